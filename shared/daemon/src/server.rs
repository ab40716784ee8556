//! `/livez`, `/readyz` and `/metrics` for both daemons.
//!
//! Liveness checks nothing external (a broker outage must not get every replica restarted);
//! readiness reports each named check and answers 503 when one fails.
//!
//! The server is small on purpose and bounded: at most [`MAX_CONNECTIONS`] at once (more are
//! closed at once), request headers must arrive within [`HEADER_TIMEOUT`], and no connection
//! lives longer than [`CONNECTION_LIFETIME`]. Half-open or idle connections cannot pile up and
//! take the file descriptors that jobs need. Bind it to 127.0.0.1 unless a scraper elsewhere
//! needs it (the daemons serve nothing unless `--listen` or `*.listen` is set).

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use chime_shared::health::Health;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Connections served at once; further ones are closed as soon as they are accepted.
pub const MAX_CONNECTIONS: usize = 32;
/// A client must send its request headers within this.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// No connection, however active, lives longer than this.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

#[derive(Clone)]
struct AppState {
    health: Health,
    metrics: Option<PrometheusHandle>,
}

/// Serves the endpoints on `listener` until `token` is cancelled; `metrics` is the recorder
/// [`crate::telemetry::install_recorder`] returned (without it `/metrics` answers 404).
pub async fn serve(
    listener: tokio::net::TcpListener,
    health: Health,
    metrics: Option<PrometheusHandle>,
    token: CancellationToken,
) -> std::io::Result<()> {
    if let Some(h) = &metrics {
        // The recorder is installed without the exporter's own upkeep task.
        let h = h.clone();
        let t = token.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = t.cancelled() => break,
                    _ = tick.tick() => h.run_upkeep(),
                }
            }
        });
    }
    let app = Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_route))
        .with_state(AppState { health, metrics });
    serve_router(listener, app, token).await
}

/// Serves `app` on `listener` with the same bounds (connection cap, header timeout,
/// connection lifetime) until `token` is cancelled.
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    app: Router,
    token: CancellationToken,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = token.cancelled() => return Ok(()),
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: keep serving once some are back.
                tracing::warn!(error = %e, "server cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            drop(stream); // over the cap: closed at once
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
            drop(permit);
        });
    }
}

async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    let code = if s.health.ready() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, [(header::CONTENT_TYPE, "application/json")], s.health.report() + "\n")
}

async fn metrics_route(State(s): State<AppState>) -> impl IntoResponse {
    match s.metrics {
        Some(h) => (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], h.render()),
        None => (StatusCode::NOT_FOUND, [(header::CONTENT_TYPE, "text/plain")], "no recorder\n".into()),
    }
}
