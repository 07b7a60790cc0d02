//! TRL's server protocol (`trl vllm-serve`, which `trl.generation.vllm_client.VLLMClient`
//! drives), trailing slashes included: `/health/`, `/get_world_size/`, `/generate/`,
//! `/chat/`, `/reset_prefix_cache/`, and the weight-update routes `/init_communicator/`,
//! `/update_named_param/` and `/close_communicator/`.
//!
//! `/generate/` and `/chat/` read their sampling fields as `/v1/completions` reads the
//! same names (TRL's `generation_kwargs` are vLLM `SamplingParams` keyword arguments, which
//! are `/v1/completions` fields), and run one job on the shared request path, so that a
//! prompt gives the bits `/v1/completions` gives for the same sampling and seed.
//!
//! The weight routes make the group TRL's client expects: arbor's ranks are ranks
//! `0..tp` of a vLLM `StatelessProcessGroup` and the trainer is the last, so arbor's rank 0
//! runs the group's `TCPStore` and makes and publishes the NCCL id (docs/rl.md). As TRL's
//! server does, `/init_communicator/` and `/update_named_param/` answer before the group is
//! joined or the tensor received: the client joins or broadcasts only after the answer.

use std::sync::{Arc, Mutex};

use arbor_model::batching::{Rendezvous, TensorMeta};
use arbor_model::DType;
use arbor_serving::{Commit, ControlOp, Policy, UpdateReq};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::admin::{body, parse};
use super::api::{body_error, parse_body, ApiError, CompletionRequest};
use super::chat::Message;
use super::job::Job;
use super::state::AppState;

/// The group `/init_communicator/` makes (TRL's requests name none).
pub const GROUP: &str = "trl";

/// How long a rank waits for the trainer in the group (join, each broadcast).
const GROUP_TIMEOUT_S: f64 = 300.0;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/health/", get(health))
        .route("/get_world_size/", get(world_size))
        .route("/generate/", post(generate))
        .route("/chat/", post(chat))
        .route("/reset_prefix_cache/", post(reset_prefix_cache))
        .route("/init_communicator/", post(init_communicator))
        .route("/update_named_param/", post(update_named_param))
        .route("/close_communicator/", post(close_communicator))
}

async fn health(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"status": "ok"})).into_response()
}

/// TRL's world size is the server's workers (`tensor_parallel_size * data_parallel_size`);
/// its client adds one for itself.
async fn world_size(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"world_size": st.tp})).into_response()
}

/// The sampling fields both routes share (TRL's `GenerateRequest` / `ChatRequest`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Sampling {
    #[serde(default = "one")]
    n: usize,
    repetition_penalty: Option<f64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    max_tokens: Option<usize>,
    /// Top alternatives per token (0: the sampled token's only); null: none.
    #[serde(default = "some_zero")]
    logprobs: Option<usize>,
    structured_outputs_regex: Option<String>,
    /// vLLM `SamplingParams` keyword arguments, which override the fields above.
    #[serde(default)]
    generation_kwargs: Option<Map<String, Value>>,
}

fn one() -> usize {
    1
}

fn some_zero() -> Option<usize> {
    Some(0)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerateReq {
    prompts: Prompts,
    /// Base64 images per prompt: only none is taken.
    images: Option<Vec<Option<Vec<String>>>>,
    #[serde(flatten)]
    sampling: Sampling,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompts {
    Texts(Vec<String>),
    Ids(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatReq {
    messages: Vec<Vec<Message>>,
    #[serde(default)]
    chat_template_kwargs: Option<Map<String, Value>>,
    tools: Option<Vec<Value>>,
    #[serde(flatten)]
    sampling: Sampling,
}

/// The `/v1/completions` request the sampling fields make, `generation_kwargs` last (they
/// override, as in TRL's server). A field `/v1/completions` refuses is refused here, named
/// `generation_kwargs.KEY` when it came from there.
fn completion_request(s: &Sampling) -> Result<(CompletionRequest, Vec<String>), ApiError> {
    let mut obj = Map::new();
    obj.insert("prompt".into(), json!([[0]]));
    obj.insert("n".into(), json!(s.n));
    for (k, v) in [
        ("repetition_penalty", s.repetition_penalty),
        ("temperature", s.temperature),
        ("top_p", s.top_p),
        ("min_p", s.min_p),
    ] {
        if let Some(v) = v {
            obj.insert(k.into(), json!(v));
        }
    }
    if let Some(k) = s.top_k {
        obj.insert("top_k".into(), json!(k));
    }
    obj.insert("max_tokens".into(), json!(s.max_tokens.unwrap_or(16)));
    if let Some(k) = s.logprobs {
        obj.insert("logprobs".into(), json!(k));
    }
    let mut from_kwargs = Vec::new();
    for (k, v) in s.generation_kwargs.iter().flatten() {
        // Fields of the completions body that are not sampling parameters.
        if matches!(
            k.as_str(),
            "prompt" | "echo" | "stream" | "suffix" | "model"
        ) {
            return Err(ApiError::bad(
                format!("generation_kwargs.{k}"),
                format!("generation_kwargs.{k} is not a sampling parameter"),
            ));
        }
        obj.insert(k.clone(), v.clone());
        from_kwargs.push(k.clone());
    }
    if let Some(r) = &s.structured_outputs_regex {
        obj.insert("structured_outputs".into(), json!({"regex": r}));
    }
    let bytes = serde_json::to_vec(&Value::Object(obj))
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let req = parse_body::<CompletionRequest>(&bytes).map_err(|e| named(e, &from_kwargs))?;
    Ok((req, from_kwargs))
}

/// An error about a field that came from `generation_kwargs`, named as the client sent it.
fn named(mut e: ApiError, from_kwargs: &[String]) -> ApiError {
    if let Some(p) = e.param.as_deref() {
        if from_kwargs.iter().any(|k| k == p) {
            let named = format!("generation_kwargs.{p}");
            e.message = format!("{named}: {}", e.message);
            e.param = Some(named.into());
        }
    }
    e
}

/// Runs `prompts` (n choices each) as one job, and answers as TRL's server does.
async fn run(st: &Arc<AppState>, prompts: Vec<Vec<u32>>, s: &Sampling) -> Result<Value, ApiError> {
    if prompts.is_empty() {
        return Err(ApiError::bad("prompts", "no prompt given"));
    }
    let (req, from_kwargs) = completion_request(s)?;
    let max_tokens = req.max_tokens.unwrap_or(16);
    let mut p = req
        .common
        .params(max_tokens, req.logprobs, st.max_n)
        .map_err(|e| named(e, &from_kwargs))?;
    if req.best_of.is_some_and(|b| b != p.n) {
        return Err(ApiError::bad(
            "generation_kwargs.best_of",
            "best_of is not supported (other than equal to n)",
        ));
    }
    let requested = req.common.requested().map_err(|e| named(e, &from_kwargs))?;
    p.constraint = st.compile(requested).await?;
    st.seed(&mut p);
    for prompt in &prompts {
        st.check_prompt(prompt, max_tokens)?;
    }
    let mut job = Job::submit(st, prompts, p, false)?;
    while !job.done() {
        job.next().await?;
    }
    // Choices are prompt-major (choice i is prompt i / n's), as vLLM's outputs are.
    let n = job.p.n.max(1);
    let prompt_ids: Vec<&[u32]> = job
        .choices
        .iter()
        .step_by(n)
        .map(|c| c.prompt.as_slice())
        .collect();
    let completion_ids: Vec<Vec<u32>> = job
        .choices
        .iter()
        .map(|c| c.records.iter().map(|r| r.token).collect())
        .collect();
    let (logprobs, logprob_ids) = match job.p.logprobs {
        None => (Value::Null, Value::Null),
        Some(top) => {
            let mut lps = Vec::with_capacity(job.choices.len());
            let mut ids = Vec::with_capacity(job.choices.len());
            for c in &job.choices {
                let (l, i): (Vec<_>, Vec<_>) = c.records.iter().map(|r| ranked(r, top)).unzip();
                lps.push(l);
                ids.push(i);
            }
            (json!(lps), json!(ids))
        }
    };
    Ok(json!({
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": logprobs,
        "logprob_token_ids": logprob_ids,
    }))
}

/// One position's log-probs as vLLM ranks them: the `top` most likely tokens, most likely
/// first, and the sampled token after them where it is not among them (vLLM always
/// returns it); with `top` 0, the sampled token alone.
fn ranked(r: &arbor_model::batching::Record, top: usize) -> (Vec<Option<f32>>, Vec<u32>) {
    let mut lps = Vec::with_capacity(top + 1);
    let mut ids = Vec::with_capacity(top + 1);
    for t in r.top.iter().take(top) {
        lps.push(finite(t.logprob));
        ids.push(t.token);
    }
    if !ids.contains(&r.token) {
        lps.push(finite(r.logprob));
        ids.push(r.token);
    }
    (lps, ids)
}

/// TRL's server answers NaN as null.
fn finite(x: f32) -> Option<f32> {
    (!x.is_nan()).then_some(x)
}

fn answer(st: &AppState, r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => {
            st.stats
                .rejected
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            e.into_response()
        }
    }
}

async fn generate(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        st.generating()?;
        let g: GenerateReq = super::admin::parse(&b.map_err(body_error)?)?;
        if g.images.iter().flatten().any(Option::is_some) {
            return Err(ApiError::bad(
                "images",
                "images are not supported: arbor serves text models",
            ));
        }
        let prompts = match g.prompts {
            Prompts::Texts(t) => t
                .iter()
                .map(|t| st.encode(t, true))
                .collect::<Result<_, _>>()?,
            Prompts::Ids(ids) => ids,
        };
        run(&st, prompts, &g.sampling).await
    }
    .await;
    answer(&st, r)
}

async fn chat(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        st.generating()?;
        let c: ChatReq = super::admin::parse(&b.map_err(body_error)?)?;
        if let Some((k, _)) = c.chat_template_kwargs.iter().flatten().next() {
            return Err(ApiError::bad(
                format!("chat_template_kwargs.{k}"),
                format!("chat_template_kwargs.{k} is not supported: arbor renders the template with messages, tools, add_generation_prompt, bos_token and eos_token only"),
            ));
        }
        let tmpl = st.chat_template()?;
        let tools = c.tools.as_deref().filter(|t| !t.is_empty());
        let mut prompts = Vec::with_capacity(c.messages.len());
        for (i, conv) in c.messages.iter().enumerate() {
            if conv.is_empty() {
                return Err(ApiError::bad("messages", format!("conversation {i} is empty")));
            }
            // As vLLM's `LLM.chat`: the assistant's turn opened, tools rendered into the
            // prompt (the caller parses any call from the completion).
            let text = tmpl
                .render_with_tools(conv, true, tools)
                .map_err(|e| ApiError::bad("messages", format!("conversation {i}: {e}")))?;
            // The template writes the special tokens itself.
            prompts.push(st.encode(&text, false)?);
        }
        run(&st, prompts, &c.sampling).await
    }
    .await;
    answer(&st, r)
}

/// TRL's reset takes no body; arbor's flush needs no request running, as vLLM's does.
async fn reset_prefix_cache(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    let r = super::admin::command(&st, ControlOp::FlushCache).await;
    if !r.status().is_success() {
        return r;
    }
    Json(json!({"message": "Request received, resetting prefix cache status: True"}))
        .into_response()
}

/// What the last `/update_named_param/` that ran after its answer failed with: the next
/// weight route reports it (its caller was answered before the tensor was received).
static LATE_FAILURE: Mutex<Option<String>> = Mutex::new(None);

fn late_failure() -> Option<String> {
    LATE_FAILURE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InitCommunicator {
    /// Where the group's store listens (TRL sends "0.0.0.0": every interface).
    host: String,
    port: i64,
    world_size: usize,
    /// The trainer's GPU, which TRL's server checks is none of its own; arbor's ranks
    /// cannot tell (a shared GPU fails at the NCCL join).
    #[allow(dead_code)]
    client_device_uuid: String,
}

async fn init_communicator(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let tp = st.tp;
    super::admin::guarded(st, headers, || {
        let r: InitCommunicator = parse(&body(b)?)?;
        if r.world_size != tp + 1 {
            return Err(ApiError::bad(
                "world_size",
                format!(
                    "world_size {} is not this server's {tp} ranks and the trainer: {}",
                    r.world_size,
                    tp + 1
                ),
            ));
        }
        let port = u16::try_from(r.port)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| {
                ApiError::bad("port", format!("port must be 1 to 65535, got {}", r.port))
            })?;
        let host = r.host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(ApiError::bad(
                "host",
                format!(
                    "host is the address the group's store listens on, got {:?}",
                    r.host
                ),
            ));
        }
        late_failure();
        Ok(ControlOp::InitGroup {
            name: GROUP.into(),
            rendezvous: Rendezvous::Serve {
                host: host.to_string(),
                port,
            },
            world: r.world_size,
            rank_offset: 0,
            timeout_s: GROUP_TIMEOUT_S,
        })
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NamedParam {
    name: String,
    dtype: String,
    shape: Vec<usize>,
}

/// Answers at once, as TRL's server does: its client broadcasts the tensor only after the
/// answer. The receive runs after it, as one `update_weights_from_distributed` of one
/// tensor; the weights change once every tensor the model reads has come.
async fn update_named_param(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return super::admin::fail(e);
    }
    let parsed = (|| {
        let r: NamedParam = parse(&body(b)?)?;
        let dtype = DType::from_any_name(&r.dtype).ok_or_else(|| {
            ApiError::bad(
                "dtype",
                format!(
                    "tensor {:?}: dtype {:?} (torch.bfloat16, torch.float16 or torch.float32)",
                    r.name, r.dtype
                ),
            )
        })?;
        let t = TensorMeta {
            name: r.name,
            dtype,
            shape: r.shape,
        };
        if t.shape.len() > 8 || t.bytes().is_none_or(|b| b > st.max_push_bytes) {
            return Err(ApiError::bad(
                "shape",
                format!("tensor {:?}: shape {:?}", t.name, t.shape),
            ));
        }
        Ok(t)
    })();
    let t = match parsed {
        Ok(t) => t,
        Err(e) => return super::admin::fail(e),
    };
    if let Some(why) = late_failure() {
        return super::admin::fail(ApiError::new(
            StatusCode::CONFLICT,
            format!("an earlier /update_named_param/ failed after its answer: {why}; close the communicator and init it again"),
        ));
    }
    if let Err(e) = st.accepting() {
        return super::admin::fail(e);
    }
    let name = t.name.clone();
    let op = ControlOp::Receive {
        group: GROUP.into(),
        tensors: vec![t],
        timeout_s: GROUP_TIMEOUT_S,
        packed: None,
        commit: Commit::WhenComplete(UpdateReq {
            version: None,
            policy: Policy::Wait,
        }),
    };
    let st2 = st.clone();
    tokio::spawn(async move {
        let r = super::admin::command(&st2, op).await;
        if !r.status().is_success() {
            let status = r.status();
            let text = axum::body::to_bytes(r.into_body(), 1 << 16)
                .await
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            tracing::warn!(%status, "receiving {name:?} from the trainer failed: {text}");
            *LATE_FAILURE
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(format!("receiving {name:?} ({status}): {text}"));
        }
    });
    Json(json!({"message": "Request received, updating named parameter"})).into_response()
}

async fn close_communicator(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return super::admin::fail(e);
    }
    if let Some(why) = late_failure() {
        tracing::warn!("closing the communicator after a failed receive: {why}");
    }
    let r = super::admin::command(&st, ControlOp::DestroyGroup { name: GROUP.into() }).await;
    // None open (the one conflict a destroy has) is what closing asks for: TRL's client
    // closes at exit.
    if r.status().is_success() || r.status() == StatusCode::CONFLICT {
        return Json(json!({"message": "Request received, closing communicator"})).into_response();
    }
    r
}
