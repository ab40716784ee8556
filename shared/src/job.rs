//! Typed jobs: one Rust type per job, shared by the code that enqueues it and the worker that
//! runs it.
//!
//! ```
//! use chime_shared::job::{Job, JobOptions};
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
//! ```
//!
//! A job defined in Rust needs no `[[jobs]]` entry unless it is scheduled; an entry with the
//! same name overrides its options (so operators can tune attempts or timeouts without a
//! rebuild).

use serde::Serialize;
use serde::de::DeserializeOwned;
use std::time::Duration;

use crate::config::{BackoffConfig, DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE, JobConfig};

/// A job type: its payload is the type itself, serialised as JSON.
pub trait Job: Serialize + DeserializeOwned + Send + 'static {
    /// The job's name: the envelope's `job`, the `[[jobs]] name` that overrides its options.
    const NAME: &'static str;

    /// Queue, timeout, attempts and backoff when no `[[jobs]]` entry says otherwise.
    fn options() -> JobOptions {
        JobOptions::default()
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

impl JobOptions {
    /// Runs on `queue`.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }
    /// Runs at most `n` of this job at once in one worker process (heavy handlers bounded,
    /// light ones as wide as `worker.concurrency`).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n.max(1));
        self
    }
    /// Runs at most `n` of this job at once across every worker sharing the prefix (a rate
    /// limit for a downstream service; slots are leased in Redis, so a dead worker's slot
    /// lapses after `redis.lease`).
    pub fn global_concurrency(mut self, n: usize) -> Self {
        self.global_concurrency = Some(n.max(1));
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

    /// These options with the settings of a `[[jobs]]` entry of the same name on top.
    pub fn overridden_by(&self, config: Option<&JobConfig>) -> JobOptions {
        let Some(c) = config else { return self.clone() };
        JobOptions {
            queue: c.queue.clone().or_else(|| self.queue.clone()),
            timeout: c.timeout.or(self.timeout),
            max_attempts: c.max_attempts.or(self.max_attempts),
            backoff: c.backoff.clone().or_else(|| self.backoff.clone()),
            concurrency: c.concurrency.or(self.concurrency),
            global_concurrency: c.global_concurrency.or(self.global_concurrency),
        }
    }
}
