//! One Redis connection type for every part of chime, whatever `[redis]` describes: one
//! server (`redis.url`), a Sentinel-managed master (`redis.sentinels` + `redis.master_name`),
//! or a Redis Cluster (`redis.cluster`).
//!
//! [`RedisConn`] is cheap to clone (clones share one multiplexed connection), reconnects by
//! itself, and implements redis's `ConnectionLike`, so scripts, commands and pipelines run on
//! it unchanged:
//! - **one server**: redis's `ConnectionManager`;
//! - **Sentinel**: a multiplexed connection to the master the sentinels name. A connection
//!   error or a `READONLY` reply (the old master was demoted) drops it; the next call asks the
//!   sentinels again. A call answered `READONLY` did not run and is sent once more to the new
//!   master; a call cut off by a connection error may or may not have run and is returned as
//!   an error (chime's scripts are fenced, and its callers retry or pause);
//! - **Cluster**: redis's cluster connection (slot map, `MOVED`/`ASK`, reconnects). Every
//!   script chime runs touches one key; a pipeline whose commands live in several slots is
//!   split into one pipeline per slot, sent together, and its replies put back in order.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    Cmd, ConnectionAddr, ErrorKind, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, RedisResult, Value,
};

use crate::config::RedisConfig;
#[cfg(feature = "tls")]
use crate::config::TlsConfig;

/// A self-reconnecting Redis connection to what `[redis]` describes (see the module docs).
#[derive(Clone)]
pub struct RedisConn {
    inner: Inner,
    db: i64,
}

#[derive(Clone)]
enum Inner {
    Single(ConnectionManager),
    Sentinel(Arc<SentinelConn>),
    Cluster(Arc<LazyCluster>),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner {
            Inner::Single(_) => "single",
            Inner::Sentinel(_) => "sentinel",
            Inner::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisConn").field("kind", &kind).finish()
    }
}

fn config_error(what: String) -> RedisError {
    RedisError::from((ErrorKind::InvalidClientConfig, "redis config", what))
}

pub use crate::config::host_port;

/// The TLS files of `[redis.tls]` as redis's certificates (`None` when none are set).
#[cfg(feature = "tls")]
fn certificates(tls: &TlsConfig) -> RedisResult<Option<redis::TlsCertificates>> {
    if *tls == TlsConfig::default() {
        return Ok(None);
    }
    let files = crate::tls::TlsFiles::read("redis.tls", tls).map_err(|e| config_error(e.to_string()))?;
    Ok(Some(redis::TlsCertificates {
        client_tls: files
            .identity
            .map(|(client_cert, client_key)| redis::ClientTlsConfig { client_cert, client_key }),
        root_cert: files.ca,
    }))
}

impl RedisConn {
    /// A connection for `config`, made without waiting for Redis: the first command connects.
    pub fn new(config: &RedisConfig) -> RedisResult<Self> {
        #[cfg(feature = "tls")]
        crate::tls::install_crypto_provider();
        let info = config.url.as_str().into_connection_info()?;
        let settings = info.redis_settings();
        let tls = config.url.starts_with("rediss://");
        let db = settings.db();
        if !config.sentinels.is_empty() {
            let sentinels: Vec<ConnectionAddr> = config
                .sentinels
                .iter()
                .map(|s| {
                    host_port(s)
                        .map(|(h, p)| ConnectionAddr::Tcp(h, p))
                        .ok_or_else(|| config_error(format!("redis.sentinels: {s:?} is not host:port")))
                })
                .collect::<RedisResult<_>>()?;
            let master = config.master_name.clone().unwrap_or_default();
            let mut b = SentinelClientBuilder::new(sentinels, &master, SentinelServerType::Master)?
                .set_client_to_redis_db(db);
            if let Some(u) = settings.username() {
                b = b.set_client_to_redis_username(u);
            }
            if let Some(p) = settings.password() {
                b = b.set_client_to_redis_password(p);
            }
            #[cfg(feature = "tls")]
            if tls {
                b = b
                    .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                    .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
                if let Some(c) = certificates(&config.tls)? {
                    b = b.set_client_to_redis_certificates(c.clone()).set_client_to_sentinel_certificates(c);
                }
            }
            let cfg = redis::AsyncConnectionConfig::new()
                .set_connection_timeout(Some(config.timeout))
                .set_response_timeout(Some(config.timeout));
            let conn = SentinelConn {
                client: tokio::sync::Mutex::new(b.build()?),
                current: Shared::new(),
                cfg,
                master,
            };
            return Ok(Self { inner: Inner::Sentinel(Arc::new(conn)), db });
        }
        if !config.cluster.is_empty() {
            let scheme = if tls { "rediss" } else { "redis" };
            let nodes: Vec<String> = config
                .cluster
                .iter()
                .map(|s| {
                    host_port(s)
                        .map(|(h, p)| format!("{scheme}://{h}:{p}"))
                        .ok_or_else(|| config_error(format!("redis.cluster: {s:?} is not host:port")))
                })
                .collect::<RedisResult<_>>()?;
            let mut b = redis::cluster::ClusterClientBuilder::new(nodes)
                .connection_timeout(config.timeout)
                .response_timeout(config.timeout)
                .overall_response_timeout(Some(config.timeout + config.timeout))
                .retries(3);
            if let Some(u) = settings.username() {
                b = b.username(u);
            }
            if let Some(p) = settings.password() {
                b = b.password(p);
            }
            #[cfg(feature = "tls")]
            if tls {
                b = b.tls(redis::TlsMode::Secure);
                if let Some(c) = certificates(&config.tls)? {
                    b = b.certs(c);
                }
            }
            let lazy = LazyCluster { client: b.build()?, conn: Shared::new() };
            return Ok(Self { inner: Inner::Cluster(Arc::new(lazy)), db: 0 });
        }
        let client = crate::tls::redis_client(&config.url, &config.tls)?;
        let cm = ConnectionManagerConfig::new()
            .set_response_timeout(Some(config.timeout))
            .set_connection_timeout(Some(config.timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        Ok(Self { inner: Inner::Single(ConnectionManager::new_lazy_with_config(client, cm)?), db })
    }

    /// Like [`RedisConn::new`], then one `PING` (within `redis.timeout`) to prove Redis answers.
    pub async fn connect(config: &RedisConfig) -> RedisResult<Self> {
        let mut conn = Self::new(config)?;
        let cmd = redis::cmd("PING");
        let ping = cmd.query_async::<String>(&mut conn);
        match tokio::time::timeout(config.timeout + config.timeout, ping).await {
            Ok(r) => r.map(|_| conn),
            Err(_) => Err(RedisError::from((
                ErrorKind::Io,
                "no answer",
                format!("no PING answer within {:?}", config.timeout + config.timeout),
            ))),
        }
    }

    /// Which kind of deployment this talks to (`single`, `sentinel`, `cluster`).
    pub fn kind(&self) -> &'static str {
        match self.inner {
            Inner::Single(_) => "single",
            Inner::Sentinel(_) => "sentinel",
            Inner::Cluster(_) => "cluster",
        }
    }
}

/// The connection clones share, numbered so that a failure drops only the connection it
/// happened on (never a newer one made meanwhile).
struct Shared<C> {
    current: Mutex<Option<(u64, C)>>,
    made: std::sync::atomic::AtomicU64,
}

impl<C: Clone> Shared<C> {
    fn new() -> Self {
        Self { current: Mutex::new(None), made: std::sync::atomic::AtomicU64::new(0) }
    }

    fn get(&self) -> Option<(u64, C)> {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Keeps `conn` unless another caller stored one first (then returns that one).
    fn keep(&self, conn: C) -> (u64, C) {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(other) = current.as_ref() {
            return other.clone();
        }
        let generation = self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        *current = Some((generation, conn.clone()));
        (generation, conn)
    }

    fn drop_generation(&self, generation: u64) {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if current.as_ref().is_some_and(|(g, _)| *g == generation) {
            *current = None;
        }
    }
}

/// Whether `e` means the connection is gone (drop it, reconnect on the next call).
fn broken(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() || readonly(e)
}

fn readonly(e: &RedisError) -> bool {
    e.code() == Some("READONLY")
}

fn any_readonly(values: &[Value]) -> bool {
    values.iter().any(|v| matches!(v, Value::ServerError(e) if e.code() == "READONLY"))
}

/// The master as the sentinels name it, connected on demand.
struct SentinelConn {
    client: tokio::sync::Mutex<SentinelClient>,
    current: Shared<MultiplexedConnection>,
    cfg: redis::AsyncConnectionConfig,
    master: String,
}

impl SentinelConn {
    async fn conn(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(c) = self.current.get() {
            return Ok(c);
        }
        // One caller at a time asks the sentinels; the others then find its connection.
        let mut client = self.client.lock().await;
        if let Some(c) = self.current.get() {
            return Ok(c);
        }
        let master = client.async_get_client().await.map_err(|e| {
            RedisError::from((
                e.kind(),
                "sentinel",
                format!("no master {:?} from the sentinels: {e}", self.master),
            ))
        })?;
        let conn = master.get_multiplexed_async_connection_with_config(&self.cfg).await?;
        Ok(self.current.keep(conn))
    }

    fn drop_connection(&self, generation: u64) {
        self.current.drop_generation(generation);
    }

    async fn command(&self, cmd: &Cmd) -> RedisResult<Value> {
        for attempt in 0..2 {
            let (generation, mut conn) = self.conn().await?;
            match conn.req_packed_command(cmd).await {
                Err(e) if broken(&e) => {
                    self.drop_connection(generation);
                    if !(readonly(&e) && attempt == 0) {
                        return Err(e);
                    }
                }
                other => return other,
            }
        }
        Err(RedisError::from((ErrorKind::Io, "sentinel", "the master changed twice".to_string())))
    }

    async fn pipeline(&self, pipe: &Pipeline, offset: usize, count: usize) -> RedisResult<Vec<Value>> {
        for attempt in 0..2 {
            let (generation, mut conn) = self.conn().await?;
            match conn.req_packed_commands(pipe, offset, count).await {
                Err(e) if broken(&e) => {
                    self.drop_connection(generation);
                    if !(readonly(&e) && attempt == 0) {
                        return Err(e);
                    }
                }
                // A demoted master refuses every write of the pipeline: resend it all.
                Ok(values) if any_readonly(&values) => {
                    self.drop_connection(generation);
                    if attempt == 1 {
                        return Ok(values);
                    }
                }
                other => return other,
            }
        }
        Err(RedisError::from((ErrorKind::Io, "sentinel", "the master changed twice".to_string())))
    }
}

/// The cluster connection, made on first use. redis's cluster connection follows `MOVED`
/// and reconnects to a node that dropped, but keeps routing a dead master's slots to it until
/// something moves them: a call that fails for want of a connection (or times out) drops the
/// whole connection, and the next call makes a new one, which reads the slot map afresh from
/// the nodes that answer (a promoted replica's slots included).
struct LazyCluster {
    client: redis::cluster::ClusterClient,
    conn: Shared<ClusterConnection>,
}

/// Drops the cluster connection a call used unless the call finished well: a call cancelled
/// by its caller's timeout never sees its error, yet says the same.
struct CallGuard<'a> {
    cluster: &'a LazyCluster,
    generation: u64,
    healthy: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if !self.healthy {
            self.cluster.drop_connection(self.generation);
        }
    }
}

impl LazyCluster {
    async fn conn(&self) -> RedisResult<(u64, ClusterConnection)> {
        if let Some(c) = self.conn.get() {
            return Ok(c);
        }
        let c = self.client.get_async_connection().await?;
        Ok(self.conn.keep(c))
    }

    fn drop_connection(&self, generation: u64) {
        self.conn.drop_generation(generation);
    }

    /// Runs `f` on the connection; drops the connection when the call fails for want of it,
    /// times out, or is cancelled.
    async fn with<T, F, Fut>(&self, f: F) -> RedisResult<T>
    where
        F: FnOnce(ClusterConnection) -> Fut,
        Fut: std::future::Future<Output = RedisResult<T>>,
    {
        let (generation, conn) = self.conn().await?;
        let mut guard = CallGuard { cluster: self, generation, healthy: false };
        let out = f(conn).await;
        guard.healthy = match &out {
            Ok(_) => true,
            Err(e) => !(broken(e) || e.kind() == ErrorKind::ClusterConnectionNotFound),
        };
        out
    }

    /// A pipeline whose commands live in several slots, as one pipeline per slot (commands
    /// over several keys, such as `MGET`, go alone and the cluster connection splits them).
    async fn pipeline(&self, pipe: &Pipeline, offset: usize, count: usize) -> RedisResult<Vec<Value>> {
        self.with(|conn| Self::split_pipeline(conn, pipe, offset, count)).await
    }

    async fn split_pipeline(
        conn: ClusterConnection,
        pipe: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let cmds: Vec<&Cmd> = pipe.cmd_iter().collect();
        let groups = slot_groups(&cmds);
        if groups.len() <= 1 || offset != 0 || count != cmds.len() {
            let mut conn = conn;
            return conn.req_packed_commands(pipe, offset, count).await;
        }
        let sends = groups.iter().map(|(_, indexes)| {
            let mut conn = conn.clone();
            let mut part = Pipeline::with_capacity(indexes.len());
            for &i in indexes {
                part.add_command(cmds[i].clone());
            }
            async move {
                let n = indexes.len();
                conn.req_packed_commands(&part, 0, n).await
            }
        });
        let answers = join_all(sends).await;
        let mut out = vec![Value::Nil; cmds.len()];
        for ((_, indexes), answer) in groups.iter().zip(answers) {
            let values = answer?;
            if values.len() != indexes.len() {
                return Err(RedisError::from((
                    ErrorKind::Client,
                    "cluster pipeline",
                    format!("{} replies to {} commands", values.len(), indexes.len()),
                )));
            }
            for (&i, v) in indexes.iter().zip(values) {
                out[i] = v;
            }
        }
        Ok(out)
    }
}

/// The key a command is routed by, `None` for commands without one (`TIME`, `PING`), and
/// `Err(())` for commands over several keys.
fn routing_key(cmd: &Cmd) -> Result<Option<Vec<u8>>, ()> {
    let args: Vec<&[u8]> = cmd
        .args_iter()
        .filter_map(|a| match a {
            redis::Arg::Simple(b) => Some(b),
            _ => None,
        })
        .collect();
    let Some(name) = args.first() else { return Ok(None) };
    let name = String::from_utf8_lossy(name).to_ascii_uppercase();
    match name.as_str() {
        "EVAL" | "EVALSHA" | "FCALL" => {
            let numkeys: usize =
                args.get(2).and_then(|n| std::str::from_utf8(n).ok()?.parse().ok()).unwrap_or(0);
            match numkeys {
                0 => Ok(None),
                1 => Ok(args.get(3).map(|k| k.to_vec())),
                _ => Err(()),
            }
        }
        "TIME" | "PING" | "SCRIPT" | "INFO" | "ECHO" | "DBSIZE" | "CLIENT" => Ok(None),
        "MGET" | "DEL" | "UNLINK" | "EXISTS" | "TOUCH" if args.len() > 2 => Err(()),
        _ => Ok(args.get(1).map(|k| k.to_vec())),
    }
}

/// Commands grouped by slot, in order of first appearance; keyless commands join the first
/// group, multi-key commands get a group each.
fn slot_groups(cmds: &[&Cmd]) -> Vec<(Option<Slot>, Vec<usize>)> {
    let mut groups: Vec<(Option<Slot>, Vec<usize>)> = Vec::new();
    let mut keyless = Vec::new();
    for (i, cmd) in cmds.iter().enumerate() {
        match routing_key(cmd) {
            Ok(Some(key)) => {
                let slot = Slot::for_key(&key);
                match groups.iter_mut().find(|(s, _)| s.as_ref() == Some(&slot)) {
                    Some((_, v)) => v.push(i),
                    None => groups.push((Some(slot), vec![i])),
                }
            }
            Ok(None) => keyless.push(i),
            Err(()) => groups.push((None, vec![i])),
        }
    }
    match groups.first_mut() {
        Some((_, first)) => {
            first.extend(keyless);
            first.sort_unstable();
        }
        None if !keyless.is_empty() => groups.push((None, keyless)),
        None => {}
    }
    groups
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.inner {
            Inner::Single(c) => c.req_packed_command(cmd),
            Inner::Sentinel(s) => {
                let s = s.clone();
                Box::pin(async move { s.command(cmd).await })
            }
            Inner::Cluster(c) => {
                let c = c.clone();
                Box::pin(
                    async move { c.with(|mut conn| async move { conn.req_packed_command(cmd).await }).await },
                )
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.inner {
            Inner::Single(c) => c.req_packed_commands(cmd, offset, count),
            Inner::Sentinel(s) => {
                let s = s.clone();
                Box::pin(async move { s.pipeline(cmd, offset, count).await })
            }
            Inner::Cluster(c) => {
                let c = c.clone();
                Box::pin(async move { c.pipeline(cmd, offset, count).await })
            }
        }
    }

    fn get_db(&self) -> i64 {
        self.db
    }
}

/// Redis `TIME`: the clock a command that publishes "what is due by now" goes by (a resume's
/// catch-up, a backfill up to `now`), as pause flags are stamped by it, so that a host whose
/// clock is ahead publishes no slot that is not due yet.
pub async fn redis_now<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
) -> redis::RedisResult<chrono::DateTime<chrono::Utc>> {
    let time: (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
    Ok(instant_of(time))
}

/// Redis `TIME` in milliseconds.
pub(crate) async fn redis_ms<C: redis::aio::ConnectionLike + Send>(conn: &mut C) -> redis::RedisResult<i64> {
    Ok(redis_us(conn).await?.div_euclid(1000))
}

/// Redis `TIME` in microseconds.
pub(crate) async fn redis_us<C: redis::aio::ConnectionLike + Send>(conn: &mut C) -> redis::RedisResult<i64> {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
    Ok(secs.saturating_mul(1_000_000).saturating_add(micros))
}

/// A `TIME` reply (seconds, microseconds) in milliseconds.
fn ms_of((secs, micros): (i64, i64)) -> i64 {
    secs * 1000 + micros / 1000
}

/// A `TIME` reply (seconds, microseconds), read in a pipeline with what it dates, as an instant.
pub(crate) fn instant_of(time: (i64, i64)) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_millis(ms_of(time)).unwrap_or_else(chrono::Utc::now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelines_are_grouped_by_slot_keeping_keyless_and_multi_key_commands_apart() {
        let mut a = redis::cmd("EVALSHA");
        a.arg("sha").arg(1).arg("p:idem:a");
        let mut b = redis::cmd("EVALSHA");
        b.arg("sha").arg(1).arg("p:idem:b");
        let mut a2 = redis::cmd("HGETALL");
        a2.arg("p:idem:a");
        let time = redis::cmd("TIME");
        let mut mget = redis::cmd("MGET");
        mget.arg("x").arg("y");
        let groups = slot_groups(&[&a, &b, &time, &a2, &mget]);
        let indexes: Vec<Vec<usize>> = groups.into_iter().map(|(_, v)| v).collect();
        assert_eq!(indexes, vec![vec![0, 2, 3], vec![1], vec![4]]);
        assert_eq!(host_port("redis-1:26379"), Some(("redis-1".into(), 26379)));
        assert_eq!(host_port("[::1]:7000"), Some(("::1".into(), 7000)));
        assert_eq!(host_port("redis-1"), None);
    }
}
