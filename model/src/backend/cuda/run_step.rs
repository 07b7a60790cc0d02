//! How `run_step` runs a step: its inputs uploaded once, its outputs (row stats, top-k)
//! computed on the device and downloaded once; a decode-shaped step padded to its bucket
//! and replayed from a CUDA graph (graphs.rs).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use arbor_kernels::cuda::ops::dev_ptr;
use arbor_kernels::cuda::RowMeta;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::graphs::{Entry, Key, State};
use super::step::{self, InLayout, OutLayout, Padded, StepMeta};
use super::{CudaAct, CudaBackend};
use crate::backend::{
    set_masked_draws, wanted_rows, BResult, Backend, KvRows, MaskedRows, SeqRows, StepForward,
    StepInputs, StepResults, WantRow,
};

impl CudaBackend {
    /// The device row map of this batch: the current step's when the batch is the one
    /// `run_step` uploaded, else uploaded now (an op called outside `run_step`). `table`:
    /// the rows' block tables, `None` for an op that reads positions only (RoPE), which
    /// takes any row map of these rows.
    pub(super) fn step_meta(
        &self,
        seqs: &[SeqRows],
        table: Option<&[u32]>,
        rows: usize,
    ) -> BResult<std::sync::MutexGuard<'_, Option<StepMeta>>> {
        let mut guard = self.meta.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = matches!(guard.as_ref(), Some(m) if m.rows == rows
            && m.seqs == seqs
            && table.is_none_or(|t| m.table.as_deref() == Some(t)));
        if !fresh {
            // Without tables (RoPE alone): every sequence's table is block 0, enough for
            // the row map's checks; an op that writes or reads the cache uploads the real
            // ones.
            let zeros;
            let t = match table {
                Some(t) => t,
                None => {
                    let n = seqs
                        .iter()
                        .map(|s| s.table0 + arbor_kernels::paged::blocks_for(s.pos0 + s.len))
                        .max()
                        .unwrap_or(0);
                    zeros = vec![0u32; n];
                    &zeros
                }
            };
            let kv = KvRows { seqs, table: t };
            let layout = InLayout {
                rows,
                outs: 0,
                table: t.len(),
            };
            let mut words = vec![0u32; layout.words()];
            let ends =
                step::fill_row_map(&mut words, layout, kv).map_err(|msg| self.shape_err(msg))?;
            let buf = self.timed("upload row map", rows, || {
                self.dev.upload_u32(&words).map_err(|e| self.dev_err(e))
            })?;
            // Ids are not part of a row map made here: `embedding` uploads its own.
            *guard = Some(StepMeta::new(
                &self.dev.stream,
                Vec::new(),
                kv,
                table.is_some(),
                layout,
                Arc::new(buf),
                ends,
                None,
            ));
        }
        Ok(guard)
    }

    pub(super) fn meta_of<'a>(&self, guard: &'a Option<StepMeta>) -> BResult<&'a RowMeta> {
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
        let (words, pos_end, block_end) =
            step::pack_inputs(inputs).map_err(|m| self.shape_err(m))?;
        let layout = InLayout {
            rows: inputs.ids.len(),
            outs: inputs.out_rows.len(),
            table: inputs.table.len(),
        };
        let buf = self.timed("upload step", layout.rows, || {
            self.dev.upload_u32(&words).map_err(|e| self.dev_err(e))
        })?;
        self.set_meta(StepMeta::new(
            &self.dev.stream,
            inputs.ids.to_vec(),
            inputs.kv_rows(),
            true,
            layout,
            Arc::new(buf),
            (pos_end, block_end),
            None,
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
        self.check_collectives()?;
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
        // Rows close together come down in one copy: a copy to pageable memory costs a
        // fixed ~0.4 ms, more than a few rows' bytes in between.
        const GAP: usize = 4;
        let mut rest = &wanted[..];
        while let Some(&first) = rest.first() {
            let n = 1 + rest.windows(2).take_while(|w| w[1] - w[0] <= GAP).count();
            let last = rest[n - 1];
            let span = self.timed("download rows", n, || {
                self.dev
                    .download_range(
                        "downloading logits rows",
                        &l.buf,
                        first * l.cols..last * l.cols + vocab,
                    )
                    .map_err(|e| self.dev_err(e))
            })?;
            for &r in &rest[..n] {
                let at = (r - first) * l.cols;
                res.rows[r] = Some(span[at..at + vocab].to_vec());
            }
            rest = &rest[n..];
        }
        Ok(())
    }

    /// A step run op by op: its inputs uploaded once, its results downloaded once.
    pub(super) fn step_eager(
        &self,
        inputs: &StepInputs<'_>,
        forward: &mut StepForward<'_, Self>,
        masked: &mut MaskedRows<'_, '_>,
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
        // The forward is on its way: the host's work for the masks overlaps it.
        let masked = masked()?;
        let drawn = self.masked_draws(&logits, inputs.vocab, &masked)?;
        let mut res = self.read_outputs(&out, ol, layout.outs)?;
        set_masked_draws(&mut res.stats, &masked, &drawn)?;
        self.fetch_rows(&mut res, Some(&logits), inputs.vocab, want_row)?;
        Ok(res)
    }

    /// A decode-shaped step padded to `key.rows` and run from its recording (graphs.rs):
    /// eagerly in the workspace the first time, captured the second, replayed after.
    pub(super) fn step_recorded(
        &self,
        inputs: &StepInputs<'_>,
        forward: &mut StepForward<'_, Self>,
        masked: &mut MaskedRows<'_, '_>,
        want_row: &WantRow<'_>,
        key: Key,
    ) -> BResult<StepResults> {
        let n = inputs.ids.len();
        let padded = Padded::new(inputs, key.rows).map_err(|m| self.shape_err(m))?;
        let pin = padded.inputs(inputs);
        let (words, pos_end, block_end) = step::pack_inputs(&pin).map_err(|m| self.shape_err(m))?;
        let layout = InLayout {
            rows: key.rows,
            outs: key.rows,
            table: key.table_capacity(),
        };
        if pin.table.len() > layout.table {
            // More table than this shape holds (tables longer than the rows need): run it
            // op by op, where it is checked.
            return self.step_eager(inputs, forward, masked, want_row);
        }
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
        // SAFETY: the entry's input buffer holds the layout's words, of which `words` are
        // the first (their tables within the capacity, checked above); stream-ordered
        // after every earlier step that read it.
        unsafe { self.dev.write_raw(dev_ptr(&entry.inputs, s), &words) }
            .map_err(|e| self.dev_err(e))?;
        // The current meta may describe this buffer's old contents (the step that was
        // captured): no op may take it for the new ones.
        *self.meta.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let (mut replayed, mut recorded) = (false, false);
        match &entry.state {
            State::Recorded { graph, limits } => {
                if pos_end > limits.0 || block_end > limits.1 {
                    // Beyond what the recording's ops were checked for: run (and check)
                    // this step op by op.
                    drop(graphs);
                    return self.step_eager(inputs, forward, masked, want_row);
                }
                graph
                    .launch()
                    .map_err(|e| self.dev_err_msg("replaying a decode step", e))?;
                replayed = true;
            }
            State::Failed | State::HostBound => {
                drop(graphs);
                return self.step_eager(inputs, forward, masked, want_row);
            }
            State::New | State::Warm => {
                let capture = matches!(entry.state, State::Warm);
                self.set_meta(StepMeta::new(
                    s,
                    padded.ids.clone(),
                    pin.kv_rows(),
                    true,
                    layout,
                    entry.inputs.clone(),
                    (pos_end, block_end),
                    Some(key.splits),
                ));
                let reads = self.host_reads.load(Ordering::Relaxed);
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
                    entry.logits = Some(run?).filter(|_| key.keeps_logits);
                    entry.state = if self.host_reads.load(Ordering::Relaxed) == reads {
                        State::Warm
                    } else {
                        tracing::debug!(
                            rank = self.comm.rank(),
                            rows = key.rows,
                            "a decode step read activations on the host: this shape runs op by op"
                        );
                        State::HostBound
                    };
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
                            entry.logits = Some(logits).filter(|_| key.keeps_logits);
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
                                splits = key.splits,
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
                            return self.step_eager(inputs, forward, masked, want_row);
                        }
                    }
                }
            }
        }
        // The step is on its way (replayed, or run the first times): the host's work for
        // the masks overlaps it.
        let masked = masked()?;
        let drawn = match (&entry.logits, masked.is_empty()) {
            (_, true) => Vec::new(),
            (Some(l), false) => self.masked_draws(l, inputs.vocab, &masked)?,
            (None, false) => {
                return Err(self
                    .shape_err("constrained rows in a recorded step that keeps no logits".into()))
            }
        };
        let mut res = self.read_outputs(&entry.outputs, ol, n)?;
        set_masked_draws(&mut res.stats, &masked, &drawn)?;
        self.fetch_rows(&mut res, entry.logits.as_ref(), inputs.vocab, want_row)?;
        graphs.replays += u64::from(replayed || recorded);
        graphs.recorded += u64::from(recorded);
        Ok(res)
    }
}
