//! What to read off each logits row of a step: the scored token's log-prob, or the
//! sampled token (from the backend's draw, the row's candidates, or the row itself), and
//! the record's top-N.

use super::StepOut;
use crate::backend::MaskedRow;
use crate::batching::Record;
use crate::constraint::{self, TokenMask};
use crate::error::{MResult, ModelError};
use crate::sampling::{self, RowDraw, RowStats, Sampling};

/// What to read off one logits row.
pub(super) enum RowTask<'a> {
    /// The log-prob of a given token (scoring, prompt log-probs).
    Score { token: u32, n_top: usize },
    /// Choose the next token, then record it.
    Sample {
        sampling: Sampling,
        key: u64,
        position: usize,
        n_top: usize,
        /// A constrained row: the token is the backend's masked draw
        /// (`constraint::draw_masked`, where the logits are) or, for top-k / top-p and
        /// where that finds nothing, drawn on the host from the masked row
        /// (`constraint::choose_masked`), which then comes to the host after the step.
        constrained: bool,
        /// A constrained row's mask, once it is known (a mask computed while the step
        /// runs is filled in then).
        allowed: Option<&'a TokenMask>,
    },
}

impl RowTask<'_> {
    /// Whether the row may be drawn on the host from its whole logits row (a constrained
    /// row whose masked draw the backend cannot make or finds nothing for).
    pub(super) fn drawn_on_host(&self) -> bool {
        self.constrained()
    }

    /// Output row `row`'s masked draw, where the backend makes it: a constrained greedy
    /// or pure-temperature row, with its mask (`late`: one computed while the step runs).
    pub(super) fn masked_row<'s>(
        &'s self,
        row: usize,
        late: Option<&'s TokenMask>,
    ) -> Option<MaskedRow<'s>> {
        match *self {
            RowTask::Sample {
                ref sampling,
                key,
                position,
                constrained: true,
                allowed,
                ..
            } => {
                let mask = late.or(allowed)?;
                constraint::masked_draw(sampling, key, position).map(|draw| MaskedRow {
                    row,
                    draw,
                    mask,
                })
            }
            _ => None,
        }
    }

    fn constrained(&self) -> bool {
        match *self {
            RowTask::Sample { constrained, .. } => constrained,
            RowTask::Score { .. } => false,
        }
    }

    /// The index whose value the row's stats report: the scored token.
    pub(super) fn pick(&self) -> u32 {
        match *self {
            RowTask::Score { token, .. } => token,
            RowTask::Sample { .. } => u32::MAX,
        }
    }

    /// What the backend computes for the draw where the logits are: a pure
    /// temperature's Gumbel-max draw, a whole-vocabulary top-p's tempered sum.
    pub(super) fn draw(&self) -> RowDraw {
        match *self {
            // The backend's draws know no mask: the host draws from the masked row.
            RowTask::Score { .. }
            | RowTask::Sample {
                constrained: true, ..
            } => RowDraw::None,
            RowTask::Sample {
                ref sampling,
                key,
                position,
                ..
            } => sampling::row_draw(sampling, key, position),
        }
    }

    /// The draw from the row's candidates (`Choice::NeedsRow` when its top-p nucleus
    /// lies beyond them); `None` for rows that draw nothing from candidates.
    fn candidate_choice(&self, stats: &RowStats, cand: &[(u32, f32)]) -> Option<sampling::Choice> {
        let k = self.draw_candidates();
        match *self {
            RowTask::Sample {
                ref sampling,
                key,
                position,
                ..
            } if k > 0 && stats.sampled == u32::MAX => Some(sampling::choose_from_candidates(
                &cand[..cand.len().min(k)],
                sampling,
                key,
                position,
                stats.tempered_sum,
                // Fewer than asked for: every non-NaN value of the row.
                cand.len() < k,
            )),
            _ => None,
        }
    }

    /// Whether the row must come to the host after its stats and candidates: a
    /// constrained row without the backend's masked draw, or a top-p nucleus the
    /// candidates do not reach.
    pub(super) fn wants_row(&self, stats: &RowStats, cand: &[(u32, f32)]) -> bool {
        self.constrained() && stats.sampled == u32::MAX
            || matches!(
                self.candidate_choice(stats, cand),
                Some(sampling::Choice::NeedsRow)
            )
    }

    /// How many candidates a sampled token's draw needs (0: none, or the whole row).
    fn draw_candidates(&self) -> usize {
        match *self {
            RowTask::Sample {
                ref sampling,
                constrained: false,
                ..
            } => sampling::candidates_needed(sampling),
            RowTask::Sample { .. } | RowTask::Score { .. } => 0,
        }
    }

    fn n_top(&self) -> usize {
        match *self {
            RowTask::Score { n_top, .. } | RowTask::Sample { n_top, .. } => n_top,
        }
    }

    /// How many top candidates the backend selects for this row (0: none): the draw's
    /// top-k and the record's top-N come from one selection (the first n of the k most
    /// likely are the n most likely), so the row need not come to the host.
    pub(super) fn candidates(&self) -> usize {
        if self.needs_row() {
            0
        } else {
            self.draw_candidates().max(self.n_top())
        }
    }

    /// Whether the record needs the whole row on the host from the start: top-N beyond
    /// the backend's selection, or a token sampled with a top-k beyond it (a sort over the
    /// vocabulary).
    pub(super) fn needs_row(&self) -> bool {
        let whole_row_draw = match *self {
            // Its row comes after the step (`wants_row`), whatever its sampling.
            RowTask::Sample {
                constrained: true, ..
            } => false,
            RowTask::Sample { ref sampling, .. } => {
                !sampling.is_greedy() && !sampling.draws_on_device() && self.draw_candidates() == 0
            }
            RowTask::Score { .. } => false,
        };
        whole_row_draw || self.n_top() > sampling::CANDIDATES_MAX
    }

    /// The record from the row's stats and, where `needs_row` or `wants_row`, the row
    /// itself, or, where `candidates`, the row's top candidates.
    fn run(
        &self,
        stats: &RowStats,
        row: Option<&[f32]>,
        cand: Option<&[(u32, f32)]>,
    ) -> MResult<Record> {
        let (token, value, n_top) = match *self {
            RowTask::Score { token, n_top } => (token, stats.picked, n_top),
            RowTask::Sample {
                ref sampling,
                key,
                position,
                n_top,
                constrained: true,
                allowed,
            } => match (row, allowed) {
                // The backend's masked draw: `choose_masked`'s token where it found one.
                _ if stats.sampled != u32::MAX => (stats.sampled, stats.sampled_value, n_top),
                (_, None) => {
                    return Err(ModelError::Plan(format!(
                        "the constrained draw at position {position} of request {key} has no mask"
                    )))
                }
                (Some(row), Some(mask)) => {
                    let t = constraint::choose_masked(row, mask, sampling, key, position);
                    (t, row.get(t as usize).copied().unwrap_or(f32::NAN), n_top)
                }
                (None, Some(_)) => {
                    return Err(ModelError::Plan(format!(
                        "the constrained draw at position {position} of request {key} needs its row, which the step did not bring"
                    )))
                }
            },
            RowTask::Sample {
                ref sampling,
                key,
                position,
                n_top,
                constrained: false,
                ..
            } => match row {
                // The backend's draw, also when the row came to the host for top-N: a
                // request's tokens do not depend on whether it asked for log-probs.
                _ if stats.sampled != u32::MAX => (stats.sampled, stats.sampled_value, n_top),
                Some(row) if !sampling.is_greedy() && row.len() > 1 => {
                    // A whole-vocabulary top-p compares with the backend's tempered sum,
                    // as the candidates' draw does.
                    let tempered = sampling.is_nucleus().then_some(stats.tempered_sum);
                    let t = sampling::choose_with(row, sampling, key, position, tempered);
                    (t, row[t as usize], n_top)
                }
                // `choose` on the draw's candidates (same token and value); the argmax
                // where there are none, as `choose` gives for an all-NaN row.
                None => match self.candidate_choice(stats, cand.unwrap_or(&[])) {
                    Some(sampling::Choice::Token(t, v)) => (t, v, n_top),
                    Some(sampling::Choice::NeedsRow) => {
                        return Err(ModelError::Plan(format!(
                            "the top-p draw at position {position} of request {key} needs its row, which the step did not bring"
                        )))
                    }
                    Some(sampling::Choice::Empty) | None => (stats.argmax, stats.max, n_top),
                },
                _ => (stats.argmax, stats.max, n_top),
            },
        };
        Ok(Record {
            token,
            logprob: value - stats.lse,
            top: match (row, cand) {
                (Some(row), _) => sampling::top_n(row, stats.lse, n_top),
                (None, Some(c)) => sampling::top_n_of_candidates(c, stats.lse, n_top),
                (None, None) => Vec::new(),
            },
            digest: stats.digest,
        })
    }
}

/// The records of every task. Rows on the host (top-N beyond the candidates, whole-row
/// draws) are spread over the host's cores.
pub(super) fn records_parallel(
    out: &StepOut,
    vocab: usize,
    tasks: &[RowTask],
) -> MResult<Vec<Record>> {
    if let Some(t) =
        (0..tasks.len()).find(|&r| tasks[r].needs_row() && out.host.row(r, vocab).is_none())
    {
        return Err(ModelError::Plan(format!(
            "row {t} needs its logits on the host but the step did not download them"
        )));
    }
    let cand = |r: usize| out.cands.get(r).map(Vec::as_slice);
    sampling::map_rows(tasks.len(), out.host.values(), |r, _| {
        tasks[r].run(&out.stats[r], out.host.row(r, vocab), cand(r))
    })
    .into_iter()
    .collect()
}
