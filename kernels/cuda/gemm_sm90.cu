// Hopper (sm_90a) variant of the tree GEMM: the leaf is a chain of wgmma m64n128k16 over
// the segment's k16 chunks, in order, from +0 (same masking rules as gemm_tree.cu, whose
// helpers and Params this file uses; the two are compiled as one program). Every sm_90a
// path below issues that same instruction, so the large-M kernel (whole tree in the block)
// and the small-M split kernel give the same bits.
//
// Shared-memory tiles are [rows][64 bf16] = 128-byte rows written by cp.async in the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r & 7), atoms 1024-aligned),
// the layout wgmma's descriptors read with swizzle mode 1.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The leaf instruction for a consumer warpgroup's tile width (wgmma.cuh's instructions).
template <int WN>
DEVI void wgmma_m64k16(float* d, u64 desc_a, u64 desc_b) {
    if constexpr (WN == 128) {
        wgmma_m64n128k16(d, desc_a, desc_b);
    } else if constexpr (WN == 112) {
        wgmma_m64n112k16(d, desc_a, desc_b);
    } else if constexpr (WN == 96) {
        wgmma_m64n96k16(d, desc_a, desc_b);
    } else if constexpr (WN == 64) {
        wgmma_m64n64k16(d, desc_a, desc_b);
    } else if constexpr (WN == 56) {
        wgmma_m64n56k16(d, desc_a, desc_b);
    } else if constexpr (WN == 48) {
        wgmma_m64n48k16(d, desc_a, desc_b);
    } else if constexpr (WN == 32) {
        wgmma_m64n32k16(d, desc_a, desc_b);
    } else if constexpr (WN == 24) {
        wgmma_m64n24k16(d, desc_a, desc_b);
    } else if constexpr (WN == 16) {
        wgmma_m64n16k16(d, desc_a, desc_b);
    } else if constexpr (WN == 8) {
        wgmma_m64n8k16(d, desc_a, desc_b);
    } else {
        static_assert(WN == 128, "no wgmma for this tile width");
    }
}

// K-major, 128-byte swizzle: 8-row atoms 1024 bytes apart (SBO), LBO unused (16).
DEVI u64 smem_desc(u32 addr) { return wgmma_desc(addr, 16, 1024); }


// One block: BM (64 or 128: one or two warpgroups) x 128 output tile, BK = 64.
template <int BM, int STAGES, bool SPLIT>
DEVI void wg_block(const Params& p, int m_tile, int n_tile, int seg_begin, int seg_count) {
    constexpr int BN = 128, BK = 64, CH = 8;
    constexpr int THREADS = BM * 2;  // 128 per warpgroup of 64 rows
    constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
    constexpr int A_PER = BM * CH / THREADS;  // 16-byte chunks per thread per tile: 4
    constexpr int B_PER = BN * CH / THREADS;  // 8 (one warpgroup) or 4 (two)

    extern __shared__ unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;
    const u32 sA = base;
    const u32 sB = base + STAGES * A_BYTES;
    // Tree-stack spill slots (thread-private, [slot][reg][thread]), generic pointer.
    float* slots = (float*)(smem_raw + (base - raw) + STAGES * (A_BYTES + B_BYTES));

    const int tid = threadIdx.x;
    const int wg = tid >> 7, wl = tid & 127;
    const int row0 = m_tile * BM, col0 = n_tile * BN;
    const int tiles_per_seg = (p.seg_len + BK - 1) / BK;
    const int total = seg_count * tiles_per_seg;

    // Fixed per-thread load assignment: chunk column c, rows tid/8 + j*THREADS/8.
    const int c = tid & 7;
    const u16* a_src[A_PER];
    u32 a_dst[A_PER];
    bool a_ok[A_PER];
#pragma unroll
    for (int j = 0; j < A_PER; ++j) {
        const int r = (tid >> 3) + j * (THREADS / 8);
        a_ok[j] = row0 + r < p.M;
        a_src[j] = p.x + (long long)(a_ok[j] ? row0 + r : 0) * p.ldx + c * 8;
        a_dst[j] = r * 128 + ((c ^ (r & 7)) << 4);
    }
    const u16* b_src[B_PER];
    u32 b_dst[B_PER];
    bool b_ok[B_PER];
#pragma unroll
    for (int j = 0; j < B_PER; ++j) {
        const int r = (tid >> 3) + j * (THREADS / 8);
        b_ok[j] = col0 + r < p.N;
        b_src[j] = p.w + (long long)(b_ok[j] ? col0 + r : 0) * p.ldw + c * 8;
        b_dst[j] = r * 128 + ((c ^ (r & 7)) << 4);
    }

    // Load cursor: tile index, its segment and k offset.
    int ls = seg_begin, lkt = 0;
    auto load_next = [&](int stage) {
        const int k0 = ls * p.seg_len + lkt * BK;
        const int khi = min((ls + 1) * p.seg_len, p.K);
        const bool kok = k0 + c * 8 < khi;
        const u32 sa = sA + stage * A_BYTES, sb = sB + stage * B_BYTES;
        // Rows past M (columns past N) are left unwritten: an MMA output row depends only
        // on its own A row (column on its own B row), and those outputs are never stored.
        // At decode (M = 1) this skips 63 of the 64 A rows' zero-fills per tile.
#pragma unroll
        for (int j = 0; j < A_PER; ++j) {
            if (!a_ok[j]) continue;
            cp_async16(sa + a_dst[j], kok ? (const void*)(a_src[j] + k0) : (const void*)p.x, kok);
        }
#pragma unroll
        for (int j = 0; j < B_PER; ++j) {
            if (!b_ok[j]) continue;
            cp_async16(sb + b_dst[j], kok ? (const void*)(b_src[j] + k0) : (const void*)p.w, kok);
        }
        if (++lkt == tiles_per_seg) lkt = 0, ++ls;
    };

    float acc[64];
    float root[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f, root[i] = 0.f;

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
            fence_proxy_async();
            __syncthreads();
            {
                const int tn = t + STAGES - 1;
                if (tn < total) load_next(tn % STAGES);
                cp_commit();
            }
            const int stage = t % STAGES;
            const int k0 = s * p.seg_len + kt * BK;
            // k16 chunks of this tile that start inside the segment (the leaf's chunks).
            const int nk = min(BK / 16, max(0, (khi - k0 + 15) / 16));
            const u64 da = smem_desc(sA + stage * A_BYTES + wg * 64 * 128);
            const u64 db = smem_desc(sB + stage * B_BYTES);
            wgmma_fence();
            if (nk == BK / 16) {
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk)
                    wgmma_m64n128k16(acc, da + 2 * kk, db + 2 * kk);
            } else {
                for (int kk = 0; kk < nk; ++kk) wgmma_m64n128k16(acc, da + 2 * kk, db + 2 * kk);
            }
            wgmma_commit();
            wgmma_wait0();
        }

        // Accumulator element i: row 16*(warp in group) + lane/4 + 8*((i/2)&1),
        // column 8*(i/4) + 2*(lane%4) + (i&1).
        if (SPLIT) {
            float* dst = p.ws + (long long)s * p.M * p.N;
            const int lane = wl & 31, wq = wl >> 5;
#pragma unroll
            for (int i = 0; i < 64; i += 2) {
                const int r = row0 + wg * 64 + wq * 16 + (lane >> 2) + 8 * ((i >> 1) & 1);
                const int cc = col0 + 8 * (i >> 2) + 2 * (lane & 3);
                if (r < p.M) {
                    if (cc < p.N) dst[(long long)r * p.N + cc] = acc[i];
                    if (cc + 1 < p.N) dst[(long long)r * p.N + cc + 1] = acc[i + 1];
                }
            }
        } else {
            float* s0 = slots;
            float* s1 = slots + 64 * THREADS;
#pragma unroll
            for (int i = 0; i < 64; ++i) {
                const int j = i * THREADS + tid;
                const float v = acc[i];
                float& r = root[i];
                switch (sl) {
                    case 0: r = v; break;
                    case 1: r = r + v; break;
                    case 2: s0[j] = v; break;
                    case 3: r = r + (s0[j] + v); break;
                    case 4: s0[j] = v; break;
                    case 5: s0[j] = s0[j] + v; break;
                    case 6: s1[j] = v; break;
                    default: r = r + (s0[j] + (s1[j] + v));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    }
    cp_wait<0>();

    if (SPLIT) {
        split_finish<BM, BN, THREADS>(p, plain_rows<BM>(p, m_tile), n_tile);
    } else {
        const int lane = wl & 31, wq = wl >> 5;
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
            const int r = row0 + wg * 64 + wq * 16 + (lane >> 2) + 8 * ((i >> 1) & 1);
            const int cc = col0 + 8 * (i >> 2) + 2 * (lane & 3);
            if (r >= p.M) continue;
            const long long idx = (long long)r * p.N + cc;
            if (cc < p.N) store_out(p.outf, p.outh, idx, root[i]);
            if (cc + 1 < p.N) store_out(p.outf, p.outh, idx + 1, root[i + 1]);
        }
    }
}

// Large M: 128x128 tiles (two warpgroups), 3 stages, the whole tree in the block; grouped
// 1-D grid as arbor_gemm_tree_128x128.
extern "C" __global__ void __launch_bounds__(256, 1) arbor_gemm_wg_tree_128x128(Params p) {
    const int num_m = (p.M + 127) / 128;
    const int num_n = (p.N + 127) / 128;
    const int group = 8;
    const int pid = blockIdx.x;
    const int per_group = group * num_n;
    const int first_m = (pid / per_group) * group;
    const int gsize = min(num_m - first_m, group);
    const int m_tile = first_m + (pid % per_group) % gsize;
    const int n_tile = (pid % per_group) / gsize;
    wg_block<128, 3, false>(p, m_tile, n_tile, 0, p.n_seg);
}

// Small M: one block per (128 columns, segment, 64 rows); split_finish combines.
extern "C" __global__ void __launch_bounds__(128) arbor_gemm_wg_split_64x128(Params p) {
    wg_block<64, 4, true>(p, blockIdx.z, blockIdx.x, blockIdx.y, 1);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
