// What a step's record needs from each logits row, so that only a few bytes per row leave
// the GPU: argmax (lowest index on ties, NaN never wins, index 0 if every value is NaN),
// the value there, log Σ exp, the value at a requested index, the digest of
// kernels/src/cpu/digest.rs, and on request a temperature draw by the Gumbel-max trick
// (kernels/src/cpu/gumbel.rs: argmax of x·inv_t + g(key, i), exact like the argmax). One
// block of RS_THREADS per row. The argmaxes are exact whatever the split (larger value,
// then lower index); log Σ exp has a fixed order (thread t takes elements t, t +
// RS_THREADS, ... in order, then a fixed shared-memory tree); so a row's results depend
// only on the row: not on the batch, the TP size (the logits are all-gathered first) or
// the launch.

#define RS_THREADS 512
#define RS_CHUNK 256
#define RS_GROUP 32
#define FNV_BASIS 0xcbf29ce484222325ULL
#define FNV_PRIME 0x00000100000001b3ULL

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// gumbel.rs::gumbel: u from the top 24 bits (exact in f32), g = −ln(−ln u).
__device__ __forceinline__ float gumbel_noise(unsigned long long key, unsigned int i) {
    const unsigned long long h = splitmix64(key ^ (unsigned long long)i);
    const float u = ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
    return -logf(-logf(u));
}

// The block's best (value, index) of per-thread candidates: larger value, then lower
// index; index < 0 is "none". A fixed tree, so the winner is exact.
__device__ __forceinline__ void block_argmax(float* sv, int* si, int t) {
    for (int s = RS_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) {
            const float ov = sv[t + s];
            const int oi = si[t + s];
            const int mi = si[t];
            if (oi >= 0 && (mi < 0 || ov > sv[t] || (ov == sv[t] && oi < mi))) {
                sv[t] = ov;
                si[t] = oi;
            }
        }
        __syncthreads();
    }
}

// Calls f(row[i], i) for i = t, t + RS_THREADS, ... < n in that order, with RS_AHEAD loads
// issued before the first call of each group: the row sits in L2 right after the LM head,
// and one load at a time paid its round trip ~250 times per loop.
#define RS_AHEAD 8
template <typename F>
__device__ __forceinline__ void strided_in_order(const float* __restrict__ row, int n, int t, F f) {
    int i = t;
    for (; i + (RS_AHEAD - 1) * RS_THREADS < n; i += RS_AHEAD * RS_THREADS) {
        float v[RS_AHEAD];
#pragma unroll
        for (int u = 0; u < RS_AHEAD; ++u) v[u] = row[i + u * RS_THREADS];
#pragma unroll
        for (int u = 0; u < RS_AHEAD; ++u) f(v[u], i + u * RS_THREADS);
    }
    for (; i < n; i += RS_THREADS) f(row[i], i);
}

// digest.rs's fold step: FNV-1a over a whole word.
__device__ __forceinline__ unsigned long long fnv_word(unsigned long long h, unsigned long long w) {
    return (h ^ w) * FNV_PRIME;
}

// The argmax of one thread's candidates, in increasing index order (the first of equals
// kept; NaN never wins).
struct BestOf {
    float v = 0.0f;
    int i = -1;
    __device__ __forceinline__ void see(float x, int at) {
        if (x == x && (i < 0 || x > v)) { v = x; i = at; }
    }
};

// grid: rows; block: RS_THREADS; dynamic shared memory: (n_chunks + n_groups) * 8 bytes.
// params: [rows, 3] = (pick index or ≥ vocab for none, draw key, mode << 32 | inv_t bits:
// mode 1 = a Gumbel draw, 2 = the tempered sum of a top-p draw, 0 = neither).
// out_f: [rows, 6] = (max, lse, picked, value at the draw, tempered sum, 0);
// out_u: [rows, 3] = (argmax, digest, drawn index or u32::MAX).
extern "C" __global__ void row_stats_kernel(const float* __restrict__ x, int cols, int vocab,
                                            const unsigned long long* __restrict__ params,
                                            float* __restrict__ out_f,
                                            unsigned long long* __restrict__ out_u) {
    pdl_enter();
    extern __shared__ unsigned long long digests[];  // chunks, then groups
    __shared__ float sv[RS_THREADS];
    __shared__ int si[RS_THREADS];
    __shared__ float ss[RS_THREADS];
    const int t = threadIdx.x;
    const float* row = x + (size_t)blockIdx.x * cols;
    const unsigned long long* pr = params + (size_t)blockIdx.x * 3;
    const unsigned int mode = (unsigned int)(pr[2] >> 32);
    const bool draw = mode == 1;
    const bool nucleus = mode == 2;
    const unsigned long long key = pr[1];
    const float inv_t = __uint_as_float((unsigned int)(pr[2] & 0xffffffffu));

    // One pass over thread t's chunks (c = t, t + RS_THREADS, ...: 1 KiB of consecutive
    // values each, read as 16-byte vectors, eight in flight): the chunk's digest and the
    // thread's argmax and draw candidates. (Before, the digest was a pass of its own and
    // the chunk digests were folded byte by byte on one thread: 100 µs per step.)
    const int n_chunks = (vocab + RS_CHUNK - 1) / RS_CHUNK;
    const int n_groups = (n_chunks + RS_GROUP - 1) / RS_GROUP;
    const bool vec = (reinterpret_cast<size_t>(row) & 15) == 0;
    BestOf best, drawn_best;
    auto see = [&](unsigned long long& h, float v, int i) {
        h = fnv_word(h, __float_as_uint(v));
        best.see(v, i);
        if (draw && v == v) drawn_best.see(v * inv_t + gumbel_noise(key, (unsigned int)i), i);
    };
    for (int c = t; c < n_chunks; c += RS_THREADS) {
        unsigned long long h = FNV_BASIS;
        const int begin = c * RS_CHUNK;
        const int end = min(vocab, begin + RS_CHUNK);
        int i = begin;
        if (vec && end - begin == RS_CHUNK) {
            const float4* p = reinterpret_cast<const float4*>(row + begin);
            for (int q0 = 0; q0 < RS_CHUNK / 4; q0 += 8) {
                float4 v[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) v[u] = p[q0 + u];
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const int at = begin + 4 * (q0 + u);
                    see(h, v[u].x, at);
                    see(h, v[u].y, at + 1);
                    see(h, v[u].z, at + 2);
                    see(h, v[u].w, at + 3);
                }
            }
            i = end;
        }
        for (; i < end; ++i) see(h, row[i], i);
        digests[c] = h;
    }
    sv[t] = best.v;
    si[t] = best.i;
    __syncthreads();
    // Thread g folds group g's chunk digests (all written before the barrier above).
    for (int g = t; g < n_groups; g += RS_THREADS) {
        unsigned long long h = FNV_BASIS;
        const int end = min(n_chunks, (g + 1) * RS_GROUP);
        for (int c = g * RS_GROUP; c < end; ++c) h = fnv_word(h, digests[c]);
        digests[n_chunks + g] = h;
    }
    block_argmax(sv, si, t);
    const int am = si[0] < 0 ? 0 : si[0];
    const float m = si[0] < 0 ? NEG_INF : sv[0];
    __syncthreads();

    // The draw: the same exact argmax over the perturbed values.
    int drawn = -1;
    if (draw) {
        sv[t] = drawn_best.v;
        si[t] = drawn_best.i;
        __syncthreads();
        block_argmax(sv, si, t);
        drawn = si[0] < 0 ? 0 : si[0];
    }

    // log Σ exp(x - m) and, for a top-p draw, Σ exp(x·inv_t - m·inv_t) (gumbel.rs's
    // tempered_sum): per thread in index order, then the tree (the same order for both).
    float acc = 0.0f, acc_t = 0.0f;
    const float mt = m * inv_t;
    if (m != NEG_INF) {
        if (nucleus) {
            strided_in_order(row, vocab, t, [&](float v, int) {
                acc += expf(v - m);
                acc_t += expf(v * inv_t - mt);
            });
        } else {
            strided_in_order(row, vocab, t, [&](float v, int) { acc += expf(v - m); });
        }
    }
    ss[t] = acc;
    sv[t] = acc_t;
    __syncthreads();
    for (int s = RS_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) {
            ss[t] = ss[t] + ss[t + s];
            sv[t] = sv[t] + sv[t + s];
        }
        __syncthreads();
    }

    if (t == 0) {
        unsigned long long h = FNV_BASIS;
        for (int g = 0; g < n_groups; ++g) h = fnv_word(h, digests[n_chunks + g]);
        const unsigned long long p = pr[0];
        const float nan = __int_as_float(0x7fc00000);
        float* of = out_f + (size_t)blockIdx.x * 6;
        of[0] = vocab > 0 ? row[am] : nan;
        of[1] = (m == NEG_INF) ? m : m + logf(ss[0]);
        of[2] = (p < (unsigned long long)vocab) ? row[p] : nan;
        of[3] = (drawn >= 0 && vocab > 0) ? row[drawn] : nan;
        of[4] = nucleus ? sv[0] : nan;
        of[5] = 0.0f;
        unsigned long long* ou = out_u + (size_t)blockIdx.x * 3;
        ou[0] = (unsigned long long)am;
        ou[1] = h;
        ou[2] = drawn >= 0 ? (unsigned long long)drawn : 0xffffffffULL;
    }
}

// The draws of constrained rows over their allowed ids alone (model/src/constraint.rs's
// draw_masked): the argmax of the allowed values (mode 0) or of their Gumbel keys
// x·inv_t + g(key, i) (mode 1), NaN never winning, lowest index on ties. Where no allowed
// value (or key) is above −∞ the answer is "none" (u32::MAX): the host then draws from the
// row, whose fallback rules live there alone. Two kernels: each row's mask words split into
// `gridDim.y` parts, each part's best (key, index) from one block, then the parts' best per
// row. Every argmax is exact (larger key, then lower index) and each thread visits its ids
// in increasing order, so the winner depends only on the row and its mask, not on the
// split.

// grid: (masked rows, parts); block: RS_THREADS.
// rows: [n] the logits row of each; params: [n, 2] = (key, mode << 32 | inv_t bits);
// bits: [n, words] the allowed ids (id i is bit i % 32 of word i / 32);
// part: [n, parts, 2] = (best key bits, its index or u32::MAX for none).
extern "C" __global__ void masked_draw_kernel(const float* __restrict__ x, int cols, int vocab,
                                              int words, const unsigned int* __restrict__ rows,
                                              const unsigned long long* __restrict__ params,
                                              const unsigned int* __restrict__ bits,
                                              unsigned int* __restrict__ part) {
    pdl_enter();
    __shared__ float sv[RS_THREADS];
    __shared__ int si[RS_THREADS];
    const int t = threadIdx.x;
    const float* row = x + (size_t)rows[blockIdx.x] * cols;
    const unsigned int* mask = bits + (size_t)blockIdx.x * words;
    const unsigned long long* pr = params + (size_t)blockIdx.x * 2;
    const unsigned long long key = pr[0];
    const bool gumbel = (unsigned int)(pr[1] >> 32) == 1;
    const float inv_t = __uint_as_float((unsigned int)(pr[1] & 0xffffffffu));
    const int per = (words + gridDim.y - 1) / gridDim.y;
    const int w_begin = blockIdx.y * per;
    const int w_end = min(words, w_begin + per);
    // A warp takes 32 mask words at a time (one coalesced read), skips the empty ones
    // together, and reads each other word's allowed values at once: lane b takes id
    // w·32 + b.
    const int lane = t & 31;
    BestOf best;
    for (int w0 = w_begin + (t >> 5) * 32; w0 < w_end; w0 += RS_THREADS) {
        const unsigned int mine = (w0 + lane < w_end) ? mask[w0 + lane] : 0u;
        unsigned int busy = __ballot_sync(0xffffffffu, mine != 0u);
        while (busy != 0u) {
            const int j = __ffs(busy) - 1;
            busy &= busy - 1;
            const unsigned int b = __shfl_sync(0xffffffffu, mine, j);
            const int i = (w0 + j) * 32 + lane;
            if (((b >> lane) & 1u) != 0u && i < vocab) {
                const float v = row[i];
                if (v == v) best.see(gumbel ? v * inv_t + gumbel_noise(key, (unsigned int)i) : v, i);
            }
        }
    }
    sv[t] = best.v;
    si[t] = best.i;
    __syncthreads();
    block_argmax(sv, si, t);
    if (t == 0) {
        unsigned int* o = part + ((size_t)blockIdx.x * gridDim.y + blockIdx.y) * 2;
        o[0] = __float_as_uint(sv[0]);
        o[1] = si[0] < 0 ? 0xffffffffu : (unsigned int)si[0];
    }
}

// grid: masked rows; block: 32 (parts ≤ 32).
// out: [n, 2] = (drawn index or u32::MAX, the row's value there as f32 bits).
extern "C" __global__ void masked_draw_combine_kernel(const float* __restrict__ x, int cols,
                                                      const unsigned int* __restrict__ rows,
                                                      const unsigned int* __restrict__ part,
                                                      int parts,
                                                      unsigned int* __restrict__ out) {
    pdl_enter();
    const int lane = threadIdx.x;
    float v = 0.0f;
    int i = -1;
    if (lane < parts) {
        const unsigned int* p = part + ((size_t)blockIdx.x * parts + lane) * 2;
        v = __uint_as_float(p[0]);
        i = p[1] == 0xffffffffu ? -1 : (int)p[1];
    }
    for (int s = 16; s > 0; s >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, v, s);
        const int oi = __shfl_down_sync(0xffffffffu, i, s);
        if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) {
            v = ov;
            i = oi;
        }
    }
    if (lane == 0) {
        const bool found = i >= 0 && v != NEG_INF;
        const float* row = x + (size_t)rows[blockIdx.x] * cols;
        out[2 * blockIdx.x] = found ? (unsigned int)i : 0xffffffffu;
        out[2 * blockIdx.x + 1] = found ? __float_as_uint(row[i]) : 0x7fc00000u;
    }
}
