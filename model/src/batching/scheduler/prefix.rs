//! The scheduler's side of the prefix cache (the cached blocks themselves, their lookup,
//! registration and eviction, are the block pool's: `batching::kv`): a waiting request looks
//! up the longest run of its full blocks the cache holds, waits for a block another
//! sequence is computing instead of computing it too, and a running sequence registers
//! each full block it completes.

use std::collections::HashMap;

use arbor_kernels::paged::KV_BLOCK;

use super::sequence::Running;
use super::Scheduler;
use crate::batching::kv::{block_hash, chain_hashes, BlockPool, PrefixStats};

/// Chain hashes of blocks running sequences are computing and will register, with how
/// many compute each: a waiting request whose next uncached block is one of them waits
/// for it (the `n` samples of one prompt share its prefill) instead of computing it too.
#[derive(Debug, Default)]
pub(super) struct Pending(HashMap<u64, usize>);

impl Pending {
    /// Whether a running sequence computes the block of chain hash `h`.
    pub(super) fn computing(&self, h: u64) -> bool {
        self.0.contains_key(&h)
    }

    /// One more sequence computes each of these blocks.
    pub(super) fn add(&mut self, hashes: &[u64]) {
        for h in hashes {
            *self.0.entry(*h).or_insert(0) += 1;
        }
    }

    /// One fewer sequence computes the block of chain hash `h`.
    pub(super) fn done(&mut self, h: u64) {
        if let Some(n) = self.0.get_mut(&h) {
            *n -= 1;
            if *n == 0 {
                self.0.remove(&h);
            }
        }
    }

    pub(super) fn clear(&mut self) {
        self.0.clear();
    }
}

impl Scheduler {
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

    /// Waiting request `i`'s chain hashes of its known full blocks (kept on it once
    /// computed), the cached blocks it may start from, and how many of its blocks a hit
    /// may cover.
    pub(super) fn cached_prefix(&mut self, i: usize) -> (Vec<u64>, Vec<u32>, usize) {
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
        (hashes, hits, reusable)
    }
}

/// Registers the full blocks of `r` computed since the last call in the prefix cache.
/// Where the cache already holds a block of the same tokens after the same prefix, `r`
/// takes that one instead of its own (the same bits: a prefix's KV does not depend on how
/// it was computed), so that later sequences find one chain.
pub(super) fn register_computed(pool: &mut BlockPool, pending: &mut Pending, r: &mut Running) {
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
            pending.done(h);
        }
        r.registered += 1;
    }
}

#[cfg(test)]
mod tests {
    use arbor_kernels::paged::blocks_for;

    use super::super::testing::{cfg, drive, run};
    use super::super::{Event, SchedulerConfig, SeqId, SeqSpec};
    use super::*;

    fn prompt(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32)
            .map(|i| 3 + (seed * 131 + i * 7) % 50)
            .collect()
    }

    fn with_prompt(key: u64, tokens: Vec<u32>, max_new: usize) -> SeqSpec {
        SeqSpec::greedy(key, tokens, max_new)
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
    fn a_sequence_reporting_its_routes_computes_its_whole_prompt() {
        let p = prompt(5, 3 * KV_BLOCK);
        let mut s = Scheduler::new(cached_cfg(16)).unwrap();
        s.submit(with_prompt(0, p.clone(), 1)).unwrap();
        drive(&mut s);
        let mut routed = with_prompt(1, p.clone(), 3);
        routed.routes = true;
        s.submit(routed).unwrap();
        // Every fed position is reported once, in order, before the step's token.
        let mut fed = Vec::new();
        let mut tokens = 0;
        loop {
            let plan = s.plan();
            if plan.is_empty() {
                break;
            }
            assert!(plan.rows.iter().all(|r| r.routes));
            let results: Vec<_> = run(&plan)
                .into_iter()
                .zip(&plan.rows)
                .map(|(mut res, r)| {
                    res.routes = vec![r.pos0 as u32; r.tokens.len()];
                    res
                })
                .collect();
            for ev in s.apply(&plan, &results).unwrap() {
                match ev {
                    Event::Routed { pos0, experts, .. } => {
                        assert_eq!(fed.len(), pos0);
                        assert_eq!(experts, vec![pos0 as u32; experts.len()]);
                        fed.extend((pos0..pos0 + experts.len()).map(|p| p as u32));
                        // A step's routes come before its token: position P + i is fed
                        // once token i + 1 has been reported.
                        assert_eq!(tokens, (pos0 + 1).saturating_sub(p.len()));
                    }
                    Event::Token { .. } => tokens += 1,
                    _ => {}
                }
            }
        }
        // The whole prompt, then each generated token but the last: no cache hit.
        assert_eq!(tokens, 3);
        assert_eq!(fed, (0..(p.len() + 2) as u32).collect::<Vec<_>>());
        assert_eq!(s.prefix_stats().hits, 0);
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
