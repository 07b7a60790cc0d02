//! RoPE and the paged KV-cache write, alone and fused with the q/k/v split.

use super::{check, elementwise_cfg, i32_of, DevBf16, DevF32, RowMeta};
use crate::cuda::{CudaError, GpuDevice};
use crate::paged::PagedKvLayout;

impl GpuDevice {
    /// Writes K and V rows (`[rows, n_kv_heads·head_dim]`, rounded to bf16) into layer
    /// `layer` of the paged cache, at each row's position in its table's block.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write(
        &self,
        kc: &mut DevBf16,
        vc: &mut DevBf16,
        layout: PagedKvLayout,
        layer: usize,
        k: &DevF32,
        v: &DevF32,
        meta: &RowMeta,
    ) -> Result<(), CudaError> {
        const K: &str = "kv_write_kernel";
        meta.check_cache(K, layout, layer)?;
        let rows = meta.rows;
        let width = layout.n_kv_heads * layout.head_dim;
        check(
            K,
            kc.len() == layout.len() && vc.len() == layout.len(),
            || "cache buffers do not match their layout".into(),
        )?;
        check(
            K,
            k.len() == rows * width && v.len() == rows * width,
            || {
                format!(
                    "k/v have {}/{} values, expected {rows}×{width}",
                    k.len(),
                    v.len(),
                )
            },
        )?;
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let (dp, dt, tb) = (meta.positions, meta.table_off, meta.table);
        let ri = i32_of(K, "rows", rows)?;
        i32_of(K, "width", width)?;
        let kvi = i32_of(K, "n_kv_heads", layout.n_kv_heads)?;
        let di = i32_of(K, "head_dim", layout.head_dim)?;
        let li = i32_of(K, "layer", layer)?;
        let bi = i32_of(K, "blocks", layout.blocks)?;
        let mut b = self.launch(self.func(K)?);
        b.out(kc).out(vc).arg(k).arg(v).arg(&dp).arg(&dt).arg(&tb);
        b.arg(&ri).arg(&kvi).arg(&di).arg(&li).arg(&bi);
        self.launched(K, unsafe { b.launch(elementwise_cfg(rows * width)) })
    }

    /// Rotates `x` (`[rows, n_heads·head_dim]`) in place; row r at position `row_pos[r]`.
    /// `cos`/`sin`: `[max_pos, half]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut DevF32,
        cos: &DevF32,
        sin: &DevF32,
        half: usize,
        meta: &RowMeta,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "rope_kernel";
        let rows = meta.rows;
        check(K, x.len() == rows * n_heads * head_dim, || {
            format!(
                "x has {} values, expected {rows}×{n_heads}×{head_dim}",
                x.len()
            )
        })?;
        check(K, 2 * half <= head_dim && half > 0, || {
            format!("rotary half {half} does not fit head_dim {head_dim}")
        })?;
        check(
            K,
            cos.len() == sin.len() && cos.len().is_multiple_of(half),
            || "cos/sin tables of different shapes".into(),
        )?;
        let max_pos = cos.len() / half;
        meta.limit_positions(K, "the RoPE table", max_pos)?;
        if rows == 0 || n_heads == 0 {
            return Ok(());
        }
        let dp = meta.positions;
        let (ri, hi, di, hf) = (
            rows as i32,
            i32_of(K, "n_heads", n_heads)?,
            i32_of(K, "head_dim", head_dim)?,
            half as i32,
        );
        let mut b = self.launch(self.func(K)?);
        b.out(x)
            .arg(cos)
            .arg(sin)
            .arg(&dp)
            .arg(&ri)
            .arg(&hi)
            .arg(&di)
            .arg(&hf);
        self.launched(K, unsafe {
            b.launch(elementwise_cfg(rows * n_heads * half))
        })
    }

    /// The fused q/k/v output `qkv` (`[rows, (n_heads + 2·n_kv)·head_dim]`): returns q
    /// rotated; writes k rotated and v into the paged cache at each row's position. The
    /// bits of `copy_cols`, `rope` and `kv_write`, in one launch. `cos`/`sin`:
    /// `[max_pos, head_dim / 2]`.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_rope_kv(
        &self,
        qkv: &DevF32,
        kc: &mut DevBf16,
        vc: &mut DevBf16,
        layout: PagedKvLayout,
        layer: usize,
        cos: &DevF32,
        sin: &DevF32,
        meta: &RowMeta,
        n_heads: usize,
        n_kv: usize,
        head_dim: usize,
    ) -> Result<DevF32, CudaError> {
        const K: &str = "qkv_rope_kv_kernel";
        meta.check_cache(K, layout, layer)?;
        let rows = meta.rows;
        let half = head_dim / 2;
        check(K, half > 0 && 2 * half == head_dim, || {
            format!("head_dim {head_dim} is not even")
        })?;
        check(
            K,
            layout.n_kv_heads == n_kv && layout.head_dim == head_dim,
            || {
                format!(
                    "a cache of {} KV heads of {} for {n_kv} KV heads of {head_dim}",
                    layout.n_kv_heads, layout.head_dim
                )
            },
        )?;
        check(
            K,
            qkv.len() == rows * (n_heads + 2 * n_kv) * head_dim,
            || {
                format!(
                    "qkv has {} values, expected {rows}×({n_heads} + 2·{n_kv})×{head_dim}",
                    qkv.len()
                )
            },
        )?;
        check(
            K,
            kc.len() == layout.len() && vc.len() == layout.len(),
            || "cache buffers do not match their layout".into(),
        )?;
        check(K, cos.len() == sin.len(), || {
            "cos/sin tables of different shapes".into()
        })?;
        meta.limit_positions(K, "the RoPE table", cos.len() / half)?;
        let mut q = self.empty_f32(rows * n_heads * head_dim)?;
        if rows == 0 {
            return Ok(q);
        }
        let (dp, dt, tb) = (meta.positions, meta.table_off, meta.table);
        let (ri, hi, kvi, di, hf) = (
            i32_of(K, "rows", rows)?,
            i32_of(K, "n_heads", n_heads)?,
            i32_of(K, "n_kv_heads", n_kv)?,
            i32_of(K, "head_dim", head_dim)?,
            half as i32,
        );
        let (li, bi) = (
            i32_of(K, "layer", layer)?,
            i32_of(K, "blocks", layout.blocks)?,
        );
        // Four values a thread where the rows allow 16-byte accesses (same bits).
        let per = if half.is_multiple_of(4) { 4 } else { 1 };
        let kernel = if per == 4 { "qkv_rope_kv4_kernel" } else { K };
        let mut b = self.launch(self.func(kernel)?);
        b.arg(qkv).out(&mut q).out(kc).out(vc).arg(cos).arg(sin);
        b.arg(&dp)
            .arg(&dt)
            .arg(&tb)
            .arg(&ri)
            .arg(&hi)
            .arg(&kvi)
            .arg(&di)
            .arg(&hf);
        b.arg(&li).arg(&bi);
        let units = rows * (n_heads + 2 * n_kv) * (half / per);
        self.launched(K, unsafe { b.launch(elementwise_cfg(units)) })?;
        Ok(q)
    }
}
