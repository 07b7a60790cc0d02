//! The in-process transport: `world` ranks as threads of one process, linked by crossbeam
//! channels. For unit tests of everything above the transport (tree all-reduce, model
//! sharding) without sockets.

use std::time::Duration;

use crossbeam::channel::{unbounded, Receiver, Sender};

use crate::message_passing::{message_communicator, Incoming, MessageCollectives, OpKind, Outbox};
use crate::CommError;

/// Builds the ranks of an in-process group.
pub struct InProcGroup;

impl InProcGroup {
    /// One communicator per rank (index = rank), with a 60 s operation timeout. Move each
    /// into its own thread; dropping one looks like a disconnected peer to the others.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world: usize) -> Vec<InProcComm> {
        Self::with_timeout(world, Duration::from_secs(60))
    }

    /// Like [`InProcGroup::new`] with a given timeout for every operation.
    pub fn with_timeout(world: usize, timeout: Duration) -> Vec<InProcComm> {
        // links[src][dst]: what src sends to dst.
        let mut senders: Vec<Vec<Option<Sender<Incoming>>>> = (0..world)
            .map(|_| (0..world).map(|_| None).collect())
            .collect();
        let mut receivers: Vec<Vec<Option<Receiver<Incoming>>>> = (0..world)
            .map(|_| (0..world).map(|_| None).collect())
            .collect();
        for (src, row) in senders.iter_mut().enumerate() {
            for (dst, slot) in row.iter_mut().enumerate() {
                if src != dst {
                    let (tx, rx) = unbounded();
                    *slot = Some(tx);
                    receivers[dst][src] = Some(rx);
                }
            }
        }
        senders
            .into_iter()
            .zip(receivers)
            .enumerate()
            .map(|(rank, (to, from))| InProcComm {
                collectives: MessageCollectives::new(
                    rank,
                    world,
                    timeout,
                    InProcOutbox { rank, to },
                    from,
                ),
            })
            .collect()
    }
}

struct InProcOutbox {
    rank: usize,
    to: Vec<Option<Sender<Incoming>>>,
}

impl Outbox for InProcOutbox {
    fn send(&self, peer: usize, kind: OpKind, seq: u64, payload: &[u8]) -> Result<(), CommError> {
        let tx = self.to.get(peer).and_then(|t| t.as_ref()).ok_or_else(|| {
            CommError::InvalidArgument {
                rank: self.rank,
                detail: format!("no link to rank {peer}"),
            }
        })?;
        tx.send(Incoming::Data {
            kind,
            seq,
            payload: payload.to_vec(),
        })
        .map_err(|_| CommError::PeerDisconnected {
            rank: self.rank,
            peer,
            context: format!("while sending {kind} #{seq}"),
        })
    }

    fn abort(&self, peer: usize, reason: &str) {
        if let Some(Some(tx)) = self.to.get(peer) {
            let _ = tx.send(Incoming::Abort(reason.to_string()));
        }
    }
}

/// One rank of an [`InProcGroup`].
pub struct InProcComm {
    collectives: MessageCollectives<InProcOutbox>,
}

message_communicator!(InProcComm, "inproc");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Communicator;
    use std::thread;

    /// Runs `f` on every rank of an in-process group of `world`, returns results by rank.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        timeout: Duration,
        f: impl Fn(InProcComm) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let handles: Vec<_> = InProcGroup::with_timeout(world, timeout)
            .into_iter()
            .map(|c| {
                let f = f.clone();
                thread::spawn(move || f(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_gather_broadcast_barrier() {
        for world in [1usize, 2, 3, 8] {
            let out = on_ranks(world, Duration::from_secs(10), |c| {
                let r = c.rank() as u8;
                let g = c.all_gather_bytes(&[r, r + 100]).unwrap();
                let mut b = if c.rank() == world_last(&c) {
                    b"from the root".to_vec()
                } else {
                    vec![r; c.rank()]
                };
                c.broadcast_bytes(&mut b, world_last(&c)).unwrap();
                c.barrier().unwrap();
                (g, b)
            });
            let expect: Vec<u8> = (0..world as u8).flat_map(|r| [r, r + 100]).collect();
            for (g, b) in out {
                assert_eq!(g, expect, "world {world}");
                assert_eq!(b, b"from the root");
            }
        }
    }

    fn world_last(c: &InProcComm) -> usize {
        c.world_size() - 1
    }

    #[test]
    fn missing_rank_times_out_naming_it() {
        let out = on_ranks(4, Duration::from_millis(200), |c| {
            if c.rank() == 2 {
                // Stays alive but never joins the collective.
                thread::sleep(Duration::from_millis(600));
                return None;
            }
            Some(c.all_gather_bytes(&[1]).unwrap_err())
        });
        match &out[0] {
            Some(CommError::OpTimeout { missing, .. }) => assert_eq!(missing, &vec![2]),
            other => panic!("expected a timeout naming rank 2, got {other:?}"),
        }
    }

    #[test]
    fn dropped_rank_is_a_disconnect_and_later_calls_fail() {
        let out = on_ranks(3, Duration::from_secs(10), |c| {
            if c.rank() == 1 {
                drop(c);
                return (None, None);
            }
            let first = c.all_gather_bytes(&[1]).unwrap_err();
            let second = c.barrier().unwrap_err();
            (Some(first), Some(second))
        });
        for (rank, (first, second)) in out.into_iter().enumerate() {
            if rank == 1 {
                continue;
            }
            // Either the disconnect itself, or the other survivor's abort naming it.
            let msg = first.unwrap().to_string();
            assert!(msg.contains("rank 1"), "rank {rank}: {msg}");
            assert!(matches!(second, Some(CommError::Poisoned { .. })));
        }
    }

    #[test]
    fn mismatched_calls_and_lengths_are_errors_on_every_rank() {
        let out = on_ranks(2, Duration::from_secs(10), |c| {
            if c.rank() == 0 {
                c.all_gather_bytes(&[1, 2]).unwrap_err().to_string()
            } else {
                c.all_gather_bytes(&[1, 2, 3]).unwrap_err().to_string()
            }
        });
        assert!(out[0].contains("rank 1 contributed 3 bytes"), "{}", out[0]);
        assert!(out[1].contains("rank 0 contributed 2 bytes"), "{}", out[1]);

        let out = on_ranks(2, Duration::from_secs(10), |c| {
            if c.rank() == 0 {
                c.barrier().unwrap_err().to_string()
            } else {
                c.all_gather_bytes(&[1]).unwrap_err().to_string()
            }
        });
        for msg in out {
            assert!(msg.contains("while this rank is in"), "{msg}");
        }
    }

    #[test]
    fn bad_broadcast_root_is_an_error() {
        let c = InProcGroup::new(1).pop().unwrap();
        let err = c.broadcast_bytes(&mut vec![], 3).unwrap_err();
        assert!(err.to_string().contains("root 3"), "{err}");
    }
}
