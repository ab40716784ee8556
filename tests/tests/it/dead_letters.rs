//! Messages that cannot run reach their DLQ with reason headers, body unchanged.

use chime_shared::amqp;
use chime_shared::envelope::{Envelope, Source, adhoc_key, header_str};
use chime_worker::Stats;
use chime_worker::{JobError, Registry, raw_handler_fn};
use lapin::BasicProperties;
use lapin::options::{BasicAckOptions, BasicGetOptions, ConfirmSelectOptions};
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;

use crate::common::*;

/// Takes every message from `dlq` (acking it), as (body, headers by name).
pub async fn drain_dlq(dlq: &str, expect: usize) -> Vec<(Vec<u8>, HashMap<String, String>)> {
    let conn = connect_amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    let started = std::time::Instant::now();
    while out.len() < expect {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "only {} of {expect} dead letters in {dlq}",
            out.len()
        );
        match ch.basic_get(dlq.into(), BasicGetOptions::default()).await.unwrap() {
            Some(m) => {
                let props = &m.delivery.properties;
                let mut h = HashMap::new();
                for k in [
                    "x-chime-reason",
                    "x-chime-error",
                    "x-chime-attempts",
                    "x-chime-failed-at",
                    "x-chime-worker",
                ] {
                    if let Some(v) = header_str(props, k) {
                        h.insert(k.to_string(), v);
                    }
                }
                out.push((m.delivery.data.clone(), h));
                m.delivery.acker.ack(BasicAckOptions::default()).await.unwrap();
            }
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let _ = conn.close(200, "".into()).await;
    out
}

#[tokio::test]
async fn malformed_unknown_and_oversized_messages_go_to_the_dlq_without_retries() {
    let env = TestEnv::new("malformed");
    let mut config = env.config("classic", "", "unknown_job_grace = \"1s\"", COUNT_JOB).into_config();
    config.amqp.max_message_bytes = 4096;
    let config = config.validated().unwrap();
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), counting_registry(&ledger), 2).await;
    let conn = connect_amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let names = env.names();
    let ex = names.work_exchange();
    let t = Duration::from_secs(10);
    amqp::publish_confirmed(&ch, &ex, "default", b"this is not json", BasicProperties::default(), t)
        .await
        .unwrap();
    let missing = br#"{"v":1,"job":"count"}"#;
    amqp::publish_confirmed(&ch, &ex, "default", missing, BasicProperties::default(), t).await.unwrap();
    let ghost = Envelope::new(
        "ghost",
        "default",
        adhoc_key("ghost", "1"),
        serde_json::json!(1),
        None,
        3,
        Source::Adhoc,
    );
    amqp::publish_confirmed(&ch, &ex, "default", &ghost.encode(), ghost.properties(), t).await.unwrap();
    let big = Envelope::new(
        "count",
        "default",
        adhoc_key("count", "big"),
        json!("x".repeat(8000)),
        None,
        3,
        Source::Adhoc,
    );
    amqp::publish_confirmed(&ch, &ex, "default", &big.encode(), big.properties(), t).await.unwrap();

    let w = &worker;
    wait_until("four dead letters", Duration::from_secs(20), || async { w.dead_lettered() == 4 }).await;
    let dead = drain_dlq(&names.dlq("default"), 4).await;
    let reasons: Vec<&str> = dead.iter().map(|(_, h)| h["x-chime-reason"].as_str()).collect();
    // The job nobody knows is sent round for `worker.unknown_job_grace` (a rolling deploy may
    // bring its handler), so it reaches the DLQ last.
    assert_eq!(reasons, ["malformed", "malformed", "too_large", "unknown_job"]);
    assert_eq!(Stats::get(&worker.stats.retried), 0, "none of these is retried");
    assert!(Stats::get(&worker.stats.redelayed) >= 1, "the unknown job waited out its grace");
    assert_eq!(dead[0].0, b"this is not json", "body unchanged");
    assert_eq!(dead[3].0, ghost.encode(), "body unchanged");
    assert!(dead[1].1["x-chime-error"].contains("missing field"), "{:?}", dead[1].1);
    for (_, h) in &dead {
        assert!(h.contains_key("x-chime-failed-at") && h.contains_key("x-chime-worker"), "{h:?}");
    }
    assert_eq!(ledger.total(), 0);
    worker.stop().await;
    let _ = conn.close(200, "".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_errors_die_at_once_while_panics_and_timeouts_retry_then_die() {
    let env = TestEnv::new("failing");
    let fast = "max_attempts = 2\nbackoff = { initial = \"1s\", factor = 1.0, max = \"1s\" }\n";
    let jobs = format!(
        "[[jobs]]\nname = \"perm\"\nhandler = \"perm\"\n{fast}\
         [[jobs]]\nname = \"boom\"\nhandler = \"boom\"\n{fast}\
         [[jobs]]\nname = \"slow\"\nhandler = \"slow\"\ntimeout = \"1s\"\n{fast}"
    );
    let config = env.config("quorum", "", "", &jobs);
    let calls = Ledger::default();
    let mut reg = Registry::new();
    let c = calls.clone();
    reg.register(
        "perm",
        raw_handler_fn(move |_, _| {
            c.record(1);
            async { Err(JobError::permanent("bad input")) }
        }),
    );
    let c = calls.clone();
    reg.register(
        "boom",
        raw_handler_fn(move |_, _| {
            c.record(2);
            async { panic!("handler exploded") }
        }),
    );
    let c = calls.clone();
    reg.register(
        "slow",
        raw_handler_fn(move |_, _| {
            c.record(3);
            async {
                tokio::time::sleep(Duration::from_secs(600)).await;
                Ok(())
            }
        }),
    );
    let worker = Running::start(config.clone(), reg, 4).await;
    let client = chime_producer::EnqueueClient::connect(config).await.unwrap();
    for job in ["perm", "boom", "slow"] {
        client.enqueue(chime_producer::EnqueueRequest::new(job)).await.unwrap();
    }
    let w = &worker;
    wait_until("three dead letters", Duration::from_secs(30), || async { w.dead_lettered() == 3 }).await;
    let mut dead = drain_dlq(&env.names().dlq("default"), 3).await;
    dead.sort_by(|a, b| a.1["x-chime-reason"].cmp(&b.1["x-chime-reason"]));
    let got: Vec<(&str, &str)> =
        dead.iter().map(|(_, h)| (h["x-chime-reason"].as_str(), h["x-chime-attempts"].as_str())).collect();
    assert_eq!(got, [("panic", "2"), ("permanent", "1"), ("timeout", "2")]);
    assert!(dead[0].1["x-chime-error"].contains("handler exploded"));
    assert!(dead[1].1["x-chime-error"].contains("bad input"));
    assert_eq!(
        (calls.get(1), calls.get(2), calls.get(3)),
        (1, 2, 2),
        "permanent once; panic and timeout twice"
    );
    assert_eq!(Stats::get(&worker.stats.retried), 2);
    assert!(worker.health.ready(), "worker still ready after a panic");
    worker.stop().await;
}
