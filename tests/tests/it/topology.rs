//! Declaration is idempotent; a mismatching existing queue is named with its argument.

use chime_shared::topology::{self, TopologyError};
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};

use crate::common::*;

#[tokio::test]
async fn declaring_twice_is_fine_and_a_mismatch_names_queue_and_argument() {
    let env = TestEnv::new("topo");
    let conn = connect_amqp().await;
    let quorum = env.config("quorum", "", "", "");
    topology::declare(&conn, &quorum, &["default".into()]).await.unwrap();
    topology::declare(&conn, &quorum, &["default".into()]).await.unwrap();

    // Only the delivery limit differs: the error names exactly that argument.
    let mut limit = quorum.clone().into_config();
    limit.amqp.delivery_limit = 7;
    let err = topology::declare(&conn, &limit, &["default".into()]).await.unwrap_err();
    match &err {
        TopologyError::Inequivalent { queue, argument, .. } => {
            assert_eq!(queue, &env.names().work_queue("default"));
            assert_eq!(argument, "x-delivery-limit");
        }
        other => panic!("expected Inequivalent, got {other}"),
    }
    let text = err.to_string();
    assert!(text.contains(&env.names().work_queue("default")) && text.contains("x-delivery-limit"), "{text}");
    assert!(!err.is_transient());

    // Classic against quorum: RabbitMQ reports the first differing argument it checks.
    let classic = env.config("classic", "", "", "");
    let err = topology::declare(&conn, &classic, &["default".into()]).await.unwrap_err();
    assert!(
        matches!(&err, TopologyError::Inequivalent { argument, .. } if argument.starts_with("x-")),
        "{err}"
    );

    // A queue someone declared by hand without our dead-letter exchange.
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    let mut env2 = TestEnv::new("topo2");
    env2.queues = vec!["other".into()];
    let name = env2.names().work_queue("other");
    ch.queue_declare(name.as_str().into(), QueueDeclareOptions { durable: true, ..Default::default() }, args)
        .await
        .unwrap();
    let cfg2 = env2.config("quorum", "", "", "");
    let err = topology::declare(&conn, &cfg2, &["other".into()]).await.unwrap_err();
    assert!(
        matches!(&err, TopologyError::Inequivalent { argument, .. } if argument.starts_with("x-")),
        "{err}"
    );

    // Every declaration is sent at once: a refusal late in the list (the DLQ, declared by
    // hand as a classic queue) is named, not an earlier queue nor "channel closed".
    let env3 = TestEnv::new("topo3");
    let dlq = env3.names().dlq("default");
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("classic".into()));
    ch.queue_declare(dlq.as_str().into(), QueueDeclareOptions { durable: true, ..Default::default() }, args)
        .await
        .unwrap();
    let err =
        topology::declare(&conn, &env3.config("quorum", "", "", ""), &["default".into()]).await.unwrap_err();
    match &err {
        TopologyError::Inequivalent { queue, argument, .. } => {
            assert_eq!((queue.as_str(), argument.as_str()), (dlq.as_str(), "x-queue-type"), "{err}");
        }
        other => panic!("expected Inequivalent, got {other}"),
    }
    let _ = conn.close(200, "".into()).await;
}

/// `amqp.quorum_replicas` caps how many nodes hold each of the prefix's quorum queues (the
/// broker's default is every node). The broker checks it like any argument: the same prefix
/// declared with another value fails, naming the queue and `x-quorum-initial-group-size`.
#[tokio::test]
async fn quorum_replicas_caps_the_copies_of_each_queue_on_a_cluster() {
    let cluster = PrivateCluster::start(2).await;
    let conn = connect_amqp_to(&cluster.urls()[0]).await;
    let mut capped_env = TestEnv::new("topo-replicas");
    capped_env.amqp_url = cluster.urls()[0].clone();
    let mut capped = capped_env.config("quorum", "", "", "").into_config();
    capped.amqp.quorum_replicas = Some(1);
    topology::declare(&conn, &capped, &["default".into()]).await.unwrap();
    let mut every_env = TestEnv::new("topo-every");
    every_env.amqp_url = cluster.urls()[0].clone();
    topology::declare(&conn, &every_env.config("quorum", "", "", ""), &["default".into()]).await.unwrap();
    let out = cluster.nodes[0].ctl(&["list_queues", "-q", "--no-table-headers", "name", "members"]);
    let members = |queue: &str| {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(queue))
            .map(|l| l.matches("@localhost").count())
            .unwrap_or_else(|| panic!("{queue} not listed:\n{out}"))
    };
    let (c, e) = (capped_env.names(), every_env.names());
    assert_eq!(members(&c.work_queue("default")), 1, "{out}");
    assert_eq!(members(&c.dlq("default")), 1, "{out}");
    assert_eq!(members(&c.unroutable_queue()), 1, "{out}");
    assert_eq!(members(&e.work_queue("default")), 2, "{out}");
    // The capped prefix declared without the cap: refused, by name.
    let err = topology::declare(&conn, &capped_env.config("quorum", "", "", ""), &["default".into()])
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TopologyError::Inequivalent { argument, .. } if argument == "x-quorum-initial-group-size"),
        "{err}"
    );
    let _ = conn.close(200, "".into()).await;
}
