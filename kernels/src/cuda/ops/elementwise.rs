//! Element-wise ops: SiLU·mul, the row bias, the residual add.

use super::{arg_bf16_out, check, check_bf16_out, elementwise_cfg, i32_of, DevBf16, DevF32};
use crate::cuda::{CudaError, GpuDevice};

impl GpuDevice {
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
}
