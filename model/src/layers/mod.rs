//! One type per sharding kind: each owns how its weight is cut across the TP ranks and
//! which collective follows it.

mod column;
mod gate_up;
mod moe;
mod row;
mod vocab;

pub use column::{ColumnParallelLinear, ColumnPart};
pub use gate_up::GateUpLinear;
pub use moe::{route, MoeBlock, Route};
pub use row::RowParallelLinear;
pub use vocab::{Embedding, VocabParallelHead};

use std::ops::Range;

use half::bf16;

use crate::backend::{Backend, BackendError, DeviceCut};
use crate::error::{MResult, ModelError};
use crate::weights::{MatPart, MatPlan, RowOrder, WeightStore};

/// What every layer's `load` needs: the backend to upload to, the checkpoint, and this
/// rank's place in the TP group.
pub struct LoadCtx<'a, B: Backend> {
    pub backend: &'a B,
    pub store: &'a WeightStore,
    pub rank: usize,
    pub tp: usize,
    /// The TP size whose rank-0 shard the row-parallel layers reduce as: `tp`, except
    /// when a benchmark emulates one rank of a larger group (`LoadOptions::rank_of_tp`).
    pub row_tp: usize,
}

impl<B: Backend> LoadCtx<'_, B> {
    pub fn backend_err(&self, source: BackendError) -> ModelError {
        ModelError::Backend {
            rank: self.rank,
            source,
        }
    }

    /// The weight `plan` describes, every value checked finite; each part's tensor is
    /// then released. Where every part's tensor lies in the backend's memory (a trainer's
    /// broadcast), the parts are cut, converted and checked there. Otherwise, from
    /// safetensors, the backend has its rows written straight into the memory it uploads
    /// from, a chunk at a time (`Backend::mat_from_rows`); GGUF parts are dequantized
    /// whole, then uploaded. Every tensor's presence and shape is checked before any row
    /// is read.
    pub fn mat(&self, plan: &MatPlan) -> MResult<B::Mat> {
        let mat = match self.device_mat(plan)? {
            Some(m) => m,
            None => self.host_mat(plan)?,
        };
        for p in &plan.parts {
            self.store.release(&p.name);
        }
        Ok(mat)
    }

    fn device_mat(&self, plan: &MatPlan) -> MResult<Option<B::Mat>> {
        let mut held = Vec::with_capacity(plan.parts.len());
        for p in &plan.parts {
            match self.store.device(&p.name, &[p.n, p.k])? {
                Some(t) => held.push(t),
                None => return Ok(None),
            }
        }
        plan.check().map_err(ModelError::Plan)?;
        let (n, k) = (plan.rows(), plan.width());
        let cuts: Vec<DeviceCut<'_>> = plan
            .parts
            .iter()
            .zip(&held)
            .enumerate()
            .map(|(i, (p, t))| {
                let (dst_row0, dst_step) = plan.landing(i);
                DeviceCut {
                    src: t,
                    k: p.k,
                    rows: p.rows.clone(),
                    cols: p.cols.clone(),
                    dst_row0,
                    dst_step,
                }
            })
            .collect();
        match self.backend.mat_from_device(n, k, &cuts) {
            Ok(Ok(m)) => Ok(Some(m)),
            Ok(Err(bad)) => {
                let (p, t) = (&plan.parts[bad.cut], &held[bad.cut]);
                let es = t.dtype.size();
                let at = t.range.start + bad.flat * es;
                let raw = t.bytes.read(at..at + es).map_err(|msg| {
                    self.backend_err(BackendError::Device {
                        rank: self.rank,
                        msg,
                    })
                })?;
                Err(crate::safetensors::non_finite_error(
                    self.store.label(),
                    &p.name,
                    t.dtype,
                    &t.shape,
                    &raw,
                    bad.flat,
                ))
            }
            // A backend that cannot cut on its own memory: the host path reads the bytes.
            Err(BackendError::Unsupported(_)) => Ok(None),
            Err(e) => Err(self.backend_err(e)),
        }
    }

    fn host_mat(&self, plan: &MatPlan) -> MResult<B::Mat> {
        self.store.check_plan(plan)?;
        let (n, k) = (plan.rows(), plan.width());
        if self.store.fills_by_rows() {
            return self
                .backend
                .mat_from_rows(n, k, &mut |rows, dst| self.store.fill(plan, rows, dst));
        }
        let mut data = vec![bf16::ZERO; n * k];
        self.store.fill(plan, 0..n, &mut data)?;
        self.backend
            .mat_from_host(&data, n, k)
            .map_err(|e| self.backend_err(e))
    }

    /// Elements `range` of the vector `name` of length `len`; the tensor is then released.
    pub fn vector(&self, name: &str, len: usize, range: Range<usize>) -> MResult<Vec<f32>> {
        let v = self.store.vector(name, len, range)?;
        self.store.release(name);
        Ok(v)
    }

    /// Rows `rows` (all `k` columns) of the `[n, k]` matrix `name`, uploaded.
    pub fn mat_rows(&self, name: &str, n: usize, k: usize, rows: Range<usize>) -> MResult<B::Mat> {
        self.mat(&MatPlan {
            parts: vec![MatPart {
                name: name.to_string(),
                n,
                k,
                rows,
                cols: 0..k,
            }],
            order: RowOrder::Stacked,
            pad_rows: 0,
        })
    }

    /// Elements `range` of `<prefix>.bias` (`[out_features]`) as a one-row activation,
    /// or `None` when the layer has no bias.
    pub fn bias(
        &self,
        prefix: &str,
        out_features: usize,
        range: Range<usize>,
        present: bool,
    ) -> MResult<Option<B::Act>> {
        if !present {
            return Ok(None);
        }
        let b = self.vector(&format!("{prefix}.bias"), out_features, range)?;
        self.backend
            .act_from_host(&b, 1, b.len())
            .map(Some)
            .map_err(|e| self.backend_err(e))
    }
}
