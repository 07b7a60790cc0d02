//! How many KV blocks a rank's cache gets: from free GPU memory (after the weights) times
//! `gpu_memory_utilization`, less what a step still needs beside the cache; from a host
//! memory budget on the CPU; or as given (`--kv-blocks`). Every rank takes the smallest
//! of the ranks' numbers (the plan names block ids, the same on every rank).

use arbor_kernels::paged::{splits_of, KV_BLOCK};

use crate::batching::scheduler::{DEFAULT_STEP_OUTPUTS, DEFAULT_STEP_TOKENS};
use crate::config::ModelConfig;
use crate::forward::HeadPlan;

const GIB: f64 = (1u64 << 30) as f64;

/// How the KV cache is sized.
#[derive(Debug, Clone, PartialEq)]
pub struct KvOptions {
    /// Exactly this many blocks (overrides the memory-based sizing).
    pub blocks: Option<usize>,
    /// CUDA: the fraction of the device memory free after loading the weights that the
    /// cache and the steps' working memory may use.
    pub gpu_memory_utilization: f64,
    /// CPU: GiB of host memory for the cache (its pages are touched only as blocks fill);
    /// `None`: [`default_cpu_cache_bytes`].
    pub cpu_cache_gib: Option<f64>,
    /// The most one step holds: the working memory kept beside the cache. `None`: not
    /// known at load (an offline command's work): the cache is made by
    /// `Runner::reserve_steps` once the work is known.
    pub step: Option<StepBudget>,
    /// Share full blocks between sequences with the same tokens up to them (`generate` and
    /// `score`; a serving session's scheduler has its own flag).
    pub prefix_cache: bool,
    /// Where a weight update's second copy of the weights finds room (docs/rl.md, Memory).
    pub update_memory: UpdateMemory,
}

/// A weight update loads the new weights beside the serving ones and swaps them only
/// once every rank has them (so a failure changes nothing): it needs room for a second
/// copy. An update runs only when no request is started, so the KV cache then holds
/// nothing but the prefix cache, which the update drops anyway: freeing the cache for the
/// update and making it again after loses nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpdateMemory {
    /// Keep the KV cache when the device has room for the second copy beside it, else
    /// free it for the update.
    #[default]
    Auto,
    /// Free the KV cache for every update.
    FreeKvCache,
    /// Never free it: an update without room fails (nothing changes).
    KeepKvCache,
}

impl UpdateMemory {
    /// Whether to free the KV cache for an update needing `need` bytes where `free` are
    /// free (`None`: unknown, a host backend). The margin covers the load's temporaries
    /// and the allocator's rounding.
    pub fn frees_cache(self, need: u64, free: Option<u64>) -> bool {
        match self {
            UpdateMemory::FreeKvCache => true,
            UpdateMemory::KeepKvCache => false,
            UpdateMemory::Auto => free.is_some_and(|f| f < need + need / 20 + (1 << 30)),
        }
    }
}

/// The most one step holds, which sizes the working memory a rank keeps beside its KV
/// cache. A server takes any request, so it plans for its step limits; an offline command
/// knows its work, and a budget cut to it leaves the rest of the memory to the cache (ranks
/// sharing a GPU have little to spare).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepBudget {
    /// Most rows (new tokens) in one step.
    pub tokens: usize,
    /// Most rows whose logits one step computes.
    pub outputs: usize,
    /// Most sequences one decode step runs.
    pub decode_rows: usize,
    /// The longest sequence (prompt + generated) a step serves; `None`: the context limit.
    pub context: Option<usize>,
}

/// One static batch of offline work, as [`StepBudget::for_batches`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchWork {
    /// Prompt (or scored sequence) tokens of the batch together: its prefill rows.
    pub rows: usize,
    /// Rows whose logits a step of the batch needs at most: one per sequence when
    /// generating, every scored position when scoring.
    pub outputs: usize,
    /// Sequences of the batch.
    pub seqs: usize,
    /// Its longest sequence, prompt and generated tokens together.
    pub longest: usize,
}

impl StepBudget {
    /// A server's budget: steps of up to `tokens` rows and `outputs` logits rows, decode
    /// steps as large as the largest recorded one, at any context.
    pub fn serving(tokens: usize, outputs: usize) -> Self {
        StepBudget {
            tokens,
            outputs,
            decode_rows: DECODE_ROWS,
            context: None,
        }
    }

    /// The budget of offline work run as `batches`, no larger than a server's default
    /// step (a longer prompt is prefilled in chunks: the same bits), and at most
    /// `max_tokens` rows a step where given.
    pub fn for_batches(
        batches: impl IntoIterator<Item = BatchWork>,
        max_tokens: Option<usize>,
    ) -> Self {
        let most = batches
            .into_iter()
            .fold(BatchWork::default(), |m, b| BatchWork {
                rows: m.rows.max(b.rows),
                outputs: m.outputs.max(b.outputs),
                seqs: m.seqs.max(b.seqs),
                longest: m.longest.max(b.longest),
            });
        let tokens = most
            .rows
            .min(DEFAULT_STEP_TOKENS)
            .min(max_tokens.unwrap_or(usize::MAX));
        StepBudget {
            tokens: tokens.max(1),
            outputs: most.outputs.clamp(1, DEFAULT_STEP_OUTPUTS),
            decode_rows: most.seqs.max(1).next_power_of_two().min(DECODE_ROWS),
            context: Some(most.longest.max(1)),
        }
    }

    /// This budget with steps of at most `tokens` rows (and as many logits rows at most).
    pub fn cut_to(self, tokens: usize) -> Self {
        let tokens = tokens.clamp(1, self.tokens);
        StepBudget {
            tokens,
            outputs: self.outputs.min(tokens),
            ..self
        }
    }

    /// The budget's own limits, named.
    pub fn validate(&self) -> Result<(), String> {
        if self.tokens == 0 || self.outputs == 0 || self.decode_rows == 0 {
            return Err(format!(
                "step tokens {}, step outputs {} and decode rows {} must be at least 1",
                self.tokens, self.outputs, self.decode_rows
            ));
        }
        Ok(())
    }
}

pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;
/// The CPU cache's size by default: at most this, and at most half of the host's
/// available memory shared by the ranks on the host.
pub const DEFAULT_CPU_CACHE_GIB: f64 = 4.0;

/// Memory the OS says new allocations can have (Linux MemAvailable), in bytes.
pub fn host_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// Ranks on this host (`LOCAL_WORLD_SIZE`, else 1).
pub fn local_ranks() -> usize {
    std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1)
}

/// The CPU cache's bytes per rank when no size is given: [`DEFAULT_CPU_CACHE_GIB`], or half
/// of `available` (the host's) split over `local` ranks where that is less.
pub fn default_cpu_cache_bytes(available: Option<u64>, local: usize) -> u64 {
    let cap = (DEFAULT_CPU_CACHE_GIB * GIB) as u64;
    match available {
        Some(a) => cap.min(a / 2 / local.max(1) as u64),
        None => cap,
    }
}

impl Default for KvOptions {
    fn default() -> Self {
        KvOptions {
            blocks: None,
            gpu_memory_utilization: DEFAULT_GPU_MEMORY_UTILIZATION,
            cpu_cache_gib: None,
            step: Some(StepBudget::serving(
                DEFAULT_STEP_TOKENS,
                DEFAULT_STEP_OUTPUTS,
            )),
            prefix_cache: true,
            update_memory: UpdateMemory::Auto,
        }
    }
}

impl KvOptions {
    /// The options' own limits, named.
    pub fn validate(&self) -> Result<(), String> {
        let u = self.gpu_memory_utilization;
        if !(u.is_finite() && u > 0.0 && u <= 1.0) {
            return Err(format!("gpu_memory_utilization {u} must be in (0, 1]"));
        }
        if let Some(g) = self.cpu_cache_gib {
            if !(g.is_finite() && g > 0.0) {
                return Err(format!("the CPU KV cache size {g} GiB must be above 0"));
            }
        }
        if self.blocks == Some(0) {
            return Err("a KV cache of 0 blocks holds nothing".into());
        }
        match &self.step {
            Some(step) => step.validate(),
            None => Ok(()),
        }
    }
}

/// The cache a rank made, as every rank made it.
#[derive(Debug, Clone, PartialEq)]
pub struct KvCapacity {
    pub blocks: usize,
    /// Bytes of one block on this rank: K and V of every layer (and of a shadow's).
    pub bytes_per_block: usize,
    /// The longest sequence (prompt + generated): the model's context limit, at most
    /// what the cache holds.
    pub max_seq_len: usize,
    /// How the size was chosen, for the log.
    pub source: String,
}

impl KvCapacity {
    /// Positions the cache holds.
    pub fn tokens(&self) -> usize {
        self.blocks * KV_BLOCK
    }

    /// Bytes of the cache on this rank.
    pub fn bytes(&self) -> usize {
        self.blocks * self.bytes_per_block
    }

    pub fn gib(&self) -> f64 {
        self.bytes() as f64 / GIB
    }
}

/// The blocks this rank can hold (before the ranks agree on the smallest) and how that
/// was chosen. `free`: device memory free now (None: the cache is in host memory, of
/// `cpu_default` bytes unless the options say); `reserve`: bytes a step still needs beside
/// the cache.
pub fn blocks_that_fit(
    opts: &KvOptions,
    free: Option<u64>,
    cpu_default: u64,
    bytes_per_block: usize,
    reserve: u64,
) -> Result<(usize, String), String> {
    if let Some(n) = opts.blocks {
        return Ok((n, format!("--kv-blocks {n}")));
    }
    let bpb = bytes_per_block.max(1) as f64;
    match free {
        Some(free) => {
            let budget = free as f64 * opts.gpu_memory_utilization - reserve as f64;
            let n = (budget / bpb).floor();
            if n < 1.0 {
                return Err(format!(
                    "no GPU memory left for the KV cache: {:.2} GiB free × {} − {:.2} GiB for a step's working memory is below one block of {:.2} MiB (lower --max-num-batched-tokens, raise --gpu-memory-utilization, or use more GPUs)",
                    free as f64 / GIB,
                    opts.gpu_memory_utilization,
                    reserve as f64 / GIB,
                    bpb / (1u64 << 20) as f64
                ));
            }
            Ok((
                n.min(u32::MAX as f64) as usize,
                format!(
                    "{:.0}% of {:.2} GiB free, less {:.2} GiB for the steps",
                    100.0 * opts.gpu_memory_utilization,
                    free as f64 / GIB,
                    reserve as f64 / GIB
                ),
            ))
        }
        None => {
            let (bytes, why) = match opts.cpu_cache_gib {
                Some(g) => (g * GIB, format!("--kv-cache-gib {g}")),
                None => (
                    cpu_default as f64,
                    format!("the default --kv-cache-gib {:.2}", cpu_default as f64 / GIB),
                ),
            };
            let n = (bytes / bpb).floor();
            if n < 1.0 {
                return Err(format!(
                    "{why} is below one KV block ({:.3} MiB)",
                    bpb / (1u64 << 20) as f64
                ));
            }
            Ok((n.min(u32::MAX as f64) as usize, why))
        }
    }
}

/// The fewest rows an offline step budget is cut to by [`fitting_step`].
pub const MIN_FIT_STEP_TOKENS: usize = 256;

/// The step budget offline work runs with on this rank: `step` when a cache beside its
/// working memory holds the work's longest sequence (`blocks_at` gives the blocks a cache
/// beside a budget's working memory holds), else the largest of `step` halved down to
/// [`MIN_FIT_STEP_TOKENS`] rows that does, else the smallest of them (the cache's sizing
/// then says what is missing). Ranks sharing one GPU each plan a step's working memory;
/// eight of them planning 8192-row steps can leave the cache nothing. A smaller step
/// changes no bit (a prompt is prefilled in chunks, with the same bits), only the speed.
pub fn fitting_step(step: StepBudget, blocks_at: impl Fn(&StepBudget) -> usize) -> StepBudget {
    let need = step.context.map_or(1, |c| c.div_ceil(KV_BLOCK)).max(1);
    let mut tried = step;
    loop {
        if blocks_at(&tried) >= need || tried.tokens <= MIN_FIT_STEP_TOKENS {
            return tried;
        }
        tried = tried.cut_to((tried.tokens / 2).max(MIN_FIT_STEP_TOKENS));
    }
}

/// The context a step's working memory is planned for: the model's (`max_seq_len`), but
/// no more positions than the cache can hold: `blocks` when given, else as many blocks as
/// `free` bytes (a device's) hold, reserve aside. A model declaring millions of positions
/// then plans for what the memory allows, not for its declared length.
pub fn reserve_context(
    max_seq_len: usize,
    blocks: Option<usize>,
    free: Option<u64>,
    bytes_per_block: usize,
) -> usize {
    let most = match (blocks, free) {
        (Some(n), _) => n,
        (None, Some(f)) => usize::try_from(f / bytes_per_block.max(1) as u64).unwrap_or(usize::MAX),
        (None, None) => usize::MAX,
    };
    max_seq_len.min(most.saturating_mul(KV_BLOCK))
}

/// Headroom beside the estimate below: CUDA graphs, NCCL and cuBLAS buffers, allocator
/// slack.
const FIXED_RESERVE: u64 = 1 << 30;
/// Decode rows of a recorded step, at most (the CUDA backend's largest graph bucket; a
/// smaller batch is padded to a bucket no larger than its next power of two).
const DECODE_ROWS: usize = 256;

/// An upper estimate of the device memory one step of `step` allocates beside the KV
/// cache on one rank of TP `tp`, with contexts up to `max_seq_len` (and the step's own
/// limit): activations of a layer (f32 and their bf16 copies, the all-reduce's gathered
/// partials, the GEMMs' bf16 inputs), the logits, the split attention's partial states of
/// its largest decode step, and a fixed headroom.
pub fn step_reserve_bytes(
    cfg: &ModelConfig,
    heads: &HeadPlan,
    tp: usize,
    step: &StepBudget,
    max_seq_len: usize,
) -> u64 {
    let h = cfg.hidden_size;
    let hd = cfg.head_dim;
    let q = heads.n_heads * hd;
    let kv = heads.n_kv_heads * hd;
    let inter = cfg.intermediate_size.div_ceil(tp);
    let widest = h.max(q + 2 * kv).max(2 * inter);
    // f32 values alive per row at the peak of a layer, doubled for what the allocator
    // has not reused yet: the residual, norms, q/k/v, attention, o and down with their
    // gathered partials, gate/up and SiLU·mul; then bf16 copies and a GEMM's input.
    let f32_per_row = 2 * (4 * h + 2 * tp * h + 2 * (q + 2 * kv) + 2 * q + 3 * inter);
    let bf16_per_row = 2 * h + q + inter + widest;
    let rows = step.tokens as u64;
    let acts = rows * (4 * (f32_per_row + moe_f32_per_row(cfg, tp)) + 2 * bf16_per_row) as u64;
    // Logits: the local shard, the gathered rows and a copy.
    let vocab_local = cfg.vocab_size.div_ceil(tp);
    let logits = step.outputs as u64 * 4 * (2 * vocab_local + cfg.vocab_size) as u64;
    // The decode kernel's split states: rows × heads × splits × (head_dim + 2) f32.
    let context = step.context.map_or(max_seq_len, |c| c.min(max_seq_len));
    let splits = splits_of(context.saturating_sub(1)).next_power_of_two();
    let decode = (step.decode_rows * heads.n_heads * splits * (hd + 2) * 4) as u64;
    acts + logits + decode + FIXED_RESERVE
}

/// f32 values per row that a mixture-of-experts layer holds beside a dense layer's, doubled
/// like those for what the allocator has not reused yet: the router's logits, and per
/// (row, chosen expert) its gathered input with a bf16 copy, the expert's SiLU·mul output,
/// the down projection's partial, its copy stacked with the other experts', the
/// all-reduce's gathered partials of every rank and its result; then the weighted sum.
/// 0 for a dense model.
fn moe_f32_per_row(cfg: &ModelConfig, tp: usize) -> usize {
    let Some(m) = &cfg.moe else {
        return 0;
    };
    let h = cfg.hidden_size;
    let inter = m.expert_intermediate.div_ceil(tp);
    let per_route = h + h / 2 + inter + 2 * h + tp * h + h;
    2 * (m.num_experts + m.top_k * per_route + h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::in_memory_path;

    #[test]
    fn blocks_follow_the_memory_and_the_override() {
        let o = KvOptions::default();
        let (n, why) = blocks_that_fit(&o, Some(10 << 30), 0, 1 << 20, 1 << 30).unwrap();
        // 10 GiB × 0.9 − 1 GiB = 8 GiB of 1 MiB blocks.
        assert_eq!(n, 8192);
        assert!(why.contains("90% of 10.00 GiB free"), "{why}");
        let e = blocks_that_fit(&o, Some(1 << 30), 0, 1 << 20, 1 << 30).unwrap_err();
        assert!(e.contains("no GPU memory left for the KV cache"), "{e}");
        let (n, why) = blocks_that_fit(&o, None, 3 << 30, 1 << 20, 0).unwrap();
        assert_eq!(n, 3072);
        assert!(why.contains("the default --kv-cache-gib 3.00"), "{why}");
        let four = KvOptions {
            cpu_cache_gib: Some(4.0),
            ..o.clone()
        };
        let (n, why) = blocks_that_fit(&four, None, 3 << 30, 1 << 20, 0).unwrap();
        assert_eq!((n, why.as_str()), (4096, "--kv-cache-gib 4"));
        let fixed = KvOptions {
            blocks: Some(7),
            ..o.clone()
        };
        let (n, _) = blocks_that_fit(&fixed, Some(0), 0, 1 << 20, 1 << 40).unwrap();
        assert_eq!(n, 7);
        let tiny = KvOptions {
            cpu_cache_gib: Some(1e-9),
            ..o
        };
        let e = blocks_that_fit(&tiny, None, 0, 1 << 20, 0).unwrap_err();
        assert!(e.contains("below one KV block"), "{e}");
        // The default: 4 GiB, or half the available memory over the host's ranks.
        let gib = 1u64 << 30;
        assert_eq!(default_cpu_cache_bytes(None, 1), 4 * gib);
        assert_eq!(default_cpu_cache_bytes(Some(64 * gib), 2), 4 * gib);
        assert_eq!(default_cpu_cache_bytes(Some(8 * gib), 4), gib);
    }

    #[test]
    fn options_are_checked() {
        let bad = |f: fn(&mut KvOptions)| {
            let mut o = KvOptions::default();
            f(&mut o);
            o.validate().unwrap_err()
        };
        assert!(bad(|o| o.gpu_memory_utilization = 0.0).contains("(0, 1]"));
        assert!(bad(|o| o.gpu_memory_utilization = 1.5).contains("(0, 1]"));
        assert!(bad(|o| o.cpu_cache_gib = Some(f64::NAN)).contains("above 0"));
        assert!(bad(|o| o.blocks = Some(0)).contains("0 blocks"));
        assert!(KvOptions::default().validate().is_ok());
    }

    fn llama3_8b() -> ModelConfig {
        let text = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072}"#;
        ModelConfig::from_json_str(text, &in_memory_path()).unwrap()
    }

    #[test]
    fn the_reserve_grows_with_the_step_and_the_context() {
        let cfg = llama3_8b();
        let heads = HeadPlan::new(&cfg, 0, 1).unwrap();
        let o = StepBudget::serving(DEFAULT_STEP_TOKENS, DEFAULT_STEP_OUTPUTS);
        let base = step_reserve_bytes(&cfg, &heads, 1, &o, 4096);
        let long = step_reserve_bytes(&cfg, &heads, 1, &o, 131072);
        let small = StepBudget { tokens: 512, ..o };
        let less = step_reserve_bytes(&cfg, &heads, 1, &small, 4096);
        assert!(long > base && base > less && less > FIXED_RESERVE);
        // A llama3-8b step of 8192 rows: a few GiB, well under an H100's 80.
        let gib = base as f64 / GIB;
        assert!((2.0..16.0).contains(&gib), "{gib} GiB");
    }

    #[test]
    fn offline_work_reserves_what_it_runs() {
        let cfg = llama3_8b();
        // Two batches of a generate: 6 prompts of ~100 tokens, then 2 of 300.
        let gen = |seqs: usize, prompt: usize| BatchWork {
            rows: seqs * prompt,
            outputs: seqs,
            seqs,
            longest: prompt + 16,
        };
        let work = StepBudget::for_batches([gen(6, 100), gen(2, 300)], None);
        assert_eq!(
            work,
            StepBudget {
                tokens: 600,
                outputs: 6,
                decode_rows: 8,
                context: Some(316),
            }
        );
        // A flag caps the rows; a huge batch keeps the server's limits.
        assert_eq!(StepBudget::for_batches([gen(6, 100)], Some(64)).tokens, 64);
        let huge = StepBudget::for_batches([gen(2000, 100)], None);
        let serving = StepBudget::serving(DEFAULT_STEP_TOKENS, DEFAULT_STEP_OUTPUTS);
        assert_eq!(
            (huge.tokens, huge.outputs, huge.decode_rows),
            (serving.tokens, serving.outputs, serving.decode_rows)
        );
        assert!(StepBudget::for_batches([], None).validate().is_ok());
        // One rank of TP 8 on the llama3-8b shape: the server's step reserves 7.45 GiB,
        // which an 80 GB GPU shared by 8 ranks does not have per rank; the work's own
        // step reserves little beside the fixed headroom.
        let heads = HeadPlan::new(&cfg, 1, 8).unwrap();
        let server = step_reserve_bytes(&cfg, &heads, 8, &serving, 131072) as f64 / GIB;
        let mine = step_reserve_bytes(&cfg, &heads, 8, &work, 131072) as f64 / GIB;
        assert!(server > 5.0, "{server} GiB");
        assert!(mine < 1.5, "{mine} GiB");
    }

    #[test]
    fn offline_steps_shrink_until_the_longest_sequence_fits() {
        let step = StepBudget {
            tokens: 6000,
            outputs: 8,
            decode_rows: 8,
            context: Some(1500),
        };
        // 24 blocks hold a sequence of 1500 positions.
        let blocks_at =
            |room_from: usize| move |s: &StepBudget| if s.tokens <= room_from { 30 } else { 0 };
        assert_eq!(fitting_step(step, blocks_at(8192)), step, "fits as it is");
        let cut = fitting_step(step, blocks_at(2048));
        assert_eq!((cut.tokens, cut.outputs), (1500, 8), "6000 → 3000 → 1500");
        assert_eq!(cut.context, step.context);
        assert_eq!(cut.decode_rows, step.decode_rows);
        let floor = fitting_step(step, blocks_at(0));
        assert_eq!(
            floor.tokens, MIN_FIT_STEP_TOKENS,
            "the smallest tried, left to the error"
        );
        // Too few blocks for the longest sequence counts as not fitting.
        let few = |s: &StepBudget| if s.tokens <= 750 { 24 } else { 23 };
        assert_eq!(fitting_step(step, few).tokens, 750);
        // Logits rows never exceed the rows.
        let scoring = StepBudget {
            outputs: 6000,
            ..step
        };
        assert_eq!(scoring.cut_to(1024).outputs, 1024);
        assert_eq!(scoring.cut_to(9000), scoring, "never larger");
    }

    /// Qwen3-30B-A3B's shape: a step's experts hold top_k routes of every row, each with
    /// its input, output and the all-reduce's gathered partials.
    #[test]
    fn the_reserve_covers_the_experts_of_every_row() {
        let text = r#"{"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
            "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
            "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "norm_topk_prob": true}"#;
        let moe = ModelConfig::from_json_str(text, &in_memory_path()).unwrap();
        let dense = ModelConfig {
            moe: None,
            ..moe.clone()
        };
        let step = StepBudget::serving(DEFAULT_STEP_TOKENS, DEFAULT_STEP_OUTPUTS);
        for tp in [1, 4] {
            let heads = HeadPlan::new(&moe, 0, tp).unwrap();
            let with = step_reserve_bytes(&moe, &heads, tp, &step, 4096);
            let without = step_reserve_bytes(&dense, &heads, tp, &step, 4096);
            // The gathered partials alone: rows × top_k × hidden f32 from each of tp ranks.
            let gathered = (DEFAULT_STEP_TOKENS * 8 * 2048 * tp * 4) as u64;
            assert!(with > without + gathered, "TP {tp}: {with} vs {without}");
        }
        let two = ModelConfig::from_json_str(
            &text.replace("\"num_experts_per_tok\": 8", "\"num_experts_per_tok\": 2"),
            &in_memory_path(),
        )
        .unwrap();
        let heads = HeadPlan::new(&moe, 0, 1).unwrap();
        assert!(
            step_reserve_bytes(&moe, &heads, 1, &step, 4096)
                > step_reserve_bytes(&two, &heads, 1, &step, 4096)
        );
    }

    #[test]
    fn the_reserve_plans_for_no_more_context_than_the_cache_holds() {
        let m = 1 << 24;
        assert_eq!(
            reserve_context(m, Some(8), Some(1 << 40), 1 << 20),
            8 * KV_BLOCK
        );
        // 80 GiB of 1 MiB blocks: 81920 blocks at most.
        assert_eq!(
            reserve_context(m, None, Some(80 << 30), 1 << 20),
            81920 * KV_BLOCK
        );
        assert_eq!(reserve_context(4096, None, Some(80 << 30), 1 << 20), 4096);
        assert_eq!(reserve_context(m, None, None, 1 << 20), m);
    }

    #[test]
    fn an_update_frees_the_cache_only_without_room_beside_it() {
        let g = 1u64 << 30;
        let need = 15 * g;
        // auto: room for the copy plus the margin keeps the cache, less frees it.
        assert!(!UpdateMemory::Auto.frees_cache(need, Some(20 * g)));
        assert!(UpdateMemory::Auto.frees_cache(need, Some(15 * g)));
        assert!(UpdateMemory::Auto.frees_cache(need, Some(16 * g)));
        // No device to ask (a host backend): keep it.
        assert!(!UpdateMemory::Auto.frees_cache(need, None));
        assert!(UpdateMemory::FreeKvCache.frees_cache(need, Some(80 * g)));
        assert!(!UpdateMemory::KeepKvCache.frees_cache(need, Some(0)));
    }
}
