//! The API the CLI drives: load a rank's shard, then `generate` / `score` static batches.

use std::path::PathBuf;
use std::sync::Arc;

use arbor_collective::Communicator;

use crate::backend::cpu::{default_threads, CpuBackend};
use crate::backend::{Backend, Numerics, SeqRows, StepInputs};
use crate::config::ModelConfig;
use crate::engine::{Event, Record, RowResult, Scheduler, SchedulerConfig, SeqSpec, StepPlan};
use crate::error::{MResult, ModelError};
use crate::forward::{Model, Trace};
use crate::generation_config::GenerationConfig;
use crate::layers::LoadCtx;
use crate::sampling::{self, RowDraw, RowStats, Sampling, TokenLogprob};
use crate::tokenizer_config::TokenizerConfig;
use crate::weights::WeightStore;

/// Context length used when neither `--max-seq-len` nor a smaller
/// `max_position_embeddings` bounds it (the RoPE table and KV cache scale with it).
pub const DEFAULT_MAX_SEQ_LEN: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    pub model_dir: PathBuf,
    pub device: Device,
    /// Context length; default `min(max_position_embeddings, DEFAULT_MAX_SEQ_LEN)`, and no
    /// longer than the model's exact context (`ModelConfig::exact_context_limit`).
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
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Length,
    Eos,
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

pub trait Runner {
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
    /// The context length requests must fit in.
    fn max_seq_len(&self) -> usize;
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
    /// Time spent in `generate` so far.
    fn timing(&self) -> GenTiming;
    /// Decode shapes recorded (CUDA graphs) and steps replayed from them so far; `None`
    /// where steps are not recorded (the CPU backend, `ARBOR_CUDA_GRAPHS=0`).
    fn recorded_steps(&self) -> Option<(u64, u64)>;
    /// Allocates the persistent KV cache (`slots` sequences of `max_len` positions) that
    /// `execute` runs on; replaces any earlier one.
    fn start_session(&mut self, slots: usize, max_len: usize) -> MResult<()>;
    /// Runs one step of the continuous-batching engine on the session's cache. Every rank
    /// of the group must execute the same plans in the same order.
    fn execute(&mut self, plan: &StepPlan) -> MResult<Vec<RowResult>>;
}

/// Loads this rank's shard (TP = `comm.world_size()`).
pub fn load(opts: &LoadOptions, comm: Arc<dyn Communicator>) -> MResult<Box<dyn Runner>> {
    match opts.device {
        Device::Cpu if opts.numerics == Numerics::Fast => Err(ModelError::Unavailable(
            "--numerics fast needs --device cuda (cuBLAS and NCCL); the CPU backend has only the invariant kernels".into(),
        )),
        Device::Cpu => {
            // An explicit ARBOR_CPU_THREADS wins; otherwise share the cores among the
            // ranks on this host.
            if std::env::var_os(arbor_kernels::cpu::THREADS_ENV).is_none() {
                arbor_kernels::cpu::set_num_threads(default_threads());
            }
            let mut engine = Engine::new(CpuBackend::new(comm), opts)?;
            if opts.shadow_tp1 {
                let shadow = Engine::new(
                    CpuBackend::new(Arc::new(arbor_collective::SingleComm)),
                    opts,
                )?;
                engine = engine.with_shadow(shadow);
            }
            Ok(Box::new(engine))
        }
        Device::Cuda if opts.numerics == Numerics::Fast && opts.shadow_tp1 => {
            Err(ModelError::Unavailable(
                "--shadow-tp1 asserts bit-equality with TP 1, which --numerics fast does not promise"
                    .into(),
            ))
        }
        Device::Cuda => crate::backend::cuda::load_runner(opts, comm),
    }
}

/// Reads `<dir>/tokenizer.json` if present.
pub fn load_tokenizer(dir: &std::path::Path) -> MResult<Option<tokenizers::Tokenizer>> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Ok(None);
    }
    tokenizers::Tokenizer::from_file(&path)
        .map(Some)
        .map_err(|e| ModelError::Tokenizer {
            path,
            msg: e.to_string(),
        })
}

/// The model of one rank on backend `B`, optionally with a TP=1 shadow.
pub struct Engine<B: Backend> {
    backend: B,
    model: Model<B>,
    tokenizer: Option<tokenizers::Tokenizer>,
    tokenizer_config: Option<TokenizerConfig>,
    generation_config: Option<GenerationConfig>,
    eos_token_ids: Vec<u32>,
    max_seq_len: usize,
    shadow: Option<Box<Engine<B>>>,
    timing: GenTiming,
    /// The persistent cache of `start_session`, with its slots and positions per slot.
    session: Option<(Caches<B>, usize, usize)>,
}

/// A batch's KV caches: the model's and, with a shadow, the shadow's.
struct Caches<B: Backend> {
    main: B::KvCache,
    shadow: Option<B::KvCache>,
}

impl<B: Backend> Engine<B> {
    /// Loads the model in `opts.model_dir` for `backend`'s rank and world size.
    pub fn new(backend: B, opts: &LoadOptions) -> MResult<Self> {
        let dir = &opts.model_dir;
        let cfg = ModelConfig::from_dir(dir)?;
        let max_seq_len = match opts.max_seq_len {
            Some(0) => {
                return Err(ModelError::Config {
                    path: dir.join("config.json"),
                    msg: "requested max_seq_len 0".into(),
                })
            }
            Some(n) if n > cfg.max_position_embeddings => {
                return Err(ModelError::Config {
                    path: dir.join("config.json"),
                    msg: format!(
                        "requested max_seq_len {n} exceeds max_position_embeddings {}",
                        cfg.max_position_embeddings
                    ),
                })
            }
            Some(n) => n,
            // By default also stay where the model's math is exact (a sliding window, say).
            None => cfg
                .exact_context_limit()
                .map_or(usize::MAX, |(n, _)| n)
                .min(cfg.max_position_embeddings)
                .min(DEFAULT_MAX_SEQ_LEN),
        };
        cfg.check_context(max_seq_len, &dir.join("config.json"))?;
        let store = WeightStore::open(dir)?;
        let row_tp = match opts.rank_of_tp {
            None => backend.world_size(),
            Some(n) if backend.world_size() == 1 && arbor_kernels::tree::is_valid_world(n) => n,
            Some(n) => {
                return Err(ModelError::Sharding {
                    tp: backend.world_size(),
                    msg: format!(
                        "emulating one rank of TP {n} needs a single rank and a TP of 1, 2, 4 or 8"
                    ),
                })
            }
        };
        let ctx = LoadCtx {
            backend: &backend,
            store: &store,
            rank: backend.rank(),
            tp: backend.world_size(),
            row_tp,
        };
        let model = Model::load(&ctx, &cfg, max_seq_len)?;
        tracing::info!(
            rank = ctx.rank,
            tp = ctx.tp,
            device = %backend.device_name(),
            arch = %cfg.arch_name,
            layers = cfg.num_layers,
            "model loaded"
        );
        let generation_config = GenerationConfig::from_dir(dir)?;
        let mut eos_token_ids = cfg.eos_token_ids.clone();
        for id in generation_config.iter().flat_map(|g| &g.eos_token_ids) {
            if !eos_token_ids.contains(id) {
                eos_token_ids.push(*id);
            }
        }
        Ok(Engine {
            tokenizer: load_tokenizer(dir)?,
            tokenizer_config: TokenizerConfig::from_dir(dir)?,
            generation_config,
            eos_token_ids,
            backend,
            model,
            max_seq_len,
            shadow: None,
            timing: GenTiming::default(),
            session: None,
        })
    }

    /// The backend this engine runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Attaches a TP=1 copy (its backend of world size 1) that every step is compared with.
    pub fn with_shadow(mut self, shadow: Engine<B>) -> Self {
        self.shadow = Some(Box::new(shadow));
        self
    }

    fn berr(&self, source: crate::backend::BackendError) -> ModelError {
        ModelError::Backend {
            rank: self.backend.rank(),
            source,
        }
    }

    fn caches(&self, slots: usize, max_len: usize) -> MResult<Caches<B>> {
        let main = self
            .backend
            .kv_cache(self.model.kv_spec(slots, max_len))
            .map_err(|e| self.berr(e))?;
        let shadow = match &self.shadow {
            Some(s) => Some(
                s.backend
                    .kv_cache(s.model.kv_spec(slots, max_len))
                    .map_err(|e| s.berr(e))?,
            ),
            None => None,
        };
        Ok(Caches { main, shadow })
    }

    fn check_tokens(&self, id: u64, tokens: &[u32]) -> MResult<()> {
        let vocab = self.model.cfg.vocab_size;
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

    /// One forward over a ragged batch; `ids_of[i]` is the request id of sequence i (for
    /// error messages), `tasks[i]` what output row i is for. Returns each output row's
    /// `RowStats`, its top candidates, and the rows' logits on the host: all of them when
    /// a task needs its row from the start (or a shadow compares them), else those whose
    /// top-p nucleus the candidates do not reach. Without a whole-row task or a shadow,
    /// the step is the backend's `run_step` (which may replay a recording); with a shadow,
    /// compares every layer and the logits bit for bit.
    fn step(
        &mut self,
        caches: &mut Caches<B>,
        ids: &[u32],
        seqs: &[SeqRows],
        out_rows: &[usize],
        ids_of: &[u64],
        tasks: &[RowTask],
    ) -> MResult<StepOut> {
        let pick: Vec<u32> = tasks.iter().map(RowTask::pick).collect();
        let draws: Vec<RowDraw> = tasks.iter().map(RowTask::draw).collect();
        let ks: Vec<usize> = tasks.iter().map(RowTask::candidates).collect();
        let need_host = tasks.iter().any(RowTask::needs_row);
        let (pick, draws, ks) = (&pick[..], &draws[..], &ks[..]);
        if !need_host && self.shadow.is_none() {
            // The device program: the backend may record it and replay the recording.
            let inputs = StepInputs {
                ids,
                seqs,
                out_rows,
                pick,
                draws,
                ks,
                vocab: self.model.vocab(),
                cache: self.backend.cache_key(&caches.main),
            };
            let model = &self.model;
            let cache = &mut caches.main;
            let want_row = |r: usize, st: &RowStats, c: &[(u32, f32)]| {
                tasks.get(r).is_some_and(|t| t.wants_row(st, c))
            };
            let res = self
                .backend
                .run_step(
                    &inputs,
                    &mut |b, inp| {
                        model.forward_logits(b, cache, inp.ids, inp.seqs, inp.out_rows, None)
                    },
                    &want_row,
                )
                .map_err(|e| self.berr(e))?;
            return Ok(StepOut {
                stats: res.stats,
                cands: res.cands,
                host: HostRows::Some(res.rows),
            });
        }
        // The rows come to the host (top-N beyond the candidates' limit, a sampling over
        // the whole row, or the shadow's comparison): the draws use them.
        let mut trace = self.shadow.as_ref().map(|_| Trace::new());
        let dev_logits = self
            .model
            .forward_logits(
                &self.backend,
                &mut caches.main,
                ids,
                seqs,
                out_rows,
                trace.as_mut(),
            )
            .map_err(|e| self.berr(e))?;
        let Some(dev_logits) = dev_logits else {
            return Ok(StepOut::default());
        };
        let stats = self
            .model
            .row_stats(&self.backend, &dev_logits, pick, draws)
            .map_err(|e| self.berr(e))?;
        let logits = self
            .model
            .logits_to_host(&self.backend, &dev_logits)
            .map_err(|e| self.berr(e))?;
        if let (Some(shadow), Some(scache), Some(trace)) =
            (self.shadow.as_mut(), caches.shadow.as_mut(), trace)
        {
            let mut strace = Trace::new();
            let slogits = shadow
                .model
                .forward(
                    &shadow.backend,
                    scache,
                    ids,
                    seqs,
                    out_rows,
                    Some(&mut strace),
                )
                .map_err(|e| shadow.berr(e))?;
            let rank = self.backend.rank();
            let hidden = self.model.cfg.hidden_size;
            let position_of_row = |row: usize| -> (usize, u64) {
                seqs.iter()
                    .zip(ids_of)
                    .find(|(s, _)| (s.row0..s.row0 + s.len).contains(&row))
                    .map_or((0, 0), |(s, &id)| (s.pos0 + row - s.row0, id))
            };
            for (layer, (a, b)) in trace.iter().zip(&strace).enumerate() {
                if let Some(row) = first_diff_row(a, b, hidden) {
                    let (position, id) = position_of_row(row);
                    return Err(ModelError::ShadowDivergence {
                        rank,
                        what: format!("hidden state after layer {layer}"),
                        position,
                        id,
                        max_abs_diff: max_abs_diff(
                            &a[row * hidden..(row + 1) * hidden],
                            &b[row * hidden..(row + 1) * hidden],
                        ),
                    });
                }
            }
            let vocab = self.model.cfg.vocab_size;
            if let Some(i) = first_diff_row(&logits, &slogits, vocab) {
                let (position, id) = position_of_row(out_rows[i]);
                return Err(ModelError::ShadowDivergence {
                    rank,
                    what: "logits".into(),
                    position,
                    id,
                    max_abs_diff: max_abs_diff(
                        &logits[i * vocab..(i + 1) * vocab],
                        &slogits[i * vocab..(i + 1) * vocab],
                    ),
                });
            }
        }
        Ok(StepOut {
            stats,
            cands: Vec::new(),
            host: HostRows::All(logits),
        })
    }
}

impl<B: Backend> Engine<B> {
    /// Plans, executes and applies steps until the scheduler is idle.
    fn drive(
        &mut self,
        caches: &mut Caches<B>,
        sched: &mut Scheduler,
        mut on_event: impl FnMut(Event),
    ) -> MResult<()> {
        loop {
            let plan = sched.plan();
            if plan.is_empty() {
                return Ok(());
            }
            let results = self.execute_on(caches, &plan)?;
            for ev in sched.apply(&plan, &results)? {
                on_event(ev);
            }
        }
    }

    /// A plan from another rank is checked before it touches the cache.
    fn check_plan(&self, plan: &StepPlan, slots: usize, max_len: usize) -> MResult<()> {
        let mut used = std::collections::HashSet::new();
        for r in &plan.rows {
            let bad = |msg: String| ModelError::BadRequest {
                id: r.sample_key,
                msg: format!("step plan row of sequence {}: {msg}", r.seq),
            };
            if r.slot >= slots || !used.insert(r.slot) {
                return Err(bad(format!(
                    "slot {} is out of range (0..{slots}) or used twice",
                    r.slot
                )));
            }
            if r.tokens.is_empty() || r.pos0 + r.tokens.len() > max_len {
                return Err(bad(format!(
                    "{} tokens at position {} do not fit {max_len} positions",
                    r.tokens.len(),
                    r.pos0
                )));
            }
            self.check_tokens(r.sample_key, &r.tokens)?;
            r.sampling.validate()?;
        }
        Ok(())
    }

    /// One step: the plan's rows as one ragged batch; records of the rows that need them.
    fn execute_on(&mut self, caches: &mut Caches<B>, plan: &StepPlan) -> MResult<Vec<RowResult>> {
        let mut ids = Vec::with_capacity(plan.n_tokens());
        let mut seqs = Vec::with_capacity(plan.rows.len());
        let mut out_rows = Vec::new();
        for r in &plan.rows {
            let row0 = ids.len();
            seqs.push(SeqRows {
                slot: r.slot,
                row0,
                len: r.tokens.len(),
                pos0: r.pos0,
            });
            ids.extend_from_slice(&r.tokens);
            for &(off, _) in &r.targets {
                if off as usize >= r.tokens.len()
                    || (r.sample && off as usize + 1 == r.tokens.len())
                {
                    return Err(ModelError::Plan(format!(
                        "sequence {}: target row {off} is outside its {} rows or is its sampled row",
                        r.seq,
                        r.tokens.len()
                    )));
                }
                out_rows.push(row0 + off as usize);
            }
            if r.sample {
                out_rows.push(row0 + r.tokens.len() - 1);
            }
        }
        let ids_of: Vec<u64> = plan.rows.iter().map(|r| r.sample_key).collect();
        // One task per logits row, in the order the rows were asked for.
        let mut tasks = Vec::with_capacity(out_rows.len());
        for r in &plan.rows {
            for &(_, target) in &r.targets {
                tasks.push(RowTask::Score {
                    token: target,
                    n_top: r.n_top,
                });
            }
            if r.sample {
                tasks.push(RowTask::Sample {
                    sampling: r.sampling,
                    key: r.sample_key,
                    position: r.pos0 + r.tokens.len(),
                    n_top: r.n_top,
                });
            }
        }
        let t0 = std::time::Instant::now();
        let out = self.step(caches, &ids, &seqs, &out_rows, &ids_of, &tasks)?;
        let vocab = self.model.cfg.vocab_size.max(1);
        let host_ok = match &out.host {
            HostRows::All(l) => l.len() == out_rows.len() * vocab,
            HostRows::Some(rows) => rows.is_empty() || rows.len() == out_rows.len(),
            HostRows::None => true,
        };
        let cands_ok = out.cands.is_empty() || out.cands.len() == out_rows.len();
        if out.stats.len() != out_rows.len() || !host_ok || !cands_ok {
            return Err(ModelError::Plan(format!(
                "the forward returned {} row records for {} rows",
                out.stats.len(),
                out_rows.len()
            )));
        }
        let t_rec = std::time::Instant::now();
        let mut records = records_parallel(&out, vocab, &tasks)?.into_iter();
        let dt_rec = t_rec.elapsed().as_secs_f64();
        let dt = t0.elapsed().as_secs_f64();
        if plan.rows.iter().any(|r| r.prefill) {
            self.timing.prefill_s += dt;
            self.timing.prefill_tokens += ids.len();
        } else {
            self.timing.decode_s += dt;
            self.timing.decode_steps += 1;
            self.timing.decode_tokens += ids.len();
            self.timing.decode_records_s += dt_rec;
        }
        let mut results = Vec::with_capacity(plan.rows.len());
        for r in &plan.rows {
            let scored: Vec<Record> = records.by_ref().take(r.targets.len()).collect();
            let sampled = if r.sample { records.next() } else { None };
            results.push(RowResult {
                seq: r.seq,
                scored,
                sampled,
            });
        }
        Ok(results)
    }
}

/// A step's row stats, its logits on the host (when a row needs them or the shadow
/// compares) and each row's top-k candidates (empty when no row asked for any, or when
/// the rows came to the host: the draws use those).
#[derive(Default)]
struct StepOut {
    stats: Vec<RowStats>,
    cands: Vec<Vec<(u32, f32)>>,
    host: HostRows,
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

/// What to read off one logits row.
enum RowTask {
    /// The log-prob of a given token (scoring, prompt log-probs).
    Score { token: u32, n_top: usize },
    /// Choose the next token, then record it.
    Sample {
        sampling: Sampling,
        key: u64,
        position: usize,
        n_top: usize,
    },
}

impl RowTask {
    /// The index whose value the row's stats report: the scored token.
    fn pick(&self) -> u32 {
        match *self {
            RowTask::Score { token, .. } => token,
            RowTask::Sample { .. } => u32::MAX,
        }
    }

    /// What the backend computes for the draw where the logits are: a pure
    /// temperature's Gumbel-max draw, a whole-vocabulary top-p's tempered sum.
    fn draw(&self) -> RowDraw {
        match *self {
            RowTask::Score { .. } => RowDraw::None,
            RowTask::Sample {
                ref sampling,
                key,
                position,
                ..
            } => sampling::row_draw(sampling, key, position),
        }
    }

    /// The draw from the row's candidates (`Choice::NeedsRow` when its top-p nucleus
    /// lies beyond them); `None` for rows that draw nothing from candidates.
    fn candidate_choice(&self, stats: &RowStats, cand: &[(u32, f32)]) -> Option<sampling::Choice> {
        let k = self.draw_candidates();
        match *self {
            RowTask::Sample {
                ref sampling,
                key,
                position,
                ..
            } if k > 0 && stats.sampled == u32::MAX => Some(sampling::choose_from_candidates(
                &cand[..cand.len().min(k)],
                sampling,
                key,
                position,
                stats.tempered_sum,
                // Fewer than asked for: every non-NaN value of the row.
                cand.len() < k,
            )),
            _ => None,
        }
    }

    /// Whether the row must come to the host after its stats and candidates: a top-p
    /// nucleus the candidates do not reach.
    fn wants_row(&self, stats: &RowStats, cand: &[(u32, f32)]) -> bool {
        matches!(
            self.candidate_choice(stats, cand),
            Some(sampling::Choice::NeedsRow)
        )
    }

    /// How many candidates a sampled token's draw needs (0: none, or the whole row).
    fn draw_candidates(&self) -> usize {
        match *self {
            RowTask::Sample { ref sampling, .. } => sampling::candidates_needed(sampling),
            RowTask::Score { .. } => 0,
        }
    }

    fn n_top(&self) -> usize {
        match *self {
            RowTask::Score { n_top, .. } | RowTask::Sample { n_top, .. } => n_top,
        }
    }

    /// How many top candidates the backend selects for this row (0: none): the draw's
    /// top-k and the record's top-N come from one selection (the first n of the k most
    /// likely are the n most likely), so the row need not come to the host.
    fn candidates(&self) -> usize {
        if self.needs_row() {
            0
        } else {
            self.draw_candidates().max(self.n_top())
        }
    }

    /// Whether the record needs the whole row on the host from the start: top-N beyond
    /// the backend's selection, or a token sampled with a top-k beyond it (a sort over the
    /// vocabulary).
    fn needs_row(&self) -> bool {
        let whole_row_draw = match *self {
            RowTask::Sample { ref sampling, .. } => {
                sampling.temperature != 0.0
                    && !sampling.draws_on_device()
                    && self.draw_candidates() == 0
            }
            RowTask::Score { .. } => false,
        };
        whole_row_draw || self.n_top() > sampling::CANDIDATES_MAX
    }

    /// The record from the row's stats and, where `needs_row` or `wants_row`, the row
    /// itself, or, where `candidates`, the row's top candidates.
    fn run(
        &self,
        stats: &RowStats,
        row: Option<&[f32]>,
        cand: Option<&[(u32, f32)]>,
    ) -> MResult<Record> {
        let (token, value, n_top) = match *self {
            RowTask::Score { token, n_top } => (token, stats.picked, n_top),
            RowTask::Sample {
                ref sampling,
                key,
                position,
                n_top,
            } => match row {
                // The backend's draw, also when the row came to the host for top-N: a
                // request's tokens do not depend on whether it asked for log-probs.
                _ if stats.sampled != u32::MAX => (stats.sampled, stats.sampled_value, n_top),
                Some(row) if sampling.temperature != 0.0 && row.len() > 1 => {
                    // A whole-vocabulary top-p compares with the backend's tempered sum,
                    // as the candidates' draw does.
                    let tempered = sampling.is_nucleus().then_some(stats.tempered_sum);
                    let t = sampling::choose_with(row, sampling, key, position, tempered);
                    (t, row[t as usize], n_top)
                }
                // `choose` on the draw's candidates (same token and value); the argmax
                // where there are none, as `choose` gives for an all-NaN row.
                None => match self.candidate_choice(stats, cand.unwrap_or(&[])) {
                    Some(sampling::Choice::Token(t, v)) => (t, v, n_top),
                    Some(sampling::Choice::NeedsRow) => {
                        return Err(ModelError::Plan(format!(
                            "the top-p draw at position {position} of request {key} needs its row, which the step did not bring"
                        )))
                    }
                    Some(sampling::Choice::Empty) | None => (stats.argmax, stats.max, n_top),
                },
                _ => (stats.argmax, stats.max, n_top),
            },
        };
        Ok(Record {
            token,
            logprob: value - stats.lse,
            top: match (row, cand) {
                (Some(row), _) => sampling::top_n(row, stats.lse, n_top),
                (None, Some(c)) => sampling::top_n_of_candidates(c, stats.lse, n_top),
                (None, None) => Vec::new(),
            },
            digest: stats.digest,
        })
    }
}

/// The records of every task. Rows on the host (top-N beyond the candidates, whole-row
/// draws) are spread over the host's cores.
fn records_parallel(out: &StepOut, vocab: usize, tasks: &[RowTask]) -> MResult<Vec<Record>> {
    if let Some(t) =
        (0..tasks.len()).find(|&r| tasks[r].needs_row() && out.host.row(r, vocab).is_none())
    {
        return Err(ModelError::Plan(format!(
            "row {t} needs its logits on the host but the step did not download them"
        )));
    }
    let cand = |r: usize| out.cands.get(r).map(Vec::as_slice);
    sampling::map_rows(tasks.len(), out.host.values(), |r, _| {
        tasks[r].run(&out.stats[r], out.host.row(r, vocab), cand(r))
    })
    .into_iter()
    .collect()
}

fn first_diff_row(a: &[f32], b: &[f32], cols: usize) -> Option<usize> {
    if a.len() != b.len() {
        return Some(0);
    }
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
        .map(|i| i / cols.max(1))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m })
}

impl<B: Backend> Runner for Engine<B> {
    fn tp(&self) -> usize {
        self.backend.world_size()
    }
    fn rank(&self) -> usize {
        self.backend.rank()
    }
    fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }
    fn tokenizer(&self) -> Option<&tokenizers::Tokenizer> {
        self.tokenizer.as_ref()
    }
    fn tokenizer_config(&self) -> Option<&TokenizerConfig> {
        self.tokenizer_config.as_ref()
    }
    fn generation_config(&self) -> Option<&GenerationConfig> {
        self.generation_config.as_ref()
    }
    fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }
    fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    fn generate(
        &mut self,
        reqs: &[GenRequest],
        s: &Sampling,
        n_top: usize,
    ) -> MResult<Vec<GenOutput>> {
        s.validate()?;
        for r in reqs {
            if r.prompt.is_empty() {
                return Err(ModelError::BadRequest {
                    id: r.id,
                    msg: "empty prompt".into(),
                });
            }
            self.check_tokens(r.id, &r.prompt)?;
            let needed = r.prompt.len().saturating_add(r.max_new_tokens);
            if needed > self.max_seq_len {
                return Err(ModelError::ContextTooLong {
                    id: r.id,
                    needed,
                    max: self.max_seq_len,
                    prompt_len: r.prompt.len(),
                });
            }
        }
        let mut outs: Vec<GenOutput> = reqs
            .iter()
            .map(|r| GenOutput {
                id: r.id,
                tokens: Vec::new(),
                logprobs: Vec::new(),
                top: Vec::new(),
                logits_digest: Vec::new(),
                finish: FinishReason::Length,
            })
            .collect();
        // Requests that generate something; sequence j of the scheduler is active[j].
        let active: Vec<usize> = (0..reqs.len())
            .filter(|&i| reqs[i].max_new_tokens > 0)
            .collect();
        if active.is_empty() {
            return Ok(outs);
        }
        let max_len = active
            .iter()
            .map(|&i| reqs[i].prompt.len() + reqs[i].max_new_tokens)
            .max()
            .unwrap_or(1);
        let mut caches = self.caches(active.len(), max_len)?;
        let cfg = SchedulerConfig::offline(active.len(), max_len, self.eos_token_ids.clone());
        let mut sched = Scheduler::new(cfg)?;
        let mut out_of = std::collections::HashMap::new();
        for &i in &active {
            let r = &reqs[i];
            let seq = sched.submit(SeqSpec {
                sample_key: r.id,
                tokens: r.prompt.clone(),
                score_from: None,
                max_new: r.max_new_tokens,
                sampling: *s,
                n_top,
                ignore_eos: false,
            })?;
            out_of.insert(seq, i);
        }
        self.drive(&mut caches, &mut sched, |ev| match ev {
            Event::Token { seq, record } => {
                if let Some(o) = out_of.get(&seq).map(|&i| &mut outs[i]) {
                    o.tokens.push(record.token);
                    o.logprobs.push(record.logprob);
                    o.top.push(record.top);
                    o.logits_digest.push(record.digest);
                }
            }
            Event::Finished { seq, reason } => {
                if let Some(o) = out_of.get(&seq).map(|&i| &mut outs[i]) {
                    o.finish = reason;
                }
            }
            Event::Scored { .. } => {}
        })?;
        Ok(outs)
    }

    fn timing(&self) -> GenTiming {
        self.timing
    }

    fn recorded_steps(&self) -> Option<(u64, u64)> {
        self.backend.recorded_steps()
    }

    fn score(&mut self, reqs: &[ScoreRequest], n_top: usize) -> MResult<Vec<ScoreOutput>> {
        for r in reqs {
            if r.prompt_len == 0 || r.prompt_len > r.tokens.len() {
                return Err(ModelError::BadRequest {
                    id: r.id,
                    msg: format!(
                        "prompt_len {} must be between 1 and the sequence length {}",
                        r.prompt_len,
                        r.tokens.len()
                    ),
                });
            }
            self.check_tokens(r.id, &r.tokens)?;
            if r.tokens.len() > self.max_seq_len {
                return Err(ModelError::ContextTooLong {
                    id: r.id,
                    needed: r.tokens.len(),
                    max: self.max_seq_len,
                    prompt_len: r.prompt_len,
                });
            }
        }
        let mut outs: Vec<ScoreOutput> = reqs
            .iter()
            .map(|r| ScoreOutput {
                id: r.id,
                logprobs: Vec::new(),
                top: Vec::new(),
                logits_digest: Vec::new(),
            })
            .collect();
        let active: Vec<usize> = (0..reqs.len())
            .filter(|&i| reqs[i].tokens.len() > reqs[i].prompt_len)
            .collect();
        if active.is_empty() {
            return Ok(outs);
        }
        let max_len = active
            .iter()
            .map(|&i| reqs[i].tokens.len())
            .max()
            .unwrap_or(1);
        let mut caches = self.caches(active.len(), max_len)?;
        let cfg = SchedulerConfig::offline(active.len(), max_len, Vec::new());
        let mut sched = Scheduler::new(cfg)?;
        let mut out_of = std::collections::HashMap::new();
        for &i in &active {
            let r = &reqs[i];
            let seq = sched.submit(SeqSpec {
                sample_key: r.id,
                tokens: r.tokens.clone(),
                score_from: Some(r.prompt_len),
                max_new: 0,
                sampling: Sampling::greedy(),
                n_top,
                ignore_eos: true,
            })?;
            out_of.insert(seq, i);
        }
        self.drive(&mut caches, &mut sched, |ev| {
            if let Event::Scored { seq, records } = ev {
                if let Some(o) = out_of.get(&seq).map(|&i| &mut outs[i]) {
                    for rec in records {
                        o.logprobs.push(rec.logprob);
                        o.top.push(rec.top);
                        o.logits_digest.push(rec.digest);
                    }
                }
            }
        })?;
        Ok(outs)
    }

    fn start_session(&mut self, slots: usize, max_len: usize) -> MResult<()> {
        if max_len > self.max_seq_len {
            return Err(ModelError::Plan(format!(
                "a session of {max_len} positions per slot exceeds the context length {}",
                self.max_seq_len
            )));
        }
        self.session = None;
        let caches = self.caches(slots, max_len)?;
        self.session = Some((caches, slots, max_len));
        Ok(())
    }

    fn execute(&mut self, plan: &StepPlan) -> MResult<Vec<RowResult>> {
        let Some((mut caches, slots, max_len)) = self.session.take() else {
            return Err(ModelError::Plan(
                "execute called before start_session".into(),
            ));
        };
        let res = self
            .check_plan(plan, slots, max_len)
            .and_then(|()| self.execute_on(&mut caches, plan));
        self.session = Some((caches, slots, max_len));
        res
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
