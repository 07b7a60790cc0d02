//! The invariance contract on the tiny models: bit-identical logits digests, tokens and
//! log-probs across TP 1/2/4/8, batch composition, and prefill (score) vs decode (generate).

mod common;

use arbor_model::{Arch, GenOutput, GenRequest, Sampling, ScoreRequest};
use common::*;

fn requests() -> Vec<GenRequest> {
    // Lengths straddle the 32-key attention block; ids are not batch positions.
    [(11u64, 5usize, 10usize), (3, 37, 12), (29, 1, 6)]
        .iter()
        .map(|&(id, len, n)| GenRequest {
            id,
            prompt: prompt(id as u32, len),
            max_new_tokens: n,
        })
        .collect()
}

fn sampled() -> Sampling {
    Sampling {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 1234,
    }
}

fn generate(
    dir: &std::path::Path,
    tp: usize,
    reqs: Vec<GenRequest>,
    s: Sampling,
) -> Vec<GenOutput> {
    let rs = on_ranks(tp, opts(dir), move |mut r| r.generate(&reqs, &s, 3));
    same_on_all_ranks(rs, |o| gen_keys(o))
}

fn check_arch(arch: Arch) {
    let m = tiny(arch, 7);
    let reqs = requests();
    for s in [Sampling::greedy(), sampled()] {
        let base = generate(m.path(), 1, reqs.clone(), s);
        assert!(base.iter().all(|o| !o.tokens.is_empty()));
        for tp in [2, 4, 8] {
            let out = generate(m.path(), tp, reqs.clone(), s);
            assert_eq!(
                gen_keys(&out),
                gen_keys(&base),
                "{arch:?} TP={tp} {s:?} differs from TP=1"
            );
        }
        // Batch composition: each request alone, and the batch reversed, at TP 1 and 4.
        for tp in [1, 4] {
            for (i, r) in reqs.iter().enumerate() {
                let alone = generate(m.path(), tp, vec![r.clone()], s);
                assert_eq!(
                    gen_key(&alone[0]),
                    gen_key(&base[i]),
                    "{arch:?} TP={tp} request {} alone",
                    r.id
                );
            }
            let rev: Vec<GenRequest> = reqs.iter().rev().cloned().collect();
            let out = generate(m.path(), tp, rev, s);
            for (o, b) in out.iter().rev().zip(&base) {
                assert_eq!(gen_key(o), gen_key(b), "{arch:?} TP={tp} reversed batch");
            }
        }
        // Prefill == decode: scoring prompt ++ generated reproduces the log-probs, digests
        // and alternatives bit for bit, at TP 1 and TP 8.
        let sreqs: Vec<ScoreRequest> = reqs
            .iter()
            .zip(&base)
            .map(|(r, o)| ScoreRequest {
                id: r.id,
                tokens: r.prompt.iter().chain(&o.tokens).copied().collect(),
                prompt_len: r.prompt.len(),
            })
            .collect();
        for tp in [1, 8] {
            let sr = sreqs.clone();
            let rs = on_ranks(tp, opts(m.path()), move |mut r| r.score(&sr, 3));
            let scored = same_on_all_ranks(rs, |o| score_keys(o));
            for (sc, g) in scored.iter().zip(&base) {
                let g = gen_key(g);
                assert_eq!(
                    (sc.id, score_key(sc).1, score_key(sc).2, score_key(sc).3),
                    (g.0, g.2, g.3, g.4),
                    "{arch:?} TP={tp} score != generate"
                );
            }
        }
    }
    // Not degenerate: different prompts continue differently, and sampling differs from greedy.
    let g = generate(m.path(), 1, reqs.clone(), Sampling::greedy());
    assert!(
        g.windows(2).any(|w| w[0].tokens != w[1].tokens),
        "all greedy continuations equal: {g:?}"
    );
    let s = generate(m.path(), 1, reqs, sampled());
    assert!(
        g.iter().zip(&s).any(|(a, b)| a.tokens != b.tokens),
        "sampling equals greedy"
    );
}

#[test]
fn llama_tp_batch_prefill_invariance() {
    check_arch(Arch::Llama);
}

#[test]
fn qwen2_tp_batch_prefill_invariance() {
    check_arch(Arch::Qwen2);
}

#[test]
fn qwen3_moe_tp_batch_prefill_invariance() {
    check_arch(Arch::Qwen3Moe);
}

#[test]
fn mixtral_tp_batch_prefill_invariance() {
    check_arch(Arch::Mixtral);
}

#[test]
fn qwen3_tp_batch_prefill_invariance() {
    check_arch(Arch::Qwen3);
}

/// Score with the prompt split differently: the log-prob of a token depends only on its
/// prefix, not on where `prompt_len` is.
#[test]
fn score_depends_on_prefix_only() {
    let m = tiny(Arch::Llama, 3);
    let toks = prompt(5, 45);
    let reqs = vec![
        ScoreRequest {
            id: 1,
            tokens: toks.clone(),
            prompt_len: 1,
        },
        ScoreRequest {
            id: 2,
            tokens: toks.clone(),
            prompt_len: 30,
        },
        ScoreRequest {
            id: 3,
            tokens: toks[..40].to_vec(),
            prompt_len: 40,
        },
    ];
    let rs = on_ranks(2, opts(m.path()), move |mut r| r.score(&reqs, 0));
    let out = same_on_all_ranks(rs, |o| score_keys(o));
    assert_eq!(out[0].logprobs.len(), 44);
    assert_eq!(out[1].logprobs.len(), 15);
    assert!(out[2].logprobs.is_empty());
    let a: Vec<u32> = out[0].logprobs[29..].iter().map(|x| x.to_bits()).collect();
    let b: Vec<u32> = out[1].logprobs.iter().map(|x| x.to_bits()).collect();
    assert_eq!(a, b);
    assert!(out[0].logprobs.iter().all(|&x| x.is_finite() && x <= 0.0));
}
