//! `EnqueueClient`: validated, confirmed publishing of ad-hoc jobs.
//!
//! A job is enqueued only when the broker confirmed it and did not return it: an unroutable
//! message is an error, never a silent drop. Validation (unknown job, bad queue, oversized
//! envelope) happens before anything is published, so a bad batch publishes nothing.

pub(crate) mod flush;
pub(crate) mod workflow;

use crate::spool::SpoolError;
use chime_shared::amqp::{self, AmqpError};
use chime_shared::config::{Config, Priority, ValidConfig, valid_name};
use chime_shared::delay;
use chime_shared::envelope::{self, Envelope, Source};
use chime_shared::job::{Job, JobOptions};
use chime_shared::telemetry;
use chime_shared::topology::{self, Names, TopologyError};
use chime_shared::trace::{self, TraceContext};
use chrono::{DateTime, Utc};
use lapin::{BasicProperties, Channel, Connection};
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use uuid::Uuid;

/// One ad-hoc job to push, by name (a `[[jobs]]` entry) or built from a typed [`Job`] with
/// [`EnqueueRequest::job`].
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnqueueRequest {
    /// The job's name.
    #[serde(skip)]
    pub job: String,
    /// JSON payload; `None` uses the job's configured `payload` (or `null`).
    #[serde(default)]
    pub payload: Option<serde_json::Value>,
    /// Caller's idempotency key: the same key for the same job runs once.
    #[serde(default)]
    pub key: Option<String>,
    /// Overrides the job's queue.
    #[serde(default)]
    pub queue: Option<String>,
    /// Overrides the job's `max_attempts`.
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Overrides the job's `priority` (the queue must have priority levels).
    #[serde(default)]
    pub priority: Option<Priority>,
    /// Deliver after this long (1 s granularity, rounded up).
    #[serde(skip)]
    pub delay: Option<Duration>,
    /// Deliver at this instant (a past instant means now).
    #[serde(skip)]
    pub at: Option<DateTime<Utc>>,
    /// What a job defined in Rust declares about itself (queue, attempts); a `[[jobs]]` entry
    /// of the same name overrides it. `None` for jobs known only by name.
    #[serde(skip)]
    pub options: Option<JobOptions>,
    /// Why a typed job cannot be enqueued (its payload does not serialise, its options are
    /// invalid): `(field, message)`, reported by `prepare` (so `enqueue` fails, naming it).
    #[serde(skip)]
    invalid: Option<(String, String)>,
    /// The W3C trace context the run is to continue; `None`: the current span's, when a
    /// tracing backend is installed (`chime_shared::trace`).
    #[serde(skip)]
    pub trace: Option<TraceContext>,
    /// Debounce: delivered after this window, and of the enqueues of its key within it only
    /// the last runs, with its payload (needs a key).
    #[serde(skip)]
    pub debounce: Option<Duration>,
    /// Replace: supersedes the copies of its key still waiting (queued or delayed); the newest
    /// enqueue runs, with its payload (needs a key).
    #[serde(skip)]
    pub replace: bool,
}

impl EnqueueRequest {
    /// A request for the job named `job` (a `[[jobs]]` entry of the config).
    pub fn new(job: impl Into<String>) -> Self {
        Self { job: job.into(), ..Default::default() }
    }

    /// A request for a typed job: its name and options from the [`Job`] impl, its payload the
    /// job itself. Chain `.key(…)`, `.delay(…)` as for any request. A job whose payload does
    /// not serialise, or whose options are invalid, fails when it is enqueued
    /// ([`EnqueueError::Invalid`] naming the field).
    pub fn job<J: Job>(job: &J) -> Self {
        let options = J::options();
        let mut invalid =
            options.validate().err().map(|e| (format!("{}::options().{}", J::NAME, e.field), e.message));
        let payload = match serde_json::to_value(job) {
            Ok(payload) => Some(payload),
            Err(e) => {
                invalid = Some(("payload".into(), format!("{} does not serialise: {e}", J::NAME)));
                None
            }
        };
        Self { job: J::NAME.to_string(), payload, options: Some(options), invalid, ..Default::default() }
    }

    /// Sets the payload (JSON).
    pub fn payload(mut self, payload: serde_json::Value) -> Self {
        self.payload = Some(payload);
        self
    }
    /// Sets the caller's idempotency key: the same key for the same job runs once.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }
    /// Overrides the job's queue.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }
    /// Delivers after `delay` (1 s granularity, rounded up).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }
    /// Delivers at `at` (a past instant means now).
    pub fn at(mut self, at: DateTime<Utc>) -> Self {
        self.at = Some(at);
        self
    }
    /// Continues the trace `trace` (say, the `traceparent` of the HTTP request that enqueues)
    /// instead of the current span's: the worker's run span becomes its child.
    pub fn trace(mut self, trace: TraceContext) -> Self {
        self.trace = Some(trace);
        self
    }
    /// Debounces: delivered after `window`; of several enqueues of this key within it, only
    /// the last runs, with its payload (a key already `done` stays done). Needs a key.
    pub fn debounce(mut self, window: Duration) -> Self {
        self.debounce = Some(window);
        self
    }
    /// Replaces: this enqueue supersedes the copies of its key still waiting (queued or
    /// delayed); they are dropped when they arrive and this one runs, with its payload. A copy
    /// already running is not stopped (see `chime cancel`). Needs a key.
    pub fn replace(mut self) -> Self {
        self.replace = true;
        self
    }
    /// Whether this enqueue supersedes earlier copies of its key (debounce or replace).
    pub fn supersedes(&self) -> bool {
        self.replace || self.debounce.is_some()
    }
    /// Overrides the job's attempts.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }
    /// Delivers ahead of (`High`) or behind (`Low`) the queue's other jobs when a backlog
    /// exists; the queue must have priority levels (a `[[jobs]]` entry on it sets `priority`).
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }
}

/// What [`EnqueueClient::enqueue`] takes: an [`EnqueueRequest`], or any typed [`Job`].
pub trait IntoRequest {
    /// The request to publish.
    fn into_request(self) -> EnqueueRequest;
}

impl IntoRequest for EnqueueRequest {
    fn into_request(self) -> EnqueueRequest {
        self
    }
}

impl<J: Job> IntoRequest for J {
    fn into_request(self) -> EnqueueRequest {
        EnqueueRequest::job(&self)
    }
}

/// An envelope ready to publish, with its delivery delay.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The message body.
    pub envelope: Envelope,
    /// Delivery delay (zero: publish to the work exchange directly).
    pub delay: Duration,
    /// A queue the config does not declare (an explicit `--queue`): it must exist on the
    /// broker before anything is published (`EnqueueClient` checks with a passive declare).
    pub unverified_queue: Option<String>,
    /// The queue of a job defined in Rust that the config does not declare: the code is its
    /// declaration, so `EnqueueClient` declares it (once) before publishing.
    pub declare_queue: Option<String>,
}

/// A prepared job encoded once, without its envelope: the body and what its message needs.
/// What `chime enqueue --batch` keeps between validating a batch and publishing it
/// ([`EnqueueClient::send_encoded`]): ~470 bytes a job for a small payload where the envelope,
/// its payload's map included, takes ~1.1 KiB, and the encoding is done where the batch is
/// validated (on two threads, before the broker is ready) instead of on the publishing task.
/// As for [`EnqueueClient::send_batch`], the queues are the caller's to check first.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// The message body ([`Envelope::encode`]).
    pub body: Vec<u8>,
    /// [`Envelope::route`].
    route: String,
    /// Delivery delay (zero: straight to the work exchange).
    delay: Duration,
    key: Uuid,
    job: String,
    timestamp: u64,
    /// [`Prepared::declare_queue`], for the spool.
    declare_queue: Option<String>,
}

impl Encoded {
    /// `p`'s body and message, its envelope dropped.
    pub fn new(p: Prepared) -> Self {
        let mut body = p.envelope.encode();
        body.shrink_to_fit();
        let Envelope { key, job, .. } = &p.envelope;
        Self {
            route: p.envelope.route(),
            delay: p.delay,
            key: *key,
            job: job.clone(),
            timestamp: p.envelope.timestamp(),
            body,
            declare_queue: p.declare_queue,
        }
    }

    /// The job's idempotency key.
    pub fn key(&self) -> Uuid {
        self.key
    }

    /// The prepared job again, decoded from the body (to spool it).
    pub fn prepared(&self) -> Result<Prepared, EnqueueError> {
        let envelope = Envelope::decode(&self.body).map_err(|e| EnqueueError::Invalid {
            field: "body".into(),
            message: format!("an encoded job does not decode: {e}"),
        })?;
        let declare_queue = self.declare_queue.clone();
        Ok(Prepared { envelope, delay: self.delay, unverified_queue: None, declare_queue })
    }
}

/// A confirmed job.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Enqueued {
    /// Id of the message (of the first member, for a run that fanned out).
    pub id: Uuid,
    /// Idempotency key of the run (of the whole run, for one that fanned out: its group
    /// record names the members; `EnqueueClient::wait` waits for all of them).
    pub key: Uuid,
    /// Job name.
    pub job: String,
    /// Queue it was published to.
    pub queue: String,
    /// The members' keys, for a sharded or broadcast job (empty otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<Uuid>,
    /// Whether the broker confirmed it, or the local spool holds it.
    pub delivery: Delivery,
}

/// How an enqueued job was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// The broker confirmed it.
    Confirmed,
    /// The broker did not confirm it within `amqp.publish_timeout` (or earlier jobs of this
    /// producer are still spooled, and it keeps their order): it is written to the local spool
    /// (`[producer] spool_dir`, with `fsync`), and a flush publishes it later under the same
    /// key, id and `enqueued_at`.
    Spooled,
}

impl Delivery {
    /// `confirmed` or `spooled`, as the HTTP API and `chime enqueue` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Delivery::Confirmed => "confirmed",
            Delivery::Spooled => "spooled",
        }
    }
}

/// Result of a batch: how many were confirmed, and the first failure if any.
#[derive(Debug)]
pub struct BatchReport {
    /// Jobs in the batch.
    pub total: usize,
    /// Jobs the broker confirmed.
    pub confirmed: usize,
    /// Jobs written to the local spool instead (messages, for sharded or broadcast jobs).
    pub spooled: usize,
    /// The first failure (publishing stops there).
    pub error: Option<EnqueueError>,
}

/// Why a job was not enqueued. Nothing was published when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    /// The job is neither in the config nor a typed job.
    #[error("unknown job {0:?} (not in the config's [[jobs]])")]
    UnknownJob(String),
    /// An explicit queue exists neither in the config nor on the broker.
    #[error(
        "queue {queue:?} is neither declared by this config nor present on the broker ({detail}): \
         a job published to it could never be delivered"
    )]
    NoSuchQueue {
        /// Logical queue name.
        queue: String,
        /// The broker's answer to the passive declare.
        detail: String,
    },
    /// A field of the request is invalid.
    #[error("invalid {field}: {message}")]
    Invalid {
        /// Which field (`key`, `delay`, `max_attempts`, …).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The encoded envelope is above `amqp.max_message_bytes`.
    #[error("envelope of job {job} is {size} bytes, above amqp.max_message_bytes ({max})")]
    TooLarge {
        /// Job name.
        job: String,
        /// Encoded size in bytes.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// A broadcast job, and no live worker consumes its queue: nobody to run it.
    #[error(
        "broadcast: no live worker consumes queue {queue:?}, so nothing would run (start one, or resume the queue)"
    )]
    NoWorkers {
        /// The job's queue.
        queue: String,
    },
    /// Redis, which a sharded or broadcast job needs (its group record), could not be asked.
    #[error("redis: {0}")]
    Redis(String),
    /// Declaring the job's queue or the delay chain failed.
    #[error(transparent)]
    Topology(#[from] Box<TopologyError>),
    /// Publishing failed or was not confirmed.
    #[error(transparent)]
    Amqp(#[from] Box<AmqpError>),
    /// A batch stopped by its stop flag ([`EnqueueClient::with_stop`]): what was published
    /// before was confirmed (the report's `confirmed`, the first in order); nothing after it
    /// was published.
    #[error("interrupted: the rest of the batch was not published")]
    Interrupted,
    /// The broker did not take the job and the local spool could not either (full, or its
    /// directory unwritable): nothing was kept. Or the spool could not be opened or flushed.
    #[error("{context}: {source}")]
    Spool {
        /// What the spool was asked to do, and why (a job the broker did not take).
        context: String,
        /// What the spool said.
        source: SpoolError,
    },
}

impl From<AmqpError> for EnqueueError {
    fn from(e: AmqpError) -> Self {
        Self::Amqp(Box::new(e))
    }
}

impl From<TopologyError> for EnqueueError {
    fn from(e: TopologyError) -> Self {
        Self::Topology(Box::new(e))
    }
}

impl EnqueueError {
    /// The broker could not be reached, did not confirm, or refused a declaration: what the
    /// spool is for (a message it returned as unroutable is not: publishing it later would
    /// not route it either).
    pub fn is_broker(&self) -> bool {
        match self {
            Self::Amqp(e) => e.is_transient(),
            Self::Topology(e) => !matches!(**e, TopologyError::Inequivalent { .. }),
            _ => false,
        }
    }

    /// Errors in what the caller asked for (exit code 2), as opposed to run-time failures.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            Self::UnknownJob(_) | Self::Invalid { .. } | Self::TooLarge { .. } | Self::NoSuchQueue { .. }
        )
    }
}

/// Publishes ad-hoc jobs with confirms. Holds one connection and a pool of confirm channels
/// (each publish or batch has a channel to itself while its confirms are outstanding, so a
/// returned message is always matched to its own publish), and replaces them when they break: a publish cut off by a lost connection is sent again on a
/// new one (across `amqp.url`), with the same envelope and key, so a copy the broker did
/// receive is absorbed as a duplicate by the workers, never run as a second job.
pub struct EnqueueClient {
    /// The connection, made at the first publish when the broker could not be reached at
    /// `connect` (a client with a spool starts anyway).
    session: tokio::sync::RwLock<Option<Arc<Session>>>,
    /// The local spool (`[producer] spool_dir`).
    spooler: Option<Arc<flush::Spooler>>,
    pub(crate) config: ValidConfig,
    pub(crate) names: Names,
    /// Queues of typed jobs already declared by this client.
    declared: Mutex<HashSet<String>>,
    /// Redis, for [`EnqueueClient::wait`] (connected on first use).
    pub(crate) redis: tokio::sync::OnceCell<chime_shared::history::HistoryReader>,
    /// Set to stop the batches being published ([`Self::with_stop`]).
    stop: Arc<std::sync::atomic::AtomicBool>,
}

/// A connection and its confirm channels.
struct Session {
    conn: Arc<Connection>,
    channels: amqp::ChannelPool,
}

/// How a batch makes each item a message: exchange, routing key, body (the item's own when it
/// holds one encoded), properties.
type Wire<'a, T> = dyn for<'i> Fn(&'i T) -> Message<'i> + Sync + 'a;

/// One message of a batch: exchange, routing key, body, properties.
type Message<'i> = (String, String, std::borrow::Cow<'i, [u8]>, BasicProperties);

/// `f` as a [`Wire`]: a closure's signature is made to borrow its body from its item.
fn wire<T, F: for<'i> Fn(&'i T) -> Message<'i>>(f: F) -> F {
    f
}

/// Confirm channels a client opens at most: concurrent publishes and batches beyond it wait.
const CHANNELS: usize = 64;

/// Outstanding confirms in a pipelined batch.
const BATCH_WINDOW: usize = 4096;

/// New connections one call may make before it gives up.
const MAX_RECONNECTS: u32 = 5;

/// Whether `e`, seen on `session`, is cured by a new connection: the publish or its confirm
/// failed because the channel or connection went away, no channel could be opened on a dead
/// connection, or no confirm came and the connection is dead. (No confirm on a live connection
/// is a blocked broker: a new one would not help.)
fn needs_new_connection(e: &AmqpError, session: &Session) -> bool {
    match e {
        AmqpError::Publish { .. } => true,
        AmqpError::Channel(_) => !session.conn.status().connected(),
        AmqpError::ConfirmTimeout(_) => !session.conn.status().connected(),
        _ => false,
    }
}

/// Wait before the `n`th new connection (1-based): 0.25 s, 0.5 s, 1 s, 2 s, 2 s.
fn reconnect_delay(n: u32) -> Duration {
    Duration::from_millis(250u64 << n.saturating_sub(1).min(3))
}

impl EnqueueClient {
    /// Connects, declares the topology of every configured queue, and enables confirms.
    ///
    /// With a spool (`[producer] spool_dir`), a broker that cannot be reached is not an error:
    /// jobs go to the spool until it answers, and a flusher in the background publishes them
    /// (and what producers that have died left in the directory).
    pub async fn connect(config: ValidConfig) -> Result<Self, EnqueueError> {
        let spooler = match &config.producer.spool_dir {
            Some(dir) => Some(Arc::new(flush::Spooler::open(&config, dir).map_err(|source| {
                EnqueueError::Spool { context: "opening the spool (producer.spool_dir)".into(), source }
            })?)),
            None => None,
        };
        let session = match Self::open(&config, &[]).await {
            Ok(s) => Some(Arc::new(s)),
            Err(e) if spooler.is_some() && e.is_broker() => {
                tracing::warn!(error = %e, "broker unreachable; jobs go to the spool until it answers");
                None
            }
            Err(e) => return Err(e),
        };
        let client = Self::with_session(config, session, spooler);
        if let Some(s) = &client.spooler {
            s.start_flusher();
        }
        Ok(client)
    }

    /// A client without a spool that connects at its first publish (the flusher's).
    pub(crate) fn lazy(config: ValidConfig) -> Self {
        Self::with_session(config, None, None)
    }

    fn with_session(
        config: ValidConfig,
        session: Option<Arc<Session>>,
        spooler: Option<Arc<flush::Spooler>>,
    ) -> Self {
        let names = Names::new(&config.prefix);
        Self {
            session: tokio::sync::RwLock::new(session),
            spooler,
            config,
            names,
            declared: Mutex::new(HashSet::new()),
            redis: tokio::sync::OnceCell::new(),
            stop: Arc::default(),
        }
    }

    /// This client, its batches stopped by `flag` (a Ctrl-C handler sets it): once it is set,
    /// a batch being published (`enqueue_batch`, `send_batch`, packed or not) sends nothing
    /// more, waits for the confirms of what it sent, and reports them with
    /// [`EnqueueError::Interrupted`]; so does a batch started later. Nothing is spooled.
    pub fn with_stop(mut self, flag: Arc<std::sync::atomic::AtomicBool>) -> Self {
        self.stop = flag;
        self
    }

    /// The local spool, when `[producer] spool_dir` is set.
    pub fn spool(&self) -> Option<&crate::spool::Spool> {
        self.spooler.as_deref().map(|s| s.spool())
    }

    /// Whether jobs of this client wait in the spool: until its flusher has published them,
    /// new jobs are spooled behind them.
    pub fn spool_backlog(&self) -> bool {
        self.spooler.as_ref().is_some_and(|s| s.backlog())
    }

    /// A new connection with the topology declared (configured queues and `extra`) and a
    /// channel in confirm mode.
    async fn open(config: &Config, extra: &[String]) -> Result<Session, EnqueueError> {
        let conn = amqp::connect(&config.amqp, "chime-enqueue").await?;
        let mut queues = config.all_queues();
        queues.extend(extra.iter().filter(|q| !queues.contains(q)).cloned().collect::<Vec<_>>());
        topology::declare(&conn, config, &queues).await?;
        let conn = Arc::new(conn);
        let channels = amqp::ChannelPool::new(conn.clone(), CHANNELS);
        // One channel now, so that a broker refusing channels fails the connect, not a publish.
        channels.lend().await?.settled();
        Ok(Session { conn, channels })
    }

    /// The session, connecting first if there is none yet.
    async fn session(&self) -> Result<Arc<Session>, EnqueueError> {
        if let Some(s) = self.session.read().await.as_ref() {
            return Ok(s.clone());
        }
        let mut current = self.session.write().await;
        if let Some(s) = current.as_ref() {
            return Ok(s.clone());
        }
        let fresh = Arc::new(Self::open(&self.config, &self.declared_queues()).await?);
        tracing::info!("enqueue client connected");
        *current = Some(fresh.clone());
        Ok(fresh)
    }

    fn declared_queues(&self) -> Vec<String> {
        self.declared.lock().map(|d| d.iter().cloned().collect()).unwrap_or_default()
    }

    /// Replaces `broken` with a new session, unless another call already did (then that one
    /// is used).
    async fn reconnect(&self, broken: &Arc<Session>, attempt: u32) -> Result<Arc<Session>, EnqueueError> {
        let mut current = self.session.write().await;
        if let Some(c) = current.as_ref()
            && !Arc::ptr_eq(c, broken)
        {
            return Ok(c.clone());
        }
        tokio::time::sleep(reconnect_delay(attempt)).await;
        let fresh = Arc::new(Self::open(&self.config, &self.declared_queues()).await?);
        tracing::info!(attempt, "enqueue client reconnected");
        *current = Some(fresh.clone());
        Ok(fresh)
    }

    /// Builds and validates the envelope for `req` without publishing.
    pub fn prepare(&self, req: &EnqueueRequest) -> Result<Prepared, EnqueueError> {
        prepare(&self.config, req)
    }

    /// Publishes one job — an [`EnqueueRequest`] or a typed [`Job`] — and waits for its
    /// confirm.
    ///
    /// With a spool, a job the broker does not confirm within `amqp.publish_timeout` is
    /// spooled instead ([`Delivery::Spooled`]); so is every job while earlier ones of this
    /// client are still spooled (they keep their order).
    pub async fn enqueue(&self, req: impl IntoRequest) -> Result<Enqueued, EnqueueError> {
        let req = req.into_request();
        if !trace::enabled() {
            return self.enqueue_one(&req).await;
        }
        // A span of its own, which the run's span on the worker continues.
        let span = tracing::info_span!("enqueue", otel.kind = "producer", job = %req.job,
            key = tracing::field::Empty, delivery = tracing::field::Empty);
        let done = tracing::Instrument::instrument(self.enqueue_one(&req), span.clone()).await;
        if let Ok(d) = &done {
            span.record("key", tracing::field::display(d.key));
            span.record("delivery", d.delivery.as_str());
        }
        done
    }

    async fn enqueue_one(&self, req: &EnqueueRequest) -> Result<Enqueued, EnqueueError> {
        let p = self.prepare(req)?;
        if req.supersedes() {
            self.supersede(&p.envelope).await?;
        }
        // With a spool, a typed job's own queue is declared on the way to the broker; a queue
        // only the broker knows must be there now, or a spooled job could never be delivered.
        if self.spooler.is_none() || p.unverified_queue.is_some() {
            self.check_queue(&p).await?;
        }
        self.enqueue_prepared(&p).await
    }

    /// Debounce and replace: makes `env` the newest version of its key (its `enqueued_at`), so
    /// that workers drop the older copies when they arrive (`chime_shared::idempotency::supersede`).
    async fn supersede(&self, env: &Envelope) -> Result<(), EnqueueError> {
        let mut conn = self
            .redis_conn()
            .await
            .map_err(|e| EnqueueError::Redis(format!("recording the newest copy of key {}: {e}", env.key)))?;
        let version = chime_shared::idempotency::version_of(env);
        let retention = self.config.redis.done_retention;
        chime_shared::idempotency::supersede(&mut conn, &self.names, &env.key.to_string(), version, retention)
            .await
            .map(|_| ())
            .map_err(|e| EnqueueError::Redis(format!("recording the newest copy of key {}: {e}", env.key)))
    }

    /// Publishes one prepared job — as itself, or fanned out to its shards or live workers —
    /// and waits for every confirm. A broadcast copy whose worker is gone is dropped; no live
    /// worker at all is [`EnqueueError::NoWorkers`]. With a spool, as [`Self::enqueue`].
    pub async fn enqueue_prepared(&self, p: &Prepared) -> Result<Enqueued, EnqueueError> {
        let members = self.fan_out(std::slice::from_ref(p)).await?;
        let Some(spooler) = &self.spooler else { return self.publish_members(p, &members).await };
        if members.is_empty() {
            return Err(EnqueueError::NoWorkers { queue: p.envelope.queue.clone() });
        }
        if spooler.backlog() {
            let why = "earlier jobs of this producer are still in the spool".to_string();
            return self.spool_members(spooler, p, &members, why).await;
        }
        let timeout = self.config.amqp.publish_timeout;
        let direct = async {
            if p.declare_queue.is_some() {
                self.check_queue(p).await?;
            }
            self.publish_members(p, &members).await
        };
        match tokio::time::timeout(timeout, direct).await {
            Ok(Ok(done)) => Ok(done),
            Ok(Err(e)) if e.is_broker() => self.spool_members(spooler, p, &members, e.to_string()).await,
            Ok(Err(e)) => Err(e),
            Err(_) => {
                let why = format!(
                    "no confirm within {} (amqp.publish_timeout)",
                    chime_shared::duration::format(timeout)
                );
                self.spool_members(spooler, p, &members, why).await
            }
        }
    }

    /// Writes a job's messages to the spool: what it answers for them.
    async fn spool_members(
        &self,
        spooler: &Arc<flush::Spooler>,
        p: &Prepared,
        members: &[Prepared],
        why: String,
    ) -> Result<Enqueued, EnqueueError> {
        spooler.append(members, &why).await.map_err(|source| EnqueueError::Spool {
            context: format!(
                "the broker did not take job {} ({why}), and the spool could not take it",
                p.envelope.job
            ),
            source,
        })?;
        let mut done = enqueued(&p.envelope);
        done.delivery = Delivery::Spooled;
        if !(members.len() == 1 && members[0].envelope.key == p.envelope.key) {
            done.members = members.iter().map(|m| m.envelope.key).collect();
            done.id = members.first().map_or(done.id, |m| m.envelope.id);
        }
        Ok(done)
    }

    /// Publishes a job's messages (see [`Self::enqueue_prepared`]).
    async fn publish_members(&self, p: &Prepared, members: &[Prepared]) -> Result<Enqueued, EnqueueError> {
        if members.len() == 1 && members[0].envelope.key == p.envelope.key {
            self.publish(&p.envelope, p.delay).await?;
            return Ok(enqueued(&p.envelope));
        }
        if members.is_empty() {
            return Err(EnqueueError::NoWorkers { queue: p.envelope.queue.clone() });
        }
        let mut done = enqueued(&p.envelope);
        if members.iter().any(|m| m.envelope.target.is_some()) {
            // Broadcast: a copy for a worker whose queue is gone (the worker with it) is dropped.
            for m in members {
                match self.publish(&m.envelope, m.delay).await {
                    Ok(()) => done.members.push(m.envelope.key),
                    Err(EnqueueError::Amqp(e)) if matches!(*e, AmqpError::Returned { .. }) => {
                        tracing::info!(worker = ?m.envelope.target, "broadcast: that worker is gone; its copy is dropped");
                        if m.envelope.step.as_ref().is_some_and(|s| s.releases) {
                            self.member_gone(m.envelope.key).await;
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
            if done.members.is_empty() {
                return Err(EnqueueError::NoWorkers { queue: p.envelope.queue.clone() });
            }
        } else {
            let report = match self.config.job(&p.envelope.job).and_then(|j| j.pack) {
                Some(n) => self.publish_packed(members, n).await,
                None => self.publish_batch(members).await,
            };
            if let Some(e) = report.error {
                return Err(e);
            }
            done.members = members.iter().map(|m| m.envelope.key).collect();
        }
        done.id = members.first().map_or(done.id, |m| m.envelope.id);
        Ok(done)
    }

    /// The client's Redis connection (made on first use: only debounce, replace, fanned-out
    /// jobs and workflows need Redis).
    pub(crate) async fn redis_conn(&self) -> Result<chime_shared::redis_conn::RedisConn, redis::RedisError> {
        let reader = self
            .redis
            .get_or_try_init(|| {
                chime_shared::history::HistoryReader::connect(&self.config.redis, self.names.clone())
            })
            .await?;
        Ok(reader.connection())
    }

    /// Marks a broadcast member whose copy was dropped (its worker is gone) as ended
    /// (`cancelled`), so that the run's `on_complete` job does not wait for it.
    async fn member_gone(&self, key: Uuid) {
        let Some(reader) = self.redis.get() else { return };
        let mut conn = reader.connection();
        let why = "broadcast copy dropped: its worker is gone";
        let retention = self.config.redis.done_retention;
        if let Err(e) =
            chime_shared::idempotency::cancel(&mut conn, &self.names, &key.to_string(), retention, why).await
        {
            tracing::warn!(%key, error = %e, "cannot mark the dropped broadcast copy ended; its on_complete job waits for it");
        }
    }

    /// Every prepared job as the messages it is published as: itself, or, for a sharded or
    /// broadcast job, one per shard or live worker (the run's group record, written in Redis
    /// here, fixes which). Order is kept.
    pub async fn fan_out(&self, prepared: &[Prepared]) -> Result<Vec<Prepared>, EnqueueError> {
        let mut out = Vec::with_capacity(prepared.len());
        for p in prepared {
            let Some(job) = self.config.job(&p.envelope.job).filter(|j| j.shards.is_some() || j.broadcast)
            else {
                out.push(p.clone());
                continue;
            };
            let redis_err = |e: redis::RedisError| {
                EnqueueError::Redis(format!("a sharded or broadcast job's group record: {e}"))
            };
            let mut conn = self.redis_conn().await.map_err(redis_err)?;
            let fan = match chime_shared::group::propose(&mut conn, &self.names, job, None)
                .await
                .map_err(redis_err)?
            {
                Some(fan) => chime_shared::group::fix(
                    &mut conn,
                    &self.names,
                    &p.envelope,
                    &fan,
                    self.config.redis.done_retention,
                )
                .await
                .map_err(redis_err)?,
                None => continue,
            };
            let mut members = fan.envelopes(&p.envelope);
            if let Some(c) = chime_shared::workflow::Completion::of(&self.config.jobs, job) {
                let done = c.attach(&p.envelope, &mut members);
                members.push(done);
            }
            out.extend(members.into_iter().map(|envelope| Prepared { envelope, ..p.clone() }));
        }
        Ok(out)
    }

    /// Makes sure the job's queue exists: declares a typed job's own queue, verifies one given
    /// explicitly.
    async fn check_queue(&self, p: &Prepared) -> Result<(), EnqueueError> {
        if let Some(q) = &p.unverified_queue {
            self.verify_queue(q).await?;
        }
        if let Some(q) = &p.declare_queue {
            self.declare_queue(q).await?;
        }
        Ok(())
    }

    /// Declares a typed job's own queue (once per client).
    pub(crate) async fn declare_queue(&self, q: &str) -> Result<(), EnqueueError> {
        let known = self.declared.lock().map(|d| d.contains(q)).unwrap_or(false);
        if !known {
            let session = self.session().await?;
            topology::declare(&session.conn, &self.config, &[q.to_string()]).await?;
            if let Ok(mut d) = self.declared.lock() {
                d.insert(q.to_string());
            }
        }
        Ok(())
    }

    /// A queue the config does not declare must exist as a chime work queue on the broker
    /// (declared by another config's workers); otherwise nothing could ever deliver to it.
    pub async fn verify_queue(&self, queue: &str) -> Result<(), EnqueueError> {
        topology::depth(&self.session().await?.conn, &self.names.work_queue(queue))
            .await
            .map(drop)
            .map_err(|e| EnqueueError::NoSuchQueue { queue: queue.to_string(), detail: e.to_string() })
    }

    /// Publishes an envelope for delivery after `delay` and waits for its confirm; a lost
    /// connection is replaced and the envelope sent again (up to 5 new connections).
    pub async fn publish(&self, env: &Envelope, delay: Duration) -> Result<(), EnqueueError> {
        let (exchange, routing_key) =
            delay::target(&self.names, self.config.amqp.queue_type, &env.route(), delay);
        let body = env.encode();
        let mut session = self.session().await?;
        let mut reconnects = 0;
        loop {
            let sent = session
                .channels
                .publish_confirmed(
                    &exchange,
                    &routing_key,
                    &body,
                    env.properties(),
                    self.config.amqp.publish_timeout,
                )
                .await;
            match sent {
                Ok(()) => break,
                Err(e) if reconnects < MAX_RECONNECTS && needs_new_connection(&e, &session) => {
                    reconnects += 1;
                    tracing::warn!(error = %e, key = %env.key, "publish failed; sending it again on a new connection");
                    session = self.reconnect(&session, reconnects).await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        metrics::counter!(telemetry::JOBS_PUBLISHED, "job" => env.job.clone(), "source" => env.source.as_str())
            .increment(1);
        Ok(())
    }

    /// Validates every request first (nothing is published if one is invalid), then
    /// publishes with up to 4096 confirms outstanding, stopping at the first failure.
    pub async fn enqueue_batch(&self, reqs: &[EnqueueRequest]) -> Result<BatchReport, EnqueueError> {
        let envs = self.checked(reqs).await?;
        let envs = self.fan_out(&envs).await?;
        Ok(self.send_batch(&envs).await)
    }

    /// Every request prepared (errors name the line, from 1), and each queue no config
    /// declares checked once, before anything is published.
    async fn checked(&self, reqs: &[EnqueueRequest]) -> Result<Vec<Prepared>, EnqueueError> {
        let envs = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                self.prepare(r).map_err(|e| match e {
                    EnqueueError::Invalid { field, message } => {
                        EnqueueError::Invalid { field: format!("line {}: {field}", i + 1), message }
                    }
                    EnqueueError::UnknownJob(j) => EnqueueError::Invalid {
                        field: format!("line {}: job", i + 1),
                        message: format!("unknown job {j:?}"),
                    },
                    other => other,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Queues no line's config declares are checked once each, before anything is sent
        // (with a spool, a typed job's own queue the broker cannot declare now is declared by
        // the flush).
        let mut checked = HashSet::new();
        for (i, p) in envs.iter().enumerate() {
            let queue = p.unverified_queue.as_ref().or(p.declare_queue.as_ref());
            if queue.is_some_and(|q| checked.insert(q.clone())) {
                match self.check_queue(p).await {
                    Ok(()) => {}
                    Err(e) if self.spooler.is_some() && p.unverified_queue.is_none() && e.is_broker() => {}
                    Err(e) => {
                        return Err(EnqueueError::Invalid {
                            field: format!("line {}: queue", i + 1),
                            message: e.to_string(),
                        });
                    }
                }
            }
        }
        Ok(envs)
    }

    /// [`Self::publish_batch`], and with a spool, what the broker did not confirm goes to the
    /// spool (all of it while earlier jobs of this client are still spooled).
    pub async fn send_batch(&self, envs: &[Prepared]) -> BatchReport {
        let Some(spooler) = &self.spooler else { return self.publish_batch(envs).await };
        if spooler.backlog() {
            let why = "earlier jobs of this producer are still in the spool".to_string();
            return self.spool_rest(spooler, envs, 0, why).await;
        }
        let report = self.publish_batch(envs).await;
        match report.error {
            Some(e) if e.is_broker() => self.spool_rest(spooler, envs, report.confirmed, e.to_string()).await,
            _ => report,
        }
    }

    /// [`Self::enqueue_batch`], packed: up to `pack` jobs per AMQP message (and no message
    /// above `amqp.max_message_bytes`), each job with its own key, id, payload and attempts.
    /// Workers unpack them and settle every job on its own (a job that fails is retried or
    /// dead-lettered alone); the message is acked when all its jobs are settled. Broadcast
    /// jobs cannot be packed ([`EnqueueError::Invalid`]); a sharded job's members are packed.
    pub async fn enqueue_packed(
        &self,
        reqs: &[EnqueueRequest],
        pack: usize,
    ) -> Result<BatchReport, EnqueueError> {
        check_pack(pack)?;
        for (i, r) in reqs.iter().enumerate() {
            if self.config.job(&r.job).is_some_and(|j| j.broadcast) {
                return Err(EnqueueError::Invalid {
                    field: format!("line {}: job", i + 1),
                    message: format!("{:?} is a broadcast job: one copy per worker cannot be packed", r.job),
                });
            }
            if r.supersedes() {
                return Err(EnqueueError::Invalid {
                    field: format!("line {}: debounce", i + 1),
                    message: "debounce and replace cannot be packed".into(),
                });
            }
        }
        let envs = self.checked(reqs).await?;
        let envs = self.fan_out(&envs).await?;
        Ok(self.send_packed(&envs, pack).await)
    }

    /// [`Self::send_batch`], packed (see [`Self::enqueue_packed`]): up to `pack` jobs per
    /// message. With a spool, the jobs of packs the broker did not confirm are spooled one by
    /// one (a flush publishes them unpacked).
    pub async fn send_packed(&self, envs: &[Prepared], pack: usize) -> BatchReport {
        if let Err(e) = check_pack(pack) {
            return BatchReport { total: envs.len(), confirmed: 0, spooled: 0, error: Some(e) };
        }
        if let Some(spooler) = &self.spooler
            && spooler.backlog()
        {
            let why = "earlier jobs of this producer are still in the spool".to_string();
            return self.spool_rest(spooler, envs, 0, why).await;
        }
        let report = self.publish_packed(envs, pack).await;
        match (&self.spooler, report.error) {
            (Some(spooler), Some(e)) if e.is_broker() => {
                self.spool_rest(spooler, envs, report.confirmed, e.to_string()).await
            }
            (_, error) => BatchReport { error, ..report },
        }
    }

    /// [`Self::publish_batch`], packed: up to `pack` jobs per message (no spool).
    async fn publish_packed(&self, envs: &[Prepared], pack: usize) -> BatchReport {
        let qt = self.config.amqp.queue_type;
        let packs = match packs(&self.names, qt, envs, pack, self.config.amqp.max_message_bytes) {
            Ok(p) => p,
            Err(e) => return BatchReport { total: envs.len(), confirmed: 0, spooled: 0, error: Some(e) },
        };
        let wire = wire(|p: &Pack| {
            (p.exchange.clone(), p.routing_key.clone(), p.body.as_slice().into(), p.props.clone())
        });
        let (sent, error) = self.publish_all(&packs, &wire).await;
        let confirmed = if sent == 0 { 0 } else { packs[sent - 1].jobs.end };
        count_published(envs.first().map(|p| p.envelope.job.as_str()), confirmed);
        BatchReport { total: envs.len(), confirmed, spooled: 0, error }
    }

    /// Spools `envs[confirmed..]`: the report of a batch the broker took up to `confirmed`.
    async fn spool_rest(
        &self,
        spooler: &Arc<flush::Spooler>,
        envs: &[Prepared],
        confirmed: usize,
        why: String,
    ) -> BatchReport {
        self.spool_tail(spooler, &envs[confirmed..], envs.len(), why).await
    }

    /// Spools `rest`, the jobs of a batch of `total` the broker did not take.
    async fn spool_tail(
        &self,
        spooler: &Arc<flush::Spooler>,
        rest: &[Prepared],
        total: usize,
        why: String,
    ) -> BatchReport {
        let confirmed = total - rest.len();
        let mut report = BatchReport { total, confirmed, spooled: 0, error: None };
        match spooler.append(rest, &why).await {
            Ok(()) => report.spooled = rest.len(),
            Err(source) => {
                let context = format!(
                    "the broker did not take the batch from message {} on ({why}), and the spool could not take it",
                    confirmed + 1
                );
                report.error = Some(EnqueueError::Spool { context, source });
            }
        }
        report
    }

    /// [`Self::send_batch`] of encoded jobs ([`Encoded`]): what the broker did not confirm
    /// goes to the spool, when there is one (decoded again: the spool keeps envelopes).
    pub async fn send_encoded(&self, jobs: &[Encoded]) -> BatchReport {
        let Some(spooler) = &self.spooler else { return self.publish_encoded(jobs).await };
        let (confirmed, why) = if spooler.backlog() {
            (0, "earlier jobs of this producer are still in the spool".to_string())
        } else {
            let report = self.publish_encoded(jobs).await;
            match report.error {
                Some(e) if e.is_broker() => (report.confirmed, e.to_string()),
                _ => return report,
            }
        };
        match jobs[confirmed..].iter().map(Encoded::prepared).collect::<Result<Vec<_>, _>>() {
            Ok(rest) => self.spool_tail(spooler, &rest, jobs.len(), why).await,
            Err(e) => BatchReport { total: jobs.len(), confirmed, spooled: 0, error: Some(e) },
        }
    }

    /// [`Self::publish_batch`] of encoded jobs (no spool).
    pub async fn publish_encoded(&self, jobs: &[Encoded]) -> BatchReport {
        let qt = self.config.amqp.queue_type;
        let work = self.names.work_exchange();
        let wire = wire(|j: &Encoded| {
            let (exchange, rk) =
                delay::target_with(|| work.clone(), &self.names, qt, j.route.clone(), j.delay);
            (exchange, rk, j.body.as_slice().into(), envelope::properties_of(j.key, &j.job, j.timestamp))
        });
        self.publish_jobs(jobs, jobs.first().map(|j| j.job.as_str()), &wire).await
    }

    /// [`Self::publish_all`] of `items`, jobs of `job`, counted as published.
    async fn publish_jobs<T>(&self, items: &[T], job: Option<&str>, wire: &Wire<'_, T>) -> BatchReport {
        let (confirmed, error) = self.publish_all(items, wire).await;
        count_published(job, confirmed);
        BatchReport { total: items.len(), confirmed, spooled: 0, error }
    }

    /// Pipelined publish of prepared envelopes, with up to 4096 confirms outstanding. When the
    /// connection breaks, a new one is made and publishing resumes from the first envelope not
    /// yet confirmed (copies the broker did receive are absorbed by their keys).
    pub async fn publish_batch(&self, envs: &[Prepared]) -> BatchReport {
        let qt = self.config.amqp.queue_type;
        let work = self.names.work_exchange();
        let wire = wire(|p: &Prepared| {
            // Most jobs go straight to the work exchange: its name made once per batch.
            let (exchange, rk) =
                delay::target_with(|| work.clone(), &self.names, qt, p.envelope.route(), p.delay);
            (exchange, rk, p.envelope.encode().into(), p.envelope.properties())
        });
        self.publish_jobs(envs, envs.first().map(|p| p.envelope.job.as_str()), &wire).await
    }

    /// Publishes `items` (each made a message by `wire`) pipelined, and resumes on a new
    /// connection from the first one not confirmed when the connection breaks: how many were
    /// confirmed, and the failure that stopped it.
    async fn publish_all<T>(&self, items: &[T], wire: &Wire<'_, T>) -> (usize, Option<EnqueueError>) {
        let mut session = match self.session().await {
            Ok(s) => s,
            Err(e) => return (0, Some(e)),
        };
        let mut confirmed = 0usize;
        let mut reconnects = 0;
        let error = loop {
            let (upto, failed) = self.publish_from(&session, items, wire, confirmed).await;
            confirmed = upto;
            let Some(e) = failed else { break None };
            if reconnects >= MAX_RECONNECTS || !needs_new_connection(&e, &session) {
                break Some(e.into());
            }
            reconnects += 1;
            tracing::warn!(error = %e, resume_at = confirmed, "batch publish failed; resuming on a new connection");
            match self.reconnect(&session, reconnects).await {
                Ok(s) => session = s,
                Err(e) => break Some(e),
            }
        };
        // Only a stop leaves items unsent without a failure.
        let error = error.or_else(|| (confirmed < items.len()).then_some(EnqueueError::Interrupted));
        (confirmed, error)
    }

    /// Publishes `envs[start..]` on a channel of the session lent to this batch,
    /// [`amqp::PUBLISH_GROUP`] at a time; returns how many from the start of `envs` are confirmed
    /// (confirms are awaited in order) and the first failure.
    async fn publish_from<T>(
        &self,
        session: &Session,
        items: &[T],
        wire: &Wire<'_, T>,
        start: usize,
    ) -> (usize, Option<AmqpError>) {
        let lent = match session.channels.lend().await {
            Ok(l) => l,
            Err(e) => return (start, Some(e)),
        };
        let mut returns = amqp::Returns::default();
        let (confirmed, failed) = self.publish_on(lent.channel(), &mut returns, items, wire, start).await;
        if failed.is_none() {
            lent.settled();
        }
        // A message the broker returned counts as the first failure, wherever it was.
        if !returns.is_empty() {
            for (i, item) in items.iter().enumerate().take(confirmed).skip(start) {
                let (exchange, rk, body, _) = wire(item);
                if let Some(e) = returns.take(&exchange, &rk, &body) {
                    return (i, Some(e));
                }
            }
        }
        (confirmed, failed)
    }

    /// [`Self::publish_from`] on `channel`, with the returned messages its confirms carried
    /// left in `returns`.
    async fn publish_on<T>(
        &self,
        channel: &Channel,
        returns: &mut amqp::Returns,
        items: &[T],
        wire: &Wire<'_, T>,
        start: usize,
    ) -> (usize, Option<AmqpError>) {
        let timeout = self.config.amqp.publish_timeout;
        // The confirms of `items[confirmed..]`, in order; a failure's names are made again
        // from its item (thousands of outstanding publishes keep no strings).
        let mut pending: VecDeque<lapin::PublisherConfirm> = VecDeque::with_capacity(BATCH_WINDOW);
        let mut confirmed = start;
        let names = |i: usize| {
            let (exchange, rk, _, _) = wire(&items[i]);
            (exchange, rk)
        };
        for group in items[start..].chunks(amqp::PUBLISH_GROUP) {
            // Stopped: what was sent is confirmed below; `publish_all` reports the rest.
            if self.stop.load(std::sync::atomic::Ordering::Relaxed) {
                break;
            }
            while pending.len() + group.len() > BATCH_WINDOW
                && let Some(p) = pending.pop_front()
            {
                if let Err(e) = returns.confirm_named(p, timeout, || names(confirmed)).await {
                    return (confirmed, Some(e));
                }
                confirmed += 1;
            }
            let mut encoded: Vec<Message<'_>> = group.iter().map(wire).collect();
            let outgoing = encoded.iter_mut().map(|(exchange, rk, body, props)| amqp::Outgoing {
                exchange,
                routing_key: rk,
                body,
                props: std::mem::take(props),
            });
            for sent in amqp::publish_group(channel, outgoing).await {
                match sent {
                    Ok(p) => pending.push_back(p),
                    Err(e) => return (confirmed, Some(e)),
                }
            }
        }
        for p in pending {
            if let Err(e) = returns.confirm_named(p, timeout, || names(confirmed)).await {
                return (confirmed, Some(e));
            }
            confirmed += 1;
        }
        (confirmed, None)
    }
}

/// Counts `n` ad-hoc jobs of `job` (a batch's first job names it) as published.
fn count_published(job: Option<&str>, n: usize) {
    if let Some(job) = job {
        metrics::counter!(telemetry::JOBS_PUBLISHED, "job" => job.to_string(), "source" => "adhoc")
            .increment(n as u64);
    }
}

/// One packed message: jobs `jobs` of the batch, where they go, and the body.
#[derive(Debug)]
pub struct Pack {
    /// The batch's jobs it holds (indices).
    pub jobs: std::ops::Range<usize>,
    /// Exchange it is published to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// `{"v":1,"pack":[…]}`.
    pub body: Vec<u8>,
    /// The pack's properties (`x-chime-pack` = jobs in it).
    pub props: BasicProperties,
}

/// A pack size is 1 to [`envelope::pack::MAX_PACK`].
fn check_pack(pack: usize) -> Result<(), EnqueueError> {
    if (1..=envelope::pack::MAX_PACK).contains(&pack) {
        return Ok(());
    }
    Err(EnqueueError::Invalid {
        field: "pack".into(),
        message: format!("{pack}: a pack holds 1 to {} jobs", envelope::pack::MAX_PACK),
    })
}

/// `envs` packed in order: consecutive jobs for the same destination (route and delay), up
/// to `n` per pack and `max_bytes` per body. A broadcast copy cannot be packed.
pub fn packs(
    names: &Names,
    queue_type: chime_shared::config::QueueType,
    envs: &[Prepared],
    n: usize,
    max_bytes: usize,
) -> Result<Vec<Pack>, EnqueueError> {
    let mut out: Vec<Pack> = Vec::new();
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    let mut size = envelope::pack::OVERHEAD;
    let mut start = 0;
    let mut target: Option<(String, String)> = None;
    let close = |out: &mut Vec<Pack>,
                 bodies: &mut Vec<Vec<u8>>,
                 start: usize,
                 end: usize,
                 target: (String, String)| {
        let body = envelope::pack::encode(bodies);
        let props = envelope::pack::properties(&envs[start].envelope, end - start);
        bodies.clear();
        out.push(Pack { jobs: start..end, exchange: target.0, routing_key: target.1, body, props });
    };
    for (i, p) in envs.iter().enumerate() {
        if p.envelope.target.is_some() {
            return Err(EnqueueError::Invalid {
                field: format!("line {}: job", i + 1),
                message: format!("{:?} is a broadcast copy: it cannot be packed", p.envelope.job),
            });
        }
        let here = delay::target(names, queue_type, &p.envelope.route(), p.delay);
        let body = p.envelope.encode();
        let full = !bodies.is_empty() && (bodies.len() >= n || size + body.len() + 1 > max_bytes);
        if let Some(t) = target.take_if(|t| *t != here || full) {
            close(&mut out, &mut bodies, start, i, t);
            size = envelope::pack::OVERHEAD;
            start = i;
        }
        if target.is_none() {
            target = Some(here);
        }
        size += body.len() + 1;
        bodies.push(body);
    }
    if let Some(t) = target {
        close(&mut out, &mut bodies, start, envs.len(), t);
    }
    Ok(out)
}

/// Builds the envelope of `req` under `config`: the job must exist (a `[[jobs]]` entry, or a
/// typed job's own options), the queue name and the attempt count must be valid, and the
/// envelope must fit `amqp.max_message_bytes`.
pub fn prepare(config: &Config, req: &EnqueueRequest) -> Result<Prepared, EnqueueError> {
    prepare_with(config, req, req.payload.clone())
}

/// [`prepare`], taking the request: its payload is moved into the envelope, not copied.
pub fn prepare_owned(config: &Config, mut req: EnqueueRequest) -> Result<Prepared, EnqueueError> {
    let payload = req.payload.take();
    prepare_with(config, &req, payload)
}

/// [`prepare`] of `req` with `payload` (the request's own, taken or copied).
fn prepare_with(
    config: &Config,
    req: &EnqueueRequest,
    payload: Option<serde_json::Value>,
) -> Result<Prepared, EnqueueError> {
    if let Some((field, message)) = &req.invalid {
        return Err(EnqueueError::Invalid { field: field.clone(), message: message.clone() });
    }
    let entry = config.job(&req.job);
    // The queue and attempts its options give (an entry's over a typed job's own).
    let (own_queue, attempts) = match (req.options.as_ref(), entry) {
        (own, Some(entry)) => entry.queue_and_attempts_over(own),
        (Some(own), None) => (own.queue_name(), own.attempts()),
        (None, None) => return Err(EnqueueError::UnknownJob(req.job.clone())),
    };
    if !valid_name(&req.job) {
        return Err(EnqueueError::Invalid {
            field: "job".into(),
            message: format!("{:?} must be 1-100 letters, digits, '-', '_' or '.'", req.job),
        });
    }
    let queue = req.queue.as_deref().unwrap_or(own_queue);
    if !valid_name(queue) {
        return Err(EnqueueError::Invalid {
            field: "queue".into(),
            message: format!("{queue:?} must be 1-100 letters, digits, '-', '_' or '.'"),
        });
    }
    let max_attempts = req.max_attempts.unwrap_or(attempts);
    if max_attempts == 0 || max_attempts > envelope::MAX_ATTEMPTS {
        return Err(EnqueueError::Invalid {
            field: "max_attempts".into(),
            message: format!("must be between 1 and {}", envelope::MAX_ATTEMPTS),
        });
    }
    let key = match &req.key {
        Some(k) if k.is_empty() => {
            return Err(EnqueueError::Invalid { field: "key".into(), message: "must not be empty".into() });
        }
        Some(k) => envelope::adhoc_key(&req.job, k),
        None => envelope::random_key(),
    };
    if req.supersedes() && req.key.is_none() {
        let flag = if req.replace { "replace" } else { "debounce" };
        return Err(EnqueueError::Invalid {
            field: flag.into(),
            message: "needs a key: the key names the run whose earlier copies it supersedes".into(),
        });
    }
    if req.debounce.is_some() && (req.delay.is_some() || req.at.is_some()) {
        return Err(EnqueueError::Invalid {
            field: "debounce".into(),
            message: "the window is the delay: give --debounce or a delay/time, not both".into(),
        });
    }
    if req.debounce.is_some_and(|w| w < Duration::from_secs(1)) {
        return Err(EnqueueError::Invalid {
            field: "debounce".into(),
            message: "must be at least 1s (delays are whole seconds)".into(),
        });
    }
    if req.supersedes() && (entry.is_some_and(|j| j.shards.is_some() || j.broadcast)) {
        return Err(EnqueueError::Invalid {
            field: if req.replace { "replace".into() } else { "debounce".into() },
            message: format!(
                "job {:?} fans out (sharded or broadcast): replace and debounce apply to one run",
                req.job
            ),
        });
    }
    let delay = match (req.delay.or(req.debounce), req.at) {
        (Some(_), Some(_)) => {
            return Err(EnqueueError::Invalid {
                field: "delay".into(),
                message: "give a delay or a time, not both".into(),
            });
        }
        (Some(d), None) => d,
        // A time in the past means "now".
        (None, Some(at)) => (at - Utc::now()).to_std().unwrap_or(Duration::ZERO),
        (None, None) => Duration::ZERO,
    };
    if delay > delay::MAX_DELAY {
        return Err(EnqueueError::Invalid {
            field: if req.at.is_some() { "at".into() } else { "delay".into() },
            message: format!(
                "{} is beyond the longest delay chime can hold ({})",
                chime_shared::duration::format(delay),
                chime_shared::duration::format(delay::MAX_DELAY)
            ),
        });
    }
    let payload =
        payload.or_else(|| entry.and_then(|j| j.payload.clone())).unwrap_or(serde_json::Value::Null);
    if envelope::too_deep(&payload) {
        return Err(EnqueueError::Invalid { field: "payload".into(), message: envelope::too_deep_message() });
    }
    let mut env = Envelope::new(&req.job, queue, key, payload, None, max_attempts, Source::Adhoc);
    if let Some(t) = req.trace.clone().or_else(trace::current) {
        env.trace_id = Some(t.traceparent);
        env.trace_state = t.tracestate;
    }
    let priority = req.priority.or_else(|| entry.and_then(|j| j.priority)).unwrap_or_default();
    if priority != Priority::Normal {
        let declared = config.declares_queue(queue);
        if declared && !config.levels(queue).contains(&priority) {
            return Err(EnqueueError::Invalid {
                field: "priority".into(),
                message: format!(
                    "queue {queue:?} has no priority levels: set `priority` on a [[jobs]] entry of that queue, \
                     so that it gets them and workers consume them"
                ),
            });
        }
        env.priority = Some(priority);
    }
    if let Err(size) = env.check_len(config.amqp.max_message_bytes) {
        return Err(EnqueueError::TooLarge {
            job: req.job.clone(),
            size,
            max: config.amqp.max_message_bytes,
        });
    }
    // A queue the config does not declare: a typed job's own is declared, one given explicitly
    // must exist.
    let unknown = !config.declares_queue(queue);
    let own = req.queue.is_none() && req.options.is_some();
    let unverified_queue = (unknown && !own).then(|| queue.to_string());
    let declare_queue = (unknown && own).then(|| queue.to_string());
    Ok(Prepared { envelope: env, delay, unverified_queue, declare_queue })
}

fn enqueued(env: &Envelope) -> Enqueued {
    Enqueued {
        id: env.id,
        key: env.key,
        job: env.job.clone(),
        queue: env.queue.clone(),
        members: Vec::new(),
        delivery: Delivery::Confirmed,
    }
}

/// Parses one line of `--batch` input: `{"payload": …, "key": …, "queue": …,
/// "max_attempts": …}` (an object with a `payload` field, each field at most once), or a bare
/// payload. An error names the field at fault (`key: invalid type: …`).
pub fn parse_batch_line(job: &str, line: &str) -> Result<EnqueueRequest, String> {
    parse_batch_line_shaped(job, line).map(|(req, _)| req)
}

/// How a batch line was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineShape {
    /// An object with a `payload` field: the request's fields.
    Request,
    /// Anything else: the payload itself.
    Payload,
    /// An object without `payload` whose fields are all a request's others (`{"key": "k1"}`):
    /// read as the payload, as documented, though it was likely meant as a request with the
    /// job's default payload (worth a warning: such a job has no key).
    PayloadLikeRequest,
}

/// The fields of a batch line's request besides `payload`.
const REQUEST_FIELDS: [&str; 4] = ["key", "queue", "max_attempts", "priority"];

/// [`parse_batch_line`], with how the line was read.
pub fn parse_batch_line_shaped(job: &str, line: &str) -> Result<(EnqueueRequest, LineShape), String> {
    // The common shape first, parsed in one step; any other line (and any error) the general
    // way below, which names what is wrong.
    if line.contains("\"payload\"")
        && let Ok(mut req) = serde_json::from_str::<EnqueueRequest>(line)
    {
        req.job = job.to_string();
        return Ok((req, LineShape::Request));
    }
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("invalid JSON: {}", within_line(&e)))?;
    let shape = match &value {
        serde_json::Value::Object(m) if m.contains_key("payload") => LineShape::Request,
        serde_json::Value::Object(m)
            if !m.is_empty() && m.keys().all(|k| REQUEST_FIELDS.contains(&k.as_str())) =>
        {
            LineShape::PayloadLikeRequest
        }
        _ => LineShape::Payload,
    };
    let mut req = match &value {
        // Read again from the text, for an error that names its field (the object above kept
        // a field given twice only once).
        serde_json::Value::Object(m) if m.contains_key("payload") => {
            let mut de = serde_json::Deserializer::from_str(line);
            serde_path_to_error::deserialize::<_, EnqueueRequest>(&mut de).map_err(|e| {
                let path = e.path().to_string();
                let message = within_line(&e.into_inner());
                let named = path == "." || message.contains(&format!("`{path}`"));
                if named { message } else { format!("{path}: {message}") }
            })?
        }
        _ => EnqueueRequest { payload: Some(value), ..Default::default() },
    };
    req.job = job.to_string();
    Ok((req, shape))
}

/// `e`'s message, its position given by column alone (the line is the batch's line).
fn within_line(e: &serde_json::Error) -> String {
    let at = format!(" at line {} column {}", e.line(), e.column());
    e.to_string().replace(&at, &format!(" (column {})", e.column()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_lines() {
        let r = parse_batch_line("j", r#"{"payload":{"a":1},"key":"k1"}"#).unwrap();
        assert_eq!(r.key.as_deref(), Some("k1"));
        assert_eq!(r.payload, Some(serde_json::json!({"a":1})));
        let r = parse_batch_line("j", r#"{"a":1}"#).unwrap();
        assert_eq!(r.payload, Some(serde_json::json!({"a":1})));
        // An object of a request's fields without `payload` is a payload, said so.
        let (r, shape) = parse_batch_line_shaped("j", r#"{"key":"k1","queue":"q"}"#).unwrap();
        assert_eq!(
            (r.payload, r.key, shape),
            (Some(serde_json::json!({"key":"k1","queue":"q"})), None, LineShape::PayloadLikeRequest)
        );
        for line in [r#"{"key":"k1","user":2}"#, "{}", r#"{"payload":{"key":"k1"}}"#, "3"] {
            let (_, shape) = parse_batch_line_shaped("j", line).unwrap();
            assert_ne!(shape, LineShape::PayloadLikeRequest, "{line}");
        }
        assert!(parse_batch_line("j", r#"{"payload":1,"colour":2}"#).unwrap_err().contains("colour"));
        assert_eq!(
            parse_batch_line("j", "{nope").unwrap_err(),
            "invalid JSON: key must be a string (column 2)"
        );
        // A field given twice is refused (as the HTTP API does), a field of the wrong type named.
        let e = parse_batch_line("j", r#"{"payload":1,"payload":2}"#).unwrap_err();
        assert!(e.starts_with("duplicate field `payload`"), "{e}");
        let e = parse_batch_line("j", r#"{"payload":1,"key":123}"#).unwrap_err();
        assert!(e.starts_with("key: invalid type: integer `123`, expected a string"), "{e}");
        let e = parse_batch_line("j", r#"{"payload":1,"priority":"urgent"}"#).unwrap_err();
        assert!(e.starts_with("priority: unknown variant `urgent`"), "{e}");
        let r = parse_batch_line("j", r#"{"a":"\"payload\""}"#).unwrap();
        assert_eq!(r.payload, Some(serde_json::json!({"a": "\"payload\""})));
        let r = parse_batch_line("j", r#"{"payload":null,"key":"k"}"#).unwrap();
        assert_eq!((r.payload, r.key.as_deref(), r.job.as_str()), (None, Some("k"), "j"));
    }

    #[test]
    fn an_encoded_job_is_its_envelope_body_and_message_and_decodes_back() {
        let c = Config::from_toml_str("[[jobs]]\nname = \"j\"\nhandler = \"noop\"\n").unwrap();
        let req = EnqueueRequest::new("j")
            .payload(serde_json::json!({"i": 7}))
            .key("k")
            .delay(Duration::from_secs(5));
        let p = prepare(&c, &req).unwrap();
        let e = Encoded::new(p.clone());
        assert_eq!(e.body, p.envelope.encode());
        assert_eq!(e.key(), p.envelope.key);
        assert_eq!(
            envelope::properties_of(e.key, &e.job, e.timestamp),
            p.envelope.properties(),
            "the same message properties"
        );
        assert_eq!((e.route.as_str(), e.delay), (p.envelope.route().as_str(), p.delay));
        let back = e.prepared().unwrap();
        assert_eq!((back.envelope.encode(), back.delay), (p.envelope.encode(), p.delay));
    }

    #[test]
    fn prepare_validates() {
        let c =
            Config::from_toml_str("[amqp]\nmax_message_bytes = 2048\n[[jobs]]\nname='j'\nhandler='noop'\n")
                .unwrap();
        assert!(matches!(prepare(&c, &EnqueueRequest::new("x")), Err(EnqueueError::UnknownJob(_))));
        let big = serde_json::Value::String("x".repeat(4096));
        assert!(matches!(
            prepare(&c, &EnqueueRequest::new("j").payload(big)),
            Err(EnqueueError::TooLarge { .. })
        ));
        // At the limit a message is counted exactly (the cheap bound is above it): one byte
        // more is refused with its length.
        let len = |n: usize| {
            let p = prepare(&c, &EnqueueRequest::new("j").key("k").payload("x".repeat(n).into()));
            p.map(|p| p.envelope.encoded_len()).map_err(|e| match e {
                EnqueueError::TooLarge { size, .. } => size,
                other => panic!("{other}"),
            })
        };
        // A payload nested deeper than a worker reads is refused by name, however it was built.
        let nested = |depth: usize| (0..depth).fold(serde_json::json!(1), |v, _| serde_json::json!([v]));
        assert!(prepare(&c, &EnqueueRequest::new("j").payload(nested(envelope::MAX_PAYLOAD_DEPTH))).is_ok());
        for depth in [envelope::MAX_PAYLOAD_DEPTH + 1, 500] {
            let e = prepare(&c, &EnqueueRequest::new("j").payload(nested(depth))).unwrap_err();
            assert!(matches!(&e, EnqueueError::Invalid { field, .. } if field == "payload"), "{e}");
        }
        let base = len(0).unwrap();
        assert_eq!(len(2048 - base), Ok(2048));
        assert_eq!(len(2049 - base), Err(2049));
        let a = prepare(&c, &EnqueueRequest::new("j").key("k")).unwrap().envelope;
        let b = prepare(&c, &EnqueueRequest::new("j").key("k")).unwrap().envelope;
        assert_eq!(a.key, b.key);
        assert_ne!(a.id, b.id);
        assert!(prepare(&c, &EnqueueRequest::new("j").queue("bad queue")).is_err());
        let past =
            prepare(&c, &EnqueueRequest::new("j").at(Utc::now() - chrono::Duration::hours(1))).unwrap();
        assert_eq!(past.delay, Duration::ZERO);
        let year = prepare(&c, &EnqueueRequest::new("j").delay(Duration::from_secs(366 * 86_400))).unwrap();
        assert_eq!(year.delay.as_secs(), 366 * 86_400);
        let absurd = EnqueueRequest::new("j").at(Utc::now() + chrono::Duration::days(365 * 20));
        assert!(matches!(prepare(&c, &absurd), Err(EnqueueError::Invalid { field, .. }) if field == "at"));
    }

    #[derive(serde::Serialize, serde::Deserialize)]
    struct SendWelcome {
        user_id: u64,
    }
    impl Job for SendWelcome {
        const NAME: &'static str = "send_welcome";
        fn options() -> JobOptions {
            JobOptions::default().queue("mail").max_attempts(7)
        }
    }

    #[test]
    fn typed_jobs_need_no_entry_and_an_entry_overrides_their_options() {
        let bare = Config::from_toml_str("").unwrap();
        let p = prepare(&bare, &EnqueueRequest::job(&SendWelcome { user_id: 1 })).unwrap();
        assert_eq!((p.envelope.queue.as_str(), p.envelope.max_attempts), ("mail", 7));
        assert_eq!(p.envelope.payload, serde_json::json!({"user_id": 1}));
        assert_eq!(p.declare_queue.as_deref(), Some("mail"), "the client declares a typed job's queue");
        let tuned =
            Config::from_toml_str("[[jobs]]\nname='send_welcome'\nhandler='send_welcome'\nmax_attempts=2\n")
                .unwrap();
        let p = prepare(&tuned, &EnqueueRequest::job(&SendWelcome { user_id: 1 })).unwrap();
        assert_eq!(
            (p.envelope.queue.as_str(), p.envelope.max_attempts),
            ("mail", 2),
            "attempts from the entry"
        );
        // A typed job that cannot be enqueued says why when it is enqueued, naming the field.
        #[derive(serde::Deserialize)]
        struct Careless;
        impl serde::Serialize for Careless {
            fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
                Err(serde::ser::Error::custom("no"))
            }
        }
        impl Job for Careless {
            const NAME: &'static str = "careless";
            fn options() -> JobOptions {
                JobOptions::default().concurrency(0)
            }
        }
        let Err(EnqueueError::Invalid { field, .. }) = prepare(&bare, &EnqueueRequest::job(&Careless)) else {
            panic!("a payload that does not serialise is refused");
        };
        assert_eq!(field, "payload");
        #[derive(serde::Serialize, serde::Deserialize)]
        struct Eager;
        impl Job for Eager {
            const NAME: &'static str = "eager";
            fn options() -> JobOptions {
                JobOptions::default().concurrency(0)
            }
        }
        let Err(EnqueueError::Invalid { field, message }) =
            prepare(&bare, &EnqueueRequest::job(&Eager).key("k"))
        else {
            panic!("invalid options are refused");
        };
        assert_eq!(field, "eager::options().concurrency", "{message}");
        // By name, without the type, the job is unknown to a config that does not define it.
        assert!(matches!(
            prepare(&bare, &EnqueueRequest::new("send_welcome")),
            Err(EnqueueError::UnknownJob(_))
        ));
    }

    /// `--batch` lines as they come: any text, or objects whose fields have any type. Each is a
    /// request or refused with a one-line reason; a request is published or refused by
    /// [`prepare`]. Nothing panics.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn leaf() -> impl Strategy<Value = serde_json::Value> {
            prop_oneof![
                Just(serde_json::Value::Null),
                any::<bool>().prop_map(serde_json::Value::from),
                any::<i64>().prop_map(serde_json::Value::from),
                any::<u64>().prop_map(serde_json::Value::from),
                any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(serde_json::Value::from),
                "\\PC{0,30}".prop_map(serde_json::Value::from),
                proptest::sample::select(vec![
                    "high",
                    "low",
                    "normal",
                    "",
                    "de\u{0}fault",
                    "a b",
                    "x".repeat(300).leak()
                ])
                .prop_map(serde_json::Value::from),
            ]
        }

        fn line() -> impl Strategy<Value = String> {
            let field = proptest::sample::select(vec![
                "payload",
                "key",
                "queue",
                "max_attempts",
                "priority",
                "delay",
                "job",
                "colour",
            ]);
            prop_oneof![
                3 => proptest::collection::btree_map(field, leaf(), 0..6)
                    .prop_map(|m| serde_json::to_string(&m).unwrap_or_default()),
                1 => leaf().prop_map(|v| v.to_string()),
                1 => "\\PC{0,80}",
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig {
                cases: chime_shared::fuzz_cases(2_000),
                failure_persistence: None,
                ..ProptestConfig::default()
            })]

            #[test]
            fn batch_lines_are_requests_or_refused(line in line()) {
                let c = Config::from_toml_str(
                    "[amqp]\nmax_message_bytes = 2048\n[[jobs]]\nname='j'\nhandler='noop'\n",
                )
                .unwrap();
                match parse_batch_line("j", &line) {
                    Err(e) => prop_assert!(!e.contains('\n'), "one line: {e:?}"),
                    Ok(req) => {
                        if let Err(e) = prepare(&c, &req) {
                            prop_assert!(!e.to_string().contains('\n'), "{e}");
                        }
                    }
                }
            }
        }
    }
}
