//! The bitwise checks of `arbor bench gemm`: every timed call against the TP shards'
//! tree combination, other batch positions, a column shard, every other path, the bf16
//! rounding, a repeat after other shapes, the tile counters, and the SiLU·mul epilogue's
//! bf16 values with and without its f32 copy.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use arbor_kernels::cpu::matmul::TreeMatmul;
use arbor_kernels::cuda::gemm::{Epilogue, GemmArgs, OutDtype, Path, TreeGemm};
use arbor_kernels::tree::{combine_roots, SegmentLayout, SEGMENTS};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream};

use super::{ptr, Check, Operands};

/// max |a - b| / max |b|.
pub(super) fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    for (&x, &y) in a.iter().zip(b) {
        num = num.max((x as f64 - y as f64).abs());
        den = den.max((y as f64).abs());
    }
    if a.iter().chain(b).any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    num / den.max(f64::MIN_POSITIVE)
}

/// One call of the tree GEMM on the bench operands: `x_row` / `w_row` shift the operands
/// by rows (a batch position, a column shard of W), `k_off` by columns (a TP shard of K).
pub(super) struct Call {
    pub(super) shape: TreeMatmul,
    pub(super) x_row: usize,
    pub(super) w_row: usize,
    pub(super) k_off: usize,
    pub(super) path: Option<Path>,
    pub(super) out_dtype: OutDtype,
}

impl Call {
    pub(super) fn new(shape: TreeMatmul) -> Self {
        Self {
            shape,
            x_row: 0,
            w_row: 0,
            k_off: 0,
            path: None,
            out_dtype: OutDtype::F32,
        }
    }
}

pub(super) fn launch(
    stream: &Arc<CudaStream>,
    tg: &TreeGemm,
    ops: &Operands,
    c: &Call,
    out: &CudaSlice<f32>,
) -> Result<()> {
    let s = c.shape;
    let out_elems = match c.out_dtype {
        OutDtype::F32 => s.m * s.n,
        OutDtype::Bf16 => (s.m * s.n).div_ceil(2),
    };
    let fits = (c.x_row + s.m) * ops.k <= ops.x.len()
        && (c.w_row + s.n) * ops.k <= ops.w[0].len()
        && c.k_off + s.k <= ops.k
        && out_elems <= out.len();
    if !fits {
        bail!(
            "bench call {:?} at rows {}/{} does not fit its buffers",
            s,
            c.x_row,
            c.w_row
        );
    }
    let a = GemmArgs {
        shape: s,
        x: ptr(&ops.x, stream) + ((c.x_row * ops.k + c.k_off) * 2) as u64,
        ldx: ops.k,
        // Every row from x_row on may be read, as the model's padded buffers are: the rows
        // past M are other data, which the row checks show does not reach the M rows.
        x_rows: ops.x.len() / ops.k - c.x_row,
        w: ptr(&ops.w[0], stream) + ((c.w_row * ops.k + c.k_off) * 2) as u64,
        ldw: ops.k,
        out: ptr(out, stream),
        out_dtype: c.out_dtype,
        ws: ptr(&ops.ws, stream),
        ws_len: ops.ws_len,
        counters: ptr(&ops.cnt, stream),
        counters_len: ops.cnt_len,
        w_constant: true,
        epilogue: Epilogue::Store,
    };
    let path = c.path.unwrap_or(Path::for_shape(&s, ops.family));
    // Poison the output and the segment-sum workspace (all bits set: NaN) so that a call
    // that leaves an output element unwritten, or combines a segment sum it did not
    // write, cannot pass by finding an earlier call's value there.
    for (p, bytes) in [(a.out, out.len() * 4), (a.ws, ops.ws.len() * 4)] {
        // SAFETY: `p` is the start of a live allocation of `bytes` bytes on this stream.
        unsafe { cudarc::driver::result::memset_d8_async(p, 0xFF, bytes, stream.cu_stream()) }
            .with_context(|| format!("cuMemsetD8Async of {bytes} bytes"))?;
    }
    // SAFETY: checked above that every operand lies inside its buffer.
    unsafe { tg.launch(stream, &a, Some(path)) }?;
    Ok(())
}

/// Runs an f32 call and returns its [m, n] result.
pub(super) fn call_f32(
    stream: &Arc<CudaStream>,
    tg: &TreeGemm,
    ops: &Operands,
    c: &Call,
    out: &CudaSlice<f32>,
) -> Result<Vec<f32>> {
    launch(stream, tg, ops, c, out)?;
    let mut host = stream.clone_dtoh(out)?;
    host.truncate(c.shape.m * c.shape.n);
    Ok(host)
}

/// The first element whose bits differ, as "(row, col): got vs want".
pub(super) fn first_mismatch(got: &[f32], want: &[f32], cols: usize) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("length {} vs {}", got.len(), want.len()));
    }
    got.iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
        .map(|i| {
            format!(
                "first at ({}, {}): {:e} vs {:e}",
                i / cols,
                i % cols,
                got[i],
                want[i]
            )
        })
}

pub(super) fn verdict(name: String, mismatch: Option<String>, ok_detail: String) -> Check {
    match mismatch {
        None => Check {
            name,
            pass: true,
            detail: ok_detail,
        },
        Some(d) => Check {
            name,
            pass: false,
            detail: d,
        },
    }
}

/// Full result vs the host tree-combination of the TP = 2, 4, 8 shard roots.
pub(super) fn check_tp(
    stream: &Arc<CudaStream>,
    tg: &TreeGemm,
    ops: &Operands,
    layout: &SegmentLayout,
    m: usize,
    y: &[f32],
) -> Result<Check> {
    let n = ops.n;
    let mut bad = None;
    for world in [2usize, 4, 8] {
        let mut roots = Vec::with_capacity(world);
        for rank in 0..world {
            let cols = layout.shard(rank, world);
            let shape = TreeMatmul {
                m,
                n,
                k: cols.len(),
                seg_len: layout.seg_len,
                n_seg: SEGMENTS / world,
            };
            let c = Call {
                k_off: cols.start,
                ..Call::new(shape)
            };
            roots.push(call_f32(stream, tg, ops, &c, &ops.out2)?);
        }
        let slices: Vec<&[f32]> = roots.iter().map(|r| r.as_slice()).collect();
        let mut combined = vec![0.0f32; m * n];
        combine_roots(&slices, &mut combined);
        if let Some(d) = first_mismatch(&combined, y, n) {
            bad = Some(format!("TP={world}: {d}"));
            break;
        }
    }
    Ok(verdict(
        "tp_shards".into(),
        bad,
        "TP 2/4/8 roots combine to the full bits".into(),
    ))
}

/// Rows computed at M = m from a shifted batch position vs the same rows at M = m_ref.
pub(super) fn check_rows(
    stream: &Arc<CudaStream>,
    tg: &TreeGemm,
    ops: &Operands,
    shape: TreeMatmul,
    m_ref: usize,
    ref_y: &[f32],
) -> Result<Check> {
    let n = ops.n;
    let off = 3.min(m_ref - shape.m);
    let c = Call {
        x_row: off,
        ..Call::new(shape)
    };
    let got = call_f32(stream, tg, ops, &c, &ops.out2)?;
    let want = &ref_y[off * n..(off + shape.m) * n];
    Ok(verdict(
        "rows_vs_m".into(),
        first_mismatch(&got, want, n)
            .map(|d| format!("M={} at row offset {off} vs M={m_ref}: {d}", shape.m)),
        format!(
            "rows {off}..{} equal at M={} and M={m_ref}",
            off + shape.m,
            shape.m
        ),
    ))
}

/// A column shard of W (N-sharding, as a column-parallel layer does) vs the full result.
pub(super) fn check_cols(
    stream: &Arc<CudaStream>,
    tg: &TreeGemm,
    ops: &Operands,
    shape: TreeMatmul,
    y: &[f32],
) -> Result<Check> {
    let n = ops.n;
    let n0 = (n / 2 / 8 * 8 + 8).min(n - 1);
    let nn = n - n0;
    let c = Call {
        w_row: n0,
        ..Call::new(TreeMatmul { n: nn, ..shape })
    };
    let got = call_f32(stream, tg, ops, &c, &ops.out2)?;
    let want: Vec<f32> = (0..shape.m)
        .flat_map(|r| y[r * n + n0..(r + 1) * n].iter().copied())
        .collect();
    Ok(verdict(
        "cols_shard".into(),
        first_mismatch(&got, &want, nn).map(|d| format!("columns {n0}..{n}: {d}")),
        format!("columns {n0}..{n} equal as an N shard"),
    ))
}

/// Every launch path (tile shapes, split or in-block tree) gives the same bits.
pub(super) fn check_paths(
    stream: &Arc<CudaStream>,
    tg: &TreeGemm,
    ops: &Operands,
    shape: TreeMatmul,
    y: &[f32],
) -> Result<Check> {
    let mut bad = None;
    for &p in Path::all(ops.family) {
        let c = Call {
            path: Some(p),
            ..Call::new(shape)
        };
        if let Some(d) = first_mismatch(&call_f32(stream, tg, ops, &c, &ops.out2)?, y, ops.n) {
            bad = Some(format!("path {}: {d}", p.name()));
            break;
        }
    }
    Ok(verdict(
        "paths".into(),
        bad,
        "every path of the family agrees".into(),
    ))
}

/// bf16 output is the f32 root rounded to nearest even.
pub(super) fn check_bf16(
    stream: &Arc<CudaStream>,
    tg: &TreeGemm,
    ops: &Operands,
    shape: TreeMatmul,
    y: &[f32],
) -> Result<Check> {
    let c = Call {
        out_dtype: OutDtype::Bf16,
        ..Call::new(shape)
    };
    launch(stream, tg, ops, &c, &ops.out2)?;
    let raw = stream.clone_dtoh(&ops.out2)?;
    // Little-endian: f32 word i holds bf16 elements 2i (low half) and 2i + 1.
    let got = raw.iter().flat_map(|w| {
        let b = w.to_bits();
        [(b & 0xffff) as u16, (b >> 16) as u16]
    });
    let bad = got
        .zip(y)
        .position(|(g, v)| g != half::bf16::from_f32(*v).to_bits())
        .map(|i| format!("element {i}: f32 root {:e}", y[i]));
    Ok(verdict(
        "bf16_out".into(),
        bad,
        "bf16 output = RNE(f32 root)".into(),
    ))
}

/// The full call again, after the other checks' calls of other shapes: state they left
/// behind (workspace, counters) must not change its bits.
pub(super) fn check_repeat(
    stream: &Arc<CudaStream>,
    tg: &TreeGemm,
    ops: &Operands,
    shape: TreeMatmul,
    y: &[f32],
) -> Result<Check> {
    let got = call_f32(stream, tg, ops, &Call::new(shape), &ops.out2)?;
    Ok(verdict(
        "repeat".into(),
        first_mismatch(&got, y, ops.n).map(|d| format!("after other shapes' calls: {d}")),
        "same bits after calls of other shapes".into(),
    ))
}

/// Every split call must leave its tile counters at zero for the next call.
pub(super) fn check_counters(stream: &Arc<CudaStream>, ops: &Operands) -> Result<Check> {
    let cnt = stream.clone_dtoh(&ops.cnt)?;
    let bad = cnt
        .iter()
        .position(|&c| c != 0)
        .map(|i| format!("counter {i} is {} after the calls (must be 0)", cnt[i]));
    Ok(verdict(
        "counters_zero".into(),
        bad,
        "every tile counter back at zero".into(),
    ))
}

/// The SiLU·mul epilogue's bf16 values written with the f32 copy and without it: they must
/// be the same bits. `args(bf16, alone)` gives the call's arguments for either mode.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_silu_bf16(
    stream: &Arc<CudaStream>,
    tg: &TreeGemm,
    ops: &Operands,
    path: Path,
    m: usize,
    n: usize,
    args: impl Fn(CUdeviceptr, bool) -> GemmArgs,
) -> Result<Check> {
    let a = args(ptr(&ops.silu_h, stream), false);
    let b = args(ptr(&ops.silu_h2, stream), true);
    // SAFETY: the bench's buffers are sized for the largest M of this shape.
    unsafe {
        tg.launch(stream, &a, Some(path))?;
        tg.launch(stream, &b, Some(path))?;
    }
    let (h1, h2) = (
        stream.clone_dtoh(&ops.silu_h)?,
        stream.clone_dtoh(&ops.silu_h2)?,
    );
    let len = m * n / 2;
    let bad = h1[..len]
        .iter()
        .zip(&h2[..len])
        .position(|(a, b)| a != b)
        .map(|i| format!("element {i}: {:#06x} vs {:#06x}", h1[i], h2[i]));
    Ok(verdict(
        "silu_bf16".into(),
        bad,
        "SiLU·mul bf16 values with and without the f32 copy".into(),
    ))
}
