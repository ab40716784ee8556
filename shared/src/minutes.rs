//! Numbers over time for the dashboard: per-minute totals in Redis at a bounded cost.
//!
//! Workers add what they settled each minute (succeeded, retried, dead-lettered, and the
//! enqueue → start latency as histogram buckets) with one pipelined `HINCRBY` batch every few
//! seconds ([`add`]); the DLQ monitor (the leader ticker, or `chime watch`) records the
//! depths of the work queues and DLQs it reads ([`set_depths`]). One hash per minute,
//! `<prefix>:minutes:<unix minute>`, kept [`RETENTION`]: about 1,440 small hashes a day,
//! whatever the job rate. [`read`] returns a window, oldest first.

use redis::aio::ConnectionLike;
use std::collections::BTreeMap;
use std::time::Duration;

use crate::names::Names;

/// How long a minute's hash is kept.
pub const RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Upper bounds (ms) of the latency buckets; a last bucket holds everything above.
pub const LATENCY_BOUNDS_MS: [u64; 13] =
    [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000];

/// The outcomes counted per minute.
pub const OUTCOMES: [&str; 3] = ["succeeded", "retried", "dead_lettered"];

/// The minute (Unix seconds / 60) of `t`.
pub fn minute_of(t: chrono::DateTime<chrono::Utc>) -> i64 {
    t.timestamp().div_euclid(60)
}

/// What one process counted in one minute (or the sum of all of them, read back).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// By outcome (see [`OUTCOMES`]).
    pub outcomes: BTreeMap<String, u64>,
    /// Runs started, by latency bucket (`LATENCY_BOUNDS_MS.len() + 1` of them).
    pub latency: Vec<u64>,
}

impl Counts {
    /// Counts one settled delivery.
    pub fn outcome(&mut self, outcome: &str) {
        if OUTCOMES.contains(&outcome) {
            *self.outcomes.entry(outcome.to_string()).or_default() += 1;
        }
    }

    /// Counts one run that started `ms` after its slot or enqueue.
    pub fn latency(&mut self, ms: u64) {
        if self.latency.is_empty() {
            self.latency = vec![0; LATENCY_BOUNDS_MS.len() + 1];
        }
        let i = LATENCY_BOUNDS_MS.iter().position(|b| ms <= *b).unwrap_or(LATENCY_BOUNDS_MS.len());
        self.latency[i] += 1;
    }

    /// Whether nothing was counted.
    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty() && self.latency.iter().all(|n| *n == 0)
    }

    /// The latency at quantile `q` (0 to 1), as the upper bound of its bucket (`None`: no run,
    /// or above the last bound).
    pub fn latency_quantile_ms(&self, q: f64) -> Option<u64> {
        let total: u64 = self.latency.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.latency.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return LATENCY_BOUNDS_MS.get(i).copied();
            }
        }
        None
    }
}

/// One minute read back: what every worker counted, and the depths last recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Minute {
    /// Unix minute.
    pub minute: i64,
    /// What every worker counted in it.
    pub counts: Counts,
    /// Ready messages by work queue.
    pub depths: BTreeMap<String, u64>,
    /// Ready messages by DLQ (by its queue's name).
    pub dlq_depths: BTreeMap<String, u64>,
}

/// Adds `counts` (per minute) to the shared totals: one pipeline.
pub async fn add<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    counts: &BTreeMap<i64, Counts>,
) -> redis::RedisResult<()> {
    let ttl = RETENTION.as_secs() + 120;
    let mut pipe = redis::pipe();
    for (minute, c) in counts {
        let key = names.minute(*minute);
        for (outcome, n) in &c.outcomes {
            pipe.cmd("HINCRBY").arg(&key).arg(outcome).arg(*n).ignore();
        }
        for (i, n) in c.latency.iter().enumerate().filter(|(_, n)| **n > 0) {
            pipe.cmd("HINCRBY").arg(&key).arg(format!("lat{i}")).arg(*n).ignore();
        }
        pipe.cmd("EXPIRE").arg(&key).arg(ttl).ignore();
    }
    pipe.query_async(conn).await
}

/// Records the depths read at `minute` (the last reading of the minute stands).
pub async fn set_depths<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    minute: i64,
    work: &[(String, u32)],
    dead: &[(String, u32)],
) -> redis::RedisResult<()> {
    let key = names.minute(minute);
    let mut pipe = redis::pipe();
    for (q, d) in work {
        pipe.cmd("HSET").arg(&key).arg(format!("depth:{q}")).arg(*d).ignore();
    }
    for (q, d) in dead {
        pipe.cmd("HSET").arg(&key).arg(format!("dlq:{q}")).arg(*d).ignore();
    }
    pipe.cmd("EXPIRE").arg(&key).arg(RETENTION.as_secs() + 120).ignore();
    pipe.query_async(conn).await
}

/// The minutes from `from` to `to` (inclusive), oldest first; a minute nobody wrote is empty.
pub async fn read<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    from: i64,
    to: i64,
) -> redis::RedisResult<Vec<Minute>> {
    let mut pipe = redis::pipe();
    for m in from..=to {
        pipe.cmd("HGETALL").arg(names.minute(m));
    }
    let all: Vec<BTreeMap<String, u64>> = pipe.query_async(conn).await?;
    Ok((from..=to).zip(all).map(|(minute, fields)| decode(minute, &fields)).collect())
}

fn decode(minute: i64, fields: &BTreeMap<String, u64>) -> Minute {
    let mut m = Minute { minute, ..Minute::default() };
    m.counts.latency = vec![0; LATENCY_BOUNDS_MS.len() + 1];
    for (k, v) in fields {
        if let Some(q) = k.strip_prefix("depth:") {
            m.depths.insert(q.to_string(), *v);
        } else if let Some(q) = k.strip_prefix("dlq:") {
            m.dlq_depths.insert(q.to_string(), *v);
        } else if let Some(i) = k.strip_prefix("lat").and_then(|i| i.parse::<usize>().ok()) {
            if let Some(slot) = m.counts.latency.get_mut(i) {
                *slot = *v;
            }
        } else if OUTCOMES.contains(&k.as_str()) {
            m.counts.outcomes.insert(k.clone(), *v);
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_quantiles_come_from_the_buckets() {
        let mut c = Counts::default();
        assert_eq!(c.latency_quantile_ms(0.5), None);
        for ms in [1, 2, 3, 4, 7, 8, 20, 40, 90, 2000] {
            c.latency(ms);
        }
        assert_eq!(c.latency_quantile_ms(0.5), Some(10));
        assert_eq!(c.latency_quantile_ms(0.99), Some(2500));
        c.latency(3_600_000);
        assert_eq!(c.latency_quantile_ms(1.0), None, "above the last bound");
        c.outcome("succeeded");
        c.outcome("duplicate");
        assert_eq!(c.outcomes.len(), 1, "only the charted outcomes");
    }

    #[test]
    fn a_minute_decodes_from_its_hash() {
        let fields: BTreeMap<String, u64> = [
            ("succeeded", 7),
            ("lat0", 5),
            ("lat13", 1),
            ("depth:default", 12),
            ("dlq:default", 2),
            ("junk", 9),
            ("lat99", 4),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let m = decode(3, &fields);
        assert_eq!(m.counts.outcomes["succeeded"], 7);
        assert_eq!((m.counts.latency[0], m.counts.latency[13]), (5, 1));
        assert_eq!((m.depths["default"], m.dlq_depths["default"]), (12, 2));
    }
}
