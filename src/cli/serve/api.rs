//! The OpenAI request bodies arbor accepts and their validation.

use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::Deserialize;

use super::chat::Message;
pub use super::error::ApiError;
use super::fields::{self, Kind};

/// A request body type and the fields it accepts (serde's `deny_unknown_fields` does not
/// work with `flatten`).
pub trait Body: serde::de::DeserializeOwned {
    const FIELDS: &'static [&'static str];
    /// Whether the sampling fields both generation endpoints share (`COMMON_FIELDS`) belong.
    const SAMPLING: bool = true;
    /// The values checked before serde reads the body (`fields::check`), so that a bad
    /// one names its field; serde checks the others.
    const KINDS: &'static [(&'static str, Kind)] = &[];
}

const COMMON_FIELDS: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "top_k",
    "ignore_eos",
    "sample_id",
    "prompt_logprobs",
    "rid",
    // vLLM's fields that keep the output's bits (docs/serving.md).
    "return_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "stop_token_ids",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "cache_salt",
    // Structured output (docs/serving.md): OpenAI's, then vLLM's.
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
];

impl Body for CompletionRequest {
    const FIELDS: &'static [&'static str] = &[
        "prompt",
        "max_tokens",
        "logprobs",
        "echo",
        "best_of",
        "suffix",
    ];
    const KINDS: &'static [(&'static str, Kind)] = fields::COMPLETION_KINDS;
}

impl Body for ChatRequest {
    const FIELDS: &'static [&'static str] = &[
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "add_generation_prompt",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    ];
    const KINDS: &'static [(&'static str, Kind)] = fields::CHAT_KINDS;
}

/// The error for a request body axum could not read (over the size limit, or cut off).
pub fn body_error(e: BytesRejection) -> ApiError {
    let status = e.status();
    let msg = if status == StatusCode::PAYLOAD_TOO_LARGE {
        "the request body is too large".to_string()
    } else {
        format!("cannot read the request body: {}", e.body_text())
    };
    ApiError::new(status, msg)
}

/// Parses a JSON body: every refusal is 400 and names what was wrong (malformed JSON, not
/// an object, a field that is not supported, a value of the wrong type or range: see
/// `fields::check`; what serde still refuses, such as a missing field).
pub fn parse_body<T: Body>(bytes: &[u8]) -> Result<T, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")))?;
    let serde_json::Value::Object(mut obj) = v else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "the request body must be a JSON object",
        ));
    };
    let common: &[&str] = if T::SAMPLING { COMMON_FIELDS } else { &[] };
    let common_kinds: &[(&str, Kind)] = if T::SAMPLING {
        fields::COMMON_KINDS
    } else {
        &[]
    };
    fields::check(&mut obj, &[T::FIELDS, common], &[T::KINDS, common_kinds]).map_err(|r| {
        let e = ApiError::bad(r.param, r.message);
        match r.unsupported {
            true => e.with_code("unsupported_parameter"),
            false => e,
        }
    })?;
    serde_json::from_value(serde_json::Value::Object(obj))
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("invalid request: {e}")))
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    /// vLLM's: usage in every chunk, when `include_usage` is set too.
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// Sampling and output fields both endpoints share (OpenAI's, then arbor's extensions).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<usize>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// Accepted for OpenAI compatibility; not used.
    #[allow(dead_code)]
    pub user: Option<String>,
    /// Extension: keep the K most likely tokens (0 or -1 = off).
    pub top_k: Option<i64>,
    /// Extension: keep generating past end-of-sequence.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Extension: the id sampling is keyed by; choice i uses `sample_id + i` (default 0,
    /// which makes choice 0 equal to `arbor generate` of a prompt with id 0).
    pub sample_id: Option<u64>,
    /// Extension: teacher-forced log-probs of the prompt (= `arbor score`).
    #[serde(default)]
    pub prompt_logprobs: bool,
    /// Extension: the request's id (the response's `id`), which `/abort_request` names.
    pub rid: Option<String>,
    /// vLLM: token ids are always returned (`token_ids`).
    #[allow(dead_code)]
    pub return_token_ids: Option<bool>,
    /// Special tokens in the text (default: skipped).
    pub skip_special_tokens: Option<bool>,
    /// A matched stop string or stop token stays in the text.
    #[serde(default)]
    pub include_stop_str_in_output: bool,
    /// Tokens that end a choice (finish_reason "stop"), even with `ignore_eos`.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Only their neutral values: each other value changes the draw.
    pub min_p: Option<f32>,
    /// Tokens a choice generates before its stop tokens may be drawn.
    pub min_tokens: Option<usize>,
    pub repetition_penalty: Option<f32>,
    /// A prefix-cache namespace: the cache never changes a result's bits, so any value
    /// gives the same output.
    #[allow(dead_code)]
    pub cache_salt: Option<String>,
    /// Structured output: OpenAI's `response_format`, vLLM's `structured_outputs` and its
    /// older `guided_*` fields (`structured::from_*`).
    pub response_format: Option<serde_json::Value>,
    pub structured_outputs: Option<serde_json::Value>,
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<serde_json::Value>,
    pub guided_choice: Option<serde_json::Value>,
    pub guided_grammar: Option<serde_json::Value>,
}

/// What a matched stop string or stop token leaves in the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopTrim {
    /// The text ends before the match (OpenAI, vLLM and SGLang's default).
    Before,
    /// The text ends after the match (vLLM's `include_stop_str_in_output`).
    After,
    /// The whole decoded text (SGLang's `no_stop_trim`).
    Keep,
}

/// Most `stop_token_ids`.
pub const MAX_STOP_TOKENS: usize = 64;

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    pub max_tokens: Option<usize>,
    /// Top-N alternatives per token (0..=20); token log-probs whenever present.
    pub logprobs: Option<usize>,
    #[serde(default)]
    pub echo: bool,
    pub best_of: Option<usize>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<usize>,
    pub add_generation_prompt: Option<bool>,
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub common: Common,
}

/// The validated parameters of one request.
#[derive(Debug, Clone)]
pub struct Params {
    pub max_tokens: usize,
    pub sampling: arbor_model::Sampling,
    pub n: usize,
    pub stop: Vec<String>,
    /// Token log-probs with this many alternatives (None: no log-probs).
    pub logprobs: Option<usize>,
    pub echo: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// Usage in every streamed chunk (`stream_options.continuous_usage_stats`).
    pub continuous_usage: bool,
    /// Whether the request gave its `seed` (else the server picks one: `AppState::seed`).
    pub seeded: bool,
    pub ignore_eos: bool,
    pub sample_id: u64,
    pub prompt_logprobs: bool,
    pub rid: Option<String>,
    pub stop_token_ids: Vec<u32>,
    /// vLLM's `min_tokens`: until a choice has this many tokens, its stop tokens cannot
    /// be drawn and its stop strings do not match (`constraint::MinTokens`).
    pub min_tokens: usize,
    pub stop_trim: StopTrim,
    /// Special tokens are left out of the text.
    pub skip_special: bool,
    /// The output's constraint (structured output, a forced tool call).
    pub constraint: Option<std::sync::Arc<super::structured::Compiled>>,
    /// Chat with tools: the format its replies' calls are parsed in.
    pub tool_format: Option<super::tools::Format>,
    /// Report every fed token's routed experts (SGLang's `return_routed_experts`).
    pub routes: bool,
}

/// Longest `rid`.
pub const MAX_RID_LEN: usize = 256;

pub const MAX_TOP_LOGPROBS: usize = 20;

impl Params {
    /// How many sequences a request of `prompts` prompts runs (one per prompt and choice):
    /// a bad request when more than `max_queue` (it could never be admitted, so "retry
    /// later" would be wrong) or when the last one's sample id (`sample_id + index`) is
    /// past 2^64 - 1.
    pub fn sequences(&self, prompts: usize, max_queue: usize) -> Result<usize, ApiError> {
        let total = prompts.saturating_mul(self.n);
        if total > max_queue {
            let (param, what) = if prompts > 1 {
                ("prompt", format!("{prompts} prompts × n {}", self.n))
            } else {
                ("n", format!("n {}", self.n))
            };
            return Err(ApiError::bad(
                param,
                format!("{what} = {total} sequences, more than the server queues at once (--max-queue {max_queue}); split the request"),
            ));
        }
        if self
            .sample_id
            .checked_add(total.saturating_sub(1) as u64)
            .is_none()
        {
            return Err(ApiError::bad(
                "sample_id",
                format!(
                    "sample_id {} + {} choices passes 2^64 - 1 (choice i is keyed by sample_id + i)",
                    self.sample_id, total
                ),
            ));
        }
        Ok(total)
    }
}

impl Common {
    /// Validates everything but the token limits; `max_n` bounds `n`.
    pub fn params(
        &self,
        max_tokens: usize,
        logprobs: Option<usize>,
        max_n: usize,
    ) -> Result<Params, ApiError> {
        let temperature = self.temperature.unwrap_or(1.0);
        if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
            return Err(ApiError::bad(
                "temperature",
                format!("temperature must be in [0, 2], got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::bad(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match self.top_k.unwrap_or(0) {
            -1 | 0 => 0,
            k if k > 0 => k as usize,
            k => {
                return Err(ApiError::bad(
                    "top_k",
                    format!("top_k must be -1, 0 or positive, got {k}"),
                ))
            }
        };
        let n = self.n.unwrap_or(1);
        if n == 0 || n > max_n {
            return Err(ApiError::bad(
                "n",
                format!("n must be in 1..={max_n}, got {n}"),
            ));
        }
        let seed = match self.seed {
            None => 0,
            Some(s) if s >= 0 => s as u64,
            Some(s) => return Err(ApiError::bad("seed", format!("seed must be >= 0, got {s}"))),
        };
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if v.is_some_and(|v| v != 0.0) {
                return Err(ApiError::bad(
                    name,
                    format!("{name} is not supported (only 0)"),
                ));
            }
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::bad("logit_bias", "logit_bias is not supported"));
        }
        neutral("min_p", self.min_p, 0.0)?;
        neutral("repetition_penalty", self.repetition_penalty, 1.0)?;
        let stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
        if stop_token_ids.len() > MAX_STOP_TOKENS {
            return Err(ApiError::bad(
                "stop_token_ids",
                format!("at most {MAX_STOP_TOKENS} stop_token_ids"),
            ));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        };
        if stop.len() > 4 || stop.iter().any(|s| s.is_empty()) {
            return Err(ApiError::bad(
                "stop",
                "stop takes at most 4 non-empty strings",
            ));
        }
        if let Some(rid) = &self.rid {
            if rid.is_empty() || rid.len() > MAX_RID_LEN || rid.chars().any(|c| c.is_control()) {
                return Err(ApiError::bad(
                    "rid",
                    format!("rid must be 1 to {MAX_RID_LEN} bytes without control characters"),
                ));
            }
        }
        if logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return Err(ApiError::bad(
                "logprobs",
                format!("at most {MAX_TOP_LOGPROBS} top log-probs"),
            ));
        }
        Ok(Params {
            max_tokens,
            sampling: arbor_model::Sampling {
                temperature,
                top_k,
                top_p,
                seed,
            },
            n,
            stop,
            logprobs,
            echo: false,
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            // As vLLM: per-chunk usage only where usage was asked for at all.
            continuous_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage && o.continuous_usage_stats),
            seeded: self.seed.is_some(),
            ignore_eos: self.ignore_eos,
            sample_id: self.sample_id.unwrap_or(0),
            prompt_logprobs: self.prompt_logprobs,
            rid: self.rid.clone(),
            stop_token_ids,
            min_tokens: self.min_tokens.unwrap_or(0),
            stop_trim: if self.include_stop_str_in_output {
                StopTrim::After
            } else {
                StopTrim::Before
            },
            skip_special: self.skip_special_tokens.unwrap_or(true),
            constraint: None,
            tool_format: None,
            routes: false,
        })
    }

    /// The output constraint the request asks for, at most one (400 naming the field of a
    /// bad or second one).
    pub fn requested(&self) -> Result<Option<super::structured::Requested>, ApiError> {
        use super::structured as s;
        let mut found = Vec::new();
        if let Some(v) = &self.response_format {
            found.extend(s::from_response_format(v)?);
        }
        if let Some(v) = &self.structured_outputs {
            found.extend(s::from_structured_outputs(v)?);
        }
        for (name, v) in [
            ("guided_json", &self.guided_json),
            ("guided_regex", &self.guided_regex),
            ("guided_choice", &self.guided_choice),
            ("guided_grammar", &self.guided_grammar),
        ] {
            if let Some(v) = v {
                found.push(s::from_field(name, v)?);
            }
        }
        s::one_of(found)
    }
}

/// A sampling field that arbor takes only at its neutral value (any other changes the
/// draw, which arbor does not implement): 400 naming it.
pub fn neutral(name: &'static str, v: Option<f32>, off: f32) -> Result<(), ApiError> {
    match v {
        Some(x) if x != off => Err(ApiError::bad(
            name,
            format!("{name} is not supported (only {off}, got {x}): it changes the output"),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_and_misshapen_bodies() {
        let e = parse_body::<CompletionRequest>(b"{\"prompt\": ").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = parse_body::<CompletionRequest>(br#"{"prompt": "x", "max_tokns": 3}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("max_tokns"));
        assert!(e.message.contains("not supported"), "{}", e.message);
        let e =
            parse_body::<CompletionRequest>(br#"{"prompt": "x", "max_tokens": -1}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.message, "max_tokens must be at least 0, got -1");
        let e = parse_body::<ChatRequest>(br#"{"messages": [], "max_tokens": -1}"#).unwrap_err();
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (Some("max_tokens"), "max_tokens must be at least 1, got -1")
        );
        for f in ["functions", "audio", "modalities"] {
            let body = format!(r#"{{"messages": [], "{f}": {{}}}}"#);
            let e = parse_body::<ChatRequest>(body.as_bytes()).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (StatusCode::BAD_REQUEST, Some(f))
            );
        }
        let e = parse_body::<CompletionRequest>(br#"[1]"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let r = parse_body::<CompletionRequest>(
            br#"{"prompt": "x", "max_tokens": null, "echo": null, "stream_options": {"include_usage": true, "continuous_usage_stats": true}}"#,
        )
        .unwrap();
        let p = r.common.params(16, None, 4).unwrap();
        assert!(p.include_usage && p.continuous_usage && !p.seeded);
        let r = parse_body::<CompletionRequest>(
            br#"{"prompt": [1, 2], "temperature": 0.5, "top_k": 3, "stop": "x"}"#,
        )
        .unwrap();
        assert!(matches!(r.prompt, PromptInput::Tokens(ref t) if t == &[1, 2]));
        let p = r.common.params(16, None, 4).unwrap();
        assert_eq!(
            (p.sampling.top_k, p.stop.clone()),
            (3, vec!["x".to_string()])
        );
    }

    #[test]
    fn bad_sampling_values_name_the_parameter() {
        let c = |json: &str| {
            parse_body::<CompletionRequest>(json.as_bytes())
                .unwrap()
                .common
        };
        let e = c(r#"{"prompt":"x","temperature":-1}"#)
            .params(1, None, 4)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = c(r#"{"prompt":"x","top_p":0}"#)
            .params(1, None, 4)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_p"));
        let e = c(r#"{"prompt":"x","n":5}"#).params(1, None, 4).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = c(r#"{"prompt":"x"}"#).params(1, Some(21), 4).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        let e = parse_body::<CompletionRequest>(br#"{"prompt":"x","min_tokens":-1}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("min_tokens"));
        let p = c(r#"{"prompt":"x","min_tokens":3}"#)
            .params(8, None, 4)
            .unwrap();
        assert_eq!(p.min_tokens, 3);
        assert_eq!(
            c(r#"{"prompt":"x"}"#)
                .params(8, None, 4)
                .unwrap()
                .min_tokens,
            0
        );
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn sequences_beyond_the_queue_or_the_sample_ids_are_refused() {
        let p = |json: &str| {
            parse_body::<CompletionRequest>(json.as_bytes())
                .unwrap()
                .common
                .params(1, None, 16)
                .unwrap()
        };
        assert_eq!(p(r#"{"prompt":"x","n":3}"#).sequences(2, 6).ok(), Some(6));
        let e = p(r#"{"prompt":"x","n":3}"#).sequences(1, 2).unwrap_err();
        assert_eq!(
            (e.status, e.param.as_deref()),
            (StatusCode::BAD_REQUEST, Some("n"))
        );
        let e = p(r#"{"prompt":"x"}"#).sequences(300, 256).unwrap_err();
        assert_eq!(
            (e.status, e.param.as_deref()),
            (StatusCode::BAD_REQUEST, Some("prompt"))
        );
        assert!(e.message.contains("300"), "{}", e.message);
        let max = u64::MAX;
        assert_eq!(
            p(&format!(r#"{{"prompt":"x","sample_id":{max}}}"#))
                .sequences(1, 8)
                .ok(),
            Some(1)
        );
        let e = p(&format!(r#"{{"prompt":"x","n":2,"sample_id":{max}}}"#))
            .sequences(1, 8)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("sample_id"));
        let e = p(&format!(r#"{{"prompt":"x","sample_id":{}}}"#, max - 1))
            .sequences(3, 8)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("sample_id"));
    }
}
