//! Rank 0's scheduler: requests join and leave at every step, prompts are prefilled in
//! chunks mixed with decode rows under a per-step token budget, and KV capacity is
//! accounted in blocks (requests wait in a FIFO queue while it is full).
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

use std::collections::VecDeque;

use crate::engine::kv::{BlockPool, SlotPool};
use crate::engine::plan::{PlanRow, Record, RowResult, StepPlan};
use crate::error::{MResult, ModelError};
use crate::sampling::Sampling;

pub type SeqId = u64;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// KV-cache slots (sequences that can run at once).
    pub slots: usize,
    /// Positions per slot; a request needs `prompt + max_new` of them.
    pub max_seq_len: usize,
    /// Largest prefill chunk per sequence and step.
    pub chunk: usize,
    /// Most new tokens (rows) in one step; decode rows are served first.
    pub step_tokens: usize,
    pub block_size: usize,
    pub kv_blocks: usize,
    /// Generation ends when one of these is sampled.
    pub eos: Vec<u32>,
    /// Grow KV per token and preempt by recompute when it runs out, instead of reserving
    /// every position a request may use at admission (see the module doc).
    pub preempt: bool,
}

impl SchedulerConfig {
    /// One slot per request and no limits: the first step prefills every prompt whole,
    /// then one decode row per live sequence each step (the static batch of `generate`).
    pub fn offline(slots: usize, max_seq_len: usize, eos: Vec<u32>) -> Self {
        let block_size = 16;
        SchedulerConfig {
            slots,
            max_seq_len,
            chunk: usize::MAX,
            step_tokens: usize::MAX,
            block_size,
            kv_blocks: slots * max_seq_len.div_ceil(block_size),
            eos,
            preempt: false,
        }
    }
}

/// What a request asks of the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqSpec {
    /// The id the sampling draw is keyed by (see `PlanRow::sample_key`).
    pub sample_key: u64,
    /// The prompt (for scoring, the whole sequence).
    pub tokens: Vec<u32>,
    /// Teacher-forced records for the prompt positions `>= score_from` (≥ 1).
    pub score_from: Option<usize>,
    pub max_new: usize,
    pub sampling: Sampling,
    pub n_top: usize,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
}

/// Why a sequence stopped generating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Length,
    Eos,
}

/// What a step did to a sequence, in plan order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Teacher-forced records of prompt positions, in position order.
    Scored {
        seq: SeqId,
        records: Vec<Record>,
    },
    Token {
        seq: SeqId,
        record: Record,
    },
    Finished {
        seq: SeqId,
        reason: FinishReason,
    },
}

#[derive(Debug)]
struct Running {
    id: SeqId,
    spec: SeqSpec,
    slot: usize,
    /// Reserved KV blocks (the block table of a paged layout).
    blocks: Vec<u32>,
    /// Tokens already in the cache.
    fed: usize,
    generated: Vec<u32>,
    /// Positions below this are fed as prefill chunks: the prompt, and after a preemption
    /// the tokens generated before it.
    prefill_to: usize,
    /// Prompt positions whose scoring target was already reported (a recompute after a
    /// preemption does not report them again).
    scored_below: usize,
}

/// A request in the queue: new, or preempted with what it had generated.
#[derive(Debug)]
struct Waiting {
    id: SeqId,
    spec: SeqSpec,
    generated: Vec<u32>,
    scored_below: usize,
}

impl Waiting {
    fn known_len(&self) -> usize {
        self.spec.tokens.len() + self.generated.len()
    }
}

impl Running {
    fn known(&self, i: usize) -> u32 {
        if i < self.spec.tokens.len() {
            self.spec.tokens[i]
        } else {
            self.generated[i - self.spec.tokens.len()]
        }
    }

    fn known_len(&self) -> usize {
        self.spec.tokens.len() + self.generated.len()
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    slots: SlotPool,
    blocks: BlockPool,
    waiting: VecDeque<Waiting>,
    preemptions: u64,
    running: Vec<Running>,
    next_id: SeqId,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> MResult<Self> {
        if cfg.slots == 0 || cfg.chunk == 0 || cfg.step_tokens == 0 || cfg.block_size == 0 {
            return Err(ModelError::Plan(format!(
                "scheduler limits must be at least 1: slots {}, chunk {}, step tokens {}, block size {}",
                cfg.slots, cfg.chunk, cfg.step_tokens, cfg.block_size
            )));
        }
        Ok(Scheduler {
            slots: SlotPool::new(cfg.slots),
            blocks: BlockPool::new(cfg.block_size, cfg.kv_blocks),
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

    /// Queues a request; errors if it could never run (empty, longer than a slot, or
    /// needing more blocks than the cache has).
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
        let blocks = self.blocks.blocks_for(needed);
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
            self.release(r);
            return true;
        }
        false
    }

    fn release(&mut self, r: Running) {
        self.slots.give_back(r.slot);
        self.blocks.give_back(r.blocks);
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

    /// (used, total) KV blocks.
    pub fn kv_blocks(&self) -> (usize, usize) {
        (self.blocks.used(), self.blocks.total())
    }

    /// Sequences preempted so far (each recomputed on readmission).
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Blocks a waiting request takes at admission.
    fn admission_blocks(&self, w: &Waiting) -> usize {
        let positions = if self.cfg.preempt {
            w.known_len()
        } else {
            w.spec.tokens.len().saturating_add(w.spec.max_new)
        };
        self.blocks.blocks_for(positions)
    }

    /// Admits waiting requests in arrival order while a slot and their blocks are free
    /// (FIFO: a large request at the head is not overtaken). Under `preempt`, one spare
    /// block per running sequence stays free for their growth, so that a request admitted
    /// now is not preempted again at once.
    fn admit(&mut self) {
        while let Some(w) = self.waiting.front() {
            let need = self.admission_blocks(w);
            let spare = if self.cfg.preempt {
                self.running.len()
            } else {
                0
            };
            if self.slots.in_use() == self.slots.total()
                || self.blocks.total() - self.blocks.used() < need + spare
            {
                break;
            }
            let Some(blocks) = self.blocks.take(need) else {
                break;
            };
            let Some(slot) = self.slots.take() else {
                self.blocks.give_back(blocks);
                break;
            };
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            let prefill_to = w.known_len();
            self.running.push(Running {
                id: w.id,
                spec: w.spec,
                slot,
                blocks,
                fed: 0,
                generated: w.generated,
                prefill_to,
                scored_below: w.scored_below,
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
                self.blocks.blocks_for(r.fed + 1)
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
        self.slots.give_back(r.slot);
        self.blocks.give_back(r.blocks);
        self.preemptions += 1;
        self.waiting.push_front(Waiting {
            id: r.id,
            spec: r.spec,
            generated: r.generated,
            scored_below: r.scored_below,
        });
    }

    /// The next step: decode rows of every sequence that has one, then prefill chunks in
    /// admission order, within the token budget. Empty when there is nothing to do.
    pub fn plan(&mut self) -> StepPlan {
        self.admit();
        if self.cfg.preempt {
            self.grow();
        }
        let mut budget = self.cfg.step_tokens;
        let mut rows = Vec::new();
        for r in &self.running {
            if budget == 0 {
                break;
            }
            if r.fed >= r.prefill_to && r.fed < r.known_len() {
                rows.push(self.row(r, r.fed, r.fed + 1));
                budget -= 1;
            }
        }
        for r in &self.running {
            if budget == 0 {
                break;
            }
            if r.fed < r.prefill_to {
                let end = r
                    .prefill_to
                    .min(r.fed.saturating_add(self.cfg.chunk.min(budget)));
                rows.push(self.row(r, r.fed, end));
                budget -= end - r.fed;
            }
        }
        StepPlan { rows }
    }

    /// The plan row feeding positions `start..end` of `r`.
    fn row(&self, r: &Running, start: usize, end: usize) -> PlanRow {
        let prompt = r.spec.tokens.len();
        let targets = match r.spec.score_from {
            Some(from) => (start..end)
                .filter(|&p| p + 1 >= from && p + 1 < prompt && p >= r.scored_below)
                .map(|p| ((p - start) as u32, r.spec.tokens[p + 1]))
                .collect(),
            None => Vec::new(),
        };
        PlanRow {
            seq: r.id,
            sample_key: r.spec.sample_key,
            slot: r.slot,
            pos0: start,
            tokens: (start..end).map(|i| r.known(i)).collect(),
            targets,
            sample: end == r.known_len() && r.generated.len() < r.spec.max_new,
            prefill: start < r.prefill_to,
            sampling: r.spec.sampling,
            n_top: r.spec.n_top,
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
                self.release(r);
            }
        }
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(key: u64, prompt: usize, max_new: usize) -> SeqSpec {
        SeqSpec {
            sample_key: key,
            tokens: (1..=prompt as u32).collect(),
            score_from: None,
            max_new,
            sampling: Sampling::greedy(),
            n_top: 0,
            ignore_eos: false,
        }
    }

    fn rec(token: u32) -> Record {
        Record {
            token,
            logprob: -1.0,
            top: Vec::new(),
            digest: 0,
        }
    }

    /// Fake execution: every sampled token is `7`, every target is echoed.
    fn run(plan: &StepPlan) -> Vec<RowResult> {
        plan.rows
            .iter()
            .map(|r| RowResult {
                seq: r.seq,
                scored: r.targets.iter().map(|&(_, t)| rec(t)).collect(),
                sampled: r.sample.then(|| rec(7)),
            })
            .collect()
    }

    fn cfg(slots: usize, chunk: usize, step: usize, blocks: usize) -> SchedulerConfig {
        SchedulerConfig {
            slots,
            max_seq_len: 64,
            chunk,
            step_tokens: step,
            block_size: 4,
            kv_blocks: blocks,
            eos: vec![2],
            preempt: false,
        }
    }

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
    fn full_cache_queues_and_cancel_frees() {
        // 3 blocks of 4: a request of 8 positions takes 2, so the second waits.
        let mut s = Scheduler::new(cfg(4, 64, 64, 3)).unwrap();
        let a = s.submit(spec(0, 4, 4)).unwrap();
        let b = s.submit(spec(1, 4, 4)).unwrap();
        let p = s.plan();
        assert_eq!(p.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![a]);
        assert_eq!((s.running(), s.waiting(), s.kv_blocks()), (1, 1, (2, 3)));
        // Cancelled mid-step: its result is ignored and its blocks go back.
        assert!(s.cancel(a));
        assert!(s.apply(&p, &run(&p)).unwrap().is_empty());
        let p = s.plan();
        assert_eq!(p.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![b]);
        assert!(!s.cancel(a));
        let e = s.submit(spec(2, 4, 100)).unwrap_err().to_string();
        assert!(e.contains("104 positions"), "{e}");
        let e = s.submit(spec(3, 13, 0)).unwrap_err().to_string();
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

    /// Runs to idle with a fake model whose token at a position depends only on the
    /// request and the position (as the real engine's does); returns each sequence's
    /// tokens as reported by Token events, and every plan row's (seq, pos0, tokens).
    #[allow(clippy::type_complexity)]
    fn drive(
        s: &mut Scheduler,
    ) -> (
        std::collections::BTreeMap<SeqId, Vec<u32>>,
        Vec<(SeqId, usize, Vec<u32>)>,
    ) {
        let mut out = std::collections::BTreeMap::new();
        let mut rows = Vec::new();
        for _ in 0..1000 {
            let p = s.plan();
            if p.is_empty() {
                break;
            }
            let res: Vec<RowResult> = p
                .rows
                .iter()
                .map(|r| {
                    rows.push((r.seq, r.pos0, r.tokens.clone()));
                    let pos = (r.pos0 + r.tokens.len()) as u32;
                    RowResult {
                        seq: r.seq,
                        scored: r.targets.iter().map(|&(_, t)| rec(t)).collect(),
                        sampled: r
                            .sample
                            .then(|| rec(3 + (r.sample_key as u32 * 31 + pos) % 50)),
                    }
                })
                .collect();
            for ev in s.apply(&p, &res).unwrap() {
                if let Event::Token { seq, record } = ev {
                    out.entry(seq).or_insert_with(Vec::new).push(record.token);
                }
            }
        }
        assert!(s.is_idle());
        (out, rows)
    }

    #[test]
    fn preempted_sequences_recompute_and_end_with_the_same_tokens() {
        let specs = [spec(0, 5, 12), spec(1, 6, 12), spec(2, 3, 12)];
        // Alone with room: the reference tokens.
        let mut roomy = Scheduler::new(cfg(3, 64, 64, 64)).unwrap();
        let ids: Vec<SeqId> = specs
            .iter()
            .map(|sp| roomy.submit(sp.clone()).unwrap())
            .collect();
        let (want, _) = drive(&mut roomy);
        assert_eq!(roomy.preemptions(), 0);

        // 12 blocks of 4 positions for three sequences of up to 17–18 positions.
        let mut tight_cfg = cfg(3, 64, 64, 12);
        tight_cfg.preempt = true;
        let mut tight = Scheduler::new(tight_cfg).unwrap();
        for (sp, &id) in specs.iter().zip(&ids) {
            assert_eq!(tight.submit(sp.clone()).unwrap(), id);
        }
        let (got, rows) = drive(&mut tight);
        assert!(tight.preemptions() > 0, "the cache was never short");
        assert_eq!(got, want, "preemption changed the tokens");
        for (id, toks) in &got {
            assert_eq!(toks.len(), 12, "sequence {id}: every token reported once");
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
        let g = s.submit(spec(0, 4, 12)).unwrap();
        let mut sc = spec(1, 16, 0);
        sc.score_from = Some(1);
        let sid = s.submit(sc).unwrap();
        let mut targets = Vec::new();
        for _ in 0..1000 {
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
        assert_eq!(targets, (2..=16).collect::<Vec<u32>>());
    }
}
