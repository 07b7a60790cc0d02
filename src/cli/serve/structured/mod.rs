//! Structured output: a request's JSON schema, regular expression, Lark grammar or list of
//! choices compiled by llguidance into a per-choice [`Constraint`] whose token masks the
//! engine applies before sampling (`arbor_model::constraint`). A mask is a function of the
//! request's own generated tokens, so a constrained request keeps every bit promise: the
//! same output alone, under load, after a preemption and at every TP size.
//!
//! The request fields (docs/serving.md, *Structured output*): OpenAI's `response_format`
//! (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `choice`,
//! `grammar`, `json_object`) and its older `guided_json`, `guided_regex`, `guided_choice`,
//! `guided_grammar`, and SGLang's `json_schema`, `regex` and `ebnf` sampling parameters.
//! A grammar is in llguidance's Lark syntax or in GBNF (`root ::= ...`, llama.cpp's), which
//! [`gbnf`] writes as Lark, as both servers' llguidance backends read either.

pub mod gbnf;
mod vocab;

use std::borrow::Cow;
use std::sync::{Arc, Mutex, OnceLock};

use arbor_model::constraint::{Constraint, TokenConstraint, TokenMask};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use super::error::ApiError;

/// Largest schema, regex, grammar or list of choices a request may give (in bytes of its
/// JSON): far above a real schema, and a bound on the work compiling it may take.
pub const MAX_SPEC_BYTES: usize = 64 << 10;
/// Most `choice` entries.
pub const MAX_CHOICES: usize = 1024;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    /// Any JSON object.
    JsonObject,
    JsonSchema(Value),
    Regex(String),
    /// llguidance's Lark syntax (a GBNF grammar already written as Lark).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

/// A constraint and the request field it came from (errors name it).
#[derive(Debug, Clone, PartialEq)]
pub struct Requested {
    pub spec: Spec,
    pub param: Cow<'static, str>,
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::bad(param.to_string(), msg)
}

/// The size a spec's value takes in a request, bounded by [`MAX_SPEC_BYTES`].
fn bounded(param: &str, v: &Value) -> Result<(), ApiError> {
    let n = v.to_string().len();
    if n > MAX_SPEC_BYTES {
        return Err(bad(
            param,
            format!("{param} is {n} bytes, more than the {MAX_SPEC_BYTES} this server takes"),
        ));
    }
    Ok(())
}

fn string_of(param: &str, v: &Value) -> Result<String, ApiError> {
    bounded(param, v)?;
    match v {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        other => Err(bad(
            param,
            format!(
                "{param} must be a non-empty string, got {}",
                short(&other.to_string())
            ),
        )),
    }
}

fn short(s: &str) -> String {
    match s.char_indices().nth(60) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    }
}

/// A grammar in Lark or GBNF syntax, as Lark; a GBNF grammar that cannot be read is
/// refused naming the field.
fn grammar_of(param: &str, v: &Value) -> Result<Spec, ApiError> {
    let g = string_of(param, v)?;
    if !gbnf::is_gbnf(&g) {
        return Ok(Spec::Lark(g));
    }
    gbnf::to_lark(&g)
        .map(Spec::Lark)
        .map_err(|e| bad(param, format!("invalid GBNF grammar in {param}: {e}")))
}

/// A JSON schema given as an object or as its JSON text (SGLang and vLLM take both).
fn schema_of(param: &str, v: &Value) -> Result<Value, ApiError> {
    bounded(param, v)?;
    let schema = match v {
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| bad(param, format!("{param} is not valid JSON: {e}")))?,
        other => other.clone(),
    };
    match schema {
        Value::Object(_) => Ok(schema),
        other => Err(bad(
            param,
            format!(
                "{param} must be a JSON schema object, got {}",
                short(&other.to_string())
            ),
        )),
    }
}

fn choices_of(param: &str, v: &Value) -> Result<Vec<String>, ApiError> {
    bounded(param, v)?;
    let list = v.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
        bad(
            param,
            format!("{param} must be a non-empty list of strings"),
        )
    })?;
    if list.len() > MAX_CHOICES {
        return Err(bad(
            param,
            format!("{param} has more than {MAX_CHOICES} entries"),
        ));
    }
    list.iter()
        .map(|c| {
            c.as_str().map(str::to_string).ok_or_else(|| {
                bad(
                    param,
                    format!("{param} must list strings, got {}", short(&c.to_string())),
                )
            })
        })
        .collect()
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema`
/// with its `schema` (`name`, `description` and `strict` are accepted: the output always
/// follows the schema).
pub fn from_response_format(v: &Value) -> Result<Option<Requested>, ApiError> {
    let param: Cow<'static, str> = "response_format".into();
    bounded(&param, v)?;
    let kind = v["type"].as_str().ok_or_else(|| {
        bad(
            &param,
            "response_format must be an object with a \"type\": \"text\", \"json_object\" or \"json_schema\"",
        )
    })?;
    let obj = v.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>());
    if let Some(k) = obj
        .iter()
        .flatten()
        .find(|k| !matches!(k.as_str(), "type" | "json_schema"))
    {
        return Err(bad(
            &param,
            format!("the field {k:?} of response_format is not supported"),
        ));
    }
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Requested {
            spec: Spec::JsonObject,
            param,
        })),
        "json_schema" => {
            let js = &v["json_schema"];
            let p: Cow<'static, str> = "response_format.json_schema".into();
            let Some(o) = js.as_object() else {
                return Err(bad(
                    &p,
                    "response_format of type json_schema needs json_schema: {\"name\": ..., \"schema\": {...}}",
                ));
            };
            if let Some(k) = o
                .keys()
                .find(|k| !matches!(k.as_str(), "name" | "schema" | "strict" | "description"))
            {
                return Err(bad(
                    &p,
                    format!("the field {k:?} of response_format.json_schema is not supported"),
                ));
            }
            if !o.get("name").is_some_and(Value::is_string) {
                return Err(bad(&p, "response_format.json_schema needs a \"name\" string"));
            }
            let sp: Cow<'static, str> = "response_format.json_schema.schema".into();
            // OpenAI allows no schema (any JSON object).
            let spec = match o.get("schema") {
                None | Some(Value::Null) => Spec::JsonObject,
                Some(s) => Spec::JsonSchema(schema_of(&sp, s)?),
            };
            Ok(Some(Requested { spec, param: sp }))
        }
        other => Err(bad(
            &param,
            format!("response_format type {other:?} is not supported (text, json_object or json_schema)"),
        )),
    }
}

/// vLLM's `structured_outputs` object: one of `json`, `regex`, `choice`, `grammar`,
/// `json_object`.
pub fn from_structured_outputs(v: &Value) -> Result<Option<Requested>, ApiError> {
    let top: Cow<'static, str> = "structured_outputs".into();
    bounded(&top, v)?;
    let Some(o) = v.as_object() else {
        return Err(bad(&top, "structured_outputs must be an object"));
    };
    let mut found = None;
    for (k, x) in o {
        if x.is_null() || x == &Value::Bool(false) {
            continue;
        }
        let param: Cow<'static, str> = match k.as_str() {
            "json" => "structured_outputs.json".into(),
            "regex" => "structured_outputs.regex".into(),
            "choice" => "structured_outputs.choice".into(),
            "grammar" => "structured_outputs.grammar".into(),
            "json_object" => "structured_outputs.json_object".into(),
            // Engine choices and whitespace switches of vLLM's backends: one engine here.
            "backend" | "disable_fallback" | "disable_additional_properties" | "disable_any_whitespace" | "whitespace_pattern" => continue,
            other => {
                return Err(bad(
                    &top,
                    format!("the field {other:?} of structured_outputs is not supported (json, regex, choice, grammar, json_object)"),
                ))
            }
        };
        let spec = match k.as_str() {
            "json" => Spec::JsonSchema(schema_of(&param, x)?),
            "regex" => Spec::Regex(string_of(&param, x)?),
            "choice" => Spec::Choice(choices_of(&param, x)?),
            "grammar" => grammar_of(&param, x)?,
            _ => Spec::JsonObject,
        };
        if found.is_some() {
            return Err(bad(
                &top,
                "structured_outputs takes one of json, regex, choice, grammar or json_object",
            ));
        }
        found = Some(Requested { spec, param });
    }
    Ok(found)
}

/// vLLM's older top-level fields (`guided_json`, ...) and SGLang's sampling parameters
/// (`json_schema`, `regex`, `ebnf`), by name.
pub fn from_field(name: &'static str, v: &Value) -> Result<Requested, ApiError> {
    let param: Cow<'static, str> = name.into();
    let spec = match name {
        "guided_json" | "json_schema" => Spec::JsonSchema(schema_of(&param, v)?),
        "guided_regex" | "regex" => Spec::Regex(string_of(&param, v)?),
        "guided_choice" => Spec::Choice(choices_of(&param, v)?),
        "guided_grammar" | "ebnf" => grammar_of(&param, v)?,
        _ => return Err(bad(&param, format!("{name} is not supported"))),
    };
    Ok(Requested { spec, param })
}

/// At most one constraint per request: two fields that each ask for one are refused,
/// naming the second.
pub fn one_of(found: Vec<Requested>) -> Result<Option<Requested>, ApiError> {
    let mut it = found.into_iter();
    let first = it.next();
    if let Some(second) = it.next() {
        return Err(bad(
            &second.param,
            format!(
                "{} and {} both constrain the output: give one",
                first.as_ref().map_or("", |f| &f.param),
                second.param
            ),
        ));
    }
    Ok(first)
}

/// A regex matching exactly one of `choices`.
fn choice_regex(choices: &[String]) -> String {
    let escape = |s: &str| {
        let mut out = String::with_capacity(s.len() * 2);
        for c in s.chars() {
            if "\\.+*?()|[]{}^$#&-~ ".contains(c) {
                out.push('\\');
            }
            out.push(c);
        }
        out
    };
    choices
        .iter()
        .map(|c| format!("(?:{})", escape(c)))
        .collect::<Vec<_>>()
        .join("|")
}

impl Spec {
    /// llguidance's grammar. JSON is written as Python's `json.dumps` writes it (", " and
    /// ": ", no other whitespace), unless the schema says otherwise in its `x-guidance`.
    fn grammar(&self) -> TopLevelGrammar {
        let json = |mut schema: Value| {
            if let Some(o) = schema.as_object_mut() {
                o.entry("x-guidance").or_insert_with(|| {
                    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
                });
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        match self {
            Spec::JsonObject => json(json!({"type": "object"})),
            Spec::JsonSchema(s) => json(s.clone()),
            Spec::Regex(r) => TopLevelGrammar::from_regex(r),
            Spec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Spec::Choice(c) => TopLevelGrammar::from_regex(&choice_regex(c)),
        }
    }

    fn what(&self) -> &'static str {
        match self {
            Spec::JsonObject | Spec::JsonSchema(_) => "JSON schema",
            Spec::Regex(_) | Spec::Choice(_) => "regular expression",
            Spec::Lark(_) => "grammar",
        }
    }
}

/// llguidance's view of the served tokenizer, made on the first constrained request (the
/// trie over a large vocabulary takes a moment; servers that never constrain never pay).
pub struct Engine {
    tokenizer: Option<tokenizers::Tokenizer>,
    vocab: usize,
    eos: Vec<u32>,
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
}

impl Engine {
    pub fn new(tokenizer: Option<tokenizers::Tokenizer>, vocab: usize, eos: Vec<u32>) -> Self {
        Engine {
            tokenizer,
            vocab,
            eos,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<Arc<ParserFactory>, String> {
        self.factory
            .get_or_init(|| {
                let tok = self.tokenizer.clone().ok_or(
                    "structured output needs the model's tokenizer (tokenizer.json), which this model lacks",
                )?;
                let env = vocab::Env::new(tok, self.vocab, &self.eos)?;
                let mut f = ParserFactory::new_simple(&(Arc::new(env) as llguidance::toktrie::TokEnv))
                    .map_err(|e| format!("cannot build the constrained-decoding tables: {e}"))?;
                f.quiet();
                *f.limits_mut() = ParserLimits {
                    // Errors name what was wrong without echoing the whole grammar.
                    verbose_errors: false,
                    ..ParserLimits::default()
                };
                Ok(Arc::new(f))
            })
            .clone()
    }

    /// Compiles `req` (blocking: a large schema takes milliseconds to seconds). 400 naming
    /// the field for a schema, regex or grammar llguidance refuses; 400 too where the model
    /// cannot be constrained (no tokenizer, one of unknown spelling).
    pub fn compile(&self, req: &Requested) -> Result<Compiled, ApiError> {
        let factory = self
            .factory()
            .map_err(|e| bad(&req.param, e).with_code("structured_output_unavailable"))?;
        let grammar = req.spec.grammar();
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            factory.create_parser(grammar)
        }))
        .map_err(|_| {
            bad(
                &req.param,
                format!("the {} cannot be compiled", req.spec.what()),
            )
        })?
        .map_err(|e| {
            bad(
                &req.param,
                format!("invalid {} in {}: {e}", req.spec.what(), req.param),
            )
        })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(bad(
                &req.param,
                format!("invalid {} in {}: {e}", req.spec.what(), req.param),
            ));
        }
        Ok(Compiled {
            matcher,
            vocab: self.vocab,
            param: req.param.clone(),
        })
    }
}

/// A compiled constraint, from which every choice of the request starts.
pub struct Compiled {
    matcher: Matcher,
    vocab: usize,
    pub param: Cow<'static, str>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Compiled({})", self.param)
    }
}

/// What a choice's constraint ran into: the error of a grammar that failed mid-way
/// (llguidance's limits), read by the request when the choice ends.
#[derive(Debug, Clone, Default)]
pub struct Failure(Arc<Mutex<Option<String>>>);

impl Failure {
    pub fn get(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Compiled {
    /// A fresh constraint for one choice, and where it reports a failure.
    pub fn start(&self) -> (Constraint, Failure) {
        let failure = Failure::default();
        let g = Guided {
            initial: self.matcher.clone(),
            cur: self.matcher.clone(),
            consumed: Vec::new(),
            vocab: self.vocab,
            failure: failure.clone(),
        };
        (Constraint::new(g), failure)
    }
}

/// One choice's matcher, advanced over its generated tokens.
struct Guided {
    initial: Matcher,
    cur: Matcher,
    consumed: Vec<u32>,
    vocab: usize,
    failure: Failure,
}

impl Guided {
    fn fail(&mut self, what: String) -> TokenMask {
        let mut f = self.failure.0.lock().unwrap_or_else(|e| e.into_inner());
        f.get_or_insert(what);
        drop(f);
        // Only end-of-sequence: the choice ends here, and the request reports why.
        let eos = self
            .cur
            .tok_env()
            .or_else(|_| self.initial.tok_env())
            .map(|env| env.tok_trie().eos_token_set())
            .ok();
        match eos {
            Some(v) => TokenMask::from_bits(v.as_slice().to_vec(), self.vocab),
            None => TokenMask::from_ids(&[], self.vocab),
        }
    }
}

impl TokenConstraint for Guided {
    fn allowed(&mut self, generated: &[u32]) -> TokenMask {
        if self.failure.get().is_some() {
            return self.fail(String::new());
        }
        if !generated.starts_with(&self.consumed) {
            // Run again from the prompt (a restart after new weights): start over.
            self.cur = self.initial.clone();
            self.consumed.clear();
        }
        for &t in &generated[self.consumed.len()..] {
            if self.cur.is_stopped() {
                // Past the grammar's end (ignore_eos): nothing more to follow.
                break;
            }
            if let Err(e) = self.cur.consume_token(t) {
                let n = self.consumed.len();
                return self.fail(format!(
                    "the constraint rejected token {t} after {n} generated tokens: {e}"
                ));
            }
            self.consumed.push(t);
        }
        self.consumed.truncate(generated.len());
        match self.cur.compute_mask_or_eos() {
            Ok(v) if v.num_set() > 0 => TokenMask::from_bits(v.as_slice().to_vec(), self.vocab),
            Ok(_) => self.fail(format!(
                "the constraint allows no token after {} generated tokens",
                generated.len()
            )),
            Err(e) => self.fail(format!(
                "the constraint failed after {} generated tokens: {e}",
                generated.len()
            )),
        }
    }
    /// A grammar's mask costs tens to hundreds of microseconds a row: computed while the
    /// step's forward runs. `allowed` always gives one.
    fn masks_later(&mut self, _generated: &[u32]) -> bool {
        true
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn response_formats() {
        assert_eq!(
            from_response_format(&json!({"type": "text"})).unwrap(),
            None
        );
        let r = from_response_format(&json!({"type": "json_object"}))
            .unwrap()
            .unwrap();
        assert_eq!(r.spec, Spec::JsonObject);
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let r = from_response_format(
            &json!({"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": true}}),
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.spec, Spec::JsonSchema(s));
        assert_eq!(r.param, "response_format.json_schema.schema");
        let e = from_response_format(&json!({"type": "xml"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format"));
        let e =
            from_response_format(&json!({"type": "json_schema", "json_schema": {"schema": {}}}))
                .unwrap_err();
        assert!(e.message.contains("\"name\""), "{}", e.message);
        let e = from_response_format(
            &json!({"type": "json_schema", "json_schema": {"name": "x", "schema": "[1"}}),
        )
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("response_format.json_schema.schema")
        );
        let big = "x".repeat(MAX_SPEC_BYTES + 1);
        let e = from_field("guided_regex", &json!(big)).unwrap_err();
        assert!(e.message.contains("more than"), "{}", e.message);
    }

    #[test]
    fn vllm_fields_and_one_constraint_per_request() {
        let r = from_structured_outputs(&json!({"regex": "a+", "backend": "x"}))
            .unwrap()
            .unwrap();
        assert_eq!(
            (r.spec, r.param.as_ref()),
            (Spec::Regex("a+".into()), "structured_outputs.regex")
        );
        let e = from_structured_outputs(&json!({"regex": "a", "choice": ["b"]})).unwrap_err();
        assert!(e.message.contains("one of"), "{}", e.message);
        let e = from_structured_outputs(&json!({"structural_tag": "x"})).unwrap_err();
        assert!(e.message.contains("structural_tag"), "{}", e.message);
        let e = from_field("guided_choice", &json!([])).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_choice"));
        let a = from_field("guided_regex", &json!("a")).unwrap();
        let b = from_field("guided_json", &json!({"type": "string"})).unwrap();
        let e = one_of(vec![a.clone(), b]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_json"));
        assert_eq!(one_of(vec![a.clone()]).unwrap(), Some(a));
    }

    /// A byte-level tokenizer of the 256 bytes and two specials (256 BOS, 257 EOS), as
    /// `arbor make-model` writes, in a vocabulary padded to 300.
    pub(crate) fn byte_engine() -> Engine {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut next = 0x100u32;
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            let c = if printable(b) {
                b as char
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            };
            vocab.insert(c.to_string(), json!(b));
        }
        let special = |id: u32, content: &str| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        };
        let t = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(256, "<|begin_of_text|>"), special(257, "<|end_of_text|>")],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": false, "vocab": vocab, "merges": []}
        });
        let tok = tokenizers::Tokenizer::from_bytes(t.to_string().as_bytes()).unwrap();
        Engine::new(Some(tok), 300, vec![257])
    }

    /// Follows a constraint, choosing at every step the allowed token that `pick` prefers,
    /// until it allows only EOS (257) or `max` tokens; the text and whether it ended.
    pub(crate) fn follow(
        c: &Constraint,
        max: usize,
        pick: impl Fn(&[u32], usize) -> u32,
    ) -> (String, bool) {
        let mut out: Vec<u32> = Vec::new();
        for step in 0..max {
            let m = c.allowed(&out);
            let allowed: Vec<u32> = (0..300).filter(|&t| m.allows(t)).collect();
            assert!(!allowed.is_empty());
            assert!(allowed.iter().all(|&t| t < 256 || t == 257), "{allowed:?}");
            let t = pick(&allowed, step);
            if t == 257 {
                return (
                    String::from_utf8_lossy(&out.iter().map(|&t| t as u8).collect::<Vec<_>>())
                        .into_owned(),
                    true,
                );
            }
            out.push(t);
        }
        (
            String::from_utf8_lossy(&out.iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned(),
            false,
        )
    }

    #[test]
    fn a_regex_and_a_schema_are_followed_to_their_end() {
        let e = byte_engine();
        let re = from_field("guided_regex", &json!("(yes|no)-[0-9]{2}")).unwrap();
        let c = e.compile(&re).unwrap();
        // Always the last allowed token: EOS (257) as soon as the regex may end.
        let (text, ended) = follow(&c.start().0, 20, |a, _| *a.last().unwrap());
        assert!(ended);
        assert!(text == "yes-99" || text == "no-99", "{text}");
        // The first allowed one: never EOS while a byte may follow.
        let (text, ended) = follow(&c.start().0, 20, |a, _| a[0]);
        assert_eq!((text.as_str(), ended), ("no-00", true));

        let schema = json!({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 3},
            "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["name", "n"], "additionalProperties": false});
        let r = from_field("guided_json", &schema).unwrap();
        let c = e.compile(&r).unwrap();
        let mut ended_once = false;
        for k in 0..5usize {
            // A varied walk that takes EOS as soon as it is allowed.
            let (text, ended) = follow(&c.start().0, 200, |a, step| {
                if a.contains(&257) {
                    257
                } else {
                    a[(step * 7 + k) % a.len()]
                }
            });
            assert!(ended, "{text}");
            ended_once = true;
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(
                v["name"].as_str().is_some_and(|s| s.chars().count() <= 3),
                "{v}"
            );
            assert!(v["n"].as_i64().is_some_and(|n| (0..=9).contains(&n)), "{v}");
            assert_eq!(v.as_object().map(|o| o.len()), Some(2), "{v}");
        }
        assert!(ended_once);
    }

    #[test]
    fn a_restart_from_the_prompt_starts_over() {
        let e = byte_engine();
        let c = e
            .compile(&from_field("guided_choice", &json!(["ab", "cd"])).unwrap())
            .unwrap();
        let (con, failure) = c.start();
        let first = con.allowed(&[]);
        assert!(first.allows(b'a' as u32) && first.allows(b'c' as u32) && !first.allows(257));
        assert_eq!(
            con.allowed(&[b'a' as u32]),
            TokenMask::Ids(vec![b'b' as u32])
        );
        // A different history (run again from the prompt): the mask of that history.
        assert_eq!(
            con.allowed(&[b'c' as u32]),
            TokenMask::Ids(vec![b'd' as u32])
        );
        assert_eq!(con.allowed(&[]), first);
        assert_eq!(
            con.allowed(&[b'c' as u32, b'd' as u32]),
            TokenMask::Ids(vec![257])
        );
        assert_eq!(failure.get(), None);
        // A token the constraint never allowed is a failure, reported, and ends the choice.
        let m = con.allowed(&[b'x' as u32]);
        assert_eq!(m, TokenMask::Ids(vec![257]));
        assert!(
            failure.get().is_some_and(|f| f.contains("token 120")),
            "{:?}",
            failure.get()
        );
    }

    #[test]
    fn bad_schemas_regexes_and_grammars_name_their_field() {
        let e = byte_engine();
        let r = from_field("guided_regex", &json!("(unclosed")).unwrap();
        let err = e.compile(&r).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("guided_regex"));
        assert!(
            err.message.contains("regular expression"),
            "{}",
            err.message
        );
        let r = from_field("guided_json", &json!({"type": "no-such-type"})).unwrap();
        let err = e.compile(&r).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("guided_json"), "{}", err.message);
        let r = from_field("guided_grammar", &json!("start: undefined_rule")).unwrap();
        let err = e.compile(&r).unwrap_err();
        assert_eq!(
            err.param.as_deref(),
            Some("guided_grammar"),
            "{}",
            err.message
        );
        let none = Engine::new(None, 300, vec![257]);
        let err = none
            .compile(&from_field("guided_regex", &json!("a")).unwrap())
            .unwrap_err();
        assert!(err.message.contains("tokenizer"), "{}", err.message);
    }

    /// Whether `s` is a sum or difference of numbers without leading zeros, parenthesised
    /// at will: the arithmetic grammar below.
    fn is_sum(s: &str) -> bool {
        fn expr(b: &[u8], i: &mut usize) -> bool {
            if !term(b, i) {
                return false;
            }
            while *i < b.len() && (b[*i] == b'+' || b[*i] == b'-') {
                *i += 1;
                if !term(b, i) {
                    return false;
                }
            }
            true
        }
        fn term(b: &[u8], i: &mut usize) -> bool {
            if b.get(*i) == Some(&b'(') {
                *i += 1;
                return expr(b, i) && b.get(*i) == Some(&b')') && {
                    *i += 1;
                    true
                };
            }
            let start = *i;
            while b.get(*i).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            }
            let n = *i - start;
            n > 0 && n <= 4 && (n == 1 || b[start] != b'0')
        }
        let mut i = 0;
        expr(s.as_bytes(), &mut i) && i == s.len()
    }

    #[test]
    fn gbnf_and_lark_grammars_are_followed() {
        let e = byte_engine();
        let gbnf = "root ::= expr\nexpr ::= term ((\"+\" | \"-\") term)*\n\
                    term ::= num | \"(\" expr \")\"\nnum ::= [1-9] [0-9]{0,3} | \"0\"\n";
        let lark = "start: expr\nexpr: term ((\"+\" | \"-\") term)*\n\
                    term: num | \"(\" expr \")\"\nnum: /[1-9][0-9]{0,3}/ | \"0\"\n";
        for (field, g) in [
            ("ebnf", gbnf),
            ("guided_grammar", gbnf),
            ("guided_grammar", lark),
        ] {
            let c = e.compile(&from_field(field, &json!(g)).unwrap()).unwrap();
            let mut seen = std::collections::HashSet::new();
            for k in 0..12usize {
                // Varied walks; EOS taken once the text is 12 bytes or more.
                let (text, ended) = follow(&c.start().0, 64, |a, step| {
                    if a.contains(&257) && (step >= 12 || k % 3 == 0) {
                        257
                    } else {
                        let a: Vec<u32> = a.iter().copied().filter(|&t| t != 257).collect();
                        a[(step * 5 + k * 3) % a.len()]
                    }
                });
                assert!(ended && is_sum(&text), "{field}: {text:?}");
                seen.insert(text);
            }
            assert!(seen.len() > 3, "{seen:?}");
        }
        // Alternatives that share a prefix: both reachable.
        let c = e
            .compile(&from_field("ebnf", &json!("root ::= (\"a\" | \"ab\") \"c\"")).unwrap())
            .unwrap();
        let (con, _) = c.start();
        let m = con.allowed(&[b'a' as u32]);
        assert!(m.allows(b'b' as u32) && m.allows(b'c' as u32), "{m:?}");
        assert_eq!(
            con.allowed(&[b'a' as u32, b'b' as u32]),
            TokenMask::Ids(vec![b'c' as u32])
        );
        // A GBNF grammar that cannot be read, or llguidance refuses, names its field.
        let err = from_field("ebnf", &json!("root ::= undefined-rule")).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("ebnf"));
        assert!(err.message.contains("undefined-rule"), "{}", err.message);
        let r = from_structured_outputs(&json!({"grammar": "root ::= [a-z]{5,2}"}));
        let err = r.unwrap_err();
        assert_eq!(err.param.as_deref(), Some("structured_outputs.grammar"));
        let r = from_field("ebnf", &json!("root ::= \"a\"{0,0}")).unwrap();
        let err = e.compile(&r).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("ebnf"), "{}", err.message);
    }

    #[test]
    fn choices_become_an_exact_alternation() {
        let re = choice_regex(&["a.b".into(), "c d".into()]);
        assert_eq!(re, r"(?:a\.b)|(?:c\ d)");
    }
}
