//! One type per sharding kind: each owns how its weight is cut across the TP ranks and
//! which collective follows it.

mod column;
mod row;
mod vocab;

pub use column::ColumnParallelLinear;
pub use row::RowParallelLinear;
pub use vocab::{Embedding, VocabParallelHead};

use crate::backend::{Backend, BackendError};
use crate::error::ModelError;
use crate::weights::WeightStore;

/// What every layer's `load` needs: the backend to upload to, the checkpoint, and this
/// rank's place in the TP group.
pub struct LoadCtx<'a, B: Backend> {
    pub backend: &'a B,
    pub store: &'a WeightStore,
    pub rank: usize,
    pub tp: usize,
}

impl<B: Backend> LoadCtx<'_, B> {
    pub fn backend_err(&self, source: BackendError) -> ModelError {
        ModelError::Backend {
            rank: self.rank,
            source,
        }
    }
}
