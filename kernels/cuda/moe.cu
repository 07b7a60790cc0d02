// Mixture-of-experts routing on the device (model/src/layers/moe.rs has the host twin):
// every kernel here computes each row (or each pair of a row and one of its experts) from
// that row alone, in a fixed order, so routes and sums do not depend on the batch, and a
// step that routes on the device can be recorded as a CUDA graph.
//
// A step's P = rows * k (row, expert) pairs are laid out by expert: expert 0's pairs,
// then expert 1's, each expert's in row order. The grouped GEMM (gemm_moe.cu) walks that
// layout in tiles that never cross an expert.

// Bitmask words of the chosen experts: at most 32 * MOE_MASK_WORDS experts per router.
#define MOE_MASK_WORDS 16

// Per row of router logits [rows, E]: the top k experts of the f32 softmax (max first;
// the sum in index order; ties to the lower index, compared as exps, as the host does),
// listed in expert order with their probabilities, renormalised over the chosen k when
// norm is set (the chosen sum in expert order). One thread per row.
extern "C" __global__ void moe_route_kernel(const float* __restrict__ logits, int rows, int E, int k,
                                            int norm, int* __restrict__ ids, float* __restrict__ w) {
    pdl_enter();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* l = logits + (long long)r * E;
    float mx = __int_as_float(0xff800000u);  // -inf
    for (int e = 0; e < E; ++e) mx = fmaxf(mx, l[e]);
    float sum = 0.f;
    for (int e = 0; e < E; ++e) sum = __fadd_rn(sum, expf(__fsub_rn(l[e], mx)));
    unsigned chosen[MOE_MASK_WORDS];
#pragma unroll
    for (int i = 0; i < MOE_MASK_WORDS; ++i) chosen[i] = 0u;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        float bv = 0.f;
        for (int e = 0; e < E; ++e) {
            if (chosen[e >> 5] & (1u << (e & 31))) continue;
            const float v = expf(__fsub_rn(l[e], mx));
            if (best < 0 || v > bv) best = e, bv = v;
        }
        if (best >= 0) chosen[best >> 5] |= 1u << (best & 31);
    }
    float picked = 0.f;
    int j = 0;
    for (int e = 0; e < E && j < k; ++e) {
        if (!(chosen[e >> 5] & (1u << (e & 31)))) continue;
        const float p = __fdiv_rn(expf(__fsub_rn(l[e], mx)), sum);
        ids[(long long)r * k + j] = e;
        w[(long long)r * k + j] = p;
        picked = __fadd_rn(picked, p);
        ++j;
    }
    if (norm) {
        for (int q = 0; q < k; ++q) {
            const long long i = (long long)r * k + q;
            w[i] = __fdiv_rn(w[i], picked);
        }
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
