//! Device memory another library owns — a torch tensor in a trainer's process — used as
//! arbor's activations and weights without a copy, and the ordering between that
//! library's stream and arbor's: the ops of `arbor.torch` on CUDA tensors run the backend's
//! own methods (the same kernels, chosen the same way, as a serving rank's step) on views
//! of the tensors.

use std::sync::Arc;

use arbor_kernels::cuda::{DevBuf, GpuDevice};
use cudarc::driver::sys;

use super::gemm::GemmKind;
use super::{CudaAct, CudaBackend, CudaMat};
use crate::backend::{BResult, BackendError};

impl CudaBackend {
    /// A world-size-1 backend on GPU `ordinal` for a process that holds the model's tensors
    /// itself (a trainer): the linear layers' kernel chosen as a serving rank chooses it
    /// (`ARBOR_GEMM`, else by the GPU's architecture), invariant numerics, no recorded steps.
    pub fn for_foreign_tensors(ordinal: usize) -> Result<Self, BackendError> {
        let err = |msg: String| BackendError::Device { rank: 0, msg };
        let kind = GemmKind::from_env().map_err(err)?;
        let dev = GpuDevice::open(ordinal).map_err(|e| err(e.to_string()))?;
        let gemm = super::load::linear_kernel(&dev, kind, 0).map_err(err)?;
        let mut backend = Self::solo(Arc::new(dev));
        backend.gemm = gemm;
        Ok(backend)
    }

    /// The CUDA ordinal of this backend's GPU.
    pub fn ordinal(&self) -> usize {
        self.dev.ordinal
    }

    /// A view of the f32 values `[rows, cols]` at device address `ptr` as an activation.
    ///
    /// # Safety
    /// `ptr` addresses `rows·cols` f32 values on this backend's GPU that stay allocated,
    /// and are written by no other work, while the view and the kernels reading it live.
    pub unsafe fn borrow_act(&self, ptr: u64, rows: usize, cols: usize) -> CudaAct {
        self.act(
            DevBuf::borrowed(&self.dev.stream, ptr, rows * cols),
            rows,
            cols,
        )
    }

    /// [`CudaBackend::borrow_act`] with its values rounded to bf16 at `bf16_ptr` (the
    /// companion a GEMM reads instead of converting `ptr`'s values itself).
    ///
    /// # Safety
    /// As [`CudaBackend::borrow_act`], for both; the bf16 values are exactly `bf16(x)`.
    pub unsafe fn borrow_act_with_bf16(
        &self,
        ptr: u64,
        bf16_ptr: u64,
        rows: usize,
        cols: usize,
    ) -> CudaAct {
        let bf16 = DevBuf::borrowed(&self.dev.stream, bf16_ptr, rows * cols);
        self.act_with_bf16(
            DevBuf::borrowed(&self.dev.stream, ptr, rows * cols),
            rows,
            cols,
            Some(bf16),
        )
    }

    /// A view of the bf16 weight `[n, k]` at device address `ptr`.
    ///
    /// # Safety
    /// As [`CudaBackend::borrow_act`], for `n·k` bf16 values.
    pub unsafe fn borrow_mat(&self, ptr: u64, n: usize, k: usize) -> CudaMat {
        CudaMat {
            buf: DevBuf::borrowed(&self.dev.stream, ptr, n * k),
            n,
            k,
        }
    }

    /// Copies `a` into the `rows·cols` f32 values at device address `dst`, on arbor's
    /// stream.
    ///
    /// # Safety
    /// `dst` addresses that many f32 values on this GPU, allocated and used by no other
    /// work until the copy has run (order the owner's stream after it with
    /// [`CudaBackend::release_to_stream`]).
    pub unsafe fn copy_act_to(&self, a: &CudaAct, dst: u64) -> BResult<()> {
        let n = a.rows * a.cols;
        if n == 0 {
            return Ok(());
        }
        let mut out = DevBuf::<f32>::borrowed(&self.dev.stream, dst, n);
        self.dev
            .stream
            .memcpy_dtod(&*a.buf, &mut *out)
            .map_err(|e| self.dev_err_msg("copying an activation out", e))
    }

    /// Work queued on arbor's stream from now on runs after the work queued so far on the
    /// stream `foreign` (a raw `CUstream`, e.g. `torch.cuda.current_stream().cuda_stream`).
    pub fn wait_for_stream(&self, foreign: u64) -> BResult<()> {
        let ev = self
            .dev
            .ctx
            .new_event(None)
            .map_err(|e| self.dev_err_msg("creating an event", e))?;
        // SAFETY: `ev` is a live event of this context; `foreign` is a stream handle of the
        // same context, valid for the caller's call.
        unsafe { sys::cuEventRecord(ev.cu_event(), foreign as sys::CUstream) }
            .result()
            .map_err(|e| self.dev_err_msg("recording an event on the caller's stream", e))?;
        self.dev
            .stream
            .wait(&ev)
            .map_err(|e| self.dev_err_msg("waiting for the caller's stream", e))
    }

    /// Work queued on the stream `foreign` from now on runs after the work queued so far
    /// on arbor's stream (so the owner may free or rewrite the memory it lent).
    pub fn release_to_stream(&self, foreign: u64) -> BResult<()> {
        let ev = self
            .dev
            .stream
            .record_event(None)
            .map_err(|e| self.dev_err_msg("recording an event", e))?;
        // SAFETY: as in `wait_for_stream`; a destroyed event's pending waits still hold.
        unsafe { sys::cuStreamWaitEvent(foreign as sys::CUstream, ev.cu_event(), 0) }
            .result()
            .map_err(|e| self.dev_err_msg("making the caller's stream wait", e))
    }
}
