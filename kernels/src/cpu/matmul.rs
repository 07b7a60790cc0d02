//! Y = X·Wᵀ with the reduction over K following the 8-segment tree.
//!
//! Every output element is computed the same way wherever it sits: for each of its local
//! segments the leaf of `leaf.rs` (16 lanes, multiply then add, pairwise lane tree), then
//! `tree::tree_sum` over the segment sums. Tiling, the instruction set used and the thread
//! count only decide which elements are computed together, never how one is computed.
use std::ops::Range;

use half::bf16;

use super::leaf::{bf16_to_f32, lanes_tree, LANES};
use super::threads::{map_jobs, threads_for};
use crate::tree::{tree_sum, SEGMENTS};

/// Which part of the tree a call computes.
///
/// `k` is the number of columns the caller holds (its shard of K), `seg_len` the global
/// segment length (`SegmentLayout::seg_len` of the *full* K) and `n_seg` the number of
/// segments the shard consists of (8/TP; a power of two). Local segment s covers local
/// columns `[s·seg_len, min((s+1)·seg_len, k))`; the result is the subtree root over the
/// `n_seg` segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeMatmul {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub seg_len: usize,
    pub n_seg: usize,
}

impl TreeMatmul {
    /// The whole reduction on one rank: `n_seg = 8` over `SegmentLayout::new(k)`.
    pub fn full(m: usize, n: usize, k: usize) -> Self {
        Self {
            m,
            n,
            k,
            seg_len: crate::tree::SegmentLayout::new(k).seg_len,
            n_seg: SEGMENTS,
        }
    }
}

/// Rows × columns of output one job computes: the weight block (`cols` rows of W) stays
/// in cache while the job's rows stream past it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Blocking {
    pub rows: usize,
    pub cols: usize,
}

const BLOCKING: Blocking = Blocking { rows: 64, cols: 16 };

/// x: [m, k] row-major bf16; w: [n, k] row-major bf16 (a linear layer's weight as stored by
/// HF); out: [m, n] f32, the subtree root for every element.
///
/// Panics (naming the mismatch) if the slices do not have the sizes `shape` gives or if
/// `shape` is not a valid piece of the tree (`n_seg` a power of two ≤ 8,
/// `k ≤ n_seg·seg_len`): those are programming errors of the caller, not input data.
pub fn tree_matmul(x: &[bf16], w: &[bf16], shape: TreeMatmul, out: &mut [f32]) {
    let TreeMatmul { m, n, k, .. } = shape;
    let jobs = m.div_ceil(BLOCKING.rows) * n.div_ceil(BLOCKING.cols);
    let threads = threads_for(m.saturating_mul(n).saturating_mul(k), jobs);
    tree_matmul_on(x, w, shape, out, threads);
}

/// [`tree_matmul`] on an explicit number of threads (benchmarks; the result does not
/// depend on it).
pub fn tree_matmul_on(x: &[bf16], w: &[bf16], shape: TreeMatmul, out: &mut [f32], threads: usize) {
    tree_matmul_blocked(
        x,
        w,
        shape,
        out,
        threads,
        BLOCKING,
        Isa::detect(),
        Kernel::Fused,
    );
}

/// [`tree_matmul_on`] with the earlier kernel: SIMD only for a segment's full 16-element
/// chunks, the segment's tail, the lane tree and the segment tree in scalar code. The same
/// bits (tested); kept as the benchmark's baseline and the tests' second opinion.
pub fn tree_matmul_unfused_on(
    x: &[bf16],
    w: &[bf16],
    shape: TreeMatmul,
    out: &mut [f32],
    threads: usize,
) {
    tree_matmul_blocked(
        x,
        w,
        shape,
        out,
        threads,
        BLOCKING,
        Isa::detect(),
        Kernel::Unfused,
    );
}

/// How much of an output tile runs in vector registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// Chunks, the masked segment tail, the lane tree and the segment tree all in vectors
    /// (AVX2/AVX-512; `Isa::Portable` has no vectors and runs `Unfused`).
    Fused,
    /// Vectors for the full chunks only, the rest scalar.
    Unfused,
}

#[allow(clippy::too_many_arguments)] // tests vary every one of them
pub(crate) fn tree_matmul_blocked(
    x: &[bf16],
    w: &[bf16],
    shape: TreeMatmul,
    out: &mut [f32],
    threads: usize,
    blocking: Blocking,
    isa: Isa,
    kernel: Kernel,
) {
    check_shape(x, w, shape, out);
    let TreeMatmul {
        m,
        n,
        k,
        seg_len,
        n_seg,
    } = shape;
    if m == 0 || n == 0 {
        return;
    }
    let xf: Vec<f32> = x.iter().map(|&b| bf16_to_f32(b)).collect();
    let p = Problem {
        xf: &xf,
        w,
        k,
        seg_len,
        n_seg,
        isa,
        kernel,
    };
    run_blocked(m, n, out, threads, blocking, |rows, cols, o, ld, origin| {
        tree_block(&p, rows, cols, o, ld, origin)
    });
}

/// Baseline for the benchmark only: a straightforward f32-accumulating matmul with no
/// fixed tree (same layout as [`tree_matmul`]).
pub fn plain_matmul(x: &[bf16], w: &[bf16], m: usize, n: usize, k: usize, out: &mut [f32]) {
    let jobs = m.div_ceil(BLOCKING.rows) * n.div_ceil(BLOCKING.cols);
    plain_matmul_on(
        x,
        w,
        m,
        n,
        k,
        out,
        threads_for(m.saturating_mul(n).saturating_mul(k), jobs),
    );
}

/// [`plain_matmul`] on an explicit number of threads: the same job split as
/// [`tree_matmul_on`], each element a sequential sum over K.
pub fn plain_matmul_on(
    x: &[bf16],
    w: &[bf16],
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    threads: usize,
) {
    check_shape(
        x,
        w,
        TreeMatmul {
            m,
            n,
            k,
            seg_len: k.max(1),
            n_seg: 1,
        },
        out,
    );
    if m == 0 || n == 0 {
        return;
    }
    let xf: Vec<f32> = x.iter().map(|&b| bf16_to_f32(b)).collect();
    run_blocked(m, n, out, threads, BLOCKING, |rows, cols, o, ld, origin| {
        for r in rows {
            let xr = &xf[r * k..(r + 1) * k];
            for c in cols.clone() {
                let wr = &w[c * k..(c + 1) * k];
                let mut s = 0.0f32;
                for (a, b) in xr.iter().zip(wr) {
                    s += a * bf16_to_f32(*b);
                }
                o[(r - origin.0) * ld + (c - origin.1)] = s;
            }
        }
    });
}

fn check_shape(x: &[bf16], w: &[bf16], s: TreeMatmul, out: &[f32]) {
    let TreeMatmul {
        m,
        n,
        k,
        seg_len,
        n_seg,
    } = s;
    assert!(
        n_seg.is_power_of_two() && n_seg <= SEGMENTS,
        "tree_matmul: n_seg must be 1, 2, 4 or 8, got {n_seg}"
    );
    assert!(
        k <= n_seg * seg_len,
        "tree_matmul: k = {k} columns do not fit in {n_seg} segments of {seg_len}"
    );
    assert_eq!(
        x.len(),
        m * k,
        "tree_matmul: x has {} values, expected m·k = {m}·{k}",
        x.len()
    );
    assert_eq!(
        w.len(),
        n * k,
        "tree_matmul: w has {} values, expected n·k = {n}·{k}",
        w.len()
    );
    assert_eq!(
        out.len(),
        m * n,
        "tree_matmul: out has {} values, expected m·n = {m}·{n}",
        out.len()
    );
}

/// Cut [m, n] into blocks, run `block(rows, cols, out, ld, origin)` on each (on `threads`
/// threads) and place the results. `block` writes element (r, c) at
/// `out[(r - origin.0)·ld + (c - origin.1)]`.
fn run_blocked<F>(m: usize, n: usize, out: &mut [f32], threads: usize, b: Blocking, block: F)
where
    F: Fn(Range<usize>, Range<usize>, &mut [f32], usize, (usize, usize)) + Sync,
{
    let (rb, cb) = (b.rows.max(1), b.cols.max(1));
    let n_cb = n.div_ceil(cb);
    let jobs = m.div_ceil(rb) * n_cb;
    let ranges = |j: usize| {
        let (r0, c0) = ((j / n_cb) * rb, (j % n_cb) * cb);
        (r0..(r0 + rb).min(m), c0..(c0 + cb).min(n))
    };
    if threads <= 1 || jobs <= 1 {
        for j in 0..jobs {
            let (rows, cols) = ranges(j);
            block(rows, cols, out, n, (0, 0));
        }
        return;
    }
    let results = map_jobs(jobs, threads, |j| {
        let (rows, cols) = ranges(j);
        let mut buf = vec![0.0f32; rows.len() * cols.len()];
        block(
            rows.clone(),
            cols.clone(),
            &mut buf,
            cols.len(),
            (rows.start, cols.start),
        );
        buf
    });
    for (j, buf) in results.into_iter().enumerate() {
        let (rows, cols) = ranges(j);
        for (i, r) in rows.enumerate() {
            out[r * n + cols.start..r * n + cols.end]
                .copy_from_slice(&buf[i * cols.len()..(i + 1) * cols.len()]);
        }
    }
}

struct Problem<'a> {
    /// x converted to f32 once per call: [m, k].
    xf: &'a [f32],
    w: &'a [bf16],
    k: usize,
    seg_len: usize,
    n_seg: usize,
    isa: Isa,
    kernel: Kernel,
}

/// Which implementation of the leaf's inner loop runs. They differ only in how many lanes
/// one instruction moves: each lane sees the same multiply and add (never fused), so all
/// give the same bits (tested).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512_usable() {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every variant this CPU can run (for tests).
    #[cfg(test)]
    pub(crate) fn all_available() -> Vec<Self> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                v.push(Isa::Avx2);
            }
            if avx512_usable() {
                v.push(Isa::Avx512);
            }
        }
        v
    }
}

/// The AVX-512 kernel's masked 16-bit loads (the segment tail's weights) need BW and VL
/// besides F; every AVX-512 CPU but the Xeon Phi has them.
#[cfg(target_arch = "x86_64")]
fn avx512_usable() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

fn tree_block(
    p: &Problem,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &mut [f32],
    ld: usize,
    origin: (usize, usize),
) {
    // Tile sizes that keep the accumulators in registers: 16 zmm at 4×4 with AVX-512,
    // 8 pairs of ymm at 2×2 with AVX2.
    match p.isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => tree_block_tiled::<4, 4>(p, rows, cols, out, ld, origin),
        _ => tree_block_tiled::<2, 2>(p, rows, cols, out, ld, origin),
    }
}

/// Tiles of R rows × C columns (R·C independent accumulators share each load), with
/// 1-wide tiles for the edges.
fn tree_block_tiled<const R: usize, const C: usize>(
    p: &Problem,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &mut [f32],
    ld: usize,
    origin: (usize, usize),
) {
    let mut r = rows.start;
    while r < rows.end {
        let full_rows = r + R <= rows.end;
        let mut c = cols.start;
        while c < cols.end {
            let full_cols = c + C <= cols.end;
            let at = (r - origin.0) * ld + (c - origin.1);
            match (full_rows, full_cols) {
                (true, true) => store(out, at, ld, &tile::<R, C>(p, r, c)),
                (true, false) => store(out, at, ld, &tile::<R, 1>(p, r, c)),
                (false, true) => store(out, at, ld, &tile::<1, C>(p, r, c)),
                (false, false) => store(out, at, ld, &tile::<1, 1>(p, r, c)),
            }
            c += if full_cols { C } else { 1 };
        }
        r += if full_rows { R } else { 1 };
    }
}

fn store<const R: usize, const C: usize>(out: &mut [f32], at: usize, ld: usize, v: &[[f32; C]; R]) {
    for (i, row) in v.iter().enumerate() {
        out[at + i * ld..at + i * ld + C].copy_from_slice(row);
    }
}

/// Lane accumulators of R rows × C columns.
type Acc<const R: usize, const C: usize> = [[[f32; LANES]; C]; R];

/// The subtree roots of rows `r0..r0+R` × columns `c0..c0+C`.
#[inline(always)]
fn tile<const R: usize, const C: usize>(p: &Problem, r0: usize, c0: usize) -> [[f32; C]; R] {
    match (p.kernel, p.isa) {
        // SAFETY: the variant was chosen by `Isa::detect`/`all_available`, so the CPU has
        // the feature.
        #[cfg(target_arch = "x86_64")]
        (Kernel::Fused, Isa::Avx512) if R * C <= 16 => unsafe {
            x86::tile_avx512::<R, C>(p, r0, c0)
        },
        #[cfg(target_arch = "x86_64")]
        (Kernel::Fused, Isa::Avx2) if R * C <= 4 => unsafe { x86::tile_avx2::<R, C>(p, r0, c0) },
        _ => tile_unfused::<R, C>(p, r0, c0),
    }
}

/// Columns `[lo, hi)` of local segment `s` (empty past the shard's `k`).
#[inline(always)]
fn segment_range(p: &Problem, s: usize) -> (usize, usize) {
    let lo = (s * p.seg_len).min(p.k);
    let hi = ((s + 1) * p.seg_len).min(p.k);
    (lo, hi)
}

/// [`tile`] with vectors for the full chunks only.
#[allow(clippy::needless_range_loop)] // s also names the segment's columns
fn tile_unfused<const R: usize, const C: usize>(
    p: &Problem,
    r0: usize,
    c0: usize,
) -> [[f32; C]; R] {
    let k = p.k;
    let mut seg_sums = [[[0.0f32; SEGMENTS]; C]; R];
    for s in 0..p.n_seg {
        let (lo, hi) = segment_range(p, s);
        let xs: [&[f32]; R] = std::array::from_fn(|i| &p.xf[(r0 + i) * k + lo..(r0 + i) * k + hi]);
        let ws: [&[bf16]; C] = std::array::from_fn(|j| &p.w[(c0 + j) * k + lo..(c0 + j) * k + hi]);
        let chunks = (hi - lo) / LANES;
        let mut acc: Acc<R, C> = match p.isa {
            // SAFETY: the variant was chosen by `Isa::detect`/`all_available`, so the CPU
            // has the feature; every slice holds at least `chunks·16` elements.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::chunks_avx512::<R, C>(&xs, &ws, chunks) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::chunks_avx2::<R, C>(&xs, &ws, chunks) },
            Isa::Portable => chunks_portable::<R, C>(&xs, &ws, chunks),
        };
        // The short tail of a segment: element `chunks·16 + l` goes to lane l.
        let t0 = chunks * LANES;
        for i in 0..R {
            for j in 0..C {
                for (l, (a, b)) in xs[i][t0..].iter().zip(&ws[j][t0..]).enumerate() {
                    acc[i][j][l] += a * bf16_to_f32(*b);
                }
                seg_sums[i][j][s] = lanes_tree(&acc[i][j]);
            }
        }
    }
    std::array::from_fn(|i| std::array::from_fn(|j| tree_sum(&seg_sums[i][j][..p.n_seg])))
}

/// The leaf's full 16-element chunks, one lane per array element.
#[allow(clippy::needless_range_loop)]
fn chunks_portable<const R: usize, const C: usize>(
    xs: &[&[f32]; R],
    ws: &[&[bf16]; C],
    chunks: usize,
) -> Acc<R, C> {
    let mut acc = [[[0.0f32; LANES]; C]; R];
    let mut wv = [[0.0f32; LANES]; C];
    for ch in 0..chunks {
        let i0 = ch * LANES;
        for j in 0..C {
            for l in 0..LANES {
                wv[j][l] = bf16_to_f32(ws[j][i0 + l]);
            }
        }
        for i in 0..R {
            for j in 0..C {
                for l in 0..LANES {
                    acc[i][j][l] += xs[i][i0 + l] * wv[j][l];
                }
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The leaf with explicit vectors: `_mm*_mul_ps` then `_mm*_add_ps` (never FMA), lane l
    //! of a vector = lane l of the leaf. `chunks_*` give the full chunks' lanes to the
    //! scalar tail of `tile_unfused`; `tile_*` also run the tail (masked) and both trees in
    //! registers.
    // Index loops over the const tile sizes unroll fully and keep vectors in registers.
    #![allow(clippy::needless_range_loop)]
    use std::arch::x86_64::*;

    use half::bf16;

    use super::{segment_range, Acc, Problem, LANES};
    use crate::tree::pairwise;

    fn check<const R: usize, const C: usize>(xs: &[&[f32]; R], ws: &[&[bf16]; C], chunks: usize) {
        let need = chunks * LANES;
        assert!(
            xs.iter().all(|x| x.len() >= need) && ws.iter().all(|w| w.len() >= need),
            "tree_matmul leaf: slices shorter than {chunks} chunks"
        );
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn chunks_avx512<const R: usize, const C: usize>(
        xs: &[&[f32]; R],
        ws: &[&[bf16]; C],
        chunks: usize,
    ) -> Acc<R, C> {
        // SAFETY: the caller's promise, passed on.
        let a = unsafe { chunks_avx512_regs::<R, C>(xs, ws, chunks) };
        let mut acc = [[[0.0f32; LANES]; C]; R];
        for i in 0..R {
            for j in 0..C {
                // SAFETY: acc[i][j] holds 16 f32.
                unsafe { _mm512_storeu_ps(acc[i][j].as_mut_ptr(), a[i][j]) };
            }
        }
        acc
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn chunks_avx2<const R: usize, const C: usize>(
        xs: &[&[f32]; R],
        ws: &[&[bf16]; C],
        chunks: usize,
    ) -> Acc<R, C> {
        // SAFETY: the caller's promise, passed on.
        let a = unsafe { chunks_avx2_regs::<R, C>(xs, ws, chunks) };
        let mut acc = [[[0.0f32; LANES]; C]; R];
        for i in 0..R {
            for j in 0..C {
                for h in 0..2 {
                    // SAFETY: acc[i][j] holds 16 f32.
                    unsafe { _mm256_storeu_ps(acc[i][j].as_mut_ptr().add(8 * h), a[i][j][h]) };
                }
            }
        }
        acc
    }

    /// Elements `i0..i0 + t` of `w` as f32 in lanes `0..t` (a segment's tail), zeros above.
    ///
    /// # Safety
    /// AVX-512F/BW/VL; `w` holds at least `i0 + t` elements, `t ≤ 16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn tail_w_avx512(w: &[bf16], i0: usize, mask: __mmask16) -> __m512 {
        // SAFETY: the masked load touches only the lanes below `t`, inside the slice.
        let raw = unsafe { _mm256_maskz_loadu_epi16(mask, w.as_ptr().add(i0).cast()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
    }

    /// Pairwise sums of neighbouring lanes of `a` and `b` per 128-bit block,
    /// `[a0+a1, a2+a3, b0+b1, b2+b3]`: the even element is always the left operand, as in
    /// `lanes_tree`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn pairs512(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(a, b),
            _mm512_shuffle_ps::<0xDD>(a, b),
        )
    }

    /// The same one level up: neighbouring 128-bit blocks,
    /// `[a.b0+a.b1, a.b2+a.b3, b.b0+b.b1, b.b2+b.b3]`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn block_pairs512(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    }

    /// Lane i of the result is `lanes_tree` of `v[i]`, with the very additions of
    /// `lanes_tree` (levels 1 and 2 inside 128-bit blocks, 3 and 4 across them).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn lane_trees512(v: &[__m512; 16]) -> __m512 {
        let p: [__m512; 8] = std::array::from_fn(|i| pairs512(v[2 * i], v[2 * i + 1]));
        // q[i], block b, lane l: lanes 4b..4b+4 of v[4i + l], summed.
        let q: [__m512; 4] = std::array::from_fn(|i| pairs512(p[2 * i], p[2 * i + 1]));
        // s[i], block b: lanes 8(b%2)..8(b%2)+8 of v[8i + 4(b/2) + l].
        let s = [block_pairs512(q[0], q[1]), block_pairs512(q[2], q[3])];
        block_pairs512(s[0], s[1])
    }

    /// [`super::tile`] in zmm registers: per segment the full chunks, the tail under a
    /// lane mask (the masked-off lanes keep their accumulator unchanged), the lane trees
    /// of all R·C outputs at once, then the segment tree lane by lane.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn tile_avx512<const R: usize, const C: usize>(
        p: &Problem,
        r0: usize,
        c0: usize,
    ) -> [[f32; C]; R] {
        assert!(
            R * C <= 16,
            "tile_avx512: one zmm holds 16 outputs, not {R}×{C}"
        );
        let k = p.k;
        let mut roots = [_mm512_setzero_ps(); 8];
        for (s, root) in roots.iter_mut().enumerate().take(p.n_seg) {
            let (lo, hi) = segment_range(p, s);
            let xs: [&[f32]; R] =
                std::array::from_fn(|i| &p.xf[(r0 + i) * k + lo..(r0 + i) * k + hi]);
            let ws: [&[bf16]; C] =
                std::array::from_fn(|j| &p.w[(c0 + j) * k + lo..(c0 + j) * k + hi]);
            let len = hi - lo;
            let chunks = len / LANES;
            // SAFETY: AVX-512F is enabled here; every slice holds `len ≥ chunks·16` elements.
            let mut a = unsafe { chunks_avx512_regs::<R, C>(&xs, &ws, chunks) };
            let (i0, t) = (chunks * LANES, len % LANES);
            if t > 0 {
                let mask: __mmask16 = (1u16 << t) - 1;
                // SAFETY: every slice holds `i0 + t` elements.
                let wv: [__m512; C] =
                    std::array::from_fn(|j| unsafe { tail_w_avx512(ws[j], i0, mask) });
                for i in 0..R {
                    // SAFETY: the masked load touches only the first `t` floats from
                    // `i0`, all inside the slice.
                    let xv = unsafe { _mm512_maskz_loadu_ps(mask, xs[i].as_ptr().add(i0)) };
                    for j in 0..C {
                        a[i][j] =
                            _mm512_mask_add_ps(a[i][j], mask, a[i][j], _mm512_mul_ps(xv, wv[j]));
                    }
                }
            }
            let mut v = [_mm512_setzero_ps(); 16];
            for i in 0..R {
                for j in 0..C {
                    v[i * C + j] = a[i][j];
                }
            }
            *root = lane_trees512(&v);
        }
        // The segment tree of `tree_sum`, all outputs at once.
        let root = pairwise(&mut roots[..p.n_seg], |a, b| _mm512_add_ps(a, b));
        let mut flat = [0.0f32; 16];
        // SAFETY: flat holds 16 f32.
        unsafe { _mm512_storeu_ps(flat.as_mut_ptr(), root) };
        std::array::from_fn(|i| std::array::from_fn(|j| flat[i * C + j]))
    }

    /// The full chunks with the accumulators left in registers.
    ///
    /// # Safety
    /// AVX-512F; every slice holds at least `chunks·16` elements.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn chunks_avx512_regs<const R: usize, const C: usize>(
        xs: &[&[f32]; R],
        ws: &[&[bf16]; C],
        chunks: usize,
    ) -> [[__m512; C]; R] {
        check(xs, ws, chunks);
        let mut a = [[_mm512_setzero_ps(); C]; R];
        let mut wv = [_mm512_setzero_ps(); C];
        for ch in 0..chunks {
            let i0 = ch * LANES;
            for j in 0..C {
                // SAFETY: `check` guarantees i0 + 16 ≤ len.
                let raw = unsafe { _mm256_loadu_si256(ws[j].as_ptr().add(i0).cast()) };
                wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)));
            }
            for i in 0..R {
                // SAFETY: as above.
                let xv = unsafe { _mm512_loadu_ps(xs[i].as_ptr().add(i0)) };
                for j in 0..C {
                    a[i][j] = _mm512_add_ps(a[i][j], _mm512_mul_ps(xv, wv[j]));
                }
            }
        }
        a
    }

    /// `[a0+a1, a2+a3, b0+b1, b2+b3]` per 128-bit block (see [`pairs512`]).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn pairs256(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0x88>(a, b),
            _mm256_shuffle_ps::<0xDD>(a, b),
        )
    }

    /// Lane i of the result is the 8-lane pairwise tree of `v[i]`:
    /// `((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7))`, the halves of `lanes_tree`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn half_trees256(v: &[__m256; 8]) -> __m256 {
        let p: [__m256; 4] = std::array::from_fn(|i| pairs256(v[2 * i], v[2 * i + 1]));
        let q = [pairs256(p[0], p[1]), pairs256(p[2], p[3])];
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(q[0], q[1]),
            _mm256_permute2f128_ps::<0x31>(q[0], q[1]),
        )
    }

    /// [`tile_avx512`] with pairs of ymm registers (lanes 0..8 and 8..16 of the leaf).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn tile_avx2<const R: usize, const C: usize>(
        p: &Problem,
        r0: usize,
        c0: usize,
    ) -> [[f32; C]; R] {
        assert!(
            R * C <= 4,
            "tile_avx2: one xmm holds 4 outputs, not {R}×{C}"
        );
        let k = p.k;
        let mut roots = [_mm_setzero_ps(); 8];
        let lane_idx = [
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15),
        ];
        for (s, root) in roots.iter_mut().enumerate().take(p.n_seg) {
            let (lo, hi) = segment_range(p, s);
            let xs: [&[f32]; R] =
                std::array::from_fn(|i| &p.xf[(r0 + i) * k + lo..(r0 + i) * k + hi]);
            let ws: [&[bf16]; C] =
                std::array::from_fn(|j| &p.w[(c0 + j) * k + lo..(c0 + j) * k + hi]);
            let len = hi - lo;
            let chunks = len / LANES;
            // SAFETY: AVX2 is enabled here; every slice holds `len ≥ chunks·16` elements.
            let mut a = unsafe { chunks_avx2_regs::<R, C>(&xs, &ws, chunks) };
            let (i0, t) = (chunks * LANES, len % LANES);
            if t > 0 {
                let tv = _mm256_set1_epi32(t as i32);
                let mask = [
                    _mm256_cmpgt_epi32(tv, lane_idx[0]),
                    _mm256_cmpgt_epi32(tv, lane_idx[1]),
                ];
                let mut wv = [[_mm256_setzero_ps(); 2]; C];
                for j in 0..C {
                    // Lanes past `t` are zero and blended away below.
                    let mut buf = [0u16; LANES];
                    for (d, v) in buf.iter_mut().zip(&ws[j][i0..i0 + t]) {
                        *d = v.to_bits();
                    }
                    for h in 0..2 {
                        // SAFETY: buf holds 16 u16.
                        let raw = unsafe { _mm_loadu_si128(buf.as_ptr().add(8 * h).cast()) };
                        wv[j][h] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                            _mm256_cvtepu16_epi32(raw),
                        ));
                    }
                }
                let halves = if t > 8 { 2 } else { 1 };
                for i in 0..R {
                    for h in 0..halves {
                        // SAFETY: the masked load reads only the lanes below `t`, all
                        // inside the slice.
                        let xv =
                            unsafe { _mm256_maskload_ps(xs[i].as_ptr().add(i0 + 8 * h), mask[h]) };
                        let m = _mm256_castsi256_ps(mask[h]);
                        for j in 0..C {
                            let sum = _mm256_add_ps(a[i][j][h], _mm256_mul_ps(xv, wv[j][h]));
                            a[i][j][h] = _mm256_blendv_ps(a[i][j][h], sum, m);
                        }
                    }
                }
            }
            // Low halves of the R·C outputs first, then their high halves.
            let mut v = [_mm256_setzero_ps(); 8];
            for i in 0..R {
                for j in 0..C {
                    v[i * C + j] = a[i][j][0];
                    v[4 + i * C + j] = a[i][j][1];
                }
            }
            let h = half_trees256(&v);
            *root = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        }
        let root = pairwise(&mut roots[..p.n_seg], |a, b| _mm_add_ps(a, b));
        let mut flat = [0.0f32; 4];
        // SAFETY: flat holds 4 f32.
        unsafe { _mm_storeu_ps(flat.as_mut_ptr(), root) };
        std::array::from_fn(|i| std::array::from_fn(|j| flat[i * C + j]))
    }

    /// The full chunks with the accumulators left in registers (lanes 0..8 in `[0]`,
    /// 8..16 in `[1]`).
    ///
    /// # Safety
    /// AVX2; every slice holds at least `chunks·16` elements.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn chunks_avx2_regs<const R: usize, const C: usize>(
        xs: &[&[f32]; R],
        ws: &[&[bf16]; C],
        chunks: usize,
    ) -> [[[__m256; 2]; C]; R] {
        check(xs, ws, chunks);
        let mut a = [[[_mm256_setzero_ps(); 2]; C]; R];
        let mut wv = [[_mm256_setzero_ps(); 2]; C];
        for ch in 0..chunks {
            let i0 = ch * LANES;
            for j in 0..C {
                for h in 0..2 {
                    // SAFETY: `check` guarantees i0 + 16 ≤ len.
                    let raw = unsafe { _mm_loadu_si128(ws[j].as_ptr().add(i0 + 8 * h).cast()) };
                    wv[j][h] =
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)));
                }
            }
            for i in 0..R {
                for h in 0..2 {
                    // SAFETY: as above.
                    let xv = unsafe { _mm256_loadu_ps(xs[i].as_ptr().add(i0 + 8 * h)) };
                    for j in 0..C {
                        a[i][j][h] = _mm256_add_ps(a[i][j][h], _mm256_mul_ps(xv, wv[j][h]));
                    }
                }
            }
        }
        a
    }
}

#[cfg(test)]
#[path = "matmul_tests.rs"]
mod tests;
