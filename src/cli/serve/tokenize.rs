//! vLLM's tokenizer routes, so that clients such as lm-eval-harness (`local-completions`,
//! whose default tokenizer backend probes them) use the served model's own tokenizer with
//! no setup: `POST /tokenize` (text as `/v1/completions` encodes it, or chat messages as
//! `/v1/chat/completions` renders them), `POST /detokenize` and `GET /tokenizer_info`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{body_error, parse_body, ApiError, Body};
use super::chat::Message;
use super::fields::Kind;
use super::state::AppState;

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Message>>,
    /// Default: true for `prompt` (as `/v1/completions`), false for `messages` (the
    /// template writes them), as vLLM.
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub return_token_strs: bool,
    /// With `messages`: the tools the template shows, as `/v1/chat/completions` passes
    /// them (vLLM's field).
    pub tools: Option<Value>,
}

impl Body for TokenizeRequest {
    const FIELDS: &'static [&'static str] = &[
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "return_token_strs",
        "tools",
    ];
    const SAMPLING: bool = false;
    const KINDS: &'static [(&'static str, Kind)] = &[
        ("model", Kind::Str),
        ("prompt", Kind::Str),
        ("add_special_tokens", Kind::Bool),
        ("add_generation_prompt", Kind::Bool),
        ("return_token_strs", Kind::Bool),
    ];
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

impl Body for DetokenizeRequest {
    const FIELDS: &'static [&'static str] = &["model", "tokens"];
    const SAMPLING: bool = false;
    const KINDS: &'static [(&'static str, Kind)] = &[("model", Kind::Str)];
}

fn no_tokenizer() -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "this model has no tokenizer.json: the tokenizer routes need one",
    )
    .with_code("tokenizer_unavailable")
}

pub(super) async fn tokenize(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        st.accepting()?;
        let req: TokenizeRequest = parse_body(&body.map_err(body_error)?)?;
        st.check_model(req.model.as_deref())?;
        let tokens = match (&req.prompt, &req.messages) {
            (Some(text), None) => st.encode(text, req.add_special_tokens.unwrap_or(true))?,
            (None, Some(messages)) => {
                if messages.is_empty() {
                    return Err(ApiError::bad("messages", "messages is empty"));
                }
                let tools = super::tools::Tools::from_request(req.tools.as_ref(), None, None)?;
                let text = st
                    .chat_template()?
                    .render_with_tools(
                        messages,
                        req.add_generation_prompt.unwrap_or(true),
                        tools.as_ref().map(|t| &t.list[..]),
                    )
                    .map_err(|e| ApiError::bad("messages", e))?;
                st.encode(&text, req.add_special_tokens.unwrap_or(false))?
            }
            (Some(_), Some(_)) => {
                return Err(ApiError::bad(
                    "messages",
                    "give prompt or messages, not both",
                ))
            }
            (None, None) => return Err(ApiError::bad("prompt", "give prompt or messages")),
        };
        let mut v = json!({"tokens": tokens, "count": tokens.len(), "max_model_len": st.max_len});
        if req.return_token_strs {
            let tok = st.tokenizer().ok_or_else(no_tokenizer)?;
            v["token_strs"] = tokens
                .iter()
                .map(|&t| tok.id_to_token(t).map_or(Value::Null, Value::String))
                .collect();
        }
        Ok(Json(v).into_response())
    }
    .await;
    r.unwrap_or_else(|e| e.into_response())
}

pub(super) async fn detokenize(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        st.accepting()?;
        let req: DetokenizeRequest = parse_body(&body.map_err(body_error)?)?;
        st.check_model(req.model.as_deref())?;
        let tok = st.tokenizer().ok_or_else(no_tokenizer)?;
        if let Some((i, t)) = req
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= st.vocab())
        {
            return Err(ApiError::bad(
                "tokens",
                format!(
                    "token id {t} at index {i} is outside the vocabulary (size {})",
                    st.vocab()
                ),
            ));
        }
        // Special tokens kept, as vLLM (and transformers' decode) gives them.
        let prompt = tok
            .decode(&req.tokens, false)
            .map_err(|e| ApiError::bad("tokens", format!("cannot decode the tokens: {e}")))?;
        Ok(Json(json!({ "prompt": prompt })).into_response())
    }
    .await;
    r.unwrap_or_else(|e| e.into_response())
}

/// What vLLM's `/tokenizer_info` gives (tokenizer_config.json's settings, the class and the
/// chat template), from what arbor reads of the model, with the context length the server
/// takes and the ids that end a sequence.
pub(super) async fn tokenizer_info(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Response {
    let r = (|| {
        st.authorize(&headers)?;
        let tok = st.tokenizer().ok_or_else(no_tokenizer)?;
        Ok::<_, ApiError>(Json(info(&st, tok)).into_response())
    })();
    r.unwrap_or_else(|e| e.into_response())
}

fn info(st: &AppState, tok: &tokenizers::Tokenizer) -> Value {
    let cfg = st.tokenizer_config();
    let name = |id: Option<&u32>| id.and_then(|&id| tok.id_to_token(id));
    // A model without tokenizer_config.json (a GGUF file, say) still names its end token:
    // clients look it up (lm-eval requires `eos_token`).
    let eos = cfg
        .and_then(|c| c.eos_token.clone())
        .or_else(|| name(st.eos_token_ids.first()));
    let mut v = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": cfg.and_then(|c| c.bos_token.clone()),
        "eos_token": eos,
        "pad_token": cfg.and_then(|c| c.pad_token.clone()),
        "model_max_length": st.max_len,
        "max_model_len": st.max_len,
        "vocab_size": tok.get_vocab_size(true),
        "eos_token_ids": st.eos_token_ids,
    });
    if let Some(c) = cfg {
        if let Some(b) = c.add_bos_token {
            v["add_bos_token"] = json!(b);
        }
        if let Some(b) = c.add_eos_token {
            v["add_eos_token"] = json!(b);
        }
        if let Some(t) = &c.chat_template {
            v["chat_template"] = json!(t);
        }
    }
    v
}
