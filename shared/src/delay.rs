//! Plugin-free delayed delivery: binary TTL levels (the scheme of NServiceBus and kombu ≥ 5.5),
//! in one chain per virtual host that every prefix shares (see `names`). This module is the
//! arithmetic (routing keys, levels); `topology` declares the chain.
//!
//! Level L (0 ≤ L < 28) is a topic exchange and a queue `chime-delay.<type>.L` whose
//! queue-level TTL is 2^L seconds and which dead-letters into level L−1 (level 0 into
//! `chime-delay.deliver`). A delayed message is published to the level of its highest set bit
//! ([`entry_level`]; every level above would route it straight on) with the routing
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

use std::time::Duration;

use crate::names::QueueType;
use crate::names::{self, Names};

/// Number of levels: delays up to 2^28 − 1 seconds.
pub const LEVELS: u32 = 28;
/// Longest delay that can be expressed.
pub const MAX_DELAY: Duration = Duration::from_secs((1 << LEVELS) - 1);
// A job's backoff is bounded by this chain's longest delay.
const _: () = assert!(MAX_DELAY.as_secs() == chime_job::MAX_BACKOFF.as_secs());

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

/// Exchange and routing key that deliver to `queue` after `delay` (now, if it is zero; at
/// most [`MAX_DELAY`]: a longer delay would lose its high bits in the routing key).
pub fn target(names: &Names, queue_type: QueueType, queue: &str, delay: Duration) -> (String, String) {
    target_with(|| names.work_exchange(), names, queue_type, queue.to_string(), delay)
}

/// [`target`] with the work exchange's name from `work` (a publisher of many jobs makes it
/// once) and the queue moved in.
pub fn target_with(
    work: impl FnOnce() -> String,
    names: &Names,
    queue_type: QueueType,
    queue: String,
    delay: Duration,
) -> (String, String) {
    match seconds(delay).min(MAX_DELAY.as_secs()) {
        0 => (work(), queue),
        secs => {
            (names::delay_level(queue_type, entry_level(secs)), routing_key(secs, names.prefix(), &queue))
        }
    }
}

/// The level whose exchange a delay of `secs` (> 0) is published to: its highest set bit,
/// where it waits first. Every level above routes a clear bit straight on, so publishing to
/// the top level would end in the same queue after the broker had matched the key against up
/// to 27 more exchanges' bindings (a delay of a minute: 6 levels instead of 28). Delays beyond
/// [`MAX_DELAY`] keep the top level (their bits above it are not in the key).
pub fn entry_level(secs: u64) -> u32 {
    first_level(secs).map_or(LEVELS - 1, |l| l.min(LEVELS - 1))
}

/// `n` topic wildcards for the higher levels' bits (binding keys of the chain).
pub fn stars(n: u32) -> String {
    "*.".repeat(n as usize)
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
    fn a_delay_enters_the_chain_at_its_highest_bit_and_never_above_the_top() {
        assert_eq!(entry_level(1), 0);
        assert_eq!(entry_level(37), 5);
        assert_eq!(entry_level(MAX_DELAY.as_secs()), LEVELS - 1);
        assert_eq!(entry_level(MAX_DELAY.as_secs() + 1), LEVELS - 1);
        assert_eq!(entry_level(u64::MAX), LEVELS - 1);
        let names = Names::new("p");
        let (exchange, key) = target(&names, QueueType::Quorum, "default", Duration::from_secs(37));
        assert_eq!(exchange, names::delay_level(QueueType::Quorum, 5));
        assert_eq!(key, routing_key(37, "p", "default"));
        let (exchange, key) = target(&names, QueueType::Classic, "default", Duration::ZERO);
        assert_eq!((exchange, key), (names.work_exchange(), "default".to_string()));
        // Beyond the longest delay: the longest, not its low bits (2^28 s has none set).
        let (_, key) = target(&names, QueueType::Quorum, "default", Duration::from_secs(1 << LEVELS));
        assert_eq!(key, routing_key(MAX_DELAY.as_secs(), "p", "default"));
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(seconds(Duration::from_millis(1)), 1);
        assert_eq!(seconds(Duration::from_secs(3)), 3);
        assert_eq!(seconds(Duration::from_millis(3001)), 4);
    }
}
