//! CUDA kernels: sources under `kernels/cuda/`, compiled by NVRTC once per process for the
//! device's architecture (`sm_90a` on Hopper; the PTX kept on disk by [`ptx_cache`]),
//! loaded into one module per device, and launched through the typed wrappers of [`ops`].
//!
//! Every kernel keeps the CPU backend's promise on the GPU: each output element's sequence
//! of roundings is fixed by the source (NVRTC runs with `--fmad=false`; fused multiply-adds
//! are written out), never by the number of rows, the TP size or the launch shape. GPU and
//! CPU results agree within bf16 tolerance, not bit for bit.
//!
//! cudarc loads libcuda/libnvrtc at run time and panics when one is missing; [`probe`]
//! checks first, so a machine without a GPU gets an error that says so.

pub mod buf;
pub mod compile;
pub mod cublas;
pub mod device;
pub mod error;
pub mod gemm;
pub mod launch;
pub mod ops;
pub mod probe;
pub mod ptx_cache;
pub mod source;
pub mod staging;
pub mod upload_ring;

pub use buf::{DevBuf, Workspace, WorkspaceScope};
pub use compile::{arch_for, compile_ptx};
pub use device::GpuDevice;
pub use error::CudaError;
pub use ops::paged_attention;
pub use ops::{CutDest, CutSource, DevBf16, DevF32, DevU32, RowMeta, SourceType};

#[cfg(test)]
mod gpu_tests;
