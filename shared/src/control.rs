//! What operators see and steer in Redis: worker heartbeats (`<prefix>:workers:<id>`, a JSON
//! [`WorkerBeat`] with a TTL) and pause flags (`<prefix>:paused:{queue|schedule}:<name>`, a
//! JSON [`PauseFlag`], no TTL). Workers write their beat and read the queue flags; the ticker
//! reads the schedule flags; the CLI and the dashboard read and write them here.

use crate::redis_conn::{redis_ms, redis_now};
use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;
use serde::{Deserialize, Serialize};

use crate::names::Names;

/// How often a worker writes its heartbeat.
pub const BEAT_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// A heartbeat not renewed within this long disappears (the worker is gone).
pub const BEAT_TTL: std::time::Duration = std::time::Duration::from_secs(15);

/// A job running on a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Running {
    /// Job name.
    pub job: String,
    /// Idempotency key.
    pub key: String,
    /// Logical queue.
    pub queue: String,
    /// Attempt number.
    pub attempt: u32,
    /// When the handler started.
    pub started_at: DateTime<Utc>,
}

/// One live worker process, as its heartbeat says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerBeat {
    /// Worker id (`host:pid` unless configured).
    pub id: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// chime version.
    pub version: String,
    /// Logical queues it consumes.
    pub queues: Vec<String>,
    /// Of those, the ones it paused because their flag is set.
    pub paused: Vec<String>,
    /// Jobs it runs at once at most.
    pub concurrency: usize,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// When this beat was written.
    pub seen_at: DateTime<Utc>,
    /// Whether it is consuming (connected, Redis up, not draining).
    pub consuming: bool,
    /// Deliveries settled so far: succeeded, retried, dead-lettered, duplicates.
    pub settled: [u64; 4],
    /// Jobs running now.
    pub running: Vec<Running>,
    /// Its last beat, written as it stopped cleanly (kept a day in `workers-last`).
    #[serde(default)]
    pub stopped: bool,
}

/// How long a worker's last heartbeat is kept after it stops or dies.
pub const LAST_BEAT_KEPT: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// A pause flag: who set it, when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PauseFlag {
    /// When it was set.
    pub at: DateTime<Utc>,
    /// Who set it (`user@host`, or `web`).
    pub by: String,
}

/// What a pause applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A queue: workers stop consuming it.
    Queue,
    /// A schedule: the ticker skips its slots.
    Schedule,
}

impl Target {
    fn key(self, names: &Names, name: &str) -> String {
        match self {
            Target::Queue => names.paused_queue(name),
            Target::Schedule => names.paused_schedule(name),
        }
    }
}

/// `user@host` of this process, for [`PauseFlag::by`].
pub fn operator() -> String {
    let user =
        std::env::var("USER").or_else(|_| std::env::var("LOGNAME")).unwrap_or_else(|_| "unknown".into());
    format!("{user}@{}", gethostname::gethostname().to_string_lossy())
}

/// Sets a pause flag, stamped by Redis `TIME`; returns the flag that was already set, if any
/// (then nothing changes).
pub async fn pause<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    target: Target,
    name: &str,
    by: &str,
) -> redis::RedisResult<Option<PauseFlag>> {
    let flag = PauseFlag { at: redis_now(conn).await?, by: by.to_string() };
    let key = target.key(names, name);
    let set: bool = redis::cmd("SET")
        .arg(&key)
        .arg(serde_json::to_string(&flag).unwrap_or_default())
        .arg("NX")
        .query_async::<Option<String>>(conn)
        .await?
        .is_some();
    if set { Ok(None) } else { Ok(Some(flag_of(conn, &key).await?.unwrap_or(flag))) }
}

/// Clears a pause flag; returns the flag that was set (`None`: it was not paused).
pub async fn resume<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    target: Target,
    name: &str,
) -> redis::RedisResult<Option<PauseFlag>> {
    let key = target.key(names, name);
    let text: Option<String> = redis::cmd("GETDEL").arg(&key).query_async(conn).await?;
    Ok(text.map(|t| parse_flag(&t)))
}

fn parse_flag(text: &str) -> PauseFlag {
    serde_json::from_str(text).unwrap_or(PauseFlag { at: DateTime::<Utc>::UNIX_EPOCH, by: "?".into() })
}

async fn flag_of<C: ConnectionLike + Send>(conn: &mut C, key: &str) -> redis::RedisResult<Option<PauseFlag>> {
    let text: Option<String> = redis::cmd("GET").arg(key).query_async(conn).await?;
    Ok(text.map(|t| parse_flag(&t)))
}

/// The flags of `names_to_check`, in order (`None`: not paused).
pub async fn flags<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    target: Target,
    names_to_check: &[String],
) -> redis::RedisResult<Vec<Option<PauseFlag>>> {
    if names_to_check.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<String> = names_to_check.iter().map(|n| target.key(names, n)).collect();
    let texts: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(conn).await?;
    Ok(texts.into_iter().map(|t| t.map(|t| parse_flag(&t))).collect())
}

/// Writes (or refreshes) a worker's heartbeat: its key with [`BEAT_TTL`] and its entry in the
/// workers index, and drops index entries a minute past their heartbeat's expiry (the
/// writers keep the index tidy; readers change nothing).
pub async fn beat<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    beat: &WorkerBeat,
) -> redis::RedisResult<()> {
    let ttl = u64::try_from(BEAT_TTL.as_millis()).unwrap_or(15_000);
    // Index scores are Redis time, as the readers' cut-off is: no worker's or reader's clock
    // decides who is live.
    let now = redis_ms(conn).await?;
    let until = now + i64::try_from(ttl).unwrap_or(15_000);
    let mut pipe = redis::pipe();
    pipe.cmd("ZREMRANGEBYSCORE")
        .arg(names.workers_index())
        .arg("-inf")
        .arg(now - STALE_MS)
        .ignore()
        .cmd("SET")
        .arg(names.worker(&beat.id))
        .arg(serde_json::to_string(beat).unwrap_or_default())
        .arg("PX")
        .arg(ttl)
        .ignore()
        .cmd("ZADD")
        .arg(names.workers_index())
        .arg(until)
        .arg(&beat.id)
        .ignore();
    // One round trip: the live beat and the one kept after it stops.
    keep_last(&mut pipe, names, beat, now);
    pipe.query_async(conn).await
}

/// Adds to `pipe`: keep `beat` as the worker's last for [`LAST_BEAT_KEPT`], and drop workers
/// not seen for that long from the index of workers seen.
fn keep_last(pipe: &mut redis::Pipeline, names: &Names, beat: &WorkerBeat, now: i64) {
    let kept = i64::try_from(LAST_BEAT_KEPT.as_millis()).unwrap_or(i64::MAX);
    pipe.cmd("SET")
        .arg(names.worker_last(&beat.id))
        .arg(serde_json::to_string(beat).unwrap_or_default())
        .arg("PX")
        .arg(kept)
        .ignore()
        .cmd("ZADD")
        .arg(names.workers_seen())
        .arg(now)
        .arg(&beat.id)
        .ignore()
        .cmd("ZREMRANGEBYSCORE")
        .arg(names.workers_seen())
        .arg("-inf")
        .arg(now - kept)
        .ignore();
}

/// Adds to `pipe`: remove worker `id`'s live heartbeat and its index entry.
fn forget(pipe: &mut redis::Pipeline, names: &Names, id: &str) {
    pipe.cmd("DEL").arg(names.worker(id)).ignore().cmd("ZREM").arg(names.workers_index()).arg(id).ignore();
}

/// A clean stop: the last beat (marked `stopped`) is kept a day, the live one removed.
pub async fn retire<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    beat: &WorkerBeat,
) -> redis::RedisResult<()> {
    let now = redis_ms(conn).await?;
    let last = WorkerBeat { stopped: true, running: Vec::new(), ..beat.clone() };
    let mut pipe = redis::pipe();
    keep_last(&mut pipe, names, &last, now);
    forget(&mut pipe, names, &beat.id);
    pipe.query_async(conn).await
}

/// Workers seen in the last day that no longer beat: their last heartbeat, newest first
/// (`stopped` when they stopped cleanly; else they died or lost Redis). Read-only.
pub async fn gone<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
) -> redis::RedisResult<Vec<WorkerBeat>> {
    let now = redis_ms(conn).await?;
    let kept = i64::try_from(LAST_BEAT_KEPT.as_millis()).unwrap_or(i64::MAX);
    let ids: Vec<String> = redis::cmd("ZRANGEBYSCORE")
        .arg(names.workers_seen())
        .arg(now - kept)
        .arg("+inf")
        .query_async(conn)
        .await?;
    let live: std::collections::BTreeSet<String> =
        workers(conn, names).await?.into_iter().map(|w| w.id).collect();
    let ids: Vec<&String> = ids.iter().filter(|id| !live.contains(*id)).collect();
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<String> = ids.iter().map(|id| names.worker_last(id)).collect();
    let texts: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(conn).await?;
    let mut beats: Vec<WorkerBeat> =
        texts.into_iter().flatten().filter_map(|t| serde_json::from_str(&t).ok()).collect();
    beats.sort_by_key(|b| std::cmp::Reverse(b.seen_at));
    Ok(beats)
}

/// Removes a worker's heartbeat (on a clean shutdown).
pub async fn unregister<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    id: &str,
) -> redis::RedisResult<()> {
    let mut pipe = redis::pipe();
    forget(&mut pipe, names, id);
    pipe.query_async(conn).await
}

/// How long past its heartbeat's expiry (Redis time) an index entry is still read, and then
/// dropped by the next beat of any worker.
const STALE_MS: i64 = 60_000;

/// Every live worker of the prefix, by id: the index entries less than a minute past their
/// heartbeat's expiry (by Redis time, as the beats write them), then the heartbeats that have
/// not expired. Read-only: a dashboard or CLI listing never changes Redis.
pub async fn workers<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
) -> redis::RedisResult<Vec<WorkerBeat>> {
    let stale = redis_ms(conn).await? - STALE_MS;
    let ids: Vec<String> = redis::cmd("ZRANGEBYSCORE")
        .arg(names.workers_index())
        .arg(stale)
        .arg("+inf")
        .query_async(conn)
        .await?;
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<String> = ids.iter().map(|id| names.worker(id)).collect();
    let texts: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(conn).await?;
    let mut beats: Vec<WorkerBeat> =
        texts.into_iter().flatten().filter_map(|t| serde_json::from_str(&t).ok()).collect();
    beats.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(beats)
}

/// Cancels `key` (`chime cancel`, the dashboard's Cancel button, `POST /v1/jobs/{key}/cancel`)
/// and says what happened, the same words everywhere: a run in progress is stopped by its
/// worker (which records it); a key waiting for its next attempt or not started yet is
/// recorded `cancelled` here (in the history too, when its record knew its job), and a copy of
/// it that arrives later is dropped. A key already `done`, `dead` or `cancelled` is left as it
/// is. The message's flag is true when something was cancelled (or had been).
pub async fn cancel(
    conn: &mut crate::redis_conn::RedisConn,
    names: &Names,
    config: &crate::config::Config,
    key: &str,
    who: &str,
) -> Result<(crate::idempotency::Cancelled, String, bool), crate::idempotency::IdemError> {
    use crate::idempotency::Cancelled;
    use crate::record::KeyState;
    let retention = config.redis.done_retention;
    let (found, about) = crate::idempotency::cancel(conn, names, key, retention, who).await?;
    let unrun = |error: &str| {
        about.as_ref().map(|(job, queue)| crate::history::RunEvent {
            job: job.clone(),
            key: key.to_string(),
            id: String::new(),
            queue: queue.clone(),
            attempt: 0,
            max_attempts: 0,
            worker: who.to_string(),
            started_at: None,
            finished_at: Utc::now(),
            outcome: crate::history::Outcome::Cancelled,
            duration_ms: None,
            reason: Some("cancelled".into()),
            error: Some(error.to_string()),
            entry: None,
        })
    };
    let keep = crate::duration::format(retention);
    let (text, event, ok) = match &found {
        Cancelled::Running { owner } => {
            let worker = owner.split('/').next().unwrap_or(owner);
            (
                format!(
                    "cancelling {key}: its run on worker {worker} stops within a second (the handler's cancellation \
                     token fires; an exec program gets SIGTERM, then SIGKILL after worker.cancel_grace); it is \
                     recorded cancelled, not retried, not dead-lettered"
                ),
                None,
                true,
            )
        }
        Cancelled::Waiting => (
            format!(
                "cancelled {key}: no run held it (it was waiting for its next attempt, or its worker is gone); \
                 a copy that arrives is dropped as cancelled"
            ),
            unrun(&format!("cancelled by {who} between attempts")),
            true,
        ),
        Cancelled::NotStarted => (
            format!(
                "cancelled {key}: no run of it has started (it is queued or delayed, or chime does not know it); \
                 a copy that arrives within redis.done_retention ({keep}) is dropped as cancelled"
            ),
            None,
            true,
        ),
        Cancelled::Settled(KeyState::Cancelled) => (format!("{key} was cancelled already"), None, true),
        Cancelled::Settled(KeyState::Done) => (format!("{key} is done: nothing to cancel"), None, false),
        Cancelled::Settled(KeyState::Dead | KeyState::Dying) => (
            format!(
                "{key} is dead (dead-lettered): nothing to cancel; `chime dlq purge` removes its dead letter"
            ),
            None,
            false,
        ),
        Cancelled::Settled(other) => (format!("{key} is {other}: nothing cancelled"), None, false),
    };
    if let Some(event) = event
        && let Err(e) = crate::history::append(conn, names, &[event]).await
    {
        tracing::warn!(error = %e, "the cancellation is not in the history");
    }
    Ok((found, text, ok))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_garbled_flag_still_counts_as_paused() {
        assert_eq!(parse_flag("not json").by, "?");
        let f = PauseFlag { at: Utc::now(), by: "ops@host".into() };
        assert_eq!(parse_flag(&serde_json::to_string(&f).unwrap()), f);
    }
}
