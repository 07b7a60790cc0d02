//! A request's state inside the scheduler: waiting in the queue (new, or preempted with
//! what it had generated) or running (holding the KV blocks of its positions).

use std::borrow::Cow;

use super::request::{SeqId, SeqSpec};

/// An admitted sequence: it holds the KV blocks of its positions.
#[derive(Debug)]
pub(super) struct Running {
    pub(super) id: SeqId,
    pub(super) spec: SeqSpec,
    /// The block table: the blocks of positions `0..64·len`, in order.
    pub(super) blocks: Vec<u32>,
    /// Tokens already in the cache.
    pub(super) fed: usize,
    pub(super) generated: Vec<u32>,
    /// Positions below this are fed as prefill chunks: the prompt, and after a preemption
    /// the tokens generated before it.
    pub(super) prefill_to: usize,
    /// Prompt positions whose scoring target was already reported (a recompute after a
    /// preemption does not report them again).
    pub(super) scored_below: usize,
    /// The chain hashes of its full blocks known so far (`batching::kv::chain_hashes`).
    pub(super) hashes: Vec<u64>,
    /// Blocks registered in the prefix cache (or found there), from the first.
    pub(super) registered: usize,
    /// Blocks `registered..pending_end` are ones this sequence computes that others wait
    /// for (`Scheduler::pending`).
    pub(super) pending_end: usize,
    /// Whether its blocks go to the prefix cache (not after the cache was dropped).
    pub(super) cacheable: bool,
}

impl Running {
    pub(super) fn known(&self, i: usize) -> u32 {
        if i < self.spec.tokens.len() {
            self.spec.tokens[i]
        } else {
            self.generated[i - self.spec.tokens.len()]
        }
    }

    pub(super) fn known_len(&self) -> usize {
        self.spec.tokens.len() + self.generated.len()
    }
}

/// A request in the queue: new, or preempted with what it had generated.
#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) id: SeqId,
    pub(super) spec: SeqSpec,
    pub(super) generated: Vec<u32>,
    pub(super) scored_below: usize,
    /// The chain hashes of its known tokens' full blocks, once looked up.
    pub(super) hashes: Option<Vec<u64>>,
}

impl Waiting {
    pub(super) fn known_len(&self) -> usize {
        self.spec.tokens.len() + self.generated.len()
    }

    /// The prompt and what was generated before a preemption.
    pub(super) fn known(&self) -> Cow<'_, [u32]> {
        if self.generated.is_empty() {
            Cow::Borrowed(&self.spec.tokens)
        } else {
            Cow::Owned([&self.spec.tokens[..], &self.generated[..]].concat())
        }
    }

    /// Positions a prefix-cache hit may cover: all known but the last (its row gives the
    /// logits to sample from), none whose scoring record is still owed, and none of a
    /// sequence that reports its routes (a cached block carries no routes).
    pub(super) fn reusable(&self) -> usize {
        if self.spec.routes {
            return 0;
        }
        let all = self.known_len().saturating_sub(1);
        match target_range(&self.spec, self.scored_below) {
            (lo, hi) if lo < hi => all.min(lo),
            _ => all,
        }
    }
}

/// The prompt positions whose rows a sequence must still score: `[lo, hi)`.
pub(super) fn target_range(spec: &SeqSpec, scored_below: usize) -> (usize, usize) {
    match spec.score_from {
        Some(from) => (
            from.saturating_sub(1).max(scored_below),
            spec.tokens.len().saturating_sub(1),
        ),
        None => (0, 0),
    }
}
