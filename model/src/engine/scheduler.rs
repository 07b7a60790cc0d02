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

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};

use arbor_kernels::paged::{blocks_for, KV_BLOCK};

use crate::engine::kv::{block_hash, chain_hashes, BlockPool, PrefixStats};
use crate::engine::plan::{PlanRow, Record, RowResult, StepPlan};
use crate::error::{MResult, ModelError};
use crate::sampling::Sampling;

pub type SeqId = u64;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most sequences running at once.
    pub max_running: usize,
    /// Positions a request may use: it needs `prompt + max_new` of them (the context limit).
    pub max_seq_len: usize,
    /// Largest prefill chunk per sequence and step.
    pub chunk: usize,
    /// Most new tokens (rows) in one step; decode rows are served first.
    pub step_tokens: usize,
    /// Most rows whose logits one step computes (scoring targets and sampled rows): bounds
    /// the step's logits memory; a scoring prompt's chunk is cut to fit.
    pub step_outputs: usize,
    /// KV blocks in the cache (of `arbor_kernels::paged::KV_BLOCK` positions).
    pub kv_blocks: usize,
    /// Generation ends when one of these is sampled.
    pub eos: Vec<u32>,
    /// Grow KV per token and preempt by recompute when it runs out, instead of reserving
    /// every position a request may use at admission (see the module doc).
    pub preempt: bool,
    /// Plan no decode row while a sequence still has prompt to prefill (offline: a static
    /// batch prefills every prompt, then decodes, so prefill and decode time apart).
    pub prefill_first: bool,
    /// Share full KV blocks between sequences whose tokens up to them are equal (the
    /// prefix cache, `engine::kv`): a new sequence starts computing at its first position
    /// not cached.
    pub prefix_cache: bool,
}

/// Rows per step of offline `generate` / `score`, and of `arbor serve` by default: prompts
/// in chunks of at most this many rows (the same bits as whole).
pub const DEFAULT_STEP_TOKENS: usize = 8192;
/// Logits rows per step by default (see `SchedulerConfig::step_outputs`).
pub const DEFAULT_STEP_OUTPUTS: usize = 1024;

impl SchedulerConfig {
    /// A static batch over a cache of `kv_blocks` blocks: as many requests as their blocks
    /// allow run at once, every position reserved at admission; their prompts are
    /// prefilled (within `step_tokens` rows a step) before any decodes, then one decode
    /// row per live sequence each step.
    pub fn offline(
        max_seq_len: usize,
        kv_blocks: usize,
        step_tokens: usize,
        eos: Vec<u32>,
    ) -> Self {
        SchedulerConfig {
            max_running: usize::MAX,
            max_seq_len,
            chunk: step_tokens,
            step_tokens,
            step_outputs: DEFAULT_STEP_OUTPUTS,
            kv_blocks,
            eos,
            preempt: false,
            prefill_first: true,
            prefix_cache: true,
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
    /// The block table: the blocks of positions `0..64·len`, in order.
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
    /// The chain hashes of its full blocks known so far (`engine::kv::chain_hashes`).
    hashes: Vec<u64>,
    /// Blocks registered in the prefix cache (or found there), from the first.
    registered: usize,
    /// Blocks `registered..pending_end` are ones this sequence computes that others wait
    /// for (`Scheduler::pending`).
    pending_end: usize,
    /// Whether its blocks go to the prefix cache (not after the cache was dropped).
    cacheable: bool,
}

/// A request in the queue: new, or preempted with what it had generated.
#[derive(Debug)]
struct Waiting {
    id: SeqId,
    spec: SeqSpec,
    generated: Vec<u32>,
    scored_below: usize,
    /// The chain hashes of its known tokens' full blocks, once looked up.
    hashes: Option<Vec<u64>>,
}

impl Waiting {
    fn known_len(&self) -> usize {
        self.spec.tokens.len() + self.generated.len()
    }

    /// The prompt and what was generated before a preemption.
    fn known(&self) -> Cow<'_, [u32]> {
        if self.generated.is_empty() {
            Cow::Borrowed(&self.spec.tokens)
        } else {
            Cow::Owned([&self.spec.tokens[..], &self.generated[..]].concat())
        }
    }

    /// Positions a prefix-cache hit may cover: all known but the last (its row gives the
    /// logits to sample from), and none whose scoring record is still owed.
    fn reusable(&self) -> usize {
        let all = self.known_len().saturating_sub(1);
        match target_range(&self.spec, self.scored_below) {
            (lo, hi) if lo < hi => all.min(lo),
            _ => all,
        }
    }
}

/// The prompt positions whose rows a sequence must still score: `[lo, hi)`.
fn target_range(spec: &SeqSpec, scored_below: usize) -> (usize, usize) {
    match spec.score_from {
        Some(from) => (
            from.saturating_sub(1).max(scored_below),
            spec.tokens.len().saturating_sub(1),
        ),
        None => (0, 0),
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
    blocks: BlockPool,
    waiting: VecDeque<Waiting>,
    preemptions: u64,
    running: Vec<Running>,
    next_id: SeqId,
    /// Chain hashes of blocks running sequences are computing and will register, with how
    /// many compute each: a waiting request whose next uncached block is one of them waits
    /// for it (the `n` samples of one prompt share its prefill) instead of computing it too.
    pending: HashMap<u64, usize>,
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
            || cfg.step_outputs == 0
            || cfg.kv_blocks == 0
        {
            return Err(ModelError::Plan(format!(
                "scheduler limits must be at least 1: running sequences {}, chunk {}, step tokens {}, step outputs {}, KV blocks {}",
                cfg.max_running, cfg.chunk, cfg.step_tokens, cfg.step_outputs, cfg.kv_blocks
            )));
        }
        Ok(Scheduler {
            blocks: pool,
            pending: HashMap::new(),
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
            unpend(&mut self.pending, *h);
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

    /// Blocks whose contents the prefix cache holds (held or idle).
    pub fn cached_blocks(&self) -> usize {
        self.blocks.cached()
    }

    /// Positions looked up in the prefix cache and found there, so far.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.blocks.stats()
    }

    /// Forgets every cached block: to call when the weights change (the cached blocks hold
    /// the old model's KV). Running sequences keep their blocks, and register none any
    /// more; nothing cached before is found again.
    pub fn drop_prefix_cache(&mut self) {
        self.blocks.drop_cache();
        self.pending.clear();
        for r in &mut self.running {
            r.cacheable = false;
            r.pending_end = r.registered;
        }
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
            let (hashes, hits, reusable) = {
                let w = &self.waiting[i];
                let known = w.known();
                let hashes = match (&w.hashes, prefix) {
                    (_, false) => Vec::new(),
                    (Some(h), true) => h.clone(),
                    (None, true) => chain_hashes(&known, known.len() / KV_BLOCK),
                };
                let reusable = (w.reusable() / KV_BLOCK).min(hashes.len());
                let hits = self.blocks.lookup(&known, &hashes[..reusable]);
                (hashes, hits, reusable)
            };
            if prefix && self.waiting[i].hashes.is_none() {
                self.waiting[i].hashes = Some(hashes.clone());
            }
            if hits.len() < reusable && self.pending.contains_key(&hashes[hits.len()]) {
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
            for h in &hashes[hits.len()..] {
                *self.pending.entry(*h).or_insert(0) += 1;
            }
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
    /// the token and output budgets. Empty when there is nothing to do.
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
        StepPlan { rows }
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

/// One fewer sequence computes the block of chain hash `h`.
fn unpend(pending: &mut HashMap<u64, usize>, h: u64) {
    if let Some(n) = pending.get_mut(&h) {
        *n -= 1;
        if *n == 0 {
            pending.remove(&h);
        }
    }
}

/// Registers the full blocks of `r` computed since the last call in the prefix cache.
/// Where the cache already holds a block of the same tokens after the same prefix, `r`
/// takes that one instead of its own (the same bits: a prefix's KV does not depend on how
/// it was computed), so that later sequences find one chain.
fn register_computed(pool: &mut BlockPool, pending: &mut HashMap<u64, usize>, r: &mut Running) {
    if !r.cacheable || !pool.prefix_cache() {
        return;
    }
    while r.registered < r.fed / KV_BLOCK {
        let b = r.registered;
        let tokens: Vec<u32> = (b * KV_BLOCK..(b + 1) * KV_BLOCK)
            .map(|p| r.known(p))
            .collect();
        let h = match r.hashes.get(b) {
            Some(&h) => h,
            None => {
                let h = block_hash(b.checked_sub(1).map(|p| r.hashes[p]), &tokens);
                r.hashes.push(h);
                h
            }
        };
        let parent = b.checked_sub(1).map(|p| r.blocks[p]);
        if let Some(other) = pool.register(r.blocks[b], h, parent, &tokens) {
            pool.acquire(&[other]);
            pool.release(&[r.blocks[b]]);
            r.blocks[b] = other;
        }
        if b < r.pending_end {
            unpend(pending, h);
        }
        r.registered += 1;
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

    fn cfg(running: usize, chunk: usize, step: usize, blocks: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_running: running,
            max_seq_len: 1024,
            chunk,
            step_tokens: step,
            step_outputs: 1024,
            kv_blocks: blocks,
            eos: vec![2],
            preempt: false,
            prefill_first: false,
            prefix_cache: false,
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
        for _ in 0..10_000 {
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

    fn prompt(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32)
            .map(|i| 3 + (seed * 131 + i * 7) % 50)
            .collect()
    }

    fn with_prompt(key: u64, tokens: Vec<u32>, max_new: usize) -> SeqSpec {
        SeqSpec {
            tokens,
            ..spec(key, 1, max_new)
        }
    }

    fn cached_cfg(blocks: usize) -> SchedulerConfig {
        SchedulerConfig {
            prefix_cache: true,
            ..cfg(8, 64, 256, blocks)
        }
    }

    #[test]
    fn n_samples_share_the_prompt_blocks() {
        // Three samples of one prompt of 3 full blocks and 8 more tokens.
        let p = prompt(1, 3 * KV_BLOCK + 8);
        let specs: Vec<SeqSpec> = (0..3).map(|k| with_prompt(k, p.clone(), 5)).collect();
        let run = |cache: bool| {
            let mut s = Scheduler::new(SchedulerConfig {
                prefix_cache: cache,
                ..cfg(8, 64, 256, 64)
            })
            .unwrap();
            for sp in &specs {
                s.submit(sp.clone()).unwrap();
            }
            let (tokens, rows) = drive(&mut s);
            (tokens, rows, s.prefix_stats(), s.cached_blocks())
        };
        let (want, _, none, _) = run(false);
        assert_eq!(none, PrefixStats::default());
        let (got, rows, stats, cached) = run(true);
        assert_eq!(got, want, "the cache changed the tokens");
        // The first sample computes the prompt; the others wait for its blocks, then start
        // at the first position not cached.
        let first_row = |seq: SeqId| rows.iter().find(|r| r.0 == seq).map(|r| r.1);
        assert_eq!(first_row(0), Some(0));
        assert_eq!(first_row(1), Some(3 * KV_BLOCK));
        assert_eq!(first_row(2), Some(3 * KV_BLOCK));
        assert_eq!(stats.hits, 2 * 3 * KV_BLOCK as u64);
        assert_eq!(stats.queried, 3 * p.len() as u64);
        assert!(cached >= 3, "{cached} blocks cached");
    }

    #[test]
    fn a_prefix_ending_on_a_block_boundary_still_computes_its_last_token() {
        let p = prompt(2, 2 * KV_BLOCK);
        let mut s = Scheduler::new(cached_cfg(16)).unwrap();
        s.submit(with_prompt(0, p.clone(), 2)).unwrap();
        drive(&mut s);
        s.submit(with_prompt(1, p.clone(), 2)).unwrap();
        let plan = s.plan();
        // Block 1 is cached too, but position 127's row gives the logits to sample from.
        assert_eq!(plan.rows.len(), 1);
        assert_eq!(plan.rows[0].pos0, KV_BLOCK);
        assert_eq!(plan.rows[0].tokens, p[KV_BLOCK..]);
        assert!(plan.rows[0].sample);
    }

    #[test]
    fn scoring_requests_compute_the_rows_they_score() {
        let p = prompt(3, 4 * KV_BLOCK);
        let mut s = Scheduler::new(cached_cfg(16)).unwrap();
        s.submit(with_prompt(0, p.clone(), 1)).unwrap();
        drive(&mut s);
        // Scored from position 100: only block 0 (positions 0..64) may come from the cache.
        let mut sc = with_prompt(1, p.clone(), 0);
        sc.score_from = Some(101);
        s.submit(sc).unwrap();
        let mut targets = Vec::new();
        let mut first = None;
        loop {
            let plan = s.plan();
            if plan.is_empty() {
                break;
            }
            first.get_or_insert(plan.rows[0].pos0);
            for r in &plan.rows {
                targets.extend(r.targets.iter().map(|&(o, _)| r.pos0 + o as usize));
            }
            s.apply(&plan, &run(&plan)).unwrap();
        }
        assert_eq!(first, Some(KV_BLOCK));
        assert_eq!(targets, (100..p.len() - 1).collect::<Vec<_>>());
        assert_eq!(
            s.prefix_stats().hits,
            (2 * KV_BLOCK) as u64 - KV_BLOCK as u64
        );
    }

    #[test]
    fn cached_blocks_are_evicted_before_anyone_is_preempted() {
        // 6 blocks: a finished sequence leaves 3 cached, then two others need 3 each.
        let mut c = cached_cfg(6);
        c.preempt = true;
        let mut s = Scheduler::new(c).unwrap();
        s.submit(with_prompt(0, prompt(4, 3 * KV_BLOCK - 1), 1))
            .unwrap();
        drive(&mut s);
        assert_eq!((s.cached_blocks(), s.kv_blocks().0), (2, 0));
        s.submit(with_prompt(1, prompt(5, 2 * KV_BLOCK), 60))
            .unwrap();
        s.submit(with_prompt(2, prompt(6, 2 * KV_BLOCK), 60))
            .unwrap();
        drive(&mut s);
        assert_eq!(s.preemptions(), 0);
        assert!(s.cached_blocks() <= 6);
    }

    #[test]
    fn preemption_with_the_prefix_cache_keeps_the_tokens_and_reuses_blocks() {
        let specs: Vec<SeqSpec> = (0..3)
            .map(|k| with_prompt(k, prompt(7 + k as u32, 70), 150))
            .collect();
        let mut roomy = Scheduler::new(cached_cfg(64)).unwrap();
        for sp in &specs {
            roomy.submit(sp.clone()).unwrap();
        }
        let (want, _) = drive(&mut roomy);
        let mut c = cached_cfg(10);
        c.preempt = true;
        let mut tight = Scheduler::new(c).unwrap();
        for sp in &specs {
            tight.submit(sp.clone()).unwrap();
        }
        let (got, _) = drive(&mut tight);
        assert!(tight.preemptions() > 0, "the cache was never short");
        assert_eq!(
            got, want,
            "preemption with the prefix cache changed the tokens"
        );
        assert!(
            tight.prefix_stats().hits > 0,
            "a readmitted sequence found none of its blocks"
        );
        assert_eq!(tight.kv_blocks().0, 0);
    }

    #[test]
    fn a_later_turn_reuses_the_earlier_turns_blocks() {
        let p = prompt(8, 100);
        let mut s = Scheduler::new(cached_cfg(16)).unwrap();
        s.submit(with_prompt(5, p.clone(), 60)).unwrap();
        let (out, _) = drive(&mut s);
        // The next turn: the conversation so far and a new message.
        let mut next = p.clone();
        next.extend(&out[&0]);
        next.extend(prompt(9, 30));
        s.submit(with_prompt(6, next.clone(), 1)).unwrap();
        let plan = s.plan();
        // 160 known positions of the first turn: blocks 0 and 1 (128 positions) cached.
        assert_eq!(plan.rows[0].pos0, 2 * KV_BLOCK);
        assert_eq!(plan.rows[0].tokens, next[2 * KV_BLOCK..]);
    }

    #[test]
    fn dropping_the_prefix_cache_forgets_every_block() {
        let p = prompt(10, 3 * KV_BLOCK);
        let mut s = Scheduler::new(cached_cfg(16)).unwrap();
        s.submit(with_prompt(0, p.clone(), 1)).unwrap();
        drive(&mut s);
        assert!(s.cached_blocks() > 0);
        s.drop_prefix_cache();
        assert_eq!(s.cached_blocks(), 0);
        s.submit(with_prompt(1, p.clone(), 1)).unwrap();
        assert_eq!(
            s.plan().rows[0].pos0,
            0,
            "nothing cached is found after the drop"
        );
    }

    #[test]
    fn block_tables_cover_the_rows_and_no_block_is_written_twice() {
        let mut c = cached_cfg(12);
        c.preempt = true;
        let mut s = Scheduler::new(c).unwrap();
        let shared = prompt(11, 150);
        for k in 0..5u64 {
            let mut t = shared.clone();
            t.extend(prompt(20 + k as u32, 10 * k as usize));
            s.submit(with_prompt(k, t, 40)).unwrap();
        }
        for _ in 0..10_000 {
            let plan = s.plan();
            if plan.is_empty() {
                break;
            }
            let mut written = std::collections::HashSet::new();
            for r in &plan.rows {
                let end = r.pos0 + r.tokens.len();
                assert_eq!(r.blocks.len(), blocks_for(end));
                for p in r.pos0..end {
                    assert!(
                        written.insert((r.blocks[p / KV_BLOCK], p % KV_BLOCK)),
                        "position {p} of sequence {} written twice",
                        r.seq
                    );
                }
            }
            s.apply(&plan, &run(&plan)).unwrap();
        }
        assert!(s.is_idle());
        assert_eq!(s.kv_blocks().0, 0);
    }
}
