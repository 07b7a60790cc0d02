//! `arbor generate`: continuations of prompts, as one rank of a TP group.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::common::{self, DeviceArg, JsonlSink, KvArgs, NumericsArg, SamplingArgs, StepArgs};
use super::model_api::{BatchWork, Device, FinishReason, GenOutput, GenRequest, Runner, Sampling};
use super::records::{Finish, GenRecord, PromptLine, TopEntry};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Model directory (config.json, *.safetensors, tokenizer.json), or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// A prompt as text (repeatable; needs the model's tokenizer.json).
    #[arg(long)]
    pub prompt: Vec<String>,
    /// JSONL prompts: {"id":..,"prompt":"text"} or {"id":..,"tokens":[...]} per line.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// New tokens per request (fewer if the model emits end-of-sequence).
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Requests per static batch, taken in input order.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Also report the N most likely alternatives at each generated position.
    #[arg(long, default_value_t = 0)]
    pub logprobs: usize,
    /// Write JSONL here (rank 0 only).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write JSONL to stdout instead of the human-readable listing.
    #[arg(long, conflicts_with = "out")]
    pub jsonl: bool,
    /// Also run a TP=1 copy of the model and stop at the first bit that differs.
    #[arg(long)]
    pub shadow_tp1: bool,
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

/// A prompt before tokenisation.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub id: u64,
    pub text: Option<String>,
    pub tokens: Option<Vec<u32>>,
}

/// `--prompt` arguments first (ids 0, 1, ...), then the `--prompts` file's lines (ids
/// from the file, else their index in the combined list).
pub fn collect_prompts(texts: &[String], file: Option<&Path>) -> Result<Vec<Prompt>> {
    let mut prompts: Vec<Prompt> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| Prompt {
            id: i as u64,
            text: Some(t.clone()),
            tokens: None,
        })
        .collect();
    if let Some(path) = file {
        for (line, p) in common::read_jsonl::<PromptLine>(path)? {
            let id = p.id.unwrap_or(prompts.len() as u64);
            let prompt = match (p.prompt, p.tokens) {
                (Some(text), None) => Prompt {
                    id,
                    text: Some(text),
                    tokens: None,
                },
                (None, Some(tokens)) => Prompt {
                    id,
                    text: None,
                    tokens: Some(tokens),
                },
                _ => bail!(
                    "{}:{line}: give exactly one of \"prompt\" (text) or \"tokens\" (ids)",
                    path.display()
                ),
            };
            prompts.push(prompt);
        }
    }
    if prompts.is_empty() {
        bail!("no prompts: give --prompt TEXT or --prompts FILE.jsonl");
    }
    common::check_unique_ids(prompts.iter().map(|p| p.id), "prompts")?;
    Ok(prompts)
}

pub fn validate_sampling(s: &Sampling) -> Result<()> {
    if !(s.temperature.is_finite() && s.temperature >= 0.0) {
        bail!(
            "--temperature {} must be a finite number >= 0",
            s.temperature
        );
    }
    if !(s.top_p > 0.0 && s.top_p <= 1.0) {
        bail!("--top-p {} must be in (0, 1]", s.top_p);
    }
    Ok(())
}

/// Token ids of every prompt; text needs the model's tokenizer.
fn tokenize(runner: &dyn Runner, prompts: &[Prompt], model: &Path) -> Result<Vec<Vec<u32>>> {
    prompts
        .iter()
        .map(|p| {
            let ids = match (&p.tokens, &p.text) {
                (Some(t), _) => t.clone(),
                (None, Some(text)) => {
                    let tok = runner.tokenizer().with_context(|| {
                        format!(
                            "prompt {} is text, but {} has no tokenizer.json (give token ids instead)",
                            p.id,
                            model.display()
                        )
                    })?;
                    let encoder = arbor_model::PromptEncoder {
                        tokenizer: tok,
                        config: runner.tokenizer_config(),
                    };
                    encoder
                        .encode(text.as_str(), true)
                        .map_err(|e| anyhow::anyhow!("cannot tokenise prompt {}: {e}", p.id))?
                }
                (None, None) => bail!("prompt {} has neither text nor tokens", p.id),
            };
            if ids.is_empty() {
                bail!("prompt {} is empty (it must have at least one token)", p.id);
            }
            Ok(ids)
        })
        .collect()
}

fn decode(runner: &dyn Runner, ids: &[u32]) -> Option<String> {
    let tok = runner.tokenizer()?;
    match tok.decode(ids, true) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!("cannot decode {} tokens: {e}", ids.len());
            None
        }
    }
}

fn to_record(runner: &dyn Runner, prompt: &[u32], out: GenOutput, n_top: usize) -> GenRecord {
    GenRecord {
        id: out.id,
        prompt_tokens: prompt.to_vec(),
        text: decode(runner, &out.tokens),
        tokens: out.tokens,
        logprobs: out.logprobs,
        top: TopEntry::table(n_top, out.top),
        logits_digest: out.logits_digest,
        finish: match out.finish {
            FinishReason::Length => Finish::Length,
            FinishReason::Eos => Finish::Eos,
        },
    }
}

/// What one static batch of `reqs` asks of a step: its prompts prefilled, then one sampled
/// row per sequence.
pub fn batch_work(reqs: &[GenRequest]) -> BatchWork {
    BatchWork {
        rows: reqs.iter().map(|r| r.prompt.len()).sum(),
        outputs: reqs.len(),
        seqs: reqs.len(),
        longest: reqs
            .iter()
            .map(|r| r.prompt.len().saturating_add(r.max_new_tokens))
            .max()
            .unwrap_or(0),
    }
}

/// The step budget of running `reqs` in static batches of `batch`.
pub fn budget_of<T>(
    step: StepArgs,
    reqs: &[T],
    batch: usize,
    work: impl Fn(&[T]) -> BatchWork,
) -> super::model_api::StepBudget {
    step.budget(common::batches(reqs.len(), batch).map(|r| work(&reqs[r])))
}

/// Runs `reqs` in static batches of `batch`, in input order.
pub fn run_batches<T>(
    reqs: &[T],
    batch: usize,
    mut step: impl FnMut(&[T]) -> Result<()>,
) -> Result<()> {
    let n_batches = reqs.len().div_ceil(batch.max(1));
    let show = n_batches > 1 && std::io::stderr().is_terminal();
    for (i, r) in common::batches(reqs.len(), batch).enumerate() {
        if show {
            eprintln!("batch {}/{} ({} requests)", i + 1, n_batches, r.len());
        }
        step(&reqs[r])?;
    }
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let sampling = args.sampling.to_sampling();
    validate_sampling(&sampling)?;
    let prompts = collect_prompts(&args.prompt, args.prompts.as_deref())?;
    let mut runner = common::load_runner(
        &args.model,
        args.device,
        args.max_seq_len,
        args.shadow_tp1,
        args.numerics,
        args.kv.offline()?,
    )?;
    let ids = tokenize(runner.as_ref(), &prompts, &args.model)?;
    let reqs: Vec<GenRequest> = prompts
        .iter()
        .zip(&ids)
        .map(|(p, t)| GenRequest {
            id: p.id,
            prompt: t.clone(),
            max_new_tokens: args.max_tokens,
        })
        .collect();
    runner.reserve_steps(budget_of(args.step, &reqs, args.batch, batch_work))?;

    // Rank 0 writes each batch as it finishes (a failure later keeps what was done).
    let rank0 = runner.rank() == 0;
    let mut sink = match rank0 && (args.out.is_some() || args.jsonl) {
        true => Some(JsonlSink::create(args.out.as_deref())?),
        false => None,
    };
    let by_id: HashMap<u64, &Prompt> = prompts.iter().map(|p| (p.id, p)).collect();
    run_batches(&reqs, args.batch, |chunk| {
        let outs = runner.generate(chunk, &sampling, args.logprobs)?;
        for pair in common::paired(chunk, outs, |r, o| (r.id, o.id), "request")? {
            let (req, out) = pair?;
            if !rank0 {
                continue;
            }
            let rec = to_record(runner.as_ref(), &req.prompt, out, args.logprobs);
            match sink.as_mut() {
                Some(sink) => sink.write(&rec)?,
                None => print_record(runner.as_ref(), by_id.get(&rec.id).copied(), &rec),
            }
        }
        Ok(())
    })?;
    if rank0 {
        let shared = match args.device.resolve() {
            Device::Cuda if runner.tp() > 1 => common::shared_gpu().ok().flatten(),
            _ => None,
        };
        // On stderr, so that --jsonl output stays machine-readable.
        eprintln!(
            "timing (rank 0, TP {}): {}{}",
            runner.tp(),
            runner.timing().summary(),
            shared.map_or(String::new(), |(ordinal, ranks)| format!(
                " [{}]",
                common::shared_gpu_note(ordinal, ranks)
            ))
        );
    }
    match sink {
        Some(sink) => sink.finish(),
        None => Ok(()),
    }
}

fn print_record(runner: &dyn Runner, prompt: Option<&Prompt>, r: &GenRecord) {
    let prompt_text = prompt
        .and_then(|p| p.text.clone())
        .or_else(|| decode(runner, &r.prompt_tokens))
        .unwrap_or_default();
    let sum: f64 = r.logprobs.iter().map(|&l| l as f64).sum();
    println!(
        "[{}] {} prompt tokens, {} new ({}), sum logprob {:.4}",
        r.id,
        r.prompt_tokens.len(),
        r.tokens.len(),
        match r.finish {
            Finish::Length => "length",
            Finish::Eos => "eos",
        },
        sum
    );
    // Quoted and escaped: a random-weight model emits control bytes.
    println!("  prompt: {prompt_text:?}");
    match &r.text {
        Some(t) => println!("  output: {t:?}"),
        None => println!("  output tokens: {:?}", r.tokens),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_from_args_and_file() {
        let dir = std::env::temp_dir().join(format!("arbor-gen-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("p.jsonl");
        std::fs::write(&p, "{\"prompt\":\"hi\"}\n{\"id\":9,\"tokens\":[1,2,3]}\n").unwrap();
        let got = collect_prompts(&["a".into()], Some(&p)).unwrap();
        assert_eq!(got.iter().map(|p| p.id).collect::<Vec<_>>(), vec![0, 1, 9]);
        assert_eq!(got[2].tokens, Some(vec![1, 2, 3]));

        std::fs::write(&p, "{\"id\":1,\"prompt\":\"x\",\"tokens\":[1]}\n").unwrap();
        let e = format!("{:#}", collect_prompts(&[], Some(&p)).unwrap_err());
        assert!(e.contains("p.jsonl:1"), "{e}");
        std::fs::write(&p, "{\"id\":0,\"prompt\":\"x\"}\n").unwrap();
        let e = format!(
            "{:#}",
            collect_prompts(&["y".into()], Some(&p)).unwrap_err()
        );
        assert!(e.contains("id 0"), "{e}");
        std::fs::write(&p, "{\"id\":-1,\"prompt\":\"x\"}\n").unwrap();
        assert!(collect_prompts(&[], Some(&p)).is_err());
        assert!(collect_prompts(&[], None).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sampling_is_validated() {
        let ok = Sampling {
            temperature: 0.7,
            top_k: 5,
            top_p: 0.9,
            seed: 1,
        };
        assert!(validate_sampling(&ok).is_ok());
        assert!(validate_sampling(&Sampling {
            temperature: -1.0,
            ..ok
        })
        .is_err());
        assert!(validate_sampling(&Sampling {
            temperature: f32::NAN,
            ..ok
        })
        .is_err());
        assert!(validate_sampling(&Sampling { top_p: 0.0, ..ok }).is_err());
        assert!(validate_sampling(&Sampling { top_p: 1.5, ..ok }).is_err());
    }
}
