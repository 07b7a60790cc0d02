//! Hugging Face `config.json` for the decoder architectures arbor runs:
//! LlamaForCausalLM (Llama 2/3.x), MistralForCausalLM (Llama-shaped; a sliding window only
//! where it covers the whole context), Qwen2ForCausalLM (Qwen2 and Qwen2.5: q/k/v biases)
//! and dense Qwen3ForCausalLM (per-head q/k RMSNorm, `head_dim` independent of
//! hidden/heads), as transformers 4 and 5 write them.
//!
//! Strict by design: every key either is read (and implemented, or refused value by
//! value), or is known not to change inference; any other key is an error naming it,
//! because a silently ignored key is a silently wrong model.

mod keys;
mod moe;
mod rope;

use std::path::{Path, PathBuf};

use arbor_kernels::cpu::{RopeScaling, RopeTable};
use serde_json::{Map, Value};

use crate::error::{MResult, ModelError};

pub use keys::ALLOW_ENV;
pub use moe::{checkpoint_names, MoeConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    /// Qwen2 and Qwen2.5: Llama's layers with biases on q/k/v (none on o).
    Qwen2,
    Qwen3,
    /// Qwen3's attention with a mixture of experts in place of the MLP.
    Qwen3Moe,
    /// Mistral's attention with 8 experts, 2 per token.
    Mixtral,
}

impl Arch {
    /// Per-head RMSNorm of q and k before RoPE.
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe)
    }

    /// A mixture of experts in place of (some) MLPs.
    pub fn is_moe(self) -> bool {
        matches!(self, Arch::Qwen3Moe | Arch::Mixtral)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    /// The architecture string as written in config.json.
    pub arch_name: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on the q/k/v projections (Llama's `attention_bias`; always for Qwen2).
    pub qkv_bias: bool,
    /// A bias on the o projection (Llama's `attention_bias`; never for Qwen2).
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The attention window of the layers that slide (None: every layer sees every key).
    /// arbor computes full attention, so it runs such a model only in a context the window
    /// covers ([`ModelConfig::check_context`]).
    pub sliding_window: Option<usize>,
    /// The experts of a mixture-of-experts model (None: every MLP is dense).
    pub moe: Option<MoeConfig>,
    /// `dtype` / `torch_dtype` as written (arbor computes with bf16 weights whatever it says).
    pub dtype: Option<String>,
}

impl ModelConfig {
    /// Reads `<dir>/config.json`; keys named in `ARBOR_ALLOW_CONFIG_KEYS` are ignored.
    pub fn from_dir(dir: &Path) -> MResult<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_json_str_allowing(&text, &path, &keys::allowed_from_env())
    }

    /// Parses config.json text; `path` only names the file in errors.
    pub fn from_json_str(text: &str, path: &Path) -> MResult<Self> {
        Self::from_json_str_allowing(text, path, &[])
    }

    /// As [`ModelConfig::from_json_str`], ignoring the unknown keys in `allowed` (with a
    /// warning) instead of refusing them.
    pub fn from_json_str_allowing(text: &str, path: &Path, allowed: &[String]) -> MResult<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| cfg_err(path, format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| cfg_err(path, "top level is not a JSON object".into()))?;
        let r = Reader { obj, path };
        let unknown = keys::unknown(obj, allowed);
        if !unknown.is_empty() {
            return Err(cfg_err(
                path,
                format!(
                    "unknown key{} {}: arbor does not know what {} to the model's math, so it refuses to guess (if you know {} harmless, list {} in {}=key,...)",
                    if unknown.len() > 1 { "s" } else { "" },
                    unknown.iter().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(", "),
                    if unknown.len() > 1 { "they do" } else { "it does" },
                    if unknown.len() > 1 { "they are" } else { "it is" },
                    if unknown.len() > 1 { "them" } else { "it" },
                    keys::ALLOW_ENV,
                ),
            ));
        }
        for k in obj.keys().filter(|k| allowed.contains(k)) {
            if !keys::MATH.contains(&k.as_str()) && !keys::INERT.contains(&k.as_str()) {
                tracing::warn!(config = %path.display(), key = %k, "ignoring config key (allowed by {})", keys::ALLOW_ENV);
            }
        }

        let arch_name = match obj.get("architectures") {
            Some(Value::Array(a)) if a.len() == 1 => a[0]
                .as_str()
                .ok_or_else(|| cfg_err(path, "\"architectures\"[0] is not a string".into()))?
                .to_string(),
            Some(other) => {
                return Err(cfg_err(
                    path,
                    format!("\"architectures\" must be a list of one name, got {other}"),
                ))
            }
            None => return Err(cfg_err(path, "missing field \"architectures\"".into())),
        };
        let (arch, model_types): (Arch, &[&str]) = match arch_name.as_str() {
            "LlamaForCausalLM" => (Arch::Llama, &["llama"]),
            "MistralForCausalLM" => (Arch::Llama, &["mistral"]),
            "Qwen2ForCausalLM" => (Arch::Qwen2, &["qwen2"]),
            "Qwen3ForCausalLM" => (Arch::Qwen3, &["qwen3"]),
            "Qwen3MoeForCausalLM" => (Arch::Qwen3Moe, &["qwen3_moe"]),
            "MixtralForCausalLM" => (Arch::Mixtral, &["mixtral"]),
            _ => {
                return Err(ModelError::UnknownArch {
                    path: path.to_path_buf(),
                    arch: arch_name,
                })
            }
        };
        match obj.get("model_type") {
            None | Some(Value::Null) => {}
            Some(Value::String(t)) if model_types.contains(&t.as_str()) => {}
            Some(t) => {
                return Err(cfg_err(
                    path,
                    format!("model_type {t} does not match the architecture {arch_name} (expected {model_types:?})"),
                ))
            }
        }
        r.refuse_set(
            "quantization_config",
            "quantized checkpoints are not supported",
        )?;
        r.refuse_set("pruned_heads", "pruned attention heads are not supported")?;
        r.refuse_true("is_encoder_decoder")?;
        r.refuse_true("add_cross_attention")?;
        let num_layers = r.usize_req("num_hidden_layers")?;
        // Checked before anything is sized by it (the per-layer types below).
        if num_layers > MAX_LAYERS {
            return Err(cfg_err(
                path,
                format!("num_hidden_layers {num_layers} is beyond the {MAX_LAYERS} layers arbor accepts"),
            ));
        }
        let max_position_embeddings = r.usize_req("max_position_embeddings")?;
        check_positions("max_position_embeddings", max_position_embeddings, path)?;
        let layer_types = layer_types(&r, arch, num_layers)?;
        let rope = rope::parse(obj, path, &layer_types, max_position_embeddings)?;
        let sliding_window =
            if layer_types.iter().any(|t| t == "sliding_attention") {
                match r.usize_opt("sliding_window")? {
                    Some(w) if w > 0 => Some(w),
                    _ => return Err(cfg_err(
                        path,
                        "layers of type \"sliding_attention\" but no positive \"sliding_window\""
                            .into(),
                    )),
                }
            } else {
                None
            };
        let dtype = dtype(&r)?;
        let attention_bias = r.bool_opt("attention_bias")?;
        let (qkv_bias, o_bias) = match (arch, attention_bias) {
            // Qwen2's attention has q/k/v biases and no o bias, with no key to say so.
            (Arch::Qwen2, None) => (true, false),
            (Arch::Qwen2, Some(_)) => return Err(cfg_err(
                path,
                "\"attention_bias\" is not a Qwen2 key (Qwen2 has q/k/v biases and no o_proj bias)"
                    .into(),
            )),
            (_, b) => (b.unwrap_or(false), b.unwrap_or(false)),
        };

        let hidden_size = r.usize_req("hidden_size")?;
        let num_heads = r.usize_req("num_attention_heads")?;
        let num_kv_heads = r.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match r.usize_opt("head_dim")? {
            Some(h) => h,
            None => {
                if num_heads == 0 || hidden_size % num_heads != 0 {
                    return Err(cfg_err(
                        path,
                        format!("no \"head_dim\" and hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads}"),
                    ));
                }
                hidden_size / num_heads
            }
        };
        let intermediate_size = r.usize_req("intermediate_size")?;
        let moe = moe::parse(&r, arch, num_layers, intermediate_size)?;
        let cfg = ModelConfig {
            arch,
            arch_name,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: r.usize_req("vocab_size")?,
            rms_norm_eps: rms_norm_eps(&r)?,
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            max_position_embeddings,
            tie_word_embeddings: r.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias: r.bool_opt("mlp_bias")?.unwrap_or(false),
            bos_token_id: token_ids(obj.get("bos_token_id"), "bos_token_id", path)?
                .first()
                .copied(),
            eos_token_ids: token_ids(obj.get("eos_token_id"), "eos_token_id", path)?,
            sliding_window,
            moe,
            dtype,
        };
        cfg.validate(&r)?;
        Ok(cfg)
    }

    fn validate(&self, r: &Reader) -> MResult<()> {
        let path = r.path;
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(cfg_err(path, format!("\"{name}\" must be positive, got 0")));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(cfg_err(
                path,
                format!(
                    "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    self.num_heads, self.num_kv_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(cfg_err(
                path,
                format!("head_dim {} must be even for RoPE", self.head_dim),
            ));
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(cfg_err(
                path,
                format!("vocab_size {} exceeds u32", self.vocab_size),
            ));
        }
        // The RoPE parameters as the table takes them, checked now (nothing is built) so
        // that a bad value is refused by name when the config is read.
        RopeTable::check(self.head_dim, self.rope_theta, self.rope_scaling)
            .map_err(|e| cfg_err(path, e.to_string()))?;
        if let Some(act) = r.obj.get("hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(cfg_err(
                    path,
                    format!("hidden_act {act} is not supported (only \"silu\")"),
                ));
            }
        }
        Ok(())
    }

    /// The longest context in which arbor's math is the model's, and why it is bounded: a
    /// sliding window (arbor attends to every key) or "dynamic" RoPE (which HF rescales
    /// past its original context, making a row depend on its call's length).
    pub fn exact_context_limit(&self) -> Option<(usize, String)> {
        let window = self
            .sliding_window
            .map(|w| (w, format!("sliding_window {w}")));
        let dynamic = match self.rope_scaling {
            Some(RopeScaling::Dynamic {
                original_max_position_embeddings: o,
                ..
            }) => Some((
                o,
                format!("\"dynamic\" RoPE beyond its original {o} positions"),
            )),
            _ => None,
        };
        [window, dynamic]
            .into_iter()
            .flatten()
            .min_by_key(|(n, _)| *n)
    }

    /// The context length a run uses: `requested` (`--max-seq-len`) when given and at most
    /// `max_position_embeddings`, else the model's whole context where its math is exact
    /// (a sliding window may cover less); refused where the model's math is not what arbor
    /// computes ([`ModelConfig::check_context`]). The KV cache bounds it further (the
    /// runner's `init_cache`). `path`: config.json, for errors.
    pub fn context_len(&self, requested: Option<usize>, path: &Path) -> MResult<usize> {
        let n = match requested {
            Some(0) => return Err(cfg_err(path, "requested max_seq_len 0".into())),
            Some(n) if n > self.max_position_embeddings => {
                return Err(cfg_err(
                    path,
                    format!(
                        "requested max_seq_len {n} exceeds max_position_embeddings {}",
                        self.max_position_embeddings
                    ),
                ))
            }
            Some(n) => n,
            None => self
                .exact_context_limit()
                .map_or(usize::MAX, |(n, _)| n)
                .min(self.max_position_embeddings),
        };
        self.check_context(n, path)?;
        Ok(n)
    }

    /// Refuses a context in which the model's math differs from what arbor computes
    /// ([`ModelConfig::exact_context_limit`]).
    pub fn check_context(&self, max_seq_len: usize, path: &Path) -> MResult<()> {
        match self.exact_context_limit() {
            Some((limit, why)) if max_seq_len > limit => Err(cfg_err(
                path,
                format!(
                    "a context of {max_seq_len} positions needs {why}, which arbor does not implement; it computes this model exactly up to {limit} positions (run with --max-seq-len {limit} or less)"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Whether `other` (a checkpoint's config) describes the same model: the same
    /// architecture, every shape, and every constant of the math, so that its weights can
    /// replace these in a running server. The context length, token ids and dtype may
    /// differ (the server keeps its own). Names the first field that differs.
    pub fn same_model_as(&self, other: &ModelConfig) -> Result<(), String> {
        let fields: [(&str, String, String); 17] = [
            (
                "architectures",
                self.arch_name.clone(),
                other.arch_name.clone(),
            ),
            (
                "hidden_size",
                self.hidden_size.to_string(),
                other.hidden_size.to_string(),
            ),
            (
                "intermediate_size",
                self.intermediate_size.to_string(),
                other.intermediate_size.to_string(),
            ),
            (
                "num_hidden_layers",
                self.num_layers.to_string(),
                other.num_layers.to_string(),
            ),
            (
                "num_attention_heads",
                self.num_heads.to_string(),
                other.num_heads.to_string(),
            ),
            (
                "num_key_value_heads",
                self.num_kv_heads.to_string(),
                other.num_kv_heads.to_string(),
            ),
            (
                "head_dim",
                self.head_dim.to_string(),
                other.head_dim.to_string(),
            ),
            (
                "vocab_size",
                self.vocab_size.to_string(),
                other.vocab_size.to_string(),
            ),
            (
                "rms_norm_eps",
                format!("{:e}", self.rms_norm_eps),
                format!("{:e}", other.rms_norm_eps),
            ),
            (
                "rope_theta",
                self.rope_theta.to_string(),
                other.rope_theta.to_string(),
            ),
            (
                "rope_scaling",
                format!("{:?}", self.rope_scaling),
                format!("{:?}", other.rope_scaling),
            ),
            (
                "tie_word_embeddings",
                self.tie_word_embeddings.to_string(),
                other.tie_word_embeddings.to_string(),
            ),
            (
                "q/k/v biases",
                self.qkv_bias.to_string(),
                other.qkv_bias.to_string(),
            ),
            (
                "o_proj bias",
                self.o_bias.to_string(),
                other.o_bias.to_string(),
            ),
            (
                "mlp_bias",
                self.mlp_bias.to_string(),
                other.mlp_bias.to_string(),
            ),
            (
                "sliding_window",
                format!("{:?}", self.sliding_window),
                format!("{:?}", other.sliding_window),
            ),
            (
                "experts",
                format!("{:?}", self.moe),
                format!("{:?}", other.moe),
            ),
        ];
        match fields.iter().find(|(_, a, b)| a != b) {
            Some((name, a, b)) => Err(format!(
                "{name} is {b} in the new checkpoint but {a} in the running model"
            )),
            None => Ok(()),
        }
    }

    /// Total query width `num_heads · head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Total key/value width `num_kv_heads · head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Parameters of one dense layer's matrices (q, k, v, o, gate, up, down; norms aside).
    pub fn layer_matrix_params(&self) -> u64 {
        let (h, q, kv, i) = (
            self.hidden_size as u64,
            self.q_dim() as u64,
            self.kv_dim() as u64,
            self.intermediate_size as u64,
        );
        h * (q + 2 * kv) + q * h + 3 * h * i
    }

    /// Parameters of every layer's matrices (norms, embedding and head aside): a
    /// mixture-of-experts layer counts its router and all its experts, whose weights a
    /// rank holds (and a large batch reads) whichever experts a token takes.
    pub fn matrix_params(&self) -> u64 {
        let dense = self.layer_matrix_params();
        let Some(m) = &self.moe else {
            return self.num_layers as u64 * dense;
        };
        let h = self.hidden_size as u64;
        let mlp = 3 * h * self.intermediate_size as u64;
        let experts = m.num_experts as u64 * (h + 3 * h * m.expert_intermediate as u64);
        m.sparse_layers
            .iter()
            .map(|&sparse| dense - mlp + if sparse { experts } else { mlp })
            .sum()
    }
}

fn cfg_err(path: &Path, msg: String) -> ModelError {
    ModelError::Config {
        path: path.to_path_buf(),
        msg,
    }
}

struct Reader<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl Reader<'_> {
    fn usize_opt(&self, key: &str) -> MResult<Option<usize>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    cfg_err(
                        self.path,
                        format!("\"{key}\" must be a non-negative integer, got {v}"),
                    )
                }),
        }
    }
    fn usize_req(&self, key: &str) -> MResult<usize> {
        self.usize_opt(key)?
            .ok_or_else(|| cfg_err(self.path, format!("missing field \"{key}\"")))
    }
    fn f64_opt(&self, key: &str) -> MResult<Option<f64>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| cfg_err(self.path, format!("\"{key}\" must be a number, got {v}"))),
        }
    }
    /// Refuses `key` unless it is absent, null or empty.
    fn refuse_set(&self, key: &str, why: &str) -> MResult<()> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(()),
            Some(Value::Object(o)) if o.is_empty() => Ok(()),
            Some(v) => Err(cfg_err(self.path, format!("\"{key}\" is set ({v}): {why}"))),
        }
    }
    fn refuse_true(&self, key: &str) -> MResult<()> {
        match self.bool_opt(key)? {
            Some(true) => Err(cfg_err(
                self.path,
                format!("\"{key}\" is true: arbor runs decoder-only models"),
            )),
            _ => Ok(()),
        }
    }
    fn bool_opt(&self, key: &str) -> MResult<Option<bool>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| {
                cfg_err(
                    self.path,
                    format!("\"{key}\" must be true or false, got {v}"),
                )
            }),
        }
    }
}

/// Epsilons of RMSNorm in real checkpoints are 1e-6 to 1e-5; one above this swamps the
/// variance it guards (near-uniform logits) and can only be a corrupt value.
pub const MAX_RMS_NORM_EPS: f64 = 1.0;

/// `rms_norm_eps` (default 1e-6, as transformers' Llama), finite and in
/// [0, [`MAX_RMS_NORM_EPS`]], checked before it is rounded to f32.
fn rms_norm_eps(r: &Reader) -> MResult<f32> {
    let eps = r.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
    if !(eps.is_finite() && (0.0..=MAX_RMS_NORM_EPS).contains(&eps)) {
        let written = r
            .obj
            .get("rms_norm_eps")
            .map_or(eps.to_string(), Value::to_string);
        return Err(cfg_err(
            r.path,
            format!("\"rms_norm_eps\" {written} is outside [0, {MAX_RMS_NORM_EPS}]"),
        ));
    }
    Ok(eps as f32)
}

/// bos/eos ids may be absent, null, an integer or a list of integers.
pub(crate) fn token_ids(v: Option<&Value>, key: &str, path: &Path) -> MResult<Vec<u32>> {
    let one = |x: &Value| -> MResult<u32> {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                cfg_err(
                    path,
                    format!("\"{key}\" must hold token ids (integers), got {x}"),
                )
            })
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(one).collect(),
        Some(x) => Ok(vec![one(x)?]),
    }
}

/// More layers than any checkpoint of the supported families has (≤ 128), so a corrupt
/// count is refused before it sizes anything.
const MAX_LAYERS: usize = 4096;

/// The longest context a config may declare: 16 Mi positions. The longest published
/// contexts are near 10 M positions (Llama 4 Scout's 10,485,760), so this bounds a
/// corrupt or hostile length field (2^32 − 1, say) without refusing any real model.
/// Nothing is sized by the declared length itself (the RoPE table follows the context a
/// run uses: `--max-seq-len` and the KV cache), but a run without `--max-seq-len` plans
/// for the whole declared context.
pub const MAX_POSITIONS: usize = 1 << 24;

/// Refuses a context length field (`key`) beyond [`MAX_POSITIONS`].
pub(crate) fn check_positions(key: &str, n: usize, path: &Path) -> MResult<()> {
    if n > MAX_POSITIONS {
        return Err(cfg_err(
            path,
            format!("\"{key}\" {n} is beyond the {MAX_POSITIONS} positions arbor accepts (no real model has that many; the field is corrupt)"),
        ));
    }
    Ok(())
}

/// The type of each layer ("full_attention" or "sliding_attention"): `layer_types` where
/// written (transformers 5, and Qwen3 in late 4.x), else derived as transformers derives
/// it: Qwen2 and Qwen3 slide layers from `max_window_layers` on when `use_sliding_window`; Llama and
/// Mistral slide every layer when `sliding_window` is set.
fn layer_types(r: &Reader, arch: Arch, num_layers: usize) -> MResult<Vec<String>> {
    let path = r.path;
    if let Some(v) = r.obj.get("layer_types").filter(|v| !v.is_null()) {
        let list = v
            .as_array()
            .ok_or_else(|| cfg_err(path, format!("\"layer_types\" must be a list, got {v}")))?;
        if list.len() != num_layers {
            return Err(cfg_err(
                path,
                format!(
                    "\"layer_types\" has {} entries for {num_layers} layers",
                    list.len()
                ),
            ));
        }
        return list
            .iter()
            .map(|t| match t.as_str() {
                Some(s @ ("full_attention" | "sliding_attention")) => Ok(s.to_string()),
                _ => Err(cfg_err(
                    path,
                    format!("layer type {t} is not supported (\"full_attention\" and \"sliding_attention\" are)"),
                )),
            })
            .collect();
    }
    let window_set = !matches!(r.obj.get("sliding_window"), None | Some(Value::Null));
    let slides = |i: usize| -> MResult<bool> {
        Ok(match arch {
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
                window_set
                    && r.bool_opt("use_sliding_window")?.unwrap_or(false)
                    && i >= r.usize_opt("max_window_layers")?.unwrap_or(28)
            }
            Arch::Llama | Arch::Mixtral => window_set,
        })
    };
    (0..num_layers)
        .map(|i| {
            Ok(if slides(i)? {
                "sliding_attention"
            } else {
                "full_attention"
            }
            .to_string())
        })
        .collect()
}

/// `dtype` (transformers 5) or `torch_dtype` (4): the precision the weights were saved in.
fn dtype(r: &Reader) -> MResult<Option<String>> {
    let read = |key: &str| -> MResult<Option<String>> {
        match r.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if matches!(s.as_str(), "bfloat16" | "float16" | "float32") => {
                Ok(Some(s.clone()))
            }
            Some(v) => Err(cfg_err(
                r.path,
                format!("\"{key}\" {v} is not supported (bfloat16, float16 and float32 are)"),
            )),
        }
    };
    match (read("dtype")?, read("torch_dtype")?) {
        (Some(a), Some(b)) if a != b => Err(cfg_err(
            r.path,
            format!("\"dtype\" {a:?} and \"torch_dtype\" {b:?} disagree"),
        )),
        (a, b) => Ok(a.or(b)),
    }
}

/// A config path for error messages when no file is involved.
pub fn in_memory_path() -> PathBuf {
    PathBuf::from("<config.json>")
}

#[cfg(test)]
mod tests;
