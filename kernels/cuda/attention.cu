// Causal GQA attention over the bf16 KV cache. One block per (query row, KV head, group of
// up to `gsz` ≤ ATTN_GROUP of that KV head's query heads), ATTN_WARPS warps (or fewer:
// the states below are the numerics, not the warps that run them). The host picks
// gsz: ATTN_GROUP (heads share each key and value load) when there are rows enough to fill
// the GPU, 1 for a few rows (four times the blocks, a quarter of the work on each block's
// latency chain). A head's arithmetic is the same either way.
//
// The order of every reduction is a function of the query's position alone, never of the
// batch, the TP size or whether later keys exist (prefill and decode run this one path):
//
// - Keys come in chunks of ATTN_CHUNK = 32 aligned at position 0. Chunk c belongs to state
//   c mod ATTN_WARPS (run by one warp), which walks its chunks in increasing order with
//   the online softmax.
//   In a chunk, lane j owns key j: score = (sequential fma over head_dim of q·k) · scale.
//   Per chunk: m' = max(m, chunk max), corr = exp(m − m'), l = l·corr + Σ_j p_j (butterfly),
//   acc[d] = acc[d]·corr, then acc[d] = fma(p_j, v_j[d], acc[d]) for j in key order.
// - Then the states are combined in order w = 0 .. nw−1 (nw = the states that own at
//   least one chunk): M = max m_w, e_w = exp(m_w − M); L = l_0·e_0, then
//   L = fma(l_w, e_w, L) for w = 1, 2, ...; O[d] likewise from acc_w[d]; the output is O / L.
//
// The query heads of a group share each key and value load (GQA); a head's arithmetic
// does not depend on which other heads share its block. ATTN_CHUNK and ATTN_WARPS are
// part of the numerics: changing either changes bits.

#define ATTN_CHUNK 32
#define ATTN_WARPS 8
#define ATTN_GROUP 4
#define ATTN_MAX_HEAD_DIM 256

// DPL bf16 values at p (DPL·2-byte aligned) as f32, in one load.
template <int DPL>
__device__ __forceinline__ void load_bf16s(const bf16_t* p, float* out) {
    if (DPL == 8) {
        const uint4 r = *reinterpret_cast<const uint4*>(p);
        const unsigned int w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            out[2 * e] = __uint_as_float(w[e] << 16);
            out[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
        }
    } else if (DPL == 4) {
        const uint2 r = *reinterpret_cast<const uint2*>(p);
        out[0] = __uint_as_float(r.x << 16);
        out[1] = __uint_as_float(r.x & 0xffff0000u);
        out[2] = __uint_as_float(r.y << 16);
        out[3] = __uint_as_float(r.y & 0xffff0000u);
    } else if (DPL == 2) {
        const unsigned int r = *reinterpret_cast<const unsigned int*>(p);
        out[0] = __uint_as_float(r << 16);
        out[1] = __uint_as_float(r & 0xffff0000u);
    } else {
#pragma unroll
        for (int e = 0; e < DPL; ++e) out[e] = bf16_to_f32(p[e]);
    }
}

// HD: the head dimension when known at compile time (a multiple of 32: lane l owns the
// DPL = HD/32 consecutive dimensions from l·DPL, loaded as one vector), or 0: head_dim at
// run time (≤ ATTN_MAX_HEAD_DIM), lane l owning dimensions l, l+32, ... Only the loads
// differ; every value sees the same arithmetic in the same order.
template <int HD>
__device__ __forceinline__ void attention_body(
    const float* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
    float* __restrict__ out, bf16_t* __restrict__ outb, const unsigned int* __restrict__ row_slot,
    const unsigned int* __restrict__ row_pos, int n_heads, int n_kv_heads, int head_dim_rt, float scale,
    int layer, int slots, int max_len, int gsz)
{
    constexpr int DPL = HD > 0 ? HD / WARP : ATTN_MAX_HEAD_DIM / WARP;
    // Value rows loaded before their fmas: enough in flight to hide the latency, few
    // enough registers not to spill.
    constexpr int VB = DPL <= 4 ? 8 : 4;
    const int head_dim = HD > 0 ? HD : head_dim_rt;
    __shared__ float sq[ATTN_GROUP][ATTN_MAX_HEAD_DIM];
    extern __shared__ float part[];  // [ATTN_WARPS][ATTN_GROUP][head_dim + 2]: acc, m, l
    const int lane = threadIdx.x & 31;
    const int wid = threadIdx.x >> 5;
    const int row = blockIdx.x;
    const int group = n_heads / n_kv_heads;
    const int subs = (group + gsz - 1) / gsz;
    const int kvh = blockIdx.y / subs;
    const int h0 = kvh * group + (blockIdx.y % subs) * gsz;
    const int nh = min(gsz, kvh * group + group - h0);
    const int width = n_kv_heads * head_dim;
    // The dimension of this lane's i-th accumulator.
    auto dim = [&](int i) { return HD > 0 ? lane * DPL + i : lane + i * WARP; };

    // The row's metadata before the barrier: its loads overlap the query's.
    const int pos = (int)row_pos[row];
    const size_t base = ((size_t)layer * slots + row_slot[row]) * max_len;
    for (int t = threadIdx.x; t < nh * head_dim; t += blockDim.x) {
        const int g = t / head_dim, d = t % head_dim;
        sq[g][d] = q[((size_t)row * n_heads + h0 + g) * head_dim + d];
    }
    __syncthreads();

    const bf16_t* kbase = kc + base * width + (size_t)kvh * head_dim;
    const bf16_t* vbase = vc + base * width + (size_t)kvh * head_dim;
    const int n_chunks = pos / ATTN_CHUNK + 1;
    const bool vec = HD > 0 || ((head_dim & 7) == 0 && (width & 7) == 0);

    // State s (chunks c ≡ s mod ATTN_WARPS) runs on warp s mod the block's warps, which
    // does not change its arithmetic: the host launches 4 warps when no row has more
    // than 4 chunks (twice the working warps per SM at the same registers; 10 % off a
    // prefill of 128-token prompts, H200) and ATTN_WARPS otherwise.
    const int n_states = min(ATTN_WARPS, n_chunks);
    const int stride = head_dim + 2;
    for (int s = wid; s < n_states; s += (int)(blockDim.x >> 5)) {
        float m[ATTN_GROUP], l[ATTN_GROUP], acc[ATTN_GROUP][DPL];
#pragma unroll
        for (int g = 0; g < ATTN_GROUP; ++g) {
            m[g] = NEG_INF;
            l[g] = 0.0f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[g][i] = 0.0f;
        }

        for (int c = s; c < n_chunks; c += ATTN_WARPS) {
            const int k0 = c * ATTN_CHUNK;
            const int nvalid = min(ATTN_CHUNK, pos + 1 - k0);
            // Values of keys j0 .. j0+VB−1 of this chunk (zeros past the valid keys).
            auto load_values = [&](int j0, float (&vf)[VB][DPL]) {
#pragma unroll
                for (int jj = 0; jj < VB; ++jj) {
                    const bf16_t* vr = vbase + (size_t)(k0 + j0 + jj) * width;
                    if (j0 + jj >= nvalid) {
#pragma unroll
                        for (int i = 0; i < DPL; ++i) vf[jj][i] = 0.0f;
                    } else if (HD > 0) {
                        load_bf16s<DPL>(vr + lane * DPL, vf[jj]);
                    } else {
#pragma unroll
                        for (int i = 0; i < DPL; ++i)
                            vf[jj][i] = dim(i) < head_dim ? bf16_to_f32(vr[dim(i)]) : 0.0f;
                    }
                }
            };
            // The first values do not depend on the scores: their loads overlap the dots.
            float vf[VB][DPL];
            load_values(0, vf);
            float dot[ATTN_GROUP];
#pragma unroll
            for (int g = 0; g < ATTN_GROUP; ++g) dot[g] = 0.0f;
            if (lane < nvalid) {
                const bf16_t* kr = kbase + (size_t)(k0 + lane) * width;
                if (vec) {
                    // 8 values per 16-byte load; the fma order over d is the scalar loop's.
#pragma unroll(HD > 0 ? HD / 8 : 1)
                    for (int d0 = 0; d0 < head_dim; d0 += 8) {
                        float kf[8];
                        load_bf16s<8>(kr + d0, kf);
#pragma unroll
                        for (int g = 0; g < ATTN_GROUP; ++g) {
                            if (g < nh) {
#pragma unroll
                                for (int e = 0; e < 8; ++e) dot[g] = __fmaf_rn(sq[g][d0 + e], kf[e], dot[g]);
                            }
                        }
                    }
                } else {
                    for (int d = 0; d < head_dim; ++d) {
                        const float kf = bf16_to_f32(kr[d]);
#pragma unroll
                        for (int g = 0; g < ATTN_GROUP; ++g)
                            if (g < nh) dot[g] = __fmaf_rn(sq[g][d], kf, dot[g]);
                    }
                }
            }
            float p[ATTN_GROUP];
#pragma unroll
            for (int g = 0; g < ATTN_GROUP; ++g) {
                if (g >= nh) break;
                const float s = (lane < nvalid) ? dot[g] * scale : NEG_INF;
                const float m_new = fmaxf(m[g], warp_max(s));
                const float corr = expf(m[g] - m_new);
                p[g] = (lane < nvalid) ? expf(s - m_new) : 0.0f;
                l[g] = l[g] * corr + warp_sum(p[g]);
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[g][i] = acc[g][i] * corr;
                m[g] = m_new;
            }
#pragma unroll
            for (int j0 = 0; j0 < ATTN_CHUNK; j0 += VB) {
                if (j0 >= nvalid) break;
                if (j0 > 0) load_values(j0, vf);
#pragma unroll
                for (int jj = 0; jj < VB; ++jj) {
                    if (j0 + jj >= nvalid) break;
#pragma unroll
                    for (int g = 0; g < ATTN_GROUP; ++g) {
                        if (g >= nh) break;
                        const float pj = __shfl_sync(FULL_MASK, p[g], j0 + jj);
#pragma unroll
                        for (int i = 0; i < DPL; ++i)
                            if (HD > 0 || i * WARP < head_dim) acc[g][i] = __fmaf_rn(pj, vf[jj][i], acc[g][i]);
                    }
                }
            }
        }

#pragma unroll
        for (int g = 0; g < ATTN_GROUP; ++g) {
            if (g >= nh) break;
            float* ps = part + (s * ATTN_GROUP + g) * stride;
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                if (dim(i) < head_dim) ps[dim(i)] = acc[g][i];
            }
            if (lane == 0) {
                ps[head_dim] = m[g];
                ps[head_dim + 1] = l[g];
            }
        }
    }
    __syncthreads();

    for (int t = threadIdx.x; t < nh * head_dim; t += blockDim.x) {
        const int g = t / head_dim, d = t % head_dim;
        float mx = NEG_INF;
        for (int w = 0; w < n_states; ++w) mx = fmaxf(mx, part[(w * ATTN_GROUP + g) * stride + head_dim]);
        const float* p0 = part + g * stride;
        float e = expf(p0[head_dim] - mx);
        float lsum = p0[head_dim + 1] * e;
        float o = p0[d] * e;
        for (int w = 1; w < n_states; ++w) {
            const float* pw = part + (w * ATTN_GROUP + g) * stride;
            e = expf(pw[head_dim] - mx);
            lsum = __fmaf_rn(pw[head_dim + 1], e, lsum);
            o = __fmaf_rn(pw[d], e, o);
        }
        const size_t at = ((size_t)row * n_heads + h0 + g) * head_dim + d;
        out[at] = o / lsum;
        if (outb) outb[at] = f32_to_bf16(o / lsum);
    }
}

// grid: (rows, n_kv_heads * ceil(group / gsz)); block: up to ATTN_WARPS * 32; gsz in 1..=ATTN_GROUP;
// dynamic shared memory: ATTN_WARPS * ATTN_GROUP * (head_dim + 2) floats. outb (may be
// null): the output rounded to bf16 as well (for the o GEMM).
#define ATTN_ARGS                                                                                  \
    const float* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,     \
        float* __restrict__ out, bf16_t* __restrict__ outb, const unsigned int* __restrict__ row_slot, \
        const unsigned int* __restrict__ row_pos, int n_heads, int n_kv_heads, int head_dim,       \
        float scale, int layer, int slots, int max_len, int gsz
#define ATTN_PASS q, kc, vc, out, outb, row_slot, row_pos, n_heads, n_kv_heads, head_dim, scale, layer, slots, max_len, gsz

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP) attention_kernel(ATTN_ARGS) {
    pdl_enter();
    attention_body<0>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP) attention_hd64_kernel(ATTN_ARGS) {
    pdl_enter();
    attention_body<64>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP) attention_hd128_kernel(ATTN_ARGS) {
    pdl_enter();
    attention_body<128>(ATTN_PASS);
}
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP) attention_hd256_kernel(ATTN_ARGS) {
    pdl_enter();
    attention_body<256>(ATTN_PASS);
}
