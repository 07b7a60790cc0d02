// Rotary embedding, HF rotate_half convention, from the host RopeTable (f64-computed,
// stored f32): for i < half, (x1, x2) = (x[i], x[i+half]) →
// (x1·cos − x2·sin, x2·cos + x1·sin). Dimensions past 2·half are left unrotated.

// The rotation of one pair; both kernels use it, so their bits are the same.
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, float* y1, float* y2) {
    *y1 = x1 * c - x2 * s;
    *y2 = x2 * c + x1 * s;
}

extern "C" __global__ void rope_kernel(float* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                       const unsigned int* __restrict__ row_pos, int rows, int n_heads, int head_dim, int half) {
    pdl_enter();
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
    rope_rotate(x1, x2, c, s, &xh[j], &xh[j + half]);
}

// The fused q/k/v output [rows, (n_heads + 2·n_kv)·head_dim] (q, k, v column blocks) →
// q rotated into q_out [rows, n_heads·head_dim], k rotated and v as they are into the
// bf16 cache at the row's (slot, position). Each value goes through rope_kernel's and
// kv_write_kernel's arithmetic (the split is a copy), so the bits are theirs; one launch
// instead of four. Needs 2·half == head_dim. One thread per (row, head, i < half).
extern "C" __global__ void qkv_rope_kv_kernel(const float* __restrict__ qkv, float* __restrict__ q_out,
                                              bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                              const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                              const unsigned int* __restrict__ row_slot, const unsigned int* __restrict__ row_pos,
                                              int rows, int n_heads, int n_kv, int head_dim, int half,
                                              int layer, int slots, int max_len) {
    pdl_enter();
    const int heads = n_heads + 2 * n_kv;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * heads * half) return;
    const int j = (int)(i % half);
    const long long rh = i / half;
    const int h = (int)(rh % heads);
    const int r = (int)(rh / heads);
    const float* src = qkv + ((size_t)r * heads + h) * head_dim;
    const float x1 = src[j];
    const float x2 = src[j + half];
    const int width = n_kv * head_dim;
    const size_t cache_row =
        (((size_t)layer * slots + row_slot[r]) * max_len + row_pos[r]) * width;
    if (h >= n_heads + n_kv) {
        bf16_t* dst = vc + cache_row + (size_t)(h - n_heads - n_kv) * head_dim;
        dst[j] = f32_to_bf16(x1);
        dst[j + half] = f32_to_bf16(x2);
        return;
    }
    const size_t t = (size_t)row_pos[r] * half + j;
    const float c = cos_t[t];
    const float s = sin_t[t];
    float y1, y2;
    rope_rotate(x1, x2, c, s, &y1, &y2);
    if (h < n_heads) {
        float* dst = q_out + ((size_t)r * n_heads + h) * head_dim;
        dst[j] = y1;
        dst[j + half] = y2;
    } else {
        bf16_t* dst = kc + cache_row + (size_t)(h - n_heads) * head_dim;
        dst[j] = f32_to_bf16(y1);
        dst[j + half] = f32_to_bf16(y2);
    }
}

// qkv_rope_kv_kernel with 4 consecutive i per thread (16-byte loads of the q/k/v values and
// the tables, 16-byte q and 8-byte cache stores), for half % 4 == 0: each value's
// arithmetic is the same, so are the bits; a quarter of the threads and of the 64-bit
// index divisions. One thread per (row, head, 4 consecutive i < half).
extern "C" __global__ void qkv_rope_kv4_kernel(const float* __restrict__ qkv, float* __restrict__ q_out,
                                               bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                               const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                               const unsigned int* __restrict__ row_slot, const unsigned int* __restrict__ row_pos,
                                               int rows, int n_heads, int n_kv, int head_dim, int half,
                                               int layer, int slots, int max_len) {
    pdl_enter();
    const int heads = n_heads + 2 * n_kv;
    const int quarter = half >> 2;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * heads * quarter) return;
    const int j = (int)(i % quarter) * 4;
    const long long rh = i / quarter;
    const int h = (int)(rh % heads);
    const int r = (int)(rh / heads);
    const float* src = qkv + ((size_t)r * heads + h) * head_dim;
    const float4 a = *reinterpret_cast<const float4*>(src + j);
    const float4 b = *reinterpret_cast<const float4*>(src + j + half);
    const float x1[4] = {a.x, a.y, a.z, a.w};
    const float x2[4] = {b.x, b.y, b.z, b.w};
    const int width = n_kv * head_dim;
    const size_t cache_row =
        (((size_t)layer * slots + row_slot[r]) * max_len + row_pos[r]) * width;
    auto store_bf16x4 = [](bf16_t* dst, const float* v) {
        const unsigned int lo = (unsigned int)f32_to_bf16(v[0]) | ((unsigned int)f32_to_bf16(v[1]) << 16);
        const unsigned int hi = (unsigned int)f32_to_bf16(v[2]) | ((unsigned int)f32_to_bf16(v[3]) << 16);
        *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
    };
    if (h >= n_heads + n_kv) {
        bf16_t* dst = vc + cache_row + (size_t)(h - n_heads - n_kv) * head_dim;
        store_bf16x4(dst + j, x1);
        store_bf16x4(dst + j + half, x2);
        return;
    }
    const size_t t = (size_t)row_pos[r] * half + j;
    const float4 c4 = *reinterpret_cast<const float4*>(cos_t + t);
    const float4 s4 = *reinterpret_cast<const float4*>(sin_t + t);
    const float c[4] = {c4.x, c4.y, c4.z, c4.w};
    const float s[4] = {s4.x, s4.y, s4.z, s4.w};
    float y1[4], y2[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) rope_rotate(x1[e], x2[e], c[e], s[e], &y1[e], &y2[e]);
    if (h < n_heads) {
        float* dst = q_out + ((size_t)r * n_heads + h) * head_dim;
        *reinterpret_cast<float4*>(dst + j) = make_float4(y1[0], y1[1], y1[2], y1[3]);
        *reinterpret_cast<float4*>(dst + j + half) = make_float4(y2[0], y2[1], y2[2], y2[3]);
    } else {
        bf16_t* dst = kc + cache_row + (size_t)(h - n_heads) * head_dim;
        store_bf16x4(dst + j, y1);
        store_bf16x4(dst + j + half, y2);
    }
}
