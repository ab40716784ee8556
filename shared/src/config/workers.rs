//! `[worker]` and `[ticker]`: the two daemons, and their rules.

use super::*;

/// `[worker]`: `chime-worker` and custom worker binaries.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Queues to consume; empty means every queue named by a job (plus `default`).
    pub queues: Vec<String>,
    /// Jobs run at once per process (default 256: handlers are futures; `exec` and `http`
    /// jobs have lower limits of their own, `jobs[].concurrency`).
    pub concurrency: usize,
    /// Unacked deliveries per queue consumer; defaults to `concurrency`, or to the sum of
    /// the limits of the queue's jobs when each has one.
    pub prefetch: Option<u16>,
    /// Drain deadline on SIGTERM/SIGINT.
    #[serde(deserialize_with = "duration::de")]
    pub shutdown_timeout: Duration,
    /// Handler timeout for jobs that set none.
    #[serde(deserialize_with = "duration::de")]
    pub default_timeout: Duration,
    /// Address of `/metrics`, `/livez`, `/readyz` (overridden by `--listen`).
    pub listen: Option<String>,
    /// Runtime threads of a `chime-worker` process; 0 = one per CPU core.
    pub threads: usize,
    /// A job this worker has no handler for is sent round again for this long (a rolling
    /// deploy may bring the worker that knows it) before it is dead-lettered as `unknown_job`.
    #[serde(deserialize_with = "duration::de")]
    pub unknown_job_grace: Duration,
    /// On timeout or at the drain deadline a handler's cancellation token fires first; the
    /// handler gets this long to stop on its own before its future is dropped.
    #[serde(deserialize_with = "duration::de")]
    pub cancel_grace: Duration,
    /// Variables of the worker's environment passed to every `exec` job's program. Nothing
    /// else is (besides `PATH`, `HOME`, locale, `TZ`, `TMPDIR` and the job's `CHIME_*` facts):
    /// the worker's own secrets (`CHIME_AMQP_URL`, `CHIME_REDIS_URL`, …) never reach a job.
    pub pass_env: Vec<String>,
    /// The longest a run waits in place for its rate limit, holding its delivery; a run that
    /// must wait longer is parked (sent round the delay chain, its attempt unchanged).
    #[serde(deserialize_with = "duration::de")]
    pub max_hold: Duration,
    /// Most parked copies sent round the delay chain as one message (copies parked within
    /// 50 ms of each other for the same whole-second delay to the same queue travel as a
    /// pack); 1 sends each alone. Default 100.
    pub park_pack: usize,
    /// Load shedding per queue (`[worker.shed.<queue>]`): above a backlog depth or age,
    /// workers skip the queue's `sheddable` runs and the ticker their slots.
    pub shed: BTreeMap<String, ShedConfig>,
}

/// `[worker.shed.<queue>]`: when a queue is backed up enough that its `sheddable` jobs are
/// skipped. Shedding starts when either threshold is reached and stops when both are below
/// 80 % of theirs (hysteresis, so it does not flap at the line).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShedConfig {
    /// Ready messages in the queue (all its priority levels).
    #[serde(default)]
    pub max_depth: Option<u32>,
    /// How long the runs a worker takes from the queue have waited since they were due.
    #[serde(default, deserialize_with = "duration::de_opt")]
    pub max_age: Option<Duration>,
}

/// How much a job matters when its queue is backed up (`jobs[].criticality`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Criticality {
    /// Never shed.
    Critical,
    /// Not shed (default); reserved for a second level of shedding.
    #[default]
    Normal,
    /// Skipped (recorded `shed`) while its queue is above its shedding threshold.
    Sheddable,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            queues: Vec::new(),
            concurrency: 256,
            prefetch: None,
            shutdown_timeout: Duration::from_secs(30),
            default_timeout: Duration::from_secs(300),
            listen: None,
            threads: 0,
            unknown_job_grace: Duration::from_secs(300),
            cancel_grace: Duration::from_secs(5),
            pass_env: Vec::new(),
            max_hold: Duration::from_secs(2),
            park_pack: 100,
            shed: BTreeMap::new(),
        }
    }
}

/// `[ticker]`: `chime tick`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TickerConfig {
    /// Address of the ticker's `/metrics`, `/livez`, `/readyz` (overridden by `--listen`).
    pub listen: Option<String>,
    /// Leader lease: a standby takes over within one lease after the leader dies.
    #[serde(deserialize_with = "duration::de")]
    pub lease: Duration,
    /// Warn (and export the gauge) when the local clock differs from Redis `TIME` by more.
    #[serde(deserialize_with = "duration::de")]
    pub max_clock_skew: Duration,
}

impl Default for TickerConfig {
    fn default() -> Self {
        Self { listen: None, lease: Duration::from_secs(10), max_clock_skew: Duration::from_millis(200) }
    }
}

/// A `listen` address as `HOST:PORT` (`127.0.0.1:9090`, `[::1]:9090`, `0.0.0.0:9090` for every
/// interface; a host name is resolved when the daemon starts): checked by its shape, so that a
/// daemon does not fail to start on an address its config check passed.
pub fn check_listen(addr: &str) -> Result<(), String> {
    let example = "expected HOST:PORT, e.g. 127.0.0.1:9090";
    if addr.contains('@') || addr.contains("://") {
        // Never quote a part of it: what follows a user is a password.
        return Err(format!(
            "{:?} is a URL or names a user; a listen address is only where to listen ({example})",
            redact(addr)
        ));
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(format!("{addr:?} has no port ({example})"));
    };
    if port.parse::<u16>().is_err() {
        return Err(format!("{addr:?}: port {port:?} is not 0 to 65535 ({example})"));
    }
    let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
    if host.is_empty() || (host.contains(':') && !bracketed) {
        return Err(format!(
            "{addr:?}: no host before the port ({example}; 0.0.0.0 for every interface, [::1] for IPv6)"
        ));
    }
    Ok(())
}

impl TickerConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if let Some(l) = &self.listen {
            check_listen(l).map_err(|e| ConfigError::invalid("ticker.listen", e))?;
        }
        Ok(())
    }
}

impl WorkerConfig {
    /// Concurrency, threads, names of queues and passed variables, the cancel grace.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.concurrency == 0 || self.concurrency > 10_000 {
            return Err(ConfigError::invalid("worker.concurrency", "must be between 1 and 10000"));
        }
        if self.threads > 1024 {
            return Err(ConfigError::invalid("worker.threads", "must be between 0 (one per core) and 1024"));
        }
        for (i, name) in self.pass_env.iter().enumerate() {
            if !valid_env_name(name) {
                return Err(ConfigError::invalid(
                    format!("worker.pass_env[{i}]"),
                    format!("{name:?} is not a variable name"),
                ));
            }
        }
        if self.prefetch == Some(0) {
            return Err(ConfigError::invalid("worker.prefetch", "must be at least 1"));
        }
        for (i, q) in self.queues.iter().enumerate() {
            if !valid_name(q) {
                return Err(ConfigError::invalid(
                    format!("worker.queues[{i}]"),
                    format!("{q:?} must be 1-100 letters, digits, '-', '_' or '.'"),
                ));
            }
            if let Some(first) = self.queues[..i].iter().position(|e| e == q) {
                return Err(ConfigError::invalid(
                    format!("worker.queues[{i}]"),
                    format!("{q:?} is given twice (also worker.queues[{first}])"),
                ));
            }
        }
        if let Some(l) = &self.listen {
            check_listen(l).map_err(|e| ConfigError::invalid("worker.listen", e))?;
        }
        if self.cancel_grace > Duration::from_secs(3600) {
            return Err(ConfigError::invalid("worker.cancel_grace", "must be at most 1h"));
        }
        for (q, s) in &self.shed {
            if !valid_name(q) {
                return Err(ConfigError::invalid(
                    format!("worker.shed.{q}"),
                    "a queue name: 1-100 letters, digits, '-', '_' or '.'",
                ));
            }
            if s.max_depth.is_none() && s.max_age.is_none() {
                return Err(ConfigError::invalid(
                    format!("worker.shed.{q}"),
                    "needs max_depth (ready messages) or max_age (a duration such as \"5m\"), or both",
                ));
            }
            if s.max_depth == Some(0) {
                return Err(ConfigError::invalid(format!("worker.shed.{q}.max_depth"), "must be at least 1"));
            }
            if s.max_age.is_some_and(|a| a < Duration::from_secs(1)) {
                return Err(ConfigError::invalid(format!("worker.shed.{q}.max_age"), "must be at least 1s"));
            }
        }
        if !(1..=crate::envelope::pack::MAX_PACK).contains(&self.park_pack) {
            return Err(ConfigError::invalid(
                "worker.park_pack",
                format!(
                    "must be 1 (each parked copy alone) to {} copies per message",
                    crate::envelope::pack::MAX_PACK
                ),
            ));
        }
        if self.max_hold > Duration::from_secs(60) {
            return Err(ConfigError::invalid(
                "worker.max_hold",
                "must be at most 60s (a run waiting longer is parked, not held: RabbitMQ's consumer_timeout closes \
                 channels that hold deliveries too long)",
            ));
        }
        Ok(())
    }
}
