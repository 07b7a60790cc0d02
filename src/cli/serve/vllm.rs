//! vLLM's token-in, token-out generate route, `POST /inference/v1/generate`
//! (`vllm/entrypoints/serve/disagg/protocol.py`: `GenerateRequest` in,
//! `GenerateResponse` out), which SkyRL's and prime-rl's rollout clients call. The body's
//! `sampling_params` (vLLM's `SamplingParams`) become the fields of a `/v1/completions`
//! request of the same token ids, checked by the same parser and run as the same job:
//! the same prompt, parameters and seed give the same bits on both routes.
//!
//! vLLM's weight-transfer routes live in `vllm_weights.rs`.

use std::sync::Arc;

use arbor_model::batching::Record;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::api::{body_error, parse_body, ApiError, CompletionRequest};
use super::job::Job;
use super::state::AppState;

/// `SamplingParams` fields that cannot change the tokens or log-probs returned (the route
/// returns no text, and the prefix cache never changes a bit).
const IGNORED: &[&str] = &[
    "detokenize",
    "spaces_between_special_tokens",
    "output_kind",
    "skip_reading_prefix_cache",
    "flat_logprobs",
];

/// `SamplingParams` fields taken only at their neutral value (absent, null, empty, false):
/// any other asks for something arbor does not do.
const NEUTRAL_ONLY: &[&str] = &[
    "truncate_prompt_tokens",
    "logits_processors",
    "allowed_token_ids",
    "bad_words",
    "extra_args",
    "guided_decoding",
    "thinking_token_budget",
];

/// `SamplingParams` fields that are `/v1/completions` fields of the same meaning: checked
/// and run by its parser.
const PASSED: &[&str] = &[
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "structured_outputs",
];

/// Fields of the body beside `token_ids` and `sampling_params`, taken only when neutral.
const NEUTRAL_TOP: &[&str] = &["features", "kv_transfer_params", "stream_options"];

/// Most log-prob alternatives (vLLM's default `max_logprobs`).
const MAX_LOGPROBS: i64 = 20;

fn is_neutral(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

/// vLLM's `logprobs` / `prompt_logprobs`: `None`, or how many alternatives (0..=20).
fn count(name: &'static str, v: Option<Value>) -> Result<Option<usize>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(k) if (0..=MAX_LOGPROBS).contains(&k) => Ok(Some(k as usize)),
            Some(-1) => Err(ApiError::bad(
                name,
                format!(
                    "{name} -1 (the whole vocabulary) is not supported: give 0 to {MAX_LOGPROBS}"
                ),
            )),
            _ => Err(ApiError::bad(
                name,
                format!("{name} must be an integer from 0 to {MAX_LOGPROBS}, got {v}"),
            )),
        },
    }
}

/// A parsed request: the completions request it is, and what the response shows.
struct Generate {
    req: CompletionRequest,
    request_id: Option<String>,
    /// `sampling_params.logprobs`: per output token, the sampled one and this many more.
    logprobs: Option<usize>,
    /// `sampling_params.prompt_logprobs`.
    prompt_logprobs: Option<usize>,
    /// The fields that came from `sampling_params` (errors name them there).
    from_sampling: Vec<String>,
}

fn parse(st: &AppState, bytes: &[u8]) -> Result<Generate, ApiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")))?;
    let Value::Object(mut top) = v else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "the request body must be a JSON object",
        ));
    };
    // vLLM's scheduling priority: the order requests run in never changes their bits.
    top.remove("priority");
    for k in NEUTRAL_TOP {
        if let Some(v) = top.remove(*k) {
            if !is_neutral(&v) {
                return Err(ApiError::bad(*k, format!("{k} is not supported")));
            }
        }
    }
    if top
        .remove("stream")
        .is_some_and(|v| v != Value::Bool(false) && !v.is_null())
    {
        return Err(ApiError::bad(
            "stream",
            "stream is not supported on /inference/v1/generate: send stream false (the response holds every token id)",
        ));
    }
    let request_id = match top.remove("request_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(v) => {
            return Err(ApiError::bad(
                "request_id",
                format!("request_id must be a string, got {v}"),
            ))
        }
    };
    let token_ids = top
        .remove("token_ids")
        .ok_or_else(|| ApiError::bad("token_ids", "token_ids is required"))?;
    if token_ids.as_array().is_none_or(|a| a.is_empty()) {
        return Err(ApiError::bad(
            "token_ids",
            "token_ids must be a non-empty list of token ids",
        ));
    }
    let mut sp = match top.remove("sampling_params") {
        Some(Value::Object(o)) => o,
        None | Some(Value::Null) => {
            return Err(ApiError::bad(
                "sampling_params",
                "sampling_params is required",
            ))
        }
        Some(v) => {
            return Err(ApiError::bad(
                "sampling_params",
                format!("sampling_params must be an object, got {v}"),
            ))
        }
    };
    for k in IGNORED {
        sp.remove(*k);
    }
    for k in NEUTRAL_ONLY {
        if let Some(v) = sp.remove(*k) {
            if !is_neutral(&v) {
                return Err(ApiError::bad(
                    format!("sampling_params.{k}"),
                    format!("sampling_params.{k} is not supported"),
                ));
            }
        }
    }
    let logprobs = count("sampling_params.logprobs", sp.remove("logprobs"))?;
    let prompt_logprobs = count(
        "sampling_params.prompt_logprobs",
        sp.remove("prompt_logprobs"),
    )?;
    // Without max_tokens vLLM generates up to the context's end.
    if sp.get("max_tokens").is_none_or(Value::is_null) {
        let n = token_ids.as_array().map_or(0, Vec::len);
        sp.insert("max_tokens".into(), json!(st.max_len.saturating_sub(n)));
    }
    let from_sampling: Vec<String> = sp.keys().cloned().collect();
    // The body of `/v1/completions` for the same prompt and parameters.
    let mut body = Map::new();
    body.insert("prompt".into(), token_ids);
    let alternatives = logprobs.max(prompt_logprobs);
    if let Some(k) = alternatives {
        body.insert("logprobs".into(), json!(k));
    }
    if prompt_logprobs.is_some() {
        body.insert("prompt_logprobs".into(), json!(true));
    }
    if let Some(rid) = &request_id {
        body.insert("rid".into(), json!(rid));
    }
    let mut keys: Vec<String> = sp.keys().cloned().collect();
    keys.sort();
    if let Some(k) = keys.iter().find(|k| !PASSED.contains(&k.as_str())) {
        return Err(ApiError::bad(
            format!("sampling_params.{k}"),
            format!("sampling_params.{k} is not supported"),
        ));
    }
    body.extend(sp);
    // What may be left at the top level: `model`, and `cache_salt` (a prefix-cache
    // namespace, which never changes a bit).
    let mut keys: Vec<String> = top.keys().cloned().collect();
    keys.sort();
    if let Some(k) = keys
        .iter()
        .find(|k| !matches!(k.as_str(), "model" | "cache_salt"))
    {
        return Err(ApiError::bad(
            k.clone(),
            format!("the field {k:?} is not supported by this server"),
        ));
    }
    body.extend(top);
    let req: CompletionRequest =
        parse_body(&serde_json::to_vec(&Value::Object(body)).unwrap_or_default())
            .map_err(|e| in_sampling(e, &from_sampling))?;
    Ok(Generate {
        req,
        request_id,
        logprobs,
        prompt_logprobs,
        from_sampling,
    })
}

/// A refused field of `sampling_params` named where the client put it (and `rid` as the
/// `request_id` it came from).
fn in_sampling(mut e: ApiError, from_sampling: &[String]) -> ApiError {
    if e.param.as_deref() == Some("rid") {
        e.message = e.message.replace("rid", "request_id");
        e.param = Some("request_id".into());
    }
    if let Some(p) = e.param.as_deref() {
        if from_sampling.iter().any(|k| k == p) {
            let named = format!("sampling_params.{p}");
            e.message = e.message.replacen(p, &named, 1);
            e.param = Some(named.into());
        }
    }
    e
}

pub(super) async fn generate(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        st.generating()?;
        let bytes = body.map_err(body_error)?;
        let g = parse(&st, &bytes)?;
        st.check_model(g.req.common.model.as_deref())?;
        let prompt = match &g.req.prompt {
            super::api::PromptInput::Tokens(t) => t.clone(),
            _ => {
                return Err(ApiError::bad(
                    "token_ids",
                    "token_ids must be a list of token ids",
                ))
            }
        };
        let max_tokens = g.req.max_tokens.unwrap_or(0);
        let mut p = g
            .req
            .common
            .params(max_tokens, g.req.logprobs, st.max_n)
            .map_err(|e| in_sampling(e, &g.from_sampling))?;
        let requested = g
            .req
            .common
            .requested()
            .map_err(|e| in_sampling(e, &g.from_sampling))?;
        p.constraint = st.compile(requested).await?;
        st.seed(&mut p);
        st.check_prompt(&prompt, max_tokens)?;
        let mut job = Job::submit(&st, vec![prompt], p, false)?;
        while !job.done() {
            job.next().await?;
        }
        Ok(Json(response(&job, &g)).into_response())
    }
    .await;
    match r {
        Ok(r) => r,
        Err(e) => {
            st.stats
                .rejected
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            e.into_response()
        }
    }
}

/// vLLM's `ChatCompletionLogProb`: the token as `token_id:ID`.
fn alt(id: u32, lp: f32) -> Value {
    json!({"token": format!("token_id:{id}"), "logprob": lp.max(-9999.0), "bytes": null})
}

/// The sampled token, then the most likely others: `max(k, 1)` entries, as vLLM lists a
/// step's log-probs (`_create_tokens_logprobs`).
fn top_list(r: &Record, k: usize) -> Vec<Value> {
    std::iter::once(alt(r.token, r.logprob))
        .chain(
            r.top
                .iter()
                .filter(|t| t.token != r.token)
                .map(|t| alt(t.token, t.logprob)),
        )
        .take(k.max(1))
        .collect()
}

/// vLLM's `Logprob` map of one prompt position: the prompt's token first, then the `k`
/// most likely (1-based `rank` where arbor knows it).
fn prompt_entry(token: u32, r: &Record, k: usize) -> Value {
    let rank_of = |id: u32| r.top.iter().position(|t| t.token == id).map(|i| i + 1);
    let mut m = Map::new();
    m.insert(
        token.to_string(),
        json!({"logprob": r.logprob.max(-9999.0), "rank": rank_of(token), "decoded_token": null}),
    );
    for (i, t) in r.top.iter().take(k).enumerate() {
        m.entry(t.token.to_string()).or_insert_with(
            || json!({"logprob": t.logprob.max(-9999.0), "rank": i + 1, "decoded_token": null}),
        );
    }
    Value::Object(m)
}

fn response(job: &Job, g: &Generate) -> Value {
    let mut completion = 0usize;
    let choices: Vec<Value> = job
        .choices
        .iter()
        .map(|c| {
            completion += c.records.len();
            let logprobs = g.logprobs.map(|k| {
                json!({"content": c.records.iter().map(|r| json!({
                    "token": format!("token_id:{}", r.token),
                    "logprob": r.logprob.max(-9999.0),
                    "bytes": null,
                    "top_logprobs": top_list(r, k),
                })).collect::<Vec<_>>()})
            });
            json!({
                "index": c.index,
                "logprobs": logprobs,
                "finish_reason": c.finish.unwrap_or("stop"),
                "token_ids": c.records.iter().map(|r| r.token).collect::<Vec<_>>(),
            })
        })
        .collect();
    let first = job.choices.first();
    let prompt_len = first.map_or(0, |c| c.prompt.len());
    // Position 0 has no context: None, as vLLM's list starts.
    let prompt_logprobs = g.prompt_logprobs.zip(first).map(|(k, c)| {
        std::iter::once(Value::Null)
            .chain(
                c.prompt
                    .iter()
                    .skip(1)
                    .zip(&c.prompt_records)
                    .map(|(&t, r)| prompt_entry(t, r, k)),
            )
            .collect::<Vec<_>>()
    });
    json!({
        "request_id": g.request_id.as_deref().unwrap_or(&job.id),
        "id": job.id,
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
        },
        "prompt_logprobs": prompt_logprobs,
        "kv_transfer_params": null,
        // The weights the tokens came from (arbor's; vLLM has no such field).
        "weight_version": first.and_then(|c| c.version.as_deref()),
    })
}
