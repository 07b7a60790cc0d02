//! The GEMM's error: each names the value or library that was wrong.

use cudarc::driver::DriverError;

use crate::cpu::matmul::TreeMatmul;

/// Errors of the GEMM; each names the value or library that was wrong.
#[derive(Debug, thiserror::Error)]
pub enum GemmError {
    #[error("no usable GPU: {0}")]
    NoGpu(String),
    #[error("NVRTC compile of gemm_tree.cu for {arch} failed:\n{log}")]
    Compile { arch: String, log: String },
    #[error("CUDA driver call '{what}' failed: {source}")]
    Driver {
        what: String,
        #[source]
        source: DriverError,
    },
    #[error("tree GEMM shape {shape:?}: {msg}")]
    Shape { shape: TreeMatmul, msg: String },
    #[error("{var}={value:?}: {msg}")]
    Env {
        var: &'static str,
        value: String,
        msg: &'static str,
    },
}

/// Maps a driver error to [`GemmError::Driver`] naming the call.
pub(super) fn driver(what: &str) -> impl FnOnce(DriverError) -> GemmError + '_ {
    move |source| GemmError::Driver {
        what: what.to_string(),
        source,
    }
}
