//! Fanned-out runs: a sharded job's slot (or ad-hoc enqueue) becomes one message per shard, a
//! broadcast job's one message per live worker. The run's own key (the slot's key, or the
//! enqueue's) is the *base*; every member has a key derived from it
//! ([`crate::envelope::shard_key`], [`crate::envelope::broadcast_key`]).
//!
//! The group record `<prefix>:group:<base>` fixes what the run fanned out to, the first time
//! it is published: how many shards (`shards = "workers"` counts the live workers then), or
//! which workers. Whoever publishes the same run again (a second ticker in a split brain, a new
//! leader catching up, a backfill) reads the record and publishes the same members with the
//! same keys, so the copies are absorbed, never run as a differently sharded second run. The
//! record lives as long as the members' own records (`redis.done_retention`), and is what
//! `chime inspect` shows: each member's state, a missing one included.

use chrono::{DateTime, Utc};
use redis::Script;
use std::sync::LazyLock;
use std::time::Duration;
use uuid::Uuid;

use crate::config::{JobConfig, Shards};
use crate::control::{self, WorkerBeat};
use crate::envelope::{Envelope, broadcast_key, shard_key};
use crate::names::Names;
use crate::redis_conn::RedisConn;

/// What a run fans out to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fan {
    /// This many shards, `0..n`.
    Shards(u32),
    /// One copy for each of these workers (ids).
    Broadcast(Vec<String>),
}

/// One message of a fanned-out run.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Member {
    /// Its own idempotency key.
    pub key: Uuid,
    /// Its shard (sharded runs).
    pub shard: Option<u32>,
    /// The worker it is for (broadcast runs).
    pub target: Option<String>,
}

impl Fan {
    /// The members of the run keyed `base`, in order.
    pub fn members(&self, base: Uuid) -> Vec<Member> {
        match self {
            Fan::Shards(n) => (0..*n)
                .map(|i| Member { key: shard_key(base, i, *n), shard: Some(i), target: None })
                .collect(),
            Fan::Broadcast(workers) => workers
                .iter()
                .map(|w| Member { key: broadcast_key(base, w), shard: None, target: Some(w.clone()) })
                .collect(),
        }
    }

    /// The members' envelopes: copies of `base` (the run's envelope, keyed with the base key)
    /// with their own keys, shard or worker, and the base as their group.
    pub fn envelopes(&self, base: &Envelope) -> Vec<Envelope> {
        let shards = match self {
            Fan::Shards(n) => Some(*n),
            Fan::Broadcast(_) => None,
        };
        self.members(base.key)
            .into_iter()
            .map(|m| {
                let mut e = base.clone();
                e.id = crate::envelope::new_id();
                e.key = m.key;
                e.group = Some(base.key);
                e.shard = m.shard;
                e.shards = shards;
                e.target = m.target;
                e
            })
            .collect()
    }
}

/// A run's group record.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GroupRecord {
    /// The run's own key.
    pub base: Uuid,
    /// Job name.
    pub job: String,
    /// Its queue.
    pub queue: String,
    /// What it fanned out to.
    pub fan: Fan,
    /// The slot, for a scheduled run.
    pub slot: Option<DateTime<Utc>>,
    /// When the record was written (the run's first publish).
    pub created: Option<DateTime<Utc>>,
}

/// KEYS[1] group key; ARGV job, queue, kind (`shards`|`broadcast`), n, workers (JSON), slot,
/// retention_ms → {kind, n, workers} as stored: written when absent, else the record's own.
static FIX: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local h = redis.call('HMGET', KEYS[1], 'k', 'n', 'w')
if h[1] then return {h[1], h[2], h[3] or '[]'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'j', ARGV[1], 'q', ARGV[2], 'k', ARGV[3], 'n', ARGV[4], 'w', ARGV[5], 's', ARGV[6], 'c', string.format('%.0f', now))
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return {ARGV[3], ARGV[4], ARGV[5]}",
    )
});

fn decode_fan(kind: &str, n: &str, workers: &str) -> Option<Fan> {
    match kind {
        "shards" => n.parse().ok().filter(|n| *n >= 1).map(Fan::Shards),
        "broadcast" => serde_json::from_str(workers).ok().map(Fan::Broadcast),
        _ => None,
    }
}

/// Fixes what the run keyed `base` fans out to: `proposed`, unless an earlier publish of the
/// same run already fixed it (then that).
pub async fn fix(
    conn: &mut RedisConn,
    names: &Names,
    base: &Envelope,
    proposed: &Fan,
    retention: Duration,
) -> redis::RedisResult<Fan> {
    let (kind, n, workers) = match proposed {
        Fan::Shards(n) => ("shards", *n, "[]".to_string()),
        Fan::Broadcast(w) => (
            "broadcast",
            u32::try_from(w.len()).unwrap_or(u32::MAX),
            serde_json::to_string(w).unwrap_or_default(),
        ),
    };
    let slot = base.slot.map(|s| s.to_rfc3339()).unwrap_or_default();
    let (k, n, w): (String, String, String) = FIX
        .key(names.group(&base.key.to_string()))
        .arg(&base.job)
        .arg(&base.queue)
        .arg(kind)
        .arg(n)
        .arg(workers)
        .arg(slot)
        .arg(u64::try_from(retention.as_millis()).unwrap_or(u64::MAX))
        .invoke_async(conn)
        .await?;
    decode_fan(&k, &n, &w).ok_or_else(|| {
        redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "unreadable group record"))
    })
}

/// The group record of the run keyed `base`, if it fanned out.
pub async fn read(
    conn: &mut RedisConn,
    names: &Names,
    base: Uuid,
) -> redis::RedisResult<Option<GroupRecord>> {
    let fields: std::collections::HashMap<String, String> =
        redis::cmd("HGETALL").arg(names.group(&base.to_string())).query_async(conn).await?;
    let get = |k: &str| fields.get(k).cloned().unwrap_or_default();
    let Some(fan) = decode_fan(&get("k"), &get("n"), &get("w")) else { return Ok(None) };
    Ok(Some(GroupRecord {
        base,
        job: get("j"),
        queue: get("q"),
        fan,
        slot: get("s").parse().ok(),
        created: get("c").parse::<i64>().ok().and_then(DateTime::from_timestamp_millis),
    }))
}

/// The workers that consume `queue` now (heartbeat alive, consuming, the queue not paused),
/// by id; with `started_by`, only those that were already running then (a worker that joins
/// later never runs an earlier slot).
pub fn consumers_of(beats: &[WorkerBeat], queue: &str, started_by: Option<DateTime<Utc>>) -> Vec<String> {
    beats
        .iter()
        .filter(|b| {
            b.consuming && b.queues.iter().any(|q| q == queue) && !b.paused.iter().any(|q| q == queue)
        })
        .filter(|b| started_by.is_none_or(|t| b.started_at <= t))
        .map(|b| b.id.clone())
        .collect()
}

/// What a run of `job` fans out to now (`None`: it does not): its shard count, or the live
/// workers it is broadcast to (those started before `slot`, for a scheduled run). Reads the
/// heartbeats when the count or the workers depend on them.
pub async fn propose(
    conn: &mut RedisConn,
    names: &Names,
    job: &JobConfig,
    slot: Option<DateTime<Utc>>,
) -> redis::RedisResult<Option<Fan>> {
    propose_for(conn, names, job.queue(), job.shards, job.broadcast, slot).await
}

/// [`propose`] from a job's queue and fan-out settings.
pub async fn propose_for(
    conn: &mut RedisConn,
    names: &Names,
    queue: &str,
    shards: Option<Shards>,
    broadcast: bool,
    slot: Option<DateTime<Utc>>,
) -> redis::RedisResult<Option<Fan>> {
    Ok(match (shards, broadcast) {
        (Some(Shards::Count(n)), _) => Some(Fan::Shards(n)),
        (Some(Shards::Workers), _) => {
            let beats = control::workers(conn, names).await?;
            let n = u32::try_from(consumers_of(&beats, queue, None).len()).unwrap_or(u32::MAX).max(1);
            Some(Fan::Shards(n))
        }
        (None, true) => {
            let beats = control::workers(conn, names).await?;
            Some(Fan::Broadcast(consumers_of(&beats, queue, slot)))
        }
        (None, false) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{Source, scheduled_key};

    #[test]
    fn members_have_their_own_keys_derived_from_the_base() {
        let slot: DateTime<Utc> = "2026-03-29T01:00:00Z".parse().unwrap();
        let base = Envelope::new(
            "j",
            "default",
            scheduled_key("j", slot),
            serde_json::json!(1),
            Some(slot),
            3,
            Source::Schedule,
        );
        let fan = Fan::Shards(3);
        let envs = fan.envelopes(&base);
        assert_eq!(envs.len(), 3);
        for (i, e) in envs.iter().enumerate() {
            assert_eq!((e.shard, e.shards, e.group), (Some(i as u32), Some(3), Some(base.key)));
            assert_eq!(e.key, shard_key(base.key, i as u32, 3));
            assert_eq!(e.route(), "default");
        }
        // Deterministic: another replica derives the same keys; another count, other keys.
        assert_eq!(Fan::Shards(3).members(base.key), fan.members(base.key));
        assert_ne!(Fan::Shards(4).members(base.key)[0].key, fan.members(base.key)[0].key);
        let b = Fan::Broadcast(vec!["h:1".into(), "h:2".into()]).envelopes(&base);
        assert_eq!(b[1].target.as_deref(), Some("h:2"));
        assert_eq!(b[1].route(), "@h-2");
        assert_eq!(b[1].key, broadcast_key(base.key, "h:2"));
    }
}
