// Top-k candidates of each logits row, so that top-k sampling need not download the row:
// the k largest values (NaN excluded), in model/src/sampling.rs's order — descending by
// f32 total order, lowest index first on ties — as (index, value) pairs.
//
// Every value becomes one u64 key that orders exactly so (sampling.rs::order_key): the
// value's bits mapped to an order-preserving u32 in the high half, the complemented index
// in the low half. Keys are unique, so "the k largest keys" has one answer and the work is
// integer only: a radix select finds the k-th largest key T (8 passes of 8 bits, each a
// shared-memory histogram of the keys that match the digits chosen so far), the keys
// ≥ T (exactly k) are gathered and sorted in shared memory (bitonic). One block per row.

#define SEL_THREADS 1024
#define SEL_MAX_K 1024

__device__ __forceinline__ unsigned long long select_key(float v, unsigned int i) {
    const unsigned int b = __float_as_uint(v);
    const unsigned int k = (b >> 31) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)k << 32) | (unsigned long long)(~i);
}

// grid: rows; block: SEL_THREADS. ks[r]: how many candidates row r wants (0: none, at
// most SEL_MAX_K). out_idx / out_val: [rows, kmax]; out_n[r]: how many were written
// (min(ks[r], non-NaN values)).
extern "C" __global__ void __launch_bounds__(SEL_THREADS) top_k_select_kernel(
    const float* __restrict__ x, int cols, int vocab, const unsigned int* __restrict__ ks, int kmax,
    unsigned int* __restrict__ out_idx, float* __restrict__ out_val, unsigned int* __restrict__ out_n) {
    pdl_enter();
    __shared__ unsigned int hist[256];
    __shared__ unsigned long long prefix;
    __shared__ unsigned int need;  // how many of the keys under the current prefix to take
    __shared__ unsigned int n_valid;
    __shared__ unsigned int n_got;
    __shared__ unsigned long long cand[SEL_MAX_K];
    const int t = threadIdx.x;
    const float* row = x + (size_t)blockIdx.x * cols;
    const unsigned int k = min(ks[blockIdx.x], (unsigned int)SEL_MAX_K);
    if (k == 0) {
        if (t == 0) out_n[blockIdx.x] = 0;
        return;
    }
    if (t == 0) {
        prefix = 0;
        n_valid = 0;
        n_got = 0;
    }
    __syncthreads();
    unsigned int mine = 0;
    for (int i = t; i < vocab; i += SEL_THREADS) mine += row[i] == row[i];
    atomicAdd(&n_valid, mine);
    __syncthreads();
    const unsigned int kk = min(k, n_valid);
    if (t == 0) need = kk;
    if (kk > 0) {
        // Pass p picks the p-th byte (from the top) of T: the keys whose higher bytes equal
        // T's are histogrammed by this byte; walking the bins from the top, the bin where
        // the count reaches `need` is T's byte, and the keys in the bins above it are taken.
        for (int p = 0; p < 8; ++p) {
            for (int b = t; b < 256; b += SEL_THREADS) hist[b] = 0;
            __syncthreads();
            const int shift = 56 - 8 * p;
            const unsigned long long pre = prefix;
            for (int i = t; i < vocab; i += SEL_THREADS) {
                const float v = row[i];
                if (v != v) continue;
                const unsigned long long key = select_key(v, (unsigned int)i);
                if (p > 0 && (key >> (shift + 8)) != pre) continue;
                atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
            }
            __syncthreads();
            if (t < WARP) {
                // Read before the shuffles: the lane that finds T's byte writes `need`
                // after them, when every lane has read it.
                const unsigned int nd = need;
                // Lane l holds bins 255 − 8l .. 248 − 8l (high bins first); an exclusive
                // prefix sum over lanes gives the count above each lane's bins.
                unsigned int c[8], s = 0;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    c[j] = hist[255 - 8 * t - j];
                    s += c[j];
                }
                unsigned int incl = s;
#pragma unroll
                for (int o = 1; o < WARP; o <<= 1) {
                    const unsigned int u = __shfl_up_sync(FULL_MASK, incl, o);
                    if (t >= o) incl += u;
                }
                const unsigned int above = incl - s;
                if (above < nd && nd <= incl) {
                    unsigned int acc = above;
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        if (acc + c[j] >= nd) {
                            prefix = (pre << 8) | (unsigned long long)(255 - 8 * t - j);
                            need = nd - acc;
                            break;
                        }
                        acc += c[j];
                    }
                }
            }
            __syncthreads();
        }
        // prefix is now T itself: exactly kk keys are ≥ T.
        const unsigned long long T = prefix;
        for (int i = t; i < vocab; i += SEL_THREADS) {
            const float v = row[i];
            if (v != v) continue;
            const unsigned long long key = select_key(v, (unsigned int)i);
            if (key >= T) {
                const unsigned int at = atomicAdd(&n_got, 1u);
                if (at < SEL_MAX_K) cand[at] = key;  // exactly kk ≤ SEL_MAX_K arrive
            }
        }
    }
    // Bitonic sort, descending, of the gathered keys padded with zeros (every real key is
    // nonzero: a non-NaN value's high half is never 0).
    __syncthreads();
    const unsigned int got = min(n_got, (unsigned int)SEL_MAX_K);
    unsigned int n = 1;
    while (n < got) n <<= 1;
    for (unsigned int i = got + t; i < n; i += SEL_THREADS) cand[i] = 0;
    __syncthreads();
    for (unsigned int size = 2; size <= n; size <<= 1) {
        for (unsigned int stride = size >> 1; stride > 0; stride >>= 1) {
            for (unsigned int i = t; i < n; i += SEL_THREADS) {
                const unsigned int j = i ^ stride;
                if (j > i) {
                    const bool desc = (i & size) == 0;
                    const unsigned long long a = cand[i], b = cand[j];
                    if (desc ? (a < b) : (a > b)) {
                        cand[i] = b;
                        cand[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (unsigned int i = t; i < got; i += SEL_THREADS) {
        const unsigned int idx = ~(unsigned int)(cand[i] & 0xffffffffu);
        out_idx[(size_t)blockIdx.x * kmax + i] = idx;
        out_val[(size_t)blockIdx.x * kmax + i] = row[idx];
    }
    if (t == 0) out_n[blockIdx.x] = got;
}
