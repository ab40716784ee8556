//! The handler API: what a job sees, and how it says whether a failure is worth retrying.
//!
//! Handlers never see lapin or Redis types: they get a [`JobContext`] and the payload.

use futures_util::future::BoxFuture;
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Facts about the run in progress.
#[derive(Debug, Clone)]
pub struct JobContext {
    pub job: String,
    pub queue: String,
    /// Idempotency key: the same for every copy and retry of this run.
    pub key: Uuid,
    /// Id of this message instance.
    pub id: Uuid,
    /// 1 for the first attempt.
    pub attempt: u32,
    pub max_attempts: u32,
    /// Scheduled instant of a scheduled run.
    pub slot: Option<chrono::DateTime<chrono::Utc>>,
    /// Fencing token: strictly increases each time the key is claimed. A database that
    /// stores the highest fence seen per key can reject a stale (paused, then resumed) run.
    pub fence: u64,
    /// Handler timeout of this job.
    pub timeout: Duration,
    /// Cancelled when the run must stop (timeout, lost lease, shutdown deadline).
    pub cancel: CancellationToken,
}

/// How a handler failed.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Worth another attempt (network blip, busy dependency).
    #[error("transient: {0}")]
    Transient(String),
    /// Retrying cannot help (bad input, rejected by the remote side).
    #[error("permanent: {0}")]
    Permanent(String),
}

impl JobError {
    pub fn transient(e: impl std::fmt::Display) -> Self {
        Self::Transient(e.to_string())
    }
    pub fn permanent(e: impl std::fmt::Display) -> Self {
        Self::Permanent(e.to_string())
    }
}

/// A job handler. Implemented for you by [`handler_fn`] and [`raw_handler_fn`].
pub trait Handler: Send + Sync + 'static {
    fn call(&self, ctx: JobContext, payload: serde_json::Value) -> BoxFuture<'static, Result<(), JobError>>;
}

struct FnHandler<F>(F);

impl<F, Fut> Handler for FnHandler<F>
where
    F: Fn(JobContext, serde_json::Value) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), JobError>> + Send + 'static,
{
    fn call(&self, ctx: JobContext, payload: serde_json::Value) -> BoxFuture<'static, Result<(), JobError>> {
        Box::pin((self.0)(ctx, payload))
    }
}

/// A handler over the raw JSON payload.
pub fn raw_handler_fn<F, Fut>(f: F) -> Arc<dyn Handler>
where
    F: Fn(JobContext, serde_json::Value) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), JobError>> + Send + 'static,
{
    Arc::new(FnHandler(f))
}

/// A handler over a typed payload. A payload that does not deserialise into `P` is a
/// permanent failure (retrying the same bytes cannot help).
pub fn handler_fn<P, F, Fut>(f: F) -> Arc<dyn Handler>
where
    P: DeserializeOwned + Send + 'static,
    F: Fn(JobContext, P) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), JobError>> + Send + 'static,
{
    let f = Arc::new(f);
    raw_handler_fn(move |ctx, value| {
        let f = f.clone();
        async move {
            let payload: P = serde_json::from_value(value).map_err(|e| {
                JobError::Permanent(format!("payload does not match the handler's type: {e}"))
            })?;
            f(ctx, payload).await
        }
    })
}

/// Job name → handler.
#[derive(Clone, Default)]
pub struct Registry {
    handlers: HashMap<String, Arc<dyn Handler>>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `handler` for `job` (replacing an earlier one).
    pub fn register(&mut self, job: impl Into<String>, handler: Arc<dyn Handler>) -> &mut Self {
        self.handlers.insert(job.into(), handler);
        self
    }

    pub fn get(&self, job: &str) -> Option<Arc<dyn Handler>> {
        self.handlers.get(job).cloned()
    }

    pub fn contains(&self, job: &str) -> bool {
        self.handlers.contains_key(job)
    }

    /// Registered job names and their handlers.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Arc<dyn Handler>)> {
        self.handlers.iter().map(|(k, v)| (k.as_str(), v))
    }
}
