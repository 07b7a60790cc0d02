//! `arbor bench gemm`: the tree GEMM against cuBLAS (same process, same data), with the
//! invariance checked bitwise for every shape and M it times.
//!
//! Per (K, N) and M: median of per-iteration CUDA-event times after a warm-up, W rotated
//! over enough copies to defeat L2; TFLOP/s of both and their ratio; for M ≤ 64 the
//! weight-streaming GB/s against the device-to-device copy ceiling measured in the same
//! run. Checks: bits of the full result vs the host tree-combination of the TP = 2/4/8
//! segment-range shards, vs the same rows computed at the largest M (at a shifted row
//! position), vs a column shard of W, vs every launch path, bf16 output = rounded f32
//! root; and the relative error against cuBLAS (< 1e-2).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use arbor_kernels::cpu::matmul::TreeMatmul;
use arbor_kernels::cuda::cublas::Blas;
use arbor_kernels::cuda::gemm::{
    self, padded_rows, Epilogue, Family, GemmArgs, OutDtype, Path, TreeGemm,
};
use arbor_kernels::tree::{SegmentLayout, SEGMENTS};
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUevent_flags};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use serde::Serialize;

mod checks;
use checks::{
    call_f32, check_bf16, check_cols, check_counters, check_paths, check_repeat, check_rows,
    check_silu_bf16, check_tp, first_mismatch, rel_err, Call,
};

#[derive(clap::Args)]
pub struct Args {
    /// (K, N) shapes as KxN, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4096x4096,14336x4096,4096x14336,6144x2048"
    )]
    shapes: Vec<String>,
    /// Batch sizes M, comma-separated; the largest is also the reference for the row check.
    #[arg(long = "m", value_delimiter = ',', default_value = "1,16,64,1024,4096")]
    ms: Vec<usize>,
    /// Timed iterations per measurement (the median is reported).
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// Untimed iterations before timing.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Output element type of both arbor and cuBLAS.
    #[arg(long, value_enum, default_value = "f32")]
    out: OutArg,
    /// Leaf family: auto (wgmma on Hopper, mma.sync elsewhere), mma or wgmma.
    #[arg(long, value_enum, default_value = "auto")]
    family: FamilyArg,
    /// Time this launch path (by name, e.g. wgtma128) at every M instead of the default
    /// path for M; the checks still compare it with every other path.
    #[arg(long)]
    path: Option<String>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Seed of the random operands.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write every measurement and check as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Time what one rank of a TP group computes for a row-parallel layer of each KxN:
    /// its shard of K (8/TP of the 8 segments, contiguous operands), against cuBLAS on
    /// the same shard. 1: the whole layer.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// What arbor's timed call stores: the roots (`store`), or the MLP's SiLU·mul of
    /// alternating gate/up columns as f32 and bf16 (`silu`, what the model's gate/up layer
    /// writes) or bf16 alone (`silu-bf16`). cuBLAS times the plain GEMM either way. N must
    /// be even for the SiLU epilogues.
    #[arg(long, value_enum, default_value = "store")]
    epilogue: EpilogueArg,
    /// Rows of X arbor's timed call may read: `model` (the model's rule,
    /// `gemm::x_rows_to_read`), `padded` (M rounded up to whole 128-row boxes) or `exact`
    /// (M: the boxes of the last row tile reach past X and the TMA unit fills them).
    #[arg(long, value_enum, default_value = "model")]
    x_rows: XRowsArg,
    /// `full`: after timing, check every call's bits (TP shards, rows, columns, paths, bf16,
    /// repeat) and its error against cuBLAS. `none`: time only, for A/B runs of builds
    /// whose bits the GPU tests have checked (at large shapes the checks copy many
    /// full-size results to the host: ~1 GB each at M 8192 × N 28672). Rows say
    /// "unchecked".
    #[arg(long, value_enum, default_value = "full")]
    checks: ChecksArg,
    /// `cold`: W rotated over copies that fill 3× L2, so no timed call finds it cached (a
    /// model's layers). `warm`: one copy, which a timed call finds in L2 where it fits: the
    /// most that fetching W into L2 ahead of the call could give it.
    #[arg(long, value_enum, default_value = "cold")]
    w_cache: WCacheArg,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum WCacheArg {
    Cold,
    Warm,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ChecksArg {
    Full,
    None,
}

impl Args {
    /// Whether the timed calls are checked after timing (`--checks full`).
    fn checked(&self) -> bool {
        self.checks == ChecksArg::Full
    }
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum XRowsArg {
    Model,
    Padded,
    Exact,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum EpilogueArg {
    Store,
    Silu,
    SiluBf16,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum OutArg {
    F32,
    Bf16,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum FamilyArg {
    Auto,
    Mma,
    Wgmma,
}

#[derive(Serialize)]
struct Report {
    device: String,
    arch: String,
    out_dtype: &'static str,
    /// What arbor's timed call stored (`--epilogue`); cuBLAS always times the plain GEMM.
    epilogue: &'static str,
    /// Rows of X arbor's timed calls read (`--x-rows`).
    x_rows: &'static str,
    copy_ceiling_gbps: f64,
    iters: usize,
    results: Vec<Row>,
    /// False under `--checks none`: the rows were timed, not checked.
    checked: bool,
    all_checks_pass: bool,
}

#[derive(Serialize, Clone)]
struct Row {
    /// The K this call reduces (a rank's shard at TP > 1) and the layer's.
    k: usize,
    global_k: usize,
    tp: usize,
    n: usize,
    m: usize,
    path: &'static str,
    arbor_ms: f64,
    cublas_ms: f64,
    arbor_tflops: f64,
    cublas_tflops: f64,
    ratio: f64,
    /// Weight bytes over arbor's time, and that as a fraction of the copy ceiling (M ≤ 64).
    weight_gbps: Option<f64>,
    frac_of_copy: Option<f64>,
    /// None under `--checks none`.
    rel_err_vs_cublas: Option<f64>,
    checks: Vec<Check>,
    /// Whether the other leaf family (when compiled) gives the same bits: information
    /// only, the contract holds per family.
    other_family_equal: Option<bool>,
}

#[derive(Serialize, Clone)]
struct Check {
    name: String,
    pass: bool,
    detail: String,
}

pub fn run(args: Args) -> Result<()> {
    gemm::probe().context("'bench gemm' needs an NVIDIA GPU")?;
    // SAFETY: only dlopens the library names cudarc would use.
    if !unsafe { blas_sys::is_culib_present() } {
        bail!(
            "'bench gemm' needs libcublas for its baseline: add its directory (e.g. \
             /usr/local/cuda/targets/x86_64-linux/lib) to LD_LIBRARY_PATH"
        );
    }
    let shapes = parse_shapes(&args.shapes)?;
    let mut ms = args.ms.clone();
    ms.sort_unstable();
    ms.dedup();
    if ms.first() == Some(&0) || ms.is_empty() {
        bail!("--m needs positive batch sizes, got {:?}", args.ms);
    }
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    if args.epilogue != EpilogueArg::Store {
        if let Some((k, n)) = shapes.iter().find(|(_, n)| n % 2 != 0) {
            bail!("--epilogue silu needs gate/up pairs: N = {n} (shape {k}x{n}) is odd");
        }
        if args.out != OutArg::F32 {
            bail!("--epilogue silu writes its own outputs (f32 and/or bf16); leave --out at f32");
        }
    }
    if !arbor_kernels::tree::is_valid_world(args.tp) {
        bail!("--tp {} must be 1, 2, 4 or 8", args.tp);
    }
    let ctx = CudaContext::new(args.device)
        .with_context(|| format!("cannot open CUDA device {}", args.device))?;
    // Raw pointers are used throughout on one stream; cudarc's per-buffer events add nothing.
    // SAFETY: no buffer is shared with another stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().context("cuStreamCreate")?;
    let device = ctx.name().unwrap_or_else(|_| "unknown".into());
    let l2 = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        .unwrap_or(64 << 20)
        .max(1) as usize;
    let t0 = std::time::Instant::now();
    let tg = TreeGemm::new(&ctx)?;
    tracing::info!(
        arch = %tg.arch,
        ms = t0.elapsed().as_millis() as u64,
        "compiled the tree GEMM"
    );
    let blas = Blas::new(&stream).map_err(anyhow::Error::msg)?;
    let timer = Timer::new(&ctx, &stream, args.warmup, args.iters)?;
    let out_dtype = match args.out {
        OutArg::F32 => OutDtype::F32,
        OutArg::Bf16 => OutDtype::Bf16,
    };

    let family = match args.family {
        FamilyArg::Auto => tg.family,
        FamilyArg::Mma => Family::Mma,
        FamilyArg::Wgmma => Family::Wgmma,
    };
    if let Some(p) = Path::all(family).iter().find(|p| !tg.has(**p)) {
        bail!("path {} is not available on {}", p.name(), tg.arch);
    }
    let forced = match &args.path {
        None => None,
        Some(name) => Some(
            *Path::all(family)
                .iter()
                .find(|p| p.name() == name)
                .with_context(|| {
                    let names: Vec<&str> = Path::all(family).iter().map(|p| p.name()).collect();
                    format!("--path {name:?} is not a path of the {family:?} family ({names:?})")
                })?,
        ),
    };
    let copy_gbps = copy_ceiling(&stream, &timer)?;
    println!(
        "device: {device} ({}), L2 {} MiB, leaf family {family:?}",
        tg.arch,
        l2 >> 20
    );
    println!("copy ceiling (device-to-device, read+write): {copy_gbps:.0} GB/s");
    if args.w_cache == WCacheArg::Warm {
        println!("W warm: one copy, found in L2 by every timed call where it fits");
    }
    if args.tp > 1 {
        println!(
            "TP {}: each K below is rank 0's shard of the layer's K ({} of the 8 segments)",
            args.tp,
            SEGMENTS / args.tp
        );
    }
    for (path, size) in [
        (Path::WgCluster64, SEGMENTS),
        (Path::WgCluster64x2, SEGMENTS / 2),
    ] {
        if let Ok(Some(c)) = tg.max_active_clusters(path, SEGMENTS) {
            println!(
                "{}: at most {c} clusters of {size} blocks resident ({} blocks)",
                path.name(),
                c as usize * size
            );
        }
    }
    // The swapped kernels run one block an SM in clusters of one to eight: how many fit
    // at once decides which forms make one wave (swap_form).
    for size in [2usize, 4, 8] {
        if let Ok(c) = tg.swap_clusters(size) {
            println!(
                "wgswap blocks: at most {c} clusters of {size} resident ({} blocks)",
                c as usize * size
            );
        }
    }
    println!(
        "{:>6} {:>6} {:>5} {:>8} {:>9} {:>9} {:>8} {:>8} {:>6} {:>7} {:>6} {:>8} checks",
        "K",
        "N",
        "M",
        "path",
        "arbor ms",
        "cuBLAS ms",
        "arbor TF",
        "cuBLAS TF",
        "ratio",
        "GB/s",
        "%copy",
        "rel err"
    );
    match args.epilogue {
        EpilogueArg::Store => {}
        EpilogueArg::Silu => println!("arbor times include the SiLU·mul epilogue (f32 and bf16 out); cuBLAS times the GEMM alone"),
        EpilogueArg::SiluBf16 => println!("arbor times include the SiLU·mul epilogue (bf16 out only); cuBLAS times the GEMM alone"),
    }
    let mut rows = Vec::new();
    for &(k, n) in &shapes {
        let shape_rows = bench_shape(
            &stream, &tg, &blas, &timer, &args, &ms, k, n, l2, out_dtype, copy_gbps, family, forced,
        )
        .with_context(|| format!("shape K={k} N={n} at TP {}", args.tp))?;
        rows.extend(shape_rows);
    }
    let checked = args.checked();
    let all_pass = rows
        .iter()
        .all(|r| r.rel_err_vs_cublas.is_none_or(|e| e < 1e-2) && r.checks.iter().all(|c| c.pass));
    let report = Report {
        device,
        arch: tg.arch.clone(),
        epilogue: match args.epilogue {
            EpilogueArg::Store => "store",
            EpilogueArg::Silu => "silu (f32 + bf16)",
            EpilogueArg::SiluBf16 => "silu (bf16)",
        },
        x_rows: match args.x_rows {
            XRowsArg::Model => "model",
            XRowsArg::Padded => "padded",
            XRowsArg::Exact => "exact",
        },
        out_dtype: match out_dtype {
            OutDtype::F32 => "f32",
            OutDtype::Bf16 => "bf16",
        },
        copy_ceiling_gbps: copy_gbps,
        iters: args.iters,
        results: rows,
        checked,
        all_checks_pass: checked && all_pass,
    };
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    print_summary(&report);
    if checked && !all_pass {
        bail!("some invariance or correctness checks failed (see the table above)");
    }
    Ok(())
}

fn parse_shapes(specs: &[String]) -> Result<Vec<(usize, usize)>> {
    specs
        .iter()
        .map(|s| {
            let (k, n) = s
                .split_once(['x', 'X'])
                .with_context(|| format!("shape '{s}' is not KxN"))?;
            let k: usize = k
                .trim()
                .parse()
                .with_context(|| format!("K in shape '{s}'"))?;
            let n: usize = n
                .trim()
                .parse()
                .with_context(|| format!("N in shape '{s}'"))?;
            if k == 0 || n == 0 {
                bail!("shape '{s}' has a zero dimension");
            }
            Ok((k, n))
        })
        .collect()
}

fn print_summary(r: &Report) {
    let big: Vec<&Row> = r.results.iter().filter(|x| x.m >= 1024).collect();
    let small: Vec<&Row> = r.results.iter().filter(|x| x.m <= 64).collect();
    if let Some(min) = big.iter().map(|x| x.ratio).reduce(f64::min) {
        println!("M >= 1024: worst arbor/cuBLAS ratio {min:.3} (target 0.90)");
    }
    if let Some(min) = small.iter().filter_map(|x| x.frac_of_copy).reduce(f64::min) {
        println!(
            "M <= 64: worst weight-streaming fraction of the copy ceiling {min:.3} (target 0.85)"
        );
    }
    println!(
        "invariance and correctness: {}",
        if !r.checked {
            "not checked (--checks none)"
        } else if r.all_checks_pass {
            "all pass"
        } else {
            "FAILURES"
        }
    );
}

/// Deterministic non-zero bf16 values in (-1, 1).
fn random_bf16(len: usize, seed: u64) -> Vec<u16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = ((s >> 40) as f32) / (1u64 << 24) as f32; // [0, 1)
            let v = 2.0 * u - 1.0;
            let v = if v == 0.0 { 0.5 } else { v };
            half::bf16::from_f32(v).to_bits()
        })
        .collect()
}

fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> CUdeviceptr {
    let (p, _sync) = s.device_ptr(stream);
    p
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>> {
    stream
        .alloc_zeros::<T>(len.max(1))
        .with_context(|| format!("cannot allocate {len} elements on the GPU"))
}

struct Timer {
    starts: Vec<cudarc::driver::CudaEvent>,
    ends: Vec<cudarc::driver::CudaEvent>,
    warmup: usize,
    stream: Arc<CudaStream>,
}

impl Timer {
    fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        warmup: usize,
        iters: usize,
    ) -> Result<Self> {
        let mk = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let starts = (0..iters).map(|_| mk()).collect::<Result<Vec<_>, _>>()?;
        let ends = (0..iters).map(|_| mk()).collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            starts,
            ends,
            warmup,
            stream: stream.clone(),
        })
    }

    /// Median milliseconds of `f(i)` over the timed iterations.
    fn median_ms(&self, mut f: impl FnMut(usize) -> Result<()>) -> Result<f64> {
        for i in 0..self.warmup {
            f(i)?;
        }
        for (i, (a, b)) in self.starts.iter().zip(&self.ends).enumerate() {
            a.record(&self.stream)?;
            f(self.warmup + i)?;
            b.record(&self.stream)?;
        }
        self.stream.synchronize()?;
        let mut t = self
            .starts
            .iter()
            .zip(&self.ends)
            .map(|(a, b)| a.elapsed_ms(b).map(|x| x as f64))
            .collect::<Result<Vec<_>, _>>()?;
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    }
}

fn copy_ceiling(stream: &Arc<CudaStream>, timer: &Timer) -> Result<f64> {
    let bytes = 1usize << 30;
    let src: CudaSlice<u8> = zeros(stream, bytes)?;
    let mut dst: CudaSlice<u8> = zeros(stream, bytes)?;
    let ms = timer.median_ms(|_| Ok(stream.memcpy_dtod(&src, &mut dst)?))?;
    Ok(2.0 * bytes as f64 / (ms * 1e-3) / 1e9)
}

/// Device operands of one (K, N); X and W rows have stride `k`.
struct Operands {
    family: Family,
    k: usize,
    n: usize,
    x: CudaSlice<u16>,
    w: Vec<CudaSlice<u16>>,
    out: CudaSlice<f32>,
    out2: CudaSlice<f32>,
    /// The SiLU·mul epilogue's bf16 outputs (`--epilogue silu*`): the timed call's, and the
    /// other mode's for the check that both write the same bits.
    silu_h: CudaSlice<u16>,
    silu_h2: CudaSlice<u16>,
    ws: CudaSlice<f32>,
    ws_len: usize,
    /// Tile arrival counters of the split paths: zeroed once, left at zero by every call.
    cnt: CudaSlice<u32>,
    cnt_len: usize,
}

#[allow(clippy::too_many_arguments)]
fn bench_shape(
    stream: &Arc<CudaStream>,
    tg: &TreeGemm,
    blas: &Blas,
    timer: &Timer,
    args: &Args,
    ms: &[usize],
    k: usize,
    n: usize,
    l2: usize,
    out_dtype: OutDtype,
    copy_gbps: f64,
    family: Family,
    forced: Option<Path>,
) -> Result<Vec<Row>> {
    // At TP > 1 the operands are rank 0's shard of K, contiguous as a rank holds them,
    // reduced as its 8/TP segments of the layer's segment length.
    let global_k = k;
    let layout = SegmentLayout::new(global_k);
    let n_seg = SEGMENTS / args.tp;
    let k = layout.shard(0, args.tp).len();
    let m_ref = *ms.last().context("no M")?;
    let x_rows = padded_rows(m_ref + 8);
    let w_bytes = n * k * 2;
    // Enough weight copies that one pass over them is 3× L2: a timed call never finds W
    // cached by the previous one.
    let copies = match args.w_cache {
        WCacheArg::Cold => (3 * l2).div_ceil(w_bytes).clamp(1, 16),
        WCacheArg::Warm => 1,
    };
    let x_host = random_bf16(x_rows * k, args.seed);
    let w_host = random_bf16(n * k, args.seed.wrapping_add(0x51ed));
    let x = stream.clone_htod(&x_host)?;
    let w_copies = (0..copies)
        .map(|_| stream.clone_htod(&w_host))
        .collect::<Result<Vec<_>, _>>()?;
    // Workspace and tile counters for the split paths, up to M = 1024 (larger M reach the
    // split paths through the row check). One of each serves every call of every shape,
    // as in the model; the counters are zeroed once, as the kernels require.
    let split_paths = || {
        [Family::Mma, Family::Wgmma]
            .into_iter()
            .flat_map(|f| Path::all(f).iter().copied())
    };
    let ws_len = ms
        .iter()
        .flat_map(|&m| split_paths().map(move |p| p.workspace_len(m.min(1024), n, n_seg)))
        .max()
        .unwrap_or(0);
    let cnt_len = ms
        .iter()
        .flat_map(|&m| split_paths().map(move |p| p.counters_len(m.min(1024), n)))
        .max()
        .unwrap_or(0);
    let ops = Operands {
        family,
        k,
        n,
        x,
        w: w_copies,
        out: zeros(stream, m_ref * n)?,
        out2: zeros(stream, m_ref * n)?,
        silu_h: zeros(stream, m_ref * n / 2)?,
        silu_h2: zeros(stream, m_ref * n / 2)?,
        ws: zeros(stream, ws_len)?,
        ws_len,
        cnt: zeros(stream, cnt_len)?,
        cnt_len,
    };
    let full = |m: usize| TreeMatmul {
        m,
        n,
        k,
        seg_len: layout.seg_len,
        n_seg,
    };

    let checked = args.checked();
    // The reference rows: the largest M, by its own path.
    let ref_y = if checked {
        call_f32(stream, tg, &ops, &Call::new(full(m_ref)), &ops.out)?
    } else {
        Vec::new()
    };

    let mut rows = Vec::new();
    for &m in ms {
        let path = forced.unwrap_or_else(|| {
            if family == tg.family {
                tg.default_path(&full(m), args.epilogue != EpilogueArg::Store)
            } else {
                Path::for_shape(&full(m), family)
            }
        });
        let x_p = ptr(&ops.x, stream);
        let out_p = ptr(&ops.out, stream);
        let ws_p = ptr(&ops.ws, stream);
        let cnt_p = ptr(&ops.cnt, stream);
        let wp: Vec<CUdeviceptr> = ops.w.iter().map(|w| ptr(w, stream)).collect();
        let silu_p = ptr(&ops.silu_h, stream);
        let timed_args = |w: CUdeviceptr, epilogue: EpilogueArg, bf16: CUdeviceptr| GemmArgs {
            shape: full(m),
            x: x_p,
            ldx: k,
            x_rows: match args.x_rows {
                XRowsArg::Model => gemm::x_rows_to_read(m, padded_rows(m), gemm::PAD_ABOVE_ROWS),
                XRowsArg::Padded => padded_rows(m),
                XRowsArg::Exact => m,
            },
            w,
            ldw: k,
            out: if epilogue == EpilogueArg::SiluBf16 {
                0
            } else {
                out_p
            },
            out_dtype,
            ws: ws_p,
            ws_len: ops.ws_len,
            counters: cnt_p,
            counters_len: ops.cnt_len,
            w_constant: true,
            epilogue: match epilogue {
                EpilogueArg::Store => Epilogue::Store,
                EpilogueArg::Silu | EpilogueArg::SiluBf16 => Epilogue::SiluMulPairs { bf16 },
            },
        };
        let arbor_ms = timer.median_ms(|i| {
            let a = timed_args(wp[i % wp.len()], args.epilogue, silu_p);
            // SAFETY: all pointers are live buffers sized for `full(m)`.
            unsafe { tg.launch(stream, &a, Some(path)) }?;
            Ok(())
        })?;
        let out2_p = ptr(&ops.out2, stream);
        let cublas_ms = timer.median_ms(|i| {
            // SAFETY: the operands were allocated for this (m, n, k) on the bench stream.
            unsafe { blas.gemm(m, n, k, x_p, wp[i % wp.len()], out2_p, out_dtype) }
                .map_err(anyhow::Error::msg)
        })?;

        // Checks (untimed), unless asked not to.
        let (rel_err, checks, other_family_equal) = if checked {
            // The epilogue's bf16 values must not depend on whether its f32 copy is written.
            let silu_check = match args.epilogue {
                EpilogueArg::Store => None,
                EpilogueArg::Silu | EpilogueArg::SiluBf16 => {
                    let mode = |alone| {
                        if alone {
                            EpilogueArg::SiluBf16
                        } else {
                            EpilogueArg::Silu
                        }
                    };
                    Some(check_silu_bf16(
                        stream,
                        tg,
                        &ops,
                        path,
                        m,
                        n,
                        |bf16, alone| timed_args(wp[0], mode(alone), bf16),
                    )?)
                }
            };
            let y = call_f32(stream, tg, &ops, &Call::new(full(m)), &ops.out)?;
            // SAFETY: as above.
            unsafe { blas.gemm(m, n, k, x_p, wp[0], out2_p, OutDtype::F32) }
                .map_err(anyhow::Error::msg)?;
            let y_blas: Vec<f32> = stream.clone_dtoh(&ops.out2)?[..m * n].to_vec();
            let rel_err = Some(rel_err(&y, &y_blas));
            let mut checks: Vec<Check> = silu_check.into_iter().collect();
            if args.tp == 1 {
                checks.push(check_tp(stream, tg, &ops, &layout, m, &y)?);
            }
            if m < m_ref {
                checks.push(check_rows(stream, tg, &ops, full(m), m_ref, &ref_y)?);
            }
            checks.push(check_cols(stream, tg, &ops, full(m), &y)?);
            if m <= 1024 {
                checks.push(check_paths(stream, tg, &ops, full(m), &y)?);
            }
            checks.push(check_bf16(stream, tg, &ops, full(m), &y)?);
            // After calls of other shapes (TP shards, a column shard, other M) sharing the
            // workspace and counters: the same call again, and the counters all back at zero.
            checks.push(check_repeat(stream, tg, &ops, full(m), &y)?);
            checks.push(check_counters(stream, &ops)?);
            let other = match family {
                Family::Mma => Family::Wgmma,
                Family::Wgmma => Family::Mma,
            };
            let other_path = Path::for_shape(&full(m), other);
            let other_family_equal = if tg.has(other_path) {
                let c = Call {
                    path: Some(other_path),
                    ..Call::new(full(m))
                };
                let o = call_f32(stream, tg, &ops, &c, &ops.out2)?;
                Some(first_mismatch(&o, &y, n).is_none())
            } else {
                None
            };

            (rel_err, checks, other_family_equal)
        } else {
            (None, Vec::new(), None)
        };

        let flops = 2.0 * (m * n * k) as f64;
        let arbor_tf = flops / (arbor_ms * 1e-3) / 1e12;
        let cublas_tf = flops / (cublas_ms * 1e-3) / 1e12;
        let (gbps, frac) = if m <= 64 {
            let g = w_bytes as f64 / (arbor_ms * 1e-3) / 1e9;
            (Some(g), Some(g / copy_gbps))
        } else {
            (None, None)
        };
        let row = Row {
            k,
            global_k,
            tp: args.tp,
            n,
            m,
            path: path.name(),
            arbor_ms,
            cublas_ms,
            arbor_tflops: arbor_tf,
            cublas_tflops: cublas_tf,
            ratio: cublas_ms / arbor_ms,
            weight_gbps: gbps,
            frac_of_copy: frac,
            rel_err_vs_cublas: rel_err,
            checks,
            other_family_equal,
        };
        print_row(&row);
        rows.push(row);
    }
    Ok(rows)
}

fn print_row(r: &Row) {
    let fails: Vec<&str> = r
        .checks
        .iter()
        .filter(|c| !c.pass)
        .map(|c| c.name.as_str())
        .collect();
    let mut status = if r.rel_err_vs_cublas.is_none() {
        "unchecked".to_string()
    } else if fails.is_empty() && r.rel_err_vs_cublas.is_some_and(|e| e < 1e-2) {
        format!("ok ({})", r.checks.len())
    } else {
        format!("FAIL {fails:?}")
    };
    if let Some(eq) = r.other_family_equal {
        status.push_str(if eq {
            " [other family: same bits]"
        } else {
            " [other family: other bits]"
        });
    }
    println!(
        "{:>6} {:>6} {:>5} {:>8} {:>9.4} {:>9.4} {:>8.1} {:>8.1} {:>6.3} {:>7} {:>6} {:>8} {}",
        r.k,
        r.n,
        r.m,
        r.path,
        r.arbor_ms,
        r.cublas_ms,
        r.arbor_tflops,
        r.cublas_tflops,
        r.ratio,
        r.weight_gbps.map_or("-".into(), |g| format!("{g:.0}")),
        r.frac_of_copy
            .map_or("-".into(), |f| format!("{:.1}", 100.0 * f)),
        r.rel_err_vs_cublas
            .map_or("-".into(), |e| format!("{e:.1e}")),
        status
    );
    for c in r.checks.iter().filter(|c| !c.pass) {
        println!("    {}: {}", c.name, c.detail);
    }
}
