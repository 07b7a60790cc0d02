//! The process-wide thread count of the CPU kernels and the small job runner they share.
//!
//! Kernels never let the thread count change a result: work is cut into jobs whose
//! outputs are disjoint and each output element is computed by the same sequence of
//! operations whichever thread runs its job.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// 0 = not decided yet (read `ARBOR_CPU_THREADS` on first use).
static NUM_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Environment variable that sets the default thread count.
pub const THREADS_ENV: &str = "ARBOR_CPU_THREADS";

/// Set the number of threads every CPU kernel may use (at least 1). When 8 ranks share
/// 2 cores, each rank sets 1.
pub fn set_num_threads(n: usize) {
    NUM_THREADS.store(n.max(1), Ordering::Relaxed);
}

/// The thread count kernels use: [`set_num_threads`], else `ARBOR_CPU_THREADS`, else the
/// machine's available parallelism.
pub fn num_threads() -> usize {
    match NUM_THREADS.load(Ordering::Relaxed) {
        0 => {
            let n = default_threads();
            // A concurrent set_num_threads wins over the default.
            let _ = NUM_THREADS.compare_exchange(0, n, Ordering::Relaxed, Ordering::Relaxed);
            NUM_THREADS.load(Ordering::Relaxed)
        }
        n => n,
    }
}

fn default_threads() -> usize {
    let avail = std::thread::available_parallelism().map_or(1, |n| n.get());
    match std::env::var(THREADS_ENV) {
        Ok(s) => match parse_threads(&s) {
            Some(n) => n,
            None => {
                tracing::warn!(
                    value = %s,
                    fallback = avail,
                    "{THREADS_ENV} is not a positive integer; using the available parallelism"
                );
                avail
            }
        },
        Err(_) => avail,
    }
}

/// A thread count as `ARBOR_CPU_THREADS` gives it: a positive integer.
fn parse_threads(s: &str) -> Option<usize> {
    s.trim().parse::<usize>().ok().filter(|&n| n > 0)
}

/// How many threads a kernel doing `work` multiply-adds over `jobs` jobs should use:
/// small problems run on the calling thread (spawning costs more than it saves).
pub(crate) fn threads_for(work: usize, jobs: usize) -> usize {
    const MIN_WORK_PER_THREAD: usize = 1 << 21;
    let by_work = (work / MIN_WORK_PER_THREAD).max(1);
    // Results never depend on this choice; it only avoids paying thread start-up for
    // less work than it costs.
    num_threads().min(by_work).min(jobs).max(1)
}

/// Run `f(job)` for every job in `0..n_jobs` on `threads` threads (the calling thread is
/// one of them), returning the results in job order.
pub(crate) fn map_jobs<T, F>(n_jobs: usize, threads: usize, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(usize) -> T + Sync,
{
    if threads <= 1 || n_jobs <= 1 {
        return (0..n_jobs).map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let worker = || {
        let mut done = Vec::new();
        loop {
            let j = next.fetch_add(1, Ordering::Relaxed);
            if j >= n_jobs {
                return done;
            }
            done.push((j, f(j)));
        }
    };
    let mut parts = std::thread::scope(|s| {
        let handles: Vec<_> = (1..threads.min(n_jobs)).map(|_| s.spawn(worker)).collect();
        let mut parts = vec![worker()];
        for h in handles {
            match h.join() {
                Ok(p) => parts.push(p),
                // A panicking job is a kernel bug; surface the original panic.
                Err(e) => std::panic::resume_unwind(e),
            }
        }
        parts
    });
    let mut all: Vec<(usize, T)> = parts.iter_mut().flat_map(std::mem::take).collect();
    all.sort_unstable_by_key(|(j, _)| *j);
    all.into_iter().map(|(_, t)| t).collect()
}

/// Call `f(index, chunk)` for every `chunk_len`-sized chunk of `out` on `threads` threads;
/// chunks are handed out one at a time so uneven chunks balance.
pub(crate) fn for_each_chunk_mut<F>(out: &mut [f32], chunk_len: usize, threads: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    if chunk_len == 0 {
        return;
    }
    if threads <= 1 {
        out.chunks_mut(chunk_len)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
        return;
    }
    let queue = Mutex::new(out.chunks_mut(chunk_len).enumerate());
    let worker = || loop {
        // The lock only hands out the next disjoint chunk; a poisoned lock means another
        // worker panicked, which the scope re-raises.
        let item = match queue.lock() {
            Ok(mut q) => q.next(),
            Err(_) => return,
        };
        match item {
            Some((i, c)) => f(i, c),
            None => return,
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(worker);
        }
        worker();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_setting() {
        // Other tests may run kernels meanwhile: their results do not depend on this.
        set_num_threads(3);
        assert_eq!(num_threads(), 3);
        assert_eq!(
            threads_for(usize::MAX, 2),
            2,
            "never more threads than jobs"
        );
        assert_eq!(threads_for(10, 100), 1, "small work stays on the caller");
        set_num_threads(0);
        assert_eq!(num_threads(), 1, "0 means 1");
        assert_eq!(parse_threads(" 4 "), Some(4));
        assert_eq!(parse_threads("0"), None);
        assert_eq!(parse_threads("-2"), None);
        assert_eq!(parse_threads("many"), None);
    }

    #[test]
    fn map_jobs_keeps_job_order() {
        for threads in [1, 2, 3, 8] {
            let r = map_jobs(37, threads, |j| j * 3);
            assert_eq!(
                r,
                (0..37).map(|j| j * 3).collect::<Vec<_>>(),
                "threads {threads}"
            );
        }
    }

    #[test]
    fn chunks_cover_everything_once() {
        for threads in [1, 2, 5] {
            let mut out = vec![0.0f32; 103];
            for_each_chunk_mut(&mut out, 10, threads, |i, c| {
                for v in c.iter_mut() {
                    *v += i as f32 + 1.0;
                }
            });
            for (j, v) in out.iter().enumerate() {
                assert_eq!(*v, (j / 10) as f32 + 1.0);
            }
        }
    }
}
