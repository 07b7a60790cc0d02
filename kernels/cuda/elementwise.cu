// Element-wise kernels: one thread per element, no reductions.

extern "C" __global__ void silu_mul_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                                           float* __restrict__ out, long long count) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    out[i] = silu_mul(gate[i], up[i]);
}

// The gate/up projection's output with gate and up columns alternating (gu = [rows, 2·inter],
// column 2j gate j, column 2j + 1 up j: the layout whose GEMM epilogue computes this itself,
// gemm_sm90_tma.cu): out = silu(gate)·up, the bits of silu_mul_kernel on the two halves.
// outb (may be null): the output rounded to bf16 as well (for the down GEMM).
extern "C" __global__ void silu_mul_pairs_kernel(const float2* __restrict__ gu, float* __restrict__ out,
                                                 bf16_t* __restrict__ outb, long long count) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const float2 v = gu[i];
    const float y = silu_mul(v.x, v.y);
    out[i] = y;
    if (outb) outb[i] = f32_to_bf16(y);
}

// Columns [col0, col0 + cols) of src [rows, src_cols] into dst [rows, cols].
extern "C" __global__ void copy_cols_kernel(const float* __restrict__ src, float* __restrict__ dst,
                                            long long rows, int src_cols, int col0, int cols) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    const long long r = i / cols;
    dst[i] = src[r * src_cols + col0 + (i - r * cols)];
}

extern "C" __global__ void add_row_bias_kernel(float* __restrict__ x, const float* __restrict__ bias,
                                               long long count, int cols) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] = x[i] + bias[i % cols];
}

extern "C" __global__ void add_assign_kernel(float* __restrict__ x, const float* __restrict__ y, long long count) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] = x[i] + y[i];
}

// out[r, c] = table[ids[r], c] as f32. ids are checked on the host.
extern "C" __global__ void embedding_kernel(const bf16_t* __restrict__ table, const unsigned int* __restrict__ ids,
                                            float* __restrict__ out, int rows, int cols) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    const int r = (int)(i / cols);
    const int c = (int)(i % cols);
    out[i] = bf16_to_f32(table[(size_t)ids[r] * cols + c]);
}

// out[r, :] = x[idx[r], :]
extern "C" __global__ void select_rows_kernel(const float* __restrict__ x, const unsigned int* __restrict__ idx,
                                              float* __restrict__ out, int rows, int cols) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    const int r = (int)(i / cols);
    const int c = (int)(i % cols);
    out[i] = x[(size_t)idx[r] * cols + c];
}

// gathered [world, rows, cols] (an all-gather's rank-major output) → out [rows, world*cols].
extern "C" __global__ void interleave_cols_kernel(const float* __restrict__ gathered, float* __restrict__ out,
                                                  int world, int rows, int cols) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long total = (long long)world * rows * cols;
    if (i >= total) return;
    const int c = (int)(i % cols);
    const long long rest = i / cols;
    const int r = (int)(rest % rows);
    const int w = (int)(rest / rows);
    out[((size_t)r * world + w) * cols + c] = gathered[i];
}

// Write K and V rows ([rows, n_kv·head_dim], rounded to bf16) into one layer of the paged
// cache: row r at position row_pos[r] of the sequence whose block table starts at
// table[row_toff[r]].
extern "C" __global__ void kv_write_kernel(bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                           const float* __restrict__ k, const float* __restrict__ v,
                                           const unsigned int* __restrict__ row_pos, const unsigned int* __restrict__ row_toff,
                                           const unsigned int* __restrict__ table, int rows, int n_kv, int head_dim,
                                           int layer, int blocks) {
    pdl_enter();
    const int width = n_kv * head_dim;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * width) return;
    const int r = (int)(i / width);
    const int c = (int)(i % width);
    const int h = c / head_dim;
    const size_t dst = kv_row_at(table, row_toff[r], row_pos[r], layer, blocks, n_kv, head_dim) +
                       (size_t)h * KV_BLOCK * head_dim + (c % head_dim);
    kc[dst] = f32_to_bf16(k[i]);
    vc[dst] = f32_to_bf16(v[i]);
}

// f16 bits to f32, exactly (subnormals included): no CUDA half header is needed.
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    const unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    const unsigned int exp = ((unsigned int)h >> 10) & 0x1fu;
    const unsigned int man = (unsigned int)h & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (exp != 0u) return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
    // ±0 or a subnormal: man · 2^-24 is exact in f32.
    const float v = (float)man * 5.9604644775390625e-8f;
    return __uint_as_float(sign | __float_as_uint(v));
}

// A block of a received weight cut into a bf16 matrix: element (r, c) of rows × cols,
// taken from source row row0 + r and column col0 + c of a [*, src_k] tensor of `dtype`
// (0 bf16, 1 f16, 2 f32), lands at destination row dst_row0 + r·dst_step, column c, of a
// [*, dst_k] matrix. The conversion to bf16 is the host's (half::bf16::from_f32 of the
// exact f32 value). The smallest source index of a value that is not finite in bf16 goes
// to *first_bad (which the caller set to ~0). The source is read as bytes' worth of its
// type only where `aligned` says the address allows (a packed buffer may place a tensor at
// any byte).
extern "C" __global__ void cut_to_bf16_kernel(const unsigned char* __restrict__ src, int dtype,
                                              int aligned, long long src_k, long long row0,
                                              long long col0, long long rows, long long cols,
                                              bf16_t* __restrict__ dst, long long dst_k,
                                              long long dst_row0, long long dst_step,
                                              unsigned long long* __restrict__ first_bad) {
    pdl_enter();
    const long long count = rows * cols;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        const long long r = i / cols;
        const long long c = i - r * cols;
        const long long s = (row0 + r) * src_k + col0 + c;
        bf16_t out;
        if (dtype == 2) {
            unsigned int u;
            if (aligned) {
                u = ((const unsigned int*)src)[s];
            } else {
                const unsigned char* p = src + s * 4;
                u = (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
                    ((unsigned int)p[3] << 24);
            }
            out = f32_to_bf16(__uint_as_float(u));
        } else {
            unsigned short h;
            if (aligned) {
                h = ((const unsigned short*)src)[s];
            } else {
                const unsigned char* p = src + s * 2;
                h = (unsigned short)((unsigned int)p[0] | ((unsigned int)p[1] << 8));
            }
            out = dtype == 0 ? h : f32_to_bf16(f16_to_f32(h));
        }
        dst[(dst_row0 + r * dst_step) * dst_k + c] = out;
        if ((out & 0x7f80u) == 0x7f80u) atomicMin(first_bad, (unsigned long long)s);
    }
}
