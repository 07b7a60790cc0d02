//! Row-parallel linear (o_proj, down_proj): K is split exactly along
//! `SegmentLayout::new(K).shard(rank, tp)`; each rank computes the subtree root of its
//! 8/tp segments and the tree all-reduce finishes the same fixed tree on every rank.

use std::ops::Range;

use arbor_kernels::tree::{SegmentLayout, SEGMENTS};

use super::LoadCtx;
use crate::backend::{BResult, Backend, TreeSpec};
use crate::error::MResult;

pub struct RowParallelLinear<B: Backend> {
    w: B::Mat,
    /// Replicated; added once, after the all-reduce.
    bias: Option<B::Act>,
    tree: TreeSpec,
    /// Global input columns this rank holds.
    pub cols: Range<usize>,
}

impl<B: Backend> RowParallelLinear<B> {
    /// The K-range rank `rank` of `tp` holds for a reduction of length `in_features`; the
    /// column-parallel layer feeding this one must produce exactly these features.
    pub fn shard(in_features: usize, rank: usize, tp: usize) -> Range<usize> {
        SegmentLayout::new(in_features).shard(rank, tp)
    }

    pub fn load(
        ctx: &LoadCtx<B>,
        prefix: &str,
        out_features: usize,
        in_features: usize,
        bias: bool,
    ) -> MResult<Self> {
        let cols = Self::shard(in_features, ctx.rank, ctx.tp);
        let data = ctx.store.cols(
            &format!("{prefix}.weight"),
            out_features,
            in_features,
            cols.clone(),
        )?;
        let w = ctx
            .backend
            .mat_from_host(&data, out_features, cols.len())
            .map_err(|e| ctx.backend_err(e))?;
        let bias = ctx.bias(prefix, out_features, 0..out_features, bias)?;
        Ok(RowParallelLinear {
            w,
            bias,
            tree: TreeSpec {
                seg_len: SegmentLayout::new(in_features).seg_len,
                n_seg: SEGMENTS / ctx.tp,
                k: in_features,
            },
            cols,
        })
    }

    /// `x` holds this rank's columns `self.cols` of the input; returns the full output,
    /// identical on every rank.
    pub fn forward(&self, b: &B, x: &B::Act) -> BResult<B::Act> {
        let partial = b.matmul(x, &self.w, self.tree)?;
        let mut y = b.tree_all_reduce(partial)?;
        if let Some(bias) = &self.bias {
            b.add_row_bias(&mut y, bias)?;
        }
        Ok(y)
    }
}
