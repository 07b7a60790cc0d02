//! What callers hand the scheduler (a request: `SeqSpec`) and what it hands back at each
//! step (`Event`s of the sequence it made of the request).

use crate::batching::plan::Record;
use crate::constraint::Constraint;
use crate::sampling::Sampling;

pub type SeqId = u64;

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
    /// The tokens each sampled row may take (structured output), from the sequence's own
    /// generated tokens.
    pub constraint: Option<Constraint>,
    /// Report the experts each fed token is routed to (`Event::Routed`). Such a sequence
    /// computes its whole prompt: a prefix-cache hit has no routes to report.
    pub routes: bool,
}

impl SeqSpec {
    /// A greedy sequence generating up to `max_new` tokens after `tokens`, with no prompt
    /// scoring and no top-N.
    pub fn greedy(sample_key: u64, tokens: Vec<u32>, max_new: usize) -> Self {
        SeqSpec {
            sample_key,
            tokens,
            score_from: None,
            max_new,
            sampling: Sampling::greedy(),
            n_top: 0,
            ignore_eos: false,
            constraint: None,
            routes: false,
        }
    }
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
    /// The experts positions `pos0..` were routed to (`[positions, num_layers, top_k]`),
    /// before that step's other events. A position fed again (after a preemption) is
    /// reported again, with the same experts.
    Routed {
        seq: SeqId,
        pos0: usize,
        experts: Vec<u32>,
    },
}
