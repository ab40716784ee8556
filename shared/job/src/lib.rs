//! Typed jobs: one Rust type per job, shared by the code that enqueues it and the worker that
//! runs it. This crate is all a crate that only defines jobs needs: serde and a duration
//! parser, nothing of RabbitMQ, Redis or TLS.
//!
//! ```
//! use chime_job::{Job, JobOptions};
//! use std::time::Duration;
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct SendWelcome {
//!     user_id: u64,
//! }
//!
//! impl Job for SendWelcome {
//!     const NAME: &'static str = "send_welcome";
//!     fn options() -> JobOptions {
//!         JobOptions::default().queue("emails").max_attempts(3).timeout(Duration::from_secs(30))
//!     }
//! }
//!
//! assert_eq!(SendWelcome::options().queue_name(), "emails");
//! assert!(SendWelcome::options().validate().is_ok());
//! ```
//!
//! A job defined in Rust needs no `[[jobs]]` entry unless it is scheduled; an entry with the
//! same name overrides its options (so operators can tune attempts or timeouts without a
//! rebuild). The same rules check both ([`JobOptions::validate`]).

#![warn(missing_docs)]

pub mod duration;

use serde::Deserialize;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::time::Duration;

/// The queue of a job that names none.
pub const DEFAULT_QUEUE: &str = "default";
/// Attempts of a job that sets none (first run included).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Most attempts a job may have (first run included).
pub const MAX_ATTEMPTS: u32 = 1000;
/// Most runs at once a per-process or global concurrency limit may allow.
pub const MAX_CONCURRENCY: usize = 10_000;
/// The longest retry delay a backoff may reach: the longest delay the delay chain holds
/// (2^28 − 1 s, about 8.5 years; a longer one would lose its high bits there).
pub const MAX_BACKOFF: Duration = Duration::from_secs((1 << 28) - 1);

/// A job type: its payload is the type itself, serialised as JSON.
pub trait Job: Serialize + DeserializeOwned + Send + 'static {
    /// The job's name: the envelope's `job`, the `[[jobs]] name` that overrides its options.
    const NAME: &'static str;

    /// Queue, timeout, attempts and backoff when no `[[jobs]]` entry says otherwise.
    fn options() -> JobOptions {
        JobOptions::default()
    }
}

/// Names of queues, jobs and prefixes: letters, digits, `-`, `_`, `.`; 1 to 100 characters.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 100
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Exponential backoff of retries: `initial`·`factor`^(attempt−1), capped at `max`, plus
/// jitter.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackoffConfig {
    /// Delay before the second attempt.
    #[serde(deserialize_with = "duration::de")]
    pub initial: Duration,
    /// Growth per attempt (1 to 100).
    pub factor: f32,
    /// Longest delay.
    #[serde(deserialize_with = "duration::de")]
    pub max: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self { initial: Duration::from_secs(5), factor: 2.0, max: Duration::from_secs(3600) }
    }
}

/// What a job defined in Rust declares about itself. Build it from `JobOptions::default()`.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct JobOptions {
    /// Queue (default `default`).
    pub queue: Option<String>,
    /// Handler timeout (default `worker.default_timeout`).
    pub timeout: Option<Duration>,
    /// Attempts in all, first run included (default 5).
    pub max_attempts: Option<u32>,
    /// Retry delays (default: 5 s doubling to 1 h).
    pub backoff: Option<BackoffConfig>,
    /// Runs at once in one worker process (default `worker.concurrency`).
    pub concurrency: Option<usize>,
    /// Runs at once across every worker sharing the prefix (default: no such limit).
    pub global_concurrency: Option<usize>,
}

/// A job option that is not allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidOption {
    /// The option (`queue`, `timeout`, `max_attempts`, `backoff`, `concurrency`,
    /// `global_concurrency`), as the `[[jobs]]` key of the same name.
    pub field: &'static str,
    /// What is wrong with it.
    pub message: String,
}

impl std::fmt::Display for InvalidOption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for InvalidOption {}

impl JobOptions {
    /// Runs on `queue`.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }
    /// Runs at most `n` of this job at once in one worker process (heavy handlers bounded,
    /// light ones as wide as `worker.concurrency`).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n);
        self
    }
    /// Runs at most `n` of this job at once across every worker sharing the prefix (a rate
    /// limit for a downstream service; slots are leased in Redis, so a dead worker's slot
    /// lapses after `redis.lease`).
    pub fn global_concurrency(mut self, n: usize) -> Self {
        self.global_concurrency = Some(n);
        self
    }
    /// Stops the handler after `timeout` (its cancellation token fires first).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
    /// Gives up after `n` attempts (first run included).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }
    /// Waits between attempts by `backoff`.
    pub fn backoff(mut self, backoff: BackoffConfig) -> Self {
        self.backoff = Some(backoff);
        self
    }

    /// The queue, `default` if none was set.
    pub fn queue_name(&self) -> &str {
        self.queue.as_deref().unwrap_or(DEFAULT_QUEUE)
    }

    /// The attempts, 5 if none were set.
    pub fn attempts(&self) -> u32 {
        self.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS)
    }

    /// Checks every option set, by the rules a `[[jobs]]` entry is checked by: a queue name of
    /// the name alphabet, a positive timeout, 1 to [`MAX_ATTEMPTS`] attempts, a backoff with
    /// `initial` > 0, `factor` between 1 and 100 and `max` ≥ `initial`, limits between 1 and
    /// [`MAX_CONCURRENCY`].
    pub fn validate(&self) -> Result<(), InvalidOption> {
        let bad = |field, message: String| Err(InvalidOption { field, message });
        if let Some(q) = &self.queue
            && !valid_name(q)
        {
            return bad("queue", format!("{q:?} must be 1-100 letters, digits, '-', '_' or '.'"));
        }
        if self.timeout.is_some_and(|t| t.is_zero()) {
            return bad("timeout", "must be positive".into());
        }
        if self.max_attempts.is_some_and(|n| n == 0 || n > MAX_ATTEMPTS) {
            return bad("max_attempts", format!("must be between 1 and {MAX_ATTEMPTS}"));
        }
        if let Some(b) = &self.backoff
            && (!(1.0..=100.0).contains(&b.factor) || b.initial.is_zero() || b.max < b.initial)
        {
            return bad("backoff", "needs initial > 0, factor between 1 and 100, and max >= initial".into());
        }
        if let Some(b) = &self.backoff
            && b.max > MAX_BACKOFF
        {
            return bad(
                "backoff",
                format!(
                    "max {}s: at most {}s (about 8.5 years), the longest delay chime holds",
                    b.max.as_secs(),
                    MAX_BACKOFF.as_secs()
                ),
            );
        }
        for (field, n) in [("concurrency", self.concurrency), ("global_concurrency", self.global_concurrency)]
        {
            if n.is_some_and(|n| n == 0 || n > MAX_CONCURRENCY) {
                return bad(field, format!("must be between 1 and {MAX_CONCURRENCY}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked_by_the_config_rules() {
        assert!(JobOptions::default().validate().is_ok());
        let ok = JobOptions::default().queue("emails").max_attempts(3).timeout(Duration::from_secs(1));
        assert!(ok.validate().is_ok());
        for (options, field) in [
            (JobOptions::default().queue("bad queue"), "queue"),
            (JobOptions::default().timeout(Duration::ZERO), "timeout"),
            (JobOptions::default().max_attempts(0), "max_attempts"),
            (JobOptions::default().max_attempts(MAX_ATTEMPTS + 1), "max_attempts"),
            (
                JobOptions::default().backoff(BackoffConfig { factor: 0.5, ..BackoffConfig::default() }),
                "backoff",
            ),
            (
                JobOptions::default().backoff(BackoffConfig {
                    initial: Duration::from_secs(10),
                    max: Duration::from_secs(1),
                    ..BackoffConfig::default()
                }),
                "backoff",
            ),
            // Beyond the longest delay the delay chain holds.
            (
                JobOptions::default().backoff(BackoffConfig {
                    max: MAX_BACKOFF + Duration::from_secs(1),
                    ..BackoffConfig::default()
                }),
                "backoff",
            ),
            (JobOptions::default().concurrency(0), "concurrency"),
            (JobOptions::default().global_concurrency(MAX_CONCURRENCY + 1), "global_concurrency"),
        ] {
            assert_eq!(options.validate().map_err(|e| e.field), Err(field), "{options:?}");
        }
    }

    #[test]
    fn names_use_one_alphabet() {
        assert!(valid_name("reports.daily") && valid_name("a-b_c"));
        assert!(!valid_name("") && !valid_name("a b") && !valid_name(&"x".repeat(101)) && !valid_name("(x)"));
    }
}
