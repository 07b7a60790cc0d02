// Causal GQA attention over the paged bf16 KV cache, on tensor cores (mma.sync m16n8k16,
// bf16 in, f32 accumulate; sm_80 and later).
//
// Two kernels compute attention rows, and a row's result has the same bits whichever one
// computes it, because both run the same per-block routines (pa_scores, pa_pv) on a
// warp's m16 tiles of rows, and a row's arithmetic in an mma never depends on the other
// rows of its tile:
//   - the prefill kernel: a CTA takes consecutive query rows of one sequence and one query
//     head (flash-attention style: Q tile against K/V blocks), in two builds: 4 warps ×
//     16 rows (64-row tiles) or 3 warps × 32 rows (96-row tiles, two m16 tiles per warp);
//   - the decode kernel: a CTA of one warp takes one row, the query heads that share one
//     KV head (GQA: the heads are the tile's rows), and one split of its keys; its wide
//     build (paged_attention_wide.cu) shares each block among four warps, each score and
//     each acc tile still one warp's chain of the same mma.
//
// The numerics of a row (query position p, head h), fixed by p alone (sl = scale·log2 e):
// - q is rounded to bf16. Keys come in blocks of PA_BLOCK = 64 positions aligned at 0 (the
//   KV cache's block: a block's keys are contiguous), and the blocks in splits of
//   PA_SPLIT_BLOCKS = 8 (512 keys) aligned at 0. The row sees keys 0..=p.
// - In a split, the blocks are taken in increasing order with the online softmax from an
//   empty state (m = −inf, l = 0, acc = 0). One block:
//     s_j  = mma dot of q and k_j over head_dim in steps of 16, in order (−inf past p);
//     m'   = max(m, (max_j s_j)·sl);  mu = m' (0 when m' = −inf);
//     c    = 1 if m' == m, else ex2(m − mu);
//     p_j  = ex2(fma(s_j, sl, −mu));  l = fma(l, c, Σ_j p_j)  (Σ: per thread in key order
//            over its 16 keys, then lanes xor 1, xor 2);
//     acc  = acc·c, then acc += bf16(p) · V by mma over the block's keys in steps of 16.
// - The splits' states are folded in split order into the row's state (empty at first):
//   an empty split changes nothing; into an empty state a split is copied; otherwise
//   M = max(m_a, m_b), e = 1 where m == M else ex2(m − M), l = fma(l_b, e_b, l_a·e_a),
//   acc = fma(acc_b, e_b, acc_a·e_a). The output is acc · rcp(l) (rcp rounded to
//   nearest), and that rounded to bf16 for the o GEMM.
// The prefill kernel folds each split as it finishes it; the decode kernel writes each
// split's state to memory and pa_combine folds them (in the same order, with the same
// arithmetic), except for a row of one split, which it finishes itself (the fold of one
// split into an empty state is a copy). PA_BLOCK and PA_SPLIT_BLOCKS are part of the
// numerics: changing either changes bits.
//
// Keys past the range a tile may see are zero-filled when loaded, so a masked key
// (p_j = 0) never meets garbage (0 · NaN) in the P·V product.

#define PA_BLOCK 64
#define PA_SPLIT_BLOCKS 8
#define PA_SPLIT (PA_BLOCK * PA_SPLIT_BLOCKS)
// The prefill kernel's two builds (paged_tiles.rs, PrefillTiles): 4 warps × 16 rows, and
// 3 warps × 32 rows (two m16 tiles per warp).
#define PA_PREFILL_ROWS 64
#define PA_PREFILL2_ROWS 96

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define PA_MMA 1
#endif

__device__ __forceinline__ unsigned pa_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global → shared, asynchronously; zeros when !valid (nothing is read then).
__device__ __forceinline__ void pa_cp16(unsigned dst, const void* src, bool valid) {
#ifdef PA_MMA
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
#endif
}
__device__ __forceinline__ void pa_commit() {
#ifdef PA_MMA
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void pa_wait() {
#ifdef PA_MMA
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ void pa_ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
#ifdef PA_MMA
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
#endif
}
__device__ __forceinline__ void pa_ldsm_x2(unsigned addr, unsigned& r0, unsigned& r1) {
#ifdef PA_MMA
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
#endif
}
__device__ __forceinline__ void pa_ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
#ifdef PA_MMA
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
#endif
}

// d += a · b (16×16 bf16 · 16×8 bf16 → 16×8 f32).
__device__ __forceinline__ void pa_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#ifdef PA_MMA
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// 2^x by the hardware approximation (one instruction, the same bits on every call).
__device__ __forceinline__ float pa_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two f32 rounded to bf16 (to nearest, ties to even), `lo` in the low half.
__device__ __forceinline__ unsigned pa_pack(float lo, float hi) {
#ifdef PA_MMA
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
#endif
}

// A tile of rows of HD bf16 in shared memory, in 16-byte chunks, in one of two layouts (SWZ;
// the values and every computation on them are the same in both):
// - swizzled (SWZ, from HD 64 up): rows unpadded, chunk c of row r at r·HD/8 + (c ^ (r % 8)).
//   The 8 rows an ldmatrix reads (r % 8 all different) hit distinct banks, and each 8-thread
//   group of a cp.async writes one aligned 128-byte line. With padded rows (272 bytes at
//   HD 128) those lines straddle two: the LSU splits the writes and fetches a third of the
//   K/V sectors from L2 twice, and the tiles take 6 % more shared memory. The kernels that
//   stream the cache (many CTAs per SM) use it.
// - padded (below HD 64, too few chunks to swizzle over 8 rows, or !SWZ): each row padded by
//   one chunk, chunk c of row r at r·(HD/8 + 1) + c, so every address is a per-thread base
//   plus a constant: fewer instructions for a lone warp whose chain of instructions bounds
//   it (the two-stage decode kernel, one CTA per SM at small batches).
template <int HD, bool SWZ>
__device__ __forceinline__ int pa_chunk(int r, int c) {
    if constexpr (SWZ && HD >= 64)
        return r * (HD / 8) + (c ^ (r & 7));
    else
        return r * (HD / 8 + 1) + c;
}
template <int HD, bool SWZ>
__host__ __device__ constexpr int pa_tile_elems(int rows) {
    return rows * (SWZ && HD >= 64 ? HD : HD + 8);
}

// A KV block (row j: key j, head_dim values at src + j·head_dim) into a tile by NT
// threads; keys j ≥ nvalid and dims ≥ head_dim become zeros. Full rows (head_dim = HD) go
// by cp.async, thread t taking chunk t mod HD/8 of every (NT·8/HD)-th row from t·8/HD;
// other head dims go synchronously.
// The caller commits and waits.
template <int HD, bool SWZ, int NT>
__device__ __forceinline__ void pa_load_kv(bf16_t* tile, const bf16_t* src, int head_dim, int nvalid, int tid) {
    if (head_dim == HD) {
        constexpr int CPR = HD / 8;
        constexpr int RPI = NT / CPR;
        static_assert(NT % CPR == 0, "threads must cover whole rows");
        const int c = tid % CPR, r0 = tid / CPR;
        const bf16_t* s = src + r0 * HD + c * 8;
        const unsigned d = pa_smem(tile);
#pragma unroll
        for (int k = 0; k < (PA_BLOCK + RPI - 1) / RPI; ++k) {
            // Rows past nvalid are zero-filled: the source is not read (it is in the block).
            // Past the block's 64 rows (3 warps: RPI does not divide 64) nothing is copied.
            const int r = r0 + k * RPI;
            if (PA_BLOCK % RPI == 0 || r < PA_BLOCK)
                pa_cp16(d + pa_chunk<HD, SWZ>(r, c) * 16, s + k * RPI * HD, r < nvalid);
        }
    } else if ((head_dim & 7) == 0) {
        const int gch = head_dim / 8;
        for (int i = tid; i < PA_BLOCK * (HD / 8); i += NT) {
            const int r = i / (HD / 8), c = i % (HD / 8);
            const bool ok = r < nvalid && c < gch;
            const bf16_t* from = ok ? src + (size_t)r * head_dim + c * 8 : src;
            pa_cp16(pa_smem(tile + pa_chunk<HD, SWZ>(r, c) * 8), from, ok);
        }
    } else {
        for (int i = tid; i < PA_BLOCK * HD; i += NT) {
            const int r = i / HD, d = i % HD;
            const bf16_t v = (r < nvalid && d < head_dim) ? src[(size_t)r * head_dim + d] : (bf16_t)0;
            tile[pa_chunk<HD, SWZ>(r, d / 8) * 8 + (d & 7)] = v;
        }
    }
}

// Query rows (f32, row r at src_r(r)) rounded to bf16 into a tile of `rows` rows by NT
// threads; rows past nrows and dims past head_dim are zeros.
template <int HD, bool SWZ, int NT, typename RowPtr>
__device__ __forceinline__ void pa_load_q(bf16_t* tile, int rows, int nrows, int head_dim, RowPtr src_r, int tid) {
    if (head_dim == HD) {
        constexpr int FPR = HD / 4;  // float4s per row
        for (int i = tid; i < rows * FPR; i += NT) {
            const int r = i / FPR, d = (i % FPR) * 4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (r < nrows) v = *reinterpret_cast<const float4*>(src_r(r) + d);
            uint2 w;
            w.x = pa_pack(v.x, v.y);
            w.y = pa_pack(v.z, v.w);
            *reinterpret_cast<uint2*>(tile + pa_chunk<HD, SWZ>(r, d / 8) * 8 + (d & 7)) = w;
        }
        return;
    }
    for (int i = tid; i < rows * (HD / 2); i += NT) {
        const int r = i / (HD / 2), d = (i % (HD / 2)) * 2;
        float a = 0.0f, b = 0.0f;
        if (r < nrows) {
            const float* s = src_r(r);
            if (d < head_dim) a = s[d];
            if (d + 1 < head_dim) b = s[d + 1];
        }
        *reinterpret_cast<unsigned*>(tile + pa_chunk<HD, SWZ>(r, d / 8) * 8 + (d & 7)) = pa_pack(a, b);
    }
}

// One warp's 16 rows of state; this thread holds rows g = lane/4 ([0]) and g + 8 ([1]),
// and of each 8-dim tile j of acc the dims j·8 + 2·(lane%4) + {0, 1} (mma C layout). A
// warp of the wide decode kernel holds J of the HD/8 tiles of acc (and the whole m, l).
template <int HD, int J = HD / 8>
struct PaState {
    float m[2], l[2];
    float acc[J][4];
};

template <int HD, int J>
__device__ __forceinline__ void pa_reset(PaState<HD, J>& s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        s.m[r] = NEG_INF;
        s.l[r] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s.acc[j][e] = 0.0f;
}

// The maximum of row r (0: g, 1: g + 8) of a block's scores (keys key0 .. key0 + 63),
// keys past the row's position first set to −inf where MASK (header).
template <bool MASK>
__device__ __forceinline__ float pa_block_max(float (&s)[8][4], int r, int key0, int rowpos, int t4) {
    float bm = NEG_INF;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            if (MASK && key0 + n * 8 + 2 * t4 + e > rowpos) s[n][2 * r + e] = NEG_INF;
            bm = fmaxf(bm, s[n][2 * r + e]);
        }
    bm = fmaxf(bm, __shfl_xor_sync(FULL_MASK, bm, 1));
    return fmaxf(bm, __shfl_xor_sync(FULL_MASK, bm, 2));
}

// Row r's probabilities p = ex2(fma(s, sl, −mu)) in place of its scores, and their sum:
// per thread in key order, then lanes xor 1, xor 2 (header).
__device__ __forceinline__ float pa_block_probs(float (&s)[8][4], int r, float sl, float mu) {
    float ls = 0.0f;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float p = pa_ex2(__fmaf_rn(s[n][2 * r + e], sl, -mu));
            s[n][2 * r + e] = p;
            ls = ls + p;
        }
    ls = ls + __shfl_xor_sync(FULL_MASK, ls, 1);
    return ls + __shfl_xor_sync(FULL_MASK, ls, 2);
}

// acc · c of this thread's two rows (c[0] for row g, c[1] for row g + 8).
template <int HD, int J>
__device__ __forceinline__ void pa_scale_acc(PaState<HD, J>& st, const float (&c)[2]) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
        st.acc[j][0] = st.acc[j][0] * c[0];
        st.acc[j][1] = st.acc[j][1] * c[0];
        st.acc[j][2] = st.acc[j][2] * c[1];
        st.acc[j][3] = st.acc[j][3] * c[1];
    }
}

// The online-softmax update of one block's scores (header); MASK: keys past a row's
// position may be in the block.
template <int HD, bool MASK, int J>
__device__ __forceinline__ void pa_softmax(PaState<HD, J>& st, float (&s)[8][4], int key0, const int (&rowpos)[2], float sl,
                                           int lane) {
    const int t4 = lane & 3;
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float bm = pa_block_max<MASK>(s, r, key0, rowpos[r], t4);
        const float mn = fmaxf(st.m[r], bm * sl);
        const float mu = mn == NEG_INF ? 0.0f : mn;
        corr[r] = mn == st.m[r] ? 1.0f : pa_ex2(st.m[r] - mu);
        const float ls = pa_block_probs(s, r, sl, mu);
        st.l[r] = __fmaf_rn(st.l[r], corr[r], ls);
        st.m[r] = mn;
    }
    // acc · 1 = acc: skipped when no row of the warp has a new maximum.
    if (__any_sync(FULL_MASK, corr[0] != 1.0f || corr[1] != 1.0f)) pa_scale_acc(st, corr);
}

// pa_softmax of a block of a warp's 16 rows, masked only where some row of the warp does
// not see every key of the block (a block every row sees whole needs no mask: the same
// values).
template <int HD, int J>
__device__ __forceinline__ void pa_softmax_block(PaState<HD, J>& st, float (&s)[8][4], int key0, const int (&rowpos)[2],
                                                 float sl, int lane) {
    if (__all_sync(FULL_MASK, key0 + PA_BLOCK - 1 <= min(rowpos[0], rowpos[1])))
        pa_softmax<HD, false>(st, s, key0, rowpos, sl, lane);
    else
        pa_softmax<HD, true>(st, s, key0, rowpos, sl, lane);
}

// One key block (keys key0 .. key0+63) into a warp's MT tiles of 16 rows (MT = 1 or 2;
// tile m's state st[m], its q rows at sq + m·16 rows), in two halves: pa_scores (the
// scores against sk, the online-softmax update of m and l, acc scaled; leaves the
// probabilities in s) then pa_pv (acc += bf16(p) · sv). rowpos[m]: the positions of this
// thread's two rows of tile m (−1: a row that sees no key). See the header. The tiles
// share every K and V fragment (one ldmatrix feeds MT mma); an mma's row never depends on
// the other rows of its tile, and each row's chains run in the same order for any MT
// (scores: over the k-steps in order; P·V: over the block's 16-key steps in order), so MT
// changes no bit.
template <int HD, bool SWZ, int MT>
__device__ __forceinline__ void pa_scores(PaState<HD> (&st)[MT], float (&s)[MT][8][4], const bf16_t* sq,
                                          const bf16_t* sk, int key0, const int (&rowpos)[MT][2], float sl,
                                          int lane) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[m][n][e] = 0.0f;
    // q's fragments a k-step at a time (registers for one, not all), keys in n-tiles of 8;
    // each score's mma chain runs over the k-steps in order.
    const int qi = lane >> 3;
    const int qr = (qi & 1) * 8 + (lane & 7);
    if (HD / 16 == 1) {
        unsigned a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
            pa_ldsm_x4(pa_smem(sq + pa_chunk<HD, SWZ>(16 * m + qr, qi >> 1) * 8), a[m][0], a[m][1], a[m][2], a[m][3]);
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            unsigned b0, b1;
            pa_ldsm_x2(pa_smem(sk + pa_chunk<HD, SWZ>(n * 8 + (lane & 7), (lane >> 3) & 1) * 8), b0, b1);
#pragma unroll
            for (int m = 0; m < MT; ++m) pa_mma(s[m][n], a[m], b0, b1);
        }
    } else if (MT > 1) {
        // One k-step's q fragments at a time (8 registers for two tiles), K's fragments of
        // that k-step for two n-tiles by one ldmatrix: the same ldmatrix count as below.
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            unsigned a[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
                pa_ldsm_x4(pa_smem(sq + pa_chunk<HD, SWZ>(16 * m + qr, 2 * kk + (qi >> 1)) * 8), a[m][0], a[m][1],
                           a[m][2], a[m][3]);
#pragma unroll
            for (int n = 0; n < 8; n += 2) {
                unsigned b0, b1, b2, b3;
                const int kr = n * 8 + (lane >> 4) * 8 + (lane & 7);
                pa_ldsm_x4(pa_smem(sk + pa_chunk<HD, SWZ>(kr, 2 * kk + ((lane >> 3) & 1)) * 8), b0, b1, b2, b3);
#pragma unroll
                for (int m = 0; m < MT; ++m) pa_mma(s[m][n], a[m], b0, b1);
#pragma unroll
                for (int m = 0; m < MT; ++m) pa_mma(s[m][n + 1], a[m], b2, b3);
            }
        }
    } else {
#pragma unroll
        for (int kk = 0; kk + 1 < HD / 16; kk += 2) {
            unsigned a0[MT][4], a1[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                pa_ldsm_x4(pa_smem(sq + pa_chunk<HD, SWZ>(16 * m + qr, 2 * kk + (qi >> 1)) * 8), a0[m][0], a0[m][1],
                           a0[m][2], a0[m][3]);
                pa_ldsm_x4(pa_smem(sq + pa_chunk<HD, SWZ>(16 * m + qr, 2 * kk + 2 + (qi >> 1)) * 8), a1[m][0], a1[m][1],
                           a1[m][2], a1[m][3]);
            }
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                unsigned b0, b1, b2, b3;
                pa_ldsm_x4(pa_smem(sk + pa_chunk<HD, SWZ>(n * 8 + (lane & 7), 2 * kk + (lane >> 3)) * 8), b0, b1, b2,
                           b3);
#pragma unroll
                for (int m = 0; m < MT; ++m) pa_mma(s[m][n], a0[m], b0, b1);
#pragma unroll
                for (int m = 0; m < MT; ++m) pa_mma(s[m][n], a1[m], b2, b3);
            }
        }
    }

#pragma unroll
    for (int m = 0; m < MT; ++m) pa_softmax_block<HD>(st[m], s[m], key0, rowpos[m], sl, lane);
}

// bf16(p) of keys kk·16 .. kk·16+15 as P·V's A fragment.
__device__ __forceinline__ void pa_pfrag(unsigned (&a)[4], const float (&s)[8][4], int kk) {
    a[0] = pa_pack(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pa_pack(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pa_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pa_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}
template <int MT>
__device__ __forceinline__ void pa_pack_p(unsigned (&P)[MT][4][4], const float (&s)[MT][8][4]) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) pa_pfrag(P[m][kk], s[m], kk);
}

// P·V from the probabilities s (packed a 16-key step at a time, as the mma needs them).
template <int HD, bool SWZ>
__device__ __forceinline__ void pa_pv(PaState<HD> (&st)[1], const float (&s)[1][8][4], const bf16_t* sv, int lane) {
    const int i = lane >> 3;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        unsigned pa[4];
        pa_pfrag(pa, s[0], kk);
        const int vr = kk * 16 + (i & 1) * 8 + (lane & 7);
#pragma unroll
        for (int j = 0; j < HD / 8; j += 2) {
            unsigned b0, b1, b2, b3;
            pa_ldsm_x4_t(pa_smem(sv + pa_chunk<HD, SWZ>(vr, j + (i >> 1)) * 8), b0, b1, b2, b3);
            pa_mma(st[0].acc[j], pa, b0, b1);
            pa_mma(st[0].acc[j + 1], pa, b2, b3);
        }
    }
}

// P·V from bf16(p) packed after the scores (pa_pack_p: 16 registers a tile where the
// probabilities take 32, which lets two tiles' states fit).
template <int HD, bool SWZ, int MT>
__device__ __forceinline__ void pa_pv(PaState<HD> (&st)[MT], const unsigned (&P)[MT][4][4], const bf16_t* sv,
                                      int lane) {
    const int i = lane >> 3;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const int vr = kk * 16 + (i & 1) * 8 + (lane & 7);
#pragma unroll
        for (int j = 0; j < HD / 8; j += 2) {
            unsigned b0, b1, b2, b3;
            pa_ldsm_x4_t(pa_smem(sv + pa_chunk<HD, SWZ>(vr, j + (i >> 1)) * 8), b0, b1, b2, b3);
#pragma unroll
            for (int m = 0; m < MT; ++m) pa_mma(st[m].acc[j], P[m][kk], b0, b1);
#pragma unroll
            for (int m = 0; m < MT; ++m) pa_mma(st[m].acc[j + 1], P[m][kk], b2, b3);
        }
    }
}

// The fold of one split's (m, l, a) into a row's (m, l, a) for n values (header).
struct PaFold {
    float ea, eb;
    int kind;  // 0: nothing changes, 1: copy b, 2: combine
};
__device__ __forceinline__ PaFold pa_fold_row(float& ma, float& la, float mb, float lb) {
    PaFold f{1.0f, 1.0f, 0};
    if (mb == NEG_INF) return f;
    if (ma == NEG_INF) {
        f.kind = 1;
        ma = mb;
        la = lb;
        return f;
    }
    f.kind = 2;
    const float mx = fmaxf(ma, mb);
    f.ea = ma == mx ? 1.0f : pa_ex2(ma - mx);
    f.eb = mb == mx ? 1.0f : pa_ex2(mb - mx);
    la = __fmaf_rn(lb, f.eb, la * f.ea);
    ma = mx;
    return f;
}
__device__ __forceinline__ float pa_fold_val(const PaFold& f, float a, float b) {
    return f.kind == 0 ? a : f.kind == 1 ? b : __fmaf_rn(b, f.eb, a * f.ea);
}

// acc · rcp(l) of a pair of values, written as f32 (and bf16 when outb is given) at `at`.
__device__ __forceinline__ float pa_rcp(float x) {
    return __frcp_rn(x);
}
__device__ __forceinline__ void pa_put2(float* out, bf16_t* outb, size_t at, float o0, float o1) {
    *reinterpret_cast<float2*>(out + at) = make_float2(o0, o1);
    if (outb) *reinterpret_cast<unsigned*>(outb + at) = pa_pack(o0, o1);
}

// Writes this thread's part of a warp's 16 rows `st` (no fold pending) as acc · rcp(l):
// row r of the thread goes to dst(r) (−1: not a real row), dims below head_dim (even);
// the state's acc tiles are tiles j0 .. j0 + J of the rows.
template <int HD, int J, typename RowDst>
__device__ __forceinline__ void pa_store(const PaState<HD, J>& st, RowDst dst, int head_dim, int lane, float* out,
                                         bf16_t* outb, int j0 = 0) {
    const int t4 = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const long long at = dst(r);
        if (at < 0) continue;
        const float inv = pa_rcp(st.l[r]);
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int d = (j0 + j) * 8 + 2 * t4;
            if (d < head_dim)
                pa_put2(out, outb, at + d, st.acc[j][2 * r] * inv, st.acc[j][2 * r + 1] * inv);
        }
    }
}

// Address of KV head `kvh` of KV block `id` in the pool [layer][block][kvh][64][head_dim].
__device__ __forceinline__ const bf16_t* pa_kv_at(const bf16_t* pool, unsigned id, long long layer_blocks, int n_kv_heads,
                                                  int kvh, int head_dim) {
    return pool + (((size_t)layer_blocks + id) * n_kv_heads + kvh) * (size_t)(PA_BLOCK * head_dim);
}

// ---------------------------------------------------------------------------------------
// Prefill: grid (tiles, n_heads), WARPS warps of MT·16 rows each. tiles[t] = (q row of
// the tile's first row, rows in the tile (1..=WARPS·MT·16), its position, the sequence's
// block-table offset); the rows of a tile are consecutive positions of one sequence. One K
// and one V buffer: the next block's K loads while this block's P·V runs, its V while the
// next scores run. The rows' total state lives in shared memory (thread-private slots,
// touched once a split), so registers hold only the split's state. Two builds (a speed
// choice, the same bits): 4 warps × 16 rows (pa_prefill_hd*, 64-row tiles) and 3 warps ×
// 32 rows (pa_prefill96_hd*, 96-row tiles: two m16 tiles per warp share every K and V
// fragment, FA2's structure; 113 KB of shared memory at head_dim 128, two CTAs per SM).
// Dynamic shared memory: see paged_tiles.rs.
#define PA_PREFILL_ARGS                                                                                        \
    const float *__restrict__ q, const bf16_t *__restrict__ kpool, const bf16_t *__restrict__ vpool,             \
        float *__restrict__ out, bf16_t *__restrict__ outb, const unsigned *__restrict__ tiles,                  \
        const unsigned *__restrict__ table, int n_tiles, int n_heads, int n_kv_heads, int head_dim, float sl,    \
        long long layer_blocks
#define PA_PREFILL_PASS q, kpool, vpool, out, outb, tiles, table, n_tiles, n_heads, n_kv_heads, head_dim, sl, layer_blocks

// Tile m's value (j, e) of this thread's row r in the total state: slot ((m·HD/8 + j)·4 +
// 2r + e)·NT from the thread's own.
template <int HD, int NT>
__device__ __forceinline__ int pa_tslot(int m, int j, int r, int e) {
    return ((m * (HD / 8) + j) * 4 + 2 * r + e) * NT;
}

template <int HD, int NT, typename TotalML>
__device__ __forceinline__ void pa_fold_smem(TotalML ml, float* tacc, const PaState<HD>& sp, int m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const PaFold f = pa_fold_row(ml(m, r, 0), ml(m, r, 1), sp.m[r], sp.l[r]);
        if (f.kind == 0) continue;
#pragma unroll
        for (int j = 0; j < HD / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float* t = tacc + pa_tslot<HD, NT>(m, j, r, e);
                *t = pa_fold_val(f, *t, sp.acc[j][2 * r + e]);
            }
    }
}

template <int HD, int WARPS, int MT>
__device__ __forceinline__ void pa_prefill_body(PA_PREFILL_ARGS) {
    constexpr int NT = WARPS * 32;
    constexpr int ROWS = WARPS * MT * 16;
    constexpr bool SWZ = true;  // many warps per SM stream the tiles (pa_chunk)
    extern __shared__ uint4 pa_shm[];
    bf16_t* sq = reinterpret_cast<bf16_t*>(pa_shm);
    bf16_t* sk = sq + pa_tile_elems<HD, SWZ>(ROWS);
    bf16_t* sv = sk + pa_tile_elems<HD, SWZ>(PA_BLOCK);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* tacc = reinterpret_cast<float*>(sv + pa_tile_elems<HD, SWZ>(PA_BLOCK)) + tid;
    const int t = n_tiles - 1 - (int)blockIdx.x;  // the later (longer) tiles first
    const unsigned* tile = tiles + 4 * t;
    const int row0 = (int)tile[0], nrows = (int)tile[1], pos0 = (int)tile[2];
    const unsigned tab = tile[3];
    const int h = blockIdx.y;
    const int kvh = h / (n_heads / n_kv_heads);
    const int width = n_heads * head_dim;
    const int last = pos0 + nrows - 1;
    const int nblk = last / PA_BLOCK + 1;
    auto load = [&](bf16_t* dst, const bf16_t* pool, unsigned id, int blk) {
        pa_load_kv<HD, SWZ, NT>(dst, pa_kv_at(pool, id, layer_blocks, n_kv_heads, kvh, head_dim), head_dim,
                           min(PA_BLOCK, last - blk * PA_BLOCK + 1), tid);
        pa_commit();
    };
    {
        const unsigned id0 = table[tab];
        load(sk, kpool, id0, 0);
        load(sv, vpool, id0, 0);
    }
    pa_load_q<HD, SWZ, NT>(
        sq, ROWS, nrows, head_dim, [&](int r) { return q + (size_t)(row0 + r) * width + (size_t)h * head_dim; },
        tid);

    const int g = lane >> 2;
    const int wr = warp * MT * 16;
    const bf16_t* wq = sq + pa_tile_elems<HD, SWZ>(wr);
    int rowpos[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = wr + 16 * m + 8 * r + g;
            rowpos[m][r] = i < nrows ? pos0 + i : -1;
        }
    const int warp_last = wr < nrows ? pos0 + min(wr + MT * 16 - 1, nrows - 1) : -1;
    // The rows' total m and l (ml(m, r, 0 | 1)): in registers for one tile, in thread-private
    // shared slots past the total acc for two (8 registers the two states need).
    float tml_r[MT == 1 ? 2 : 1][2];
    float* tml_s = tacc + ROWS * HD;
    auto ml = [&](int m, int r, int w) -> float& {
        if constexpr (MT == 1)
            return tml_r[r][w];
        else
            return tml_s[((m * 2 + r) * 2 + w) * NT];
    };
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            ml(m, r, 0) = NEG_INF;
            ml(m, r, 1) = 0.0f;
        }
    PaState<HD> spl[MT];
    for (int b0 = 0; b0 < nblk; b0 += PA_SPLIT_BLOCKS) {
#pragma unroll
        for (int m = 0; m < MT; ++m) pa_reset(spl[m]);
        const int b1 = min(b0 + PA_SPLIT_BLOCKS, nblk);
        for (int blk = b0; blk < b1; ++blk) {
            const bool more = blk + 1 < nblk;
            // The next block's id, read now: its latency hides behind this block's scores.
            const unsigned nid = more ? table[tab + blk + 1] : 0u;
            pa_wait<1>();  // K(blk) has landed (V(blk) may be in flight)
            __syncthreads();
            const bool active = blk * PA_BLOCK <= warp_last;
            // MT = 1: the probabilities stay f32 until P·V (the 64-row build as it was);
            // MT = 2: packed to bf16 right away, to hold two tiles' states.
            float s[MT][8][4];
            unsigned P[MT][4][4];
            if (active) {
                pa_scores<HD, SWZ, MT>(spl, s, wq, sk, blk * PA_BLOCK, rowpos, sl, lane);
                if constexpr (MT > 1) pa_pack_p<MT>(P, s);
            }
            __syncthreads();  // every warp is done with K(blk)
            if (more) {
                load(sk, kpool, nid, blk + 1);
                pa_wait<1>();  // V(blk) has landed
            } else {
                pa_wait<0>();
            }
            __syncthreads();
            if (active) {
                if constexpr (MT == 1)
                    pa_pv<HD, SWZ>(spl, s, sv, lane);
                else
                    pa_pv<HD, SWZ, MT>(spl, P, sv, lane);
            }
            __syncthreads();  // every warp is done with V(blk)
            if (more) load(sv, vpool, nid, blk + 1);
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) pa_fold_smem<HD, NT>(ml, tacc, spl[m], m);
    }
    const int t4 = lane & 3;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (rowpos[m][r] < 0) continue;
            const size_t at = (size_t)(row0 + wr + 16 * m + 8 * r + g) * width + (size_t)h * head_dim;
            const float inv = pa_rcp(ml(m, r, 1));
#pragma unroll
            for (int j = 0; j < HD / 8; ++j) {
                const int d = j * 8 + 2 * t4;
                if (d < head_dim)
                    pa_put2(out, outb, at + d, tacc[pa_tslot<HD, NT>(m, j, r, 0)] * inv,
                            tacc[pa_tslot<HD, NT>(m, j, r, 1)] * inv);
            }
        }
}

// ---------------------------------------------------------------------------------------
// Decode: grid (rows, n_kv_heads · ceil(group / 16), max_splits), one warp. Row i of the
// launch is q row rows[i] (rows == nullptr: row i); its position and block-table offset
// are row_pos / row_table at that q row. A row of one split writes its output; a row of
// more writes each split's state to part[i][h][split][head_dim + 2] (acc, m, l) for
// pa_combine. Dynamic shared memory: see paged_tiles.rs.
//
// STAGES is a speed choice only (the arithmetic of a block is the same): 2, two K/V stages
// (the next block loads during this one); 1, one K and one V tile (the next K loads during
// this block's P·V, the next V during the next scores, as the prefill kernel does): six
// CTAs per SM at head_dim 128 where two stages fit three, which pays once CTAs queue for
// SMs (H200: 4 × 8192 context 0.86 of two stages' time). Four stages were slower
// everywhere (docs/attention.md): a lone warp's block is bound by its own instructions,
// not by its wait for the next block.
#define PA_DECODE_ARGS                                                                                           \
    const float *__restrict__ q, const bf16_t *__restrict__ kpool, const bf16_t *__restrict__ vpool,               \
        float *__restrict__ out, bf16_t *__restrict__ outb, float *__restrict__ part,                              \
        const unsigned *__restrict__ rows, const unsigned *__restrict__ row_pos,                                   \
        const unsigned *__restrict__ row_table, const unsigned *__restrict__ table, int n_heads, int n_kv_heads,   \
        int head_dim, float sl, long long layer_blocks, int max_splits
#define PA_DECODE_PASS \
    q, kpool, vpool, out, outb, part, rows, row_pos, row_table, table, n_heads, n_kv_heads, head_dim, sl, layer_blocks, max_splits

// Where a decode CTA sits in the grid (every build): its launch row i and q row, the row's
// position and block-table offset, its KV head and 16-head tile (h0, nh heads), its split
// and that split's blocks b0 .. b1, with their block ids (`ids`: lane b of every warp holds
// block b0 + b's). `live` is false past the row's last split.
//
// The rows, positions and block tables are the step's inputs, uploaded before its first
// kernel and written by none, so every decode build reads them here, before the PDL wait:
// that chain of dependent loads runs while the kernel before (RoPE and the KV write) still
// does. The K and V tiles, and q, come after it.
struct PaDecodeCta {
    int i, row, pos, n_splits, split, kvh, h0, nh, width, b0, b1;
    unsigned tab, ids;
    bool live;
};
__device__ __forceinline__ PaDecodeCta pa_decode_cta(const unsigned* rows, const unsigned* row_pos,
                                                     const unsigned* row_table, const unsigned* table,
                                                     int n_heads, int n_kv_heads, int head_dim, int lane) {
    PaDecodeCta c;
    c.i = blockIdx.x;
    c.row = rows ? (int)rows[c.i] : c.i;
    c.pos = (int)row_pos[c.row];
    c.tab = row_table[c.row];
    c.n_splits = c.pos / PA_SPLIT + 1;
    c.split = blockIdx.z;
    c.live = c.split < c.n_splits;
    const int group = n_heads / n_kv_heads;
    const int htiles = (group + 15) / 16;
    c.kvh = blockIdx.y / htiles;
    c.h0 = c.kvh * group + (blockIdx.y % htiles) * 16;
    c.nh = min(16, c.kvh * group + group - c.h0);
    c.width = n_heads * head_dim;
    c.b0 = c.split * PA_SPLIT_BLOCKS;
    c.b1 = min(c.b0 + PA_SPLIT_BLOCKS, c.pos / PA_BLOCK + 1);
    c.ids = c.live && lane < c.b1 - c.b0 ? table[c.tab + c.b0 + lane] : 0u;
    return c;
}

// K (v = 0) or V (v = 1) of key block blk of a decode CTA into a tile by NT threads
// (every lane of each warp calls it: the block id comes from c.ids); the caller commits.
template <int HD, bool SWZ, int NT>
__device__ __forceinline__ void pa_decode_load(bf16_t* dst, int v, int blk, const PaDecodeCta& c,
                                               const bf16_t* kpool, const bf16_t* vpool, long long layer_blocks,
                                               int n_kv_heads, int head_dim, int tid) {
    const int nvalid = min(PA_BLOCK, c.pos - blk * PA_BLOCK + 1);
    const unsigned id = __shfl_sync(FULL_MASK, c.ids, blk - c.b0);
    pa_load_kv<HD, SWZ, NT>(dst, pa_kv_at(v ? vpool : kpool, id, layer_blocks, n_kv_heads, c.kvh, head_dim), head_dim,
                            nvalid, tid);
}

// Block blk's K and V tiles into its stage (nothing past the split's last block b1 - 1),
// as one commit group either way, so the wait counts stay uniform.
template <typename Load, typename Stage>
__device__ __forceinline__ void pa_decode_fill(const Load& load, const Stage& stage, int blk, int b1, int tile) {
    if (blk < b1) {
        load(stage(blk), 0, blk);
        load(stage(blk) + tile, 1, blk);
    }
    pa_commit();
}

// The end of a decode CTA: a row of one split writes its output, a row of more this
// split's state to part (acc tiles j0 .. j0 + J of it; m and l where `ml`) for pa_combine.
template <int HD, int J>
__device__ __forceinline__ void pa_decode_finish(const PaState<HD, J>& st, const PaDecodeCta& c,
                                                 const int (&rowpos)[2], int j0, bool ml, float* out,
                                                 bf16_t* outb, float* part, int n_heads, int head_dim,
                                                 int max_splits, int lane) {
    const int g = lane >> 2;
    if (c.n_splits == 1) {
        pa_store<HD>(
            st,
            [&](int r) -> long long {
                return rowpos[r] < 0 ? -1 : (long long)c.row * c.width + (long long)(c.h0 + g + 8 * r) * head_dim;
            },
            head_dim, lane, out, outb, j0);
        return;
    }
    const int t4 = lane & 3;
    const int stride = head_dim + 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rowpos[r] < 0) continue;
        float* p = part + (((size_t)c.i * n_heads + c.h0 + g + 8 * r) * max_splits + c.split) * stride;
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int d = (j0 + j) * 8 + 2 * t4 + e;
                if (d < head_dim) p[d] = st.acc[j][2 * r + e];
            }
        if (ml && t4 == 0) {
            p[head_dim] = st.m[r];
            p[head_dim + 1] = st.l[r];
        }
    }
}

template <int HD, int STAGES>
__device__ __forceinline__ void pa_decode_body(PA_DECODE_ARGS) {
    static_assert(STAGES == 1 || STAGES == 2, "1 or 2 stages");
    // One stage streams the cache with CTAs queued for SMs: swizzled tiles (more CTAs per
    // SM, no split cp.async writes). Two stages run one CTA per SM at small batches, bound
    // by the warp's own chain of instructions: padded tiles, whose addresses cost none.
    constexpr bool SWZ = STAGES == 1;
    extern __shared__ uint4 pa_shm[];
    bf16_t* sq = reinterpret_cast<bf16_t*>(pa_shm);
    bf16_t* skv = sq + pa_tile_elems<HD, SWZ>(16);
    const int lane = threadIdx.x;
    const PaDecodeCta c = pa_decode_cta(rows, row_pos, row_table, table, n_heads, n_kv_heads, head_dim, lane);
    if (!c.live) return;
    pdl_enter();
    const int pos = c.pos, b0 = c.b0, b1 = c.b1;
    constexpr int TILE = pa_tile_elems<HD, SWZ>(PA_BLOCK);

    auto load = [&](bf16_t* dst, int v, int blk) {
        pa_decode_load<HD, SWZ, 32>(dst, v, blk, c, kpool, vpool, layer_blocks, n_kv_heads, head_dim, lane);
    };
    // Stage of block blk: its K tile, then its V tile.
    auto stage = [&](int blk) { return skv + ((blk - b0) % STAGES) * 2 * TILE; };

    if constexpr (STAGES == 1) {
        load(skv, 0, b0);
        pa_commit();
        load(skv + TILE, 1, b0);
        pa_commit();
    } else {
#pragma unroll
        for (int s = 0; s + 1 < STAGES; ++s) pa_decode_fill(load, stage, b0 + s, b1, TILE);
    }
    pa_load_q<HD, SWZ, 32>(
        sq, 16, c.nh, head_dim, [&](int r) { return q + (size_t)c.row * c.width + (size_t)(c.h0 + r) * head_dim; },
        lane);

    const int g = lane >> 2;
    const int rowpos[1][2] = {{g < c.nh ? pos : -1, g + 8 < c.nh ? pos : -1}};
    PaState<HD> spl[1];
    pa_reset(spl[0]);
    for (int blk = b0; blk < b1; ++blk) {
        float s[1][8][4];
        if constexpr (STAGES == 1) {
            const bool more = blk + 1 < b1;
            pa_wait<1>();  // K(blk) has landed (V(blk) may be in flight)
            __syncwarp();
            pa_scores<HD, SWZ, 1>(spl, s, sq, skv, blk * PA_BLOCK, rowpos, sl, lane);
            __syncwarp();  // every lane is done with K(blk)
            if (more) load(skv, 0, blk + 1);
            pa_commit();
            pa_wait<1>();  // V(blk) has landed
            __syncwarp();
            pa_pv<HD, SWZ>(spl, s, skv + TILE, lane);
            __syncwarp();  // every lane is done with V(blk)
            if (more) load(skv + TILE, 1, blk + 1);
            pa_commit();
        } else {
            pa_wait<STAGES - 2>();  // block blk has landed
            __syncwarp();           // and every lane is done with the stage loaded next
            pa_decode_fill(load, stage, blk + STAGES - 1, b1, TILE);
            const bf16_t* st = stage(blk);
            pa_scores<HD, SWZ, 1>(spl, s, sq, st, blk * PA_BLOCK, rowpos, sl, lane);
            pa_pv<HD, SWZ>(spl, s, st + TILE, lane);
        }
    }
    pa_decode_finish(spl[0], c, rowpos[0], 0, true, out, outb, part, n_heads, head_dim, max_splits, lane);
}

// The decode bodies call pdl_enter() themselves, after their step-input prologue.
#define PA_DECODE_ENTRY(NAME, HD, STAGES)                                  \
    extern "C" __global__ void __launch_bounds__(32) NAME(PA_DECODE_ARGS) { \
        pa_decode_body<HD, STAGES>(PA_DECODE_PASS);                        \
    }
// A prefill build of ROWS-row tiles, MT m16 tiles per warp.
#define PA_PREFILL_ENTRY(NAME, HD, ROWS, MT)                                                   \
    extern "C" __global__ void __launch_bounds__(ROWS / MT / 16 * 32) NAME(PA_PREFILL_ARGS) { \
        pdl_enter();                                                                           \
        pa_prefill_body<HD, ROWS / MT / 16, MT>(PA_PREFILL_PASS);                              \
    }
#define PA_ENTRIES(HD)                                                     \
    PA_PREFILL_ENTRY(pa_prefill_hd##HD, HD, PA_PREFILL_ROWS, 1)            \
    PA_PREFILL_ENTRY(pa_prefill96_hd##HD, HD, PA_PREFILL2_ROWS, 2)         \
    PA_DECODE_ENTRY(pa_decode_hd##HD, HD, 2)                               \
    PA_DECODE_ENTRY(pa_decode1_hd##HD, HD, 1)

PA_ENTRIES(16)
PA_ENTRIES(32)
PA_ENTRIES(64)
PA_ENTRIES(128)

// HD 256 decodes only (its prefill state would not fit in registers); the host routes
// every row of such a model through the decode kernel, which gives the same bits.
PA_DECODE_ENTRY(pa_decode_hd256, 256, 2)
PA_DECODE_ENTRY(pa_decode1_hd256, 256, 1)

// ---------------------------------------------------------------------------------------
// Combine: grid (rows, ⌈n_heads · head_dim/2 / 128⌉), blocks of at most 128 threads.
// Folds the splits pa_decode wrote for rows of more than one split, in split order, and
// writes acc · rcp(l). A thread holds one pair of dims of one head (8-byte loads: a
// split's state is head_dim + 2 floats), so every thread of a block works and a warp
// reads 256 contiguous bytes of a split. The loads of PA_COMBINE_BATCH splits go out
// before their folds: one round trip to L2 for that many splits, where the fold's chain
// would wait on each split's in turn. Eight blocks an SM: 54 registers (ptxas 13.0), none
// spilled.
#define PA_COMBINE_BATCH 8
extern "C" __global__ void __launch_bounds__(128, 8)
    pa_combine(float* __restrict__ out, bf16_t* __restrict__ outb, const float* __restrict__ part,
               const unsigned* __restrict__ rows, const unsigned* __restrict__ row_pos, int n_heads, int head_dim,
               int max_splits) {
    // The row and its position are step inputs (pa_decode_cta): read before the PDL wait.
    const int i = blockIdx.x;
    const int row = rows ? (int)rows[i] : i;
    const int n_splits = (int)row_pos[row] / PA_SPLIT + 1;
    if (n_splits == 1) return;
    const int pairs = head_dim >> 1;
    const int x = blockIdx.y * blockDim.x + threadIdx.x;
    if (x >= n_heads * pairs) return;
    pdl_enter();
    const int h = x / pairs, d = 2 * (x - h * pairs);
    const int stride = head_dim + 2;
    const float* p0 = part + ((size_t)i * n_heads + h) * max_splits * stride;
    float m = NEG_INF, l = 0.0f, a0 = 0.0f, a1 = 0.0f;
    for (int s0 = 0; s0 < n_splits; s0 += PA_COMBINE_BATCH) {
        float2 ml[PA_COMBINE_BATCH], v[PA_COMBINE_BATCH];
#pragma unroll
        for (int j = 0; j < PA_COMBINE_BATCH; ++j) {
            if (s0 + j < n_splits) {
                const float* p = p0 + (size_t)(s0 + j) * stride;
                ml[j] = *reinterpret_cast<const float2*>(p + head_dim);
                v[j] = *reinterpret_cast<const float2*>(p + d);
            }
        }
#pragma unroll
        for (int j = 0; j < PA_COMBINE_BATCH; ++j) {
            if (s0 + j < n_splits) {
                const PaFold f = pa_fold_row(m, l, ml[j].x, ml[j].y);
                a0 = pa_fold_val(f, a0, v[j].x);
                a1 = pa_fold_val(f, a1, v[j].y);
            }
        }
    }
    const float inv = pa_rcp(l);
    const size_t at = (size_t)row * n_heads * head_dim + (size_t)h * head_dim;
    pa_put2(out, outb, at + d, a0 * inv, a1 * inv);
}
