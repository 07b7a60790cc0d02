//! Y = X·Wᵀ with the reduction over K following the 8-segment tree.
use half::bf16;

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

/// x: [m, k] row-major bf16; w: [n, k] row-major bf16 (a linear layer's weight as stored by
/// HF); out: [m, n] f32, the subtree root for every element.
pub fn tree_matmul(x: &[bf16], w: &[bf16], shape: TreeMatmul, out: &mut [f32]) {
    let _ = (x, w, shape, out);
    unimplemented!("tree_matmul")
}

/// Baseline for the benchmark only: a straightforward f32-accumulating matmul with no
/// fixed tree (same layout as [`tree_matmul`]).
pub fn plain_matmul(x: &[bf16], w: &[bf16], m: usize, n: usize, k: usize, out: &mut [f32]) {
    let _ = (x, w, m, n, k, out);
    unimplemented!("plain_matmul")
}
