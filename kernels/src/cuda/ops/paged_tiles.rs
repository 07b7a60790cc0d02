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

/// Dynamic shared memory of the prefill kernel (a Q tile, one K and one V tile, the rows'
/// total state: HD f32 per row) or of the decode kernel (16 query rows, two K/V stages).
pub(crate) fn smem_bytes(hd: usize, prefill: bool) -> usize {
    if prefill {
        2 * (tile_elems(hd, PREFILL_TILE_ROWS) + 2 * tile_elems(hd, KV_BLOCK))
            + 4 * PREFILL_TILE_ROWS * hd
    } else {
        2 * (tile_elems(hd, 16) + 4 * tile_elems(hd, KV_BLOCK))
    }
}

/// (kernel, dynamic shared memory) of every paged-attention entry that needs more than the
/// default 48 KiB; set on the functions when the module is loaded.
pub(crate) fn smem_attributes() -> Vec<(&'static str, usize)> {
    let mut v = Vec::new();
    for (hd, pre, dec) in [
        (16, "pa_prefill_hd16", "pa_decode_hd16"),
        (32, "pa_prefill_hd32", "pa_decode_hd32"),
        (64, "pa_prefill_hd64", "pa_decode_hd64"),
        (128, "pa_prefill_hd128", "pa_decode_hd128"),
    ] {
        v.push((pre, smem_bytes(hd, true)));
        v.push((dec, smem_bytes(hd, false)));
    }
    v.push(("pa_decode_hd256", smem_bytes(256, false)));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_a_hopper_sm_twice_for_prefill() {
        // 2 prefill CTAs per SM (228 KiB, 1 KiB reserved per block) at head_dim 128.
        assert!(2 * (smem_bytes(128, true) + 1024) <= 228 * 1024);
        assert!(smem_bytes(256, false) <= 227 * 1024);
        assert_eq!(padded_head_dim(20), Some(32));
        assert_eq!(padded_head_dim(257), None);
    }
}
