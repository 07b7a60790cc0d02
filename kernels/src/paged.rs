//! The paged KV cache's geometry and the attention's fixed key structure, shared by the
//! CPU and CUDA backends and by the scheduler that hands out blocks.
//!
//! A cache is a pool of blocks of [`KV_BLOCK`] positions. K and V are each stored as
//! `[layers, blocks, n_kv_heads, KV_BLOCK, head_dim]` bf16: one KV head's keys of one block
//! are contiguous (`KV_BLOCK · head_dim` values), which is what an attention kernel loads
//! as a tile. A sequence's positions live in the blocks its block table lists, in order:
//! position `p` is row `p % KV_BLOCK` of block `table[p / KV_BLOCK]`.
//!
//! Attention's reduction order is fixed by the position alone: keys in blocks of
//! [`KV_BLOCK`] aligned at 0, blocks in splits of [`ATTN_SPLIT_BLOCKS`], splits folded in
//! order (docs/invariance.md). Both constants are part of the numerics.

/// Positions per KV block, and keys per attention block on the GPU (the CPU's key block,
/// `cpu::attention::ATTN_BLOCK`, divides it).
pub const KV_BLOCK: usize = 64;
/// Key blocks per attention split.
pub const ATTN_SPLIT_BLOCKS: usize = 8;
/// Keys per attention split: a row at position `p` has `p / ATTN_SPLIT + 1` splits.
pub const ATTN_SPLIT: usize = KV_BLOCK * ATTN_SPLIT_BLOCKS;

/// The splits of the keys `0..=pos`.
pub fn splits_of(pos: usize) -> usize {
    pos / ATTN_SPLIT + 1
}

/// Blocks that hold positions `0..len`.
pub fn blocks_for(len: usize) -> usize {
    len.div_ceil(KV_BLOCK)
}

/// The shape of one of a paged cache's two pools (K or V).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedKvLayout {
    pub layers: usize,
    pub blocks: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl PagedKvLayout {
    /// Values of one layer's block (all KV heads).
    pub fn block_len(&self) -> usize {
        self.n_kv_heads * KV_BLOCK * self.head_dim
    }

    /// Values in the pool.
    pub fn len(&self) -> usize {
        self.layers * self.blocks * self.block_len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Index of the first value of (layer, block, KV head, row in the block).
    pub fn at(&self, layer: usize, block: usize, kv_head: usize, row: usize) -> usize {
        (((layer * self.blocks + block) * self.n_kv_heads + kv_head) * KV_BLOCK + row)
            * self.head_dim
    }

    /// Bytes of K and V of one block over all layers (bf16).
    pub fn bytes_per_block(&self) -> usize {
        2 * 2 * self.layers * self.block_len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry() {
        let l = PagedKvLayout {
            layers: 2,
            blocks: 3,
            n_kv_heads: 4,
            head_dim: 8,
        };
        assert_eq!(l.block_len(), 4 * 64 * 8);
        assert_eq!(l.len(), 2 * 3 * 4 * 64 * 8);
        assert_eq!(l.at(0, 0, 0, 1), 8);
        assert_eq!(l.at(0, 0, 1, 0), 64 * 8);
        assert_eq!(l.at(0, 1, 0, 0), l.block_len());
        assert_eq!(l.at(1, 0, 0, 0), 3 * l.block_len());
        assert_eq!(l.at(1, 2, 3, 63) + 8, l.len());
        assert_eq!(l.bytes_per_block(), 4 * 2 * l.block_len());
        assert_eq!((splits_of(0), splits_of(511), splits_of(512)), (1, 1, 2));
        assert_eq!((blocks_for(0), blocks_for(64), blocks_for(65)), (0, 1, 2));
    }
}
