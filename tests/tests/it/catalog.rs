//! The workers' catalog: a job defined only in Rust, on a queue of its own, is visible to
//! every operator tool — enqueue by name, status, the DLQ tools, history, inspect, the
//! dashboard and the DLQ alerts — though the config file names neither the job nor its queue.

use chime_shared::job::{Job, JobOptions};
use chime_worker::{JobContext, JobError, Registry};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use crate::common::*;

#[derive(serde::Serialize, serde::Deserialize)]
struct SendInvoice {
    cents: u64,
}

impl Job for SendInvoice {
    const NAME: &'static str = "send_invoice";
    fn options() -> JobOptions {
        JobOptions::default().queue("invoices").max_attempts(1)
    }
}

async fn send_invoice(_: JobContext, invoice: SendInvoice) -> Result<u64, JobError> {
    if invoice.cents == 0 {
        return Err(JobError::permanent("an invoice of 0 cents"));
    }
    Ok(invoice.cents)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_only_a_worker_knows_is_visible_to_every_tool() {
    let mut env = TestEnv::new("catalog");
    env.queues.push("invoices".into());
    let text = env.config_text(
        "classic",
        "",
        "",
        "[alerts]\ndlq_threshold = 1\nfor = \"200ms\"\ninterval = \"100ms\"\n",
    );
    let path = env.write_config(&text);
    let config = env.config("classic", "", "", "");
    assert!(config.job("send_invoice").is_none() && !config.all_queues().contains(&"invoices".to_string()));

    let mut registry = Registry::new();
    registry.job(send_invoice);
    let worker =
        chime_worker::Worker::builder(config.clone()).registry(registry).worker_id("cat-w1").build().unwrap();
    let token = CancellationToken::new();
    let running = tokio::spawn(worker.run(token.clone()));
    let names = env.names();
    let redis_url = env.redis_url.clone();
    wait_until("the worker registered its jobs", Duration::from_secs(20), || {
        let (names, url) = (names.clone(), redis_url.clone());
        async move {
            let mut r = connect_redis(&url).await;
            let c = chime_shared::catalog::read(&mut r, &names).await.unwrap();
            c.jobs.get("send_invoice").is_some_and(|j| j.queue == "invoices" && j.handler == "rust")
                && c.queues.contains_key("invoices")
        }
    })
    .await;

    // Enqueued by name from the command line, though the file does not define it.
    let (code, out, err) = chime(
        &path,
        &["enqueue", "send_invoice", "--payload", r#"{"cents":5}"#, "--key", "ok", "--wait"],
        None,
    );
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(out.trim(), "5", "the typed result: {out}{err}");
    let (code, out, err) =
        chime(&path, &["enqueue", "send_invoice", "--payload", r#"{"cents":0}"#, "--key", "zero"], None);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("on queue invoices"), "the worker's queue for its job: {out}");
    let dlq = names.dlq("invoices");
    wait_until("the bad invoice is dead-lettered", Duration::from_secs(30), || {
        let dlq = dlq.clone();
        async move { depth(&dlq).await == 1 }
    })
    .await;

    let (code, out, err) = chime(&path, &["status"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("invoices"), "status lists the queue:\n{out}");
    for args in [&["dlq", "list", "--queue", "invoices"][..], &["dlq", "list"]] {
        let (code, out, err) = chime(&path, args, None);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(out.contains("send_invoice") && out.contains("permanent"), "{args:?}:\n{out}");
    }
    // The worker writes its runs to the history up to a second after settling them.
    let p = path.clone();
    wait_until("both runs in the history", Duration::from_secs(20), || {
        let p = p.clone();
        async move {
            let (code, out, err) =
                tokio::task::spawn_blocking(move || chime(&p, &["history", "--job", "send_invoice"], None))
                    .await
                    .unwrap();
            assert_eq!(code, 0, "{err}");
            out.contains("succeeded") && out.contains("dead_lettered")
        }
    })
    .await;
    let (code, out, err) = chime(&path, &["inspect", "--job", "send_invoice", "--key", "zero"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("dead"), "inspect:\n{out}");

    // The dashboard lists the queue and its dead letter.
    let (web, base) = crate::web::start_web(&env, &path, &[], &[]).await;
    let page = reqwest::get(format!("{base}/dlq?queue=invoices")).await.unwrap();
    assert_eq!(page.status(), 200);
    let page = page.text().await.unwrap();
    assert!(page.contains("send_invoice"), "{page}");
    let overview = reqwest::get(format!("{base}/")).await.unwrap().text().await.unwrap();
    assert!(overview.contains("invoices"), "{overview}");
    drop(web);

    // The DLQ alert, from a monitor given the file's config alone.
    let (addr, bodies) = crate::dlq_ops::webhook().await;
    let mut alerting = config.clone().into_config();
    alerting.alerts.webhook = Some(format!("http://{addr}/alerts"));
    alerting.alerts.interval = Duration::from_millis(100);
    alerting.alerts.for_ = Duration::from_millis(200);
    let stop = CancellationToken::new();
    let monitor = tokio::spawn(chime_scheduler::monitor::run(
        alerting.validated().unwrap(),
        chime_shared::health::Health::default(),
        stop.clone(),
    ));
    wait_until("an alert for the invoices DLQ", Duration::from_secs(20), || {
        let bodies = bodies.clone();
        async move { bodies.lock().unwrap().iter().any(|b| b["groupLabels"]["queue"] == "invoices") }
    })
    .await;
    stop.cancel();
    monitor.await.unwrap();
    token.cancel();
    running.await.unwrap().unwrap();
}

/// Catalog ages are Redis `TIME`'s, as its entries are stamped: a worker whose clock is eight
/// days ahead registers its jobs without pruning the others' (by its own clock every entry,
/// its own included, was past the 7-day retention: it emptied the catalog, and jobs defined in
/// Rust on other workers vanished from every tool).
#[tokio::test]
async fn a_worker_whose_clock_is_days_ahead_keeps_the_catalog() {
    use chime_shared::catalog::{self, CatalogJob};
    let env = TestEnv::new("catalog-skew");
    let jobs = "[[jobs]]\nname = \"skewed\"\nhandler = \"noop\"\n";
    let path = env.write_config(&env.config_text("quorum", "", "", jobs));
    let names = env.names();
    let mut r = connect_redis(&env.redis_url).await;
    let elsewhere = CatalogJob {
        name: "elsewhere".into(),
        queue: "default".into(),
        handler: "rust".into(),
        max_attempts: 3,
        timeout_ms: 30_000,
        scheduled: false,
        worker: "another".into(),
        seen_at: chrono::Utc::now(),
    };
    catalog::register(&mut r, &names, &[elsewhere], &[]).await.unwrap();
    let _worker = Child::with_clock("chime-worker", &env.dir, &path, &[], "+8d", "ahead", &[]);
    // One task writes the worker's heartbeat, then its catalog: a second heartbeat comes after
    // the first catalog write (and its pruning) ended.
    let first_beat = std::sync::Mutex::new(None);
    wait_until("the skewed worker's second heartbeat", Duration::from_secs(30), || {
        let (names, url) = (names.clone(), env.redis_url.clone());
        let first_beat = &first_beat;
        async move {
            let mut r = connect_redis(&url).await;
            let beats = chime_shared::control::workers(&mut r, &names).await.unwrap();
            let Some(seen) = beats.first().map(|b| b.seen_at) else { return false };
            let mut first = first_beat.lock().unwrap();
            *first.get_or_insert(seen) != seen
        }
    })
    .await;
    let c = catalog::read(&mut r, &names).await.unwrap();
    assert!(c.jobs.contains_key("skewed"), "its own job: {:?}", c.jobs.keys());
    assert!(c.jobs.contains_key("elsewhere"), "another worker's job: {:?}", c.jobs.keys());
}
