//! Redis stopped and restarted (empty) under load: nothing lost, intake paused meanwhile.

use chime_producer::{EnqueueClient, EnqueueRequest};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_loses_nothing_and_pauses_intake() {
    let mut redis = PrivateRedis::start().await;
    let mut env = TestEnv::new("redisdown");
    env.redis_url = redis.url();
    let config = env.config("quorum", "timeout = \"500ms\"", "", COUNT_JOB);
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), counting_registry(&ledger), 4).await;
    let client = EnqueueClient::connect(Arc::new(config)).await.unwrap();
    let total = 300u64;
    let reqs: Vec<_> =
        (0..total).map(|n| EnqueueRequest::new("count").payload(json!({"n": n, "sleep_ms": 10}))).collect();
    assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, total as usize);

    let l = &ledger;
    wait_until("some jobs done", Duration::from_secs(30), || async { l.distinct() >= 30 }).await;
    redis.kill();
    let h = worker.health.clone();
    wait_until("readiness fails while redis is down", Duration::from_secs(10), || {
        let h = h.clone();
        async move { !h.ready() && !h.get("redis") }
    })
    .await;
    let during = ledger.total();
    assert!(during < total, "outage began before the backlog drained");
    redis.restart().await;
    wait_until("every job executed after redis returned", Duration::from_secs(60), || async {
        l.distinct() == total as usize
    })
    .await;
    wait_until("readiness recovers", Duration::from_secs(10), || {
        let h = h.clone();
        async move { h.ready() }
    })
    .await;
    // Redis came back empty, so a job that ran but whose outcome was not yet acked can run
    // again; the bound is the jobs in flight at the outage (concurrency 4 + prefetch).
    let dups = ledger.duplicates();
    println!(
        "redis outage: {total} jobs, 0 lost, {dups} duplicate executions, {during} done before the outage"
    );
    assert!(dups <= 8, "duplicates {dups} exceed in-flight bound");
    worker.stop().await;
}
