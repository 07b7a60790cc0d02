//! SGLang's native generate route, `POST /generate`: token ids (or text) in, token ids,
//! text and `meta_info` (finish reason, log-probs as `[logprob, id, text]`, the weight
//! version) out, one prompt or a batch, whole or streamed as SGLang streams (cumulative
//! chunks, then `data: [DONE]`). A request runs as a job like `/v1/completions` with the
//! same sample keys (choice i of the request: `sample_id` 0 + i, seed `sampling_seed` or
//! 0), so both routes give the same bits for the same prompt and sampling.
//!
//! `return_routed_experts` (a mixture-of-experts model) adds `meta_info.routed_experts`
//! as SGLang does: base64 of little-endian int32 `[tokens, num_hidden_layers, top_k]`,
//! one row per position the forward ran, `routed_experts_start_len..prompt + output - 1`
//! (the last output token is never fed). The layout is SGLang's
//! (`python/sglang/srt/layers/moe/routed_experts_capturer.py`, the base64 in
//! `python/sglang/srt/managers/tokenizer_manager.py`), as slime decodes it
//! (`slime/utils/types.py` `_apply_meta_info`, `slime/utils/misc.py`
//! `decode_int32_meta_array`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arbor_model::batching::Record;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::api::{body_error, ApiError, Common, StopInput, StopTrim};
use super::choice::{ChoiceState, Matched};
use super::job::{Job, Update};
use super::state::AppState;

/// SGLang's default `max_new_tokens`.
const DEFAULT_MAX_NEW: usize = 128;

/// Fields of the request that cannot change the output whatever their value (routing,
/// logging, priorities).
const IGNORED: &[&str] = &[
    "log_metrics",
    "data_parallel_rank",
    "routed_dp_rank",
    "priority",
    "extra_key",
    "no_logs",
    "custom_labels",
    "modalities",
    "conversation_id",
];

/// Fields taken only when absent, null, false or empty: anything else asks for something
/// arbor does not do (images, adapters, hidden states, ...).
const NEUTRAL_ONLY: &[&str] = &[
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "lora_path",
    "lora_id",
    "custom_logit_processor",
    "return_hidden_states",
    "return_entropy",
    "token_ids_logprob",
    "session_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "background",
];

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TextInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum IdsInput {
    One(Vec<u32>),
    Many(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerateReq {
    text: Option<TextInput>,
    input_ids: Option<IdsInput>,
    sampling_params: Option<Value>,
    rid: Option<Value>,
    #[serde(default)]
    return_logprob: bool,
    logprob_start_len: Option<i64>,
    #[serde(default)]
    top_logprobs_num: usize,
    #[serde(default)]
    return_text_in_logprobs: bool,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    return_routed_experts: bool,
    /// SGLang's first reported position (0: the whole sequence; at most the prompt's
    /// length).
    routed_experts_start_len: Option<usize>,
}

/// SGLang's `SamplingParams`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SamplingParams {
    max_new_tokens: Option<usize>,
    stop: Option<StopInput>,
    stop_token_ids: Option<Vec<u32>>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    min_new_tokens: Option<usize>,
    n: Option<usize>,
    #[serde(default)]
    ignore_eos: bool,
    skip_special_tokens: Option<bool>,
    /// Only the slow tokenizers put spaces between special tokens; arbor's decoder never
    /// does, so either value gives the same text.
    #[allow(dead_code)]
    spaces_between_special_tokens: Option<bool>,
    #[serde(default)]
    no_stop_trim: bool,
    sampling_seed: Option<i64>,
    /// Read only by a custom logit processor, which arbor refuses.
    #[allow(dead_code)]
    custom_params: Option<Value>,
    #[allow(dead_code)]
    stream_interval: Option<usize>,
    logit_bias: Option<Map<String, Value>>,
    json_schema: Option<Value>,
    regex: Option<Value>,
    ebnf: Option<Value>,
    structural_tag: Option<Value>,
    stop_regex: Option<Value>,
}

fn unprocessable(m: String) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, m)
}

fn is_neutral(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Array(a) => a.iter().all(is_neutral),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

/// A parsed `/generate` request: its prompts and parameters, and what the response holds.
struct Generate {
    prompts: Vec<Vec<u32>>,
    /// A batch (a list of prompts, or n > 1): the response is a list.
    batch: bool,
    common: Common,
    max_new: Option<usize>,
    no_stop_trim: bool,
    logprobs: Option<usize>,
    start_len: Option<usize>,
    text_in_logprobs: bool,
    stream: bool,
    /// `json_schema`, `regex` or `ebnf`.
    constraint: Option<super::structured::Requested>,
    /// `return_routed_experts`: from this position.
    routes_from: Option<usize>,
}

fn parse(st: &AppState, bytes: &[u8]) -> Result<Generate, ApiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")))?;
    let Value::Object(mut obj) = v else {
        return Err(unprocessable(
            "the request body must be a JSON object".into(),
        ));
    };
    for k in IGNORED {
        obj.remove(*k);
    }
    for k in NEUTRAL_ONLY {
        if let Some(v) = obj.remove(*k) {
            if !is_neutral(&v) {
                return Err(ApiError::bad(*k, format!("{k} is not supported")));
            }
        }
    }
    let r: GenerateReq = serde_json::from_value(Value::Object(obj))
        .map_err(|e| unprocessable(format!("invalid request: {e}")))?;
    let sp: SamplingParams =
        match r.sampling_params {
            None | Some(Value::Null) => SamplingParams::default(),
            Some(v @ Value::Object(_)) => serde_json::from_value(v)
                .map_err(|e| unprocessable(format!("invalid sampling_params: {e}")))?,
            Some(_) => return Err(ApiError::bad(
                "sampling_params",
                "sampling_params is not supported as a list: give one object for the whole batch",
            )),
        };
    for (name, v, why) in [
        (
            "structural_tag",
            &sp.structural_tag,
            "constrain with json_schema or regex",
        ),
        ("stop_regex", &sp.stop_regex, "use stop strings"),
    ] {
        if v.as_ref().is_some_and(|v| !is_neutral(v)) {
            return Err(ApiError::bad(
                name,
                format!("{name} is not supported: {why}"),
            ));
        }
    }
    let mut found = Vec::new();
    for (name, v) in [
        ("json_schema", &sp.json_schema),
        ("regex", &sp.regex),
        ("ebnf", &sp.ebnf),
    ] {
        if let Some(v) = v.as_ref().filter(|v| !is_neutral(v)) {
            found.push(super::structured::from_field(name, v)?);
        }
    }
    let constraint = super::structured::one_of(found)?;
    let rid = match r.rid {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => {
            return Err(ApiError::bad(
                "rid",
                "rid is not supported as a list: a batch is one request, named by one rid",
            ))
        }
    };
    let (prompts, list) = match (r.text, r.input_ids) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad(
                "input_ids",
                "give text or input_ids, not both",
            ))
        }
        (None, None) => return Err(ApiError::bad("input_ids", "give text or input_ids")),
        (Some(TextInput::One(t)), None) => (vec![st.encode(&t, true)?], false),
        (Some(TextInput::Many(v)), None) => (
            v.iter()
                .map(|t| st.encode(t, true))
                .collect::<Result<_, _>>()?,
            true,
        ),
        (None, Some(IdsInput::One(ids))) => (vec![ids], false),
        (None, Some(IdsInput::Many(v))) => (v, true),
    };
    if prompts.is_empty() {
        return Err(ApiError::bad("input_ids", "no prompt given"));
    }
    let start_len = match r.logprob_start_len {
        None | Some(-1) => None,
        Some(s) if s >= 0 => Some(s as usize),
        Some(s) => {
            return Err(ApiError::bad(
                "logprob_start_len",
                format!("logprob_start_len must be -1 or >= 0, got {s}"),
            ))
        }
    };
    let common = Common {
        temperature: sp.temperature,
        top_p: sp.top_p,
        n: sp.n,
        seed: sp.sampling_seed,
        stop: sp.stop,
        stream: r.stream,
        presence_penalty: sp.presence_penalty,
        frequency_penalty: sp.frequency_penalty,
        logit_bias: sp.logit_bias,
        top_k: sp.top_k,
        ignore_eos: sp.ignore_eos,
        rid,
        skip_special_tokens: sp.skip_special_tokens,
        stop_token_ids: sp.stop_token_ids,
        min_p: sp.min_p,
        min_tokens: sp.min_new_tokens,
        repetition_penalty: sp.repetition_penalty,
        ..Common::default()
    };
    Ok(Generate {
        batch: list || sp.n.unwrap_or(1) > 1,
        prompts,
        common,
        max_new: sp.max_new_tokens,
        no_stop_trim: sp.no_stop_trim,
        logprobs: r.return_logprob.then_some(r.top_logprobs_num),
        start_len: start_len.filter(|_| r.return_logprob),
        text_in_logprobs: r.return_text_in_logprobs,
        stream: r.stream,
        constraint,
        routes_from: r
            .return_routed_experts
            .then(|| r.routed_experts_start_len.unwrap_or(0)),
    })
}

/// What the response needs beyond the job.
struct Shape {
    batch: bool,
    logprobs: bool,
    top: usize,
    start_len: Option<usize>,
    text_in_logprobs: bool,
    max_new: usize,
    t0: Instant,
    routes_from: Option<usize>,
}

pub(super) async fn generate(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let t0 = Instant::now();
    let r = async {
        st.authorize(&headers)?;
        st.generating()?;
        let bytes = body.map_err(body_error)?;
        let g = parse(&st, &bytes)?;
        // As SGLang does, the default and a limit past the context are cut to what fits.
        let room = g
            .prompts
            .iter()
            .map(|p| st.max_len.saturating_sub(p.len()))
            .min()
            .unwrap_or(0);
        let max_new = g.max_new.unwrap_or(DEFAULT_MAX_NEW).min(room);
        let mut p = g.common.params(max_new, g.logprobs, st.max_n)?;
        p.constraint = st.compile(g.constraint).await?;
        // Unseeded requests draw a fresh seed as completions do: frameworks send each of a
        // prompt's samples as its own request, which one fixed seed would make identical.
        st.seed(&mut p);
        if g.no_stop_trim {
            p.stop_trim = StopTrim::Keep;
        }
        for (i, prompt) in g.prompts.iter().enumerate() {
            if let Some(s) = g.start_len.filter(|&s| s >= prompt.len()) {
                return Err(ApiError::bad(
                    "logprob_start_len",
                    format!(
                        "logprob_start_len {s} is not below the length of prompt {i} ({} tokens)",
                        prompt.len()
                    ),
                ));
            }
            st.check_prompt(prompt, max_new)?;
        }
        p.prompt_logprobs = g.start_len.is_some();
        if let Some(from) = g.routes_from {
            if st.routed.is_none() {
                return Err(ApiError::bad(
                    "return_routed_experts",
                    "return_routed_experts: this model has no experts (a dense model routes no token)",
                ));
            }
            if let Some((i, prompt)) = g.prompts.iter().enumerate().find(|(_, p)| from > p.len()) {
                return Err(ApiError::bad(
                    "routed_experts_start_len",
                    format!(
                        "routed_experts_start_len {from} is past the length of prompt {i} ({} tokens)",
                        prompt.len()
                    ),
                ));
            }
            p.routes = true;
        }
        let shape = Shape {
            batch: g.batch,
            logprobs: g.logprobs.is_some(),
            top: g.logprobs.unwrap_or(0),
            start_len: g.start_len,
            text_in_logprobs: g.text_in_logprobs,
            max_new,
            t0,
            routes_from: g.routes_from,
        };
        let mut job = Job::submit(&st, g.prompts, p, false)?;
        if g.stream {
            return Ok(stream(job, shape).into_response());
        }
        while !job.done() {
            job.next().await?;
        }
        let mut items: Vec<Value> = (0..job.choices.len())
            .map(|i| item(&job, &shape, i))
            .collect();
        Ok(match (shape.batch, items.pop()) {
            (false, Some(one)) => Json(one).into_response(),
            (_, last) => {
                items.extend(last);
                Json(Value::Array(items)).into_response()
            }
        })
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

/// `[logprob, id, text or null]`, SGLang's log-prob entry.
fn entry(job: &Job, shape: &Shape, lp: Option<f32>, id: u32) -> Value {
    let text = shape
        .text_in_logprobs
        .then(|| job.st.token_str(id))
        .map_or(Value::Null, Value::from);
    json!([lp, id, text])
}

fn top_entries(job: &Job, shape: &Shape, r: &Record) -> Value {
    r.top
        .iter()
        .map(|t| entry(job, shape, Some(t.logprob), t.token))
        .collect()
}

fn finish_reason(c: &ChoiceState, shape: &Shape) -> Value {
    match c.finish {
        None => Value::Null,
        Some("length") => json!({"type": "length", "length": shape.max_new}),
        Some("abort") => json!({"type": "abort", "message": if c.records.is_empty() {
            // SGLang's words for a request that never ran: its clients send it again.
            "Abort before prefill"
        } else {
            "aborted"
        }}),
        Some(_) => match &c.matched {
            Some(Matched::Token(t)) => json!({"type": "stop", "matched": t}),
            Some(Matched::Str(s)) => json!({"type": "stop", "matched": s}),
            None => json!({"type": "stop"}),
        },
    }
}

/// Choice `i` as SGLang returns it: text, output ids and `meta_info`.
fn item(job: &Job, shape: &Shape, i: usize) -> Value {
    let c = &job.choices[i];
    let mut meta = json!({
        "id": job.id,
        "finish_reason": finish_reason(c, shape),
        "prompt_tokens": c.prompt.len(),
        "completion_tokens": c.records.len(),
        // Per-request prefix-cache hits are not tracked (the cache never changes a bit).
        "cached_tokens": 0,
        "weight_version": c.version.as_deref(),
        "e2e_latency": shape.t0.elapsed().as_secs_f64(),
        // The seed the sample was drawn with: sent back as `sampling_seed`, it replays.
        "sampling_seed": job.p.sampling.seed,
    });
    if shape.logprobs {
        meta["output_token_logprobs"] = c
            .records
            .iter()
            .map(|r| entry(job, shape, Some(r.logprob), r.token))
            .collect();
        if shape.top > 0 {
            meta["output_top_logprobs"] = c
                .records
                .iter()
                .map(|r| top_entries(job, shape, r))
                .collect();
        }
        // Aligned with the prompt from the start position; the first entry is null, as
        // SGLang's is (by default only the last prompt token's).
        let s = shape.start_len.unwrap_or(c.prompt.len().saturating_sub(1));
        meta["input_token_logprobs"] = (s..c.prompt.len())
            .map(|pos| {
                let lp = (pos > s)
                    .then(|| pos.checked_sub(1).and_then(|j| c.prompt_records.get(j)))
                    .flatten()
                    .map(|r| r.logprob);
                entry(job, shape, lp, c.prompt[pos])
            })
            .collect();
    }
    if let (Some(from), Some(_)) = (shape.routes_from, c.finish) {
        let per_token = job.st.routed.map_or(0, |(l, k)| l * k);
        meta["routed_experts"] = Value::from(routed_experts(c, from, per_token));
    }
    let mut v = json!({
        "text": settled_text(c),
        "output_ids": c.records.iter().map(|r| r.token).collect::<Vec<_>>(),
        "meta_info": meta,
    });
    if shape.batch {
        v["index"] = json!(c.index);
    }
    v
}

/// SGLang's `routed_experts` of a finished choice: base64 of the little-endian int32
/// routes of positions `from..prompt + output - 1` (those the forward ran; fewer where
/// it stopped early, as an abort before prefill).
fn routed_experts(c: &ChoiceState, from: usize, per_token: usize) -> String {
    let end = (c.prompt.len() + c.records.len()).saturating_sub(1);
    let have = c.routes.len() / per_token.max(1);
    let (from, end) = (from.min(end), end.min(have));
    let ids = c
        .routes
        .get(from * per_token..end.max(from) * per_token)
        .unwrap_or_default();
    let bytes: Vec<u8> = ids.iter().flat_map(|&e| (e as i32).to_le_bytes()).collect();
    base64(&bytes)
}

/// Standard base64 with padding (RFC 4648 §4), what Python's `base64.b64decode` reads.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The text so far; while the choice runs, without a trailing partial character.
fn settled_text(c: &ChoiceState) -> &str {
    match c.finish {
        Some(_) => &c.text,
        None => c.text.trim_end_matches('\u{FFFD}'),
    }
}

fn stream(
    job: Job,
    shape: Shape,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    struct S {
        job: Job,
        shape: Shape,
        pending: VecDeque<Event>,
        ended: bool,
    }
    let s = S {
        job,
        shape,
        pending: VecDeque::new(),
        ended: false,
    };
    let stream = futures_util::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(e) = s.pending.pop_front() {
                return Some((Ok(e), s));
            }
            if s.ended {
                return None;
            }
            if s.job.done() {
                s.pending.push_back(Event::default().data("[DONE]"));
                s.ended = true;
                continue;
            }
            match s.job.next().await {
                Ok(Update::Token(i, _) | Update::Finished(i)) => {
                    s.job.choices[i].streamed = true;
                    // With stop strings, a chunk waits for the choice to settle: its text
                    // may still lose a stop string's beginning.
                    if s.job.choices[i].finish.is_some() || s.job.p.stop.is_empty() {
                        let v = item(&s.job, &s.shape, i);
                        s.pending.push_back(Event::default().data(v.to_string()));
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    s.pending.push_back(Job::error_event(&e));
                    s.pending.push_back(Event::default().data("[DONE]"));
                    s.ended = true;
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

#[cfg(test)]
mod tests {
    use super::base64;

    #[test]
    fn base64_is_rfc_4648_with_padding() {
        // RFC 4648 §10's test vectors.
        for (raw, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(raw.as_bytes()), enc, "{raw:?}");
        }
        // High bits and the last two letters of the alphabet.
        assert_eq!(base64(&[0xfb, 0xff, 0xbf]), "+/+/");
        // Expert ids 1 and 258 as little-endian int32.
        assert_eq!(base64(&[1, 0, 0, 0, 2, 1, 0, 0]), "AQAAAAIBAAA=");
    }
}
