//! The RL and operations routes (docs/rl.md): weight updates (from disk, pushed over
//! HTTP, broadcast over NCCL), the weight version, generation pause / continue / abort,
//! memory release / resume and cache flush. The names are SGLang's (vLLM's `/sleep`,
//! `/wake_up`, `/is_sleeping` and `/reset_prefix_cache` are aliases). Every route needs
//! the API key when one is set; bodies are bounded; each route parses its body into a
//! `ControlOp`, the serving loop answers it, and an operation it cannot apply changes
//! nothing.

use std::path::PathBuf;
use std::sync::Arc;

use arbor_collective::tcp_store::{stateless_broadcast_key, torch_group_id_key};
use arbor_model::batching::{IdFormat, Rendezvous, TensorMeta};
use arbor_model::DType;
use arbor_serving::{Commit, ControlOp, Policy, RefusalKind, UpdateReq};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{body_error, ApiError};
use super::conn::UPLOAD_PATH;
use super::state::AppState;

/// Longest weight version and group name.
const MAX_NAME: usize = 128;
/// Most tensors one `/update_weights_from_distributed` call may list.
const MAX_TENSORS: usize = 1 << 16;
/// Default and largest wait for the trainer in the NCCL group (join, each broadcast).
const GROUP_TIMEOUT_S: f64 = 120.0;
const MAX_GROUP_TIMEOUT_S: f64 = 3600.0;

/// A weight version: what responses report. Printable, at most 128 bytes.
pub fn check_version(v: &str) -> Result<(), String> {
    if v.is_empty() || v.len() > MAX_NAME || v.chars().any(char::is_control) {
        return Err(format!(
            "a weight version is 1 to {MAX_NAME} bytes without control characters, got {v:?}"
        ));
    }
    Ok(())
}

pub fn routes(max_upload: usize) -> Router<Arc<AppState>> {
    Router::new()
        .route("/update_weights_from_disk", post(from_disk))
        .route(
            UPLOAD_PATH,
            post(from_tensor).layer(DefaultBodyLimit::max(max_upload)),
        )
        .route("/init_weights_update_group", post(init_group))
        .route("/update_weights_from_distributed", post(from_distributed))
        .route("/destroy_weights_update_group", post(destroy_group))
        .route("/get_weight_version", get(weight_version))
}

/// An admin error: the OpenAI error body with SGLang's `success` / `message` beside it.
pub(super) fn fail(e: ApiError) -> Response {
    let mut body = e.body();
    body["success"] = json!(false);
    body["message"] = json!(e.message);
    (e.status, Json(body)).into_response()
}

/// A JSON body of `T` (unknown fields refused); an empty body is `{}`.
pub(super) fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    let v: Value = serde_json::from_slice(text)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the request body must be a JSON object",
        ));
    }
    serde_json::from_value(v).map_err(|e| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("invalid request: {e}"),
        )
    })
}

/// The HTTP status of a refused operation.
fn status(kind: RefusalKind) -> StatusCode {
    match kind {
        RefusalKind::Input => StatusCode::BAD_REQUEST,
        RefusalKind::Conflict => StatusCode::CONFLICT,
        RefusalKind::Failed => StatusCode::INTERNAL_SERVER_ERROR,
        RefusalKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// Hands `op` to the serving loop and waits for its answer.
pub(super) async fn command(st: &AppState, op: ControlOp) -> Response {
    if let Err(e) = st.accepting() {
        return fail(e);
    }
    match st.handle.control(op).await {
        Ok(body) => {
            log_update(&body);
            Json(body).into_response()
        }
        Err(r) => fail(ApiError::new(status(r.kind), r.message)),
    }
}

/// The server's log line for weights that changed.
fn log_update(body: &Value) {
    if let (Some(old), Some(new), Some(seconds)) = (
        body["previous_weight_version"].as_str(),
        body["weight_version"].as_str(),
        body["seconds"].as_f64(),
    ) {
        eprintln!("arbor serve: weights updated in {seconds:.2} s: version {old} -> {new}");
    }
}

/// Runs `f` (which parses and validates) after the API key check, then the command.
pub(super) async fn guarded(
    st: Arc<AppState>,
    headers: HeaderMap,
    f: impl FnOnce() -> Result<ControlOp, ApiError>,
) -> Response {
    guarded_opt(st, headers, || f().map(Some)).await
}

/// [`guarded`] for a request that may name nothing to do (`None`: success at once).
pub(super) async fn guarded_opt(
    st: Arc<AppState>,
    headers: HeaderMap,
    f: impl FnOnce() -> Result<Option<ControlOp>, ApiError>,
) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return fail(e);
    }
    match f() {
        Ok(Some(op)) => command(&st, op).await,
        Ok(None) => Json(json!({"success": true, "message": "nothing to do"})).into_response(),
        Err(e) => fail(e),
    }
}

pub(super) fn body(b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(body_error)
}

/// The requests in flight during an update: `policy`, or SGLang's `abort_all_requests`.
pub(super) fn update_req(
    version: Option<String>,
    policy: Option<&str>,
    abort_all: Option<bool>,
) -> Result<UpdateReq, ApiError> {
    if let Some(v) = &version {
        check_version(v).map_err(|m| ApiError::bad("weight_version", m))?;
    }
    let policy = match (policy, abort_all) {
        (None, Some(true)) | (Some("abort"), _) => Policy::Abort,
        (Some("wait") | None, None | Some(false)) => Policy::Wait,
        (Some("retract"), None | Some(false)) => Policy::Retract,
        (Some(p @ ("wait" | "retract")), Some(true)) => {
            return Err(ApiError::bad(
                "abort_all_requests",
                format!("abort_all_requests: true contradicts policy {p:?}"),
            ))
        }
        (Some(other), _) => {
            return Err(ApiError::bad(
                "policy",
                format!("policy must be \"wait\", \"retract\" or \"abort\", got {other:?}"),
            ))
        }
    };
    Ok(UpdateReq { version, policy })
}

pub(super) fn model_path(p: &str) -> Result<PathBuf, ApiError> {
    let path = PathBuf::from(p);
    if !path.exists() {
        return Err(ApiError::bad(
            "model_path",
            format!(
                "{p:?} does not exist on the server (what --model takes: an HF model directory with config.json and *.safetensors, or a GGUF file)"
            ),
        ));
    }
    Ok(path)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FromDisk {
    model_path: String,
    weight_version: Option<String>,
    policy: Option<String>,
    #[serde(alias = "abort_all_request")]
    abort_all_requests: Option<bool>,
    /// Accepted for SGLang's clients: the cache is always dropped.
    #[allow(dead_code)]
    flush_cache: Option<bool>,
    load_format: Option<String>,
}

async fn from_disk(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    guarded(st, headers, || {
        let r: FromDisk = parse(&body(b)?)?;
        if let Some(f) = r.load_format.as_deref() {
            if !matches!(f, "auto" | "safetensors") {
                return Err(ApiError::bad(
                    "load_format",
                    format!(
                        "load_format {f:?}: arbor reads safetensors (\"auto\" or \"safetensors\")"
                    ),
                ));
            }
        }
        Ok(ControlOp::FromDisk {
            path: model_path(&r.model_path)?,
            update: update_req(r.weight_version, r.policy.as_deref(), r.abort_all_requests)?,
        })
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TensorQuery {
    commit: Option<bool>,
    discard: Option<bool>,
    weight_version: Option<String>,
    policy: Option<String>,
    abort_all_requests: Option<bool>,
}

/// The body is one safetensors image (a part of the checkpoint), or with `Content-Type:
/// application/json` SGLang's JSON of CUDA IPC handles (ipc.rs); `?commit=false` stages
/// it and waits for more, `?commit=true` stages it and applies everything staged, and
/// without `commit` it applies once every tensor the model reads is staged; an empty body
/// with `commit=true` applies what is staged; `?discard=true` drops it.
async fn from_tensor(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    q: Result<Query<TensorQuery>, axum::extract::rejection::QueryRejection>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let json = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"));
    let tp = st.tp;
    guarded(st, headers, || {
        let Query(q) = q.map_err(|e| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("invalid query: {}", e.body_text()),
            )
        })?;
        let bytes = body(b)?;
        if q.discard == Some(true) {
            if !bytes.is_empty() || q.commit == Some(true) {
                return Err(ApiError::bad(
                    "discard",
                    "discard=true takes no body and no commit",
                ));
            }
            return Ok(ControlOp::Discard);
        }
        // An empty body is a commit or discard, whatever its content type.
        if json && !bytes.iter().all(u8::is_ascii_whitespace) {
            if q.weight_version.is_some() || q.policy.is_some() || q.abort_all_requests.is_some() {
                return Err(ApiError::bad(
                    "weight_version",
                    "with a JSON body, weight_version, policy and abort_all_requests go in the body",
                ));
            }
            let r: super::ipc::FromTensorIpc = parse(&bytes)?;
            let ranks = super::ipc::ranks(&r, tp)?;
            let commit = commit_of(q.commit, r.weight_version, r.policy, r.abort_all_requests)?;
            return Ok(ControlOp::StageIpc { ranks, commit });
        }
        let commit = commit_of(q.commit, q.weight_version, q.policy, q.abort_all_requests)?;
        Ok(match (bytes.is_empty(), commit) {
            (true, Commit::Now(u) | Commit::WhenComplete(u)) => ControlOp::Commit(u),
            (true, Commit::No) => {
                return Err(ApiError::bad(
                    "body",
                    "the body is empty: send a safetensors image of some of the tensors",
                ))
            }
            (false, commit) => ControlOp::Stage {
                bytes: Vec::from(bytes),
                commit,
            },
        })
    })
    .await
}

/// When a pushed part applies (`commit` of the query), and the update it is part of.
fn commit_of(
    commit: Option<bool>,
    version: Option<String>,
    policy: Option<String>,
    abort_all: Option<bool>,
) -> Result<Commit, ApiError> {
    Ok(match commit {
        Some(false) => {
            if version.is_some() || policy.is_some() {
                return Err(ApiError::bad(
                    "commit",
                    "weight_version and policy go with the call that commits (commit=true, or no commit)",
                ));
            }
            Commit::No
        }
        given => {
            let u = update_req(version, policy.as_deref(), abort_all)?;
            if given.is_some() {
                Commit::Now(u)
            } else {
                Commit::WhenComplete(u)
            }
        }
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InitGroup {
    /// The trainer's torch `TCPStore` (its rendezvous `tcp://master_address:master_port`),
    /// where the group's rank 0 publishes the NCCL id.
    master_address: Option<String>,
    /// A number, or a string of one (AReaL sends a string).
    master_port: Option<Value>,
    rank_offset: usize,
    world_size: usize,
    group_name: String,
    backend: Option<String>,
    /// The trainer's `ncclUniqueId` instead of a store: 256 hex digits, or 128 bytes.
    unique_id: Option<Value>,
    /// How the trainer made the group on its store: `torch` (default: torch.distributed's
    /// `ProcessGroupNCCL`, as SGLang's `init_custom_process_group` makes it) or `vllm`
    /// (vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`).
    rendezvous: Option<String>,
    /// SkyRL's: `true` would replace a group of the same name; arbor holds one group, which
    /// must be destroyed first.
    override_existing: Option<bool>,
    timeout_s: Option<f64>,
}

/// The store's port: a number, or a string of one.
pub(super) fn master_port(v: &Value) -> Result<u16, ApiError> {
    let port = match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) if !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit()) => {
            s.parse::<u64>().ok()
        }
        _ => None,
    };
    port.and_then(|p| u16::try_from(p).ok())
        .filter(|&p| p > 0)
        .ok_or_else(|| {
            ApiError::bad(
                "master_port",
                format!("master_port is the port of the trainer's TCPStore, 1 to 65535 (a number or a string of digits), got {v}"),
            )
        })
}

pub(super) fn master_address(a: &str) -> Result<String, ApiError> {
    if a.is_empty() || a.len() > 253 || a.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ApiError::bad(
            "master_address",
            format!("master_address is the host name or IP address of the trainer's TCPStore, got {a:?}"),
        ));
    }
    // A bracketed IPv6 address (as in a URL) is the address inside.
    Ok(a.trim_start_matches('[').trim_end_matches(']').to_string())
}

/// Where every rank learns the group's NCCL id.
fn rendezvous(r: &InitGroup, name: &str) -> Result<Rendezvous, ApiError> {
    let store = r.master_address.is_some() || r.master_port.is_some();
    match (&r.unique_id, store) {
        (Some(_), true) => Err(ApiError::bad(
            "unique_id",
            "give unique_id or master_address and master_port, not both",
        )),
        (Some(id), false) => {
            if r.rendezvous.is_some() {
                return Err(ApiError::bad(
                    "rendezvous",
                    "rendezvous names how the trainer's store holds the NCCL id: it goes with master_address and master_port",
                ));
            }
            Ok(Rendezvous::UniqueId(unique_id(id)?))
        }
        (None, false) => Err(ApiError::bad(
            "master_address",
            "give master_address and master_port (the trainer's torch TCPStore, as SGLang takes them), or unique_id (the trainer's ncclUniqueId)",
        )),
        (None, true) => {
            let host = master_address(r.master_address.as_deref().ok_or_else(|| {
                ApiError::bad("master_address", "master_port goes with master_address")
            })?)?;
            let port = master_port(r.master_port.as_ref().ok_or_else(|| {
                ApiError::bad("master_port", "master_address goes with master_port")
            })?)?;
            let (key, format) = match r.rendezvous.as_deref().unwrap_or("torch") {
                "torch" => (torch_group_id_key(name, "cuda", 0), IdFormat::Raw),
                "vllm" => (stateless_broadcast_key(0, 0), IdFormat::VllmPickle),
                other => {
                    return Err(ApiError::bad(
                        "rendezvous",
                        format!("rendezvous must be \"torch\" (torch.distributed's process group, as SGLang's clients make it) or \"vllm\" (vLLM's StatelessProcessGroup and PyNcclCommunicator), got {other:?}"),
                    ))
                }
            };
            Ok(Rendezvous::Store {
                host,
                port,
                key,
                format,
            })
        }
    }
}

fn unique_id(v: &Value) -> Result<Vec<u8>, ApiError> {
    let bad = || {
        ApiError::bad(
            "unique_id",
            "unique_id is the trainer's 128-byte ncclUniqueId: 256 hex digits or a list of 128 integers 0..=255",
        )
    };
    let bytes: Vec<u8> = match v {
        Value::String(s) => {
            if s.len() != 256 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad());
            }
            (0..128)
                .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16))
                .collect::<Result<_, _>>()
                .map_err(|_| bad())?
        }
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_u64().and_then(|x| u8::try_from(x).ok()))
            .collect::<Option<_>>()
            .ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    if bytes.len() != 128 {
        return Err(bad());
    }
    Ok(bytes)
}

fn group_name(n: &str) -> Result<String, ApiError> {
    if n.is_empty() || n.len() > MAX_NAME || n.chars().any(char::is_control) {
        return Err(ApiError::bad(
            "group_name",
            format!("group_name is 1 to {MAX_NAME} bytes without control characters"),
        ));
    }
    Ok(n.to_string())
}

pub(super) fn timeout(t: Option<f64>) -> Result<f64, ApiError> {
    let t = t.unwrap_or(GROUP_TIMEOUT_S);
    if !(t.is_finite() && t > 0.0 && t <= MAX_GROUP_TIMEOUT_S) {
        return Err(ApiError::bad(
            "timeout_s",
            format!("timeout_s must be in (0, {MAX_GROUP_TIMEOUT_S}], got {t}"),
        ));
    }
    Ok(t)
}

async fn init_group(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let tp = st.tp;
    guarded(st, headers, || {
        let r: InitGroup = parse(&body(b)?)?;
        if let Some(be) = r.backend.as_deref() {
            if be != "nccl" {
                return Err(ApiError::bad(
                    "backend",
                    format!("backend {be:?}: arbor's weight-update group is NCCL (\"nccl\")"),
                ));
            }
        }
        if r.override_existing == Some(true) {
            return Err(ApiError::bad(
                "override_existing",
                "arbor holds one weight-update group: destroy_weights_update_group first, then init the new one",
            ));
        }
        let name = group_name(&r.group_name)?;
        let rendezvous = rendezvous(&r, &name)?;
        if r.rank_offset == 0 {
            return Err(ApiError::bad(
                "rank_offset",
                "rank_offset must be at least 1: the trainer is rank 0 of the group (it makes the NCCL id, and its store where it publishes it)",
            ));
        }
        if r.world_size < r.rank_offset + tp || r.world_size > 1 << 16 {
            return Err(ApiError::bad(
                "world_size",
                format!(
                    "world_size {} cannot hold ranks {}..{} (arbor's {tp} ranks after rank_offset)",
                    r.world_size,
                    r.rank_offset,
                    r.rank_offset + tp
                ),
            ));
        }
        Ok(ControlOp::InitGroup {
            name,
            rendezvous,
            world: r.world_size,
            rank_offset: r.rank_offset,
            timeout_s: timeout(r.timeout_s)?,
        })
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FromDistributed {
    names: Vec<String>,
    dtypes: Vec<String>,
    shapes: Vec<Vec<usize>>,
    group_name: String,
    weight_version: Option<String>,
    /// False: stage these and wait for more calls; true: apply everything staged now;
    /// none: apply once every tensor the model reads is staged.
    commit: Option<bool>,
    /// SGLang's (a quantised or delta format); arbor takes the tensors as they are.
    load_format: Option<String>,
    policy: Option<String>,
    abort_all_requests: Option<bool>,
    #[allow(dead_code)]
    flush_cache: Option<bool>,
    timeout_s: Option<f64>,
}

/// The tensors a trainer lists for a broadcast (`names`, `dtypes`, `shapes` under the
/// client's own field names), checked: the same count of each, 1..=MAX_TENSORS, a dtype
/// the model reads, a shape whose bytes fit, and at most `max_bytes` in all.
pub(super) fn tensor_list(
    [names_f, dtypes_f, shapes_f]: [&'static str; 3],
    names: Vec<String>,
    dtypes: &[String],
    shapes: Vec<Vec<usize>>,
    max_bytes: usize,
) -> Result<Vec<TensorMeta>, ApiError> {
    let short = |f: &str| f.rsplit('.').next().unwrap_or(f).to_string();
    let n = names.len();
    if n == 0 || n > MAX_TENSORS || dtypes.len() != n || shapes.len() != n {
        return Err(ApiError::bad(
            names_f,
            format!(
                "{}, {} and {} must list the same 1..={MAX_TENSORS} tensors (got {n}, {}, {})",
                short(names_f),
                short(dtypes_f),
                short(shapes_f),
                dtypes.len(),
                shapes.len()
            ),
        ));
    }
    let mut tensors = Vec::with_capacity(n);
    let mut total = 0usize;
    for ((name, dtype), shape) in names.into_iter().zip(dtypes).zip(shapes) {
        let dt = DType::from_any_name(dtype).ok_or_else(|| {
            ApiError::bad(
                dtypes_f,
                format!("tensor {name:?}: dtype {dtype:?} is not one the model reads (bfloat16, float16 or float32)"),
            )
        })?;
        let t = TensorMeta {
            name,
            dtype: dt,
            shape,
        };
        let bytes = t.bytes().filter(|_| t.shape.len() <= 8).ok_or_else(|| {
            ApiError::bad(
                shapes_f,
                format!("tensor {:?}: shape {:?}", t.name, t.shape),
            )
        })?;
        total = total.saturating_add(bytes);
        tensors.push(t);
    }
    if total > max_bytes {
        return Err(ApiError::bad(
            shapes_f,
            format!("the tensors hold {total} bytes, more than the whole model in float32 ({max_bytes})"),
        ));
    }
    Ok(tensors)
}

async fn from_distributed(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let max_bytes = st.max_push_bytes;
    guarded(st, headers, || {
        let r: FromDistributed = parse(&body(b)?)?;
        let tensors = tensor_list(["names", "dtypes", "shapes"], r.names, &r.dtypes, r.shapes, max_bytes)?;
        if let Some(f) = r.load_format.as_deref() {
            return Err(ApiError::bad(
                "load_format",
                format!("load_format {f:?}: arbor receives the tensors as they are named and shaped (leave load_format out)"),
            ));
        }
        let update = update_req(r.weight_version, r.policy.as_deref(), r.abort_all_requests)?;
        let commit = match r.commit {
            None => Commit::WhenComplete(update),
            Some(true) => Commit::Now(update),
            Some(false) => Commit::No,
        };
        Ok(ControlOp::Receive {
            group: group_name(&r.group_name)?,
            tensors,
            timeout_s: timeout(r.timeout_s)?,
            packed: None,
            commit,
        })
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DestroyGroup {
    group_name: String,
}

async fn destroy_group(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let prime = super::state::PRIME_RL_GROUP;
    let leaves_prime = matches!(&b, Ok(bytes) if parse::<DestroyGroup>(bytes).is_ok_and(|r| r.group_name == prime));
    let st2 = st.clone();
    let r = guarded(st, headers, || {
        let r: DestroyGroup = parse(&body(b)?)?;
        Ok(ControlOp::DestroyGroup {
            name: group_name(&r.group_name)?,
        })
    })
    .await;
    // prime-rl's /update_weights reads the directory again once its group is gone.
    if leaves_prime && r.status().is_success() {
        *st2.prime_broadcaster
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
    }
    r
}

async fn weight_version(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return fail(e);
    }
    Json(json!({"weight_version": st.stats.weight_version()})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_are_hex_or_bytes() {
        let hex = "0a".repeat(128);
        assert_eq!(unique_id(&json!(hex)).unwrap(), vec![10u8; 128]);
        assert_eq!(
            unique_id(&json!(vec![255u8; 128])).unwrap(),
            vec![255u8; 128]
        );
        for bad in [
            json!("0a".repeat(127)),
            json!("zz".repeat(128)),
            json!(vec![1u8; 127]),
            json!(vec![256u32; 128]),
            json!(7),
        ] {
            assert_eq!(
                unique_id(&bad).unwrap_err().param.as_deref(),
                Some("unique_id"),
                "{bad}"
            );
        }
    }

    fn init(body: Value) -> InitGroup {
        serde_json::from_value(body).expect("an InitGroup body")
    }

    #[test]
    fn the_store_port_is_a_number_or_a_string_of_one() {
        assert_eq!(master_port(&json!(29500)).unwrap(), 29500);
        assert_eq!(master_port(&json!("29500")).unwrap(), 29500);
        for bad in [
            json!(0),
            json!(65536),
            json!(-3),
            json!("29 500"),
            json!(""),
            json!(1.5),
            json!(null),
        ] {
            assert_eq!(
                master_port(&bad).unwrap_err().param.as_deref(),
                Some("master_port"),
                "{bad}"
            );
        }
        assert_eq!(master_address("[::1]").unwrap(), "::1");
        assert!(master_address("host name").is_err());
    }

    #[test]
    fn the_rendezvous_key_is_the_one_the_trainer_writes() {
        let base = json!({"master_address": "10.0.0.2", "master_port": "4000", "rank_offset": 1,
                          "world_size": 2, "group_name": "slime-pp_0"});
        let Rendezvous::Store {
            host,
            port,
            key,
            format,
        } = rendezvous(&init(base.clone()), "slime-pp_0").unwrap()
        else {
            panic!("a store rendezvous");
        };
        assert_eq!(
            (host.as_str(), port, key.as_str(), format),
            (
                "10.0.0.2",
                4000,
                "slime-pp_0/slime-pp_0//cuda//0",
                IdFormat::Raw
            )
        );
        let mut vllm = base.clone();
        vllm["rendezvous"] = json!("vllm");
        let Rendezvous::Store { key, format, .. } = rendezvous(&init(vllm), "slime-pp_0").unwrap()
        else {
            panic!("a store rendezvous");
        };
        assert_eq!(
            (key.as_str(), format),
            ("broadcast_from/0/0", IdFormat::VllmPickle)
        );
        let by_id = json!({"unique_id": "ab".repeat(128), "rank_offset": 1, "world_size": 2, "group_name": "g"});
        assert_eq!(
            rendezvous(&init(by_id), "g").unwrap(),
            Rendezvous::UniqueId(vec![0xab; 128])
        );
    }

    #[test]
    fn policies_and_sglang_abort_all() {
        let p = |policy: Option<&str>, abort: Option<bool>| {
            update_req(None, policy, abort).map(|u| u.policy)
        };
        assert_eq!(p(None, None).unwrap(), Policy::Wait);
        assert_eq!(p(None, Some(true)).unwrap(), Policy::Abort);
        assert_eq!(p(Some("retract"), Some(false)).unwrap(), Policy::Retract);
        assert_eq!(p(Some("abort"), Some(true)).unwrap(), Policy::Abort);
        assert_eq!(
            p(Some("retract"), Some(true)).unwrap_err().param.as_deref(),
            Some("abort_all_requests")
        );
        assert_eq!(
            p(Some("later"), None).unwrap_err().param.as_deref(),
            Some("policy")
        );
        assert!(update_req(Some("".into()), None, None).is_err());
        assert!(update_req(Some("step\n1".into()), None, None).is_err());
        assert!(update_req(Some("step-1".into()), None, None).is_ok());
    }
}
