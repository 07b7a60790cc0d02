//! The HTTP server on rank 0 (axum): the routing table (the OpenAI routes, the RL and
//! operations routes, health and metrics) under the body limits, and its run until the
//! leader says stop, draining on SIGTERM.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use super::api::ApiError;
use super::conn;
use super::openai::{chat_completions, completions, model, models};
use super::state::AppState;
use super::tokenize::{detokenize, tokenize, tokenizer_info};

async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.accepting() {
        Ok(()) => Json(json!({
            "status": "ok",
            "weight_version": st.stats.weight_version(),
            "paused": st.stats.paused.load(Ordering::Relaxed),
            "memory_released": st.stats.released.load(Ordering::Relaxed),
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        st.stats.render(),
    )
        .into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::new(StatusCode::NOT_FOUND, format!("no route {}", uri.path())).into_response()
}

fn router(st: Arc<AppState>) -> Router {
    let limit = st.max_body;
    let limits = st.limits;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        // OpenAI's model card and vLLM's tokenizer routes (clients such as lm-eval probe them).
        .route("/v1/models/{*id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/tokenizer_info", get(tokenizer_info))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(super::admin::routes(st.max_upload))
        .merge(super::lifecycle::routes())
        // SGLang's /generate and the info, health and control routes of SGLang and vLLM.
        .merge(super::compat::routes())
        .merge(super::vllm_weights::routes())
        .merge(super::prime_rl::routes())
        .merge(super::trl::routes())
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            limits,
            conn::read_body,
        ))
        .with_state(st)
}

async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!("cannot listen for SIGTERM: {e}");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Runs the HTTP server until the leader says stop; reports the bound address (or the
/// bind error) on `ready` first.
pub fn serve(
    state: AppState,
    addr: SocketAddr,
    ready: std::sync::mpsc::Sender<Result<SocketAddr>>,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                let _ = ready.send(Err(anyhow::anyhow!("cannot bind {addr}: {e}")));
                return Ok(());
            }
        };
        let bound = listener
            .local_addr()
            .with_context(|| format!("bound {addr}"))?;
        let _ = ready.send(Ok(bound));
        let st = Arc::new(state);
        let sig = st.clone();
        tokio::spawn(async move {
            terminated().await;
            tracing::info!("SIGTERM: draining");
            eprintln!("arbor serve: signal received, draining (new requests get 503)");
            sig.draining.store(true, Ordering::SeqCst);
            let _ = sig.handle.drain();
        });
        let stop = st.stop.subscribe();
        let mut stop2 = st.stop.subscribe();
        let limits = st.limits;
        let server = conn::serve(listener, router(st), limits, stop);
        // Connections that outlive the drain (idle keep-alives, stuck clients) get 5 s.
        tokio::select! {
            _ = server => {},
            _ = async move {
                let _ = stop2.wait_for(|v| *v).await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            } => {}
        }
        Ok(())
    })
}
