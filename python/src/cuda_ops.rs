//! `arbor._native.CudaOps`: the forward of `arbor.torch`'s operations on CUDA tensors. Each
//! runs arbor's CUDA backend — the same methods, so the same kernels chosen the same way,
//! as a serving rank's step at TP 1 — on views of the torch tensors (weights and inputs are
//! read in place), and writes the result into the output tensor torch allocated (the
//! kernels write there themselves: the backend's `*_to` methods). arbor's
//! stream waits for the caller's stream before the op and the caller's stream waits for
//! arbor's after it, so torch's own ordering (and its allocator's reuse of freed memory)
//! holds across the call.

use std::sync::Mutex;

use arbor_kernels::cpu::RowDraw;
use arbor_kernels::cuda::ops::{ROW_STATS_F32, ROW_STATS_U64};
use arbor_kernels::paged::blocks_for;
use arbor_kernels::tree::{SegmentLayout, SEGMENTS};
use arbor_model::backend::cuda::{CudaAct, CudaBackend, CudaMat};
use arbor_model::backend::{Backend, HeadSpec, KvRows, KvSpec, SeqRows, TreeSpec};
use arbor_model::safetensors::DType;
use pyo3::prelude::*;

use crate::error::{NResult, NativeError};
use crate::ops::{expect_shape, int64_operand, int_operand, operand, sequences, Mem, Place};
use crate::spec::ModelSpec;
use crate::tensors::IntDType;

#[pyclass(module = "arbor._native", name = "CudaOps", frozen)]
pub struct CudaOps {
    /// One op at a time: the backend's step state (its row map) is per call.
    backend: Mutex<CudaBackend>,
    ordinal: usize,
}

// SAFETY: the backend is only reached through the Mutex, one thread at a time; its CUDA
// handles (context, stream, modules) may be used from any thread once bound, which every
// launch does (`bind_to_thread`).
unsafe impl Send for CudaOps {}
unsafe impl Sync for CudaOps {}

impl CudaOps {
    /// Where this backend's operands must be.
    fn place(&self) -> Place {
        Place::Cuda(self.ordinal)
    }

    /// Runs `f` on the backend between the two stream orderings (see the module comment).
    fn run<T>(&self, stream: u64, f: impl FnOnce(&CudaBackend) -> NResult<T>) -> NResult<T> {
        let b = self
            .backend
            .lock()
            .map_err(|e| NativeError::Poisoned(e.to_string()))?;
        b.wait_for_stream(stream).map_err(model_err)?;
        let out = f(&b);
        // Ordered even after a failed op: the caller's stream must not outrun what was queued.
        b.release_to_stream(stream).map_err(model_err)?;
        out
    }
}

fn model_err(e: arbor_model::backend::BackendError) -> NativeError {
    NativeError::Backend(e)
}

#[pymethods]
impl CudaOps {
    /// arbor's CUDA backend on GPU `ordinal` (the device of the tensors it will be given).
    #[new]
    fn new(ordinal: usize) -> PyResult<Self> {
        // Under the GIL: the backend holds CUDA handles that are not `Send` by type.
        let backend = CudaBackend::for_foreign_tensors(ordinal).map_err(model_err)?;
        Ok(CudaOps {
            backend: Mutex::new(backend),
            ordinal,
        })
    }

    #[getter]
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// `out = bf16(x) · wᵀ` in f32 with arbor's tree order over K. `x` f32 `[M, K]` (with
    /// `xb`, its bf16 rounding, the GEMM reads that instead of converting), `w` bf16
    /// `[N, K]`, `out` f32 `[M, N]`; `stream` the caller's `CUstream`.
    #[pyo3(signature = (x, xb, w, out, stream))]
    fn tree_linear(
        &self,
        x: &Bound<'_, PyAny>,
        xb: Option<&Bound<'_, PyAny>>,
        w: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        const OP: &str = "tree_linear";
        let lin = LinearIn::new(OP, x, xb, w, self.place())?;
        let o = operand(OP, "out", out, DType::F32, 2, self.place())?;
        expect_shape(OP, "out", &o, &[lin.m, lin.n])?;
        Ok(self.run(stream, |b| {
            // SAFETY: x, w and out are CUDA tensors of these shapes on this device, held by
            // the caller for the call; the caller's stream waits for this op before reusing them.
            unsafe {
                let (xa, wm) = lin.borrow(b);
                b.matmul_to(&xa, &wm, lin.tree, o.addr()).map_err(model_err)
            }
        })?)
    }

    /// `out = silu(gate)·up` of `bf16(x) · wᵀ` whose weight rows alternate gate and up
    /// (row 2j gate j, row 2j + 1 up j): the engine's fused gate/up projection, its
    /// epilogue computing SiLU·mul where the GEMM has one (the bits of `tree_linear` then
    /// `silu_mul` on the two halves). `x` f32 `[M, K]` (`xb` its bf16), `w` bf16 `[2I, K]`,
    /// `out` f32 `[M, I]`, `outb` (optional) bf16 `[M, I]`: `out` rounded to bf16.
    #[pyo3(signature = (x, xb, w, out, outb, stream))]
    fn tree_linear_silu(
        &self,
        x: &Bound<'_, PyAny>,
        xb: Option<&Bound<'_, PyAny>>,
        w: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        outb: Option<&Bound<'_, PyAny>>,
        stream: u64,
    ) -> PyResult<()> {
        const OP: &str = "tree_linear_silu";
        let lin = LinearIn::new(OP, x, xb, w, self.place())?;
        let (m, n) = (lin.m, lin.n);
        if n % 2 != 0 {
            return Err(NativeError::Input(format!(
                "{OP}: the gate/up weight has {n} rows, not an even count"
            ))
            .into());
        }
        let o = operand(OP, "out", out, DType::F32, 2, self.place())?;
        expect_shape(OP, "out", &o, &[m, n / 2])?;
        let ob = bf16_out(OP, outb, &[m, n / 2], self.place())?;
        Ok(self.run(stream, |b| {
            // SAFETY: as in `tree_linear`; outb, when given, is a bf16 CUDA tensor of out's
            // shape on this device, held by the caller for the call.
            unsafe {
                let (xa, wm) = lin.borrow(b);
                b.matmul_silu_mul_to(&xa, &wm, lin.tree, o.addr(), ob.as_ref().map(Mem::addr))
                    .map_err(model_err)
            }
        })?)
    }

    /// Per row `x / sqrt(mean(x²) + eps) · weight`, f32 `[R, C]`, `weight` f32 `[C]`;
    /// `outb` (optional) bf16 `[R, C]`: `out` rounded to bf16, written by the same kernel
    /// (the input a following linear reads).
    #[pyo3(signature = (x, weight, eps, out, stream, outb=None))]
    fn rms_norm(
        &self,
        x: &Bound<'_, PyAny>,
        weight: &Bound<'_, PyAny>,
        eps: f32,
        out: &Bound<'_, PyAny>,
        stream: u64,
        outb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        const OP: &str = "rms_norm";
        let x = operand(OP, "x", x, DType::F32, 2, self.place())?;
        let w = operand(OP, "weight", weight, DType::F32, 1, self.place())?;
        let o = operand(OP, "out", out, DType::F32, 2, self.place())?;
        let (r, c) = (x.shape[0], x.shape[1]);
        expect_shape(OP, "weight", &w, &[c])?;
        expect_shape(OP, "out", &o, &[r, c])?;
        let ob = bf16_out(OP, outb, &[r, c], self.place())?;
        Ok(self.run(stream, |b| {
            // SAFETY: as in `tree_linear_silu`.
            unsafe {
                let xa = b.borrow_act(x.addr(), r, c);
                let wa = b.borrow_act(w.addr(), 1, c);
                b.rms_norm_to(&xa, &wa, eps, o.addr(), ob.as_ref().map(Mem::addr))
                    .map_err(model_err)
            }
        })?)
    }

    /// `silu(gate) · up`, f32, one shape `[R, C]`.
    fn silu_mul(
        &self,
        gate: &Bound<'_, PyAny>,
        up: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        const OP: &str = "silu_mul";
        let g = operand(OP, "gate", gate, DType::F32, 2, self.place())?;
        let u = operand(OP, "up", up, DType::F32, 2, self.place())?;
        let o = operand(OP, "out", out, DType::F32, 2, self.place())?;
        let (r, c) = (g.shape[0], g.shape[1]);
        expect_shape(OP, "up", &u, &[r, c])?;
        expect_shape(OP, "out", &o, &[r, c])?;
        Ok(self.run(stream, |b| {
            // SAFETY: as in `tree_linear`.
            unsafe {
                let ga = b.borrow_act(g.addr(), r, c);
                let ua = b.borrow_act(u.addr(), r, c);
                b.silu_mul_to(&ga, &ua, o.addr()).map_err(model_err)
            }
        })?)
    }

    /// `silu(gate)·up` of `gu` f32 `[R, 2C]` whose columns alternate gate and up (column
    /// 2j gate j, 2j + 1 up j), into `out` f32 `[R, C]` and, rounded to bf16, `outb`
    /// (optional, bf16 `[R, C]`): the bits of `silu_mul` on the two halves.
    #[pyo3(signature = (gu, out, outb, stream))]
    fn silu_mul_pairs(
        &self,
        gu: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        outb: Option<&Bound<'_, PyAny>>,
        stream: u64,
    ) -> PyResult<()> {
        const OP: &str = "silu_mul_pairs";
        let g = operand(OP, "gu", gu, DType::F32, 2, self.place())?;
        let (r, c2) = (g.shape[0], g.shape[1]);
        if c2 % 2 != 0 {
            return Err(NativeError::Input(format!(
                "{OP}: gu has {c2} columns, not an even count"
            ))
            .into());
        }
        let o = operand(OP, "out", out, DType::F32, 2, self.place())?;
        expect_shape(OP, "out", &o, &[r, c2 / 2])?;
        let ob = bf16_out(OP, outb, &[r, c2 / 2], self.place())?;
        Ok(self.run(stream, |b| {
            // SAFETY: as in `tree_linear_silu`.
            unsafe {
                let ga = b.borrow_act(g.addr(), r, c2);
                b.silu_mul_pairs_to(&ga, o.addr(), ob.as_ref().map(Mem::addr))
                    .map_err(model_err)
            }
        })?)
    }

    /// RoPE on `q` and `k` (rows at positions `0..len` of each packed sequence), keys and
    /// values into a KV cache of one layer, causal attention: what a serving rank's prefill
    /// step does with a layer's q/k/v. With `fused`, `qkv` is q, k and v side by side
    /// (`[T, (n_heads + 2·n_kv_heads)·head_dim]`, the engine's fused kernel for models
    /// without q/k norms); otherwise `q`, `k`, `v` are separate (the engine's path for
    /// Qwen3). `out` f32 `[T, n_heads·head_dim]`.
    #[allow(clippy::too_many_arguments)]
    /// `outb` (optional) bf16 of `out`'s shape: `out` rounded to bf16 (the o projection's
    /// input).
    #[pyo3(signature = (spec, qkv, q, k, v, cu_seqlens, n_heads, n_kv_heads, out, stream, outb=None))]
    fn rope_attention(
        &self,
        spec: &ModelSpec,
        qkv: Option<&Bound<'_, PyAny>>,
        q: Option<&Bound<'_, PyAny>>,
        k: Option<&Bound<'_, PyAny>>,
        v: Option<&Bound<'_, PyAny>>,
        cu_seqlens: Vec<usize>,
        n_heads: usize,
        n_kv_heads: usize,
        out: &Bound<'_, PyAny>,
        stream: u64,
        outb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        const OP: &str = "rope_attention";
        let hd = spec.head_dim();
        let (qw, kvw) = (n_heads * hd, n_kv_heads * hd);
        let o = operand(OP, "out", out, DType::F32, 2, self.place())?;
        let rows = o.shape[0];
        expect_shape(OP, "out", &o, &[rows, qw])?;
        let ob = bf16_out(OP, outb, &[rows, qw], self.place())?;
        let seqs = sequences(OP, &cu_seqlens, rows)?;
        let longest = seqs.iter().map(|&(_, n)| n).max().unwrap_or(0);
        let table = spec.table(longest)?;
        let operand = |what: &str, t: Option<&Bound<'_, PyAny>>, w: usize| -> NResult<Mem> {
            let t = t.ok_or_else(|| NativeError::Input(format!("{OP}: {what} is missing")))?;
            let m = operand(OP, what, t, DType::F32, 2, self.place())?;
            expect_shape(OP, what, &m, &[rows, w])?;
            Ok(m)
        };
        let inputs = match qkv {
            Some(t) => Err(operand("qkv", Some(t), qw + 2 * kvw)?),
            None => Ok((
                operand("q", q, qw)?,
                operand("k", k, kvw)?,
                operand("v", v, kvw)?,
            )),
        };
        // Each sequence's blocks follow the previous one's: position p of sequence s is
        // row p % KV_BLOCK of block table0(s) + p / KV_BLOCK.
        let mut kv_seqs = Vec::with_capacity(seqs.len());
        let mut blocks = 0;
        for &(row0, len) in &seqs {
            kv_seqs.push(SeqRows {
                row0,
                len,
                pos0: 0,
                table0: blocks,
            });
            blocks += blocks_for(len);
        }
        let block_table: Vec<u32> = (0..blocks as u32).collect();
        let heads = HeadSpec {
            n_heads,
            n_kv_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        Ok(self.run(stream, |b| {
            let kv_rows = KvRows {
                seqs: &kv_seqs,
                table: &block_table,
            };
            let mut cache = b
                .kv_cache(KvSpec {
                    layers: 1,
                    blocks: blocks.max(1),
                    n_kv_heads,
                    head_dim: hd,
                })
                .map_err(model_err)?;
            // SAFETY: as in `tree_linear`; the borrowed q and k are copied before RoPE
            // rotates them in place, so the caller's tensors are only read.
            unsafe {
                let q = match &inputs {
                    Err(qkv) => {
                        let a = b.borrow_act(qkv.addr(), rows, qw + 2 * kvw);
                        b.qkv_rope_kv(&a, &mut cache, 0, kv_rows, heads, &table)
                            .map_err(model_err)?
                    }
                    Ok((q, k, v)) => {
                        let all: Vec<usize> = (0..rows).collect();
                        let mut qa = b
                            .select_rows(&b.borrow_act(q.addr(), rows, qw), &all)
                            .map_err(model_err)?;
                        let mut ka = b
                            .select_rows(&b.borrow_act(k.addr(), rows, kvw), &all)
                            .map_err(model_err)?;
                        let va = b.borrow_act(v.addr(), rows, kvw);
                        b.rope(&mut qa, &kv_seqs, n_heads, &table)
                            .map_err(model_err)?;
                        b.rope(&mut ka, &kv_seqs, n_kv_heads, &table)
                            .map_err(model_err)?;
                        b.kv_write(&mut cache, 0, &ka, &va, kv_rows)
                            .map_err(model_err)?;
                        qa
                    }
                };
                b.attention_to(
                    &q,
                    &cache,
                    0,
                    kv_rows,
                    heads,
                    o.addr(),
                    ob.as_ref().map(Mem::addr),
                )
                .map_err(model_err)
            }
        })?)
    }

    /// Whether the engine runs a TP-1 MoE block of `experts` experts, `hidden` wide with
    /// `inter` intermediate columns each and `top_k` a token, on the device (its routing
    /// kernel and grouped GEMM: the default on a GPU with the tensor GEMM, unless
    /// `ARBOR_MOE=host`); otherwise it routes on the host.
    fn moe_routes_on_device(
        &self,
        hidden: usize,
        inter: usize,
        experts: usize,
        top_k: usize,
    ) -> PyResult<bool> {
        let b = self
            .backend
            .lock()
            .map_err(|e| NativeError::Poisoned(e.to_string()))?;
        Ok(b.moe_routes_on_device(hidden, inter, experts, top_k)
            .map_err(model_err)?)
    }

    /// The engine's device routing of router logits (f32 `[R, E]`): each row's `top_k`
    /// experts of the f32 softmax (ties to the lower index) in increasing index at
    /// `experts` (int32 `[R, top_k]`), their probabilities (renormalised over the chosen
    /// where `norm`) at `weights` (f32 `[R, top_k]`) — the kernel the engine's device MoE
    /// path routes with, so its bits (its exp is the GPU's, not the host's).
    #[pyo3(signature = (logits, top_k, norm, weights, experts, stream))]
    fn moe_route(
        &self,
        logits: &Bound<'_, PyAny>,
        top_k: usize,
        norm: bool,
        weights: &Bound<'_, PyAny>,
        experts: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        const OP: &str = "moe_route";
        let l = operand(OP, "logits", logits, DType::F32, 2, self.place())?;
        let (rows, e) = (l.shape[0], l.shape[1]);
        let w = operand(OP, "weights", weights, DType::F32, 2, self.place())?;
        expect_shape(OP, "weights", &w, &[rows, top_k])?;
        let x = int_operand(OP, "experts", experts, IntDType::I32, 2, self.place())?;
        expect_shape(OP, "experts", &x, &[rows, top_k])?;
        Ok(self.run(stream, |b| {
            // SAFETY: as in `tree_linear`; weights and experts hold rows × top_k f32 and
            // i32 values on this device.
            unsafe {
                let la = b.borrow_act(l.addr(), rows, e);
                b.moe_route_to(&la, top_k, norm, x.addr(), w.addr())
                    .map_err(model_err)
            }
        })?)
    }

    /// The GPU's row statistics of `logits` (f32 `[R, C]`, its first `vocab` columns)
    /// with everything on the device, nothing read back, so that torch's stream runs on
    /// without the host waiting: `params` int64 `[R, 3]` (per row the picked column, a
    /// value ≥ `vocab` for none, then 0, 0: no draw), `out_f` f32 `[R, 6]` (max,
    /// log-sum-exp, the picked value, …) and `out_u` int64 `[R, 3]` (argmax, digest, …)
    /// written by the kernel `token_logprobs` runs, so a token's log-prob is
    /// `out_f[r, 2] − out_f[r, 1]`, the same bits. A pick outside the vocabulary gives a
    /// NaN picked value (the kernel reads nothing outside the row).
    fn row_stats(
        &self,
        logits: &Bound<'_, PyAny>,
        vocab: usize,
        params: &Bound<'_, PyAny>,
        out_f: &Bound<'_, PyAny>,
        out_u: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        const OP: &str = "row_stats";
        let l = operand(OP, "logits", logits, DType::F32, 2, self.place())?;
        let (rows, cols) = (l.shape[0], l.shape[1]);
        if vocab > cols {
            return Err(NativeError::Input(format!(
                "{OP}: vocab {vocab} for rows of {cols} logits"
            ))
            .into());
        }
        let p = int64_operand(OP, "params", params, 2, self.place())?;
        expect_shape(OP, "params", &p, &[rows, 3])?;
        let f = operand(OP, "out_f", out_f, DType::F32, 2, self.place())?;
        expect_shape(OP, "out_f", &f, &[rows, ROW_STATS_F32])?;
        let u = int64_operand(OP, "out_u", out_u, 2, self.place())?;
        expect_shape(OP, "out_u", &u, &[rows, ROW_STATS_U64])?;
        Ok(self.run(stream, |b| {
            // SAFETY: as in `tree_linear`; torch's allocations are 8-byte aligned (the
            // kernel checks it too).
            unsafe {
                let la = b.borrow_act(l.addr(), rows, cols);
                b.row_stats_to(&la, vocab, p.addr(), f.addr(), u.addr())
                    .map_err(model_err)
            }
        })?)
    }

    /// Per row r: `logits[r, targets[r]] − logsumexp(logits[r])` with the GPU's row
    /// statistics (what a serving rank reports as a token's log-prob), and the row's
    /// digest. `logits` f32 `[R, V]`.
    fn token_logprobs(
        &self,
        logits: &Bound<'_, PyAny>,
        targets: Vec<i64>,
        stream: u64,
    ) -> PyResult<(Vec<f32>, Vec<u64>)> {
        const OP: &str = "token_logprobs";
        let l = operand(OP, "logits", logits, DType::F32, 2, self.place())?;
        let (rows, vocab) = (l.shape[0], l.shape[1]);
        if targets.len() != rows {
            return Err(NativeError::Input(format!(
                "{OP}: {} targets for {rows} rows of logits",
                targets.len()
            ))
            .into());
        }
        let mut pick = Vec::with_capacity(rows);
        for (r, &t) in targets.iter().enumerate() {
            match u32::try_from(t) {
                Ok(t) if (t as usize) < vocab => pick.push(t),
                _ => {
                    return Err(NativeError::Input(format!(
                        "{OP}: target {t} of row {r} is outside the vocabulary (size {vocab})"
                    ))
                    .into())
                }
            }
        }
        let draws = vec![RowDraw::None; rows];
        let stats = self.run(stream, |b| {
            // SAFETY: as in `tree_linear`.
            let la = unsafe { b.borrow_act(l.addr(), rows, vocab) };
            b.row_stats(&la, vocab, &pick, &draws).map_err(model_err)
        })?;
        Ok(stats.iter().map(|s| (s.picked - s.lse, s.digest)).unzip())
    }
}

/// A linear's inputs: `x` f32 `[M, K]`, `xb` (optional) its bf16 rounding, the weight bf16
/// `[N, K]`, and the tree over K that every TP size cuts.
struct LinearIn {
    x: Mem,
    xb: Option<Mem>,
    w: Mem,
    m: usize,
    k: usize,
    n: usize,
    tree: TreeSpec,
}

impl LinearIn {
    fn new(
        op: &str,
        x: &Bound<'_, PyAny>,
        xb: Option<&Bound<'_, PyAny>>,
        w: &Bound<'_, PyAny>,
        place: Place,
    ) -> NResult<Self> {
        let x = operand(op, "x", x, DType::F32, 2, place)?;
        let xb = xb
            .map(|t| operand(op, "xb", t, DType::BF16, 2, place))
            .transpose()?;
        if let Some(b) = &xb {
            expect_shape(op, "xb", b, &x.shape)?;
        }
        let w = operand(op, "weight", w, DType::BF16, 2, place)?;
        let (m, k, n) = (x.shape[0], x.shape[1], w.shape[0]);
        expect_shape(op, "weight", &w, &[n, k])?;
        let tree = TreeSpec {
            seg_len: SegmentLayout::new(k).seg_len,
            n_seg: SEGMENTS,
            k,
        };
        Ok(LinearIn {
            x,
            xb,
            w,
            m,
            k,
            n,
            tree,
        })
    }

    /// Views of x (with its bf16 companion when given) and the weight on `b`.
    ///
    /// # Safety
    /// The tensors stay allocated, and are written by no other work, while the views and
    /// the kernels reading them live.
    unsafe fn borrow(&self, b: &CudaBackend) -> (CudaAct, CudaMat) {
        let (m, k, n) = (self.m, self.k, self.n);
        let xa = match &self.xb {
            Some(xb) => b.borrow_act_with_bf16(self.x.addr(), xb.addr(), m, k),
            None => b.borrow_act(self.x.addr(), m, k),
        };
        (xa, b.borrow_mat(self.w.addr(), n, k))
    }
}

/// The optional bf16 companion output `outb` of an op, checked to be `shape`.
fn bf16_out(
    op: &str,
    outb: Option<&Bound<'_, PyAny>>,
    shape: &[usize],
    place: Place,
) -> NResult<Option<Mem>> {
    outb.map(|t| {
        let m = operand(op, "outb", t, DType::BF16, 2, place)?;
        expect_shape(op, "outb", &m, shape)?;
        Ok(m)
    })
    .transpose()
}
