//! Rank 0's scheduler: requests join and leave at every step, prompts are prefilled in
//! chunks mixed with decode rows under a per-step token budget, and every sequence holds
//! the KV blocks of its positions (its block table, sent with each of its plan rows);
//! requests wait in a FIFO queue while the blocks run out.
//!
//! Two admission policies (`SchedulerConfig::preempt`):
//! - reserve (offline `generate` / `score`): admission reserves blocks for the prompt and
//!   every token the request may generate, so nothing is ever preempted;
//! - preempt (`arbor serve`): admission reserves the known tokens only and a sequence takes
//!   a block when its next position needs one; when none is free the most recently
//!   admitted sequence is preempted: its KV is dropped, it goes back to the head of the
//!   queue with the tokens it has generated, and on readmission it recomputes them as a
//!   prefill. Prefill equals decode bit for bit and sampling is keyed by position, so a
//!   preempted request's tokens and log-probs are the ones it would have had anyway.
//!
//! The requests and events are in `request`, the limits in `config`, a sequence's state
//! (waiting or running) in `sequence`, and the scheduler's side of the prefix cache
//! (lookup, blocks in flight, registration) in `prefix`.

mod config;
mod prefix;
mod request;
mod sequence;
#[cfg(test)]
mod testing;

use std::collections::VecDeque;

use arbor_kernels::paged::{blocks_for, KV_BLOCK};

use config::round_step_rows;
pub use config::{
    SchedulerConfig, DEFAULT_PREFILL_BESIDE_DECODE, DEFAULT_ROW_MULTIPLE, DEFAULT_STEP_OUTPUTS,
    DEFAULT_STEP_TOKENS,
};
pub use request::{Event, FinishReason, SeqId, SeqSpec};

use crate::batching::kv::BlockPool;
use crate::batching::plan::{PlanRow, RowResult, StepPlan};
use crate::error::{MResult, ModelError};
use prefix::{register_computed, Pending};
use sequence::{target_range, Running, Waiting};

pub struct Scheduler {
    cfg: SchedulerConfig,
    blocks: BlockPool,
    waiting: VecDeque<Waiting>,
    preemptions: u64,
    running: Vec<Running>,
    next_id: SeqId,
    /// Blocks running sequences compute that waiting requests wait for (`Pending`).
    pending: Pending,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> MResult<Self> {
        let pool = BlockPool::new(cfg.kv_blocks, cfg.prefix_cache);
        Self::with_pool(cfg, pool)
    }

    /// A scheduler over `pool` (whose cached blocks it may reuse: one left by an earlier
    /// scheduler on the same cache, `into_pool`), which must have `cfg.kv_blocks` blocks.
    pub fn with_pool(cfg: SchedulerConfig, pool: BlockPool) -> MResult<Self> {
        if pool.total() != cfg.kv_blocks.min(u32::MAX as usize)
            || pool.prefix_cache() != cfg.prefix_cache
            || pool.used() != 0
        {
            return Err(ModelError::Plan(format!(
                "a pool of {} blocks ({} held, prefix cache {}) for a scheduler of {} blocks (prefix cache {})",
                pool.total(),
                pool.used(),
                pool.prefix_cache(),
                cfg.kv_blocks,
                cfg.prefix_cache
            )));
        }
        if cfg.max_running == 0
            || cfg.chunk == 0
            || cfg.step_tokens == 0
            || cfg.prefill_beside_decode == 0
            || cfg.row_multiple == 0
            || cfg.step_outputs == 0
            || cfg.kv_blocks == 0
        {
            return Err(ModelError::Plan(format!(
                "scheduler limits must be at least 1: running sequences {}, chunk {}, step tokens {}, prefill beside decode {}, row multiple {}, step outputs {}, KV blocks {}",
                cfg.max_running, cfg.chunk, cfg.step_tokens, cfg.prefill_beside_decode, cfg.row_multiple, cfg.step_outputs, cfg.kv_blocks
            )));
        }
        Ok(Scheduler {
            blocks: pool,
            pending: Pending::default(),
            cfg,
            waiting: VecDeque::new(),
            preemptions: 0,
            running: Vec::new(),
            next_id: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The block pool, with its prefix cache, for a later scheduler on the same cache
    /// (`with_pool`); None while sequences still hold blocks.
    pub fn into_pool(self) -> Option<BlockPool> {
        (self.is_idle() && self.blocks.used() == 0).then_some(self.blocks)
    }

    /// Queues a request; errors if it could never run (empty, longer than the context
    /// limit, or needing more blocks than the cache has).
    pub fn submit(&mut self, spec: SeqSpec) -> MResult<SeqId> {
        let key = spec.sample_key;
        if spec.tokens.is_empty() {
            return Err(ModelError::BadRequest {
                id: key,
                msg: "empty prompt".into(),
            });
        }
        let needed = spec.tokens.len().saturating_add(spec.max_new);
        if needed > self.cfg.max_seq_len {
            return Err(ModelError::ContextTooLong {
                id: key,
                needed,
                max: self.cfg.max_seq_len,
                prompt_len: spec.tokens.len(),
            });
        }
        let blocks = blocks_for(needed);
        if blocks > self.blocks.total() {
            return Err(ModelError::BadRequest {
                id: key,
                msg: format!(
                    "needs {blocks} KV blocks but the cache has {}",
                    self.blocks.total()
                ),
            });
        }
        if let Some(f) = spec.score_from {
            if f == 0 || f > spec.tokens.len() {
                return Err(ModelError::BadRequest {
                    id: key,
                    msg: format!(
                        "scoring starts at position {f}, outside 1..={}",
                        spec.tokens.len()
                    ),
                });
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Waiting {
            id,
            spec,
            generated: Vec::new(),
            scored_below: 0,
            hashes: None,
        });
        Ok(id)
    }

    /// Drops a waiting or running sequence and frees its KV; false if it is unknown
    /// (already finished).
    pub fn cancel(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.waiting.iter().position(|w| w.id == id) {
            self.waiting.remove(i);
            return true;
        }
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            let r = self.running.remove(i);
            self.release(&r);
            return true;
        }
        false
    }

    /// Gives back a sequence's blocks (the cached ones stay cached) and the blocks it
    /// was to compute for others.
    fn release(&mut self, r: &Running) {
        self.blocks.release(&r.blocks);
        for h in &r.hashes[r.registered.min(r.pending_end)..r.pending_end] {
            self.pending.done(*h);
        }
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// (used, total) KV blocks: held by running sequences, in the cache.
    pub fn kv_blocks(&self) -> (usize, usize) {
        (self.blocks.used(), self.blocks.total())
    }

    /// Sequences preempted so far (each recomputed on readmission).
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Blocks a waiting request needs at admission (before any prefix-cache hit).
    fn admission_blocks(&self, w: &Waiting) -> usize {
        let positions = if self.cfg.preempt {
            w.known_len()
        } else {
            w.spec.tokens.len().saturating_add(w.spec.max_new)
        };
        blocks_for(positions)
    }

    /// Admits waiting requests in arrival order while the running sequences are fewer than
    /// `max_running` and their blocks are available (FIFO: a large request at the head is
    /// not overtaken). A request first takes the longest run of its full blocks the prefix
    /// cache holds; one whose next block a running sequence is computing waits for it and
    /// lets the requests behind it go first. Under `preempt`, one spare block per running
    /// sequence stays free for their growth, so that a request admitted now is not
    /// preempted again at once.
    fn admit(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() && self.running.len() < self.cfg.max_running {
            let prefix = self.blocks.prefix_cache();
            let (hashes, hits, reusable) = self.cached_prefix(i);
            if hits.len() < reusable && self.pending.computing(hashes[hits.len()]) {
                i += 1;
                continue;
            }
            let w = &self.waiting[i];
            let need = self.admission_blocks(w).saturating_sub(hits.len());
            let spare = if self.cfg.preempt {
                self.running.len()
            } else {
                0
            };
            let available = self.blocks.available() - self.blocks.unheld(&hits);
            if available < need + spare {
                break;
            }
            self.blocks.acquire(&hits);
            let Some(taken) = self.blocks.take(need) else {
                self.blocks.release(&hits);
                break;
            };
            let Some(w) = self.waiting.remove(i) else {
                break;
            };
            self.blocks.count_lookup(
                if prefix { w.known_len() } else { 0 },
                hits.len() * KV_BLOCK,
            );
            self.pending.add(&hashes[hits.len()..]);
            let mut blocks = hits.clone();
            blocks.extend(taken);
            let prefill_to = w.known_len();
            self.running.push(Running {
                id: w.id,
                spec: w.spec,
                blocks,
                fed: hits.len() * KV_BLOCK,
                generated: w.generated,
                prefill_to,
                scored_below: w.scored_below,
                pending_end: hashes.len(),
                hashes,
                registered: hits.len(),
                cacheable: prefix,
            });
        }
    }

    /// Under `preempt`: gives every sequence about to decode the block its next position
    /// needs, preempting the most recently admitted sequences while none is free.
    fn grow(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            let need = if r.fed >= r.prefill_to && r.fed < r.known_len() {
                blocks_for(r.fed + 1)
            } else {
                0
            };
            let mut preempted_self = false;
            while self.running[i].blocks.len() < need {
                if let Some(mut b) = self.blocks.take(1) {
                    self.running[i].blocks.append(&mut b);
                    continue;
                }
                let victim = self.running.len() - 1;
                self.preempt(victim);
                if victim == i {
                    preempted_self = true;
                    break;
                }
            }
            if !preempted_self {
                i += 1;
            }
        }
    }

    /// Drops running sequence `i`'s KV and queues it first, to be recomputed.
    fn preempt(&mut self, i: usize) {
        let r = self.running.remove(i);
        self.release(&r);
        self.preemptions += 1;
        self.waiting.push_front(Waiting {
            id: r.id,
            spec: r.spec,
            generated: r.generated,
            scored_below: r.scored_below,
            hashes: None,
        });
    }

    /// The next step: decode rows of every sequence that has one (none while a prompt is
    /// prefilling under `prefill_first`), then prefill chunks in admission order, within
    /// the token and output budgets (and, beside decode rows, `prefill_beside_decode`
    /// prompt rows). Empty when there is nothing to do.
    pub fn plan(&mut self) -> StepPlan {
        self.admit();
        if self.cfg.preempt {
            self.grow();
        }
        let mut budget = self.cfg.step_tokens;
        let mut outputs = self.cfg.step_outputs;
        let mut rows = Vec::new();
        let decode = !self.cfg.prefill_first || self.running.iter().all(|r| r.fed >= r.prefill_to);
        for r in self.running.iter().filter(|_| decode) {
            if budget == 0 || outputs == 0 {
                break;
            }
            if r.fed >= r.prefill_to && r.fed < r.known_len() {
                let row = self.row(r, r.fed, r.fed + 1);
                outputs -= row.targets.len() + usize::from(row.sample);
                rows.push(row);
                budget -= 1;
            }
        }
        if !rows.is_empty() {
            budget = round_step_rows(
                rows.len(),
                self.cfg.prefill_beside_decode,
                self.cfg.row_multiple,
                budget,
            );
        }
        for r in &self.running {
            if budget == 0 {
                break;
            }
            if r.fed < r.prefill_to {
                let mut end = r
                    .prefill_to
                    .min(r.fed.saturating_add(self.cfg.chunk.min(budget)));
                end = self.fit_outputs(r, r.fed, end, outputs);
                if end == r.fed {
                    continue;
                }
                let row = self.row(r, r.fed, end);
                outputs -= row.targets.len() + usize::from(row.sample);
                budget -= end - r.fed;
                rows.push(row);
            }
        }
        self.constrain(&mut rows);
        StepPlan { rows }
    }

    /// The masks of the constrained sequences' sampled rows, from each sequence's own
    /// generated tokens, computed side by side on the host's cores; a row whose
    /// constraint computes its mask later (a grammar's, tens to hundreds of microseconds
    /// over a large vocabulary) is marked `mask_later` instead ([`Scheduler::late_masks`]).
    fn constrain(&self, rows: &mut [PlanRow]) {
        let mut jobs: Vec<(usize, &crate::constraint::Constraint, &[u32])> = rows
            .iter()
            .enumerate()
            .filter(|(_, row)| row.sample)
            .filter_map(|(i, row)| {
                let r = self.running.iter().find(|r| r.id == row.seq)?;
                Some((i, r.spec.constraint.as_ref()?, &r.generated[..]))
            })
            .collect();
        jobs.retain(|&(i, c, generated)| {
            rows[i].mask_later = c.masks_later(generated);
            !rows[i].mask_later
        });
        if jobs.is_empty() {
            return;
        }
        // A constraint may leave a row unmasked (`min_tokens` once met): it stays on the
        // device's draw.
        let masks =
            crate::sampling::map_rows(jobs.len(), usize::MAX, |j, _| jobs[j].1.mask(jobs[j].2));
        for ((i, _, _), mask) in jobs.iter().zip(masks) {
            rows[*i].allowed = mask;
        }
    }

    /// The masks of `plan`'s `mask_later` rows, in plan order, computed side by side on
    /// the host's cores: rank 0 calls it while the step's forward runs, before `apply`,
    /// so each is the mask of its sequence's tokens when the plan was made.
    pub fn late_masks(&self, plan: &StepPlan) -> MResult<Vec<crate::constraint::TokenMask>> {
        let jobs: Vec<(u64, Option<&Running>)> = plan
            .rows
            .iter()
            .filter(|row| row.mask_later)
            .map(|row| (row.seq, self.running.iter().find(|r| r.id == row.seq)))
            .collect();
        let masks = crate::sampling::map_rows(jobs.len(), usize::MAX, |j, _| {
            let r = jobs[j].1?;
            r.spec.constraint.as_ref()?.mask(&r.generated)
        });
        jobs.iter()
            .zip(masks)
            .map(|(&(seq, _), m)| {
                m.ok_or_else(|| {
                    ModelError::Plan(format!(
                        "sequence {seq}: its constraint gave no mask for a row planned to be masked later"
                    ))
                })
            })
            .collect()
    }

    /// The end (at most `end`, at least `start`) of a chunk of `r` from `start` whose rows
    /// need at most `outputs` logits rows.
    fn fit_outputs(&self, r: &Running, start: usize, end: usize, outputs: usize) -> usize {
        // Target rows are the positions [lo, hi) (see `row`); the sampled row is end - 1
        // when the chunk reaches the known tokens.
        let (lo, hi) = target_range(&r.spec, r.scored_below);
        let first = start.max(lo);
        let mut end = if first < hi {
            end.min(first.saturating_add(outputs))
        } else {
            end
        };
        let targets = end.min(hi).saturating_sub(first);
        let samples = end == r.known_len() && r.generated.len() < r.spec.max_new;
        if samples && targets + 1 > outputs {
            end -= 1;
        }
        end.max(start)
    }

    /// The plan row feeding positions `start..end` of `r`.
    fn row(&self, r: &Running, start: usize, end: usize) -> PlanRow {
        let (lo, hi) = target_range(&r.spec, r.scored_below);
        let targets = (start.max(lo)..end.min(hi))
            .map(|p| ((p - start) as u32, r.spec.tokens[p + 1]))
            .collect();
        PlanRow {
            seq: r.id,
            sample_key: r.spec.sample_key,
            blocks: r.blocks[..blocks_for(end)].to_vec(),
            pos0: start,
            tokens: (start..end).map(|i| r.known(i)).collect(),
            targets,
            sample: end == r.known_len() && r.generated.len() < r.spec.max_new,
            prefill: start < r.prefill_to,
            sampling: r.spec.sampling,
            n_top: r.spec.n_top,
            allowed: None,
            mask_later: false,
            routes: r.spec.routes,
        }
    }

    /// Applies a step's results (of the plan `plan()` returned last); returns what
    /// happened, finished sequences last for each row.
    pub fn apply(&mut self, plan: &StepPlan, results: &[RowResult]) -> MResult<Vec<Event>> {
        if plan.rows.len() != results.len() {
            return Err(ModelError::Plan(format!(
                "{} results for a plan of {} rows",
                results.len(),
                plan.rows.len()
            )));
        }
        let mut events = Vec::new();
        for (row, res) in plan.rows.iter().zip(results) {
            if row.seq != res.seq {
                return Err(ModelError::Plan(format!(
                    "result for sequence {} where {} was planned",
                    res.seq, row.seq
                )));
            }
            // Cancelled while the step ran: nothing to report.
            let Some(i) = self.running.iter().position(|r| r.id == row.seq) else {
                continue;
            };
            let eos = &self.cfg.eos;
            let r = &mut self.running[i];
            r.fed = row.pos0 + row.tokens.len();
            r.scored_below = r.scored_below.max(r.fed);
            register_computed(&mut self.blocks, &mut self.pending, r);
            if row.routes {
                events.push(Event::Routed {
                    seq: r.id,
                    pos0: row.pos0,
                    experts: res.routes.clone(),
                });
            }
            if !res.scored.is_empty() {
                events.push(Event::Scored {
                    seq: r.id,
                    records: res.scored.clone(),
                });
            }
            let mut finish = None;
            if let Some(rec) = &res.sampled {
                r.generated.push(rec.token);
                events.push(Event::Token {
                    seq: r.id,
                    record: rec.clone(),
                });
                if !r.spec.ignore_eos && eos.contains(&rec.token) {
                    finish = Some(FinishReason::Eos);
                } else if r.generated.len() >= r.spec.max_new {
                    finish = Some(FinishReason::Length);
                }
            } else if r.spec.max_new == 0 && r.fed >= r.spec.tokens.len() {
                finish = Some(FinishReason::Length);
            }
            if let Some(reason) = finish {
                let r = self.running.remove(i);
                events.push(Event::Finished { seq: r.id, reason });
                self.release(&r);
            }
        }
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{cfg, drive, rec, run, spec};
    use super::*;

    #[test]
    fn chunked_prefill_mixes_with_decode_under_the_budget() {
        let mut s = Scheduler::new(cfg(4, 4, 6, 64)).unwrap();
        let a = s.submit(spec(0, 3, 2)).unwrap();
        let b = s.submit(spec(1, 10, 1)).unwrap();
        let p = s.plan();
        // a whole (3), then b's first chunk limited by the budget (3 of 6).
        let shape: Vec<_> = p
            .rows
            .iter()
            .map(|r| (r.seq, r.pos0, r.tokens.len(), r.sample))
            .collect();
        assert_eq!(shape, vec![(a, 0, 3, true), (b, 0, 3, false)]);
        s.apply(&p, &run(&p)).unwrap();
        let p = s.plan();
        let shape: Vec<_> = p
            .rows
            .iter()
            .map(|r| (r.seq, r.pos0, r.tokens.clone(), r.sample))
            .collect();
        // a decodes its sampled token at position 3; b continues with a chunk of 4.
        assert_eq!(
            shape,
            vec![(a, 3, vec![7], true), (b, 3, vec![4, 5, 6, 7], false)]
        );
        let ev = s.apply(&p, &run(&p)).unwrap();
        assert!(ev.contains(&Event::Finished {
            seq: a,
            reason: FinishReason::Length
        }));
        let p = s.plan();
        assert_eq!(p.rows.len(), 1);
        assert_eq!((p.rows[0].pos0, p.rows[0].tokens.len()), (7, 3));
        assert!(p.rows[0].sample);
        let ev = s.apply(&p, &run(&p)).unwrap();
        assert!(matches!(ev.last(), Some(Event::Finished { seq, .. }) if *seq == b));
        assert!(s.is_idle());
        assert_eq!(s.kv_blocks().0, 0);
    }

    #[test]
    fn prompt_rows_beside_decode_rows_stay_within_their_budget() {
        let mut s = Scheduler::new(SchedulerConfig {
            prefill_beside_decode: 2,
            ..cfg(4, 8, 8, 64)
        })
        .unwrap();
        let a = s.submit(spec(0, 3, 10)).unwrap();
        let p = s.plan();
        // No decode row yet: the prompt takes the whole step budget.
        assert_eq!(p.rows.len(), 1);
        assert_eq!((p.rows[0].seq, p.rows[0].tokens.len()), (a, 3));
        s.apply(&p, &run(&p)).unwrap();
        let b = s.submit(spec(1, 7, 1)).unwrap();
        let mut prompt_rows: Vec<usize> = Vec::new();
        while prompt_rows.iter().sum::<usize>() < 7 {
            let p = s.plan();
            let decode = p.rows.iter().any(|r| r.seq == a);
            let fed: usize = p
                .rows
                .iter()
                .filter(|r| r.seq == b)
                .map(|r| r.tokens.len())
                .sum();
            assert!(decode, "a decodes every step while b prefills");
            prompt_rows.push(fed);
            s.apply(&p, &run(&p)).unwrap();
        }
        // Beside a's decode rows, b's 7 prompt rows come 2 at a time.
        assert_eq!(prompt_rows, vec![2, 2, 2, 1]);
    }

    #[test]
    fn prompt_rows_beside_decode_rows_round_the_step_up() {
        let mut s = Scheduler::new(SchedulerConfig {
            prefill_beside_decode: 2,
            row_multiple: 4,
            ..cfg(4, 8, 8, 64)
        })
        .unwrap();
        let a = s.submit(spec(0, 3, 10)).unwrap();
        let p = s.plan();
        s.apply(&p, &run(&p)).unwrap();
        let b = s.submit(spec(1, 7, 1)).unwrap();
        let mut steps: Vec<(usize, usize)> = Vec::new();
        while steps.iter().map(|s| s.1).sum::<usize>() < 7 {
            let p = s.plan();
            let rows = |seq| -> usize {
                p.rows
                    .iter()
                    .filter(|r| r.seq == seq)
                    .map(|r| r.tokens.len())
                    .sum()
            };
            steps.push((rows(a), rows(b)));
            s.apply(&p, &run(&p)).unwrap();
        }
        // One decode row of a and 2 prompt rows of b make 3: b takes a third to make the
        // step a multiple of 4, until its prompt runs out.
        assert_eq!(steps, vec![(1, 3), (1, 3), (1, 1)]);
    }

    #[test]
    fn the_prefill_budget_beside_decode_changes_no_token() {
        let specs: Vec<SeqSpec> = (0..6).map(|k| spec(k, 5 + 7 * k as usize, 9)).collect();
        let tokens = |beside: usize, row_multiple: usize| {
            let mut s = Scheduler::new(SchedulerConfig {
                prefill_beside_decode: beside,
                row_multiple,
                ..cfg(4, 16, 32, 64)
            })
            .unwrap();
            for sp in &specs {
                s.submit(sp.clone()).unwrap();
            }
            let (tokens, rows) = drive(&mut s);
            (tokens, rows.len())
        };
        let (whole, whole_rows) = tokens(32, 1);
        let (small, small_rows) = tokens(3, 1);
        let (rounded, _) = tokens(3, 8);
        assert_eq!(small, whole);
        assert_eq!(rounded, whole);
        assert!(
            small_rows > whole_rows,
            "a budget of 3 prompt rows beside decode rows cuts the prompts into more chunks ({small_rows} rows vs {whole_rows})"
        );
    }

    /// A constraint whose mask names how many tokens it was told were generated, and
    /// keeps every `generated` it was asked about.
    struct Counting(std::sync::Arc<std::sync::Mutex<Vec<Vec<u32>>>>);

    impl crate::constraint::TokenConstraint for Counting {
        fn allowed(&mut self, generated: &[u32]) -> crate::constraint::TokenMask {
            self.0.lock().unwrap().push(generated.to_vec());
            crate::constraint::TokenMask::Ids(vec![100 + generated.len() as u32])
        }
    }

    #[test]
    fn constrained_rows_carry_the_mask_of_their_own_tokens() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut s = Scheduler::new(cfg(4, 4, 8, 64)).unwrap();
        let mut c = spec(0, 6, 3);
        c.constraint = Some(crate::constraint::Constraint::new(Counting(seen.clone())));
        let a = s.submit(c).unwrap();
        let b = s.submit(spec(1, 2, 3)).unwrap();
        let mut masks = Vec::new();
        while !s.is_idle() {
            let p = s.plan();
            for r in &p.rows {
                // Only sampled rows of the constrained sequence have a mask.
                assert_eq!(r.allowed.is_some(), r.seq == a && r.sample, "{r:?}");
                if let Some(m) = &r.allowed {
                    masks.push(m.clone());
                }
                assert!(r.seq == a || r.seq == b);
            }
            s.apply(&p, &run(&p)).unwrap();
        }
        use crate::constraint::TokenMask::Ids;
        assert_eq!(masks, vec![Ids(vec![100]), Ids(vec![101]), Ids(vec![102])]);
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen, vec![vec![], vec![7], vec![7, 7]]);
    }

    /// [`Counting`], its masks computed while the step runs.
    struct Later(Counting);

    impl crate::constraint::TokenConstraint for Later {
        fn allowed(&mut self, generated: &[u32]) -> crate::constraint::TokenMask {
            self.0.allowed(generated)
        }
        fn masks_later(&mut self, _generated: &[u32]) -> bool {
            true
        }
    }

    #[test]
    fn masks_computed_later_are_those_of_the_plans_tokens() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut s = Scheduler::new(cfg(4, 4, 8, 64)).unwrap();
        let mut c = spec(0, 6, 3);
        c.constraint = Some(crate::constraint::Constraint::new(Later(Counting(
            seen.clone(),
        ))));
        let a = s.submit(c).unwrap();
        s.submit(spec(1, 2, 3)).unwrap();
        let mut masks = Vec::new();
        while !s.is_idle() {
            let p = s.plan();
            for r in &p.rows {
                assert!(r.allowed.is_none(), "{r:?}");
                assert_eq!(r.mask_later, r.seq == a && r.sample, "{r:?}");
            }
            let late = s.late_masks(&p).unwrap();
            assert_eq!(late.len(), p.rows.iter().filter(|r| r.mask_later).count());
            masks.extend(late);
            s.apply(&p, &run(&p)).unwrap();
        }
        use crate::constraint::TokenMask::Ids;
        assert_eq!(masks, vec![Ids(vec![100]), Ids(vec![101]), Ids(vec![102])]);
        assert_eq!(*seen.lock().unwrap(), vec![vec![], vec![7], vec![7, 7]]);
    }

    #[test]
    fn min_tokens_masks_only_the_rows_before_it_is_met() {
        let mut s = Scheduler::new(cfg(4, 4, 8, 64)).unwrap();
        let mut c = spec(0, 6, 4);
        c.constraint = crate::constraint::MinTokens::wrap(2, &[2], 300, None);
        let a = s.submit(c).unwrap();
        let mut masked = Vec::new();
        while !s.is_idle() {
            let p = s.plan();
            for r in p.rows.iter().filter(|r| r.seq == a && r.sample) {
                masked.push(r.allowed.as_ref().map(|m| m.allows(2)));
            }
            s.apply(&p, &run(&p)).unwrap();
        }
        // Two host-drawn rows banning token 2, then the unmasked draw.
        assert_eq!(masked, vec![Some(false), Some(false), None, None]);
    }

    #[test]
    fn full_cache_queues_and_cancel_frees() {
        // 3 blocks of 64: a request of 128 positions takes 2, so the second waits.
        let mut s = Scheduler::new(cfg(4, 64, 64, 3)).unwrap();
        let a = s.submit(spec(0, 64, 64)).unwrap();
        let b = s.submit(spec(1, 64, 64)).unwrap();
        let p = s.plan();
        assert_eq!(p.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![a]);
        assert_eq!((s.running(), s.waiting(), s.kv_blocks()), (1, 1, (2, 3)));
        // Cancelled mid-step: its result is ignored and its blocks go back.
        assert!(s.cancel(a));
        assert!(s.apply(&p, &run(&p)).unwrap().is_empty());
        let p = s.plan();
        assert_eq!(p.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![b]);
        assert!(!s.cancel(a));
        let e = s.submit(spec(2, 4, 1100)).unwrap_err().to_string();
        assert!(e.contains("1104 positions"), "{e}");
        let e = s.submit(spec(3, 200, 0)).unwrap_err().to_string();
        assert!(e.contains("needs 4 KV blocks but the cache has 3"), "{e}");
    }

    #[test]
    fn eos_stops_and_scoring_targets_follow_the_prompt() {
        let mut s = Scheduler::new(cfg(2, 2, 64, 64)).unwrap();
        let mut sc = spec(5, 5, 0);
        sc.score_from = Some(2);
        let id = s.submit(sc).unwrap();
        let mut targets = Vec::new();
        loop {
            let p = s.plan();
            if p.is_empty() {
                break;
            }
            for r in &p.rows {
                assert!(!r.sample);
                targets.extend(r.targets.iter().map(|&(o, t)| (r.pos0 + o as usize, t)));
            }
            s.apply(&p, &run(&p)).unwrap();
        }
        // Positions 1..4 predict tokens 3, 4, 5 (score_from 2 skips token 2).
        assert_eq!(targets, vec![(1, 3), (2, 4), (3, 5)]);
        assert!(s.is_idle(), "{id}");

        let g = s.submit(spec(6, 2, 10)).unwrap();
        let p = s.plan();
        let res = vec![RowResult {
            seq: g,
            scored: vec![],
            sampled: Some(rec(2)),
            routes: vec![],
        }];
        let ev = s.apply(&p, &res).unwrap();
        assert_eq!(
            ev.last(),
            Some(&Event::Finished {
                seq: g,
                reason: FinishReason::Eos
            })
        );
    }

    #[test]
    fn preempted_sequences_recompute_and_end_with_the_same_tokens() {
        let specs = [spec(0, 5, 150), spec(1, 6, 150), spec(2, 3, 150)];
        // Alone with room: the reference tokens.
        let mut roomy = Scheduler::new(cfg(3, 64, 64, 64)).unwrap();
        let ids: Vec<SeqId> = specs
            .iter()
            .map(|sp| roomy.submit(sp.clone()).unwrap())
            .collect();
        let (want, _) = drive(&mut roomy);
        assert_eq!(roomy.preemptions(), 0);

        // 7 blocks of 64 positions for three sequences of up to 156 positions (3 blocks).
        let mut tight_cfg = cfg(3, 64, 64, 7);
        tight_cfg.preempt = true;
        let mut tight = Scheduler::new(tight_cfg).unwrap();
        for (sp, &id) in specs.iter().zip(&ids) {
            assert_eq!(tight.submit(sp.clone()).unwrap(), id);
        }
        let (got, rows) = drive(&mut tight);
        assert!(tight.preemptions() > 0, "the cache was never short");
        assert_eq!(got, want, "preemption changed the tokens");
        for (id, toks) in &got {
            assert_eq!(toks.len(), 150, "sequence {id}: every token reported once");
        }
        // A recompute feeds the known tokens again from position 0, in one chunk.
        let recomputed = rows
            .iter()
            .filter(|(_, pos0, t)| *pos0 == 0 && t.len() > 6)
            .count();
        assert!(recomputed > 0, "{rows:?}");
        for (seq, pos0, t) in &rows {
            let sp = &specs[*seq as usize];
            let known: Vec<u32> = sp.tokens.iter().chain(&want[seq]).copied().collect();
            assert_eq!(
                &known[*pos0..*pos0 + t.len()],
                &t[..],
                "sequence {seq} at {pos0}"
            );
        }
        assert_eq!(tight.kv_blocks().0, 0);
    }

    #[test]
    fn a_preempted_scoring_request_reports_each_target_once() {
        // Prefill one position per step, so the generating sequence outgrows the cache
        // while the scoring one is half way.
        let mut c = cfg(2, 1, 64, 6);
        c.preempt = true;
        let mut s = Scheduler::new(c).unwrap();
        let g = s.submit(spec(0, 4, 200)).unwrap();
        let mut sc = spec(1, 256, 0);
        sc.score_from = Some(1);
        let sid = s.submit(sc).unwrap();
        let mut targets = Vec::new();
        for _ in 0..10_000 {
            let p = s.plan();
            if p.is_empty() {
                break;
            }
            let res = run(&p);
            for ev in s.apply(&p, &res).unwrap() {
                if let Event::Scored { seq, records } = ev {
                    assert_eq!(seq, sid);
                    targets.extend(records.iter().map(|r| r.token));
                }
            }
        }
        assert!(s.is_idle(), "{g}");
        assert!(
            s.preemptions() > 0,
            "the scoring request was never preempted"
        );
        assert_eq!(targets, (2..=256).collect::<Vec<u32>>());
    }
}
