//! The TCP transport: one process per rank, a full mesh of sockets (fine up to 8 ranks).
//!
//! Setup, in [`TcpComm::connect`]:
//! 1. Rank 0 listens on MASTER_PORT on every interface (`0.0.0.0`, or `[::]` when
//!    MASTER_ADDR is IPv6) and serves the rendezvous.
//! 2. Every other rank opens a data listener on an ephemeral port, connects to
//!    MASTER_ADDR:MASTER_PORT (retrying until rank 0 is up) and sends a `Hello` (rank,
//!    world size, data port).
//! 3. When all have arrived, rank 0 answers each with a `Welcome`: the session id and every
//!    rank's data address, made of the IP rank 0 saw the rank connect from (an address
//!    that demonstrably routes, never a guessed 127.0.0.1) and its data port. The
//!    rendezvous connection itself stays as the link between rank 0 and that rank.
//! 4. Rank j connects to every rank 0 < i < j and introduces itself with a `MeshHello`;
//!    then a barrier over the whole mesh confirms every link.
//!
//! Every wait has a deadline (ARBOR_TIMEOUT_SECS). On any failure rank 0 sends an `Abort`
//! with the reason to every rank that arrived, so all of them fail with the same message.
//! After setup each link has a reader thread that drains frames into a channel, so sends
//! never deadlock; collective operations time out after ARBOR_OP_TIMEOUT_SECS.

use std::io;
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam::channel::{unbounded, Receiver, Sender};

use crate::engine::{engine_communicator, Engine, Incoming, OpKind, Outbox};
use crate::env::{RankInfo, Timeouts};
use crate::wire::{self, Frame, Hello, Kind, MeshHello, ReadError, Welcome};
use crate::CommError;

/// How often a waiting accept loop looks for new connections.
const POLL: Duration = Duration::from_millis(5);

/// One rank of a TCP group.
pub struct TcpComm {
    engine: Engine<TcpOutbox>,
    /// The links, kept to shut them down on drop (which ends the reader threads).
    streams: Vec<Option<TcpStream>>,
}

impl TcpComm {
    /// Joins (rank > 0) or serves (rank 0) the rendezvous at `info.master_addr:master_port`
    /// and opens the mesh.
    pub fn connect(info: &RankInfo, timeouts: Timeouts) -> Result<TcpComm, CommError> {
        let target = format!("{}:{}", info.master_addr, info.master_port);
        if info.rank == 0 {
            let master = resolve(0, &info.master_addr, info.master_port)?;
            let any = match master.first().map(SocketAddr::ip) {
                Some(IpAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            };
            let bind = SocketAddr::new(any, info.master_port);
            let listener = TcpListener::bind(bind).map_err(|e| CommError::Io {
                rank: 0,
                context: format!(
                    "binding the rendezvous port {bind} (MASTER_PORT; is another group using it?)"
                ),
                source: e,
            })?;
            Self::serve(listener, info.world_size, timeouts)
        } else {
            Self::join(info.rank, info.world_size, &target, timeouts)
        }
    }

    /// Rank 0: serves the rendezvous on `listener` until `world - 1` ranks have arrived.
    pub fn serve(
        listener: TcpListener,
        world: usize,
        timeouts: Timeouts,
    ) -> Result<TcpComm, CommError> {
        let deadline = Instant::now() + timeouts.rendezvous;
        let here = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let io_err = |context: &str, e: io::Error| CommError::Io {
            rank: 0,
            context: format!("{context} on the rendezvous port {here}"),
            source: e,
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("setting up", e))?;
        let (tx, rx) = unbounded::<(TcpStream, SocketAddr, Result<Frame, ReadError>)>();
        let mut arrived: Vec<Option<(TcpStream, Hello, SocketAddr)>> =
            (0..world).map(|_| None).collect();
        let mut count = 1;
        tracing::debug!(%here, world, "rank 0: serving the rendezvous");
        while count < world {
            loop {
                match listener.accept() {
                    Ok((stream, addr)) => spawn_handshake(stream, addr, deadline, tx.clone()),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        let err = io_err("accepting", e);
                        abort_all(&mut arrived, &err);
                        return Err(err);
                    }
                }
            }
            if let Ok((mut stream, addr, res)) = rx.recv_timeout(POLL) {
                match check_hello(res, addr, world, &arrived) {
                    Ok(Some((r, hello))) => {
                        tracing::debug!(rank = r, %addr, host = %hello.host, "rank arrived");
                        arrived[r] = Some((stream, hello, addr));
                        count += 1;
                    }
                    // A connection that said nothing before the deadline: the timeout below
                    // reports the ranks that are missing.
                    Ok(None) => {}
                    Err(err) => {
                        let _ = wire::write_frame(
                            &mut stream,
                            Kind::Abort,
                            0,
                            0,
                            0,
                            err.to_string().as_bytes(),
                        );
                        abort_all(&mut arrived, &err);
                        return Err(err);
                    }
                }
            }
            if count < world && Instant::now() >= deadline {
                let missing: Vec<usize> = (1..world).filter(|&r| arrived[r].is_none()).collect();
                let err = CommError::RendezvousTimeout {
                    rank: 0,
                    addr: here.clone(),
                    timeout: timeouts.rendezvous,
                    missing,
                };
                abort_all(&mut arrived, &err);
                return Err(err);
            }
        }
        let session = session_id();
        let peers: Vec<String> = arrived
            .iter()
            .map(|a| match a {
                Some((_, hello, addr)) => SocketAddr::new(addr.ip(), hello.data_port).to_string(),
                None => String::new(),
            })
            .collect();
        let welcome = Welcome { session, peers };
        let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for r in 1..world {
            let Some((mut stream, _, _)) = arrived[r].take() else {
                continue;
            };
            if let Err(e) = wire::write_msg(&mut stream, Kind::Welcome, 0, &welcome) {
                let err = CommError::PeerDisconnected {
                    rank: 0,
                    peer: r,
                    context: format!("before it got the rendezvous welcome ({e})"),
                };
                abort_all(&mut arrived, &err);
                abort_links(&mut links, 0, &err);
                return Err(err);
            }
            links[r] = Some(stream);
        }
        Self::finish(0, world, links, timeouts)
    }

    /// Rank > 0: joins the rendezvous at `master` ("host:port") and opens the mesh.
    pub fn join(
        rank: usize,
        world: usize,
        master: &str,
        timeouts: Timeouts,
    ) -> Result<TcpComm, CommError> {
        if rank == 0 || rank >= world {
            return Err(CommError::InvalidArgument {
                rank,
                detail: format!("join needs 0 < rank < world size {world}"),
            });
        }
        let deadline = Instant::now() + timeouts.rendezvous;
        let (host, port) = split_host_port(rank, master)?;
        let addrs = resolve(rank, host, port)?;
        let mut stream = connect_until(rank, &addrs, master, deadline, timeouts.rendezvous)?;
        let io_err = |context: String, e: io::Error| CommError::Io {
            rank,
            context,
            source: e,
        };
        let local_ip = stream
            .local_addr()
            .map_err(|e| io_err(format!("reading the local address toward {master}"), e))?
            .ip();
        let any = match local_ip {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let listener = TcpListener::bind(SocketAddr::new(any, 0))
            .map_err(|e| io_err("opening the data listener".into(), e))?;
        let data_port = listener
            .local_addr()
            .map_err(|e| io_err("reading the data listener's port".into(), e))?
            .port();
        let hello = Hello {
            world_size: world as u32,
            data_port,
            host: host_name(),
        };
        wire::write_msg(&mut stream, Kind::Hello, rank, &hello).map_err(|e| {
            CommError::PeerDisconnected {
                rank,
                peer: 0,
                context: format!("while this rank introduced itself at {master} ({e})"),
            }
        })?;
        // Rank 0 is alive and enforces its own deadline (which began before ours could);
        // wait a little longer so that its abort message, naming the missing ranks, arrives.
        let welcome_wait = timeouts.rendezvous + Duration::from_secs(5);
        stream
            .set_read_timeout(Some(welcome_wait))
            .map_err(|e| io_err("setting a read timeout".into(), e))?;
        let peer0 = format!("rank 0 at {master}");
        let frame = wire::read_frame(&mut stream, wire::MAX_CONTROL_LEN).map_err(|e| match e {
            ReadError::TimedOut => CommError::OpTimeout {
                rank,
                op: "rendezvous (waiting for rank 0's welcome)".into(),
                timeout: welcome_wait,
                missing: vec![0],
            },
            e => read_error(rank, 0, &peer0, e, "during the rendezvous"),
        })?;
        let welcome: Welcome = match frame.kind {
            Kind::Welcome => wire::decode_msg(&frame).map_err(|detail| CommError::Protocol {
                rank,
                peer: peer0.clone(),
                detail,
            })?,
            Kind::Abort => {
                return Err(CommError::PeerAborted {
                    rank,
                    peer: 0,
                    reason: String::from_utf8_lossy(&frame.payload).into_owned(),
                })
            }
            k => {
                return Err(CommError::Protocol {
                    rank,
                    peer: peer0,
                    detail: format!("expected a welcome, got a {k:?} frame"),
                })
            }
        };
        if welcome.peers.len() != world {
            return Err(CommError::Protocol {
                rank,
                peer: peer0,
                detail: format!(
                    "welcome lists {} ranks, the world size is {world}",
                    welcome.peers.len()
                ),
            });
        }
        let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        links[0] = Some(stream);
        let mesh = Self::open_mesh(
            rank, world, &welcome, &listener, &mut links, deadline, timeouts,
        );
        if let Err(err) = mesh {
            abort_links(&mut links, rank, &err);
            return Err(err);
        }
        Self::finish(rank, world, links, timeouts)
    }

    /// Connects to ranks 1..rank, accepts ranks rank+1..world.
    fn open_mesh(
        rank: usize,
        world: usize,
        welcome: &Welcome,
        listener: &TcpListener,
        links: &mut [Option<TcpStream>],
        deadline: Instant,
        timeouts: Timeouts,
    ) -> Result<(), CommError> {
        for (i, addr) in welcome.peers.iter().enumerate().take(rank).skip(1) {
            let target: SocketAddr = addr.parse().map_err(|_| CommError::Protocol {
                rank,
                peer: "rank 0".into(),
                detail: format!("welcome gives rank {i} the address {addr:?}"),
            })?;
            let mut s = connect_until(
                rank,
                &[target],
                &format!("rank {i} at {addr}"),
                deadline,
                timeouts.rendezvous,
            )?;
            wire::write_msg(
                &mut s,
                Kind::MeshHello,
                rank,
                &MeshHello {
                    session: welcome.session,
                },
            )
            .map_err(|e| CommError::PeerDisconnected {
                rank,
                peer: i,
                context: format!("while opening the link to {addr} ({e})"),
            })?;
            links[i] = Some(s);
        }
        let here = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let io_err = |e: io::Error| CommError::Io {
            rank,
            context: format!("accepting links on {here}"),
            source: e,
        };
        listener.set_nonblocking(true).map_err(io_err)?;
        let mut waiting = world - rank - 1;
        while waiting > 0 {
            match listener.accept() {
                Ok((mut s, addr)) => {
                    let peer = format!("connection from {addr}");
                    let remaining = deadline.saturating_duration_since(Instant::now()).max(POLL);
                    s.set_nonblocking(false).map_err(io_err)?;
                    s.set_read_timeout(Some(remaining)).map_err(io_err)?;
                    let frame = match wire::read_frame(&mut s, wire::MAX_CONTROL_LEN) {
                        Ok(f) => f,
                        Err(ReadError::TimedOut) => continue,
                        Err(e) => {
                            return Err(read_error(
                                rank,
                                usize::MAX,
                                &peer,
                                e,
                                "while opening the mesh",
                            ))
                        }
                    };
                    let j = frame.rank;
                    let hello: MeshHello = if frame.kind == Kind::MeshHello {
                        wire::decode_msg(&frame).map_err(|detail| CommError::Protocol {
                            rank,
                            peer: peer.clone(),
                            detail,
                        })?
                    } else {
                        return Err(CommError::Protocol {
                            rank,
                            peer,
                            detail: format!("expected a mesh hello, got a {:?} frame", frame.kind),
                        });
                    };
                    if hello.session != welcome.session {
                        return Err(CommError::Protocol {
                            rank,
                            peer,
                            detail: "belongs to another arbor group (session id differs)".into(),
                        });
                    }
                    if j <= rank || j >= world || links[j].is_some() {
                        return Err(CommError::Protocol {
                            rank,
                            peer,
                            detail: format!(
                                "claims rank {j}, which may not connect here (world {world})"
                            ),
                        });
                    }
                    links[j] = Some(s);
                    waiting -= 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> =
                            (rank + 1..world).filter(|&j| links[j].is_none()).collect();
                        return Err(CommError::RendezvousTimeout {
                            rank,
                            addr: here,
                            timeout: timeouts.rendezvous,
                            missing,
                        });
                    }
                    thread::sleep(POLL);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(e)),
            }
        }
        Ok(())
    }

    /// Starts the reader threads and confirms the mesh with a barrier.
    fn finish(
        rank: usize,
        world: usize,
        links: Vec<Option<TcpStream>>,
        timeouts: Timeouts,
    ) -> Result<TcpComm, CommError> {
        let mut writers: Vec<Option<Mutex<TcpStream>>> = (0..world).map(|_| None).collect();
        let mut inbox: Vec<Option<Receiver<Incoming>>> = (0..world).map(|_| None).collect();
        for (peer, link) in links.iter().enumerate() {
            let Some(s) = link else { continue };
            let io_err = |e: io::Error| CommError::Io {
                rank,
                context: format!("setting up the link to rank {peer}"),
                source: e,
            };
            s.set_nodelay(true).map_err(io_err)?;
            s.set_nonblocking(false).map_err(io_err)?;
            s.set_read_timeout(None).map_err(io_err)?;
            s.set_write_timeout(Some(timeouts.op)).map_err(io_err)?;
            writers[peer] = Some(Mutex::new(s.try_clone().map_err(io_err)?));
            let reader = s.try_clone().map_err(io_err)?;
            let (tx, rx) = unbounded();
            thread::Builder::new()
                .name(format!("arbor-rx-{peer}"))
                .spawn(move || read_loop(rank, peer, reader, tx))
                .map_err(|e| CommError::Io {
                    rank,
                    context: format!("starting the reader thread for rank {peer}"),
                    source: e,
                })?;
            inbox[peer] = Some(rx);
        }
        let comm = TcpComm {
            engine: Engine::new(
                rank,
                world,
                timeouts.op,
                TcpOutbox {
                    rank,
                    timeout: timeouts.op,
                    writers,
                },
                inbox,
            ),
            streams: links,
        };
        comm.engine.barrier_within(timeouts.rendezvous)?;
        tracing::debug!(rank, world, "tcp mesh ready");
        Ok(comm)
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        for s in self.streams.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

engine_communicator!(TcpComm, "tcp");

struct TcpOutbox {
    rank: usize,
    /// The sockets' write timeout (the operation timeout), for messages.
    timeout: Duration,
    writers: Vec<Option<Mutex<TcpStream>>>,
}

impl TcpOutbox {
    fn write(
        &self,
        peer: usize,
        kind: Kind,
        seq: u64,
        aux: u32,
        payload: &[u8],
    ) -> Result<(), io::Error> {
        let w = self
            .writers
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotConnected,
                    format!("no link to rank {peer}"),
                )
            })?;
        let mut s = match w.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        wire::write_frame(&mut *s, kind, self.rank, seq, aux, payload)
    }
}

impl Outbox for TcpOutbox {
    fn send(&self, peer: usize, kind: OpKind, seq: u64, payload: &[u8]) -> Result<(), CommError> {
        let (k, aux) = match kind {
            OpKind::Gather => (Kind::Gather, 0),
            OpKind::Broadcast { root } => (Kind::Broadcast, root as u32),
            OpKind::Barrier => (Kind::Barrier, 0),
        };
        self.write(peer, k, seq, aux, payload)
            .map_err(|e| match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CommError::OpTimeout {
                    rank: self.rank,
                    op: format!("sending {kind} #{seq}"),
                    timeout: self.timeout,
                    missing: vec![peer],
                },
                io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::NotConnected
                | io::ErrorKind::UnexpectedEof => CommError::PeerDisconnected {
                    rank: self.rank,
                    peer,
                    context: format!("while sending {kind} #{seq} ({e})"),
                },
                _ => CommError::Io {
                    rank: self.rank,
                    context: format!("sending {kind} #{seq} to rank {peer}"),
                    source: e,
                },
            })
    }

    fn abort(&self, peer: usize, reason: &str) {
        let _ = self.write(peer, Kind::Abort, 0, 0, reason.as_bytes());
    }
}

/// Drains one link into its channel until the link fails or the communicator is dropped.
fn read_loop(rank: usize, peer: usize, mut s: TcpStream, tx: Sender<Incoming>) {
    let name = format!("rank {peer}");
    loop {
        let msg = match wire::read_frame(&mut s, wire::MAX_DATA_LEN) {
            Ok(f) if f.rank != peer => Incoming::Failed(CommError::Protocol {
                rank,
                peer: name.clone(),
                detail: format!("a frame on its link claims to come from rank {}", f.rank),
            }),
            Ok(f) => match f.kind {
                Kind::Gather | Kind::Barrier | Kind::Broadcast => {
                    let kind = match f.kind {
                        Kind::Gather => OpKind::Gather,
                        Kind::Barrier => OpKind::Barrier,
                        _ => OpKind::Broadcast {
                            root: f.aux as usize,
                        },
                    };
                    Incoming::Data {
                        kind,
                        seq: f.seq,
                        payload: f.payload,
                    }
                }
                Kind::Abort => Incoming::Abort(String::from_utf8_lossy(&f.payload).into_owned()),
                k => Incoming::Failed(CommError::Protocol {
                    rank,
                    peer: name.clone(),
                    detail: format!("unexpected {k:?} frame after setup"),
                }),
            },
            Err(e) => Incoming::Failed(read_error(rank, peer, &name, e, "")),
        };
        let last = matches!(msg, Incoming::Failed(_) | Incoming::Abort(_));
        if tx.send(msg).is_err() || last {
            return;
        }
    }
}

/// Maps a read failure on the link to `peer` (usize::MAX: not yet known) to an error.
fn read_error(rank: usize, peer: usize, name: &str, e: ReadError, context: &str) -> CommError {
    let disconnected = |what: String| {
        if peer == usize::MAX {
            CommError::Protocol {
                rank,
                peer: name.to_string(),
                detail: format!("{what} {context}"),
            }
        } else {
            CommError::PeerDisconnected {
                rank,
                peer,
                context: format!("({what}) {context}"),
            }
        }
    };
    match e {
        ReadError::Closed => disconnected("connection closed".into()),
        e @ ReadError::Truncated { .. } => disconnected(e.to_string()),
        ReadError::BadMagic(got) => CommError::BadMagic {
            rank,
            peer: name.to_string(),
            got,
            expected: wire::MAGIC,
        },
        ReadError::BadVersion(got) => CommError::VersionMismatch {
            rank,
            peer: name.to_string(),
            got,
            expected: wire::VERSION,
        },
        ReadError::Malformed(m) => CommError::Protocol {
            rank,
            peer: name.to_string(),
            detail: m,
        },
        ReadError::TimedOut => CommError::Protocol {
            rank,
            peer: name.to_string(),
            detail: format!("sent nothing in time {context}"),
        },
        ReadError::Io(e)
            if matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted
            ) =>
        {
            disconnected(e.to_string())
        }
        ReadError::Io(e) => CommError::Io {
            rank,
            context: format!("reading from {name} {context}"),
            source: e,
        },
    }
}

/// Reads a newcomer's first frame on its own thread, so that a silent connection cannot
/// hold up the others.
fn spawn_handshake(
    stream: TcpStream,
    addr: SocketAddr,
    deadline: Instant,
    tx: Sender<(TcpStream, SocketAddr, Result<Frame, ReadError>)>,
) {
    let _ = thread::Builder::new()
        .name("arbor-rendezvous".into())
        .spawn(move || {
            let mut s = stream;
            let remaining = deadline.saturating_duration_since(Instant::now()).max(POLL);
            let res = s
                .set_nonblocking(false)
                .and_then(|_| s.set_read_timeout(Some(remaining)))
                .map_err(ReadError::Io)
                .and_then(|_| wire::read_frame(&mut s, wire::MAX_CONTROL_LEN));
            let _ = tx.send((s, addr, res));
        });
}

/// Validates a newcomer's hello; Ok(None) for a connection that timed out silently.
fn check_hello(
    res: Result<Frame, ReadError>,
    addr: SocketAddr,
    world: usize,
    arrived: &[Option<(TcpStream, Hello, SocketAddr)>],
) -> Result<Option<(usize, Hello)>, CommError> {
    let peer = format!("connection from {addr}");
    let frame = match res {
        Ok(f) => f,
        Err(ReadError::TimedOut) => return Ok(None),
        Err(e) => return Err(read_error(0, usize::MAX, &peer, e, "at the rendezvous")),
    };
    let protocol = |detail: String| CommError::Protocol {
        rank: 0,
        peer: peer.clone(),
        detail,
    };
    if frame.kind != Kind::Hello {
        return Err(protocol(format!(
            "expected a hello, got a {:?} frame",
            frame.kind
        )));
    }
    let hello: Hello = wire::decode_msg(&frame).map_err(protocol)?;
    let r = frame.rank;
    if hello.world_size as usize != world {
        return Err(protocol(format!(
            "rank {r} (host {}) has WORLD_SIZE={}, rank 0 has {world}",
            hello.host, hello.world_size
        )));
    }
    if r == 0 || r >= world {
        return Err(protocol(format!(
            "claims rank {r}, which is not a non-zero rank of a world of {world}"
        )));
    }
    if let Some((_, _, first)) = &arrived[r] {
        return Err(protocol(format!(
            "claims rank {r}, already taken by {first}"
        )));
    }
    Ok(Some((r, hello)))
}

fn abort_all(arrived: &mut [Option<(TcpStream, Hello, SocketAddr)>], err: &CommError) {
    let reason = err.to_string();
    for (s, _, _) in arrived.iter_mut().flatten() {
        let _ = wire::write_frame(s, Kind::Abort, 0, 0, 0, reason.as_bytes());
    }
}

fn abort_links(links: &mut [Option<TcpStream>], rank: usize, err: &CommError) {
    let reason = err.to_string();
    for s in links.iter_mut().flatten() {
        let _ = wire::write_frame(s, Kind::Abort, rank, 0, 0, reason.as_bytes());
    }
}

/// Connects to the first of `addrs` that answers, retrying until `deadline`.
fn connect_until(
    rank: usize,
    addrs: &[SocketAddr],
    what: &str,
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream, CommError> {
    let mut last_error = String::from("no address to try");
    loop {
        for a in addrs {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let attempt = remaining
                .min(Duration::from_secs(2))
                .max(Duration::from_millis(10));
            match TcpStream::connect_timeout(a, attempt) {
                Ok(s) => return Ok(s),
                Err(e) => last_error = format!("{a}: {e}"),
            }
        }
        if Instant::now() >= deadline {
            return Err(CommError::MasterUnreachable {
                rank,
                addr: what.to_string(),
                timeout,
                last_error,
            });
        }
        thread::sleep(Duration::from_millis(50));
    }
}

fn split_host_port(rank: usize, target: &str) -> Result<(&str, u16), CommError> {
    let bad = || CommError::Config(format!("rank {rank}: {target:?} is not host:port"));
    let (host, port) = target.rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Ok((host, port.parse().map_err(|_| bad())?))
}

fn resolve(rank: usize, host: &str, port: u16) -> Result<Vec<SocketAddr>, CommError> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            CommError::Config(format!(
                "rank {rank}: MASTER_ADDR {host:?} does not resolve: {e}"
            ))
        })?
        .collect();
    if addrs.is_empty() {
        return Err(CommError::Config(format!(
            "rank {rank}: MASTER_ADDR {host:?} resolves to no address"
        )));
    }
    Ok(addrs)
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "?".into())
}

/// Distinguishes this group from a stale one on the same ports; not a secret.
fn session_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (u64::from(std::process::id()) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree_allreduce::tree_all_reduce;
    use crate::Communicator;
    use std::io::Write;

    fn timeouts(secs: f64) -> Timeouts {
        Timeouts {
            rendezvous: Duration::from_secs_f64(secs),
            op: Duration::from_secs_f64(secs),
        }
    }

    fn listener() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        (l, addr)
    }

    /// Starts rank 0 and `ranks` (a subset of 1..world) as threads; returns their results.
    fn group<T: Send + 'static>(
        world: usize,
        ranks: Vec<usize>,
        t: Timeouts,
        f: impl Fn(Result<TcpComm, CommError>) -> T + Send + Sync + Clone + 'static,
    ) -> (T, Vec<T>, String) {
        let (l, addr) = listener();
        let joins: Vec<_> = ranks
            .into_iter()
            .map(|r| {
                let (f, addr) = (f.clone(), addr.clone());
                thread::spawn(move || f(TcpComm::join(r, world, &addr, t)))
            })
            .collect();
        let zero = f(TcpComm::serve(l, world, t));
        let rest = joins.into_iter().map(|h| h.join().unwrap()).collect();
        (zero, rest, addr)
    }

    #[test]
    fn mesh_of_four_gathers_broadcasts_and_reduces() {
        let (zero, rest, _) = group(4, vec![1, 2, 3], timeouts(20.0), |c| {
            let c = c.unwrap();
            let r = c.rank();
            let g = c.all_gather_bytes(&[r as u8; 3]).unwrap();
            let mut b = if r == 2 { vec![42; 5] } else { vec![] };
            c.broadcast_bytes(&mut b, 2).unwrap();
            c.barrier().unwrap();
            // Order-sensitive per-rank roots; every rank must get the tree's bits.
            let roots = [1e8f32, -1e8, 1.0, 3.5e-3];
            let sum = tree_all_reduce(&c, &[roots[r]]).unwrap();
            (g, b, sum[0].to_bits(), c.transport())
        });
        let expect_sum = ((1e8f32 + -1e8) + (1.0 + 3.5e-3)).to_bits();
        for (g, b, sum, t) in std::iter::once(zero).chain(rest) {
            assert_eq!(g, vec![0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]);
            assert_eq!(b, vec![42; 5]);
            assert_eq!(sum, expect_sum);
            assert_eq!(t, "tcp");
        }
    }

    #[test]
    fn missing_rank_is_named_on_every_rank() {
        let (zero, rest, _) = group(3, vec![1], timeouts(0.5), |c| {
            c.err().map(|e| e.to_string())
        });
        let zero = zero.unwrap();
        assert!(zero.contains("rank(s) 2 never arrived"), "{zero}");
        let one = rest[0].clone().unwrap();
        assert!(
            one.contains("rank 0 aborted") && one.contains("rank(s) 2 never arrived"),
            "{one}"
        );
    }

    #[test]
    fn unreachable_rank_zero_is_named() {
        let (l, addr) = listener();
        drop(l);
        let e = TcpComm::join(1, 2, &addr, timeouts(0.3))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("could not reach the rendezvous of rank 0"),
            "{e}"
        );
    }

    /// Rank 0 with world 3, rank 1 joining properly, and a bad peer sending `bytes`.
    fn bad_peer(bytes: Vec<u8>) -> (String, String) {
        let (l, addr) = listener();
        let t = timeouts(10.0);
        let one = {
            let addr = addr.clone();
            thread::spawn(move || TcpComm::join(1, 3, &addr, t).err().map(|e| e.to_string()))
        };
        let bad = {
            let addr = addr.clone();
            thread::spawn(move || {
                // Let rank 1 arrive first, so that it must be told too.
                thread::sleep(Duration::from_millis(200));
                let mut s = TcpStream::connect(&addr).unwrap();
                let _ = s.write_all(&bytes);
                // Closing right away covers "disconnects mid-exchange".
            })
        };
        let start = Instant::now();
        let zero = TcpComm::serve(l, 3, t).err().unwrap().to_string();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "rank 0 took {:?}",
            start.elapsed()
        );
        bad.join().unwrap();
        (zero, one.join().unwrap().unwrap())
    }

    #[test]
    fn garbage_wrong_version_and_half_frames_fail_cleanly() {
        let (zero, one) =
            bad_peer(b"GET / HTTP/1.1\r\n\r\n012345678901234567890123456789".to_vec());
        assert!(zero.contains("not an arbor frame"), "{zero}");
        assert!(
            one.contains("rank 0 aborted") && one.contains("not an arbor frame"),
            "{one}"
        );

        let mut v = wire::encode_header(Kind::Hello, 2, 0, 0, 0);
        v[4..8].copy_from_slice(&7u32.to_le_bytes());
        let (zero, one) = bad_peer(v);
        assert!(zero.contains("protocol version 7"), "{zero}");
        assert!(one.contains("protocol version 7"), "{one}");

        let mut half = Vec::new();
        let hello = Hello {
            world_size: 3,
            data_port: 1,
            host: "h".into(),
        };
        wire::write_msg(&mut half, Kind::Hello, 2, &hello).unwrap();
        half.truncate(half.len() - 2);
        let (zero, one) = bad_peer(half);
        assert!(zero.contains("closed mid-frame"), "{zero}");
        assert!(one.contains("closed mid-frame"), "{one}");

        let mut wrong_world = Vec::new();
        wire::write_msg(
            &mut wrong_world,
            Kind::Hello,
            2,
            &Hello {
                world_size: 4,
                ..hello
            },
        )
        .unwrap();
        let (zero, _) = bad_peer(wrong_world);
        assert!(
            zero.contains("rank 2 (host h) has WORLD_SIZE=4, rank 0 has 3"),
            "{zero}"
        );
    }

    #[test]
    fn a_dead_peer_fails_the_next_operation_naming_it() {
        let (zero, rest, _) = group(3, vec![1, 2], timeouts(20.0), |c| {
            let c = c.unwrap();
            if c.rank() == 2 {
                drop(c);
                return None;
            }
            Some(c.all_gather_bytes(&[1, 2, 3]).unwrap_err().to_string())
        });
        for msg in [zero.unwrap(), rest[0].clone().unwrap()] {
            assert!(msg.contains("rank 2"), "{msg}");
        }
    }
}
