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

/// Default config path when neither `--config` nor `$CHIME_CONFIG` is given.
pub const DEFAULT_PATH: &str = "chime.toml";
/// Queue that jobs without a `queue` key go to.
pub const DEFAULT_QUEUE: &str = "default";
/// Exit code of an `exec` command that means "permanent failure, do not retry".
pub const DEFAULT_PERMANENT_EXIT_CODE: i32 = 100;

/// A configuration problem. `Display` names the file and key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path} not found (pass --config PATH or set CHIME_CONFIG)")]
    NotFound { path: PathBuf },
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("invalid config: {key}: {message}")]
    Invalid { key: String, message: String },
}

impl ConfigError {
    fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid { key: key.into(), message: message.into() }
    }
}

/// The whole `chime.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Prefix of every exchange, queue and Redis key (`CHIME_PREFIX`).
    #[serde(default = "default_prefix")]
    pub prefix: String,
    #[serde(default)]
    pub amqp: AmqpConfig,
    #[serde(default)]
    pub redis: RedisConfig,
    #[serde(default)]
    pub worker: WorkerConfig,
    #[serde(default)]
    pub ticker: TickerConfig,
    #[serde(default)]
    pub alerts: AlertsConfig,
    #[serde(default)]
    pub jobs: Vec<JobConfig>,
}

fn default_prefix() -> String {
    "chime".into()
}

/// One URL or a list of URLs tried in turn (cluster nodes).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Urls {
    One(String),
    Many(Vec<String>),
}

impl Urls {
    pub fn list(&self) -> Vec<String> {
        match self {
            Urls::One(u) => vec![u.clone()],
            Urls::Many(v) => v.clone(),
        }
    }
}

/// Queue type of work queues and DLQs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    Quorum,
    Classic,
}

impl QueueType {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AmqpConfig {
    /// `amqp://user:pass@host:port/vhost`; a list is tried in order (`CHIME_AMQP_URL`,
    /// comma-separated for several).
    #[serde(default = "default_amqp_url")]
    pub url: Urls,
    #[serde(default = "default_queue_type")]
    pub queue_type: QueueType,
    /// Quorum queues only: broker-side safety net against crash loops. Always explicit and
    /// positive, never -1 (on RabbitMQ 3.10, -1 dead-letters on the first requeue).
    #[serde(default = "default_delivery_limit")]
    pub delivery_limit: u32,
    #[serde(default = "default_heartbeat", deserialize_with = "duration::de")]
    pub heartbeat: Duration,
    /// How long a publish may wait for its confirm before it counts as failed.
    #[serde(default = "default_publish_timeout", deserialize_with = "duration::de")]
    pub publish_timeout: Duration,
    /// Largest envelope chime publishes; larger payloads are rejected before publishing,
    /// and larger deliveries are dead-lettered as `too_large`.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// The broker's `consumer_timeout` (RabbitMQ default 30 min): workers warn at startup
    /// when a job's timeout is not safely below it.
    #[serde(default = "default_consumer_timeout", deserialize_with = "duration::de")]
    pub consumer_timeout: Duration,
}

fn default_consumer_timeout() -> Duration {
    Duration::from_secs(1800)
}

fn default_amqp_url() -> Urls {
    Urls::One("amqp://guest:guest@127.0.0.1:5672/%2f".into())
}
fn default_queue_type() -> QueueType {
    QueueType::Quorum
}
fn default_delivery_limit() -> u32 {
    50
}
fn default_heartbeat() -> Duration {
    Duration::from_secs(10)
}
fn default_publish_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_max_message_bytes() -> usize {
    1024 * 1024
}

impl Default for AmqpConfig {
    fn default() -> Self {
        Self {
            url: default_amqp_url(),
            queue_type: default_queue_type(),
            delivery_limit: default_delivery_limit(),
            heartbeat: default_heartbeat(),
            publish_timeout: default_publish_timeout(),
            max_message_bytes: default_max_message_bytes(),
            consumer_timeout: default_consumer_timeout(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://host:port/db` (`CHIME_REDIS_URL`).
    #[serde(default = "default_redis_url")]
    pub url: String,
    /// How long a claim stays valid without renewal; renewed every third of it.
    #[serde(default = "default_lease", deserialize_with = "duration::de")]
    pub lease: Duration,
    /// How long `done`/`dead` marks are kept (duplicates within it are absorbed).
    #[serde(default = "default_retention", deserialize_with = "duration::de")]
    pub done_retention: Duration,
    /// Per-command response timeout; past it Redis counts as unreachable.
    #[serde(default = "default_redis_timeout", deserialize_with = "duration::de")]
    pub timeout: Duration,
}

fn default_redis_url() -> String {
    "redis://127.0.0.1:6379/0".into()
}
fn default_lease() -> Duration {
    Duration::from_secs(30)
}
fn default_retention() -> Duration {
    Duration::from_secs(7 * 86_400)
}
fn default_redis_timeout() -> Duration {
    Duration::from_secs(3)
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: default_redis_url(),
            lease: default_lease(),
            done_retention: default_retention(),
            timeout: default_redis_timeout(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Queues to consume; empty means every queue named by a job (plus `default`).
    #[serde(default)]
    pub queues: Vec<String>,
    /// Jobs run at once per process.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Unacked deliveries per queue consumer; defaults to `concurrency`.
    #[serde(default)]
    pub prefetch: Option<u16>,
    /// Drain deadline on SIGTERM/SIGINT.
    #[serde(default = "default_shutdown_timeout", deserialize_with = "duration::de")]
    pub shutdown_timeout: Duration,
    /// Handler timeout for jobs that set none.
    #[serde(default = "default_job_timeout", deserialize_with = "duration::de")]
    pub default_timeout: Duration,
    /// Address of `/metrics`, `/livez`, `/readyz` (overridden by `--listen`).
    #[serde(default)]
    pub listen: Option<String>,
    /// Runtime threads of a `chime-worker` process; 0 = one per CPU core.
    #[serde(default)]
    pub threads: usize,
    /// A job this worker has no handler for is sent round again for this long (a rolling
    /// deploy may bring the worker that knows it) before it is dead-lettered as `unknown_job`.
    #[serde(default = "default_unknown_job_grace", deserialize_with = "duration::de")]
    pub unknown_job_grace: Duration,
    /// On timeout or at the drain deadline a handler's cancellation token fires first; the
    /// handler gets this long to stop on its own before its future is dropped.
    #[serde(default = "default_cancel_grace", deserialize_with = "duration::de")]
    pub cancel_grace: Duration,
    /// Variables of the worker's environment passed to every `exec` job's program. Nothing
    /// else is (besides `PATH`, `HOME`, locale, `TZ`, `TMPDIR` and the job's `CHIME_*` facts):
    /// the worker's own secrets (`CHIME_AMQP_URL`, `CHIME_REDIS_URL`, …) never reach a job.
    #[serde(default)]
    pub pass_env: Vec<String>,
}

fn default_concurrency() -> usize {
    8
}
fn default_shutdown_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_job_timeout() -> Duration {
    Duration::from_secs(300)
}
fn default_unknown_job_grace() -> Duration {
    Duration::from_secs(300)
}
fn default_cancel_grace() -> Duration {
    Duration::from_secs(5)
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            queues: Vec::new(),
            concurrency: default_concurrency(),
            prefetch: None,
            shutdown_timeout: default_shutdown_timeout(),
            default_timeout: default_job_timeout(),
            listen: None,
            threads: 0,
            unknown_job_grace: default_unknown_job_grace(),
            cancel_grace: default_cancel_grace(),
            pass_env: Vec::new(),
        }
    }
}

/// Settings of `chime tick` (the ticker lands with its own issue; keys are validated now).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TickerConfig {
    #[serde(default)]
    pub listen: Option<String>,
    #[serde(default = "default_ticker_lease", deserialize_with = "duration::de")]
    pub lease: Duration,
    #[serde(default = "default_clock_skew", deserialize_with = "duration::de")]
    pub max_clock_skew: Duration,
}

fn default_ticker_lease() -> Duration {
    Duration::from_secs(10)
}
fn default_clock_skew() -> Duration {
    Duration::from_millis(200)
}

impl Default for TickerConfig {
    fn default() -> Self {
        Self { listen: None, lease: default_ticker_lease(), max_clock_skew: default_clock_skew() }
    }
}

/// DLQ depth alerting (used by the DLQ monitor).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlertsConfig {
    #[serde(default = "default_threshold")]
    pub dlq_threshold: u64,
    #[serde(default = "default_for", deserialize_with = "duration::de", rename = "for")]
    pub for_: Duration,
    /// Alertmanager-compatible webhook URL (log only when unset).
    #[serde(default)]
    pub webhook: Option<String>,
    /// How often DLQ depths are read.
    #[serde(default = "default_alert_interval", deserialize_with = "duration::de")]
    pub interval: Duration,
}

fn default_threshold() -> u64 {
    1
}
fn default_alert_interval() -> Duration {
    Duration::from_secs(15)
}
fn default_for() -> Duration {
    Duration::from_secs(60)
}

impl Default for AlertsConfig {
    fn default() -> Self {
        Self {
            dlq_threshold: default_threshold(),
            for_: default_for(),
            webhook: None,
            interval: default_alert_interval(),
        }
    }
}

/// Exponential backoff of retries.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackoffConfig {
    #[serde(default = "default_backoff_initial", deserialize_with = "duration::de")]
    pub initial: Duration,
    #[serde(default = "default_backoff_factor")]
    pub factor: f32,
    #[serde(default = "default_backoff_max", deserialize_with = "duration::de")]
    pub max: Duration,
}

fn default_backoff_initial() -> Duration {
    Duration::from_secs(5)
}
fn default_backoff_factor() -> f32 {
    2.0
}
fn default_backoff_max() -> Duration {
    Duration::from_secs(3600)
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            initial: default_backoff_initial(),
            factor: default_backoff_factor(),
            max: default_backoff_max(),
        }
    }
}

/// Missed-slot policy of a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CatchUp {
    All,
    Latest,
    None,
}

/// One `[[jobs]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobConfig {
    pub name: String,
    /// Cron expression (5 or 6 fields, or a macro such as `@daily`); absent = ad-hoc only.
    #[serde(default)]
    pub schedule: Option<String>,
    /// IANA zone of the schedule; default UTC.
    #[serde(default)]
    pub timezone: Option<String>,
    #[serde(default)]
    pub queue: Option<String>,
    /// `exec`, `http`, `noop`, or the name of a handler registered in Rust.
    pub handler: String,
    /// `exec`: program and arguments (no shell).
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// `exec`: exit codes that mean permanent failure (default `[100]`).
    #[serde(default)]
    pub permanent_exit_codes: Option<Vec<i32>>,
    /// `exec`: variables of the worker's environment passed to this job's program, besides
    /// `worker.pass_env` and the safe defaults (`PATH`, `HOME`, locale, `TZ`, `TMPDIR`).
    #[serde(default)]
    pub pass_env: Option<Vec<String>>,
    /// `http`: URL the payload is POSTed to.
    #[serde(default)]
    pub url: Option<String>,
    /// Default payload (scheduled runs, and `chime enqueue` without `--payload`).
    #[serde(default)]
    pub payload: Option<serde_json::Value>,
    #[serde(default)]
    pub max_attempts: Option<u32>,
    #[serde(default)]
    pub backoff: Option<BackoffConfig>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    pub timeout: Option<Duration>,
    #[serde(default)]
    pub catch_up: Option<CatchUp>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    pub catch_up_window: Option<Duration>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    pub deadline: Option<Duration>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    pub jitter: Option<Duration>,
}

/// Default number of attempts (first run included).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

impl JobConfig {
    pub fn queue(&self) -> &str {
        self.queue.as_deref().unwrap_or(DEFAULT_QUEUE)
    }
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS)
    }
    pub fn permanent_exit_codes(&self) -> Vec<i32> {
        self.permanent_exit_codes.clone().unwrap_or_else(|| vec![DEFAULT_PERMANENT_EXIT_CODE])
    }
}

/// An environment variable name: a letter or `_`, then letters, digits or `_`.
pub fn valid_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Names of queues, jobs and prefixes: letters, digits, `-`, `_`, `.`; 1 to 100 characters.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 100
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl Config {
    /// Resolves the path (`--config` > `$CHIME_CONFIG` > `./chime.toml`), reads, parses,
    /// applies environment overrides and validates.
    pub fn load(explicit: Option<&Path>) -> Result<Self, ConfigError> {
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
        config.validate()?;
        Ok(config)
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
                format!("line {line}, column {column}: ")
            });
            ConfigError::Parse {
                path: origin.to_string(),
                message: format!("{}{}", at.unwrap_or_default(), redact_text(e.message().trim_end())),
            }
        })
    }

    /// Parses and validates TOML text, applying no environment overrides (tests, embedding).
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let config = Self::parse(text, "<config>")?;
        config.validate()?;
        Ok(config)
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
        if !valid_name(&self.prefix) {
            return Err(ConfigError::invalid(
                "prefix",
                format!("{:?} must be 1-100 letters, digits, '-', '_' or '.'", self.prefix),
            ));
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
        if self.amqp.delivery_limit == 0 {
            return Err(ConfigError::invalid(
                "amqp.delivery_limit",
                "must be a positive number (0 and -1 dead-letter on the first requeue on RabbitMQ 3.10)",
            ));
        }
        if self.amqp.heartbeat.as_secs() == 0 || self.amqp.heartbeat.as_secs() > 600 {
            return Err(ConfigError::invalid("amqp.heartbeat", "must be between 1s and 10m"));
        }
        if self.amqp.max_message_bytes < 1024 {
            return Err(ConfigError::invalid("amqp.max_message_bytes", "must be at least 1024"));
        }
        if !self.redis.url.starts_with("redis://")
            && !self.redis.url.starts_with("rediss://")
            && !self.redis.url.starts_with("redis+unix://")
        {
            return Err(ConfigError::invalid(
                "redis.url",
                format!("{:?} must start with redis:// or rediss://", redact(&self.redis.url)),
            ));
        }
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
            if let Some(q) = &job.queue
                && !valid_name(q)
            {
                return Err(ConfigError::invalid(
                    key("queue"),
                    format!("{q:?} must be 1-100 letters, digits, '-', '_' or '.'"),
                ));
            }
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
            match job.handler.as_str() {
                "exec" => match &job.command {
                    Some(c) if !c.is_empty() && !c[0].is_empty() => {}
                    _ => {
                        return Err(ConfigError::invalid(
                            key("command"),
                            "required for handler \"exec\" (a non-empty list: program and arguments)",
                        ));
                    }
                },
                "http" => match &job.url {
                    Some(u) if u.starts_with("http://") || u.starts_with("https://") => {}
                    _ => {
                        return Err(ConfigError::invalid(
                            key("url"),
                            "required for handler \"http\" (an http:// or https:// URL)",
                        ));
                    }
                },
                "" => return Err(ConfigError::invalid(key("handler"), "must not be empty")),
                _ => {}
            }
            if job.handler != "exec" && job.command.is_some() {
                return Err(ConfigError::invalid(key("command"), "only valid with handler \"exec\""));
            }
            if job.handler != "exec" && job.pass_env.is_some() {
                return Err(ConfigError::invalid(key("pass_env"), "only valid with handler \"exec\""));
            }
            for (j, name) in job.pass_env.iter().flatten().enumerate() {
                if !valid_env_name(name) {
                    return Err(ConfigError::invalid(
                        format!("{}[{j}]", key("pass_env")),
                        format!("{name:?} is not a variable name"),
                    ));
                }
            }
            if job.handler != "http" && job.url.is_some() {
                return Err(ConfigError::invalid(key("url"), "only valid with handler \"http\""));
            }
            if job.max_attempts.is_some_and(|n| n == 0 || n > crate::envelope::MAX_ATTEMPTS) {
                return Err(ConfigError::invalid(
                    key("max_attempts"),
                    format!("must be between 1 and {}", crate::envelope::MAX_ATTEMPTS),
                ));
            }
            if let Some(b) = &job.backoff
                && (!(1.0..=100.0).contains(&b.factor) || b.initial.is_zero() || b.max < b.initial)
            {
                return Err(ConfigError::invalid(
                    key("backoff"),
                    "needs initial > 0, factor between 1 and 100, and max >= initial",
                ));
            }
            if job.timeout.is_some_and(|t| t.is_zero()) {
                return Err(ConfigError::invalid(key("timeout"), "must be positive"));
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

    /// Effective prefetch per consumer.
    pub fn prefetch(&self) -> u16 {
        self.worker.prefetch.unwrap_or_else(|| u16::try_from(self.worker.concurrency).unwrap_or(u16::MAX))
    }
}

/// Hides the password and the query values of a URL for logs, errors and headers:
/// `amqp://chime:***@host/vh`, `https://api/x?api_key=***&page=***`.
pub fn redact(url: &str) -> String {
    let (base, fragment) = match url.split_once('#') {
        Some((b, _)) => (b, "#***"),
        None => (url, ""),
    };
    let (base, query) = match base.split_once('?') {
        Some((b, q)) => {
            let masked: Vec<String> = q
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) => format!("{k}=***"),
                    None => pair.to_string(),
                })
                .collect();
            (b, format!("?{}", masked.join("&")))
        }
        None => (base, String::new()),
    };
    let base = match (base.find("://"), base.rfind('@')) {
        (Some(s), Some(at)) if at > s + 3 => {
            let creds = &base[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:***{}", &base[..s + 3], &creds[..c], &base[at..]),
                None => base.to_string(),
            }
        }
        _ => base.to_string(),
    };
    format!("{base}{query}{fragment}")
}

/// [`redact`] applied to every URL inside a free text (an error message, a header): a URL
/// runs from its scheme to the next white space or quote.
pub fn redact_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let start = rest[..i]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '+' || c == '-' || c == '.'))
            .map_or(0, |j| j + 1);
        let end = rest[i..]
            .find(|c: char| c.is_whitespace() || c == '"' || c == '\'' || c == '`')
            .map_or(rest.len(), |j| i + j);
        out.push_str(&rest[..start]);
        out.push_str(&redact(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Control characters (newlines, terminal escapes) of untrusted text shown as escapes, so a
/// name or message from the wire cannot forge a log line or drive a terminal.
pub fn escape_control(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(
        text.chars()
            .flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] })
            .collect(),
    )
}

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
        assert!(err("[worker]\nthreads = 5000\n").contains("worker.threads"));
    }

    #[test]
    fn env_overrides_win() {
        let mut c = Config::from_toml_str("").unwrap();
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
    fn redact_hides_passwords_and_query_values() {
        assert_eq!(redact("amqp://guest:secret@h:5672/%2f"), "amqp://guest:***@h:5672/%2f");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
        assert_eq!(
            redact("https://api.example/hook?api_key=s3cret&x=1"),
            "https://api.example/hook?api_key=***&x=***"
        );
        assert_eq!(redact("https://u:p@h/p?token=t#frag"), "https://u:***@h/p?token=***#***");
        let text = "request to \"https://h/x?token=abc\" failed; fallback amqp://a:b@c/ also";
        assert_eq!(
            redact_text(text),
            "request to \"https://h/x?token=***\" failed; fallback amqp://a:***@c/ also"
        );
        assert_eq!(escape_control("ok"), "ok");
        assert_eq!(escape_control("a\nINFO forged\u{1b}[2J"), "a\\nINFO forged\\u{1b}[2J");
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
