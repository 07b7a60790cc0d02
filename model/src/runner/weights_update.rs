//! Weights that change while a server runs (RL rollouts): a checkpoint from disk, tensors
//! a trainer pushes over HTTP, or tensors it broadcasts over NCCL replace every rank's
//! shard, atomically across the ranks (docs/rl.md).
//!
//! Every command ([`ControlMsg`]) runs in two phases on every rank ([`run_control`]):
//! 1. **prepare**: the rank does everything that can fail without touching what it serves
//!    with: it reads the checkpoint (or the staged tensors) and cuts its shard into new
//!    buffers (a second copy of its weights, [`Model::load`] exactly as at start, which
//!    checks names, shapes, dtypes and that every value is finite), allocates, joins a
//!    group;
//! 2. the ranks exchange their outcomes (an all-gather), and **finish**: all of them apply
//!    (swap the prepared model in, drop the recorded steps) or all of them undo.
//!
//! A failure on any rank therefore leaves the old weights serving on every rank, and all
//! ranks report the same error.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use arbor_collective::Communicator;

use super::weights_group::{join_serving_store, join_through_store, Group, GroupSlot, StoreSource};
use super::Worker;
use crate::backend::{Backend, DeviceTensor, KvSpec};
use crate::batching::{ControlMsg, Rendezvous, UpdateSource};
use crate::config::ModelConfig;
use crate::error::{MResult, ModelError};
use crate::forward::{HeadPlan, Model};
use crate::layers::LoadCtx;
use crate::safetensors::SafeFile;
use crate::weights::WeightStore;

/// Where device-resident staged tensors came from, as errors about them name it.
pub(super) const NCCL_LABEL: &str = "tensors received over NCCL";
pub(super) const IN_BAND_LABEL: &str = "tensors received over NCCL (prime-rl)";
pub(super) const IPC_LABEL: &str = "tensors handed over by CUDA IPC";

/// Where the serving weights came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A model directory: `resume_memory` can read it again.
    Disk(PathBuf),
    /// Tensors a trainer pushed: there is no copy to read again.
    Pushed,
}

/// What a rank holds, for reports (identical on every rank after every command).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightsState {
    pub weights_loaded: bool,
    pub kv_loaded: bool,
    pub origin: Origin,
    pub staged_tensors: usize,
    pub staged_bytes: usize,
    /// The NCCL group joined with a trainer, if any.
    pub group: Option<String>,
    /// How many tensors the model reads (a full push stages them all).
    pub model_tensors: usize,
    /// Elements of every tensor the model reads (the size of a full push).
    pub model_elements: usize,
    /// Elements of the largest of them (the smallest part a push can be cut into).
    pub largest_tensor_elements: usize,
}

/// An engine's weight-update state.
pub(super) struct Updates<B: Backend> {
    /// Every tensor the model reads and the shape it reads it as (recorded by the load).
    expected: BTreeMap<String, Vec<usize>>,
    origin: Origin,
    /// Tensors pushed for the next update, whole (each rank cuts its shard at `Update`):
    /// in host memory (pushed over HTTP), or in the backend's (received over NCCL).
    staged: Vec<SafeFile>,
    pub(super) staged_device: Vec<(String, DeviceTensor)>,
    staged_names: HashSet<String>,
    staged_bytes: usize,
    /// Phase one's result, until phase two.
    candidate: Option<(Model<B>, Origin)>,
    /// A resumed KV cache (the size it had), until phase two.
    new_session: Option<(super::Caches<B>, super::KvCapacity)>,
    new_group: Option<(String, Group)>,
    pub(super) group: Option<(String, Group)>,
    /// The KV cache was freed to make room for the update's second copy: phase two makes
    /// it again (`UpdateMemory`).
    cache_freed: bool,
}

impl<B: Backend> Updates<B> {
    pub(super) fn new(expected: BTreeMap<String, Vec<usize>>, dir: &Path) -> Self {
        Updates {
            expected,
            origin: Origin::Disk(dir.to_path_buf()),
            staged: Vec::new(),
            staged_device: Vec::new(),
            staged_names: HashSet::new(),
            staged_bytes: 0,
            candidate: None,
            new_session: None,
            new_group: None,
            group: None,
            cache_freed: false,
        }
    }

    fn discard_staged(&mut self) {
        self.staged.clear();
        self.staged_device.clear();
        self.staged_names.clear();
        self.staged_bytes = 0;
    }
}

impl<B: Backend> Drop for Updates<B> {
    /// The engine is ending: a group still joined is left without waiting for the trainer
    /// (`destroy_weights_update_group` destroys it properly, on a thread of its own; here
    /// the process may exit before such a thread finishes).
    fn drop(&mut self) {
        for (_, g) in self.group.take().into_iter().chain(self.new_group.take()) {
            g.abort();
        }
    }
}

/// Tensors a pushed checkpoint may hold that the model does not read: dropped, not
/// refused (a trainer's `state_dict()` lists a tied head twice, and older transformers
/// stored RoPE's inverse frequencies).
fn ignorable(name: &str, cfg: &ModelConfig) -> bool {
    (cfg.tie_word_embeddings && name == "lm_head.weight") || name.ends_with("rotary_emb.inv_freq")
}

/// How a phase-one failure should be reported to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The input (checkpoint, tensors, request) is wrong: a 4xx.
    Input,
    /// The command does not fit the server's state (weights released, no group): 409.
    State,
    /// The device or the transport failed: 5xx.
    Server,
}

impl FailureKind {
    fn of(e: &ModelError) -> Self {
        match e {
            ModelError::Io { .. }
            | ModelError::Config { .. }
            | ModelError::UnknownArch { .. }
            | ModelError::Gguf { .. }
            | ModelError::Tokenizer { .. }
            | ModelError::Safetensors { .. }
            | ModelError::MissingTensor { .. }
            | ModelError::ShapeMismatch { .. }
            | ModelError::DtypeUnsupported { .. }
            | ModelError::BadRequest { .. }
            | ModelError::Rendezvous(_)
            | ModelError::Backend {
                source: crate::backend::BackendError::Unsupported(_),
                ..
            } => FailureKind::Input,
            ModelError::Unavailable(_) => FailureKind::State,
            _ => FailureKind::Server,
        }
    }

    fn code(self) -> u8 {
        match self {
            FailureKind::Input => 1,
            FailureKind::State => 2,
            FailureKind::Server => 3,
        }
    }

    fn from_code(c: u8) -> Self {
        match c {
            1 => FailureKind::Input,
            2 => FailureKind::State,
            _ => FailureKind::Server,
        }
    }
}

/// A command that did not apply: nothing changed on any rank. One entry per rank that
/// failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlError {
    pub kind: FailureKind,
    pub failures: Vec<(usize, String)>,
}

impl std::fmt::Display for ControlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Every rank usually fails the same way: say it once.
        let first = &self.failures[0].1;
        if self.failures.len() > 1 && self.failures.iter().all(|(_, m)| m == first) {
            let ranks: Vec<String> = self.failures.iter().map(|(r, _)| r.to_string()).collect();
            return write!(f, "{first} (ranks {})", ranks.join(", "));
        }
        let parts: Vec<String> = self
            .failures
            .iter()
            .map(|(r, m)| format!("rank {r}: {m}"))
            .collect();
        write!(f, "{}", parts.join("; "))
    }
}

impl std::error::Error for ControlError {}

/// The two phases of `msg` on this rank, with every rank of `comm` doing the same:
/// `Ok` when all ranks applied it, else the failures of every rank (nothing changed
/// anywhere). `Err(ModelError)` only when the ranks could not exchange their outcomes
/// (a rank is gone): the group is then broken.
pub fn run_control(
    runner: &mut dyn super::Runner,
    comm: &dyn Communicator,
    mut msg: ControlMsg,
) -> MResult<Result<(), ControlError>> {
    let local = runner.control_prepare(&mut msg);
    let msg = &msg;
    if let Err(e) = &local {
        tracing::warn!(rank = comm.rank(), what = msg.what(), "{e}");
    }
    let all = gather_outcomes(comm, local.as_ref().err())?;
    let ok = all.iter().all(Option::is_none);
    runner.control_finish(msg, ok);
    if ok {
        return Ok(Ok(()));
    }
    let kind = all
        .iter()
        .flatten()
        .map(|(k, _)| *k)
        .max_by_key(|k| k.code())
        .unwrap_or(FailureKind::Server);
    let failures = all
        .into_iter()
        .enumerate()
        .filter_map(|(r, o)| o.map(|(_, m)| (r, m)))
        .collect();
    Ok(Err(ControlError { kind, failures }))
}

/// Every rank's phase-one outcome, in rank order (`None`: succeeded).
fn gather_outcomes(
    comm: &dyn Communicator,
    local: Option<&ModelError>,
) -> MResult<Vec<Option<(FailureKind, String)>>> {
    let rank = comm.rank();
    let coll = |source| ModelError::Backend {
        rank,
        source: crate::backend::BackendError::Collective { rank, source },
    };
    // The all-gather takes equal lengths: first the lengths, then the padded messages.
    let (code, text) = match local {
        None => (0u8, String::new()),
        Some(e) => (FailureKind::of(e).code(), e.to_string()),
    };
    let text = text.into_bytes();
    let heads = comm
        .all_gather_u64(((code as u64) << 32) | text.len() as u64)
        .map_err(coll)?;
    let width = heads
        .iter()
        .map(|h| (h & 0xffff_ffff) as usize)
        .max()
        .unwrap_or(0);
    let mut padded = text.clone();
    padded.resize(width, 0);
    let texts = comm.all_gather_bytes(&padded).map_err(coll)?;
    Ok(heads
        .iter()
        .enumerate()
        .map(|(r, &h)| {
            let code = (h >> 32) as u8;
            let len = (h & 0xffff_ffff) as usize;
            (code != 0).then(|| {
                let bytes = texts.get(r * width..r * width + len).unwrap_or_default();
                (
                    FailureKind::from_code(code),
                    String::from_utf8_lossy(bytes).into_owned(),
                )
            })
        })
        .collect())
}

impl<B: Backend> Worker<B> {
    pub(super) fn weights_state(&self) -> WeightsState {
        let sizes = || {
            self.updates
                .expected
                .values()
                .map(|s| s.iter().product::<usize>())
        };
        WeightsState {
            weights_loaded: self.model.is_some(),
            kv_loaded: self.cache.is_some(),
            origin: self.updates.origin.clone(),
            staged_tensors: self.updates.staged_names.len(),
            staged_bytes: self.updates.staged_bytes,
            group: self.updates.group.as_ref().map(|(n, _)| n.clone()),
            model_tensors: self.updates.expected.len(),
            model_elements: sizes().sum(),
            largest_tensor_elements: sizes().max().unwrap_or(0),
        }
    }

    pub(super) fn weight_shapes(&self) -> BTreeMap<String, Vec<usize>> {
        self.updates.expected.clone()
    }

    /// This rank's paged KV cache of `blocks` blocks (the weights are not needed for it).
    pub(super) fn kv_spec(&self, blocks: usize) -> MResult<KvSpec> {
        let heads = HeadPlan::new(&self.cfg, self.backend.rank(), self.backend.world_size())?;
        Ok(KvSpec {
            layers: self.cfg.num_layers,
            blocks,
            n_kv_heads: heads.n_kv_heads,
            head_dim: self.cfg.head_dim,
        })
    }

    /// Phase one of `msg` on this rank.
    pub(super) fn control_prepare(&mut self, msg: &mut ControlMsg) -> MResult<()> {
        if self.shadow.is_some() {
            return Err(ModelError::Unavailable(
                "weights cannot change under --shadow-tp1".into(),
            ));
        }
        match msg {
            ControlMsg::Stage { label, bytes } => {
                let file = SafeFile::from_bytes(Path::new(label), std::mem::take(bytes))?;
                self.stage(vec![file], Vec::new(), "")
            }
            ControlMsg::StageIpc { ranks } => self.stage_ipc(ranks),
            ControlMsg::Receive {
                group,
                tensors,
                timeout_s,
                packed,
            } => self.receive(group, tensors, *packed, Duration::from_secs_f64(*timeout_s)),
            ControlMsg::ReceiveInBand {
                group,
                timeout_s,
                max_bytes,
            } => self.receive_in_band(group, Duration::from_secs_f64(*timeout_s), *max_bytes),
            ControlMsg::Discard | ControlMsg::FlushCache => Ok(()),
            ControlMsg::Update(src) => {
                self.make_room_for_update()?;
                self.prepare_model(src)
            }
            ControlMsg::Release { .. } => Ok(()),
            ControlMsg::Resume { weights, kv, from } => {
                if *weights && self.model.is_none() {
                    let src = match (from, &self.updates.origin) {
                        (Some(dir), _) => UpdateSource::Disk(dir.clone()),
                        (None, Origin::Disk(dir)) => UpdateSource::Disk(dir.clone()),
                        (None, Origin::Pushed) => {
                            return Err(ModelError::Unavailable(
                                "the released weights came from a push and have no copy on disk: give model_path, or push new weights (update_weights_from_tensor / _distributed) before resuming"
                                    .into(),
                            ))
                        }
                    };
                    self.prepare_model(&src)?;
                }
                if *kv && self.cache.is_none() {
                    // The same blocks as before: the serving scheduler's pool.
                    let Some(cap) = self.kv_shape.clone() else {
                        return Ok(());
                    };
                    if self.model.is_none() && self.updates.candidate.is_none() {
                        return Err(ModelError::Unavailable(
                            "the KV cache cannot come back before the weights: resume the weights too (or push new ones)".into(),
                        ));
                    }
                    let caches = self.alloc_caches(cap.blocks)?;
                    self.updates.new_session = Some((caches, cap));
                }
                Ok(())
            }
            ControlMsg::JoinGroup {
                name,
                rendezvous,
                world,
                rank_offset,
                timeout_s,
            } => {
                if let Some((g, _)) = &self.updates.group {
                    return Err(ModelError::Unavailable(format!(
                        "already in the weight-update group {g:?}: destroy it first"
                    )));
                }
                let rank = *rank_offset + self.backend.rank();
                if rank >= *world {
                    return Err(ModelError::BadRequest {
                        id: 0,
                        msg: format!(
                            "rank_offset {rank_offset} + this rank {} is outside a group of world_size {world}",
                            self.backend.rank()
                        ),
                    });
                }
                let timeout = Duration::from_secs_f64(*timeout_s);
                let slot = match rendezvous {
                    Rendezvous::UniqueId(id) => Group::trainer_first(GroupSlot::Joined(
                        self.backend
                            .join_weights_group(id, *world, rank, timeout)
                            .map_err(|e| self.berr(e))?,
                    )),
                    Rendezvous::Serve { host, port } => {
                        join_serving_store(&self.backend, host, *port, *world, rank, timeout)?
                    }
                    Rendezvous::Store {
                        host,
                        port,
                        key,
                        format,
                    } => {
                        let src = StoreSource {
                            host,
                            port: *port,
                            key,
                            format: *format,
                        };
                        Group::trainer_first(join_through_store(
                            &self.backend,
                            &src,
                            *world,
                            rank,
                            timeout,
                        )?)
                    }
                };
                self.updates.new_group = Some((name.clone(), slot));
                Ok(())
            }
            ControlMsg::LeaveGroup { name } => match &self.updates.group {
                Some((g, _)) if g == name => Ok(()),
                Some((g, _)) => Err(ModelError::BadRequest {
                    id: 0,
                    msg: format!("no weight-update group {name:?} (the group is {g:?})"),
                }),
                None => Err(ModelError::Unavailable(format!(
                    "no weight-update group {name:?} (none was initialised)"
                ))),
            },
        }
    }

    /// Phase two of `msg`: `apply` when every rank's phase one succeeded, else undo.
    pub(super) fn control_finish(&mut self, msg: &ControlMsg, apply: bool) {
        let u = &mut self.updates;
        match msg {
            ControlMsg::Stage { .. }
            | ControlMsg::StageIpc { .. }
            | ControlMsg::Receive { .. }
            | ControlMsg::ReceiveInBand { .. } => {
                // A part that failed anywhere makes the whole push start over: no rank
                // may hold tensors another rank does not.
                if !apply {
                    u.discard_staged();
                    self.remake_cache_if_freed();
                }
            }
            ControlMsg::Discard => {
                u.discard_staged();
                self.remake_cache_if_freed();
            }
            ControlMsg::FlushCache => {
                if apply {
                    self.backend.forget_recordings();
                    // The prefix cache of generate / score; a session's is its scheduler's.
                    self.offline_pool = None;
                }
            }
            ControlMsg::Update(_) => {
                // The staged tensors went into the candidate (or were refused): gone
                // either way.
                u.discard_staged();
                let cand = u.candidate.take();
                if let (true, Some((model, origin))) = (apply, cand) {
                    // Recordings read the old weights: drop them before the weights go;
                    // the cached prefixes are the old model's KV.
                    let t0 = std::time::Instant::now();
                    self.backend.forget_recordings();
                    self.offline_pool = None;
                    self.model = Some(model);
                    self.updates.origin = origin;
                    tracing::info!(
                        rank = self.backend.rank(),
                        swap_seconds = t0.elapsed().as_secs_f64(),
                        "new weights swapped in (the old ones freed)"
                    );
                }
                self.remake_cache_if_freed();
            }
            ControlMsg::Release { weights, kv } => {
                if apply {
                    self.backend.forget_recordings();
                    self.offline_pool = None;
                    if *kv {
                        self.cache = None;
                    }
                    if *weights {
                        self.model = None;
                    }
                    // Frees are stream-ordered: without this the memory stays in the
                    // process's pool while the server idles, and the trainer beside it
                    // cannot have it.
                    if let Err(e) = self.backend.give_back_memory() {
                        tracing::warn!("giving released memory back to the driver: {e}");
                    }
                }
            }
            ControlMsg::Resume { .. } => {
                let cand = u.candidate.take();
                let session = u.new_session.take();
                if apply {
                    if let Some((model, origin)) = cand {
                        self.backend.forget_recordings();
                        self.offline_pool = None;
                        self.model = Some(model);
                        self.updates.origin = origin;
                    }
                    if session.is_some() {
                        self.cache = session;
                    }
                }
            }
            ControlMsg::JoinGroup { .. } => {
                let g = u.new_group.take();
                if apply {
                    u.group = g;
                }
            }
            ControlMsg::LeaveGroup { .. } => {
                if apply {
                    u.group = None;
                }
            }
        }
    }

    /// Frees the KV cache for the update when `UpdateMemory` says so (the device has no
    /// room for a second copy of this rank's weights beside it). The update runs with no
    /// request started, so the cache holds only cached prefixes, which the update drops.
    pub(super) fn make_room_for_update(&mut self) -> MResult<()> {
        if self.cache.is_none() {
            return Ok(());
        }
        let need = self.weights_bytes_estimate();
        let policy = self.kv_opts.update_memory;
        let free = match policy {
            // Memory the process keeps but does not use counts as free: give it back first.
            // Ranks sharing a GPU load at once: each counts its share of the free memory.
            crate::runner::UpdateMemory::Auto => {
                self.backend.give_back_memory().map_err(|e| self.berr(e))?;
                self.backend
                    .free_device_memory()
                    .map_err(|e| self.berr(e))?
            }
            _ => None,
        };
        if !policy.frees_cache(need, free) {
            return Ok(());
        }
        // Recordings write the cache: they go with it.
        self.backend.forget_recordings();
        self.offline_pool = None;
        self.cache = None;
        self.updates.cache_freed = true;
        let after = self.backend.give_back_memory().map_err(|e| self.berr(e))?;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        tracing::info!(
            rank = self.backend.rank(),
            weights_gib = format!("{:.2}", gib(need)),
            free_before_gib = free.map(|f| format!("{:.2}", gib(f))),
            free_after_gib = after.map(|f| format!("{:.2}", gib(f))),
            ?policy,
            "KV cache freed for the weight update's second copy of the weights (made again after it)"
        );
        Ok(())
    }

    /// The bytes of this rank's weights, from the configuration (bf16; the embedding and
    /// the LM head counted whole, an upper bound at TP > 1).
    fn weights_bytes_estimate(&self) -> u64 {
        let c = &self.cfg;
        let tp = self.backend.world_size().max(1) as u64;
        let layers = c.matrix_params() / tp;
        2 * (layers + 2 * c.vocab_size as u64 * c.hidden_size as u64)
    }

    /// Makes the KV cache again if a push or an update freed it.
    fn remake_cache_if_freed(&mut self) {
        if std::mem::take(&mut self.updates.cache_freed) {
            self.remake_freed_cache();
        }
    }

    /// Makes the cache freed by `make_room_for_update` again (the same blocks), after the
    /// update swapped the weights in or was undone. On failure the cache stays released:
    /// generation answers 503 until `resume_memory_occupation` brings it back.
    fn remake_freed_cache(&mut self) {
        let Some(cap) = self.kv_shape.clone() else {
            return;
        };
        if let Err(e) = self.backend.give_back_memory() {
            tracing::warn!("giving memory back before remaking the KV cache: {e}");
        }
        match self.alloc_caches(cap.blocks) {
            Ok(c) => self.cache = Some((c, cap)),
            Err(e) => tracing::error!(
                rank = self.backend.rank(),
                "the KV cache freed for the weight update could not be made again: {e}; \
                 resume_memory_occupation with tags [\"kv_cache\"] brings it back"
            ),
        }
    }

    /// Phase one of an update: the new model, loaded beside the serving one.
    fn prepare_model(&mut self, src: &UpdateSource) -> MResult<()> {
        let (store, origin) = match src {
            // A directory of safetensors alone (prime-rl's trainer writes its weights
            // without config.json): the served model's weights, read by its config.
            UpdateSource::Disk(path)
                if path.is_dir()
                    && !path.join("config.json").exists()
                    && (path.join("model.safetensors").exists()
                        || path.join("model.safetensors.index.json").exists()) =>
            {
                (WeightStore::open(path)?, Origin::Disk(path.clone()))
            }
            UpdateSource::Disk(path) => {
                // What --model takes (an HF directory, or a GGUF file), read by the same
                // loader, with the same errors.
                let (cfg, cfg_path, store) = crate::checkpoint::open_weights(path)?;
                self.cfg
                    .same_model_as(&cfg)
                    .map_err(|msg| ModelError::Config {
                        path: cfg_path.clone(),
                        msg: format!("not the served model: {msg}"),
                    })?;
                cfg.check_context(self.max_seq_len, &cfg_path)?;
                if self.max_seq_len > cfg.max_position_embeddings {
                    return Err(ModelError::Config {
                        path: cfg_path,
                        msg: format!(
                            "max_position_embeddings {} is below the served context length {}",
                            cfg.max_position_embeddings, self.max_seq_len
                        ),
                    });
                }
                (store, Origin::Disk(path.clone()))
            }
            UpdateSource::Staged => {
                let missing: Vec<&String> = self
                    .updates
                    .expected
                    .keys()
                    .filter(|n| !self.updates.staged_names.contains(*n))
                    .collect();
                if let Some(first) = missing.first() {
                    return Err(ModelError::MissingTensor {
                        dir: PathBuf::from(format!(
                            "the pushed tensors ({} of {} the model reads; {} missing)",
                            self.updates.staged_names.len(),
                            self.updates.expected.len(),
                            missing.len()
                        )),
                        tensor: first.to_string(),
                    });
                }
                let files = std::mem::take(&mut self.updates.staged);
                let device = std::mem::take(&mut self.updates.staged_device);
                let store = WeightStore::from_files(Path::new("pushed tensors"), files, device)?;
                (store, Origin::Pushed)
            }
        };
        let t0 = std::time::Instant::now();
        let ctx = LoadCtx {
            backend: &self.backend,
            store: &store,
            rank: self.backend.rank(),
            tp: self.backend.world_size(),
            row_tp: self.row_tp,
        };
        let wait0 = self.backend.upload_wait_seconds();
        let model = Model::load(&ctx, &self.cfg, self.rope_len())?;
        tracing::info!(
            rank = self.backend.rank(),
            cut_seconds = t0.elapsed().as_secs_f64(),
            host_read_seconds = store.read_seconds(),
            upload_wait_seconds = self.backend.upload_wait_seconds() - wait0,
            "new weights prepared (cut: the new model made, every shard read or cut, converted \
             to bf16 and checked finite — on the device for tensors received there; \
             host_read: reading, converting and cutting on the host into the upload buffers; \
             upload_wait: waiting for copies to the device to free a buffer)"
        );
        self.updates.candidate = Some((model, origin));
        Ok(())
    }

    /// Checks pushed tensors against the model and stages them: known names (or ones the
    /// model ignores), each once, the shapes the model reads, bf16/f16/f32. Values are
    /// checked (finite in bf16) when the update cuts the shards, as a load checks them.
    /// `source` names where the device-resident tensors came from, for errors.
    pub(super) fn stage(
        &mut self,
        files: Vec<SafeFile>,
        device: Vec<(String, DeviceTensor)>,
        source: &str,
    ) -> MResult<()> {
        let u = &mut self.updates;
        let mut names = HashSet::new();
        // Whether the model reads `name` as `found` (false: a tensor it ignores).
        let mut check = |path: &Path, name: &String, found: &[usize]| -> MResult<bool> {
            let bad = |msg: String| ModelError::Safetensors {
                path: path.to_path_buf(),
                msg: format!("tensor {name:?}: {msg}"),
            };
            let Some(shape) = u.expected.get(name) else {
                if ignorable(name, &self.cfg) {
                    return Ok(false);
                }
                return Err(bad(
                    "the model has no such tensor (names as in the HF checkpoint, e.g. model.layers.0.mlp.down_proj.weight)"
                        .into(),
                ));
            };
            if found != shape.as_slice() {
                return Err(ModelError::ShapeMismatch {
                    path: path.to_path_buf(),
                    tensor: name.clone(),
                    expected: shape.clone(),
                    found: found.to_vec(),
                });
            }
            if u.staged_names.contains(name) || !names.insert(name.clone()) {
                return Err(bad(
                    "given twice (already staged since the last update)".into()
                ));
            }
            Ok(true)
        };
        let mut kept = Vec::new();
        for mut f in files {
            let mut drop_names = Vec::new();
            let mut list: Vec<(&String, &crate::safetensors::TensorInfo)> =
                f.tensors.iter().collect();
            list.sort_by(|a, b| a.0.cmp(b.0));
            for (name, t) in list {
                if !check(&f.path, name, &t.shape)? {
                    drop_names.push(name.clone());
                }
            }
            for n in drop_names {
                f.tensors.remove(&n);
            }
            kept.push(f);
        }
        let label = Path::new(source);
        let mut kept_device = Vec::with_capacity(device.len());
        for (name, t) in device {
            if check(label, &name, &t.shape)? {
                kept_device.push((name, t));
            }
        }
        for f in kept {
            u.staged_bytes += f.len_bytes();
            u.staged_names.extend(f.tensors.keys().cloned());
            u.staged.push(f);
        }
        for (name, t) in kept_device {
            u.staged_bytes += t.len_bytes();
            u.staged_names.insert(name.clone());
            u.staged_device.push((name, t));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_once_what_every_rank_said() {
        let same = ControlError {
            kind: FailureKind::Input,
            failures: vec![(0, "bad".into()), (1, "bad".into())],
        };
        assert_eq!(same.to_string(), "bad (ranks 0, 1)");
        let one = ControlError {
            kind: FailureKind::Server,
            failures: vec![(3, "out of memory".into())],
        };
        assert_eq!(one.to_string(), "rank 3: out of memory");
    }

    #[test]
    fn a_tied_head_and_rope_buffers_are_ignorable() {
        let text = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
            "vocab_size": 10, "max_position_embeddings": 64, "tie_word_embeddings": true}"#;
        let cfg = ModelConfig::from_json_str(text, &crate::config::in_memory_path()).unwrap();
        assert!(ignorable("lm_head.weight", &cfg));
        assert!(ignorable(
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            &cfg
        ));
        assert!(!ignorable("model.layers.0.mlp.typo.weight", &cfg));
        let untied = ModelConfig {
            tie_word_embeddings: false,
            ..cfg
        };
        assert!(!ignorable("lm_head.weight", &untied));
    }
}
