//! Column-parallel linear (q/k/v, gate/up): the output features are split; every output
//! element is reduced over the full K on one rank by the 8-segment tree, so its bits do
//! not depend on TP. No collective follows: the next layer consumes the shard.
//!
//! Projections of the same input are loaded as one layer (q/k/v; gate/up): each part's
//! rows of this rank are stacked into one weight, so one GEMM streams them all instead of
//! one launch (and one bf16 conversion of the input) per part. An output element's
//! reduction depends only on its row of X and its row of W, never on N, so the stacked
//! layer's outputs equal the separate layers' bit for bit.

use std::ops::Range;

use arbor_kernels::tree::{SegmentLayout, SEGMENTS};

use super::LoadCtx;
use crate::backend::{BResult, Backend, TreeSpec};
use crate::error::MResult;

/// One projection of a column-parallel layer: `<prefix>.weight` is
/// `[out_features, in_features]`, of which this rank holds `rows`.
#[derive(Debug, Clone)]
pub struct ColumnPart {
    pub prefix: String,
    pub out_features: usize,
    pub rows: Range<usize>,
}

pub struct ColumnParallelLinear<B: Backend> {
    w: B::Mat,
    bias: Option<B::Act>,
    tree: TreeSpec,
    /// Local output columns of each part, in order.
    widths: Vec<usize>,
}

impl<B: Backend> ColumnParallelLinear<B> {
    /// Loads every part's rows (and, if `bias`, the same ranges of `<prefix>.bias`),
    /// stacked in the order given.
    pub fn load(
        ctx: &LoadCtx<B>,
        parts: &[ColumnPart],
        in_features: usize,
        bias: bool,
    ) -> MResult<Self> {
        let mut data = Vec::new();
        let mut bias_data = Vec::new();
        let mut widths = Vec::with_capacity(parts.len());
        for p in parts {
            data.extend(ctx.store.rows(
                &format!("{}.weight", p.prefix),
                p.out_features,
                in_features,
                p.rows.clone(),
            )?);
            if bias {
                bias_data.extend(ctx.store.vector(
                    &format!("{}.bias", p.prefix),
                    p.out_features,
                    p.rows.clone(),
                )?);
            }
            widths.push(p.rows.len());
        }
        let n: usize = widths.iter().sum();
        let w = ctx
            .backend
            .mat_from_host(&data, n, in_features)
            .map_err(|e| ctx.backend_err(e))?;
        let bias = if bias {
            Some(
                ctx.backend
                    .act_from_host(&bias_data, 1, n)
                    .map_err(|e| ctx.backend_err(e))?,
            )
        } else {
            None
        };
        Ok(ColumnParallelLinear {
            w,
            bias,
            tree: TreeSpec {
                seg_len: SegmentLayout::new(in_features).seg_len,
                n_seg: SEGMENTS,
                k: in_features,
            },
            widths,
        })
    }

    /// All parts' outputs side by side, `[rows, Σ widths]`.
    pub fn forward(&self, b: &B, x: &B::Act) -> BResult<B::Act> {
        let mut y = b.matmul(x, &self.w, self.tree)?;
        if let Some(bias) = &self.bias {
            b.add_row_bias(&mut y, bias)?;
        }
        Ok(y)
    }

    /// Each part's output on its own.
    pub fn forward_parts(&self, b: &B, x: &B::Act) -> BResult<Vec<B::Act>> {
        let y = self.forward(b, x)?;
        if self.widths.len() == 1 {
            return Ok(vec![y]);
        }
        b.split_cols(&y, &self.widths)
    }
}
