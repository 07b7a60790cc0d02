//! The device abstraction the model is written against once.
//!
//! A `Backend` owns device buffers, runs the kernels and the collectives of one rank.
//! Activations are f32 matrices; weights are bf16 `[n, k]` matrices as HF stores them; the
//! KV cache is a bf16 pool of blocks (`arbor_kernels::paged`). Rows of a batch are the
//! sequences' new tokens concatenated with no padding (`SeqRows` says which rows belong to
//! which sequence and at which positions, `KvRows` adds the sequences' block tables), so
//! padding can never change a row's numbers.

pub mod cpu;
pub mod cuda;
pub mod device_tensor;
pub mod error;

use arbor_kernels::cpu::RopeTable;
use arbor_kernels::paged::{blocks_for, PagedKvLayout};

use crate::error::{MResult, ModelError};
pub use device_tensor::{DeviceBytes, DeviceCut, DeviceTensor, NonFinite, Wire};

pub use error::{BResult, BackendError};

/// What writes a weight's rows for [`Backend::mat_from_rows`]: `fill(rows, dst)`, `dst`
/// holding `rows.len()` rows.
pub type RowFill<'a> = dyn FnMut(std::ops::Range<usize>, &mut [half::bf16]) -> MResult<()> + 'a;

/// How a backend does its arithmetic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Numerics {
    /// Every reduction follows the fixed tree: the same bits at every TP size, batch size
    /// and step shape (docs/invariance.md).
    #[default]
    Invariant,
    /// cuBLAS for the linear layers and NCCL's all-reduce (CUDA only): the vendor's
    /// fastest kernels, whose bits depend on the batch and the TP size. For measuring the
    /// price of determinism, and for users who do not need it.
    Fast,
}

impl Numerics {
    pub fn as_str(self) -> &'static str {
        match self {
            Numerics::Invariant => "invariant",
            Numerics::Fast => "fast",
        }
    }
}

impl std::str::FromStr for Numerics {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "invariant" => Ok(Numerics::Invariant),
            "fast" => Ok(Numerics::Fast),
            other => Err(format!(
                "numerics {other:?} is neither \"invariant\" nor \"fast\""
            )),
        }
    }
}

/// The rows of one sequence inside a ragged batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqRows {
    /// First row of this sequence in the batch's activations.
    pub row0: usize,
    /// Number of new tokens (rows).
    pub len: usize,
    /// Position of the first new token (= tokens already in the cache).
    pub pos0: usize,
    /// Where the sequence's block table starts in the step's tables (`KvRows::table`):
    /// its `blocks_for(pos0 + len)` entries from there.
    pub table0: usize,
}

/// A step's rows as the KV cache sees them: the sequences, and their block tables
/// concatenated (position p of a sequence is row `p % KV_BLOCK` of block
/// `table[table0 + p / KV_BLOCK]`, `arbor_kernels::paged`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRows<'a> {
    pub seqs: &'a [SeqRows],
    pub table: &'a [u32],
}

impl<'a> KvRows<'a> {
    /// The block table of `s` (one of `seqs`): the blocks of its positions `0..pos0+len`.
    pub fn table_of(&self, s: &SeqRows) -> Result<&'a [u32], String> {
        let n = blocks_for(s.pos0 + s.len);
        s.table0
            .checked_add(n)
            .and_then(|end| self.table.get(s.table0..end))
            .ok_or_else(|| {
                format!(
                    "positions {}..{} need block-table entries {}..{}+{n}, the step has {}",
                    s.pos0,
                    s.pos0 + s.len,
                    s.table0,
                    s.table0,
                    self.table.len()
                )
            })
    }

    /// Checks that every sequence's table lies in `table` and names blocks below `blocks`.
    pub fn check(&self, blocks: usize) -> Result<(), String> {
        for s in self.seqs {
            let t = self.table_of(s)?;
            if let Some(b) = t.iter().find(|&&b| b as usize >= blocks) {
                return Err(format!(
                    "the sequence at rows {}..{} names block {b} of a cache of {blocks} blocks",
                    s.row0,
                    s.row0 + s.len
                ));
            }
        }
        Ok(())
    }
}

/// Shape of the local attention heads of one rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadSpec {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// Size of a paged KV cache: `layers × blocks × n_kv_heads × KV_BLOCK × head_dim`, K and V.
pub type KvSpec = PagedKvLayout;

/// Which part of the 8-segment tree a matmul computes: the weight's local K consists of
/// `n_seg` segments of `seg_len` columns (see `arbor_kernels::tree::SegmentLayout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeSpec {
    pub seg_len: usize,
    pub n_seg: usize,
    /// The layer's full (global) K, whatever this rank holds: lets a backend choose a
    /// kernel per weight from global properties only, so the choice is the same at every TP.
    pub k: usize,
}

/// A mixture-of-experts block as [`Backend::moe_forward`] runs it: each token's `top_k`
/// experts (renormalised when `norm_topk_prob`), and the trees of the experts' gate/up
/// (rows alternating gate and up) and down projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeSpec {
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub gate_up: TreeSpec,
    pub down: TreeSpec,
}

/// Everything one step's device work reads that changes from step to step (besides the
/// KV cache it writes): the backend uploads it once per step, and a step it recorded
/// reads it from there when replayed (docs/step.md, "The device-resident step").
#[derive(Debug, Clone, Copy)]
pub struct StepInputs<'a> {
    /// The rows' token ids, sequences concatenated as `seqs` says.
    pub ids: &'a [u32],
    pub seqs: &'a [SeqRows],
    /// The sequences' block tables, concatenated (`SeqRows::table0`).
    pub table: &'a [u32],
    /// The rows whose logits the step computes, in order.
    pub out_rows: &'a [usize],
    /// Per output row: the index whose value its stats report (`u32::MAX`: none).
    pub pick: &'a [u32],
    /// Per output row: what its stats compute for its draw where the logits are (a pure
    /// temperature's Gumbel-max draw, a whole-vocabulary top-p's tempered sum).
    pub draws: &'a [crate::sampling::RowDraw],
    /// Per output row: how many top candidates to select (0: none; at most
    /// `sampling::CANDIDATES_MAX`).
    pub ks: &'a [usize],
    /// The logits columns that are the vocabulary.
    pub vocab: usize,
    /// Identifies the KV cache the step runs on ([`Backend::cache_key`]): a recorded step
    /// writes that cache's memory and is replayed only on it.
    pub cache: u64,
    /// Whether a row may come to the host whole after the step (a constrained row, drawn
    /// there from its masked logits): a recorded step must then keep its logits.
    pub rows_to_host: bool,
}

/// The constrained rows a step draws where its logits are, asked for once the step's
/// device work is under way (their masks may be computed meanwhile, or arrive from rank
/// 0): their stats' `sampled` and `sampled_value` become the masked draw's, left at
/// `u32::MAX` where `constraint::draw_masked` finds no allowed value above −∞ (the row
/// then comes to the host through `WantRow`). An error here is the caller's own, which it
/// keeps: the backend only passes it on.
pub type MaskedRows<'f, 'm> = dyn FnMut() -> BResult<Vec<MaskedRow<'m>>> + 'f;

/// A constrained output row whose token the backend draws where the logits are
/// ([`Backend::masked_draws`]).
#[derive(Debug, Clone, Copy)]
pub struct MaskedRow<'a> {
    /// The output row.
    pub row: usize,
    pub draw: crate::sampling::MaskedDraw,
    pub mask: &'a crate::constraint::TokenMask,
}

/// Puts the masked draws (`Backend::masked_draws`'s answers, one per `masked` row) into
/// their rows' stats.
pub fn set_masked_draws(
    stats: &mut [crate::sampling::RowStats],
    masked: &[MaskedRow<'_>],
    drawn: &[Option<(u32, f32)>],
) -> BResult<()> {
    if drawn.len() != masked.len() {
        return Err(BackendError::Shape(format!(
            "{} masked draws for {} constrained rows",
            drawn.len(),
            masked.len()
        )));
    }
    let n = stats.len();
    for (m, d) in masked.iter().zip(drawn) {
        let st = stats.get_mut(m.row).ok_or_else(|| {
            BackendError::Shape(format!(
                "constrained row {} of a step with {n} output rows",
                m.row
            ))
        })?;
        if let Some((t, v)) = *d {
            st.sampled = t;
            st.sampled_value = v;
        }
    }
    Ok(())
}

impl StepInputs<'_> {
    /// The rows and their block tables.
    pub fn kv_rows(&self) -> KvRows<'_> {
        KvRows {
            seqs: self.seqs,
            table: self.table,
        }
    }

    /// One row per sequence, and every row's logits in row order: the shape of a decode
    /// step (whatever its size), which a backend may record once and replay.
    pub fn is_decode_shaped(&self) -> bool {
        self.ids.len() == self.seqs.len()
            && self.out_rows.len() == self.ids.len()
            && self.out_rows.iter().enumerate().all(|(i, &r)| i == r)
            && self
                .seqs
                .iter()
                .enumerate()
                .all(|(i, s)| s.row0 == i && s.len == 1)
    }
}

/// What a step returns per output row: its stats, where `StepInputs::ks` asked its top
/// candidates (empty when no row asked for any), and the rows (their `vocab` values) that
/// the step's `WantRow` asked for after seeing those (empty when none did).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepResults {
    pub stats: Vec<crate::sampling::RowStats>,
    pub cands: Vec<Vec<(u32, f32)>>,
    pub rows: Vec<Option<Vec<f32>>>,
}

/// Whether output row `r` must come to the host after all, given its stats and
/// candidates (a top-p nucleus larger than the candidates).
pub type WantRow<'f> = dyn Fn(usize, &crate::sampling::RowStats, &[(u32, f32)]) -> bool + 'f;

/// The device work of one step given its (possibly padded) inputs: the logits of
/// `inputs.out_rows`, or `None` when there are none. It must take everything that varies
/// from step to step from `inputs`, since a backend may record it once and replay the
/// recording for later steps of the same shape without calling it.
pub type StepForward<'f, B> =
    dyn FnMut(&B, &StepInputs<'_>) -> BResult<Option<<B as Backend>::Act>> + 'f;

pub trait Backend {
    /// f32 matrix `[rows, cols]` in device memory.
    type Act;
    /// bf16 weight matrix `[n, k]` in device memory.
    type Mat: Send + Sync;
    type KvCache;
    /// A mixture-of-experts block's experts prepared for [`Backend::moe_forward`].
    type Experts: Send + Sync;

    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    fn device_name(&self) -> String;

    fn mat_from_host(&self, data: &[half::bf16], n: usize, k: usize) -> BResult<Self::Mat>;

    /// The `[n, k]` bf16 weight made from `cuts` of tensors this backend holds
    /// ([`DeviceTensor`]), each block converted to bf16 where it lands; rows no cut writes
    /// are zero. `Ok(Err(_))` names the first value that is not finite in bf16 (cuts in
    /// order, elements in row-major order within each), as a host load refuses it.
    /// Backends with no memory of their own for such tensors: Unsupported.
    fn mat_from_device(
        &self,
        n: usize,
        k: usize,
        cuts: &[DeviceCut<'_>],
    ) -> BResult<Result<Self::Mat, NonFinite>> {
        let _ = (n, k, cuts);
        Err(BackendError::Unsupported(format!(
            "rank {}: {} holds no device-resident tensors",
            self.rank(),
            self.device_name()
        )))
    }

    /// `data` copied into this backend's memory, for [`Backend::mat_from_device`] (what a
    /// trainer's broadcast leaves there; tests make their tensors so).
    fn device_bytes(&self, data: &[u8]) -> BResult<std::sync::Arc<dyn DeviceBytes>> {
        let _ = data;
        Err(BackendError::Unsupported(format!(
            "rank {}: {} holds no device-resident tensors",
            self.rank(),
            self.device_name()
        )))
    }

    /// A weight `[n, k]` whose rows `fill(rows, dst)` writes (`dst`: `rows.len()` × `k`
    /// values). A backend may call it chunk by chunk, into the memory it copies to the
    /// device from, so that one chunk's copy overlaps the next one's reading (a load is
    /// then bounded by the host's reading, not by reading plus copying); by default one
    /// host buffer takes the whole weight.
    fn mat_from_rows(&self, n: usize, k: usize, fill: &mut RowFill<'_>) -> MResult<Self::Mat> {
        let mut data = vec![half::bf16::ZERO; n * k];
        fill(0..n, &mut data)?;
        self.mat_from_host(&data, n, k)
            .map_err(|source| ModelError::Backend {
                rank: self.rank(),
                source,
            })
    }
    /// Seconds the host has waited so far for weight copies to the device to free the
    /// memory it fills (`mat_from_rows`): the part of a load that the copies bound.
    fn upload_wait_seconds(&self) -> f64 {
        0.0
    }
    fn act_from_host(&self, data: &[f32], rows: usize, cols: usize) -> BResult<Self::Act>;
    fn act_to_host(&self, a: &Self::Act) -> BResult<Vec<f32>>;
    /// (rows, cols)
    fn shape(&self, a: &Self::Act) -> (usize, usize);
    /// Same data viewed as `[rows, cols]` (rows·cols unchanged).
    fn reshape(&self, a: Self::Act, rows: usize, cols: usize) -> BResult<Self::Act>;
    /// The given rows, in the given order.
    fn select_rows(&self, a: &Self::Act, rows: &[usize]) -> BResult<Self::Act>;

    fn embedding(&self, table: &Self::Mat, ids: &[u32]) -> BResult<Self::Act>;
    /// Per-row RMSNorm; `weight` is `[1, cols]`.
    fn rms_norm(&self, x: &Self::Act, weight: &Self::Act, eps: f32) -> BResult<Self::Act>;
    /// x (rounded to bf16) · wᵀ, the subtree root over the weight's local segments.
    fn matmul(&self, x: &Self::Act, w: &Self::Mat, tree: TreeSpec) -> BResult<Self::Act>;
    fn add_row_bias(&self, x: &mut Self::Act, bias: &Self::Act) -> BResult<()>;
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act) -> BResult<()>;
    fn silu_mul(&self, gate: &Self::Act, up: &Self::Act) -> BResult<Self::Act>;
    /// `silu_mul` of a gate/up output `[rows, 2·inter]` whose gate and up columns
    /// alternate (column 2j gate j, 2j + 1 up j): the bits of `silu_mul` of the two.
    fn silu_mul_pairs(&self, gu: &Self::Act) -> BResult<Self::Act>;
    /// `silu_mul_pairs(matmul(x, w, tree))` for a weight whose rows alternate gate and up;
    /// a backend may compute the SiLU·mul in the GEMM's epilogue (same bits).
    fn matmul_silu_mul(&self, x: &Self::Act, w: &Self::Mat, tree: TreeSpec) -> BResult<Self::Act> {
        let gu = self.matmul(x, w, tree)?;
        self.silu_mul_pairs(&gu)
    }
    /// Consecutive column blocks of `x` of the given widths (which sum to its columns).
    fn split_cols(&self, x: &Self::Act, widths: &[usize]) -> BResult<Vec<Self::Act>>;
    /// Rotate `x` (`[rows, n_heads*head_dim]`) in place at the positions `seqs` give.
    fn rope(
        &self,
        x: &mut Self::Act,
        seqs: &[SeqRows],
        n_heads: usize,
        table: &RopeTable,
    ) -> BResult<()>;

    /// `x += y`, then `rms_norm` of the sum: the residual add and the next norm. The
    /// bits are those of the two ops; a backend may run them as one pass.
    fn add_rms_norm(
        &self,
        x: &mut Self::Act,
        y: &Self::Act,
        weight: &Self::Act,
        eps: f32,
    ) -> BResult<Self::Act> {
        self.add_assign(x, y)?;
        self.rms_norm(x, weight, eps)
    }

    /// The fused q/k/v output (`[rows, (n_heads + 2·n_kv_heads)·head_dim]`, q, k and v
    /// column blocks): rotates q and k, writes k and v into the cache at the positions
    /// `seqs` give, and returns q. The bits of `split_cols`, `rope` (q, k) and `kv_write`;
    /// a backend may run them as one pass.
    fn qkv_rope_kv(
        &self,
        qkv: &Self::Act,
        cache: &mut Self::KvCache,
        layer: usize,
        rows: KvRows<'_>,
        heads: HeadSpec,
        table: &RopeTable,
    ) -> BResult<Self::Act> {
        qkv_rope_kv_unfused(self, qkv, cache, layer, rows, heads, table)
    }

    fn kv_cache(&self, spec: KvSpec) -> BResult<Self::KvCache>;
    /// Write K and V (`[rows, n_kv_heads*head_dim]`, rounded to bf16) at the positions
    /// `rows` give, into the blocks their tables name.
    fn kv_write(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        k: &Self::Act,
        v: &Self::Act,
        rows: KvRows<'_>,
    ) -> BResult<()>;
    /// Causal attention of `q` against the cache (which already holds this batch's keys),
    /// each sequence's keys read through its block table.
    fn attention(
        &self,
        q: &Self::Act,
        cache: &Self::KvCache,
        layer: usize,
        rows: KvRows<'_>,
        heads: HeadSpec,
    ) -> BResult<Self::Act>;
    /// The smallest of every rank's `value` (an all-gather): what all ranks agree on, e.g.
    /// the KV blocks that fit on every rank.
    fn min_over_ranks(&self, value: u64) -> BResult<u64>;
    /// Device memory free now that this rank may plan for (its share, where ranks share
    /// the device), in bytes; `None` where the cache lives in host memory.
    fn free_device_memory(&self) -> BResult<Option<u64>> {
        Ok(None)
    }

    /// Prepares a mixture-of-experts block's experts (each one's gate/up and down weight,
    /// in expert order) for [`Backend::moe_forward`]; `None` where this backend routes on
    /// the host (`layers::moe` then runs each expert as a dense MLP).
    fn moe_experts(
        &self,
        gate_up: &[&Self::Mat],
        down: &[&Self::Mat],
        spec: MoeSpec,
    ) -> BResult<Option<Self::Experts>>;
    /// A mixture-of-experts block's output `[rows, hidden]` for `x` and its router's f32
    /// `logits` (`[rows, experts]`), computed where the activations are: the routes of
    /// `layers::moe::route`, each expert's rows through its MLP with the down projection
    /// reduced by the tree all-reduce, and each token's expert outputs weighted and added
    /// in expert order. With `routes`, also appends each row's experts (`[rows, top_k]`,
    /// in expert order) as routed: a response that reports them reads the device's own
    /// choice, not a recomputation.
    fn moe_forward(
        &self,
        x: &Self::Act,
        logits: &Self::Act,
        experts: &Self::Experts,
        routes: Option<&mut Vec<u32>>,
    ) -> BResult<Self::Act>;

    /// The row-parallel all-reduce: every rank passes the subtree root of its segments;
    /// every rank gets the full tree's root (same bits on all ranks and at every TP).
    fn tree_all_reduce(&self, partial: Self::Act) -> BResult<Self::Act>;
    /// Per row of `logits` (its first `vocab` columns): argmax, the max, log Σ exp, the
    /// value at `pick[r]` (`u32::MAX`: none), the digest and, where `draws[r]` asks, the
    /// Gumbel-max draw (`sampling::RowStats`), computed where the logits are, so that a
    /// step need not download them.
    fn row_stats(
        &self,
        logits: &Self::Act,
        vocab: usize,
        pick: &[u32],
        draws: &[crate::sampling::RowDraw],
    ) -> BResult<Vec<crate::sampling::RowStats>>;
    /// Per row of `logits` (its first `vocab` columns): the `ks[r]` largest values (NaN
    /// excluded) as (index, value), most likely first, lowest index first on ties
    /// (`sampling::top_k_candidates`); `ks[r] = 0`: none, and at most
    /// `sampling::CANDIDATES_MAX`. A top-k draw needs only these, not the row on the host.
    fn top_k(
        &self,
        logits: &Self::Act,
        vocab: usize,
        ks: &[usize],
    ) -> BResult<Vec<Vec<(u32, f32)>>> {
        let (rows, cols) = self.shape(logits);
        if ks.len() != rows || vocab > cols {
            return Err(BackendError::Shape(format!(
                "top_k of [{rows}, {cols}] logits with vocab {vocab} and {} k's",
                ks.len()
            )));
        }
        let host = self.act_to_host(logits)?;
        Ok(ks
            .iter()
            .enumerate()
            .map(|(r, &k)| {
                let row = &host[r * cols..r * cols + vocab];
                crate::sampling::top_k_candidates(row, k)
            })
            .collect())
    }
    /// Per `masked` row of `logits` (its first `vocab` columns): the token
    /// `constraint::draw_masked` draws over the ids its mask allows, and the row's value
    /// there; `None` where that finds none above −∞. A backend that computes it where the
    /// logits are sends the masks there instead of bringing the rows back.
    fn masked_draws(
        &self,
        logits: &Self::Act,
        vocab: usize,
        masked: &[MaskedRow<'_>],
    ) -> BResult<Vec<Option<(u32, f32)>>> {
        if masked.is_empty() {
            return Ok(Vec::new());
        }
        let (rows, cols) = self.shape(logits);
        if vocab > cols || masked.iter().any(|m| m.row >= rows) {
            return Err(BackendError::Shape(format!(
                "masked draws on rows {:?} of [{rows}, {cols}] logits with vocab {vocab}",
                masked.iter().map(|m| m.row).collect::<Vec<_>>()
            )));
        }
        let host = self.act_to_host(logits)?;
        Ok(masked
            .iter()
            .map(|m| {
                let row = &host[m.row * cols..m.row * cols + vocab];
                crate::constraint::draw_masked(row, m.mask, m.draw).map(|t| (t, row[t as usize]))
            })
            .collect())
    }
    /// Concatenate the ranks' column blocks (equal widths): `[rows, cols]` → `[rows, world·cols]`.
    fn all_gather_cols(&self, x: &Self::Act) -> BResult<Self::Act>;

    /// A step: `forward`'s logits, then each output row's stats and top candidates
    /// (`row_stats`, `top_k`), then the rows `want_row` asks for. A backend may upload the
    /// inputs once, pad a decode-shaped step to a fixed batch size, record it and replay
    /// the recording on later steps instead of calling `forward` (the CUDA backend's
    /// graphs); the results are the same bits either way, since every kernel is batch
    /// invariant.
    fn run_step(
        &self,
        inputs: &StepInputs<'_>,
        forward: &mut StepForward<'_, Self>,
        masked: &mut MaskedRows<'_, '_>,
        want_row: &WantRow<'_>,
    ) -> BResult<StepResults>
    where
        Self: Sized,
    {
        let Some(logits) = forward(self, inputs)? else {
            return Ok(StepResults::default());
        };
        let mut stats = self.row_stats(&logits, inputs.vocab, inputs.pick, inputs.draws)?;
        let masked = masked()?;
        let drawn = self.masked_draws(&logits, inputs.vocab, &masked)?;
        set_masked_draws(&mut stats, &masked, &drawn)?;
        let cands = if inputs.ks.iter().any(|&k| k > 0) {
            self.top_k(&logits, inputs.vocab, inputs.ks)?
        } else {
            Vec::new()
        };
        let wanted = wanted_rows(&stats, &cands, want_row);
        let mut rows = Vec::new();
        if !wanted.is_empty() {
            let (_, cols) = self.shape(&logits);
            let host = self.act_to_host(&logits)?;
            rows = vec![None; stats.len()];
            for r in wanted {
                rows[r] = Some(host[r * cols..r * cols + inputs.vocab].to_vec());
            }
        }
        Ok(StepResults { stats, cands, rows })
    }

    /// An identity for `cache` that differs from every other live cache's (0 where the
    /// backend records nothing).
    fn cache_key(&self, _cache: &Self::KvCache) -> u64 {
        0
    }

    /// Where `run_step` records steps: the shapes recorded and the steps run from a
    /// recording so far; `None` where it never records.
    fn recorded_steps(&self) -> Option<(u64, u64)> {
        None
    }

    /// Drops every recorded step: a recording reads the weights and writes the cache it
    /// was made with, so it must never run after either is replaced or freed.
    fn forget_recordings(&self) {}

    /// Gives device memory this rank keeps but no longer uses back to the driver (after
    /// `release_memory_occupation` dropped the weights or the cache), and returns the
    /// device's free memory afterwards; `None` where there is no device.
    fn give_back_memory(&self) -> BResult<Option<u64>> {
        Ok(None)
    }

    /// Copies the bytes of `buffers` (allocations a trainer on this rank's GPU shares by
    /// CUDA IPC handle, `batching::ipc`) device to device into this backend's own memory,
    /// one [`DeviceBytes`] per buffer, for [`Backend::mat_from_device`]. GPU backends only;
    /// each buffer's device must be this rank's GPU.
    fn copy_ipc(
        &self,
        _buffers: &[crate::batching::ipc::IpcBuffer],
    ) -> BResult<Vec<std::sync::Arc<dyn DeviceBytes>>> {
        Err(BackendError::Unsupported(format!(
            "rank {}: CUDA IPC needs a CUDA rank (--device cuda) on the trainer's GPU; this rank runs on {}: send the tensors as a safetensors body (Content-Type: application/octet-stream) instead",
            self.rank(),
            self.device_name()
        )))
    }

    /// Joins the NCCL group of a trainer process that broadcasts new weights (the trainer
    /// is rank 0 of `world`; this backend's rank is `rank` in it). `unique_id` is the
    /// 128-byte `ncclUniqueId` the trainer made. Collective with the trainer: fails when
    /// it has not joined within `timeout`. GPU backends only.
    fn join_weights_group(
        &self,
        unique_id: &[u8],
        world: usize,
        rank: usize,
        timeout: std::time::Duration,
    ) -> BResult<Box<dyn WeightsGroup>> {
        self.weights_group_joiner(world, rank, timeout)?(unique_id)
    }

    /// A fresh NCCL unique id, made where this rank is the group's rank 0 (the trainer
    /// takes another rank). GPU backends only.
    fn weights_group_unique_id(&self) -> BResult<[u8; 128]> {
        Err(BackendError::Unsupported(format!(
            "rank {}: a NCCL weight-update group needs GPU ranks (--device cuda); this rank runs on {}: push the weights over HTTP (update_weights_from_tensor) or from disk instead",
            self.rank(),
            self.device_name()
        )))
    }

    /// What [`Backend::join_weights_group`] does once the unique id is known, ready to run
    /// on another thread: a rank that reads the id from the trainer's store waits for it
    /// there while it serves. Fails at once where this backend cannot join (CPU ranks,
    /// ranks sharing a GPU).
    fn weights_group_joiner(
        &self,
        _world: usize,
        _rank: usize,
        _timeout: std::time::Duration,
    ) -> BResult<WeightsGroupJoiner> {
        Err(BackendError::Unsupported(format!(
            "rank {}: a NCCL weight-update group needs GPU ranks (--device cuda); this rank runs on {}: push the weights over HTTP (update_weights_from_tensor) or from disk instead",
            self.rank(),
            self.device_name()
        )))
    }
}

/// Joins a trainer's NCCL group given its unique id ([`Backend::weights_group_joiner`]).
pub type WeightsGroupJoiner = Box<dyn FnOnce(&[u8]) -> BResult<Box<dyn WeightsGroup>> + Send>;

/// A NCCL group joined with a trainer (`Backend::join_weights_group`).
pub trait WeightsGroup: Send {
    /// Receives one broadcast from the trainer (group rank `root`) per entry of `parts`
    /// (its size in bytes and what it carries), in order, into this rank's device memory.
    /// The broadcasts are queued back to back and waited for together; fails, leaving the
    /// group unusable, when the next one has not arrived within `timeout` of the previous.
    fn receive(
        &mut self,
        parts: &[(usize, Wire)],
        root: usize,
        timeout: std::time::Duration,
    ) -> BResult<Vec<std::sync::Arc<dyn DeviceBytes>>>;

    /// A sum all-reduce of one f32 zero with every member, as vLLM's `PyNcclCommunicator`
    /// runs right after it joins (its members wait for it), waiting at most `timeout`.
    fn warm_up(&mut self, timeout: std::time::Duration) -> BResult<()>;

    /// Leaves the group without waiting for the other members, as the process ends:
    /// destroying a communicator waits for every member to destroy theirs, and a wait
    /// still running when the process exits tears NCCL down under it.
    fn abort(self: Box<Self>) {}
}

/// The output rows `want_row` asks for, in order.
pub fn wanted_rows(
    stats: &[crate::sampling::RowStats],
    cands: &[Vec<(u32, f32)>],
    want_row: &WantRow<'_>,
) -> Vec<usize> {
    (0..stats.len())
        .filter(|&r| want_row(r, &stats[r], cands.get(r).map_or(&[], Vec::as_slice)))
        .collect()
}

/// `Backend::qkv_rope_kv` as its four ops (the definition of its bits).
pub fn qkv_rope_kv_unfused<B: Backend + ?Sized>(
    b: &B,
    qkv: &B::Act,
    cache: &mut B::KvCache,
    layer: usize,
    rows: KvRows<'_>,
    heads: HeadSpec,
    table: &RopeTable,
) -> BResult<B::Act> {
    let (q_dim, kv_dim) = (
        heads.n_heads * heads.head_dim,
        heads.n_kv_heads * heads.head_dim,
    );
    let [mut q, mut k, v]: [B::Act; 3] = b
        .split_cols(qkv, &[q_dim, kv_dim, kv_dim])?
        .try_into()
        .map_err(|_| BackendError::Shape("q/k/v split into other than 3 parts".into()))?;
    b.rope(&mut q, rows.seqs, heads.n_heads, table)?;
    b.rope(&mut k, rows.seqs, heads.n_kv_heads, table)?;
    b.kv_write(cache, layer, &k, &v, rows)?;
    Ok(q)
}
