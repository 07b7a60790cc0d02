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

use arbor_collective::pickled_id::nccl_id_from_pickle;
use arbor_collective::tcp_store::{StoreClient, StoreError};

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
                                "the trainer's NCCL group was not formed within {:.0} s: the trainer's rank 0 publishes the NCCL id under {} when it makes its communicator (at its first collective, e.g. the broadcast of the first tensor, unless it bound a device at init), and every member must join",
                                timeout.as_secs_f64(),
                                p.source
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
    Ok(GroupSlot::Joining(PendingJoin { rx, cancel, source }))
}
