//! `arbor check`: runs `generate` under every (TP, batch) configuration through
//! `arbor-launch`, scores the reference's sequences at TP=1, and reports whether all of it
//! is bit-identical (the TP-invariance CI job).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::common::{self, DeviceArg, KvArgs, SamplingArgs, StepArgs};
use super::metrics::{self, ConfigRun, Report, TOP_N};
use super::records::{GenRecord, ScoreRecord};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Model directory, or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// TP sizes to run (each through `arbor-launch -n TP`).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub tp: Vec<usize>,
    /// Static batch sizes to run.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub batch: Vec<usize>,
    /// JSONL prompts (as for `generate`); default: a few built-in prompts of different lengths.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// New tokens per prompt.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Sampling, as for `generate`.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Backend of every configuration (invariance holds per backend).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// The arbor-launch binary (default: next to this executable).
    #[arg(long)]
    pub launcher: Option<PathBuf>,
    /// Passed to arbor-launch: let N ranks share each GPU, or `auto` (as many as it takes,
    /// one per GPU where there are enough), so that every TP size runs on fewer GPUs, with
    /// the collectives staged through the host (see `arbor-launch --help`).
    #[arg(long, value_name = "N|auto", value_parser = common::parse_ranks_per_gpu)]
    pub ranks_per_gpu: Option<String>,
    /// Let the ranks' output (stderr: logs, progress) through while each configuration
    /// runs, instead of keeping it for the message of a configuration that fails. A long
    /// run then shows where it is; `RUST_LOG=info` adds each rank's KV cache and step
    /// choices.
    #[arg(long)]
    pub rank_logs: bool,
    /// Also write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Keep every configuration's JSONL output in this directory (default: a temporary
    /// directory, removed afterwards).
    #[arg(long)]
    pub keep_dir: Option<PathBuf>,
    /// The KV cache's size, passed on to every `generate` and `score`.
    #[command(flatten)]
    pub kv: KvArgs,
    /// Passed on to every `generate` and `score`.
    #[command(flatten)]
    pub step: StepArgs,
    /// TEST ONLY: run configuration TP:BATCH with seed+1, so its outputs really differ;
    /// shows that the check can fail.
    #[arg(long, hide = true, value_parser = parse_config)]
    pub perturb_seed_of: Option<(usize, usize)>,
}

fn parse_config(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not TP:BATCH"))?;
    let n = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|e| format!("{x:?} in {s:?}: {e}"))
    };
    Ok((n(a)?, n(b)?))
}

/// Built-in prompts of different lengths (short, long, numeric, one word).
const DEFAULT_PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "1, 1, 2, 3, 5, 8,",
    "Rust",
];

/// Writes the default prompts: text when the model has a tokenizer, else token ids
/// (all below 256, inside any real vocabulary).
fn write_default_prompts(model: &Path, path: &Path) -> Result<()> {
    let has_tokenizer = arbor_model::checkpoint::has_tokenizer(model);
    let mut lines = String::new();
    for (i, text) in DEFAULT_PROMPTS.iter().enumerate() {
        let line = if has_tokenizer {
            serde_json::json!({ "id": i, "prompt": text })
        } else {
            let ids: Vec<u32> = text.bytes().map(u32::from).collect();
            serde_json::json!({ "id": i, "tokens": ids })
        };
        lines.push_str(&line.to_string());
        lines.push('\n');
    }
    std::fs::write(path, lines).with_context(|| format!("cannot write {}", path.display()))
}

/// A working directory removed on drop unless the user asked to keep it.
struct WorkDir {
    path: PathBuf,
    remove: bool,
}

impl WorkDir {
    fn new(keep: Option<&Path>) -> Result<Self> {
        let (path, remove) = match keep {
            Some(p) => (p.to_path_buf(), false),
            None => {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.subsec_nanos())
                    .unwrap_or(0);
                let name = format!("arbor-check-{}-{nanos}", std::process::id());
                (std::env::temp_dir().join(name), true)
            }
        };
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create directory {}", path.display()))?;
        Ok(Self { path, remove })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// How the configurations are launched.
pub enum Launcher {
    /// An `arbor-launch` binary: its stderr captured and shown on failure, or with
    /// `stream` (`--rank-logs`) passed through as the ranks write it.
    External { path: PathBuf, stream: bool },
    /// The launcher library inside this process (when no `arbor-launch` binary was built,
    /// e.g. after `cargo run -- demo`); the ranks' output goes straight to this stderr.
    InProcess,
}

impl Launcher {
    /// `--launcher PATH`, else `arbor-launch` next to this executable, else in-process;
    /// `stream`: an external launcher passes the ranks' stderr through.
    pub fn find(explicit: Option<&Path>, stream: bool) -> Result<Self> {
        let external = |path| Launcher::External { path, stream };
        if explicit.is_some() {
            return common::find_launcher(explicit).map(external);
        }
        Ok(common::find_launcher(None).map_or(Launcher::InProcess, external))
    }

    /// Whether the ranks' stderr reaches this process's stderr while they run.
    fn streams(&self) -> bool {
        match self {
            Launcher::External { stream, .. } => *stream,
            Launcher::InProcess => true,
        }
    }

    /// Runs `arbor <sub_args>` as `tp` ranks (with `launch_args` for arbor-launch); the
    /// error holds the ranks' stderr where it was not passed through ([`Launcher::streams`]).
    fn run(
        &self,
        tp: usize,
        launch_args: &[OsString],
        sub_args: &[OsString],
        what: &str,
    ) -> Result<()> {
        let arbor = std::env::current_exe().context("cannot find the path of this executable")?;
        match self {
            Launcher::External { path, stream } => {
                let mut cmd = Command::new(path);
                cmd.arg("-n")
                    .arg(tp.to_string())
                    .args(launch_args)
                    .arg("--")
                    .arg(&arbor)
                    .args(sub_args);
                if *stream {
                    cmd.stderr(Stdio::inherit());
                }
                let out = cmd
                    .output()
                    .with_context(|| format!("cannot start {}", path.display()))?;
                if !out.status.success() {
                    if *stream {
                        bail!(
                            "{what} failed ({}); the ranks' errors are above",
                            out.status
                        );
                    }
                    let stderr = String::from_utf8_lossy(&out.stderr);
                    bail!("{what} failed ({}):\n{}", out.status, stderr.trim_end());
                }
            }
            Launcher::InProcess => {
                let mut argv: Vec<OsString> =
                    vec!["arbor-launch".into(), "-n".into(), tp.to_string().into()];
                argv.extend(launch_args.iter().cloned());
                argv.push("--".into());
                argv.push(arbor.into_os_string());
                argv.extend(sub_args.iter().cloned());
                let args = <arbor_launch::Args as clap::Parser>::try_parse_from(argv)
                    .with_context(|| format!("{what}: building the launch command"))?;
                let plan = arbor_launch::plan(&args)
                    .with_context(|| format!("{what}: planning the launch"))?;
                arbor_launch::signals::install()
                    .with_context(|| format!("{what}: installing the signal handlers"))?;
                let code = arbor_launch::supervise::run(&plan)
                    .with_context(|| format!("{what}: launching"))?;
                if code != 0 {
                    bail!("{what} failed (exit code {code}); the ranks' errors are above");
                }
            }
        }
        Ok(())
    }
}

/// A configuration's progress label, its "ok" to follow on the same line, or on a line
/// after the ranks' own where their output comes through.
fn progress(launcher: &Launcher, label: &str) {
    if launcher.streams() {
        eprintln!("{label}");
    } else {
        eprint!("{label}");
    }
}

fn read_records<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    Ok(common::read_jsonl::<T>(path)?
        .into_iter()
        .map(|(_, r)| r)
        .collect())
}

fn config_name(tp: usize, batch: usize) -> String {
    format!("TP={tp} batch={batch}")
}

pub fn run(args: Args) -> Result<()> {
    let report = run_check(&args)?;
    if !report.invariant() {
        let mut msg = String::from("outputs are not bit-identical across configurations");
        if let Some(d) = &report.first_difference {
            msg = format!(
                "{msg}: first difference in {} (vs {}), request {}, generated position {}: {}",
                d.config, report.reference, d.id, d.position, d.what
            );
        }
        if let Some(d) = &report.first_score_difference {
            msg = format!(
                "{msg}; score at TP=1 differs from generate: request {}, position {}: {}",
                d.id, d.position, d.what
            );
        }
        bail!(msg);
    }
    Ok(())
}

/// Runs every configuration and the score pass, prints the table and returns the report.
pub fn run_check(args: &Args) -> Result<Report> {
    if args.tp.is_empty() || args.batch.is_empty() {
        bail!("--tp and --batch need at least one value each");
    }
    if let Some(&bad) = args.tp.iter().find(|&&t| !matches!(t, 1 | 2 | 4 | 8)) {
        bail!("--tp {bad}: TP must be 1, 2, 4 or 8");
    }
    if let Some(&bad) = args.batch.iter().find(|&&b| b == 0) {
        bail!("--batch {bad}: a batch needs at least one request");
    }
    super::generate::validate_sampling(&args.sampling.to_sampling())?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if !arbor_model::checkpoint::is_model(&args.model) {
        bail!(
            "{} is neither a model directory with config.json nor a GGUF file",
            args.model.display()
        );
    }
    let launcher = Launcher::find(args.launcher.as_deref(), args.rank_logs)?;
    let launch_args: Vec<OsString> = match &args.ranks_per_gpu {
        Some(n) => vec!["--ranks-per-gpu".into(), n.into()],
        None => Vec::new(),
    };
    let work = WorkDir::new(args.keep_dir.as_deref())?;
    let prompts = match &args.prompts {
        Some(p) => p.clone(),
        None => {
            let p = work.path.join("prompts.jsonl");
            write_default_prompts(&args.model, &p)?;
            p
        }
    };
    let sampling = if args.sampling.to_sampling().is_greedy() {
        "greedy".to_string()
    } else {
        format!(
            "temperature {} top-k {} top-p {} seed {}",
            args.sampling.temperature, args.sampling.top_k, args.sampling.top_p, args.sampling.seed
        )
    };
    let mut configs: Vec<(usize, usize)> = Vec::new();
    for &t in &args.tp {
        for &b in &args.batch {
            if !configs.contains(&(t, b)) {
                configs.push((t, b));
            }
        }
    }
    eprintln!(
        "arbor check: {} configurations, {} new tokens, {sampling}, device {}{}",
        configs.len(),
        args.max_tokens,
        args.device.as_str(),
        args.ranks_per_gpu
            .as_ref()
            .map_or(String::new(), |n| format!(", {n} ranks per GPU"))
    );

    let mut runs = Vec::with_capacity(configs.len());
    for (i, &(tp, batch)) in configs.iter().enumerate() {
        let name = config_name(tp, batch);
        let out = work.path.join(format!("generate-tp{tp}-b{batch}.jsonl"));
        let seed = if args.perturb_seed_of == Some((tp, batch)) {
            eprintln!(
                "  (test only: {name} runs with seed {})",
                args.sampling.seed.wrapping_add(1)
            );
            args.sampling.seed.wrapping_add(1)
        } else {
            args.sampling.seed
        };
        // OS strings: paths need not be UTF-8.
        let mut sub: Vec<OsString> = vec![
            "generate".into(),
            "--model".into(),
            args.model.clone().into(),
            "--prompts".into(),
            prompts.clone().into(),
            "--max-tokens".into(),
            args.max_tokens.to_string().into(),
            "--temperature".into(),
            args.sampling.temperature.to_string().into(),
            "--top-k".into(),
            args.sampling.top_k.to_string().into(),
            "--top-p".into(),
            args.sampling.top_p.to_string().into(),
            "--seed".into(),
            seed.to_string().into(),
            "--batch".into(),
            batch.to_string().into(),
            "--logprobs".into(),
            TOP_N.to_string().into(),
            "--device".into(),
            args.device.as_str().into(),
            "--out".into(),
            out.clone().into(),
        ];
        sub.extend(args.kv.to_args().into_iter().map(OsString::from));
        sub.extend(args.step.to_args().into_iter().map(OsString::from));
        progress(
            &launcher,
            &format!("[{:>2}/{}] {name:<16} generate ... ", i + 1, configs.len()),
        );
        let t0 = Instant::now();
        launcher.run(tp, &launch_args, &sub, &format!("generate at {name}"))?;
        eprintln!("ok ({:.1} s)", t0.elapsed().as_secs_f64());
        runs.push(ConfigRun {
            name,
            records: read_records::<GenRecord>(&out)?,
        });
    }

    let score_out = work.path.join("score-tp1.jsonl");
    let ref_out = work.path.join(format!(
        "generate-tp{}-b{}.jsonl",
        configs[0].0, configs[0].1
    ));
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    let mut sub: Vec<OsString> = vec![
        "score".into(),
        "--model".into(),
        args.model.clone().into(),
        "--input".into(),
        ref_out.into(),
        "--batch".into(),
        max_batch.to_string().into(),
        "--device".into(),
        args.device.as_str().into(),
        "--out".into(),
        score_out.clone().into(),
    ];
    sub.extend(args.kv.to_args().into_iter().map(OsString::from));
    sub.extend(args.step.to_args().into_iter().map(OsString::from));
    progress(
        &launcher,
        &format!("[score] TP=1 batch={max_batch:<8} score ... "),
    );
    let t0 = Instant::now();
    launcher.run(1, &launch_args, &sub, "score at TP=1")?;
    eprintln!("ok ({:.1} s)", t0.elapsed().as_secs_f64());
    let scores = read_records::<ScoreRecord>(&score_out)?;

    let report = metrics::compare(&runs, Some(&scores))?;
    print_table(&report, args, &runs[0].records);
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "model": args.model,
            "tp": args.tp,
            "batch": args.batch,
            "max_tokens": args.max_tokens,
            "temperature": args.sampling.temperature,
            "top_k": args.sampling.top_k,
            "top_p": args.sampling.top_p,
            "seed": args.sampling.seed,
            "device": args.device.as_str(),
            "invariant": report.invariant(),
            "report": report,
        });
        let text = serde_json::to_string_pretty(&doc).context("serialising the report")?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write report {}", path.display()))?;
    }
    Ok(report)
}

fn yes_no(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "-",
    }
}

fn fmt_div(d: f64) -> String {
    if d == 0.0 {
        "0".into()
    } else {
        format!("{d:.3e}")
    }
}

fn print_table(r: &Report, args: &Args, reference: &[GenRecord]) {
    let tps: Vec<String> = args.tp.iter().map(|t| t.to_string()).collect();
    let bs: Vec<String> = args.batch.iter().map(|b| b.to_string()).collect();
    println!();
    println!(
        "{}: {} prompts x {} configurations (TP {} x batch {}); reference {}",
        args.model.display(),
        r.prompts.len(),
        r.configs.len(),
        tps.join(","),
        bs.join(","),
        r.reference
    );
    println!();
    println!(
        "{:>8}  {:>10}  {:>9}  {:>14}  {:>16}  {:>17}",
        "prompt",
        "prompt tok",
        "new tok",
        "unique outputs",
        "top-5 divergence",
        "score == generate"
    );
    for p in &r.prompts {
        println!(
            "{:>8}  {:>10}  {:>9}  {:>14}  {:>16}  {:>17}",
            p.id,
            p.prompt_tokens,
            p.generated_tokens,
            p.unique_outputs,
            fmt_div(p.top5_divergence),
            yes_no(p.score_equal)
        );
    }
    println!(
        "{:>8}  {:>10}  {:>9}  {:>14}  {:>16}  {:>17}",
        "total",
        "",
        "",
        r.max_unique_outputs,
        fmt_div(r.max_top5_divergence),
        yes_no(r.score_equal)
    );
    if reference.iter().any(|g| g.text.is_some()) {
        println!();
        println!("generated text ({}):", r.reference);
        for g in reference {
            let text: String = g.text.as_deref().unwrap_or("").chars().take(60).collect();
            println!("{:>8}  {text:?}", g.id);
        }
    }
    println!();
    println!("unique outputs: distinct (tokens, log-prob bits, logits digests) across configurations (1 = invariant; total = max)");
    println!("top-5 divergence: max over configurations of mean over positions of max |p - p_ref| over the reference's top-5 tokens (total = max)");
    println!();
    if r.invariant() {
        println!(
            "RESULT: bit-identical across all {} configurations; score at TP=1 equals generate bit for bit.",
            r.configs.len()
        );
    } else {
        println!(
            "RESULT: DIFFERENT: {} of {} prompts differ across configurations.",
            r.prompts_with_differences,
            r.prompts.len()
        );
        if let Some(d) = &r.first_difference {
            println!(
                "first difference: {} vs {}, request {}, generated position {}: {}",
                d.config, r.reference, d.id, d.position, d.what
            );
        }
        if let Some(d) = &r.first_score_difference {
            println!(
                "score vs generate: request {}, position {}: {}",
                d.id, d.position, d.what
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_flag_parses() {
        assert_eq!(parse_config("4:3"), Ok((4, 3)));
        assert!(parse_config("4").is_err());
        assert!(parse_config("a:3").unwrap_err().contains("\"a\""));
    }

    #[test]
    fn default_prompts_without_tokenizer_are_ids() {
        let dir = std::env::temp_dir().join(format!("arbor-check-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("p.jsonl");
        write_default_prompts(&dir, &p).unwrap();
        let got = super::super::generate::collect_prompts(&[], Some(&p)).unwrap();
        assert_eq!(got.len(), DEFAULT_PROMPTS.len());
        assert!(got.iter().all(|p| p
            .tokens
            .as_ref()
            .is_some_and(|t| t.iter().all(|&x| x < 256))));
        let lens: std::collections::HashSet<_> = got
            .iter()
            .map(|p| p.tokens.as_ref().map_or(0, |t| t.len()))
            .collect();
        assert_eq!(
            lens.len(),
            DEFAULT_PROMPTS.len(),
            "prompts of different lengths"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
