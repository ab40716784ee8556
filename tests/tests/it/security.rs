//! The second security review: each test reproduces one of its findings (issue "Security,
//! round two") and fails on the code it was found in.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::common::*;

/// One `GET path` on a fresh connection; the whole answer, or `None` if the connection was
/// refused, closed early or took over 10 s.
async fn get_once(port: u16, path: &str) -> Option<String> {
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

/// `clients` sockets to `port` that each connect, send `opening` (nothing, or the start of a
/// request they never finish), hold the connection until the server closes it, and connect
/// again at once, until `stop`. Returns how many connections were made.
fn hold_connections(
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

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Finding 2: 32 idle connections, reopened as they were dropped, failed `/livez` 23 times of
/// 23 over 12 s (one table of 32 for every client; newcomers closed at once). Here 300 idle
/// sockets and 100 that send half a request, all reopened at once when closed, from the
/// probe's own address: every probe must still be answered, and the worker's descriptors stay
/// bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_are_answered_while_a_client_holds_hundreds_of_idle_connections() {
    let env = TestEnv::new("sec-probes");
    let path =
        env.write_config(&env.config_text("classic", "", "", "[[jobs]]\nname = \"n\"\nhandler = \"noop\"\n"));
    let port = free_port();
    let worker = Child::worker(&env.dir, &path, &["--listen", &format!("127.0.0.1:{port}")], "w");
    wait_until("/livez answers", Duration::from_secs(30), || async move {
        get_once(port, "/livez").await.is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;
    let before = worker.open_fds();

    let stop = CancellationToken::new();
    let idle = hold_connections(port, 300, b"", &stop);
    let slow = hold_connections(port, 100, b"GET /livez HTTP/1.1\r\nhost: x\r\n", &stop);
    // The attack is under way once the server has closed some of them (they reconnected).
    wait_until("the server is saturated", Duration::from_secs(30), || {
        let (idle, slow) = (idle.clone(), slow.clone());
        async move { idle.load(Ordering::Relaxed) > 400 && slow.load(Ordering::Relaxed) > 150 }
    })
    .await;

    let (mut answered, mut latencies) = (0, Vec::new());
    let probes = 200;
    for _ in 0..probes {
        let t = Instant::now();
        let r = get_once(port, "/livez").await;
        latencies.push(t.elapsed().as_secs_f64() * 1000.0);
        if r.is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
            answered += 1;
        }
    }
    let ready = get_once(port, "/readyz").await.unwrap_or_default();
    let during = worker.open_fds();
    let connections = idle.load(Ordering::Relaxed) + slow.load(Ordering::Relaxed);
    stop.cancel();
    latencies.sort_by(f64::total_cmp);
    println!(
        "/livez under 400 held connections ({connections} made): {answered}/{probes} answered; \
         p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; worker fds {before} -> {during}",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default(),
    );
    assert_eq!(answered, probes, "every probe is answered");
    assert!(ready.starts_with("HTTP/1.1 200") || ready.starts_with("HTTP/1.1 503"), "{ready}");
    let cap = chime_daemon::server::MAX_CONNECTIONS + chime_daemon::connections::LOBBY;
    assert!(during <= before + cap + 16, "the worker holds {during} fds (from {before}) under attack");

    // An idle connection is still closed by the server within the header timeout.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut b = [0u8; 1];
    let closed = tokio::time::timeout(Duration::from_secs(15), s.read(&mut b)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "an idle connection stayed open");
}
