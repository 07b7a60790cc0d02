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

/// Most template instructions one rendering may run (minijinja's fuel): far above what a
/// real template needs for a 1 MiB conversation, and about a second of work.
pub const RENDER_FUEL: u64 = 20_000_000;
/// Longest rendering (checked as it writes).
pub const RENDER_TIME: std::time::Duration = std::time::Duration::from_secs(5);
/// Largest rendered prompt in bytes.
pub const RENDER_BYTES: usize = 16 << 20;

/// Where a rendering writes: refuses bytes past [`RENDER_BYTES`] or past
/// [`RENDER_TIME`], which ends the rendering.
struct Bounded {
    out: Vec<u8>,
    deadline: std::time::Instant,
    over: Option<String>,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let over = if self.out.len() + buf.len() > RENDER_BYTES {
            Some(format!("the rendered prompt passes {RENDER_BYTES} bytes"))
        } else if std::time::Instant::now() > self.deadline {
            Some(format!(
                "rendering took more than {} s",
                RENDER_TIME.as_secs()
            ))
        } else {
            None
        };
        if let Some(why) = over {
            self.over = Some(why.clone());
            return Err(std::io::Error::other(why));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
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
        env.set_fuel(Some(RENDER_FUEL));
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

    /// The prompt text for `messages`; errors are the template's own (a bad conversation),
    /// or say that the rendering ran past its bounds ([`RENDER_FUEL`] instructions,
    /// [`RENDER_TIME`], [`RENDER_BYTES`]).
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
        let mut out = Bounded {
            out: Vec::new(),
            deadline: std::time::Instant::now() + RENDER_TIME,
            over: None,
        };
        let r = tmpl.render_captured_to(
            minijinja::context! {
                messages => msgs,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            },
            &mut out,
        );
        match (r, out.over) {
            (Ok(_), _) => String::from_utf8(out.out)
                .map_err(|e| format!("chat template: the rendered prompt is not UTF-8: {e}")),
            (Err(_), Some(why)) => Err(format!("chat template: {why}")),
            (Err(e), None) if e.kind() == minijinja::ErrorKind::OutOfFuel => Err(format!(
                "chat template: too much work (more than {RENDER_FUEL} template instructions)"
            )),
            (Err(e), None) => Err(format!("chat template: {e}")),
        }
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

    /// A template (a hostile checkpoint's) that loops for ever or writes without end is
    /// stopped: rendering is bounded in work and output (unbounded, one took > 30 s and 2.5 GB).
    #[test]
    fn rendering_is_bounded_in_work_and_output() {
        for (src, needle) in [
            // 10^12 iterations that write nothing.
            (
                "{% for i in range(10000) %}{% for j in range(10000) %}{% for k in range(10000) %}{% endfor %}{% endfor %}{% endfor %}",
                "too much work",
            ),
            // 10^8 x 100 bytes of output.
            (
                "{% for i in range(10000) %}{% for j in range(10000) %}{{ 'x' * 100 }}{% endfor %}{% endfor %}",
                "bytes",
            ),
            // Few instructions, each writing 10^8 bytes.
            (
                "{% for i in range(10000) %}{{ 'y' * 100000000 }}{% endfor %}",
                "bytes",
            ),
        ] {
            let t = ChatTemplate::new(src, String::new(), String::new()).unwrap();
            let t0 = std::time::Instant::now();
            let e = t.render(&[msg("user", "hi")], true).unwrap_err();
            let took = t0.elapsed();
            assert!(e.contains(needle), "{src}: {e}");
            assert!(took < std::time::Duration::from_secs(10), "{src}: took {took:?}");
        }
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
