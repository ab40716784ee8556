//! One pass at a time over a DLQ.
//!
//! AMQP cannot read a queue without taking its messages, so every pass — a listing too —
//! takes each dead letter and puts a copy back at the tail. While a pass holds a message, a
//! concurrent purge or replay would not see it and would report it gone. So every pass
//! (`dlq list|show|replay|purge`, the dashboard's reads and actions, `chime inspect`) holds
//! `<prefix>:dlq-lock:<queue>` in Redis for its duration; another pass waits for it. The lock
//! lapses [`TTL`] after its holder died; a live holder renews it.

use chime_shared::redis_conn::RedisConn;
use redis::Script;
use std::sync::Arc;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use super::DlqError;

/// A lock whose holder stopped renewing it lapses after this.
pub const TTL: Duration = Duration::from_secs(30);
/// How long a pass waits for another one to end before giving up.
pub const WAIT: Duration = Duration::from_secs(300);

/// KEYS[1] lock; ARGV holder, ttl ms. Renews the lock if `holder` holds it: 1, else 0.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0",
    )
});

/// KEYS[1] lock; ARGV holder. Deletes the lock if `holder` holds it.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0",
    )
});

/// A held pass lock; renewed in the background until [`PassLock::release`].
pub struct PassLock {
    conn: RedisConn,
    key: String,
    holder: String,
    stop: CancellationToken,
    lost: Arc<AtomicBool>,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl PassLock {
    /// Takes `key`, waiting up to [`WAIT`] while another pass holds it; `holder` names this
    /// pass in the other's error message.
    pub async fn take(conn: RedisConn, key: String, queue: &str, holder: String) -> Result<Self, DlqError> {
        let deadline = tokio::time::Instant::now() + WAIT;
        let mut pause = Duration::from_millis(50);
        loop {
            let mut c = conn.clone();
            let set: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&holder)
                .arg("NX")
                .arg("PX")
                .arg(ms(TTL))
                .query_async(&mut c)
                .await
                .map_err(DlqError::Lock)?;
            if set.is_some() {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                let other: Option<String> =
                    redis::cmd("GET").arg(&key).query_async(&mut c).await.unwrap_or_default();
                return Err(DlqError::Busy { queue: queue.to_string(), holder: other.unwrap_or_default() });
            }
            tokio::time::sleep(pause).await; // polling a lock held by another process
            pause = (pause * 2).min(Duration::from_millis(500));
        }
        let (stop, lost) = (CancellationToken::new(), Arc::new(AtomicBool::new(false)));
        let renewal = {
            let (mut conn, key, holder, stop, lost) =
                (conn.clone(), key.clone(), holder.clone(), stop.clone(), lost.clone());
            async move {
                let mut tick = tokio::time::interval(TTL / 3);
                tick.tick().await;
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tick.tick() => {}
                    }
                    let held: Result<i64, _> =
                        RENEW.key(&key).arg(&holder).arg(ms(TTL)).invoke_async(&mut conn).await;
                    if matches!(held, Ok(0)) {
                        lost.store(true, Ordering::Release);
                        return;
                    }
                }
            }
        };
        tokio::spawn(renewal);
        Ok(Self { conn, key, holder, stop, lost })
    }

    /// `Err` once another pass took the lock (this one stalled past [`TTL`]).
    pub fn check(&self, queue: &str) -> Result<(), DlqError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(DlqError::Busy {
                queue: queue.to_string(),
                holder: "(taken over after a stall)".into(),
            });
        }
        Ok(())
    }

    /// Releases the lock (if still held).
    pub async fn release(self) {
        self.stop.cancel();
        let mut conn = self.conn.clone();
        let _: Result<i64, _> = RELEASE.key(&self.key).arg(&self.holder).invoke_async(&mut conn).await;
    }
}
