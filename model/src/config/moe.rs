//! The mixture-of-experts keys of Qwen3-MoE and Mixtral configs: how many experts, how many
//! a token is routed to, their width, and which layers have them.

use super::{cfg_err, Arch, Reader};
use crate::error::MResult;

/// The experts of a mixture-of-experts model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeConfig {
    /// Experts in every sparse layer.
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// The intermediate width of one expert.
    pub expert_intermediate: usize,
    /// Renormalise the chosen experts' probabilities to sum to 1 (Mixtral always does).
    pub norm_topk_prob: bool,
    /// Per layer: whether its MLP is the experts (else the dense MLP of
    /// `intermediate_size`).
    pub sparse_layers: Vec<bool>,
}

/// Keys only a mixture-of-experts config may set.
pub const KEYS: &[&str] = &[
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
];

/// More experts than any published checkpoint has (≤ 512), so a corrupt count is refused
/// before it sizes anything.
const MAX_EXPERTS: usize = 4096;

/// The experts of `r`'s config (None for a dense architecture, which may set none of
/// [`KEYS`]); `intermediate_size` is the dense MLP's width (Mixtral's experts use it).
pub(super) fn parse(
    r: &Reader,
    arch: Arch,
    num_layers: usize,
    intermediate_size: usize,
) -> MResult<Option<MoeConfig>> {
    let path = r.path;
    if !arch.is_moe() {
        if let Some(k) = KEYS
            .iter()
            .find(|k| !matches!(r.obj.get(**k), None | Some(serde_json::Value::Null)))
        {
            return Err(cfg_err(
                path,
                format!(
                    "\"{k}\" is a mixture-of-experts key, but {arch:?} is a dense architecture"
                ),
            ));
        }
        return Ok(None);
    }
    // The Hub's Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts
    // (Mixtral's name) for both.
    let num_experts = match (
        r.usize_opt("num_experts")?,
        r.usize_opt("num_local_experts")?,
    ) {
        (Some(a), Some(b)) if a != b => {
            return Err(cfg_err(
                path,
                format!("\"num_experts\" {a} and \"num_local_experts\" {b} disagree"),
            ))
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => {
            return Err(cfg_err(
                path,
                "missing field \"num_experts\" (or \"num_local_experts\")".into(),
            ))
        }
    };
    if num_experts == 0 || num_experts > MAX_EXPERTS {
        return Err(cfg_err(
            path,
            format!("{num_experts} experts: arbor accepts 1 to {MAX_EXPERTS}"),
        ));
    }
    let top_k = r.usize_req("num_experts_per_tok")?;
    if top_k == 0 || top_k > num_experts {
        return Err(cfg_err(
            path,
            format!("num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts"),
        ));
    }
    let (expert_intermediate, norm_topk_prob, sparse_layers) = match arch {
        Arch::Mixtral => {
            for k in [
                "moe_intermediate_size",
                "norm_topk_prob",
                "decoder_sparse_step",
                "mlp_only_layers",
            ] {
                if !matches!(r.obj.get(k), None | Some(serde_json::Value::Null)) {
                    return Err(cfg_err(path, format!("\"{k}\" is not a Mixtral key")));
                }
            }
            (intermediate_size, true, vec![true; num_layers])
        }
        _ => {
            let step = r.usize_opt("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(cfg_err(
                    path,
                    "decoder_sparse_step 0 (it must be at least 1)".into(),
                ));
            }
            let dense = mlp_only_layers(r, num_layers)?;
            let sparse = (0..num_layers)
                .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                .collect();
            (
                r.usize_req("moe_intermediate_size")?,
                r.bool_opt("norm_topk_prob")?.unwrap_or(false),
                sparse,
            )
        }
    };
    if expert_intermediate == 0 {
        return Err(cfg_err(path, "an expert's intermediate size is 0".into()));
    }
    Ok(Some(MoeConfig {
        num_experts,
        top_k,
        expert_intermediate,
        norm_topk_prob,
        sparse_layers,
    }))
}

/// `mlp_only_layers`: the layers that keep a dense MLP.
fn mlp_only_layers(r: &Reader, num_layers: usize) -> MResult<Vec<usize>> {
    let path = r.path;
    match r.obj.get("mlp_only_layers") {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|v| match v.as_u64().and_then(|x| usize::try_from(x).ok()) {
                Some(i) if i < num_layers => Ok(i),
                _ => Err(cfg_err(
                    path,
                    format!("mlp_only_layers holds {v}, not a layer index below {num_layers}"),
                )),
            })
            .collect(),
        Some(v) => Err(cfg_err(
            path,
            format!("\"mlp_only_layers\" must be a list, got {v}"),
        )),
    }
}

/// How `arch`'s checkpoints name a layer's experts: the block under `model.layers.N`
/// (whose `gate` is the router) and each expert's gate, up and down projections.
pub fn checkpoint_names(arch: Arch) -> (&'static str, [&'static str; 3]) {
    match arch {
        Arch::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    }
}
