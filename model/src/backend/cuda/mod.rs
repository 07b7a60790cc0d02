//! CUDA backend: device buffers, the NVRTC kernels of `arbor_kernels::cuda`, and the GPU
//! collective (NCCL all-gather of f32 subtree roots + the fixed tree as a GPU kernel).
//!
//! Each rank takes GPU `LOCAL_RANK` (else its rank), counted as the driver counts, i.e.
//! relative to `CUDA_VISIBLE_DEVICES`; with `ARBOR_RANKS_PER_GPU=N` (`arbor-launch
//! --ranks-per-gpu`) N ranks share each GPU and the collectives go through the host
//! (`arbor_collective::device_map`, `arbor_collective::gpu::staged`). Every kernel fixes each output element's order of
//! roundings independently of rows, TP and launch shape, so the contract's invariances hold
//! on the GPU as on the CPU; the two backends agree within bf16 tolerance only.
//!
//! Here: the device types and the `Backend` impl, each method an op wrapped in the
//! profiler. Opening the device is load.rs; the ops ops.rs, the KV cache and attention
//! kv.rs, the TP collectives collective.rs; `run_step` (inputs up once, outputs down once,
//! decode steps replayed from CUDA graphs) run_step.rs, with the step buffers' layouts in
//! step.rs and the recordings in graphs.rs; the tensor-core GEMM gemm.rs.

mod collective;
mod foreign;
pub mod gemm;
pub mod graphs;
mod ipc;
mod kv;
mod load;
mod moe;
mod ops;
mod profile;
mod received;
mod run_step;
pub mod step;
mod weights_group;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arbor_collective::device_map::DeviceSlot;
use arbor_collective::gpu::{Algo, GpuCollective};
use arbor_collective::Communicator;
use arbor_kernels::cpu::RopeTable;
use arbor_kernels::cuda::cublas::Blas;
use arbor_kernels::cuda::upload_ring::RowsUploadError;
use arbor_kernels::cuda::{CudaError, DevBf16, DevF32, GpuDevice};

use super::{
    BResult, Backend, BackendError, HeadSpec, KvRows, KvSpec, RowFill, SeqRows, StepForward,
    StepInputs, StepResults, TreeSpec, WantRow,
};
use gemm::{tensor_eligible, GemmKind, GemmOut, TensorGemm};
use graphs::{Graphs, Key};
pub use kv::CudaKv;
use ops::RopeDev;
use profile::Profiler;

use crate::error::{MResult, ModelError};
use step::StepMeta;

/// f32 activations `[rows, cols]` on the GPU.
pub struct CudaAct {
    buf: DevF32,
    rows: usize,
    cols: usize,
    /// The same values rounded to bf16, written by the kernel that produced `buf` when a
    /// GEMM will read them (norms, SiLU·mul, attention): the GEMM then skips its own
    /// conversion pass. Always exactly `bf16(buf)`.
    bf16: Option<DevBf16>,
}

/// bf16 weight `[n, k]` on the GPU.
pub struct CudaMat {
    buf: DevBf16,
    n: usize,
    k: usize,
}

pub struct CudaBackend {
    comm: Arc<dyn Communicator>,
    /// This rank's GPU and how many ranks of this host share it.
    slot: DeviceSlot,
    dev: Arc<GpuDevice>,
    /// The TP group's GPU collective (None at world size 1).
    coll: Option<GpuCollective>,
    algo: Algo,
    rope: Mutex<Option<RopeDev>>,
    /// The tensor-core GEMM when the choice resolves to `tensor` (the default on sm_80+;
    /// None: the simple kernel only).
    gemm: Option<TensorGemm>,
    /// `--numerics fast`: cuBLAS for every matmul and NCCL's all-reduce.
    blas: Option<Blas>,
    /// The current step's inputs on the device (step.rs).
    meta: Mutex<Option<StepMeta>>,
    /// Decode steps recorded as CUDA graphs (graphs.rs).
    graphs: Mutex<Graphs>,
    /// `ARBOR_PROFILE=1`: per-op device time (synchronising around every op).
    prof: Option<Profiler>,
    /// Activations read back to the host so far. A decode step whose first run reads
    /// some (a mixture-of-experts layer that routes its rows on the host) is never
    /// recorded: a replay would repeat the first step's host decisions (graphs.rs).
    host_reads: AtomicU64,
    /// The two events that order arbor's stream with a foreign one (foreign.rs), made on
    /// first use and re-recorded by every call: a wait takes the event's state when it is
    /// queued, so one event per direction serves every op.
    handoff: Mutex<Option<[cudarc::driver::CudaEvent; 2]>>,
}

impl CudaBackend {
    /// Whether decode steps are recorded as CUDA graphs (`ARBOR_CUDA_GRAPHS`, off while
    /// profiling).
    pub fn records_steps(&self) -> bool {
        self.graphs().enabled
    }

    /// Turns recording on or off (off while profiling); turning it off drops the
    /// recordings.
    pub fn set_recording(&self, on: bool) {
        let mut g = self.graphs();
        g.enabled = on && self.prof.is_none();
        if !g.enabled {
            g.clear();
        }
    }

    fn graphs(&self) -> MutexGuard<'_, Graphs> {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Which GEMM kernel this backend's linear layers use where they can.
    pub fn gemm_kind(&self) -> GemmKind {
        match self.gemm {
            Some(_) => GemmKind::Tensor,
            None => GemmKind::Simple,
        }
    }

    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.dev
    }

    /// This rank's GPU and the ranks of this host on it: a rank may plan for
    /// 1 / `ranks_on_device` of the device's memory (e.g. when sizing the KV cache).
    pub fn device_slot(&self) -> DeviceSlot {
        self.slot
    }

    /// Whether the TP group's collectives are staged through the host because ranks
    /// share a GPU.
    pub fn collectives_staged(&self) -> bool {
        self.coll.as_ref().is_some_and(GpuCollective::shared)
    }

    fn dev_err(&self, e: CudaError) -> BackendError {
        BackendError::Device {
            rank: self.comm.rank(),
            msg: e.to_string(),
        }
    }

    fn dev_err_msg(&self, what: &str, e: cudarc::driver::DriverError) -> BackendError {
        BackendError::Device {
            rank: self.comm.rank(),
            msg: format!("{what}: {e:?}"),
        }
    }

    /// A tensor-GEMM failure, naming the op and its operands' shapes.
    fn gemm_err(
        &self,
        op: &str,
        x: &CudaAct,
        w: &CudaMat,
        e: impl std::fmt::Display,
    ) -> BackendError {
        BackendError::Device {
            rank: self.comm.rank(),
            msg: format!(
                "{op} of x [{}, {}] with w [{}, {}]: {e}",
                x.rows, x.cols, w.n, w.k
            ),
        }
    }

    fn shape_err(&self, msg: String) -> BackendError {
        BackendError::Shape(format!("rank {} (cuda): {msg}", self.comm.rank()))
    }

    fn act(&self, buf: DevF32, rows: usize, cols: usize) -> CudaAct {
        CudaAct {
            buf,
            rows,
            cols,
            bf16: None,
        }
    }

    fn act_with_bf16(
        &self,
        buf: DevF32,
        rows: usize,
        cols: usize,
        bf16: Option<DevBf16>,
    ) -> CudaAct {
        CudaAct {
            bf16,
            ..self.act(buf, rows, cols)
        }
    }

    /// A bf16 companion buffer of `[rows, cols]` for an op whose output feeds a GEMM, when
    /// the GEMMs read bf16 (the tensor-core kernels and cuBLAS; the simple kernel reads f32).
    /// Above 64 rows its rows are padded to whole TMA boxes (`gemm::PadRows`): a box
    /// that reaches past the buffer costs the TMA unit time, and the rows past `rows` are
    /// read, never stored.
    fn bf16_out(&self, rows: usize, cols: usize) -> BResult<Option<DevBf16>> {
        if self.gemm.is_none() && self.blas.is_none() {
            return Ok(None);
        }
        let pad = gemm::PadRows::from_env().map_err(|e| self.shape_err(e))?;
        let mut b = self
            .dev
            .empty_bf16(pad.rows_to_allocate(rows) * cols)
            .map_err(|e| self.dev_err(e))?;
        if pad == gemm::PadRows::Zero {
            self.dev
                .zero_from(&mut b, rows * cols)
                .map_err(|e| self.dev_err(e))?;
        }
        Ok(Some(b))
    }

    /// The tensor GEMM of `x · wᵀ` with the output `out` names, into `dst` when given;
    /// `None` where the path has no such epilogue (nothing ran). `op` names the call in
    /// errors.
    #[allow(clippy::too_many_arguments)]
    fn tensor_gemm(
        &self,
        g: &TensorGemm,
        op: &str,
        x: &CudaAct,
        w: &CudaMat,
        tree: TreeSpec,
        out: GemmOut<'_>,
        dst: Option<DevF32>,
    ) -> BResult<Option<DevF32>> {
        g.matmul_into(
            &self.dev,
            &x.buf,
            x.bf16.as_ref(),
            x.rows,
            x.cols,
            &w.buf,
            w.n,
            tree,
            out,
            dst,
        )
        .map_err(|e| self.gemm_err(op, x, w, e))
    }

    /// [`CudaBackend::tensor_gemm`] over gate/up rows with its SiLU·mul epilogue, into
    /// `dst` when given (`[x.rows, w.n/2]` f32) and its bf16 rounding into `bf16`.
    fn gemm_silu_mul(
        &self,
        g: &TensorGemm,
        x: &CudaAct,
        w: &CudaMat,
        tree: TreeSpec,
        bf16: Option<&mut DevBf16>,
        dst: Option<DevF32>,
    ) -> BResult<Option<DevF32>> {
        self.tensor_gemm(
            g,
            "matmul+silu",
            x,
            w,
            tree,
            GemmOut::SiluMulPairs(bf16),
            dst,
        )
    }

    /// Runs one op, timed by the profiler when there is one.
    fn timed<T>(&self, op: &str, rows: usize, f: impl FnOnce() -> BResult<T>) -> BResult<T> {
        match &self.prof {
            None => f(),
            Some(p) => {
                let sync = || self.dev.synchronize().map_err(|e| self.dev_err(e));
                sync()?;
                let t0 = std::time::Instant::now();
                let r = f()?;
                sync()?;
                // Keyed by rows too: a decode step's ops and a prefill's differ by orders
                // of magnitude and must not share an average.
                p.add(&format!("{op} m={rows}"), t0.elapsed());
                Ok(r)
            }
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // NCCL (2.26 and later) destroys a communicator only after every CUDA graph that
        // captured one of its collectives is gone: ncclCommDestroy waits for the graphs'
        // destructors. Fields drop in declaration order, the collective before the
        // recordings, so without this every TP > 1 process with NCCL that recorded a decode
        // step hung on exit (seen on nvidia-h200-x4, 2026-11-26). Graphs go first.
        if self.dev.ctx.bind_to_thread().is_ok() {
            let _ = self.dev.stream.synchronize();
        }
        self.graphs().clear();
        // Then the collective (and its communicator), explicitly: the order must not
        // depend on where the fields happen to be declared.
        drop(self.coll.take());
    }
}

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Mat = CudaMat;
    type KvCache = CudaKv;
    type Experts = moe::CudaExperts;

    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    fn device_name(&self) -> String {
        let shared = if self.slot.shared() {
            format!(", shared by {} ranks", self.slot.ranks_on_device)
        } else {
            String::new()
        };
        format!(
            "cuda:{} {} ({}{shared})",
            self.dev.ordinal,
            self.dev.name(),
            self.dev.arch
        )
    }

    fn mat_from_host(&self, data: &[half::bf16], n: usize, k: usize) -> BResult<CudaMat> {
        if data.len() != n * k {
            return Err(self.shape_err(format!(
                "weight of {} values uploaded as [{n}, {k}]",
                data.len()
            )));
        }
        let buf = self.dev.upload_bf16(data).map_err(|e| self.dev_err(e))?;
        Ok(CudaMat { buf, n, k })
    }

    fn mat_from_device(
        &self,
        n: usize,
        k: usize,
        cuts: &[super::DeviceCut<'_>],
    ) -> BResult<Result<CudaMat, super::NonFinite>> {
        self.cut_mat(n, k, cuts)
    }

    fn device_bytes(&self, data: &[u8]) -> BResult<Arc<dyn super::DeviceBytes>> {
        self.device_bytes_from_host(data)
    }

    fn mat_from_rows(&self, n: usize, k: usize, fill: &mut RowFill<'_>) -> MResult<CudaMat> {
        match self.dev.upload_bf16_rows(n, k, fill) {
            Ok(buf) => Ok(CudaMat { buf, n, k }),
            Err(RowsUploadError::Fill(e)) => Err(e),
            Err(RowsUploadError::Cuda(e)) => Err(ModelError::Backend {
                rank: self.comm.rank(),
                source: self.dev_err(e),
            }),
        }
    }

    fn upload_wait_seconds(&self) -> f64 {
        self.dev.uploads.wait_seconds()
    }

    fn act_from_host(&self, data: &[f32], rows: usize, cols: usize) -> BResult<CudaAct> {
        if data.len() != rows * cols {
            return Err(self.shape_err(format!(
                "activation of {} values uploaded as [{rows}, {cols}]",
                data.len()
            )));
        }
        let buf = self.dev.upload_f32(data).map_err(|e| self.dev_err(e))?;
        Ok(self.act(buf, rows, cols))
    }

    fn act_to_host(&self, a: &CudaAct) -> BResult<Vec<f32>> {
        self.host_reads.fetch_add(1, Ordering::Relaxed);
        let v = self.timed("download", a.rows, || {
            self.dev.download_f32(&a.buf).map_err(|e| self.dev_err(e))
        })?;
        self.check_collectives()?;
        Ok(v)
    }

    fn shape(&self, a: &CudaAct) -> (usize, usize) {
        (a.rows, a.cols)
    }

    fn reshape(&self, a: CudaAct, rows: usize, cols: usize) -> BResult<CudaAct> {
        if rows * cols != a.rows * a.cols {
            return Err(self.shape_err(format!(
                "reshape [{}, {}] to [{rows}, {cols}]",
                a.rows, a.cols
            )));
        }
        Ok(CudaAct {
            buf: a.buf,
            rows,
            cols,
            bf16: a.bf16,
        })
    }

    fn select_rows(&self, a: &CudaAct, rows: &[usize]) -> BResult<CudaAct> {
        if a.cols == 0 {
            return Ok(self.act(
                self.dev.zeros_f32(0).map_err(|e| self.dev_err(e))?,
                rows.len(),
                0,
            ));
        }
        let buf = self.timed("select_rows", rows.len(), || {
            self.dev
                .select_rows(&a.buf, a.cols, rows)
                .map_err(|e| self.dev_err(e))
        })?;
        Ok(self.act(buf, rows.len(), a.cols))
    }

    fn embedding(&self, table: &CudaMat, ids: &[u32]) -> BResult<CudaAct> {
        let guard = self.meta.lock().unwrap_or_else(|e| e.into_inner());
        let buf = self.timed("embedding", ids.len(), || {
            match guard.as_ref() {
                // The step's ids, uploaded with its other inputs (checked by the engine
                // against the vocabulary, and again here on the host).
                Some(m) if !ids.is_empty() && m.ids == ids => {
                    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.n) {
                        return Err(self.shape_err(format!(
                            "token id {bad} is out of range for a vocabulary of {}",
                            table.n
                        )));
                    }
                    let at = m.word(&self.dev.stream, m.layout.ids());
                    // SAFETY: the current step's buffer holds these ids at `at`.
                    unsafe { self.dev.embedding_raw(&table.buf, table.k, at, ids.len()) }
                }
                _ => self.dev.embedding(&table.buf, table.k, ids),
            }
            .map_err(|e| self.dev_err(e))
        })?;
        Ok(self.act(buf, ids.len(), table.k))
    }

    fn rms_norm(&self, x: &CudaAct, weight: &CudaAct, eps: f32) -> BResult<CudaAct> {
        let mut bf16 = self.bf16_out(x.rows, x.cols)?;
        let buf = self.timed("rms_norm", x.rows, || {
            self.dev
                .rms_norm(&x.buf, x.rows, x.cols, &weight.buf, eps, bf16.as_mut())
                .map_err(|e| self.dev_err(e))
        })?;
        Ok(self.act_with_bf16(buf, x.rows, x.cols, bf16))
    }

    fn matmul(&self, x: &CudaAct, w: &CudaMat, tree: TreeSpec) -> BResult<CudaAct> {
        if x.cols != w.k {
            return Err(self.shape_err(format!(
                "matmul of x [{}, {}] with w [{}, {}]",
                x.rows, x.cols, w.n, w.k
            )));
        }
        let label = self
            .prof
            .as_ref()
            .map(|_| format!("matmul n={} k={}", w.n, w.k))
            .unwrap_or_default();
        self.timed(&label, x.rows, || self.matmul_untimed(x, w, tree))
    }

    fn add_row_bias(&self, x: &mut CudaAct, bias: &CudaAct) -> BResult<()> {
        self.timed("add_row_bias", x.rows, || {
            self.add_row_bias_untimed(x, bias)
        })
    }

    fn add_assign(&self, x: &mut CudaAct, y: &CudaAct) -> BResult<()> {
        self.timed("add_assign", x.rows, || self.add_assign_untimed(x, y))
    }

    fn silu_mul(&self, gate: &CudaAct, up: &CudaAct) -> BResult<CudaAct> {
        self.timed("silu_mul", gate.rows, || self.silu_mul_untimed(gate, up))
    }

    fn row_stats(
        &self,
        logits: &CudaAct,
        vocab: usize,
        pick: &[u32],
        draws: &[crate::sampling::RowDraw],
    ) -> BResult<Vec<crate::sampling::RowStats>> {
        self.timed("row_stats", logits.rows, || {
            self.dev
                .row_stats(&logits.buf, logits.rows, logits.cols, vocab, pick, draws)
                .map_err(|e| self.dev_err(e))
        })
    }

    fn top_k(&self, logits: &CudaAct, vocab: usize, ks: &[usize]) -> BResult<Vec<Vec<(u32, f32)>>> {
        self.timed("top_k", logits.rows, || {
            self.dev
                .top_k_select(&logits.buf, logits.rows, logits.cols, vocab, ks)
                .map_err(|e| self.dev_err(e))
        })
    }

    fn masked_draws(
        &self,
        logits: &CudaAct,
        vocab: usize,
        masked: &[super::MaskedRow<'_>],
    ) -> BResult<Vec<Option<(u32, f32)>>> {
        if masked.is_empty() {
            return Ok(Vec::new());
        }
        let fill = |j: usize, dst: &mut [u32]| match masked[j].mask {
            crate::constraint::TokenMask::Bits(w) => {
                let n = w.len().min(dst.len());
                dst[..n].copy_from_slice(&w[..n]);
            }
            crate::constraint::TokenMask::Ids(ids) => {
                for &i in ids.iter().filter(|&&i| (i as usize) < vocab) {
                    dst[i as usize / 32] |= 1 << (i % 32);
                }
            }
        };
        let rows: Vec<u32> = masked.iter().map(|m| m.row as u32).collect();
        let draws: Vec<_> = masked.iter().map(|m| m.draw).collect();
        self.timed("masked_draw", masked.len(), || {
            self.dev
                .masked_draw(
                    &logits.buf,
                    logits.rows,
                    logits.cols,
                    vocab,
                    &rows,
                    &draws,
                    fill,
                )
                .map_err(|e| self.dev_err(e))
        })
    }

    fn silu_mul_pairs(&self, gu: &CudaAct) -> BResult<CudaAct> {
        if !gu.cols.is_multiple_of(2) {
            return Err(self.shape_err(format!(
                "silu_mul_pairs of [{}, {}]: odd column count",
                gu.rows, gu.cols
            )));
        }
        let inter = gu.cols / 2;
        let mut bf16 = self.bf16_out(gu.rows, inter)?;
        let buf = self.timed("silu_mul_pairs", gu.rows, || {
            self.dev
                .silu_mul_pairs(&gu.buf, gu.rows, inter, bf16.as_mut())
                .map_err(|e| self.dev_err(e))
        })?;
        Ok(self.act_with_bf16(buf, gu.rows, inter, bf16))
    }

    fn matmul_silu_mul(&self, x: &CudaAct, w: &CudaMat, tree: TreeSpec) -> BResult<CudaAct> {
        let fused = self
            .gemm
            .as_ref()
            .filter(|_| self.blas.is_none() && tensor_eligible(tree));
        if let Some(g) = fused {
            if x.cols != w.k || !w.n.is_multiple_of(2) {
                return Err(self.shape_err(format!(
                    "matmul_silu_mul of x [{}, {}] with gate/up w [{}, {}]",
                    x.rows, x.cols, w.n, w.k
                )));
            }
            let inter = w.n / 2;
            let mut bf16 = self.bf16_out(x.rows, inter)?;
            let label = self
                .prof
                .as_ref()
                .map(|_| format!("matmul+silu n={} k={}", w.n, w.k))
                .unwrap_or_default();
            let buf = self.timed(&label, x.rows, || {
                self.gemm_silu_mul(g, x, w, tree, bf16.as_mut(), None)
            })?;
            if let Some(buf) = buf {
                return Ok(self.act_with_bf16(buf, x.rows, inter, bf16));
            }
        }
        let gu = self.matmul(x, w, tree)?;
        self.silu_mul_pairs(&gu)
    }

    fn split_cols(&self, x: &CudaAct, widths: &[usize]) -> BResult<Vec<CudaAct>> {
        if widths.iter().sum::<usize>() != x.cols {
            return Err(self.shape_err(format!(
                "split of [{}, {}] into columns {widths:?}",
                x.rows, x.cols
            )));
        }
        self.timed("split_cols", x.rows, || {
            let mut c0 = 0;
            let mut out = Vec::with_capacity(widths.len());
            for &w in widths {
                let buf = self
                    .dev
                    .copy_cols(&x.buf, x.rows, x.cols, c0, w)
                    .map_err(|e| self.dev_err(e))?;
                out.push(self.act(buf, x.rows, w));
                c0 += w;
            }
            Ok(out)
        })
    }

    fn rope(
        &self,
        x: &mut CudaAct,
        seqs: &[SeqRows],
        n_heads: usize,
        table: &RopeTable,
    ) -> BResult<()> {
        let meta = self.step_meta(seqs, None, x.rows)?;
        let meta = self.meta_of(&meta)?;
        self.timed("rope", x.rows, || {
            self.rope_untimed(x, meta, n_heads, table)
        })
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaAct,
        y: &CudaAct,
        weight: &CudaAct,
        eps: f32,
    ) -> BResult<CudaAct> {
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(self.shape_err(format!(
                "add of [{}, {}] and [{}, {}]",
                x.rows, x.cols, y.rows, y.cols
            )));
        }
        let (rows, cols) = (x.rows, x.cols);
        let mut bf16 = self.bf16_out(rows, cols)?;
        // x changes: a bf16 copy of its old values would be stale.
        x.bf16 = None;
        let buf = self.timed("add_rms_norm", rows, || {
            self.dev
                .add_rms_norm(
                    &mut x.buf,
                    &y.buf,
                    rows,
                    cols,
                    &weight.buf,
                    eps,
                    bf16.as_mut(),
                )
                .map_err(|e| self.dev_err(e))
        })?;
        Ok(self.act_with_bf16(buf, rows, cols, bf16))
    }

    fn qkv_rope_kv(
        &self,
        qkv: &CudaAct,
        cache: &mut CudaKv,
        layer: usize,
        rows: KvRows<'_>,
        heads: HeadSpec,
        table: &RopeTable,
    ) -> BResult<CudaAct> {
        let hd = heads.head_dim;
        if table.head_dim != hd || !hd.is_multiple_of(2) {
            // The fused kernel rotates whole heads; anything else takes the four ops.
            return crate::backend::qkv_rope_kv_unfused(
                self, qkv, cache, layer, rows, heads, table,
            );
        }
        let meta = self.step_meta(rows.seqs, Some(rows.table), qkv.rows)?;
        let meta = self.meta_of(&meta)?;
        let tables = self.rope_tables(table)?;
        let Some(t) = tables.as_ref() else {
            return Err(self.shape_err("RoPE table missing after upload".into()));
        };
        let layout = cache.layout;
        self.timed("qkv_rope_kv", qkv.rows, || {
            let buf = self
                .dev
                .qkv_rope_kv(
                    &qkv.buf,
                    &mut cache.k,
                    &mut cache.v,
                    layout,
                    layer,
                    &t.cos,
                    &t.sin,
                    meta,
                    heads.n_heads,
                    heads.n_kv_heads,
                    hd,
                )
                .map_err(|e| self.dev_err(e))?;
            Ok(self.act(buf, qkv.rows, heads.n_heads * hd))
        })
    }

    fn kv_cache(&self, spec: KvSpec) -> BResult<CudaKv> {
        self.kv_cache_untimed(spec)
    }

    fn kv_write(
        &self,
        cache: &mut CudaKv,
        layer: usize,
        k: &CudaAct,
        v: &CudaAct,
        rows: KvRows<'_>,
    ) -> BResult<()> {
        let meta = self.step_meta(rows.seqs, Some(rows.table), k.rows)?;
        let meta = self.meta_of(&meta)?;
        self.timed("kv_write", k.rows, || {
            self.kv_write_untimed(cache, layer, k, v, meta)
        })
    }

    fn attention(
        &self,
        q: &CudaAct,
        cache: &CudaKv,
        layer: usize,
        rows: KvRows<'_>,
        heads: HeadSpec,
    ) -> BResult<CudaAct> {
        let mut meta = self.step_meta(rows.seqs, Some(rows.table), q.rows)?;
        let meta = meta
            .as_mut()
            .ok_or_else(|| self.shape_err("row map missing after upload".into()))?;
        self.timed("attention", q.rows, || {
            self.attention_untimed(q, cache, layer, meta, heads)
        })
    }

    fn min_over_ranks(&self, value: u64) -> BResult<u64> {
        if self.comm.world_size() == 1 {
            return Ok(value);
        }
        let rank = self.comm.rank();
        let all = self
            .comm
            .all_gather_u64(value)
            .map_err(|source| BackendError::Collective { rank, source })?;
        Ok(all.into_iter().min().unwrap_or(value))
    }

    fn free_device_memory(&self) -> BResult<Option<u64>> {
        // Stream-ordered frees (the load's temporaries) go back to the driver at a
        // synchronisation: measure after it.
        self.dev.synchronize().map_err(|e| self.dev_err(e))?;
        let (free, _total) = self
            .dev
            .ctx
            .mem_get_info()
            .map_err(|e| self.dev_err_msg("querying free device memory", e))?;
        // Ranks sharing the GPU plan for their share of it each.
        Ok(Some(free as u64 / self.slot.ranks_on_device.max(1) as u64))
    }

    fn moe_experts(
        &self,
        gate_up: &[&CudaMat],
        down: &[&CudaMat],
        spec: super::MoeSpec,
    ) -> BResult<Option<moe::CudaExperts>> {
        self.moe_experts_untimed(gate_up, down, spec)
    }

    fn moe_forward(
        &self,
        x: &CudaAct,
        logits: &CudaAct,
        experts: &moe::CudaExperts,
        routes: Option<&mut Vec<u32>>,
    ) -> BResult<CudaAct> {
        self.moe_forward_untimed(x, logits, experts, routes)
    }

    fn tree_all_reduce(&self, partial: CudaAct) -> BResult<CudaAct> {
        let op = match self.blas {
            Some(_) => "all_reduce (nccl)",
            None => "all_reduce (tree)",
        };
        self.timed(op, partial.rows, || self.all_reduce_untimed(partial))
    }

    fn all_gather_cols(&self, x: &CudaAct) -> BResult<CudaAct> {
        self.timed("all_gather_cols", x.rows, || {
            self.all_gather_cols_untimed(x)
        })
    }

    /// Inputs uploaded once, results downloaded once; a decode-shaped step is padded to
    /// its bucket and replayed from a CUDA graph when recording is on (graphs.rs).
    fn run_step(
        &self,
        inputs: &StepInputs<'_>,
        forward: &mut StepForward<'_, Self>,
        masked: &mut super::MaskedRows<'_, '_>,
        want_row: &WantRow<'_>,
    ) -> BResult<StepResults> {
        let key = if self.records_steps() && inputs.is_decode_shaped() {
            let pos_end = inputs
                .seqs
                .iter()
                .map(|s| s.pos0 + s.len)
                .max()
                .unwrap_or(0);
            let stride = step::stride_for(inputs.ks);
            graphs::bucket(inputs.ids.len()).map(|rows| Key {
                rows,
                stride,
                splits: arbor_kernels::cuda::paged_attention::AttnRouting::split_bucket(pos_end),
                keeps_logits: stride > 0 || inputs.rows_to_host,
            })
        } else {
            None
        };
        // PDL's overlap pays in decode steps and cost a long prefill time (launch.rs).
        // Opening the device checked the variable: an error here cannot occur.
        let pdl = arbor_kernels::cuda::launch::PdlPolicy::from_env()
            .unwrap_or(arbor_kernels::cuda::launch::PdlPolicy::Auto);
        arbor_kernels::cuda::launch::set_step_pdl(pdl.for_step(inputs.ids.len()));
        match key {
            Some(key) => self.step_recorded(inputs, forward, masked, want_row, key),
            None => self.step_eager(inputs, forward, masked, want_row),
        }
    }

    fn cache_key(&self, cache: &CudaKv) -> u64 {
        cache.id
    }

    fn recorded_steps(&self) -> Option<(u64, u64)> {
        let g = self.graphs();
        g.enabled.then_some((g.recorded, g.replays))
    }

    fn forget_recordings(&self) {
        self.graphs().clear();
    }

    fn give_back_memory(&self) -> BResult<Option<u64>> {
        let ws = self.dev.trim_memory().map_err(|e| self.dev_err(e))?;
        // Blocks still lent (long-lived scratch) keep the workspace's chunks.
        let (kept, _) = self.dev.workspace.usage();
        let (free, total) = self
            .dev
            .ctx
            .mem_get_info()
            .map_err(|e| self.dev_err_msg("querying free device memory", e))?;
        tracing::info!(
            rank = self.comm.rank(),
            workspace_freed_mib = ws >> 20,
            workspace_kept_mib = kept >> 20,
            free_gib = format!("{:.1}", free as f64 / (1u64 << 30) as f64),
            total_gib = format!("{:.1}", total as f64 / (1u64 << 30) as f64),
            "device memory given back"
        );
        Ok(Some(free as u64))
    }

    fn copy_ipc(
        &self,
        buffers: &[crate::batching::ipc::IpcBuffer],
    ) -> BResult<Vec<Arc<dyn super::DeviceBytes>>> {
        self.copy_ipc_buffers(buffers)
    }

    fn weights_group_joiner(
        &self,
        world: usize,
        rank: usize,
        timeout: std::time::Duration,
    ) -> BResult<super::WeightsGroupJoiner> {
        self.group_joiner(world, rank, timeout)
    }

    fn weights_group_unique_id(&self) -> BResult<[u8; 128]> {
        let rank = self.comm.rank();
        arbor_collective::nccl::new_unique_id(rank).map_err(|e| BackendError::Device {
            rank,
            msg: format!("making the weight-update group's NCCL id: {e}"),
        })
    }
}
