//! Opt-in `spool`: what the producers' local spool costs and how fast it goes.
//!
//! 1. Enqueue with the broker up, `[producer] spool_dir` set against unset: single enqueues
//!    (64 at a time) and batches of 1,000, the variants interleaved over `--runs` rounds.
//! 2. With the broker down (nothing listening on its port): jobs spooled per second, single
//!    enqueues (64 at a time, an `fsync` each) and batches of 1,000 (an `fsync` per batch).
//! 3. The flush once the broker is back: jobs published (confirmed) per second.
//! 4. A producer spooling 1 GiB with the broker down: its resident memory before and after.

use crate::Ctx;
use crate::measure::*;
use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_tests::*;
use std::sync::Arc;
use std::time::Instant;

const SINGLE: usize = 10_000;
const BATCHED: usize = 50_000;
const DOWN_SINGLE: usize = 5_000;
const DOWN_BATCHED: usize = 200_000;
const BATCH: usize = 1_000;

fn text(env: &TestEnv, queue_type: &str, spool: bool, amqp_port: Option<u16>) -> String {
    let producer = if spool {
        format!(
            "[producer]\nspool_dir = \"{}\"\nspool_max_bytes = 4294967296\n",
            env.dir.join("spool").display()
        )
    } else {
        String::new()
    };
    let t = env.config_text(
        queue_type,
        "",
        "",
        &format!("{producer}[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n"),
    );
    match amqp_port {
        Some(p) => t.replace(&env.amqp_url, &format!("amqp://guest:guest@127.0.0.1:{p}/%2f")),
        None => t,
    }
}

fn config(text: &str) -> chime_shared::config::ValidConfig {
    chime_shared::config::Config::from_toml_str(text).unwrap()
}

fn requests(n: usize, payload: &serde_json::Value) -> Vec<EnqueueRequest> {
    (0..n).map(|_| EnqueueRequest::new("noop").payload(payload.clone())).collect()
}

/// Jobs a second: `n` single enqueues, 64 at a time.
async fn singles(client: &Arc<EnqueueClient>, n: usize) -> (f64, usize) {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..64 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut spooled = 0;
            for _ in (t..n).step_by(64) {
                let done = client
                    .enqueue(EnqueueRequest::new("noop").payload(serde_json::json!({"i": t})))
                    .await
                    .unwrap();
                spooled += usize::from(done.delivery == chime_producer::Delivery::Spooled);
            }
            spooled
        }));
    }
    let mut spooled = 0;
    for t in tasks {
        spooled += t.await.unwrap();
    }
    (n as f64 / start.elapsed().as_secs_f64(), spooled)
}

/// Jobs a second: `n` jobs in batches of [`BATCH`].
async fn batches(client: &EnqueueClient, n: usize, payload: &serde_json::Value) -> (f64, usize) {
    let start = Instant::now();
    let mut spooled = 0;
    for _ in 0..n / BATCH {
        let r = client.enqueue_batch(&requests(BATCH, payload)).await.unwrap();
        assert!(r.error.is_none(), "{:?}", r.error);
        spooled += r.spooled;
    }
    (n as f64 / start.elapsed().as_secs_f64(), spooled)
}

pub async fn scenario(c: &Ctx) {
    let qt = c.o.queue_type.as_str();
    println!("\n== spool: enqueue with the broker up, spool_dir set vs unset ({qt} queues)");
    let small = serde_json::json!({"i": 1});
    let mut rates: [Vec<f64>; 4] = Default::default();
    for round in 0..c.o.runs {
        for spool in [false, true] {
            let env = TestEnv::new("bench-spool");
            let client =
                Arc::new(EnqueueClient::connect(config(&text(&env, qt, spool, None))).await.unwrap());
            let (s, s_spooled) = singles(&client, SINGLE).await;
            let (b, b_spooled) = batches(&client, BATCHED, &small).await;
            assert_eq!(s_spooled + b_spooled, 0, "the broker is up: nothing is spooled");
            let i = usize::from(spool) * 2;
            rates[i].push(s);
            rates[i + 1].push(b);
            println!(
                "round {round}: spool {:<3}  single {s:>7.0} jobs/s  batches {b:>7.0} jobs/s",
                if spool { "on" } else { "off" }
            );
        }
    }
    let m: Vec<f64> = rates.iter().map(|r| median(r.clone())).collect();
    println!(
        "median: single {:.0} → {:.0} jobs/s ({:.2}×), batches {:.0} → {:.0} jobs/s ({:.2}×) with the spool on",
        m[0],
        m[2],
        m[2] / m[0],
        m[1],
        m[3],
        m[3] / m[1]
    );

    println!("\n== spool: the broker down, then back");
    let env = TestEnv::new("bench-spool-down");
    let dead = free_port();
    let down = Arc::new(EnqueueClient::connect(config(&text(&env, qt, true, Some(dead)))).await.unwrap());
    let (s, s_spooled) = singles(&down, DOWN_SINGLE).await;
    println!(
        "spooled  single enqueues, 64 at a time: {s:>8.0} jobs/s ({s_spooled} of {DOWN_SINGLE} spooled)"
    );
    let (b, b_spooled) = batches(&down, DOWN_BATCHED, &small).await;
    println!("spooled  batches of {BATCH}: {b:>8.0} jobs/s ({b_spooled} of {DOWN_BATCHED} spooled)");
    drop(down);
    let bytes: u64 = std::fs::read_dir(env.dir.join("spool"))
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    let live = config(&text(&env, qt, true, None));
    let start = Instant::now();
    let report = chime_producer::flush_spool(&live).await.unwrap().unwrap();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "flushed  {} jobs ({:.0} MB in {} files) in {secs:.1} s: {:.0} jobs/s",
        report.published,
        bytes as f64 / 1e6,
        report.files,
        report.published as f64 / secs
    );
    assert_eq!(report.published, DOWN_SINGLE + DOWN_BATCHED);
    drop(env);
    big(qt).await;
}

/// A producer spooling 1 GiB (`BENCH_SPOOL_MB` MB) with the broker down: its memory.
pub async fn big(qt: &str) {
    let mb: u64 = std::env::var("BENCH_SPOOL_MB").ok().and_then(|s| s.parse().ok()).unwrap_or(1024);
    println!("\n== spool: a producer spooling {mb} MiB with the broker down");
    let env = TestEnv::new("bench-spool-big");
    let me = std::process::id();
    let before = rss_kb(me);
    let down = EnqueueClient::connect(config(&text(&env, qt, true, Some(free_port())))).await.unwrap();
    // Jobs of ~4 KB: 1 GiB is about 260,000 of them.
    let big = serde_json::json!({"blob": "x".repeat(4000)});
    let start = Instant::now();
    let (mut jobs, mut peak) = (0usize, before);
    let dir = env.dir.join("spool");
    let size = || -> u64 {
        std::fs::read_dir(&dir)
            .map(|d| d.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum())
            .unwrap_or(0)
    };
    while size() < mb << 20 {
        let r = down.enqueue_batch(&requests(BATCH, &big)).await.unwrap();
        assert_eq!(r.spooled, BATCH, "{:?}", r.error);
        jobs += BATCH;
        peak = peak.max(rss_kb(me));
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "spooled  {jobs} jobs, {:.2} GiB in {secs:.1} s ({:.0} jobs/s, {:.0} MB/s); this process's RSS {} MB before, \
         {} MB at most while spooling, {} MB after",
        size() as f64 / (1u64 << 30) as f64,
        jobs as f64 / secs,
        size() as f64 / 1e6 / secs,
        before / 1024,
        peak / 1024,
        rss_kb(me) / 1024
    );
    drop(down);
    let _ = std::fs::remove_dir_all(&dir);
}
