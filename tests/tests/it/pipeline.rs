//! enqueue → RabbitMQ → workers → Redis: executed once, duplicates absorbed.

use chime_producer::{EnqueueClient, EnqueueRequest};
use serde_json::json;
use std::time::{Duration, Instant};

use crate::common::*;

async fn enqueue_runs_once(queue_type: &str) {
    let env = TestEnv::new(&format!("once-{queue_type}"));
    let config = env.config(queue_type, "", "", COUNT_JOB);
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), counting_registry(&ledger), 4).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let done = client.enqueue(EnqueueRequest::new("count").payload(json!({"n": 7}))).await.unwrap();
    assert_eq!(done.queue, "default");
    let w = &worker;
    wait_until("job executed", Duration::from_secs(20), || async { w.succeeded() == 1 }).await;
    assert_eq!(ledger.get(7), 1);
    assert_eq!(depth(&env.names().work_queue("default")).await, 0);
    // The key is recorded as done in Redis.
    assert_eq!(idem_state(&env, &done.key.to_string()).await.as_deref(), Some("done"));
    worker.stop().await;
}

#[tokio::test]
async fn enqueue_runs_once_on_quorum_queue() {
    enqueue_runs_once("quorum").await;
}

#[tokio::test]
async fn enqueue_runs_once_on_classic_queue() {
    enqueue_runs_once("classic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_jobs_over_three_workers_run_exactly_once() {
    let env = TestEnv::new("thousand");
    let config = env.config("quorum", "", "prefetch = 20", COUNT_JOB);
    let ledger = Ledger::default();
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(Running::start(config.clone(), counting_registry(&ledger), 8).await);
    }
    let client = EnqueueClient::connect(config).await.unwrap();
    let reqs: Vec<_> = (0..1000u64).map(|n| EnqueueRequest::new("count").payload(json!({"n": n}))).collect();
    let started = Instant::now();
    let report = client.enqueue_batch(&reqs).await.unwrap();
    assert_eq!(report.confirmed, 1000, "{:?}", report.error);
    let l = &ledger;
    wait_until("1000 distinct jobs executed", Duration::from_secs(120), || async { l.distinct() == 1000 })
        .await;
    let secs = started.elapsed().as_secs_f64();
    // A handler records itself before its worker records `done` and counts the success.
    let w = &workers;
    wait_until("1000 successes counted", Duration::from_secs(30), || async {
        w.iter().map(|w| w.succeeded()).sum::<u64>() >= 1000
    })
    .await;
    let per_worker: Vec<u64> = workers.iter().map(|w| w.succeeded()).collect();
    println!("1000 jobs over 3 workers: {secs:.2}s, {:.0} jobs/s, per worker {per_worker:?}", 1000.0 / secs);
    assert_eq!(ledger.total(), 1000, "duplicate executions: {}", ledger.duplicates());
    assert!((0..1000).all(|n| ledger.get(n) == 1));
    assert_eq!(per_worker.iter().sum::<u64>(), 1000);
    assert!(per_worker.iter().all(|n| *n > 0), "every worker took work: {per_worker:?}");
    // Each key came once: an ack frame the broker refused (one sent out of the ledger's order,
    // a multiple ack over a tag already acked) would close the channel and redeliver what was
    // done but unacked, and the redeliveries would count as duplicates.
    let duplicates: u64 = workers.iter().map(|w| w.duplicates()).sum();
    assert_eq!(duplicates, 0, "no delivery came twice");
    for w in workers {
        w.stop().await;
    }
}

#[tokio::test]
async fn same_key_enqueued_twice_runs_once() {
    let env = TestEnv::new("samekey");
    // A busy copy comes back after the owner's remaining lease: keep it short here.
    let config = env.config("quorum", "lease = \"2s\"", "", COUNT_JOB);
    let ledger = Ledger::default();
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    // Two copies delivered concurrently (the first still running when the second arrives)
    // and a third copy later: one execution, two duplicates absorbed.
    let req = EnqueueRequest::new("count").payload(json!({"n": 1, "sleep_ms": 300})).key("order-1");
    let a = client.enqueue(req.clone()).await.unwrap();
    let b = client.enqueue(req.clone()).await.unwrap();
    assert_eq!(a.key, b.key);
    assert_ne!(a.id, b.id);
    let worker = Running::start(config, counting_registry(&ledger), 4).await;
    let w = &worker;
    wait_until("one run and one duplicate", Duration::from_secs(20), || async {
        w.succeeded() == 1 && w.duplicates() == 1
    })
    .await;
    client.enqueue(req).await.unwrap();
    wait_until("late duplicate absorbed", Duration::from_secs(20), || async { w.duplicates() == 2 }).await;
    assert_eq!(ledger.get(1), 1);
    worker.stop().await;
}
