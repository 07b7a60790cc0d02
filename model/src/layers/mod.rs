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
use crate::weights::WeightStore;

/// One block of a weight being made: rows `rows` × columns `cols` of the `[n, k]`
/// checkpoint tensor `name`, landing at rows `dst_row0`, `dst_row0 + dst_step`, … of the
/// weight (a column-parallel layer stacks or alternates its parts' rows; a row-parallel
/// layer takes a range of columns).
#[derive(Debug, Clone)]
pub struct Block<'a> {
    pub name: &'a str,
    pub n: usize,
    pub k: usize,
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    pub dst_row0: usize,
    pub dst_step: usize,
}

impl<'a> Block<'a> {
    /// Rows `rows` of `[n, k]`, stacked from row `dst_row0` on.
    pub fn rows(name: &'a str, n: usize, k: usize, rows: Range<usize>, dst_row0: usize) -> Self {
        Block {
            name,
            n,
            k,
            rows,
            cols: 0..k,
            dst_row0,
            dst_step: 1,
        }
    }
}

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

    /// The `[n, k]` bf16 weight made of `blocks` (rows no block writes are zero), every
    /// value checked finite; each block's tensor is then released. Where every block's
    /// tensor lies in the backend's memory (a trainer's broadcast), the blocks are cut,
    /// converted and checked there; else they are read on the host and uploaded.
    pub fn mat(&self, n: usize, k: usize, blocks: &[Block<'_>]) -> MResult<B::Mat> {
        let mat = match self.device_mat(n, k, blocks)? {
            Some(m) => m,
            None => self.host_mat(n, k, blocks)?,
        };
        for b in blocks {
            self.store.release(b.name);
        }
        Ok(mat)
    }

    fn device_mat(&self, n: usize, k: usize, blocks: &[Block<'_>]) -> MResult<Option<B::Mat>> {
        let mut held = Vec::with_capacity(blocks.len());
        for b in blocks {
            match self.store.device(b.name, &[b.n, b.k])? {
                Some(t) => held.push(t),
                None => return Ok(None),
            }
        }
        let cuts: Vec<DeviceCut<'_>> = blocks
            .iter()
            .zip(&held)
            .map(|(b, t)| DeviceCut {
                src: t,
                k: b.k,
                rows: b.rows.clone(),
                cols: b.cols.clone(),
                dst_row0: b.dst_row0,
                dst_step: b.dst_step,
            })
            .collect();
        match self.backend.mat_from_device(n, k, &cuts) {
            Ok(Ok(m)) => Ok(Some(m)),
            Ok(Err(bad)) => {
                let (b, t) = (&blocks[bad.cut], &held[bad.cut]);
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
                    b.name,
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

    fn host_mat(&self, n: usize, k: usize, blocks: &[Block<'_>]) -> MResult<B::Mat> {
        let read = |b: &Block<'_>| {
            if b.cols == (0..b.k) {
                self.store.rows(b.name, b.n, b.k, b.rows.clone())
            } else {
                debug_assert_eq!(b.rows, 0..b.n, "a block cuts rows or columns, not both");
                self.store.cols(b.name, b.n, b.k, b.cols.clone())
            }
        };
        let data = match blocks {
            // One block that is the whole weight: no copy.
            [b] if b.dst_row0 == 0 && b.dst_step == 1 && b.rows.len() == n && b.cols.len() == k => {
                read(b)?
            }
            _ => {
                let mut data = vec![bf16::ZERO; n * k];
                for b in blocks {
                    let w = b.cols.len();
                    for (i, row) in read(b)?.chunks_exact(w.max(1)).enumerate() {
                        let d0 = (b.dst_row0 + i * b.dst_step) * k;
                        data[d0..d0 + w].copy_from_slice(row);
                    }
                }
                data
            }
        };
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
