//! The reduction tree of the invariance contract (docs/invariance.md).
//!
//! Every reduction over a matmul's K is cut into [`SEGMENTS`] contiguous segments. Each
//! segment is summed by a backend's leaf procedure (which depends on nothing but that
//! segment's data), and the segment sums are combined by the fixed full binary tree
//! `((s0+s1)+(s2+s3)) + ((s4+s5)+(s6+s7))`. At TP = t, rank r owns segments
//! `[r·8/t, (r+1)·8/t)`, computes the subtree root over them, and the t roots are combined
//! with the same tree shape: a subtree computed anywhere is the same sequence of additions,
//! so the result has the same bits for every t in {1, 2, 4, 8}.

use std::ops::Range;

/// Number of leaf segments, which is also the largest supported TP size.
pub const SEGMENTS: usize = 8;

/// How a reduction dimension of length `k` is cut into the 8 segments.
///
/// Segments have `seg_len = ceil(k / 8)` elements; the last ones may be shorter or empty
/// (conceptually zero-padded: an empty segment sums to +0.0). The layout depends only on
/// `k`, never on TP, batch or thread count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentLayout {
    pub k: usize,
    pub seg_len: usize,
}

impl SegmentLayout {
    pub fn new(k: usize) -> Self {
        Self {
            k,
            seg_len: k.div_ceil(SEGMENTS).max(1),
        }
    }

    /// Columns of segment `s` (clamped to `k`, possibly empty).
    pub fn segment(&self, s: usize) -> Range<usize> {
        let lo = (s * self.seg_len).min(self.k);
        let hi = ((s + 1) * self.seg_len).min(self.k);
        lo..hi
    }

    /// Segments owned by `rank` at TP = `world` (`world` a power of two ≤ 8).
    pub fn segments_of(rank: usize, world: usize) -> Range<usize> {
        debug_assert!(is_valid_world(world) && rank < world);
        let per = SEGMENTS / world;
        rank * per..(rank + 1) * per
    }

    /// Columns owned by `rank` at TP = `world`: the union of its segments.
    pub fn shard(&self, rank: usize, world: usize) -> Range<usize> {
        let segs = Self::segments_of(rank, world);
        let lo = self.segment(segs.start).start;
        let hi = self.segment(segs.end - 1).end;
        lo..hi
    }
}

/// TP sizes the tree supports: 1, 2, 4, 8.
pub fn is_valid_world(world: usize) -> bool {
    world.is_power_of_two() && world <= SEGMENTS
}

/// The one addition the tree is made of. Kept as a function so every backend's host-side
/// code names the same operation.
#[inline(always)]
pub fn combine_pair(a: f32, b: f32) -> f32 {
    a + b
}

/// Sum a power-of-two number of values with the fixed pairwise tree
/// (left-to-right pairs at every level).
pub fn tree_sum(vals: &[f32]) -> f32 {
    assert!(
        vals.len().is_power_of_two(),
        "tree_sum needs a power-of-two count, got {}",
        vals.len()
    );
    let mut buf = [0.0f32; SEGMENTS];
    let n = vals.len();
    if n > SEGMENTS {
        // Larger trees (e.g. lane reductions) recurse on halves: same shape by construction.
        let (a, b) = vals.split_at(n / 2);
        return combine_pair(tree_sum(a), tree_sum(b));
    }
    buf[..n].copy_from_slice(vals);
    pairwise(&mut buf[..n], combine_pair)
}

/// The fixed pairwise tree over `vals` (a power-of-two count, at least one), in place:
/// left-to-right pairs at every level, `add(left, right)`. [`tree_sum`]'s tree, for any
/// value a pair can be added as (the CPU kernels' vector registers hold many outputs'
/// segment sums at once). Always inlined: inside a kernel compiled for AVX-512 the adds
/// must stay vector instructions there, not calls (measured: a called version halved the
/// single-row GEMM's speed).
#[inline(always)]
pub fn pairwise<T: Copy>(vals: &mut [T], add: impl Fn(T, T) -> T) -> T {
    let mut width = vals.len();
    while width > 1 {
        for i in 0..width / 2 {
            vals[i] = add(vals[2 * i], vals[2 * i + 1]);
        }
        width /= 2;
    }
    vals[0]
}

/// Combine `roots.len()` (a power of two ≤ 8) equally long slices element-wise with the
/// fixed tree, writing into `out`. `roots[i]` is the subtree root of rank i's segments.
pub fn combine_roots(roots: &[&[f32]], out: &mut [f32]) {
    let n = roots.len();
    assert!(
        is_valid_world(n),
        "combine_roots needs 1, 2, 4 or 8 roots, got {n}"
    );
    for r in roots {
        assert_eq!(r.len(), out.len(), "combine_roots: root length mismatch");
    }
    let mut lane = [0.0f32; SEGMENTS];
    for (j, o) in out.iter_mut().enumerate() {
        for (i, r) in roots.iter().enumerate() {
            lane[i] = r[j];
        }
        *o = tree_sum(&lane[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_covers_k_exactly_once() {
        for k in [1usize, 7, 8, 9, 100, 128, 4096, 14336, 4097] {
            let l = SegmentLayout::new(k);
            let mut next = 0;
            for s in 0..SEGMENTS {
                let r = l.segment(s);
                assert_eq!(r.start, next.min(k));
                next = r.end;
            }
            assert_eq!(next, k);
            for world in [1, 2, 4, 8] {
                let mut next = 0;
                for rank in 0..world {
                    let r = l.shard(rank, world);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, k, "k={k} world={world}");
            }
        }
    }

    #[test]
    fn subtrees_compose_to_the_full_tree() {
        // Values chosen so that association order matters in f32.
        let s = [1e8f32, 1.0, -1e8, 1.0, 3.5e-3, 7.0, -2.0e7, 2.0e7];
        let full = tree_sum(&s);
        for world in [1usize, 2, 4, 8] {
            let roots: Vec<f32> = (0..world)
                .map(|r| tree_sum(&s[SegmentLayout::segments_of(r, world)]))
                .collect();
            let slices: Vec<&[f32]> = roots.iter().map(std::slice::from_ref).collect();
            let mut out = [0.0f32];
            combine_roots(&slices, &mut out);
            assert_eq!(out[0].to_bits(), full.to_bits(), "world {world}");
        }
        // And a different association does differ here, so the test can fail.
        let seq = s.iter().fold(0.0f32, |a, &b| a + b);
        assert_ne!(seq.to_bits(), full.to_bits());
    }
}
