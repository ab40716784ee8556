//! `[alerts]`, `[history]`, `[results]`, `[checkpoints]`: what chime watches and keeps, and their rules.

use super::*;

/// `[alerts]`: DLQ depth alerting.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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

/// `[telemetry]`: traces over OTLP.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Where to send spans, OTLP over HTTP with JSON bodies (`http://collector:4318`; the
    /// path `/v1/traces` is added unless the URL has a path). Unset (default): no spans are
    /// made or sent.
    pub otlp_endpoint: Option<String>,
}

impl TelemetryConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.otlp_endpoint {
            let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"));
            if rest.is_none_or(|r| r.is_empty() || r.starts_with('/') || r.contains(char::is_whitespace)) {
                return Err(ConfigError::invalid(
                    "telemetry.otlp_endpoint",
                    format!("{url:?}: an http:// or https:// URL is expected (\"http://collector:4318\")"),
                ));
            }
        }
        Ok(())
    }

    /// The URL spans are posted to: the endpoint, with `/v1/traces` when it has no path.
    pub fn traces_url(&self) -> Option<String> {
        let url = self.otlp_endpoint.as_deref()?.trim_end_matches('/');
        let after_scheme = url.split_once("://").map_or(url, |(_, r)| r);
        Some(if after_scheme.contains('/') { url.to_string() } else { format!("{url}/v1/traces") })
    }
}

/// `[log]`: what workers log.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// The share of keys whose successful runs are logged (0.0 to 1.0, default 1.0):
    /// failures, retries and dead letters are always logged; a success (and a park on the way
    /// to it) is logged for a key in the sample, chosen by the key, so every such line of a
    /// key is logged or none is. Metrics and history stay complete.
    pub success_sample: f64,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { success_sample: 1.0 }
    }
}

impl LogConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.success_sample) {
            return Err(ConfigError::invalid(
                "log.success_sample",
                format!("{}: must be between 0.0 (no successes logged) and 1.0 (all)", self.success_sample),
            ));
        }
        Ok(())
    }

    /// Whether the successful runs of `key` are logged (deterministic: by the key's low bits).
    pub fn logs_success(&self, key: &uuid::Uuid) -> bool {
        if self.success_sample >= 1.0 {
            return true;
        }
        // A UUID's last 7 bytes (hashed in v5 keys, random in v7 ones; the byte before them
        // holds the variant bits, always the same) as a fraction of their range.
        let low = (key.as_u128() as u64) & ((1 << 56) - 1);
        (low as f64 / (1u64 << 56) as f64) < self.success_sample
    }
}

/// `[history]`: one event per run in a Redis stream per queue, and a key's last runs in its
/// idempotency record.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Deserialize)]
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

impl AlertsConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.dlq_threshold == 0 {
            return Err(ConfigError::invalid("alerts.dlq_threshold", "must be at least 1"));
        }
        if self.interval < Duration::from_millis(100) {
            return Err(ConfigError::invalid("alerts.interval", "must be at least 100ms"));
        }
        if let Some(w) = &self.webhook
            && !(w.starts_with("http://") || w.starts_with("https://"))
        {
            return Err(ConfigError::invalid("alerts.webhook", "must be an http:// or https:// URL"));
        }
        Ok(())
    }
}

impl HistoryConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_len == 0 || self.max_age.is_zero() {
            return Err(ConfigError::invalid(
                "history",
                "max_len and max_age must be positive (set history.enabled = false to record nothing)",
            ));
        }
        if !(1..=100).contains(&self.runs_per_key) {
            return Err(ConfigError::invalid("history.runs_per_key", "must be between 1 and 100"));
        }
        Ok(())
    }
}

impl ResultsConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !(16..=1_048_576).contains(&self.max_bytes) {
            return Err(ConfigError::invalid("results.max_bytes", "must be between 16 and 1048576"));
        }
        if self.retention.is_some_and(|r| r.is_zero()) {
            return Err(ConfigError::invalid("results.retention", "must be positive"));
        }
        Ok(())
    }
}

impl CheckpointsConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !(16..=1_048_576).contains(&self.max_bytes) {
            return Err(ConfigError::invalid("checkpoints.max_bytes", "must be between 16 and 1048576"));
        }
        if self.poll < Duration::from_millis(50) || self.poll > Duration::from_secs(60) {
            return Err(ConfigError::invalid("checkpoints.poll", "must be between 50ms and 1m"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn successes_are_sampled_by_key_in_the_share_asked_for() {
        let keys: Vec<uuid::Uuid> =
            (0..10_000).map(|i| crate::envelope::adhoc_key("job", &i.to_string())).collect();
        for share in [0.0, 0.1, 0.5, 1.0] {
            let log = LogConfig { success_sample: share };
            let logged = keys.iter().filter(|k| log.logs_success(k)).count();
            let want = share * keys.len() as f64;
            assert!((logged as f64 - want).abs() <= 0.02 * keys.len() as f64, "{share}: {logged}");
            // By the key: the same answer every time.
            assert!(keys.iter().all(|k| log.logs_success(k) == log.logs_success(k)));
        }
        let bad = Config::from_toml_str("[log]\nsuccess_sample = 1.5\n").unwrap_err().to_string();
        assert!(bad.contains("log.success_sample"), "{bad}");
    }
}
