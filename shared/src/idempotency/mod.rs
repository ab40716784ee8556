//! The Redis idempotency table: one hash per key, `<prefix>:idem:<key>`, driven only by the
//! atomic Lua scripts below (each touches exactly one key, so Redis Cluster works).
//!
//! Fields: `s` state (`run`, `dying`, `done`, `dead`, `free`), `o` owner token, `u` lease end
//! (ms of Redis `TIME`, so worker clocks do not matter), `f` fence, `c` when the last claim was
//! taken and `t` when the last outcome was recorded (ms of Redis `TIME`); while `dying`, also
//! `r` reason, `e` error and `a` attempts of the dead letter being published. With history on,
//! `n` counts the key's runs and `run:<n>` holds the last few as JSON ([`crate::history`]).
//! `cp` is the run's last checkpoint (written by its owner, cleared when it is `done`), `res`
//! the result a `done` run returned, `rt` the instant (ms) that result expires when that is
//! before the record does.
//!
//! **Fences** are microseconds of Redis `TIME`, raised to at least one above the last fence of
//! the key: strictly increasing while the record exists, and, after Redis lost the record
//! (restart without persistence, failover to a lagging replica, eviction), still above every
//! fence issued before, as long as the Redis clock (the new master's, after a failover) is not
//! behind by more than the time between the two claims. So a handler that keeps "the highest
//! fence seen" never rejects a legitimate run after data loss.
//!
//! **States.** `run`: claimed, lease until `u`, renewed by its owner. `dying`: the owner
//! decided to dead-letter and is publishing the DLQ copy; a copy that finds the key `dying`
//! (its publisher died or failed) publishes the dead letter again instead of dropping it.
//! `done`/`dead`: settled; later copies are duplicates. `free`: released for a retry.
//! `cancelled` (`chime cancel`, [`cancel`]): settled without running again; the owner of a
//! run in progress learns it at its next renewal (or sooner, from the cancellations stream),
//! and a copy that arrives later is dropped as cancelled. A run that still completes within
//! its grace records `done` (it did run).
//!
//! Every write refreshes the record's TTL to the retention, so a record never expires while
//! its job runs (`done_retention` is validated to exceed every job timeout plus a lease).
//!
//! This table makes duplicates rare, not impossible: a Redis failover or restart without
//! persistence loses keys. Handlers that need exactly-once effects use the key or the fence
//! in their own transaction.

pub mod circuit;
pub mod limit;
pub mod workflow;

use redis::aio::ConnectionLike;
use redis::{Cmd, Pipeline, Script, Value};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

use crate::config::{HistoryConfig, RedisConfig};
use crate::history::RunEvent;
use crate::redis_conn::RedisConn;
use crate::topology::Names;

/// `now` (µs) and `now_ms` from Redis `TIME`, and `int()` to write a number exactly (Redis
/// turns Lua numbers into strings with 14 significant digits, too few for microseconds).
const PRELUDE: &str = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) \
local now_ms = math.floor(now / 1000) local function int(x) return string.format('%.0f', x) end";

/// KEYS[1] idem key; ARGV owner, lease_ms, retention_ms, version (µs: the copy's
/// [`version_of`], or empty), attempt (the copy's, or empty). A copy older than the key's
/// newest version (`v`, set by debounce and replace) is `superseded`. A copy whose attempt is
/// below the key's next attempt (`na`, written when a retry was published) is `stale`: a
/// redelivered earlier attempt of a key whose retry is already on its way (its ack was lost:
/// a worker died, a pack was requeued) does not run again beside the retry. Claiming again with the same owner
/// token returns the same fence (a command resent after a connection drop is harmless). A
/// claim returns the key's last checkpoint (7th element), if any.
/// A `dying` key whose publisher's hold (`u`) has lapsed is handed to the caller (it becomes
/// the owner, holding it for a lease) with the dead letter's facts; while the publisher still
/// holds it, the copy is `busy` (a second dead letter only if the publisher died or gave up).
static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{PRELUDE}
{CLAIM_FN}
return claim(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])"
    ))
});

/// The body of [`CLAIM`] as a Lua function `claim(key, owner, lease_ms, retention_ms,
/// version, attempt)` (after [`PRELUDE`]), for the scripts that claim a key among other
/// work (the rate decision that lets a run start at once claims its key in the same call).
pub(crate) const CLAIM_FN: &str = r"local function claim(key, owner, lease_ms, retention_ms, version, attempt)
local h = redis.call('HMGET', key, 's', 'o', 'u', 'f', 'r', 'e', 'a', 'cp', 'v', 'na')
local s, fence = h[1], tonumber(h[4]) or 0
version, attempt = tonumber(version or ''), tonumber(attempt or '')
if s == 'cancelled' then return {s, fence, 0} end
if h[9] and version and version < tonumber(h[9]) then return {'superseded', fence, 0} end
if s == 'done' or s == 'dead' then return {s, fence, 0} end
if s == 'dying' then
  if h[2] ~= owner and (tonumber(h[3]) or 0) > now_ms then return {'busy', fence, tonumber(h[3]) - now_ms} end
  redis.call('HSET', key, 'o', owner, 'u', int(now_ms + tonumber(lease_ms)))
  redis.call('PEXPIRE', key, retention_ms)
  return {'dying', fence, 0, h[5] or '', h[6] or '', tonumber(h[7]) or 0}
end
if s == 'run' and h[2] == owner then return {'claimed', fence, 0, '', '', 0, h[8]} end
if s == 'run' and (tonumber(h[3]) or 0) > now_ms then return {'busy', fence, tonumber(h[3]) - now_ms} end
if attempt and h[10] and attempt < tonumber(h[10]) then return {'stale', fence, 0} end
fence = math.max(fence + 1, now)
redis.call('HSET', key, 's', 'run', 'o', owner, 'u', int(now_ms + tonumber(lease_ms)), 'f', int(fence), 'c', int(now_ms))
redis.call('PEXPIRE', key, retention_ms)
return {'claimed', fence, 0, '', '', 0, h[8]}
end";

/// KEYS[1]; ARGV owner, lease_ms, retention_ms → `{answer, fence}`: `renewed`; `lost` (another
/// owner or state holds the key); `recreated` (the record was gone: Redis lost data; it is
/// claimed again for this owner with a new fence, and the job keeps running).
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{PRELUDE}
local h = redis.call('HMGET', KEYS[1], 's', 'o', 'f')
if not h[1] then
  redis.call('HSET', KEYS[1], 's', 'run', 'o', ARGV[1], 'u', int(now_ms + tonumber(ARGV[2])), 'f', int(now))
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {{'recreated', now}}
end
if h[1] == 'cancelled' and h[2] == ARGV[1] then return {{'cancelled', tonumber(h[3]) or 0}} end
if h[1] ~= 'run' or h[2] ~= ARGV[1] then return {{'lost', tonumber(h[3]) or 0}} end
redis.call('HSET', KEYS[1], 'u', int(now_ms + tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {{'renewed', tonumber(h[3]) or 0}}"
    ))
});

/// Lua: `log_run(i)` appends the run line `ARGV[i]` to the record as `run:<n>`, keeps the last
/// `ARGV[i+1]`, and sets the record's job (`j`, `ARGV[i+2]`) and queue (`q`, `ARGV[i+3]`).
const LOG_RUN: &str = "local function log_run(i) \
local n = redis.call('HINCRBY', KEYS[1], 'n', 1) \
redis.call('HSET', KEYS[1], 'run:' .. n, ARGV[i], 'j', ARGV[i + 2], 'q', ARGV[i + 3]) \
local old = n - tonumber(ARGV[i + 1]) \
if old >= 1 then redis.call('HDEL', KEYS[1], 'run:' .. old) end end";

/// KEYS[1]; ARGV owner, fence, new state, retention_ms[, result, result retention ms (0: the
/// record's; its expiry is written by Redis `TIME`, as the record's own), run line,
/// runs kept, job, queue] → 1 recorded, 0 another owner holds the key, 2 recorded although
/// the record was gone (Redis lost data; `free` writes nothing). `done` stores the result
/// (unless empty) and clears the checkpoint. With a run, the run is appended to the record in
/// the same step (the run history's per-key index costs no command of its own).
static FINISH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{PRELUDE}
{LOG_RUN}
local function result()
  if ARGV[3] ~= 'done' then return end
  redis.call('HDEL', KEYS[1], 'cp', 'res', 'rt')
  if ARGV[5] and ARGV[5] ~= '' then
    redis.call('HSET', KEYS[1], 'res', ARGV[5])
    if ARGV[6] ~= '0' then redis.call('HSET', KEYS[1], 'rt', int(now_ms + tonumber(ARGV[6]))) end
  end
end
local h = redis.call('HMGET', KEYS[1], 's', 'o')
if not h[1] then
  if ARGV[3] ~= 'free' then
    redis.call('HSET', KEYS[1], 's', ARGV[3], 'o', ARGV[1], 'f', ARGV[2], 'u', 0, 't', int(now_ms))
    result()
    if ARGV[7] then log_run(7) end
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
  end
  return 2
end
local finished_anyway = h[1] == 'cancelled' and ARGV[3] == 'done'
if (h[1] ~= 'run' and h[1] ~= 'dying' and not finished_anyway) or h[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 's', ARGV[3], 'u', 0, 't', int(now_ms))
redis.call('HDEL', KEYS[1], 'r', 'e', 'a')
if ARGV[3] == 'free' and ARGV[5] and ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'na', ARGV[5]) end
result()
if ARGV[7] then log_run(7) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1"
    ))
});

/// KEYS[1]; ARGV owner, retention_ms[, run line, runs kept, job, queue] → 1 settled, 0 the key
/// already has a record (nothing written). A key that never runs (a slot the ticker skipped
/// for overlap or shed) becomes `done` with its run in the record, so a copy published for it
/// later is a duplicate; a key already published and claimed, or settled, is left as it is:
/// of two tickers deciding one slot (a lease that lapsed mid-publish) the first decision holds.
static SETTLE_UNRUN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{PRELUDE}
{LOG_RUN}
if redis.call('HEXISTS', KEYS[1], 's') == 1 then return 0 end
redis.call('HSET', KEYS[1], 's', 'done', 'o', ARGV[1], 'f', 0, 'u', 0, 't', int(now_ms))
if ARGV[3] then log_run(3) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1"
    ))
});

/// Settles `key`, which never runs, as `done` with `run` in its record (history on) unless it
/// already has a record: `Ok(false)` then, and nothing is written (a second decision for a
/// slot, or a key already published and claimed).
pub async fn settle_unrun(
    conn: &mut RedisConn,
    names: &Names,
    retention: Duration,
    history: &HistoryConfig,
    run: &RunEvent,
) -> Result<bool, IdemError> {
    let mut inv = SETTLE_UNRUN.key(names.idem_key(&run.key));
    inv.arg(&run.worker).arg(IdemStore::ms(retention));
    if history.enabled {
        inv.arg(run.record_line()).arg(history.runs_per_key).arg(&run.job).arg(&run.queue);
    }
    let n: i64 = inv.invoke_async(conn).await?;
    Ok(n == 1)
}

/// KEYS[1]; ARGV retention_ms, who → `{state before, owner, lease left ms, job, queue}`. A
/// key that is `done`, `dead`, `dying` or already `cancelled` is left as it is; any other
/// (running, free between attempts, a lapsed run, or no record at all: not started, or
/// unknown) becomes `cancelled`, keeping its owner (whose renewal then answers `cancelled`).
static CANCEL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{PRELUDE}
local h = redis.call('HMGET', KEYS[1], 's', 'o', 'u', 'j', 'q')
local s = h[1]
local left = math.max((tonumber(h[3]) or 0) - now_ms, 0)
if s == 'done' or s == 'dead' or s == 'dying' or s == 'cancelled' then
  return {{s, h[2] or '', 0, h[4] or '', h[5] or ''}}
end
if s == 'run' and left == 0 then s = 'lapsed' end
redis.call('HSET', KEYS[1], 's', 'cancelled', 'u', 0, 't', int(now_ms), 'x', ARGV[2])
if not h[1] then redis.call('HSET', KEYS[1], 'o', '', 'f', 0) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {{s or 'none', h[2] or '', left, h[4] or '', h[5] or ''}}"
    ))
});

/// KEYS[1]; ARGV version (µs), retention_ms → the key's state (`none` without one). Raises the
/// record's `v` to the version unless the key is settled: a copy whose version is below `v`
/// is superseded (`CLAIM` answers `superseded`).
static SUPERSEDE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local h = redis.call('HMGET', KEYS[1], 's', 'v')
local s = h[1]
if s == 'done' or s == 'dead' or s == 'dying' or s == 'cancelled' then return s end
if not h[2] or tonumber(h[2]) < tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'v', ARGV[1]) end
redis.call('HDEL', KEYS[1], 'na')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return s or 'none'",
    )
});

/// The version of a copy for debounce and replace: when its job was enqueued, in µs (retries
/// and delayed copies keep it).
pub fn version_of(env: &crate::envelope::Envelope) -> u64 {
    u64::try_from(env.enqueued_at.timestamp_micros()).unwrap_or(0)
}

/// Makes `version` the newest of `key` (debounce, replace): copies of the key with an older
/// version are dropped as superseded when they arrive. Returns the key's state (a settled key
/// is left as it is: a key `done` stays done).
pub async fn supersede(
    conn: &mut RedisConn,
    names: &Names,
    key: &str,
    version: u64,
    retention: Duration,
) -> Result<crate::record::KeyState, IdemError> {
    let mut inv = SUPERSEDE.key(names.idem_key(key));
    inv.arg(version).arg(IdemStore::ms(retention));
    let state: String = inv.invoke_async(conn).await.map_err(IdemError::classify)?;
    Ok(crate::record::KeyState::parse(&state))
}

/// What [`cancel`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancelled {
    /// A run held the key: its owner stops it (the token fires within about a second).
    Running {
        /// The run's owner token (`<worker>/<n>`).
        owner: String,
    },
    /// Between attempts (`free`), or its run's lease had lapsed: nothing runs it again.
    Waiting,
    /// No record: not started yet (queued or delayed), or a key chime does not know. A copy
    /// that arrives within `redis.done_retention` is dropped as cancelled.
    NotStarted,
    /// Already settled (`done`, `dead`, `dying` or `cancelled`): nothing changed.
    Settled(crate::record::KeyState),
}

/// Cancels `key` (see [`Cancelled`]); `who` is recorded with it (`x`). The job and queue of
/// the key, when its record knew them, come back for the history.
pub async fn cancel(
    conn: &mut RedisConn,
    names: &Names,
    key: &str,
    retention: Duration,
    who: &str,
) -> Result<(Cancelled, Option<(String, String)>), IdemError> {
    let mut inv = CANCEL.key(names.idem_key(key));
    inv.arg(IdemStore::ms(retention)).arg(who);
    let (state, owner, _left, job, queue): (String, String, u64, String, String) =
        inv.invoke_async(conn).await.map_err(IdemError::classify)?;
    let about = (!job.is_empty()).then_some((job, queue));
    let answer = match state.as_str() {
        "run" => {
            // Told to every worker (read twice a second); the owner's renewal is the fallback.
            let _: String = redis::cmd("XADD")
                .arg(names.cancels())
                .arg("MAXLEN")
                .arg("~")
                .arg(10_000)
                .arg("*")
                .arg("key")
                .arg(key)
                .query_async(conn)
                .await?;
            Cancelled::Running { owner }
        }
        "free" | "lapsed" => Cancelled::Waiting,
        "none" => Cancelled::NotStarted,
        other => Cancelled::Settled(crate::record::KeyState::parse(other)),
    };
    Ok((answer, about))
}

/// KEYS[1]; ARGV owner, checkpoint, retention_ms → 1 saved, 0 another owner (or a final
/// state) holds the key, 2 saved although the record was gone (Redis lost data: the
/// checkpoint waits for the next renewal, which re-creates the claim around it).
static CHECKPOINT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local h = redis.call('HMGET', KEYS[1], 's', 'o')
if h[1] and (h[1] ~= 'run' or h[2] ~= ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'cp', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if h[1] then return 1 end
return 2",
    )
});

/// KEYS[1]; ARGV run line, runs kept, job, queue. Appends a run to an existing record (see
/// `LOG_RUN`); writes nothing when there is no record (it would have no TTL).
static RUNLOG: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{LOG_RUN}
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
log_run(1)
return 1"
    ))
});

/// KEYS[1] a history stream; ARGV max entries, max age (ms), then one entry's runs per
/// argument (see [`crate::history::encode_entry`]). Appends the entries, then trims the stream
/// to the newest max entries and drops those older than max age, by Redis time (the entries'
/// ids are Redis time: a writer whose clock is days ahead would otherwise trim them all).
/// Exact trims, once per call (a call carries the runs of one pipeline): an approximate one
/// only drops whole stream nodes, which never happens to a quiet stream's last node.
static XADDS: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"for i = 3, #ARGV do
  redis.call('XADD', KEYS[1], '*', 'runs', ARGV[i])
end
redis.call('XTRIM', KEYS[1], 'MAXLEN', ARGV[1])
local t = redis.call('TIME')
local oldest = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[2])
if oldest > 0 then redis.call('XTRIM', KEYS[1], 'MINID', string.format('%.0f', oldest)) end
return #ARGV - 2",
    )
});

/// KEYS[1]; ARGV owner, fence, reason, error, attempts, retention_ms, lease_ms → 1 marked
/// `dying`, 0 another owner holds the key, 2 marked although the record was gone. The owner
/// holds the dying key for a lease while it publishes the dead letter (`u`): a copy arriving
/// meanwhile waits instead of publishing a second one.
static DYING: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{PRELUDE}
local h = redis.call('HMGET', KEYS[1], 's', 'o')
if h[1] and (h[1] ~= 'run' or h[2] ~= ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 's', 'dying', 'o', ARGV[1], 'f', ARGV[2], 'u', int(now_ms + tonumber(ARGV[7])), 'r', ARGV[3], 'e', ARGV[4], 'a', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
if h[1] then return 1 end
return 2",
    ))
});

/// KEYS[1]; ARGV owner. The owner of a `dying` key could not publish its dead letter: it lets
/// go of its hold, so the next copy dead-letters the key at once.
static LET_GO_DYING: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local h = redis.call('HMGET', KEYS[1], 's', 'o')
if h[1] ~= 'dying' or h[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'u', 0)
return 1",
    )
});

/// KEYS[1]. A dead key becomes free again (DLQ replay); so does a `dying` one (its worker
/// died between the dead letter's confirm and recording `dead`: the replay is what the
/// operator wants, not a second dead letter). 1 = revived, 0 = neither. Either way the key's
/// next attempt (`na`) is cleared: the replay's copy starts at attempt 1, and a letter
/// dead-lettered without a claim (an open circuit, an unknown job) after a retry left the key
/// `free` with `na` set — its replay must not be taken for a stale copy.
static REVIVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"redis.call('HDEL', KEYS[1], 'na')
local s = redis.call('HGET', KEYS[1], 's')
if s ~= 'dead' and s ~= 'dying' then return 0 end
redis.call('HSET', KEYS[1], 's', 'free', 'u', 0)
redis.call('HDEL', KEYS[1], 'r', 'e', 'a')
return 1",
    )
});

/// The claim script (`KEYS[1]`; ARGV owner, lease_ms, retention_ms → `{state, fence,
/// remaining_ms}`), for benchmarks and tools that drive Redis directly.
pub fn claim_script() -> &'static Script {
    &CLAIM
}

/// The finish script (`KEYS[1]`; ARGV owner, fence, state, retention_ms → 1, 0 or 2).
pub fn finish_script() -> &'static Script {
    &FINISH
}

/// Result of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Ours to run, with this fence token.
    Claimed {
        /// Fence token of the record (increases with every claim of the key).
        fence: u64,
        /// The checkpoint an earlier attempt (or copy) of the key saved, to resume from.
        checkpoint: Option<String>,
    },
    /// Already completed (a duplicate).
    Done {
        /// Fence token of the record (increases with every claim of the key).
        fence: u64,
    },
    /// Already dead-lettered (a duplicate of a dead job).
    Dead {
        /// Fence token of the record (increases with every claim of the key).
        fence: u64,
    },
    /// An older copy of a key a newer enqueue replaced (debounce, replace): dropped.
    Superseded {
        /// Fence token of the record (increases with every claim of the key).
        fence: u64,
    },
    /// An earlier attempt of a key whose retry is already published (this copy's ack was
    /// lost): dropped as a duplicate, the retry runs.
    Stale {
        /// Fence token of the record.
        fence: u64,
    },
    /// Cancelled (`chime cancel`): this copy is dropped as cancelled.
    Cancelled {
        /// Fence token of the record (increases with every claim of the key).
        fence: u64,
    },
    /// Another live owner holds it for `remaining` more.
    Busy {
        /// Fence token of the record (increases with every claim of the key).
        fence: u64,
        /// Time left on the owner's lease.
        remaining: Duration,
    },
    /// Decided dead, but its dead letter may not have reached the DLQ: the caller now owns
    /// the key and must publish the dead letter again (then record `dead`).
    Dying {
        /// Fence token of the record (increases with every claim of the key).
        fence: u64,
        /// The dead letter to publish again.
        dead: DeadInfo,
    },
}

/// What a `dying` record keeps of the dead letter being published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadInfo {
    /// `x-chime-reason`.
    pub reason: String,
    /// `x-chime-error` (already truncated by the caller).
    pub error: String,
    /// `x-chime-attempts`.
    pub attempts: u32,
}

/// Result of a lease renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Still ours, lease and TTL extended.
    Renewed,
    /// The record was gone (Redis lost data): claimed again for the same owner with this new
    /// fence; the job keeps running.
    Recreated {
        /// Fence token of the record (increases with every claim of the key).
        fence: u64,
    },
    /// Another owner (or a final state) holds the key: the lease was really taken over.
    Lost,
    /// The run was cancelled (`chime cancel`): stop it, settle nothing more.
    Cancelled,
}

/// Whether an outcome was written by [`IdemStore::finish`] or [`IdemStore::mark_dying`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Written over our own record.
    Yes,
    /// The record was gone (Redis lost data) and has been written anew.
    Recreated,
    /// Another owner holds the key (our lease lapsed and it was claimed); nothing written.
    NotOurs,
}

impl Recorded {
    fn from_reply(n: i64) -> Self {
        match n {
            1 => Recorded::Yes,
            2 => Recorded::Recreated,
            _ => Recorded::NotOurs,
        }
    }
}

/// Final state written by [`IdemStore::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Final {
    /// Ran to completion; duplicates are acked without running.
    Done,
    /// Dead-lettered (the dead letter is confirmed); duplicates are acked without running.
    Dead,
    /// Give the key back (parked, or shutdown before finishing): the same copy comes back.
    Free,
    /// Give the key back for a retry already published as attempt `.0`: a copy of an earlier
    /// attempt that arrives later (redelivered) is stale ([`Claim::Stale`]).
    Retry(u32),
}

impl Final {
    fn as_str(self) -> &'static str {
        match self {
            Final::Done => "done",
            Final::Dead => "dead",
            Final::Free | Final::Retry(_) => "free",
        }
    }
}

/// Errors of the idempotency store.
#[derive(Debug, Clone, thiserror::Error)]
pub enum IdemError {
    /// Redis could not be reached or refused the command.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A script replied with something this release does not expect.
    #[error("redis script returned an unexpected reply: {0}")]
    Protocol(String),
    /// The key's record is not a chime record (another type under the key, fields a script
    /// cannot read): a problem of this one key, not of Redis.
    #[error("the key's Redis record is not a chime record ({0}); delete or fix it, then replay the job")]
    BadRecord(String),
}

impl IdemError {
    /// The batching task is gone (its runtime shut down) before a call was answered.
    fn batcher_stopped() -> Self {
        IdemError::Protocol("redis batcher stopped".into())
    }

    /// A problem of one key's record, as opposed to Redis being unreachable.
    pub fn is_bad_record(&self) -> bool {
        matches!(self, IdemError::BadRecord(_))
    }

    /// Server replies that concern the key, not the connection.
    fn classify(e: redis::RedisError) -> Self {
        let script = e.code() == Some("ERR") && e.detail().is_some_and(|d| d.contains("script"));
        if e.code() == Some("WRONGTYPE") || script {
            IdemError::BadRecord(e.to_string())
        } else {
            IdemError::Redis(e)
        }
    }
}

/// Most commands sent in one pipeline.
const MAX_BATCH: usize = 256;

/// What the batching task is handed.
enum Op {
    /// One script call waiting for its pipeline.
    Call { cmd: Cmd, reply: oneshot::Sender<Result<Value, IdemError>> },
    /// A run for its queue's history stream, written at the head of the next pipeline, ahead
    /// of any call handed over after it (the finish that records its outcome).
    Run { stream: String, values: [String; 4], trim: Trim },
    /// One rate decision ([`IdemStore::take_rate`]): the decisions of one bucket that wait
    /// together are merged into one script call.
    Rate { key: String, ask: limit::RateAsk, reply: limit::RateReply },
}

/// How a history stream is cut as runs are appended.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Trim {
    /// Most entries kept (`history.max_len / RUNS_PER_ENTRY`).
    max_entries: u64,
    /// `history.max_age` in ms.
    max_age_ms: i64,
}

/// A cheaply clonable handle on one multiplexed, self-reconnecting Redis connection (the hot
/// path: no pool checkout per job), plus a connection of its own used only for health probes,
/// so a probe tests Redis itself, not the state of the shared multiplexed pipeline.
///
/// Claims, renewals and finishes go through one batching task: whatever calls are waiting
/// when the previous pipeline returns are written as the next pipeline, in one write, and
/// their replies read back together. Under load that turns a syscall and a cross-thread
/// wake-up per call into one per batch; when idle, a call costs one round trip as before.
/// Each call is its own single-key script, so Redis Cluster works (a rate decision that claims
/// the run's key, two keys in one script, is never sent to a cluster).
#[derive(Clone)]
pub struct IdemStore {
    conn: RedisConn,
    probes: Arc<RedisConn>,
    timeout: Duration,
    names: Names,
    lease: Duration,
    retention: Duration,
    /// The batching task, started on first use inside the caller's runtime, and started
    /// again if that runtime has shut down.
    batcher: Arc<Mutex<Option<mpsc::UnboundedSender<Op>>>>,
    /// Run history settings (`None`: off).
    history: Option<HistoryConfig>,
    /// `results.retention` (`None`: as long as the record).
    result_retention: Option<Duration>,
}

impl IdemStore {
    /// Creates the store without waiting for Redis: the first command connects, and a
    /// broken connection is re-established in the background.
    pub fn connect(config: &RedisConfig, names: Names) -> Result<Self, IdemError> {
        let conn = RedisConn::new(config)?;
        // The probe's own connection, so a probe tests Redis, not the shared pipeline.
        let probes = Arc::new(RedisConn::new(config)?);
        Ok(Self {
            conn,
            probes,
            timeout: config.timeout,
            names,
            lease: config.lease,
            retention: config.done_retention,
            batcher: Arc::new(Mutex::new(None)),
            history: None,
            result_retention: None,
        })
    }

    /// Records run history with these settings (when `enabled`).
    pub fn with_history(mut self, history: &HistoryConfig) -> Self {
        self.history = history.enabled.then(|| history.clone());
        self
    }

    /// Whether runs are recorded.
    pub fn records_history(&self) -> bool {
        self.history.is_some()
    }

    /// Hands `event` to the batching task for its queue's history stream. The run is written
    /// at the head of the next pipeline, so a finish called after this (the script that
    /// records the outcome) reaches Redis in the same write or a later one: a worker acks
    /// only after its finish answered, so a run whose key is `done` is in the stream, even
    /// when the worker is killed right after. Runs of one pipeline share stream entries (up
    /// to [`crate::history::RUNS_PER_ENTRY`] each). Nobody waits for the append itself.
    pub fn stream_run(&self, event: &RunEvent) {
        let Some(h) = &self.history else { return };
        let trim = Trim {
            max_entries: h.max_len.div_ceil(crate::history::RUNS_PER_ENTRY as u64),
            max_age_ms: i64::try_from(h.max_age.as_millis()).unwrap_or(i64::MAX),
        };
        let _ = self.batcher().send(Op::Run {
            stream: self.names.history(&event.queue),
            values: event.stream_values(),
            trim,
        });
    }

    /// Appends `event` to its key's record (for a run no finish recorded: the finishing
    /// script writes its own run's line). Its reply is dropped: history never holds up an
    /// ack.
    pub fn log_run(&self, event: &RunEvent) {
        let Some(h) = &self.history else { return };
        if event.key.is_empty() {
            return;
        }
        let mut log = evalsha(&RUNLOG, self.names.idem_key(&event.key));
        log.arg(event.record_line()).arg(h.runs_per_key).arg(&event.job).arg(&event.queue);
        self.send(log);
    }

    /// Waits until everything handed to the batching task so far has been written (a worker
    /// calls it as it stops, for the runs no finish followed).
    pub async fn flush_history(&self) {
        if self.history.is_none() {
            return;
        }
        let _ = tokio::time::timeout(self.timeout * 2, self.call::<Value>(redis::cmd("PING"))).await;
    }

    /// The store's self-reconnecting connection, for the worker's other Redis traffic
    /// (heartbeats, pause flags).
    pub fn connection(&self) -> RedisConn {
        self.conn.clone()
    }

    /// The lease a claim takes (`redis.lease`).
    pub fn lease(&self) -> Duration {
        self.lease
    }

    pub(crate) fn ms(d: Duration) -> u64 {
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
    }

    /// How long records are kept (`redis.done_retention`).
    pub(crate) fn retention(&self) -> Duration {
        self.retention
    }

    /// The key names of this store's prefix.
    pub(crate) fn names(&self) -> &Names {
        &self.names
    }

    /// Queues `cmd` on the batching task without waiting for (or reading) its reply.
    pub(crate) fn send(&self, cmd: Cmd) {
        let (reply, _) = oneshot::channel();
        let _ = self.batcher().send(Op::Call { cmd, reply });
    }

    /// The batching task's queue, starting the task if needed.
    fn batcher(&self) -> mpsc::UnboundedSender<Op> {
        batcher_of(&self.batcher, &self.conn)
    }

    /// Sends one script call through the batching task and waits for its reply.
    pub(crate) async fn call<T: redis::FromRedisValue>(&self, cmd: Cmd) -> Result<T, IdemError> {
        let tx = self.batcher();
        let (reply, answer) = oneshot::channel();
        tx.send(Op::Call { cmd, reply }).map_err(|_| IdemError::batcher_stopped())?;
        let value = answer.await.map_err(|_| IdemError::batcher_stopped())??;
        redis::from_redis_value(value).map_err(|e| IdemError::BadRecord(format!("unexpected reply: {e}")))
    }

    /// Claims `key` for `owner` (a token unique to this attempt). One round trip.
    pub async fn claim(&self, key: &str, owner: &str) -> Result<Claim, IdemError> {
        self.claim_copy(key, owner, None, None).await
    }

    /// [`IdemStore::claim`] for the copy of `version` ([`version_of`]) and `attempt`: an older
    /// copy of a key a newer enqueue replaced is [`Claim::Superseded`], an earlier attempt of
    /// a key whose retry is published [`Claim::Stale`].
    pub async fn claim_copy(
        &self,
        key: &str,
        owner: &str,
        version: Option<u64>,
        attempt: Option<u32>,
    ) -> Result<Claim, IdemError> {
        let mut cmd = evalsha(&CLAIM, self.names.idem_key(key));
        cmd.arg(owner).arg(Self::ms(self.lease)).arg(Self::ms(self.retention));
        match version {
            Some(v) => cmd.arg(v),
            None => cmd.arg(""),
        };
        match attempt {
            Some(a) => cmd.arg(a),
            None => cmd.arg(""),
        };
        let reply: Vec<Value> = self.call(cmd).await?;
        parse_claim(&reply)
    }

    /// Extends our lease and the record's TTL; re-creates a record Redis lost.
    pub async fn renew(&self, key: &str, owner: &str) -> Result<Renewal, IdemError> {
        let mut cmd = evalsha(&RENEW, self.names.idem_key(key));
        cmd.arg(owner).arg(Self::ms(self.lease)).arg(Self::ms(self.retention));
        let (answer, fence): (String, u64) = self.call(cmd).await?;
        Ok(match answer.as_str() {
            "renewed" => Renewal::Renewed,
            "recreated" => Renewal::Recreated { fence },
            "lost" => Renewal::Lost,
            "cancelled" => Renewal::Cancelled,
            other => return Err(IdemError::BadRecord(format!("renew answered {other:?}"))),
        })
    }

    /// Records the outcome ([`Recorded::NotOurs`]: another owner claimed the key after our
    /// lease lapsed; it records its own outcome).
    pub async fn finish(
        &self,
        key: &str,
        owner: &str,
        fence: u64,
        state: Final,
    ) -> Result<Recorded, IdemError> {
        self.finish_with_run(key, owner, fence, state, None, None).await
    }

    /// [`IdemStore::finish`], with the result of a `done` run (JSON) kept in the record, and
    /// `run` appended to the key's record in the same script when history is on (the caller
    /// handed it to [`IdemStore::stream_run`] first; [`IdemStore::log_run`] is for runs no
    /// finish recorded).
    pub async fn finish_with_run(
        &self,
        key: &str,
        owner: &str,
        fence: u64,
        state: Final,
        result: Option<&str>,
        run: Option<&RunEvent>,
    ) -> Result<Recorded, IdemError> {
        // A result kept longer than the record would be extends the record; one kept shorter
        // carries its own expiry (readers ignore it past then).
        let (retention, keep_ms) = match (result, self.result_retention) {
            (Some(_), Some(keep)) if keep > self.retention => (keep, 0),
            (Some(_), Some(keep)) => (self.retention, Self::ms(keep).max(1)),
            _ => (self.retention, 0),
        };
        let mut cmd = evalsha(&FINISH, self.names.idem_key(key));
        cmd.arg(owner).arg(fence).arg(state.as_str()).arg(Self::ms(retention));
        match state {
            Final::Retry(next) => cmd.arg(next.to_string()).arg(keep_ms),
            _ => cmd.arg(result.unwrap_or("")).arg(keep_ms),
        };
        if let (Some(h), Some(run)) = (&self.history, run) {
            cmd.arg(run.record_line()).arg(h.runs_per_key).arg(&run.job).arg(&run.queue);
        }
        let n: i64 = self.call(cmd).await?;
        Ok(Recorded::from_reply(n))
    }

    /// Saves `checkpoint` (JSON) as the key's checkpoint, if `owner` still holds it.
    pub async fn checkpoint(&self, key: &str, owner: &str, checkpoint: &str) -> Result<Recorded, IdemError> {
        let mut cmd = evalsha(&CHECKPOINT, self.names.idem_key(key));
        cmd.arg(owner).arg(checkpoint).arg(Self::ms(self.retention));
        let n: i64 = self.call(cmd).await?;
        Ok(Recorded::from_reply(n))
    }

    /// Keeps results for `retention` instead of `redis.done_retention` (`results.retention`).
    pub fn with_result_retention(mut self, retention: Option<Duration>) -> Self {
        self.result_retention = retention;
        self
    }

    /// Marks the key `dying` before its dead letter is published, so that a copy finding the
    /// key publishes the dead letter again if this publish never completes.
    pub async fn mark_dying(
        &self,
        key: &str,
        owner: &str,
        fence: u64,
        dead: &DeadInfo,
    ) -> Result<Recorded, IdemError> {
        let mut cmd = evalsha(&DYING, self.names.idem_key(key));
        cmd.arg(owner)
            .arg(fence)
            .arg(&dead.reason)
            .arg(&dead.error)
            .arg(dead.attempts)
            .arg(Self::ms(self.retention))
            .arg(Self::ms(self.lease));
        let n: i64 = self.call(cmd).await?;
        Ok(Recorded::from_reply(n))
    }

    /// `owner` could not publish the dead letter of its `dying` key: its hold ends, so the
    /// next copy dead-letters the key at once (best-effort, nobody waits; without it the
    /// hold lapses after a lease).
    pub fn let_go_dying(&self, key: &str, owner: &str) {
        let mut cmd = evalsha(&LET_GO_DYING, self.names.idem_key(key));
        cmd.arg(owner);
        self.send(cmd);
    }

    /// Makes a dead (or dying) key claimable again (the fence history is kept). `Ok(false)`
    /// if it was neither (never seen, expired, or already revived).
    pub async fn revive(&self, key: &str) -> Result<bool, IdemError> {
        let mut conn = self.conn.clone();
        let n: i64 = REVIVE.key(self.names.idem_key(key)).invoke_async(&mut conn).await?;
        Ok(n == 1)
    }

    /// The health probe: Redis `TIME` on the probe pool's own connection, within the
    /// configured timeout; answers how far this host's clock is ahead of Redis's (negative:
    /// behind), in microseconds, the round trip halved, and that round trip (the reading's
    /// error is up to half of it). Whole milliseconds would not do: the three truncations
    /// (this clock, Redis's, the half round trip) alone move a reading by up to two of them
    /// from one second to the next on hosts whose clocks agree.
    pub async fn clock_offset_us(&self) -> Result<(i64, i64), IdemError> {
        let probe = async {
            let mut conn = (*self.probes).clone();
            let (sent, started) = (chrono::Utc::now(), std::time::Instant::now());
            let redis_us = crate::redis_conn::redis_us(&mut conn).await?;
            let round_trip = i64::try_from(started.elapsed().as_micros()).unwrap_or(i64::MAX);
            let offset = sent.timestamp_micros().saturating_add(round_trip / 2).saturating_sub(redis_us);
            Ok::<_, IdemError>((offset, round_trip))
        };
        tokio::time::timeout(self.timeout, probe)
            .await
            .map_err(|_| IdemError::Protocol(format!("no TIME answer within {:?}", self.timeout)))?
    }
}

/// `EVALSHA <script> 1 <key>`; the caller adds the arguments. Sized for the largest call
/// (a finish with its run line: 14 arguments), so that building it does not reallocate.
pub(crate) fn evalsha(script: &Script, key: String) -> Cmd {
    let mut cmd = Cmd::with_capacity(14, 384);
    cmd.arg("EVALSHA");
    cmd.arg(script.get_hash()).arg(1).arg(key);
    cmd
}

/// A claim script's reply (see [`CLAIM`]).
pub(crate) fn parse_claim(reply: &[Value]) -> Result<Claim, IdemError> {
    // A missing field is Nil: no conversion (a failed one formats an error message).
    let text = |i: usize| match reply.get(i) {
        None | Some(Value::Nil) => None,
        Some(v) => redis::from_redis_value::<String>(v.clone()).ok(),
    };
    let num =
        |i: usize| reply.get(i).and_then(|v| redis::from_redis_value::<u64>(v.clone()).ok()).unwrap_or(0);
    let (fence, third) = (num(1), num(2));
    Ok(match text(0).as_deref() {
        Some("claimed") => Claim::Claimed { fence, checkpoint: text(6) },
        Some("done") => Claim::Done { fence },
        Some("dead") => Claim::Dead { fence },
        Some("cancelled") => Claim::Cancelled { fence },
        Some("superseded") => Claim::Superseded { fence },
        Some("stale") => Claim::Stale { fence },
        Some("busy") => Claim::Busy { fence, remaining: Duration::from_millis(third) },
        Some("dying") => Claim::Dying {
            fence,
            dead: DeadInfo {
                reason: text(3).unwrap_or_default(),
                error: text(4).unwrap_or_default(),
                attempts: u32::try_from(num(5)).unwrap_or(u32::MAX),
            },
        },
        other => return Err(IdemError::BadRecord(format!("claim answered {other:?}"))),
    })
}

/// The batching task's queue in `slot`, starting the task on `conn` if needed.
fn batcher_of(
    slot: &Mutex<Option<mpsc::UnboundedSender<Op>>>,
    conn: &RedisConn,
) -> mpsc::UnboundedSender<Op> {
    let mut batcher = slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match batcher.as_ref() {
        Some(tx) if !tx.is_closed() => tx.clone(),
        _ => {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(batch_loop(conn.clone(), rx));
            *batcher = Some(tx.clone());
            tx
        }
    }
}

/// The batching task: one pipeline in flight at a time; calls that arrive meanwhile form the
/// next one. Ends when every store handle is gone.
async fn batch_loop(mut conn: RedisConn, mut rx: mpsc::UnboundedReceiver<Op>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let ops = std::mem::take(&mut batch);
        send_batch(&mut conn, ops).await;
    }
}

/// Who waits for one call of a pipeline.
enum Reply {
    /// The caller of that call.
    One(oneshot::Sender<Result<Value, IdemError>>),
    /// The callers of one merged rate call, in the order of their asks.
    Rates(Vec<limit::RateReply>),
}

impl Reply {
    fn send(self, answer: Result<Value, IdemError>) {
        match self {
            Reply::One(tx) => {
                let _ = tx.send(answer);
            }
            Reply::Rates(txs) => limit::answer_rates(txs, answer),
        }
    }
}

/// Answers every call of a failed pipeline with the same error.
fn fail_all(replies: Vec<Option<Reply>>, error: impl Fn() -> IdemError) {
    for reply in replies.into_iter().flatten() {
        reply.send(Err(error()));
    }
}

/// Sends `ops` as one pipeline and answers each. Calls rejected with `NOSCRIPT` (Redis
/// restarted, or `SCRIPT FLUSH`) did not run: the scripts are loaded and those calls resent.
///
/// The batch's history runs come first, as one `XADDS` call per stream (their replies are
/// only logged: history is best-effort), so each run reaches Redis ahead of the finish that
/// was handed over after it. The rate decisions of one bucket are one call (in the order
/// they were asked), after the other calls.
async fn send_batch(conn: &mut RedisConn, ops: Vec<Op>) {
    let mut pipe = Pipeline::with_capacity(ops.len());
    let mut replies: Vec<Option<Reply>> = Vec::with_capacity(ops.len());
    let mut calls = Vec::with_capacity(ops.len());
    let mut streams: Vec<(String, Trim, Vec<[String; 4]>)> = Vec::new();
    let mut rates = limit::Merged::default();
    for op in ops {
        match op {
            Op::Call { cmd, reply } => calls.push((cmd, reply)),
            Op::Rate { key, ask, reply } => rates.add(key, ask, reply),
            Op::Run { stream, values, trim } => {
                match streams.iter_mut().find(|(s, t, _)| *s == stream && *t == trim) {
                    Some((_, _, runs)) => runs.push(values),
                    None => streams.push((stream, trim, vec![values])),
                }
            }
        }
    }
    if !streams.is_empty() {
        for (stream, trim, runs) in streams {
            let mut cmd = evalsha(&XADDS, stream);
            cmd.arg(trim.max_entries).arg(trim.max_age_ms);
            for entry in runs.chunks(crate::history::RUNS_PER_ENTRY) {
                cmd.arg(crate::history::encode_entry(entry));
            }
            pipe.add_command(cmd);
            replies.push(None);
        }
    }
    for (cmd, reply) in calls {
        pipe.add_command(cmd);
        replies.push(Some(Reply::One(reply)));
    }
    for (cmd, txs) in rates.calls() {
        pipe.add_command(cmd);
        replies.push(Some(Reply::Rates(txs)));
    }
    for round in 0..2 {
        let values = match conn.req_packed_commands(&pipe, 0, replies.len()).await {
            Ok(v) if v.len() == replies.len() => v,
            Ok(v) => {
                let msg = format!("{} replies to a pipeline of {}", v.len(), replies.len());
                return fail_all(replies, || IdemError::Protocol(msg.clone()));
            }
            Err(e) => return fail_all(replies, || IdemError::Redis(e.clone())),
        };
        let mut again = Pipeline::new();
        let mut again_replies = Vec::new();
        for ((reply, value), cmd) in replies.into_iter().zip(values).zip(pipe.cmd_iter()) {
            let answer = match value {
                Value::ServerError(e) if round == 0 && e.code() == "NOSCRIPT" => {
                    again.add_command(cmd.clone());
                    again_replies.push(reply);
                    continue;
                }
                Value::ServerError(e) => Err(IdemError::classify(e.into())),
                v => Ok(v),
            };
            match reply {
                Some(reply) => reply.send(answer),
                None => {
                    if let Err(e) = answer {
                        tracing::debug!(error = %e, "run history not written");
                    }
                }
            }
        }
        if again_replies.is_empty() {
            return;
        }
        let ours = [&*CLAIM, &*RENEW, &*FINISH, &*DYING, &*LET_GO_DYING, &*RUNLOG, &*XADDS, &*CHECKPOINT];
        for script in
            ours.into_iter().chain(limit::scripts()).chain(circuit::scripts()).chain(workflow::scripts())
        {
            if let Err(e) = script.prepare_invoke().load_async(conn).await {
                return fail_all(again_replies, || IdemError::Redis(e.clone()));
            }
        }
        pipe = again;
        replies = again_replies;
    }
}
