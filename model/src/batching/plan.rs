//! What one step executes and what it returns; the plan is what rank 0 broadcasts.

use serde::{Deserialize, Serialize};

use crate::constraint::TokenMask;
use crate::error::{MResult, ModelError};
use crate::sampling::{Sampling, TokenLogprob};

/// The new rows of one sequence in a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRow {
    /// The scheduler's handle of the sequence (unique among live sequences).
    pub seq: u64,
    /// The id the sampling draw is keyed by, with `sampling.seed` and the position (for
    /// `generate`, the request id): never a block or the step, so load cannot move it.
    pub sample_key: u64,
    /// The sequence's block table: the KV blocks of its positions `0..pos0 + tokens.len()`
    /// (`blocks_for` of that many), in position order. Its bits do not depend on which
    /// blocks they are.
    pub blocks: Vec<u32>,
    /// Position of `tokens[0]` (= tokens already in the cache for this sequence).
    pub pos0: usize,
    pub tokens: Vec<u32>,
    /// Teacher-forced records: (row offset in `tokens`, the token that row is scored on).
    pub targets: Vec<(u32, u32)>,
    /// Sample the next token from the last row.
    pub sample: bool,
    /// The rows are prompt tokens (for the prefill / decode timing split only).
    pub prefill: bool,
    pub sampling: Sampling,
    pub n_top: usize,
    /// The tokens the sampled row may take (a constrained sequence's mask, computed by rank
    /// 0 from that sequence's tokens): every rank draws from the same masked row.
    pub allowed: Option<TokenMask>,
    /// The sampled row is constrained and its mask comes after the plan (`allowed` is
    /// `None`): rank 0 computes it while the step's forward runs and sends it as
    /// [`PlanMsg::Masks`] (`Scheduler::late_masks`).
    pub mask_later: bool,
    /// Report the experts every row was routed to (`RowResult::routes`).
    pub routes: bool,
}

/// One step: any mix of prefill chunks and decode rows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepPlan {
    pub rows: Vec<PlanRow>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// New tokens (rows of activations) in the step.
    pub fn n_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.tokens.len()).sum()
    }
}

/// What rank 0 broadcasts to the other ranks before every step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum PlanMsg {
    Step(StepPlan),
    /// Nothing to run; keeps the followers' collective wait short of its timeout.
    Idle,
    Shutdown,
    /// New weights, memory released or resumed, caches dropped: every rank runs it
    /// (`runner::weights_update::run_control`) between steps.
    Control(crate::batching::ControlMsg),
    /// The masks of the current step's `mask_later` rows, in plan order, sent while the
    /// step runs.
    Masks(Vec<TokenMask>),
}

impl PlanMsg {
    pub fn encode(&self) -> MResult<Vec<u8>> {
        bincode::serialize(self).map_err(|e| ModelError::Plan(format!("cannot encode: {e}")))
    }

    pub fn decode(bytes: &[u8]) -> MResult<Self> {
        bincode::deserialize(bytes).map_err(|e| {
            ModelError::Plan(format!(
                "cannot decode a {}-byte step plan: {e}",
                bytes.len()
            ))
        })
    }
}

/// The output of one row: a token (sampled, or the target it was scored on), its
/// log-probability, the top-N alternatives and the digest of the full logits row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<TokenLogprob>,
    pub digest: u64,
}

/// The results of one `PlanRow`, in the plan's order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RowResult {
    pub seq: u64,
    /// One per `targets` entry, in order.
    pub scored: Vec<Record>,
    pub sampled: Option<Record>,
    /// Where the row asked (`PlanRow::routes`): the experts each of its tokens was routed
    /// to, `[tokens, num_layers, top_k]` (`forward::Model::forward_routed`); else empty.
    pub routes: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_round_trip_and_garbage_is_named() {
        let plan = StepPlan {
            rows: vec![PlanRow {
                seq: 3,
                sample_key: 9,
                blocks: vec![4],
                pos0: 4,
                tokens: vec![5, 6],
                targets: vec![(0, 6)],
                sample: true,
                prefill: true,
                routes: true,
                sampling: Sampling {
                    temperature: 0.7,
                    top_k: 3,
                    top_p: 0.9,
                    seed: 11,
                },
                n_top: 2,
                allowed: Some(TokenMask::Ids(vec![1, 5])),
                mask_later: false,
            }],
        };
        let msg = PlanMsg::Step(plan);
        let back = PlanMsg::decode(&msg.encode().unwrap()).unwrap();
        assert_eq!(back, msg);
        let e = PlanMsg::decode(&[0xff, 0xff, 0xff])
            .unwrap_err()
            .to_string();
        assert!(e.contains("3-byte step plan"), "{e}");
    }
}
