//! Hostile and careless input: one bad message, record, client or command must not stall,
//! leak or exhaust anything. Each test reproduces a finding of the security pass.

use chime_cli::dlq::{DlqClient, Filter, UNROUTABLE};
use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_shared::envelope::{Envelope, Source, adhoc_key};
use chime_shared::{Config, amqp};
use chime_worker::Stats;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;

/// Publishes raw bytes to a prefix's work exchange, as a careless or hostile publisher would.
async fn publish_raw(env: &TestEnv, body: &[u8]) {
    let conn = connect_amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    amqp::publish_confirmed(
        &ch,
        &env.names().work_exchange(),
        "default",
        body,
        lapin::BasicProperties::default(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let _ = conn.close(200, "".into()).await;
}

/// Finding 1: `--queue <nobody's> --delay 1s` was confirmed, and 40 such messages held every
/// delayed job of the broker at the head of the (at-least-once) delay chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_delayed_message_never_holds_back_the_delay_chain() {
    let env = TestEnv::new("h-unroutable");
    let text = env.config_text("quorum", "", "", COUNT_JOB);
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    // The CLI refuses a queue nobody declares, naming it.
    let (code, _, err) = chime(&path, &["enqueue", "count", "--queue", "ghost", "--delay", "1s"], None);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("\"ghost\""), "{err}");
    // A publisher that does not check (another tool, an older release) gets them in anyway.
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    for i in 0..40 {
        let e = Envelope::new(
            "count",
            "ghost",
            adhoc_key("count", &format!("g{i}")),
            json!({"n": i}),
            None,
            3,
            Source::Adhoc,
        );
        client.publish(&e, Duration::from_secs(1)).await.unwrap();
    }
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), counting_registry(&ledger), 4).await;
    client
        .enqueue(EnqueueRequest::new("count").payload(json!({"n": 1000})).delay(Duration::from_secs(1)))
        .await
        .unwrap();
    let l = &ledger;
    wait_until("the valid delayed job ran", Duration::from_secs(20), || async { l.get(1000) == 1 }).await;
    // The 40 wait in the prefix's unroutable queue, visible to `chime dlq`.
    wait_depth(&env.names().unroutable_queue(), 40, Duration::from_secs(20)).await;
    let dlq = DlqClient::connect(config).await.unwrap();
    let dead = dlq.list(UNROUTABLE, &Filter::default()).await.unwrap();
    assert_eq!(dead.len(), 40);
    assert!(dead.iter().all(|d| d.reason == "unroutable"));
    dlq.close().await;
    worker.stop().await;
}

/// Finding 2: a batch line naming an unconfigured queue published the others.
#[tokio::test]
async fn a_batch_with_one_bad_queue_publishes_nothing() {
    let env = TestEnv::new("h-batch");
    let path = env.write_config(&env.config_text("classic", "", "", COUNT_JOB));
    let lines =
        "{\"payload\":{\"n\":1}}\n{\"payload\":{\"n\":2},\"queue\":\"nosuch\"}\n{\"payload\":{\"n\":3}}\n";
    let (code, out, err) = chime(&path, &["enqueue", "count", "--batch", "-"], Some(lines));
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("line 2") && err.contains("nosuch"), "{err}");
    assert_eq!(depth(&env.names().work_queue("default")).await, 0, "nothing published");
}

/// Findings 3 and 4: a child writing 400 MB to stderr took the worker to 427 MB; children
/// inherited the worker's whole environment (broker and Redis URLs with passwords).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_children_get_a_clean_environment_and_bounded_output() {
    let env = TestEnv::new("h-exec");
    let dump = env.dir.join("env.txt");
    let jobs = format!(
        "[[jobs]]\nname = \"envdump\"\nhandler = \"exec\"\npass_env = [\"ALLOWED_VAR\"]\ncommand = ['sh', '-c', 'env > {}']\n\
         [[jobs]]\nname = \"loud\"\nhandler = \"exec\"\nmax_attempts = 1\n\
         command = ['sh', '-c', 'head -c 400000000 /dev/zero | tr \"\\\\000\" x >&2; echo THE-END >&2; exit 3']\n",
        dump.display()
    );
    let text = env.config_text("classic", "", "", &jobs);
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    let secrets = [
        ("CHIME_AMQP_URL", env.amqp_url.as_str()),
        ("CHIME_REDIS_URL", env.redis_url.as_str()),
        ("SECRET_TOKEN", "hunter2"),
        ("ALLOWED_VAR", "yes"),
    ];
    let worker = Child::worker_env(&env.dir, &path, "w", &secrets);
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    client.enqueue(EnqueueRequest::new("envdump")).await.unwrap();
    let d = dump.clone();
    wait_until("the job dumped its environment", Duration::from_secs(30), || {
        let d = d.clone();
        async move { std::fs::read_to_string(&d).is_ok_and(|t| t.contains("CHIME_KEY=")) }
    })
    .await;
    let seen = std::fs::read_to_string(&dump).unwrap();
    for leaked in ["hunter2", "CHIME_AMQP_URL", "CHIME_REDIS_URL", "guest:guest"] {
        assert!(!seen.contains(leaked), "{leaked} reached the job:\n{seen}");
    }
    assert!(
        seen.contains("ALLOWED_VAR=yes") && seen.contains("PATH=") && seen.contains("CHIME_JOB=envdump"),
        "{seen}"
    );

    client.enqueue(EnqueueRequest::new("loud")).await.unwrap();
    wait_depth(&env.names().dlq("default"), 1, Duration::from_secs(120)).await;
    let peak_mib = worker.peak_rss_kib() / 1024;
    let dlq = DlqClient::connect(config).await.unwrap();
    let dead = dlq.list("default", &Filter::default()).await.unwrap();
    let error = dead[0].error.clone().unwrap_or_default();
    assert!(error.ends_with("THE-END") && error.len() <= 1000, "the stderr tail: {} bytes", error.len());
    assert!(peak_mib < 100, "the worker peaked at {peak_mib} MiB while a child wrote 400 MB to stderr");
    println!("worker peak RSS while a child wrote 400 MB to stderr: {peak_mib} MiB");
    dlq.close().await;
}

/// Finding 4: query strings of `http` jobs and webhooks in logs and in `x-chime-error`; a
/// config syntax error echoing a password. Round two, finding 3: a token as the whole
/// userinfo (`http://ghp_…@host`) and secrets in the path (Slack, Discord and Teams webhooks)
/// reached the worker log, `x-chime-error` (`dlq list`) and `chime history`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_in_urls_never_reach_logs_or_dead_letters() {
    let env = TestEnv::new("h-secrets");
    let jobs = "[[jobs]]\nname = \"hook\"\nhandler = \"http\"\nmax_attempts = 1\nurl = \"http://127.0.0.1:1/hook?api_key=SECRET-Q\"\n\
                [[jobs]]\nname = \"slack\"\nhandler = \"http\"\nmax_attempts = 1\n\
                url = \"http://ghp_SECRETuSeR4ab2Cd3Ef4Gh5Ij6Kl7Mn8Op9Qr0@127.0.0.1:1/services/T0123ABCD/B0456EFGH/SECRETpAtH9Qx2Rt7Vb1Nc4Pw8\"\n\
                [alerts]\nwebhook = \"http://127.0.0.1:1/api/webhooks/123456789012345678/SECRETwEbHoOk-Ab9Cd8Ef7Gh6Ij5Kl4Mn3?token=SECRET-W\"\nfor = \"1s\"\ninterval = \"200ms\"\n";
    let text = env.config_text("classic", "", "", jobs);
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    let worker = Child::worker(&env.dir, &path, &[], "w");
    let watch = Child::chime(&env.dir, &path, &["watch"], "watch");
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    client.enqueue(EnqueueRequest::new("hook")).await.unwrap();
    client.enqueue(EnqueueRequest::new("slack")).await.unwrap();
    wait_depth(&env.names().dlq("default"), 2, Duration::from_secs(30)).await;
    let w = &watch;
    wait_until("the webhook was tried", Duration::from_secs(30), || async {
        w.log_text().contains("alert webhook failed")
    })
    .await;
    let dlq = DlqClient::connect(config).await.unwrap();
    let errors: Vec<String> = dlq
        .list("default", &Filter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.error.unwrap_or_default())
        .collect();
    dlq.close().await;
    assert!(errors.iter().any(|e| e.contains("api_key=***")), "x-chime-error: {errors:?}");
    assert!(
        errors.iter().any(|e| e.contains("http://***@127.0.0.1:1/services/T0123ABCD/B0456EFGH/***")),
        "{errors:?}"
    );
    assert!(errors.iter().all(|e| !e.contains("SECRET")), "x-chime-error: {errors:?}");
    let (_, history, _) = chime(&path, &["history", "--json"], None);
    let (_, listed, _) = chime(&path, &["dlq", "list", "--json"], None);
    assert!(history.contains("B0456EFGH") && listed.contains("B0456EFGH"), "{history}\n{listed}");
    let (_web, base) = crate::web::start_web(&env, &path, &[], &[]).await;
    let mut pages = String::new();
    for page in ["/history", "/dlq?queue=default"] {
        pages += &reqwest::get(format!("{base}{page}")).await.unwrap().text().await.unwrap();
    }
    assert!(pages.contains("B0456EFGH"), "{pages}");
    for (what, text) in [
        ("worker log", worker.log_text()),
        ("watch log", watch.log_text()),
        ("chime history", history),
        ("chime dlq list", listed),
        ("the dashboard", pages),
    ] {
        assert!(!text.contains("SECRET"), "{what} leaks a secret:\n{text}");
    }
    let bad = env.dir.join("bad.toml");
    std::fs::write(&bad, "[amqp]\nurl = \"amqp://u:SECRET-P@h/\"\nheartbeat = = 1\n").unwrap();
    let (code, out, err) = chime(&bad, &["check-config"], None);
    assert_eq!(code, 2);
    assert!(!format!("{out}{err}").contains("SECRET"), "{err}");
    assert!(err.contains("line 3"), "{err}");
}

/// Finding 4: job names and errors with newlines or terminal escapes forged log lines and
/// drove the terminal of `chime dlq show`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_never_reach_logs_or_terminals_raw() {
    let env = TestEnv::new("h-ctrl");
    let jobs = "[[jobs]]\nname = \"noisy\"\nhandler = \"exec\"\ncommand = ['sh', '-c', 'printf \"boom\\\\033[2J\\\\nINFO forged\" >&2; exit 100']\n";
    let text = env.config_text("classic", "", "", jobs);
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    let worker = Child::worker(&env.dir, &path, &[], "w");
    let mut evil: serde_json::Value = serde_json::from_slice(
        &Envelope::new("noisy", "default", adhoc_key("noisy", "x"), json!(null), None, 3, Source::Adhoc)
            .encode(),
    )
    .unwrap();
    evil["job"] = "evil\nINFO forged line".into();
    let client = EnqueueClient::connect(config).await.unwrap(); // declares the topology
    publish_raw(&env, &serde_json::to_vec(&evil).unwrap()).await;
    client.enqueue(EnqueueRequest::new("noisy")).await.unwrap();
    wait_depth(&env.names().dlq("default"), 2, Duration::from_secs(30)).await;
    let log = worker.log_text();
    assert!(!log.lines().any(|l| l.starts_with("INFO forged")), "a forged log line:\n{log}");
    assert!(!log.contains('\u{1b}'), "a raw escape in the log");
    let (code, list, _) = chime(&path, &["dlq", "list"], None);
    assert_eq!(code, 0);
    assert!(!list.contains('\u{1b}') && !list.lines().any(|l| l.starts_with("INFO forged")), "{list}");
    for id in list.lines().filter_map(|l| l.split_whitespace().next()).filter(|w| w.len() == 36) {
        let (_, shown, _) = chime(&path, &["dlq", "show", id], None);
        assert!(!shown.contains('\u{1b}') && !shown.lines().any(|l| l.starts_with("INFO forged")), "{shown}");
    }
}

/// Finding 5: a non-hash value under an idempotency key was taken for "Redis unreachable":
/// intake paused and resumed in a loop; a garbage ticker lease blocked scheduling silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_record_is_dead_lettered_and_nothing_else_pauses() {
    let env = TestEnv::new("h-poison");
    let config = env.config("classic", "", "", COUNT_JOB);
    let key = adhoc_key("count", "poisoned").to_string();
    let mut r = connect_redis(&env.redis_url).await;
    let _: () =
        redis::cmd("SET").arg(env.names().idem_key(&key)).arg("garbage").query_async(&mut r).await.unwrap();
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), counting_registry(&ledger), 4).await;
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    client.enqueue(EnqueueRequest::new("count").key("poisoned").payload(json!({"n": 0}))).await.unwrap();
    for n in 1..=5 {
        client.enqueue(EnqueueRequest::new("count").payload(json!({"n": n}))).await.unwrap();
    }
    let l = &ledger;
    wait_until("the other jobs ran", Duration::from_secs(30), || async { (1..=5).all(|n| l.get(n) == 1) })
        .await;
    wait_depth(&env.names().dlq("default"), 1, Duration::from_secs(30)).await;
    let dlq = DlqClient::connect(config).await.unwrap();
    let dead = dlq.list("default", &Filter::default()).await.unwrap();
    assert_eq!(dead[0].reason, "bad_record", "{dead:?}");
    dlq.close().await;
    assert_eq!(ledger.get(0), 0);
    assert_eq!(Stats::get(&worker.stats.requeued), 0, "no requeue loop");
    assert!(worker.health.get("redis") && worker.health.get("consuming"), "the worker never paused");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_ticker_lease_is_replaced() {
    let env = TestEnv::new("h-lease");
    let jobs = "[[jobs]]\nname = \"tick\"\nhandler = \"noop\"\nschedule = \"* * * * * *\"\n[ticker]\nlease = \"2s\"\n";
    let text = env.config_text("classic", "", "", jobs);
    let path = env.write_config(&text);
    let mut r = connect_redis(&env.redis_url).await;
    let key = format!("{}:ticker:leader", env.prefix);
    let _: () = redis::cmd("SET").arg(&key).arg("not a lease").query_async(&mut r).await.unwrap();
    let ticker = Child::ticker(&env.dir, &path, &[], "t");
    let q = env.names().work_queue("default");
    wait_until("slots published", Duration::from_secs(30), || {
        let q = q.clone();
        async move { depth(&q).await >= 2 }
    })
    .await;
    assert!(ticker.log_text().contains("not a lease; replaced it"), "{}", ticker.log_text());
}

/// Finding 8: 28 delay queues per prefix; about 13 prefixes exhausted a broker limited to
/// 1,024 open files, which then stopped completing AMQP handshakes for everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_prefixes_share_a_broker_limited_to_1024_open_files() {
    let rabbit = PrivateRabbit::start_nofile(1024).await;
    // RabbitMQ reports what it can use of the process limit (927 of 1,024).
    let status = rabbit.ctl(&["status"]);
    let limit: u32 = status
        .split("File Descriptors")
        .nth(1)
        .and_then(|rest| rest.split("limit: ").nth(1))
        .and_then(|n| n.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .unwrap_or(u32::MAX);
    assert!(limit <= 1024, "the node runs under the 1,024 limit:\n{status}");
    let mut envs = Vec::new();
    for i in 0..50 {
        let mut env = TestEnv::new(&format!("h-fifty{i}"));
        env.amqp_url = rabbit.url();
        let config = env.config("quorum", "", "", COUNT_JOB);
        let client = EnqueueClient::connect(config).await.unwrap_or_else(|e| panic!("prefix {i}: {e}"));
        client
            .enqueue(EnqueueRequest::new("count").payload(json!({"n": i})).delay(Duration::from_secs(1)))
            .await
            .unwrap();
        envs.push(env);
    }
    for env in &envs {
        let q = env.names().work_queue("default");
        let url = rabbit.url();
        wait_until(&format!("the delayed job of {}", env.prefix), Duration::from_secs(60), || {
            let (q, url) = (q.clone(), url.clone());
            async move {
                let conn = connect_amqp_to(&url).await;
                let d = chime_shared::topology::depth(&conn, &q).await.map(|(m, _)| m).unwrap_or(0);
                let _ = conn.close(200, "".into()).await;
                d == 1
            }
        })
        .await;
    }
    let queues = rabbit.ctl(&["-q", "list_queues", "name"]).lines().count();
    println!("50 prefixes, 1 delayed job each, on a node limited to 1,024 open files: {queues} queues");
    assert!(queues < 50 * 3 + 30 + 5, "{queues} queues");
}

/// Finding 9: oversized and out-of-range input.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_out_of_range_input_is_refused_early() {
    let env = TestEnv::new("h-sizes");
    let path = env.write_config(&env.config_text("classic", "", "", COUNT_JOB));
    // A 50 MB payload file is refused without being read whole.
    let big = env.dir.join("big.json");
    std::fs::write(&big, vec![b' '; 50 << 20]).unwrap();
    let out = std::process::Command::new("/usr/bin/time")
        .args(["-f", "%M"])
        .arg(bin("chime"))
        .arg("--config")
        .arg(&path)
        .args(["enqueue", "count", "--payload-file"])
        .arg(&big)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("larger than amqp.max_message_bytes"), "{err}");
    let peak_kib: u64 = err.lines().last().and_then(|l| l.trim().parse().ok()).unwrap_or(u64::MAX);
    assert!(peak_kib < 40 * 1024, "chime peaked at {peak_kib} KiB for a 50 MB file");
    // One 50 MB batch line, likewise.
    let line = format!("{{\"payload\":\"{}\"}}\n", "x".repeat(50 << 20));
    let (code, _, err) = chime(&path, &["enqueue", "count", "--batch", "-"], Some(&line));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("line 1") && err.contains("max_message_bytes"), "{err}");
    // Schedules that cannot be planned.
    for bad in ["0 0 0 1 1 * 2030", "0 0 30 2 *"] {
        let p = env.dir.join("cron.toml");
        std::fs::write(&p, format!("[[jobs]]\nname = \"c\"\nhandler = \"noop\"\nschedule = \"{bad}\"\n"))
            .unwrap();
        let (code, _, err) = chime(&p, &["check-config"], None);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains("jobs[0] (c).schedule"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_envelopes_are_malformed_not_retried() {
    let env = TestEnv::new("h-wire");
    let config = env.config("classic", "", "", COUNT_JOB);
    let ledger = Ledger::default();
    let worker = Running::start(config, counting_registry(&ledger), 2).await;
    let base: serde_json::Value = serde_json::from_slice(
        &Envelope::new("count", "default", adhoc_key("count", "w"), json!({"n": 1}), None, 3, Source::Adhoc)
            .encode(),
    )
    .unwrap();
    // Round two, finding 9: a shard that names no shard of its run reached the handler.
    let shard = |shard: serde_json::Value, shards: serde_json::Value| {
        let mut v = base.clone();
        v["shard"] = shard;
        v["shards"] = shards;
        v["group"] = json!(adhoc_key("count", "g"));
        v
    };
    let mut bad = vec![shard(json!(0), json!(0)), shard(json!(3), json!(3)), shard(json!(1), json!(null))];
    for (field, value) in [
        ("max_attempts", json!(4_294_967_295u32)),
        ("attempt", json!(4_294_967_295u32)),
        ("queue", json!("de\u{0}fault")),
    ] {
        let mut v = base.clone();
        v[field] = value;
        bad.push(v);
    }
    for v in &bad {
        publish_raw(&env, &serde_json::to_vec(v).unwrap()).await;
    }
    let w = &worker;
    wait_until("six dead letters", Duration::from_secs(20), || async { w.dead_lettered() == 6 }).await;
    assert_eq!(Stats::get(&worker.stats.retried), 0);
    assert_eq!(ledger.total(), 0);
    worker.stop().await;
}

/// Finding 9: `http` jobs followed redirects anywhere, re-POSTing body and key; round two: a
/// redirect within the host could still change the port (another service) or, from `https`,
/// downgrade to `http` (a 307/308 resends the body in clear).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_jobs_follow_redirects_only_within_their_origin() {
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut strangers = Vec::new();
    // Another host, and another port of the same host.
    for addr in ["127.0.0.2:0", "127.0.0.1:0"] {
        let stranger = tokio::net::TcpListener::bind(addr).await.unwrap();
        strangers.push(stranger.local_addr().unwrap());
        let h = hits.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = stranger.accept().await {
                h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
            }
        });
    }
    let redirector = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = redirector.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = redirector.accept().await {
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).await.unwrap_or(0);
            let to = if String::from_utf8_lossy(&buf[..n]).starts_with("POST /host") {
                strangers[0]
            } else {
                strangers[1]
            };
            let resp = format!(
                "HTTP/1.1 307 Temporary Redirect\r\nlocation: http://{to}/steal\r\ncontent-length: 0\r\n\r\n"
            );
            let _ = s.write_all(resp.as_bytes()).await;
        }
    });
    let env = TestEnv::new("h-redirect");
    let jobs = format!(
        "[[jobs]]\nname = \"host\"\nhandler = \"http\"\nmax_attempts = 1\nurl = \"http://127.0.0.1:{port}/host\"\n\
         [[jobs]]\nname = \"port\"\nhandler = \"http\"\nmax_attempts = 1\nurl = \"http://127.0.0.1:{port}/port\"\n"
    );
    let config = env.config("classic", "", "", &jobs);
    let worker = Running::start(config.clone(), chime_worker::Registry::new(), 1).await;
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    for job in ["host", "port"] {
        client.enqueue(EnqueueRequest::new(job).payload(json!({"secret": "body"}))).await.unwrap();
    }
    let w = &worker;
    wait_until("dead-lettered", Duration::from_secs(20), || async { w.dead_lettered() == 2 }).await;
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0, "the body went to another origin");
    let dlq = DlqClient::connect(config).await.unwrap();
    let dead = dlq.list("default", &Filter::default()).await.unwrap();
    for d in &dead {
        assert_eq!(d.reason, "permanent");
        assert!(d.error.as_deref().unwrap_or("").contains("not followed"), "{dead:?}");
    }
    dlq.close().await;
    worker.stop().await;
}

/// Finding 8: when the broker stopped completing handshakes, commands waited and gave up with
/// a bare timeout. A listener that accepts TCP and never answers stands in for that broker.
#[tokio::test]
async fn a_broker_that_never_completes_the_handshake_is_named_as_such() {
    let mute = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = mute.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = mute.accept().await {
            held.push(s); // accepted, never answered
        }
    });
    let env = TestEnv::new("h-mute");
    let mute_url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let path =
        env.write_config(&env.config_text("classic", "", "", COUNT_JOB).replace(&env.amqp_url, &mute_url));
    let (code, _, err) = tokio::task::spawn_blocking(move || chime(&path, &["status"], None)).await.unwrap();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("did not complete the AMQP handshake") && err.contains("file handles"), "{err}");
}
