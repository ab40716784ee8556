//! `EnqueueClient`: validated, confirmed publishing of ad-hoc jobs.
//!
//! A job is enqueued only when the broker confirmed it and did not return it: an unroutable
//! message is an error, never a silent drop. Validation (unknown job, bad queue, oversized
//! envelope) happens before anything is published, so a bad batch publishes nothing.

use chime_shared::amqp::{self, AmqpError};
use chime_shared::config::{Config, valid_name};
use chime_shared::delay;
use chime_shared::envelope::{self, Envelope, Source};
use chime_shared::telemetry;
use chime_shared::topology::{self, Names, TopologyError};
use chrono::{DateTime, Utc};
use lapin::options::ConfirmSelectOptions;
use lapin::{Channel, Connection};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// One ad-hoc job to push.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnqueueRequest {
    #[serde(skip)]
    pub job: String,
    /// JSON payload; `None` uses the job's configured `payload` (or `null`).
    #[serde(default)]
    pub payload: Option<serde_json::Value>,
    /// Caller's idempotency key: the same key for the same job runs once.
    #[serde(default)]
    pub key: Option<String>,
    /// Overrides the job's queue.
    #[serde(default)]
    pub queue: Option<String>,
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Deliver after this long (1 s granularity, rounded up).
    #[serde(skip)]
    pub delay: Option<Duration>,
    /// Deliver at this instant (a past instant means now).
    #[serde(skip)]
    pub at: Option<DateTime<Utc>>,
}

impl EnqueueRequest {
    pub fn new(job: impl Into<String>) -> Self {
        Self { job: job.into(), ..Default::default() }
    }
    pub fn payload(mut self, payload: serde_json::Value) -> Self {
        self.payload = Some(payload);
        self
    }
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }
    pub fn at(mut self, at: DateTime<Utc>) -> Self {
        self.at = Some(at);
        self
    }
}

/// An envelope ready to publish, with its delivery delay.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub envelope: Envelope,
    pub delay: Duration,
    /// A queue the config does not declare (an explicit `--queue`): it must exist on the
    /// broker before anything is published (`EnqueueClient` checks with a passive declare).
    pub unverified_queue: Option<String>,
}

/// A confirmed job.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Enqueued {
    pub id: Uuid,
    pub key: Uuid,
    pub job: String,
    pub queue: String,
}

/// Result of a batch: how many were confirmed, and the first failure if any.
#[derive(Debug)]
pub struct BatchReport {
    pub total: usize,
    pub confirmed: usize,
    pub error: Option<EnqueueError>,
}

#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error("unknown job {0:?} (not in the config's [[jobs]])")]
    UnknownJob(String),
    #[error(
        "queue {queue:?} is neither declared by this config nor present on the broker ({detail}): \
         a job published to it could never be delivered"
    )]
    NoSuchQueue { queue: String, detail: String },
    #[error("invalid {field}: {message}")]
    Invalid { field: String, message: String },
    #[error("envelope of job {job} is {size} bytes, above amqp.max_message_bytes ({max})")]
    TooLarge { job: String, size: usize, max: usize },
    #[error(transparent)]
    Topology(#[from] Box<TopologyError>),
    #[error(transparent)]
    Amqp(#[from] Box<AmqpError>),
}

impl From<AmqpError> for EnqueueError {
    fn from(e: AmqpError) -> Self {
        Self::Amqp(Box::new(e))
    }
}

impl From<TopologyError> for EnqueueError {
    fn from(e: TopologyError) -> Self {
        Self::Topology(Box::new(e))
    }
}

impl EnqueueError {
    /// Errors in what the caller asked for (exit code 2), as opposed to run-time failures.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            Self::UnknownJob(_) | Self::Invalid { .. } | Self::TooLarge { .. } | Self::NoSuchQueue { .. }
        )
    }
}

/// Publishes ad-hoc jobs with confirms. Holds one connection and one confirm channel.
pub struct EnqueueClient {
    _conn: Connection,
    channel: Channel,
    config: Arc<Config>,
    names: Names,
}

/// Outstanding confirms in a pipelined batch.
const BATCH_WINDOW: usize = 4096;

impl EnqueueClient {
    /// Connects, declares the topology of every configured queue, and enables confirms.
    pub async fn connect(config: Arc<Config>) -> Result<Self, EnqueueError> {
        let conn = amqp::connect(&config.amqp, "chime-enqueue").await?;
        topology::declare(&conn, &config, &config.all_queues()).await?;
        let channel = conn
            .create_channel()
            .await
            .map_err(|e| AmqpError::Connect { urls: "channel".into(), last: e.to_string() })?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| AmqpError::Connect { urls: "confirm.select".into(), last: e.to_string() })?;
        let names = Names::new(&config.prefix);
        Ok(Self { _conn: conn, channel, config, names })
    }

    /// Builds and validates the envelope for `req` without publishing.
    pub fn prepare(&self, req: &EnqueueRequest) -> Result<Prepared, EnqueueError> {
        prepare(&self.config, req)
    }

    /// Publishes one job and waits for its confirm.
    pub async fn enqueue(&self, req: EnqueueRequest) -> Result<Enqueued, EnqueueError> {
        let p = self.prepare(&req)?;
        if let Some(q) = &p.unverified_queue {
            self.verify_queue(q).await?;
        }
        self.publish(&p.envelope, p.delay).await?;
        Ok(enqueued(&p.envelope))
    }

    /// A queue the config does not declare must exist as a chime work queue on the broker
    /// (declared by another config's workers); otherwise nothing could ever deliver to it.
    pub async fn verify_queue(&self, queue: &str) -> Result<(), EnqueueError> {
        topology::depth(&self._conn, &self.names.work_queue(queue))
            .await
            .map(drop)
            .map_err(|e| EnqueueError::NoSuchQueue { queue: queue.to_string(), detail: e.to_string() })
    }

    /// Publishes an envelope for delivery after `delay` and waits for its confirm.
    pub async fn publish(&self, env: &Envelope, delay: Duration) -> Result<(), EnqueueError> {
        let (exchange, routing_key) =
            delay::target(&self.names, self.config.amqp.queue_type, &env.queue, delay);
        amqp::publish_confirmed(
            &self.channel,
            &exchange,
            &routing_key,
            &env.encode(),
            env.properties(),
            self.config.amqp.publish_timeout,
        )
        .await?;
        metrics::counter!(telemetry::JOBS_PUBLISHED, "job" => env.job.clone(), "source" => env.source.as_str())
            .increment(1);
        Ok(())
    }

    /// Validates every request first (nothing is published if one is invalid), then
    /// publishes with up to 4096 confirms outstanding, stopping at the first failure.
    pub async fn enqueue_batch(&self, reqs: &[EnqueueRequest]) -> Result<BatchReport, EnqueueError> {
        let envs = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                self.prepare(r).map_err(|e| match e {
                    EnqueueError::Invalid { field, message } => {
                        EnqueueError::Invalid { field: format!("line {}: {field}", i + 1), message }
                    }
                    EnqueueError::UnknownJob(j) => EnqueueError::Invalid {
                        field: format!("line {}: job", i + 1),
                        message: format!("unknown job {j:?}"),
                    },
                    other => other,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Queues no line's config declares are checked once each, before anything is sent.
        let mut checked = std::collections::HashSet::new();
        for (i, p) in envs.iter().enumerate() {
            if let Some(q) = &p.unverified_queue
                && checked.insert(q.clone())
            {
                self.verify_queue(q).await.map_err(|e| EnqueueError::Invalid {
                    field: format!("line {}: queue", i + 1),
                    message: e.to_string(),
                })?;
            }
        }
        Ok(self.publish_batch(&envs).await)
    }

    /// Pipelined publish of prepared envelopes.
    pub async fn publish_batch(&self, envs: &[Prepared]) -> BatchReport {
        let timeout = self.config.amqp.publish_timeout;
        let mut pending: VecDeque<(lapin::PublisherConfirm, String, String)> =
            VecDeque::with_capacity(BATCH_WINDOW);
        let mut confirmed = 0usize;
        let mut error = None;
        for Prepared { envelope: env, delay, .. } in envs {
            if pending.len() >= BATCH_WINDOW
                && let Some((p, exchange, rk)) = pending.pop_front()
            {
                match amqp::check_confirm(p, &exchange, &rk, timeout).await {
                    Ok(()) => confirmed += 1,
                    Err(e) => {
                        error = Some(e.into());
                        break;
                    }
                }
            }
            let (exchange, rk) = delay::target(&self.names, self.config.amqp.queue_type, &env.queue, *delay);
            match amqp::publish(&self.channel, &exchange, &rk, &env.encode(), env.properties()).await {
                Ok(p) => pending.push_back((p, exchange, rk)),
                Err(e) => {
                    error = Some(e.into());
                    break;
                }
            }
        }
        for (p, exchange, rk) in pending {
            match amqp::check_confirm(p, &exchange, &rk, timeout).await {
                Ok(()) => confirmed += 1,
                Err(e) => {
                    error.get_or_insert(e.into());
                }
            }
        }
        if let Some(first) = envs.first() {
            metrics::counter!(telemetry::JOBS_PUBLISHED, "job" => first.envelope.job.clone(), "source" => "adhoc")
                .increment(confirmed as u64);
        }
        BatchReport { total: envs.len(), confirmed, error }
    }
}

/// Builds the envelope of `req` under `config`: the job must exist, the queue name and the
/// attempt count must be valid, and the envelope must fit `amqp.max_message_bytes`.
pub fn prepare(config: &Config, req: &EnqueueRequest) -> Result<Prepared, EnqueueError> {
    let job = config.job(&req.job).ok_or_else(|| EnqueueError::UnknownJob(req.job.clone()))?;
    let queue = req.queue.as_deref().unwrap_or(job.queue());
    if !valid_name(queue) {
        return Err(EnqueueError::Invalid {
            field: "queue".into(),
            message: format!("{queue:?} must be 1-100 letters, digits, '-', '_' or '.'"),
        });
    }
    let max_attempts = req.max_attempts.unwrap_or(job.max_attempts());
    if max_attempts == 0 || max_attempts > envelope::MAX_ATTEMPTS {
        return Err(EnqueueError::Invalid {
            field: "max_attempts".into(),
            message: format!("must be between 1 and {}", envelope::MAX_ATTEMPTS),
        });
    }
    let key = match &req.key {
        Some(k) if k.is_empty() => {
            return Err(EnqueueError::Invalid { field: "key".into(), message: "must not be empty".into() });
        }
        Some(k) => envelope::adhoc_key(&job.name, k),
        None => envelope::random_key(),
    };
    let delay = match (req.delay, req.at) {
        (Some(_), Some(_)) => {
            return Err(EnqueueError::Invalid {
                field: "delay".into(),
                message: "give a delay or a time, not both".into(),
            });
        }
        (Some(d), None) => d,
        // A time in the past means "now".
        (None, Some(at)) => (at - Utc::now()).to_std().unwrap_or(Duration::ZERO),
        (None, None) => Duration::ZERO,
    };
    if delay > delay::MAX_DELAY {
        return Err(EnqueueError::Invalid {
            field: if req.at.is_some() { "at".into() } else { "delay".into() },
            message: format!(
                "{} is beyond the longest delay chime can hold ({})",
                chime_shared::duration::format(delay),
                chime_shared::duration::format(delay::MAX_DELAY)
            ),
        });
    }
    let payload = req.payload.clone().or_else(|| job.payload.clone()).unwrap_or(serde_json::Value::Null);
    let env = Envelope::new(&job.name, queue, key, payload, None, max_attempts, Source::Adhoc);
    let size = env.encode().len();
    if size > config.amqp.max_message_bytes {
        return Err(EnqueueError::TooLarge {
            job: job.name.clone(),
            size,
            max: config.amqp.max_message_bytes,
        });
    }
    let unverified_queue = (!config.all_queues().iter().any(|q| q == queue)).then(|| queue.to_string());
    Ok(Prepared { envelope: env, delay, unverified_queue })
}

fn enqueued(env: &Envelope) -> Enqueued {
    Enqueued { id: env.id, key: env.key, job: env.job.clone(), queue: env.queue.clone() }
}

/// Parses one line of `--batch` input: `{"payload": …, "key": …, "queue": …,
/// "max_attempts": …}` (an object with a `payload` field), or a bare payload.
pub fn parse_batch_line(job: &str, line: &str) -> Result<EnqueueRequest, String> {
    let value: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("invalid JSON: {e}"))?;
    let mut req = match &value {
        serde_json::Value::Object(m) if m.contains_key("payload") => {
            serde_json::from_value::<EnqueueRequest>(value).map_err(|e| e.to_string())?
        }
        _ => EnqueueRequest { payload: Some(value), ..Default::default() },
    };
    req.job = job.to_string();
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_lines() {
        let r = parse_batch_line("j", r#"{"payload":{"a":1},"key":"k1"}"#).unwrap();
        assert_eq!(r.key.as_deref(), Some("k1"));
        assert_eq!(r.payload, Some(serde_json::json!({"a":1})));
        let r = parse_batch_line("j", r#"{"a":1}"#).unwrap();
        assert_eq!(r.payload, Some(serde_json::json!({"a":1})));
        assert!(parse_batch_line("j", r#"{"payload":1,"colour":2}"#).unwrap_err().contains("colour"));
        assert!(parse_batch_line("j", "{nope").is_err());
    }

    #[test]
    fn prepare_validates() {
        let c =
            Config::from_toml_str("[amqp]\nmax_message_bytes = 2048\n[[jobs]]\nname='j'\nhandler='noop'\n")
                .unwrap();
        assert!(matches!(prepare(&c, &EnqueueRequest::new("x")), Err(EnqueueError::UnknownJob(_))));
        let big = serde_json::Value::String("x".repeat(4096));
        assert!(matches!(
            prepare(&c, &EnqueueRequest::new("j").payload(big)),
            Err(EnqueueError::TooLarge { .. })
        ));
        let a = prepare(&c, &EnqueueRequest::new("j").key("k")).unwrap().envelope;
        let b = prepare(&c, &EnqueueRequest::new("j").key("k")).unwrap().envelope;
        assert_eq!(a.key, b.key);
        assert_ne!(a.id, b.id);
        assert!(prepare(&c, &EnqueueRequest::new("j").queue("bad queue")).is_err());
        let past =
            prepare(&c, &EnqueueRequest::new("j").at(Utc::now() - chrono::Duration::hours(1))).unwrap();
        assert_eq!(past.delay, Duration::ZERO);
        let year = prepare(&c, &EnqueueRequest::new("j").delay(Duration::from_secs(366 * 86_400))).unwrap();
        assert_eq!(year.delay.as_secs(), 366 * 86_400);
        let absurd = EnqueueRequest::new("j").at(Utc::now() + chrono::Duration::days(365 * 20));
        assert!(matches!(prepare(&c, &absurd), Err(EnqueueError::Invalid { field, .. }) if field == "at"));
    }
}
