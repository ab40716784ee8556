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

/// Two configs of the same prefix and spool (`[producer]` with `extra`): the first with a
/// broker URL nothing answers on, the second with the test's broker.
fn down_and_up(env: &TestEnv, extra: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let text = env.config_text("quorum", "", "", &spool_section(env, extra));
    let down = env.dir.join("down.toml");
    std::fs::write(&down, text.replace(&env.amqp_url, "amqp://guest:guest@127.0.0.1:1/%2f")).unwrap();
    (down, env.write_config(&text))
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
    // A packed batch meanwhile: its jobs are spooled one by one, behind the others.
    let packed: Vec<EnqueueRequest> = (100..110).map(job).collect();
    let report = client.enqueue_packed(&packed, 4).await.unwrap();
    assert!(report.error.is_none(), "{:?}", report.error);
    assert_eq!((report.confirmed, report.spooled), (0, 10));
    let spool = client.spool().unwrap();
    let status = spool.status().unwrap();
    assert_eq!(status.records, 60, "{status:?}");
    let listed: Vec<String> = spool.list().unwrap().iter().map(|r| r.envelope.key.to_string()).collect();
    let want: Vec<String> =
        (10..60).chain(100..110).map(|n| client.prepare(&job(n)).unwrap().envelope.key.to_string()).collect();
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
        (0..71).chain(100..110).map(|n| client.prepare(&job(n)).unwrap().envelope.key.to_string()).collect();
    crate::limits::wait_all_done(&config, &env, &keys, Duration::from_secs(60)).await;
    worker.stop().await;
    let ran = order.lock().unwrap().clone();
    let mut sorted = ran.clone();
    sorted.sort();
    assert_eq!(sorted, (0..71).chain(100..110).collect::<Vec<_>>(), "each job ran once");
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
    let (down, up) = down_and_up(&env, "spool_max_bytes = 65536");
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

/// `chime enqueue --batch` with the broker unreachable: the whole batch is spooled (the jobs
/// the command keeps encoded between its passes are decoded back into envelopes for the
/// spool), and a flush publishes each once, with the payload and key of its line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_spooled_whole_when_the_broker_is_away() {
    let env = TestEnv::new("spool-batch");
    let (down, up) = down_and_up(&env, "");
    let file = env.dir.join("batch.jsonl");
    let lines: String =
        (10..13).map(|n| format!("{{\"payload\":{{\"n\":{n}}},\"key\":\"k{n}\"}}\n")).collect();
    std::fs::write(&file, lines).unwrap();
    let args = ["enqueue", "rec", "--batch", file.to_str().unwrap(), "--allow-spool", "--json"];
    let (code, out, err) = chime(&down, &args, None);
    assert_eq!(code, 0, "{out}{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!((report["spooled"].as_u64(), report["confirmed"].as_u64()), (Some(3), Some(0)), "{out}");
    let (code, out, err) = chime(&up, &["spool", "flush"], None);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("published 3 spooled job(s)"), "{out}");
    let config = chime_shared::Config::load(Some(&up)).unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let worker = Running::start(config.clone(), recorder(&order), 2).await;
    let keys: Vec<String> =
        (10..13).map(|n| chime_shared::envelope::adhoc_key("rec", &format!("k{n}")).to_string()).collect();
    crate::limits::wait_all_done(&config, &env, &keys, Duration::from_secs(30)).await;
    worker.stop().await;
    let mut ran = order.lock().unwrap().clone();
    ran.sort();
    assert_eq!(ran, [10, 11, 12]);
}

/// What a producer answered for one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Confirmed,
    Spooled,
    /// Failed, or the producer was killed before it answered: the job may run (at most once)
    /// or not.
    Unknown,
}

/// The broker stopped under a steady enqueue load from the library, `chime enqueue` and
/// `chime api` at once (`CHIME_SPOOL_OUTAGE_SECS`, default 10 s; RELIABILITY.md records a
/// 60 s run), with producers SIGKILLed while they spool: the `chime api` process once in the
/// middle of the outage (restarted: the new process takes over the dead one's spool file), and
/// `chime enqueue` processes at random moments. Every job a producer answered for (confirmed
/// or spooled) runs exactly once afterwards; no job runs twice, answered or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_under_load_from_every_producer_loses_nothing_and_runs_nothing_twice() {
    let outage = Duration::from_secs(
        std::env::var("CHIME_SPOOL_OUTAGE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(10),
    );
    let rabbit = PrivateRabbit::start().await;
    let mut env = TestEnv::new("spool-outage");
    env.amqp_url = rabbit.url();
    let jobs = format!(
        "{}{COUNT_JOB}",
        spool_section(&env, "").replace("[[jobs]]\nname = \"rec\"\nhandler = \"rec\"\n", "")
    );
    let text = env.config_text("quorum", "", "", &jobs);
    let path = env.write_config(&text);
    let config = env.config("quorum", "", "", &jobs);
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), counting_registry(&ledger), 16).await;
    let answers: Arc<Mutex<Vec<(u64, String, Answer)>>> = Arc::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let job = |n: u64| format!(r#"{{"n": {n}}}"#);

    // The library: one job every 20 ms.
    let client = Arc::new(EnqueueClient::connect(config.clone()).await.unwrap());
    let lib = {
        let (client, answers, stop) = (client.clone(), answers.clone(), stop.clone());
        tokio::spawn(async move {
            for n in 0u64.. {
                if stop.is_cancelled() {
                    break;
                }
                let key = format!("lib-{n}");
                let req = EnqueueRequest::new("count").payload(serde_json::json!({"n": n})).key(&key);
                let a = match client.enqueue(req).await {
                    Ok(d) if d.delivery == Delivery::Confirmed => Answer::Confirmed,
                    Ok(_) => Answer::Spooled,
                    Err(_) => Answer::Unknown,
                };
                answers.lock().unwrap().push((n, key, a));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // `chime enqueue`, one process at a time; a third of them SIGKILLed within 80 ms.
    let cli = {
        let (answers, stop, path) = (answers.clone(), stop.clone(), path.clone());
        tokio::spawn(async move {
            for i in 0u64.. {
                if stop.is_cancelled() {
                    break;
                }
                let (n, key) = (100_000 + i, format!("cli-{i}"));
                let mut child = tokio::process::Command::new(bin("chime"))
                    .arg("--config")
                    .arg(&path)
                    .args(["enqueue", "count", "--payload", &job(n), "--key", &key, "--allow-spool"])
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::null())
                    .kill_on_drop(true)
                    .spawn()
                    .unwrap();
                let a = if i % 3 == 2 {
                    let after = Duration::from_millis(uuid::Uuid::new_v4().as_u128() as u64 % 80);
                    tokio::select! {
                        s = child.wait() => if s.is_ok_and(|s| s.success()) { Answer::Spooled } else { Answer::Unknown },
                        () = tokio::time::sleep(after) => {
                            let _ = child.start_kill();
                            let _ = child.wait().await;
                            Answer::Unknown
                        }
                    }
                } else {
                    let out = child.wait_with_output().await.unwrap();
                    let text = String::from_utf8_lossy(&out.stdout);
                    match (out.status.success(), text.contains("spooled")) {
                        (true, false) => Answer::Confirmed,
                        (true, true) => Answer::Spooled,
                        _ => Answer::Unknown,
                    }
                };
                answers.lock().unwrap().push((n, key, a));
            }
        })
    };
    // `chime api`, one POST every 50 ms; the process is SIGKILLed in the outage and restarted.
    let port = free_port();
    let start_api = || {
        let mut cmd = tokio::process::Command::new(bin("chime"));
        cmd.env("CHIME_API_TOKEN", "outage-token-0123456789");
        Child::run(cmd, &env.dir, &path, &["api", "--listen", &format!("127.0.0.1:{port}")], "api")
    };
    let mut api = start_api();
    wait_until("chime api answers /livez", Duration::from_secs(30), || async move {
        chime_tests::probes::get_once(port, "/livez").await.is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;
    let http = {
        let (answers, stop) = (answers.clone(), stop.clone());
        tokio::spawn(async move {
            let web = reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap();
            for i in 0u64.. {
                if stop.is_cancelled() {
                    break;
                }
                let (n, key) = (200_000 + i, format!("http-{i}"));
                let sent = web
                    .post(format!("http://127.0.0.1:{port}/api/v1/jobs/count"))
                    .bearer_auth("outage-token-0123456789")
                    .header("content-type", "application/json")
                    .body(serde_json::json!({"payload": {"n": n}, "key": key}).to_string())
                    .send()
                    .await;
                let a = match sent {
                    Ok(r) if r.status() == 202 => {
                        let v: serde_json::Value =
                            serde_json::from_str(&r.text().await.unwrap_or_default()).unwrap_or_default();
                        match v["delivery"].as_str() {
                            Some("confirmed") => Answer::Confirmed,
                            Some("spooled") => Answer::Spooled,
                            _ => Answer::Unknown,
                        }
                    }
                    _ => Answer::Unknown,
                };
                answers.lock().unwrap().push((n, key, a));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    let count = |a: Answer| answers.lock().unwrap().iter().filter(|x| x.2 == a).count();
    wait_until("jobs confirmed before the outage", Duration::from_secs(30), || async {
        count(Answer::Confirmed) >= 30
    })
    .await;
    rabbit.kill().await;
    let down = Instant::now();
    wait_until("jobs spooled in the outage", Duration::from_secs(30), || async {
        count(Answer::Spooled) >= 20
    })
    .await;
    tokio::time::sleep(outage.saturating_sub(down.elapsed()) / 2).await;
    // The API process, killed while it holds spooled jobs; a new one takes its place.
    api.child.start_kill().unwrap();
    let _ = api.child.wait().await;
    api = start_api();
    tokio::time::sleep(outage.saturating_sub(down.elapsed())).await;
    let spooled_in_outage = count(Answer::Spooled);
    rabbit.restart().await;
    println!("broker down for {:?}", down.elapsed());
    let back = count(Answer::Confirmed);
    wait_until("jobs confirmed after the outage", Duration::from_secs(60), || async {
        count(Answer::Confirmed) >= back + 30
    })
    .await;
    stop.cancel();
    for t in [lib, cli, http] {
        t.await.unwrap();
    }
    // What killed `chime enqueue` processes left: an operator's flush (workers do it at start).
    let (code, out, err) = chime(&path, &["spool", "flush"], None);
    assert_eq!(code, 0, "{out}{err}");

    let all = answers.lock().unwrap().clone();
    let answered: Vec<&(u64, String, Answer)> = all.iter().filter(|a| a.2 != Answer::Unknown).collect();
    let keys: Vec<String> =
        answered.iter().map(|(_, k, _)| chime_shared::envelope::adhoc_key("count", k).to_string()).collect();
    crate::limits::wait_all_done(&config, &env, &keys, Duration::from_secs(120)).await;
    wait_until("the spool empty", Duration::from_secs(60), || async {
        let (_, out, _) = chime(&path, &["spool", "status", "--json"], None);
        serde_json::from_str::<serde_json::Value>(out.trim()).is_ok_and(|s| s["records"] == 0)
    })
    .await;
    let lost: Vec<&(u64, String, Answer)> =
        answered.iter().copied().filter(|(n, _, _)| ledger.get(*n) != 1).collect();
    let by = |p: &str, a: Answer| all.iter().filter(|x| x.1.starts_with(p) && x.2 == a).count();
    println!(
        "answered {} of {} jobs ({spooled_in_outage} spooled in the outage): library {}+{} spooled, cli {}+{} spooled \
         ({} unknown, killed or failed), http {}+{} spooled ({} unknown); runs {}, duplicate runs {}",
        answered.len(),
        all.len(),
        by("lib-", Answer::Confirmed),
        by("lib-", Answer::Spooled),
        by("cli-", Answer::Confirmed),
        by("cli-", Answer::Spooled),
        by("cli-", Answer::Unknown),
        by("http-", Answer::Confirmed),
        by("http-", Answer::Spooled),
        by("http-", Answer::Unknown),
        ledger.total(),
        ledger.duplicates()
    );
    assert!(lost.is_empty(), "answered but not run exactly once: {lost:?}");
    assert_eq!(ledger.duplicates(), 0, "no job runs twice");
    for p in ["lib-", "cli-", "http-"] {
        assert!(by(p, Answer::Spooled) > 0, "{p} jobs were spooled in the outage");
    }
    worker.stop().await;
    drop(client);
    drop(api);
}
