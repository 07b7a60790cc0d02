//! A request body's fields checked before serde reads it, so that every refusal names its
//! field in plain words: a field the server does not know or does not implement is "not
//! supported" (400, `param` the field), a value of the wrong type or out of range says what
//! it must be. `null` means the field's default, as in OpenAI's API and vLLM.

use std::borrow::Cow;

use serde_json::{Map, Value};

/// Why a field was refused; the request's error (400) says it with `param` the field.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub param: Cow<'static, str>,
    pub message: String,
    /// A field the server does not support (OpenAI's code `unsupported_parameter`), not a
    /// bad value.
    pub unsupported: bool,
}

/// What a field's value must be.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// An integer, at least `min`.
    Int {
        min: i64,
    },
    Number,
    Bool,
    Str,
}

/// Fields both generation endpoints check (the rest are checked by serde).
pub const COMMON_KINDS: &[(&str, Kind)] = &[
    ("model", Kind::Str),
    ("temperature", Kind::Number),
    ("top_p", Kind::Number),
    ("n", Kind::Int { min: 1 }),
    ("seed", Kind::Int { min: 0 }),
    ("stream", Kind::Bool),
    ("presence_penalty", Kind::Number),
    ("frequency_penalty", Kind::Number),
    ("user", Kind::Str),
    ("top_k", Kind::Int { min: -1 }),
    ("ignore_eos", Kind::Bool),
    ("sample_id", Kind::Int { min: 0 }),
    ("prompt_logprobs", Kind::Bool),
    ("rid", Kind::Str),
    ("min_tokens", Kind::Int { min: 0 }),
];

/// `/v1/completions`: `max_tokens` 0 with `echo` scores the prompt and generates nothing
/// (OpenAI's legacy completions allow it; lm-eval's log-likelihoods used it).
pub const COMPLETION_KINDS: &[(&str, Kind)] = &[
    ("max_tokens", Kind::Int { min: 0 }),
    ("logprobs", Kind::Int { min: 0 }),
    ("echo", Kind::Bool),
    ("best_of", Kind::Int { min: 1 }),
];

pub const CHAT_KINDS: &[(&str, Kind)] = &[
    ("max_tokens", Kind::Int { min: 1 }),
    ("max_completion_tokens", Kind::Int { min: 1 }),
    ("logprobs", Kind::Bool),
    ("top_logprobs", Kind::Int { min: 0 }),
    ("add_generation_prompt", Kind::Bool),
    ("parallel_tool_calls", Kind::Bool),
];

/// The name as `param` carries it: the accepted field's own `'static` name where there is
/// one, else the client's text.
fn param_of(known: &[&'static str], k: &str) -> Cow<'static, str> {
    match known.iter().find(|f| **f == k) {
        Some(f) => (*f).into(),
        None => k.to_string().into(),
    }
}

/// Drops `null` fields (the default), refuses fields outside `accepted` and checks the
/// values `kinds` names.
pub fn check(
    obj: &mut Map<String, Value>,
    accepted: &[&[&'static str]],
    kinds: &[&[(&'static str, Kind)]],
) -> Result<(), Refusal> {
    obj.retain(|_, v| !v.is_null());
    let known: Vec<&'static str> = accepted.iter().flat_map(|a| a.iter().copied()).collect();
    // Sorted, so that a body with several such fields always names the same one.
    let mut keys: Vec<&String> = obj.keys().collect();
    keys.sort();
    if let Some(k) = keys.into_iter().find(|k| !known.contains(&k.as_str())) {
        return Err(Refusal {
            param: param_of(&known, k),
            message: format!("the field {k:?} is not supported by this server"),
            unsupported: true,
        });
    }
    for &(name, kind) in kinds.iter().flat_map(|k| k.iter()) {
        let Some(v) = obj.get(name) else { continue };
        let wrong = |what: &str| {
            Err(Refusal {
                param: name.into(),
                message: format!("{name} must be {what}, got {}", short(v)),
                unsupported: false,
            })
        };
        match kind {
            Kind::Int { min } => {
                let ok_int = v.as_i64().map(|i| i >= min).or(v.as_u64().map(|_| true));
                match ok_int {
                    Some(true) => {}
                    Some(false) => return wrong(&format!("at least {min}")),
                    None => return wrong("an integer"),
                }
            }
            Kind::Number if !v.is_number() => return wrong("a number"),
            Kind::Bool if !v.is_boolean() => return wrong("true or false"),
            Kind::Str if !v.is_string() => return wrong("a string"),
            _ => {}
        }
    }
    Ok(())
}

/// A value as an error message shows it: its JSON, cut short.
fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(v: Value) -> Result<Map<String, Value>, Refusal> {
        let Value::Object(mut obj) = v else {
            unreachable!("test bodies are objects")
        };
        check(
            &mut obj,
            &[&["prompt", "max_tokens", "seed", "stream", "temperature"]],
            &[&[
                ("max_tokens", Kind::Int { min: 1 }),
                ("seed", Kind::Int { min: 0 }),
                ("stream", Kind::Bool),
                ("temperature", Kind::Number),
            ]],
        )
        .map(|()| obj)
    }

    #[test]
    fn unknown_fields_are_not_supported_and_named() {
        let e = run(json!({"prompt": "x", "tools": [], "zeta": 1})).unwrap_err();
        assert_eq!(e.param, "tools");
        assert!(e.unsupported);
        assert!(
            e.message.contains("\"tools\" is not supported"),
            "{}",
            e.message
        );
    }

    #[test]
    fn ranges_and_types_in_plain_words() {
        let e = run(json!({"prompt": "x", "max_tokens": -1})).unwrap_err();
        assert_eq!((e.param.as_ref(), e.unsupported), ("max_tokens", false));
        assert_eq!(e.message, "max_tokens must be at least 1, got -1");
        let e = run(json!({"prompt": "x", "max_tokens": 2.5})).unwrap_err();
        assert_eq!(e.message, "max_tokens must be an integer, got 2.5");
        let e = run(json!({"prompt": "x", "stream": "yes"})).unwrap_err();
        assert_eq!(e.param, "stream");
        let e = run(json!({"prompt": "x", "temperature": "hot"})).unwrap_err();
        assert_eq!(e.message, "temperature must be a number, got \"hot\"");
        assert!(run(json!({"prompt": "x", "seed": u64::MAX})).is_ok());
    }

    #[test]
    fn null_means_the_default() {
        let obj = run(json!({"prompt": "x", "max_tokens": null, "tools": null})).unwrap();
        assert_eq!(obj.len(), 1);
    }
}
