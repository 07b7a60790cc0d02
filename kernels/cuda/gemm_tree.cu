// arbor's TP-invariant GEMM: Y[m,n] = sum_k X[m,k] * W[n,k] with the reduction over K
// following the fixed 8-segment tree (docs/invariance.md).
//
// The leaf of one output element over one segment is a chain of m16n8k16 tensor-core MMAs
// over the segment's k16 chunks, in order, starting from +0, with the chunk that crosses the
// segment end zero-filled and no chunk that starts past it. Nothing in that chain depends on
// M, N, the tile shape or the grid: an element's MMA result depends only on its own row of
// X, its own row of W and its own accumulator, so every kernel below (large tiles with the
// tree held in the block, or one block per segment plus a combine kernel) produces the
// same bits. Segment sums are combined as ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)) in f32; a
// call over n_seg = 1, 2, 4 segments (a TP shard) returns that subtree's root.
//
// Requirements checked on the host: K, seg_len, ldx and ldw are multiples of 8 (16-byte
// cp.async chunks never straddle a segment end) and K <= n_seg * seg_len.
// Built by NVRTC without CUDA headers: only builtins and inline PTX (sm_80+).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define DEVI __device__ __forceinline__

DEVI u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

DEVI void cp_async16(u32 dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;  // src-size 0: the 16 bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
DEVI void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
DEVI void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

DEVI void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

DEVI void mma16816(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// f32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
DEVI u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

DEVI void store_out(float* outf, u16* outh, long long idx, float v) {
    if (outh) outh[idx] = f32_to_bf16(v);
    else outf[idx] = v;
}

// 16-byte chunk swizzle inside a row of BK bf16, so that ldmatrix's 8 rows hit 8 distinct
// bank groups.
template <int CH>
DEVI int swz(int r) {
    return CH == 4 ? ((r >> 1) & 3) : (r & 7);
}

struct Params {
    const u16* x;   // [M, ldx], columns [0, K) used
    const u16* w;   // [N, ldw]
    float* outf;    // [M, N] f32 result, or null
    u16* outh;      // [M, N] bf16 result, or null
    float* ws;      // split path: [n_seg, M, N] f32 segment sums of this call
    u32* cnt;       // split path: one arrival counter per output tile, zero between calls
    int M, N, K, seg_len, n_seg, ldx, ldw;
};

DEVI float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
    return v;
}

// The output rows one block computes: [row0, min(row0 + BM, end)), reading X row
// gather[r] for output row r (X row r where gather is null) against the weight w; tile
// numbers the block's row tile among the call's (the split path's counters).
struct Rows {
    int row0, end;
    const int* gather;
    const u16* w;
    int tile;
};

// The plain GEMM's rows: tile m_tile of M, X and Y rows alike, the call's weight.
template <int BM>
DEVI Rows plain_rows(const Params& p, int m_tile) {
    return Rows{m_tile * BM, p.M, nullptr, p.w, m_tile};
}

// Split path, after a block stored its segment sum of tile (m_tile, n_tile) into ws: the
// last of the tile's n_seg blocks to arrive combines the n_seg sums with the fixed tree
// (the same additions whichever block is last).
//
// The arrival counters live in their own buffer (p.cnt), never inside ws: the sums'
// extent depends on the call's M, N and n_seg, so a counter placed after them moved with
// the shape and landed on another shape's sums (TP shards and column shards read garbage
// counters, so no block combined and the output kept stale values). atomicInc
// with limit n_seg - 1 wraps the last arrival's increment back to 0, so every call
// leaves its counters at zero for the next call, whatever its shape.
template <int BM, int BN, int THREADS, bool SILU = false>
DEVI void split_finish(const Params& p, const Rows& rs, int n_tile) {
    const int n_tiles = (p.N + BN - 1) / BN;
    const long long mn = (long long)p.M * p.N;
    u32* cnt = p.cnt + ((long long)rs.tile * n_tiles + n_tile);
    // Every thread's sum stores must be visible device-wide before thread 0 announces the
    // block's arrival: fence, then a barrier so that no warp is still storing.
    __threadfence();
    __syncthreads();
    int prev = 0;
    if (threadIdx.x == 0) prev = (int)atomicInc(cnt, (u32)(p.n_seg - 1));
    if (!__syncthreads_or(threadIdx.x == 0 && prev == p.n_seg - 1)) return;
    __threadfence();
    const int row0 = rs.row0, col0 = n_tile * BN;
    const float* ws = p.ws;
    // Only the tile's rows below its end (one row of the 64 at decode M = 1).
    const int rows = min(BM, rs.end - row0);
    // SILU: one (gate, up) column pair per step, silu(gate)·up in bf16 at [r, c / 2].
    constexpr int STEP = SILU ? 2 : 1;
    for (int i = threadIdx.x; i < rows * (BN / STEP); i += THREADS) {
        const int r = row0 + i / (BN / STEP), c = col0 + STEP * (i % (BN / STEP));
        if (c >= p.N) continue;
        float v[STEP];
#pragma unroll
        for (int h = 0; h < STEP; ++h) {
            const long long e = (long long)r * p.N + c + h;
            float x[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) x[q] = q < p.n_seg ? ld_cg(ws + q * mn + e) : 0.f;
            if (p.n_seg == 1) {
                v[h] = x[0];
            } else if (p.n_seg == 2) {
                v[h] = x[0] + x[1];
            } else if (p.n_seg == 4) {
                v[h] = (x[0] + x[1]) + (x[2] + x[3]);
            } else {
                v[h] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
            }
        }
        if (SILU)
            p.outh[(long long)r * (p.N / 2) + c / 2] = f32_to_bf16(silu_mul(v[0], v[STEP - 1]));
        else
            store_out(p.outf, p.outh, (long long)r * p.N + c, v[0]);
    }
}

// One block: a BM x BN output tile over segments [seg_begin, seg_begin + seg_count).
// SPLIT: seg_count == 1 and the leaf goes to ws; otherwise the block runs the whole tree.
// SILU: W's rows alternate gate and up (N even); the block writes silu(gate)·up rounded
// to bf16 at [r, c / 2] of outh (the bits of the roots followed by silu_mul_pairs_kernel's
// bf16 output), and no roots.
template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool SPLIT, bool SILU = false>
DEVI void tree_gemm_block(const Params& p, const Rows& rs, int n_tile, int seg_begin, int seg_count) {
    constexpr int WARPS_N = BN / WN;
    constexpr int THREADS = 32 * (BM / WM) * WARPS_N;
    constexpr int MT = WM / 16, NT = WN / 8;
    constexpr int CH = BK / 8;
    constexpr int NACC = MT * NT * 4;
    static_assert(NT % 2 == 0, "WN must be a multiple of 16");
    static_assert(CH == 4 || CH == 8, "BK must be 32 or 64");

    extern __shared__ __align__(128) unsigned char smem[];
    u16* sA = (u16*)smem;
    u16* sB = sA + STAGES * BM * BK;
    // Two spill slots of the tree stack (thread-private, [slot][reg][thread]): the stack
    // needs 4 live tile partials at its deepest; registers hold the leaf and one.
    float* slots = (float*)(sB + STAGES * BN * BK);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int row0 = rs.row0, col0 = n_tile * BN;
    const int tiles_per_seg = (p.seg_len + BK - 1) / BK;
    const int total = seg_count * tiles_per_seg;

    // Fixed per-thread load assignment (computed once, not per tile): 16-byte chunk
    // column lc and rows tid/CH + j*THREADS/CH; slots past the tile's rows do nothing.
    constexpr int A_PER = (BM * CH + THREADS - 1) / THREADS;
    constexpr int B_PER = (BN * CH + THREADS - 1) / THREADS;
    static_assert(THREADS % CH == 0, "a thread keeps one chunk column");
    const int lc = tid % CH;
    const u32 sa0 = smem_addr(sA), sb0 = smem_addr(sB);
    const u16* a_src[A_PER];
    u32 a_dst[A_PER];
    bool a_row[A_PER], a_slot[A_PER];
#pragma unroll
    for (int j = 0; j < A_PER; ++j) {
        const int r = tid / CH + j * (THREADS / CH);
        a_slot[j] = r < BM;
        a_row[j] = a_slot[j] && row0 + r < rs.end;
        const int xr = !a_row[j] ? 0 : rs.gather ? rs.gather[row0 + r] : row0 + r;
        a_src[j] = p.x + (long long)xr * p.ldx + lc * 8;
        a_dst[j] = (r * CH + (lc ^ swz<CH>(r))) * 16;
    }
    const u16* b_src[B_PER];
    u32 b_dst[B_PER];
    bool b_row[B_PER], b_slot[B_PER];
#pragma unroll
    for (int j = 0; j < B_PER; ++j) {
        const int r = tid / CH + j * (THREADS / CH);
        b_slot[j] = r < BN;
        b_row[j] = b_slot[j] && col0 + r < p.N;
        b_src[j] = rs.w + (long long)(b_row[j] ? col0 + r : 0) * p.ldw + lc * 8;
        b_dst[j] = (r * CH + (lc ^ swz<CH>(r))) * 16;
    }
    // Load cursor: the next tile's segment and tile index within it.
    int ls = seg_begin, lkt = 0;
    auto load_next = [&](int stage) {
        const int k0 = ls * p.seg_len + lkt * BK;
        const int khi = min((ls + 1) * p.seg_len, p.K);
        const bool kok = k0 + lc * 8 < khi;
        const u32 sa = sa0 + stage * (BM * BK * 2), sb = sb0 + stage * (BN * BK * 2);
        // Rows past M (columns past N) are left unwritten: an MMA output row depends only
        // on its own A row (column on its own B row), and those outputs are never stored.
#pragma unroll
        for (int j = 0; j < A_PER; ++j) {
            if (!a_row[j]) continue;
            cp_async16(sa + a_dst[j], kok ? (const void*)(a_src[j] + k0) : (const void*)p.x, kok);
        }
#pragma unroll
        for (int j = 0; j < B_PER; ++j) {
            if (!b_row[j]) continue;
            cp_async16(sb + b_dst[j], kok ? (const void*)(b_src[j] + k0) : (const void*)rs.w, kok);
        }
        if (++lkt == tiles_per_seg) lkt = 0, ++ls;
    };

    // ldmatrix byte offsets inside a stage, per fragment and k16 step.
    u32 a_frag[MT][BK / 16], b_frag[NT / 2][BK / 16];
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int r = wm * WM + mt * 16 + (lane & 15);
            const int ch = kk * 2 + (lane >> 4);
            a_frag[mt][kk] = (r * CH + (ch ^ swz<CH>(r))) * 16;
        }
#pragma unroll
        for (int nt = 0; nt < NT / 2; ++nt) {
            const int r = wn * WN + nt * 16 + ((lane >> 4) << 3) + (lane & 7);
            const int ch = kk * 2 + ((lane >> 3) & 1);
            b_frag[nt][kk] = (r * CH + (ch ^ swz<CH>(r))) * 16;
        }
    }

    float acc[MT][NT][4];
    float root[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f, root[i][j][e] = 0.f;

#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < total) load_next(t);
        cp_commit();
    }

    int t = 0;
    for (int sl = 0; sl < seg_count; ++sl) {
        const int s = seg_begin + sl;
        const int khi = min((s + 1) * p.seg_len, p.K);
        for (int kt = 0; kt < tiles_per_seg; ++kt, ++t) {
            cp_wait<STAGES - 2>();
            __syncthreads();
            {
                const int tn = t + STAGES - 1;
                if (tn < total) load_next(tn % STAGES);
                cp_commit();
            }
            const int stage = t % STAGES;
            const int k0 = s * p.seg_len + kt * BK;
            // The leaf has exactly ceil(len/16) chunks, whatever BK is.
            const int nk = min(BK / 16, max(0, (khi - k0 + 15) / 16));
            const u32 a_base = sa0 + stage * (BM * BK * 2);
            const u32 b_base = sb0 + stage * (BN * BK * 2);
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                if (kk >= nk) break;
                u32 a[MT][4], b[NT][2];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldsm_x4(a_base + a_frag[mt][kk], a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
#pragma unroll
                for (int nt = 0; nt < NT / 2; ++nt)
                    ldsm_x4(b_base + b_frag[nt][kk], b[2 * nt][0], b[2 * nt][1], b[2 * nt + 1][0],
                            b[2 * nt + 1][1]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mma16816(acc[mt][nt], a[mt], b[nt]);
            }
        }

        // Segment end: the leaf is complete.
        {
            if (SPLIT) {
                // One segment per block: its leaf goes to ws[s] for split_finish.
                float* dst = p.ws + (long long)s * p.M * p.N;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int r = row0 + wm * WM + mt * 16 + (lane >> 2) + h * 8;
                            const int c = col0 + wn * WN + nt * 8 + (lane & 3) * 2;
                            if (r < rs.end) {
                                if (c < p.N) dst[(long long)r * p.N + c] = acc[mt][nt][2 * h];
                                if (c + 1 < p.N)
                                    dst[(long long)r * p.N + c + 1] = acc[mt][nt][2 * h + 1];
                            }
                        }
            } else {
                // Push the leaf onto the tree stack: root/slot0/slot1 hold the pending
                // subtrees; the additions below are exactly the tree's, bracket by bracket.
                float* s0 = slots;
                float* s1 = slots + NACC * THREADS;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            const int j = ((mt * NT + nt) * 4 + c) * THREADS + tid;
                            const float v = acc[mt][nt][c];
                            float& r = root[mt][nt][c];
                            switch (sl) {
                                case 0: r = v; break;                    // s0
                                case 1: r = r + v; break;                // s0+s1
                                case 2: s0[j] = v; break;                // s2
                                case 3: r = r + (s0[j] + v); break;      // (s0+s1)+(s2+s3)
                                case 4: s0[j] = v; break;                // s4
                                case 5: s0[j] = s0[j] + v; break;        // s4+s5
                                case 6: s1[j] = v; break;                // s6
                                default: r = r + (s0[j] + (s1[j] + v));  // root
                            }
                            acc[mt][nt][c] = 0.f;
                        }
            }
        }
    }
    cp_wait<0>();

    if (SPLIT) {
        split_finish<BM, BN, THREADS, SILU>(p, rs, n_tile);
    } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = row0 + wm * WM + mt * 16 + (lane >> 2) + h * 8;
                    const int c = col0 + wn * WN + nt * 8 + (lane & 3) * 2;
                    if (r >= rs.end) continue;
                    if (SILU) {
                        // c is even: the pair (c, c + 1) is one (gate, up).
                        if (c + 1 < p.N)
                            p.outh[(long long)r * (p.N / 2) + c / 2] =
                                f32_to_bf16(silu_mul(root[mt][nt][2 * h], root[mt][nt][2 * h + 1]));
                        continue;
                    }
                    const long long idx = (long long)r * p.N + c;
                    if (c < p.N) store_out(p.outf, p.outh, idx, root[mt][nt][2 * h]);
                    if (c + 1 < p.N) store_out(p.outf, p.outh, idx + 1, root[mt][nt][2 * h + 1]);
                }
    }
}

// Large M: 128x128 tiles, 8 warps of 64x32, BK 64, 3-stage cp.async pipeline, the whole
// tree in the block. 1-D grid in groups of 8 row tiles so that neighbouring blocks share W
// in L2.
#define TREE_BM 128
#define TREE_BN 128
extern "C" __global__ void __launch_bounds__(256, 1) arbor_gemm_tree_128x128(Params p) {
    const int num_m = (p.M + TREE_BM - 1) / TREE_BM;
    const int num_n = (p.N + TREE_BN - 1) / TREE_BN;
    const int group = 8;
    const int pid = blockIdx.x;
    const int per_group = group * num_n;
    const int first_m = (pid / per_group) * group;
    const int gsize = min(num_m - first_m, group);
    const int m_tile = first_m + (pid % per_group) % gsize;
    const int n_tile = (pid % per_group) / gsize;
    tree_gemm_block<TREE_BM, TREE_BN, 64, 64, 32, 3, false>(p, plain_rows<TREE_BM>(p, m_tile), n_tile, 0,
                                                            p.n_seg);
}

// Small M (decode): one block per (column tile, segment, row tile); the split over the
// fixed segments is the tree's own leaf level, so no extra reduction order is introduced;
// the last block of each tile combines the segment sums (split_finish).
extern "C" __global__ void __launch_bounds__(128) arbor_gemm_split_16x64(Params p) {
    tree_gemm_block<16, 64, 64, 16, 16, 6, true>(p, plain_rows<16>(p, blockIdx.z), blockIdx.x, blockIdx.y, 1);
}
extern "C" __global__ void __launch_bounds__(128) arbor_gemm_split_64x64(Params p) {
    tree_gemm_block<64, 64, 64, 64, 16, 4, true>(p, plain_rows<64>(p, blockIdx.z), blockIdx.x, blockIdx.y, 1);
}
