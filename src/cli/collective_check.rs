//! `arbor collective-check`: exercises the whole collective stack before any model runs.
//!
//! Run as one rank under `arbor-launch -n W` (W = 1, 2, 4, 8) or alone (W = 1). For each
//! size, 8 segments of pseudo-random f32 values are generated from (seed, size, segment),
//! so every rank can build all of them. Each rank tree-all-reduces the subtree root of its
//! own segments and compares the result bit for bit with the single-process tree over all
//! 8 segments; the ranks also compare digests of their results. Rank 0 prints the report.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use arbor_collective::tree_all_reduce;
use arbor_kernels::tree::{is_valid_world, tree_sum, SegmentLayout, SEGMENTS};

#[derive(clap::Args, Debug, Clone)]
#[command(after_help = "Run it as every rank of a group, e.g.\n  \
    arbor-launch -n 8 -- arbor collective-check\n  \
    mpirun -np 4 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 arbor collective-check\n\
    Alone it is a world of 1. Each rank checks its result bit for bit against the \
    single-process tree over all 8 segments and the ranks compare digests; rank 0 prints \
    the report. Exit status 1 on any mismatch.")]
pub struct Args {
    /// Numbers of f32 elements to all-reduce, one check each.
    #[arg(long, value_delimiter = ',', default_value = "1,7,64,1000,4096,65536")]
    pub sizes: Vec<usize>,

    /// Seed of the pseudo-random data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Testing aid: this rank flips the lowest bit of its first result element, so that
    /// the check must report a mismatch.
    #[arg(long, hide = true, value_name = "RANK")]
    pub corrupt_rank: Option<usize>,
}

/// Largest size accepted (per rank memory: ~10 f32 buffers of this many elements).
const MAX_SIZE: usize = 1 << 26;

/// One rank's outcome for one size, as it travels to rank 0 (little-endian u64 fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Outcome {
    mismatches: u64,
    /// First mismatching index, its value's bits and the reference's (valid if mismatches > 0).
    first: u64,
    got: u32,
    want: u32,
    digest: u64,
}

impl Outcome {
    const BYTES: usize = 32;

    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::BYTES);
        v.extend_from_slice(&self.mismatches.to_le_bytes());
        v.extend_from_slice(&self.first.to_le_bytes());
        v.extend_from_slice(&self.got.to_le_bytes());
        v.extend_from_slice(&self.want.to_le_bytes());
        v.extend_from_slice(&self.digest.to_le_bytes());
        v
    }

    fn decode(b: &[u8]) -> Outcome {
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let u32_at = |i: usize| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[i..i + 4]);
            u32::from_le_bytes(a)
        };
        Outcome {
            mismatches: u64_at(0),
            first: u64_at(8),
            got: u32_at(16),
            want: u32_at(20),
            digest: u64_at(24),
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    if args.sizes.is_empty() {
        bail!("--sizes: give at least one size");
    }
    if let Some(&s) = args.sizes.iter().find(|&&s| s > MAX_SIZE) {
        bail!("--sizes: {s} elements is more than the limit {MAX_SIZE}");
    }
    let (comm, info) = arbor_collective::init_from_env().context("joining the rank group")?;
    let (rank, world) = (comm.rank(), comm.world_size());
    if !is_valid_world(world) {
        bail!("rank {rank}: collective-check needs a world size of 1, 2, 4 or 8, got {world}");
    }
    tracing::info!(
        rank,
        world,
        source = info.source,
        transport = comm.transport(),
        "collective-check"
    );
    let mut lines = Vec::new();
    let mut failed = false;
    for &n in &args.sizes {
        let segs = segments(args.seed, n);
        let own = SegmentLayout::segments_of(rank, world);
        let partial: Vec<f32> = (0..n)
            .map(|j| tree_sum(&column(&segs, j)[own.clone()]))
            .collect();
        let t0 = Instant::now();
        let mut out = tree_all_reduce(comm.as_ref(), &partial)
            .with_context(|| format!("tree all-reduce of {n} elements"))?;
        let micros = t0.elapsed().as_secs_f64() * 1e6;
        if args.corrupt_rank == Some(rank) {
            if let Some(v) = out.first_mut() {
                *v = f32::from_bits(v.to_bits() ^ 1);
            }
        }
        let mut o = Outcome {
            mismatches: 0,
            first: 0,
            got: 0,
            want: 0,
            digest: digest(&out),
        };
        let mut order_sensitive = 0usize;
        for (j, v) in out.iter().enumerate() {
            let col = column(&segs, j);
            let want = tree_sum(&col);
            let sequential = col.iter().fold(0.0f32, |a, &b| a + b);
            if sequential.to_bits() != want.to_bits() {
                order_sensitive += 1;
            }
            if v.to_bits() != want.to_bits() {
                if o.mismatches == 0 {
                    (o.first, o.got, o.want) = (j as u64, v.to_bits(), want.to_bits());
                }
                o.mismatches += 1;
            }
        }
        let all = comm
            .all_gather_bytes(&o.encode())
            .context("gathering the ranks' outcomes")?;
        let outcomes: Vec<Outcome> = all
            .chunks_exact(Outcome::BYTES)
            .map(Outcome::decode)
            .collect();
        let agree = outcomes.iter().all(|x| x.digest == outcomes[0].digest);
        let bad: Vec<(usize, &Outcome)> = outcomes
            .iter()
            .enumerate()
            .filter(|(_, x)| x.mismatches > 0)
            .collect();
        failed |= !agree || !bad.is_empty();
        let verdict = match bad.first() {
            None => "ok".to_string(),
            Some((r, x)) => format!(
                "MISMATCH on {} rank(s); first: rank {r} index {} got {:#010x} want {:#010x} ({} wrong)",
                bad.len(),
                x.first,
                x.got,
                x.want,
                x.mismatches
            ),
        };
        lines.push(format!(
            "{n:>10} {:>17} {:>11} {:>12.1}  {verdict}",
            format!("{order_sensitive}/{n}"),
            if agree { "yes" } else { "NO" },
            micros
        ));
        // Recycle: keep peak memory to one size at a time.
        out.clear();
    }
    if rank == 0 {
        println!(
            "arbor collective-check: world {world} ({}), seed {}, {} segments",
            comm.transport(),
            args.seed,
            SEGMENTS
        );
        println!(
            "{:>10} {:>17} {:>11} {:>12}  vs single-process tree",
            "elements", "order-sensitive", "ranks agree", "time (µs)"
        );
        for l in &lines {
            println!("{l}");
        }
        if !failed {
            println!(
                "all {} size(s) bit-identical to the single-process tree on all {world} rank(s)",
                args.sizes.len()
            );
        }
    }
    comm.barrier().context("final barrier")?;
    if failed {
        bail!("rank {rank}: collective-check found results that are not bit-identical");
    }
    Ok(())
}

/// The 8 segment values of every element, `segs[s][j]`: depends on (seed, n, s, j) only.
fn segments(seed: u64, n: usize) -> Vec<Vec<f32>> {
    (0..SEGMENTS)
        .map(|s| {
            (0..n)
                .map(|j| value(seed, n as u64, s as u64, j as u64))
                .collect()
        })
        .collect()
}

fn column(segs: &[Vec<f32>], j: usize) -> [f32; SEGMENTS] {
    let mut c = [0.0f32; SEGMENTS];
    for (s, seg) in segs.iter().enumerate() {
        c[s] = seg[j];
    }
    c
}

/// A finite f32 with a random sign, mantissa and exponent in [2^-20, 2^20): magnitudes far
/// apart, so that the order of additions shows in the rounded sums.
fn value(seed: u64, n: u64, s: u64, j: u64) -> f32 {
    let h = splitmix64(seed ^ splitmix64(n ^ splitmix64(s ^ splitmix64(j))));
    let sign = ((h >> 63) as u32) << 31;
    let exp = 127 - 20 + ((h >> 23) % 40) as u32;
    let mantissa = (h as u32) & 0x007f_ffff;
    f32::from_bits(sign | (exp << 23) | mantissa)
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a over the result's bits: equal digests on all ranks mean equal bits (up to a
/// 2^-64 chance), without shipping whole results to rank 0.
fn digest(v: &[f32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for x in v {
        for b in x.to_bits().to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_is_finite_deterministic_and_order_sensitive() {
        let a = segments(3, 500);
        assert_eq!(a, segments(3, 500));
        assert_ne!(a, segments(4, 500));
        assert!(a.iter().flatten().all(|v| v.is_finite()));
        let sensitive = (0..500)
            .filter(|&j| {
                let c = column(&a, j);
                c.iter().fold(0.0f32, |x, &y| x + y).to_bits() != tree_sum(&c).to_bits()
            })
            .count();
        assert!(
            sensitive > 100,
            "only {sensitive} of 500 elements are order-sensitive"
        );
    }

    #[test]
    fn outcome_round_trips() {
        let o = Outcome {
            mismatches: 3,
            first: 17,
            got: 0xdead_beef,
            want: 0x3f80_0000,
            digest: u64::MAX - 5,
        };
        assert_eq!(Outcome::decode(&o.encode()), o);
    }
}
