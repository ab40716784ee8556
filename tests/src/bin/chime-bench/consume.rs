//! Draining: raw lapin + redis consumers against chime-worker processes.

use crate::Ctx;
use crate::fixtures::*;
use crate::measure::*;
use chime_producer::EnqueueClient;
use chime_tests::*;
use futures_util::StreamExt;
use lapin::Connection;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// chime's default lease and done retention, so the raw keys live as long as chime's.
pub const LEASE_MS: u64 = 30_000;
pub const RETENTION_MS: u64 = 7 * 24 * 3_600_000;

/// What the raw consumer does in Redis for each message.
#[derive(Clone, Copy, PartialEq)]
pub enum RawRedis {
    /// chime's own claim and finish scripts (the same two commands chime sends).
    Scripts,
    /// The same, the finish also appending the run to the key's record as a worker with
    /// history on (the default) does: its Redis work per job but the history stream's.
    Record,
    /// `SET NX PX` then `SET PX`: dedup without chime's lease and fence.
    Sets,
}

/// Raw consumer: `concurrency` tasks; per message two Redis commands, then a per-message ack.
pub async fn raw_consume(
    conn: &Connection,
    queue: &str,
    n: u64,
    concurrency: usize,
    redis_url: &str,
    prefix: &str,
    mode: RawRedis,
) -> (f64, [f64; 3], [f64; 2]) {
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
    let wakeups = Wakeups::start(&[std::process::id()]);
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
                RawRedis::Scripts | RawRedis::Record => {
                    let owner = format!("raw/{i}");
                    // The reply's length varies with the state (a claim adds the checkpoint).
                    let reply: Vec<redis::Value> = chime_shared::idempotency::claim_script()
                        .key(&key)
                        .arg(&owner)
                        .arg(LEASE_MS)
                        .arg(RETENTION_MS)
                        .invoke_async(&mut r)
                        .await
                        .unwrap();
                    let state: String = redis::from_redis_value(reply[0].clone()).unwrap();
                    let fence: u64 = redis::from_redis_value(reply[1].clone()).unwrap();
                    assert_eq!(state, "claimed");
                    let mut finish = chime_shared::idempotency::finish_script().key(&key);
                    finish.arg(&owner).arg(fence).arg("done").arg(RETENTION_MS);
                    if mode == RawRedis::Record {
                        // A run line of the worker's shape (outcome, attempt, max, finished,
                        // duration, worker), the default 20 kept, job and queue.
                        let line =
                            format!("d 1 3 {} 0 bench-host:{}", 1_764_900_000_000u64 + i, std::process::id());
                        finish.arg("").arg(0).arg(line).arg(20).arg("noop").arg("default");
                    }
                    let ok: i64 = finish.invoke_async(&mut r).await.unwrap();
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
    let wakeups = wakeups.per_message(n);
    let _ = ch.close(200, "".into()).await;
    (rate, cpu, wakeups)
}

pub async fn completed(ports: &[u16]) -> u64 {
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

/// Waits until the worker on each of `ports` consumes (its `/readyz` answers 200).
pub async fn wait_ready(ports: &[u16]) {
    wait_until("workers consuming", Duration::from_secs(30), || async move {
        for p in ports {
            let ok =
                reqwest::get(format!("http://127.0.0.1:{p}/readyz")).await.is_ok_and(|r| r.status() == 200);
            if !ok {
                return false;
            }
        }
        true
    })
    .await;
}

/// What one drain measured.
pub struct Drain {
    pub rate: f64,
    rss_peak: u64,
    cpu: [f64; 3],
    /// The workers' system calls and context switches per job.
    wakeups: [f64; 2],
}

/// Every run of one drain configuration.
#[derive(Default)]
pub struct Drains {
    rates: Vec<f64>,
    /// Each run's rate over the raw consumer's rate of the same round.
    ratios: Vec<f64>,
    cpus: Vec<[f64; 3]>,
    wakeups: Vec<[f64; 2]>,
    rss_peak: u64,
}

/// RSS of one chime-worker process consuming an empty queue (after it is ready).
pub async fn idle_rss(env: &TestEnv, queue_type: &str) -> u64 {
    let d = chime_drain(env, queue_type, None, 0, 1, false).await;
    d.rss_peak
}

/// `procs` chime-worker processes drain `n` prepared jobs, timed from the moment every
/// process is consuming (as the raw consumer is timed from its `basic.consume`).
pub async fn chime_drain(
    env: &TestEnv,
    queue_type: &str,
    client: Option<&EnqueueClient>,
    n: usize,
    procs: usize,
    dup: bool,
) -> Drain {
    let bin = bin_path("chime-worker");
    chime_drain_worker(env, queue_type, client, n, procs, dup, "", &bench_worker_section(), true, &bin).await
}

/// The worker section every drain uses unless it measures the worker's settings.
pub fn bench_worker_section() -> String {
    let threads = std::env::var("BENCH_WORKER_THREADS").unwrap_or_else(|_| "0".into());
    format!("concurrency = 32\nprefetch = 64\nthreads = {threads}")
}

/// [`chime_drain`] with `extra` config sections (`[history]`, …) and this `[worker]` section;
/// `quiet`: `RUST_LOG=warn`, else the workers log as shipped (`info`: a line per job).
#[allow(clippy::too_many_arguments)]
pub async fn chime_drain_worker(
    env: &TestEnv,
    queue_type: &str,
    client: Option<&EnqueueClient>,
    n: usize,
    procs: usize,
    dup: bool,
    extra: &str,
    worker: &str,
    quiet: bool,
    bin: &std::path::Path,
) -> Drain {
    let jobs = format!("{extra}[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n");
    chime_drain_jobs(env, queue_type, client, n, procs, dup, &jobs, worker, quiet, bin).await
}

/// [`chime_drain_worker`] with the config's jobs (and other sections) as given: `jobs` must
/// define the `noop` job the `n` jobs published are of.
#[allow(clippy::too_many_arguments)]
pub async fn chime_drain_jobs(
    env: &TestEnv,
    queue_type: &str,
    client: Option<&EnqueueClient>,
    n: usize,
    procs: usize,
    dup: bool,
    jobs: &str,
    worker: &str,
    quiet: bool,
    bin: &std::path::Path,
) -> Drain {
    if let Some(client) = client {
        let batch = envelopes(n, dup);
        assert_eq!(client.publish_batch(&batch).await.confirmed, n);
    }
    let text = env.config_text(queue_type, "", worker, jobs);
    let path = env.write_config(&text);
    let ports: Vec<u16> = (0..procs).map(|_| free_port()).collect();
    let mut children = Vec::new();
    for p in &ports {
        let mut c = tokio::process::Command::new(bin);
        c.arg("--config").arg(&path).args(["--listen", &format!("127.0.0.1:{p}")]);
        if quiet {
            c.env("RUST_LOG", "warn");
        } else {
            c.env_remove("RUST_LOG");
        }
        c.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).kill_on_drop(true);
        children.push(c.spawn().unwrap());
    }
    let pids: Vec<u32> = children.iter().filter_map(|c| c.id()).collect();
    // From the start: attaching perf takes a moment, in which ready workers would drain.
    let wakeups = Wakeups::start(&pids);
    // Started = every process consumes (its /readyz answers 200).
    wait_ready(&ports).await;
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
    if before * 10 > n as u64 {
        eprintln!(
            "\nchime-bench: {before} of {n} jobs were done before the timed window began; the rate is of the rest"
        );
    }
    let rate = timed as f64 / start.elapsed().as_secs_f64();
    let cpu = cpu.per_message(timed);
    let wakeups = wakeups.per_message(n as u64);
    for c in &mut children {
        let _ = c.start_kill();
        let _ = c.wait().await;
    }
    Drain { rate, rss_peak: peak, cpu, wakeups }
}

/// `consume` (and `duplicates`): raw consumers and 1/2/4 chime-worker processes, interleaved;
/// returns one worker's drain rate.
pub async fn scenario(c: &Ctx) -> Option<f64> {
    let mut saturated = None;
    let o = &c.o;
    let conn = &c.conn;
    let qt = c.o.queue_type.clone();
    let secs = c.o.seconds;
    let env = TestEnv::new("bench-con");
    let config = bench_config(&env, &qt, "");
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    let q = env.names().work_queue("default");
    // Sized so that one drain takes about --seconds at ~20k jobs/s.
    let n = 20_000 * secs as usize;
    // Runs interleave (raw, raw with SETs, then chime) so that each ratio compares
    // figures measured a minute apart; the ratio printed is the median of the per-run ratios.
    let mut raw = Vec::new();
    let mut raw_cpu = Vec::new();
    let mut raw_wakeups = Vec::new();
    let mut sets = Vec::new();
    let mut sets_cpu = Vec::new();
    let mut sets_wakeups = Vec::new();
    let (mut record, mut record_cpu, mut record_wakeups) = (Vec::new(), Vec::new(), Vec::new());
    // Per round, one worker's rate over the raw consumer's with the run record.
    let mut record_ratios = Vec::new();
    let mut chime: Vec<Drains> = o.procs.iter().map(|_| Drains::default()).collect();
    // Another chime-worker binary (an earlier build), drained beside this one in each round.
    let before = std::env::var_os("BENCH_WORKER_BEFORE").map(std::path::PathBuf::from);
    let mut before_drains = Drains::default();
    for r in 0..o.runs {
        for (mode, rates, cpus, wakeups, what) in [
            (RawRedis::Scripts, &mut raw, &mut raw_cpu, &mut raw_wakeups, "chime's two scripts"),
            (RawRedis::Sets, &mut sets, &mut sets_cpu, &mut sets_wakeups, "two SETs"),
            (
                RawRedis::Record,
                &mut record,
                &mut record_cpu,
                &mut record_wakeups,
                "the scripts and the run record",
            ),
        ] {
            progress(&format!("consume: raw consumer with {what}, run {}/{} ({n} messages)", r + 1, o.runs));
            assert_eq!(client.publish_batch(&envelopes(n, false)).await.confirmed, n);
            let (rate, cpu, w) = raw_consume(conn, &q, n as u64, 32, &env.redis_url, &env.prefix, mode).await;
            rates.push(rate);
            cpus.push(cpu);
            wakeups.push(w);
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
            if procs == 1 {
                record_ratios.push(d.rate / record[r]);
            }
            c.cpus.push(d.cpu);
            c.wakeups.push(d.wakeups);
            c.rss_peak = c.rss_peak.max(d.rss_peak);
        }
        if let Some(bin) = &before {
            progress(&format!("consume: 1 BENCH_WORKER_BEFORE process, run {}/{} ({n} jobs)", r + 1, o.runs));
            assert_eq!(client.publish_batch(&envelopes(n, false)).await.confirmed, n);
            let section = bench_worker_section();
            let d = chime_drain_worker(&env, &qt, None, n, 1, false, "", &section, true, bin).await;
            let b = &mut before_drains;
            b.rates.push(d.rate);
            b.ratios.push(d.rate / raw[r]);
            b.cpus.push(d.cpu);
            b.wakeups.push(d.wakeups);
            b.rss_peak = b.rss_peak.max(d.rss_peak);
        }
    }
    progress("");
    let sets_ratio = median(sets.iter().zip(&raw).map(|(s, r)| s / r).collect());
    let raw_rate = median(raw);
    println!(
        "consume  raw: ack + chime's 2 scripts {raw_rate:>7.0} msg/s   (32 in flight, one multiplexed Redis connection)   {}; {}",
        cpu_text(median3(&raw_cpu)),
        wakeup_text(&raw_wakeups)
    );
    println!(
        "consume  raw: ack + 2 plain SETs     {:>8.0} msg/s   {sets_ratio:.2}x raw   {}; {}",
        median(sets),
        cpu_text(median3(&sets_cpu)),
        wakeup_text(&sets_wakeups)
    );
    for (i, procs) in o.procs.iter().enumerate() {
        let Drains { rates, ratios, cpus, wakeups, rss_peak: rss } = &chime[i];
        let rate = median(rates.clone());
        if *procs == 1 {
            saturated = Some(rate);
        }
        println!(
            "consume  {procs} chime-worker process(es)  {rate:>9.0} jobs/s  {:.2}x raw   {}; {}   RSS peak {} KiB",
            median(ratios.clone()),
            cpu_text(median3(cpus)),
            wakeup_text(wakeups),
            rss
        );
    }
    if before.is_some() {
        let Drains { rates, ratios, cpus, wakeups, rss_peak: rss } = &before_drains;
        println!(
            "consume  1 BENCH_WORKER_BEFORE process  {:>8.0} jobs/s  {:.2}x raw   {}; {}   RSS peak {} KiB",
            median(rates.clone()),
            median(ratios.clone()),
            cpu_text(median3(cpus)),
            wakeup_text(wakeups),
            rss
        );
    }
    println!(
        "consume  raw: ack + 2 scripts + run record {:>5.0} msg/s   (the worker's Redis work per job but the history stream)   {}; {}",
        median(record),
        cpu_text(median3(&record_cpu)),
        wakeup_text(&record_wakeups)
    );
    if !record_ratios.is_empty() {
        println!("consume  1 chime-worker against that consumer: {:.2}x", median(record_ratios));
    }
    println!("memory   chime-worker RSS idle (empty queue, consuming): {} KiB", idle_rss(&env, &qt).await);
    if c.want("duplicates") {
        let mut rates = Vec::new();
        for r in 0..o.runs {
            progress(&format!("duplicates: every job twice, run {}/{}", r + 1, o.runs));
            rates.push(chime_drain(&env, &qt, Some(&client), n, 1, true).await.rate);
        }
        progress("");
        println!("consume  duplicates (each key x2)   {:>9.0} deliveries/s (half absorbed)", median(rates));
    }
    saturated
}

/// `defaults`: one worker with the default `[worker]` settings against the same worker tuned
/// (concurrency 32, 100, 200, 400; prefetch = concurrency), no-op jobs, all with
/// `RUST_LOG=warn`; and the defaults once more with the shipped log level (`info`: one line
/// per job, to /dev/null here).
pub async fn defaults(c: &Ctx) {
    let o = &c.o;
    let qt = c.o.queue_type.clone();
    let env = TestEnv::new("bench-defaults");
    let config = bench_config(&env, &qt, "");
    let client = EnqueueClient::connect(config).await.unwrap();
    let n = 100_000;
    let settings = [
        ("defaults", ""),
        ("defaults, info logs", ""),
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
            let (name, worker) = settings[i];
            let quiet = name != "defaults, info logs";
            let bin = bin_path("chime-worker");
            let d = chime_drain_worker(&env, &qt, Some(&client), n, 1, false, "", worker, quiet, &bin).await;
            rates[i].push(d.rate);
        }
    }
    progress("");
    let medians: Vec<f64> = rates.into_iter().map(median).collect();
    let best = medians[2..].iter().cloned().fold(0.0, f64::max);
    for ((name, _), m) in settings.iter().zip(&medians) {
        println!("defaults {name:<20} {m:>9.0} jobs/s   {:.2}x best tuned", m / best);
    }
}

/// Opt-in `history`: the run history's cost on one worker's drain rate, on and off
/// interleaved; and its memory per event.
pub async fn history(c: &Ctx) {
    let o = &c.o;
    let qt = c.o.queue_type.clone();
    let secs = c.o.seconds;
    let env = TestEnv::new("bench-hist");
    let config = bench_config(&env, &qt, "");
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
                chime_drain_worker(
                    &env,
                    &qt,
                    Some(&client),
                    n,
                    1,
                    false,
                    extra,
                    &bench_worker_section(),
                    true,
                    &bin_path("chime-worker"),
                )
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
