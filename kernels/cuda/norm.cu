// RMSNorm, one block of NORM_THREADS per row: thread t sums x[c]² over c = t, t+256, ...
// in order, then a fixed shared-memory tree. The block size is a constant, so a row's
// bits never depend on the number of rows.

#define NORM_THREADS 256

// The part both norm kernels share: thread t's partial sum of squares `acc` (over columns
// t, t+256, ... of the block's row xr) through the fixed tree, then the scaled output.
// outb (may be null): the output rounded to bf16 as well, for a GEMM that reads it (the
// rounding the GEMM would do itself, without a pass of its own).
__device__ __forceinline__ void rms_norm_finish(float acc, const float* __restrict__ xr,
                                                const float* __restrict__ weight, float* __restrict__ out,
                                                bf16_t* __restrict__ outb, int cols, float eps) {
    __shared__ float sh[NORM_THREADS];
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    sh[t] = acc;
    __syncthreads();
    for (int s = NORM_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] = sh[t] + sh[t + s];
        __syncthreads();
    }
    const float inv = 1.0f / sqrtf(sh[0] / (float)cols + eps);
    float* o = out + (size_t)row * cols;
    bf16_t* ob = outb ? outb + (size_t)row * cols : nullptr;
    for (int c = t; c < cols; c += NORM_THREADS) {
        const float v = (xr[c] * inv) * weight[c];
        o[c] = v;
        if (ob) ob[c] = f32_to_bf16(v);
    }
}

extern "C" __global__ void rms_norm_kernel(const float* __restrict__ x, const float* __restrict__ weight,
                                           float* __restrict__ out, bf16_t* __restrict__ outb, int cols, float eps) {
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    const float* xr = x + (size_t)row * cols;
    float acc = 0.0f;
    for (int c = t; c < cols; c += NORM_THREADS) acc = __fmaf_rn(xr[c], xr[c], acc);
    rms_norm_finish(acc, xr, weight, out, outb, cols, eps);
}

// x += y, then RMSNorm of the sum: the residual add and the next norm in one pass. Each
// element's add is the add_assign_kernel's, and the norm's reduction is rms_norm_kernel's
// (the same thread owns the same columns), so the bits are those of the two kernels.
extern "C" __global__ void add_rms_norm_kernel(float* __restrict__ x, const float* __restrict__ y,
                                               const float* __restrict__ weight, float* __restrict__ out,
                                               bf16_t* __restrict__ outb, int cols, float eps) {
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    float* xr = x + (size_t)row * cols;
    const float* yr = y + (size_t)row * cols;
    float acc = 0.0f;
    for (int c = t; c < cols; c += NORM_THREADS) {
        const float v = xr[c] + yr[c];
        xr[c] = v;
        acc = __fmaf_rn(v, v, acc);
    }
    rms_norm_finish(acc, xr, weight, out, outb, cols, eps);
}
