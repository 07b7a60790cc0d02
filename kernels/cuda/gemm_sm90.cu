// Hopper (sm_90a) variant of the tree GEMM: the leaf is a chain of wgmma m64n128k16 over
// the segment's k16 chunks, in order, from +0 (same masking rules as gemm_tree.cu, whose
// helpers and Params this file uses; the two are compiled as one program). Every sm_90a
// path below issues that same instruction, so the large-M kernel (whole tree in the block)
// and the small-M split kernel give the same bits.
//
// Shared-memory tiles are [rows][64 bf16] = 128-byte rows written by cp.async in the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r & 7), atoms 1024-aligned),
// the layout wgmma's descriptors read with swizzle mode 1.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// D[64x128] += A[64x16] * B[16x128]ᵀ, both K-major in 128-byte-swizzled shared memory.
DEVI void wgmma_m64n128k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

// The same leaf on narrower tiles (the whole-K kernels' 2·WN-column blocks): wgmma computes
// every output element from its own rows of A and B and its own accumulator, so the width
// of the instruction does not change any element's bits (the kernel tests compare paths).
DEVI void wgmma_m64n112k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %58, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55"
        "}, %56, %57, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

DEVI void wgmma_m64n96k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
        "}, %48, %49, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

DEVI void wgmma_m64n64k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

DEVI void wgmma_m64n56k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %30, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27"
        "}, %28, %29, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

DEVI void wgmma_m64n48k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23"
        "}, %24, %25, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

DEVI void wgmma_m64n32k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

DEVI void wgmma_m64n24k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %14, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11"
        "}, %12, %13, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

DEVI void wgmma_m64n16k16(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

// The leaf instruction for a consumer warpgroup's tile width.
template <int WN>
DEVI void wgmma_m64k16(float* d, u64 desc_a, u64 desc_b) {
    if constexpr (WN == 128) {
        wgmma_m64n128k16(d, desc_a, desc_b);
    } else if constexpr (WN == 112) {
        wgmma_m64n112k16(d, desc_a, desc_b);
    } else if constexpr (WN == 96) {
        wgmma_m64n96k16(d, desc_a, desc_b);
    } else if constexpr (WN == 64) {
        wgmma_m64n64k16(d, desc_a, desc_b);
    } else if constexpr (WN == 56) {
        wgmma_m64n56k16(d, desc_a, desc_b);
    } else if constexpr (WN == 48) {
        wgmma_m64n48k16(d, desc_a, desc_b);
    } else if constexpr (WN == 32) {
        wgmma_m64n32k16(d, desc_a, desc_b);
    } else if constexpr (WN == 24) {
        wgmma_m64n24k16(d, desc_a, desc_b);
    } else if constexpr (WN == 16) {
        wgmma_m64n16k16(d, desc_a, desc_b);
    } else {
        static_assert(WN == 128, "no wgmma for this tile width");
    }
}

DEVI void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DEVI void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
DEVI void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// cp.async writes are generic-proxy; wgmma reads through the async proxy.
DEVI void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// K-major, 128-byte swizzle: 8-row atoms 1024 bytes apart (SBO), LBO unused (16).
DEVI u64 smem_desc(u32 addr) {
    u64 d = 0;
    d |= (u64)((addr & 0x3FFFF) >> 4);
    d |= (u64)(16 >> 4) << 16;
    d |= (u64)(1024 >> 4) << 32;
    d |= 1ull << 62;
    return d;
}

// One block: BM (64 or 128: one or two warpgroups) x 128 output tile, BK = 64.
template <int BM, int STAGES, bool SPLIT>
DEVI void wg_block(const Params& p, int m_tile, int n_tile, int seg_begin, int seg_count) {
    constexpr int BN = 128, BK = 64, CH = 8;
    constexpr int THREADS = BM * 2;  // 128 per warpgroup of 64 rows
    constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
    constexpr int A_PER = BM * CH / THREADS;  // 16-byte chunks per thread per tile: 4
    constexpr int B_PER = BN * CH / THREADS;  // 8 (one warpgroup) or 4 (two)

    extern __shared__ unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;
    const u32 sA = base;
    const u32 sB = base + STAGES * A_BYTES;
    // Tree-stack spill slots (thread-private, [slot][reg][thread]), generic pointer.
    float* slots = (float*)(smem_raw + (base - raw) + STAGES * (A_BYTES + B_BYTES));

    const int tid = threadIdx.x;
    const int wg = tid >> 7, wl = tid & 127;
    const int row0 = m_tile * BM, col0 = n_tile * BN;
    const int tiles_per_seg = (p.seg_len + BK - 1) / BK;
    const int total = seg_count * tiles_per_seg;

    // Fixed per-thread load assignment: chunk column c, rows tid/8 + j*THREADS/8.
    const int c = tid & 7;
    const u16* a_src[A_PER];
    u32 a_dst[A_PER];
    bool a_ok[A_PER];
#pragma unroll
    for (int j = 0; j < A_PER; ++j) {
        const int r = (tid >> 3) + j * (THREADS / 8);
        a_ok[j] = row0 + r < p.M;
        a_src[j] = p.x + (long long)(a_ok[j] ? row0 + r : 0) * p.ldx + c * 8;
        a_dst[j] = r * 128 + ((c ^ (r & 7)) << 4);
    }
    const u16* b_src[B_PER];
    u32 b_dst[B_PER];
    bool b_ok[B_PER];
#pragma unroll
    for (int j = 0; j < B_PER; ++j) {
        const int r = (tid >> 3) + j * (THREADS / 8);
        b_ok[j] = col0 + r < p.N;
        b_src[j] = p.w + (long long)(b_ok[j] ? col0 + r : 0) * p.ldw + c * 8;
        b_dst[j] = r * 128 + ((c ^ (r & 7)) << 4);
    }

    // Load cursor: tile index, its segment and k offset.
    int ls = seg_begin, lkt = 0;
    auto load_next = [&](int stage) {
        const int k0 = ls * p.seg_len + lkt * BK;
        const int khi = min((ls + 1) * p.seg_len, p.K);
        const bool kok = k0 + c * 8 < khi;
        const u32 sa = sA + stage * A_BYTES, sb = sB + stage * B_BYTES;
        // Rows past M (columns past N) are left unwritten: an MMA output row depends only
        // on its own A row (column on its own B row), and those outputs are never stored.
        // At decode (M = 1) this skips 63 of the 64 A rows' zero-fills per tile.
#pragma unroll
        for (int j = 0; j < A_PER; ++j) {
            if (!a_ok[j]) continue;
            cp_async16(sa + a_dst[j], kok ? (const void*)(a_src[j] + k0) : (const void*)p.x, kok);
        }
#pragma unroll
        for (int j = 0; j < B_PER; ++j) {
            if (!b_ok[j]) continue;
            cp_async16(sb + b_dst[j], kok ? (const void*)(b_src[j] + k0) : (const void*)p.w, kok);
        }
        if (++lkt == tiles_per_seg) lkt = 0, ++ls;
    };

    float acc[64];
    float root[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f, root[i] = 0.f;

#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < total) load_next(t);
        cp_commit();
    }

    int t = 0;
    for (int sl = 0; sl < seg_count; ++sl) {
        const int s = seg_begin + sl;
        const int khi = min((s + 1) * p.seg_len, p.K);
        for (int kt = 0; kt < tiles_per_seg; ++kt, ++t) {
            cp_wait<STAGES - 2>();
            fence_proxy_async();
            __syncthreads();
            {
                const int tn = t + STAGES - 1;
                if (tn < total) load_next(tn % STAGES);
                cp_commit();
            }
            const int stage = t % STAGES;
            const int k0 = s * p.seg_len + kt * BK;
            // k16 chunks of this tile that start inside the segment (the leaf's chunks).
            const int nk = min(BK / 16, max(0, (khi - k0 + 15) / 16));
            const u64 da = smem_desc(sA + stage * A_BYTES + wg * 64 * 128);
            const u64 db = smem_desc(sB + stage * B_BYTES);
            wgmma_fence();
            if (nk == BK / 16) {
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk)
                    wgmma_m64n128k16(acc, da + 2 * kk, db + 2 * kk);
            } else {
                for (int kk = 0; kk < nk; ++kk) wgmma_m64n128k16(acc, da + 2 * kk, db + 2 * kk);
            }
            wgmma_commit();
            wgmma_wait0();
        }

        // Accumulator element i: row 16*(warp in group) + lane/4 + 8*((i/2)&1),
        // column 8*(i/4) + 2*(lane%4) + (i&1).
        if (SPLIT) {
            float* dst = p.ws + (long long)s * p.M * p.N;
            const int lane = wl & 31, wq = wl >> 5;
#pragma unroll
            for (int i = 0; i < 64; i += 2) {
                const int r = row0 + wg * 64 + wq * 16 + (lane >> 2) + 8 * ((i >> 1) & 1);
                const int cc = col0 + 8 * (i >> 2) + 2 * (lane & 3);
                if (r < p.M) {
                    if (cc < p.N) dst[(long long)r * p.N + cc] = acc[i];
                    if (cc + 1 < p.N) dst[(long long)r * p.N + cc + 1] = acc[i + 1];
                }
            }
        } else {
            float* s0 = slots;
            float* s1 = slots + 64 * THREADS;
#pragma unroll
            for (int i = 0; i < 64; ++i) {
                const int j = i * THREADS + tid;
                const float v = acc[i];
                float& r = root[i];
                switch (sl) {
                    case 0: r = v; break;
                    case 1: r = r + v; break;
                    case 2: s0[j] = v; break;
                    case 3: r = r + (s0[j] + v); break;
                    case 4: s0[j] = v; break;
                    case 5: s0[j] = s0[j] + v; break;
                    case 6: s1[j] = v; break;
                    default: r = r + (s0[j] + (s1[j] + v));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    }
    cp_wait<0>();

    if (SPLIT) {
        split_finish<BM, BN, THREADS>(p, plain_rows<BM>(p, m_tile), n_tile);
    } else {
        const int lane = wl & 31, wq = wl >> 5;
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
            const int r = row0 + wg * 64 + wq * 16 + (lane >> 2) + 8 * ((i >> 1) & 1);
            const int cc = col0 + 8 * (i >> 2) + 2 * (lane & 3);
            if (r >= p.M) continue;
            const long long idx = (long long)r * p.N + cc;
            if (cc < p.N) store_out(p.outf, p.outh, idx, root[i]);
            if (cc + 1 < p.N) store_out(p.outf, p.outh, idx + 1, root[i + 1]);
        }
    }
}

// Large M: 128x128 tiles (two warpgroups), 3 stages, the whole tree in the block; grouped
// 1-D grid as arbor_gemm_tree_128x128.
extern "C" __global__ void __launch_bounds__(256, 1) arbor_gemm_wg_tree_128x128(Params p) {
    const int num_m = (p.M + 127) / 128;
    const int num_n = (p.N + 127) / 128;
    const int group = 8;
    const int pid = blockIdx.x;
    const int per_group = group * num_n;
    const int first_m = (pid / per_group) * group;
    const int gsize = min(num_m - first_m, group);
    const int m_tile = first_m + (pid % per_group) % gsize;
    const int n_tile = (pid % per_group) / gsize;
    wg_block<128, 3, false>(p, m_tile, n_tile, 0, p.n_seg);
}

// Small M: one block per (128 columns, segment, 64 rows); split_finish combines.
extern "C" __global__ void __launch_bounds__(128) arbor_gemm_wg_split_64x128(Params p) {
    wg_block<64, 4, true>(p, blockIdx.z, blockIdx.x, blockIdx.y, 1);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
