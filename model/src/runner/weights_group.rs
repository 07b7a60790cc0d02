//! A rank's membership of a trainer's NCCL weight-update group (docs/rl.md): joined at
//! once from a unique id the trainer passed over HTTP, or through the trainer's torch
//! `TCPStore`, where the group's rank 0 publishes the id.
//!
//! A torch trainer makes its NCCL communicator at its first collective unless it bound a
//! device at init, and frameworks ask the engine to join before that collective: the id
//! may appear only when the first broadcast starts, or while the trainer's own init waits
//! for this rank. So a rank checks in at the store when asked to join (which the trainer's
//! store waits for), then waits for the id on a thread of its own while it serves, and
//! joins the communicator there; the first receive waits (bounded) for that join.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use arbor_collective::pickled_id::{nccl_id_from_pickle, nccl_id_to_pickle, VLLM_MODULE};
use arbor_collective::stateless_group::{GroupError, StatelessMember};
use arbor_collective::store_server::StoreServer;
use arbor_collective::tcp_store::{stateless_broadcast_key, StoreClient, StoreError};

use crate::backend::{BResult, Backend, BackendError, WeightsGroup};
use crate::batching::IdFormat;
use crate::error::{MResult, ModelError};

/// How long one wait for the id lasts before the thread looks whether it was cancelled.
const POLL: Duration = Duration::from_millis(500);

/// Where a rank reads the id: the store, the key, and how the id is written there.
pub(super) struct StoreSource<'a> {
    pub host: &'a str,
    pub port: u16,
    pub key: &'a str,
    pub format: IdFormat,
}

/// A weight-update group: the NCCL side, the trainer's rank in it, and, where arbor runs
/// the group's store (vLLM style with the trainer last), this rank's membership of it.
pub(super) struct Group {
    pub slot: GroupSlot,
    /// The trainer's group rank: the root of every broadcast.
    pub root: usize,
    pub stateless: Option<Stateless>,
}

impl Group {
    /// A group whose trainer is rank 0 (the rendezvous by id or through its store).
    pub(super) fn trainer_first(slot: GroupSlot) -> Self {
        Group {
            slot,
            root: 0,
            stateless: None,
        }
    }

    /// Leaves the group without waiting for the trainer ([`WeightsGroup::abort`]); a join
    /// still running is cancelled.
    pub(super) fn abort(self) {
        if let GroupSlot::Joined(g) = self.slot {
            g.abort();
        }
    }

    /// vLLM's store barrier, where the group has one (TRL's client and server pass one
    /// after each broadcast).
    pub(super) fn barrier(&mut self, rank: usize, timeout: Duration) -> MResult<()> {
        match &mut self.stateless {
            None => Ok(()),
            Some(s) => s.member.barrier(timeout).map_err(|e| {
                ModelError::Rendezvous(format!(
                    "rank {rank}: the StatelessProcessGroup barrier at the TCPStore {}: {e}",
                    s.member.store_addr()
                ))
            }),
        }
    }
}

/// This rank's part in a vLLM `StatelessProcessGroup` whose store arbor runs.
pub(super) struct Stateless {
    member: StatelessMember,
    /// On rank 0: the store itself, which lives as long as the group.
    _server: Option<StoreServer>,
}

/// A group this rank belongs to, or is joining.
pub(super) enum GroupSlot {
    Joined(Box<dyn WeightsGroup>),
    Joining(PendingJoin),
}

/// A join running on its own thread: the id is awaited in the store, then the
/// communicator made.
pub(super) struct PendingJoin {
    rx: Receiver<BResult<Box<dyn WeightsGroup>>>,
    cancel: Arc<AtomicBool>,
    /// "key K in the TCPStore at ADDR", for errors.
    source: String,
    /// What a join that did not finish in time waited for.
    waits_for: String,
}

impl Drop for PendingJoin {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl GroupSlot {
    /// The joined group, waiting at most `timeout` for a join still running. A join that
    /// has not finished by then keeps running (a later call may find it done).
    pub(super) fn joined(
        &mut self,
        rank: usize,
        timeout: Duration,
    ) -> MResult<&mut Box<dyn WeightsGroup>> {
        if let GroupSlot::Joining(p) = self {
            let g = match p.rx.recv_timeout(timeout) {
                Ok(Ok(g)) => g,
                Ok(Err(source)) => return Err(ModelError::Backend { rank, source }),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(ModelError::Backend {
                        rank,
                        source: BackendError::Device {
                            rank,
                            msg: format!(
                                "the trainer's NCCL group was not formed within {:.0} s: {}",
                                timeout.as_secs_f64(),
                                p.waits_for
                            ),
                        },
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(ModelError::Backend {
                        rank,
                        source: BackendError::Device {
                            rank,
                            msg: format!("the thread joining the trainer's NCCL group through {} ended without an answer", p.source),
                        },
                    })
                }
            };
            *self = GroupSlot::Joined(g);
        }
        match self {
            GroupSlot::Joined(g) => Ok(g),
            GroupSlot::Joining(_) => unreachable!("joined above"),
        }
    }
}

fn store_err(e: StoreError) -> ModelError {
    ModelError::Rendezvous(e.to_string())
}

/// The id as written in the store.
fn decode(format: IdFormat, value: &[u8], source: &str) -> Result<Vec<u8>, String> {
    match format {
        IdFormat::Raw if value.len() == 128 => Ok(value.to_vec()),
        IdFormat::Raw => Err(format!(
            "{source} holds {} bytes, not the 128 of a NCCL unique id",
            value.len()
        )),
        IdFormat::VllmPickle => nccl_id_from_pickle(value)
            .map(|id| id.to_vec())
            .map_err(|e| format!("{source} holds no pickled vLLM ncclUniqueId: {e}")),
    }
}

/// Checks this rank in at the trainer's store as member `group_rank` of `world`, and
/// starts joining the group once the id is there. Where this backend cannot join (CPU
/// ranks), the id is read here and the refusal says what was read: the rendezvous is
/// checked as far as a CPU rank can take it.
pub(super) fn join_through_store<B: Backend>(
    backend: &B,
    src: &StoreSource<'_>,
    world: usize,
    group_rank: usize,
    timeout: Duration,
) -> MResult<GroupSlot> {
    let rank = backend.rank();
    let mut store = StoreClient::connect(src.host, src.port, timeout).map_err(store_err)?;
    let source = format!("key {:?} in the TCPStore at {}", src.key, store.addr());
    store.check_in().map_err(store_err)?;
    let warm_up = src.format == IdFormat::VllmPickle;
    let joiner = match backend.weights_group_joiner(world, group_rank, timeout) {
        Ok(j) => j,
        Err(BackendError::Unsupported(why)) => {
            let value = store.get(src.key, timeout).map_err(store_err)?;
            let id = decode(src.format, &value, &source).map_err(ModelError::Rendezvous)?;
            return Err(ModelError::Backend {
                rank,
                source: BackendError::Unsupported(format!(
                    "read the trainer's {}-byte NCCL unique id (beginning {}) from {source}, but {why}",
                    id.len(),
                    id.iter().take(4).map(|b| format!("{b:02x}")).collect::<String>()
                )),
            });
        }
        Err(e) => return Err(ModelError::Backend { rank, source: e }),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let stop = cancel.clone();
    let key = src.key.to_string();
    let format = src.format;
    let what = source.clone();
    let spawned = std::thread::Builder::new()
        .name("weights-group-rendezvous".into())
        .spawn(move || {
            let failed = |msg: String| BackendError::Device { rank, msg };
            let value = loop {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                match store.get(&key, POLL) {
                    Ok(v) => break v,
                    Err(StoreError::Timeout { .. }) => continue,
                    Err(e) => {
                        let _ = tx.send(Err(failed(format!("waiting for the NCCL id: {e}"))));
                        return;
                    }
                }
            };
            let r = decode(format, &value, &what)
                .map_err(failed)
                .and_then(|id| joiner(&id))
                .and_then(|mut g| {
                    if warm_up {
                        g.warm_up(timeout)?;
                    }
                    Ok(g)
                });
            tracing::info!(
                rank,
                ok = r.is_ok(),
                "weight-update group: {what} read, joined"
            );
            // Nobody waits any more when the group was left meanwhile: the group is
            // dropped here.
            let _ = tx.send(r);
        })
        .map_err(|e| ModelError::Backend {
            rank,
            source: BackendError::Device {
                rank,
                msg: format!("starting the thread that joins the weight-update group: {e}"),
            },
        })?;
    drop(spawned);
    let waits_for = format!("the trainer's rank 0 publishes the NCCL id under {source} when it makes its communicator (at its first collective, e.g. the broadcast of the first tensor, unless it bound a device at init), and every member must join");
    Ok(GroupSlot::Joining(PendingJoin {
        rx,
        cancel,
        source,
        waits_for,
    }))
}

fn group_err(e: GroupError) -> ModelError {
    ModelError::Rendezvous(e.to_string())
}

/// Where the other ranks reach the store rank 0 runs: the address it listens on, or the
/// loopback for a wildcard (the ranks of one server share rank 0's host).
fn reachable(host: &str) -> &str {
    match host.trim_start_matches('[').trim_end_matches(']') {
        "" | "0.0.0.0" => "127.0.0.1",
        "::" => "::1",
        h => h,
    }
}

/// Joins a vLLM-style group in which this server's ranks come first and the trainer is
/// the last of `world` (TRL's vLLM client): rank 0 runs the group's `TCPStore` on
/// `host:port`, makes the NCCL id and publishes it as `PyNcclCommunicator` does; the other
/// ranks read it there. Every rank then joins the communicator on a thread of its own (it
/// forms when the trainer joins, after this call answers) and warms it up.
pub(super) fn join_serving_store<B: Backend>(
    backend: &B,
    host: &str,
    port: u16,
    world: usize,
    group_rank: usize,
    timeout: Duration,
) -> MResult<Group> {
    let rank = backend.rank();
    let berr = |source| ModelError::Backend { rank, source };
    // A rank that cannot join says so before anything listens or waits.
    let joiner = backend
        .weights_group_joiner(world, group_rank, timeout)
        .map_err(berr)?;
    let id = match group_rank {
        0 => Some(backend.weights_group_unique_id().map_err(berr)?),
        _ => None,
    };
    let server = match group_rank {
        0 => {
            Some(StoreServer::bind(host, port).map_err(|e| ModelError::Rendezvous(e.to_string()))?)
        }
        _ => None,
    };
    let connect = |what: &str| {
        let c = StoreClient::connect(reachable(host), port, timeout).map_err(store_err)?;
        tracing::debug!(
            rank,
            "weight-update group: {what} connected to {}",
            c.addr()
        );
        Ok::<_, ModelError>(c)
    };
    let mut member = {
        let mut c = connect("the member")?;
        c.check_in().map_err(store_err)?;
        StatelessMember::new(c, group_rank, world)
    };
    let key = stateless_broadcast_key(0, 0);
    let source = format!("key {key:?} in the TCPStore at {}", member.store_addr());
    let slot = match id {
        Some(id) => {
            member
                .broadcast_send(&nccl_id_to_pickle(&id, VLLM_MODULE))
                .map_err(group_err)?;
            spawn_join(
                rank,
                joiner,
                true,
                timeout,
                source,
                move |_| Ok(id.to_vec()),
            )?
        }
        None => {
            // The id is broadcast 0 from rank 0: the member has read it once the thread has.
            member.count_received(0);
            let mut c = connect("the id reader")?;
            spawn_join(rank, joiner, true, timeout, source.clone(), move |stop| {
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return Err(None);
                    }
                    match c.get(&key, POLL) {
                        Ok(v) => {
                            return decode(IdFormat::VllmPickle, &v, &source).map_err(Some);
                        }
                        Err(StoreError::Timeout { .. }) => continue,
                        Err(e) => return Err(Some(format!("waiting for the NCCL id: {e}"))),
                    }
                }
            })?
        }
    };
    Ok(Group {
        slot,
        root: world - 1,
        stateless: Some(Stateless {
            member,
            _server: server,
        }),
    })
}

/// Starts the thread that gets the id with `id` (`Err(None)`: cancelled), joins and
/// (with `warm_up`) warms the communicator up.
fn spawn_join(
    rank: usize,
    joiner: crate::backend::WeightsGroupJoiner,
    warm_up: bool,
    timeout: Duration,
    source: String,
    id: impl FnOnce(&AtomicBool) -> Result<Vec<u8>, Option<String>> + Send + 'static,
) -> MResult<GroupSlot> {
    let (tx, rx) = std::sync::mpsc::channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let stop = cancel.clone();
    let what = source.clone();
    std::thread::Builder::new()
        .name("weights-group-join".into())
        .spawn(move || {
            let failed = |msg: String| BackendError::Device { rank, msg };
            let id = match id(&stop) {
                Ok(id) => id,
                Err(None) => return,
                Err(Some(msg)) => {
                    let _ = tx.send(Err(failed(msg)));
                    return;
                }
            };
            let r = joiner(&id).and_then(|mut g| {
                if warm_up {
                    g.warm_up(timeout)?;
                }
                Ok(g)
            });
            tracing::info!(rank, ok = r.is_ok(), "weight-update group: {what}, joined");
            let _ = tx.send(r);
        })
        .map_err(|e| ModelError::Backend {
            rank,
            source: BackendError::Device {
                rank,
                msg: format!("starting the thread that joins the weight-update group: {e}"),
            },
        })?;
    let waits_for = format!("arbor's rank 0 published the NCCL id under {source}, and the communicator forms when the trainer, the group's last rank, joins it (its StatelessProcessGroup.create and PyNcclCommunicator, after /init_communicator/ answered)");
    Ok(GroupSlot::Joining(PendingJoin {
        rx,
        cancel,
        source,
        waits_for,
    }))
}
