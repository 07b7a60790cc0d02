//! `arbor bench attention`: the paged attention kernels alone, one layer, on one GPU, for
//! the prefill and decode shapes of a model's attention (default: llama3-8b's 32 query
//! heads, 8 KV heads, head_dim 128). Per shape: the median time of CUDA-event-timed
//! launches after a warm-up, the FLOP rate and the KV bytes read per second, and the two
//! floors (FLOPs at the tensor-core rate, bytes at the copy bandwidth, both given).
//! `scripts/bench/bench-attention.sh` prints it next to PyTorch's flash attention on the same
//! shapes (`scripts/bench/attention-reference.py`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use arbor_kernels::cuda::paged_attention::{AttnRouting, PagedRows, SeqSpan};
use arbor_kernels::cuda::{ops::dev_ptr, GpuDevice};
use arbor_kernels::paged::{blocks_for, splits_of, PagedKvLayout};
use cudarc::driver::sys::CUevent_flags;
use serde::Serialize;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value_t = 32)]
    heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Prefill shapes, BATCHxTOKENS (causal, each sequence from position 0).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8x1024,64x1024,4x8192,2x16384"
    )]
    prefill: Vec<String>,
    /// Decode shapes, BATCHxCONTEXT (one new row per sequence at position CONTEXT-1).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1x1024,64x1024,256x1024,1x8192,32x8192,1x16384,16x16384"
    )]
    decode: Vec<String>,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// JSON output.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Serialize)]
struct Row {
    kind: &'static str,
    batch: usize,
    tokens: usize,
    us: f64,
    tflops: f64,
    kv_gbs: f64,
}

fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let (a, b) = s
        .split_once('x')
        .with_context(|| format!("shape {s:?} is not BATCHxTOKENS"))?;
    let (a, b): (usize, usize) = (
        a.trim()
            .parse()
            .with_context(|| format!("batch in {s:?}"))?,
        b.trim()
            .parse()
            .with_context(|| format!("tokens in {s:?}"))?,
    );
    if a == 0 || b == 0 {
        bail!("shape {s:?} has a zero");
    }
    Ok((a, b))
}

pub fn run(a: Args) -> Result<()> {
    arbor_kernels::cuda::probe::driver().context("'bench attention' needs an NVIDIA GPU")?;
    if a.kv_heads == 0 || !a.heads.is_multiple_of(a.kv_heads) {
        bail!(
            "{} heads are not a multiple of {} KV heads",
            a.heads,
            a.kv_heads
        );
    }
    if a.iters == 0 {
        bail!("--iters must be at least 1");
    }
    let dev = GpuDevice::open(0).context("opening GPU 0")?;
    println!(
        "arbor bench attention on {}: {} heads, {} KV heads, head_dim {}; one layer, median of {} runs",
        dev.name(),
        a.heads,
        a.kv_heads,
        a.head_dim,
        a.iters
    );
    println!(
        "{:>8} {:>6} {:>7} {:>10} {:>9} {:>10}",
        "kind", "batch", "tokens", "us", "TFLOP/s", "KV GB/s"
    );
    let mut rows = Vec::new();
    for s in a.prefill.iter().filter(|s| !s.trim().is_empty()) {
        let (b, t) = parse_shape(s)?;
        rows.push(bench(&dev, &a, "prefill", b, t)?);
    }
    for s in a.decode.iter().filter(|s| !s.trim().is_empty()) {
        let (b, t) = parse_shape(s)?;
        rows.push(bench(&dev, &a, "decode", b, t)?);
    }
    if let Some(p) = &a.out {
        std::fs::write(p, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

/// One shape: `batch` sequences of `tokens` positions each in their own blocks; prefill
/// computes every row, decode the last row of each.
fn bench(
    dev: &GpuDevice,
    a: &Args,
    kind: &'static str,
    batch: usize,
    tokens: usize,
) -> Result<Row> {
    let nb = blocks_for(tokens);
    let layout = PagedKvLayout {
        layers: 1,
        blocks: batch * nb,
        n_kv_heads: a.kv_heads,
        head_dim: a.head_dim,
    };
    let fill = |len: usize, seed: u32| -> Vec<u16> {
        // bf16 values in about ±1 from a cheap hash (real data, not zeros).
        (0..len as u32)
            .map(|i| {
                let h = (i ^ seed).wrapping_mul(2654435761).rotate_left(13);
                0x3c00 + (h % 0x400) as u16 + if h & 0x8000_0000 != 0 { 0x8000 } else { 0 }
            })
            .collect()
    };
    let k = dev.upload("k", &fill(layout.len(), 1))?;
    let v = dev.upload("v", &fill(layout.len(), 2))?;
    let table: Vec<u32> = (0..(batch * nb) as u32).collect();
    let decode = kind == "decode";
    let (pos, toff, spans): (Vec<u32>, Vec<u32>, Vec<SeqSpan>) = if decode {
        (
            vec![(tokens - 1) as u32; batch],
            (0..batch).map(|s| (s * nb) as u32).collect(),
            Vec::new(),
        )
    } else {
        let mut p = Vec::new();
        let mut o = Vec::new();
        let mut sp = Vec::new();
        for s in 0..batch {
            sp.push(SeqSpan {
                row0: s * tokens,
                len: tokens,
                pos0: 0,
                table0: s * nb,
            });
            p.extend(0..tokens as u32);
            o.extend(std::iter::repeat_n((s * nb) as u32, tokens));
        }
        (p, o, sp)
    };
    let nrows = pos.len();
    let w = a.heads * a.head_dim;
    let q: Vec<f32> = (0..nrows * w)
        .map(|i| ((i as u32).wrapping_mul(2246822519) >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
        .collect();
    let dq = dev.upload_f32(&q)?;
    let dpos = dev.upload_u32(&pos)?;
    let doff = dev.upload_u32(&toff)?;
    let dtab = dev.upload_u32(&table)?;
    arbor_kernels::cuda::paged_attention::check_tables(&pos, &toff, &table, layout.blocks)?;
    // SAFETY: the buffers live to the end of this function, and check_tables passed.
    let prow = unsafe {
        PagedRows::from_device(
            nrows,
            dev_ptr(&dpos, &dev.stream),
            dev_ptr(&doff, &dev.stream),
            dev_ptr(&dtab, &dev.stream),
        )
    };
    let routing = if decode {
        dev.attn_routing_decode(nrows, AttnRouting::split_bucket(tokens))
    } else {
        dev.attn_routing(&spans, a.head_dim)?
    };
    let scale = 1.0 / (a.head_dim as f32).sqrt();
    let mut outb = dev.empty_bf16(q.len())?;
    // Outputs and split states lent by the step workspace, as in the engine's steps: no
    // allocation inside the timed launches.
    let _scope = dev.workspace.scope();
    let mut launch = || -> Result<()> {
        let o = dev.paged_attention(
            &dq,
            &k,
            &v,
            layout,
            0,
            &prow,
            &routing,
            a.heads,
            scale,
            Some(&mut outb),
        )?;
        drop(o);
        Ok(())
    };
    for _ in 0..a.warmup {
        launch()?;
    }
    let ev = || dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
    let mut times = Vec::with_capacity(a.iters);
    for _ in 0..a.iters {
        let (e0, e1) = (ev()?, ev()?);
        e0.record(&dev.stream)?;
        launch()?;
        e1.record(&dev.stream)?;
        e1.synchronize()?;
        times.push(e0.elapsed_ms(&e1)? as f64 * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let us = times[times.len() / 2];
    // Causal FLOPs (QK and PV, 2 per multiply-add) and the KV bytes a pass must read.
    let keys: f64 = if decode {
        (batch * tokens) as f64
    } else {
        batch as f64 * (tokens * (tokens + 1) / 2) as f64
    };
    let flops = 4.0 * keys * (a.heads * a.head_dim) as f64;
    let kv_bytes = (batch * tokens * a.kv_heads * a.head_dim * 2 * 2) as f64;
    let row = Row {
        kind,
        batch,
        tokens,
        us,
        tflops: flops / (us * 1e-6) / 1e12,
        kv_gbs: kv_bytes / (us * 1e-6) / 1e9,
    };
    // Which build ran (ARBOR_ATTN_DECODE, ARBOR_ATTN_PREFILL_ROWS), for A/B logs.
    let tiles = if decode {
        format!(
            ", {:?} decode build",
            dev.decode_build(&routing, a.heads, layout)?
        )
    } else {
        let pt = routing.prefill_tiles();
        format!(", {pt:?} build, {}-row tiles", pt.rows())
    };
    println!(
        "{:>8} {:>6} {:>7} {:>10.1} {:>9.1} {:>10.0}   (splits {}{tiles})",
        kind,
        batch,
        tokens,
        row.us,
        row.tflops,
        row.kv_gbs,
        splits_of(tokens - 1)
    );
    Ok(row)
}
