//! The catalog: what the workers of a prefix can run, in Redis, so that the operator tools
//! see jobs and queues the config file does not name (jobs defined in Rust, on queues of
//! their own).
//!
//! Each worker registers its jobs (name, queue, handler kind, attempts, timeout, whether
//! scheduled) and the queues it consumes when it starts and every minute after
//! ([`register`]); an entry is read for [`RETENTION`] after its last registration, so a job
//! whose workers are stopped stays visible to the DLQ tools for a week. Readers
//! ([`read`]) change nothing; [`Catalog::merge`] adds what the config lacks to a config for
//! the tools (`status`, `dlq`, `history`, `inspect`, `enqueue`, `run`, `web`, alerts).

use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

use crate::config::{Config, HandlerConfig, JobConfig, Overlap};
use crate::names::Names;

/// How long an entry is read after its last registration.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// How often a running worker registers again.
pub const REFRESH: Duration = Duration::from_secs(60);

/// One job a worker can run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogJob {
    /// The job's name.
    pub name: String,
    /// The queue it is published to.
    pub queue: String,
    /// `exec`, `http`, `noop`, or `rust` (registered in the worker's code).
    pub handler: String,
    /// Attempts in all.
    pub max_attempts: u32,
    /// The handler's timeout.
    pub timeout_ms: u64,
    /// Whether the worker's config schedules it (the ticker needs a `[[jobs]]` entry for that).
    pub scheduled: bool,
    /// The worker that registered it last.
    pub worker: String,
    /// When it was registered last.
    pub seen_at: DateTime<Utc>,
}

/// One queue a worker consumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogQueue {
    /// The queue's name.
    pub name: String,
    /// The worker that registered it last.
    pub worker: String,
    /// When it was registered last.
    pub seen_at: DateTime<Utc>,
}

/// Everything registered within [`RETENTION`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalog {
    /// By job name.
    pub jobs: BTreeMap<String, CatalogJob>,
    /// By queue name.
    pub queues: BTreeMap<String, CatalogQueue>,
}

/// Registers `jobs` and `queues` (one pipeline), and drops entries past [`RETENTION`].
pub async fn register<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    jobs: &[CatalogJob],
    queues: &[CatalogQueue],
) -> redis::RedisResult<()> {
    let mut pipe = redis::pipe();
    for j in jobs {
        pipe.cmd("HSET").arg(names.catalog_jobs()).arg(&j.name).arg(json(j)).ignore();
    }
    for q in queues {
        pipe.cmd("HSET").arg(names.catalog_queues()).arg(&q.name).arg(json(q)).ignore();
    }
    pipe.query_async::<()>(conn).await?;
    // Pruning: what no worker registered within the retention.
    let (_, stale) = fetch(conn, names).await?;
    if !stale.is_empty() {
        let mut prune = redis::pipe();
        for (key, field) in stale {
            prune.cmd("HDEL").arg(key).arg(field).ignore();
        }
        prune.query_async::<()>(conn).await?;
    }
    Ok(())
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

fn fresh(seen_at: DateTime<Utc>, now: DateTime<Utc>) -> bool {
    (now - seen_at).to_std().map_or(true, |age| age <= RETENTION)
}

/// The catalog within the retention, and the `(hash, field)` of every entry past it or
/// unreadable. Ages are Redis `TIME`'s (read in the same round trip), as entries are stamped
/// by it: a host whose clock is days ahead neither hides the catalog nor prunes it whole.
async fn fetch<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
) -> redis::RedisResult<(Catalog, Vec<(String, String)>)> {
    let mut catalog = Catalog::default();
    let mut stale = Vec::new();
    let (time, jobs, queues): ((i64, i64), BTreeMap<String, String>, BTreeMap<String, String>) =
        redis::pipe()
            .cmd("TIME")
            .cmd("HGETALL")
            .arg(names.catalog_jobs())
            .cmd("HGETALL")
            .arg(names.catalog_queues())
            .query_async(conn)
            .await?;
    let now = crate::redis_conn::instant_of(time);
    for (field, text) in jobs {
        match serde_json::from_str::<CatalogJob>(&text) {
            Ok(j) if fresh(j.seen_at, now) => {
                catalog.jobs.insert(j.name.clone(), j);
            }
            _ => stale.push((names.catalog_jobs(), field)),
        }
    }
    for (field, text) in queues {
        match serde_json::from_str::<CatalogQueue>(&text) {
            Ok(q) if fresh(q.seen_at, now) => {
                catalog.queues.insert(q.name.clone(), q);
            }
            _ => stale.push((names.catalog_queues(), field)),
        }
    }
    Ok((catalog, stale))
}

/// The catalog as registered within [`RETENTION`]; unreadable entries are skipped.
pub async fn read<C: ConnectionLike + Send>(conn: &mut C, names: &Names) -> redis::RedisResult<Catalog> {
    Ok(fetch(conn, names).await?.0)
}

impl Catalog {
    /// `config` with what it lacks from the catalog: a job only a worker knows becomes an
    /// entry of its own (its queue, attempts and timeout; the handler by name, no schedule),
    /// a queue only a worker consumes joins [`Config::all_queues`]. What the config says wins;
    /// entries whose names are not valid names are left out (Redis is not trusted).
    pub fn merge(&self, mut config: Config) -> Config {
        let valid = |s: &str| crate::config::valid_name(s);
        for j in self.jobs.values() {
            if config.job(&j.name).is_some() || !valid(&j.name) || !valid(&j.queue) {
                continue;
            }
            let max_attempts =
                (1..=crate::envelope::MAX_ATTEMPTS).contains(&j.max_attempts).then_some(j.max_attempts);
            let timeout = (j.timeout_ms > 0).then(|| Duration::from_millis(j.timeout_ms));
            config.jobs.push(JobConfig {
                name: j.name.clone(),
                schedule: None,
                timezone: None,
                queue: Some(j.queue.clone()),
                handler: HandlerConfig::Registered(j.name.clone()),
                payload: None,
                max_attempts,
                backoff: None,
                timeout,
                catch_up: None,
                catch_up_window: None,
                deadline: None,
                jitter: None,
                concurrency: None,
                global_concurrency: None,
                overlap: Overlap::default(),
                shards: None,
                pack: None,
                broadcast: false,
                priority: None,
                rate_limit: None,
                circuit: None,
                criticality: Default::default(),
                promote_after: None,
                calendar: None,
                on_holiday: None,
                business_day: None,
                after: Vec::new(),
                on_complete: None,
            });
        }
        let known = config.all_queues();
        for q in self.queues.keys() {
            if valid(q) && !known.contains(q) && !config.catalog_queues.contains(q) {
                config.catalog_queues.push(q.clone());
            }
        }
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str, queue: &str, seen_at: DateTime<Utc>) -> CatalogJob {
        CatalogJob {
            name: name.into(),
            queue: queue.into(),
            handler: "rust".into(),
            max_attempts: 3,
            timeout_ms: 30_000,
            scheduled: false,
            worker: "w".into(),
            seen_at,
        }
    }

    #[test]
    fn merging_adds_what_the_config_lacks_and_keeps_what_it_says() {
        let config = Config::from_toml_str("[[jobs]]\nname = \"a\"\nhandler = \"noop\"\nmax_attempts = 9\n")
            .unwrap()
            .into_config();
        let now = Utc::now();
        let mut c = Catalog::default();
        for j in
            [job("a", "elsewhere", now), job("send_invoice", "invoices", now), job("bad name!", "q", now)]
        {
            c.jobs.insert(j.name.clone(), j);
        }
        c.queues.insert("@w1".into(), CatalogQueue { name: "@w1".into(), worker: "w".into(), seen_at: now });
        c.queues.insert(
            "reports".into(),
            CatalogQueue { name: "reports".into(), worker: "w".into(), seen_at: now },
        );
        let merged = c.merge(config).validated().unwrap();
        assert_eq!(merged.job("a").unwrap().max_attempts(), 9, "the config wins");
        assert_eq!(merged.job("a").unwrap().queue(), "default");
        let invoice = merged.job("send_invoice").unwrap();
        assert_eq!((invoice.queue(), invoice.max_attempts()), ("invoices", 3));
        assert_eq!(invoice.timeout, Some(Duration::from_secs(30)));
        assert!(invoice.schedule.is_none());
        assert!(merged.job("bad name!").is_none());
        assert_eq!(merged.all_queues(), ["default", "invoices", "reports"]);
    }

    #[test]
    fn entries_past_the_retention_are_stale() {
        let now = Utc::now();
        assert!(fresh(now - chrono::Duration::days(6), now));
        assert!(!fresh(now - chrono::Duration::days(8), now));
    }
}
