//! Per-row statistics of the logits (argmax, log-sum-exp, picked value, digest, the
//! on-device draw) and the top-k selection of candidates, with their host-side layouts.

use cudarc::driver::LaunchConfig;

use super::{check, dev_ptr, i32_of, DevF32};
use crate::cpu::{MaskedDraw, RowDraw, RowStats};
use crate::cuda::{CudaError, GpuDevice};

const RS_THREADS: u32 = 512;
/// Mask words a block of the masked draw takes at most (a 128k vocabulary's 4096 words in
/// 8 parts).
const MASK_PART_WORDS: usize = 512;
/// select.cu's SEL_THREADS and SEL_MAX_K.
const SEL_THREADS: u32 = 1024;
pub const TOP_K_MAX: usize = 1024;
/// rowstats.cu's RS_CHUNK and RS_GROUP: cpu::digest's DIGEST_CHUNK and DIGEST_GROUP.
const RS_CHUNK: usize = crate::cpu::DIGEST_CHUNK;
const RS_GROUP: usize = crate::cpu::DIGEST_GROUP;
/// Chunk and group digests live in dynamic shared memory next to the kernel's 6 KiB of
/// static.
const RS_MAX_DIGESTS: usize = (48 * 1024 - 12 * RS_THREADS as usize) / 8;

/// f32 and u64 results per row of the row-stats kernel (rowstats.cu): argmax, digest
/// and draw as u64; max, log-sum-exp, the picked value, the drawn value, the tempered sum
/// and a pad (keeping the u64 part 8-byte aligned) as f32.
pub const ROW_STATS_F32: usize = 6;
pub const ROW_STATS_U64: usize = 3;

/// The row-stats kernel's parameters, 3 u64 per row: the pick, the draw's key, and
/// `mode << 32 | inv_t` bits (mode 1: a Gumbel draw, 2: the tempered sum, 0: neither).
pub fn row_stats_params(pick: &[u32], draws: &[RowDraw]) -> Vec<u64> {
    pick.iter()
        .zip(draws)
        .flat_map(|(&p, d)| match *d {
            RowDraw::Gumbel(g) => [p as u64, g.key, 1 << 32 | g.inv_t.to_bits() as u64],
            RowDraw::Nucleus { inv_t } => [p as u64, 0, 2 << 32 | inv_t.to_bits() as u64],
            RowDraw::None => [p as u64, 0, 0],
        })
        .collect()
}

/// The masked-draw kernel's parameters, 2 u64 per row: the key and `mode << 32 | inv_t`
/// bits (mode 0: the allowed argmax, 1: the allowed Gumbel-max).
pub fn masked_draw_params(draws: &[MaskedDraw]) -> Vec<u64> {
    draws
        .iter()
        .flat_map(|d| match *d {
            MaskedDraw::Argmax => [0, 0],
            MaskedDraw::Gumbel(g) => [g.key, 1 << 32 | g.inv_t.to_bits() as u64],
        })
        .collect()
}

/// The rows of the row-stats kernel's results.
pub fn decode_row_stats(f: &[f32], u: &[u64]) -> Vec<RowStats> {
    f.chunks_exact(ROW_STATS_F32)
        .zip(u.chunks_exact(ROW_STATS_U64))
        .map(|(f, u)| RowStats {
            argmax: u[0] as u32,
            max: f[0],
            lse: f[1],
            picked: f[2],
            digest: u[1],
            sampled: u[2] as u32,
            sampled_value: f[3],
            tempered_sum: f[4],
        })
        .collect()
}

/// The candidates of the top-k kernel's results: row r's first `cnt[r]` (index, value)
/// pairs of its `kmax`-entry rows.
pub fn decode_top_k(cnt: &[u32], idx: &[u32], val: &[f32], kmax: usize) -> Vec<Vec<(u32, f32)>> {
    cnt.iter()
        .enumerate()
        .map(|(r, &n)| {
            let m = (n as usize).min(kmax);
            (0..m)
                .map(|j| (idx[r * kmax + j], val[r * kmax + j]))
                .collect()
        })
        .collect()
}

impl GpuDevice {
    /// Argmax, max, log-sum-exp, the value at `pick[r]` (`u32::MAX`: none) and the digest
    /// of the first `vocab` values of each row of `x` (`[rows, cols]`); a few bytes per row
    /// come back instead of the row.
    pub fn row_stats(
        &self,
        x: &DevF32,
        rows: usize,
        cols: usize,
        vocab: usize,
        pick: &[u32],
        draws: &[RowDraw],
    ) -> Result<Vec<RowStats>, CudaError> {
        check(
            "row_stats_kernel",
            pick.len() == rows && draws.len() == rows,
            || {
                format!(
                    "{} picks and {} draws for {rows} rows",
                    pick.len(),
                    draws.len()
                )
            },
        )?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let params = self.upload("uploading row params", &row_stats_params(pick, draws))?;
        let of = self.alloc::<f32>(rows * ROW_STATS_F32)?;
        let ou = self.alloc::<u64>(rows * ROW_STATS_U64)?;
        let s = &self.stream;
        // SAFETY: the three buffers hold `rows` rows of parameters and results.
        unsafe {
            self.row_stats_raw(
                x,
                rows,
                cols,
                vocab,
                dev_ptr(&params, s),
                dev_ptr(&of, s),
                dev_ptr(&ou, s),
            )
        }?;
        let f = self.download("downloading row stats", &of, of.len())?;
        let u = self.download("downloading row stats", &ou, ou.len())?;
        Ok(decode_row_stats(&f, &u))
    }

    /// `row_stats` with its parameters and results in device memory: `params` holds
    /// [`row_stats_params`] (3 u64 per row); the kernel writes [`ROW_STATS_F32`] f32 per
    /// row at `out_f` and [`ROW_STATS_U64`] u64 per row at `out_u` ([`decode_row_stats`]).
    ///
    /// # Safety
    /// The three addresses are device memory of this device holding `rows` rows each,
    /// 8-byte aligned, valid until the kernel has run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn row_stats_raw(
        &self,
        x: &DevF32,
        rows: usize,
        cols: usize,
        vocab: usize,
        params: u64,
        out_f: u64,
        out_u: u64,
    ) -> Result<(), CudaError> {
        const K: &str = "row_stats_kernel";
        check(K, x.len() == rows * cols && vocab <= cols, || {
            format!("{} values as [{rows}, {cols}] with vocab {vocab}", x.len())
        })?;
        check(K, [params, out_f, out_u].iter().all(|p| p % 8 == 0), || {
            "parameter and result buffers must be 8-byte aligned".into()
        })?;
        let n_chunks = vocab.div_ceil(RS_CHUNK);
        let n_digests = n_chunks + n_chunks.div_ceil(RS_GROUP);
        check(K, n_digests <= RS_MAX_DIGESTS, || {
            format!("vocab {vocab} needs {n_digests} chunk and group digests, more than {RS_MAX_DIGESTS}")
        })?;
        if rows == 0 {
            return Ok(());
        }
        let (ci, vi) = (i32_of(K, "cols", cols)?, i32_of(K, "vocab", vocab)?);
        let cfg = LaunchConfig {
            grid_dim: (i32_of(K, "rows", rows)? as u32, 1, 1),
            block_dim: (RS_THREADS, 1, 1),
            shared_mem_bytes: (n_digests * 8) as u32,
        };
        let mut b = self.launch(self.func(K)?);
        b.arg(x)
            .arg(&ci)
            .arg(&vi)
            .arg(&params)
            .arg(&out_f)
            .arg(&out_u);
        self.launched(K, unsafe { b.launch(cfg) })
    }

    /// The draws of constrained rows where the logits are: for each j, row `rows[j]` of
    /// `x` (`[n_rows, cols]`) drawn by `draws[j]` over the ids its mask allows (`fill(j,
    /// words)` writes the mask into its zeroed `vocab.div_ceil(32)` words, id i at bit
    /// i % 32 of word i / 32): the drawn id and the row's value there, `None` where no
    /// allowed value is above −∞ (the host's fallback rules then draw from the row). Only
    /// the masks go up (4 bytes per 32 ids), from pinned memory, so that the copy is
    /// queued behind the step's work without the host waiting for it; 8 bytes per row
    /// come back.
    #[allow(clippy::too_many_arguments)]
    pub fn masked_draw(
        &self,
        x: &DevF32,
        n_rows: usize,
        cols: usize,
        vocab: usize,
        rows: &[u32],
        draws: &[MaskedDraw],
        fill: impl Fn(usize, &mut [u32]),
    ) -> Result<Vec<Option<(u32, f32)>>, CudaError> {
        const K: &str = "masked_draw_kernel";
        let n = rows.len();
        let words = vocab.div_ceil(32);
        check(K, x.len() == n_rows * cols && vocab <= cols, || {
            format!(
                "{} values as [{n_rows}, {cols}] with vocab {vocab}",
                x.len()
            )
        })?;
        check(K, draws.len() == n, || {
            format!("{n} rows with {} draws", draws.len())
        })?;
        if let Some(r) = rows.iter().find(|&&r| r as usize >= n_rows) {
            return Err(CudaError::Launch {
                kernel: K,
                msg: format!("row {r} of logits with {n_rows} rows"),
            });
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        // One upload: the parameters (8-byte aligned at the start), the rows, the masks.
        let total = 5 * n + n * words;
        let staged = self.stage_beside(total, |host| {
            for (j, p) in masked_draw_params(draws).into_iter().enumerate() {
                host[2 * j] = p as u32;
                host[2 * j + 1] = (p >> 32) as u32;
            }
            host[4 * n..5 * n].copy_from_slice(rows);
            let masks = &mut host[5 * n..];
            masks.fill(0);
            for (j, m) in masks.chunks_exact_mut(words).enumerate() {
                fill(j, m);
            }
        })?;
        let s = &self.stream;
        let base = staged.addr;
        // Each row's words in parts of at most MASK_PART_WORDS, one block each: a row alone
        // would leave most of the GPU idle.
        let parts = words.div_ceil(MASK_PART_WORDS).clamp(1, 32);
        let part = self.alloc::<u32>(2 * n * parts)?;
        let out = self.alloc::<u32>(2 * n)?;
        let (p_params, p_rows, p_bits) = (base, base + 16 * n as u64, base + 20 * n as u64);
        let (p_part, p_out) = (dev_ptr(&part, s), dev_ptr(&out, s));
        let (ci, vi, wi, pi) = (
            i32_of(K, "cols", cols)?,
            i32_of(K, "vocab", vocab)?,
            i32_of(K, "mask words", words)?,
            parts as i32,
        );
        let blocks = i32_of(K, "rows", n)? as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, parts as u32, 1),
            block_dim: (RS_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.launch(self.func(K)?);
        b.arg(x)
            .arg(&ci)
            .arg(&vi)
            .arg(&wi)
            .arg(&p_rows)
            .arg(&p_params)
            .arg(&p_bits)
            .arg(&p_part);
        // SAFETY: `up` holds the parameters, rows and masks at the offsets passed, every
        // row index is inside `x` (checked above), `part` holds 2 words per row and part;
        // all stay alive until the download below has waited for the kernels.
        self.launched(K, unsafe { b.launch(cfg) })?;
        const C: &str = "masked_draw_combine_kernel";
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.launch(self.func(C)?);
        b.arg(x)
            .arg(&ci)
            .arg(&p_rows)
            .arg(&p_part)
            .arg(&pi)
            .arg(&p_out);
        // SAFETY: as above; `out` holds 2 words a row.
        self.launched(C, unsafe { b.launch(cfg) })?;
        let got = self.download("downloading constrained rows' draws", &out, 2 * n)?;
        drop(staged);
        Ok(got
            .chunks_exact(2)
            .map(|w| (w[0] != u32::MAX).then(|| (w[0], f32::from_bits(w[1]))))
            .collect())
    }

    /// The `ks[r]` largest of the first `vocab` values of each row of `x` (`[rows, cols]`),
    /// NaN excluded, as (index, value) in `sampling::sorted_desc`'s order (descending by
    /// total order, lowest index first on ties); `ks[r] = 0`: none. At most
    /// [`TOP_K_MAX`] per row; 8 bytes per candidate come back instead of the row.
    pub fn top_k_select(
        &self,
        x: &DevF32,
        rows: usize,
        cols: usize,
        vocab: usize,
        ks: &[usize],
    ) -> Result<Vec<Vec<(u32, f32)>>, CudaError> {
        const K: &str = "top_k_select_kernel";
        check(K, ks.len() == rows, || {
            format!("{} k's for {rows} rows", ks.len())
        })?;
        if let Some(k) = ks.iter().find(|&&k| k > TOP_K_MAX) {
            return Err(CudaError::Launch {
                kernel: K,
                msg: format!("top-k {k} is more than the kernel's {TOP_K_MAX}"),
            });
        }
        let kmax = ks.iter().copied().max().unwrap_or(0);
        if rows == 0 || kmax == 0 {
            return Ok(vec![Vec::new(); rows]);
        }
        let k32: Vec<u32> = ks.iter().map(|&k| k as u32).collect();
        let dks = self.upload_u32(&k32)?;
        // The kernel writes the first out_n[r] entries of each row; only those are read.
        let idx = self.alloc::<u32>(rows * kmax)?;
        let val = self.alloc::<f32>(rows * kmax)?;
        let cnt = self.alloc::<u32>(rows)?;
        let s = &self.stream;
        // SAFETY: each buffer holds `rows` rows of `kmax` (or 1) entries; every k ≤ kmax.
        unsafe {
            self.top_k_raw(
                x,
                rows,
                cols,
                vocab,
                dev_ptr(&dks, s),
                kmax,
                [dev_ptr(&idx, s), dev_ptr(&val, s), dev_ptr(&cnt, s)],
            )
        }?;
        let n = self.download("downloading top-k counts", &cnt, rows)?;
        let i = self.download("downloading top-k indices", &idx, idx.len())?;
        let v = self.download("downloading top-k values", &val, val.len())?;
        Ok(decode_top_k(&n, &i, &v, kmax))
    }

    /// `top_k_select` with the k's (u32 per row) and the results in device memory:
    /// `out` = [indices (u32, `kmax` per row), values (f32, `kmax` per row), counts (u32
    /// per row)] ([`decode_top_k`]).
    ///
    /// # Safety
    /// The addresses are device memory of this device of those sizes, valid until the
    /// kernel has run, and every k is at most `kmax`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn top_k_raw(
        &self,
        x: &DevF32,
        rows: usize,
        cols: usize,
        vocab: usize,
        ks: u64,
        kmax: usize,
        out: [u64; 3],
    ) -> Result<(), CudaError> {
        const K: &str = "top_k_select_kernel";
        check(K, x.len() == rows * cols && vocab <= cols, || {
            format!("{} values as [{rows}, {cols}] with vocab {vocab}", x.len())
        })?;
        check(K, kmax <= TOP_K_MAX, || {
            format!("top-k {kmax} is more than the kernel's {TOP_K_MAX}")
        })?;
        if rows == 0 || kmax == 0 {
            return Ok(());
        }
        let (ci, vi, ki) = (
            i32_of(K, "cols", cols)?,
            i32_of(K, "vocab", vocab)?,
            i32_of(K, "k", kmax)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (i32_of(K, "rows", rows)? as u32, 1, 1),
            block_dim: (SEL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let [idx, val, cnt] = out;
        let mut b = self.launch(self.func(K)?);
        b.arg(x)
            .arg(&ci)
            .arg(&vi)
            .arg(&ks)
            .arg(&ki)
            .arg(&idx)
            .arg(&val)
            .arg(&cnt);
        self.launched(K, unsafe { b.launch(cfg) })
    }
}
