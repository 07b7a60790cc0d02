//! Column-parallel linear (q/k/v, gate, up): the output features are split; every output
//! element is reduced over the full K on one rank by the 8-segment tree, so its bits do
//! not depend on TP. No collective follows: the next layer consumes the shard.

use std::ops::Range;

use arbor_kernels::tree::{SegmentLayout, SEGMENTS};

use super::LoadCtx;
use crate::backend::{BResult, Backend, TreeSpec};
use crate::error::MResult;

pub struct ColumnParallelLinear<B: Backend> {
    w: B::Mat,
    bias: Option<B::Act>,
    tree: TreeSpec,
    /// Global output rows this rank holds.
    pub rows: Range<usize>,
}

impl<B: Backend> ColumnParallelLinear<B> {
    /// Loads rows `rows` of `<prefix>.weight` (`[out_features, in_features]`) and, if
    /// `bias`, the same range of `<prefix>.bias`.
    pub fn load(
        ctx: &LoadCtx<B>,
        prefix: &str,
        out_features: usize,
        in_features: usize,
        rows: Range<usize>,
        bias: bool,
    ) -> MResult<Self> {
        let data = ctx.store.rows(
            &format!("{prefix}.weight"),
            out_features,
            in_features,
            rows.clone(),
        )?;
        Self::from_rows(ctx, prefix, &data, out_features, in_features, rows, bias)
    }

    /// Builds the layer from this rank's rows, already read (e.g. from a tied embedding).
    pub fn from_rows(
        ctx: &LoadCtx<B>,
        prefix: &str,
        data: &[half::bf16],
        out_features: usize,
        in_features: usize,
        rows: Range<usize>,
        bias: bool,
    ) -> MResult<Self> {
        let w = ctx
            .backend
            .mat_from_host(data, data.len() / in_features.max(1), in_features)
            .map_err(|e| ctx.backend_err(e))?;
        let bias = ctx.bias(prefix, out_features, rows.clone(), bias)?;
        Ok(ColumnParallelLinear {
            w,
            bias,
            tree: TreeSpec {
                seg_len: SegmentLayout::new(in_features).seg_len,
                n_seg: SEGMENTS,
                k: in_features,
            },
            rows,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Act) -> BResult<B::Act> {
        let mut y = b.matmul(x, &self.w, self.tree)?;
        if let Some(bias) = &self.bias {
            b.add_row_bias(&mut y, bias)?;
        }
        Ok(y)
    }
}
