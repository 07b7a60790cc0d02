//! Host side of the TMA kernels of `kernels/cuda/gemm_sm90_tma.cu`: the tensor maps that
//! describe X and W as `[rows][n_seg][seg_len]` (so a TMA box never reads past a segment's
//! end: the columns from `seg_len` on come back as zeros, the leaf's zero-fill), and the
//! launch through `cuLaunchKernelEx` (the small-M kernel runs as thread-block clusters of
//! the tile's `n_seg` segment blocks).

use std::ffi::c_void;

use cudarc::driver::sys::{
    self, CUdeviceptr, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchAttributeValue,
    CUlaunchConfig, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill,
    CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::{CudaFunction, CudaStream};

use super::error::GemmError;

/// Columns per TMA box: one 128-byte swizzled row of bf16.
pub const BOX_K: u32 = 64;

/// Most blocks the persistent large-M kernel launches (it also stops at the SM count).
pub const MAX_PERSISTENT_BLOCKS: usize = 256;

/// A `CUtensorMap` as the kernel's `struct TensorMap` (64-byte aligned, 128 bytes).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TensorMapBytes(pub [u64; 16]);

/// `struct TmaParams` of gemm_sm90_tma.cu, passed as one `__grid_constant__` parameter.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TmaParams {
    pub tx: TensorMapBytes,
    pub tw: TensorMapBytes,
    /// The large-M kernel's f32 result for its TMA stores (with `tma_out`; the SiLU·mul
    /// epilogue's `[m, n/2]` values where `outf` is set).
    pub to: TensorMapBytes,
    /// The SiLU·mul epilogue's bf16 `[m, n/2]` values for the TMA stores (with `tma_out`,
    /// where `outh` is set).
    pub toh: TensorMapBytes,
    pub outf: CUdeviceptr,
    pub outh: CUdeviceptr,
    pub m: i32,
    pub n: i32,
    pub seg_len: i32,
    pub n_seg: i32,
    /// 1: W may be loaded before the PDL wait (see `GemmArgs::w_constant`).
    pub w_early: i32,
    /// 1: the SiLU·mul epilogue of alternating gate/up rows (`Epilogue::SiluMulPairs`).
    pub epi: i32,
    /// 1: the large-M kernel's result leaves by TMA store: f32 roots through `to`, or the
    /// SiLU·mul epilogue's values through `to` (f32) and `toh` (bf16).
    pub tma_out: i32,
    /// 1: a consumer warpgroup whose 64 rows all lie at or past `m` runs no wgmma.
    pub skip_idle: i32,
    /// 1 (with `tma_out`): a warpgroup with only some rows below `m` stores by TMA too.
    pub tma_partial: i32,
    /// 1: the large-M kernel's blocks take every row tile of a column before the next
    /// column (`gemm::column_order`).
    pub column_order: i32,
    /// The large-M kernel's tail split ([`tail_tiles`]): each half's subtree roots, `tail`
    /// × 2 warpgroups × 2 halves × 64·bn f32 ([`tail_workspace_len`]).
    pub ws: CUdeviceptr,
    /// `tail` × 2 arrival counters, zero between calls.
    pub cnt: CUdeviceptr,
    /// Tiles done as two halves (0: none).
    pub tail: i32,
}

/// The large-M kernel's tail ([`TmaParams::tail`]) for a grid of `blocks` over `tiles`
/// tiles of `n_seg` segments: the tiles of a last, partial round of the grid where they
/// fill at most half of it (as halves they then fit one round of half the time), else 0.
/// Not where the grid is a single round (no whole round before it) or a tile has one
/// segment.
pub fn tail_tiles(tiles: usize, blocks: usize, n_seg: usize) -> usize {
    if blocks == 0 || tiles <= blocks || n_seg < 2 {
        return 0;
    }
    let r = tiles % blocks;
    if 2 * r <= blocks {
        r
    } else {
        0
    }
}

/// f32 elements of workspace a tail of `tail` tiles of `bn` columns needs.
pub fn tail_workspace_len(tail: usize, bn: usize) -> usize {
    tail * 2 * 2 * 64 * bn
}

/// One operand (`rows` rows of `ld` bf16 starting at `ptr`, columns `[0, n_seg·seg_len)`
/// used) as the 3-D tensor `[rows][n_seg][seg_len]` with boxes of `{64, 1, box_rows}`,
/// 128-byte swizzle (the layout the wgmma descriptors read), out-of-bounds elements zero.
pub fn encode(
    what: &str,
    ptr: CUdeviceptr,
    rows: usize,
    ld: usize,
    seg_len: usize,
    n_seg: usize,
    box_rows: u32,
) -> Result<TensorMapBytes, GemmError> {
    encode_tiled(
        what,
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        ptr,
        &[seg_len as u64, n_seg as u64, rows as u64],
        // Byte strides of dims 1 and 2 (dim 0 is contiguous).
        &[seg_len as u64 * 2, ld as u64 * 2],
        &[BOX_K, 1, box_rows],
        CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
    )
}

/// Rows of the large-M kernel's TMA store box (a consumer warpgroup's rows).
pub const OUT_BOX_ROWS: u32 = 64;

/// The element type of a result the large-M kernel stores by TMA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutElem {
    F32,
    Bf16,
}

impl OutElem {
    fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }

    /// Columns of the store box: one 128-byte swizzled row.
    pub fn box_cols(self) -> u32 {
        (128 / self.bytes()) as u32
    }
}

/// The result `[rows, cols]` of `elem` (row stride `cols`) at `ptr` as the 2-D tensor the
/// large-M kernel's TMA stores write, boxes of [`OUT_BOX_ROWS`] rows × one 128-byte row
/// ([`OutElem::box_cols`]) with the 128-byte swizzle its shared-memory staging uses; TMA
/// clips what falls outside. Needs [`out_map_fits`].
pub fn encode_out(
    ptr: CUdeviceptr,
    rows: usize,
    cols: usize,
    elem: OutElem,
) -> Result<TensorMapBytes, GemmError> {
    let (what, dtype) = match elem {
        OutElem::F32 => (
            "output",
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        ),
        OutElem::Bf16 => (
            "bf16 output",
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        ),
    };
    encode_tiled(
        what,
        dtype,
        ptr,
        &[cols as u64, rows as u64],
        &[(cols * elem.bytes()) as u64],
        &[elem.box_cols(), OUT_BOX_ROWS],
        CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
    )
}

/// `cuTensorMapEncodeTiled` of the tensor at `ptr` with these dims (innermost first), byte
/// strides of dims 1.. and box, unit element strides, 128-byte swizzle, no
/// out-of-bounds fill (zeros), the failure naming `what` and the arguments.
fn encode_tiled(
    what: &str,
    dtype: CUtensorMapDataType,
    ptr: CUdeviceptr,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
    l2: CUtensorMapL2promotion,
) -> Result<TensorMapBytes, GemmError> {
    debug_assert!(strides.len() + 1 == dims.len() && boxes.len() == dims.len());
    let elem = [1u32; 5];
    let mut map = std::mem::MaybeUninit::<CUtensorMap>::uninit();
    // SAFETY: `dims` and `boxes` have the rank the call is told, `strides` one less, `elem`
    // at least that many; `map` is written by the call.
    let res = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            dims.len() as u32,
            ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            l2,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    res.result().map_err(|source| GemmError::Driver {
        what: format!(
            "cuTensorMapEncodeTiled({what}: {ptr:#x}, dims {dims:?}, byte strides {strides:?}, box {boxes:?})"
        ),
        source,
    })?;
    // SAFETY: initialised by the successful call above.
    let map = unsafe { map.assume_init() };
    Ok(TensorMapBytes(map.opaque))
}

/// Whether a result of `elem` at `ptr` with `cols` columns can be a TMA store's tensor
/// (16-byte aligned base and row stride).
pub fn out_map_fits(ptr: CUdeviceptr, cols: usize, elem: OutElem) -> bool {
    ptr.is_multiple_of(16) && (cols * elem.bytes()).is_multiple_of(16)
}

/// Grid, block, dynamic shared memory and cluster width of one launch.
#[derive(Debug, Clone, Copy)]
pub struct LaunchShape {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
    /// Blocks per cluster along x, if the kernel runs as clusters.
    pub cluster_x: Option<u32>,
    /// Launch with programmatic dependent launch (the kernels begin with `pdl_wait`).
    pub pdl: bool,
}

/// How many clusters of `cluster_x` blocks of `f` (with `block` threads and `smem` bytes of
/// shared memory each) the device can run at once.
pub fn max_active_clusters(
    f: &CudaFunction,
    block: u32,
    smem: u32,
    cluster_x: u32,
) -> Result<u32, GemmError> {
    // SAFETY: plain data; only the cluster dimension member is read.
    let mut value: CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.clusterDim.x = cluster_x;
    value.clusterDim.y = 1;
    value.clusterDim.z = 1;
    let mut attrs = [CUlaunchAttribute {
        id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        pad: [0; 4],
        value,
    }];
    let cfg = CUlaunchConfig {
        gridDimX: cluster_x * 1024,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: std::ptr::null_mut(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: 1,
    };
    let mut n = 0i32;
    // SAFETY: `cfg` and `attrs` outlive the call, `n` is written by it.
    unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &cfg) }
        .result()
        .map_err(|source| GemmError::Driver {
            what: format!("cuOccupancyMaxActiveClusters(cluster {cluster_x}, {smem} B shared)"),
            source,
        })?;
    Ok(n.max(0) as u32)
}

/// Launches `f(params)` with `cuLaunchKernelEx` (`params`: the kernel's one parameter
/// struct, `TmaParams` or the grouped kernel's).
///
/// # Safety
/// The tensor maps and output pointers in `params` must point at live allocations of the
/// stream's context that stay alive until the kernel has run.
pub unsafe fn launch<P: Copy>(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    shape: LaunchShape,
    params: &P,
) -> Result<(), GemmError> {
    let LaunchShape {
        grid,
        block,
        smem,
        cluster_x,
        pdl,
    } = shape;
    let driver = |what: String| {
        move |source| GemmError::Driver {
            what: what.clone(),
            source,
        }
    };
    stream
        .context()
        .bind_to_thread()
        .map_err(driver("cuCtxSetCurrent".into()))?;
    // SAFETY: the value is plain data; only the cluster dimension member is read.
    let mut attrs: Vec<CUlaunchAttribute> = Vec::new();
    if let Some(cx) = cluster_x {
        let mut value: CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.clusterDim.x = cx;
        value.clusterDim.y = 1;
        value.clusterDim.z = 1;
        attrs.push(CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            pad: [0; 4],
            value,
        });
    }
    // While the running step wants it (launch.rs, `set_step_pdl`).
    if pdl && crate::cuda::launch::step_pdl() {
        attrs.push(crate::cuda::launch::pdl_attribute());
    }
    let cfg = CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: attrs.len() as u32,
    };
    let mut p = *params;
    let mut args = [&mut p as *mut P as *mut c_void];
    sys::cuLaunchKernelEx(
        &cfg,
        f.cu_function(),
        args.as_mut_ptr(),
        std::ptr::null_mut(),
    )
    .result()
    .map_err(driver(format!(
        "cuLaunchKernelEx({name}, grid {grid:?}, block {block}, {smem} B shared, cluster {cluster_x:?})"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_boxes_are_one_swizzled_row_and_need_aligned_rows() {
        assert_eq!(OutElem::F32.box_cols(), 32);
        assert_eq!(OutElem::Bf16.box_cols(), 64);
        assert!(out_map_fits(0x1000, 4, OutElem::F32));
        assert!(!out_map_fits(0x1000, 6, OutElem::F32));
        assert!(!out_map_fits(0x1008, 8, OutElem::F32));
        // 132 bf16 columns are 264 bytes a row: not a multiple of 16.
        assert!(!out_map_fits(0x1000, 132, OutElem::Bf16));
        assert!(out_map_fits(0x1000, 136, OutElem::Bf16));
    }

    #[test]
    fn params_match_the_c_struct() {
        // struct TmaParams: four 128-byte maps, two pointers, eleven ints, two pointers, an
        // int, padded to 64.
        assert_eq!(std::mem::align_of::<TmaParams>(), 64);
        assert_eq!(std::mem::offset_of!(TmaParams, tw), 128);
        assert_eq!(std::mem::offset_of!(TmaParams, to), 256);
        assert_eq!(std::mem::offset_of!(TmaParams, toh), 384);
        assert_eq!(std::mem::offset_of!(TmaParams, outf), 512);
        assert_eq!(std::mem::offset_of!(TmaParams, m), 528);
        assert_eq!(std::mem::offset_of!(TmaParams, n_seg), 540);
        assert_eq!(std::mem::offset_of!(TmaParams, w_early), 544);
        assert_eq!(std::mem::offset_of!(TmaParams, epi), 548);
        assert_eq!(std::mem::offset_of!(TmaParams, tma_out), 552);
        assert_eq!(std::mem::offset_of!(TmaParams, skip_idle), 556);
        assert_eq!(std::mem::offset_of!(TmaParams, tma_partial), 560);
        assert_eq!(std::mem::offset_of!(TmaParams, column_order), 564);
        assert_eq!(std::mem::offset_of!(TmaParams, ws), 568);
        assert_eq!(std::mem::offset_of!(TmaParams, cnt), 576);
        assert_eq!(std::mem::offset_of!(TmaParams, tail), 584);
        assert_eq!(std::mem::size_of::<TmaParams>(), 640);
    }

    #[test]
    fn the_tail_is_a_last_round_at_most_half_full() {
        // gate/up at 256 rows on 132 SMs: 448 tiles, 3 rounds and 52.
        assert_eq!(tail_tiles(448, 132, 8), 52);
        assert_eq!(tail_tiles(448, 132, 2), 52);
        assert_eq!(tail_tiles(448, 132, 1), 0);
        // 100 of 132 in the last round: as halves, two rounds of half the time.
        assert_eq!(tail_tiles(496, 132, 8), 0);
        assert_eq!(tail_tiles(462, 132, 8), 66);
        assert_eq!(tail_tiles(528, 132, 8), 0);
        // One partial round: no whole round before it.
        assert_eq!(tail_tiles(60, 132, 8), 0);
        assert_eq!(tail_tiles(132, 132, 8), 0);
        assert_eq!(tail_tiles(10, 0, 8), 0);
        assert_eq!(tail_workspace_len(52, 128), 52 * 4 * 64 * 128);
    }
}
