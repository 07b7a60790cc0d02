//! GPU tests of the paged attention kernels (skipped, saying why, without a GPU): every row
//! has the same bits from either prefill build (64-row and 96-row tiles; whole or chunked
//! at any offset), from the decode kernel with its splits, and inside any batch; and the
//! values agree with an f64 reference over the same bf16 inputs.

use half::bf16;

use super::*;
use crate::cuda::ops::DevU32;
use crate::cuda::GpuDevice;
use crate::paged::{blocks_for, PagedKvLayout};

fn device() -> Option<GpuDevice> {
    if let Err(e) = crate::cuda::probe::driver() {
        eprintln!("skipped: {e}");
        return None;
    }
    Some(GpuDevice::open(0).unwrap_or_else(|e| panic!("a GPU is present but cannot be used: {e}")))
}

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        ((self.f() + 1.0) * 0.5 * n as f32) as usize % n
    }
}

/// A cache with one sequence of `len` positions in shuffled blocks; every other value of
/// the pool is NaN (a kernel that reads past what it may see turns rows into NaN).
struct Case {
    layout: PagedKvLayout,
    n_heads: usize,
    q: Vec<f32>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    table: Vec<u32>,
}

impl Case {
    fn new(n_heads: usize, n_kv_heads: usize, head_dim: usize, len: usize, seed: u64) -> Self {
        let mut rng = Rng(seed);
        let nb = blocks_for(len);
        let layout = PagedKvLayout {
            layers: 2,
            blocks: nb + 3,
            n_kv_heads,
            head_dim,
        };
        let mut ids: Vec<u32> = (0..layout.blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let table = ids[..nb].to_vec();
        let nan = bf16::from_bits(0x7fc0);
        let (mut k, mut v) = (vec![nan; layout.len()], vec![nan; layout.len()]);
        let layer = 1;
        for p in 0..len {
            for h in 0..n_kv_heads {
                let at = layout.at(layer, table[p / KV_BLOCK] as usize, h, p % KV_BLOCK);
                for d in 0..head_dim {
                    k[at + d] = bf16::from_f32(rng.f() * 2.0);
                    v[at + d] = bf16::from_f32(rng.f());
                }
            }
        }
        let q = (0..len * n_heads * head_dim)
            .map(|_| rng.f() * 2.0)
            .collect();
        Case {
            layout,
            n_heads,
            q,
            k,
            v,
            table,
        }
    }

    fn scale(&self) -> f32 {
        1.0 / (self.layout.head_dim as f32).sqrt()
    }

    /// Row r (position r) by f64 arithmetic over the bf16 inputs (q rounded as the kernels do).
    fn reference_row(&self, r: usize) -> Vec<f64> {
        let (hd, nh, nkv) = (self.layout.head_dim, self.n_heads, self.layout.n_kv_heads);
        let mut out = vec![0.0; nh * hd];
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let qv: Vec<f64> = (0..hd)
                .map(|d| bf16::from_f32(self.q[(r * nh + h) * hd + d]).to_f64())
                .collect();
            let at = |p: usize| {
                self.layout
                    .at(1, self.table[p / KV_BLOCK] as usize, kvh, p % KV_BLOCK)
            };
            let s: Vec<f64> = (0..=r)
                .map(|p| {
                    (0..hd)
                        .map(|d| qv[d] * self.k[at(p) + d].to_f64())
                        .sum::<f64>()
                        * self.scale() as f64
                })
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
            for d in 0..hd {
                out[h * hd + d] = (0..=r)
                    .map(|p| (s[p] - mx).exp() / z * self.v[at(p) + d].to_f64())
                    .sum();
            }
        }
        out
    }
}

struct OnDevice {
    k: DevBf16,
    v: DevBf16,
}

fn upload(dev: &GpuDevice, c: &Case) -> OnDevice {
    let bits = |x: &[bf16]| x.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
    OnDevice {
        k: dev.upload("k", &bits(&c.k)).unwrap(),
        v: dev.upload("v", &bits(&c.v)).unwrap(),
    }
}

/// How a test step routes its rows.
#[derive(Clone, Copy, Debug)]
enum Route {
    /// Every row through the decode kernel, in this variant.
    Decode(DecodeBuild),
    /// Runs of at least 16 rows to this prefill build, the others to the decode kernel.
    Prefill(PrefillTiles),
}

/// Attention of the given (position, q row) list, whose rows form the given spans, with
/// the case's table for every span. Returns f32 `[rows, n_heads·head_dim]` and its bf16.
fn run(
    dev: &GpuDevice,
    c: &Case,
    kv: &OnDevice,
    positions: &[usize],
    spans: &[SeqSpan],
    route: Route,
) -> (Vec<f32>, Vec<u16>) {
    let w = c.n_heads * c.layout.head_dim;
    let q: Vec<f32> = positions
        .iter()
        .flat_map(|&p| c.q[p * w..(p + 1) * w].to_vec())
        .collect();
    let pos: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
    let toff = vec![0u32; positions.len()];
    check_tables(&pos, &toff, &c.table, c.layout.blocks).unwrap();
    let dq = dev.upload_f32(&q).unwrap();
    let dpos: DevU32 = dev.upload_u32(&pos).unwrap();
    let doff: DevU32 = dev.upload_u32(&toff).unwrap();
    let dtab: DevU32 = dev.upload_u32(&c.table).unwrap();
    let s = &dev.stream;
    let rows = unsafe {
        PagedRows::from_device(
            positions.len(),
            crate::cuda::ops::dev_ptr(&dpos, s),
            crate::cuda::ops::dev_ptr(&doff, s),
            crate::cuda::ops::dev_ptr(&dtab, s),
        )
    };
    let routing = match route {
        Route::Decode(st) => {
            let ms = positions
                .iter()
                .map(|&p| crate::paged::splits_of(p))
                .max()
                .unwrap_or(1);
            dev.attn_routing_decode(positions.len(), ms)
                .with_decode_build(st)
        }
        Route::Prefill(pt) => {
            let r = dev.attn_routing_with(spans, c.layout.head_dim, pt).unwrap();
            assert_eq!(r.prefill_tiles(), pt);
            r
        }
    };
    let mut outb = dev.empty_bf16(q.len()).unwrap();
    let out = dev
        .paged_attention(
            &dq,
            &kv.k,
            &kv.v,
            c.layout,
            1,
            &rows,
            &routing,
            c.n_heads,
            c.scale(),
            Some(&mut outb),
        )
        .unwrap();
    dev.synchronize().unwrap();
    (
        dev.download_f32(&out).unwrap(),
        dev.download("outb", &outb, outb.len()).unwrap(),
    )
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn check_shape(n_heads: usize, n_kv: usize, head_dim: usize, len: usize, seed: u64) {
    let Some(dev) = device() else { return };
    let c = Case::new(n_heads, n_kv, head_dim, len, seed);
    let kv = upload(&dev, &c);
    // Every prefill build that runs on the device at this head dim.
    for pt in PrefillTiles::ALL
        .into_iter()
        .filter(|pt| pt.runs(&dev.arch, head_dim))
    {
        check_build(&dev, &c, &kv, len, pt);
    }
}

/// The checks of [`check_shape`] with prefill build `pt`.
fn check_build(dev: &GpuDevice, c: &Case, kv: &OnDevice, len: usize, pt: PrefillTiles) {
    let head_dim = c.layout.head_dim;
    let w = c.n_heads * head_dim;
    let all: Vec<usize> = (0..len).collect();
    let whole = [SeqSpan {
        row0: 0,
        len,
        pos0: 0,
        table0: 0,
    }];
    let (pre, preb) = run(dev, c, kv, &all, &whole, Route::Prefill(pt));
    assert!(
        pre.iter().all(|x| x.is_finite()),
        "hd {head_dim} {pt:?}: non-finite output (read past the keys?)"
    );

    // Against f64, on a spread of rows (the first, across blocks and splits, the last).
    let mut worst = 0.0f64;
    for r in (0..len).step_by(97).chain([len - 1]) {
        let want = c.reference_row(r);
        let got = &pre[r * w..(r + 1) * w];
        let num: f64 = got
            .iter()
            .zip(&want)
            .map(|(&g, &x)| (g as f64 - x).powi(2))
            .sum();
        let den: f64 = want.iter().map(|x| x * x).sum();
        worst = worst.max((num / den.max(1e-30)).sqrt());
    }
    assert!(
        worst < 8e-3,
        "hd {head_dim} {pt:?}: relative error {worst} vs f64"
    );

    // Every row through the decode kernel (splits, combine), in each of its builds (how
    // many warps share a block, how far ahead it loads): the same bits.
    for build in DecodeBuild::ALL {
        if padded_head_dim(c.layout.head_dim)
            .and_then(|hd| decode_kernel(hd, build))
            .is_none()
        {
            continue;
        }
        let (dec, decb) = run(dev, c, kv, &all, &whole, Route::Decode(build));
        if let Some(i) = (0..pre.len()).find(|&i| pre[i].to_bits() != dec[i].to_bits()) {
            panic!(
                "hd {head_dim}: decode ({build:?} build) differs from prefill ({pt:?}) at row {}, value {} ({} vs {})",
                i / w,
                i % w,
                dec[i],
                pre[i]
            );
        }
        assert_eq!(
            preb, decb,
            "hd {head_dim}: bf16 outputs differ ({build:?} build, {pt:?})"
        );
    }

    // A chunk at an unaligned offset (a chunked prefill after a cached prefix), and the
    // rows of several sequences in one batch in another order.
    let (a, b) = (37.min(len - 1), (len * 2 / 3).max(38.min(len)));
    let chunk: Vec<usize> = (a..b).collect();
    let span = [SeqSpan {
        row0: 0,
        len: chunk.len(),
        pos0: a,
        table0: 0,
    }];
    let (ch, _) = run(dev, c, kv, &chunk, &span, Route::Prefill(pt));
    assert_eq!(
        bits(&ch),
        bits(&pre[a * w..b * w]),
        "hd {head_dim} {pt:?}: chunk {a}..{b}"
    );

    let mixed_pos: Vec<usize> = [len - 1, 3, 5, 6, 7]
        .into_iter()
        .chain(len / 2..len / 2 + 20)
        .filter(|&p| p < len)
        .collect();
    let spans: Vec<SeqSpan> = {
        let mut v = Vec::new();
        for (i, &p) in mixed_pos.iter().enumerate() {
            // Consecutive positions stay one span (the 20-row run becomes prefill tiles).
            if i > 0 && mixed_pos[i - 1] + 1 == p {
                let last: &mut SeqSpan = v.last_mut().unwrap();
                last.len += 1;
            } else {
                v.push(SeqSpan {
                    row0: i,
                    len: 1,
                    pos0: p,
                    table0: 0,
                });
            }
        }
        v
    };
    let (mx, _) = run(dev, c, kv, &mixed_pos, &spans, Route::Prefill(pt));
    for (i, &p) in mixed_pos.iter().enumerate() {
        assert_eq!(
            bits(&mx[i * w..(i + 1) * w]),
            bits(&pre[p * w..(p + 1) * w]),
            "hd {head_dim} {pt:?}: batch row {i} (position {p})"
        );
    }
}

#[test]
fn paged_attention_hd128_gqa4_three_splits() {
    check_shape(8, 2, 128, 1100, 1);
}

#[test]
fn paged_attention_hd64_nine_heads_three_kv() {
    check_shape(9, 3, 64, 700, 2);
}

#[test]
fn paged_attention_small_and_padded_head_dims() {
    check_shape(4, 4, 32, 600, 3);
    check_shape(8, 4, 16, 300, 4);
    check_shape(4, 2, 20, 530, 5);
    check_shape(2, 1, 6, 90, 6);
    // Padded to 128: every head-dim-128 build (the parallel one too) on rows of 104
    // values and 24 zero columns.
    check_shape(8, 2, 104, 700, 9);
}

#[test]
fn paged_attention_group_of_32_heads_and_hd256() {
    check_shape(32, 1, 128, 200, 7);
    check_shape(4, 2, 256, 600, 8);
}
