// Wide decode (follows paged_attention.cu in the program and uses its per-block routines
// and arguments): the decode kernel's work on W warps (the same grid, the same state in
// `part`, the same bits). A lone warp walks a split's blocks as a chain of ~2.5 µs each
// (its own instructions, not the loads: docs/attention.md), which is the whole kernel at
// batch 1. Here every warp loads a share of each K/V block, computes the scores of 8/W of
// its n-tiles (each score's chain over the k-steps as in pa_scores), and puts them in
// shared memory; then every warp takes all 8 n-tiles back in the one-warp register layout
// and runs the same pa_softmax_block on them (so m, l and p are the one-warp values in every
// warp), and does P·V for its HD/8/W tiles of acc (each tile's chain over the block's
// 16-key steps in order, as in pa_pv). Each acc tile and each score is computed by one
// chain of the same mma in the same order as in the one-warp kernel, hence the same bits.
// STAGES K/V stages in flight, swizzled tiles (the loads come from 32·W threads).

// The scores of n-tiles n0 .. n0 + NW of a block (pa_scores' chains, MT = 1, HD ≥ 32).
template <int HD, bool SWZ, int NW>
__device__ __forceinline__ void pa_scores_part(float (&s)[NW][4], const bf16_t* sq, const bf16_t* sk, int n0,
                                               int lane) {
    static_assert(HD >= 32, "two k-steps of q at a time");
#pragma unroll
    for (int n = 0; n < NW; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
    const int qi = lane >> 3;
    const int qr = (qi & 1) * 8 + (lane & 7);
#pragma unroll
    for (int kk = 0; kk + 1 < HD / 16; kk += 2) {
        unsigned a0[4], a1[4];
        pa_ldsm_x4(pa_smem(sq + pa_chunk<HD, SWZ>(qr, 2 * kk + (qi >> 1)) * 8), a0[0], a0[1], a0[2], a0[3]);
        pa_ldsm_x4(pa_smem(sq + pa_chunk<HD, SWZ>(qr, 2 * kk + 2 + (qi >> 1)) * 8), a1[0], a1[1], a1[2], a1[3]);
#pragma unroll
        for (int n = 0; n < NW; ++n) {
            unsigned b0, b1, b2, b3;
            pa_ldsm_x4(pa_smem(sk + pa_chunk<HD, SWZ>((n0 + n) * 8 + (lane & 7), 2 * kk + (lane >> 3)) * 8), b0, b1,
                       b2, b3);
            pa_mma(s[n], a0, b0, b1);
            pa_mma(s[n], a1, b2, b3);
        }
    }
}

// The 16-key step kk of P·V (bf16(p) as the A fragment pa) into acc tiles j0 .. j0 + J.
template <int HD, bool SWZ, int J>
__device__ __forceinline__ void pa_pv_step(PaState<HD, J>& st, const unsigned (&pa)[4], const bf16_t* sv, int kk,
                                           int j0, int lane) {
    static_assert(J % 2 == 0, "acc tiles in pairs (one ldmatrix.x4.trans)");
    const int i = lane >> 3;
    const int vr = kk * 16 + (i & 1) * 8 + (lane & 7);
#pragma unroll
    for (int j = 0; j < J; j += 2) {
        unsigned b0, b1, b2, b3;
        pa_ldsm_x4_t(pa_smem(sv + pa_chunk<HD, SWZ>(vr, j0 + j + (i >> 1)) * 8), b0, b1, b2, b3);
        pa_mma(st.acc[j], pa, b0, b1);
        pa_mma(st.acc[j + 1], pa, b2, b3);
    }
}

// P·V into acc tiles j0 .. j0 + J (pa_pv's chains, MT = 1).
template <int HD, bool SWZ, int J>
__device__ __forceinline__ void pa_pv_part(PaState<HD, J>& st, const float (&s)[8][4], const bf16_t* sv, int j0,
                                           int lane) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        unsigned pa[4];
        pa_pfrag(pa, s, kk);
        pa_pv_step<HD, SWZ, J>(st, pa, sv, kk, j0, lane);
    }
}

template <int HD, int STAGES, int W>
__device__ __forceinline__ void pa_decode_wide_body(PA_DECODE_ARGS) {
    static_assert(STAGES >= 2, "the next block loads during this one");
    constexpr bool SWZ = true;
    constexpr int NT = 32 * W;
    constexpr int NW = 8 / W;       // score n-tiles of a warp
    constexpr int JW = HD / 8 / W;  // acc tiles of a warp
    static_assert(8 % W == 0 && NW >= 1 && JW >= 2, "W must split 8 n-tiles and HD/8 acc tiles");
    extern __shared__ uint4 pa_shm[];
    bf16_t* sq = reinterpret_cast<bf16_t*>(pa_shm);
    float4* ssc = reinterpret_cast<float4*>(sq + pa_tile_elems<HD, SWZ>(16));  // [n-tile][lane]
    bf16_t* skv = reinterpret_cast<bf16_t*>(ssc + 8 * 32);
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const PaDecodeCta c = pa_decode_cta(rows, row_pos, row_table, table, n_heads, n_kv_heads, head_dim, lane);
    if (!c.live) return;
    pdl_enter();
    const int pos = c.pos, b0 = c.b0, b1 = c.b1;
    constexpr int TILE = pa_tile_elems<HD, SWZ>(PA_BLOCK);

    auto load = [&](bf16_t* dst, int v, int blk) {
        pa_decode_load<HD, SWZ, NT>(dst, v, blk, c, kpool, vpool, layer_blocks, n_kv_heads, head_dim, tid);
    };
    auto stage = [&](int blk) { return skv + ((blk - b0) % STAGES) * 2 * TILE; };
#pragma unroll
    for (int s = 0; s + 1 < STAGES; ++s) pa_decode_fill(load, stage, b0 + s, b1, TILE);
    pa_load_q<HD, SWZ, NT>(
        sq, 16, c.nh, head_dim, [&](int r) { return q + (size_t)c.row * c.width + (size_t)(c.h0 + r) * head_dim; },
        tid);

    const int g = lane >> 2;
    const int rowpos[2] = {g < c.nh ? pos : -1, g + 8 < c.nh ? pos : -1};
    PaState<HD, JW> spl;
    pa_reset(spl);
    for (int blk = b0; blk < b1; ++blk) {
        pa_wait<STAGES - 2>();  // this thread's part of block blk has landed
        __syncthreads();        // every part (and q) has, and every warp is done with the
                                // stage loaded next and with the scores in ssc
        pa_decode_fill(load, stage, blk + STAGES - 1, b1, TILE);
        const bf16_t* st = stage(blk);
        {
            float part_s[NW][4];
            pa_scores_part<HD, SWZ, NW>(part_s, sq, st, warp * NW, lane);
#pragma unroll
            for (int n = 0; n < NW; ++n)
                ssc[(warp * NW + n) * 32 + lane] = make_float4(part_s[n][0], part_s[n][1], part_s[n][2], part_s[n][3]);
        }
        __syncthreads();
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            const float4 v = ssc[n * 32 + lane];
            s[n][0] = v.x;
            s[n][1] = v.y;
            s[n][2] = v.z;
            s[n][3] = v.w;
        }
        pa_softmax_block<HD>(spl, s, blk * PA_BLOCK, rowpos, sl, lane);
        pa_pv_part<HD, SWZ, JW>(spl, s, st + TILE, warp * JW, lane);
    }
    pa_decode_finish(spl, c, rowpos, warp * JW, warp == 0, out, outb, part, n_heads, head_dim, max_splits, lane);
}

#define PA_DECODE_WIDE_ENTRY(NAME, HD, STAGES, W)                           \
    extern "C" __global__ void __launch_bounds__(32 * W) NAME(PA_DECODE_ARGS) { \
        pa_decode_wide_body<HD, STAGES, W>(PA_DECODE_PASS);                     \
    }

// The wide decode kernel at the head dims whose acc tiles split over its warps in pairs:
// four warps, three stages. Measured on an H100 (docs/attention.md), two stages were 0–13 %
// slower at batch 1, and six stages (one CTA per SM) or eight warps no faster at batch 1
// and slower from two CTAs per SM.
PA_DECODE_WIDE_ENTRY(pa_decode_wide_hd64, 64, 3, 4)
PA_DECODE_WIDE_ENTRY(pa_decode_wide_hd128, 128, 3, 4)
