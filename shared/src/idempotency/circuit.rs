//! Circuit breakers shared by every worker (`jobs[].circuit`, `[[circuits]]`): one hash per
//! circuit, `<prefix>:circuit:<name>` (see `Names::circuit`), changed only by the scripts
//! here (one key each: Redis Cluster works), on Redis `TIME`.
//!
//! Fields: `state` (`closed`, `open`, `half_open`; absent = closed), `since` (ms of the last
//! change), `until` (ms when an open circuit lets probes through), `forced` (`1` while an
//! operator holds it open), `probes` (the admission times of the probes out, space
//! separated), `tripped` (`<failures> <runs>` that opened it), and the rolling window: ten
//! slices of `window / 10`, `S<slice>` and `F<slice>` counting the runs that succeeded and
//! failed in each.
//!
//! A run asks `ADMIT` before it runs (closed: go; open: wait; half-open: go as a probe
//! while fewer than `probes` are out, else wait) and reports how it ended to `RECORD`
//! (closed: count it and open when the window trips; half-open: a probe that succeeded closes
//! the circuit, one that failed opens it again). A probe whose worker died stops counting
//! after `probe_ttl`, so a lost probe cannot hold a circuit half-open.

use redis::aio::ConnectionLike;
use redis::{Script, Value};
use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use super::{IdemError, IdemStore, evalsha};
use crate::config::Config;
use crate::names::Names;

/// KEYS[1] a circuit; ARGV probes, probe_ttl_ms, open_for_ms → `{verdict, n}`: `closed` (run),
/// `probe` (run as a probe; `n` is its token), `open` (wait `n` ms), `busy` (half-open with
/// every probe out: wait; `n` is when the oldest probe lapses, ms).
static ADMIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local v = redis.call('HMGET', KEYS[1], 'state', 'until', 'forced', 'probes')
local state = v[1] or 'closed'
if state == 'closed' then return {'closed', 0} end
if v[3] == '1' then return {'open', tonumber(ARGV[3])} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if state == 'open' then
  local untl = tonumber(v[2]) or 0
  if now < untl then return {'open', untl - now} end
  redis.call('HSET', KEYS[1], 'state', 'half_open', 'since', now, 'probes', '')
  v[4] = ''
end
local ttl = tonumber(ARGV[2])
local live, oldest = {}, nil
for p in string.gmatch(v[4] or '', '%d+') do
  local at = tonumber(p)
  if at + ttl > now then
    table.insert(live, p)
    if not oldest or at < oldest then oldest = at end
  end
end
if #live < tonumber(ARGV[1]) then
  local token = string.format('%.0f', now)
  table.insert(live, token)
  redis.call('HSET', KEYS[1], 'probes', table.concat(live, ' '))
  return {'probe', token}
end
return {'busy', oldest + ttl - now}",
    )
});

/// KEYS[1] a circuit; ARGV outcome (`s` succeeded, `f` failed, `n` neither: only gives a
/// probe back), probe token (or empty), window_ms, min_volume, failures (0: use the ratio),
/// failure_ratio, open_for_ms, successes (more runs that succeeded, counted with this one:
/// a worker reports successes in batches) → `{change, state, succeeded, failed}`: `change`
/// is `opened`, `closed` or empty.
static RECORD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local v = redis.call('HMGET', KEYS[1], 'state', 'forced', 'probes')
local state = v[1] or 'closed'
local o, token = ARGV[1], ARGV[2]
local window, minv, failures, ratio, open_for =
  tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local probe = false
if token ~= '' and v[3] and v[3] ~= '' then
  local rest = {}
  for p in string.gmatch(v[3], '%d+') do
    if not probe and p == token then probe = true else table.insert(rest, p) end
  end
  if probe then redis.call('HSET', KEYS[1], 'probes', table.concat(rest, ' ')) end
end
if o == 'n' or v[2] == '1' then return {'', state, 0, 0} end
if state == 'half_open' then
  if not probe then return {'', state, 0, 0} end
  if o == 's' then
    redis.call('DEL', KEYS[1])
    redis.call('HSET', KEYS[1], 'state', 'closed', 'since', now)
    redis.call('PEXPIRE', KEYS[1], window + 86400000)
    return {'closed', 'closed', 1, 0}
  end
  redis.call('HSET', KEYS[1], 'state', 'open', 'since', now, 'until', now + open_for, 'probes', '', 'tripped', '1 1')
  redis.call('PEXPIRE', KEYS[1], open_for + 86400000)
  return {'opened', 'open', 0, 1}
end
if state ~= 'closed' then return {'', state, 0, 0} end
local slice = math.max(100, math.floor(window / 10))
local cur = math.floor(now / slice)
local more = tonumber(ARGV[8]) or 0
if o == 's' then more = more + 1 else redis.call('HINCRBY', KEYS[1], 'F' .. string.format('%.0f', cur), 1) end
if more > 0 then redis.call('HINCRBY', KEYS[1], 'S' .. string.format('%.0f', cur), more) end
local all = redis.call('HGETALL', KEYS[1])
local s, f = 0, 0
for i = 1, #all, 2 do
  local k = all[i]
  local kind, n = string.sub(k, 1, 1), tonumber(string.sub(k, 2))
  if (kind == 'S' or kind == 'F') and n then
    if n <= cur - 10 then
      redis.call('HDEL', KEYS[1], k)
    elseif kind == 'S' then
      s = s + tonumber(all[i + 1])
    else
      f = f + tonumber(all[i + 1])
    end
  end
end
local vol = s + f
local trip = false
if vol >= minv then
  if failures > 0 then trip = f >= failures else trip = f >= ratio * vol end
end
if trip then
  redis.call('HSET', KEYS[1], 'state', 'open', 'since', now, 'until', now + open_for, 'probes', '',
    'tripped', f .. ' ' .. vol)
  redis.call('PEXPIRE', KEYS[1], open_for + 86400000)
  return {'opened', 'open', s, f}
end
redis.call('PEXPIRE', KEYS[1], window + 86400000)
return {'', 'closed', s, f}",
    )
});

/// KEYS[1] a circuit; ARGV `open` (held open until closed) or `close` (closed, its window
/// forgotten) → the state before.
static FORCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local before = redis.call('HGET', KEYS[1], 'state') or 'closed'
if redis.call('HGET', KEYS[1], 'forced') == '1' then before = 'forced_open' end
redis.call('DEL', KEYS[1])
if ARGV[1] == 'open' then
  redis.call('HSET', KEYS[1], 'state', 'open', 'since', now, 'until', 0, 'forced', '1')
else
  redis.call('HSET', KEYS[1], 'state', 'closed', 'since', now)
  redis.call('PEXPIRE', KEYS[1], 86400000)
end
return before",
    )
});

/// The scripts the workers call (loaded again after a Redis restart, with the others).
pub(crate) fn scripts() -> [&'static Script; 2] {
    [&ADMIT, &RECORD]
}

/// A circuit's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Runs go through.
    Closed,
    /// Runs wait (or are dead-lettered).
    Open,
    /// Probes go through; the rest wait.
    HalfOpen,
}

impl CircuitState {
    /// As stored, logged and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::Open => "open",
            CircuitState::HalfOpen => "half_open",
        }
    }

    /// The value of `chime_circuit_state`: 0 closed, 1 half-open, 2 open.
    pub fn gauge(self) -> f64 {
        match self {
            CircuitState::Closed => 0.0,
            CircuitState::HalfOpen => 1.0,
            CircuitState::Open => 2.0,
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "open" => CircuitState::Open,
            "half_open" => CircuitState::HalfOpen,
            _ => CircuitState::Closed,
        }
    }
}

/// What [`IdemStore::circuit_admit`] says of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Closed: run.
    Go,
    /// Half-open: run as a probe; report it with this token.
    Probe(String),
    /// Open: nothing runs for this long (an operator's hold: `open_for`).
    Open(Duration),
    /// Half-open with every probe out: the oldest lapses in this long unless it reports sooner.
    Busy(Duration),
}

impl Admit {
    /// The state the answer shows.
    pub fn state(&self) -> CircuitState {
        match self {
            Admit::Go => CircuitState::Closed,
            Admit::Probe(_) | Admit::Busy(_) => CircuitState::HalfOpen,
            Admit::Open(_) => CircuitState::Open,
        }
    }
}

/// How a run that went through a circuit ended, for [`IdemStore::circuit_record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The handler succeeded.
    Succeeded,
    /// The handler failed (an error, a timeout, a panic).
    Failed,
    /// Neither (stopped, pushed back, lease lost): only its probe, if it was one, is given back.
    Neither,
}

/// What [`IdemStore::circuit_record`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// The state it changed to, if it changed.
    pub changed: Option<CircuitState>,
    /// The runs that succeeded in the window (closed circuits; zero otherwise).
    pub succeeded: u64,
    /// The runs that failed in the window.
    pub failed: u64,
}

/// A circuit's settings as the scripts take them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// The rolling window runs are counted over.
    pub window: Duration,
    /// Runs that must have ended in the window before it may open.
    pub min_volume: u32,
    /// Failures in the window that open it (0: the ratio decides).
    pub failures: u32,
    /// The share of failed runs that opens it (with `failures` 0).
    pub failure_ratio: f64,
    /// How long it stays open.
    pub open_for: Duration,
    /// Probes let through at once while half-open.
    pub probes: u32,
    /// How long a probe counts as out without a report (the job's longest run).
    pub probe_ttl: Duration,
}

impl IdemStore {
    /// Asks circuit `key` (`Names::circuit`) whether a run may go now.
    pub async fn circuit_admit(&self, key: String, limits: &Limits) -> Result<Admit, IdemError> {
        let mut cmd = evalsha(&ADMIT, key);
        cmd.arg(limits.probes).arg(IdemStore::ms(limits.probe_ttl)).arg(IdemStore::ms(limits.open_for));
        let (verdict, n): (String, Value) = self.call(cmd).await?;
        let num = || redis::from_redis_value::<u64>(n.clone()).ok();
        match (verdict.as_str(), num()) {
            ("closed", _) => Ok(Admit::Go),
            ("probe", Some(token)) => Ok(Admit::Probe(token.to_string())),
            ("open", Some(ms)) => Ok(Admit::Open(Duration::from_millis(ms))),
            ("busy", Some(ms)) => Ok(Admit::Busy(Duration::from_millis(ms))),
            _ => Err(IdemError::Protocol(format!("circuit script replied {verdict:?}, {n:?}"))),
        }
    }

    /// Reports how a run admitted by circuit `key` ended.
    pub async fn circuit_record(
        &self,
        key: String,
        limits: &Limits,
        ended: Ended,
        probe: Option<&str>,
        successes: u64,
    ) -> Result<Recorded, IdemError> {
        let cmd = record_cmd(key, limits, ended, probe, successes);
        let (change, _state, succeeded, failed): (String, String, u64, u64) = self.call(cmd).await?;
        let changed = match change.as_str() {
            "opened" => Some(CircuitState::Open),
            "closed" => Some(CircuitState::Closed),
            _ => None,
        };
        Ok(Recorded { changed, succeeded, failed })
    }

    /// Gives probe `token` of circuit `key` back unreported (best-effort, nobody waits).
    pub fn circuit_give_back(&self, key: String, limits: &Limits, token: &str) {
        self.send(record_cmd(key, limits, Ended::Neither, Some(token), 0));
    }
}

fn record_cmd(key: String, limits: &Limits, ended: Ended, probe: Option<&str>, successes: u64) -> redis::Cmd {
    let mut cmd = evalsha(&RECORD, key);
    let o = match ended {
        Ended::Succeeded => "s",
        Ended::Failed => "f",
        Ended::Neither => "n",
    };
    cmd.arg(o)
        .arg(probe.unwrap_or(""))
        .arg(IdemStore::ms(limits.window))
        .arg(limits.min_volume)
        .arg(limits.failures)
        .arg(limits.failure_ratio)
        .arg(IdemStore::ms(limits.open_for))
        .arg(successes);
    cmd
}

/// One circuit of the config with its state, as `chime circuits --json`, the dashboard and
/// the alerts read it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CircuitView {
    /// Its name.
    pub name: String,
    /// The jobs that go through it.
    pub jobs: Vec<String>,
    /// Its settings, in words.
    pub settings: String,
    /// Its state in Redis.
    #[serde(flatten)]
    pub status: CircuitStatus,
}

/// Reads the state of every circuit of `config` (one `HGETALL` each; the rolling windows
/// counted at Redis `TIME`, the clock their slices were written by).
pub async fn read_all<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    config: &Config,
) -> redis::RedisResult<Vec<CircuitView>> {
    let now_ms = u64::try_from(crate::redis_conn::redis_ms(conn).await?).unwrap_or(0);
    let mut out = Vec::new();
    for (c, jobs) in config.all_circuits() {
        let hash: HashMap<String, String> =
            redis::cmd("HGETALL").arg(names.circuit(&c.name)).query_async(conn).await?;
        out.push(CircuitView {
            status: CircuitStatus::from_hash(&hash, c.circuit.window, now_ms),
            settings: c.circuit.to_string(),
            name: c.name,
            jobs,
        });
    }
    Ok(out)
}

/// Holds circuit `name` open (`open`: until closed) or closes it (its window forgotten), for
/// every worker; returns the state before (`closed`, `open`, `half_open`, `forced_open`).
pub async fn force<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    name: &str,
    open: bool,
) -> redis::RedisResult<String> {
    FORCE.key(names.circuit(name)).arg(if open { "open" } else { "close" }).invoke_async(conn).await
}

/// A circuit as `chime circuits` and the dashboard show it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CircuitStatus {
    /// `closed`, `open` or `half_open`.
    pub state: &'static str,
    /// Held open by an operator (`chime circuit open`) until closed.
    pub forced: bool,
    /// When it last changed state (ms since the epoch; absent: never, it is closed).
    pub since_ms: Option<u64>,
    /// When an open circuit lets probes through (ms since the epoch).
    pub until_ms: Option<u64>,
    /// Probes out (half-open).
    pub probes_out: u32,
    /// Runs that succeeded in the window (closed).
    pub succeeded: u64,
    /// Runs that failed in the window (closed).
    pub failed: u64,
    /// The failures and runs in the window that opened it.
    pub tripped: Option<String>,
}

impl CircuitStatus {
    /// Reads a circuit's hash (`HGETALL`), counting the window's slices up to `now_ms`.
    pub fn from_hash(hash: &HashMap<String, String>, window: Duration, now_ms: u64) -> Self {
        let slice = (u64::try_from(window.as_millis()).unwrap_or(u64::MAX) / 10).max(100);
        let cur = now_ms / slice;
        let (mut succeeded, mut failed) = (0, 0);
        for (k, v) in hash {
            let (kind, n) = k.split_at(k.len().min(1));
            let (Ok(n), Ok(v)) = (n.parse::<u64>(), v.parse::<u64>()) else { continue };
            if n + 10 <= cur {
                continue;
            }
            match kind {
                "S" => succeeded += v,
                "F" => failed += v,
                _ => {}
            }
        }
        let num = |f: &str| hash.get(f).and_then(|v| v.parse::<u64>().ok()).filter(|v| *v > 0);
        let state = CircuitState::parse(hash.get("state").map_or("closed", String::as_str));
        let forced = hash.get("forced").is_some_and(|f| f == "1");
        CircuitStatus {
            state: state.as_str(),
            forced,
            since_ms: num("since"),
            until_ms: if state == CircuitState::Open && !forced { num("until") } else { None },
            probes_out: hash.get("probes").map_or(0, |p| p.split_whitespace().count() as u32),
            succeeded,
            failed,
            tripped: hash.get("tripped").filter(|_| state != CircuitState::Closed).cloned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_reads_as_its_state_and_window() {
        let window = Duration::from_secs(10);
        let now = 1_000_000_000u64;
        let cur = now / 1000;
        let hash: HashMap<String, String> = [
            ("state", "closed".to_string()),
            ("since", "5".into()),
            (&format!("S{cur}"), "4".into()),
            (&format!("F{}", cur - 3), "2".into()),
            (&format!("F{}", cur - 10), "9".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let s = CircuitStatus::from_hash(&hash, window, now);
        assert_eq!((s.state, s.succeeded, s.failed, s.since_ms, s.forced), ("closed", 4, 2, Some(5), false));
        let open: HashMap<String, String> =
            [("state", "open"), ("until", "77"), ("tripped", "5 8"), ("probes", "")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        let s = CircuitStatus::from_hash(&open, window, now);
        assert_eq!(
            (s.state, s.until_ms, s.tripped.as_deref(), s.probes_out),
            ("open", Some(77), Some("5 8"), 0)
        );
        assert_eq!(CircuitStatus::from_hash(&HashMap::new(), window, now).state, "closed");
    }
}
