//! CUDA backend: device buffers, NVRTC kernels from `arbor_kernels::cuda`, and the GPU
//! collective. (Filled in by the CUDA backend work.)
