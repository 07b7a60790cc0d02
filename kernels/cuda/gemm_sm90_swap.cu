// Hopper (sm_90a) tree GEMM for a few rows of X with the operands swapped: W's rows are
// the wgmma's 64-row A side and X's rows (up to 8) its N side, so that a warpgroup's
// accumulator is 64 W rows x 8 X rows (4 values a thread) rather than 64 X rows of which
// one may be real. A leaf element is the same chain as every other path's: wgmma's output
// element (r, c) is the sum of its own row of A times its own row of B, in k order, onto
// its own accumulator, whichever operand is which. That the tensor core rounds the two the
// same is this hardware's behaviour, not the ISA's promise; the GPU tests compare this path
// with the others bit for bit. With the accumulator this small, the ring takes the whole
// of shared memory (24 stages of 9 KB at 64 W rows a block) and the block's subtree never
// leaves registers.
// Uses gemm_sm90_tma.cu's ring, leaf, TMA, cluster and epilogue helpers.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// X rows a block (the N side), one A operand's bytes a k-tile (64 W rows x 64 columns),
// and the shared memory the ring fills.
constexpr int SWAP_XR = 8;
constexpr int SWAP_SUB_BYTES = 64 * 64 * 2;
constexpr int SWAP_SMEM = 224 * 1024;

// Stages of [W (64·S)x64 | X 8x64] (S x 8 KB and 1 KB: whole 1024-byte swizzle atoms). A
// ring of fewer than six stages releases each one as soon as its wgmma group is done.
template <int S>
struct SwapLayout {
    static constexpr int TW = 64 * S;       // W rows a block
    static constexpr int A = SWAP_XR / 2;   // accumulator values a thread, an A operand
    static constexpr int W_BYTES = S * SWAP_SUB_BYTES;
    static constexpr int STAGE_BYTES = W_BYTES + SWAP_XR * 64 * 2;
    static constexpr int STAGES = SWAP_SMEM / STAGE_BYTES;
    static constexpr bool HOLD1 = STAGES >= 6;
    static_assert(STAGE_BYTES % 1024 == 0, "a stage must keep the swizzle atoms aligned");
    static_assert(STAGES >= 2, "the ring needs two stages");
};

// The producer's stage `it`: once free, k-tile kt of segment seg, S W boxes of 64 rows
// from w_row and X rows from m0, completing on the stage's full barrier.
template <int S>
DEVI void swap_produce(const TmaParams& p, u32 ring, u32 full, u32 empty, u32 it, int kt, int seg,
                       int w_row, int m0) {
    using L = SwapLayout<S>;
    const int stage = (int)(it % L::STAGES);
    mbar_wait(empty + 8 * stage, ((it / L::STAGES) & 1) ^ 1);
    const u32 fb = full + 8 * stage, dst = ring + stage * L::STAGE_BYTES;
    mbar_expect_tx(fb, L::STAGE_BYTES);
    load_w_boxes<S, 64>(p, dst, kt, seg, w_row, fb);
    tma_load_3d(dst + L::W_BYTES, &p.tx, kt * 64, seg, m0, fb);
}

// Leaf j's sums folded into the block's subtree over its segments, pairwise as the tree
// is: level[l] holds the finished subtree of 2^l leaves waiting for its right sibling.
// After the last leaf, acc holds the block's subtree root.
template <int N>
DEVI void swap_fold_leaf(float* acc, float (&level)[3][N], int j, bool last) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float v = acc[i];
        int l = 0;
        if (j & 1) {
            v = level[0][i] + v;
            l = 1;
            if (j & 2) {
                v = level[1][i] + v;
                l = 2;
                if (j & 4) {
                    v = level[2][i] + v;
                    l = 3;
                }
            }
        }
        if (last) acc[i] = v;
        else level[l][i] = v;
    }
}

// The swapped kernel: one block per (64·S W rows, SPC segments, 8 rows of X), its subtree
// over the SPC segments in registers, and a tile's n_seg / SPC blocks a cluster that folds
// the subtrees over DSMEM (as the wgquad kernels do), each block storing 1/(n_seg / SPC)
// of the tile. No workspace. Grid (ceil(N / (64·S)) · n_seg / SPC, ceil(M / 8)); 160
// threads: warpgroup 0 consumes, the warp after it produces (one thread issues every TMA).
// The forms (S, SPC) are the ones whose grid is one wave of resident clusters for a
// llama3-8b layer at some TP (docs/gemm.md).
template <int S, int SPC>
DEVI void swap_body(const TmaParams& p) {
    using L = SwapLayout<S>;
    constexpr int XR = SWAP_XR, TW = L::TW;
    constexpr int STAGES = L::STAGES, STAGE_BYTES = L::STAGE_BYTES, A = L::A;
    constexpr int RED = TW + 4;  // f32 row stride of the block's subtree roots
    static_assert(XR * RED * 4 <= STAGES * STAGE_BYTES, "the subtree roots must fit in the ring");
    extern __shared__ unsigned char sq_smem[];
    const u32 raw = smem_addr(sq_smem);
    const u32 base = (raw + 1023u) & ~1023u;
    const u32 ring = base;
    const u32 full = base + STAGES * STAGE_BYTES;
    const u32 empty = full + 8 * STAGES;
    require_smem(empty + 8 * STAGES - raw);
    // After the leaves the ring holds the block's [XR][RED] subtree roots.
    float* red = (float*)(sq_smem + (base - raw));

    const int tid = threadIdx.x;
    // Segments a block (fewer where the call has fewer), blocks a tile.
    const int spc = min(SPC, p.n_seg), ns = p.n_seg / spc;
    const int r = ns > 1 ? (int)cluster_ctarank() : 0;
    const int t = (int)blockIdx.x / ns;
    const int m0 = (int)blockIdx.y * XR, rows = min(XR, p.M - m0);
    const int tps = (p.seg_len + 63) / 64;
    if (tid == 0) {
        for (int q = 0; q < STAGES; ++q) {
            mbar_init(full + 8 * q, 1);
            mbar_init(empty + 8 * q, EMPTY_ARRIVALS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup_uniform() == 1) {
        if (tid == 128) {
            tma_prefetch_map(&p.tx);
            tma_prefetch_map(&p.tw);
            // W (constant) before the PDL wait, so under PDL it streams while the previous
            // kernel finishes; X (its output) after it.
            const int early = p.w_early ? min(STAGES, spc * tps) : 0;
            for (int e = 0; e < early; ++e) {
                mbar_expect_tx(full + 8 * e, STAGE_BYTES);
                load_w_boxes<S, 64>(p, ring + e * STAGE_BYTES, e % tps, r * spc + e / tps, t * TW, full + 8 * e);
            }
            pdl_enter();
            for (int e = 0; e < early; ++e)
                tma_load_3d(ring + e * STAGE_BYTES + L::W_BYTES, &p.tx, (e % tps) * 64, r * spc + e / tps, m0,
                            full + 8 * e);
            u32 it = 0;
            for (int j = 0; j < spc; ++j)
                for (int kt = 0; kt < tps; ++kt, ++it)
                    if ((int)it >= early) swap_produce<S>(p, ring, full, empty, it, kt, r * spc + j, t * TW, m0);
        } else {
            pdl_enter();
        }
    } else {
        pdl_enter();
        const bool releaser = tid == 0;
        float acc[S * A], level[3][S * A];
        u32 it = 0;
#pragma unroll
        for (int j = 0; j < SPC; ++j) {
            if (j < spc) {
                // The leaf with W (at the stage's start) as the A operand(s) and X as the B.
                leaf_segment<STAGES, STAGE_BYTES, XR, S, SWAP_SUB_BYTES, L::HOLD1>(
                    acc, ring, ring + L::W_BYTES, full, empty, 0, p.seg_len, tps, it, releaser);
                swap_fold_leaf(acc, level, j, j == spc - 1);
            }
        }
        // Every TMA has landed (the consumer waited for each) and every wgmma has read its
        // stage, so the ring takes the roots.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        warpgroup_bar(0);
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
            for (int j = 0; j < A; ++j) {
                const int c = acc_col(tid, j);
                if (c < rows) red[c * RED + 64 * s + acc_row(tid, j)] = acc[s * A + j];
            }
    }
    if (ns > 1)
        cluster_sync();
    else
        __syncthreads();
    // This block's share of the tile's 4-column groups: the ns subtree roots of each, one
    // 16-byte DSMEM load apiece, folded by the tree's top (tree_of over ns).
    constexpr int GROUPS = TW / 4;
    const int total = rows * GROUPS, per = (total + ns - 1) / ns;
    const int g_end = min(total, (r + 1) * per);
    const u32 red_addr = smem_addr(red);
    for (int gi = r * per + tid; gi < g_end; gi += 160) {
        const int c = gi / GROUPS, nl = (gi % GROUPS) * 4, n = t * TW + nl;
        if (n >= p.N) continue;
        float x[4][8];
        const u32 a = red_addr + (u32)(c * RED + nl) * 4u;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            if (q < ns) {
                const float4 v = ns > 1 ? ld_cluster4(map_to_rank(a, (u32)q)) : *(const float4*)(red + c * RED + nl);
                x[0][q] = v.x, x[1][q] = v.y, x[2][q] = v.z, x[3][q] = v.w;
            }
        }
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = tree_of(x[j], ns);
        if (p.epi) {
            const int np = n + 3 < p.N ? 2 : (n + 1 < p.N ? 1 : 0);
            if (np > 0) store_silu(p, m0 + c, n >> 1, np, silu_mul(v[0], v[1]), np == 2 ? silu_mul(v[2], v[3]) : 0.f);
        } else {
            store_roots4(p, m0 + c, n, v);
        }
    }
    // No block may leave while another still reads its shared memory.
    if (ns > 1) cluster_sync();
}

// The forms (W rows a block, segments a block); path.rs SWAP_FORMS lists the same.
#define ARBOR_SWAP_KERNEL(TW, SPC)                                                            \
    extern "C" __global__ void __launch_bounds__(160, 1)                                      \
        arbor_gemm_wg_swap_##TW##x8_s##SPC(const __grid_constant__ TmaParams p) {             \
        swap_body<TW / 64, SPC>(p);                                                           \
    }
ARBOR_SWAP_KERNEL(64, 1)
ARBOR_SWAP_KERNEL(64, 2)
ARBOR_SWAP_KERNEL(64, 4)
ARBOR_SWAP_KERNEL(64, 8)
ARBOR_SWAP_KERNEL(128, 4)
ARBOR_SWAP_KERNEL(128, 8)
ARBOR_SWAP_KERNEL(448, 4)
#undef ARBOR_SWAP_KERNEL

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
