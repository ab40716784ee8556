//! `/livez` of a `chime-worker`'s health server, idle and under the connection flood of the
//! security test (300 idle sockets and 100 half requests, reconnecting as soon as they are
//! closed, from the probe's own address).

use chime_tests::probes::{flood, get_once, probe, quantile};
use chime_tests::*;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Prints answered/total and p50/p99/max of 500 probes, idle and flooded. With
/// `BENCH_WORKER_BEFORE=/path/to/chime-worker`, the same for that build first.
pub async fn scenario(runs: usize) {
    if let Ok(before) = std::env::var("BENCH_WORKER_BEFORE") {
        println!("\n== probes, {before}");
        measure(tokio::process::Command::new(&before), runs).await;
    }
    println!("\n== probes, this build");
    measure(tokio::process::Command::new(bin("chime-worker")), runs).await;
}

async fn measure(cmd: tokio::process::Command, runs: usize) {
    let env = TestEnv::new("bench-probes");
    let path =
        env.write_config(&env.config_text("classic", "", "", "[[jobs]]\nname = \"n\"\nhandler = \"noop\"\n"));
    let port = free_port();
    let _worker = Child::run(cmd, &env.dir, &path, &["--listen", &format!("127.0.0.1:{port}")], "w");
    wait_until("/livez answers", Duration::from_secs(30), || async move {
        get_once(port, "/livez").await.is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;
    println!("/livez of chime-worker --listen, 500 probes one after the other");
    for run in 0..runs {
        let p = probe(port, "/livez", 500).await;
        println!(
            "run {run}: idle     {}/500 answered, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            p.answered,
            quantile(&p.ms, 0.5),
            quantile(&p.ms, 0.99),
            p.ms.last().copied().unwrap_or_default()
        );
        let stop = CancellationToken::new();
        let (idle, slow) = flood(port, &stop).await;
        let p = probe(port, "/livez", 500).await;
        let made = idle.load(Ordering::Relaxed) + slow.load(Ordering::Relaxed);
        stop.cancel();
        println!(
            "run {run}: flooded  {}/500 answered (at most {} failed in a row), p50 {:.2} ms, p99 {:.2} ms, \
             max {:.2} ms ({made} flood connections made)",
            p.answered,
            p.worst_streak,
            quantile(&p.ms, 0.5),
            quantile(&p.ms, 0.99),
            p.ms.last().copied().unwrap_or_default()
        );
    }
}
