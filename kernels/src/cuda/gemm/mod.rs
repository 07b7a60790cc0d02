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

mod args;
mod error;
mod grouped;
mod path;
mod program;
mod select;
mod spread;
mod swap;
mod switch;
pub mod tma;

use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUfunction_attribute_enum};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use crate::cpu::matmul::TreeMatmul;
pub use args::{
    padded_rows, validate, x_rows_to_allocate, x_rows_to_read, Epilogue, GemmArgs, OutDtype,
    PAD_ABOVE_ROWS, X_ROW_BOX,
};
use error::driver;
pub use error::GemmError;
pub use grouped::{expert_maps, validate_grouped, GroupedArgs, GroupedPath, GroupedWg, MoeTiles};
pub use path::{
    Family, Path, SwapForm, QUAD128_BNS, QUAD_BNS, SWAP_FORMS, SWAP_XR, TMA_BNS, WHOLE_BNS,
};
pub use program::{arch_for, compile, probe, program, SOURCES};
pub use select::{
    column_order, column_order_rows, default_path_for, narrow_from, quad128_enabled, quad128_tile,
    quad_tile, shard_whole_tile, skip_idle_enabled, tail_split_enabled, tma_store, tma_tile,
    whole_tile, wide_cluster_fits, ClusterCapacity, Switches, TmaStore, COLUMN_ORDER_ROWS,
    NARROW_BY_DEFAULT, NARROW_ENV, NARROW_FROM_ROWS, QUAD128_BY_DEFAULT, QUAD128_ENV,
    SKIP_IDLE_ENV, TAIL_SPLIT_ENV, TILE_ORDER_ENV, TMA_STORE_ENV,
};
pub use spread::{spread_enabled, spread_path, SPREAD_BY_DEFAULT, SPREAD_ENV, SPREAD_ROWS};
pub use swap::{swap_form, swap_rule, SwapRule, SWAP_BY_DEFAULT, SWAP_ENV};

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

impl Params {
    /// The kernel's view of `s` and the operands (device addresses, 0 for none).
    #[allow(clippy::too_many_arguments)]
    fn new(
        s: &TreeMatmul,
        x: CUdeviceptr,
        w: CUdeviceptr,
        outf: CUdeviceptr,
        outh: CUdeviceptr,
        ws: CUdeviceptr,
        cnt: CUdeviceptr,
        ldx: usize,
        ldw: usize,
    ) -> Self {
        Params {
            x,
            w,
            outf,
            outh,
            ws,
            cnt,
            m: s.m as i32,
            n: s.n as i32,
            k: s.k as i32,
            seg_len: s.seg_len as i32,
            n_seg: s.n_seg as i32,
            ldx: ldx as i32,
            ldw: ldw as i32,
        }
    }
}

/// The compiled kernels of one context.
pub struct TreeGemm {
    pub arch: String,
    /// The leaf family this device uses for every default path.
    pub family: Family,
    _module: Arc<CudaModule>,
    kernels: Vec<(Path, CudaFunction)>,
    /// The experts' grouped kernels (mma.sync, every sm_80+ device).
    grouped: Vec<(GroupedPath, bool, CudaFunction)>,
    /// `arbor_moe_gather_rows`: X's rows in pair order for the wgmma grouped kernel.
    gather: CudaFunction,
    /// Streaming multiprocessors: the persistent kernel's grid.
    sms: usize,
    /// The cluster kernels' clusters that fit on the device at once.
    capacity: ClusterCapacity,
    /// Launch the TMA kernels with programmatic dependent launch (launch.rs); the other
    /// paths have no `pdl_wait` and always launch plainly.
    pdl: bool,
    /// The default path's on/off rules ([`Switches::from_env`]).
    switches: Switches,
    /// How the persistent kernels store their results ([`tma_store`]).
    tma_store: TmaStore,
    /// Whether idle consumer warpgroups skip their wgmma ([`skip_idle_enabled`]).
    skip_idle: bool,
    /// The most rows at which the persistent kernels may take their tiles by column
    /// ([`column_order_rows`]; `None`: never).
    column_order_rows: Option<usize>,
    /// Whether the persistent kernels split a last round at most half full
    /// ([`tail_split_enabled`]).
    tail_split: bool,
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
        let mut grouped = Vec::new();
        let wg_grouped: &[GroupedPath] = match family {
            Family::Wgmma => &GroupedPath::WGMMA,
            Family::Mma => &[],
        };
        for (path, silu) in GroupedPath::ALL
            .into_iter()
            .chain(wg_grouped.iter().copied())
            .flat_map(|p| [(p, false), (p, true)])
        {
            let name = path.kernel(silu);
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
            grouped.push((path, silu, f));
        }
        let gather = module
            .load_function("arbor_moe_gather_rows")
            .map_err(driver("cuModuleGetFunction(arbor_moe_gather_rows)"))?;
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("cuDeviceGetAttribute(multiprocessor count)"))?;
        let mut tg = Self {
            arch,
            family,
            _module: module,
            kernels,
            grouped,
            gather,
            sms: sms.max(1) as usize,
            capacity: ClusterCapacity::default(),
            pdl: super::launch::pdl_enabled(ctx).map_err(|_| GemmError::Env {
                var: super::launch::PDL_ENV,
                value: std::env::var(super::launch::PDL_ENV).unwrap_or_default(),
                msg: "expected 0, 1, auto or below:ROWS",
            })?,
            switches: Switches::from_env()?,
            tma_store: tma_store(std::env::var(TMA_STORE_ENV).ok().as_deref())?,
            skip_idle: skip_idle_enabled(std::env::var(SKIP_IDLE_ENV).ok().as_deref())?,
            column_order_rows: column_order_rows(std::env::var(TILE_ORDER_ENV).ok().as_deref())?,
            tail_split: tail_split_enabled(std::env::var(TAIL_SPLIT_ENV).ok().as_deref())?,
        };
        for (i, n_seg) in [1usize, 2, 4, 8].into_iter().enumerate() {
            tg.capacity.cluster64[i] = tg
                .max_active_clusters(Path::WgCluster64, n_seg)?
                .unwrap_or(0);
        }
        for (i, size) in [1usize, 2, 4, 8].into_iter().enumerate() {
            tg.capacity.swap[i] = tg.swap_clusters(size)?;
        }
        Ok(tg)
    }

    /// The path a call of this shape takes by default ([`default_path_for`] on this
    /// device; `silu`: the call ends in the SiLU·mul epilogue). All give the same bits
    /// (same leaf, same tree), so this choice may depend on the device.
    pub fn default_path(&self, shape: &TreeMatmul, silu: bool) -> Path {
        default_path_for(
            shape,
            self.family,
            self.sms,
            &self.capacity,
            self.switches,
            silu,
            |p| self.has(p),
        )
    }

    /// For the cluster path: how many clusters of `n_seg` blocks fit on the device at once
    /// (what bounds its single-wave grid); `None` for other paths.
    pub fn max_active_clusters(&self, path: Path, n_seg: usize) -> Result<Option<u32>, GemmError> {
        let cluster = match path {
            Path::WgCluster64 => n_seg,
            Path::WgCluster64x2 | Path::WgCluster64x2N256 => n_seg.div_ceil(2),
            Path::WgSwap { spc, .. } => Path::swap_cluster(spc, n_seg),
            _ => return Ok(None),
        };
        let Some((_, f)) = self.kernels.iter().find(|(p, _)| *p == path) else {
            return Ok(None);
        };
        let (_, block) = path.launch_dims(1, 1, n_seg);
        tma::max_active_clusters(f, block, path.smem_bytes(), cluster as u32).map(Some)
    }

    /// How many clusters of `size` swapped-kernel blocks (one an SM, the same shared memory
    /// whatever the form) the device holds at once; 0 where none was compiled. Asked of
    /// the one-segment form, whose cluster is a call's `n_seg` blocks.
    pub fn swap_clusters(&self, size: usize) -> Result<u32, GemmError> {
        let path = Path::WgSwap { tw: 64, spc: 1 };
        Ok(self.max_active_clusters(path, size)?.unwrap_or(0))
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
        let silu = matches!(a.epilogue, Epilogue::SiluMulPairs { .. });
        let path = path.unwrap_or_else(|| self.default_path(&s, silu));
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
        let p = Params::new(&s, a.x, a.w, outf, outh, a.ws, a.counters, a.ldx, a.ldw);
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

    /// The tiles a persistent kernel's call does as half tiles ([`tma::tail_tiles`]): 0
    /// for other paths, with the split off, or where the call brought too little
    /// workspace or too few counters for them.
    fn tail(&self, path: Path, a: &GemmArgs) -> usize {
        let Path::WgTma { bn } = path else {
            return 0;
        };
        if !self.tail_split {
            return 0;
        }
        let s = a.shape;
        let tiles = Path::persistent_tiles(bn, s.m, s.n);
        let blocks = Path::persistent_blocks(bn, s.m, s.n, self.sms);
        let tail = tma::tail_tiles(tiles, blocks, s.n_seg);
        let fits = a.ws != 0
            && a.ws.is_multiple_of(16)
            && a.ws_len >= tma::tail_workspace_len(tail, bn)
            && a.counters != 0
            && a.counters.is_multiple_of(4)
            && a.counters_len >= 2 * tail;
        if fits {
            tail
        } else {
            0
        }
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
        let x_box = match path {
            Path::WgTma { .. } | Path::WgQuad128 { .. } => 128,
            Path::WgSwap { .. } => SWAP_XR as u32,
            _ => 64,
        };
        let w_rows = match path {
            Path::WgWhole { bn } | Path::WgQuad { bn } => (bn / 2) as u32,
            // The W map's box is one 64-row A operand; a block loads tw / 64 of them.
            Path::WgSwap { .. } => 64,
            Path::WgQuad128 { bn } | Path::WgTma { bn } => bn as u32,
            _ => 128,
        };
        // The persistent kernels store plain f32 roots, or the SiLU·mul epilogue's values, by
        // TMA, overlapping the next tile, where their tiles are whole store boxes.
        use tma::OutElem;
        let none = tma::TensorMapBytes([0; 16]);
        let silu = matches!(a.epilogue, Epilogue::SiluMulPairs { .. });
        let tma_out = path.tma_stores(silu)
            && self.tma_store != TmaStore::Off
            && if silu {
                (outf == 0 || tma::out_map_fits(outf, s.n / 2, OutElem::F32))
                    && (outh == 0 || tma::out_map_fits(outh, s.n / 2, OutElem::Bf16))
            } else {
                outh == 0 && tma::out_map_fits(outf, s.n, OutElem::F32)
            };
        let (to, toh) = match (tma_out, silu) {
            (false, _) => (none, none),
            (true, false) => (tma::encode_out(outf, s.m, s.n, OutElem::F32)?, none),
            (true, true) => (
                if outf == 0 {
                    none
                } else {
                    tma::encode_out(outf, s.m, s.n / 2, OutElem::F32)?
                },
                if outh == 0 {
                    none
                } else {
                    tma::encode_out(outh, s.m, s.n / 2, OutElem::Bf16)?
                },
            ),
        };
        let column_order = matches!(path, Path::WgTma { .. })
            && column_order(
                self.column_order_rows,
                s.m,
                s.n.div_ceil(w_rows as usize),
                self.sms,
            );
        let tail = if column_order { 0 } else { self.tail(path, a) };
        let p = tma::TmaParams {
            tx: tma::encode("x", a.x, a.x_rows, a.ldx, s.seg_len, s.n_seg, x_box)?,
            tw: tma::encode("w", a.w, s.n, a.ldw, s.seg_len, s.n_seg, w_rows)?,
            to,
            toh,
            outf,
            outh,
            m: s.m as i32,
            n: s.n as i32,
            seg_len: s.seg_len as i32,
            n_seg: s.n_seg as i32,
            w_early: i32::from(a.w_constant),
            epi: i32::from(silu),
            tma_out: i32::from(tma_out),
            skip_idle: i32::from(self.skip_idle),
            tma_partial: i32::from(self.tma_store == TmaStore::Partial),
            column_order: i32::from(column_order),
            ws: if tail > 0 { a.ws } else { 0 },
            cnt: if tail > 0 { a.counters } else { 0 },
            tail: tail as i32,
        };
        let ((gx, gy, gz), block) = path.launch_dims(s.m, s.n, s.n_seg);
        let (gx, cluster) = match path {
            Path::WgTma { bn } => (Path::persistent_blocks(bn, s.m, s.n, self.sms), None),
            Path::WgSwap { spc, .. } => {
                let ns = Path::swap_cluster(spc, s.n_seg);
                (gx, (ns > 1).then_some(ns as u32))
            }
            Path::WgCluster64x2 | Path::WgCluster64x2N256 => (gx, Some((s.n_seg / 2) as u32)),
            Path::WgWhole { .. } => (gx, None),
            Path::WgQuad { .. } | Path::WgQuad128 { .. } => (gx, Some(s.n_seg.div_ceil(4) as u32)),
            _ => (gx, Some(s.n_seg as u32)),
        };
        if gx > i32::MAX as usize || gy > 65535 {
            return Err(GemmError::Shape {
                shape: s,
                msg: format!("grid ({gx}, {gy}) is too large for path {}", path.name()),
            });
        }
        tma::launch(
            stream,
            f,
            path.kernel(),
            tma::LaunchShape {
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

    #[test]
    fn params_match_the_c_struct() {
        // struct Params in gemm_tree.cu: six 8-byte pointers, then seven ints, padded to 8.
        assert_eq!(std::mem::size_of::<Params>(), 80);
        assert_eq!(std::mem::offset_of!(Params, ws), 32);
        assert_eq!(std::mem::offset_of!(Params, cnt), 40);
        assert_eq!(std::mem::offset_of!(Params, m), 48);
        assert_eq!(std::mem::offset_of!(Params, ldw), 72);
    }
}

#[cfg(test)]
mod gpu_test;
