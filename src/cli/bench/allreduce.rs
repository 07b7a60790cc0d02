//! `arbor bench allreduce`: the deterministic all-reduce algorithms next to NCCL's own
//! all-reduce, measured in the same run, one process per GPU (run under `arbor-launch -n W`).
//!
//! Per (size, dtype, algorithm): median time per call (CUDA events; small sizes replay a
//! CUDA graph of many calls so launch gaps do not dominate), algbw, busbw (nccl-tests'
//! `2(W-1)/W` factor), ratio to NCCL, and bits-ok: the output equals the host tree over the
//! same inputs bit for bit (checked before and after the timed calls) and is identical on
//! all ranks. Rank 0 prints the table, writes JSON and an SVG plot of time vs size.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use arbor_collective::device_map::{self, RanksPerGpu};
use arbor_collective::gpu::mem::DeviceBuf;
use arbor_collective::gpu::reference::{f32_to_bf16, tree_reference_bf16, tree_reference_f32};
use arbor_collective::gpu::{probe_driver, Algo, GpuCollective, GpuOptions};
use arbor_collective::nccl::Dtype;
use arbor_collective::Communicator;
use cudarc::driver::{result as dres, sys as dsys, CudaContext, CudaEvent, CudaStream};
use serde::Serialize;

#[derive(clap::Args)]
pub struct Args {
    /// Message sizes in bytes per rank (suffixes K, M, G = powers of 1024).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8K,32K,128K,512K,1M,2M,8M,32M,128M,256M"
    )]
    sizes: Vec<String>,
    /// Element types: bf16 (inputs bf16, tree in f32, output rounded once) and/or f32.
    #[arg(long, value_delimiter = ',', default_value = "bf16,f32")]
    dtypes: Vec<String>,
    /// Algorithms: nccl (NCCL's all-reduce, the reference), allgather-tree, oneshot,
    /// twoshot, twoshot-copy (two-shot from an unregistered input), auto; nvls only when
    /// asked for by name (refused on machines that forbid it).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "nccl,allgather-tree,oneshot,twoshot,twoshot-copy,auto"
    )]
    algos: Vec<String>,
    /// Timed repetitions per row (the median is reported).
    #[arg(long, default_value_t = 25)]
    iters: usize,
    /// Calls per captured CUDA graph (sizes up to --graph-max-bytes).
    #[arg(long, default_value_t = 20)]
    graph_calls: usize,
    /// Largest size timed through CUDA-graph replays.
    #[arg(long, default_value = "4M")]
    graph_max: String,
    /// JSON output (rank 0).
    #[arg(long, default_value = "allreduce.json")]
    json: std::path::PathBuf,
    /// SVG plot of time vs size (rank 0).
    #[arg(long, default_value = "allreduce.svg")]
    svg: std::path::PathBuf,
    /// Grid caps of the one-shot and two-shot kernels (blocks of 512 threads).
    #[arg(long, default_value_t = 64)]
    oneshot_blocks: usize,
    #[arg(long, default_value_t = 128)]
    twoshot_blocks: usize,
    /// Register the input buffer with the collective (two-shot then reads peers' inputs in
    /// place); `twoshot-copy` rows always use an unregistered copy of the input.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    register_input: bool,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Which {
    Nccl,
    Tree(Algo),
    /// Two-shot on an input that is not registered: staged through the IPC buffer.
    TwoShotCopy,
}

impl Which {
    fn name(self) -> &'static str {
        match self {
            Which::Nccl => "nccl",
            Which::Tree(a) => a.name(),
            Which::TwoShotCopy => "twoshot-copy",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
struct Row {
    world: usize,
    bytes: usize,
    count: usize,
    dtype: &'static str,
    algo: &'static str,
    /// The algorithm `auto` ran (same as `algo` otherwise).
    ran: &'static str,
    time_us: f64,
    algbw_gbs: f64,
    busbw_gbs: f64,
    ratio_to_nccl: Option<f64>,
    /// Output equals the host tree bit for bit (before and after the timed calls).
    bits_tree: bool,
    /// Output identical on all ranks.
    bits_ranks: bool,
    bits_ok: bool,
    graph: bool,
    error: Option<String>,
}

#[derive(Serialize)]
struct Report<'a> {
    device: String,
    world: usize,
    /// Ranks on rank 0's GPU where ranks share GPUs (collectives staged through the host;
    /// the times are not representative).
    shared_gpu_ranks: Option<usize>,
    nccl_nvls_enable: Option<String>,
    input_registered: bool,
    iters: usize,
    graph_calls: usize,
    rows: &'a [Row],
}

fn parse_size(s: &str) -> anyhow::Result<usize> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let v: usize = num
        .parse()
        .with_context(|| format!("size '{s}' is not a number with an optional K/M/G suffix"))?;
    Ok(v * mul)
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Rank `r`'s inputs: signed values spread over 2^-8 .. 2^8, so the order of additions
/// changes the rounding (a test that could not fail otherwise).
fn input_f32(seed: u64, rank: usize, bytes: usize, n: usize) -> Vec<f32> {
    let base = splitmix(seed ^ ((rank as u64) << 48) ^ (bytes as u64));
    (0..n)
        .map(|i| {
            let h = splitmix(base ^ i as u64);
            let m = ((h >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
            m * f32::powi(2.0, (h & 15) as i32 - 7)
        })
        .collect()
}

fn fnv(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for chunk in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h ^= u64::from_le_bytes(w);
        h = h.wrapping_mul(0x1000_0000_01b3);
    }
    h
}

struct Bench {
    host: Arc<dyn Communicator>,
    coll: GpuCollective,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    input: DeviceBuf,
    input_copy: DeviceBuf,
    output: DeviceBuf,
    rank: usize,
    world: usize,
}

impl Bench {
    fn launch(&self, which: Which, n: usize, dtype: Dtype) -> anyhow::Result<&'static str> {
        // SAFETY: input/output hold the largest size of the run; same call on every rank.
        unsafe {
            match which {
                Which::Nccl => {
                    let nccl = self.coll.nccl().context(
                        "NCCL cannot run with ranks sharing a GPU (the collectives are staged \
                         through the host)",
                    )?;
                    nccl.all_reduce_raw(self.input.ptr(), self.output.ptr(), n, dtype)?;
                    Ok("nccl")
                }
                Which::Tree(a) => Ok(self
                    .coll
                    .all_reduce_raw(a, self.input.ptr(), self.output.ptr(), n, dtype)?
                    .name()),
                Which::TwoShotCopy => Ok(self
                    .coll
                    .all_reduce_raw(
                        Algo::TwoShot,
                        self.input_copy.ptr(),
                        self.output.ptr(),
                        n,
                        dtype,
                    )?
                    .name()),
            }
        }
    }

    fn poison_output(&self, bytes: usize) -> anyhow::Result<()> {
        // SAFETY: within the output allocation.
        unsafe { dres::memset_d8_async(self.output.ptr(), 0xff, bytes, self.stream.cu_stream()) }
            .map_err(|e| anyhow::anyhow!("poisoning the output: {e:?}"))
    }

    fn read_output(&self, bytes: usize) -> anyhow::Result<Vec<u8>> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow::anyhow!("stream: {e:?}"))?;
        let mut v = vec![0u8; bytes];
        // SAFETY: within the output allocation; the stream is idle.
        unsafe { dres::memcpy_dtoh_sync(&mut v, self.output.ptr()) }
            .map_err(|e| anyhow::anyhow!("copying the output back: {e:?}"))?;
        Ok(v)
    }

    fn event(&self) -> anyhow::Result<CudaEvent> {
        self.ctx
            .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| anyhow::anyhow!("creating a CUDA event: {e:?}"))
    }

    /// Median time per call in µs, and whether a graph was used.
    fn time(
        &self,
        which: Which,
        n: usize,
        dtype: Dtype,
        use_graph: bool,
        args: &Args,
    ) -> anyhow::Result<(f64, bool)> {
        let (start, stop) = (self.event()?, self.event()?);
        let mut samples = Vec::with_capacity(args.iters);
        if use_graph {
            let calls = args.graph_calls.max(1);
            self.stream
                .begin_capture(dsys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(|e| anyhow::anyhow!("begin capture: {e:?}"))?;
            let mut captured = Ok(());
            for _ in 0..calls {
                if let Err(e) = self.launch(which, n, dtype) {
                    captured = Err(e);
                    break;
                }
            }
            let graph = self
                .stream
                .end_capture(dsys::CUgraphInstantiate_flags(0))
                .map_err(|e| anyhow::anyhow!("end capture: {e:?}"))?;
            captured?;
            let graph = graph.context("the captured graph is empty")?;
            graph
                .launch()
                .map_err(|e| anyhow::anyhow!("graph launch: {e:?}"))?;
            self.sync_all()?;
            for _ in 0..args.iters {
                start
                    .record(&self.stream)
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                graph
                    .launch()
                    .map_err(|e| anyhow::anyhow!("graph launch: {e:?}"))?;
                stop.record(&self.stream)
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                stop.synchronize().map_err(|e| anyhow::anyhow!("{e:?}"))?;
                let ms = start
                    .elapsed_ms(&stop)
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                samples.push(ms as f64 * 1000.0 / calls as f64);
            }
        } else {
            for _ in 0..args.iters {
                start
                    .record(&self.stream)
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                self.launch(which, n, dtype)?;
                stop.record(&self.stream)
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                stop.synchronize().map_err(|e| anyhow::anyhow!("{e:?}"))?;
                let ms = start
                    .elapsed_ms(&stop)
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                samples.push(ms as f64 * 1000.0);
            }
        }
        samples.sort_by(f64::total_cmp);
        Ok((samples[samples.len() / 2], use_graph))
    }

    fn sync_all(&self) -> anyhow::Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow::anyhow!("stream: {e:?}"))?;
        self.host.barrier()?;
        Ok(())
    }

    /// Largest value over the ranks (the slowest rank sets a collective's time).
    fn max_over_ranks(&self, v: f64) -> anyhow::Result<f64> {
        let all = self.host.all_gather_bytes(&v.to_le_bytes())?;
        Ok(all
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .fold(f64::MIN, f64::max))
    }

    /// A failed host-staged exchange or an IPC barrier that gave up (watchdog) leaves
    /// garbage, not an error on the stream: asked on every rank, and agreed, so that all
    /// ranks fail the row together (a watchdog may fire on some ranks only).
    fn check_all(&self) -> anyhow::Result<()> {
        let mine = self.coll.check();
        if self.all_ranks_agree(mine.is_ok())? {
            return Ok(());
        }
        match mine {
            Err(e) => Err(e.into()),
            Ok(()) => bail!(
                "another rank's collective failed (its log says why; after an IPC watchdog \
                 fires, the IPC kernels of this run stay failed)"
            ),
        }
    }

    fn all_ranks_agree(&self, ok: bool) -> anyhow::Result<bool> {
        let all = self.host.all_gather_bytes(&[u8::from(ok)])?;
        Ok(all.iter().all(|&b| b == 1))
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    probe_driver().context("arbor bench allreduce needs an NVIDIA GPU")?;
    let sizes: Vec<usize> = args
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_, _>>()?;
    let dtypes: Vec<Dtype> = args
        .dtypes
        .iter()
        .map(|s| s.parse::<Dtype>().map_err(anyhow::Error::msg))
        .collect::<Result<_, _>>()?;
    let mut whiches = Vec::new();
    for a in &args.algos {
        whiches.push(if a == "nccl" {
            Which::Nccl
        } else if a == "twoshot-copy" {
            Which::TwoShotCopy
        } else {
            Which::Tree(a.parse::<Algo>().map_err(anyhow::Error::msg)?)
        });
    }
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    if sizes.is_empty() || dtypes.is_empty() || whiches.is_empty() {
        bail!("--sizes, --dtypes and --algos must each name at least one value");
    }
    let graph_max = parse_size(&args.graph_max)?;
    let max_bytes = *sizes.iter().max().unwrap_or(&0);

    let (host, _info) = arbor_collective::init_from_env().context("joining the rank group")?;
    let rank = host.rank();
    let world = host.world_size();
    let visible = probe_driver()?;
    let slot = device_map::from_env(visible)?;
    let allow_shared = RanksPerGpu::from_env()
        .map_err(anyhow::Error::msg)?
        .allows_sharing();
    let ctx = CudaContext::new(slot.ordinal)
        .map_err(|e| anyhow::anyhow!("opening GPU {}: {e:?}", slot.ordinal))?;
    // One stream for everything: cudarc's cross-stream event tracking would put waits on
    // events recorded outside a graph capture into the capture.
    // SAFETY: called before any buffer or stream of this context exists.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx
        .new_stream()
        .map_err(|e| anyhow::anyhow!("creating a stream: {e:?}"))?;
    let device = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    let opts = GpuOptions {
        ipc_capacity_bytes: max_bytes,
        oneshot_blocks: args.oneshot_blocks,
        twoshot_blocks: args.twoshot_blocks,
        allow_shared,
        ..GpuOptions::default()
    };
    let t0 = Instant::now();
    let coll = GpuCollective::with_options(host.clone(), stream.clone(), opts)?;
    tracing::info!(
        rank,
        world,
        ms = t0.elapsed().as_millis() as u64,
        ipc = coll.ipc_enabled(),
        "collective ready"
    );
    if rank == 0 && !coll.ipc_enabled() {
        eprintln!("warning: CUDA IPC could not be set up; oneshot/twoshot rows will fail");
    }
    let shared_note = shared_gpu_note(&coll, rank, slot.ordinal);
    if let Some(note) = &shared_note {
        eprintln!("{note}");
    }
    ctx.bind_to_thread().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let bench = Bench {
        host: host.clone(),
        input: DeviceBuf::alloc(max_bytes, rank)?,
        input_copy: DeviceBuf::alloc(max_bytes, rank)?,
        output: DeviceBuf::alloc(max_bytes, rank)?,
        coll,
        stream,
        ctx,
        rank,
        world,
    };
    // Sized before any graph capture: growing the scratch synchronises the stream.
    bench.coll.reserve(max_bytes)?;
    let registered = args.register_input && bench.coll.register_buffer(bench.input.ptr())?;
    if rank == 0 {
        eprintln!("input buffer registered for in-place peer reads: {registered}");
    }

    let mut rows = Vec::new();
    for &dtype in &dtypes {
        for &bytes in &sizes {
            let n = bytes / dtype.size();
            if n == 0 {
                continue;
            }
            let bytes = n * dtype.size();
            // Inputs of every rank on the host (for the reference), this rank's on the GPU.
            let all: Vec<Vec<f32>> = (0..world)
                .map(|r| input_f32(args.seed, r, bytes, n))
                .collect();
            let (mine, reference): (Vec<u8>, Vec<u8>) = match dtype {
                Dtype::F32 => {
                    let refs: Vec<&[f32]> = all.iter().map(Vec::as_slice).collect();
                    let out = tree_reference_f32(&refs);
                    (
                        all[rank].iter().flat_map(|v| v.to_le_bytes()).collect(),
                        out.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    )
                }
                Dtype::Bf16 => {
                    let b: Vec<Vec<u16>> = all
                        .iter()
                        .map(|v| v.iter().map(|&x| f32_to_bf16(x)).collect())
                        .collect();
                    let refs: Vec<&[u16]> = b.iter().map(Vec::as_slice).collect();
                    let out = tree_reference_bf16(&refs);
                    (
                        b[rank].iter().flat_map(|v| v.to_le_bytes()).collect(),
                        out.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    )
                }
            };
            drop(all);
            // SAFETY: within the input allocation.
            unsafe { dres::memcpy_htod_sync(bench.input.ptr(), &mine) }
                .map_err(|e| anyhow::anyhow!("uploading the input: {e:?}"))?;
            // SAFETY: within the copy's allocation.
            unsafe { dres::memcpy_htod_sync(bench.input_copy.ptr(), &mine) }
                .map_err(|e| anyhow::anyhow!("uploading the input copy: {e:?}"))?;
            let mut nccl_time = None;
            for &which in &whiches {
                let row = measure(
                    &bench,
                    which,
                    n,
                    bytes,
                    dtype,
                    &reference,
                    bytes <= graph_max,
                    &args,
                );
                let row = match row {
                    Ok(mut r) => {
                        if which == Which::Nccl {
                            nccl_time = Some(r.time_us);
                        }
                        r.ratio_to_nccl = nccl_time.map(|t| r.time_us / t);
                        r
                    }
                    Err(e) => {
                        // An algorithm that cannot run here (e.g. nvls refused) is a row
                        // with its reason; every rank fails the same way.
                        bench.stream.synchronize().ok();
                        Row {
                            world,
                            bytes,
                            count: n,
                            dtype: dtype.name(),
                            algo: which.name(),
                            ran: which.name(),
                            time_us: f64::NAN,
                            algbw_gbs: f64::NAN,
                            busbw_gbs: f64::NAN,
                            ratio_to_nccl: None,
                            bits_tree: false,
                            bits_ranks: false,
                            bits_ok: false,
                            graph: false,
                            error: Some(format!("{e:#}")),
                        }
                    }
                };
                if rank == 0 {
                    eprintln!("{}", format_row(&row));
                }
                rows.push(row);
            }
        }
    }
    if rank == 0 {
        let report = Report {
            device,
            world,
            shared_gpu_ranks: bench
                .coll
                .shared()
                .then(|| bench.coll.sharing().groups[0].len()),
            nccl_nvls_enable: std::env::var("NCCL_NVLS_ENABLE").ok(),
            input_registered: registered,
            iters: args.iters,
            graph_calls: args.graph_calls,
            rows: &rows,
        };
        std::fs::write(&args.json, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", args.json.display()))?;
        std::fs::write(&args.svg, svg::plot(&rows, world, &report.device))
            .with_context(|| format!("writing {}", args.svg.display()))?;
        println!(
            "all-reduce, {world} x {} (times: median per call, max over ranks)",
            report.device
        );
        if let Some(note) = &shared_note {
            println!("{note}");
        }
        println!("{}", header());
        for r in &rows {
            println!("{}", format_row(r));
        }
        println!("json: {}  svg: {}", args.json.display(), args.svg.display());
        print!("{}", summary(&rows, world));
    }
    bench.host.barrier()?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn measure(
    b: &Bench,
    which: Which,
    n: usize,
    bytes: usize,
    dtype: Dtype,
    reference: &[u8],
    use_graph: bool,
    args: &Args,
) -> anyhow::Result<Row> {
    b.sync_all()?;
    // Check first, on a poisoned output, then warm up, time, and check again: the timed
    // back-to-back calls are where a missing barrier would show.
    b.poison_output(bytes)?;
    let ran = b.launch(which, n, dtype)?;
    let first = b.read_output(bytes)?;
    // A kernel that gave up (watchdog) fails its row here, before the timed calls.
    b.check_all()?;
    for _ in 0..3 {
        b.launch(which, n, dtype)?;
    }
    b.sync_all()?;
    let (t, graph) = b.time(which, n, dtype, use_graph, args)?;
    let last = b.read_output(bytes)?;
    b.check_all()?;
    let local_tree = first == reference && last == reference;
    let bits_tree = b.all_ranks_agree(local_tree)?;
    let hash = fnv(&last);
    let hashes = b.host.all_gather_bytes(&hash.to_le_bytes())?;
    let bits_ranks = hashes.chunks_exact(8).all(|c| c == hash.to_le_bytes());
    let time_us = b.max_over_ranks(t)?;
    let algbw = bytes as f64 / (time_us * 1e-6) / 1e9;
    let w = b.world as f64;
    if !local_tree && which != Which::Nccl {
        let first_bad = first
            .iter()
            .zip(reference)
            .position(|(a, r)| a != r)
            .map(|i| i / dtype.size());
        tracing::error!(
            rank = b.rank,
            algo = which.name(),
            bytes,
            dtype = dtype.name(),
            ?first_bad,
            "output differs from the host tree"
        );
    }
    Ok(Row {
        world: b.world,
        bytes,
        count: n,
        dtype: dtype.name(),
        algo: which.name(),
        ran,
        time_us,
        algbw_gbs: algbw,
        busbw_gbs: algbw * 2.0 * (w - 1.0) / w,
        ratio_to_nccl: None,
        bits_tree,
        bits_ranks,
        bits_ok: bits_tree && bits_ranks,
        graph,
        error: None,
    })
}

/// The line every output of a run on shared GPUs carries.
fn shared_gpu_note(coll: &GpuCollective, rank: usize, ordinal: usize) -> Option<String> {
    coll.shared().then(|| {
        crate::cli::common::shared_gpu_note(
            ordinal,
            coll.sharing().groups.get(rank).map_or(1, Vec::len),
        )
    })
}

/// One line per (dtype, size): NCCL, what `auto` ran and its ratio, every algorithm's
/// ratio, and whether every deterministic row was bit-exact.
fn summary(rows: &[Row], world: usize) -> String {
    let mut out = format!(
        "summary, {world} GPUs: time per call (us) and ratio to NCCL; bits = every deterministic row bit-exact\n{:>6} {:>5} {:>9} {:>9} {:>8} {:>6}  ratios\n",
        "size", "type", "nccl", "auto", "ran", "x nccl"
    );
    let mut keys: Vec<(&str, usize)> = rows.iter().map(|r| (r.dtype, r.bytes)).collect();
    keys.dedup();
    for (dtype, bytes) in keys {
        let group: Vec<&Row> = rows
            .iter()
            .filter(|r| r.dtype == dtype && r.bytes == bytes)
            .collect();
        let nccl = group.iter().find(|r| r.algo == "nccl" && r.error.is_none());
        let auto = group.iter().find(|r| r.algo == "auto" && r.error.is_none());
        let det: Vec<&&Row> = group
            .iter()
            .filter(|r| r.algo != "nccl" && r.error.is_none())
            .collect();
        let bits = !det.is_empty() && det.iter().all(|r| r.bits_ok);
        let ratios: Vec<String> = det
            .iter()
            .filter_map(|r| r.ratio_to_nccl.map(|x| format!("{}={x:.2}", r.algo)))
            .collect();
        out.push_str(&format!(
            "{:>6} {:>5} {:>9} {:>9} {:>8} {:>6}  {} bits={}\n",
            human(bytes),
            dtype,
            nccl.map_or("-".into(), |r| format!("{:.2}", r.time_us)),
            auto.map_or("-".into(), |r| format!("{:.2}", r.time_us)),
            auto.map_or("-", |r| r.ran),
            auto.and_then(|r| r.ratio_to_nccl)
                .map_or("-".into(), |x| format!("{x:.2}")),
            ratios.join(" "),
            if bits { "ok" } else { "FAIL" },
        ));
    }
    out
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{}M", bytes >> 20)
    } else if bytes >= 1 << 10 {
        format!("{}K", bytes >> 10)
    } else {
        format!("{bytes}")
    }
}

fn header() -> String {
    format!(
        "{:>6} {:>10} {:>5} {:>15} {:>9} {:>10} {:>9} {:>9} {:>7} {:>7}",
        "size", "count", "type", "algo", "ran", "time(us)", "algbw", "busbw", "x nccl", "bits-ok"
    )
}

fn format_row(r: &Row) -> String {
    if let Some(e) = &r.error {
        return format!(
            "{:>6} {:>10} {:>5} {:>15}  error: {}",
            human(r.bytes),
            r.count,
            r.dtype,
            r.algo,
            e.lines().next().unwrap_or("")
        );
    }
    format!(
        "{:>6} {:>10} {:>5} {:>15} {:>9} {:>10.2} {:>9.2} {:>9.2} {:>7} {:>7}",
        human(r.bytes),
        r.count,
        r.dtype,
        r.algo,
        r.ran,
        r.time_us,
        r.algbw_gbs,
        r.busbw_gbs,
        r.ratio_to_nccl.map_or("-".into(), |x| format!("{x:.2}")),
        if r.bits_ok {
            "yes"
        } else if r.bits_ranks {
            "not-tree"
        } else {
            "NO"
        },
    )
}

/// A hand-written SVG: time vs size, log-log, one panel per dtype, one line per algorithm.
mod svg {
    use super::{human, Row};
    use std::fmt::Write;

    const COLORS: &[&str] = &[
        "#000000", "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
    ];

    pub fn plot(rows: &[Row], world: usize, device: &str) -> String {
        let mut dtypes: Vec<&str> = Vec::new();
        let mut algos: Vec<&str> = Vec::new();
        for r in rows.iter().filter(|r| r.error.is_none()) {
            if !dtypes.contains(&r.dtype) {
                dtypes.push(r.dtype);
            }
            if !algos.contains(&r.algo) {
                algos.push(r.algo);
            }
        }
        let ok: Vec<&Row> = rows
            .iter()
            .filter(|r| r.error.is_none() && r.time_us > 0.0)
            .collect();
        let (pw, ph, ml, mt, mb) = (460.0, 340.0, 70.0, 50.0, 60.0);
        let width = ml + dtypes.len().max(1) as f64 * (pw + 40.0) + 150.0;
        let height = mt + ph + mb;
        let lx = |b: usize| (b as f64).log2();
        let (xmin, xmax) = ok.iter().fold((f64::MAX, f64::MIN), |(a, z), r| {
            (a.min(lx(r.bytes)), z.max(lx(r.bytes)))
        });
        let (ymin, ymax) = ok.iter().fold((f64::MAX, f64::MIN), |(a, z), r| {
            (a.min(r.time_us.log10()), z.max(r.time_us.log10()))
        });
        let (ymin, ymax) = (ymin.floor(), ymax.ceil().max(ymin.floor() + 1.0));
        let xspan = (xmax - xmin).max(1.0);
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{ml}" y="20" font-size="15">all-reduce time vs size, {world} x {device} (log-log; lower is better)</text>"#
        );
        for (pi, dt) in dtypes.iter().enumerate() {
            let x0 = ml + pi as f64 * (pw + 40.0);
            let px = |b: usize| x0 + (lx(b) - xmin) / xspan * pw;
            let py = |t: f64| mt + ph - (t.log10() - ymin) / (ymax - ymin) * ph;
            let _ = writeln!(
                s,
                r#"<rect x="{x0}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
            );
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="middle">{dt}: message size per rank</text>"#,
                x0 + pw / 2.0,
                mt + ph + 40.0
            );
            let mut e = ymin;
            while e <= ymax {
                let y = mt + ph - (e - ymin) / (ymax - ymin) * ph;
                let _ = writeln!(
                    s,
                    r#"<line x1="{x0}" x2="{}" y1="{y}" y2="{y}" stroke="lightgray"/><text x="{}" y="{}" text-anchor="end">{} us</text>"#,
                    x0 + pw,
                    x0 - 4.0,
                    y + 4.0,
                    10f64.powf(e)
                );
                e += 1.0;
            }
            let mut sizes: Vec<usize> = ok
                .iter()
                .filter(|r| r.dtype == *dt)
                .map(|r| r.bytes)
                .collect();
            sizes.sort_unstable();
            sizes.dedup();
            for b in &sizes {
                let _ = writeln!(
                    s,
                    r#"<text x="{}" y="{}" text-anchor="middle" font-size="10">{}</text>"#,
                    px(*b),
                    mt + ph + 15.0,
                    human(*b)
                );
            }
            for (ai, algo) in algos.iter().enumerate() {
                let pts: Vec<String> = ok
                    .iter()
                    .filter(|r| r.dtype == *dt && r.algo == *algo)
                    .map(|r| format!("{:.1},{:.1}", px(r.bytes), py(r.time_us)))
                    .collect();
                if pts.is_empty() {
                    continue;
                }
                let c = COLORS[ai % COLORS.len()];
                let dash = if *algo == "nccl" {
                    r#" stroke-dasharray="6,3""#
                } else {
                    ""
                };
                let _ = writeln!(
                    s,
                    r#"<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="{}"/>"#,
                    pts.join(" ")
                );
            }
        }
        let lx0 = ml + dtypes.len().max(1) as f64 * (pw + 40.0);
        for (ai, algo) in algos.iter().enumerate() {
            let y = mt + 20.0 + ai as f64 * 20.0;
            let c = COLORS[ai % COLORS.len()];
            let _ = writeln!(
                s,
                r#"<line x1="{lx0}" x2="{}" y1="{y}" y2="{y}" stroke="{c}" stroke-width="2"/><text x="{}" y="{}">{algo}</text>"#,
                lx0 + 25.0,
                lx0 + 30.0,
                y + 4.0
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8K").unwrap(), 8192);
        assert_eq!(parse_size("256M").unwrap(), 256 << 20);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("8Q").is_err());
    }

    #[test]
    fn inputs_depend_on_rank_and_make_order_matter() {
        let a = input_f32(1, 0, 64, 16);
        let b = input_f32(1, 1, 64, 16);
        assert_ne!(a, b);
        assert_eq!(a, input_f32(1, 0, 64, 16));
        // Over many elements, a different association gives different bits somewhere.
        let r: Vec<Vec<f32>> = (0..4).map(|k| input_f32(3, k, 4096, 1024)).collect();
        let differs = (0..1024).any(|i| {
            let t = (r[0][i] + r[1][i]) + (r[2][i] + r[3][i]);
            let s = ((r[0][i] + r[1][i]) + r[2][i]) + r[3][i];
            t.to_bits() != s.to_bits()
        });
        assert!(differs);
    }

    #[test]
    fn svg_has_a_line_per_algorithm() {
        let row = |algo: &'static str, bytes: usize, t: f64| Row {
            world: 2,
            bytes,
            count: bytes / 4,
            dtype: "f32",
            algo,
            ran: algo,
            time_us: t,
            algbw_gbs: 1.0,
            busbw_gbs: 1.0,
            ratio_to_nccl: None,
            bits_tree: true,
            bits_ranks: true,
            bits_ok: true,
            graph: true,
            error: None,
        };
        let rows = vec![
            row("nccl", 8192, 6.0),
            row("nccl", 1 << 20, 20.0),
            row("oneshot", 8192, 4.0),
            row("oneshot", 1 << 20, 15.0),
        ];
        let s = svg::plot(&rows, 2, "test");
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        let mut rows = rows;
        rows[2].ratio_to_nccl = Some(4.0 / 6.0);
        let sum = summary(&rows, 2);
        assert!(sum.contains("oneshot=0.67 bits=ok"), "{sum}");
        rows[2].bits_ok = false;
        assert!(summary(&rows, 2).contains("bits=FAIL"));
    }
}
