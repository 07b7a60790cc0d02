//! The KV cache on the GPU: its K and V buffers, the write of a batch's rows, and
//! attention over it.

use std::sync::atomic::{AtomicU64, Ordering};

use arbor_kernels::cuda::{DevBf16, KvLayout, RowMeta};

use super::{CudaAct, CudaBackend};
use crate::backend::{BResult, HeadSpec, KvSpec};

/// bf16 K and V caches, `[layers, slots, max_len, n_kv_heads·head_dim]` each.
pub struct CudaKv {
    pub(super) k: DevBf16,
    pub(super) v: DevBf16,
    pub(super) layout: KvLayout,
    /// Unique among the caches of this process (`Backend::cache_key`).
    pub(super) id: u64,
}

/// Cache ids: never reused, so a recording made on a dropped cache never runs again.
static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

impl CudaBackend {
    pub(super) fn kv_cache_untimed(&self, spec: KvSpec) -> BResult<CudaKv> {
        let layout = KvLayout {
            layers: spec.layers,
            slots: spec.slots,
            max_len: spec.max_len,
            width: spec.n_kv_heads * spec.head_dim,
        };
        let k = self
            .dev
            .zeros_bf16(layout.len())
            .map_err(|e| self.dev_err(e))?;
        let v = self
            .dev
            .zeros_bf16(layout.len())
            .map_err(|e| self.dev_err(e))?;
        Ok(CudaKv {
            k,
            v,
            layout,
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    pub(super) fn kv_write_untimed(
        &self,
        cache: &mut CudaKv,
        layer: usize,
        k: &CudaAct,
        v: &CudaAct,
        meta: &RowMeta,
    ) -> BResult<()> {
        let w = cache.layout.width;
        if k.cols != w || v.cols != w || k.rows != v.rows {
            return Err(self.shape_err(format!(
                "kv_write of k [{}, {}] / v [{}, {}] into a cache of width {w}",
                k.rows, k.cols, v.rows, v.cols
            )));
        }
        let layout = cache.layout;
        self.dev
            .kv_write(
                &mut cache.k,
                &mut cache.v,
                layout,
                layer,
                &k.buf,
                &v.buf,
                meta,
            )
            .map_err(|e| self.dev_err(e))
    }

    pub(super) fn attention_untimed(
        &self,
        q: &CudaAct,
        cache: &CudaKv,
        layer: usize,
        meta: &RowMeta,
        heads: HeadSpec,
    ) -> BResult<CudaAct> {
        if q.cols != heads.n_heads * heads.head_dim {
            return Err(self.shape_err(format!(
                "attention q has {} columns for {} heads of {}",
                q.cols, heads.n_heads, heads.head_dim
            )));
        }
        let mut bf16 = self.bf16_out(q.rows * q.cols)?;
        let buf = self
            .dev
            .attention(
                &q.buf,
                &cache.k,
                &cache.v,
                cache.layout,
                layer,
                meta,
                heads.n_heads,
                heads.n_kv_heads,
                heads.head_dim,
                heads.scale,
                bf16.as_mut(),
            )
            .map_err(|e| self.dev_err(e))?;
        Ok(self.act_with_bf16(buf, q.rows, q.cols, bf16))
    }
}
