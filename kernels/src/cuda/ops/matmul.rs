//! The simple tree matmul (any shape; the tensor-core GEMM is `cuda::gemm`) and the tree
//! combine of segment partials.

use cudarc::driver::{CudaView, LaunchConfig};

use super::{check, elementwise_cfg, i32_of, DevBf16, DevF32};
use crate::cuda::{CudaError, GpuDevice};

/// Rows of a matmul handled per launch: bounds the segment-partials buffer
/// (`n_seg × rows × n` f32) whatever M is. Each row's arithmetic does not depend on it.
const MM_ROW_CHUNK: usize = 256;
const MM_ROWS_PER_WARP_TILE: usize = 8;
const MM_WARPS_PER_BLOCK: usize = 8;

impl GpuDevice {
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
}
