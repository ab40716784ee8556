//! A private RabbitMQ node SIGKILLed and restarted under load: the worker reconnects,
//! re-declares, re-consumes, and nothing is lost.

use chime_producer::{EnqueueClient, EnqueueRequest};
use serde_json::json;
use std::time::Duration;

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_reconnects_after_a_broker_restart_and_loses_nothing() {
    let rabbit = PrivateRabbit::start().await;
    let mut env = TestEnv::new("brokerdown");
    env.amqp_url = rabbit.url();
    let config = env.config("quorum", "", "", COUNT_JOB);
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), counting_registry(&ledger), 4).await;
    let total = 200u64;
    {
        let client = EnqueueClient::connect(config.clone()).await.unwrap();
        let reqs: Vec<_> = (0..total)
            .map(|n| EnqueueRequest::new("count").payload(json!({"n": n, "sleep_ms": 10})))
            .collect();
        assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, total as usize);
    }
    let l = &ledger;
    wait_until("some jobs done", Duration::from_secs(30), || async { l.distinct() >= 20 }).await;
    rabbit.kill().await;
    let h = worker.health.clone();
    wait_until("worker notices the broker is gone", Duration::from_secs(30), || {
        let h = h.clone();
        async move { !h.get("amqp") && !h.ready() }
    })
    .await;
    let before = ledger.distinct();
    rabbit.restart().await;
    wait_until("every confirmed job executed after the restart", Duration::from_secs(90), || async {
        l.distinct() == total as usize
    })
    .await;
    wait_until("worker consuming again", Duration::from_secs(30), || {
        let h = h.clone();
        async move { h.ready() }
    })
    .await;
    let dups = ledger.duplicates();
    println!(
        "broker restart: {total} jobs, 0 lost, {dups} duplicate executions, {before} done before the kill"
    );
    // Deliveries unacked at the kill come back; the Redis record absorbs those that ran.
    assert!(dups <= 4, "duplicate executions {dups} above the in-flight bound");
    worker.stop().await;
}

/// One `EnqueueClient` across a broker restart: the enqueue after it reconnects (to the next
/// URL of the list, the first being dead) and publishes once, under its own key; a batch sent
/// after a second restart arrives whole. Nothing is published twice under a new key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_client_reconnects_after_a_broker_restart() {
    let rabbit = PrivateRabbit::start().await;
    let mut env = TestEnv::new("enqreconnect");
    env.amqp_url = rabbit.url();
    // A dead node first in the list: the client must move on to the live one.
    let dead = format!("amqp://guest:guest@127.0.0.1:{}/%2f", free_port());
    let text = env.config_text("quorum", "", "", COUNT_JOB).replacen(
        &format!("url = \"{}\"", rabbit.url()),
        &format!("url = [\"{dead}\", \"{}\"]", rabbit.url()),
        1,
    );
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let client = EnqueueClient::connect(config).await.unwrap();
    let a = client.enqueue(EnqueueRequest::new("count").key("a").payload(json!({"n": 1}))).await.unwrap();
    rabbit.restart().await;
    let b = client.enqueue(EnqueueRequest::new("count").key("b").payload(json!({"n": 2}))).await.unwrap();
    assert_ne!(a.key, b.key);
    rabbit.restart().await;
    let reqs: Vec<_> = (0..500).map(|n| EnqueueRequest::new("count").key(format!("batch-{n}"))).collect();
    let report = client.enqueue_batch(&reqs).await.unwrap();
    assert_eq!((report.confirmed, report.error.is_none()), (500, true), "{:?}", report.error);
    // What is in the work queue: a, b and the batch, each key once (the quorum queue kept `a`
    // across both restarts).
    let conn = connect_amqp_to(&rabbit.url()).await;
    let ch = conn.create_channel().await.unwrap();
    let queue = env.names().work_queue("default");
    let mut keys = std::collections::HashMap::<String, usize>::new();
    while let Some(m) = ch.basic_get(queue.as_str().into(), Default::default()).await.unwrap() {
        let e = chime_shared::Envelope::decode(&m.data).unwrap();
        *keys.entry(e.key.to_string()).or_default() += 1;
    }
    assert_eq!(keys.len(), 502, "a, b and 500 batch jobs");
    assert!(keys.values().all(|n| *n == 1), "each published once");
    assert!(keys.contains_key(&a.key.to_string()) && keys.contains_key(&b.key.to_string()));
}
