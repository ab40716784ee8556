//! The producers' local spool (`[producer] spool_dir`) against real services: jobs the broker
//! cannot take are kept on disk and published later, in order, under their own keys.

use crate::common::*;
use chime_producer::{Delivery, EnqueueClient, EnqueueRequest};
use chime_worker::{JobContext, Registry, raw_handler_fn};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Handler `rec`: records the payload's `n`, succeeds.
fn recorder(order: &Arc<Mutex<Vec<u64>>>) -> Registry {
    let o = order.clone();
    let mut r = Registry::new();
    r.register(
        "rec",
        raw_handler_fn(move |_ctx: JobContext, p: serde_json::Value| {
            o.lock().unwrap().push(p["n"].as_u64().unwrap_or(u64::MAX));
            async { Ok(()) }
        }),
    );
    r
}

fn spool_section(env: &TestEnv, extra: &str) -> String {
    format!(
        "[producer]\nspool_dir = \"{}\"\n{extra}\n[[jobs]]\nname = \"rec\"\nhandler = \"rec\"\n",
        env.dir.join("spool").display()
    )
}

/// The broker (a private node) SIGKILLed under a producer with a spool: every enqueue while it
/// is down returns `Spooled` (none fails, none is lost); once it is back, the client's flusher
/// publishes them in the order they were enqueued, and a worker runs each once. Jobs enqueued
/// while spooled ones wait go behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_enqueued_while_the_broker_is_down_are_spooled_then_published_in_order_and_run_once() {
    let rabbit = PrivateRabbit::start().await;
    let mut env = TestEnv::new("spool-down");
    env.amqp_url = rabbit.url();
    let config = env.config("quorum", "", "", &spool_section(&env, "spool_alert_after = \"1m\""));
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    let job =
        |n: u64| EnqueueRequest::new("rec").payload(serde_json::json!({"n": n})).key(format!("job-{n}"));
    for n in 0..10 {
        assert_eq!(client.enqueue(job(n)).await.unwrap().delivery, Delivery::Confirmed);
    }
    rabbit.kill().await;
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    for n in 10..60 {
        let t = Instant::now();
        let done =
            client.enqueue(job(n)).await.unwrap_or_else(|e| panic!("job {n} while the broker is down: {e}"));
        assert_eq!(done.delivery, Delivery::Spooled, "job {n}");
        slowest = slowest.max(t.elapsed());
    }
    println!(
        "50 enqueues with the broker down: {:?} in all, the slowest {slowest:?} (the first waits for the reconnects)",
        started.elapsed()
    );
    let spool = client.spool().unwrap();
    let status = spool.status().unwrap();
    assert_eq!(status.records, 50, "{status:?}");
    let listed: Vec<String> = spool.list().unwrap().iter().map(|r| r.envelope.key.to_string()).collect();
    let want: Vec<String> =
        (10..60).map(|n| client.prepare(&job(n)).unwrap().envelope.key.to_string()).collect();
    assert_eq!(listed, want, "spooled in the order enqueued, under their own keys");
    rabbit.restart().await;
    // Behind the spooled ones until the flusher has published them all.
    let mut behind = Vec::new();
    for n in 60..70 {
        behind.push(client.enqueue(job(n)).await.unwrap().delivery);
    }
    wait_until("the spool flushed", Duration::from_secs(60), || async {
        spool.status().map(|s| s.records == 0 && s.files == 0).unwrap_or(false) && !client.spool_backlog()
    })
    .await;
    let direct = client.enqueue(job(70)).await.unwrap().delivery;
    assert_eq!(direct, Delivery::Confirmed, "published directly once the spool is empty");
    println!("enqueued just after the broker came back: {behind:?}");
    let order = Arc::new(Mutex::new(Vec::new()));
    let worker = Running::start(config.clone(), recorder(&order), 1).await;
    let keys: Vec<String> =
        (0..71).map(|n| client.prepare(&job(n)).unwrap().envelope.key.to_string()).collect();
    crate::limits::wait_all_done(&config, &env, &keys, Duration::from_secs(60)).await;
    worker.stop().await;
    let ran = order.lock().unwrap().clone();
    let mut sorted = ran.clone();
    sorted.sort();
    assert_eq!(sorted, (0..71).collect::<Vec<_>>(), "each job ran once");
    // One consumer running one at a time takes them in the order the queue holds them.
    let spooled: Vec<u64> = ran.iter().copied().filter(|n| (10..60).contains(n)).collect();
    assert_eq!(spooled, (10..60).collect::<Vec<_>>(), "spooled jobs published in order");
}

/// `chime enqueue` with the broker unreachable: the job goes to the spool (exit 1, or 0 with
/// `--allow-spool`), `chime spool status` and `list` show it, a torn line a producer killed
/// mid-write left is set aside, a full spool refuses a job by name, and `chime spool flush`
/// with the broker back publishes what was spooled, which a worker then runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_spools_when_the_broker_is_away_and_flushes_when_it_is_back() {
    let env = TestEnv::new("spool-cli");
    // The same prefix and spool, first with a broker URL nothing answers on.
    let text = env.config_text("quorum", "", "", &spool_section(&env, "spool_max_bytes = 65536"));
    let down = env.dir.join("down.toml");
    std::fs::write(&down, text.replace(&env.amqp_url, "amqp://guest:guest@127.0.0.1:1/%2f")).unwrap();
    let up = env.write_config(&text);
    let (code, out, err) = chime(&down, &["enqueue", "rec", "--payload", r#"{"n": 1}"#, "--key", "a"], None);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("spooled"), "{out}");
    assert!(err.contains("--allow-spool") && err.contains("chime spool"), "{err}");
    let (code, out, err) = chime(
        &down,
        &["enqueue", "rec", "--payload", r#"{"n": 2}"#, "--key", "b", "--allow-spool", "--json"],
        None,
    );
    assert_eq!(code, 0, "{out}{err}");
    let answer: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (answer["spooled"].as_bool(), answer["confirmed"].as_bool()),
        (Some(true), Some(false)),
        "{out}"
    );
    // Full: a job that does not fit is refused, by name, and the spool keeps what it had.
    let big = format!(r#"{{"n": 3, "pad": "{}"}}"#, "x".repeat(64_800));
    let (code, _, err) = chime(&down, &["enqueue", "rec", "--payload", &big, "--key", "c"], None);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is full") && err.contains("producer.spool_max_bytes"), "{err}");
    let (code, out, err) = chime(&down, &["spool", "status", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(status["records"], 2, "{out}");
    let (_, listed, _) = chime(&down, &["spool", "list"], None);
    assert_eq!(listed.lines().count(), 2, "{listed}");
    // The monitor (here in the test; the leader ticker or `chime watch`) alerts while a spool
    // has held a job longer than producer.spool_alert_after, and resolves once it is flushed.
    let (addr, bodies) = crate::dlq_ops::webhook().await;
    let mut watched = chime_shared::Config::load(Some(&up)).unwrap().into_config();
    watched.alerts.webhook = Some(format!("http://{addr}/alerts"));
    watched.alerts.interval = Duration::from_millis(100);
    watched.producer.spool_alert_after = Duration::from_secs(1);
    let token = tokio_util::sync::CancellationToken::new();
    let monitor = tokio::spawn(chime_scheduler::monitor::run(
        watched.validated().unwrap(),
        chime_shared::health::Health::default(),
        token.clone(),
    ));
    crate::dlq_ops::wait_notifications(&bodies, 1, "the spool alert firing").await;
    // A producer killed mid-write: a torn last line.
    let file = std::fs::read_dir(env.dir.join("spool"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(".log"))
        .unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&file)
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"0123456789abcdef {\"envel"))
        .unwrap();
    let (code, out, err) = chime(&up, &["spool", "flush"], None);
    assert_eq!(code, 0, "{out}{err}");
    crate::dlq_ops::wait_notifications(&bodies, 2, "the spool alert resolved").await;
    token.cancel();
    monitor.await.unwrap();
    let all = bodies.lock().unwrap().clone();
    let statuses: Vec<&str> = all.iter().map(|b| b["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["firing", "resolved"], "exactly one of each");
    let alert = &all[0]["alerts"][0];
    assert_eq!(alert["labels"]["alertname"], "ChimeSpoolNotEmpty");
    let spool_dir = std::fs::canonicalize(env.dir.join("spool")).unwrap();
    assert!(
        alert["labels"]["spool"].as_str().unwrap().ends_with(&spool_dir.display().to_string()),
        "{alert}"
    );
    assert!(alert["annotations"]["description"].as_str().unwrap().contains("2 job(s)"), "{alert}");
    assert!(out.contains("published 2 spooled job(s)") && !out.contains("left"), "{out}");
    assert!(out.contains("set aside, not replayed") && out.contains("line 2: no newline"), "{out}");
    let config = chime_shared::Config::load(Some(&up)).unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let worker = Running::start(config.clone(), recorder(&order), 2).await;
    let keys: Vec<String> = ["a", "b"]
        .iter()
        .map(|k| {
            chime_producer::prepare(&config, &EnqueueRequest::new("rec").key(*k))
                .unwrap()
                .envelope
                .key
                .to_string()
        })
        .collect();
    crate::limits::wait_all_done(&config, &env, &keys, Duration::from_secs(30)).await;
    worker.stop().await;
    let mut ran = order.lock().unwrap().clone();
    ran.sort();
    assert_eq!(ran, [1, 2]);
    let (_, out, _) = chime(&up, &["spool", "status"], None);
    assert!(out.contains("0 job(s) in 0 file(s)") && out.contains("set aside"), "{out}");
}
