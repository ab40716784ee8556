//! Graceful degradation: rate limits across worker processes, parked runs, push-back,
//! sampled success logs.

use chime_shared::history::{Outcome, RunEvent};
use chime_shared::record::KeyState;
use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::*;

/// The most runs that started within any `window` (by their `started_at`).
fn most_in_window(runs: &[&RunEvent], window: chrono::Duration) -> usize {
    let mut starts: Vec<_> = runs.iter().filter_map(|e| e.started_at).collect();
    starts.sort();
    let mut most = 0;
    let mut first = 0;
    for (i, t) in starts.iter().enumerate() {
        while *t - starts[first] >= window {
            first += 1;
        }
        most = most.max(i + 1 - first);
    }
    most
}

/// Enqueues `n` jobs of `job` with `payload(i)`; returns their keys.
async fn enqueue_keys(
    config: &chime_shared::config::ValidConfig,
    job: &str,
    n: usize,
    payload: impl Fn(usize) -> serde_json::Value,
) -> Vec<String> {
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let reqs: Vec<_> = (0..n)
        .map(|i| chime_producer::EnqueueRequest::new(job).key(format!("{job}-{i}")).payload(payload(i)))
        .collect();
    let keys = reqs.iter().map(|r| client.prepare(r).unwrap().envelope.key.to_string()).collect();
    let report = client.enqueue_batch(&reqs).await.unwrap();
    assert_eq!(report.confirmed, n, "{:?}", report.error);
    keys
}

async fn wait_all_done(
    config: &chime_shared::config::ValidConfig,
    env: &TestEnv,
    keys: &[String],
    within: Duration,
) {
    let reader = chime_shared::history::HistoryReader::connect(&config.redis, env.names()).await.unwrap();
    let keys = keys.to_vec();
    wait_until("every key done", within, || {
        let (reader, keys) = (reader.clone(), keys.clone());
        async move {
            let states = reader.states(&keys).await.unwrap();
            states.iter().all(|s| matches!(s, Some((KeyState::Done, _))))
        }
    })
    .await;
}

/// Two worker processes share one limit of 20 runs a second: 100 jobs enqueued at once start
/// no more than 41 (plus 4 for the spread of claim latencies) in any two seconds; the
/// runs whose start is further off than `worker.max_hold` are parked and come back to run
/// once each, as their first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_holds_across_two_workers_and_parked_runs_run_once() {
    let env = TestEnv::new("rate-two");
    let jobs = "[[jobs]]\nname = \"paced\"\nhandler = \"noop\"\nrate_limit = \"20/s\"\n";
    let text = env.config_text("classic", "", "max_hold = \"1s\"", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let keys = enqueue_keys(&config, "paced", 100, |_| serde_json::json!({})).await;
    let (a, b) = (Child::worker(&env.dir, &path, &[], "a"), Child::worker(&env.dir, &path, &[], "b"));
    wait_all_done(&config, &env, &keys, Duration::from_secs(60)).await;
    let (_, runs) = history_runs(&env).await;
    let succeeded: Vec<&RunEvent> = runs.iter().filter(|e| e.outcome == Outcome::Succeeded).collect();
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &succeeded {
        *per_key.entry(e.key.as_str()).or_default() += 1;
    }
    assert!(per_key.len() == 100 && per_key.values().all(|n| *n == 1), "each ran once: {per_key:?}");
    assert!(succeeded.iter().all(|e| e.attempt == 1), "parking never counts an attempt");
    let workers: std::collections::BTreeSet<&str> = succeeded.iter().map(|e| e.worker.as_str()).collect();
    assert_eq!(workers.len(), 2, "both workers ran some: {workers:?}");
    let parked = runs.iter().filter(|e| e.outcome == Outcome::Parked).count();
    assert!(parked > 0, "runs further off than max_hold were parked");
    assert!(
        runs.iter()
            .filter(|e| e.outcome == Outcome::Parked)
            .all(|e| e.reason.as_deref() == Some("rate_limit")),
        "parked for their rate limit"
    );
    // Starts are reserved 50 ms apart; a run starts at its reservation plus its claim's
    // latency, which varies under load: any 2 s hold at most 41 reservations, plus 4 for
    // that spread.
    let most = most_in_window(&succeeded, chrono::Duration::seconds(2));
    assert!(most <= 45, "{most} runs started within two seconds under a limit of 20/s");
    drop((a, b));
}

/// Per tenant: one tenant's flood never delays another tenant's jobs of the same job type.
/// Tenant `big` enqueues 30 jobs at 2/s (15 s of work), then `small` enqueues 3: those run
/// within their own budget, long before `big`'s backlog is through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_flood_does_not_delay_another_tenant() {
    let env = TestEnv::new("rate-tenant");
    let jobs =
        "[[jobs]]\nname = \"call\"\nhandler = \"noop\"\nrate_limit = { rate = \"2/s\", key = \"tenant\" }\n";
    let text = env.config_text("classic", "", "max_hold = \"1s\"", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let worker = Child::worker(&env.dir, &path, &[], "w");
    let big = enqueue_keys(&config, "call", 30, |_| serde_json::json!({"tenant": "big"})).await;
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let mut small = Vec::new();
    for i in 0..3 {
        let req = chime_producer::EnqueueRequest::new("call")
            .key(format!("small-{i}"))
            .payload(serde_json::json!({"tenant": "small"}));
        small.push(client.prepare(&req).unwrap().envelope.key.to_string());
        client.enqueue(req).await.unwrap();
    }
    wait_all_done(&config, &env, &small, Duration::from_secs(30)).await;
    let reader = chime_shared::history::HistoryReader::connect(&config.redis, env.names()).await.unwrap();
    let done_big =
        reader.states(&big).await.unwrap().iter().filter(|s| matches!(s, Some((KeyState::Done, _)))).count();
    assert!(
        done_big < 20,
        "small's 3 jobs were done while big's backlog was still going ({done_big} of 30 done)"
    );
    wait_all_done(&config, &env, &big, Duration::from_secs(60)).await;
    let (_, runs) = history_runs(&env).await;
    let big_runs: Vec<&RunEvent> =
        runs.iter().filter(|e| e.outcome == Outcome::Succeeded && big.contains(&e.key)).collect();
    let most = most_in_window(&big_runs, chrono::Duration::seconds(5));
    assert!(most <= 12, "{most} of big's runs within 5 s under 2/s");
    drop(worker);
}

/// A handler that reports the downstream pushed back (`JobError::rate_limited`) parks its run
/// for the wait it asked for, as the same attempt, and holds the job's limit for every run of
/// the bucket meanwhile: the next job of the bucket starts only after the hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_back_run_is_parked_and_holds_its_bucket() {
    use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
    use std::sync::{Arc, Mutex};
    let env = TestEnv::new("rate-push");
    let jobs = "[[jobs]]\nname = \"api\"\nhandler = \"api\"\nrate_limit = \"stripe\"\nmax_attempts = 1\n\
                [[limits]]\nname = \"stripe\"\nrate = \"100/s\"\n";
    let config = env.config("classic", "", "", jobs);
    // Attempt runs of `first` push back once with 2 s; every run's start is noted.
    let starts: Arc<Mutex<Vec<(String, u32, std::time::Instant)>>> = Arc::default();
    let mut registry = Registry::new();
    let s = starts.clone();
    registry.register(
        "api",
        raw_handler_fn(move |ctx: JobContext, p: serde_json::Value| {
            let s = s.clone();
            async move {
                let name = p["name"].as_str().unwrap_or_default().to_string();
                let earlier = s.lock().unwrap().iter().filter(|(n, ..)| *n == name).count();
                s.lock().unwrap().push((name.clone(), ctx.attempt(), std::time::Instant::now()));
                if name == "first" && earlier == 0 {
                    return Err(JobError::rate_limited(Duration::from_secs(2), "HTTP 429"));
                }
                Ok(())
            }
        }),
    );
    let worker = Running::start(config.clone(), registry, 8).await;
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let first = chime_producer::EnqueueRequest::new("api").payload(serde_json::json!({"name": "first"}));
    client.enqueue(first).await.unwrap();
    let s = starts.clone();
    wait_until("first ran once", Duration::from_secs(10), || {
        let n = s.lock().unwrap().len();
        async move { n == 1 }
    })
    .await;
    let pushed_at = starts.lock().unwrap()[0].2;
    // Parked (after its bucket was held): then the next job of the bucket arrives.
    let e = &env;
    wait_until("first parked", Duration::from_secs(10), || async move {
        history_runs(e).await.1.iter().any(|r| r.outcome == Outcome::Parked)
    })
    .await;
    let second = chime_producer::EnqueueRequest::new("api").payload(serde_json::json!({"name": "second"}));
    client.enqueue(second).await.unwrap();
    let s = starts.clone();
    wait_until("both done", Duration::from_secs(30), || {
        let n = s.lock().unwrap().len();
        async move { n == 3 }
    })
    .await;
    let starts = starts.lock().unwrap().clone();
    // `max_attempts = 1`: a counted attempt would have dead-lettered it.
    assert!(starts.iter().all(|(_, attempt, _)| *attempt == 1), "{starts:?}");
    for (name, _, at) in &starts[1..] {
        assert!(
            at.duration_since(pushed_at) >= Duration::from_millis(1900),
            "{name} started {:?} after the push-back, inside the 2 s hold",
            at.duration_since(pushed_at)
        );
    }
    assert_eq!(worker.dead_lettered(), 0);
    worker.stop().await;
    let (_, runs) = history_runs(&env).await;
    assert!(
        runs.iter().any(|e| e.outcome == Outcome::Parked && e.reason.as_deref() == Some("pushed_back")),
        "{runs:?}"
    );
}

/// `log.success_sample = 0`: a worker logs no success, still logs every failure, and its
/// history and metrics still count every run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_logs_drop_successes_and_keep_failures() {
    let env = TestEnv::new("log-sample");
    let jobs = "[log]\nsuccess_sample = 0.0\n\
                [[jobs]]\nname = \"fine\"\nhandler = \"noop\"\n\
                [[jobs]]\nname = \"broken\"\nhandler = \"exec\"\ncommand = [\"sh\", \"-c\", \"exit 100\"]\n";
    let text = env.config_text("classic", "", "", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let fine = enqueue_keys(&config, "fine", 20, |_| serde_json::json!({})).await;
    let broken = enqueue_keys(&config, "broken", 1, |_| serde_json::json!({})).await;
    let worker = Child::worker(&env.dir, &path, &[], "w");
    wait_all_done(&config, &env, &fine, Duration::from_secs(30)).await;
    let reader = chime_shared::history::HistoryReader::connect(&config.redis, env.names()).await.unwrap();
    let b = broken.clone();
    wait_until("the broken job dead-lettered", Duration::from_secs(30), || {
        let (reader, b) = (reader.clone(), b.clone());
        async move { matches!(reader.states(&b).await.unwrap()[0], Some((KeyState::Dead, _))) }
    })
    .await;
    let w = &worker;
    wait_until("the failure logged", Duration::from_secs(10), || {
        let log = w.log_text();
        async move { log.contains("dead-lettered") }
    })
    .await;
    let log = worker.log_text();
    assert!(!log.contains("job succeeded"), "no success logged at a sample of 0:\n{log}");
    assert!(log.contains("job failed"), "{log}");
    let (_, runs) = history_runs(&env).await;
    assert_eq!(runs.iter().filter(|e| e.outcome == Outcome::Succeeded).count(), 20, "history stays complete");
}
