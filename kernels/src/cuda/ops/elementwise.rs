//! Element-wise ops: SiLU·mul, the row bias, the residual add.

use super::{
    arg_bf16_out, check, check_bf16_out, elementwise_cfg, i32_of, output, DevBf16, DevF32,
};
use crate::cuda::{CudaError, GpuDevice};

impl GpuDevice {
    pub fn silu_mul(&self, gate: &DevF32, up: &DevF32) -> Result<DevF32, CudaError> {
        self.silu_mul_into(gate, up, None)
    }

    /// [`GpuDevice::silu_mul`] written into `out` when given (`gate`'s length).
    pub fn silu_mul_into(
        &self,
        gate: &DevF32,
        up: &DevF32,
        out: Option<DevF32>,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "silu_mul_kernel";
        check(K, gate.len() == up.len(), || {
            format!("gate has {} values, up {}", gate.len(), up.len())
        })?;
        let count = gate.len();
        let mut out = output(self, K, out, count)?;
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
        self.silu_mul_pairs_into(gu, rows, inter, None, outb)
    }

    /// [`GpuDevice::silu_mul_pairs`] written into `out` when given (`[rows, inter]`).
    pub fn silu_mul_pairs_into(
        &self,
        gu: &DevF32,
        rows: usize,
        inter: usize,
        out: Option<DevF32>,
        outb: Option<&mut DevBf16>,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "silu_mul_pairs_kernel";
        check_bf16_out(K, &outb, rows * inter)?;
        check(K, gu.len() == rows * 2 * inter, || {
            format!("gate/up has {} values, expected {rows}×2×{inter}", gu.len())
        })?;
        let mut out = output(self, K, out, rows * inter)?;
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

/// The element type of a tensor [`GpuDevice::cut_to_bf16`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceType {
    Bf16,
    F16,
    F32,
}

impl SourceType {
    pub fn size(self) -> usize {
        match self {
            SourceType::Bf16 | SourceType::F16 => 2,
            SourceType::F32 => 4,
        }
    }

    fn code(self) -> i32 {
        match self {
            SourceType::Bf16 => 0,
            SourceType::F16 => 1,
            SourceType::F32 => 2,
        }
    }
}

/// Where [`GpuDevice::cut_to_bf16`] reads: a `[*, k]` tensor of `dtype` whose bytes
/// start `src`.
pub struct CutSource<'a> {
    pub src: &'a cudarc::driver::CudaView<'a, u8>,
    pub dtype: SourceType,
    pub k: usize,
}

/// Where [`GpuDevice::cut_to_bf16`] writes: row `r` of the block lands at row
/// `row0 + r·step` of the `[*, k]` matrix `dst`.
pub struct CutDest<'a> {
    pub dst: &'a mut DevBf16,
    pub k: usize,
    pub row0: usize,
    pub step: usize,
}

impl GpuDevice {
    /// Rows `rows` × columns `cols` of `src`, converted to bf16 as the host converts
    /// (`half::bf16::from_f32` of the exact value), written into `to`. The smallest flat
    /// source index of a value that is not finite in bf16 is folded into `first_bad` by a
    /// minimum (set it to `u64::MAX` first).
    pub fn cut_to_bf16(
        &self,
        from: &CutSource<'_>,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        to: CutDest<'_>,
        first_bad: &mut cudarc::driver::CudaViewMut<'_, u64>,
    ) -> Result<(), CudaError> {
        const K: &str = "cut_to_bf16_kernel";
        let (n_rows, width) = (rows.len(), cols.len());
        check(K, cols.end <= from.k && width <= to.k, || {
            format!(
                "columns {cols:?} of a source of {} columns into a matrix of {}",
                from.k, to.k
            )
        })?;
        let src_need = if n_rows == 0 {
            0
        } else {
            ((rows.end - 1) * from.k + cols.end) * from.dtype.size()
        };
        check(K, src_need <= from.src.len(), || {
            format!(
                "rows {rows:?} × columns {cols:?} of [*, {}] {:?} need {src_need} bytes, the source holds {}",
                from.k,
                from.dtype,
                from.src.len()
            )
        })?;
        let dst_need = if n_rows == 0 {
            0
        } else {
            (to.row0 + (n_rows - 1) * to.step) * to.k + width
        };
        check(K, dst_need <= to.dst.len(), || {
            format!(
                "{n_rows} rows from row {} every {} of [*, {}] need {dst_need} values, the matrix holds {}",
                to.row0,
                to.step,
                to.k,
                to.dst.len()
            )
        })?;
        check(K, first_bad.len() == 1, || {
            format!("{} flags for one block", first_bad.len())
        })?;
        let count = n_rows * width;
        if count == 0 {
            return Ok(());
        }
        use cudarc::driver::DevicePtr;
        let addr = from.src.device_ptr(&self.stream).0;
        let aligned = i32::from(addr.is_multiple_of(from.dtype.size() as u64));
        let as_i64 = |v: usize| v as i64;
        // At most 2^20 blocks: the kernel strides over the rest.
        let mut cfg = super::elementwise_cfg(count);
        cfg.grid_dim.0 = cfg.grid_dim.0.min(1 << 20);
        let mut b = self.launch(self.func(K)?);
        b.arg(from.src)
            .arg(&from.dtype.code())
            .arg(&aligned)
            .arg(&as_i64(from.k))
            .arg(&as_i64(rows.start))
            .arg(&as_i64(cols.start))
            .arg(&as_i64(n_rows))
            .arg(&as_i64(width))
            .out(to.dst)
            .arg(&as_i64(to.k))
            .arg(&as_i64(to.row0))
            .arg(&as_i64(to.step))
            .out(first_bad);
        self.launched(K, unsafe { b.launch(cfg) })
    }
}
