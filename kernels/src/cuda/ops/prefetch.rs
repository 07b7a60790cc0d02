//! L2 prefetch of a weight ahead of the GEMM that reads it (`prefetch.cu`): which bytes
//! ([`PrefetchPlan`]) and the launch.

use cudarc::driver::LaunchConfig;

use super::{check, DevBf16};
use crate::cuda::{CudaError, GpuDevice};

/// A whole weight is fetched in chunks of this many bytes, one bulk prefetch each: small
/// enough that the prefetches spread over many SMs' copy engines.
const WHOLE_CHUNK: usize = 8 << 10;
/// The smallest head worth an instruction: two 128-byte lines.
const MIN_HEAD: usize = 256;
const THREADS: u32 = 32;

/// What `l2_prefetch_kernel` fetches of a weight: the first `head` bytes of each of
/// `chunks` chunks (`chunk_bytes` apart) of `rows` rows (`row_bytes` apart), none at or
/// past `limit` bytes from the start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefetchPlan {
    pub rows: usize,
    pub row_bytes: usize,
    pub chunks: usize,
    pub chunk_bytes: usize,
    pub head: usize,
    pub limit: usize,
}

impl PrefetchPlan {
    /// About `budget` bytes (never more) of a bf16 weight `[n, k]` whose rows are `n_seg`
    /// tree segments of `seg_len`: all of it where the budget covers it; else the same
    /// share of the start of every segment of every row (a GEMM block streams its own
    /// segments, so every block finds the same share in L2), or of every row where a
    /// segment's share would be under two cache lines; `None` where a row's would be too.
    pub fn new(n: usize, k: usize, seg_len: usize, n_seg: usize, budget: usize) -> Option<Self> {
        let total = n.checked_mul(k)?.checked_mul(2)?;
        if total == 0 || budget < MIN_HEAD {
            return None;
        }
        if budget >= total {
            return Some(Self {
                rows: total.div_ceil(WHOLE_CHUNK),
                row_bytes: WHOLE_CHUNK,
                chunks: 1,
                chunk_bytes: WHOLE_CHUNK,
                head: WHOLE_CHUNK,
                limit: total,
            });
        }
        let share =
            |bytes: usize| (bytes as u128 * budget as u128 / total as u128) as usize / 128 * 128;
        let row_bytes = k * 2;
        let seg_bytes = seg_len * 2;
        let head = share(seg_bytes);
        if n_seg > 1 && n_seg * seg_len == k && head >= MIN_HEAD {
            return Some(Self {
                rows: n,
                row_bytes,
                chunks: n_seg,
                chunk_bytes: seg_bytes,
                head,
                limit: total,
            });
        }
        let head = share(row_bytes);
        (head >= MIN_HEAD).then_some(Self {
            rows: n,
            row_bytes,
            chunks: 1,
            chunk_bytes: row_bytes,
            head,
            limit: total,
        })
    }

    /// The bytes it fetches.
    pub fn bytes(&self) -> usize {
        if self.chunks == 1 && self.head == self.chunk_bytes && self.row_bytes == self.head {
            return self.limit;
        }
        self.rows * self.chunks * self.head
    }
}

impl GpuDevice {
    /// Starts fetching `plan`'s bytes of `w` into L2 (stream-ordered after the work queued
    /// before it; the fetch itself runs on past the kernel). Changes no value anywhere.
    pub fn prefetch_l2(&self, w: &DevBf16, plan: &PrefetchPlan) -> Result<(), CudaError> {
        const K: &str = "l2_prefetch_kernel";
        check(K, plan.limit <= w.len() * 2, || {
            format!(
                "the plan reaches byte {} of a weight of {} bytes",
                plan.limit,
                w.len() * 2
            )
        })?;
        let head = i32::try_from(plan.head).ok().filter(|h| h % 16 == 0);
        let (Some(head), Ok(chunks)) = (head, i32::try_from(plan.chunks)) else {
            return Err(CudaError::Launch {
                kernel: K,
                msg: format!("head {} or {} chunks out of range", plan.head, plan.chunks),
            });
        };
        let count = plan.rows * plan.chunks;
        if count == 0 {
            return Ok(());
        }
        let blocks = count.div_ceil(THREADS as usize).clamp(1, 4 * self.sms);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, row_bytes) = (plan.rows as i64, plan.row_bytes as i64);
        let (chunk_bytes, limit) = (plan.chunk_bytes as i64, plan.limit as i64);
        let mut b = self.launch(self.func(K)?);
        b.arg(w)
            .arg(&rows)
            .arg(&row_bytes)
            .arg(&chunks)
            .arg(&chunk_bytes)
            .arg(&head)
            .arg(&limit);
        self.launched(K, unsafe { b.launch(cfg) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_that_covers_the_weight_fetches_all_of_it_in_chunks() {
        // o of llama3-8b: 4096 × 4096 bf16, 32 MiB.
        let p = PrefetchPlan::new(4096, 4096, 512, 8, 64 << 20).unwrap();
        assert_eq!(p.limit, 32 << 20);
        assert_eq!(p.bytes(), 32 << 20);
        assert_eq!(p.rows * p.row_bytes, 32 << 20);
        assert_eq!((p.chunks, p.head), (1, WHOLE_CHUNK));
        // A size that is not a multiple of the chunk: the last chunk is cut at the limit.
        let p = PrefetchPlan::new(3, 8, 1, 8, 1 << 20).unwrap();
        assert_eq!((p.rows, p.limit, p.bytes()), (1, 48, 48));
    }

    #[test]
    fn a_smaller_budget_takes_the_same_share_of_every_segment() {
        // q/k/v: 6144 × 4096 (48 MiB), 12 MiB: a quarter of each 1 KiB segment.
        let p = PrefetchPlan::new(6144, 4096, 512, 8, 12 << 20).unwrap();
        assert_eq!(
            (p.rows, p.chunks, p.chunk_bytes, p.head),
            (6144, 8, 1024, 256)
        );
        assert_eq!(p.bytes(), 12 << 20);
        // A TP 4 shard of it, 2 segments: the same share.
        let p = PrefetchPlan::new(6144, 1024, 512, 2, 3 << 20).unwrap();
        assert_eq!((p.chunks, p.head), (2, 256));
    }

    #[test]
    fn below_two_lines_a_segment_the_share_is_taken_per_row_or_not_at_all() {
        // gate/up: 28672 × 4096 (224 MiB), 8 MiB: 36 bytes a segment, 292 a row → 256.
        let p = PrefetchPlan::new(28672, 4096, 512, 8, 8 << 20).unwrap();
        assert_eq!((p.chunks, p.chunk_bytes, p.head), (1, 8192, 256));
        assert!(p.bytes() <= 8 << 20);
        // 1 MiB of it: 36 bytes a row, nothing worth fetching.
        assert_eq!(PrefetchPlan::new(28672, 4096, 512, 8, 1 << 20), None);
        assert_eq!(PrefetchPlan::new(28672, 4096, 512, 8, 0), None);
        assert_eq!(PrefetchPlan::new(0, 4096, 512, 8, 1 << 20), None);
    }

    #[test]
    fn heads_are_whole_lines_and_never_exceed_the_budget() {
        for &(n, k, seg, n_seg) in &[
            (4096, 4096, 512, 8),
            (4096, 14336, 1792, 8),
            (1536, 4096, 512, 8),
            (4096, 1024, 512, 2),
        ] {
            for mib in [1usize, 2, 3, 5, 8, 13, 21, 34] {
                let budget = mib << 20;
                if let Some(p) = PrefetchPlan::new(n, k, seg, n_seg, budget) {
                    assert_eq!(p.head % 128, 0, "{p:?}");
                    assert!(
                        p.bytes() <= budget.max(p.limit.min(budget)),
                        "{p:?} over {budget}"
                    );
                    assert!(p.head <= p.chunk_bytes && p.limit == n * k * 2, "{p:?}");
                }
            }
        }
    }
}
