//! The decoder, written once against `Backend`:
//!
//! ```text
//! ids ─► embedding ─► [ RMSNorm ─► q/k/v (column) ─► (Qwen3: per-head q/k RMSNorm) ─► RoPE
//!     ─► KV write ─► attention (own heads) ─► o_proj (row + tree all-reduce) ─► + residual
//!     ─► RMSNorm ─► gate/up (column) ─► SiLU·mul ─► down_proj (row) ─► + residual ] × L
//!     ─► (rows that need logits) ─► RMSNorm ─► LM head (vocab shard) ─► all-gather
//! ```

use arbor_kernels::cpu::RopeTable;
use arbor_kernels::tree::is_valid_world;

use crate::backend::{BResult, Backend, HeadSpec, KvRows, KvSpec};
use crate::config::ModelConfig;
use crate::error::{MResult, ModelError};
use crate::layers::{
    ColumnParallelLinear, ColumnPart, Embedding, GateUpLinear, LoadCtx, MoeBlock,
    RowParallelLinear, VocabParallelHead,
};

/// How the attention heads are split over the TP ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadPlan {
    /// Local query heads (`n_heads / tp`) and the first global one.
    pub n_heads: usize,
    pub head0: usize,
    /// Local KV heads and the first global one (a single replicated head when
    /// `n_kv_heads < tp`).
    pub n_kv_heads: usize,
    pub kv_head0: usize,
}

impl HeadPlan {
    /// The heads of `rank` at TP `tp`; an error says why the model does not split and
    /// which TP sizes do.
    pub fn new(cfg: &ModelConfig, rank: usize, tp: usize) -> MResult<Self> {
        Self::plan(cfg, rank, tp).map_err(|e| match e {
            ModelError::Sharding { tp, msg } => {
                let ok: Vec<usize> = [1, 2, 4, 8]
                    .into_iter()
                    .filter(|&t| Self::plan(cfg, 0, t).is_ok())
                    .collect();
                ModelError::Sharding {
                    tp,
                    msg: format!("{msg} (each rank holds whole heads; TP sizes that split this model: {ok:?})"),
                }
            }
            e => e,
        })
    }

    fn plan(cfg: &ModelConfig, rank: usize, tp: usize) -> MResult<Self> {
        let shard_err = |msg: String| ModelError::Sharding { tp, msg };
        if !is_valid_world(tp) {
            return Err(shard_err("TP must be 1, 2, 4 or 8".into()));
        }
        if !cfg.num_heads.is_multiple_of(tp) {
            return Err(shard_err(format!(
                "num_attention_heads {} is not divisible by TP {tp}",
                cfg.num_heads
            )));
        }
        // o_proj is row-parallel over K = heads·head_dim: every rank's segment shard of K
        // must be exactly its heads' columns (true whenever K % 8 == 0).
        let k = cfg.q_dim();
        let layout = arbor_kernels::tree::SegmentLayout::new(k);
        if let Some(r) = (0..tp).find(|&r| layout.shard(r, tp) != (r * k / tp..(r + 1) * k / tp)) {
            return Err(shard_err(format!(
                "num_attention_heads·head_dim = {k} is not a multiple of 8: o_proj's segment shard {:?} on rank {r} does not match its heads' columns {:?}",
                layout.shard(r, tp),
                r * k / tp..(r + 1) * k / tp
            )));
        }
        let n_heads = cfg.num_heads / tp;
        let (n_kv_heads, kv_head0) = if cfg.num_kv_heads >= tp {
            if !cfg.num_kv_heads.is_multiple_of(tp) {
                return Err(shard_err(format!(
                    "num_key_value_heads {} is not divisible by TP {tp}",
                    cfg.num_kv_heads
                )));
            }
            let n = cfg.num_kv_heads / tp;
            (n, rank * n)
        } else {
            if !tp.is_multiple_of(cfg.num_kv_heads) {
                return Err(shard_err(format!(
                    "TP {tp} is not a multiple of num_key_value_heads {} (needed to replicate KV heads)",
                    cfg.num_kv_heads
                )));
            }
            (1, rank * cfg.num_kv_heads / tp)
        };
        Ok(HeadPlan {
            n_heads,
            head0: rank * n_heads,
            n_kv_heads,
            kv_head0,
        })
    }
}

fn part(prefix: &str, out_features: usize, rows: &std::ops::Range<usize>) -> ColumnPart {
    ColumnPart {
        prefix: prefix.to_string(),
        out_features,
        rows: rows.clone(),
    }
}

struct Norm<B: Backend> {
    w: B::Act,
}

impl<B: Backend> Norm<B> {
    fn load(ctx: &LoadCtx<B>, name: &str, len: usize) -> MResult<Self> {
        let w = ctx.vector(name, len, 0..len)?;
        Ok(Norm {
            w: ctx
                .backend
                .act_from_host(&w, 1, len)
                .map_err(|e| ctx.backend_err(e))?,
        })
    }
}

struct Layer<B: Backend> {
    input_norm: Norm<B>,
    /// q, k and v stacked: one GEMM.
    qkv: ColumnParallelLinear<B>,
    q_norm: Option<Norm<B>>,
    k_norm: Option<Norm<B>>,
    o: RowParallelLinear<B>,
    post_norm: Norm<B>,
    mlp: Mlp<B>,
}

enum Mlp<B: Backend> {
    Dense {
        /// gate and up stacked: one GEMM, then SiLU·mul over its halves.
        gate_up: GateUpLinear<B>,
        down: RowParallelLinear<B>,
    },
    Experts(MoeBlock<B>),
}

impl<B: Backend> Mlp<B> {
    fn forward(&self, b: &B, x: &B::Act, routed: Option<&mut Vec<u32>>) -> BResult<B::Act> {
        match self {
            Mlp::Dense { gate_up, down } => down.forward(b, &gate_up.forward(b, x)?),
            Mlp::Experts(moe) => moe.forward(b, x, routed),
        }
    }
}

pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    pub heads: HeadPlan,
    embed: Embedding<B>,
    layers: Vec<Layer<B>>,
    final_norm: Norm<B>,
    head: VocabParallelHead<B>,
    rope: RopeTable,
}

/// The RoPE table of `cfg` for positions `0..max_pos`.
fn rope_table(cfg: &ModelConfig, max_pos: usize) -> MResult<RopeTable> {
    RopeTable::try_new(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling).map_err(|e| {
        ModelError::Config {
            path: "config.json".into(),
            msg: e.to_string(),
        }
    })
}

/// Per-layer hidden states (host copies, replicated after every all-reduce) for the
/// TP=1 shadow comparison.
pub type Trace = Vec<Vec<f32>>;

impl<B: Backend> Model<B> {
    /// Loads this rank's shard; `max_pos` sizes the RoPE table: the positions a run may
    /// use (0 for none yet: [`Model::fit_rope`] sizes it once the KV cache is known).
    pub fn load(ctx: &LoadCtx<B>, cfg: &ModelConfig, max_pos: usize) -> MResult<Self> {
        let heads = HeadPlan::new(cfg, ctx.rank, ctx.tp)?;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let inter_rows = RowParallelLinear::<B>::shard(cfg.intermediate_size, ctx.rank, ctx.tp);
        let q_rows = heads.head0 * hd..(heads.head0 + heads.n_heads) * hd;
        let kv_rows = heads.kv_head0 * hd..(heads.kv_head0 + heads.n_kv_heads) * hd;
        debug_assert_eq!(
            q_rows,
            RowParallelLinear::<B>::shard(cfg.q_dim(), ctx.rank, ctx.tp)
        );
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let mb = cfg.mlp_bias;
            let qk_norm = cfg.arch.has_qk_norm();
            layers.push(Layer {
                input_norm: Norm::load(ctx, &format!("{p}.input_layernorm.weight"), h)?,
                qkv: ColumnParallelLinear::load(
                    ctx,
                    &[
                        part(&format!("{p}.self_attn.q_proj"), cfg.q_dim(), &q_rows),
                        part(&format!("{p}.self_attn.k_proj"), cfg.kv_dim(), &kv_rows),
                        part(&format!("{p}.self_attn.v_proj"), cfg.kv_dim(), &kv_rows),
                    ],
                    h,
                    cfg.qkv_bias,
                )?,
                q_norm: if qk_norm {
                    Some(Norm::load(
                        ctx,
                        &format!("{p}.self_attn.q_norm.weight"),
                        hd,
                    )?)
                } else {
                    None
                },
                k_norm: if qk_norm {
                    Some(Norm::load(
                        ctx,
                        &format!("{p}.self_attn.k_norm.weight"),
                        hd,
                    )?)
                } else {
                    None
                },
                o: RowParallelLinear::load(
                    ctx,
                    &format!("{p}.self_attn.o_proj"),
                    h,
                    cfg.q_dim(),
                    cfg.o_bias,
                )?,
                post_norm: Norm::load(ctx, &format!("{p}.post_attention_layernorm.weight"), h)?,
                mlp: match cfg.moe.as_ref().filter(|m| m.sparse_layers[i]) {
                    Some(moe) => Mlp::Experts(MoeBlock::load(ctx, &p, cfg.arch, moe, h)?),
                    None => Mlp::Dense {
                        gate_up: GateUpLinear::load(
                            ctx,
                            &part(
                                &format!("{p}.mlp.gate_proj"),
                                cfg.intermediate_size,
                                &inter_rows,
                            ),
                            &part(
                                &format!("{p}.mlp.up_proj"),
                                cfg.intermediate_size,
                                &inter_rows,
                            ),
                            h,
                            mb,
                        )?,
                        down: RowParallelLinear::load(
                            ctx,
                            &format!("{p}.mlp.down_proj"),
                            h,
                            cfg.intermediate_size,
                            mb,
                        )?,
                    },
                },
            });
        }
        let head_name = if cfg.tie_word_embeddings {
            // Read by the embedding and the head: a device-resident copy goes after both.
            ctx.store.set_readers("model.embed_tokens.weight", 2);
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        Ok(Model {
            cfg: cfg.clone(),
            heads,
            embed: Embedding::load(ctx, "model.embed_tokens.weight", cfg.vocab_size, h)?,
            layers,
            final_norm: Norm::load(ctx, "model.norm.weight", h)?,
            head: VocabParallelHead::load(ctx, head_name, cfg.vocab_size, h)?,
            rope: rope_table(cfg, max_pos)?,
        })
    }

    /// Sizes the RoPE table to `max_pos` positions (the context of the run: at most what
    /// the KV cache holds), so that a model declaring a long context costs only what is
    /// used. Entry (p, i) depends on p and i alone: any size gives the same bits.
    pub fn fit_rope(&mut self, max_pos: usize) -> MResult<()> {
        if self.rope.max_pos != max_pos {
            self.rope = rope_table(&self.cfg, max_pos)?;
        }
        Ok(())
    }

    /// Positions the RoPE table holds.
    pub fn rope_positions(&self) -> usize {
        self.rope.max_pos
    }

    /// This rank's paged KV cache of `blocks` blocks.
    pub fn kv_spec(&self, blocks: usize) -> KvSpec {
        KvSpec {
            layers: self.cfg.num_layers,
            blocks,
            n_kv_heads: self.heads.n_kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    fn head_spec(&self) -> HeadSpec {
        HeadSpec {
            n_heads: self.heads.n_heads,
            n_kv_heads: self.heads.n_kv_heads,
            head_dim: self.cfg.head_dim,
            scale: 1.0 / (self.cfg.head_dim as f32).sqrt(),
        }
    }

    /// Per-head RMSNorm: view `[rows, n·hd]` as `[rows·n, hd]`.
    fn head_norm(&self, b: &B, x: B::Act, n: usize, norm: &Norm<B>) -> BResult<B::Act> {
        let (rows, cols) = b.shape(&x);
        let hd = self.cfg.head_dim;
        let x = b.reshape(x, rows * n, hd)?;
        let y = b.rms_norm(&x, &norm.w, self.cfg.rms_norm_eps)?;
        b.reshape(y, rows, cols)
    }

    /// Runs `ids` (the sequences' new tokens, concatenated as `rows.seqs` says) through the
    /// model, writing their K/V into `cache` (the blocks of their tables); returns the full logits `[out_rows.len(),
    /// vocab]` of the rows `out_rows` on the host. With `trace`, pushes every layer's output.
    pub fn forward(
        &self,
        b: &B,
        cache: &mut B::KvCache,
        ids: &[u32],
        rows: KvRows<'_>,
        out_rows: &[usize],
        trace: Option<&mut Trace>,
    ) -> BResult<Vec<f32>> {
        match self.forward_logits(b, cache, ids, rows, out_rows, trace)? {
            Some(l) => self.head.to_host(b, &l),
            None => Ok(Vec::new()),
        }
    }

    /// The logits of `forward` where the backend holds them (`[out_rows.len(), cols]`,
    /// cols ≥ vocab); None when no row was asked for.
    pub fn forward_logits(
        &self,
        b: &B,
        cache: &mut B::KvCache,
        ids: &[u32],
        rows: KvRows<'_>,
        out_rows: &[usize],
        trace: Option<&mut Trace>,
    ) -> BResult<Option<B::Act>> {
        self.forward_routed(b, cache, ids, rows, out_rows, trace, None)
    }

    /// Experts a token is routed to in each mixture-of-experts layer (None: a dense model).
    pub fn routed_top_k(&self) -> Option<usize> {
        self.cfg.moe.as_ref().map(|m| m.top_k)
    }

    /// [`Model::forward_logits`]; with `routed`, also sets it to the experts every row of
    /// `ids` was routed to, `[rows, num_layers, top_k]` (SGLang's layout for
    /// `return_routed_experts`), each row's in expert order; a dense layer's entries are 0,
    /// as in SGLang's zero-filled capture buffer. Routes are read as the forward ran them,
    /// so the logits are those of `forward_logits`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_routed(
        &self,
        b: &B,
        cache: &mut B::KvCache,
        ids: &[u32],
        rows: KvRows<'_>,
        out_rows: &[usize],
        mut trace: Option<&mut Trace>,
        mut routed: Option<&mut Vec<u32>>,
    ) -> BResult<Option<B::Act>> {
        let top_k = self.routed_top_k().unwrap_or(0);
        let n_layers = self.layers.len();
        if let Some(out) = routed.as_deref_mut() {
            out.clear();
            out.resize(ids.len() * n_layers * top_k, 0);
        }
        let mut layer_routes = Vec::new();
        let cfg = &self.cfg;
        let hs = self.head_spec();
        let eps = cfg.rms_norm_eps;
        let mut x = self.embed.forward(b, ids)?;
        // The previous layer's last residual add computes this layer's input norm too.
        let mut normed: Option<B::Act> = None;
        for (li, l) in self.layers.iter().enumerate() {
            let n = match normed.take() {
                Some(n) => n,
                None => b.rms_norm(&x, &l.input_norm.w, eps)?,
            };
            // Keys go to the cache before attention reads them, so prefill and decode read
            // the same bf16 keys.
            let q = if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                let [q, k, v]: [B::Act; 3] =
                    l.qkv.forward_parts(b, &n)?.try_into().map_err(|_| {
                        crate::backend::BackendError::Shape(
                            "q/k/v split into other than 3 parts".into(),
                        )
                    })?;
                let mut q = self.head_norm(b, q, hs.n_heads, qn)?;
                let mut k = self.head_norm(b, k, hs.n_kv_heads, kn)?;
                b.rope(&mut q, rows.seqs, hs.n_heads, &self.rope)?;
                b.rope(&mut k, rows.seqs, hs.n_kv_heads, &self.rope)?;
                b.kv_write(cache, li, &k, &v, rows)?;
                q
            } else {
                let qkv = l.qkv.forward(b, &n)?;
                b.qkv_rope_kv(&qkv, cache, li, rows, hs, &self.rope)?
            };
            let a = b.attention(&q, cache, li, rows, hs)?;
            let o = l.o.forward(b, &a)?;
            let n = b.add_rms_norm(&mut x, &o, &l.post_norm.w, eps)?;
            let capture = routed.is_some() && matches!(l.mlp, Mlp::Experts(_));
            layer_routes.clear();
            let d = l.mlp.forward(b, &n, capture.then_some(&mut layer_routes))?;
            if let (true, Some(out)) = (capture, routed.as_deref_mut()) {
                if layer_routes.len() != ids.len() * top_k {
                    return Err(crate::backend::BackendError::Shape(format!(
                        "layer {li} reported {} routed experts for {} rows of top-{top_k}",
                        layer_routes.len(),
                        ids.len()
                    )));
                }
                for (r, experts) in layer_routes.chunks_exact(top_k.max(1)).enumerate() {
                    let at = (r * n_layers + li) * top_k;
                    out[at..at + top_k].copy_from_slice(experts);
                }
            }
            match self.layers.get(li + 1) {
                Some(next) => normed = Some(b.add_rms_norm(&mut x, &d, &next.input_norm.w, eps)?),
                None => b.add_assign(&mut x, &d)?,
            }
            if let Some(t) = trace.as_deref_mut() {
                t.push(b.act_to_host(&x)?);
            }
        }
        if out_rows.is_empty() {
            return Ok(None);
        }
        // A decode step wants every row in order: no copy.
        let all = out_rows.len() == ids.len() && out_rows.iter().enumerate().all(|(i, &r)| i == r);
        let x = if all { x } else { b.select_rows(&x, out_rows)? };
        let x = b.rms_norm(&x, &self.final_norm.w, cfg.rms_norm_eps)?;
        self.head.forward(b, &x).map(Some)
    }

    /// The vocabulary: the logits columns that are tokens.
    pub fn vocab(&self) -> usize {
        self.head.vocab()
    }

    /// `forward_logits`' rows on the host, `[rows, vocab]`.
    pub fn logits_to_host(&self, b: &B, logits: &B::Act) -> BResult<Vec<f32>> {
        self.head.to_host(b, logits)
    }

    /// `Backend::row_stats` of `forward_logits`' rows.
    pub fn row_stats(
        &self,
        b: &B,
        logits: &B::Act,
        pick: &[u32],
        draws: &[crate::sampling::RowDraw],
    ) -> BResult<Vec<crate::sampling::RowStats>> {
        b.row_stats(logits, self.head.vocab(), pick, draws)
    }

    /// `Backend::top_k` of `forward_logits`' rows.
    pub fn top_k(&self, b: &B, logits: &B::Act, ks: &[usize]) -> BResult<Vec<Vec<(u32, f32)>>> {
        b.top_k(logits, self.head.vocab(), ks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::in_memory_path;

    fn cfg(heads: usize, kv: usize, head_dim: usize) -> ModelConfig {
        let text = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": {h}, "intermediate_size": 64,
                "num_hidden_layers": 1, "num_attention_heads": {heads}, "num_key_value_heads": {kv},
                "head_dim": {head_dim}, "vocab_size": 10, "max_position_embeddings": 64}}"#,
            h = heads * head_dim
        );
        ModelConfig::from_json_str(&text, &in_memory_path()).unwrap()
    }

    #[test]
    fn kv_heads_are_split_or_replicated_like_vllm() {
        let c = cfg(8, 4, 16);
        let plans: Vec<HeadPlan> = (0..8).map(|r| HeadPlan::new(&c, r, 8).unwrap()).collect();
        // Each rank has one query head; q head r belongs to KV group r / 2.
        for (r, p) in plans.iter().enumerate() {
            assert_eq!(
                (p.n_heads, p.head0, p.n_kv_heads, p.kv_head0),
                (1, r, 1, r / 2)
            );
        }
        let p = HeadPlan::new(&c, 1, 2).unwrap();
        assert_eq!((p.n_heads, p.head0, p.n_kv_heads, p.kv_head0), (4, 4, 2, 2));
    }

    #[test]
    fn unsplittable_heads_are_refused() {
        let e = HeadPlan::new(&cfg(6, 2, 16), 0, 4).unwrap_err().to_string();
        assert!(
            e.contains("num_attention_heads 6 is not divisible by TP 4"),
            "{e}"
        );
        let e = HeadPlan::new(&cfg(8, 8, 16), 0, 3).unwrap_err().to_string();
        assert!(e.contains("TP must be 1, 2, 4 or 8"), "{e}");
        // 6 heads × 10 = 60 columns: segments of 8 do not fall on head boundaries at TP 2.
        assert!(HeadPlan::new(&cfg(6, 6, 10), 0, 1).is_ok());
        let e = HeadPlan::new(&cfg(6, 6, 10), 0, 2).unwrap_err().to_string();
        assert!(e.contains("not a multiple of 8"), "{e}");
    }
}
