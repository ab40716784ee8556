//! Circuit breakers shared by every worker: opening on failures, parking without using
//! attempts, probing, closing; operators forcing them; Redis restarted empty while one is open.

use chime_shared::history::{Outcome, RunEvent};
use chime_shared::record::KeyState;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::common::*;
use crate::limits::wait_all_done;

/// The state field of circuit `name`'s hash (`None`: no hash).
async fn circuit_field(env: &TestEnv, name: &str, field: &str) -> Option<String> {
    let mut r = connect_redis(&env.redis_url).await;
    redis::cmd("HGET").arg(env.names().circuit(name)).arg(field).query_async(&mut r).await.unwrap()
}

async fn enqueue_keys(config: &chime_shared::config::ValidConfig, job: &str, n: usize) -> Vec<String> {
    crate::limits::enqueue_keys(config, job, n, |_| serde_json::json!({})).await
}

async fn states(
    config: &chime_shared::config::ValidConfig,
    env: &TestEnv,
    keys: &[String],
) -> Vec<Option<KeyState>> {
    let reader = chime_shared::history::HistoryReader::connect(&config.redis, env.names()).await.unwrap();
    reader.states(keys).await.unwrap().into_iter().map(|s| s.map(|(s, _)| s)).collect()
}

fn ms(t: chrono::DateTime<chrono::Utc>) -> i64 {
    t.timestamp_millis()
}

/// Two worker processes run a job whose downstream fails (an `exec` command that fails while a
/// flag file exists) through one shared circuit (3 failures in 30 s open it for 2 s, 1 probe).
/// The circuit opens for both workers; while it is open only probes run (at most one per
/// opening, plus the runs already admitted when it tripped); the other runs are parked
/// without using an attempt. Once the downstream is back a probe closes it and every job is
/// done exactly once, nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_circuit_opens_parks_probes_and_closes_losing_nothing() {
    let env = TestEnv::new("circuit-two");
    let flag = env.dir.join("down");
    std::fs::write(&flag, "").unwrap();
    let cmd = format!("test ! -e '{}'", flag.display());
    let jobs = format!(
        "[[jobs]]\nname = \"call\"\nhandler = \"exec\"\ncommand = [\"sh\", \"-c\", {cmd:?}]\ncircuit = \"dep\"\n\
         concurrency = 1\nmax_attempts = 20\nbackoff = {{ initial = \"1s\", factor = 1.0, max = \"1s\" }}\n\
         [[circuits]]\nname = \"dep\"\nfailures = 3\nwindow = \"30s\"\nopen_for = \"2s\"\n"
    );
    let text = env.config_text("classic", "", "", &jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let keys = enqueue_keys(&config, "call", 30).await;
    let (a, b) = (Child::worker(&env.dir, &path, &[], "a"), Child::worker(&env.dir, &path, &[], "b"));
    let e = &env;
    wait_until("the circuit opened", Duration::from_secs(30), || async move {
        circuit_field(e, "dep", "state").await.is_some()
    })
    .await;
    // Let two probes fail (the circuit opened three times), then bring the downstream back.
    let (wa, wb) = (&a, &b);
    wait_until("two probes ran", Duration::from_secs(30), || async move {
        (wa.log_text() + &wb.log_text()).matches("goes as a probe").count() >= 2
    })
    .await;
    std::fs::remove_file(&flag).unwrap();
    let recovered = chrono::Utc::now();
    wait_all_done(&config, &env, &keys, Duration::from_secs(60)).await;
    let (_, runs) = history_runs(&env).await;
    let succeeded: Vec<&RunEvent> = runs.iter().filter(|r| r.outcome == Outcome::Succeeded).collect();
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &succeeded {
        *per_key.entry(r.key.as_str()).or_default() += 1;
    }
    assert!(per_key.len() == 30 && per_key.values().all(|n| *n == 1), "each ran once: {per_key:?}");
    // Attempts only grow by failures: parking used none.
    let mut failures: HashMap<&str, u32> = HashMap::new();
    for r in runs.iter().filter(|r| r.outcome == Outcome::Retried) {
        *failures.entry(r.key.as_str()).or_default() += 1;
    }
    for r in &succeeded {
        let failed = failures.get(r.key.as_str()).copied().unwrap_or(0);
        assert_eq!(
            r.attempt,
            failed + 1,
            "key {} succeeded as attempt {} after {failed} failure(s)",
            r.key,
            r.attempt
        );
    }
    let parked: Vec<&RunEvent> = runs.iter().filter(|r| r.outcome == Outcome::Parked).collect();
    assert!(
        !parked.is_empty() && parked.iter().all(|r| r.reason.as_deref() == Some("circuit_open")),
        "{parked:?}"
    );
    // While open: the first park marks the opening; failed runs that started after it are
    // probes (one per opening of 2 s) or the runs admitted before it tripped (one per worker
    // at `concurrency = 1`).
    let first_open = parked.iter().map(|r| r.finished_at).min().unwrap();
    let open_ms = ms(recovered) - ms(first_open);
    let during: Vec<&RunEvent> = runs
        .iter()
        .filter(|r| r.outcome == Outcome::Retried)
        .filter(|r| r.started_at.is_some_and(|s| s > first_open && s < recovered))
        .collect();
    let openings = open_ms / 2000 + 1;
    println!(
        "circuit: open {open_ms} ms, {} failed attempts started while open ({openings} openings of 2 s), {} parks, {} failures in all",
        during.len(),
        parked.len(),
        failures.values().sum::<u32>()
    );
    assert!(
        during.len() as i64 <= openings + 2,
        "{} failed attempts while the circuit was open {open_ms} ms (at most one probe per 2 s opening)",
        during.len()
    );
    let logs = a.log_text() + &b.log_text();
    assert!(logs.contains("circuit opened") && logs.contains("circuit closed"), "{logs}");
    assert_eq!(depth(&env.names().dlq("default")).await, 0, "nothing dead-lettered");
    drop((a, b));
}

/// Operators force circuits: `chime circuit open` parks the runs of its jobs (for every
/// worker) until `chime circuit close`; `chime circuits --json` shows who holds it; an
/// unknown name is refused by name. `on_open = "dead_letter"` sends the runs that find their
/// circuit open to the DLQ as `circuit_open`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_force_circuits_open_and_closed() {
    let env = TestEnv::new("circuit-force");
    let jobs = "[[jobs]]\nname = \"sms\"\nhandler = \"noop\"\ncircuit = \"ops\"\n\
                [[jobs]]\nname = \"mail\"\nhandler = \"noop\"\ncircuit = { failures = 5, on_open = \"dead_letter\" }\n\
                [[circuits]]\nname = \"ops\"\nfailure_ratio = 0.5\nopen_for = \"1s\"\n";
    let text = env.config_text("classic", "", "", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let (code, _, err) = chime(&path, &["circuit", "open", "nope"], None);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("\"nope\" is not a circuit breaker of this config (known: mail, ops)"), "{err}");
    for name in ["ops", "mail"] {
        let (code, out, err) = chime(&path, &["circuit", "open", name], None);
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains(&format!("circuit {name} held open (was closed)")), "{out}");
    }
    let (code, out, _) = chime(&path, &["circuits", "--json"], None);
    assert_eq!(code, 0);
    let shown: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(shown.len(), 2, "{out}");
    assert!(shown.iter().all(|c| c["state"] == "open" && c["forced"] == true), "{out}");
    assert_eq!(shown[1]["jobs"], serde_json::json!(["sms"]));
    let sms = enqueue_keys(&config, "sms", 5).await;
    let mail = enqueue_keys(&config, "mail", 2).await;
    let worker = Child::worker(&env.dir, &path, &[], "w");
    wait_depth(&env.names().dlq("default"), 2, Duration::from_secs(30)).await;
    let e = &env;
    wait_until("every sms parked at least once", Duration::from_secs(30), || async move {
        let (_, runs) = history_runs(e).await;
        let parked: std::collections::BTreeSet<String> =
            runs.iter().filter(|r| r.outcome == Outcome::Parked).map(|r| r.key.clone()).collect();
        parked.len() >= 5
    })
    .await;
    assert!(
        states(&config, &env, &sms).await.iter().all(|s| *s != Some(KeyState::Done)),
        "held open: none ran"
    );
    let (_, out, _) = chime(&path, &["circuits"], None);
    assert!(out.contains("open (held by an operator)"), "{out}");
    let (code, out, err) = chime(&path, &["circuit", "close", "ops"], None);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("circuit ops closed (was forced_open)"), "{out}");
    wait_all_done(&config, &env, &sms, Duration::from_secs(60)).await;
    let (code, out, _) = chime(&path, &["dlq", "list", "--queue", "default", "--json"], None);
    assert_eq!(code, 0);
    assert_eq!(out.matches("circuit_open").count(), 2, "{out}");
    // The mail keys were not run, so a replay (once the circuit is closed) runs them.
    assert!(states(&config, &env, &mail).await.iter().all(|s| *s != Some(KeyState::Done)));
    drop(worker);
}

/// Redis restarted empty while a circuit is open and runs are parked: the circuit starts
/// closed again (its state was in Redis), the parked runs come back and run, and a downstream
/// still failing opens it again. Nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_empty_while_a_circuit_is_open_loses_nothing() {
    let mut redis = PrivateRedis::start().await;
    let mut env = TestEnv::new("circuit-redis");
    env.redis_url = redis.url();
    let flag = env.dir.join("down");
    std::fs::write(&flag, "").unwrap();
    let cmd = format!("test ! -e '{}'", flag.display());
    let jobs = format!(
        "[[jobs]]\nname = \"call\"\nhandler = \"exec\"\ncommand = [\"sh\", \"-c\", {cmd:?}]\n\
         circuit = {{ failures = 2, open_for = \"30s\" }}\nmax_attempts = 50\n\
         backoff = {{ initial = \"1s\", factor = 1.0, max = \"1s\" }}\n"
    );
    let text = env.config_text("classic", "", "", &jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let keys = enqueue_keys(&config, "call", 10).await;
    let worker = Child::worker(&env.dir, &path, &[], "w");
    let e = &env;
    wait_until("the circuit opened and runs are parked", Duration::from_secs(30), || async move {
        let (_, runs) = history_runs(e).await;
        circuit_field(e, "call", "state").await.as_deref() == Some("open")
            && runs.iter().any(|r| r.outcome == Outcome::Parked)
    })
    .await;
    // Everything in Redis is gone: keys, history, the circuit.
    redis.restart().await;
    std::fs::remove_file(&flag).unwrap();
    wait_all_done(&config, &env, &keys, Duration::from_secs(90)).await;
    assert_eq!(depth(&env.names().dlq("default")).await, 0, "nothing dead-lettered");
    assert_eq!(circuit_field(&env, "call", "state").await.as_deref().unwrap_or("closed"), "closed");
    drop(worker);
}

/// The DLQ monitor alerts while a circuit is not closed: one `firing` (alert
/// `ChimeCircuitOpen`, label `circuit`) when it opens, one `resolved` when it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_circuit_that_is_not_closed_fires_an_alert_then_resolves_it() {
    let env = TestEnv::new("circuit-alert");
    let (addr, bodies) = crate::dlq_ops::webhook().await;
    let jobs = "[[jobs]]\nname = \"sms\"\nhandler = \"noop\"\ncircuit = \"ops\"\n\
                [[circuits]]\nname = \"ops\"\nfailures = 5\n";
    let mut config = env.config("classic", "", "", jobs).into_config();
    config.alerts.webhook = Some(format!("http://{addr}/alerts"));
    config.alerts.interval = Duration::from_millis(100);
    let config = config.validated().unwrap();
    let token = tokio_util::sync::CancellationToken::new();
    let monitor = tokio::spawn(chime_scheduler::monitor::run(
        config.clone(),
        chime_shared::health::Health::default(),
        token.clone(),
    ));
    let mut conn = connect_redis(&env.redis_url).await;
    chime_shared::circuit::force(&mut conn, &env.names(), "ops", true).await.unwrap();
    crate::dlq_ops::wait_notifications(&bodies, 1, "firing").await;
    chime_shared::circuit::force(&mut conn, &env.names(), "ops", false).await.unwrap();
    crate::dlq_ops::wait_notifications(&bodies, 2, "resolved").await;
    token.cancel();
    monitor.await.unwrap();
    let all = bodies.lock().unwrap().clone();
    let statuses: Vec<&str> = all.iter().map(|b| b["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["firing", "resolved"], "exactly one of each");
    let labels = &all[0]["alerts"][0]["labels"];
    assert_eq!(
        (labels["alertname"].as_str(), labels["circuit"].as_str()),
        (Some("ChimeCircuitOpen"), Some("ops"))
    );
    let description = all[0]["alerts"][0]["annotations"]["description"].as_str().unwrap_or_default();
    assert!(
        description.contains("open (held by an operator)") && description.contains("jobs sms"),
        "{description}"
    );
}
