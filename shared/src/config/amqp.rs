//! `[amqp]`: the broker, its URLs, queue type and limits, and their rules.

use super::*;

/// One URL or a list of URLs tried in turn (cluster nodes).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged, expecting = "a URL (\"amqp://host/%2f\") or a list of URLs")]
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
#[derive(Debug, Clone, PartialEq, Deserialize)]
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

impl AmqpConfig {
    /// URLs (one scheme for all, TLS settings only with `amqps://`), limits.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let urls = self.url.list();
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
            if let Err(e) = u.parse::<lapin::uri::AMQPUri>() {
                return Err(ConfigError::invalid(
                    "amqp.url",
                    format!(
                        "{:?} does not parse ({e}): expected amqp://host[:port][/vhost] (the vhost / is %2f), \
                         with user and password before the host",
                        redact(u)
                    ),
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
        check_tls("amqp", tls_urls != 0, &self.tls, "amqps://")?;
        if self.delivery_limit == 0 {
            return Err(ConfigError::invalid(
                "amqp.delivery_limit",
                "must be a positive number (0 and -1 dead-letter on the first requeue on RabbitMQ 3.10)",
            ));
        }
        match self.quorum_replicas {
            Some(0) => return Err(ConfigError::invalid("amqp.quorum_replicas", "must be at least 1")),
            Some(n) if n > 99 => {
                return Err(ConfigError::invalid("amqp.quorum_replicas", "must be at most 99"));
            }
            Some(_) if self.queue_type == QueueType::Classic => {
                return Err(ConfigError::invalid(
                    "amqp.quorum_replicas",
                    "applies to quorum queues only (queue_type = \"classic\")",
                ));
            }
            _ => {}
        }
        if self.heartbeat.as_secs() == 0 || self.heartbeat.as_secs() > 600 {
            return Err(ConfigError::invalid("amqp.heartbeat", "must be between 1s and 10m"));
        }
        if self.max_message_bytes < 1024 {
            return Err(ConfigError::invalid("amqp.max_message_bytes", "must be at least 1024"));
        }
        if self.max_message_bytes > 512 << 20 {
            return Err(ConfigError::invalid(
                "amqp.max_message_bytes",
                format!(
                    "{}: RabbitMQ takes no message above 512 MiB (536870912); its own default limit, \
                     max_message_size, is 128 MiB on 3.x and 16 MiB on 4.x",
                    self.max_message_bytes
                ),
            ));
        }
        Ok(())
    }
}
