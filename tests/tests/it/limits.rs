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

/// One worker (its `[worker]` settings `worker`) drains `n` jobs of `paced`, a no-op limited
/// to 20/s (its other settings `job`); returns the test's environment (bind it first: the
/// worker must stop before it is cleaned up), the config, the worker and the history's runs.
async fn drain_paced(
    name: &str,
    worker: &str,
    job: &str,
    n: usize,
) -> (TestEnv, chime_shared::config::ValidConfig, Child, Vec<RunEvent>) {
    let env = TestEnv::new(name);
    let jobs = format!("[[jobs]]\nname = \"paced\"\nhandler = \"noop\"\n{job}rate_limit = \"20/s\"\n");
    let text = env.config_text("classic", "", worker, &jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let keys = enqueue_keys(&config, "paced", n, |_| serde_json::json!({})).await;
    let child = Child::worker(&env.dir, &path, &[], "w");
    wait_all_done(&config, &env, &keys, Duration::from_secs(60)).await;
    let (_, runs) = history_runs(&env).await;
    (env, config, child, runs)
}

/// The sizes of the packs of parked copies a worker sent, from its debug log (`copies=N`).
fn pack_sizes(worker: &Child) -> Vec<usize> {
    worker
        .log_text()
        .lines()
        .filter(|l| l.contains("parked copies sent round in one message"))
        .filter_map(|l| l.split("copies=").nth(1)?.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .collect()
}

/// Enqueues `n` jobs of `job` with `payload(i)`; returns their keys.
pub(crate) async fn enqueue_keys(
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

pub(crate) async fn wait_all_done(
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
    println!("rate limit: {most} starts at most in 2 s, {parked} parks");
    assert!(most <= 45, "{most} runs started within two seconds under a limit of 20/s");
    drop((a, b));
}

/// Copies parked at once for the same delay travel round the delay chain in packs
/// (`worker.park_pack`), and each keeps its own ticket: 100 jobs at 20/s on one worker, the
/// ~60 parked within moments of each other come back in a few messages; no run parks more than
/// twice (a copy that lost its ticket would take a new one at the back of the line and park
/// again and again), each runs once, as its first attempt, and the limit's spacing holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_copies_travel_in_packs_and_keep_their_tickets() {
    let (_env, config, worker, runs) = drain_paced("rate-packs", "", "", 100).await;
    assert_eq!(config.worker.park_pack, 100, "packing is the default");
    let succeeded: Vec<&RunEvent> = runs.iter().filter(|e| e.outcome == Outcome::Succeeded).collect();
    let mut ran: BTreeMap<&str, usize> = BTreeMap::new();
    let mut parks: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &succeeded {
        *ran.entry(e.key.as_str()).or_default() += 1;
    }
    for e in runs.iter().filter(|e| e.outcome == Outcome::Parked) {
        *parks.entry(e.key.as_str()).or_default() += 1;
    }
    assert!(ran.len() == 100 && ran.values().all(|n| *n == 1), "each ran once: {ran:?}");
    assert!(succeeded.iter().all(|e| e.attempt == 1), "parking never counts an attempt");
    let parked: usize = parks.values().sum();
    assert!(parks.len() >= 50, "most runs were parked: {} of 100", parks.len());
    assert!(parks.values().all(|n| *n <= 2), "no run parked more than twice (tickets kept): {parks:?}");
    let packed = pack_sizes(&worker);
    let in_packs: usize = packed.iter().sum();
    println!("{parked} parks of {} runs; {} packs carried {in_packs} of them", parks.len(), packed.len());
    assert!(
        in_packs * 2 >= parked,
        "most parked copies travelled in packs: {in_packs} of {parked} ({packed:?})"
    );
    let most = most_in_window(&succeeded, chrono::Duration::seconds(2));
    assert!(most <= 45, "{most} runs started within two seconds under a limit of 20/s");
    drop(worker);
}

/// A pack of parked copies never holds more copies of a job than a worker can start at once
/// (`jobs[].concurrency` 3 here, below `worker.park_pack`): a worker taking it back never has
/// a copy wait for the job's slot while it holds the others' delivery. (A prefetch of 100
/// lets the line grow past `worker.max_hold`: with the job's default of 3, runs would
/// wait in place instead of parking.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pack_of_parked_copies_holds_no_more_than_its_job_can_start() {
    let (_env, _, worker, runs) =
        drain_paced("rate-pack-cap", "prefetch = 100", "concurrency = 3\n", 80).await;
    let ran = runs.iter().filter(|e| e.outcome == Outcome::Succeeded).count();
    assert_eq!(ran, 80, "each ran once");
    let packed = pack_sizes(&worker);
    assert!(!packed.is_empty(), "copies were packed");
    assert!(packed.iter().all(|n| *n <= 3), "packs of at most the job's concurrency: {packed:?}");
    drop(worker);
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

/// Load shedding: a queue 300 deep over its `max_depth` of 100. The worker skips the runs of
/// the `sheddable` job (acked, recorded `shed` with the threshold crossed), runs every
/// `critical` one; every sheddable key ran or was shed, none both. Once the depth is below 80 %
/// of the threshold the flag goes, and sheddable jobs enqueued then all run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backed_up_queue_sheds_its_sheddable_runs_and_never_its_critical_ones() {
    let env = TestEnv::new("shed");
    let jobs = "[worker.shed.default]\nmax_depth = 100\n\
                [[jobs]]\nname = \"report\"\nhandler = \"slow\"\ncriticality = \"sheddable\"\n\
                [[jobs]]\nname = \"pay\"\nhandler = \"slow\"\ncriticality = \"critical\"\n";
    let config = env.config("classic", "", "", jobs);
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let (report, pay) = pay_and_report(&client, 300, 6).await;
    let worker = Running::start(config.clone(), sleeper(50), 2).await;
    let e = &env;
    wait_all_done(&config, &env, &pay, Duration::from_secs(60)).await;
    wait_until("every report run or shed", Duration::from_secs(60), || async {
        let (ran, shed) = ran_and_shed(e).await;
        report.iter().all(|k| ran.contains_key(k) || shed.contains_key(k))
    })
    .await;
    // Below the threshold (the flag gone), sheddable jobs run again.
    wait_until("the shedding flag gone", Duration::from_secs(30), || async {
        let mut c = connect_redis(&e.redis_url).await;
        chime_shared::shed::read(&mut c, &e.names(), &["default".into()]).await.unwrap()[0].is_none()
    })
    .await;
    let reqs: Vec<_> =
        (0..20).map(|i| chime_producer::EnqueueRequest::new("report").key(format!("later-{i}"))).collect();
    let later: Vec<String> =
        reqs.iter().map(|r| client.prepare(r).unwrap().envelope.key.to_string()).collect();
    assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, 20);
    wait_all_done(&config, &env, &later, Duration::from_secs(30)).await;
    worker.stop().await;
    let (ran, shed_keys) = ran_and_shed(&env).await;
    assert!(later.iter().all(|k| ran.get(k) == Some(&1)), "sheddable runs enqueued later run");
    let (_, runs) = history_runs(&env).await;
    let shed: Vec<&RunEvent> =
        runs.iter().filter(|x| x.outcome == Outcome::Shed && !later.contains(&x.key)).collect();
    assert!(pay.iter().all(|k| !shed_keys.contains_key(k)), "a critical job is never shed");
    let shed_reports = report.iter().filter(|k| shed_keys.contains_key(*k)).count();
    let ran_reports = report.iter().filter(|k| ran.contains_key(*k)).count();
    println!("shedding: {shed_reports} of 250 sheddable runs shed, {ran_reports} ran");
    assert!(shed_reports > 0, "the backed-up queue shed sheddable runs");
    for k in &report {
        let (r, s) = (ran.get(k).copied().unwrap_or(0), shed_keys.get(k).copied().unwrap_or(0));
        assert_eq!(r + s, 1, "{k}: ran {r} times, shed {s} times (once in all, never both)");
    }
    let why = shed.iter().find(|x| x.job == "report").and_then(|x| x.error.clone()).unwrap_or_default();
    assert!(why.contains(">= max_depth 100"), "{why}");
    assert!(
        chime_shared::shed::read(&mut connect_redis(&env.redis_url).await, &env.names(), &["default".into()])
            .await
            .unwrap()[0]
            .is_none(),
        "the queue no longer sheds once its backlog is gone"
    );
}

/// `max_age` trusts a run's `enqueued_at`, which is the producer's clock. A producer whose clock
/// is ten minutes behind makes its runs look ten minutes old: once a reading has found the
/// queue empty they count as waiting at most since then, and nothing is shed (the wait the
/// worker reports, `chime_queue_wait_seconds`, stays under a minute). A worker started with
/// such a run already waiting has never seen the queue empty: it takes the age as said, and
/// the queue sheds by age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_whose_clock_is_behind_cannot_make_an_empty_queue_shed() {
    let env = TestEnv::new("shed-clock");
    let port = free_port();
    let jobs = "[worker.shed.default]\nmax_age = \"1m\"\n\
                [[jobs]]\nname = \"report\"\nhandler = \"noop\"\ncriticality = \"sheddable\"\n";
    let text = env.config_text("classic", "", &format!("listen = \"127.0.0.1:{port}\""), jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    // Published as a producer ten minutes behind would.
    let behind = |key: &str| {
        let mut p = client.prepare(&chime_producer::EnqueueRequest::new("report").key(key)).unwrap();
        p.envelope.enqueued_at -= chrono::Duration::minutes(10);
        p
    };
    let metrics = || async move {
        let url = format!("http://127.0.0.1:{port}/metrics");
        match reqwest::get(url).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    };
    let shed_flag = || async {
        let mut c = connect_redis(&env.redis_url).await;
        chime_shared::shed::read(&mut c, &env.names(), &["default".into()]).await.unwrap().remove(0)
    };
    let worker = Child::worker(&env.dir, &path, &[], "w");
    // A reading has found the queue empty (the gauge is set at each reading).
    wait_until("the worker read the queue", Duration::from_secs(30), || async {
        metrics().await.contains("chime_queue_shedding{queue=\"default\"} 0")
    })
    .await;
    let early = behind("early");
    let key = early.envelope.key.to_string();
    assert_eq!(client.send_batch(&[early]).await.confirmed, 1);
    wait_all_done(&config, &env, std::slice::from_ref(&key), Duration::from_secs(30)).await;
    // The reading after it was taken reports the wait it counted.
    let wait_line = |m: &str| {
        m.lines()
            .find(|l| l.starts_with("chime_queue_wait_seconds{queue=\"default\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    wait_until("the wait reported", Duration::from_secs(30), || async {
        wait_line(&metrics().await).is_some()
    })
    .await;
    let waited = wait_line(&metrics().await).unwrap();
    assert!(waited < 60.0, "a run from an empty queue counted as waiting {waited} s");
    assert_eq!(shed_flag().await, None, "the empty queue does not shed");
    let (ran, shed) = ran_and_shed(&env).await;
    assert_eq!((ran.get(&key), shed.get(&key)), (Some(&1), None));
    assert!(metrics().await.contains("chime_queue_shedding{queue=\"default\"} 0"));
    drop(worker);
    // A worker that finds such a run waiting when it starts has never seen the queue empty.
    let late = behind("late");
    let late_key = late.envelope.key.to_string();
    assert_eq!(client.send_batch(&[late]).await.confirmed, 1);
    // Without `listen`: the first worker's port may not be free yet.
    let quiet = env.dir.join("quiet.toml");
    std::fs::write(&quiet, env.config_text("classic", "", "", jobs)).unwrap();
    let second = Child::worker(&env.dir, &quiet, &[], "w2");
    wait_all_done(&config, &env, std::slice::from_ref(&late_key), Duration::from_secs(30)).await;
    wait_until("the queue sheds by age", Duration::from_secs(30), || async {
        shed_flag().await.is_some_and(|why| why.contains(">= max_age 1m"))
    })
    .await;
    drop(second);
}

/// While a queue's shedding flag is set, the ticker records the slots of its sheddable jobs
/// as `shed` (the watermark moves on: they are not published later) and publishes the others;
/// once it is gone, it publishes them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ticker_sheds_the_slots_of_sheddable_jobs_while_their_queue_sheds() {
    let env = TestEnv::new("shed-tick");
    let jobs = "[worker.shed.default]\nmax_age = \"1m\"\n\
                [[jobs]]\nname = \"digest\"\nhandler = \"noop\"\ncriticality = \"sheddable\"\nschedule = \"* * * * * *\"\n\
                [[jobs]]\nname = \"beat\"\nhandler = \"noop\"\nschedule = \"* * * * * *\"\n";
    let text = env.config_text("classic", "", "", jobs);
    let path = env.write_config(&text);
    let mut conn = connect_redis(&env.redis_url).await;
    let names = env.names();
    chime_shared::shed::set(&mut conn, &names, "default", "age 2m >= max_age 1m").await.unwrap();
    let ticker = Child::ticker(&env.dir, &path, &[], "t");
    let e = &env;
    let shed_slots = || async move {
        history_runs(e).await.1.iter().filter(|r| r.job == "digest" && r.outcome == Outcome::Shed).count()
    };
    // Kept set (it expires 5 s after the last refresh) until three slots were shed.
    wait_until("three digest slots shed", Duration::from_secs(30), || async {
        let mut c = connect_redis(&e.redis_url).await;
        chime_shared::shed::set(&mut c, &names, "default", "age 2m >= max_age 1m").await.unwrap();
        shed_slots().await >= 3
    })
    .await;
    let (_, runs) = history_runs(&env).await;
    let shed = runs.iter().find(|r| r.job == "digest" && r.outcome == Outcome::Shed).unwrap();
    assert!(shed.error.as_deref().unwrap_or_default().ends_with("age 2m >= max_age 1m"), "{shed:?}");
    // Meanwhile the job that is not sheddable was published: its slots wait in the queue.
    let ready = depth(&env.names().work_queue("default")).await;
    assert!(ready >= 2, "{ready} messages: beat's slots are published");
    chime_shared::shed::clear(&mut conn, &names, "default").await.unwrap();
    let (before, shed_before) = (ready, shed_slots().await);
    wait_until("six more slots published", Duration::from_secs(30), || async move {
        depth(&e.names().work_queue("default")).await >= before + 6
    })
    .await;
    drop(ticker);
    let shed_after = shed_slots().await;
    assert!(
        shed_after <= shed_before + 1,
        "digest's slots are published again ({shed_before} shed, then {shed_after})"
    );
}

/// A worker SIGKILLed while runs are parked and held in place (a rate limit of 10/s over 60
/// jobs), once parked copies have started coming back (in packs: the default): nothing is
/// lost and nothing runs twice. A delivery whose parked copy was confirmed but not yet acked
/// comes back as well as its copy, and a pack of parked copies held by the killed worker
/// comes back whole; the keys absorb the second copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_with_runs_parked_loses_nothing_and_runs_nothing_twice() {
    let env = TestEnv::new("rate-kill");
    let jobs = "[[jobs]]\nname = \"paced\"\nhandler = \"noop\"\nrate_limit = \"10/s\"\n";
    let text = env.config_text("classic", "", "max_hold = \"1s\"", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let keys = enqueue_keys(&config, "paced", 60, |_| serde_json::json!({})).await;
    let a = Child::worker(&env.dir, &path, &[], "a");
    let b = Child::worker(&env.dir, &path, &[], "b");
    let e = &env;
    wait_until("runs parked, and a parked run back and done", Duration::from_secs(30), || async move {
        let (_, runs) = history_runs(e).await;
        let parked: std::collections::BTreeSet<&str> =
            runs.iter().filter(|r| r.outcome == Outcome::Parked).map(|r| r.key.as_str()).collect();
        parked.len() >= 20
            && runs.iter().any(|r| r.outcome == Outcome::Succeeded && parked.contains(r.key.as_str()))
    })
    .await;
    a.signal(libc::SIGKILL);
    assert!(pack_sizes(&a).len() + pack_sizes(&b).len() > 0, "the parked copies travelled in packs");
    let c = Child::worker(&env.dir, &path, &[], "c");
    wait_all_done(&config, &env, &keys, Duration::from_secs(60)).await;
    let (_, runs) = history_runs(&env).await;
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for r in runs.iter().filter(|r| r.outcome == Outcome::Succeeded) {
        *per_key.entry(r.key.as_str()).or_default() += 1;
    }
    assert!(per_key.len() == 60 && per_key.values().all(|n| *n == 1), "each ran once: {per_key:?}");
    drop((a, b, c));
}

/// The rate script against real Redis: a run's first ask gives it a ticket (its place in
/// line); copies that come back together, however late, are let through one interval apart
/// (a start within the wait each may do in place is its own; the rest are told to come back),
/// never all at once; a fresh run gets a ticket behind theirs and no start before theirs.
#[tokio::test]
async fn copies_back_late_together_start_an_interval_apart() {
    let env = TestEnv::new("rate-script");
    let config = env.config("classic", "", "", "");
    let store = chime_shared::idempotency::IdemStore::connect(&config.redis, env.names()).unwrap();
    let key = env.names().rate("b", "-");
    let (interval, burst) = (10_000u64, 1u32); // 100/s
    let mut tickets = Vec::new();
    for _ in 0..50 {
        let take = store.take_rate(key.clone(), interval, burst, None, Duration::ZERO, None).await.unwrap();
        tickets.push(take.ticket_us);
    }
    assert!(tickets.windows(2).all(|w| w[1] >= w[0] + interval), "tickets in line: {tickets:?}");
    let last_ticket = *tickets.last().unwrap();
    let conn = connect_redis(&env.redis_url).await;
    wait_until("every ticket is past (Redis time)", Duration::from_secs(5), || {
        let mut conn = conn.clone();
        async move {
            let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
            s * 1_000_000 + us > last_ticket
        }
    })
    .await;
    // Every copy comes back at once, after its ticket (a clump from a late delay chain),
    // each allowed 200 ms in place: 20 starts of the next 200 ms go to them, spaced.
    // A start (Redis time) lies within [sent + wait, received + wait] of the client's clock.
    let mut starts = Vec::new();
    let mut told_back = 0;
    let asking = std::time::Instant::now();
    for t in &tickets {
        let sent = std::time::Instant::now();
        let take = store
            .take_rate(key.clone(), interval, burst, Some(*t), Duration::from_millis(200), None)
            .await
            .unwrap();
        let received = std::time::Instant::now();
        assert_eq!(take.ticket_us, *t, "a copy keeps its ticket");
        if take.admitted {
            starts.push((sent + take.wait, received + take.wait));
        } else {
            told_back += 1;
            assert!(take.wait > Duration::from_millis(200), "told to come back later: {take:?}");
        }
    }
    // The 200 ms move on while the 50 ask, one after another: a loaded machine that takes
    // longer to ask sees more starts within each copy's wait (one per interval it took).
    let slid = (asking.elapsed().as_micros() / u128::from(interval)) as usize;
    assert!(
        (19..=22 + slid).contains(&starts.len()),
        "{} of 50 admitted within 200 ms at 100/s (asking took {:?})",
        starts.len(),
        asking.elapsed()
    );
    assert_eq!(told_back, 50 - starts.len());
    for w in starts.windows(2) {
        let gap = w[1].1.saturating_duration_since(w[0].0);
        assert!(gap >= Duration::from_micros(interval), "starts one interval apart: {gap:?} in {starts:?}");
    }
    // A new run is in line behind all 50: its ticket is after theirs, and its start (when
    // its turn comes within its wait: asking slowly lets the line move that far) is after
    // every start given to them.
    let fresh =
        store.take_rate(key.clone(), interval, burst, None, Duration::from_millis(200), None).await.unwrap();
    assert!(fresh.ticket_us > *tickets.last().unwrap(), "{fresh:?}");
    if fresh.admitted
        && let Some(last) = starts.last()
    {
        let gap = (std::time::Instant::now() + fresh.wait).saturating_duration_since(last.0);
        assert!(gap >= Duration::from_micros(interval), "the fresh run started ahead of the line: {fresh:?}");
    }
    // A push-back holds every start, however old the ticket.
    store.slow_rate(key.clone(), Duration::from_secs(3), interval, burst).await.unwrap();
    let held = store
        .take_rate(key.clone(), interval, burst, Some(tickets[0]), Duration::from_secs(2), None)
        .await
        .unwrap();
    assert!(!held.admitted && held.wait > Duration::from_secs(2), "{held:?}");
}

/// Asks of one bucket made at once share one script call (a returning pack's members, a
/// flood's copies): each still gets its own place in line and its own start, exactly as if
/// they had asked one after another. 50 fresh runs ask together, each allowed 200 ms in
/// place, beside asks of another bucket in the same pipelines: tickets one interval apart,
/// about 20 starts, one interval apart, the rest told to come back; the other bucket is
/// untouched by them; and Redis ran a handful of script calls, not 53 (a private Redis,
/// whose command counts are this test's alone).
#[tokio::test]
async fn asks_of_one_bucket_made_at_once_are_decided_as_if_one_after_another() {
    let redis = PrivateRedis::start().await;
    let mut env = TestEnv::new("rate-merged");
    env.redis_url = redis.url();
    let config = env.config("classic", "", "", "");
    let store = chime_shared::idempotency::IdemStore::connect(&config.redis, env.names()).unwrap();
    let (key, other) = (env.names().rate("b", "flood"), env.names().rate("b", "quiet"));
    let (interval, burst) = (10_000u64, 1u32); // 100/s
    let horizon = Duration::from_millis(200);
    let ask = |key: &String| {
        let (store, key) = (store.clone(), key.clone());
        async move {
            let sent = std::time::Instant::now();
            let take = store.take_rate(key, interval, burst, None, horizon, None).await.unwrap();
            (sent, std::time::Instant::now(), take)
        }
    };
    let asks: Vec<_> = (0..50).map(|_| ask(&key)).collect();
    let quiet: Vec<_> = (0..3).map(|_| ask(&other)).collect();
    let (mut flood, quiet) = futures_util::future::join(
        futures_util::future::join_all(asks),
        futures_util::future::join_all(quiet),
    )
    .await;
    flood.sort_by_key(|(_, _, take)| take.ticket_us);
    let tickets: Vec<u64> = flood.iter().map(|(_, _, t)| t.ticket_us).collect();
    assert!(tickets.windows(2).all(|w| w[1] >= w[0] + interval), "tickets in line: {tickets:?}");
    let starts: Vec<_> = flood
        .iter()
        .filter(|(_, _, t)| t.admitted)
        .map(|(sent, got, t)| (*sent + t.wait, *got + t.wait))
        .collect();
    assert!((19..=23).contains(&starts.len()), "{} of 50 admitted within 200 ms at 100/s", starts.len());
    for w in starts.windows(2) {
        let gap = w[1].1.saturating_duration_since(w[0].0);
        assert!(gap >= Duration::from_micros(interval), "starts one interval apart: {gap:?} in {starts:?}");
    }
    for (_, _, t) in flood.iter().filter(|(_, _, t)| !t.admitted) {
        assert!(t.wait > horizon, "told to come back later: {t:?}");
    }
    // The other bucket's three asks: its own line, from its first start (burst 1: at once).
    let mut quiet: Vec<_> = quiet.into_iter().map(|(_, _, t)| t).collect();
    quiet.sort_by_key(|t| t.ticket_us);
    assert!(quiet.iter().all(|t| t.admitted), "{quiet:?}");
    assert!(quiet[0].wait < Duration::from_millis(5), "the other bucket's first starts at once: {quiet:?}");
    // One call per bucket and pipeline (the first may be refused NOSCRIPT and sent again).
    let mut conn = connect_redis(&env.redis_url).await;
    let stats: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
    let calls = |cmd: &str| {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
            .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert!(calls("evalsha") <= 8, "53 asks took {} script calls:\n{stats}", calls("evalsha"));
}

/// A run the rate limit lets start at once has its key claimed in the same script call (one
/// round trip instead of two); a run that must wait first is not claimed (it claims after its
/// wait); a claim the key's record refuses answers as the claim alone would (busy, a record
/// that is not chime's), and only for that run: the asks decided with it in one call are
/// claimed as usual.
#[tokio::test]
async fn a_run_let_through_at_once_is_claimed_with_its_rate_decision() {
    use chime_shared::idempotency::Claim;
    use chime_shared::limit::ClaimWith;
    let env = TestEnv::new("rate-claim");
    let config = env.config("classic", "", "", "");
    let store = chime_shared::idempotency::IdemStore::connect(&config.redis, env.names()).unwrap();
    let (interval, burst) = (10_000u64, 1u32); // 100/s
    let with = |key: &str, owner: &str| {
        Some(ClaimWith { key: key.into(), owner: owner.into(), version: 1, attempt: 1 })
    };
    let bucket = env.names().rate("b", "-");
    let at_once =
        store.take_rate(bucket.clone(), interval, burst, None, Duration::ZERO, with("k1", "o1")).await;
    let at_once = at_once.unwrap();
    assert!(at_once.admitted && at_once.wait.is_zero(), "{at_once:?}");
    assert!(matches!(at_once.claim, Some(Ok(Claim::Claimed { .. }))), "{at_once:?}");
    let mut conn = connect_redis(&env.redis_url).await;
    let record: (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(env.names().idem_key("k1"))
        .arg("s")
        .arg("o")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(record, (Some("run".into()), Some("o1".into())), "the key is held by the run's owner");
    // The next start is an interval off: admitted with a wait, not claimed.
    let later = store
        .take_rate(bucket.clone(), interval, burst, None, Duration::from_millis(500), with("k2", "o2"))
        .await
        .unwrap();
    assert!(later.admitted && !later.wait.is_zero() && later.claim.is_none(), "{later:?}");
    let k2: Option<String> =
        redis::cmd("HGET").arg(env.names().idem_key("k2")).arg("s").query_async(&mut conn).await.unwrap();
    assert_eq!(k2, None, "a run that waits first is not claimed yet");
    // Three asks of one roomy bucket at once: a key held by another run, a key whose record
    // is a string, a fresh key.
    let roomy = env.names().rate("b", "roomy");
    let _: () =
        redis::cmd("SET").arg(env.names().idem_key("bad")).arg("x").query_async(&mut conn).await.unwrap();
    let ask = |key: &'static str, owner: &'static str| {
        let (store, roomy) = (store.clone(), roomy.clone());
        async move { store.take_rate(roomy, interval, 10, None, Duration::ZERO, with(key, owner)).await.unwrap() }
    };
    let (busy, bad, fresh) = tokio::join!(ask("k1", "o3"), ask("bad", "o4"), ask("k3", "o5"));
    assert!(matches!(busy.claim, Some(Ok(Claim::Busy { .. }))), "{busy:?}");
    assert!(matches!(&bad.claim, Some(Err(e)) if e.is_bad_record()), "{bad:?}");
    assert!(matches!(fresh.claim, Some(Ok(Claim::Claimed { .. }))), "{fresh:?}");
}

/// The broker (a private node) SIGKILLed and restarted while a queue sheds: every critical
/// run is done, every sheddable key ran or was shed (none both, none lost), and sheddable
/// runs enqueued after the backlog is gone all run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_while_shedding_loses_nothing() {
    let rabbit = PrivateRabbit::start().await;
    let mut env = TestEnv::new("shed-restart");
    env.amqp_url = rabbit.url();
    let jobs = "[worker.shed.default]\nmax_depth = 100\n\
                [[jobs]]\nname = \"report\"\nhandler = \"slow\"\ncriticality = \"sheddable\"\n\
                [[jobs]]\nname = \"pay\"\nhandler = \"slow\"\ncriticality = \"critical\"\n";
    let config = env.config("quorum", "", "", jobs);
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let (report, pay) = pay_and_report(&client, 400, 4).await;
    drop(client);
    let worker = Running::start(config.clone(), sleeper(40), 2).await;
    let e = &env;
    wait_until("the queue sheds", Duration::from_secs(30), || async {
        let (_, runs) = history_runs(e).await;
        runs.iter().any(|x| x.outcome == Outcome::Shed)
    })
    .await;
    rabbit.kill().await;
    let reader = chime_shared::history::HistoryReader::connect(&config.redis, env.names()).await.unwrap();
    let pay_done = |states: Vec<Option<(KeyState, _)>>| {
        states.iter().filter(|s| matches!(s, Some((KeyState::Done, _)))).count()
    };
    let before = pay_done(reader.states(&pay).await.unwrap());
    assert!(before < 80, "the broker went down with critical runs still waiting ({before} of 100 done)");
    let h = worker.health.clone();
    wait_until("the worker notices the broker is gone", Duration::from_secs(30), || {
        let h = h.clone();
        async move { !h.get("amqp") }
    })
    .await;
    rabbit.restart().await;
    wait_all_done(&config, &env, &pay, Duration::from_secs(120)).await;
    wait_until("every report run or shed", Duration::from_secs(120), || async {
        let (ran, shed) = ran_and_shed(e).await;
        report.iter().all(|k| ran.contains_key(k) || shed.contains_key(k))
    })
    .await;
    let (ran, shed) = ran_and_shed(e).await;
    assert!(pay.iter().all(|k| !shed.contains_key(k)), "a critical run was shed");
    for k in &report {
        let (r, s) = (ran.get(k).copied().unwrap_or(0), shed.get(k).copied().unwrap_or(0));
        assert_eq!(r + s, 1, "{k}: ran {r} times, shed {s} times (once in all, never both)");
    }
    println!(
        "shedding across a broker restart: {before} of 100 critical runs done at the kill; {} of 300 sheddable runs shed, the rest ran",
        report.iter().filter(|k| shed.contains_key(*k)).count()
    );
    wait_until("the shedding flag gone", Duration::from_secs(30), || async {
        let mut c = connect_redis(&e.redis_url).await;
        chime_shared::shed::read(&mut c, &e.names(), &["default".into()]).await.unwrap()[0].is_none()
    })
    .await;
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let reqs: Vec<_> =
        (0..20).map(|i| chime_producer::EnqueueRequest::new("report").key(format!("later-{i}"))).collect();
    let later: Vec<String> =
        reqs.iter().map(|r| client.prepare(r).unwrap().envelope.key.to_string()).collect();
    assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, 20);
    wait_all_done(&config, &env, &later, Duration::from_secs(60)).await;
    worker.stop().await;
    let (ran, _) = ran_and_shed(e).await;
    assert!(later.iter().all(|k| ran.get(k) == Some(&1)), "sheddable runs enqueued later run");
}

/// How many times the history says each key ran (`succeeded`), and was shed.
async fn ran_and_shed(
    env: &TestEnv,
) -> (std::collections::BTreeMap<String, usize>, std::collections::BTreeMap<String, usize>) {
    let (mut ran, mut shed) = (std::collections::BTreeMap::new(), std::collections::BTreeMap::new());
    for r in history_runs(env).await.1 {
        match r.outcome {
            Outcome::Succeeded => *ran.entry(r.key).or_insert(0) += 1,
            Outcome::Shed => *shed.entry(r.key).or_insert(0) += 1,
            _ => {}
        }
    }
    (ran, shed)
}

/// Handler `slow`: sleeps `ms`, succeeds.
fn sleeper(ms: u64) -> chime_worker::Registry {
    let mut registry = chime_worker::Registry::new();
    registry.register(
        "slow",
        chime_worker::raw_handler_fn(move |_, _| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(())
        }),
    );
    registry
}

/// Enqueues a backlog of `n` runs, every `every`th of job `pay`, the others of `report`;
/// returns the keys of each (`report`, `pay`).
async fn pay_and_report(
    client: &chime_producer::EnqueueClient,
    n: usize,
    every: usize,
) -> (Vec<String>, Vec<String>) {
    let (mut report, mut pay, mut reqs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let (job, keys) = if i % every == 0 { ("pay", &mut pay) } else { ("report", &mut report) };
        let req = chime_producer::EnqueueRequest::new(job).key(format!("{job}-{i}"));
        keys.push(client.prepare(&req).unwrap().envelope.key.to_string());
        reqs.push(req);
    }
    assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, n);
    (report, pay)
}
