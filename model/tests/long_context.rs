//! Long prompts and the prefix cache on the tiny models (CPU, TP groups of threads):
//! - prompts of 600 to 1100 tokens, whose rows see keys in two or three attention splits
//!   of 512: the same bits at TP 1/2/4/8, whole or prefilled in chunks, and scoring them
//!   (prefill) gives the log-probs of generating them (decode);
//! - the prefix cache (a repeated system prompt, `n` samples of one prompt, a second turn
//!   of a conversation) gives the bits of recomputation, at every TP, also when the cache
//!   is too small to keep everything (blocks evicted, requests waiting).

mod common;

use arbor_model::batching::scheduler::DEFAULT_STEP_OUTPUTS;
use arbor_model::{
    Arch, GenOutput, GenRequest, KvOptions, LoadOptions, Sampling, ScoreRequest, StepBudget,
};
use common::*;

fn sampled() -> Sampling {
    Sampling {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 77,
    }
}

fn long_opts(dir: &std::path::Path, kv: KvOptions) -> LoadOptions {
    LoadOptions {
        max_seq_len: Some(1200),
        kv,
        ..opts(dir)
    }
}

/// `generate` of each batch in turn on one runner per rank (the prefix cache lives across
/// the calls), the outputs of every call.
fn generate_calls(
    o: LoadOptions,
    tp: usize,
    calls: Vec<Vec<GenRequest>>,
    s: Sampling,
) -> Vec<Vec<GenOutput>> {
    let rs = on_ranks(tp, o, move |mut r| {
        let mut out = Vec::new();
        for reqs in &calls {
            out.push(r.generate(reqs, &s, 3)?);
        }
        Ok((out, r.prefix_cache_stats()))
    });
    let (out, stats) = same_on_all_ranks(rs, |(o, _)| {
        o.iter().map(|v| gen_keys(v)).collect::<Vec<_>>()
    });
    if let Some((st, _)) = stats {
        assert!(st.hits <= st.queried, "{st:?}");
    }
    out
}

fn keys(v: &[Vec<GenOutput>]) -> Vec<Vec<GenKey>> {
    v.iter().map(|o| gen_keys(o)).collect()
}

#[test]
fn long_prompts_cross_attention_splits_with_the_same_bits() {
    let m = tiny(Arch::Llama, 21);
    let reqs: Vec<GenRequest> = [(1u64, 600usize), (2, 1100), (3, 513)]
        .iter()
        .map(|&(id, len)| GenRequest {
            id,
            prompt: prompt(id as u32 + 40, len),
            max_new_tokens: 6,
        })
        .collect();
    let kv = KvOptions {
        prefix_cache: false,
        ..Default::default()
    };
    let base = generate_calls(
        long_opts(m.path(), kv.clone()),
        1,
        vec![reqs.clone()],
        sampled(),
    );
    for tp in [2, 4, 8] {
        let out = generate_calls(
            long_opts(m.path(), kv.clone()),
            tp,
            vec![reqs.clone()],
            sampled(),
        );
        assert_eq!(keys(&out), keys(&base), "TP {tp} differs from TP 1");
    }
    // Prefilled in chunks of 200 rows (splits straddle the chunks): the same bits.
    let chunked = KvOptions {
        step: Some(StepBudget::serving(200, DEFAULT_STEP_OUTPUTS)),
        ..kv.clone()
    };
    let out = generate_calls(
        long_opts(m.path(), chunked),
        2,
        vec![reqs.clone()],
        sampled(),
    );
    assert_eq!(keys(&out), keys(&base), "chunked prefill differs");
    // Scoring prompt ++ generated (prefill) gives generate's (decode) records.
    let sreqs: Vec<ScoreRequest> = reqs
        .iter()
        .zip(&base[0])
        .map(|(r, o)| ScoreRequest {
            id: r.id,
            tokens: r.prompt.iter().chain(&o.tokens).copied().collect(),
            prompt_len: r.prompt.len(),
        })
        .collect();
    let o = long_opts(m.path(), kv);
    let rs = on_ranks(4, o, move |mut r| r.score(&sreqs, 3));
    let scored = same_on_all_ranks(rs, |o| score_keys(o));
    for (sc, g) in scored.iter().zip(&base[0]) {
        let (sk, gk) = (score_key(sc), gen_key(g));
        assert_eq!(
            (sk.0, sk.1, sk.2, sk.3),
            (gk.0, gk.2, gk.3, gk.4),
            "score != generate"
        );
    }
}

/// A system prompt of 3 blocks and a bit shared by several requests, `n` samples of one
/// prompt, and a second turn that continues the first.
fn cached_calls() -> (Vec<GenRequest>, Vec<u32>) {
    let system = prompt(60, 3 * 64 + 10);
    let mut reqs: Vec<GenRequest> = (0..3u64)
        .map(|k| GenRequest {
            id: 10 + k,
            prompt: system
                .iter()
                .chain(&prompt(70 + k as u32, 20 + 30 * k as usize))
                .copied()
                .collect(),
            max_new_tokens: 5,
        })
        .collect();
    let one = prompt(80, 150);
    reqs.extend((0..3u64).map(|k| GenRequest {
        id: 20 + k,
        prompt: one.clone(),
        max_new_tokens: 5,
    }));
    (reqs, one)
}

/// The calls of `cached_calls` and a second turn built on the first call's outputs.
fn with_second_turn(
    o: LoadOptions,
    tp: usize,
    s: Sampling,
) -> (Vec<Vec<GenKey>>, Option<(u64, u64)>) {
    let (reqs, one) = cached_calls();
    let rs = on_ranks(tp, o, move |mut r| {
        let first = r.generate(&reqs, &s, 3)?;
        let turn: Vec<u32> = one
            .iter()
            .chain(&first[3].tokens)
            .chain(&prompt(90, 40))
            .copied()
            .collect();
        let second = r.generate(
            &[GenRequest {
                id: 30,
                prompt: turn,
                max_new_tokens: 5,
            }],
            &s,
            3,
        )?;
        Ok((
            vec![gen_keys(&first), gen_keys(&second)],
            r.prefix_cache_stats().map(|(st, _)| (st.queried, st.hits)),
        ))
    });
    same_on_all_ranks(rs, |(k, _)| k.clone())
}

#[test]
fn the_prefix_cache_gives_the_bits_of_recomputation() {
    let m = tiny(Arch::Qwen3, 22);
    let off = KvOptions {
        prefix_cache: false,
        ..Default::default()
    };
    for s in [Sampling::greedy(), sampled()] {
        let (want, none) = with_second_turn(long_opts(m.path(), off.clone()), 1, s);
        assert_eq!(none.map(|x| x.1), Some(0), "no hits without the cache");
        for tp in [1, 2, 4, 8] {
            let (got, stats) = with_second_turn(long_opts(m.path(), KvOptions::default()), tp, s);
            assert_eq!(
                got, want,
                "TP {tp} {s:?}: the prefix cache changed the records"
            );
            let (queried, hits) = stats.expect("the cache ran");
            // The system prompt's 3 blocks twice, the shared prompt's 2 blocks twice, and the
            // second turn's first 2 blocks (the first turn's prompt).
            assert!(
                hits >= (2 * 3 + 2 * 2 + 2) * 64,
                "TP {tp}: {hits} of {queried} positions from the cache"
            );
        }
    }
}

#[test]
fn a_small_cache_evicts_and_keeps_the_bits() {
    let m = tiny(Arch::Llama, 23);
    let (want, _) = with_second_turn(
        long_opts(
            m.path(),
            KvOptions {
                prefix_cache: false,
                ..Default::default()
            },
        ),
        2,
        sampled(),
    );
    // 8 blocks: the requests wait for each other and cached blocks are evicted.
    let small = KvOptions {
        blocks: Some(8),
        ..Default::default()
    };
    let (got, stats) = with_second_turn(long_opts(m.path(), small), 2, sampled());
    assert_eq!(got, want, "a small cache changed the records");
    assert!(stats.is_some_and(|(_, hits)| hits > 0), "{stats:?}");
}
