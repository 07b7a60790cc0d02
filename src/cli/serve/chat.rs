//! Chat prompts: the model's own template (tokenizer_config.json `chat_template`,
//! chat_template.jinja, or a GGUF file's `tokenizer.chat_template`), rendered with
//! minijinja and Python-compatible string methods, as transformers does. A template that
//! cannot be parsed turns chat off, not the server ([`Chat`]).

use anyhow::{Context, Result};
use arbor_model::TokenizerConfig;
use minijinja::value::Kwargs;
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
    /// An assistant turn's calls (OpenAI's `tool_calls`).
    #[serde(default)]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` turn's answer to the call of this id.
    #[serde(default)]
    pub tool_call_id: Option<String>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
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
    /// How the template teaches the model to write a tool call.
    pub tool_format: super::tools::Format,
}

/// The chat a server offers: a template, none (the model has no template), or off (its
/// template cannot be parsed; completions still run).
pub enum Chat {
    Ready(Box<ChatTemplate>),
    Missing,
    /// Why chat is off, naming where the template came from.
    Broken(String),
}

impl Chat {
    /// The model's template; a parse failure is logged and turns chat off.
    pub fn from_config(cfg: Option<&TokenizerConfig>) -> Chat {
        match ChatTemplate::from_config(cfg) {
            Ok(Some(t)) => Chat::Ready(Box::new(t)),
            Ok(None) => Chat::Missing,
            Err(e) => {
                let why = format!("{e:#}");
                tracing::warn!("chat is off: {why}; /v1/completions serves as usual");
                Chat::Broken(why)
            }
        }
    }
}

impl ChatTemplate {
    /// The template of the model's tokenizer config; None if it has none. Errors name
    /// where the template came from.
    pub fn from_config(cfg: Option<&TokenizerConfig>) -> Result<Option<Self>> {
        let Some(cfg) = cfg else {
            return Ok(None);
        };
        let Some(source) = &cfg.chat_template else {
            return Ok(None);
        };
        let from = cfg
            .chat_template_source
            .as_deref()
            .unwrap_or("tokenizer_config.json");
        Self::new(
            source,
            cfg.bos_token.clone().unwrap_or_default(),
            cfg.eos_token.clone().unwrap_or_default(),
        )
        .map(Some)
        .with_context(|| format!("the chat template of {from}"))
    }

    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(RENDER_FUEL));
        // transformers renders with trim_blocks and lstrip_blocks: templates are written
        // for them (a newline after a block tag is not output).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", without_generation_tags(source))
            .map_err(|e| anyhow::anyhow!("cannot parse the template: {e}"))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            tool_format: super::tools::Format::of_template(source),
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
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    /// [`render`](Self::render) with the request's tools as the template's `tools`
    /// variable (undefined without them, as transformers leaves it).
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String, String> {
        let mut msgs = Vec::with_capacity(messages.len());
        for m in messages {
            msgs.push(TemplateMessage {
                role: &m.role,
                content: m.text()?,
                name: m.name.as_deref(),
                tool_calls: m.tool_calls.as_deref().map(super::tools::for_template),
                tool_call_id: m.tool_call_id.as_deref(),
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
                tools => tools,
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

/// transformers' `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`, so `{"a": 1}` renders with Python's
/// spaces and `<` stays `<` (minijinja's own filter is compact and escapes for HTML).
/// Mappings a template builds have their keys sorted (minijinja keeps no insertion order).
fn tojson(value: &minijinja::Value, kwargs: Kwargs) -> Result<String, minijinja::Error> {
    let bad = |msg: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg);
    let indent = match kwargs.get::<Option<minijinja::Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_usize(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n)),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(bad(format!(
                    "tojson: indent {v} is not a number or a string"
                )))
            }
        },
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(s) => return Err(bad(format!("tojson: separators {s:?} is not a pair"))),
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    // serde_json's maps are ordered by key: sort_keys changes nothing more.
    let _ = kwargs.get::<Option<bool>>("sort_keys")?;
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(value)
        .map_err(|e| bad(format!("tojson: cannot serialize {value}: {e}")))?;
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        ascii,
    };
    let mut out = String::new();
    style.write(&v, 0, &mut out);
    Ok(out)
}

/// How Python's `json.dumps` lays out a value.
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ascii: bool,
}

impl JsonStyle {
    fn write(&self, v: &serde_json::Value, level: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Array(a) if !a.is_empty() => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    self.separate(i, level + 1, out);
                    self.write(x, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            J::Object(o) if !o.is_empty() => {
                out.push('{');
                for (i, (k, x)) in o.iter().enumerate() {
                    self.separate(i, level + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key_sep);
                    self.write(x, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
            J::String(s) => self.string(s, out),
            other => out.push_str(&other.to_string()),
        }
    }

    /// Before item `i` of a container at `level`.
    fn separate(&self, i: usize, level: usize, out: &mut String) {
        if i > 0 {
            out.push_str(&self.item_sep);
        }
        self.newline(level, out);
    }

    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            out.push_str(&ind.repeat(level));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        let quoted = serde_json::Value::from(s).to_string();
        if !self.ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
}

/// transformers' `{% generation %}` … `{% endgeneration %}` marks the assistant's text
/// for training masks and renders its body unchanged. minijinja has no such tag: each
/// becomes `{% if true %}` / `{% endif %}`, which render the same, whitespace control
/// (`{%-`, `-%}`) included.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            // Unclosed: the parser will say so.
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, close) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replaced = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replaced {
            Some(r) => out.push_str(&format!("{{%{open} {r} {close}%}}")),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, text: &str) -> Message {
        Message {
            role: role.into(),
            content: Some(Content::Text(text.into())),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }

    #[test]
    fn a_qwen_template_renders_tools_calls_and_their_results() {
        let src = include_str!("../../../tests/serve/templates/qwen2.5.jinja");
        let t = ChatTemplate::new(src, String::new(), "<|im_end|>".into()).unwrap();
        assert_eq!(t.tool_format, super::super::tools::Format::Hermes);
        let tools = vec![serde_json::json!({"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})];
        let mut call = msg("assistant", "");
        call.content = None;
        call.tool_calls = Some(vec![serde_json::json!({"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}})]);
        let mut result = msg("tool", "{\"temp\": 21}");
        result.tool_call_id = Some("call_1".into());
        let conv = [msg("user", "Weather in Paris?"), call, result];
        let out = t.render_with_tools(&conv, true, Some(&tools)).unwrap();
        let want = concat!(
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
            "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n",
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
            "{\"function\": {\"name\": \"get_weather\", \"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, \"type\": \"object\"}}, \"type\": \"function\"}",
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n",
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n",
        );
        assert_eq!(out, want);
        // Without tools the template takes its other branch.
        let plain = t.render(&[msg("user", "hi")], true).unwrap();
        assert!(
            plain.starts_with("<|im_start|>system\nYou are Qwen") && !plain.contains("<tools>"),
            "{plain}"
        );
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

    /// A tool-calling style template (macros, a recursive one with a default argument,
    /// `namespace`, reversed slices, `loop.nextitem`, string methods, `tojson`,
    /// `{% generation %}`, block tags on lines of their own) renders as transformers
    /// renders it: the expected text is Jinja2's with transformers' environment
    /// (trim_blocks, lstrip_blocks, its `tojson` and `generation` tag). `{% macro %}` once
    /// stopped `arbor serve` from starting.
    #[test]
    fn a_tool_calling_style_template_renders_as_transformers_does() {
        let src = r#"{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content | trim -}}
    {%- else -%}
        {%- for part in content -%}{{ part.text }}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_schema(spec, depth=0) -%}
    {%- if spec is mapping -%}
        {%- for key, value in spec | items -%}
            {{- key }}={{ render_schema(value, depth + 1) }}{{ ";" if not loop.last }}
        {%- endfor -%}
    {%- else -%}
        {{- spec | tojson -}}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages[::-1] -%}
    {%- if ns.last_user < 0 and m.role == 'user' -%}
        {%- set ns.last_user = (messages | length - 1) - loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{{ bos_token }}
{% for m in messages %}
    {% if m.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' ~ m.role) }}
    {% endif %}
<|{{ m.role }}|>
    {% if m.role == 'assistant' %}
        {% generation %}
        {{- m.content.split('</think>')[-1].lstrip('\n') -}}
        {% endgeneration %}
    {% else %}
        {{- render_content(m.content) -}}
    {% endif %}
    {% if loop.index0 == ns.last_user %}[last user]{% endif %}
    {% if loop.nextitem is defined and loop.nextitem.role == m.role %}[again]{% endif %}
{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
{{ render_schema({"a": "é<", "b": {"c": [1, "x"]}}) }}
{{ {"k": [1, 2]} | tojson }}|{{ {"k": 1} | tojson(indent=2) }}|{{ "é" | tojson(ensure_ascii=true) }}"#;
        let t = ChatTemplate::new(src, "<s>".into(), "</s>".into()).unwrap();
        let out = t
            .render(
                &[
                    msg("system", " be brief "),
                    msg("user", "hi"),
                    msg("user", "again"),
                    msg("assistant", "<think>hm</think>\n\nhello"),
                ],
                true,
            )
            .unwrap();
        let want = r#"<s>
<|system|>
be brief</s>
<|user|>
hi[again]</s>
<|user|>
again[last user]</s>
<|assistant|>
hello</s>
<|assistant|>
a="é<";b=c=[1, "x"]
{"k": [1, 2]}|{
  "k": 1
}|"\u00e9""#;
        assert_eq!(out, want);
        let e = t.render(&[msg("tool", "x")], false).unwrap_err();
        assert!(e.contains("unknown role tool"), "{e}");
    }

    #[test]
    fn generation_tags_become_blocks_that_render_their_body() {
        assert_eq!(
            without_generation_tags("a{%- generation -%} b {%+endgeneration%}{% if x %}{{ '{%' }}"),
            "a{%- if true -%} b {%+ endif %}{% if x %}{{ '{%' }}"
        );
        assert_eq!(without_generation_tags("x{% generation"), "x{% generation");
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
        assert!(e.contains("tokenizer_config.json"), "{e}");
    }

    /// A template that cannot be parsed turns chat off, naming where the template came
    /// from (it once stopped the server, blamed on tokenizer_config.json whatever its
    /// source).
    #[test]
    fn an_unparsable_template_turns_chat_off_naming_its_source() {
        let cfg = TokenizerConfig {
            chat_template: Some("{% frobnicate %}".into()),
            chat_template_source: Some("m.gguf (tokenizer.chat_template)".into()),
            ..Default::default()
        };
        let Chat::Broken(why) = Chat::from_config(Some(&cfg)) else {
            panic!("the template should not parse")
        };
        assert!(
            why.contains("m.gguf (tokenizer.chat_template)") && why.contains("frobnicate"),
            "{why}"
        );
        assert!(matches!(Chat::from_config(None), Chat::Missing));
        let ok = TokenizerConfig {
            chat_template: Some("{% macro m() %}x{% endmacro %}{{ m() }}".into()),
            ..Default::default()
        };
        assert!(matches!(Chat::from_config(Some(&ok)), Chat::Ready(_)));
    }
}
