// Mixture-of-experts routing on the device (model/src/layers/moe.rs has the host twin):
// every kernel here computes each row (or each pair of a row and one of its experts) from
// that row alone, in a fixed order, so routes and sums do not depend on the batch, and a
// step that routes on the device can be recorded as a CUDA graph.
//
// A step's P = rows * k (row, expert) pairs are laid out by expert: expert 0's pairs,
// then expert 1's, each expert's in row order. The grouped GEMM (gemm_moe.cu) walks that
// layout in tiles that never cross an expert.

// Rows per block of the route kernel (one warp each), and the most experts a row may
// choose.
#define MOE_ROUTE_WARPS 4
#define MOE_TOP_K_MAX 64

// Per row of router logits [rows, E]: the top k experts of the f32 softmax, listed in
// expert order with their probabilities, renormalised over the chosen k when norm is set.
// The order is the host's (layers/moe.rs `route`), but exp is the GPU's expf, whose
// results need not be the host's bit for bit: max, then exp(l - max) per expert,
// their sum in index order from +0, the k largest exps (ties to the lower index: an
// exact argmax, whichever lanes compare them), p = exp / sum, and the chosen p summed in
// expert order. One warp per row; the row's exps and choices in shared memory
// (MOE_ROUTE_WARPS * (E + MOE_TOP_K_MAX) words).
extern "C" __global__ void __launch_bounds__(32 * MOE_ROUTE_WARPS)
    moe_route_kernel(const float* __restrict__ logits, int rows, int E, int k, int norm,
                     int* __restrict__ ids, float* __restrict__ w) {
    pdl_enter();
    extern __shared__ float moe_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * MOE_ROUTE_WARPS + warp;
    if (r >= rows) return;
    float* ex = moe_smem + warp * (E + MOE_TOP_K_MAX);
    int* sel = (int*)(ex + E);
    const float* l = logits + (long long)r * E;
    float mx = __int_as_float(0xff800000u);  // -inf
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    for (int e = lane; e < E; e += 32) ex[e] = expf(__fsub_rn(l[e], mx));
    __syncwarp();
    float sum = 0.f;
    if (lane == 0)
        for (int e = 0; e < E; ++e) sum = __fadd_rn(sum, ex[e]);
    sum = __shfl_sync(0xffffffffu, sum, 0);
    // Lane `lane` holds experts lane + 32 i; bit i of `taken` marks one already chosen.
    unsigned taken = 0u;
    for (int j = 0; j < k; ++j) {
        int be = -1;
        float bv = 0.f;
        for (int i = 0, e = lane; e < E; ++i, e += 32) {
            if (taken & (1u << i)) continue;
            const float v = ex[e];
            if (be < 0 || v > bv) be = e, bv = v;
        }
        for (int o = 16; o; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) be = oe, bv = ov;
        }
        if (be >= 0 && (be & 31) == lane) taken |= 1u << (be >> 5);
        if (lane == 0) sel[j] = be;
    }
    __syncwarp();
    if (lane != 0) return;
    // Expert order: insertion sort of the k choices.
    for (int a = 1; a < k; ++a) {
        const int v = sel[a];
        int b = a - 1;
        for (; b >= 0 && sel[b] > v; --b) sel[b + 1] = sel[b];
        sel[b + 1] = v;
    }
    float picked = 0.f;
    for (int j = 0; j < k; ++j) {
        const float p = __fdiv_rn(ex[sel[j]], sum);
        ids[(long long)r * k + j] = sel[j];
        w[(long long)r * k + j] = p;
        picked = __fadd_rn(picked, p);
    }
    if (norm)
        for (int j = 0; j < k; ++j) {
            const long long i = (long long)r * k + j;
            w[i] = __fdiv_rn(w[i], picked);
        }
}

// One block per expert: each of the expert's pairs gets its rank among them in row order
// (rank[pair]), and counts[e] their number. A row's k experts are distinct, so a row has
// at most one pair per expert.
extern "C" __global__ void moe_count_kernel(const int* __restrict__ ids, int rows, int k,
                                            int* __restrict__ rank, int* __restrict__ counts) {
    pdl_enter();
    __shared__ int warp_total[32];
    __shared__ int base;
    const int e = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    for (int r0 = 0; r0 < rows; r0 += blockDim.x) {
        const int r = r0 + threadIdx.x;
        int slot = -1;
        if (r < rows)
            for (int j = 0; j < k; ++j)
                if (ids[(long long)r * k + j] == e) slot = j;
        const unsigned ball = __ballot_sync(0xffffffffu, slot >= 0);
        if (lane == 0) warp_total[warp] = __popc(ball);
        __syncthreads();
        int off = base;
        for (int q = 0; q < warp; ++q) off += warp_total[q];
        if (slot >= 0) rank[(long long)r * k + slot] = off + __popc(ball & ((1u << lane) - 1u));
        __syncthreads();
        if (threadIdx.x == 0) {
            int t = 0;
            for (int q = 0; q < warps; ++q) t += warp_total[q];
            base += t;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) counts[e] = base;
}

// One thread: each expert's first pair (offsets, exclusive prefix of counts in expert
// order) and the GEMM's row tiles: tiles of at most bm pairs, none crossing an expert,
// each as (expert, first pair, the expert's end). Tiles past n_tiles are not run.
extern "C" __global__ void moe_schedule_kernel(const int* __restrict__ counts, int E, int bm,
                                               int max_tiles, int* __restrict__ offsets,
                                               int* __restrict__ tile_expert, int* __restrict__ tile_row0,
                                               int* __restrict__ tile_end, int* __restrict__ n_tiles) {
    pdl_enter();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    int off = 0, t = 0;
    for (int e = 0; e < E; ++e) {
        const int c = counts[e];
        offsets[e] = off;
        for (int r = 0; r < c && t < max_tiles; r += bm, ++t) {
            tile_expert[t] = e;
            tile_row0[t] = off + r;
            tile_end[t] = off + c;
        }
        off += c;
    }
    *n_tiles = t;
}

// Per pair (row r, slot j): its place in the expert-major layout; sorted_row[place] = r
// (the X row the gate/up GEMM gathers), pair_pos[pair] = place (where combine reads it).
extern "C" __global__ void moe_scatter_kernel(const int* __restrict__ ids, const int* __restrict__ rank,
                                              const int* __restrict__ offsets, int pairs, int k,
                                              int* __restrict__ sorted_row, int* __restrict__ pair_pos) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pairs) return;
    const int place = offsets[ids[i]] + rank[i];
    sorted_row[place] = i / k;
    pair_pos[i] = place;
}

// out[r, c] = the row's expert outputs y[pair_pos[r, j], c] weighted by w[r, j] and added
// in expert order from +0, one rounding per multiply and per add (the host's order).
extern "C" __global__ void moe_combine_kernel(const float* __restrict__ y, const int* __restrict__ pair_pos,
                                              const float* __restrict__ w, long long rows, int k, int cols,
                                              float* __restrict__ out) {
    pdl_enter();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    const long long r = i / cols;
    const int c = (int)(i - r * cols);
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
        const long long p = pair_pos[r * k + j];
        acc = __fadd_rn(acc, __fmul_rn(w[r * k + j], y[p * cols + c]));
    }
    out[i] = acc;
}
