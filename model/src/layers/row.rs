//! Row-parallel linear (o_proj, down_proj): K is split exactly along
//! `SegmentLayout::new(K).shard(rank, tp)`; each rank computes the subtree root of its
//! 8/tp segments and the tree all-reduce finishes the same fixed tree on every rank.

use std::ops::Range;

use arbor_kernels::tree::{SegmentLayout, SEGMENTS};

use super::LoadCtx;
use crate::backend::{BResult, Backend, TreeSpec};
use crate::error::MResult;
use crate::weights::{MatPart, MatPlan, RowOrder};

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
        let w = ctx.mat(&MatPlan {
            parts: vec![MatPart {
                name: format!("{prefix}.weight"),
                n: out_features,
                k: in_features,
                rows: 0..out_features,
                cols: cols.clone(),
            }],
            order: RowOrder::Stacked,
            pad_rows: 0,
        })?;
        let bias = ctx.bias(prefix, out_features, 0..out_features, bias)?;
        Ok(RowParallelLinear {
            w,
            bias,
            tree: Self::tree(in_features, ctx)?,
            cols,
        })
    }

    /// The reduction this rank runs: its 8/tp segments of the layer's K; when a benchmark
    /// emulates one rank of a TP group of `row_tp` on a single rank, rank 0's segments of
    /// a `row_tp` times longer K, which the whole local K must be.
    fn tree(in_features: usize, ctx: &LoadCtx<B>) -> MResult<TreeSpec> {
        if ctx.row_tp == ctx.tp {
            return Ok(TreeSpec {
                seg_len: SegmentLayout::new(in_features).seg_len,
                n_seg: SEGMENTS / ctx.tp,
                k: in_features,
            });
        }
        let global = in_features * ctx.row_tp;
        let layout = SegmentLayout::new(global);
        if layout.shard(0, ctx.row_tp).len() != in_features {
            return Err(crate::error::ModelError::Sharding {
                tp: ctx.row_tp,
                msg: format!(
                    "a K of {in_features} is not rank 0's shard of {global} at TP {}",
                    ctx.row_tp
                ),
            });
        }
        Ok(TreeSpec {
            seg_len: layout.seg_len,
            n_seg: SEGMENTS / ctx.row_tp,
            k: global,
        })
    }

    /// The weight (this rank's columns) and its tree, where the layer has no bias.
    pub fn weight(&self) -> Option<(&B::Mat, TreeSpec)> {
        match self.bias {
            None => Some((&self.w, self.tree)),
            Some(_) => None,
        }
    }

    /// This rank's subtree roots for `x` (its columns `self.cols` of the input), before
    /// the all-reduce: for a caller that reduces several layers' partials in one
    /// all-reduce (the experts of a layer). The bias is not in it.
    pub fn partial(&self, b: &B, x: &B::Act) -> BResult<B::Act> {
        b.matmul(x, &self.w, self.tree)
    }

    /// `x` holds this rank's columns `self.cols` of the input; returns the full output,
    /// identical on every rank.
    pub fn forward(&self, b: &B, x: &B::Act) -> BResult<B::Act> {
        let partial = self.partial(b, x)?;
        let mut y = b.tree_all_reduce(partial)?;
        if let Some(bias) = &self.bias {
            b.add_row_bias(&mut y, bias)?;
        }
        Ok(y)
    }
}
