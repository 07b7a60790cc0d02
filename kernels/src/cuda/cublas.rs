//! cuBLAS as the fast, non-invariant GEMM: the baseline of `arbor bench gemm` and the
//! linear layers of `--numerics fast`. cuBLAS picks its kernel (and split-K) by shape, so
//! a row's bits depend on the batch: exactly what the invariant path avoids.

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::gemm::OutDtype;

/// cuBLAS's workspace: given to it up front, so that it allocates nothing while a step
/// is captured into a CUDA graph (cuBLAS's graph-capture guidance).
const WORKSPACE_BYTES: usize = 32 << 20;

/// A cuBLAS handle bound to one stream.
pub struct Blas {
    handle: blas_sys::cublasHandle_t,
    _workspace: CudaSlice<u8>,
}

// SAFETY: the handle is used from one thread at a time (the owner's `&self` calls are
// serialised by the stream's owner); cuBLAS handles may move between threads.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Blas {
    /// A handle whose work is queued on `stream`, with a workspace of its own.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, String> {
        let handle = blas::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?;
        // Owned by the struct from here, so a failure below destroys the handle.
        // SAFETY: cuBLAS uses the workspace as scratch; its contents do not matter.
        let workspace = match unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created above, destroyed once.
                let _ = unsafe { blas::destroy_handle(handle) };
                return Err(format!("allocating cuBLAS's workspace: {e:?}"));
            }
        };
        let b = Self {
            handle,
            _workspace: workspace,
        };
        // SAFETY: a fresh handle and a live stream.
        unsafe { blas::set_stream(handle, stream.cu_stream() as blas_sys::cudaStream_t) }
            .map_err(|e| format!("cublasSetStream: {e:?}"))?;
        let ptr = b._workspace.device_ptr(stream).0;
        // SAFETY: the workspace lives as long as the handle (both owned by `b`).
        let status =
            unsafe { blas_sys::cublasSetWorkspace_v2(handle, ptr as *mut _, WORKSPACE_BYTES) };
        if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(format!("cublasSetWorkspace: {status:?}"));
        }
        Ok(b)
    }

    /// Row-major `Y[m,n] = X[m,k]·W[n,k]ᵀ` with bf16 X and W, f32 accumulation.
    ///
    /// # Safety
    /// `x`, `w` and `y` must be live device allocations of at least `m·k`, `n·k` (bf16) and
    /// `m·n` elements of `out`'s type, on this handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        x: CUdeviceptr,
        w: CUdeviceptr,
        y: CUdeviceptr,
        out: OutDtype,
    ) -> Result<(), String> {
        let alpha = 1.0f32;
        let beta = 0.0f32;
        let c_type = match out {
            OutDtype::F32 => blas_sys::cudaDataType::CUDA_R_32F,
            OutDtype::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
        };
        let dim =
            |v: usize| i32::try_from(v).map_err(|_| format!("cuBLAS dimension {v} exceeds i32"));
        // Column-major, this is Yᵀ = W·Xᵀ with W transposed.
        blas::gemm_ex(
            self.handle,
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            dim(n)?,
            dim(m)?,
            dim(k)?,
            &alpha as *const f32 as *const _,
            w as *const _,
            blas_sys::cudaDataType::CUDA_R_16BF,
            dim(k)?,
            x as *const _,
            blas_sys::cudaDataType::CUDA_R_16BF,
            dim(k)?,
            &beta as *const f32 as *const _,
            y as *mut _,
            c_type,
            dim(n)?,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| format!("cublasGemmEx m={m} n={n} k={k}: {e:?}"))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `Blas::new` and is destroyed once.
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }
}
