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

use lapin::options::{ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ExchangeKind};

use crate::config::{AmqpConfig, Config};
use crate::delay::{self, LEVELS};
use crate::names::QueueType;
use crate::names::{self, DELAY_DELIVER, DELAY_ORPHANS, DELAY_ORPHANS_EXCHANGE, DELAY_UNROUTABLE};

pub use crate::names::Names;

/// Why declaring the topology failed.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// A queue exists with arguments chime would declare differently.
    #[error(
        "queue {queue} already exists with a different {argument}: {detail}. Delete the queue \
         (after draining it) or align the config (amqp.queue_type, amqp.delivery_limit) with it"
    )]
    Inequivalent {
        /// Full queue name.
        queue: String,
        /// The argument that differs (`x-queue-type`, …).
        argument: String,
        /// The broker's message.
        detail: String,
    },
    /// Any other broker error while declaring.
    #[error("declaring {what} failed: {source}")]
    Amqp {
        /// What was being declared.
        what: String,
        /// The broker's error.
        source: Box<lapin::Error>,
    },
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

/// `x-quorum-initial-group-size` of a quorum queue when `amqp.quorum_replicas` is set: the
/// broker otherwise replicates a new quorum queue to every node of the cluster.
fn replicas(t: &mut FieldTable, replicas: Option<u32>) {
    if let Some(n) = replicas {
        t.insert(ShortString::from("x-quorum-initial-group-size"), AMQPValue::LongLongInt(i64::from(n)));
    }
}

/// Arguments of a work queue.
pub fn work_queue_args(names: &Names, amqp: &AmqpConfig) -> FieldTable {
    let (queue_type, delivery_limit) = (amqp.queue_type, amqp.delivery_limit);
    let mut t = FieldTable::default();
    t.insert(ShortString::from("x-queue-type"), long(queue_type.as_str()));
    t.insert(ShortString::from("x-dead-letter-exchange"), long(&names.dead_exchange()));
    match queue_type {
        QueueType::Quorum => {
            replicas(&mut t, amqp.quorum_replicas);
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
pub fn dlq_args(amqp: &AmqpConfig) -> FieldTable {
    let queue_type = amqp.queue_type;
    let mut t = FieldTable::default();
    t.insert(ShortString::from("x-queue-type"), long(queue_type.as_str()));
    match queue_type {
        QueueType::Quorum => {
            replicas(&mut t, amqp.quorum_replicas);
            t.insert(ShortString::from("x-delivery-limit"), AMQPValue::LongLongInt(DLQ_DELIVERY_LIMIT));
        }
        QueueType::Classic => {
            t.insert(ShortString::from("x-queue-version"), AMQPValue::LongLongInt(2));
        }
    }
    t
}

/// One declaration or binding of a pipelined batch: what it names, and the broker's reply.
type Step<'a> = std::pin::Pin<Box<dyn Future<Output = Result<(), (String, lapin::Error)>> + Send + 'a>>;

fn step<'a, T>(what: String, reply: impl Future<Output = lapin::Result<T>> + Send + 'a) -> Step<'a> {
    Box::pin(async move { reply.await.map(|_| ()).map_err(|e| (what, e)) })
}

/// Sends every step on one channel without waiting for each reply (each is sent when first
/// polled, here in order), then waits for the replies in order: one round trip instead of one
/// per step. The broker carries them out in order; a refusal closes the channel and every
/// later step fails with that same error, so the first failure in order names what was
/// refused.
async fn pipelined(mut steps: Vec<Step<'_>>) -> Result<(), (String, lapin::Error)> {
    let early = crate::amqp::poll_each_once(&mut steps, || ()).await;
    for (s, slot) in steps.into_iter().zip(early) {
        match slot {
            Some(r) => r?,
            None => s.await?,
        }
    }
    Ok(())
}

/// Declares exchanges, work queues and DLQs for `queues`, on a throwaway channel (a 406
/// closes the channel it happens on), every declaration and binding sent at once.
pub async fn declare(conn: &Connection, config: &Config, queues: &[String]) -> Result<(), TopologyError> {
    let names = Names::new(&config.prefix);
    let ch = conn
        .create_channel()
        .await
        .map_err(|source| TopologyError::Amqp { what: "a channel".into(), source: Box::new(source) })?;
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    let mut steps = Vec::new();
    for ex in [names.work_exchange(), names.dead_exchange()] {
        let declared =
            ch.exchange_declare(ex.as_str().into(), ExchangeKind::Direct, durable, FieldTable::default());
        steps.push(step(ex, declared));
    }
    steps.extend(chain_steps(&ch, config.amqp.queue_type));
    steps.extend(unroutable_steps(&ch, &names, &config.amqp));
    let qopts = QueueDeclareOptions { durable: true, ..Default::default() };
    for q in queues {
        // The queue itself, and its priority levels' queues when it has them.
        for (route, _) in config.routes(q) {
            let wq = names.work_queue(&route);
            let mut args = work_queue_args(&names, &config.amqp);
            if &route != q {
                // Broker-side dead letters keep their routing key: a level's go to its queue's DLQ.
                args.insert(ShortString::from("x-dead-letter-routing-key"), long(q));
            }
            steps.push(step(wq.clone(), ch.queue_declare(wq.as_str().into(), qopts, args)));
            let bound = ch.queue_bind(
                wq.as_str().into(),
                names.work_exchange().into(),
                route.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            );
            steps.push(step(format!("binding of {wq}"), bound));
            steps.push(step(format!("delay binding of {wq}"), bind_queue(&ch, &names, &route)));
        }
        let dlq = names.dlq(q);
        steps.push(step(dlq.clone(), ch.queue_declare(dlq.as_str().into(), qopts, dlq_args(&config.amqp))));
        let bound = ch.queue_bind(
            dlq.as_str().into(),
            names.dead_exchange().into(),
            q.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        );
        steps.push(step(format!("binding of {dlq}"), bound));
    }
    let done = pipelined(steps).await.map_err(|(what, e)| classify(&what, e));
    let _ = ch.close(200, "declared".into()).await;
    done
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

/// The shared chain of `queue_type` — levels, delivery and unroutable exchanges, the orphans
/// queue — to declare (idempotent: every prefix declares the same arguments), in order.
fn chain_steps(ch: &Channel, queue_type: QueueType) -> Vec<Step<'_>> {
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    let queue_opts = QueueDeclareOptions { durable: true, ..Default::default() };
    let mut steps = Vec::new();
    let mut orphan_args = FieldTable::default();
    orphan_args.insert(ShortString::from("x-queue-type"), long(QueueType::Quorum.as_str()));
    steps.push(step(DELAY_ORPHANS.into(), ch.queue_declare(DELAY_ORPHANS.into(), queue_opts, orphan_args)));
    let declared = ch.exchange_declare(
        DELAY_ORPHANS_EXCHANGE.into(),
        ExchangeKind::Fanout,
        durable,
        FieldTable::default(),
    );
    steps.push(step(DELAY_ORPHANS_EXCHANGE.into(), declared));
    let bound = ch.queue_bind(
        DELAY_ORPHANS.into(),
        DELAY_ORPHANS_EXCHANGE.into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    );
    steps.push(step(DELAY_ORPHANS.into(), bound));
    let mut unroutable_args = FieldTable::default();
    unroutable_args.insert(ShortString::from("alternate-exchange"), long(DELAY_ORPHANS_EXCHANGE));
    let declared =
        ch.exchange_declare(DELAY_UNROUTABLE.into(), ExchangeKind::Topic, durable, unroutable_args);
    steps.push(step(DELAY_UNROUTABLE.into(), declared));
    let mut deliver_args = FieldTable::default();
    deliver_args.insert(ShortString::from("alternate-exchange"), long(DELAY_UNROUTABLE));
    let declared = ch.exchange_declare(DELAY_DELIVER.into(), ExchangeKind::Topic, durable, deliver_args);
    steps.push(step(DELAY_DELIVER.into(), declared));
    for level in 0..LEVELS {
        let ex = names::delay_level(queue_type, level);
        let declared =
            ch.exchange_declare(ex.as_str().into(), ExchangeKind::Topic, durable, FieldTable::default());
        steps.push(step(ex, declared));
    }
    for level in 0..LEVELS {
        let ex = names::delay_level(queue_type, level);
        let next =
            if level == 0 { DELAY_DELIVER.to_string() } else { names::delay_level(queue_type, level - 1) };
        let mut args = FieldTable::default();
        args.insert(ShortString::from("x-queue-type"), long(queue_type.as_str()));
        args.insert(ShortString::from("x-message-ttl"), AMQPValue::LongLongInt((1i64 << level) * 1000));
        args.insert(ShortString::from("x-dead-letter-exchange"), long(&next));
        if queue_type == QueueType::Quorum {
            args.insert(ShortString::from("x-dead-letter-strategy"), long("at-least-once"));
            args.insert(ShortString::from("x-overflow"), long("reject-publish"));
        } else {
            args.insert(ShortString::from("x-queue-version"), AMQPValue::LongLongInt(2));
        }
        // The level's queue is named as its exchange.
        steps.push(step(ex.clone(), ch.queue_declare(ex.as_str().into(), queue_opts, args)));
        let higher = delay::stars(LEVELS - 1 - level);
        let bound = ch.queue_bind(
            ex.as_str().into(),
            ex.as_str().into(),
            format!("{higher}1.#").into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        );
        steps.push(step(ex.clone(), bound));
        let bound = ch.exchange_bind(
            next.as_str().into(),
            ex.as_str().into(),
            format!("{higher}0.#").into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        );
        steps.push(step(ex, bound));
    }
    steps
}

/// Binds work queue `<p>.q.<queue>` to the delivery exchange (sent when first polled).
pub fn bind_queue<'a>(
    ch: &'a Channel,
    names: &Names,
    queue: &str,
) -> impl Future<Output = Result<(), lapin::Error>> + Send + use<'a> {
    let key = format!("{}{}.{}", delay::stars(LEVELS), names::word(names.prefix()), names::word(queue));
    ch.queue_bind(
        names.work_queue(queue).into(),
        DELAY_DELIVER.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
}

/// `<p>.unroutable` (a DLQ: nothing expires), bound to the unroutable exchange for every
/// queue of the prefix and to `<p>.dead` under [`names::UNROUTABLE_SOURCE`], to declare in
/// order.
fn unroutable_steps<'a>(ch: &'a Channel, names: &Names, amqp: &AmqpConfig) -> Vec<Step<'a>> {
    let q = names.unroutable_queue();
    let declared = ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions { durable: true, ..Default::default() },
        dlq_args(amqp),
    );
    let key = format!("{}{}.*", delay::stars(LEVELS), names::word(names.prefix()));
    let from_chain = ch.queue_bind(
        q.as_str().into(),
        DELAY_UNROUTABLE.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    );
    let from_dead = ch.queue_bind(
        q.as_str().into(),
        names.dead_exchange().as_str().into(),
        names::UNROUTABLE_SOURCE.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    );
    vec![step(q.clone(), declared), step(q.clone(), from_chain), step(q, from_dead)]
}

/// How long a worker's own queue outlives its consumer (the worker gone, or reconnecting).
pub const WORKER_QUEUE_EXPIRES: std::time::Duration = std::time::Duration::from_secs(300);

/// Declares a worker's own queue (`<prefix>.q.@<worker>`, where its broadcast copies are
/// delivered) and binds it to the work exchange and the delay chain (a retried copy comes back
/// to it). Classic and unreplicated whatever `queue_type` is: it serves one process; it
/// expires [`WORKER_QUEUE_EXPIRES`] after its worker stopped consuming it (a copy published to
/// it meanwhile is for a worker that is gone).
pub async fn declare_worker_queue(
    ch: &Channel,
    names: &Names,
    worker: &str,
) -> Result<String, TopologyError> {
    let route = crate::envelope::worker_route(worker);
    let q = names.work_queue(&route);
    let mut args = FieldTable::default();
    args.insert(ShortString::from("x-queue-type"), long("classic"));
    args.insert(ShortString::from("x-queue-version"), AMQPValue::LongLongInt(2));
    args.insert(
        ShortString::from("x-expires"),
        AMQPValue::LongLongInt(i64::try_from(WORKER_QUEUE_EXPIRES.as_millis()).unwrap_or(i64::MAX)),
    );
    let amqp = |what: String| {
        move |source: lapin::Error| TopologyError::Amqp { what: what.clone(), source: Box::new(source) }
    };
    ch.queue_declare(q.as_str().into(), QueueDeclareOptions { durable: true, ..Default::default() }, args)
        .await
        .map_err(|e| classify(&q, e))?;
    ch.queue_bind(
        q.as_str().into(),
        names.work_exchange().into(),
        route.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(amqp(format!("binding of {q}")))?;
    bind_queue(ch, names, &route).await.map_err(amqp(format!("delay binding of {q}")))?;
    Ok(route)
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

/// What one prefix's processes need on a RabbitMQ virtual host, as regular expressions over
/// resource names (RabbitMQ's `configure`, `write`, `read`), and the topic permissions that
/// keep the shared delay chain from reaching another prefix: on every exchange of the chain, a
/// user may publish only routing keys that end in its own prefix, and bind only the chain's
/// own keys and its own prefix's. Never the default exchange (it reaches every queue of the
/// virtual host by name). See SECURITY.md ("Several prefixes on one broker").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permissions {
    /// `configure`, `write` and `read` (one pattern serves all three).
    pub resources: String,
    /// `(exchange, write, read)` per exchange of the delay chain.
    pub topics: Vec<(String, String, String)>,
}

/// The [`Permissions`] of `prefix` (letters, digits, `-`, `_`: nothing to escape).
pub fn permissions(prefix: &str) -> Permissions {
    let own = format!(r"{prefix}\.(work|dead|unroutable|q\..+|dlq\..+)");
    let resources = format!(r"^({own}|chime-delay\..+)$");
    let levels = crate::delay::LEVELS;
    let write = format!(r"^([01]\.){{{levels}}}{}\.[^.]+$", names::word(prefix));
    let read = format!(r"^((\*\.)*[01]\.#|(\*\.){{{levels}}}{}\.([^.]+|\*))$", names::word(prefix));
    let mut exchanges: Vec<String> = [QueueType::Quorum, QueueType::Classic]
        .into_iter()
        .flat_map(|t| (0..levels).map(move |l| names::delay_level(t, l)))
        .collect();
    exchanges.extend([DELAY_DELIVER.to_string(), DELAY_UNROUTABLE.to_string()]);
    let topics = exchanges.into_iter().map(|x| (x, write.clone(), read.clone())).collect();
    Permissions { resources, topics }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quorum_work_queues_never_use_minus_one() {
        let t = work_queue_args(&Names::new("c"), &AmqpConfig::default());
        assert_eq!(t.inner().get("x-delivery-limit"), Some(&AMQPValue::LongLongInt(50)));
        assert!(t.inner().get("x-quorum-initial-group-size").is_none(), "unset: the broker's default");
    }

    #[test]
    fn quorum_replicas_sets_the_initial_group_size_of_work_queues_and_dlqs() {
        let amqp = AmqpConfig { quorum_replicas: Some(3), ..AmqpConfig::default() };
        for t in [work_queue_args(&Names::new("c"), &amqp), dlq_args(&amqp)] {
            assert_eq!(t.inner().get("x-quorum-initial-group-size"), Some(&AMQPValue::LongLongInt(3)));
        }
        let classic = AmqpConfig { queue_type: QueueType::Classic, ..amqp };
        assert!(
            work_queue_args(&Names::new("c"), &classic).inner().get("x-quorum-initial-group-size").is_none()
        );
    }
}
