//! Run history: what ran, where, when, and how it ended.
//!
//! Workers write one [`RunEvent`] per settled run to a Redis stream per queue
//! (`<prefix>:history:<queue>`, `XADD … MAXLEN ~ history.max_len`, and `XTRIM … MINID ~` for
//! `history.max_age`), and the same event into the key's idempotency record (field `run:<n>`,
//! the last `history.runs_per_key` kept), so one key's runs are read without scanning a stream.
//! Both writes ride the worker's Redis batching and nobody waits for them: history is
//! best-effort and never delays an ack.
//!
//! Readers ([`HistoryReader`]) walk the streams newest first. A filtered search reads at most
//! `budget` entries per queue and says so when it stopped early, so a page over a million
//! entries stays fast.

use chrono::{DateTime, TimeZone, Utc};
use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

use crate::config::RedisConfig;
use crate::names::Names;

/// Most bytes of an error kept in an event.
pub const ERROR_BYTES: usize = 1024;

/// How a run (or a delivery that could not run) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The handler succeeded and `done` was recorded.
    Succeeded,
    /// The attempt failed; the next one was published to the delay chain.
    Retried,
    /// The message went to its DLQ (`reason` says why).
    DeadLettered,
    /// A scheduled slot picked up past its deadline was skipped.
    Expired,
    /// The worker stopped the run at its drain deadline; the message went back to the queue.
    Stopped,
    /// Another owner took the key over while this run was going; that owner settles it.
    LostLease,
}

impl Outcome {
    /// Every outcome, in a fixed order.
    pub const ALL: [Outcome; 6] = [
        Outcome::Succeeded,
        Outcome::Retried,
        Outcome::DeadLettered,
        Outcome::Expired,
        Outcome::Stopped,
        Outcome::LostLease,
    ];

    /// The spelling in events, filters and URLs.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Retried => "retried",
            Outcome::DeadLettered => "dead_lettered",
            Outcome::Expired => "expired",
            Outcome::Stopped => "stopped",
            Outcome::LostLease => "lost_lease",
        }
    }

    /// Parses [`Outcome::as_str`]'s spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.as_str() == s)
    }
}

/// One run, or one delivery settled without running (expired, dead-lettered on arrival).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunEvent {
    /// Job name (empty for a message that was not a chime envelope).
    pub job: String,
    /// Idempotency key (empty when unknown).
    pub key: String,
    /// Message id of the copy that ran.
    pub id: String,
    /// Logical queue.
    pub queue: String,
    /// Attempt number (0 when unknown).
    pub attempt: u32,
    /// The job's `max_attempts` (0 when unknown).
    pub max_attempts: u32,
    /// Worker id.
    pub worker: String,
    /// When the handler started; `None` when none ran.
    pub started_at: Option<DateTime<Utc>>,
    /// When the delivery was settled.
    pub finished_at: DateTime<Utc>,
    /// How it ended.
    pub outcome: Outcome,
    /// Handler run time in milliseconds, when one ran.
    pub duration_ms: Option<u64>,
    /// Dead-letter reason (`x-chime-reason`), for `dead_lettered`.
    pub reason: Option<String>,
    /// The error, at most [`ERROR_BYTES`] (cut on a character boundary).
    pub error: Option<String>,
    /// Stream entry id, when read from a stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<String>,
}

/// `s` cut to at most `max` bytes on a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn ms(t: DateTime<Utc>) -> String {
    t.timestamp_millis().to_string()
}

fn from_ms(s: &str) -> Option<DateTime<Utc>> {
    s.parse::<i64>().ok().and_then(|ms| Utc.timestamp_millis_opt(ms).single())
}

impl RunEvent {
    /// The stream entry's fields (the same names in every entry, which streams store once per
    /// node).
    pub fn fields(&self) -> [(&'static str, String); 12] {
        [
            ("job", self.job.clone()),
            ("key", self.key.clone()),
            ("id", self.id.clone()),
            ("attempt", self.attempt.to_string()),
            ("max", self.max_attempts.to_string()),
            ("worker", self.worker.clone()),
            ("started", self.started_at.map(ms).unwrap_or_default()),
            ("finished", ms(self.finished_at)),
            ("outcome", self.outcome.as_str().to_string()),
            ("ms", self.duration_ms.map(|d| d.to_string()).unwrap_or_default()),
            ("reason", self.reason.clone().unwrap_or_default()),
            ("error", self.error.clone().unwrap_or_default()),
        ]
    }

    /// An event read back from entry `entry` of `queue`'s stream; `None` if it is not one.
    pub fn from_fields(queue: &str, entry: &str, f: &HashMap<String, String>) -> Option<Self> {
        let get = |k: &str| f.get(k).map(String::as_str).unwrap_or("");
        let opt = |k: &str| Some(get(k).to_string()).filter(|v| !v.is_empty());
        Some(Self {
            job: get("job").to_string(),
            key: get("key").to_string(),
            id: get("id").to_string(),
            queue: queue.to_string(),
            attempt: get("attempt").parse().unwrap_or(0),
            max_attempts: get("max").parse().unwrap_or(0),
            worker: get("worker").to_string(),
            started_at: from_ms(get("started")),
            finished_at: from_ms(get("finished"))?,
            outcome: Outcome::parse(get("outcome"))?,
            duration_ms: get("ms").parse().ok(),
            reason: opt("reason"),
            error: opt("error"),
            entry: Some(entry.to_string()),
        })
    }

    /// The event as the JSON kept in the key's record.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// What to look for in the history.
#[derive(Debug, Clone, Default)]
pub struct Query {
    /// Only these queues (default: every queue given to the reader).
    pub queue: Option<String>,
    /// Only this job.
    pub job: Option<String>,
    /// Only this idempotency key (read from the key's record, not the streams).
    pub key: Option<String>,
    /// Only this outcome.
    pub outcome: Option<Outcome>,
    /// Only events finished at or after this.
    pub since: Option<DateTime<Utc>>,
    /// Only events older than this stream entry id (the next page).
    pub before: Option<String>,
    /// At most this many events (newest first).
    pub limit: usize,
}

/// What a search found.
#[derive(Debug, Clone, Default)]
pub struct Found {
    /// Matching events, newest first.
    pub events: Vec<RunEvent>,
    /// Stream entries read.
    pub scanned: usize,
    /// The search stopped at its budget before reaching the oldest entry or `since`: older
    /// matches may exist (search again with `before` = the last entry read).
    pub truncated: Option<String>,
}

/// A key's idempotency record, decoded.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KeyRecord {
    /// `run`, `dying`, `done`, `dead`, `free`; `None` when there is no record.
    pub state: Option<String>,
    /// Owner token of the last claim (`<worker>:<n>`).
    pub owner: Option<String>,
    /// Fence of the last claim (µs of Redis `TIME` at that claim).
    pub fence: Option<u64>,
    /// When the last claim was taken.
    pub claimed_at: Option<DateTime<Utc>>,
    /// When the last outcome was recorded.
    pub finished_at: Option<DateTime<Utc>>,
    /// End of the current lease, while `run`.
    pub lease_until: Option<DateTime<Utc>>,
    /// Time until Redis expires the record, in ms.
    pub expires_in_ms: Option<i64>,
    /// The dead letter being published, while `dying`: reason.
    pub dying_reason: Option<String>,
    /// The key's last runs, oldest first.
    pub runs: Vec<RunEvent>,
}

impl KeyRecord {
    /// Decodes the fields of an idempotency hash and its `PTTL`.
    pub fn decode(fields: &HashMap<String, String>, pttl: i64) -> Self {
        let get = |k: &str| fields.get(k).cloned().filter(|v| !v.is_empty());
        let at = |k: &str| get(k).as_deref().and_then(from_ms).filter(|t| t.timestamp_millis() > 0);
        let mut runs: Vec<(u64, RunEvent)> = fields
            .iter()
            .filter_map(|(k, v)| {
                let n = k.strip_prefix("run:")?.parse::<u64>().ok()?;
                Some((n, serde_json::from_str::<RunEvent>(v).ok()?))
            })
            .collect();
        runs.sort_by_key(|(n, _)| *n);
        Self {
            state: get("s"),
            owner: get("o"),
            fence: get("f").and_then(|f| f.parse().ok()),
            claimed_at: at("c"),
            finished_at: at("t"),
            lease_until: if get("s").as_deref() == Some("run") { at("u") } else { None },
            expires_in_ms: (pttl >= 0).then_some(pttl),
            dying_reason: get("r"),
            runs: runs.into_iter().map(|(_, r)| r).collect(),
        }
    }
}

/// Reads the history, key records and related state for the CLI and the dashboard.
#[derive(Clone)]
pub struct HistoryReader {
    conn: MultiplexedConnection,
    names: Names,
    /// Most entries a filtered search reads per queue.
    pub budget: usize,
}

/// Entries read per `XREVRANGE`.
const PAGE: usize = 1000;

impl HistoryReader {
    /// Connects to Redis (within `redis.timeout`).
    pub async fn connect(config: &RedisConfig, names: Names) -> redis::RedisResult<Self> {
        let client = redis::Client::open(config.url.as_str())?;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(config.timeout))
            .set_response_timeout(Some(config.timeout));
        let conn = client.get_multiplexed_async_connection_with_config(&cfg).await?;
        Ok(Self { conn, names, budget: 100_000 })
    }

    /// The decoded record of `key` (state, owner, fence, times, TTL, last runs).
    pub async fn record(&self, key: &str) -> redis::RedisResult<KeyRecord> {
        let mut conn = self.conn.clone();
        let idem = self.names.idem_key(key);
        let (fields, pttl): (HashMap<String, String>, i64) =
            redis::pipe().hgetall(&idem).pttl(&idem).query_async(&mut conn).await?;
        Ok(KeyRecord::decode(&fields, pttl))
    }

    /// States of several keys at once (`None`: no record), in order.
    pub async fn states(
        &self,
        keys: &[String],
    ) -> redis::RedisResult<Vec<Option<(String, Option<DateTime<Utc>>)>>> {
        let mut pipe = redis::pipe();
        for k in keys {
            pipe.cmd("HMGET").arg(self.names.idem_key(k)).arg("s").arg("t");
        }
        let mut conn = self.conn.clone();
        let rows: Vec<(Option<String>, Option<String>)> = pipe.query_async(&mut conn).await?;
        Ok(rows.into_iter().map(|(s, t)| s.map(|s| (s, t.as_deref().and_then(from_ms)))).collect())
    }

    /// Events matching `q` across `queues`, newest first.
    pub async fn search(&self, queues: &[String], q: &Query) -> redis::RedisResult<Found> {
        if let Some(key) = &q.key {
            let record = self.record(key).await?;
            let mut events: Vec<RunEvent> =
                record.runs.into_iter().rev().filter(|e| matches(e, q)).take(q.limit).collect();
            events.sort_by_key(|e| std::cmp::Reverse(e.finished_at));
            return Ok(Found { events, scanned: 0, truncated: None });
        }
        let mut found = Found::default();
        let selected = queues.iter().filter(|name| q.queue.as_ref().is_none_or(|w| w == *name));
        for queue in selected {
            let (events, scanned, truncated) = self.search_queue(queue, q).await?;
            found.events.extend(events);
            found.scanned += scanned;
            if truncated.is_some() {
                found.truncated = truncated;
            }
        }
        // Entry ids are `<ms>-<seq>` of the Redis clock: newest first across queues.
        found.events.sort_by_key(|e| std::cmp::Reverse(entry_order(e)));
        found.events.truncate(q.limit);
        Ok(found)
    }

    async fn search_queue(
        &self,
        queue: &str,
        q: &Query,
    ) -> redis::RedisResult<(Vec<RunEvent>, usize, Option<String>)> {
        let stream = self.names.history(queue);
        let mut conn = self.conn.clone();
        let mut end = match &q.before {
            Some(id) => format!("({id}"),
            None => "+".to_string(),
        };
        let floor = q.since.map(|t| t.timestamp_millis().to_string()).unwrap_or_else(|| "-".into());
        let (mut out, mut scanned) = (Vec::new(), 0usize);
        // Without a filter beyond the range, the first `limit` entries are the answer.
        let page_size = if q.job.is_none() && q.outcome.is_none() { q.limit.clamp(1, PAGE) } else { PAGE };
        loop {
            let page: Vec<(String, Vec<String>)> = redis::cmd("XREVRANGE")
                .arg(&stream)
                .arg(&end)
                .arg(&floor)
                .arg("COUNT")
                .arg(page_size)
                .query_async(&mut conn)
                .await?;
            let n = page.len();
            for (id, flat) in &page {
                scanned += 1;
                let fields: HashMap<String, String> =
                    flat.chunks_exact(2).map(|kv| (kv[0].clone(), kv[1].clone())).collect();
                if let Some(e) = RunEvent::from_fields(queue, id, &fields)
                    && matches(&e, q)
                {
                    out.push(e);
                    if out.len() >= q.limit {
                        return Ok((out, scanned, None));
                    }
                }
            }
            let Some((last, _)) = page.last() else { return Ok((out, scanned, None)) };
            if n < page_size {
                return Ok((out, scanned, None));
            }
            if scanned >= self.budget {
                return Ok((out, scanned, Some(last.clone())));
            }
            end = format!("({last}");
        }
    }

    /// Number of events and bytes of memory of `queue`'s stream.
    pub async fn stream_size(&self, queue: &str) -> redis::RedisResult<(u64, Option<u64>)> {
        let stream = self.names.history(queue);
        let mut conn = self.conn.clone();
        let len: u64 = redis::cmd("XLEN").arg(&stream).query_async(&mut conn).await?;
        let bytes: Option<u64> =
            redis::cmd("MEMORY").arg("USAGE").arg(&stream).query_async(&mut conn).await?;
        Ok((len, bytes))
    }

    /// Events ever added to `queue`'s stream (`XINFO STREAM` `entries-added`, Redis 7; 0 if
    /// the stream does not exist yet), for rates.
    pub async fn entries_added(&self, queue: &str) -> redis::RedisResult<u64> {
        let stream = self.names.history(queue);
        let mut conn = self.conn.clone();
        let info: redis::RedisResult<HashMap<String, redis::Value>> =
            redis::cmd("XINFO").arg("STREAM").arg(&stream).query_async(&mut conn).await;
        match info {
            Ok(map) => match map.get("entries-added") {
                Some(redis::Value::Int(n)) => Ok(u64::try_from(*n).unwrap_or(0)),
                _ => Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "no entries-added (Redis < 7)",
                ))),
            },
            Err(e) if e.to_string().contains("no such key") => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// The connection, for the other Redis reads of the CLI and the dashboard.
    pub fn connection(&self) -> MultiplexedConnection {
        self.conn.clone()
    }
}

fn entry_order(e: &RunEvent) -> (u64, u64) {
    let id = e.entry.as_deref().unwrap_or("");
    let (a, b) = id.split_once('-').unwrap_or((id, "0"));
    (a.parse().unwrap_or(0), b.parse().unwrap_or(0))
}

fn matches(e: &RunEvent, q: &Query) -> bool {
    q.job.as_ref().is_none_or(|j| *j == e.job)
        && q.outcome.is_none_or(|o| o == e.outcome)
        && q.since.is_none_or(|t| e.finished_at >= t)
        && q.queue.as_ref().is_none_or(|w| *w == e.queue)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> RunEvent {
        RunEvent {
            job: "report".into(),
            key: "k".into(),
            id: "i".into(),
            queue: "default".into(),
            attempt: 2,
            max_attempts: 5,
            worker: "host:1".into(),
            started_at: Utc.timestamp_millis_opt(1_700_000_000_000).single(),
            finished_at: Utc.timestamp_millis_opt(1_700_000_000_250).single().unwrap_or_default(),
            outcome: Outcome::DeadLettered,
            duration_ms: Some(250),
            reason: Some("permanent".into()),
            error: Some("bad input".into()),
            entry: None,
        }
    }

    #[test]
    fn events_round_trip_through_stream_fields_and_json() {
        let e = event();
        let fields: HashMap<String, String> =
            e.fields().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let back = RunEvent::from_fields("default", "1-0", &fields).unwrap();
        assert_eq!(RunEvent { entry: None, ..back.clone() }, e);
        assert_eq!(back.entry.as_deref(), Some("1-0"));
        assert_eq!(serde_json::from_str::<RunEvent>(&e.to_json()).unwrap(), e);
        let none = RunEvent { started_at: None, duration_ms: None, reason: None, error: None, ..e };
        let fields: HashMap<String, String> =
            none.fields().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        assert_eq!(
            RunEvent::from_fields("default", "1-0", &fields).map(|b| RunEvent { entry: None, ..b }),
            Some(none)
        );
    }

    #[test]
    fn records_decode_with_their_runs_in_order() {
        let mut f = HashMap::new();
        for (k, v) in [
            ("s", "done"),
            ("o", "w:3"),
            ("f", "1700000000000123"),
            ("c", "1700000000000"),
            ("t", "1700000000250"),
            ("u", "0"),
        ] {
            f.insert(k.to_string(), v.to_string());
        }
        let mut second = event();
        second.outcome = Outcome::Succeeded;
        f.insert("run:10".into(), second.to_json());
        f.insert("run:9".into(), event().to_json());
        f.insert("run:x".into(), "garbage".into());
        let r = KeyRecord::decode(&f, 5000);
        assert_eq!(r.state.as_deref(), Some("done"));
        assert_eq!(r.fence, Some(1_700_000_000_000_123));
        assert_eq!(r.lease_until, None, "no lease once settled");
        assert_eq!(r.expires_in_ms, Some(5000));
        assert_eq!(
            r.runs.iter().map(|e| e.outcome).collect::<Vec<_>>(),
            [Outcome::DeadLettered, Outcome::Succeeded]
        );
        assert_eq!(KeyRecord::decode(&HashMap::new(), -2).state, None);
    }

    #[test]
    fn truncation_respects_characters() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("abc", 10), "abc");
    }
}
