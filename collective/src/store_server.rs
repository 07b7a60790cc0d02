//! A server of PyTorch's c10d `TCPStore` protocol (the one [`crate::tcp_store`] speaks
//! as a client), for a group whose store arbor must run: vLLM's `StatelessProcessGroup`
//! runs its store on its rank 0, and when the trainer takes the last rank (TRL's vLLM
//! client), rank 0 is an arbor rank.
//!
//! It answers what torch 2.11's C++ client sends (the legacy server's behaviour):
//! `VALIDATE` (a wrong magic closes the connection), `PING`, `SET`, `COMPARE_SET`, `GET`
//! (of a missing key: the connection closes, as torch's server closes it), `ADD`,
//! `CHECK`, `WAIT` / `CANCEL_WAIT`, `GETNUMKEYS`, `DELETE_KEY`, `APPEND`, `MULTI_GET`,
//! `MULTI_SET`. The queue commands close the connection. One thread per connection; a
//! wait is answered when another connection sets its keys.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::tcp_store::MAX_VALUE_BYTES;

/// `c10d::detail::validationMagicNumber`.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// How often idle threads look whether the server was dropped.
const TICK: Duration = Duration::from_millis(20);

/// The most keys one request may name.
const MAX_KEYS: u64 = 1 << 16;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen for the TCPStore at {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    /// Notified on every change: waits look again.
    changed: Condvar,
    stop: AtomicBool,
}

/// A running store; dropping it closes the listener and every connection.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl StoreServer {
    /// Listens on `host:port` (port 0 picks a free one).
    pub fn bind(host: &str, port: u16) -> Result<Self, ServerError> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let shown = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let bind_err = |source| ServerError::Bind {
            addr: shown.clone(),
            source,
        };
        let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs().map_err(bind_err)?.collect();
        let listener = TcpListener::bind(&addrs[..]).map_err(bind_err)?;
        let addr = listener.local_addr().map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("tcp-store-accept".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(bind_err)?;
        Ok(StoreServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The number of keys held (tests, logs).
    pub fn len(&self) -> usize {
        self.shared.map.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.changed.notify_all();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let s = shared.clone();
                let spawned = std::thread::Builder::new()
                    .name("tcp-store-conn".into())
                    .spawn(move || {
                        if let Err(why) = serve(stream, &s) {
                            tracing::debug!(%peer, "TCPStore connection closed: {why}");
                        }
                    });
                if let Err(e) = spawned {
                    tracing::warn!("no thread for a TCPStore connection from {peer}: {e}");
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(TICK),
            Err(e) => {
                tracing::warn!("accepting a TCPStore connection: {e}");
                std::thread::sleep(TICK);
            }
        }
    }
}

/// One connection's reads: each retries on the socket's timeout until the server stops.
struct Conn<'a> {
    s: TcpStream,
    shared: &'a Shared,
}

impl Conn<'_> {
    fn read_exact(&mut self, b: &mut [u8]) -> Result<(), String> {
        let mut at = 0;
        while at < b.len() {
            if self.shared.stop.load(Ordering::Relaxed) {
                return Err("the server stopped".into());
            }
            match self.s.read(&mut b[at..]) {
                Ok(0) => return Err("the client closed the connection".into()),
                Ok(n) => at += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    }

    fn u8(&mut self) -> Result<u8, String> {
        let mut b = [0u8; 1];
        self.read_exact(&mut b)?;
        Ok(b[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        let mut b = [0u8; 4];
        self.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn bytes(&mut self) -> Result<Vec<u8>, String> {
        let n = self.u64()?;
        if n > MAX_VALUE_BYTES {
            return Err(format!("a value of {n} bytes, more than {MAX_VALUE_BYTES}"));
        }
        let mut v = vec![0u8; n as usize];
        self.read_exact(&mut v)?;
        Ok(v)
    }

    fn keys(&mut self) -> Result<Vec<Vec<u8>>, String> {
        let n = self.u64()?;
        if n > MAX_KEYS {
            return Err(format!("{n} keys in one request, more than {MAX_KEYS}"));
        }
        (0..n).map(|_| self.bytes()).collect()
    }

    fn send(&mut self, b: &[u8]) -> Result<(), String> {
        self.s.write_all(b).map_err(|e| e.to_string())
    }

    fn send_value(&mut self, v: &[u8]) -> Result<(), String> {
        let mut out = Vec::with_capacity(8 + v.len());
        out.extend_from_slice(&(v.len() as u64).to_le_bytes());
        out.extend_from_slice(v);
        self.send(&out)
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<u8>, Vec<u8>>> {
        // A connection thread that panicked holding the lock left the map whole (every
        // change is one insert or remove).
        self.shared
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn changed(&self) {
        self.shared.changed.notify_all();
    }

    /// A `WAIT`: answered once every key exists, or withdrawn by a `CANCEL_WAIT`.
    fn wait(&mut self, keys: &[Vec<u8>]) -> Result<(), String> {
        loop {
            {
                let m = self.map();
                if keys.iter().all(|k| m.contains_key(k)) {
                    drop(m);
                    return self.send(&[STOP_WAITING]);
                }
                let _ = self
                    .shared
                    .changed
                    .wait_timeout(m, TICK)
                    .map_err(|_| "the store's lock was poisoned".to_string())?;
            }
            if self.shared.stop.load(Ordering::Relaxed) {
                return Err("the server stopped".into());
            }
            // The only request a client sends while it waits is the cancel.
            self.s.set_nonblocking(true).map_err(|e| e.to_string())?;
            let mut b = [0u8; 1];
            let r = self.s.read(&mut b);
            self.s.set_nonblocking(false).map_err(|e| e.to_string())?;
            match r {
                Ok(0) => return Err("the client closed the connection while waiting".into()),
                Ok(_) if b[0] == CANCEL_WAIT => return self.send(&[WAIT_CANCELED]),
                Ok(_) => return Err(format!("command {} while a wait was pending", b[0])),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

const SET: u8 = 1;
const COMPARE_SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const GETNUMKEYS: u8 = 7;
const DELETE_KEY: u8 = 8;
const APPEND: u8 = 9;
const MULTI_GET: u8 = 10;
const MULTI_SET: u8 = 11;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
const READY: u8 = 0;
const NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

fn serve(stream: TcpStream, shared: &Shared) -> Result<(), String> {
    stream
        .set_read_timeout(Some(TICK * 5))
        .map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let mut c = Conn { s: stream, shared };
    if c.u8()? != 0 {
        return Err("the first command was not VALIDATE".into());
    }
    let magic = c.u32()?;
    if magic != VALIDATION_MAGIC {
        return Err(format!(
            "validation magic {magic:#x}: not a torch TCPStore client"
        ));
    }
    loop {
        let q = c.u8()?;
        match q {
            PING => {
                let nonce = c.u32()?;
                c.send(&nonce.to_le_bytes())?;
            }
            SET => {
                let (k, v) = (c.bytes()?, c.bytes()?);
                c.map().insert(k, v);
                c.changed();
            }
            COMPARE_SET => {
                let (k, expected, desired) = (c.bytes()?, c.bytes()?, c.bytes()?);
                let out = {
                    let mut m = c.map();
                    match m.get(&k) {
                        None if expected.is_empty() => {
                            m.insert(k, desired.clone());
                            desired
                        }
                        None => expected,
                        Some(cur) if *cur == expected => {
                            m.insert(k, desired.clone());
                            desired
                        }
                        Some(cur) => cur.clone(),
                    }
                };
                c.changed();
                c.send_value(&out)?;
            }
            GET => {
                let k = c.bytes()?;
                let v = c.map().get(&k).cloned();
                match v {
                    Some(v) => c.send_value(&v)?,
                    None => {
                        return Err(format!(
                            "GET of the missing key {:?}",
                            String::from_utf8_lossy(&k)
                        ))
                    }
                }
            }
            ADD => {
                let k = c.bytes()?;
                let mut d = [0u8; 8];
                c.read_exact(&mut d)?;
                let delta = i64::from_le_bytes(d);
                let now = {
                    let mut m = c.map();
                    let old = match m.get(&k) {
                        None => 0,
                        Some(v) => std::str::from_utf8(v)
                            .ok()
                            .and_then(|s| s.parse::<i64>().ok())
                            .ok_or_else(|| {
                                format!(
                                    "ADD to key {:?}, which holds no number",
                                    String::from_utf8_lossy(&k)
                                )
                            })?,
                    };
                    let now = old.wrapping_add(delta);
                    m.insert(k, now.to_string().into_bytes());
                    now
                };
                c.changed();
                c.send(&now.to_le_bytes())?;
            }
            CHECK => {
                let keys = c.keys()?;
                let all = {
                    let m = c.map();
                    keys.iter().all(|k| m.contains_key(k))
                };
                c.send(&[if all { READY } else { NOT_READY }])?;
            }
            WAIT => {
                let keys = c.keys()?;
                c.wait(&keys)?;
            }
            CANCEL_WAIT => c.send(&[WAIT_CANCELED])?,
            GETNUMKEYS => {
                let n = c.map().len() as i64;
                c.send(&n.to_le_bytes())?;
            }
            DELETE_KEY => {
                let k = c.bytes()?;
                let n = i64::from(c.map().remove(&k).is_some());
                c.changed();
                c.send(&n.to_le_bytes())?;
            }
            APPEND => {
                let (k, v) = (c.bytes()?, c.bytes()?);
                c.map().entry(k).or_default().extend_from_slice(&v);
                c.changed();
            }
            MULTI_GET => {
                let keys = c.keys()?;
                let vals: Option<Vec<Vec<u8>>> = {
                    let m = c.map();
                    keys.iter().map(|k| m.get(k).cloned()).collect()
                };
                let vals = vals.ok_or("MULTI_GET of a missing key")?;
                for v in vals {
                    c.send_value(&v)?;
                }
            }
            MULTI_SET => {
                let n = c.u64()?;
                if n > MAX_KEYS {
                    return Err(format!("{n} keys in one request, more than {MAX_KEYS}"));
                }
                let mut kv = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    kv.push((c.bytes()?, c.bytes()?));
                }
                c.map().extend(kv);
                c.changed();
            }
            other => return Err(format!("command {other} is not served")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp_store::StoreClient;
    use std::time::Instant;

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn arbors_client_against_the_server() {
        let s = StoreServer::bind("127.0.0.1", 0).unwrap();
        let port = s.local_addr().port();
        let mut a = StoreClient::connect("127.0.0.1", port, T).unwrap();
        let mut b = StoreClient::connect("127.0.0.1", port, T).unwrap();
        assert_eq!(a.check_in().unwrap(), 1);
        assert_eq!(b.check_in().unwrap(), 2);
        a.set("k", b"v").unwrap();
        // A set has no answer: a request with one, on the same connection, comes after it.
        assert!(a.check(&["k"]).unwrap());
        assert!(b.check(&["k"]).unwrap());
        assert!(!b.check(&["k", "x"]).unwrap());
        assert_eq!(b.get("k", T).unwrap(), b"v");
        assert_eq!(a.add("n", 5).unwrap(), 5);
        assert_eq!(b.add("n", -7).unwrap(), -2);
        // A wait answered by another connection's set.
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            a.set("late", b"x").unwrap();
            a
        });
        let t0 = Instant::now();
        assert_eq!(b.get("late", T).unwrap(), b"x");
        assert!(t0.elapsed() >= Duration::from_millis(100));
        let mut a = t.join().unwrap();
        // A wait that times out is withdrawn; the connection still serves.
        let e = b.get("never", Duration::from_millis(100)).unwrap_err();
        assert!(e.to_string().contains("never"), "{e}");
        assert_eq!(b.get("k", T).unwrap(), b"v");
        assert!(a.delete("k").unwrap());
        assert!(!a.delete("k").unwrap());
        assert!(!b.check(&["k"]).unwrap());
        drop(s);
        // Dropped: the listener is gone.
        assert!(StoreClient::connect("127.0.0.1", port, Duration::from_millis(300)).is_err());
    }
}
