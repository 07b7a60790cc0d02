//! The generation and memory routes (docs/rl.md): pause / continue / abort, memory release
//! / resume, cache flush and the released state, under SGLang's names (vLLM's are aliases
//! in compat.rs). Each parses its body into a `ControlOp` the serving loop answers.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use arbor_serving::{ControlOp, PauseMode};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::admin::{body, check_version, fail, guarded, guarded_opt, model_path, parse};
use super::api::ApiError;
use super::state::AppState;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/pause_generation", post(pause))
        .route("/continue_generation", post(continue_generation))
        .route("/abort_request", post(abort))
        .route("/release_memory_occupation", post(release))
        .route("/resume_memory_occupation", post(resume))
        .route("/flush_cache", get(flush_cache).post(flush_cache))
        // vLLM's names (more in compat.rs).
        .route("/is_sleeping", get(is_sleeping))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Pause {
    mode: Option<String>,
}

async fn pause(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    guarded(st, headers, || {
        let r: Pause = parse(&body(b)?)?;
        let mode = match r.mode.as_deref().unwrap_or("abort") {
            "abort" => PauseMode::Abort,
            "retract" => PauseMode::Retract,
            "in_place" => PauseMode::InPlace,
            other => {
                return Err(ApiError::bad(
                    "mode",
                    format!("mode must be \"abort\", \"retract\" or \"in_place\", got {other:?}"),
                ))
            }
        };
        Ok(ControlOp::Pause(mode))
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Empty {}

/// SGLang's `/continue_generation`, and vLLM's `/resume`.
pub(super) async fn continue_generation(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    guarded(st, headers, || {
        let _: Continue = parse(&body(b)?)?;
        Ok(ControlOp::Continue)
    })
    .await
}

/// SGLang's `torch_empty_cache` returns the allocator's cached blocks to the driver:
/// memory only, never the output.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Continue {
    #[allow(dead_code)]
    torch_empty_cache: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Abort {
    rid: Option<String>,
    abort_all: Option<bool>,
}

async fn abort(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    guarded(st, headers, || {
        let r: Abort = parse(&body(b)?)?;
        // SGLang's clients send `rid: ""` beside `abort_all: true`.
        let rid = r.rid.filter(|rid| !rid.is_empty());
        match (rid, r.abort_all.unwrap_or(false)) {
            (Some(_), true) => Err(ApiError::bad("rid", "give rid or abort_all, not both")),
            (None, false) => Err(ApiError::bad(
                "rid",
                "give the request's rid (its response id), or abort_all: true",
            )),
            (rid, _) => Ok(ControlOp::Abort { rid }),
        }
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Memory {
    tags: Option<Vec<String>>,
    model_path: Option<String>,
    weight_version: Option<String>,
}

/// (weights, kv) named by SGLang's tags (none: both). `cuda_graph` names nothing arbor
/// holds apart (its recorded steps live in the KV cache's session and are recorded again
/// on demand): alone, it names nothing to do.
pub(super) fn tags(t: Option<&[String]>) -> Result<(bool, bool), ApiError> {
    let Some(t) = t else {
        return Ok((true, true));
    };
    let mut out = (false, false);
    let mut graphs = false;
    for tag in t {
        match tag.as_str() {
            "weights" => out.0 = true,
            "kv_cache" => out.1 = true,
            "cuda_graph" => graphs = true,
            other => {
                return Err(ApiError::bad(
                    "tags",
                    format!("tag {other:?}: arbor holds \"weights\" and \"kv_cache\" (\"cuda_graph\" is accepted and names nothing)"),
                ))
            }
        }
    }
    if out == (false, false) && !graphs {
        return Err(ApiError::bad("tags", "tags is empty"));
    }
    Ok(out)
}

async fn release(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    guarded_opt(st, headers, || {
        let r: Memory = parse(&body(b)?)?;
        if r.model_path.is_some() || r.weight_version.is_some() {
            return Err(ApiError::bad(
                "model_path",
                "model_path and weight_version go with resume_memory_occupation",
            ));
        }
        let (weights, kv) = tags(r.tags.as_deref())?;
        Ok((weights || kv).then_some(ControlOp::Release { weights, kv }))
    })
    .await
}

async fn resume(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    guarded_opt(st, headers, || {
        let r: Memory = parse(&body(b)?)?;
        let (weights, kv) = tags(r.tags.as_deref())?;
        if let Some(v) = &r.weight_version {
            check_version(v).map_err(|m| ApiError::bad("weight_version", m))?;
        }
        let from = r.model_path.as_deref().map(model_path).transpose()?;
        Ok((weights || kv).then_some(ControlOp::Resume {
            weights,
            kv,
            from,
            version: r.weight_version,
        }))
    })
    .await
}

pub(super) async fn flush_cache(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    guarded(st, headers, || {
        let _: Empty = parse(&body(b)?)?;
        Ok(ControlOp::FlushCache)
    })
    .await
}

async fn is_sleeping(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return fail(e);
    }
    Json(json!({"is_sleeping": st.stats.released.load(Ordering::Relaxed)})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_tags() {
        assert_eq!(tags(None).unwrap(), (true, true));
        assert_eq!(
            tags(Some(&["kv_cache".to_string()])).unwrap(),
            (false, true)
        );
        assert!(tags(Some(&[])).is_err());
        assert_eq!(
            tags(Some(&["cuda_graph".to_string()])).unwrap(),
            (false, false)
        );
        assert!(tags(Some(&["gpu".to_string()])).is_err());
    }
}
