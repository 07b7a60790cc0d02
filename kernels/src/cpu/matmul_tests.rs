use super::*;
use crate::cpu::testutil::{first_bit_diff, Rng};
use crate::tree::{combine_roots, SegmentLayout};

/// The leaf and tree exactly as specified, written the slow obvious way: element i of a
/// segment into lane i % 16, lanes by `tree_sum`, segments by `tree_sum`.
fn spec(x: &[bf16], w: &[bf16], s: TreeMatmul) -> Vec<f32> {
    let mut out = vec![0.0f32; s.m * s.n];
    for r in 0..s.m {
        for c in 0..s.n {
            let mut segs = [0.0f32; 8];
            for (seg, slot) in segs.iter_mut().enumerate().take(s.n_seg) {
                let lo = (seg * s.seg_len).min(s.k);
                let hi = ((seg + 1) * s.seg_len).min(s.k);
                let mut lanes = [0.0f32; 16];
                for (i, col) in (lo..hi).enumerate() {
                    let p = x[r * s.k + col].to_f32() * w[c * s.k + col].to_f32();
                    lanes[i % 16] += p;
                }
                *slot = tree_sum(&lanes);
            }
            out[r * s.n + c] = tree_sum(&segs[..s.n_seg]);
        }
    }
    out
}

fn f64_ref(x: &[bf16], w: &[bf16], m: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut val = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for r in 0..m {
        for c in 0..n {
            for i in 0..k {
                let p = x[r * k + i].to_f64() * w[c * k + i].to_f64();
                val[r * n + c] += p;
                mag[r * n + c] += p.abs();
            }
        }
    }
    (val, mag)
}

fn run(x: &[bf16], w: &[bf16], s: TreeMatmul, threads: usize, b: Blocking) -> Vec<f32> {
    run_isa(x, w, s, threads, b, Isa::detect())
}

fn run_isa(
    x: &[bf16],
    w: &[bf16],
    s: TreeMatmul,
    threads: usize,
    b: Blocking,
    isa: Isa,
) -> Vec<f32> {
    run_kernel(x, w, s, threads, b, isa, Kernel::Fused)
}

fn run_kernel(
    x: &[bf16],
    w: &[bf16],
    s: TreeMatmul,
    threads: usize,
    b: Blocking,
    isa: Isa,
    kernel: Kernel,
) -> Vec<f32> {
    let mut out = vec![f32::NAN; s.m * s.n];
    tree_matmul_blocked(x, w, s, &mut out, threads, b, isa, kernel);
    out
}

const KERNELS: [Kernel; 2] = [Kernel::Fused, Kernel::Unfused];

const BLOCKINGS: [Blocking; 3] = [
    BLOCKING,
    Blocking { rows: 3, cols: 5 },
    Blocking { rows: 1, cols: 1 },
];

#[test]
fn matches_the_specified_procedure_bitwise() {
    let mut rng = Rng::new(1);
    for (m, n, k) in [
        (1, 1, 1),
        (7, 11, 13),
        (5, 9, 100),
        (6, 5, 257),
        (9, 6, 1000),
        (3, 4, 3),
    ] {
        let x = rng.bf16_vec(m * k, 10);
        let w = rng.bf16_vec(n * k, 10);
        let s = TreeMatmul::full(m, n, k);
        let want = spec(&x, &w, s);
        for isa in Isa::all_available() {
            for kernel in KERNELS {
                for b in BLOCKINGS {
                    for threads in [1, 3] {
                        let got = run_kernel(&x, &w, s, threads, b, isa, kernel);
                        assert_eq!(
                            first_bit_diff(&got, &want),
                            None,
                            "m={m} n={n} k={k} threads={threads} blocking={b:?} {isa:?} {kernel:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn close_to_f64() {
    let mut rng = Rng::new(2);
    for (m, n, k) in [(4, 7, 1), (5, 9, 100), (3, 17, 1029)] {
        let x = rng.bf16_vec(m * k, 3);
        let w = rng.bf16_vec(n * k, 3);
        let mut got = vec![0.0; m * n];
        tree_matmul(&x, &w, TreeMatmul::full(m, n, k), &mut got);
        let mut plain = vec![0.0; m * n];
        plain_matmul(&x, &w, m, n, k, &mut plain);
        let (val, mag) = f64_ref(&x, &w, m, n, k);
        for i in 0..m * n {
            // f32 accumulation of k products: error ≤ k·eps·Σ|p| (loose, but catches any
            // wrong index or dropped term, which err by O(|p|)).
            let tol = 1e-7 * (k as f64 + 1.0) * mag[i] + 1e-30;
            assert!(
                (got[i] as f64 - val[i]).abs() <= tol,
                "tree m={m} n={n} k={k} i={i}: {} vs {}",
                got[i],
                val[i]
            );
            assert!(
                (plain[i] as f64 - val[i]).abs() <= tol,
                "plain m={m} n={n} k={k} i={i}: {} vs {}",
                plain[i],
                val[i]
            );
        }
    }
}

#[test]
fn row_result_independent_of_batch_position_columns_and_threads() {
    let mut rng = Rng::new(3);
    let (m, n, k) = (13, 21, 300);
    let x = rng.bf16_vec(m * k, 8);
    let w = rng.bf16_vec(n * k, 8);
    let s = TreeMatmul::full(m, n, k);
    let batch = run(&x, &w, s, 1, BLOCKING);
    for threads in [2, 4] {
        for b in BLOCKINGS {
            assert_eq!(
                first_bit_diff(&run(&x, &w, s, threads, b), &batch),
                None,
                "threads={threads} {b:?}"
            );
        }
    }
    // Each row alone (m = 1), and inside a different batch at a different position.
    for r in 0..m {
        let row = &x[r * k..(r + 1) * k];
        let alone = run(row, &w, TreeMatmul::full(1, n, k), 1, BLOCKING);
        assert_eq!(
            first_bit_diff(&alone, &batch[r * n..(r + 1) * n]),
            None,
            "row {r} alone"
        );
        let mut other = rng.bf16_vec(5 * k, 8);
        other[2 * k..3 * k].copy_from_slice(row);
        let moved = run(
            &other,
            &w,
            TreeMatmul::full(5, n, k),
            2,
            Blocking { rows: 2, cols: 3 },
        );
        assert_eq!(
            first_bit_diff(&moved[2 * n..3 * n], &batch[r * n..(r + 1) * n]),
            None,
            "row {r} at 2 of 5"
        );
    }
    // A subset of the columns (what a column-parallel shard computes).
    let cols = 4..13;
    let w_sub = &w[cols.start * k..cols.end * k];
    let sub = run(&x, w_sub, TreeMatmul::full(m, cols.len(), k), 1, BLOCKING);
    for r in 0..m {
        assert_eq!(
            first_bit_diff(
                &sub[r * cols.len()..(r + 1) * cols.len()],
                &batch[r * n + cols.start..r * n + cols.end]
            ),
            None,
            "row {r} of a column shard"
        );
    }
}

fn columns(a: &[bf16], rows: usize, k: usize, cols: std::ops::Range<usize>) -> Vec<bf16> {
    (0..rows)
        .flat_map(|r| a[r * k + cols.start..r * k + cols.end].to_vec())
        .collect()
}

#[test]
fn tp_shards_compose_to_the_full_tree() {
    let mut rng = Rng::new(4);
    let (m, n) = (3, 5);
    let mut order_mattered = false;
    for k in [1usize, 5, 8, 16, 100, 127, 129, 1000, 1001] {
        let x = rng.bf16_vec(m * k, 12);
        let w = rng.bf16_vec(n * k, 12);
        let layout = SegmentLayout::new(k);
        let full = run(&x, &w, TreeMatmul::full(m, n, k), 1, BLOCKING);
        for t in [1usize, 2, 4, 8] {
            let roots: Vec<Vec<f32>> = (0..t)
                .map(|r| {
                    let cols = layout.shard(r, t);
                    let s = TreeMatmul {
                        m,
                        n,
                        k: cols.len(),
                        seg_len: layout.seg_len,
                        n_seg: 8 / t,
                    };
                    run(
                        &columns(&x, m, k, cols.clone()),
                        &columns(&w, n, k, cols),
                        s,
                        2,
                        Blocking { rows: 2, cols: 2 },
                    )
                })
                .collect();
            let slices: Vec<&[f32]> = roots.iter().map(|v| v.as_slice()).collect();
            let mut combined = vec![0.0f32; m * n];
            combine_roots(&slices, &mut combined);
            assert_eq!(first_bit_diff(&combined, &full), None, "k={k} tp={t}");
        }
        // The same segment sums added left to right: must differ somewhere, or this data
        // could not catch a kernel that ignores the tree.
        let per_seg: Vec<Vec<f32>> = (0..8)
            .map(|s| {
                let cols = layout.segment(s);
                let sh = TreeMatmul {
                    m,
                    n,
                    k: cols.len(),
                    seg_len: layout.seg_len,
                    n_seg: 1,
                };
                run(
                    &columns(&x, m, k, cols.clone()),
                    &columns(&w, n, k, cols),
                    sh,
                    1,
                    BLOCKING,
                )
            })
            .collect();
        for i in 0..m * n {
            let seq = per_seg.iter().fold(0.0f32, |a, v| a + v[i]);
            order_mattered |= seq.to_bits() != full[i].to_bits();
        }
    }
    assert!(
        order_mattered,
        "test data never distinguishes the tree from a sequential sum"
    );
}

#[test]
fn empty_and_degenerate_shapes() {
    let mut out = vec![f32::NAN; 6];
    tree_matmul(&[], &[], TreeMatmul::full(2, 3, 0), &mut out);
    assert!(
        out.iter().all(|v| v.to_bits() == 0),
        "k = 0 must give +0.0: {out:?}"
    );
    let mut none: Vec<f32> = vec![];
    tree_matmul(&[], &[bf16::ONE; 4], TreeMatmul::full(0, 2, 2), &mut none);
}

#[test]
#[should_panic(expected = "do not fit")]
fn rejects_columns_outside_the_segments() {
    let mut out = vec![0.0; 1];
    let s = TreeMatmul {
        m: 1,
        n: 1,
        k: 10,
        seg_len: 4,
        n_seg: 2,
    };
    tree_matmul(&[bf16::ONE; 10], &[bf16::ONE; 10], s, &mut out);
}

/// Shapes around the leaf's edges: segments of 1..=40 columns (0, 1 or 2 full chunks and
/// every tail length), the last segments short or empty (k not a multiple of 8), shards of
/// 1, 2, 4 or 8 segments, single rows, and tiles cut at every edge.
fn leaf_edge_shape() -> impl proptest::strategy::Strategy<Value = (TreeMatmul, u64)> {
    use proptest::prelude::*;
    (
        prop_oneof![Just(1usize), 1usize..=9],
        1usize..=9,
        1usize..=40,
        0usize..8,
        prop_oneof![Just(8usize), Just(1usize), Just(2usize), Just(4usize)],
        any::<u64>(),
    )
        .prop_map(|(m, n, seg_len, short, n_seg, seed)| {
            let k = (n_seg * seg_len).saturating_sub(short).max(1);
            let shape = TreeMatmul {
                m,
                n,
                k,
                seg_len,
                n_seg,
            };
            (shape, seed)
        })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// The vectorised tail, lane tree and segment tree give the bits of the scalar ones
    /// (and of the written-out definition) on every instruction set this CPU has.
    #[test]
    fn fused_kernel_matches_unfused_and_the_definition((s, seed) in leaf_edge_shape()) {
        let mut rng = Rng::new(seed);
        let x = rng.bf16_vec(s.m * s.k, 12);
        let w = rng.bf16_vec(s.n * s.k, 12);
        let want = spec(&x, &w, s);
        let b = Blocking { rows: 5, cols: 7 };
        for isa in Isa::all_available() {
            let unfused = run_kernel(&x, &w, s, 1, b, isa, Kernel::Unfused);
            let fused = run_kernel(&x, &w, s, 1, b, isa, Kernel::Fused);
            proptest::prop_assert_eq!(first_bit_diff(&unfused, &want), None, "unfused {:?} {:?}", isa, s);
            proptest::prop_assert_eq!(first_bit_diff(&fused, &unfused), None, "fused {:?} {:?}", isa, s);
        }
    }
}
