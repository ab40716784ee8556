//! An OTLP/HTTP receiver for the trace tests and the `traces` benchmark: it keeps the JSON body
//! of every request posted to `/v1/traces` and answers `{}`.

use std::sync::{Arc, Mutex};

/// The bodies received so far.
pub type Bodies = Arc<Mutex<Vec<serde_json::Value>>>;

/// Starts a receiver on a free loopback port: its port and what it received.
pub async fn receiver() -> (u16, Bodies) {
    let got: Bodies = Arc::default();
    let sink = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let sink = sink.clone();
            async move {
                let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
                sink.lock().unwrap().push(json);
                ([("content-type", "application/json")], "{}")
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, got)
}
