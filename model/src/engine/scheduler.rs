//! Rank 0's scheduler: requests join and leave at every step, prompts are prefilled in
//! chunks mixed with decode rows under a per-step token budget, and KV capacity is
//! reserved in blocks at admission (requests wait in a FIFO queue while it is full).
//!
//! Admission reserves blocks for the prompt and every token the request may generate, so
//! a running sequence never runs out and nothing is ever preempted. (Preemption by
//! recompute would also keep the bits, since prefill equals decode bit for bit.)

use std::collections::VecDeque;

use crate::engine::kv::{BlockPool, SlotPool};
use crate::engine::plan::{PlanRow, Record, RowResult, StepPlan};
use crate::error::{MResult, ModelError};
use crate::runner::FinishReason;
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
    waiting: VecDeque<(SeqId, SeqSpec)>,
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
        self.waiting.push_back((id, spec));
        Ok(id)
    }

    /// Drops a waiting or running sequence and frees its KV; false if it is unknown
    /// (already finished).
    pub fn cancel(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.waiting.iter().position(|(w, _)| *w == id) {
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

    /// Admits waiting requests in arrival order while a slot and their blocks are free
    /// (FIFO: a large request at the head is not overtaken).
    fn admit(&mut self) {
        while let Some((_, spec)) = self.waiting.front() {
            let need = self
                .blocks
                .blocks_for(spec.tokens.len().saturating_add(spec.max_new));
            if self.slots.in_use() == self.slots.total() {
                break;
            }
            let Some(blocks) = self.blocks.take(need) else {
                break;
            };
            let Some(slot) = self.slots.take() else {
                self.blocks.give_back(blocks);
                break;
            };
            let Some((id, spec)) = self.waiting.pop_front() else {
                break;
            };
            self.running.push(Running {
                id,
                spec,
                slot,
                blocks,
                fed: 0,
                generated: Vec::new(),
            });
        }
    }

    /// The next step: decode rows of every sequence that has one, then prefill chunks in
    /// admission order, within the token budget. Empty when there is nothing to do.
    pub fn plan(&mut self) -> StepPlan {
        self.admit();
        let mut budget = self.cfg.step_tokens;
        let mut rows = Vec::new();
        for r in &self.running {
            if budget == 0 {
                break;
            }
            if r.fed >= r.spec.tokens.len() && r.fed < r.known_len() {
                rows.push(self.row(r, r.fed, r.fed + 1));
                budget -= 1;
            }
        }
        for r in &self.running {
            if budget == 0 {
                break;
            }
            let prompt = r.spec.tokens.len();
            if r.fed < prompt {
                let end = prompt.min(r.fed.saturating_add(self.cfg.chunk.min(budget)));
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
                .filter(|&p| p + 1 >= from && p + 1 < prompt)
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
            prefill: start < prompt,
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
}
