//! `/livez`, `/readyz` and `/metrics` for both daemons.
//!
//! Liveness checks nothing external (a broker outage must not get every replica restarted);
//! readiness reports each named check and answers 503 when one fails.
//!
//! The server is small on purpose and bounded: at most [`MAX_CONNECTIONS`] at once and
//! [`MAX_PER_CLIENT`] per client address, where a newcomer takes the place of the connection
//! idle longest (so idle sockets can never lock probes out: see [`crate::connections`]);
//! request headers must arrive within [`HEADER_TIMEOUT`], and no connection lives longer than
//! [`CONNECTION_LIFETIME`]. Half-open or idle connections cannot pile up and take the file
//! descriptors that jobs need. Bind it to 127.0.0.1 unless a scraper elsewhere needs it (the
//! daemons serve nothing unless `--listen` or `*.listen` is set).

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use chime_shared::health::Health;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use crate::connections::{Conn, Heard, Lobby, Table};
pub use crate::connections::{MAX_CONNECTIONS, MAX_PER_CLIENT};

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

/// Serves `app` on `listener` with the same bounds (the connection table of
/// [`crate::connections`], header timeout, connection lifetime) until `token` is cancelled.
/// Handlers can read the client's address with `ConnectInfo<SocketAddr>`.
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    app: Router,
    token: CancellationToken,
) -> std::io::Result<()> {
    let table = Arc::new(Table::default());
    let lobby = Arc::new(Lobby::default());
    let app = app.layer(axum::middleware::from_fn(mark_busy));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = token.cancelled() => return Ok(()),
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors, say: keep serving once some are back.
                tracing::warn!(error = %e, "server cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if let Some(place) = table.admit(peer.ip(), heard(&stream)) {
            serve_connection(stream, peer, place, &table, &app);
        } else {
            // The table is full and this client said nothing yet: wait a moment for its
            // first bytes in the lobby (a request arriving makes it a talking newcomer).
            let (table, lobby, app) = (table.clone(), lobby.clone(), app.clone());
            let place = lobby.enter();
            tokio::spawn(async move {
                let spoke = tokio::select! {
                    r = tokio::time::timeout(LOBBY_WAIT, stream.readable()) => matches!(r, Ok(Ok(()))),
                    // Pushed out by a newer one: a request that arrived meanwhile still counts
                    // (this task may not have run since).
                    _ = place.cancelled() => heard(&stream) != Heard::Nothing,
                };
                lobby.leave(&place);
                if spoke && let Some(place) = table.admit(peer.ip(), heard(&stream)) {
                    serve_connection(stream, peer, place, &table, &app);
                }
            });
        }
        // Let the new connection's task read its waiting request (and become busy, so not
        // evictable) before more connections are accepted.
        tokio::task::yield_now().await;
    }
}

/// How long a silent newcomer may wait in the lobby for its first bytes.
const LOBBY_WAIT: Duration = Duration::from_secs(1);

/// Serves one admitted connection until it ends, is evicted, or outlives its lifetime.
fn serve_connection(
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    (id, conn): (u64, Arc<Conn>),
    table: &Arc<Table>,
    app: &Router,
) {
    let app = app
        .clone()
        .layer(axum::Extension(conn.clone()))
        .layer(axum::Extension(axum::extract::ConnectInfo(peer)));
    let service = hyper_util::service::TowerToHyperService::new(app);
    let table = table.clone();
    tokio::spawn(async move {
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        tokio::select! {
            _ = tokio::time::timeout(CONNECTION_LIFETIME, connection) => {}
            _ = conn.evicted.cancelled() => {}
        }
        table.remove(id);
    });
}

/// What the client has sent so far, without reading it (a probe sends its whole request right
/// after connecting; an idle socket sends nothing; a slow one part of a request).
fn heard(stream: &tokio::net::TcpStream) -> Heard {
    let mut bytes = [0u8; 2048];
    let mut buf = tokio::io::ReadBuf::new(&mut bytes);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match stream.poll_peek(&mut cx, &mut buf) {
        std::task::Poll::Ready(Ok(n)) if n > 0 => {
            if buf.filled().windows(4).any(|w| w == b"\r\n\r\n") {
                Heard::Request
            } else {
                Heard::Part
            }
        }
        _ => Heard::Nothing,
    }
}

/// Marks the connection busy while a request is answered (a busy connection is never evicted).
async fn mark_busy(
    axum::Extension(conn): axum::Extension<Arc<Conn>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let _busy = conn.busy();
    next.run(req).await
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
