// Hopper (sm_90a) tree GEMM with TMA loads and warp specialisation. Same leaf as
// gemm_sm90.cu (a chain of wgmma m64n128k16 over the segment's k16 chunks, in order, from
// +0; the chunk crossing the segment end zero-filled; no chunk issued past it), same tree,
// so every path of the Wgmma family gives the same bits.
//
// The segment structure is in the TMA view itself: X [M, ldx] and W [N, ldw] are described
// as 3-D tensors [rows][n_seg][seg_len] (strides ld and seg_len elements), so a box of
// 64 columns at (k, s, row) never reads past the end of segment s: TMA zero-fills the
// columns from seg_len on, exactly the zero-fill the leaf needs. This needs
// k == n_seg * seg_len (checked on the host; the model's tensor layers always have it).
//
// The kernels:
// - arbor_gemm_wg_tma_128x128 (large M): persistent, one producer thread issuing TMA into
//   a 5-deep ring guarded by mbarriers, two consumer warpgroups of 64x128 each running the
//   whole tree of their tile (tile_tree). The tree needs up to three pending 64x128
//   partials besides the running leaf; the producer gives registers to the consumers
//   (setmaxnreg), so the leaf, the root and p1 are in registers and s6 waits in shared
//   memory. arbor_gemm_wg_tma_128x{96,64}: the same on narrower tiles (more tiles, so
//   that a layer at 129-1024 rows fills the SMs' last round), with a deeper ring.
// - arbor_gemm_wg_cluster_64x128 (small M): one block per (128 columns, segment, 64 rows),
//   the n_seg blocks of a tile form a thread-block cluster; each leaves its segment sum in
//   its own shared memory and the cluster combines them over distributed shared memory in
//   tree order, every block finishing 1/n_seg of the tile. No workspace, no atomics.
//   arbor_gemm_wg_cluster2_64x128: the same with two segments per block (half the blocks).
// - arbor_gemm_wg_quad_128x{128,64} (129 <= M <= 512): the quad kernels' blocks (four
//   segments a block, clusters of two) on 128-row tiles, the two consumer warpgroups
//   stacked over the rows and sharing each W tile, so that a narrow layer at M = 256 makes
//   a full wave of blocks where wgtma128's whole-K tiles made half of one.
// - arbor_gemm_wg_whole_64x{224,112,64,48,32} (small M, wide N): one block per 64-row tile
//   of that many columns summing every segment and evaluating the tree itself (leaf and
//   root in registers, two pending partials in shared memory), so that a grid of one block
//   per SM needs no cluster and no second, partial wave.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

struct __align__(64) TensorMap {
    u64 opaque[16];
};

struct __align__(64) TmaParams {
    TensorMap tx;  // X as [M][n_seg][seg_len], box {64, 1, BM}
    TensorMap tw;  // W as [N][n_seg][seg_len], box {64, 1, 128}
    TensorMap to;  // large-M kernel with tma_out: the f32 [M, N] result (epi 1: [M, N/2]), box {32, 64}
    TensorMap toh; // large-M kernel with tma_out, epi 1, outh set: the bf16 [M, N/2] result, box {64, 64}
    float* outf;   // [M, N] f32 result, or null
    u16* outh;     // [M, N] bf16 result, or null
    int M, N, seg_len, n_seg;
    // 1: W is constant while the previous kernels run (model weights), so a kernel launched
    // with PDL may load its first W tiles before pdl_enter().
    int w_early;
    // 0: store the [M, N] roots. 1: W's rows alternate gate and up (N = 2·inter); store
    // silu(gate)·up, [M, N/2], to outf and, if set, rounded to bf16 to outh.
    int epi;
    // Large-M kernel: 1 when the result leaves by TMA store from shared memory, overlapping
    // the next tile's mainloop: epi 0, f32 roots (no bf16) through `to`; epi 1, silu(gate)·up
    // through `to` (f32, where outf is set) and `toh` (bf16, where outh is set).
    int tma_out;
    // 1: a consumer warpgroup whose 64 rows all lie at or past M (the last tile of
    // 129-192 rows) runs no wgmma: it only passes the ring's stages on. Those rows are
    // never stored; their MMAs cost the SM's tensor cores (and power) all the same.
    int skip_idle;
    // 1 (with tma_out): a warpgroup with only some rows below M stores by TMA as well (the
    // TMA unit clips the box at M); 0: such a warpgroup stores from registers.
    int tma_partial;
    // Large-M kernel: 1 when a block takes every row tile of a column before its next
    // column (block_tile), 0 when the blocks walk the tiles in groups of 8 row tiles.
    int column_order;
    // Large-M kernel: the last `tail` tiles (0: none) are each done by two blocks, one per
    // half of the segments, where they would otherwise fill only part of a last round of
    // the grid (block_unit). Each half's subtree root goes to ws; the warpgroup that
    // arrives second at the tile's counter in cnt adds the two (tail_combine) and stores.
    float* ws;       // tail x 2 warpgroups x 2 halves x (64 x WN) f32, or null
    unsigned* cnt;   // tail x 2 arrival counters, zero between calls, or null
    int tail;
};

DEVI void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
DEVI void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
DEVI void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// A stage's empty barrier expects this many arrivals from each consumer warpgroup: its
// releaser's one arrival of this count after the stage's wgmma group, or one from each
// of its warps where it runs none (leaf_segment, idle).
constexpr u32 EMPTY_ARRIVALS = 4;
DEVI void mbar_release(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "n"(EMPTY_ARRIVALS) : "memory");
}
DEVI void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// One 3-D box {64 columns, 1 segment, rows} of `map` at (k, seg, row) into shared memory,
// completing `bytes` on `bar`.
DEVI void tma_load_3d(u32 dst, const TensorMap* map, int k, int seg, int row, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"((u64)map), "r"(k), "r"(seg), "r"(row), "r"(bar)
        : "memory");
}
DEVI void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)map) : "memory");
}
// The TMA store of one 2-D box from shared memory at `src` to (col, row) of `map`, in this
// thread's bulk group.
DEVI void tma_store_2d(const TensorMap* map, u32 src, int col, int row) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                     (u64)map),
                 "r"(col), "r"(row), "r"(src)
                 : "memory");
}
DEVI void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// This thread's bulk stores have read their shared memory (it may be rewritten).
DEVI void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
DEVI void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Shared-memory writes of this thread visible to the async proxy (a TMA store's reads).
DEVI void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// A barrier of the 128 threads of one warpgroup (ids 1 and 2; 0 is __syncthreads).
DEVI void warpgroup_bar(int g) { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + g) : "memory"); }

// The host sizes dynamic shared memory from its own copy of the layout (Path::smem_bytes);
// a block given less than the layout needs stops here instead of corrupting memory.
DEVI void require_smem(u32 bytes) {
    u32 have;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(have));
    if (have < bytes) __trap();
}

DEVI void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

// The warpgroup index as a warp-uniform value, so that ptxas sees the role branches as
// uniform per warpgroup (otherwise it serialises the wgmma in them).
DEVI int warpgroup_uniform() { return __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0); }


// The producer side of the ring: waits until stage `it % STAGES` is free, then loads
// k-tile kt of segment seg into it (X rows from x_row into the first A_BYTES, W rows from
// w_row after them), completing on that stage's full barrier.
// NW W boxes of WN rows (w_row, w_row + WN, ...) of k-tile kt, segment seg, one after
// another from dst, completing on bar (the W map's box has WN rows).
template <int NW, int WN = 128>
DEVI void load_w_boxes(const TmaParams& p, u32 dst, int kt, int seg, int w_row, u32 bar) {
#pragma unroll
    for (int i = 0; i < NW; ++i)
        tma_load_3d(dst + i * WN * 64 * 2, &p.tw, kt * 64, seg, w_row + WN * i, bar);
}

// NW: W boxes of WN rows per stage (load_w_boxes).
template <int STAGES, int STAGE_BYTES, int A_BYTES, int NW = 1, int WN = 128>
DEVI void produce_stage(const TmaParams& p, u32 ring, u32 full, u32 empty, u32 it, int kt,
                        int seg, int x_row, int w_row) {
    const int stage = (int)(it % STAGES);
    mbar_wait(empty + 8 * stage, ((it / STAGES) & 1) ^ 1);
    const u32 fb = full + 8 * stage;
    mbar_expect_tx(fb, STAGE_BYTES);
    const u32 dst = ring + stage * STAGE_BYTES;
    tma_load_3d(dst, &p.tx, kt * 64, seg, x_row, fb);
    load_w_boxes<NW, WN>(p, dst + A_BYTES, kt, seg, w_row, fb);
}

// k16 chunks of k-tile kt (64 columns) that start inside a segment of seg_len columns.
DEVI int chunks_in_tile(int seg_len, int kt) { return min(4, (seg_len - kt * 64 + 15) / 16); }

// The consumer side of the ring: runs the leaf of one segment (tiles_per_seg k-tiles) of
// this warpgroup's 64 rows x WN columns into acc (WN / 2 values a thread), releasing each
// stage once its wgmma group is done. `it` counts k-tiles consumed by this block
// (stage = it % STAGES, parity = its round).
// idle (uniform in the warpgroup): its rows are never stored, so it only waits for each
// stage and releases it, and acc stays zero. Each warp releases the stage itself: with no
// wgmma tying the warps to one releaser, a warp left two rounds of the ring behind would
// read a later phase's parity as its own and wait forever. (A releaser-only walk with a
// warpgroup barrier makes ptxas serialise every wgmma of the kernel: C7520.)
// S: A operands a stage, A_STEP bytes apart, each onto its own WN / 2 values of acc with
// the stage's one B operand (the swapped kernels' taller W tiles; each element's chain is
// the one-operand chain). HOLD1: keep a wgmma group in flight across stages (the stage
// is released one k-tile late); a ring of a few large stages releases each at once.
template <int STAGES, int STAGE_BYTES, int WN = 128, int S = 1, int A_STEP = 0, bool HOLD1 = true>
DEVI void leaf_segment(float* acc, u32 sA, u32 sB, u32 full, u32 empty, int a_row_off,
                       int seg_len, int tiles_per_seg, u32& it, bool releaser, bool idle = false) {
#pragma unroll
    for (int i = 0; i < S * WN / 2; ++i) acc[i] = 0.f;
    if (idle) {
        for (int kt = 0; kt < tiles_per_seg; ++kt, ++it) {
            const int stage = (int)(it % STAGES);
            mbar_wait(full + 8 * stage, (it / STAGES) & 1);
            if ((threadIdx.x & 31) == 0) mbar_arrive(empty + 8 * stage);
        }
        return;
    }
    int prev = -1;
    for (int kt = 0; kt < tiles_per_seg; ++kt, ++it) {
        const int stage = (int)(it % STAGES);
        mbar_wait(full + 8 * stage, (it / STAGES) & 1);
        const u64 da = smem_desc(sA + stage * STAGE_BYTES + a_row_off);
        const u64 db = smem_desc(sB + stage * STAGE_BYTES);
        const int nk = chunks_in_tile(seg_len, kt);
        wgmma_fence();
        if (nk == 4) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                for (int s = 0; s < S; ++s)
                    wgmma_m64k16<WN>(acc + s * (WN / 2), da + 2 * kk + s * (A_STEP >> 4), db + 2 * kk);
        } else {
            for (int kk = 0; kk < nk; ++kk)
#pragma unroll
                for (int s = 0; s < S; ++s)
                    wgmma_m64k16<WN>(acc + s * (WN / 2), da + 2 * kk + s * (A_STEP >> 4), db + 2 * kk);
        }
        wgmma_commit();
        if constexpr (HOLD1) {
            // Keep one group in flight: the previous tile's group is done, free its stage.
            wgmma_wait1();
            if (prev >= 0 && releaser) mbar_release(empty + 8 * prev);
            prev = stage;
        } else {
            wgmma_wait0();
            if (releaser) mbar_release(empty + 8 * stage);
        }
    }
    if constexpr (HOLD1) {
        wgmma_wait0();
        if (prev >= 0 && releaser) mbar_release(empty + 8 * prev);
    }
}

// Accumulator element i of a thread of a 64x128 wgmma tile: row 16*(warp in group) +
// lane/4 + 8*((i/2)&1), column 8*(i/4) + 2*(lane%4) + (i&1).
DEVI int acc_row(int wl, int i) { return ((wl >> 5) << 4) + ((wl & 31) >> 2) + 8 * ((i >> 1) & 1); }
DEVI int acc_col(int wl, int i) { return 8 * (i >> 2) + 2 * (wl & 3) + (i & 1); }

// The epilogue's stores. Roots: one 16-byte (f32) or 8-byte (bf16) store per 4 columns
// where the row allows it (scalar stores left 3/4 of every written sector unused).
DEVI void store_roots4(const TmaParams& p, long long row, int col, const float* v) {
    const long long idx = row * p.N + col;
    if (col + 3 < p.N) {
        if (p.outh && ((idx & 3) == 0)) {
            const u32 lo = (u32)f32_to_bf16(v[0]) | ((u32)f32_to_bf16(v[1]) << 16);
            const u32 hi = (u32)f32_to_bf16(v[2]) | ((u32)f32_to_bf16(v[3]) << 16);
            *(uint2*)(p.outh + idx) = make_uint2(lo, hi);
            return;
        }
        if (!p.outh && ((idx & 3) == 0)) {
            *(float4*)(p.outf + idx) = make_float4(v[0], v[1], v[2], v[3]);
            return;
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (col + j < p.N) store_out(p.outf, p.outh, idx + j, v[j]);
}

// silu(gate)·up of n (1 or 2) gate/up column pairs, output columns j, j + 1 of a row of N/2.
// Either output may be null (not both): a bf16-only result feeds the next GEMM alone.
DEVI void store_silu(const TmaParams& p, long long row, int j, int n, float y0, float y1) {
    const long long idx = row * (p.N >> 1) + j;
    if (n == 2 && (idx & 1) == 0) {
        if (p.outf) *(float2*)(p.outf + idx) = make_float2(y0, y1);
        if (p.outh) *(u32*)(p.outh + idx) = (u32)f32_to_bf16(y0) | ((u32)f32_to_bf16(y1) << 16);
        return;
    }
    if (p.outf) p.outf[idx] = y0;
    if (p.outh) p.outh[idx] = f32_to_bf16(y0);
    if (n == 2) {
        if (p.outf) p.outf[idx + 1] = y1;
        if (p.outh) p.outh[idx + 1] = f32_to_bf16(y1);
    }
}

// Register budgets of the persistent 384-thread kernels: the block starts with 168 a
// thread (65536 / 384, rounded down to a multiple of 8); the producer warpgroup, which
// only issues TMA, gives back down to 40 and the two consumer warpgroups take 232 each
// (2·128·232 + 128·40 = 64512 of the 65536), enough for three live 64x128 tiles of the
// tree (leaf, root and p1) without spills.
DEVI void producer_registers() { asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory"); }
DEVI void consumer_registers() { asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory"); }

// The consumer side of one 64x128 output tile of a persistent kernel: the leaves of its
// n_seg segments (8, or 1, 2 or 4 for a TP shard's subtree) from the ring, summed into
// root as ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)) while they arrive. Straight-line, so each
// leaf runs into the register tile that keeps it: root, acc and p1 are registers, s6 waits
// for one segment in a thread-private shared-memory slot (`s6[64 · 128]`: the thread's
// values 128 floats apart in its warpgroup's half of the slot, conflict-free). `before_s6`
// runs before the slot is written (the dense kernel's TMA store may still be reading it).
// WN: the tile's columns (each leaf a 64 x WN wgmma chain, WN / 2 values a thread).
template <int STAGES, int STAGE_BYTES, int A_BYTES, int WN = 128, typename BeforeS6>
DEVI void tile_tree(float* root, float* acc, float* p1, float* s6, u32 ring, u32 full,
                    u32 empty, int a_row_off, int seg_len, int tps, int n_seg, u32& it,
                    bool releaser, BeforeS6 before_s6, bool idle = false) {
    // Each leaf drains its wgmma groups before the tree step. Chaining a leaf into another
    // tile without draining (s1 issued while s0's last group runs), even with that tile
    // zeroed beforehand, makes ptxas (13.0) serialise every wgmma of the kernel (C7515:
    // non-wgmma instructions define accumulator registers inside a pipeline stage).
#define LEAF(dst) \
    leaf_segment<STAGES, STAGE_BYTES, WN>(dst, ring, ring + A_BYTES, full, empty, a_row_off, seg_len, tps, it, releaser, idle)
    LEAF(root);
    if (n_seg > 1) {
        LEAF(acc);
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) root[i] = root[i] + acc[i];
    }
    if (n_seg > 2) {
        LEAF(p1);
        LEAF(acc);
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) root[i] = root[i] + (p1[i] + acc[i]);
    }
    if (n_seg > 4) {
        LEAF(p1);
        LEAF(acc);
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) p1[i] = p1[i] + acc[i];
        LEAF(acc);
        before_s6();
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) s6[i * 128] = acc[i];
        LEAF(acc);
#pragma unroll
        for (int i = 0; i < WN / 2; ++i) root[i] = root[i] + (p1[i] + (s6[i * 128] + acc[i]));
    }
#undef LEAF
}

// ---------------------------------------------------------------------------------------
// Large M: persistent 128x128 tiles, warp-specialised.

constexpr int TMA_STAGES = 5;
constexpr int TMA_A_BYTES = 128 * 64 * 2;
constexpr int TMA_B_BYTES = 128 * 64 * 2;
// One stage: A then B, each 1024-aligned (swizzle atoms).
constexpr int TMA_STAGE_BYTES = TMA_A_BYTES + TMA_B_BYTES;

DEVI void tile_coords(int t, int num_m, int num_n, int& m_tile, int& n_tile) {
    // Groups of 8 m-tiles walk along N together, so the blocks running at once share
    // W tiles (and X tiles) in L2.
    const int group = 8;
    const int per_group = group * num_n;
    const int first_m = (t / per_group) * group;
    const int gsize = min(num_m - first_m, group);
    m_tile = first_m + (t % per_group) % gsize;
    n_tile = (t % per_group) / gsize;
}

// The tile a persistent block works on at its i-th turn; false past its last one.
// column_order 0: tile blockIdx.x + i * gridDim.x, placed by tile_coords. column_order 1:
// row tile i % num_m of column blockIdx.x + (i / num_m) * gridDim.x, so one SM reads a
// column's W tile for all of its row tiles, one right after the other (from L2 after the
// first), and each block gets its share of a last, partial row tile. With two row tiles
// and an even grid, the default order gives a block only full tiles or only partial ones,
// and two blocks that need the same W tile need it at different times.
DEVI bool block_tile(int i, int num_m, int num_n, int column_order, int& m_tile, int& n_tile) {
    if (column_order) {
        const int col = (int)blockIdx.x + (i / num_m) * (int)gridDim.x;
        if (col >= num_n) return false;
        m_tile = i % num_m;
        n_tile = col;
        return true;
    }
    const int t = (int)blockIdx.x + i * (int)gridDim.x;
    if (t >= num_m * num_n) return false;
    tile_coords(t, num_m, num_n, m_tile, n_tile);
    return true;
}

// One unit of a persistent block's work: tile (mt, nt), its segments [seg0, seg0 + nseg);
// half -1 for a whole tile, 0 or 1 for the first or second half of tail tile j.
struct Unit {
    int mt, nt, seg0, nseg, half, j;
};

// The block's i-th unit; false past its last one. Without a tail (p.tail == 0), the tiles
// of block_tile. With one, the T - tail tiles before it are a whole number of rounds of
// the grid (the host picks tail = T mod blocks, at most half the blocks): block b takes
// tiles b, b + blocks, ... of those, then, if b < 2·tail, half b / tail of tail tile
// b mod tail. A last round of tail whole tiles would leave blocks - tail SMs idle; as
// halves it takes half the time. The tree is unchanged: the first half's root is
// ((s0+s1)+(s2+s3)) (at n_seg 8), the second's ((s4+s5)+(s6+s7)), and their sum the
// tile's root.
DEVI bool block_unit(int i, const TmaParams& p, int num_m, int num_n, Unit& u) {
    u.seg0 = 0;
    u.nseg = p.n_seg;
    u.half = -1;
    u.j = 0;
    if (p.tail == 0) return block_tile(i, num_m, num_n, p.column_order, u.mt, u.nt);
    const int whole = num_m * num_n - p.tail;
    const int t = (int)blockIdx.x + i * (int)gridDim.x;
    if (t < whole) {
        tile_coords(t, num_m, num_n, u.mt, u.nt);
        return true;
    }
    if (i != whole / (int)gridDim.x || (int)blockIdx.x >= 2 * p.tail) return false;
    u.half = (int)blockIdx.x / p.tail;
    u.j = (int)blockIdx.x % p.tail;
    u.nseg = p.n_seg / 2;
    u.seg0 = u.half * u.nseg;
    tile_coords(whole + u.j, num_m, num_n, u.mt, u.nt);
    return true;
}

// A warpgroup's half root of a tail tile in the workspace: thread wl's values 4i .. 4i + 3
// as one float4 at (i·128 + wl), so that each of a warp's 16-byte accesses covers 512
// contiguous bytes and a thread's A values take A / 4 accesses.
DEVI float4* half_root(const TmaParams& p, size_t tile_wg, int half, int a) {
    return (float4*)(p.ws + (tile_wg * 2 + half) * ((size_t)a * 128));
}

// The warpgroup's half of tail tile u.j: its subtree root (A values a thread) goes to the
// workspace; the warpgroup that arrives second at the counter reads the other half's and
// adds the two in the tree's order (first + second) into root, and returns true: it stores
// the tile. The first returns false. Writes, then a fence, then the arrival; the second
// fences again before it reads (bypassing L1), and leaves the counter at zero. Every load
// is issued into `other` (the tree's leaf tile, free by now) before the first add, so the
// adds wait for one round trip: with each value's load followed by its add, the combine
// was a chain of A L2 round trips (gemm-log run 31: the halves at 256 rows went from 1.04×
// to 0.94× the time of whole tiles on an H200).
template <int A>
DEVI bool tail_combine(const TmaParams& p, float* root, float* other, const Unit& u, int g, int wl,
                       bool releaser, volatile int* arrived) {
    const size_t tile_wg = (size_t)u.j * 2 + g;
    float4* const mine = half_root(p, tile_wg, u.half, A);
#pragma unroll
    for (int i = 0; i < A; i += 4) mine[(i / 4) * 128 + wl] = make_float4(root[i], root[i + 1], root[i + 2], root[i + 3]);
    __threadfence();
    warpgroup_bar(g);
    if (releaser) *arrived = (int)atomicAdd(p.cnt + tile_wg, 1u);
    warpgroup_bar(g);
    const bool second = *arrived != 0;
    // Every thread has read the flag before the releaser may set it for another unit.
    warpgroup_bar(g);
    if (!second) return false;
    __threadfence();
    const float4* const theirs = half_root(p, tile_wg, 1 - u.half, A);
#pragma unroll
    for (int i = 0; i < A; i += 4) {
        const float4 x = __ldcg(theirs + (i / 4) * 128 + wl);
        other[i] = x.x;
        other[i + 1] = x.y;
        other[i + 2] = x.z;
        other[i + 3] = x.w;
    }
#pragma unroll
    for (int i = 0; i < A; ++i) root[i] = u.half == 0 ? root[i] + other[i] : other[i] + root[i];
    if (releaser) p.cnt[tile_wg] = 0u;
    return true;
}

// Shared memory of a persistent kernel besides alignment and barriers: its ring and the
// s6 slot, which is also the TMA store's staging.
constexpr int TMA_SMEM = 226 * 1024;

// The persistent kernel of 128 x WN tiles: stages of [X 128x64 | W WNx64] (each a whole
// number of 1024-byte swizzle atoms), as many as fit beside the s6 slot (WN / 2 values x
// 256 consumer threads), at most 8: WN = 128 5 (TMA_STAGES), 96 6, 64 8.
template <int WN>
struct TmaLayout {
    static constexpr int A = WN / 2;  // accumulator values a consumer thread
    static constexpr int A_BYTES = TMA_A_BYTES;
    static constexpr int STAGE_BYTES = A_BYTES + WN * 64 * 2;
    static constexpr int SLOT_BYTES = A * 256 * 4;
    static constexpr int FIT = (TMA_SMEM - SLOT_BYTES) / STAGE_BYTES;
    static constexpr int STAGES = FIT < 8 ? FIT : 8;
    static_assert(STAGE_BYTES % 1024 == 0, "a stage must keep the swizzle atoms aligned");
};
static_assert(TmaLayout<128>::STAGES == TMA_STAGES && TmaLayout<128>::STAGE_BYTES == TMA_STAGE_BYTES,
              "the 128-column layout is the one the MoE kernel shares");

// 384 threads: warpgroups 0 and 1 consume (rows 0-63 and 64-127 of the tile), warpgroup 2
// produces (one thread issues every TMA). WN < 128: narrower tiles, more of them, for the
// M where 128 x 128 tiles fill only part of the SMs' last round (M = 256: q/k/v makes 96
// tiles of 128 columns, 128 of 96). Each leaf is the 64 x WN wgmma chain, whose values do
// not depend on WN, so every width gives the same bits.
template <int WN>
DEVI void persistent_body(const TmaParams& p) {
    using L = TmaLayout<WN>;
    constexpr int STAGES = L::STAGES, STAGE_BYTES = L::STAGE_BYTES, A_BYTES = L::A_BYTES, A = L::A;
    extern __shared__ unsigned char tma_smem[];
    const u32 raw = smem_addr(tma_smem);
    const u32 base = (raw + 1023u) & ~1023u;
    // Layout: STAGES x [A 128x64 | B WNx64], the s6 slot, then the full and empty barriers.
    const u32 ring = base;
    float* slot = (float*)(tma_smem + (base - raw) + STAGES * STAGE_BYTES);
    const u32 full = base + STAGES * STAGE_BYTES + L::SLOT_BYTES;
    const u32 empty = full + 8 * STAGES;
    require_smem(empty + 8 * STAGES - raw);
    // The TMA stores stage whole 32-column f32 boxes (the SiLU·mul epilogue's two f32 and
    // one bf16 box: 128 columns); the host sets tma_out only for widths that have them.
    if (p.tma_out && (p.epi ? WN != 128 : WN % 32 != 0)) __trap();

    const int tid = threadIdx.x;
    const int wg = warpgroup_uniform();
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, 2 * EMPTY_ARRIVALS);  // two consumer warpgroups
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        tma_prefetch_map(&p.tx);
        tma_prefetch_map(&p.tw);
        if (p.tma_out) {
            tma_prefetch_map(&p.to);
            if (p.epi && p.outh) tma_prefetch_map(&p.toh);
        }
    }
    __syncthreads();

    const int num_m = (p.M + 127) / 128, num_n = (p.N + WN - 1) / WN;
    const int tps = (p.seg_len + 63) / 64;

    if (wg == 2) {
        producer_registers();
        if (tid != 256) {
            pdl_enter();
            return;
        }
        // The first tile's first stages of W (constant data) go out before the wait, so
        // under PDL they stream while the previous kernel finishes; their X boxes follow
        // the wait, each stage's full barrier expecting both (as in small_m_body).
        Unit u0;
        int early = 0;
        if (p.w_early && block_unit(0, p, num_m, num_n, u0)) {
            early = min(STAGES, u0.nseg * tps);
            for (int e = 0; e < early; ++e) {
                mbar_expect_tx(full + 8 * e, STAGE_BYTES);
                load_w_boxes<1, WN>(p, ring + e * STAGE_BYTES + A_BYTES, e % tps, u0.seg0 + e / tps,
                                    u0.nt * WN, full + 8 * e);
            }
        }
        pdl_enter();
        for (int e = 0; e < early; ++e)
            tma_load_3d(ring + e * STAGE_BYTES, &p.tx, (e % tps) * 64, u0.seg0 + e / tps, u0.mt * 128,
                        full + 8 * e);
        u32 it = 0;
        Unit u;
        for (int i = 0; block_unit(i, p, num_m, num_n, u); ++i) {
            for (int s = u.seg0; s < u.seg0 + u.nseg; ++s) {
                for (int kt = 0; kt < tps; ++kt, ++it) {
                    if ((int)it < early) continue;
                    produce_stage<STAGES, STAGE_BYTES, A_BYTES, 1, WN>(p, ring, full, empty, it, kt, s,
                                                                      u.mt * 128, u.nt * WN);
                }
            }
        }
        return;
    }

    pdl_enter();
    const int g = wg;              // consumer warpgroup: rows 64g .. 64g + 63 of the tile
    const int wl = tid & 127;
    const bool releaser = wl == 0;
    consumer_registers();
    float acc[A], root[A], p1[A];
    // This warpgroup's half of the slot: s6 during the tree, then the tile's roots for the
    // TMA store (WN / 32 128-byte-swizzled boxes of 64 rows x 32 columns).
    float* half = slot + g * A * 128;
    const u32 stage_out = smem_addr(half);
    // The previous tile's TMA store reads `half` until its bulk group says otherwise.
    auto store_done = [&] {
        if (!p.tma_out) return;
        if (releaser) bulk_wait_read();
        warpgroup_bar(g);
    };
    __shared__ int arrived[2];  // tail_combine's counter value, one per warpgroup
    u32 it = 0;
    Unit u;
    for (int i = 0; block_unit(i, p, num_m, num_n, u); ++i) {
        const int row0 = u.mt * 128 + g * 64, col0 = u.nt * WN;
        const bool idle = p.skip_idle && row0 >= p.M;
        tile_tree<STAGES, STAGE_BYTES, A_BYTES, WN>(root, acc, p1, half + wl, ring, full, empty,
                                                    g * 64 * 128, p.seg_len, tps, u.nseg, it,
                                                    releaser, store_done, idle);
        // An idle warpgroup's rows are never stored: neither half of it meets the other.
        if (u.half >= 0 && !idle && !tail_combine<A>(p, root, acc, u, g, wl, releaser, arrived + g)) continue;
        // A warpgroup with rows on both sides of M stores by TMA, the unit clipping the box
        // at M, where the host asks for it (tma_partial, the default: the decode step at
        // 72-224 rows 0.5-1.5 ms faster than with these rows leaving from registers).
        const bool tma_out = p.tma_out && (row0 + 64 <= p.M || (p.tma_partial && row0 < p.M));
        if constexpr (WN == 128) {
            if (tma_out && p.epi) {
                // silu(gate)·up of the tile's 64 column pairs: f32 as two 64x32 boxes at the
                // half's start, bf16 as one 64x64 box after them (both 128-byte swizzled).
                // Value i/2 sits at row rb + 8·((i/2)&1) (rb = 16·warp + g, g = lane/4, so
                // the row's r & 7 is g) and output column 4·(i/4) + lane%4: each offset is a
                // per-thread base, a constant of i, and the swizzle's (k ^ g) << 4 =
                // (k << 4) ^ (g << 4) with k a constant of i; the outputs' tests are hoisted.
                store_done();
                const bool want_f = p.outf != nullptr, want_h = p.outh != nullptr;
                const u32 g16 = ((wl & 31) >> 2) << 4, t = wl & 3;
                const u32 rb = ((wl >> 5) << 4) + ((wl & 31) >> 2);
                unsigned char* const base_f = (unsigned char*)half + rb * 128 + (t << 2);
                unsigned char* const base_h = (unsigned char*)half + 16384 + rb * 128 + (t << 1);
#pragma unroll
                for (int i = 0; i < A; i += 2) {
                    const float y = silu_mul(root[i], root[i + 1]);
                    const u32 lo = ((i >> 1) & 1) * 1024;
                    if (want_f) *(float*)(base_f + (i >> 5) * 8192 + lo + ((((i >> 2) & 7) << 4) ^ g16)) = y;
                    if (want_h) *(u16*)(base_h + lo + ((i >> 2) & 1) * 8 + (((i >> 3) << 4) ^ g16)) = f32_to_bf16(y);
                }
                fence_async_smem();
                warpgroup_bar(g);
                if (releaser) {
                    if (p.outf) {
                        tma_store_2d(&p.to, stage_out, col0 / 2, row0);
                        tma_store_2d(&p.to, stage_out + 8192, col0 / 2 + 32, row0);
                    }
                    if (p.outh) tma_store_2d(&p.toh, stage_out + 16384, col0 / 2, row0);
                    bulk_commit();
                }
                continue;
            }
        }
        if constexpr (WN % 32 == 0) {
            if (tma_out) {
                store_done();
#pragma unroll
                for (int i = 0; i < A; i += 2) {
                    const int r = acc_row(wl, i), c = acc_col(wl, i);
                    const int cc = c & 31;
                    const u32 off = (c >> 5) * 8192 + r * 128 + ((((cc >> 2) ^ (r & 7)) << 4) | ((cc & 3) << 2));
                    *(float2*)((unsigned char*)half + off) = make_float2(root[i], root[i + 1]);
                }
                fence_async_smem();
                warpgroup_bar(g);
                if (releaser) {
#pragma unroll
                    for (int b = 0; b < WN / 32; ++b) tma_store_2d(&p.to, stage_out + b * 8192, col0 + 32 * b, row0);
                    bulk_commit();
                }
                continue;
            }
        }
        if (p.epi) {
            // c is even: the pair (c, c + 1) is (gate j, up j), j = c / 2. Lanes 2l and
            // 2l + 1 hold j and j + 1 of one row: the even lane stores both.
#pragma unroll
            for (int i = 0; i < A; i += 2) {
                const int r = row0 + acc_row(wl, i);
                const int c = col0 + acc_col(wl, i);
                const float y = silu_mul(root[i], root[i + 1]);
                const float y1 = __shfl_down_sync(0xffffffffu, y, 1);
                if (r >= p.M || (wl & 1)) continue;
                const int n = c + 3 < p.N ? 2 : (c + 1 < p.N ? 1 : 0);
                if (n > 0) store_silu(p, r, c >> 1, n, y, y1);
            }
            continue;
        }
#pragma unroll
        for (int i = 0; i < A; i += 2) {
            const int r = row0 + acc_row(wl, i);
            const int c = col0 + acc_col(wl, i);
            if (r >= p.M) continue;
            const long long idx = (long long)r * p.N + c;
            if (c + 1 < p.N && p.outf && (((u64)(p.outf + idx) & 7) == 0)) {
                *(float2*)(p.outf + idx) = make_float2(root[i], root[i + 1]);
            } else {
                if (c < p.N) store_out(p.outf, p.outh, idx, root[i]);
                if (c + 1 < p.N) store_out(p.outf, p.outh, idx + 1, root[i + 1]);
            }
        }
    }
    if (p.tma_out && releaser) bulk_wait_all();
}

#define PERSISTENT_KERNEL(BN)                                                 \
    extern "C" __global__ void __launch_bounds__(384, 1)                    \
        arbor_gemm_wg_tma_128x##BN(const __grid_constant__ TmaParams p) {   \
        persistent_body<BN>(p);                                              \
    }
PERSISTENT_KERNEL(128)
PERSISTENT_KERNEL(96)
PERSISTENT_KERNEL(64)
#undef PERSISTENT_KERNEL

// ---------------------------------------------------------------------------------------
// Small M: a cluster of the n_seg segment blocks of one 64-row tile, combined over DSMEM.

constexpr int CL_A_BYTES = 64 * 64 * 2;

// Shared-memory layout of a small-M kernel with NW consumer warpgroups of WN columns (a
// 64 x NW·WN tile): STAGES x [X 64x64 | W (NW·WN)x64], for the whole-K kernel two tree
// slots (WN / 2 f32 each per consumer thread), then the full and empty barriers. NW = 1: 4
// stages (two blocks fit on an SM); NW = 2: 5 stages (one block per SM, X loaded once for
// both warpgroups: at M = 64 the X tiles were a third of the bytes a block streamed); whole
// K and quad: as many stages (at most 8) as fit in WHOLE_SMEM besides the slots (WN = 112:
// 3).
// TALL: the NW consumer warpgroups are stacked over the rows (a 64·NW x WN tile, one X box
// of 64·NW rows and one W box a stage, the W tile shared) instead of side by side. TALL
// blocks sum at most four segments, so their tree needs one slot (s2), not two.
constexpr int WHOLE_SMEM = 225 * 1024;  // leaves 2 KB of the 227 for alignment and barriers
template <int NW, int WN = 128, bool TREE = false, bool TALL = false>
struct ClusterLayout {
    static constexpr int BM = TALL ? 64 * NW : 64;
    static constexpr int BN = TALL ? WN : WN * NW;
    static constexpr int A_BYTES = BM * 64 * 2;
    static constexpr int W_BYTES = WN * 64 * 2;  // one W box (a consumer warpgroup's columns)
    static constexpr int W_BOXES = TALL ? 1 : NW;
    static constexpr int STAGE_BYTES = A_BYTES + W_BOXES * W_BYTES;
    static constexpr int N_SLOTS = TREE ? (TALL ? 1 : 2) : 0;
    static constexpr int SLOT_BYTES = N_SLOTS * (WN / 2) * 128 * NW * 4;
    static constexpr int FIT = (WHOLE_SMEM - SLOT_BYTES) / STAGE_BYTES;
    static constexpr int STAGES = TREE ? (FIT < 8 ? FIT : 8) : (NW == 1 ? 4 : 5);
    static constexpr int RED_STRIDE = BN + 8;  // f32 row stride of the segment sums
    static constexpr int THREADS = 128 * NW + 32;
    // After the leaves the ring holds the block's [BM][RED_STRIDE] f32 sums.
    static_assert(BM * RED_STRIDE * 4 <= STAGES * STAGE_BYTES, "segment sums overflow the ring");
};

DEVI u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
DEVI void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}
DEVI u32 map_to_rank(u32 addr, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
DEVI float4 ld_cluster4(u32 addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

// The fixed tree over the first ns (1, 2, 4 or 8) segment sums.
DEVI float tree_of(const float* x, int ns) {
    if (ns == 1) return x[0];
    if (ns == 2) return x[0] + x[1];
    if (ns == 4) return (x[0] + x[1]) + (x[2] + x[3]);
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

// Each block sums SPC consecutive segments (SPC = 2: the pair's sum (s0+s1) in registers,
// the tree's first level) of a 64 x WN·NW tile; the n_seg / SPC blocks of a tile form a
// cluster that combines their sums over DSMEM with the rest of the tree. Grid
// (n_tiles * cl, m_tiles), cluster (cl, 1, 1) with cl = n_seg / SPC: the block's rank r in
// its cluster covers segments [r * SPC, (r + 1) * SPC). Warpgroups 0 .. NW-1 consume (W
// rows WN·g .. WN·g + WN - 1 of the tile, each the 64xWN leaf of the narrow kernel, so
// every NW and WN gives the same bits), the warp after them produces. SPC = 2 halves the
// blocks, so a tile grid that needs more clusters than fit on the device at once (30
// clusters of 8 on an H100) still runs in one wave. SPC = 0: the block sums all n_seg
// segments and evaluates the whole tree itself (no cluster). SPC = 4: the block evaluates
// the subtree of min(4, n_seg) segments itself, a cluster of two combines the halves.
// TALL (SPC = 4 only): warpgroup g takes rows 64g .. 64g + 63 of a 64·NW-row tile and all
// WN columns (the same 64xWN leaf), the W tile loaded once for both.
template <int SPC, int NW, int WN = 128, bool TALL = false>
DEVI void small_m_body(const TmaParams& p) {
    constexpr bool WHOLE = SPC == 0;
    constexpr bool TREE = SPC == 0 || SPC == 4;  // the block evaluates its subtree itself
    static_assert(!TALL || SPC == 4, "the tall tiles keep one tree slot: four segments a block");
    using L = ClusterLayout<NW, WN, TREE, TALL>;
    constexpr int STAGES = L::STAGES, STAGE_BYTES = L::STAGE_BYTES, A = WN / 2;
    constexpr int BM = L::BM, BN = L::BN, A_BYTES = L::A_BYTES, W_BOXES = L::W_BOXES;
    extern __shared__ unsigned char cl_smem[];
    const u32 raw = smem_addr(cl_smem);
    const u32 base = (raw + 1023u) & ~1023u;
    const u32 ring = base;
    float* slot = (float*)(cl_smem + (base - raw) + STAGES * STAGE_BYTES);
    const u32 full = base + STAGES * STAGE_BYTES + L::SLOT_BYTES;
    const u32 empty = full + 8 * STAGES;
    require_smem(empty + 8 * STAGES - raw);
    // After the leaf, the ring is reused for the segment sum [BM][RED_STRIDE] f32.
    float* red = (float*)(cl_smem + (base - raw));

    const int tid = threadIdx.x;
    const int spc = WHOLE ? p.n_seg : min(SPC, p.n_seg);  // segments per block
    const int ns = p.n_seg / spc;           // blocks per cluster
    const int seg = WHOLE ? 0 : (int)cluster_ctarank();
    const int nt = blockIdx.x / ns, mt = blockIdx.y;
    const int tps = (p.seg_len + 63) / 64;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, NW * EMPTY_ARRIVALS);  // NW consumer warpgroups
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    float acc[A];
    const int wg = warpgroup_uniform();
    if (wg == NW) {
        if (tid == 128 * NW) {
            tma_prefetch_map(&p.tx);
            tma_prefetch_map(&p.tw);
            // The first stages' W tiles (constant data) go out before the wait, so under
            // PDL they stream while the previous kernel finishes; their X tiles follow
            // the wait. Each stage's full barrier expects both, as in produce_stage.
            const int early = p.w_early ? min(STAGES, spc * tps) : 0;
            for (int it = 0; it < early; ++it) {
                const u32 fb = full + 8 * it;
                mbar_expect_tx(fb, STAGE_BYTES);
                load_w_boxes<W_BOXES, WN>(p, ring + it * STAGE_BYTES + A_BYTES, it % tps,
                                          seg * spc + it / tps, nt * BN, fb);
            }
            pdl_enter();
            for (int it = 0; it < early; ++it)
                tma_load_3d(ring + it * STAGE_BYTES, &p.tx, (it % tps) * 64, seg * spc + it / tps,
                            mt * BM, full + 8 * it);
            u32 it = 0;
            for (int j = 0; j < spc; ++j) {
                for (int kt = 0; kt < tps; ++kt, ++it) {
                    if ((int)it < early) continue;
                    produce_stage<STAGES, STAGE_BYTES, A_BYTES, W_BOXES, WN>(
                        p, ring, full, empty, it, kt, seg * spc + j, mt * BM, nt * BN);
                }
            }
        } else {
            pdl_enter();
        }
    } else {
        pdl_enter();
        // Side by side: the warpgroup's own W box under the shared X rows. Stacked: its
        // own 64 X rows (8 KB into the X box, a whole number of swizzle atoms) over the
        // shared W box.
        const u32 sw = ring + A_BYTES + (TALL ? 0 : wg * L::W_BYTES);
        const int a_off = TALL ? wg * 64 * 128 : 0;
        const bool releaser = (tid & 127) == 0;
        const bool idle = TALL && p.skip_idle && mt * BM + wg * 64 >= p.M;
        u32 it = 0;
        if constexpr (TREE) {
            // The tree ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)), or its first spc leaves (the
            // subtree of the block's segments), evaluated as the segments arrive: the leaf and the root in registers, the
            // pending partial (s2, then s4+s5) and s6 in thread-private shared-memory slots
            // ([value][thread], conflict-free). ptxas gives a kernel with wgmma at most 168
            // registers a thread here (288 threads, counted as 384): a third live tile spilled.
            float root[A];
#define P1(i) slot[(i) * (128 * NW) + tid]
#define S6(i) slot[(A + (i)) * (128 * NW) + tid]
            for (int s = 0; s < spc; ++s) {
                leaf_segment<STAGES, STAGE_BYTES, WN>(acc, ring, sw, full, empty, a_off, p.seg_len, tps, it,
                                                      releaser, idle);
                switch (s) {
                    case 0:
#pragma unroll
                        for (int i = 0; i < A; ++i) root[i] = acc[i];
                        break;
                    case 1:
#pragma unroll
                        for (int i = 0; i < A; ++i) root[i] = root[i] + acc[i];
                        break;
                    case 2:
                    case 4:
#pragma unroll
                        for (int i = 0; i < A; ++i) P1(i) = acc[i];
                        break;
                    case 3:
#pragma unroll
                        for (int i = 0; i < A; ++i) root[i] = root[i] + (P1(i) + acc[i]);
                        break;
                    case 5:
#pragma unroll
                        for (int i = 0; i < A; ++i) P1(i) = P1(i) + acc[i];
                        break;
                    case 6:
#pragma unroll
                        for (int i = 0; i < A; ++i) S6(i) = acc[i];
                        break;
                    default:
#pragma unroll
                        for (int i = 0; i < A; ++i) root[i] = root[i] + (P1(i) + (S6(i) + acc[i]));
                }
            }
#undef P1
#undef S6
#pragma unroll
            for (int i = 0; i < A; ++i) acc[i] = root[i];
        } else {
            leaf_segment<STAGES, STAGE_BYTES, WN>(acc, ring, sw, full, empty, a_off, p.seg_len, tps, it,
                                                  releaser, idle);
            if (SPC == 2) {
                float part[A];
#pragma unroll
                for (int i = 0; i < A; ++i) part[i] = acc[i];
                leaf_segment<STAGES, STAGE_BYTES, WN>(acc, ring, sw, full, empty, a_off, p.seg_len, tps, it,
                                                      releaser, idle);
#pragma unroll
                for (int i = 0; i < A; ++i) acc[i] = part[i] + acc[i];
            }
        }
    }
    // Every TMA of this block has landed (the consumers waited for each) and every wgmma
    // has read its stage, so the ring can take the segment sum.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const int rows = min(BM, p.M - mt * BM);
    if (wg < NW) {
        const int wl = tid & 127;
        const int r0 = TALL ? wg * 64 : 0, c0 = TALL ? 0 : wg * WN;
#pragma unroll
        for (int i = 0; i < A; i += 2) {
            const int r = r0 + acc_row(wl, i);
            if (r < rows)
                *(float2*)(red + r * L::RED_STRIDE + c0 + acc_col(wl, i)) =
                    make_float2(acc[i], acc[i + 1]);
        }
    }
    if constexpr (WHOLE)
        __syncthreads();
    else
        cluster_sync();
    // This block finishes 4-column groups [seg * per, (seg + 1) * per) of the tile's
    // rows x BN, reading each group's n_seg segment sums with one 16-byte DSMEM load each.
    constexpr int GROUPS = BN / 4;  // 4-column groups per row
    const int total = rows * GROUPS;
    const int per = (total + ns - 1) / ns;
    const int g_end = min(total, (seg + 1) * per);
    const u32 red_addr = smem_addr(red);
    for (int gi = seg * per + tid; gi < g_end; gi += L::THREADS) {
        const int r = gi / GROUPS, c = (gi % GROUPS) * 4;
        float x[4][8];
        if constexpr (WHOLE) {
            const float4 v = *(const float4*)(red + r * L::RED_STRIDE + c);
            x[0][0] = v.x, x[1][0] = v.y, x[2][0] = v.z, x[3][0] = v.w;
        } else {
            const u32 a = red_addr + (u32)(r * L::RED_STRIDE + c) * 4u;
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                if (q < ns) {
                    const float4 v = ld_cluster4(map_to_rank(a, (u32)q));
                    x[0][q] = v.x, x[1][q] = v.y, x[2][q] = v.z, x[3][q] = v.w;
                }
            }
        }
        const long long row = (long long)mt * BM + r;
        const int col = nt * BN + c;
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = tree_of(x[j], ns);
        if (p.epi) {
            // col is a multiple of 4: (gate j, up j, gate j + 1, up j + 1), j = col / 2.
            const int n = (col + 3 < p.N) ? 2 : (col + 1 < p.N ? 1 : 0);
            if (n > 0) store_silu(p, row, col >> 1, n, silu_mul(v[0], v[1]), n == 2 ? silu_mul(v[2], v[3]) : 0.f);
        } else {
            store_roots4(p, row, col, v);
        }
    }
    // No block may leave while another still reads its shared memory.
    if constexpr (!WHOLE) cluster_sync();
}

extern "C" __global__ void __launch_bounds__(160, 1)
    arbor_gemm_wg_cluster_64x128(const __grid_constant__ TmaParams p) {
    small_m_body<1, 1>(p);
}

extern "C" __global__ void __launch_bounds__(160, 1)
    arbor_gemm_wg_cluster2_64x128(const __grid_constant__ TmaParams p) {
    small_m_body<2, 1>(p);
}

// Two consumer warpgroups sharing each X tile: 64 x 256 tiles, two segments per block.
extern "C" __global__ void __launch_bounds__(288, 1)
    arbor_gemm_wg_cluster2_64x256(const __grid_constant__ TmaParams p) {
    small_m_body<2, 2>(p);
}

// 64 x BN tiles, two consumer warpgroups of BN / 2 columns each, SPC segments per block:
// - whole (SPC = 0): all of K and the whole tree in the block, no cluster. The host takes
//   the width whose tiles fill the SMs in full waves (4096 x 28672: 128 blocks of 224
//   columns), where the cluster kernels ran 3.6 waves of 248 resident blocks, the last one
//   60 % full.
// - quad (SPC = 4): the subtree (s0+s1)+(s2+s3) in the block, clusters of two for the whole
//   K: half as many blocks as the two-segment cluster kernels, a deeper ring each (the
//   narrow layers, 4096 x 4096 at M = 64: 64-column tiles, 128 blocks, as cuBLAS runs it).
#define TREE_KERNEL(KIND, SPC, BN)                                           \
    extern "C" __global__ void __launch_bounds__(288, 1)                    \
        arbor_gemm_wg_##KIND##_64x##BN(const __grid_constant__ TmaParams p) { \
        small_m_body<SPC, 2, BN / 2>(p);                                     \
    }
TREE_KERNEL(whole, 0, 224)
TREE_KERNEL(whole, 0, 112)
TREE_KERNEL(whole, 0, 64)
TREE_KERNEL(whole, 0, 48)
TREE_KERNEL(whole, 0, 32)
TREE_KERNEL(quad, 4, 96)
TREE_KERNEL(quad, 4, 64)
#undef TREE_KERNEL

// 128 x BN tiles for 129 <= M <= 512: the quad block (four segments, clusters of two) with
// its two consumer warpgroups stacked over the rows, each the 64 x BN leaf, sharing the W
// tile: twice the MMA work per W byte of the 64-row quad tiles, and 2·M/128·N/BN blocks
// where wgtma128 runs M/128·N/128 (4096 x 4096 at M = 256: 128 blocks against 64).
#define TALL_KERNEL(BN)                                                       \
    extern "C" __global__ void __launch_bounds__(288, 1)                    \
        arbor_gemm_wg_quad_128x##BN(const __grid_constant__ TmaParams p) {  \
        small_m_body<4, 2, BN, true>(p);                                     \
    }
TALL_KERNEL(128)
TALL_KERNEL(64)
#undef TALL_KERNEL

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
