//! Plugin-free delayed delivery: binary TTL levels (the scheme of NServiceBus and kombu ≥ 5.5),
//! in one chain per virtual host that every prefix shares (see `names`).
//!
//! Level L (0 ≤ L < 28) is a topic exchange and a queue `chime-delay.<type>.L` whose
//! queue-level TTL is 2^L seconds and which dead-letters into level L−1 (level 0 into
//! `chime-delay.deliver`). A delayed message is published to the top level with the routing
//! key `b27.b26.….b0.<prefix>.<queue>` (the delay's bits, most significant first, then the
//! prefix and queue as one word each, dots spelled `~`). At each level a set bit routes the
//! message into that level's queue, where it waits 2^L s; a clear bit routes it straight on
//! through an exchange-to-exchange binding. After level 0 the delivery exchange routes it to
//! `<prefix>.q.<queue>` by the last two words.
//!
//! A message the delivery exchange cannot route (its queue was never declared, or was
//! deleted) goes to the delivery exchange's alternate exchange and from there to
//! `<prefix>.unroutable` — it never stays at the head of level 0, where (quorum queues
//! dead-letter at-least-once) it would hold back every delayed message behind it.
//!
//! Every message in one level queue has the same TTL, so expiry at the head is FIFO-safe (no
//! per-message TTLs mixed in one queue). Delays go from 0 to 2^28 − 1 s (8.5 years) at 1 s
//! granularity. Quorum level queues dead-letter at-least-once, so a delayed message is never
//! lost between levels; classic ones dead-letter at-most-once (lost only if an exchange of
//! the chain were deleted).

use lapin::options::{ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};
use std::time::Duration;

use crate::config::QueueType;
use crate::names::{self, DELAY_DELIVER, DELAY_ORPHANS, DELAY_ORPHANS_EXCHANGE, DELAY_UNROUTABLE, Names};

/// Number of levels: delays up to 2^28 − 1 seconds.
pub const LEVELS: u32 = 28;
/// Longest delay that can be expressed.
pub const MAX_DELAY: Duration = Duration::from_secs((1 << LEVELS) - 1);

/// Whole seconds of `delay`, rounded up (a delay is never shortened).
pub fn seconds(delay: Duration) -> u64 {
    delay.as_secs() + u64::from(delay.subsec_nanos() > 0)
}

/// Routing key for a delay of `secs` seconds to `queue` of `prefix`.
pub fn routing_key(secs: u64, prefix: &str, queue: &str) -> String {
    let mut key = String::with_capacity(2 * LEVELS as usize + prefix.len() + queue.len() + 1);
    for level in (0..LEVELS).rev() {
        key.push(if secs >> level & 1 == 1 { '1' } else { '0' });
        key.push('.');
    }
    key.push_str(&names::word(prefix));
    key.push('.');
    key.push_str(&names::word(queue));
    key
}

/// The level queue a freshly published delay of `secs` waits in first (its highest bit).
pub fn first_level(secs: u64) -> Option<u32> {
    (secs > 0).then(|| 63 - secs.leading_zeros())
}

/// Exchange and routing key that deliver to `queue` after `delay` (now, if it is zero).
pub fn target(names: &Names, queue_type: QueueType, queue: &str, delay: Duration) -> (String, String) {
    match seconds(delay) {
        0 => (names.work_exchange(), queue.to_string()),
        secs => (names::delay_level(queue_type, LEVELS - 1), routing_key(secs, names.prefix(), queue)),
    }
}

/// `n` topic wildcards for the higher levels' bits.
fn stars(n: u32) -> String {
    "*.".repeat(n as usize)
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Declares the shared chain of `queue_type` — levels, delivery and unroutable exchanges, the
/// orphans queue — (idempotent: every prefix declares the same arguments).
pub async fn declare_chain(ch: &Channel, queue_type: QueueType) -> Result<(), (String, lapin::Error)> {
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    let orphans = DELAY_ORPHANS.to_string();
    let mut orphan_args = FieldTable::default();
    orphan_args.insert(ShortString::from("x-queue-type"), long(QueueType::Quorum.as_str()));
    ch.queue_declare(
        orphans.as_str().into(),
        QueueDeclareOptions { durable: true, ..Default::default() },
        orphan_args,
    )
    .await
    .map_err(|e| (orphans.clone(), e))?;
    let mut unroutable_args = FieldTable::default();
    unroutable_args.insert(ShortString::from("alternate-exchange"), long(DELAY_ORPHANS_EXCHANGE));
    let orphans_x = DELAY_ORPHANS_EXCHANGE.to_string();
    ch.exchange_declare(orphans_x.as_str().into(), ExchangeKind::Fanout, durable, FieldTable::default())
        .await
        .map_err(|e| (orphans_x.clone(), e))?;
    ch.queue_bind(
        orphans.as_str().into(),
        orphans_x.as_str().into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| (orphans.clone(), e))?;
    ch.exchange_declare(DELAY_UNROUTABLE.into(), ExchangeKind::Topic, durable, unroutable_args)
        .await
        .map_err(|e| (DELAY_UNROUTABLE.to_string(), e))?;
    let mut deliver_args = FieldTable::default();
    deliver_args.insert(ShortString::from("alternate-exchange"), long(DELAY_UNROUTABLE));
    ch.exchange_declare(DELAY_DELIVER.into(), ExchangeKind::Topic, durable, deliver_args)
        .await
        .map_err(|e| (DELAY_DELIVER.to_string(), e))?;
    for level in 0..LEVELS {
        let ex = names::delay_level(queue_type, level);
        ch.exchange_declare(ex.as_str().into(), ExchangeKind::Topic, durable, FieldTable::default())
            .await
            .map_err(|e| (ex.clone(), e))?;
    }
    for level in 0..LEVELS {
        let ex = names::delay_level(queue_type, level);
        let next =
            if level == 0 { DELAY_DELIVER.to_string() } else { names::delay_level(queue_type, level - 1) };
        let q = ex.clone();
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
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions { durable: true, ..Default::default() },
            args,
        )
        .await
        .map_err(|e| (q.clone(), e))?;
        let higher = stars(LEVELS - 1 - level);
        ch.queue_bind(
            q.as_str().into(),
            ex.as_str().into(),
            format!("{higher}1.#").into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| (q.clone(), e))?;
        ch.exchange_bind(
            next.as_str().into(),
            ex.as_str().into(),
            format!("{higher}0.#").into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| (ex.clone(), e))?;
    }
    Ok(())
}

/// Binds work queue `<p>.q.<queue>` to the delivery exchange.
pub async fn bind_queue(ch: &Channel, names: &Names, queue: &str) -> Result<(), lapin::Error> {
    let key = format!("{}{}.{}", stars(LEVELS), names::word(names.prefix()), names::word(queue));
    ch.queue_bind(
        names.work_queue(queue).into(),
        DELAY_DELIVER.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
}

/// Declares `<p>.unroutable` (a DLQ: nothing expires) and binds it to the unroutable exchange
/// for every queue of the prefix.
pub async fn declare_unroutable(
    ch: &Channel,
    names: &Names,
    queue_type: QueueType,
) -> Result<(), lapin::Error> {
    let q = names.unroutable_queue();
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions { durable: true, ..Default::default() },
        crate::topology::dlq_args(queue_type),
    )
    .await?;
    let key = format!("{}{}.*", stars(LEVELS), names::word(names.prefix()));
    ch.queue_bind(
        q.as_str().into(),
        DELAY_UNROUTABLE.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_keys_spell_the_bits_msb_first_then_prefix_and_queue() {
        let k = routing_key(5, "chime", "default");
        assert_eq!(k.matches('.').count(), LEVELS as usize + 1);
        assert!(k.ends_with("0.0.0.0.0.1.0.1.chime.default"), "{k}");
        assert_eq!(routing_key(0, "p", "q"), format!("{}p.q", "0.".repeat(28)));
        // Dots inside names cannot make two destinations share a key.
        assert_ne!(routing_key(1, "a.b", "c"), routing_key(1, "a", "b.c"));
        assert!(routing_key(MAX_DELAY.as_secs(), "p", "a.b").starts_with(&"1.".repeat(28)));
        // The longest prefix and queue names fit AMQP's 255-byte routing keys.
        assert!(routing_key(1, &"p".repeat(64), &"q".repeat(100)).len() <= 255);
    }

    #[test]
    fn first_level_is_the_highest_bit() {
        assert_eq!(first_level(0), None);
        assert_eq!(first_level(1), Some(0));
        assert_eq!(first_level(7), Some(2));
        assert_eq!(first_level(365 * 86_400), Some(24));
        assert_eq!(first_level(MAX_DELAY.as_secs()), Some(27));
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(seconds(Duration::from_millis(1)), 1);
        assert_eq!(seconds(Duration::from_secs(3)), 3);
        assert_eq!(seconds(Duration::from_millis(3001)), 4);
    }
}
