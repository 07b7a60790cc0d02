//! The TP-invariant tensor-core GEMM (`kernels/cuda/gemm_tree.cu`): Y = X·Wᵀ with the
//! reduction over K following the fixed 8-segment tree, the GPU twin of
//! [`crate::cpu::matmul::tree_matmul`] (same [`TreeMatmul`] shape, same shard semantics).
//!
//! The launch paths of one leaf [`Family`] share one leaf (a chain of tensor-core MMAs
//! over a segment's k16 chunks from +0) and one tree, so they give the same bits; the path
//! is picked from M only for speed. The split paths keep segment sums in a scratch
//! workspace and arrival counters in a separate, zero-between-calls buffer, so calls of any
//! shape can share both (docs/gemm.md). Standalone: it compiles its own NVRTC program, so
//! it does not wait on the rest of the CUDA backend.

use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUfunction_attribute_enum};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, DriverError, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{CompileError, CompileOptions};

use super::gemm_tma;
use crate::cpu::matmul::TreeMatmul;
use crate::tree::SEGMENTS;

/// The kernel sources, compiled together as their own NVRTC program: the portable
/// mma.sync kernels (sm_80+) and the Hopper wgmma kernels (compiled only for sm_90a).
pub const SOURCES: &[(&str, &str)] = &[
    ("pdl.cuh", include_str!("../../cuda/pdl.cuh")),
    ("silu.cuh", include_str!("../../cuda/silu.cuh")),
    ("gemm_tree.cu", include_str!("../../cuda/gemm_tree.cu")),
    ("gemm_sm90.cu", include_str!("../../cuda/gemm_sm90.cu")),
    (
        "gemm_sm90_tma.cu",
        include_str!("../../cuda/gemm_sm90_tma.cu"),
    ),
];

/// The program: the sources concatenated, each under a `#line` so messages name the file.
pub fn program() -> String {
    let mut s = String::new();
    for (name, text) in SOURCES {
        s.push_str(&format!("#line 1 \"{name}\"\n{text}\n"));
    }
    s
}

/// Errors of the GEMM; each names the value or library that was wrong.
#[derive(Debug, thiserror::Error)]
pub enum GemmError {
    #[error("no usable GPU: {0}")]
    NoGpu(String),
    #[error("NVRTC compile of gemm_tree.cu for {arch} failed:\n{log}")]
    Compile { arch: String, log: String },
    #[error("CUDA driver call '{what}' failed: {source}")]
    Driver {
        what: String,
        #[source]
        source: DriverError,
    },
    #[error("tree GEMM shape {shape:?}: {msg}")]
    Shape { shape: TreeMatmul, msg: String },
}

fn driver(what: &str) -> impl FnOnce(DriverError) -> GemmError + '_ {
    move |source| GemmError::Driver {
        what: what.to_string(),
        source,
    }
}

/// Checks that libcuda and libnvrtc open before cudarc touches them (its loader panics).
pub fn probe() -> Result<(), GemmError> {
    // SAFETY: only dlopens the library names cudarc itself would use.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GemmError::NoGpu(
            "libcuda.so could not be loaded (no NVIDIA driver on this machine)".into(),
        ));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GemmError::NoGpu(
            "libnvrtc.so is not on the loader path (set LD_LIBRARY_PATH)".into(),
        ));
    }
    let count = std::panic::catch_unwind(CudaContext::device_count)
        .map_err(|_| GemmError::NoGpu("the CUDA driver library is unusable".into()))?
        .map_err(|e| GemmError::NoGpu(format!("cuInit/cuDeviceGetCount failed: {e}")))?;
    if count <= 0 {
        return Err(GemmError::NoGpu("the driver reports no CUDA device".into()));
    }
    Ok(())
}

/// NVRTC target: Hopper gets `sm_90a`; the kernel itself needs sm_80 or newer.
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".into()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Compiles [`SOURCE`] for `arch` and returns the PTX text.
pub fn compile(arch: &str) -> Result<String, GemmError> {
    let opts = CompileOptions {
        fmad: Some(false),
        ftz: Some(false),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("gemm_tree.cu".into()),
        ..Default::default()
    };
    let src = program();
    let res = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(src, opts))
        .map_err(|_| GemmError::NoGpu("libnvrtc is unusable".into()))?;
    let ptx = res.map_err(|e| GemmError::Compile {
        arch: arch.to_string(),
        log: match e {
            CompileError::CompileError { nvrtc, log, .. } => {
                format!("{nvrtc:?}\n{}", log.to_string_lossy())
            }
            other => format!("{other:?}"),
        },
    })?;
    Ok(ptx.to_src())
}

/// Output element type; both are rounded only after the tree's root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutDtype {
    F32,
    Bf16,
}

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

/// The `wgwhole` tile width the default path takes for an M ≤ 64 call on `sms` SMs, if
/// any: where its grid runs in waves that are each at least 3/4 full (whole-K blocks are
/// one per SM, so a partial last wave idles SMs), and only where `bench gemm` found it
/// faster than the cluster kernels (H200, docs/gemm.md run 11): the 224-column tiles below
/// M = 32 (4096 × 28672: 65.9 µs against 69.4 at M = 1), the 112-column ones from M = 32
/// (4096 × 28672 at M = 64: 67.6 against 79.5; 4096 × 14336: 36.9 against 43.6), the
/// 64-column ones above M = 32 (4096 × 7168 at M = 64: 23.2 against 25.2). Narrower N
/// (q/k/v, o, down) stays on the cluster kernels, which split K over more blocks.
pub fn whole_tile(m: usize, n: usize, sms: usize) -> Option<usize> {
    let full_waves = |bn: usize, one_wave: bool| {
        let blocks = n.div_ceil(bn) * m.div_ceil(64);
        fills_waves(blocks, sms) && (!one_wave || blocks <= sms)
    };
    match m {
        0..=31 => full_waves(224, true).then_some(224),
        32 => full_waves(112, false).then_some(112),
        _ => [112, 64].into_iter().find(|&bn| full_waves(bn, false)),
    }
}

/// The `wgquad` tile width the default path takes for a call on `sms` SMs, if any: above
/// M = 32 (below it the cluster kernels were faster at every shape), the widest of
/// [`QUAD_BNS`] whose blocks fill full waves. `bench gemm` on an H200 (docs/gemm.md run 12)
/// at M = 64: 4096 × 4096 16.8 µs against 18.2, 4096 × 6144 21.2 against 22.6, 14336 × 4096
/// 37.2 against 39.6.
pub fn quad_tile(m: usize, n: usize, n_seg: usize, sms: usize) -> Option<usize> {
    if !(33..=64).contains(&m) {
        return None;
    }
    QUAD_BNS
        .into_iter()
        .find(|&bn| fills_waves(n.div_ceil(bn) * n_seg.div_ceil(4), sms))
}

/// The `wgwhole` tile width a row-parallel layer's shard of at most two segments (TP 4
/// and 8: o and down) takes at M ≤ 64. `bench gemm --tp` on an H200 (docs/gemm.md run
/// 13): at TP 4, M = 1, down (14336 × 4096) 18.5 µs against 26.7 for the 64×256 cluster
/// tiles, which make only 16 blocks of its 2 segments; o (4096 × 4096) 9.6 against 12.4;
/// at TP 8 12.3 against 15.8 and 7.2 against 8.8; within 0.5 µs of the best width at
/// every M measured.
pub fn shard_whole_tile(m: usize, n_seg: usize) -> Option<usize> {
    (m <= 64 && n_seg <= 2).then_some(64)
}

/// Whether an M ≤ 32 call takes the 64×256 two-segment cluster tiles: where they make at
/// least 56 blocks. Fewer (a narrow q/k/v at TP 2 to 8, a row-parallel shard of four
/// segments at TP 2) leave most SMs idle, and the 128-column one-segment clusters are
/// faster (H200, docs/gemm.md run 13: TP 4 q/k/v 4096 × 1536 at M = 1 10.9 µs against 12.7,
/// TP 2 down 23.4 against 32.9); at 56 and more (TP 8 gate/up 4096 × 3584, TP 1 o) they
/// are at least as fast.
pub fn wide_cluster_fits(n: usize, n_seg: usize) -> bool {
    n.div_ceil(256) * n_seg.div_ceil(2) >= 56
}

/// Whether a grid of `blocks` blocks, one per SM at a time, runs in waves that are each at
/// least 3/4 full (a partial last wave idles SMs while the slowest blocks finish).
fn fills_waves(blocks: usize, sms: usize) -> bool {
    if blocks == 0 || sms == 0 {
        return false;
    }
    let last = blocks - (blocks - 1) / sms * sms;
    4 * last >= 3 * sms
}

/// The default path of a call on a device of `sms` SMs: [`Path::for_shape`], except that
/// a `wgcluster64` call takes a `wgwhole` kernel where [`shard_whole_tile`] or
/// [`whole_tile`] names one, a `wgquad` kernel where [`quad_tile`] does; otherwise one of
/// M ≤ 32 takes `wgcluster64x2n256` where [`wide_cluster_fits`], and a larger one whose
/// grid has more clusters than the device holds at once (`cluster_capacity`, by
/// log2 n_seg: it would run in two waves, the second nearly empty) takes `wgcluster64x2`,
/// half the blocks. `has`: whether a path was compiled for the device.
pub fn default_path_for(
    shape: &TreeMatmul,
    family: Family,
    sms: usize,
    cluster_capacity: &[u32; 4],
    has: impl Fn(Path) -> bool,
) -> Path {
    let path = Path::for_shape(shape, family);
    if path == Path::WgCluster64 {
        let whole = shard_whole_tile(shape.m, shape.n_seg)
            .or_else(|| whole_tile(shape.m, shape.n, sms))
            .map(|bn| Path::WgWhole { bn });
        let quad = quad_tile(shape.m, shape.n, shape.n_seg, sms).map(|bn| Path::WgQuad { bn });
        if let Some(p) = whole.into_iter().chain(quad).find(|&p| has(p)) {
            return p;
        }
    }
    // Up to M = 32 the 64×256 tiles stream W faster at every TP 1 shape (H200,
    // docs/gemm.md run 8: 4096 × 28672 at M = 1 in 69.6 µs against 87.0, M = 16 73.2
    // against 82.8); at M = 64 the two are even (85.5 / 84.8).
    if path == Path::WgCluster64
        && shape.n_seg >= 2
        && shape.m <= 32
        && wide_cluster_fits(shape.n, shape.n_seg)
    {
        return Path::WgCluster64x2N256;
    }
    if path == Path::WgCluster64 && shape.n_seg >= 2 {
        let cap = cluster_capacity[shape.n_seg.trailing_zeros().min(3) as usize];
        let clusters = shape.n.div_ceil(128) * shape.m.div_ceil(64);
        if clusters > cap as usize {
            return Path::WgCluster64x2;
        }
    }
    path
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
    /// wgmma fed by TMA, warp-specialised and persistent, 128×128 tiles, the whole tree in
    /// the block. Needs `k == n_seg·seg_len`.
    WgTma128,
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
            (Family::Wgmma, _) if tma => Path::WgTma128,
            (Family::Wgmma, 0..=256) => Path::WgSplit64,
            (Family::Wgmma, _) => Path::WgTree128,
        }
    }

    /// Every path of a family (all must agree bitwise).
    pub fn all(family: Family) -> &'static [Path] {
        match family {
            Family::Mma => &[Path::Tree128, Path::Split16, Path::Split64],
            Family::Wgmma => &[
                Path::WgTma128,
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
            | Path::WgTma128
            | Path::WgCluster64
            | Path::WgCluster64x2
            | Path::WgCluster64x2N256
            | Path::WgWhole { .. }
            | Path::WgQuad { .. } => Family::Wgmma,
        }
    }

    /// Whether the path loads through TMA tensor maps (and so needs `k == n_seg·seg_len`).
    pub fn is_tma(self) -> bool {
        matches!(
            self,
            Path::WgTma128
                | Path::WgCluster64
                | Path::WgCluster64x2
                | Path::WgCluster64x2N256
                | Path::WgWhole { .. }
                | Path::WgQuad { .. }
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Path::Tree128 => "tree128",
            Path::Split16 => "split16",
            Path::Split64 => "split64",
            Path::WgTree128 => "wgtree128",
            Path::WgSplit64 => "wgsplit64",
            Path::WgTma128 => "wgtma128",
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
        }
    }

    /// Whether the path keeps segment sums in the workspace (and arrival counters).
    fn is_split(self) -> bool {
        matches!(self, Path::Split16 | Path::Split64 | Path::WgSplit64)
    }

    /// f32 elements of workspace the path needs: the split paths keep each segment sum
    /// (`n_seg·m·n`); `wgtma128` keeps the tree's s6 partials per block (only with all 8
    /// segments); 0 for the others. Need not be initialised.
    pub fn workspace_len(self, m: usize, n: usize, n_seg: usize) -> usize {
        match self {
            _ if self.is_split() => n_seg * m * n,
            Path::WgTma128 if n_seg == SEGMENTS => {
                self.persistent_blocks(m, n, usize::MAX) * gemm_tma::S6_FLOATS_PER_BLOCK
            }
            _ => 0,
        }
    }

    /// Blocks of the persistent kernel: one per tile, at most one per SM and at most
    /// [`gemm_tma::MAX_PERSISTENT_BLOCKS`].
    fn persistent_blocks(self, m: usize, n: usize, sms: usize) -> usize {
        (m.div_ceil(128) * n.div_ceil(128))
            .min(sms)
            .min(gemm_tma::MAX_PERSISTENT_BLOCKS)
    }

    /// u32 arrival counters the path needs: one per output tile for the split paths, 0 for
    /// the tree paths. The counter buffer must be zeroed once when allocated; every call
    /// leaves the counters it used at zero, so one buffer serves calls of any shape (it is
    /// separate from the workspace because the sums' extent changes with the shape).
    pub fn counters_len(self, m: usize, n: usize) -> usize {
        if self.is_split() {
            let ((tiles_n, _, tiles_m), _) = self.launch_dims(m, n, 1);
            tiles_n * tiles_m
        } else {
            0
        }
    }

    /// Dynamic shared memory of the path's kernel; must match the template arguments in
    /// the .cu files: STAGES·(BM+BN)·BK·2 bytes, plus the tree paths' two f32 spill slots
    /// of the tree stack (64 values × 256 threads each), plus 1024 bytes for aligning the
    /// wgmma tiles to the swizzle atom.
    fn smem_bytes(self) -> u32 {
        const SLOTS: u32 = 2 * 64 * 256 * 4;
        match self {
            Path::Tree128 => 3 * (128 + 128) * 64 * 2 + SLOTS,
            Path::Split16 => 6 * (16 + 64) * 64 * 2,
            Path::Split64 => 4 * (64 + 64) * 64 * 2,
            Path::WgTree128 => 3 * (128 + 128) * 64 * 2 + SLOTS + 1024,
            Path::WgSplit64 => 4 * (64 + 128) * 64 * 2 + 1024,
            // gemm_sm90_tma.cu: TMA_STAGES = 5 stages of (128 + 128) x 64 bf16, one f32
            // tree slot (64 values x 256 consumer threads), 2 x 5 mbarriers, alignment.
            Path::WgTma128 => 5 * (128 + 128) * 64 * 2 + 64 * 256 * 4 + 80 + 1024,
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
                let slots = 2 * (bn / 4) * 256 * 4;
                let stage = (64 + bn) * 64 * 2;
                let stages = ((WHOLE_SMEM - slots) / stage).min(8);
                stages * stage + slots + 16 * stages + 1024
            }
        }
    }

    /// (grid, threads per block) for a shape.
    fn launch_dims(self, m: usize, n: usize, n_seg: usize) -> ((usize, usize, usize), u32) {
        match self {
            Path::Tree128 | Path::WgTree128 => ((m.div_ceil(128) * n.div_ceil(128), 1, 1), 256),
            Path::Split16 => ((n.div_ceil(64), n_seg, m.div_ceil(16)), 128),
            Path::Split64 => ((n.div_ceil(64), n_seg, m.div_ceil(64)), 128),
            Path::WgSplit64 => ((n.div_ceil(128), n_seg, m.div_ceil(64)), 128),
            // Persistent: the launch caps the grid at the number of SMs.
            Path::WgTma128 => ((m.div_ceil(128) * n.div_ceil(128), 1, 1), 384),
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
        }
    }

    fn kernel(self) -> &'static str {
        match self {
            Path::Tree128 => "arbor_gemm_tree_128x128",
            Path::Split16 => "arbor_gemm_split_16x64",
            Path::Split64 => "arbor_gemm_split_64x64",
            Path::WgTree128 => "arbor_gemm_wg_tree_128x128",
            Path::WgSplit64 => "arbor_gemm_wg_split_64x128",
            Path::WgTma128 => "arbor_gemm_wg_tma_128x128",
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
        }
    }
}

/// Kernel parameters, laid out as `struct Params` in gemm_tree.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Params {
    x: CUdeviceptr,
    w: CUdeviceptr,
    outf: CUdeviceptr,
    outh: CUdeviceptr,
    ws: CUdeviceptr,
    cnt: CUdeviceptr,
    m: i32,
    n: i32,
    k: i32,
    seg_len: i32,
    n_seg: i32,
    ldx: i32,
    ldw: i32,
}

// SAFETY: plain-old-data with the C layout the kernel expects.
unsafe impl DeviceRepr for Params {}

/// Raw device operands of one call. `x` is [m, ldx] and `w` [n, ldw] bf16 (only columns
/// `[0, shape.k)` are read, so a TP shard of K is a pointer offset plus the full row
/// stride); `out` is [m, n] of `out_dtype`; `ws` has `ws_len` f32 elements (scratch);
/// `counters` has `counters_len` u32 elements, zeroed once at allocation and left at zero
/// by every call (see [`Path::counters_len`]). Neither may be used by two streams at once.
#[derive(Debug, Clone, Copy)]
pub struct GemmArgs {
    pub shape: TreeMatmul,
    pub x: CUdeviceptr,
    pub ldx: usize,
    pub w: CUdeviceptr,
    pub ldw: usize,
    pub out: CUdeviceptr,
    pub out_dtype: OutDtype,
    pub ws: CUdeviceptr,
    pub ws_len: usize,
    pub counters: CUdeviceptr,
    pub counters_len: usize,
    /// W is not written by any kernel that may still run on the stream (model weights,
    /// uploaded operands): under programmatic dependent launch the small-M TMA kernel then
    /// loads its first W tiles before waiting for the previous kernel (launch.rs).
    pub w_constant: bool,
    pub epilogue: Epilogue,
}

/// What a call writes at `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// The roots, `[m, n]` of `out_dtype`.
    Store,
    /// The MLP's gate/up projection with W's rows alternating gate and up (row 2j gate j,
    /// 2j + 1 up j; `n` even): `silu(gate)·up`, `[m, n/2]` f32 at `out` and, where `bf16`
    /// is not 0, rounded to bf16 there too. The bits of the stored roots followed by the
    /// element-wise `silu_mul_pairs` kernel; the TMA paths only ([`Path::is_tma`]).
    SiluMulPairs { bf16: CUdeviceptr },
}

/// Checks a shape against the kernel's requirements (see gemm_tree.cu).
pub fn validate(a: &GemmArgs, path: Path) -> Result<(), GemmError> {
    let s = a.shape;
    let bad = |msg: String| Err(GemmError::Shape { shape: s, msg });
    match path {
        Path::WgWhole { bn } if !WHOLE_BNS.contains(&bn) => {
            return bad(format!(
                "wgwhole has no {bn}-column tile (one of {WHOLE_BNS:?})"
            ));
        }
        Path::WgQuad { bn } if !QUAD_BNS.contains(&bn) => {
            return bad(format!(
                "wgquad has no {bn}-column tile (one of {QUAD_BNS:?})"
            ));
        }
        _ => {}
    }
    if !(s.n_seg.is_power_of_two() && s.n_seg <= SEGMENTS) {
        return bad(format!("n_seg = {} is not 1, 2, 4 or 8", s.n_seg));
    }
    if s.seg_len == 0 || !s.seg_len.is_multiple_of(8) {
        return bad(format!(
            "seg_len = {} must be a positive multiple of 8",
            s.seg_len
        ));
    }
    if !s.k.is_multiple_of(8) || s.k > s.n_seg * s.seg_len {
        return bad(format!(
            "k = {} must be a multiple of 8 and at most n_seg·seg_len = {}",
            s.k,
            s.n_seg * s.seg_len
        ));
    }
    if a.ldx < s.k || a.ldw < s.k || !a.ldx.is_multiple_of(8) || !a.ldw.is_multiple_of(8) {
        return bad(format!(
            "row strides ldx = {}, ldw = {} must be multiples of 8 and at least k",
            a.ldx, a.ldw
        ));
    }
    if !a.x.is_multiple_of(16) || !a.w.is_multiple_of(16) {
        return bad(format!(
            "x ({:#x}) and w ({:#x}) must be 16-byte aligned",
            a.x, a.w
        ));
    }
    if let Epilogue::SiluMulPairs { bf16 } = a.epilogue {
        if !path.is_tma() {
            return bad(format!(
                "path {} has no fused SiLU·mul epilogue (the TMA paths have)",
                path.name()
            ));
        }
        if !s.n.is_multiple_of(2) || a.out_dtype != OutDtype::F32 {
            return bad(format!(
                "the SiLU·mul epilogue needs an even n (gate/up pairs) and f32 output, got n = {} and {:?}",
                s.n, a.out_dtype
            ));
        }
        if !bf16.is_multiple_of(16) {
            return bad(format!("bf16 output {bf16:#x} must be 16-byte aligned"));
        }
    }
    if path.is_tma() && s.k != s.n_seg * s.seg_len {
        return bad(format!(
            "path {} needs k == n_seg·seg_len = {} (full segments), got k = {}",
            path.name(),
            s.n_seg * s.seg_len,
            s.k
        ));
    }
    let limit = i32::MAX as usize;
    if s.m > limit || s.n > limit || s.n_seg * s.seg_len > limit || a.ldx > limit || a.ldw > limit {
        return bad("a dimension exceeds i32".into());
    }
    let need = path.workspace_len(s.m, s.n, s.n_seg);
    if need > 0 && (a.ws == 0 || !a.ws.is_multiple_of(16)) {
        return bad(format!(
            "path {} needs a 16-byte aligned workspace, got {:#x}",
            path.name(),
            a.ws
        ));
    }
    if a.ws_len < need {
        return bad(format!(
            "path {} needs {need} f32 of workspace, got {}",
            path.name(),
            a.ws_len
        ));
    }
    let need = path.counters_len(s.m, s.n);
    if a.counters_len < need {
        return bad(format!(
            "path {} needs {need} u32 tile counters, got {}",
            path.name(),
            a.counters_len
        ));
    }
    if need > 0 && (a.counters == 0 || !a.counters.is_multiple_of(4)) {
        return bad(format!(
            "counters ({:#x}) must be a 4-byte aligned device pointer",
            a.counters
        ));
    }
    Ok(())
}

/// The compiled kernels of one context.
pub struct TreeGemm {
    pub arch: String,
    /// The leaf family this device uses for every default path.
    pub family: Family,
    _module: Arc<CudaModule>,
    kernels: Vec<(Path, CudaFunction)>,
    /// Streaming multiprocessors: the persistent kernel's grid.
    sms: usize,
    /// Clusters of 1, 2, 4 and 8 `wgcluster64` blocks that fit on the device at once
    /// (0 where that path is not compiled).
    cluster_capacity: [u32; 4],
    /// Launch the TMA kernels with programmatic dependent launch (launch.rs); the other
    /// paths have no `pdl_wait` and always launch plainly.
    pdl: bool,
}

impl TreeGemm {
    /// Compiles and loads the kernels for the context's device: the wgmma family on
    /// Hopper (sm_90a), the mma.sync family elsewhere (and on Hopper too, for comparison).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, GemmError> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("cuDeviceGetAttribute(compute capability)"))?;
        if major < 8 {
            return Err(GemmError::NoGpu(format!(
                "compute capability {major}.{minor}: the tree GEMM needs sm_80 or newer"
            )));
        }
        let arch = arch_for(major, minor);
        let family = if arch == "sm_90a" {
            Family::Wgmma
        } else {
            Family::Mma
        };
        let ptx = compile(&arch)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(driver("cuModuleLoadData(gemm_tree)"))?;
        let mut kernels = Vec::new();
        let families: &[Family] = match family {
            Family::Wgmma => &[Family::Wgmma, Family::Mma],
            Family::Mma => &[Family::Mma],
        };
        for fam in families {
            for &path in Path::all(*fam) {
                let name = path.kernel();
                let f = module
                    .load_function(name)
                    .map_err(driver(&format!("cuModuleGetFunction({name})")))?;
                f.set_attribute(
                    CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    path.smem_bytes() as i32,
                )
                .map_err(driver(&format!(
                    "cuFuncSetAttribute({name}, {} bytes of shared memory)",
                    path.smem_bytes()
                )))?;
                kernels.push((path, f));
            }
        }
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("cuDeviceGetAttribute(multiprocessor count)"))?;
        let mut tg = Self {
            arch,
            family,
            _module: module,
            kernels,
            sms: sms.max(1) as usize,
            cluster_capacity: [0; 4],
            pdl: super::launch::pdl_enabled(ctx),
        };
        for (i, n_seg) in [1usize, 2, 4, 8].into_iter().enumerate() {
            tg.cluster_capacity[i] = tg
                .max_active_clusters(Path::WgCluster64, n_seg)?
                .unwrap_or(0);
        }
        Ok(tg)
    }

    /// The path a call of this shape takes by default ([`default_path_for`] on this
    /// device). All give the same bits (same leaf, same tree), so this choice may depend
    /// on the device.
    pub fn default_path(&self, shape: &TreeMatmul) -> Path {
        default_path_for(shape, self.family, self.sms, &self.cluster_capacity, |p| {
            self.has(p)
        })
    }

    /// For the cluster path: how many clusters of `n_seg` blocks fit on the device at once
    /// (what bounds its single-wave grid); `None` for other paths.
    pub fn max_active_clusters(&self, path: Path, n_seg: usize) -> Result<Option<u32>, GemmError> {
        let cluster = match path {
            Path::WgCluster64 => n_seg,
            Path::WgCluster64x2 | Path::WgCluster64x2N256 => n_seg.div_ceil(2),
            _ => return Ok(None),
        };
        let Some((_, f)) = self.kernels.iter().find(|(p, _)| *p == path) else {
            return Ok(None);
        };
        let (_, block) = path.launch_dims(1, 1, n_seg);
        gemm_tma::max_active_clusters(f, block, path.smem_bytes(), cluster as u32).map(Some)
    }

    /// Whether `path` was compiled for this device.
    pub fn has(&self, path: Path) -> bool {
        self.kernels.iter().any(|(p, _)| *p == path)
    }

    /// Enqueues Y = X·Wᵀ (the subtree root over `shape.n_seg` segments) on `stream`,
    /// by `path` (or [`TreeGemm::default_path`]).
    ///
    /// # Safety
    /// The pointers in `a` must be live device allocations of this context with the sizes
    /// [`GemmArgs`] describes, not freed before the stream has run the kernels.
    pub unsafe fn launch(
        &self,
        stream: &CudaStream,
        a: &GemmArgs,
        path: Option<Path>,
    ) -> Result<(), GemmError> {
        let s = a.shape;
        let path = path.unwrap_or_else(|| self.default_path(&s));
        validate(a, path)?;
        let Some((_, f)) = self.kernels.iter().find(|(p, _)| *p == path) else {
            return Err(GemmError::Shape {
                shape: s,
                msg: format!("path {} is not available on {}", path.name(), self.arch),
            });
        };
        if s.m == 0 || s.n == 0 {
            return Ok(());
        }
        let (outf, outh) = match (a.epilogue, a.out_dtype) {
            (Epilogue::SiluMulPairs { bf16 }, _) => (a.out, bf16),
            (Epilogue::Store, OutDtype::F32) => (a.out, 0),
            (Epilogue::Store, OutDtype::Bf16) => (0, a.out),
        };
        if path.is_tma() {
            // One segment cannot be split in two: the one-segment kernel is the same sum.
            if matches!(path, Path::WgCluster64x2 | Path::WgCluster64x2N256) && s.n_seg == 1 {
                return self.launch(stream, a, Some(Path::WgCluster64));
            }
            return self.launch_tma(stream, f, path, a, outf, outh);
        }
        let p = Params {
            x: a.x,
            w: a.w,
            outf,
            outh,
            ws: a.ws,
            cnt: a.counters,
            m: s.m as i32,
            n: s.n as i32,
            k: s.k as i32,
            seg_len: s.seg_len as i32,
            n_seg: s.n_seg as i32,
            ldx: a.ldx as i32,
            ldw: a.ldw as i32,
        };
        let (grid, block) = path.launch_dims(s.m, s.n, s.n_seg);
        if grid.0 > u32::MAX as usize || grid.2 > 65535 {
            return Err(GemmError::Shape {
                shape: s,
                msg: format!("grid {grid:?} is too large for path {}", path.name()),
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
            .launch(cfg)
            .map_err(driver(&format!("launch {}", path.kernel())))?;
        Ok(())
    }

    /// The TMA paths: tensor maps for this call's X and W, then `cuLaunchKernelEx`.
    unsafe fn launch_tma(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        path: Path,
        a: &GemmArgs,
        outf: CUdeviceptr,
        outh: CUdeviceptr,
    ) -> Result<(), GemmError> {
        let s = a.shape;
        let x_rows = if path == Path::WgTma128 { 128 } else { 64 };
        let w_rows = match path {
            Path::WgWhole { bn } | Path::WgQuad { bn } => (bn / 2) as u32,
            _ => 128,
        };
        let p = gemm_tma::TmaParams {
            tx: gemm_tma::encode("x", a.x, s.m, a.ldx, s.seg_len, s.n_seg, x_rows)?,
            tw: gemm_tma::encode("w", a.w, s.n, a.ldw, s.seg_len, s.n_seg, w_rows)?,
            outf,
            outh,
            ws: a.ws,
            m: s.m as i32,
            n: s.n as i32,
            seg_len: s.seg_len as i32,
            n_seg: s.n_seg as i32,
            w_early: i32::from(a.w_constant),
            epi: i32::from(matches!(a.epilogue, Epilogue::SiluMulPairs { .. })),
        };
        let ((gx, gy, gz), block) = path.launch_dims(s.m, s.n, s.n_seg);
        let (gx, cluster) = match path {
            Path::WgTma128 => (path.persistent_blocks(s.m, s.n, self.sms), None),
            Path::WgCluster64x2 | Path::WgCluster64x2N256 => (gx, Some((s.n_seg / 2) as u32)),
            Path::WgWhole { .. } => (gx, None),
            Path::WgQuad { .. } => (gx, Some(s.n_seg.div_ceil(4) as u32)),
            _ => (gx, Some(s.n_seg as u32)),
        };
        if gx > i32::MAX as usize || gy > 65535 {
            return Err(GemmError::Shape {
                shape: s,
                msg: format!("grid ({gx}, {gy}) is too large for path {}", path.name()),
            });
        }
        gemm_tma::launch(
            stream,
            f,
            path.kernel(),
            gemm_tma::LaunchShape {
                grid: (gx as u32, gy as u32, gz as u32),
                block,
                smem: path.smem_bytes(),
                cluster_x: cluster,
                pdl: self.pdl,
            },
            &p,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(shape: TreeMatmul) -> GemmArgs {
        GemmArgs {
            shape,
            x: 0x1000,
            ldx: shape.k,
            w: 0x2000,
            ldw: shape.k,
            out: 0x3000,
            out_dtype: OutDtype::F32,
            ws: 0x4000,
            ws_len: 8 * shape.m * shape.n,
            counters: 0x5000,
            counters_len: 1024,
            w_constant: true,
            epilogue: Epilogue::Store,
        }
    }

    /// The default paths of the llama3-8b layers at TP 1, 2, 4 and 8 on 132 SMs, as
    /// `bench gemm` (and `--tp`) measured them fastest or within noise of it on an H200
    /// (docs/gemm.md runs 8, 11, 12 and 13).
    #[test]
    fn default_paths_of_every_tp_follow_the_measurements() {
        // wgcluster64 capacity (clusters resident) by log2 n_seg, as an H200 reports it.
        let cap = [248, 124, 62, 30];
        let pick = |m: usize, n: usize, n_seg: usize| {
            let shape = TreeMatmul {
                m,
                n,
                k: 512 * n_seg,
                seg_len: 512,
                n_seg,
            };
            default_path_for(&shape, Family::Wgmma, 132, &cap, |_| true).name()
        };
        let cases = [
            // TP 1: q/k/v, o (and down), gate/up at decode batches.
            (1, 6144, 8, "wgcluster64x2n256"),
            (32, 6144, 8, "wgcluster64x2n256"),
            (1, 4096, 8, "wgcluster64x2n256"),
            (64, 4096, 8, "wgquad64"),
            (64, 6144, 8, "wgquad96"),
            (8, 28672, 8, "wgwhole224"),
            (64, 28672, 8, "wgwhole112"),
            // TP 2: q/k/v (3072), o and down (four segments), gate/up (14336).
            (1, 3072, 8, "wgcluster64"),
            (32, 3072, 8, "wgcluster64"),
            (1, 4096, 4, "wgcluster64"),
            (32, 4096, 4, "wgcluster64"),
            (64, 4096, 4, "wgcluster64"),
            (1, 14336, 8, "wgcluster64x2n256"),
            (64, 14336, 8, "wgwhole112"),
            // TP 4: q/k/v (1536), o and down (two segments), gate/up (7168).
            (1, 1536, 8, "wgcluster64"),
            (64, 1536, 8, "wgcluster64"),
            (1, 4096, 2, "wgwhole64"),
            (32, 4096, 2, "wgwhole64"),
            (64, 4096, 2, "wgwhole64"),
            (1, 7168, 8, "wgcluster64x2n256"),
            (64, 7168, 8, "wgwhole64"),
            // TP 8: q/k/v (768), o and down (one segment), gate/up (3584).
            (1, 768, 8, "wgcluster64"),
            (1, 4096, 1, "wgwhole64"),
            (64, 4096, 1, "wgwhole64"),
            (1, 3584, 8, "wgcluster64x2n256"),
            (64, 3584, 8, "wgquad64"),
        ];
        for (m, n, n_seg, want) in cases {
            assert_eq!(
                pick(m, n, n_seg),
                want,
                "M = {m}, N = {n}, {n_seg} segments"
            );
        }
        // A path the device lacks is passed over.
        let shape = TreeMatmul {
            m: 1,
            n: 4096,
            k: 1024,
            seg_len: 512,
            n_seg: 2,
        };
        let no_whole = default_path_for(&shape, Family::Wgmma, 132, &cap, |p| {
            !matches!(p, Path::WgWhole { .. })
        });
        assert_eq!(no_whole, Path::WgCluster64);
    }

    #[test]
    fn whole_tiles_go_where_they_fill_the_waves() {
        // 132 SMs (H100 / H200), the llama3-8b layers at TP 1 / 2 / 4.
        let cases = [
            (1, 28672, Some(224)),
            (16, 28672, Some(224)),
            (32, 28672, Some(112)),
            (64, 28672, Some(112)),
            (1, 14336, None),
            (64, 14336, Some(112)),
            (32, 7168, None),
            (64, 7168, Some(64)),
            (64, 6144, None),
            (64, 4096, None),
            (64, 128256, None),
        ];
        for (m, n, want) in cases {
            assert_eq!(whole_tile(m, n, 132), want, "M = {m}, N = {n}");
        }
        assert_eq!(whole_tile(1, 0, 132), None);
        let quads = [
            (64, 4096, 8, Some(64)),
            (64, 6144, 8, Some(96)),
            (32, 4096, 8, None),
            (1, 6144, 8, None),
            (64, 3072, 8, None),
            (64, 4096, 4, None),
            (64, 128256, 8, None),
        ];
        for (m, n, n_seg, want) in quads {
            assert_eq!(quad_tile(m, n, n_seg, 132), want, "M = {m}, N = {n}");
        }
        let tree_paths = WHOLE_BNS
            .map(|bn| (Path::WgWhole { bn }, "whole", bn))
            .into_iter()
            .chain(QUAD_BNS.map(|bn| (Path::WgQuad { bn }, "quad", bn)));
        for (p, kind, bn) in tree_paths {
            assert!(Path::all(Family::Wgmma).contains(&p) && p.is_tma());
            assert!(
                p.smem_bytes() <= 227 * 1024,
                "{}: {} B",
                p.name(),
                p.smem_bytes()
            );
            assert_eq!(p.kernel(), format!("arbor_gemm_wg_{kind}_64x{bn}"));
            assert_eq!(p.name(), format!("wg{kind}{bn}"));
        }
    }

    #[test]
    fn validation_names_the_bad_value() {
        let good = TreeMatmul {
            m: 4,
            n: 64,
            k: 4096,
            seg_len: 512,
            n_seg: 8,
        };
        assert!(validate(&args(good), Path::Split16).is_ok());
        let shard = TreeMatmul {
            k: 1024,
            n_seg: 2,
            ..good
        };
        assert!(validate(&args(shard), Path::Tree128).is_ok());
        let cases = [
            (TreeMatmul { n_seg: 3, ..good }, "n_seg = 3"),
            (
                TreeMatmul {
                    seg_len: 500,
                    ..good
                },
                "seg_len = 500",
            ),
            (TreeMatmul { k: 4100, ..good }, "k = 4100"),
            (
                TreeMatmul {
                    k: 2048,
                    n_seg: 2,
                    ..good
                },
                "k = 2048",
            ),
        ];
        assert!(validate(&args(good), Path::WgWhole { bn: 224 }).is_ok());
        let e = validate(&args(good), Path::WgWhole { bn: 100 }).unwrap_err();
        assert!(e.to_string().contains("100-column"), "{e}");
        let e = validate(&args(good), Path::WgQuad { bn: 224 }).unwrap_err();
        assert!(e.to_string().contains("224-column"), "{e}");
        for (shape, want) in cases {
            let e = validate(&args(shape), Path::Split16)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
        }
        let mut a = args(good);
        a.ws_len = 10;
        let e = validate(&a, Path::Split64).unwrap_err().to_string();
        assert!(e.contains("workspace"), "{e}");
        let mut c = args(good);
        c.counters_len = 0;
        let e = validate(&c, Path::WgSplit64).unwrap_err().to_string();
        assert!(e.contains("tile counters"), "{e}");
        assert!(
            validate(&c, Path::WgTree128).is_ok(),
            "tree paths need no counters"
        );
        a.ldx = 4000;
        assert!(validate(&a, Path::Tree128).is_err());
    }

    #[test]
    fn params_match_the_c_struct() {
        // struct Params in gemm_tree.cu: six 8-byte pointers, then seven ints, padded to 8.
        assert_eq!(std::mem::size_of::<Params>(), 80);
        assert_eq!(std::mem::offset_of!(Params, ws), 32);
        assert_eq!(std::mem::offset_of!(Params, cnt), 40);
        assert_eq!(std::mem::offset_of!(Params, m), 48);
        assert_eq!(std::mem::offset_of!(Params, ldw), 72);
    }

    #[test]
    fn every_shape_has_a_valid_path_of_its_family() {
        let full = TreeMatmul {
            m: 1,
            n: 64,
            k: 4096,
            seg_len: 512,
            n_seg: 8,
        };
        // k < n_seg·seg_len: a short last segment, which the TMA view cannot describe.
        let short = TreeMatmul { k: 4088, ..full };
        for fam in [Family::Mma, Family::Wgmma] {
            for m in [1usize, 16, 17, 64, 256, 257, 4096] {
                for base in [full, short] {
                    let shape = TreeMatmul { m, ..base };
                    let p = Path::for_shape(&shape, fam);
                    assert_eq!(p.family(), fam);
                    assert!(Path::all(fam).contains(&p));
                    let small = if p.is_tma() { m <= 64 } else { m <= 256 };
                    let split_k = p.is_split()
                        || matches!(
                            p,
                            Path::WgCluster64 | Path::WgCluster64x2 | Path::WgCluster64x2N256
                        );
                    assert_eq!(split_k, small, "m = {m}");
                    assert_eq!(
                        p.is_tma(),
                        fam == Family::Wgmma && base.k == 4096,
                        "{shape:?}"
                    );
                    let mut a = args(shape);
                    a.ws_len = p.workspace_len(m, shape.n, shape.n_seg);
                    a.counters_len = p.counters_len(m, shape.n);
                    assert!(validate(&a, p).is_ok(), "{shape:?} {p:?}");
                }
            }
        }
        let e = validate(&args(TreeMatmul { m: 4096, ..short }), Path::WgTma128)
            .unwrap_err()
            .to_string();
        assert!(e.contains("k == n_seg·seg_len = 4096"), "{e}");
        // s6 partials: one 64 x 256 slice per persistent block, bounded whatever M and N.
        assert_eq!(
            Path::WgTma128.workspace_len(4096, 14336, 8),
            gemm_tma::MAX_PERSISTENT_BLOCKS * 64 * 256
        );
        assert_eq!(Path::WgTma128.workspace_len(200, 200, 8), 4 * 64 * 256);
        assert_eq!(Path::WgTma128.workspace_len(4096, 4096, 4), 0);
        assert_eq!(Path::WgCluster64.counters_len(64, 4096), 0);
    }

    /// The source compiles for Hopper with the local NVRTC, and the tensor-core MMA is in
    /// the PTX; skipped (with the reason printed) where libnvrtc cannot be loaded.
    #[test]
    fn source_compiles_for_sm_90a() {
        // SAFETY: only dlopens libnvrtc.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("skipped: libnvrtc.so is not loadable here (set LD_LIBRARY_PATH)");
            return;
        }
        let ptx = match compile("sm_90a") {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        };
        assert!(ptx.contains(".target sm_90a"), "PTX targets another arch");
        let paths = Path::all(Family::Mma)
            .iter()
            .chain(Path::all(Family::Wgmma));
        for k in paths.map(|p| p.kernel()) {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{k} missing from the PTX"
            );
        }
        assert!(ptx.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"));
        assert!(ptx.contains("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"));
        assert!(ptx.contains("cp.async.bulk.tensor.3d"));
        assert!(ptx.contains("ld.shared::cluster.v4.f32"));
        // The Hopper kernels are left out of a non-Hopper build rather than failing it.
        let ptx80 = compile("sm_80").unwrap_or_else(|e| panic!("{e}"));
        assert!(!ptx80.contains("wgmma"));
        assert!(ptx80.contains(".entry arbor_gemm_tree_128x128("));
    }
}

#[cfg(test)]
#[path = "gemm_gpu_test.rs"]
mod gpu_test;
