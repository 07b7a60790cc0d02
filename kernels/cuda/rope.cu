// Rotary embedding, HF rotate_half convention, from the host RopeTable (f64-computed,
// stored f32): for i < half, (x1, x2) = (x[i], x[i+half]) →
// (x1·cos − x2·sin, x2·cos + x1·sin). Dimensions past 2·half are left unrotated.

extern "C" __global__ void rope_kernel(float* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                       const unsigned int* __restrict__ row_pos, int rows, int n_heads, int head_dim, int half) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * n_heads * half) return;
    const int j = (int)(i % half);
    const long long rh = i / half;
    const int h = (int)(rh % n_heads);
    const int r = (int)(rh / n_heads);
    const size_t t = (size_t)row_pos[r] * half + j;
    const float c = cos_t[t];
    const float s = sin_t[t];
    float* xh = x + ((size_t)r * n_heads + h) * head_dim;
    const float x1 = xh[j];
    const float x2 = xh[j + half];
    xh[j] = x1 * c - x2 * s;
    xh[j + half] = x2 * c + x1 * s;
}
