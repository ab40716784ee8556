//! Latency under load: the end-to-end capacity (the highest offered rate whose backlog stays
//! flat), found by stepping the offered rate, and enqueue → handler start at 25 %, 50 % and
//! 80 % of it. The publisher (this process) and the worker (`chime-bench latency-worker`, a
//! child process running the worker library) are separate processes.

use crate::Ctx;
use crate::measure::*;
use chime_producer::{EnqueueClient, Prepared};
use chime_shared::envelope::{self, Envelope, Source};
use chime_tests::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// A job whose payload carries the instant it was handed to the client (µs since the epoch).
fn lat_job() -> Prepared {
    let t = chrono::Utc::now().timestamp_micros();
    Prepared {
        envelope: Envelope::new(
            "lat",
            "default",
            envelope::random_key(),
            serde_json::json!({ "t": t }),
            None,
            1,
            Source::Adhoc,
        ),
        delay: Duration::ZERO,
        unverified_queue: None,
        declare_queue: None,
    }
}

/// `chime-bench latency-worker CONFIG`: a worker with the default `[worker]` settings whose
/// `lat` handler records enqueue → start. Reads commands on stdin, one a line: `reset` clears
/// the histogram, `report` prints `count p50 p99 p999 max` (µs); prints `ready` once consuming.
pub async fn worker_main(config: &str) {
    let text = std::fs::read_to_string(config).unwrap();
    let cfg = chime_shared::config::Config::from_toml_str(&text).unwrap();
    let lat = latencies();
    let l = lat.clone();
    let mut reg = chime_worker::Registry::new();
    reg.register(
        "lat",
        chime_worker::raw_handler_fn(move |_, p: serde_json::Value| {
            // Recorded unless the payload says `rec: false`; then sleeps `sleep_ms`, if any.
            if p["rec"] != false {
                let sent = p["t"].as_i64().unwrap_or(0);
                let now = chrono::Utc::now().timestamp_micros();
                l.lock().unwrap().saturating_record((now - sent).max(1) as u64);
            }
            let sleep = p["sleep_ms"].as_u64().unwrap_or(0);
            async move {
                if sleep > 0 {
                    tokio::time::sleep(Duration::from_millis(sleep)).await;
                }
                Ok(())
            }
        }),
    );
    let health = chime_shared::health::Health::default();
    let worker = chime_worker::Worker::builder(cfg).registry(reg).health(health.clone()).build().unwrap();
    let token = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(token.clone()));
    wait_until("latency worker consuming", Duration::from_secs(30), || {
        let h = health.clone();
        async move { h.get("consuming") }
    })
    .await;
    println!("ready");
    let (tx, mut lines) = tokio::sync::mpsc::channel::<String>(8);
    std::thread::spawn(move || {
        for line in std::io::stdin().lines().map_while(Result::ok) {
            if tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    while let Some(line) = lines.recv().await {
        match line.trim() {
            "reset" => {
                lat.lock().unwrap().reset();
                println!("ok");
            }
            "report" => {
                let h = lat.lock().unwrap().clone();
                println!(
                    "{} {} {} {} {}",
                    h.len(),
                    h.value_at_quantile(0.5),
                    h.value_at_quantile(0.99),
                    h.value_at_quantile(0.999),
                    h.max()
                );
            }
            _ => break,
        }
    }
    token.cancel();
    let _ = run.await;
}

/// The worker child process and its command pipe.
struct LatWorker {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    out: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

/// What the worker recorded since the last `reset`.
#[derive(Clone, Copy, Default)]
struct Recorded {
    count: u64,
    p50: f64,
    p99: f64,
    p999: f64,
    max: f64,
}

impl LatWorker {
    async fn start(config: &std::path::Path) -> Self {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .arg("latency-worker")
            .arg(config)
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = tokio::time::timeout(Duration::from_secs(60), out.next_line()).await;
        assert!(
            matches!(ready, Ok(Ok(Some(ref l))) if l == "ready"),
            "latency worker did not start: {ready:?}"
        );
        Self { child, stdin, out }
    }

    async fn ask(&mut self, cmd: &str) -> String {
        self.stdin.write_all(format!("{cmd}\n").as_bytes()).await.unwrap();
        self.stdin.flush().await.unwrap();
        tokio::time::timeout(Duration::from_secs(30), self.out.next_line())
            .await
            .expect("latency worker answers")
            .unwrap()
            .expect("latency worker alive")
    }

    async fn reset(&mut self) {
        assert_eq!(self.ask("reset").await, "ok");
    }

    async fn report(&mut self) -> Recorded {
        let line = self.ask("report").await;
        let v: Vec<f64> = line.split_whitespace().map(|x| x.parse().unwrap()).collect();
        let ms = |us: f64| us / 1000.0;
        Recorded { count: v[0] as u64, p50: ms(v[1]), p99: ms(v[2]), p999: ms(v[3]), max: ms(v[4]) }
    }

    /// Asks the worker to stop and waits for it to exit (so that it cannot declare the
    /// prefix's queues again after the bench removed them).
    async fn stop(mut self) {
        let _ = self.stdin.write_all(b"quit\n").await;
        let _ = self.stdin.flush().await;
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }

    fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }
}

/// Offers `rate` jobs/s for `dur`: every millisecond the jobs due so far are handed to the
/// client as one batch in a task of its own (a service enqueuing from many requests at once).
/// Returns the rate confirmed.
async fn offer(client: &Arc<EnqueueClient>, rate: f64, dur: Duration) -> f64 {
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut sent = 0u64;
    let mut tasks = Vec::new();
    while start.elapsed() < dur {
        tick.tick().await;
        let due = (rate * start.elapsed().as_secs_f64()) as u64;
        if due > sent {
            let batch: Vec<Prepared> = (sent..due).map(|_| lat_job()).collect();
            sent = due;
            let c = client.clone();
            tasks.push(tokio::spawn(async move { c.publish_batch(&batch).await.confirmed }));
        }
    }
    let mut confirmed = 0;
    for t in tasks {
        confirmed += t.await.unwrap();
    }
    confirmed as f64 / start.elapsed().as_secs_f64()
}

/// Least-squares slope of `(seconds, depth)` samples, messages per second.
fn slope(samples: &[(f64, f64)]) -> f64 {
    let n = samples.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (sx, sy) = samples.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (num, den) =
        samples.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + (x - mx) * (y - my), b + (x - mx) * (x - mx)));
    if den == 0.0 { 0.0 } else { num / den }
}

/// One offered rate, measured.
struct Step {
    offered: f64,
    confirmed: f64,
    completed: f64,
    slope: f64,
    recorded: Recorded,
    /// CPU µs per job: broker, Redis, worker, publisher.
    cpu: [f64; 4],
}

impl Step {
    /// Sustained: the publisher kept up and the backlog did not grow (by more than 2 % of the
    /// rate, or 50 jobs/s, whichever is more: depth readings jitter by a few prefetch windows).
    fn sustained(&self) -> bool {
        self.confirmed >= 0.97 * self.offered && self.slope <= (0.02 * self.offered).max(50.0)
    }
}

/// Offers `rate` for `warm` (not measured), then `secs` measured: depth sampled every 250 ms,
/// the worker's histogram reset at the window's start. Waits for the backlog to drain after.
async fn step(
    client: &Arc<EnqueueClient>,
    worker: &mut LatWorker,
    queue: &str,
    rate: f64,
    warm: Duration,
    secs: Duration,
) -> Step {
    let probe = connect_amqp().await;
    offer(client, rate, warm).await;
    worker.reset().await;
    let me = std::process::id();
    let cpu = CpuWindow::start(vec![worker.pid(), me]);
    let publisher0 = cpu_secs(me);
    let (c, q) = (client.clone(), queue.to_string());
    let offering = tokio::spawn(async move { offer(&c, rate, secs).await });
    let start = Instant::now();
    let mut samples = Vec::new();
    while start.elapsed() < secs {
        if let Ok((depth, _)) = chime_shared::topology::depth(&probe, &q).await {
            samples.push((start.elapsed().as_secs_f64(), f64::from(depth)));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let confirmed = offering.await.unwrap();
    let recorded = worker.report().await;
    let elapsed = start.elapsed().as_secs_f64();
    let n = recorded.count.max(1);
    let [broker, redis, both] = cpu.per_message(n);
    let publisher = (cpu_secs(me) - publisher0) * 1e6 / n as f64;
    let step = Step {
        offered: rate,
        confirmed,
        completed: recorded.count as f64 / elapsed,
        slope: slope(&samples),
        recorded,
        cpu: [broker, redis, both - publisher, publisher],
    };
    // The next step starts from an empty queue.
    wait_until("the backlog drains", Duration::from_secs(300), || {
        let (p, q) = (&probe, queue);
        async move { chime_shared::topology::depth(p, q).await.is_ok_and(|(d, _)| d == 0) }
    })
    .await;
    let _ = probe.close(200, "".into()).await;
    step
}

fn step_line(what: &str, s: &Step) -> String {
    format!(
        "{what:<9} offered {:>6.0}/s  confirmed {:>6.0}/s  started {:>6.0}/s  backlog {:>+7.0}/s  {}   p50 {:>6.2} ms  p99 {:>7.2} ms  p99.9 {:>7.2} ms  max {:>7.1} ms   CPU/job: broker {:.0} µs, redis {:.0} µs, worker {:.0} µs, publisher {:.0} µs",
        s.offered,
        s.confirmed,
        s.completed,
        s.slope,
        if s.sustained() { "flat " } else { "grows" },
        s.recorded.p50,
        s.recorded.p99,
        s.recorded.p999,
        s.recorded.max,
        s.cpu[0],
        s.cpu[1],
        s.cpu[2],
        s.cpu[3]
    )
}

/// `latency`: the capacity search, then the latency at 25 %, 50 % and 80 % of it (and at any
/// `--latency-rates`), each `--runs` times.
pub async fn scenario(c: &Ctx) {
    let env = TestEnv::new("bench-lat");
    let text = env.config_text(
        &c.o.queue_type,
        "",
        "",
        "[[jobs]]\nname = \"lat\"\nhandler = \"lat\"\nmax_attempts = 1\n",
    );
    let path = env.write_config(&text);
    let config = chime_shared::config::Config::from_toml_str(&text).unwrap();
    let client = Arc::new(EnqueueClient::connect(config).await.unwrap());
    let mut worker = LatWorker::start(&path).await;
    let queue = env.names().work_queue("default");
    let (warm, secs) = (Duration::from_secs(2), Duration::from_secs(c.o.seconds.clamp(4, 10)));
    // Start well below what one worker drains, when that was measured; step up by 20 %.
    let mut rate = c.saturated.map_or(2_000.0, |d| (d * 0.3).max(500.0));
    let mut capacities = Vec::new();
    for r in 0..c.o.runs {
        let (mut good, mut bad): (Option<f64>, Option<f64>) = (None, None);
        let mut probes = 0;
        while probes < 30 {
            probes += 1;
            progress(&format!("latency: capacity search, run {}/{}, offering {rate:.0}/s", r + 1, c.o.runs));
            let mut s = step(&client, &mut worker, &queue, rate, warm, secs).await;
            progress("");
            println!("{}", step_line("capacity", &s));
            if !s.sustained() {
                // One hiccup of this VM (a queue compacting its log, a noisy neighbour) must
                // not end the search: a rate counts as too much only when it fails twice.
                progress(&format!(
                    "latency: capacity search, run {}/{}, offering {rate:.0}/s again",
                    r + 1,
                    c.o.runs
                ));
                s = step(&client, &mut worker, &queue, rate, warm, secs).await;
                progress("");
                println!("{}", step_line("again", &s));
            }
            if s.sustained() {
                good = Some(rate);
            } else {
                bad = Some(rate);
            }
            rate = match (good, bad) {
                (Some(g), None) => g * 1.2,
                (None, Some(b)) => b / 1.5,
                // Bisect until the bracket is within 5 %.
                (Some(g), Some(b)) if b / g > 1.05 => (g + b) / 2.0,
                _ => break,
            };
        }
        let cap = good.unwrap_or(0.0);
        println!(
            "capacity run {}/{}: {cap:.0} jobs/s (first unsustained: {:.0})",
            r + 1,
            c.o.runs,
            bad.unwrap_or(0.0)
        );
        capacities.push(cap);
        rate = cap;
    }
    let capacity = median(capacities.clone());
    println!(
        "latency  end-to-end capacity (publisher and worker in separate processes, default [worker]): {capacity:.0} jobs/s (runs: {})",
        capacities.iter().map(|c| format!("{c:.0}")).collect::<Vec<_>>().join(", ")
    );
    let mut points: Vec<(String, f64)> =
        [25.0, 50.0, 80.0].iter().map(|p| (format!("{p:.0}%"), capacity * p / 100.0)).collect();
    points.extend(c.o.rates.iter().map(|r| (format!("{r}/s"), *r as f64)));
    for (name, rate) in points {
        let mut steps = Vec::new();
        for r in 0..c.o.runs {
            progress(&format!("latency: {name} of capacity ({rate:.0}/s), run {}/{}", r + 1, c.o.runs));
            steps.push(
                step(&client, &mut worker, &queue, rate, Duration::from_secs(3), Duration::from_secs(10))
                    .await,
            );
            progress("");
        }
        let m = |f: fn(&Step) -> f64| median(steps.iter().map(f).collect());
        println!(
            "latency  at {name:<5} ({rate:>6.0}/s)  enqueue → handler start p50 {:>6.2} ms  p99 {:>7.2} ms  p99.9 {:>7.2} ms  (max {:.1} ms; started {:.0}/s; backlog {:+.0}/s; CPU/job broker {:.0} µs, redis {:.0} µs, worker {:.0} µs, publisher {:.0} µs)",
            m(|s| s.recorded.p50),
            m(|s| s.recorded.p99),
            m(|s| s.recorded.p999),
            m(|s| s.recorded.max),
            m(|s| s.completed),
            m(|s| s.slope),
            m(|s| s.cpu[0]),
            m(|s| s.cpu[1]),
            m(|s| s.cpu[2]),
            m(|s| s.cpu[3]),
        );
    }
    worker.stop().await;
}

/// A job of `job` whose payload carries the instant it was made, whether the worker records
/// its latency, and how long it sleeps.
fn job_at(job: &str, rec: bool, sleep_ms: u64) -> Prepared {
    let mut p = lat_job();
    p.envelope.job = job.to_string();
    p.envelope.payload =
        serde_json::json!({ "t": chrono::Utc::now().timestamp_micros(), "rec": rec, "sleep_ms": sleep_ms });
    p
}

/// Opt-in `priority`: 50,000 low-priority jobs (10 ms each) wait; while one worker with the
/// default settings drains them, high-priority jobs arrive at 100/s for 3 s: their enqueue →
/// start latency; then 100 more low jobs, whose latency is the backlog's.
pub async fn priority(c: &Ctx) {
    let env = TestEnv::new("bench-prio");
    let jobs = "[[jobs]]\nname = \"bulk\"\nhandler = \"lat\"\npriority = \"low\"\nmax_attempts = 1\n\
                [[jobs]]\nname = \"urgent\"\nhandler = \"lat\"\npriority = \"high\"\nmax_attempts = 1\n";
    let text = env.config_text(&c.o.queue_type, "", "", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::config::Config::from_toml_str(&text).unwrap();
    let client = Arc::new(EnqueueClient::connect(config).await.unwrap());
    let probe = connect_amqp().await;
    let low_queue = env
        .names()
        .work_queue(&chime_shared::envelope::priority_route("default", chime_shared::config::Priority::Low));
    let (mut high, mut low, mut backlog_left) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..c.o.runs {
        progress(&format!("priority: 50,000 low jobs waiting, run {}/{}", r + 1, c.o.runs));
        let backlog: Vec<Prepared> = (0..50_000)
            .map(|_| {
                let mut p = job_at("bulk", false, 10);
                p.envelope.priority = Some(chime_shared::config::Priority::Low);
                p
            })
            .collect();
        assert_eq!(client.publish_batch(&backlog).await.confirmed, 50_000);
        let mut worker = LatWorker::start(&path).await;
        worker.reset().await;
        progress(&format!("priority: high jobs at 100/s through the backlog, run {}/{}", r + 1, c.o.runs));
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        for _ in 0..300 {
            tick.tick().await;
            let mut p = job_at("urgent", true, 0);
            p.envelope.priority = Some(chime_shared::config::Priority::High);
            client.publish_batch(std::slice::from_ref(&p)).await;
        }
        let waited = Instant::now();
        let h = loop {
            let h = worker.report().await;
            if h.count >= 300 {
                break h;
            }
            assert!(
                waited.elapsed() < Duration::from_secs(300),
                "high jobs stuck: {} of 300 started",
                h.count
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let (left, _) = chime_shared::topology::depth(&probe, &low_queue).await.unwrap_or((0, 0));
        backlog_left.push(f64::from(left));
        high.push(h);
        // Now at the backlog's own level.
        worker.reset().await;
        let tail: Vec<Prepared> = (0..100)
            .map(|_| {
                let mut p = job_at("bulk", true, 10);
                p.envelope.priority = Some(chime_shared::config::Priority::Low);
                p
            })
            .collect();
        client.publish_batch(&tail).await;
        let waited = Instant::now();
        let l = loop {
            let l = worker.report().await;
            if l.count >= 100 {
                break l;
            }
            assert!(
                waited.elapsed() < Duration::from_secs(600),
                "low jobs stuck: {} of 100 started",
                l.count
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        low.push(l);
        worker.stop().await;
        wait_until("the backlog drained", Duration::from_secs(300), || async {
            chime_shared::topology::depth(&probe, &low_queue).await.is_ok_and(|(d, _)| d == 0)
        })
        .await;
    }
    progress("");
    let m = |v: &[Recorded], f: fn(&Recorded) -> f64| median(v.iter().map(f).collect());
    println!(
        "priority 300 high jobs (100/s) through a 50,000-job low backlog (10 ms each, default [worker]): enqueue → start p50 {:.2} ms  p99 {:.2} ms  max {:.1} ms   ({:.0} low jobs still waiting after the last high one)",
        m(&high, |r| r.p50),
        m(&high, |r| r.p99),
        m(&high, |r| r.max),
        median(backlog_left)
    );
    println!(
        "priority 100 low jobs after the backlog, for comparison: enqueue → start p50 {:.0} ms  p99 {:.0} ms",
        m(&low, |r| r.p50),
        m(&low, |r| r.p99)
    );
    let _ = probe.close(200, "".into()).await;
}
