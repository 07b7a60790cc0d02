//! The GPU collective's error; the NCCL transport reports through it too.

/// Errors of the GPU collective; each names the rank and what failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("GPU collective unavailable: {0}")]
    Unavailable(String),
    #[error("CUDA error on rank {rank}: {msg}")]
    Cuda { rank: usize, msg: String },
    #[error("NCCL error on rank {rank}: {msg}")]
    Nccl { rank: usize, msg: String },
    #[error("host collective error on rank {rank}: {msg}")]
    Host { rank: usize, msg: String },
    #[error("compiling the all-reduce kernels failed: {0}")]
    Compile(String),
    #[error("invalid all-reduce call on rank {rank}: {msg}")]
    Invalid { rank: usize, msg: String },
    #[error("NVLS refused: {0}")]
    NvlsRefused(String),
    #[error("not implemented: {0}")]
    NotImplemented(String),
}
