//! The paged attention kernels' tiles: the head dims they are compiled for and the shared
//! memory each needs (set on the functions when the module is loaded, `device.rs`).

use crate::paged::KV_BLOCK;

/// paged_attention.cu's PA_PREFILL_ROWS: query rows per prefill tile.
pub const PREFILL_TILE_ROWS: usize = 64;

/// The head dimension a kernel is compiled for: head_dim padded with zeros to the next of
/// 16, 32, 64, 128, 256 (zeros change no dot product).
pub(crate) fn padded_head_dim(head_dim: usize) -> Option<usize> {
    [16, 32, 64, 128, 256].into_iter().find(|&p| head_dim <= p)
}

fn tile_elems(hd: usize, rows: usize) -> usize {
    rows * (hd + 8)
}

/// Dynamic shared memory of the prefill kernel: a Q tile, one K and one V tile, the rows'
/// total state (HD f32 per row).
pub(crate) fn prefill_smem_bytes(hd: usize) -> usize {
    2 * (tile_elems(hd, PREFILL_TILE_ROWS) + 2 * tile_elems(hd, KV_BLOCK))
        + 4 * PREFILL_TILE_ROWS * hd
}

/// How far ahead the decode kernel loads its key blocks (paged_attention.cu, STAGES). A
/// speed choice only: a block's arithmetic is the same in every variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeStages {
    /// One K and one V tile: the smallest CTA, for steps of many CTAs.
    One,
    /// Two K/V stages: the next block loads during this one.
    Two,
}

impl DecodeStages {
    fn count(self) -> usize {
        match self {
            Self::One => 1,
            Self::Two => 2,
        }
    }

    /// From `1` or `2` (the `ARBOR_ATTN_DECODE_STAGES` override).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "1" => Some(Self::One),
            "2" => Some(Self::Two),
            _ => None,
        }
    }

    /// The variant for a decode launch of `ctas` CTAs on `sms` SMs: the smallest CTA once
    /// they queue for SMs (then warps per SM bound the step; H200, 4 × 8192 context: 0.86
    /// of two stages' time), two stages while every CTA has an SM (batch 1: 0.98).
    pub fn for_launch(ctas: usize, sms: usize) -> Self {
        if ctas <= sms {
            Self::Two
        } else {
            Self::One
        }
    }
}

/// Dynamic shared memory of the decode kernel: 16 query rows and its K/V tiles.
pub(crate) fn decode_smem_bytes(hd: usize, stages: DecodeStages) -> usize {
    2 * (tile_elems(hd, 16) + 2 * stages.count() * tile_elems(hd, KV_BLOCK))
}

/// The decode kernel compiled for padded head dim `hd` with `stages`, if there is one.
pub(crate) fn decode_kernel(hd: usize, stages: DecodeStages) -> Option<&'static str> {
    use DecodeStages::*;
    Some(match (hd, stages) {
        (16, One) => "pa_decode1_hd16",
        (16, Two) => "pa_decode_hd16",
        (32, One) => "pa_decode1_hd32",
        (32, Two) => "pa_decode_hd32",
        (64, One) => "pa_decode1_hd64",
        (64, Two) => "pa_decode_hd64",
        (128, One) => "pa_decode1_hd128",
        (128, Two) => "pa_decode_hd128",
        (256, One) => "pa_decode1_hd256",
        (256, Two) => "pa_decode_hd256",
        _ => return None,
    })
}

/// (kernel, dynamic shared memory) of every paged-attention entry; set on the functions
/// when the module is loaded (those above the default 48 KiB need it).
pub(crate) fn smem_attributes() -> Vec<(&'static str, usize)> {
    let mut v = Vec::new();
    for (hd, pre) in [
        (16, "pa_prefill_hd16"),
        (32, "pa_prefill_hd32"),
        (64, "pa_prefill_hd64"),
        (128, "pa_prefill_hd128"),
    ] {
        v.push((pre, prefill_smem_bytes(hd)));
    }
    for hd in [16, 32, 64, 128, 256] {
        for st in [DecodeStages::One, DecodeStages::Two] {
            if let Some(name) = decode_kernel(hd, st) {
                v.push((name, decode_smem_bytes(hd, st)));
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
        // 2 prefill CTAs per SM (228 KiB, 1 KiB reserved per block) at head_dim 128.
        assert!(2 * (prefill_smem_bytes(128) + 1024) <= 228 * 1024);
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
        // Five one-stage CTAs per SM at head_dim 128 where two-stage ones fit three.
        let per_sm = |st| 228 * 1024 / (decode_smem_bytes(128, st) + 1024);
        assert_eq!(per_sm(DecodeStages::One), 5);
        assert_eq!(per_sm(DecodeStages::Two), 3);
        assert_eq!(DecodeStages::for_launch(16, 132), DecodeStages::Two);
        assert_eq!(DecodeStages::for_launch(4096, 132), DecodeStages::One);
        assert_eq!(DecodeStages::parse(" 1"), Some(DecodeStages::One));
        assert_eq!(DecodeStages::parse("4"), None);
    }

    #[test]
    fn head_dims_pad_up() {
        assert_eq!(padded_head_dim(20), Some(32));
        assert_eq!(padded_head_dim(257), None);
    }
}
