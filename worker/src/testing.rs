//! Unit-testing a handler without a broker or Redis: [`TestRun`] makes the [`JobContext`] a
//! worker would pass, and keeps what the handler left (its result and its checkpoints).
//!
//! ```
//! use chime_worker::{JobContext, JobError, testing::TestRun};
//!
//! async fn import_rows(ctx: JobContext, rows: u64) -> Result<(), JobError> {
//!     let start: u64 = ctx.last_checkpoint().unwrap_or(0);
//!     for row in start..rows {
//!         ctx.checkpoint(&(row + 1)).await?;
//!     }
//!     ctx.set_result(&rows);
//!     Ok(())
//! }
//!
//! # tokio_test_block_on(async {
//! // A retry of a run that was cut off after row 8.
//! let run = TestRun::new("import_rows").attempt(2).last_checkpoint(&8u64);
//! import_rows(run.context(), 10).await.unwrap();
//! assert_eq!(run.checkpoints(), vec![serde_json::json!(9), serde_json::json!(10)]);
//! assert_eq!(run.result(), Some(serde_json::json!(10)));
//! # });
//! # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
//! # }
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::handler::{JobContext, RunState};

/// One run of a handler outside a worker: the facts its [`JobContext`] reports (set them
/// with the builder methods; the defaults are those of a first attempt on the `default`
/// queue), and, after the run, its result and the checkpoints it saved. Limits are the
/// config's defaults (`checkpoints.max_bytes`, `results.max_bytes`).
#[derive(Debug)]
pub struct TestRun {
    ctx: JobContext,
}

impl TestRun {
    /// A first attempt of `job` (of 3), with random key and id, a 5-minute timeout.
    pub fn new(job: impl Into<String>) -> Self {
        let checkpoints = chime_shared::config::CheckpointsConfig::default();
        let run = RunState {
            checkpoint: Mutex::new(None),
            result: Mutex::new(None),
            saves: None,
            max_bytes: checkpoints.max_bytes,
            result_max_bytes: chime_shared::config::ResultsConfig::default().max_bytes,
            poll: checkpoints.poll,
            kept: Some(Mutex::new(Vec::new())),
            upstream: Vec::new(),
        };
        Self {
            ctx: JobContext {
                job: job.into(),
                queue: chime_shared::config::DEFAULT_QUEUE.to_string(),
                key: Uuid::new_v4(),
                id: Uuid::now_v7(),
                attempt: 1,
                max_attempts: 3,
                slot: None,
                fence: 1,
                timeout: Duration::from_secs(300),
                cancel: CancellationToken::new(),
                run: Arc::new(run),
                shard: None,
                group: None,
            },
        }
    }

    /// The queue the job came from.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.ctx.queue = queue.into();
        self
    }

    /// The job's idempotency key.
    pub fn key(mut self, key: Uuid) -> Self {
        self.ctx.key = key;
        self
    }

    /// This attempt (from 1).
    pub fn attempt(mut self, attempt: u32) -> Self {
        self.ctx.attempt = attempt;
        self
    }

    /// Attempts allowed in all.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.ctx.max_attempts = max_attempts;
        self
    }

    /// The scheduled slot of a cron run.
    pub fn slot(mut self, slot: DateTime<Utc>) -> Self {
        self.ctx.slot = Some(slot);
        self
    }

    /// The run's timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.ctx.timeout = timeout;
        self
    }

    /// Shard `shard` of `shards` of a sharded run whose group key is `group`.
    pub fn shard(mut self, shard: u32, shards: u32, group: Uuid) -> Self {
        self.ctx.shard = Some((shard, shards));
        self.ctx.group = Some(group);
        self
    }

    /// A workflow step's upstream runs ([`JobContext::upstream`]).
    ///
    /// # Panics
    /// Once the run has started (its state is shared with the handler).
    pub fn upstream(mut self, runs: Vec<chime_shared::workflow::UpstreamRun>) -> Self {
        #[allow(clippy::expect_used)] // a test helper used before the run: its state is not shared yet
        let run = Arc::get_mut(&mut self.ctx.run).expect("upstream is set before the run");
        run.upstream = runs;
        self
    }

    /// The checkpoint an earlier attempt saved ([`JobContext::last_checkpoint`] returns it).
    ///
    /// # Panics
    /// If `value` does not serialise to JSON (a test's own input).
    pub fn last_checkpoint<T: Serialize + ?Sized>(self, value: &T) -> Self {
        #[allow(clippy::expect_used)] // a test helper: a value that cannot serialise is the test's bug
        let json = serde_json::to_string(value).expect("the checkpoint serialises to JSON");
        if let Ok(mut last) = self.ctx.run.checkpoint.lock() {
            *last = Some(json);
        }
        self
    }

    /// The context to pass to the handler (clones share this run: cancellation, result,
    /// checkpoints).
    pub fn context(&self) -> JobContext {
        self.ctx.clone()
    }

    /// Cancels the run, as a worker does at its timeout or at shutdown
    /// ([`JobContext::cancelled`] returns).
    pub fn cancel(&self) {
        self.ctx.cancel.cancel();
    }

    /// The result the handler set ([`JobContext::set_result`]), or the typed handler's return
    /// value; `None` if it set none, or if it did not serialise.
    pub fn result(&self) -> Option<serde_json::Value> {
        self.ctx.run.result.lock().ok()?.clone()?.ok()
    }

    /// The checkpoints the handler saved, in order.
    pub fn checkpoints(&self) -> Vec<serde_json::Value> {
        let Some(kept) = &self.ctx.run.kept else { return Vec::new() };
        let Ok(kept) = kept.lock() else { return Vec::new() };
        kept.iter().filter_map(|json| serde_json::from_str(json).ok()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JobError;

    #[tokio::test]
    async fn a_test_run_reports_its_facts_cancels_and_keeps_nothing_it_was_not_given() {
        let group = Uuid::new_v4();
        let run = TestRun::new("report").queue("reports").attempt(3).max_attempts(4).shard(2, 8, group);
        let ctx = run.context();
        assert_eq!((ctx.job(), ctx.queue(), ctx.attempt(), ctx.max_attempts()), ("report", "reports", 3, 4));
        assert_eq!((ctx.shard(), ctx.group()), (Some((2, 8)), Some(group)));
        assert_eq!(ctx.last_checkpoint::<u64>(), None);
        assert!(!ctx.is_cancelled());
        run.cancel();
        ctx.cancelled().await;
        assert_eq!((run.result(), run.checkpoints()), (None, vec![]));
        // Larger than checkpoints.max_bytes: refused as in a worker, nothing kept.
        let e: JobError = ctx.checkpoint(&"x".repeat(70_000)).await.unwrap_err();
        assert!(e.to_string().contains("checkpoints.max_bytes"), "{e}");
        assert!(run.checkpoints().is_empty());
    }
}
