//! The default path of a call: the table `bench gemm` measured, as pure functions of the
//! shape and the device (docs/gemm.md).

use super::error::GemmError;
use super::path::{packs_waves, Family, Path, QUAD128_BNS, QUAD_BNS, TMA_BNS};
use super::spread::{spread_enabled, spread_path, SPREAD_ENV, SPREAD_ROWS};
use super::swap::{swap_form, swap_rule, SwapRule, SWAP_ENV};
use super::switch::switch;
use crate::cpu::matmul::TreeMatmul;

/// The variable that lets the default path take the 128-row quad tiles
/// ([`quad128_tile`]): `1` on, `0` off, unset [`QUAD128_BY_DEFAULT`].
pub const QUAD128_ENV: &str = "ARBOR_GEMM_M256";

/// Whether [`quad128_tile`] applies when [`QUAD128_ENV`] is unset: on, where it was
/// measured faster (docs/gemm.md run 15).
pub const QUAD128_BY_DEFAULT: bool = true;

/// [`QUAD128_ENV`]'s value (`None`: unset) as a switch.
pub fn quad128_enabled(value: Option<&str>) -> Result<bool, GemmError> {
    switch(
        QUAD128_ENV,
        value,
        QUAD128_BY_DEFAULT,
        "expected 1 (128-row quad tiles for 97 <= M <= 256 where they fill one wave) or 0",
    )
}

/// The variable that sets the rows from which the default path takes the persistent
/// kernel's narrower tiles ([`tma_tile`]): `1` from [`NARROW_FROM_ROWS`], `from:ROWS` from
/// that many rows (to re-measure the rule), `0` never; unset [`NARROW_BY_DEFAULT`].
pub const NARROW_ENV: &str = "ARBOR_GEMM_NARROW";

/// Whether [`tma_tile`] applies when [`NARROW_ENV`] is unset.
pub const NARROW_BY_DEFAULT: bool = true;

/// [`NARROW_ENV`]'s value (`None`: unset): the rows from which the narrow tiles apply, or
/// `None` for never.
pub fn narrow_from(value: Option<&str>) -> Result<Option<usize>, GemmError> {
    let value = value.map(str::trim);
    if let Some(rows) = value.and_then(|v| v.strip_prefix("from:")) {
        return match rows.trim().parse::<usize>() {
            Ok(r) if r > 0 => Ok(Some(r)),
            _ => Err(GemmError::Env {
                var: NARROW_ENV,
                value: value.unwrap_or_default().to_string(),
                msg: "from:ROWS takes a row count of at least 1",
            }),
        };
    }
    let on = switch(
        NARROW_ENV,
        value,
        NARROW_BY_DEFAULT,
        "expected 1 (the persistent kernel's 128-row tiles narrower than 128 columns where they fill the SMs' rounds better, from 256 rows), from:ROWS or 0",
    )?;
    Ok(on.then_some(NARROW_FROM_ROWS))
}

/// Rows from which the default path may take the persistent kernel's narrow tiles
/// ([`tma_tile`]). At 192 rows the decode step was slower with them (13.85 ms against 13.12
/// on an H100, docs/gemm.md run 22), at 256 faster (12.11 against 12.26).
pub const NARROW_FROM_ROWS: usize = 256;

/// The persistent kernel's tile width (one of [`TMA_BNS`]) for a call of at least
/// `from_rows` rows ([`NARROW_FROM_ROWS`] by default) on `sms` SMs: the width whose rounds
/// of tiles over the SMs cost least, a round of 128×`bn` tiles costed as `bn + 24` columns
/// (each tile's X rows and its tree do not shrink with `bn`), the widest among equals.
/// `bench gemm` on an H100 (docs/gemm.md run 22) found the width this cost picks fastest
/// at all 20 of its llama3-8b points from M = 256 to 1024: at M = 256 q/k/v (N 6144) 96
/// columns, 31.0 µs against 35.1 for 128 (128 tiles in one round where 128 columns make
/// 96), o 64 (22.9 against 27.6 for the quad tiles), down 64 (61.1 against 66.7), gate/up
/// 96 (127.1 against 129.7). 112 columns lost at every point.
/// Fewer rows: 128 (the `wgwhole` and `wgquad128x` rules cover most of those).
pub fn tma_tile(m: usize, n: usize, sms: usize, from_rows: usize) -> usize {
    if m < from_rows || sms == 0 {
        return 128;
    }
    let cost = |bn: usize| (m.div_ceil(128) * n.div_ceil(bn)).div_ceil(sms) * (bn + 24);
    TMA_BNS.into_iter().fold(
        128,
        |best, bn| if cost(bn) < cost(best) { bn } else { best },
    )
}

/// The variable that sets how the persistent kernels (`wgtma128*`) store their results: by
/// TMA from shared memory, overlapping the next tile, or from registers. Unset, `auto` or
/// `partial`: by TMA every warpgroup with a row below M, the TMA unit clipping the box at
/// M ([`TmaStore::Partial`]); `1` by TMA only a warpgroup whose 64 rows all lie below M,
/// the rest from registers; `0` from registers. Every way gives the same bits.
pub const TMA_STORE_ENV: &str = "ARBOR_GEMM_TMA_STORE";

/// How the persistent kernels store their results ([`TMA_STORE_ENV`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TmaStore {
    /// `0`: from registers.
    Off,
    /// `1`: by TMA where a warpgroup's 64 rows all lie below M, the rest from registers.
    Whole,
    /// The default: by TMA wherever a warpgroup has a row below M. Measured on an H100
    /// (gemm-log run 25), the decode step against [`TmaStore::Whole`]: 72 rows 9.06 ms
    /// against 9.55–9.64, 112 rows 8.37–8.39 against 9.04–9.05, 160 rows 11.73–11.75
    /// against 12.24–12.29, 224 rows 12.11–12.14 against 13.57–13.63; where no warpgroup
    /// straddles M (1, 128, 192, 256 rows) the same.
    Partial,
}

/// [`TMA_STORE_ENV`]'s value (`None`: unset).
pub fn tma_store(value: Option<&str>) -> Result<TmaStore, GemmError> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") | Some("partial") => Ok(TmaStore::Partial),
        Some("1") => Ok(TmaStore::Whole),
        Some("0") => Ok(TmaStore::Off),
        Some(v) => Err(GemmError::Env {
            var: TMA_STORE_ENV,
            value: v.to_string(),
            msg: "expected auto or partial (the default: by TMA wherever a warpgroup has a row below M), 1 (only where its rows all do) or 0",
        }),
    }
}

/// The variable that lets a persistent or tall-tile kernel's consumer warpgroup whose 64
/// rows all lie at or past M (the last tile of 129–192 rows) skip its wgmma: `1` on, `0`
/// off, unset [`SKIP_IDLE_BY_DEFAULT`]. Either gives the same bits (those rows are never
/// stored).
pub const SKIP_IDLE_ENV: &str = "ARBOR_GEMM_SKIP_IDLE";

/// Whether idle warpgroups skip their wgmma when [`SKIP_IDLE_ENV`] is unset.
pub const SKIP_IDLE_BY_DEFAULT: bool = true;

/// [`SKIP_IDLE_ENV`]'s value (`None`: unset) as a switch.
pub fn skip_idle_enabled(value: Option<&str>) -> Result<bool, GemmError> {
    switch(
        SKIP_IDLE_ENV,
        value,
        SKIP_IDLE_BY_DEFAULT,
        "expected 1 (warpgroups with no row below M run no wgmma) or 0",
    )
}

/// The variable that turns the persistent kernels' tail split on (`1`, the default) or off
/// (`0`): where the tiles of a last, partial round of the grid fill at most half of it,
/// each is done by two blocks, one per half of its segments, the tree unchanged
/// (`tma::tail_tiles`). The same bits either way.
pub const TAIL_SPLIT_ENV: &str = "ARBOR_GEMM_TAIL_SPLIT";

/// Whether the tail split applies when [`TAIL_SPLIT_ENV`] is unset.
pub const TAIL_SPLIT_BY_DEFAULT: bool = true;

/// [`TAIL_SPLIT_ENV`]'s value (`None`: unset) as a switch.
pub fn tail_split_enabled(value: Option<&str>) -> Result<bool, GemmError> {
    switch(
        TAIL_SPLIT_ENV,
        value,
        TAIL_SPLIT_BY_DEFAULT,
        "expected 1 (a last round at most half full runs as half tiles) or 0",
    )
}

/// The variable that sets the order in which a persistent kernel's (`wgtma128*`) blocks
/// take their tiles. Unset or `groups`: block b takes tiles b, b + blocks, b + 2·blocks,
/// …, walking N in groups of 8 row tiles. `columns:ROWS`: at most ROWS rows, where the
/// call has at least as many column tiles as the device has SMs, each block takes every
/// row tile of a column before its next column, so one SM reads each W tile for all its
/// rows (`columns`: up to [`COLUMN_ORDER_ROWS`]). The same bits either way (a tile's
/// values do not depend on when it runs).
pub const TILE_ORDER_ENV: &str = "ARBOR_GEMM_TILE_ORDER";

/// The rows up to which `ARBOR_GEMM_TILE_ORDER=columns` orders tiles by column: two row
/// tiles, decode's band.
pub const COLUMN_ORDER_ROWS: usize = 256;

/// [`TILE_ORDER_ENV`]'s value (`None`: unset) as the most rows a call may have to take its
/// tiles by column (`None`: never).
pub fn column_order_rows(value: Option<&str>) -> Result<Option<usize>, GemmError> {
    match value.map(str::trim) {
        None | Some("") | Some("groups") => Ok(None),
        Some("columns") => Ok(Some(COLUMN_ORDER_ROWS)),
        Some(v) => match v
            .strip_prefix("columns:")
            .map(|r| r.trim().parse::<usize>())
        {
            Some(Ok(rows)) => Ok(Some(rows)),
            _ => Err(GemmError::Env {
                var: TILE_ORDER_ENV,
                value: v.to_string(),
                msg: "expected groups (the default), columns or columns:ROWS",
            }),
        },
    }
}

/// Whether a persistent call of `m` rows and `column_tiles` column tiles on `sms` SMs
/// takes its tiles by column under [`column_order_rows`]'s `rows`: only where every block
/// gets a column of its own (with fewer columns, ordering by column would leave SMs idle
/// that the row tiles now fill).
pub fn column_order(rows: Option<usize>, m: usize, column_tiles: usize, sms: usize) -> bool {
    rows.is_some_and(|r| m <= r) && column_tiles >= sms
}

/// The `wgwhole` tile width the default path takes for an M ≤ 64 call on `sms` SMs, if
/// any: where its grid runs in waves that are each at least 3/4 full (whole-K blocks are
/// one per SM, so a partial last wave idles SMs), and only where `bench gemm` found it
/// faster than the cluster kernels (H200, docs/gemm.md run 11): the 224-column tiles below
/// M = 32 (4096 × 28672: 65.9 µs against 69.4 at M = 1), the 112-column ones from M = 32
/// (4096 × 28672 at M = 64: 67.6 against 79.5; 4096 × 14336: 36.9 against 43.6), the
/// 64-column ones above M = 32 (4096 × 7168 at M = 64: 23.2 against 25.2). Narrower N
/// (q/k/v, o, down) stays on the cluster kernels, which split K over more blocks.
pub fn whole_tile(m: usize, n: usize, sms: usize) -> Option<usize> {
    let full_waves = |bn: usize, one_wave: bool| {
        let blocks = n.div_ceil(bn) * m.div_ceil(64);
        fills_waves(blocks, sms) && (!one_wave || blocks <= sms)
    };
    match m {
        0..=31 => full_waves(224, true).then_some(224),
        32 => full_waves(112, false).then_some(112),
        _ => [112, 64].into_iter().find(|&bn| full_waves(bn, false)),
    }
}

/// The `wgquad` tile width the default path takes for a call on `sms` SMs, if any: above
/// M = 32 (below it the cluster kernels were faster at every shape), the widest of
/// [`QUAD_BNS`] whose blocks fill full waves. `bench gemm` on an H200 (docs/gemm.md run 12)
/// at M = 64: 4096 × 4096 16.8 µs against 18.2, 4096 × 6144 21.2 against 22.6, 14336 × 4096
/// 37.2 against 39.6.
pub fn quad_tile(m: usize, n: usize, n_seg: usize, sms: usize) -> Option<usize> {
    if !(33..=64).contains(&m) {
        return None;
    }
    QUAD_BNS
        .into_iter()
        .find(|&bn| fills_waves(n.div_ceil(bn) * n_seg.div_ceil(4), sms))
}

/// The `wgwhole` tile width a row-parallel layer's shard of at most two segments (TP 4
/// and 8: o and down) takes at M ≤ 64. `bench gemm --tp` on an H200 (docs/gemm.md run
/// 13): at TP 4, M = 1, down (14336 × 4096) 18.5 µs against 26.7 for the 64×256 cluster
/// tiles, which make only 16 blocks of its 2 segments; o (4096 × 4096) 9.6 against 12.4;
/// at TP 8 12.3 against 15.8 and 7.2 against 8.8; within 0.5 µs of the best width at
/// every M measured.
pub fn shard_whole_tile(m: usize, n_seg: usize) -> Option<usize> {
    (m <= 64 && n_seg <= 2).then_some(64)
}

/// The `wgwhole` tile width a call of 65 ≤ M ≤ 128 (decode at batch 128, short prefills)
/// takes instead of `wgtma128`, whose one row of 128×128 tiles leaves most SMs idle on a
/// narrow layer: the widest of 112 and 64 whose two rows of blocks make one wave of at
/// least 3/4 of the SMs. `sweep-gemm-paths.sh` on an H200 at M = 128 (docs/gemm.md run 14): q/k/v
/// 4096 × 6144 26.3 µs (wgwhole112) against 37.2, o 4096 × 4096 22.1 (wgwhole64) against
/// 35.7, down 14336 × 4096 56.6 against 87.5; gate/up (4096 × 28672, 512 blocks) and the
/// LM head stay on `wgtma128` (87.7 against 126.2 for wgwhole112), as does every layer at
/// M = 256.
pub fn one_wave_whole_tile(m: usize, n: usize, sms: usize) -> Option<usize> {
    if !(65..=128).contains(&m) {
        return None;
    }
    [112, 64].into_iter().find(|&bn| {
        let blocks = n.div_ceil(bn) * m.div_ceil(64);
        blocks <= sms && fills_waves(blocks, sms)
    })
}

/// The `wgquad128x` tile width a call of 97 ≤ M ≤ 256 of eight segments (TP 1's o and
/// down at a decode batch of 128 to 256) takes instead of `wgtma128` or a `wgwhole`
/// kernel, if any: the widest of [`QUAD128_BNS`] whose grid (two blocks, a cluster, per
/// 128×`bn` tile) is one wave at least 7/8 full. `wgtma128`'s M/128 rows of whole-K tiles
/// make 64 blocks for 4096 × 4096 at M = 256, half the SMs; the quad tiles split each
/// tile's K over a cluster of two. Measured on an H100 (docs/gemm.md run 15, µs, against
/// the path before): M = 256 o 28.6 / 37.9, down 67.1 / 91.2 (128×128); M = 128 o 22.5 /
/// 24.0, down 51.1 / 63.7 (128×64). Where the grid needs a second wave (q/k/v and gate/up
/// at M = 256, every layer at M = 512) the quad tiles lost (q/k/v 52.7–56.2 / 41.7, o at
/// M = 512 51.8 / 40.4), and shards of fewer segments were not measured.
pub fn quad128_tile(m: usize, n: usize, n_seg: usize, sms: usize) -> Option<usize> {
    if !(97..=256).contains(&m) || n_seg != 8 {
        return None;
    }
    QUAD128_BNS.into_iter().find(|&bn| {
        let blocks = n.div_ceil(bn) * m.div_ceil(128) * 2;
        blocks <= sms && packs_waves(blocks, sms)
    })
}

/// Whether an M ≤ 32 call takes the 64×256 two-segment cluster tiles: where they make at
/// least 56 blocks. Fewer (a narrow q/k/v at TP 2 to 8, a row-parallel shard of four
/// segments at TP 2) leave most SMs idle, and the 128-column one-segment clusters are
/// faster (H200, docs/gemm.md run 13: TP 4 q/k/v 4096 × 1536 at M = 1 10.9 µs against 12.7,
/// TP 2 down 23.4 against 32.9); at 56 and more (TP 8 gate/up 4096 × 3584, TP 1 o) they
/// are at least as fast.
pub fn wide_cluster_fits(n: usize, n_seg: usize) -> bool {
    n.div_ceil(256) * n_seg.div_ceil(2) >= 56
}

/// Whether a grid of `blocks` blocks, one per SM at a time, runs in waves that are each at
/// least 3/4 full (a partial last wave idles SMs while the slowest blocks finish).
fn fills_waves(blocks: usize, sms: usize) -> bool {
    if blocks == 0 || sms == 0 {
        return false;
    }
    let last = blocks - (blocks - 1) / sms * sms;
    4 * last >= 3 * sms
}

/// The on/off rules of [`default_path_for`], each from its variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Switches {
    /// [`QUAD128_ENV`]: the 128-row quad tiles.
    pub quad128: bool,
    /// [`NARROW_ENV`]: the rows from which the persistent kernel's narrower tiles apply
    /// (`None`: never).
    pub narrow_from: Option<usize>,
    /// [`SWAP_ENV`]: where the swapped-operand kernels apply.
    pub swap: SwapRule,
    /// [`SPREAD_ENV`]: calls of few tiles spread over the cluster kernels.
    pub spread: bool,
}

impl Switches {
    /// The switches from the process's environment.
    pub fn from_env() -> Result<Self, GemmError> {
        Ok(Switches {
            quad128: quad128_enabled(std::env::var(QUAD128_ENV).ok().as_deref())?,
            narrow_from: narrow_from(std::env::var(NARROW_ENV).ok().as_deref())?,
            swap: swap_rule(std::env::var(SWAP_ENV).ok().as_deref())?,
            spread: spread_enabled(std::env::var(SPREAD_ENV).ok().as_deref())?,
        })
    }
}

/// How many clusters of the cluster kernels the device holds at once
/// (`cuOccupancyMaxActiveClusters`; 0 where a kernel is not compiled): what decides whether
/// a grid of clusters runs in one wave.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClusterCapacity {
    /// `wgcluster64` clusters of 1, 2, 4 and 8 blocks (by log2 of the count).
    pub cluster64: [u32; 4],
    /// Swapped-kernel clusters of 1, 2, 4 and 8 blocks (by log2 of the count; one block an
    /// SM).
    pub swap: [u32; 4],
}

/// The default path of a call on a device of `sms` SMs: [`Path::for_shape`], except that
/// a TMA call takes the swapped kernel [`swap_form`] names under [`SWAP_ENV`]'s rule, and
/// a `wgcluster64` call takes a `wgwhole` kernel where [`shard_whole_tile`] or
/// [`whole_tile`] names one, a `wgquad` kernel where [`quad_tile`] does; otherwise one of
/// M ≤ 32 takes `wgcluster64x2n256` where [`wide_cluster_fits`], and a larger one whose
/// grid has more clusters than the device holds at once (`capacity.cluster64`, by
/// log2 n_seg: it would run in two waves, the second nearly empty) takes `wgcluster64x2`,
/// half the blocks. With `quad128` ([`QUAD128_ENV`]), a `wgtma128` call takes a
/// `wgquad128x` kernel where [`quad128_tile`] names one; before that, with `narrow_from`
/// ([`NARROW_ENV`]), a call of at least that many rows takes the narrower
/// persistent tiles [`tma_tile`] names, unless it ends in the SiLU·mul epilogue (`silu`)
/// and the narrow tile cannot store that by TMA: its stores from registers made the
/// gate/up layer at M = 256 slower than 128-column tiles (161.3 µs against 144.8 in the
/// decode step, docs/gemm.md run 22). Last, with `spread` ([`SPREAD_ENV`]), a call of 65 to
/// 256 rows whose path leaves half the SMs idle takes the cluster kernel [`spread_path`]
/// names. `has`: whether a path was compiled for the device.
pub fn default_path_for(
    shape: &TreeMatmul,
    family: Family,
    sms: usize,
    capacity: &ClusterCapacity,
    switches: Switches,
    silu: bool,
    has: impl Fn(Path) -> bool,
) -> Path {
    // One type for `has` at every depth, so the call below instantiates nothing new.
    let has: &dyn Fn(Path) -> bool = &has;
    if switches.spread && SPREAD_ROWS.contains(&shape.m) {
        let others = Switches {
            spread: false,
            ..switches
        };
        let path = default_path_for(shape, family, sms, capacity, others, silu, has);
        if !path.is_tma() {
            return path;
        }
        return spread_path(
            shape.m,
            shape.n,
            shape.n_seg,
            path,
            sms,
            &capacity.cluster64,
            silu,
        )
        .filter(|&p| has(p))
        .unwrap_or(path);
    }
    let Switches {
        quad128,
        narrow_from,
        swap,
        ..
    } = switches;
    let path = Path::for_shape(shape, family);
    if path.is_tma() {
        if let Some(p) =
            swap_form(shape.m, shape.n, shape.n_seg, sms, &capacity.swap, swap).filter(|&p| has(p))
        {
            return p;
        }
    }
    if let (Path::WgTma { bn: 128 }, Some(from)) = (path, narrow_from) {
        let p = Path::WgTma {
            bn: tma_tile(shape.m, shape.n, sms, from),
        };
        if p != path && has(p) && (!silu || p.tma_stores(true)) {
            return p;
        }
    }
    if path == (Path::WgTma { bn: 128 }) && quad128 {
        if let Some(p) = quad128_tile(shape.m, shape.n, shape.n_seg, sms)
            .map(|bn| Path::WgQuad128 { bn })
            .filter(|&p| has(p))
        {
            return p;
        }
    }
    if path == (Path::WgTma { bn: 128 }) {
        if let Some(p) = one_wave_whole_tile(shape.m, shape.n, sms)
            .map(|bn| Path::WgWhole { bn })
            .filter(|&p| has(p))
        {
            return p;
        }
    }
    if path == Path::WgCluster64 {
        let whole = shard_whole_tile(shape.m, shape.n_seg)
            .or_else(|| whole_tile(shape.m, shape.n, sms))
            .map(|bn| Path::WgWhole { bn });
        let quad = quad_tile(shape.m, shape.n, shape.n_seg, sms).map(|bn| Path::WgQuad { bn });
        if let Some(p) = whole.into_iter().chain(quad).find(|&p| has(p)) {
            return p;
        }
    }
    // Up to M = 32 the 64×256 tiles stream W faster at every TP 1 shape (H200,
    // docs/gemm.md run 8: 4096 × 28672 at M = 1 in 69.6 µs against 87.0, M = 16 73.2
    // against 82.8); at M = 64 the two are even (85.5 / 84.8).
    if path == Path::WgCluster64
        && shape.n_seg >= 2
        && shape.m <= 32
        && wide_cluster_fits(shape.n, shape.n_seg)
    {
        return Path::WgCluster64x2N256;
    }
    if path == Path::WgCluster64 && shape.n_seg >= 2 {
        let cap = capacity.cluster64[shape.n_seg.trailing_zeros().min(3) as usize];
        let clusters = shape.n.div_ceil(128) * shape.m.div_ceil(64);
        if clusters > cap as usize {
            return Path::WgCluster64x2;
        }
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::gemm::path::{QUAD128_BNS, QUAD_BNS, WHOLE_BNS};

    /// `wgcluster64` clusters resident at once by log2 n_seg, as an H200 reports it.
    const H200_CAP: ClusterCapacity = ClusterCapacity {
        cluster64: [248, 124, 62, 30],
        swap: [132, 66, 30, 15],
    };

    /// The Wgmma default path's name for M × N over `n_seg` segments of 512 on 132 SMs
    /// with an H200's `wgcluster64` capacity.
    fn h200_path(m: usize, n: usize, n_seg: usize, quad128: bool) -> &'static str {
        h200_path_with(
            m,
            n,
            n_seg,
            Switches {
                quad128,
                narrow_from: None,
                swap: SwapRule::Off,
                spread: false,
            },
        )
    }

    /// As [`h200_path`] with both switches given.
    fn h200_path_with(m: usize, n: usize, n_seg: usize, switches: Switches) -> &'static str {
        let shape = TreeMatmul {
            m,
            n,
            k: 512 * n_seg,
            seg_len: 512,
            n_seg,
        };
        default_path_for(
            &shape,
            Family::Wgmma,
            132,
            &H200_CAP,
            switches,
            false,
            |_| true,
        )
        .name()
    }

    /// The default paths of the llama3-8b layers at TP 1, 2, 4 and 8 on 132 SMs, as
    /// `bench gemm` (and `--tp`) measured them fastest or within noise of it on an H200
    /// (docs/gemm.md runs 8, 11, 12 and 13).
    #[test]
    fn default_paths_of_every_tp_follow_the_measurements() {
        let pick = |m: usize, n: usize, n_seg: usize| h200_path(m, n, n_seg, false);
        let cases = [
            // TP 1: q/k/v, o (and down), gate/up at decode batches.
            (1, 6144, 8, "wgcluster64x2n256"),
            (32, 6144, 8, "wgcluster64x2n256"),
            (1, 4096, 8, "wgcluster64x2n256"),
            (64, 4096, 8, "wgquad64"),
            (64, 6144, 8, "wgquad96"),
            (8, 28672, 8, "wgwhole224"),
            (64, 28672, 8, "wgwhole112"),
            // TP 1 at M = 128: q/k/v, o and down on whole-K tiles, gate/up and the LM head
            // on wgtma128, as everything at M = 256.
            (128, 6144, 8, "wgwhole112"),
            (128, 4096, 8, "wgwhole64"),
            (96, 4096, 8, "wgwhole64"),
            (128, 28672, 8, "wgtma128"),
            (128, 128256, 8, "wgtma128"),
            (256, 4096, 8, "wgtma128"),
            (256, 6144, 8, "wgtma128"),
            // TP 2: q/k/v (3072), o and down (four segments), gate/up (14336).
            (1, 3072, 8, "wgcluster64"),
            (32, 3072, 8, "wgcluster64"),
            (1, 4096, 4, "wgcluster64"),
            (32, 4096, 4, "wgcluster64"),
            (64, 4096, 4, "wgcluster64"),
            (1, 14336, 8, "wgcluster64x2n256"),
            (64, 14336, 8, "wgwhole112"),
            // TP 4: q/k/v (1536), o and down (two segments), gate/up (7168).
            (1, 1536, 8, "wgcluster64"),
            (64, 1536, 8, "wgcluster64"),
            (1, 4096, 2, "wgwhole64"),
            (32, 4096, 2, "wgwhole64"),
            (64, 4096, 2, "wgwhole64"),
            (1, 7168, 8, "wgcluster64x2n256"),
            (64, 7168, 8, "wgwhole64"),
            // TP 8: q/k/v (768), o and down (one segment), gate/up (3584).
            (1, 768, 8, "wgcluster64"),
            (1, 4096, 1, "wgwhole64"),
            (64, 4096, 1, "wgwhole64"),
            (1, 3584, 8, "wgcluster64x2n256"),
            (64, 3584, 8, "wgquad64"),
        ];
        for (m, n, n_seg, want) in cases {
            assert_eq!(
                pick(m, n, n_seg),
                want,
                "M = {m}, N = {n}, {n_seg} segments"
            );
        }
        // A path the device lacks is passed over.
        let shape = TreeMatmul {
            m: 1,
            n: 4096,
            k: 1024,
            seg_len: 512,
            n_seg: 2,
        };
        let off = Switches {
            quad128: false,
            narrow_from: None,
            swap: SwapRule::Off,
            spread: false,
        };
        let no_whole = default_path_for(&shape, Family::Wgmma, 132, &H200_CAP, off, false, |p| {
            !matches!(p, Path::WgWhole { .. })
        });
        assert_eq!(no_whole, Path::WgCluster64);
    }

    #[test]
    fn whole_tiles_go_where_they_fill_the_waves() {
        // 132 SMs (H100 / H200), the llama3-8b layers at TP 1 / 2 / 4.
        let cases = [
            (1, 28672, Some(224)),
            (16, 28672, Some(224)),
            (32, 28672, Some(112)),
            (64, 28672, Some(112)),
            (1, 14336, None),
            (64, 14336, Some(112)),
            (32, 7168, None),
            (64, 7168, Some(64)),
            (64, 6144, None),
            (64, 4096, None),
            (64, 128256, None),
        ];
        for (m, n, want) in cases {
            assert_eq!(whole_tile(m, n, 132), want, "M = {m}, N = {n}");
        }
        assert_eq!(whole_tile(1, 0, 132), None);
        let quads = [
            (64, 4096, 8, Some(64)),
            (64, 6144, 8, Some(96)),
            (32, 4096, 8, None),
            (1, 6144, 8, None),
            (64, 3072, 8, None),
            (64, 4096, 4, None),
            (64, 128256, 8, None),
        ];
        for (m, n, n_seg, want) in quads {
            assert_eq!(quad_tile(m, n, n_seg, 132), want, "M = {m}, N = {n}");
        }
        let tree_paths = WHOLE_BNS
            .map(|bn| (Path::WgWhole { bn }, "whole", bn))
            .into_iter()
            .chain(QUAD_BNS.map(|bn| (Path::WgQuad { bn }, "quad", bn)));
        for (p, kind, bn) in tree_paths {
            assert!(Path::all(Family::Wgmma).contains(&p) && p.is_tma());
            assert!(
                p.smem_bytes() <= 227 * 1024,
                "{}: {} B",
                p.name(),
                p.smem_bytes()
            );
            assert_eq!(p.kernel(), format!("arbor_gemm_wg_{kind}_64x{bn}"));
            assert_eq!(p.name(), format!("wg{kind}{bn}"));
        }
    }

    #[test]
    fn column_order_only_when_asked_within_its_rows_and_with_a_column_per_sm() {
        assert_eq!(column_order_rows(None).unwrap(), None);
        assert_eq!(column_order_rows(Some("groups")).unwrap(), None);
        assert_eq!(
            column_order_rows(Some("columns")).unwrap(),
            Some(COLUMN_ORDER_ROWS)
        );
        assert_eq!(
            column_order_rows(Some(" columns: 192 ")).unwrap(),
            Some(192)
        );
        for bad in ["1", "column", "columns:", "columns:x"] {
            let e = column_order_rows(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(TILE_ORDER_ENV) && e.contains(bad.trim()), "{e}");
        }
        let on = Some(COLUMN_ORDER_ROWS);
        // gate/up (224 column tiles) and the LM head (1002) on 132 SMs, up to 256 rows.
        assert!(column_order(on, 160, 224, 132));
        assert!(column_order(on, 256, 1002, 132));
        assert!(!column_order(on, 257, 224, 132));
        // q/k/v (48 column tiles): by column, 48 blocks would do the work of 96.
        assert!(!column_order(on, 160, 48, 132));
        assert!(!column_order(None, 160, 224, 132));
    }

    /// The 128-row quad rule (off with [`QUAD128_ENV`]=0): what it picks for the llama3-8b
    /// layers on 132 SMs, and that every other call keeps the path it had.
    #[test]
    fn quad128_tiles_only_in_their_band_and_only_when_enabled() {
        let pick = h200_path;
        let cases = [
            // o / down (N 4096): one wave of 128 blocks, 128×128 tiles from M = 129 and
            // 128×64 ones from M = 97.
            (97, 4096, 8, "wgquad128x64"),
            (128, 4096, 8, "wgquad128x64"),
            (129, 4096, 8, "wgquad128x128"),
            (200, 4096, 8, "wgquad128x128"),
            (256, 4096, 8, "wgquad128x128"),
            // Two waves or more: q/k/v (N 6144), gate/up, the LM head, M over 256.
            (128, 6144, 8, "wgwhole112"),
            (256, 6144, 8, "wgtma128"),
            (256, 28672, 8, "wgtma128"),
            (256, 128256, 8, "wgtma128"),
            (384, 4096, 8, "wgtma128"),
            (512, 4096, 8, "wgtma128"),
            // Shards of fewer segments (TP 2 / TP 4 o and down): not measured, unchanged.
            (256, 4096, 4, "wgtma128"),
            (256, 4096, 2, "wgtma128"),
            // Outside the band: unchanged.
            (96, 4096, 8, "wgwhole64"),
            (64, 4096, 8, "wgquad64"),
            (1024, 4096, 8, "wgtma128"),
        ];
        for (m, n, n_seg, want) in cases {
            assert_eq!(
                pick(m, n, n_seg, true),
                want,
                "M = {m}, N = {n}, {n_seg} segments"
            );
            let off = pick(m, n, n_seg, false);
            assert!(!off.starts_with("wgquad128"), "M = {m}, N = {n}: {off}");
        }
        assert_eq!(pick(256, 4096, 8, false), "wgtma128");
        assert_eq!(pick(128, 4096, 8, false), "wgwhole64");
        assert_eq!(tma_store(None).unwrap(), TmaStore::Partial);
        assert_eq!(tma_store(Some("auto")).unwrap(), TmaStore::Partial);
        assert_eq!(tma_store(Some("1")).unwrap(), TmaStore::Whole);
        assert_eq!(tma_store(Some(" 0 ")).unwrap(), TmaStore::Off);
        assert_eq!(tma_store(Some("partial")).unwrap(), TmaStore::Partial);
        let e = tma_store(Some("on")).unwrap_err().to_string();
        assert!(e.contains(TMA_STORE_ENV) && e.contains("on"), "{e}");
        assert_eq!(skip_idle_enabled(None).unwrap(), SKIP_IDLE_BY_DEFAULT);
        assert!(!skip_idle_enabled(Some("0")).unwrap());
        let e = skip_idle_enabled(Some("2")).unwrap_err().to_string();
        assert!(e.contains(SKIP_IDLE_ENV) && e.contains('2'), "{e}");
        assert_eq!(tail_split_enabled(None).unwrap(), TAIL_SPLIT_BY_DEFAULT);
        assert!(!tail_split_enabled(Some("0")).unwrap());
        let e = tail_split_enabled(Some("on")).unwrap_err().to_string();
        assert!(e.contains(TAIL_SPLIT_ENV) && e.contains("on"), "{e}");
        assert_eq!(quad128_enabled(None).unwrap(), QUAD128_BY_DEFAULT);
        assert!(quad128_enabled(Some("1")).unwrap());
        assert!(!quad128_enabled(Some("0")).unwrap());
        let e = quad128_enabled(Some("yes")).unwrap_err().to_string();
        assert!(e.contains("ARBOR_GEMM_M256") && e.contains("yes"), "{e}");
        for bn in QUAD128_BNS {
            let p = Path::WgQuad128 { bn };
            assert!(Path::all(Family::Wgmma).contains(&p) && p.is_tma());
            assert!(
                p.smem_bytes() <= 227 * 1024,
                "{}: {} B",
                p.name(),
                p.smem_bytes()
            );
            assert_eq!(p.kernel(), format!("arbor_gemm_wg_quad_128x{bn}"));
            assert_eq!(p.name(), format!("wgquad128x{bn}"));
        }
    }

    /// The narrow persistent tiles (off with [`NARROW_ENV`]=0): the widths the rounds pick
    /// for the llama3-8b layers on 132 SMs, and that they replace only `wgtma128` from
    /// [`NARROW_FROM_ROWS`] rows.
    #[test]
    fn narrow_tiles_fill_the_rounds_from_256_rows() {
        let widths = [
            // (M, N, width): q/k/v, o / down, gate/up, the LM head.
            (256, 6144, 96),
            (256, 4096, 64),
            (256, 28672, 96),
            (384, 6144, 96),
            (384, 4096, 96),
            (384, 28672, 96),
            (512, 4096, 128),
            (512, 6144, 96),
            (512, 28672, 128),
            (768, 6144, 96),
            (768, 4096, 96),
            (768, 28672, 128),
            (1024, 4096, 128),
            (1024, 6144, 128),
            (1024, 28672, 128),
            (2048, 28672, 128),
            (4096, 4096, 128),
            (192, 4096, 128),
            (128, 4096, 128),
            (1, 4096, 128),
        ];
        for (m, n, want) in widths {
            assert_eq!(
                tma_tile(m, n, 132, NARROW_FROM_ROWS),
                want,
                "M = {m}, N = {n}"
            );
        }
        assert_eq!(tma_tile(256, 4096, 0, NARROW_FROM_ROWS), 128);
        // A lower threshold lets the rounds choose below 256 rows.
        assert_eq!(tma_tile(192, 6144, 132, 160), 96);
        assert_eq!(tma_tile(128, 6144, 132, 160), 128);
        // Steps launch without PDL where the narrow tiles start (launch.rs).
        assert_eq!(crate::cuda::launch::PDL_OFF_FROM_ROWS, NARROW_FROM_ROWS);
        let on = Switches {
            quad128: true,
            narrow_from: Some(NARROW_FROM_ROWS),
            swap: SwapRule::Off,
            spread: false,
        };
        // From 256 rows the narrow tiles come before the quad ones; below, nothing changes.
        assert_eq!(h200_path_with(256, 4096, 8, on), "wgtma128x64");
        assert_eq!(h200_path_with(256, 6144, 8, on), "wgtma128x96");
        assert_eq!(h200_path_with(256, 28672, 8, on), "wgtma128x96");
        // The SiLU·mul epilogue keeps the 128-column tiles, which store it by TMA.
        let gate_up = TreeMatmul {
            m: 256,
            n: 28672,
            k: 4096,
            seg_len: 512,
            n_seg: 8,
        };
        let silu = default_path_for(&gate_up, Family::Wgmma, 132, &H200_CAP, on, true, |_| true);
        assert_eq!(silu.name(), "wgtma128");
        assert_eq!(h200_path_with(4096, 4096, 8, on), "wgtma128");
        assert_eq!(h200_path_with(192, 4096, 8, on), "wgquad128x128");
        assert_eq!(h200_path_with(128, 4096, 8, on), "wgquad128x64");
        assert_eq!(h200_path_with(128, 28672, 8, on), "wgtma128");
        assert_eq!(h200_path_with(64, 4096, 8, on), "wgquad64");
        assert_eq!(h200_path(256, 4096, 8, true), "wgquad128x128");
        assert_eq!(
            narrow_from(None).unwrap(),
            NARROW_BY_DEFAULT.then_some(NARROW_FROM_ROWS)
        );
        assert_eq!(narrow_from(Some("1")).unwrap(), Some(NARROW_FROM_ROWS));
        assert_eq!(narrow_from(Some("0")).unwrap(), None);
        assert_eq!(narrow_from(Some(" from:160 ")).unwrap(), Some(160));
        for bad in ["2", "from:", "from:0", "from:x", "160"] {
            let e = narrow_from(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(NARROW_ENV) && e.contains(bad), "{bad}: {e}");
        }
        for bn in TMA_BNS {
            let p = Path::WgTma { bn };
            assert!(Path::all(Family::Wgmma).contains(&p) && p.is_tma());
            assert!(
                p.smem_bytes() <= 227 * 1024,
                "{}: {} B",
                p.name(),
                p.smem_bytes()
            );
            assert_eq!(p.kernel(), format!("arbor_gemm_wg_tma_128x{bn}"));
        }
        assert_eq!(Path::WgTma { bn: 128 }.smem_bytes(), 230_480);
        assert!(TMA_BNS
            .iter()
            .all(|&bn| Path::WgTma { bn }.tma_stores(false)));
        assert!(
            Path::WgTma { bn: 128 }.tma_stores(true) && !Path::WgTma { bn: 64 }.tma_stores(true)
        );
    }

    #[test]
    fn the_swapped_kernels_take_the_layers_whose_blocks_fill_one_wave_up_to_eight_rows() {
        let on = Switches {
            quad128: true,
            narrow_from: Some(NARROW_FROM_ROWS),
            swap: SwapRule::Packed,
            spread: false,
        };
        for (m, n, n_seg, want) in [
            // TP 1's o and down: 128 blocks, 64 clusters of two.
            (1, 4096, 8, "wgswap64s4"),
            (8, 4096, 8, "wgswap64s4"),
            (9, 4096, 8, "wgcluster64x2n256"),
            // TP 1's gate/up: 64 tiles of 448 W rows, 128 blocks.
            (1, 28672, 8, "wgswap448s4"),
            // The o and down shards at TP 2 (4 segments) and TP 4 (2).
            (1, 4096, 4, "wgswap64s2"),
            (4, 4096, 2, "wgswap64s1"),
            // q/k/v has no form above 96 blocks; gate/up at TP 2 and 4 none above 112.
            (1, 6144, 8, "wgcluster64x2n256"),
            (1, 3072, 8, "wgcluster64"),
            (1, 14336, 8, "wgcluster64x2n256"),
            // The LM head would need more than a wave.
            (1, 128256, 8, "wgcluster64x2n256"),
            (64, 4096, 8, "wgquad64"),
        ] {
            assert_eq!(
                h200_path_with(m, n, n_seg, on),
                want,
                "M = {m}, N = {n}, {n_seg} segments"
            );
        }
        let off = Switches {
            swap: SwapRule::Off,
            ..on
        };
        assert_eq!(h200_path_with(1, 4096, 8, off), "wgcluster64x2n256");
        // A device without the kernel keeps the rules before it.
        let shape = TreeMatmul {
            m: 1,
            n: 4096,
            k: 4096,
            seg_len: 512,
            n_seg: 8,
        };
        let p = default_path_for(&shape, Family::Wgmma, 132, &H200_CAP, on, false, |p| {
            !matches!(p, Path::WgSwap { .. })
        });
        assert_eq!(p.name(), "wgcluster64x2n256");
    }

    #[test]
    fn calls_of_few_tiles_spread_over_clusters_and_the_rest_do_not_move() {
        let with = |spread| Switches {
            quad128: true,
            narrow_from: Some(NARROW_FROM_ROWS),
            swap: SwapRule::Packed,
            spread,
        };
        let path = |m, n, k, n_seg, silu, spread| {
            let s = TreeMatmul {
                m,
                n,
                k,
                seg_len: k / n_seg,
                n_seg,
            };
            default_path_for(
                &s,
                Family::Wgmma,
                132,
                &H200_CAP,
                with(spread),
                silu,
                |_| true,
            )
            .name()
        };
        // TP 4's and TP 2's q/k/v shards from 65 to 256 rows: 12 to 48 persistent tiles.
        assert_eq!(path(128, 1536, 4096, 8, false, false), "wgtma128");
        assert_eq!(path(128, 1536, 4096, 8, false, true), "wgcluster64");
        assert_eq!(path(256, 1536, 4096, 8, false, true), "wgcluster64x2");
        assert_eq!(path(128, 3072, 4096, 8, false, true), "wgcluster64x2");
        // The o shards of two and four segments from 160 rows.
        assert_eq!(path(192, 4096, 1024, 2, false, true), "wgcluster64");
        assert_eq!(path(192, 4096, 2048, 4, false, true), "wgcluster64x2");
        // Every TP 1 layer, the gate/up shards (SiLU·mul), TP 2's q/k/v from 160 rows, the
        // down shards of 7 and 14 segments and the LM head shards keep their path at every M.
        for (n, k, n_seg, silu) in [
            (6144, 4096, 8, false),
            (4096, 4096, 8, false),
            (28672, 4096, 8, true),
            (4096, 14336, 28, false),
            (128256, 4096, 8, false),
            (14336, 4096, 8, true),
            (7168, 4096, 8, true),
            (3584, 4096, 8, true),
            (4096, 3584, 7, false),
            (4096, 7168, 14, false),
            (64128, 4096, 8, false),
            (32064, 4096, 8, false),
        ] {
            for m in [1, 8, 64, 65, 96, 128, 160, 192, 256, 257, 1024] {
                assert_eq!(
                    path(m, n, k, n_seg, silu, true),
                    path(m, n, k, n_seg, silu, false),
                    "M = {m}, {k} × {n}"
                );
            }
        }
        for m in [160, 192, 256] {
            assert_eq!(
                path(m, 3072, 4096, 8, false, true),
                path(m, 3072, 4096, 8, false, false)
            );
        }
    }
}
