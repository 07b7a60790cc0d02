//! The TP group's collectives on the GPU: the row-parallel all-reduce (the fixed tree, or
//! NCCL's under `--numerics fast`) and the column all-gather.

use std::sync::Arc;

use arbor_collective::gpu::{Algo, GpuCollective, GpuOptions};
use arbor_collective::nccl::Dtype;
use arbor_collective::Communicator;
use arbor_kernels::cuda::ops::dev_ptr;
use arbor_kernels::cuda::GpuDevice;

use super::{CudaAct, CudaBackend};
use crate::backend::{BResult, BackendError};

/// The all-reduce algorithm: `auto` by default (one-shot for small messages, two-shot for
/// large ones, all-gather + tree where IPC is unavailable: every one gives the tree's bits);
/// `ARBOR_GPU_ALLREDUCE=tree|oneshot|twoshot` forces one. NVLS is never taken from here.
pub(super) fn allreduce_algo(var: Option<&str>) -> Result<Algo, String> {
    match var {
        None => Ok(Algo::Auto),
        Some(s) => match s.parse::<Algo>()? {
            Algo::Nvls => Err(
                "ARBOR_GPU_ALLREDUCE=nvls: NVLink multicast is not used by the CUDA backend".into(),
            ),
            a => Ok(a),
        },
    }
}

/// `allow_shared`: the user let ranks share a GPU (`ARBOR_RANKS_PER_GPU`); where they do,
/// the collectives go through the host and the IPC kernels run only when named.
pub(super) fn gpu_collective(
    comm: &Arc<dyn Communicator>,
    dev: &GpuDevice,
    algo: Algo,
    allow_shared: bool,
) -> Result<GpuCollective, String> {
    let mut opts = GpuOptions {
        allow_shared,
        shared_ipc: matches!(algo, Algo::OneShot | Algo::TwoShot),
        ..GpuOptions::default()
    };
    if algo == Algo::AllGatherTree {
        // No CUDA IPC buffers when only the all-gather path runs.
        opts.ipc_capacity_bytes = 0;
    }
    GpuCollective::with_options(comm.clone(), dev.stream.clone(), opts).map_err(|e| e.to_string())
}

impl CudaBackend {
    /// At TP > 1, runs each collective a step uses once (the all-reduce of this
    /// numerics, the all-gather) on a small buffer, so that their one-time costs (NCCL's
    /// connection setup, kernel loads, first scratch buffers) are paid at load time and
    /// not by the first request's prefill. Collective: every rank runs it inside `new`.
    pub(super) fn warm_up_collectives(&self) -> Result<(), BackendError> {
        if self.comm.world_size() == 1 {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let x = self.act(
            self.dev.zeros_f32(4096).map_err(|e| self.dev_err(e))?,
            1,
            4096,
        );
        let gathered = self.all_gather_cols_untimed(&x)?;
        let reduced = self.all_reduce_untimed(x)?;
        self.dev.synchronize().map_err(|e| self.dev_err(e))?;
        self.check_collectives()?;
        drop((gathered, reduced));
        tracing::info!(
            rank = self.comm.rank(),
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "collectives warmed up"
        );
        Ok(())
    }

    /// Errors the stream could not report (a failed host-staged exchange, an IPC barrier
    /// that gave up): checked where a step's results reach the host.
    pub(super) fn check_collectives(&self) -> BResult<()> {
        match &self.coll {
            Some(c) => c
                .check()
                .map_err(|e| self.coll_err("collective of an earlier op", e)),
            None => Ok(()),
        }
    }

    fn coll(&self) -> BResult<&GpuCollective> {
        self.coll.as_ref().ok_or_else(|| BackendError::Device {
            rank: self.comm.rank(),
            msg: format!(
                "no GPU collective for world size {}",
                self.comm.world_size()
            ),
        })
    }

    fn coll_err(&self, what: &str, e: arbor_collective::gpu::GpuError) -> BackendError {
        BackendError::Device {
            rank: self.comm.rank(),
            msg: format!("{what}: {e}"),
        }
    }

    pub(super) fn all_reduce_untimed(&self, partial: CudaAct) -> BResult<CudaAct> {
        let world = self.comm.world_size();
        if world == 1 {
            return Ok(partial);
        }
        if partial.buf.is_empty() {
            return Ok(partial);
        }
        let coll = self.coll()?;
        // The output comes from the device (lent inside a recorded step), not from the
        // collective's own allocation.
        let mut out = self
            .dev
            .empty_f32(partial.buf.len())
            .map_err(|e| self.dev_err(e))?;
        match self.blas {
            Some(_) => {
                let s = &self.dev.stream;
                let (src, dst, n) = (dev_ptr(&partial.buf, s), dev_ptr(&out, s), out.len());
                // SAFETY: both buffers hold n f32 on this rank's device and stay alive
                // until the stream's work is done (stream-ordered frees).
                unsafe { coll.sum_all_reduce_raw(src, dst, n, Dtype::F32) }
                    .map_err(|e| self.coll_err("sum all-reduce (--numerics fast)", e))?;
            }
            None => {
                coll.tree_all_reduce_into(self.algo, &partial.buf, &mut out)
                    .map_err(|e| self.coll_err("tree all-reduce", e))?;
            }
        }
        Ok(self.act(out, partial.rows, partial.cols))
    }

    pub(super) fn all_gather_cols_untimed(&self, x: &CudaAct) -> BResult<CudaAct> {
        let world = self.comm.world_size();
        if world == 1 {
            let buf = self.dev.copy_f32(&x.buf).map_err(|e| self.dev_err(e))?;
            return Ok(self.act(buf, x.rows, x.cols));
        }
        if x.buf.is_empty() {
            return Ok(self.act(
                self.dev.zeros_f32(0).map_err(|e| self.dev_err(e))?,
                x.rows,
                world * x.cols,
            ));
        }
        let n = x.buf.len();
        let gathered = self.dev.empty_f32(world * n).map_err(|e| self.dev_err(e))?;
        {
            let s = &self.dev.stream;
            // SAFETY: x holds n f32, `gathered` world·n, both on this rank's device.
            unsafe {
                self.coll()?.all_gather_raw(
                    dev_ptr(&x.buf, s),
                    dev_ptr(&gathered, s),
                    n,
                    Dtype::F32,
                )
            }
            .map_err(|e| self.coll_err("all-gather of columns", e))?;
        }
        let buf = self
            .dev
            .interleave_cols(&gathered, world, x.rows, x.cols)
            .map_err(|e| self.dev_err(e))?;
        Ok(self.act(buf, x.rows, world * x.cols))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allreduce_algo_defaults_to_auto_and_refuses_nvls() {
        assert_eq!(allreduce_algo(None).unwrap(), Algo::Auto);
        assert_eq!(allreduce_algo(Some("tree")).unwrap(), Algo::AllGatherTree);
        assert_eq!(allreduce_algo(Some("oneshot")).unwrap(), Algo::OneShot);
        assert!(allreduce_algo(Some("nvls"))
            .unwrap_err()
            .contains("NVLink multicast"));
        assert!(allreduce_algo(Some("fastest")).is_err());
    }
}
