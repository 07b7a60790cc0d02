//! Host token sampling with a top-k / top-p cut (the path a sampled row takes when its
//! logits come to the host): `arbor_model::sampling::choose` next to the plain selection
//! it replaced (indices selected and sorted by value through a comparison closure), on a
//! Llama-3-sized row. `cargo bench --bench top_k` (`-- --quick` for shorter runs).
use std::time::Duration;

mod common;
use common::time_it;

use arbor_model::sampling::{choose, draw_from};
use arbor_model::Sampling;

/// The replaced selection (indices selected and sorted through a comparison closure),
/// then the same draw.
fn choose_plain(row: &[f32], s: &Sampling, id: u64, position: usize) -> u32 {
    let limit = if s.top_k == 0 {
        row.len()
    } else {
        s.top_k.min(row.len())
    };
    let mut cand: Vec<usize> = (0..row.len()).filter(|&i| !row[i].is_nan()).collect();
    let cmp = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
    if limit < cand.len() {
        cand.select_nth_unstable_by(limit, cmp);
        cand.truncate(limit);
    }
    cand.sort_unstable_by(cmp);
    draw_from(row, &cand, s, id, position)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let budget = Duration::from_millis(if quick { 200 } else { 1000 });
    let vocab = 128_256;
    let mut st = 11u64;
    // Logit-like values on a bf16 grid (many ties), spread as a model's are.
    let row: Vec<f32> = (0..vocab)
        .map(|_| {
            st = st
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            half::bf16::from_f32(((st >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 24.0).to_f32()
        })
        .collect();
    println!(
        "host sampling of one {vocab}-token row, µs per row (median), arbor vs the plain selection"
    );
    println!(
        "{:<30} {:>10} {:>10} {:>7}",
        "sampling", "arbor", "plain", "ratio"
    );
    for (name, top_k, top_p) in [
        ("T 1, top-k 50", 50, 1.0f32),
        ("T 1, top-k 1000", 1000, 1.0),
        ("T 1, top-k 50, top-p 0.9", 50, 0.9),
        ("T 1, top-p 0.9 (no top-k)", 0, 0.9),
    ] {
        let s = Sampling {
            temperature: 1.0,
            top_k,
            top_p,
            seed: 5,
        };
        // Same token from both, at several positions (a check, not the timed part).
        for pos in 0..8 {
            assert_eq!(
                choose(&row, &s, 3, pos),
                choose_plain(&row, &s, 3, pos),
                "{name} position {pos}"
            );
        }
        let mut pos = 0;
        let arbor = time_it(budget, || {
            pos += 1;
            std::hint::black_box(choose(&row, &s, 3, pos));
        });
        let plain = time_it(budget, || {
            pos += 1;
            std::hint::black_box(choose_plain(&row, &s, 3, pos));
        });
        println!(
            "{name:<30} {:>10.1} {:>10.1} {:>6.2}x",
            arbor * 1e6,
            plain * 1e6,
            plain / arbor
        );
    }
}
