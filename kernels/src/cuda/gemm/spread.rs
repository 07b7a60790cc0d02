//! The cluster paths for calls of 65 to 256 rows whose tiles are too few for the SMs: a
//! column shard of a tensor-parallel rank (its q/k/v at TP 2 to 8) has so few columns that
//! the persistent kernel's 128-column tiles leave most SMs idle (docs/gemm.md).

use super::error::GemmError;
use super::path::Path;
use super::switch::switch;

/// The variable that lets the default path spread a call of few tiles over clusters
/// ([`spread_path`]): `1` on, `0` off, unset [`SPREAD_BY_DEFAULT`].
pub const SPREAD_ENV: &str = "ARBOR_GEMM_SPREAD";

/// The rows a call may have for [`spread_path`] to move it (at 64 and fewer the cluster
/// paths are the rule's own).
pub const SPREAD_ROWS: std::ops::RangeInclusive<usize> = 65..=256;

/// Whether [`spread_path`] applies when [`SPREAD_ENV`] is unset.
pub const SPREAD_BY_DEFAULT: bool = true;

/// [`SPREAD_ENV`]'s value (`None`: unset) as a switch.
pub fn spread_enabled(value: Option<&str>) -> Result<bool, GemmError> {
    switch(
        SPREAD_ENV,
        value,
        SPREAD_BY_DEFAULT,
        "expected 1 (the cluster kernels for 65 <= M <= 256 where the other path's blocks leave half the SMs idle) or 0",
    )
}

/// The cluster path a call of `m` rows, `n` columns over `n_seg` segments takes instead of
/// `path`, on `sms` SMs that hold `cluster64[i]` `wgcluster64` clusters of 2^i blocks at
/// once; `None` where it keeps that path.
///
/// With [`SPREAD_ROWS`] rows, where the path's blocks are fewer than half the SMs (TP 4's q/k/v shard, 4096 × 1536, at 128 rows:
/// 12 persistent tiles of 128 columns), over 2 to 8 segments (a cluster holds a tile's
/// segments), without the SiLU·mul epilogue: `wgcluster64` (a block for each 64 × 128
/// tile and segment) where all of its clusters fit on the device at once, else
/// `wgcluster64x2` (two segments a block) where those do; either only where it has at
/// least twice the blocks. Every path gives the same bits (same leaf, same tree).
pub fn spread_path(
    m: usize,
    n: usize,
    n_seg: usize,
    path: Path,
    sms: usize,
    cluster64: &[u32; 4],
    silu: bool,
) -> Option<Path> {
    let blocks_of = |p: Path| {
        let ((x, y, z), _) = p.launch_dims(m, n, n_seg);
        x * y * z
    };
    let blocks = blocks_of(path);
    if !SPREAD_ROWS.contains(&m) || !(2..=8).contains(&n_seg) || silu || 2 * blocks >= sms {
        return None;
    }
    let clusters = n.div_ceil(128) * m.div_ceil(64);
    // A cluster of `size` blocks counts as one of the next power of two.
    let fits = |size: usize| {
        let i = size.next_power_of_two().trailing_zeros().min(3) as usize;
        clusters <= cluster64[i] as usize
    };
    [
        (Path::WgCluster64, n_seg),
        (Path::WgCluster64x2, n_seg.div_ceil(2)),
    ]
    .into_iter()
    .find(|&(p, size)| fits(size) && blocks_of(p) >= 2 * blocks)
    .map(|(p, _)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TMA128: Path = Path::WgTma { bn: 128 };

    /// `wgcluster64` clusters of 1, 2, 4 and 8 blocks resident at once, as an H200 reports
    /// them.
    const H200: [u32; 4] = [248, 124, 62, 30];

    #[test]
    fn a_shard_of_few_tiles_spreads_over_clusters() {
        // TP 4's q/k/v shard at 128 rows: 12 tiles of 128 → 24 clusters of 8 (30 fit).
        assert_eq!(
            spread_path(128, 1536, 8, TMA128, 132, &H200, false),
            Some(Path::WgCluster64)
        );
        // At 192 and 256 rows 36 and 48 clusters of 8 do not fit: clusters of 4 do.
        assert_eq!(
            spread_path(192, 1536, 8, TMA128, 132, &H200, false),
            Some(Path::WgCluster64x2)
        );
        assert_eq!(
            spread_path(256, 1536, 8, Path::WgTma { bn: 64 }, 132, &H200, false),
            Some(Path::WgCluster64x2)
        );
        // TP 2's q/k/v shard at 128 rows (24 tiles): 48 clusters of 4.
        assert_eq!(
            spread_path(128, 3072, 8, TMA128, 132, &H200, false),
            Some(Path::WgCluster64x2)
        );
        // TP 4's o shard over two segments at 160 rows (64 tiles): 96 clusters of 2.
        assert_eq!(
            spread_path(160, 4096, 2, TMA128, 132, &H200, false),
            Some(Path::WgCluster64)
        );
        // Seven segments count as a cluster of 8: 96 clusters do not fit, 96 of 4 do not
        // either.
        assert_eq!(spread_path(160, 4096, 7, TMA128, 132, &H200, false), None);
    }

    #[test]
    fn full_grids_small_and_large_calls_and_the_epilogue_keep_their_path() {
        // Half the SMs or more: 128 blocks of `wgwhole64`, and 64 persistent tiles of
        // 128 × 64 on 128 SMs (exactly half).
        assert_eq!(
            spread_path(128, 4096, 8, Path::WgWhole { bn: 64 }, 132, &H200, false),
            None
        );
        assert_eq!(
            spread_path(128, 4096, 8, Path::WgTma { bn: 64 }, 128, &H200, false),
            None
        );
        // 64 rows and fewer (the rule's own cluster choice), more than 256.
        assert_eq!(spread_path(64, 1536, 8, TMA128, 132, &H200, false), None);
        assert_eq!(spread_path(257, 1536, 8, TMA128, 132, &H200, false), None);
        // One segment (no cluster to spread over), more than eight (no cluster that big).
        assert_eq!(spread_path(128, 1536, 1, TMA128, 132, &H200, false), None);
        assert_eq!(spread_path(128, 1536, 14, TMA128, 132, &H200, false), None);
        // The SiLU·mul epilogue stays on the path that stores it.
        assert_eq!(spread_path(128, 1536, 8, TMA128, 132, &H200, true), None);
        // Nothing fits at once (no cluster kernel compiled).
        assert_eq!(spread_path(128, 1536, 8, TMA128, 132, &[0; 4], false), None);
    }

    #[test]
    fn the_switch_comes_from_its_variable() {
        assert_eq!(spread_enabled(None).unwrap(), SPREAD_BY_DEFAULT);
        assert!(spread_enabled(Some("1")).unwrap());
        assert!(!spread_enabled(Some(" 0")).unwrap());
        let e = spread_enabled(Some("yes")).unwrap_err().to_string();
        assert!(e.contains(SPREAD_ENV) && e.contains("yes"), "{e}");
    }
}
