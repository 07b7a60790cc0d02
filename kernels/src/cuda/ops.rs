//! Typed launch wrappers: shapes are checked here, on the host, before any launch, so a
//! kernel never reads or writes out of bounds because of a caller's mistake.

use cudarc::driver::{CudaFunction, CudaView, DeviceRepr, LaunchConfig};

use super::buf::DevBuf;
use super::launch::Launch;

use super::{CudaError, GpuDevice};
use crate::cpu::{RowDraw, RowStats};

/// f32 device buffer (activations).
pub type DevF32 = DevBuf<f32>;
/// bf16 device buffer, stored as raw bits (weights, KV cache).
pub type DevBf16 = DevBuf<u16>;
/// u32 device buffer (token ids, row indices, positions).
pub type DevU32 = DevBuf<u32>;

/// Shape of a KV cache buffer: `[layers, slots, max_len, width]`, width = kv heads × head_dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: usize,
    pub slots: usize,
    pub max_len: usize,
    pub width: usize,
}

impl KvLayout {
    pub fn len(&self) -> usize {
        self.layers * self.slots * self.max_len * self.width
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where each row of a ragged batch goes: its KV slot and position, on the device.
///
/// Uploaded once per step (with the step's other inputs) and read by RoPE, the KV write
/// and attention of every layer; the bounds are checked on the host when it is built, and
/// every limit an op checks it against is remembered ([`RowMeta::limits`]), so that a
/// recorded step replayed with new positions can be checked against the same limits.
pub struct RowMeta {
    /// Device addresses of `[slot; rows]` and `[pos; rows]` (u32).
    slots: u64,
    positions: u64,
    /// The buffer behind them when this meta owns it (`GpuDevice::row_meta`).
    _owned: Option<DevU32>,
    rows: usize,
    /// One past the largest slot and position (0 when there are no rows).
    slot_end: usize,
    pos_end: usize,
    /// Launch shapes must not depend on the positions: the step is being recorded and
    /// will be replayed at other positions (attention then always runs ATTN_WARPS warps).
    fixed_shape: bool,
    /// The smallest (slot, position) limits the ops checked this meta against.
    limits: std::cell::Cell<(usize, usize)>,
}

impl RowMeta {
    /// A row map over device memory that the caller keeps alive while the meta and the
    /// kernels queued with it are in use. `slot_end` / `pos_end`: one past the largest
    /// slot and position of the rows.
    ///
    /// # Safety
    /// `slots` and `positions` are device addresses of `rows` u32 each on the device the
    /// meta is used with, holding the slots and positions the two ends describe.
    pub unsafe fn from_device(
        slots: u64,
        positions: u64,
        rows: usize,
        slot_end: usize,
        pos_end: usize,
        fixed_shape: bool,
    ) -> Self {
        RowMeta {
            slots,
            positions,
            _owned: None,
            rows,
            slot_end,
            pos_end,
            fixed_shape,
            limits: std::cell::Cell::new((usize::MAX, usize::MAX)),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The tightest (slots, positions) limits that the ops run with this meta checked it
    /// against: a replay of their recording is valid for rows whose slots and positions
    /// stay below them.
    pub fn limits(&self) -> (usize, usize) {
        self.limits.get()
    }

    fn limit_slots(&self, kernel: &'static str, slots: usize) -> Result<(), CudaError> {
        let (s, p) = self.limits.get();
        self.limits.set((s.min(slots), p));
        check(kernel, self.slot_end <= slots, || {
            format!(
                "slot {} of a cache with {slots} slots",
                self.slot_end.saturating_sub(1)
            )
        })
    }

    fn limit_positions(&self, kernel: &'static str, what: &str, n: usize) -> Result<(), CudaError> {
        let (s, p) = self.limits.get();
        self.limits.set((s, p.min(n)));
        check(kernel, self.pos_end <= n, || {
            format!(
                "position {} beyond {what} ({n} positions)",
                self.pos_end.saturating_sub(1)
            )
        })
    }

    fn check_cache(
        &self,
        kernel: &'static str,
        layout: KvLayout,
        layer: usize,
    ) -> Result<(), CudaError> {
        check(kernel, layer < layout.layers, || {
            format!("layer {layer} of a cache with {} layers", layout.layers)
        })?;
        self.limit_slots(kernel, layout.slots)?;
        self.limit_positions(kernel, "the cache length", layout.max_len)
    }
}

const RS_THREADS: u32 = 512;
/// select.cu's SEL_THREADS and SEL_MAX_K.
const SEL_THREADS: u32 = 1024;
pub const TOP_K_MAX: usize = 1024;
/// rowstats.cu's RS_CHUNK and RS_GROUP: cpu::digest's DIGEST_CHUNK and DIGEST_GROUP.
const RS_CHUNK: usize = crate::cpu::DIGEST_CHUNK;
const RS_GROUP: usize = crate::cpu::DIGEST_GROUP;
/// Chunk and group digests live in dynamic shared memory next to the kernel's 6 KiB of
/// static.
const RS_MAX_DIGESTS: usize = (48 * 1024 - 12 * RS_THREADS as usize) / 8;

/// Rows of a matmul handled per launch: bounds the segment-partials buffer
/// (`n_seg × rows × n` f32) whatever M is. Each row's arithmetic does not depend on it.
const MM_ROW_CHUNK: usize = 256;
const MM_ROWS_PER_WARP_TILE: usize = 8;
const MM_WARPS_PER_BLOCK: usize = 8;
const EW_THREADS: u32 = 256;
const NORM_THREADS: u32 = 256;
/// attention.cu's ATTN_WARPS, ATTN_CHUNK, ATTN_GROUP and ATTN_MAX_HEAD_DIM.
const ATTN_WARPS: usize = 8;
const ATTN_CHUNK: usize = 32;
const ATTN_GROUP: usize = 4;
const ATTN_MAX_HEAD_DIM: usize = 256;

/// f32 and u64 results per row of the row-stats kernel (rowstats.cu): argmax, digest
/// and draw as u64; max, log-sum-exp, the picked value, the drawn value, the tempered sum
/// and a pad (keeping the u64 part 8-byte aligned) as f32.
pub const ROW_STATS_F32: usize = 6;
pub const ROW_STATS_U64: usize = 3;

/// The row-stats kernel's parameters, 3 u64 per row: the pick, the draw's key, and
/// `mode << 32 | inv_t` bits (mode 1: a Gumbel draw, 2: the tempered sum, 0: neither).
pub fn row_stats_params(pick: &[u32], draws: &[RowDraw]) -> Vec<u64> {
    pick.iter()
        .zip(draws)
        .flat_map(|(&p, d)| match *d {
            RowDraw::Gumbel(g) => [p as u64, g.key, 1 << 32 | g.inv_t.to_bits() as u64],
            RowDraw::Nucleus { inv_t } => [p as u64, 0, 2 << 32 | inv_t.to_bits() as u64],
            RowDraw::None => [p as u64, 0, 0],
        })
        .collect()
}

/// The rows of the row-stats kernel's results.
pub fn decode_row_stats(f: &[f32], u: &[u64]) -> Vec<RowStats> {
    f.chunks_exact(ROW_STATS_F32)
        .zip(u.chunks_exact(ROW_STATS_U64))
        .map(|(f, u)| RowStats {
            argmax: u[0] as u32,
            max: f[0],
            lse: f[1],
            picked: f[2],
            digest: u[1],
            sampled: u[2] as u32,
            sampled_value: f[3],
            tempered_sum: f[4],
        })
        .collect()
}

/// The candidates of the top-k kernel's results: row r's first `cnt[r]` (index, value)
/// pairs of its `kmax`-entry rows.
pub fn decode_top_k(cnt: &[u32], idx: &[u32], val: &[f32], kmax: usize) -> Vec<Vec<(u32, f32)>> {
    cnt.iter()
        .enumerate()
        .map(|(r, &n)| {
            let m = (n as usize).min(kmax);
            (0..m)
                .map(|j| (idx[r * kmax + j], val[r * kmax + j]))
                .collect()
        })
        .collect()
}

/// One past the largest value (0 for none): the bound a row map's slots or positions
/// are checked with.
pub fn end_of(v: &[u32]) -> usize {
    v.iter().map(|&x| x as usize + 1).max().unwrap_or(0)
}

/// The device address of `buf`'s first element.
pub fn dev_ptr<T>(buf: &DevBuf<T>, stream: &cudarc::driver::CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    buf.device_ptr(stream).0
}

/// The vocabulary of an embedding table of rows of `cols`.
fn embedding_vocab(table: &DevBf16, cols: usize) -> Result<usize, CudaError> {
    check(
        "embedding_kernel",
        cols > 0 && table.len().is_multiple_of(cols),
        || format!("table has {} values, not rows of {cols}", table.len()),
    )?;
    Ok(table.len() / cols)
}

fn i32_of(kernel: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Launch {
        kernel,
        msg: format!("{what} = {v} does not fit the kernel's 32-bit index"),
    })
}

fn check(kernel: &'static str, ok: bool, msg: impl FnOnce() -> String) -> Result<(), CudaError> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Launch { kernel, msg: msg() })
    }
}

fn elementwise_cfg(count: usize) -> LaunchConfig {
    let blocks = count.div_ceil(EW_THREADS as usize).max(1);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (EW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Checks an optional bf16 companion output (see `rms_norm`) against its f32 output's length.
fn check_bf16_out(
    kernel: &'static str,
    outb: &Option<&mut DevBf16>,
    len: usize,
) -> Result<(), CudaError> {
    match outb {
        Some(o) => check(kernel, o.len() == len, || {
            format!("bf16 output has {} values, expected {len}", o.len())
        }),
        None => Ok(()),
    }
}

/// Pushes an optional bf16 companion output: the buffer, or the null pointer the kernel
/// reads as "none".
fn arg_bf16_out(b: &mut Launch<'_>, outb: Option<&mut DevBf16>) {
    const NO_OUTPUT: u64 = 0;
    match outb {
        Some(o) => b.out(o),
        None => b.arg(&NO_OUTPUT),
    };
}

/// The norm kernels' shared checks (weight and companion output against `[rows, cols]`)
/// and launch shape: one block of NORM_THREADS per row.
fn norm_launch(
    kernel: &'static str,
    rows: usize,
    cols: usize,
    weight: &DevF32,
    outb: &Option<&mut DevBf16>,
) -> Result<LaunchConfig, CudaError> {
    check_bf16_out(kernel, outb, rows * cols)?;
    check(kernel, weight.len() == cols, || {
        format!("weight has {} values, expected {cols}", weight.len())
    })?;
    Ok(LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (NORM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl GpuDevice {
    /// A launch of one of the ops program's kernels (each begins with `pdl_enter()`), with
    /// the PDL attribute when the device allows it (launch.rs).
    fn launch<'a>(&'a self, f: &'a CudaFunction) -> Launch<'a> {
        Launch::new(&self.stream, f, self.pdl)
    }

    fn drv<T>(
        &self,
        what: &str,
        r: Result<T, cudarc::driver::DriverError>,
    ) -> Result<T, CudaError> {
        r.map_err(|source| CudaError::Driver {
            ordinal: self.ordinal,
            what: what.to_string(),
            source,
        })
    }

    fn launched(
        &self,
        kernel: &'static str,
        r: Result<impl Sized, cudarc::driver::DriverError>,
    ) -> Result<(), CudaError> {
        self.drv(&format!("launching {kernel}"), r).map(|_| ())
    }

    /// A copy of host data in a buffer of its own (never lent: uploads hold weights,
    /// tables and the inputs of steps, which outlive a step).
    pub fn upload<T: DeviceRepr>(&self, what: &str, data: &[T]) -> Result<DevBuf<T>, CudaError> {
        if data.is_empty() {
            // SAFETY: no elements to leave undefined.
            return self
                .drv(what, unsafe { self.stream.alloc::<T>(0) })
                .map(DevBuf::owned);
        }
        self.drv(what, self.stream.clone_htod(data))
            .map(DevBuf::owned)
    }

    pub fn upload_f32(&self, data: &[f32]) -> Result<DevF32, CudaError> {
        self.upload("uploading f32 data", data)
    }

    pub fn upload_bf16(&self, data: &[half::bf16]) -> Result<DevBf16, CudaError> {
        self.upload("uploading bf16 data", bytemuck::cast_slice::<_, u16>(data))
    }

    pub fn upload_u32(&self, data: &[u32]) -> Result<DevU32, CudaError> {
        self.upload("uploading u32 data", data)
    }

    /// Overwrites the device memory at `dst` with `data` (stream-ordered).
    ///
    /// # Safety
    /// `dst` is device memory of this device with room for `data`.
    pub unsafe fn write_raw<T: DeviceRepr>(&self, dst: u64, data: &[T]) -> Result<(), CudaError> {
        if data.is_empty() {
            return Ok(());
        }
        self.drv("binding the context", self.ctx.bind_to_thread())?;
        self.drv("uploading", unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, data, self.stream.cu_stream())
        })
    }

    /// The first `len` values of `buf` on the host. A copy into pageable memory returns
    /// once it has completed, so this waits for the stream's earlier work.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        what: &str,
        buf: &DevBuf<T>,
        len: usize,
    ) -> Result<Vec<T>, CudaError> {
        self.download_range(what, buf, 0..len)
    }

    /// Values `range` of `buf` on the host (see `download`).
    pub fn download_range<T: DeviceRepr + Default + Clone>(
        &self,
        what: &str,
        buf: &DevBuf<T>,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<T>, CudaError> {
        check(
            "download",
            range.start <= range.end && range.end <= buf.len(),
            || format!("values {range:?} from a buffer of {}", buf.len()),
        )?;
        if range.is_empty() {
            return Ok(Vec::new());
        }
        let mut out = vec![T::default(); range.len()];
        self.drv(what, self.stream.memcpy_dtoh(&buf.slice(range), &mut out))?;
        Ok(out)
    }

    pub fn download_f32(&self, buf: &DevF32) -> Result<Vec<f32>, CudaError> {
        self.download("downloading f32 data", buf, buf.len())
    }

    pub fn download_bf16(&self, buf: &DevBf16) -> Result<Vec<half::bf16>, CudaError> {
        let bits = self.download("downloading bf16 data", buf, buf.len())?;
        Ok(bits.into_iter().map(half::bf16::from_bits).collect())
    }

    /// A buffer of `len` values with undefined contents: lent by the workspace while a
    /// step scope is open (buf.rs), else a stream-ordered allocation of its own.
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<DevBuf<T>, CudaError> {
        if let Some(b) = self.drv(
            "lending from the step workspace",
            self.workspace.lend::<T>(&self.stream, len),
        )? {
            return Ok(b);
        }
        // SAFETY: callers write every element before anything reads it (or zero it).
        self.drv("allocating", unsafe { self.stream.alloc::<T>(len) })
            .map(DevBuf::owned)
    }

    /// `alloc`, zeroed (stream-ordered).
    pub fn alloc_zeroed<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<DevBuf<T>, CudaError> {
        let mut b = self.alloc::<T>(len)?;
        if len > 0 {
            self.drv("zeroing", self.stream.memset_zeros(&mut *b))?;
        }
        Ok(b)
    }

    /// An f32 buffer with undefined contents, for an output that a kernel writes in full:
    /// saves the memset a zeroed buffer costs on every op.
    pub fn empty_f32(&self, len: usize) -> Result<DevF32, CudaError> {
        self.alloc(len)
    }

    pub fn zeros_f32(&self, len: usize) -> Result<DevF32, CudaError> {
        self.alloc_zeroed(len)
    }

    /// A bf16 buffer with undefined contents (see `empty_f32`).
    pub fn empty_bf16(&self, len: usize) -> Result<DevBf16, CudaError> {
        self.alloc(len)
    }

    pub fn zeros_bf16(&self, len: usize) -> Result<DevBf16, CudaError> {
        self.alloc_zeroed(len)
    }

    pub fn copy_f32(&self, src: &DevF32) -> Result<DevF32, CudaError> {
        let mut out = self.empty_f32(src.len())?;
        if !src.is_empty() {
            self.drv(
                "copying f32 buffer",
                self.stream.memcpy_dtod(&**src, &mut *out),
            )?;
        }
        Ok(out)
    }

    /// out `[m, n]` = bf16(x) `[m, k]` · wᵀ (`w`: `[n, k]` bf16), reduced over the local K
    /// as `n_seg` segments of `seg_len` columns (last ones possibly short or empty) and
    /// returned as the subtree root over them.
    #[allow(clippy::too_many_arguments)]
    pub fn tree_matmul(
        &self,
        x: &DevF32,
        m: usize,
        k: usize,
        w: &DevBf16,
        n: usize,
        seg_len: usize,
        n_seg: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "tree_matmul_leaf";
        check(K, x.len() == m * k, || {
            format!("x has {} values, expected m×k = {m}×{k}", x.len())
        })?;
        check(K, w.len() == n * k, || {
            format!("w has {} values, expected n×k = {n}×{k}", w.len())
        })?;
        check(K, matches!(n_seg, 1 | 2 | 4 | 8), || {
            format!("n_seg = {n_seg}, expected 1, 2, 4 or 8")
        })?;
        check(K, seg_len >= 1 && n_seg * seg_len >= k, || {
            format!("seg_len = {seg_len} × n_seg = {n_seg} does not cover k = {k}")
        })?;
        let mut out = self.empty_f32(m * n)?;
        if m == 0 || n == 0 {
            return Ok(out);
        }
        let (ki, ni, segi) = (
            i32_of(K, "k", k)?,
            i32_of(K, "n", n)?,
            i32_of(K, "seg_len", seg_len)?,
        );
        let vec = i32::from(k.is_multiple_of(8) && seg_len.is_multiple_of(8));
        // f32_to_bf16 writes all m·k values.
        let mut xb = self.empty_bf16(m * k)?;
        {
            let count = (m * k) as i64;
            let f = self.func("f32_to_bf16_kernel")?;
            let mut b = self.launch(f);
            b.arg(x).out(&mut xb).arg(&count);
            self.launched("f32_to_bf16_kernel", unsafe {
                b.launch(elementwise_cfg(m * k))
            })?;
        }
        let chunk = MM_ROW_CHUNK.min(m);
        let mut part = self.zeros_f32(n_seg * chunk * n)?;
        let leaf = self.func(K)?;
        let comb = self.func("tree_combine")?;
        let mut r0 = 0;
        while r0 < m {
            let rows = chunk.min(m - r0);
            let rows_i = rows as i32;
            let xv: CudaView<u16> = xb.slice(r0 * k..(r0 + rows) * k);
            let cfg = LaunchConfig {
                grid_dim: (
                    n.div_ceil(MM_WARPS_PER_BLOCK) as u32,
                    n_seg as u32,
                    rows.div_ceil(MM_ROWS_PER_WARP_TILE) as u32,
                ),
                block_dim: ((MM_WARPS_PER_BLOCK * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            {
                let mut b = self.launch(leaf);
                b.arg(&xv)
                    .arg(w)
                    .out(&mut part)
                    .arg(&rows_i)
                    .arg(&ni)
                    .arg(&ki)
                    .arg(&segi)
                    .arg(&vec);
                self.launched(K, unsafe { b.launch(cfg) })?;
            }
            {
                let count = (rows * n) as i64;
                let n_parts = n_seg as i32;
                let mut ov = out.slice_mut(r0 * n..(r0 + rows) * n);
                let mut b = self.launch(comb);
                b.arg(&part).out(&mut ov).arg(&count).arg(&n_parts);
                self.launched("tree_combine", unsafe {
                    b.launch(elementwise_cfg(rows * n))
                })?;
            }
            r0 += rows;
        }
        Ok(out)
    }

    /// `out[..x.len()]` = bf16(x), rounded to nearest even by the same kernel as
    /// [`GpuDevice::tree_matmul`]'s input (so a GEMM fed from it sees the same bf16 X);
    /// `out` may be longer (a reusable scratch buffer).
    pub fn f32_to_bf16_into(&self, x: &DevF32, out: &mut DevBf16) -> Result<(), CudaError> {
        const K: &str = "f32_to_bf16_kernel";
        check(K, out.len() >= x.len(), || {
            format!(
                "bf16 output holds {} values, the input has {}",
                out.len(),
                x.len()
            )
        })?;
        if x.is_empty() {
            return Ok(());
        }
        let count = x.len() as i64;
        let f = self.func(K)?;
        let mut b = self.launch(f);
        b.arg(x).out(out).arg(&count);
        self.launched(K, unsafe { b.launch(elementwise_cfg(x.len())) })
    }

    /// out\[i\] = the fixed tree over `parts[p·count + i]`, p < n_parts (1, 2, 4 or 8).
    pub fn tree_combine(
        &self,
        parts: &DevF32,
        count: usize,
        n_parts: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "tree_combine";
        check(K, matches!(n_parts, 1 | 2 | 4 | 8), || {
            format!("n_parts = {n_parts}, expected 1, 2, 4 or 8")
        })?;
        check(K, parts.len() == count * n_parts, || {
            format!(
                "parts has {} values, expected {n_parts} × {count}",
                parts.len()
            )
        })?;
        let mut out = self.empty_f32(count)?;
        if count == 0 {
            return Ok(out);
        }
        let (c, np) = (count as i64, n_parts as i32);
        let mut b = self.launch(self.func(K)?);
        b.arg(parts).out(&mut out).arg(&c).arg(&np);
        self.launched(K, unsafe { b.launch(elementwise_cfg(count)) })?;
        Ok(out)
    }

    /// Per-row RMSNorm. `outb`: also write the output rounded to bf16 there (what a GEMM
    /// reading it would compute itself), saving the GEMM its conversion pass.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        x: &DevF32,
        rows: usize,
        cols: usize,
        weight: &DevF32,
        eps: f32,
        outb: Option<&mut DevBf16>,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "rms_norm_kernel";
        check(K, x.len() == rows * cols, || {
            format!("x has {} values, expected {rows}×{cols}", x.len())
        })?;
        let cfg = norm_launch(K, rows, cols, weight, &outb)?;
        let mut out = self.empty_f32(rows * cols)?;
        if rows == 0 || cols == 0 {
            return Ok(out);
        }
        let ci = i32_of(K, "cols", cols)?;
        let mut b = self.launch(self.func(K)?);
        b.arg(x).arg(weight).out(&mut out);
        arg_bf16_out(&mut b, outb);
        b.arg(&ci).arg(&eps);
        self.launched(K, unsafe { b.launch(cfg) })?;
        Ok(out)
    }

    /// `x += y` then RMSNorm of the sum (`x`, `y`: `[rows, cols]`): the bits of
    /// `add_assign` followed by `rms_norm`, in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        x: &mut DevF32,
        y: &DevF32,
        rows: usize,
        cols: usize,
        weight: &DevF32,
        eps: f32,
        outb: Option<&mut DevBf16>,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "add_rms_norm_kernel";
        check(K, x.len() == rows * cols && y.len() == rows * cols, || {
            format!(
                "x has {} values, y {}, expected {rows}×{cols}",
                x.len(),
                y.len()
            )
        })?;
        let cfg = norm_launch(K, rows, cols, weight, &outb)?;
        let mut out = self.empty_f32(rows * cols)?;
        if rows == 0 || cols == 0 {
            return Ok(out);
        }
        let ci = i32_of(K, "cols", cols)?;
        let mut b = self.launch(self.func(K)?);
        b.out(x).arg(y).arg(weight).out(&mut out);
        arg_bf16_out(&mut b, outb);
        b.arg(&ci).arg(&eps);
        self.launched(K, unsafe { b.launch(cfg) })?;
        Ok(out)
    }

    pub fn silu_mul(&self, gate: &DevF32, up: &DevF32) -> Result<DevF32, CudaError> {
        const K: &str = "silu_mul_kernel";
        check(K, gate.len() == up.len(), || {
            format!("gate has {} values, up {}", gate.len(), up.len())
        })?;
        let count = gate.len();
        let mut out = self.empty_f32(count)?;
        if count == 0 {
            return Ok(out);
        }
        let c = count as i64;
        let mut b = self.launch(self.func(K)?);
        b.arg(gate).arg(up).out(&mut out).arg(&c);
        self.launched(K, unsafe { b.launch(elementwise_cfg(count)) })?;
        Ok(out)
    }

    /// Argmax, max, log-sum-exp, the value at `pick[r]` (`u32::MAX`: none) and the digest
    /// of the first `vocab` values of each row of `x` (`[rows, cols]`); a few bytes per row
    /// come back instead of the row.
    pub fn row_stats(
        &self,
        x: &DevF32,
        rows: usize,
        cols: usize,
        vocab: usize,
        pick: &[u32],
        draws: &[RowDraw],
    ) -> Result<Vec<RowStats>, CudaError> {
        check(
            "row_stats_kernel",
            pick.len() == rows && draws.len() == rows,
            || {
                format!(
                    "{} picks and {} draws for {rows} rows",
                    pick.len(),
                    draws.len()
                )
            },
        )?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let params = self.upload("uploading row params", &row_stats_params(pick, draws))?;
        let of = self.alloc::<f32>(rows * ROW_STATS_F32)?;
        let ou = self.alloc::<u64>(rows * ROW_STATS_U64)?;
        let s = &self.stream;
        // SAFETY: the three buffers hold `rows` rows of parameters and results.
        unsafe {
            self.row_stats_raw(
                x,
                rows,
                cols,
                vocab,
                dev_ptr(&params, s),
                dev_ptr(&of, s),
                dev_ptr(&ou, s),
            )
        }?;
        let f = self.download("downloading row stats", &of, of.len())?;
        let u = self.download("downloading row stats", &ou, ou.len())?;
        Ok(decode_row_stats(&f, &u))
    }

    /// `row_stats` with its parameters and results in device memory: `params` holds
    /// [`row_stats_params`] (3 u64 per row); the kernel writes [`ROW_STATS_F32`] f32 per
    /// row at `out_f` and [`ROW_STATS_U64`] u64 per row at `out_u` ([`decode_row_stats`]).
    ///
    /// # Safety
    /// The three addresses are device memory of this device holding `rows` rows each,
    /// 8-byte aligned, valid until the kernel has run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn row_stats_raw(
        &self,
        x: &DevF32,
        rows: usize,
        cols: usize,
        vocab: usize,
        params: u64,
        out_f: u64,
        out_u: u64,
    ) -> Result<(), CudaError> {
        const K: &str = "row_stats_kernel";
        check(K, x.len() == rows * cols && vocab <= cols, || {
            format!("{} values as [{rows}, {cols}] with vocab {vocab}", x.len())
        })?;
        check(K, [params, out_f, out_u].iter().all(|p| p % 8 == 0), || {
            "parameter and result buffers must be 8-byte aligned".into()
        })?;
        let n_chunks = vocab.div_ceil(RS_CHUNK);
        let n_digests = n_chunks + n_chunks.div_ceil(RS_GROUP);
        check(K, n_digests <= RS_MAX_DIGESTS, || {
            format!("vocab {vocab} needs {n_digests} chunk and group digests, more than {RS_MAX_DIGESTS}")
        })?;
        if rows == 0 {
            return Ok(());
        }
        let (ci, vi) = (i32_of(K, "cols", cols)?, i32_of(K, "vocab", vocab)?);
        let cfg = LaunchConfig {
            grid_dim: (i32_of(K, "rows", rows)? as u32, 1, 1),
            block_dim: (RS_THREADS, 1, 1),
            shared_mem_bytes: (n_digests * 8) as u32,
        };
        let mut b = self.launch(self.func(K)?);
        b.arg(x)
            .arg(&ci)
            .arg(&vi)
            .arg(&params)
            .arg(&out_f)
            .arg(&out_u);
        self.launched(K, unsafe { b.launch(cfg) })
    }

    /// The `ks[r]` largest of the first `vocab` values of each row of `x` (`[rows, cols]`),
    /// NaN excluded, as (index, value) in `sampling::sorted_desc`'s order (descending by
    /// total order, lowest index first on ties); `ks[r] = 0`: none. At most
    /// [`TOP_K_MAX`] per row; 8 bytes per candidate come back instead of the row.
    pub fn top_k_select(
        &self,
        x: &DevF32,
        rows: usize,
        cols: usize,
        vocab: usize,
        ks: &[usize],
    ) -> Result<Vec<Vec<(u32, f32)>>, CudaError> {
        const K: &str = "top_k_select_kernel";
        check(K, ks.len() == rows, || {
            format!("{} k's for {rows} rows", ks.len())
        })?;
        if let Some(k) = ks.iter().find(|&&k| k > TOP_K_MAX) {
            return Err(CudaError::Launch {
                kernel: K,
                msg: format!("top-k {k} is more than the kernel's {TOP_K_MAX}"),
            });
        }
        let kmax = ks.iter().copied().max().unwrap_or(0);
        if rows == 0 || kmax == 0 {
            return Ok(vec![Vec::new(); rows]);
        }
        let k32: Vec<u32> = ks.iter().map(|&k| k as u32).collect();
        let dks = self.upload_u32(&k32)?;
        // The kernel writes the first out_n[r] entries of each row; only those are read.
        let idx = self.alloc::<u32>(rows * kmax)?;
        let val = self.alloc::<f32>(rows * kmax)?;
        let cnt = self.alloc::<u32>(rows)?;
        let s = &self.stream;
        // SAFETY: each buffer holds `rows` rows of `kmax` (or 1) entries; every k ≤ kmax.
        unsafe {
            self.top_k_raw(
                x,
                rows,
                cols,
                vocab,
                dev_ptr(&dks, s),
                kmax,
                [dev_ptr(&idx, s), dev_ptr(&val, s), dev_ptr(&cnt, s)],
            )
        }?;
        let n = self.download("downloading top-k counts", &cnt, rows)?;
        let i = self.download("downloading top-k indices", &idx, idx.len())?;
        let v = self.download("downloading top-k values", &val, val.len())?;
        Ok(decode_top_k(&n, &i, &v, kmax))
    }

    /// `top_k_select` with the k's (u32 per row) and the results in device memory:
    /// `out` = [indices (u32, `kmax` per row), values (f32, `kmax` per row), counts (u32
    /// per row)] ([`decode_top_k`]).
    ///
    /// # Safety
    /// The addresses are device memory of this device of those sizes, valid until the
    /// kernel has run, and every k is at most `kmax`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn top_k_raw(
        &self,
        x: &DevF32,
        rows: usize,
        cols: usize,
        vocab: usize,
        ks: u64,
        kmax: usize,
        out: [u64; 3],
    ) -> Result<(), CudaError> {
        const K: &str = "top_k_select_kernel";
        check(K, x.len() == rows * cols && vocab <= cols, || {
            format!("{} values as [{rows}, {cols}] with vocab {vocab}", x.len())
        })?;
        check(K, kmax <= TOP_K_MAX, || {
            format!("top-k {kmax} is more than the kernel's {TOP_K_MAX}")
        })?;
        if rows == 0 || kmax == 0 {
            return Ok(());
        }
        let (ci, vi, ki) = (
            i32_of(K, "cols", cols)?,
            i32_of(K, "vocab", vocab)?,
            i32_of(K, "k", kmax)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (i32_of(K, "rows", rows)? as u32, 1, 1),
            block_dim: (SEL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let [idx, val, cnt] = out;
        let mut b = self.launch(self.func(K)?);
        b.arg(x)
            .arg(&ci)
            .arg(&vi)
            .arg(&ks)
            .arg(&ki)
            .arg(&idx)
            .arg(&val)
            .arg(&cnt);
        self.launched(K, unsafe { b.launch(cfg) })
    }

    /// silu(gate)·up of a gate/up output `[rows, 2·inter]` whose gate and up columns
    /// alternate (column 2j gate j, 2j + 1 up j).
    pub fn silu_mul_pairs(
        &self,
        gu: &DevF32,
        rows: usize,
        inter: usize,
        outb: Option<&mut DevBf16>,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "silu_mul_pairs_kernel";
        check_bf16_out(K, &outb, rows * inter)?;
        check(K, gu.len() == rows * 2 * inter, || {
            format!("gate/up has {} values, expected {rows}×2×{inter}", gu.len())
        })?;
        let mut out = self.empty_f32(rows * inter)?;
        if rows == 0 || inter == 0 {
            return Ok(out);
        }
        let count = (rows * inter) as i64;
        let mut b = self.launch(self.func(K)?);
        b.arg(gu).out(&mut out);
        arg_bf16_out(&mut b, outb);
        b.arg(&count);
        self.launched(K, unsafe { b.launch(elementwise_cfg(rows * inter)) })?;
        Ok(out)
    }

    /// Columns `col0..col0 + cols` of `src` (`[rows, src_cols]`) as a `[rows, cols]` matrix.
    pub fn copy_cols(
        &self,
        src: &DevF32,
        rows: usize,
        src_cols: usize,
        col0: usize,
        cols: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "copy_cols_kernel";
        check(
            K,
            src.len() == rows * src_cols && col0 + cols <= src_cols,
            || {
                format!(
                    "columns {col0}..{} of a [{rows}, {src_cols}] matrix of {} values",
                    col0 + cols,
                    src.len()
                )
            },
        )?;
        let mut out = self.empty_f32(rows * cols)?;
        if rows == 0 || cols == 0 {
            return Ok(out);
        }
        let r = rows as i64;
        let (sc, c0, c) = (
            i32_of(K, "src_cols", src_cols)?,
            i32_of(K, "col0", col0)?,
            i32_of(K, "cols", cols)?,
        );
        let mut b = self.launch(self.func(K)?);
        b.arg(src).out(&mut out).arg(&r).arg(&sc).arg(&c0).arg(&c);
        self.launched(K, unsafe { b.launch(elementwise_cfg(rows * cols)) })?;
        Ok(out)
    }

    pub fn add_row_bias(&self, x: &mut DevF32, bias: &DevF32) -> Result<(), CudaError> {
        const K: &str = "add_row_bias_kernel";
        let cols = bias.len();
        check(K, cols > 0 && x.len().is_multiple_of(cols), || {
            format!(
                "x has {} values, not a multiple of the bias length {cols}",
                x.len()
            )
        })?;
        if x.is_empty() {
            return Ok(());
        }
        let (count, ci) = (x.len() as i64, i32_of(K, "cols", cols)?);
        let cfg = elementwise_cfg(x.len());
        let mut b = self.launch(self.func(K)?);
        b.out(x).arg(bias).arg(&count).arg(&ci);
        self.launched(K, unsafe { b.launch(cfg) })
    }

    pub fn add_assign(&self, x: &mut DevF32, y: &DevF32) -> Result<(), CudaError> {
        const K: &str = "add_assign_kernel";
        check(K, x.len() == y.len(), || {
            format!("x has {} values, y {}", x.len(), y.len())
        })?;
        if x.is_empty() {
            return Ok(());
        }
        let count = x.len() as i64;
        let cfg = elementwise_cfg(x.len());
        let mut b = self.launch(self.func(K)?);
        b.out(x).arg(y).arg(&count);
        self.launched(K, unsafe { b.launch(cfg) })
    }

    /// Rows `ids` of `table` (`[vocab, cols]` bf16) as f32.
    pub fn embedding(
        &self,
        table: &DevBf16,
        cols: usize,
        ids: &[u32],
    ) -> Result<DevF32, CudaError> {
        let vocab = embedding_vocab(table, cols)?;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(CudaError::Launch {
                kernel: "embedding_kernel",
                msg: format!("token id {bad} is out of range for a vocabulary of {vocab}"),
            });
        }
        if ids.is_empty() {
            return self.empty_f32(0);
        }
        let dids = self.upload_u32(ids)?;
        // SAFETY: `dids` holds the ids, checked against the vocabulary above.
        unsafe { self.embedding_raw(table, cols, dev_ptr(&dids, &self.stream), ids.len()) }
    }

    /// `embedding` of `rows` ids already on the device at `ids` (u32).
    ///
    /// # Safety
    /// `ids` is device memory of this device holding `rows` ids below the table's
    /// vocabulary, valid until the kernel has run.
    pub unsafe fn embedding_raw(
        &self,
        table: &DevBf16,
        cols: usize,
        ids: u64,
        rows: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "embedding_kernel";
        embedding_vocab(table, cols)?;
        let mut out = self.empty_f32(rows * cols)?;
        if rows == 0 {
            return Ok(out);
        }
        let (ri, ci) = (i32_of(K, "rows", rows)?, i32_of(K, "cols", cols)?);
        let mut b = self.launch(self.func(K)?);
        b.arg(table).arg(&ids).out(&mut out).arg(&ri).arg(&ci);
        self.launched(K, unsafe { b.launch(elementwise_cfg(rows * cols)) })?;
        Ok(out)
    }

    /// The given rows of `x` (`[rows, cols]`), in the given order.
    pub fn select_rows(&self, x: &DevF32, cols: usize, idx: &[usize]) -> Result<DevF32, CudaError> {
        const K: &str = "select_rows_kernel";
        check(K, cols > 0 && x.len().is_multiple_of(cols), || {
            format!("x has {} values, not rows of {cols}", x.len())
        })?;
        let rows = x.len() / cols;
        let mut idx32 = Vec::with_capacity(idx.len());
        for &i in idx {
            check(K, i < rows, || {
                format!("row {i} requested from a matrix of {rows} rows")
            })?;
            idx32.push(i as u32);
        }
        let mut out = self.empty_f32(idx.len() * cols)?;
        if idx.is_empty() {
            return Ok(out);
        }
        let didx = self.upload_u32(&idx32)?;
        let (ri, ci) = (i32_of(K, "rows", idx.len())?, i32_of(K, "cols", cols)?);
        let mut b = self.launch(self.func(K)?);
        b.arg(x).arg(&didx).out(&mut out).arg(&ri).arg(&ci);
        self.launched(K, unsafe { b.launch(elementwise_cfg(idx.len() * cols)) })?;
        Ok(out)
    }

    /// `[world, rows, cols]` (rank-major, as an all-gather returns it) → `[rows, world·cols]`.
    pub fn interleave_cols(
        &self,
        gathered: &DevF32,
        world: usize,
        rows: usize,
        cols: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "interleave_cols_kernel";
        check(K, gathered.len() == world * rows * cols, || {
            format!(
                "gathered has {} values, expected {world}×{rows}×{cols}",
                gathered.len()
            )
        })?;
        let mut out = self.empty_f32(gathered.len())?;
        if gathered.is_empty() {
            return Ok(out);
        }
        let (wi, ri, ci) = (
            i32_of(K, "world", world)?,
            i32_of(K, "rows", rows)?,
            i32_of(K, "cols", cols)?,
        );
        let mut b = self.launch(self.func(K)?);
        b.arg(gathered).out(&mut out).arg(&wi).arg(&ri).arg(&ci);
        self.launched(K, unsafe { b.launch(elementwise_cfg(gathered.len())) })?;
        Ok(out)
    }

    /// Uploads the per-row (slot, position) of a batch in one copy, into a buffer the
    /// meta owns.
    pub fn row_meta(&self, row_slot: &[u32], row_pos: &[u32]) -> Result<RowMeta, CudaError> {
        check("row_meta", row_slot.len() == row_pos.len(), || {
            format!("{} slots for {} positions", row_slot.len(), row_pos.len())
        })?;
        let rows = row_slot.len();
        let mut both = Vec::with_capacity(2 * rows);
        both.extend_from_slice(row_slot);
        both.extend_from_slice(row_pos);
        let buf = self.upload_u32(&both)?;
        let base = dev_ptr(&buf, &self.stream);
        // SAFETY: `buf` holds the slots then the positions, and the meta keeps it.
        let mut meta = unsafe {
            RowMeta::from_device(
                base,
                base + 4 * rows as u64,
                rows,
                end_of(row_slot),
                end_of(row_pos),
                false,
            )
        };
        meta._owned = Some(buf);
        Ok(meta)
    }

    /// Writes K and V rows (`[rows, width]`, rounded to bf16) at (slot, position) per row.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        kc: &mut DevBf16,
        vc: &mut DevBf16,
        layout: KvLayout,
        layer: usize,
        k: &DevF32,
        v: &DevF32,
        meta: &RowMeta,
    ) -> Result<(), CudaError> {
        const K: &str = "kv_write_kernel";
        meta.check_cache(K, layout, layer)?;
        let rows = meta.rows;
        check(
            K,
            kc.len() == layout.len() && vc.len() == layout.len(),
            || "cache buffers do not match their layout".into(),
        )?;
        check(
            K,
            k.len() == rows * layout.width && v.len() == rows * layout.width,
            || {
                format!(
                    "k/v have {}/{} values, expected {rows}×{}",
                    k.len(),
                    v.len(),
                    layout.width
                )
            },
        )?;
        if rows == 0 || layout.width == 0 {
            return Ok(());
        }
        let (ds, dp) = (meta.slots, meta.positions);
        let ri = rows as i32;
        let wi = i32_of(K, "width", layout.width)?;
        let li = layer as i32;
        let si = i32_of(K, "slots", layout.slots)?;
        let mi = i32_of(K, "max_len", layout.max_len)?;
        let mut b = self.launch(self.func(K)?);
        b.out(kc).out(vc).arg(k).arg(v).arg(&ds).arg(&dp);
        b.arg(&ri).arg(&wi).arg(&li).arg(&si).arg(&mi);
        self.launched(K, unsafe { b.launch(elementwise_cfg(rows * layout.width)) })
    }

    /// Rotates `x` (`[rows, n_heads·head_dim]`) in place; row r at position `row_pos[r]`.
    /// `cos`/`sin`: `[max_pos, half]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut DevF32,
        cos: &DevF32,
        sin: &DevF32,
        half: usize,
        meta: &RowMeta,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "rope_kernel";
        let rows = meta.rows;
        check(K, x.len() == rows * n_heads * head_dim, || {
            format!(
                "x has {} values, expected {rows}×{n_heads}×{head_dim}",
                x.len()
            )
        })?;
        check(K, 2 * half <= head_dim && half > 0, || {
            format!("rotary half {half} does not fit head_dim {head_dim}")
        })?;
        check(
            K,
            cos.len() == sin.len() && cos.len().is_multiple_of(half),
            || "cos/sin tables of different shapes".into(),
        )?;
        let max_pos = cos.len() / half;
        meta.limit_positions(K, "the RoPE table", max_pos)?;
        if rows == 0 || n_heads == 0 {
            return Ok(());
        }
        let dp = meta.positions;
        let (ri, hi, di, hf) = (
            rows as i32,
            i32_of(K, "n_heads", n_heads)?,
            i32_of(K, "head_dim", head_dim)?,
            half as i32,
        );
        let mut b = self.launch(self.func(K)?);
        b.out(x)
            .arg(cos)
            .arg(sin)
            .arg(&dp)
            .arg(&ri)
            .arg(&hi)
            .arg(&di)
            .arg(&hf);
        self.launched(K, unsafe {
            b.launch(elementwise_cfg(rows * n_heads * half))
        })
    }

    /// The fused q/k/v output `qkv` (`[rows, (n_heads + 2·n_kv)·head_dim]`): returns q
    /// rotated; writes k rotated and v into the cache at each row's (slot, position). The
    /// bits of `copy_cols`, `rope` and `kv_write`, in one launch. `cos`/`sin`:
    /// `[max_pos, head_dim / 2]`.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_rope_kv(
        &self,
        qkv: &DevF32,
        kc: &mut DevBf16,
        vc: &mut DevBf16,
        layout: KvLayout,
        layer: usize,
        cos: &DevF32,
        sin: &DevF32,
        meta: &RowMeta,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "qkv_rope_kv_kernel";
        meta.check_cache(K, layout, layer)?;
        let rows = meta.rows;
        let half = head_dim / 2;
        check(K, half > 0 && 2 * half == head_dim, || {
            format!("head_dim {head_dim} is not even")
        })?;
        check(K, layout.width == n_kv * head_dim, || {
            format!(
                "cache width {} ≠ {n_kv} KV heads × {head_dim}",
                layout.width
            )
        })?;
        check(
            K,
            qkv.len() == rows * (n_heads + 2 * n_kv) * head_dim,
            || {
                format!(
                    "qkv has {} values, expected {rows}×({n_heads} + 2·{n_kv})×{head_dim}",
                    qkv.len()
                )
            },
        )?;
        check(
            K,
            kc.len() == layout.len() && vc.len() == layout.len(),
            || "cache buffers do not match their layout".into(),
        )?;
        check(K, cos.len() == sin.len(), || {
            "cos/sin tables of different shapes".into()
        })?;
        meta.limit_positions(K, "the RoPE table", cos.len() / half)?;
        let mut q = self.empty_f32(rows * n_heads * head_dim)?;
        if rows == 0 {
            return Ok(q);
        }
        let (ds, dp) = (meta.slots, meta.positions);
        let (ri, hi, kvi, di, hf) = (
            rows as i32,
            i32_of(K, "n_heads", n_heads)?,
            i32_of(K, "n_kv_heads", n_kv)?,
            i32_of(K, "head_dim", head_dim)?,
            half as i32,
        );
        let (li, si, mi) = (
            layer as i32,
            i32_of(K, "slots", layout.slots)?,
            i32_of(K, "max_len", layout.max_len)?,
        );
        // Four values a thread where the rows allow 16-byte accesses (same bits).
        let per = if half.is_multiple_of(4) { 4 } else { 1 };
        let kernel = if per == 4 { "qkv_rope_kv4_kernel" } else { K };
        let mut b = self.launch(self.func(kernel)?);
        b.arg(qkv).out(&mut q).out(kc).out(vc).arg(cos).arg(sin);
        b.arg(&ds)
            .arg(&dp)
            .arg(&ri)
            .arg(&hi)
            .arg(&kvi)
            .arg(&di)
            .arg(&hf);
        b.arg(&li).arg(&si).arg(&mi);
        let units = rows * (n_heads + 2 * n_kv) * (half / per);
        self.launched(K, unsafe { b.launch(elementwise_cfg(units)) })?;
        Ok(q)
    }

    /// Causal GQA attention of `q` (`[rows, n_heads·head_dim]`) against the cache; row r
    /// is at `row_pos[r]` of slot `row_slot[r]` and sees keys `0..=row_pos[r]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &DevF32,
        kc: &DevBf16,
        vc: &DevBf16,
        layout: KvLayout,
        layer: usize,
        meta: &RowMeta,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        outb: Option<&mut DevBf16>,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "attention_kernel";
        check_bf16_out(K, &outb, q.len())?;
        // Specialised per common head_dim (vector loads, unrolled); the same arithmetic.
        let kernel = match head_dim {
            64 => "attention_hd64_kernel",
            128 => "attention_hd128_kernel",
            256 => "attention_hd256_kernel",
            _ => K,
        };
        meta.check_cache(K, layout, layer)?;
        let rows = meta.rows;
        check(
            K,
            n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
            || format!("{n_heads} query heads are not a multiple of {n_kv_heads} KV heads"),
        )?;
        check(K, head_dim > 0 && head_dim <= ATTN_MAX_HEAD_DIM, || {
            format!("head_dim {head_dim} is outside 1..={ATTN_MAX_HEAD_DIM}")
        })?;
        check(K, layout.width == n_kv_heads * head_dim, || {
            format!(
                "cache width {} ≠ {n_kv_heads} KV heads × {head_dim}",
                layout.width
            )
        })?;
        check(K, q.len() == rows * n_heads * head_dim, || {
            format!(
                "q has {} values, expected {rows}×{n_heads}×{head_dim}",
                q.len()
            )
        })?;
        check(
            K,
            kc.len() == layout.len() && vc.len() == layout.len(),
            || "cache buffers do not match their layout".into(),
        )?;
        let mut out = self.empty_f32(q.len())?;
        if rows == 0 || n_heads == 0 {
            return Ok(out);
        }
        let (ds, dp) = (meta.slots, meta.positions);
        let gsz = attention_group(rows, n_heads);
        let subs = (n_heads / n_kv_heads).div_ceil(gsz);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, (n_kv_heads * subs) as u32, 1),
            block_dim: (32 * attention_warps(meta) as u32, 1, 1),
            shared_mem_bytes: (ATTN_WARPS * ATTN_GROUP * (head_dim + 2) * 4) as u32,
        };
        let gi = gsz as i32;
        let (hi, kvi, di) = (n_heads as i32, n_kv_heads as i32, head_dim as i32);
        let (li, si, mi) = (
            layer as i32,
            i32_of(K, "slots", layout.slots)?,
            i32_of(K, "max_len", layout.max_len)?,
        );
        let mut b = self.launch(self.func(kernel)?);
        b.arg(q).arg(kc).arg(vc).out(&mut out);
        arg_bf16_out(&mut b, outb);
        b.arg(&ds).arg(&dp);
        b.arg(&hi)
            .arg(&kvi)
            .arg(&di)
            .arg(&scale)
            .arg(&li)
            .arg(&si)
            .arg(&mi)
            .arg(&gi);
        self.launched(K, unsafe { b.launch(cfg) })?;
        Ok(out)
    }
}

/// Warps per attention block when the longest row ends before `pos_end`: half of them
/// when no row has more than half ATTN_WARPS chunks (the other half would idle at the
/// barrier, holding registers). Measured on an H200 (session 22): 6 warps for 6 chunks was
/// slower than 8 (the combine spreads a group's outputs over fewer threads), 4 for 4 was
/// 10 % faster. The bits do not depend on it (attention.cu).
/// A recorded step (`RowMeta::fixed_shape`) keeps ATTN_WARPS: its replays run at other
/// positions.
fn attention_warps(meta: &RowMeta) -> usize {
    if !meta.fixed_shape && meta.pos_end.div_ceil(ATTN_CHUNK) <= ATTN_WARPS / 2 {
        ATTN_WARPS / 2
    } else {
        ATTN_WARPS
    }
}

/// Query heads per attention block (attention.cu's `gsz`): up to ATTN_GROUP of a KV head's
/// heads share each key and value load once the rows' heads fill the GPU; a few rows get
/// one head per block, four times the blocks for the same work (profiled on an H200 at
/// batch 1: 8 blocks of 8 warps, 12 % achieved occupancy). The bits do not depend on it.
fn attention_group(rows: usize, n_heads: usize) -> usize {
    if rows * n_heads < 512 {
        1
    } else {
        ATTN_GROUP
    }
}
