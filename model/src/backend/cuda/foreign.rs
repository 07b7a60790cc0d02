//! Device memory another library owns — a torch tensor in a trainer's process — used as
//! arbor's activations and weights without a copy, and the ordering between that
//! library's stream and arbor's: the ops of `arbor.torch` on CUDA tensors run the backend's
//! own methods (the same kernels, chosen the same way, as a serving rank's step) on views
//! of the tensors.

use std::sync::{Arc, MutexGuard};

use arbor_kernels::cuda::{DevBf16, DevBuf, DevF32, GpuDevice};
use cudarc::driver::{sys, CudaEvent};

use super::gemm::{tensor_eligible, GemmKind};
use super::kv::Placed;
use super::{CudaAct, CudaBackend, CudaKv, CudaMat};
use crate::backend::{BResult, Backend, BackendError, HeadSpec, KvRows, TreeSpec};

impl CudaBackend {
    /// A world-size-1 backend on GPU `ordinal` for a process that holds the model's tensors
    /// itself (a trainer): the linear layers' kernel chosen as a serving rank chooses it
    /// (`ARBOR_GEMM`, else by the GPU's architecture), invariant numerics, no recorded steps.
    pub fn for_foreign_tensors(ordinal: usize) -> Result<Self, BackendError> {
        let err = |msg: String| BackendError::Device { rank: 0, msg };
        let kind = GemmKind::from_env().map_err(err)?;
        let dev = GpuDevice::open(ordinal).map_err(|e| err(e.to_string()))?;
        let gemm = super::load::linear_kernel(&dev, kind, 0).map_err(err)?;
        let mut backend = Self::solo(Arc::new(dev));
        backend.gemm = gemm;
        Ok(backend)
    }

    /// The CUDA ordinal of this backend's GPU.
    pub fn ordinal(&self) -> usize {
        self.dev.ordinal
    }

    /// A view of the f32 values `[rows, cols]` at device address `ptr` as an activation.
    ///
    /// # Safety
    /// `ptr` addresses `rows·cols` f32 values on this backend's GPU that stay allocated,
    /// and are written by no other work, while the view and the kernels reading it live.
    pub unsafe fn borrow_act(&self, ptr: u64, rows: usize, cols: usize) -> CudaAct {
        self.act(
            DevBuf::borrowed(&self.dev.stream, ptr, rows * cols),
            rows,
            cols,
        )
    }

    /// [`CudaBackend::borrow_act`] with its values rounded to bf16 at `bf16_ptr` (the
    /// companion a GEMM reads instead of converting `ptr`'s values itself).
    ///
    /// # Safety
    /// As [`CudaBackend::borrow_act`], for both; the bf16 values are exactly `bf16(x)`.
    pub unsafe fn borrow_act_with_bf16(
        &self,
        ptr: u64,
        bf16_ptr: u64,
        rows: usize,
        cols: usize,
    ) -> CudaAct {
        let bf16 = DevBuf::borrowed(&self.dev.stream, bf16_ptr, rows * cols);
        self.act_with_bf16(
            DevBuf::borrowed(&self.dev.stream, ptr, rows * cols),
            rows,
            cols,
            Some(bf16),
        )
    }

    /// A view of the bf16 weight `[n, k]` at device address `ptr`.
    ///
    /// # Safety
    /// As [`CudaBackend::borrow_act`], for `n·k` bf16 values.
    pub unsafe fn borrow_mat(&self, ptr: u64, n: usize, k: usize) -> CudaMat {
        CudaMat {
            buf: DevBuf::borrowed(&self.dev.stream, ptr, n * k),
            n,
            k,
        }
    }

    /// Copies `a` into the `rows·cols` f32 values at device address `dst`, on arbor's
    /// stream.
    ///
    /// # Safety
    /// `dst` addresses that many f32 values on this GPU, allocated and used by no other
    /// work until the copy has run (order the owner's stream after it with
    /// [`CudaBackend::release_to_stream`]).
    pub unsafe fn copy_act_to(&self, a: &CudaAct, dst: u64) -> BResult<()> {
        let n = a.rows * a.cols;
        if n == 0 {
            return Ok(());
        }
        let mut out = DevBuf::<f32>::borrowed(&self.dev.stream, dst, n);
        self.dev
            .stream
            .memcpy_dtod(&*a.buf, &mut *out)
            .map_err(|e| self.dev_err_msg("copying an activation out", e))
    }

    /// `dst` (f32 `[rows, cols]`) as the output buffer of an op.
    unsafe fn lent_f32(&self, dst: u64, len: usize) -> DevF32 {
        DevBuf::borrowed(&self.dev.stream, dst, len)
    }

    /// `dst` (bf16 values) as the bf16 companion an op writes.
    unsafe fn lent_bf16(&self, dst: Option<u64>, len: usize) -> Option<DevBf16> {
        dst.map(|p| DevBuf::borrowed(&self.dev.stream, p, len))
    }

    /// [`Backend::matmul`] written at `dst` (`[x.rows, w.n]` f32): the tensor GEMM writes
    /// there itself, the other kernels' results are copied there. The bits are `matmul`'s.
    ///
    /// # Safety
    /// As [`CudaBackend::copy_act_to`], for `x.rows·w.n` f32 values.
    pub unsafe fn matmul_to(
        &self,
        x: &CudaAct,
        w: &CudaMat,
        tree: TreeSpec,
        dst: u64,
    ) -> BResult<()> {
        self.check_matmul(x, w)?;
        let out = self.lent_f32(dst, x.rows * w.n);
        self.timed("matmul (into)", x.rows, || {
            self.matmul_untimed_into(x, w, tree, Some(out))
        })?;
        Ok(())
    }

    /// `silu(gate)·up` of `x · wᵀ` whose weight rows alternate gate and up (the engine's
    /// gate/up layout), written at `dst` (`[x.rows, w.n/2]` f32) and, rounded to bf16, at
    /// `dst_bf16` when given: [`Backend::matmul_silu_mul`]'s bits (the GEMM's epilogue
    /// where the kernel has it, else the GEMM then `silu_mul_pairs`).
    ///
    /// # Safety
    /// As [`CudaBackend::copy_act_to`], for `x.rows·w.n/2` f32 values at `dst` and bf16
    /// values at `dst_bf16`.
    pub unsafe fn matmul_silu_mul_to(
        &self,
        x: &CudaAct,
        w: &CudaMat,
        tree: TreeSpec,
        dst: u64,
        dst_bf16: Option<u64>,
    ) -> BResult<()> {
        self.check_matmul(x, w)?;
        if !w.n.is_multiple_of(2) {
            return Err(self.shape_err(format!("gate/up weight of {} rows: odd", w.n)));
        }
        let len = x.rows * w.n / 2;
        if let Some(g) = self
            .gemm
            .as_ref()
            .filter(|_| self.blas.is_none() && tensor_eligible(tree))
        {
            let mut outb = self.lent_bf16(dst_bf16, len);
            let done = self.timed("matmul+silu (into)", x.rows, || {
                self.gemm_silu_mul(g, x, w, tree, outb.as_mut(), Some(self.lent_f32(dst, len)))
            })?;
            if done.is_some() {
                return Ok(());
            }
        }
        let gu = self.matmul(x, w, tree)?;
        self.silu_mul_pairs_to(&gu, dst, dst_bf16)
    }

    fn check_matmul(&self, x: &CudaAct, w: &CudaMat) -> BResult<()> {
        if x.cols != w.k {
            return Err(self.shape_err(format!(
                "matmul of x [{}, {}] with w [{}, {}]",
                x.rows, x.cols, w.n, w.k
            )));
        }
        Ok(())
    }

    /// [`Backend::rms_norm`] written at `dst` (f32, `x`'s shape) and its bf16 rounding at
    /// `dst_bf16` when given (the companion a following GEMM reads).
    ///
    /// # Safety
    /// As [`CudaBackend::copy_act_to`], for `x`'s size in f32 at `dst` and in bf16 at
    /// `dst_bf16`.
    pub unsafe fn rms_norm_to(
        &self,
        x: &CudaAct,
        weight: &CudaAct,
        eps: f32,
        dst: u64,
        dst_bf16: Option<u64>,
    ) -> BResult<()> {
        let len = x.rows * x.cols;
        let mut outb = self.lent_bf16(dst_bf16, len);
        let out = self.lent_f32(dst, len);
        self.timed("rms_norm (into)", x.rows, || {
            self.dev
                .rms_norm_into(
                    &x.buf,
                    x.rows,
                    x.cols,
                    &weight.buf,
                    eps,
                    Some(out),
                    outb.as_mut(),
                )
                .map_err(|e| self.dev_err(e))
        })?;
        Ok(())
    }

    /// [`Backend::silu_mul`] written at `dst` (f32, `gate`'s shape).
    ///
    /// # Safety
    /// As [`CudaBackend::copy_act_to`], for `gate`'s size.
    pub unsafe fn silu_mul_to(&self, gate: &CudaAct, up: &CudaAct, dst: u64) -> BResult<()> {
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return Err(self.shape_err(format!(
                "silu_mul of gate [{}, {}] and up [{}, {}]",
                gate.rows, gate.cols, up.rows, up.cols
            )));
        }
        let out = self.lent_f32(dst, gate.rows * gate.cols);
        self.timed("silu_mul (into)", gate.rows, || {
            self.dev
                .silu_mul_into(&gate.buf, &up.buf, Some(out))
                .map_err(|e| self.dev_err(e))
        })?;
        Ok(())
    }

    /// [`Backend::silu_mul_pairs`] (gate and up columns alternating in `gu`) written at
    /// `dst` (f32 `[gu.rows, gu.cols/2]`) and its bf16 rounding at `dst_bf16` when given.
    ///
    /// # Safety
    /// As [`CudaBackend::copy_act_to`], for half of `gu`'s size in f32 at `dst` and in
    /// bf16 at `dst_bf16`.
    pub unsafe fn silu_mul_pairs_to(
        &self,
        gu: &CudaAct,
        dst: u64,
        dst_bf16: Option<u64>,
    ) -> BResult<()> {
        if !gu.cols.is_multiple_of(2) {
            return Err(self.shape_err(format!(
                "silu_mul_pairs of [{}, {}]: odd column count",
                gu.rows, gu.cols
            )));
        }
        let inter = gu.cols / 2;
        let mut outb = self.lent_bf16(dst_bf16, gu.rows * inter);
        let out = self.lent_f32(dst, gu.rows * inter);
        self.timed("silu_mul_pairs (into)", gu.rows, || {
            self.dev
                .silu_mul_pairs_into(&gu.buf, gu.rows, inter, Some(out), outb.as_mut())
                .map_err(|e| self.dev_err(e))
        })?;
        Ok(())
    }

    /// [`Backend::attention`] written at `dst` (f32, `q`'s shape) and its bf16 rounding at
    /// `dst_bf16` when given.
    ///
    /// # Safety
    /// As [`CudaBackend::copy_act_to`], for `q`'s size in f32 at `dst` and in bf16 at
    /// `dst_bf16`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attention_to(
        &self,
        q: &CudaAct,
        cache: &CudaKv,
        layer: usize,
        rows: KvRows<'_>,
        heads: HeadSpec,
        dst: u64,
        dst_bf16: Option<u64>,
    ) -> BResult<()> {
        let mut meta = self.step_meta(rows.seqs, Some(rows.table), q.rows)?;
        let meta = meta
            .as_mut()
            .ok_or_else(|| self.shape_err("row map missing after upload".into()))?;
        let len = q.rows * q.cols;
        let out = Placed {
            f32: self.lent_f32(dst, len),
            bf16: self.lent_bf16(dst_bf16, len),
        };
        self.timed("attention (into)", q.rows, || {
            self.attention_untimed_into(q, cache, layer, meta, heads, Some(out))
        })?;
        Ok(())
    }

    /// The row statistics of `logits` (`[rows, cols]`, the first `vocab` columns) with
    /// the parameters and results in device memory, nothing read back:
    /// `GpuDevice::row_stats_raw`, the kernel [`Backend::row_stats`] runs, so the same bits.
    /// `params`: 3 u64 per row (`row_stats_params`); the kernel writes `ROW_STATS_F32`
    /// f32 per row at `out_f` and `ROW_STATS_U64` u64 per row at `out_u`.
    ///
    /// # Safety
    /// The three addresses are device memory of this GPU holding `logits.rows` rows each,
    /// 8-byte aligned, used by no other work until the kernel has run.
    pub unsafe fn row_stats_to(
        &self,
        logits: &CudaAct,
        vocab: usize,
        params: u64,
        out_f: u64,
        out_u: u64,
    ) -> BResult<()> {
        self.timed("row_stats (into)", logits.rows, || {
            self.dev
                .row_stats_raw(
                    &logits.buf,
                    logits.rows,
                    logits.cols,
                    vocab,
                    params,
                    out_f,
                    out_u,
                )
                .map_err(|e| self.dev_err(e))
        })
    }

    /// The events ordering arbor's stream with a foreign one, made on first use.
    fn handoff_events(&self) -> BResult<MutexGuard<'_, Option<[CudaEvent; 2]>>> {
        let mut g = self.handoff.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            let make = || {
                self.dev
                    .ctx
                    .new_event(None)
                    .map_err(|e| self.dev_err_msg("creating an event", e))
            };
            *g = Some([make()?, make()?]);
        }
        Ok(g)
    }

    /// Work queued on arbor's stream from now on runs after the work queued so far on the
    /// stream `foreign` (a raw `CUstream`, e.g. `torch.cuda.current_stream().cuda_stream`).
    pub fn wait_for_stream(&self, foreign: u64) -> BResult<()> {
        let events = self.handoff_events()?;
        let Some([ev, _]) = events.as_ref() else {
            return Err(self.shape_err("stream events missing after creation".into()));
        };
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(|e| self.dev_err_msg("binding the context", e))?;
        // SAFETY: `ev` is a live event of this context; `foreign` is a stream handle of the
        // same context, valid for the caller's call.
        unsafe { sys::cuEventRecord(ev.cu_event(), foreign as sys::CUstream) }
            .result()
            .map_err(|e| self.dev_err_msg("recording an event on the caller's stream", e))?;
        self.dev
            .stream
            .wait(ev)
            .map_err(|e| self.dev_err_msg("waiting for the caller's stream", e))
    }

    /// Work queued on the stream `foreign` from now on runs after the work queued so far
    /// on arbor's stream (so the owner may free or rewrite the memory it lent).
    pub fn release_to_stream(&self, foreign: u64) -> BResult<()> {
        let events = self.handoff_events()?;
        let Some([_, ev]) = events.as_ref() else {
            return Err(self.shape_err("stream events missing after creation".into()));
        };
        ev.record(&self.dev.stream)
            .map_err(|e| self.dev_err_msg("recording an event", e))?;
        // SAFETY: as in `wait_for_stream`; the wait takes the event's state now, so
        // re-recording it later does not touch this wait.
        unsafe { sys::cuStreamWaitEvent(foreign as sys::CUstream, ev.cu_event(), 0) }
            .result()
            .map_err(|e| self.dev_err_msg("making the caller's stream wait", e))
    }
}
