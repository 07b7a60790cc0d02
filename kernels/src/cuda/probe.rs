//! Checks that the CUDA libraries can be opened before cudarc touches them (its dynamic
//! loader panics on a missing library or symbol).

use super::CudaError;

/// Whether libcuda can be loaded and reports at least one device.
pub fn driver() -> Result<usize, CudaError> {
    // SAFETY: only tries to dlopen the library names cudarc would use.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver(
            "libcuda.so could not be loaded (no NVIDIA driver on this machine?)".into(),
        ));
    }
    let count = std::panic::catch_unwind(cudarc::driver::CudaContext::device_count)
        .map_err(|p| {
            CudaError::NoDriver(format!(
                "the driver library is unusable: {}",
                panic_text(&p)
            ))
        })?
        .map_err(|e| CudaError::NoDriver(format!("cuInit/cuDeviceGetCount failed: {e}")))?;
    if count <= 0 {
        return Err(CudaError::NoDriver(
            "the driver reports no CUDA device".into(),
        ));
    }
    Ok(count as usize)
}

/// Whether libnvrtc can be loaded.
pub fn nvrtc() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the library names cudarc would use.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NoNvrtc(
            "libnvrtc.so is not on the loader path (set LD_LIBRARY_PATH)".into(),
        ))
    }
}

/// `auto` device selection: true when a CUDA device is usable.
pub fn gpu_present() -> bool {
    driver().is_ok()
}

pub(crate) fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic without a message".into()
    }
}
