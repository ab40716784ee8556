//! Dead-letter operations over AMQP alone (no management plugin).
//!
//! Every operation is one *pass* over a DLQ: take exactly as many messages as the queue
//! held when the pass began (`basic.get`, manual ack), and for each either
//! - keep it: publish an identical copy to the tail of the same DLQ, wait for the confirm,
//!   then ack the original (a full pass leaves the order unchanged);
//! - drop it (purge): ack it;
//! - replay it: make its key claimable again in Redis, publish a fresh envelope (attempt 1,
//!   `source = replay`) to the work queue, wait for the confirm, then ack the DLQ copy.
//!
//! Nothing is ever requeued, so quorum delivery counters never move (on RabbitMQ 4.0–4.2
//! each requeue counts toward the delivery limit). A crash between a publish and its ack
//! leaves a duplicate, never a loss. Passes over one DLQ never overlap: each holds the DLQ's
//! lock in Redis ([`lock`]), so a purge never misses a message a listing holds at that moment.
//! A pass reads with bounded memory ([`DeadLetter`], [`BodyKept`]): a listing keeps no bodies.

mod letter;
pub mod lock;

pub use letter::{BodyKept, DeadLetter};

use chime_shared::amqp::{self, AmqpError};
use chime_shared::config::ValidConfig;
use chime_shared::envelope::{Envelope, Source};
use chime_shared::idempotency::{IdemError, IdemStore};
use chime_shared::topology::{self, Names, TopologyError};
use chrono::{DateTime, Utc};
use lapin::options::{BasicAckOptions, BasicGetOptions, ConfirmSelectOptions};
use lapin::{Channel, Connection};
use std::time::Duration;
use uuid::Uuid;

/// The source name of the prefix's unroutable delayed messages (never a queue name: names
/// cannot hold parentheses).
pub const UNROUTABLE: &str = chime_shared::names::UNROUTABLE_SOURCE;

/// Which dead letters an operation applies to.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Exact ids (resolve prefixes first with [`DlqClient::resolve`]); empty = every id.
    pub ids: Vec<String>,
    /// Idempotency keys; empty = every key.
    pub keys: Vec<Uuid>,
    pub job: Option<String>,
    /// Only dead letters that failed at least this long ago.
    pub older_than: Option<Duration>,
}

/// Why ids given on the command line do not name dead letters one to one.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("{given:?} matches {} dead letters; give more of the id:\n{}", .matches.len(), .matches.join("\n"))]
    Ambiguous { given: String, matches: Vec<String> },
    #[error("no dead letter matches {0:?}")]
    NoMatch(String),
    #[error("{0:?} is too short: give a whole id or at least 8 characters")]
    TooShort(String),
}

impl Filter {
    pub fn matches(&self, d: &DeadLetter, now: DateTime<Utc>) -> bool {
        let id_ok = self.ids.is_empty() || self.ids.contains(&d.id);
        let key_ok = self.keys.is_empty() || d.key.is_some_and(|k| self.keys.contains(&k));
        let id_ok = id_ok && key_ok;
        let job_ok = self.job.as_ref().is_none_or(|j| d.job.as_deref() == Some(j.as_str()));
        let age_ok = self
            .older_than
            .is_none_or(|min| d.failed_at.is_some_and(|t| (now - t).to_std().is_ok_and(|age| age >= min)));
        id_ok && job_ok && age_ok
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    #[error(transparent)]
    Amqp(#[from] AmqpError),
    #[error("RabbitMQ: {0}")]
    Lapin(#[from] Box<lapin::Error>),
    #[error(transparent)]
    Topology(#[from] TopologyError),
    #[error("redis: {0}")]
    Redis(#[from] IdemError),
    #[error("unknown queue {0:?} (not in the config)")]
    UnknownQueue(String),
    #[error("another pass over the DLQ of {queue} is still running ({holder}); try again when it ends")]
    Busy { queue: String, holder: String },
    /// The lock that keeps two passes over one DLQ apart could not be taken (Redis failed).
    #[error("taking the DLQ's lock in Redis")]
    Lock(#[source] redis::RedisError),
}

impl From<lapin::Error> for DlqError {
    fn from(e: lapin::Error) -> Self {
        Self::Lapin(Box::new(e))
    }
}

/// What a listing found.
#[derive(Debug, Default, Clone)]
pub struct Listing {
    /// The first matching dead letters, in queue order, up to the limit.
    pub letters: Vec<DeadLetter>,
    /// Every match, kept or not.
    pub matched: usize,
    /// Dead letters the pass went over.
    pub seen: usize,
}

/// What a pass does with one dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Keep,
    Drop,
    Replay,
}

/// Counts of one pass.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct PassReport {
    pub seen: usize,
    pub kept: usize,
    pub dropped: usize,
    pub replayed: usize,
    /// Matched a replay but could not be replayed (not a valid envelope); kept.
    pub unreplayable: usize,
}

/// DLQ operations on one connection.
pub struct DlqClient {
    conn: Connection,
    channel: Channel,
    config: ValidConfig,
    names: Names,
    store: IdemStore,
    /// What this client is (`chime dlq`, `chime web`), for the lock's holder.
    who: String,
}

impl DlqClient {
    pub async fn connect(config: ValidConfig) -> Result<Self, DlqError> {
        let conn = amqp::connect(&config.amqp, "chime-dlq").await?;
        topology::declare(&conn, &config, &config.all_queues()).await?;
        let channel = conn.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        let names = Names::new(&config.prefix);
        let store = IdemStore::connect(&config.redis, names.clone())?;
        Ok(Self { conn, channel, config, names, store, who: "chime".into() })
    }

    /// Names this client in a waiting pass's error ("another pass … is still running").
    pub fn named(mut self, who: &str) -> Self {
        self.who = who.to_string();
        self
    }

    /// `Some(q)` if configured (or [`UNROUTABLE`]), else every configured queue and the
    /// prefix's unroutable delayed messages.
    pub fn queues(&self, only: Option<&str>) -> Result<Vec<String>, DlqError> {
        let mut all = self.config.all_queues();
        all.push(UNROUTABLE.to_string());
        match only {
            None => Ok(all),
            Some(q) if all.iter().any(|a| a == q) => Ok(vec![q.to_string()]),
            Some(q) => Err(DlqError::UnknownQueue(q.to_string())),
        }
    }

    /// The broker queue behind a DLQ source name.
    fn dlq_of(&self, queue: &str) -> String {
        if queue == UNROUTABLE { self.names.unroutable_queue() } else { self.names.dlq(queue) }
    }

    /// Ready messages in the DLQ of `queue`.
    pub async fn depth(&self, queue: &str) -> Result<u32, DlqError> {
        Ok(topology::depth(&self.conn, &self.dlq_of(queue)).await?.0)
    }

    /// Turns ids or id prefixes (8+ characters) into exact ids, each naming exactly one dead
    /// letter of `queues`: a prefix that matches several is an error listing them (dead letter
    /// ids are UUIDv7, so all of one minute share their first 8 characters).
    pub async fn resolve(
        &self,
        queues: &[String],
        given: &[String],
    ) -> Result<Result<Vec<String>, ResolveError>, DlqError> {
        let mut all = Vec::new();
        for q in queues {
            all.extend(self.list(q, &Filter::default()).await?);
        }
        let mut out = Vec::new();
        for g in given {
            let exact: Vec<&DeadLetter> = all.iter().filter(|d| d.id == *g).collect();
            let found: Vec<&DeadLetter> = if exact.is_empty() {
                if g.len() < 8 {
                    return Ok(Err(ResolveError::TooShort(g.clone())));
                }
                all.iter().filter(|d| d.id.starts_with(g.as_str())).collect()
            } else {
                exact
            };
            match found.as_slice() {
                [] => return Ok(Err(ResolveError::NoMatch(g.clone()))),
                [one] => out.push(one.id.clone()),
                many => {
                    let matches = many
                        .iter()
                        .map(|d| {
                            format!(
                                "  {}  {}  {}  {}",
                                d.id,
                                d.queue,
                                d.job.as_deref().unwrap_or("-"),
                                d.reason
                            )
                        })
                        .collect();
                    return Ok(Err(ResolveError::Ambiguous { given: g.clone(), matches }));
                }
            }
        }
        Ok(Ok(out))
    }

    /// Every dead letter of `queue` matching `filter`, in queue order, without bodies. The
    /// DLQ is unchanged.
    pub async fn list(&self, queue: &str, filter: &Filter) -> Result<Vec<DeadLetter>, DlqError> {
        Ok(self.list_with(queue, filter, BodyKept::NONE, usize::MAX).await?.letters)
    }

    /// [`DlqClient::list`], keeping `kept` of each body and at most `limit` dead letters (the
    /// pass still goes over the whole DLQ, and counts every match).
    pub async fn list_with(
        &self,
        queue: &str,
        filter: &Filter,
        kept: BodyKept,
        limit: usize,
    ) -> Result<Listing, DlqError> {
        let mut out = Listing::default();
        let now = self.now().await?;
        let report = self
            .pass(queue, kept, |d| {
                if filter.matches(d, now) {
                    out.matched += 1;
                    if out.letters.len() < limit {
                        out.letters.push(d.clone());
                    }
                }
                Action::Keep
            })
            .await?;
        out.seen = report.seen;
        Ok(out)
    }

    /// Replays matching dead letters into their work queue.
    pub async fn replay(&self, queue: &str, filter: &Filter) -> Result<PassReport, DlqError> {
        let now = self.now().await?;
        self.pass(
            queue,
            BodyKept::NONE,
            |d| if filter.matches(d, now) { Action::Replay } else { Action::Keep },
        )
        .await
    }

    /// Deletes matching dead letters.
    pub async fn purge(&self, queue: &str, filter: &Filter) -> Result<PassReport, DlqError> {
        let now = self.now().await?;
        self.pass(queue, BodyKept::NONE, |d| if filter.matches(d, now) { Action::Drop } else { Action::Keep })
            .await
    }

    /// Redis `TIME`, which `--older-than` is judged by: dead letters are stamped with the
    /// failing worker's Redis-corrected clock, so a host whose clock is ahead would otherwise
    /// take recent dead letters for old ones (and purge them).
    async fn now(&self) -> Result<DateTime<Utc>, DlqError> {
        let now = chime_shared::redis_conn::redis_now(&mut self.store.connection()).await;
        Ok(now.map_err(IdemError::from)?)
    }

    /// One pass over the DLQ of `queue`, holding its lock.
    async fn pass(
        &self,
        queue: &str,
        kept: BodyKept,
        decide: impl FnMut(&DeadLetter) -> Action,
    ) -> Result<PassReport, DlqError> {
        let holder = format!("{} {}", chime_shared::names::process_name(), self.who);
        let lock =
            lock::PassLock::take(self.store.connection(), self.names.dlq_lock(queue), queue, holder).await?;
        let done = self.pass_locked(queue, kept, decide, &lock).await;
        lock.release().await;
        done
    }

    async fn pass_locked(
        &self,
        queue: &str,
        kept: BodyKept,
        mut decide: impl FnMut(&DeadLetter) -> Action,
        lock: &lock::PassLock,
    ) -> Result<PassReport, DlqError> {
        let dlq = self.dlq_of(queue);
        let n = self.depth(queue).await?;
        let timeout = self.config.amqp.publish_timeout;
        let mut report = PassReport::default();
        for _ in 0..n {
            lock.check(queue)?;
            let Some(msg) = self.channel.basic_get(dlq.as_str().into(), BasicGetOptions::default()).await?
            else {
                break; // the DLQ was emptied behind chime's back (a broker-side purge)
            };
            let delivery = msg.delivery;
            report.seen += 1;
            let (dead, envelope) = DeadLetter::read(queue, &delivery, kept);
            let mut action = decide(&dead);
            if action == Action::Replay && envelope.is_none() {
                report.unreplayable += 1;
                action = Action::Keep;
            }
            match action {
                Action::Keep => {
                    // Through `<p>.dead`, which routes the source name to this DLQ.
                    amqp::publish_confirmed(
                        &self.channel,
                        &self.names.dead_exchange(),
                        queue,
                        &delivery.data,
                        delivery.properties.clone(),
                        timeout,
                    )
                    .await?;
                    report.kept += 1;
                }
                Action::Drop => report.dropped += 1,
                Action::Replay => {
                    let Some(old) = envelope else { continue };
                    // An unroutable delayed message goes back to the queue it was meant for.
                    let target = if queue == UNROUTABLE { old.queue.clone() } else { queue.to_string() };
                    let mut env = Envelope::new(
                        &old.job,
                        &target,
                        old.key,
                        old.payload,
                        old.slot,
                        old.max_attempts,
                        Source::Replay,
                    );
                    // The replayed run stays in the trace of the job that died.
                    (env.trace_id, env.trace_state) = (old.trace_id, old.trace_state);
                    // A level's job goes back to its level; a broadcast copy to any worker
                    // (the one it was for may be gone), still under its own key.
                    env.priority = old.priority;
                    (env.group, env.shard, env.shards) = (old.group, old.shard, old.shards);
                    // Dead keys absorb duplicates; replay is the explicit override.
                    self.store.revive(&env.key.to_string()).await?;
                    amqp::publish_confirmed(
                        &self.channel,
                        &self.names.work_exchange(),
                        &env.route(),
                        &env.encode(),
                        env.properties(),
                        timeout,
                    )
                    .await?;
                    metrics::counter!(chime_shared::telemetry::JOBS_PUBLISHED, "job" => env.job.clone(), "source" => "replay")
                        .increment(1);
                    report.replayed += 1;
                }
            }
            delivery.acker.ack(BasicAckOptions::default()).await?;
        }
        Ok(report)
    }

    pub async fn close(self) {
        let _ = self.channel.close(200, "done".into()).await;
        let _ = self.conn.close(200, "done".into()).await;
    }
}
