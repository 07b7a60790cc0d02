//! The paged KV cache on the GPU: its K and V pools, the write of a batch's rows, and
//! attention over it (the paged attention kernels).

use std::sync::atomic::{AtomicU64, Ordering};

use arbor_kernels::cuda::paged_attention::{decode_pos_limit, SeqSpan};
use arbor_kernels::cuda::{DevBf16, DevF32, RowMeta};
use arbor_kernels::paged::PagedKvLayout;

use super::step::StepMeta;
use super::{CudaAct, CudaBackend};
use crate::backend::{BResult, HeadSpec, KvSpec};

/// bf16 K and V pools, `[layers, blocks, n_kv_heads, KV_BLOCK, head_dim]` each.
pub struct CudaKv {
    pub(super) k: DevBf16,
    pub(super) v: DevBf16,
    pub(super) layout: PagedKvLayout,
    /// Unique among the caches of this process (`Backend::cache_key`).
    pub(super) id: u64,
}

/// Cache ids: never reused, so a recording made on a dropped cache never runs again.
static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

/// Output buffers an op writes instead of its own: the f32 values, and their bf16
/// rounding where wanted.
pub(super) struct Placed {
    pub(super) f32: DevF32,
    pub(super) bf16: Option<DevBf16>,
}

impl CudaBackend {
    pub(super) fn kv_cache_untimed(&self, spec: KvSpec) -> BResult<CudaKv> {
        let layout = spec;
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
        let w = cache.layout.n_kv_heads * cache.layout.head_dim;
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

    /// Attention of `q` over the cache, the rows routed to the kernels once per step
    /// (a recorded decode step: all of them through the decode kernel at its split bucket).
    pub(super) fn attention_untimed(
        &self,
        q: &CudaAct,
        cache: &CudaKv,
        layer: usize,
        step: &mut StepMeta,
        heads: HeadSpec,
    ) -> BResult<CudaAct> {
        self.attention_untimed_into(q, cache, layer, step, heads, None)
    }

    /// `attention_untimed` written into the buffers of `out` when given.
    pub(super) fn attention_untimed_into(
        &self,
        q: &CudaAct,
        cache: &CudaKv,
        layer: usize,
        step: &mut StepMeta,
        heads: HeadSpec,
        out: Option<Placed>,
    ) -> BResult<CudaAct> {
        const K: &str = "paged attention";
        if q.cols != heads.n_heads * heads.head_dim
            || heads.n_kv_heads != cache.layout.n_kv_heads
            || heads.head_dim != cache.layout.head_dim
        {
            return Err(self.shape_err(format!(
                "attention q has {} columns for {} heads of {}, over a cache of {} KV heads of {}",
                q.cols,
                heads.n_heads,
                heads.head_dim,
                cache.layout.n_kv_heads,
                cache.layout.head_dim
            )));
        }
        let meta: &RowMeta = &step.meta;
        meta.limit_blocks(K, cache.layout.blocks)
            .map_err(|e| self.dev_err(e))?;
        if step.routing.is_none() {
            let routing = match step.split_bucket {
                Some(splits) => self.dev.attn_routing_decode(step.rows, splits),
                None => {
                    let spans: Vec<SeqSpan> = step
                        .seqs
                        .iter()
                        .map(|s| SeqSpan {
                            row0: s.row0,
                            len: s.len,
                            pos0: s.pos0,
                            table0: s.table0,
                        })
                        .collect();
                    self.dev
                        .attn_routing(&spans, heads.head_dim)
                        .map_err(|e| self.dev_err(e))?
                }
            };
            step.routing = Some(routing);
        }
        let routing = step
            .routing
            .as_ref()
            .ok_or_else(|| self.shape_err("attention routing missing".into()))?;
        if step.split_bucket.is_some() {
            // The decode kernel's grid covers `max_splits` splits: the rows must stay below
            // them (a replayed recording is checked against this limit). A routing made
            // from the rows covers them by construction.
            step.meta
                .limit_positions(
                    K,
                    "the attention's split bucket",
                    decode_pos_limit(routing.max_splits()),
                )
                .map_err(|e| self.dev_err(e))?;
        }
        let (dst, mut bf16) = match out {
            Some(p) => (Some(p.f32), p.bf16),
            None => (None, self.bf16_out(q.rows, q.cols)?),
        };
        let buf = self
            .dev
            .paged_attention_into(
                &q.buf,
                &cache.k,
                &cache.v,
                cache.layout,
                layer,
                &step.meta.paged(),
                routing,
                heads.n_heads,
                heads.scale,
                dst,
                bf16.as_mut(),
            )
            .map_err(|e| self.dev_err(e))?;
        Ok(self.act_with_bf16(buf, q.rows, q.cols, bf16))
    }
}
