//! prime-rl's inference-server routes (`src/prime_rl/inference/vllm/server.py`), as its
//! orchestrator calls them (`src/prime_rl/utils/client.py`):
//!
//! - `POST /init_broadcaster {host, port, rank_offset, inference_world_size, timeout,
//!   quantize_in_weight_transfer, session_id}`: every rank joins the trainer's vLLM-style
//!   group (`StatelessProcessGroup` on the trainer's store, the trainer at rank 0) as
//!   rank `rank_offset + rank + 1` of `inference_world_size + 1`, as prime-rl's NCCL
//!   worker (`worker/nccl.py`) does;
//! - `POST /update_weights {weight_dir}`: after `/init_broadcaster`, receives one update
//!   in band over that group (`batching::in_band`); without it, reads the checkpoint the
//!   trainer wrote in `weight_dir` (prime-rl's filesystem worker);
//! - `GET /liveness`.
//!
//! Both updates are atomic as everywhere in arbor: staged, then swapped in at once; the
//! requests in flight (the orchestrator pauses with mode `keep` first) re-run on the new
//! weights, so every response comes from one version.

use std::path::PathBuf;
use std::sync::Arc;

use arbor_collective::tcp_store::stateless_broadcast_key;
use arbor_model::batching::{IdFormat, Rendezvous};
use arbor_serving::{Commit, ControlOp, Policy, UpdateReq};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use super::admin::{command, fail, master_address, master_port, parse, timeout};
use super::api::ApiError;
use super::state::{AppState, PRIME_RL_GROUP};

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/init_broadcaster", post(init))
        .route("/liveness", get(liveness))
}

/// The body of `/init_broadcaster` (`init_nccl_broadcast`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Init {
    host: String,
    port: Value,
    rank_offset: usize,
    inference_world_size: usize,
    timeout: Option<f64>,
    #[serde(default)]
    quantize_in_weight_transfer: bool,
    /// NIXL's session; the NCCL worker drops it.
    #[allow(dead_code)]
    session_id: Option<String>,
}

fn init_op(st: &AppState, i: Init) -> Result<(ControlOp, f64), ApiError> {
    if i.quantize_in_weight_transfer {
        return Err(ApiError::bad(
            "quantize_in_weight_transfer",
            "quantize_in_weight_transfer (vLLM's FP8 kernel layout) is not supported: arbor takes the checkpoint's tensors",
        ));
    }
    let tp = st.tp;
    // prime-rl's rank_offset counts inference GPUs from 0; the trainer is rank 0.
    let rank_offset = i.rank_offset + 1;
    let world = i.inference_world_size.saturating_add(1);
    if i.inference_world_size < i.rank_offset + tp || world > 1 << 16 {
        return Err(ApiError::bad(
            "inference_world_size",
            format!(
                "inference_world_size {} cannot hold GPUs {}..{} (this server's {tp} ranks after rank_offset {})",
                i.inference_world_size,
                i.rank_offset,
                i.rank_offset + tp,
                i.rank_offset
            ),
        ));
    }
    let t = timeout(i.timeout).map_err(|e| rename(e, "timeout"))?;
    let op = ControlOp::InitGroup {
        name: PRIME_RL_GROUP.into(),
        rendezvous: Rendezvous::Store {
            host: master_address(&i.host).map_err(|e| rename(e, "host"))?,
            port: master_port(&i.port).map_err(|e| rename(e, "port"))?,
            key: stateless_broadcast_key(0, 0),
            format: IdFormat::VllmPickle,
        },
        world,
        rank_offset,
        timeout_s: t,
    };
    Ok((op, t))
}

/// An error of a shared check, named by prime-rl's field.
fn rename(mut e: ApiError, param: &str) -> ApiError {
    e.param = Some(param.to_string().into());
    e
}

async fn init(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return fail(e);
    }
    let parsed = super::admin::body(b)
        .and_then(|b| parse::<Init>(&b))
        .and_then(|i| init_op(&st, i));
    let (op, t) = match parsed {
        Ok(x) => x,
        Err(e) => return fail(e),
    };
    let r = with_status(command(&st, op).await).await;
    if r.status().is_success() {
        *st.prime_broadcaster
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(t);
    }
    r
}

/// `/update_weights {"weight_dir": ...}`: the command it runs.
pub(super) fn update_op(
    st: &AppState,
    body: &serde_json::Map<String, Value>,
) -> Result<ControlOp, ApiError> {
    if let Some(k) = body.keys().find(|k| *k != "weight_dir") {
        return Err(ApiError::bad(
            k.clone(),
            format!("the field {k:?} is not supported by this server (prime-rl's /update_weights takes weight_dir)"),
        ));
    }
    let update = UpdateReq {
        version: None,
        policy: Policy::Retract,
    };
    let broadcaster = *st
        .prime_broadcaster
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(timeout_s) = broadcaster {
        // prime-rl's NCCL worker ignores the directory (the trainer's marker lives there).
        return Ok(ControlOp::ReceiveInBand {
            group: PRIME_RL_GROUP.into(),
            timeout_s,
            max_bytes: st.max_push_bytes,
            commit: Commit::Now(update),
        });
    }
    let dir = match body.get("weight_dir") {
        Some(Value::String(d)) if !d.is_empty() => PathBuf::from(d),
        _ => {
            return Err(ApiError::bad(
                "weight_dir",
                "weight_dir must name the directory of the trainer's checkpoint (or call /init_broadcaster first to receive the weights over NCCL)",
            ))
        }
    };
    if !dir.is_dir() {
        return Err(ApiError::bad(
            "weight_dir",
            format!("{} is not a directory on the server", dir.display()),
        ));
    }
    Ok(ControlOp::FromDisk { path: dir, update })
}

/// A success answered as prime-rl's server answers (`{"status": "ok"}`), arbor's fields
/// beside it.
pub(super) async fn with_status(r: Response) -> Response {
    if !r.status().is_success() {
        return r;
    }
    let (parts, body) = r.into_parts();
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => {
            return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
        }
    };
    let mut v: Value = serde_json::from_slice(&bytes).unwrap_or_else(|_| json!({}));
    if let Value::Object(o) = &mut v {
        o.insert("status".into(), json!("ok"));
    }
    (parts.status, Json(v)).into_response()
}

async fn liveness(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return fail(e);
    }
    Json(json!({"status": "ok"})).into_response()
}
