//! `[producer]`: what a producer (`EnqueueClient`, `chime enqueue`) does when the broker
//! cannot confirm a job.

use super::*;

/// `[producer]`: the local spool (off unless `spool_dir` is set).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProducerConfig {
    /// Directory of the local spool: an enqueue the broker cannot confirm within
    /// `amqp.publish_timeout` is written here (with `fsync`) and published later, in order,
    /// under its own key. Unset (default): such an enqueue fails. Producers, `chime-worker` and
    /// `chime tick` that share the directory flush it. A relative path is taken from the
    /// working directory.
    pub spool_dir: Option<PathBuf>,
    /// Most bytes the spool directory holds (default 1 GiB): a job that does not fit is
    /// refused with an error, never dropped.
    pub spool_max_bytes: u64,
    /// How long the spool may hold a job before the alert `ChimeSpoolNotEmpty` fires
    /// (default `"5m"`).
    #[serde(deserialize_with = "duration::de")]
    pub spool_alert_after: Duration,
}

impl Default for ProducerConfig {
    fn default() -> Self {
        Self { spool_dir: None, spool_max_bytes: 1 << 30, spool_alert_after: Duration::from_secs(300) }
    }
}

impl ProducerConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.spool_dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
            return Err(ConfigError::invalid(
                "producer.spool_dir",
                "is empty (leave it out to turn the spool off)",
            ));
        }
        // A missing directory is made when a job is first spooled; a file in its place never
        // could be.
        if let Some(d) = &self.spool_dir
            && d.exists()
            && !d.is_dir()
        {
            return Err(ConfigError::invalid(
                "producer.spool_dir",
                format!("{} is not a directory", d.display()),
            ));
        }
        if self.spool_max_bytes < 65_536 {
            return Err(ConfigError::invalid(
                "producer.spool_max_bytes",
                format!(
                    "{}: must be at least 65536 (a spooled job takes up to amqp.max_message_bytes)",
                    self.spool_max_bytes
                ),
            ));
        }
        if self.spool_alert_after < Duration::from_secs(1) {
            return Err(ConfigError::invalid("producer.spool_alert_after", "must be at least 1s"));
        }
        Ok(())
    }
}

/// `[api]`: the HTTP enqueue API (`chime api`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// Largest request body accepted, in bytes (default 1 MiB); a larger one is answered
    /// `413`. The job's envelope is bounded by `amqp.max_message_bytes` as well.
    pub max_body_bytes: usize,
    /// Requests each token may make, per process (default `"100/s"`): a count, `/`, a period.
    /// Up to the count may come at once after a quiet spell; beyond, `429` with `Retry-After`.
    pub rate_limit: String,
    /// Tokens limited to some jobs, each read from an environment variable (the config holds
    /// no secret). `CHIME_API_TOKEN`, when set, is a token for every job.
    pub tokens: Vec<ApiToken>,
}

/// `[[api.tokens]]`: a bearer token and the jobs it may enqueue and inspect.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiToken {
    /// A name for logs and errors (`billing`).
    pub name: String,
    /// The environment variable holding the token (`CHIME_API_TOKEN_BILLING`).
    pub env: String,
    /// The jobs it may enqueue and whose keys it may read; `["*"]` for every job.
    pub jobs: Vec<String>,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self { max_body_bytes: 1 << 20, rate_limit: "100/s".into(), tokens: Vec::new() }
    }
}

impl ApiConfig {
    /// The per-token request rate (validated: `rate_limit` parses).
    pub fn rate(&self) -> super::Rate {
        let mut rate = super::Rate::parse(&self.rate_limit).unwrap_or(super::Rate {
            limit: 100,
            per: Duration::from_secs(1),
            burst: 1,
        });
        rate.burst = rate.limit;
        rate
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !(1024..=64 << 20).contains(&self.max_body_bytes) {
            return Err(ConfigError::invalid(
                "api.max_body_bytes",
                format!("{}: must be 1024 to 67108864 (64 MiB)", self.max_body_bytes),
            ));
        }
        super::Rate::parse(&self.rate_limit).map_err(|e| ConfigError::invalid("api.rate_limit", e))?;
        let mut names = BTreeSet::new();
        for (i, t) in self.tokens.iter().enumerate() {
            let at = |field: &str| format!("api.tokens[{i}] ({}).{field}", t.name);
            if !valid_name(&t.name) {
                return Err(ConfigError::invalid(
                    format!("api.tokens[{i}].name"),
                    format!("{:?} must be letters, digits, '-' or '_'", t.name),
                ));
            }
            if !names.insert(t.name.as_str()) {
                return Err(ConfigError::invalid(at("name"), "duplicate token name"));
            }
            if t.env.is_empty()
                || !t.env.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            {
                return Err(ConfigError::invalid(
                    at("env"),
                    format!("{:?}: the name of an environment variable (A-Z, 0-9, '_')", t.env),
                ));
            }
            if t.jobs.is_empty() {
                return Err(ConfigError::invalid(
                    at("jobs"),
                    "is empty: list the jobs, or [\"*\"] for every job",
                ));
            }
            if let Some(j) = t.jobs.iter().find(|j| j.as_str() != "*" && !valid_name(j)) {
                return Err(ConfigError::invalid(at("jobs"), format!("{j:?} is not a job name")));
            }
        }
        Ok(())
    }
}
