//! The ops behind `Backend`'s methods (which wrap them in the profiler): matmul (the
//! tensor GEMM, cuBLAS, or the simple kernel), element-wise ops, RoPE.

use arbor_kernels::cpu::RopeTable;
use arbor_kernels::cuda::cublas::Blas;
use arbor_kernels::cuda::gemm::OutDtype;
use arbor_kernels::cuda::{DevF32, RowMeta};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::gemm::{tensor_eligible, GemmOut};
use super::{CudaAct, CudaBackend, CudaMat};
use crate::backend::{BResult, BackendError, TreeSpec};

/// The RoPE table's copy on the device, keyed by the host table it came from.
pub(super) struct RopeDev {
    key: (usize, usize, usize, usize),
    pub(super) cos: DevF32,
    pub(super) sin: DevF32,
}

impl CudaBackend {
    pub(super) fn matmul_untimed(
        &self,
        x: &CudaAct,
        w: &CudaMat,
        tree: TreeSpec,
    ) -> BResult<CudaAct> {
        self.matmul_untimed_into(x, w, tree, None)
    }

    /// `matmul_untimed` with its result in `dst` when given (`[x.rows, w.n]` f32): the
    /// tensor GEMM writes there itself; the other kernels' results are copied there.
    pub(super) fn matmul_untimed_into(
        &self,
        x: &CudaAct,
        w: &CudaMat,
        tree: TreeSpec,
        dst: Option<DevF32>,
    ) -> BResult<CudaAct> {
        if let Some(blas) = &self.blas {
            let y = self.blas_matmul(blas, x, w)?;
            return self.placed(y, dst);
        }
        if let Some(g) = self.gemm.as_ref().filter(|_| tensor_eligible(tree)) {
            let buf = self
                .tensor_gemm(g, "matmul", x, w, tree, GemmOut::Roots, dst)?
                .ok_or_else(|| self.gemm_err("matmul", x, w, "no output"))?;
            return Ok(self.act(buf, x.rows, w.n));
        }
        let buf = self
            .dev
            .tree_matmul(
                &x.buf,
                x.rows,
                x.cols,
                &w.buf,
                w.n,
                tree.seg_len,
                tree.n_seg,
            )
            .map_err(|e| self.dev_err(e))?;
        self.placed(self.act(buf, x.rows, w.n), dst)
    }

    /// `a`, copied into `dst` when given (an op whose kernel allocates its own output).
    fn placed(&self, a: CudaAct, dst: Option<DevF32>) -> BResult<CudaAct> {
        let Some(mut dst) = dst else {
            return Ok(a);
        };
        if dst.len() != a.buf.len() {
            return Err(self.shape_err(format!(
                "output of {} values for [{}, {}]",
                dst.len(),
                a.rows,
                a.cols
            )));
        }
        if !dst.is_empty() {
            self.dev
                .stream
                .memcpy_dtod(&*a.buf, &mut *dst)
                .map_err(|e| self.dev_err_msg("copying an output into place", e))?;
        }
        Ok(CudaAct {
            buf: dst,
            rows: a.rows,
            cols: a.cols,
            bf16: None,
        })
    }

    /// `--numerics fast`: Y = bf16(X)·Wᵀ by cuBLAS, f32 out.
    fn blas_matmul(&self, blas: &Blas, x: &CudaAct, w: &CudaMat) -> BResult<CudaAct> {
        let d = &self.dev;
        let mut y = d.empty_f32(x.rows * w.n).map_err(|e| self.dev_err(e))?;
        if x.rows == 0 || w.n == 0 {
            return Ok(self.act(y, x.rows, w.n));
        }
        let converted;
        let xb = match &x.bf16 {
            Some(b) => b,
            None => {
                let mut b = d.empty_bf16(x.rows * x.cols).map_err(|e| self.dev_err(e))?;
                d.f32_to_bf16_into(&x.buf, &mut b)
                    .map_err(|e| self.dev_err(e))?;
                converted = b;
                &converted
            }
        };
        let s = &d.stream;
        {
            let (xp, _gx) = xb.device_ptr(s);
            let (wp, _gw) = w.buf.device_ptr(s);
            let (yp, _gy) = y.device_ptr_mut(s);
            // SAFETY: xb is [rows, cols] bf16, w [n, k] bf16 with k == cols (checked by the
            // caller), y [rows, n] f32, all live on this stream.
            unsafe { blas.gemm(x.rows, w.n, x.cols, xp, wp, yp, OutDtype::F32) }.map_err(
                |msg| BackendError::Device {
                    rank: self.comm.rank(),
                    msg,
                },
            )?;
        }
        Ok(self.act(y, x.rows, w.n))
    }

    pub(super) fn add_row_bias_untimed(&self, x: &mut CudaAct, bias: &CudaAct) -> BResult<()> {
        if bias.rows * bias.cols != x.cols {
            return Err(self.shape_err(format!(
                "bias of {} values for {} columns",
                bias.rows * bias.cols,
                x.cols
            )));
        }
        if x.rows == 0 {
            return Ok(());
        }
        let (d, b) = (&self.dev, &bias.buf);
        x.bf16 = None;
        d.add_row_bias(&mut x.buf, b).map_err(|e| self.dev_err(e))
    }

    pub(super) fn add_assign_untimed(&self, x: &mut CudaAct, y: &CudaAct) -> BResult<()> {
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(self.shape_err(format!(
                "add of [{}, {}] and [{}, {}]",
                x.rows, x.cols, y.rows, y.cols
            )));
        }
        let d = &self.dev;
        x.bf16 = None;
        d.add_assign(&mut x.buf, &y.buf)
            .map_err(|e| self.dev_err(e))
    }

    pub(super) fn silu_mul_untimed(&self, gate: &CudaAct, up: &CudaAct) -> BResult<CudaAct> {
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return Err(self.shape_err(format!(
                "silu_mul of gate [{}, {}] and up [{}, {}]",
                gate.rows, gate.cols, up.rows, up.cols
            )));
        }
        let buf = self
            .dev
            .silu_mul(&gate.buf, &up.buf)
            .map_err(|e| self.dev_err(e))?;
        Ok(self.act(buf, gate.rows, gate.cols))
    }

    pub(super) fn rope_tables(
        &self,
        table: &RopeTable,
    ) -> BResult<std::sync::MutexGuard<'_, Option<RopeDev>>> {
        // The model keeps one table for its lifetime; key on its identity and shape.
        let key = (
            table.cos.as_ptr() as usize,
            table.cos.len(),
            table.max_pos,
            table.head_dim,
        );
        let mut guard = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().map(|r| r.key) != Some(key) {
            let cos = self
                .dev
                .upload_f32(&table.cos)
                .map_err(|e| self.dev_err(e))?;
            let sin = self
                .dev
                .upload_f32(&table.sin)
                .map_err(|e| self.dev_err(e))?;
            *guard = Some(RopeDev { key, cos, sin });
        }
        Ok(guard)
    }

    pub(super) fn rope_untimed(
        &self,
        x: &mut CudaAct,
        meta: &RowMeta,
        n_heads: usize,
        table: &RopeTable,
    ) -> BResult<()> {
        if x.cols != n_heads * table.head_dim {
            return Err(self.shape_err(format!(
                "rope on {} columns for {n_heads} heads of {}",
                x.cols, table.head_dim
            )));
        }
        let tables = self.rope_tables(table)?;
        let Some(t) = tables.as_ref() else {
            return Err(self.shape_err("RoPE table missing after upload".into()));
        };
        let half = table.head_dim / 2;
        if half == 0 {
            return Ok(());
        }
        x.bf16 = None;
        self.dev
            .rope(
                &mut x.buf,
                &t.cos,
                &t.sin,
                half,
                meta,
                n_heads,
                table.head_dim,
            )
            .map_err(|e| self.dev_err(e))
    }
}
