// Prefill attention on Hopper's warpgroup MMA (sm_90a): pa_prefill_hd*'s 64-row tile (4
// warps × 16 rows) computed by one warpgroup, the scores by wgmma m64n64k16 (Q and K from
// shared memory) and P·V by wgmma m64nHDk16 (P from registers, V N-major from shared
// memory): no ldmatrix, and 12 wgmma a block where the warps issued 128 mma.sync each.
//
// A row's arithmetic is the one paged_attention.cu's header spells out, with its routines:
// the scores' chain over head_dim's k16 steps in order from +0, pa_softmax, P·V over the
// block's 16-key steps in order into the scaled acc, pa_fold_row's split fold, acc ·
// rcp(l). A warp's part of a wgmma fragment is mma.sync m16n8k16's (accumulator: rows g
// and g + 8 of the warp's 16, columns 2t and 2t + 1 of each 8-column tile; A: the same
// pairs), so the per-thread code is pa_prefill_body's. That one wgmma k16 step rounds as
// one mma.sync k16 step is this hardware's behaviour, not the ISA's promise: the GPU test
// checks every row of this build against the decode kernel bit for bit, as the GEMM's
// grouped wgmma path is checked against mma.sync.
//
// Every warp of the warpgroup takes part in every wgmma, also on a causal-diagonal block
// its rows do not see: those keys are masked, and a block of masked keys leaves a row's
// state as it was (m and l unchanged, corr 1, P 0, acc + 0·V = acc), so the bits are those
// of skipping it.
//
// Shared memory, 1024-aligned: Q, K and V tiles as HD/64 column halves of [64 rows][128 B]
// in the 128-byte swizzle (16-byte chunk c of a row r at chunk c ^ (r & 7)), the layout
// wgmma's descriptors read with swizzle mode 1; then the rows' total state as in
// pa_prefill_body. One K and one V buffer, loaded as pa_prefill_body loads them. Only
// head_dim == HD (64 or 128) takes this build (paged_tiles.rs). The scores' wgmma, the
// fences, waits and descriptors are wgmma.cuh's, shared with the GEMMs.
#define PA_WG_ROWS 64
#define PA_WG_THREADS 128
#define PA_WG_HALF (64 * 128)  // bytes of a [64 rows][64 bf16] column half

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d[32] += P·V of one 16-key step: m64n64k16, A (P) in registers, B (V) N-major in
// shared memory.
__device__ __forceinline__ void pa_wgmma_rs_n64(float* d, const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// d[64] += P·V of one 16-key step: m64n128k16, A (P) in registers, B (V) N-major in
// shared memory.
__device__ __forceinline__ void pa_wgmma_rs_n128(float* d, const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// Byte offset of 16-byte chunk c (of HD/8) of row r in a swizzled tile.
__device__ __forceinline__ unsigned pa_wg_at(int r, int c) {
    return (unsigned)((c >> 3) * PA_WG_HALF + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// A KV block (key j at src + j·HD) into a swizzled tile; keys j ≥ nvalid become zeros
// (not read). Thread t copies chunk t mod HD/8 of every (128·8/HD)-th row from t·8/HD: a
// multiple of 8 rows apart, so the swizzle is the thread's own and every address is its
// base plus a constant. The caller commits.
template <int HD>
__device__ __forceinline__ void pa_wg_load_kv(unsigned tile, const bf16_t* src, int nvalid, int tid) {
    constexpr int CPR = HD / 8, RPI = PA_WG_THREADS / CPR;
    const int c = tid % CPR, r0 = tid / CPR;
    const bf16_t* s = src + r0 * HD + c * 8;
    const unsigned d = tile + pa_wg_at(r0, c);
#pragma unroll
    for (int k = 0; k < PA_BLOCK / RPI; ++k) pa_cp16(d + k * RPI * 128, s + k * RPI * HD, r0 + k * RPI < nvalid);
}

template <int HD>
__device__ __forceinline__ void pa_wg_pv(float* acc, const unsigned (&a)[4], unsigned long long db) {
    if constexpr (HD == 128)
        pa_wgmma_rs_n128(acc, a, db);
    else
        pa_wgmma_rs_n64(acc, a, db);
}

// A tile's rows, positions, KV head and block count, where its swizzled Q, K and V tiles
// and its rows' total state are.
template <int HD>
struct PaWgTile {
    int row0, nrows, pos0, last, nblk, kvh, width, h;
    unsigned tab;
    unsigned raw, sq, sk, sv;  // shared addresses: the window, the Q, K and V tiles
    float* tacc;               // the total acc, thread-private slots
    int rowpos[2];             // this thread's rows' positions (−1: not a row)
};

// The tile of this CTA (tiles[n_tiles − 1 − blockIdx.x]: the later, longer tiles first).
template <int HD>
__device__ __forceinline__ PaWgTile<HD> pa_wg_tile(PA_PREFILL_ARGS) {
    constexpr int TILE = HD / 64 * PA_WG_HALF;
    extern __shared__ uint4 pa_shm[];
    PaWgTile<HD> w;
    w.raw = pa_smem(pa_shm);
    const unsigned base = (w.raw + 1023u) & ~1023u;
    w.sq = base;
    w.sk = base + TILE;
    w.sv = base + 2 * TILE;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    w.tacc = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(pa_shm) + (base - w.raw) + 3 * TILE) + tid;
    const unsigned* tile = tiles + 4 * (n_tiles - 1 - (int)blockIdx.x);
    w.row0 = (int)tile[0];
    w.nrows = (int)tile[1];
    w.pos0 = (int)tile[2];
    w.tab = tile[3];
    w.h = blockIdx.y;
    w.kvh = w.h / (n_heads / n_kv_heads);
    w.width = n_heads * head_dim;
    w.last = w.pos0 + w.nrows - 1;
    w.nblk = w.last / PA_BLOCK + 1;
    const int g = lane >> 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = warp * 16 + 8 * r + g;
        w.rowpos[r] = i < w.nrows ? w.pos0 + i : -1;
    }
    return w;
}

// q rounded to bf16 into the swizzled Q tile, rows past nrows zeros, four values a store;
// unrolled, so that a thread's loads are all in flight at once.
template <int HD>
__device__ __forceinline__ void pa_wg_load_q(const PaWgTile<HD>& w, const float* q) {
    extern __shared__ uint4 pa_shm[];
    unsigned char* q_tile = reinterpret_cast<unsigned char*>(pa_shm) + (w.sq - w.raw);
    constexpr int FPR = HD / 4;
    static_assert(PA_WG_ROWS * FPR % PA_WG_THREADS == 0, "whole rounds of float4s");
#pragma unroll
    for (int k = 0; k < PA_WG_ROWS * FPR / PA_WG_THREADS; ++k) {
        const int i = threadIdx.x + k * PA_WG_THREADS;
        const int r = i / FPR, d = (i % FPR) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < w.nrows) v = *reinterpret_cast<const float4*>(q + (size_t)(w.row0 + r) * w.width + (size_t)w.h * HD + d);
        uint2 u;
        u.x = pa_pack(v.x, v.y);
        u.y = pa_pack(v.z, v.w);
        *reinterpret_cast<uint2*>(q_tile + pa_wg_at(r, d / 8) + (d & 7) * 2) = u;
    }
}

// scores of the warpgroup's 64 rows against the K tile at sk: s = 0, then the chain over
// head_dim's k16 steps in order; issued and committed, not waited for.
template <int HD>
__device__ __forceinline__ void pa_wg_scores(float (&s)[8][4], unsigned sq, unsigned sk) {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
    // The descriptors before the fence: no instruction between it and the wgmma may
    // define their inputs (ptxas would serialize the pipeline).
    unsigned long long da[HD / 16], db[HD / 16];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const unsigned off = (kk >> 2) * PA_WG_HALF + (kk & 3) * 32;
        da[kk] = wgmma_desc(sq + off, 16, 1024);
        db[kk] = wgmma_desc(sk + off, 16, 1024);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) wgmma_m64n64k16(&s[0][0], da[kk], db[kk]);
    wgmma_commit();
}

// acc += P·V over the block's 16-key steps in order (V tile at sv); issued and committed.
template <int HD>
__device__ __forceinline__ void pa_wg_pv_block(PaState<HD>& st, const unsigned (&P)[4][4], unsigned sv) {
    unsigned long long db[4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) db[kk] = wgmma_desc(sv + kk * 16 * 128, PA_WG_HALF, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) pa_wg_pv<HD>(&st.acc[0][0], P[kk], db[kk]);
    wgmma_commit();
}

// Writes the rows' total state as acc · rcp(l).
template <int HD>
__device__ __forceinline__ void pa_wg_store(const PaWgTile<HD>& w, const float (&tml)[2][2], float* out, bf16_t* outb) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t4 = lane & 3, g = lane >> 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (w.rowpos[r] < 0) continue;
        const size_t at = (size_t)(w.row0 + warp * 16 + 8 * r + g) * w.width + (size_t)w.h * HD;
        const float inv = pa_rcp(tml[r][1]);
#pragma unroll
        for (int j = 0; j < HD / 8; ++j)
            pa_put2(out, outb, at + j * 8 + 2 * t4, w.tacc[pa_tslot<HD, PA_WG_THREADS>(0, j, r, 0)] * inv,
                    w.tacc[pa_tslot<HD, PA_WG_THREADS>(0, j, r, 1)] * inv);
    }
}

// One K and one V tile, loaded as pa_prefill_body loads them; each block's scores, softmax
// and P·V in turn, each waited for. (FA3's overlap inside the warpgroup, the next block's
// scores and this block's P·V beside the softmax with two K and V tiles, measured slower
// at long contexts: two CTAs per SM already overlap each other, docs/attention.md.)
template <int HD>
__device__ __forceinline__ void pa_prefill_wg_body(PA_PREFILL_ARGS) {
    static_assert(HD == 64 || HD == 128, "the wgmma build is for head dims 64 and 128");
    const PaWgTile<HD> w = pa_wg_tile<HD>(PA_PREFILL_PASS);
    const int tid = threadIdx.x, lane = tid & 31;
    auto load = [&](unsigned dst, const bf16_t* pool, unsigned id, int blk) {
        pa_wg_load_kv<HD>(dst, pa_kv_at(pool, id, layer_blocks, n_kv_heads, w.kvh, HD),
                          min(PA_BLOCK, w.last - blk * PA_BLOCK + 1), tid);
        pa_commit();
    };
    {
        const unsigned id0 = table[w.tab];
        load(w.sk, kpool, id0, 0);
        load(w.sv, vpool, id0, 0);
    }
    pa_wg_load_q<HD>(w, q);
    float tml[2][2] = {{NEG_INF, 0.0f}, {NEG_INF, 0.0f}};
    auto ml = [&](int, int r, int i) -> float& { return tml[r][i]; };
    PaState<HD> spl[1];
    for (int b0 = 0; b0 < w.nblk; b0 += PA_SPLIT_BLOCKS) {
        pa_reset(spl[0]);
        const int b1 = min(b0 + PA_SPLIT_BLOCKS, w.nblk);
        for (int blk = b0; blk < b1; ++blk) {
            const bool more = blk + 1 < w.nblk;
            // The next block's id, read now: its latency hides behind this block's scores.
            const unsigned nid = more ? table[w.tab + blk + 1] : 0u;
            pa_wait<1>();  // K(blk) has landed (V(blk) may be in flight)
            fence_proxy_async();
            __syncthreads();
            float s[8][4];
            pa_wg_scores<HD>(s, w.sq, w.sk);
            wgmma_wait0();
            __syncthreads();  // the warpgroup is done with K(blk)
            if (more) {
                load(w.sk, kpool, nid, blk + 1);
                pa_wait<1>();  // V(blk) has landed
            } else {
                pa_wait<0>();
            }
            pa_softmax_block<HD>(spl[0], s, blk * PA_BLOCK, w.rowpos, sl, lane);
            unsigned P[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) pa_pfrag(P[kk], s, kk);
            fence_proxy_async();
            __syncthreads();  // every thread's part of V(blk) is visible
            pa_wg_pv_block<HD>(spl[0], P, w.sv);
            wgmma_wait0();
            __syncthreads();  // the warpgroup is done with V(blk)
            if (more) load(w.sv, vpool, nid, blk + 1);
        }
        pa_fold_smem<HD, PA_WG_THREADS>(ml, w.tacc, spl[0], 0);
    }
    pa_wg_store<HD>(w, tml, out, outb);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Defined on every architecture (the module exports every entry point); empty but for
// sm_90a, where alone the host launches them (paged_tiles.rs).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PA_WG_CALL(HD) pa_prefill_wg_body<HD>(PA_PREFILL_PASS)
#else
#define PA_WG_CALL(HD)
#endif
#define PA_PREFILL_WG_ENTRY(HD)                                                                         \
    extern "C" __global__ void __launch_bounds__(PA_WG_THREADS) pa_prefill_wg_hd##HD(PA_PREFILL_ARGS) { \
        pdl_enter();                                                                                    \
        PA_WG_CALL(HD);                                                                                 \
    }
PA_PREFILL_WG_ENTRY(64)
PA_PREFILL_WG_ENTRY(128)
