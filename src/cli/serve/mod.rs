//! `arbor serve`: an OpenAI-compatible HTTP server on rank 0 over the serving loop
//! (`arbor_serving`). Every rank executes the step plans rank 0's scheduler broadcasts, so a
//! request's tokens and log-probs do not depend on what else the server is doing.

pub mod admin;
pub mod api;
pub mod chat;
pub mod choice;
pub mod client;
pub mod compat;
pub mod conn;
pub mod error;
pub mod fields;
pub mod http;
pub mod ipc;
pub mod job;
pub mod leader;
pub mod lifecycle;
pub mod openai;
pub mod options;
pub mod prime_rl;
pub mod response;
pub mod sglang;
pub mod state;
pub mod structured;
pub mod tokenize;
pub mod tools;
pub mod trl;
pub mod vllm;
pub mod vllm_weights;

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::common::{self, DeviceArg, KvArgs, NumericsArg};
use super::model_api::{
    self, LoadOptions, DEFAULT_PREFILL_BESIDE_DECODE, DEFAULT_ROW_MULTIPLE, DEFAULT_STEP_OUTPUTS,
    DEFAULT_STEP_TOKENS,
};

/// `--update-memory`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateMemoryArg {
    Auto,
    FreeKvCache,
    KeepKvCache,
}

impl UpdateMemoryArg {
    fn resolve(self) -> model_api::UpdateMemory {
        match self {
            UpdateMemoryArg::Auto => model_api::UpdateMemory::Auto,
            UpdateMemoryArg::FreeKvCache => model_api::UpdateMemory::FreeKvCache,
            UpdateMemoryArg::KeepKvCache => model_api::UpdateMemory::KeepKvCache,
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Model directory (config.json, *.safetensors, tokenizer.json, tokenizer_config.json), or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// `fast`: cuBLAS and NCCL's all-reduce (CUDA only), no invariance promise; for
    /// measuring the price of determinism.
    #[arg(long, value_enum, default_value_t = NumericsArg::Invariant)]
    pub numerics: NumericsArg,
    /// Address to bind (loopback unless told otherwise): an IP address (IPv6 with or
    /// without brackets) or a host name such as `localhost`.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind (0 picks a free one; the address is logged).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every /v1 request.
    #[arg(long, env = "ARBOR_API_KEY")]
    pub api_key: Option<String>,
    /// The model name /v1/models reports and requests may give (default: the directory's or file's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Context length per sequence, prompt and generated tokens (default: the model's
    /// `max_position_embeddings`, at most what the KV cache holds).
    #[arg(long, alias = "max-model-len")]
    pub max_seq_len: Option<usize>,
    /// Most sequences running at once (each holds the KV blocks of its positions only).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// New tokens (rows) per engine step; decode rows are served first.
    #[arg(long, default_value_t = DEFAULT_STEP_TOKENS)]
    pub max_num_batched_tokens: usize,
    /// Largest prompt chunk one sequence prefills per step.
    #[arg(long, default_value_t = 2048)]
    pub prefill_chunk: usize,
    /// Most prompt rows a step takes beside decode rows (a step without decode rows takes
    /// up to --max-num-batched-tokens): every running sequence's next token waits for the
    /// step's prompt rows, so this bounds inter-token latency while new prompts arrive.
    #[arg(long, default_value_t = DEFAULT_PREFILL_BESIDE_DECODE)]
    pub prefill_beside_decode: usize,
    /// Beside decode rows, take prompt rows up to the next multiple of this many rows in
    /// the step (within --max-num-batched-tokens). A GEMM's time grows by whole rounds of
    /// its 128-row tiles over the SMs; at 1024 rows every llama3-8b layer fills its last
    /// round on an H100, so rows that fill it come almost free. 1 turns the rounding off.
    /// Speed only: chunking changes no output.
    #[arg(long, default_value_t = DEFAULT_ROW_MULTIPLE)]
    pub row_multiple: usize,
    #[command(flatten)]
    pub kv: KvArgs,
    /// Reserve KV for every position a request may use when it is admitted, instead of
    /// growing it per token and preempting (then recomputing, with the same bits) the
    /// newest sequence when it runs out.
    #[arg(long)]
    pub no_preempt: bool,
    /// Sequences waiting or running before new requests get 429.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Largest request body in bytes (413 above it; at once when Content-Length says so).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a client has to send a request's headers; an idle keep-alive connection is
    /// closed after as long.
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout_s: f64,
    /// Seconds a client has to send a request's body once its headers arrived (408 after).
    #[arg(long, default_value_t = 30.0)]
    pub body_timeout_s: f64,
    /// HTTP connections open at once; more wait to be accepted (lowered to fit `ulimit -n`).
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// The sampling seed of requests that give none. Without it each such request at a
    /// temperature draws a fresh seed and returns it (`seed` in the body, `x-arbor-seed`),
    /// so that any sample can be replayed; with it they all use N, as `arbor generate`
    /// does.
    #[arg(long, value_name = "N")]
    pub default_seed: Option<u64>,
    /// Largest `n` (choices per request).
    #[arg(long, default_value_t = 16)]
    pub max_n: usize,
    /// On SIGTERM (or Ctrl-C): seconds to let in-flight requests finish before cancelling
    /// them with 503 (at most a day).
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout_s: f64,
    /// The weight version responses report until the first update (docs/rl.md).
    #[arg(long, default_value = "0")]
    pub weight_version: String,
    /// Largest body of one /update_weights_from_tensor call (a safetensors image; push a
    /// larger checkpoint in several parts). Default: 512 MiB, or the served model's
    /// largest tensor in f32 plus 1 MiB when that is more, so every tensor fits in a part
    /// of its own.
    #[arg(long)]
    pub max_weight_upload_bytes: Option<usize>,
    /// Where a weight update's second copy of the weights goes: `auto` keeps the KV cache
    /// when the GPU has room for the copy beside it and otherwise frees the cache for the
    /// update (it holds only cached prefixes then) and makes it again after;
    /// `free-kv-cache` always frees it; `keep-kv-cache` never does (an update without room
    /// fails, nothing changes).
    #[arg(long, value_enum, default_value_t = UpdateMemoryArg::Auto)]
    pub update_memory: UpdateMemoryArg,
    /// How long an update with policy "wait" waits for the started requests to finish
    /// before it is refused (nothing changes).
    #[arg(long, default_value_t = 300.0)]
    pub weight_update_wait_s: f64,
    /// Tensors staged by a push are dropped after this long without a new part or commit.
    #[arg(long, default_value_t = 600.0)]
    pub weight_upload_idle_s: f64,
}

pub fn run(args: Args) -> Result<()> {
    let listen = options::check_flags(&args)?;
    let info = arbor_collective::RankInfo::from_env()
        .context("reading the TP group's variables (RANK / WORLD_SIZE / LOCAL_WORLD_SIZE)")?;
    options::check_kv(
        &args,
        args.device.resolve(),
        info.world_size,
        info.local_world_size,
        options::host_available_bytes(),
    )?;
    let mut kv = args
        .kv
        .to_options(args.max_num_batched_tokens, step_outputs(&args))?;
    kv.update_memory = args.update_memory.resolve();
    let comm = common::init_comm()?;
    let rank = comm.rank();
    let opts = LoadOptions {
        model_dir: args.model.clone(),
        device: args.device.resolve(),
        max_seq_len: args.max_seq_len,
        shadow_tp1: false,
        numerics: args.numerics.resolve(),
        rank_of_tp: None,
        kv,
    };
    tracing::info!(rank, world = comm.world_size(), model = %args.model.display(), "loading");
    let mut runner = model_api::load(&opts, comm.clone())
        .with_context(|| format!("loading model {} on rank {rank}", args.model.display()))?;
    runner
        .start_session()
        .with_context(|| format!("starting the serving session on rank {rank}"))?;
    if rank != 0 {
        // The launcher forwards SIGTERM/SIGINT to every rank; only rank 0 drains, and the
        // others stop when it says so (or when it is gone).
        // SAFETY: signal(2) with SIG_IGN installs no handler code.
        unsafe {
            libc::signal(libc::SIGTERM, libc::SIG_IGN);
            libc::signal(libc::SIGINT, libc::SIG_IGN);
        }
        return Ok(arbor_serving::follow(runner.as_mut(), comm.as_ref())?);
    }
    leader::lead(&args, listen, runner, comm)
}

/// Logits rows per step: every running sequence's sampled row, at least the default (room
/// for scoring rows), at most the step's rows.
pub fn step_outputs(args: &Args) -> usize {
    args.max_num_seqs
        .max(DEFAULT_STEP_OUTPUTS)
        .min(args.max_num_batched_tokens)
}
