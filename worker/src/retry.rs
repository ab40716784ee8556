//! Retry policy: a pure decision from (attempt, max_attempts, failure) to "retry after this
//! delay" or "dead, for this reason". Delays grow exponentially (`initial` × `factor`^(n−1),
//! capped at `max`) with jitter of up to +100% (backon's), capped at `max` again, rounded up to
//! whole seconds (the delay chain's granularity). The jitter is seeded by the key and attempt,
//! so a decision is reproducible.

use chime_shared::config::BackoffConfig;
use std::time::Duration;
use uuid::Uuid;

/// How a run failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The handler returned a transient error.
    Transient,
    /// The handler ran past its timeout.
    Timeout,
    /// The handler panicked.
    Panic,
    /// The handler returned a permanent error.
    Permanent,
}

/// Why a message went to its DLQ (`x-chime-reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadReason {
    /// Attempts used up; the last failure was a transient error.
    Exhausted,
    /// The handler said retrying cannot help.
    Permanent,
    /// Not a v1 envelope.
    Malformed,
    /// No handler for the job on this worker.
    UnknownJob,
    /// Attempts used up; the last attempt timed out.
    Timeout,
    /// Attempts used up; the last attempt panicked.
    Panic,
    /// Above `amqp.max_message_bytes`.
    TooLarge,
    /// The key's Redis record is not a chime record (WRONGTYPE, unreadable fields).
    BadRecord,
    /// Its circuit breaker was open (`on_open = "dead_letter"`).
    CircuitOpen,
    /// A workflow step that waited for its upstream steps longer than `redis.done_retention`.
    Blocked,
}

impl DeadReason {
    /// The `x-chime-reason` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadReason::Exhausted => "exhausted",
            DeadReason::Permanent => "permanent",
            DeadReason::Malformed => "malformed",
            DeadReason::UnknownJob => "unknown_job",
            DeadReason::Timeout => "timeout",
            DeadReason::Panic => "panic",
            DeadReason::TooLarge => "too_large",
            DeadReason::BadRecord => "bad_record",
            DeadReason::CircuitOpen => "circuit_open",
            DeadReason::Blocked => "blocked",
        }
    }
}

/// What happens to a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Publish the next attempt after this delay.
    Retry(Duration),
    /// Dead-letter with this reason.
    Dead(DeadReason),
}

/// Decides what happens after attempt `attempt` (1-based) of `max_attempts` failed.
pub fn decide(
    attempt: u32,
    max_attempts: u32,
    failure: Failure,
    backoff: &BackoffConfig,
    key: Uuid,
) -> Decision {
    if failure == Failure::Permanent {
        return Decision::Dead(DeadReason::Permanent);
    }
    if attempt >= max_attempts {
        return Decision::Dead(match failure {
            Failure::Timeout => DeadReason::Timeout,
            Failure::Panic => DeadReason::Panic,
            Failure::Transient | Failure::Permanent => DeadReason::Exhausted,
        });
    }
    Decision::Retry(delay(attempt, backoff, seed(key, attempt)))
}

fn seed(key: Uuid, attempt: u32) -> u64 {
    let (hi, lo) = key.as_u64_pair();
    hi ^ lo.rotate_left(17) ^ u64::from(attempt).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Delay before attempt `attempt + 1`.
pub fn delay(attempt: u32, backoff: &BackoffConfig, seed: u64) -> Duration {
    use backon::BackoffBuilder;
    let mut delays = backon::ExponentialBuilder::default()
        .with_min_delay(backoff.initial)
        .with_factor(backoff.factor)
        .with_max_delay(backoff.max)
        .with_jitter()
        .with_jitter_seed(seed)
        .without_max_times()
        .build();
    let d = delays.nth(attempt.saturating_sub(1) as usize).unwrap_or(backoff.max).min(backoff.max);
    Duration::from_secs(chime_shared::delay::seconds(d).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff(initial: u64, factor: f32, max: u64) -> BackoffConfig {
        BackoffConfig { initial: Duration::from_secs(initial), factor, max: Duration::from_secs(max) }
    }

    #[test]
    fn permanent_is_dead_at_once() {
        let d = decide(1, 5, Failure::Permanent, &backoff(5, 2.0, 60), Uuid::nil());
        assert_eq!(d, Decision::Dead(DeadReason::Permanent));
    }

    #[test]
    fn exhaustion_names_the_last_failure() {
        let b = backoff(5, 2.0, 60);
        assert_eq!(decide(3, 3, Failure::Transient, &b, Uuid::nil()), Decision::Dead(DeadReason::Exhausted));
        assert_eq!(decide(3, 3, Failure::Timeout, &b, Uuid::nil()), Decision::Dead(DeadReason::Timeout));
        assert_eq!(decide(1, 1, Failure::Panic, &b, Uuid::nil()), Decision::Dead(DeadReason::Panic));
        assert!(matches!(decide(2, 3, Failure::Panic, &b, Uuid::nil()), Decision::Retry(_)));
    }

    #[test]
    fn delays_grow_with_jitter_within_bounds() {
        let b = backoff(5, 2.0, 60);
        for attempt in 1..=8u32 {
            let base = (5u64 << (attempt - 1)).min(60);
            for s in 0..50u64 {
                let d = delay(attempt, &b, s).as_secs();
                assert!(
                    d >= base && d <= (2 * base).min(60),
                    "attempt {attempt}: {d}s outside [{base}, {}]",
                    (2 * base).min(60)
                );
            }
        }
        // Deterministic for the same seed.
        assert_eq!(delay(3, &b, 42), delay(3, &b, 42));
        // Never below one second.
        assert_eq!(
            delay(
                1,
                &BackoffConfig {
                    initial: Duration::from_millis(10),
                    factor: 1.0,
                    max: Duration::from_millis(10)
                },
                1
            ),
            Duration::from_secs(1)
        );
    }
}
