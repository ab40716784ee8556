//! Typed configuration: TOML with unknown keys rejected, durations as strings, validated once.
//!
//! Precedence is: command-line flag > environment variable (`CHIME_AMQP_URL`,
//! `CHIME_REDIS_URL`, `CHIME_PREFIX`) > config file > default. Every error names the key
//! that is wrong so that `chime check-config` can point the operator straight at it.

use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
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

// Each section: its types, defaults and rules together; `Config::validate` runs them and the
// rules that span sections.
mod amqp;
mod calendars;
mod circuits;
mod jobs;
mod limits;
mod ops;
mod producer;
mod store;
mod workers;
mod workflows;
pub use workflows::order as step_order;

pub use amqp::{AmqpConfig, Urls};
pub use calendars::{CalendarConfig, ResolvedCalendar};
pub use circuits::{Circuit, CircuitRef, NamedCircuit, OnOpen, ResolvedCircuit, Trip};
pub use jobs::{CatchUp, ExecConfig, HandlerConfig, JobConfig, Overlap, Shards};
pub use limits::{LimitKey, NO_TENANT, NamedLimit, Rate, RateLimit, RateLimitRef, ResolvedLimit};
pub use ops::{AlertsConfig, CheckpointsConfig, HistoryConfig, LogConfig, ResultsConfig, TelemetryConfig};
pub use producer::{ApiConfig, ApiToken, ProducerConfig};
pub use store::RedisConfig;
pub use workers::{Criticality, ShedConfig, TickerConfig, WorkerConfig, check_listen};

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
    /// What workers log.
    pub log: LogConfig,
    /// Traces exported over OTLP (off unless `otlp_endpoint` is set).
    pub telemetry: TelemetryConfig,
    /// What producers do when the broker cannot confirm a job (the local spool).
    pub producer: ProducerConfig,
    /// The HTTP enqueue API (`chime api`).
    pub api: ApiConfig,
    /// The jobs.
    #[serde(deserialize_with = "jobs::de_jobs")]
    pub jobs: Vec<JobConfig>,
    /// Rate limits several jobs share by name (`jobs[].rate_limit = "<name>"`).
    #[serde(deserialize_with = "limits::de_limits")]
    pub limits: Vec<NamedLimit>,
    /// Circuit breakers several jobs share by name (`jobs[].circuit = "<name>"`).
    #[serde(deserialize_with = "circuits::de_circuits")]
    pub circuits: Vec<NamedCircuit>,
    /// Business calendars jobs follow by name (`jobs[].calendar = "<name>"`).
    pub calendars: Vec<CalendarConfig>,
    /// The calendars read and checked (their `.ics` files included) when the config was
    /// validated.
    #[serde(skip)]
    pub resolved_calendars: BTreeMap<String, ResolvedCalendar>,
    /// Queues known only from the workers' catalog (never read from the file): they join
    /// [`Config::all_queues`] for the operator tools (see `crate::catalog`).
    #[serde(skip)]
    pub catalog_queues: Vec<String>,
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
            log: LogConfig::default(),
            telemetry: TelemetryConfig::default(),
            producer: ProducerConfig::default(),
            api: ApiConfig::default(),
            jobs: Vec::new(),
            limits: Vec::new(),
            circuits: Vec::new(),
            calendars: Vec::new(),
            resolved_calendars: BTreeMap::new(),
            catalog_queues: Vec::new(),
        }
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
            "is a TLS URL, but this build has no TLS (chime-shared's `tls` feature, on by default); \
             chime never falls back to plaintext",
        ));
    }
    Ok(())
}

/// `[<section>.tls]` is only valid with a TLS URL, and its files must be readable PEM.
fn check_tls(section: &str, tls_url: bool, tls: &TlsConfig, scheme: &str) -> Result<(), ConfigError> {
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

/// `host:port` → (host, port); `[v6]:port` gives the address without brackets. A user
/// (`user:password@host:port`) or a path is not a host.
pub fn host_port(s: &str) -> Option<(String, u16)> {
    if s.contains(['@', '/']) {
        return None;
    }
    let (host, port) = s.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    (!host.is_empty() && port != 0).then(|| (host.trim_matches(['[', ']']).to_string(), port))
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
    let line = text[start..end].split('#').next().unwrap_or("").trim();
    // A table's header (`[jobs]`, `[[amqp]]`): the table's name.
    if let Some(name) = line.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        let list = name.starts_with('[');
        let name = name.trim_start_matches('[').trim_end_matches(']').trim();
        if !bare(name) {
            return None;
        }
        // An entry of a list: its index, from the entries above it.
        let header = format!("[[{name}]]");
        return Some(if list {
            let n =
                text[..start].lines().filter(|l| l.split('#').next().unwrap_or("").trim() == header).count();
            format!("{name}[{n}]")
        } else {
            name.to_string()
        });
    }
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

/// A TOML error in `text`, in one line: the key and position at fault, then toml's message
/// (without the source line toml would quote, which may hold a password; any URL redacted).
pub fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let at = e.span().map(|span| {
        let before = &text[..span.start.min(text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
        match key_at(text, span.start) {
            Some(key) => format!("{key} (line {line}, column {column}): "),
            None => format!("line {line}, column {column}: "),
        }
    });
    let message = plain_types(e.message().trim_end(), "a table");
    // A list written as one table, or a table as a list: say which brackets.
    let on_list_header = e.span().is_some_and(|span| {
        let start = text[..span.start.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
        text[start..].trim_start().starts_with("[[")
    });
    let about_fields = ["missing field", "unknown field", "duplicate"].iter().any(|m| message.contains(m));
    let hint = match message.as_str() {
        "invalid type: map, expected a sequence" => {
            " (a list of tables is written [[name]], each entry with its own [[name]])"
        }
        _ if on_list_header && !about_fields => " (one table is written [name]: [[name]] makes a list)",
        _ => "",
    };
    crate::redact::escape_control(&format!("{}{}{hint}", at.unwrap_or_default(), redact_text(&message)))
        .into_owned()
}

/// `message` with serde's `expected struct Name` (a Rust type's name, which says nothing to a
/// user) as `expected <noun>` (`a table` in TOML, `an object` in JSON).
pub fn plain_types(message: &str, noun: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(i) = rest.find("expected struct ") {
        out.push_str(&rest[..i]);
        out.push_str("expected ");
        out.push_str(noun);
        rest = &rest[i + "expected struct ".len()..];
        rest = rest.trim_start_matches(|c: char| c.is_ascii_alphanumeric() || c == '_');
    }
    out.push_str(rest);
    out
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
        toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: origin.to_string(), message: toml_error(text, &e) })
    }

    /// Parses and validates TOML text, applying no environment overrides (tests, embedding).
    pub fn from_toml_str(text: &str) -> Result<ValidConfig, ConfigError> {
        Self::parse(text, "<config>")?.validated()
    }

    /// This config, checked: the form every entry point takes. Built in code, a config is
    /// checked by the same rules as one read from a file.
    pub fn validated(mut self) -> Result<ValidConfig, ConfigError> {
        self.resolved_calendars = self.check()?;
        Ok(ValidConfig(std::sync::Arc::new(self)))
    }

    /// The schedule of `job` (an entry of this config), on its calendar if it follows one;
    /// `None` for a job without a schedule.
    pub fn schedule_of(&self, job: &JobConfig) -> Result<Option<crate::schedule::Schedule>, ConfigError> {
        let fresh;
        let calendars = if self.resolved_calendars.len() == self.calendars.len() {
            &self.resolved_calendars
        } else {
            // Not validated yet: read the calendars now.
            fresh = calendars::resolve(&self.calendars)?;
            &fresh
        };
        calendars::schedule_of(job, calendars).map_err(|(field, e)| {
            let at =
                self.jobs.iter().position(|j| j.name == job.name).map_or(String::new(), |i| format!("[{i}]"));
            ConfigError::invalid(format!("jobs{at} ({}).{field}", job.name), e)
        })
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
        self.check().map(|_| ())
    }

    /// [`Config::validate`], giving the calendars it read.
    fn check(&self) -> Result<BTreeMap<String, ResolvedCalendar>, ConfigError> {
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
        // Its names would be the delay chain's (`chime-delay.deliver`, `chime-delay.orphans`),
        // and tools that act on a prefix's resources would act on every prefix's delays.
        if self.prefix == chime_protocol::names::DELAY_PREFIX {
            return Err(ConfigError::invalid(
                "prefix",
                format!(
                    "{:?} is reserved: it names the delay chain every prefix shares ({}.*)",
                    self.prefix,
                    chime_protocol::names::DELAY_PREFIX
                ),
            ));
        }
        self.history.validate()?;
        self.results.validate()?;
        self.checkpoints.validate()?;
        self.log.validate()?;
        self.producer.validate()?;
        self.api.validate()?;
        self.telemetry.validate()?;
        self.amqp.validate()?;
        self.redis.validate()?;
        self.alerts.validate()?;
        self.worker.validate()?;
        self.ticker.validate()?;
        if let Some(q) = self.catalog_queues.iter().find(|q| !valid_name(q)) {
            return Err(ConfigError::invalid("catalog", format!("queue {q:?} is not a valid name")));
        }
        let mut names = BTreeSet::new();
        for (i, job) in self.jobs.iter().enumerate() {
            job.validate(i)?;
            if !names.insert(job.name.as_str()) {
                return Err(ConfigError::invalid(
                    format!("jobs[{i}] ({}).name", job.name),
                    "duplicate job name",
                ));
            }
        }
        limits::validate(&self.limits, &self.jobs)?;
        circuits::validate(&self.circuits, &self.jobs)?;
        let calendars = calendars::resolve(&self.calendars)?;
        calendars::validate(&calendars, &self.jobs)?;
        workflows::validate(&self.jobs)?;
        let queues = self.all_queues();
        for q in self.worker.shed.keys() {
            if !queues.contains(q) {
                return Err(ConfigError::invalid(
                    format!("worker.shed.{q}"),
                    format!(
                        "{q:?} is not a queue of this config (queues: {}; a queue only Rust code names goes in worker.queues)",
                        queues.join(", ")
                    ),
                ));
            }
        }
        for (i, job) in self.jobs.iter().enumerate() {
            if let Some(after) = job.promote_after {
                let at = format!("jobs[{i}] ({}).promote_after", job.name);
                if !(Duration::from_secs(1)..=Duration::from_secs(86_400)).contains(&after) {
                    return Err(ConfigError::invalid(
                        at,
                        "must be between 1s and 1d (it counts whole seconds)",
                    ));
                }
                if self.levels(job.queue()).len() < 2 {
                    return Err(ConfigError::invalid(
                        at,
                        format!(
                            "queue {:?} has no priority levels to promote through (set priority on one of its jobs)",
                            job.queue()
                        ),
                    ));
                }
            }
            if job.criticality == Criticality::Sheddable && !self.worker.shed.contains_key(job.queue()) {
                return Err(ConfigError::invalid(
                    format!("jobs[{i}] ({}).criticality", job.name),
                    format!(
                        "\"sheddable\" needs a threshold for its queue: [worker.shed.{}] with max_depth or max_age",
                        job.queue()
                    ),
                ));
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
                    "must exceed the longest job timeout ({}, {job}) plus worker.cancel_grace and redis.lease ({} in all)",
                    duration::format(longest),
                    duration::format(floor)
                ),
            ));
        }
        Ok(calendars)
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

    /// Every queue any job or worker refers to (what gets declared), and those the workers'
    /// catalog adds.
    pub fn all_queues(&self) -> Vec<String> {
        let mut set: BTreeSet<String> = self.jobs.iter().map(|j| j.queue().to_string()).collect();
        set.extend(self.worker.queues.iter().cloned());
        set.extend(self.catalog_queues.iter().cloned());
        set.insert(DEFAULT_QUEUE.to_string());
        set.into_iter().collect()
    }

    /// Whether `queue` is one of [`Self::all_queues`] (without building the list).
    pub fn declares_queue(&self, queue: &str) -> bool {
        queue == DEFAULT_QUEUE
            || self.jobs.iter().any(|j| j.queue() == queue)
            || self.worker.queues.iter().any(|q| q == queue)
            || self.catalog_queues.iter().any(|q| q == queue)
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

/// A setting that names a shared entry or is a table of its own (`rate_limit = "stripe"` or
/// `rate_limit = { … }`; the same for `circuit`).
enum NameOrTable {
    /// A string.
    Name(String),
    /// A table, to be read again as the table it must be.
    Table(toml::Table),
}

impl NameOrTable {
    /// Reads a string or a table; anything else is an error saying what was `expected`.
    fn deserialize<'de, D: serde::Deserializer<'de>>(d: D, expected: &'static str) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            S(String),
            T(toml::Table),
        }
        match Raw::deserialize(d).map_err(|_| serde::de::Error::custom(expected))? {
            Raw::S(s) => Ok(NameOrTable::Name(s)),
            Raw::T(t) => Ok(NameOrTable::Table(t)),
        }
    }

    /// `table` read again as a `Raw` (so an unknown key is named), then made a value by `into`.
    fn read<Raw: serde::de::DeserializeOwned, T>(
        table: toml::Table,
        into: impl FnOnce(Raw) -> Result<T, String>,
    ) -> Result<T, String> {
        Raw::deserialize(toml::Value::Table(table)).map_err(|e| one_line(&e.to_string())).and_then(into)
    }
}

/// A table's error as one line, the field it names first: toml writes `message\nin `field``
/// (`on_open: unknown variant `drop`, expected `park` or `dead_letter``).
fn one_line(message: &str) -> String {
    let message = message.trim_end();
    match message.rsplit_once("\nin `") {
        Some((what, field)) => format!("{}: {what}", field.trim_end_matches('`')),
        None => message.replace('\n', " "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error of a config that must be refused.
    pub(super) fn err(text: &str) -> String {
        match Config::from_toml_str(text) {
            Ok(_) => panic!("config unexpectedly valid:\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn queue_and_attempts_over_are_those_of_over() {
        let entry = |extra: &str| {
            let text = format!("[[jobs]]\nname = \"j\"\nhandler = \"noop\"\n{extra}\n");
            Config::from_toml_str(&text).unwrap().job("j").cloned().unwrap()
        };
        let own = [
            None,
            Some(chime_job::JobOptions::default()),
            Some(chime_job::JobOptions::default().queue("mine").max_attempts(7)),
        ];
        for e in [entry(""), entry("queue = \"theirs\"\nmax_attempts = 2"), entry("max_attempts = 3")] {
            for o in &own {
                let over = e.over(&o.clone().unwrap_or_default());
                assert_eq!(
                    e.queue_and_attempts_over(o.as_ref()),
                    (over.queue_name(), over.attempts()),
                    "{o:?}"
                );
            }
        }
    }

    #[test]
    fn promote_after_needs_levels_and_whole_seconds() {
        let job = |extra: &str| format!("[[jobs]]\nname = \"bulk\"\nhandler = \"noop\"\n{extra}\n");
        let ok = Config::from_toml_str(&job("priority = \"low\"\npromote_after = \"30s\"")).unwrap();
        assert_eq!(ok.job("bulk").and_then(|j| j.promote_after), Some(Duration::from_secs(30)));
        for (text, says) in [
            (
                job("promote_after = \"30s\""),
                "jobs[0] (bulk).promote_after: queue \"default\" has no priority levels",
            ),
            (job("priority = \"low\"\npromote_after = \"500ms\""), "between 1s and 1d"),
            (job("priority = \"low\"\npromote_after = \"2d\""), "between 1s and 1d"),
            (job("priority = \"low\"\npromote_after = 30"), "promote_after"),
        ] {
            let e = err(&text);
            assert!(e.contains(says), "{text}\n→ {e}");
        }
    }

    #[test]
    fn pack_applies_to_sharded_jobs_and_is_refused_by_name_elsewhere() {
        let job = |extra: &str| format!("[[jobs]]\nname = \"split\"\nhandler = \"noop\"\n{extra}\n");
        let ok = Config::from_toml_str(&job("shards = 500\npack = 100")).unwrap();
        assert_eq!(ok.job("split").and_then(|j| j.pack), Some(100));
        for (text, says) in [
            (job("pack = 10"), "jobs[0] (split).pack: packs a sharded job's members; set `shards`"),
            (job("broadcast = true\npack = 10"), "jobs[0] (split).pack: a broadcast job's copies"),
            (job("shards = 5\npack = 1"), "jobs[0] (split).pack: 1: must be between 2 and 1000"),
            (job("shards = 5\npack = 1001"), "jobs[0] (split).pack: 1001: must be between 2 and 1000"),
            (job("shards = 5\npack = \"10\""), "pack"),
        ] {
            let e = err(&text);
            assert!(e.contains(says), "{text}\n→ {e}");
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
    fn listen_addresses_worker_queues_and_the_spool_directory_are_checked_by_name() {
        for (text, says) in [
            (
                "[ticker]\nlisten = \"1.2.3.4\"\n",
                "ticker.listen: \"1.2.3.4\" has no port (expected HOST:PORT",
            ),
            ("[worker]\nlisten = \":9090\"\n", "worker.listen: \":9090\": no host before the port"),
            ("[worker]\nlisten = \"::1:9090\"\n", "worker.listen: \"::1:9090\": no host before the port"),
            ("[worker]\nlisten = \"localhost:99999\"\n", "port \"99999\" is not 0 to 65535"),
            // A password in a listen address or a node list is never echoed (a fuzz case once
            // showed the port part of `amqp://u:PW@h/` quoted whole).
            (
                "[worker]\nlisten = \"amqp://u:Sup3rSecretPw@h/\"\n",
                "worker.listen: \"amqp://u:***@h/\" is a URL or names a user",
            ),
            ("[ticker]\nlisten = \"u:Sup3rSecretPw@h:9090\"\n", "ticker.listen: \"u:***@h:9090\" is a URL"),
            (
                "[redis]\nsentinels = [\"u:Sup3rSecretPw@h:26379\"]\nmaster_name = \"m\"\n",
                "redis.sentinels[0]: \"u:***@h:26379\" is not host:port",
            ),
            (
                "[redis]\ncluster = [\"u:Sup3rSecretPw@h\"]\n",
                "redis.cluster[0]: \"u:***@h\" is not host:port",
            ),
            (
                "[worker]\nqueues = [\"a\", \"b\", \"a\"]\n",
                "worker.queues[2]: \"a\" is given twice (also worker.queues[0])",
            ),
        ] {
            let e = err(text);
            assert!(e.contains(says), "{text}: {e}");
            assert!(!e.contains("Sup3rSecretPw"), "{text}: {e}");
        }
        // A spool directory that is a file could never take a job.
        let file = std::env::temp_dir().join(format!("chime-spool-file-{}", std::process::id()));
        std::fs::write(&file, "").unwrap();
        let e = err(&format!("[producer]\nspool_dir = {:?}\n", file.display().to_string()));
        let _ = std::fs::remove_file(&file);
        assert!(e.contains(&format!("producer.spool_dir: {} is not a directory", file.display())), "{e}");
        let e = err("[producer]\nspool_dir = \"\"\n");
        assert!(e.contains("producer.spool_dir: is empty"), "{e}");
        for ok in ["127.0.0.1:9090", "0.0.0.0:0", "[::1]:9090", "localhost:9090", "metrics.internal:80"] {
            assert_eq!(check_listen(ok), Ok(()), "{ok}");
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
        // Nor take the shared delay chain's names.
        let e = err("prefix = \"chime-delay\"\n");
        assert!(e.contains("prefix: \"chime-delay\" is reserved: it names the delay chain"), "{e}");
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
                pass_env: vec![],
                rate_limited_exit_codes: vec![]
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
        assert!(
            err("[amqp]\nmax_message_bytes = 1073741824\n")
                .contains("amqp.max_message_bytes: 1073741824: RabbitMQ")
        );
        assert!(Config::from_toml_str("[amqp]\nmax_message_bytes = 536870912\n").is_ok());
        assert!(err("[amqp]\nquorum_replicas = 0\n").contains("amqp.quorum_replicas"));
        assert!(
            err("[amqp]\nqueue_type = \"classic\"\nquorum_replicas = 3\n").contains("amqp.quorum_replicas")
        );
        assert!(err("[worker]\nthreads = 5000\n").contains("worker.threads"));
        // A URL that cannot connect anywhere is refused here, saying why, its password hidden.
        for (toml, says) in [
            (
                "[redis]\nurl = \"redis://h:99999\"\n",
                "redis.url: \"redis://h:99999\" does not parse (invalid port number)",
            ),
            ("[redis]\nurl = \"redis://:6379\"\n", "(empty host)"),
            ("[redis]\nurl = \"redis://h/abc\"\n", "(Invalid database number)"),
            (
                "[redis]\nurl = \"redis://u:secretpw@[::1\"\n",
                "\"redis://u:***@[::1\" does not parse (invalid IPv6 address)",
            ),
            (
                "[amqp]\nurl = \"amqp://h:99999/%2f\"\n",
                "amqp.url: \"amqp://h:99999/%2f\" does not parse (invalid port number)",
            ),
            (
                "[amqp]\nurl = [\"amqp://a/%2f\", \"amqp://u:secretpw@[::1\"]\n",
                "\"amqp://u:***@[::1\" does not parse",
            ),
        ] {
            let e = err(toml);
            assert!(e.contains(says) && !e.contains("secretpw"), "{toml}: {e}");
        }
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
        // An error on a table's header names the table (a list's entry by its index), and one
        // written with the wrong brackets says which; no Rust type's name reaches the user.
        for (text, says) in [
            (
                "[[jobs]]\nname='a'\nhandler='noop'\n[[jobs]]\nhandler='noop'\n",
                "jobs[1] (line 4, column 1): missing field `name`",
            ),
            (
                "[jobs]\nname='a'\n",
                "jobs (line 1, column 1): invalid type: map, expected a sequence (a list of tables is written [[name]]",
            ),
            (
                "[[amqp]]\nurl='amqp://h'\n",
                "amqp[0] (line 1, column 1): a URL (\"amqp://host/%2f\") or a list of URLs (one table is written [name]",
            ),
            ("[amqp]\nurl = 5\n", "amqp.url (line 2, column 7): a URL"),
            ("amqp = 5\n", "expected a table"),
        ] {
            let e = err(text);
            assert!(e.contains(says) && !e.contains("struct ") && !e.contains("untagged"), "{text}: {e}");
        }
        assert_eq!(
            plain_types("invalid type: integer `1`, expected struct StepRequest at 3", "a table"),
            "invalid type: integer `1`, expected a table at 3"
        );
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
