//! The TCP transport: one process per rank, a full mesh of sockets (fine up to 8 ranks).
//!
//! Setup, in [`TcpComm::connect`]:
//! 1. Rank 0 listens on MASTER_PORT at the address MASTER_ADDR resolves to (loopback for a
//!    job on one host), or on every interface with ARBOR_BIND_ALL=1, and serves the
//!    rendezvous.
//! 2. Every other rank connects to MASTER_ADDR:MASTER_PORT (retrying until rank 0 is up),
//!    opens a data listener on an ephemeral port of the local address that connection
//!    uses, proves the job token (see [`crate::auth`]) and sends a `Hello` (rank, world
//!    size, data port).
//! 3. When all have arrived, rank 0 answers each with a `Welcome`: the session id and every
//!    rank's data address, made of the IP rank 0 saw the rank connect from (an address
//!    that demonstrably routes, never a guessed 127.0.0.1) and its data port. The
//!    rendezvous connection itself stays as the link between rank 0 and that rank.
//! 4. Rank j connects to every rank 0 < i < j, proves the token again and introduces itself
//!    with a `MeshHello`; then a barrier over the whole mesh confirms every link.
//!
//! Every incoming connection is handled on its own thread with a short deadline: a
//! stranger that sends garbage, nothing, or a wrong token is turned away (and logged)
//! while the listener keeps waiting for the real ranks. Only a peer that passed the token
//! check can make the group fail (a wrong WORLD_SIZE, a rank claimed twice).
//!
//! Every wait has a deadline (ARBOR_TIMEOUT_SECS). On any failure rank 0 sends an `Abort`
//! with the reason to every rank that arrived, so all of them fail with the same message.
//! After setup each link has a reader thread that drains frames into a channel, so sends
//! never deadlock; collective operations time out after ARBOR_OP_TIMEOUT_SECS.

use std::io::{self, Read};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam::channel::{unbounded, Receiver, Sender};

use crate::auth::{self, AuthChallenge, AuthHello, AuthProof, JobToken, Purpose, Security};
use crate::engine::{engine_communicator, Engine, Incoming, OpKind, Outbox};
use crate::env::{RankInfo, Timeouts};
use crate::wire::{self, Frame, Hello, Kind, MeshHello, ReadError, Welcome};
use crate::CommError;

/// How often a waiting accept loop looks for new connections.
const POLL: Duration = Duration::from_millis(5);
/// How long one incoming connection may take to prove the token and introduce itself;
/// real ranks do it at once, a stranger holding the connection open is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Incoming connections handled at once; more are closed unread (a flood of strangers
/// cannot make a listener start unbounded threads).
const MAX_PENDING_HANDSHAKES: usize = 64;

/// One rank of a TCP group.
pub struct TcpComm {
    engine: Engine<TcpOutbox>,
    /// The links, kept to shut them down on drop (which ends the reader threads).
    streams: Vec<Option<TcpStream>>,
}

impl TcpComm {
    /// Joins (rank > 0) or serves (rank 0) the rendezvous at `info.master_addr:master_port`
    /// and opens the mesh.
    pub fn connect(
        info: &RankInfo,
        timeouts: Timeouts,
        security: &Security,
    ) -> Result<TcpComm, CommError> {
        let target = format!("{}:{}", info.master_addr, info.master_port);
        if info.rank == 0 && security.token.is_none() {
            warn_unauthenticated(&target);
        }
        if info.rank == 0 {
            let listener = bind_rendezvous(info, security)?;
            Self::serve(listener, info.world_size, timeouts, security)
        } else {
            Self::join(info.rank, info.world_size, &target, timeouts, security)
        }
    }

    /// Rank 0: serves the rendezvous on `listener` until `world - 1` ranks have arrived.
    pub fn serve(
        listener: TcpListener,
        world: usize,
        timeouts: Timeouts,
        security: &Security,
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
        let mut gate = Gate::new(
            listener,
            0,
            Purpose::Rendezvous,
            security.token.clone(),
            deadline,
        )
        .map_err(|e| io_err("setting up", e))?;
        let mut arrived: Vec<Option<(TcpStream, Hello, SocketAddr)>> =
            (0..world).map(|_| None).collect();
        let mut count = 1;
        tracing::debug!(%here, world, "rank 0: serving the rendezvous");
        while count < world {
            let next = match gate.poll() {
                Ok(n) => n,
                Err(e) => {
                    let err = io_err("accepting", e);
                    abort_all(&mut arrived, &err);
                    return Err(err);
                }
            };
            if let Some((mut stream, addr, res)) = next {
                match check_hello(res, addr, world, &arrived) {
                    Ok(Some((r, hello))) => {
                        tracing::debug!(rank = r, %addr, host = %hello.host, "rank arrived");
                        arrived[r] = Some((stream, hello, addr));
                        count += 1;
                    }
                    // Proved the token, then said nothing in time: the timeout below
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
                    refused: gate.refusals(),
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
        security: &Security,
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
        // Peers reach this rank's data port at the address rank 0 sees it connect from,
        // which is this local address: nothing needs to listen anywhere else.
        let bind_ip = if security.bind_all {
            unspecified_like(local_ip)
        } else {
            local_ip
        };
        let listener = TcpListener::bind(SocketAddr::new(bind_ip, 0))
            .map_err(|e| io_err(format!("opening the data listener on {bind_ip}"), e))?;
        let data_port = listener
            .local_addr()
            .map_err(|e| io_err("reading the data listener's port".into(), e))?
            .port();
        let peer0 = format!("rank 0 at {master}");
        auth_connect(
            &mut stream,
            rank,
            &peer0,
            Purpose::Rendezvous,
            security.token.as_ref(),
            deadline,
        )?;
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
            rank, world, &welcome, listener, &mut links, deadline, timeouts, security,
        );
        if let Err(err) = mesh {
            abort_links(&mut links, rank, &err);
            return Err(err);
        }
        Self::finish(rank, world, links, timeouts)
    }

    /// Connects to ranks 1..rank, accepts ranks rank+1..world.
    #[allow(clippy::too_many_arguments)]
    fn open_mesh(
        rank: usize,
        world: usize,
        welcome: &Welcome,
        listener: TcpListener,
        links: &mut [Option<TcpStream>],
        deadline: Instant,
        timeouts: Timeouts,
        security: &Security,
    ) -> Result<(), CommError> {
        for (i, addr) in welcome.peers.iter().enumerate().take(rank).skip(1) {
            let target: SocketAddr = addr.parse().map_err(|_| CommError::Protocol {
                rank,
                peer: "rank 0".into(),
                detail: format!("welcome gives rank {i} the address {addr:?}"),
            })?;
            let name = format!("rank {i} at {addr}");
            let mut s = connect_until(rank, &[target], &name, deadline, timeouts.rendezvous)?;
            auth_connect(
                &mut s,
                rank,
                &name,
                Purpose::Mesh,
                security.token.as_ref(),
                deadline,
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
        let mut waiting = world - rank - 1;
        if waiting == 0 {
            return Ok(());
        }
        let mut gate = Gate::new(
            listener,
            rank,
            Purpose::Mesh,
            security.token.clone(),
            deadline,
        )
        .map_err(io_err)?;
        while waiting > 0 {
            if let Some((s, addr, res)) = gate.poll().map_err(io_err)? {
                let peer = format!("connection from {addr}");
                let frame = match res {
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
                    // A rank of an earlier group with the same token and ports: not ours,
                    // and no reason to fail this group.
                    tracing::warn!(
                        "rank {rank}: refused a link from {addr}: it belongs to another arbor \
                         group (session id differs)"
                    );
                    continue;
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
            } else if Instant::now() >= deadline {
                let missing: Vec<usize> =
                    (rank + 1..world).filter(|&j| links[j].is_none()).collect();
                return Err(CommError::RendezvousTimeout {
                    rank,
                    addr: here,
                    timeout: timeouts.rendezvous,
                    missing,
                    refused: gate.refusals(),
                });
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

/// A connection that passed the token check, who it came from, and its first protocol
/// frame (or why that could not be read).
type Passed = (TcpStream, SocketAddr, Result<Frame, ReadError>);

/// What became of one incoming connection's handshake.
enum Handshake {
    /// It proved the token (or neither side has one); then its first protocol frame, or
    /// why that could not be read.
    Passed(TcpStream, SocketAddr, Result<Frame, ReadError>),
    /// Turned away, and why (the peer was told where it still listened).
    Refused(SocketAddr, String),
}

/// A listener whose incoming connections must pass the token handshake. Each is handled
/// on its own thread, so that a silent or slow connection cannot hold up the others.
struct Gate {
    listener: TcpListener,
    rank: usize,
    purpose: Purpose,
    token: Option<JobToken>,
    deadline: Instant,
    tx: Sender<Handshake>,
    rx: Receiver<Handshake>,
    pending: usize,
    /// How many connections were turned away, and the last one (address, why).
    refused: usize,
    last_refusal: Option<(SocketAddr, String)>,
}

impl Gate {
    fn new(
        listener: TcpListener,
        rank: usize,
        purpose: Purpose,
        token: Option<JobToken>,
        deadline: Instant,
    ) -> io::Result<Gate> {
        listener.set_nonblocking(true)?;
        let (tx, rx) = unbounded();
        Ok(Gate {
            listener,
            rank,
            purpose,
            token,
            deadline,
            tx,
            rx,
            pending: 0,
            refused: 0,
            last_refusal: None,
        })
    }

    /// Accepts what is waiting, then waits up to [`POLL`] for a connection that passed.
    fn poll(&mut self) -> io::Result<Option<Passed>> {
        loop {
            match self.listener.accept() {
                Ok((stream, addr)) => self.start(stream, addr),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        match self.rx.recv_timeout(POLL) {
            Ok(Handshake::Passed(s, addr, res)) => {
                self.pending -= 1;
                Ok(Some((s, addr, res)))
            }
            Ok(Handshake::Refused(addr, reason)) => {
                self.pending -= 1;
                tracing::warn!(
                    "rank {}: refused a connection from {addr}: {reason}",
                    self.rank
                );
                self.refused += 1;
                self.last_refusal = Some((addr, reason));
                Ok(None)
            }
            Err(_) => Ok(None),
        }
    }

    /// For a timeout message: the connections turned away while waiting, if any.
    fn refusals(&self) -> String {
        match &self.last_refusal {
            None => String::new(),
            Some((addr, why)) => format!(
                "; meanwhile {} connection(s) were refused, the last from {addr}: {why}",
                self.refused
            ),
        }
    }

    fn start(&mut self, stream: TcpStream, addr: SocketAddr) {
        if self.pending >= MAX_PENDING_HANDSHAKES {
            tracing::warn!(
                "rank {}: dropped a connection from {addr}: {MAX_PENDING_HANDSHAKES} \
                 handshakes already in progress",
                self.rank
            );
            return;
        }
        let (rank, purpose, token, tx) =
            (self.rank, self.purpose, self.token.clone(), self.tx.clone());
        let until = handshake_deadline(self.deadline);
        let spawned = thread::Builder::new()
            .name("arbor-handshake".into())
            .spawn(move || {
                let _ = tx.send(handshake(
                    stream,
                    addr,
                    rank,
                    purpose,
                    token.as_ref(),
                    until,
                ));
            });
        match spawned {
            Ok(_) => self.pending += 1,
            Err(e) => tracing::warn!(
                "rank {}: dropped a connection from {addr}: cannot start its thread: {e}",
                self.rank
            ),
        }
    }
}

/// The end of one connection's handshake: a short while from now, and never past the
/// rendezvous deadline.
fn handshake_deadline(deadline: Instant) -> Instant {
    let now = Instant::now();
    (now + HANDSHAKE_TIMEOUT).min(deadline).max(now + POLL)
}

/// Reads from a socket with one deadline for the whole exchange: a peer trickling one
/// byte at a time cannot stretch it (a plain read timeout restarts on every byte).
struct DeadlineReader<'a> {
    s: &'a TcpStream,
    until: Instant,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.s.set_read_timeout(Some(left))?;
        let mut s = self.s;
        s.read(buf)
    }
}

/// Acceptor side of one connection: the token check, then its first protocol frame.
fn handshake(
    mut s: TcpStream,
    addr: SocketAddr,
    rank: usize,
    purpose: Purpose,
    token: Option<&JobToken>,
    until: Instant,
) -> Handshake {
    let setup = s
        .set_nonblocking(false)
        .and_then(|_| s.set_nodelay(true))
        .and_then(|_| s.set_write_timeout(Some(HANDSHAKE_TIMEOUT)));
    if let Err(e) = setup {
        return Handshake::Refused(addr, format!("cannot set up the connection: {e}"));
    }
    match auth_accept(&mut s, addr, rank, purpose, token, until) {
        Ok(()) => {
            let res = wire::read_frame(&mut DeadlineReader { s: &s, until }, wire::MAX_CONTROL_LEN);
            Handshake::Passed(s, addr, res)
        }
        Err(reason) => {
            let _ = wire::write_frame(&mut s, Kind::Abort, rank, 0, 0, reason.as_bytes());
            let _ = s.shutdown(Shutdown::Both);
            Handshake::Refused(addr, reason)
        }
    }
}

/// The acceptor's half of the token handshake (see [`crate::auth`]); Err: why the peer is
/// turned away.
fn auth_accept(
    s: &mut TcpStream,
    addr: SocketAddr,
    rank: usize,
    purpose: Purpose,
    token: Option<&JobToken>,
    until: Instant,
) -> Result<(), String> {
    let peer = format!("connection from {addr}");
    let read = |s: &TcpStream, want: Kind| -> Result<Frame, String> {
        let f = wire::read_frame(&mut DeadlineReader { s, until }, wire::MAX_CONTROL_LEN).map_err(
            |e| match e {
                ReadError::TimedOut => format!(
                    "it did not complete the job-token handshake within {}s",
                    HANDSHAKE_TIMEOUT.as_secs_f64()
                ),
                e => read_error(rank, usize::MAX, &peer, e, "during the job-token handshake")
                    .to_string(),
            },
        )?;
        if f.kind != want {
            return Err(format!(
                "expected {want:?} (the job-token handshake), got a {:?} frame                  (an arbor build without job tokens?)",
                f.kind
            ));
        }
        Ok(f)
    };
    let f = read(s, Kind::AuthHello)?;
    let hello: AuthHello = wire::decode_msg(&f)?;
    if let Some(reason) = auth::mismatch_reason(token.is_some(), hello.has_token) {
        return Err(reason);
    }
    let ns = auth::nonce().map_err(|e| e.to_string())?;
    let proof = token
        .map(|t| auth::acceptor_proof(t, purpose, &hello.nonce, &ns))
        .unwrap_or_default();
    let challenge = AuthChallenge {
        nonce: ns,
        has_token: token.is_some(),
        proof,
    };
    wire::write_msg(s, Kind::AuthChallenge, rank, &challenge)
        .map_err(|e| format!("it left during the job-token handshake ({e})"))?;
    let f = read(s, Kind::AuthProof)?;
    let answer: AuthProof = wire::decode_msg(&f)?;
    let ok = match token {
        Some(t) => auth::verify_connector(t, purpose, &ns, &hello.nonce, &answer.proof),
        None => answer.proof.is_empty(),
    };
    if !ok {
        return Err(auth::wrong_token_reason());
    }
    wire::write_frame(s, Kind::AuthOk, rank, 0, 0, &[])
        .map_err(|e| format!("it left during the job-token handshake ({e})"))
}

/// The connector's half of the token handshake with `peer` (e.g. "rank 0 at host:port"),
/// waiting until `until` at most: the peer is a known rank, which may be busy opening its
/// own links before it gets to this one, so the short limit of incoming handshakes does
/// not apply.
fn auth_connect(
    s: &mut TcpStream,
    rank: usize,
    peer: &str,
    purpose: Purpose,
    token: Option<&JobToken>,
    until: Instant,
) -> Result<(), CommError> {
    let protocol = |detail: String| CommError::Protocol {
        rank,
        peer: peer.to_string(),
        detail,
    };
    let sent = |e: io::Error| {
        protocol(format!(
            "closed the connection during the job-token handshake ({e})"
        ))
    };
    let nc = auth::nonce()?;
    wire::write_msg(
        s,
        Kind::AuthHello,
        rank,
        &AuthHello {
            nonce: nc,
            has_token: token.is_some(),
        },
    )
    .map_err(sent)?;
    let read = |s: &TcpStream, want: Kind| -> Result<Frame, CommError> {
        let f = wire::read_frame(&mut DeadlineReader { s, until }, wire::MAX_CONTROL_LEN).map_err(
            |e| match e {
                ReadError::TimedOut => protocol(
                    "did not answer the job-token handshake before the rendezvous deadline \
                     (ARBOR_TIMEOUT_SECS)"
                        .into(),
                ),
                e => read_error(rank, usize::MAX, peer, e, "during the job-token handshake"),
            },
        )?;
        match f.kind {
            k if k == want => Ok(f),
            Kind::Abort => Err(CommError::Refused {
                rank,
                peer: peer.to_string(),
                reason: String::from_utf8_lossy(&f.payload).into_owned(),
            }),
            k => Err(protocol(format!(
                "expected {want:?} (the job-token handshake), got a {k:?} frame"
            ))),
        }
    };
    let f = read(s, Kind::AuthChallenge)?;
    let challenge: AuthChallenge = wire::decode_msg(&f).map_err(protocol)?;
    let proof = token
        .map(|t| auth::connector_proof(t, purpose, &challenge.nonce, &nc))
        .unwrap_or_default();
    wire::write_msg(s, Kind::AuthProof, rank, &AuthProof { proof }).map_err(sent)?;
    read(s, Kind::AuthOk)?;
    // Checked last: with a wrong token the acceptor's refusal, which names the token, is
    // the clearer message; this catches a listener that accepts anything.
    let genuine = match token {
        Some(t) => auth::verify_acceptor(t, purpose, &nc, &challenge.nonce, &challenge.proof),
        None => !challenge.has_token,
    };
    if !genuine {
        return Err(CommError::Auth {
            rank,
            peer: peer.to_string(),
            detail: format!(
                "it accepted this rank without proving this job's token; it is not a rank \
                 of this job ({})",
                auth::wrong_token_reason()
            ),
        });
    }
    Ok(())
}

/// The address(es) rank 0's rendezvous listens on: where MASTER_ADDR resolves, unless
/// ARBOR_BIND_ALL=1.
fn bind_rendezvous(info: &RankInfo, security: &Security) -> Result<TcpListener, CommError> {
    let master = resolve(0, &info.master_addr, info.master_port)?;
    let spans_hosts = info.local_world_size < info.world_size;
    let name_is_ip = info
        .master_addr
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .is_ok();
    let candidates: Vec<SocketAddr> = if security.bind_all {
        vec![SocketAddr::new(
            unspecified_like(master[0].ip()),
            info.master_port,
        )]
    } else if spans_hosts && !name_is_ip && master.iter().all(|a| a.ip().is_loopback()) {
        // /etc/hosts often maps a machine's own name to 127.0.1.1, while the other hosts
        // resolve it to a routable address: listening on loopback would shut them out.
        tracing::warn!(
            "rank 0: MASTER_ADDR {} resolves to loopback ({}) here but ranks run on other \
             hosts: listening on every interface (the job token still guards the port)",
            info.master_addr,
            master[0].ip()
        );
        vec![SocketAddr::new(
            unspecified_like(master[0].ip()),
            info.master_port,
        )]
    } else {
        master
    };
    let mut last = None;
    for a in &candidates {
        match TcpListener::bind(a) {
            Ok(l) => {
                tracing::debug!(addr = %a, "rank 0: rendezvous listener bound");
                return Ok(l);
            }
            Err(e) => last = Some((*a, e)),
        }
    }
    let (a, e) = last.unwrap_or_else(|| {
        (
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), info.master_port),
            io::Error::other("MASTER_ADDR resolves to no address"),
        )
    });
    let hint = if e.kind() == io::ErrorKind::AddrNotAvailable {
        format!(
            "MASTER_ADDR {} is not an address of this host; set {}=1 to listen on every \
             interface",
            info.master_addr,
            auth::BIND_ALL_VAR
        )
    } else {
        "MASTER_PORT; is another group using it?".to_string()
    };
    Err(CommError::Io {
        rank: 0,
        context: format!("binding the rendezvous port {a} ({hint})"),
        source: e,
    })
}

fn unspecified_like(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// Warns, once per process, that anyone who reaches the ports can join.
fn warn_unauthenticated(target: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::warn!(
            "this job is unauthenticated: no {} or {} is set, so any process that can reach \
             the rendezvous at {target} can join it (arbor-launch sets a token for its ranks)",
            auth::TOKEN_VAR,
            auth::TOKEN_FILE_VAR
        )
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

    fn sec(token: Option<&str>) -> Security {
        Security {
            token: token.map(|t| JobToken::new(t, "test").unwrap()),
            bind_all: false,
        }
    }

    fn listener() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        (l, addr)
    }

    /// Starts rank 0 and `ranks` (a subset of 1..world) as threads, every one with
    /// `security`; returns their results.
    fn group<T: Send + 'static>(
        world: usize,
        ranks: Vec<usize>,
        t: Timeouts,
        security: Security,
        f: impl Fn(Result<TcpComm, CommError>) -> T + Send + Sync + Clone + 'static,
    ) -> (T, Vec<T>, String) {
        let (l, addr) = listener();
        let joins: Vec<_> = ranks
            .into_iter()
            .map(|r| {
                let (f, addr, sec) = (f.clone(), addr.clone(), security.clone());
                thread::spawn(move || f(TcpComm::join(r, world, &addr, t, &sec)))
            })
            .collect();
        let zero = f(TcpComm::serve(l, world, t, &security));
        let rest = joins.into_iter().map(|h| h.join().unwrap()).collect();
        (zero, rest, addr)
    }

    #[test]
    fn mesh_of_four_gathers_broadcasts_and_reduces() {
        // With a job token: every rendezvous and mesh link passes the handshake.
        for security in [sec(Some("s3cret")), sec(None)] {
            let (zero, rest, _) = group(4, vec![1, 2, 3], timeouts(20.0), security, |c| {
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
    }

    #[test]
    fn missing_rank_is_named_on_every_rank() {
        let (zero, rest, _) = group(3, vec![1], timeouts(0.5), sec(Some("t")), |c| {
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
        let e = TcpComm::join(1, 2, &addr, timeouts(0.3), &sec(None))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("could not reach the rendezvous of rank 0"),
            "{e}"
        );
    }

    /// Connects to `addr`, sends `bytes`, and returns what came back until the peer
    /// closed (or 5 s passed).
    fn stranger(addr: &str, bytes: &[u8], keep_silent: bool) -> Vec<u8> {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(bytes).unwrap();
        if !keep_silent {
            let _ = s.shutdown(Shutdown::Write);
        }
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let mut back = Vec::new();
        let _ = s.read_to_end(&mut back);
        back
    }

    /// The reason in the `Abort` frame a refused stranger was sent.
    fn abort_reason(back: &[u8]) -> String {
        match wire::read_frame(&mut &back[..], wire::MAX_CONTROL_LEN) {
            Ok(f) if f.kind == Kind::Abort => String::from_utf8_lossy(&f.payload).into_owned(),
            other => panic!("expected an abort frame, got {other:?}"),
        }
    }

    #[test]
    fn strangers_are_turned_away_without_disturbing_the_group() {
        let (l, addr) = listener();
        let t = timeouts(20.0);
        let token = sec(Some("the-real-one"));
        // A silent connection first: it must not hold up anyone.
        let silent = {
            let addr = addr.clone();
            thread::spawn(move || stranger(&addr, b"", true))
        };
        let mut hello_only = Vec::new();
        wire::write_msg(
            &mut hello_only,
            Kind::Hello,
            2,
            &Hello {
                world_size: 3,
                data_port: 1,
                host: "h".into(),
            },
        )
        .unwrap();
        let mut wrong_version = wire::encode_header(Kind::AuthHello, 2, 0, 0, 0);
        wrong_version[4..8].copy_from_slice(&7u32.to_le_bytes());
        let half = wire::encode_header(Kind::AuthHello, 2, 0, 0, 9)[..20].to_vec();
        let loud: Vec<(Vec<u8>, &str)> = vec![
            (
                b"GET / HTTP/1.1\r\n\r\n012345678901234567890123456789".to_vec(),
                "not an arbor frame",
            ),
            (wrong_version, "protocol version 7"),
            (half, "closed mid-frame"),
            // An arbor peer of a build without job tokens.
            (hello_only, "expected AuthHello"),
        ];
        let strangers = {
            let addr = addr.clone();
            thread::spawn(move || {
                loud.into_iter()
                    .map(|(bytes, want)| (abort_reason(&stranger(&addr, &bytes, false)), want))
                    .collect::<Vec<_>>()
            })
        };
        let ranks: Vec<_> = [1, 2]
            .into_iter()
            .map(|r| {
                let (addr, token) = (addr.clone(), token.clone());
                thread::spawn(move || {
                    // Let the strangers go first.
                    thread::sleep(Duration::from_millis(300));
                    TcpComm::join(r, 3, &addr, t, &token).map(|c| c.barrier())
                })
            })
            .collect();
        let start = Instant::now();
        let zero = TcpComm::serve(l, 3, t, &token).unwrap();
        zero.barrier().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "rank 0 took {:?}: a silent stranger held it up",
            start.elapsed()
        );
        for h in ranks {
            h.join().unwrap().unwrap().unwrap();
        }
        for (reason, want) in strangers.join().unwrap() {
            assert!(reason.contains(want), "{want}: {reason}");
        }
        drop(zero);
        // The silent one is let go when its handshake time runs out.
        let back = silent.join().unwrap();
        assert!(abort_reason(&back).contains("did not complete the job-token handshake"));
    }

    #[test]
    fn wrong_token_is_refused_and_the_right_rank_still_joins() {
        let (l, addr) = listener();
        let t = timeouts(20.0);
        let impostor = {
            let addr = addr.clone();
            thread::spawn(move || TcpComm::join(1, 2, &addr, t, &sec(Some("guess"))))
        };
        let real = {
            let addr = addr.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(300));
                TcpComm::join(1, 2, &addr, t, &sec(Some("right"))).map(|c| c.barrier())
            })
        };
        let zero = TcpComm::serve(l, 2, t, &sec(Some("right"))).unwrap();
        zero.barrier().unwrap();
        real.join().unwrap().unwrap().unwrap();
        let e = impostor.join().unwrap().err().unwrap().to_string();
        assert!(
            e.contains(&format!(
                "rank 0 at {addr} refused this rank: job token mismatch"
            )) && e.contains("ARBOR_JOB_TOKEN"),
            "{e}"
        );
    }

    #[test]
    fn a_timeout_names_the_refused_connections() {
        let (l, addr) = listener();
        let t = timeouts(1.0);
        let impostor =
            thread::spawn(move || TcpComm::join(1, 2, &addr, t, &sec(Some("guess"))).is_err());
        let e = TcpComm::serve(l, 2, t, &sec(Some("right")))
            .err()
            .unwrap()
            .to_string();
        assert!(impostor.join().unwrap());
        assert!(
            e.contains("rank(s) 1 never arrived")
                && e.contains("1 connection(s) were refused, the last from 127.0.0.1:")
                && e.contains("job token mismatch"),
            "{e}"
        );
    }

    /// Runs the acceptor's handshake on one connection to a fresh listener; returns the
    /// listener's address and the outcome (Ok: passed, Err: the refusal).
    fn acceptor(token: Option<&str>) -> (String, thread::JoinHandle<Result<(), String>>) {
        let (l, addr) = listener();
        let token = sec(token).token;
        let h = thread::spawn(move || {
            let (s, a) = l.accept().unwrap();
            let until = Instant::now() + Duration::from_secs(5);
            match handshake(s, a, 0, Purpose::Rendezvous, token.as_ref(), until) {
                Handshake::Passed(..) => Ok(()),
                Handshake::Refused(_, why) => Err(why),
            }
        });
        (addr, h)
    }

    fn connector(addr: &str, token: Option<&str>) -> Result<(), CommError> {
        let mut s = TcpStream::connect(addr).unwrap();
        let token = sec(token).token;
        let until = Instant::now() + Duration::from_secs(5);
        let r = auth_connect(
            &mut s,
            1,
            "rank 0",
            Purpose::Rendezvous,
            token.as_ref(),
            until,
        );
        if r.is_ok() {
            // The acceptor reads one protocol frame after the handshake.
            wire::write_frame(&mut s, Kind::Barrier, 1, 0, 0, &[]).unwrap();
        }
        r
    }

    #[test]
    fn handshake_right_wrong_and_missing_tokens() {
        let (addr, h) = acceptor(Some("k"));
        connector(&addr, Some("k")).unwrap();
        h.join().unwrap().unwrap();

        let (addr, h) = acceptor(None);
        connector(&addr, None).unwrap();
        h.join().unwrap().unwrap();

        let (addr, h) = acceptor(Some("k"));
        let e = connector(&addr, Some("not-k")).unwrap_err().to_string();
        assert!(
            e.contains("rank 0 refused this rank: job token mismatch"),
            "{e}"
        );
        assert!(h
            .join()
            .unwrap()
            .unwrap_err()
            .contains("job token mismatch"));

        let (addr, h) = acceptor(Some("k"));
        let e = connector(&addr, None).unwrap_err().to_string();
        assert!(
            e.contains("refused this rank: this job requires a job token and the connecting process has none"),
            "{e}"
        );
        assert!(h.join().unwrap().unwrap_err().contains("has none"));

        let (addr, h) = acceptor(None);
        let e = connector(&addr, Some("k")).unwrap_err().to_string();
        assert!(
            e.contains("refused this rank: the connecting process has a job token but this job runs without one"),
            "{e}"
        );
        assert!(h.join().unwrap().unwrap_err().contains("runs without one"));
    }

    /// Reads one frame of `kind` off `s`.
    fn expect(s: &mut TcpStream, kind: Kind) -> Frame {
        let f = wire::read_frame(s, wire::MAX_CONTROL_LEN).unwrap();
        assert_eq!(f.kind, kind, "{f:?}");
        f
    }

    #[test]
    fn replayed_proofs_are_refused() {
        let token = sec(Some("k")).token.unwrap();
        let nc = [7u8; auth::NONCE_LEN];
        let hello = AuthHello {
            nonce: nc,
            has_token: true,
        };
        // A genuine exchange, recorded by an eavesdropper.
        let (addr, h) = acceptor(Some("k"));
        let mut s = TcpStream::connect(&addr).unwrap();
        wire::write_msg(&mut s, Kind::AuthHello, 1, &hello).unwrap();
        let recorded: AuthChallenge =
            wire::decode_msg(&expect(&mut s, Kind::AuthChallenge)).unwrap();
        let proof = auth::connector_proof(&token, Purpose::Rendezvous, &recorded.nonce, &nc);
        wire::write_msg(
            &mut s,
            Kind::AuthProof,
            1,
            &AuthProof {
                proof: proof.clone(),
            },
        )
        .unwrap();
        expect(&mut s, Kind::AuthOk);
        wire::write_frame(&mut s, Kind::Barrier, 1, 0, 0, &[]).unwrap();
        h.join().unwrap().unwrap();

        // Replaying the connector's side: same nonce, same proof, a fresh acceptor nonce.
        let (addr, h) = acceptor(Some("k"));
        let mut s = TcpStream::connect(&addr).unwrap();
        wire::write_msg(&mut s, Kind::AuthHello, 1, &hello).unwrap();
        let fresh: AuthChallenge = wire::decode_msg(&expect(&mut s, Kind::AuthChallenge)).unwrap();
        assert_ne!(fresh.nonce, recorded.nonce);
        wire::write_msg(&mut s, Kind::AuthProof, 1, &AuthProof { proof }).unwrap();
        let refusal = expect(&mut s, Kind::Abort);
        assert!(String::from_utf8_lossy(&refusal.payload).contains("job token mismatch"));
        assert!(h
            .join()
            .unwrap()
            .unwrap_err()
            .contains("job token mismatch"));

        // Replaying the acceptor's side: a fake rank 0 answers with the recorded challenge;
        // the connector's nonce is new, so the recorded proof does not hold.
        let (l, addr) = listener();
        let fake = thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            expect(&mut s, Kind::AuthHello);
            wire::write_msg(&mut s, Kind::AuthChallenge, 0, &recorded).unwrap();
            expect(&mut s, Kind::AuthProof);
            wire::write_frame(&mut s, Kind::AuthOk, 0, 0, 0, &[]).unwrap();
        });
        let e = connector(&addr, Some("k")).unwrap_err().to_string();
        assert!(e.contains("without proving this job's token"), "{e}");
        fake.join().unwrap();
    }

    #[test]
    fn wrong_world_size_from_a_real_rank_still_fails_the_group() {
        let (l, addr) = listener();
        let t = timeouts(10.0);
        let one = {
            let addr = addr.clone();
            thread::spawn(move || {
                TcpComm::join(1, 3, &addr, t, &sec(Some("k")))
                    .err()
                    .map(|e| e.to_string())
            })
        };
        let bad = {
            let addr = addr.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(200));
                let mut s = TcpStream::connect(&addr).unwrap();
                let token = sec(Some("k")).token;
                let until = Instant::now() + Duration::from_secs(5);
                auth_connect(
                    &mut s,
                    2,
                    "rank 0",
                    Purpose::Rendezvous,
                    token.as_ref(),
                    until,
                )
                .unwrap();
                let hello = Hello {
                    world_size: 4,
                    data_port: 1,
                    host: "h".into(),
                };
                wire::write_msg(&mut s, Kind::Hello, 2, &hello).unwrap();
            })
        };
        let zero = TcpComm::serve(l, 3, t, &sec(Some("k")))
            .err()
            .unwrap()
            .to_string();
        bad.join().unwrap();
        assert!(
            zero.contains("rank 2 (host h) has WORLD_SIZE=4, rank 0 has 3"),
            "{zero}"
        );
        let one = one.join().unwrap().unwrap();
        assert!(
            one.contains("rank 0 aborted") && one.contains("WORLD_SIZE=4"),
            "{one}"
        );
    }

    #[test]
    fn listeners_bind_the_master_address_only() {
        let info = RankInfo {
            rank: 0,
            world_size: 2,
            local_rank: 0,
            local_world_size: 2,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            source: "test",
        };
        let l = bind_rendezvous(&info, &sec(None)).unwrap();
        assert_eq!(
            l.local_addr().unwrap().ip(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        let all = Security {
            bind_all: true,
            ..sec(None)
        };
        let l = bind_rendezvous(&info, &all).unwrap();
        assert_eq!(
            l.local_addr().unwrap().ip(),
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        );
        // An address that is not this host's: a clear error naming the way out.
        let far = RankInfo {
            master_addr: "192.0.2.1".into(),
            ..info
        };
        let e = bind_rendezvous(&far, &sec(None)).unwrap_err().to_string();
        assert!(
            e.contains("192.0.2.1") && e.contains("ARBOR_BIND_ALL=1"),
            "{e}"
        );
    }

    #[test]
    fn a_dead_peer_fails_the_next_operation_naming_it() {
        let (zero, rest, _) = group(3, vec![1, 2], timeouts(20.0), sec(None), |c| {
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
