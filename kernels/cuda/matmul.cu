// Tree matmul: out = bf16(x) · wᵀ reduced over K in the 8-segment tree.
//
// Pass 1 (tree_matmul_leaf) computes every segment's leaf sum into part[seg][row][col];
// pass 2 (tree_combine) folds the segments with the fixed tree. The leaf of one output
// element is done by one warp: lane l sums the chunks l, l+32, l+64, ... of 8 consecutive
// columns of the segment (columns in increasing order inside a chunk, one explicit fma
// each), then the warp's butterfly sum. That order depends on the segment's data alone:
// not on M (rows are walked in tiles, each row's arithmetic unchanged), not on N or on
// which rank holds the segment.

#define MM_ROWS 8
#define MM_CHUNK 8

extern "C" __global__ void f32_to_bf16_kernel(const float* __restrict__ x, bf16_t* __restrict__ y, long long count) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) y[i] = f32_to_bf16(x[i]);
}

// grid: (ceil(n / warps_per_block), n_seg, ceil(m / MM_ROWS)); block: warps_per_block * 32.
// vec != 0 when k and seg_len are multiples of 8, so full chunks are 16-byte aligned.
extern "C" __global__ void tree_matmul_leaf(
    const bf16_t* __restrict__ x, const bf16_t* __restrict__ w, float* __restrict__ part,
    int m, int n, int k, int seg_len, int vec)
{
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int col = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int seg = blockIdx.y;
    const int r0 = blockIdx.z * MM_ROWS;
    if (col >= n) return;
    const int s0 = min(seg * seg_len, k);
    const int s1 = min(s0 + seg_len, k);
    const bf16_t* wr = w + (size_t)col * k;

    float acc[MM_ROWS];
#pragma unroll
    for (int r = 0; r < MM_ROWS; ++r) acc[r] = 0.0f;

    for (int c = s0 + lane * MM_CHUNK; c < s1; c += WARP * MM_CHUNK) {
        float wv[MM_CHUNK];
        const bool full = c + MM_CHUNK <= s1;
        if (vec && full) {
            uint4 raw = *reinterpret_cast<const uint4*>(wr + c);
            const bf16_t* h = reinterpret_cast<const bf16_t*>(&raw);
#pragma unroll
            for (int j = 0; j < MM_CHUNK; ++j) wv[j] = bf16_to_f32(h[j]);
        } else {
#pragma unroll
            for (int j = 0; j < MM_CHUNK; ++j) wv[j] = (c + j < s1) ? bf16_to_f32(wr[c + j]) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < MM_ROWS; ++r) {
            if (r0 + r < m) {
                const bf16_t* xr = x + (size_t)(r0 + r) * k;
                float xv[MM_CHUNK];
                if (vec && full) {
                    uint4 raw = *reinterpret_cast<const uint4*>(xr + c);
                    const bf16_t* h = reinterpret_cast<const bf16_t*>(&raw);
#pragma unroll
                    for (int j = 0; j < MM_CHUNK; ++j) xv[j] = bf16_to_f32(h[j]);
                } else {
#pragma unroll
                    for (int j = 0; j < MM_CHUNK; ++j) xv[j] = (c + j < s1) ? bf16_to_f32(xr[c + j]) : 0.0f;
                }
                // Columns past the segment end are skipped, never added as zeros: the
                // sequence of roundings is the same for a full and a partial chunk.
#pragma unroll
                for (int j = 0; j < MM_CHUNK; ++j) {
                    if (c + j < s1) acc[r] = __fmaf_rn(xv[j], wv[j], acc[r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MM_ROWS; ++r) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && r0 + r < m) part[((size_t)seg * m + (r0 + r)) * n + col] = s;
    }
}

// out[i] = tree over parts[p][i], p < n_parts (1, 2, 4 or 8). Used for a matmul's segments
// and for the ranks' subtree roots after an all-gather.
extern "C" __global__ void tree_combine(const float* __restrict__ parts, float* __restrict__ out, long long count, int n_parts) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float v[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) v[p] = (p < n_parts) ? parts[(size_t)p * count + i] : 0.0f;
    out[i] = tree8(v, n_parts);
}
