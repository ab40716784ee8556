//! Overlap policy of scheduled jobs (`overlap = "allow" | "skip" | "buffer_one"`): what the
//! ticker does with a due slot while the job's previous run is still in progress.
//!
//! In Redis, `<prefix>:overlap:<job>` holds the last run the ticker published (`last`: its
//! key, `at`: when) and the slot waiting for it to end (`buf`, Unix seconds; `buffer_one`
//! only). A run is in progress until its key is `done` or `dead` — queued, running, between
//! retries; for a fanned-out run, until every member is (a broadcast copy whose worker is gone
//! counts as ended). A run whose record has expired (published longer than
//! `redis.done_retention` ago) counts as ended. The leader decides, publishes, and records
//! the run it published only after the broker confirmed it; a new leader reads the same hash,
//! so a buffered slot survives a failover.

use chime_shared::config::Overlap;
use chime_shared::control;
use chime_shared::group::{self, Fan};
use chime_shared::names::Names;
use chime_shared::record::KeyState;
use chime_shared::redis_conn::RedisConn;
use chrono::{DateTime, Utc};
use std::collections::HashMap;
use std::time::Duration;
use uuid::Uuid;

/// What to do with a due slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Publish it.
    Publish,
    /// Do not publish it: count it and record it in the history.
    Skip,
    /// Keep it until the previous run ends.
    Buffer,
}

/// The decision for a due slot under `policy`, given whether the previous run is still in
/// progress and whether a slot already waits.
pub fn decide(policy: Overlap, previous_running: bool, waiting: bool) -> Decision {
    match (policy, previous_running, waiting) {
        (Overlap::Allow, _, _) | (_, false, _) => Decision::Publish,
        (Overlap::Skip, true, _) => Decision::Skip,
        (Overlap::BufferOne, true, false) => Decision::Buffer,
        (Overlap::BufferOne, true, true) => Decision::Skip,
    }
}

/// A job's overlap state as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    /// Key of the last run published, and when (ms).
    pub last: Option<(Uuid, i64)>,
    /// The slot waiting for it (Unix seconds).
    pub buffered: Option<i64>,
}

/// Reads the overlap state of `jobs`.
pub async fn states(conn: &mut RedisConn, names: &Names, jobs: &[&str]) -> redis::RedisResult<Vec<State>> {
    let mut pipe = redis::pipe();
    for j in jobs {
        pipe.cmd("HMGET").arg(names.overlap(j)).arg("last").arg("at").arg("buf");
    }
    let rows: Vec<(Option<String>, Option<i64>, Option<i64>)> = pipe.query_async(conn).await?;
    Ok(rows
        .into_iter()
        .map(|(last, at, buf)| State {
            last: last.and_then(|l| l.parse().ok()).map(|k| (k, at.unwrap_or(0))),
            buffered: buf,
        })
        .collect())
}

/// Records `key` as the job's last run (published now); clears the waiting slot when it was
/// the one published (`released`).
pub async fn published(
    conn: &mut RedisConn,
    names: &Names,
    job: &str,
    key: Uuid,
    released: bool,
) -> redis::RedisResult<()> {
    let mut pipe = redis::pipe();
    pipe.cmd("HSET")
        .arg(names.overlap(job))
        .arg("last")
        .arg(key.to_string())
        .arg("at")
        .arg(Utc::now().timestamp_millis())
        .ignore();
    if released {
        pipe.cmd("HDEL").arg(names.overlap(job)).arg("buf").ignore();
    }
    pipe.query_async(conn).await
}

/// Keeps `slot` as the job's waiting slot.
pub async fn buffer(
    conn: &mut RedisConn,
    names: &Names,
    job: &str,
    slot: DateTime<Utc>,
) -> redis::RedisResult<()> {
    redis::cmd("HSET").arg(names.overlap(job)).arg("buf").arg(slot.timestamp()).query_async(conn).await
}

/// Whether the run keyed `last`, published at `at` (ms), is still in progress.
pub async fn running(
    conn: &mut RedisConn,
    names: &Names,
    last: Uuid,
    at: i64,
    retention: Duration,
) -> redis::RedisResult<bool> {
    let (keys, gone): (Vec<Uuid>, Vec<Uuid>) = match group::read(conn, names, last).await? {
        Some(g) => {
            let members = g.fan.members(last);
            // A broadcast copy whose worker is gone will never run: it counts as ended.
            let gone = match &g.fan {
                Fan::Broadcast(_) => {
                    let beats = control::workers(conn, names).await?;
                    members
                        .iter()
                        .filter(|m| m.target.as_ref().is_some_and(|t| !beats.iter().any(|b| &b.id == t)))
                        .map(|m| m.key)
                        .collect()
                }
                Fan::Shards(_) => Vec::new(),
            };
            (members.into_iter().map(|m| m.key).collect(), gone)
        }
        None => (vec![last], Vec::new()),
    };
    let mut pipe = redis::pipe();
    for k in &keys {
        pipe.cmd("HGET").arg(names.idem_key(&k.to_string())).arg("s");
    }
    let states: Vec<Option<String>> = pipe.query_async(conn).await?;
    let expired =
        Utc::now().timestamp_millis() - at > i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    Ok(keys.iter().zip(states).any(|(k, s)| match s.map(|s| KeyState::parse(&s)) {
        Some(s) if s.settled() => false,
        // No record: not claimed yet (queued, delayed), unless it is too old to have one.
        None => !expired && !gone.contains(k),
        Some(_) => !gone.contains(k),
    }))
}

/// Whether each job's last run is in progress, for jobs whose state has one.
pub async fn running_of(
    conn: &mut RedisConn,
    names: &Names,
    states: &HashMap<String, State>,
    retention: Duration,
) -> redis::RedisResult<HashMap<String, bool>> {
    let mut out = HashMap::new();
    for (job, s) in states {
        let busy = match s.last {
            Some((key, at)) => running(conn, names, key, at, retention).await?,
            None => false,
        };
        out.insert(job.clone(), busy);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policies_decide_as_documented() {
        use Decision::*;
        for waiting in [false, true] {
            assert_eq!(decide(Overlap::Allow, true, waiting), Publish);
            assert_eq!(decide(Overlap::Skip, false, waiting), Publish);
            assert_eq!(decide(Overlap::BufferOne, false, waiting), Publish);
            assert_eq!(decide(Overlap::Skip, true, waiting), Skip);
        }
        assert_eq!(decide(Overlap::BufferOne, true, false), Buffer);
        assert_eq!(decide(Overlap::BufferOne, true, true), Skip, "at most one waits");
    }
}
