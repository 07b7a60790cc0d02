// SiLU(g)·u, shared by both NVRTC programs: the element-wise kernel of the unfused MLP and
// the gate/up GEMM's fused epilogue evaluate one expression, so the two give the same bits.
__device__ __forceinline__ float silu_mul(float g, float u) { return (g / (1.0f + expf(-g))) * u; }
