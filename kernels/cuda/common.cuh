// Shared helpers for arbor's kernels. Compiled by NVRTC with --fmad=false, so every
// multiply-add that is fused is fused explicitly (__fmaf_rn) and the rounding sequence of
// each output element is fixed by the source alone, never by the compiler's choices.
//
// bf16 is carried as its raw 16 bits (unsigned short): no CUDA headers are needed, and the
// host uploads half::bf16 bit patterns unchanged.

typedef unsigned short bf16_t;

#define WARP 32
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest, ties to even (as half::bf16::from_f32); NaN stays a quiet NaN.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Butterfly sum over the 32 lanes: a fixed pairing at every level, and since f32 addition
// is commutative every lane ends with the same bits.
__device__ __forceinline__ float warp_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 16);
    v += __shfl_xor_sync(FULL_MASK, v, 8);
    v += __shfl_xor_sync(FULL_MASK, v, 4);
    v += __shfl_xor_sync(FULL_MASK, v, 2);
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 16));
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 8));
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 4));
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return v;
}

// The fixed full binary tree of the invariance contract over n (1, 2, 4 or 8) values.
__device__ __forceinline__ float tree8(const float v[8], int n) {
    if (n == 1) return v[0];
    if (n == 2) return v[0] + v[1];
    if (n == 4) return (v[0] + v[1]) + (v[2] + v[3]);
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// The paged KV cache (arbor_kernels::paged): K and V pools of [layers, blocks, n_kv,
// KV_BLOCK, head_dim] bf16; position p of a sequence is row p % KV_BLOCK of block
// table[p / KV_BLOCK]. KV_BLOCK is paged_attention.cu's PA_BLOCK.
#define KV_BLOCK 64

// Index of the first value of (layer, the block of position `pos` in the row's table,
// KV head 0, the position's row): KV head h is KV_BLOCK · head_dim further per head.
__device__ __forceinline__ size_t kv_row_at(const unsigned int* __restrict__ table, unsigned int table_off,
                                            unsigned int pos, int layer, int blocks, int n_kv, int head_dim) {
    const unsigned int block = table[table_off + pos / KV_BLOCK];
    return ((((size_t)layer * blocks + block) * n_kv) * KV_BLOCK + pos % KV_BLOCK) * (size_t)head_dim;
}

