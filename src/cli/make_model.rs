//! `arbor make-model`: a random-weight model in Hugging Face format (wraps
//! `arbor_model::synth`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::model_api::{
    make_model_with_progress, Arch, ConfigFormat, Preset, Progress, SynthOptions,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ArchArg {
    Llama,
    /// Qwen2 / Qwen2.5 (q/k/v biases).
    Qwen2,
    Qwen3,
    /// Qwen3-MoE (tiny: 8 experts, 2 per token; layer 0 dense).
    #[value(name = "qwen3-moe")]
    Qwen3Moe,
    /// Mixtral (tiny: 8 experts, 2 per token).
    Mixtral,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PresetArg {
    /// A few MB; what CI and the demo use.
    Tiny,
    /// Llama-3-8B shapes (~16 GB of bf16).
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// Qwen3-8B shapes (~16 GB of bf16).
    #[value(name = "qwen3-8b")]
    Qwen3_8b,
    /// Qwen3-30B-A3B shapes: 128 experts, 8 per token (~61 GB of bf16 for its 48 layers;
    /// `--layers` writes fewer).
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
    /// Mixtral-8x7B shapes: 8 experts, 2 per token (~93 GB of bf16 for its 32 layers;
    /// `--layers` writes fewer).
    #[value(name = "mixtral-8x7b")]
    Mixtral8x7b,
}

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Architecture [default: the preset's own; llama for tiny].
    #[arg(long, value_enum)]
    pub arch: Option<ArchArg>,
    #[arg(long, value_enum, default_value_t = PresetArg::Tiny)]
    pub preset: PresetArg,
    /// The weights are a function of the seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (created; must be empty unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Write into a non-empty directory, replacing the model files there.
    #[arg(long)]
    pub force: bool,
    /// Which transformers generation's config.json to write: 4 (rope_theta + rope_scaling,
    /// torch_dtype) or 5 (rope_parameters, dtype); arbor reads both to the same bits.
    #[arg(long, value_enum, default_value_t = HfConfigArg::V4)]
    pub hf_config: HfConfigArg,
    /// Write the shape one rank of a TP=N group computes instead (query and KV heads,
    /// intermediate size and vocabulary divided by N): `bench decode` of it on one GPU
    /// measures a rank's compute at TP=N, collectives aside.
    #[arg(long, value_name = "N")]
    pub per_rank_of_tp: Option<usize>,
    /// Write only the first N layers of the preset (every other shape unchanged): a decode
    /// step's time per layer on a machine whose memory or disk does not hold them all.
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfConfigArg {
    #[value(name = "4")]
    V4,
    #[value(name = "5")]
    V5,
}

/// Fails when `dir` exists and holds anything (unless `force`).
pub fn check_out_dir(dir: &Path, force: bool) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        bail!("--out {} exists and is not a directory", dir.display());
    }
    if dir.is_dir() && !force {
        let mut entries = std::fs::read_dir(dir)
            .with_context(|| format!("cannot read directory {}", dir.display()))?;
        if entries.next().is_some() {
            bail!(
                "--out {} is not empty; pass --force to overwrite the model files there",
                dir.display()
            );
        }
    }
    Ok(())
}

/// Writes the model `a` describes, of architecture `arch` (`a.arch` resolved).
pub fn make(arch: ArchArg, a: &Args) -> Result<()> {
    let Args {
        preset,
        seed,
        ref out,
        force,
        hf_config,
        per_rank_of_tp,
        layers,
        ..
    } = *a;
    let out = out.as_path();
    check_out_dir(out, force)?;
    let arch = match arch {
        ArchArg::Llama => Arch::Llama,
        ArchArg::Qwen2 => Arch::Qwen2,
        ArchArg::Qwen3Moe => Arch::Qwen3Moe,
        ArchArg::Mixtral => Arch::Mixtral,
        ArchArg::Qwen3 => Arch::Qwen3,
    };
    let preset = match preset {
        PresetArg::Tiny => Preset::Tiny,
        PresetArg::Llama3_8b => Preset::Llama3_8b,
        PresetArg::Qwen3_8b => Preset::Qwen3_8b,
        PresetArg::Qwen3_30bA3b => Preset::Qwen3_30bA3b,
        PresetArg::Mixtral8x7b => Preset::Mixtral8x7b,
    };
    let big = preset != Preset::Tiny;
    let mut next_report = 0u64;
    let mut report = |p: Progress| {
        // Big presets take minutes: a line per ~2% (or the last tensor) on stderr.
        if big && (p.done_bytes >= next_report || p.done_bytes == p.total_bytes) {
            next_report = p.done_bytes + p.total_bytes / 50;
            eprintln!(
                "make-model: {:5.1}% {:.2} / {:.2} GB  {}",
                100.0 * p.done_bytes as f64 / p.total_bytes.max(1) as f64,
                p.done_bytes as f64 / 1e9,
                p.total_bytes as f64 / 1e9,
                p.tensor
            );
        }
    };
    let mut shape = match per_rank_of_tp {
        Some(tp) => Some(
            preset
                .shape(arch)
                .per_rank(tp)
                .map_err(|e| anyhow::anyhow!("--per-rank-of-tp {tp}: {e}"))?,
        ),
        None => None,
    };
    if let Some(n) = layers {
        let mut s = shape.unwrap_or_else(|| preset.shape(arch));
        if n == 0 || n > s.layers {
            bail!("--layers {n}: the preset has {} layers", s.layers);
        }
        s.layers = n;
        shape = Some(s);
    }
    let opts = SynthOptions {
        config_format: match hf_config {
            HfConfigArg::V4 => ConfigFormat::Transformers4,
            HfConfigArg::V5 => ConfigFormat::Transformers5,
        },
        shape,
        ..SynthOptions::new(arch, preset, seed, out)
    };
    make_model_with_progress(&opts, &mut report)
        .with_context(|| format!("writing the model to {}", out.display()))
}

pub fn run(args: Args) -> Result<()> {
    let natural = match args.preset {
        PresetArg::Tiny | PresetArg::Llama3_8b => ArchArg::Llama,
        PresetArg::Qwen3_8b => ArchArg::Qwen3,
        PresetArg::Qwen3_30bA3b => ArchArg::Qwen3Moe,
        PresetArg::Mixtral8x7b => ArchArg::Mixtral,
    };
    let arch = args.arch.unwrap_or(natural);
    if arch != natural && args.preset != PresetArg::Tiny {
        tracing::warn!(
            "writing {arch:?} architecture with the {:?} preset's shapes",
            args.preset
        );
    }
    make(arch, &args)?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_non_empty_dir_without_force() {
        let dir = std::env::temp_dir().join(format!("arbor-mm-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(check_out_dir(&dir, false).is_ok());
        assert!(check_out_dir(&dir.join("new"), false).is_ok());
        std::fs::write(dir.join("x"), "1").unwrap();
        let e = check_out_dir(&dir, false).unwrap_err().to_string();
        assert!(e.contains("--force") && e.contains("arbor-mm-test"), "{e}");
        assert!(check_out_dir(&dir, true).is_ok());
        assert!(check_out_dir(&dir.join("x"), true).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
