// Hopper (sm_90a) grouped expert GEMM for many pairs per expert: gemm_sm90_tma.cu's
// persistent, warp-specialised 128x128 TMA kernel over the routing's row tiles (moe.cu
// moe_schedule_kernel with bm = 128), each tile inside one expert. X is the pairs' rows
// laid out by expert ([P, K] bf16: the down projection's input as the gate/up projection
// wrote it, or the gate/up projection's X gathered by arbor_moe_gather_rows), W of the
// tile's expert is read through that expert's own tensor map. Each element is the wgmma
// leaf chain and the tree of the dense kernel, over its own X row and W row: a tile's rows
// past its expert's end (the next expert's pairs, or TMA's zero fill past P) are computed
// and never stored, and do not touch the stored rows' arithmetic.
//
// The grid is fixed by the call's P (the host sizes it from the most tiles the routing
// can write), so a step can be recorded; the blocks walk the tile count the routing wrote.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

struct __align__(64) MoeTmaParams {
    TensorMap tx;              // the pairs' X [P][n_seg][seg_len], box {64, 1, 128}
    const TensorMap* tw;       // [experts] expert e's W [N][n_seg][seg_len], box {64, 1, 128}
    const int* tile_expert;    // the routing's tile tables (struct MoeTiles)
    const int* tile_row0;
    const int* tile_end;
    const int* n_tiles;
    float* outf;  // [P, N] f32 roots (not SILU)
    u16* outh;    // SILU: [P, N / 2] bf16 silu(gate)·up
    int P, N, seg_len, n_seg;
};

// The maps of the experts' weights were written by a host copy: the tensormap proxy must
// see them before a TMA reads one (CUDA C++ Programming Guide, passing a tensor map in
// global memory).
DEVI void tensormap_acquire(const TensorMap* map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;\n" ::"l"((u64)map) : "memory");
}

template <bool SILU>
DEVI void moe_wg_tma_body(const MoeTmaParams& p) {
    extern __shared__ unsigned char moe_tma_smem[];
    const u32 raw = smem_addr(moe_tma_smem);
    const u32 base = (raw + 1023u) & ~1023u;
    // The dense kernel's layout: STAGES x [A 128x64 | B 128x64], the s6 slot, barriers.
    const u32 ring = base;
    float* slot = (float*)(moe_tma_smem + (base - raw) + TMA_STAGES * TMA_STAGE_BYTES);
    const u32 full = base + TMA_STAGES * TMA_STAGE_BYTES + 64 * 256 * 4;
    const u32 empty = full + 8 * TMA_STAGES;
    require_smem(empty + 8 * TMA_STAGES - raw);

    const int tid = threadIdx.x;
    const int wg = warpgroup_uniform();
    if (tid == 0) {
        for (int s = 0; s < TMA_STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 2 * EMPTY_ARRIVALS);  // two consumer warpgroups
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        tma_prefetch_map(&p.tx);
    }
    // The tile tables and X are the previous kernels' output.
    pdl_enter();
    __syncthreads();

    const int num_m = *p.n_tiles, num_n = (p.N + 127) / 128;
    const int tiles = num_m * num_n;
    const int tps = (p.seg_len + 63) / 64;

    if (wg == 2) {
        producer_registers();
        if (tid != 256) return;
        u32 it = 0;
        int fenced = -1;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            int mt, nt;
            tile_coords(t, num_m, num_n, mt, nt);
            const int e = p.tile_expert[mt], x_row = p.tile_row0[mt];
            const TensorMap* tw = p.tw + e;
            if (e != fenced) {
                tensormap_acquire(tw);
                fenced = e;
            }
            for (int s = 0; s < p.n_seg; ++s) {
                for (int kt = 0; kt < tps; ++kt, ++it) {
                    const int stage = (int)(it % TMA_STAGES);
                    mbar_wait(empty + 8 * stage, ((it / TMA_STAGES) & 1) ^ 1);
                    const u32 fb = full + 8 * stage;
                    mbar_expect_tx(fb, TMA_STAGE_BYTES);
                    const u32 dst = ring + stage * TMA_STAGE_BYTES;
                    tma_load_3d(dst, &p.tx, kt * 64, s, x_row, fb);
                    tma_load_3d(dst + TMA_A_BYTES, tw, kt * 64, s, nt * 128, fb);
                }
            }
        }
        return;
    }

    const int g = wg;
    const int wl = tid & 127;
    const bool releaser = wl == 0;
    consumer_registers();
    float acc[64], root[64], p1[64];
    u32 it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int mt, nt;
        tile_coords(t, num_m, num_n, mt, nt);
        // Rows from the tile's first pair up to its expert's end are this tile's; a
        // warpgroup with none of them runs no wgmma.
        const int row0 = p.tile_row0[mt] + g * 64, end = p.tile_end[mt], col0 = nt * 128;
        tile_tree<TMA_STAGES, TMA_STAGE_BYTES, TMA_A_BYTES>(
            root, acc, p1, slot + g * 64 * 128 + wl, ring, full, empty, g * 64 * 128, p.seg_len,
            tps, p.n_seg, it, releaser, [] {}, row0 >= end);
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
            const int r = row0 + acc_row(wl, i);
            const int c = col0 + acc_col(wl, i);
            if (r >= end) continue;
            if (SILU) {
                // c is even: the pair (c, c + 1) is (gate j, up j), j = c / 2.
                if (c + 1 < p.N)
                    p.outh[(long long)r * (p.N >> 1) + (c >> 1)] = f32_to_bf16(silu_mul(root[i], root[i + 1]));
                continue;
            }
            const long long idx = (long long)r * p.N + c;
            if (c + 1 < p.N && ((idx & 1) == 0)) {
                *(float2*)(p.outf + idx) = make_float2(root[i], root[i + 1]);
            } else {
                if (c < p.N) p.outf[idx] = root[i];
                if (c + 1 < p.N) p.outf[idx + 1] = root[i + 1];
            }
        }
    }
}

// 384 threads: two consumer warpgroups (rows 0-63 and 64-127 of the tile), one producer.
extern "C" __global__ void __launch_bounds__(384, 1)
    arbor_moe_gemm_wg_tma_128x128(const __grid_constant__ MoeTmaParams p) {
    moe_wg_tma_body<false>(p);
}
extern "C" __global__ void __launch_bounds__(384, 1)
    arbor_moe_gemm_wg_tma_128x128_silu(const __grid_constant__ MoeTmaParams p) {
    moe_wg_tma_body<true>(p);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
