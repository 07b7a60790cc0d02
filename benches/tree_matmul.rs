//! GFLOP/s of the CPU `tree_matmul` next to the plain sequential-K matmul on the same
//! shapes, on one thread and on all cores. `cargo bench --bench tree_matmul`
//! (`-- --quick` for shorter runs).
use std::time::Duration;

mod common;
use common::time_it;

use arbor_kernels::cpu::{num_threads, plain_matmul_on, tree_matmul_on, TreeMatmul};
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

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let budget = Duration::from_millis(if quick { 100 } else { 400 });
    let all = num_threads();
    let mut thread_counts = vec![1];
    if all > 1 {
        thread_counts.push(all);
    }
    println!("tree_matmul vs plain_matmul, Y[M,N] = X[M,K]·W[N,K]ᵀ, bf16 in, f32 out");
    println!("(median time per call; GFLOP/s = 2·M·N·K / time; ratio = plain time / tree time; {all} threads available)");
    println!(
        "{:>5} {:>6} {:>6} {:>7} | {:>10} {:>10} | {:>10} {:>10} | {:>6}",
        "M", "K", "N", "threads", "tree ms", "tree GF/s", "plain ms", "plain GF/s", "ratio"
    );
    for (k, n) in [(1024usize, 1024usize), (4096, 1024)] {
        let w = data(n * k, 2);
        for m in [1usize, 8, 64, 256] {
            let x = data(m * k, 1);
            let mut out = vec![0.0f32; m * n];
            let flop = 2.0 * (m * n * k) as f64;
            for &t in &thread_counts {
                let tt = time_it(budget, || {
                    tree_matmul_on(&x, &w, TreeMatmul::full(m, n, k), &mut out, t)
                });
                let tp = time_it(budget, || plain_matmul_on(&x, &w, m, n, k, &mut out, t));
                println!(
                    "{m:>5} {k:>6} {n:>6} {t:>7} | {:>10.3} {:>10.2} | {:>10.3} {:>10.2} | {:>6.2}",
                    tt * 1e3,
                    flop / tt / 1e9,
                    tp * 1e3,
                    flop / tp / 1e9,
                    tp / tt
                );
            }
        }
    }
}
