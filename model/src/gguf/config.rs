//! GGUF metadata -> the Hugging Face `config.json` transformers would have for the same
//! model, which then goes through arbor's own (strict) config parser. As there, a key that
//! may change the math and that arbor does not implement is refused by name.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::reader::{GgufFile, MetaValue};
use crate::config::{ModelConfig, ALLOW_ENV, MAX_POSITIONS, MAX_RMS_NORM_EPS};
use crate::error::{MResult, ModelError};

/// The GGUF architectures arbor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufArch {
    /// `llama`: Llama 1/2/3, Mistral, SmolLM, TinyLlama... llama.cpp's converter permutes
    /// the q/k rows for GGML's interleaved RoPE. With `llama.expert_count` set it is
    /// Mixtral: every layer's MLP is experts.
    Llama,
    /// `qwen2` (Qwen2, Qwen2.5): q/k/v biases; rows stored as in HF (NEOX RoPE).
    Qwen2,
    /// `qwen3`: per-head q/k RMSNorm; rows stored as in HF (NEOX RoPE).
    Qwen3,
    /// `qwen3moe` (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention and a mixture of
    /// experts in every layer, each layer's experts stacked in one tensor per projection.
    Qwen3Moe,
}

impl GgufArch {
    pub fn name(self) -> &'static str {
        match self {
            GgufArch::Llama => "llama",
            GgufArch::Qwen2 => "qwen2",
            GgufArch::Qwen3 => "qwen3",
            GgufArch::Qwen3Moe => "qwen3moe",
        }
    }

    /// Whether llama.cpp stored q/k rows permuted for interleaved (GPT-J style) RoPE.
    pub fn permuted_qk(self) -> bool {
        self == GgufArch::Llama
    }
}

/// `<arch>.` keys arbor reads (or refuses value by value).
const ARCH_KEYS: &[&str] = &[
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "attention.key_length",
    "attention.value_length",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
    "vocab_size",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "tensor_data_layout",
];

/// Key prefixes that never change the math: provenance, llama.cpp's quantization notes,
/// and the tokenizer (read by `tokenizer.rs`).
const OTHER_PREFIXES: &[&str] = &["general.", "quantize.", "tokenizer."];

fn err(path: &Path, msg: String) -> ModelError {
    ModelError::Gguf {
        path: path.to_path_buf(),
        msg,
    }
}

/// The architecture named in `general.architecture`, or an error listing the supported.
pub fn arch(f: &GgufFile) -> MResult<GgufArch> {
    let a = f.get("general.architecture").ok_or_else(|| {
        err(
            &f.path,
            "no \"general.architecture\" in the metadata".into(),
        )
    })?;
    match a.as_str() {
        Some("llama") => Ok(GgufArch::Llama),
        Some("qwen2") => Ok(GgufArch::Qwen2),
        Some("qwen3") => Ok(GgufArch::Qwen3),
        Some("qwen3moe") => Ok(GgufArch::Qwen3Moe),
        _ => Err(err(
            &f.path,
            format!(
                "general.architecture {} is not supported (arbor runs \"llama\", \"qwen2\", \"qwen3\" and \"qwen3moe\" GGUF files)",
                a.brief()
            ),
        )),
    }
}

/// Reads the metadata of one architecture, naming GGUF keys in errors.
struct Meta<'a> {
    f: &'a GgufFile,
    arch: GgufArch,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch.name())
    }

    fn get(&self, k: &str) -> Option<&MetaValue> {
        self.f.get(&self.key(k))
    }

    fn usize_opt(&self, k: &str) -> MResult<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    err(
                        &self.f.path,
                        format!(
                            "{} must be a non-negative integer, got {} ({})",
                            self.key(k),
                            v.brief(),
                            v.type_name()
                        ),
                    )
                }),
        }
    }

    fn usize_req(&self, k: &str) -> MResult<usize> {
        self.usize_opt(k)?.ok_or_else(|| {
            err(
                &self.f.path,
                format!("missing metadata key {}", self.key(k)),
            )
        })
    }

    /// A float key: absent, or a finite number within `range` (described as `what`). A
    /// value that is present but bad is refused by name, never replaced by a default
    /// (NaN and ±inf, which JSON cannot hold, would otherwise reach the config as null).
    fn f64_opt(&self, k: &str, range: FloatRange) -> MResult<Option<f64>> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        let x = v.as_f64().ok_or_else(|| {
            err(
                &self.f.path,
                format!("{} must be a number, got {}", self.key(k), v.brief()),
            )
        })?;
        if !(x.is_finite() && range.holds(x)) {
            return Err(err(
                &self.f.path,
                format!(
                    "{} is {}: it must be {}",
                    self.key(k),
                    v.brief(),
                    range.what()
                ),
            ));
        }
        Ok(Some(x))
    }

    /// A context length key, within what arbor accepts.
    fn positions_opt(&self, k: &str) -> MResult<Option<usize>> {
        let n = self.usize_opt(k)?;
        if let Some(n) = n.filter(|&n| n > MAX_POSITIONS) {
            return Err(err(
                &self.f.path,
                format!(
                    "{} {n} is beyond the {MAX_POSITIONS} positions arbor accepts (no real model has that many; the field is corrupt)",
                    self.key(k)
                ),
            ));
        }
        Ok(n)
    }
}

/// Where a float metadata value must lie.
#[derive(Debug, Clone, Copy)]
enum FloatRange {
    /// RoPE's base: above 1 (frequencies fall with the dimension).
    AboveOne,
    /// A scaling factor: above 0.
    Positive,
    /// RMSNorm's epsilon: in [0, `MAX_RMS_NORM_EPS`].
    Epsilon,
    /// 0 or more.
    NonNegative,
}

impl FloatRange {
    fn holds(self, x: f64) -> bool {
        match self {
            FloatRange::AboveOne => x > 1.0,
            FloatRange::Positive => x > 0.0,
            FloatRange::Epsilon => (0.0..=MAX_RMS_NORM_EPS).contains(&x),
            FloatRange::NonNegative => x >= 0.0,
        }
    }

    fn what(self) -> String {
        match self {
            FloatRange::AboveOne => "a finite number above 1".into(),
            FloatRange::Positive => "a finite number above 0".into(),
            FloatRange::Epsilon => format!("a finite number in [0, {MAX_RMS_NORM_EPS}]"),
            FloatRange::NonNegative => "a finite number of 0 or more".into(),
        }
    }
}

/// What the metadata says beyond config.json: how the q/k rows are laid out.
pub struct GgufConfig {
    pub arch: GgufArch,
    pub config: ModelConfig,
    /// The config.json it corresponds to (what `arbor convert` would write).
    pub config_json: Value,
}

/// Builds the model's config from the metadata and the tensors present (`output.weight`
/// for untied heads, biases, `rope_freqs.weight`).
pub fn read(f: &GgufFile, rope_freqs: Option<&[f32]>) -> MResult<GgufConfig> {
    let arch = arch(f)?;
    let path = &f.path;
    if let Some(n) = f.get("split.count").and_then(MetaValue::as_u64) {
        if n > 1 {
            return Err(err(
                path,
                format!("this is one of {n} split GGUF files; merge them first (llama-gguf-split --merge FIRST.gguf OUT.gguf)"),
            ));
        }
    }
    if let Some(t) = f.get("general.type").and_then(MetaValue::as_str) {
        if t != "model" {
            return Err(err(
                path,
                format!("general.type is {t:?}: arbor runs models, not {t}s"),
            ));
        }
    }
    let allowed = allowed_from_env();
    let prefix = format!("{}.", arch.name());
    let mut unknown: Vec<&str> = f
        .metadata
        .keys()
        .map(String::as_str)
        .filter(|k| match k.strip_prefix(&prefix) {
            Some(rest) => !ARCH_KEYS.contains(&rest),
            None => !OTHER_PREFIXES.iter().any(|p| k.starts_with(p)) && *k != "split.count",
        })
        .filter(|k| !allowed.iter().any(|a| a == k))
        .collect();
    unknown.sort_unstable();
    if !unknown.is_empty() {
        return Err(err(
            path,
            format!(
                "unknown metadata key{} {}: arbor does not know what {} to the model's math, so it refuses to guess (if you know it is harmless, list it in {ALLOW_ENV}=key,...)",
                if unknown.len() > 1 { "s" } else { "" },
                unknown.iter().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(", "),
                if unknown.len() > 1 { "they do" } else { "it does" },
            ),
        ));
    }
    let m = Meta { f, arch };
    let experts = match arch {
        GgufArch::Qwen3Moe => Some(experts(&m)?),
        // llama.cpp's converter writes Mixtral as `llama` with the expert counts set
        // (`LlamaModel.set_gguf_parameters`); `expert_count` 0 or absent is a dense model.
        GgufArch::Llama if m.usize_opt("expert_count")?.is_some_and(|n| n > 0) => {
            Some(experts(&m)?)
        }
        _ => {
            for k in [
                "expert_count",
                "expert_used_count",
                "expert_feed_forward_length",
            ] {
                if let Some(n) = m.usize_opt(k)?.filter(|&n| n > 0) {
                    let why = if arch == GgufArch::Llama {
                        format!(
                            "mixture-of-experts metadata without {} (llama files with experts are Mixtral)",
                            m.key("expert_count")
                        )
                    } else {
                        format!(
                            "mixture-of-experts {} files are not supported (qwen3moe files, and llama files with experts, are)",
                            arch.name()
                        )
                    };
                    return Err(err(path, format!("{} = {n}: {why}", m.key(k))));
                }
            }
            None
        }
    };
    // A `llama` file with experts is Mixtral: transformers' Mixtral has one width for its
    // experts (`intermediate_size`) and no biases.
    let mixtral = arch == GgufArch::Llama && experts.is_some();
    if let (true, Some(x)) = (mixtral, experts) {
        let ff = m.usize_req("feed_forward_length")?;
        if x.width != ff {
            return Err(err(
                path,
                format!(
                    "{} {} differs from {} {ff}: Mixtral's experts are {} wide (a separate expert width is not supported for llama files)",
                    m.key("expert_feed_forward_length"),
                    x.width,
                    m.key("feed_forward_length"),
                    m.key("feed_forward_length")
                ),
            ));
        }
    }
    if let Some(v) = m.get("tensor_data_layout") {
        if v.as_str() != Some("Meta AI original pth") {
            return Err(err(
                path,
                format!(
                    "{} {} is not a layout arbor knows",
                    m.key("tensor_data_layout"),
                    v.brief()
                ),
            ));
        }
    }
    let hidden = m.usize_req("embedding_length")?;
    let heads = m.usize_req("attention.head_count")?;
    if let Some(v) = m
        .get("attention.head_count_kv")
        .filter(|v| v.as_array().is_some())
    {
        return Err(err(
            path,
            format!(
                "{} is per layer ({}): layers with different head counts are not supported",
                m.key("attention.head_count_kv"),
                v.brief()
            ),
        ));
    }
    let kv_heads = m.usize_opt("attention.head_count_kv")?.unwrap_or(heads);
    if heads == 0 {
        return Err(err(path, format!("{} is 0", m.key("attention.head_count"))));
    }
    let head_dim = match m.usize_opt("attention.key_length")? {
        Some(k) => k,
        None if hidden % heads == 0 => hidden / heads,
        None => {
            return Err(err(
                path,
                format!(
                    "no {} and embedding_length {hidden} is not divisible by head_count {heads}",
                    m.key("attention.key_length")
                ),
            ))
        }
    };
    if let Some(v) = m.usize_opt("attention.value_length")? {
        if v != head_dim {
            return Err(err(
                path,
                format!(
                    "{} {v} differs from the key length {head_dim}: not supported",
                    m.key("attention.value_length")
                ),
            ));
        }
    }
    if let Some(r) = m.usize_opt("rope.dimension_count")? {
        if r != head_dim {
            return Err(err(
                path,
                format!(
                    "{} {r} rotates part of a {head_dim}-wide head (partial rotary): not supported",
                    m.key("rope.dimension_count")
                ),
            ));
        }
    }
    let vocab = match m.usize_opt("vocab_size")? {
        Some(v) => v,
        None => match f.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array) {
            Some(t) => t.len(),
            None => f
                .tensors
                .get("token_embd.weight")
                .and_then(|t| t.dims.get(1).copied())
                .ok_or_else(|| err(path, "cannot tell the vocabulary size: no vocab_size, tokens or token_embd.weight".into()))?,
        },
    };
    // Absent, the base is llama.cpp's and transformers' default; present, it must be good.
    let theta = m
        .f64_opt("rope.freq_base", FloatRange::AboveOne)?
        .unwrap_or(10000.0);
    let context = m.positions_opt("context_length")?.ok_or_else(|| {
        err(
            path,
            format!("missing metadata key {}", m.key("context_length")),
        )
    })?;
    let mut rope_scaling = match m.get("rope.scaling.type").map(|v| v.as_str()) {
        None | Some(Some("none")) => {
            // llama.cpp reads 0 as "unset"; any other factor would scale by a rule the
            // file does not name (llama.cpp assumes linear without a type).
            match m.f64_opt("rope.scaling.factor", FloatRange::NonNegative)? {
                None => {}
                Some(f) if f == 0.0 || f == 1.0 => {}
                Some(f) => {
                    return Err(err(
                        path,
                        format!(
                            "{} {f} without a {} (or with \"none\"): arbor does not guess the scaling it means",
                            m.key("rope.scaling.factor"),
                            m.key("rope.scaling.type")
                        ),
                    ))
                }
            }
            Value::Null
        }
        Some(Some("linear")) => json!({
            "rope_type": "linear",
            "factor": m.f64_opt("rope.scaling.factor", FloatRange::Positive)?.ok_or_else(|| err(path, format!("linear RoPE scaling without {}", m.key("rope.scaling.factor"))))?,
        }),
        Some(Some("yarn")) => {
            let mut y = Map::new();
            y.insert("rope_type".into(), json!("yarn"));
            if let Some(fac) = m.f64_opt("rope.scaling.factor", FloatRange::Positive)? {
                y.insert("factor".into(), json!(fac));
            }
            if let Some(o) = m.positions_opt("rope.scaling.original_context_length")? {
                y.insert("original_max_position_embeddings".into(), json!(o));
            }
            Value::Object(y)
        }
        Some(_) => {
            let v = m
                .get("rope.scaling.type")
                .map(MetaValue::brief)
                .unwrap_or_default();
            return Err(err(
                path,
                format!(
                    "{} {v} is not supported (none, linear and yarn are)",
                    m.key("rope.scaling.type")
                ),
            ));
        }
    };
    if let Some(freqs) = rope_freqs {
        if !rope_scaling.is_null() {
            return Err(err(path, "both rope_freqs.weight and a rope.scaling.type: arbor does not know how they combine".into()));
        }
        rope_scaling = llama3_from_freqs(freqs, theta, head_dim).ok_or_else(|| {
            err(
                path,
                format!(
                    "rope_freqs.weight holds per-frequency factors that match no Llama-3 scaling arbor tried (factor 2..64, low 1, high 4, original context 8192): not supported; first factors {:?}",
                    &freqs[..freqs.len().min(4)]
                ),
            )
        })?;
    }
    let has = |name: &str| f.tensors.contains_key(name);
    let attention_bias = has("blk.0.attn_q.bias");
    let mlp_bias = has("blk.0.ffn_up.bias");
    if mixtral {
        if let Some(b) = ["blk.0.attn_q.bias", "blk.0.attn_output.bias"]
            .into_iter()
            .find(|b| has(b))
        {
            return Err(err(
                path,
                format!("tensor {b:?}: attention biases in a llama file with experts (Mixtral has none): not supported"),
            ));
        }
    }
    match arch {
        GgufArch::Qwen3 | GgufArch::Qwen3Moe if attention_bias => {
            return Err(err(
                path,
                format!("attention biases in a {} file: not supported", arch.name()),
            ))
        }
        GgufArch::Qwen2 if !attention_bias || has("blk.0.attn_output.bias") => return Err(err(
            path,
            "a qwen2 file needs q/k/v biases (blk.N.attn_q.bias) and no o bias (attn_output.bias)"
                .into(),
        )),
        _ => {}
    }
    // A token id that is present but not an id is refused, not dropped (a file whose EOS
    // was lost would generate past its end).
    let tok = |k: &str| -> MResult<Option<u64>> {
        let key = format!("tokenizer.ggml.{k}");
        match f.get(&key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                err(
                    path,
                    format!("{key} is {} ({}), not a token id", v.brief(), v.type_name()),
                )
            }),
        }
    };
    let mut eos: Vec<u64> = Vec::new();
    for k in ["eos_token_id", "eot_token_id", "eom_token_id"] {
        if let Some(id) = tok(k)? {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    let (arch_name, model_type) = match arch {
        GgufArch::Llama if mixtral => ("MixtralForCausalLM", "mixtral"),
        GgufArch::Llama => ("LlamaForCausalLM", "llama"),
        GgufArch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        GgufArch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        GgufArch::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
    };
    let mut c = json!({
        "architectures": [arch_name],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": m.usize_req("feed_forward_length")?,
        "num_hidden_layers": m.usize_req("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": m.f64_opt("attention.layer_norm_rms_epsilon", FloatRange::Epsilon)?.ok_or_else(|| err(path, format!("missing metadata key {}", m.key("attention.layer_norm_rms_epsilon"))))?,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": context,
        "tie_word_embeddings": !has("output.weight"),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    });
    let obj = c.as_object_mut().expect("a JSON object literal");
    if arch == GgufArch::Llama && !mixtral {
        obj.insert("attention_bias".into(), json!(attention_bias));
        obj.insert("mlp_bias".into(), json!(mlp_bias));
    } else if mlp_bias {
        return Err(err(
            path,
            format!("MLP biases in a {} file: not supported", arch.name()),
        ));
    } else if matches!(arch, GgufArch::Qwen3 | GgufArch::Qwen3Moe) {
        obj.insert("attention_bias".into(), json!(false));
    }
    if let (true, Some(x)) = (mixtral, experts) {
        // Mixtral renormalises its top-k weights (transformers' MixtralSparseMoeBlock, and
        // llama.cpp's llama graph with `norm_w = true`), which arbor's Mixtral config
        // implies: no key for it, as transformers' Mixtral config has none.
        obj.insert("num_local_experts".into(), json!(x.count));
        obj.insert("num_experts_per_tok".into(), json!(x.used));
    } else if let Some(x) = experts {
        // llama.cpp runs every qwen3moe layer as experts and always renormalises the
        // chosen experts' weights (`build_moe_ffn(.., norm_w = true, ..)`).
        obj.insert("num_experts".into(), json!(x.count));
        obj.insert("num_experts_per_tok".into(), json!(x.used));
        obj.insert("moe_intermediate_size".into(), json!(x.width));
        obj.insert("norm_topk_prob".into(), json!(true));
        obj.insert("decoder_sparse_step".into(), json!(1));
        obj.insert("mlp_only_layers".into(), json!([]));
    }
    if let Some(b) = tok("bos_token_id")? {
        obj.insert("bos_token_id".into(), json!(b));
    }
    if !eos.is_empty() {
        obj.insert("eos_token_id".into(), json!(eos));
    }
    let shown = path.with_file_name(format!(
        "{} (metadata as config.json)",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    ));
    let config = ModelConfig::from_json_str(&c.to_string(), &shown)?;
    Ok(GgufConfig {
        arch,
        config,
        config_json: c,
    })
}

/// A mixture-of-experts file's experts, as its metadata says.
#[derive(Debug, Clone, Copy)]
struct Experts {
    count: usize,
    used: usize,
    /// One expert's intermediate width.
    width: usize,
}

/// `expert_count` and `expert_used_count` (both required), and the experts' width:
/// `expert_feed_forward_length`, else as llama.cpp takes it: `feed_forward_length` for
/// `llama`, `feed_forward_length / expert_used_count` otherwise. More experts used than
/// there are is refused by its keys; other counts out of range go on to the config parser,
/// which names them.
fn experts(m: &Meta) -> MResult<Experts> {
    let count = m.usize_req("expert_count")?;
    let used = m.usize_req("expert_used_count")?;
    if used == 0 || used > count {
        return Err(err(
            &m.f.path,
            format!(
                "{} {used} must be between 1 and {} {count}",
                m.key("expert_used_count"),
                m.key("expert_count")
            ),
        ));
    }
    let width = match m.usize_opt("expert_feed_forward_length")? {
        Some(w) => w,
        // llama.cpp's llama graph sizes its experts by feed_forward_length
        // (src/models/llama.cpp: ffn_up_exps is {n_embd, n_ff, n_expert}).
        None if m.arch == GgufArch::Llama => m.usize_req("feed_forward_length")?,
        None => {
            let ff = m.usize_req("feed_forward_length")?;
            if used == 0 || ff % used != 0 {
                return Err(err(
                    &m.f.path,
                    format!(
                        "no {} and {} {ff} does not split into {} {used} experts' widths",
                        m.key("expert_feed_forward_length"),
                        m.key("feed_forward_length"),
                        m.key("expert_used_count")
                    ),
                ));
            }
            ff / used
        }
    };
    Ok(Experts { count, used, width })
}

fn allowed_from_env() -> Vec<String> {
    std::env::var(ALLOW_ENV)
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

/// llama.cpp stores Llama 3.1's RoPE scaling as its per-frequency factors
/// (`rope_freqs.weight`, computed by `convert_hf_to_gguf.py` from the four parameters in
/// f32). The parameters are recovered by trying the values every Llama 3.x release uses
/// and keeping the set that reproduces every factor.
fn llama3_from_freqs(freqs: &[f32], theta: f64, head_dim: usize) -> Option<Value> {
    if freqs.len() != head_dim / 2 {
        return None;
    }
    let (low, high, old) = (1.0f64, 4.0f64, 8192.0f64);
    [8.0f64, 32.0, 16.0, 4.0, 2.0, 64.0]
        .into_iter()
        .find_map(|factor| {
            let ok = freqs.iter().enumerate().all(|(i, &got)| {
                let freq = 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32) as f64;
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let want = if wavelen < old / high {
                    1.0
                } else if wavelen > old / low {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                ((got as f64) - want).abs() <= 1e-4 * want
            });
            ok.then(|| {
                json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                   "high_freq_factor": high, "original_max_position_embeddings": old as usize})
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_factors_are_recognised_and_others_refused() {
        // Llama 3.1 8B: theta 500000, head_dim 128, factor 8.
        let (theta, hd) = (500000.0f64, 128usize);
        let freqs: Vec<f32> = (0..hd / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf((2 * i) as f64 / hd as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let w = if wavelen < 2048.0 {
                    1.0
                } else if wavelen > 8192.0 {
                    8.0
                } else {
                    let s = (8192.0 / wavelen - 1.0) / 3.0;
                    1.0 / ((1.0 - s) / 8.0 + s)
                };
                w as f32
            })
            .collect();
        let v = llama3_from_freqs(&freqs, theta, hd).expect("recognised");
        assert_eq!(v["factor"], json!(8.0));
        let mut odd = freqs.clone();
        odd[40] *= 1.01;
        assert!(llama3_from_freqs(&odd, theta, hd).is_none());
        assert!(llama3_from_freqs(&freqs[1..], theta, hd).is_none());
    }
}
