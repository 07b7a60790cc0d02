//! The experts' grouped GEMM of a mixture-of-experts layer (`kernels/cuda/gemm_moe.cu`):
//! one launch computes every (token, expert) pair's `X[gather[r]]·W_eᵀ`, the pairs laid
//! out by expert as the device routing left them (`ops::moe`). Its blocks are the mma.sync
//! family's, so every output element is that family's leaf chain and tree: the bits of a
//! pair do not depend on which other pairs the step has.

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};

use super::args::check_tree;
use super::error::{driver, GemmError};
use super::path::Path;
use super::{Params, TreeGemm};
use crate::cpu::matmul::TreeMatmul;

/// Which grouped kernel runs a call: the three mma.sync block shapes. All give the same
/// bits, so the choice (from the pairs per expert) is only about speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupedPath {
    /// 16-row tiles, one block per (64 columns, segment, tile); decode.
    Split16,
    /// 64-row tiles, one block per (64 columns, segment, tile).
    Split64,
    /// 128×128 tiles, the whole tree in the block; prefill.
    Tree128,
}

impl GroupedPath {
    pub const ALL: [GroupedPath; 3] = [Self::Split16, Self::Split64, Self::Tree128];

    /// The path for `pairs` (token, expert) pairs over `experts` experts, by the rows an
    /// expert gets on average.
    pub fn for_pairs(pairs: usize, experts: usize) -> Self {
        let per_expert = pairs / experts.clamp(1, pairs.max(1));
        match per_expert {
            0..=16 => Self::Split16,
            17..=96 => Self::Split64,
            _ => Self::Tree128,
        }
    }

    /// Rows per tile.
    pub fn bm(self) -> usize {
        match self {
            Self::Split16 => 16,
            Self::Split64 => 64,
            Self::Tree128 => 128,
        }
    }

    fn bn(self) -> usize {
        match self {
            Self::Tree128 => 128,
            _ => 64,
        }
    }

    fn is_split(self) -> bool {
        !matches!(self, Self::Tree128)
    }

    /// The dense path with the same block (its shared memory and threads).
    fn dense(self) -> Path {
        match self {
            Self::Split16 => Path::Split16,
            Self::Split64 => Path::Split64,
            Self::Tree128 => Path::Tree128,
        }
    }

    /// The kernel: roots in f32, or (`silu`) the gate/up projection's SiLU·mul in bf16.
    pub fn kernel(self, silu: bool) -> &'static str {
        match (self, silu) {
            (Self::Split16, false) => "arbor_moe_gemm_split_16x64",
            (Self::Split64, false) => "arbor_moe_gemm_split_64x64",
            (Self::Tree128, false) => "arbor_moe_gemm_tree_128x128",
            (Self::Split16, true) => "arbor_moe_gemm_split_16x64_silu",
            (Self::Split64, true) => "arbor_moe_gemm_split_64x64_silu",
            (Self::Tree128, true) => "arbor_moe_gemm_tree_128x128_silu",
        }
    }

    pub(super) fn smem_bytes(self) -> u32 {
        self.dense().smem_bytes()
    }

    /// The most row tiles `pairs` pairs over `experts` experts can need: each expert
    /// that has pairs wastes less than one tile.
    pub fn max_tiles(self, pairs: usize, experts: usize) -> usize {
        let bm = self.bm();
        (pairs + experts.min(pairs) * (bm - 1)).div_ceil(bm)
    }

    /// f32 elements of workspace a call needs (the split paths' segment sums).
    pub fn workspace_len(self, pairs: usize, n: usize, n_seg: usize) -> usize {
        if self.is_split() {
            n_seg * pairs * n
        } else {
            0
        }
    }

    /// Arrival counters a call needs (split paths: one per tile and column tile).
    pub fn counters_len(self, pairs: usize, experts: usize, n: usize) -> usize {
        if self.is_split() {
            self.max_tiles(pairs, experts) * n.div_ceil(self.bn())
        } else {
            0
        }
    }
}

/// Device tables the routing wrote (`ops::moe::MoeRoute`), as `struct MoeTiles` in
/// gemm_moe.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoeTiles {
    pub tile_expert: CUdeviceptr,
    pub tile_row0: CUdeviceptr,
    pub tile_end: CUdeviceptr,
    pub n_tiles: CUdeviceptr,
    /// The X row of each output row (0: output row r reads X row r).
    pub gather: CUdeviceptr,
    /// Each expert's weight, `[n, ldw]` bf16.
    pub w_table: CUdeviceptr,
}

// SAFETY: plain-old-data with the C layout the kernel expects.
unsafe impl DeviceRepr for MoeTiles {}

/// One grouped call: `shape.m` output rows of `n` f32 columns at `out` (with `silu`: of
/// `n / 2` bf16 columns, each silu(gate)·up of a pair of W rows), reducing `k` columns of
/// X (`[.., ldx]` bf16) over `n_seg` segments of `seg_len`.
#[derive(Debug, Clone, Copy)]
pub struct GroupedArgs {
    /// `m` is the number of (token, expert) pairs.
    pub shape: TreeMatmul,
    pub experts: usize,
    pub x: CUdeviceptr,
    pub ldx: usize,
    pub ldw: usize,
    pub out: CUdeviceptr,
    pub silu: bool,
    pub ws: CUdeviceptr,
    pub ws_len: usize,
    pub counters: CUdeviceptr,
    pub counters_len: usize,
    pub tiles: MoeTiles,
    /// The tile tables' length: at least `path.max_tiles(pairs, experts)`.
    pub max_tiles: usize,
}

/// Checks a grouped call against the kernels' requirements (those of the dense GEMM, plus
/// the tables and scratch the path needs).
pub fn validate_grouped(a: &GroupedArgs, path: GroupedPath) -> Result<(), GemmError> {
    let shape = a.shape;
    let bad = |msg: String| Err(GemmError::Shape { shape, msg });
    check_tree(&shape, a.ldx, a.ldw)?;
    for (what, p) in [("x", a.x), ("output", a.out), ("workspace", a.ws)] {
        if !p.is_multiple_of(16) {
            return bad(format!("{what} pointer {p:#x} is not 16-byte aligned"));
        }
    }
    if a.silu && !shape.n.is_multiple_of(2) {
        return bad(format!(
            "the SiLU·mul output pairs W's rows: n = {} must be even",
            shape.n
        ));
    }
    if a.max_tiles < path.max_tiles(shape.m, a.experts) {
        return bad(format!(
            "tile tables of {} entries, the routing may write {}",
            a.max_tiles,
            path.max_tiles(shape.m, a.experts)
        ));
    }
    let (ws, cnt) = (
        path.workspace_len(shape.m, shape.n, shape.n_seg),
        path.counters_len(shape.m, a.experts, shape.n),
    );
    if a.ws_len < ws || a.counters_len < cnt {
        return bad(format!(
            "{} workspace floats and {} counters, the path needs {ws} and {cnt}",
            a.ws_len, a.counters_len
        ));
    }
    Ok(())
}

impl TreeGemm {
    /// Enqueues the grouped GEMM on `stream` by `path`.
    ///
    /// # Safety
    /// Every pointer in `a` must be a live device allocation of this context of the size
    /// `a` states, the tile tables written by the routing of the same `pairs` and `path`,
    /// and each weight in the table `[n, ldw]` bf16; none freed before the stream ran.
    pub unsafe fn launch_grouped(
        &self,
        stream: &CudaStream,
        a: &GroupedArgs,
        path: GroupedPath,
    ) -> Result<(), GemmError> {
        validate_grouped(a, path)?;
        let Some((_, _, f)) = self
            .grouped
            .iter()
            .find(|(p, silu, _)| *p == path && *silu == a.silu)
        else {
            return Err(GemmError::NoGpu(format!(
                "grouped kernel {} is not loaded",
                path.kernel(a.silu)
            )));
        };
        let s = a.shape;
        if s.m == 0 || s.n == 0 {
            return Ok(());
        }
        let (outf, outh) = if a.silu { (0, a.out) } else { (a.out, 0) };
        let p = Params::new(&s, a.x, 0, outf, outh, a.ws, a.counters, a.ldx, a.ldw);
        let tiles = a.max_tiles.max(1);
        let (grid, block) = match path {
            GroupedPath::Tree128 => ((s.n.div_ceil(128), tiles, 1), 256),
            _ => ((s.n.div_ceil(64), s.n_seg, tiles), 128),
        };
        if grid.1 > 65535 || grid.2 > 65535 || s.m > i32::MAX as usize {
            return Err(GemmError::Shape {
                shape: s,
                msg: format!("grid {grid:?} is too large for {}", path.kernel(a.silu)),
            });
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
            block_dim: (block, 1, 1),
            shared_mem_bytes: path.smem_bytes(),
        };
        stream
            .launch_builder(f)
            .arg(&p)
            .arg(&a.tiles)
            .launch(cfg)
            .map_err(driver(&format!("launch {}", path.kernel(a.silu))))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_bound_every_split_of_the_pairs() {
        // Brute force over small cases: the schedule's tile count never exceeds max_tiles.
        for path in GroupedPath::ALL {
            let bm = path.bm();
            for experts in [1usize, 3, 8] {
                for pairs in 0..40usize {
                    // Worst case: as many experts as possible with one row over a tile.
                    let mut worst = 0;
                    for busy in 1..=experts.min(pairs.max(1)) {
                        let each = pairs / busy;
                        let extra = pairs % busy;
                        let t: usize = (0..busy)
                            .map(|i| (each + usize::from(i < extra)).div_ceil(bm))
                            .sum();
                        worst = worst.max(t);
                    }
                    assert!(
                        worst <= path.max_tiles(pairs, experts),
                        "{path:?} {pairs} pairs {experts} experts: {worst} tiles"
                    );
                }
            }
        }
    }

    #[test]
    fn moe_tiles_match_the_c_struct() {
        assert_eq!(std::mem::size_of::<MoeTiles>(), 48);
        assert_eq!(std::mem::offset_of!(MoeTiles, w_table), 40);
    }

    #[test]
    fn paths_follow_rows_per_expert() {
        assert_eq!(GroupedPath::for_pairs(8, 128), GroupedPath::Split16);
        assert_eq!(GroupedPath::for_pairs(512, 128), GroupedPath::Split16);
        assert_eq!(GroupedPath::for_pairs(64 * 128, 128), GroupedPath::Split64);
        assert_eq!(GroupedPath::for_pairs(8192 * 8, 128), GroupedPath::Tree128);
        assert_eq!(GroupedPath::for_pairs(0, 8), GroupedPath::Split16);
    }
}
