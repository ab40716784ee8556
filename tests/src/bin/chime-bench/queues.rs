//! Opt-in `queue-types`: why classic queues drain slower than quorum queues here. Raw lapin
//! alone (no Redis, no chime): the same persistent messages published into, then drained from,
//! a quorum queue and classic queues of both index versions, persistent and transient, acked
//! one by one or `multiple` every 32; the broker's CPU per message in each phase.

use crate::Ctx;
use crate::fixtures::*;
use crate::measure::*;
use crate::publish::{Amount, FASTEST, Target, bare_props, raw_publish};
use chime_tests::*;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection};
use std::time::Instant;

/// One queue shape and how it is drained.
struct Variant {
    what: &'static str,
    /// `x-queue-type` and, for classic queues, `x-queue-version`.
    queue_type: &'static str,
    version: Option<i64>,
    persistent: bool,
    /// Acks sent as one `multiple` ack per this many deliveries (1: one ack per message).
    ack_every: u64,
}

const VARIANTS: [Variant; 7] = [
    Variant {
        what: "quorum, persistent, ack each",
        queue_type: "quorum",
        version: None,
        persistent: true,
        ack_every: 1,
    },
    Variant {
        what: "quorum, persistent, ack 32 at once",
        queue_type: "quorum",
        version: None,
        persistent: true,
        ack_every: 32,
    },
    Variant {
        what: "classic v2, persistent, ack each",
        queue_type: "classic",
        version: Some(2),
        persistent: true,
        ack_every: 1,
    },
    Variant {
        what: "classic v2, persistent, ack 32 at once",
        queue_type: "classic",
        version: Some(2),
        persistent: true,
        ack_every: 32,
    },
    Variant {
        what: "classic v2, transient, ack each",
        queue_type: "classic",
        version: Some(2),
        persistent: false,
        ack_every: 1,
    },
    Variant {
        what: "classic v1, persistent, ack each",
        queue_type: "classic",
        version: Some(1),
        persistent: true,
        ack_every: 1,
    },
    Variant {
        what: "classic v1, transient, ack each",
        queue_type: "classic",
        version: Some(1),
        persistent: false,
        ack_every: 1,
    },
];

/// Drains `n` messages from `queue` with 64 in flight, acking as `ack_every` says; msg/s.
async fn drain(conn: &Connection, queue: &str, n: u64, ack_every: u64) -> f64 {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(64, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(queue.into(), "qt".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let start = Instant::now();
    let mut got = 0u64;
    while got < n {
        let Some(Ok(d)) = consumer.next().await else { panic!("consumer ended after {got} of {n}") };
        got += 1;
        if got.is_multiple_of(ack_every) || got == n {
            d.acker.ack(BasicAckOptions { multiple: ack_every > 1 }).await.unwrap();
        }
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let _ = ch.close(200, "".into()).await;
    rate
}

pub async fn scenario(c: &Ctx) {
    let conn = &c.conn;
    let n = 10_000 * c.o.seconds;
    let env = TestEnv::new("bench-qt");
    let body = envelopes(1, false)[0].envelope.encode();
    let ch = conn.create_channel().await.unwrap();
    // [publish rate, publish broker µs, drain rate, drain broker µs] per run.
    let mut figures: Vec<Vec<[f64; 4]>> = VARIANTS.iter().map(|_| Vec::new()).collect();
    for r in 0..c.o.runs {
        for k in 0..VARIANTS.len() {
            let i = (k + r) % VARIANTS.len();
            let v = &VARIANTS[i];
            progress(&format!("queue-types: {}, run {}/{}", v.what, r + 1, c.o.runs));
            let queue = format!("{}.qt.{i}", env.prefix);
            let mut args = FieldTable::default();
            args.insert(ShortString::from("x-queue-type"), AMQPValue::LongString(v.queue_type.into()));
            if let Some(version) = v.version {
                args.insert(ShortString::from("x-queue-version"), AMQPValue::LongLongInt(version));
            }
            let durable = QueueDeclareOptions { durable: true, ..Default::default() };
            ch.queue_declare(queue.as_str().into(), durable, args).await.unwrap();
            let props = if v.persistent {
                bare_props()
            } else {
                BasicProperties::default().with_delivery_mode(1).with_content_type("application/json".into())
            };
            let t = Target { exchange: "", routing_key: &queue, mandatory: false, props, body: &body };
            let cpu = CpuWindow::start(Vec::new());
            let (published, _) = raw_publish(conn, &t, FASTEST, Amount::Count(n as usize)).await;
            let publish_broker = cpu.per_message(n)[0];
            let cpu = CpuWindow::start(Vec::new());
            let drained = drain(conn, &queue, n, v.ack_every).await;
            let drain_broker = cpu.per_message(n)[0];
            ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
            figures[i].push([published, publish_broker, drained, drain_broker]);
        }
    }
    progress("");
    let base = median(figures[0].iter().map(|f| f[2]).collect());
    for (v, f) in VARIANTS.iter().zip(&figures) {
        let m = |j: usize| median(f.iter().map(|x| x[j]).collect());
        println!(
            "queues   {:<40} publish {:>6.0} msg/s, broker {:>3.0} µs/msg   drain {:>6.0} msg/s ({:.2}x quorum), broker {:>3.0} µs/msg",
            v.what,
            m(0),
            m(1),
            m(2),
            m(2) / base,
            m(3)
        );
    }
}
