//! chime-bench: throughput and latency of chime against a raw lapin + redis baseline measured
//! in the same run, on the same broker and Redis. Prints medians and ratios; asserts nothing.
//!
//! ```text
//! cargo run --release -p chime-tests --bin chime-bench -- [--queue-type quorum|classic]
//!     [--runs 3] [--seconds 10] [--only SCENARIO,…] [--workers 1,2,4]
//!     [--latency-rates 1000,2000]
//! ```
//!
//! Scenarios: publish (raw vs EnqueueClient), consume (raw per-message ack + chime's 2 scripts,
//! or 2 plain SETs, vs 1/2/4 chime-worker processes), latency (enqueue → handler start at
//! steady rates), duplicates, ticker (100,000 schedules); opt-in: properties (the broker's
//! cost of each AMQP property of the envelope), history (the run history's cost on the drain
//! rate, and its memory per event), web (the dashboard's page times over 1,000,000 history
//! events and 10,000 dead letters).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chime_producer::EnqueueClient;
use chime_producer::Prepared;
use chime_shared::config::{Config, JobConfig};
use chime_shared::envelope::{self, Envelope, Source};
use chime_tests::*;
use futures_util::StreamExt;
use hdrhistogram::Histogram;
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

/// Throughput and latency of chime against raw lapin + redis (see the file header).
#[derive(clap::Parser)]
struct Opts {
    /// Queue type of the work queues.
    #[arg(long, default_value = "quorum", value_parser = ["quorum", "classic"])]
    queue_type: String,
    /// Runs per figure (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Length of each measured run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Scenarios to run (default: all but the opt-in ones).
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    /// Worker process counts of the consume scenario.
    #[arg(long = "workers", value_delimiter = ',', default_value = "1,2,4")]
    procs: Vec<usize>,
    /// Steady enqueue rates of the latency scenario.
    #[arg(long = "latency-rates", value_delimiter = ',', default_value = "1000,2000")]
    rates: Vec<u64>,
}

fn progress(what: &str) {
    eprint!("\r\x1b[2K{what}");
    let _ = std::io::stderr().flush();
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Latencies in µs (1 µs to 1 h, 3 significant digits).
fn latencies() -> Arc<std::sync::Mutex<Histogram<u64>>> {
    Arc::new(std::sync::Mutex::new(Histogram::new_with_bounds(1, 3_600_000_000, 3).unwrap()))
}

/// The `q` quantile of a latency histogram, in ms.
fn quantile_ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
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

/// Pids of the processes whose command name is `comm` (e.g. `beam.smp`, `redis-server`).
fn pids_named(comm: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm))
        .collect()
}

/// CPU time of the broker, Redis and the consumer during one measured window.
struct CpuWindow {
    broker: Vec<u32>,
    redis: Vec<u32>,
    consumers: Vec<u32>,
    start: [f64; 3],
}

impl CpuWindow {
    fn start(consumers: Vec<u32>) -> Self {
        let broker = pids_named("beam.smp");
        let redis = pids_named("redis-server");
        let mut w = Self { broker, redis, consumers, start: [0.0; 3] };
        w.start = w.now();
        w
    }
    fn now(&self) -> [f64; 3] {
        let sum = |pids: &[u32]| pids.iter().map(|p| cpu_secs(*p)).sum::<f64>();
        [sum(&self.broker), sum(&self.redis), sum(&self.consumers)]
    }
    /// µs of CPU per message for broker, Redis and the consumer process(es).
    fn per_message(&self, n: u64) -> [f64; 3] {
        let end = self.now();
        std::array::from_fn(|i| (end[i] - self.start[i]) * 1e6 / n as f64)
    }
}

/// Median of each component of several `[broker, redis, consumer]` CPU figures.
fn median3(v: &[[f64; 3]]) -> [f64; 3] {
    std::array::from_fn(|i| median(v.iter().map(|x| x[i]).collect()))
}

fn cpu_text(c: [f64; 3]) -> String {
    format!("CPU/msg: broker {:.0} µs, redis {:.0} µs, consumer {:.0} µs", c[0], c[1], c[2])
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
                unverified_queue: None,
                declare_queue: None,
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

/// chime's default lease and done retention, so the raw keys live as long as chime's.
const LEASE_MS: u64 = 30_000;
const RETENTION_MS: u64 = 7 * 24 * 3_600_000;

/// What the raw consumer does in Redis for each message.
#[derive(Clone, Copy, PartialEq)]
enum RawRedis {
    /// chime's own claim and finish scripts (the same two commands chime sends).
    Scripts,
    /// `SET NX PX` then `SET PX`: dedup without chime's lease and fence.
    Sets,
}

/// Raw consumer: `concurrency` tasks; per message two Redis commands, then a per-message ack.
async fn raw_consume(
    conn: &Connection,
    queue: &str,
    n: u64,
    concurrency: usize,
    redis_url: &str,
    prefix: &str,
    mode: RawRedis,
) -> (f64, [f64; 3]) {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(u16::try_from(concurrency * 2).unwrap(), BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(queue.into(), "raw".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let redis = connect_redis(redis_url).await;
    let done = Arc::new(AtomicU64::new(0));
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let all_done = Arc::new(tokio::sync::Notify::new());
    let cpu = CpuWindow::start(vec![std::process::id()]);
    let start = Instant::now();
    let mut i = 0u64;
    let run = uuid::Uuid::new_v4().simple().to_string();
    while i < n {
        let Some(Ok(d)) = consumer.next().await else { break };
        i += 1;
        let permit = sem.clone().acquire_owned().await.unwrap();
        let (mut r, done, key) = (redis.clone(), done.clone(), format!("{prefix}:raw:{run}:{i}"));
        let all_done = all_done.clone();
        tokio::spawn(async move {
            match mode {
                RawRedis::Scripts => {
                    let owner = format!("raw/{i}");
                    let (state, fence, _): (String, u64, u64) = chime_shared::idempotency::claim_script()
                        .key(&key)
                        .arg(&owner)
                        .arg(LEASE_MS)
                        .arg(RETENTION_MS)
                        .invoke_async(&mut r)
                        .await
                        .unwrap();
                    assert_eq!(state, "claimed");
                    let ok: i64 = chime_shared::idempotency::finish_script()
                        .key(&key)
                        .arg(&owner)
                        .arg(fence)
                        .arg("done")
                        .arg(RETENTION_MS)
                        .invoke_async(&mut r)
                        .await
                        .unwrap();
                    assert_eq!(ok, 1);
                }
                RawRedis::Sets => {
                    let _: Option<String> = redis::cmd("SET")
                        .arg(&key)
                        .arg("run")
                        .arg("NX")
                        .arg("PX")
                        .arg(LEASE_MS)
                        .query_async(&mut r)
                        .await
                        .unwrap();
                    let _: String = redis::cmd("SET")
                        .arg(&key)
                        .arg("done")
                        .arg("PX")
                        .arg(RETENTION_MS)
                        .query_async(&mut r)
                        .await
                        .unwrap();
                }
            }
            d.acker.ack(BasicAckOptions::default()).await.unwrap();
            if done.fetch_add(1, Ordering::Relaxed) + 1 == n {
                all_done.notify_one();
            }
            drop(permit);
        });
    }
    // A failed task (it panics) would leave this waiting: bound it.
    tokio::time::timeout(Duration::from_secs(600), all_done.notified())
        .await
        .expect("raw consumer did not finish (a task failed?)");
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let cpu = cpu.per_message(n);
    let _ = ch.close(200, "".into()).await;
    (rate, cpu)
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

/// What one drain measured.
struct Drain {
    rate: f64,
    rss_peak: u64,
    cpu: [f64; 3],
}

/// Every run of one drain configuration.
#[derive(Default)]
struct Drains {
    rates: Vec<f64>,
    /// Each run's rate over the raw consumer's rate of the same round.
    ratios: Vec<f64>,
    cpus: Vec<[f64; 3]>,
    rss_peak: u64,
}

/// RSS of one chime-worker process consuming an empty queue (after it is ready).
async fn idle_rss(env: &TestEnv, queue_type: &str) -> u64 {
    let d = chime_drain(env, queue_type, None, 0, 1, false).await;
    d.rss_peak
}

/// `procs` chime-worker processes drain `n` prepared jobs, timed from the moment every
/// process is consuming (as the raw consumer is timed from its `basic.consume`).
async fn chime_drain(
    env: &TestEnv,
    queue_type: &str,
    client: Option<&EnqueueClient>,
    n: usize,
    procs: usize,
    dup: bool,
) -> Drain {
    chime_drain_worker(env, queue_type, client, n, procs, dup, "", &bench_worker_section()).await
}

/// The worker section every drain uses unless it measures the worker's settings.
fn bench_worker_section() -> String {
    let threads = std::env::var("BENCH_WORKER_THREADS").unwrap_or_else(|_| "0".into());
    format!("concurrency = 32\nprefetch = 64\nthreads = {threads}")
}

/// [`chime_drain`] with `extra` config sections (`[history]`, …) and this `[worker]` section.
#[allow(clippy::too_many_arguments)]
async fn chime_drain_worker(
    env: &TestEnv,
    queue_type: &str,
    client: Option<&EnqueueClient>,
    n: usize,
    procs: usize,
    dup: bool,
    extra: &str,
    worker: &str,
) -> Drain {
    if let Some(client) = client {
        let batch = envelopes(n, dup);
        assert_eq!(client.publish_batch(&batch).await.confirmed, n);
    }
    let text = env.config_text(
        queue_type,
        "",
        worker,
        &format!("{extra}[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n"),
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
    let pids: Vec<u32> = children.iter().filter_map(|c| c.id()).collect();
    // Started = every process consumes (its /readyz answers 200).
    wait_until("workers consuming", Duration::from_secs(30), || {
        let ports = ports.clone();
        async move {
            for p in ports {
                let ok = reqwest::get(format!("http://127.0.0.1:{p}/readyz"))
                    .await
                    .is_ok_and(|r| r.status() == 200);
                if !ok {
                    return false;
                }
            }
            true
        }
    })
    .await;
    let cpu = CpuWindow::start(pids.clone());
    let start = Instant::now();
    // Jobs finished while the other processes were still starting are not timed.
    let before = completed(&ports).await;
    let mut peak = 0;
    loop {
        let done = completed(&ports).await;
        peak = peak.max(rss_kb(pids[0]));
        if done >= n as u64 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(600), "drain stalled at {done}/{n}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let timed = n as u64 - before;
    let rate = timed as f64 / start.elapsed().as_secs_f64();
    let cpu = cpu.per_message(timed);
    for c in &mut children {
        let _ = c.start_kill();
        let _ = c.wait().await;
    }
    Drain { rate, rss_peak: peak, cpu }
}

fn bin_path(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().join(name)
}

fn lat_envelope() -> Envelope {
    let t = chrono::Utc::now().timestamp_micros() as f64 / 1e6;
    Envelope::new(
        "lat",
        "default",
        envelope::random_key(),
        serde_json::json!({"t": t}),
        None,
        1,
        Source::Adhoc,
    )
}

/// One in-process worker (32 at once); one publish every 1/`rate` s for `secs`, each awaiting
/// its own confirm. Returns (jobs per second including the tail, p50 ms, p99 ms) of
/// enqueue → handler start.
async fn latency(config: &Config, rate: u64, secs: u64) -> (f64, f64, f64) {
    let lat = latencies();
    let l = lat.clone();
    let mut reg = chime_worker::Registry::new();
    reg.register(
        "lat",
        chime_worker::raw_handler_fn(move |_, p: serde_json::Value| {
            let sent = p["t"].as_f64().unwrap();
            let now = chrono::Utc::now().timestamp_micros() as f64 / 1e6;
            l.lock().unwrap().saturating_record(((now - sent) * 1e6).max(1.0) as u64);
            async { Ok(()) }
        }),
    );
    let health = chime_shared::health::Health::default();
    let mut cfg = config.clone();
    cfg.jobs.push(cfg.jobs[0].clone());
    cfg.jobs.last_mut().unwrap().name = "lat".into();
    cfg.jobs.last_mut().unwrap().handler = chime_shared::config::HandlerConfig::Registered("lat".into());
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
    let cfg = Arc::new(cfg);
    let client = Arc::new(EnqueueClient::connect(cfg.clone()).await.unwrap());
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    let total = rate * secs;
    for _ in 0..total {
        tick.tick().await;
        let env = lat_envelope();
        // Each publish still waits for its own confirm, concurrently with the next ones.
        let c = client.clone();
        tokio::spawn(async move { c.publish(&env, Duration::ZERO).await });
    }
    let l2 = lat.clone();
    wait_until("latency jobs done", Duration::from_secs(120), || {
        let l2 = l2.clone();
        async move { l2.lock().unwrap().len() >= total }
    })
    .await;
    let achieved = total as f64 / start.elapsed().as_secs_f64();
    token.cancel();
    let _ = h.await;
    let h = lat.lock().unwrap();
    (achieved, quantile_ms(&h, 0.5), quantile_ms(&h, 0.99))
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
    let lags = latencies();
    let l = lags.clone();
    let reader = tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let now = chrono::Utc::now();
            if let Ok(e) = Envelope::decode(&d.data)
                && let Some(slot) = e.slot
            {
                l.lock()
                    .unwrap()
                    .saturating_record((now - slot).num_microseconds().unwrap_or(0).max(1) as u64);
            }
        }
    });
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(config));
    let pid = std::process::id();
    let rss_before = rss_kb(pid);
    let planning = Instant::now();
    let token = tokio_util::sync::CancellationToken::new();
    let t =
        chime_cli::ticker::Ticker::new(rx, format!("bench:{pid}"), chime_shared::health::Health::default())
            .unwrap();
    let run = tokio::spawn(t.run(token.clone()));
    // Measure a steady window after the first slot arrives.
    wait_until("first slot delivered", Duration::from_secs(60), || {
        let l = lags.clone();
        async move { !l.lock().unwrap().is_empty() }
    })
    .await;
    let plan_secs = planning.elapsed().as_secs_f64();
    lags.lock().unwrap().reset();
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
    let h = lags.lock().unwrap().clone();
    let n = h.len() as usize;
    let _ = conn.close(200, "".into()).await;
    (
        n,
        quantile_ms(&h, 0.5),
        quantile_ms(&h, 0.99),
        cpu * 100.0,
        rss_peak.saturating_sub(rss_before),
        plan_secs,
    )
}

#[tokio::main]
async fn main() {
    let o = <Opts as clap::Parser>::parse();
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

    // Opt-in (--only defaults): one worker with the default [worker] settings against the
    // same worker tuned (concurrency 32, 100, 200; prefetch = concurrency), no-op jobs.
    if o.only.as_ref().is_some_and(|v| v.iter().any(|x| x == "defaults")) {
        let env = TestEnv::new("bench-defaults");
        let config = Arc::new(bench_config(&env, &qt, ""));
        let client = EnqueueClient::connect(config).await.unwrap();
        let n = 100_000;
        let settings = [
            ("defaults", ""),
            ("concurrency 32", "concurrency = 32"),
            ("concurrency 100", "concurrency = 100"),
            ("concurrency 200", "concurrency = 200"),
            ("concurrency 400", "concurrency = 400"),
            ("32, prefetch 200", "concurrency = 32\nprefetch = 200"),
        ];
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); settings.len()];
        for r in 0..o.runs {
            // Rotate the order per round (a quorum queue compacts its log after a drain).
            for k in 0..settings.len() {
                let i = (k + r) % settings.len();
                progress(&format!("defaults: {}, run {}/{} ({n} jobs)", settings[i].0, r + 1, o.runs));
                let d = chime_drain_worker(&env, &qt, Some(&client), n, 1, false, "", settings[i].1).await;
                rates[i].push(d.rate);
            }
        }
        progress("");
        let medians: Vec<f64> = rates.into_iter().map(median).collect();
        let best = medians[1..].iter().cloned().fold(0.0, f64::max);
        for ((name, _), m) in settings.iter().zip(&medians) {
            println!("defaults {name:<16} {m:>9.0} jobs/s   {:.2}x best tuned", m / best);
        }
    }

    // Opt-in (--only batch-memory): peak RSS of `chime enqueue --batch` for 100,000 and
    // 1,000,000 lines, from a file and from standard input (spooled to a temporary file).
    if o.only.as_ref().is_some_and(|v| v.iter().any(|x| x == "batch-memory")) {
        let env = TestEnv::new("bench-batchmem");
        let config = Arc::new(bench_config(&env, &qt, ""));
        let _declared = EnqueueClient::connect(config).await.unwrap();
        let q = env.names().work_queue("default");
        let text = env.config_text(&qt, "", "", "[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n");
        let path = env.write_config(&text);
        for n in [100_000usize, 1_000_000] {
            let file = env.dir.join("batch.jsonl");
            let lines: String =
                (0..n).map(|i| format!("{{\"payload\":{{\"i\":{i}}},\"key\":\"k{i}\"}}\n")).collect();
            std::fs::write(&file, lines).unwrap();
            for stdin in [false, true] {
                progress(&format!("batch-memory: {n} lines, {}", if stdin { "stdin" } else { "file" }));
                let script = format!(
                    "/usr/bin/time -f %M {} --config {} enqueue noop --batch {} --json {}",
                    bin_path("chime").display(),
                    path.display(),
                    if stdin { "-" } else { file.to_str().unwrap() },
                    if stdin { format!("< {}", file.display()) } else { String::new() },
                );
                let out = tokio::process::Command::new("sh").args(["-c", &script]).output().await.unwrap();
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
                let rss: u64 = String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("0")
                    .trim()
                    .parse()
                    .unwrap_or(0);
                let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                progress("");
                println!(
                    "batch    chime enqueue --batch {n:>9} lines from {:<5}  peak RSS {:>7} KiB  {:.0} jobs/s",
                    if stdin { "stdin" } else { "file" },
                    rss,
                    v["confirmed"].as_f64().unwrap() / v["seconds"].as_f64().unwrap()
                );
                purge(&conn, &q).await;
            }
        }
    }

    // Opt-in (--only properties): which of the envelope's AMQP properties costs the broker.
    if o.only.as_ref().is_some_and(|v| v.iter().any(|x| x == "properties")) {
        let env = TestEnv::new("bench-props");
        let config = Arc::new(bench_config(&env, &qt, ""));
        let _declared = EnqueueClient::connect(config).await.unwrap();
        let q = env.names().work_queue("default");
        let work = env.names().work_exchange();
        let sample = envelopes(1, false).remove(0).envelope;
        let body = sample.encode();
        let base =
            || BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into());
        let variants: Vec<(&str, BasicProperties)> = vec![
            ("none beyond delivery_mode, content_type", base()),
            ("+ message_id (the key)", base().with_message_id(sample.key.to_string().into())),
            ("+ type (the job)", base().with_type(sample.job.clone().into())),
            ("+ timestamp", base().with_timestamp(1_764_000_000)),
            ("all three (chime's)", sample.properties()),
        ];
        let mut rates: Vec<Vec<f64>> = variants.iter().map(|_| Vec::new()).collect();
        for r in 0..o.runs {
            for (i, (what, props)) in variants.iter().enumerate() {
                progress(&format!("properties: {what}, run {}/{}", r + 1, o.runs));
                rates[i]
                    .push(raw_publish(&conn, &work, "default", true, Some(props.clone()), &body, secs).await);
                purge(&conn, &q).await;
            }
        }
        progress("");
        let base_rate = median(rates[0].clone());
        for ((what, _), r) in variants.iter().zip(rates) {
            let r = median(r);
            println!("props    raw publish, {what:<40} {r:>7.0} msg/s   {:.2}x", r / base_rate);
        }
    }

    if want("consume") {
        let env = TestEnv::new("bench-con");
        let config = Arc::new(bench_config(&env, &qt, ""));
        let client = EnqueueClient::connect(config.clone()).await.unwrap();
        let q = env.names().work_queue("default");
        // Sized so that one drain takes about --seconds at ~20k jobs/s.
        let n = 20_000 * secs as usize;
        // Runs interleave (raw, raw with SETs, then chime) so that each ratio compares
        // figures measured a minute apart; the ratio printed is the median of the per-run ratios.
        let mut raw = Vec::new();
        let mut raw_cpu = Vec::new();
        let mut sets = Vec::new();
        let mut sets_cpu = Vec::new();
        let mut chime: Vec<Drains> = o.procs.iter().map(|_| Drains::default()).collect();
        for r in 0..o.runs {
            for (mode, rates, cpus, what) in [
                (RawRedis::Scripts, &mut raw, &mut raw_cpu, "chime's two scripts"),
                (RawRedis::Sets, &mut sets, &mut sets_cpu, "two SETs"),
            ] {
                progress(&format!(
                    "consume: raw consumer with {what}, run {}/{} ({n} messages)",
                    r + 1,
                    o.runs
                ));
                assert_eq!(client.publish_batch(&envelopes(n, false)).await.confirmed, n);
                let (rate, cpu) =
                    raw_consume(&conn, &q, n as u64, 32, &env.redis_url, &env.prefix, mode).await;
                rates.push(rate);
                cpus.push(cpu);
            }
            for (i, &procs) in o.procs.iter().enumerate() {
                progress(&format!(
                    "consume: {procs} chime-worker process(es), run {}/{} ({n} jobs)",
                    r + 1,
                    o.runs
                ));
                let d = chime_drain(&env, &qt, Some(&client), n, procs, false).await;
                let c = &mut chime[i];
                c.rates.push(d.rate);
                c.ratios.push(d.rate / raw[r]);
                c.cpus.push(d.cpu);
                c.rss_peak = c.rss_peak.max(d.rss_peak);
            }
        }
        progress("");
        let sets_ratio = median(sets.iter().zip(&raw).map(|(s, r)| s / r).collect());
        let raw_rate = median(raw);
        println!(
            "consume  raw: ack + chime's 2 scripts {raw_rate:>7.0} msg/s   (32 in flight, one multiplexed Redis connection)   {}",
            cpu_text(median3(&raw_cpu))
        );
        println!(
            "consume  raw: ack + 2 plain SETs     {:>8.0} msg/s   {sets_ratio:.2}x raw   {}",
            median(sets),
            cpu_text(median3(&sets_cpu))
        );
        for (i, procs) in o.procs.iter().enumerate() {
            let Drains { rates, ratios, cpus, rss_peak: rss } = &chime[i];
            let rate = median(rates.clone());
            if *procs == 1 {
                saturated = Some(rate);
            }
            println!(
                "consume  {procs} chime-worker process(es)  {rate:>9.0} jobs/s  {:.2}x raw   {}   RSS peak {} KiB",
                median(ratios.clone()),
                cpu_text(median3(cpus)),
                rss
            );
        }
        println!(
            "memory   chime-worker RSS idle (empty queue, consuming): {} KiB",
            idle_rss(&env, &qt).await
        );
        if want("duplicates") {
            let mut rates = Vec::new();
            for r in 0..o.runs {
                progress(&format!("duplicates: every job twice, run {}/{}", r + 1, o.runs));
                rates.push(chime_drain(&env, &qt, Some(&client), n, 1, true).await.rate);
            }
            progress("");
            println!(
                "consume  duplicates (each key x2)   {:>9.0} deliveries/s (half absorbed)",
                median(rates)
            );
        }
    }

    // Opt-in (--only history): the run history's cost on one worker's drain rate, history
    // on and off interleaved; and its memory per event.
    if o.only.as_ref().is_some_and(|v| v.iter().any(|x| x == "history")) {
        let env = TestEnv::new("bench-hist");
        let config = Arc::new(bench_config(&env, &qt, ""));
        let client = EnqueueClient::connect(config.clone()).await.unwrap();
        let n = 20_000 * secs as usize;
        let (mut on, mut off, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let (mut cpu_on, mut cpu_off) = (Vec::new(), Vec::new());
        for r in 0..o.runs {
            // Alternate which goes first: a quorum queue compacts its log after a drain, which
            // would otherwise always slow the second drain of a round.
            let mut pair = [None, None];
            for first in [r % 2 == 1, r % 2 == 0] {
                let with = first;
                progress(&format!(
                    "history: {}, run {}/{} ({n} jobs)",
                    if with { "on" } else { "off" },
                    r + 1,
                    o.runs
                ));
                let extra = if with { "" } else { "[history]\nenabled = false\n" };
                pair[usize::from(with)] = Some(
                    chime_drain_worker(&env, &qt, Some(&client), n, 1, false, extra, &bench_worker_section())
                        .await,
                );
            }
            let (a, b) = (pair[0].take().unwrap(), pair[1].take().unwrap());
            ratios.push(b.rate / a.rate);
            off.push(a.rate);
            on.push(b.rate);
            cpu_off.push(a.cpu);
            cpu_on.push(b.cpu);
        }
        progress("");
        let mut r = connect_redis(&env.redis_url).await;
        let stream = env.names().history("default");
        // Runs in the stream: entries hold up to RUNS_PER_ENTRY each.
        let mut len: u64 = 0;
        let mut from = "-".to_string();
        loop {
            let page: Vec<(String, std::collections::HashMap<String, String>)> = redis::cmd("XRANGE")
                .arg(&stream)
                .arg(&from)
                .arg("+")
                .arg("COUNT")
                .arg(10_000)
                .query_async(&mut r)
                .await
                .unwrap();
            for (id, f) in &page {
                len += chime_shared::history::decode_entry("default", id, f).len() as u64;
            }
            match page.last() {
                Some((id, _)) if page.len() == 10_000 => from = format!("({id}"),
                _ => break,
            }
        }
        let bytes: u64 = memory_usage(&mut r, &stream).await;
        println!(
            "history  drain, 1 worker: off {:.0} jobs/s, on {:.0} jobs/s: {:.3}x with history (rounds: {})   stream: {len} runs, {:.0} bytes/run ({:.0} MiB per million)",
            median(off),
            median(on),
            median(ratios.clone()),
            ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(" "),
            bytes as f64 / len.max(1) as f64,
            bytes as f64 / len.max(1) as f64 * 1e6 / 1_048_576.0
        );
        let cpu = |v: &[[f64; 3]], i: usize| median(v.iter().map(|c| c[i]).collect());
        println!(
            "history  CPU µs per job (broker / Redis / worker): off {:.0} / {:.0} / {:.0}, on {:.0} / {:.0} / {:.0}",
            cpu(&cpu_off, 0),
            cpu(&cpu_off, 1),
            cpu(&cpu_off, 2),
            cpu(&cpu_on, 0),
            cpu(&cpu_on, 1),
            cpu(&cpu_on, 2)
        );
        // A key's record with and without its run entries, from a sample of this prefix's keys.
        let (mut with, mut without) = (Vec::new(), Vec::new());
        let mut cursor = 0u64;
        while with.len() < 500 || without.len() < 500 {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}:idem:*", env.prefix))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut r)
                .await
                .unwrap();
            for k in keys {
                let (runs, bytes): (bool, u64) = redis::pipe()
                    .hexists(&k, "n")
                    .cmd("MEMORY")
                    .arg("USAGE")
                    .arg(&k)
                    .query_async(&mut r)
                    .await
                    .unwrap();
                if runs { with.push(bytes as f64) } else { without.push(bytes as f64) }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        if !with.is_empty() && !without.is_empty() {
            println!(
                "history  a key's record: {:.0} bytes without history, {:.0} with one run (kept for redis.done_retention)",
                median(without),
                median(with)
            );
        }
    }

    // Opt-in (--only web): the dashboard's page times over 1,000,000 history entries and
    // 10,000 dead letters.
    if o.only.as_ref().is_some_and(|v| v.iter().any(|x| x == "web")) {
        web_pages(&qt).await;
    }

    if want("latency") {
        let env = TestEnv::new("bench-lat");
        let config = bench_config(&env, &qt, "");
        // A sweep: --latency-rates (1,000 and 2,000 jobs/s), and half the saturated rate (one
        // worker's drain rate measured above, with nobody publishing) when consume ran.
        let mut rates = o.rates.clone();
        if let Some(drain) = saturated {
            rates.push((drain / 2.0) as u64);
        }
        for rate in rates {
            let mut p50 = Vec::new();
            let mut p99 = Vec::new();
            let mut done = Vec::new();
            for r in 0..o.runs {
                progress(&format!("latency: {rate} jobs/s for {secs}s, run {}/{}", r + 1, o.runs));
                let (achieved, a, b) = latency(&config, rate, secs).await;
                done.push(achieved);
                p50.push(a);
                p99.push(b);
            }
            progress("");
            println!(
                "latency  enqueue → handler start at {rate}/s   p50 {:.2} ms   p99 {:.2} ms   (all done at {:.0}/s incl. the tail)",
                median(p50),
                median(p99),
                median(done)
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

/// Fills a prefix with 1,000,000 history events (10 jobs, 1 in 1,000 dead-lettered) and 10,000
/// dead letters, starts `chime web` on it and times each page (median and p95 of 20 loads,
/// after one warm-up; the DLQ's first read, a pass over the whole queue, is timed apart).
async fn web_pages(qt: &str) {
    use chime_shared::history::{Outcome, RunEvent};
    const EVENTS: usize = 1_000_000;
    const DEAD: usize = 10_000;
    let env = TestEnv::new("bench-web");
    let jobs: String = (0..10)
        .map(|i| format!("[[jobs]]\nname = \"job-{i}\"\nhandler = \"noop\"\nschedule = \"*/15 * * * *\"\n"))
        .collect();
    let text = env.config_text(qt, "", "", &jobs);
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    let names = env.names();
    let mut r = connect_redis(&env.redis_url).await;
    let stream = names.history("default");
    let now = chrono::Utc::now();
    let mut some_key = String::new();
    let t = Instant::now();
    for chunk in 0..EVENTS / 10_000 {
        progress(&format!("web: writing history {}/{EVENTS}", chunk * 10_000));
        let mut pipe = redis::pipe();
        let mut entry = Vec::new();
        for i in chunk * 10_000..(chunk + 1) * 10_000 {
            let dead = i % 1000 == 999;
            let key = envelope::random_key().to_string();
            if i == EVENTS - 10 {
                some_key = key.clone();
            }
            let finished = now - chrono::Duration::milliseconds((EVENTS - i) as i64 * 50);
            let e = RunEvent {
                job: format!("job-{}", i % 10),
                key,
                id: uuid::Uuid::now_v7().to_string(),
                queue: "default".into(),
                attempt: 1,
                max_attempts: 5,
                worker: "bench-host:4242".into(),
                started_at: Some(finished - chrono::Duration::milliseconds(12)),
                finished_at: finished,
                outcome: if dead { Outcome::DeadLettered } else { Outcome::Succeeded },
                duration_ms: Some(12),
                reason: dead.then(|| "exhausted".to_string()),
                error: dead.then(|| "exit code 3: upstream answered 503".to_string()),
                entry: None,
            };
            // As the worker writes them: a few runs to an entry.
            entry.push(e.stream_values());
            if entry.len() == chime_shared::history::RUNS_PER_ENTRY {
                let runs = chime_shared::history::encode_entry(&std::mem::take(&mut entry));
                pipe.cmd("XADD").arg(&stream).arg("*").arg("runs").arg(runs).ignore();
            }
        }
        let _: () = pipe.query_async(&mut r).await.unwrap();
    }
    let bytes: u64 = memory_usage(&mut r, &stream).await;
    let history_secs = t.elapsed().as_secs_f64();
    // The key page's record, as the worker leaves it.
    let idem = names.idem_key(&some_key);
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg(&idem)
        .arg("s")
        .arg("done")
        .arg("o")
        .arg("bench-host:4242/1")
        .arg("f")
        .arg(7)
        .ignore()
        .query_async(&mut r)
        .await
        .unwrap();
    // Dead letters, as the worker publishes them.
    let conn = connect_amqp().await;
    chime_shared::topology::declare(&conn, &config, &config.all_queues()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let dlq = names.dlq("default");
    let mut first_id = String::new();
    for chunk in 0..DEAD / 1000 {
        progress(&format!("web: publishing dead letters {}/{DEAD}", chunk * 1000));
        let mut confirms = Vec::new();
        for i in 0..1000 {
            let env_ = Envelope::new(
                &format!("job-{}", i % 10),
                "default",
                envelope::random_key(),
                serde_json::json!({"invoice": i, "amount_cents": 4200}),
                None,
                5,
                Source::Adhoc,
            );
            let id = uuid::Uuid::now_v7().to_string();
            if first_id.is_empty() {
                first_id = id.clone();
            }
            let mut h = FieldTable::default();
            let failed_at = chrono::Utc::now().to_rfc3339();
            for (k, v) in [
                ("x-chime-reason", "exhausted"),
                ("x-chime-error", "exit code 3: upstream answered 503 Service Unavailable"),
                ("x-chime-attempts", "5"),
                ("x-chime-failed-at", failed_at.as_str()),
                ("x-chime-worker", "bench-host:4242"),
                ("x-chime-queue", "default"),
                ("x-chime-dead-id", id.as_str()),
            ] {
                h.insert(k.into(), lapin::types::AMQPValue::LongString(v.into()));
            }
            let props = env_.properties().with_headers(h);
            confirms.push(
                ch.basic_publish("".into(), dlq.as_str().into(), Default::default(), &env_.encode(), props)
                    .await
                    .unwrap(),
            );
        }
        for c in confirms {
            c.await.unwrap();
        }
    }
    progress("web: starting chime web");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _web = Child::chime(&env.dir, &path, &["web", "--listen", &format!("127.0.0.1:{port}")], "web");
    let http = reqwest::Client::new();
    wait_until("chime web answers", Duration::from_secs(30), || {
        let (http, url) = (http.clone(), format!("{base}/livez"));
        async move { http.get(url).send().await.is_ok() }
    })
    .await;
    let time = |url: String| {
        let http = http.clone();
        async move {
            let t = Instant::now();
            let resp = http.get(&url).send().await.unwrap();
            let status = resp.status();
            let body = resp.bytes().await.unwrap();
            assert!(status.is_success(), "{url}: {status}");
            (t.elapsed().as_secs_f64() * 1000.0, body.len())
        }
    };
    // The first view of a large DLQ starts a background pass over it; the page says so
    // (id="reading") until the pass is done.
    progress("web: the DLQ's first read");
    let t = Instant::now();
    loop {
        let body = http.get(format!("{base}/dlq?queue=default")).send().await.unwrap().text().await.unwrap();
        if !body.contains("id=\"reading\"") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(300), "the DLQ was never read");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cold = t.elapsed().as_secs_f64() * 1000.0;
    let pages = [
        ("overview", "/".to_string()),
        ("schedules", "/schedules".to_string()),
        ("running", "/running".to_string()),
        ("history, newest 100", "/history".to_string()),
        ("history, one job", "/history?job=job-3".to_string()),
        ("history, dead_lettered (1 in 1,000)", "/history?outcome=dead_lettered".to_string()),
        ("history, a job with no runs", "/history?job=nope".to_string()),
        ("key", format!("/keys/{some_key}")),
        ("DLQ, first 100 of 10,000", "/dlq?queue=default".to_string()),
        ("DLQ, page 50", "/dlq?queue=default&page=50".to_string()),
        ("DLQ, filtered by job", "/dlq?queue=default&job=job-3".to_string()),
        ("dead letter", format!("/dlq/default/{first_id}")),
    ];
    println!(
        "web      {EVENTS} history events ({:.0} MiB in Redis, written in {history_secs:.0}s), {DEAD} dead letters; \
         the DLQ's first read (a pass over all of it): {cold:.0} ms",
        bytes as f64 / 1_048_576.0
    );
    for (name, path) in pages {
        progress(&format!("web: {name}"));
        let _ = time(format!("{base}{path}")).await;
        let mut ms = Vec::new();
        let mut size = 0;
        for _ in 0..20 {
            let (m, n) = time(format!("{base}{path}")).await;
            ms.push(m);
            size = n;
        }
        ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
        progress("");
        println!(
            "web      {name:<38} median {:>6.1} ms   p95 {:>6.1} ms   {:>7} bytes",
            ms[ms.len() / 2],
            ms[ms.len() * 95 / 100],
            size
        );
    }
    let _ = ch.close(200, "".into()).await;
    let _ = conn.close(200, "".into()).await;
}

/// Bytes of Redis memory `key` takes, every element counted (`MEMORY USAGE … SAMPLES 0`).
async fn memory_usage(r: &mut redis::aio::MultiplexedConnection, key: &str) -> u64 {
    redis::cmd("MEMORY").arg("USAGE").arg(key).arg("SAMPLES").arg(0).query_async(r).await.unwrap()
}
