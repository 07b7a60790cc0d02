// RMSNorm, one block of NORM_THREADS per row: thread t sums x[c]² over c = t, t+256, ...
// in order, then a fixed shared-memory tree. The block size is a constant, so a row's
// bits never depend on the number of rows.

#define NORM_THREADS 256

extern "C" __global__ void rms_norm_kernel(const float* __restrict__ x, const float* __restrict__ weight,
                                           float* __restrict__ out, int cols, float eps) {
    __shared__ float sh[NORM_THREADS];
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    const float* xr = x + (size_t)row * cols;
    float acc = 0.0f;
    for (int c = t; c < cols; c += NORM_THREADS) acc = __fmaf_rn(xr[c], xr[c], acc);
    sh[t] = acc;
    __syncthreads();
    for (int s = NORM_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] = sh[t] + sh[t + s];
        __syncthreads();
    }
    const float inv = 1.0f / sqrtf(sh[0] / (float)cols + eps);
    float* o = out + (size_t)row * cols;
    for (int c = t; c < cols; c += NORM_THREADS) o[c] = (xr[c] * inv) * weight[c];
}
