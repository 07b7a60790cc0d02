//! The HTTP connections of `arbor serve`: what a client may hold. At most
//! `--max-connections` are open at once (more wait unaccepted in the listen queue, so the
//! process never runs out of descriptors); a request's headers must arrive within
//! `--header-timeout-s` (an idle keep-alive connection is closed after as long) and its
//! body within `--body-timeout-s`; a body declared larger than `--max-body-bytes` is 413
//! before any of it is read.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use futures_util::StreamExt as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use super::api::ApiError;
use super::Args;

/// Descriptors kept back from `--max-connections` for everything else rank 0 opens (model
/// files, the links to the other ranks, the runtime's own).
const RESERVED_FDS: usize = 64;

/// The route whose body is a part of a checkpoint (admin.rs): it has a size limit of its
/// own, `Limits::max_upload`.
pub const UPLOAD_PATH: &str = "/update_weights_from_tensor";

/// What one client may hold.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub max_body: usize,
    /// The body limit of `/update_weights_from_tensor` (a part of a checkpoint).
    pub max_upload: usize,
}

impl Limits {
    /// From the (checked) flags and the served model's largest tensor (elements, for the
    /// default upload limit); `--max-connections` lowered to fit this process's
    /// descriptor limit (`ulimit -n`), with a warning when it is.
    pub fn from_args(args: &Args, largest_tensor: usize) -> Limits {
        let fds = open_files_limit();
        let fit = fds.map_or(usize::MAX, |n| n.saturating_sub(RESERVED_FDS).max(1));
        if args.max_connections > fit {
            tracing::warn!(
                "--max-connections {} lowered to {fit}: this process may open {} files (ulimit -n)",
                args.max_connections,
                fds.unwrap_or(0)
            );
        }
        Limits {
            max_connections: args.max_connections.min(fit).min(MAX_CONNECTIONS),
            header_timeout: Duration::from_secs_f64(args.header_timeout_s),
            body_timeout: Duration::from_secs_f64(args.body_timeout_s),
            max_body: args.max_body_bytes,
            max_upload: args
                .max_weight_upload_bytes
                .unwrap_or_else(|| default_max_upload(largest_tensor)),
        }
    }
}

/// The upload limit without `--max-weight-upload-bytes`: 512 MiB, raised so that the
/// largest tensor (`elements`), pushed alone as f32 with its header, fits in one part; a
/// tensor cannot be split across parts.
pub fn default_max_upload(elements: usize) -> usize {
    (512 << 20usize).max(elements.saturating_mul(4).saturating_add(1 << 20))
}

/// The soft limit on open files (RLIMIT_NOFILE); None when unlimited or unknown.
fn open_files_limit() -> Option<usize> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given and nothing else.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    (rc == 0 && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur as usize)
}

/// Most `--max-connections` (far past any descriptor limit).
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// Serves `app` on `listener` until `stop` turns true: then no new connections, and the
/// open ones finish their current request; returns when they are all closed (see
/// [`super::http::serve`] for the bound on that wait).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    stop: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut stopping = stop.clone();
    loop {
        // A slot first, then the connection: past the bound, connections wait in the
        // listen queue instead of taking a descriptor each.
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
            _ = stopping.wait_for(|v| *v) => break,
        };
        let (stream, peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors or similar: not the listener's fault; try again
                    // shortly rather than spin.
                    tracing::warn!("accepting an HTTP connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stopping.wait_for(|v| *v) => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .keep_alive(true);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%peer, "HTTP connection ended: {e}");
                    }
                    return;
                }
                _ = stop.wait_for(|v| *v) => conn.as_mut().graceful_shutdown(),
            }
            if let Err(e) = conn.await {
                tracing::debug!(%peer, "HTTP connection ended: {e}");
            }
        });
    }
    drop(listener);
    // Every slot back: every connection closed.
    let _ = slots.acquire_many(limits.max_connections as u32).await;
}

/// Middleware: reads the request body whole before the handler sees it, within
/// `body_timeout` and `max_body` bytes (413 at once when Content-Length says more).
pub async fn read_body(State(limits): State<Limits>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    // A pushed part of a checkpoint has a limit of its own (docs/rl.md).
    let (max_body, flag) = if parts.uri.path() == UPLOAD_PATH {
        (limits.max_upload, "--max-weight-upload-bytes")
    } else {
        (limits.max_body, "--max-body-bytes")
    };
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is too large (more than {max_body} bytes, {flag})"),
        )
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_body as u64) {
        return close(too_large().into_response());
    }
    let read = tokio::time::timeout(limits.body_timeout, collect(body, max_body)).await;
    let bytes = match read {
        Ok(Ok(b)) => b,
        Ok(Err(BodyError::TooLarge)) => return close(too_large().into_response()),
        Ok(Err(BodyError::Read(e))) => {
            return close(
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read the request body: {e}"),
                )
                .into_response(),
            )
        }
        Err(_) => {
            return close(
                ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the request body did not arrive within {} s (--body-timeout-s)",
                        limits.body_timeout.as_secs_f64()
                    ),
                )
                .into_response(),
            )
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// A response after which the connection is closed (the rest of its body, if any, is not
/// read).
fn close(mut r: Response) -> Response {
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    r
}

enum BodyError {
    TooLarge,
    Read(String),
}

async fn collect(body: Body, limit: usize) -> Result<Bytes, BodyError> {
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError::Read(e.to_string()))?;
        if buf.len() + chunk.len() > limit {
            return Err(BodyError::TooLarge);
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(buf))
}

#[cfg(test)]
mod tests {
    use super::default_max_upload;

    #[test]
    fn the_default_upload_limit_takes_the_largest_tensor_in_f32() {
        assert_eq!(default_max_upload(0), 512 << 20);
        assert_eq!(default_max_upload(1000), 512 << 20, "small models: 512 MiB");
        // llama3-8b's embedding, 128256 × 4096: 2.1 GB as f32, plus a header's room.
        let embed = 128_256 * 4096;
        assert_eq!(default_max_upload(embed), embed * 4 + (1 << 20));
        assert_eq!(default_max_upload(usize::MAX), usize::MAX, "no overflow");
    }
}
