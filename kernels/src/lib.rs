//! arbor's kernels. `tree` fixes the reduction order every backend follows; `cpu` is the
//! reference backend (bf16 storage, f32 accumulation); `cuda` holds the GPU kernels,
//! compiled by NVRTC at start.

pub mod cpu;
pub mod cuda;
pub mod paged;
pub mod tree;

pub use tree::{SegmentLayout, SEGMENTS};
