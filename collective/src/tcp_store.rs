//! A client of PyTorch's c10d `TCPStore`: the key-value store a trainer's
//! `torch.distributed` rendezvous (`tcp://host:port`) runs on its rank 0, through which
//! the other members of a process group find the NCCL unique id (docs/rl.md).
//!
//! The wire protocol is the one torch 2.11's C++ client speaks to either server (the
//! libuv one, the default, or the legacy one): every request is a command byte followed by
//! its arguments, integers little-endian (the host order of every platform torch ships
//! for), strings and byte strings as a `u64` length and the bytes:
//! - on connect, `VALIDATE` with the magic number (no answer), then `PING` with a nonce,
//!   answered by the same nonce;
//! - `SET key value` (no answer); `GET key` answers `u64 len, bytes` and is sent only
//!   after a `WAIT` for the key, as the server answers a missing key by closing;
//! - `ADD key i64` answers the new `i64`; `CHECK n keys` answers `READY` / `NOT_READY`;
//! - `WAIT n keys` answers `STOP_WAITING` once every key exists; a client that gives up
//!   sends `CANCEL_WAIT` and reads `WAIT_CANCELED` (after a `STOP_WAITING` that crossed
//!   it).
//!
//! Torch's client puts `/` before every key a user names (`store.set("k")` is `/k` on the
//! wire); this client does the same, so a key reads here as Python names it. A
//! `TCPStore` made with `world_size` also counts its members in: each adds 1 to
//! `init/` (no `/`), and the server's own client waits until the count reaches
//! `world_size` ([`StoreClient::check_in`]).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// `c10d::detail::validationMagicNumber`.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// `c10d::detail::QueryType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Query {
    Validate = 0,
    Set = 1,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    DeleteKey = 8,
    CancelWait = 12,
    Ping = 13,
}

/// `CheckResponseType::READY`, `WaitResponseType::STOP_WAITING` / `WAIT_CANCELED`.
const READY: u8 = 0;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// The key each member of a `TCPStore(world_size=…)` adds 1 to when it connects.
pub const INIT_KEY: &str = "init/";

/// The largest value this client accepts from a server: far above a NCCL id or a pickled
/// object the rendezvous exchanges, far below what would exhaust memory.
pub const MAX_VALUE_BYTES: u64 = 64 << 20;

/// How long one connection attempt may take before the next (the store's server may not
/// listen yet: a trainer often starts it after asking the rollout engine to join).
const CONNECT_RETRY: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the TCPStore address {addr:?} does not resolve: {msg}")]
    Resolve { addr: String, msg: String },

    #[error(
        "cannot reach the TCPStore at {addr} within {:.1} s (is the trainer's store running there? it listens on master_address:master_port): {last}",
        waited.as_secs_f64()
    )]
    Unreachable {
        addr: String,
        waited: Duration,
        last: String,
    },

    #[error("the TCPStore at {addr}: {what}: {source}")]
    Io {
        addr: String,
        what: String,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "the TCPStore at {addr}: {what} did not answer within {:.1} s",
        timeout.as_secs_f64()
    )]
    Timeout {
        addr: String,
        what: String,
        /// The limit that ran out.
        timeout: Duration,
    },

    #[error("the TCPStore at {addr}: {what}: {msg}")]
    Protocol {
        addr: String,
        what: String,
        msg: String,
    },
}

/// Joins `key` below the prefixes of a chain of torch `PrefixStore`s, innermost (closest
/// to the `TCPStore`) first: `PrefixStore(p, store).set(k)` sets `p + "/" + k` in `store`.
pub fn prefixed(prefixes: &[&str], key: &str) -> String {
    let mut k = key.to_string();
    for p in prefixes.iter().rev() {
        k = format!("{p}/{k}");
    }
    k
}

/// Where torch's `ProcessGroupNCCL` rank 0 sets the unique id of its `comm`th communicator
/// (0: the first, made at eager init or at the first collective), for a group made the way
/// SGLang's `init_custom_process_group` (and slime's, AReaL's and OpenRLHF's copies of it)
/// makes it: `rendezvous("tcp://…")`'s store, wrapped in `PrefixStore(group_name)` by the
/// function, `PrefixStore(group_name + "/")` by `_new_process_group_helper`, and
/// `PrefixStore(device + "/")` for the device's backend (`cuda` for NCCL); the key is
/// `ProcessGroupNCCL`'s `ncclCommCounter_`.
pub fn torch_group_id_key(group_name: &str, device: &str, comm: u64) -> String {
    prefixed(
        &[group_name, &format!("{group_name}/"), &format!("{device}/")],
        &comm.to_string(),
    )
}

/// Where vLLM's `StatelessProcessGroup.broadcast_obj` puts the `n`th object rank `src`
/// broadcasts (its store is the `TCPStore` itself, no prefix).
pub fn stateless_broadcast_key(src: usize, n: u64) -> String {
    format!("broadcast_from/{src}/{n}")
}

/// A connection to a `TCPStore` server.
pub struct StoreClient {
    stream: TcpStream,
    addr: String,
    /// How long a request waits for its answer.
    timeout: Duration,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .finish()
    }
}

impl StoreClient {
    /// Connects to the store at `host:port`, trying again until `timeout` (the server may
    /// start after this client), and validates the connection as torch's client does.
    /// Every later request waits at most `timeout` for its answer unless it says so.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self, StoreError> {
        let addr = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let t0 = Instant::now();
        let targets: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| StoreError::Resolve {
                addr: addr.clone(),
                msg: e.to_string(),
            })?
            .collect();
        if targets.is_empty() {
            return Err(StoreError::Resolve {
                addr,
                msg: "no address".into(),
            });
        }
        let mut last = String::from("no attempt");
        let stream = 'found: loop {
            for t in &targets {
                let left = timeout.saturating_sub(t0.elapsed());
                if left.is_zero() {
                    break;
                }
                match TcpStream::connect_timeout(t, left.min(Duration::from_secs(5))) {
                    Ok(s) => break 'found s,
                    Err(e) => last = format!("{t}: {e}"),
                }
            }
            if t0.elapsed() + CONNECT_RETRY >= timeout {
                return Err(StoreError::Unreachable {
                    addr,
                    waited: t0.elapsed(),
                    last,
                });
            }
            std::thread::sleep(CONNECT_RETRY);
        };
        let io = |what: &str| {
            let addr = addr.clone();
            let what = what.to_string();
            move |source| StoreError::Io { addr, what, source }
        };
        stream
            .set_nodelay(true)
            .map_err(io("setting TCP_NODELAY"))?;
        let mut c = StoreClient {
            stream,
            addr,
            timeout,
        };
        c.set_timeout(timeout)?;
        c.handshake()?;
        Ok(c)
    }

    /// The address, as errors name it.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// How long a request waits for its answer (and a write for the socket).
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<(), StoreError> {
        // A zero timeout means "block forever" to the socket: never ask for that.
        self.timeout = timeout.max(Duration::from_millis(1));
        let t = Some(self.timeout);
        self.stream
            .set_read_timeout(t)
            .and_then(|_| self.stream.set_write_timeout(t))
            .map_err(|source| StoreError::Io {
                addr: self.addr.clone(),
                what: "setting the socket timeouts".into(),
                source,
            })
    }

    fn handshake(&mut self) -> Result<(), StoreError> {
        let mut req = Request::new(Query::Validate);
        req.u32(VALIDATION_MAGIC);
        // The nonce only has to come back; the process id and the clock make a stale
        // answer on a reused connection unlikely to match.
        let nonce = std::process::id()
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
        req.cmd(Query::Ping).u32(nonce);
        self.send(&req, "validating the connection")?;
        let echo = u32::from_le_bytes(self.read_array("validating the connection (ping)")?);
        if echo != nonce {
            return Err(self.protocol(
                "validating the connection (ping)",
                format!("answered nonce {echo:#x} to {nonce:#x}: not a torch TCPStore server?"),
            ));
        }
        Ok(())
    }

    /// Counts this client in as one member of a `TCPStore(world_size=…)`, as each member's
    /// constructor does (the server's owner waits for all of them before it goes on).
    /// Returns how many have checked in so far.
    pub fn check_in(&mut self) -> Result<i64, StoreError> {
        self.add_raw(INIT_KEY, 1)
    }

    /// `store.set(key, value)`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let mut req = Request::new(Query::Set);
        req.bytes(wire_key(key).as_bytes()).bytes(value);
        self.send(&req, &format!("setting key {key:?}"))
    }

    /// `store.add(key, delta)`: the value after adding.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.add_raw(&wire_key(key), delta)
    }

    fn add_raw(&mut self, wire: &str, delta: i64) -> Result<i64, StoreError> {
        let what = format!("adding {delta} to key {wire:?}");
        let mut req = Request::new(Query::Add);
        req.bytes(wire.as_bytes()).i64(delta);
        self.send(&req, &what)?;
        Ok(i64::from_le_bytes(self.read_array(&what)?))
    }

    /// `store.delete_key(key)`: whether the key was there.
    pub fn delete(&mut self, key: &str) -> Result<bool, StoreError> {
        let what = format!("deleting key {key:?}");
        let mut req = Request::new(Query::DeleteKey);
        req.bytes(wire_key(key).as_bytes());
        self.send(&req, &what)?;
        Ok(i64::from_le_bytes(self.read_array(&what)?) > 0)
    }

    /// `store.check(keys)`: whether every key exists now.
    pub fn check(&mut self, keys: &[&str]) -> Result<bool, StoreError> {
        let what = format!("checking keys {keys:?}");
        let mut req = Request::new(Query::Check);
        req.u64(keys.len() as u64);
        for k in keys {
            req.bytes(wire_key(k).as_bytes());
        }
        self.send(&req, &what)?;
        let [r] = self.read_array::<1>(&what)?;
        Ok(r == READY)
    }

    /// `store.wait(keys, timeout)`: returns once every key exists, or fails with
    /// [`StoreError::Timeout`] after `timeout` (the wait is withdrawn, the connection
    /// stays usable).
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let what = format!("waiting for key(s) {keys:?}");
        let mut req = Request::new(Query::Wait);
        req.u64(keys.len() as u64);
        for k in keys {
            req.bytes(wire_key(k).as_bytes());
        }
        self.send(&req, &what)?;
        let mut b = [0u8; 1];
        self.stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(|source| self.io(&what, source))?;
        let r = self.stream.read_exact(&mut b);
        // Later requests wait as long as the client was made to.
        let restore = |c: &mut Self| {
            c.stream
                .set_read_timeout(Some(c.timeout))
                .map_err(|source| c.io(&what, source))
        };
        match r {
            Ok(()) => {
                restore(self)?;
                if b[0] != STOP_WAITING {
                    return Err(self.protocol(&what, format!("answered {} to a wait", b[0])));
                }
                Ok(())
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                restore(self)?;
                self.cancel_wait(&what)?;
                Err(StoreError::Timeout {
                    addr: self.addr.clone(),
                    what,
                    timeout,
                })
            }
            Err(e) => Err(self.io(&what, e)),
        }
    }

    /// Withdraws a wait that timed out, as torch's client does: the server answers
    /// `WAIT_CANCELED`, after a `STOP_WAITING` if the keys came meanwhile.
    fn cancel_wait(&mut self, what: &str) -> Result<(), StoreError> {
        let what = format!("{what}: withdrawing the wait");
        self.send(&Request::new(Query::CancelWait), &what)?;
        let [mut r] = self.read_array::<1>(&what)?;
        if r == STOP_WAITING {
            [r] = self.read_array::<1>(&what)?;
        }
        if r != WAIT_CANCELED {
            return Err(self.protocol(&what, format!("answered {r} to the cancel")));
        }
        Ok(())
    }

    /// `store.get(key)` with the wait bounded by `timeout` (torch's waits the store's
    /// timeout): the value once the key exists.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key], timeout)?;
        let what = format!("getting key {key:?}");
        let mut req = Request::new(Query::Get);
        req.bytes(wire_key(key).as_bytes());
        self.send(&req, &what)?;
        let len = u64::from_le_bytes(self.read_array(&what)?);
        if len > MAX_VALUE_BYTES {
            return Err(self.protocol(
                &what,
                format!(
                    "a value of {len} bytes, more than the {MAX_VALUE_BYTES} this client takes"
                ),
            ));
        }
        let mut v = vec![0u8; len as usize];
        self.read_exact(&mut v, &what)?;
        Ok(v)
    }

    fn send(&mut self, req: &Request, what: &str) -> Result<(), StoreError> {
        self.stream
            .write_all(&req.buf)
            .map_err(|source| self.io(what, source))
    }

    fn read_array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], StoreError> {
        let mut b = [0u8; N];
        self.read_exact(&mut b, what)?;
        Ok(b)
    }

    fn read_exact(&mut self, b: &mut [u8], what: &str) -> Result<(), StoreError> {
        self.stream.read_exact(b).map_err(|e| {
            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                StoreError::Timeout {
                    addr: self.addr.clone(),
                    what: what.to_string(),
                    timeout: self.timeout,
                }
            } else if e.kind() == ErrorKind::UnexpectedEof {
                self.protocol(what, "the server closed the connection".into())
            } else {
                self.io(what, e)
            }
        })
    }

    fn io(&self, what: &str, source: std::io::Error) -> StoreError {
        StoreError::Io {
            addr: self.addr.clone(),
            what: what.to_string(),
            source,
        }
    }

    fn protocol(&self, what: &str, msg: String) -> StoreError {
        StoreError::Protocol {
            addr: self.addr.clone(),
            what: what.to_string(),
            msg,
        }
    }
}

/// The key on the wire for a key a user names.
fn wire_key(key: &str) -> String {
    format!("/{key}")
}

/// One or more commands, sent in one write.
struct Request {
    buf: Vec<u8>,
}

impl Request {
    fn new(q: Query) -> Self {
        Request { buf: vec![q as u8] }
    }

    fn cmd(&mut self, q: Query) -> &mut Self {
        self.buf.push(q as u8);
        self
    }

    fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u64(b.len() as u64);
        self.buf.extend_from_slice(b);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};

    /// What the fake server does with a connection.
    #[derive(Clone, Copy, PartialEq)]
    enum Fake {
        /// Speaks the protocol over a shared map.
        Store,
        /// Accepts and never answers.
        Silent,
        /// Answers the ping with another nonce.
        WrongNonce,
        /// Answers a GET with a length above the limit.
        HugeValue,
    }

    type Map = Arc<Mutex<HashMap<Vec<u8>, Vec<u8>>>>;

    fn read_n<const N: usize>(s: &mut TcpStream) -> Option<[u8; N]> {
        let mut b = [0u8; N];
        s.read_exact(&mut b).ok().map(|_| b)
    }

    fn read_str(s: &mut TcpStream) -> Option<Vec<u8>> {
        let n = u64::from_le_bytes(read_n(s)?) as usize;
        let mut v = vec![0u8; n];
        s.read_exact(&mut v).ok()?;
        Some(v)
    }

    fn read_keys(s: &mut TcpStream) -> Option<Vec<Vec<u8>>> {
        let n = u64::from_le_bytes(read_n(s)?);
        (0..n).map(|_| read_str(s)).collect()
    }

    /// Serves one connection the way torch's server does (the subset this client uses).
    fn serve(mut s: TcpStream, map: Map, mode: Fake) -> Option<()> {
        let [q] = read_n::<1>(&mut s)?;
        assert_eq!(q, Query::Validate as u8, "the first command validates");
        assert_eq!(u32::from_le_bytes(read_n(&mut s)?), VALIDATION_MAGIC);
        if mode == Fake::Silent {
            std::thread::sleep(Duration::from_secs(3));
            return None;
        }
        loop {
            let [q] = read_n::<1>(&mut s)?;
            match q {
                13 => {
                    let mut nonce = u32::from_le_bytes(read_n(&mut s)?);
                    if mode == Fake::WrongNonce {
                        nonce ^= 1;
                    }
                    s.write_all(&nonce.to_le_bytes()).ok()?;
                }
                1 => {
                    let k = read_str(&mut s)?;
                    let v = read_str(&mut s)?;
                    map.lock().unwrap().insert(k, v);
                }
                3 => {
                    let k = read_str(&mut s)?;
                    if mode == Fake::HugeValue {
                        s.write_all(&(MAX_VALUE_BYTES + 1).to_le_bytes()).ok()?;
                        continue;
                    }
                    let v = map.lock().unwrap().get(&k).cloned()?;
                    s.write_all(&(v.len() as u64).to_le_bytes()).ok()?;
                    s.write_all(&v).ok()?;
                }
                4 => {
                    let k = read_str(&mut s)?;
                    let d = i64::from_le_bytes(read_n(&mut s)?);
                    let mut m = map.lock().unwrap();
                    let old: i64 = m
                        .get(&k)
                        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
                        .unwrap_or(0);
                    m.insert(k, (old + d).to_string().into_bytes());
                    s.write_all(&(old + d).to_le_bytes()).ok()?;
                }
                5 => {
                    let keys = read_keys(&mut s)?;
                    let m = map.lock().unwrap();
                    let all = keys.iter().all(|k| m.contains_key(k));
                    s.write_all(&[if all { READY } else { 1 }]).ok()?;
                }
                6 => {
                    let keys = read_keys(&mut s)?;
                    // Polls the map; a CANCEL_WAIT from the client ends the wait.
                    s.set_nonblocking(true).ok()?;
                    loop {
                        if keys.iter().all(|k| map.lock().unwrap().contains_key(k)) {
                            s.set_nonblocking(false).ok()?;
                            s.write_all(&[STOP_WAITING]).ok()?;
                            break;
                        }
                        let mut b = [0u8; 1];
                        match s.read(&mut b) {
                            Ok(1) => {
                                assert_eq!(b[0], Query::CancelWait as u8);
                                s.set_nonblocking(false).ok()?;
                                s.write_all(&[WAIT_CANCELED]).ok()?;
                                break;
                            }
                            Ok(_) => return None,
                            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                                std::thread::sleep(Duration::from_millis(5))
                            }
                            Err(_) => return None,
                        }
                    }
                }
                other => panic!("unexpected command {other}"),
            }
        }
    }

    fn fake(mode: Fake) -> (u16, Map) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let map: Map = Arc::default();
        let m = map.clone();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let m = m.clone();
                std::thread::spawn(move || serve(s, m, mode));
            }
        });
        (port, map)
    }

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn set_get_add_check_and_wait_as_torch_names_them() {
        let (port, map) = fake(Fake::Store);
        let mut a = StoreClient::connect("127.0.0.1", port, T).unwrap();
        let mut b = StoreClient::connect("localhost", port, T).unwrap();
        assert_eq!(a.check_in().unwrap(), 1);
        assert_eq!(b.check_in().unwrap(), 2);
        assert_eq!(map.lock().unwrap()[&b"init/".to_vec()], b"2");
        a.set("k", b"value").unwrap();
        // A set has no answer: a request that has one, on the same connection, comes after.
        assert!(a.check(&["k"]).unwrap());
        // Torch's client puts "/" before the user's key.
        assert_eq!(map.lock().unwrap()[&b"/k".to_vec()], b"value");
        assert_eq!(b.get("k", T).unwrap(), b"value");
        assert!(b.check(&["k"]).unwrap());
        assert!(!b.check(&["k", "other"]).unwrap());
        assert_eq!(a.add("n", 5).unwrap(), 5);
        assert_eq!(b.add("n", -2).unwrap(), 3);
        // A get waits for a key another client sets later.
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            a.set("late", &[7u8; 128]).unwrap();
            a
        });
        assert_eq!(b.get("late", T).unwrap(), vec![7u8; 128]);
        t.join().unwrap();
    }

    #[test]
    fn a_key_that_never_comes_times_out_and_the_connection_still_works() {
        let (port, _) = fake(Fake::Store);
        let mut c = StoreClient::connect("127.0.0.1", port, T).unwrap();
        let t0 = Instant::now();
        let e = c.get("never", Duration::from_millis(300)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        let msg = e.to_string();
        assert!(matches!(e, StoreError::Timeout { .. }), "{msg}");
        assert!(
            msg.contains("\"never\"") && msg.contains(&format!("127.0.0.1:{port}")),
            "{msg}"
        );
        c.set("after", b"x").unwrap();
        assert_eq!(c.get("after", T).unwrap(), b"x");
    }

    #[test]
    fn nobody_listening_is_an_error_naming_the_address_after_the_timeout() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let t0 = Instant::now();
        let e = StoreClient::connect("127.0.0.1", port, Duration::from_millis(500)).unwrap_err();
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_millis(350) && waited < Duration::from_secs(3),
            "{waited:?}"
        );
        let msg = e.to_string();
        assert!(matches!(e, StoreError::Unreachable { .. }), "{msg}");
        assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
        let e = StoreClient::connect("no-such-host.invalid", 1, Duration::from_millis(200))
            .unwrap_err();
        assert!(e.to_string().contains("no-such-host.invalid"), "{e}");
    }

    #[test]
    fn a_server_that_does_not_speak_the_protocol_is_refused() {
        let (port, _) = fake(Fake::Silent);
        let e = StoreClient::connect("127.0.0.1", port, Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, StoreError::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("ping"), "{e}");
        let (port, _) = fake(Fake::WrongNonce);
        let e = StoreClient::connect("127.0.0.1", port, T).unwrap_err();
        assert!(e.to_string().contains("nonce"), "{e}");
        let (port, _) = fake(Fake::HugeValue);
        let mut c = StoreClient::connect("127.0.0.1", port, T).unwrap();
        c.set("k", b"v").unwrap();
        let e = c.get("k", T).unwrap_err();
        assert!(
            e.to_string().contains("\"k\"") && e.to_string().contains("bytes"),
            "{e}"
        );
    }

    #[test]
    fn prefix_store_chains_join_with_slashes() {
        // PrefixStore("cuda/", PrefixStore("g/", PrefixStore("g", store))).set("0").
        assert_eq!(prefixed(&["g", "g/", "cuda/"], "0"), "g/g//cuda//0");
        assert_eq!(prefixed(&[], "k"), "k");
        assert_eq!(
            torch_group_id_key("slime-pp_0", "cuda", 0),
            "slime-pp_0/slime-pp_0//cuda//0"
        );
        assert_eq!(stateless_broadcast_key(0, 0), "broadcast_from/0/0");
    }
}
