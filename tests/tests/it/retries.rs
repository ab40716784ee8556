//! Retries through the delay chain, and delayed delivery for `enqueue --delay/--at`.

use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_shared::delay;
use chime_worker::{JobContext, JobError, Registry, Stats, raw_handler_fn};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::dead_letters::drain_dlq;

const FAST: &str = "backoff = { initial = \"1s\", factor = 1.0, max = \"1s\" }\n";

#[tokio::test]
async fn a_job_failing_twice_then_succeeding_runs_three_times() {
    let env = TestEnv::new("flaky");
    let config = env.config(
        "quorum",
        "",
        "",
        &format!("[[jobs]]\nname = \"flaky\"\nhandler = \"flaky\"\nmax_attempts = 5\n{FAST}"),
    );
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let mut reg = Registry::new();
    let a = attempts.clone();
    reg.register(
        "flaky",
        raw_handler_fn(move |ctx: JobContext, _| {
            a.lock().unwrap().push((ctx.attempt(), ctx.fence()));
            async move { if ctx.attempt() < 3 { Err(JobError::transient("not yet")) } else { Ok(()) } }
        }),
    );
    let worker = Running::start(config.clone(), reg, 2).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    client.enqueue(EnqueueRequest::new("flaky")).await.unwrap();
    let w = &worker;
    wait_until("success after two retries", Duration::from_secs(30), || async { w.succeeded() == 1 }).await;
    let seen = attempts.lock().unwrap().clone();
    assert_eq!(seen.iter().map(|(a, _)| *a).collect::<Vec<_>>(), [1, 2, 3], "attempts 1..3");
    assert!(seen.windows(2).all(|w| w[0].1 < w[1].1), "the fence grows per claim: {seen:?}");
    assert_eq!(Stats::get(&worker.stats.retried), 2);
    assert_eq!(worker.dead_lettered(), 0);
    worker.stop().await;
}

#[tokio::test]
async fn a_job_that_always_fails_runs_max_attempts_times_then_is_dead_lettered() {
    let env = TestEnv::new("hopeless");
    let config = env.config(
        "classic",
        "",
        "",
        &format!("[[jobs]]\nname = \"bad\"\nhandler = \"bad\"\nmax_attempts = 3\n{FAST}"),
    );
    let runs = Ledger::default();
    let mut reg = Registry::new();
    let r = runs.clone();
    reg.register(
        "bad",
        raw_handler_fn(move |ctx: JobContext, _| {
            r.record(u64::from(ctx.attempt()));
            async { Err(JobError::transient("upstream 503")) }
        }),
    );
    let worker = Running::start(config.clone(), reg, 2).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let job = client.enqueue(EnqueueRequest::new("bad").key("k")).await.unwrap();
    let w = &worker;
    wait_until("dead-lettered", Duration::from_secs(30), || async { w.dead_lettered() == 1 }).await;
    assert_eq!(runs.total(), 3);
    let dead = drain_dlq(&env.names().dlq("default"), 1).await;
    let (body, h) = &dead[0];
    assert_eq!(h["x-chime-reason"], "exhausted");
    assert_eq!(h["x-chime-attempts"], "3");
    assert!(h["x-chime-error"].contains("upstream 503"));
    let env3: chime_shared::Envelope = chime_shared::Envelope::decode(body).unwrap();
    assert_eq!((env3.key, env3.attempt), (job.key, 3), "the DLQ holds the last attempt's envelope");
    // The key is dead: a later duplicate is absorbed, not rerun.
    assert_eq!(idem_state(&env, &job.key.to_string()).await.as_deref(), Some("dead"));
    client.enqueue(EnqueueRequest::new("bad").key("k")).await.unwrap();
    wait_until("duplicate of a dead job absorbed", Duration::from_secs(20), || async { w.duplicates() == 1 })
        .await;
    assert_eq!(runs.total(), 3);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_jobs_arrive_in_order_within_a_second_of_their_due_time() {
    let env = TestEnv::new("delays");
    let config = env.config("quorum", "", "", "[[jobs]]\nname = \"at\"\nhandler = \"at\"\n");
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let mut reg = Registry::new();
    let a = arrivals.clone();
    reg.register(
        "at",
        raw_handler_fn(move |_, p: serde_json::Value| {
            a.lock().unwrap().push((p["d"].as_u64().unwrap(), Instant::now()));
            async { Ok(()) }
        }),
    );
    let worker = Running::start(config.clone(), reg, 4).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let start = Instant::now();
    for d in [7u64, 1, 3] {
        client
            .enqueue(
                EnqueueRequest::new("at").payload(serde_json::json!({"d": d})).delay(Duration::from_secs(d)),
            )
            .await
            .unwrap();
    }
    let w = &worker;
    wait_until("three delayed jobs ran", Duration::from_secs(30), || async { w.succeeded() == 3 }).await;
    let got = arrivals.lock().unwrap().clone();
    let order: Vec<u64> = got.iter().map(|(d, _)| *d).collect();
    assert_eq!(order, [1, 3, 7]);
    for (d, at) in &got {
        let late = at.duration_since(start).as_secs_f64() - *d as f64;
        println!("delay {d}s: ran {late:+.3}s after due");
        // The broker's timers run on Erlang's clock, which corrects a jump of the OS clock by
        // running up to 1 % fast (`no_time_warp`, RabbitMQ's default): after this machine was
        // suspended and resumed, the broker's clock was 6.3 s behind the OS's and the 7 s job
        // ran 53 ms early. A delay rounded down or a level skipped would be a whole second
        // early, so 1 % plus 50 ms of slack hides neither.
        let slack = 0.01 * *d as f64 + 0.05;
        assert!((-slack..1.0).contains(&late), "delay {d}s ran {late:.3}s after due");
    }
    worker.stop().await;
}

#[tokio::test]
async fn a_one_year_delay_is_accepted_and_waits_in_level_24() {
    use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
    let env = TestEnv::new("year");
    let config = env.config("classic", "", "", "[[jobs]]\nname = \"later\"\nhandler = \"noop\"\n");
    let client = EnqueueClient::connect(config).await.unwrap();
    let year = Duration::from_secs(365 * 86_400);
    let job = client.enqueue(EnqueueRequest::new("later").delay(year)).await.unwrap();
    let level = delay::first_level(year.as_secs()).unwrap();
    assert_eq!(level, 24);
    assert_eq!(depth(&env.names().work_queue("default")).await, 0);
    // The level queue is shared by every prefix on the broker: find this test's message in it
    // and take it out (a year-long delay must not outlive the test).
    let q = chime_shared::names::delay_level(chime_shared::config::QueueType::Classic, level);
    let conn = connect_amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let key = job.key.to_string();
    let found = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let Ok(Some(m)) = ch.basic_get(q.as_str().into(), BasicGetOptions::default()).await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            if m.properties.message_id().as_ref().map(|id| id.as_str()) == Some(key.as_str()) {
                m.ack(BasicAckOptions::default()).await.unwrap();
                return true;
            }
            m.nack(BasicNackOptions { requeue: true, ..Default::default() }).await.unwrap();
        }
    })
    .await;
    assert_eq!(found, Ok(true), "the message waits in level 24 ({q})");
    let _ = conn.close(200, "".into()).await;
}
