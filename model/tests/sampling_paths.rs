//! A sampled token does not depend on where its draw was made: from the backend's top
//! candidates, from rows brought to the host after the step's stats (a top-p nucleus
//! larger than the candidates), or from whole rows brought for top-N log-probs; at TP 1
//! and TP 2.

mod common;

use arbor_model::{Arch, GenRequest, Preset, Sampling, SynthOptions};
use common::*;

/// A tiny Llama with a vocabulary larger than the backend's 1024 candidates, so that a
/// near-uniform row's top-p nucleus lies beyond them.
fn wide_vocab() -> TempDir {
    let shape = arbor_model::synth::Shape {
        vocab: 3000,
        ..Preset::Tiny.shape(Arch::Llama)
    };
    make(SynthOptions {
        shape: Some(shape),
        ..SynthOptions::new(Arch::Llama, Preset::Tiny, 21, "")
    })
}

fn requests() -> Vec<GenRequest> {
    [(1u64, 7usize), (2, 30), (3, 2)]
        .into_iter()
        .map(|(id, len)| GenRequest {
            id,
            prompt: prompt(id as u32, len),
            max_new_tokens: 6,
        })
        .collect()
}

/// The tokens, log-prob bits and digests of a generation (top-N left out: one run asks
/// for it, the other does not).
fn draws(dir: &std::path::Path, tp: usize, s: Sampling, n_top: usize) -> Vec<GenKey> {
    let rs = on_ranks(tp, opts(dir), move |mut r| {
        r.generate(&requests(), &s, n_top)
    });
    let outs = same_on_all_ranks(rs, |o| gen_keys(o));
    outs.iter()
        .map(|o| {
            let mut k = gen_key(o);
            k.4.clear();
            k
        })
        .collect()
}

#[test]
fn top_p_tokens_do_not_depend_on_where_the_draw_was_made() {
    let m = wide_vocab();
    let top_p = |temperature, top_p| Sampling {
        temperature,
        top_k: 0,
        top_p,
        seed: 13,
    };
    // 0.95 at temperature 4 (a flat row of 3000 tokens): a nucleus beyond the 1024
    // candidates, so the rows come to the host after the stats (checked when this test
    // was written: every sampled row of every step); 0.02 at 0.05: within them.
    for s in [top_p(4.0, 0.95), top_p(0.05, 0.02)] {
        let from_step = draws(m.path(), 1, s, 0);
        // Top-N beyond the candidates brings every row to the host from the start.
        let from_rows = draws(m.path(), 1, s, 1025);
        assert_eq!(from_step, from_rows, "{s:?}: step draw vs whole rows");
        assert_eq!(draws(m.path(), 2, s, 0), from_step, "{s:?}: TP 2 vs TP 1");
        let distinct: std::collections::HashSet<&Vec<u32>> =
            from_step.iter().map(|k| &k.1).collect();
        assert!(
            distinct.len() > 1,
            "{s:?}: every request drew the same tokens"
        );
    }
}

/// A temperature below `GREEDY_BELOW` is greedy, on every path a draw can take (the
/// backend's Gumbel-max draw, top-k candidates, a top-p nucleus, whole rows for top-N):
/// 1/T overflows f32 below ~3e-39 and the scaled logits long before, which once drew
/// low-probability tokens.
#[test]
fn tiny_temperatures_are_greedy() {
    let m = wide_vocab();
    let greedy = draws(m.path(), 1, Sampling::greedy(), 0);
    for t in [1e-45f32, 1e-39, 1e-30, 5e-6] {
        for (top_k, top_p) in [(0, 1.0f32), (40, 1.0), (0, 0.9), (40, 0.9)] {
            let s = Sampling {
                temperature: t,
                top_k,
                top_p,
                seed: 5,
            };
            assert_eq!(draws(m.path(), 1, s, 0), greedy, "{s:?}");
            assert_eq!(draws(m.path(), 1, s, 1025), greedy, "{s:?}, whole rows");
        }
    }
    let s = Sampling {
        temperature: 1e-39,
        top_k: 0,
        top_p: 1.0,
        seed: 5,
    };
    assert_eq!(draws(m.path(), 2, s, 0), greedy, "TP 2");
}
