//! A link after setup: frames out through the outbox, a reader thread per link draining
//! frames into the collectives' channel, and what a failed read means.

use std::io;
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::Duration;

use crossbeam::channel::Sender;

use crate::message_passing::{Incoming, OpKind, Outbox};
use crate::wire::{self, Kind, ReadError};
use crate::CommError;

pub(super) struct TcpOutbox {
    pub(super) rank: usize,
    /// The sockets' write timeout (the operation timeout), for messages.
    pub(super) timeout: Duration,
    pub(super) writers: Vec<Option<Mutex<TcpStream>>>,
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
pub(super) fn read_loop(rank: usize, peer: usize, mut s: TcpStream, tx: Sender<Incoming>) {
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
pub(super) fn read_error(
    rank: usize,
    peer: usize,
    name: &str,
    e: ReadError,
    context: &str,
) -> CommError {
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
