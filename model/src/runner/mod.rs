//! The API the CLI drives: load a rank's shard, then `generate` / `score` static batches,
//! or run a serving session's step plans.
//!
//! [`Worker`] is one rank's model on a backend; it reaches the device only through the
//! [`Backend`] trait. [`load`] builds it (load.rs), a step plan runs as one ragged batch
//! (execute.rs → step.rs), each output row's record comes from its stats, candidates or
//! host row (records.rs), and `generate` / `score` drive the scheduler (drivers.rs).

pub mod capacity;
mod drivers;
mod execute;
mod load;
mod records;
mod step;
mod weights_group;
mod weights_receive;
pub mod weights_update;

use std::path::PathBuf;

use crate::backend::{Backend, Numerics};
use crate::batching::{ControlMsg, RowResult, StepPlan};
use crate::config::ModelConfig;
use crate::error::{MResult, ModelError};
use crate::forward::{HeadPlan, Model};
use crate::generation_config::GenerationConfig;
use crate::sampling::{RowStats, Sampling, TokenLogprob};
use crate::tokenizer_config::TokenizerConfig;

pub use crate::batching::FinishReason;
pub use crate::checkpoint::load_tokenizer;
pub use capacity::{BatchWork, KvCapacity, KvOptions, StepBudget, UpdateMemory};
pub use load::load;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    pub model_dir: PathBuf,
    pub device: Device,
    /// Context length (prompt + generated); default the model's `max_position_embeddings`,
    /// no longer than its exact context (`ModelConfig::exact_context_limit`); in any case
    /// at most what the KV cache holds.
    pub max_seq_len: Option<usize>,
    /// Also hold a TP=1 copy and compare every step bit for bit.
    pub shadow_tp1: bool,
    /// Invariant (the default) or the vendor's fast, batch- and TP-dependent kernels.
    pub numerics: Numerics,
    /// Benchmarking only, on one rank: reduce the row-parallel layers (o, down) as rank 0
    /// of a TP group of this size does, over its 8/N of the segments of an N times longer
    /// K, and skip nothing else. On a `make-model --per-rank-of-tp N` model a step then
    /// runs exactly one rank's kernels (the all-reduces aside); its outputs are not a
    /// model's.
    pub rank_of_tp: Option<usize>,
    /// How the paged KV cache is sized: made at load where the step budget is given, else
    /// by `Runner::reserve_steps` once the work is known.
    pub kv: KvOptions,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenOutput {
    pub id: u64,
    /// Generated tokens only.
    pub tokens: Vec<u32>,
    /// log_softmax(logits)[token] per generated token.
    pub logprobs: Vec<f32>,
    /// Top-`n_top` alternatives per generated position.
    pub top: Vec<Vec<TokenLogprob>>,
    /// Digest of the f32 bits of the full logits row per generated position.
    pub logits_digest: Vec<u64>,
    pub finish: FinishReason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScoreRequest {
    pub id: u64,
    pub tokens: Vec<u32>,
    /// Tokens `[prompt_len..]` are scored, each given its prefix (1 ≤ prompt_len ≤ len).
    pub prompt_len: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ScoreOutput {
    pub id: u64,
    pub logprobs: Vec<f32>,
    pub top: Vec<Vec<TokenLogprob>>,
    pub logits_digest: Vec<u64>,
}

/// Wall-clock time spent in steps since the runner was loaded: a step runs from its plan
/// to its rows' records (tokens chosen, log-probs, digests), so its time is its whole cost
/// on this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenTiming {
    /// Prefill steps (one per `generate` call) and the prompt tokens they processed.
    pub prefill_s: f64,
    pub prefill_tokens: usize,
    /// Decode steps (one new token for every live sequence) and the tokens they made.
    pub decode_s: f64,
    pub decode_steps: usize,
    pub decode_tokens: usize,
    /// The part of the decode time spent on the host after the logits arrived: choosing
    /// tokens, log-probs, top-N, digests.
    pub decode_records_s: f64,
}

impl GenTiming {
    /// One line for a person: prefill and decode cost, per step and per token.
    pub fn summary(&self) -> String {
        let per_step = |s: f64, n: usize| if n > 0 { 1e3 * s / n as f64 } else { 0.0 };
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        format!(
            "prefill {:.1} ms for {} prompt tokens ({:.0} tok/s); decode {} steps in {:.3} s ({:.2} ms/step, {:.0} tok/s; host records {:.2} ms/step)",
            1e3 * self.prefill_s,
            self.prefill_tokens,
            rate(self.prefill_tokens, self.prefill_s),
            self.decode_steps,
            self.decode_s,
            per_step(self.decode_s, self.decode_steps),
            rate(self.decode_tokens, self.decode_s),
            per_step(self.decode_records_s, self.decode_steps),
        )
    }
}

/// What any caller may ask of a rank's worker: the model, its tokenizer, its limits and
/// what its steps have cost.
pub trait ModelInfo {
    fn tp(&self) -> usize;
    fn rank(&self) -> usize;
    fn config(&self) -> &ModelConfig;
    /// None if the model directory has no tokenizer.json.
    fn tokenizer(&self) -> Option<&tokenizers::Tokenizer>;
    /// tokenizer_config.json (and chat_template.jinja), if present.
    fn tokenizer_config(&self) -> Option<&TokenizerConfig>;
    /// generation_config.json, if present.
    fn generation_config(&self) -> Option<&GenerationConfig>;
    /// The ids that end a sequence: config.json's and generation_config.json's together.
    fn eos_token_ids(&self) -> &[u32];
    /// The context length requests must fit in: the model's, at most what the KV cache
    /// holds.
    fn max_seq_len(&self) -> usize;
    /// The KV cache made at load (the same number of blocks on every rank; the size it
    /// comes back with after a release); `None` before it is made (a `Worker` built by
    /// hand makes it on first use).
    fn kv_capacity(&self) -> Option<&KvCapacity>;
    /// Time spent in `generate` so far.
    fn timing(&self) -> GenTiming;
    /// Decode shapes recorded (CUDA graphs) and steps replayed from them so far; `None`
    /// where steps are not recorded (the CPU backend, `ARBOR_CUDA_GRAPHS=0`).
    fn recorded_steps(&self) -> Option<(u64, u64)>;
}

/// Offline work (`generate`, `score`): static batches that own the worker's KV cache
/// between session-less calls.
pub trait OfflineRunner: ModelInfo {
    /// Sizes the steps to come to `step` and makes the KV cache with the memory that
    /// leaves (again, where it was made for another budget): what an offline command does
    /// once it knows its work. A collective: every rank calls it with the same budget.
    fn reserve_steps(&mut self, step: StepBudget) -> MResult<()>;
    /// All requests run as ONE static batch (ragged, no padding); sampling is keyed by
    /// (seed, request id, position), so results depend on neither batch nor TP.
    fn generate(
        &mut self,
        reqs: &[GenRequest],
        s: &Sampling,
        n_top: usize,
    ) -> MResult<Vec<GenOutput>>;
    /// Teacher-forced, prefill only (the trainer's path); one static batch.
    fn score(&mut self, reqs: &[ScoreRequest], n_top: usize) -> MResult<Vec<ScoreOutput>>;
    /// The prefix cache of `generate` and `score` so far: positions looked up and found,
    /// and the blocks it holds (`None` before the first call, or after a failed one).
    fn prefix_cache_stats(&self) -> Option<(crate::batching::kv::PrefixStats, usize)>;
    /// Forgets the prefix cache of `generate` and `score` (call it when the weights change:
    /// the cached blocks hold the old model's KV). A serving session's cache is its
    /// scheduler's: `Scheduler::drop_prefix_cache`.
    fn drop_prefix_cache(&mut self);
}

/// A serving session: the plans of rank 0's scheduler, executed in the same order on
/// every rank.
pub trait SessionRunner: ModelInfo {
    /// Hands the KV cache to the plans of `execute` (a serving session, whose scheduler on
    /// rank 0 owns the blocks from now on): `generate` and `score` refuse to run after it,
    /// since their blocks would be the session's.
    fn start_session(&mut self) -> MResult<()>;
    /// Runs one step of the continuous-batching engine on the session's cache. Every rank
    /// of the group must execute the same plans in the same order. `late` gives the masks
    /// of the plan's `mask_later` rows (rank 0: `Scheduler::late_masks`, sent on to the
    /// other ranks; they receive them), asked for once while the step's device work runs,
    /// and only when there are such rows.
    fn execute(&mut self, plan: &StepPlan, late: &mut LateMasks<'_>) -> MResult<Vec<RowResult>>;
}

/// The masks of a step's `mask_later` rows, in plan order (`SessionRunner::execute`).
pub type LateMasks<'a> = dyn FnMut() -> MResult<Vec<crate::constraint::TokenMask>> + 'a;

/// Weight and memory commands, in two phases on every rank (`weights_update`).
pub trait WeightControl {
    /// Phase one of a weight or memory command on this rank: everything that can fail,
    /// nothing that changes what the rank serves with (`weights_update::run_control`
    /// drives both phases on every rank).
    /// A payload it consumes (pushed bytes) is taken out of `msg`.
    fn control_prepare(&mut self, msg: &mut ControlMsg) -> MResult<()>;
    /// Phase two: apply phase one's result (every rank succeeded), or undo it.
    fn control_finish(&mut self, msg: &ControlMsg, apply: bool);
    /// The weights, KV cache and staged tensors this rank holds.
    fn weights_state(&self) -> weights_update::WeightsState;
    /// Every tensor the model reads, by HF name, with its whole (unsharded) shape: what a
    /// weight update must provide, and what a trainer holding the model needs to know.
    fn weight_shapes(&self) -> std::collections::BTreeMap<String, Vec<usize>>;
}

/// Everything a rank's worker does: what [`load`] returns. Callers that need one role
/// take that trait.
pub trait Runner: OfflineRunner + SessionRunner + WeightControl {}

impl<T: OfflineRunner + SessionRunner + WeightControl> Runner for T {}

/// One rank's worker: its shard of the model on backend `B`, its KV cache, its tokenizer
/// and weight-update state, optionally with a TP=1 shadow.
pub struct Worker<B: Backend> {
    backend: B,
    /// The model's config (kept while the weights are released).
    cfg: ModelConfig,
    /// The weights on the device; None while released (`release_memory`).
    model: Option<Model<B>>,
    /// The TP size the row-parallel layers reduce as (`LoadCtx::row_tp`).
    row_tp: usize,
    /// Weight updates: the tensors a checkpoint must hold, staged tensors, a prepared
    /// model, where the weights came from (runner/weights_update.rs).
    updates: weights_update::Updates<B>,
    tokenizer: Option<tokenizers::Tokenizer>,
    tokenizer_config: Option<TokenizerConfig>,
    generation_config: Option<GenerationConfig>,
    eos_token_ids: Vec<u32>,
    /// The context limit of the model (before the cache bounds it).
    max_seq_len: usize,
    kv_opts: KvOptions,
    /// The step budget offline work last asked for (`reserve_steps`); `kv_opts.step` holds
    /// the one the cache was made for, which may be cut from it (`make_cache`).
    step_asked: Option<StepBudget>,
    shadow: Option<Box<Worker<B>>>,
    timing: GenTiming,
    /// The paged KV cache (made by `init_cache` at load) and its size; None before it is
    /// made and while it is released (`release_memory`).
    cache: Option<(Caches<B>, KvCapacity)>,
    /// The size chosen when the cache was made: a resumed cache has the same blocks (the
    /// serving scheduler's).
    kv_shape: Option<KvCapacity>,
    /// `start_session` was called: the plans of `execute` own the cache's blocks.
    session: bool,
    /// The blocks of the cache between `generate` / `score` calls, with their prefix
    /// cache (None: none cached).
    offline_pool: Option<crate::batching::BlockPool>,
}

/// A batch's KV caches: the model's and, with a shadow, the shadow's.
struct Caches<B: Backend> {
    main: B::KvCache,
    shadow: Option<B::KvCache>,
}

impl<B: Backend> Worker<B> {
    /// The backend this engine runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    fn berr(&self, source: crate::backend::BackendError) -> ModelError {
        ModelError::Backend {
            rank: self.backend.rank(),
            source,
        }
    }

    /// Sizes and makes the KV cache (the model's and the shadow's, with the same blocks):
    /// from `--kv-blocks`, else from the memory left after loading, the same number of
    /// blocks on every rank (a collective: every rank calls it). `load` calls it; an
    /// engine built by hand makes its cache on first use.
    pub fn init_cache(&mut self) -> MResult<()> {
        self.make_cache(false)
    }

    /// [`Worker::init_cache`]; `fit_step`: offline work, whose step budget may be cut
    /// (`capacity::fitting_step`, the same on every rank) where its working memory would
    /// leave the cache too little for the work's longest sequence.
    fn make_cache(&mut self, fit_step: bool) -> MResult<()> {
        self.cache = None;
        self.offline_pool = None;
        let opts = &self.kv_opts;
        opts.validate()
            .map_err(|m| ModelError::Plan(format!("KV cache: {m}")))?;
        let step = opts.step.ok_or_else(|| {
            ModelError::Plan(
                "the KV cache is sized for the work: call reserve_steps before running".into(),
            )
        })?;
        let mut bpb = self.kv_spec(0)?.bytes_per_block();
        if let Some(s) = &self.shadow {
            bpb += s.kv_spec(0)?.bytes_per_block();
        }
        // Every rank's weights are on its device before any rank measures what is left
        // (ranks may share a device): a barrier.
        self.backend.min_over_ranks(0).map_err(|e| self.berr(e))?;
        let free = self
            .backend
            .free_device_memory()
            .map_err(|e| self.berr(e))?;
        let (rank, tp) = (self.backend.rank(), self.backend.world_size());
        let heads = HeadPlan::new(&self.cfg, rank, tp)?;
        let context = capacity::reserve_context(self.max_seq_len, opts.blocks, free, bpb);
        let shadow_heads = match &self.shadow {
            Some(s) => Some((&s.cfg, HeadPlan::new(&s.cfg, 0, 1)?)),
            None => None,
        };
        let reserve_for = |step: &StepBudget| {
            let mine = capacity::step_reserve_bytes(&self.cfg, &heads, tp, step, context);
            mine + shadow_heads.as_ref().map_or(0, |(cfg, sh)| {
                capacity::step_reserve_bytes(cfg, sh, 1, step, context)
            })
        };
        let cpu_default = match (free, opts.cpu_cache_gib, opts.blocks) {
            (None, None, None) => capacity::default_cpu_cache_bytes(
                capacity::host_available_bytes(),
                capacity::local_ranks(),
            ),
            _ => 0,
        };
        // Only a cache sized from free device memory grows when the step's working memory
        // shrinks; every rank of a group takes the same branch (one backend kind, one
        // `--kv-blocks`).
        let step = if fit_step && free.is_some() && opts.blocks.is_none() {
            let fits = capacity::fitting_step(step, |s| {
                capacity::blocks_that_fit(opts, free, cpu_default, bpb, reserve_for(s))
                    .map_or(0, |(n, _)| n)
            });
            let tokens = self
                .backend
                .min_over_ranks(fits.tokens as u64)
                .map_err(|e| self.berr(e))? as usize;
            let cut = step.cut_to(tokens);
            if cut != step && rank == 0 {
                tracing::warn!(
                    from = step.tokens,
                    to = cut.tokens,
                    "steps cut to fit the KV cache beside their working memory (--max-num-batched-tokens sets them; the bits do not change)"
                );
            }
            cut
        } else {
            step
        };
        let reserve = reserve_for(&step);
        let (mine, source) = capacity::blocks_that_fit(opts, free, cpu_default, bpb, reserve)
            .map_err(|m| ModelError::Plan(format!("rank {rank}: {m}")))?;
        let blocks = self
            .backend
            .min_over_ranks(mine as u64)
            .map_err(|e| self.berr(e))? as usize;
        // The offline scheduler runs the steps of this budget (cut or not).
        self.kv_opts.step = Some(step);
        let caches = self.alloc_caches(blocks)?;
        let cap = KvCapacity {
            blocks,
            bytes_per_block: bpb,
            max_seq_len: self
                .max_seq_len
                .min(blocks * arbor_kernels::paged::KV_BLOCK),
            source: if blocks < mine {
                format!("{source}; the smallest of the ranks'")
            } else {
                source
            },
        };
        self.fit_rope(cap.max_seq_len)?;
        tracing::info!(
            rank,
            blocks,
            gib = cap.gib(),
            max_seq_len = cap.max_seq_len,
            source = %cap.source,
            "KV cache"
        );
        self.kv_shape = Some(cap.clone());
        self.cache = Some((caches, cap));
        Ok(())
    }

    /// Sizes the RoPE tables of the model (and the shadow's) to the context the cache
    /// allows, `max_seq_len` positions.
    fn fit_rope(&mut self, max_seq_len: usize) -> MResult<()> {
        if let Some(m) = &mut self.model {
            m.fit_rope(max_seq_len)?;
        }
        if let Some(s) = &mut self.shadow {
            s.fit_rope(max_seq_len)?;
        }
        Ok(())
    }

    /// The positions a model loaded now must rotate: the cache's context once the cache
    /// was sized (0 before: `init_cache` sizes the table then).
    pub(super) fn rope_len(&self) -> usize {
        self.kv_shape.as_ref().map_or(0, |c| c.max_seq_len)
    }

    /// The model's (and the shadow's) cache of `blocks` blocks.
    fn alloc_caches(&self, blocks: usize) -> MResult<Caches<B>> {
        let main = self
            .backend
            .kv_cache(self.kv_spec(blocks)?)
            .map_err(|e| self.berr(e))?;
        let shadow = match &self.shadow {
            Some(s) => Some(
                s.backend
                    .kv_cache(s.kv_spec(blocks)?)
                    .map_err(|e| s.berr(e))?,
            ),
            None => None,
        };
        Ok(Caches { main, shadow })
    }

    /// The cache and its size, for a call that runs on it (made now if it never was).
    fn take_cache(&mut self) -> MResult<(Caches<B>, KvCapacity)> {
        if self.cache.is_none() {
            if self.kv_shape.is_some() {
                return Err(ModelError::Unavailable(
                    "the KV cache is released (release_memory_occupation): resume it first".into(),
                ));
            }
            self.init_cache()?;
        }
        self.cache
            .take()
            .ok_or_else(|| ModelError::Plan("the KV cache was not made".into()))
    }

    fn check_tokens(&self, id: u64, tokens: &[u32]) -> MResult<()> {
        let vocab = self.cfg.vocab_size;
        if let Some((index, &token)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(ModelError::TokenOutOfVocab {
                id,
                token,
                index,
                vocab,
            });
        }
        Ok(())
    }
}

/// The error of a step while the weights are released.
fn released() -> ModelError {
    ModelError::Unavailable(
        "the weights are released (release_memory_occupation): resume them first".into(),
    )
}

/// A step's row stats, its logits on the host (when a row needs them or the shadow
/// compares) and each row's top-k candidates (empty when no row asked for any, or when
/// the rows came to the host: the draws use those).
#[derive(Default)]
struct StepOut {
    stats: Vec<RowStats>,
    cands: Vec<Vec<(u32, f32)>>,
    host: HostRows,
    /// Where a row asked for them: every token's routed experts, `[ids, layers, top_k]`
    /// (`forward::Model::forward_routed`); else empty.
    routes: Vec<u32>,
}

/// Which logits rows of a step are on the host.
#[derive(Default)]
enum HostRows {
    /// Every row (`[rows, vocab]`).
    All(Vec<f32>),
    /// The rows asked for after the stats (`None` for the others; empty: none).
    Some(Vec<Option<Vec<f32>>>),
    #[default]
    None,
}

impl HostRows {
    fn row(&self, r: usize, vocab: usize) -> Option<&[f32]> {
        match self {
            HostRows::All(l) => l.get(r * vocab..(r + 1) * vocab),
            HostRows::Some(rows) => rows.get(r).and_then(Option::as_deref),
            HostRows::None => None,
        }
    }

    /// Values on the host (whether the records are worth spreading over the cores).
    fn values(&self) -> usize {
        match self {
            HostRows::All(l) => l.len(),
            HostRows::Some(rows) => rows.iter().flatten().map(Vec::len).sum(),
            HostRows::None => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::GenTiming;

    #[test]
    fn timing_summary_reports_per_step_and_per_token() {
        let t = GenTiming {
            prefill_s: 0.5,
            prefill_tokens: 1000,
            decode_s: 0.63,
            decode_steps: 63,
            decode_tokens: 504,
            decode_records_s: 0.126,
        };
        let s = t.summary();
        assert!(
            s.contains("prefill 500.0 ms for 1000 prompt tokens (2000 tok/s)"),
            "{s}"
        );
        assert!(
            s.contains(
                "decode 63 steps in 0.630 s (10.00 ms/step, 800 tok/s; host records 2.00 ms/step)"
            ),
            "{s}"
        );
        let none = GenTiming::default().summary();
        assert!(
            none.contains(
                "decode 0 steps in 0.000 s (0.00 ms/step, 0 tok/s; host records 0.00 ms/step)"
            ),
            "{none}"
        );
    }
}
