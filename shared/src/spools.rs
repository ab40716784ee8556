//! What the producers' local spools hold, as they report it to Redis (`<prefix>:spools`), so
//! that the DLQ monitor (the leader ticker, or `chime watch`) can alert while jobs wait in one:
//! the spool is on the producer's disk, the alert is wherever the monitor runs.

use chrono::{DateTime, Utc};
use redis::aio::ConnectionLike;

use crate::names::Names;

/// One spool's report: where it is and what it holds.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SpoolReport {
    /// Host of the process that reported it.
    pub host: String,
    /// The spool directory on that host.
    pub dir: String,
    /// Jobs waiting to be published.
    pub records: usize,
    /// Bytes the directory holds.
    pub bytes: u64,
    /// When the oldest waiting job was spooled.
    pub oldest: Option<DateTime<Utc>>,
    /// When this was reported.
    pub at: DateTime<Utc>,
}

impl SpoolReport {
    /// Its field in the hash: one per host and directory, whoever flushes it.
    pub fn field(&self) -> String {
        format!("{}:{}", self.host, self.dir)
    }
}

/// The host name, as reports name it.
pub fn host() -> String {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    if host.is_empty() { "host".into() } else { host }
}

/// Writes `report` (a spool that holds jobs), or removes its field (an empty one).
pub async fn report<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
    report: &SpoolReport,
) -> redis::RedisResult<()> {
    if report.records == 0 {
        return redis::cmd("HDEL").arg(names.spools()).arg(report.field()).query_async(conn).await;
    }
    let json = serde_json::to_string(report).unwrap_or_default();
    redis::cmd("HSET").arg(names.spools()).arg(report.field()).arg(json).query_async(conn).await
}

/// Every spool that reported holding jobs (a report that does not parse is skipped).
pub async fn read<C: ConnectionLike + Send>(
    conn: &mut C,
    names: &Names,
) -> redis::RedisResult<Vec<SpoolReport>> {
    let all: Vec<(String, String)> = redis::cmd("HGETALL").arg(names.spools()).query_async(conn).await?;
    Ok(all.into_iter().filter_map(|(_, v)| serde_json::from_str(&v).ok()).collect())
}
