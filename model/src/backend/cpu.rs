//! CPU backend over `arbor_kernels::cpu` and a host `Communicator`.

use std::sync::Arc;

use arbor_collective::Communicator;
use arbor_kernels::cpu::{self as k, AttnShape, PagedKv, RopeTable, TreeMatmul};
use arbor_kernels::paged::KV_BLOCK;
use half::bf16;

use super::device_tensor::HostBytes;
use super::{
    BResult, Backend, BackendError, DeviceBytes, DeviceCut, HeadSpec, KvRows, KvSpec, NonFinite,
    RowFill, SeqRows, TreeSpec,
};
use crate::error::MResult;

/// f32 activations `[rows, cols]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuAct {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

/// A bf16 weight `[n, k]`, row-major.
#[derive(Debug, Clone)]
pub struct CpuMat {
    pub data: Vec<bf16>,
    pub n: usize,
    pub k: usize,
}

/// The paged K and V pools, `[layers, blocks, n_kv_heads, KV_BLOCK, head_dim]` bf16 each
/// (`arbor_kernels::paged`).
pub struct CpuKv {
    spec: KvSpec,
    k: Vec<bf16>,
    v: Vec<bf16>,
}

impl CpuKv {
    fn width(&self) -> usize {
        self.spec.n_kv_heads * self.spec.head_dim
    }
}

/// `n` zero values, from zeroed memory: the pages of a large pool are not touched (nor
/// resident) until blocks in them are written.
fn zeroed_bf16(n: usize) -> Vec<bf16> {
    use half::vec::HalfBitsVecExt as _;
    vec![0u16; n].reinterpret_into()
}

pub struct CpuBackend {
    comm: Arc<dyn Communicator>,
}

impl CpuBackend {
    /// A backend for `comm`'s rank. The kernels' thread count is process-wide; the
    /// runner sets it (see [`default_threads`]).
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        CpuBackend { comm }
    }

    fn shape_err(&self, msg: String) -> BackendError {
        BackendError::Shape(format!("rank {}: {msg}", self.comm.rank()))
    }

    fn check_rows(&self, what: &str, x: &CpuAct, cols: usize) -> BResult<()> {
        if x.cols != cols || x.data.len() != x.rows * x.cols {
            return Err(self.shape_err(format!(
                "{what}: activation is [{}, {}] ({} values), expected {cols} columns",
                x.rows,
                x.cols,
                x.data.len()
            )));
        }
        Ok(())
    }

    fn check_seqs(&self, what: &str, rows: usize, seqs: &[SeqRows]) -> BResult<()> {
        let mut next = 0;
        for s in seqs {
            if s.row0 != next {
                return Err(
                    self.shape_err(format!("{what}: sequences are not contiguous rows ({s:?})"))
                );
            }
            next = s.row0 + s.len;
        }
        if next != rows {
            return Err(self.shape_err(format!(
                "{what}: sequences cover {next} rows, activation has {rows}"
            )));
        }
        Ok(())
    }
}

/// Kernel threads per process: the machine's cores split over the ranks on this host
/// (`LOCAL_WORLD_SIZE`), at least 1.
pub fn default_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let local = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1);
    (cores / local).max(1)
}

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

impl Backend for CpuBackend {
    type Act = CpuAct;
    type Mat = CpuMat;
    type KvCache = CpuKv;
    /// The CPU routes on the host: no prepared experts.
    type Experts = std::convert::Infallible;

    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    fn device_name(&self) -> String {
        format!("cpu ({} transport)", self.comm.transport())
    }

    fn mat_from_host(&self, data: &[bf16], n: usize, k: usize) -> BResult<CpuMat> {
        if data.len() != n * k {
            return Err(self.shape_err(format!(
                "weight has {} values, expected [{n}, {k}]",
                data.len()
            )));
        }
        Ok(CpuMat {
            data: data.to_vec(),
            n,
            k,
        })
    }
    /// The CPU's "device" memory is the host's: the cuts are the host load's conversion
    /// and check, applied to the bytes held.
    fn mat_from_device(
        &self,
        n: usize,
        k: usize,
        cuts: &[DeviceCut<'_>],
    ) -> BResult<Result<CpuMat, NonFinite>> {
        let mut data = vec![bf16::ZERO; n * k];
        for (ci, c) in cuts.iter().enumerate() {
            let held = c
                .src
                .bytes
                .as_any()
                .downcast_ref::<HostBytes>()
                .ok_or_else(|| {
                    BackendError::Unsupported(format!(
                        "rank {}: a device tensor the CPU backend did not make",
                        self.rank()
                    ))
                })?;
            let es = c.src.dtype.size();
            let width = c.cols.len();
            let src_ok = c.cols.end <= c.k && c.rows.end * c.k * es <= c.src.range.len();
            let last = c.dst_row0 + c.rows.len().saturating_sub(1) * c.dst_step;
            if !src_ok || width > k || (!c.rows.is_empty() && last >= n) {
                return Err(self.shape_err(format!(
                    "cut {ci}: rows {:?} × columns {:?} of [*, {}] ({} bytes) into [{n}, {k}] from row {} every {}",
                    c.rows, c.cols, c.k, c.src.range.len(), c.dst_row0, c.dst_step
                )));
            }
            for (i, r) in c.rows.clone().enumerate() {
                let at = c.src.range.start + (r * c.k + c.cols.start) * es;
                let b = &held.0[at..at + width * es];
                let d0 = (c.dst_row0 + i * c.dst_step) * k;
                let d = &mut data[d0..d0 + width];
                crate::safetensors::convert_into(b, c.src.dtype, d);
                if let Some(j) = crate::safetensors::first_non_finite(d) {
                    return Ok(Err(NonFinite {
                        cut: ci,
                        flat: r * c.k + c.cols.start + j,
                    }));
                }
            }
        }
        Ok(Ok(CpuMat { data, n, k }))
    }

    fn device_bytes(&self, data: &[u8]) -> BResult<Arc<dyn DeviceBytes>> {
        Ok(Arc::new(HostBytes(data.to_vec())))
    }

    fn mat_from_rows(&self, n: usize, k: usize, fill: &mut RowFill<'_>) -> MResult<CpuMat> {
        // The host buffer is the weight: no copy after the fill.
        let mut data = vec![bf16::ZERO; n * k];
        fill(0..n, &mut data)?;
        Ok(CpuMat { data, n, k })
    }
    fn act_from_host(&self, data: &[f32], rows: usize, cols: usize) -> BResult<CpuAct> {
        if data.len() != rows * cols {
            return Err(self.shape_err(format!(
                "activation has {} values, expected [{rows}, {cols}]",
                data.len()
            )));
        }
        Ok(CpuAct {
            data: data.to_vec(),
            rows,
            cols,
        })
    }
    fn act_to_host(&self, a: &CpuAct) -> BResult<Vec<f32>> {
        Ok(a.data.clone())
    }
    fn shape(&self, a: &CpuAct) -> (usize, usize) {
        (a.rows, a.cols)
    }
    fn reshape(&self, a: CpuAct, rows: usize, cols: usize) -> BResult<CpuAct> {
        if rows * cols != a.rows * a.cols {
            return Err(self.shape_err(format!(
                "cannot view [{}, {}] as [{rows}, {cols}]",
                a.rows, a.cols
            )));
        }
        Ok(CpuAct {
            data: a.data,
            rows,
            cols,
        })
    }
    fn select_rows(&self, a: &CpuAct, rows: &[usize]) -> BResult<CpuAct> {
        let mut data = Vec::with_capacity(rows.len() * a.cols);
        for &r in rows {
            if r >= a.rows {
                return Err(self.shape_err(format!("row {r} selected from {} rows", a.rows)));
            }
            data.extend_from_slice(&a.data[r * a.cols..(r + 1) * a.cols]);
        }
        Ok(CpuAct {
            data,
            rows: rows.len(),
            cols: a.cols,
        })
    }

    fn embedding(&self, table: &CpuMat, ids: &[u32]) -> BResult<CpuAct> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.n) {
            return Err(self.shape_err(format!(
                "token id {bad} outside the embedding table of {} rows",
                table.n
            )));
        }
        let mut out = vec![0.0; ids.len() * table.k];
        k::embedding(&table.data, table.k, ids, &mut out);
        Ok(CpuAct {
            data: out,
            rows: ids.len(),
            cols: table.k,
        })
    }
    fn rms_norm(&self, x: &CpuAct, weight: &CpuAct, eps: f32) -> BResult<CpuAct> {
        self.check_rows("rms_norm", x, weight.data.len())?;
        let mut out = vec![0.0; x.data.len()];
        k::rms_norm(&x.data, x.cols, &weight.data, eps, &mut out);
        Ok(CpuAct { data: out, ..*x })
    }
    fn matmul(&self, x: &CpuAct, w: &CpuMat, tree: TreeSpec) -> BResult<CpuAct> {
        self.check_rows("matmul", x, w.k)?;
        let mut out = vec![0.0; x.rows * w.n];
        let shape = TreeMatmul {
            m: x.rows,
            n: w.n,
            k: w.k,
            seg_len: tree.seg_len,
            n_seg: tree.n_seg,
        };
        k::tree_matmul(&to_bf16(&x.data), &w.data, shape, &mut out);
        Ok(CpuAct {
            data: out,
            rows: x.rows,
            cols: w.n,
        })
    }
    fn add_row_bias(&self, x: &mut CpuAct, bias: &CpuAct) -> BResult<()> {
        self.check_rows("add_row_bias", x, bias.data.len())?;
        k::add_row_bias(&mut x.data, &bias.data);
        Ok(())
    }
    fn add_assign(&self, x: &mut CpuAct, y: &CpuAct) -> BResult<()> {
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(self.shape_err(format!(
                "add: [{}, {}] += [{}, {}]",
                x.rows, x.cols, y.rows, y.cols
            )));
        }
        k::add_assign(&mut x.data, &y.data);
        Ok(())
    }
    fn silu_mul(&self, gate: &CpuAct, up: &CpuAct) -> BResult<CpuAct> {
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return Err(self.shape_err(format!(
                "silu_mul: gate [{}, {}] vs up [{}, {}]",
                gate.rows, gate.cols, up.rows, up.cols
            )));
        }
        let mut out = vec![0.0; gate.data.len()];
        k::silu_mul(&gate.data, &up.data, &mut out);
        Ok(CpuAct { data: out, ..*gate })
    }
    fn row_stats(
        &self,
        logits: &CpuAct,
        vocab: usize,
        pick: &[u32],
        draws: &[crate::sampling::RowDraw],
    ) -> BResult<Vec<crate::sampling::RowStats>> {
        if vocab > logits.cols || pick.len() != logits.rows || draws.len() != logits.rows {
            return Err(self.shape_err(format!(
                "row_stats of [{}, {}] with vocab {vocab}, {} picks and {} draws",
                logits.rows,
                logits.cols,
                pick.len(),
                draws.len()
            )));
        }
        Ok(crate::sampling::host_row_stats(
            &logits.data,
            logits.cols,
            vocab,
            pick,
            draws,
        ))
    }
    fn silu_mul_pairs(&self, gu: &CpuAct) -> BResult<CpuAct> {
        if !gu.cols.is_multiple_of(2) || gu.data.len() != gu.rows * gu.cols {
            return Err(self.shape_err(format!(
                "silu_mul_pairs of [{}, {}] ({} values): needs an even column count",
                gu.rows,
                gu.cols,
                gu.data.len()
            )));
        }
        let (gate, up): (Vec<f32>, Vec<f32>) =
            gu.data.chunks_exact(2).map(|p| (p[0], p[1])).unzip();
        let inter = gu.cols / 2;
        self.silu_mul(
            &CpuAct {
                data: gate,
                rows: gu.rows,
                cols: inter,
            },
            &CpuAct {
                data: up,
                rows: gu.rows,
                cols: inter,
            },
        )
    }
    fn split_cols(&self, x: &CpuAct, widths: &[usize]) -> BResult<Vec<CpuAct>> {
        if widths.iter().sum::<usize>() != x.cols || x.data.len() != x.rows * x.cols {
            return Err(self.shape_err(format!(
                "split of [{}, {}] into columns {widths:?}",
                x.rows, x.cols
            )));
        }
        let mut out: Vec<CpuAct> = widths
            .iter()
            .map(|&w| CpuAct {
                data: Vec::with_capacity(x.rows * w),
                rows: x.rows,
                cols: w,
            })
            .collect();
        for row in x.data.chunks_exact(x.cols.max(1)) {
            let mut c0 = 0;
            for (o, &w) in out.iter_mut().zip(widths) {
                o.data.extend_from_slice(&row[c0..c0 + w]);
                c0 += w;
            }
        }
        Ok(out)
    }
    fn rope(
        &self,
        x: &mut CpuAct,
        seqs: &[SeqRows],
        n_heads: usize,
        table: &RopeTable,
    ) -> BResult<()> {
        self.check_rows("rope", x, n_heads * table.head_dim)?;
        self.check_seqs("rope", x.rows, seqs)?;
        let mut positions = Vec::with_capacity(x.rows);
        for s in seqs {
            positions.extend(s.pos0..s.pos0 + s.len);
        }
        if let Some(&p) = positions.iter().find(|&&p| p >= table.max_pos) {
            return Err(self.shape_err(format!(
                "rope: position {p} beyond the table's {}",
                table.max_pos
            )));
        }
        table.apply(&mut x.data, n_heads, &positions);
        Ok(())
    }

    fn kv_cache(&self, spec: KvSpec) -> BResult<CpuKv> {
        let n = spec.len();
        Ok(CpuKv {
            spec,
            k: zeroed_bf16(n),
            v: zeroed_bf16(n),
        })
    }
    fn kv_write(
        &self,
        cache: &mut CpuKv,
        layer: usize,
        kx: &CpuAct,
        vx: &CpuAct,
        rows: KvRows<'_>,
    ) -> BResult<()> {
        let w = cache.width();
        let hd = cache.spec.head_dim;
        self.check_rows("kv_write k", kx, w)?;
        self.check_rows("kv_write v", vx, w)?;
        self.check_seqs("kv_write", kx.rows, rows.seqs)?;
        if layer >= cache.spec.layers {
            return Err(self.shape_err(format!(
                "kv_write: layer {layer} of a cache of {} layers",
                cache.spec.layers
            )));
        }
        rows.check(cache.spec.blocks)
            .map_err(|m| self.shape_err(format!("kv_write: {m}")))?;
        for s in rows.seqs {
            let table = rows
                .table_of(s)
                .map_err(|m| self.shape_err(format!("kv_write: {m}")))?;
            for i in 0..s.len {
                let p = s.pos0 + i;
                let block = table[p / KV_BLOCK] as usize;
                for h in 0..cache.spec.n_kv_heads {
                    let dst = cache.spec.at(layer, block, h, p % KV_BLOCK);
                    let src = (s.row0 + i) * w + h * hd;
                    for (d, &x) in cache.k[dst..dst + hd]
                        .iter_mut()
                        .zip(&kx.data[src..src + hd])
                    {
                        *d = bf16::from_f32(x);
                    }
                    for (d, &x) in cache.v[dst..dst + hd]
                        .iter_mut()
                        .zip(&vx.data[src..src + hd])
                    {
                        *d = bf16::from_f32(x);
                    }
                }
            }
        }
        Ok(())
    }
    fn attention(
        &self,
        q: &CpuAct,
        cache: &CpuKv,
        layer: usize,
        rows: KvRows<'_>,
        heads: HeadSpec,
    ) -> BResult<CpuAct> {
        let qw = heads.n_heads * heads.head_dim;
        self.check_rows("attention", q, qw)?;
        self.check_seqs("attention", q.rows, rows.seqs)?;
        if heads.n_kv_heads != cache.spec.n_kv_heads
            || heads.head_dim != cache.spec.head_dim
            || layer >= cache.spec.layers
        {
            return Err(self.shape_err(format!(
                "attention: heads {heads:?} at layer {layer} do not match the cache {:?}",
                cache.spec
            )));
        }
        rows.check(cache.spec.blocks)
            .map_err(|m| self.shape_err(format!("attention: {m}")))?;
        let shape = AttnShape {
            n_heads: heads.n_heads,
            n_kv_heads: heads.n_kv_heads,
            head_dim: heads.head_dim,
            scale: heads.scale,
        };
        let mut out = vec![0.0; q.data.len()];
        for s in rows.seqs {
            let table = rows
                .table_of(s)
                .map_err(|m| self.shape_err(format!("attention: {m}")))?;
            let kv = PagedKv {
                k: &cache.k,
                v: &cache.v,
                layout: cache.spec,
                layer,
                table,
            };
            let span = s.row0 * qw..(s.row0 + s.len) * qw;
            k::attention(&q.data[span.clone()], s.pos0, &kv, shape, &mut out[span]);
        }
        Ok(CpuAct { data: out, ..*q })
    }

    fn min_over_ranks(&self, value: u64) -> BResult<u64> {
        if self.comm.world_size() == 1 {
            return Ok(value);
        }
        let rank = self.comm.rank();
        let all = self
            .comm
            .all_gather_u64(value)
            .map_err(|source| BackendError::Collective { rank, source })?;
        Ok(all.into_iter().min().unwrap_or(value))
    }

    fn moe_experts(
        &self,
        _gate_up: &[&CpuMat],
        _down: &[&CpuMat],
        _spec: super::MoeSpec,
    ) -> BResult<Option<Self::Experts>> {
        Ok(None)
    }

    fn moe_forward(
        &self,
        _x: &CpuAct,
        _logits: &CpuAct,
        experts: &Self::Experts,
        _routes: Option<&mut Vec<u32>>,
    ) -> BResult<CpuAct> {
        match *experts {}
    }

    fn tree_all_reduce(&self, partial: CpuAct) -> BResult<CpuAct> {
        if self.comm.world_size() == 1 {
            return Ok(partial);
        }
        let rank = self.comm.rank();
        let out = arbor_collective::tree_all_reduce(self.comm.as_ref(), &partial.data)
            .map_err(|source| BackendError::Collective { rank, source })?;
        if out.len() != partial.data.len() {
            return Err(self.shape_err(format!(
                "tree all-reduce returned {} values, expected {}",
                out.len(),
                partial.data.len()
            )));
        }
        Ok(CpuAct {
            data: out,
            ..partial
        })
    }
    fn all_gather_cols(&self, x: &CpuAct) -> BResult<CpuAct> {
        let world = self.comm.world_size();
        if world == 1 {
            return Ok(x.clone());
        }
        let rank = self.comm.rank();
        let all = self
            .comm
            .all_gather_f32(&x.data)
            .map_err(|source| BackendError::Collective { rank, source })?;
        let n = x.data.len();
        if all.len() != n * world {
            return Err(self.shape_err(format!(
                "all-gather returned {} values, expected {}",
                all.len(),
                n * world
            )));
        }
        let mut out = Vec::with_capacity(n * world);
        for r in 0..x.rows {
            for p in 0..world {
                out.extend_from_slice(&all[p * n + r * x.cols..p * n + (r + 1) * x.cols]);
            }
        }
        Ok(CpuAct {
            data: out,
            rows: x.rows,
            cols: x.cols * world,
        })
    }
}
