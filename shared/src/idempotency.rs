//! The Redis idempotency table: one hash per key, `<prefix>:idem:<key>`, driven only by the
//! atomic Lua scripts below (each touches exactly one key, so Redis Cluster works).
//!
//! Fields: `s` state (`run`, `done`, `dead`, `free`), `o` owner token, `u` lease end (ms of
//! Redis `TIME`, so worker clocks do not matter), `f` fence (monotonic per key: incremented
//! on every successful claim, kept for the retention period).
//!
//! This table makes duplicates rare, not impossible: a Redis failover or restart without
//! persistence loses keys. Handlers that need exactly-once effects use the key or the fence
//! in their own transaction.

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Cmd, Pipeline, Script, Value};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

use crate::config::RedisConfig;
use crate::topology::Names;

const NOW: &str =
    "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)";

/// KEYS[1] idem key; ARGV owner, lease_ms, retention_ms. Claiming again with the same owner
/// token returns the same fence (a command resent after a connection drop is harmless).
static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{NOW}
local h = redis.call('HMGET', KEYS[1], 's', 'o', 'u', 'f')
local s, fence = h[1], tonumber(h[4]) or 0
if s == 'done' or s == 'dead' then return {{s, fence, 0}} end
if s == 'run' and h[2] == ARGV[1] then return {{'claimed', fence, 0}} end
if s == 'run' and tonumber(h[3]) > now then return {{'busy', fence, tonumber(h[3]) - now}} end
fence = fence + 1
redis.call('HSET', KEYS[1], 's', 'run', 'o', ARGV[1], 'u', now + tonumber(ARGV[2]), 'f', fence)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {{'claimed', fence, 0}}"
    ))
});

/// KEYS[1]; ARGV owner, fence, lease_ms. 1 = renewed, 0 = no longer ours.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{NOW}
local h = redis.call('HMGET', KEYS[1], 's', 'o', 'f')
if h[1] ~= 'run' or h[2] ~= ARGV[1] or h[3] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'u', now + tonumber(ARGV[3]))
return 1"
    ))
});

/// KEYS[1]; ARGV owner, fence, new state, retention_ms. 1 = recorded, 0 = not ours.
static FINISH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local h = redis.call('HMGET', KEYS[1], 's', 'o', 'f')
if h[1] ~= 'run' or h[2] ~= ARGV[1] or h[3] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 's', ARGV[3], 'u', 0)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1",
    )
});

/// KEYS[1]. A dead key becomes free again (DLQ replay); 1 = revived, 0 = was not dead.
static REVIVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('HGET', KEYS[1], 's') ~= 'dead' then return 0 end
redis.call('HSET', KEYS[1], 's', 'free', 'u', 0)
return 1",
    )
});

/// The claim script (KEYS[1]; ARGV owner, lease_ms, retention_ms → `{state, fence,
/// remaining_ms}`), for benchmarks and tools that drive Redis directly.
pub fn claim_script() -> &'static Script {
    &CLAIM
}

/// The finish script (KEYS[1]; ARGV owner, fence, state, retention_ms → 1 or 0).
pub fn finish_script() -> &'static Script {
    &FINISH
}

/// Result of a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Ours to run, with this fence token.
    Claimed { fence: u64 },
    /// Already completed (a duplicate).
    Done { fence: u64 },
    /// Already dead-lettered (a duplicate of a dead job).
    Dead { fence: u64 },
    /// Another live owner holds it for `remaining` more.
    Busy { fence: u64, remaining: Duration },
}

/// Final state written by [`IdemStore::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Final {
    Done,
    Dead,
    /// Give the key back (retry later, or shutdown before finishing).
    Free,
}

impl Final {
    fn as_str(self) -> &'static str {
        match self {
            Final::Done => "done",
            Final::Dead => "dead",
            Final::Free => "free",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IdemError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis script returned an unexpected reply: {0}")]
    Protocol(String),
}

/// Most commands sent in one pipeline.
const MAX_BATCH: usize = 256;

/// One script call waiting for its pipeline.
struct Op {
    cmd: Cmd,
    reply: oneshot::Sender<Result<Value, IdemError>>,
}

/// A cheaply clonable handle on one multiplexed, self-reconnecting Redis connection (the hot
/// path: no pool checkout per job), plus a small deadpool pool used only for health probes,
/// so a probe tests Redis itself, not the state of the shared multiplexed pipeline.
///
/// Claims, renewals and finishes go through one batching task: whatever calls are waiting
/// when the previous pipeline returns are written as the next pipeline, in one write, and
/// their replies read back together. Under load that turns a syscall and a cross-thread
/// wake-up per call into one per batch; when idle, a call costs one round trip as before.
/// Each call is still its own single-key script, so Redis Cluster works.
#[derive(Clone)]
pub struct IdemStore {
    conn: ConnectionManager,
    probes: deadpool_redis::Pool,
    timeout: Duration,
    names: Names,
    lease: Duration,
    retention: Duration,
    /// The batching task, started on first use inside the caller's runtime, and started
    /// again if that runtime has shut down.
    batcher: Arc<Mutex<Option<mpsc::UnboundedSender<Op>>>>,
}

impl IdemStore {
    /// Creates the store without waiting for Redis: the first command connects, and a
    /// broken connection is re-established in the background.
    pub fn connect(config: &RedisConfig, names: Names) -> Result<Self, IdemError> {
        let client = Client::open(config.url.as_str())?;
        let cm = ConnectionManagerConfig::new()
            .set_response_timeout(Some(config.timeout))
            .set_connection_timeout(Some(config.timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client, cm)?;
        let probes = deadpool_redis::Config::from_url(config.url.as_str())
            .builder()
            .map_err(|e| IdemError::Protocol(format!("redis pool: {e}")))?
            .max_size(1)
            .wait_timeout(Some(config.timeout))
            .create_timeout(Some(config.timeout))
            .recycle_timeout(Some(config.timeout))
            .runtime(deadpool_redis::Runtime::Tokio1)
            .build()
            .map_err(|e| IdemError::Protocol(format!("redis pool: {e}")))?;
        Ok(Self {
            conn,
            probes,
            timeout: config.timeout,
            names,
            lease: config.lease,
            retention: config.done_retention,
            batcher: Arc::new(Mutex::new(None)),
        })
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    fn ms(d: Duration) -> u64 {
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
    }

    /// Sends one script call through the batching task and waits for its reply.
    async fn call<T: redis::FromRedisValue>(&self, cmd: Cmd) -> Result<T, IdemError> {
        let tx = {
            let mut batcher = self.batcher.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            match batcher.as_ref() {
                Some(tx) if !tx.is_closed() => tx.clone(),
                _ => {
                    let (tx, rx) = mpsc::unbounded_channel();
                    tokio::spawn(batch_loop(self.conn.clone(), rx));
                    *batcher = Some(tx.clone());
                    tx
                }
            }
        };
        let (reply, answer) = oneshot::channel();
        tx.send(Op { cmd, reply }).map_err(|_| IdemError::Protocol("redis batcher stopped".into()))?;
        let value = answer.await.map_err(|_| IdemError::Protocol("redis batcher stopped".into()))??;
        Ok(redis::from_redis_value(value).map_err(redis::RedisError::from)?)
    }

    /// Claims `key` for `owner` (a token unique to this attempt). One round trip.
    pub async fn claim(&self, key: &str, owner: &str) -> Result<Claim, IdemError> {
        let mut cmd = evalsha(&CLAIM, self.names.idem_key(key));
        cmd.arg(owner).arg(Self::ms(self.lease)).arg(Self::ms(self.retention));
        let (state, fence, remaining): (String, u64, u64) = self.call(cmd).await?;
        Ok(match state.as_str() {
            "claimed" => Claim::Claimed { fence },
            "done" => Claim::Done { fence },
            "dead" => Claim::Dead { fence },
            "busy" => Claim::Busy { fence, remaining: Duration::from_millis(remaining) },
            other => return Err(IdemError::Protocol(other.to_string())),
        })
    }

    /// Extends our lease; `Ok(false)` means another owner took the key over.
    pub async fn renew(&self, key: &str, owner: &str, fence: u64) -> Result<bool, IdemError> {
        let mut cmd = evalsha(&RENEW, self.names.idem_key(key));
        cmd.arg(owner).arg(fence).arg(Self::ms(self.lease));
        let n: i64 = self.call(cmd).await?;
        Ok(n == 1)
    }

    /// Records the outcome. `Ok(false)` means the key was no longer ours (our lease lapsed
    /// and another owner claimed it); the newer owner records its own outcome.
    pub async fn finish(&self, key: &str, owner: &str, fence: u64, state: Final) -> Result<bool, IdemError> {
        let mut cmd = evalsha(&FINISH, self.names.idem_key(key));
        cmd.arg(owner).arg(fence).arg(state.as_str()).arg(Self::ms(self.retention));
        let n: i64 = self.call(cmd).await?;
        Ok(n == 1)
    }

    /// Makes a dead key claimable again (the fence history is kept). `Ok(false)` if it was
    /// not dead (never seen, expired, or already revived).
    pub async fn revive(&self, key: &str) -> Result<bool, IdemError> {
        let mut conn = self.conn.clone();
        let n: i64 = REVIVE.key(self.names.idem_key(key)).invoke_async(&mut conn).await?;
        Ok(n == 1)
    }

    /// `PING` on the probe pool's own connection, within the configured timeout.
    pub async fn ping(&self) -> Result<(), IdemError> {
        let probe = async {
            let mut conn =
                self.probes.get().await.map_err(|e| IdemError::Protocol(format!("redis pool: {e}")))?;
            let _: String = redis::cmd("PING").query_async(&mut *conn).await?;
            Ok::<_, IdemError>(())
        };
        tokio::time::timeout(self.timeout, probe)
            .await
            .map_err(|_| IdemError::Protocol(format!("no PING answer within {:?}", self.timeout)))?
    }
}

/// `EVALSHA <script> 1 <key>`; the caller adds the arguments.
fn evalsha(script: &Script, key: String) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(1).arg(key);
    cmd
}

/// The batching task: one pipeline in flight at a time; calls that arrive meanwhile form the
/// next one. Ends when every store handle is gone.
async fn batch_loop(mut conn: ConnectionManager, mut rx: mpsc::UnboundedReceiver<Op>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let ops = std::mem::take(&mut batch);
        send_batch(&mut conn, ops).await;
    }
}

type Reply = oneshot::Sender<Result<Value, IdemError>>;

/// Answers every call of a failed pipeline with the same error.
fn fail_all(replies: Vec<Reply>, error: impl Fn() -> IdemError) {
    for reply in replies {
        let _ = reply.send(Err(error()));
    }
}

/// Sends `ops` as one pipeline and answers each. Calls rejected with `NOSCRIPT` (Redis
/// restarted, or `SCRIPT FLUSH`) did not run: the scripts are loaded and those calls resent.
async fn send_batch(conn: &mut ConnectionManager, ops: Vec<Op>) {
    let mut pipe = Pipeline::with_capacity(ops.len());
    let mut replies = Vec::with_capacity(ops.len());
    for op in ops {
        pipe.add_command(op.cmd);
        replies.push(op.reply);
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
                Value::ServerError(e) => Err(IdemError::Redis(e.into())),
                v => Ok(v),
            };
            let _ = reply.send(answer);
        }
        if again_replies.is_empty() {
            return;
        }
        for script in [&*CLAIM, &*RENEW, &*FINISH] {
            if let Err(e) = script.prepare_invoke().load_async(conn).await {
                return fail_all(again_replies, || IdemError::Redis(e.clone()));
            }
        }
        pipe = again;
        replies = again_replies;
    }
}
