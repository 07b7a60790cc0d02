//! Whether a usable CUDA driver is there, asked before anything touches it.

use cudarc::driver::{sys as dsys, CudaContext};

use super::error::GpuError;

/// Checks that libcuda loads and reports a device, without letting cudarc panic.
pub fn probe_driver() -> Result<usize, GpuError> {
    // SAFETY: only tries to dlopen the library names cudarc would use.
    if !unsafe { dsys::is_culib_present() } {
        return Err(GpuError::Unavailable(
            "libcuda.so could not be loaded (no NVIDIA driver on this machine)".into(),
        ));
    }
    let count = std::panic::catch_unwind(CudaContext::device_count)
        .map_err(|_| {
            GpuError::Unavailable("libcuda is unusable (cudarc panicked loading it)".into())
        })?
        .map_err(|e| GpuError::Unavailable(format!("cuInit / cuDeviceGetCount failed: {e:?}")))?;
    if count <= 0 {
        return Err(GpuError::Unavailable(
            "the driver reports no CUDA device".into(),
        ));
    }
    Ok(count as usize)
}
