//! The ticker's shared state in Redis: the leader lease and the per-job watermarks.
//!
//! - `<p>:ticker:leader` = `"<ticker id>|<acquired at, ms of Redis TIME>"`, with a PX expiry.
//!   Acquire and renew are one compare-and-extend script: only the holder extends it.
//! - `<p>:ticker:wm` hash: job → the last slot (Unix seconds) whose publish was confirmed.
//!   Advanced with a max, so two leaders in a split brain can never move it backwards.

use chime_shared::config::RedisConfig;
use chime_shared::control::{self, Target};
use chime_shared::redis_conn::RedisConn;
use chime_shared::topology::Names;
use redis::Script;
use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

/// KEYS[1] leader key; ARGV id, lease_ms. Returns {held (0/1), acquired_ms, redis_now_ms,
/// holder, replaced}: `replaced` is 1 when the key held something that is not a lease (another
/// type, or a value not of the form `id|ms`) — it is taken over, or nobody could ever lead.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local kind = redis.call('TYPE', KEYS[1]).ok
local v = nil
if kind == 'string' then v = redis.call('GET', KEYS[1]) end
local sep = v and string.find(v, '|', 1, true)
local since = sep and tonumber(string.sub(v, sep + 1))
if kind ~= 'none' and not since then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[1], ARGV[1] .. '|' .. now, 'PX', ARGV[2])
  return {1, now, now, ARGV[1], 1}
end
if not v then
  redis.call('SET', KEYS[1], ARGV[1] .. '|' .. now, 'PX', ARGV[2])
  return {1, now, now, ARGV[1], 0}
end
local holder = string.sub(v, 1, sep - 1)
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, since, now, holder, 0}
end
return {0, since, now, holder, 0}",
    )
});

/// KEYS[1]; ARGV id. Deletes the lease if we hold it.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. '|' then
  return redis.call('DEL', KEYS[1])
end
return 0",
    )
});

/// KEYS[1] watermark hash; ARGV job1, slot1, job2, slot2, … Sets each to max(current, slot).
static ADVANCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"for i = 1, #ARGV, 2 do
  local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[i]))
  if not cur or tonumber(ARGV[i + 1]) > cur then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return 1",
    )
});

/// Answer of an acquire/renew attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseState {
    pub held: bool,
    pub holder: String,
    /// When the current holder acquired the lease (ms, Redis clock).
    pub acquired_ms: i64,
    /// Redis `TIME` at the call (ms).
    pub redis_now_ms: i64,
}

/// Current leader as seen by `chime status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LeaderInfo {
    pub id: String,
    pub lease_age_ms: i64,
    pub expires_in_ms: i64,
}

#[derive(Clone)]
pub struct TickerStore {
    conn: RedisConn,
    leader_key: String,
    wm_key: String,
    /// `<job>:missed` and `<job>:paused` → slots counted so far (for `status` and the
    /// dashboard; the metrics say the same per process).
    counts_key: String,
}

impl TickerStore {
    pub fn connect(config: &RedisConfig, prefix: &str) -> Result<Self, redis::RedisError> {
        let names = chime_shared::names::Names::new(prefix);
        Ok(Self {
            conn: RedisConn::new(config)?,
            leader_key: names.ticker_leader(),
            wm_key: names.ticker_watermarks(),
            counts_key: names.ticker_counts(),
        })
    }

    /// Acquires the lease, or extends it if `id` holds it. Garbage under the lease key is
    /// replaced (and logged): it must not block scheduling.
    pub async fn acquire(&self, id: &str, lease: Duration) -> Result<LeaseState, redis::RedisError> {
        let mut c = self.conn.clone();
        let (held, acquired_ms, redis_now_ms, holder, replaced): (i64, i64, i64, String, i64) = ACQUIRE
            .key(&self.leader_key)
            .arg(id)
            .arg(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX))
            .invoke_async(&mut c)
            .await?;
        if replaced == 1 {
            tracing::warn!(key = %self.leader_key, "the leader key held something that is not a lease; replaced it");
        }
        Ok(LeaseState { held: held == 1, holder, acquired_ms, redis_now_ms })
    }

    pub async fn release(&self, id: &str) -> Result<(), redis::RedisError> {
        let mut c = self.conn.clone();
        let _: i64 = RELEASE.key(&self.leader_key).arg(id).invoke_async(&mut c).await?;
        Ok(())
    }

    pub async fn leader(&self) -> Result<Option<LeaderInfo>, redis::RedisError> {
        let mut c = self.conn.clone();
        let (v, ttl, time): (Option<String>, i64, (i64, i64)) = redis::pipe()
            .get(&self.leader_key)
            .pttl(&self.leader_key)
            .cmd("TIME")
            .query_async(&mut c)
            .await?;
        let now = time.0 * 1000 + time.1 / 1000;
        Ok(v.and_then(|v| {
            let (id, since) = v.split_once('|')?;
            Some(LeaderInfo {
                id: id.to_string(),
                lease_age_ms: now - since.parse::<i64>().ok()?,
                expires_in_ms: ttl,
            })
        }))
    }

    /// Watermarks (Unix seconds) of every job that has one.
    pub async fn watermarks(&self) -> Result<HashMap<String, i64>, redis::RedisError> {
        let mut c = self.conn.clone();
        redis::cmd("HGETALL").arg(&self.wm_key).query_async(&mut c).await
    }

    /// Advances watermarks (never backwards), one round trip for the whole batch.
    pub async fn advance(&self, slots: &[(&str, i64)]) -> Result<(), redis::RedisError> {
        if slots.is_empty() {
            return Ok(());
        }
        let mut c = self.conn.clone();
        let mut inv = ADVANCE.key(&self.wm_key);
        for (job, slot) in slots {
            inv.arg(*job).arg(*slot);
        }
        let _: i64 = inv.invoke_async(&mut c).await?;
        Ok(())
    }

    /// Pause flags of these schedules, in order (`true`: paused).
    /// The store's connection (for the overlap state and group records).
    pub fn conn(&self) -> RedisConn {
        self.conn.clone()
    }

    pub async fn paused(&self, names: &Names, jobs: &[String]) -> Result<Vec<bool>, redis::RedisError> {
        let mut c = self.conn.clone();
        let flags = control::flags(&mut c, names, Target::Schedule, jobs).await?;
        Ok(flags.iter().map(Option::is_some).collect())
    }

    /// Adds `n` to a job's `missed` or `paused` count (best-effort).
    pub async fn count(&self, job: &str, what: &str, n: u64) {
        let mut c = self.conn.clone();
        let r: Result<i64, _> = redis::cmd("HINCRBY")
            .arg(&self.counts_key)
            .arg(format!("{job}:{what}"))
            .arg(n)
            .query_async(&mut c)
            .await;
        if let Err(e) = r {
            tracing::debug!(error = %e, "slot count not recorded");
        }
    }

    /// Every job's `missed` and `paused` counts.
    pub async fn counts(&self) -> Result<HashMap<String, SlotCounts>, redis::RedisError> {
        let mut c = self.conn.clone();
        let raw: HashMap<String, u64> =
            redis::cmd("HGETALL").arg(&self.counts_key).query_async(&mut c).await?;
        let mut out: HashMap<String, SlotCounts> = HashMap::new();
        for (field, n) in raw {
            if let Some((job, what)) = field.rsplit_once(':') {
                let e = out.entry(job.to_string()).or_default();
                match what {
                    "missed" => e.missed += n,
                    "paused" => e.paused += n,
                    "overlapped" => e.overlapped += n,
                    "calendar" => e.calendar += n,
                    _ => {}
                }
            }
        }
        Ok(out)
    }
}

/// Slots of a job the ticker handled without publishing, since the prefix began.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotCounts {
    /// Outside the catch-up window, or dropped by the catch-up policy.
    pub missed: u64,
    /// Due while the schedule was paused.
    pub paused: u64,
    /// Skipped by the overlap policy (the previous run was still in progress).
    pub overlapped: u64,
    /// Skipped by its business calendar (`on_holiday = "skip"`: holidays and days off).
    pub calendar: u64,
}
