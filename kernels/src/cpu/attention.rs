//! Causal attention with GQA over a bf16 KV cache: keys in fixed-size blocks aligned at
//! absolute position 0, blocks combined in key order with the online softmax. One code
//! path serves many query rows (prefill) and one row against a cache (decode).
use half::bf16;

/// Keys per block. Fixed: changing it changes bits.
pub const ATTN_BLOCK: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// q: [rows, n_heads*head_dim] f32 for one sequence's query rows at positions
/// `pos0 .. pos0+rows`; k, v: [len, n_kv_heads*head_dim] bf16, keys of positions `0..len`
/// with `len >= pos0 + rows`. Row i attends keys `0..=pos0+i`. out: like q.
pub fn attention(q: &[f32], pos0: usize, k: &[bf16], v: &[bf16], shape: AttnShape, out: &mut [f32]) {
    let _ = (q, pos0, k, v, shape, out);
    unimplemented!("attention")
}
