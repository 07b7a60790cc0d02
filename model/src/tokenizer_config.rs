//! `tokenizer_config.json` (and `chat_template.jinja`, where transformers ≥ 4.43 keeps the
//! template): BOS/EOS handling and the chat template, plus [`PromptEncoder`], which turns
//! text into ids the way transformers' tokenizer does for the same files.

use std::path::Path;

use serde_json::Value;

use crate::error::{MResult, ModelError};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerConfig {
    /// The chat template (Jinja), from tokenizer_config.json or chat_template.jinja.
    pub chat_template: Option<String>,
    /// Where the chat template came from, for messages: the file (tokenizer_config.json,
    /// chat_template.jinja) or a GGUF file's `tokenizer.chat_template`.
    pub chat_template_source: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    /// None: tokenizer.json's post-processor decides (the usual case).
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub model_max_length: Option<usize>,
}

impl TokenizerConfig {
    /// Reads `<dir>/tokenizer_config.json` and `<dir>/chat_template.jinja`; None when
    /// neither exists.
    pub fn from_dir(dir: &Path) -> MResult<Option<Self>> {
        let path = dir.join("tokenizer_config.json");
        let jinja = dir.join("chat_template.jinja");
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|source| ModelError::Io {
                path: p.to_path_buf(),
                source,
            })
        };
        let mut cfg = match path.exists() {
            true => Self::from_json_str(&read(&path)?, &path)?,
            false if jinja.exists() => TokenizerConfig::default(),
            false => return Ok(None),
        };
        if cfg.chat_template.is_none() && jinja.exists() {
            cfg.chat_template = Some(read(&jinja)?);
            cfg.chat_template_source = Some(jinja.display().to_string());
        }
        Ok(Some(cfg))
    }

    /// Parses tokenizer_config.json text; `path` names it in errors.
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
        // A special token is a string or an AddedToken object with "content".
        let token = |key: &str| -> MResult<Option<String>> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(Value::Object(o)) => match o.get("content") {
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(err(format!("\"{key}\" has no string \"content\""))),
                },
                Some(x) => Err(err(format!(
                    "\"{key}\" must be a string or a token object, got {x}"
                ))),
            }
        };
        let flag = |key: &str| -> MResult<Option<bool>> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Bool(b)) => Ok(Some(*b)),
                Some(x) => Err(err(format!("\"{key}\" must be true or false, got {x}"))),
            }
        };
        // Older files list named templates; "default" is the one chat uses.
        let chat_template = match obj.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => {
                let named = |n: &str| {
                    list.iter()
                        .find(|t| t.get("name").and_then(Value::as_str) == Some(n))
                };
                let t = named("default")
                    .or_else(|| list.first())
                    .ok_or_else(|| err("\"chat_template\" is an empty list".into()))?;
                Some(
                    t.get("template")
                        .and_then(Value::as_str)
                        .ok_or_else(|| {
                            err("a \"chat_template\" entry has no string \"template\"".into())
                        })?
                        .to_string(),
                )
            }
            Some(x) => {
                return Err(err(format!(
                    "\"chat_template\" must be a string or a list, got {x}"
                )))
            }
        };
        // transformers writes 1e30-ish sentinels for "no limit".
        let model_max_length = obj
            .get("model_max_length")
            .and_then(Value::as_f64)
            .filter(|n| (1.0..1e15).contains(n))
            .map(|n| n as usize);
        Ok(TokenizerConfig {
            chat_template_source: chat_template.as_ref().map(|_| path.display().to_string()),
            chat_template,
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            pad_token: token("pad_token")?,
            add_bos_token: flag("add_bos_token")?,
            add_eos_token: flag("add_eos_token")?,
            model_max_length,
        })
    }
}

/// Text to ids as transformers encodes a prompt: tokenizer.json's own special-token
/// handling, with `add_bos_token` / `add_eos_token` from tokenizer_config.json overriding
/// it where they are set (as transformers' Llama tokenizers rebuild their post-processor).
pub struct PromptEncoder<'a> {
    pub tokenizer: &'a tokenizers::Tokenizer,
    pub config: Option<&'a TokenizerConfig>,
}

impl PromptEncoder<'_> {
    /// `add_special_tokens` as in transformers: false for text that already holds them
    /// (a rendered chat template, say).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        let ids = |special: bool| -> Result<Vec<u32>, String> {
            Ok(self
                .tokenizer
                .encode(text, special)
                .map_err(|e| e.to_string())?
                .get_ids()
                .to_vec())
        };
        let mut out = ids(add_special_tokens)?;
        if !add_special_tokens {
            return Ok(out);
        }
        let Some(cfg) = self.config else {
            return Ok(out);
        };
        let id_of = |t: &Option<String>| t.as_deref().and_then(|t| self.tokenizer.token_to_id(t));
        let plain = || ids(false);
        if let (Some(add), Some(bos)) = (cfg.add_bos_token, id_of(&cfg.bos_token)) {
            let added = out.first() == Some(&bos) && plain()?.first() != Some(&bos);
            if add && !added && out.first() != Some(&bos) {
                out.insert(0, bos);
            } else if !add && added {
                out.remove(0);
            }
        }
        if let (Some(add), Some(eos)) = (cfg.add_eos_token, id_of(&cfg.eos_token)) {
            let added = out.last() == Some(&eos) && plain()?.last() != Some(&eos);
            if add && !added && out.last() != Some(&eos) {
                out.push(eos);
            } else if !add && added {
                out.pop();
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Messages about a template name the file it came from.
    #[test]
    fn the_template_knows_its_source() {
        let dir = std::env::temp_dir().join(format!("arbor-tc-src-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("chat_template.jinja"), "J").unwrap();
        let c = TokenizerConfig::from_dir(&dir).unwrap().unwrap();
        let jinja = c.chat_template_source.unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"chat_template": "T"}"#,
        )
        .unwrap();
        let c = TokenizerConfig::from_dir(&dir).unwrap().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(jinja.ends_with("chat_template.jinja"), "{jinja}");
        assert_eq!(c.chat_template.as_deref(), Some("T"));
        let json = c.chat_template_source.unwrap();
        assert!(json.ends_with("tokenizer_config.json"), "{json}");
    }

    #[test]
    fn special_tokens_as_strings_or_objects_and_template_lists() {
        let c = TokenizerConfig::from_json_str(
            r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
                "add_bos_token": true, "model_max_length": 1000000000000000019884624838656,
                "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
            Path::new("t.json"),
        )
        .unwrap();
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
        assert_eq!(c.add_bos_token, Some(true));
        assert_eq!(c.add_eos_token, None);
        assert_eq!(c.model_max_length, None);
        assert_eq!(c.chat_template.as_deref(), Some("D"));
        for (text, key) in [
            (r#"{"bos_token": 3}"#, "bos_token"),
            (r#"{"add_bos_token": "yes"}"#, "add_bos_token"),
            (r#"{"chat_template": 7}"#, "chat_template"),
        ] {
            let e = TokenizerConfig::from_json_str(text, Path::new("t.json"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains("t.json"), "{e}");
        }
    }
}
