//! Tool calling on `/v1/chat/completions`: the request's `tools`, `tool_choice` and
//! `parallel_tool_calls`; the tools handed to the chat template (its `tools` variable, as
//! transformers passes them); the model's output parsed into OpenAI `tool_calls` in the
//! format its template teaches; and, when a call is forced (`required` or a named
//! function), the output constrained to such a call whose arguments follow the function's
//! JSON schema (a Lark grammar with `%json` for llguidance, `structured`).
//!
//! Formats, chosen from the chat template's text:
//! - Hermes / Qwen2.5 / Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//!   one block per call;
//! - Llama 3.1 / 3.2: the whole reply is `{"name": ..., "parameters": {...}}` (after an
//!   optional `<|python_tag|>`), calls separated by `; `;
//! - Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; `[TOOL_CALLS]` is a
//!   special token in Mistral's tokenizers, which the grammar of a forced call names by id
//!   and the reply keeps (special tokens are not skipped from it, as vLLM's Mistral parser
//!   asks) so that the call can be found.

use std::borrow::Cow;

use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::structured::{Requested, Spec, MAX_SPEC_BYTES};

/// Most tools one request may list.
pub const MAX_TOOLS: usize = 128;

/// How the served model writes a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Hermes,
    Llama3,
    Mistral,
}

impl Format {
    /// The format a chat template teaches; Hermes-style tags where it names none (the
    /// most common one, and the one a forced call is written in).
    pub fn of_template(source: &str) -> Format {
        if source.contains("[TOOL_CALLS]") {
            Format::Mistral
        } else if source.contains("<tool_call>") {
            Format::Hermes
        } else if source.contains("<|python_tag|>") || source.contains("\"parameters\": ") {
            Format::Llama3
        } else {
            Format::Hermes
        }
    }
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools.
#[derive(Debug, Clone)]
pub struct Tools {
    /// As the request gave them (`{"type": "function", "function": {...}}`), for the
    /// template.
    pub list: Vec<Value>,
    pub choice: Choice,
    pub parallel: bool,
}

fn bad(param: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::bad(param, msg)
}

impl Tools {
    /// Checks `tools`, `tool_choice` and `parallel_tool_calls`; None when the request
    /// lists no tools and forces none.
    pub fn from_request(
        tools: Option<&Value>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Tools>, ApiError> {
        let list = match tools {
            None => Vec::new(),
            Some(v) => {
                let n = v.to_string().len();
                if n > MAX_SPEC_BYTES {
                    return Err(bad(
                        "tools",
                        format!(
                            "tools is {n} bytes, more than the {MAX_SPEC_BYTES} this server takes"
                        ),
                    ));
                }
                let list = v
                    .as_array()
                    .ok_or_else(|| {
                        bad(
                            "tools",
                            "tools must be a list of {\"type\": \"function\", \"function\": {...}}",
                        )
                    })?
                    .clone();
                if list.len() > MAX_TOOLS {
                    return Err(bad("tools", format!("at most {MAX_TOOLS} tools")));
                }
                for (i, t) in list.iter().enumerate() {
                    check_tool(i, t)?;
                }
                list
            }
        };
        let choice = match choice {
            None if list.is_empty() => Choice::None,
            None => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => {
                    return Err(bad(
                        "tool_choice",
                        format!("tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {other:?}"),
                    ))
                }
            },
            Some(v) => match (v["type"].as_str(), v["function"]["name"].as_str()) {
                (Some("function"), Some(name)) => Choice::Named(name.to_string()),
                _ => {
                    return Err(bad(
                        "tool_choice",
                        "tool_choice as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ))
                }
            },
        };
        match &choice {
            Choice::Required | Choice::Named(_) if list.is_empty() => {
                return Err(bad(
                    "tool_choice",
                    "tool_choice forces a call but tools is empty",
                ))
            }
            Choice::Named(n) if !list.iter().any(|t| name_of(t) == Some(n.as_str())) => {
                return Err(bad(
                    "tool_choice",
                    format!("tool_choice names the function {n:?}, which tools does not list"),
                ))
            }
            _ => {}
        }
        if list.is_empty() {
            return Ok(None);
        }
        Ok(Some(Tools {
            list,
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// Whether the template sees the tools and the output is parsed for calls
    /// (`tool_choice` "none" hides them: the model cannot call what it was not shown).
    pub fn active(&self) -> bool {
        self.choice != Choice::None
    }

    /// The output constraint of a forced call in `format`: one call (a named function, or
    /// `parallel_tool_calls` false) or one or more, each `{"name", "arguments"}` with the
    /// arguments following the function's `parameters` schema. None where nothing is
    /// forced. `mistral_marker` is the id of the special token `[TOOL_CALLS]` where the
    /// tokenizer has one (else the marker is written as text).
    pub fn forced(&self, format: Format, mistral_marker: Option<u32>) -> Option<Requested> {
        let names: Vec<&str> = match &self.choice {
            Choice::Required => self.list.iter().filter_map(name_of).collect(),
            Choice::Named(n) => vec![n.as_str()],
            Choice::None | Choice::Auto => return None,
        };
        let args_key = match format {
            Format::Hermes | Format::Mistral => "arguments",
            Format::Llama3 => "parameters",
        };
        let calls: Vec<Value> = names
            .iter()
            .map(|n| {
                let params = self
                    .list
                    .iter()
                    .find(|t| name_of(t) == Some(*n))
                    .map(|t| t["function"]["parameters"].clone())
                    .filter(|p| p.is_object())
                    .unwrap_or_else(|| json!({"type": "object"}));
                json!({"type": "object",
                       "properties": {"name": {"const": n}, args_key: params},
                       "required": ["name", args_key],
                       "additionalProperties": false})
            })
            .collect();
        let mut schema = if calls.len() == 1 {
            calls.into_iter().next().unwrap_or(Value::Null)
        } else {
            json!({"anyOf": calls})
        };
        if let Some(o) = schema.as_object_mut() {
            o.insert(
                "x-guidance".into(),
                json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
            );
        }
        let many = self.parallel && matches!(self.choice, Choice::Required);
        let grammar = match format {
            Format::Hermes if many => format!(
                "start: call (\"\\n\" call)*\ncall: \"<tool_call>\\n\" obj \"\\n</tool_call>\"\nobj: %json {schema}\n"
            ),
            Format::Hermes => {
                format!("start: \"<tool_call>\\n\" obj \"\\n</tool_call>\"\nobj: %json {schema}\n")
            }
            Format::Llama3 if many => format!("start: obj (\"; \" obj)*\nobj: %json {schema}\n"),
            Format::Llama3 => format!("start: obj\nobj: %json {schema}\n"),
            Format::Mistral => {
                let marker = match mistral_marker {
                    Some(id) => format!("<[{id}]>"),
                    None => "\"[TOOL_CALLS]\"".to_string(),
                };
                let more = if many { " (\", \" obj)*" } else { "" };
                format!("start: {marker} \"[\" obj{more} \"]\"\nobj: %json {schema}\n")
            }
        };
        Some(Requested {
            spec: Spec::Lark(grammar),
            param: Cow::Borrowed("tools"),
        })
    }
}

/// The id of Mistral's `[TOOL_CALLS]` where the tokenizer has it as a special token.
pub fn mistral_marker(tok: &tokenizers::Tokenizer) -> Option<u32> {
    tok.get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special && t.content == "[TOOL_CALLS]")
        .map(|(id, _)| id)
        .min()
}

fn name_of(t: &Value) -> Option<&str> {
    t["function"]["name"].as_str()
}

fn check_tool(i: usize, t: &Value) -> Result<(), ApiError> {
    let what = |m: &str| bad("tools", format!("tools[{i}]: {m}"));
    if t["type"].as_str() != Some("function") {
        return Err(what("the type must be \"function\""));
    }
    let f = t["function"]
        .as_object()
        .ok_or_else(|| what("needs a \"function\" object"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| what("the function needs a \"name\""))?;
    if name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
    {
        return Err(what(&format!(
            "the function name {name:?} must be 1 to 64 letters, digits, '_', '-' or '.'"
        )));
    }
    if let Some(p) = f.get("parameters") {
        if !p.is_object() && !p.is_null() {
            return Err(what("parameters must be a JSON schema object"));
        }
    }
    if let Some(k) = f
        .keys()
        .find(|k| !matches!(k.as_str(), "name" | "description" | "parameters" | "strict"))
    {
        return Err(what(&format!("the function field {k:?} is not supported")));
    }
    Ok(())
}

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments as a JSON object.
    pub arguments: Value,
}

/// A reply split into its text and its calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// The text outside the calls (None where nothing but calls and whitespace).
    pub content: Option<String>,
    pub calls: Vec<Call>,
}

/// A call object `{"name": ..., "arguments" | "parameters": {...}}`; arguments given as
/// a JSON string (some models write them so) are read as the object they hold.
fn call_of(v: &Value) -> Option<Call> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.to_string();
    let args = o.get("arguments").or_else(|| o.get("parameters"));
    let arguments = match args {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str(s).ok()?,
        Some(v) => v.clone(),
    };
    arguments.is_object().then_some(Call { name, arguments })
}

fn content_of(parts: &str) -> Option<String> {
    let t = parts.trim();
    (!t.is_empty()).then(|| t.to_string())
}

/// The calls in a finished reply; a reply without any (or whose calls do not parse) is
/// all content.
pub fn parse(text: &str, format: Format) -> Parsed {
    let plain = || Parsed {
        content: Some(text.to_string()).filter(|t| !t.is_empty()),
        calls: Vec::new(),
    };
    match format {
        Format::Hermes => {
            let mut calls = Vec::new();
            let mut rest = String::new();
            let mut s = text;
            while let Some(at) = s.find("<tool_call>") {
                rest.push_str(&s[..at]);
                let body = &s[at + "<tool_call>".len()..];
                let Some(end) = body.find("</tool_call>") else {
                    return plain();
                };
                match serde_json::from_str::<Value>(body[..end].trim())
                    .ok()
                    .as_ref()
                    .and_then(call_of)
                {
                    Some(c) => calls.push(c),
                    None => return plain(),
                }
                s = &body[end + "</tool_call>".len()..];
            }
            rest.push_str(s);
            if calls.is_empty() {
                return plain();
            }
            Parsed {
                content: content_of(&rest),
                calls,
            }
        }
        Format::Llama3 => {
            let body = text.trim();
            let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
            if !body.starts_with('{') {
                return plain();
            }
            let mut calls = Vec::new();
            for part in split_top_level(body, ';') {
                match serde_json::from_str::<Value>(part.trim())
                    .ok()
                    .as_ref()
                    .and_then(call_of)
                {
                    Some(c) => calls.push(c),
                    None => return plain(),
                }
            }
            Parsed {
                content: None,
                calls,
            }
        }
        Format::Mistral => {
            let Some(at) = text.find("[TOOL_CALLS]") else {
                return plain();
            };
            let body = text[at + "[TOOL_CALLS]".len()..].trim();
            let calls: Option<Vec<Call>> = match serde_json::from_str::<Value>(body) {
                Ok(Value::Array(a)) => a.iter().map(call_of).collect(),
                Ok(v) => call_of(&v).map(|c| vec![c]),
                Err(_) => None,
            };
            match calls {
                Some(calls) if !calls.is_empty() => Parsed {
                    content: content_of(&text[..at]),
                    calls,
                },
                _ => plain(),
            }
        }
    }
}

/// `s` cut at `sep` where it stands outside JSON strings, objects and lists.
fn split_top_level(s: &str, sep: char) -> Vec<&str> {
    let (mut depth, mut in_str, mut esc, mut start) = (0i32, false, false, 0);
    let mut out = Vec::new();
    for (i, c) in s.char_indices() {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            c if c == sep && depth == 0 => {
                out.push(&s[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

/// Where a stream must stop sending text as content: from the start of a call (or of
/// what may become one: a prefix of the call's opening at the end of the text), so that a
/// call's text is never streamed as content. None: all of it may go.
pub fn hold_from(text: &str, format: Format) -> Option<usize> {
    let marker = match format {
        Format::Hermes => "<tool_call>",
        Format::Mistral => "[TOOL_CALLS]",
        Format::Llama3 => {
            // A call is the whole reply: hold while it may still start with one.
            let t = text.trim_start();
            let tag = "<|python_tag|>";
            return (t.is_empty()
                || t.starts_with('{')
                || t.starts_with(tag)
                || tag.starts_with(t))
            .then_some(0);
        }
    };
    if let Some(at) = text.find(marker) {
        return Some(at);
    }
    // The longest suffix of the text that begins the marker.
    (1..marker.len())
        .rev()
        .filter(|&k| k <= text.len())
        .find(|&k| text.is_char_boundary(text.len() - k) && text.ends_with(&marker[..k]))
        .map(|k| text.len() - k)
}

/// An OpenAI `tool_calls` entry; `id` is a pure function of the request id, the choice
/// and the call's place, so a replayed request returns the same ids.
pub fn call_json(rid: &str, choice: usize, k: usize, c: &Call) -> Value {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in rid
        .bytes()
        .chain(choice.to_le_bytes())
        .chain(k.to_le_bytes())
    {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    json!({"id": format!("call_{h:016x}"), "type": "function",
           "function": {"name": c.name, "arguments": c.arguments.to_string()}})
}

/// An assistant message's `tool_calls` as a template reads them: each call's `arguments`
/// an object where the request gave its JSON text (transformers' templates iterate it or
/// write it with `tojson`).
pub fn for_template(calls: &[Value]) -> Vec<Value> {
    calls
        .iter()
        .map(|c| {
            let mut c = c.clone();
            if let Some(s) = c["function"]["arguments"].as_str() {
                if let Ok(v @ Value::Object(_)) = serde_json::from_str::<Value>(s) {
                    c["function"]["arguments"] = v;
                }
            }
            c
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "description": "d",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}}])
    }

    #[test]
    fn requests_are_checked_and_name_their_field() {
        let t = Tools::from_request(Some(&weather()), None, None)
            .unwrap()
            .unwrap();
        assert_eq!((t.choice.clone(), t.parallel), (Choice::Auto, true));
        assert!(Tools::from_request(None, None, None).unwrap().is_none());
        let e = Tools::from_request(None, Some(&json!("required")), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = Tools::from_request(
            Some(&weather()),
            Some(&json!({"type": "function", "function": {"name": "nope"}})),
            None,
        )
        .unwrap_err();
        assert!(e.message.contains("\"nope\""), "{}", e.message);
        let e = Tools::from_request(Some(&json!([{"type": "retrieval"}])), None, None).unwrap_err();
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (Some("tools"), "tools[0]: the type must be \"function\"")
        );
        let e = Tools::from_request(Some(&weather()), Some(&json!("sometimes")), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let none = Tools::from_request(Some(&weather()), Some(&json!("none")), None)
            .unwrap()
            .unwrap();
        assert!(!none.active() && none.forced(Format::Hermes, None).is_none());
    }

    #[test]
    fn hermes_llama_and_mistral_calls_parse() {
        let p = parse(
            "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
            Format::Hermes,
        );
        assert_eq!(p.content.as_deref(), Some("Let me look."));
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.calls[0].arguments, json!({"city": "Paris"}));
        let p = parse(
            "<|python_tag|>{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"a;b\"}}",
            Format::Llama3,
        );
        assert_eq!(
            p.calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            ["now", "get_weather"]
        );
        assert_eq!(p.calls[1].arguments["city"], "a;b");
        let p = parse(
            "[TOOL_CALLS][{\"name\": \"now\", \"arguments\": \"{}\"}]",
            Format::Mistral,
        );
        assert_eq!(p.calls.len(), 1);
        // Text that is not a call stays text.
        for (t, f) in [
            ("<tool_call>{bad json}</tool_call>", Format::Hermes),
            ("{\"no\": 1}", Format::Llama3),
            ("plain words", Format::Mistral),
        ] {
            let p = parse(t, f);
            assert_eq!((p.content.as_deref(), p.calls.len()), (Some(t), 0));
        }
    }

    #[test]
    fn streams_hold_back_what_may_be_a_call() {
        assert_eq!(hold_from("Hello <tool", Format::Hermes), Some(6));
        assert_eq!(hold_from("Hello <tool_call>{", Format::Hermes), Some(6));
        assert_eq!(hold_from("Hello", Format::Hermes), None);
        assert_eq!(hold_from("  {\"na", Format::Llama3), Some(0));
        assert_eq!(hold_from("Sure", Format::Llama3), None);
        assert_eq!(hold_from("<|pyth", Format::Llama3), Some(0));
    }

    #[test]
    fn forced_calls_become_grammars_and_ids_replay() {
        let t = Tools::from_request(
            Some(&weather()),
            Some(&json!({"type": "function", "function": {"name": "get_weather"}})),
            None,
        )
        .unwrap()
        .unwrap();
        let Some(Requested {
            spec: Spec::Lark(g),
            ..
        }) = t.forced(Format::Hermes, None)
        else {
            panic!("no grammar")
        };
        assert!(g.starts_with("start: \"<tool_call>\\n\" obj"), "{g}");
        assert!(g.contains("\"const\":\"get_weather\""), "{g}");
        let c = Call {
            name: "now".into(),
            arguments: json!({}),
        };
        assert_eq!(call_json("r", 0, 1, &c), call_json("r", 0, 1, &c));
        assert_ne!(
            call_json("r", 0, 1, &c)["id"],
            call_json("r", 0, 2, &c)["id"]
        );
        assert_eq!(call_json("r", 0, 1, &c)["function"]["arguments"], "{}");
        assert_eq!(Format::of_template("{{ '<tool_call>' }}"), Format::Hermes);
        assert_eq!(Format::of_template("<|python_tag|>"), Format::Llama3);
        assert_eq!(Format::of_template("[TOOL_CALLS]"), Format::Mistral);
    }

    #[test]
    fn a_forced_mistral_call_starts_with_its_special_token() {
        use super::super::structured::tests::byte_engine;
        let t = Tools::from_request(Some(&weather()), Some(&json!("required")), None)
            .unwrap()
            .unwrap();
        // The byte tokenizer's special token 256 stands for `[TOOL_CALLS]`.
        let r = t.forced(Format::Mistral, Some(256)).unwrap();
        let Spec::Lark(g) = &r.spec else {
            panic!("{r:?}")
        };
        assert!(
            g.starts_with("start: <[256]> \"[\" obj (\", \" obj)* \"]\""),
            "{g}"
        );
        let (con, _) = byte_engine().compile(&r).unwrap().start();
        assert_eq!(con.allowed(&[]).count(), 1);
        assert!(con.allowed(&[]).allows(256));
        assert_eq!(con.allowed(&[256]).count(), 1);
        assert!(con.allowed(&[256]).allows(b'[' as u32));
    }

    #[test]
    fn a_forced_tool_call_parses_and_follows_its_schema() {
        use super::super::structured::tests::{byte_engine, follow};
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
                           "required": ["city"], "additionalProperties": false}}},
            {"type": "function", "function": {"name": "now"}}]);
        let e = byte_engine();
        for (choice, format) in [
            (json!("required"), Format::Hermes),
            (
                json!({"type": "function", "function": {"name": "get_weather"}}),
                Format::Hermes,
            ),
            (
                json!({"type": "function", "function": {"name": "get_weather"}}),
                Format::Llama3,
            ),
            (json!("required"), Format::Mistral),
        ] {
            let t = Tools::from_request(Some(&tools), Some(&choice), Some(false))
                .unwrap()
                .unwrap();
            let c = e.compile(&t.forced(format, None).unwrap()).unwrap();
            for k in 0..4usize {
                let (text, ended) = follow(&c.start().0, 300, |a, step| {
                    if a.contains(&257) {
                        257
                    } else {
                        a[(step * 5 + k * 3) % a.len()]
                    }
                });
                assert!(ended, "{text}");
                let p = parse(&text, format);
                assert_eq!(p.calls.len(), 1, "{text}");
                let call = &p.calls[0];
                if call.name == "get_weather" {
                    let city = call.arguments["city"]
                        .as_str()
                        .unwrap_or_else(|| panic!("{text}"));
                    assert!(city.chars().count() <= 4, "{text}");
                    assert_eq!(
                        call.arguments.as_object().map(|o| o.len()),
                        Some(1),
                        "{text}"
                    );
                } else {
                    assert_eq!(call.name, "now", "{text}");
                }
            }
        }
    }
}
