//! Causal attention of a ragged batch against the KV cache.

use cudarc::driver::LaunchConfig;

use super::{arg_bf16_out, check, check_bf16_out, i32_of, DevBf16, DevF32, KvLayout, RowMeta};
use crate::cuda::{CudaError, GpuDevice};

/// attention.cu's ATTN_WARPS, ATTN_CHUNK, ATTN_GROUP and ATTN_MAX_HEAD_DIM.
const ATTN_WARPS: usize = 8;
const ATTN_CHUNK: usize = 32;
const ATTN_GROUP: usize = 4;
const ATTN_MAX_HEAD_DIM: usize = 256;

impl GpuDevice {
    /// Causal GQA attention of `q` (`[rows, n_heads·head_dim]`) against the cache; row r
    /// is at `row_pos[r]` of slot `row_slot[r]` and sees keys `0..=row_pos[r]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &DevF32,
        kc: &DevBf16,
        vc: &DevBf16,
        layout: KvLayout,
        layer: usize,
        meta: &RowMeta,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        outb: Option<&mut DevBf16>,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "attention_kernel";
        check_bf16_out(K, &outb, q.len())?;
        // Specialised per common head_dim (vector loads, unrolled); the same arithmetic.
        let kernel = match head_dim {
            64 => "attention_hd64_kernel",
            128 => "attention_hd128_kernel",
            256 => "attention_hd256_kernel",
            _ => K,
        };
        meta.check_cache(K, layout, layer)?;
        let rows = meta.rows;
        check(
            K,
            n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
            || format!("{n_heads} query heads are not a multiple of {n_kv_heads} KV heads"),
        )?;
        check(K, head_dim > 0 && head_dim <= ATTN_MAX_HEAD_DIM, || {
            format!("head_dim {head_dim} is outside 1..={ATTN_MAX_HEAD_DIM}")
        })?;
        check(K, layout.width == n_kv_heads * head_dim, || {
            format!(
                "cache width {} ≠ {n_kv_heads} KV heads × {head_dim}",
                layout.width
            )
        })?;
        check(K, q.len() == rows * n_heads * head_dim, || {
            format!(
                "q has {} values, expected {rows}×{n_heads}×{head_dim}",
                q.len()
            )
        })?;
        check(
            K,
            kc.len() == layout.len() && vc.len() == layout.len(),
            || "cache buffers do not match their layout".into(),
        )?;
        let mut out = self.empty_f32(q.len())?;
        if rows == 0 || n_heads == 0 {
            return Ok(out);
        }
        let (ds, dp) = (meta.slots, meta.positions);
        let gsz = attention_group(rows, n_heads);
        let subs = (n_heads / n_kv_heads).div_ceil(gsz);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, (n_kv_heads * subs) as u32, 1),
            block_dim: (32 * attention_warps(meta) as u32, 1, 1),
            shared_mem_bytes: (ATTN_WARPS * ATTN_GROUP * (head_dim + 2) * 4) as u32,
        };
        let gi = gsz as i32;
        let (hi, kvi, di) = (n_heads as i32, n_kv_heads as i32, head_dim as i32);
        let (li, si, mi) = (
            layer as i32,
            i32_of(K, "slots", layout.slots)?,
            i32_of(K, "max_len", layout.max_len)?,
        );
        let mut b = self.launch(self.func(kernel)?);
        b.arg(q).arg(kc).arg(vc).out(&mut out);
        arg_bf16_out(&mut b, outb);
        b.arg(&ds).arg(&dp);
        b.arg(&hi)
            .arg(&kvi)
            .arg(&di)
            .arg(&scale)
            .arg(&li)
            .arg(&si)
            .arg(&mi)
            .arg(&gi);
        self.launched(K, unsafe { b.launch(cfg) })?;
        Ok(out)
    }
}

/// Warps per attention block when the longest row ends before `pos_end`: half of them
/// when no row has more than half ATTN_WARPS chunks (the other half would idle at the
/// barrier, holding registers). Measured on an H200 (session 22): 6 warps for 6 chunks was
/// slower than 8 (the combine spreads a group's outputs over fewer threads), 4 for 4 was
/// 10 % faster. The bits do not depend on it (attention.cu).
/// A recorded step (`RowMeta::fixed_shape`) keeps ATTN_WARPS: its replays run at other
/// positions.
fn attention_warps(meta: &RowMeta) -> usize {
    if !meta.fixed_shape && meta.pos_end.div_ceil(ATTN_CHUNK) <= ATTN_WARPS / 2 {
        ATTN_WARPS / 2
    } else {
        ATTN_WARPS
    }
}

/// Query heads per attention block (attention.cu's `gsz`): up to ATTN_GROUP of a KV head's
/// heads share each key and value load once the rows' heads fill the GPU; a few rows get
/// one head per block, four times the blocks for the same work (profiled on an H200 at
/// batch 1: 8 blocks of 8 warps, 12 % achieved occupancy). The bits do not depend on it.
fn attention_group(rows: usize, n_heads: usize) -> usize {
    if rows * n_heads < 512 {
        1
    } else {
        ATTN_GROUP
    }
}
