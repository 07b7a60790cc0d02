//! vLLM's weight-transfer routes (`vllm/entrypoints/serve/rlhf/api_router.py`, NCCL
//! backend `vllm/distributed/weight_transfer/nccl_engine.py`), which SkyRL, TRL and
//! NeMo-RL drive: `/init_weight_transfer_engine` joins the trainer's group (vLLM's
//! `StatelessProcessGroup` on the trainer's store, the trainer at rank 0),
//! `/start_weight_update`, `/update_weights` (names, `dtype_names`, shapes, and `packed`:
//! the tensors in a few `uint8` buffers) and `/finish_weight_update`; and SkyRL's
//! `/collective_rpc` calls of the same three steps.
//!
//! An update stays atomic as everywhere in arbor: the tensors are staged until every one
//! the model reads has arrived, then replace the weights at once. The requests in flight
//! (a trainer pauses with mode `keep` first) re-run from their prompts on the new weights,
//! so every response comes from one version.

use std::sync::Arc;

use arbor_collective::tcp_store::stateless_broadcast_key;
use arbor_model::batching::packed::DEFAULT_BUFFER_BYTES;
use arbor_model::batching::{IdFormat, Rendezvous, TensorMeta};
use arbor_serving::{Commit, ControlOp, Policy, UpdateReq};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::admin::{body, command, fail, master_address, master_port, timeout};
use super::api::ApiError;
use super::state::AppState;

/// The name arbor gives the group vLLM's API leaves unnamed.
pub const GROUP: &str = "vllm-weight-transfer";

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/init_weight_transfer_engine", post(init))
        .route("/start_weight_update", post(start))
        .route("/update_weights", post(update))
        .route("/finish_weight_update", post(finish))
        .route("/collective_rpc", post(collective_rpc))
}

/// The body as a JSON object (400 otherwise, as vLLM answers).
fn object(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    match serde_json::from_slice(text) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("invalid JSON body: {e}"),
        )),
    }
}

/// `obj[key]` as `T`, refusing unknown fields with `key.field` named.
fn field<T: serde::de::DeserializeOwned>(
    obj: &mut Map<String, Value>,
    key: &'static str,
) -> Result<T, ApiError> {
    let v = obj
        .remove(key)
        .filter(|v| !v.is_null())
        .ok_or_else(|| ApiError::bad(key, format!("Missing '{key}' in request body")))?;
    if !v.is_object() {
        return Err(ApiError::bad(key, format!("{key} must be an object")));
    }
    serde_json::from_value(v).map_err(|e| {
        let msg = e.to_string();
        // serde names an unknown field as "unknown field `x`".
        let param = msg
            .split('`')
            .nth(1)
            .map_or_else(|| key.to_string(), |f| format!("{key}.{f}"));
        ApiError::bad(param, format!("invalid {key}: {msg}"))
    })
}

fn no_other_fields(obj: &Map<String, Value>) -> Result<(), ApiError> {
    match obj.keys().next() {
        Some(k) => Err(ApiError::bad(
            k.clone(),
            format!("the field {k:?} is not supported by this server"),
        )),
        None => Ok(()),
    }
}

/// `NCCLWeightTransferInitInfo`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InitInfo {
    master_address: Option<String>,
    master_port: Option<Value>,
    rank_offset: Option<usize>,
    world_size: Option<usize>,
}

fn init_op(st: &AppState, mut obj: Map<String, Value>) -> Result<ControlOp, ApiError> {
    let i: InitInfo = field(&mut obj, "init_info")?;
    no_other_fields(&obj)?;
    let (Some(addr), Some(port), Some(rank_offset), Some(world)) =
        (i.master_address, i.master_port, i.rank_offset, i.world_size)
    else {
        return Err(ApiError::bad(
            "init_info",
            "init_info needs master_address, master_port, rank_offset and world_size: arbor's weight transfer is the NCCL backend (the IPC backend's empty init_info is not supported)",
        ));
    };
    let tp = st.tp;
    if rank_offset == 0 {
        return Err(ApiError::bad(
            "init_info.rank_offset",
            "rank_offset must be at least 1: the trainer is rank 0 of the group",
        ));
    }
    if world < rank_offset + tp || world > 1 << 16 {
        return Err(ApiError::bad(
            "init_info.world_size",
            format!(
                "world_size {world} cannot hold ranks {rank_offset}..{} (arbor's {tp} ranks after rank_offset)",
                rank_offset + tp
            ),
        ));
    }
    Ok(ControlOp::InitGroup {
        name: GROUP.into(),
        rendezvous: Rendezvous::Store {
            host: master_address(&addr)?,
            port: master_port(&port)?,
            key: stateless_broadcast_key(0, 0),
            format: IdFormat::VllmPickle,
        },
        world,
        rank_offset,
        timeout_s: timeout(None)?,
    })
}

/// `NCCLWeightTransferUpdateInfo`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateInfo {
    names: Vec<String>,
    dtype_names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    #[serde(default)]
    packed: bool,
    packed_buffer_size_bytes: Option<usize>,
    /// How many buffers the trainer fills at once: its streams, not the layout.
    #[allow(dead_code)]
    packed_num_buffers: Option<usize>,
    /// Whether the names are the checkpoint's (vLLM reloads layer by layer then): arbor
    /// always reads the checkpoint's names.
    is_checkpoint_format: Option<bool>,
}

/// The tensors an update lists, checked.
fn tensors(st: &AppState, u: UpdateInfo) -> Result<(Vec<TensorMeta>, Option<usize>), ApiError> {
    let out = super::admin::tensor_list(
        [
            "update_info.names",
            "update_info.dtype_names",
            "update_info.shapes",
        ],
        u.names,
        &u.dtype_names,
        u.shapes,
        st.max_push_bytes,
    )?;
    if u.is_checkpoint_format == Some(false) {
        return Err(ApiError::bad(
            "update_info.is_checkpoint_format",
            "is_checkpoint_format false (vLLM's kernel layout) is not supported: send the checkpoint's tensors",
        ));
    }
    let packed = match (u.packed, u.packed_buffer_size_bytes) {
        (false, _) => None,
        (true, None) => Some(DEFAULT_BUFFER_BYTES),
        (true, Some(0)) => {
            return Err(ApiError::bad(
                "update_info.packed_buffer_size_bytes",
                "packed_buffer_size_bytes must be at least 1",
            ))
        }
        (true, Some(b)) => Some(b),
    };
    Ok((out, packed))
}

/// The requests in flight re-run on the new weights (see the module's comment).
fn update_req() -> UpdateReq {
    UpdateReq {
        version: None,
        policy: Policy::Retract,
    }
}

fn update_op(st: &AppState, update_info: UpdateInfo) -> Result<ControlOp, ApiError> {
    let (tensors, packed) = tensors(st, update_info)?;
    Ok(ControlOp::Receive {
        group: GROUP.into(),
        tensors,
        timeout_s: timeout(None)?,
        packed,
        commit: Commit::WhenComplete(update_req()),
    })
}

/// What a route does: a command, or nothing (vLLM's answer then).
enum Step {
    Op(ControlOp),
    Nothing(Value),
}

async fn run(
    st: Arc<AppState>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
    f: impl FnOnce(&AppState, Map<String, Value>) -> Result<Step, ApiError>,
) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return fail(e);
    }
    match body(b).and_then(|b| object(&b)).and_then(|o| f(&st, o)) {
        Ok(Step::Op(op)) => command(&st, op).await,
        Ok(Step::Nothing(v)) => Json(v).into_response(),
        Err(e) => fail(e),
    }
}

async fn init(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    run(st, headers, b, |st, o| init_op(st, o).map(Step::Op)).await
}

fn start_step(mut o: Map<String, Value>) -> Result<Step, ApiError> {
    if let Some(v) = o.remove("is_checkpoint_format") {
        if v == Value::Bool(false) {
            return Err(ApiError::bad(
                "is_checkpoint_format",
                "is_checkpoint_format false (vLLM's kernel layout) is not supported: send the checkpoint's tensors",
            ));
        }
    }
    no_other_fields(&o)?;
    Ok(Step::Nothing(
        json!({"success": true, "message": "Weight update started"}),
    ))
}

async fn start(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    run(st, headers, b, |_, o| start_step(o)).await
}

async fn update(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let prime =
        matches!(&b, Ok(bytes) if object(bytes).is_ok_and(|o| o.contains_key("weight_dir")));
    let r = run(st, headers, b, |st, mut o| {
        // prime-rl's server takes the same path with its own body.
        if o.contains_key("weight_dir") {
            return super::prime_rl::update_op(st, &o).map(Step::Op);
        }
        let u: UpdateInfo = field(&mut o, "update_info")?;
        no_other_fields(&o)?;
        update_op(st, u).map(Step::Op)
    })
    .await;
    if prime {
        super::prime_rl::with_status(r).await
    } else {
        r
    }
}

async fn finish(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    run(st, headers, b, |_, o| {
        no_other_fields(&o)?;
        Ok(Step::Op(ControlOp::Finish(update_req())))
    })
    .await
}

/// SkyRL's calls of its worker extension's methods through vLLM's `/collective_rpc`
/// (`skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py`): the
/// three steps of an update, by name; any other method is refused.
async fn collective_rpc(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let tp = st.tp;
    let r = run(st, headers, b, |st, mut o| {
        let method = match o.remove("method") {
            Some(Value::String(m)) => m,
            _ => return Err(ApiError::bad("method", "Missing 'method' in request body")),
        };
        // vLLM's own bound on the call: arbor bounds each wait for the trainer itself.
        o.remove("timeout");
        if o.remove("args").is_some_and(|a| !a.as_array().is_some_and(Vec::is_empty)) {
            return Err(ApiError::bad("args", "args is not supported: give kwargs"));
        }
        let mut kwargs = match o.remove("kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(k)) => k,
            Some(_) => return Err(ApiError::bad("kwargs", "kwargs must be an object")),
        };
        no_other_fields(&o)?;
        match method.as_str() {
            "skyrl_start_weight_update" | "start_weight_update" => start_step(kwargs),
            "update_weights_nccl" | "update_weights" => {
                let u: UpdateInfo = field(&mut kwargs, "update_info")?;
                no_other_fields(&kwargs)?;
                update_op(st, u).map(Step::Op)
            }
            "skyrl_finish_weight_update" | "finish_weight_update" => {
                no_other_fields(&kwargs)?;
                Ok(Step::Op(ControlOp::Finish(update_req())))
            }
            other => Err(ApiError::bad(
                "method",
                format!("method {other:?} is not supported: arbor runs skyrl_start_weight_update, update_weights_nccl and skyrl_finish_weight_update (and vLLM's start_weight_update, update_weights, finish_weight_update)"),
            )),
        }
    })
    .await;
    if !r.status().is_success() {
        return r;
    }
    // vLLM answers with each worker's return value (None for these methods).
    Json(json!({"results": vec![Value::Null; tp]})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(v: Value) -> Result<UpdateInfo, ApiError> {
        let mut o = Map::new();
        o.insert("update_info".into(), v);
        field(&mut o, "update_info")
    }

    #[test]
    fn update_info_fields_are_vllms() {
        let u = info(json!({"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]],
                            "packed": true, "packed_buffer_size_bytes": 64, "packed_num_buffers": 2}))
        .unwrap();
        assert!(u.packed);
        assert_eq!(u.packed_buffer_size_bytes, Some(64));
        let e = info(json!({"names": [], "dtype_names": [], "shapes": [], "ipc_handles": {}}))
            .err()
            .unwrap();
        assert_eq!(e.param.as_deref(), Some("update_info.ipc_handles"));
        let mut none = Map::new();
        let e = field::<UpdateInfo>(&mut none, "update_info").err().unwrap();
        assert_eq!(e.message, "Missing 'update_info' in request body");
    }
}
