//! The worker runtime: connection supervision, consumers, bounded concurrency, Redis
//! gating and graceful shutdown. Takes a `CancellationToken`; installs no signal handler.
//!
//! Lifecycle: connect (URLs in turn, backoff) → declare → consume every queue on its own
//! channel with a prefetch → for each delivery take a concurrency permit and spawn
//! `process::handle`. While Redis is unreachable, consumers are cancelled (intake stops)
//! and `/readyz` fails; they resume when Redis answers. A queue whose pause flag is set is
//! not consumed (its in-flight jobs finish); every second the flags are read, every 5 s the
//! worker's heartbeat is written. A lost connection is rebuilt.
//! On shutdown: cancel consumers, requeue what was prefetched, drain in-flight jobs up to
//! `worker.shutdown_timeout`, then stop what is left (requeued, claim released) and close.

use chime_shared::amqp;
use chime_shared::config::{Config, ConfigError, Priority, ValidConfig};
use chime_shared::control::{self, Target, WorkerBeat};
use chime_shared::envelope::pack;
use chime_shared::health::Health;
use chime_shared::idempotency::IdemStore;
use chime_shared::topology::{self, TopologyError};
use futures_util::StreamExt;
use futures_util::stream::SelectAll;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

use crate::ack::{AckBatcher, Ticket};
use crate::handler::Registry;
use crate::process::{self, Incoming};
pub use crate::state::Stats;
use crate::state::{Core, resolve_jobs};
use crate::store::BrokerOutbox;

/// Why a worker could not be built or stopped running.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The config (or the registry against it) is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The broker refused the topology.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// Redis could not be set up.
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
    core: Arc<Core>,
    store: IdemStore,
    queues: Vec<String>,
    concurrency: usize,
    /// Prefetch of each queue's consumer (as `queues`).
    prefetch: Vec<u16>,
    health: Health,
    redis_rx: watch::Receiver<bool>,
}

/// Builds a [`Worker`] from config plus Rust-registered handlers.
pub struct WorkerBuilder {
    config: ValidConfig,
    registry: Registry,
    queues: Option<Vec<String>>,
    concurrency: Option<usize>,
    worker_id: Option<String>,
    health: Option<Health>,
}

impl WorkerBuilder {
    /// A builder with no Rust handlers; built-in handlers come from the config (validated:
    /// [`Config::validated`], or [`Config::load`]).
    pub fn new(config: ValidConfig) -> Self {
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
    /// Logical queues to consume (default: every queue of the config's and registry's jobs).
    pub fn queues(mut self, queues: Vec<String>) -> Self {
        self.queues = Some(queues);
        self
    }
    /// Jobs run at once (default `worker.concurrency`).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n);
        self
    }
    /// Owner id written into claims (default `worker.id`, else host and pid).
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
        let config = self.config;
        // By default: the config's queues, plus those of jobs defined in Rust.
        let queues = self.queues.unwrap_or_else(|| {
            let mut q = config.worker_queues();
            if config.worker.queues.is_empty() {
                q.extend(self.registry.job_queues().map(str::to_string));
                q.sort();
                q.dedup();
            }
            q
        });
        let concurrency = self.concurrency.unwrap_or(config.worker.concurrency);
        if concurrency == 0 {
            return Err(ConfigError::Invalid {
                key: "--concurrency".into(),
                message: "must be at least 1".into(),
            }
            .into());
        }
        let known = config.all_queues();
        for (i, q) in queues.iter().enumerate() {
            if !chime_shared::config::valid_name(q) {
                return Err(ConfigError::Invalid {
                    key: format!("--queues[{i}]"),
                    message: format!("{q:?} must be 1-100 letters, digits, '-', '_' or '.'"),
                }
                .into());
            }
            // Consumed twice, each with its own prefetch: surely a slip.
            if let Some(first) = queues[..i].iter().position(|e| e == q) {
                return Err(ConfigError::Invalid {
                    key: format!("--queues[{i}]"),
                    message: format!("{q:?} is given twice (also --queues[{first}])"),
                }
                .into());
            }
            // Maybe a typo (the queue meant goes unconsumed), maybe a queue another config or
            // another worker's code declares: consumed, and said.
            if !known.iter().any(|k| k == q) && !self.registry.job_queues().any(|r| r == q) {
                tracing::warn!(
                    queue = %q,
                    known = %known.join(", "),
                    "a queue to consume is neither in this config nor a queue of this worker's jobs \
                     defined in Rust: consuming it (declared if missing); check the name if that was not meant"
                );
            }
        }
        let jobs = resolve_jobs(&config, &self.registry, &queues)?;
        let store = IdemStore::connect(&config.redis, chime_shared::topology::Names::new(&config.prefix))?
            .with_history(&config.history)
            .with_result_retention(config.results.retention);
        let worker_id = self.worker_id.unwrap_or_else(chime_shared::names::process_name);
        let prefetch =
            queues.iter().map(|q| default_prefetch(&config, &self.registry, &jobs, q, concurrency)).collect();
        let health = self.health.unwrap_or_default();
        for c in ["amqp", "redis", "consuming"] {
            health.set(c, false);
        }
        let core = Arc::new(Core::new(config, self.registry, jobs, worker_id));
        let redis_rx = core.redis_ok.subscribe();
        Ok(Worker { core, store, queues, concurrency, prefetch, health, redis_rx })
    }
}

/// Why a session ended.
enum SessionEnd {
    Shutdown,
    ConnectionLost(String),
}

impl Worker {
    /// Same as [`WorkerBuilder::new`].
    pub fn builder(config: ValidConfig) -> WorkerBuilder {
        WorkerBuilder::new(config)
    }

    /// Readiness checks (`amqp`, `redis`), for a health endpoint.
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// Outcome counters of this worker.
    pub fn stats(&self) -> Arc<Stats> {
        self.core.stats.clone()
    }

    /// A handle that replaces the job definitions of the running worker (SIGHUP, a changed
    /// config file). The queues it consumes and the connection settings stay as they were.
    pub fn reloader(&self) -> Reloader {
        Reloader { core: self.core.clone(), queues: self.queues.clone() }
    }

    /// The logical queues this worker consumes.
    pub fn queues(&self) -> &[String] {
        &self.queues
    }

    /// Runs until `shutdown` is cancelled, then drains. Returns an error only for problems
    /// a restart cannot fix (a queue declared with other arguments).
    ///
    /// The worker runs as a task of the current runtime, whatever polls this future: the
    /// intake spawns a task per delivery, and from a runtime thread that task starts on the
    /// same thread without waking another one.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        match tokio::spawn(self.run_on_runtime(shutdown)).await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is shutting down.
            Err(_) => Ok(()),
        }
    }

    async fn run_on_runtime(mut self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        let tracker = TaskTracker::new();
        let semaphore = Arc::new(Semaphore::new(self.concurrency));
        metrics::gauge!(chime_shared::telemetry::WORKER_CONCURRENCY).set(self.concurrency as f64);
        metrics::gauge!(chime_shared::telemetry::WORKER_RUNNING).set(0.0);
        let monitor = tokio::spawn(redis_monitor(
            self.core.clone(),
            self.store.clone(),
            self.health.clone(),
            shutdown.clone(),
        ));
        let shedding = tokio::spawn(shedding(
            self.core.clone(),
            self.store.clone(),
            self.queues.clone(),
            shutdown.clone(),
        ));
        let steering = tokio::spawn(control(
            self.core.clone(),
            self.store.clone(),
            self.queues.clone(),
            self.concurrency,
            self.health.clone(),
            shutdown.clone(),
        ));
        let cancels = tokio::spawn(cancellations(self.core.clone(), self.store.clone()));
        info!(worker = %self.core.worker_id, queues = ?self.queues, concurrency = self.concurrency,
            prefetch = ?self.prefetch, "worker starting");

        let mut delays = reconnect_delays();
        let mut result = Ok(());
        while !shutdown.is_cancelled() {
            let conn_name = format!("chime-worker {}", self.core.worker_id);
            let conn = tokio::select! {
                c = amqp::connect(&self.core.config.amqp, &conn_name) => c,
                _ = shutdown.cancelled() => break,
            };
            let conn = match conn {
                Ok(c) => Arc::new(c),
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
                    // Whatever is still open goes: the broker requeues its unacked deliveries.
                    let _ = conn.close(320, "reconnecting".into()).await;
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
        cancels.abort();
        let _ = steering.await;
        let _ = shedding.await;
        // Runs no finish followed (expired, lost lease) may still wait for their pipeline.
        self.store.flush_history().await;
        self.health.set("consuming", false);
        info!("worker stopped");
        result
    }

    /// Waits for in-flight jobs up to the drain deadline, then stops the rest.
    async fn drain(&self, tracker: &TaskTracker) {
        self.core.intake_stopped.cancel();
        tracker.close();
        let deadline = self.core.config.worker.shutdown_timeout;
        if tokio::time::timeout(deadline, tracker.wait()).await.is_err() {
            warn!(in_flight = tracker.len(), ?deadline, "drain deadline passed; stopping the remaining jobs");
            self.core.hard_stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(10), tracker.wait()).await;
        }
    }

    async fn session(
        &mut self,
        conn: &Arc<Connection>,
        tracker: &TaskTracker,
        semaphore: &Arc<Semaphore>,
        shutdown: &CancellationToken,
    ) -> Result<SessionEnd, TopologyError> {
        topology::declare(conn, &self.core.config, &self.queues).await?;
        let lost = |e: lapin::Error| Ok(SessionEnd::ConnectionLost(e.to_string()));
        let publish = Arc::new(amqp::ChannelPool::new(conn.clone(), crate::store::PUBLISH_CHANNELS));
        // One publish channel now, so that a broker refusing channels ends the session here.
        match publish.lend().await {
            Ok(lent) => lent.settled(),
            Err(e) => return Ok(SessionEnd::ConnectionLost(e.to_string())),
        }
        self.health.set("amqp", true);
        info!("connected to RabbitMQ");

        // One channel per route (a queue, or one of its priority levels) for the whole
        // session: a pause cancels the consumer but keeps the channel, so in-flight deliveries
        // on it can still be settled.
        let mut channels = Vec::new();
        for (q, prefetch) in self.queues.iter().zip(&self.prefetch) {
            let routes = self.core.config.routes(q);
            let levels = routes.len();
            for (route, level) in routes {
                let ch = match conn.create_channel().await {
                    Ok(c) => c,
                    Err(e) => return lost(e),
                };
                // Priority holds only among deliveries already here: above the lowest level,
                // twice the prefetch keeps one waiting for every slot that frees while the
                // broker sends the next (else a low job would take the slot meanwhile).
                let prefetch =
                    if levels > 1 && level != Priority::Low { prefetch.saturating_mul(2) } else { *prefetch };
                if let Err(e) = ch.basic_qos(prefetch, BasicQosOptions::default()).await {
                    return lost(e);
                }
                let acks = AckBatcher::spawn(Arc::new(ch.clone()));
                channels.push(Route { queue: q.clone(), route, level, ch, acks });
            }
        }
        // Broadcast jobs: this worker's own queue, where the copies for it arrive.
        let broadcast =
            self.core.config.jobs.iter().any(|j| j.broadcast && self.queues.iter().any(|q| q == j.queue()));
        if broadcast {
            let ch = match conn.create_channel().await {
                Ok(c) => c,
                Err(e) => return lost(e),
            };
            let route = topology::declare_worker_queue(&ch, &self.core.names, &self.core.worker_id).await?;
            let prefetch = self.prefetch.first().copied().unwrap_or(8);
            if let Err(e) = ch.basic_qos(prefetch, BasicQosOptions::default()).await {
                return lost(e);
            }
            // Its deliveries belong to the queue their envelope names (set when decoded).
            channels.push(Route {
                queue: String::new(),
                route,
                level: Priority::Normal,
                acks: AckBatcher::spawn(Arc::new(ch.clone())),
                ch,
            });
        }
        let outbox = BrokerOutbox {
            channels: publish,
            names: self.core.names.clone(),
            queue_type: self.core.config.amqp.queue_type,
            timeout: self.core.config.amqp.publish_timeout,
            broken: CancellationToken::new(),
            parks: Arc::new(crate::parks::Packer::new(
                self.core.config.worker.park_pack.min(self.core.config.worker.concurrency),
                self.core.config.amqp.max_message_bytes,
                // Half each queue's prefetch (its base level's: a priority level above takes
                // twice as many).
                self.queues
                    .iter()
                    .zip(&self.prefetch)
                    .map(|(q, p)| (q.clone(), usize::from(*p).div_ceil(2)))
                    .collect(),
            )),
        };

        let mut paused_rx = self.core.paused.subscribe();
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
            let paused = paused_rx.borrow_and_update().clone();
            let mut tags = Vec::new();
            // By level: the next delivery taken is the most urgent one waiting.
            let mut streams: [SelectAll<_>; 3] = [SelectAll::new(), SelectAll::new(), SelectAll::new()];
            // Levels above the lowest with messages waiting on the broker as intake starts.
            let mut backlogged = [false; 3];
            for r in &channels {
                if !r.queue.is_empty() && paused.contains(&r.queue) {
                    continue;
                }
                if r.level != Priority::Low
                    && channels.iter().any(|o| o.queue == r.queue && o.level != r.level)
                {
                    let passive = lapin::options::QueueDeclareOptions { passive: true, ..Default::default() };
                    let name = self.core.names.work_queue(&r.route);
                    match r.ch.queue_declare(name.as_str().into(), passive, FieldTable::default()).await {
                        Ok(q) if q.message_count() > 0 => backlogged[level_index(r.level)] = true,
                        Ok(_) => {}
                        Err(e) => return lost(e),
                    }
                }
                match self.consume(&r.ch, &r.route).await {
                    Ok(consumer) => {
                        let (queue, route, acks) = (r.queue.clone(), r.route.clone(), r.acks.clone());
                        tags.push((r.ch.clone(), consumer.tag()));
                        streams[level_index(r.level)].push(
                            consumer.map(move |d| (queue.clone(), route.clone(), acks.clone(), d)).boxed(),
                        );
                    }
                    Err(e) => return lost(e),
                }
            }
            if !paused.is_empty() {
                info!(paused = ?paused, "paused queues are not consumed (chime resume queue Q)");
            }
            if streams.iter().all(SelectAll::is_empty) {
                // Every queue is paused: wait for a resume.
                self.health.set("consuming", false);
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(SessionEnd::Shutdown),
                    changed = paused_rx.changed() => if changed.is_err() { return Ok(SessionEnd::Shutdown) },
                }
                continue;
            }
            self.health.set("consuming", true);
            let mut streams = streams.map(StreamExt::peekable);
            // The first fill: every level pushes its prefetch at once, and a low delivery that
            // arrives first must not take a slot before the high ones waiting on the broker
            // are here. Wait (briefly) until each backlogged level has delivered.
            let first_fill = tokio::time::Instant::now() + FIRST_FILL;
            for (stream, waiting) in streams.iter_mut().zip(backlogged) {
                if waiting {
                    let _ = tokio::time::timeout_at(first_fill, std::pin::Pin::new(stream).peek()).await;
                }
            }
            let [high, normal, low] = &mut streams;
            let pause = loop {
                // A slot first, then the delivery to run in it: a high one before a normal one
                // before a low one, whichever arrived first (the broker pushes each level's
                // prefetch; they wait here until a slot is free).
                let permit = tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break Pause::Shutdown,
                    _ = redis_becomes(&mut self.redis_rx, false) => break Pause::Redis,
                    _ = paused_rx.changed() => break Pause::Steer,
                    _ = outbox.broken.cancelled() => break Pause::Lost("the broker closed the publish channel".into()),
                    p = semaphore.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break Pause::Shutdown,
                    },
                };
                // Aging (`jobs[].promote_after`): of the deliveries here, the one of the most
                // urgent level after promotion, the longest waiting among equals.
                let aged = if self.core.promote.is_empty() {
                    None
                } else {
                    aged_pick(&self.core, [&mut *high, &mut *normal, &mut *low])
                };
                let next = if let Some(next) = aged {
                    Some(next)
                } else {
                    tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => break Pause::Shutdown,
                        _ = redis_becomes(&mut self.redis_rx, false) => break Pause::Redis,
                        _ = paused_rx.changed() => break Pause::Steer,
                        _ = outbox.broken.cancelled() => break Pause::Lost("the broker closed the publish channel".into()),
                        next = high.next(), if !high.get_ref().is_empty() => next,
                        next = normal.next(), if !normal.get_ref().is_empty() => next,
                        next = low.next(), if !low.get_ref().is_empty() => next,
                    }
                };
                match next {
                    Some((queue, route, acks, Ok(delivery))) => {
                        let ticket = acks.delivered(delivery.delivery_tag);
                        let (core, store, outbox) = (self.core.clone(), self.store.clone(), outbox.clone());
                        let max = self.core.config.amqp.max_message_bytes + pack::OVERHEAD;
                        if pack::is_pack(&delivery.properties)
                            && delivery.data.len() <= max
                            && let Ok((jobs, headers)) = pack::unpack(&delivery.data)
                        {
                            let jobs: Vec<Vec<u8>> = jobs.into_iter().map(<[u8]>::to_vec).collect();
                            let unpacked =
                                Unpacked { queue, route, properties: delivery.properties, jobs, headers };
                            let (tracker, semaphore, shutdown) =
                                (tracker.clone(), semaphore.clone(), shutdown.clone());
                            tracker.clone().spawn(Box::pin(async move {
                                unpacked
                                    .run(core, store, outbox, ticket, permit, (tracker, semaphore, shutdown))
                                    .await;
                            }));
                            continue;
                        }
                        let incoming = Incoming {
                            queue,
                            route,
                            data: delivery.data,
                            properties: delivery.properties,
                            slot: process::WorkerSlot::new(permit),
                            packed: false,
                        };
                        // Boxed: the delivery's future is large, and a task moves what it
                        // holds (into its cell, and again to drop it) once per job.
                        tracker.spawn(Box::pin(async move {
                            process::handle(&core, &store, &outbox, incoming, ticket).await;
                        }));
                    }
                    Some((_, route, _, Err(e))) => break Pause::Lost(format!("consumer of {route}: {e}")),
                    None => break Pause::Lost("consumers ended (cancelled by the broker?)".into()),
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
                for level in &mut streams {
                    while let Some((_, _, acks, Ok(d))) = level.next().await {
                        acks.delivered(d.delivery_tag).requeue().await;
                    }
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
                for r in &channels {
                    r.acks.flush().await;
                    if r.queue.is_empty() {
                        // This worker's own queue: nobody else will consume it.
                        let opts = lapin::options::QueueDeleteOptions::default();
                        let _ = r.ch.queue_delete(self.core.names.work_queue(&r.route).into(), opts).await;
                    }
                    let _ = r.ch.close(200, "shutdown".into()).await;
                }
                outbox.channels.close().await;
                return Ok(SessionEnd::Shutdown);
            }
            if matches!(pause, Pause::Redis) {
                warn!("redis unreachable: intake paused until it answers");
            }
        }
    }

    async fn consume(&self, ch: &Channel, queue: &str) -> Result<lapin::Consumer, lapin::Error> {
        let tag = format!("{}/{}/{}", self.core.worker_id, queue, uuid::Uuid::new_v4().simple());
        let consumer = ch
            .basic_consume(
                self.core.names.work_queue(queue).into(),
                tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(consumer)
    }
}

/// What the intake's streams of one level yield: queue, route, its acks, the delivery.
type Arrival = (String, String, AckBatcher, Result<lapin::message::Delivery, lapin::Error>);

/// With aging: the delivery a free slot takes among those already here (none here: `None`,
/// and the first to arrive goes). Each is ranked by its level less one for each whole
/// `promote_after` of its job it has waited ([`queued_since`]), then by how long it waited.
fn aged_pick<S>(core: &Core, levels: [&mut futures_util::stream::Peekable<S>; 3]) -> Option<Arrival>
where
    S: futures_util::Stream<Item = Arrival> + Unpin,
{
    use futures_util::FutureExt;
    let now = u64::try_from(core.now().timestamp()).unwrap_or(0);
    let mut best: Option<(usize, u64, usize)> = None;
    let mut levels = levels;
    for (level, stream) in levels.iter_mut().enumerate() {
        let Some(Some((_, _, _, Ok(d)))) = std::pin::Pin::new(&mut **stream).peek().now_or_never() else {
            continue;
        };
        let since = queued_since(&d.properties).unwrap_or(now);
        let steps = d
            .properties
            .kind()
            .as_ref()
            .and_then(|job| core.promote.get(job.as_str()))
            .map_or(0, |after| now.saturating_sub(since) / after.as_secs().max(1));
        let rank = (level.saturating_sub(usize::try_from(steps).unwrap_or(usize::MAX)), since, level);
        if best.is_none_or(|b| rank < b) {
            best = Some(rank);
        }
    }
    let (_, _, level) = best?;
    levels[level].next().now_or_never().flatten()
}

/// Since when a delivery has waited in its queue (Unix seconds): since it came back from the
/// delay chain (its latest `x-death`), else since it was enqueued (the `timestamp` property).
fn queued_since(props: &lapin::BasicProperties) -> Option<u64> {
    use lapin::types::AMQPValue;
    let back = props.headers().as_ref().and_then(|h| match h.inner().get("x-death")? {
        AMQPValue::FieldArray(deaths) => match deaths.as_slice().first()? {
            AMQPValue::FieldTable(death) => match death.inner().get("time")? {
                AMQPValue::Timestamp(t) => Some(*t),
                _ => None,
            },
            _ => None,
        },
        _ => None,
    });
    back.or(*props.timestamp())
}

/// A route the session consumes: a queue, or one of its priority levels.
struct Route {
    /// The queue it belongs to (pause flags, dead letters, history).
    queue: String,
    /// The broker queue it is (`<prefix>.q.<route>`).
    route: String,
    level: Priority,
    ch: Channel,
    acks: AckBatcher,
}

/// How long intake waits, as it starts, for the first deliveries of priority levels that have
/// messages waiting (so that order holds from the first job after a restart).
const FIRST_FILL: Duration = Duration::from_secs(1);

/// Index of a level in the intake's streams, most urgent first.
fn level_index(level: Priority) -> usize {
    match level {
        Priority::High => 0,
        Priority::Normal => 1,
        Priority::Low => 2,
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
    /// A queue was paused or resumed: consume again, the paused queues left out.
    Steer,
    Lost(String),
}

/// Every second, reads the pause flags of this worker's queues into [`Core::paused`]; every
/// [`control::BEAT_EVERY`], writes its heartbeat. The beat is deleted on shutdown.
async fn control(
    core: Arc<Core>,
    store: IdemStore,
    queues: Vec<String>,
    concurrency: usize,
    health: Health,
    shutdown: CancellationToken,
) {
    let mut conn = store.connection();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut last_beat: Option<tokio::time::Instant> = None;
    let mut last_catalog: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => break,
        }
        if let Ok(flags) = control::flags(&mut conn, &core.names, Target::Queue, &queues).await {
            let now: BTreeSet<String> =
                queues.iter().zip(&flags).filter(|(_, f)| f.is_some()).map(|(q, _)| q.clone()).collect();
            let changed = core.paused.send_if_modified(|before| {
                if *before == now {
                    return false;
                }
                for (q, flag) in queues.iter().zip(&flags) {
                    match (before.contains(q), flag) {
                        (false, Some(f)) => {
                            info!(queue = %q, by = %f.by, "queue paused: no longer consuming it")
                        }
                        (true, None) => info!(queue = %q, "queue resumed: consuming it again"),
                        _ => {}
                    }
                }
                *before = now.clone();
                true
            });
            if changed {
                last_beat = None; // the heartbeat shows the change at once
            }
        }
        if last_beat.is_none_or(|t| t.elapsed() >= control::BEAT_EVERY) {
            last_beat = Some(tokio::time::Instant::now());
            let beat = heartbeat(&core, &queues, concurrency, &health);
            if let Err(e) = control::beat(&mut conn, &core.names, &beat).await {
                debug!(error = %e, "heartbeat not written");
            }
            flush_minutes(&core, &mut conn).await;
        }
        // What this worker can run, for the operator tools (jobs defined in Rust included).
        if last_catalog.is_none_or(|t| t.elapsed() >= chime_shared::catalog::REFRESH) {
            let (jobs, consumed) = core.catalog(&queues);
            match chime_shared::catalog::register(&mut conn, &core.names, &jobs, &consumed).await {
                Ok(()) => last_catalog = Some(tokio::time::Instant::now()),
                Err(e) => debug!(error = %e, "catalog not written"),
            }
        }
    }
    flush_minutes(&core, &mut conn).await;
    let last = heartbeat(&core, &queues, concurrency, &health);
    if control::retire(&mut conn, &core.names, &last).await.is_err() {
        let _ = control::unregister(&mut conn, &core.names, &core.worker_id).await;
    }
}

/// How often a worker reads the cancellations stream.
const CANCELS_EVERY: Duration = Duration::from_millis(500);

/// Twice a second: the keys `chime cancel` named since the last read (the cancellations
/// stream, one Redis command); a run of one of them here has its token fired. A stream rather
/// than pub/sub: it needs no connection of its own (Sentinel, Cluster) and loses nothing while
/// a connection is re-made. The owner's lease renewal, which finds the key `cancelled`, is the
/// fallback (within a third of `redis.lease`).
async fn cancellations(core: Arc<Core>, store: IdemStore) {
    let mut conn = store.connection();
    let stream = core.names.cancels();
    let mut last: Option<String> = None;
    let mut tick = tokio::time::interval(CANCELS_EVERY);
    loop {
        tick.tick().await;
        let Some(from) = last.clone() else {
            // From the newest entry on: a key cancelled before is `cancelled` already, and a
            // claim of it here finds that.
            let newest: Result<Vec<(String, Vec<String>)>, _> = redis::cmd("XREVRANGE")
                .arg(&stream)
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(1)
                .query_async(&mut conn)
                .await;
            if let Ok(newest) = newest {
                last = Some(newest.first().map_or_else(|| "0-0".to_string(), |(id, _)| id.clone()));
            }
            continue;
        };
        let read: Result<Vec<(String, Vec<String>)>, _> = redis::cmd("XRANGE")
            .arg(&stream)
            .arg(format!("({from}"))
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await;
        let Ok(entries) = read else { continue };
        for (id, fields) in entries {
            if let [name, key] = fields.as_slice()
                && name == "key"
                && core.cancel_key(key)
            {
                info!(%key, "chime cancel named a run of this worker: stopping it");
            }
            last = Some(id);
        }
    }
}

/// Every second, for each consumed queue with a shedding threshold: reads its depth (every
/// priority level) and the longest wait of the runs taken from it since, decides whether it
/// must shed (`chime_shared::shed::judge`), sets or clears its flag in Redis, and sheds while
/// this worker's reading or another worker's flag says so.
async fn shedding(core: Arc<Core>, store: IdemStore, queues: Vec<String>, shutdown: CancellationToken) {
    use chime_shared::shed;
    let watched: Vec<String> = queues.iter().filter(|q| core.shed.contains_key(*q)).cloned().collect();
    if watched.is_empty() {
        return;
    }
    let mut conn = store.connection();
    let mut amqp: Option<lapin::Connection> = None;
    let mut own: HashMap<String, bool> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => break,
        }
        if amqp.as_ref().is_none_or(|c| !c.status().connected()) {
            amqp = chime_shared::amqp::connect(&core.config.amqp, "chime-worker shedding").await.ok();
        }
        let flags = match shed::read(&mut conn, &core.names, &watched).await {
            Ok(f) => f,
            Err(e) => {
                debug!(error = %e, "shedding flags unreadable");
                vec![None; watched.len()]
            }
        };
        for (q, flag) in watched.iter().zip(flags) {
            let (Some(state), Some(cfg)) = (core.shed.get(q), core.config.worker.shed.get(q)) else {
                continue;
            };
            let mut depth = None;
            if let Some(c) = &amqp {
                let mut sum = 0u32;
                let mut read = true;
                for (route, _) in core.config.routes(q) {
                    match chime_shared::topology::depth(c, &core.names.work_queue(&route)).await {
                        Ok((d, _)) => sum = sum.saturating_add(d),
                        Err(_) => read = false,
                    }
                }
                depth = read.then_some(sum);
            }
            let age = state.take_age();
            if depth == Some(0) {
                state.saw_empty();
            }
            if let Some(a) = age {
                metrics::gauge!(chime_shared::telemetry::QUEUE_WAIT, "queue" => q.clone())
                    .set(a.as_secs_f64());
            }
            let was_own = own.get(q).copied().unwrap_or(false);
            let mine = shed::judge(cfg, shed::Reading { depth, age }, was_own);
            let written = match (&mine, was_own) {
                (Some(why), _) => shed::set(&mut conn, &core.names, q, why).await,
                (None, true) => shed::clear(&mut conn, &core.names, q).await,
                (None, false) => Ok(()),
            };
            if let Err(e) = written {
                debug!(error = %e, queue = %q, "shedding flag not written");
            }
            own.insert(q.clone(), mine.is_some());
            // Another worker's flag counts too (the one read before this reading was ours).
            let now = mine.or(if was_own { None } else { flag });
            let mut reason = state.reason.write().unwrap_or_else(|p| p.into_inner());
            match (reason.is_some(), &now) {
                (false, Some(why)) => {
                    warn!(queue = %q, reason = %why, "queue backed up: shedding its sheddable runs")
                }
                (true, None) => {
                    info!(queue = %q, "queue below its shedding threshold: its sheddable runs run again")
                }
                _ => {}
            }
            metrics::gauge!(chime_shared::telemetry::QUEUE_SHEDDING, "queue" => q.clone())
                .set(if now.is_some() { 1.0 } else { 0.0 });
            *reason = now;
        }
    }
    // This worker no longer watches: its own flag goes (another worker still shedding sets it again).
    for (q, mine) in own {
        if mine {
            let _ = shed::clear(&mut conn, &core.names, &q).await;
        }
    }
}

/// Adds this worker's per-minute counts to the shared totals (kept for the next flush when
/// Redis does not answer).
async fn flush_minutes(core: &Core, conn: &mut chime_shared::redis_conn::RedisConn) {
    let counts = core.take_minutes();
    if counts.is_empty() {
        return;
    }
    if let Err(e) = chime_shared::minutes::add(conn, &core.names, &counts).await {
        debug!(error = %e, "per-minute totals not written yet");
        core.restore_minutes(counts);
    }
}

fn heartbeat(core: &Core, queues: &[String], concurrency: usize, health: &Health) -> WorkerBeat {
    let stats = &core.stats;
    let mut running: Vec<_> =
        core.running.lock().unwrap_or_else(|p| p.into_inner()).values().map(|(r, _)| r.clone()).collect();
    running.sort_by_key(|r| r.started_at);
    WorkerBeat {
        id: core.worker_id.clone(),
        host: gethostname::gethostname().to_string_lossy().into_owned(),
        pid: std::process::id(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        queues: queues.to_vec(),
        paused: core.paused.borrow().iter().cloned().collect(),
        concurrency,
        started_at: core.started_at,
        seen_at: core.now(),
        consuming: health.get("consuming"),
        settled: [
            Stats::get(&stats.succeeded),
            Stats::get(&stats.retried),
            Stats::get(&stats.dead_lettered),
            Stats::get(&stats.duplicates),
        ],
        running,
        stopped: false,
    }
}

/// A queue consumer's prefetch: `worker.prefetch` when set; otherwise `concurrency`, or less
/// when every job this worker knows on the queue has its own limit (their sum): a worker
/// must not hold back hundreds of `exec` jobs it will run 8 at a time, which other workers
/// could run meanwhile.
fn default_prefetch(
    config: &chime_shared::Config,
    registry: &Registry,
    jobs: &crate::state::Jobs,
    queue: &str,
    concurrency: usize,
) -> u16 {
    if let Some(p) = config.worker.prefetch {
        return p;
    }
    let queue_of = |name: &str| {
        config
            .job(name)
            .map(|j| j.queue().to_string())
            .or_else(|| registry.options(name).map(|o| o.queue_name().to_string()))
            .unwrap_or_else(|| chime_shared::config::DEFAULT_QUEUE.to_string())
    };
    let mut on_queue = jobs.iter().filter(|(name, _)| queue_of(name) == queue).peekable();
    let n = if on_queue.peek().is_none() {
        concurrency
    } else {
        on_queue.map(|(_, spec)| spec.max_running.unwrap_or(concurrency)).sum::<usize>().min(concurrency)
    };
    u16::try_from(n.max(1)).unwrap_or(u16::MAX)
}

/// Asks Redis its `TIME` every second (every 250 ms while it is down), publishes whether it
/// answered and keeps this host's clock offset to it ([`Core::now`]; set before the first
/// answer lets intake start), warning while it is over a second.
async fn redis_monitor(core: Arc<Core>, store: IdemStore, health: Health, shutdown: CancellationToken) {
    let mut was_ok = None;
    let mut skewed = false;
    let mut readings = crate::state::ClockReadings::default();
    loop {
        let ping = store.clock_offset_us().await.map(|(reading, round_trip)| {
            let offset_us = readings.offset(reading, round_trip);
            core.set_clock_offset(offset_us);
            let offset = offset_us / 1000;
            metrics::gauge!(chime_shared::telemetry::WORKER_CLOCK_SKEW).set(offset_us as f64 / 1e6);
            if skewed != (offset.abs() > 1000) {
                skewed = !skewed;
                if skewed {
                    warn!(
                        offset_ms = offset,
                        "this host's clock differs from Redis TIME by over a second: deadlines and waits are judged by Redis's (keep hosts on NTP)"
                    );
                } else {
                    info!(offset_ms = offset, "this host's clock is within a second of Redis TIME again");
                }
            }
        });
        let ok = ping.is_ok();
        if !ok {
            // The Redis that answers next may be another host (a failover): follow its clock
            // from its first reading.
            readings = crate::state::ClockReadings::default();
        }
        if was_ok != Some(ok) {
            let url = core.config.redis.endpoint();
            match ping {
                Ok(()) => info!(%url, "redis reachable"),
                Err(e) => {
                    let error = chime_shared::tls::with_explanation(e.to_string());
                    warn!(%url, %error, "redis unreachable")
                }
            }
            was_ok = Some(ok);
        }
        health.set("redis", ok);
        core.redis_ok.send_if_modified(|v| {
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

/// Replaces a running worker's job definitions (see [`Worker::reloader`]).
#[derive(Clone)]
pub struct Reloader {
    core: Arc<Core>,
    queues: Vec<String>,
}

impl Reloader {
    /// Applies the jobs of `config` (validated, resolved to handlers) to the running worker:
    /// jobs it did not know are run from now on, changed timeouts and backoffs apply to the
    /// next delivery. Deliveries already running keep their definition.
    pub fn reload(&self, config: &Config) -> Result<(), WorkerError> {
        let jobs = resolve_jobs(config, &self.core.registry, &self.queues)?;
        if config.worker_queues() != self.queues && config.worker.queues != self.queues {
            warn!("the reloaded config names other queues; restart the worker to consume them");
        }
        let kept = crate::state::kept_on_reload(&self.core.config, config);
        if !kept.is_empty() {
            warn!(
                changed = %kept.join(", "),
                "the reloaded config changes settings a running worker keeps until it restarts (only job definitions, with their limits and circuits, are reloaded)"
            );
        }
        info!(jobs = jobs.len(), "job definitions reloaded");
        self.core.set_jobs(jobs);
        Ok(())
    }
}

/// The jobs of a pack delivery, each run as a delivery of its own.
struct Unpacked {
    queue: String,
    route: String,
    properties: lapin::BasicProperties,
    jobs: Vec<Vec<u8>>,
    /// Each job's own headers (a pack of parked copies), or none.
    headers: Vec<pack::MemberHeaders>,
}

impl Unpacked {
    /// Starts each job in a worker slot of its own (the first in the slot the pack came
    /// with), as slots free up: a pack never runs more jobs at once than `worker.concurrency`.
    /// On shutdown the jobs not started are handed back: the pack is requeued once the
    /// started ones are settled.
    async fn run(
        self,
        core: Arc<Core>,
        store: IdemStore,
        outbox: BrokerOutbox,
        ticket: Ticket,
        first: tokio::sync::OwnedSemaphorePermit,
        (tracker, semaphore, shutdown): (TaskTracker, Arc<Semaphore>, CancellationToken),
    ) {
        let tickets = ticket.unpack(self.jobs.len());
        let mut first = Some(first);
        let mut own = self.headers.into_iter();
        for (data, ticket) in self.jobs.into_iter().zip(tickets) {
            let properties = match own.next() {
                Some(h) => pack::with_member_headers(&self.properties, &h),
                None => self.properties.clone(),
            };
            let permit = match first.take() {
                Some(p) => p,
                None => tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => {
                        ticket.requeue().await;
                        continue;
                    }
                    p = semaphore.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => {
                            ticket.requeue().await;
                            continue;
                        }
                    },
                },
            };
            let incoming = Incoming {
                queue: self.queue.clone(),
                route: self.route.clone(),
                data,
                properties,
                slot: process::WorkerSlot::new(permit),
                packed: true,
            };
            let (core, store, outbox) = (core.clone(), store.clone(), outbox.clone());
            tracker.spawn(Box::pin(async move {
                process::handle(&core, &store, &outbox, incoming, ticket).await;
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Worker;

    #[test]
    fn a_queue_given_twice_is_refused_by_name() {
        let config = chime_shared::config::Config::from_toml_str("").unwrap();
        let built =
            Worker::builder(config).queues(vec!["default".into(), "mail".into(), "default".into()]).build();
        let e = built.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("--queues[2]: \"default\" is given twice (also --queues[0])"), "{e}");
    }
}
