//! Typed configuration: TOML with unknown keys rejected, durations as strings, validated once.
//!
//! Precedence is: command-line flag > environment variable (`CHIME_AMQP_URL`,
//! `CHIME_REDIS_URL`, `CHIME_PREFIX`) > config file > default. Every error names the key
//! that is wrong so that `chime check-config` can point the operator straight at it.

use serde::Deserialize;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use crate::duration;
use crate::redact::{redact, redact_text};
use chime_job::JobOptions;

/// Default config path when neither `--config` nor `$CHIME_CONFIG` is given.
pub const DEFAULT_PATH: &str = "chime.toml";
// The job definitions' own types and rules, shared with crates that only define jobs.
pub use chime_job::{BackoffConfig, DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE, valid_name};
// Domain types the config names, defined beside their domain.
pub use crate::envelope::Priority;
pub use crate::names::QueueType;
pub use crate::tls::TlsConfig;
/// Exit code of an `exec` command that means "permanent failure, do not retry".
pub const DEFAULT_PERMANENT_EXIT_CODE: i32 = 100;

/// A configuration problem. `Display` names the file and key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No file at the resolved path.
    #[error("config file {path} not found (pass --config PATH or set CHIME_CONFIG)")]
    NotFound {
        /// The path tried.
        path: PathBuf,
    },
    /// The file exists but cannot be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The path tried.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not valid TOML, or a key or value of the wrong shape (the message gives line and
    /// column; it never quotes the source line, which may hold a password).
    #[error("{path}: {message}")]
    Parse {
        /// Where the text came from.
        path: String,
        /// What is wrong, and where.
        message: String,
    },
    /// A value that parses but is not allowed.
    #[error("invalid config: {key}: {message}")]
    Invalid {
        /// The key at fault (`redis.lease`, `jobs[2] (report).schedule`, a flag).
        key: String,
        /// What is wrong with it.
        message: String,
    },
}

impl ConfigError {
    /// An invalid value: the message may quote it, so URLs in it are redacted (a URL with a
    /// password typed into the wrong key) and control characters escaped.
    fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        let message = crate::redact::escape_control(&redact_text(&message.into())).into_owned();
        Self::Invalid { key: key.into(), message }
    }
}

/// The whole `chime.toml`. Every section and key is optional unless noted; unknown keys are
/// errors naming the key.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Prefix of every exchange, queue and Redis key (`CHIME_PREFIX`; at most 64 letters,
    /// digits, `-` or `_`).
    pub prefix: String,
    /// RabbitMQ.
    pub amqp: AmqpConfig,
    /// Redis.
    pub redis: RedisConfig,
    /// `chime-worker`.
    pub worker: WorkerConfig,
    /// `chime tick`.
    pub ticker: TickerConfig,
    /// DLQ alerts (`chime tick` on the leader, or `chime watch`).
    pub alerts: AlertsConfig,
    /// Run history (written by workers, read by `chime history`, `inspect` and `web`).
    pub history: HistoryConfig,
    /// What a run returns, kept with its key's record.
    pub results: ResultsConfig,
    /// What a run saves to resume from.
    pub checkpoints: CheckpointsConfig,
    /// The jobs.
    #[serde(deserialize_with = "de_jobs")]
    pub jobs: Vec<JobConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            prefix: "chime".into(),
            amqp: AmqpConfig::default(),
            redis: RedisConfig::default(),
            worker: WorkerConfig::default(),
            ticker: TickerConfig::default(),
            alerts: AlertsConfig::default(),
            history: HistoryConfig::default(),
            results: ResultsConfig::default(),
            checkpoints: CheckpointsConfig::default(),
            jobs: Vec::new(),
        }
    }
}

/// One URL or a list of URLs tried in turn (cluster nodes).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Urls {
    /// A single URL.
    One(String),
    /// URLs tried in order.
    Many(Vec<String>),
}

impl Urls {
    /// The URLs, in the order they are tried.
    pub fn list(&self) -> Vec<String> {
        match self {
            Urls::One(u) => vec![u.clone()],
            Urls::Many(v) => v.clone(),
        }
    }
}

/// `[amqp]`: the broker.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AmqpConfig {
    /// `amqp://user:pass@host:port/vhost`; a list is tried in order (`CHIME_AMQP_URL`,
    /// comma-separated for several).
    pub url: Urls,
    /// Type of the work queues and DLQs.
    pub queue_type: QueueType,
    /// Quorum queues only: broker-side safety net against crash loops. Always explicit and
    /// positive, never -1 (on RabbitMQ 3.10, -1 dead-letters on the first requeue).
    pub delivery_limit: u32,
    /// Quorum queues only: how many nodes hold a copy of each of the prefix's queues
    /// (`x-quorum-initial-group-size`, given when the queue is first declared). Unset, the
    /// broker puts a copy on every node of the cluster, so that each node added makes every
    /// message cost more; 3 (or 5) keeps the cost per message flat as the cluster grows.
    pub quorum_replicas: Option<u32>,
    /// AMQP heartbeat.
    #[serde(deserialize_with = "duration::de")]
    pub heartbeat: Duration,
    /// How long a publish may wait for its confirm before it counts as failed.
    #[serde(deserialize_with = "duration::de")]
    pub publish_timeout: Duration,
    /// Largest envelope chime publishes; larger payloads are rejected before publishing,
    /// and larger deliveries are dead-lettered as `too_large`.
    pub max_message_bytes: usize,
    /// The broker's `consumer_timeout`: workers warn when a job timeout is not safely below it.
    #[serde(deserialize_with = "duration::de")]
    pub consumer_timeout: Duration,
    /// `[amqp.tls]`: CA and client certificate for `amqps://` URLs.
    pub tls: TlsConfig,
}

impl Default for AmqpConfig {
    fn default() -> Self {
        Self {
            url: Urls::One("amqp://guest:guest@127.0.0.1:5672/%2f".into()),
            queue_type: QueueType::Quorum,
            delivery_limit: 50,
            quorum_replicas: None,
            heartbeat: Duration::from_secs(10),
            publish_timeout: Duration::from_secs(30),
            max_message_bytes: 1024 * 1024,
            consumer_timeout: Duration::from_secs(30 * 60),
            tls: TlsConfig::default(),
        }
    }
}

/// `[redis]`: the idempotency table, leases and ticker state.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://host:port/db` (`CHIME_REDIS_URL`).
    pub url: String,
    /// How long a claim stays valid without renewal; renewed every third of it.
    #[serde(deserialize_with = "duration::de")]
    pub lease: Duration,
    /// How long `done`/`dead` marks are kept (duplicates within it are absorbed).
    #[serde(deserialize_with = "duration::de")]
    pub done_retention: Duration,
    /// Per-command response timeout; past it Redis counts as unreachable.
    #[serde(deserialize_with = "duration::de")]
    pub timeout: Duration,
    /// `[redis.tls]`: CA and client certificate for a `rediss://` URL.
    pub tls: TlsConfig,
    /// Sentinels (`host:port`) to ask for the master `master_name`; `url` then gives only
    /// the scheme (`rediss://` for TLS), the password and the database.
    pub sentinels: Vec<String>,
    /// The master's name in the sentinels' configuration (with `sentinels`).
    pub master_name: Option<String>,
    /// Redis Cluster seed nodes (`host:port`); `url` then gives only the scheme and the
    /// password (the database is always 0).
    pub cluster: Vec<String>,
}

impl RedisConfig {
    /// Where Redis is, for errors and logs (password redacted): the URL, the master and its
    /// sentinels, or the cluster's seed nodes.
    pub fn endpoint(&self) -> String {
        if !self.sentinels.is_empty() {
            format!(
                "master {:?} via sentinels {}",
                self.master_name.as_deref().unwrap_or(""),
                self.sentinels.join(", ")
            )
        } else if !self.cluster.is_empty() {
            format!("cluster {}", self.cluster.join(", "))
        } else {
            redact(&self.url)
        }
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379/0".into(),
            lease: Duration::from_secs(30),
            done_retention: Duration::from_secs(7 * 86_400),
            timeout: Duration::from_secs(3),
            tls: TlsConfig::default(),
            sentinels: Vec::new(),
            master_name: None,
            cluster: Vec::new(),
        }
    }
}

/// `[worker]`: `chime-worker` and custom worker binaries.
#[derive(Debug, Clone, Deserialize)]
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
        }
    }
}

/// `[ticker]`: `chime tick`.
#[derive(Debug, Clone, Deserialize)]
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

/// `[alerts]`: DLQ depth alerting.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlertsConfig {
    /// DLQ depth that counts as an alert.
    pub dlq_threshold: u64,
    /// How long the depth must stay at or above the threshold before `firing`.
    #[serde(deserialize_with = "duration::de", rename = "for")]
    pub for_: Duration,
    /// Alertmanager-compatible webhook URL (log only when unset).
    pub webhook: Option<String>,
    /// How often DLQ depths are read.
    #[serde(deserialize_with = "duration::de")]
    pub interval: Duration,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        Self {
            dlq_threshold: 1,
            for_: Duration::from_secs(60),
            webhook: None,
            interval: Duration::from_secs(15),
        }
    }
}

/// `[history]`: one event per run in a Redis stream per queue, and a key's last runs in its
/// idempotency record.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HistoryConfig {
    /// Record runs (default `true`).
    pub enabled: bool,
    /// Most runs kept per queue (default 1,000,000): the stream is cut to `max_len / 8`
    /// entries of up to 8 runs ([`crate::history::RUNS_PER_ENTRY`]).
    pub max_len: u64,
    /// Runs older than this are trimmed (default 24 h; as new runs are written).
    #[serde(deserialize_with = "duration::de")]
    pub max_age: Duration,
    /// Runs kept in a key's record for `chime inspect` (default 20, at most 100).
    pub runs_per_key: u32,
}

impl Default for HistoryConfig {
    fn default() -> Self {
        Self { enabled: true, max_len: 1_000_000, max_age: Duration::from_secs(86_400), runs_per_key: 20 }
    }
}

/// `[results]`: the value a successful run returns (a Rust handler's return value, an `exec`
/// job's standard output, an `http` job's response body), kept in its key's record.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ResultsConfig {
    /// Largest result kept, in bytes of JSON (default 65,536; at most 1,048,576). A larger
    /// result does not fail the run: its record says the result was too large.
    pub max_bytes: usize,
    /// How long a result is kept (default: as long as the record, `redis.done_retention`).
    /// Longer keeps the record that long; shorter hides the result from readers after it.
    #[serde(deserialize_with = "duration::de_opt")]
    pub retention: Option<Duration>,
}

impl Default for ResultsConfig {
    fn default() -> Self {
        Self { max_bytes: 65_536, retention: None }
    }
}

/// `[checkpoints]`: what a run saves (`JobContext::checkpoint`, or an `exec` job's
/// `CHIME_CHECKPOINT_FILE`) so that a retry or a redelivered copy resumes from it.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointsConfig {
    /// Largest checkpoint, in bytes (default 65,536; at most 1,048,576): a larger one is an
    /// error of the save (the run goes on; the previous checkpoint stands).
    pub max_bytes: usize,
    /// How often a running `exec` job's checkpoint file is read back (default `"1s"`).
    #[serde(deserialize_with = "duration::de")]
    pub poll: Duration,
}

impl Default for CheckpointsConfig {
    fn default() -> Self {
        Self { max_bytes: 65_536, poll: Duration::from_secs(1) }
    }
}

/// Missed-slot policy of a schedule, after an outage of every ticker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CatchUp {
    /// Every missed slot within the window, oldest first.
    All,
    /// Only the newest missed slot.
    Latest,
    /// Nothing from the outage; resume at the next slot.
    None,
}

/// What the ticker does with a slot whose previous run is still in progress (not yet done or
/// dead: queued, running, or between retries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Publish it anyway (runs may overlap).
    #[default]
    Allow,
    /// Skip it (counted in `chime_slots_overlapped_total`, recorded in the history).
    Skip,
    /// Hold it until the previous run ends, then publish it; at most one waits, later ones
    /// are skipped.
    BufferOne,
}

impl Overlap {
    /// `allow`, `skip` or `buffer_one`, as the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::Allow => "allow",
            Overlap::Skip => "skip",
            Overlap::BufferOne => "buffer_one",
        }
    }
}

/// How many copies of each slot (or ad-hoc enqueue) a sharded job fans out to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(untagged)]
pub enum Shards {
    /// A fixed number, 1 to 1,000.
    Count(u32),
    /// As many as workers consume the job's queue when the slot is published.
    Workers,
}

impl<'de> Deserialize<'de> for Shards {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(i64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) if (1..=1000).contains(&n) => Ok(Shards::Count(n as u32)),
            Raw::N(n) => {
                Err(serde::de::Error::custom(format!("{n}: must be between 1 and 1000, or \"workers\"")))
            }
            Raw::S(s) if s == "workers" => Ok(Shards::Workers),
            Raw::S(s) => Err(serde::de::Error::custom(format!("{s:?}: a number of shards, or \"workers\""))),
        }
    }
}

/// One `[[jobs]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "RawJobConfig")]
pub struct JobConfig {
    /// The job's name (required): letters, digits, `-`, `_`, `.`.
    pub name: String,
    /// Cron expression (5 or 6 fields, or a macro such as `@daily`); absent = ad-hoc only.
    pub schedule: Option<String>,
    /// IANA zone of the schedule; default UTC.
    pub timezone: Option<String>,
    /// Queue; default `default`.
    pub queue: Option<String>,
    /// What runs the job, with the settings only that handler has.
    pub handler: HandlerConfig,
    /// Default payload (scheduled runs, and `chime enqueue` without `--payload`).
    pub payload: Option<serde_json::Value>,
    /// Attempts in all, first run included (default 5, at most 1,000).
    pub max_attempts: Option<u32>,
    /// Retry delays (default 5 s doubling to 1 h).
    pub backoff: Option<BackoffConfig>,
    /// Handler timeout (default `worker.default_timeout`).
    pub timeout: Option<Duration>,
    /// After an outage of every ticker (default `all`).
    pub catch_up: Option<CatchUp>,
    /// How far back missed slots are caught up (default 1 h).
    pub catch_up_window: Option<Duration>,
    /// A slot started later than slot + deadline is skipped (`expired`).
    pub deadline: Option<Duration>,
    /// Publish up to this much after the slot, deterministically per slot.
    pub jitter: Option<Duration>,
    /// Runs of this job at once in one worker process (default: 8 for `exec`, otherwise
    /// `worker.concurrency`): heavy handlers bounded, light ones run wide.
    pub concurrency: Option<usize>,
    /// Runs of this job at once across every worker sharing the prefix (slots leased in
    /// Redis; a dead worker's slot lapses after `redis.lease`).
    pub global_concurrency: Option<usize>,
    /// A scheduled job's slot whose previous run is still in progress (default `allow`).
    pub overlap: Overlap,
    /// Fan each slot (or ad-hoc enqueue) out to this many messages, one per shard.
    pub shards: Option<Shards>,
    /// Run each slot once on every live worker consuming the job's queue.
    pub broadcast: bool,
    /// Delivery order when a backlog exists (default `normal`).
    pub priority: Option<Priority>,
}

/// What runs a job. In TOML it is the `handler` key plus the keys of that handler alone
/// (`command`, `permanent_exit_codes`, `pass_env` for `exec`; `url` for `http`): a key of
/// another handler is an error naming it, so no combination here is invalid.
#[derive(Debug, Clone, PartialEq)]
pub enum HandlerConfig {
    /// `handler = "exec"`: runs a program per job.
    Exec(ExecConfig),
    /// `handler = "http"`: POSTs the payload to `url` (an `http://` or `https://` URL).
    Http {
        /// Where the payload is POSTed.
        url: String,
    },
    /// `handler = "noop"`: succeeds at once (benchmarks, smoke tests).
    Noop,
    /// Any other name: a handler registered in Rust (a typed job's name, or
    /// `Registry::register`).
    Registered(String),
}

/// Settings of the `exec` handler.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecConfig {
    /// Program and arguments (no shell); at least the program.
    pub command: Vec<String>,
    /// Exit codes that mean permanent failure (default `[100]`).
    pub permanent_exit_codes: Vec<i32>,
    /// Variables of the worker's environment passed to this job's program, besides
    /// `worker.pass_env` and the safe defaults (`PATH`, `HOME`, locale, `TZ`, `TMPDIR`).
    pub pass_env: Vec<String>,
}

impl HandlerConfig {
    /// The `handler` key as written (`exec`, `http`, `noop`, or the registered name).
    pub fn name(&self) -> &str {
        match self {
            HandlerConfig::Exec(_) => "exec",
            HandlerConfig::Http { .. } => "http",
            HandlerConfig::Noop => "noop",
            HandlerConfig::Registered(name) => name,
        }
    }
}

/// `[[jobs]]` as written: every handler's keys side by side, checked and folded into
/// [`HandlerConfig`] by `TryFrom` (serde's `flatten` would lose `deny_unknown_fields`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJobConfig {
    name: String,
    #[serde(default)]
    schedule: Option<String>,
    #[serde(default)]
    timezone: Option<String>,
    #[serde(default)]
    queue: Option<String>,
    handler: String,
    #[serde(default)]
    command: Option<Vec<String>>,
    #[serde(default)]
    permanent_exit_codes: Option<Vec<i32>>,
    #[serde(default)]
    pass_env: Option<Vec<String>>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    payload: Option<serde_json::Value>,
    #[serde(default)]
    max_attempts: Option<u32>,
    #[serde(default)]
    backoff: Option<BackoffConfig>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    timeout: Option<Duration>,
    #[serde(default)]
    catch_up: Option<CatchUp>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    catch_up_window: Option<Duration>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    deadline: Option<Duration>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    jitter: Option<Duration>,
    #[serde(default)]
    concurrency: Option<usize>,
    #[serde(default)]
    global_concurrency: Option<usize>,
    #[serde(default)]
    overlap: Option<Overlap>,
    #[serde(default)]
    shards: Option<Shards>,
    #[serde(default)]
    broadcast: Option<bool>,
    #[serde(default)]
    priority: Option<Priority>,
}

/// `[[jobs]]` with each entry's index in its errors, as `validate` names them.
fn de_jobs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<JobConfig>, D::Error> {
    let raw = Vec::<RawJobConfig>::deserialize(d)?;
    raw.into_iter()
        .enumerate()
        .map(|(i, job)| job.into_job(&format!("jobs[{i}]")).map_err(serde::de::Error::custom))
        .collect()
}

impl TryFrom<RawJobConfig> for JobConfig {
    type Error = String;

    fn try_from(raw: RawJobConfig) -> Result<Self, String> {
        raw.into_job("jobs")
    }
}

impl RawJobConfig {
    fn into_job(self, at: &str) -> Result<JobConfig, String> {
        let raw = self;
        let key = |field: &str| format!("{at} ({}).{field}", raw.name);
        let only =
            |field: &str, handler: &str| format!("{}: only valid with handler \"{handler}\"", key(field));
        if raw.overlap.is_some_and(|o| o != Overlap::Allow) && raw.schedule.is_none() {
            return Err(format!(
                "{}: applies to scheduled jobs only (this one has no schedule)",
                key("overlap")
            ));
        }
        if raw.broadcast == Some(true) && raw.shards.is_some() {
            return Err(format!("{}: a job is sharded or broadcast, not both", key("broadcast")));
        }
        if raw.handler != "exec" {
            for (field, set) in [
                ("command", raw.command.is_some()),
                ("permanent_exit_codes", raw.permanent_exit_codes.is_some()),
                ("pass_env", raw.pass_env.is_some()),
            ] {
                if set {
                    return Err(only(field, "exec"));
                }
            }
        }
        if raw.handler != "http" && raw.url.is_some() {
            return Err(only("url", "http"));
        }
        let handler = match raw.handler.as_str() {
            "exec" => match raw.command {
                Some(command) if command.first().is_some_and(|p| !p.is_empty()) => {
                    HandlerConfig::Exec(ExecConfig {
                        command,
                        permanent_exit_codes: raw
                            .permanent_exit_codes
                            .unwrap_or(vec![DEFAULT_PERMANENT_EXIT_CODE]),
                        pass_env: raw.pass_env.unwrap_or_default(),
                    })
                }
                _ => {
                    return Err(format!(
                        "{}: required for handler \"exec\" (a non-empty list: program and arguments)",
                        key("command")
                    ));
                }
            },
            "http" => match raw.url {
                Some(url) if url.starts_with("http://") || url.starts_with("https://") => {
                    HandlerConfig::Http { url }
                }
                _ => {
                    return Err(format!(
                        "{}: required for handler \"http\" (an http:// or https:// URL)",
                        key("url")
                    ));
                }
            },
            "noop" => HandlerConfig::Noop,
            "" => return Err(format!("{}: must not be empty", key("handler"))),
            _ => HandlerConfig::Registered(raw.handler),
        };
        Ok(JobConfig {
            name: raw.name,
            schedule: raw.schedule,
            timezone: raw.timezone,
            queue: raw.queue,
            handler,
            payload: raw.payload,
            max_attempts: raw.max_attempts,
            backoff: raw.backoff,
            timeout: raw.timeout,
            catch_up: raw.catch_up,
            catch_up_window: raw.catch_up_window,
            deadline: raw.deadline,
            jitter: raw.jitter,
            concurrency: raw.concurrency,
            global_concurrency: raw.global_concurrency,
            overlap: raw.overlap.unwrap_or_default(),
            shards: raw.shards,
            broadcast: raw.broadcast.unwrap_or(false),
            priority: raw.priority,
        })
    }
}

/// A [`Config`] that passed [`Config::validate`]: what every entry point takes
/// (`Worker::builder`, `EnqueueClient::connect`, the daemons and the CLI), obtained only
/// through validation ([`Config::load`], [`Config::from_toml_str`], [`Config::validated`]).
/// Reads go through `Deref`; to change a setting, take the [`Config`] out
/// ([`ValidConfig::into_config`]) and validate it again. Cloning it is cheap (shared).
#[derive(Debug, Clone)]
pub struct ValidConfig(std::sync::Arc<Config>);

impl std::ops::Deref for ValidConfig {
    type Target = Config;
    fn deref(&self) -> &Config {
        &self.0
    }
}

impl ValidConfig {
    /// The config itself, to change and validate again.
    pub fn into_config(self) -> Config {
        std::sync::Arc::unwrap_or_clone(self.0)
    }
}

impl TryFrom<Config> for ValidConfig {
    type Error = ConfigError;
    fn try_from(config: Config) -> Result<Self, ConfigError> {
        config.validated()
    }
}

/// A TLS URL in a build without chime-shared's `tls` feature: refused by name (never spoken
/// in plaintext).
fn no_tls_in_this_build(key: &str, tls_url: bool) -> Result<(), ConfigError> {
    tls_supported(key, tls_url, cfg!(feature = "tls"))
}

fn tls_supported(key: &str, tls_url: bool, built_with_tls: bool) -> Result<(), ConfigError> {
    if tls_url && !built_with_tls {
        return Err(ConfigError::invalid(
            key,
            "is a TLS URL, but this build has no TLS (chime-shared's `tls` feature, on by default);              chime never falls back to plaintext",
        ));
    }
    Ok(())
}

/// `host:port` → (host, port); `[v6]:port` gives the address without brackets.
pub fn host_port(s: &str) -> Option<(String, u16)> {
    let (host, port) = s.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    (!host.is_empty() && port != 0).then(|| (host.trim_matches(['[', ']']).to_string(), port))
}

impl JobConfig {
    /// The job's schedule, if it has one, in its zone.
    pub fn schedule(&self) -> Result<Option<crate::schedule::Schedule>, crate::schedule::ScheduleError> {
        self.schedule
            .as_deref()
            .map(|s| crate::schedule::Schedule::parse(s, self.timezone.as_deref()))
            .transpose()
    }

    /// The options this entry sets (a typed job's options with this entry on top:
    /// [`JobConfig::over`]).
    pub fn options(&self) -> JobOptions {
        let mut o = JobOptions::default();
        o.queue = self.queue.clone();
        o.timeout = self.timeout;
        o.max_attempts = self.max_attempts;
        o.backoff = self.backoff.clone();
        o.concurrency = self.concurrency;
        o.global_concurrency = self.global_concurrency;
        o
    }

    /// `base` (a typed job's own options) with every setting of this entry on top, so
    /// operators tune a job defined in Rust without a rebuild.
    pub fn over(&self, base: &JobOptions) -> JobOptions {
        let mut o = base.clone();
        let mine = self.options();
        o.queue = mine.queue.or(o.queue);
        o.timeout = mine.timeout.or(o.timeout);
        o.max_attempts = mine.max_attempts.or(o.max_attempts);
        o.backoff = mine.backoff.or(o.backoff);
        o.concurrency = mine.concurrency.or(o.concurrency);
        o.global_concurrency = mine.global_concurrency.or(o.global_concurrency);
        o
    }

    /// The job's queue (`default` unless set).
    pub fn queue(&self) -> &str {
        self.queue.as_deref().unwrap_or(DEFAULT_QUEUE)
    }
    /// The job's attempts (5 unless set).
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS)
    }
}

/// An environment variable name: a letter or `_`, then letters, digits or `_`.
pub fn valid_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The dotted key (`worker.concurrency`, `jobs[2].global_concurrency`) of the `key = value`
/// line holding byte `offset` of `text`, when that line is one: a parse error is named by key,
/// without quoting the line (its value may hold a password).
fn key_at(text: &str, offset: usize) -> Option<String> {
    let bare = |k: &str| !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    let key = text[start..end].split_once('=')?.0.trim();
    if !bare(key) {
        return None;
    }
    // The table the line belongs to: the last header above it, with its index for arrays.
    let mut table = String::new();
    let mut counts: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for l in text[..start].lines().map(|l| l.split('#').next().unwrap_or("").trim()) {
        if let Some(name) = l.strip_prefix("[[").and_then(|r| r.strip_suffix("]]")).map(str::trim) {
            if bare(name) {
                let n = counts.entry(name).or_insert(0);
                table = format!("{name}[{n}]");
                *n += 1;
            }
        } else if let Some(name) = l.strip_prefix('[').and_then(|r| r.strip_suffix(']')).map(str::trim)
            && bare(name)
        {
            table = match name.split_once('.') {
                // A sub-table of an array's last element (`[jobs.backoff]`).
                Some((head, rest)) if counts.get(head).is_some_and(|n| *n > 0) => {
                    format!("{head}[{}].{rest}", counts[head] - 1)
                }
                _ => name.to_string(),
            };
        }
    }
    Some(if table.is_empty() { key.to_string() } else { format!("{table}.{key}") })
}

impl Config {
    /// Resolves the path (`--config` > `$CHIME_CONFIG` > `./chime.toml`), reads, parses,
    /// applies environment overrides and validates.
    pub fn load(explicit: Option<&Path>) -> Result<ValidConfig, ConfigError> {
        let path = Self::resolve_path(explicit);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ConfigError::NotFound { path });
            }
            Err(source) => return Err(ConfigError::Read { path, source }),
        };
        let mut config = Self::parse(&text, &path.display().to_string())?;
        config.apply_env(|k| std::env::var(k).ok())?;
        config.validated()
    }

    /// The config path: `explicit`, else `$CHIME_CONFIG`, else `./chime.toml`.
    pub fn resolve_path(explicit: Option<&Path>) -> PathBuf {
        match explicit {
            Some(p) => p.to_path_buf(),
            None => std::env::var_os("CHIME_CONFIG")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_PATH)),
        }
    }

    /// Parses TOML text without env overrides or validation (`origin` names it in errors).
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        // toml's own message quotes the offending source line, which may hold a password:
        // report the position and the message alone, with any URL in it redacted.
        toml::from_str(text).map_err(|e| {
            let at = e.span().map(|span| {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                match key_at(text, span.start) {
                    Some(key) => format!("{key} (line {line}, column {column}): "),
                    None => format!("line {line}, column {column}: "),
                }
            });
            ConfigError::Parse {
                path: origin.to_string(),
                message: crate::redact::escape_control(&format!(
                    "{}{}",
                    at.unwrap_or_default(),
                    redact_text(e.message().trim_end())
                ))
                .into_owned(),
            }
        })
    }

    /// Parses and validates TOML text, applying no environment overrides (tests, embedding).
    pub fn from_toml_str(text: &str) -> Result<ValidConfig, ConfigError> {
        Self::parse(text, "<config>")?.validated()
    }

    /// This config, checked: the form every entry point takes. Built in code, a config is
    /// checked by the same rules as one read from a file.
    pub fn validated(self) -> Result<ValidConfig, ConfigError> {
        self.validate()?;
        Ok(ValidConfig(std::sync::Arc::new(self)))
    }

    /// Applies `CHIME_AMQP_URL`, `CHIME_REDIS_URL` and `CHIME_PREFIX` through `get`.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        if let Some(url) = get("CHIME_AMQP_URL").filter(|s| !s.is_empty()) {
            let urls: Vec<String> =
                url.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
            self.amqp.url = Urls::Many(urls);
        }
        if let Some(url) = get("CHIME_REDIS_URL").filter(|s| !s.is_empty()) {
            self.redis.url = url;
        }
        if let Some(prefix) = get("CHIME_PREFIX").filter(|s| !s.is_empty()) {
            self.prefix = prefix;
        }
        Ok(())
    }

    /// `[<section>.tls]` is only valid with a TLS URL, and its files must be readable PEM.
    fn check_tls(
        &self,
        section: &str,
        tls_url: bool,
        tls: &TlsConfig,
        scheme: &str,
    ) -> Result<(), ConfigError> {
        if *tls == TlsConfig::default() {
            return Ok(());
        }
        if !tls_url {
            return Err(ConfigError::invalid(
                format!("{section}.tls"),
                format!("is set but {section}.url is not a {scheme} URL (the settings would be ignored)"),
            ));
        }
        crate::tls::TlsFiles::read(&format!("{section}.tls"), tls)
            .map(|_| ())
            .map_err(|e| ConfigError::invalid(e.key, e.message))
    }

    /// `redis.sentinels` / `redis.master_name` / `redis.cluster` fit together.
    fn check_redis_topology(&self, scheme: &str) -> Result<(), ConfigError> {
        let r = &self.redis;
        for (key, list) in [("redis.sentinels", &r.sentinels), ("redis.cluster", &r.cluster)] {
            for (i, node) in list.iter().enumerate() {
                if host_port(node).is_none() {
                    return Err(ConfigError::invalid(
                        format!("{key}[{i}]"),
                        format!("{node:?} is not host:port"),
                    ));
                }
            }
            if !list.is_empty() && !matches!(scheme, "redis" | "rediss") {
                return Err(ConfigError::invalid(
                    key,
                    "needs a redis:// or rediss:// redis.url (for the scheme and password)",
                ));
            }
        }
        if !r.sentinels.is_empty() && !r.cluster.is_empty() {
            return Err(ConfigError::invalid(
                "redis.cluster",
                "set either redis.sentinels or redis.cluster, not both",
            ));
        }
        match (&r.master_name, r.sentinels.is_empty()) {
            (None, false) => {
                Err(ConfigError::invalid("redis.master_name", "is required with redis.sentinels"))
            }
            (Some(_), true) => {
                Err(ConfigError::invalid("redis.master_name", "is only used with redis.sentinels"))
            }
            (Some(m), false) if m.is_empty() => {
                Err(ConfigError::invalid("redis.master_name", "must not be empty"))
            }
            _ => Ok(()),
        }?;
        if !r.cluster.is_empty() {
            use redis::IntoConnectionInfo;
            let db = r.url.as_str().into_connection_info().map(|i| i.redis_settings().db()).unwrap_or(0);
            if db != 0 {
                return Err(ConfigError::invalid(
                    "redis.url",
                    format!("database {db}: a Redis Cluster has only database 0"),
                ));
            }
        }
        Ok(())
    }

    /// Checks every value once; the error names the first bad key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.prefix.len() > 64 {
            return Err(ConfigError::invalid(
                "prefix",
                format!(
                    "{:?} is longer than 64 characters (delayed messages carry it in a routing key)",
                    self.prefix
                ),
            ));
        }
        if !valid_name(&self.prefix) || self.prefix.contains('.') {
            return Err(ConfigError::invalid(
                "prefix",
                format!(
                    "{:?} must be letters, digits, '-' or '_' (no '.': with prefix \"a\" and queue \"q.x\", \
                     or prefix \"a.q\" and queue \"x\", both would name the queue a.q.q.x)",
                    self.prefix
                ),
            ));
        }
        if self.history.max_len == 0 || self.history.max_age.is_zero() {
            return Err(ConfigError::invalid(
                "history",
                "max_len and max_age must be positive (set history.enabled = false to record nothing)",
            ));
        }
        if !(16..=1_048_576).contains(&self.results.max_bytes) {
            return Err(ConfigError::invalid("results.max_bytes", "must be between 16 and 1048576"));
        }
        if self.results.retention.is_some_and(|r| r.is_zero()) {
            return Err(ConfigError::invalid("results.retention", "must be positive"));
        }
        if !(16..=1_048_576).contains(&self.checkpoints.max_bytes) {
            return Err(ConfigError::invalid("checkpoints.max_bytes", "must be between 16 and 1048576"));
        }
        if self.checkpoints.poll < Duration::from_millis(50)
            || self.checkpoints.poll > Duration::from_secs(60)
        {
            return Err(ConfigError::invalid("checkpoints.poll", "must be between 50ms and 1m"));
        }
        if !(1..=100).contains(&self.history.runs_per_key) {
            return Err(ConfigError::invalid("history.runs_per_key", "must be between 1 and 100"));
        }
        let urls = self.amqp.url.list();
        if urls.is_empty() {
            return Err(ConfigError::invalid("amqp.url", "at least one URL is required"));
        }
        for u in &urls {
            if !(u.starts_with("amqp://") || u.starts_with("amqps://")) {
                return Err(ConfigError::invalid(
                    "amqp.url",
                    format!("{:?} must start with amqp:// or amqps://", redact(u)),
                ));
            }
        }
        let tls_urls = urls.iter().filter(|u| u.starts_with("amqps://")).count();
        if tls_urls != 0 && tls_urls != urls.len() {
            return Err(ConfigError::invalid(
                "amqp.url",
                "mixes amqps:// and amqp:// URLs: a failover would drop to plaintext (use one scheme)",
            ));
        }
        no_tls_in_this_build("amqp.url", tls_urls != 0)?;
        self.check_tls("amqp", tls_urls != 0, &self.amqp.tls, "amqps://")?;
        if self.amqp.delivery_limit == 0 {
            return Err(ConfigError::invalid(
                "amqp.delivery_limit",
                "must be a positive number (0 and -1 dead-letter on the first requeue on RabbitMQ 3.10)",
            ));
        }
        match self.amqp.quorum_replicas {
            Some(0) => return Err(ConfigError::invalid("amqp.quorum_replicas", "must be at least 1")),
            Some(n) if n > 99 => {
                return Err(ConfigError::invalid("amqp.quorum_replicas", "must be at most 99"));
            }
            Some(_) if self.amqp.queue_type == QueueType::Classic => {
                return Err(ConfigError::invalid(
                    "amqp.quorum_replicas",
                    "applies to quorum queues only (queue_type = \"classic\")",
                ));
            }
            _ => {}
        }
        if self.amqp.heartbeat.as_secs() == 0 || self.amqp.heartbeat.as_secs() > 600 {
            return Err(ConfigError::invalid("amqp.heartbeat", "must be between 1s and 10m"));
        }
        if self.amqp.max_message_bytes < 1024 {
            return Err(ConfigError::invalid("amqp.max_message_bytes", "must be at least 1024"));
        }
        let scheme = self.redis.url.split_once("://").map(|(s, _)| s).unwrap_or("");
        if !matches!(scheme, "redis" | "rediss" | "redis+unix" | "unix") {
            return Err(ConfigError::invalid(
                "redis.url",
                format!(
                    "{:?}: scheme {scheme:?} is not supported (use redis://, rediss:// or redis+unix://; for \
                     Sentinel set redis.sentinels and redis.master_name, for a cluster redis.cluster)",
                    redact(&self.redis.url)
                ),
            ));
        }
        no_tls_in_this_build("redis.url", scheme == "rediss")?;
        if self.redis.url.contains("#insecure") {
            return Err(ConfigError::invalid(
                "redis.url",
                "#insecure would turn certificate checks off; chime does not allow it (set redis.tls.ca_file)",
            ));
        }
        self.check_tls("redis", scheme == "rediss", &self.redis.tls, "rediss://")?;
        self.check_redis_topology(scheme)?;
        if self.redis.lease < Duration::from_secs(1) {
            return Err(ConfigError::invalid("redis.lease", "must be at least 1s"));
        }
        if self.alerts.dlq_threshold == 0 {
            return Err(ConfigError::invalid("alerts.dlq_threshold", "must be at least 1"));
        }
        if self.alerts.interval < Duration::from_millis(100) {
            return Err(ConfigError::invalid("alerts.interval", "must be at least 100ms"));
        }
        if let Some(w) = &self.alerts.webhook
            && !(w.starts_with("http://") || w.starts_with("https://"))
        {
            return Err(ConfigError::invalid("alerts.webhook", "must be an http:// or https:// URL"));
        }
        if self.worker.concurrency == 0 || self.worker.concurrency > 10_000 {
            return Err(ConfigError::invalid("worker.concurrency", "must be between 1 and 10000"));
        }
        if self.worker.threads > 1024 {
            return Err(ConfigError::invalid("worker.threads", "must be between 0 (one per core) and 1024"));
        }
        for (i, name) in self.worker.pass_env.iter().enumerate() {
            if !valid_env_name(name) {
                return Err(ConfigError::invalid(
                    format!("worker.pass_env[{i}]"),
                    format!("{name:?} is not a variable name"),
                ));
            }
        }
        if self.worker.prefetch == Some(0) {
            return Err(ConfigError::invalid("worker.prefetch", "must be at least 1"));
        }
        for (i, q) in self.worker.queues.iter().enumerate() {
            if !valid_name(q) {
                return Err(ConfigError::invalid(
                    format!("worker.queues[{i}]"),
                    format!("{q:?} must be 1-100 letters, digits, '-', '_' or '.'"),
                ));
            }
        }
        let mut names = BTreeSet::new();
        for (i, job) in self.jobs.iter().enumerate() {
            let key = |field: &str| format!("jobs[{i}] ({}).{field}", job.name);
            if !valid_name(&job.name) {
                return Err(ConfigError::invalid(
                    format!("jobs[{i}].name"),
                    format!("{:?} must be 1-100 letters, digits, '-', '_' or '.'", job.name),
                ));
            }
            if !names.insert(job.name.as_str()) {
                return Err(ConfigError::invalid(key("name"), "duplicate job name"));
            }
            // The rules a typed job's options are checked by (queue, timeout, attempts,
            // backoff, limits).
            job.options().validate().map_err(|e| ConfigError::invalid(key(e.field), e.message))?;
            if let Some(s) = &job.schedule {
                // The planner's own parser: 5 or 6 fields, and a pattern that can fire.
                crate::schedule::Schedule::parse(s, None)
                    .map_err(|e| ConfigError::invalid(key("schedule"), e.to_string()))?;
            }
            if let Some(tz) = &job.timezone {
                chrono_tz::Tz::from_str(tz).map_err(|_| {
                    ConfigError::invalid(key("timezone"), format!("{tz:?} is not an IANA time zone"))
                })?;
            }
            let pass_env = match &job.handler {
                HandlerConfig::Exec(exec) => exec.pass_env.as_slice(),
                _ => &[],
            };
            for (j, name) in pass_env.iter().enumerate() {
                if !valid_env_name(name) {
                    return Err(ConfigError::invalid(
                        format!("{}[{j}]", key("pass_env")),
                        format!("{name:?} is not a variable name"),
                    ));
                }
            }
        }
        // A record must outlive the longest run it guards (renewals refresh its TTL, but a
        // retention shorter than a run would still let a finished key expire early).
        let (longest, job) = self
            .jobs
            .iter()
            .map(|j| (j.timeout.unwrap_or(self.worker.default_timeout), j.name.as_str()))
            .chain([(self.worker.default_timeout, "worker.default_timeout")])
            .max()
            .unwrap_or((self.worker.default_timeout, "worker.default_timeout"));
        let floor = longest + self.worker.cancel_grace + self.redis.lease;
        if self.redis.done_retention <= floor {
            return Err(ConfigError::invalid(
                "redis.done_retention",
                format!(
                    "must exceed the longest job timeout ({longest:?}, {job}) plus worker.cancel_grace and \
                     redis.lease ({floor:?} in all)"
                ),
            ));
        }
        if self.worker.cancel_grace > Duration::from_secs(3600) {
            return Err(ConfigError::invalid("worker.cancel_grace", "must be at most 1h"));
        }
        Ok(())
    }

    /// The job named `name`.
    pub fn job(&self, name: &str) -> Option<&JobConfig> {
        self.jobs.iter().find(|j| j.name == name)
    }

    /// Queues a worker consumes by default: `worker.queues`, else every job's queue.
    pub fn worker_queues(&self) -> Vec<String> {
        if !self.worker.queues.is_empty() {
            return self.worker.queues.clone();
        }
        let mut set: BTreeSet<String> = self.jobs.iter().map(|j| j.queue().to_string()).collect();
        set.insert(DEFAULT_QUEUE.to_string());
        set.into_iter().collect()
    }

    /// Every queue any job or worker refers to (what gets declared).
    pub fn all_queues(&self) -> Vec<String> {
        let mut set: BTreeSet<String> = self.jobs.iter().map(|j| j.queue().to_string()).collect();
        set.extend(self.worker.queues.iter().cloned());
        set.insert(DEFAULT_QUEUE.to_string());
        set.into_iter().collect()
    }

    /// The priority levels of `queue`: all three when one of its jobs sets `priority`, else
    /// only `normal` (a level is a queue of its own on the broker).
    pub fn levels(&self, queue: &str) -> Vec<Priority> {
        if self.jobs.iter().any(|j| j.queue() == queue && j.priority.is_some()) {
            Priority::ALL.to_vec()
        } else {
            vec![Priority::Normal]
        }
    }

    /// The routes (queues on the broker, `<prefix>.q.<route>`) of `queue` with their levels,
    /// highest first.
    pub fn routes(&self, queue: &str) -> Vec<(String, Priority)> {
        self.levels(queue).into_iter().map(|p| (crate::envelope::priority_route(queue, p), p)).collect()
    }
}

#[cfg(test)]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        match Config::from_toml_str(text) {
            Ok(_) => panic!("config unexpectedly valid:\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_build_without_tls_refuses_tls_urls_by_name() {
        let e = tls_supported("redis.url", true, false).unwrap_err().to_string();
        assert!(e.contains("redis.url") && e.contains("never falls back to plaintext"), "{e}");
        assert!(tls_supported("redis.url", false, false).is_ok());
        assert!(tls_supported("amqp.url", true, true).is_ok());
    }

    #[cfg(feature = "tls")]
    #[test]
    fn sentinel_and_cluster_settings_fit_together() {
        let ok = Config::from_toml_str(
            "[redis]\nurl = \"rediss://:pw@x/2\"\nsentinels = [\"s1:26379\", \"s2:26379\"]\nmaster_name = \"m\"\n",
        )
        .unwrap();
        assert_eq!(ok.redis.endpoint(), "master \"m\" via sentinels s1:26379, s2:26379");
        Config::from_toml_str("[redis]\ncluster = [\"c1:7000\", \"c2:7000\"]\n").unwrap();
        for (text, want) in [
            ("[redis]\nsentinels = [\"s1:26379\"]\n", "redis.master_name: is required with redis.sentinels"),
            ("[redis]\nmaster_name = \"m\"\n", "redis.master_name: is only used with redis.sentinels"),
            (
                "[redis]\nsentinels = [\"s1\"]\nmaster_name = \"m\"\n",
                "redis.sentinels[0]: \"s1\" is not host:port",
            ),
            (
                "[redis]\nsentinels = [\"s1:1\"]\nmaster_name = \"m\"\ncluster = [\"c:1\"]\n",
                "redis.cluster: set either redis.sentinels or redis.cluster",
            ),
            ("[redis]\nurl = \"redis://x/3\"\ncluster = [\"c:1\"]\n", "a Redis Cluster has only database 0"),
            (
                "[redis]\ncluster = [\"c:1\"]\nurl = \"redis+unix:///tmp/r.sock\"\n",
                "redis.cluster: needs a redis://",
            ),
        ] {
            let e = err(text);
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn a_prefix_cannot_make_two_prefixes_name_one_queue() {
        // `a` + `q.x` and `a.q` + `x` would both be the queue a.q.q.x.
        let e = err("prefix = \"a.q\"\n[[jobs]]\nname = \"j\"\nhandler = \"noop\"\nqueue = \"x\"\n");
        assert!(e.contains("prefix: \"a.q\" must be letters, digits"), "{e}");
        Config::from_toml_str(
            "prefix = \"a\"\n[[jobs]]\nname = \"j\"\nhandler = \"noop\"\nqueue = \"q.x\"\n",
        )
        .unwrap();
        Config::from_toml_str("prefix = \"billing-eu_2\"\n").unwrap();
    }

    #[test]
    fn empty_config_has_defaults() {
        let c = Config::from_toml_str("").unwrap();
        assert_eq!(c.prefix, "chime");
        assert_eq!(c.amqp.queue_type, QueueType::Quorum);
        assert_eq!(c.redis.lease, Duration::from_secs(30));
        assert_eq!(c.worker_queues(), vec!["default".to_string()]);
    }

    #[test]
    fn unknown_keys_are_named() {
        assert!(err("[worker]\nconcurency = 3\n").contains("concurency"));
        assert!(err("colour = 1\n").contains("colour"));
        assert!(err("[[jobs]]\nname='a'\nhandler='noop'\nretries=3\n").contains("retries"));
    }

    #[test]
    fn bad_values_are_named() {
        assert!(err("[redis]\nlease = \"soon\"\n").contains("soon"));
        assert!(err("[amqp]\nqueue_type = \"stream\"\n").contains("stream"));
        let e = err("[[jobs]]\nname='a'\nhandler='exec'\n");
        assert!(e.contains("jobs[0] (a).command"), "{e}");
        // A key of another handler is named, not ignored.
        let e = err(
            "[[jobs]]\nname='a'\nhandler='noop'\n[[jobs]]\nname='b'\nhandler='http'\nurl='http://x'\npermanent_exit_codes=[3]\n",
        );
        assert!(e.contains("jobs[1] (b).permanent_exit_codes: only valid with handler \"exec\""), "{e}");
        let c = Config::from_toml_str(
            "[[jobs]]\nname='a'\nhandler='exec'\ncommand=['true']\n[[jobs]]\nname='b'\nhandler='mine'\n",
        )
        .unwrap();
        assert_eq!(
            c.jobs[0].handler,
            HandlerConfig::Exec(ExecConfig {
                command: vec!["true".into()],
                permanent_exit_codes: vec![100],
                pass_env: vec![]
            })
        );
        assert_eq!(c.jobs[1].handler, HandlerConfig::Registered("mine".into()));
        let e = err("[[jobs]]\nname='a'\nhandler='noop'\nschedule='61 * * * *'\n");
        assert!(e.contains("jobs[0] (a).schedule"), "{e}");
        let e = err("[[jobs]]\nname='a'\nhandler='noop'\nschedule='0 0 30 2 *'\n");
        assert!(e.contains("jobs[0] (a).schedule") && e.contains("never fires"), "{e}");
        let e = err("[[jobs]]\nname='a'\nhandler='noop'\nschedule='0 0 0 1 1 * 2030'\n");
        assert!(e.contains("jobs[0] (a).schedule") && e.contains("7 fields"), "{e}");
        let e = err("[[jobs]]\nname='a'\nhandler='noop'\ntimezone='Mars/Olympus'\n");
        assert!(e.contains("jobs[0] (a).timezone"), "{e}");
        let e = err("[[jobs]]\nname='a'\nhandler='noop'\n[[jobs]]\nname='a'\nhandler='noop'\n");
        assert!(e.contains("duplicate"), "{e}");
        assert!(err("[amqp]\ndelivery_limit = 0\n").contains("amqp.delivery_limit"));
        assert!(err("[amqp]\nquorum_replicas = 0\n").contains("amqp.quorum_replicas"));
        assert!(
            err("[amqp]\nqueue_type = \"classic\"\nquorum_replicas = 3\n").contains("amqp.quorum_replicas")
        );
        assert!(err("[worker]\nthreads = 5000\n").contains("worker.threads"));
        for (line, key) in [
            ("concurrency = 0", "jobs[0] (a).concurrency: must be between 1 and 10000"),
            ("global_concurrency = 0", "jobs[0] (a).global_concurrency: must be between 1 and 10000"),
            ("global_concurrency = 10001", "jobs[0] (a).global_concurrency: must be between 1 and 10000"),
            ("global_concurrency = -1", "jobs[0].global_concurrency (line 4, column 22): invalid value"),
            ("concurrency = \"lots\"", "jobs[0].concurrency (line 4, column 15)"),
        ] {
            let e = err(&format!("[[jobs]]\nname='a'\nhandler='noop'\n{line}\n"));
            assert!(e.contains(key), "{line}: {e}");
        }
    }

    #[test]
    fn a_value_of_the_wrong_type_is_named_by_its_key() {
        let text = "prefix = 'p'\n[worker]\nconcurrency = 8\n[[jobs]]\nname='a'\nhandler='noop'\n\
                    [[jobs]]\nname='b'\nhandler='noop'\n[jobs.backoff]\ninitial = 5\n";
        let e = err(text);
        assert!(e.contains("jobs[1].backoff.initial (line 11, column 11)"), "{e}");
        let e = err("[redis]\nurl = 'redis://u:secret@h/0'\nlease = 3\n");
        assert!(e.contains("redis.lease (line 3"), "{e}");
        assert!(!e.contains("secret"), "{e}");
        assert!(err("[worker]\nconcurrency = -1\n").contains("worker.concurrency (line 2"));
        assert_eq!(key_at("[[jobs]]\nurls = [\n 'a=b',\n]\n", 20), None, "an array's element is no key");
    }

    #[test]
    fn env_overrides_win() {
        let mut c = Config::from_toml_str("").unwrap().into_config();
        c.apply_env(|k| match k {
            "CHIME_AMQP_URL" => Some("amqp://a/%2f, amqp://b/%2f".into()),
            "CHIME_PREFIX" => Some("t1".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.amqp.url.list(), vec!["amqp://a/%2f", "amqp://b/%2f"]);
        assert_eq!(c.prefix, "t1");
    }

    #[test]
    fn syntax_errors_never_echo_the_source_line() {
        let e = err("[amqp]\nurl = \"amqp://u:hunter2@h/\"\nheartbeat = = 3\n");
        assert!(!e.contains("hunter2"), "{e}");
        assert!(e.contains("line 3"), "{e}");
        let e = err("[amqp]\nheartbeat = \"amqp://u:hunter2@h/\"\n");
        assert!(!e.contains("hunter2"), "{e}");
    }
}
