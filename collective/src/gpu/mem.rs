//! Plain `cuMemAlloc` buffers. The registered IPC buffer must come from `cuMemAlloc`:
//! stream-ordered (pool) allocations, which cudarc uses when it can, cannot be exported
//! with `cuIpcGetMemHandle`.

use cudarc::driver::result as dres;

use super::GpuError;

/// Owns `bytes` of device memory on the context current when it was made.
#[derive(Debug)]
pub struct DeviceBuf {
    ptr: u64,
    bytes: usize,
    rank: usize,
}

impl DeviceBuf {
    /// The caller has bound the device's context to this thread.
    pub fn alloc(bytes: usize, rank: usize) -> Result<Self, GpuError> {
        // SAFETY: plain allocation; a zero-byte request is rounded up so the pointer is real.
        let ptr = unsafe { dres::malloc_sync(bytes.max(256)) }.map_err(|e| GpuError::Cuda {
            rank,
            msg: format!("cuMemAlloc of {bytes} bytes: {e:?}"),
        })?;
        Ok(Self { ptr, bytes, rank })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc above and freed once.
        if let Err(e) = unsafe { dres::free_sync(self.ptr) } {
            tracing::warn!(
                rank = self.rank,
                "cuMemFree of {} bytes failed: {e:?}",
                self.bytes
            );
        }
    }
}
