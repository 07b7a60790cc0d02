//! The gate of a listener: every incoming connection is handled on its own thread with a
//! short deadline and must pass the job-token handshake (see [`crate::auth`]); the
//! connector's half of that handshake.
//!
//! Anyone who can reach a port can open connections to it, token or not. So that idle or
//! slow ones cannot keep a real rank out, a full gate makes room for a new connection by
//! dropping the one that has waited longest without saying anything (else the oldest),
//! and a connector whose connection is dropped before it was answered connects again
//! until its deadline.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam::channel::{unbounded, Receiver, Sender};

use super::link::read_error;
use super::net::connect_until;
use crate::auth::{self, AuthChallenge, AuthHello, AuthProof, JobToken, Purpose};
use crate::wire::{self, Frame, Kind, ReadError};
use crate::CommError;

/// How often a waiting accept loop looks for new connections.
const POLL: Duration = Duration::from_millis(5);
/// How long one incoming connection may take to prove the token and introduce itself;
/// real ranks do it at once, a stranger holding the connection open is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Incoming connections handled at once (a flood of strangers cannot make a listener
/// start unbounded threads); a new one past this many takes the place of the one that
/// waited longest without saying anything.
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Pause before a connector connects again after its connection was dropped unanswered.
const RECONNECT_PAUSE: Duration = Duration::from_millis(20);

/// A connection that passed the token check, who it came from, and its first protocol
/// frame (or why that could not be read).
type Passed = (TcpStream, SocketAddr, Result<Frame, ReadError>);

/// What became of one incoming connection's handshake.
pub(super) enum Handshake {
    /// It proved the token (or neither side has one); then its first protocol frame, or
    /// why that could not be read.
    Passed(TcpStream, SocketAddr, Result<Frame, ReadError>),
    /// Turned away, and why (the peer was told where it still listened).
    Refused(SocketAddr, String),
}

/// A listener whose incoming connections must pass the token handshake. Each is handled
/// on its own thread, so that a silent or slow connection cannot hold up the others.
pub(super) struct Gate {
    listener: TcpListener,
    rank: usize,
    purpose: Purpose,
    token: Option<JobToken>,
    deadline: Instant,
    tx: Sender<(u64, Handshake)>,
    rx: Receiver<(u64, Handshake)>,
    /// The handshakes in progress, by the id their thread reports with.
    pending: HashMap<u64, Pending>,
    next_id: u64,
    /// How many connections were turned away, and the last one (address, why).
    refused: usize,
    last_refusal: Option<(SocketAddr, String)>,
}

/// A handshake in progress, as the gate sees it.
struct Pending {
    addr: SocketAddr,
    since: Instant,
    /// Its socket, to drop the connection from here.
    stream: TcpStream,
    /// Set by its thread once the peer's first handshake frame arrived.
    spoke: Arc<AtomicBool>,
}

impl Gate {
    pub(super) fn new(
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
            pending: HashMap::new(),
            next_id: 0,
            refused: 0,
            last_refusal: None,
        })
    }

    /// Accepts what is waiting, then waits up to [`POLL`] for a connection that passed.
    pub(super) fn poll(&mut self) -> io::Result<Option<Passed>> {
        loop {
            match self.listener.accept() {
                Ok((stream, addr)) => self.start(stream, addr),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        match self.rx.recv_timeout(POLL) {
            Ok((id, Handshake::Passed(s, addr, res))) => {
                if self.pending.remove(&id).is_none() {
                    // Dropped for a newer connection just as it passed: it is gone.
                    return Ok(None);
                }
                Ok(Some((s, addr, res)))
            }
            Ok((id, Handshake::Refused(addr, reason))) => {
                // One dropped for a newer connection was counted then.
                if self.pending.remove(&id).is_some() {
                    self.refuse(addr, reason);
                }
                Ok(None)
            }
            Err(_) => Ok(None),
        }
    }

    fn refuse(&mut self, addr: SocketAddr, reason: String) {
        tracing::warn!(
            "rank {}: refused a connection from {addr}: {reason}",
            self.rank
        );
        self.refused += 1;
        self.last_refusal = Some((addr, reason));
    }

    /// Drops the handshake that waited longest without a word from its peer (else the
    /// oldest) to make room for a new connection.
    fn make_room(&mut self) {
        let victim = self
            .pending
            .iter()
            .min_by_key(|(_, p)| (p.spoke.load(Ordering::SeqCst), p.since))
            .map(|(&id, _)| id);
        if let Some(p) = victim.and_then(|id| self.pending.remove(&id)) {
            // Its thread's read ends at once; what it reports then is ignored.
            let _ = p.stream.shutdown(Shutdown::Both);
            let reason = format!(
                "dropped after {:.1}s {} to make room: {MAX_PENDING_HANDSHAKES} handshakes were in progress",
                p.since.elapsed().as_secs_f64(),
                if p.spoke.load(Ordering::SeqCst) {
                    "without finishing the job-token handshake"
                } else {
                    "without a word"
                }
            );
            self.refuse(p.addr, reason);
        }
    }

    /// For a timeout message: the connections turned away while waiting, if any.
    pub(super) fn refusals(&self) -> String {
        match &self.last_refusal {
            None => String::new(),
            Some((addr, why)) => format!(
                "; meanwhile {} connection(s) were refused, the last from {addr}: {why}",
                self.refused
            ),
        }
    }

    fn start(&mut self, stream: TcpStream, addr: SocketAddr) {
        let handle = match stream.try_clone() {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(
                    "rank {}: dropped a connection from {addr}: cannot hold it: {e}",
                    self.rank
                );
                return;
            }
        };
        if self.pending.len() >= MAX_PENDING_HANDSHAKES {
            self.make_room();
        }
        let (rank, purpose, token, tx) =
            (self.rank, self.purpose, self.token.clone(), self.tx.clone());
        let until = handshake_deadline(self.deadline);
        let spoke = Arc::new(AtomicBool::new(false));
        let id = self.next_id;
        self.next_id += 1;
        let heard = spoke.clone();
        let spawned = thread::Builder::new()
            .name("arbor-handshake".into())
            .spawn(move || {
                let h = handshake(stream, addr, rank, purpose, token.as_ref(), until, &heard);
                let _ = tx.send((id, h));
            });
        match spawned {
            Ok(_) => {
                self.pending.insert(
                    id,
                    Pending {
                        addr,
                        since: Instant::now(),
                        stream: handle,
                        spoke,
                    },
                );
            }
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
/// `spoke` is set once the peer's first handshake frame arrived.
pub(super) fn handshake(
    mut s: TcpStream,
    addr: SocketAddr,
    rank: usize,
    purpose: Purpose,
    token: Option<&JobToken>,
    until: Instant,
    spoke: &AtomicBool,
) -> Handshake {
    let setup = s
        .set_nonblocking(false)
        .and_then(|_| s.set_nodelay(true))
        .and_then(|_| s.set_write_timeout(Some(HANDSHAKE_TIMEOUT)));
    if let Err(e) = setup {
        return Handshake::Refused(addr, format!("cannot set up the connection: {e}"));
    }
    match auth_accept(&mut s, addr, rank, purpose, token, until, spoke) {
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
    spoke: &AtomicBool,
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
    spoke.store(true, Ordering::SeqCst);
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

/// A connection to `peer` (e.g. "rank 0 at host:port"; the first of `addrs` that answers,
/// `what` in an error when none does) that passed the token handshake, by `until`
/// (`timeout`: that limit, for messages). A connection the peer drops before it answers
/// (its gate made room for a newer one) is opened again: strangers at the peer's port
/// delay a real rank, they do not keep it out.
#[allow(clippy::too_many_arguments)]
pub(super) fn connect_authenticated(
    rank: usize,
    addrs: &[SocketAddr],
    what: &str,
    peer: &str,
    purpose: Purpose,
    token: Option<&JobToken>,
    until: Instant,
    timeout: Duration,
) -> Result<TcpStream, CommError> {
    let mut dropped = 0u32;
    loop {
        let mut s = connect_until(rank, addrs, what, until, timeout)?;
        match auth_connect(&mut s, rank, peer, purpose, token, until) {
            Ok(()) => {
                if dropped > 0 {
                    tracing::info!(rank, peer, dropped, "joined after reconnecting");
                }
                return Ok(s);
            }
            Err(Attempt::Dropped(e)) if Instant::now() + RECONNECT_PAUSE < until => {
                dropped += 1;
                tracing::debug!(
                    rank,
                    peer,
                    "connection dropped unanswered ({e}); reconnecting"
                );
                thread::sleep(RECONNECT_PAUSE);
            }
            Err(Attempt::Dropped(e) | Attempt::Failed(e)) => return Err(e),
        }
    }
}

/// Why one try of the connector's handshake failed.
enum Attempt {
    /// The peer closed the connection before it answered: worth another connection.
    Dropped(CommError),
    Failed(CommError),
}

impl From<CommError> for Attempt {
    fn from(e: CommError) -> Self {
        Attempt::Failed(e)
    }
}

/// Whether a read ended because the peer closed or reset the connection.
fn closed(e: &ReadError) -> bool {
    match e {
        ReadError::Closed | ReadError::Truncated { .. } => true,
        ReadError::Io(e) => matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::UnexpectedEof
        ),
        _ => false,
    }
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
) -> Result<(), Attempt> {
    let protocol = |detail: String| CommError::Protocol {
        rank,
        peer: peer.to_string(),
        detail,
    };
    let sent = |e: io::Error| {
        Attempt::Dropped(protocol(format!(
            "closed the connection during the job-token handshake ({e})"
        )))
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
    let read = |s: &TcpStream, want: Kind| -> Result<Frame, Attempt> {
        let f = wire::read_frame(&mut DeadlineReader { s, until }, wire::MAX_CONTROL_LEN).map_err(
            |e| match e {
                ReadError::TimedOut => Attempt::Failed(protocol(
                    "did not answer the job-token handshake before the rendezvous deadline \
                     (ARBOR_TIMEOUT_SECS)"
                        .into(),
                )),
                e if closed(&e) => Attempt::Dropped(read_error(
                    rank,
                    usize::MAX,
                    peer,
                    e,
                    "during the job-token handshake",
                )),
                e => Attempt::Failed(read_error(
                    rank,
                    usize::MAX,
                    peer,
                    e,
                    "during the job-token handshake",
                )),
            },
        )?;
        match f.kind {
            k if k == want => Ok(f),
            Kind::Abort => Err(Attempt::Failed(CommError::Refused {
                rank,
                peer: peer.to_string(),
                reason: String::from_utf8_lossy(&f.payload).into_owned(),
            })),
            k => Err(Attempt::Failed(protocol(format!(
                "expected {want:?} (the job-token handshake), got a {k:?} frame"
            )))),
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
        return Err(Attempt::Failed(CommError::Auth {
            rank,
            peer: peer.to_string(),
            detail: format!(
                "it accepted this rank without proving this job's token; it is not a rank \
                 of this job ({})",
                auth::wrong_token_reason()
            ),
        }));
    }
    Ok(())
}
