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
    /// Rows of the GEMMs' row tile (`DEFAULT_ROW_TILE` on a GPU, 1 for none). Beside
    /// decode rows the prompt budget is rounded up (within `step_tokens`) so that the
    /// step's rows fill whole tiles: a GEMM's partly filled last row tile costs as much as
    /// a full one, so the rows that fill it come almost free. Chunking changes no bit.
    pub row_tile: usize,
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
/// Rows of the large-M GEMM's tile (`wgtma128`: 128 × 128), the default `row_tile` of
/// `arbor serve`.
pub const DEFAULT_ROW_TILE: usize = 128;
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
            row_tile: 1,
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
/// the step's rows are a multiple of `row_tile`, but never past `left` (the step's token
/// budget after its decode rows).
pub(crate) fn fill_row_tiles(
    decode_rows: usize,
    beside: usize,
    row_tile: usize,
    left: usize,
) -> usize {
    let tile = row_tile.max(1);
    let filled = decode_rows
        .saturating_add(beside)
        .div_ceil(tile)
        .saturating_mul(tile);
    filled.saturating_sub(decode_rows).min(left)
}

#[cfg(test)]
mod tests {
    use super::fill_row_tiles;

    #[test]
    fn prompt_rows_beside_decode_fill_the_last_row_tile() {
        // 143 decode rows + 512 prompt rows = 655: the sixth 128-row tile is filled.
        assert_eq!(fill_row_tiles(143, 512, 128, 8192 - 143), 768 - 143);
        // Already a multiple: unchanged.
        assert_eq!(fill_row_tiles(128, 512, 128, 8192), 512);
        // The step's budget caps it.
        assert_eq!(fill_row_tiles(143, 512, 128, 600), 600);
        assert_eq!(fill_row_tiles(143, 512, 128, 300), 300);
        // No tile: the budget as given.
        assert_eq!(fill_row_tiles(143, 512, 1, 8192), 512);
        assert_eq!(fill_row_tiles(0, 7, 4, 100), 8);
    }
}
