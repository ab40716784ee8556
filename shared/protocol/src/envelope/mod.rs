//! Envelope v1: the JSON body of every chime message, and the idempotency keys.
//!
//! Keys derive from the *scheduled instant* (or the caller's key), never from `now()`, so
//! every ticker replica, restart or catch-up produces the same key for the same slot. The
//! attempt counter travels here and is never derived from `x-death` or delivery counts,
//! whose meaning changed between RabbitMQ 3.10, 3.13, 4.0 and 4.3.

use chrono::{DateTime, SecondsFormat, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use serde::{Deserialize, Deserializer, Serialize};
use uuid::Uuid;

/// The only envelope version this release reads and writes.
pub const VERSION: u32 = 1;

/// Namespace of chime's UUIDv5 keys: UUIDv5(URL namespace, `"https://chime.dev/ns/idempotency"`).
/// Changing it changes every key: never do.
pub const NAMESPACE: Uuid = Uuid::from_u128(0x7f5a_2425_8181_5667_9a90_8823_4fab_d9fe);

/// Where a message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// Published by the ticker for a due slot.
    Schedule,
    /// Published by `chime enqueue` or the producer library.
    Adhoc,
    /// Published again from a dead-letter queue by `chime dlq replay`.
    Replay,
}

impl Source {
    /// The wire spelling (`schedule`, `adhoc`, `replay`), also used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Schedule => "schedule",
            Source::Adhoc => "adhoc",
            Source::Replay => "replay",
        }
    }
}

/// The message body. Every field is required on the wire (`null` where allowed). Fields this
/// release does not know are accepted and kept (a rolling deploy adds fields; `v` changes only
/// for breaking changes), so a retry published by an older worker still carries them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Wire-format version ([`VERSION`]).
    pub v: u32,
    /// UUIDv7 of this message instance.
    pub id: Uuid,
    /// Idempotency key.
    pub key: Uuid,
    /// Job name; selects the handler.
    pub job: String,
    /// Logical queue (without prefix) the message was published to.
    pub queue: String,
    /// Job arguments, any JSON value.
    pub payload: serde_json::Value,
    /// Scheduled instant (UTC) of a scheduled run; `null` for ad-hoc runs.
    #[serde(deserialize_with = "required_nullable", serialize_with = "time::serialize_opt")]
    pub slot: Option<DateTime<Utc>>,
    /// When the first attempt was published.
    #[serde(serialize_with = "time::serialize")]
    pub enqueued_at: DateTime<Utc>,
    /// Starts at 1; carried by chime.
    pub attempt: u32,
    /// Attempts allowed in total, first run included (at most [`MAX_ATTEMPTS`]).
    pub max_attempts: u32,
    /// Who published the message.
    pub source: Source,
    /// The producer's W3C trace context: a `traceparent` value
    /// (`00-<trace id>-<parent span id>-<flags>`), which the worker's run span continues; a
    /// value that is not one is ignored.
    #[serde(deserialize_with = "required_nullable")]
    pub trace_id: Option<String>,
    /// The W3C `tracestate` that goes with `trace_id`, passed along unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_state: Option<String>,
    /// A fanned-out run (sharded or broadcast): the key of the whole run, which names its
    /// group record; each copy has a key of its own derived from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<Uuid>,
    /// A sharded run: this copy's shard, 0-based.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    /// A sharded run: how many shards the run has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<u32>,
    /// A broadcast run: the worker this copy is for (delivered through that worker's own
    /// queue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Delivery order when a backlog exists; `None` is normal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// Published by `chime backfill` for a past slot: a job's `deadline` counts from
    /// `enqueued_at` (the backfill), not from the slot, which is past on purpose.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub backfill: bool,
    /// A step of a workflow (a scheduled chain, an ad-hoc DAG, a fanned-out run's members and
    /// its `on_complete` job): what it waits for, and whether its end releases other steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<Step>,
    /// Fields of newer releases, passed through unchanged.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A workflow step (the envelope's `step`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// The workflow's key: names its record (`<prefix>:workflow:<key>`), or, for a
    /// fanned-out run, its group.
    pub workflow: Uuid,
    /// This step's name within the workflow.
    pub name: String,
    /// The steps it waits for (none: it starts at once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<Upstream>,
    /// What they must have come to: every one `done` (a chain), or merely ended (`on_complete`).
    #[serde(default, skip_serializing_if = "Wait::is_done")]
    pub wait: Wait,
    /// Whether some step waits for this one: its `done` or `dead` releases them at once.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub releases: bool,
}

/// A step another waits for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Upstream {
    /// Its name within the workflow.
    pub step: String,
    /// Its job.
    pub job: String,
    /// Its idempotency key.
    pub key: Uuid,
}

/// What a step waits for its upstream steps to come to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Wait {
    /// Every one `done`: a dead or cancelled one blocks the step (`after`).
    #[default]
    Done,
    /// Every one ended: `done`, `dead` or `cancelled` (`on_complete`).
    Ended,
}

impl Wait {
    fn is_done(&self) -> bool {
        *self == Wait::Done
    }
}

/// Key of step `step` of the workflow keyed `workflow`: UUIDv5(ns, "{workflow}#step:{step}").
pub fn step_key(workflow: Uuid, step: &str) -> Uuid {
    Uuid::new_v5(&NAMESPACE, format!("{workflow}#step:{step}").as_bytes())
}

/// Key of the `on_complete` run of the fanned-out run keyed `base`: UUIDv5(ns,
/// "{base}#complete").
pub fn completion_key(base: Uuid) -> Uuid {
    Uuid::new_v5(&NAMESPACE, format!("{base}#complete").as_bytes())
}

/// With `deserialize_with`, serde no longer treats a missing `Option` field as `None`: the
/// field must be present, though it may be `null`.
fn required_nullable<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d)
}

// Most attempts a job may have (first run included). More is not a retry policy but a loop.
pub use chime_job::MAX_ATTEMPTS;

/// Why a body is not a valid envelope (the message is dead-lettered as `malformed`).
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The parser's message can quote the offending bytes: control characters are escaped,
    /// since the reason is logged and sent along in `x-chime-error`.
    #[error("body is not a chime envelope: {}", crate::escape_control(&.0.to_string()))]
    Json(#[from] serde_json::Error),
    /// `v` is not the version this release reads.
    #[error("unsupported envelope version {0} (this release reads v{VERSION})")]
    Version(u32),
    #[error("attempt {attempt} is outside 1..=max_attempts ({max}), or max_attempts is above {MAX_ATTEMPTS}")]
    /// `attempt` is 0 or above `max_attempts`, or `max_attempts` is above [`MAX_ATTEMPTS`].
    Attempt {
        /// The envelope's attempt.
        attempt: u32,
        /// The envelope's max_attempts.
        max: u32,
    },
    /// `shard`/`shards` that name no shard: `shards` outside 1..=[`MAX_SHARDS`], `shard` not
    /// below it, or one without the other.
    #[error(
        "shard {shard:?} of {shards:?} names no shard (shards 1..={MAX_SHARDS}, shard below shards, both or neither)"
    )]
    Shard {
        /// The envelope's shard.
        shard: Option<u32>,
        /// The envelope's shards.
        shards: Option<u32>,
    },
    #[error("{field} {value:?} is not a valid name (1-100 letters, digits, '-', '_' or '.')")]
    /// The job or queue name is empty, too long or has characters outside the name alphabet.
    Name {
        /// `job` or `queue`.
        field: &'static str,
        /// The offending value.
        value: String,
    },
}

/// Most shards a run may have on the wire (the config allows 1,000; `shards = "workers"` as
/// many as there are workers).
pub const MAX_SHARDS: u32 = 10_000;

/// Delivery order when a backlog exists: `high` before `normal` before `low`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Deserialize, serde::Serialize, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Ahead of the others.
    High,
    /// The default.
    #[default]
    Normal,
    /// Behind the others.
    Low,
}

impl Priority {
    /// Every level, highest first.
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];
    /// `high`, `normal` or `low`.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }
}

impl std::str::FromStr for Priority {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "high" => Ok(Priority::High),
            "normal" => Ok(Priority::Normal),
            "low" => Ok(Priority::Low),
            _ => Err(format!("{s:?}: high, normal or low")),
        }
    }
}

/// Key of a scheduled run: UUIDv5(ns, "{job}@{slot as RFC 3339 UTC, seconds}").
pub fn scheduled_key(job: &str, slot: DateTime<Utc>) -> Uuid {
    let name = format!("{job}@{}", slot.to_rfc3339_opts(SecondsFormat::Secs, true));
    Uuid::new_v5(&NAMESPACE, name.as_bytes())
}

/// Key of an ad-hoc run with a caller key: UUIDv5(ns, "{job}#{key}").
pub fn adhoc_key(job: &str, key: &str) -> Uuid {
    Uuid::new_v5(&NAMESPACE, format!("{job}#{key}").as_bytes())
}

/// Key of an ad-hoc run without a caller key: random (UUIDv7).
pub fn random_key() -> Uuid {
    new_id()
}

thread_local! {
    /// This thread's UUIDv7 counter. `Uuid::now_v7` takes one mutex shared by the whole
    /// process: two threads preparing a batch's halves spent ~12 % of their time on it.
    static IDS: uuid::ContextV7 = const { uuid::ContextV7::new() };
}

/// A new UUIDv7 (its first 48 bits the time in milliseconds, then a counter reseeded at
/// random each millisecond and random bits): ordered among the ids of one thread, unique
/// across threads and processes by its random bits.
pub fn new_id() -> Uuid {
    IDS.with(|c| Uuid::new_v7(uuid::Timestamp::now(c)))
}

/// [`new_id`] and the instant it was made, the clock read once.
fn new_id_at() -> (Uuid, DateTime<Utc>) {
    let now = std::time::SystemTime::now();
    let since = now.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let id = IDS.with(|c| Uuid::new_v7(uuid::Timestamp::from_unix(c, since.as_secs(), since.subsec_nanos())));
    (id, DateTime::<Utc>::from(now))
}

/// Key of shard `shard` of `shards` of the run keyed `base`: UUIDv5(ns,
/// "{base}#shard:{shard}/{shards}"). Every ticker replica derives the same keys for a slot.
pub fn shard_key(base: Uuid, shard: u32, shards: u32) -> Uuid {
    Uuid::new_v5(&NAMESPACE, format!("{base}#shard:{shard}/{shards}").as_bytes())
}

/// Key of the copy of the broadcast run keyed `base` for worker `worker`: UUIDv5(ns,
/// "{base}#worker:{worker}").
pub fn broadcast_key(base: Uuid, worker: &str) -> Uuid {
    Uuid::new_v5(&NAMESPACE, format!("{base}#worker:{worker}").as_bytes())
}

pub use crate::names::worker_route;

/// The route of `queue`'s level `priority`: the queue itself for `normal`, else
/// `<queue>^high` or `<queue>^low` (`^` is outside the name alphabet: no queue is called so).
pub fn priority_route(queue: &str, priority: Priority) -> String {
    match priority {
        Priority::Normal => queue.to_string(),
        p => crate::names::level_route(queue, p.as_str()),
    }
}

/// How deep a payload may nest (arrays and objects within one another; `[]` is one level).
/// Workers read a body with serde_json's limit of 128 levels, and the payload sits one level
/// down in an envelope, three in a pack: 100 leaves room for both.
pub const MAX_PAYLOAD_DEPTH: usize = 100;

/// Why a payload nesting deeper than [`MAX_PAYLOAD_DEPTH`] is refused (see [`too_deep`]).
pub fn too_deep_message() -> String {
    format!(
        "nests deeper than {MAX_PAYLOAD_DEPTH} levels (arrays and objects within one another): a worker could not read it"
    )
}

/// Whether `payload` nests deeper than [`MAX_PAYLOAD_DEPTH`]; it looks no further down than
/// that, so a value built deeper in code costs no more (and cannot exhaust the stack).
pub fn too_deep(payload: &serde_json::Value) -> bool {
    fn deeper(v: &serde_json::Value, left: usize) -> bool {
        use serde_json::Value;
        match v {
            Value::Array(a) => left == 0 || a.iter().any(|x| deeper(x, left - 1)),
            Value::Object(m) => left == 0 || m.values().any(|x| deeper(x, left - 1)),
            _ => false,
        }
    }
    deeper(payload, MAX_PAYLOAD_DEPTH)
}

/// What an envelope's body spends, at most, on its keys, punctuation, and values of a fixed
/// size (numbers of up to 10 digits, ids of 38 bytes, instants of up to 35, names of enums,
/// `null`s and the quotes of its strings): 463 bytes at most today, with room to spare.
const FIXED_BOUND: usize = 1024;

/// An upper bound of `v`'s compact JSON length (as serde_json writes it): strings at most 6
/// bytes a byte, numbers at most 24 characters (integers by itoa, floats by ryu).
fn value_bound(v: &serde_json::Value) -> usize {
    use serde_json::Value;
    match v {
        Value::Null => 4,
        Value::Bool(_) => 5,
        Value::Number(_) => 24,
        Value::String(s) => 2 + 6 * s.len(),
        Value::Array(a) => 2 + a.iter().map(|x| value_bound(x) + 1).sum::<usize>(),
        Value::Object(m) => {
            2 + m.iter().map(|(k, x)| 2 + 6 * k.len() + 1 + value_bound(x) + 1).sum::<usize>()
        }
    }
}

impl Envelope {
    /// A fresh envelope for attempt 1.
    pub fn new(
        job: &str,
        queue: &str,
        key: Uuid,
        payload: serde_json::Value,
        slot: Option<DateTime<Utc>>,
        max_attempts: u32,
        source: Source,
    ) -> Self {
        let (id, enqueued_at) = new_id_at();
        Self {
            v: VERSION,
            id,
            key,
            job: job.to_string(),
            queue: queue.to_string(),
            payload,
            slot,
            enqueued_at,
            attempt: 1,
            max_attempts,
            source,
            trace_id: None,
            trace_state: None,
            group: None,
            shard: None,
            shards: None,
            target: None,
            priority: None,
            backfill: false,
            step: None,
            extra: serde_json::Map::new(),
        }
    }

    /// Where the message goes: a queue of the prefix (`<prefix>.q.<route>`). The job's queue,
    /// or its priority level's queue, or, for a broadcast copy, its worker's own queue.
    pub fn route(&self) -> String {
        match (&self.target, self.priority) {
            (Some(worker), _) => worker_route(worker),
            (None, Some(p)) => priority_route(&self.queue, p),
            (None, None) => self.queue.clone(),
        }
    }

    /// The JSON body.
    pub fn encode(&self) -> Vec<u8> {
        // Serialising this struct cannot fail: every field is a plain JSON value. Sized for a
        // typical envelope (about 300 bytes with a small payload): one allocation, no regrowth.
        let mut body = Vec::with_capacity(512);
        match serde_json::to_writer(&mut body, self) {
            Ok(()) => body,
            Err(_) => Vec::new(),
        }
    }

    /// `Ok` when [`Self::encode`]'s body is at most `max` bytes, else `Err` with its length.
    /// The body is counted only when a cheap upper bound of its length (nothing encoded)
    /// exceeds `max`: most envelopes are far below any limit.
    pub fn check_len(&self, max: usize) -> Result<(), usize> {
        if self.len_bound().is_some_and(|b| b <= max) {
            return Ok(());
        }
        let n = self.encoded_len();
        if n <= max { Ok(()) } else { Err(n) }
    }

    /// An upper bound of [`Self::encode`]'s length, nothing encoded: every key, punctuation
    /// and fixed-size value within [`FIXED_BOUND`], each string at most 6 bytes a byte
    /// (`\u00XX`), the payload by [`value_bound`]; `None` for a workflow step or fields of
    /// newer releases (counted exactly instead).
    fn len_bound(&self) -> Option<usize> {
        // Every field named: a field added to the envelope must be accounted for here.
        let Envelope {
            v: _,
            id: _,
            key: _,
            job,
            queue,
            payload,
            slot: _,
            enqueued_at: _,
            attempt: _,
            max_attempts: _,
            source: _,
            trace_id,
            trace_state,
            group: _,
            shard: _,
            shards: _,
            target,
            priority: _,
            backfill: _,
            step,
            extra,
        } = self;
        if step.is_some() || !extra.is_empty() {
            return None;
        }
        let text = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        let strings = job.len() + queue.len() + text(trace_id) + text(trace_state) + text(target);
        Some(FIXED_BOUND + 6 * strings + value_bound(payload))
    }

    /// The length of [`Self::encode`]'s body, counted without building it.
    pub fn encoded_len(&self) -> usize {
        /// Counts the bytes written to it.
        struct Count(usize);
        impl std::io::Write for Count {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0 += buf.len();
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut n = Count(0);
        match serde_json::to_writer(&mut n, self) {
            Ok(()) => n.0,
            Err(_) => 0,
        }
    }

    /// Parses and validates a body: version, attempt range and names.
    pub fn decode(body: &[u8]) -> Result<Self, DecodeError> {
        let env: Envelope = serde_json::from_slice(body)?;
        if env.v != VERSION {
            return Err(DecodeError::Version(env.v));
        }
        if env.attempt == 0
            || env.max_attempts == 0
            || env.attempt > env.max_attempts
            || env.max_attempts > MAX_ATTEMPTS
        {
            return Err(DecodeError::Attempt { attempt: env.attempt, max: env.max_attempts });
        }
        match (env.shard, env.shards) {
            (None, None) => {}
            (Some(shard), Some(shards)) if (1..=MAX_SHARDS).contains(&shards) && shard < shards => {}
            (shard, shards) => return Err(DecodeError::Shard { shard, shards }),
        }
        for (field, value) in [("job", &env.job), ("queue", &env.queue)] {
            if !chime_job::valid_name(value) {
                // Shown with escapes: the value comes from the wire.
                let value: String = value.chars().take(100).collect();
                return Err(DecodeError::Name { field, value });
            }
        }
        Ok(env)
    }

    /// AMQP properties: `message_id = key`, `type = job`, `timestamp`, persistent, JSON.
    pub fn properties(&self) -> BasicProperties {
        properties_of(self.key, &self.job, self.timestamp())
    }

    /// The AMQP `timestamp` of its message: `enqueued_at` in whole seconds.
    pub fn timestamp(&self) -> u64 {
        u64::try_from(self.enqueued_at.timestamp()).unwrap_or(0)
    }
}

/// [`Envelope::properties`] of an envelope of `key` and `job` enqueued at `timestamp` (s).
pub fn properties_of(key: Uuid, job: &str, timestamp: u64) -> BasicProperties {
    BasicProperties::default()
        .with_content_type(ShortString::from("application/json"))
        .with_delivery_mode(2)
        .with_message_id(ShortString::from(
            key.hyphenated().encode_lower(&mut Uuid::encode_buffer()).to_string(),
        ))
        .with_type(ShortString::from(job.to_string()))
        .with_timestamp(timestamp)
}

/// Reads a string header (long or short string) from AMQP properties.
pub fn header_str(props: &BasicProperties, name: &str) -> Option<String> {
    let headers = props.headers().as_ref()?;
    match headers.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        AMQPValue::LongLongInt(n) => Some(n.to_string()),
        AMQPValue::LongInt(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Inserts a string header.
pub fn put_header(table: &mut FieldTable, name: &str, value: &str) {
    table.insert(ShortString::from(name), AMQPValue::LongString(LongString::from(value)));
}

pub mod pack;
mod time;

#[cfg(test)]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound that spares most envelopes their counting is never below the length, with
    /// every field at its longest: strings of characters escaped as `\u00XX`, numbers of 24
    /// characters, instants beyond the year 9999; and `check_len` is exact at the limit.
    #[test]
    fn the_length_bound_is_never_below_the_length() {
        let worst = "\u{1}\"\\é\n".repeat(30);
        let payload = serde_json::json!({
            worst.clone(): [f64::MIN_POSITIVE, -f64::MAX, i64::MIN, u64::MAX, null, true, false, worst.clone()],
            "nested": {"a": [[[]]], "b": {}, "c": -1.234_567_890_123_456_7e-300},
        });
        let far: DateTime<Utc> = "+200000-12-31T23:59:59.999999999Z".parse().unwrap();
        let mut env =
            Envelope::new(&worst, &worst, Uuid::now_v7(), payload, Some(far), u32::MAX, Source::Replay);
        env.enqueued_at = far;
        env.attempt = u32::MAX;
        env.v = u32::MAX;
        env.trace_id = Some(worst.clone());
        env.trace_state = Some(worst.clone());
        env.group = Some(Uuid::now_v7());
        env.shard = Some(u32::MAX);
        env.shards = Some(u32::MAX);
        env.target = Some(worst.clone());
        env.priority = Some(Priority::Normal);
        env.backfill = true;
        let exact = env.encoded_len();
        assert_eq!(exact, env.encode().len());
        let bound = env.len_bound().unwrap();
        assert!(bound >= exact, "bound {bound} < length {exact}");
        // The fixed part alone: an envelope of empty strings and a null payload.
        let mut bare = env.clone();
        (bare.job, bare.queue, bare.payload) = (String::new(), String::new(), serde_json::Value::Null);
        (bare.trace_id, bare.trace_state, bare.target) =
            (Some(String::new()), Some(String::new()), Some(String::new()));
        assert!(bare.encoded_len() + 4 <= FIXED_BOUND, "{}", bare.encoded_len());
        assert_eq!(env.check_len(exact), Ok(()));
        assert_eq!(env.check_len(exact - 1), Err(exact));
        // A small envelope is far below its bound's limit; one with newer fields is counted.
        let small =
            Envelope::new("j", "q", Uuid::now_v7(), serde_json::json!({"i": 1}), None, 3, Source::Adhoc);
        assert_eq!(small.check_len(small.encoded_len()), Ok(()));
        assert_eq!(small.check_len(10), Err(small.encoded_len()));
        let mut newer = small.clone();
        newer.extra.insert("later".into(), serde_json::json!("x".repeat(2000)));
        assert_eq!(newer.len_bound(), None);
        assert_eq!(newer.check_len(2000), Err(newer.encoded_len()));
    }

    #[test]
    fn new_ids_are_version_7_ordered_on_a_thread_and_unique_across_threads() {
        let made = |n| (0..n).map(|_| new_id()).collect::<Vec<_>>();
        let threads: Vec<_> = (0..4).map(|_| std::thread::spawn(move || made(20_000))).collect();
        let mut all = std::collections::HashSet::new();
        for t in threads {
            let ids = t.join().unwrap();
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "ordered on their thread");
            assert!(ids.iter().all(|id| id.get_version_num() == 7));
            all.extend(ids);
        }
        assert_eq!(all.len(), 80_000, "no id made twice");
        // An envelope's id carries the instant it was enqueued, to the millisecond.
        let env = Envelope::new("j", "q", random_key(), serde_json::Value::Null, None, 1, Source::Adhoc);
        let (secs, nanos) = env.id.get_timestamp().unwrap().to_unix();
        let millis = |s: u64, n: u32| s * 1000 + u64::from(n / 1_000_000);
        let at = env.enqueued_at;
        assert_eq!(millis(secs, nanos), millis(at.timestamp() as u64, at.timestamp_subsec_nanos()));
    }

    #[test]
    fn the_deepest_payload_allowed_is_read_back_alone_and_in_a_pack() {
        let nested = |depth: usize, inner: serde_json::Value| {
            (0..depth).fold(inner, |v, i| {
                if i % 2 == 0 { serde_json::json!([v]) } else { serde_json::json!({"k": v}) }
            })
        };
        let deepest = nested(MAX_PAYLOAD_DEPTH, serde_json::json!(1));
        assert!(!too_deep(&deepest));
        assert!(too_deep(&nested(MAX_PAYLOAD_DEPTH + 1, serde_json::json!(1))));
        assert!(too_deep(&nested(MAX_PAYLOAD_DEPTH, serde_json::json!([]))), "[] is a level");
        let env = Envelope::new("j", "q", random_key(), deepest.clone(), None, 1, Source::Adhoc);
        let body = env.encode();
        assert_eq!(Envelope::decode(&body).unwrap().payload, deepest);
        let packed = pack::encode(&[&body]);
        let members = pack::split(&packed).unwrap();
        assert_eq!(Envelope::decode(members[0]).unwrap().payload, deepest);
        // Deeper values, as code can build them, are judged without recursing through them.
        assert!(too_deep(&nested(1_000, serde_json::Value::Null)));
    }

    #[test]
    fn namespace_is_derived_as_documented() {
        let derived = Uuid::new_v5(&Uuid::NAMESPACE_URL, b"https://chime.dev/ns/idempotency");
        assert_eq!(NAMESPACE, derived, "namespace constant must be {derived}");
    }

    /// This vector must never change between releases: keys already in Redis and in queues
    /// would stop matching, and a rolling upgrade would double-run every slot.
    #[test]
    fn fixed_key_vector() {
        let slot: DateTime<Utc> = "2026-03-29T01:00:00Z".parse().unwrap();
        assert_eq!(scheduled_key("nightly-report", slot).to_string(), "6c94badc-ac49-57fc-aff9-efaefacce06b",);
        assert_eq!(adhoc_key("send-invoice", "inv-42").to_string(), "ca3fe340-5e83-5ff8-b0c0-619f773233f1");
    }

    #[test]
    fn keys_ignore_sub_second_and_offset_spelling() {
        let a: DateTime<Utc> = "2026-03-29T03:00:00+02:00".parse().unwrap();
        let b: DateTime<Utc> = "2026-03-29T01:00:00Z".parse().unwrap();
        assert_eq!(scheduled_key("j", a), scheduled_key("j", b));
        assert_ne!(scheduled_key("j", b), scheduled_key("k", b));
        assert_ne!(random_key(), random_key());
    }

    fn sample() -> Envelope {
        Envelope::new(
            "j",
            "default",
            adhoc_key("j", "k"),
            serde_json::json!({"a": 1}),
            None,
            3,
            Source::Adhoc,
        )
    }

    #[test]
    fn round_trip() {
        let e = sample();
        assert_eq!(Envelope::decode(&e.encode()).unwrap(), e);
    }

    #[test]
    fn malformed_bodies_are_rejected() {
        assert!(Envelope::decode(b"not json").is_err());
        let mut v: serde_json::Value = serde_json::from_slice(&sample().encode()).unwrap();
        v.as_object_mut().unwrap().remove("slot");
        let e = Envelope::decode(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(e.to_string().contains("slot"), "{e}");
        let mut v: serde_json::Value = serde_json::from_slice(&sample().encode()).unwrap();
        v["v"] = 2.into();
        assert!(matches!(Envelope::decode(&serde_json::to_vec(&v).unwrap()), Err(DecodeError::Version(2))));
        let mut v: serde_json::Value = serde_json::from_slice(&sample().encode()).unwrap();
        v["attempt"] = 0.into();
        assert!(Envelope::decode(&serde_json::to_vec(&v).unwrap()).is_err());
        for (field, value) in [
            ("max_attempts", serde_json::json!(4_294_967_295u32)),
            ("queue", "de\u{0}fault".into()),
            ("job", "j\nINFO forged".into()),
        ] {
            let mut v: serde_json::Value = serde_json::from_slice(&sample().encode()).unwrap();
            v[field] = value;
            let e = Envelope::decode(&serde_json::to_vec(&v).unwrap()).unwrap_err().to_string();
            assert!(!e.contains('\n') && !e.contains('\u{0}'), "{field}: {e}");
        }
    }

    #[test]
    fn floats_survive_a_retry_to_the_last_bit() {
        // Found by fuzzing: without serde_json's correctly rounded parsing this value came back
        // one ulp off after a decode and re-encode, i.e. after a retry.
        let mut e = sample();
        e.payload = serde_json::json!({"x": 3.886955734428261e269, "y": 0.1 + 0.2});
        assert_eq!(Envelope::decode(&e.encode()).unwrap(), e);
    }

    #[test]
    fn unknown_fields_are_accepted_and_kept() {
        let mut v: serde_json::Value = serde_json::from_slice(&sample().encode()).unwrap();
        v["tenant"] = "acme".into();
        v["trace"] = serde_json::json!({"id": 2, "sampled": true});
        let e = Envelope::decode(&serde_json::to_vec(&v).unwrap()).unwrap();
        assert_eq!(e.extra["tenant"], "acme");
        let again: serde_json::Value = serde_json::from_slice(&e.encode()).unwrap();
        assert_eq!(again, v, "a republished envelope carries the fields it did not know");
    }

    #[test]
    fn properties_follow_the_contract() {
        let e = sample();
        let p = e.properties();
        assert_eq!(p.message_id().as_ref().unwrap().as_str(), e.key.to_string());
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "j");
        assert_eq!(*p.delivery_mode(), Some(2));
    }
}
