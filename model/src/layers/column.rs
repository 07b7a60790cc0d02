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
use crate::error::{MResult, ModelError};
use crate::weights::{MatPart, MatPlan, RowOrder};

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
        Self::load_arranged(ctx, parts, in_features, bias, RowOrder::Stacked)
    }

    /// Loads two parts of equal width with their rows alternating (`a`'s row j at 2j,
    /// `b`'s at 2j + 1), for an epilogue that combines the pair (gate/up).
    pub fn load_alternating(
        ctx: &LoadCtx<B>,
        a: &ColumnPart,
        b: &ColumnPart,
        in_features: usize,
        bias: bool,
    ) -> MResult<Self> {
        if a.rows.len() != b.rows.len() {
            return Err(ModelError::Plan(format!(
                "{} and {} cannot alternate: this rank holds {} and {} of their rows",
                a.prefix,
                b.prefix,
                a.rows.len(),
                b.rows.len()
            )));
        }
        let parts = [a.clone(), b.clone()];
        Self::load_arranged(ctx, &parts, in_features, bias, RowOrder::Alternating)
    }

    fn load_arranged(
        ctx: &LoadCtx<B>,
        parts: &[ColumnPart],
        in_features: usize,
        bias: bool,
        order: RowOrder,
    ) -> MResult<Self> {
        let plan = MatPlan {
            parts: parts
                .iter()
                .map(|p| MatPart {
                    name: format!("{}.weight", p.prefix),
                    n: p.out_features,
                    k: in_features,
                    rows: p.rows.clone(),
                    cols: 0..in_features,
                })
                .collect(),
            order,
            pad_rows: 0,
        };
        let w = ctx.mat(&plan)?;
        let mut biases = Vec::with_capacity(parts.len());
        if bias {
            for p in parts {
                biases.push(ctx.vector(
                    &format!("{}.bias", p.prefix),
                    p.out_features,
                    p.rows.clone(),
                )?);
            }
        }
        let widths: Vec<usize> = parts.iter().map(|p| p.rows.len()).collect();
        let n: usize = widths.iter().sum();
        let bias_data = match order {
            RowOrder::Stacked => biases.concat(),
            RowOrder::Alternating => alternate_rows(&biases, 1),
        };
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

    /// The weight, its tree and its bias, for a layer that runs its own op on them.
    pub(super) fn weight_and_bias(&self) -> (&B::Mat, TreeSpec, Option<&B::Act>) {
        (&self.w, self.tree, self.bias.as_ref())
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

/// The rows (of `width` values) of two equally long parts, alternating: part 0's row j
/// at 2j, part 1's at 2j + 1 (the biases' order where the weight's rows alternate). Empty input (no parts, e.g. no bias) gives an empty result.
fn alternate_rows<T: Copy>(parts: &[Vec<T>], width: usize) -> Vec<T> {
    let [a, b] = parts else {
        return parts.concat();
    };
    let mut out = Vec::with_capacity(a.len() + b.len());
    for (ra, rb) in a.chunks_exact(width).zip(b.chunks_exact(width)) {
        out.extend_from_slice(ra);
        out.extend_from_slice(rb);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::alternate_rows;

    #[test]
    fn alternating_rows_interleave_whole_rows() {
        let a = vec![1, 2, 3, 4, 5, 6];
        let b = vec![10, 20, 30, 40, 50, 60];
        assert_eq!(
            alternate_rows(&[a.clone(), b.clone()], 2),
            [1, 2, 10, 20, 3, 4, 30, 40, 5, 6, 50, 60]
        );
        assert_eq!(alternate_rows(&[a, b], 1)[..4], [1, 10, 2, 20]);
        assert!(alternate_rows::<u8>(&[], 3).is_empty());
    }
}
