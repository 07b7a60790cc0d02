//! `generation_config.json`: the end-of-sequence ids and the sampling defaults a checkpoint
//! ships (Llama-3 instruct models stop on several ids, listed only here).

use std::path::Path;

use serde_json::Value;

use crate::error::{MResult, ModelError};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// Whether the checkpoint's authors sample by default (false: greedy).
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
}

impl GenerationConfig {
    /// Reads `<dir>/generation_config.json`; None when the file does not exist.
    pub fn from_dir(dir: &Path) -> MResult<Option<Self>> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_json_str(&text, &path).map(Some)
    }

    /// Parses the file's text; `path` names it in errors. Keys arbor does not use (beam
    /// search settings, say) only affect HF's `generate` defaults and are not refused.
    pub fn from_json_str(text: &str, path: &Path) -> MResult<Self> {
        let err = |msg: String| ModelError::Config {
            path: path.to_path_buf(),
            msg,
        };
        let v: Value =
            serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| err("top level is not a JSON object".into()))?;
        let num = |key: &str| -> MResult<Option<f64>> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| err(format!("\"{key}\" must be a number, got {x}"))),
            }
        };
        let top_k = match num("top_k")? {
            None => None,
            Some(k) if k >= 0.0 && k.fract() == 0.0 => Some(k as usize),
            Some(k) => {
                return Err(err(format!(
                    "\"top_k\" must be a whole number >= 0, got {k}"
                )))
            }
        };
        let do_sample = match obj.get("do_sample") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(x) => return Err(err(format!("\"do_sample\" must be true or false, got {x}"))),
        };
        Ok(GenerationConfig {
            eos_token_ids: crate::config::token_ids(obj.get("eos_token_id"), "eos_token_id", path)?,
            bos_token_id: crate::config::token_ids(obj.get("bos_token_id"), "bos_token_id", path)?
                .first()
                .copied(),
            do_sample,
            temperature: num("temperature")?.map(|t| t as f32),
            top_p: num("top_p")?.map(|t| t as f32),
            top_k,
        })
    }

    /// The checkpoint's default sampling settings with `seed`: greedy unless `do_sample`;
    /// otherwise HF's defaults (temperature 1, top-p 1, top-k 50) where a value is absent.
    pub fn default_sampling(&self, seed: u64) -> crate::Sampling {
        if self.do_sample != Some(true) {
            return crate::Sampling {
                seed,
                ..crate::Sampling::greedy()
            };
        }
        crate::Sampling {
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(50),
            top_p: self.top_p.unwrap_or(1.0),
            seed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_instruct_style() {
        let g = GenerationConfig::from_json_str(
            r#"{"bos_token_id": 128000, "do_sample": true, "eos_token_id": [128001, 128008, 128009],
                "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0.dev0"}"#,
            Path::new("g.json"),
        )
        .unwrap();
        assert_eq!(g.eos_token_ids, vec![128001, 128008, 128009]);
        assert_eq!(g.bos_token_id, Some(128000));
        let s = g.default_sampling(3);
        assert_eq!((s.temperature, s.top_p, s.top_k, s.seed), (0.6, 0.9, 50, 3));
        let greedy = GenerationConfig::default().default_sampling(0);
        assert_eq!(greedy.temperature, 0.0);
    }

    #[test]
    fn errors_name_the_key() {
        for (text, key) in [
            (r#"{"eos_token_id": "x"}"#, "eos_token_id"),
            (r#"{"top_k": 2.5}"#, "top_k"),
            (r#"{"temperature": "hot"}"#, "temperature"),
            (r#"{"do_sample": 1}"#, "do_sample"),
        ] {
            let e = GenerationConfig::from_json_str(text, Path::new("g.json"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains("g.json"), "{e}");
        }
    }
}
