// Causal GQA attention over the bf16 KV cache, one warp per (query row, head).
//
// Keys come in blocks of ATTN_BLOCK = 32 aligned at position 0, walked in key order with
// the online softmax. In a block, lane j owns key j: its score is a sequential dot product
// over head_dim (q from shared memory, one explicit fma per dimension) times scale. Keys
// past the query's position are skipped (never multiplied by zero), so a query sees the
// same operations whether later keys exist (prefill) or not (decode): one code path.
// Per block: m' = max(m, block max), corr = exp(m − m'), l = l·corr + Σ_j p_j (butterfly),
// acc[d] = acc[d]·corr then + p_j·v_j[d] for j in key order (lane l owns d = l, l+32, ...).

#define ATTN_BLOCK 32
#define ATTN_WARPS 4
#define ATTN_MAX_HEAD_DIM 256
#define ATTN_DPL (ATTN_MAX_HEAD_DIM / WARP)

// grid: (rows, ceil(n_heads / ATTN_WARPS)); block: ATTN_WARPS * 32.
extern "C" __global__ void attention_kernel(
    const float* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
    float* __restrict__ out, const unsigned int* __restrict__ row_slot, const unsigned int* __restrict__ row_pos,
    int n_heads, int n_kv_heads, int head_dim, float scale, int layer, int slots, int max_len)
{
    __shared__ float sq[ATTN_WARPS][ATTN_MAX_HEAD_DIM];
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
    const int row = blockIdx.x;
    const int h = blockIdx.y * ATTN_WARPS + wid;
    if (h >= n_heads) return;  // whole warp leaves together; no block-wide barrier below
    const int kvh = h / (n_heads / n_kv_heads);
    const int width = n_kv_heads * head_dim;
    const float* qh = q + ((size_t)row * n_heads + h) * head_dim;
    for (int d = lane; d < head_dim; d += WARP) sq[wid][d] = qh[d];
    __syncwarp();

    const int pos = (int)row_pos[row];
    const size_t base = ((size_t)layer * slots + row_slot[row]) * max_len;
    float m = NEG_INF;
    float l = 0.0f;
    float acc[ATTN_DPL];
#pragma unroll
    for (int i = 0; i < ATTN_DPL; ++i) acc[i] = 0.0f;

    for (int b0 = 0; b0 <= pos; b0 += ATTN_BLOCK) {
        const int nvalid = min(ATTN_BLOCK, pos + 1 - b0);
        float s = NEG_INF;
        if (lane < nvalid) {
            const bf16_t* kr = kc + (base + b0 + lane) * width + (size_t)kvh * head_dim;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; ++d) dot = __fmaf_rn(sq[wid][d], bf16_to_f32(kr[d]), dot);
            s = dot * scale;
        }
        const float m_new = fmaxf(m, warp_max(s));
        const float corr = expf(m - m_new);
        const float p = (lane < nvalid) ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < ATTN_DPL; ++i) acc[i] = acc[i] * corr;
        for (int j = 0; j < nvalid; ++j) {
            const float pj = __shfl_sync(FULL_MASK, p, j);
            const bf16_t* vr = vc + (base + b0 + j) * width + (size_t)kvh * head_dim;
#pragma unroll
            for (int i = 0; i < ATTN_DPL; ++i) {
                const int d = lane + i * WARP;
                if (d < head_dim) acc[i] = __fmaf_rn(pj, bf16_to_f32(vr[d]), acc[i]);
            }
        }
        m = m_new;
    }
    float* o = out + ((size_t)row * n_heads + h) * head_dim;
#pragma unroll
    for (int i = 0; i < ATTN_DPL; ++i) {
        const int d = lane + i * WARP;
        if (d < head_dim) o[d] = acc[i] / l;
    }
}
