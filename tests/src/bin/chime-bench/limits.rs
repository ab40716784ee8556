//! `limits` (opt-in): graceful degradation measured. A rate limit's accuracy across worker
//! processes under an offered load five times the limit; tenants isolated by per-key limits
//! while one floods; what limits and circuits cost the drain; a circuit over a downstream
//! that fails for a while then recovers.

use crate::Ctx;
use crate::consume::chime_drain_jobs;
use crate::fixtures::*;
use crate::measure::*;
use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_shared::history::{Outcome, RunEvent};
use chime_tests::*;
use chrono::{DateTime, Utc};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `limits` runs every part; `limits-rate`, `limits-tenants`, `limits-cost`,
/// `limits-circuit` one each; `limits-broker` (only when named) the broker's own floor under
/// the tenants' flood, with no chime process running.
pub async fn scenario(c: &Ctx) {
    let all = c.opted("limits");
    if all || c.opted("limits-rate") {
        accuracy(c).await;
    }
    if all || c.opted("limits-tenants") {
        tenants(c).await;
    }
    if all || c.opted("limits-cost") {
        cost(c).await;
    }
    if all || c.opted("limits-circuit") {
        circuit(c).await;
    }
    if c.opted("limits-broker") {
        broker_floor(c).await;
    }
}

/// Idle and total CPU time since boot (jiffies, from `/proc/stat`), where there is one.
fn cpu_idle() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> =
        stat.lines().next()?.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    Some((fields.get(3)? + fields.get(4).copied().unwrap_or(0), fields.iter().sum()))
}

/// `env`'s config with `jobs` and the run's `worker.park_pack`: a client, and `procs` workers
/// consuming (with their health ports).
async fn limited_workers(
    c: &Ctx,
    env: &TestEnv,
    jobs: &str,
    procs: usize,
) -> (EnqueueClient, Vec<tokio::process::Child>, Vec<u16>) {
    let worker = format!("park_pack = {}", c.o.park_pack);
    let text = env.config_text(&c.o.queue_type, "", &worker, jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let client = EnqueueClient::connect(config).await.unwrap();
    let (children, ports) = workers(&path, procs).await;
    (client, children, ports)
}

/// `procs` chime-worker processes on `path` (logging warnings only), consuming.
async fn workers(path: &std::path::Path, procs: usize) -> (Vec<tokio::process::Child>, Vec<u16>) {
    let ports: Vec<u16> = (0..procs).map(|_| free_port()).collect();
    let mut children = Vec::new();
    for p in &ports {
        let mut c = tokio::process::Command::new(bin_path("chime-worker"));
        c.arg("--config").arg(path).args(["--listen", &format!("127.0.0.1:{p}")]).env("RUST_LOG", "warn");
        c.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).kill_on_drop(true);
        children.push(c.spawn().unwrap());
    }
    crate::consume::wait_ready(&ports).await;
    (children, ports)
}

/// Publishes `per_second` requests a second, in one batch every 100 ms, for `secs` seconds
/// (`req(i)` makes the i-th); returns each key's publish time.
async fn offer(
    client: &EnqueueClient,
    per_second: usize,
    secs: u64,
    req: impl Fn(usize) -> EnqueueRequest,
) -> HashMap<String, DateTime<Utc>> {
    offer_every(client, per_second, secs, Duration::from_millis(100), req).await
}

/// [`offer`] in ticks of `every`: each tick publishes the requests due by its end (a rate
/// that does not divide into ticks is spread over them).
async fn offer_every(
    client: &EnqueueClient,
    per_second: usize,
    secs: u64,
    every: Duration,
    req: impl Fn(usize) -> EnqueueRequest,
) -> HashMap<String, DateTime<Utc>> {
    let mut sent = HashMap::new();
    let (ticks, due_by) = schedule(per_second, secs, every);
    let mut tick = tokio::time::interval(every);
    let mut i = 0;
    for k in 0..ticks {
        tick.tick().await;
        let due = due_by(k + 1);
        if due == i {
            continue;
        }
        let reqs: Vec<EnqueueRequest> = (i..due).map(&req).collect();
        let per_tick = due - i;
        i = due;
        let now = Utc::now();
        for r in &reqs {
            sent.insert(client.prepare(r).unwrap().envelope.key.to_string(), now);
        }
        assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, per_tick);
    }
    sent
}

/// A steady offer of `per_second` for `secs` in ticks of `every`: how many ticks, and how many
/// messages are due by the end of the k-th (a rate that does not divide into ticks is spread
/// over them).
fn schedule(per_second: usize, secs: u64, every: Duration) -> (usize, impl Fn(usize) -> usize) {
    let ticks = (Duration::from_secs(secs).as_micros() / every.as_micros().max(1)) as usize;
    (ticks, move |k: usize| (k * per_second * every.as_micros() as usize) / 1_000_000)
}

/// Every run in the history of `env`'s default queue.
async fn runs(env: &TestEnv) -> Vec<RunEvent> {
    let mut r = connect_redis(&env.redis_url).await;
    let stream = env.names().history("default");
    let mut out = Vec::new();
    let mut from = "-".to_string();
    loop {
        let page: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
            .arg(&stream)
            .arg(&from)
            .arg("+")
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut r)
            .await
            .unwrap();
        for (id, f) in &page {
            out.extend(chime_shared::history::decode_entry("default", id, f));
        }
        match page.last() {
            Some((id, _)) if page.len() == 10_000 => from = format!("({id}"),
            _ => break,
        }
    }
    out
}

/// Waits until the workers on `ports` ran `n` jobs successfully (their metrics say).
async fn wait_succeeded(ports: &[u16], n: usize, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    loop {
        let mut done = 0u64;
        for p in ports {
            if let Ok(r) = reqwest::get(format!("http://127.0.0.1:{p}/metrics")).await
                && let Ok(text) = r.text().await
            {
                done += text
                    .lines()
                    .filter(|l| {
                        l.starts_with("chime_jobs_completed_total{") && l.contains("outcome=\"succeeded\"")
                    })
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>() as u64;
            }
        }
        progress(&format!("{what}: {done}/{n}"));
        if done >= n as u64 {
            break;
        }
        assert!(Instant::now() < deadline, "{what}: stalled at {done}/{n}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    progress("");
}

/// 200/s across 4 worker processes, `--offer` a second (1,000 by default) for 6 × `--seconds`:
/// the runs started in each 10 s window, against the limit.
async fn accuracy(c: &Ctx) {
    let env = TestEnv::new("bench-rate");
    // Every park is a history entry too: keep them all (the default would cut the first minute).
    let jobs = "[history]\nmax_len = 100000000\n[[jobs]]\nname = \"paced\"\nhandler = \"noop\"\nrate_limit = \"200/s\"\n";
    let (client, procs, ports) = limited_workers(c, &env, jobs, 4).await;
    let secs = 6 * c.o.seconds;
    let rate = c.o.offer;
    progress(&format!(
        "limits: offering {rate}/s for {secs} s to a 200/s limit (park_pack {})",
        c.o.park_pack
    ));
    let (began, idle_before) = (Instant::now(), cpu_idle());
    let sent = offer(&client, rate, secs, |i| EnqueueRequest::new("paced").key(format!("p{i}"))).await;
    let offered_for = began.elapsed().as_secs_f64();
    let idle = match (idle_before, cpu_idle()) {
        (Some(a), Some(b)) if b.1 > a.1 => {
            format!("{:.0} %", 100.0 * (b.0 - a.0) as f64 / (b.1 - a.1) as f64)
        }
        _ => "unknown".to_string(),
    };
    let n = sent.len();
    wait_succeeded(&ports, n, Duration::from_secs(secs * 5 + 600), "limits: draining at 200/s").await;
    drop(procs);
    let all = runs(&env).await;
    let mut starts: Vec<DateTime<Utc>> =
        all.iter().filter(|r| r.outcome == Outcome::Succeeded).filter_map(|r| r.started_at).collect();
    starts.sort();
    assert_eq!(starts.len(), n, "every run's start must be in the history");
    let parks: Vec<DateTime<Utc>> =
        all.iter().filter(|r| r.outcome == Outcome::Parked).map(|r| r.finished_at).collect();
    let parked = parks.len();
    let first = starts[0];
    let windows = (starts[starts.len() - 1] - first).num_seconds() / 10;
    let (mut rates, mut park_rates) = (Vec::new(), Vec::new());
    for w in 0..windows {
        let (from, to) =
            (first + chrono::Duration::seconds(10 * w), first + chrono::Duration::seconds(10 * (w + 1)));
        rates.push(starts.iter().filter(|s| **s >= from && **s < to).count() as f64 / 10.0);
        park_rates.push(parks.iter().filter(|s| **s >= from && **s < to).count() as f64 / 10.0);
    }
    let worst = rates.iter().map(|r| (r / 200.0 - 1.0).abs()).fold(0.0, f64::max);
    println!(
        "limits   200/s across 4 workers, {rate}/s offered for {secs} s ({n} jobs, {parked} parks): {} full 10 s windows, {:.1}–{:.1} runs/s, worst {:.1} % off the limit",
        rates.len(),
        rates.iter().copied().fold(f64::MAX, f64::min),
        rates.iter().copied().fold(0.0, f64::max),
        worst * 100.0
    );
    println!(
        "limits   per window (runs/s): {}",
        rates.iter().map(|r| format!("{r:.1}")).collect::<Vec<_>>().join(" ")
    );
    println!(
        "limits   the offer took {offered_for:.0} s (CPU idle meanwhile: {idle}); worker.park_pack {}",
        c.o.park_pack
    );
    println!(
        "limits   parks per window (/s): {}",
        park_rates.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(" ")
    );
    let mut per_key: HashMap<&str, usize> = HashMap::new();
    for r in all.iter().filter(|r| r.outcome == Outcome::Parked) {
        *per_key.entry(r.key.as_str()).or_default() += 1;
    }
    let mut times = [0usize; 5];
    for k in sent.keys() {
        times[per_key.get(k.as_str()).copied().unwrap_or(0).min(4)] += 1;
    }
    println!(
        "limits   runs parked 0 / 1 / 2 / 3 / 4+ times: {}",
        times.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(" / ")
    );
}

/// What a tenth tenant does beside the nine quiet ones in [`tenants`].
#[derive(Clone, Copy, PartialEq)]
enum Tenth {
    /// Nothing.
    Idle,
    /// Floods its limited job at 200/s (150/s of it parked).
    Floods,
    /// Control: 50/s (what its limit lets through), nothing parked.
    AtItsLimit,
    /// Control: 200/s of an unlimited job (the same offered load, no limiter).
    Unlimited,
    /// Control (`BENCH_TENANT_BARE_FLOOD=1`): 200/s sent by a [`bare_flood`], beside chime:
    /// the same messages through the broker, none through a worker or Redis.
    Bare,
}

/// A durable queue `<prefix>.bench-<name>` of `queue_type` on a connection of its own: the
/// connection, a channel to publish on, the queue's name and a consumer on a second channel
/// (with `prefetch`: manual acks; without: no acks).
async fn bare_queue(
    env: &TestEnv,
    name: &str,
    queue_type: &str,
    prefetch: Option<u16>,
) -> (lapin::Connection, lapin::Channel, String, lapin::Consumer) {
    use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
    let conn = connect_amqp_to(&env.amqp_url).await;
    let queue = format!("{}.bench-{name}", env.prefix);
    let ch = conn.create_channel().await.unwrap();
    let mut args = lapin::types::FieldTable::default();
    args.insert("x-queue-type".into(), lapin::types::AMQPValue::LongString(queue_type.into()));
    let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
    ch.queue_declare(queue.as_str().into(), durable, args).await.unwrap();
    let rx = conn.create_channel().await.unwrap();
    if let Some(n) = prefetch {
        rx.basic_qos(n, BasicQosOptions::default()).await.unwrap();
    }
    let options = BasicConsumeOptions { no_ack: prefetch.is_none(), ..BasicConsumeOptions::default() };
    let consumer = rx
        .basic_consume(queue.as_str().into(), name.into(), options, lapin::types::FieldTable::default())
        .await
        .unwrap();
    (conn, ch, queue, consumer)
}

/// A bare AMQP round trip beside the tenants (`BENCH_TENANT_PROBE=<per second>`): a plain
/// lapin publisher and consumer on a durable queue of their own, of the type the workers'
/// queues are (`queue_type`), publish persistent messages each `every`, what is due by then,
/// for `secs`; the histogram of publish to delivery (µs). What the machine's load does
/// to a message's wait with no chime in its path: the control that tells the load's share of
/// the quiet tenants' waits from chime's.
async fn bare_probe(
    env: &TestEnv,
    queue_type: &str,
    per_second: usize,
    secs: u64,
    every: Duration,
) -> hdrhistogram::Histogram<u64> {
    use futures_util::StreamExt;
    use lapin::options::{BasicPublishOptions, QueueDeleteOptions};
    let mut h = latencies().lock().unwrap().clone();
    if per_second == 0 {
        return h;
    }
    let (conn, ch, queue, mut consumer) = bare_queue(env, "probe", queue_type, None).await;
    let origin = Instant::now();
    let (ticks, due_by) = schedule(per_second, secs, every);
    let total = (secs as usize) * per_second;
    let received = async {
        let mut waits = latencies().lock().unwrap().clone();
        for _ in 0..total {
            let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_secs(60), consumer.next()).await else {
                break;
            };
            let sent = u64::from_le_bytes(d.data[..8].try_into().unwrap());
            waits.record((origin.elapsed().as_micros() as u64).saturating_sub(sent).max(1)).unwrap();
        }
        waits
    };
    let sent = async {
        let mut tick = tokio::time::interval(every);
        let mut i = 0;
        for k in 0..ticks {
            tick.tick().await;
            while i < due_by(k + 1) {
                i += 1;
                let body = (origin.elapsed().as_micros() as u64).to_le_bytes();
                let props = lapin::BasicProperties::default().with_delivery_mode(2);
                ch.basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    props,
                )
                .await
                .unwrap();
            }
        }
    };
    let (waits, ()) = tokio::join!(received, sent);
    assert_eq!(waits.len() as usize, total, "limits: the bare probe lost messages");
    h.add(&waits).unwrap();
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    let _ = conn.close(200, "done".into()).await;
    h
}

/// A bare flood beside a [`bare_probe`]: a plain lapin publisher sends `per_second` persistent
/// messages of `size` bytes to a durable queue of its own (of type `queue_type`), each `every`
/// what is due by then, and waits for the broker's confirms as chime's enqueue does; a plain
/// consumer takes them with manual acks (prefetch 100). Returns when all are acked.
async fn bare_flood(
    env: &TestEnv,
    queue_type: &str,
    per_second: usize,
    secs: u64,
    every: Duration,
    size: usize,
) {
    use futures_util::StreamExt;
    use lapin::options::{BasicAckOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
    let (conn, ch, queue, mut consumer) = bare_queue(env, "flood", queue_type, Some(100)).await;
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let (ticks, due_by) = schedule(per_second, secs, every);
    let total = (secs as usize) * per_second;
    let drained = async {
        for _ in 0..total {
            let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_secs(60), consumer.next()).await else {
                panic!("limits: the bare flood lost messages");
            };
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    };
    let sent = async {
        let body = vec![b'x'; size];
        let mut tick = tokio::time::interval(every);
        let mut i = 0;
        for k in 0..ticks {
            tick.tick().await;
            let mut confirms = Vec::new();
            while i < due_by(k + 1) {
                i += 1;
                let props = lapin::BasicProperties::default().with_delivery_mode(2);
                let publish = ch.basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    props,
                );
                confirms.push(publish.await.unwrap());
            }
            for c in confirms {
                assert!(c.await.unwrap().is_ack(), "limits: the broker refused a bare flood message");
            }
        }
    };
    tokio::join!(drained, sent);
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    let _ = conn.close(200, "done".into()).await;
}

/// The broker's floor under the tenants' load, with no chime process running: a
/// [`bare_probe`] at the quiet tenants' 90/s (each 10 ms), alone and beside a [`bare_flood`]
/// at the flooding tenant's 200/s of chime-sized messages (266 bytes), `--runs` rounds in
/// rotated order. If this flood alone moves the probe's p99 beyond 1.10x, no client of this
/// broker can keep the tenants' target, whatever it does with the flood once delivered.
async fn broker_floor(c: &Ctx) {
    let secs = 2 * c.o.seconds;
    let every = Duration::from_millis(10);
    let mut p99: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut p50: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut pooled: Vec<_> = (0..2).map(|_| latencies().lock().unwrap().clone()).collect();
    let mut broker_cpu: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for r in 0..c.o.runs {
        for k in 0..2 {
            let v = (k + r) % 2;
            progress(&format!("limits: broker floor, round {}/{}", r + 1, c.o.runs));
            let env = TestEnv::new("bench-floor");
            let window = CpuWindow::start(Vec::new());
            let began = Instant::now();
            let flood = async {
                if v == 1 {
                    bare_flood(&env, &c.o.queue_type, 200, secs, every, 266).await;
                }
            };
            let (probed, ()) = tokio::join!(bare_probe(&env, &c.o.queue_type, 90, secs, every), flood);
            broker_cpu[v].push(100.0 * (window.now()[0] - window.start[0]) / began.elapsed().as_secs_f64());
            p99[v].push(quantile_ms(&probed, 0.99));
            p50[v].push(quantile_ms(&probed, 0.5));
            pooled[v].add(&probed).unwrap();
        }
    }
    progress("");
    let ratio = median(p99[1].iter().zip(&p99[0]).map(|(f, a)| f / a).collect());
    let all = |v: usize| quantile_ms(&pooled[v], 0.99);
    let rounds = |v: usize| p99[v].iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" ");
    println!(
        "limits   broker floor ({} queues, no chime process): bare probe at 90/s, persistent, publish to delivery; \
         medians of {} rounds: alone p50/p99 {:.2}/{:.2} ms; beside a bare flood of 200/s (confirmed, acked) \
         {:.2}/{:.2} ms: {:.2}x p99 alone (median of the rounds' ratios), {:.2}x with every round's waits together \
         ({:.2} against {:.2} ms); broker CPU {:.0} against {:.0} % of a core",
        c.o.queue_type,
        c.o.runs,
        median(p50[0].clone()),
        median(p99[0].clone()),
        median(p50[1].clone()),
        median(p99[1].clone()),
        ratio,
        all(1) / all(0),
        all(1),
        all(0),
        median(broker_cpu[1].clone()),
        median(broker_cpu[0].clone()),
    );
    println!("limits   broker floor, p99 per round (ms): alone {}; flood {}", rounds(0), rounds(1));
}

/// The p99 wait (publish to start) of nine tenants offering 10/s each under a 50/s limit per
/// tenant: alone, while a tenth floods at 200/s, and two controls that tell the limiter's part
/// from the load's (the tenth at its limit; 200/s of an unlimited job); `--runs` rounds in
/// rotated order, medians. Every tenant publishes each 10 ms what is due by then (a steady
/// stream); `BENCH_TENANT_TICK_MS=100` publishes in batches every 100 ms instead, as the
/// figures before 2026-12-06 did (the flood's 20 copies then land with the quiet tenants' 9,
/// each tick, and the quiet runs wait behind them). Each variant also prints the CPU the
/// broker, Redis, the workers and the bench used while the tenants offered, and with
/// `BENCH_TENANT_PROBE=<per second>` a [`bare_probe`] runs beside the tenants: what the same
/// load does to a message that goes through the broker alone.
async fn tenants(c: &Ctx) {
    let secs = 2 * c.o.seconds;
    let tick_ms: u64 = std::env::var("BENCH_TENANT_TICK_MS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    let every = Duration::from_millis(tick_ms.max(1));
    let probe_rate: usize =
        std::env::var("BENCH_TENANT_PROBE").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    let bare_flood_too = std::env::var("BENCH_TENANT_BARE_FLOOD").is_ok_and(|s| s == "1");
    let mut variants = vec![Tenth::Idle, Tenth::Floods, Tenth::AtItsLimit, Tenth::Unlimited];
    if bare_flood_too {
        variants.push(Tenth::Bare);
    }
    let names = ["alone", "flood", "at its limit", "unlimited", "bare flood"];
    // Per variant, each round's (p50, p99), and every round's waits in one histogram.
    let mut p: Vec<Vec<(f64, f64)>> = vec![Vec::new(); variants.len()];
    let mut pooled: Vec<_> = variants.iter().map(|_| latencies().lock().unwrap().clone()).collect();
    // Per variant, the bare probe's rounds' p99 and its waits together; and the CPU share
    // (% of one core) of the broker, Redis, the workers and the bench while the tenants offer.
    let mut bare: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut bare_pooled: Vec<_> = variants.iter().map(|_| latencies().lock().unwrap().clone()).collect();
    let mut cpu: Vec<Vec<[f64; 4]>> = vec![Vec::new(); variants.len()];
    for r in 0..c.o.runs {
        for k in 0..variants.len() {
            let v = (k + r) % variants.len();
            let tenth = variants[v];
            let env = TestEnv::new("bench-tenant");
            let jobs = "[[jobs]]\nname = \"call\"\nhandler = \"noop\"\nrate_limit = { rate = \"50/s\", key = \"tenant\" }\n\
                    [[jobs]]\nname = \"bulk\"\nhandler = \"noop\"\n";
            let (client, procs, ports) = limited_workers(c, &env, jobs, 2).await;
            progress(&format!("limits: tenants, round {}/{}", r + 1, c.o.runs));
            let quiet = async {
                offer_every(&client, 90, secs, every, |i| {
                    let t = 1 + i % 9;
                    EnqueueRequest::new("call")
                        .key(format!("t{t}-{i}"))
                        .payload(serde_json::json!({"tenant": t}))
                })
                .await
            };
            let loud = async {
                let (job, rate) = match tenth {
                    Tenth::Idle => return HashMap::new(),
                    Tenth::Bare => {
                        bare_flood(&env, &c.o.queue_type, 200, secs, every, 266).await;
                        return HashMap::new();
                    }
                    Tenth::Floods => ("call", 200),
                    Tenth::AtItsLimit => ("call", 50),
                    Tenth::Unlimited => ("bulk", 200),
                };
                offer_every(&client, rate, secs, every, |i| {
                    EnqueueRequest::new(job).key(format!("t0-{i}")).payload(serde_json::json!({"tenant": 0}))
                })
                .await
            };
            let pids: Vec<u32> = procs.iter().filter_map(tokio::process::Child::id).collect();
            let window = CpuWindow::start(pids);
            let (bench_cpu, began) = (cpu_secs(std::process::id()), Instant::now());
            let (sent, flooded, probed) =
                tokio::join!(quiet, loud, bare_probe(&env, &c.o.queue_type, probe_rate, secs, every));
            let (used, wall) = (window.now(), began.elapsed().as_secs_f64());
            let bench_used = cpu_secs(std::process::id()) - bench_cpu;
            cpu[v].push(std::array::from_fn(|i| {
                100.0 * if i < 3 { used[i] - window.start[i] } else { bench_used } / wall
            }));
            if probe_rate > 0 {
                bare[v].push(quantile_ms(&probed, 0.99));
                bare_pooled[v].add(&probed).unwrap();
            }
            let n = sent.len() + flooded.len();
            wait_succeeded(&ports, n, Duration::from_secs(secs * 12 + 600), "limits: tenants draining").await;
            drop(procs);
            let mut waits = latencies().lock().unwrap().clone();
            for r in runs(&env).await.iter().filter(|r| r.outcome == Outcome::Succeeded) {
                if let (Some(at), Some(start)) = (sent.get(&r.key), r.started_at) {
                    waits.record(((start - *at).num_microseconds().unwrap_or(0)).max(1) as u64).unwrap();
                }
            }
            p[v].push((quantile_ms(&waits, 0.5), quantile_ms(&waits, 0.99)));
            pooled[v].add(&waits).unwrap();
        }
    }
    progress("");
    let rounds = |v: usize| p[v].iter().map(|(a, b)| format!("{a:.1}/{b:.1}")).collect::<Vec<_>>().join(" ");
    let p50 = |v: usize| median(p[v].iter().map(|x| x.0).collect());
    let p99 = |v: usize| median(p[v].iter().map(|x| x.1).collect());
    // Round by round: the flood's p99 over the same round's idle one.
    let ratio = median(p[1].iter().zip(&p[0]).map(|(f, i)| f.1 / i.1).collect());
    println!(
        "limits   9 tenants at 10/s each under 50/s per tenant, {secs} s a variant, published every {tick_ms} ms, \
         park_pack {}, {} round(s), medians of p50/p99 wait: {:.1}/{:.1} ms alone; {:.1}/{:.1} ms while a 10th floods at 200/s \
         ({:.2}x p99 alone, median of the rounds' ratios); controls: the 10th at its 50/s {:.1}/{:.1} ms, \
         200/s of an unlimited job {:.1}/{:.1} ms (flood {:.2}x p99 of the unlimited control)",
        c.o.park_pack,
        c.o.runs,
        p50(0),
        p99(0),
        p50(1),
        p99(1),
        ratio,
        p50(2),
        p99(2),
        p50(3),
        p99(3),
        p99(1) / p99(3)
    );
    for (v, name) in names.iter().take(variants.len()).enumerate() {
        println!("limits   tenants, {name}, p50/p99 per round (ms): {}", rounds(v));
    }
    // One round's p99 is its 18th-worst wait of 1,800 (at `--seconds 10`) and moves by a fifth
    // between rounds; all rounds' waits together give each variant's p99 from `--runs` times
    // as many.
    let all = |v: usize| quantile_ms(&pooled[v], 0.99);
    println!(
        "limits   tenants, every round's waits together ({} per variant), p99: alone {:.2} ms; flood {:.2} ms ({:.2}x alone, \
         {:.2}x the unlimited control); the 10th at its limit {:.2} ms ({:.2}x alone); unlimited {:.2} ms ({:.2}x alone)",
        pooled[0].len(),
        all(0),
        all(1),
        all(1) / all(0),
        all(1) / all(3),
        all(2),
        all(2) / all(0),
        all(3),
        all(3) / all(0)
    );
    for (v, name) in names.iter().take(variants.len()).enumerate() {
        let c = |i: usize| median(cpu[v].iter().map(|x| x[i]).collect());
        println!(
            "limits   tenants, {name}, CPU while offering (% of a core, medians of the rounds): broker {:.0}, redis {:.0}, \
             workers {:.0}, bench {:.0}",
            c(0),
            c(1),
            c(2),
            c(3)
        );
    }
    if probe_rate > 0 {
        let b = |v: usize| median(bare[v].clone());
        let ball = |v: usize| quantile_ms(&bare_pooled[v], 0.99);
        let ratio = |v: usize| median(bare[v].iter().zip(&bare[0]).map(|(x, a)| x / a).collect());
        println!(
            "limits   tenants, bare AMQP probe at {probe_rate}/s ({} queue, persistent; publish to delivery, no chime in its path), p99: \
             alone {:.2} ms; flood {:.2} ms ({:.2}x alone, median of the rounds' ratios; {:.2}x with every round's \
             waits together); at its limit {:.2} ms ({:.2}x; {:.2}x together); unlimited {:.2} ms ({:.2}x; {:.2}x \
             together); p50, every round's waits together: alone {:.2} ms, flood {:.2} ms",
            c.o.queue_type,
            b(0),
            b(1),
            ratio(1),
            ball(1) / ball(0),
            b(2),
            ratio(2),
            ball(2) / ball(0),
            b(3),
            ratio(3),
            ball(3) / ball(0),
            quantile_ms(&bare_pooled[0], 0.5),
            quantile_ms(&bare_pooled[1], 0.5)
        );
    }
    if bare_flood_too {
        let tenants_ratio = median(p[4].iter().zip(&p[0]).map(|(f, a)| f.1 / a.1).collect());
        println!(
            "limits   tenants, beside a bare flood of 200/s (no worker or Redis in its path), quiet tenants' p99: {:.2} ms \
             ({:.2}x alone, median of the rounds' ratios; {:.2}x with every round's waits together){}",
            p99(4),
            tenants_ratio,
            all(4) / all(0),
            if probe_rate > 0 {
                let r = median(bare[4].iter().zip(&bare[0]).map(|(x, a)| x / a).collect());
                let t = quantile_ms(&bare_pooled[4], 0.99) / quantile_ms(&bare_pooled[0], 0.99);
                format!("; bare probe {r:.2}x alone ({t:.2}x together)")
            } else {
                String::new()
            }
        );
    }
}

/// The drain of unlimited `noop` jobs with a limited job and a circuit configured for another
/// job, against none; and of `noop` jobs that go through a (closed) circuit.
async fn cost(c: &Ctx) {
    let env = TestEnv::new("bench-lcost");
    let client = EnqueueClient::connect(bench_config(&env, &c.o.queue_type, "")).await.unwrap();
    let n = 20_000 * c.o.seconds as usize;
    let noop = "[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n";
    let others = "[[jobs]]\nname = \"limited\"\nhandler = \"noop\"\nrate_limit = \"stripe\"\ncircuit = \"dep\"\n\
                  [[limits]]\nname = \"stripe\"\nrate = \"100/s\"\n[[circuits]]\nname = \"dep\"\nfailures = 5\n";
    let guarded = "[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\ncircuit = { failures = 5 }\n";
    let variants = [noop.to_string(), format!("{others}{noop}"), guarded.to_string()];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); 3];
    for r in 0..c.o.runs {
        for k in 0..3 {
            // Rotate the order each round.
            let v = (k + r) % 3;
            progress(&format!("limits: cost, variant {v}, run {}/{}", r + 1, c.o.runs));
            let d = chime_drain_jobs(
                &env,
                &c.o.queue_type,
                Some(&client),
                n,
                1,
                false,
                &variants[v],
                &crate::consume::bench_worker_section(),
                true,
                &bin_path("chime-worker"),
            )
            .await;
            rates[v].push(d.rate);
        }
    }
    progress("");
    let ratio = |v: usize| median(rates[v].iter().zip(&rates[0]).map(|(a, b)| a / b).collect());
    println!(
        "limits   drain, 1 worker: plain {:.0} jobs/s; with a limit and a circuit on another job {:.0} ({:.3}x); every job through a closed circuit {:.0} ({:.3}x)",
        median(rates[0].clone()),
        median(rates[1].clone()),
        ratio(1),
        median(rates[2].clone()),
        ratio(2)
    );
    let each = |v: usize| rates[v].iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(" ");
    println!(
        "limits   drain per round (jobs/s): plain {}; limit elsewhere {}; circuit {}",
        each(0),
        each(1),
        each(2)
    );
}

/// An `http` job at 50/s whose downstream fails every request for 3 × `--seconds` (30 s by
/// default), then answers: the requests that reached it, how many while its circuit (10
/// failures in 10 s, open 5 s, 1 probe) was open, and whether every job was then done, once.
async fn circuit(c: &Ctx) {
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;
    let failing = Arc::new(AtomicBool::new(true));
    let (hits_failing, hits) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let times: Arc<Mutex<Vec<DateTime<Utc>>>> = Arc::default();
    let (f, hf, h, t) = (failing.clone(), hits_failing.clone(), hits.clone(), times.clone());
    let app = Router::new().route(
        "/call",
        post(move || {
            let (f, hf, h, t) = (f.clone(), hf.clone(), h.clone(), t.clone());
            async move {
                h.fetch_add(1, Ordering::SeqCst);
                if f.load(Ordering::SeqCst) {
                    hf.fetch_add(1, Ordering::SeqCst);
                    t.lock().unwrap().push(Utc::now());
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::OK
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let env = TestEnv::new("bench-circuit");
    let jobs = format!(
        "[[jobs]]\nname = \"call\"\nhandler = \"http\"\nurl = \"http://{addr}/call\"\ncircuit = \"dep\"\nmax_attempts = 5\n\
         backoff = {{ initial = \"1s\", factor = 2.0, max = \"4s\" }}\n\
         [[circuits]]\nname = \"dep\"\nfailures = 10\nwindow = \"10s\"\nopen_for = \"5s\"\nprobes = 1\n"
    );
    let text = env.config_text(&c.o.queue_type, "", "", &jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let client = EnqueueClient::connect(config).await.unwrap();
    let (procs, ports) = workers(&path, 2).await;
    let secs = 3 * c.o.seconds;
    progress(&format!("limits: circuit, downstream failing for {secs} s"));
    let started = Instant::now();
    let sent = offer(&client, 50, secs, |i| EnqueueRequest::new("call").key(format!("c{i}"))).await;
    failing.store(false, Ordering::SeqCst);
    let failing_for = started.elapsed();
    wait_succeeded(&ports, sent.len(), Duration::from_secs(600), "limits: circuit recovering").await;
    drop(procs);
    let all = runs(&env).await;
    let dead = all.iter().filter(|r| r.outcome == Outcome::DeadLettered).count();
    let parked = all.iter().filter(|r| r.outcome == Outcome::Parked).count();
    let succeeded = all.iter().filter(|r| r.outcome == Outcome::Succeeded).count();
    let max_attempt =
        all.iter().filter(|r| r.outcome == Outcome::Succeeded).map(|r| r.attempt).max().unwrap_or(0);
    // The circuit first opened before the first park; requests after it that failed were
    // probes, or runs admitted just before it tripped.
    let times = times.lock().unwrap().clone();
    let first_park = all.iter().filter(|r| r.outcome == Outcome::Parked).map(|r| r.finished_at).min();
    let after = first_park.map_or(0, |p| times.iter().filter(|t| **t > p).count());
    let open_s = first_park
        .map_or(0.0, |p| (times.last().copied().unwrap_or(p) - p).num_milliseconds() as f64 / 1000.0);
    println!(
        "limits   circuit: {} jobs at 50/s, downstream failing {:.0} s: {} failed requests, {} of them after the first park ({open_s:.0} s: probes, at most one per 5 s opening, and runs admitted as it tripped); {parked} parks; then {succeeded} succeeded (highest attempt {max_attempt} of 5), {dead} dead-lettered; {} requests in all",
        sent.len(),
        failing_for.as_secs_f64(),
        hits_failing.load(Ordering::SeqCst),
        after,
        hits.load(Ordering::SeqCst)
    );
}
