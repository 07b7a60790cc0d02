//! Hugging Face `config.json` for the decoder architectures arbor runs:
//! LlamaForCausalLM (Llama 2/3.x incl. `rope_scaling` type "llama3"), MistralForCausalLM
//! without sliding window (Mistral-7B-v0.3 is Llama-shaped) and dense Qwen3ForCausalLM
//! (per-head q/k RMSNorm, `head_dim` independent of hidden/heads).

use std::path::{Path, PathBuf};

use arbor_kernels::cpu::RopeScaling;
use serde_json::{Map, Value};

use crate::error::{MResult, ModelError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen3,
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
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Reads `<dir>/config.json`.
    pub fn from_dir(dir: &Path) -> MResult<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_json_str(&text, &path)
    }

    /// Parses config.json text; `path` only names the file in errors.
    pub fn from_json_str(text: &str, path: &Path) -> MResult<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| cfg_err(path, format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| cfg_err(path, "top level is not a JSON object".into()))?;
        let r = Reader { obj, path };

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
        let arch = match arch_name.as_str() {
            "LlamaForCausalLM" | "MistralForCausalLM" => Arch::Llama,
            "Qwen3ForCausalLM" => Arch::Qwen3,
            _ => {
                return Err(ModelError::UnknownArch {
                    path: path.to_path_buf(),
                    arch: arch_name,
                })
            }
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
        let cfg = ModelConfig {
            arch,
            arch_name,
            hidden_size,
            intermediate_size: r.usize_req("intermediate_size")?,
            num_layers: r.usize_req("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: r.usize_req("vocab_size")?,
            rms_norm_eps: r.f64_opt("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta: r.f64_opt("rope_theta")?.unwrap_or(10000.0),
            rope_scaling: parse_rope_scaling(obj.get("rope_scaling"), path)?,
            max_position_embeddings: r.usize_req("max_position_embeddings")?,
            tie_word_embeddings: r.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: r.bool_opt("attention_bias")?.unwrap_or(false),
            mlp_bias: r.bool_opt("mlp_bias")?.unwrap_or(false),
            bos_token_id: token_ids(obj.get("bos_token_id"), "bos_token_id", path)?
                .first()
                .copied(),
            eos_token_ids: token_ids(obj.get("eos_token_id"), "eos_token_id", path)?,
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
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(cfg_err(
                path,
                format!(
                    "rms_norm_eps {} is not a finite non-negative number",
                    self.rms_norm_eps
                ),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(cfg_err(
                path,
                format!("rope_theta {} must be positive", self.rope_theta),
            ));
        }
        if let Some(act) = r.obj.get("hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(cfg_err(
                    path,
                    format!("hidden_act {act} is not supported (only \"silu\")"),
                ));
            }
        }
        // Sliding-window attention would change which keys a row sees; refuse it rather
        // than silently computing full attention.
        if let Some(w) = r.obj.get("sliding_window") {
            let used = match self.arch {
                Arch::Qwen3 => r.bool_opt("use_sliding_window")?.unwrap_or(false),
                Arch::Llama => !w.is_null(),
            };
            if used {
                return Err(cfg_err(
                    path,
                    format!("sliding_window {w} is not supported"),
                ));
            }
        }
        Ok(())
    }

    /// Total query width `num_heads · head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Total key/value width `num_kv_heads · head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
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

/// bos/eos ids may be absent, null, an integer or a list of integers.
fn token_ids(v: Option<&Value>, key: &str, path: &Path) -> MResult<Vec<u32>> {
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

fn parse_rope_scaling(v: Option<&Value>, path: &Path) -> MResult<Option<RopeScaling>> {
    let obj = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(other) => {
            return Err(cfg_err(
                path,
                format!("\"rope_scaling\" must be an object or null, got {other}"),
            ))
        }
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("");
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let num = |key: &str| -> MResult<f64> {
                obj.get(key).and_then(Value::as_f64).ok_or_else(|| {
                    cfg_err(
                        path,
                        format!("rope_scaling (llama3): missing or non-numeric \"{key}\""),
                    )
                })
            };
            let orig = obj
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    cfg_err(path, "rope_scaling (llama3): missing or non-integer \"original_max_position_embeddings\"".into())
                })?;
            let s = RopeScaling {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: orig,
            };
            if !(s.factor > 0.0
                && s.low_freq_factor > 0.0
                && s.high_freq_factor > s.low_freq_factor)
            {
                return Err(cfg_err(
                    path,
                    format!("rope_scaling (llama3): need factor > 0 and high_freq_factor > low_freq_factor > 0, got {s:?}"),
                ));
            }
            Ok(Some(s))
        }
        other => Err(cfg_err(
            path,
            format!(
                "rope_scaling type {other:?} is not supported (only \"llama3\" and \"default\")"
            ),
        )),
    }
}

/// A config path for error messages when no file is involved.
pub fn in_memory_path() -> PathBuf {
    PathBuf::from("<config.json>")
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA3: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
      "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
      "max_position_embeddings": 131072, "tie_word_embeddings": false, "hidden_act": "silu",
      "attention_bias": false, "mlp_bias": false, "bos_token_id": 128000,
      "eos_token_id": [128001, 128008, 128009],
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    }"#;

    const QWEN3: &str = r#"{
      "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
      "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
      "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
      "max_position_embeddings": 40960, "tie_word_embeddings": false, "attention_bias": false,
      "bos_token_id": 151643, "eos_token_id": 151645, "rope_scaling": null,
      "sliding_window": null, "use_sliding_window": false
    }"#;

    fn parse(s: &str) -> MResult<ModelConfig> {
        ModelConfig::from_json_str(s, &in_memory_path())
    }

    #[test]
    fn llama3_with_rope_scaling_and_eos_list() {
        let c = parse(LLAMA3).unwrap();
        assert_eq!(c.arch, Arch::Llama);
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.num_kv_heads, 8);
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        assert_eq!(c.bos_token_id, Some(128000));
        let s = c.rope_scaling.unwrap();
        assert_eq!(s.factor, 8.0);
        assert_eq!(s.original_max_position_embeddings, 8192);
    }

    #[test]
    fn qwen3_head_dim_and_scalar_eos() {
        let c = parse(QWEN3).unwrap();
        assert_eq!(c.arch, Arch::Qwen3);
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.eos_token_ids, vec![151645]);
        assert!(c.rope_scaling.is_none());
        assert_eq!(c.rope_theta, 1e6);
    }

    #[test]
    fn mistral_is_llama_shaped() {
        let s = LLAMA3.replace("LlamaForCausalLM", "MistralForCausalLM");
        assert_eq!(parse(&s).unwrap().arch, Arch::Llama);
        let s = s.replace(
            "\"mlp_bias\": false",
            "\"mlp_bias\": false, \"sliding_window\": 4096",
        );
        let e = parse(&s).unwrap_err().to_string();
        assert!(e.contains("sliding_window"), "{e}");
    }

    #[test]
    fn errors_name_the_problem() {
        let e = parse(&LLAMA3.replace("LlamaForCausalLM", "GPT2LMHeadModel")).unwrap_err();
        assert!(matches!(e, ModelError::UnknownArch { ref arch, .. } if arch == "GPT2LMHeadModel"));
        let e = parse(&LLAMA3.replace("\"hidden_size\": 4096,", ""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field \"hidden_size\""), "{e}");
        let e = parse(&LLAMA3.replace("\"hidden_size\": 4096", "\"hidden_size\": \"big\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_size"), "{e}");
        let e = parse("{ not json").unwrap_err().to_string();
        assert!(e.contains("not valid JSON"), "{e}");
        let e = parse(&LLAMA3.replace("\"llama3\"", "\"yarn\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("yarn"), "{e}");
        let e = parse(&LLAMA3.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_key_value_heads 5"), "{e}");
        let e = parse(&LLAMA3.replace(
            "\"eos_token_id\": [128001, 128008, 128009]",
            "\"eos_token_id\": [-1]",
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("eos_token_id"), "{e}");
    }
}
