//! Plugin-free delayed delivery: binary TTL levels (the scheme of NServiceBus and kombu ≥ 5.5).
//!
//! Level L (0 ≤ L < 28) is a topic exchange `<p>.delay.L` and a queue `<p>.delay.L` whose
//! queue-level TTL is 2^L seconds and which dead-letters into level L−1 (level 0 into
//! `<p>.delay.deliver`). A delayed message is published to the top level with the routing key
//! `b27.b26.….b0.<queue>`, the delay's bits, most significant first. At each level a set bit
//! routes the message into that level's queue, where it waits 2^L s; a clear bit routes it
//! straight on through an exchange-to-exchange binding. After level 0 the delivery exchange
//! routes it to `<p>.q.<queue>` by the words after the bits.
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
use crate::topology::Names;

/// Number of levels: delays up to 2^28 − 1 seconds.
pub const LEVELS: u32 = 28;
/// Longest delay that can be expressed.
pub const MAX_DELAY: Duration = Duration::from_secs((1 << LEVELS) - 1);

/// Whole seconds of `delay`, rounded up (a delay is never shortened).
pub fn seconds(delay: Duration) -> u64 {
    delay.as_secs() + u64::from(delay.subsec_nanos() > 0)
}

/// Routing key for a delay of `secs` seconds to `queue`.
pub fn routing_key(secs: u64, queue: &str) -> String {
    let mut key = String::with_capacity(2 * LEVELS as usize + queue.len());
    for level in (0..LEVELS).rev() {
        key.push(if secs >> level & 1 == 1 { '1' } else { '0' });
        key.push('.');
    }
    key.push_str(queue);
    key
}

/// The level queue a freshly published delay of `secs` waits in first (its highest bit).
pub fn first_level(secs: u64) -> Option<u32> {
    (secs > 0).then(|| 63 - secs.leading_zeros())
}

/// Exchange and routing key that deliver to `queue` after `delay` (now, if it is zero).
pub fn target(names: &Names, queue: &str, delay: Duration) -> (String, String) {
    match seconds(delay) {
        0 => (names.work_exchange(), queue.to_string()),
        secs => (names.delay_exchange(LEVELS - 1), routing_key(secs, queue)),
    }
}

/// `n` topic wildcards for the higher levels' bits.
fn stars(n: u32) -> String {
    "*.".repeat(n as usize)
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Declares the level exchanges and queues and the delivery exchange (idempotent).
pub async fn declare_levels(
    ch: &Channel,
    names: &Names,
    queue_type: QueueType,
) -> Result<(), (String, lapin::Error)> {
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    let deliver = names.delay_deliver_exchange();
    ch.exchange_declare(deliver.as_str().into(), ExchangeKind::Topic, durable, FieldTable::default())
        .await
        .map_err(|e| (deliver.clone(), e))?;
    for level in 0..LEVELS {
        let ex = names.delay_exchange(level);
        ch.exchange_declare(ex.as_str().into(), ExchangeKind::Topic, durable, FieldTable::default())
            .await
            .map_err(|e| (ex.clone(), e))?;
    }
    for level in 0..LEVELS {
        let ex = names.delay_exchange(level);
        let next = if level == 0 { deliver.clone() } else { names.delay_exchange(level - 1) };
        let q = names.delay_queue(level);
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
    ch.queue_bind(
        names.work_queue(queue).into(),
        names.delay_deliver_exchange().into(),
        format!("{}{queue}", stars(LEVELS)).into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_keys_spell_the_bits_msb_first() {
        let k = routing_key(5, "default");
        assert_eq!(k.matches('.').count(), LEVELS as usize);
        assert!(k.ends_with("0.0.0.0.0.1.0.1.default"), "{k}");
        assert_eq!(routing_key(0, "q"), format!("{}q", "0.".repeat(28)));
        assert!(routing_key(MAX_DELAY.as_secs(), "a.b").starts_with(&"1.".repeat(28)));
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
