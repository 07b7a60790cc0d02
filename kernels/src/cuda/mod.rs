//! CUDA kernels: sources under `kernels/cuda/`, compiled by NVRTC once per process for the
//! device's architecture. (Filled in by the CUDA backend work.)
