//! GFLOP/s of the CPU `tree_matmul` at SmolLM2-135M's shapes, where K = 576 cuts into
//! segments of 72 columns (4 full 16-lane chunks and a tail of 8), next to the earlier
//! kernel that ran the tail and the trees in scalar code, and K = 1536 / 2048 controls
//! (segments of whole chunks). Both kernels on the same data in the same run; the outputs
//! are compared bit for bit. `cargo bench -p arbor-kernels --bench tree_matmul_tail`
//! (`-- --quick`, `-- --lm-head` for the full 49152-row head).
use std::time::Duration;

#[path = "../../benches/common/mod.rs"]
mod common;
use common::time_it;

use arbor_kernels::cpu::{num_threads, tree_matmul_on, tree_matmul_unfused_on, TreeMatmul};
use half::bf16;

fn data(n: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5)
        })
        .collect()
}

const ROUNDS: usize = 3;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let head_rows = if args.iter().any(|a| a == "--lm-head") {
        49152
    } else {
        8192
    };
    let budget = Duration::from_millis(if quick { 60 } else { 250 });
    let all = num_threads();
    println!("tree_matmul, Y[M,N] = X[M,K]·W[N,K]ᵀ, bf16 in, f32 out, {all} threads available");
    println!(
        "(GFLOP/s = 2·M·N·K / time, time = best of {ROUNDS} alternating medians; \
         before = scalar tail and trees)"
    );
    println!(
        "{:>5} {:>6} {:>6} {:>4} {:>7} | {:>11} {:>10} | {:>7} | bits",
        "M", "N", "K", "seg", "threads", "before GF/s", "after GF/s", "speedup"
    );
    let shapes = [
        (64usize, 576usize, 576usize),
        (64, 1536, 576),
        (64, 576, 1536),
        (1, 576, 576),
        (1, 1536, 576),
        (256, head_rows, 576),
        (64, 1536, 1536),
        (64, 2048, 2048),
        (1, 2048, 2048),
    ];
    for (m, n, k) in shapes {
        let x = data(m * k, 1);
        let w = data(n * k, 2);
        let shape = TreeMatmul::full(m, n, k);
        let mut before = vec![0.0f32; m * n];
        let mut after = vec![0.0f32; m * n];
        let flop = 2.0 * (m * n * k) as f64;
        let mut thread_counts = vec![1];
        if all > 1 {
            thread_counts.push(all);
        }
        for threads in thread_counts {
            // The machine is shared: alternate the two kernels and keep each one's best
            // median, so that a busy stretch does not land on one side only.
            let (mut tb, mut ta) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..ROUNDS {
                tb = tb.min(time_it(budget, || {
                    tree_matmul_unfused_on(&x, &w, shape, &mut before, threads)
                }));
                ta = ta.min(time_it(budget, || {
                    tree_matmul_on(&x, &w, shape, &mut after, threads)
                }));
            }
            let same = before
                .iter()
                .zip(&after)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            println!(
                "{m:>5} {n:>6} {k:>6} {:>4} {threads:>7} | {:>11.2} {:>10.2} | {:>6.2}× | {}",
                shape.seg_len,
                flop / tb / 1e9,
                flop / ta / 1e9,
                tb / ta,
                if same { "equal" } else { "DIFFER" }
            );
            assert!(same, "kernels disagree at M={m} N={n} K={k}");
        }
    }
}
