//! The launch paths: which kernel, its grid, block and shared memory, and the workspace
//! and counters it needs. All paths of one [`Family`] give the same bits.

use super::tma;
use crate::cpu::matmul::TreeMatmul;

/// Which tensor-core instruction the leaf is made of. Paths of one family give the same
/// bits; the two families need not agree with each other, so a device always uses one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `mma.sync.m16n8k16` (sm_80 and newer).
    Mma,
    /// `wgmma.m64n128k16` (sm_90a only).
    Wgmma,
}

/// Tile widths of the `wgwhole` kernels (two consumer warpgroups of half as many columns
/// each, whose wgmma is m64n(bn/2)k16 and whose W box has bn/2 rows), widest first.
pub const WHOLE_BNS: [usize; 5] = [224, 112, 64, 48, 32];
/// gemm_sm90_tma.cu WHOLE_SMEM: the shared memory a `wgwhole` block fills with its ring
/// stages and tree slots.
const WHOLE_SMEM: u32 = 225 * 1024;
/// Tile widths of the `wgquad` kernels.
pub const QUAD_BNS: [usize; 2] = [96, 64];
/// Tile widths of the `wgquad128x` kernels (128-row tiles), widest first.
pub const QUAD128_BNS: [usize; 2] = [128, 64];
/// One form of the swapped kernel: W rows and segments a block, its path name and its
/// kernel (gemm_sm90_swap.cu ARBOR_SWAP_KERNEL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapForm {
    pub tw: usize,
    pub spc: usize,
    pub name: &'static str,
    pub kernel: &'static str,
}

/// The swapped kernel's forms, each one wave of resident clusters for some llama3-8b layer
/// at TP 1, 2 or 4 (docs/gemm.md).
pub const SWAP_FORMS: [SwapForm; 7] = [
    SwapForm {
        tw: 64,
        spc: 1,
        name: "wgswap64s1",
        kernel: "arbor_gemm_wg_swap_64x8_s1",
    },
    SwapForm {
        tw: 64,
        spc: 2,
        name: "wgswap64s2",
        kernel: "arbor_gemm_wg_swap_64x8_s2",
    },
    SwapForm {
        tw: 64,
        spc: 4,
        name: "wgswap64s4",
        kernel: "arbor_gemm_wg_swap_64x8_s4",
    },
    SwapForm {
        tw: 64,
        spc: 8,
        name: "wgswap64s8",
        kernel: "arbor_gemm_wg_swap_64x8_s8",
    },
    SwapForm {
        tw: 128,
        spc: 4,
        name: "wgswap128s4",
        kernel: "arbor_gemm_wg_swap_128x8_s4",
    },
    SwapForm {
        tw: 128,
        spc: 8,
        name: "wgswap128s8",
        kernel: "arbor_gemm_wg_swap_128x8_s8",
    },
    SwapForm {
        tw: 448,
        spc: 4,
        name: "wgswap448s4",
        kernel: "arbor_gemm_wg_swap_448x8_s4",
    },
];

/// The form of `tw` W rows and `spc` segments a block, if it is compiled.
fn swap_form_of(tw: usize, spc: usize) -> Option<&'static SwapForm> {
    SWAP_FORMS.iter().find(|f| f.tw == tw && f.spc == spc)
}
/// gemm_sm90_swap.cu SWAP_XR: X rows a swapped block (the wgmma's N side).
pub const SWAP_XR: usize = 8;
/// gemm_sm90_swap.cu SWAP_SMEM: the shared memory a swapped block fills with its ring.
const SWAP_SMEM: u32 = 224 * 1024;

/// Tile widths of the persistent `wgtma128` kernels (128-row tiles), widest first.
pub const TMA_BNS: [usize; 3] = [128, 96, 64];
/// gemm_sm90_tma.cu TMA_SMEM: the shared memory a persistent block fills with its ring
/// stages and its s6 slot.
const TMA_SMEM: u32 = 226 * 1024;

/// Dynamic shared memory of a TMA kernel that fills `budget` bytes with `slots` bytes of
/// tree slots and as many ring stages of `stage` bytes as fit beside them (at most 8), plus
/// two mbarriers a stage and 1024 bytes for aligning the swizzle atoms: the kernels'
/// layouts (`TmaLayout`, `ClusterLayout` in gemm_sm90_tma.cu).
fn ring_smem(budget: u32, slots: u32, stage: u32) -> u32 {
    let stages = ((budget - slots) / stage).min(8);
    stages * stage + slots + 16 * stages + 1024
}

/// Whether a grid of `blocks` blocks, one per SM at a time, uses at least 7/8 of the
/// block slots of the waves it runs in.
pub(super) fn packs_waves(blocks: usize, sms: usize) -> bool {
    if blocks == 0 || sms == 0 {
        return false;
    }
    8 * blocks >= 7 * blocks.div_ceil(sms) * sms
}

/// Launch path. All paths of a [`Family`] give the same bits; [`Path::for_shape`] picks
/// by speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// mma.sync, 128×128 tiles, the whole tree inside the block.
    Tree128,
    /// mma.sync, one block per (64 columns, segment, 16 rows); the last block of a tile
    /// combines.
    Split16,
    /// mma.sync, one block per (64 columns, segment, 64 rows); the last block of a tile
    /// combines.
    Split64,
    /// wgmma, 128×128 tiles, the whole tree inside the block.
    WgTree128,
    /// wgmma, one block per (128 columns, segment, 64 rows); the last block of a tile
    /// combines.
    WgSplit64,
    /// wgmma fed by TMA, warp-specialised and persistent, 128×`bn` tiles (`bn` one of
    /// [`TMA_BNS`]), the whole tree in the block. Needs `k == n_seg·seg_len`.
    WgTma { bn: usize },
    /// wgmma fed by TMA, one block per (128 columns, segment, 64 rows); the tile's
    /// `n_seg` blocks are a cluster and combine over distributed shared memory. Needs
    /// `k == n_seg·seg_len`.
    WgCluster64,
    /// As `WgCluster64` with two segments per block (clusters of `n_seg / 2`), half the
    /// blocks; with a single segment (`n_seg = 1`) it is `WgCluster64`.
    WgCluster64x2,
    /// As `WgCluster64x2` with 64×256 tiles: two consumer warpgroups share each X tile
    /// (one block per SM). At M = 64 the narrow kernel's X tiles are a third of the bytes
    /// it streams; this halves them. With `n_seg = 1` it is `WgCluster64`.
    WgCluster64x2N256,
    /// wgmma fed by TMA, one block per 64×`bn` tile (two consumer warpgroups of `bn / 2`
    /// columns; `bn` one of [`WHOLE_BNS`]) summing all of the tile's segments and
    /// evaluating the tree itself: no cluster, no workspace. For an N whose tiles fill the
    /// SMs once (4096 × 28672: 128 blocks of 224). Needs `k == n_seg·seg_len`.
    WgWhole { bn: usize },
    /// As `WgWhole` with four segments per block (the subtree `(s0+s1)+(s2+s3)` in the
    /// block) and the tile's `n_seg / 4` blocks a cluster combining over distributed shared
    /// memory; `bn` one of [`QUAD_BNS`]. For the narrow layers at small M.
    WgQuad { bn: usize },
    /// As `WgQuad` on 128×`bn` tiles (`bn` one of [`QUAD128_BNS`]): the two consumer
    /// warpgroups take 64 rows each and share the W tile. For 129 ≤ M ≤ 512, where
    /// `wgtma128`'s few whole-K tiles leave SMs idle.
    WgQuad128 { bn: usize },
    /// wgmma fed by TMA with the operands swapped: W's rows are the instruction's 64-row
    /// side (`tw / 64` A operands a block) and 8 rows of X its N side (m64n8k16), so the
    /// accumulator holds only X's few rows; `tw` W rows × 8 X rows a block, `spc` segments
    /// a block (their subtree in registers) and a tile's `n_seg / spc` blocks a cluster
    /// folding over distributed shared memory, as `WgQuad` does: no workspace. For M ≤ 8
    /// (more rows run as row tiles of 8). `(tw, spc)` one of [`SWAP_FORMS`]. Needs
    /// `k == n_seg·seg_len`.
    WgSwap { tw: usize, spc: usize },
}

impl Path {
    /// The fastest path of `family` for a shape: by M, and for the Wgmma family the TMA
    /// kernels wherever the shape allows them (`k == n_seg·seg_len`, true of every model
    /// layer the tensor GEMM takes). The TMA crossover is at M = 64: on an H100 the
    /// persistent kernel beat the cluster kernel at every M from 96 up
    /// (docs/gemm.md, run 6).
    pub fn for_shape(s: &TreeMatmul, family: Family) -> Path {
        let tma = s.k == s.n_seg * s.seg_len;
        match (family, s.m) {
            (Family::Mma, 0..=16) => Path::Split16,
            (Family::Mma, 17..=256) => Path::Split64,
            (Family::Mma, _) => Path::Tree128,
            (Family::Wgmma, 0..=64) if tma => Path::WgCluster64,
            (Family::Wgmma, _) if tma => Path::WgTma { bn: 128 },
            (Family::Wgmma, 0..=256) => Path::WgSplit64,
            (Family::Wgmma, _) => Path::WgTree128,
        }
    }

    /// Every path of a family (all must agree bitwise).
    pub fn all(family: Family) -> &'static [Path] {
        match family {
            Family::Mma => &[Path::Tree128, Path::Split16, Path::Split64],
            Family::Wgmma => &[
                Path::WgTma { bn: 128 },
                Path::WgTma { bn: 96 },
                Path::WgTma { bn: 64 },
                Path::WgCluster64,
                Path::WgCluster64x2,
                Path::WgCluster64x2N256,
                Path::WgWhole { bn: 224 },
                Path::WgWhole { bn: 112 },
                Path::WgWhole { bn: 64 },
                Path::WgWhole { bn: 48 },
                Path::WgWhole { bn: 32 },
                Path::WgQuad { bn: 96 },
                Path::WgQuad { bn: 64 },
                Path::WgQuad128 { bn: 128 },
                Path::WgQuad128 { bn: 64 },
                Path::WgSwap { tw: 64, spc: 1 },
                Path::WgSwap { tw: 64, spc: 2 },
                Path::WgSwap { tw: 64, spc: 4 },
                Path::WgSwap { tw: 64, spc: 8 },
                Path::WgSwap { tw: 128, spc: 4 },
                Path::WgSwap { tw: 128, spc: 8 },
                Path::WgSwap { tw: 448, spc: 4 },
                Path::WgTree128,
                Path::WgSplit64,
            ],
        }
    }

    pub fn family(self) -> Family {
        match self {
            Path::Tree128 | Path::Split16 | Path::Split64 => Family::Mma,
            Path::WgTree128
            | Path::WgSplit64
            | Path::WgTma { .. }
            | Path::WgCluster64
            | Path::WgCluster64x2
            | Path::WgCluster64x2N256
            | Path::WgWhole { .. }
            | Path::WgQuad { .. }
            | Path::WgQuad128 { .. }
            | Path::WgSwap { .. } => Family::Wgmma,
        }
    }

    /// Whether the path loads through TMA tensor maps (and so needs `k == n_seg·seg_len`).
    pub fn is_tma(self) -> bool {
        matches!(
            self,
            Path::WgTma { .. }
                | Path::WgCluster64
                | Path::WgCluster64x2
                | Path::WgCluster64x2N256
                | Path::WgWhole { .. }
                | Path::WgQuad { .. }
                | Path::WgQuad128 { .. }
                | Path::WgSwap { .. }
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Path::Tree128 => "tree128",
            Path::Split16 => "split16",
            Path::Split64 => "split64",
            Path::WgTree128 => "wgtree128",
            Path::WgSplit64 => "wgsplit64",
            Path::WgTma { bn: 128 } => "wgtma128",
            Path::WgTma { bn: 96 } => "wgtma128x96",
            Path::WgTma { bn: 64 } => "wgtma128x64",
            Path::WgTma { .. } => "wgtma",
            Path::WgCluster64 => "wgcluster64",
            Path::WgCluster64x2 => "wgcluster64x2",
            Path::WgCluster64x2N256 => "wgcluster64x2n256",
            Path::WgWhole { bn: 224 } => "wgwhole224",
            Path::WgWhole { bn: 112 } => "wgwhole112",
            Path::WgWhole { bn: 64 } => "wgwhole64",
            Path::WgWhole { bn: 48 } => "wgwhole48",
            Path::WgWhole { bn: 32 } => "wgwhole32",
            Path::WgWhole { .. } => "wgwhole",
            Path::WgQuad { bn: 96 } => "wgquad96",
            Path::WgQuad { bn: 64 } => "wgquad64",
            Path::WgQuad { .. } => "wgquad",
            Path::WgQuad128 { bn: 128 } => "wgquad128x128",
            Path::WgQuad128 { bn: 64 } => "wgquad128x64",
            Path::WgQuad128 { .. } => "wgquad128",
            Path::WgSwap { tw, spc } => swap_form_of(tw, spc).map_or("wgswap", |f| f.name),
        }
    }

    /// Whether the path can store its result by TMA (`TmaParams::tma_out`): the persistent
    /// kernels whose tiles are whole store boxes, 32 f32 columns for plain roots, 128
    /// columns (two f32 boxes and one bf16 box of SiLU·mul values) for the epilogue.
    pub(super) fn tma_stores(self, silu: bool) -> bool {
        match self {
            Path::WgTma { bn } if silu => bn == 128,
            Path::WgTma { bn } => bn.is_multiple_of(32),
            _ => false,
        }
    }

    /// Whether the path keeps segment sums in the workspace (and arrival counters).
    pub(super) fn is_split(self) -> bool {
        matches!(self, Path::Split16 | Path::Split64 | Path::WgSplit64)
    }

    /// f32 elements of workspace the path uses: the split paths keep each segment sum
    /// (`n_seg·m·n`, required); a persistent kernel (`WgTma`) its tail's half roots
    /// (optional: given less, it runs without the tail split, with the same bits), as
    /// many as any device's grid can ask for; 0 for the others. Need not be initialised.
    pub fn workspace_len(self, m: usize, n: usize, n_seg: usize) -> usize {
        match self {
            _ if self.is_split() => n_seg * m * n,
            Path::WgTma { bn } => tma::tail_workspace_len(Self::max_tail(bn, m, n), bn),
            _ => 0,
        }
    }

    /// The most tail tiles a persistent kernel of 128×`bn` tiles can split on any device:
    /// a tail fills at most half a grid, which holds at most every tile and at most
    /// [`tma::MAX_PERSISTENT_BLOCKS`] blocks.
    fn max_tail(bn: usize, m: usize, n: usize) -> usize {
        Self::persistent_tiles(bn, m, n).min(tma::MAX_PERSISTENT_BLOCKS) / 2
    }

    /// Output tiles of a persistent kernel of 128×`bn` tiles.
    pub(super) fn persistent_tiles(bn: usize, m: usize, n: usize) -> usize {
        m.div_ceil(128) * n.div_ceil(bn)
    }

    /// Blocks of a persistent kernel of 128×`bn` tiles: one per tile, at most one per SM
    /// and at most [`tma::MAX_PERSISTENT_BLOCKS`].
    pub(super) fn persistent_blocks(bn: usize, m: usize, n: usize, sms: usize) -> usize {
        Self::persistent_tiles(bn, m, n)
            .min(sms)
            .min(tma::MAX_PERSISTENT_BLOCKS)
    }

    /// Blocks of a swapped kernel's tile (its cluster): `n_seg / spc`, one where the call
    /// has no more segments than a block sums (the kernel's `min(SPC, n_seg)`).
    pub(super) fn swap_cluster(spc: usize, n_seg: usize) -> usize {
        (n_seg / spc.max(1)).max(1)
    }

    /// u32 arrival counters the path uses: one per output tile for the split paths
    /// (required), two per tail tile for a persistent kernel (optional, as its
    /// workspace), 0 for the other tree paths. The counter buffer must be zeroed once when
    /// allocated; every call leaves the counters it used at zero, so one buffer serves
    /// calls of any shape (it is separate from the workspace because the sums' extent
    /// changes with the shape).
    pub fn counters_len(self, m: usize, n: usize) -> usize {
        match self {
            _ if self.is_split() => {
                let ((tiles_n, _, tiles_m), _) = self.launch_dims(m, n, 1);
                tiles_n * tiles_m
            }
            Path::WgTma { bn } => 2 * Self::max_tail(bn, m, n),
            _ => 0,
        }
    }

    /// Dynamic shared memory of the path's kernel; must match the template arguments in
    /// the .cu files: STAGES·(BM+BN)·BK·2 bytes, plus the tree paths' two f32 spill slots
    /// of the tree stack (64 values × 256 threads each), plus 1024 bytes for aligning the
    /// wgmma tiles to the swizzle atom.
    pub(super) fn smem_bytes(self) -> u32 {
        const SLOTS: u32 = 2 * 64 * 256 * 4;
        match self {
            Path::Tree128 => 3 * (128 + 128) * 64 * 2 + SLOTS,
            Path::Split16 => 6 * (16 + 64) * 64 * 2,
            Path::Split64 => 4 * (64 + 64) * 64 * 2,
            Path::WgTree128 => 3 * (128 + 128) * 64 * 2 + SLOTS + 1024,
            Path::WgSplit64 => 4 * (64 + 128) * 64 * 2 + 1024,
            // gemm_sm90_tma.cu TmaLayout<bn>: one f32 tree slot (bn / 2 values x 256
            // consumer threads), as many stages of (128 + bn) x 64 bf16 as fit in TMA_SMEM
            // beside it (at most 8; 5 at bn = 128), 2 mbarriers a stage, alignment.
            Path::WgTma { bn } => {
                let bn = bn as u32;
                ring_smem(TMA_SMEM, (bn / 2) * 256 * 4, (128 + bn) * 64 * 2)
            }
            // CL_STAGES = 4 stages of (64 + 128) x 64 bf16, 2 x 4 mbarriers, alignment (two
            // blocks fit on an SM).
            Path::WgCluster64 | Path::WgCluster64x2 => 4 * (64 + 128) * 64 * 2 + 64 + 1024,
            // ClusterLayout<2>: 5 stages of (64 + 256) x 64 bf16, 2 x 5 mbarriers, alignment.
            Path::WgCluster64x2N256 => 5 * (64 + 256) * 64 * 2 + 80 + 1024,
            // ClusterLayout<2, bn / 2, true>: two f32 tree slots (bn / 4 values x 256
            // consumer threads each), as many stages of (64 + bn) x 64 bf16 as fit in
            // WHOLE_SMEM beside them (at most 8), 2 mbarriers a stage, alignment.
            Path::WgWhole { bn } | Path::WgQuad { bn } => {
                let bn = bn as u32;
                ring_smem(WHOLE_SMEM, 2 * (bn / 4) * 256 * 4, (64 + bn) * 64 * 2)
            }
            // ClusterLayout<2, bn, true, true>: one f32 tree slot (bn / 2 values x 256
            // consumer threads), stages of (128 + bn) x 64 bf16 as above.
            Path::WgQuad128 { bn } => {
                let bn = bn as u32;
                ring_smem(WHOLE_SMEM, (bn / 2) * 256 * 4, (128 + bn) * 64 * 2)
            }
            // SwapLayout<tw / 64>: as many stages of (tw + 8) x 64 bf16 as fit in SWAP_SMEM
            // (no tree slots, no cap), 2 mbarriers a stage, alignment.
            Path::WgSwap { tw, .. } => {
                let stage = (tw + SWAP_XR) as u32 * 64 * 2;
                let stages = SWAP_SMEM / stage;
                stages * stage + 16 * stages + 1024
            }
        }
    }

    /// (grid, threads per block) for a shape.
    pub(super) fn launch_dims(
        self,
        m: usize,
        n: usize,
        n_seg: usize,
    ) -> ((usize, usize, usize), u32) {
        match self {
            Path::Tree128 | Path::WgTree128 => ((m.div_ceil(128) * n.div_ceil(128), 1, 1), 256),
            Path::Split16 => ((n.div_ceil(64), n_seg, m.div_ceil(16)), 128),
            Path::Split64 => ((n.div_ceil(64), n_seg, m.div_ceil(64)), 128),
            Path::WgSplit64 => ((n.div_ceil(128), n_seg, m.div_ceil(64)), 128),
            // Persistent: the launch caps the grid at the number of SMs.
            Path::WgTma { bn } => ((Self::persistent_tiles(bn, m, n), 1, 1), 384),
            Path::WgCluster64 => ((n.div_ceil(128) * n_seg, m.div_ceil(64), 1), 160),
            Path::WgCluster64x2 => (
                (n.div_ceil(128) * n_seg.div_ceil(2), m.div_ceil(64), 1),
                160,
            ),
            Path::WgCluster64x2N256 => (
                (n.div_ceil(256) * n_seg.div_ceil(2), m.div_ceil(64), 1),
                288,
            ),
            Path::WgWhole { bn } => ((n.div_ceil(bn), m.div_ceil(64), 1), 288),
            Path::WgQuad { bn } => ((n.div_ceil(bn) * n_seg.div_ceil(4), m.div_ceil(64), 1), 288),
            Path::WgQuad128 { bn } => (
                (n.div_ceil(bn) * n_seg.div_ceil(4), m.div_ceil(128), 1),
                288,
            ),
            Path::WgSwap { tw, spc } => (
                (
                    n.div_ceil(tw) * Self::swap_cluster(spc, n_seg),
                    m.div_ceil(SWAP_XR),
                    1,
                ),
                160,
            ),
        }
    }

    pub(super) fn kernel(self) -> &'static str {
        match self {
            Path::Tree128 => "arbor_gemm_tree_128x128",
            Path::Split16 => "arbor_gemm_split_16x64",
            Path::Split64 => "arbor_gemm_split_64x64",
            Path::WgTree128 => "arbor_gemm_wg_tree_128x128",
            Path::WgSplit64 => "arbor_gemm_wg_split_64x128",
            Path::WgTma { bn: 128 } => "arbor_gemm_wg_tma_128x128",
            Path::WgTma { bn: 96 } => "arbor_gemm_wg_tma_128x96",
            Path::WgTma { bn: 64 } => "arbor_gemm_wg_tma_128x64",
            Path::WgTma { .. } => "arbor_gemm_wg_tma",
            Path::WgCluster64 => "arbor_gemm_wg_cluster_64x128",
            Path::WgCluster64x2 => "arbor_gemm_wg_cluster2_64x128",
            Path::WgCluster64x2N256 => "arbor_gemm_wg_cluster2_64x256",
            Path::WgWhole { bn: 224 } => "arbor_gemm_wg_whole_64x224",
            Path::WgWhole { bn: 112 } => "arbor_gemm_wg_whole_64x112",
            Path::WgWhole { bn: 64 } => "arbor_gemm_wg_whole_64x64",
            Path::WgWhole { bn: 48 } => "arbor_gemm_wg_whole_64x48",
            Path::WgWhole { bn: 32 } => "arbor_gemm_wg_whole_64x32",
            Path::WgWhole { .. } => "arbor_gemm_wg_whole",
            Path::WgQuad { bn: 96 } => "arbor_gemm_wg_quad_64x96",
            Path::WgQuad { bn: 64 } => "arbor_gemm_wg_quad_64x64",
            Path::WgQuad { .. } => "arbor_gemm_wg_quad",
            Path::WgQuad128 { bn: 128 } => "arbor_gemm_wg_quad_128x128",
            Path::WgQuad128 { bn: 64 } => "arbor_gemm_wg_quad_128x64",
            Path::WgQuad128 { .. } => "arbor_gemm_wg_quad_128",
            Path::WgSwap { tw, spc } => {
                swap_form_of(tw, spc).map_or("arbor_gemm_wg_swap", |f| f.kernel)
            }
        }
    }
}
