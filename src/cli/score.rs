//! `arbor score`: teacher-forced log-probs of given sequences (prefill only, the trainer's
//! path), as one rank of a TP group.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use super::common::{self, DeviceArg, JsonlSink, KvArgs, NumericsArg, StepArgs};
use super::generate::{budget_of, run_batches};
use super::model_api::{BatchWork, ScoreRequest};
use super::records::{ScoreLine, ScoreRecord, TopEntry};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Model directory (config.json, *.safetensors), or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL: {"id":..,"tokens":[...],"prompt_len":n} per line, or `arbor generate` output.
    #[arg(long)]
    pub input: PathBuf,
    /// Sequences per static batch, taken in input order.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Also report the N most likely alternatives at each scored position.
    #[arg(long, default_value_t = 0)]
    pub logprobs: usize,
    /// Write JSONL here (rank 0 only); default stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Context length to allocate (default: the model's).
    #[arg(long)]
    pub max_seq_len: Option<usize>,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// `fast`: cuBLAS and NCCL's all-reduce (CUDA only), no invariance promise; for
    /// measuring the price of determinism.
    #[arg(long, value_enum, default_value_t = NumericsArg::Invariant)]
    pub numerics: NumericsArg,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub step: StepArgs,
}

/// What one static batch of `reqs` asks of a step: every sequence prefilled, with the
/// logits of each scored position.
fn batch_work(reqs: &[ScoreRequest]) -> BatchWork {
    BatchWork {
        rows: reqs.iter().map(|r| r.tokens.len()).sum(),
        outputs: reqs
            .iter()
            .map(|r| r.tokens.len().saturating_sub(r.prompt_len))
            .sum(),
        seqs: reqs.len(),
        longest: reqs.iter().map(|r| r.tokens.len()).max().unwrap_or(0),
    }
}

/// The scoring requests of an input file, ids defaulting to the record's index.
pub fn read_requests(path: &Path) -> Result<Vec<ScoreRequest>> {
    let mut reqs = Vec::new();
    for (line, rec) in common::read_jsonl::<ScoreLine>(path)? {
        let (id, tokens, prompt_len) = rec
            .sequence(line)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        reqs.push(ScoreRequest {
            id: id.unwrap_or(reqs.len() as u64),
            tokens,
            prompt_len,
        });
    }
    if reqs.is_empty() {
        bail!("{} holds no sequences", path.display());
    }
    common::check_unique_ids(reqs.iter().map(|r| r.id), &path.display().to_string())?;
    Ok(reqs)
}

pub fn run(args: Args) -> Result<()> {
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let reqs = read_requests(&args.input)?;
    let mut runner = common::load_runner(
        &args.model,
        args.device,
        args.max_seq_len,
        false,
        args.numerics,
        args.kv.offline()?,
    )?;
    runner.reserve_steps(budget_of(args.step, &reqs, args.batch, batch_work))?;
    // Rank 0 writes each batch as it finishes.
    let mut sink = match runner.rank() {
        0 => Some(JsonlSink::create(args.out.as_deref())?),
        _ => None,
    };
    run_batches(&reqs, args.batch, |chunk| {
        let outs = runner.score(chunk, args.logprobs)?;
        for pair in common::paired(chunk, outs, |r, o| (r.id, o.id), "sequence")? {
            let (req, out) = pair?;
            let Some(sink) = sink.as_mut() else {
                continue;
            };
            sink.write(&ScoreRecord {
                id: out.id,
                prompt_len: req.prompt_len,
                tokens: req.tokens.clone(),
                logprobs: out.logprobs,
                top: TopEntry::table(args.logprobs, out.top),
                logits_digest: out.logits_digest,
            })?;
        }
        Ok(())
    })?;
    match sink {
        Some(sink) => sink.finish(),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_input_forms() {
        let dir = std::env::temp_dir().join(format!("arbor-score-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("s.jsonl");
        std::fs::write(
            &p,
            "{\"tokens\":[1,2,3],\"prompt_len\":1}\n\
             {\"id\":5,\"prompt_tokens\":[4],\"tokens\":[6,7],\"logprobs\":[-1,-2]}\n",
        )
        .unwrap();
        let r = read_requests(&p).unwrap();
        assert_eq!(
            (r[0].id, r[0].prompt_len, r[0].tokens.clone()),
            (0, 1, vec![1, 2, 3])
        );
        assert_eq!(
            (r[1].id, r[1].prompt_len, r[1].tokens.clone()),
            (5, 1, vec![4, 6, 7])
        );
        std::fs::write(&p, "{\"tokens\":[1],\"prompt_len\":0}\n").unwrap();
        let e = format!("{:#}", read_requests(&p).unwrap_err());
        assert!(e.contains("s.jsonl") && e.contains("prompt_len 0"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
