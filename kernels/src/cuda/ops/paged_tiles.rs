//! The paged attention kernels' tiles: the head dims they are compiled for and the shared
//! memory each needs (set on the functions when the module is loaded, `device.rs`).

use crate::paged::{ATTN_SPLIT_BLOCKS, KV_BLOCK};

/// paged_attention.cu's PA_PREFILL2_ROWS: query rows per tile of the default prefill
/// build (3 warps × 32 rows, two m16 tiles per warp).
pub const PREFILL_TILE_ROWS: usize = 96;
/// paged_attention.cu's PA_PREFILL_ROWS: query rows per tile of the 16-rows-per-warp
/// prefill build (4 warps × 16 rows).
pub const PREFILL_TILE_ROWS_NARROW: usize = 64;

/// Positions from which a step's prefill takes the 96-row build by default.
pub const LONG_PREFILL_POS: usize = 4096;

/// The environment variable that picks the prefill build for A/B runs.
pub const PREFILL_ROWS_ENV: &str = "ARBOR_ATTN_PREFILL_ROWS";

/// The variable that forces the decode kernel's build ([`DecodeBuild`]) for A/B runs: `1`,
/// `2`, `wide` or `par`. A build without a kernel at the head dim, or whose shared memory
/// does not fit the device, falls back to the rule.
pub const DECODE_BUILD_ENV: &str = "ARBOR_ATTN_DECODE";

/// The variable that lets the rule ([`DecodeBuild::for_launch`]) take the builds of several
/// warps (wide, parallel): `1` (the default) or `0` (the one-warp builds only).
pub const DECODE_WIDE_ENV: &str = "ARBOR_ATTN_DECODE_WIDE";

/// The prefill kernel's build: a speed choice only (a row's arithmetic is the same in
/// every build, and equals the decode kernel's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillTiles {
    /// 64-row tiles, 4 warps of 16 rows (`pa_prefill_hd*`).
    Rows64,
    /// 96-row tiles, 3 warps of 32 rows sharing each K and V fragment between two m16
    /// tiles (`pa_prefill96_hd*`); the default for long prompts where [`Self::Wgmma`]
    /// does not run.
    Rows96,
    /// 64-row tiles on one warpgroup, scores and P·V by wgmma (`pa_prefill_wg_hd*`,
    /// paged_attention_wg.cu): sm_90a and head dims 64 and 128 only
    /// ([`PrefillTiles::runs`]).
    Wgmma,
}

impl PrefillTiles {
    pub const ALL: [Self; 3] = [Self::Rows64, Self::Rows96, Self::Wgmma];

    pub fn rows(self) -> usize {
        match self {
            Self::Rows64 | Self::Wgmma => PREFILL_TILE_ROWS_NARROW,
            Self::Rows96 => PREFILL_TILE_ROWS,
        }
    }

    /// Threads per CTA: 32 per warp, 16 rows per warp (64 rows, also the warpgroup's) or
    /// 32 (96).
    pub(crate) fn threads(self) -> usize {
        match self {
            Self::Rows64 | Self::Wgmma => 32 * PREFILL_TILE_ROWS_NARROW / 16,
            Self::Rows96 => 32 * PREFILL_TILE_ROWS / 32,
        }
    }

    /// From `64`, `96` (the rows of a tile) or `wgmma`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "64" => Some(Self::Rows64),
            "96" => Some(Self::Rows96),
            "wgmma" => Some(Self::Wgmma),
            _ => None,
        }
    }

    /// Whether this build computes a model of `head_dim` on a device of NVRTC target
    /// `arch`: the wgmma build needs sm_90a and a head dim of exactly 64 or 128 (its tiles
    /// are whole 64-column swizzle halves); the others run everywhere up to 128.
    pub fn runs(self, arch: &str, head_dim: usize) -> bool {
        match self {
            Self::Wgmma => arch == "sm_90a" && (head_dim == 64 || head_dim == 128),
            Self::Rows64 | Self::Rows96 => head_dim <= 128,
        }
    }

    /// This build where it [`runs`](PrefillTiles::runs), else the 64-row one (the same
    /// bits: a speed choice only).
    pub fn or_fallback(self, arch: &str, head_dim: usize) -> Self {
        if self.runs(arch, head_dim) {
            self
        } else {
            Self::Rows64
        }
    }

    /// The build `ARBOR_ATTN_PREFILL_ROWS` names (`value`), `None` when unset (the choice
    /// is then [`PrefillTiles::for_longest`]'s); an error naming the variable and the value
    /// otherwise.
    pub fn from_env_value(value: Option<&str>) -> Result<Option<Self>, String> {
        match value {
            None => Ok(None),
            Some(v) => Self::parse(v).map(Some).ok_or_else(|| {
                format!("{PREFILL_ROWS_ENV}={v:?} is not 64, 96 or wgmma (the prefill build)")
            }),
        }
    }

    /// The default build for a step whose prefill rows reach position `longest` at most,
    /// on a device of NVRTC target `arch`, for a model of `head_dim`: the wgmma build
    /// wherever it runs (H100, one layer of llama3-8b: 0.64 of the 64-row build's time at
    /// 1k contexts, 0.54 of the 96-row build's at 8k–16k, docs/attention.md), else
    /// [`PrefillTiles::for_longest`].
    pub fn default_for(arch: &str, head_dim: usize, longest: usize) -> Self {
        if Self::Wgmma.runs(arch, head_dim) {
            Self::Wgmma
        } else {
            Self::for_longest(longest)
        }
    }

    /// The build for a step whose prefill rows reach position `longest` at most: 96-row
    /// tiles from [`LONG_PREFILL_POS`] on, 64-row tiles below (H100, one layer of
    /// llama3-8b: 0.93–0.95 of the 96-row time at 1k contexts, 1.02–1.03 at 8k and 16k).
    pub fn for_longest(longest: usize) -> Self {
        if longest >= LONG_PREFILL_POS {
            Self::Rows96
        } else {
            Self::Rows64
        }
    }

    /// The prefill kernel of this build for padded head dim `hd` (none above 128).
    pub(crate) fn kernel(self, hd: usize) -> Option<&'static str> {
        use PrefillTiles::*;
        Some(match (hd, self) {
            (16, Rows64) => "pa_prefill_hd16",
            (32, Rows64) => "pa_prefill_hd32",
            (64, Rows64) => "pa_prefill_hd64",
            (128, Rows64) => "pa_prefill_hd128",
            (16, Rows96) => "pa_prefill96_hd16",
            (32, Rows96) => "pa_prefill96_hd32",
            (64, Rows96) => "pa_prefill96_hd64",
            (128, Rows96) => "pa_prefill96_hd128",
            (64, Wgmma) => "pa_prefill_wg_hd64",
            (128, Wgmma) => "pa_prefill_wg_hd128",
            _ => return None,
        })
    }
}

/// The head dimension a kernel is compiled for: head_dim padded with zeros to the next of
/// 16, 32, 64, 128, 256 (zeros change no dot product).
pub(crate) fn padded_head_dim(head_dim: usize) -> Option<usize> {
    [16, 32, 64, 128, 256].into_iter().find(|&p| head_dim <= p)
}

/// Elements of a tile of `rows` rows (paged_attention.cu, `pa_chunk` and `pa_tile_elems`):
/// `swizzled` rows are unpadded from head_dim 64 up; other rows are padded by 8.
fn tile_elems(hd: usize, rows: usize, swizzled: bool) -> usize {
    rows * if swizzled && hd >= 64 { hd } else { hd + 8 }
}

/// Dynamic shared memory of the prefill kernel: a Q tile, one K and one V tile, the rows'
/// total state (HD f32 per row), and for 32 rows per warp the rows' total m and l too
/// (thread-private: 8 f32 per thread, 8 per row). The wgmma build's tiles (its own
/// swizzle) are 1024-aligned: up to 1 KiB goes to the alignment.
pub(crate) fn prefill_smem_bytes(hd: usize, tiles: PrefillTiles) -> usize {
    let rows = tiles.rows();
    let state = 4 * rows * hd;
    let mma_tiles = 2 * (tile_elems(hd, rows, true) + 2 * tile_elems(hd, KV_BLOCK, true));
    match tiles {
        PrefillTiles::Rows64 => mma_tiles + state,
        PrefillTiles::Rows96 => mma_tiles + state + 4 * 8 * tiles.threads(),
        PrefillTiles::Wgmma => 1024 + 2 * hd * (rows + 2 * KV_BLOCK) + state,
    }
}

/// Which build of the decode kernel runs (paged_attention.cu): how many warps share a CTA's
/// work and how far ahead it loads its key blocks. A speed choice only: every build runs
/// each score and each acc tile as the same chain of the same mma, so the bits are the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeBuild {
    /// One warp, one K and one V tile: the smallest CTA, for steps of many CTAs.
    One,
    /// One warp, two K/V stages: the next block loads during this one.
    Two,
    /// Four warps sharing each block (`pa_decode_wide_body`), three K/V stages; head dims
    /// 64 and 128.
    Wide,
    /// Eight warps, one block of the split each (`pa_decode_par_body`): every block's
    /// scores and softmax at once, then the chain of acc over the blocks; the whole split's
    /// K and V in shared memory (213.5 KB, one CTA per SM: sm_90). Head dim 128.
    Parallel,
}

impl DecodeBuild {
    /// Every build, in the order the tests run them.
    pub const ALL: [Self; 4] = [Self::One, Self::Two, Self::Wide, Self::Parallel];

    /// Threads of a CTA.
    pub fn threads(self) -> u32 {
        match self {
            Self::One | Self::Two => 32,
            Self::Wide => 128,
            Self::Parallel => 256,
        }
    }

    /// From `1`, `2`, `wide` or `par` (the [`DECODE_BUILD_ENV`] override).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "1" => Some(Self::One),
            "2" => Some(Self::Two),
            "wide" => Some(Self::Wide),
            "par" => Some(Self::Parallel),
            _ => None,
        }
    }

    /// Whether the build has a kernel at padded head dim `hd` whose shared memory fits
    /// `smem_per_block` bytes (the device's opt-in limit).
    pub fn runs(self, hd: usize, smem_per_block: usize) -> bool {
        decode_kernel(hd, self).is_some() && decode_smem_bytes(hd, self) <= smem_per_block
    }

    /// [`DECODE_BUILD_ENV`]'s value (`None`: unset) as the build it forces; anything else
    /// than its values an error naming the variable and the value.
    pub fn from_env_value(value: Option<&str>) -> Result<Option<Self>, String> {
        match value {
            None => Ok(None),
            Some(v) => Self::parse(v).map(Some).ok_or_else(|| {
                format!("{DECODE_BUILD_ENV}={v:?} is not 1, 2, wide or par (the decode build)")
            }),
        }
    }

    /// [`DECODE_WIDE_ENV`]'s value (`None`: unset, on) as whether the rule may take the
    /// wide build.
    pub fn wide_allowed(value: Option<&str>) -> Result<bool, String> {
        match value.map(str::trim) {
            None | Some("") | Some("1") => Ok(true),
            Some("0") => Ok(false),
            Some(v) => Err(format!(
                "{DECODE_WIDE_ENV}={v:?} is not 1 (the rule may take the decode builds of several warps) or 0"
            )),
        }
    }

    /// The build for a decode launch of `ctas` CTAs on `sms` SMs at padded head dim `hd`
    /// (`several`: whether the builds of several warps may be taken; `smem_per_block`:
    /// the device's opt-in shared memory per block). While the grid fits one wave, the
    /// parallel build (a split's blocks at once instead of a chain of them: batch 1 to a
    /// few rows, where that chain is the kernel's time), else the wide build while at most
    /// two CTAs with keys share an SM (four warps shorten each link: H100, one layer of
    /// llama3-8b, 1 × 1024 context 24.5 → 18.2 µs, 1 × 8192 27.6 → 22.5, docs/attention.md),
    /// then the one-warp two-stage build while the grid fits one wave (head dims without
    /// either), and the smallest CTA once CTAs queue for SMs (warps per SM bound the step
    /// then; H200, 4 × 8192 context: 0.86 of two stages' time).
    ///
    /// `live`: the CTAs with keys at the low end of the launch's splits ([`live_ctas`]). A
    /// recorded step's grid counts a power of two of splits, and the CTAs past a row's last
    /// split come last in the launch order (the split is grid z) and leave at once, so the
    /// wide build's two CTAs per SM count those (H200, batch 1, 16k–32k positions: the
    /// wide build 0.97 / 1.01 / 0.99 of the one-stage build's step at 16k / 24k / 31k).
    pub fn for_launch(
        ctas: usize,
        live: usize,
        sms: usize,
        hd: usize,
        several: bool,
        smem_per_block: usize,
    ) -> Self {
        if several && ctas <= sms && Self::Parallel.runs(hd, smem_per_block) {
            Self::Parallel
        } else if several && live <= 2 * sms && Self::Wide.runs(hd, smem_per_block) {
            Self::Wide
        } else if ctas <= sms {
            Self::Two
        } else {
            Self::One
        }
    }
}

/// The CTAs of a decode launch of `ctas_per_split` CTAs a split and `splits` splits (grid
/// z) that have keys when the longest row has the fewest splits the launch serves: half of
/// them and one more (a recorded step's power-of-two bucket serves rows of more than half
/// its splits), all of them at one or two.
pub fn live_ctas(ctas_per_split: usize, splits: usize) -> usize {
    let low = if splits <= 2 { splits } else { splits / 2 + 1 };
    ctas_per_split * low
}

/// Dynamic shared memory of the decode kernel: 16 query rows and its K/V tiles, swizzled
/// except in the one-warp two-stage build (paged_attention.cu, `pa_chunk`); in the wide
/// build the scores its warps exchange (8 n-tiles × 32 lanes × 4 f32); in the parallel one
/// (paged_attention_par.cu) a split's 8 K and 4 more V tiles, each block's P fragments (4
/// × 32 lanes × 16 bytes) and three f32 for each of its 16 rows.
pub(crate) fn decode_smem_bytes(hd: usize, build: DecodeBuild) -> usize {
    let swizzled = build != DecodeBuild::Two;
    let q = tile_elems(hd, 16, swizzled);
    let kv = tile_elems(hd, KV_BLOCK, swizzled);
    match build {
        DecodeBuild::One => 2 * (q + 2 * kv),
        DecodeBuild::Two => 2 * (q + 4 * kv),
        DecodeBuild::Wide => 2 * (q + 6 * kv) + 8 * 32 * 16,
        DecodeBuild::Parallel => {
            let blocks = ATTN_SPLIT_BLOCKS;
            2 * (q + (blocks + blocks / 2) * kv) + blocks * (4 * 32 * 16 + 3 * 16 * 4)
        }
    }
}

/// The decode kernel compiled for padded head dim `hd` in `build`, if there is one.
pub(crate) fn decode_kernel(hd: usize, build: DecodeBuild) -> Option<&'static str> {
    use DecodeBuild::*;
    Some(match (hd, build) {
        (16, One) => "pa_decode1_hd16",
        (16, Two) => "pa_decode_hd16",
        (32, One) => "pa_decode1_hd32",
        (32, Two) => "pa_decode_hd32",
        (64, One) => "pa_decode1_hd64",
        (64, Two) => "pa_decode_hd64",
        (64, Wide) => "pa_decode_wide_hd64",
        (128, One) => "pa_decode1_hd128",
        (128, Two) => "pa_decode_hd128",
        (128, Wide) => "pa_decode_wide_hd128",
        (128, Parallel) => "pa_decode_par_hd128",
        (256, One) => "pa_decode1_hd256",
        (256, Two) => "pa_decode_hd256",
        _ => return None,
    })
}

/// (kernel, dynamic shared memory) of every paged-attention entry; set on the functions
/// when the module is loaded (those above the default 48 KiB need it).
pub(crate) fn smem_attributes() -> Vec<(&'static str, usize)> {
    let mut v = Vec::new();
    for hd in [16, 32, 64, 128] {
        for t in PrefillTiles::ALL {
            if let Some(name) = t.kernel(hd) {
                v.push((name, prefill_smem_bytes(hd, t)));
            }
        }
    }
    for hd in [16, 32, 64, 128, 256] {
        for build in DecodeBuild::ALL {
            if let Some(name) = decode_kernel(hd, build) {
                v.push((name, decode_smem_bytes(hd, build)));
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_a_hopper_sm_twice_for_prefill() {
        // 2 prefill CTAs per SM (228 KiB, 1 KiB reserved per block) at head_dim 128, in
        // both builds; a third 96-row CTA would not fit (the occupancy the build assumes).
        for t in PrefillTiles::ALL {
            let per_sm = 228 * 1024 / (prefill_smem_bytes(128, t) + 1024);
            assert!(per_sm >= 2, "{t:?}: {per_sm} CTAs per SM");
        }
        assert_eq!(prefill_smem_bytes(128, PrefillTiles::Rows96), 109_568);
        // Alignment slack, Q + K + V (16 KiB each), the total state (32 KiB).
        assert_eq!(
            prefill_smem_bytes(128, PrefillTiles::Wgmma),
            1024 + 3 * 16_384 + 32_768
        );
        assert_eq!(228 * 1024 / (109_568 + 1024), 2);
    }

    #[test]
    fn prefill_builds_parse_strictly() {
        assert_eq!(PrefillTiles::from_env_value(None), Ok(None));
        assert_eq!(
            PrefillTiles::from_env_value(Some(" 64")),
            Ok(Some(PrefillTiles::Rows64))
        );
        assert_eq!(
            PrefillTiles::from_env_value(Some("96")),
            Ok(Some(PrefillTiles::Rows96))
        );
        assert_eq!(PrefillTiles::for_longest(1040), PrefillTiles::Rows64);
        assert_eq!(
            PrefillTiles::for_longest(LONG_PREFILL_POS - 1),
            PrefillTiles::Rows64
        );
        assert_eq!(
            PrefillTiles::for_longest(LONG_PREFILL_POS),
            PrefillTiles::Rows96
        );
        assert_eq!(
            PrefillTiles::from_env_value(Some("wgmma")),
            Ok(Some(PrefillTiles::Wgmma))
        );
        for bad in ["", "32", "16", "96x", "auto", "wg"] {
            let e = PrefillTiles::from_env_value(Some(bad)).unwrap_err();
            assert!(
                e.contains("ARBOR_ATTN_PREFILL_ROWS") && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
        assert_eq!(PrefillTiles::Rows64.rows(), 64);
        assert_eq!(PrefillTiles::Rows96.rows(), 96);
        // A warp owns 16 rows in one build, 32 in the other.
        assert_eq!(PrefillTiles::Rows64.threads(), 128);
        assert_eq!(PrefillTiles::Rows96.threads(), 96);
        assert_eq!(PrefillTiles::Rows96.kernel(128), Some("pa_prefill96_hd128"));
        assert_eq!(PrefillTiles::Rows64.kernel(256), None);
        assert_eq!(PrefillTiles::Wgmma.kernel(128), Some("pa_prefill_wg_hd128"));
        assert_eq!(PrefillTiles::Wgmma.kernel(32), None);
    }

    #[test]
    fn the_wgmma_build_runs_on_sm_90a_at_head_dims_64_and_128_only() {
        let w = PrefillTiles::Wgmma;
        assert!(w.runs("sm_90a", 128) && w.runs("sm_90a", 64));
        // A padded head dim (100 → 128) would need zero columns the build does not make.
        for hd in [16, 32, 100, 256] {
            assert!(!w.runs("sm_90a", hd), "head_dim {hd}");
            assert_eq!(w.or_fallback("sm_90a", hd), PrefillTiles::Rows64);
        }
        for arch in ["sm_80", "sm_89", "sm_100"] {
            assert_eq!(w.or_fallback(arch, 128), PrefillTiles::Rows64, "{arch}");
        }
        assert_eq!(w.or_fallback("sm_90a", 128), w);
        // The default takes it wherever it runs, the mma.sync builds elsewhere.
        assert_eq!(PrefillTiles::default_for("sm_90a", 128, 100), w);
        assert_eq!(PrefillTiles::default_for("sm_90a", 64, 9000), w);
        assert_eq!(
            PrefillTiles::default_for("sm_90a", 32, 100),
            PrefillTiles::Rows64
        );
        assert_eq!(
            PrefillTiles::default_for("sm_80", 128, LONG_PREFILL_POS),
            PrefillTiles::Rows96
        );
        assert_eq!(
            PrefillTiles::Rows96.or_fallback("sm_80", 128),
            PrefillTiles::Rows96
        );
    }

    #[test]
    fn every_decode_variant_fits_and_is_compiled() {
        let compiled = crate::cuda::source::KERNELS;
        for (name, bytes) in smem_attributes() {
            assert!(
                bytes <= 227 * 1024,
                "{name}: {bytes} bytes of shared memory"
            );
            assert!(compiled.contains(&name), "{name} is not in source::KERNELS");
        }
        // Six one-stage CTAs per SM at head_dim 128 where two-stage ones fit three; the
        // wide build two, as `for_launch` assumes.
        let per_sm = |b| 228 * 1024 / (decode_smem_bytes(128, b) + 1024);
        assert_eq!(per_sm(DecodeBuild::One), 6);
        assert_eq!(per_sm(DecodeBuild::Two), 3);
        assert_eq!(per_sm(DecodeBuild::Wide), 2);
        // The parallel build: one CTA on an sm_90 SM (227 KiB a block), none on sm_80's
        // 163 KiB.
        assert_eq!(decode_smem_bytes(128, DecodeBuild::Parallel), 218_624);
        assert_eq!(per_sm(DecodeBuild::Parallel), 1);
        const SM90: usize = 227 * 1024;
        const SM80: usize = 163 * 1024;
        assert!(DecodeBuild::Parallel.runs(128, SM90));
        assert!(!DecodeBuild::Parallel.runs(128, SM80));
        assert!(!DecodeBuild::Parallel.runs(64, SM90));
        // (CTAs, those with keys, head dim, several warps allowed, shared memory a block) →
        // build, on 132 SMs.
        for (ctas, live, hd, several, smem, want) in [
            (16, 16, 128, true, SM90, DecodeBuild::Parallel),
            (132, 132, 128, true, SM90, DecodeBuild::Parallel),
            (16, 16, 128, true, SM80, DecodeBuild::Wide),
            (16, 16, 64, true, SM90, DecodeBuild::Wide),
            (133, 133, 128, true, SM90, DecodeBuild::Wide),
            (264, 264, 128, true, SM90, DecodeBuild::Wide),
            // Batch 1 at 16k-32k positions: 64 splits of 8 KV heads, 33 with keys.
            (512, 264, 128, true, SM90, DecodeBuild::Wide),
            (512, 264, 128, false, SM90, DecodeBuild::One),
            // The parallel build counts every CTA: one wave of them.
            (256, 72, 128, true, SM90, DecodeBuild::Wide),
            (16, 16, 128, false, SM90, DecodeBuild::Two),
            (16, 16, 32, true, SM90, DecodeBuild::Two),
            (265, 265, 128, true, SM90, DecodeBuild::One),
            (528, 265, 128, true, SM90, DecodeBuild::One),
            (4096, 4096, 128, true, SM90, DecodeBuild::One),
        ] {
            assert_eq!(
                DecodeBuild::for_launch(ctas, live, 132, hd, several, smem),
                want,
                "{ctas} CTAs ({live} with keys), head dim {hd}, {smem} bytes"
            );
        }
        // Half the splits and one more have keys at a bucket's low end.
        assert_eq!(live_ctas(8, 1), 8);
        assert_eq!(live_ctas(8, 2), 16);
        assert_eq!(live_ctas(8, 3), 16);
        assert_eq!(live_ctas(8, 4), 24);
        assert_eq!(live_ctas(8, 64), 264);
        assert_eq!(DecodeBuild::parse(" 1"), Some(DecodeBuild::One));
        assert_eq!(DecodeBuild::parse("wide"), Some(DecodeBuild::Wide));
        assert_eq!(DecodeBuild::parse("par"), Some(DecodeBuild::Parallel));
        assert_eq!(DecodeBuild::parse("4"), None);
        assert_eq!(DecodeBuild::from_env_value(None), Ok(None));
        assert_eq!(
            DecodeBuild::from_env_value(Some("wide")),
            Ok(Some(DecodeBuild::Wide))
        );
        let err = DecodeBuild::from_env_value(Some("3")).unwrap_err();
        assert!(
            err.contains(DECODE_BUILD_ENV) && err.contains("\"3\""),
            "{err}"
        );
        assert_eq!(DecodeBuild::wide_allowed(None), Ok(true));
        assert_eq!(DecodeBuild::wide_allowed(Some("0")), Ok(false));
        let err = DecodeBuild::wide_allowed(Some("no")).unwrap_err();
        assert!(err.contains(DECODE_WIDE_ENV), "{err}");
        for hd in [16, 32, 64, 128, 256] {
            assert!(decode_kernel(hd, DecodeBuild::One).is_some());
            assert!(decode_kernel(hd, DecodeBuild::Two).is_some());
        }
    }

    #[test]
    fn head_dims_pad_up() {
        assert_eq!(padded_head_dim(20), Some(32));
        assert_eq!(padded_head_dim(257), None);
    }
}
