//! CUDA backend: device buffers, the NVRTC kernels of `arbor_kernels::cuda`, and the GPU
//! collective (NCCL all-gather of f32 subtree roots + the fixed tree as a GPU kernel).
//!
//! Each rank takes GPU `LOCAL_RANK` (else its rank), counted as the driver counts, i.e.
//! relative to `CUDA_VISIBLE_DEVICES`. Every kernel fixes each output element's order of
//! roundings independently of rows, TP and launch shape, so the contract's invariances hold
//! on the GPU as on the CPU; the two backends agree within bf16 tolerance only.

pub mod gemm;
pub mod graphs;
mod profile;
pub mod step;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arbor_collective::gpu::{Algo, GpuCollective, GpuOptions};
use arbor_collective::nccl::Dtype;
use arbor_collective::Communicator;
use arbor_kernels::cpu::RopeTable;
use arbor_kernels::cuda::cublas::Blas;
use arbor_kernels::cuda::gemm::OutDtype;
use arbor_kernels::cuda::ops::dev_ptr;
use arbor_kernels::cuda::{CudaError, DevBf16, DevF32, GpuDevice, KvLayout, RowMeta};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{
    wanted_rows, BResult, Backend, BackendError, HeadSpec, KvSpec, Numerics, SeqRows, StepForward,
    StepInputs, StepResults, TreeSpec, WantRow,
};
use gemm::{tensor_eligible, GemmKind, GemmOut, TensorGemm};
use graphs::{Entry, Graphs, Key, State};
use profile::Profiler;
use step::{InLayout, OutLayout, Padded, StepMeta};

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

/// bf16 K and V caches, `[layers, slots, max_len, n_kv_heads·head_dim]` each.
pub struct CudaKv {
    k: DevBf16,
    v: DevBf16,
    layout: KvLayout,
    /// Unique among the caches of this process (`Backend::cache_key`).
    id: u64,
}

/// Cache ids: never reused, so a recording made on a dropped cache never runs again.
static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

/// The RoPE table's copy on the device, keyed by the host table it came from.
struct RopeDev {
    key: (usize, usize, usize, usize),
    cos: DevF32,
    sin: DevF32,
}

pub struct CudaBackend {
    comm: Arc<dyn Communicator>,
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
}

/// The GPU ordinal of this rank: `LOCAL_RANK`, else the rank.
fn ordinal_for(rank: usize) -> Result<usize, String> {
    match std::env::var("LOCAL_RANK") {
        Ok(s) => s
            .trim()
            .parse::<usize>()
            .map_err(|_| format!("LOCAL_RANK={s:?} is not a GPU index")),
        Err(_) => Ok(rank),
    }
}

/// The all-reduce algorithm: `auto` by default (one-shot for small messages, two-shot for
/// large ones, all-gather + tree where IPC is unavailable: every one gives the tree's bits);
/// `ARBOR_GPU_ALLREDUCE=tree|oneshot|twoshot` forces one. NVLS is never taken from here.
fn allreduce_algo(var: Option<&str>) -> Result<Algo, String> {
    match var {
        None => Ok(Algo::Auto),
        Some(s) => match s.parse::<Algo>()? {
            Algo::Nvls => Err(
                "ARBOR_GPU_ALLREDUCE=nvls: NVLink multicast is not used by the CUDA backend".into(),
            ),
            a => Ok(a),
        },
    }
}

fn gpu_collective(
    comm: &Arc<dyn Communicator>,
    dev: &GpuDevice,
    algo: Algo,
) -> Result<GpuCollective, String> {
    let mut opts = GpuOptions::default();
    if algo == Algo::AllGatherTree {
        // No CUDA IPC buffers when only the all-gather path runs.
        opts.ipc_capacity_bytes = 0;
    }
    GpuCollective::with_options(comm.clone(), dev.stream.clone(), opts).map_err(|e| e.to_string())
}

impl CudaBackend {
    /// Opens this rank's GPU and, at TP > 1, joins the NCCL group (collective: every rank
    /// of `comm` must call it).
    pub fn new(comm: Arc<dyn Communicator>, numerics: Numerics) -> Result<Self, BackendError> {
        let rank = comm.rank();
        let err = |msg: String| BackendError::Device { rank, msg };
        // Checked before the device is opened, so a bad value is reported on any machine.
        let kind = GemmKind::from_env().map_err(err)?;
        let ordinal = ordinal_for(rank).map_err(err)?;
        let dev = GpuDevice::open(ordinal).map_err(|e| err(e.to_string()))?;
        let (major, _) = dev
            .ctx
            .compute_capability()
            .map_err(|e| err(format!("cuDeviceGetAttribute(compute capability): {e}")))?;
        let kind = kind.resolve(major);
        tracing::info!(rank, gemm = ?kind, "CUDA backend linear layers");
        let algo =
            allreduce_algo(std::env::var("ARBOR_GPU_ALLREDUCE").ok().as_deref()).map_err(err)?;
        let gemm = match kind {
            GemmKind::Simple | GemmKind::Auto => None,
            GemmKind::Tensor => Some(TensorGemm::new(&dev).map_err(|e| err(e.to_string()))?),
        };
        let coll = if comm.world_size() > 1 {
            Some(gpu_collective(&comm, &dev, algo).map_err(err)?)
        } else {
            None
        };
        let blas = match numerics {
            Numerics::Invariant => None,
            Numerics::Fast => Some(Blas::new(&dev.stream).map_err(err)?),
        };
        tracing::info!(rank, numerics = numerics.as_str(), "CUDA backend numerics");
        let prof = Profiler::from_env(rank);
        let graphs = graphs::enabled(std::env::var(graphs::ENV).ok().as_deref()).map_err(err)?;
        if graphs && prof.is_some() {
            tracing::info!(
                rank,
                "ARBOR_PROFILE synchronises every op: decode steps are not recorded as graphs"
            );
        }
        let backend = Self {
            comm,
            dev: Arc::new(dev),
            coll,
            algo,
            rope: Mutex::new(None),
            gemm,
            blas,
            meta: Mutex::new(None),
            graphs: Mutex::new(Graphs::new(graphs && prof.is_none())),
            prof,
        };
        backend.warm_up_collectives()?;
        Ok(backend)
    }

    /// At TP > 1, runs each collective a step uses once (the all-reduce of this
    /// numerics, the all-gather) on a small buffer, so that their one-time costs (NCCL's
    /// connection setup, kernel loads, first scratch buffers) are paid at load time and
    /// not by the first request's prefill. Collective: every rank runs it inside `new`.
    fn warm_up_collectives(&self) -> Result<(), BackendError> {
        if self.comm.world_size() == 1 {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let x = self.act(
            self.dev.zeros_f32(4096).map_err(|e| self.dev_err(e))?,
            1,
            4096,
        );
        let gathered = self.all_gather_cols_untimed(&x)?;
        let reduced = self.all_reduce_untimed(x)?;
        self.dev.synchronize().map_err(|e| self.dev_err(e))?;
        drop((gathered, reduced));
        tracing::info!(
            rank = self.comm.rank(),
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "collectives warmed up"
        );
        Ok(())
    }

    /// A world-size-1 backend on an already opened device, with the simple GEMM and no
    /// recorded steps.
    pub fn solo(dev: Arc<GpuDevice>) -> Self {
        Self {
            comm: Arc::new(arbor_collective::SingleComm),
            dev,
            coll: None,
            algo: Algo::AllGatherTree,
            rope: Mutex::new(None),
            gemm: None,
            blas: None,
            meta: Mutex::new(None),
            graphs: Mutex::new(Graphs::new(false)),
            prof: None,
        }
    }

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

    /// The TP=1 shadow of this backend: world size 1 on the same device, the same GEMM
    /// choice (sharing its compiled kernels, with scratch buffers of its own).
    pub fn tp1_shadow(&self) -> Self {
        Self {
            gemm: self.gemm.as_ref().map(TensorGemm::sibling),
            ..Self::solo(self.dev.clone())
        }
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

    /// A bf16 companion buffer of `len` values for an op whose output feeds a GEMM, when
    /// the GEMMs read bf16 (the tensor-core kernels and cuBLAS; the simple kernel reads f32).
    fn bf16_out(&self, len: usize) -> BResult<Option<DevBf16>> {
        if self.gemm.is_none() && self.blas.is_none() {
            return Ok(None);
        }
        self.dev
            .empty_bf16(len)
            .map(Some)
            .map_err(|e| self.dev_err(e))
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

    /// The device row map of this batch: the current step's when the batch is the one
    /// `run_step` uploaded, else uploaded now (an op called outside `run_step`).
    fn step_meta(
        &self,
        seqs: &[SeqRows],
        rows: usize,
    ) -> BResult<std::sync::MutexGuard<'_, Option<StepMeta>>> {
        let mut guard = self.meta.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = matches!(guard.as_ref(), Some(m) if m.rows == rows && m.seqs == seqs);
        if !fresh {
            let layout = InLayout { rows, outs: 0 };
            let mut words = vec![0u32; layout.words()];
            let ends =
                step::fill_row_map(&mut words, layout, seqs).map_err(|msg| self.shape_err(msg))?;
            let buf = self.timed("upload row map", rows, || {
                self.dev.upload_u32(&words).map_err(|e| self.dev_err(e))
            })?;
            // Ids are not part of a row map made here: `embedding` uploads its own.
            *guard = Some(StepMeta::new(
                &self.dev.stream,
                Vec::new(),
                seqs,
                layout,
                Arc::new(buf),
                ends,
                false,
            ));
        }
        Ok(guard)
    }

    fn meta_of<'a>(&self, guard: &'a Option<StepMeta>) -> BResult<&'a RowMeta> {
        guard
            .as_ref()
            .map(|m| &m.meta)
            .ok_or_else(|| self.shape_err("row map missing after upload".into()))
    }

    /// Makes `meta` the current step's inputs.
    fn set_meta(&self, meta: StepMeta) {
        *self.meta.lock().unwrap_or_else(|e| e.into_inner()) = Some(meta);
    }

    /// Uploads a step's inputs (one copy into a new buffer) and makes them current.
    fn upload_step(&self, inputs: &StepInputs<'_>) -> BResult<InLayout> {
        let (words, slot_end, pos_end) =
            step::pack_inputs(inputs).map_err(|m| self.shape_err(m))?;
        let layout = InLayout {
            rows: inputs.ids.len(),
            outs: inputs.out_rows.len(),
        };
        let buf = self.timed("upload step", layout.rows, || {
            self.dev.upload_u32(&words).map_err(|e| self.dev_err(e))
        })?;
        self.set_meta(StepMeta::new(
            &self.dev.stream,
            inputs.ids.to_vec(),
            inputs.seqs,
            layout,
            Arc::new(buf),
            (slot_end, pos_end),
            false,
        ));
        Ok(layout)
    }

    /// Launches the row stats (and, with a stride, the top-k selection) of `logits` into
    /// `out` (`OutLayout` words), reading the rows' parameters from the current step.
    fn launch_outputs(
        &self,
        logits: &CudaAct,
        vocab: usize,
        ol: OutLayout,
        out: &arbor_kernels::cuda::DevU32,
    ) -> BResult<()> {
        let guard = self.meta.lock().unwrap_or_else(|e| e.into_inner());
        let m = guard
            .as_ref()
            .ok_or_else(|| self.shape_err("step outputs without step inputs".into()))?;
        if logits.rows != ol.outs || m.layout.outs != ol.outs || out.len() < ol.words() {
            return Err(self.shape_err(format!(
                "step outputs of {} logits rows for {} output rows ({} of {} words)",
                logits.rows,
                m.layout.outs,
                out.len(),
                ol.words()
            )));
        }
        let s = &self.dev.stream;
        let o = dev_ptr(out, s);
        let at = |w: usize| o + 4 * w as u64;
        self.timed("row_stats", logits.rows, || {
            // SAFETY: `out` holds the layout's words; the parameters are the current
            // step's, which `guard` keeps alive.
            unsafe {
                self.dev.row_stats_raw(
                    &logits.buf,
                    logits.rows,
                    logits.cols,
                    vocab,
                    m.word(s, m.layout.params()),
                    at(ol.stats_f32()),
                    at(ol.stats_u64()),
                )
            }
            .map_err(|e| self.dev_err(e))
        })?;
        if ol.stride > 0 {
            self.timed("top_k", logits.rows, || {
                // SAFETY: as above; every k is at most the stride (`stride_for`).
                unsafe {
                    self.dev.top_k_raw(
                        &logits.buf,
                        logits.rows,
                        logits.cols,
                        vocab,
                        m.word(s, m.layout.ks()),
                        ol.stride,
                        [at(ol.indices()), at(ol.values()), at(ol.counts())],
                    )
                }
                .map_err(|e| self.dev_err(e))
            })?;
        }
        Ok(())
    }

    /// The results of `launch_outputs`: one download, the first `keep` rows.
    fn read_outputs(
        &self,
        out: &arbor_kernels::cuda::DevU32,
        ol: OutLayout,
        keep: usize,
    ) -> BResult<StepResults> {
        let words = self.timed("download step", ol.outs, || {
            self.dev
                .download("downloading step results", out, ol.words())
                .map_err(|e| self.dev_err(e))
        })?;
        step::decode_outputs(&words, ol, keep).map_err(|m| self.shape_err(m))
    }

    /// The rows of `logits` that `want_row` asks for given `res`, on the host (their
    /// `vocab` values), into `res.rows`.
    fn fetch_rows(
        &self,
        res: &mut StepResults,
        logits: Option<&CudaAct>,
        vocab: usize,
        want_row: &WantRow<'_>,
    ) -> BResult<()> {
        let wanted = wanted_rows(&res.stats, &res.cands, want_row);
        if wanted.is_empty() {
            return Ok(());
        }
        let l =
            logits.ok_or_else(|| self.shape_err("step rows asked for without logits".into()))?;
        res.rows = vec![None; res.stats.len()];
        for r in wanted {
            let row = self.timed("download row", 1, || {
                self.dev
                    .download_range(
                        "downloading a logits row",
                        &l.buf,
                        r * l.cols..r * l.cols + vocab,
                    )
                    .map_err(|e| self.dev_err(e))
            })?;
            res.rows[r] = Some(row);
        }
        Ok(())
    }

    /// A step run op by op: its inputs uploaded once, its results downloaded once.
    fn step_eager(
        &self,
        inputs: &StepInputs<'_>,
        forward: &mut StepForward<'_, Self>,
        want_row: &WantRow<'_>,
    ) -> BResult<StepResults> {
        let layout = self.upload_step(inputs)?;
        let Some(logits) = forward(self, inputs)? else {
            return Ok(StepResults::default());
        };
        let ol = OutLayout {
            outs: layout.outs,
            stride: step::stride_for(inputs.ks),
        };
        let out = self
            .dev
            .alloc::<u32>(ol.words())
            .map_err(|e| self.dev_err(e))?;
        self.launch_outputs(&logits, inputs.vocab, ol, &out)?;
        let mut res = self.read_outputs(&out, ol, layout.outs)?;
        self.fetch_rows(&mut res, Some(&logits), inputs.vocab, want_row)?;
        Ok(res)
    }

    /// A decode-shaped step padded to `key.rows` and run from its recording (graphs.rs):
    /// eagerly in the workspace the first time, captured the second, replayed after.
    fn step_recorded(
        &self,
        inputs: &StepInputs<'_>,
        forward: &mut StepForward<'_, Self>,
        want_row: &WantRow<'_>,
        key: Key,
    ) -> BResult<StepResults> {
        let n = inputs.ids.len();
        let padded = Padded::new(inputs, key.rows).map_err(|m| self.shape_err(m))?;
        let pin = padded.inputs(inputs);
        let (words, slot_end, pos_end) = step::pack_inputs(&pin).map_err(|m| self.shape_err(m))?;
        let layout = InLayout {
            rows: key.rows,
            outs: key.rows,
        };
        let ol = OutLayout {
            outs: key.rows,
            stride: key.stride,
        };
        let mut graphs = self.graphs();
        let entry = graphs
            .entry(inputs.cache, key, || {
                let alloc = |len: usize| self.dev.alloc::<u32>(len).map_err(|e| e.to_string());
                Ok(Entry {
                    inputs: Arc::new(alloc(layout.words())?),
                    outputs: alloc(ol.words())?,
                    logits: None,
                    state: State::New,
                })
            })
            .map_err(|m| self.shape_err(m))?;
        let s = &self.dev.stream;
        // SAFETY: the entry's input buffer holds the layout's words; stream-ordered after
        // every earlier step that read it.
        unsafe { self.dev.write_raw(dev_ptr(&entry.inputs, s), &words) }
            .map_err(|e| self.dev_err(e))?;
        // The current meta may describe this buffer's old contents (the step that was
        // captured): no op may take it for the new ones.
        *self.meta.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let (mut replayed, mut recorded) = (false, false);
        match &entry.state {
            State::Recorded { graph, limits } => {
                if slot_end > limits.0 || pos_end > limits.1 {
                    // Beyond what the recording's ops were checked for: run (and check)
                    // this step op by op.
                    drop(graphs);
                    return self.step_eager(inputs, forward, want_row);
                }
                graph
                    .launch()
                    .map_err(|e| self.dev_err_msg("replaying a decode step", e))?;
                replayed = true;
            }
            State::Failed => {
                drop(graphs);
                return self.step_eager(inputs, forward, want_row);
            }
            State::New | State::Warm => {
                let capture = matches!(entry.state, State::Warm);
                self.set_meta(StepMeta::new(
                    s,
                    padded.ids.clone(),
                    &padded.seqs,
                    layout,
                    entry.inputs.clone(),
                    (slot_end, pos_end),
                    true,
                ));
                let scope = self.dev.workspace.scope();
                if capture {
                    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                        .map_err(|e| self.dev_err_msg("beginning a graph capture", e))?;
                }
                let run = forward(self, &pin).and_then(|logits| match logits {
                    Some(l) => self
                        .launch_outputs(&l, inputs.vocab, ol, &entry.outputs)
                        .map(|()| l),
                    None => Err(self.shape_err("a decode step without logits".into())),
                });
                if !capture {
                    drop(scope);
                    entry.logits = Some(run?).filter(|_| key.stride > 0);
                    entry.state = State::Warm;
                } else {
                    let graph = s.end_capture(CUgraphInstantiate_flags(0));
                    drop(scope);
                    let limits = self
                        .meta
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .as_ref()
                        .map(|m| m.meta.limits());
                    match (run, graph, limits) {
                        (Ok(logits), Ok(Some(graph)), Some(limits)) => {
                            // Kept where rows may be asked for: the graph writes its
                            // logits here on every replay.
                            entry.logits = Some(logits).filter(|_| key.stride > 0);
                            graph
                                .upload()
                                .map_err(|e| self.dev_err_msg("uploading a decode graph", e))?;
                            graph
                                .launch()
                                .map_err(|e| self.dev_err_msg("replaying a decode step", e))?;
                            tracing::debug!(
                                rank = self.comm.rank(),
                                rows = key.rows,
                                stride = key.stride,
                                "decode step recorded"
                            );
                            entry.state = State::Recorded { graph, limits };
                            recorded = true;
                        }
                        (run, graph, _) => {
                            let why = match (run, graph) {
                                (Err(e), _) => e.to_string(),
                                (_, Err(e)) => format!("{e:?}"),
                                _ => "no graph".to_string(),
                            };
                            tracing::warn!(
                                rank = self.comm.rank(),
                                rows = key.rows,
                                "recording a decode step failed ({why}): this batch size runs op by op"
                            );
                            entry.state = State::Failed;
                            drop(graphs);
                            // A failed capture may leave an error behind in the context.
                            let _ = self.dev.ctx.check_err();
                            return self.step_eager(inputs, forward, want_row);
                        }
                    }
                }
            }
        }
        let mut res = self.read_outputs(&entry.outputs, ol, n)?;
        self.fetch_rows(&mut res, entry.logits.as_ref(), inputs.vocab, want_row)?;
        graphs.replays += u64::from(replayed || recorded);
        graphs.recorded += u64::from(recorded);
        Ok(res)
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

    fn rope_tables(
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

    fn coll(&self) -> BResult<&GpuCollective> {
        self.coll.as_ref().ok_or_else(|| BackendError::Device {
            rank: self.comm.rank(),
            msg: format!(
                "no GPU collective for world size {}",
                self.comm.world_size()
            ),
        })
    }

    fn coll_err(&self, what: &str, e: arbor_collective::gpu::GpuError) -> BackendError {
        BackendError::Device {
            rank: self.comm.rank(),
            msg: format!("{what}: {e}"),
        }
    }
}

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Mat = CudaMat;
    type KvCache = CudaKv;

    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    fn device_name(&self) -> String {
        format!(
            "cuda:{} {} ({})",
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
        self.timed("download", a.rows, || {
            self.dev.download_f32(&a.buf).map_err(|e| self.dev_err(e))
        })
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
        let mut bf16 = self.bf16_out(x.rows * x.cols)?;
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

    fn silu_mul_pairs(&self, gu: &CudaAct) -> BResult<CudaAct> {
        if !gu.cols.is_multiple_of(2) {
            return Err(self.shape_err(format!(
                "silu_mul_pairs of [{}, {}]: odd column count",
                gu.rows, gu.cols
            )));
        }
        let inter = gu.cols / 2;
        let mut bf16 = self.bf16_out(gu.rows * inter)?;
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
            let mut bf16 = self.bf16_out(x.rows * inter)?;
            let label = self
                .prof
                .as_ref()
                .map(|_| format!("matmul+silu n={} k={}", w.n, w.k))
                .unwrap_or_default();
            let buf = self.timed(&label, x.rows, || {
                g.matmul(
                    &self.dev,
                    &x.buf,
                    x.bf16.as_ref(),
                    x.rows,
                    x.cols,
                    &w.buf,
                    w.n,
                    tree,
                    GemmOut::SiluMulPairs(bf16.as_mut()),
                )
                .map_err(|e| self.gemm_err("matmul+silu", x, w, e))
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
        let meta = self.step_meta(seqs, x.rows)?;
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
        let mut bf16 = self.bf16_out(rows * cols)?;
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
        seqs: &[SeqRows],
        heads: HeadSpec,
        table: &RopeTable,
    ) -> BResult<CudaAct> {
        let hd = heads.head_dim;
        if table.head_dim != hd || !hd.is_multiple_of(2) {
            // The fused kernel rotates whole heads; anything else takes the four ops.
            return crate::backend::qkv_rope_kv_unfused(
                self, qkv, cache, layer, seqs, heads, table,
            );
        }
        let meta = self.step_meta(seqs, qkv.rows)?;
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
        seqs: &[SeqRows],
    ) -> BResult<()> {
        let meta = self.step_meta(seqs, k.rows)?;
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
        seqs: &[SeqRows],
        heads: HeadSpec,
    ) -> BResult<CudaAct> {
        let meta = self.step_meta(seqs, q.rows)?;
        let meta = self.meta_of(&meta)?;
        self.timed("attention", q.rows, || {
            self.attention_untimed(q, cache, layer, meta, heads)
        })
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
        want_row: &WantRow<'_>,
    ) -> BResult<StepResults> {
        let key = if self.records_steps() && inputs.is_decode_shaped() {
            graphs::bucket(inputs.ids.len()).map(|rows| Key {
                rows,
                stride: step::stride_for(inputs.ks),
            })
        } else {
            None
        };
        match key {
            Some(key) => self.step_recorded(inputs, forward, want_row, key),
            None => self.step_eager(inputs, forward, want_row),
        }
    }

    fn cache_key(&self, cache: &CudaKv) -> u64 {
        cache.id
    }

    fn recorded_steps(&self) -> Option<(u64, u64)> {
        let g = self.graphs();
        g.enabled.then_some((g.recorded, g.replays))
    }
}

/// The ops themselves; `Backend`'s methods wrap them in the profiler.
impl CudaBackend {
    fn matmul_untimed(&self, x: &CudaAct, w: &CudaMat, tree: TreeSpec) -> BResult<CudaAct> {
        if let Some(blas) = &self.blas {
            return self.blas_matmul(blas, x, w);
        }
        if let Some(g) = self.gemm.as_ref().filter(|_| tensor_eligible(tree)) {
            let buf = g
                .matmul(
                    &self.dev,
                    &x.buf,
                    x.bf16.as_ref(),
                    x.rows,
                    x.cols,
                    &w.buf,
                    w.n,
                    tree,
                    GemmOut::Roots,
                )
                .map_err(|e| self.gemm_err("matmul", x, w, e))?
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
        Ok(self.act(buf, x.rows, w.n))
    }

    fn add_row_bias_untimed(&self, x: &mut CudaAct, bias: &CudaAct) -> BResult<()> {
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

    fn add_assign_untimed(&self, x: &mut CudaAct, y: &CudaAct) -> BResult<()> {
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

    fn silu_mul_untimed(&self, gate: &CudaAct, up: &CudaAct) -> BResult<CudaAct> {
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

    fn rope_untimed(
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

    fn kv_cache_untimed(&self, spec: KvSpec) -> BResult<CudaKv> {
        let layout = KvLayout {
            layers: spec.layers,
            slots: spec.slots,
            max_len: spec.max_len,
            width: spec.n_kv_heads * spec.head_dim,
        };
        let k = self
            .dev
            .zeros_bf16(layout.len())
            .map_err(|e| self.dev_err(e))?;
        let v = self
            .dev
            .zeros_bf16(layout.len())
            .map_err(|e| self.dev_err(e))?;
        Ok(CudaKv {
            k,
            v,
            layout,
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    fn kv_write_untimed(
        &self,
        cache: &mut CudaKv,
        layer: usize,
        k: &CudaAct,
        v: &CudaAct,
        meta: &RowMeta,
    ) -> BResult<()> {
        let w = cache.layout.width;
        if k.cols != w || v.cols != w || k.rows != v.rows {
            return Err(self.shape_err(format!(
                "kv_write of k [{}, {}] / v [{}, {}] into a cache of width {w}",
                k.rows, k.cols, v.rows, v.cols
            )));
        }
        let layout = cache.layout;
        self.dev
            .kv_write(
                &mut cache.k,
                &mut cache.v,
                layout,
                layer,
                &k.buf,
                &v.buf,
                meta,
            )
            .map_err(|e| self.dev_err(e))
    }

    fn attention_untimed(
        &self,
        q: &CudaAct,
        cache: &CudaKv,
        layer: usize,
        meta: &RowMeta,
        heads: HeadSpec,
    ) -> BResult<CudaAct> {
        if q.cols != heads.n_heads * heads.head_dim {
            return Err(self.shape_err(format!(
                "attention q has {} columns for {} heads of {}",
                q.cols, heads.n_heads, heads.head_dim
            )));
        }
        let mut bf16 = self.bf16_out(q.rows * q.cols)?;
        let buf = self
            .dev
            .attention(
                &q.buf,
                &cache.k,
                &cache.v,
                cache.layout,
                layer,
                meta,
                heads.n_heads,
                heads.n_kv_heads,
                heads.head_dim,
                heads.scale,
                bf16.as_mut(),
            )
            .map_err(|e| self.dev_err(e))?;
        Ok(self.act_with_bf16(buf, q.rows, q.cols, bf16))
    }

    fn all_reduce_untimed(&self, partial: CudaAct) -> BResult<CudaAct> {
        let world = self.comm.world_size();
        if world == 1 {
            return Ok(partial);
        }
        if partial.buf.is_empty() {
            return Ok(partial);
        }
        let coll = self.coll()?;
        // The output comes from the device (lent inside a recorded step), not from the
        // collective's own allocation.
        let mut out = self
            .dev
            .empty_f32(partial.buf.len())
            .map_err(|e| self.dev_err(e))?;
        match self.blas {
            Some(_) => {
                let s = &self.dev.stream;
                let (src, dst, n) = (dev_ptr(&partial.buf, s), dev_ptr(&out, s), out.len());
                // SAFETY: both buffers hold n f32 on this rank's device and stay alive
                // until the stream's work is done (stream-ordered frees).
                unsafe { coll.nccl().all_reduce_raw(src, dst, n, Dtype::F32) }
                    .map_err(|e| self.coll_err("NCCL all-reduce (--numerics fast)", e))?
            }
            None => {
                coll.tree_all_reduce_into(self.algo, &partial.buf, &mut out)
                    .map_err(|e| self.coll_err("tree all-reduce", e))?;
            }
        }
        Ok(self.act(out, partial.rows, partial.cols))
    }

    fn all_gather_cols_untimed(&self, x: &CudaAct) -> BResult<CudaAct> {
        let world = self.comm.world_size();
        if world == 1 {
            let buf = self.dev.copy_f32(&x.buf).map_err(|e| self.dev_err(e))?;
            return Ok(self.act(buf, x.rows, x.cols));
        }
        if x.buf.is_empty() {
            return Ok(self.act(
                self.dev.zeros_f32(0).map_err(|e| self.dev_err(e))?,
                x.rows,
                world * x.cols,
            ));
        }
        let n = x.buf.len();
        let gathered = self.dev.empty_f32(world * n).map_err(|e| self.dev_err(e))?;
        {
            let s = &self.dev.stream;
            // SAFETY: x holds n f32, `gathered` world·n, both on this rank's device.
            unsafe {
                self.coll()?.nccl().all_gather_raw(
                    dev_ptr(&x.buf, s),
                    dev_ptr(&gathered, s),
                    n,
                    Dtype::F32,
                )
            }
            .map_err(|e| self.coll_err("all-gather of columns", e))?;
        }
        let buf = self
            .dev
            .interleave_cols(&gathered, world, x.rows, x.cols)
            .map_err(|e| self.dev_err(e))?;
        Ok(self.act(buf, x.rows, world * x.cols))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allreduce_algo_defaults_to_auto_and_refuses_nvls() {
        assert_eq!(allreduce_algo(None).unwrap(), Algo::Auto);
        assert_eq!(allreduce_algo(Some("tree")).unwrap(), Algo::AllGatherTree);
        assert_eq!(allreduce_algo(Some("oneshot")).unwrap(), Algo::OneShot);
        assert!(allreduce_algo(Some("nvls"))
            .unwrap_err()
            .contains("NVLink multicast"));
        assert!(allreduce_algo(Some("fastest")).is_err());
    }
}
