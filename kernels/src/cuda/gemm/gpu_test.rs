//! GPU test of every path of the tree GEMM: calls of different shapes — the full
//! reduction, TP shards (fewer segments), a column shard of W, another M — share one
//! workspace and one counter buffer, as they do in the model, and must still give the full
//! result's bits. Outputs are poisoned (NaN) before every call so that an element a call
//! leaves unwritten cannot pass, and the result is also checked against the host tree
//! matmul within bf16 tolerance so that NaN = NaN cannot pass either. Skips, saying why,
//! where no GPU is usable.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::*;
use crate::cpu::matmul::tree_matmul;
use crate::tree::{combine_roots, SegmentLayout, SEGMENTS};

struct Bufs {
    stream: Arc<CudaStream>,
    x: CudaSlice<u16>,
    w: CudaSlice<u16>,
    out: CudaSlice<f32>,
    ws: CudaSlice<f32>,
    cnt: CudaSlice<u32>,
    k: usize,
}

impl Bufs {
    fn p<T>(&self, s: &CudaSlice<T>) -> CUdeviceptr {
        s.device_ptr(&self.stream).0
    }

    /// One call on X rows from `x_row`, W rows from `w_row`, K columns from `k_off`.
    fn call(
        &self,
        tg: &TreeGemm,
        path: Path,
        shape: TreeMatmul,
        (x_row, w_row, k_off): (usize, usize, usize),
    ) -> Vec<f32> {
        let out = self.p(&self.out);
        // SAFETY: `out` is a live allocation of out.len() f32 on this stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                out,
                0xFF,
                self.out.len() * 4,
                self.stream.cu_stream(),
            )
        }
        .unwrap_or_else(|e| panic!("memset: {e}"));
        let a = GemmArgs {
            shape,
            x: self.p(&self.x) + ((x_row * self.k + k_off) * 2) as u64,
            ldx: self.k,
            // Every row from x_row on may be read: the rows past M are other data, which
            // must not reach the M rows' bits (the row checks compare them).
            x_rows: self.x.len() / self.k - x_row,
            w: self.p(&self.w) + ((w_row * self.k + k_off) * 2) as u64,
            ldw: self.k,
            out,
            out_dtype: OutDtype::F32,
            ws: self.p(&self.ws),
            ws_len: self.ws.len(),
            counters: self.p(&self.cnt),
            counters_len: self.cnt.len(),
            w_constant: true,
            epilogue: Epilogue::Store,
        };
        // SAFETY: the test's shapes lie inside the buffers (asserted by their sizes below).
        unsafe { tg.launch(&self.stream, &a, Some(path)) }
            .unwrap_or_else(|e| panic!("{} {shape:?}: {e}", path.name()));
        let mut y = self
            .stream
            .clone_dtoh(&self.out)
            // A kernel fault surfaces here, at the call's own synchronisation.
            .unwrap_or_else(|e| {
                let at = (x_row, w_row, k_off);
                panic!("{} {shape:?} at {at:?}: {e}", path.name())
            });
        y.truncate(shape.m * shape.n);
        y
    }
}

/// `call` with the persistent kernels taking their tiles by column on a device of three
/// SMs, as the test counts them (three blocks, each taking many columns in turn, its last
/// row tile partial where M is not a multiple of 128); `tg` as it was afterwards.
fn by_column<T>(tg: &mut TreeGemm, call: impl FnOnce(&TreeGemm) -> T) -> T {
    let (order, sms) = (tg.column_order_rows.replace(usize::MAX), tg.sms);
    tg.sms = 3;
    let out = call(tg);
    (tg.column_order_rows, tg.sms) = (order, sms);
    out
}

/// `call` on a device of `sms` SMs, as the test counts them, with the persistent kernels'
/// tail split on or off; `tg` as it was afterwards. On five blocks a call whose last
/// round holds one or two tiles splits them (q/k/v at 129 rows: 96 tiles, 19 rounds and
/// 1), one of three or four does not (gate/up at 256 rows: 448 tiles, 89 rounds and 3).
fn on_blocks<T>(
    tg: &mut TreeGemm,
    sms: usize,
    tail_split: bool,
    call: impl FnOnce(&TreeGemm) -> T,
) -> T {
    let (old_split, old_sms) = (std::mem::replace(&mut tg.tail_split, tail_split), tg.sms);
    tg.sms = sms;
    let out = call(tg);
    (tg.tail_split, tg.sms) = (old_split, old_sms);
    out
}

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!("{what}: element {i}: {:e} vs {:e}", got[i], want[i]);
    }
}

fn rng_bf16(len: usize, mut s: u64) -> Vec<u16> {
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            bf16::from_f32(v).to_bits()
        })
        .collect()
}

#[test]
fn calls_of_any_shape_share_workspace_and_counters() {
    if let Err(e) = probe() {
        eprintln!("skipped: {e}");
        return;
    }
    let ctx = CudaContext::new(0).unwrap_or_else(|e| panic!("a GPU is present but: {e}"));
    // SAFETY: every buffer is used on this one stream only.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap_or_else(|e| panic!("{e}"));
    let tg = TreeGemm::new(&ctx).unwrap_or_else(|e| panic!("{e}"));
    // K = 1024: seg_len 128, two 64-column tiles per segment; K = 320: seg_len 40, one
    // tile whose last k16 chunk crosses the segment end (zero-filled) and whose last
    // chunk is not issued; K = 128: seg_len 16 (the tiny model's q/k/v).
    for k in [1024usize, 320, 128] {
        check_all_paths(&tg, &stream, k);
    }
}

fn check_all_paths(tg: &TreeGemm, stream: &Arc<CudaStream>, k: usize) {
    // N = 200: partial column tiles of 64 and 128.
    let (m, n) = (3usize, 200usize);
    let layout = SegmentLayout::new(k);
    let x_host = rng_bf16((m + 8) * k, 7);
    let w_host = rng_bf16(n * k, 11);
    let m_big = 70; // two row tiles of the 64-row split paths
    let paths: Vec<Path> = [Family::Mma, Family::Wgmma]
        .into_iter()
        .flat_map(|f| Path::all(f).iter().copied())
        .filter(|p| tg.has(*p))
        .collect();
    let x_big = rng_bf16(m_big * k, 13);
    let mut x_all = x_host.clone();
    x_all.extend_from_slice(&x_big);
    let b = Bufs {
        x: stream.clone_htod(&x_all).unwrap_or_else(|e| panic!("{e}")),
        w: stream.clone_htod(&w_host).unwrap_or_else(|e| panic!("{e}")),
        out: stream
            .alloc_zeros(m_big * n)
            .unwrap_or_else(|e| panic!("{e}")),
        ws: stream
            .alloc_zeros(SEGMENTS * m_big * n)
            .unwrap_or_else(|e| panic!("{e}")),
        cnt: stream
            .alloc_zeros(
                paths
                    .iter()
                    .map(|p| p.counters_len(m_big, n))
                    .max()
                    .unwrap_or(0)
                    .max(1),
            )
            .unwrap_or_else(|e| panic!("{e}")),
        stream: stream.clone(),
        k,
    };
    let full = |m| TreeMatmul {
        m,
        n,
        k,
        seg_len: layout.seg_len,
        n_seg: SEGMENTS,
    };

    // Host reference (a different leaf, so within bf16 tolerance, not bits).
    let xb: Vec<bf16> = x_host[..m * k]
        .iter()
        .map(|&u| bf16::from_bits(u))
        .collect();
    let wb: Vec<bf16> = w_host.iter().map(|&u| bf16::from_bits(u)).collect();
    let mut y_host = vec![0.0f32; m * n];
    tree_matmul(&xb, &wb, full(m), &mut y_host);
    let scale = y_host.iter().fold(0.0f32, |a, v| a.max(v.abs()));

    for fam in [Family::Mma, Family::Wgmma] {
        let fam_paths: Vec<Path> = paths
            .iter()
            .copied()
            .filter(|p| p.family() == fam)
            .collect();
        // The family's first path is the reference; every path (itself included) must
        // give its bits for every shape below.
        let Some(&reference) = fam_paths.first() else {
            continue;
        };
        let y = b.call(tg, reference, full(m), (0, 0, 0));
        for (g, h) in y.iter().zip(&y_host) {
            assert!(
                (g - h).abs() <= 1e-2 * scale,
                "{fam:?} K {k}: {g} vs host {h} (scale {scale})"
            );
        }
        for &path in &fam_paths {
            let name = format!("{} K {k}", path.name());
            same_bits(&b.call(tg, path, full(m), (0, 0, 0)), &y, &name);
            // Another M first (more row tiles, more counters), then TP shards.
            let big = b.call(tg, path, full(m_big), (m + 8, 0, 0));
            assert!(big.iter().all(|v| v.is_finite()), "{name}: M = {m_big}");
            for world in [2usize, 4, 8] {
                let roots: Vec<Vec<f32>> = (0..world)
                    .map(|rank| {
                        let cols = layout.shard(rank, world);
                        let shape = TreeMatmul {
                            k: cols.len(),
                            n_seg: SEGMENTS / world,
                            ..full(m)
                        };
                        b.call(tg, path, shape, (0, 0, cols.start))
                    })
                    .collect();
                let slices: Vec<&[f32]> = roots.iter().map(|r| r.as_slice()).collect();
                let mut combined = vec![0.0f32; m * n];
                combine_roots(&slices, &mut combined);
                same_bits(&combined, &y, &format!("{name}: TP={world} shards"));
            }
            // A column shard of W starting inside a tile.
            let n0 = 72;
            let got = b.call(
                tg,
                path,
                TreeMatmul {
                    n: n - n0,
                    ..full(m)
                },
                (0, n0, 0),
            );
            let want: Vec<f32> = (0..m)
                .flat_map(|r| y[r * n + n0..(r + 1) * n].to_vec())
                .collect();
            same_bits(&got, &want, &format!("{name}: columns {n0}..{n}"));
            same_bits(&b.call(tg, path, full(m), (0, 0, 0)), &y, &name);
            let cnt = stream.clone_dtoh(&b.cnt).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                cnt.iter().all(|&c| c == 0),
                "{name}: tile counters not reset: {cnt:?}"
            );
        }
    }
}

/// The llama3-8b layer shapes (q/k/v, o, down, gate/up) at the row counts of decode at
/// batch 129–512 and short prefills, where the 128-row tiles of `wgtma128` and
/// `wgquad128x` take partial last row tiles (129, 200, 384): every Wgmma path gives
/// `wgtma128`'s bits; for the 128-row paths also every TP 2 / 4 / 8 shard (a
/// row-parallel layer's rank: 4, 2, 1 segments) combined on the host, and for the
/// persistent kernels also on a grid of five blocks, the tail split on and off. One row
/// is checked against the host `tree_matmul` within bf16 tolerance (the paths could agree
/// on NaN).
#[test]
fn model_shapes_from_129_to_512_rows_give_the_same_bits_on_every_path() {
    if let Err(e) = probe() {
        eprintln!("skipped: {e}");
        return;
    }
    let ctx = CudaContext::new(0).unwrap_or_else(|e| panic!("a GPU is present but: {e}"));
    // SAFETY: every buffer is used on this one stream only.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap_or_else(|e| panic!("{e}"));
    let mut tg = TreeGemm::new(&ctx).unwrap_or_else(|e| panic!("{e}"));
    if tg.family != Family::Wgmma {
        eprintln!("skipped: {} runs the Mma family", tg.arch);
        return;
    }
    let paths: Vec<Path> = Path::all(Family::Wgmma)
        .iter()
        .copied()
        .filter(|p| tg.has(*p))
        .collect();
    let ms = [129usize, 200, 256, 384, 512];
    let m_max = 512;
    for (k, n) in [
        (4096usize, 4096usize),
        (4096, 6144),
        (14336, 4096),
        (4096, 28672),
    ] {
        let layout = SegmentLayout::new(k);
        let x_host = rng_bf16(m_max * k, 31 + k as u64);
        let w_host = rng_bf16(n * k, 37 + n as u64);
        let wb: Vec<bf16> = w_host.iter().map(|&u| bf16::from_bits(u)).collect();
        let b = Bufs {
            x: stream.clone_htod(&x_host).unwrap_or_else(|e| panic!("{e}")),
            w: stream.clone_htod(&w_host).unwrap_or_else(|e| panic!("{e}")),
            out: stream
                .alloc_zeros(m_max * n)
                .unwrap_or_else(|e| panic!("{e}")),
            ws: stream
                .alloc_zeros(
                    paths
                        .iter()
                        .map(|p| p.workspace_len(m_max, n, SEGMENTS))
                        .max()
                        .unwrap_or(0)
                        .max(1),
                )
                .unwrap_or_else(|e| panic!("{e}")),
            cnt: stream
                .alloc_zeros(
                    paths
                        .iter()
                        .map(|p| p.counters_len(m_max, n))
                        .max()
                        .unwrap_or(0)
                        .max(1),
                )
                .unwrap_or_else(|e| panic!("{e}")),
            stream: stream.clone(),
            k,
        };
        let full = |m| TreeMatmul {
            m,
            n,
            k,
            seg_len: layout.seg_len,
            n_seg: SEGMENTS,
        };
        for m in ms {
            let y = b.call(&tg, Path::WgTma { bn: 128 }, full(m), (0, 0, 0));
            // The last row (in the partial last row tile where M is not a multiple of 128).
            let xr: Vec<bf16> = x_host[(m - 1) * k..m * k]
                .iter()
                .map(|&u| bf16::from_bits(u))
                .collect();
            let mut row = vec![0.0f32; n];
            tree_matmul(&xr, &wb, TreeMatmul { m: 1, ..full(m) }, &mut row);
            let scale = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            for (j, (g, h)) in y[(m - 1) * n..].iter().zip(&row).enumerate() {
                assert!(
                    (g - h).abs() <= 1e-2 * scale,
                    "K {k} N {n} M {m}: row {} column {j}: {g} vs host {h} (scale {scale})",
                    m - 1
                );
            }
            for &path in &paths {
                let name = format!("{} K {k} N {n} M {m}", path.name());
                same_bits(&b.call(&tg, path, full(m), (0, 0, 0)), &y, &name);
                if matches!(path, Path::WgTma { .. }) {
                    same_bits(
                        &by_column(&mut tg, |tg| b.call(tg, path, full(m), (0, 0, 0))),
                        &y,
                        &format!("{name}, tiles by column"),
                    );
                    for split in [false, true] {
                        same_bits(
                            &on_blocks(&mut tg, 5, split, |tg| {
                                b.call(tg, path, full(m), (0, 0, 0))
                            }),
                            &y,
                            &format!("{name}, five blocks, tail split {split}"),
                        );
                    }
                }
                if !matches!(path, Path::WgTma { .. } | Path::WgQuad128 { .. }) {
                    continue;
                }
                for world in [2usize, 4, 8] {
                    let roots: Vec<Vec<f32>> = (0..world)
                        .map(|rank| {
                            let cols = layout.shard(rank, world);
                            let shape = TreeMatmul {
                                k: cols.len(),
                                n_seg: SEGMENTS / world,
                                ..full(m)
                            };
                            b.call(&tg, path, shape, (0, 0, cols.start))
                        })
                        .collect();
                    let slices: Vec<&[f32]> = roots.iter().map(|r| r.as_slice()).collect();
                    let mut combined = vec![0.0f32; m * n];
                    combine_roots(&slices, &mut combined);
                    same_bits(&combined, &y, &format!("{name}: TP={world} shards"));
                }
            }
            let cnt = stream.clone_dtoh(&b.cnt).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                cnt.iter().all(|&c| c == 0),
                "K {k} N {n} M {m}: tile counters not reset"
            );
        }
    }
}

/// The SiLU·mul epilogue of every TMA path: bit for bit the path's stored roots followed
/// by the element-wise `silu_mul_pairs` kernel (the unfused MLP), in f32 and in bf16, at
/// M inside one row tile, across row tiles and above 128 rows, with N a multiple of 4 and
/// N = 2 mod 4 (a last pair alone in its 4-column group); with both outputs, f32 alone and
/// bf16 alone.
#[test]
fn silu_epilogue_is_the_stored_roots_then_silu_mul_pairs() {
    if let Err(e) = probe() {
        eprintln!("skipped: {e}");
        return;
    }
    let dev =
        crate::cuda::GpuDevice::open(0).unwrap_or_else(|e| panic!("a GPU is present but: {e}"));
    let mut tg = TreeGemm::new(&dev.ctx).unwrap_or_else(|e| panic!("{e}"));
    let stream = dev.stream.clone();
    let k = 1024usize;
    let layout = SegmentLayout::new(k);
    let m_max = 200usize;
    let n_max = 512usize;
    let x = stream
        .clone_htod(&rng_bf16(m_max * k, 21))
        .unwrap_or_else(|e| panic!("{e}"));
    let w = stream
        .clone_htod(&rng_bf16(n_max * k, 23))
        .unwrap_or_else(|e| panic!("{e}"));
    let ws: CudaSlice<f32> = stream
        .alloc_zeros(SEGMENTS * m_max * n_max)
        .unwrap_or_else(|e| panic!("{e}"));
    let p = |s: &CudaSlice<u16>| s.device_ptr(&stream).0;
    let tma: Vec<Path> = Path::all(Family::Wgmma)
        .iter()
        .copied()
        .filter(|p| p.is_tma() && tg.has(*p))
        .collect();
    if tma.is_empty() {
        eprintln!("skipped: no TMA path on {}", tg.arch);
        return;
    }
    for &path in &tma {
        // The last three have n/2 a multiple of 8, so wgtma128's values leave by TMA store
        // (f32 and bf16 boxes clipped at the last row and column tiles); the others by the
        // threads' stores.
        for (m, n) in [
            (3usize, 264usize),
            (70, 200),
            (150, 198),
            (1, 2),
            (150, 272),
            (200, 512),
            (3, 16),
        ] {
            let shape = TreeMatmul {
                m,
                n,
                k,
                seg_len: layout.seg_len,
                n_seg: SEGMENTS,
            };
            let what = format!("{} M {m} N {n}", path.name());
            // `out` 0: no f32 output (the bf16 one alone).
            let run = |tg: &TreeGemm, epilogue: Epilogue, out: u64| {
                let a = GemmArgs {
                    shape,
                    x: p(&x),
                    ldx: k,
                    x_rows: x.len() / k,
                    w: p(&w),
                    ldw: k,
                    out,
                    out_dtype: OutDtype::F32,
                    ws: ws.device_ptr(&stream).0,
                    ws_len: ws.len(),
                    counters: 0,
                    counters_len: 0,
                    w_constant: true,
                    epilogue,
                };
                // SAFETY: the shapes lie inside the buffers allocated above.
                unsafe { tg.launch(&stream, &a, Some(path)) }
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
            };
            let ptr_f32 = |b: &mut CudaSlice<f32>| b.device_ptr_mut(&stream).0;
            let mut roots = dev
                .upload_f32(&vec![f32::NAN; m * n])
                .unwrap_or_else(|e| panic!("{e}"));
            run(&tg, Epilogue::Store, ptr_f32(&mut roots));
            let mut want_b = dev.empty_bf16(m * n / 2).unwrap_or_else(|e| panic!("{e}"));
            let want = dev
                .silu_mul_pairs(&roots, m, n / 2, Some(&mut want_b))
                .unwrap_or_else(|e| panic!("{what}: silu_mul_pairs: {e}"));
            // Outputs that show any value a run leaves unwritten.
            let nan_f32 = || {
                dev.upload_f32(&vec![f32::NAN; m * n / 2])
                    .unwrap_or_else(|e| panic!("{e}"))
            };
            let nan_bf16 = || {
                dev.upload_bf16(&vec![half::bf16::NAN; m * n / 2])
                    .unwrap_or_else(|e| panic!("{e}"))
            };
            let mut got = nan_f32();
            let mut got_b = nan_bf16();
            let bp = got_b.device_ptr_mut(&stream).0;
            run(&tg, Epilogue::SiluMulPairs { bf16: bp }, ptr_f32(&mut got));
            let host = |b: &crate::cuda::DevF32| {
                dev.download_f32(b)
                    .unwrap_or_else(|e| panic!("{what}: {e}"))
            };
            let want_h = host(&want);
            assert!(
                want_h.iter().all(|v| v.is_finite()),
                "{what}: roots left unwritten"
            );
            same_bits(&host(&got), &want_h, &what);
            let bits = |b: &crate::cuda::DevBf16| -> Vec<f32> {
                dev.download_bf16(b)
                    .unwrap_or_else(|e| panic!("{what}: {e}"))
                    .iter()
                    .map(|v| v.to_f32())
                    .collect()
            };
            same_bits(&bits(&got_b), &bits(&want_b), &format!("{what} (bf16)"));
            // Without the bf16 copy (f32 alone).
            let mut got_f = nan_f32();
            run(&tg, Epilogue::SiluMulPairs { bf16: 0 }, ptr_f32(&mut got_f));
            same_bits(&host(&got_f), &want_h, &format!("{what} (f32 alone)"));
            // Without the f32 copy (bf16 alone).
            let mut alone_b = nan_bf16();
            let ap = alone_b.device_ptr_mut(&stream).0;
            run(&tg, Epilogue::SiluMulPairs { bf16: ap }, 0);
            same_bits(
                &bits(&alone_b),
                &bits(&want_b),
                &format!("{what} (bf16 alone)"),
            );
            if matches!(path, Path::WgTma { .. }) {
                let mut col = nan_f32();
                let mut col_b = nan_bf16();
                let cp = col_b.device_ptr_mut(&stream).0;
                let cf = ptr_f32(&mut col);
                by_column(&mut tg, |tg| {
                    run(tg, Epilogue::SiluMulPairs { bf16: cp }, cf)
                });
                same_bits(&host(&col), &want_h, &format!("{what}, tiles by column"));
                same_bits(
                    &bits(&col_b),
                    &bits(&want_b),
                    &format!("{what} (bf16), tiles by column"),
                );
            }
        }
    }
}

/// One grouped call's operands: `counts[e]` pairs for expert e, laid out by expert; X
/// gathered from `tokens` rows (pair r reads token `gather[r]`) or, with `tokens` 0, one
/// X row per pair; each expert's W a different window of one random buffer.
struct GroupedCase {
    what: String,
    counts: Vec<usize>,
    tokens: usize,
    shape: TreeMatmul,
    silu: bool,
}

impl GroupedCase {
    fn new(
        what: &str,
        counts: Vec<usize>,
        tokens: usize,
        k: usize,
        n: usize,
        n_seg: usize,
    ) -> Self {
        let pairs = counts.iter().sum();
        let shape = TreeMatmul {
            m: pairs,
            n,
            k,
            seg_len: k / n_seg,
            n_seg,
        };
        GroupedCase {
            what: what.into(),
            counts,
            tokens,
            shape,
            silu: false,
        }
    }

    /// The routing's tiles of `bm` rows: (expert, first row, the expert's end).
    fn tiles(&self, bm: usize) -> Vec<(i32, i32, i32)> {
        let (mut t, mut off) = (Vec::new(), 0usize);
        for (e, &c) in self.counts.iter().enumerate() {
            for r in (0..c).step_by(bm) {
                t.push((e as i32, (off + r) as i32, (off + c) as i32));
            }
            off += c;
        }
        t
    }

    /// The call's output by `path` (as f32: the SiLU·mul output's bf16 widened).
    fn run(&self, tg: &TreeGemm, stream: &Arc<CudaStream>, path: GroupedPath) -> Vec<f32> {
        let s = self.shape;
        let experts = self.counts.len();
        let up = |v: &[i32]| stream.clone_htod(v).unwrap_or_else(|e| panic!("{e}"));
        let x_rows = if self.tokens > 0 { self.tokens } else { s.m };
        let x = stream
            .clone_htod(&rng_bf16(x_rows * s.k, 41 + s.k as u64))
            .unwrap_or_else(|e| panic!("{e}"));
        // Expert e's weight starts `shift·e` values into one buffer (16-byte aligned).
        let shift = 8 * 97;
        let w = stream
            .clone_htod(&rng_bf16(s.n * s.k + experts * shift, 43 + s.n as u64))
            .unwrap_or_else(|e| panic!("{e}"));
        let wp = w.device_ptr(stream).0;
        let ptrs: Vec<u64> = (0..experts).map(|e| wp + (2 * shift * e) as u64).collect();
        let w_table = stream.clone_htod(&ptrs).unwrap_or_else(|e| panic!("{e}"));
        let gather: Vec<i32> = (0..s.m)
            .map(|r| ((r * 7919 + 13) % x_rows.max(1)) as i32)
            .collect();
        let gather = up(&gather);
        let max_tiles = path.max_tiles(s.m, experts);
        let tiles = self.tiles(path.bm());
        assert!(tiles.len() <= max_tiles, "{}: tile bound", self.what);
        let col = |f: fn(&(i32, i32, i32)) -> i32| {
            let mut v: Vec<i32> = tiles.iter().map(f).collect();
            v.resize(max_tiles.max(1), -1);
            up(&v)
        };
        let (te, tr, tend) = (col(|t| t.0), col(|t| t.1), col(|t| t.2));
        let nt = up(&[tiles.len() as i32]);
        let out_len = if self.silu { s.m * s.n / 2 } else { s.m * s.n };
        // Poisoned: an element a path leaves unwritten reads as NaN.
        let out16: CudaSlice<u16> = stream
            .clone_htod(&vec![0xFFFFu16; out_len.max(1)])
            .unwrap_or_else(|e| panic!("{e}"));
        let out32: CudaSlice<f32> = stream
            .clone_htod(&vec![f32::NAN; out_len.max(1)])
            .unwrap_or_else(|e| panic!("{e}"));
        let ws_len = path.workspace_len(s.m, s.n, s.n_seg).max(1);
        let cnt_len = path.counters_len(s.m, experts, s.n).max(1);
        let ws: CudaSlice<f32> = stream.alloc_zeros(ws_len).unwrap_or_else(|e| panic!("{e}"));
        let cnt: CudaSlice<u32> = stream
            .alloc_zeros(cnt_len)
            .unwrap_or_else(|e| panic!("{e}"));
        let p32 = |b: &CudaSlice<i32>| b.device_ptr(stream).0;
        let a = GroupedArgs {
            shape: s,
            experts,
            x: x.device_ptr(stream).0,
            ldx: s.k,
            ldw: s.k,
            out: if self.silu {
                out16.device_ptr(stream).0
            } else {
                out32.device_ptr(stream).0
            },
            silu: self.silu,
            ws: ws.device_ptr(stream).0,
            ws_len,
            counters: cnt.device_ptr(stream).0,
            counters_len: cnt_len,
            tiles: MoeTiles {
                tile_expert: p32(&te),
                tile_row0: p32(&tr),
                tile_end: p32(&tend),
                n_tiles: p32(&nt),
                gather: if self.tokens > 0 { p32(&gather) } else { 0 },
                w_table: w_table.device_ptr(stream).0,
            },
            max_tiles,
        };
        let what = format!("{} ({})", self.what, path.name());
        let xg: CudaSlice<u16> = stream
            .alloc_zeros((s.m * s.k).max(8))
            .unwrap_or_else(|e| panic!("{e}"));
        let maps = if path == GroupedPath::WgTma128 {
            expert_maps(&ptrs, s.n, s.k, s.seg_len, s.n_seg)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
        } else {
            vec![0u64; 16]
        };
        let maps = stream.clone_htod(&maps).unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: every table, operand and output above is sized for this call's pairs.
        let res = unsafe {
            if path == GroupedPath::WgTma128 {
                let wg = GroupedWg {
                    w_maps: maps.device_ptr(stream).0,
                    w_maps_len: maps.len(),
                    xg: xg.device_ptr(stream).0,
                    xg_len: xg.len(),
                };
                tg.launch_grouped_wg(stream, &a, &wg)
            } else {
                tg.launch_grouped(stream, &a, path)
            }
        };
        res.unwrap_or_else(|e| panic!("{what}: {e}"));
        let mut got: Vec<f32> = if self.silu {
            let h = stream
                .clone_dtoh(&out16)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            h.iter().map(|&b| bf16::from_bits(b).to_f32()).collect()
        } else {
            stream
                .clone_dtoh(&out32)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
        };
        got.truncate(out_len);
        assert!(
            got.iter().all(|v| v.is_finite()),
            "{what}: an output element was left unwritten"
        );
        got
    }
}

/// The Hopper grouped kernel (wgmma + TMA, 128-row tiles, X gathered into pair order)
/// gives the mma.sync grouped kernel's bits, with and without the SiLU·mul epilogue, on
/// uneven and empty experts, segment tails (K = 320: seg_len 40; Qwen3's down projection:
/// seg_len 96), a TP shard's four segments, and the Qwen3-30B-A3B and Mixtral shapes.
#[test]
fn grouped_wgmma_gives_the_mma_bits() {
    if let Err(e) = probe() {
        eprintln!("skipped: {e}");
        return;
    }
    let ctx = CudaContext::new(0).unwrap_or_else(|e| panic!("a GPU is present but: {e}"));
    // SAFETY: every buffer is used on this one stream only.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap_or_else(|e| panic!("{e}"));
    let tg = TreeGemm::new(&ctx).unwrap_or_else(|e| panic!("{e}"));
    if !tg.has_grouped(GroupedPath::WgTma128) {
        eprintln!("skipped: no wgmma grouped kernel on {}", tg.arch);
        return;
    }
    let uneven = vec![300usize, 0, 17, 129, 0, 1, 256, 64];
    // Qwen3-30B-A3B at 512 tokens: 128 experts, top-8, some experts empty.
    let qwen: Vec<usize> = (0..128usize)
        .map(|e| if e % 11 == 3 { 0 } else { (e * 37 + 5) % 61 })
        .collect();
    let mixtral = vec![150usize, 0, 37, 300, 5, 129, 0, 64];
    let mut cases = vec![
        GroupedCase::new("uneven, K 320", uneven.clone(), 200, 320, 192, SEGMENTS),
        GroupedCase::new(
            "uneven, K 320, pair rows",
            uneven.clone(),
            0,
            320,
            200,
            SEGMENTS,
        ),
        GroupedCase::new("TP shard of 4 segments", uneven, 0, 512, 256, 4),
        GroupedCase::new("qwen3 gate/up", qwen.clone(), 512, 2048, 1536, SEGMENTS),
        GroupedCase::new("qwen3 down", qwen, 0, 768, 2048, SEGMENTS),
        GroupedCase::new(
            "mixtral gate/up",
            mixtral.clone(),
            400,
            4096,
            28672,
            SEGMENTS,
        ),
        GroupedCase::new("mixtral down", mixtral, 0, 14336, 4096, SEGMENTS),
    ];
    for c in &mut cases {
        // Gate/up projections (X gathered) end in the SiLU·mul epilogue.
        c.silu = c.tokens > 0;
    }
    cases.push(GroupedCase {
        silu: false,
        ..GroupedCase::new(
            "uneven gathered, roots",
            vec![3, 140, 0, 128, 1],
            90,
            320,
            128,
            SEGMENTS,
        )
    });
    for c in &cases {
        let want = c.run(&tg, &stream, GroupedPath::Tree128);
        let got = c.run(&tg, &stream, GroupedPath::WgTma128);
        same_bits(&got, &want, &format!("{}: wgtma128 vs tree128", c.what));
        if c.shape.m * c.shape.n <= 1 << 20 {
            let split = c.run(&tg, &stream, GroupedPath::Split16);
            same_bits(&got, &split, &format!("{}: wgtma128 vs split16", c.what));
        }
        println!("{}: {} pairs, same bits", c.what, c.shape.m);
    }
}
