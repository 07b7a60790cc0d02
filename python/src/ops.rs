//! arbor's CPU kernels run on torch tensors' own memory: the forward of `arbor.torch`'s
//! operations. Each function reads its inputs and writes its output tensor through
//! `data_ptr()` (no copy in or out), after checking every tensor's device, dtype, shape
//! and that the output overlaps no input. The bits are those the CPU backend computes at
//! TP 1 (`model/src/backend/cpu.rs`), which every TP size reproduces.

use arbor_kernels::cpu::{self as k, AttnShape, PagedKv, TreeMatmul};
use arbor_kernels::paged::{blocks_for, PagedKvLayout, KV_BLOCK};
use arbor_kernels::tree::{SegmentLayout, SEGMENTS};
use arbor_model::layers::route;
use arbor_model::safetensors::DType;
use arbor_model::sampling::log_sum_exp;
use half::bf16;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::error::{NResult, NativeError};
use crate::tensors::{device, int_memory, memory, IntDType};

/// A tensor's memory: where it starts, how many bytes, its shape.
#[derive(Debug, Clone)]
pub struct Mem {
    ptr: usize,
    bytes: usize,
    pub shape: Vec<usize>,
}

impl Mem {
    /// The address of its first byte.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    fn overlaps(&self, other: &Mem) -> bool {
        self.bytes > 0
            && other.bytes > 0
            && self.ptr < other.ptr + other.bytes
            && other.ptr < self.ptr + self.bytes
    }

    /// # Safety
    /// The tensor `self` describes is alive, unchanged in size, and written by no one
    /// else while the slice is used (the caller holds it as an argument of the call).
    unsafe fn slice<'a, T>(&self) -> &'a [T] {
        if self.len() == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.ptr as *const T, self.len())
    }

    /// # Safety
    /// As [`Mem::slice`], and no other slice of the call overlaps it ([`check_disjoint`]).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<'a, T>(&self) -> &'a mut [T] {
        if self.len() == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.ptr as *mut T, self.len())
    }
}

/// Where an op's tensors must be: the CPU (arbor's CPU kernels) or one GPU (its CUDA
/// backend, `cuda_ops`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Cpu,
    Cuda(usize),
}

/// `t` as operand `what` of `op`: a contiguous tensor at `place`, of `dtype`, with `dims`
/// dimensions.
pub fn operand(
    op: &str,
    what: &str,
    t: &Bound<'_, PyAny>,
    dtype: DType,
    dims: usize,
    place: Place,
) -> NResult<Mem> {
    let name = at_place(op, what, t, place)?;
    let d = memory(&name, t, &name)?;
    if d.dtype != dtype {
        return Err(NativeError::Type(format!(
            "{name}: dtype {} where arbor's kernel takes {}",
            d.dtype.name(),
            dtype.name()
        )));
    }
    check_dims(&name, &d.shape, dims)?;
    Ok(Mem {
        ptr: d.ptr(),
        bytes: d.nbytes(),
        shape: d.shape,
    })
}

/// An int64 operand of an op (indices, or results the kernel writes as u64): on `place`,
/// contiguous, `dims` dimensions.
pub fn int64_operand(
    op: &str,
    what: &str,
    t: &Bound<'_, PyAny>,
    dims: usize,
    place: Place,
) -> NResult<Mem> {
    int_operand(op, what, t, IntDType::I64, dims, place)
}

/// An integer operand of `int`'s dtype: on `place`, contiguous, `dims` dimensions.
pub fn int_operand(
    op: &str,
    what: &str,
    t: &Bound<'_, PyAny>,
    int: IntDType,
    dims: usize,
    place: Place,
) -> NResult<Mem> {
    let name = at_place(op, what, t, place)?;
    let (ptr, shape, bytes) = int_memory(t, &name, int)?;
    check_dims(&name, &shape, dims)?;
    Ok(Mem { ptr, bytes, shape })
}

/// `op: what`, once `t` is a torch tensor on `place` (the name its errors carry).
fn at_place(op: &str, what: &str, t: &Bound<'_, PyAny>, place: Place) -> NResult<String> {
    let name = format!("{op}: {what}");
    let (kind, index) =
        device(t, &name).map_err(|_| NativeError::Type(format!("{name}: not a torch.Tensor")))?;
    match place {
        Place::Cpu if kind != "cpu" => Err(NativeError::NotYet(format!(
            "{name} is on the {kind} device: this function runs arbor's CPU kernel (arbor.torch \
             hands CUDA tensors to arbor._native.CudaOps)"
        ))),
        Place::Cuda(ordinal) if kind != "cuda" || index != Some(ordinal) => {
            Err(NativeError::Input(format!(
                "{name} is on {kind}:{}, the op runs on cuda:{ordinal}",
                index.map_or("?".into(), |i| i.to_string())
            )))
        }
        _ => Ok(name),
    }
}

fn check_dims(name: &str, shape: &[usize], dims: usize) -> NResult<()> {
    if shape.len() != dims {
        return Err(NativeError::Input(format!(
            "{name}: shape {shape:?} where {dims} dimensions are expected"
        )));
    }
    Ok(())
}

pub fn expect_shape(op: &str, what: &str, m: &Mem, shape: &[usize]) -> NResult<()> {
    if m.shape != shape {
        return Err(NativeError::Input(format!(
            "{op}: {what} has shape {:?}, expected {shape:?}",
            m.shape
        )));
    }
    Ok(())
}

/// The output must not share memory with any input: the kernels read inputs while
/// writing it.
fn check_disjoint(op: &str, out: &Mem, inputs: &[&Mem]) -> NResult<()> {
    if inputs.iter().any(|i| out.overlaps(i)) {
        return Err(NativeError::Input(format!(
            "{op}: the output tensor shares memory with an input"
        )));
    }
    Ok(())
}

/// `out = bf16(x) · wᵀ` in f32 with arbor's tree order over K (8 segments, as every TP
/// size cuts it). `x`: bf16 `[M, K]`, `w`: bf16 `[N, K]`, `out`: f32 `[M, N]`.
#[pyfunction]
pub fn tree_linear(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    const OP: &str = "tree_linear";
    let x = operand(OP, "x", x, DType::BF16, 2, Place::Cpu)?;
    let w = operand(OP, "weight", w, DType::BF16, 2, Place::Cpu)?;
    let o = operand(OP, "out", out, DType::F32, 2, Place::Cpu)?;
    let (m, kk, n) = (x.shape[0], x.shape[1], w.shape[0]);
    if w.shape[1] != kk {
        return Err(NativeError::Input(format!(
            "{OP}: x is [{m}, {kk}] but weight is {:?} (expected [N, {kk}])",
            w.shape
        ))
        .into());
    }
    expect_shape(OP, "out", &o, &[m, n])?;
    check_disjoint(OP, &o, &[&x, &w])?;
    let shape = TreeMatmul {
        m,
        n,
        k: kk,
        seg_len: SegmentLayout::new(kk).seg_len,
        n_seg: SEGMENTS,
    };
    if m == 0 || n == 0 {
        return Ok(());
    }
    py.detach(|| {
        // SAFETY: the three tensors are arguments of this call (alive), checked contiguous
        // CPU tensors of these shapes and dtypes; `out` overlaps neither input.
        let (xs, ws, os) = unsafe { (x.slice::<bf16>(), w.slice::<bf16>(), o.slice_mut::<f32>()) };
        k::tree_matmul(xs, ws, shape, os);
    });
    Ok(())
}

/// `out = x / sqrt(mean(x²) + eps) · weight` per row (arbor's order), f32 `[R, C]`,
/// `weight` f32 `[C]`.
#[pyfunction]
pub fn rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    const OP: &str = "rms_norm";
    let x = operand(OP, "x", x, DType::F32, 2, Place::Cpu)?;
    let w = operand(OP, "weight", weight, DType::F32, 1, Place::Cpu)?;
    let o = operand(OP, "out", out, DType::F32, 2, Place::Cpu)?;
    if w.shape[0] != x.shape[1] {
        return Err(NativeError::Input(format!(
            "{OP}: weight has {} values for rows of {}",
            w.shape[0], x.shape[1]
        ))
        .into());
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(
            NativeError::Input(format!("{OP}: eps {eps} is not a finite value ≥ 0")).into(),
        );
    }
    expect_shape(OP, "out", &o, &x.shape)?;
    check_disjoint(OP, &o, &[&x, &w])?;
    let cols = x.shape[1];
    py.detach(|| {
        // SAFETY: as in `tree_linear`.
        let (xs, ws, os) = unsafe { (x.slice::<f32>(), w.slice::<f32>(), o.slice_mut::<f32>()) };
        k::rms_norm(xs, cols, ws, eps, os);
    });
    Ok(())
}

/// `out = silu(gate) · up` element-wise (`silu(g) = g / (1 + exp(−g))`), f32, one shape.
#[pyfunction]
pub fn silu_mul(
    py: Python<'_>,
    gate: &Bound<'_, PyAny>,
    up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    const OP: &str = "silu_mul";
    let g = operand(OP, "gate", gate, DType::F32, 2, Place::Cpu)?;
    let u = operand(OP, "up", up, DType::F32, 2, Place::Cpu)?;
    let o = operand(OP, "out", out, DType::F32, 2, Place::Cpu)?;
    expect_shape(OP, "up", &u, &g.shape)?;
    expect_shape(OP, "out", &o, &g.shape)?;
    check_disjoint(OP, &o, &[&g, &u])?;
    py.detach(|| {
        // SAFETY: as in `tree_linear`.
        let (gs, us, os) = unsafe { (g.slice::<f32>(), u.slice::<f32>(), o.slice_mut::<f32>()) };
        k::silu_mul(gs, us, os);
    });
    Ok(())
}

/// Each row's experts from its router logits, by the engine's own routing function
/// (`arbor_model::layers::route`: the f32 softmax, the `top_k` most probable, ties to the
/// lower index, renormalised where `norm`): `logits` f32 `[R, E]`; `weights` f32 `[R, k]`
/// gets the chosen experts' weights. Returns the chosen experts, increasing in each row,
/// as little-endian i64 `[R, k]` (torch has no integer dtype arbor's tensor reader takes).
#[pyfunction]
pub fn moe_route<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    top_k: usize,
    norm: bool,
    weights: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyByteArray>> {
    const OP: &str = "moe_route";
    let l = operand(OP, "logits", logits, DType::F32, 2, Place::Cpu)?;
    let w = operand(OP, "weights", weights, DType::F32, 2, Place::Cpu)?;
    let (rows, e) = (l.shape[0], l.shape[1]);
    if top_k == 0 || top_k > e {
        return Err(NativeError::Input(format!(
            "{OP}: top_k {top_k} for {e} experts (it must be between 1 and the expert count)"
        ))
        .into());
    }
    expect_shape(OP, "weights", &w, &[rows, top_k])?;
    check_disjoint(OP, &w, &[&l])?;
    let experts = py.detach(|| {
        // SAFETY: as in `tree_linear`.
        let (ls, ws) = unsafe { (l.slice::<f32>(), w.slice_mut::<f32>()) };
        let mut experts = Vec::with_capacity(rows * top_k * 8);
        for (row, out) in ls.chunks_exact(e).zip(ws.chunks_exact_mut(top_k)) {
            for (o, (expert, weight)) in out.iter_mut().zip(route(row, top_k, norm).experts) {
                *o = weight;
                experts.extend_from_slice(&(expert as i64).to_le_bytes());
            }
        }
        experts
    });
    Ok(PyByteArray::new(py, &experts))
}

/// The sequences `cu_seqlens` cuts `rows` into: `[0, l0, l0 + l1, …, rows]`.
pub fn sequences(op: &str, cu_seqlens: &[usize], rows: usize) -> NResult<Vec<(usize, usize)>> {
    let bad = |msg: String| NativeError::Input(format!("{op}: cu_seqlens {msg}"));
    match (cu_seqlens.first(), cu_seqlens.last()) {
        (Some(0), Some(&end)) if end == rows => {}
        _ => {
            return Err(bad(format!(
                "must start at 0 and end at the row count {rows} (got {} values, first {:?}, last {:?})",
                cu_seqlens.len(),
                cu_seqlens.first(),
                cu_seqlens.last()
            )))
        }
    }
    let mut out = Vec::with_capacity(cu_seqlens.len().saturating_sub(1));
    for (i, w) in cu_seqlens.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(bad(format!(
                "decreases at index {}: {} > {}",
                i + 1,
                w[0],
                w[1]
            )));
        }
        out.push((w[0], w[1] - w[0]));
    }
    Ok(out)
}

/// Causal attention of packed sequences, with arbor's key-block order: `q` f32
/// `[T, n_heads·head_dim]` (RoPE applied), `k`, `v` f32 `[T, n_kv_heads·head_dim]` (rounded
/// to bf16 here, as arbor's KV cache holds them), `cu_seqlens` the sequences' row offsets
/// (each starts at position 0), `out` f32 like `q`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn attention(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    cu_seqlens: Vec<usize>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    const OP: &str = "attention";
    if n_heads == 0 || n_kv_heads == 0 || head_dim == 0 || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(NativeError::Input(format!(
            "{OP}: {n_heads} query heads, {n_kv_heads} KV heads of {head_dim}: the query heads must be a non-zero multiple of the KV heads"
        ))
        .into());
    }
    let q = operand(OP, "q", q, DType::F32, 2, Place::Cpu)?;
    let km = operand(OP, "k", k, DType::F32, 2, Place::Cpu)?;
    let vm = operand(OP, "v", v, DType::F32, 2, Place::Cpu)?;
    let o = operand(OP, "out", out, DType::F32, 2, Place::Cpu)?;
    let rows = q.shape[0];
    let (qw, kvw) = (n_heads * head_dim, n_kv_heads * head_dim);
    expect_shape(OP, "q", &q, &[rows, qw])?;
    expect_shape(OP, "k", &km, &[rows, kvw])?;
    expect_shape(OP, "v", &vm, &[rows, kvw])?;
    expect_shape(OP, "out", &o, &[rows, qw])?;
    check_disjoint(OP, &o, &[&q, &km, &vm])?;
    let seqs = sequences(OP, &cu_seqlens, rows)?;
    let shape = AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
        // The engine's scale (`Model::head_spec`).
        scale: 1.0 / (head_dim as f32).sqrt(),
    };
    py.detach(|| {
        // SAFETY: as in `tree_linear`.
        let (qs, ks, vs, os) = unsafe {
            (
                q.slice::<f32>(),
                km.slice::<f32>(),
                vm.slice::<f32>(),
                o.slice_mut::<f32>(),
            )
        };
        for &(row0, len) in &seqs {
            let layout = PagedKvLayout {
                layers: 1,
                blocks: blocks_for(len),
                n_kv_heads,
                head_dim,
            };
            let (kc, vc) = paged(
                &layout,
                &ks[row0 * kvw..(row0 + len) * kvw],
                &vs[row0 * kvw..(row0 + len) * kvw],
            );
            let table: Vec<u32> = (0..layout.blocks as u32).collect();
            let kv = PagedKv {
                k: &kc,
                v: &vc,
                layout,
                layer: 0,
                table: &table,
            };
            let span = row0 * qw..(row0 + len) * qw;
            k::attention(&qs[span.clone()], 0, &kv, shape, &mut os[span]);
        }
    });
    Ok(())
}

/// One sequence's keys and values laid out as a KV cache of one layer whose blocks are in
/// order, each value rounded to bf16 as `kv_write` stores it.
fn paged(layout: &PagedKvLayout, k: &[f32], v: &[f32]) -> (Vec<bf16>, Vec<bf16>) {
    let (n, hd) = (layout.n_kv_heads, layout.head_dim);
    let mut kc = vec![bf16::ZERO; layout.len()];
    let mut vc = vec![bf16::ZERO; layout.len()];
    for p in 0..k.len() / (n * hd).max(1) {
        for h in 0..n {
            let dst = layout.at(0, p / KV_BLOCK, h, p % KV_BLOCK);
            let src = (p * n + h) * hd;
            for i in 0..hd {
                kc[dst + i] = bf16::from_f32(k[src + i]);
                vc[dst + i] = bf16::from_f32(v[src + i]);
            }
        }
    }
    (kc, vc)
}

/// Per row r: `log_softmax(logits[r])[targets[r]]` as arbor computes a token's log-prob
/// (`row[t] − lse(row)`, the sum of exponentials in index order). `logits` f32 `[R, V]`,
/// `out` f32 `[R]`.
#[pyfunction]
pub fn token_logprobs(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    targets: Vec<i64>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    const OP: &str = "token_logprobs";
    let l = operand(OP, "logits", logits, DType::F32, 2, Place::Cpu)?;
    let o = operand(OP, "out", out, DType::F32, 1, Place::Cpu)?;
    let (rows, vocab) = (l.shape[0], l.shape[1]);
    expect_shape(OP, "out", &o, &[rows])?;
    if targets.len() != rows {
        return Err(NativeError::Input(format!(
            "{OP}: {} targets for {rows} rows of logits",
            targets.len()
        ))
        .into());
    }
    if let Some((r, &t)) = targets
        .iter()
        .enumerate()
        .find(|(_, &t)| t < 0 || t as u64 >= vocab as u64)
    {
        return Err(NativeError::Input(format!(
            "{OP}: target {t} of row {r} is outside the vocabulary (size {vocab})"
        ))
        .into());
    }
    check_disjoint(OP, &o, &[&l])?;
    py.detach(|| {
        // SAFETY: as in `tree_linear`.
        let (ls, os) = unsafe { (l.slice::<f32>(), o.slice_mut::<f32>()) };
        for (r, (out, &t)) in os.iter_mut().zip(&targets).enumerate() {
            let row = &ls[r * vocab..(r + 1) * vocab];
            *out = row[t as usize] - log_sum_exp(row);
        }
    });
    Ok(())
}

/// The 64-bit digest of each logits row (`arbor score`'s `logits_digest`): `logits` f32
/// `[R, V]`.
#[pyfunction]
pub fn logits_digest(py: Python<'_>, logits: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let l = operand("logits_digest", "logits", logits, DType::F32, 2, Place::Cpu)?;
    let vocab = l.shape[1];
    Ok(py.detach(|| {
        // SAFETY: `logits` is an argument of this call (alive), a checked contiguous CPU
        // f32 tensor of this shape; it is only read.
        let ls = unsafe { l.slice::<f32>() };
        ls.chunks_exact(vocab.max(1)).map(k::digest).collect()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cu_seqlens_are_checked() {
        assert_eq!(
            sequences("op", &[0, 2, 5], 5).unwrap(),
            vec![(0, 2), (2, 3)]
        );
        assert_eq!(
            sequences("op", &[0, 0, 5], 5).unwrap(),
            vec![(0, 0), (0, 5)]
        );
        for (bad, want) in [
            (vec![], "must start at 0"),
            (vec![1, 5], "must start at 0"),
            (vec![0, 4], "end at the row count 5"),
            (vec![0, 3, 2, 5], "decreases at index 2"),
        ] {
            let e = sequences("op", &bad, 5).unwrap_err().to_string();
            assert!(e.contains(want), "{bad:?}: {e}");
        }
    }

    #[test]
    fn paged_layout_puts_position_p_at_its_block_row() {
        let layout = PagedKvLayout {
            layers: 1,
            blocks: 2,
            n_kv_heads: 2,
            head_dim: 2,
        };
        // 70 positions × 2 heads × 2 values: value = position·10 + head.
        let k: Vec<f32> = (0..70)
            .flat_map(|p| (0..2).flat_map(move |h| [p as f32 * 10.0 + h as f32; 2]))
            .collect();
        let (kc, vc) = paged(&layout, &k, &k);
        for p in [0usize, 63, 64, 69] {
            for h in 0..2 {
                let at = layout.at(0, p / KV_BLOCK, h, p % KV_BLOCK);
                assert_eq!(
                    kc[at].to_f32(),
                    bf16::from_f32(p as f32 * 10.0 + h as f32).to_f32()
                );
                assert_eq!(vc[at + 1], kc[at]);
            }
        }
    }
}
