//! The info, health and control routes other engines' clients call, mapped onto arbor's
//! state and control operations: SGLang's `/health_generate`, `/get_model_info`,
//! `/get_server_info`, `/get_load`, `/update_weight_version`; vLLM's `/pause`,
//! `/resume`, `/get_world_size`, `/sleep`, `/wake_up` and `/reset_prefix_cache`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use arbor_serving::{ControlOp, PauseMode};
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::admin::{body, check_version, fail, guarded, guarded_opt, parse};
use super::api::{ApiError, Common};
use super::job::Job;
use super::lifecycle::{tags, Empty};
use super::state::AppState;

/// How long `/health_generate` waits for its one token.
const HEALTH_GENERATE_S: u64 = 20;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/generate", post(super::sglang::generate))
        .route("/inference/v1/generate", post(super::vllm::generate))
        .route("/health_generate", get(health_generate))
        .route("/get_model_info", get(model_info))
        .route("/get_server_info", get(server_info))
        .route("/get_load", get(load))
        .route("/update_weight_version", post(update_weight_version))
        .route("/pause", post(pause))
        .route("/resume", post(super::lifecycle::continue_generation))
        .route("/get_world_size", get(world_size))
        .route("/sleep", post(sleep))
        .route("/wake_up", post(wake_up))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
}

/// A query of repeatable `key=value` pairs (vLLM's `?tags=a&tags=b`), or 422.
fn pairs(
    q: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Vec<(String, String)>, ApiError> {
    q.map(|Query(v)| v).map_err(|e| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("invalid query: {}", e.body_text()),
        )
    })
}

/// One generated token: 200 with an empty body once it came, 503 otherwise (paused,
/// released, draining, or no token within 20 s).
async fn health_generate(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let r = async {
        st.authorize(&headers)?;
        st.generating()?;
        let greedy = Common {
            temperature: Some(0.0),
            ..Common::default()
        };
        let p = greedy.params(1, None, 1)?;
        let mut job = Job::submit(&st, vec![vec![0]], p, false)?;
        let run = async {
            while !job.done() {
                job.next().await?;
            }
            Ok::<_, ApiError>(())
        };
        match tokio::time::timeout(Duration::from_secs(HEALTH_GENERATE_S), run).await {
            Ok(r) => r,
            Err(_) => Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no token within {HEALTH_GENERATE_S} s (is generation paused?)"),
            )),
        }
    }
    .await;
    match r {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) if e.status.is_client_error() && e.status != StatusCode::UNAUTHORIZED => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.message).into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn model_info(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    let i = &st.server_info;
    Json(json!({
        "model_path": i["model_path"],
        "tokenizer_path": i["tokenizer_path"],
        "served_model_name": i["served_model_name"],
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": st.stats.weight_version(),
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": null,
        "architectures": null,
    }))
    .into_response()
}

async fn server_info(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    let mut v = st.server_info.clone();
    v["weight_version"] = json!(st.stats.weight_version());
    v["internal_states"] = json!([{
        "weight_version": st.stats.weight_version(),
        "paused": st.stats.paused.load(Ordering::Relaxed),
        "memory_released": st.stats.released.load(Ordering::Relaxed),
    }]);
    Json(v).into_response()
}

/// SGLang's per-data-parallel-rank load (arbor is one).
async fn load(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    let s = &st.stats;
    let waiting = s.waiting.load(Ordering::Relaxed);
    let running = s.running.load(Ordering::Relaxed);
    let used = s.kv_blocks_used.load(Ordering::Relaxed);
    Json(json!([{
        "dp_rank": 0,
        "num_reqs": waiting + running,
        "num_waiting_reqs": waiting,
        "num_running_reqs": running,
        "num_tokens": used.saturating_mul(arbor_kernels::paged::KV_BLOCK as u64),
    }]))
    .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WeightVersion {
    new_version: String,
    #[serde(default)]
    abort_all_requests: bool,
}

async fn update_weight_version(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    guarded(st, headers, || {
        let r: WeightVersion = parse(&body(b)?)?;
        check_version(&r.new_version).map_err(|m| ApiError::bad("new_version", m))?;
        Ok(ControlOp::SetVersion {
            version: r.new_version,
            abort_all: r.abort_all_requests,
        })
    })
    .await
}

/// vLLM's pause: `mode=abort` (the default) ends the requests in flight, `keep` holds
/// them in place; `wait` (let them finish, hold new ones) is refused.
async fn pause(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    q: Result<Query<Vec<(String, String)>>, QueryRejection>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    guarded(st, headers, || {
        let _: Empty = parse(&body(b)?)?;
        let mut mode = PauseMode::Abort;
        for (k, v) in pairs(q)? {
            match (k.as_str(), v.as_str()) {
                ("mode", "abort") => mode = PauseMode::Abort,
                ("mode", "keep") => mode = PauseMode::InPlace,
                ("mode", "wait") => {
                    return Err(ApiError::bad(
                        "mode",
                        "mode \"wait\" is not supported: use \"keep\" (requests stay in place) or \"abort\"",
                    ))
                }
                ("mode", other) => {
                    return Err(ApiError::bad(
                        "mode",
                        format!("mode must be \"abort\" or \"keep\", got {other:?}"),
                    ))
                }
                // The prefix cache never changes a result's bits: kept or cleared, the
                // same output.
                ("clear_cache" | "wait_for_inflight_requests", "false" | "False" | "0") => {}
                ("clear_cache", _) => {}
                (k, _) => {
                    return Err(ApiError::bad(
                        "mode",
                        format!("query parameter {k:?} is not supported"),
                    ))
                }
            }
        }
        Ok(ControlOp::Pause(mode))
    })
    .await
}

async fn world_size(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"world_size": st.tp})).into_response()
}

/// The `tags` of a query (repeated or comma-separated); `None` when absent.
fn query_tags(pairs: &[(String, String)]) -> Option<Vec<String>> {
    let t: Vec<String> = pairs
        .iter()
        .filter(|(k, _)| k == "tags")
        .flat_map(|(_, v)| v.split(',').map(|s| s.trim().to_string()))
        .filter(|s| !s.is_empty())
        .collect();
    (!t.is_empty()).then_some(t)
}

/// vLLM's sleep: frees what `tags` names (both without tags). Level 1 would keep the
/// weights on the host and level 2 discard them; arbor frees them either way and reads
/// them again on wake-up.
async fn sleep(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    q: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Response {
    guarded_opt(st, headers, || {
        let q = pairs(q)?;
        for (k, v) in &q {
            match k.as_str() {
                "level" if matches!(v.as_str(), "1" | "2") => {}
                "level" => return Err(ApiError::bad("level", "sleep takes level 1 or 2")),
                "tags" => {}
                // vLLM's modes for the requests in flight: arbor's release needs none
                // running, so "abort" ends them by the caller's pause first.
                "mode" => {}
                other => {
                    return Err(ApiError::bad(
                        other.to_string(),
                        format!("query parameter {other:?} is not supported"),
                    ))
                }
            }
        }
        let (weights, kv) = tags(query_tags(&q).as_deref())?;
        Ok((weights || kv).then_some(ControlOp::Release { weights, kv }))
    })
    .await
}

async fn wake_up(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    q: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Response {
    guarded_opt(st, headers, || {
        let q = pairs(q)?;
        if let Some((k, _)) = q.iter().find(|(k, _)| k != "tags") {
            return Err(ApiError::bad(
                k.clone(),
                format!("wake_up takes tags only, got {k:?}"),
            ));
        }
        let (weights, kv) = tags(query_tags(&q).as_deref())?;
        Ok((weights || kv).then_some(ControlOp::Resume {
            weights,
            kv,
            from: None,
            version: None,
        }))
    })
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResetPrefixCache {
    #[serde(default)]
    reset_running_requests: bool,
    /// A connector's cache outside the engine: arbor has none.
    #[allow(dead_code)]
    reset_external: Option<bool>,
}

/// vLLM's reset with its body (or none): `flush_cache`; with `reset_running_requests`
/// the requests in flight are aborted first.
async fn reset_prefix_cache(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    q: Result<Query<Vec<(String, String)>>, QueryRejection>,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return fail(e);
    }
    let parsed = (|| {
        let mut r: ResetPrefixCache = parse(&body(b)?)?;
        for (k, v) in pairs(q)? {
            match k.as_str() {
                "reset_running_requests" => {
                    r.reset_running_requests = matches!(v.as_str(), "true" | "True" | "1")
                }
                "reset_external" => {}
                other => {
                    return Err(ApiError::bad(
                        "reset_running_requests",
                        format!("query parameter {other:?} is not supported"),
                    ))
                }
            }
        }
        Ok(r)
    })();
    let r = match parsed {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    if r.reset_running_requests {
        let aborted = super::admin::command(&st, ControlOp::Abort { rid: None }).await;
        if !aborted.status().is_success() {
            return aborted;
        }
    }
    super::admin::command(&st, ControlOp::FlushCache).await
}
