//! The dashboard's page times over a large history and DLQ.

use crate::fixtures::*;
use crate::measure::*;
use chime_shared::config::Config;
use chime_shared::envelope::{self, Envelope, Source};
use chime_tests::*;
use lapin::options::ConfirmSelectOptions;
use lapin::types::FieldTable;
use std::time::{Duration, Instant};

/// Fills a prefix with 1,000,000 history events (10 jobs, 1 in 1,000 dead-lettered) and 10,000
/// dead letters, starts `chime web` on it and times each page (median and p95 of 20 loads,
/// after one warm-up; the DLQ's first read, a pass over the whole queue, is timed apart).
pub async fn web_pages(qt: &str) {
    use chime_shared::history::{Outcome, RunEvent};
    const EVENTS: usize = 1_000_000;
    const DEAD: usize = 10_000;
    let env = TestEnv::new("bench-web");
    let jobs: String = (0..10)
        .map(|i| format!("[[jobs]]\nname = \"job-{i}\"\nhandler = \"noop\"\nschedule = \"*/15 * * * *\"\n"))
        .collect();
    let text = env.config_text(qt, "", "", &jobs);
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    let names = env.names();
    let mut r = connect_redis(&env.redis_url).await;
    let stream = names.history("default");
    let now = chrono::Utc::now();
    let mut some_key = String::new();
    let t = Instant::now();
    for chunk in 0..EVENTS / 10_000 {
        progress(&format!("web: writing history {}/{EVENTS}", chunk * 10_000));
        let mut pipe = redis::pipe();
        let mut entry = Vec::new();
        for i in chunk * 10_000..(chunk + 1) * 10_000 {
            let dead = i % 1000 == 999;
            let key = envelope::random_key().to_string();
            if i == EVENTS - 10 {
                some_key = key.clone();
            }
            let finished = now - chrono::Duration::milliseconds((EVENTS - i) as i64 * 50);
            let e = RunEvent {
                job: format!("job-{}", i % 10),
                key,
                id: uuid::Uuid::now_v7().to_string(),
                queue: "default".into(),
                attempt: 1,
                max_attempts: 5,
                worker: "bench-host:4242".into(),
                started_at: Some(finished - chrono::Duration::milliseconds(12)),
                finished_at: finished,
                outcome: if dead { Outcome::DeadLettered } else { Outcome::Succeeded },
                duration_ms: Some(12),
                reason: dead.then(|| "exhausted".to_string()),
                error: dead.then(|| "exit code 3: upstream answered 503".to_string()),
                entry: None,
            };
            // As the worker writes them: a few runs to an entry.
            entry.push(e.stream_values());
            if entry.len() == chime_shared::history::RUNS_PER_ENTRY {
                let runs = chime_shared::history::encode_entry(&std::mem::take(&mut entry));
                pipe.cmd("XADD").arg(&stream).arg("*").arg("runs").arg(runs).ignore();
            }
        }
        let _: () = pipe.query_async(&mut r).await.unwrap();
    }
    let bytes: u64 = memory_usage(&mut r, &stream).await;
    let history_secs = t.elapsed().as_secs_f64();
    // The key page's record, as the worker leaves it.
    let idem = names.idem_key(&some_key);
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg(&idem)
        .arg("s")
        .arg("done")
        .arg("o")
        .arg("bench-host:4242/1")
        .arg("f")
        .arg(7)
        .ignore()
        .query_async(&mut r)
        .await
        .unwrap();
    // Dead letters, as the worker publishes them.
    let conn = connect_amqp().await;
    chime_shared::topology::declare(&conn, &config, &config.all_queues()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let dlq = names.dlq("default");
    let mut first_id = String::new();
    for chunk in 0..DEAD / 1000 {
        progress(&format!("web: publishing dead letters {}/{DEAD}", chunk * 1000));
        let mut confirms = Vec::new();
        for i in 0..1000 {
            let env_ = Envelope::new(
                &format!("job-{}", i % 10),
                "default",
                envelope::random_key(),
                serde_json::json!({"invoice": i, "amount_cents": 4200}),
                None,
                5,
                Source::Adhoc,
            );
            let id = uuid::Uuid::now_v7().to_string();
            if first_id.is_empty() {
                first_id = id.clone();
            }
            let mut h = FieldTable::default();
            let failed_at = chrono::Utc::now().to_rfc3339();
            for (k, v) in [
                ("x-chime-reason", "exhausted"),
                ("x-chime-error", "exit code 3: upstream answered 503 Service Unavailable"),
                ("x-chime-attempts", "5"),
                ("x-chime-failed-at", failed_at.as_str()),
                ("x-chime-worker", "bench-host:4242"),
                ("x-chime-queue", "default"),
                ("x-chime-dead-id", id.as_str()),
            ] {
                h.insert(k.into(), lapin::types::AMQPValue::LongString(v.into()));
            }
            let props = env_.properties().with_headers(h);
            confirms.push(
                ch.basic_publish("".into(), dlq.as_str().into(), Default::default(), &env_.encode(), props)
                    .await
                    .unwrap(),
            );
        }
        for c in confirms {
            c.await.unwrap();
        }
    }
    progress("web: starting chime web");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _web = Child::chime(&env.dir, &path, &["web", "--listen", &format!("127.0.0.1:{port}")], "web");
    let http = reqwest::Client::new();
    wait_until("chime web answers", Duration::from_secs(30), || {
        let (http, url) = (http.clone(), format!("{base}/livez"));
        async move { http.get(url).send().await.is_ok() }
    })
    .await;
    let time = |url: String| {
        let http = http.clone();
        async move {
            let t = Instant::now();
            let resp = http.get(&url).send().await.unwrap();
            let status = resp.status();
            let body = resp.bytes().await.unwrap();
            assert!(status.is_success(), "{url}: {status}");
            (t.elapsed().as_secs_f64() * 1000.0, body.len())
        }
    };
    // The first view of a large DLQ starts a background pass over it; the page says so
    // (id="reading") until the pass is done.
    progress("web: the DLQ's first read");
    let t = Instant::now();
    loop {
        let body = http.get(format!("{base}/dlq?queue=default")).send().await.unwrap().text().await.unwrap();
        if !body.contains("id=\"reading\"") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(300), "the DLQ was never read");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cold = t.elapsed().as_secs_f64() * 1000.0;
    let pages = [
        ("overview", "/".to_string()),
        ("schedules", "/schedules".to_string()),
        ("running", "/running".to_string()),
        ("history, newest 100", "/history".to_string()),
        ("history, one job", "/history?job=job-3".to_string()),
        ("history, dead_lettered (1 in 1,000)", "/history?outcome=dead_lettered".to_string()),
        ("history, a job with no runs", "/history?job=nope".to_string()),
        ("key", format!("/keys/{some_key}")),
        ("DLQ, first 100 of 10,000", "/dlq?queue=default".to_string()),
        ("DLQ, page 50", "/dlq?queue=default&page=50".to_string()),
        ("DLQ, filtered by job", "/dlq?queue=default&job=job-3".to_string()),
        ("dead letter", format!("/dlq/default/{first_id}")),
    ];
    println!(
        "web      {EVENTS} history events ({:.0} MiB in Redis, written in {history_secs:.0}s), {DEAD} dead letters; \
         the DLQ's first read (a pass over all of it): {cold:.0} ms",
        bytes as f64 / 1_048_576.0
    );
    for (name, path) in pages {
        progress(&format!("web: {name}"));
        let _ = time(format!("{base}{path}")).await;
        let mut ms = Vec::new();
        let mut size = 0;
        for _ in 0..20 {
            let (m, n) = time(format!("{base}{path}")).await;
            ms.push(m);
            size = n;
        }
        ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
        progress("");
        println!(
            "web      {name:<38} median {:>6.1} ms   p95 {:>6.1} ms   {:>7} bytes",
            ms[ms.len() / 2],
            ms[ms.len() * 95 / 100],
            size
        );
    }
    let _ = ch.close(200, "".into()).await;
    let _ = conn.close(200, "".into()).await;
}
