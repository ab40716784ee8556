//! The handler API: what a job sees ([`JobContext`]), how it fails ([`JobError`]), and how
//! handlers are registered ([`Registry`]) — typed ([`Registry::job`], for a [`Job`] type,
//! with shared [`State`]) or over raw JSON ([`Registry::register`], for `exec`-style names).
//!
//! Handlers never see lapin or Redis types.

use chime_shared::job::{Job, JobOptions};
use futures_util::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Facts about the run in progress, and its cancellation.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct JobContext {
    pub(crate) job: String,
    pub(crate) queue: String,
    pub(crate) key: Uuid,
    pub(crate) id: Uuid,
    pub(crate) attempt: u32,
    pub(crate) max_attempts: u32,
    pub(crate) slot: Option<chrono::DateTime<chrono::Utc>>,
    pub(crate) fence: u64,
    pub(crate) timeout: Duration,
    pub(crate) cancel: CancellationToken,
    pub(crate) run: Arc<RunState>,
    /// `(shard, shards)` of a sharded run.
    pub(crate) shard: Option<(u32, u32)>,
    /// Key of the whole fanned-out run (sharded or broadcast).
    pub(crate) group: Option<Uuid>,
}

/// What a run keeps beside its facts: the checkpoint it resumed from (or saved last), the
/// result it set, and the way to the worker that saves checkpoints under the key's claim.
#[derive(Default)]
pub(crate) struct RunState {
    /// The last checkpoint, as JSON text.
    pub(crate) checkpoint: std::sync::Mutex<Option<String>>,
    /// The result set with `set_result` or returned by a typed handler; `Err` when it could
    /// not be turned into JSON.
    pub(crate) result: std::sync::Mutex<Option<Result<serde_json::Value, String>>>,
    /// Saves go to the run's owner task (which holds the claim), with their answer.
    pub(crate) saves: Option<tokio::sync::mpsc::UnboundedSender<SaveCheckpoint>>,
    /// `checkpoints.max_bytes`.
    pub(crate) max_bytes: usize,
    /// `results.max_bytes`.
    pub(crate) result_max_bytes: usize,
    /// `checkpoints.poll` (how often an `exec` job's checkpoint file is read).
    pub(crate) poll: Duration,
    /// Outside a worker ([`crate::testing::TestRun`]): checkpoints are kept here instead.
    pub(crate) kept: Option<std::sync::Mutex<Vec<String>>>,
    /// A workflow step's upstream runs.
    pub(crate) upstream: Vec<chime_shared::workflow::UpstreamRun>,
}

impl fmt::Debug for RunState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunState").field("saves", &self.saves.is_some()).finish_non_exhaustive()
    }
}

/// One checkpoint to save (JSON text), and where to say how it went.
pub(crate) struct SaveCheckpoint {
    pub(crate) json: String,
    pub(crate) done: tokio::sync::oneshot::Sender<Result<(), String>>,
}

impl JobContext {
    /// The job's name.
    pub fn job(&self) -> &str {
        &self.job
    }
    /// The queue the job came from.
    pub fn queue(&self) -> &str {
        &self.queue
    }
    /// Idempotency key: the same for every copy and retry of this run. Store it with the
    /// job's effect (unique) for exactly-once effects.
    pub fn key(&self) -> Uuid {
        self.key
    }
    /// Id of this message instance.
    pub fn id(&self) -> Uuid {
        self.id
    }
    /// 1 for the first attempt.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
    /// Attempts in all, first run included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }
    /// Scheduled instant of a scheduled run; `None` for ad-hoc runs.
    pub fn slot(&self) -> Option<chrono::DateTime<chrono::Utc>> {
        self.slot
    }
    /// Fencing token: strictly increases each time the key is claimed (microseconds of Redis
    /// time). A store that keeps the highest fence seen per key can reject a stale run.
    pub fn fence(&self) -> u64 {
        self.fence
    }
    /// This job's handler timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    /// A sharded run's shard and shard count, `(shard, shards)` with `shard` in
    /// `0..shards`: take the part of the work that is yours (say, ids where `id % shards ==
    /// shard`). `None` for a job that is not sharded.
    pub fn shard(&self) -> Option<(u32, u32)> {
        self.shard
    }
    /// Key of the whole run a shard or broadcast copy belongs to (its group record names
    /// every member); `None` for a run that did not fan out.
    pub fn group(&self) -> Option<Uuid> {
        self.group
    }
    /// A workflow step's upstream steps, as they ended: each one's step name, job, key,
    /// state (`done`; for an `on_complete` job also `dead` or `cancelled`) and the result
    /// its `done` run left. Empty for a job that waits for nothing.
    pub fn upstream(&self) -> &[chime_shared::workflow::UpstreamRun] {
        &self.run.upstream
    }
    /// The result upstream step `step` left (`None`: no such step, or no result kept).
    pub fn upstream_result(&self, step: &str) -> Option<&serde_json::Value> {
        self.run.upstream.iter().find(|u| u.step == step)?.result.as_ref()?.value()
    }
    /// Resolves when the run must stop: its timeout passed, the worker is shutting down past
    /// its drain deadline, or another owner took the key over. The handler then has
    /// `worker.cancel_grace` to return (a result it returns in that time stands) before its
    /// future is dropped.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await;
    }
    /// Whether the run must stop (see [`JobContext::cancelled`]).
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// The last checkpoint saved under this key, by an earlier attempt, a copy that was cut
    /// off (its worker died), or this run; `None` if there is none or it is not a `T`.
    ///
    /// ```
    /// # async fn f(ctx: chime_worker::JobContext) -> Result<(), chime_worker::JobError> {
    /// let start: u64 = ctx.last_checkpoint().unwrap_or(0);
    /// for row in start..1000 {
    ///     // … process row …
    ///     ctx.checkpoint(&(row + 1)).await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn last_checkpoint<T: DeserializeOwned>(&self) -> Option<T> {
        let text = self.run.checkpoint.lock().ok()?.clone()?;
        serde_json::from_str(&text).ok()
    }

    /// Saves `value` under the key, while this run holds it, for a retry or a redelivered copy
    /// to resume from ([`JobContext::last_checkpoint`]). A run that succeeds clears it. An
    /// error (Redis unreachable, the lease taken over, larger than `checkpoints.max_bytes`)
    /// leaves the previous checkpoint in place; `?` makes it a transient failure.
    pub async fn checkpoint<T: Serialize + ?Sized>(&self, value: &T) -> Result<(), JobError> {
        let json = serde_json::to_string(value)
            .map_err(|e| JobError::permanent(format!("checkpoint does not serialise: {e}")))?;
        self.save_checkpoint(json).await
    }

    /// Saves checkpoint JSON text (see [`JobContext::checkpoint`]).
    pub(crate) async fn save_checkpoint(&self, json: String) -> Result<(), JobError> {
        if json.len() > self.run.max_bytes {
            return Err(JobError::transient(format!(
                "checkpoint of {} bytes exceeds checkpoints.max_bytes ({})",
                json.len(),
                self.run.max_bytes
            )));
        }
        let Some(saves) = &self.run.saves else {
            let Some(kept) = &self.run.kept else {
                return Err(JobError::transient("checkpoints are not available outside a worker"));
            };
            if let Ok(mut kept) = kept.lock() {
                kept.push(json.clone());
            }
            if let Ok(mut last) = self.run.checkpoint.lock() {
                *last = Some(json);
            }
            return Ok(());
        };
        let (done, answer) = tokio::sync::oneshot::channel();
        saves
            .send(SaveCheckpoint { json: json.clone(), done })
            .map_err(|_| JobError::transient("the run has ended; checkpoint not saved"))?;
        answer
            .await
            .map_err(|_| JobError::transient("the run has ended; checkpoint not saved"))?
            .map_err(JobError::transient)?;
        if let Ok(mut last) = self.run.checkpoint.lock() {
            *last = Some(json);
        }
        Ok(())
    }

    /// The last checkpoint as JSON text.
    pub(crate) fn checkpoint_text(&self) -> Option<String> {
        self.run.checkpoint.lock().ok()?.clone()
    }

    /// Records that the run has a result that cannot be kept (say, too large to read).
    pub(crate) fn set_result_error(&self, why: String) {
        if let Ok(mut slot) = self.run.result.lock() {
            *slot = Some(Err(why));
        }
    }

    /// Sets the run's result: kept with the key's record when the run succeeds (up to
    /// `results.max_bytes` of JSON), read back by `EnqueueClient::wait`, `chime enqueue
    /// --wait` and `chime inspect`. A typed handler's return value is its result.
    pub fn set_result<T: Serialize + ?Sized>(&self, value: &T) {
        let value = serde_json::to_value(value).map_err(|e| format!("result does not serialise: {e}"));
        if let Ok(mut slot) = self.run.result.lock() {
            *slot = Some(value);
        }
    }
}

/// How a failure is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Transient,
    Permanent,
    RetryAfter(Duration),
    RateLimited(Duration),
}

/// The longest push-back a run is parked for ([`JobError::rate_limited`], an `http` job's
/// `Retry-After`): a day.
pub const MAX_PUSH_BACK: Duration = Duration::from_secs(86_400);

/// Why a handler failed, with the cause chain of the error it came from.
///
/// Any error converts with `?` and counts as transient (retried with the job's backoff):
///
/// ```
/// use chime_worker::JobError;
/// fn parse(s: &str) -> Result<u32, JobError> {
///     Ok(s.parse::<u32>()?) // ParseIntError → transient
/// }
/// assert!(!parse("x").unwrap_err().is_permanent());
/// let e = JobError::permanent("empty invoice");
/// assert!(e.is_permanent());
/// ```
pub struct JobError {
    kind: Kind,
    error: Box<dyn std::error::Error + Send + Sync>,
}

impl JobError {
    /// Worth another attempt (a network blip, a busy dependency).
    pub fn transient(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self { kind: Kind::Transient, error: error.into() }
    }
    /// Retrying cannot help (bad input, rejected by the remote side): straight to the DLQ.
    pub fn permanent(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self { kind: Kind::Permanent, error: error.into() }
    }
    /// Try again after `delay` instead of the job's backoff (a rate limit's `Retry-After`; at
    /// most the longest delay chime holds, about 8.5 years). It still counts as an attempt.
    pub fn retry_after(delay: Duration, error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self { kind: Kind::RetryAfter(delay), error: error.into() }
    }
    /// The downstream pushed back (HTTP 429, a quota): the run is parked for `retry_after`
    /// (at most [`MAX_PUSH_BACK`], a day) and runs again then, without counting as an
    /// attempt, and the job's rate limit (`jobs[].rate_limit`), if it has one, holds every
    /// worker's runs of its bucket (and tenant) until then.
    pub fn rate_limited(
        retry_after: Duration,
        error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self { kind: Kind::RateLimited(retry_after), error: error.into() }
    }
    /// The wait asked for by [`JobError::rate_limited`].
    pub fn rate_limited_for(&self) -> Option<Duration> {
        match self.kind {
            Kind::RateLimited(d) => Some(d),
            _ => None,
        }
    }
    /// Whether retrying cannot help.
    pub fn is_permanent(&self) -> bool {
        self.kind == Kind::Permanent
    }
    /// The delay asked for by [`JobError::retry_after`].
    pub fn retry_delay(&self) -> Option<Duration> {
        match self.kind {
            Kind::RetryAfter(d) => Some(d),
            _ => None,
        }
    }
    /// The error that caused this one.
    pub fn error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.error
    }
}

/// The error and its causes, `outer: inner: innermost`.
impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.error)?;
        let mut source = self.error.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

impl fmt::Debug for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobError({:?}: {self})", self.kind)
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for JobError {
    fn from(error: E) -> Self {
        Self::transient(error)
    }
}

/// A job handler over the raw JSON payload. Implemented for you by [`Registry::job`],
/// [`handler_fn`] and [`raw_handler_fn`]; implement it yourself to keep state in `self`
/// (the future may borrow it: no clone per call).
pub trait Handler: Send + Sync + 'static {
    /// Runs one attempt.
    fn call<'a>(&'a self, ctx: JobContext, payload: serde_json::Value)
    -> BoxFuture<'a, Result<(), JobError>>;
}

struct FnHandler<F>(F);

impl<F, Fut> Handler for FnHandler<F>
where
    F: Fn(JobContext, serde_json::Value) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), JobError>> + Send + 'static,
{
    fn call<'a>(
        &'a self,
        ctx: JobContext,
        payload: serde_json::Value,
    ) -> BoxFuture<'a, Result<(), JobError>> {
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
        async move { f(ctx, decode::<P>(value)?).await }
    })
}

fn decode<P: DeserializeOwned>(value: serde_json::Value) -> Result<P, JobError> {
    serde_json::from_value(value)
        .map_err(|e| JobError::permanent(format!("payload does not match the handler's type: {e}")))
}

/// Shared state given to typed handlers: registered once with [`Registry::state`], handed to
/// each call by clone (keep it cheap to clone: a pool, an `Arc`).
#[derive(Debug, Clone, Copy, Default)]
pub struct State<S>(pub S);

/// States by type (see [`Registry::state`]).
#[doc(hidden)]
#[derive(Clone, Default)]
pub struct States(Arc<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>);

impl States {
    fn get<S: Clone + Send + Sync + 'static>(&self) -> Option<S> {
        self.0.get(&TypeId::of::<S>()).and_then(|s| s.downcast_ref::<S>()).cloned()
    }
}

/// A function that handles job `J`: `Fn(JobContext, J)` or `Fn(JobContext, J, State<S>)`,
/// returning a future of `Result<R, JobError>` where `R` is `()` or any `Serialize` value (the
/// run's result, see [`JobContext::set_result`]). `Args` tells the forms apart; you never
/// name it.
pub trait JobFn<J, Args>: Send + Sync + 'static {
    /// Runs one attempt; `states` holds what [`Registry::state`] registered.
    #[doc(hidden)]
    fn run(&self, ctx: JobContext, job: J, states: &States) -> BoxFuture<'static, Result<(), JobError>>;
    /// The state type this function needs, checked when the worker is built.
    #[doc(hidden)]
    fn needs(states: &States) -> Result<(), &'static str>;
}

/// Keeps what a typed handler returned as the run's result (`()` is none).
fn returned<R: Serialize>(ctx: &JobContext, value: R) {
    match serde_json::to_value(&value) {
        Ok(serde_json::Value::Null) => {}
        Ok(v) => {
            if let Ok(mut slot) = ctx.run.result.lock() {
                *slot = Some(Ok(v));
            }
        }
        Err(e) => {
            if let Ok(mut slot) = ctx.run.result.lock() {
                *slot = Some(Err(format!("result does not serialise: {e}")));
            }
        }
    }
}

impl<F, Fut, J, R> JobFn<J, (R,)> for F
where
    F: Fn(JobContext, J) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<R, JobError>> + Send + 'static,
    R: Serialize + Send + 'static,
{
    fn run(&self, ctx: JobContext, job: J, _: &States) -> BoxFuture<'static, Result<(), JobError>> {
        let fut = self(ctx.clone(), job);
        Box::pin(async move {
            returned(&ctx, fut.await?);
            Ok(())
        })
    }
    fn needs(_: &States) -> Result<(), &'static str> {
        Ok(())
    }
}

impl<F, Fut, J, S, R> JobFn<J, (State<S>, R)> for F
where
    F: Fn(JobContext, J, State<S>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<R, JobError>> + Send + 'static,
    S: Clone + Send + Sync + 'static,
    R: Serialize + Send + 'static,
{
    fn run(&self, ctx: JobContext, job: J, states: &States) -> BoxFuture<'static, Result<(), JobError>> {
        match states.get::<S>() {
            Some(s) => {
                let fut = self(ctx.clone(), job, State(s));
                Box::pin(async move {
                    returned(&ctx, fut.await?);
                    Ok(())
                })
            }
            None => Box::pin(async {
                Err(JobError::permanent(format!("no state of type {}", std::any::type_name::<S>())))
            }),
        }
    }
    fn needs(states: &States) -> Result<(), &'static str> {
        states.get::<S>().map(drop).ok_or(std::any::type_name::<S>())
    }
}

struct TypedHandler<J, F, Args> {
    f: Arc<F>,
    states: States,
    _marker: std::marker::PhantomData<fn(J, Args)>,
}

impl<J: Job, F: JobFn<J, Args>, Args: 'static> Handler for TypedHandler<J, F, Args> {
    fn call<'a>(
        &'a self,
        ctx: JobContext,
        payload: serde_json::Value,
    ) -> BoxFuture<'a, Result<(), JobError>> {
        match decode::<J>(payload) {
            Ok(job) => self.f.run(ctx, job, &self.states),
            Err(e) => Box::pin(async { Err(e) }),
        }
    }
}

/// A registered handler: ready, or typed and bound to the states when it is taken out (so a
/// state may be registered before or after the handlers that use it).
#[derive(Clone)]
enum Entry {
    Ready(Arc<dyn Handler>),
    Typed {
        bind: Arc<dyn Fn(States) -> Arc<dyn Handler> + Send + Sync>,
        /// The state type the handler takes, if it is missing.
        needs: fn(&States) -> Result<(), &'static str>,
    },
}

/// Job name → handler, the options of jobs defined in Rust, and the shared states.
#[derive(Clone, Default)]
pub struct Registry {
    handlers: HashMap<String, Entry>,
    options: HashMap<String, JobOptions>,
    states: HashMap<TypeId, Arc<dyn Any + Send + Sync>>,
    /// Problems found while registering, reported when the worker is built.
    errors: Vec<String>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `state` for handlers that take `State<S>`, before or after them; a handler
    /// whose state is missing when the worker is built is an error naming the type.
    pub fn state<S: Clone + Send + Sync + 'static>(&mut self, state: S) -> &mut Self {
        self.states.insert(TypeId::of::<S>(), Arc::new(state));
        self
    }

    /// Registers `f` for job type `J`, under `J::NAME` with `J::options()` (a `[[jobs]]` entry
    /// of the same name overrides them):
    ///
    /// ```
    /// # use chime_worker::{JobContext, JobError, Registry, State};
    /// # use chime_shared::job::Job;
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct SendWelcome { user_id: u64 }
    /// impl Job for SendWelcome { const NAME: &'static str = "send_welcome"; }
    ///
    /// #[derive(Clone)]
    /// struct Mailer;
    ///
    /// async fn send_welcome(ctx: JobContext, job: SendWelcome, State(mailer): State<Mailer>) -> Result<(), JobError> {
    ///     let _ = (ctx.key(), job.user_id, mailer);
    ///     Ok(())
    /// }
    ///
    /// let mut registry = Registry::new();
    /// registry.state(Mailer).job(send_welcome);
    /// ```
    pub fn job<J: Job, Args: 'static, F: JobFn<J, Args>>(&mut self, f: F) -> &mut Self {
        let options = J::options();
        if let Err(e) = options.validate() {
            self.errors.push(format!("job {:?}: {}::options().{e}", J::NAME, std::any::type_name::<J>()));
        }
        let f = Arc::new(f);
        let bind = move |states: States| -> Arc<dyn Handler> {
            Arc::new(TypedHandler::<J, F, Args> { f: f.clone(), states, _marker: std::marker::PhantomData })
        };
        let entry = Entry::Typed { bind: Arc::new(bind), needs: F::needs };
        self.handlers.insert(J::NAME.to_string(), entry);
        self.options.insert(J::NAME.to_string(), options);
        self
    }

    /// Registers `handler` for the job (or `[[jobs]] handler = "…"` name) `name`, replacing an
    /// earlier one.
    pub fn register(&mut self, name: impl Into<String>, handler: Arc<dyn Handler>) -> &mut Self {
        self.handlers.insert(name.into(), Entry::Ready(handler));
        self
    }

    /// The handler registered under `name`, with the states registered so far.
    pub fn get(&self, name: &str) -> Option<Arc<dyn Handler>> {
        self.handlers.get(name).map(|entry| self.bound(entry))
    }

    fn bound(&self, entry: &Entry) -> Arc<dyn Handler> {
        match entry {
            Entry::Ready(handler) => handler.clone(),
            Entry::Typed { bind, .. } => bind(self.states()),
        }
    }

    fn states(&self) -> States {
        States(Arc::new(self.states.clone()))
    }

    /// Whether a handler is registered under `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.handlers.contains_key(name)
    }

    /// Registered names and their handlers (with the states registered so far).
    pub fn iter(&self) -> impl Iterator<Item = (&str, Arc<dyn Handler>)> {
        self.handlers.iter().map(|(k, v)| (k.as_str(), self.bound(v)))
    }

    /// The options of a job registered with [`Registry::job`].
    pub fn options(&self, name: &str) -> Option<&JobOptions> {
        self.options.get(name)
    }

    /// The queues of the jobs registered with [`Registry::job`].
    pub fn job_queues(&self) -> impl Iterator<Item = &str> {
        self.options.values().map(JobOptions::queue_name)
    }

    /// What keeps the registry from making a worker: options a config entry could not have,
    /// and states a handler takes that were never registered.
    pub(crate) fn errors(&self) -> Vec<String> {
        let states = self.states();
        let mut errors = self.errors.clone();
        let mut missing: Vec<_> = self
            .handlers
            .iter()
            .filter_map(|(name, entry)| match entry {
                Entry::Typed { needs, .. } => needs(&states).err().map(|ty| (name, ty)),
                Entry::Ready(_) => None,
            })
            .map(|(name, ty)| {
                format!("job {name:?} takes State<{ty}>, which was never registered (Registry::state)")
            })
            .collect();
        missing.sort();
        errors.extend(missing);
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> JobContext {
        JobContext {
            job: "send_welcome".into(),
            queue: "default".into(),
            key: Uuid::nil(),
            id: Uuid::nil(),
            attempt: 2,
            max_attempts: 5,
            slot: None,
            fence: 7,
            timeout: Duration::from_secs(1),
            cancel: CancellationToken::new(),
            run: Arc::default(),
            shard: None,
            group: None,
        }
    }

    #[derive(Debug, serde::Serialize, serde::Deserialize)]
    struct SendWelcome {
        user_id: u64,
    }
    impl Job for SendWelcome {
        const NAME: &'static str = "send_welcome";
        fn options() -> JobOptions {
            JobOptions::default().queue("mail").max_attempts(9)
        }
    }

    #[derive(Debug)]
    struct Outer(std::io::Error);
    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("sending the welcome mail")
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    fn fails_with_question_mark() -> Result<(), JobError> {
        Err(Outer(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "smtp refused")))?;
        Ok(())
    }

    #[test]
    fn errors_convert_with_question_mark_keep_their_causes_and_say_how_to_retry() {
        let e = fails_with_question_mark().unwrap_err();
        assert!(!e.is_permanent() && e.retry_delay().is_none(), "`?` is transient");
        assert_eq!(e.to_string(), "sending the welcome mail: smtp refused", "the chain is kept");
        let inner = e.error().source().and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(inner.map(std::io::Error::kind), Some(std::io::ErrorKind::ConnectionRefused));
        assert!(JobError::permanent("bad input").is_permanent());
        let later = JobError::retry_after(Duration::from_secs(30), "429");
        assert_eq!(later.retry_delay(), Some(Duration::from_secs(30)));
        assert!(!later.is_permanent());
    }

    #[tokio::test]
    async fn typed_jobs_get_their_payload_state_and_options() {
        #[derive(Clone)]
        struct Seen(Arc<std::sync::Mutex<Vec<u64>>>);
        async fn handle(ctx: JobContext, job: SendWelcome, State(seen): State<Seen>) -> Result<(), JobError> {
            assert_eq!((ctx.attempt(), ctx.fence()), (2, 7));
            seen.0.lock().map_err(|_| JobError::transient("poisoned"))?.push(job.user_id);
            Ok(())
        }
        let seen = Seen(Arc::default());
        let mut registry = Registry::new();
        registry.state(seen.clone()).job(handle);
        assert!(registry.errors().is_empty());
        assert_eq!(registry.options("send_welcome").map(JobOptions::queue_name), Some("mail"));
        assert_eq!(registry.job_queues().collect::<Vec<_>>(), ["mail"]);
        let h = registry.get("send_welcome").unwrap();
        h.call(ctx(), serde_json::json!({"user_id": 42})).await.unwrap();
        assert_eq!(*seen.0.lock().unwrap(), [42]);
        // A payload of another shape cannot succeed on a retry: permanent.
        let e = h.call(ctx(), serde_json::json!({"user": "x"})).await.unwrap_err();
        assert!(e.is_permanent() && e.to_string().contains("payload does not match"), "{e}");
    }

    #[tokio::test]
    async fn a_typed_handler_returns_its_result_and_unit_leaves_none() {
        #[derive(serde::Serialize)]
        struct Receipt {
            sent_to: u64,
        }
        async fn receipt(_: JobContext, job: SendWelcome) -> Result<Receipt, JobError> {
            Ok(Receipt { sent_to: job.user_id })
        }
        /// Runs `send_welcome` as registered in `registry` and returns its context.
        async fn call(registry: Registry) -> JobContext {
            let c = ctx();
            registry
                .get("send_welcome")
                .unwrap()
                .call(c.clone(), serde_json::json!({"user_id": 9}))
                .await
                .unwrap();
            c
        }
        let mut registry = Registry::new();
        registry.job(receipt);
        let c = call(registry).await;
        let kept = c.run.result.lock().unwrap().take();
        assert_eq!(kept, Some(Ok(serde_json::json!({"sent_to": 9}))));

        async fn nothing(_: JobContext, _: SendWelcome) -> Result<(), JobError> {
            Ok(())
        }
        let mut registry = Registry::new();
        registry.job(nothing);
        let c = call(registry).await;
        assert!(c.run.result.lock().unwrap().is_none(), "() is no result");
        // Outside a worker there is nowhere to save a checkpoint: an error, not a panic.
        assert!(c.checkpoint(&1).await.is_err());
        assert_eq!(c.last_checkpoint::<u64>(), None);
    }

    #[tokio::test]
    async fn a_state_may_come_before_or_after_its_handler_and_a_missing_one_is_named() {
        #[derive(Clone)]
        struct Pool(u64);
        async fn handle(_: JobContext, job: SendWelcome, State(pool): State<Pool>) -> Result<u64, JobError> {
            Ok(job.user_id + pool.0)
        }
        let mut registry = Registry::new();
        registry.job(handle);
        let errors = registry.errors();
        assert_eq!(errors.len(), 1);
        assert!(errors[0].contains("send_welcome") && errors[0].contains("Pool"), "{errors:?}");
        registry.state(Pool(100));
        assert!(registry.errors().is_empty());
        let c = ctx();
        registry
            .get("send_welcome")
            .unwrap()
            .call(c.clone(), serde_json::json!({"user_id": 1}))
            .await
            .unwrap();
        assert_eq!(*c.run.result.lock().unwrap(), Some(Ok(serde_json::json!(101))));
    }
}
