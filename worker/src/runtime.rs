//! The worker runtime: connection supervision, consumers, bounded concurrency, Redis
//! gating and graceful shutdown. Takes a `CancellationToken`; installs no signal handler.
//!
//! Lifecycle: connect (URLs in turn, backoff) → declare → consume every queue on its own
//! channel with a prefetch → for each delivery take a concurrency permit and spawn
//! [`process::handle`]. While Redis is unreachable, consumers are cancelled (intake stops)
//! and `/readyz` fails; they resume when Redis answers. A lost connection is rebuilt.
//! On shutdown: cancel consumers, requeue what was prefetched, drain in-flight jobs up to
//! `worker.shutdown_timeout`, then stop what is left (requeued, claim released) and close.

use chime_shared::amqp;
use chime_shared::config::{BackoffConfig, Config, ConfigError};
use chime_shared::health::Health;
use chime_shared::idempotency::IdemStore;
use chime_shared::telemetry::{self, outcome};
use chime_shared::topology::{self, Names, TopologyError};
use futures_util::StreamExt;
use futures_util::stream::SelectAll;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::ack::AckBatcher;
use crate::builtin;
use crate::handler::{Handler, Registry};
use crate::process;

/// A job this worker can run.
pub(crate) struct JobSpec {
    pub handler: Arc<dyn Handler>,
    pub timeout: Duration,
    pub backoff: BackoffConfig,
    /// A scheduled slot started later than slot + deadline is skipped as expired.
    pub deadline: Option<Duration>,
    /// Metric handles of this job, registered on first use (after the recorder is installed).
    metrics: OnceLock<JobMetrics>,
}

impl JobSpec {
    fn new(
        handler: Arc<dyn Handler>,
        timeout: Duration,
        backoff: BackoffConfig,
        deadline: Option<Duration>,
    ) -> Self {
        Self { handler, timeout, backoff, deadline, metrics: OnceLock::new() }
    }

    /// The handles of the per-job series updated on every delivery (looked up once, not per job).
    pub fn metrics(&self, job: &str) -> &JobMetrics {
        self.metrics.get_or_init(|| JobMetrics::new(job))
    }
}

/// Metric handles updated for every delivery of one job.
pub(crate) struct JobMetrics {
    pub succeeded: metrics::Counter,
    pub duplicate: metrics::Counter,
    pub lag: metrics::Histogram,
    pub duration: metrics::Histogram,
}

impl JobMetrics {
    fn new(job: &str) -> Self {
        let completed = |outcome: &'static str| metrics::counter!(telemetry::JOBS_COMPLETED, "job" => job.to_string(), "outcome" => outcome);
        Self {
            succeeded: completed(outcome::SUCCEEDED),
            duplicate: completed(outcome::DUPLICATE),
            lag: metrics::histogram!(telemetry::JOB_LAG, "job" => job.to_string()),
            duration: metrics::histogram!(telemetry::JOB_DURATION, "job" => job.to_string()),
        }
    }
}

/// Settled deliveries of this worker, by outcome (for tests, `status` and benchmarks).
#[derive(Debug, Default)]
pub struct Stats {
    pub succeeded: AtomicU64,
    pub duplicates: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub requeued: AtomicU64,
    pub lost_lease: AtomicU64,
    /// Failed attempts sent round for another attempt.
    pub retried: AtomicU64,
    /// Copies of a busy key sent round again.
    pub redelayed: AtomicU64,
    /// Scheduled slots skipped because they started past their deadline.
    pub expired: AtomicU64,
}

impl Stats {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// State shared by every delivery task.
pub(crate) struct Shared {
    pub config: Arc<Config>,
    pub names: Names,
    pub store: IdemStore,
    pub worker_id: String,
    /// Makes owner tokens unique across restarts that reuse a host name and pid.
    nonce: String,
    owners: AtomicU64,
    pub stats: Arc<Stats>,
    /// Every job this worker can run: configured jobs, then registry-only handlers.
    jobs: HashMap<String, JobSpec>,
    redis_ok: watch::Sender<bool>,
    /// Cancelled when shutdown begins: no new work, stop waiting on busy keys.
    pub intake_stopped: CancellationToken,
    /// Cancelled at the drain deadline: stop running handlers.
    pub hard_stop: CancellationToken,
}

impl Shared {
    pub fn job(&self, name: &str) -> Option<&JobSpec> {
        self.jobs.get(name)
    }

    pub fn knows(&self, name: &str) -> bool {
        self.jobs.contains_key(name)
    }

    /// A token unique to one attempt: worker id, a per-process nonce and a counter.
    pub fn owner_token(&self) -> String {
        let n = self.owners.fetch_add(1, Ordering::Relaxed);
        format!("{}/{}/{n}", self.worker_id, self.nonce)
    }

    /// Called on any Redis error: pauses intake until the monitor sees Redis again.
    pub fn redis_failed(&self) {
        self.redis_ok.send_replace(false);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Topology(#[from] TopologyError),
    #[error("redis: {0}")]
    Redis(#[from] chime_shared::idempotency::IdemError),
}

impl WorkerError {
    /// Usage/config problems (exit code 2) as opposed to run-time failures.
    pub fn is_config(&self) -> bool {
        matches!(self, WorkerError::Config(_) | WorkerError::Topology(TopologyError::Inequivalent { .. }))
    }
}

/// A configured worker, ready to [`run`](Worker::run).
pub struct Worker {
    shared: Arc<Shared>,
    queues: Vec<String>,
    concurrency: usize,
    prefetch: u16,
    health: Health,
    redis_rx: watch::Receiver<bool>,
}

/// Builds a [`Worker`] from config plus Rust-registered handlers.
pub struct WorkerBuilder {
    config: Config,
    registry: Registry,
    queues: Option<Vec<String>>,
    concurrency: Option<usize>,
    worker_id: Option<String>,
    health: Option<Health>,
}

impl WorkerBuilder {
    pub fn new(config: Config) -> Self {
        Self {
            config,
            registry: Registry::new(),
            queues: None,
            concurrency: None,
            worker_id: None,
            health: None,
        }
    }
    /// Handlers referenced by name from `[[jobs]] handler = "…"` (or by job name).
    pub fn registry(mut self, registry: Registry) -> Self {
        self.registry = registry;
        self
    }
    pub fn queues(mut self, queues: Vec<String>) -> Self {
        self.queues = Some(queues);
        self
    }
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n);
        self
    }
    pub fn worker_id(mut self, id: impl Into<String>) -> Self {
        self.worker_id = Some(id.into());
        self
    }
    /// Health checks to update (share them with the `/readyz` server).
    pub fn health(mut self, health: Health) -> Self {
        self.health = Some(health);
        self
    }

    /// Resolves every job of the consumed queues to a handler; a job whose handler this
    /// worker does not have is a config error naming the job.
    pub fn build(self) -> Result<Worker, WorkerError> {
        let config = Arc::new(self.config);
        let queues = self.queues.unwrap_or_else(|| config.worker_queues());
        let concurrency = self.concurrency.unwrap_or(config.worker.concurrency);
        if concurrency == 0 {
            return Err(ConfigError::Invalid {
                key: "--concurrency".into(),
                message: "must be at least 1".into(),
            }
            .into());
        }
        for (i, q) in queues.iter().enumerate() {
            if !chime_shared::config::valid_name(q) {
                return Err(ConfigError::Invalid {
                    key: format!("--queues[{i}]"),
                    message: format!("{q:?} must be 1-100 letters, digits, '-', '_' or '.'"),
                }
                .into());
            }
        }
        let mut jobs = HashMap::new();
        for (i, job) in config.jobs.iter().enumerate() {
            let handler = builtin::for_job(job).or_else(|| self.registry.get(&job.handler));
            match handler {
                Some(handler) => {
                    let timeout = job.timeout.unwrap_or(config.worker.default_timeout);
                    let limit = config.amqp.consumer_timeout.saturating_sub(Duration::from_secs(60));
                    if timeout >= limit {
                        warn!(job = %job.name, ?timeout, consumer_timeout = ?config.amqp.consumer_timeout,
                            "job timeout is not safely below RabbitMQ's consumer_timeout (minus its 1 min check \
                             interval): a run that long makes the broker close the channel and requeue every \
                             unacked delivery on it; raise consumer_timeout on the broker and amqp.consumer_timeout");
                    }
                    let backoff = job.backoff.clone().unwrap_or_default();
                    jobs.insert(job.name.clone(), JobSpec::new(handler, timeout, backoff, job.deadline));
                }
                None if queues.iter().any(|q| q == job.queue()) => {
                    return Err(ConfigError::Invalid {
                        key: format!("jobs[{i}] ({}).handler", job.name),
                        message: format!(
                            "{:?} is neither a built-in handler ({}) nor registered in this worker",
                            job.handler,
                            builtin::BUILTINS.join(", ")
                        ),
                    }
                    .into());
                }
                None => {}
            }
        }
        for (name, handler) in self.registry.iter() {
            if !jobs.contains_key(name) {
                let spec = JobSpec::new(
                    handler.clone(),
                    config.worker.default_timeout,
                    BackoffConfig::default(),
                    None,
                );
                jobs.insert(name.to_string(), spec);
            }
        }
        let names = Names::new(&config.prefix);
        let store = IdemStore::connect(&config.redis, names.clone())?;
        let worker_id = self.worker_id.unwrap_or_else(default_worker_id);
        let (redis_ok, redis_rx) = watch::channel(false);
        let prefetch =
            config.worker.prefetch.unwrap_or_else(|| u16::try_from(concurrency).unwrap_or(u16::MAX));
        let health = self.health.unwrap_or_default();
        for c in ["amqp", "redis", "consuming"] {
            health.set(c, false);
        }
        let shared = Arc::new(Shared {
            config,
            names,
            store,
            worker_id,
            nonce: uuid::Uuid::new_v4().simple().to_string()[..8].to_string(),
            owners: AtomicU64::new(0),
            stats: Arc::new(Stats::default()),
            jobs,
            redis_ok,
            intake_stopped: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
        });
        Ok(Worker { shared, queues, concurrency, prefetch, health, redis_rx })
    }
}

fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "host".into());
    format!("{}:{}", host.trim(), std::process::id())
}

/// Why a session ended.
enum SessionEnd {
    Shutdown,
    ConnectionLost(String),
}

impl Worker {
    pub fn builder(config: Config) -> WorkerBuilder {
        WorkerBuilder::new(config)
    }

    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// Outcome counters of this worker.
    pub fn stats(&self) -> Arc<Stats> {
        self.shared.stats.clone()
    }

    pub fn queues(&self) -> &[String] {
        &self.queues
    }

    /// Runs until `shutdown` is cancelled, then drains. Returns an error only for problems
    /// a restart cannot fix (a queue declared with other arguments).
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        let tracker = TaskTracker::new();
        let semaphore = Arc::new(Semaphore::new(self.concurrency));
        let monitor = tokio::spawn(redis_monitor(self.shared.clone(), self.health.clone(), shutdown.clone()));
        info!(worker = %self.shared.worker_id, queues = ?self.queues, concurrency = self.concurrency,
            prefetch = self.prefetch, "worker starting");

        let mut delays = reconnect_delays();
        let mut result = Ok(());
        while !shutdown.is_cancelled() {
            let conn_name = format!("chime-worker {}", self.shared.worker_id);
            let conn = tokio::select! {
                c = amqp::connect(&self.shared.config.amqp, &conn_name) => c,
                _ = shutdown.cancelled() => break,
            };
            let conn = match conn {
                Ok(c) => c,
                Err(e) => {
                    let delay = delays.next().unwrap_or(MAX_RECONNECT_DELAY);
                    warn!(error = %e, retry_in = ?delay, "cannot connect to RabbitMQ");
                    self.health.set("amqp", false);
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.cancelled() => break,
                    }
                    continue;
                }
            };
            match self.session(&conn, &tracker, &semaphore, &shutdown).await {
                Ok(SessionEnd::Shutdown) => {
                    let _ = conn.close(200, "shutdown".into()).await;
                    break;
                }
                Ok(SessionEnd::ConnectionLost(why)) => {
                    self.health.set("amqp", false);
                    self.health.set("consuming", false);
                    warn!(reason = %why, "RabbitMQ connection lost; reconnecting");
                    delays = reconnect_delays();
                }
                Err(e) if e.is_transient() => {
                    self.health.set("amqp", false);
                    warn!(error = %e, "declaring topology failed; reconnecting");
                    tokio::time::sleep(delays.next().unwrap_or(MAX_RECONNECT_DELAY)).await;
                }
                Err(e) => {
                    error!(error = %e, "cannot declare topology");
                    result = Err(e.into());
                    break;
                }
            }
        }
        if !tracker.is_closed() {
            self.drain(&tracker).await;
        }
        monitor.abort();
        self.health.set("consuming", false);
        info!("worker stopped");
        result
    }

    /// Waits for in-flight jobs up to the drain deadline, then stops the rest.
    async fn drain(&self, tracker: &TaskTracker) {
        self.shared.intake_stopped.cancel();
        tracker.close();
        let deadline = self.shared.config.worker.shutdown_timeout;
        if tokio::time::timeout(deadline, tracker.wait()).await.is_err() {
            warn!(in_flight = tracker.len(), ?deadline, "drain deadline passed; stopping the remaining jobs");
            self.shared.hard_stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(10), tracker.wait()).await;
        }
    }

    async fn session(
        &mut self,
        conn: &Connection,
        tracker: &TaskTracker,
        semaphore: &Arc<Semaphore>,
        shutdown: &CancellationToken,
    ) -> Result<SessionEnd, TopologyError> {
        topology::declare(conn, &self.shared.config, &self.queues).await?;
        let lost = |e: lapin::Error| Ok(SessionEnd::ConnectionLost(e.to_string()));
        let publish = match conn.create_channel().await {
            Ok(c) => c,
            Err(e) => return lost(e),
        };
        if let Err(e) = publish.confirm_select(ConfirmSelectOptions::default()).await {
            return lost(e);
        }
        self.health.set("amqp", true);
        info!("connected to RabbitMQ");

        // One channel per queue for the whole session: a pause cancels the consumer but
        // keeps the channel, so in-flight deliveries on it can still be settled.
        let mut channels = Vec::new();
        for q in &self.queues {
            let ch = match conn.create_channel().await {
                Ok(c) => c,
                Err(e) => return lost(e),
            };
            if let Err(e) = ch.basic_qos(self.prefetch, BasicQosOptions::default()).await {
                return lost(e);
            }
            channels.push((q.clone(), ch, AckBatcher::spawn()));
        }
        let publish = Arc::new(publish);

        loop {
            // Intake only while Redis answers: without it no delivery can be decided.
            let redis_ok = *self.redis_rx.borrow();
            if !redis_ok {
                self.health.set("consuming", false);
                info!("waiting for redis before consuming");
                tokio::select! {
                    alive = redis_becomes(&mut self.redis_rx, true) => if !alive { return Ok(SessionEnd::Shutdown); },
                    _ = shutdown.cancelled() => return Ok(SessionEnd::Shutdown),
                }
            }
            let mut tags = Vec::new();
            let mut streams = SelectAll::new();
            for (q, ch, acks) in &channels {
                match self.consume(ch, q).await {
                    Ok(consumer) => {
                        let (queue, acks) = (q.clone(), acks.clone());
                        tags.push((ch.clone(), consumer.tag()));
                        streams.push(consumer.map(move |d| (queue.clone(), acks.clone(), d)).boxed());
                    }
                    Err(e) => return lost(e),
                }
            }
            self.health.set("consuming", true);
            let pause = loop {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break Pause::Shutdown,
                    _ = redis_becomes(&mut self.redis_rx, false) => break Pause::Redis,
                    next = streams.next() => match next {
                        Some((queue, acks, Ok(delivery))) => {
                            acks.delivered(delivery.delivery_tag);
                            let permit = tokio::select! {
                                p = semaphore.clone().acquire_owned() => p,
                                _ = shutdown.cancelled() => {
                                    acks.requeue(delivery.delivery_tag, delivery.acker);
                                    break Pause::Shutdown;
                                }
                            };
                            let Ok(permit) = permit else { break Pause::Shutdown };
                            let shared = self.shared.clone();
                            let publish = publish.clone();
                            tracker.spawn(async move {
                                process::handle(&shared, &publish, &acks, &queue, delivery).await;
                                drop(permit);
                            });
                        }
                        Some((queue, _, Err(e))) => break Pause::Lost(format!("consumer of {queue}: {e}")),
                        None => break Pause::Lost("consumers ended (cancelled by the broker?)".into()),
                    },
                }
            };
            self.health.set("consuming", false);
            if let Pause::Lost(why) = pause {
                return Ok(SessionEnd::ConnectionLost(why));
            }
            // Stop intake, then give back whatever was prefetched but not started.
            for (ch, tag) in &tags {
                let _ = ch.basic_cancel(tag.clone(), BasicCancelOptions::default()).await;
            }
            let requeue = async {
                while let Some((_, acks, Ok(d))) = streams.next().await {
                    acks.delivered(d.delivery_tag);
                    acks.requeue(d.delivery_tag, d.acker);
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(2), requeue).await;
            if matches!(pause, Pause::Shutdown) {
                info!("intake stopped; draining in-flight jobs");
                self.drain(tracker).await;
                // Hand every batched ack to its channel, then close the channels gracefully:
                // close waits for close-ok, and AMQP orders frames per channel, so every ack
                // has reached the broker. Closing the connection alone can overtake the last
                // acks (they would be redelivered).
                for (_, ch, acks) in &channels {
                    acks.flush().await;
                    let _ = ch.close(200, "shutdown".into()).await;
                }
                let _ = publish.close(200, "shutdown".into()).await;
                return Ok(SessionEnd::Shutdown);
            }
            warn!("redis unreachable: intake paused until it answers");
        }
    }

    async fn consume(&self, ch: &Channel, queue: &str) -> Result<lapin::Consumer, lapin::Error> {
        let tag = format!("{}/{}/{}", self.shared.worker_id, queue, uuid::Uuid::new_v4().simple());
        let consumer = ch
            .basic_consume(
                self.shared.names.work_queue(queue).into(),
                tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(consumer)
    }
}

const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(10);

/// Reconnect delays: exponential from 200 ms to 10 s with jitter, never giving up.
fn reconnect_delays() -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(MAX_RECONNECT_DELAY)
        .with_jitter()
        .without_max_times()
        .build()
}

/// Waits until the Redis flag equals `want`; `false` if the sender is gone.
async fn redis_becomes(rx: &mut watch::Receiver<bool>, want: bool) -> bool {
    rx.wait_for(|ok| *ok == want).await.is_ok()
}

enum Pause {
    Shutdown,
    Redis,
    Lost(String),
}

/// Pings Redis every second (every 250 ms while it is down) and publishes the result.
async fn redis_monitor(shared: Arc<Shared>, health: Health, shutdown: CancellationToken) {
    let mut was_ok = None;
    loop {
        let ok = shared.store.ping().await.is_ok();
        if was_ok != Some(ok) {
            if ok {
                info!("redis reachable");
            } else {
                warn!("redis unreachable");
            }
            was_ok = Some(ok);
        }
        health.set("redis", ok);
        shared.redis_ok.send_if_modified(|v| {
            let changed = *v != ok;
            *v = ok;
            changed
        });
        let period = if ok { Duration::from_secs(1) } else { Duration::from_millis(250) };
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
