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

/// The SiLU·mul epilogue of every TMA path: bit for bit the path's stored roots followed
/// by the element-wise `silu_mul_pairs` kernel (the unfused MLP), in f32 and in bf16, at
/// M inside one row tile, across row tiles and above 128 rows, with N a multiple of 4 and
/// N = 2 mod 4 (a last pair alone in its 4-column group).
#[test]
fn silu_epilogue_is_the_stored_roots_then_silu_mul_pairs() {
    if let Err(e) = probe() {
        eprintln!("skipped: {e}");
        return;
    }
    let dev =
        crate::cuda::GpuDevice::open(0).unwrap_or_else(|e| panic!("a GPU is present but: {e}"));
    let tg = TreeGemm::new(&dev.ctx).unwrap_or_else(|e| panic!("{e}"));
    let stream = dev.stream.clone();
    let k = 1024usize;
    let layout = SegmentLayout::new(k);
    let m_max = 150usize;
    let n_max = 264usize;
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
        for (m, n) in [(3usize, 264usize), (70, 200), (150, 198), (1, 2)] {
            let shape = TreeMatmul {
                m,
                n,
                k,
                seg_len: layout.seg_len,
                n_seg: SEGMENTS,
            };
            let what = format!("{} M {m} N {n}", path.name());
            let run = |epilogue: Epilogue, out: &mut CudaSlice<f32>| {
                let a = GemmArgs {
                    shape,
                    x: p(&x),
                    ldx: k,
                    w: p(&w),
                    ldw: k,
                    out: out.device_ptr_mut(&stream).0,
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
            let mut roots = dev
                .upload_f32(&vec![f32::NAN; m * n])
                .unwrap_or_else(|e| panic!("{e}"));
            run(Epilogue::Store, &mut roots);
            let mut want_b = dev.empty_bf16(m * n / 2).unwrap_or_else(|e| panic!("{e}"));
            let want = dev
                .silu_mul_pairs(&roots, m, n / 2, Some(&mut want_b))
                .unwrap_or_else(|e| panic!("{what}: silu_mul_pairs: {e}"));
            let mut got = dev
                .upload_f32(&vec![f32::NAN; m * n / 2])
                .unwrap_or_else(|e| panic!("{e}"));
            let mut got_b = dev
                .upload_bf16(&vec![half::bf16::NAN; m * n / 2])
                .unwrap_or_else(|e| panic!("{e}"));
            let bp = got_b.device_ptr_mut(&stream).0;
            run(Epilogue::SiluMulPairs { bf16: bp }, &mut got);
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
        }
    }
}
