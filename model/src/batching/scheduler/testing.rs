//! A fake engine for the scheduler's tests: requests of known tokens, and results that
//! depend only on the request and the position (as the real engine's do).

use super::{Event, Scheduler, SchedulerConfig, SeqId, SeqSpec};
use crate::batching::plan::{Record, RowResult, StepPlan};

pub(super) fn spec(key: u64, prompt: usize, max_new: usize) -> SeqSpec {
    SeqSpec::greedy(key, (1..=prompt as u32).collect(), max_new)
}

pub(super) fn rec(token: u32) -> Record {
    Record {
        token,
        logprob: -1.0,
        top: Vec::new(),
        digest: 0,
    }
}

/// Fake execution: every sampled token is `7`, every target is echoed.
pub(super) fn run(plan: &StepPlan) -> Vec<RowResult> {
    plan.rows
        .iter()
        .map(|r| RowResult {
            seq: r.seq,
            scored: r.targets.iter().map(|&(_, t)| rec(t)).collect(),
            sampled: r.sample.then(|| rec(7)),
            routes: Vec::new(),
        })
        .collect()
}

pub(super) fn cfg(running: usize, chunk: usize, step: usize, blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_running: running,
        max_seq_len: 1024,
        chunk,
        step_tokens: step,
        prefill_beside_decode: step,
        row_multiple: 1,
        step_outputs: 1024,
        kv_blocks: blocks,
        eos: vec![2],
        preempt: false,
        prefill_first: false,
        prefix_cache: false,
    }
}

/// Runs to idle with a fake model whose token at a position depends only on the
/// request and the position (as the real engine's does); returns each sequence's
/// tokens as reported by Token events, and every plan row's (seq, pos0, tokens).
#[allow(clippy::type_complexity)]
pub(super) fn drive(
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
                    routes: Vec::new(),
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
