//! `[redis]`: the idempotency table, leases and ticker state, and their rules.

use super::*;

/// `[redis]`: the idempotency table, leases and ticker state.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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

impl RedisConfig {
    /// The URL's scheme (TLS settings only with `rediss://`, no `#insecure`), the topology
    /// (Sentinel or Cluster), the lease.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let scheme = self.url.split_once("://").map(|(s, _)| s).unwrap_or("");
        if !matches!(scheme, "redis" | "rediss" | "redis+unix" | "unix") {
            return Err(ConfigError::invalid(
                "redis.url",
                format!(
                    "{:?}: scheme {scheme:?} is not supported (use redis://, rediss:// or redis+unix://; for \
                     Sentinel set redis.sentinels and redis.master_name, for a cluster redis.cluster)",
                    redact(&self.url)
                ),
            ));
        }
        if let Err(e) = redis::IntoConnectionInfo::into_connection_info(self.url.as_str()) {
            // redis says "did not parse" alone; the URL parser says what is wrong.
            let why = match url::Url::parse(&self.url) {
                Err(u) => u.to_string(),
                Ok(_) => e.to_string().split(" - ").next().unwrap_or_default().to_string(),
            };
            return Err(ConfigError::invalid(
                "redis.url",
                format!(
                    "{:?} does not parse ({why}): expected redis://host[:port][/database], with user and \
                     password before the host if the server asks for them",
                    redact(&self.url)
                ),
            ));
        }
        no_tls_in_this_build("redis.url", scheme == "rediss")?;
        if self.url.contains("#insecure") {
            return Err(ConfigError::invalid(
                "redis.url",
                "#insecure would turn certificate checks off; chime does not allow it (set redis.tls.ca_file)",
            ));
        }
        check_tls("redis", scheme == "rediss", &self.tls, "rediss://")?;
        self.check_topology(scheme)?;
        if self.lease < Duration::from_secs(1) {
            return Err(ConfigError::invalid("redis.lease", "must be at least 1s"));
        }
        Ok(())
    }

    /// `redis.sentinels` / `redis.master_name` / `redis.cluster` fit together.
    fn check_topology(&self, scheme: &str) -> Result<(), ConfigError> {
        let r = self;
        for (key, list) in [("redis.sentinels", &r.sentinels), ("redis.cluster", &r.cluster)] {
            for (i, node) in list.iter().enumerate() {
                if host_port(node).is_none() {
                    return Err(ConfigError::invalid(
                        format!("{key}[{i}]"),
                        format!("{:?} is not host:port", redact(node)),
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
}
