//! The serving metrics: the loop updates them, a front end renders them as Prometheus
//! text (`/metrics`) and counts the requests it accepts or refuses.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use arbor_model::batching::Scheduler;

/// Gauges and counters; each is written by one side (the loop or the front end) only.
#[derive(Default)]
pub struct Stats {
    pub waiting: AtomicU64,
    pub running: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub steps: AtomicU64,
    step_seconds_bits: AtomicU64,
    last_step_seconds_bits: AtomicU64,
    pub step_rows: AtomicU64,
    /// The steps without prompt rows (decode only), apart: with the totals they split the
    /// step time into decode and prefill-carrying steps.
    pub decode_steps: AtomicU64,
    decode_step_seconds_bits: AtomicU64,
    pub decode_step_rows: AtomicU64,
    /// The decode-only steps by [`DECODE_ROW_BANDS`]: count and seconds.
    decode_band_steps: [AtomicU64; DECODE_ROW_BANDS.len()],
    decode_band_seconds_bits: [AtomicU64; DECODE_ROW_BANDS.len()],
    pub generated_tokens: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub requests: AtomicU64,
    pub rejected: AtomicU64,
    pub cancelled: AtomicU64,
    pub preemptions: AtomicU64,
    pub prefix_queried: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub prefix_cached_blocks: AtomicU64,
    recent: Mutex<VecDeque<(Instant, u64)>>,
    /// The weights serving now (the control operations set it).
    weight_version: Mutex<String>,
    pub weight_updates: AtomicU64,
    weight_update_seconds_bits: AtomicU64,
    /// `/pause_generation` in effect.
    pub paused: AtomicBool,
    /// Weights or KV cache released (`/release_memory_occupation`): requests get 503.
    pub released: AtomicBool,
    /// Seconds of rank 0's serving loop by [`Phase`].
    phase_seconds_bits: [AtomicU64; Phase::ALL.len()],
}

/// Where rank 0's serving loop spends its time, step by step: what bounds the throughput
/// when the device is not the bound (`arbor_loop_seconds_total{phase=...}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Commands, housekeeping and waiting between steps.
    Between,
    /// The scheduler's plan (with the masks computed with it).
    Plan,
    /// The step on this rank, from the plan's broadcast to its results: the device work,
    /// the draws and the records (including `Masks`).
    Execute,
    /// Within `Execute`: the masks computed while the step's device work runs, and their
    /// broadcast.
    Masks,
    /// The results applied to the scheduler and handed to the streams.
    Apply,
}

impl Phase {
    const ALL: [Phase; 5] = [
        Phase::Between,
        Phase::Plan,
        Phase::Execute,
        Phase::Masks,
        Phase::Apply,
    ];

    fn label(self) -> &'static str {
        match self {
            Phase::Between => "between",
            Phase::Plan => "plan",
            Phase::Execute => "execute",
            Phase::Masks => "masks",
            Phase::Apply => "apply",
        }
    }
}

/// Bands of rows (the most rows, the label) the decode-only steps are counted in
/// (`arbor_decode_band_steps_total{rows="…"}`), cut at the GEMMs' 64-row warpgroup tiles:
/// a step's time is not proportional to its rows, and its mean over all steps hides which
/// tile shapes the time went to (at 129–192 rows the last tile's second warpgroup has no
/// row; at 193–256 both have some).
pub const DECODE_ROW_BANDS: [(usize, &str); 5] = [
    (64, "1-64"),
    (128, "65-128"),
    (192, "129-192"),
    (256, "193-256"),
    (usize::MAX, "257+"),
];

/// The index in [`DECODE_ROW_BANDS`] of a step of `rows` rows.
fn decode_band(rows: usize) -> usize {
    DECODE_ROW_BANDS
        .iter()
        .position(|&(most, _)| rows <= most)
        .unwrap_or(DECODE_ROW_BANDS.len() - 1)
}

/// One counter family with a label: its HELP and TYPE lines, then a sample per value.
fn labelled<'a>(
    out: &mut String,
    name: &str,
    help: &str,
    key: &str,
    samples: impl Iterator<Item = (&'a str, String)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    for (label, value) in samples {
        let _ = writeln!(out, "{name}{{{key}=\"{label}\"}} {value}");
    }
}

/// Generated tokens per second are measured over this window.
const RATE_WINDOW: Duration = Duration::from_secs(10);

fn add_f64(a: &AtomicU64, v: f64) {
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
        Some((f64::from_bits(b) + v).to_bits())
    });
}

impl Stats {
    pub fn record_step(&self, seconds: f64, rows: usize, prompt_rows: usize, sampled: usize) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        add_f64(&self.step_seconds_bits, seconds);
        self.last_step_seconds_bits
            .store(seconds.to_bits(), Ordering::Relaxed);
        self.step_rows.fetch_add(rows as u64, Ordering::Relaxed);
        if prompt_rows == 0 {
            self.decode_steps.fetch_add(1, Ordering::Relaxed);
            add_f64(&self.decode_step_seconds_bits, seconds);
            self.decode_step_rows
                .fetch_add(rows as u64, Ordering::Relaxed);
            let band = decode_band(rows);
            self.decode_band_steps[band].fetch_add(1, Ordering::Relaxed);
            add_f64(&self.decode_band_seconds_bits[band], seconds);
        }
        self.prompt_tokens
            .fetch_add(prompt_rows as u64, Ordering::Relaxed);
        self.generated_tokens
            .fetch_add(sampled as u64, Ordering::Relaxed);
        if let Ok(mut q) = self.recent.lock() {
            let now = Instant::now();
            q.push_back((now, sampled as u64));
            while q
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
            {
                q.pop_front();
            }
        }
    }

    pub fn add_phase(&self, phase: Phase, seconds: f64) {
        add_f64(&self.phase_seconds_bits[phase as usize], seconds);
    }

    pub fn set_gauges(&self, waiting: usize, running: usize, kv: (usize, usize)) {
        self.waiting.store(waiting as u64, Ordering::Relaxed);
        self.running.store(running as u64, Ordering::Relaxed);
        self.kv_blocks_used.store(kv.0 as u64, Ordering::Relaxed);
        self.kv_blocks_total.store(kv.1 as u64, Ordering::Relaxed);
    }

    /// The gauges, the preemption count and the prefix cache's counters, as the scheduler
    /// has them now.
    pub fn set_from(&self, sched: &Scheduler) {
        self.set_gauges(sched.waiting(), sched.running(), sched.kv_blocks());
        self.preemptions
            .store(sched.preemptions(), Ordering::Relaxed);
        let p = sched.prefix_stats();
        self.set_prefix(p.queried, p.hits, sched.cached_blocks());
    }

    pub fn set_prefix(&self, queried: u64, hits: u64, cached_blocks: usize) {
        self.prefix_queried.store(queried, Ordering::Relaxed);
        self.prefix_hits.store(hits, Ordering::Relaxed);
        self.prefix_cached_blocks
            .store(cached_blocks as u64, Ordering::Relaxed);
    }

    pub fn set_weight_version(&self, v: &str) {
        if let Ok(mut w) = self.weight_version.lock() {
            *w = v.to_string();
        }
    }

    pub fn weight_version(&self) -> String {
        self.weight_version
            .lock()
            .map(|w| w.clone())
            .unwrap_or_default()
    }

    /// One weight update applied, taking `seconds`.
    pub fn record_update(&self, seconds: f64) {
        self.weight_updates.fetch_add(1, Ordering::Relaxed);
        add_f64(&self.weight_update_seconds_bits, seconds);
    }

    fn tokens_per_second(&self) -> f64 {
        let Ok(q) = self.recent.lock() else {
            return 0.0;
        };
        let now = Instant::now();
        let n: u64 = q
            .iter()
            .filter(|(t, _)| now.duration_since(*t) <= RATE_WINDOW)
            .map(|(_, n)| n)
            .sum();
        n as f64 / RATE_WINDOW.as_secs_f64()
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let used = g(&self.kv_blocks_used);
        let total = g(&self.kv_blocks_total);
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        metric(
            "arbor_queue_depth",
            "gauge",
            "Sequences waiting for admission.",
            g(&self.waiting).to_string(),
        );
        metric(
            "arbor_running_sequences",
            "gauge",
            "Sequences running (holding KV blocks).",
            g(&self.running).to_string(),
        );
        metric(
            "arbor_kv_blocks_used",
            "gauge",
            "KV blocks held by running sequences.",
            used.to_string(),
        );
        metric(
            "arbor_kv_blocks_total",
            "gauge",
            "KV blocks in the cache.",
            total.to_string(),
        );
        let ratio = if total > 0 {
            used as f64 / total as f64
        } else {
            0.0
        };
        metric(
            "arbor_preemptions_total",
            "counter",
            "Sequences preempted for KV and recomputed.",
            g(&self.preemptions).to_string(),
        );
        let (queried, hits) = (g(&self.prefix_queried), g(&self.prefix_hits));
        metric(
            "arbor_prefix_cache_queries_total",
            "counter",
            "Prompt positions of admitted sequences looked up in the prefix cache.",
            queried.to_string(),
        );
        metric(
            "arbor_prefix_cache_hits_total",
            "counter",
            "Of those, positions found cached (their KV reused, not computed).",
            hits.to_string(),
        );
        metric(
            "arbor_prefix_cache_hit_rate",
            "gauge",
            "Prefix cache hits over queries so far.",
            format!(
                "{:.6}",
                if queried > 0 {
                    hits as f64 / queried as f64
                } else {
                    0.0
                }
            ),
        );
        metric(
            "arbor_prefix_cache_blocks",
            "gauge",
            "KV blocks whose contents the prefix cache holds (in use or idle).",
            g(&self.prefix_cached_blocks).to_string(),
        );
        metric(
            "arbor_kv_usage_ratio",
            "gauge",
            "Fraction of KV blocks in use.",
            format!("{ratio:.6}"),
        );
        metric(
            "arbor_generation_tokens_per_second",
            "gauge",
            "Generated tokens per second over the last 10 s.",
            format!("{:.3}", self.tokens_per_second()),
        );
        metric(
            "arbor_last_step_seconds",
            "gauge",
            "Duration of the last engine step.",
            format!("{:.6}", f64::from_bits(g(&self.last_step_seconds_bits))),
        );
        metric(
            "arbor_step_seconds_total",
            "counter",
            "Time spent in engine steps.",
            format!("{:.6}", f64::from_bits(g(&self.step_seconds_bits))),
        );
        metric(
            "arbor_steps_total",
            "counter",
            "Engine steps run.",
            g(&self.steps).to_string(),
        );
        metric(
            "arbor_step_rows_total",
            "counter",
            "New tokens (rows) run through the model.",
            g(&self.step_rows).to_string(),
        );
        metric(
            "arbor_decode_steps_total",
            "counter",
            "Engine steps without prompt rows (decode only).",
            g(&self.decode_steps).to_string(),
        );
        metric(
            "arbor_decode_step_seconds_total",
            "counter",
            "Time spent in engine steps without prompt rows.",
            format!("{:.6}", f64::from_bits(g(&self.decode_step_seconds_bits))),
        );
        metric(
            "arbor_decode_step_rows_total",
            "counter",
            "Rows of the engine steps without prompt rows.",
            g(&self.decode_step_rows).to_string(),
        );
        metric(
            "arbor_prompt_tokens_total",
            "counter",
            "Prompt tokens prefilled.",
            g(&self.prompt_tokens).to_string(),
        );
        metric(
            "arbor_generation_tokens_total",
            "counter",
            "Tokens generated.",
            g(&self.generated_tokens).to_string(),
        );
        metric(
            "arbor_requests_total",
            "counter",
            "Requests accepted.",
            g(&self.requests).to_string(),
        );
        metric(
            "arbor_requests_rejected_total",
            "counter",
            "Requests refused (4xx/5xx before running).",
            g(&self.rejected).to_string(),
        );
        metric(
            "arbor_sequences_cancelled_total",
            "counter",
            "Sequences cancelled (client gone, stop string, shutdown).",
            g(&self.cancelled).to_string(),
        );
        metric(
            "arbor_weight_updates_total",
            "counter",
            "Weight updates applied.",
            g(&self.weight_updates).to_string(),
        );
        metric(
            "arbor_weight_update_seconds_total",
            "counter",
            "Time spent applying weight updates (reading, cutting and swapping the shards).",
            format!("{:.6}", f64::from_bits(g(&self.weight_update_seconds_bits))),
        );
        metric(
            "arbor_generation_paused",
            "gauge",
            "1 while /pause_generation is in effect.",
            u8::from(self.paused.load(Ordering::Relaxed)).to_string(),
        );
        metric(
            "arbor_memory_released",
            "gauge",
            "1 while the weights or the KV cache are released.",
            u8::from(self.released.load(Ordering::Relaxed)).to_string(),
        );
        // The version is a label (any string): the value is always 1.
        let v = self
            .weight_version()
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        let _ = writeln!(
            out,
            "# HELP arbor_weight_version_info The weight version serving now (label version).\n# TYPE arbor_weight_version_info gauge\narbor_weight_version_info{{version=\"{v}\"}} 1"
        );
        let secs = |a: &AtomicU64| format!("{:.6}", f64::from_bits(g(a)));
        let bands = || DECODE_ROW_BANDS.iter().map(|&(_, label)| label);
        labelled(
            &mut out,
            "arbor_decode_band_steps_total",
            "Engine steps without prompt rows, by their rows.",
            "rows",
            bands().zip(self.decode_band_steps.iter().map(|a| g(a).to_string())),
        );
        labelled(
            &mut out,
            "arbor_decode_band_seconds_total",
            "Time spent in engine steps without prompt rows, by their rows.",
            "rows",
            bands().zip(self.decode_band_seconds_bits.iter().map(secs)),
        );
        labelled(
            &mut out,
            "arbor_loop_seconds_total",
            "Time of rank 0's serving loop by phase (masks: within execute).",
            "phase",
            Phase::ALL
                .iter()
                .map(|&p| (p.label(), secs(&self.phase_seconds_bits[p as usize]))),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_bands_cut_at_the_warpgroup_tiles() {
        let band = |rows| DECODE_ROW_BANDS[decode_band(rows)].1;
        assert_eq!(band(1), "1-64");
        assert_eq!(band(64), "1-64");
        assert_eq!(band(65), "65-128");
        assert_eq!(band(129), "129-192");
        assert_eq!(band(192), "129-192");
        assert_eq!(band(193), "193-256");
        assert_eq!(band(256), "193-256");
        assert_eq!(band(257), "257+");
    }

    #[test]
    fn renders_prometheus_text() {
        let s = Stats::default();
        s.set_gauges(3, 2, (5, 20));
        s.record_step(0.5, 10, 8, 2);
        s.set_prefix(400, 100, 7);
        let t = s.render();
        assert!(t.contains("arbor_prefix_cache_queries_total 400\n"), "{t}");
        assert!(t.contains("arbor_prefix_cache_hits_total 100\n"), "{t}");
        assert!(t.contains("arbor_prefix_cache_hit_rate 0.250000\n"), "{t}");
        assert!(t.contains("arbor_prefix_cache_blocks 7\n"), "{t}");
        assert!(
            t.contains("# TYPE arbor_queue_depth gauge\narbor_queue_depth 3\n"),
            "{t}"
        );
        assert!(t.contains("arbor_kv_usage_ratio 0.250000"), "{t}");
        assert!(t.contains("arbor_generation_tokens_total 2\n"), "{t}");
        assert!(t.contains("arbor_step_seconds_total 0.500000"), "{t}");
        // That step had prompt rows; a decode-only one counts apart as well.
        assert!(t.contains("arbor_decode_steps_total 0\n"), "{t}");
        s.record_step(0.25, 4, 0, 4);
        let t = s.render();
        assert!(t.contains("arbor_steps_total 2\n"), "{t}");
        assert!(t.contains("arbor_decode_steps_total 1\n"), "{t}");
        assert!(
            t.contains("arbor_decode_step_seconds_total 0.250000\n"),
            "{t}"
        );
        assert!(t.contains("arbor_decode_step_rows_total 4\n"), "{t}");
        assert!(
            t.contains("arbor_decode_band_steps_total{rows=\"1-64\"} 1\n"),
            "{t}"
        );
        let b = Stats::default();
        b.record_step(0.125, 160, 0, 160);
        b.record_step(0.125, 192, 0, 192);
        b.record_step(0.5, 300, 0, 300);
        b.record_step(0.5, 300, 100, 300);
        let t = b.render();
        for line in [
            "arbor_decode_band_steps_total{rows=\"129-192\"} 2\n",
            "arbor_decode_band_seconds_total{rows=\"129-192\"} 0.250000\n",
            "arbor_decode_band_steps_total{rows=\"193-256\"} 0\n",
            // The step with prompt rows is not a decode-only step.
            "arbor_decode_band_steps_total{rows=\"257+\"} 1\n",
        ] {
            assert!(t.contains(line), "{line:?} missing from:\n{t}");
        }
        s.add_phase(Phase::Masks, 0.25);
        s.add_phase(Phase::Masks, 0.5);
        let t = s.render();
        assert!(
            t.contains("arbor_loop_seconds_total{phase=\"masks\"} 0.750000\n"),
            "{t}"
        );
        assert!(
            t.contains("arbor_loop_seconds_total{phase=\"plan\"} 0.000000\n"),
            "{t}"
        );
        assert!(
            t.contains("arbor_generation_tokens_per_second 0.600"),
            "{t}"
        );
    }
}
