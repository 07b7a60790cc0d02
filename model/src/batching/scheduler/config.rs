//! The scheduler's limits and policies (`SchedulerConfig`), and the step budgets offline
//! runs and `arbor serve` use by default.

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most sequences running at once.
    pub max_running: usize,
    /// Positions a request may use: it needs `prompt + max_new` of them (the context limit).
    pub max_seq_len: usize,
    /// Largest prefill chunk per sequence and step.
    pub chunk: usize,
    /// Most new tokens (rows) in one step; decode rows are served first.
    pub step_tokens: usize,
    /// Most prompt rows a step takes when it also has decode rows: a step's time grows
    /// with its prompt rows, and every decode row in it waits for them, so this bounds
    /// the inter-token latency while new prompts arrive. A step without decode rows
    /// takes up to `step_tokens`.
    pub prefill_beside_decode: usize,
    /// Beside decode rows the prompt budget is rounded up (within `step_tokens`) so that
    /// the step's rows are a multiple of this (1: no rounding). A GEMM's time grows in
    /// steps, by whole rounds of its tiles over the SMs, so the rows that fill the last
    /// round come almost free (`DEFAULT_ROW_MULTIPLE`). Chunking changes no bit.
    pub row_multiple: usize,
    /// Most rows whose logits one step computes (scoring targets and sampled rows): bounds
    /// the step's logits memory; a scoring prompt's chunk is cut to fit.
    pub step_outputs: usize,
    /// KV blocks in the cache (of `arbor_kernels::paged::KV_BLOCK` positions).
    pub kv_blocks: usize,
    /// Generation ends when one of these is sampled.
    pub eos: Vec<u32>,
    /// Grow KV per token and preempt by recompute when it runs out, instead of reserving
    /// every position a request may use at admission (see the module doc).
    pub preempt: bool,
    /// Plan no decode row while a sequence still has prompt to prefill (offline: a static
    /// batch prefills every prompt, then decodes, so prefill and decode time apart).
    pub prefill_first: bool,
    /// Share full KV blocks between sequences whose tokens up to them are equal (the
    /// prefix cache, `batching::kv`): a new sequence starts computing at its first position
    /// not cached.
    pub prefix_cache: bool,
}

/// Rows per step of offline `generate` / `score`, and of `arbor serve` by default: prompts
/// in chunks of at most this many rows (the same bits as whole).
pub const DEFAULT_STEP_TOKENS: usize = 8192;
/// Prompt rows per step beside decode rows, in `arbor serve` by default (see
/// `SchedulerConfig::prefill_beside_decode`).
pub const DEFAULT_PREFILL_BESIDE_DECODE: usize = 512;
/// `arbor serve`'s default `row_multiple`. The large-M GEMM (`wgtma128`) runs 128 × 128
/// tiles, one per SM at a time: on 132 SMs a layer of 4096 columns (32 column tiles) takes
/// one round up to 512 rows and two up to 1024, and at 1024 rows every llama3-8b layer's
/// tiles fill their last round (q/k/v 384 of 396, o and down 256 of 264, gate/up 1792 of
/// 1848). Measured on an H100, one layer's four GEMMs take 0.54 ms at 640 rows, 0.61 at
/// 768 and 0.68 at 1024 (0.84, 0.79 and 0.66 µs a row), and `arbor serve` under load gave
/// 6526 output tok/s with 512 against 6316 with 128 (docs/serving.md).
pub const DEFAULT_ROW_MULTIPLE: usize = 512;
/// Logits rows per step by default (see `SchedulerConfig::step_outputs`).
pub const DEFAULT_STEP_OUTPUTS: usize = 1024;

impl SchedulerConfig {
    /// A static batch over a cache of `kv_blocks` blocks: as many requests as their blocks
    /// allow run at once, every position reserved at admission; their prompts are
    /// prefilled (within `step_tokens` rows a step) before any decodes, then one decode
    /// row per live sequence each step.
    pub fn offline(
        max_seq_len: usize,
        kv_blocks: usize,
        step_tokens: usize,
        eos: Vec<u32>,
    ) -> Self {
        SchedulerConfig {
            max_running: usize::MAX,
            max_seq_len,
            chunk: step_tokens,
            step_tokens,
            prefill_beside_decode: step_tokens,
            row_multiple: 1,
            step_outputs: DEFAULT_STEP_OUTPUTS,
            kv_blocks,
            eos,
            preempt: false,
            prefill_first: true,
            prefix_cache: true,
        }
    }
}

/// The prompt rows a step takes beside `decode_rows` decode rows: `beside`, raised so that
/// the step's rows are a multiple of `row_multiple`, but never past `left` (the step's
/// token budget after its decode rows).
pub(crate) fn round_step_rows(
    decode_rows: usize,
    beside: usize,
    row_multiple: usize,
    left: usize,
) -> usize {
    let multiple = row_multiple.max(1);
    let filled = decode_rows
        .saturating_add(beside)
        .div_ceil(multiple)
        .saturating_mul(multiple);
    filled.saturating_sub(decode_rows).min(left)
}

#[cfg(test)]
mod tests {
    use super::round_step_rows;

    #[test]
    fn prompt_rows_beside_decode_round_the_step_up() {
        // 143 decode rows + 512 prompt rows = 655, up to the next multiple of 128 or 512.
        assert_eq!(round_step_rows(143, 512, 512, 8192 - 143), 1024 - 143);
        assert_eq!(round_step_rows(143, 512, 128, 8192 - 143), 768 - 143);
        // Already a multiple: unchanged.
        assert_eq!(round_step_rows(128, 512, 128, 8192), 512);
        // The step's budget caps it.
        assert_eq!(round_step_rows(143, 512, 128, 600), 600);
        assert_eq!(round_step_rows(143, 512, 128, 300), 300);
        // No rounding: the budget as given.
        assert_eq!(round_step_rows(143, 512, 1, 8192), 512);
        assert_eq!(round_step_rows(0, 7, 4, 100), 8);
    }
}
