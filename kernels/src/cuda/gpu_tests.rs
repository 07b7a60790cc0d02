//! Kernel tests that need a GPU: bit-identity across batch size, row position, TP split
//! and prefill vs decode, plus agreement with a host f64 reference within bf16 tolerance.
//! Each test prints why and passes when no usable GPU is present (CI has none); on a GPU
//! machine they run from the prebuilt test binary (scripts/gpu/gpu-check.sh).

use half::bf16;

use super::GpuDevice;
use crate::tree::{SegmentLayout, SEGMENTS};

fn device() -> Option<GpuDevice> {
    if let Err(e) = super::probe::driver() {
        eprintln!("skipped: {e}");
        return None;
    }
    match GpuDevice::open(0) {
        Ok(d) => Some(d),
        Err(e) => panic!("a GPU is present but cannot be used: {e}"),
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// max |a−b| / max(|b|, floor) over all elements.
fn rel_err(a: &[f32], b: &[f64], floor: f64) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs() / y.abs().max(floor))
        .fold(0.0, f64::max)
}

fn columns(x: &[f32], rows: usize, k: usize, r: std::ops::Range<usize>) -> Vec<f32> {
    (0..rows)
        .flat_map(|i| x[i * k + r.start..i * k + r.end].to_vec())
        .collect()
}

fn check_matmul(dev: &GpuDevice, m: usize, n: usize, k: usize, seed: u64) {
    let mut rng = Rng(seed);
    let x = rng.vec(m * k, 2.0);
    let w = to_bf16(&rng.vec(n * k, 0.5));
    let layout = SegmentLayout::new(k);
    let dx = dev.upload_f32(&x).unwrap();
    let dw = dev.upload_bf16(&w).unwrap();
    let full = dev
        .download_f32(
            &dev.tree_matmul(&dx, m, k, &dw, n, layout.seg_len, SEGMENTS)
                .unwrap(),
        )
        .unwrap();

    // Reference in f64 over bf16-rounded inputs.
    let xr: Vec<f64> = x.iter().map(|&v| bf16::from_f32(v).to_f64()).collect();
    let reference: Vec<f64> = (0..m * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            (0..k).map(|j| xr[r * k + j] * w[c * k + j].to_f64()).sum()
        })
        .collect();
    let err = rel_err(&full, &reference, 1.0);
    assert!(
        err < 1e-4,
        "matmul {m}x{n}x{k}: relative error {err} vs f64"
    );

    // Batch invariance: every row alone, and a reordered subset, gives the same bits.
    for r in [0, m / 2, m - 1] {
        let one = dev.upload_f32(&x[r * k..(r + 1) * k]).unwrap();
        let got = dev
            .download_f32(
                &dev.tree_matmul(&one, 1, k, &dw, n, layout.seg_len, SEGMENTS)
                    .unwrap(),
            )
            .unwrap();
        assert_eq!(
            bits(&got),
            bits(&full[r * n..(r + 1) * n]),
            "row {r} alone differs ({m}x{n}x{k})"
        );
    }

    // TP invariance: each rank's subtree root over its K shard, combined by the tree.
    for world in [2usize, 4, 8] {
        let mut roots = Vec::new();
        for rank in 0..world {
            let cols = layout.shard(rank, world);
            let kl = cols.len();
            let xs = dev.upload_f32(&columns(&x, m, k, cols.clone())).unwrap();
            let ws: Vec<bf16> = (0..n)
                .flat_map(|c| w[c * k + cols.start..c * k + cols.end].to_vec())
                .collect();
            let wsd = if ws.is_empty() {
                dev.zeros_bf16(0).unwrap()
            } else {
                dev.upload_bf16(&ws).unwrap()
            };
            let part = dev
                .tree_matmul(&xs, m, kl, &wsd, n, layout.seg_len, SEGMENTS / world)
                .unwrap();
            roots.extend(dev.download_f32(&part).unwrap());
        }
        let droots = dev.upload_f32(&roots).unwrap();
        let got = dev
            .download_f32(&dev.tree_combine(&droots, m * n, world).unwrap())
            .unwrap();
        assert_eq!(
            bits(&got),
            bits(&full),
            "TP={world} differs from TP=1 ({m}x{n}x{k})"
        );
    }
}

#[test]
fn matmul_is_batch_and_tp_invariant() {
    let Some(dev) = device() else { return };
    check_matmul(&dev, 13, 40, 300, 1); // ragged K: short last segment, scalar path
    check_matmul(&dev, 33, 24, 1024, 2); // aligned K: 16-byte path, row tiles of 8 + tail
    check_matmul(&dev, 3, 17, 9, 3); // K < 8 segments' worth: empty segments at high TP
}

#[test]
fn matmul_over_many_rows_matches_row_by_row() {
    let Some(dev) = device() else { return };
    // More rows than one launch chunk (256) must not change any row.
    let (m, n, k) = (300, 8, 64);
    let mut rng = Rng(9);
    let x = rng.vec(m * k, 1.0);
    let w = to_bf16(&rng.vec(n * k, 1.0));
    let (dx, dw) = (dev.upload_f32(&x).unwrap(), dev.upload_bf16(&w).unwrap());
    let seg = SegmentLayout::new(k).seg_len;
    let all = dev
        .download_f32(&dev.tree_matmul(&dx, m, k, &dw, n, seg, 8).unwrap())
        .unwrap();
    for r in [0, 255, 256, 299] {
        let one = dev.upload_f32(&x[r * k..(r + 1) * k]).unwrap();
        let got = dev
            .download_f32(&dev.tree_matmul(&one, 1, k, &dw, n, seg, 8).unwrap())
            .unwrap();
        assert_eq!(bits(&got), bits(&all[r * n..(r + 1) * n]), "row {r}");
    }
}

#[test]
fn rms_norm_rows_are_independent() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (9, 700);
    let mut rng = Rng(4);
    let x = rng.vec(rows * cols, 3.0);
    let w = rng.vec(cols, 1.0);
    let dw = dev.upload_f32(&w).unwrap();
    let all = dev
        .download_f32(
            &dev.rms_norm(&dev.upload_f32(&x).unwrap(), rows, cols, &dw, 1e-5, None)
                .unwrap(),
        )
        .unwrap();
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let got = dev
            .download_f32(
                &dev.rms_norm(&dev.upload_f32(row).unwrap(), 1, cols, &dw, 1e-5, None)
                    .unwrap(),
            )
            .unwrap();
        assert_eq!(bits(&got), bits(&all[r * cols..(r + 1) * cols]), "row {r}");
        let ms: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / cols as f64;
        let inv = 1.0 / (ms + 1e-5).sqrt();
        let reference: Vec<f64> = row
            .iter()
            .zip(&w)
            .map(|(&v, &g)| v as f64 * inv * g as f64)
            .collect();
        let err = rel_err(&got, &reference, 1e-3);
        assert!(err < 1e-5, "row {r}: relative error {err}");
    }
}

/// The GPU RMSNorm's bits defined on the host (kernels/cuda/norm.cu): thread t of 256 sums
/// x[c]² over c = t, t + 256, … with fused multiply-adds in order, then the pairwise tree
/// sh[t] + sh[t + s] for s = 128, …, 1; `1 / sqrt(Σ / cols + eps)`, then `(x · inv) · w`.
fn rms_norm_block_order(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let cols = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(cols) {
        // Thread t's values in its order: 4-column groups t, t + 256, ... for widths of a
        // multiple of 4 up to 8192 (norm.cu's 16-byte path), else columns t, t + 256, ...
        let vec = cols.is_multiple_of(4) && cols <= 8192;
        let mut sh: Vec<f32> = (0..256)
            .map(|t| {
                let mine: Vec<f32> = if vec {
                    row.chunks_exact(4)
                        .skip(t)
                        .step_by(256)
                        .flatten()
                        .copied()
                        .collect()
                } else {
                    row.iter().skip(t).step_by(256).copied().collect()
                };
                mine.iter().fold(0.0f32, |acc, &v| v.mul_add(v, acc))
            })
            .collect();
        let mut s = 128;
        while s > 0 {
            for t in 0..s {
                sh[t] += sh[t + s];
            }
            s /= 2;
        }
        let inv = 1.0f32 / (sh[0] / cols as f32 + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| (v * inv) * g));
    }
    out
}

#[test]
fn rms_norm_is_the_block_order_on_the_host() {
    let Some(dev) = device() else { return };
    let mut rng = Rng(12);
    // A warp per row (16, 64, 100, 128: a multiple of 4 up to 128, attention heads), the
    // 16-byte path (700, 4096: 4 groups of 4 a thread), the scalar register path (702,
    // 4094: not a multiple of 4; 130), and wider than the registers hold (the looping
    // path).
    for cols in [16usize, 64, 100, 128, 130, 700, 702, 4094, 4096, 9000] {
        // Warp rows: more than one block of them, the last block partly empty.
        let rows = if cols <= 128 { 37 } else { 3 };
        let (x, y, w) = (
            rng.vec(rows * cols, 3.0),
            rng.vec(rows * cols, 3.0),
            rng.vec(cols, 1.0),
        );
        let dw = dev.upload_f32(&w).unwrap();
        let got = dev
            .download_f32(
                &dev.rms_norm(&dev.upload_f32(&x).unwrap(), rows, cols, &dw, 1e-5, None)
                    .unwrap(),
            )
            .unwrap();
        assert_eq!(
            bits(&got),
            bits(&rms_norm_block_order(&x, &w, 1e-5)),
            "rms_norm, {cols} columns"
        );
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        let mut dx = dev.upload_f32(&x).unwrap();
        let got = dev
            .add_rms_norm(
                &mut dx,
                &dev.upload_f32(&y).unwrap(),
                rows,
                cols,
                &dw,
                1e-5,
                None,
            )
            .unwrap();
        assert_eq!(
            bits(&dev.download_f32(&dx).unwrap()),
            bits(&sum),
            "x + y, {cols} columns"
        );
        assert_eq!(
            bits(&dev.download_f32(&got).unwrap()),
            bits(&rms_norm_block_order(&sum, &w, 1e-5)),
            "add_rms_norm, {cols} columns"
        );
    }
}

#[test]
fn rope_matches_the_host_table_bitwise() {
    let Some(dev) = device() else { return };
    let (hd, n_heads, max_pos) = (64, 3, 50);
    let table = crate::cpu::RopeTable::new(hd, max_pos, 10000.0, None);
    let positions = [0usize, 7, 49, 3];
    let mut rng = Rng(5);
    let x = rng.vec(positions.len() * n_heads * hd, 1.0);
    let mut host = x.clone();
    table.apply(&mut host, n_heads, &positions);
    let mut dx = dev.upload_f32(&x).unwrap();
    let (cos, sin) = (
        dev.upload_f32(&table.cos).unwrap(),
        dev.upload_f32(&table.sin).unwrap(),
    );
    let pos32: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
    let meta = dev.row_meta(&pos32, &vec![0; pos32.len()], &[0]).unwrap();
    dev.rope(&mut dx, &cos, &sin, hd / 2, &meta, n_heads, hd)
        .unwrap();
    // Same formula, no fused operations on either side: the same bits.
    assert_eq!(bits(&dev.download_f32(&dx).unwrap()), bits(&host));
}

#[test]
fn add_rms_norm_is_add_then_norm_bitwise() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (5, 700);
    let mut rng = Rng(11);
    let (x, y, w) = (
        rng.vec(rows * cols, 3.0),
        rng.vec(rows * cols, 3.0),
        rng.vec(cols, 1.0),
    );
    let dw = dev.upload_f32(&w).unwrap();
    let dy = dev.upload_f32(&y).unwrap();
    let mut sep = dev.upload_f32(&x).unwrap();
    dev.add_assign(&mut sep, &dy).unwrap();
    let want = dev.rms_norm(&sep, rows, cols, &dw, 1e-5, None).unwrap();
    let mut fused = dev.upload_f32(&x).unwrap();
    let mut gotb = dev.zeros_bf16(rows * cols).unwrap();
    let got = dev
        .add_rms_norm(&mut fused, &dy, rows, cols, &dw, 1e-5, Some(&mut gotb))
        .unwrap();
    // The companion bf16 output is the GEMM's own conversion of the f32 output.
    let mut conv = dev.zeros_bf16(rows * cols).unwrap();
    dev.f32_to_bf16_into(&got, &mut conv).unwrap();
    assert_eq!(
        dev.download_bf16(&gotb).unwrap(),
        dev.download_bf16(&conv).unwrap(),
        "bf16 companion"
    );
    assert_eq!(
        bits(&dev.download_f32(&fused).unwrap()),
        bits(&dev.download_f32(&sep).unwrap()),
        "the residual sum"
    );
    assert_eq!(
        bits(&dev.download_f32(&got).unwrap()),
        bits(&dev.download_f32(&want).unwrap()),
        "the norm"
    );
}

#[test]
fn qkv_rope_kv_is_split_rope_and_kv_write_bitwise() {
    let Some(dev) = device() else { return };
    // head_dim 64: four values a thread (qkv_rope_kv4_kernel); 6: one (half = 3).
    for hd in [64usize, 6] {
        check_qkv_rope_kv(&dev, hd);
    }
}

fn check_qkv_rope_kv(dev: &GpuDevice, hd: usize) {
    let (n_heads, n_kv, max_pos) = (6usize, 2usize, 40usize);
    let table = crate::cpu::RopeTable::new(hd, max_pos, 10000.0, None);
    let (cos, sin) = (
        dev.upload_f32(&table.cos).unwrap(),
        dev.upload_f32(&table.sin).unwrap(),
    );
    let layout = crate::paged::PagedKvLayout {
        layers: 2,
        blocks: 4,
        n_kv_heads: n_kv,
        head_dim: hd,
    };
    // Two rows of one sequence (table [3]), one at position 0 of another ([1]), one at 39
    // of a third ([0]).
    let (pos, toff, tables) = ([5u32, 6, 0, 39], [0u32, 0, 1, 2], [3u32, 1, 0]);
    let meta = dev.row_meta(&pos, &toff, &tables).unwrap();
    let rows = pos.len();
    let (qd, kd) = (n_heads * hd, n_kv * hd);
    let cols = qd + 2 * kd;
    let qkv = dev.upload_f32(&Rng(12).vec(rows * cols, 2.0)).unwrap();

    let mut q = dev.copy_cols(&qkv, rows, cols, 0, qd).unwrap();
    let mut k = dev.copy_cols(&qkv, rows, cols, qd, kd).unwrap();
    let v = dev.copy_cols(&qkv, rows, cols, qd + kd, kd).unwrap();
    dev.rope(&mut q, &cos, &sin, hd / 2, &meta, n_heads, hd)
        .unwrap();
    dev.rope(&mut k, &cos, &sin, hd / 2, &meta, n_kv, hd)
        .unwrap();
    let (mut kc, mut vc) = (
        dev.zeros_bf16(layout.len()).unwrap(),
        dev.zeros_bf16(layout.len()).unwrap(),
    );
    dev.kv_write(&mut kc, &mut vc, layout, 1, &k, &v, &meta)
        .unwrap();

    let (mut kf, mut vf) = (
        dev.zeros_bf16(layout.len()).unwrap(),
        dev.zeros_bf16(layout.len()).unwrap(),
    );
    let qf = dev
        .qkv_rope_kv(
            &qkv, &mut kf, &mut vf, layout, 1, &cos, &sin, &meta, n_heads, n_kv, hd,
        )
        .unwrap();
    assert_eq!(
        bits(&dev.download_f32(&qf).unwrap()),
        bits(&dev.download_f32(&q).unwrap()),
        "q, head_dim {hd}"
    );
    assert_eq!(
        dev.download_bf16(&kf).unwrap(),
        dev.download_bf16(&kc).unwrap(),
        "k cache, head_dim {hd}"
    );
    assert_eq!(
        dev.download_bf16(&vf).unwrap(),
        dev.download_bf16(&vc).unwrap(),
        "v cache, head_dim {hd}"
    );
}

#[test]
fn elementwise_kernels() {
    let Some(dev) = device() else { return };
    let mut rng = Rng(6);
    let (rows, cols) = (5, 33);
    let g = rng.vec(rows * cols, 4.0);
    let u = rng.vec(rows * cols, 1.0);
    let out = dev
        .download_f32(
            &dev.silu_mul(&dev.upload_f32(&g).unwrap(), &dev.upload_f32(&u).unwrap())
                .unwrap(),
        )
        .unwrap();
    for i in 0..g.len() {
        let r = g[i] as f64 / (1.0 + (-g[i] as f64).exp()) * u[i] as f64;
        assert!(
            (out[i] as f64 - r).abs() <= 1e-6 * r.abs().max(1.0),
            "silu_mul[{i}]"
        );
    }
    let table = to_bf16(&rng.vec(10 * cols, 1.0));
    let ids = [3u32, 0, 9, 3];
    let emb = dev
        .download_f32(
            &dev.embedding(&dev.upload_bf16(&table).unwrap(), cols, &ids)
                .unwrap(),
        )
        .unwrap();
    for (r, &id) in ids.iter().enumerate() {
        let want: Vec<f32> = table[id as usize * cols..(id as usize + 1) * cols]
            .iter()
            .map(|v| v.to_f32())
            .collect();
        assert_eq!(bits(&emb[r * cols..(r + 1) * cols]), bits(&want));
    }
    assert!(
        dev.embedding(&dev.upload_bf16(&table).unwrap(), cols, &[10])
            .is_err(),
        "id 10 of 10 accepted"
    );
    let dg = dev.upload_f32(&g).unwrap();
    let sel = dev
        .download_f32(&dev.select_rows(&dg, cols, &[4, 1]).unwrap())
        .unwrap();
    assert_eq!(bits(&sel[..cols]), bits(&g[4 * cols..5 * cols]));
    assert_eq!(bits(&sel[cols..]), bits(&g[cols..2 * cols]));
    // [world=2, rows, cols] → [rows, 2·cols]
    let il = dev
        .download_f32(&dev.interleave_cols(&dg, 1, rows, cols).unwrap())
        .unwrap();
    assert_eq!(bits(&il), bits(&g));
    let two: Vec<f32> = g.iter().chain(&u).copied().collect();
    let il = dev
        .download_f32(
            &dev.interleave_cols(&dev.upload_f32(&two).unwrap(), 2, rows, cols)
                .unwrap(),
        )
        .unwrap();
    for r in 0..rows {
        assert_eq!(
            bits(&il[r * 2 * cols..r * 2 * cols + cols]),
            bits(&g[r * cols..(r + 1) * cols])
        );
        assert_eq!(
            bits(&il[r * 2 * cols + cols..(r + 1) * 2 * cols]),
            bits(&u[r * cols..(r + 1) * cols])
        );
    }
}

/// The paged KV write (fused with RoPE) into shuffled blocks, then the paged attention
/// kernels over them: within bf16 tolerance of the CPU backend's attention over the same
/// (downloaded) pool, and the same bits whether the rows come as one prefill or one by one.
#[test]
fn paged_kv_write_then_attention_agrees_with_the_cpu() {
    let Some(dev) = device() else { return };
    for (n_heads, n_kv, hd, len) in [(4usize, 2usize, 64usize, 700usize), (6, 3, 32, 130)] {
        check_paged_write_attention(&dev, n_heads, n_kv, hd, len);
    }
}

fn check_paged_write_attention(
    dev: &GpuDevice,
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    len: usize,
) {
    use crate::cpu::{AttnShape, PagedKv};
    use crate::cuda::paged_attention::SeqSpan;
    use crate::paged::{blocks_for, PagedKvLayout};
    let nb = blocks_for(len);
    let layout = PagedKvLayout {
        layers: 2,
        blocks: nb + 2,
        n_kv_heads: n_kv,
        head_dim: hd,
    };
    // Blocks in reverse order, block 0 left out: the table decides where positions live.
    let table: Vec<u32> = (1..=nb as u32).rev().collect();
    let rope = crate::cpu::RopeTable::new(hd, len, 10000.0, None);
    let (cos, sin) = (
        dev.upload_f32(&rope.cos).unwrap(),
        dev.upload_f32(&rope.sin).unwrap(),
    );
    let pos: Vec<u32> = (0..len as u32).collect();
    let toff = vec![0u32; len];
    let meta = dev.row_meta(&pos, &toff, &table).unwrap();
    let cols = (n_heads + 2 * n_kv) * hd;
    let qkv = dev.upload_f32(&Rng(21).vec(len * cols, 2.0)).unwrap();
    let (mut kc, mut vc) = (
        dev.zeros_bf16(layout.len()).unwrap(),
        dev.zeros_bf16(layout.len()).unwrap(),
    );
    let q = dev
        .qkv_rope_kv(
            &qkv, &mut kc, &mut vc, layout, 1, &cos, &sin, &meta, n_heads, n_kv, hd,
        )
        .unwrap();
    let scale = 1.0 / (hd as f32).sqrt();
    let span = [SeqSpan {
        row0: 0,
        len,
        pos0: 0,
        table0: 0,
    }];
    let routing = dev.attn_routing(&span, hd).unwrap();
    let prefill = dev
        .paged_attention(
            &q,
            &kc,
            &vc,
            layout,
            1,
            &meta.paged(),
            &routing,
            n_heads,
            scale,
            None,
        )
        .unwrap();
    let prefill = dev.download_f32(&prefill).unwrap();

    // The CPU's attention over the GPU's pool and q.
    let (hq, hk, hv) = (
        dev.download_f32(&q).unwrap(),
        dev.download_bf16(&kc).unwrap(),
        dev.download_bf16(&vc).unwrap(),
    );
    let kv = PagedKv {
        k: &hk,
        v: &hv,
        layout,
        layer: 1,
        table: &table,
    };
    let shape = AttnShape {
        n_heads,
        n_kv_heads: n_kv,
        head_dim: hd,
        scale,
    };
    // The GPU rounds q to bf16 before its dot products (paged_attention.cu): the CPU gets
    // the same q, so what differs is the GPU's bf16 P and its mma sums. Compared as a
    // relative L2 norm: with scores of ±30 the softmax is sharp, and single small outputs
    // carry relative errors no norm shows.
    let hq16: Vec<f32> = hq
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect();
    let mut cpu = vec![0.0f32; hq.len()];
    crate::cpu::attention(&hq16, 0, &kv, shape, &mut cpu);
    let num: f64 = prefill
        .iter()
        .zip(&cpu)
        .map(|(&g, &c)| (g as f64 - c as f64).powi(2))
        .sum();
    let den: f64 = cpu.iter().map(|&c| (c as f64).powi(2)).sum();
    let err = (num / den.max(1e-30)).sqrt();
    assert!(
        err < 8e-3,
        "{n_heads}/{n_kv} heads of {hd}, {len} rows: GPU vs CPU relative L2 {err}"
    );
    println!("paged write + attention, {n_heads}/{n_kv} heads of {hd}, {len} rows: GPU vs CPU relative L2 {err:.2e}");

    // The last rows one by one (the decode kernel, splits past 512) against the prefill.
    let w = n_heads * hd;
    for p in [len - 1, len / 2, 0] {
        let one = dev.row_meta(&[p as u32], &[0], &table).unwrap();
        let r = dev.attn_routing_decode(
            1,
            crate::cuda::paged_attention::AttnRouting::split_bucket(p + 1),
        );
        let qp = dev.upload_f32(&hq[p * w..(p + 1) * w]).unwrap();
        let got = dev
            .paged_attention(
                &qp,
                &kc,
                &vc,
                layout,
                1,
                &one.paged(),
                &r,
                n_heads,
                scale,
                None,
            )
            .unwrap();
        assert_eq!(
            bits(&dev.download_f32(&got).unwrap()),
            bits(&prefill[p * w..(p + 1) * w]),
            "position {p}: decode vs prefill"
        );
    }
}

#[test]
fn row_stats_match_the_host_definitions_and_not_the_batch() {
    use crate::cpu::RowDraw;
    let Some(dev) = device() else { return };
    let (vocab, cols) = (128_256usize, 128_260usize);
    let mut rng = Rng(9);
    let mut rows = [
        rng.vec(cols, 6.0),
        rng.vec(cols, 6.0),
        rng.vec(cols, 6.0),
        rng.vec(cols, 3.0),
    ];
    // Ties resolve to the lowest index; NaN never wins; padding past the vocab is ignored.
    rows[1][77] = 50.0;
    rows[1][9_000] = 50.0;
    rows[1][5] = f32::NAN;
    rows[2][vocab + 1] = 1e9;
    let flat: Vec<f32> = rows.concat();
    let pick = [3u32, 127_999, u32::MAX, 10];
    let x = dev.upload_f32(&flat).unwrap();
    let draw = |t: f32, key: u64| {
        RowDraw::Gumbel(crate::cpu::GumbelDraw {
            inv_t: 1.0 / t,
            key,
        })
    };
    let nucleus = |t: f32| RowDraw::Nucleus { inv_t: 1.0 / t };
    let draws = [draw(0.8, 11), nucleus(0.9), draw(1.5, 12), nucleus(0.7)];
    let got = dev.row_stats(&x, 4, cols, vocab, &pick, &draws).unwrap();
    for (r, s) in got.iter().enumerate() {
        let row = &rows[r][..vocab];
        let am = crate::cpu::argmax(row);
        assert_eq!(s.argmax as usize, am, "row {r}");
        assert_eq!(s.max.to_bits(), row[am].to_bits());
        assert_eq!(
            s.digest,
            crate::cpu::digest(row),
            "row {r}: digest ≠ host definition"
        );
        match pick[r] {
            u32::MAX => assert!(s.picked.is_nan()),
            p => assert_eq!(s.picked.to_bits(), row[p as usize].to_bits()),
        }
        match draws[r] {
            RowDraw::Gumbel(d) => {
                // The device's logf may differ from the host's ln in the last bit: the
                // draw is the host's, or a perturbed value within rounding of the host's.
                let want = crate::cpu::gumbel_argmax(row, d);
                let key = |i: usize| crate::cpu::gumbel::gumbel_key(row[i], i, d);
                let got = s.sampled as usize;
                assert!(
                    got == want || (key(got) - key(want)).abs() <= 1e-5 * key(want).abs(),
                    "row {r}: drew {got} (key {}), host {want} (key {})",
                    key(got),
                    key(want)
                );
                assert_eq!(s.sampled_value.to_bits(), row[got].to_bits());
                assert!(s.tempered_sum.is_nan(), "row {r}: no tempered sum asked");
            }
            RowDraw::Nucleus { inv_t } => {
                assert_eq!(s.sampled, u32::MAX, "row {r}");
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let want: f64 = row
                    .iter()
                    .map(|&v| (v as f64 * inv_t as f64 - m * inv_t as f64).exp())
                    .sum();
                if row.iter().any(|v| v.is_nan()) {
                    assert!(s.tempered_sum.is_nan(), "row {r}: a NaN logit");
                } else {
                    assert!(
                        (s.tempered_sum as f64 - want).abs() < 1e-4 * want,
                        "row {r}: tempered sum {} vs {want}",
                        s.tempered_sum
                    );
                    let host = crate::cpu::tempered_sum(row, inv_t) as f64;
                    assert!((host - want).abs() < 1e-3 * want, "host {host} vs {want}");
                }
            }
            RowDraw::None => unreachable!(),
        }
        if r != 1 {
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            assert!(
                (s.lse as f64 - lse).abs() < 1e-4,
                "row {r}: lse {} vs {lse}",
                s.lse
            );
        }
    }
    assert_eq!(got[1].argmax, 77);
    // A row alone gives the bits it gives in the batch.
    for r in [2, 3] {
        let one = dev.upload_f32(&rows[r]).unwrap();
        let alone = dev
            .row_stats(&one, 1, cols, vocab, &[pick[r]], &[draws[r]])
            .unwrap();
        assert_eq!(
            alone[0].sampled, got[r].sampled,
            "row {r}: draw alone ≠ in the batch"
        );
        assert_eq!(alone[0].lse.to_bits(), got[r].lse.to_bits());
        assert_eq!(alone[0].digest, got[r].digest);
        assert_eq!(
            alone[0].tempered_sum.to_bits(),
            got[r].tempered_sum.to_bits(),
            "row {r}: tempered sum alone ≠ in the batch"
        );
    }
}

/// The host definition of `top_k_select`: every non-NaN index sorted by value (total
/// order, descending), lowest index first on ties, the first `k` (sampling::sorted_desc).
fn top_k_host(row: &[f32], k: usize) -> Vec<(u32, u32)> {
    let mut idx: Vec<usize> = (0..row.len()).filter(|&i| !row[i].is_nan()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx.into_iter()
        .map(|i| (i as u32, row[i].to_bits()))
        .collect()
}

#[test]
fn top_k_select_is_the_sorted_order_with_ties_and_nan() {
    let Some(dev) = device() else { return };
    let mut rng = Rng(31);
    // A vocabulary row with bf16-like ties, one with few distinct values (±0, ±inf, NaN),
    // a row of NaN, and a short row whose padding past the vocabulary must not count.
    let (vocab, cols) = (128_256usize, 128_260usize);
    let bf16_like = |v: f32| bf16::from_f32(v).to_f32();
    let mut r0: Vec<f32> = rng.vec(cols, 8.0).into_iter().map(bf16_like).collect();
    r0[100] = f32::NAN;
    r0[vocab + 2] = 1e30;
    const VALUES: [f32; 8] = [
        0.0,
        -0.0,
        1.5,
        -1.5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        7.0,
    ];
    let r1: Vec<f32> = (0..cols)
        .map(|i| VALUES[((i * 2654435761usize) >> 7) % VALUES.len()])
        .collect();
    let r2 = vec![f32::NAN; cols];
    let flat: Vec<f32> = [r0.clone(), r1.clone(), r2.clone()].concat();
    let x = dev.upload_f32(&flat).unwrap();
    let rows = [&r0[..vocab], &r1[..vocab], &r2[..vocab]];
    for k in [1usize, 2, 50, 1000, 1024] {
        let ks = [k, k, k];
        let got = dev.top_k_select(&x, 3, cols, vocab, &ks).unwrap();
        for (r, row) in rows.iter().enumerate() {
            let g: Vec<(u32, u32)> = got[r].iter().map(|&(i, v)| (i, v.to_bits())).collect();
            assert_eq!(g, top_k_host(row, k), "row {r}, k {k}");
        }
    }
    // Per-row k (0: none), and a row shorter than k.
    let small: Vec<f32> = [3.0f32, 1.0, 3.0, f32::NAN, -2.0, 3.0, 0.5].to_vec();
    let xs = dev.upload_f32(&small).unwrap();
    let got = dev.top_k_select(&xs, 1, 7, 7, &[50]).unwrap();
    let g: Vec<(u32, u32)> = got[0].iter().map(|&(i, v)| (i, v.to_bits())).collect();
    assert_eq!(g, top_k_host(&small, 50));
    let got = dev.top_k_select(&x, 3, cols, vocab, &[0, 3, 0]).unwrap();
    assert!(got[0].is_empty() && got[2].is_empty());
    assert_eq!(
        got[1].iter().map(|&(i, _)| i).collect::<Vec<_>>(),
        top_k_host(rows[1], 3)
            .iter()
            .map(|&(i, _)| i)
            .collect::<Vec<_>>()
    );
    assert!(dev.top_k_select(&x, 3, cols, vocab, &[1025, 1, 1]).is_err());
}

/// Inside a step scope the device lends its buffers from the workspace: a block given
/// back is the next one of its class, and a graph captured over lent buffers replays on
/// new inputs written into the same addresses (a recorded step's mechanism, buf.rs).
#[test]
fn lent_buffers_are_reused_and_a_captured_graph_replays_on_them() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(dev) = device() else { return };
    let owned = dev.empty_f32(1000).unwrap();
    assert!(!owned.is_lent(), "no scope: a buffer of its own");
    let (rows, cols) = (3, 700);
    let mut rng = Rng(77);
    let w: Vec<f32> = rng.vec(cols, 1.0);
    let weight = dev.upload_f32(&w).unwrap();
    let input = dev.upload_f32(&vec![0.0; rows * cols]).unwrap();
    let out = dev.upload_f32(&vec![f32::NAN; rows * cols]).unwrap();
    let (inp, outp) = (
        super::ops::dev_ptr(&input, &dev.stream),
        super::ops::dev_ptr(&out, &dev.stream),
    );
    let scope = dev.workspace.scope();
    let a = dev.empty_f32(rows * cols).unwrap();
    assert!(a.is_lent());
    let a_ptr = super::ops::dev_ptr(&a, &dev.stream);
    drop(a);
    let b = dev.empty_f32(rows * cols).unwrap();
    assert_eq!(
        super::ops::dev_ptr(&b, &dev.stream),
        a_ptr,
        "the block given back comes first"
    );
    drop(b);
    // Capture: copy the input into a lent buffer, RMSNorm it (lent output), copy out.
    dev.stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    let run = || -> Result<(), super::CudaError> {
        let mut x = dev.empty_f32(rows * cols)?;
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                super::ops::dev_ptr(&x, &dev.stream),
                inp,
                4 * rows * cols,
                dev.stream.cu_stream(),
            )
        }
        .unwrap();
        dev.add_assign(&mut x, &input)?;
        let y = dev.rms_norm(&x, rows, cols, &weight, 1e-5, None)?;
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                outp,
                super::ops::dev_ptr(&y, &dev.stream),
                4 * rows * cols,
                dev.stream.cu_stream(),
            )
        }
        .unwrap();
        Ok(())
    };
    run().unwrap();
    let graph = dev
        .stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    drop(scope);
    let (used, lent) = dev.workspace.usage();
    assert!(
        used > 0 && lent == 0,
        "every lent block came back ({used}, {lent})"
    );
    for seed in [1u64, 2, 3] {
        let x = Rng(seed).vec(rows * cols, 3.0);
        unsafe { dev.write_raw(inp, &x) }.unwrap();
        graph.launch().unwrap();
        let got = dev.download_f32(&out).unwrap();
        // The same ops, eagerly, on x + x.
        let x2: Vec<f32> = x.iter().map(|v| v + v).collect();
        let want = dev
            .download_f32(
                &dev.rms_norm(
                    &dev.upload_f32(&x2).unwrap(),
                    rows,
                    cols,
                    &weight,
                    1e-5,
                    None,
                )
                .unwrap(),
            )
            .unwrap();
        assert_eq!(bits(&got), bits(&want), "replay with seed {seed}");
    }
}

/// A weight uploaded chunk by chunk through the page-locked buffers (several chunks, rows
/// that do not divide a chunk, buffers reused across weights) holds the bits one
/// pageable copy of it gives; a fill that fails stops the upload with its error and
/// leaves the buffers usable.
#[test]
fn chunked_upload_equals_one_copy() {
    let Some(dev) = device() else { return };
    let mut rng = Rng(0x5eed);
    for (n, k) in [(3, 5), (9000, 4100), (40_000, 4096), (1, 1)] {
        let host = to_bf16(&rng.vec(n * k, 3.0));
        let calls = std::cell::Cell::new(0);
        let up = dev
            .upload_bf16_rows(n, k, |rows, dst: &mut [bf16]| {
                calls.set(calls.get() + 1);
                dst.copy_from_slice(&host[rows.start * k..rows.end * k]);
                Ok::<(), String>(())
            })
            .unwrap_or_else(|e| panic!("[{n}, {k}]: {e:?}"));
        let want = dev.upload_bf16(&host).unwrap();
        assert_eq!(
            dev.download_bf16(&up).unwrap(),
            dev.download_bf16(&want).unwrap(),
            "[{n}, {k}]"
        );
        let rows_per = (crate::cuda::upload_ring::CHUNK_BYTES / 2 / k).max(1);
        assert_eq!(
            calls.get(),
            n.div_ceil(rows_per),
            "[{n}, {k}]: one fill per chunk"
        );
    }
    let e = dev
        .upload_bf16_rows(40_000, 4096, |rows, _dst: &mut [bf16]| {
            if rows.start > 0 {
                Err(format!("row {}", rows.start))
            } else {
                Ok(())
            }
        })
        .unwrap_err();
    assert!(
        matches!(e, crate::cuda::upload_ring::RowsUploadError::Fill(ref m) if m.starts_with("row ")),
        "{e:?}"
    );
    let host = to_bf16(&rng.vec(70_000 * 1024, 1.0));
    let up = dev
        .upload_bf16_rows(70_000, 1024, |rows, dst: &mut [bf16]| {
            dst.copy_from_slice(&host[rows.start * 1024..rows.end * 1024]);
            Ok::<(), String>(())
        })
        .unwrap();
    assert_eq!(dev.download_bf16(&up).unwrap(), host);
    assert!(dev.uploads.wait_seconds() >= 0.0);
}
