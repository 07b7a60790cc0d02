// Block-parallel decode (follows paged_attention_wide.cu in the program and uses its
// routines and arguments): the decode kernel's work with every block of a split at once
// (the same grid, the same state in `part`, the same bits). A split's online softmax is a
// chain over its blocks, but only acc and l carry from block to block: a block's scores
// need q and its keys alone, its running maximum m is a max over the blocks so far (exact,
// in any order), and so are its probabilities p = ex2(fma(s, sl, −mu)) and its correction
// c once the maxima are known. So warp w of eight takes block b0 + w: its scores (the
// one-warp kernel's chains, pa_scores_part over all 8 n-tiles), the mask and the block's
// row maxima (pa_block_max); after a barrier, the running maximum before and after its
// block, c, p and Σ p (pa_block_probs: pa_softmax's own arithmetic) and bf16(p) as P·V's
// A fragments, into shared memory. What is left is the chain: each warp walks the blocks
// in order for its two acc tiles (acc = acc·c, then the block's P·V steps, pa_pv_part's
// mma in pa_pv_part's order) and l = fma(l, c, Σ p). The one-warp kernel runs every
// instruction of a block after the last one's; here a block's scores and softmax run
// beside the other blocks', and the chain that remains is ~6 mma a block.
// Shared memory: q, the split's eight K tiles, V tiles of blocks 0–3 (those of blocks 4–7
// go into K tiles 0–3 once their warps have their scores), the P fragments and the per-
// block row values: 213.5 KB at head_dim 128, one CTA per SM (sm_90's 227 KB).

template <int HD>
struct PaParSmem {
    static constexpr bool SWZ = true;
    static constexpr int TILE = pa_tile_elems<HD, SWZ>(PA_BLOCK);
    static constexpr int Q = pa_tile_elems<HD, SWZ>(16);
    static constexpr int KT = PA_SPLIT_BLOCKS;      // K tiles
    static constexpr int VT = PA_SPLIT_BLOCKS / 2;  // V tiles of their own
};

// The acc chain's step of one block: acc tiles j0, j0 + 1 of the warp scaled by the
// block's c, then pa_pv_part's P·V steps with P from shared memory (the fragments
// pa_pfrag made).
template <int HD, bool SWZ>
__device__ __forceinline__ void pa_par_pv(PaState<HD, 2>& st, const uint4* pf, const float (&c)[2], const bf16_t* sv,
                                          int j0, int lane) {
    pa_scale_acc(st, c);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const uint4 p = pf[kk * 32 + lane];
        const unsigned pa[4] = {p.x, p.y, p.z, p.w};
        pa_pv_step<HD, SWZ, 2>(st, pa, sv, kk, j0, lane);
    }
}

template <int HD>
__device__ __forceinline__ void pa_decode_par_body(PA_DECODE_ARGS) {
    using L = PaParSmem<HD>;
    constexpr bool SWZ = L::SWZ;
    constexpr int TILE = L::TILE;
    constexpr int W = PA_SPLIT_BLOCKS;  // warps: one block each
    static_assert(HD / 8 == 2 * W, "two acc tiles a warp");
    extern __shared__ uint4 pa_shm[];
    bf16_t* sq = reinterpret_cast<bf16_t*>(pa_shm);
    bf16_t* sk = sq + L::Q;
    bf16_t* sv = sk + L::KT * TILE;
    uint4* sp = reinterpret_cast<uint4*>(sv + L::VT * TILE);  // [block][kk][lane]
    float* sbm = reinterpret_cast<float*>(sp + W * 4 * 32);   // [block][row]: max·sl
    float* sc = sbm + W * 16;                                  // [block][row]: c
    float* sls = sc + W * 16;                                  // [block][row]: Σ p
    const int tid = threadIdx.x;
    const int lane = tid & 31, w = tid >> 5;
    const PaDecodeCta c = pa_decode_cta(rows, row_pos, row_table, table, n_heads, n_kv_heads, head_dim, lane);
    if (!c.live) return;
    pdl_enter();
    const int pos = c.pos, b0 = c.b0, nb = c.b1 - c.b0;
    const int blk = b0 + w;
    const bool own = w < nb;

    auto load = [&](bf16_t* dst, int v, int b) {
        pa_decode_load<HD, SWZ, 32>(dst, v, b, c, kpool, vpool, layer_blocks, n_kv_heads, head_dim, lane);
    };
    // Each warp loads its own block's K (group 1) and, warps 0–3, their block's V (group
    // 2); every thread commits the same groups, so the wait counts agree.
    if (own) load(sk + w * TILE, 0, blk);
    pa_commit();
    if (w < L::VT && own) load(sv + w * TILE, 1, blk);
    pa_commit();
    pa_load_q<HD, SWZ, 32 * W>(
        sq, 16, c.nh, head_dim, [&](int r) { return q + (size_t)c.row * c.width + (size_t)(c.h0 + r) * head_dim; },
        tid);

    const int g = lane >> 2, t4 = lane & 3;
    const int rowpos[2] = {g < c.nh ? pos : -1, g + 8 < c.nh ? pos : -1};
    float s[8][4];
    pa_wait<1>();     // this thread's part of K(blk) has landed
    __syncwarp();     // and the warp's
    __syncthreads();  // q
    if (own) {
        pa_scores_part<HD, SWZ, 8>(s, sq, sk + w * TILE, 0, lane);
        // pa_softmax's mask and block maxima. Masking a block every row sees whole changes
        // no value, so it is applied to every block.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float bm = pa_block_max<true>(s, r, blk * PA_BLOCK, rowpos[r], t4);
            if (t4 == 0) sbm[w * 16 + g + 8 * r] = bm * sl;
        }
        // K tiles 0–3 take the V tiles of blocks 4–7 once their warps are done with them.
        __syncwarp();
        if (w < L::VT && w + L::VT < nb) load(sk + w * TILE, 1, blk + L::VT);
    }
    pa_commit();  // group 3
    __syncthreads();  // every block's maxima
    if (own) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = g + 8 * r;
            float m0 = NEG_INF;  // the running maximum before this block
            for (int b = 0; b < w; ++b) m0 = fmaxf(m0, sbm[b * 16 + row]);
            const float mn = fmaxf(m0, sbm[w * 16 + row]);
            const float mu = mn == NEG_INF ? 0.0f : mn;
            const float ls = pa_block_probs(s, r, sl, mu);
            if (t4 == 0) {
                sc[w * 16 + row] = mn == m0 ? 1.0f : pa_ex2(m0 - mu);
                sls[w * 16 + row] = ls;
            }
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            unsigned a[4];
            pa_pfrag(a, s, kk);
            sp[(w * 4 + kk) * 32 + lane] = make_uint4(a[0], a[1], a[2], a[3]);
        }
    }
    pa_wait<1>();     // V of blocks 0–3 (group 2) has landed
    __syncthreads();  // and every block's p, c and Σ p are in shared memory

    PaState<HD, 2> st;
    pa_reset(st);
    const int j0 = 2 * w;
    for (int b = 0; b < nb; ++b) {
        if (b == L::VT) {
            pa_wait<0>();  // V of blocks 4–7 (group 3)
            __syncthreads();
        }
        const float cr[2] = {sc[b * 16 + g], sc[b * 16 + g + 8]};
        const bf16_t* v = b < L::VT ? sv + b * TILE : sk + (b - L::VT) * TILE;
        pa_par_pv<HD, SWZ>(st, sp + b * 4 * 32, cr, v, j0, lane);
#pragma unroll
        for (int r = 0; r < 2; ++r) st.l[r] = __fmaf_rn(st.l[r], cr[r], sls[b * 16 + g + 8 * r]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float m = NEG_INF;
        for (int b = 0; b < nb; ++b) m = fmaxf(m, sbm[b * 16 + g + 8 * r]);
        st.m[r] = m;
    }
    pa_decode_finish(st, c, rowpos, j0, w == 0, out, outb, part, n_heads, head_dim, max_splits, lane);
}

// Head dim 128 only (two acc tiles for each of eight warps), and only where 213.5 KB of
// shared memory fit one CTA (sm_90; elsewhere the entry is empty and never launched).
extern "C" __global__ void __launch_bounds__(32 * PA_SPLIT_BLOCKS, 1) pa_decode_par_hd128(PA_DECODE_ARGS) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    pa_decode_par_body<128>(PA_DECODE_PASS);
#endif
}
