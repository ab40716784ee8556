//! Global concurrency limits (`jobs[].global_concurrency`): at most N runs of a job at once
//! across every worker sharing the prefix; and rate limits (`jobs[].rate_limit`).
//!
//! **Rate limits** are two GCRA counters (the generic cell rate algorithm) in one hash per
//! bucket and tenant (`<prefix>:rate:<bucket>:<tenant>`, see `Names::rate`), in µs of Redis
//! `TIME`, each advanced by the interval (`per / limit`):
//! - `t`, the **ticket** counter, orders runs: a run's first ask gives it a ticket, the time
//!   its turn comes at the limit's pace (`t − burst·interval`, now if that is past). A run whose
//!   ticket is further off than it may wait in place is parked until about then and carries
//!   its ticket back (header `x-chime-rate-at`): a late copy keeps its place in line.
//! - `a`, the **admission** counter, times starts: only a run whose ticket is due (within the
//!   wait it may do in place) asks it, and it reserves a start only within that wait. Starts
//!   are therefore spaced by the interval whatever the delay chain does: copies it returns
//!   late in a clump are due together and are let through one interval apart (the others park
//!   a second or wait in place), never at once.
//!
//! A downstream that pushed back (`JobError::rate_limited`, a declared exit code, HTTP 429 or
//! 503) sets `h`, a time nothing starts before; both counters resume after it.
//!
//! A job's slots are one sorted set, `<prefix>:limit:<job>`: member = the run's owner token
//! (the same token as its claim), score = when the slot lapses (ms of Redis `TIME`). A run
//! takes a slot before it claims its key, renews it with its lease, and frees it when the
//! handler returns. A worker that dies keeps its slots until they lapse (`redis.lease`), as
//! its claims do; lapsed slots are dropped by the next taker. One script, one key: Redis
//! Cluster works.

use redis::{Cmd, Script, Value};
use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;
use tokio::sync::oneshot;

use super::{CLAIM_FN, Claim, IdemError, IdemStore, Op, PRELUDE, evalsha, parse_claim};

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

/// KEYS[1] a rate bucket, then the idempotency keys the asks may claim; ARGV one or more
/// asks of ten values each, decided in order: interval_us, burst, ticket_us (the run's ticket
/// from an earlier ask, or 0 for a new one), horizon_us (how long it may wait in place), then
/// the index in KEYS of the run's key (0: claim nothing) and the claim's owner, lease_ms,
/// retention_ms, version and attempt (see `CLAIM`) → for each ask `ticket_us, admitted,
/// wait_us, claim`: admitted 1, it starts in `wait_us` (≤ horizon; that start is its own);
/// admitted 0, it comes back in about `wait_us` (its ticket is further off than the horizon,
/// or it is due but every start within the horizon is taken). A run that starts at once
/// (admitted, no wait) with a key to claim has it claimed in the same call: `claim` is the
/// claim's reply (`{'bad', error}` when the key's record is not a chime record), else 0. The
/// asks of one bucket that wait for the same pipeline are one call (a returning pack's
/// members, a flood's copies): one read and one write of the bucket instead of one script
/// each.
static RATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{PRELUDE}
{CLAIM_FN}
local v = redis.call('HMGET', KEYS[1], 't', 'a', 'h')
local hold = tonumber(v[3]) or 0
local q, a = tonumber(v[1]) or now, tonumber(v[2]) or now
local newq, newa = false, false
local out = {{}}
for i = 1, #ARGV, 10 do
  local T, b, ticket, horizon = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  if ticket <= 0 then
    q = math.max(q, now) + T
    ticket = math.max(q - b * T, now, hold)
    newq = true
  end
  local admitted, wait = 0, ticket - now
  if wait <= horizon then
    local next = math.max(a, now) + T
    local start = math.max(next - b * T, now, hold)
    wait = start - now
    if wait <= horizon then
      admitted, a, newa = 1, next, true
    end
  end
  local claimed, k = 0, tonumber(ARGV[i + 4])
  if admitted == 1 and wait <= 0 and k > 0 then
    local ok, c = pcall(claim, KEYS[k], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7], ARGV[i + 8], ARGV[i + 9])
    if ok then claimed = c else claimed = {{'bad', type(c) == 'table' and tostring(c.err) or tostring(c)}} end
  end
  out[#out + 1] = int(ticket)
  out[#out + 1] = admitted
  out[#out + 1] = int(math.max(wait, 0))
  out[#out + 1] = claimed
end
if newq then redis.call('HSET', KEYS[1], 't', int(q)) end
if newa then redis.call('HSET', KEYS[1], 'a', int(a)) end
redis.call('PEXPIRE', KEYS[1], math.ceil((math.max(q, a, hold) - now) / 1000) + 1000)
return out"
    ))
});

/// KEYS[1] a rate bucket; ARGV hold_us, interval_us, burst → the bucket holds every start
/// until now + hold_us (a later hold already set stands), then resumes at the sustained
/// rate. Returns the hold's end (µs).
static SLOW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local T, b = tonumber(ARGV[2]), tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], 't', 'a', 'h')
local hold = math.max(tonumber(v[3]) or 0, now + tonumber(ARGV[1]))
local q = math.max(tonumber(v[1]) or 0, hold + (b - 1) * T)
local a = math.max(tonumber(v[2]) or 0, hold + (b - 1) * T)
redis.call('HSET', KEYS[1], 't', string.format('%.0f', q), 'a', string.format('%.0f', a), 'h', string.format('%.0f', hold))
redis.call('PEXPIRE', KEYS[1], math.ceil((math.max(q, a, hold) - now) / 1000) + 1000)
return string.format('%.0f', hold)",
    )
});

/// The scripts of this module (loaded again after a Redis restart, with the others).
pub(crate) fn scripts() -> [&'static Script; 3] {
    [&TAKE, &RATE, &SLOW]
}

/// Who waits for one rate decision.
pub(crate) type RateReply = oneshot::Sender<Result<RateTake, IdemError>>;

/// One ask of [`IdemStore::take_rate`], as the rate script takes it.
#[derive(Debug, Clone)]
pub(crate) struct RateAsk {
    interval_us: u64,
    burst: u32,
    ticket_us: u64,
    horizon_us: u64,
    /// The run's key to claim if it may start at once: its Redis name, then the claim's
    /// owner, lease_ms, retention_ms, version and attempt.
    claim: Option<(String, [String; 5])>,
}

/// The run a rate decision claims when it lets the run start at once
/// ([`IdemStore::take_rate`]): what [`IdemStore::claim_copy`] takes.
#[derive(Debug, Clone)]
pub struct ClaimWith {
    /// The job key.
    pub key: String,
    /// The attempt's owner token.
    pub owner: String,
    /// The copy's version (`version_of`).
    pub version: u64,
    /// The copy's attempt.
    pub attempt: u32,
}

/// The rate asks of one pipeline, by bucket, each bucket's in the order they came.
#[derive(Default)]
pub(crate) struct Merged {
    buckets: Vec<(String, Vec<RateAsk>, Vec<RateReply>)>,
    index: HashMap<String, usize>,
}

impl Merged {
    pub(crate) fn add(&mut self, key: String, ask: RateAsk, reply: RateReply) {
        let i = match self.index.get(&key) {
            Some(&i) => i,
            None => {
                self.index.insert(key.clone(), self.buckets.len());
                self.buckets.push((key, Vec::new(), Vec::new()));
                self.buckets.len() - 1
            }
        };
        self.buckets[i].1.push(ask);
        self.buckets[i].2.push(reply);
    }

    /// One script call per bucket, with the callers it answers.
    pub(crate) fn calls(self) -> impl Iterator<Item = (Cmd, Vec<RateReply>)> {
        self.buckets.into_iter().map(|(key, asks, txs)| {
            let claims = asks.iter().filter(|a| a.claim.is_some()).count();
            let mut cmd = Cmd::with_capacity(4 + claims + asks.len() * 10, 64 + asks.len() * 160);
            cmd.arg("EVALSHA").arg(RATE.get_hash()).arg(1 + claims).arg(key);
            for (name, _) in asks.iter().filter_map(|a| a.claim.as_ref()) {
                cmd.arg(name);
            }
            let mut index = 1;
            for a in asks {
                cmd.arg(a.interval_us).arg(a.burst).arg(a.ticket_us).arg(a.horizon_us);
                match &a.claim {
                    Some((_, args)) => {
                        index += 1;
                        cmd.arg(index).arg(args);
                    }
                    None => {
                        cmd.arg(0).arg(&[""; 5]);
                    }
                }
            }
            (cmd, txs)
        })
    }
}

/// Answers the callers of one merged rate call from its reply (four values per ask).
pub(crate) fn answer_rates(txs: Vec<RateReply>, answer: Result<Value, IdemError>) {
    let values = match answer {
        Ok(Value::Array(values)) if values.len() == txs.len() * 4 => values,
        Ok(other) => {
            let e = IdemError::Protocol(format!("rate script replied {other:?} to {} asks", txs.len()));
            return txs.into_iter().for_each(|tx| drop(tx.send(Err(e.clone()))));
        }
        Err(e) => return txs.into_iter().for_each(|tx| drop(tx.send(Err(e.clone())))),
    };
    for (tx, v) in txs.into_iter().zip(values.chunks(4)) {
        let _ = tx.send(rate_take(v));
    }
}

fn rate_take(v: &[Value]) -> Result<RateTake, IdemError> {
    let parsed = (
        redis::from_redis_value_ref::<String>(&v[0]).ok().and_then(|s| s.parse::<u64>().ok()),
        redis::from_redis_value_ref::<u8>(&v[1]).ok(),
        redis::from_redis_value_ref::<String>(&v[2]).ok().and_then(|s| s.parse::<u64>().ok()),
    );
    let claim = match &v[3] {
        Value::Array(reply) => Some(match reply.first() {
            Some(first) if redis::from_redis_value_ref::<String>(first).is_ok_and(|s| s == "bad") => {
                let why = reply.get(1).and_then(|e| redis::from_redis_value_ref::<String>(e).ok());
                Err(IdemError::BadRecord(why.unwrap_or_default()))
            }
            _ => parse_claim(reply),
        }),
        _ => None,
    };
    match parsed {
        (Some(ticket_us), Some(admitted), Some(wait_us)) => {
            Ok(RateTake { ticket_us, admitted: admitted == 1, wait: Duration::from_micros(wait_us), claim })
        }
        _ => Err(IdemError::Protocol(format!("rate script replied {v:?}"))),
    }
}

/// Answer of [`IdemStore::take_rate`]: when the run may start.
#[derive(Debug, Clone)]
pub struct RateTake {
    /// The run's ticket, in µs of Redis time (carry it when the run is parked).
    pub ticket_us: u64,
    /// Whether a start is the run's: it starts after `wait`. Else it comes back in about
    /// `wait` and asks again with its ticket.
    pub admitted: bool,
    /// Until it starts (admitted; zero: at once) or should ask again.
    pub wait: Duration,
    /// The claim of its key made in the same call ([`ClaimWith`]; only when it starts at
    /// once, and never on Redis Cluster, where the key and the bucket may be on two nodes):
    /// `None` when none was made, and the caller claims as usual.
    pub claim: Option<Result<Claim, IdemError>>,
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

    /// Asks rate bucket `key` (`Names::rate`) whether a run may start within `horizon` (the
    /// wait it may do in place), giving it a ticket unless it brings one (µs, from an earlier
    /// answer). With `claim`, a run that may start at once has its key claimed in the same
    /// round trip ([`RateTake::claim`]; not on Redis Cluster).
    pub async fn take_rate(
        &self,
        key: String,
        interval_us: u64,
        burst: u32,
        ticket: Option<u64>,
        horizon: Duration,
        claim: Option<ClaimWith>,
    ) -> Result<RateTake, IdemError> {
        let claim = claim.filter(|_| self.conn.kind() != "cluster").map(|c| {
            let args = [
                c.owner,
                IdemStore::ms(self.lease()).to_string(),
                IdemStore::ms(self.retention()).to_string(),
                c.version.to_string(),
                c.attempt.to_string(),
            ];
            (self.names().idem_key(&c.key), args)
        });
        let ask = RateAsk {
            interval_us,
            burst,
            ticket_us: ticket.unwrap_or(0),
            horizon_us: u64::try_from(horizon.as_micros()).unwrap_or(u64::MAX),
            claim,
        };
        let (reply, answer) = oneshot::channel();
        self.batcher().send(Op::Rate { key, ask, reply }).map_err(|_| IdemError::batcher_stopped())?;
        answer.await.map_err(|_| IdemError::batcher_stopped())?
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
