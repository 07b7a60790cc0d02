//! The collective algorithms shared by the in-process and TCP transports.
//!
//! A transport supplies an [`Outbox`] (send one message to one peer) and, per peer, a
//! channel of [`Incoming`] messages in the order that peer sent them. The collectives number
//! every collective call; a message carries that number and the operation's kind, so a peer
//! that is out of step or calls a different collective is reported instead of silently
//! mixing buffers. Every wait has a deadline and a timeout names the ranks still missing.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Select};

use crate::CommError;

/// The collective a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Gather,
    Broadcast { root: usize },
    Barrier,
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpKind::Gather => write!(f, "all_gather"),
            OpKind::Broadcast { root } => write!(f, "broadcast from rank {root}"),
            OpKind::Barrier => write!(f, "barrier"),
        }
    }
}

/// What arrives from one peer.
#[derive(Debug)]
pub(crate) enum Incoming {
    Data {
        kind: OpKind,
        seq: u64,
        payload: Vec<u8>,
    },
    /// The peer gave up; the reason is its own error message.
    Abort(String),
    /// The link to the peer failed (disconnect, garbage); the transport's error.
    Failed(CommError),
}

/// `Communicator` for a transport struct whose `collectives` field does all the work: the
/// in-process and TCP transports differ only in their `Outbox` and their name.
macro_rules! message_communicator {
    ($ty:ty, $transport:literal) => {
        impl $crate::Communicator for $ty {
            fn rank(&self) -> usize {
                self.collectives.rank()
            }
            fn world_size(&self) -> usize {
                self.collectives.world()
            }
            fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<u8>, $crate::CommError> {
                self.collectives.all_gather(data)
            }
            fn broadcast_bytes(
                &self,
                data: &mut Vec<u8>,
                root: usize,
            ) -> Result<(), $crate::CommError> {
                self.collectives.broadcast(data, root)
            }
            fn barrier(&self) -> Result<(), $crate::CommError> {
                self.collectives.barrier_within(self.collectives.timeout())
            }
            fn transport(&self) -> &'static str {
                $transport
            }
        }
    };
}
pub(crate) use message_communicator;

/// Sends to one peer. Implementations must not block forever (a write timeout at most).
pub(crate) trait Outbox: Send + Sync {
    fn send(&self, peer: usize, kind: OpKind, seq: u64, payload: &[u8]) -> Result<(), CommError>;
    /// Best effort: tells `peer` this rank gives up. Errors are ignored.
    fn abort(&self, peer: usize, reason: &str);
}

struct State {
    seq: u64,
    poisoned: Option<String>,
}

pub(crate) struct MessageCollectives<O: Outbox> {
    rank: usize,
    world: usize,
    timeout: Duration,
    out: O,
    /// `inbox[p]`: messages from peer p (None for this rank).
    inbox: Vec<Option<Receiver<Incoming>>>,
    /// Held for the whole of an operation: calls are serialised, as the contract requires.
    state: Mutex<State>,
}

impl<O: Outbox> MessageCollectives<O> {
    pub(crate) fn new(
        rank: usize,
        world: usize,
        timeout: Duration,
        out: O,
        inbox: Vec<Option<Receiver<Incoming>>>,
    ) -> Self {
        debug_assert_eq!(inbox.len(), world);
        Self {
            rank,
            world,
            timeout,
            out,
            inbox,
            state: Mutex::new(State {
                seq: 0,
                poisoned: None,
            }),
        }
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs one collective under the state lock: numbering, poisoning, abort on failure.
    fn run<T>(&self, body: impl FnOnce(u64) -> Result<T, CommError>) -> Result<T, CommError> {
        let mut st = match self.state.lock() {
            Ok(g) => g,
            // A panic in another thread mid-operation leaves the group out of step.
            Err(p) => p.into_inner(),
        };
        if let Some(reason) = &st.poisoned {
            return Err(CommError::Poisoned {
                rank: self.rank,
                reason: reason.clone(),
            });
        }
        st.seq += 1;
        let result = body(st.seq);
        if let Err(e) = &result {
            let reason = e.to_string();
            tracing::debug!(rank = self.rank, error = %reason, "collective failed; aborting group");
            // A rank that merely relays another's abort need not tell everyone again.
            if !matches!(e, CommError::PeerAborted { .. }) {
                for p in (0..self.world).filter(|&p| p != self.rank) {
                    self.out.abort(p, &reason);
                }
            }
            st.poisoned = Some(reason);
        }
        result
    }

    pub(crate) fn all_gather(&self, data: &[u8]) -> Result<Vec<u8>, CommError> {
        self.gather_kind(data, OpKind::Gather, self.timeout)
    }

    pub(crate) fn barrier_within(&self, timeout: Duration) -> Result<(), CommError> {
        self.gather_kind(&[], OpKind::Barrier, timeout).map(|_| ())
    }

    fn gather_kind(
        &self,
        data: &[u8],
        kind: OpKind,
        timeout: Duration,
    ) -> Result<Vec<u8>, CommError> {
        self.run(|seq| {
            let deadline = Instant::now() + timeout;
            for p in (0..self.world).filter(|&p| p != self.rank) {
                self.out
                    .send(p, kind, seq, data)
                    .map_err(|e| self.explain(p, e))?;
            }
            let peers: Vec<usize> = (0..self.world).filter(|&p| p != self.rank).collect();
            let got = self.collect(&peers, kind, seq, deadline, timeout)?;
            let mut out = Vec::with_capacity(data.len() * self.world);
            let mut parts: Vec<Option<Vec<u8>>> = (0..self.world).map(|_| None).collect();
            for (p, payload) in got {
                if payload.len() != data.len() {
                    return Err(CommError::LengthMismatch {
                        rank: self.rank,
                        peer: p,
                        op: format!("{kind} #{seq}"),
                        got: payload.len(),
                        expected: data.len(),
                    });
                }
                parts[p] = Some(payload);
            }
            for (p, part) in parts.iter().enumerate() {
                match part {
                    Some(b) => out.extend_from_slice(b),
                    None if p == self.rank => out.extend_from_slice(data),
                    None => {
                        return Err(CommError::PeerDisconnected {
                            rank: self.rank,
                            peer: p,
                            context: format!("before its part of {kind} #{seq} arrived"),
                        })
                    }
                }
            }
            Ok(out)
        })
    }

    pub(crate) fn broadcast(&self, data: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        if root >= self.world {
            return Err(CommError::InvalidArgument {
                rank: self.rank,
                detail: format!(
                    "broadcast root {root} is not a rank of a world of {}",
                    self.world
                ),
            });
        }
        let kind = OpKind::Broadcast { root };
        self.run(|seq| {
            if self.rank == root {
                for p in (0..self.world).filter(|&p| p != self.rank) {
                    self.out
                        .send(p, kind, seq, data)
                        .map_err(|e| self.explain(p, e))?;
                }
                return Ok(());
            }
            let deadline = Instant::now() + self.timeout;
            let mut got = self.collect(&[root], kind, seq, deadline, self.timeout)?;
            if let Some((_, payload)) = got.pop() {
                *data = payload;
            }
            Ok(())
        })
    }

    /// A send to `peer` failed: if it told us why it left (an abort waiting in its
    /// channel), that reason is the better error, because it names the root cause.
    fn explain(&self, peer: usize, err: CommError) -> CommError {
        if let Some(rx) = self.inbox.get(peer).and_then(Option::as_ref) {
            while let Ok(msg) = rx.try_recv() {
                if let Incoming::Abort(reason) = msg {
                    return CommError::PeerAborted {
                        rank: self.rank,
                        peer,
                        reason,
                    };
                }
            }
        }
        err
    }

    /// Receives this operation's message from each of `peers`.
    fn collect(
        &self,
        peers: &[usize],
        kind: OpKind,
        seq: u64,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Vec<(usize, Vec<u8>)>, CommError> {
        let mut pending: Vec<usize> = peers.to_vec();
        let mut got = Vec::with_capacity(peers.len());
        while !pending.is_empty() {
            let receivers: Vec<&Receiver<Incoming>> = pending
                .iter()
                .map(|&p| {
                    self.inbox[p]
                        .as_ref()
                        .ok_or_else(|| CommError::InvalidArgument {
                            rank: self.rank,
                            detail: format!("no link to rank {p}"),
                        })
                })
                .collect::<Result<_, _>>()?;
            let mut sel = Select::new();
            for r in &receivers {
                sel.recv(r);
            }
            let oper = match sel.select_deadline(deadline) {
                Ok(o) => o,
                Err(_) => {
                    return Err(CommError::OpTimeout {
                        rank: self.rank,
                        op: format!("{kind} #{seq}"),
                        timeout,
                        missing: pending,
                    })
                }
            };
            let i = oper.index();
            let peer = pending[i];
            match oper.recv(receivers[i]) {
                Err(_) => {
                    return Err(CommError::PeerDisconnected {
                        rank: self.rank,
                        peer,
                        context: format!("during {kind} #{seq}"),
                    })
                }
                Ok(Incoming::Failed(e)) => return Err(e),
                Ok(Incoming::Abort(reason)) => {
                    return Err(CommError::PeerAborted {
                        rank: self.rank,
                        peer,
                        reason,
                    })
                }
                Ok(Incoming::Data {
                    kind: k,
                    seq: s,
                    payload,
                }) => {
                    if k != kind || s != seq {
                        return Err(CommError::Protocol {
                            rank: self.rank,
                            peer: format!("rank {peer}"),
                            detail: format!(
                                "it is in {k} #{s} while this rank is in {kind} #{seq} \
                                 (ranks must make the same collective calls in the same order)"
                            ),
                        });
                    }
                    got.push((peer, payload));
                    pending.remove(i);
                }
            }
        }
        Ok(got)
    }
}
