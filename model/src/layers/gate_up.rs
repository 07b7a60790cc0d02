//! The MLP's gate and up projections as one column-parallel layer whose weight rows
//! alternate (gate j, up j), followed by silu(gate)·up. With that layout both halves of an
//! output lie in one GEMM tile, so a backend computes the SiLU·mul in the GEMM's epilogue
//! (`Backend::matmul_silu_mul`) and the `[rows, 2·inter]` gate/up output never goes to
//! memory. Alternating moves rows and changes no output: each is still reduced over the
//! full K by the tree on one rank (see column.rs).

use super::{ColumnParallelLinear, ColumnPart, LoadCtx};
use crate::backend::{BResult, Backend, TreeSpec};
use crate::error::MResult;

pub struct GateUpLinear<B: Backend> {
    lin: ColumnParallelLinear<B>,
}

impl<B: Backend> GateUpLinear<B> {
    /// This rank's rows of `gate` and `up` (equal ranges of the intermediate dimension).
    pub fn load(
        ctx: &LoadCtx<B>,
        gate: &ColumnPart,
        up: &ColumnPart,
        in_features: usize,
        bias: bool,
    ) -> MResult<Self> {
        Ok(Self {
            lin: ColumnParallelLinear::load_alternating(ctx, gate, up, in_features, bias)?,
        })
    }

    /// The weight (rows alternating gate and up) and its tree, where the layer has no
    /// bias (a grouped kernel over several experts has no bias step).
    pub fn weight(&self) -> Option<(&B::Mat, TreeSpec)> {
        match self.lin.weight_and_bias() {
            (w, tree, None) => Some((w, tree)),
            _ => None,
        }
    }

    /// silu(x·gateᵀ)·(x·upᵀ), `[rows, inter]` of this rank's intermediate columns.
    pub fn forward(&self, b: &B, x: &B::Act) -> BResult<B::Act> {
        let (w, tree, bias) = self.lin.weight_and_bias();
        match bias {
            // The bias goes in before the activation: no fused epilogue for it.
            Some(bias) => {
                let mut gu = b.matmul(x, w, tree)?;
                b.add_row_bias(&mut gu, bias)?;
                b.silu_mul_pairs(&gu)
            }
            None => b.matmul_silu_mul(x, w, tree),
        }
    }
}
