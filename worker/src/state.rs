//! What every delivery task of a worker shares: its jobs (reloadable), counters, tokens, and
//! the Redis health flag. No I/O lives here, so `process` (one delivery) and `runtime` (the
//! consumers) both build on it without depending on each other.

use chime_shared::config::ValidConfig;
use chime_shared::config::{BackoffConfig, Config, ConfigError};
use chime_shared::control::Running;
use chime_shared::telemetry::{self, outcome};
use chime_shared::topology::Names;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::builtin;
use crate::handler::{Handler, Registry};

/// A job this worker can run.
pub(crate) struct JobSpec {
    pub handler: Arc<dyn Handler>,
    pub timeout: Duration,
    pub backoff: BackoffConfig,
    /// A scheduled slot started later than slot + deadline is skipped as expired.
    pub deadline: Option<Duration>,
    /// Runs at once of this job in this process (`jobs[].concurrency`), when it is below the
    /// worker's own.
    pub limit: Option<Arc<tokio::sync::Semaphore>>,
    /// The number behind `limit`.
    pub max_running: Option<usize>,
    /// Runs at once across every worker (`jobs[].global_concurrency`): slots leased in Redis.
    pub global: Option<usize>,
    /// Held by the one delivery of this job in this process that asks Redis for a global
    /// slot; the others wait for it in turn (one poller per job and process, in arrival order).
    pub global_turn: tokio::sync::Mutex<()>,
    /// A run of this job in this process freed its global slot.
    pub global_freed: tokio::sync::Notify,
    /// The rate every worker together runs it at (`jobs[].rate_limit`).
    pub rate: Option<chime_shared::config::ResolvedLimit>,
    /// The circuit breaker its runs go through (`jobs[].circuit`).
    pub circuit: Option<CircuitSpec>,
    /// Skipped while its queue sheds (`jobs[].criticality = "sheddable"`).
    pub sheddable: bool,
    /// Metric handles of this job, registered on first use (after the recorder is installed).
    metrics: OnceLock<JobMetrics>,
}

impl JobSpec {
    pub fn new(
        handler: Arc<dyn Handler>,
        timeout: Duration,
        backoff: BackoffConfig,
        deadline: Option<Duration>,
        limit: Option<usize>,
        global: Option<usize>,
    ) -> Self {
        // This process never runs more than the global limit either: the local limit is the
        // lower of the two (it also bounds the queue's default prefetch).
        let max_running = match (limit, global) {
            (Some(l), Some(g)) => Some(l.min(g)),
            (l, g) => l.or(g),
        }
        .map(|n| n.max(1));
        let limit = max_running.map(|n| Arc::new(tokio::sync::Semaphore::new(n)));
        Self {
            handler,
            timeout,
            backoff,
            deadline,
            limit,
            max_running,
            global: global.map(|n| n.max(1)),
            global_turn: tokio::sync::Mutex::new(()),
            global_freed: tokio::sync::Notify::new(),
            rate: None,
            circuit: None,
            sheddable: false,
            metrics: OnceLock::new(),
        }
    }

    /// With the rate limit its config entry names.
    pub fn with_rate(mut self, rate: Option<chime_shared::config::ResolvedLimit>) -> Self {
        self.rate = rate;
        self
    }

    /// With the circuit breaker its config entry names; `names` spells its Redis key.
    pub fn with_circuit(mut self, config: &Config, job: &str) -> Self {
        self.circuit = config.circuit_of(job).map(|c| CircuitSpec::new(c, config, self.timeout));
        self.sheddable =
            config.job(job).is_some_and(|j| j.criticality == chime_shared::config::Criticality::Sheddable);
        self
    }

    /// The handles of the per-job series updated on every delivery (looked up once, not per job).
    pub fn metrics(&self, job: &str) -> &JobMetrics {
        self.metrics.get_or_init(|| JobMetrics::new(job))
    }
}

/// A circuit breaker as a job's runs use it.
pub(crate) struct CircuitSpec {
    /// Its name (`[[circuits]]` entry, or the job's own).
    pub name: String,
    /// Its Redis hash (`Names::circuit`).
    pub key: String,
    pub limits: chime_shared::circuit::Limits,
    pub on_open: chime_shared::config::OnOpen,
    /// `chime_circuit_state{circuit}`, looked up once.
    gauge: OnceLock<metrics::Gauge>,
    /// Until when a `closed` answer stands without asking Redis again ([`CIRCUIT_CACHE`]).
    closed_until: Mutex<Option<std::time::Instant>>,
    /// Successes not yet reported, and when they last were.
    successes: AtomicU64,
    reported_at: Mutex<Option<std::time::Instant>>,
}

/// How long a worker trusts a circuit's `closed` answer, and batches its successes: a
/// circuit opening reaches every worker within this (plus the runs already admitted).
pub(crate) const CIRCUIT_CACHE: Duration = Duration::from_millis(250);

impl CircuitSpec {
    fn new(c: chime_shared::config::ResolvedCircuit, config: &Config, timeout: Duration) -> Self {
        let (failures, failure_ratio) = match c.circuit.trip {
            chime_shared::config::Trip::Failures(n) => (n, 0.0),
            chime_shared::config::Trip::Ratio(r) => (0, r),
        };
        let limits = chime_shared::circuit::Limits {
            window: c.circuit.window,
            min_volume: c.circuit.min_volume,
            failures,
            failure_ratio,
            open_for: c.circuit.open_for,
            probes: c.circuit.probes,
            // A probe reports when its run ends: at the latest after its timeout, the grace
            // its handler gets to stop, and a lease (a worker that died holding it).
            probe_ttl: timeout + config.worker.cancel_grace + config.redis.lease,
        };
        let key = Names::new(&config.prefix).circuit(&c.name);
        Self {
            key,
            limits,
            on_open: c.circuit.on_open,
            name: c.name,
            gauge: OnceLock::new(),
            closed_until: Mutex::new(None),
            successes: AtomicU64::new(0),
            reported_at: Mutex::new(None),
        }
    }

    /// Whether a recent `closed` answer still stands.
    pub fn known_closed(&self) -> bool {
        let until = *self.closed_until.lock().unwrap_or_else(|p| p.into_inner());
        until.is_some_and(|t| std::time::Instant::now() < t)
    }

    /// Notes the answer of an ask: `closed` stands for [`CIRCUIT_CACHE`].
    pub fn answered(&self, closed: bool) {
        *self.closed_until.lock().unwrap_or_else(|p| p.into_inner()) =
            closed.then(|| std::time::Instant::now() + CIRCUIT_CACHE);
    }

    /// Counts a success; returns the successes to report now (every [`CIRCUIT_CACHE`]), or 0.
    pub fn succeeded(&self) -> u64 {
        self.successes.fetch_add(1, Ordering::Relaxed);
        let mut at = self.reported_at.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        if at.is_some_and(|t| now.duration_since(t) < CIRCUIT_CACHE) {
            return 0;
        }
        *at = Some(now);
        self.successes.swap(0, Ordering::Relaxed)
    }

    /// The successes not yet reported (sent with a failure, so the window's ratio sees them).
    pub fn take_successes(&self) -> u64 {
        self.successes.swap(0, Ordering::Relaxed)
    }

    /// Sets `chime_circuit_state` to what this worker last saw.
    pub fn show(&self, state: chime_shared::circuit::CircuitState) {
        self.gauge
            .get_or_init(
                || metrics::gauge!(chime_shared::telemetry::CIRCUIT_STATE, "circuit" => self.name.clone()),
            )
            .set(state.gauge());
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
    /// Handler succeeded and `done` was recorded.
    pub succeeded: AtomicU64,
    /// Acked without running (the key was done or dead).
    pub duplicates: AtomicU64,
    /// Dead letters confirmed by the broker.
    pub dead_lettered: AtomicU64,
    /// Deliveries given back to the broker unacked (shutdown, Redis unreachable).
    pub requeued: AtomicU64,
    /// Runs whose key another owner took over (that owner settles its own copy).
    pub lost_lease: AtomicU64,
    /// Failed attempts sent round for another attempt.
    pub retried: AtomicU64,
    /// Copies of a busy key, or of a job this worker does not know yet, sent round again.
    pub redelayed: AtomicU64,
    /// Scheduled slots skipped because they started past their deadline.
    pub expired: AtomicU64,
    /// Leases whose record Redis had lost, claimed again while the job kept running.
    pub leases_recreated: AtomicU64,
}

impl Stats {
    /// Reads one counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs of one `exec` job at once per worker process unless its `concurrency` says otherwise
/// (each run is a process).
pub(crate) const DEFAULT_EXEC_CONCURRENCY: usize = 8;
/// Requests of one `http` job in flight at once per worker process unless its `concurrency`
/// says otherwise.
pub(crate) const DEFAULT_HTTP_CONCURRENCY: usize = 32;

/// Job name → what runs it.
pub(crate) type Jobs = HashMap<String, Arc<JobSpec>>;

/// Resolves every configured job to a handler (built-in or registered), then adds the
/// registry-only handlers. A job on a consumed queue whose handler this worker does not have
/// is a config error naming the job.
pub(crate) fn resolve_jobs(
    config: &Config,
    registry: &Registry,
    queues: &[String],
) -> Result<Jobs, ConfigError> {
    if let Some(e) = registry.errors().into_iter().next() {
        return Err(ConfigError::Invalid { key: "registry".into(), message: e });
    }
    let mut jobs = Jobs::new();
    for (i, job) in config.jobs.iter().enumerate() {
        let handler = builtin::for_job(job, &config.worker).or_else(|| registry.get(job.handler.name()));
        match handler {
            Some(handler) => {
                // A `[[jobs]]` entry overrides the options a typed job declares in Rust.
                let options = job.over(&registry.options(&job.name).cloned().unwrap_or_default());
                let timeout = options.timeout.unwrap_or(config.worker.default_timeout);
                let limit = config.amqp.consumer_timeout.saturating_sub(Duration::from_secs(60));
                if timeout >= limit {
                    warn!(job = %job.name, ?timeout, consumer_timeout = ?config.amqp.consumer_timeout,
                        "job timeout is not safely below RabbitMQ's consumer_timeout (minus its 1 min check \
                         interval): a run that long makes the broker close the channel and requeue every \
                         unacked delivery on it; raise consumer_timeout on the broker and amqp.consumer_timeout");
                }
                let backoff = options.backoff.clone().unwrap_or_default();
                // `exec` forks a process per run and `http` loads another service: both bounded
                // by default, whatever worker.concurrency (which Rust handlers and `noop` use).
                let limit = options.concurrency.or(match job.handler {
                    chime_shared::config::HandlerConfig::Exec(_) => Some(DEFAULT_EXEC_CONCURRENCY),
                    chime_shared::config::HandlerConfig::Http { .. } => Some(DEFAULT_HTTP_CONCURRENCY),
                    _ => None,
                });
                jobs.insert(
                    job.name.clone(),
                    Arc::new(
                        JobSpec::new(
                            handler,
                            timeout,
                            backoff,
                            job.deadline,
                            limit,
                            options.global_concurrency,
                        )
                        .with_rate(config.rate_limit_of(&job.name))
                        .with_circuit(config, &job.name),
                    ),
                );
            }
            None if queues.iter().any(|q| q == job.queue()) => {
                return Err(ConfigError::Invalid {
                    key: format!("jobs[{i}] ({}).handler", job.name),
                    message: format!(
                        "{:?} is neither a built-in handler ({}) nor registered in this worker",
                        job.handler.name(),
                        builtin::BUILTINS.join(", ")
                    ),
                });
            }
            None => {}
        }
    }
    // Handlers registered in Rust without a `[[jobs]]` entry: their own options (typed jobs)
    // or the defaults.
    for (name, handler) in registry.iter() {
        if !jobs.contains_key(name) {
            let options = registry.options(name).cloned().unwrap_or_default();
            let timeout = options.timeout.unwrap_or(config.worker.default_timeout);
            let backoff = options.backoff.clone().unwrap_or_default();
            let spec = JobSpec::new(
                handler.clone(),
                timeout,
                backoff,
                None,
                options.concurrency,
                options.global_concurrency,
            );
            jobs.insert(name.to_string(), Arc::new(spec));
        }
    }
    Ok(jobs)
}

/// State shared by every delivery task (everything but the Redis store and the broker).
pub(crate) struct Core {
    pub config: ValidConfig,
    pub names: Names,
    pub worker_id: String,
    /// Makes owner tokens unique across restarts that reuse a host name and pid.
    nonce: String,
    owners: AtomicU64,
    pub stats: Arc<Stats>,
    /// Every job this worker can run; replaced whole on reload.
    jobs: RwLock<Arc<Jobs>>,
    pub registry: Registry,
    pub redis_ok: watch::Sender<bool>,
    /// This host's clock less Redis's `TIME`, in µs, less the [`CLOCK_TOLERANCE_US`] (see
    /// [`Core::now`]): of the readings taken every second, the best of the last few
    /// ([`ClockReadings`]).
    clock_offset_us: std::sync::atomic::AtomicI64,
    /// Cancelled when shutdown begins: no new work, stop waiting on busy keys.
    pub intake_stopped: CancellationToken,
    /// Cancelled at the drain deadline: stop running handlers.
    pub hard_stop: CancellationToken,
    /// Jobs running now, by owner token (for the heartbeat), each with the token `chime
    /// cancel` fires.
    pub running: Mutex<HashMap<String, (Running, CancellationToken)>>,
    /// `chime_worker_running`, looked up once (after the recorder is installed).
    running_gauge: OnceLock<metrics::Gauge>,
    /// Queues whose pause flag is set: not consumed.
    pub paused: watch::Sender<BTreeSet<String>>,
    /// When this worker started.
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// What it settled per minute since the last flush to Redis (the dashboard's charts).
    minutes: Mutex<std::collections::BTreeMap<i64, chime_shared::minutes::Counts>>,
    /// Runs that may wait in place for their rate limit's start at once (half the worker's
    /// concurrency): beyond that a run is parked, so waiting runs never fill the prefetch that
    /// other jobs of the queue arrive through.
    pub holds: Arc<tokio::sync::Semaphore>,
    /// Load shedding of the queues that have a threshold (`[worker.shed.<queue>]`).
    pub shed: HashMap<String, QueueShed>,
    /// Aging: `jobs[].promote_after` by job (empty: strict priorities, nothing looked up).
    pub promote: HashMap<String, Duration>,
}

/// One queue's load shedding, as this worker sees it.
#[derive(Default)]
pub(crate) struct QueueShed {
    /// The longest a run taken from the queue since the last reading had waited (ms), plus
    /// one: 0 while none was taken.
    max_age_ms: AtomicU64,
    /// When a reading last found no ready message in the queue (ms on [`mono_ms`]'s clock,
    /// plus one; 0: never). A run waits in the queue only while it is ready there, so one
    /// taken since waited at most the time since then, whatever its `enqueued_at` says: a
    /// producer whose clock is behind cannot make an empty queue look backed up.
    empty_at: AtomicU64,
    /// The threshold crossed while the queue sheds (this worker's reading, or another's flag).
    pub reason: RwLock<Option<String>>,
}

impl QueueShed {
    /// A reading found the queue empty (no ready message at any level).
    pub fn saw_empty(&self) {
        self.empty_at.store(mono_ms() + 1, Ordering::Relaxed);
    }

    /// `waited_ms`, at most the time since the queue was last seen empty.
    fn bounded(&self, waited_ms: u64) -> u64 {
        match self.empty_at.load(Ordering::Relaxed) {
            0 => waited_ms,
            at => waited_ms.min(mono_ms().saturating_sub(at - 1)),
        }
    }

    /// The longest wait of the runs taken since the last call (`None`: none was taken).
    pub fn take_age(&self) -> Option<Duration> {
        match self.max_age_ms.swap(0, Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms - 1)),
        }
    }
}

/// `jobs[].promote_after` by job.
pub(crate) fn promote_of(config: &Config) -> HashMap<String, Duration> {
    config.jobs.iter().filter_map(|j| j.promote_after.map(|after| (j.name.clone(), after))).collect()
}

/// The settings of `new` a running worker keeps from `old` (it reloads job definitions with
/// their limits and circuits, nothing else): the sections that differ, named as in the file.
pub(crate) fn kept_on_reload(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut worker = new.worker.clone();
    // A change of queues is told on its own.
    worker.queues.clone_from(&old.worker.queues);
    [
        ("prefix", old.prefix != new.prefix),
        ("[amqp]", old.amqp != new.amqp),
        ("[redis]", old.redis != new.redis),
        ("[worker]", old.worker != worker),
        ("[history]", old.history != new.history),
        ("[results]", old.results != new.results),
        ("[checkpoints]", old.checkpoints != new.checkpoints),
        ("[log]", old.log != new.log),
        ("[telemetry]", old.telemetry != new.telemetry),
        ("jobs[].promote_after", promote_of(old) != promote_of(new)),
    ]
    .into_iter()
    .filter_map(|(name, changed)| changed.then_some(name))
    .collect()
}

/// Milliseconds on a monotonic clock of this process (from its first call).
fn mono_ms() -> u64 {
    static EPOCH: std::sync::LazyLock<std::time::Instant> = std::sync::LazyLock::new(std::time::Instant::now);
    u64::try_from(EPOCH.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Removes a run from [`Core::running`] when dropped.
pub(crate) struct RunningGuard<'a> {
    core: &'a Core,
    owner: String,
    /// Fired when `chime cancel` names the run's key ([`Core::cancel_key`]).
    pub cancelled: CancellationToken,
}

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        let mut running = self.core.running.lock().unwrap_or_else(|p| p.into_inner());
        running.remove(&self.owner);
        self.core.running_gauge().set(running.len() as f64);
    }
}

impl Core {
    pub fn new(config: ValidConfig, registry: Registry, jobs: Jobs, worker_id: String) -> Self {
        let names = Names::new(&config.prefix);
        let holds = Arc::new(tokio::sync::Semaphore::new((config.worker.concurrency / 2).max(1)));
        let shed = config.worker.shed.keys().map(|q| (q.clone(), QueueShed::default())).collect();
        let promote = promote_of(&config);
        Self {
            promote,
            holds,
            config,
            names,
            worker_id,
            nonce: uuid::Uuid::new_v4().simple().to_string()[..8].to_string(),
            owners: AtomicU64::new(0),
            stats: Arc::new(Stats::default()),
            jobs: RwLock::new(Arc::new(jobs)),
            registry,
            redis_ok: watch::channel(false).0,
            clock_offset_us: std::sync::atomic::AtomicI64::new(0),
            intake_stopped: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            running: Mutex::new(HashMap::new()),
            running_gauge: OnceLock::new(),
            paused: watch::channel(BTreeSet::new()).0,
            started_at: chrono::Utc::now(),
            minutes: Mutex::new(std::collections::BTreeMap::new()),
            shed,
        }
    }

    /// Now, by Redis's clock (this host's, corrected by the offset last measured): deadlines,
    /// waits and the instants written into headers are judged on the clock every worker and
    /// ticker shares, so a worker whose own clock is off does not expire runs on time.
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        let offset = self.clock_offset_us.load(Ordering::Relaxed);
        chrono::Utc::now() - chrono::Duration::microseconds(offset)
    }

    /// Records this host's clock less Redis's, in µs: what is beyond [`CLOCK_TOLERANCE_US`]
    /// either way is corrected; clocks closer than that are taken as agreeing.
    pub fn set_clock_offset(&self, us: i64) {
        self.clock_offset_us.store(beyond_tolerance(us), Ordering::Relaxed);
    }

    /// A run taken from `queue` says it waited this long (now less its `enqueued_at`): kept
    /// for the next shedding reading, at most the time since a reading last found the queue
    /// empty (see [`QueueShed::empty_at`]).
    pub fn saw_age(&self, queue: &str, waited_ms: u64) {
        if let Some(s) = self.shed.get(queue) {
            s.max_age_ms.fetch_max(s.bounded(waited_ms).saturating_add(1), Ordering::Relaxed);
        }
    }

    /// Why `queue` sheds its `sheddable` runs now, if it does.
    pub fn shedding(&self, queue: &str) -> Option<String> {
        self.shed.get(queue).and_then(|s| s.reason.read().unwrap_or_else(|p| p.into_inner()).clone())
    }

    /// Counts into this minute's totals (flushed with the heartbeat).
    pub fn count_minute(&self, f: impl FnOnce(&mut chime_shared::minutes::Counts)) {
        let minute = chime_shared::minutes::minute_of(self.now());
        let mut minutes = self.minutes.lock().unwrap_or_else(|p| p.into_inner());
        f(minutes.entry(minute).or_default());
    }

    /// Takes the counts not yet flushed.
    pub fn take_minutes(&self) -> std::collections::BTreeMap<i64, chime_shared::minutes::Counts> {
        std::mem::take(&mut *self.minutes.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Gives back counts a flush could not write (merged; older than a day dropped).
    pub fn restore_minutes(&self, back: std::collections::BTreeMap<i64, chime_shared::minutes::Counts>) {
        let oldest = chime_shared::minutes::minute_of(self.now()) - 24 * 60;
        let mut minutes = self.minutes.lock().unwrap_or_else(|p| p.into_inner());
        for (m, c) in back.into_iter().filter(|(m, _)| *m >= oldest) {
            let e = minutes.entry(m).or_default();
            for (o, n) in c.outcomes {
                *e.outcomes.entry(o).or_default() += n;
            }
            if e.latency.len() < c.latency.len() {
                e.latency.resize(c.latency.len(), 0);
            }
            for (i, n) in c.latency.into_iter().enumerate() {
                e.latency[i] += n;
            }
        }
    }

    fn running_gauge(&self) -> &metrics::Gauge {
        self.running_gauge.get_or_init(|| metrics::gauge!(telemetry::WORKER_RUNNING))
    }

    /// `chime cancel` named `key`: stops its run here, if one runs here (true). Scans the
    /// runs (a cancellation is rare; a run costs no second registry).
    pub fn cancel_key(&self, key: &str) -> bool {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let mut found = false;
        for (_, token) in running.values().filter(|(r, _)| r.key == key) {
            token.cancel();
            found = true;
        }
        found
    }

    /// Registers a run for the heartbeat and for `chime cancel` until the guard is dropped.
    pub fn running(&self, owner: &str, run: Running) -> RunningGuard<'_> {
        let cancelled = CancellationToken::new();
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running.insert(owner.to_string(), (run, cancelled.clone()));
        self.running_gauge().set(running.len() as f64);
        drop(running);
        RunningGuard { core: self, owner: owner.to_string(), cancelled }
    }

    pub fn job(&self, name: &str) -> Option<Arc<JobSpec>> {
        self.jobs.read().unwrap_or_else(|p| p.into_inner()).get(name).cloned()
    }

    /// What this worker can run, for the catalog (`chime_shared::catalog`): each job with its
    /// queue, handler kind, attempts and timeout, and the queues it consumes.
    pub fn catalog(
        &self,
        queues: &[String],
    ) -> (Vec<chime_shared::catalog::CatalogJob>, Vec<chime_shared::catalog::CatalogQueue>) {
        use chime_shared::catalog::{CatalogJob, CatalogQueue};
        use chime_shared::config::HandlerConfig;
        let now = self.now();
        let jobs = self.jobs.read().unwrap_or_else(|p| p.into_inner()).clone();
        let mut out: Vec<CatalogJob> = jobs
            .iter()
            .map(|(name, spec)| {
                let own = self.registry.options(name).cloned().unwrap_or_default();
                let entry = self.config.job(name);
                let options = entry.map_or_else(|| own.clone(), |j| j.over(&own));
                let handler = match entry.map(|j| &j.handler) {
                    Some(HandlerConfig::Registered(_)) | None => "rust".to_string(),
                    Some(h) => h.name().to_string(),
                };
                CatalogJob {
                    name: name.clone(),
                    queue: options.queue_name().to_string(),
                    handler,
                    max_attempts: options.attempts(),
                    timeout_ms: u64::try_from(spec.timeout.as_millis()).unwrap_or(u64::MAX),
                    scheduled: entry.is_some_and(|j| j.schedule.is_some()),
                    worker: self.worker_id.clone(),
                    seen_at: now,
                }
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        let queues = queues
            .iter()
            .map(|q| CatalogQueue { name: q.clone(), worker: self.worker_id.clone(), seen_at: now })
            .collect();
        (out, queues)
    }

    pub fn knows(&self, name: &str) -> bool {
        self.jobs.read().unwrap_or_else(|p| p.into_inner()).contains_key(name)
    }

    /// Replaces the job definitions (a reload); deliveries already running keep theirs.
    pub fn set_jobs(&self, jobs: Jobs) {
        *self.jobs.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(jobs);
    }

    /// A token unique to one attempt: worker id, a per-process nonce and a counter.
    pub fn owner_token(&self) -> String {
        use std::fmt::Write as _;
        let n = self.owners.fetch_add(1, Ordering::Relaxed);
        let mut token = String::with_capacity(self.worker_id.len() + self.nonce.len() + 22);
        let _ = write!(token, "{}/{}/{n}", self.worker_id, self.nonce);
        token
    }

    /// Called on any Redis error: pauses intake until the monitor sees Redis again.
    pub fn redis_failed(&self) {
        self.redis_ok.send_replace(false);
    }
}

/// How far this host's clock may be from Redis's and still be taken as the same clock: a
/// reading of the offset is off by up to half its round trip (a fraction of a millisecond,
/// more on a busy host), so smaller offsets are noise. Correcting them would move every
/// instant this worker stamps by that noise, a little differently each second.
pub(crate) const CLOCK_TOLERANCE_US: i64 = 1_000;

/// The last few readings of the offset to Redis `TIME`: the one taken with the shortest round
/// trip is the one to go by (its error, up to half the round trip, is the smallest; a
/// reading on a busy host, its answer read late, is off by however late).
#[derive(Default)]
pub(crate) struct ClockReadings(std::collections::VecDeque<(i64, i64)>);

/// How many readings (one a second) [`ClockReadings`] chooses from: a clock that steps is
/// followed within that many seconds; after Redis failed to answer (it may come back as
/// another host) the readings start afresh.
const CLOCK_READINGS: usize = 8;

impl ClockReadings {
    /// Adds a reading (`offset_us`, taken over `round_trip_us`) and answers the offset of the
    /// kept reading with the shortest round trip.
    pub fn offset(&mut self, offset_us: i64, round_trip_us: i64) -> i64 {
        if self.0.len() == CLOCK_READINGS {
            self.0.pop_front();
        }
        self.0.push_back((offset_us, round_trip_us));
        self.0.iter().min_by_key(|(_, rtt)| *rtt).map_or(offset_us, |(o, _)| *o)
    }
}

/// `offset_us` less [`CLOCK_TOLERANCE_US`] towards zero: 0 within it, and continuous beyond.
fn beyond_tolerance(offset_us: i64) -> i64 {
    if offset_us > CLOCK_TOLERANCE_US {
        offset_us - CLOCK_TOLERANCE_US
    } else if offset_us < -CLOCK_TOLERANCE_US {
        offset_us + CLOCK_TOLERANCE_US
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::{JobContext, JobError};

    #[test]
    fn clocks_within_a_millisecond_of_redis_are_taken_as_agreeing() {
        for us in [0, 1, -1, 999, -999, 1_000, -1_000] {
            assert_eq!(beyond_tolerance(us), 0, "{us} µs is noise");
        }
        assert_eq!(beyond_tolerance(1_250), 250);
        assert_eq!(beyond_tolerance(-2_000_000), -1_999_000);
        assert_eq!(beyond_tolerance(i64::MIN), i64::MIN + CLOCK_TOLERANCE_US, "no overflow");
    }

    #[test]
    fn the_reading_with_the_shortest_round_trip_of_the_last_eight_is_gone_by() {
        let mut r = ClockReadings::default();
        assert_eq!(r.offset(300, 400), 300, "the first reading is all there is");
        assert_eq!(r.offset(2_500, 5_000), 300, "a reading answered late is not taken");
        assert_eq!(r.offset(-100, 200), -100, "a quicker one is");
        for _ in 0..7 {
            assert_eq!(r.offset(600_000, 900), -100, "a step is not taken while the quick reading is kept");
        }
        assert_eq!(r.offset(600_000, 900), 600_000, "the step is followed within eight readings");
    }

    #[test]
    fn now_corrects_only_the_offset_beyond_the_tolerance() {
        let config = Config::from_toml_str("").unwrap();
        let core = Core::new(config, Registry::new(), HashMap::new(), "test".into());
        // Against the local clock read on either side: `now` must fall between them, shifted.
        let shifted = |offset_us: i64| {
            core.set_clock_offset(offset_us);
            let before = chrono::Utc::now();
            let now = core.now();
            let after = chrono::Utc::now();
            (before - now, after - now)
        };
        let (a, b) = shifted(900);
        assert!(
            a <= chrono::Duration::zero() && b >= chrono::Duration::zero(),
            "900 µs ahead is noise: {a} {b}"
        );
        let (a, b) = shifted(-901);
        assert!(
            a <= chrono::Duration::zero() && b >= chrono::Duration::zero(),
            "901 µs behind is noise: {a} {b}"
        );
        let (a, b) = shifted(5_000);
        let four = chrono::Duration::microseconds(4_000);
        assert!(a <= four && b >= four, "5 ms ahead: corrected by 4 ms ({a} {b})");
    }
    use chime_shared::job::{Job, JobOptions};

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Reindex;
    impl Job for Reindex {
        const NAME: &'static str = "reindex";
        fn options() -> JobOptions {
            let backoff = BackoffConfig { initial: Duration::from_secs(2), ..BackoffConfig::default() };
            JobOptions::default().queue("search").timeout(Duration::from_secs(30)).backoff(backoff)
        }
    }
    async fn reindex(_: JobContext, _: Reindex) -> Result<(), JobError> {
        Ok(())
    }

    fn spec(config: &str) -> Arc<JobSpec> {
        let config = Config::from_toml_str(config).unwrap();
        let mut registry = Registry::new();
        registry.job(reindex);
        let jobs = resolve_jobs(&config, &registry, &["search".to_string()]).unwrap();
        jobs.get("reindex").cloned().unwrap()
    }

    #[test]
    fn typed_options_apply_without_an_entry_and_an_entry_overrides_only_what_it_sets() {
        let own = spec("");
        assert_eq!((own.timeout, own.backoff.initial), (Duration::from_secs(30), Duration::from_secs(2)));
        let tuned = spec("[[jobs]]\nname = 'reindex'\nhandler = 'reindex'\ntimeout = '5s'\n");
        assert_eq!(tuned.timeout, Duration::from_secs(5), "the entry's timeout wins");
        assert_eq!(
            tuned.backoff.initial,
            Duration::from_secs(2),
            "the backoff it does not set stays the type's"
        );
    }

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Hasty;
    impl Job for Hasty {
        const NAME: &'static str = "hasty";
        fn options() -> JobOptions {
            JobOptions::default().timeout(Duration::ZERO)
        }
    }
    async fn hasty(_: JobContext, _: Hasty) -> Result<(), JobError> {
        Ok(())
    }

    #[test]
    fn a_typed_job_with_options_a_config_entry_could_not_have_is_refused_by_name() {
        let config = Config::from_toml_str("").unwrap();
        let mut registry = Registry::new();
        registry.job(hasty);
        let e = resolve_jobs(&config, &registry, &["default".to_string()]).err().unwrap().to_string();
        assert!(e.contains("\"hasty\"") && e.contains("timeout: must be positive"), "{e}");
    }

    #[test]
    fn a_queue_seen_empty_bounds_the_wait_its_runs_claim() {
        let shed = QueueShed::default();
        assert_eq!(shed.take_age(), None, "no run taken: no age");
        // Ten minutes by the producer's clock, never seen empty: taken as said.
        shed.max_age_ms.fetch_max(shed.bounded(600_000) + 1, Ordering::Relaxed);
        assert_eq!(shed.take_age(), Some(Duration::from_secs(600)));
        assert_eq!(shed.take_age(), None, "taken once");
        // Seen empty just now: a run taken since waited at most since then.
        shed.saw_empty();
        assert!(shed.bounded(600_000) < 60_000, "{}", shed.bounded(600_000));
    }

    #[test]
    fn a_reload_names_the_settings_it_does_not_apply() {
        let base = "[[jobs]]\nname = 'a'\nhandler = 'noop'\npriority = 'low'\n";
        let old = Config::from_toml_str(base).unwrap();
        let same = Config::from_toml_str(&format!("{base}timeout = '9s'\n")).unwrap();
        assert!(kept_on_reload(&old, &same).is_empty(), "job definitions are reloaded");
        let queues = Config::from_toml_str(&format!("[worker]\nqueues = ['default', 'x']\n{base}")).unwrap();
        assert!(kept_on_reload(&old, &queues).is_empty(), "a change of queues is told on its own");
        let changed = Config::from_toml_str(&format!(
            "[worker]\nmax_hold = '5s'\n[log]\nsuccess_sample = 0.5\n{base}promote_after = '1m'\n"
        ))
        .unwrap();
        assert_eq!(kept_on_reload(&old, &changed), ["[worker]", "[log]", "jobs[].promote_after"]);
    }
}
