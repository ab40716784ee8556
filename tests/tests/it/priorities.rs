//! Priorities: a queue whose jobs set `priority` has a queue per level on the broker, and a
//! worker with a free slot takes a high job before a normal one before a low one, on quorum
//! and classic queues alike.

use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_shared::config::Priority;
use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;

const JOBS: &str = "[[jobs]]\nname = \"bulk\"\nhandler = \"rec\"\npriority = \"low\"\n\
                    [[jobs]]\nname = \"urgent\"\nhandler = \"rec\"\npriority = \"high\"\nmax_attempts = 1\n\
                    [[jobs]]\nname = \"plain\"\nhandler = \"rec\"\n\
                    [[jobs]]\nname = \"elsewhere\"\nhandler = \"rec\"\nqueue = \"flat\"\n";

/// Records the order jobs start in (`<job>:<n>`); sleeps `ms`; `fail` payloads fail for good.
fn recorder(order: &Arc<Mutex<Vec<String>>>, ms: u64) -> Registry {
    let o = order.clone();
    let mut r = Registry::new();
    r.register(
        "rec",
        raw_handler_fn(move |ctx: JobContext, p: serde_json::Value| {
            o.lock().unwrap().push(format!("{}:{}", ctx.job(), p["n"]));
            async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                if p["fail"] == true {
                    return Err(JobError::permanent("refused"));
                }
                Ok(())
            }
        }),
    );
    r
}

#[tokio::test]
async fn high_jobs_pass_a_low_backlog_on_quorum_and_classic_queues() {
    for queue_type in ["quorum", "classic"] {
        let mut env = TestEnv::new(&format!("prio-{queue_type}"));
        env.queues = vec!["default".into(), "flat".into()];
        let config = env.config(queue_type, "", "concurrency = 4", JOBS);
        let client = EnqueueClient::connect(config.clone()).await.unwrap();
        // A backlog of 1,000 low jobs and 100 normal ones, waiting before any worker runs.
        let low: Vec<EnqueueRequest> =
            (0..1000).map(|n| EnqueueRequest::new("bulk").payload(serde_json::json!({"n": n}))).collect();
        assert_eq!(client.enqueue_batch(&low).await.unwrap().confirmed, 1000);
        let normal: Vec<EnqueueRequest> =
            (0..100).map(|n| EnqueueRequest::new("plain").payload(serde_json::json!({"n": n}))).collect();
        assert_eq!(client.enqueue_batch(&normal).await.unwrap().confirmed, 100);
        let order = Arc::new(Mutex::new(Vec::new()));
        let worker = Running::start(config.clone(), recorder(&order, 5), 4).await;
        // Every normal job runs before the low ones still waiting (the worker took some low ones
        // into its prefetch before the normal ones arrived on their level: at most 4 running).
        wait_until("100 normal jobs done", Duration::from_secs(60), || async {
            order.lock().unwrap().iter().filter(|s| s.starts_with("plain:")).count() == 100
        })
        .await;
        let started = order.lock().unwrap().clone();
        let last_plain = started.iter().rposition(|s| s.starts_with("plain:")).unwrap();
        let lows_before = started[..last_plain].iter().filter(|s| s.starts_with("bulk:")).count();
        assert!(lows_before <= 8, "{queue_type}: {lows_before} low jobs started before the last normal one");

        // Halfway through the low backlog, 20 high jobs (one by `--priority` on a low job).
        let mark = order.lock().unwrap().len();
        for n in 0..19 {
            client.enqueue(EnqueueRequest::new("urgent").payload(serde_json::json!({"n": n}))).await.unwrap();
        }
        client
            .enqueue(
                EnqueueRequest::new("bulk")
                    .payload(serde_json::json!({"n": "promoted"}))
                    .priority(Priority::High),
            )
            .await
            .unwrap();
        wait_until("the high jobs ran", Duration::from_secs(60), || async {
            let o = order.lock().unwrap();
            o.iter().filter(|s| s.starts_with("urgent:")).count() == 19
                && o.iter().any(|s| s == "bulk:\"promoted\"")
        })
        .await;
        let started = order.lock().unwrap().clone();
        let last_high =
            started.iter().rposition(|s| s.starts_with("urgent:") || s == "bulk:\"promoted\"").unwrap();
        let lows_between = started[mark..last_high].iter().filter(|s| s.starts_with("bulk:")).count();
        // Each high job was enqueued while the worker ran a few low ones; none waited behind
        // the backlog (hundreds left).
        assert!(
            lows_between <= 40,
            "{queue_type}: {lows_between} low jobs started while 20 high ones waited"
        );
        let remaining = started.iter().filter(|s| s.starts_with("bulk:")).count();
        assert!(remaining < 1000, "{queue_type}: the low backlog was not done yet ({remaining} ran)");

        // A failing high job goes to its queue's one DLQ.
        client
            .enqueue(EnqueueRequest::new("urgent").payload(serde_json::json!({"n": "x", "fail": true})))
            .await
            .unwrap();
        wait_depth(&env.names().dlq("default"), 1, Duration::from_secs(60)).await;
        wait_until("the low backlog is done", Duration::from_secs(120), || async {
            order.lock().unwrap().iter().filter(|s| s.starts_with("bulk:") && !s.contains("promoted")).count()
                == 1000
        })
        .await;
        worker.stop().await;

        // A queue none of whose jobs sets `priority` has no levels: asking for one is refused,
        // by name, before anything is published.
        let err =
            client.enqueue(EnqueueRequest::new("elsewhere").priority(Priority::High)).await.unwrap_err();
        assert!(
            err.is_usage() && err.to_string().contains("priority") && err.to_string().contains("flat"),
            "{err}"
        );
        let path = env.write_config(&env.config_text(queue_type, "", "", JOBS));
        let (code, _, stderr) = chime(&path, &["enqueue", "elsewhere", "--priority", "high"], None);
        assert_eq!(code, 2, "{stderr}");
        assert!(stderr.contains("no priority levels"), "{stderr}");
        let (code, _, stderr) = chime(&path, &["enqueue", "bulk", "--priority", "urgent"], None);
        assert_eq!(code, 2, "{stderr}");
    }
}

/// A worker starting (or restarting) on a backlog of all three levels takes the high ones
/// first from its very first job: every level pushes its prefetch at once, and intake waits
/// for the first deliveries of the backlogged levels above the lowest before it takes any.
/// From then on each free slot takes the most urgent delivery the worker holds.
#[tokio::test]
async fn a_worker_starting_on_a_mixed_backlog_takes_the_high_jobs_first() {
    let mut env = TestEnv::new("prio-restart");
    env.queues = vec!["default".into(), "flat".into()];
    let config = env.config("classic", "", "", JOBS);
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    // Enqueued least urgent first: arrival order is the reverse of the order wanted.
    for (job, level) in [("bulk", "low"), ("plain", "normal"), ("urgent", "high")] {
        let reqs: Vec<EnqueueRequest> = (0..30)
            .map(|n| EnqueueRequest::new(job).payload(serde_json::json!({"n": format!("{level}{n}")})))
            .collect();
        assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, 30);
    }
    let order = Arc::new(Mutex::new(Vec::new()));
    // 4 at once: the prefetch is 8 for high and normal, 4 for low.
    let worker = Running::start(config.clone(), recorder(&order, 5), 4).await;
    wait_until("90 jobs ran", Duration::from_secs(60), || async { order.lock().unwrap().len() == 90 }).await;
    worker.stop().await;
    let started = order.lock().unwrap().clone();
    let first: Vec<&String> = started.iter().take(8).collect();
    assert!(
        first.iter().all(|s| s.starts_with("urgent:")),
        "the first 8 starts were not all high: {started:?}"
    );
    let last_high = started.iter().rposition(|s| s.starts_with("urgent:")).unwrap();
    let last_normal = started.iter().rposition(|s| s.starts_with("plain:")).unwrap();
    let lows_before_high = started[..last_high].iter().filter(|s| s.starts_with("bulk:")).count();
    let lows_before_normal = started[..last_normal].iter().filter(|s| s.starts_with("bulk:")).count();
    println!("start order: {started:?}");
    println!(
        "low starts before the last high: {lows_before_high}; before the last normal: {lows_before_normal}"
    );
    assert!(
        lows_before_normal <= 4,
        "{lows_before_normal} low jobs started before the last normal one: {started:?}"
    );
}

/// Aging (`jobs[].promote_after`): under a high backlog that keeps growing, a low run would
/// wait for all of it; promoted a level for each second it waits, it is taken as high after
/// two, ahead of high runs enqueued after it.
#[tokio::test]
async fn an_aged_low_run_passes_a_growing_high_backlog() {
    let env = TestEnv::new("prio-aging");
    let jobs = "[[jobs]]\nname = \"bulk\"\nhandler = \"rec\"\npriority = \"low\"\npromote_after = \"1s\"\n\
                [[jobs]]\nname = \"urgent\"\nhandler = \"rec\"\npriority = \"high\"\n";
    let config = env.config("classic", "", "", jobs);
    let order = Arc::new(Mutex::new(Vec::new()));
    let worker = Running::start(config.clone(), recorder(&order, 30), 1).await;
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    // Busy with 20 high runs when the low one comes, then 50 more a second of 30 ms each, one
    // at a time: 1.5x what the worker can do.
    let first: Vec<EnqueueRequest> =
        (0..20).map(|n| EnqueueRequest::new("urgent").payload(serde_json::json!({"n": n}))).collect();
    assert_eq!(client.enqueue_batch(&first).await.unwrap().confirmed, 20);
    client.enqueue(EnqueueRequest::new("bulk").payload(serde_json::json!({"n": "old"}))).await.unwrap();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    for n in 20..200 {
        tick.tick().await;
        client.enqueue(EnqueueRequest::new("urgent").payload(serde_json::json!({"n": n}))).await.unwrap();
    }
    wait_until("every run started", Duration::from_secs(60), || async { order.lock().unwrap().len() == 201 })
        .await;
    worker.stop().await;
    let started = order.lock().unwrap().clone();
    let low = started.iter().position(|s| s == "bulk:\"old\"").unwrap();
    println!("the low run started {low}th of 201");
    assert!(low < 150, "the low run waited for {low} high runs (of 200), aging did not promote it");
}

/// `chime priority KEY LEVEL` moves one waiting run to another level; every other run stays
/// where it was on a classic queue (in its order); on a quorum queue every other run still
/// runs once, in an order RabbitMQ's returns decide (once, under CI load, runs looked at came
/// back behind untouched ones); a key not waiting, a bad level or a queue without levels is
/// refused by name.
#[tokio::test]
async fn chime_priority_moves_one_waiting_run_and_keeps_the_rest_in_order() {
    for queue_type in ["quorum", "classic"] {
        let mut env = TestEnv::new(&format!("prio-move-{queue_type}"));
        env.queues = vec!["default".into(), "flat".into()];
        let text = env.config_text(queue_type, "", "", JOBS);
        let path = env.write_config(&text);
        let config = chime_shared::Config::from_toml_str(&text).unwrap();
        let client = EnqueueClient::connect(config.clone()).await.unwrap();
        let low: Vec<EnqueueRequest> = (0..50)
            .map(|n| EnqueueRequest::new("bulk").key(format!("b{n}")).payload(serde_json::json!({"n": n})))
            .collect();
        let keys: Vec<String> =
            low.iter().map(|r| client.prepare(r).unwrap().envelope.key.to_string()).collect();
        assert_eq!(client.enqueue_batch(&low).await.unwrap().confirmed, 50);
        let (code, out, err) = chime(&path, &["priority", &keys[40], "high"], None);
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains("moved from default low to high"), "{out}");
        let (code, _, err) = chime(&path, &["priority", &keys[40], "high"], None);
        assert!(
            code == 1 && err.contains("no run with key") && err.contains("at high already"),
            "{code} {err}"
        );
        let (code, _, err) = chime(&path, &["priority", &keys[1], "urgent"], None);
        assert!(code == 2 && err.contains("\"urgent\": high, normal or low"), "{code} {err}");
        let (code, _, err) = chime(&path, &["priority", &keys[1], "high", "--queue", "flat"], None);
        assert!(code == 2 && err.contains("queue \"flat\" has no priority levels"), "{code} {err}");
        let order = Arc::new(Mutex::new(Vec::new()));
        let worker = Running::start(config.clone(), recorder(&order, 5), 1).await;
        wait_until("50 runs", Duration::from_secs(60), || async { order.lock().unwrap().len() == 50 }).await;
        worker.stop().await;
        let started = order.lock().unwrap().clone();
        assert_eq!(started[0], "bulk:40", "the moved run first: {started:?}");
        let rest: Vec<String> = (0..50).filter(|n| *n != 40).map(|n| format!("bulk:{n}")).collect();
        if queue_type == "classic" {
            assert_eq!(started[1..], rest[..], "{queue_type}: the others in their order");
        } else {
            // A quorum queue gives the runs taken on the way back in an order of its own.
            let mut others = started[1..].to_vec();
            others.sort_by_key(|s| s[5..].parse::<u32>().unwrap());
            assert_eq!(others, rest, "{queue_type}: every other run once");
        }
    }
}
