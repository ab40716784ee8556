//! Redis stopped and restarted (empty) under load: nothing lost, intake paused meanwhile.

use chime_producer::{EnqueueClient, EnqueueRequest};
use serde_json::json;
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
    let client = EnqueueClient::connect(config).await.unwrap();
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

/// The batched store under concurrency, from two runtimes in turn: 2,000 claims and finishes at once come back each with
/// its own answer; after `SCRIPT FLUSH` (as after a Redis restart) the next calls load the
/// scripts again and succeed; a claim resent by the same owner gets the same fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_store_answers_each_call_and_survives_script_flush() {
    use chime_shared::idempotency::{Claim, Final, IdemStore, Recorded};
    let redis = PrivateRedis::start().await;
    let mut env = TestEnv::new("idembatch");
    env.redis_url = redis.url();
    let config = env.config("quorum", "", "", "");
    let store = IdemStore::connect(&config.redis, env.names()).unwrap();

    // First used from a runtime that then shuts down: its batching task and redis-rs's
    // connection die with it. The store starts a new batching task in the next caller's
    // runtime; the connection manager reconnects after reporting the broken connection once.
    let other = store.clone();
    let first = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        match rt.block_on(other.claim("first-runtime", "o")).unwrap() {
            Claim::Claimed { fence, .. } => fence,
            other => panic!("{other:?}"),
        }
    })
    .join()
    .unwrap();
    let s2 = store.clone();
    wait_until("the store works from a second runtime", Duration::from_secs(10), || {
        let s2 = s2.clone();
        async move { s2.claim("first-runtime", "o").await.is_ok() }
    })
    .await;
    assert_eq!(store.finish("first-runtime", "o", first, Final::Done).await.unwrap(), Recorded::Yes);

    let calls = (0..2000).map(|i| {
        let store = store.clone();
        async move {
            let key = format!("k{i}");
            let owner = format!("o{i}");
            let Claim::Claimed { fence, .. } = store.claim(&key, &owner).await.unwrap() else {
                panic!("fresh key {key} not claimed")
            };
            assert_eq!(
                store.claim(&key, &owner).await.unwrap(),
                Claim::Claimed { fence, checkpoint: None },
                "same owner again"
            );
            assert!(matches!(store.claim(&key, "someone else").await.unwrap(), Claim::Busy { .. }));
            let state = if i % 2 == 0 { Final::Done } else { Final::Dead };
            assert_eq!(store.finish(&key, &owner, fence, state).await.unwrap(), Recorded::Yes);
            (fence, store.claim(&key, "late duplicate").await.unwrap())
        }
    });
    let answers = futures_util::future::join_all(calls).await;
    for (i, (fence, a)) in answers.iter().enumerate() {
        let want = if i % 2 == 0 { Claim::Done { fence: *fence } } else { Claim::Dead { fence: *fence } };
        assert_eq!(*a, want, "key k{i}");
    }

    let mut conn = connect_redis(&redis.url()).await;
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut conn).await.unwrap();
    let Claim::Claimed { fence, .. } = store.claim("after-flush", "o").await.unwrap() else {
        panic!("not claimed")
    };
    assert_eq!(store.finish("after-flush", "o", fence, Final::Done).await.unwrap(), Recorded::Yes);
}
