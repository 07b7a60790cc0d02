//! `arbor bench decode`: ms per decode step and prefill time of the real engine, per batch
//! size, with the model loaded once (run under `arbor-launch -n TP` for TP > 1).
//!
//! Each batch size runs `--prompt-len`-token prompts (fixed pseudo-random ids) through
//! `generate` for `--steps` new tokens, greedy (or sampled: `--temperature`, `--top-k`);
//! a warm-up generate first takes the one-time
//! costs (kernel compilation, first collectives, allocator growth) out of the figures. A
//! step is timed from its plan to its rows' records (tokens chosen, log-probs), so host
//! sampling is part of it. Rank 0 prints one line per batch and writes JSON;
//! `scripts/bench/bench-decode.sh` runs this for both numerics and every TP next to the PyTorch
//! reference loop and the weights roofline.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::cli::common::{self, DeviceArg, KvArgs, NumericsArg, StepArgs};
use crate::cli::model_api::{BatchWork, GenRequest, LoadOptions, Runner, Sampling};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory (config.json + safetensors), or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    #[arg(long, value_enum, default_value_t = NumericsArg::Invariant)]
    numerics: NumericsArg,
    /// Batch sizes (sequences decoding together).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    batch: Vec<usize>,
    /// Prompt tokens per sequence (up to the model's context; prompts longer than 8192
    /// tokens are prefilled in chunks, with the same bits).
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// New tokens per sequence (decode steps = steps - 1: the first token comes from the
    /// prefill).
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Sampling temperature (below 1e-5, 0 included: greedy). A pure temperature draws on the device (Gumbel
    /// max); top-k and top-p draw on the host from candidates the device selects.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens when sampling (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the smallest most-likely set whose probability reaches p (1: all). Without
    /// `--top-k`, a nucleus beyond the device's 1024 candidates brings its row to the host.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Time each batch's prefill as the first at its size (buffer growth and first touches
    /// included). By default an untimed prefill of other prompts of the same shape runs
    /// first, so the figure is a steady-state prefill, as the reference loops time theirs
    /// after warm-up runs.
    #[arg(long)]
    cold_prefill: bool,
    /// JSON output (rank 0).
    #[arg(long)]
    out: Option<PathBuf>,
    /// On one rank, a model made by `make-model --per-rank-of-tp N`: reduce its o and
    /// down projections as rank 0 of TP N does (its 8/N of the segments of an N times
    /// longer K), so that a step runs exactly one rank's kernels, all-reduces aside. The
    /// outputs are not a model's: for timing only.
    #[arg(long, value_name = "N")]
    rank_of_tp: Option<usize>,
    #[command(flatten)]
    kv: KvArgs,
    #[command(flatten)]
    step: StepArgs,
}

#[derive(Serialize)]
struct Row {
    tp: usize,
    numerics: &'static str,
    device: &'static str,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    batch: usize,
    prompt_len: usize,
    decode_steps: usize,
    decode_ms_per_step: f64,
    decode_tok_s: f64,
    /// Host time per step after the logits arrived (token choice, log-probs, digests).
    decode_records_ms_per_step: f64,
    prefill_ms: f64,
    prefill_tokens: usize,
    /// The prefill timed was the first at its size (`--cold-prefill`).
    cold_prefill: bool,
    /// bf16 weight bytes each rank holds in its layers and LM head shard: what a dense
    /// decode step streams; a mixture of experts' step reads only the experts its rows
    /// take, so less at small batches.
    weight_bytes_per_rank: u64,
    /// Whether decode steps were recorded as CUDA graphs (`ARBOR_CUDA_GRAPHS`), and how
    /// many of this batch's steps ran from a recording.
    cuda_graphs: bool,
    graph_steps: u64,
    /// `--rank-of-tp`: the row-parallel layers reduced as one rank of this TP size.
    rank_of_tp: Option<usize>,
    /// Ranks on rank 0's GPU where ranks share GPUs (`--ranks-per-gpu`): collectives
    /// staged through the host, the times are not representative.
    shared_gpu_ranks: Option<usize>,
}

/// " T=.. top-k .. top-p .." for a sampled run, empty for greedy.
fn sampling_label(t: f32, k: usize, p: f32) -> String {
    if t < arbor_model::sampling::GREEDY_BELOW {
        return String::new();
    }
    let mut s = format!(" T={t}");
    if k > 0 {
        s += &format!(" top-k {k}");
    }
    if p < 1.0 {
        s += &format!(" top-p {p}");
    }
    s
}

/// Bytes of the weights one rank reads in a decode step (the embedding is a gather).
fn weight_bytes_per_rank(runner: &dyn Runner) -> u64 {
    let c = runner.config();
    let params = c.matrix_params() + c.vocab_size as u64 * c.hidden_size as u64;
    2 * params / runner.tp() as u64
}

/// Prompt ids that are the same on every rank and in every run; `salt` makes each batch
/// size's prompts its own, so that no run finds another's blocks in the prefix cache (every
/// prompt token is computed).
fn prompts(batch: usize, len: usize, vocab: usize, id0: u64, salt: usize) -> Vec<GenRequest> {
    (0..batch)
        .map(|b| GenRequest {
            id: id0 + b as u64,
            prompt: (0..len)
                .map(|j| (((salt * 1009 + b) * 7919 + j * 104_729 + 13) % (vocab - 1)) as u32 + 1)
                .collect(),
            max_new_tokens: 0,
        })
        .collect()
}

pub fn run(a: Args) -> Result<()> {
    if a.batch.is_empty() || a.batch.contains(&0) {
        bail!("--batch needs batch sizes of at least 1");
    }
    if a.prompt_len == 0 || a.steps < 2 {
        bail!("--prompt-len must be at least 1 and --steps at least 2 (one decode step)");
    }
    let sampling = Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: 1,
    };
    sampling
        .validate()
        .context("--temperature / --top-k / --top-p")?;
    let max_seq_len = a.prompt_len + a.steps;
    let mut runner = common::load_runner_with(LoadOptions {
        model_dir: a.model.clone(),
        device: a.device.resolve(),
        max_seq_len: Some(max_seq_len),
        shadow_tp1: false,
        numerics: a.numerics.resolve(),
        rank_of_tp: a.rank_of_tp,
        kv: a.kv.offline()?,
    })?;
    // The warm-up's one short request fits in any of these.
    runner.reserve_steps(a.step.budget(a.batch.iter().map(|&b| BatchWork {
        rows: b * a.prompt_len,
        outputs: b,
        seqs: b,
        longest: max_seq_len,
    })))?;
    let rank = runner.rank();
    let cap = runner
        .kv_capacity()
        .cloned()
        .context("the runner made no KV cache")?;
    // Every sequence of a batch must fit at once, or the batch would decode in waves.
    let per_seq = arbor_kernels::paged::blocks_for(max_seq_len);
    if let Some(&b) = a.batch.iter().find(|&&b| b * per_seq > cap.blocks) {
        bail!(
            "batch {b} of {max_seq_len} positions needs {} KV blocks, the cache holds {} ({}): lower --batch or --prompt-len, or give the cache more memory",
            b * per_seq,
            cap.blocks,
            cap.source
        );
    }
    let vocab = runner.config().vocab_size;
    if vocab < 2 {
        bail!("model {} has a vocabulary of {vocab}", a.model.display());
    }
    let device = a.device.resolve_name();
    let numerics = a.numerics.resolve().as_str();
    let bytes = weight_bytes_per_rank(runner.as_ref());
    let shared = match (device, runner.tp()) {
        ("cuda", tp) if tp > 1 => common::shared_gpu()?,
        _ => None,
    };
    if let (0, Some((ordinal, ranks))) = (rank, shared) {
        eprintln!("bench decode: {}", common::shared_gpu_note(ordinal, ranks));
    }

    let t = Instant::now();
    let mut warm = prompts(1, a.prompt_len.min(16), vocab, 1 << 40, a.batch.len());
    warm[0].max_new_tokens = a.steps.min(4);
    runner
        .generate(&warm, &sampling, 0)
        .context("warm-up generate")?;
    if rank == 0 {
        eprintln!(
            "bench decode: TP {} {device} {numerics}, warm-up {:.2} s, {:.2} GB of weights per rank; KV cache {} blocks ({} tokens, {:.2} GiB per rank)",
            runner.tp(),
            t.elapsed().as_secs_f64(),
            bytes as f64 / 1e9,
            cap.blocks,
            cap.tokens(),
            cap.gib()
        );
    }
    let mut rows = Vec::new();
    for (i, &b) in a.batch.iter().enumerate() {
        if !a.cold_prefill {
            // Other prompts (no prefix shared with the timed ones), one new token: a prefill
            // of the timed shape and nothing else.
            let mut warm = prompts(
                b,
                a.prompt_len,
                vocab,
                ((i as u64) << 20) | (1 << 19),
                a.batch.len() + 1 + i,
            );
            for r in &mut warm {
                r.max_new_tokens = 1;
            }
            runner
                .generate(&warm, &sampling, 0)
                .with_context(|| format!("warm-up prefill at batch {b}"))?;
        }
        let mut reqs = prompts(b, a.prompt_len, vocab, (i as u64) << 20, i);
        for r in &mut reqs {
            r.max_new_tokens = a.steps;
        }
        let before = runner.timing();
        let rec_before = runner.recorded_steps();
        runner
            .generate(&reqs, &sampling, 0)
            .with_context(|| format!("generate at batch {b}"))?;
        let after = runner.timing();
        let rec_after = runner.recorded_steps();
        let steps = after.decode_steps - before.decode_steps;
        let decode_s = after.decode_s - before.decode_s;
        let tokens = after.decode_tokens - before.decode_tokens;
        let row = Row {
            tp: runner.tp(),
            numerics,
            device,
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            batch: b,
            prompt_len: a.prompt_len,
            decode_steps: steps,
            decode_ms_per_step: 1e3 * decode_s / steps.max(1) as f64,
            decode_tok_s: tokens as f64 / decode_s.max(1e-12),
            decode_records_ms_per_step: 1e3 * (after.decode_records_s - before.decode_records_s)
                / steps.max(1) as f64,
            prefill_ms: 1e3 * (after.prefill_s - before.prefill_s),
            prefill_tokens: after.prefill_tokens - before.prefill_tokens,
            cold_prefill: a.cold_prefill,
            weight_bytes_per_rank: bytes,
            rank_of_tp: a.rank_of_tp,
            shared_gpu_ranks: shared.map(|(_, n)| n),
            cuda_graphs: rec_after.is_some(),
            graph_steps: match (rec_before, rec_after) {
                (Some((_, r0)), Some((_, r1))) => r1 - r0,
                _ => 0,
            },
        };
        if rank == 0 {
            println!(
                "TP {} {:<9}{} batch {:>3}: decode {:>8.3} ms/step ({:>8.0} tok/s, {} steps, host records {:.3} ms/step, {}); prefill {:>9.1} ms for {} tokens{}{}",
                row.tp,
                numerics,
                sampling_label(a.temperature, a.top_k, a.top_p),
                b,
                row.decode_ms_per_step,
                row.decode_tok_s,
                steps,
                row.decode_records_ms_per_step,
                if row.cuda_graphs {
                    format!("{} from CUDA graphs", row.graph_steps)
                } else {
                    "no CUDA graphs".to_string()
                },
                row.prefill_ms,
                row.prefill_tokens,
                if a.cold_prefill { " (cold)" } else { "" },
                if shared.is_some() {
                    " [ranks share a GPU: not representative]"
                } else {
                    ""
                }
            );
        }
        rows.push(row);
    }
    if let (0, Some(out)) = (rank, &a.out) {
        let text = serde_json::to_string_pretty(&rows)?;
        std::fs::write(out, text + "\n")
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_in_vocabulary_and_distinct_per_row() {
        let p = prompts(3, 5, 10, 7, 0);
        assert_eq!(p.iter().map(|r| r.id).collect::<Vec<_>>(), [7, 8, 9]);
        for r in &p {
            assert_eq!(r.prompt.len(), 5);
            assert!(r.prompt.iter().all(|&t| (1..10).contains(&t)));
        }
        assert_ne!(p[0].prompt, p[1].prompt);
        let (a, b) = (prompts(2, 64, 128_256, 0, 0), prompts(2, 64, 128_256, 0, 1));
        assert!(a.iter().all(|x| b.iter().all(|y| x.prompt != y.prompt)));
    }
}
