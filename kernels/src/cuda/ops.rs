//! Typed launch wrappers: shapes are checked here, on the host, before any launch, so a
//! kernel never reads or writes out of bounds because of a caller's mistake.

use cudarc::driver::{CudaFunction, CudaSlice, CudaView, LaunchConfig};

use super::launch::Launch;

use super::{CudaError, GpuDevice};
use crate::cpu::{GumbelDraw, RowStats};

/// f32 device buffer (activations).
pub type DevF32 = CudaSlice<f32>;
/// bf16 device buffer, stored as raw bits (weights, KV cache).
pub type DevBf16 = CudaSlice<u16>;
/// u32 device buffer (token ids, row indices, positions).
pub type DevU32 = CudaSlice<u32>;

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
/// Built once per step (one upload) and read by RoPE, the KV write and attention of every
/// layer; the bounds are checked on the host when it is built.
pub struct RowMeta {
    /// `[slot; rows]` then `[pos; rows]`.
    buf: DevU32,
    rows: usize,
    /// One past the largest slot and position (0 when there are no rows).
    slot_end: usize,
    pos_end: usize,
}

impl RowMeta {
    pub fn rows(&self) -> usize {
        self.rows
    }

    fn slots(&self) -> CudaView<'_, u32> {
        self.buf.slice(0..self.rows)
    }

    fn positions(&self) -> CudaView<'_, u32> {
        self.buf.slice(self.rows..2 * self.rows)
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
        check(kernel, self.slot_end <= layout.slots, || {
            format!(
                "slot {} of a cache with {} slots",
                self.slot_end - 1,
                layout.slots
            )
        })?;
        check(kernel, self.pos_end <= layout.max_len, || {
            format!(
                "position {} beyond the cache length {}",
                self.pos_end - 1,
                layout.max_len
            )
        })
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

    pub fn upload_f32(&self, data: &[f32]) -> Result<DevF32, CudaError> {
        if data.is_empty() {
            return self.zeros_f32(0);
        }
        self.drv("uploading f32 data", self.stream.clone_htod(data))
    }

    pub fn upload_bf16(&self, data: &[half::bf16]) -> Result<DevBf16, CudaError> {
        if data.is_empty() {
            return self.drv("allocating", self.stream.alloc_zeros::<u16>(0));
        }
        let bits: &[u16] = bytemuck::cast_slice(data);
        self.drv("uploading bf16 data", self.stream.clone_htod(bits))
    }

    pub fn upload_u32(&self, data: &[u32]) -> Result<DevU32, CudaError> {
        if data.is_empty() {
            return self.drv("allocating", self.stream.alloc_zeros::<u32>(0));
        }
        self.drv("uploading u32 data", self.stream.clone_htod(data))
    }

    pub fn download_f32(&self, buf: &DevF32) -> Result<Vec<f32>, CudaError> {
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        self.drv("downloading f32 data", self.stream.clone_dtoh(buf))
    }

    pub fn download_bf16(&self, buf: &DevBf16) -> Result<Vec<half::bf16>, CudaError> {
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        let bits = self.drv("downloading bf16 data", self.stream.clone_dtoh(buf))?;
        Ok(bits.into_iter().map(half::bf16::from_bits).collect())
    }

    /// An f32 buffer with undefined contents, for an output that a kernel writes in full:
    /// saves the memset a zeroed buffer costs on every op.
    pub fn empty_f32(&self, len: usize) -> Result<DevF32, CudaError> {
        // SAFETY: f32 has no invalid bit patterns; callers overwrite every element before
        // anything reads it.
        self.drv("allocating f32 buffer", unsafe {
            self.stream.alloc::<f32>(len)
        })
    }

    pub fn zeros_f32(&self, len: usize) -> Result<DevF32, CudaError> {
        self.drv("allocating f32 buffer", self.stream.alloc_zeros::<f32>(len))
    }

    /// A bf16 buffer with undefined contents (see `empty_f32`).
    pub fn empty_bf16(&self, len: usize) -> Result<DevBf16, CudaError> {
        // SAFETY: as in `empty_f32`: raw bits, overwritten in full before they are read.
        self.drv("allocating bf16 buffer", unsafe {
            self.stream.alloc::<u16>(len)
        })
    }

    pub fn zeros_bf16(&self, len: usize) -> Result<DevBf16, CudaError> {
        self.drv(
            "allocating bf16 buffer",
            self.stream.alloc_zeros::<u16>(len),
        )
    }

    pub fn copy_f32(&self, src: &DevF32) -> Result<DevF32, CudaError> {
        self.drv("copying f32 buffer", self.stream.clone_dtod(src))
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
        // SAFETY: u16 bits; f32_to_bf16 writes all m·k values.
        let mut xb = self.drv("allocating bf16 buffer", unsafe {
            self.stream.alloc::<u16>(m * k)
        })?;
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
        draws: &[Option<GumbelDraw>],
    ) -> Result<Vec<RowStats>, CudaError> {
        const K: &str = "row_stats_kernel";
        check(
            K,
            x.len() == rows * cols && vocab <= cols && pick.len() == rows && draws.len() == rows,
            || {
                format!(
                    "{} values as [{rows}, {cols}] with vocab {vocab}, {} picks and {} draws",
                    x.len(),
                    pick.len(),
                    draws.len()
                )
            },
        )?;
        let n_chunks = vocab.div_ceil(RS_CHUNK);
        let n_digests = n_chunks + n_chunks.div_ceil(RS_GROUP);
        check(K, n_digests <= RS_MAX_DIGESTS, || {
            format!("vocab {vocab} needs {n_digests} chunk and group digests, more than {RS_MAX_DIGESTS}")
        })?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        // Per row: the pick, the draw's key, and its flag and inverse temperature.
        let params: Vec<u64> = pick
            .iter()
            .zip(draws)
            .flat_map(|(&p, d)| match d {
                Some(d) => [p as u64, d.key, 1 << 32 | d.inv_t.to_bits() as u64],
                None => [p as u64, 0, 0],
            })
            .collect();
        let dparams = self.drv("uploading row params", self.stream.clone_htod(&params))?;
        let mut of = self.empty_f32(rows * 4)?;
        // SAFETY: u64 has no invalid bit patterns; the kernel writes every element.
        let mut ou = self.drv("allocating u64 buffer", unsafe {
            self.stream.alloc::<u64>(rows * 3)
        })?;
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
            .arg(&dparams)
            .out(&mut of)
            .out(&mut ou);
        self.launched(K, unsafe { b.launch(cfg) })?;
        let f = self.drv("downloading row stats", self.stream.clone_dtoh(&of))?;
        let u = self.drv("downloading row stats", self.stream.clone_dtoh(&ou))?;
        Ok((0..rows)
            .map(|r| RowStats {
                argmax: u[3 * r] as u32,
                max: f[4 * r],
                lse: f[4 * r + 1],
                picked: f[4 * r + 2],
                digest: u[3 * r + 1],
                sampled: u[3 * r + 2] as u32,
                sampled_value: f[4 * r + 3],
            })
            .collect())
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
        check(
            K,
            x.len() == rows * cols && vocab <= cols && ks.len() == rows,
            || {
                format!(
                    "{} values as [{rows}, {cols}] with vocab {vocab} and {} k's",
                    x.len(),
                    ks.len()
                )
            },
        )?;
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
        // SAFETY: plain data; the kernel writes the first out_n[r] entries of each row,
        // and only those are read back.
        let mut idx = self.drv("allocating top-k indices", unsafe {
            self.stream.alloc::<u32>(rows * kmax)
        })?;
        let mut val = self.empty_f32(rows * kmax)?;
        let mut cnt = self.drv("allocating top-k counts", unsafe {
            self.stream.alloc::<u32>(rows)
        })?;
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
        let mut b = self.launch(self.func(K)?);
        b.arg(x)
            .arg(&ci)
            .arg(&vi)
            .arg(&dks)
            .arg(&ki)
            .out(&mut idx)
            .out(&mut val)
            .out(&mut cnt);
        self.launched(K, unsafe { b.launch(cfg) })?;
        let n = self.drv("downloading top-k counts", self.stream.clone_dtoh(&cnt))?;
        let i = self.drv("downloading top-k indices", self.stream.clone_dtoh(&idx))?;
        let v = self.drv("downloading top-k values", self.stream.clone_dtoh(&val))?;
        Ok((0..rows)
            .map(|r| {
                let m = (n[r] as usize).min(kmax);
                (0..m).map(|j| (i[r * kmax + j], v[r * kmax + j])).collect()
            })
            .collect())
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
        const K: &str = "embedding_kernel";
        check(K, cols > 0 && table.len().is_multiple_of(cols), || {
            format!("table has {} values, not rows of {cols}", table.len())
        })?;
        let vocab = table.len() / cols;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(CudaError::Launch {
                kernel: K,
                msg: format!("token id {bad} is out of range for a vocabulary of {vocab}"),
            });
        }
        let mut out = self.empty_f32(ids.len() * cols)?;
        if ids.is_empty() {
            return Ok(out);
        }
        let dids = self.upload_u32(ids)?;
        let (ri, ci) = (i32_of(K, "rows", ids.len())?, i32_of(K, "cols", cols)?);
        let mut b = self.launch(self.func(K)?);
        b.arg(table).arg(&dids).out(&mut out).arg(&ri).arg(&ci);
        self.launched(K, unsafe { b.launch(elementwise_cfg(ids.len() * cols)) })?;
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

    /// Uploads the per-row (slot, position) of a batch in one copy.
    pub fn row_meta(&self, row_slot: &[u32], row_pos: &[u32]) -> Result<RowMeta, CudaError> {
        check("row_meta", row_slot.len() == row_pos.len(), || {
            format!("{} slots for {} positions", row_slot.len(), row_pos.len())
        })?;
        let rows = row_slot.len();
        let end = |v: &[u32]| v.iter().map(|&x| x as usize + 1).max().unwrap_or(0);
        let mut both = Vec::with_capacity(2 * rows);
        both.extend_from_slice(row_slot);
        both.extend_from_slice(row_pos);
        Ok(RowMeta {
            buf: self.upload_u32(&both)?,
            rows,
            slot_end: end(row_slot),
            pos_end: end(row_pos),
        })
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
        let (ds, dp) = (meta.slots(), meta.positions());
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
        check(K, meta.pos_end <= max_pos, || {
            format!(
                "position {} beyond the RoPE table ({max_pos} positions)",
                meta.pos_end - 1
            )
        })?;
        if rows == 0 || n_heads == 0 {
            return Ok(());
        }
        let dp = meta.positions();
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
        check(
            K,
            cos.len() == sin.len() && cos.len() >= meta.pos_end * half,
            || {
                format!(
                    "position {} beyond the RoPE table ({} positions)",
                    meta.pos_end.saturating_sub(1),
                    cos.len() / half
                )
            },
        )?;
        let mut q = self.empty_f32(rows * n_heads * head_dim)?;
        if rows == 0 {
            return Ok(q);
        }
        let (ds, dp) = (meta.slots(), meta.positions());
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
        let (ds, dp) = (meta.slots(), meta.positions());
        let gsz = attention_group(rows, n_heads);
        let subs = (n_heads / n_kv_heads).div_ceil(gsz);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, (n_kv_heads * subs) as u32, 1),
            block_dim: (32 * attention_warps(meta.pos_end) as u32, 1, 1),
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
fn attention_warps(pos_end: usize) -> usize {
    if pos_end.div_ceil(ATTN_CHUNK) <= ATTN_WARPS / 2 {
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
