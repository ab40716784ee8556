//! Load shedding's shared flag (`[worker.shed.<queue>]`, `jobs[].criticality`): while a
//! worker sees a queue above its threshold it sets `<prefix>:shed:<queue>` to the threshold it
//! crossed, for 5 s, every second. Every worker sheds the queue's `sheddable` runs while the
//! flag is set (what one worker sees, all act on), the ticker does not publish their slots, and
//! the DLQ monitor alerts.

use redis::aio::ConnectionLike;
use std::time::Duration;

use crate::names::Names;

/// How long a flag outlives the last worker that set it.
pub const FLAG_TTL: Duration = Duration::from_secs(5);

/// Sets `queue`'s flag to `reason` for [`FLAG_TTL`].
pub async fn set<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    queue: &str,
    reason: &str,
) -> redis::RedisResult<()> {
    redis::cmd("SET")
        .arg(names.shed(queue))
        .arg(reason)
        .arg("PX")
        .arg(FLAG_TTL.as_millis() as u64)
        .query_async(conn)
        .await
}

/// Clears `queue`'s flag (a worker saw it fall back below its threshold).
pub async fn clear<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    queue: &str,
) -> redis::RedisResult<()> {
    redis::cmd("DEL").arg(names.shed(queue)).query_async(conn).await
}

/// The flags of `queues`, in order: the threshold crossed, or `None`.
pub async fn read<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    queues: &[String],
) -> redis::RedisResult<Vec<Option<String>>> {
    if queues.is_empty() {
        return Ok(Vec::new());
    }
    let mut cmd = redis::cmd("MGET");
    for q in queues {
        cmd.arg(names.shed(q));
    }
    cmd.query_async(conn).await
}

/// Where a queue stands against its thresholds, with hysteresis: shedding starts when
/// either threshold is reached and stops when both are below 80 % of theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// Ready messages in the queue.
    pub depth: Option<u32>,
    /// The longest a run taken from it in the last second had waited.
    pub age: Option<Duration>,
}

/// What crossing `cfg` at `r` says: `Some(reason)` while the queue must shed (given whether
/// it was shedding before), `None` when it need not.
pub fn judge(cfg: &crate::config::ShedConfig, r: Reading, shedding: bool) -> Option<String> {
    let depth = cfg.max_depth.zip(r.depth);
    let age = cfg.max_age.zip(r.age);
    let over_depth =
        depth.filter(|(max, d)| *d >= *max).map(|(max, d)| format!("depth {d} >= max_depth {max}"));
    let over_age = age.filter(|(max, a)| *a >= *max).map(|(max, a)| {
        format!(
            "age {} >= max_age {}",
            crate::duration::format(Duration::from_secs(a.as_secs())),
            crate::duration::format(max)
        )
    });
    if let Some(reason) = over_depth.or(over_age) {
        return Some(reason);
    }
    if !shedding {
        return None;
    }
    // Still above 80 %: keep shedding.
    let high_depth = depth.filter(|(max, d)| u64::from(*d) * 5 >= u64::from(*max) * 4);
    let high_age = age.filter(|(max, a)| a.as_millis() * 5 >= max.as_millis() * 4);
    match (high_depth, high_age) {
        (Some((max, d)), _) => Some(format!("depth {d}, not yet below 80 % of max_depth {max}")),
        (_, Some((max, _))) => {
            Some(format!("age not yet below 80 % of max_age {}", crate::duration::format(max)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ShedConfig;

    #[test]
    fn shedding_starts_at_a_threshold_and_stops_below_80_percent_of_each() {
        let cfg = ShedConfig { max_depth: Some(100), max_age: Some(Duration::from_secs(60)) };
        let r = |d: u32, a: u64| Reading { depth: Some(d), age: Some(Duration::from_secs(a)) };
        assert_eq!(judge(&cfg, r(99, 59), false), None);
        assert_eq!(judge(&cfg, r(100, 0), false).as_deref(), Some("depth 100 >= max_depth 100"));
        assert_eq!(judge(&cfg, r(0, 61), false).as_deref(), Some("age 1m 1s >= max_age 1m"));
        assert!(judge(&cfg, r(85, 0), true).is_some(), "above 80 %: still shedding");
        assert!(judge(&cfg, r(10, 50), true).is_some(), "the age is above 80 %");
        assert_eq!(judge(&cfg, r(79, 47), true), None);
        let depth_only = ShedConfig { max_depth: Some(10), max_age: None };
        assert_eq!(
            judge(&depth_only, Reading { depth: None, age: Some(Duration::from_secs(999)) }, false),
            None
        );
    }
}
