//! Global concurrency limits (`jobs[].global_concurrency`): at most N runs of a job at once
//! across every worker sharing the prefix; and rate limits (`jobs[].rate_limit`).
//!
//! **Rate limits** are GCRA (the generic cell rate algorithm) with reservations, one hash per
//! bucket and tenant (`<prefix>:rate:<bucket>:<tenant>`, see `Names::rate`): `t` is the
//! theoretical arrival time (µs of Redis `TIME`), advanced by the interval (`per / limit`)
//! for every run that asks; a run may start at `t − burst·interval` (at once if that is past).
//! Every ask reserves its start, so runs asking together are spaced exactly, whichever
//! worker asks: a run whose start is near waits in place, one whose start is far is parked
//! until then and runs on its return without asking again (its reservation travels with it).
//! A downstream that pushed back (`JobError::rate_limited`, a declared exit code, HTTP 429 or
//! 503) sets `h`, a time nothing starts before: later asks are scheduled after it, and a
//! returning reservation older than the push-back asks again.
//!
//! A job's slots are one sorted set, `<prefix>:limit:<job>`: member = the run's owner token
//! (the same token as its claim), score = when the slot lapses (ms of Redis `TIME`). A run
//! takes a slot before it claims its key, renews it with its lease, and frees it when the
//! handler returns. A worker that dies keeps its slots until they lapse (`redis.lease`), as
//! its claims do; lapsed slots are dropped by the next taker. One script, one key: Redis
//! Cluster works.

use redis::{Script, Value};
use std::sync::LazyLock;
use std::time::Duration;

use super::{IdemError, IdemStore, evalsha};

/// KEYS[1] the job's slots; ARGV owner, limit, lease_ms → `{1, 0}`: the owner holds a slot
/// until now + lease (taken, or renewed when it held one already); `{0, ms}`: every slot is
/// held, the first lapses in `ms` unless freed sooner.
static TAKE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now))
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], string.format('%.0f', now + tonumber(ARGV[3])), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, 0}
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {0, math.max(0, tonumber(first[2]) - now)}",
    )
});

/// KEYS[1] a rate bucket; ARGV interval_us, burst, reserved_us (a start reserved earlier,
/// or 0) → `{start_us, now_us}`: the run starts at `start_us` (Redis time; `now_us` or
/// earlier: at once). A reservation still valid (not older than a push-back) is kept; else a
/// new start is reserved.
static RATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local T, b, reserved = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], 't', 'h')
local hold = tonumber(v[2]) or 0
if reserved > 0 and reserved >= hold then
  return {string.format('%.0f', reserved), string.format('%.0f', now)}
end
local tat = math.max(tonumber(v[1]) or now, now) + T
local start = math.max(tat - b * T, now, hold)
redis.call('HSET', KEYS[1], 't', string.format('%.0f', tat))
redis.call('PEXPIRE', KEYS[1], math.ceil((math.max(tat, hold) - now) / 1000) + 1000)
return {string.format('%.0f', start), string.format('%.0f', now)}",
    )
});

/// KEYS[1] a rate bucket; ARGV hold_us, interval_us, burst → the bucket holds every start
/// until now + hold_us (a later hold already set stands), then resumes at the sustained
/// rate. Returns the hold's end (µs).
static SLOW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local T, b = tonumber(ARGV[2]), tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], 't', 'h')
local hold = math.max(tonumber(v[2]) or 0, now + tonumber(ARGV[1]))
local tat = math.max(tonumber(v[1]) or 0, hold + (b - 1) * T)
redis.call('HSET', KEYS[1], 't', string.format('%.0f', tat), 'h', string.format('%.0f', hold))
redis.call('PEXPIRE', KEYS[1], math.ceil((math.max(tat, hold) - now) / 1000) + 1000)
return string.format('%.0f', hold)",
    )
});

/// The scripts of this module (loaded again after a Redis restart, with the others).
pub(crate) fn scripts() -> [&'static Script; 3] {
    [&TAKE, &RATE, &SLOW]
}

/// Answer of [`IdemStore::take_rate`]: when the run may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateTake {
    /// The start reserved for it, in µs of Redis time (carry it when the run is parked).
    pub start_us: u64,
    /// Until then (zero: at once).
    pub wait: Duration,
}

/// Answer of [`IdemStore::take_slot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotTake {
    /// The owner holds a slot for one lease (taken now, or renewed).
    Taken,
    /// Every slot is held; the first lapses in this long unless it is freed sooner.
    Full {
        /// Until the first held slot lapses.
        lapses_in: Duration,
    },
}

impl IdemStore {
    /// Takes (or renews) one of the `limit` slots of `job` for `owner`, for one lease.
    pub async fn take_slot(&self, job: &str, owner: &str, limit: usize) -> Result<SlotTake, IdemError> {
        let mut cmd = evalsha(&TAKE, self.names().limit(job));
        cmd.arg(owner).arg(limit).arg(IdemStore::ms(self.lease()));
        let reply: Vec<Value> = self.call(cmd).await?;
        let num = |i: usize| match reply.get(i) {
            Some(v) => redis::from_redis_value::<u64>(v.clone()).ok(),
            None => None,
        };
        match (num(0), num(1)) {
            (Some(1), _) => Ok(SlotTake::Taken),
            (Some(0), Some(ms)) => Ok(SlotTake::Full { lapses_in: Duration::from_millis(ms) }),
            _ => Err(IdemError::Protocol(format!("slot script replied {reply:?}"))),
        }
    }

    /// Asks rate bucket `key` (`Names::rate`) when a run may start, reserving its start, or
    /// keeping `reserved` (µs, from an earlier answer) when no push-back voided it.
    pub async fn take_rate(
        &self,
        key: String,
        interval_us: u64,
        burst: u32,
        reserved: Option<u64>,
    ) -> Result<RateTake, IdemError> {
        let mut cmd = evalsha(&RATE, key);
        cmd.arg(interval_us).arg(burst).arg(reserved.unwrap_or(0));
        let (start, now): (String, String) = self.call(cmd).await?;
        let (Ok(start_us), Ok(now_us)) = (start.parse::<u64>(), now.parse::<u64>()) else {
            return Err(IdemError::Protocol(format!("rate script replied {start:?}, {now:?}")));
        };
        Ok(RateTake { start_us, wait: Duration::from_micros(start_us.saturating_sub(now_us)) })
    }

    /// Holds rate bucket `key` for `hold` (the downstream pushed back), for every worker.
    pub async fn slow_rate(
        &self,
        key: String,
        hold: Duration,
        interval_us: u64,
        burst: u32,
    ) -> Result<(), IdemError> {
        let mut cmd = evalsha(&SLOW, key);
        cmd.arg(u64::try_from(hold.as_micros()).unwrap_or(u64::MAX)).arg(interval_us).arg(burst);
        let _: String = self.call(cmd).await?;
        Ok(())
    }

    /// Frees `owner`'s slot of `job` (best-effort, nobody waits: an unfreed slot lapses).
    pub fn free_slot(&self, job: &str, owner: &str) {
        let mut cmd = redis::cmd("ZREM");
        cmd.arg(self.names().limit(job)).arg(owner);
        self.send(cmd);
    }
}
