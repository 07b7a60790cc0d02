// The experts' grouped GEMM of a mixture-of-experts layer: Y[P, N] where output row r
// (a (token, expert) pair in the expert-major layout of moe.cu) is X[gather[r]]·W_eᵀ for
// its expert e, each expert's weight found in a table of pointers. Every block is one of
// gemm_tree.cu's mma.sync blocks on a row tile that lies inside one expert, so each
// element is the same leaf chain and the same tree as the dense GEMM's: its bits depend
// on its own X row and W row only, never on how many rows the experts got.
//
// The grid is fixed by the call's P (an upper bound of the tiles), so a step can be
// recorded; blocks past the tile count the routing wrote return at once.

struct MoeTiles {
    const int* tile_expert;  // [max_tiles]
    const int* tile_row0;    // [max_tiles] first output row
    const int* tile_end;     // [max_tiles] the expert's end row
    const int* n_tiles;      // [1] tiles in use
    const int* gather;       // [P] X row of each output row, or null: X row r
    const u64* w_table;      // [experts] each expert's [N, ldw] weight
};

template <int BM>
DEVI bool moe_rows(const MoeTiles& t, int tile, Rows& rs) {
    if (tile >= *t.n_tiles) return false;
    rs = Rows{t.tile_row0[tile], t.tile_end[tile], t.gather, (const u16*)t.w_table[t.tile_expert[tile]],
              tile};
    return true;
}

// Each shape twice: the roots in f32 (outf), and the gate/up projection's silu(gate)·up
// in bf16 (outh, [P, N / 2]; gemm_tree.cu's SILU).
#define MOE_ENTRIES(SUFFIX, SILU)                                                                          \
    extern "C" __global__ void __launch_bounds__(128) arbor_moe_gemm_split_16x64##SUFFIX(Params p,         \
                                                                                        MoeTiles t) {      \
        Rows rs;                                                                                           \
        if (!moe_rows<16>(t, blockIdx.z, rs)) return;                                                      \
        tree_gemm_block<16, 64, 64, 16, 16, 6, true, SILU>(p, rs, blockIdx.x, blockIdx.y, 1);              \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) arbor_moe_gemm_split_64x64##SUFFIX(Params p,         \
                                                                                        MoeTiles t) {      \
        Rows rs;                                                                                           \
        if (!moe_rows<64>(t, blockIdx.z, rs)) return;                                                      \
        tree_gemm_block<64, 64, 64, 64, 16, 4, true, SILU>(p, rs, blockIdx.x, blockIdx.y, 1);              \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 1) arbor_moe_gemm_tree_128x128##SUFFIX(Params p,     \
                                                                                            MoeTiles t) {  \
        Rows rs;                                                                                           \
        if (!moe_rows<128>(t, blockIdx.y, rs)) return;                                                     \
        tree_gemm_block<128, 128, 64, 64, 32, 3, false, SILU>(p, rs, blockIdx.x, 0, p.n_seg);              \
    }

// The whole tree in a 128×128 block: grid (column tiles, row tiles); the split shapes:
// grid (column tiles, segments, row tiles).
MOE_ENTRIES(, false)
MOE_ENTRIES(_silu, true)

// The gate/up projection's X rows by pair, for the Hopper grouped kernel (gemm_moe_sm90.cu,
// whose TMA loads contiguous rows): xg[r] = x[gather[r]], K bf16 a row, K % 8 == 0 and
// both 16-byte aligned. A copy: the bits the GEMM reads are X's.
extern "C" __global__ void arbor_moe_gather_rows(const u16* __restrict__ x, const int* __restrict__ gather,
                                                 int P, int K, u16* __restrict__ xg) {
    pdl_enter();
    const int per_row = K >> 3;  // 16-byte vectors
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)P * per_row) return;
    const long long r = i / per_row;
    const int c = (int)(i - r * per_row);
    ((uint4*)(xg + r * K))[c] = ((const uint4*)(x + (long long)gather[r] * K))[c];
}
