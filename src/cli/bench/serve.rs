//! `arbor bench serve`: a bounded, self-stopping load generator against a loopback
//! `arbor serve` (started here with --model, or given with --addr). Prints throughput,
//! TTFT and inter-token latency percentiles, and how many distinct outputs each repeated
//! prompt got (1 = outputs do not depend on load).

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::cli::common::{self, DeviceArg};
use crate::cli::model_api::Numerics;
use crate::cli::serve::client;

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Start `arbor serve` on this model (under arbor-launch at --tp ranks) for the run.
    #[arg(long, conflicts_with = "addr")]
    pub model: Option<PathBuf>,
    /// Or: a running server on a loopback address (host:port).
    #[arg(long)]
    pub addr: Option<String>,
    /// Ranks of the started server.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// arbor-launch binary (default: next to this executable).
    #[arg(long)]
    pub launcher: Option<PathBuf>,
    /// Passed to arbor-launch for the started server: let N ranks share each GPU, or
    /// `auto` (collectives staged through the host: a checking mode).
    #[arg(long, value_name = "N|auto", value_parser = common::parse_ranks_per_gpu)]
    pub ranks_per_gpu: Option<String>,
    /// Requests in all.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Mean arrival rate in requests/s (exponential gaps); 0 = as fast as the clients go.
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Prompt length range in tokens, MIN:MAX (uniform), after the shared prefix.
    #[arg(long, default_value = "4:64")]
    pub prompt_len: String,
    /// Tokens every prompt starts with (a system prompt): what the server's prefix cache
    /// shares between requests.
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
    /// Output length range in tokens, MIN:MAX (uniform).
    #[arg(long, default_value = "4:32")]
    pub output_len: String,
    /// Each distinct prompt is sent this many times (at different moments, so under
    /// different loads); their outputs must be identical.
    #[arg(long, default_value_t = 4)]
    pub repeat: usize,
    /// Sampling temperature of every request (seeded, so repeats must agree).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Server flags passed through when --model starts one (e.g. "--max-num-seqs 32").
    #[arg(long, allow_hyphen_values = true)]
    pub server_args: Option<String>,
    /// Also write the summary as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `--json`: the printed summary, machine-readable (times in ms).
#[derive(serde::Serialize)]
struct Summary {
    requests_ok: usize,
    requests_failed: usize,
    wall_s: f64,
    requests_per_s: f64,
    output_tokens_per_s: f64,
    ttft_ms_p50: f64,
    ttft_ms_p90: f64,
    ttft_ms_p99: f64,
    itl_ms_p50: f64,
    itl_ms_p90: f64,
    itl_ms_p99: f64,
    e2e_ms_p50: f64,
    e2e_ms_p99: f64,
    distinct_prompts: usize,
    repeat: usize,
    max_distinct_outputs_per_prompt: usize,
    /// From the server's /metrics after the run (None: not reported).
    prefix_cache_hit_rate: Option<f64>,
    prefix_cache_hit_tokens: Option<f64>,
    preemptions: Option<f64>,
    /// The server's engine steps during the run (None: the server does not report them).
    engine: Option<EngineSteps>,
}

/// The engine steps a run caused, from the server's `/metrics` before and after it: where
/// the device time went, split into decode-only steps and steps that carry prompt rows.
#[derive(serde::Serialize, Debug, PartialEq)]
struct EngineSteps {
    steps: f64,
    step_s: f64,
    rows: f64,
    prompt_rows: f64,
    decode_steps: f64,
    decode_step_s: f64,
    decode_rows: f64,
    /// Rank 0's serving loop by phase (`arbor_loop_seconds_total`), seconds.
    loop_execute_s: f64,
    loop_plan_s: f64,
    loop_apply_s: f64,
    loop_between_s: f64,
    /// The decode-only steps by rows (`arbor_decode_band_*`); empty when the server does
    /// not report them.
    decode_bands: Vec<DecodeBand>,
}

/// The decode-only steps of one band of rows ([`arbor_serving::DECODE_ROW_BANDS`]).
#[derive(serde::Serialize, Debug, PartialEq)]
struct DecodeBand {
    rows: &'static str,
    steps: f64,
    seconds: f64,
}

/// The body of a GET that answered 200; None for any other answer or none.
fn get_ok(addr: &str, path: &str) -> Option<String> {
    client::get(addr, path)
        .ok()
        .filter(|r| r.status == 200)
        .map(|r| r.body)
}

fn server_metrics(addr: &str) -> String {
    get_ok(addr, "/metrics").unwrap_or_default()
}

/// `after - before` of each counter; None unless the server reports them all.
fn engine_steps(before: &str, after: &str) -> Option<EngineSteps> {
    let d =
        |name: &str| Some(metric_value(after, name)? - metric_value(before, name).unwrap_or(0.0));
    let phase = |p: &str| d(&format!("arbor_loop_seconds_total{{phase=\"{p}\"}}"));
    Some(EngineSteps {
        steps: d("arbor_steps_total")?,
        step_s: d("arbor_step_seconds_total")?,
        rows: d("arbor_step_rows_total")?,
        prompt_rows: d("arbor_prompt_tokens_total")?,
        decode_steps: d("arbor_decode_steps_total")?,
        decode_step_s: d("arbor_decode_step_seconds_total")?,
        decode_rows: d("arbor_decode_step_rows_total")?,
        loop_execute_s: phase("execute")?,
        loop_plan_s: phase("plan")?,
        loop_apply_s: phase("apply")?,
        loop_between_s: phase("between")?,
        decode_bands: arbor_serving::DECODE_ROW_BANDS
            .iter()
            .filter_map(|&(_, rows)| {
                let band = |name: &str| d(&format!("{name}{{rows=\"{rows}\"}}"));
                Some(DecodeBand {
                    rows,
                    steps: band("arbor_decode_band_steps_total")?,
                    seconds: band("arbor_decode_band_seconds_total")?,
                })
            })
            .collect(),
    })
}

impl EngineSteps {
    /// The decode-only steps by band of rows, the bands that had any: count and mean ms.
    fn band_line(&self) -> Option<String> {
        let bands: Vec<String> = self
            .decode_bands
            .iter()
            .filter(|b| b.steps > 0.0)
            .map(|b| {
                format!(
                    "{} rows {:.0} × {:.1} ms",
                    b.rows,
                    b.steps,
                    1e3 * b.seconds / b.steps
                )
            })
            .collect();
        (!bands.is_empty()).then(|| format!("decode-only steps {}", bands.join(", ")))
    }

    /// Two summary lines: the steps by kind (mean ms and rows each), the loop by phase.
    fn lines(&self) -> [String; 2] {
        let per = |x: f64, n: f64| if n > 0.0 { x / n } else { 0.0 };
        let mixed = self.steps - self.decode_steps;
        [
            format!(
                "engine steps       {:.0} in {:.1} s: decode only {:.0} ({:.1} ms, {:.0} rows each); \
                 with prompt rows {:.0} ({:.1} ms, {:.0} rows of which {:.0} prompt, each)",
                self.steps,
                self.step_s,
                self.decode_steps,
                1e3 * per(self.decode_step_s, self.decode_steps),
                per(self.decode_rows, self.decode_steps),
                mixed,
                1e3 * per(self.step_s - self.decode_step_s, mixed),
                per(self.rows - self.decode_rows, mixed),
                per(self.prompt_rows, mixed),
            ),
            format!(
                "serving loop (s)   execute {:.1}, plan {:.1}, apply {:.1}, between {:.1}",
                self.loop_execute_s, self.loop_plan_s, self.loop_apply_s, self.loop_between_s
            ),
        ]
    }
}

/// The value of `name` in Prometheus text.
fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

fn range(s: &str, what: &str) -> Result<(usize, usize)> {
    let (a, b) = s
        .split_once(':')
        .with_context(|| format!("--{what} {s:?}: expected MIN:MAX"))?;
    let (a, b): (usize, usize) = (
        a.trim()
            .parse()
            .with_context(|| format!("--{what} {s:?}: MIN"))?,
        b.trim()
            .parse()
            .with_context(|| format!("--{what} {s:?}: MAX"))?,
    );
    if a == 0 || b < a {
        bail!("--{what} {s:?}: need 1 <= MIN <= MAX");
    }
    Ok((a, b))
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One request of the run.
struct Planned {
    prompt_idx: usize,
    at: Duration,
    body: String,
}

#[derive(Default)]
struct Outcome {
    prompt_idx: usize,
    ok: bool,
    error: Option<String>,
    ttft: Option<f64>,
    itl: Vec<f64>,
    e2e: f64,
    tokens: usize,
    /// Token ids, log-prob bits and logits digests: what must not depend on load.
    key: String,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i.min(v.len() - 1)]
}

fn loopback(addr: &str) -> Result<()> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .with_context(|| format!("--addr {addr} is not host:port"))?
        .collect();
    if addrs.is_empty() || addrs.iter().any(|a| !a.ip().is_loopback()) {
        bail!("--addr {addr}: the load generator only targets loopback addresses");
    }
    Ok(())
}

struct Started {
    child: Child,
}

impl Drop for Started {
    fn drop(&mut self) {
        // SIGTERM lets the server drain; kill if it does not go.
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(args: &Args, model: &PathBuf) -> Result<(Started, String)> {
    let launcher = common::find_launcher(args.launcher.as_deref())?;
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("no free loopback port")?
        .port();
    let mut cmd = Command::new(launcher);
    cmd.args(["-n", &args.tp.to_string()]);
    if let Some(n) = &args.ranks_per_gpu {
        cmd.args(["--ranks-per-gpu", n]);
    }
    cmd.arg("--")
        .arg(exe)
        .args(["serve", "--model"])
        .arg(model)
        .args([
            "--port",
            &port.to_string(),
            "--device",
            args.device.as_str(),
        ]);
    if let Some(extra) = &args.server_args {
        cmd.args(extra.split_whitespace());
    }
    cmd.stdout(Stdio::null()).stderr(Stdio::inherit());
    let child = cmd
        .spawn()
        .context("starting arbor-launch ... arbor serve")?;
    let mut started = Started { child };
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    loop {
        if let Ok(r) = client::get(&addr, "/health") {
            if r.status == 200 {
                return Ok((started, addr));
            }
        }
        if let Ok(Some(st)) = started.child.try_wait() {
            bail!("the server exited before it was ready ({st})");
        }
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("the server at {addr} was not ready after 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn run_one(addr: &str, body: &str, prompt_idx: usize) -> Outcome {
    let t0 = Instant::now();
    let mut out = Outcome {
        prompt_idx,
        ..Default::default()
    };
    let mut last = t0;
    let mut key = String::new();
    let mut error = None;
    let r = client::post_sse(addr, "/v1/completions", body, &[], |data| {
        if data == "[DONE]" {
            return true;
        }
        let v: Value = match serde_json::from_str(data) {
            Ok(v) => v,
            Err(e) => {
                error = Some(format!("bad event {data:?}: {e}"));
                return false;
            }
        };
        if let Some(e) = v.get("error") {
            error = Some(e.to_string());
            return false;
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            let ids = c["token_ids"].as_array().map_or(0, |a| a.len());
            if ids == 0 {
                continue;
            }
            let now = Instant::now();
            match out.ttft {
                None => out.ttft = Some((now - t0).as_secs_f64()),
                Some(_) => out.itl.push((now - last).as_secs_f64()),
            }
            last = now;
            out.tokens += ids;
            let lps: Vec<String> = c["logprobs"]["token_logprobs"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|l| format!("{:08x}", (l.as_f64().unwrap_or(f64::NAN) as f32).to_bits()))
                .collect();
            key.push_str(&format!(
                "{}|{}|{};",
                c["token_ids"],
                lps.join(","),
                c["logits_digest"]
            ));
        }
        true
    });
    out.e2e = t0.elapsed().as_secs_f64();
    match r {
        Ok(resp) if resp.status == 200 && error.is_none() => out.ok = true,
        Ok(resp) => {
            out.error =
                Some(error.unwrap_or_else(|| format!("HTTP {}: {}", resp.status, resp.body)))
        }
        Err(e) => out.error = Some(e.to_string()),
    }
    out.key = key;
    out
}

pub fn run(args: Args) -> Result<()> {
    let (plo, phi) = range(&args.prompt_len, "prompt-len")?;
    let (olo, ohi) = range(&args.output_len, "output-len")?;
    if args.requests == 0 || args.concurrency == 0 || args.repeat == 0 {
        bail!("--requests, --concurrency and --repeat must be at least 1");
    }
    if !(args.rate.is_finite() && args.rate >= 0.0) {
        bail!("--rate {} must be >= 0", args.rate);
    }
    let (_server, addr) = match (&args.model, &args.addr) {
        (Some(m), _) => {
            let (s, a) = start_server(&args, m)?;
            (Some(s), a)
        }
        (None, Some(a)) => {
            loopback(a)?;
            (None, a.clone())
        }
        (None, None) => bail!("give --model DIR (start a server) or --addr HOST:PORT"),
    };
    // Distinct prompts, each sent `repeat` times at random moments of the run.
    let mut rng = Rng(args.seed ^ 0x5EED);
    let distinct = args.requests.div_ceil(args.repeat);
    let shared: Vec<u32> = (0..args.shared_prefix)
        .map(|_| 3 + (rng.next() % 250) as u32)
        .collect();
    let prompts: Vec<(Vec<u32>, usize)> = (0..distinct)
        .map(|_| {
            let len = rng.uniform(plo, phi);
            let mut toks = shared.clone();
            toks.extend((0..len).map(|_| 3 + (rng.next() % 250) as u32));
            (toks, rng.uniform(olo, ohi))
        })
        .collect();
    let mut order: Vec<usize> = (0..args.requests).map(|i| i % distinct).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let mut at = Duration::ZERO;
    let planned: Vec<Planned> = order
        .into_iter()
        .map(|pi| {
            if args.rate > 0.0 {
                at += Duration::from_secs_f64(-(1.0 - rng.unit()).ln() / args.rate);
            }
            let (toks, max_tokens) = &prompts[pi];
            let body = json!({
                "prompt": toks, "max_tokens": max_tokens, "temperature": args.temperature,
                "seed": args.seed, "sample_id": pi, "logprobs": 0, "stream": true, "ignore_eos": true,
            });
            Planned { prompt_idx: pi, at, body: body.to_string() }
        })
        .collect();
    eprintln!(
        "arbor bench serve: {} requests ({} distinct prompts x {}), {} clients, rate {}, prompt {}{plo}-{phi} tokens, output {olo}-{ohi} tokens, against {addr}",
        args.requests,
        distinct,
        args.repeat,
        args.concurrency,
        if args.rate > 0.0 { format!("{} req/s", args.rate) } else { "unlimited".into() },
        if args.shared_prefix > 0 { format!("{} shared + ", args.shared_prefix) } else { String::new() }
    );
    let planned = Arc::new(planned);
    let next = Arc::new(AtomicUsize::new(0));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let metrics_before = server_metrics(&addr);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..args.concurrency.min(args.requests) {
            let (planned, next, outcomes, addr) = (
                planned.clone(),
                next.clone(),
                outcomes.clone(),
                addr.clone(),
            );
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(p) = planned.get(i) else {
                    return;
                };
                if let Some(wait) = p.at.checked_sub(t0.elapsed()) {
                    std::thread::sleep(wait);
                }
                let o = run_one(&addr, &p.body, p.prompt_idx);
                if let Ok(mut v) = outcomes.lock() {
                    v.push(o);
                }
            });
        }
    });
    let wall = t0.elapsed().as_secs_f64();
    let outcomes = match Arc::try_unwrap(outcomes).map(|m| m.into_inner()) {
        Ok(Ok(v)) => v,
        _ => bail!("a client thread failed"),
    };
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok).collect();
    let tokens: usize = outcomes.iter().map(|o| o.tokens).sum();
    let mut ttft: Vec<f64> = outcomes.iter().filter_map(|o| o.ttft).collect();
    let mut itl: Vec<f64> = outcomes
        .iter()
        .flat_map(|o| o.itl.iter().copied())
        .collect();
    let mut e2e: Vec<f64> = outcomes.iter().map(|o| o.e2e).collect();
    let mut by_prompt: HashMap<usize, std::collections::HashSet<&str>> = HashMap::new();
    for o in outcomes.iter().filter(|o| o.ok) {
        by_prompt
            .entry(o.prompt_idx)
            .or_default()
            .insert(o.key.as_str());
    }
    let max_distinct = by_prompt.values().map(|s| s.len()).max().unwrap_or(0);
    let metrics = server_metrics(&addr);
    let engine = engine_steps(&metrics_before, &metrics);
    let ms = |v: f64| v * 1e3;
    let sum = Summary {
        requests_ok: outcomes.len() - failed.len(),
        requests_failed: failed.len(),
        wall_s: wall,
        requests_per_s: outcomes.len() as f64 / wall,
        output_tokens_per_s: tokens as f64 / wall,
        ttft_ms_p50: ms(percentile(&mut ttft, 50.0)),
        ttft_ms_p90: ms(percentile(&mut ttft, 90.0)),
        ttft_ms_p99: ms(percentile(&mut ttft, 99.0)),
        itl_ms_p50: ms(percentile(&mut itl, 50.0)),
        itl_ms_p90: ms(percentile(&mut itl, 90.0)),
        itl_ms_p99: ms(percentile(&mut itl, 99.0)),
        e2e_ms_p50: ms(percentile(&mut e2e, 50.0)),
        e2e_ms_p99: ms(percentile(&mut e2e, 99.0)),
        distinct_prompts: by_prompt.len(),
        repeat: args.repeat,
        max_distinct_outputs_per_prompt: max_distinct,
        prefix_cache_hit_rate: metric_value(&metrics, "arbor_prefix_cache_hit_rate"),
        prefix_cache_hit_tokens: metric_value(&metrics, "arbor_prefix_cache_hits_total"),
        preemptions: metric_value(&metrics, "arbor_preemptions_total"),
        engine,
    };
    println!(
        "requests           {} ok, {} failed, in {wall:.2} s",
        sum.requests_ok, sum.requests_failed
    );
    println!(
        "throughput         {:.2} req/s, {:.1} output tok/s",
        sum.requests_per_s, sum.output_tokens_per_s
    );
    println!(
        "TTFT (ms)          p50 {:.1}  p90 {:.1}  p99 {:.1}",
        sum.ttft_ms_p50, sum.ttft_ms_p90, sum.ttft_ms_p99
    );
    println!(
        "inter-token (ms)   p50 {:.1}  p90 {:.1}  p99 {:.1}",
        sum.itl_ms_p50, sum.itl_ms_p90, sum.itl_ms_p99
    );
    println!(
        "end-to-end (ms)    p50 {:.1}  p99 {:.1}",
        sum.e2e_ms_p50, sum.e2e_ms_p99
    );
    println!(
        "distinct outputs per repeated prompt: {max_distinct} (max over {} prompts sent {} times each)",
        by_prompt.len(),
        args.repeat
    );
    if let (Some(rate), Some(hits)) = (sum.prefix_cache_hit_rate, sum.prefix_cache_hit_tokens) {
        println!(
            "prefix cache       hit rate {rate:.3} ({hits:.0} prompt tokens reused); {} preemptions",
            sum.preemptions.unwrap_or(0.0)
        );
    }
    if let Some(e) = &sum.engine {
        for line in e.lines() {
            println!("{line}");
        }
        if let Some(line) = e.band_line() {
            println!("{line}");
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&sum)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(f) = failed.first() {
        bail!(
            "{} requests failed; first: {}",
            failed.len(),
            f.error.as_deref().unwrap_or("?")
        );
    }
    if max_distinct > 1 {
        // Only a server that says its numerics are fast may answer a prompt differently
        // under load; any other (invariant, or one that does not say) fails the run.
        if server_numerics(&addr) == Some(Numerics::Fast) {
            println!("(the server runs fast numerics: outputs may depend on load and batch)");
        } else {
            bail!("a repeated prompt got {max_distinct} different outputs: outputs depend on load");
        }
    }
    Ok(())
}

/// The numerics a server reports in `/get_server_info`; `None` for a server that does not
/// say.
fn server_numerics(addr: &str) -> Option<Numerics> {
    let v: Value = serde_json::from_str(&get_ok(addr, "/get_server_info")?).ok()?;
    v.get("numerics")?.as_str()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(steps: u32, secs: f64, decode: u32, decode_secs: f64, execute: f64) -> String {
        format!(
            "# HELP arbor_steps_total Engine steps run.\n# TYPE arbor_steps_total counter\n\
             arbor_steps_total {steps}\narbor_step_seconds_total {secs:.6}\n\
             arbor_step_rows_total {}\narbor_prompt_tokens_total {}\n\
             arbor_decode_steps_total {decode}\narbor_decode_step_seconds_total {decode_secs:.6}\n\
             arbor_decode_step_rows_total {}\n\
             arbor_loop_seconds_total{{phase=\"between\"}} 1.000000\n\
             arbor_loop_seconds_total{{phase=\"plan\"}} 0.500000\n\
             arbor_loop_seconds_total{{phase=\"execute\"}} {execute:.6}\n\
             arbor_loop_seconds_total{{phase=\"masks\"}} 0.100000\n\
             arbor_loop_seconds_total{{phase=\"apply\"}} 0.250000\n\
             arbor_decode_band_steps_total{{rows=\"1-64\"}} {decode}\n\
             arbor_decode_band_seconds_total{{rows=\"1-64\"}} {decode_secs:.6}\n\
             arbor_decode_band_steps_total{{rows=\"65-128\"}} 0\n\
             arbor_decode_band_seconds_total{{rows=\"65-128\"}} 0.000000\n",
            100 * steps,
            40 * (steps - decode),
            60 * decode,
        )
    }

    #[test]
    fn engine_steps_are_the_runs_difference_split_by_kind() {
        let before = metrics(10, 1.0, 6, 0.3, 0.9);
        let after = metrics(30, 4.0, 20, 1.0, 3.9);
        let e = engine_steps(&before, &after).expect("all counters present");
        assert_eq!(e.steps, 20.0);
        assert!((e.step_s - 3.0).abs() < 1e-9);
        assert_eq!(e.decode_steps, 14.0);
        assert_eq!(e.decode_rows, 60.0 * 14.0);
        assert_eq!(e.prompt_rows, 40.0 * 6.0);
        assert!((e.loop_execute_s - 3.0).abs() < 1e-9);
        assert_eq!(e.loop_plan_s, 0.0);
        let [steps, lp] = e.lines();
        // 14 decode-only steps of 50 ms and 60 rows; 6 with prompt rows of 383.3 ms.
        assert!(
            steps.contains("decode only 14 (50.0 ms, 60 rows each)"),
            "{steps}"
        );
        assert!(steps.contains("with prompt rows 6 (383.3 ms"), "{steps}");
        assert!(lp.contains("execute 3.0"), "{lp}");
        // Bands the server reports; a band with no steps in the run is left out.
        assert_eq!(e.decode_bands.len(), 2);
        assert_eq!(
            e.band_line().as_deref(),
            Some("decode-only steps 1-64 rows 14 × 50.0 ms")
        );
        let no_bands = engine_steps("", &after.replace("arbor_decode_band", "other"));
        assert_eq!(no_bands.and_then(|e| e.band_line()), None);
        // A server without the counters (not arbor, or older): nothing, not zeros.
        assert_eq!(engine_steps("", "arbor_steps_total 3\n"), None);
        // Without the before text (first scrape failed), the totals are the run's.
        assert_eq!(engine_steps("", &after).map(|e| e.steps), Some(30.0));
    }
}
