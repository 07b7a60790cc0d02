//! The invariance metrics of `arbor check` (those of the Tree-Based Invariant Kernels
//! paper): per prompt, the number of unique outputs across configurations, and the top-5
//! probability divergence against the reference configuration; plus whether teacher-forced
//! `score` reproduced the generated log-probs bit for bit.

use std::collections::HashMap;

use anyhow::{bail, Result};
use serde::Serialize;

use super::records::{GenRecord, ScoreRecord};

/// How many of the reference's most likely tokens the divergence looks at.
pub const TOP_N: usize = 5;

/// One configuration's generate output.
pub struct ConfigRun {
    pub name: String,
    pub records: Vec<GenRecord>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptMetrics {
    pub id: u64,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Distinct (tokens, log-prob bits, logits digests) across configurations; 1 = invariant.
    pub unique_outputs: usize,
    /// Max over configurations of the mean over positions of max |p_cfg − p_ref| over the
    /// reference's top-5 tokens.
    pub top5_divergence: f64,
    /// `None` when no score run was compared.
    pub score_equal: Option<bool>,
}

/// The first place two runs differ.
#[derive(Debug, Clone, Serialize)]
pub struct Difference {
    pub config: String,
    pub id: u64,
    /// Index into the generated tokens.
    pub position: usize,
    pub what: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub reference: String,
    pub configs: Vec<String>,
    pub prompts: Vec<PromptMetrics>,
    pub max_unique_outputs: usize,
    pub prompts_with_differences: usize,
    pub max_top5_divergence: f64,
    pub score_equal: Option<bool>,
    pub first_difference: Option<Difference>,
    pub first_score_difference: Option<Difference>,
}

impl Report {
    pub fn invariant(&self) -> bool {
        self.max_unique_outputs == 1
            && self.max_top5_divergence == 0.0
            && self.first_difference.is_none()
            && self.score_equal != Some(false)
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The first generated position where `b` differs from the reference `a`.
fn first_gen_difference(a: &GenRecord, b: &GenRecord) -> Option<(usize, String)> {
    if a.prompt_tokens != b.prompt_tokens {
        return Some((0, "the prompt tokens differ".into()));
    }
    let n = a.tokens.len().min(b.tokens.len());
    for j in 0..n {
        if a.tokens[j] != b.tokens[j] {
            return Some((j, format!("token {} vs {}", a.tokens[j], b.tokens[j])));
        }
        if let (Some(x), Some(y)) = (a.logits_digest.get(j), b.logits_digest.get(j)) {
            if x != y {
                return Some((j, format!("logits digest {x:016x} vs {y:016x}")));
            }
        }
        if let (Some(x), Some(y)) = (a.logprobs.get(j), b.logprobs.get(j)) {
            if x.to_bits() != y.to_bits() {
                return Some((
                    j,
                    format!(
                        "log-prob {x:e} vs {y:e} (bits {:08x} vs {:08x})",
                        x.to_bits(),
                        y.to_bits()
                    ),
                ));
            }
        }
    }
    if a.tokens.len() != b.tokens.len()
        || a.logprobs.len() != b.logprobs.len()
        || a.logits_digest.len() != b.logits_digest.len()
    {
        return Some((
            n,
            format!(
                "lengths differ: {} vs {} tokens, {} vs {} log-probs, {} vs {} digests",
                a.tokens.len(),
                b.tokens.len(),
                a.logprobs.len(),
                b.logprobs.len(),
                a.logits_digest.len(),
                b.logits_digest.len()
            ),
        ));
    }
    None
}

/// Probability the record gives `token` at position `j`: from its top list, or from its
/// chosen token's log-prob; a token it does not list counts as probability 0 (so a
/// difference is never hidden, at worst overstated by the run's 5th probability).
fn prob_at(r: &GenRecord, j: usize, token: u32) -> f64 {
    if let Some(alts) = r.top.as_ref().and_then(|t| t.get(j)) {
        if let Some(a) = alts.iter().find(|a| a.token == token) {
            return (a.logprob as f64).exp();
        }
    }
    if r.tokens.get(j) == Some(&token) {
        if let Some(l) = r.logprobs.get(j) {
            return (*l as f64).exp();
        }
    }
    0.0
}

fn top5_divergence(reference: &GenRecord, other: &GenRecord) -> Result<f64> {
    let n = reference.tokens.len().min(other.tokens.len());
    if n == 0 {
        return Ok(0.0);
    }
    let ref_top = reference.top.as_ref().map(|t| t.len()).unwrap_or(0);
    if ref_top < n {
        bail!(
            "request {}: the reference has top alternatives for {ref_top} of {n} positions \
             (generate must run with --logprobs {TOP_N})",
            reference.id
        );
    }
    let mut total = 0.0f64;
    for j in 0..n {
        let mut worst = 0.0f64;
        for alt in reference
            .top
            .as_ref()
            .map(|t| &t[j][..])
            .unwrap_or(&[])
            .iter()
            .take(TOP_N)
        {
            let d = ((alt.logprob as f64).exp() - prob_at(other, j, alt.token)).abs();
            // NaN counts as the largest difference.
            if d.is_nan() || d > worst {
                worst = if d.is_nan() { f64::INFINITY } else { d };
            }
        }
        total += worst;
    }
    Ok(total / n as f64)
}

/// Compares every configuration with the first (the reference), and `score` (if given,
/// run on the reference's sequences) with the reference's log-probs.
pub fn compare(runs: &[ConfigRun], score: Option<&[ScoreRecord]>) -> Result<Report> {
    let Some(reference) = runs.first() else {
        bail!("no configurations to compare");
    };
    let by_id: Vec<HashMap<u64, &GenRecord>> = runs
        .iter()
        .map(|run| run.records.iter().map(|r| (r.id, r)).collect())
        .collect();
    for (run, map) in runs.iter().zip(&by_id) {
        if map.len() != run.records.len() || run.records.len() != reference.records.len() {
            bail!(
                "configuration {} returned {} outputs ({} distinct ids); the reference {} returned {}",
                run.name,
                run.records.len(),
                map.len(),
                reference.name,
                reference.records.len()
            );
        }
    }
    let score_by_id: Option<HashMap<u64, &ScoreRecord>> =
        score.map(|s| s.iter().map(|r| (r.id, r)).collect());

    let mut prompts = Vec::new();
    let mut first_difference = None;
    let mut first_score_difference = None;
    for r0 in &reference.records {
        let mut keys: Vec<(&[u32], Vec<u32>, &[u64])> = Vec::new();
        let mut divergence = 0.0f64;
        for (run, map) in runs.iter().zip(&by_id) {
            let Some(r) = map.get(&r0.id) else {
                bail!(
                    "configuration {} has no output for request {}",
                    run.name,
                    r0.id
                );
            };
            let key = (&r.tokens[..], bits(&r.logprobs), &r.logits_digest[..]);
            if !keys.contains(&key) {
                keys.push(key);
            }
            divergence = divergence.max(top5_divergence(r0, r)?);
        }
        let score_equal = match &score_by_id {
            None => None,
            Some(m) => {
                let diff = match m.get(&r0.id) {
                    None => Some((0, "score returned no output for this request".to_string())),
                    Some(s) => score_difference(r0, s),
                };
                if let Some((position, what)) = diff {
                    first_score_difference.get_or_insert(Difference {
                        config: "score TP=1".into(),
                        id: r0.id,
                        position,
                        what,
                    });
                    Some(false)
                } else {
                    Some(true)
                }
            }
        };
        prompts.push(PromptMetrics {
            id: r0.id,
            prompt_tokens: r0.prompt_tokens.len(),
            generated_tokens: r0.tokens.len(),
            unique_outputs: keys.len(),
            top5_divergence: divergence,
            score_equal,
        });
    }
    'outer: for (run, map) in runs.iter().zip(&by_id).skip(1) {
        for r0 in &reference.records {
            if let Some(r) = map.get(&r0.id) {
                if let Some((position, what)) = first_gen_difference(r0, r) {
                    first_difference = Some(Difference {
                        config: run.name.clone(),
                        id: r0.id,
                        position,
                        what,
                    });
                    break 'outer;
                }
            }
        }
    }
    Ok(Report {
        reference: reference.name.clone(),
        configs: runs.iter().map(|r| r.name.clone()).collect(),
        max_unique_outputs: prompts.iter().map(|p| p.unique_outputs).max().unwrap_or(0),
        prompts_with_differences: prompts.iter().filter(|p| p.unique_outputs > 1).count(),
        max_top5_divergence: prompts
            .iter()
            .map(|p| p.top5_divergence)
            .fold(0.0, f64::max),
        score_equal: score.map(|_| prompts.iter().all(|p| p.score_equal == Some(true))),
        prompts,
        first_difference,
        first_score_difference,
    })
}

fn score_difference(g: &GenRecord, s: &ScoreRecord) -> Option<(usize, String)> {
    let expected: Vec<u32> = g.prompt_tokens.iter().chain(&g.tokens).copied().collect();
    if s.tokens != expected || s.prompt_len != g.prompt_tokens.len() {
        return Some((0, "score was given a different sequence".into()));
    }
    let n = g.tokens.len();
    if s.logprobs.len() != n || s.logits_digest.len() != n {
        return Some((
            s.logprobs.len().min(n),
            format!(
                "score returned {} log-probs / {} digests for {n} tokens",
                s.logprobs.len(),
                s.logits_digest.len()
            ),
        ));
    }
    for j in 0..n {
        if g.logits_digest.get(j) != Some(&s.logits_digest[j]) {
            return Some((
                j,
                format!(
                    "logits digest: generate {:016x?} vs score {:016x}",
                    g.logits_digest.get(j),
                    s.logits_digest[j]
                ),
            ));
        }
        let (a, b) = (
            g.logprobs.get(j).copied().unwrap_or(f32::NAN),
            s.logprobs[j],
        );
        if a.to_bits() != b.to_bits() {
            return Some((
                j,
                format!(
                    "log-prob: generate {a:e} vs score {b:e} (bits {:08x} vs {:08x})",
                    a.to_bits(),
                    b.to_bits()
                ),
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::super::records::{Finish, TopEntry};
    use super::*;

    fn top(ps: &[(u32, f32)]) -> Vec<TopEntry> {
        ps.iter()
            .map(|&(token, p)| TopEntry {
                token,
                logprob: p.ln(),
            })
            .collect()
    }

    fn rec(id: u64, tokens: &[u32], tops: Vec<Vec<TopEntry>>) -> GenRecord {
        let logprobs = tokens
            .iter()
            .zip(&tops)
            .map(|(t, alts)| {
                alts.iter()
                    .find(|a| a.token == *t)
                    .map(|a| a.logprob)
                    .unwrap_or(-9.0)
            })
            .collect();
        GenRecord {
            id,
            prompt_tokens: vec![1, 2],
            tokens: tokens.to_vec(),
            text: None,
            logprobs,
            top: Some(tops),
            logits_digest: tokens.iter().map(|&t| t as u64 * 31).collect(),
            finish: Finish::Length,
        }
    }

    fn base() -> Vec<GenRecord> {
        vec![
            rec(
                0,
                &[5, 6],
                vec![top(&[(5, 0.5), (7, 0.3)]), top(&[(6, 0.9), (5, 0.1)])],
            ),
            rec(1, &[8], vec![top(&[(8, 0.6), (9, 0.4)])]),
        ]
    }

    fn score_of(g: &[GenRecord]) -> Vec<ScoreRecord> {
        g.iter()
            .map(|r| ScoreRecord {
                id: r.id,
                prompt_len: r.prompt_tokens.len(),
                tokens: r.prompt_tokens.iter().chain(&r.tokens).copied().collect(),
                logprobs: r.logprobs.clone(),
                top: None,
                logits_digest: r.logits_digest.clone(),
            })
            .collect()
    }

    fn runs(n: usize) -> Vec<ConfigRun> {
        (0..n)
            .map(|i| ConfigRun {
                name: format!("cfg{i}"),
                records: base(),
            })
            .collect()
    }

    #[test]
    fn identical_runs_are_invariant() {
        let rs = runs(3);
        let s = score_of(&rs[0].records);
        let rep = compare(&rs, Some(&s)).unwrap();
        assert!(rep.invariant(), "{rep:?}");
        assert_eq!(rep.max_unique_outputs, 1);
        assert_eq!(rep.max_top5_divergence.to_bits(), 0.0f64.to_bits());
        assert_eq!(rep.score_equal, Some(true));
    }

    #[test]
    fn one_flipped_bit_is_found() {
        let mut rs = runs(3);
        let lp = &mut rs[2].records[0].logprobs[1];
        *lp = f32::from_bits(lp.to_bits() ^ 1);
        let rep = compare(&rs, None).unwrap();
        assert!(!rep.invariant());
        assert_eq!(rep.prompts[0].unique_outputs, 2);
        assert_eq!(rep.prompts[1].unique_outputs, 1);
        let d = rep.first_difference.unwrap();
        assert_eq!((d.config.as_str(), d.id, d.position), ("cfg2", 0, 1));
        assert!(d.what.contains("log-prob"), "{}", d.what);
    }

    #[test]
    fn divergence_of_the_reference_top5() {
        let mut rs = runs(2);
        // Position 0 moves 0.1 of mass from token 5 to token 7; position 1 is unchanged.
        rs[1].records[0].top.as_mut().unwrap()[0] = top(&[(7, 0.4), (5, 0.4)]);
        let rep = compare(&rs, None).unwrap();
        let d = rep.prompts[0].top5_divergence;
        assert!((d - 0.05).abs() < 1e-6, "{d}");
        assert_eq!(rep.prompts[1].top5_divergence, 0.0);
        assert!(!rep.invariant());
        // A reference token the other run does not list counts as probability 0.
        rs[1].records[1].top.as_mut().unwrap()[0] = top(&[(8, 0.6), (3, 0.4)]);
        let rep = compare(&rs, None).unwrap();
        assert!((rep.prompts[1].top5_divergence - 0.4).abs() < 1e-6);
    }

    #[test]
    fn different_tokens_and_lengths_are_reported() {
        let mut rs = runs(2);
        rs[1].records[1] = rec(1, &[9, 4], vec![top(&[(9, 0.6)]), top(&[(4, 1.0)])]);
        let rep = compare(&rs, None).unwrap();
        let d = rep.first_difference.unwrap();
        assert_eq!((d.id, d.position), (1, 0));
        assert!(d.what.contains("token 8 vs 9"), "{}", d.what);
        let mut rs = runs(2);
        rs[1].records[1].tokens.push(3);
        let d = compare(&rs, None).unwrap().first_difference.unwrap();
        assert_eq!(d.position, 1);
        assert!(d.what.contains("lengths"), "{}", d.what);
    }

    #[test]
    fn score_mismatch_is_reported() {
        let rs = runs(2);
        let mut s = score_of(&rs[0].records);
        s[1].logits_digest[0] ^= 4;
        let rep = compare(&rs, Some(&s)).unwrap();
        assert_eq!(rep.score_equal, Some(false));
        assert_eq!(rep.prompts[0].score_equal, Some(true));
        let d = rep.first_score_difference.clone().unwrap();
        assert_eq!((d.id, d.position), (1, 0));
        assert!(!rep.invariant());
        s.pop();
        let rep = compare(&rs, Some(&s)).unwrap();
        assert_eq!(rep.prompts[1].score_equal, Some(false));
    }

    #[test]
    fn missing_outputs_are_errors() {
        let mut rs = runs(2);
        rs[1].records.pop();
        let e = compare(&rs, None).unwrap_err().to_string();
        assert!(e.contains("cfg1"), "{e}");
        let mut rs = runs(2);
        rs[1].records[1].id = 4;
        assert!(compare(&rs, None)
            .unwrap_err()
            .to_string()
            .contains("request 1"));
        let mut rs = runs(2);
        rs[0].records[0].top = None;
        assert!(compare(&rs, None)
            .unwrap_err()
            .to_string()
            .contains("--logprobs"));
    }
}
