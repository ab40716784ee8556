//! Names and declaration of every exchange and queue. No queue or exchange name is spelled
//! anywhere else in chime.
//!
//! - `<p>.work` (direct) → `<p>.q.<queue>`, routing key `<queue>`.
//! - `<p>.dead` (direct) → `<p>.dlq.<queue>`, routing key `<queue>`.
//! - the shared delay chain `chime-delay.<type>.27` … `.0` → `chime-delay.deliver` →
//!   `<p>.q.<queue>`, unroutable ones → `<p>.unroutable` (see `delay` and `names`).
//!
//! Work queues dead-letter to `<p>.dead` as a safety net for broker-side rejections
//! (quorum `x-delivery-limit`, always explicit and positive). Declaring is idempotent; a
//! queue that exists with other arguments yields [`TopologyError::Inequivalent`], naming
//! the queue and the argument instead of a bare `PRECONDITION_FAILED`.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Connection, ExchangeKind};

use crate::config::{Config, QueueType};

pub use crate::names::Names;

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error(
        "queue {queue} already exists with a different {argument}: {detail}. Delete the queue \
         (after draining it) or align the config (amqp.queue_type, amqp.delivery_limit) with it"
    )]
    Inequivalent { queue: String, argument: String, detail: String },
    #[error("declaring {what} failed: {source}")]
    Amqp { what: String, source: Box<lapin::Error> },
}

impl TopologyError {
    /// A broken connection is worth retrying; a mismatch is not.
    pub fn is_transient(&self) -> bool {
        matches!(self, TopologyError::Amqp { .. })
    }
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Arguments of a work queue.
pub fn work_queue_args(names: &Names, queue_type: QueueType, delivery_limit: u32) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(ShortString::from("x-queue-type"), long(queue_type.as_str()));
    t.insert(ShortString::from("x-dead-letter-exchange"), long(&names.dead_exchange()));
    match queue_type {
        QueueType::Quorum => {
            t.insert(
                ShortString::from("x-delivery-limit"),
                AMQPValue::LongLongInt(i64::from(delivery_limit)),
            );
            // At-least-once dead lettering: broker-side dead letters are never lost in transit.
            t.insert(ShortString::from("x-dead-letter-strategy"), long("at-least-once"));
            t.insert(ShortString::from("x-overflow"), long("reject-publish"));
        }
        QueueType::Classic => {
            // CQv2: the default from 3.13, opt-in (and faster) on 3.10; accepted by 4.3.
            t.insert(ShortString::from("x-queue-version"), AMQPValue::LongLongInt(2));
        }
    }
    t
}

/// Delivery limit of quorum DLQs: RabbitMQ 4.x gives every quorum queue a default limit of
/// 20, and a DLQ has nowhere to dead-letter to, so a message returned 20 times (say, by
/// crashed operator sessions) would be dropped. This explicit, very high limit prevents that.
pub const DLQ_DELIVERY_LIMIT: i64 = 1_000_000;

/// Arguments of a dead-letter queue: nothing expires, nothing dead-letters onward.
pub fn dlq_args(queue_type: QueueType) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(ShortString::from("x-queue-type"), long(queue_type.as_str()));
    match queue_type {
        QueueType::Quorum => {
            t.insert(ShortString::from("x-delivery-limit"), AMQPValue::LongLongInt(DLQ_DELIVERY_LIMIT));
        }
        QueueType::Classic => {
            t.insert(ShortString::from("x-queue-version"), AMQPValue::LongLongInt(2));
        }
    }
    t
}

/// Declares exchanges, work queues and DLQs for `queues`, on a throwaway channel (a 406
/// closes the channel it happens on).
pub async fn declare(conn: &Connection, config: &Config, queues: &[String]) -> Result<(), TopologyError> {
    let names = Names::new(&config.prefix);
    let amqp = |what: String| {
        move |source: lapin::Error| TopologyError::Amqp { what: what.clone(), source: Box::new(source) }
    };
    let ch = conn.create_channel().await.map_err(amqp("a channel".into()))?;
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    for ex in [names.work_exchange(), names.dead_exchange()] {
        ch.exchange_declare(ex.as_str().into(), ExchangeKind::Direct, durable, FieldTable::default())
            .await
            .map_err(|e| classify(&ex, e))?;
    }
    crate::delay::declare_chain(&ch, config.amqp.queue_type).await.map_err(|(what, e)| classify(&what, e))?;
    crate::delay::declare_unroutable(&ch, &names, config.amqp.queue_type)
        .await
        .map_err(|e| classify(&names.unroutable_queue(), e))?;
    let qopts = QueueDeclareOptions { durable: true, ..Default::default() };
    for q in queues {
        let wq = names.work_queue(q);
        let args = work_queue_args(&names, config.amqp.queue_type, config.amqp.delivery_limit);
        ch.queue_declare(wq.as_str().into(), qopts, args).await.map_err(|e| classify(&wq, e))?;
        ch.queue_bind(
            wq.as_str().into(),
            names.work_exchange().into(),
            q.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(amqp(format!("binding of {wq}")))?;
        crate::delay::bind_queue(&ch, &names, q).await.map_err(amqp(format!("delay binding of {wq}")))?;
        let dlq = names.dlq(q);
        ch.queue_declare(dlq.as_str().into(), qopts, dlq_args(config.amqp.queue_type))
            .await
            .map_err(|e| classify(&dlq, e))?;
        ch.queue_bind(
            dlq.as_str().into(),
            names.dead_exchange().into(),
            q.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(amqp(format!("binding of {dlq}")))?;
    }
    let _ = ch.close(200, "declared".into()).await;
    Ok(())
}

/// Turns `PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' …` into a
/// named error.
fn classify(entity: &str, err: lapin::Error) -> TopologyError {
    if let lapin::ErrorKind::ProtocolError(amqp) = err.kind() {
        let text = amqp.get_message().as_str();
        if let Some(rest) = text.split("inequivalent arg '").nth(1) {
            let argument = rest.split('\'').next().unwrap_or("argument").to_string();
            let detail = text.split(": ").skip(1).collect::<Vec<_>>().join(": ");
            return TopologyError::Inequivalent {
                queue: entity.to_string(),
                argument,
                detail: if detail.is_empty() { text.to_string() } else { detail },
            };
        }
    }
    TopologyError::Amqp { what: entity.to_string(), source: Box::new(err) }
}

/// Ready-message and consumer counts of a queue, by passive declare (no plugin needed).
/// Uses its own channel because a missing queue closes the channel with 404.
pub async fn depth(conn: &Connection, queue: &str) -> Result<(u32, u32), lapin::Error> {
    let ch = conn.create_channel().await?;
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions { passive: true, ..Default::default() },
            FieldTable::default(),
        )
        .await;
    let _ = ch.close(200, "depth".into()).await;
    let q = q?;
    Ok((q.message_count(), q.consumer_count()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quorum_work_queues_never_use_minus_one() {
        let t = work_queue_args(&Names::new("c"), QueueType::Quorum, 50);
        assert_eq!(t.inner().get("x-delivery-limit"), Some(&AMQPValue::LongLongInt(50)));
    }
}
