// Programmatic dependent launch (kernels/src/cuda/launch.rs), shared by both NVRTC programs
// (the ops kernels and the GEMMs): wait until the previous grid has completed and its
// memory is visible, then let the next grid start launching. Every kernel launched with
// PDL calls it before it reads memory an earlier kernel writes and before its own first
// write, so memory effects keep the plain launch order and only launch latency and
// prologues overlap (a prologue may read what no kernel writes: weights, the step's
// uploaded inputs, constant tables).
// No-ops when the launch did not ask for PDL, and below sm_90.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
