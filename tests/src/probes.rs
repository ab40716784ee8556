//! Health probes under a connection flood: the test of the health server's connection table
//! and the `probes` benchmark share these.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// One `GET path` on a fresh connection to `127.0.0.1:port`; the whole answer, or `None` if
/// the connection was refused, closed early or took over 10 s.
pub async fn get_once(port: u16, path: &str) -> Option<String> {
    let fetch = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        Some(out)
    };
    tokio::time::timeout(Duration::from_secs(10), fetch).await.ok().flatten()
}

/// `clients` sockets to `127.0.0.1:port` that each connect, send `opening` (nothing, or the
/// start of a request they never finish), hold the connection until the server closes it,
/// and connect again at once, until `stop`. Returns how many connections were made.
pub fn hold_connections(
    port: u16,
    clients: usize,
    opening: &'static [u8],
    stop: &CancellationToken,
) -> Arc<AtomicU64> {
    let made = Arc::new(AtomicU64::new(0));
    for _ in 0..clients {
        let (stop, made) = (stop.clone(), made.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                    tokio::task::yield_now().await;
                    continue;
                };
                made.fetch_add(1, Ordering::Relaxed);
                if !opening.is_empty() && s.write_all(opening).await.is_err() {
                    continue;
                }
                let mut b = [0u8; 64];
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = s.read(&mut b) => {} // closed (or answered): connect again
                }
            }
        });
    }
    made
}

/// The flood of the health-server test: 300 idle sockets and 100 that send half a request,
/// all reconnecting at once when closed. Returns once the server has closed at least 100 of
/// them (the table is full and churning); the counter is of connections made.
pub async fn flood(port: u16, stop: &CancellationToken) -> (Arc<AtomicU64>, Arc<AtomicU64>) {
    let idle = hold_connections(port, 300, b"", stop);
    let slow = hold_connections(port, 100, b"GET /livez HTTP/1.1\r\nhost: x\r\n", stop);
    let (i, s) = (idle.clone(), slow.clone());
    crate::wait_until("the server is saturated", Duration::from_secs(30), move || {
        let (i, s) = (i.clone(), s.clone());
        async move { i.load(Ordering::Relaxed) > 400 && s.load(Ordering::Relaxed) > 150 }
    })
    .await;
    (idle, slow)
}

/// What [`probe`] saw.
#[derive(Debug, Default)]
pub struct Probed {
    /// Probes answered 200.
    pub answered: usize,
    /// The longest run of failed probes in a row (Kubernetes restarts a container after
    /// `failureThreshold`, 3 by default, in a row).
    pub worst_streak: usize,
    /// Each probe's time in milliseconds, sorted.
    pub ms: Vec<f64>,
}

/// `n` probes of `path`, one after the other.
pub async fn probe(port: u16, path: &str, n: usize) -> Probed {
    let mut p = Probed { ms: Vec::with_capacity(n), ..Probed::default() };
    let mut streak = 0;
    for _ in 0..n {
        let t = std::time::Instant::now();
        let r = get_once(port, path).await;
        p.ms.push(t.elapsed().as_secs_f64() * 1000.0);
        if r.is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
            p.answered += 1;
            streak = 0;
        } else {
            streak += 1;
            p.worst_streak = p.worst_streak.max(streak);
        }
    }
    p.ms.sort_by(f64::total_cmp);
    p
}

/// The `p` quantile (0–1) of sorted `values`.
pub fn quantile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
