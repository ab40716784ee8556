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
