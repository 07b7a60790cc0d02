//! `arbor demo`: what a new user runs first. Makes the tiny model if absent, then runs
//! the invariance check over TP 1/2/4/8 × batch 1/3/8, greedy, and shows the table.

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::check;
use super::common::{DeviceArg, SamplingArgs};
use super::make_model::{self, ArchArg, PresetArg};

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
}

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
            PresetArg::Tiny,
            0,
            &dir,
            true,
            make_model::HfConfigArg::V4,
            None,
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
        launcher: args.launcher,
        json: None,
        keep_dir: None,
        perturb_seed_of: None,
    })
}
