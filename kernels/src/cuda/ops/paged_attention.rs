//! Causal GQA attention over the paged KV cache on tensor cores (paged_attention.cu).
//!
//! Two kernels compute rows with the same bits: the prefill kernel takes tiles of 64 (16
//! rows a warp, or one warpgroup's wgmma on sm_90a: paged_attention_wg.cu) or 96 (32 rows
//! a warp) consecutive rows of one sequence, the decode kernel
//! one row (its GQA heads as the tile's rows) and one split of its keys, with a combine
//! kernel folding the splits. Which rows go to which kernel, and which prefill build runs
//! ([`PrefillTiles`], `ARBOR_ATTN_PREFILL_ROWS`), is a speed choice only ([`AttnRouting`]).

use cudarc::driver::LaunchConfig;

use super::{arg_bf16_out, check, check_bf16_out, i32_of, output, DevBf16, DevF32, DevU32};
use crate::cuda::{CudaError, GpuDevice};
use crate::paged::{splits_of, PagedKvLayout, ATTN_SPLIT, KV_BLOCK};

use super::paged_tiles::{
    decode_kernel, decode_smem_bytes, live_ctas, padded_head_dim, prefill_smem_bytes, DecodeBuild,
    DECODE_BUILD_ENV, DECODE_WIDE_ENV,
};
pub use super::paged_tiles::{PrefillTiles, PREFILL_ROWS_ENV};

/// A sequence with at least this many rows in a step goes to the prefill kernel; fewer
/// rows are cheaper one by one, with their keys cut into splits.
pub const PREFILL_MIN_ROWS: usize = 16;
/// paged_attention.cu `pa_combine`: its `__launch_bounds__`.
const COMBINE_THREADS: u32 = 128;

/// The rows of a step as the kernels read them, in device memory the caller keeps alive:
/// per query row its position and the offset of its sequence's block table in `table`
/// (the step's tables, concatenated).
#[derive(Debug, Clone, Copy)]
pub struct PagedRows {
    rows: usize,
    pos: u64,
    table_off: u64,
    table: u64,
}

impl PagedRows {
    /// # Safety
    /// `pos` and `table_off` are device addresses of `rows` u32 each, `table` of the block
    /// tables, on the device the rows are used with; for every row r, the entries
    /// `table[table_off[r] .. table_off[r] + pos[r] / KV_BLOCK + 1]` exist and are block
    /// ids of the cache the rows are used with. (The callers check this on the host
    /// before uploading: `check_tables`.)
    pub unsafe fn from_device(rows: usize, pos: u64, table_off: u64, table: u64) -> Self {
        Self {
            rows,
            pos,
            table_off,
            table,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// Checks on the host what [`PagedRows::from_device`] requires of the data it will point
/// at: every row's table range within `table`, every block id below `blocks`.
pub fn check_tables(
    pos: &[u32],
    table_off: &[u32],
    table: &[u32],
    blocks: usize,
) -> Result<(), CudaError> {
    const K: &str = "paged attention";
    check(K, pos.len() == table_off.len(), || {
        format!(
            "{} positions for {} table offsets",
            pos.len(),
            table_off.len()
        )
    })?;
    for (r, (&p, &t)) in pos.iter().zip(table_off).enumerate() {
        let end = t as usize + p as usize / KV_BLOCK + 1;
        check(K, end <= table.len(), || {
            format!(
                "row {r} at position {p} needs block-table entries {t}..{end}, the step has {}",
                table.len()
            )
        })?;
        if let Some(&b) = table[t as usize..end]
            .iter()
            .find(|&&b| b as usize >= blocks)
        {
            return Err(CudaError::Launch {
                kernel: K,
                msg: format!("row {r}: block {b} of a cache with {blocks} blocks"),
            });
        }
    }
    Ok(())
}

/// A sequence's rows in a step: its first row in q, the number of rows, the position of
/// the first, and where its block table starts in the step's tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    pub row0: usize,
    pub len: usize,
    pub pos0: usize,
    pub table0: usize,
}

/// Which rows of a step each kernel computes: prefill tiles for long runs of one
/// sequence's rows, the decode kernel for the others. Built once per step; the bits of a
/// row do not depend on it.
pub struct AttnRouting {
    tiles: Option<DevU32>,
    n_tiles: usize,
    /// The rows the decode kernel takes; `None`: rows 0..n_decode in order.
    decode: Option<DevU32>,
    n_decode: usize,
    /// Grid depth of the decode kernel: at least the splits of its longest row.
    max_splits: usize,
    /// The decode kernel's build; `None`: by the launch's size
    /// ([`DecodeBuild::for_launch`], or `ARBOR_ATTN_DECODE`).
    decode_build: Option<DecodeBuild>,
    /// The prefill build the tiles were cut for.
    prefill: PrefillTiles,
}

impl AttnRouting {
    /// The split depth for rows up to position `pos_end - 1`, rounded up to a power of two
    /// (so that a recorded step stays valid while contexts grow a little).
    pub fn split_bucket(pos_end: usize) -> usize {
        splits_of(pos_end.saturating_sub(1)).next_power_of_two()
    }

    pub fn max_splits(&self) -> usize {
        self.max_splits
    }

    pub fn prefill_tiles(&self) -> PrefillTiles {
        self.prefill
    }

    /// The same routing with the decode kernel's variant fixed (tests, A/B benchmarks).
    pub fn with_decode_build(mut self, build: DecodeBuild) -> Self {
        self.decode_build = Some(build);
        self
    }
}

/// The decode build [`DECODE_BUILD_ENV`] forces (`None`: unset) and whether the rule may
/// take the wide build ([`DECODE_WIDE_ENV`]), for A/B benchmarks; read once. A value
/// either variable does not take is an error at every launch.
fn decode_build_env() -> Result<(Option<DecodeBuild>, bool), CudaError> {
    static S: std::sync::OnceLock<Result<(Option<DecodeBuild>, bool), String>> =
        std::sync::OnceLock::new();
    S.get_or_init(|| {
        let forced = DecodeBuild::from_env_value(std::env::var(DECODE_BUILD_ENV).ok().as_deref())?;
        let wide = DecodeBuild::wide_allowed(std::env::var(DECODE_WIDE_ENV).ok().as_deref())?;
        Ok((forced, wide))
    })
    .clone()
    .map_err(|msg| CudaError::Launch {
        kernel: "paged attention",
        msg,
    })
}

/// `ARBOR_ATTN_PREFILL_ROWS` (64, 96 or wgmma): the prefill build, for A/B benchmarks; read
/// once (a build that does not run on the device or head dim falls back to 64 rows).
/// Unset: `None` (each step's build by [`PrefillTiles::default_for`]); any other value is
/// an error at every routing.
fn prefill_tiles_env() -> Result<Option<PrefillTiles>, CudaError> {
    static S: std::sync::OnceLock<Result<Option<PrefillTiles>, String>> =
        std::sync::OnceLock::new();
    S.get_or_init(|| {
        let v = std::env::var(PREFILL_ROWS_ENV).ok();
        PrefillTiles::from_env_value(v.as_deref())
    })
    .clone()
    .map_err(|msg| CudaError::Launch {
        kernel: "paged attention",
        msg,
    })
}

/// The prefill tiles (4 u32 each: first q row, rows, first position, table offset) of
/// `rows` rows at most, for every sequence of at least [`PREFILL_MIN_ROWS`] rows when the
/// padded head dim `hd` has a prefill kernel; the other rows go to the decode kernel
/// (their q rows, and the largest position among them).
fn route_rows(
    seqs: &[SeqSpan],
    hd: usize,
    rows: usize,
) -> Result<(Vec<u32>, Vec<u32>, usize), CudaError> {
    let (mut tiles, mut decode) = (Vec::new(), Vec::new());
    let mut max_pos = 0usize;
    for s in seqs {
        if s.len >= PREFILL_MIN_ROWS && hd <= 128 {
            for t0 in (0..s.len).step_by(rows) {
                let n = (s.len - t0).min(rows);
                for v in [s.row0 + t0, n, s.pos0 + t0, s.table0] {
                    tiles.push(u32::try_from(v).map_err(|_| CudaError::Launch {
                        kernel: "paged attention",
                        msg: format!("tile value {v} does not fit u32"),
                    })?);
                }
            }
        } else {
            for i in 0..s.len {
                decode.push((s.row0 + i) as u32);
                max_pos = max_pos.max(s.pos0 + i);
            }
        }
    }
    Ok((tiles, decode, max_pos))
}

impl GpuDevice {
    /// The routing of a ragged step whose sequences are `seqs` (rows in q order) for a
    /// model of `head_dim`, with the prefill build `ARBOR_ATTN_PREFILL_ROWS` names, or
    /// when unset the one [`PrefillTiles::default_for`] picks for the device, the head dim
    /// and the step's prefill runs.
    pub fn attn_routing(
        &self,
        seqs: &[SeqSpan],
        head_dim: usize,
    ) -> Result<AttnRouting, CudaError> {
        let build = match prefill_tiles_env()? {
            Some(b) => b,
            None => PrefillTiles::default_for(
                &self.arch,
                head_dim,
                seqs.iter()
                    .filter(|s| s.len >= PREFILL_MIN_ROWS)
                    .map(|s| s.pos0 + s.len)
                    .max()
                    .unwrap_or(0),
            ),
        };
        self.attn_routing_with(seqs, head_dim, build)
    }

    /// [`GpuDevice::attn_routing`] with the prefill build given (tests, A/B benchmarks).
    pub fn attn_routing_with(
        &self,
        seqs: &[SeqSpan],
        head_dim: usize,
        prefill: PrefillTiles,
    ) -> Result<AttnRouting, CudaError> {
        const K: &str = "paged attention";
        let hd = padded_head_dim(head_dim).ok_or_else(|| CudaError::Launch {
            kernel: K,
            msg: format!("head_dim {head_dim} is above 256"),
        })?;
        let prefill = prefill.or_fallback(&self.arch, head_dim);
        let (tiles, decode, max_pos) = route_rows(seqs, hd, prefill.rows())?;
        let n_tiles = tiles.len() / 4;
        let n_decode = decode.len();
        Ok(AttnRouting {
            tiles: (n_tiles > 0)
                .then(|| self.upload("attention tiles", &tiles))
                .transpose()?,
            n_tiles,
            decode: (n_decode > 0)
                .then(|| self.upload("attention decode rows", &decode))
                .transpose()?,
            n_decode,
            max_splits: splits_of(max_pos),
            decode_build: None,
            prefill,
        })
    }

    /// Every one of `rows` rows through the decode kernel, in order, with grid depth
    /// `max_splits` (a recorded step's bucket: [`AttnRouting::split_bucket`]).
    pub fn attn_routing_decode(&self, rows: usize, max_splits: usize) -> AttnRouting {
        AttnRouting {
            tiles: None,
            n_tiles: 0,
            decode: None,
            n_decode: rows,
            max_splits: max_splits.max(1),
            decode_build: None,
            prefill: PrefillTiles::Rows96,
        }
    }

    /// Causal GQA attention of `q` (`[rows, n_heads·head_dim]` f32) against the paged
    /// cache (`k`, `v` of `layout`), layer `layer`: row r sees the keys `0..=pos[r]` of its
    /// sequence. Returns `[rows, n_heads·head_dim]` f32; `outb`, when given, gets the same
    /// values rounded to bf16. `scale`: the softmax's factor on q·k.
    ///
    /// The positions must stay below `pos_limit`, which the caller checked on the host
    /// (for a decode routing, the rows' splits must not exceed its `max_splits`).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        q: &DevF32,
        k: &DevBf16,
        v: &DevBf16,
        layout: PagedKvLayout,
        layer: usize,
        rows: &PagedRows,
        routing: &AttnRouting,
        n_heads: usize,
        scale: f32,
        outb: Option<&mut DevBf16>,
    ) -> Result<DevF32, CudaError> {
        self.paged_attention_into(
            q, k, v, layout, layer, rows, routing, n_heads, scale, None, outb,
        )
    }

    /// The decode kernel's build for `routing`'s decode rows: the routing's own, else the
    /// one `ARBOR_ATTN_DECODE` forces, else [`DecodeBuild::for_launch`] of the launch's
    /// grid (rows × KV heads × head tiles × splits).
    pub fn decode_build(
        &self,
        routing: &AttnRouting,
        n_heads: usize,
        layout: PagedKvLayout,
    ) -> Result<DecodeBuild, CudaError> {
        let hd = padded_head_dim(layout.head_dim).ok_or_else(|| CudaError::Launch {
            kernel: "paged attention",
            msg: format!("head_dim {} is above 256", layout.head_dim),
        })?;
        self.decode_build_at(routing, hd, n_heads, layout.n_kv_heads)
    }

    /// [`GpuDevice::decode_build`] at padded head dim `hd`.
    fn decode_build_at(
        &self,
        routing: &AttnRouting,
        hd: usize,
        n_heads: usize,
        n_kv_heads: usize,
    ) -> Result<DecodeBuild, CudaError> {
        let htiles = (n_heads / n_kv_heads.max(1)).div_ceil(16);
        let per_split = routing.n_decode * n_kv_heads * htiles;
        let ctas = per_split * routing.max_splits;
        let live = live_ctas(per_split, routing.max_splits);
        let (forced, wide) = decode_build_env()?;
        let smem = self.smem_per_block;
        Ok(routing
            .decode_build
            .or(forced)
            .filter(|&b| b.runs(hd, smem))
            .unwrap_or_else(|| DecodeBuild::for_launch(ctas, live, self.sms, hd, wide, smem)))
    }

    /// [`GpuDevice::paged_attention`] written into `out` when given (`q`'s length).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_into(
        &self,
        q: &DevF32,
        k: &DevBf16,
        v: &DevBf16,
        layout: PagedKvLayout,
        layer: usize,
        rows: &PagedRows,
        routing: &AttnRouting,
        n_heads: usize,
        scale: f32,
        out: Option<DevF32>,
        outb: Option<&mut DevBf16>,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "paged attention";
        let PagedKvLayout {
            n_kv_heads,
            head_dim,
            ..
        } = layout;
        check_bf16_out(K, &outb, q.len())?;
        let hd = padded_head_dim(head_dim).ok_or_else(|| CudaError::Launch {
            kernel: K,
            msg: format!("head_dim {head_dim} is above 256"),
        })?;
        check(K, head_dim > 0 && head_dim.is_multiple_of(2), || {
            format!("head_dim {head_dim} is not even")
        })?;
        check(K, layer < layout.layers, || {
            format!("layer {layer} of a cache with {} layers", layout.layers)
        })?;
        check(
            K,
            n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
            || format!("{n_heads} query heads are not a multiple of {n_kv_heads} KV heads"),
        )?;
        check(K, q.len() == rows.rows * n_heads * head_dim, || {
            format!(
                "q has {} values, expected {}×{n_heads}×{head_dim}",
                q.len(),
                rows.rows
            )
        })?;
        check(
            K,
            k.len() == layout.len() && v.len() == layout.len(),
            || "cache buffers do not match their layout".into(),
        )?;
        check(K, routing.n_tiles == 0 || hd <= 128, || {
            format!("prefill tiles for head_dim {head_dim} (decode only above 128)")
        })?;
        let mut out = output(self, K, out, q.len())?;
        if rows.rows == 0 || n_heads == 0 {
            return Ok(out);
        }
        let sl = scale * std::f32::consts::LOG2_E;
        let hi = i32_of(K, "n_heads", n_heads)?;
        let kvi = i32_of(K, "n_kv_heads", n_kv_heads)?;
        let di = i32_of(K, "head_dim", head_dim)?;
        let layer_blocks = (layer * layout.blocks) as i64;
        let mut outb = outb;

        if let Some(tiles) = &routing.tiles {
            let pt = routing.prefill;
            check(K, pt.runs(&self.arch, head_dim), || {
                format!(
                    "the {pt:?} prefill build does not run head_dim {head_dim} on {}",
                    self.arch
                )
            })?;
            let name = pt.kernel(hd).ok_or_else(|| CudaError::Launch {
                kernel: K,
                msg: format!("no prefill kernel for head_dim {head_dim} ({pt:?})"),
            })?;
            let nt = i32_of(K, "tiles", routing.n_tiles)?;
            let mut b = self.launch(self.func(name)?);
            b.arg(q).arg(k).arg(v).out(&mut out);
            arg_bf16_out(&mut b, outb.as_deref_mut());
            b.arg(tiles)
                .arg(&rows.table)
                .arg(&nt)
                .arg(&hi)
                .arg(&kvi)
                .arg(&di);
            b.arg(&sl).arg(&layer_blocks);
            let cfg = LaunchConfig {
                grid_dim: (routing.n_tiles as u32, n_heads as u32, 1),
                block_dim: (pt.threads() as u32, 1, 1),
                shared_mem_bytes: prefill_smem_bytes(hd, pt) as u32,
            };
            self.launched(name, unsafe { b.launch(cfg) })?;
        }

        if routing.n_decode > 0 {
            let ms = routing.max_splits;
            let msi = i32_of(K, "splits", ms)?;
            let htiles = (n_heads / n_kv_heads).div_ceil(16);
            let build = self.decode_build_at(routing, hd, n_heads, n_kv_heads)?;
            let name = decode_kernel(hd, build).ok_or_else(|| CudaError::Launch {
                kernel: K,
                msg: format!("no decode kernel for head_dim {head_dim} in the {build:?} build"),
            })?;
            // Split states: [decode rows][n_heads][splits][head_dim + 2] (acc, m, l).
            let part_len = if ms > 1 {
                routing.n_decode * n_heads * ms * (head_dim + 2)
            } else {
                1
            };
            let mut part: DevF32 = self.alloc(part_len)?;
            let no_rows = 0u64;
            let mut b = self.launch(self.func(name)?);
            b.arg(q).arg(k).arg(v).out(&mut out);
            arg_bf16_out(&mut b, outb.as_deref_mut());
            b.out(&mut part);
            match &routing.decode {
                Some(d) => b.arg(d),
                None => b.arg(&no_rows),
            };
            b.arg(&rows.pos).arg(&rows.table_off).arg(&rows.table);
            b.arg(&hi)
                .arg(&kvi)
                .arg(&di)
                .arg(&sl)
                .arg(&layer_blocks)
                .arg(&msi);
            let cfg = LaunchConfig {
                grid_dim: (
                    routing.n_decode as u32,
                    (n_kv_heads * htiles) as u32,
                    ms as u32,
                ),
                block_dim: (build.threads(), 1, 1),
                shared_mem_bytes: decode_smem_bytes(hd, build) as u32,
            };
            self.launched(name, unsafe { b.launch(cfg) })?;
            if ms > 1 {
                const C: &str = "pa_combine";
                let mut b = self.launch(self.func(C)?);
                b.out(&mut out);
                arg_bf16_out(&mut b, outb);
                b.arg(&part);
                match &routing.decode {
                    Some(d) => b.arg(d),
                    None => b.arg(&no_rows),
                };
                b.arg(&rows.pos).arg(&hi).arg(&di).arg(&msi);
                let cfg = LaunchConfig {
                    grid_dim: (
                        routing.n_decode as u32,
                        combine_blocks_per_row(n_heads, head_dim),
                        1,
                    ),
                    block_dim: (COMBINE_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                self.launched(C, unsafe { b.launch(cfg) })?;
            }
        }
        Ok(out)
    }
}

/// `pa_combine`'s blocks per row: one thread for each pair of dims of each head.
fn combine_blocks_per_row(n_heads: usize, head_dim: usize) -> u32 {
    (n_heads * head_dim / 2).div_ceil(COMBINE_THREADS as usize) as u32
}

/// Positions a decode routing of `max_splits` serves: below this, every row's splits fit.
pub fn decode_pos_limit(max_splits: usize) -> usize {
    max_splits * ATTN_SPLIT
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(row0: usize, len: usize, pos0: usize, table0: usize) -> SeqSpan {
        SeqSpan {
            row0,
            len,
            pos0,
            table0,
        }
    }

    #[test]
    fn tiles_follow_the_build_rows() {
        // A 200-row sequence from position 37, a 15-row one (decode), a 16-row one.
        let seqs = [
            span(0, 200, 37, 0),
            span(200, 15, 500, 9),
            span(215, 16, 0, 20),
        ];
        let (t96, d96, mx96) = route_rows(&seqs, 128, PrefillTiles::Rows96.rows()).unwrap();
        assert_eq!(
            t96,
            [0, 96, 37, 0, 96, 96, 133, 0, 192, 8, 229, 0, 215, 16, 0, 20]
        );
        let (t64, d64, mx64) = route_rows(&seqs, 128, PrefillTiles::Rows64.rows()).unwrap();
        assert_eq!(
            t64,
            [0, 64, 37, 0, 64, 64, 101, 0, 128, 64, 165, 0, 192, 8, 229, 0, 215, 16, 0, 20]
        );
        // The decode rows do not depend on the build.
        assert_eq!(d96, (200..215).collect::<Vec<u32>>());
        assert_eq!((d64, mx64), (d96.clone(), mx96));
        assert_eq!(mx96, 514);
        // Above head_dim 128 every row decodes.
        let (t, d, _) = route_rows(&seqs, 256, 96).unwrap();
        assert!(t.is_empty() && d.len() == 231);
    }

    #[test]
    fn tables_are_checked() {
        assert!(check_tables(&[0, 70], &[0, 1], &[5, 6, 7], 8).is_ok());
        let e = check_tables(&[0, 130], &[0, 1], &[5, 6, 7], 8).unwrap_err();
        assert!(
            e.to_string().contains("needs block-table entries 1..4"),
            "{e}"
        );
        let e = check_tables(&[0], &[0], &[9], 8).unwrap_err();
        assert!(
            e.to_string().contains("block 9 of a cache with 8 blocks"),
            "{e}"
        );
    }
}

#[cfg(test)]
#[path = "paged_attention_gpu_test.rs"]
mod gpu_test;
