//! RMSNorm, alone and after the residual add.

use cudarc::driver::LaunchConfig;

use super::{arg_bf16_out, check, check_bf16_out, i32_of, output, DevBf16, DevF32};
use crate::cuda::{CudaError, GpuDevice};

const NORM_THREADS: u32 = 256;
/// Rows per block of `rms_norm_warp_kernel` (one warp each).
const NORM_WARP_ROWS: usize = 8;

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
        self.rms_norm_into(x, rows, cols, weight, eps, None, outb)
    }

    /// [`GpuDevice::rms_norm`] written into `out` when given (`[rows, cols]`).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_into(
        &self,
        x: &DevF32,
        rows: usize,
        cols: usize,
        weight: &DevF32,
        eps: f32,
        out: Option<DevF32>,
        outb: Option<&mut DevBf16>,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "rms_norm_kernel";
        check(K, x.len() == rows * cols, || {
            format!("x has {} values, expected {rows}×{cols}", x.len())
        })?;
        let cfg = norm_launch(K, rows, cols, weight, &outb)?;
        let mut out = output(self, K, out, rows * cols)?;
        if rows == 0 || cols == 0 {
            return Ok(out);
        }
        let ci = i32_of(K, "cols", cols)?;
        if cols.is_multiple_of(4) && cols <= 4 * 32 {
            // Narrow rows (attention heads): a warp per row, the same bits (norm.cu).
            const W: &str = "rms_norm_warp_kernel";
            let r = rows as i64;
            let mut b = self.launch(self.func(W)?);
            b.arg(x).arg(weight).out(&mut out);
            arg_bf16_out(&mut b, outb);
            b.arg(&r).arg(&ci).arg(&eps);
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(NORM_WARP_ROWS) as u32, 1, 1),
                block_dim: (32 * NORM_WARP_ROWS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launched(W, unsafe { b.launch(cfg) })?;
            return Ok(out);
        }
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
}
