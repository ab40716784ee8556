//! Publishing: each confirm (or returned message) reaches the publish it belongs to, however
//! many tasks share the channel, and grouped publishes keep their order.

use chime_producer::{EnqueueClient, EnqueueError, EnqueueRequest};
use chime_shared::amqp::{self, AmqpError, Outgoing};
use chime_shared::topology;
use futures_util::StreamExt;
use lapin::BasicProperties;
use lapin::options::{BasicConsumeOptions, ConfirmSelectOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;

/// Two ways a returned (unroutable) message can reach the wrong publish on a shared channel:
/// lapin numbers a publish before it queues its frames (two threads can queue against their
/// numbers), and it hands the return of a `multiple` ack to whichever publish it resolves
/// first. Either way an unroutable job would count as confirmed. The client lends each publish
/// a channel of its own and matches returns by content: many tasks, one client, jobs to a
/// queue that was deleted under it among jobs to a live one; every one gets its own verdict.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_enqueues_each_get_their_own_verdict_when_some_are_unroutable() {
    let mut env = TestEnv::new("pub-order");
    env.queues = vec!["default".into(), "gone".into()];
    let jobs = "[[jobs]]\nname = \"live\"\nhandler = \"noop\"\n[[jobs]]\nname = \"lost\"\nhandler = \"noop\"\nqueue = \"gone\"\n";
    let config = env.config("quorum", "", "", jobs);
    let client = Arc::new(EnqueueClient::connect(config).await.unwrap());
    let conn = connect_amqp().await;
    // The queue disappears after the client declared it: its jobs are now unroutable.
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete(env.names().work_queue("gone").as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    const TASKS: usize = 8;
    const EACH: usize = 400;
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let (mut wrong, mut live) = (Vec::new(), 0usize);
            for i in 0..EACH {
                let routable = (t + i) % 3 != 0;
                let job = if routable { "live" } else { "lost" };
                let r = client
                    .enqueue(EnqueueRequest::new(job).payload(serde_json::json!({"t": t, "i": i})))
                    .await;
                match (routable, &r) {
                    (true, Ok(_)) => live += 1,
                    (false, Err(EnqueueError::Amqp(e))) if matches!(**e, AmqpError::Returned { .. }) => {}
                    _ => wrong.push(format!("task {t} job {i} ({job}): {r:?}")),
                }
            }
            (wrong, live)
        }));
    }
    let (mut wrong, mut live) = (Vec::new(), 0);
    for t in tasks {
        let (w, l) = t.await.unwrap();
        wrong.extend(w);
        live += l;
    }
    assert!(
        wrong.is_empty(),
        "{} of {} enqueues got another's verdict, e.g. {:?}",
        wrong.len(),
        TASKS * EACH,
        &wrong[..wrong.len().min(3)]
    );
    let depth = topology::depth(&conn, &env.names().work_queue("default")).await.unwrap();
    assert_eq!(depth.0 as usize, live, "every confirmed job is in its queue");

    // A batch: the first unroutable job is the batch's failure, everything before it confirmed.
    let mut reqs: Vec<EnqueueRequest> =
        (0..3000).map(|i| EnqueueRequest::new("live").key(format!("b{i}"))).collect();
    reqs[1777] = EnqueueRequest::new("lost").key("b1777");
    let report = client.enqueue_batch(&reqs).await.unwrap();
    assert_eq!(report.confirmed, 1777, "{report:?}");
    assert!(
        matches!(&report.error, Some(EnqueueError::Amqp(e)) if matches!(**e, AmqpError::Returned { .. })),
        "{report:?}"
    );
    let _ = conn.close(200, "".into()).await;
}

/// A group is queued in order: the messages arrive as they were handed over.
#[tokio::test]
async fn a_group_arrives_in_order() {
    let env = TestEnv::new("pub-group");
    let conn = connect_amqp().await;
    let config = env.config("quorum", "", "", "");
    topology::declare(&conn, &config, &["default".into()]).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let work = env.names().work_exchange();
    let bodies: Vec<Vec<u8>> = (0..1000).map(|i: u32| i.to_string().into_bytes()).collect();
    for chunk in bodies.chunks(amqp::PUBLISH_GROUP) {
        let group = chunk.iter().map(|b| Outgoing {
            exchange: &work,
            routing_key: "default",
            body: b,
            props: BasicProperties::default(),
        });
        for p in amqp::publish_group(&ch, group).await {
            amqp::Returns::default()
                .confirm(p.unwrap(), &work, "default", Duration::from_secs(30))
                .await
                .unwrap();
        }
    }
    let mut consumer = ch
        .basic_consume(
            env.names().work_queue("default").as_str().into(),
            "order".into(),
            BasicConsumeOptions { no_ack: true, ..Default::default() },
            FieldTable::default(),
        )
        .await
        .unwrap();
    for want in 0..1000u32 {
        let d = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .expect("a message within 30 s")
            .unwrap()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&d.data), want.to_string());
    }
    let _ = conn.close(200, "".into()).await;
}
