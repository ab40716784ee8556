//! Global concurrency limits (`jobs[].global_concurrency`): at most N runs of a job at once
//! across every worker sharing the prefix.
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

/// The scripts of this module (loaded again after a Redis restart, with the others).
pub(crate) fn scripts() -> [&'static Script; 1] {
    [&TAKE]
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

    /// Frees `owner`'s slot of `job` (best-effort, nobody waits: an unfreed slot lapses).
    pub fn free_slot(&self, job: &str, owner: &str) {
        let mut cmd = redis::cmd("ZREM");
        cmd.arg(self.names().limit(job)).arg(owner);
        self.send(cmd);
    }
}
