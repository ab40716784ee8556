//! The per-delivery decision, as a table of pure functions: what the claim said and how the
//! run ended decide a [`Plan`] (the key is not held: nothing to record on it) or a
//! [`HeldPlan`] (this delivery holds the key's claim, whose fence every record needs); the two
//! types keep a plan that needs the claim from being reached without one. `process` carries
//! the plan out, and the order of its steps is the
//! invariant: **a delivery is acked only after its outcome is durable where the next reader
//! looks** — `done` recorded in Redis, or the retry or dead-letter copy confirmed by the broker.
//!
//! | claim | run | attempts | plan: steps in order | if the publish fails |
//! |---|---|---|---|---|
//! | Redis error | — | — | requeue (intake pauses) | |
//! | the key's record is not a chime record | — | — | dead-letter `bad_record`, ack | requeue |
//! | `done` / `dead` | — | — | ack (duplicate) | |
//! | `cancelled` | — | — | ack (dropped as cancelled, recorded) | |
//! | `superseded` (an older copy of a key a newer enqueue replaced) | — | — | ack (dropped, recorded) | |
//! | `busy` (another live owner) | — | — | re-delay this copy by the remaining lease, ack | requeue |
//! | `dying` (a dead letter not known to be confirmed) | — | — | publish the dead letter again, record `dead`, ack | requeue |
//! | claimed | succeeded | — | record `done` (retried until it is), ack | (not recorded by the drain deadline: requeue) |
//! | claimed | transient, timeout, panic | < max | publish attempt + 1 after the backoff, free the key, ack | free the key, requeue |
//! | claimed | transient, timeout, panic | = max | mark `dying`, publish the dead letter, record `dead`, ack | requeue (`dying` stays: the next copy dead-letters) |
//! | claimed | permanent | any | as above | as above |
//! | claimed | the downstream pushed back (`rate_limited`) | any | slow the job's rate bucket, publish the same attempt after the wait, free the key, ack (`parked`) | free the key, requeue |
//! | claimed | lease taken over by another owner | — | ack (that owner settles its own copy) | |
//! | claimed | cancelled (`chime cancel`; the key is `cancelled` already) | — | record the `cancelled` run, ack | |
//! | claimed, a `sheddable` job while its queue sheds | not run | — | record `done` with a `shed` run (a later copy is a duplicate), ack | (not recorded by the drain deadline: requeue) |
//! | claimed | stopped at the drain deadline | — | free the key, requeue | |
//! | (no handler for the job) | — | — | re-delay for `worker.unknown_job_grace`, then dead-letter `unknown_job` | requeue |
//! | (malformed, too large) | — | — | dead-letter, ack | requeue |
//! | (scheduled slot past its deadline) | — | — | ack (expired) | |
//! | (its rate limit's start, or a global slot, further off than `worker.max_hold`) | — | — | publish the same attempt after the wait (`parked`), ack | requeue |
//! | (a workflow step whose upstream steps are not all done: ended, for `on_complete`) | — | — | register on their records, publish the same attempt after 1 s doubling to 60 s (`parked`, reason `workflow`, recorded once), ack; an upstream's `done` or `dead` publishes it at once | requeue |
//! | (a workflow step whose upstream is dead or cancelled) | — | — | as above, up to 10 min (`blocked`, recorded once); after `redis.done_retention` waiting, dead-letter `blocked` | requeue |
//! | (its circuit breaker open, or half-open with every probe out) | — | — | publish the same attempt after the wait (`parked`), ack; or dead-letter `circuit_open` (`on_open = "dead_letter"`) | requeue |

use chime_shared::config::BackoffConfig;
use chime_shared::idempotency::{Claim, DeadInfo, IdemError};
use chrono::{DateTime, Utc};
use std::time::Duration;
use uuid::Uuid;

use crate::retry::{self, DeadReason, Decision, Failure};

/// Longest `x-chime-error` kept.
pub(crate) const MAX_ERROR_LEN: usize = 1000;

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RunEnd {
    Succeeded,
    Failed(Failure, String),
    /// A transient failure whose handler asked for this delay before the next attempt.
    RetryAfter(Duration, String),
    /// The downstream pushed back: run again after this long, as the same attempt.
    RateLimited(Duration, String),
    /// Another owner claimed the key while we ran (our lease lapsed).
    LeaseTaken,
    /// Stopped by the drain deadline without a result.
    Stopped,
    /// Cancelled (`chime cancel`) and stopped without a result in its grace.
    Cancelled,
}

/// Why a delivery is acked without a new record or message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    Duplicate,
    Expired,
    /// A copy of a cancelled key.
    Cancelled,
    /// An older copy of a key a newer enqueue replaced (debounce, replace).
    Superseded,
    /// A copy of a workflow step an upstream's end released, which still has to wait (the
    /// step's own copy is parked).
    Released,
}

/// Why a copy is sent round again unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Redelay {
    Busy,
    /// First seen without a handler at this instant (carried in `x-chime-unknown-since`).
    UnknownJob(DateTime<Utc>),
    /// It must wait longer than `worker.max_hold` before it may run.
    Parked(Park),
}

/// Why a run is parked (its `parked` history event's reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Park {
    /// Its rate limit cannot start it within the wait it may do in place; its ticket (µs of
    /// Redis time: its place in line) travels with the copy (`x-chime-rate-at`).
    RateLimit { ticket_us: u64 },
    /// Every global concurrency slot stayed held; `parks` counts the times it was parked so.
    GlobalSlot { parks: u32 },
    /// The downstream pushed back (`JobError::rate_limited`).
    PushedBack,
    /// Its circuit breaker was open, or half-open with every probe out; `parks` counts the
    /// times it was parked so.
    Circuit { parks: u32 },
    /// A workflow step whose upstream steps have not all come to what it waits for (`blocked`:
    /// one is dead or cancelled); `parks` counts the times it was parked so, `since` is when
    /// it was first (s since the epoch).
    Workflow { parks: u32, since: i64, blocked: bool },
}

impl Park {
    /// The reason recorded and counted.
    pub fn as_str(self) -> &'static str {
        match self {
            Park::RateLimit { .. } => "rate_limit",
            Park::GlobalSlot { .. } => "global_concurrency",
            Park::PushedBack => "pushed_back",
            Park::Circuit { .. } => "circuit_open",
            Park::Workflow { blocked: false, .. } => "workflow",
            Park::Workflow { blocked: true, .. } => "blocked",
        }
    }
}

/// What a dead letter sent by the key's holder does to the key's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyMark {
    /// A run failed for good: mark `dying` before publishing, `dead` after.
    MarkDying,
    /// The claim found the key `dying` and made us its owner: `dead` after publishing.
    AlreadyDying,
}

/// Settling a delivery whose key this worker does not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Plan {
    Ack(Settled),
    /// Nothing decided (Redis unreachable before the claim, a local limit not granted).
    Requeue,
    Redelay {
        delay: Duration,
        why: Redelay,
    },
    /// Dead-letter the delivery as it came; no key record is touched (unknown job,
    /// unreadable record).
    DeadLetter(DeadInfo),
}

/// Settling a delivery whose key this worker holds under a fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HeldPlan {
    RecordDone,
    Retry {
        delay: Duration,
    },
    DeadLetter {
        dead: DeadInfo,
        mark: KeyMark,
    },
    /// Another owner claimed the key while we ran: ack, that owner settles its own copy.
    LeaseTaken,
    /// Stopped at the drain deadline: free the key, requeue.
    Release,
    /// Cancelled while it ran (the record says `cancelled` already): record the run, ack.
    Cancelled,
    /// The downstream pushed back: publish the same attempt after `delay`, free the key, ack.
    Park {
        delay: Duration,
    },
    /// A `sheddable` run while its queue sheds: record `done` with a `shed` run, ack. Settled,
    /// so that a copy coming back later (an ack a broker lost) is a duplicate, not a run.
    Shed,
}

/// What the claim leads to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AfterClaim {
    /// Run the handler under this fence.
    Run(u64),
    /// Settle without holding the key.
    Settle(Plan),
    /// Settle as the key's holder without running (a `dying` key whose dead letter this
    /// delivery publishes again).
    Hold { fence: u64, plan: HeldPlan },
}

/// After the claim.
pub(crate) fn on_claim(claim: Result<Claim, &IdemError>) -> AfterClaim {
    match claim {
        Err(e) => AfterClaim::Settle(on_redis_error(e)),
        Ok(Claim::Claimed { fence, .. }) => AfterClaim::Run(fence),
        Ok(Claim::Done { .. } | Claim::Dead { .. }) => AfterClaim::Settle(Plan::Ack(Settled::Duplicate)),
        Ok(Claim::Cancelled { .. }) => AfterClaim::Settle(Plan::Ack(Settled::Cancelled)),
        Ok(Claim::Superseded { .. }) => AfterClaim::Settle(Plan::Ack(Settled::Superseded)),
        Ok(Claim::Stale { .. }) => AfterClaim::Settle(Plan::Ack(Settled::Duplicate)),
        // Never drop a busy copy (its owner may die): send it round after the remaining lease.
        Ok(Claim::Busy { remaining, .. }) => AfterClaim::Settle(Plan::Redelay {
            delay: remaining.max(Duration::from_secs(1)),
            why: Redelay::Busy,
        }),
        Ok(Claim::Dying { fence, dead }) => {
            AfterClaim::Hold { fence, plan: HeldPlan::DeadLetter { dead, mark: KeyMark::AlreadyDying } }
        }
    }
}

/// A Redis error before any claim was held (the claim itself, a global slot).
pub(crate) fn on_redis_error(e: &IdemError) -> Plan {
    if e.is_bad_record() {
        // One poisoned record must not pause the worker: this delivery goes to the DLQ.
        Plan::DeadLetter(rejected(DeadReason::BadRecord, &e.to_string()))
    } else {
        Plan::Requeue
    }
}

/// After the run of attempt `attempt` of `max_attempts`.
pub(crate) fn on_run(
    end: RunEnd,
    attempt: u32,
    max_attempts: u32,
    backoff: &BackoffConfig,
    key: Uuid,
) -> HeldPlan {
    match end {
        RunEnd::Succeeded => HeldPlan::RecordDone,
        RunEnd::LeaseTaken => HeldPlan::LeaseTaken,
        RunEnd::Stopped => HeldPlan::Release,
        RunEnd::Cancelled => HeldPlan::Cancelled,
        RunEnd::Failed(failure, error) => match retry::decide(attempt, max_attempts, failure, backoff, key) {
            Decision::Retry(delay) => HeldPlan::Retry { delay },
            Decision::Dead(reason) => {
                HeldPlan::DeadLetter { dead: dead_info(reason, &error, attempt), mark: KeyMark::MarkDying }
            }
        },
        // Not a failure: the same attempt runs again after the wait (whole seconds, at least one).
        RunEnd::RateLimited(asked, _) => {
            HeldPlan::Park { delay: Duration::from_secs(chime_shared::delay::seconds(asked).max(1)) }
        }
        RunEnd::RetryAfter(asked, error) => {
            match retry::decide(attempt, max_attempts, Failure::Transient, backoff, key) {
                // The handler's delay replaces the backoff (whole seconds, at least one).
                Decision::Retry(_) => {
                    HeldPlan::Retry { delay: Duration::from_secs(chime_shared::delay::seconds(asked).max(1)) }
                }
                Decision::Dead(reason) => HeldPlan::DeadLetter {
                    dead: dead_info(reason, &error, attempt),
                    mark: KeyMark::MarkDying,
                },
            }
        }
    }
}

/// A job this worker has no handler for, first seen without one at `since`.
pub(crate) fn unknown_job(
    job: &str,
    attempt: u32,
    since: DateTime<Utc>,
    now: DateTime<Utc>,
    grace: Duration,
) -> Plan {
    let waited = (now - since).to_std().unwrap_or(Duration::ZERO);
    match grace.checked_sub(waited) {
        Some(left) if !left.is_zero() => Plan::Redelay {
            delay: left.clamp(Duration::from_secs(1), Duration::from_secs(10)),
            why: Redelay::UnknownJob(since),
        },
        _ => Plan::DeadLetter(dead_info(
            DeadReason::UnknownJob,
            &format!(
                "no handler for job {job:?} on any worker within worker.unknown_job_grace ({})",
                chime_shared::duration::format(grace)
            ),
            attempt.saturating_sub(1),
        )),
    }
}

/// A delivery that is not a job (malformed, too large) or whose key record is unreadable:
/// straight to the DLQ, no key record touched.
pub(crate) fn rejected(reason: DeadReason, error: &str) -> DeadInfo {
    dead_info(reason, error, 0)
}

pub(crate) fn dead_info(reason: DeadReason, error: &str, attempts: u32) -> DeadInfo {
    DeadInfo {
        reason: reason.as_str().to_string(),
        error: truncate(error, MAX_ERROR_LEN).to_string(),
        attempts,
    }
}

/// `s` within `max` bytes: its head and its end, joined by " … " (an error's first line says
/// what failed, its end how it ended; the middle of a long stderr tail matters least).
fn truncate(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max {
        return std::borrow::Cow::Borrowed(s);
    }
    const GAP: &str = " … ";
    let head_len = floor_char(s, max / 4);
    let tail_start = ceil_char(s, s.len() - (max - head_len - GAP.len()));
    std::borrow::Cow::Owned(format!("{}{GAP}{}", &s[..head_len], &s[tail_start..]))
}

fn floor_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff() -> BackoffConfig {
        BackoffConfig { initial: Duration::from_secs(1), factor: 2.0, max: Duration::from_secs(60) }
    }

    #[test]
    fn claims_map_to_plans() {
        let settle = AfterClaim::Settle;
        assert_eq!(on_claim(Ok(Claim::Claimed { fence: 7, checkpoint: None })), AfterClaim::Run(7));
        assert_eq!(on_claim(Ok(Claim::Done { fence: 7 })), settle(Plan::Ack(Settled::Duplicate)));
        assert_eq!(on_claim(Ok(Claim::Dead { fence: 7 })), settle(Plan::Ack(Settled::Duplicate)));
        assert_eq!(on_claim(Ok(Claim::Cancelled { fence: 7 })), settle(Plan::Ack(Settled::Cancelled)));
        assert_eq!(on_claim(Ok(Claim::Superseded { fence: 7 })), settle(Plan::Ack(Settled::Superseded)));
        assert_eq!(on_claim(Ok(Claim::Stale { fence: 7 })), settle(Plan::Ack(Settled::Duplicate)));
        let busy = Claim::Busy { fence: 1, remaining: Duration::from_millis(300) };
        assert_eq!(
            on_claim(Ok(busy)),
            settle(Plan::Redelay { delay: Duration::from_secs(1), why: Redelay::Busy })
        );
        let dead = DeadInfo { reason: "permanent".into(), error: "x".into(), attempts: 2 };
        assert_eq!(
            on_claim(Ok(Claim::Dying { fence: 4, dead: dead.clone() })),
            AfterClaim::Hold { fence: 4, plan: HeldPlan::DeadLetter { dead, mark: KeyMark::AlreadyDying } }
        );
        let down = IdemError::Protocol("down".into());
        assert_eq!(on_claim(Err(&down)), settle(Plan::Requeue));
        let bad = IdemError::BadRecord("WRONGTYPE".into());
        let AfterClaim::Settle(Plan::DeadLetter(dead)) = on_claim(Err(&bad)) else {
            panic!("an unreadable record dead-letters the delivery");
        };
        assert_eq!(dead.reason, "bad_record");
    }

    #[test]
    fn runs_map_to_plans() {
        let k = Uuid::nil();
        assert_eq!(on_run(RunEnd::Succeeded, 1, 3, &backoff(), k), HeldPlan::RecordDone);
        assert_eq!(on_run(RunEnd::LeaseTaken, 1, 3, &backoff(), k), HeldPlan::LeaseTaken);
        assert_eq!(on_run(RunEnd::Stopped, 1, 3, &backoff(), k), HeldPlan::Release);
        assert_eq!(on_run(RunEnd::Cancelled, 1, 3, &backoff(), k), HeldPlan::Cancelled);
        assert!(matches!(
            on_run(RunEnd::Failed(Failure::Transient, "e".into()), 1, 3, &backoff(), k),
            HeldPlan::Retry { .. }
        ));
        let asked = RunEnd::RetryAfter(Duration::from_millis(42_500), "429".into());
        assert_eq!(
            on_run(asked.clone(), 1, 3, &backoff(), k),
            HeldPlan::Retry { delay: Duration::from_secs(43) }
        );
        assert!(matches!(on_run(asked, 3, 3, &backoff(), k), HeldPlan::DeadLetter { .. }));
        let HeldPlan::DeadLetter { dead, mark } =
            on_run(RunEnd::Failed(Failure::Timeout, "t".into()), 3, 3, &backoff(), k)
        else {
            panic!("exhausted attempts dead-letter");
        };
        assert_eq!((dead.reason.as_str(), dead.attempts, mark), ("timeout", 3, KeyMark::MarkDying));
        let HeldPlan::DeadLetter { dead, .. } =
            on_run(RunEnd::Failed(Failure::Permanent, "é".repeat(800)), 1, 3, &backoff(), k)
        else {
            panic!("permanent failures dead-letter");
        };
        assert_eq!(dead.reason, "permanent");
        assert!(
            dead.error.len() <= 1000 && dead.error.starts_with("éé") && dead.error.ends_with("éé"),
            "{}",
            dead.error.len()
        );
        assert!(dead.error.contains(" … "));
    }

    #[test]
    fn unknown_jobs_wait_out_the_grace_then_dead_letter() {
        let since: DateTime<Utc> = "2026-01-01T00:00:00Z".parse().unwrap();
        let grace = Duration::from_secs(60);
        let at = |s: i64| since + chrono::Duration::seconds(s);
        assert_eq!(
            unknown_job("j", 1, since, at(0), grace),
            Plan::Redelay { delay: Duration::from_secs(10), why: Redelay::UnknownJob(since) }
        );
        assert_eq!(
            unknown_job("j", 1, since, at(55), grace),
            Plan::Redelay { delay: Duration::from_secs(5), why: Redelay::UnknownJob(since) }
        );
        let Plan::DeadLetter(dead) = unknown_job("j", 1, since, at(60), grace) else {
            panic!("past the grace");
        };
        assert_eq!(dead.reason.as_str(), "unknown_job");
    }
}
