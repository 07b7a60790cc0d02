//! What the benches share.
use std::time::{Duration, Instant};

/// Run `f` until `budget` has passed (at least 3 timed calls after one warm-up call);
/// the median seconds per call, which shrugs off other processes on a shared machine.
pub fn time_it(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < 3 || start.elapsed() < budget {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}
