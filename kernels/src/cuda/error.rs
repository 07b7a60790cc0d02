/// Errors of the CUDA layer; each names the device, kernel or value that was wrong.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no usable CUDA driver: {0}")]
    NoDriver(String),
    #[error("NVRTC (libnvrtc) cannot be loaded: {0}")]
    NoNvrtc(String),
    /// The driver works but has no device of this ordinal.
    #[error(
        "CUDA device {ordinal} requested but {visible} CUDA device(s) are visible \
         (CUDA_VISIBLE_DEVICES={cuda_visible_devices})"
    )]
    NoSuchDevice {
        ordinal: usize,
        visible: usize,
        cuda_visible_devices: String,
    },
    #[error("CUDA device {ordinal}: {what}: {source}")]
    Driver {
        ordinal: usize,
        what: String,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error("NVRTC compile of arbor's kernels for {arch} failed:\n{log}")]
    Compile { arch: String, log: String },
    #[error("kernel {kernel}: {msg}")]
    Launch { kernel: &'static str, msg: String },
}
