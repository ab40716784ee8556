//! Worker behaviour: bounded concurrency, lease renewal, HTTP endpoints, the http handler.

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_is_bounded_per_process() {
    let env = TestEnv::new("bounded");
    let config =
        env.config("classic", "", "prefetch = 10", "[[jobs]]\nname = \"gauge\"\nhandler = \"gauge\"\n");
    let current = Arc::new(AtomicUsize::new(0));
    let max = Arc::new(AtomicUsize::new(0));
    let mut reg = Registry::new();
    let (c, m) = (current.clone(), max.clone());
    reg.register(
        "gauge",
        raw_handler_fn(move |_, _| {
            let (c, m) = (c.clone(), m.clone());
            async move {
                let now = c.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                c.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, JobError>(())
            }
        }),
    );
    let worker = Running::start(config.clone(), reg, 3).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let reqs: Vec<_> = (0..20).map(|_| EnqueueRequest::new("gauge")).collect();
    client.enqueue_batch(&reqs).await.unwrap();
    let w = &worker;
    wait_until("20 jobs done", Duration::from_secs(30), || async { w.succeeded() == 20 }).await;
    assert_eq!(max.load(Ordering::SeqCst), 3, "at most (and, with a backlog, exactly) 3 at once");
    worker.stop().await;
}

#[tokio::test]
async fn lease_is_renewed_while_a_long_handler_runs() {
    // Lease 1 s, handler 2.5 s: without renewal the second copy would claim the key after
    // 1 s and run the job again.
    let env = TestEnv::new("renew");
    let config = env.config("quorum", "lease = \"1s\"\ndone_retention = \"1h\"", "", COUNT_JOB);
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), counting_registry(&ledger), 2).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let req = EnqueueRequest::new("count").payload(serde_json::json!({"n": 1, "sleep_ms": 2500})).key("long");
    client.enqueue(req.clone()).await.unwrap();
    client.enqueue(req).await.unwrap();
    let w = &worker;
    wait_until("one run, one duplicate", Duration::from_secs(30), || async {
        w.succeeded() == 1 && w.duplicates() == 1
    })
    .await;
    assert_eq!(ledger.get(1), 1);
    worker.stop().await;
}

#[derive(Default)]
struct Seen {
    calls: Vec<(String, String, String)>,
}

#[tokio::test]
async fn http_handler_maps_statuses_and_sends_the_key() {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let record = |status: StatusCode, seen: Arc<Mutex<Seen>>| {
        move |headers: HeaderMap, body: String| async move {
            let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
            seen.lock().unwrap().calls.push((h("idempotency-key"), h("x-chime-attempt"), body));
            status
        }
    };
    let app = Router::new()
        .route("/ok", post(record(StatusCode::NO_CONTENT, seen.clone())))
        .route("/bad", post(record(StatusCode::UNPROCESSABLE_ENTITY, seen.clone())))
        .route("/busy", post(record(StatusCode::SERVICE_UNAVAILABLE, seen.clone())));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let env = TestEnv::new("httph");
    let jobs: String = ["ok", "bad", "busy"]
        .iter()
        .map(|p| {
            format!(
                "[[jobs]]\nname = \"h-{p}\"\nhandler = \"http\"\nurl = \"http://{addr}/{p}\"\nmax_attempts = 2\n\
                 backoff = {{ initial = \"1s\", factor = 1.0, max = \"1s\" }}\n"
            )
        })
        .collect();
    let config = env.config("classic", "", "", &jobs);
    let worker = Running::start(config.clone(), Registry::new(), 3).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let ok = client.enqueue(EnqueueRequest::new("h-ok").payload(serde_json::json!({"x": 1}))).await.unwrap();
    client.enqueue(EnqueueRequest::new("h-bad")).await.unwrap();
    client.enqueue(EnqueueRequest::new("h-busy")).await.unwrap();
    let w = &worker;
    wait_until("1 success, 2 dead letters", Duration::from_secs(30), || async {
        w.succeeded() == 1 && w.dead_lettered() == 2
    })
    .await;
    let calls = seen.lock().unwrap().calls.clone();
    assert!(calls.contains(&(ok.key.to_string(), "1".into(), "{\"x\":1}".into())), "{calls:?}");
    // 2xx once; 422 (permanent) once; 503 (transient) twice, attempts 1 and 2.
    assert_eq!(calls.len(), 4, "{calls:?}");
    let mut dead = crate::dead_letters::drain_dlq(&env.names().dlq("default"), 2).await;
    dead.sort_by(|a, b| a.1["x-chime-reason"].cmp(&b.1["x-chime-reason"]));
    let reasons: Vec<(&str, &str)> =
        dead.iter().map(|(_, h)| (h["x-chime-reason"].as_str(), h["x-chime-error"].as_str())).collect();
    let busy = format!("POST http://{addr}/busy: HTTP 503");
    let bad = format!("POST http://{addr}/bad: HTTP 422");
    assert_eq!(reasons, [("exhausted", busy.as_str()), ("permanent", bad.as_str())]);
    worker.stop().await;
}

#[tokio::test]
async fn worker_process_serves_livez_readyz_and_metrics() {
    let env = TestEnv::new("endpoints");
    let port = free_port();
    let text = env.config_text(
        "classic",
        "",
        &format!("listen = \"127.0.0.1:{port}\""),
        "[[jobs]]\nname = \"n\"\nhandler = \"noop\"\n[[jobs]]\nname = \"long\"\nhandler = \"noop\"\ntimeout = \"40m\"\n",
    );
    let path = env.write_config(&text);
    let mut w = Child::worker(&env.dir, &path, &[], "w");
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let get = |path: &'static str| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            match http.get(format!("{base}{path}")).send().await {
                Ok(r) => Some((r.status().as_u16(), r.text().await.unwrap_or_default())),
                Err(_) => None,
            }
        }
    };
    wait_until("/readyz answers 200", Duration::from_secs(20), || async {
        get("/readyz").await.is_some_and(|(s, _)| s == 200)
    })
    .await;
    let (_, ready) = get("/readyz").await.unwrap();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&ready).unwrap(),
        serde_json::json!({"amqp": true, "consuming": true, "redis": true})
    );
    assert_eq!(get("/livez").await.unwrap().0, 200);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let client = EnqueueClient::connect(config).await.unwrap();
    client.enqueue(EnqueueRequest::new("n")).await.unwrap();
    wait_until("metrics count the job", Duration::from_secs(20), || async {
        get("/metrics")
            .await
            .is_some_and(|(_, m)| m.contains("chime_jobs_completed_total{job=\"n\",outcome=\"succeeded\"} 1"))
    })
    .await;
    let (_, metrics) = get("/metrics").await.unwrap();
    assert!(metrics.contains("chime_job_duration_seconds_bucket{job=\"n\""), "histograms have buckets");
    assert!(metrics.contains("chime_up{dependency=\"redis\"} 1"));
    w.signal(15);
    let status = tokio::time::timeout(Duration::from_secs(30), w.child.wait()).await.unwrap().unwrap();
    assert_eq!(status.code(), Some(0));
    let log = w.log_text();
    assert!(
        log.contains("job timeout is not safely below RabbitMQ's consumer_timeout")
            && log.contains("job=long"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_job_does_not_hold_back_the_acks_of_finished_ones() {
    // Prefetch 4: if finished deliveries behind the long one stayed unacked (waiting for a
    // contiguous batch), the channel would stall after three of them.
    let env = TestEnv::new("ackhold");
    let config = env.config("quorum", "", "prefetch = 4", COUNT_JOB);
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), counting_registry(&ledger), 4).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    client
        .enqueue(EnqueueRequest::new("count").payload(serde_json::json!({"n": 0, "sleep_ms": 30_000})))
        .await
        .unwrap();
    let quick: Vec<_> =
        (1..=20u64).map(|n| EnqueueRequest::new("count").payload(serde_json::json!({"n": n}))).collect();
    client.enqueue_batch(&quick).await.unwrap();
    let l = &ledger;
    wait_until("20 quick jobs done while the long one runs", Duration::from_secs(20), || async {
        l.distinct() == 20
    })
    .await;
    assert_eq!(ledger.get(0), 0, "the long job is still running");
    worker.token.cancel();
}

/// `jobs[].concurrency` bounds one job in a worker process while others run wide: 12 runs of
/// a slow job limited to 2 never overlap by more than 2, and 60 light jobs on another queue
/// all finish while the first two slow runs are still running (they wait for the last light
/// job), though the worker runs only 4 jobs at once and the slow queue's prefetch is 4: a run
/// waiting for its job's limit gives its worker-wide slot back. Were it kept, the light jobs
/// would get no slot and the slow runs would give up waiting for them.
#[tokio::test]
async fn a_job_concurrency_limit_bounds_heavy_runs_and_light_jobs_pass_them() {
    use chime_worker::{JobContext, Registry, raw_handler_fn};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let mut env = TestEnv::new("jobconc");
    env.queues.push("slow".into());
    let config = env.config(
        "quorum",
        "",
        "prefetch = 4",
        "[[jobs]]\nname = \"heavy\"\nhandler = \"heavy\"\nqueue = \"slow\"\nconcurrency = 2\n\
         [[jobs]]\nname = \"light\"\nhandler = \"light\"\n",
    );
    let (now, peak, heavy_done, light_done) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    // Set by the last light job; heavy runs wait for it (up to a deadline) before finishing.
    let (lights_done, lights_seen) = tokio::sync::watch::channel(false);
    let starved = Arc::new(AtomicBool::new(false));
    let mut reg = Registry::new();
    let (n, p, h, s) = (now.clone(), peak.clone(), heavy_done.clone(), starved.clone());
    reg.register(
        "heavy",
        raw_handler_fn(move |_ctx: JobContext, _| {
            let (n, p, h, s, mut seen) = (n.clone(), p.clone(), h.clone(), s.clone(), lights_seen.clone());
            async move {
                let running = n.fetch_add(1, Ordering::SeqCst) + 1;
                p.fetch_max(running, Ordering::SeqCst);
                if !s.load(Ordering::SeqCst)
                    && tokio::time::timeout(Duration::from_secs(20), seen.wait_for(|done| *done))
                        .await
                        .is_err()
                {
                    s.store(true, Ordering::SeqCst);
                }
                // Long enough for the next runs to pile up against the limit.
                tokio::time::sleep(Duration::from_millis(50)).await;
                n.fetch_sub(1, Ordering::SeqCst);
                h.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        }),
    );
    let l = light_done.clone();
    let lights_done = Arc::new(lights_done);
    reg.register(
        "light",
        raw_handler_fn(move |_ctx: JobContext, _| {
            let (l, done) = (l.clone(), lights_done.clone());
            async move {
                if l.fetch_add(1, Ordering::SeqCst) + 1 == 60 {
                    done.send_replace(true);
                }
                Ok(())
            }
        }),
    );
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    // Heavy first, alone: two run, two more are taken in and wait for the limit (the
    // prefetch is set to 4; left to its default it would be the limit's 2). Only then the light ones, which need those two waiting runs'
    // worker-wide slots.
    let heavy: Vec<_> = (0..12).map(|i| EnqueueRequest::new("heavy").key(format!("h{i}"))).collect();
    assert_eq!(client.enqueue_batch(&heavy).await.unwrap().confirmed, 12);
    let worker = Running::start(config, reg, 4).await;
    let running = &now;
    wait_until("two heavy runs running", Duration::from_secs(30), || async {
        running.load(Ordering::SeqCst) == 2
    })
    .await;
    let light: Vec<_> = (0..60).map(|i| EnqueueRequest::new("light").key(format!("l{i}"))).collect();
    assert_eq!(client.enqueue_batch(&light).await.unwrap().confirmed, 60);
    let hd = &heavy_done;
    wait_until("every heavy run finished", Duration::from_secs(60), || async {
        hd.load(Ordering::SeqCst) == 12
    })
    .await;
    assert_eq!(light_done.load(Ordering::SeqCst), 60);
    assert_eq!(peak.load(Ordering::SeqCst), 2, "at most 2 heavy runs at once, and 2 were reached");
    assert!(
        !starved.load(Ordering::SeqCst),
        "heavy runs waited 20 s and the light jobs did not finish: runs waiting for the limit kept the worker's slots"
    );
    worker.stop().await;
}

/// Runs of one job, counted as they start and end: how many run now, the most at once, done.
#[derive(Default)]
struct Overlap {
    now: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
    done: Arc<AtomicUsize>,
}

impl Overlap {
    /// A registry whose handler `job` runs for `run_for` (the job's own length), counted here.
    fn registry(&self, job: &str, run_for: Duration) -> Registry {
        let (n, p, d) = (self.now.clone(), self.peak.clone(), self.done.clone());
        let mut reg = Registry::new();
        reg.register(
            job,
            raw_handler_fn(move |_ctx: JobContext, _| {
                let (n, p, d) = (n.clone(), p.clone(), d.clone());
                async move {
                    let running = n.fetch_add(1, Ordering::SeqCst) + 1;
                    p.fetch_max(running, Ordering::SeqCst);
                    tokio::time::sleep(run_for).await;
                    n.fetch_sub(1, Ordering::SeqCst);
                    d.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                }
            }),
        );
        reg
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    fn done(&self) -> usize {
        self.done.load(Ordering::SeqCst)
    }
}

/// `jobs[].global_concurrency` bounds a job across worker processes sharing the prefix: two
/// workers, each allowed 2 jobs at once, run 16 slow jobs limited to 3 globally; never more
/// than 3 run at once, and 3 are reached (which neither worker can do alone, so both ran at
/// once under the one limit), and every slot is freed at the end. (Which worker runs how many
/// is the broker's and the slots' race, not asserted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_concurrency_limit_holds_across_workers() {
    let env = TestEnv::new("globalconc");
    let config = env.config(
        "quorum",
        "",
        "",
        "[[jobs]]\nname = \"scarce\"\nhandler = \"scarce\"\nglobal_concurrency = 3\n",
    );
    let runs = Overlap::default();
    let registry = || runs.registry("scarce", Duration::from_millis(150));
    let a = Running::start(config.clone(), registry(), 2).await;
    let b = Running::start(config.clone(), registry(), 2).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let reqs: Vec<_> = (0..16).map(|i| EnqueueRequest::new("scarce").key(format!("s{i}"))).collect();
    assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, 16);
    let r = &runs;
    wait_until("16 runs done", Duration::from_secs(60), || async { r.done() == 16 }).await;
    assert_eq!(runs.peak(), 3, "at most 3 at once across both workers, and 3 reached (by both at once)");
    // A run counts as succeeded once its finish is recorded, just after its handler returned.
    wait_until("16 runs counted as succeeded", Duration::from_secs(30), || async {
        a.succeeded() + b.succeeded() >= 16
    })
    .await;
    assert_eq!(a.succeeded() + b.succeeded(), 16, "{} and {}", a.succeeded(), b.succeeded());
    let r = connect_redis(&env.redis_url).await;
    let limit_key = env.names().limit("scarce");
    wait_until("every slot freed", Duration::from_secs(10), || {
        let (mut r, k) = (r.clone(), limit_key.clone());
        async move { redis::cmd("ZCARD").arg(&k).query_async::<u64>(&mut r).await.unwrap() == 0 }
    })
    .await;
    a.stop().await;
    b.stop().await;
}

/// A slot held by a worker that died (never freed) lapses after its lease: with a limit of 1
/// and such a slot lapsing 2 s from now, the job starts only after it lapsed, then runs once.
#[tokio::test]
async fn a_dead_workers_global_slot_lapses() {
    let env = TestEnv::new("globallapse");
    let config = env.config(
        "quorum",
        "",
        "",
        "[[jobs]]\nname = \"solo\"\nhandler = \"solo\"\nglobal_concurrency = 1\n",
    );
    let mut r = connect_redis(&env.redis_url).await;
    let limit_key = env.names().limit("solo");
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut r).await.unwrap();
    let lapses_at_ms = secs * 1000 + micros / 1000 + 2000;
    let _: () = redis::cmd("ZADD")
        .arg(&limit_key)
        .arg(lapses_at_ms)
        .arg("dead-worker/run")
        .query_async(&mut r)
        .await
        .unwrap();
    let started = Arc::new(Mutex::new(Vec::new()));
    let mut reg = Registry::new();
    let (s, url) = (started.clone(), env.redis_url.clone());
    reg.register(
        "solo",
        raw_handler_fn(move |_ctx: JobContext, _| {
            let (s, url) = (s.clone(), url.clone());
            async move {
                let mut r = connect_redis(&url).await;
                let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut r).await.unwrap();
                s.lock().unwrap().push(secs * 1000 + micros / 1000);
                Ok(())
            }
        }),
    );
    let worker = Running::start(config.clone(), reg, 4).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    client.enqueue(EnqueueRequest::new("solo").key("one")).await.unwrap();
    let w = &worker;
    wait_until("the job ran", Duration::from_secs(30), || async { w.succeeded() == 1 }).await;
    let starts = started.lock().unwrap().clone();
    assert_eq!(starts.len(), 1, "{starts:?}");
    assert!(
        starts[0] >= lapses_at_ms,
        "started at {} ms, before the dead slot lapsed at {lapses_at_ms}",
        starts[0]
    );
    worker.stop().await;
}

/// A run longer than the lease keeps its global slot: it is renewed with the run's lease. With
/// `redis.lease` 1 s and a limit of 1, two runs of 3 s on two workers never overlap (had the
/// slot lapsed after 1 s, the second would start beside the first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_slot_outlives_the_lease_while_its_run_goes_on() {
    let env = TestEnv::new("globallong");
    let config = env.config(
        "quorum",
        "lease = \"1s\"",
        "",
        "[[jobs]]\nname = \"long\"\nhandler = \"long\"\nglobal_concurrency = 1\n",
    );
    let runs = Overlap::default();
    // The job's own length: three leases.
    let registry = || runs.registry("long", Duration::from_secs(3));
    let a = Running::start(config.clone(), registry(), 4).await;
    let b = Running::start(config.clone(), registry(), 4).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let reqs: Vec<_> = (0..2).map(|i| EnqueueRequest::new("long").key(format!("l{i}"))).collect();
    assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, 2);
    let r = &runs;
    wait_until("both runs done", Duration::from_secs(60), || async { r.done() == 2 }).await;
    assert_eq!(runs.peak(), 1, "the second run started while the first still held its slot");
    a.stop().await;
    b.stop().await;
}

/// Redis loses a job's slot set while a run holds a slot (a restart without persistence, a
/// failover to a replica that lagged): the run's next renewal takes its slot again, so the
/// limit counts it, and frees it when the run ends.
#[tokio::test]
async fn a_slot_redis_lost_is_taken_again_by_the_running_run() {
    let env = TestEnv::new("globallost");
    let config = env.config(
        "quorum",
        "lease = \"1s\"",
        "",
        "[[jobs]]\nname = \"held\"\nhandler = \"held\"\nglobal_concurrency = 1\n",
    );
    let running = Arc::new(AtomicUsize::new(0));
    let (release, released) = tokio::sync::watch::channel(false);
    let mut reg = Registry::new();
    let r = running.clone();
    reg.register(
        "held",
        raw_handler_fn(move |_ctx: JobContext, _| {
            let (r, mut released) = (r.clone(), released.clone());
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                // Runs until the test releases it.
                let _ = tokio::time::timeout(Duration::from_secs(30), released.wait_for(|v| *v)).await;
                r.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            }
        }),
    );
    let worker = Running::start(config.clone(), reg, 4).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    client.enqueue(EnqueueRequest::new("held").key("one")).await.unwrap();
    let run = &running;
    wait_until("the run started", Duration::from_secs(30), || async { run.load(Ordering::SeqCst) == 1 })
        .await;
    let r = connect_redis(&env.redis_url).await;
    let key = env.names().limit("held");
    let zcard = |mut r: redis::aio::MultiplexedConnection, k: String| async move {
        redis::cmd("ZCARD").arg(&k).query_async::<u64>(&mut r).await.unwrap()
    };
    assert_eq!(zcard(r.clone(), key.clone()).await, 1, "the run holds a slot");
    let _: () = redis::cmd("DEL").arg(&key).query_async(&mut r.clone()).await.unwrap();
    wait_until("the running run took its slot again", Duration::from_secs(10), || {
        let (r, k) = (r.clone(), key.clone());
        async move { zcard(r, k).await == 1 }
    })
    .await;
    assert_eq!(running.load(Ordering::SeqCst), 1, "still running when the slot was taken again");
    release.send_replace(true);
    wait_until("the job succeeded", Duration::from_secs(30), || async { worker.succeeded() == 1 }).await;
    wait_until("its slot freed", Duration::from_secs(10), || {
        let (r, k) = (r.clone(), key.clone());
        async move { zcard(r, k).await == 0 }
    })
    .await;
    worker.stop().await;
}
