//! Pieces every subcommand shares: logging, the device flag, this rank's communicator and
//! runner, JSONL input and output.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use arbor_collective::Communicator;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::model_api::{self, Device, LoadOptions, Runner};

/// Logs go to stderr; `RUST_LOG` is honoured (default: warnings and errors). Coloured only
/// on a terminal (a rank's stderr under arbor-launch is a pipe) and without `NO_COLOR`.
pub fn init_logging() {
    use std::io::IsTerminal as _;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .try_init();
}

/// `--device cpu|cuda|auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
    /// CUDA when a CUDA device is usable, else CPU.
    Auto,
}

impl DeviceArg {
    pub fn resolve(self) -> Device {
        match self {
            DeviceArg::Cpu => Device::Cpu,
            DeviceArg::Cuda => Device::Cuda,
            DeviceArg::Auto if arbor_kernels::cuda::probe::gpu_present() => Device::Cuda,
            DeviceArg::Auto => Device::Cpu,
        }
    }

    /// The device this resolves to on this machine.
    pub fn resolve_name(self) -> &'static str {
        match self.resolve() {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DeviceArg::Cpu => "cpu",
            DeviceArg::Cuda => "cuda",
            DeviceArg::Auto => "auto",
        }
    }
}

/// `--numerics invariant|fast`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum NumericsArg {
    /// The fixed reduction tree: the same bits at every TP size and batch.
    #[default]
    Invariant,
    /// cuBLAS + NCCL all-reduce (CUDA only): fastest, bits depend on batch and TP.
    Fast,
}

impl NumericsArg {
    pub fn resolve(self) -> model_api::Numerics {
        match self {
            NumericsArg::Invariant => model_api::Numerics::Invariant,
            NumericsArg::Fast => model_api::Numerics::Fast,
        }
    }
}

/// The sampling flags `generate` and `check` share (`check` passes them on to `generate`).
#[derive(clap::Args, Debug, Clone, Copy, PartialEq)]
pub struct SamplingArgs {
    /// Sampling temperature; below 1e-5 (0 included) = greedy (argmax, lowest token id
    /// on ties).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sampling seed; tokens depend on (seed, request id, position) only.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl Default for SamplingArgs {
    /// Greedy, as the flags' defaults.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingArgs {
    pub fn to_sampling(self) -> model_api::Sampling {
        model_api::Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
        }
    }
}

/// `--ranks-per-gpu N|auto` of the commands that start arbor-launch, checked here so that a
/// bad value fails before anything starts.
pub fn parse_ranks_per_gpu(s: &str) -> std::result::Result<String, String> {
    use arbor_collective::device_map::RanksPerGpu;
    match RanksPerGpu::parse(Some(s)) {
        Ok(RanksPerGpu::Fixed(n)) => Ok(n.to_string()),
        Ok(RanksPerGpu::Auto) => Ok("auto".into()),
        _ => Err(format!(
            "{s:?} is not a number of ranks per GPU (1 or more) or \"auto\""
        )),
    }
}

/// What benchmarks print when ranks share a GPU (`arbor-launch --ranks-per-gpu`).
pub fn shared_gpu_note(ordinal: usize, ranks: usize) -> String {
    format!(
        "ranks share GPU {ordinal} ({ranks} ranks on it): collectives staged through the host; \
         timings are not representative"
    )
}

/// This rank's GPU where it shares it with other ranks of this host (from the launcher's
/// variables, ARBOR_RANKS_PER_GPU and the visible devices): (ordinal, ranks on it).
pub fn shared_gpu() -> Result<Option<(usize, usize)>> {
    let visible = arbor_kernels::cuda::probe::driver().context("no usable CUDA driver")?;
    let slot = arbor_collective::device_map::from_env(visible)?;
    Ok(slot
        .shared()
        .then_some((slot.ordinal, slot.ranks_on_device)))
}

/// The KV cache's size flags (every subcommand that runs the model).
#[derive(clap::Args, Debug, Clone, Copy, PartialEq)]
pub struct KvArgs {
    /// CUDA: the fraction of the GPU memory free after loading the weights that the KV
    /// cache and the steps' working memory may take.
    #[arg(long, default_value_t = model_api::DEFAULT_GPU_MEMORY_UTILIZATION)]
    pub gpu_memory_utilization: f64,
    /// CPU: GiB of host memory for the KV cache (its pages are used as it fills; default:
    /// 4, or half the host's available memory shared by its ranks where that is less).
    #[arg(long)]
    pub kv_cache_gib: Option<f64>,
    /// KV blocks of 64 positions, exactly (instead of sizing the cache from memory).
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// Compute every sequence's KV itself instead of sharing the full blocks of equal
    /// prefixes (the prefix cache gives the same bits; this is for comparing).
    #[arg(long)]
    pub no_prefix_cache: bool,
}

impl Default for KvArgs {
    /// The flags' defaults.
    fn default() -> Self {
        Self {
            gpu_memory_utilization: model_api::DEFAULT_GPU_MEMORY_UTILIZATION,
            kv_cache_gib: None,
            kv_blocks: None,
            no_prefix_cache: false,
        }
    }
}

impl KvArgs {
    /// The cache options for steps of at most `step_tokens` rows and `step_outputs` logits
    /// rows; flags out of range are errors naming them.
    pub fn to_options(
        self,
        step_tokens: usize,
        step_outputs: usize,
    ) -> Result<model_api::KvOptions> {
        self.options(Some(model_api::StepBudget::serving(
            step_tokens,
            step_outputs,
        )))
    }

    /// The cache options of an offline run (`generate`, `score`, `bench decode`): the
    /// cache is made by `Runner::reserve_steps` once the work is known.
    pub fn offline(self) -> Result<model_api::KvOptions> {
        self.options(None)
    }

    fn options(self, step: Option<model_api::StepBudget>) -> Result<model_api::KvOptions> {
        let o = model_api::KvOptions {
            blocks: self.kv_blocks,
            gpu_memory_utilization: self.gpu_memory_utilization,
            cpu_cache_gib: self.kv_cache_gib,
            step,
            prefix_cache: !self.no_prefix_cache,
            update_memory: model_api::UpdateMemory::default(),
        };
        if let Err(e) = o.validate() {
            bail!("--gpu-memory-utilization / --kv-cache-gib / --kv-blocks: {e}");
        }
        Ok(o)
    }

    /// The flags as arguments, to pass on to a child process.
    pub fn to_args(self) -> Vec<String> {
        let mut a = vec![
            "--gpu-memory-utilization".to_string(),
            self.gpu_memory_utilization.to_string(),
        ];
        if let Some(g) = self.kv_cache_gib {
            a.extend(["--kv-cache-gib".to_string(), g.to_string()]);
        }
        if let Some(n) = self.kv_blocks {
            a.extend(["--kv-blocks".to_string(), n.to_string()]);
        }
        if self.no_prefix_cache {
            a.push("--no-prefix-cache".to_string());
        }
        a
    }
}

/// The step size flag of the offline commands (`arbor serve` has its own, with the
/// server's default).
#[derive(clap::Args, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepArgs {
    /// Most prompt tokens one step processes (default: the largest batch's prompt tokens,
    /// at most 8192; longer prompts are prefilled in chunks, with the same bits). The
    /// working memory of a step grows with it: lower it to leave more to the KV cache.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_num_batched_tokens: Option<u64>,
}

impl StepArgs {
    /// The step budget of offline work run as `batches`.
    pub fn budget(
        self,
        batches: impl IntoIterator<Item = model_api::BatchWork>,
    ) -> model_api::StepBudget {
        let cap = self
            .max_num_batched_tokens
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
        model_api::StepBudget::for_batches(batches, cap)
    }

    /// The flag as arguments, to pass on to a child process.
    pub fn to_args(self) -> Vec<String> {
        match self.max_num_batched_tokens {
            Some(n) => vec!["--max-num-batched-tokens".into(), n.to_string()],
            None => Vec::new(),
        }
    }
}

/// This process's rank in its TP group, from the launcher's environment (a group of
/// one when started directly).
pub fn init_comm() -> Result<Arc<dyn Communicator>> {
    let (comm, info) = arbor_collective::init_from_env()
        .context("joining the TP group (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)")?;
    tracing::debug!(
        rank = info.rank,
        world = info.world_size,
        source = info.source,
        "joined"
    );
    Ok(comm)
}

/// Joins the TP group and loads this rank's shard of the model (and makes its KV cache).
pub fn load_runner(
    model_dir: &Path,
    device: DeviceArg,
    max_seq_len: Option<usize>,
    shadow_tp1: bool,
    numerics: NumericsArg,
    kv: model_api::KvOptions,
) -> Result<Box<dyn Runner>> {
    load_runner_with(LoadOptions {
        model_dir: model_dir.to_path_buf(),
        device: device.resolve(),
        max_seq_len,
        shadow_tp1,
        numerics: numerics.resolve(),
        rank_of_tp: None,
        kv,
    })
}

/// `load_runner` with every load option given.
pub fn load_runner_with(opts: LoadOptions) -> Result<Box<dyn Runner>> {
    let comm = init_comm()?;
    let rank = comm.rank();
    let dir = opts.model_dir.clone();
    tracing::info!(rank, world = comm.world_size(), model = %dir.display(), "loading");
    model_api::load(&opts, comm)
        .with_context(|| format!("loading model {} on rank {rank}", dir.display()))
}

/// Reads a JSONL file (blank lines skipped); errors name the file and line.
/// Returns `(line number, value)` pairs.
pub fn read_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<(usize, T)>> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}: cannot read", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let v = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: malformed JSONL record", path.display(), i + 1))?;
        out.push((i + 1, v));
    }
    Ok(out)
}

/// Where JSONL output goes: a file, or stdout.
pub struct JsonlSink {
    out: Box<dyn Write>,
    name: String,
}

impl JsonlSink {
    pub fn create(path: Option<&Path>) -> Result<Self> {
        match path {
            Some(p) => {
                let f = File::create(p)
                    .with_context(|| format!("cannot create output file {}", p.display()))?;
                Ok(Self {
                    out: Box::new(BufWriter::new(f)),
                    name: p.display().to_string(),
                })
            }
            None => Ok(Self {
                out: Box::new(std::io::stdout().lock()),
                name: "stdout".into(),
            }),
        }
    }

    pub fn write<T: Serialize>(&mut self, v: &T) -> Result<()> {
        serde_json::to_writer(&mut self.out, v)
            .with_context(|| format!("writing a JSONL record to {}", self.name))?;
        self.out
            .write_all(b"\n")
            .with_context(|| format!("writing to {}", self.name))
    }

    pub fn finish(mut self) -> Result<()> {
        self.out
            .flush()
            .with_context(|| format!("writing to {}", self.name))
    }
}

/// Splits `n` items into static batches of `batch` in input order.
pub fn batches(n: usize, batch: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let b = batch.max(1);
    (0..n.div_ceil(b)).map(move |i| i * b..((i + 1) * b).min(n))
}

/// Ids must be unique: outputs are matched across runs by id.
pub fn check_unique_ids(ids: impl IntoIterator<Item = u64>, what: &str) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for id in ids {
        if !seen.insert(id) {
            bail!("{what}: request id {id} appears more than once");
        }
    }
    Ok(())
}

/// The runner's outputs for `reqs`, each with its request, in order. A count that differs
/// is an error at once; an output for another id (`ids` gives the request's and the
/// output's) is an error when reached, so the outputs before it are still handled.
/// `what` names a request in the messages ("request", "sequence").
pub fn paired<'a, R, O>(
    reqs: &'a [R],
    outs: Vec<O>,
    ids: impl Fn(&R, &O) -> (u64, u64) + 'a,
    what: &'a str,
) -> Result<impl Iterator<Item = Result<(&'a R, O)>> + 'a>
where
    O: 'a,
{
    if outs.len() != reqs.len() {
        bail!(
            "the runner returned {} outputs for {} {what}s",
            outs.len(),
            reqs.len()
        );
    }
    Ok(reqs.iter().zip(outs).map(move |(req, out)| {
        let (want, got) = ids(req, &out);
        if got != want {
            bail!("the runner returned {what} {got} where {want} was expected");
        }
        Ok((req, out))
    }))
}

/// The `arbor-launch` binary: `explicit`, else the one next to this executable.
pub fn find_launcher(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if !p.is_file() {
            bail!("launcher {} does not exist", p.display());
        }
        return Ok(p.to_path_buf());
    }
    let exe = std::env::current_exe().context("cannot find the path of this executable")?;
    let sibling = exe.with_file_name(format!("arbor-launch{}", std::env::consts::EXE_SUFFIX));
    if sibling.is_file() {
        return Ok(sibling);
    }
    bail!(
        "cannot find arbor-launch next to {} (build it with `cargo build --release --bins`, \
         or pass --launcher PATH)",
        exe.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_keep_input_order() {
        let b: Vec<_> = batches(7, 3).collect();
        assert_eq!(b, vec![0..3, 3..6, 6..7]);
        assert_eq!(batches(0, 4).count(), 0);
        assert_eq!(batches(2, 8).collect::<Vec<_>>(), vec![0..2]);
    }

    #[test]
    fn duplicate_ids_are_named() {
        let e = check_unique_ids([1, 5, 5], "prompts.jsonl").unwrap_err();
        assert!(e.to_string().contains("id 5"), "{e}");
        assert!(check_unique_ids([1, 2, 3], "x").is_ok());
    }

    #[test]
    fn jsonl_errors_name_file_and_line() {
        let dir = std::env::temp_dir().join(format!("arbor-common-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("in.jsonl");
        std::fs::write(&p, "{\"a\":1}\n\n{\"a\":\n").unwrap();
        let e = read_jsonl::<serde_json::Value>(&p).unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("in.jsonl:3"), "{msg}");
        std::fs::write(&p, "{\"a\":1}\n\n{\"a\":2}\n").unwrap();
        let v = read_jsonl::<serde_json::Value>(&p).unwrap();
        assert_eq!(v.iter().map(|(l, _)| *l).collect::<Vec<_>>(), vec![1, 3]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn outputs_are_paired_with_their_requests() {
        let ids = |r: &u64, o: &u64| (*r, *o);
        let got: Vec<(u64, u64)> = paired(&[3, 1], vec![3, 1], ids, "request")
            .unwrap()
            .map(|p| p.map(|(r, o)| (*r, o)).unwrap())
            .collect();
        assert_eq!(got, vec![(3, 3), (1, 1)]);
        let e = paired(&[3, 1], vec![3], ids, "sequence").err().unwrap();
        assert_eq!(
            e.to_string(),
            "the runner returned 1 outputs for 2 sequences"
        );
        // A wrong id fails when reached, after the outputs before it.
        let mut it = paired(&[3, 1], vec![3, 7], ids, "request").unwrap();
        assert!(it.next().unwrap().is_ok());
        let e = it.next().unwrap().err().unwrap();
        assert_eq!(
            e.to_string(),
            "the runner returned request 7 where 1 was expected"
        );
    }

    #[derive(clap::Parser)]
    struct SamplingCli {
        #[command(flatten)]
        sampling: SamplingArgs,
    }

    #[test]
    fn sampling_default_is_the_flags_defaults() {
        use clap::Parser as _;
        let parsed = SamplingCli::try_parse_from(["arbor"]).unwrap().sampling;
        assert_eq!(parsed, SamplingArgs::default());
        let set = SamplingCli::try_parse_from(["arbor", "--top-k", "3", "--seed", "9"])
            .unwrap()
            .sampling;
        assert_eq!((set.top_k, set.seed), (3, 9));
    }
}
