// L2 prefetch of a weight that a later GEMM reads: issued where the step's kernels leave
// HBM idle (RoPE, attention, norms at small batches), so that the GEMM finds part of its
// weight in L2. Only time changes: nothing is written.
//
// The weight is `rows` rows of `row_bytes`, each cut into `chunks` chunks of `chunk_bytes`
// (a row's tree segments); the first `head` bytes of every chunk are fetched (a multiple
// of 16, as the bulk prefetch needs), none past `limit` bytes from `base`. Heads of every
// segment rather than whole rows keep the GEMM's blocks, which each stream their own
// segments, equally served.
//
// It waits for the previous grid before it exits but not before it issues: the weight is
// constant, and the kernel after it (launched with PDL once this one triggers) may rely on
// this grid's completion implying the previous one's, as in every `pdl_enter()` kernel.
extern "C" __global__ void l2_prefetch_kernel(const unsigned char* __restrict__ base, long long rows,
                                              long long row_bytes, int chunks, long long chunk_bytes,
                                              int head, long long limit) {
    const long long total = rows * chunks;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long r = i / chunks;
        const long long at = r * row_bytes + (i - r * chunks) * chunk_bytes;
        const long long left = limit - at;
        const int bytes = left < head ? (int)left : head;
        if (bytes <= 0) continue;
        const unsigned char* p = base + at;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#else
        for (int o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + o));
#endif
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
