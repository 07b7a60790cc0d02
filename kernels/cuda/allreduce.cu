// Deterministic all-reduce kernels. Every kernel sums the W ranks' values
// of one element with the fixed pairwise tree ((r0+r1)+(r2+r3))+... in f32, in rank
// order, so every algorithm gives exactly the bits of `arbor_kernels::tree::combine_roots`.
// bf16 inputs are widened to f32, combined, and rounded once (nearest-even).
//
// Peer memory is read over NVLink through CUDA IPC mappings. Each rank owns one registered
// allocation laid out as [Signal | staging half 0 | staging half 1]; the half is picked by
// the parity of a device-side call counter, so a call never overwrites data a slow peer
// may still read from the previous call (see the proof in collective/src/gpu/ipc.rs).
//
// Compiled by NVRTC: no system headers.

#define ARBOR_MAX_RANKS 8
#define ARBOR_MAX_BLOCKS 128

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

struct Signal {
    u32 start[ARBOR_MAX_BLOCKS][ARBOR_MAX_RANKS];
    u32 mid[ARBOR_MAX_BLOCKS][ARBOR_MAX_RANKS];
    u32 calls;  // completed calls of the IPC kernels on this rank
    u32 done;   // blocks of the running call that have finished
    // Watchdog (set by the host once, before any call): a barrier gives up after waiting
    // this long for a peer (0: waits for ever) and writes 1 + that peer into `stalled`.
    // For ranks time-sliced on one GPU, where a peer's kernel may not run for a while;
    // the host reads `stalled` after the step and fails it (its outputs are garbage).
    u64 spin_limit_ns;
    u32 stalled;
    u32 pad;
};

// Base addresses of every rank's registered allocation, in this process's address space.
struct Peers {
    u64 base[ARBOR_MAX_RANKS];
};

__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ Signal* sig_of(const Peers& peers, int r) {
    return reinterpret_cast<Signal*>(peers.base[r]);
}

// Block-level barrier with the same block index on every rank. The block's earlier writes
// are released (bar.sync then st.release.sys is cumulative), the peers' are acquired.
// Flags only grow, so a fast peer that already wrote the next call's flag still passes.
// With a spin limit (the watchdog), a wait that exceeds it ends and is recorded.
__device__ __forceinline__ void block_barrier(const Peers& peers, int rank, int world,
                                              bool mid, u32 flag) {
    __syncthreads();
    if (threadIdx.x < (unsigned)world) {
        int p = threadIdx.x;
        Signal* remote = sig_of(peers, p);
        Signal* self = sig_of(peers, rank);
        u32* out = mid ? &remote->mid[blockIdx.x][rank] : &remote->start[blockIdx.x][rank];
        const u32* in = mid ? &self->mid[blockIdx.x][p] : &self->start[blockIdx.x][p];
        st_release_sys(out, flag);
        const u64 limit = self->spin_limit_ns;
        if (limit == 0) {
            while ((int)(ld_acquire_sys(in) - flag) < 0) {
            }
        } else {
            const u64 t0 = global_ns();
            while ((int)(ld_acquire_sys(in) - flag) < 0) {
                if (global_ns() - t0 > limit) {
                    atomicCAS(&self->stalled, 0u, (u32)p + 1u);
                    break;
                }
            }
        }
    }
    __syncthreads();
}

// Reads the call counter; every block of a call sees the same value because only the last
// block to finish advances it.
__device__ __forceinline__ u32 read_call(const Peers& peers, int rank) {
    __shared__ u32 s_call;
    if (threadIdx.x == 0) {
        s_call = *reinterpret_cast<volatile u32*>(&sig_of(peers, rank)->calls);
    }
    __syncthreads();
    return s_call;
}

__device__ __forceinline__ void finish_call(const Peers& peers, int rank, u32 call) {
    __syncthreads();
    if (threadIdx.x == 0) {
        Signal* self = sig_of(peers, rank);
        __threadfence();
        u32 prev = atomicAdd(&self->done, 1u);
        if (prev == gridDim.x - 1) {
            atomicExch(&self->done, 0u);
            atomicExch(&self->calls, call + 1u);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Element types. A pack is 16 bytes: 4 f32 or 8 bf16.

__device__ __forceinline__ float bf16_to_f32(u32 h) { return __uint_as_float(h << 16); }

__device__ __forceinline__ u32 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u >> 16) | 0x40u;  // quiet NaN, as half::bf16::from_f32
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

struct F32 {
    enum { E = 4 };
    typedef float Scalar;
    __device__ static void unpack(const uint4& p, float* f) {
        f[0] = __uint_as_float(p.x);
        f[1] = __uint_as_float(p.y);
        f[2] = __uint_as_float(p.z);
        f[3] = __uint_as_float(p.w);
    }
    __device__ static uint4 pack(const float* f) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                          __float_as_uint(f[3]));
    }
    __device__ static float to_f32(float x) { return x; }
    __device__ static float from_f32(float x) { return x; }
};

struct BF16 {
    enum { E = 8 };
    typedef u16 Scalar;
    __device__ static void unpack(const uint4& p, float* f) {
        u32 w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = bf16_to_f32(w[i] & 0xffffu);
            f[2 * i + 1] = bf16_to_f32(w[i] >> 16);
        }
    }
    __device__ static uint4 pack(const float* f) {
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = f32_to_bf16(f[2 * i]) | (f32_to_bf16(f[2 * i + 1]) << 16);
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
    __device__ static float to_f32(u16 x) { return bf16_to_f32(x); }
    __device__ static u16 from_f32(float x) { return (u16)f32_to_bf16(x); }
};

// The fixed tree over W (1, 2, 4, 8) values in rank order.
template <int W>
__device__ __forceinline__ float tree(const float* v) {
    if (W == 1) return v[0];
    if (W == 2) return v[0] + v[1];
    if (W == 4) return (v[0] + v[1]) + (v[2] + v[3]);
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

template <int W, typename T>
__device__ __forceinline__ uint4 tree_packs(const uint4* p) {
    float vals[W][T::E];
#pragma unroll
    for (int r = 0; r < W; r++) T::unpack(p[r], vals[r]);
    float out[T::E];
#pragma unroll
    for (int e = 0; e < T::E; e++) {
        float lane[W];
#pragma unroll
        for (int r = 0; r < W; r++) lane[r] = vals[r][e];
        out[e] = tree<W>(lane);
    }
    return T::pack(out);
}

__device__ __forceinline__ uint4 ld_peer(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// ---------------------------------------------------------------------------------------
// Baseline: `gathered` holds the W ranks' buffers back to back ([W][n]); any n, any
// alignment.

template <int W, typename T>
__device__ void tree_combine_body(const typename T::Scalar* gathered,
                                  typename T::Scalar* out, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float lane[W];
#pragma unroll
        for (int r = 0; r < W; r++) lane[r] = T::to_f32(gathered[r * n + i]);
        out[i] = T::from_f32(tree<W>(lane));
    }
}

#define ARBOR_DISPATCH_W(world, CALL) \
    switch (world) {                  \
        case 1: CALL(1); break;       \
        case 2: CALL(2); break;       \
        case 4: CALL(4); break;       \
        case 8: CALL(8); break;       \
        default: break;               \
    }

extern "C" __global__ void tree_combine_f32(const float* gathered, float* out, u64 n,
                                            int world) {
#define C(W) tree_combine_body<W, F32>(gathered, out, n)
    ARBOR_DISPATCH_W(world, C)
#undef C
}

extern "C" __global__ void tree_combine_bf16(const u16* gathered, u16* out, u64 n, int world) {
#define C(W) tree_combine_body<W, BF16>(gathered, out, n)
    ARBOR_DISPATCH_W(world, C)
#undef C
}

// ---------------------------------------------------------------------------------------
// One-shot: copy own input into the registered staging half, barrier, then every rank
// reads all W inputs and sums them in tree order. `n_packs` counts 16-byte packs; input and
// output are 16-byte aligned (checked on the host). `data_off` is the byte offset of
// staging half 0 inside a registered allocation, `half_bytes` the size of one half.

template <int W, typename T>
__device__ void oneshot_body(const uint4* in, uint4* out, u64 n_packs, const Peers& peers,
                             int rank, u64 data_off, u64 half_bytes) {
    u32 call = read_call(peers, rank);
    u64 half_off = data_off + (u64)(call & 1u) * half_bytes;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 first = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    uint4* mine = reinterpret_cast<uint4*>(peers.base[rank] + half_off);
    for (u64 i = first; i < n_packs; i += stride) mine[i] = in[i];
    block_barrier(peers, rank, W, false, call + 1u);
    const uint4* src[W];
#pragma unroll
    for (int r = 0; r < W; r++) src[r] = reinterpret_cast<const uint4*>(peers.base[r] + half_off);
    for (u64 i = first; i < n_packs; i += stride) {
        uint4 p[W];
#pragma unroll
        for (int r = 0; r < W; r++) p[r] = (r == rank) ? in[i] : ld_peer(src[r] + i);
        out[i] = tree_packs<W, T>(p);
    }
    finish_call(peers, rank, call);
}

extern "C" __global__ void oneshot_f32(const uint4* in, uint4* out, u64 n_packs, Peers peers,
                                       int rank, int world, u64 data_off, u64 half_bytes) {
#define C(W) oneshot_body<W, F32>(in, out, n_packs, peers, rank, data_off, half_bytes)
    ARBOR_DISPATCH_W(world, C)
#undef C
}

extern "C" __global__ void oneshot_bf16(const uint4* in, uint4* out, u64 n_packs, Peers peers,
                                        int rank, int world, u64 data_off, u64 half_bytes) {
#define C(W) oneshot_body<W, BF16>(in, out, n_packs, peers, rank, data_off, half_bytes)
    ARBOR_DISPATCH_W(world, C)
#undef C
}

// ---------------------------------------------------------------------------------------
// Two-shot: chunk c (packs [c*cp, min((c+1)*cp, n_packs))) is reduced by rank c. Every
// block handles the same within-chunk offsets j in every chunk, on every rank, so the
// barriers only need to pair equal block indices.
//   1. copy the chunks c != rank of the input into the staging half;
//   2. barrier; reduce own chunk from all W inputs in tree order; write it to the output
//      and to own staging chunk (only this rank ever reads its own chunk in step 2, and
//      from `in`, so the slot is free);
//   3. barrier; read every peer's reduced chunk from its staging half.

// `direct`: the peers' inputs are registered too (`inputs.base[r]` is rank r's input, mapped
// here), so step 1 is skipped and step 2 reads them in place. A caller may overwrite its
// input as soon as this call completes on its rank: every peer has passed the mid barrier
// by then, so every peer is done reading it.
template <int W, typename T, bool DIRECT>
__device__ void twoshot_body(const uint4* in, uint4* out, u64 n_packs, const Peers& peers,
                             const Peers& inputs, int rank, u64 data_off, u64 half_bytes) {
    u32 call = read_call(peers, rank);
    u64 half_off = data_off + (u64)(call & 1u) * half_bytes;
    const u64 cp = (n_packs + W - 1) / W;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 first = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    uint4* mine = reinterpret_cast<uint4*>(peers.base[rank] + half_off);
    const uint4* src[W];
    const uint4* red[W];
#pragma unroll
    for (int r = 0; r < W; r++) {
        red[r] = reinterpret_cast<const uint4*>(peers.base[r] + half_off);
        src[r] = DIRECT ? reinterpret_cast<const uint4*>(inputs.base[r]) : red[r];
    }

    if (!DIRECT) {
        for (u64 j = first; j < cp; j += stride) {
#pragma unroll
            for (int c = 0; c < W; c++) {
                u64 i = c * cp + j;
                if (c != rank && i < n_packs) mine[i] = in[i];
            }
        }
    }
    block_barrier(peers, rank, W, false, call + 1u);
    for (u64 j = first; j < cp; j += stride) {
        u64 i = rank * cp + j;
        if (i < n_packs) {
            uint4 p[W];
#pragma unroll
            for (int r = 0; r < W; r++) p[r] = (r == rank) ? in[i] : ld_peer(src[r] + i);
            uint4 s = tree_packs<W, T>(p);
            mine[i] = s;
            out[i] = s;
        }
    }
    block_barrier(peers, rank, W, true, call + 1u);
    for (u64 j = first; j < cp; j += stride) {
#pragma unroll
        for (int c = 0; c < W; c++) {
            u64 i = c * cp + j;
            if (c != rank && i < n_packs) out[i] = ld_peer(red[c] + i);
        }
    }
    finish_call(peers, rank, call);
}

extern "C" __global__ void twoshot_f32(const uint4* in, uint4* out, u64 n_packs, Peers peers,
                                       int rank, int world, u64 data_off, u64 half_bytes) {
#define C(W) twoshot_body<W, F32, false>(in, out, n_packs, peers, peers, rank, data_off, half_bytes)
    ARBOR_DISPATCH_W(world, C)
#undef C
}

extern "C" __global__ void twoshot_bf16(const uint4* in, uint4* out, u64 n_packs, Peers peers,
                                        int rank, int world, u64 data_off, u64 half_bytes) {
#define C(W) twoshot_body<W, BF16, false>(in, out, n_packs, peers, peers, rank, data_off, half_bytes)
    ARBOR_DISPATCH_W(world, C)
#undef C
}

extern "C" __global__ void twoshot_direct_f32(const uint4* in, uint4* out, u64 n_packs,
                                              Peers peers, Peers inputs, int rank, int world,
                                              u64 data_off, u64 half_bytes) {
#define C(W) twoshot_body<W, F32, true>(in, out, n_packs, peers, inputs, rank, data_off, half_bytes)
    ARBOR_DISPATCH_W(world, C)
#undef C
}

extern "C" __global__ void twoshot_direct_bf16(const uint4* in, uint4* out, u64 n_packs,
                                               Peers peers, Peers inputs, int rank, int world,
                                               u64 data_off, u64 half_bytes) {
#define C(W) twoshot_body<W, BF16, true>(in, out, n_packs, peers, inputs, rank, data_off, half_bytes)
    ARBOR_DISPATCH_W(world, C)
#undef C
}
