//! One step's device work: the backend's `run_step` (which may replay a recording), or,
//! where rows must come to the host or a shadow compares, the forward op by op.

use super::records::RowTask;
use super::{Caches, HostRows, StepOut, Worker};
use crate::backend::{Backend, BackendError, KvRows, MaskedRow, StepInputs};
use crate::error::{MResult, ModelError};
use crate::forward::Trace;
use crate::sampling::{RowDraw, RowStats};

impl<B: Backend> Worker<B> {
    /// One forward over a ragged batch; `ids_of[i]` is the request id of sequence i (for
    /// error messages), `tasks[i]` what output row i is for. Returns each output row's
    /// `RowStats`, its top candidates, and the rows' logits on the host: all of them when
    /// a task needs its row from the start (or a shadow compares them), else those whose
    /// top-p nucleus the candidates do not reach. Without a whole-row task or a shadow,
    /// the step is the backend's `run_step` (which may replay a recording); with a shadow,
    /// compares every layer and the logits bit for bit. `masked` gives the constrained
    /// rows' masked draws once the device work is under way (their masks may be computed
    /// meanwhile); a step whose rows all come to the host does not ask for them. With
    /// `routes`, the step runs op by op (never recorded: the routes come back to the host
    /// mid-step) and returns every token's routed experts; its logits are those of the
    /// recorded step.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step<'m>(
        &mut self,
        caches: &mut Caches<B>,
        ids: &[u32],
        rows: KvRows<'_>,
        out_rows: &[usize],
        ids_of: &[u64],
        tasks: &[RowTask],
        masked: &mut dyn FnMut() -> MResult<Vec<MaskedRow<'m>>>,
        routes: bool,
    ) -> MResult<StepOut> {
        let pick: Vec<u32> = tasks.iter().map(RowTask::pick).collect();
        let draws: Vec<RowDraw> = tasks.iter().map(RowTask::draw).collect();
        let ks: Vec<usize> = tasks.iter().map(RowTask::candidates).collect();
        let need_host = tasks.iter().any(RowTask::needs_row);
        let (pick, draws, ks) = (&pick[..], &draws[..], &ks[..]);
        let model = self.model.as_ref().ok_or_else(super::released)?;
        if !need_host && !routes && self.shadow.is_none() {
            // The device program: the backend may record it and replay the recording.
            let inputs = StepInputs {
                ids,
                seqs: rows.seqs,
                table: rows.table,
                out_rows,
                pick,
                draws,
                ks,
                vocab: model.vocab(),
                cache: self.backend.cache_key(&caches.main),
                rows_to_host: tasks.iter().any(RowTask::drawn_on_host),
            };
            let cache = &mut caches.main;
            let want_row = |r: usize, st: &RowStats, c: &[(u32, f32)]| {
                tasks.get(r).is_some_and(|t| t.wants_row(st, c))
            };
            // The masks' own error is kept here: the backend passes on a stand-in.
            let mut masks_err = None;
            let mut backend_masked = || {
                masked().map_err(|e| {
                    masks_err = Some(e);
                    BackendError::Unsupported("the step's masks could not be had".into())
                })
            };
            let res = self.backend.run_step(
                &inputs,
                &mut |b, inp| {
                    model.forward_logits(b, cache, inp.ids, inp.kv_rows(), inp.out_rows, None)
                },
                &mut backend_masked,
                &want_row,
            );
            let res = match (res, masks_err) {
                (_, Some(e)) => return Err(e),
                (res, None) => res.map_err(|e| self.berr(e))?,
            };
            return Ok(StepOut {
                stats: res.stats,
                cands: res.cands,
                host: HostRows::Some(res.rows),
                routes: Vec::new(),
            });
        }
        // The rows come to the host (top-N beyond the candidates' limit, a sampling over
        // the whole row, or the shadow's comparison): the draws use them.
        let mut trace = self.shadow.as_ref().map(|_| Trace::new());
        let mut routed = Vec::new();
        let dev_logits = model
            .forward_routed(
                &self.backend,
                &mut caches.main,
                ids,
                rows,
                out_rows,
                trace.as_mut(),
                routes.then_some(&mut routed),
            )
            .map_err(|e| self.berr(e))?;
        let Some(dev_logits) = dev_logits else {
            return Ok(StepOut {
                routes: routed,
                ..StepOut::default()
            });
        };
        let stats = model
            .row_stats(&self.backend, &dev_logits, pick, draws)
            .map_err(|e| self.berr(e))?;
        let logits = model
            .logits_to_host(&self.backend, &dev_logits)
            .map_err(|e| self.berr(e))?;
        if let (Some(shadow), Some(scache), Some(trace)) =
            (self.shadow.as_mut(), caches.shadow.as_mut(), trace)
        {
            let mut strace = Trace::new();
            let slogits = shadow
                .model
                .as_ref()
                .ok_or_else(super::released)?
                .forward(
                    &shadow.backend,
                    scache,
                    ids,
                    rows,
                    out_rows,
                    Some(&mut strace),
                )
                .map_err(|e| shadow.berr(e))?;
            let rank = self.backend.rank();
            let hidden = self.cfg.hidden_size;
            let position_of_row = |row: usize| -> (usize, u64) {
                rows.seqs
                    .iter()
                    .zip(ids_of)
                    .find(|(s, _)| (s.row0..s.row0 + s.len).contains(&row))
                    .map_or((0, 0), |(s, &id)| (s.pos0 + row - s.row0, id))
            };
            for (layer, (a, b)) in trace.iter().zip(&strace).enumerate() {
                if let Some(row) = first_diff_row(a, b, hidden) {
                    let (position, id) = position_of_row(row);
                    return Err(ModelError::ShadowDivergence {
                        rank,
                        what: format!("hidden state after layer {layer}"),
                        position,
                        id,
                        max_abs_diff: max_abs_diff(
                            &a[row * hidden..(row + 1) * hidden],
                            &b[row * hidden..(row + 1) * hidden],
                        ),
                    });
                }
            }
            let vocab = self.cfg.vocab_size;
            if let Some(i) = first_diff_row(&logits, &slogits, vocab) {
                let (position, id) = position_of_row(out_rows[i]);
                return Err(ModelError::ShadowDivergence {
                    rank,
                    what: "logits".into(),
                    position,
                    id,
                    max_abs_diff: max_abs_diff(
                        &logits[i * vocab..(i + 1) * vocab],
                        &slogits[i * vocab..(i + 1) * vocab],
                    ),
                });
            }
        }
        Ok(StepOut {
            stats,
            cands: Vec::new(),
            host: HostRows::All(logits),
            routes: routed,
        })
    }
}

fn first_diff_row(a: &[f32], b: &[f32], cols: usize) -> Option<usize> {
    if a.len() != b.len() {
        return Some(0);
    }
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
        .map(|i| i / cols.max(1))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m })
}
