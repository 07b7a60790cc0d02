//! Chat prompts: the model's own template (tokenizer_config.json `chat_template`), rendered
//! with minijinja and Python-compatible string methods, as transformers does.

use anyhow::{Context, Result};
use arbor_model::TokenizerConfig;
use serde::{Deserialize, Serialize};

/// One chat message; `content` may be a string or a list of `{"type":"text","text":..}` parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// What the template sees of a message.
#[derive(Serialize)]
struct TemplateMessage<'a> {
    role: &'a str,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

impl Message {
    /// The text of the message; parts other than text are refused.
    pub fn text(&self) -> Result<String, String> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(t)) => Ok(t.clone()),
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => s.push_str(t),
                        (kind, _) => {
                            return Err(format!(
                                "content part of type {kind:?} is not supported (text only)"
                            ))
                        }
                    }
                }
                Ok(s)
            }
        }
    }
}

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// The template of the model's tokenizer_config.json; None if it has none.
    pub fn from_config(cfg: Option<&TokenizerConfig>) -> Result<Option<Self>> {
        let Some(cfg) = cfg else {
            return Ok(None);
        };
        let Some(source) = &cfg.chat_template else {
            return Ok(None);
        };
        Self::new(
            source,
            cfg.bos_token.clone().unwrap_or_default(),
            cfg.eos_token.clone().unwrap_or_default(),
        )
        .map(Some)
        .context("tokenizer_config.json: chat_template")
    }

    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| anyhow::anyhow!("cannot parse the template: {e}"))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt text for `messages`; errors are the template's own (a bad conversation).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let mut msgs = Vec::with_capacity(messages.len());
        for m in messages {
            msgs.push(TemplateMessage {
                role: &m.role,
                content: m.text()?,
                name: m.name.as_deref(),
            });
        }
        let tmpl = self.env.get_template("chat").map_err(|e| e.to_string())?;
        tmpl.render(minijinja::context! {
            messages => msgs,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| format!("chat template: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, text: &str) -> Message {
        Message {
            role: role.into(),
            content: Some(Content::Text(text.into())),
            name: None,
        }
    }

    #[test]
    fn renders_an_hf_style_template() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}<|{{ m.role }}|>{{ m.content.strip() }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        let t = ChatTemplate::new(src, "<s>".into(), "</s>".into()).unwrap();
        let out = t
            .render(&[msg("system", " be brief "), msg("user", "hi")], true)
            .unwrap();
        assert_eq!(out, "<s><|system|>be brief</s><|user|>hi</s><|assistant|>");
        let e = t.render(&[msg("tool", "x")], false).unwrap_err();
        assert!(e.contains("bad role tool"), "{e}");
    }

    #[test]
    fn template_from_the_tokenizer_config() {
        let path = std::path::Path::new("tokenizer_config.json");
        let cfg = TokenizerConfig::from_json_str(
            r#"{"bos_token": {"content": "<B>"}, "eos_token": "<E>", "chat_template": "{{ bos_token }}D{{ eos_token }}"}"#,
            path,
        )
        .unwrap();
        let t = ChatTemplate::from_config(Some(&cfg)).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "<B>D<E>");
        assert!(ChatTemplate::from_config(None).unwrap().is_none());
        let cfg = TokenizerConfig::from_json_str(r#"{"chat_template": "{% if %}"}"#, path).unwrap();
        let e = format!("{:#}", ChatTemplate::from_config(Some(&cfg)).err().unwrap());
        assert!(e.contains("chat_template"), "{e}");
    }
}
