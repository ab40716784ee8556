//! `chime dlq` round trips and DLQ alerts.

use axum::Router;
use axum::routing::post;
use chime_cli::dlq::{DlqClient, Filter};
use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_shared::amqp;
use chime_shared::envelope::put_header;
use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
use lapin::BasicProperties;
use lapin::options::ConfirmSelectOptions;
use lapin::types::FieldTable;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use crate::common::*;

async fn chime_cli(config: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(bin("chime"))
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ids(json: &str) -> Vec<String> {
    let v: Vec<serde_json::Value> = serde_json::from_str(json).unwrap();
    v.iter().map(|d| d["id"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_dead_letters_listed_then_replayed_by_two_operators_at_once() {
    let env = TestEnv::new("dlqtrip");
    let text = env.config_text(
        "quorum",
        "",
        "",
        COUNT_JOB.replace("handler = \"count\"", "handler = \"gate\"").as_str(),
    );
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let open = Arc::new(AtomicBool::new(false));
    let ledger = Ledger::default();
    let attempts = Ledger::default();
    let mut reg = Registry::new();
    let (o, l, a) = (open.clone(), ledger.clone(), attempts.clone());
    reg.register(
        "gate",
        raw_handler_fn(move |ctx: JobContext, p: serde_json::Value| {
            let ok = o.load(Ordering::SeqCst);
            if ok {
                l.record(p["n"].as_u64().unwrap());
                a.record(u64::from(ctx.attempt()));
            }
            async move { if ok { Ok(()) } else { Err(JobError::permanent("gate closed")) } }
        }),
    );
    let worker = Running::start(config.clone(), reg, 8).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let reqs: Vec<_> =
        (0..100u64).map(|n| EnqueueRequest::new("count").payload(serde_json::json!({"n": n}))).collect();
    client.enqueue_batch(&reqs).await.unwrap();
    let w = &worker;
    wait_until("100 dead letters", Duration::from_secs(60), || async { w.dead_lettered() == 100 }).await;

    let (code, first, err) = chime_cli(&path, &["dlq", "list", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let first = ids(&first);
    assert_eq!(first.len(), 100);
    let (_, second, _) = chime_cli(&path, &["dlq", "list", "--json"]).await;
    assert_eq!(ids(&second), first, "listing neither loses nor reorders");
    let (code, table, _) = chime_cli(&path, &["dlq", "list", "--limit", "2"]).await;
    assert_eq!(code, 0);
    // A limit of none is refused, not answered "no dead letters".
    let (code, out, err) = chime_cli(&path, &["dlq", "list", "--limit", "0"]).await;
    assert_eq!(code, 2, "{out}");
    assert!(err.contains("--limit must be at least 1"), "{err}");
    assert!(table.contains("permanent") && table.contains("gate closed"), "{table}");
    let (code, shown, err) = chime_cli(&path, &["dlq", "show", &first[7]]).await;
    assert_eq!(code, 0, "{err}");
    assert!(shown.contains(&format!("id:        {}", first[7])) && shown.contains("\"n\": "), "{shown}");

    open.store(true, Ordering::SeqCst);
    let (a, b) = tokio::join!(
        chime_cli(&path, &["dlq", "replay", "--all", "--json"]),
        chime_cli(&path, &["dlq", "replay", "--all", "--json"])
    );
    assert_eq!((a.0, b.0), (0, 0), "{} {}", a.2, b.2);
    let replayed =
        |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap()["replayed"].as_u64().unwrap();
    assert_eq!(replayed(&a.1) + replayed(&b.1), 100, "two operators together replayed each dead letter once");
    let l = &ledger;
    wait_until("100 replayed jobs ran", Duration::from_secs(60), || async { l.distinct() == 100 }).await;
    assert_eq!(ledger.total(), 100, "no duplicates");
    assert_eq!(attempts.get(1), 100, "replays restart at attempt 1");
    let dlq = env.names().dlq("default");
    assert_eq!(depth(&dlq).await, 0);
    worker.stop().await;
}

async fn publish_dead(env: &TestEnv, n: usize, failed_at: chrono::DateTime<chrono::Utc>) {
    publish_dead_to(env, "default", n, failed_at).await
}

/// Publishes `n` dead letters straight into `queue`'s DLQ.
async fn publish_dead_to(env: &TestEnv, queue: &str, n: usize, failed_at: chrono::DateTime<chrono::Utc>) {
    let conn = connect_amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    for i in 0..n {
        let e = chime_shared::Envelope::new(
            "count",
            "default",
            chime_shared::envelope::random_key(),
            serde_json::json!({"n": i}),
            None,
            3,
            chime_shared::Source::Adhoc,
        );
        let mut h = FieldTable::default();
        put_header(&mut h, "x-chime-reason", "exhausted");
        put_header(&mut h, "x-chime-failed-at", &failed_at.to_rfc3339());
        put_header(&mut h, "x-chime-dead-id", &uuid::Uuid::now_v7().to_string());
        let props: BasicProperties = e.properties().with_headers(h);
        amqp::publish_confirmed(
            &ch,
            "",
            &env.names().dlq(queue),
            &e.encode(),
            props,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    }
    let _ = conn.close(200, "".into()).await;
}

#[tokio::test]
async fn purge_by_age_and_by_id() {
    let env = TestEnv::new("purge");
    let text = env.config_text("classic", "", "", COUNT_JOB);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let client = DlqClient::connect(config).await.unwrap(); // declares the topology
    publish_dead(&env, 2, chrono::Utc::now() - chrono::Duration::days(10)).await;
    publish_dead(&env, 2, chrono::Utc::now()).await;
    let (code, out, err) = chime_cli(&path, &["dlq", "purge", "--all", "--older-than", "7d", "--yes"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("purged 2 dead letter(s); 2 left in place"), "{out}");
    let left = client.list("default", &Filter::default()).await.unwrap();
    assert_eq!(left.len(), 2);
    // Ages are Redis `TIME`'s: an operator's host eight days ahead purges none of today's.
    let ahead = chime_tests::faked_clock("+8d");
    let ahead: Vec<(&str, &std::ffi::OsStr)> =
        ahead.iter().map(|(k, v)| (*k, std::ffi::OsStr::new(v))).collect();
    let (code, out, err) =
        chime_env(&path, &["dlq", "purge", "--all", "--older-than", "7d", "--yes"], None, &ahead);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("purged 0 dead letter(s); 2 left in place"), "{out}");
    // Without a terminal nobody can confirm: --yes is required, and nothing is purged.
    let (code, _, err) = chime_cli(&path, &["dlq", "purge", &left[0].id]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--yes"), "{err}");
    assert_eq!(client.list("default", &Filter::default()).await.unwrap().len(), 2);
    let (code, out, _) = chime_cli(&path, &["dlq", "purge", &left[0].id, "--yes"]).await;
    assert_eq!(code, 0);
    assert!(out.starts_with("purged 1"), "{out}");
    let (code, _, err) = chime_cli(&path, &["dlq", "purge"]).await;
    assert_eq!(code, 2, "neither ids nor --all is a usage error");
    assert!(err.contains("--all"), "{err}");
    let remaining = client.list("default", &Filter::default()).await.unwrap();
    assert_eq!(remaining.iter().map(|d| d.id.clone()).collect::<Vec<_>>(), vec![left[1].id.clone()]);
    client.close().await;
}

pub(crate) type Bodies = Arc<Mutex<Vec<serde_json::Value>>>;

/// A webhook receiver: the address to post to and the bodies received so far.
pub(crate) async fn webhook() -> (std::net::SocketAddr, Bodies) {
    let bodies = Bodies::default();
    let b = bodies.clone();
    let app = Router::new().route(
        "/alerts",
        post(move |body: String| {
            let b = b.clone();
            async move {
                b.lock().unwrap().push(serde_json::from_str(&body).unwrap());
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, bodies)
}

/// Waits (20 s at most) until the receiver holds `n` notifications.
pub(crate) async fn wait_notifications(bodies: &Bodies, n: usize, what: &str) {
    wait_until(what, Duration::from_secs(20), || {
        let got = bodies.clone();
        async move { got.lock().unwrap().len() >= n }
    })
    .await;
}

/// A config whose DLQ alerts (checked every 100 ms) go to a fresh webhook receiver.
async fn alerting(env: &TestEnv, hold: Duration, threshold: u64) -> (chime_shared::ValidConfig, Bodies) {
    let (addr, bodies) = webhook().await;
    let mut config = env.config("classic", "", "", COUNT_JOB).into_config();
    config.alerts.webhook = Some(format!("http://{addr}/alerts"));
    config.alerts.interval = Duration::from_millis(100);
    config.alerts.for_ = hold;
    config.alerts.dlq_threshold = threshold;
    (config.validated().unwrap(), bodies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_alert_fires_then_resolves_once_each() {
    let env = TestEnv::new("alerts");
    let (config, bodies) = alerting(&env, Duration::from_millis(500), 2).await;
    let health = chime_shared::health::Health::default();
    let token = CancellationToken::new();
    let monitor = tokio::spawn(chime_scheduler::monitor::run(config.clone(), health.clone(), token.clone()));
    let h = health.clone();
    wait_until("monitor connected", Duration::from_secs(10), || {
        let h = h.clone();
        async move { h.get("amqp") }
    })
    .await;
    publish_dead(&env, 1, chrono::Utc::now()).await; // below the threshold of 2
    publish_dead(&env, 2, chrono::Utc::now()).await;
    let got = bodies.clone();
    wait_until("firing notification", Duration::from_secs(20), || {
        let got = got.clone();
        async move { got.lock().unwrap().len() == 1 }
    })
    .await;
    let client = DlqClient::connect(config).await.unwrap();
    client.purge("default", &Filter::default()).await.unwrap();
    wait_until("resolved notification", Duration::from_secs(20), || {
        let got = got.clone();
        async move { got.lock().unwrap().len() >= 2 }
    })
    .await;
    token.cancel();
    monitor.await.unwrap();
    client.close().await;
    let all = bodies.lock().unwrap().clone();
    let statuses: Vec<&str> = all.iter().map(|b| b["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["firing", "resolved"], "exactly one of each");
    assert_eq!(all[0]["version"], "4");
    assert_eq!(all[0]["alerts"][0]["labels"]["queue"], "default");
    assert_eq!(all[1]["alerts"][0]["status"], "resolved");
    assert_ne!(all[1]["alerts"][0]["endsAt"], "0001-01-01T00:00:00Z");
}

/// Runs `chime … dlq purge --all` on a pseudo-terminal (util-linux `script`), answering `answer`.
async fn purge_on_a_tty(config: &std::path::Path, answer: &str) -> String {
    use tokio::io::AsyncWriteExt;
    let cmd = format!("{} --config {} dlq purge --all", bin("chime").display(), config.display());
    let mut child = tokio::process::Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("util-linux `script` runs the command on a pseudo-terminal");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(format!("{answer}\n").as_bytes()).await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output()).await.unwrap().unwrap();
    drop(stdin);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn purge_asks_on_a_terminal() {
    let env = TestEnv::new("purgetty");
    let text = env.config_text("classic", "", "", COUNT_JOB);
    let path = env.write_config(&text);
    let client = DlqClient::connect(chime_shared::Config::from_toml_str(&text).unwrap()).await.unwrap();
    publish_dead(&env, 3, chrono::Utc::now()).await;
    let out = purge_on_a_tty(&path, "n").await;
    assert!(
        out.contains("purge 3 dead letter(s) (default: 3)? [y/N]") && out.contains("nothing purged"),
        "{out}"
    );
    assert_eq!(client.list("default", &Filter::default()).await.unwrap().len(), 3);
    let out = purge_on_a_tty(&path, "y").await;
    assert!(out.contains("purged 3 dead letter(s)"), "{out}");
    assert_eq!(client.depth("default").await.unwrap(), 0);
    client.close().await;
}

/// Dead-letter ids are UUIDv7: every dead letter of the same minute shares its first 8
/// characters. A prefix that names several must never act on all of them.
#[tokio::test]
async fn an_ambiguous_id_prefix_acts_on_nothing_and_lists_the_matches() {
    let env = TestEnv::new("ambiguous");
    let text = env.config_text("classic", "", "", COUNT_JOB);
    let path = env.write_config(&text);
    let client = DlqClient::connect(chime_shared::Config::from_toml_str(&text).unwrap()).await.unwrap();
    publish_dead(&env, 3, chrono::Utc::now()).await;
    let all = client.list("default", &Filter::default()).await.unwrap();
    let prefix = &all[0].id[..8];
    assert!(all.iter().all(|d| d.id.starts_with(prefix)), "three ids of one minute share 8 characters");
    for args in
        [vec!["dlq", "show", prefix], vec!["dlq", "replay", prefix], vec!["dlq", "purge", prefix, "--yes"]]
    {
        let (code, _, err) = chime_cli(&path, &args).await;
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(all.iter().all(|d| err.contains(&d.id)), "{args:?} lists every match: {err}");
    }
    assert_eq!(client.list("default", &Filter::default()).await.unwrap().len(), 3, "nothing was touched");
    // Unknown ids and keys exit 1; too short a prefix is a usage error.
    let (code, _, err) = chime_cli(&path, &["dlq", "replay", "01234567-89ab-7def-8123-456789abcdef"]).await;
    assert_eq!(code, 1, "{err}");
    let (code, _, _) = chime_cli(&path, &["dlq", "purge", &all[0].id[..5], "--yes"]).await;
    assert_eq!(code, 2);
    // A whole id, a longer prefix, or the key names exactly one.
    let (code, out, err) = chime_cli(&path, &["dlq", "show", &all[1].id[..30]]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&all[1].id), "{out}");
    let key = all[2].key.unwrap().to_string();
    let (code, out, _) = chime_cli(&path, &["dlq", "show", &key]).await;
    assert_eq!(code, 0);
    assert!(out.contains(&all[2].id), "{out}");
    let (code, out, err) = chime_cli(&path, &["dlq", "purge", "--key", &key, "--yes"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("purged 1 dead letter(s); 2 left"), "{out}");
    let (code, _, _) = chime_cli(&path, &["dlq", "replay", "--key", &key]).await;
    assert_eq!(code, 1, "the key matches nothing any more");
    client.close().await;
}

/// `chime tick` runs the monitor only while its ticker leads: nothing is sent by a standby,
/// the alert fires once leading starts, and the monitor stops with the leadership.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_follows_leadership() {
    let env = TestEnv::new("alerts-lead");
    let (config, bodies) = alerting(&env, Duration::from_millis(200), 1).await;
    let conn = connect_amqp().await;
    chime_shared::topology::declare(&conn, &config, &["default".into()]).await.unwrap();
    publish_dead(&env, 1, chrono::Utc::now()).await;
    let (lead_tx, lead_rx) = tokio::sync::watch::channel(false);
    let (_config_tx, config_rx) = tokio::sync::watch::channel(config.clone());
    let token = CancellationToken::new();
    let monitor = tokio::spawn(chime_scheduler::monitor::run_while(lead_rx, config_rx, token.clone()));
    // A standby stays silent while a leader started at the same moment, on the same DLQ with
    // the same hold, fires: however slow the machine, the standby had the time to fire too.
    let (addr, leader_bodies) = webhook().await;
    let mut leader_config = config.into_config();
    leader_config.alerts.webhook = Some(format!("http://{addr}/alerts"));
    let (leader_tx, leader_rx) = tokio::sync::watch::channel(true);
    let (_leader_config_tx, leader_config_rx) =
        tokio::sync::watch::channel(leader_config.validated().unwrap());
    let reference =
        tokio::spawn(chime_scheduler::monitor::run_while(leader_rx, leader_config_rx, token.clone()));
    wait_notifications(&leader_bodies, 1, "firing notification from the reference leader").await;
    assert!(bodies.lock().unwrap().is_empty(), "a standby sent an alert");
    leader_tx.send_replace(false);
    lead_tx.send_replace(true);
    let got = bodies.clone();
    wait_until("firing notification from the leader", Duration::from_secs(20), || {
        let got = got.clone();
        async move { got.lock().unwrap().len() == 1 }
    })
    .await;
    lead_tx.send_replace(false);
    token.cancel();
    tokio::time::timeout(Duration::from_secs(10), monitor).await.expect("monitor stops").unwrap();
    reference.await.unwrap();
    assert_eq!(bodies.lock().unwrap()[0]["status"], "firing");
    let _ = conn.close(200, "".into()).await;
}

/// A receiver that answers per queue (by the notification's `groupLabels.queue`) and records
/// each attempt.
async fn picky_webhook(answers: &[(&str, u16)]) -> (std::net::SocketAddr, Arc<Mutex<Vec<String>>>) {
    let attempts: Arc<Mutex<Vec<String>>> = Arc::default();
    let answers: std::collections::HashMap<String, u16> =
        answers.iter().map(|(q, s)| (q.to_string(), *s)).collect();
    let seen = attempts.clone();
    let app = Router::new().route(
        "/alerts",
        post(move |body: String| {
            let (seen, answers) = (seen.clone(), answers.clone());
            async move {
                let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                let queue = v["groupLabels"]["queue"].as_str().unwrap_or_default().to_string();
                let status = answers.get(&queue).copied().unwrap_or(200);
                seen.lock().unwrap().push(queue);
                (axum::http::StatusCode::from_u16(status).unwrap(), "")
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, attempts)
}

/// Each queue's alert is delivered on its own: a receiver failing with 500 for one queue
/// (retried) does not hold back another queue's alert, and a 400 (the receiver refusing the
/// notification itself) is not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_receiver_delays_only_its_own_queue_and_a_4xx_is_not_retried() {
    let mut env = TestEnv::new("alerts-apart");
    env.queues.extend(["stuck".to_string(), "refused".to_string()]);
    let (addr, attempts) = picky_webhook(&[("stuck", 500), ("refused", 400)]).await;
    let jobs = format!(
        "{COUNT_JOB}[[jobs]]\nname = \"s\"\nhandler = \"noop\"\nqueue = \"stuck\"\n\
         [[jobs]]\nname = \"r\"\nhandler = \"noop\"\nqueue = \"refused\"\n"
    );
    let mut config = env.config("classic", "", "", &jobs).into_config();
    config.alerts.webhook = Some(format!("http://{addr}/alerts"));
    config.alerts.interval = Duration::from_millis(100);
    config.alerts.for_ = Duration::from_millis(200);
    config.alerts.dlq_threshold = 1;
    let config = config.validated().unwrap();
    let conn = connect_amqp().await;
    chime_shared::topology::declare(&conn, &config, &config.all_queues()).await.unwrap();
    let count = |q: &str| attempts.lock().unwrap().iter().filter(|a| *a == q).count();
    let health = chime_shared::health::Health::default();
    let token = CancellationToken::new();
    let monitor = tokio::spawn(chime_scheduler::monitor::run(config.clone(), health, token.clone()));
    publish_dead_to(&env, "refused", 1, chrono::Utc::now()).await;
    publish_dead_to(&env, "stuck", 1, chrono::Utc::now()).await;
    wait_until("both failing queues were notified once", Duration::from_secs(20), || async {
        count("stuck") >= 1 && count("refused") >= 1
    })
    .await;
    // Another queue's alert, due while "stuck" is being retried, goes out on time: not
    // after "stuck"'s retries (seven attempts over more than a minute) have run out.
    publish_dead_to(&env, "default", 1, chrono::Utc::now()).await;
    wait_until("the healthy queue's alert", Duration::from_secs(20), || async { count("default") >= 1 })
        .await;
    let stuck_then = count("stuck");
    assert!(stuck_then < 7, "the healthy queue's alert waited for the failing one's retries ({stuck_then})");
    // By "stuck"'s third attempt (at least 0.5 s + 1 s of backoff after its first, which came
    // after "refused"'s), a retry of "refused" (0.5 to 1 s after its first) would have come.
    wait_until("stuck retried twice", Duration::from_secs(30), || async { count("stuck") >= 3 }).await;
    assert_eq!(count("refused"), 1, "a 400 is not retried: {:?}", attempts.lock().unwrap());
    assert_eq!(count("default"), 1);
    token.cancel();
    monitor.await.unwrap();
    let _ = conn.close(200, "".into()).await;
}
