//! A mixture-of-experts MLP (Qwen3-MoE, Mixtral) with the same bits at every TP size and
//! batch:
//! - the router's logits go through the tree GEMM over the whole hidden size on every rank
//!   (its weight is replicated), so every rank routes every token alike;
//! - a token's experts are the top-k of the f32 softmax, ties to the lower expert index;
//!   the chosen probabilities are renormalised (where the config says) in expert order;
//! - each expert is the dense MLP at its own width, column- then row-parallel: its output
//!   is reduced over its intermediate dimension by the tree, exactly as a dense down
//!   projection is; every expert's partials go through one all-reduce;
//! - a token's output is its experts' outputs weighted and added in expert-index order.
//!
//! A backend that prepares the experts (`Backend::moe_experts`: the CUDA backend) routes
//! and sums on the device, with every expert's rows in one grouped GEMM, and its steps can
//! be recorded as graphs. Otherwise (the CPU, or `ARBOR_MOE=host` on the GPU) the routes
//! and the sum run on the host here, the router's logits and the experts' reduced outputs
//! coming back between kernels; the CUDA backend then does not record such a step
//! (`backend::cuda::graphs`).

use super::{ColumnParallelLinear, ColumnPart, GateUpLinear, LoadCtx, RowParallelLinear};
use crate::backend::{BResult, Backend, BackendError, MoeSpec};
use crate::config::{checkpoint_names, Arch, MoeConfig};
use crate::error::MResult;

struct Expert<B: Backend> {
    gate_up: GateUpLinear<B>,
    down: RowParallelLinear<B>,
}

pub struct MoeBlock<B: Backend> {
    /// Every expert's row on every rank.
    router: ColumnParallelLinear<B>,
    experts: Vec<Expert<B>>,
    top_k: usize,
    norm_topk_prob: bool,
    hidden: usize,
    /// The experts as the backend runs them itself (`None`: routed on the host).
    prepared: Option<B::Experts>,
}

/// Where one token goes: its experts in index order, with their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub experts: Vec<(usize, f32)>,
}

/// The experts of one token from its router logits: softmax in f32 (max first, sums in
/// index order), the `top_k` most probable (ties to the lower index), their probabilities
/// renormalised to sum to 1 if `norm`, listed in expert order.
pub fn route(logits: &[f32], top_k: usize, norm: bool) -> Route {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    order.sort_unstable();
    let probs: Vec<f32> = order.iter().map(|&e| exps[e] / sum).collect();
    let chosen: f32 = probs.iter().sum();
    Route {
        experts: order
            .into_iter()
            .zip(probs)
            .map(|(e, p)| (e, if norm { p / chosen } else { p }))
            .collect(),
    }
}

impl<B: Backend> MoeBlock<B> {
    /// Layer `prefix`'s router and experts (`model.layers.N`), named as `arch`'s
    /// checkpoints name them.
    pub fn load(
        ctx: &LoadCtx<B>,
        prefix: &str,
        arch: Arch,
        moe: &MoeConfig,
        hidden: usize,
    ) -> MResult<Self> {
        let (block, [gate, up, down]) = checkpoint_names(arch);
        let e_count = moe.num_experts;
        let router = ColumnParallelLinear::load(
            ctx,
            &[ColumnPart {
                prefix: format!("{prefix}.{block}.gate"),
                out_features: e_count,
                rows: 0..e_count,
            }],
            hidden,
            false,
        )?;
        let inter = moe.expert_intermediate;
        let rows = RowParallelLinear::<B>::shard(inter, ctx.rank, ctx.tp);
        let experts = (0..e_count)
            .map(|e| {
                let x = format!("{prefix}.{block}.experts.{e}");
                let part = |name: &str| ColumnPart {
                    prefix: format!("{x}.{name}"),
                    out_features: inter,
                    rows: rows.clone(),
                };
                Ok(Expert {
                    gate_up: GateUpLinear::load(ctx, &part(gate), &part(up), hidden, false)?,
                    down: RowParallelLinear::load(
                        ctx,
                        &format!("{x}.{down}"),
                        hidden,
                        inter,
                        false,
                    )?,
                })
            })
            .collect::<MResult<Vec<_>>>()?;
        let prepared = Self::prepare(ctx.backend, &experts, moe).map_err(|e| ctx.backend_err(e))?;
        Ok(MoeBlock {
            router,
            experts,
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
            hidden,
            prepared,
        })
    }

    /// The backend's own form of the experts, where it has one and every expert has the
    /// same bias-free weights and trees.
    fn prepare(b: &B, experts: &[Expert<B>], moe: &MoeConfig) -> BResult<Option<B::Experts>> {
        let mut gate_up = Vec::with_capacity(experts.len());
        let mut down = Vec::with_capacity(experts.len());
        let mut trees = None;
        for x in experts {
            let (Some((gu, gu_tree)), Some((d, d_tree))) = (x.gate_up.weight(), x.down.weight())
            else {
                return Ok(None);
            };
            if *trees.get_or_insert((gu_tree, d_tree)) != (gu_tree, d_tree) {
                return Ok(None);
            }
            gate_up.push(gu);
            down.push(d);
        }
        let Some((gate_up_tree, down_tree)) = trees else {
            return Ok(None);
        };
        let spec = MoeSpec {
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
            gate_up: gate_up_tree,
            down: down_tree,
        };
        b.moe_experts(&gate_up, &down, spec)
    }

    /// Every row's route.
    pub fn routes(&self, b: &B, x: &B::Act) -> BResult<Vec<Route>> {
        let logits = b.act_to_host(&self.router.forward(b, x)?)?;
        let e = self.experts.len();
        Ok(logits
            .chunks_exact(e)
            .map(|l| route(l, self.top_k, self.norm_topk_prob))
            .collect())
    }

    /// Experts each token is routed to.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The block's output for the rows of `x` (`[rows, hidden]`, identical on every rank).
    /// With `routed`, appends each row's experts as this forward chose them (`[rows,
    /// top_k]`, expert order), read where the routing ran; the output is the same either
    /// way.
    pub fn forward(&self, b: &B, x: &B::Act, routed: Option<&mut Vec<u32>>) -> BResult<B::Act> {
        match &self.prepared {
            Some(experts) => b.moe_forward(x, &self.router.forward(b, x)?, experts, routed),
            None => self.forward_on_host(b, x, routed),
        }
    }

    /// [`MoeBlock::forward`] with the routes and the weighted sum on the host.
    fn forward_on_host(&self, b: &B, x: &B::Act, routed: Option<&mut Vec<u32>>) -> BResult<B::Act> {
        let routes = self.routes(b, x)?;
        if let Some(out) = routed {
            out.extend(
                routes
                    .iter()
                    .flat_map(|r| r.experts.iter().map(|&(e, _)| e as u32)),
            );
        }
        let rows = routes.len();
        let h = self.hidden;
        // The rows each expert serves, in row order.
        let mut served: Vec<Vec<usize>> = vec![Vec::new(); self.experts.len()];
        for (r, route) in routes.iter().enumerate() {
            for &(e, _) in &route.experts {
                served[e].push(r);
            }
        }
        let mut partials: Vec<f32> = Vec::with_capacity(rows * self.top_k * h);
        let mut first_row = vec![0usize; self.experts.len()];
        for (e, expert) in self.experts.iter().enumerate() {
            first_row[e] = partials.len() / h;
            if served[e].is_empty() {
                continue;
            }
            let xe = b.select_rows(x, &served[e])?;
            let m = expert.gate_up.forward(b, &xe)?;
            partials.extend(b.act_to_host(&expert.down.partial(b, &m)?)?);
        }
        let total = partials.len() / h;
        let reduced = b.tree_all_reduce(b.act_from_host(&partials, total, h)?)?;
        let ys = b.act_to_host(&reduced)?;
        // Where each (row, expert) output lies among the reduced rows.
        let mut next = first_row;
        let mut out = vec![0f32; rows * h];
        for (r, route) in routes.iter().enumerate() {
            let o = &mut out[r * h..(r + 1) * h];
            for &(e, w) in &route.experts {
                let y = &ys[next[e] * h..(next[e] + 1) * h];
                next[e] += 1;
                for (a, &v) in o.iter_mut().zip(y) {
                    *a += w * v;
                }
            }
        }
        if out.len() != rows * h {
            return Err(BackendError::Shape(format!(
                "MoE output of {} values for {rows} rows",
                out.len()
            )));
        }
        b.act_from_host(&out, rows, h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::config::ModelConfig;
    use crate::synth::{make_model, Preset, SynthOptions};
    use crate::weights::WeightStore;

    /// The experts a forward reports are `route()` of the router's logits for each row,
    /// in expert order, and asking for them changes no bit of the output.
    #[test]
    fn reported_experts_are_the_routes_of_the_router_logits() {
        let dir = std::env::temp_dir().join(format!("arbor-moe-routed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        make_model(&SynthOptions::new(Arch::Qwen3Moe, Preset::Tiny, 5, &dir)).unwrap();
        let (config, weights) = (
            ModelConfig::from_dir(&dir).unwrap(),
            WeightStore::open(&dir).unwrap(),
        );
        let _ = std::fs::remove_dir_all(&dir);
        let b = CpuBackend::new(std::sync::Arc::new(arbor_collective::SingleComm));
        let ctx = LoadCtx {
            backend: &b,
            store: &weights,
            rank: 0,
            tp: 1,
            row_tp: 1,
        };
        let cfg = &config;
        let moe = cfg.moe.as_ref().unwrap();
        let layer = moe.sparse_layers.iter().position(|&s| s).unwrap();
        let block = MoeBlock::load(
            &ctx,
            &format!("model.layers.{layer}"),
            cfg.arch,
            moe,
            cfg.hidden_size,
        )
        .unwrap();
        let (rows, h) = (7, cfg.hidden_size);
        let xs: Vec<f32> = (0..rows * h)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let x = b.act_from_host(&xs, rows, h).unwrap();
        let mut reported = Vec::new();
        let with = b
            .act_to_host(&block.forward(&b, &x, Some(&mut reported)).unwrap())
            .unwrap();
        let without = b
            .act_to_host(&block.forward(&b, &x, None).unwrap())
            .unwrap();
        assert!(with
            .iter()
            .zip(&without)
            .all(|(a, c)| a.to_bits() == c.to_bits()));
        let logits = b
            .act_to_host(&block.router.forward(&b, &x).unwrap())
            .unwrap();
        let expected: Vec<u32> = logits
            .chunks_exact(moe.num_experts)
            .flat_map(|l| route(l, moe.top_k, moe.norm_topk_prob).experts)
            .map(|(e, _)| e as u32)
            .collect();
        assert_eq!(reported.len(), rows * moe.top_k);
        assert_eq!(reported, expected);
        // Not one expert for every row: the rows really route apart.
        assert!(reported
            .chunks(moe.top_k)
            .any(|r| r != &reported[..moe.top_k]));
    }

    #[test]
    fn routes_take_the_most_probable_experts_ties_to_the_lower_index() {
        let r = route(&[0.0, 2.0, 1.0, 2.0], 2, false);
        let e: Vec<usize> = r.experts.iter().map(|x| x.0).collect();
        assert_eq!(e, vec![1, 3]);
        let p = r.experts[0].1;
        assert_eq!(p, r.experts[1].1);
        assert!((p - 2f32.exp() / (1.0 + 2.0 * 2f32.exp() + 1f32.exp())).abs() < 1e-6);
        // Renormalised, the chosen weights sum to 1; listed in expert order.
        let r = route(&[3.0, 0.5, 1.0, -2.0], 2, true);
        assert_eq!(
            r.experts.iter().map(|x| x.0).collect::<Vec<_>>(),
            vec![0, 2]
        );
        let s: f32 = r.experts.iter().map(|x| x.1).sum();
        assert!((s - 1.0).abs() < 1e-6, "{s}");
        // One logit a bit above its tie: chosen.
        let r = route(&[1.0, 1.0 + f32::EPSILON * 2.0], 1, true);
        assert_eq!(r.experts, vec![(1, 1.0)]);
    }
}
