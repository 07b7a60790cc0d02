// RMSNorm, one block of NORM_THREADS per row. Rows of a multiple of 4 columns (up to
// NORM_THREADS·NORM_REGS): thread t owns the 4-column groups g = t, t + 256, ... and sums
// x[c]² over their columns in order (16-byte loads and stores); other rows: thread t sums
// x[c]² over c = t, t + 256, ... in order. Then a fixed tree over the 256 partials
// (sh[t] + sh[t + s] for s = 128, 64, ..., 1). The block size is a constant and the order
// a function of the width alone, so a row's bits never depend on the number of rows.
// kernels/src/cuda/gpu_tests.rs (rms_norm_is_the_block_order_on_the_host) holds the host
// definition of these bits.

#define NORM_THREADS 256
// Columns per thread held in registers between the sum and the scaling: rows up to 8192
// wide are read once, with every load (row and weights) issued before the first fma (a
// batch-1 row is one block on one SM, so its time is load latency, not bandwidth). Wider
// rows loop.
#define NORM_REGS 32

// The tree over the block's partials. Levels 128 and 64 go through shared memory; warp 0
// does level 32 from shared memory and the last five with shuffles: lane t adds lane
// t + s's value, the operands and order of sh[t] + sh[t + s]. Returns the root to every
// thread.
__device__ __forceinline__ float norm_tree(float acc) {
    __shared__ float sh[NORM_THREADS];
    __shared__ float root;
    const int t = threadIdx.x;
    sh[t] = acc;
    __syncthreads();
    for (int s = NORM_THREADS / 2; s >= 64; s >>= 1) {
        if (t < s) sh[t] = sh[t] + sh[t + s];
        __syncthreads();
    }
    if (t < 32) {
        float v = sh[t] + sh[t + 32];
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) v = v + __shfl_down_sync(0xffffffffu, v, s);
        if (t == 0) root = v;
    }
    __syncthreads();
    return root;
}

// The rows of a multiple of 4 columns: 16-byte loads and stores, a quarter of the load
// instructions (ncu, batch 64 on an H200: 4.83 → 3.54 µs per add + RMSNorm). Every row
// is 16-byte aligned: the host passes whole allocations (DevF32 / DevBf16 are owned
// device buffers, 256-byte aligned), and a row is a multiple of 16 bytes.
template <bool ADD>
__device__ __forceinline__ void rms_norm_row_vec(float* __restrict__ xr, const float* __restrict__ yr,
                                                 const float* __restrict__ weight, float* __restrict__ o,
                                                 bf16_t* __restrict__ ob, int cols, float eps) {
    constexpr int G = NORM_REGS / 4;
    const int t = threadIdx.x;
    const int groups = cols >> 2;
    float4* x4 = reinterpret_cast<float4*>(xr);
    const float4* y4 = reinterpret_cast<const float4*>(yr);
    const float4* w4 = reinterpret_cast<const float4*>(weight);
    float4 v[G], w[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
        const int g = t + j * NORM_THREADS;
        v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        w[j] = v[j];
        if (g < groups) {
            v[j] = x4[g];
            if (ADD) {
                const float4 b = y4[g];
                v[j].x += b.x, v[j].y += b.y, v[j].z += b.z, v[j].w += b.w;
            }
            w[j] = w4[g];
        }
    }
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < G; ++j) {
        const int g = t + j * NORM_THREADS;
        if (g < groups) {
            if (ADD) x4[g] = v[j];
            acc = __fmaf_rn(v[j].x, v[j].x, acc);
            acc = __fmaf_rn(v[j].y, v[j].y, acc);
            acc = __fmaf_rn(v[j].z, v[j].z, acc);
            acc = __fmaf_rn(v[j].w, v[j].w, acc);
        }
    }
    const float inv = 1.0f / sqrtf(norm_tree(acc) / (float)cols + eps);
#pragma unroll
    for (int j = 0; j < G; ++j) {
        const int g = t + j * NORM_THREADS;
        if (g < groups) {
            const float4 r = make_float4((v[j].x * inv) * w[j].x, (v[j].y * inv) * w[j].y,
                                         (v[j].z * inv) * w[j].z, (v[j].w * inv) * w[j].w);
            reinterpret_cast<float4*>(o)[g] = r;
            if (ob) {
                const unsigned int lo = (unsigned int)f32_to_bf16(r.x) | ((unsigned int)f32_to_bf16(r.y) << 16);
                const unsigned int hi = (unsigned int)f32_to_bf16(r.z) | ((unsigned int)f32_to_bf16(r.w) << 16);
                reinterpret_cast<uint2*>(ob)[g] = make_uint2(lo, hi);
            }
        }
    }
}

// One row: if ADD, x += y first (each element's add is add_assign_kernel's, stored back to
// x). outb (may be null): the output rounded to bf16 as well, for a GEMM that reads it
// (the rounding the GEMM would do itself, without a pass of its own).
template <bool ADD>
__device__ __forceinline__ void rms_norm_row(float* __restrict__ xr, const float* __restrict__ yr,
                                             const float* __restrict__ weight, float* __restrict__ o,
                                             bf16_t* __restrict__ ob, int cols, float eps) {
    const int t = threadIdx.x;
    float acc = 0.0f;
    if ((cols & 3) == 0 && cols <= NORM_THREADS * NORM_REGS) {
        rms_norm_row_vec<ADD>(xr, yr, weight, o, ob, cols, eps);
        return;
    }
    if (cols <= NORM_THREADS * NORM_REGS) {
        // The weights are loaded with the row: loaded after the tree, each output waited
        // a round trip for its weight (ncu on an H200: 950 instructions per warp, 69 % of
        // the stalls on L1TEX, 10 µs for a 128-row launch).
        float v[NORM_REGS], w[NORM_REGS];
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j) {
            const int c = t + j * NORM_THREADS;
            v[j] = 0.0f;
            w[j] = 0.0f;
            if (c < cols) {
                v[j] = ADD ? xr[c] + yr[c] : xr[c];
                w[j] = weight[c];
            }
        }
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j) {
            const int c = t + j * NORM_THREADS;
            if (c < cols) {
                if (ADD) xr[c] = v[j];
                acc = __fmaf_rn(v[j], v[j], acc);
            }
        }
        const float inv = 1.0f / sqrtf(norm_tree(acc) / (float)cols + eps);
#pragma unroll
        for (int j = 0; j < NORM_REGS; ++j) {
            const int c = t + j * NORM_THREADS;
            if (c < cols) {
                const float r = (v[j] * inv) * w[j];
                o[c] = r;
                if (ob) ob[c] = f32_to_bf16(r);
            }
        }
        return;
    }
    for (int c = t; c < cols; c += NORM_THREADS) {
        const float v = ADD ? xr[c] + yr[c] : xr[c];
        if (ADD) xr[c] = v;
        acc = __fmaf_rn(v, v, acc);
    }
    const float inv = 1.0f / sqrtf(norm_tree(acc) / (float)cols + eps);
    for (int c = t; c < cols; c += NORM_THREADS) {
        const float r = (xr[c] * inv) * weight[c];
        o[c] = r;
        if (ob) ob[c] = f32_to_bf16(r);
    }
}

extern "C" __global__ void rms_norm_kernel(const float* __restrict__ x, const float* __restrict__ weight,
                                           float* __restrict__ out, bf16_t* __restrict__ outb, int cols, float eps) {
    pdl_enter();
    const size_t off = (size_t)blockIdx.x * cols;
    rms_norm_row<false>(const_cast<float*>(x) + off, nullptr, weight, out + off, outb ? outb + off : nullptr,
                        cols, eps);
}

// x += y, then RMSNorm of the sum: the residual add and the next norm in one pass, with
// the bits of add_assign_kernel followed by rms_norm_kernel.
extern "C" __global__ void add_rms_norm_kernel(float* __restrict__ x, const float* __restrict__ y,
                                               const float* __restrict__ weight, float* __restrict__ out,
                                               bf16_t* __restrict__ outb, int cols, float eps) {
    pdl_enter();
    const size_t off = (size_t)blockIdx.x * cols;
    rms_norm_row<true>(x + off, y + off, weight, out + off, outb ? outb + off : nullptr, cols, eps);
}

// Rows of at most 128 columns, a multiple of 4 (the attention heads' q/k norms: one row
// per token and head): one warp per row, NORM_WARP_ROWS rows per block. Lane t owns
// 4-column group t, as thread t does in rms_norm_row_vec, and the block's tree reduces to
// the same shuffles here: partials past the row's groups are +0, and every level of
// norm_tree above the warp adds +0 to a sum of squares (itself), so the root and every
// output have rms_norm_kernel's bits. A block per row left 7 of its 8 warps idle.
#define NORM_WARP_ROWS 8
extern "C" __global__ void rms_norm_warp_kernel(const float* __restrict__ x, const float* __restrict__ weight,
                                                float* __restrict__ out, bf16_t* __restrict__ outb,
                                                long long rows, int cols, float eps) {
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * NORM_WARP_ROWS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int groups = cols >> 2;
    const float4* x4 = reinterpret_cast<const float4*>(x + r * cols);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f), w = v;
    if (lane < groups) {
        v = x4[lane];
        w = reinterpret_cast<const float4*>(weight)[lane];
    }
    float acc = 0.0f;
    if (lane < groups) {
        acc = __fmaf_rn(v.x, v.x, acc);
        acc = __fmaf_rn(v.y, v.y, acc);
        acc = __fmaf_rn(v.z, v.z, acc);
        acc = __fmaf_rn(v.w, v.w, acc);
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) acc = acc + __shfl_down_sync(0xffffffffu, acc, s);
    const float root = __shfl_sync(0xffffffffu, acc, 0);
    const float inv = 1.0f / sqrtf(root / (float)cols + eps);
    if (lane < groups) {
        const float4 o = make_float4((v.x * inv) * w.x, (v.y * inv) * w.y, (v.z * inv) * w.z, (v.w * inv) * w.w);
        reinterpret_cast<float4*>(out + r * cols)[lane] = o;
        if (outb) {
            const unsigned int lo = (unsigned int)f32_to_bf16(o.x) | ((unsigned int)f32_to_bf16(o.y) << 16);
            const unsigned int hi = (unsigned int)f32_to_bf16(o.z) | ((unsigned int)f32_to_bf16(o.w) << 16);
            reinterpret_cast<uint2*>(outb + r * cols)[lane] = make_uint2(lo, hi);
        }
    }
}
