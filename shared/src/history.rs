//! Run history: what ran, where, when, and how it ended.
//!
//! Workers record one [`RunEvent`] per settled run in a Redis stream per queue
//! (`<prefix>:history:<queue>`): a run is appended at the head of the Redis pipeline that
//! carries (or precedes) the script recording its outcome, the runs of one pipeline up to
//! [`RUNS_PER_ENTRY`] to an entry (field `runs`), capped at `history.max_len /
//! RUNS_PER_ENTRY` entries and by `history.max_age`. A key recorded `done` therefore has its
//! run in the stream, even when its worker is killed right after. The same run, as one short
//! line, goes into the key's idempotency record (field `run:<n>`, the last
//! `history.runs_per_key` kept; written by the script that records the outcome), so one key's
//! runs are read without scanning a stream. Nobody waits for the stream's append: history
//! never adds a round trip to a run.
//!
//! Readers ([`HistoryReader`]) walk the streams newest first. A filtered search reads at most
//! `budget` entries per queue and says so when it stopped early, so a page over a million
//! entries stays fast.

use crate::redis_conn::RedisConn;
use chrono::{DateTime, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

use crate::config::RedisConfig;
use crate::names::Names;
use crate::record::{KeyState, StoredResult};

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
    /// The ticker did not publish a scheduled slot: its job's previous run was still in
    /// progress (`overlap = "skip"`, or `"buffer_one"` with one slot already waiting).
    Skipped,
    /// The run must wait (its rate limit, a global concurrency slot, a downstream that pushed
    /// back): it was sent round the delay chain for about that long, its attempt unchanged
    /// (`reason` says why).
    Parked,
    /// Skipped while its queue was backed up past its shedding threshold (a `sheddable` job):
    /// the run by a worker, or the slot by the ticker (`error` says which threshold).
    Shed,
    /// Cancelled (`chime cancel`): the run stopped by its worker, or, for a key no run held,
    /// the cancellation itself.
    Cancelled,
    /// An older copy of a key a newer enqueue replaced (debounce, replace), dropped.
    Superseded,
    /// A workflow step whose upstream step is dead or cancelled: it waits (parked) until
    /// that step is replayed and done (`error` names it).
    Blocked,
}

impl Outcome {
    /// Every outcome, in a fixed order.
    pub const ALL: [Outcome; 12] = [
        Outcome::Succeeded,
        Outcome::Retried,
        Outcome::DeadLettered,
        Outcome::Expired,
        Outcome::Stopped,
        Outcome::LostLease,
        Outcome::Skipped,
        Outcome::Parked,
        Outcome::Shed,
        Outcome::Cancelled,
        Outcome::Superseded,
        Outcome::Blocked,
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
            Outcome::Skipped => "skipped",
            Outcome::Parked => "parked",
            Outcome::Shed => "shed",
            Outcome::Cancelled => "cancelled",
            Outcome::Superseded => "superseded",
            Outcome::Blocked => "blocked",
        }
    }

    /// One letter, for a key's record lines.
    pub fn code(self) -> char {
        match self {
            Outcome::Succeeded => 's',
            Outcome::Retried => 'r',
            Outcome::DeadLettered => 'd',
            Outcome::Expired => 'e',
            Outcome::Stopped => 'x',
            Outcome::LostLease => 'l',
            Outcome::Skipped => 'k',
            Outcome::Parked => 'p',
            Outcome::Shed => 'h',
            Outcome::Cancelled => 'c',
            Outcome::Superseded => 'u',
            Outcome::Blocked => 'b',
        }
    }

    /// Parses [`Outcome::code`].
    pub fn from_code(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| s.len() == 1 && s.starts_with(o.code()))
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
    /// Where it was read from a stream: `<entry id>:<index in the entry>` (a search given it
    /// as `before` continues with the runs older than this one).
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

/// When a run that took `duration_ms` and finished at `finished` started.
fn started(finished: DateTime<Utc>, duration_ms: Option<u64>) -> Option<DateTime<Utc>> {
    duration_ms.map(|d| finished - chrono::Duration::milliseconds(i64::try_from(d).unwrap_or(0)))
}

fn from_ms(s: &str) -> Option<DateTime<Utc>> {
    s.parse::<i64>().ok().and_then(|ms| Utc.timestamp_millis_opt(ms).single())
}

impl RunEvent {
    /// The run's values in a stream entry: job, key, message id and its
    /// [`RunEvent::record_line`].
    pub fn stream_values(&self) -> [String; 4] {
        [self.job.clone(), self.key.clone(), self.id.clone(), self.record_line()]
    }

    /// The run as its key's record keeps it, one line: `<outcome code> <attempt> <max>
    /// <finished_ms> <duration_ms or -> <worker>`, then `\n<reason>\n<error>` when either is
    /// present. The key, job and queue are the record's own (`j`, `q`), so a run that
    /// succeeded fits Redis's compact hash encoding (values up to 64 bytes) with a worker id
    /// of up to ~35 characters.
    pub fn record_line(&self) -> String {
        use std::fmt::Write as _;
        let extra = self.reason.as_deref().map_or(0, str::len) + self.error.as_deref().map_or(0, str::len);
        let mut line = String::with_capacity(64 + self.worker.len() + extra);
        let _ = write!(
            line,
            "{} {} {} {} ",
            self.outcome.code(),
            self.attempt,
            self.max_attempts,
            self.finished_at.timestamp_millis()
        );
        match self.duration_ms {
            Some(d) => {
                let _ = write!(line, "{d}");
            }
            None => line.push('-'),
        }
        line.push(' ');
        line.push_str(&self.worker);
        if self.reason.is_some() || self.error.is_some() {
            line.push('\n');
            line.push_str(self.reason.as_deref().unwrap_or(""));
            line.push('\n');
            line.push_str(self.error.as_deref().unwrap_or(""));
        }
        line
    }

    /// A run of `key` (job `job` on `queue`) from its record line; `None` if it is not one.
    pub fn from_record_line(line: &str, key: &str, job: &str, queue: &str) -> Option<Self> {
        let (head, tail) = match line.split_once('\n') {
            Some((h, t)) => (h, Some(t)),
            None => (line, None),
        };
        let mut f = head.splitn(6, ' ');
        let outcome = Outcome::from_code(f.next()?)?;
        let attempt = f.next()?.parse().ok()?;
        let max_attempts = f.next()?.parse().ok()?;
        let finished_at = Utc.timestamp_millis_opt(f.next()?.parse().ok()?).single()?;
        let duration_ms = f.next()?.parse().ok();
        let worker = f.next()?.to_string();
        let (reason, error) = match tail.map(|t| t.split_once('\n').unwrap_or((t, ""))) {
            Some((r, e)) => {
                (Some(r.to_string()).filter(|r| !r.is_empty()), Some(e.to_string()).filter(|e| !e.is_empty()))
            }
            None => (None, None),
        };
        Some(Self {
            job: job.to_string(),
            key: key.to_string(),
            id: String::new(),
            queue: queue.to_string(),
            attempt,
            max_attempts,
            worker,
            started_at: started(finished_at, duration_ms),
            finished_at,
            outcome,
            duration_ms,
            reason,
            error,
            entry: None,
        })
    }

    /// The event as the JSON kept in the key's record.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Runs per stream entry, at most: a worker appends the runs of one Redis pipeline a few to
/// an entry (one `XADD` per entry is what a run costs Redis), and the stream is capped at
/// `history.max_len / RUNS_PER_ENTRY` entries.
pub const RUNS_PER_ENTRY: usize = 8;

/// One stream entry's `runs` field: a JSON array of `[job, key, id, line]`, oldest first.
pub fn encode_entry(runs: &[[String; 4]]) -> String {
    serde_json::to_string(runs).unwrap_or_else(|_| "[]".into())
}

/// Appends `events` (each to its queue's stream, one entry each) and to their keys' records
/// when these exist: for what the ticker decides about a slot (a skipped one). Best-effort,
/// like all history; the stream is trimmed by the workers' next writes.
pub async fn append(
    conn: &mut RedisConn,
    names: &crate::topology::Names,
    events: &[RunEvent],
) -> redis::RedisResult<()> {
    let mut pipe = redis::pipe();
    for e in events {
        pipe.cmd("XADD")
            .arg(names.history(&e.queue))
            .arg("*")
            .arg("runs")
            .arg(encode_entry(std::slice::from_ref(&e.stream_values())))
            .ignore();
    }
    pipe.query_async(conn).await
}

/// The runs of stream entry `entry` of `queue`, oldest first; each event's `entry` is
/// `<entry>:<index>`, the cursor a search continues before.
pub fn decode_entry(queue: &str, entry: &str, fields: &HashMap<String, String>) -> Vec<RunEvent> {
    let Some(runs) = fields.get("runs") else { return Vec::new() };
    let Ok(runs) = serde_json::from_str::<Vec<[String; 4]>>(runs) else { return Vec::new() };
    runs.iter()
        .enumerate()
        .filter_map(|(i, [job, key, id, line])| {
            let mut e = RunEvent::from_record_line(line, key, job, queue)?;
            e.id = id.clone();
            e.entry = Some(format!("{entry}:{i}"));
            Some(e)
        })
        .collect()
}

/// Whether `s` is a cursor a search can continue before: a stream entry id (`<ms>-<seq>`, or
/// `<ms>`) with an optional `:<index>`, as [`decode_entry`] writes them. Anything else would
/// reach Redis as a range bound and fail there.
pub fn valid_cursor(s: &str) -> bool {
    let (entry, index) = s.split_once(':').unwrap_or((s, "0"));
    let (ms, seq) = entry.split_once('-').unwrap_or((entry, "0"));
    [ms, seq, index].iter().all(|p| !p.is_empty() && p.len() <= 20 && p.bytes().all(|b| b.is_ascii_digit()))
        && ms.parse::<u64>().is_ok()
        && seq.parse::<u64>().is_ok()
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
    /// Where the next page starts (`before` for the next search): the oldest stream position
    /// this page reached, when the page is full or the search stopped at its budget.
    pub next: Option<String>,
}

/// Outcome counts over a window, by job, queue and worker (see [`HistoryReader::totals`]).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Totals {
    /// `(job, outcome)` → runs.
    pub by_job: BTreeMap<String, BTreeMap<String, u64>>,
    /// `(queue, outcome)` → runs.
    pub by_queue: BTreeMap<String, BTreeMap<String, u64>>,
    /// `(worker, outcome)` → runs.
    pub by_worker: BTreeMap<String, BTreeMap<String, u64>>,
    /// Runs counted.
    pub runs: u64,
    /// Runs read (all matched the query's filters when `runs == scanned`).
    pub scanned: usize,
    /// The count stopped at the search budget: older runs in the window were not counted.
    pub truncated: bool,
}

impl Totals {
    fn add(&mut self, e: &RunEvent) {
        let outcome = e.outcome.as_str().to_string();
        let job = if e.job.is_empty() { "-".to_string() } else { e.job.clone() };
        for (map, name) in [
            (&mut self.by_job, job),
            (&mut self.by_queue, e.queue.clone()),
            (&mut self.by_worker, e.worker.clone()),
        ] {
            *map.entry(name).or_default().entry(outcome.clone()).or_default() += 1;
        }
        self.runs += 1;
    }
}

/// A key's idempotency record, decoded.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KeyRecord {
    /// The record's state; `None` when there is no record.
    pub state: Option<KeyState>,
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
    /// What a `done` run returned, or why nothing is kept (too large, not serialisable, past
    /// `results.retention`).
    #[serde(flatten)]
    pub result: Option<StoredResult>,
    /// The last checkpoint saved under the key (JSON), until a run succeeds.
    pub checkpoint: Option<serde_json::Value>,
    /// The key's last runs, oldest first.
    pub runs: Vec<RunEvent>,
    /// A workflow step that has not run: what it waits for, or what blocks it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// Workflow steps registered as waiting for this key (released by its `done` or `dead`).
    #[serde(skip_serializing_if = "is_zero")]
    pub waiters: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl KeyRecord {
    /// Decodes the fields of `key`'s idempotency hash and its `PTTL`, read at `now` (Redis
    /// `TIME`: a result's expiry was written by it, so a reader's own clock is not asked).
    pub fn decode(key: &str, fields: &HashMap<String, String>, pttl: i64, now: DateTime<Utc>) -> Self {
        let get = |k: &str| fields.get(k).cloned().filter(|v| !v.is_empty());
        let at = |k: &str| get(k).as_deref().and_then(from_ms).filter(|t| t.timestamp_millis() > 0);
        let (job, queue) = (get("j").unwrap_or_default(), get("q").unwrap_or_default());
        let mut runs: Vec<(u64, RunEvent)> = fields
            .iter()
            .filter_map(|(k, v)| {
                let n = k.strip_prefix("run:")?.parse::<u64>().ok()?;
                Some((n, RunEvent::from_record_line(v, key, &job, &queue)?))
            })
            .collect();
        runs.sort_by_key(|(n, _)| *n);
        let until = get("rt").and_then(|t| t.parse::<i64>().ok());
        let state = get("s").map(|s| KeyState::parse(&s));
        Self {
            lease_until: if state == Some(KeyState::Running) { at("u") } else { None },
            state,
            owner: get("o"),
            fence: get("f").and_then(|f| f.parse().ok()),
            claimed_at: at("c"),
            finished_at: at("t"),
            expires_in_ms: (pttl >= 0).then_some(pttl),
            dying_reason: get("r"),
            result: StoredResult::decode(get("res").as_deref(), until, now),
            checkpoint: get("cp").map(|c| serde_json::from_str(&c).unwrap_or(serde_json::Value::String(c))),
            runs: runs.into_iter().map(|(_, r)| r).collect(),
            waiting: get("wf"),
            waiters: fields.keys().filter(|k| k.starts_with("w:")).count(),
        }
    }
}

/// Reads the history, key records and related state for the CLI and the dashboard.
#[derive(Clone)]
pub struct HistoryReader {
    conn: RedisConn,
    names: Names,
    /// Most entries a filtered search reads per queue.
    pub budget: usize,
}

/// Entries read per `XREVRANGE`.
const PAGE: usize = 1000;

impl HistoryReader {
    /// Connects to Redis (within `redis.timeout`).
    pub async fn connect(config: &RedisConfig, names: Names) -> redis::RedisResult<Self> {
        let conn = RedisConn::connect(config).await?;
        Ok(Self { conn, names, budget: 100_000 })
    }

    /// Redis `TIME` (see [`crate::redis_conn::redis_now`]).
    pub async fn now(&self) -> redis::RedisResult<DateTime<Utc>> {
        crate::redis_conn::redis_now(&mut self.conn.clone()).await
    }

    /// The decoded record of `key` (state, owner, fence, times, TTL, last runs), its result
    /// judged by Redis `TIME` (read in the same round trip).
    pub async fn record(&self, key: &str) -> redis::RedisResult<KeyRecord> {
        let mut conn = self.conn.clone();
        let idem = self.names.idem_key(key);
        let (fields, pttl, time): (HashMap<String, String>, i64, (i64, i64)) =
            redis::pipe().hgetall(&idem).pttl(&idem).cmd("TIME").query_async(&mut conn).await?;
        Ok(KeyRecord::decode(key, &fields, pttl, crate::redis_conn::instant_of(time)))
    }

    /// States of several keys at once (`None`: no record), in order.
    pub async fn states(
        &self,
        keys: &[String],
    ) -> redis::RedisResult<Vec<Option<(KeyState, Option<DateTime<Utc>>)>>> {
        let mut pipe = redis::pipe();
        for k in keys {
            pipe.cmd("HMGET").arg(self.names.idem_key(k)).arg("s").arg("t");
        }
        let mut conn = self.conn.clone();
        let rows: Vec<(Option<String>, Option<String>)> = pipe.query_async(&mut conn).await?;
        Ok(rows
            .into_iter()
            .map(|(s, t)| s.map(|s| (KeyState::parse(&s), t.as_deref().and_then(from_ms))))
            .collect())
    }

    /// Events matching `q` across `queues`, newest first.
    pub async fn search(&self, queues: &[String], q: &Query) -> redis::RedisResult<Found> {
        if let Some(key) = &q.key {
            let record = self.record(key).await?;
            let mut events: Vec<RunEvent> =
                record.runs.into_iter().rev().filter(|e| matches(e, q)).take(q.limit).collect();
            events.sort_by_key(|e| std::cmp::Reverse(e.finished_at));
            return Ok(Found { events, scanned: 0, truncated: None, next: None });
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
        // Entry ids are `<ms>-<seq>` of the Redis clock: the page is the newest entries across
        // queues, and the next one starts where it ends.
        found.events.sort_by_key(|e| std::cmp::Reverse(entry_order(e)));
        found.events.truncate(q.limit);
        found.next = found.truncated.clone().or_else(|| {
            (found.events.len() == q.limit)
                .then(|| found.events.last().and_then(|e| e.entry.clone()))
                .flatten()
        });
        // Shown in finish order: each worker writes its runs in entries of its own, as its
        // pipelines go out, so stream order across workers is not quite the order runs ended in.
        found.events.sort_by_key(|e| std::cmp::Reverse((e.finished_at, entry_order(e))));
        Ok(found)
    }

    /// Counts the runs matching `q` (its `limit` and `before` ignored) by job, queue and
    /// worker and outcome: "did everything run?" over a window (`q.since`). Bounded by the
    /// search budget per queue, and says when it stopped there.
    pub async fn totals(&self, queues: &[String], q: &Query) -> redis::RedisResult<Totals> {
        let all = Query { limit: usize::MAX, before: None, key: None, ..q.clone() };
        let mut totals = Totals::default();
        let selected = queues.iter().filter(|name| all.queue.as_ref().is_none_or(|w| w == *name));
        for queue in selected {
            let (events, scanned, truncated) = self.search_queue(queue, &all).await?;
            events.iter().for_each(|e| totals.add(e));
            totals.scanned += scanned;
            totals.truncated |= truncated.is_some();
        }
        Ok(totals)
    }

    async fn search_queue(
        &self,
        queue: &str,
        q: &Query,
    ) -> redis::RedisResult<(Vec<RunEvent>, usize, Option<String>)> {
        let stream = self.names.history(queue);
        let mut conn = self.conn.clone();
        // A cursor `<entry>:<i>` continues inside that entry, before its run `i`; a bare
        // entry id continues before the entry.
        let (mut end, mut skip_from) = match q.before.as_deref().map(|b| b.split_once(':').unwrap_or((b, "")))
        {
            Some((id, "")) => (format!("({id}"), None),
            Some((id, i)) => (id.to_string(), i.parse::<usize>().ok()),
            None => ("+".to_string(), None),
        };
        // A window reaching before 1970 starts at the stream's beginning (ids are not negative).
        let floor = q.since.map(|t| t.timestamp_millis().max(0).to_string()).unwrap_or_else(|| "-".into());
        let (mut out, mut scanned) = (Vec::new(), 0usize);
        // Without a filter beyond the range, the first entries hold the answer.
        let page_size = if q.job.is_none() && q.outcome.is_none() {
            q.limit.div_ceil(RUNS_PER_ENTRY).clamp(1, PAGE) + 1
        } else {
            PAGE
        };
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
                let fields: HashMap<String, String> =
                    flat.chunks_exact(2).map(|kv| (kv[0].clone(), kv[1].clone())).collect();
                let mut runs = decode_entry(queue, id, &fields);
                if let Some(i) = skip_from.take() {
                    runs.truncate(i);
                }
                for e in runs.into_iter().rev() {
                    scanned += 1;
                    if matches(&e, q) {
                        out.push(e);
                        if out.len() >= q.limit {
                            return Ok((out, scanned, None));
                        }
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
    pub fn connection(&self) -> RedisConn {
        self.conn.clone()
    }
}

fn entry_order(e: &RunEvent) -> (u64, u64, u64) {
    let cursor = e.entry.as_deref().unwrap_or("");
    let (id, i) = cursor.split_once(':').unwrap_or((cursor, "0"));
    let (a, b) = id.split_once('-').unwrap_or((id, "0"));
    (a.parse().unwrap_or(0), b.parse().unwrap_or(0), i.parse().unwrap_or(0))
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

    #[test]
    fn cursors_are_entry_ids_with_an_optional_index() {
        for ok in ["1764698000000-0", "1764698000000-0:3", "1764698000000", "0-1:0"] {
            assert!(valid_cursor(ok), "{ok}");
        }
        for bad in [
            "nightly",
            "",
            "-",
            "1-",
            "-1",
            "1-0:",
            "1-0:x",
            "+",
            "(1-0",
            "1-0 ",
            "99999999999999999999999-0",
        ] {
            assert!(!valid_cursor(bad), "{bad}");
        }
    }

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
        let ok = RunEvent { outcome: Outcome::Succeeded, reason: None, error: None, ..e.clone() };
        let fields: HashMap<String, String> =
            [("runs".to_string(), encode_entry(&[e.stream_values(), ok.stream_values()]))].into();
        let back = decode_entry("default", "1-0", &fields);
        assert_eq!(back.len(), 2);
        assert_eq!(RunEvent { entry: None, ..back[0].clone() }, e);
        assert_eq!(RunEvent { entry: None, ..back[1].clone() }, ok);
        assert_eq!(back[1].entry.as_deref(), Some("1-0:1"));
        assert!(
            decode_entry("default", "1-0", &[("runs".to_string(), "nonsense".to_string())].into()).is_empty()
        );
        assert_eq!(serde_json::from_str::<RunEvent>(&e.to_json()).unwrap(), e);
        let line = e.record_line();
        let back = RunEvent::from_record_line(&line, &e.key, &e.job, &e.queue).unwrap();
        assert_eq!(back, RunEvent { id: String::new(), ..e.clone() });
        let ok = RunEvent {
            reason: None,
            error: None,
            worker: "invoice-worker-7d9f8c6b5-x2x9k:1".into(),
            ..e.clone()
        };
        assert!(ok.record_line().len() <= 64, "a success fits the compact encoding: {}", ok.record_line());
        let none = RunEvent { started_at: None, duration_ms: None, reason: None, error: None, ..e.clone() };
        let fields: HashMap<String, String> =
            [("runs".to_string(), encode_entry(&[none.stream_values()]))].into();
        let back = decode_entry("default", "1-0", &fields);
        assert_eq!(back.into_iter().map(|b| RunEvent { entry: None, ..b }).collect::<Vec<_>>(), [none]);
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
        f.insert("run:10".into(), second.record_line());
        f.insert("run:9".into(), event().record_line());
        f.insert("run:x".into(), "garbage".into());
        f.insert("run:11".into(), "z 1 1 1700000000250 - w".into());
        let multi = RunEvent { error: Some("line one\nline two".into()), ..event() };
        f.insert("run:12".into(), multi.record_line());
        f.insert("j".into(), event().job);
        f.insert("q".into(), event().queue);
        let r = KeyRecord::decode(&event().key, &f, 5000, Utc::now());
        assert_eq!(r.state, Some(KeyState::Done));
        assert_eq!(r.fence, Some(1_700_000_000_000_123));
        assert_eq!(r.lease_until, None, "no lease once settled");
        assert_eq!(r.expires_in_ms, Some(5000));
        assert_eq!(
            r.runs.iter().map(|e| e.outcome).collect::<Vec<_>>(),
            [Outcome::DeadLettered, Outcome::Succeeded, Outcome::DeadLettered]
        );
        assert_eq!(r.runs[2].error.as_deref(), Some("line one\nline two"));
        assert_eq!(r.runs[2].reason.as_deref(), Some("permanent"));
        assert_eq!(r.runs[0].job, event().job);
        assert_eq!(r.runs[1].key, event().key);
        assert_eq!(KeyRecord::decode("k", &HashMap::new(), -2, Utc::now()).state, None);
    }

    #[test]
    fn truncation_respects_characters() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("abc", 10), "abc");
    }
}
