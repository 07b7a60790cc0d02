//! A step plan executed: its rows as one ragged batch, checked first when it came from
//! another rank, and the records of the rows that asked for them.

use arbor_kernels::paged::{blocks_for, KV_BLOCK};

use super::records::{records_parallel, RowTask};
use super::{Caches, HostRows, LateMasks, Worker};
use crate::backend::{Backend, KvRows, MaskedRow, SeqRows};
use crate::batching::{Event, Record, RowResult, Scheduler, StepPlan};
use crate::constraint::TokenMask;
use crate::error::{MResult, ModelError};

impl<B: Backend> Worker<B> {
    /// Plans, executes and applies steps until the scheduler is idle.
    pub(super) fn drive(
        &mut self,
        caches: &mut Caches<B>,
        sched: &mut Scheduler,
        mut on_event: impl FnMut(Event),
    ) -> MResult<()> {
        loop {
            let plan = sched.plan();
            if plan.is_empty() {
                return Ok(());
            }
            let results = self.execute_on(caches, &plan, &mut || sched.late_masks(&plan))?;
            for ev in sched.apply(&plan, &results)? {
                on_event(ev);
            }
        }
    }

    /// A plan from another rank is checked before it touches the cache: its rows fit the
    /// context, their tables cover them and name blocks of the cache, and no two rows
    /// write the same position of a block.
    pub(super) fn check_plan(&self, plan: &StepPlan, blocks: usize, max_len: usize) -> MResult<()> {
        let mut written = std::collections::HashSet::new();
        for r in &plan.rows {
            let bad = |msg: String| ModelError::BadRequest {
                id: r.sample_key,
                msg: format!("step plan row of sequence {}: {msg}", r.seq),
            };
            let end = r.pos0.saturating_add(r.tokens.len());
            if r.tokens.is_empty() || end > max_len {
                return Err(bad(format!(
                    "{} tokens at position {} do not fit {max_len} positions",
                    r.tokens.len(),
                    r.pos0
                )));
            }
            if r.blocks.len() != blocks_for(end) {
                return Err(bad(format!(
                    "a block table of {} blocks for positions 0..{end} (needs {})",
                    r.blocks.len(),
                    blocks_for(end)
                )));
            }
            if let Some(b) = r.blocks.iter().find(|&&b| b as usize >= blocks) {
                return Err(bad(format!("block {b} of a cache of {blocks} blocks")));
            }
            for p in r.pos0..end {
                let at = (r.blocks[p / KV_BLOCK], p % KV_BLOCK);
                if !written.insert(at) {
                    return Err(bad(format!(
                        "position {p} writes row {} of block {}, which another row of the step writes",
                        at.1, at.0
                    )));
                }
            }
            self.check_tokens(r.sample_key, &r.tokens)?;
            r.sampling.validate()?;
            if let Some(m) = &r.allowed {
                m.check(self.cfg.vocab_size).map_err(bad)?;
            }
            if r.mask_later && (r.allowed.is_some() || !r.sample) {
                return Err(bad(
                    "a mask to come later on a row that has one or samples nothing".into(),
                ));
            }
        }
        Ok(())
    }

    /// One step: the plan's rows as one ragged batch; records of the rows that need them.
    /// `late` gives the masks of the plan's `mask_later` rows, asked for once while the
    /// step's device work runs.
    pub(super) fn execute_on(
        &mut self,
        caches: &mut Caches<B>,
        plan: &StepPlan,
        late: &mut LateMasks<'_>,
    ) -> MResult<Vec<RowResult>> {
        // Before the tasks, which borrow the masks in it.
        let late_masks: std::cell::OnceCell<Vec<TokenMask>> = std::cell::OnceCell::new();
        let mut ids = Vec::with_capacity(plan.n_tokens());
        let mut seqs = Vec::with_capacity(plan.rows.len());
        let mut table = Vec::with_capacity(plan.rows.iter().map(|r| r.blocks.len()).sum());
        let mut out_rows = Vec::new();
        for r in &plan.rows {
            let row0 = ids.len();
            seqs.push(SeqRows {
                row0,
                len: r.tokens.len(),
                pos0: r.pos0,
                table0: table.len(),
            });
            table.extend_from_slice(&r.blocks);
            ids.extend_from_slice(&r.tokens);
            for &(off, _) in &r.targets {
                if off as usize >= r.tokens.len()
                    || (r.sample && off as usize + 1 == r.tokens.len())
                {
                    return Err(ModelError::Plan(format!(
                        "sequence {}: target row {off} is outside its {} rows or is its sampled row",
                        r.seq,
                        r.tokens.len()
                    )));
                }
                out_rows.push(row0 + off as usize);
            }
            if r.sample {
                out_rows.push(row0 + r.tokens.len() - 1);
            }
        }
        let ids_of: Vec<u64> = plan.rows.iter().map(|r| r.sample_key).collect();
        // One task per logits row, in the order the rows were asked for; per task, the
        // index of its mask among the late ones.
        let mut tasks = Vec::with_capacity(out_rows.len());
        let mut late_of = Vec::with_capacity(out_rows.len());
        let mut n_late = 0;
        for r in &plan.rows {
            late_of.extend(std::iter::repeat_n(None, r.targets.len()));
            for &(_, target) in &r.targets {
                tasks.push(RowTask::Score {
                    token: target,
                    n_top: r.n_top,
                });
            }
            if r.sample {
                tasks.push(RowTask::Sample {
                    sampling: r.sampling,
                    key: r.sample_key,
                    position: r.pos0 + r.tokens.len(),
                    n_top: r.n_top,
                    constrained: r.allowed.is_some() || r.mask_later,
                    allowed: r.allowed.as_ref(),
                });
                late_of.push(r.mask_later.then_some(n_late));
                n_late += usize::from(r.mask_later);
            }
        }
        let vocab_size = self.cfg.vocab_size;
        let mut fetch = || -> MResult<()> {
            if n_late == 0 || late_masks.get().is_some() {
                return Ok(());
            }
            let masks = late()?;
            if masks.len() != n_late {
                return Err(ModelError::Plan(format!(
                    "{} masks for the step's {n_late} rows masked later",
                    masks.len()
                )));
            }
            for m in &masks {
                m.check(vocab_size).map_err(ModelError::Plan)?;
            }
            let _ = late_masks.set(masks);
            Ok(())
        };
        let t0 = std::time::Instant::now();
        let rows = KvRows {
            seqs: &seqs,
            table: &table,
        };
        let want_routes = plan.rows.iter().any(|r| r.routes);
        if want_routes && self.cfg.moe.is_none() {
            let r = plan.rows.iter().find(|r| r.routes);
            return Err(ModelError::BadRequest {
                id: r.map_or(0, |r| r.sample_key),
                msg: "routed experts were asked of a model without experts".into(),
            });
        }
        let out = {
            let mut masked = || -> MResult<Vec<MaskedRow<'_>>> {
                fetch()?;
                let late = late_masks.get().map_or(&[][..], Vec::as_slice);
                Ok(tasks
                    .iter()
                    .zip(&late_of)
                    .enumerate()
                    .filter_map(|(row, (t, i))| t.masked_row(row, i.and_then(|i| late.get(i))))
                    .collect())
            };
            self.step(
                caches,
                &ids,
                rows,
                &out_rows,
                &ids_of,
                &tasks,
                &mut masked,
                want_routes,
            )?
        };
        // A step whose rows all came to the host did not ask for the masks: the records
        // need them.
        fetch()?;
        if let Some(late) = late_masks.get() {
            for (t, i) in tasks.iter_mut().zip(&late_of) {
                if let (RowTask::Sample { allowed, .. }, Some(i)) = (t, i) {
                    *allowed = late.get(*i);
                }
            }
        }
        // Tokens × values per token of the routes, where asked.
        let per_token = match &self.cfg.moe {
            Some(m) if want_routes => self.cfg.num_layers * m.top_k,
            _ => 0,
        };
        if out.routes.len() != ids.len() * per_token {
            return Err(ModelError::Plan(format!(
                "the forward returned {} routed experts for {} tokens of {per_token}",
                out.routes.len(),
                ids.len()
            )));
        }
        let vocab = self.cfg.vocab_size.max(1);
        let host_ok = match &out.host {
            HostRows::All(l) => l.len() == out_rows.len() * vocab,
            HostRows::Some(rows) => rows.is_empty() || rows.len() == out_rows.len(),
            HostRows::None => true,
        };
        let cands_ok = out.cands.is_empty() || out.cands.len() == out_rows.len();
        if out.stats.len() != out_rows.len() || !host_ok || !cands_ok {
            return Err(ModelError::Plan(format!(
                "the forward returned {} row records for {} rows",
                out.stats.len(),
                out_rows.len()
            )));
        }
        let t_rec = std::time::Instant::now();
        let mut records = records_parallel(&out, vocab, &tasks)?.into_iter();
        let dt_rec = t_rec.elapsed().as_secs_f64();
        let dt = t0.elapsed().as_secs_f64();
        if plan.rows.iter().any(|r| r.prefill) {
            self.timing.prefill_s += dt;
            self.timing.prefill_tokens += ids.len();
        } else {
            self.timing.decode_s += dt;
            self.timing.decode_steps += 1;
            self.timing.decode_tokens += ids.len();
            self.timing.decode_records_s += dt_rec;
        }
        let mut results = Vec::with_capacity(plan.rows.len());
        let mut row0 = 0;
        for r in &plan.rows {
            let scored: Vec<Record> = records.by_ref().take(r.targets.len()).collect();
            let sampled = if r.sample { records.next() } else { None };
            let end = row0 + r.tokens.len();
            let routes = if r.routes {
                out.routes[row0 * per_token..end * per_token].to_vec()
            } else {
                Vec::new()
            };
            row0 = end;
            results.push(RowResult {
                seq: r.seq,
                scored,
                sampled,
                routes,
            });
        }
        Ok(results)
    }
}
