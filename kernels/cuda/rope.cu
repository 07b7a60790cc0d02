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

// PER (1 or 4) consecutive f32 at p: one 16-byte access for 4 (p 16-byte aligned).
template <int PER>
__device__ __forceinline__ void load_f32s(const float* p, float* v) {
    if (PER == 4) {
        const float4 a = *reinterpret_cast<const float4*>(p);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    } else {
        v[0] = p[0];
    }
}
template <int PER>
__device__ __forceinline__ void store_f32s(float* p, const float* v) {
    if (PER == 4)
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    else
        p[0] = v[0];
}
template <int PER>
__device__ __forceinline__ void store_bf16s(bf16_t* p, const float* v) {
    if (PER == 4) {
        const unsigned int lo = (unsigned int)f32_to_bf16(v[0]) | ((unsigned int)f32_to_bf16(v[1]) << 16);
        const unsigned int hi = (unsigned int)f32_to_bf16(v[2]) | ((unsigned int)f32_to_bf16(v[3]) << 16);
        *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
    } else {
        p[0] = f32_to_bf16(v[0]);
    }
}

// The fused q/k/v output [rows, (n_heads + 2·n_kv)·head_dim] (q, k, v column blocks) →
// q rotated into q_out [rows, n_heads·head_dim], k rotated and v as they are into the
// paged bf16 cache at the row's position, in the block its table names (kv_row_at). Each value goes through rope_kernel's and
// kv_write_kernel's arithmetic (the split is a copy), so the bits are theirs; one launch
// instead of four. Needs 2·half == head_dim. One thread per (row, head, PER consecutive
// i < half): PER = 4 (half % 4 == 0) makes every access 16 or 8 bytes, a quarter of the
// threads and of their 64-bit index divisions, with each value's arithmetic unchanged.
#define QKV_ROPE_ARGS                                                                                  \
    const float* __restrict__ qkv, float* __restrict__ q_out, bf16_t* __restrict__ kc,                  \
        bf16_t* __restrict__ vc, const float* __restrict__ cos_t, const float* __restrict__ sin_t,     \
        const unsigned int* __restrict__ row_pos, const unsigned int* __restrict__ row_toff,           \
        const unsigned int* __restrict__ table, int rows, int n_heads, int n_kv, int head_dim, int half, \
        int layer, int blocks
template <int PER>
__device__ __forceinline__ void qkv_rope_kv_body(QKV_ROPE_ARGS) {
    const int heads = n_heads + 2 * n_kv;
    const int units = half / PER;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * heads * units) return;
    const int j = (int)(i % units) * PER;
    const long long rh = i / units;
    const int h = (int)(rh % heads);
    const int r = (int)(rh / heads);
    // Before the PDL wait: the row's position, its cache row (positions and block tables
    // are the step's inputs, uploaded before its first kernel and written by none) and the
    // rotation (constant tables), so their dependent loads run while the q/k/v GEMM ends.
    const size_t head_stride = (size_t)KV_BLOCK * head_dim;
    const bool is_v = h >= n_heads + n_kv, is_q = h < n_heads;
    size_t cache_row = 0;
    if (!is_q) cache_row = kv_row_at(table, row_toff[r], row_pos[r], layer, blocks, n_kv, head_dim);
    float c[PER], s[PER];
    if (!is_v) {
        const size_t t = (size_t)row_pos[r] * half + j;
        load_f32s<PER>(cos_t + t, c);
        load_f32s<PER>(sin_t + t, s);
    }
    pdl_enter();
    const float* src = qkv + ((size_t)r * heads + h) * head_dim;
    float x1[PER], x2[PER];
    load_f32s<PER>(src + j, x1);
    load_f32s<PER>(src + j + half, x2);
    if (is_v) {
        bf16_t* dst = vc + cache_row + (size_t)(h - n_heads - n_kv) * head_stride;
        store_bf16s<PER>(dst + j, x1);
        store_bf16s<PER>(dst + j + half, x2);
        return;
    }
    float y1[PER], y2[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) rope_rotate(x1[e], x2[e], c[e], s[e], &y1[e], &y2[e]);
    if (is_q) {
        float* dst = q_out + ((size_t)r * n_heads + h) * head_dim;
        store_f32s<PER>(dst + j, y1);
        store_f32s<PER>(dst + j + half, y2);
    } else {
        bf16_t* dst = kc + cache_row + (size_t)(h - n_heads) * head_stride;
        store_bf16s<PER>(dst + j, y1);
        store_bf16s<PER>(dst + j + half, y2);
    }
}

#define QKV_ROPE_PASS qkv, q_out, kc, vc, cos_t, sin_t, row_pos, row_toff, table, rows, n_heads, n_kv, head_dim, half, layer, blocks
// The bodies call pdl_enter() themselves, after their step-input prologue.
extern "C" __global__ void qkv_rope_kv_kernel(QKV_ROPE_ARGS) {
    qkv_rope_kv_body<1>(QKV_ROPE_PASS);
}
extern "C" __global__ void qkv_rope_kv4_kernel(QKV_ROPE_ARGS) {
    qkv_rope_kv_body<4>(QKV_ROPE_PASS);
}
