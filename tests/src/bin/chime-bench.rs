//! chime-bench: throughput and latency of chime against a raw lapin + redis baseline measured
//! in the same run, on the same broker and Redis. Prints medians and ratios; asserts nothing.
//!
//!     cargo run --release -p chime-tests --bin chime-bench -- [--queue-type quorum|classic]
//!         [--runs 3] [--seconds 10] [--only SCENARIO,…]
//!
//! Scenarios: publish (raw vs EnqueueClient), consume (raw per-message ack + 2 Redis round
//! trips vs 1/2/4 chime-worker processes), latency (enqueue → handler start at a steady
//! rate), duplicates, ticker (100,000 schedules).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chime_producer::EnqueueClient;
use chime_producer::enqueue::Prepared;
use chime_shared::config::{Config, JobConfig};
use chime_shared::envelope::{self, Envelope, Source};
use chime_tests::*;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use std::collections::VecDeque;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

struct Opts {
    queue_type: String,
    runs: usize,
    seconds: u64,
    only: Option<Vec<String>>,
}

fn opts() -> Opts {
    let mut o = Opts { queue_type: "quorum".into(), runs: 3, seconds: 10, only: None };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--queue-type" => o.queue_type = args.next().expect("--queue-type quorum|classic"),
            "--runs" => o.runs = args.next().and_then(|v| v.parse().ok()).expect("--runs N"),
            "--seconds" => o.seconds = args.next().and_then(|v| v.parse().ok()).expect("--seconds N"),
            "--only" => {
                o.only = Some(args.next().expect("--only a,b").split(',').map(str::to_string).collect())
            }
            other => panic!("unknown argument {other}; see the file header for usage"),
        }
    }
    o
}

fn progress(what: &str) {
    eprint!("\r\x1b[2K{what}");
    let _ = std::io::stderr().flush();
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU seconds (user + system) of a process.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn bench_config(env: &TestEnv, queue_type: &str, worker: &str) -> Config {
    env.config(queue_type, "", worker, "[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n")
}

fn envelopes(n: usize, same_keys: bool) -> Vec<Prepared> {
    (0..n)
        .map(|i| {
            let key = if same_keys {
                envelope::adhoc_key("noop", &(i / 2).to_string())
            } else {
                envelope::random_key()
            };
            Prepared {
                envelope: Envelope::new(
                    "noop",
                    "default",
                    key,
                    serde_json::json!({"i": i}),
                    None,
                    3,
                    Source::Adhoc,
                ),
                delay: Duration::ZERO,
            }
        })
        .collect()
}

async fn purge(conn: &Connection, queue: &str) {
    let ch = conn.create_channel().await.unwrap();
    let _ = ch.queue_purge(queue.into(), QueuePurgeOptions::default()).await;
}

/// Raw lapin: pipelined confirmed persistent publishes (4096 in flight) for `secs`, to
/// `exchange` with `routing_key`, mandatory or not.
async fn raw_publish(
    conn: &Connection,
    exchange: &str,
    routing_key: &str,
    mandatory: bool,
    props: Option<BasicProperties>,
    body: &[u8],
    secs: u64,
) -> f64 {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let props = props.unwrap_or_else(|| {
        BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into())
    });
    let mut pending = VecDeque::new();
    let mut confirmed = 0u64;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(secs) {
        if pending.len() >= 4096 {
            let p: lapin::PublisherConfirm = pending.pop_front().unwrap();
            p.await.unwrap();
            confirmed += 1;
        }
        let p = ch
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                lapin::options::BasicPublishOptions { mandatory, ..Default::default() },
                body,
                props.clone(),
            )
            .await
            .unwrap();
        pending.push_back(p);
    }
    for p in pending {
        p.await.unwrap();
        confirmed += 1;
    }
    confirmed as f64 / start.elapsed().as_secs_f64()
}

/// chime: `EnqueueClient::publish_batch` in batches of 50,000 for `secs`.
async fn chime_publish(client: &EnqueueClient, secs: u64) -> f64 {
    // Each call drains its confirm window at the end: large batches keep the pipeline full.
    let batch = envelopes(50_000, false);
    let start = Instant::now();
    let mut n = 0usize;
    while start.elapsed() < Duration::from_secs(secs) {
        n += client.publish_batch(&batch).await.confirmed;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// `chime enqueue --batch FILE` of `n` JSON lines through the release CLI; returns jobs/s as
/// the CLI reports it (publish time, excluding process start and file parsing).
async fn cli_batch(env: &TestEnv, config_text: &str, n: usize) -> f64 {
    let path = env.write_config(config_text);
    let file = env.dir.join("batch.jsonl");
    let lines: String = (0..n).map(|i| format!("{{\"payload\":{{\"i\":{i}}}}}\n")).collect();
    std::fs::write(&file, lines).unwrap();
    let out = tokio::process::Command::new(bin_path("chime"))
        .arg("--config")
        .arg(&path)
        .args(["enqueue", "noop", "--batch"])
        .arg(&file)
        .arg("--json")
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["confirmed"].as_f64().unwrap() / v["seconds"].as_f64().unwrap()
}

/// Raw consumer: `concurrency` tasks; per message SET NX PX (claim), SET (done), ack.
async fn raw_consume(
    conn: &Connection,
    queue: &str,
    n: u64,
    concurrency: usize,
    redis_url: &str,
    prefix: &str,
) -> f64 {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(u16::try_from(concurrency * 2).unwrap(), BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(queue.into(), "raw".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let redis = connect_redis(redis_url).await;
    let done = Arc::new(AtomicU64::new(0));
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let start = Instant::now();
    let mut i = 0u64;
    while i < n {
        let Some(Ok(d)) = consumer.next().await else { break };
        i += 1;
        let permit = sem.clone().acquire_owned().await.unwrap();
        let (mut r, done, key) = (redis.clone(), done.clone(), format!("{prefix}:raw:{i}"));
        tokio::spawn(async move {
            let _: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg("run")
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async(&mut r)
                .await
                .unwrap();
            let _: String = redis::cmd("SET")
                .arg(&key)
                .arg("done")
                .arg("PX")
                .arg(60_000)
                .query_async(&mut r)
                .await
                .unwrap();
            d.acker.ack(BasicAckOptions::default()).await.unwrap();
            done.fetch_add(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    while done.load(Ordering::Relaxed) < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let _ = ch.close(200, "".into()).await;
    rate
}

async fn completed(ports: &[u16]) -> u64 {
    let mut total = 0;
    for p in ports {
        if let Ok(r) = reqwest::get(format!("http://127.0.0.1:{p}/metrics")).await
            && let Ok(text) = r.text().await
        {
            total += text
                .lines()
                .filter(|l| l.starts_with("chime_jobs_completed_total{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>() as u64;
        }
    }
    total
}

/// `procs` chime-worker processes drain `n` prepared jobs; returns (jobs/s, idle RSS, peak RSS).
async fn chime_drain(
    env: &TestEnv,
    queue_type: &str,
    client: &EnqueueClient,
    n: usize,
    procs: usize,
    dup: bool,
) -> (f64, u64, u64) {
    let batch = envelopes(n, dup);
    assert_eq!(client.publish_batch(&batch).await.confirmed, n);
    let text = env.config_text(
        queue_type,
        "",
        "concurrency = 32\nprefetch = 64",
        "[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n",
    );
    let path = env.write_config(&text);
    let ports: Vec<u16> = (0..procs).map(|_| free_port()).collect();
    let mut children = Vec::new();
    for p in &ports {
        let mut c = tokio::process::Command::new(bin_path("chime-worker"));
        c.arg("--config").arg(&path).args(["--listen", &format!("127.0.0.1:{p}")]).env("RUST_LOG", "warn");
        c.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).kill_on_drop(true);
        children.push(c.spawn().unwrap());
    }
    // Started = every process answers /readyz; jobs may already be flowing.
    let start = Instant::now();
    let mut idle = 0;
    let mut peak = 0;
    loop {
        let done = completed(&ports).await;
        let pid = children[0].id().unwrap_or(0);
        let r = rss_kb(pid);
        if idle == 0 {
            idle = r;
        }
        peak = peak.max(r);
        if done >= n as u64 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(600), "drain stalled at {done}/{n}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    for c in &mut children {
        let _ = c.start_kill();
        let _ = c.wait().await;
    }
    (rate, idle, peak)
}

fn bin_path(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().join(name)
}

/// Enqueue → handler start latency at `rate`/s for `secs` with one in-process worker.
async fn latency(config: &Config, client: &EnqueueClient, rate: u64, secs: u64) -> (f64, f64) {
    let lat = Arc::new(std::sync::Mutex::new(Vec::<f64>::new()));
    let l = lat.clone();
    let mut reg = chime_worker::Registry::new();
    reg.register(
        "lat",
        chime_worker::raw_handler_fn(move |_, p: serde_json::Value| {
            let sent = p["t"].as_f64().unwrap();
            let now = chrono::Utc::now().timestamp_micros() as f64 / 1e6;
            l.lock().unwrap().push((now - sent) * 1000.0);
            async { Ok(()) }
        }),
    );
    let health = chime_shared::health::Health::default();
    let mut cfg = config.clone();
    cfg.jobs.push(cfg.jobs[0].clone());
    cfg.jobs.last_mut().unwrap().name = "lat".into();
    cfg.jobs.last_mut().unwrap().handler = "lat".into();
    let worker = chime_worker::Worker::builder(cfg.clone())
        .registry(reg)
        .concurrency(32)
        .health(health.clone())
        .build()
        .unwrap();
    let token = tokio_util::sync::CancellationToken::new();
    let h = tokio::spawn(worker.run(token.clone()));
    wait_until("latency worker consuming", Duration::from_secs(20), || {
        let h = health.clone();
        async move { h.get("consuming") }
    })
    .await;
    let lat_client = Arc::new(EnqueueClient::connect(Arc::new(cfg)).await.unwrap());
    let _ = client;
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    let total = rate * secs;
    for _ in 0..total {
        tick.tick().await;
        let t = chrono::Utc::now().timestamp_micros() as f64 / 1e6;
        let env = Envelope::new(
            "lat",
            "default",
            envelope::random_key(),
            serde_json::json!({"t": t}),
            None,
            1,
            Source::Adhoc,
        );
        // Each publish still waits for its own confirm, concurrently with the next ones.
        let c = lat_client.clone();
        tokio::spawn(async move { c.publish(&env, Duration::ZERO).await });
    }
    let l2 = lat.clone();
    wait_until("latency jobs done", Duration::from_secs(60), || {
        let l2 = l2.clone();
        async move { l2.lock().unwrap().len() as u64 >= total }
    })
    .await;
    token.cancel();
    let _ = h.await;
    let mut v = lat.lock().unwrap().clone();
    (percentile(&mut v, 0.5), percentile(&mut v, 0.99))
}

/// 100,000 schedules in an in-process ticker; a raw consumer timestamps each delivery
/// against its slot. `hourly`: one slot per job per hour, spread over the 3,600 seconds
/// (about 28 due per second); otherwise one per minute (about 1,667 due per second).
async fn ticker(
    env: &TestEnv,
    queue_type: &str,
    secs: u64,
    hourly: bool,
) -> (usize, f64, f64, f64, u64, f64) {
    let mut config = bench_config(env, queue_type, "");
    config.ticker.lease = Duration::from_secs(10);
    let template: JobConfig =
        toml::from_str("name = \"x\"\nhandler = \"noop\"\nschedule = \"0 * * * * *\"\ncatch_up = \"none\"\n")
            .unwrap();
    config.jobs.clear();
    for i in 0..100_000u32 {
        let mut j = template.clone();
        j.name = format!("s{i}");
        j.schedule = Some(if hourly {
            format!("{} {} * * * *", i % 60, (i / 60) % 60)
        } else {
            format!("{} * * * * *", i % 60)
        });
        config.jobs.push(j);
    }
    let names = env.names();
    let conn = connect_amqp().await;
    // Declare first so the consumer can attach before the first slot.
    chime_shared::topology::declare(&conn, &config, &["default".into()]).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(1000, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            names.work_queue("default").as_str().into(),
            "lag".into(),
            BasicConsumeOptions { no_ack: true, ..Default::default() },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let lags = Arc::new(std::sync::Mutex::new(Vec::<f64>::new()));
    let l = lags.clone();
    let reader = tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let now = chrono::Utc::now();
            if let Ok(e) = Envelope::decode(&d.data)
                && let Some(slot) = e.slot
            {
                l.lock().unwrap().push((now - slot).num_microseconds().unwrap_or(0) as f64 / 1000.0);
            }
        }
    });
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(config));
    let pid = std::process::id();
    let rss_before = rss_kb(pid);
    let planning = Instant::now();
    let token = tokio_util::sync::CancellationToken::new();
    let t = chime_producer::ticker::Ticker::new(
        rx,
        format!("bench:{pid}"),
        chime_shared::health::Health::default(),
    )
    .unwrap();
    let run = tokio::spawn(t.run(token.clone()));
    // Measure a steady window after the first slot arrives.
    wait_until("first slot delivered", Duration::from_secs(60), || {
        let l = lags.clone();
        async move { !l.lock().unwrap().is_empty() }
    })
    .await;
    let plan_secs = planning.elapsed().as_secs_f64();
    lags.lock().unwrap().clear();
    let cpu0 = cpu_secs(pid);
    let start = Instant::now();
    let mut rss_peak = 0;
    while start.elapsed() < Duration::from_secs(secs) {
        rss_peak = rss_peak.max(rss_kb(pid));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let cpu = (cpu_secs(pid) - cpu0) / start.elapsed().as_secs_f64();
    token.cancel();
    let _ = run.await;
    drop(tx);
    reader.abort();
    let mut v = lags.lock().unwrap().clone();
    let n = v.len();
    let _ = conn.close(200, "".into()).await;
    (
        n,
        percentile(&mut v, 0.5),
        percentile(&mut v, 0.99),
        cpu * 100.0,
        rss_peak.saturating_sub(rss_before),
        plan_secs,
    )
}

#[tokio::main]
async fn main() {
    let o = opts();
    let want = |s: &str| o.only.as_ref().is_none_or(|v| v.iter().any(|x| x == s));
    let secs = o.seconds;
    let qt = o.queue_type.clone();
    println!("chime-bench: queue type {qt}, {} run(s) of ~{secs}s each, medians", o.runs);
    let conn = connect_amqp().await;
    // One worker's saturated drain rate, when measured in this run (for the latency rate).
    let mut saturated: Option<f64> = None;

    if want("publish") {
        let env = TestEnv::new("bench-pub");
        let config = Arc::new(bench_config(&env, &qt, ""));
        let client = EnqueueClient::connect(config.clone()).await.unwrap();
        let q = env.names().work_queue("default");
        let body = envelopes(1, false)[0].envelope.encode();
        let (mut raw, mut raw_m, mut raw_p, mut chime, mut cli) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let text = env.config_text(&qt, "", "", "[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n");
        let work = env.names().work_exchange();
        for r in 0..o.runs {
            progress(&format!("publish: raw lapin run {}/{}", r + 1, o.runs));
            raw.push(raw_publish(&conn, "", &q, false, None, &body, secs).await);
            purge(&conn, &q).await;
            progress(&format!(
                "publish: raw lapin, mandatory via the work exchange, run {}/{}",
                r + 1,
                o.runs
            ));
            raw_m.push(raw_publish(&conn, &work, "default", true, None, &body, secs).await);
            purge(&conn, &q).await;
            progress(&format!("publish: raw lapin with chime's properties, run {}/{}", r + 1, o.runs));
            let props = envelopes(1, false)[0].envelope.properties();
            raw_p.push(raw_publish(&conn, &work, "default", true, Some(props), &body, secs).await);
            purge(&conn, &q).await;
            progress(&format!("publish: EnqueueClient run {}/{}", r + 1, o.runs));
            chime.push(chime_publish(&client, secs).await);
            purge(&conn, &q).await;
            progress(&format!("publish: chime enqueue --batch (100,000 lines) run {}/{}", r + 1, o.runs));
            cli.push(cli_batch(&env, &text, 100_000).await);
            purge(&conn, &q).await;
        }
        progress("");
        let (raw, raw_m, raw_p, chime, cli) =
            (median(raw), median(raw_m), median(raw_p), median(chime), median(cli));
        println!("publish  raw lapin confirmed        {raw:>9.0} msg/s");
        println!("publish  raw, mandatory, via exchange {raw_m:>7.0} msg/s   {:.2}x raw", raw_m / raw);
        println!("publish  raw, + chime's properties    {raw_p:>7.0} msg/s   {:.2}x raw", raw_p / raw);
        println!("publish  EnqueueClient batch        {chime:>9.0} msg/s   {:.2}x raw", chime / raw);
        println!("publish  chime enqueue --batch (CLI) {cli:>8.0} msg/s   {:.2}x raw", cli / raw);
    }

    if want("consume") {
        let env = TestEnv::new("bench-con");
        let config = Arc::new(bench_config(&env, &qt, ""));
        let client = EnqueueClient::connect(config.clone()).await.unwrap();
        let q = env.names().work_queue("default");
        let n = 60_000usize;
        let mut raw = Vec::new();
        for r in 0..o.runs {
            progress(&format!("consume: raw consumer run {}/{}", r + 1, o.runs));
            assert_eq!(client.publish_batch(&envelopes(n, false)).await.confirmed, n);
            raw.push(raw_consume(&conn, &q, n as u64, 32, &env.redis_url, &env.prefix).await);
        }
        let raw = median(raw);
        println!(
            "consume  raw: ack + 2 Redis RTT     {raw:>9.0} msg/s   (32 in flight, one multiplexed Redis connection)"
        );
        for procs in [1usize, 2, 4] {
            let mut rates = Vec::new();
            let mut rss = (0, 0);
            for r in 0..o.runs {
                progress(&format!("consume: {procs} chime-worker process(es) run {}/{}", r + 1, o.runs));
                let (rate, idle, peak) = chime_drain(&env, &qt, &client, n, procs, false).await;
                rates.push(rate);
                rss = (idle, peak.max(rss.1));
            }
            progress("");
            let rate = median(rates);
            if procs == 1 {
                saturated = Some(rate);
            }
            println!(
                "consume  {procs} chime-worker process(es)  {rate:>9.0} jobs/s  {:.2}x raw   RSS {} KiB at start, {} KiB peak",
                rate / raw,
                rss.0,
                rss.1
            );
        }
        if want("duplicates") {
            let mut rates = Vec::new();
            for r in 0..o.runs {
                progress(&format!("duplicates: every job twice, run {}/{}", r + 1, o.runs));
                rates.push(chime_drain(&env, &qt, &client, n, 1, true).await.0);
            }
            progress("");
            println!(
                "consume  duplicates (each key x2)   {:>9.0} deliveries/s (half absorbed)",
                median(rates)
            );
        }
    }

    if want("latency") {
        let env = TestEnv::new("bench-lat");
        let config = bench_config(&env, &qt, "");
        let client = EnqueueClient::connect(Arc::new(config.clone())).await.unwrap();
        // Also at half the saturated single-worker rate, when it was measured in this run.
        let rates: Vec<u64> = match saturated {
            Some(sat) => vec![1000, (sat / 2.0) as u64],
            None => vec![1000],
        };
        for rate in rates {
            let mut p50 = Vec::new();
            let mut p99 = Vec::new();
            for r in 0..o.runs {
                progress(&format!("latency: {rate} jobs/s for {secs}s, run {}/{}", r + 1, o.runs));
                let (a, b) = latency(&config, &client, rate, secs).await;
                p50.push(a);
                p99.push(b);
            }
            progress("");
            println!(
                "latency  enqueue → handler start at {rate}/s   p50 {:.2} ms   p99 {:.2} ms",
                median(p50),
                median(p99)
            );
        }
    }

    if want("ticker") {
        for (hourly, shape) in [(true, "hourly, ~28 due/s"), (false, "every minute, ~1,667 due/s")] {
            let env = TestEnv::new("bench-tick");
            progress(&format!("ticker: 100,000 schedules ({shape})"));
            let (n, p50, p99, cpu, rss, plan) = ticker(&env, &qt, secs.max(20), hourly).await;
            progress("");
            println!(
                "ticker   100,000 schedules ({shape}): planned and first slot in {plan:.1}s; {n} slots measured; \
                 slot → delivered p50 {p50:.1} ms, p99 {p99:.1} ms; CPU {cpu:.0}% of a core (ticker + lag consumer); RSS +{} MiB",
                rss / 1024
            );
        }
    }
    let _ = conn.close(200, "".into()).await;
}
