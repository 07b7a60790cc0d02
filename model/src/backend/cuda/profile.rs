//! `ARBOR_PROFILE=1`: where a rank's GPU time goes, op by op.
//!
//! nsys is not on every machine arbor runs on, so the backend measures itself: the stream
//! is synchronised before and after every op and the wall time between is charged to the
//! op. That serialises host and device (the profiled run is slower than a normal one), so
//! the table says what each op costs on the device plus its launch, and the difference
//! between a profiled and an unprofiled step is the overlap the normal run gets.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

pub const PROFILE_ENV: &str = "ARBOR_PROFILE";

#[derive(Default)]
struct Entry {
    calls: u64,
    total: Duration,
}

pub struct Profiler {
    rank: usize,
    ops: Mutex<HashMap<String, Entry>>,
}

impl Profiler {
    /// A profiler when `ARBOR_PROFILE` is set to anything but `0` or empty.
    pub fn from_env(rank: usize) -> Option<Self> {
        let on = std::env::var(PROFILE_ENV).is_ok_and(|v| !v.is_empty() && v != "0");
        on.then(|| Self {
            rank,
            ops: Mutex::new(HashMap::new()),
        })
    }

    pub fn add(&self, op: &str, dt: Duration) {
        let mut ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let e = ops.entry(op.to_string()).or_default();
        e.calls += 1;
        e.total += dt;
    }

    /// The table, most expensive op first.
    pub fn report(&self) -> String {
        let ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<(&String, &Entry)> = ops.iter().collect();
        rows.sort_by(|a, b| b.1.total.cmp(&a.1.total).then(a.0.cmp(b.0)));
        let total: f64 = rows.iter().map(|(_, e)| e.total.as_secs_f64()).sum();
        let mut out = format!(
            "profile (rank {}, {PROFILE_ENV}=1, synchronised per op): {:.1} ms in {} ops\n",
            self.rank,
            1e3 * total,
            rows.iter().map(|(_, e)| e.calls).sum::<u64>()
        );
        out.push_str(&format!(
            "{:<28} {:>8} {:>10} {:>10} {:>6}\n",
            "op", "calls", "total ms", "µs/call", "share"
        ));
        for (op, e) in rows {
            let t = e.total.as_secs_f64();
            out.push_str(&format!(
                "{:<28} {:>8} {:>10.2} {:>10.1} {:>5.1}%\n",
                op,
                e.calls,
                1e3 * t,
                1e6 * t / e.calls.max(1) as f64,
                if total > 0.0 { 100.0 * t / total } else { 0.0 }
            ));
        }
        out
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        // The profile is the point of the run that asked for it: print it however the run
        // ends.
        eprint!("{}", self.report());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_orders_ops_by_total_time() {
        let p = Profiler {
            rank: 3,
            ops: Mutex::new(HashMap::new()),
        };
        p.add("rms_norm", Duration::from_micros(10));
        p.add("matmul n=8 k=8", Duration::from_micros(300));
        p.add("rms_norm", Duration::from_micros(30));
        let r = p.report();
        let lines: Vec<&str> = r.lines().collect();
        assert!(
            lines[0].contains("rank 3") && lines[0].contains("0.3 ms in 3 ops"),
            "{r}"
        );
        assert!(lines[2].starts_with("matmul n=8 k=8"), "{r}");
        assert!(
            lines[3].starts_with("rms_norm") && lines[3].contains(" 2 "),
            "{r}"
        );
        assert!(lines[3].contains("20.0"), "{r}");
        std::mem::forget(p);
    }
}
