//! The tensor-core tree GEMM ([`TreeGemm`]) behind the CUDA backend's `matmul`: the
//! default on sm_80+ GPUs, overridden with `ARBOR_GPU_GEMM=auto|tensor|simple` (docs/gemm.md,
//! "Wired into the model").
//!
//! The two kernels' leaves round differently, so a segment must be summed by the same
//! kernel at every TP size and batch size: the choice is made per weight from its global K
//! and the tree's global `seg_len` only ([`tensor_eligible`]), never from M, TP or a
//! rank's shard.

use std::env::VarError;
use std::sync::{Arc, Mutex};

use arbor_kernels::cpu::TreeMatmul;
use arbor_kernels::cuda::gemm::{
    expert_maps, x_rows_to_allocate, x_rows_to_read, Epilogue, GemmArgs, GemmError, GroupedArgs,
    GroupedPath, GroupedWg, OutDtype, TreeGemm, PAD_ABOVE_ROWS,
};
use arbor_kernels::cuda::ops::moe::MoeRoute;
use arbor_kernels::cuda::{CudaError, DevBf16, DevBuf, DevF32, DevU32, GpuDevice};
use arbor_kernels::SegmentLayout;
use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::backend::TreeSpec;

/// The environment variable that picks the GEMM kernel.
pub const ENV: &str = "ARBOR_GPU_GEMM";

/// Which kernel the CUDA backend's linear layers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmKind {
    /// `GpuDevice::tree_matmul` (one warp per output) for every layer.
    Simple,
    /// [`TreeGemm`] for every layer it accepts ([`tensor_eligible`]), the simple kernel
    /// for the others; an error on a GPU older than sm_80.
    Tensor,
    /// The default: `Tensor` on sm_80 and newer, `Simple` on older GPUs. The choice
    /// depends on the device only, so every rank of a job (and the TP=1 shadow) makes it
    /// the same way.
    Auto,
}

impl GemmKind {
    /// The value of [`ENV`]: unset means `auto`; anything but `auto`/`tensor`/`simple` is
    /// an error.
    pub fn parse(var: Option<&str>) -> Result<Self, String> {
        match var {
            None | Some("auto") => Ok(Self::Auto),
            Some("simple") => Ok(Self::Simple),
            Some("tensor") => Ok(Self::Tensor),
            Some(other) => Err(format!(
                "{ENV}={other:?} is not a GEMM kernel: expected \"auto\" (the default), \"tensor\" or \"simple\""
            )),
        }
    }

    /// The kernel `self` means on a GPU of compute capability `major`.x.
    pub fn resolve(self, major: i32) -> Self {
        match self {
            Self::Auto if major >= 8 => Self::Tensor,
            Self::Auto => Self::Simple,
            k => k,
        }
    }

    pub fn from_env() -> Result<Self, String> {
        match std::env::var(ENV) {
            Ok(v) => Self::parse(Some(&v)),
            Err(VarError::NotPresent) => Self::parse(None),
            Err(VarError::NotUnicode(v)) => Err(format!("{ENV}={v:?} is not valid UTF-8")),
        }
    }
}

/// The variable that says how the GEMMs use the rows past M of their bf16 X buffers.
pub const PAD_ENV: &str = "ARBOR_GEMM_PAD_ROWS";

/// How the rows past M of the model's bf16 X buffers are used (`ARBOR_GEMM_PAD_ROWS`).
/// The same bits every way: rows past M are never stored, and each output row depends
/// only on its own row of X.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PadRows {
    /// Unset, `auto` or `read`: above [`PAD_ABOVE_ROWS`] (64) rows every buffer holds
    /// whole 128-row boxes and the GEMMs read all of them (`x_rows_to_read`);
    /// `above:ROWS`: above another number of rows.
    Read { above: usize },
    /// `exact`: M rows are read; the TMA unit fills the last tile's boxes.
    Exact,
    /// `zero`: as `read`, each buffer's padded rows zeroed first (a memset each): slower at
    /// 160–224 rows (gemm-log runs 24 and 25).
    Zero,
}

impl PadRows {
    pub const DEFAULT: PadRows = PadRows::Read {
        above: PAD_ABOVE_ROWS,
    };

    pub fn parse(var: Option<&str>) -> Result<Self, String> {
        match var.map(str::trim) {
            None | Some("auto") | Some("read") => Ok(Self::DEFAULT),
            Some("exact") => Ok(Self::Exact),
            Some("zero") => Ok(Self::Zero),
            Some(other) => match other.strip_prefix("above:").map(|r| r.trim().parse()) {
                Some(Ok(above)) => Ok(Self::Read { above }),
                _ => Err(format!(
                    "{PAD_ENV}={other:?}: expected \"auto\" or \"read\" (the default: whole boxes above {PAD_ABOVE_ROWS} rows), \"above:ROWS\", \"exact\" or \"zero\""
                )),
            },
        }
    }

    /// The value the environment names, read once.
    pub fn from_env() -> Result<Self, String> {
        static P: std::sync::OnceLock<Result<PadRows, String>> = std::sync::OnceLock::new();
        P.get_or_init(|| Self::parse(std::env::var(PAD_ENV).ok().as_deref()))
            .clone()
    }

    fn above(self) -> usize {
        match self {
            Self::Read { above } => above,
            Self::Exact | Self::Zero => PAD_ABOVE_ROWS,
        }
    }

    /// Rows to allocate for a bf16 X buffer of `m` rows.
    pub fn rows_to_allocate(self, m: usize) -> usize {
        x_rows_to_allocate(m, self.above())
    }

    /// Rows of a bf16 X buffer of `available` rows that a call of `m` rows reads.
    pub fn x_rows(self, m: usize, available: usize) -> usize {
        match self {
            Self::Exact => m,
            _ => x_rows_to_read(m, available, self.above()),
        }
    }
}

/// Whether a layer takes the tensor kernel. A function of the weight's global K and the
/// global `seg_len` only: K and `seg_len` multiples of 8 make every segment boundary, hence
/// every rank's K shard and row stride at every TP, a multiple of 8 (what the kernel needs);
/// with `seg_len = ceil(K/8)` this means K is a multiple of 64 and every shard is full.
pub fn tensor_eligible(tree: TreeSpec) -> bool {
    tree.k > 0 && tree.k.is_multiple_of(8) && tree.seg_len > 0 && tree.seg_len.is_multiple_of(8)
}

#[derive(Debug, thiserror::Error)]
pub enum TensorGemmError {
    #[error(transparent)]
    Gemm(#[from] GemmError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("tensor GEMM: {0}")]
    Shape(String),
}

/// Reusable device buffers of one backend (one stream): the bf16 copy of X, the split
/// paths' segment sums and their tile counters. Each grows when a call needs more.
#[derive(Default)]
struct Scratch {
    xb: Option<DevBf16>,
    ws: Option<DevF32>,
    /// Zero when allocated; every call leaves the counters it used at zero.
    counters: Option<DevU32>,
    /// Outgrown buffers, held and never read: a recorded decode step (graphs.rs) may
    /// still point at one, so they live as long as the scratch.
    retired: Vec<Box<dyn std::any::Any + Send>>,
}

/// The split paths' segment sums and tile counters (a [`Scratch`]'s `ws` and
/// `counters`), grown to at least `ws_len` and `counters_len` elements, outgrown buffers
/// to `retired`.
fn split_buffers<'s>(
    ws: &'s mut Option<DevF32>,
    counters: &'s mut Option<DevU32>,
    retired: &mut Vec<Box<dyn std::any::Any + Send>>,
    dev: &GpuDevice,
    ws_len: usize,
    counters_len: usize,
) -> Result<(&'s mut DevF32, &'s mut DevU32), CudaError> {
    let ws = grown(
        ws,
        &mut |o: DevF32| retired.push(Box::new(o)),
        |b| b.len(),
        ws_len,
        |l| dev.zeros_f32(l),
    )?;
    let cnt = grown(
        counters,
        &mut |o: DevU32| retired.push(Box::new(o)),
        |b| b.len(),
        counters_len,
        |l| dev.upload_u32(&vec![0u32; l]),
    )?;
    Ok((ws, cnt))
}

/// `buf`, reallocated (zeroed) to `need` elements when it holds fewer; the outgrown
/// buffer goes to `retire`.
fn grown<'b, T>(
    buf: &'b mut Option<T>,
    retire: &mut impl FnMut(T),
    len: impl Fn(&T) -> usize,
    need: usize,
    alloc: impl FnOnce(usize) -> Result<T, CudaError>,
) -> Result<&'b mut T, CudaError> {
    let b = match buf.take() {
        Some(b) if len(&b) >= need => b,
        old => {
            let b = alloc(need.max(1))?;
            if let Some(o) = old {
                retire(o);
            }
            b
        }
    };
    Ok(buf.insert(b))
}

/// What [`TensorGemm::matmul`] writes.
pub enum GemmOut<'a> {
    /// The roots, `[m, n]` f32.
    Roots,
    /// The gate/up projection whose weight rows alternate gate and up: `silu(gate)·up`,
    /// `[m, n/2]` f32, computed in the GEMM's epilogue, and its bf16 rounding into the
    /// buffer given.
    SiluMulPairs(Option<&'a mut DevBf16>),
}

/// The compiled tensor-core kernels and this backend's scratch buffers.
pub struct TensorGemm {
    kernels: Arc<TreeGemm>,
    scratch: Mutex<Scratch>,
}

impl TensorGemm {
    /// Whether the grouped `path` was loaded for this device (the wgmma one: sm_90a).
    pub fn has_grouped(&self, path: GroupedPath) -> bool {
        self.kernels.has_grouped(path)
    }

    /// The experts' weight tensor maps for the wgmma grouped kernel (`[n, k]` bf16 each,
    /// this rank's shard, reduced as `tree`), on the device; `None` where that kernel is
    /// not loaded or cannot take the shape (the mma.sync grouped kernel then runs).
    pub fn expert_maps(
        &self,
        dev: &GpuDevice,
        table: &[u64],
        n: usize,
        k: usize,
        tree: TreeSpec,
    ) -> Result<Option<DevBuf<u64>>, TensorGemmError> {
        let shape = TreeMatmul {
            m: 1,
            n,
            k,
            seg_len: tree.seg_len,
            n_seg: tree.n_seg,
        };
        if !self.kernels.has_grouped(GroupedPath::WgTma128)
            || !GroupedPath::wg_eligible(&shape, k, k)
        {
            return Ok(None);
        }
        let maps = expert_maps(table, n, k, tree.seg_len, tree.n_seg)?;
        Ok(Some(dev.upload("expert weight tensor maps", &maps)?))
    }

    /// NVRTC-compiles the GEMM for `dev`'s architecture (wgmma on Hopper, mma.sync on
    /// other sm_80+ GPUs).
    pub fn new(dev: &GpuDevice) -> Result<Self, GemmError> {
        let kernels = TreeGemm::new(&dev.ctx)?;
        tracing::info!(arch = %kernels.arch, family = ?kernels.family, "tensor-core tree GEMM ready");
        Ok(Self {
            kernels: Arc::new(kernels),
            scratch: Mutex::new(Scratch::default()),
        })
    }

    /// The same compiled kernels with scratch buffers of its own (for another backend on
    /// the same device, e.g. the TP=1 shadow).
    pub fn sibling(&self) -> Self {
        Self {
            kernels: self.kernels.clone(),
            scratch: Mutex::new(Scratch::default()),
        }
    }

    /// bf16(x) `[m, k]` · wᵀ (`w`: `[n, k]` bf16, this rank's K shard), the subtree root
    /// over `tree.n_seg` segments, on `dev`'s stream by the device family's default path
    /// for `m`, written as `out` says. `xb`: bf16(x) when the producer of x wrote it (then
    /// no conversion pass runs). `None` only for [`GemmOut::SiluMulPairs`] on a path
    /// without that epilogue (then nothing ran).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        dev: &GpuDevice,
        x: &DevF32,
        xb: Option<&DevBf16>,
        m: usize,
        k: usize,
        w: &DevBf16,
        n: usize,
        tree: TreeSpec,
        out: GemmOut<'_>,
    ) -> Result<Option<DevF32>, TensorGemmError> {
        self.matmul_into(dev, x, xb, m, k, w, n, tree, out, None)
    }

    /// [`TensorGemm::matmul`] written into `dst` when given (`[m, n]`, or `[m, n/2]` for
    /// [`GemmOut::SiluMulPairs`]): memory the caller lends, e.g. a torch tensor's. The
    /// bits are `matmul`'s; `Ok(None)` as there (nothing ran).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_into(
        &self,
        dev: &GpuDevice,
        x: &DevF32,
        xb: Option<&DevBf16>,
        m: usize,
        k: usize,
        w: &DevBf16,
        n: usize,
        tree: TreeSpec,
        mut out: GemmOut<'_>,
        dst: Option<DevF32>,
    ) -> Result<Option<DevF32>, TensorGemmError> {
        let layout = SegmentLayout::new(tree.k);
        if !tensor_eligible(tree) || layout.seg_len != tree.seg_len {
            return Err(TensorGemmError::Shape(format!(
                "layer with global K = {} and seg_len = {} is not one the tensor kernel takes \
                 (both must be multiples of 8, seg_len = ceil(K/8) = {})",
                tree.k, tree.seg_len, layout.seg_len
            )));
        }
        if x.len() != m * k || w.len() != n * k || xb.is_some_and(|b| b.len() < m * k) {
            return Err(TensorGemmError::Shape(format!(
                "x has {} values for [{m}, {k}] (its bf16 copy {:?}), w has {} for [{n}, {k}]",
                x.len(),
                xb.map(|b| b.len()),
                w.len()
            )));
        }
        let shape = TreeMatmul {
            m,
            n,
            k,
            seg_len: tree.seg_len,
            n_seg: tree.n_seg,
        };
        let path = self
            .kernels
            .default_path(&shape, matches!(out, GemmOut::SiluMulPairs(_)));
        let out_cols = match &out {
            GemmOut::Roots => n,
            GemmOut::SiluMulPairs(_) if !path.is_tma() => return Ok(None),
            GemmOut::SiluMulPairs(outb) => {
                if !n.is_multiple_of(2) || outb.as_ref().is_some_and(|b| b.len() < m * n / 2) {
                    return Err(TensorGemmError::Shape(format!(
                        "SiLU·mul epilogue: n = {n} must be even and the bf16 output hold at least {m}×{}",
                        n / 2
                    )));
                }
                n / 2
            }
        };
        let mut y = match dst {
            None => dev.empty_f32(m * out_cols)?,
            Some(d) if d.len() == m * out_cols => d,
            Some(d) => {
                return Err(TensorGemmError::Shape(format!(
                    "the output given has {} values for [{m}, {out_cols}]",
                    d.len()
                )))
            }
        };
        if m == 0 || n == 0 {
            return Ok(Some(y));
        }
        let pad = PadRows::from_env().map_err(TensorGemmError::Shape)?;
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Scratch {
            xb: scratch_xb,
            ws,
            counters,
            retired,
        } = &mut *guard;
        let xb: &DevBf16 = match xb {
            Some(b) => b,
            None => {
                let mut retire = |o: DevBf16| retired.push(Box::new(o));
                let b = grown(
                    scratch_xb,
                    &mut retire,
                    |b| b.len(),
                    pad.rows_to_allocate(m) * k,
                    |l| dev.zeros_bf16(l),
                )?;
                dev.f32_to_bf16_into(x, b)?;
                b
            }
        };
        let (ws, cnt) = split_buffers(
            ws,
            counters,
            retired,
            dev,
            path.workspace_len(m, n, tree.n_seg),
            path.counters_len(m, n),
        )?;
        let (ws_len, counters_len) = (ws.len(), cnt.len());
        let stream = &dev.stream;
        {
            let (xp, _rx) = xb.device_ptr(stream);
            let (wp, _rw) = w.device_ptr(stream);
            let (wsp, _rws) = ws.device_ptr_mut(stream);
            let (cp, _rc) = cnt.device_ptr_mut(stream);
            let (op, _ro) = y.device_ptr_mut(stream);
            let (epilogue, _rb) = match &mut out {
                GemmOut::Roots => (Epilogue::Store, None),
                GemmOut::SiluMulPairs(None) => (Epilogue::SiluMulPairs { bf16: 0 }, None),
                GemmOut::SiluMulPairs(Some(b)) => {
                    let (bp, rb) = b.device_ptr_mut(stream);
                    (Epilogue::SiluMulPairs { bf16: bp }, Some(rb))
                }
            };
            let bp = match epilogue {
                Epilogue::SiluMulPairs { bf16 } => bf16,
                Epilogue::Store => 0,
            };
            for (name, p) in [
                ("bf16 X", xp),
                ("weight", wp),
                ("output", op),
                ("bf16 output", bp),
                ("workspace", wsp),
                ("tile counters", cp),
            ] {
                if !p.is_multiple_of(16) {
                    return Err(TensorGemmError::Shape(format!(
                        "{name} pointer {p:#x} is not 16-byte aligned (shape {shape:?})"
                    )));
                }
            }
            let a = GemmArgs {
                shape,
                x: xp,
                ldx: k,
                // Above 64 rows the bf16 X buffers hold whole TMA boxes (`PadRows`).
                x_rows: pad.x_rows(m, xb.len() / k),
                w: wp,
                ldw: k,
                out: op,
                out_dtype: OutDtype::F32,
                ws: wsp,
                ws_len,
                counters: cp,
                counters_len,
                // The model's weights: uploaded once, never written by a kernel.
                w_constant: true,
                epilogue,
            };
            // SAFETY: every pointer is a live allocation on `stream` of the size `a` states
            // (checked above and by `launch`'s validation); the scratch buffers stay
            // allocated until a later call replaces them, and that free is stream-ordered.
            unsafe { self.kernels.launch(stream, &a, Some(path)) }?;
        }
        Ok(Some(y))
    }

    /// The experts' grouped GEMM over `route`'s pairs: `[pairs, n]` f32, row r the subtree
    /// root of `xb`'s row (its token's when `gather`, else row r: `xb` is `[pairs, k]`)
    /// times the weight of r's expert in `w_table` (`[n, k]` bf16 each, this rank's K
    /// shard), by the path the route was laid out for.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_matmul(
        &self,
        dev: &GpuDevice,
        xb: &DevBf16,
        k: usize,
        route: &MoeRoute,
        gather: bool,
        w_table: &DevBuf<u64>,
        w_maps: Option<&DevBuf<u64>>,
        n: usize,
        tree: TreeSpec,
    ) -> Result<DevF32, TensorGemmError> {
        let mut y = dev.empty_f32(route.pairs() * n)?;
        let w = (w_table, w_maps);
        self.grouped_into(dev, xb, k, route, gather, w, n, tree, &mut y, false)?;
        Ok(y)
    }

    /// [`TensorGemm::grouped_matmul`] of a gate/up projection (each expert's rows
    /// alternate gate and up), written as silu(gate)·up rounded to bf16, `[pairs, n / 2]`:
    /// the bits of the roots followed by `silu_mul_pairs`'s bf16 output, without the f32
    /// roots or products ever reaching memory.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_matmul_silu(
        &self,
        dev: &GpuDevice,
        xb: &DevBf16,
        k: usize,
        route: &MoeRoute,
        w_table: &DevBuf<u64>,
        w_maps: Option<&DevBuf<u64>>,
        n: usize,
        tree: TreeSpec,
    ) -> Result<DevBf16, TensorGemmError> {
        let mut y = dev.empty_bf16(route.pairs() * (n / 2))?;
        let w = (w_table, w_maps);
        self.grouped_into(dev, xb, k, route, true, w, n, tree, &mut y, true)?;
        Ok(y)
    }

    #[allow(clippy::too_many_arguments)]
    fn grouped_into<T>(
        &self,
        dev: &GpuDevice,
        xb: &DevBf16,
        k: usize,
        route: &MoeRoute,
        gather: bool,
        (w_table, w_maps): (&DevBuf<u64>, Option<&DevBuf<u64>>),
        n: usize,
        tree: TreeSpec,
        y: &mut DevBuf<T>,
        silu: bool,
    ) -> Result<(), TensorGemmError> {
        let pairs = route.pairs();
        let x_rows = if gather { route.rows } else { pairs };
        if xb.len() < x_rows * k || w_table.len() != route.experts {
            return Err(TensorGemmError::Shape(format!(
                "grouped GEMM: x has {} values for [{x_rows}, {k}], {} expert weights for {} experts",
                xb.len(),
                w_table.len(),
                route.experts
            )));
        }
        let path = route.path;
        let out_len = if silu { pairs * (n / 2) } else { pairs * n };
        if y.len() != out_len || (silu && !n.is_multiple_of(2)) {
            return Err(TensorGemmError::Shape(format!(
                "grouped GEMM: output of {} values for {pairs} pairs of {n} columns{}",
                y.len(),
                if silu {
                    " (SiLU·mul: n/2 each, n even)"
                } else {
                    ""
                }
            )));
        }
        if pairs == 0 || n == 0 {
            return Ok(());
        }
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Scratch {
            ws,
            counters,
            retired,
            ..
        } = &mut *guard;
        let (ws, cnt) = split_buffers(
            ws,
            counters,
            retired,
            dev,
            path.workspace_len(pairs, n, tree.n_seg),
            path.counters_len(pairs, route.experts, n),
        )?;
        let stream = &dev.stream;
        let (ws_len, counters_len) = (ws.len(), cnt.len());
        let (xp, _rx) = xb.device_ptr(stream);
        let (tp, _rt) = w_table.device_ptr(stream);
        let (wsp, _rws) = ws.device_ptr_mut(stream);
        let (cp, _rc) = cnt.device_ptr_mut(stream);
        let (op, _ro) = y.device_ptr_mut(stream);
        let a = GroupedArgs {
            shape: TreeMatmul {
                m: pairs,
                n,
                k,
                seg_len: tree.seg_len,
                n_seg: tree.n_seg,
            },
            experts: route.experts,
            x: xp,
            ldx: k,
            ldw: k,
            out: op,
            silu,
            ws: wsp,
            ws_len,
            counters: cp,
            counters_len,
            tiles: route.tiles(stream, gather, tp),
            max_tiles: route.max_tiles,
        };
        if path == GroupedPath::WgTma128 {
            let Some(maps) = w_maps else {
                return Err(TensorGemmError::Shape(format!(
                    "grouped GEMM by {}: the experts' tensor maps were not built (shape {:?})",
                    path.name(),
                    a.shape
                )));
            };
            // X's rows in pair order; freed stream-ordered after the kernel has read them.
            let mut xg = if gather {
                Some(dev.empty_bf16(pairs * k)?)
            } else {
                None
            };
            let (mp, _rm) = maps.device_ptr(stream);
            let (xgp, xg_len, _rg) = match xg.as_mut() {
                Some(b) => {
                    let len = b.len();
                    let (p, r) = b.device_ptr_mut(stream);
                    (p, len, Some(r))
                }
                None => (0, 0, None),
            };
            let wg = GroupedWg {
                w_maps: mp,
                w_maps_len: maps.len(),
                xg: xgp,
                xg_len,
            };
            // SAFETY: as below; the maps were built from this table's weights for this n,
            // k and tree (`expert_maps`), and the gathered X holds pairs·k values.
            unsafe { self.kernels.launch_grouped_wg(stream, &a, &wg) }?;
            return Ok(());
        }
        // SAFETY: x, the output and the scratch are live allocations on `stream` of the
        // sizes `a` states (checked above and by `launch_grouped`'s validation); the
        // tables are the route's, written on this stream for these pairs and this path;
        // every weight in the table is an expert's [n, k] bf16, owned by the model.
        unsafe { self.kernels.launch_grouped(stream, &a, path) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_kernels::cuda::gemm::{validate, Family, Path};
    use arbor_kernels::SEGMENTS;

    /// The TreeSpec each layer kind builds on `rank` of `tp` (see layers/{row,column}.rs),
    /// with this rank's K shard.
    fn specs(k: usize, rank: usize, tp: usize) -> [(TreeSpec, usize); 2] {
        let l = SegmentLayout::new(k);
        let column = TreeSpec {
            seg_len: l.seg_len,
            n_seg: SEGMENTS,
            k,
        };
        let row = TreeSpec {
            seg_len: l.seg_len,
            n_seg: SEGMENTS / tp,
            k,
        };
        [(column, k), (row, l.shard(rank, tp).len())]
    }

    #[test]
    fn selection_is_the_same_at_every_tp_and_rank_and_the_kernel_accepts_every_m() {
        let ks = (1..=700).chain([3584, 4090, 4096, 5120, 14336, 18944]);
        let (mut tensor, mut simple) = (0, 0);
        for k in ks {
            let at_tp1 = tensor_eligible(specs(k, 0, 1)[0].0);
            if at_tp1 {
                tensor += 1;
            } else {
                simple += 1;
            }
            for tp in [1, 2, 4, 8] {
                for rank in 0..tp {
                    for (spec, k_local) in specs(k, rank, tp) {
                        assert_eq!(tensor_eligible(spec), at_tp1, "K {k} TP {tp} rank {rank}");
                        if !at_tp1 {
                            continue;
                        }
                        for m in [1usize, 7, 16, 17, 64, 65, 256, 257, 1000] {
                            for fam in [Family::Mma, Family::Wgmma] {
                                let shape = TreeMatmul {
                                    m,
                                    n: 200,
                                    k: k_local,
                                    seg_len: spec.seg_len,
                                    n_seg: spec.n_seg,
                                };
                                let path = Path::for_shape(&shape, fam);
                                if fam == Family::Wgmma {
                                    // The model's tensor layers always get the TMA paths.
                                    assert!(path.is_tma(), "K {k} TP {tp} rank {rank} M {m}");
                                }
                                let a = GemmArgs {
                                    shape,
                                    x: 0x1000,
                                    ldx: k_local,
                                    x_rows: m,
                                    w: 0x2000,
                                    ldw: k_local,
                                    out: 0x3000,
                                    out_dtype: OutDtype::F32,
                                    ws: 0x4000,
                                    ws_len: path.workspace_len(m, 200, spec.n_seg),
                                    counters: 0x5000,
                                    counters_len: path.counters_len(m, 200),
                                    w_constant: true,
                                    epilogue: Epilogue::Store,
                                };
                                if let Err(e) = validate(&a, path) {
                                    panic!("K {k} TP {tp} rank {rank} M {m}: {e}");
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(tensor > 0 && simple > 0, "{tensor} tensor, {simple} simple");
    }

    #[test]
    fn the_models_layers_take_the_expected_kernel() {
        let full = |k: usize| TreeSpec {
            seg_len: SegmentLayout::new(k).seg_len,
            n_seg: SEGMENTS,
            k,
        };
        // llama3-8b: hidden 4096, intermediate 14336; the tiny model: hidden 128 and
        // q width 256 (tensor), intermediate 344 (segments of 43: the simple kernel).
        for k in [4096, 14336, 128, 256] {
            assert!(tensor_eligible(full(k)), "K {k}");
        }
        // 96: seg_len 12; 4090: seg_len 512 but K not a multiple of 8 (a short last segment
        // that only the last rank would see); 60: seg_len 8, K not a multiple of 8.
        for k in [344, 96, 4090, 60, 0] {
            assert!(!tensor_eligible(full(k)), "K {k}");
        }
    }

    #[test]
    fn scratch_grows_only_when_a_call_needs_more_and_keeps_what_it_outgrew() {
        let mut allocs = Vec::new();
        let mut retired = Vec::new();
        let mut buf: Option<Vec<u8>> = None;
        let mut call = |buf: &mut Option<Vec<u8>>, need: usize| {
            let b = grown(
                buf,
                &mut |o: Vec<u8>| retired.push(o.len()),
                |b| b.len(),
                need,
                |l| {
                    allocs.push(l);
                    Ok(vec![0u8; l])
                },
            )
            .map(|b| b.len());
            b.unwrap_or_else(|e| panic!("{e}"))
        };
        assert_eq!(
            call(&mut buf, 0),
            1,
            "an empty need still gets a valid pointer"
        );
        assert_eq!(call(&mut buf, 100), 100);
        assert_eq!(call(&mut buf, 40), 100, "a smaller call reuses the buffer");
        assert_eq!(call(&mut buf, 101), 101);
        assert_eq!(allocs, [1, 100, 101]);
        assert_eq!(retired, [1, 100], "outgrown buffers are kept, not freed");
    }

    #[test]
    fn env_values_parse_or_name_the_bad_value() {
        assert_eq!(GemmKind::parse(None).unwrap(), GemmKind::Auto);
        assert_eq!(GemmKind::parse(Some("auto")).unwrap(), GemmKind::Auto);
        assert_eq!(GemmKind::parse(Some("simple")).unwrap(), GemmKind::Simple);
        assert_eq!(GemmKind::Auto.resolve(9), GemmKind::Tensor);
        assert_eq!(GemmKind::Auto.resolve(8), GemmKind::Tensor);
        assert_eq!(GemmKind::Auto.resolve(7), GemmKind::Simple);
        assert_eq!(GemmKind::Tensor.resolve(7), GemmKind::Tensor);
        assert_eq!(GemmKind::Simple.resolve(9), GemmKind::Simple);
        assert_eq!(GemmKind::parse(Some("tensor")).unwrap(), GemmKind::Tensor);
        for bad in ["", "Tensor", "cublas", " tensor"] {
            let e = GemmKind::parse(Some(bad)).unwrap_err();
            assert!(
                e.contains("ARBOR_GPU_GEMM") && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
    }

    #[test]
    fn pad_rows_read_whole_boxes_above_64_rows_unless_exact() {
        assert_eq!(PadRows::parse(None), Ok(PadRows::DEFAULT));
        assert_eq!(PadRows::parse(Some("auto")), Ok(PadRows::DEFAULT));
        assert_eq!(PadRows::parse(Some("read")), Ok(PadRows::DEFAULT));
        assert_eq!(
            PadRows::parse(Some("above: 64")),
            Ok(PadRows::Read { above: 64 })
        );
        assert_eq!(PadRows::parse(Some(" exact ")), Ok(PadRows::Exact));
        assert_eq!(PadRows::parse(Some("zero")), Ok(PadRows::Zero));
        for bad in ["", "1", "padded", "first-half", "above:", "above:-1"] {
            let e = PadRows::parse(Some(bad)).unwrap_err();
            assert!(
                e.contains(PAD_ENV) && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
        // The default reads whole boxes above 64 rows, M up to 64.
        let d = PadRows::DEFAULT;
        assert_eq!(d.x_rows(160, 256), 256);
        assert_eq!(d.x_rows(192, 256), 256);
        assert_eq!(d.x_rows(1, 1), 1);
        assert_eq!(d.x_rows(224, 256), 256);
        assert_eq!(d.rows_to_allocate(64), 64);
        assert_eq!(d.rows_to_allocate(96), 128);
        assert_eq!(d.x_rows(96, 128), 128);
        assert_eq!(d.rows_to_allocate(160), 256);
        assert_eq!(PadRows::Zero.x_rows(224, 256), 256);
        assert_eq!(PadRows::Exact.x_rows(160, 256), 160);
        assert_eq!(d.x_rows(1, 128), 1);
        let high = PadRows::Read { above: 128 };
        assert_eq!(high.rows_to_allocate(96), 96);
        assert_eq!(high.x_rows(96, 96), 96);
        assert_eq!(high.rows_to_allocate(160), 256);
    }
}
