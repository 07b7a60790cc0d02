//! The OpenAI routes: `/v1/completions`, `/v1/chat/completions` (a request's prompts
//! checked, tokenised or rendered with the chat template, and run as a job) and
//! `/v1/models` and `/v1/models/{id}`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::api::{body_error, parse_body, ApiError, ChatRequest, CompletionRequest, PromptInput};
use super::job::Job;
use super::response::run_job;
use super::state::AppState;
use super::tools::Tools;

pub(super) async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        st.generating()?;
        let bytes = body.map_err(body_error)?;
        let req: CompletionRequest = parse_body(&bytes)?;
        st.check_model(req.common.model.as_deref())?;
        if req.suffix.is_some() {
            return Err(ApiError::bad("suffix", "suffix is not supported"));
        }
        let prompts = match req.prompt {
            PromptInput::Text(t) => vec![st.encode(&t, true)?],
            PromptInput::Texts(v) => v
                .iter()
                .map(|t| st.encode(t, true))
                .collect::<Result<_, _>>()?,
            PromptInput::Tokens(t) => vec![t],
            PromptInput::TokenLists(v) => v,
        };
        if prompts.is_empty() {
            return Err(ApiError::bad("prompt", "no prompt given"));
        }
        let max_tokens = req.max_tokens.unwrap_or(16);
        let mut p = req.common.params(max_tokens, req.logprobs, st.max_n)?;
        if req.best_of.is_some_and(|b| b != p.n) {
            return Err(ApiError::bad(
                "best_of",
                "best_of is not supported (other than equal to n)",
            ));
        }
        p.echo = req.echo;
        p.constraint = st.compile(req.common.requested()?).await?;
        st.seed(&mut p);
        for prompt in &prompts {
            st.check_prompt(prompt, max_tokens)?;
        }
        run_job(Job::submit(&st, prompts, p, false)?).await
    }
    .await;
    finish_response(&st, r)
}

pub(super) async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        st.generating()?;
        let bytes = body.map_err(body_error)?;
        let req: ChatRequest = parse_body(&bytes)?;
        st.check_model(req.common.model.as_deref())?;
        let tmpl = st.chat_template()?;
        if req.messages.is_empty() {
            return Err(ApiError::bad("messages", "messages is empty"));
        }
        let tools = Tools::from_request(
            req.tools.as_ref(),
            req.tool_choice.as_ref(),
            req.parallel_tool_calls,
        )?;
        let active = tools.as_ref().filter(|t| t.active());
        let text = tmpl
            .render_with_tools(
                &req.messages,
                req.add_generation_prompt.unwrap_or(true),
                active.map(|t| &t.list[..]),
            )
            .map_err(|e| ApiError::bad("messages", e))?;
        // The template writes the special tokens itself.
        let prompt = st.encode(&text, false)?;
        let max_tokens = req
            .max_completion_tokens
            .or(req.max_tokens)
            .unwrap_or_else(|| st.max_len.saturating_sub(prompt.len()));
        let logprobs = match (req.logprobs, req.top_logprobs) {
            (true, k) => Some(k.unwrap_or(0)),
            (false, None) => None,
            (false, Some(_)) => {
                return Err(ApiError::bad(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                ))
            }
        };
        let mut p = req.common.params(max_tokens, logprobs, st.max_n)?;
        let mistral = tmpl.tool_format == super::tools::Format::Mistral;
        let marker = st
            .tokenizer()
            .filter(|_| mistral)
            .and_then(super::tools::mistral_marker);
        let forced = active.and_then(|t| t.forced(tmpl.tool_format, marker));
        let requested = match (req.common.requested()?, forced) {
            (Some(r), Some(_)) => {
                return Err(ApiError::bad(
                    r.param.clone(),
                    format!(
                        "{} cannot be combined with a forced tool call (tool_choice)",
                        r.param
                    ),
                ))
            }
            (r, f) => r.or(f),
        };
        p.constraint = st.compile(requested).await?;
        p.tool_format = active.map(|_| tmpl.tool_format);
        if active.is_some() && marker.is_some() {
            // The reply keeps its special tokens where `[TOOL_CALLS]` is one, or no call
            // could be found in it (vLLM's Mistral parser does the same).
            p.skip_special = false;
        }
        st.seed(&mut p);
        st.check_prompt(&prompt, max_tokens)?;
        run_job(Job::submit(&st, vec![prompt], p, true)?).await
    }
    .await;
    finish_response(&st, r)
}

fn finish_response(st: &AppState, r: Result<Response, ApiError>) -> Response {
    match r {
        Ok(r) => r,
        Err(e) => {
            st.stats.rejected.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(status = %e.status, msg = %e.message, "request refused");
            e.into_response()
        }
    }
}

fn model_card(st: &AppState) -> serde_json::Value {
    json!({"id": st.model_name, "object": "model", "created": 0, "owned_by": "arbor", "max_model_len": st.max_len})
}

pub(super) async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [model_card(&st)]})).into_response()
}

/// `GET /v1/models/{id}`: the served model's card, or 404 (`model_not_found`). The id
/// may hold slashes (`--served-model-name org/name`).
pub(super) async fn model(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let r = st
        .authorize(&headers)
        .and_then(|()| st.check_model(Some(&id)));
    match r {
        Ok(()) => Json(model_card(&st)).into_response(),
        Err(e) => e.into_response(),
    }
}
