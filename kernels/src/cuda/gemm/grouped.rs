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
use super::{tma, Params, TreeGemm};
use crate::cpu::matmul::TreeMatmul;

/// Which grouped kernel runs a call: the three mma.sync block shapes, and on Hopper the
/// wgmma + TMA kernel for many pairs per expert. The mma.sync shapes give the same bits;
/// the wgmma kernel is the other leaf family, which gave the mma.sync family's bits on
/// every H100 shape measured and is checked against it bit for bit
/// (`gpu_test::grouped_wgmma_gives_the_mma_bits`), so the choice is only about speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupedPath {
    /// 16-row tiles, one block per (64 columns, segment, tile); decode.
    Split16,
    /// 64-row tiles, one block per (64 columns, segment, tile).
    Split64,
    /// 128×128 tiles, the whole tree in the block; prefill.
    Tree128,
    /// sm_90a: gemm_sm90_tma.cu's persistent wgmma + TMA block on 128-row tiles, X as
    /// contiguous pair rows, each expert's W through its own tensor map
    /// ([`expert_maps`]). Needs `k == n_seg·seg_len` and 16-byte rows
    /// ([`GroupedPath::wg_eligible`]).
    WgTma128,
}

impl GroupedPath {
    /// The mma.sync shapes (every sm_80+ device).
    pub const ALL: [GroupedPath; 3] = [Self::Split16, Self::Split64, Self::Tree128];
    /// The sm_90a kernels.
    pub const WGMMA: [GroupedPath; 1] = [Self::WgTma128];

    /// The path for `pairs` pairs over `experts` experts where the wgmma kernel is
    /// available (`wg`): it takes the shapes `tree128` and `split64` would, and any call of
    /// at least [`Self::WG_MIN_PAIRS`] pairs. Its 128-row tiles are mostly empty at a few
    /// rows per expert, but it streams each expert's weights at a rate the mma.sync tiles
    /// do not reach: on an H100, Qwen3-30B-A3B's decode at batch 256 (2048 pairs, 16 per
    /// expert) took 3.94 ms a step with it against 5.43 with `split16`
    /// (docs/results/moe-h100). Smaller decode steps keep the mma.sync tiles.
    pub fn choose(pairs: usize, experts: usize, wg: bool) -> Self {
        match Self::for_pairs(pairs, experts) {
            Self::Tree128 | Self::Split64 if wg => Self::WgTma128,
            _ if wg && pairs >= Self::WG_MIN_PAIRS => Self::WgTma128,
            p => p,
        }
    }

    /// Pairs from which the wgmma kernel runs whatever the rows per expert.
    pub const WG_MIN_PAIRS: usize = 1024;

    /// Parses a path name (`split16`, `split64`, `tree128`, `wgtma128`).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .chain(Self::WGMMA)
            .find(|p| p.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Split16 => "split16",
            Self::Split64 => "split64",
            Self::Tree128 => "tree128",
            Self::WgTma128 => "wgtma128",
        }
    }

    /// Whether the wgmma kernel takes a call of this shape: its TMA views need the
    /// segments to tile K exactly and rows (and segments) of whole 16-byte units.
    pub fn wg_eligible(shape: &TreeMatmul, ldx: usize, ldw: usize) -> bool {
        shape.k == shape.n_seg * shape.seg_len
            && shape.seg_len.is_multiple_of(8)
            && ldx.is_multiple_of(8)
            && ldw.is_multiple_of(8)
    }

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
            Self::Tree128 | Self::WgTma128 => 128,
        }
    }

    fn bn(self) -> usize {
        match self {
            Self::Tree128 | Self::WgTma128 => 128,
            _ => 64,
        }
    }

    fn is_split(self) -> bool {
        !matches!(self, Self::Tree128 | Self::WgTma128)
    }

    /// The dense path with the same block (its shared memory and threads).
    fn dense(self) -> Path {
        match self {
            Self::Split16 => Path::Split16,
            Self::Split64 => Path::Split64,
            Self::Tree128 => Path::Tree128,
            Self::WgTma128 => Path::WgTma { bn: 128 },
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
            (Self::WgTma128, false) => "arbor_moe_gemm_wg_tma_128x128",
            (Self::WgTma128, true) => "arbor_moe_gemm_wg_tma_128x128_silu",
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
        match self {
            _ if self.is_split() => n_seg * pairs * n,
            _ => 0,
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

/// `struct MoeTmaParams` of gemm_moe_sm90.cu, one `__grid_constant__` parameter.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct MoeTmaParams {
    tx: tma::TensorMapBytes,
    tw: CUdeviceptr,
    tile_expert: CUdeviceptr,
    tile_row0: CUdeviceptr,
    tile_end: CUdeviceptr,
    n_tiles: CUdeviceptr,
    outf: CUdeviceptr,
    outh: CUdeviceptr,
    p: i32,
    n: i32,
    seg_len: i32,
    n_seg: i32,
}

/// The tensor maps of the experts' weights for [`GroupedPath::WgTma128`]: expert e's
/// `[n, ldw]` bf16 at `ptrs[e]` as `[n][n_seg][seg_len]`, boxes of 128 rows; 16 words
/// each, in expert order, to upload (64-byte aligned) as the call's `w_maps`.
pub fn expert_maps(
    ptrs: &[CUdeviceptr],
    n: usize,
    ldw: usize,
    seg_len: usize,
    n_seg: usize,
) -> Result<Vec<u64>, GemmError> {
    let mut out = Vec::with_capacity(ptrs.len() * 16);
    for (e, &p) in ptrs.iter().enumerate() {
        let m = tma::encode(
            &format!("expert {e} weight"),
            p,
            n,
            ldw,
            seg_len,
            n_seg,
            128,
        )?;
        out.extend_from_slice(&m.0);
    }
    Ok(out)
}

/// What the wgmma grouped kernel needs besides [`GroupedArgs`] (whose `tiles.w_table` it
/// does not read).
#[derive(Debug, Clone, Copy)]
pub struct GroupedWg {
    /// [`expert_maps`] of the experts' weights, uploaded: `16 · experts` words.
    pub w_maps: CUdeviceptr,
    pub w_maps_len: usize,
    /// With a gather table: room for the gathered X, `[pairs, k]` bf16 (16-byte aligned).
    pub xg: CUdeviceptr,
    pub xg_len: usize,
}

impl TreeGemm {
    /// Whether the wgmma grouped kernels were loaded (sm_90a).
    pub fn has_grouped(&self, path: GroupedPath) -> bool {
        self.grouped.iter().any(|(p, _, _)| *p == path)
    }

    /// Enqueues the grouped GEMM by [`GroupedPath::WgTma128`]: with a gather table, X's
    /// rows copied to `wg.xg` in pair order first; then the persistent wgmma kernel over
    /// the routing's tiles.
    ///
    /// # Safety
    /// As [`TreeGemm::launch_grouped`]; `wg.w_maps` must hold [`expert_maps`] of the
    /// weights `a.tiles.w_table` would name, built for this call's `n`, `ldw`, `seg_len`
    /// and `n_seg`, and the weights must stay alive while the stream runs.
    pub unsafe fn launch_grouped_wg(
        &self,
        stream: &CudaStream,
        a: &GroupedArgs,
        wg: &GroupedWg,
    ) -> Result<(), GemmError> {
        let path = GroupedPath::WgTma128;
        validate_grouped(a, path)?;
        let s = a.shape;
        let bad = |msg: String| Err(GemmError::Shape { shape: s, msg });
        if !GroupedPath::wg_eligible(&s, a.ldx, a.ldw) {
            return bad(format!(
                "{} needs k = n_seg·seg_len, seg_len, ldx and ldw multiples of 8 (ldx {}, ldw {})",
                path.name(),
                a.ldx,
                a.ldw
            ));
        }
        if !wg.w_maps.is_multiple_of(64) || wg.w_maps_len < 16 * a.experts {
            return bad(format!(
                "expert tensor maps at {:#x} ({} words): need 64-byte alignment and {} words",
                wg.w_maps,
                wg.w_maps_len,
                16 * a.experts
            ));
        }
        let gathered = a.tiles.gather != 0;
        if gathered && (!wg.xg.is_multiple_of(16) || wg.xg_len < s.m * s.k) {
            return bad(format!(
                "gathered X at {:#x} of {} values, the pairs need {} (16-byte aligned)",
                wg.xg,
                wg.xg_len,
                s.m * s.k
            ));
        }
        let f = self
            .grouped
            .iter()
            .find(|(p, silu, _)| *p == path && *silu == a.silu)
            .map(|(_, _, f)| f)
            .ok_or_else(|| {
                GemmError::NoGpu(format!(
                    "grouped kernel {} is not loaded ({})",
                    path.kernel(a.silu),
                    self.arch
                ))
            })?;
        if s.m == 0 || s.n == 0 {
            return Ok(());
        }
        if s.m > i32::MAX as usize || s.n > i32::MAX as usize {
            return bad(format!(
                "{} pairs or columns overflow the kernel's ints",
                s.m
            ));
        }
        let (x, ldx) = if gathered {
            let g = &self.gather;
            let total = s.m * (s.k / 8);
            let blocks = total.div_ceil(256);
            if blocks > u32::MAX as usize {
                return bad(format!("{total} gather vectors overflow the grid"));
            }
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let (pairs, k) = (s.m as i32, s.k as i32);
            stream
                .launch_builder(g)
                .arg(&a.x)
                .arg(&a.tiles.gather)
                .arg(&pairs)
                .arg(&k)
                .arg(&wg.xg)
                .launch(cfg)
                .map_err(driver("launch arbor_moe_gather_rows"))?;
            (wg.xg, s.k)
        } else {
            (a.x, a.ldx)
        };
        let (outf, outh) = if a.silu { (0, a.out) } else { (a.out, 0) };
        let p = MoeTmaParams {
            tx: tma::encode("pair rows", x, s.m, ldx, s.seg_len, s.n_seg, 128)?,
            tw: wg.w_maps,
            tile_expert: a.tiles.tile_expert,
            tile_row0: a.tiles.tile_row0,
            tile_end: a.tiles.tile_end,
            n_tiles: a.tiles.n_tiles,
            outf,
            outh,
            p: s.m as i32,
            n: s.n as i32,
            seg_len: s.seg_len as i32,
            n_seg: s.n_seg as i32,
        };
        let blocks = (a.max_tiles.max(1) * s.n.div_ceil(128))
            .min(self.sms)
            .min(tma::MAX_PERSISTENT_BLOCKS);
        tma::launch(
            stream,
            f,
            path.kernel(a.silu),
            tma::LaunchShape {
                grid: (blocks as u32, 1, 1),
                block: 384,
                smem: path.smem_bytes(),
                cluster_x: None,
                pdl: self.pdl,
            },
            &p,
        )
    }

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
        if path == GroupedPath::WgTma128 {
            return Err(GemmError::Shape {
                shape: a.shape,
                msg: "the wgmma grouped kernel needs its tensor maps: launch_grouped_wg".into(),
            });
        }
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
    fn moe_tma_params_match_the_c_struct() {
        assert_eq!(std::mem::offset_of!(MoeTmaParams, tw), 128);
        assert_eq!(std::mem::offset_of!(MoeTmaParams, outh), 176);
        assert_eq!(std::mem::offset_of!(MoeTmaParams, p), 184);
        assert_eq!(std::mem::offset_of!(MoeTmaParams, n_seg), 196);
        assert_eq!(std::mem::size_of::<MoeTmaParams>(), 256);
    }

    #[test]
    fn wgmma_paths_parse_and_need_tma_shapes() {
        for p in GroupedPath::ALL.into_iter().chain(GroupedPath::WGMMA) {
            assert_eq!(GroupedPath::from_name(p.name()), Some(p));
        }
        assert_eq!(GroupedPath::from_name("wgtma"), None);
        let s = |k, seg_len, n_seg| TreeMatmul {
            m: 1,
            n: 128,
            k,
            seg_len,
            n_seg,
        };
        assert!(GroupedPath::wg_eligible(&s(768, 96, 8), 768, 768));
        assert!(GroupedPath::wg_eligible(&s(384, 96, 4), 768, 384));
        assert!(!GroupedPath::wg_eligible(&s(100, 13, 8), 100, 100));
        assert!(!GroupedPath::wg_eligible(&s(80, 10, 8), 80, 80));
    }

    #[test]
    fn the_wgmma_kernel_takes_large_calls_where_it_runs() {
        use GroupedPath as P;
        // Qwen3-30B-A3B decode at batch 1, 64, 256 (top-8 of 128) and prefill.
        assert_eq!(P::choose(8, 128, true), P::Split16);
        assert_eq!(P::choose(512, 128, true), P::Split16);
        assert_eq!(P::choose(2048, 128, true), P::WgTma128);
        assert_eq!(P::choose(8192 * 8, 128, true), P::WgTma128);
        // Mixtral (top-2 of 8) at batch 256: 64 rows per expert.
        assert_eq!(P::choose(512, 8, true), P::WgTma128);
        // Without the sm_90a kernels nothing changes.
        assert_eq!(P::choose(2048, 128, false), P::Split16);
        assert_eq!(P::choose(512, 8, false), P::Split64);
        assert_eq!(P::choose(8192 * 8, 128, false), P::Tree128);
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
