//! Between the client and its spool: taking jobs the broker did not confirm, and publishing
//! them again once it does.
//!
//! A client with a spool keeps the order of its own jobs: while any of them is spooled, later
//! ones are spooled behind it (`backlog`), and only when a flush has published every record of
//! this process's files does it publish directly again. Appends and that last check hold one
//! lock, so no job slips between the flush's end and the switch.

use super::{EnqueueClient, EnqueueError, Prepared};
use crate::spool::{Claimed, Spool, SpoolError, Spooled};
use chime_shared::config::ValidConfig;
use chime_shared::spools::{self, SpoolReport};
use chime_shared::telemetry;
use chrono::Utc;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Records published per confirmed stretch (its progress is written to the file's sidecar).
const FLUSH_CHUNK: usize = 1000;

/// What a flush did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct FlushReport {
    /// Spool files published in full and removed.
    pub files: usize,
    /// Jobs (messages) published and confirmed.
    pub published: usize,
    /// Broadcast copies dropped because their worker is gone (as at enqueue).
    pub dropped: usize,
    /// Torn tails and damaged lines set aside (never replayed): the file, and why.
    pub torn: Vec<(PathBuf, String)>,
}

/// A client's spool, and the flusher that empties it.
pub(crate) struct Spooler {
    spool: Arc<Spool>,
    config: ValidConfig,
    /// Held by every append and by the flusher's check that this process's files are empty.
    gate: std::sync::Mutex<()>,
    /// This process has spooled jobs not yet published: later ones go behind them.
    backlog: AtomicBool,
    flusher: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Spooler {
    pub(crate) fn open(config: &ValidConfig, dir: &Path) -> Result<Self, SpoolError> {
        Ok(Self {
            spool: Arc::new(Spool::open(dir, config.producer.spool_max_bytes, &config.prefix)?),
            config: config.clone(),
            gate: std::sync::Mutex::new(()),
            backlog: AtomicBool::new(false),
            flusher: std::sync::Mutex::new(None),
        })
    }

    pub(crate) fn spool(&self) -> &Spool {
        &self.spool
    }

    /// Jobs of this process wait in the spool: a new one must queue behind them.
    pub(crate) fn backlog(&self) -> bool {
        self.backlog.load(Ordering::SeqCst)
    }

    /// Writes `messages` to the spool (durable when this returns), then makes sure a flusher
    /// runs.
    pub(crate) async fn append(self: &Arc<Self>, messages: &[Prepared], why: &str) -> Result<(), SpoolError> {
        let now = Utc::now();
        let records: Vec<Spooled> = messages
            .iter()
            .map(|m| Spooled {
                envelope: m.envelope.clone(),
                deliver_at: (!m.delay.is_zero())
                    .then(|| chrono::Duration::from_std(m.delay).ok().map(|d| now + d))
                    .flatten(),
                declare_queue: m.declare_queue.clone(),
                spooled_at: now,
                reason: why.to_string(),
            })
            .collect();
        let me = self.clone();
        let jobs: Vec<String> = records.iter().map(|r| r.envelope.job.clone()).collect();
        let written = tokio::task::spawn_blocking(move || {
            let _gate = me.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            me.spool.append(&records)?;
            Ok::<_, SpoolError>(me.backlog.swap(true, Ordering::SeqCst))
        })
        .await
        .map_err(|e| SpoolError::Io {
            path: self.spool.dir().to_path_buf(),
            source: std::io::Error::other(e),
        })?;
        // The first job of a backlog is reported at once (a short-lived producer such as
        // `chime enqueue` may be gone before its flusher reports); the flusher reports the rest.
        if !written? {
            report(&self.config, &self.spool).await;
        }
        for job in jobs {
            metrics::counter!(telemetry::JOBS_SPOOLED, "job" => job).increment(1);
        }
        tracing::warn!(jobs = messages.len(), reason = %why, dir = %self.spool.dir().display(), "broker did not take the job; spooled");
        self.start_flusher();
        Ok(())
    }

    /// Starts the background flusher unless one runs: it publishes this process's spooled
    /// jobs and what producers that have died left, retrying while the broker is away.
    pub(crate) fn start_flusher(self: &Arc<Self>) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        let mut flusher = self.flusher.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if flusher.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        *flusher = Some(handle.spawn(flush_loop(Arc::downgrade(self))));
    }

    /// Whether every record this process spooled is published; if so, later jobs are
    /// published directly again.
    fn drained(&self) -> bool {
        let _gate = self.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.spool.holds_own() {
            return false;
        }
        self.backlog.store(false, Ordering::SeqCst);
        true
    }
}

impl Drop for Spooler {
    fn drop(&mut self) {
        if let Some(h) = self.flusher.lock().ok().and_then(|mut f| f.take()) {
            h.abort();
        }
    }
}

/// Flushes until this process's own records are published, waiting 1 s doubling to 30 s
/// between failed attempts. It holds its spooler only while it flushes: once the client is
/// dropped, it ends (what is left stays in the spool for the next flush: a new client's, or
/// `chime-worker`'s and `chime tick`'s at start).
async fn flush_loop(spooler: std::sync::Weak<Spooler>) {
    let Some(first) = spooler.upgrade() else { return };
    let client = EnqueueClient::lazy(first.config.clone());
    drop(first);
    let mut wait = Duration::from_secs(1);
    loop {
        let Some(spooler) = spooler.upgrade() else { return };
        let flushed = flush(&client, &spooler.spool).await;
        report(&spooler.config, &spooler.spool).await;
        match flushed {
            Ok(report) => {
                if report.published > 0 || report.files > 0 {
                    tracing::info!(files = report.files, jobs = report.published, "spool flushed");
                }
                if spooler.drained() {
                    return;
                }
                wait = Duration::from_secs(1);
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?wait, "spool flush failed; trying again");
                drop(spooler);
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// Flushes the spool of `config` (`[producer] spool_dir`) once: every file no live producer
/// holds, oldest first (`chime spool flush`, and `chime-worker` and `chime tick` at start).
/// `Ok(None)` when no spool is configured.
pub async fn flush_spool(config: &ValidConfig) -> Result<Option<FlushReport>, EnqueueError> {
    let Some(dir) = &config.producer.spool_dir else { return Ok(None) };
    let spool = Spool::open(dir, config.producer.spool_max_bytes, &config.prefix).map_err(|source| {
        EnqueueError::Spool { context: "opening the spool (producer.spool_dir)".into(), source }
    })?;
    let flushed = flush(&EnqueueClient::lazy(config.clone()), &spool).await;
    report(config, &spool).await;
    flushed.map(Some)
}

/// Flushes the spool of `config` at a daemon's start (`chime-worker`, `chime tick`), trying
/// again (1 s doubling to 30 s) until one flush went through; nothing when no spool is set.
pub async fn flush_at_start(config: ValidConfig) {
    if config.producer.spool_dir.is_none() {
        return;
    }
    let mut wait = Duration::from_secs(1);
    loop {
        match flush_spool(&config).await {
            Ok(Some(report)) => {
                if report.files > 0 {
                    tracing::info!(files = report.files, jobs = report.published, "spool flushed at start");
                }
                return;
            }
            Ok(None) => return,
            Err(e @ EnqueueError::Spool { source: SpoolError::OtherPrefix { .. }, .. }) => {
                // Trying again cannot help: the directory is another prefix's.
                tracing::error!(error = %e, "spool not flushed at start");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?wait, "spool flush at start failed; trying again");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// Publishes every file of `spool` that can be taken now, in order, with `client`; each
/// stretch's progress is recorded as soon as the broker confirmed it, and a file goes when all
/// of it is published. Stops at the first failure (the file stays, from where it stopped).
pub(crate) async fn flush(client: &EnqueueClient, spool: &Spool) -> Result<FlushReport, EnqueueError> {
    let mut report = FlushReport::default();
    let spool_err = |source| EnqueueError::Spool { context: "flushing the spool".into(), source };
    loop {
        let Some(claimed) = spool.claim_next().map_err(spool_err)? else { break };
        if let Some(t) = &claimed.torn {
            report.torn.push(t.clone());
        }
        flush_file(client, &claimed, &mut report).await?;
        claimed.finish().map_err(spool_err)?;
        report.files += 1;
    }
    Ok(report)
}

/// Reports what `spool` holds to Redis for the monitor's alert (best effort, 5 s at most),
/// sets the bytes gauge, and warns here too once a job has waited `spool_alert_after`.
pub(crate) async fn report(config: &ValidConfig, spool: &Spool) {
    let Ok(status) = spool.status() else { return };
    metrics::gauge!(telemetry::SPOOL_BYTES).set(status.bytes as f64);
    let now = Utc::now();
    let dir = std::fs::canonicalize(spool.dir()).unwrap_or_else(|_| spool.dir().to_path_buf());
    let r = SpoolReport {
        host: spools::host(),
        dir: dir.display().to_string(),
        records: status.records,
        bytes: status.bytes,
        oldest: status.oldest,
        at: now,
    };
    if let Some(waited) = status.oldest.and_then(|o| (now - o).to_std().ok())
        && waited >= config.producer.spool_alert_after
    {
        tracing::warn!(jobs = status.records, waited = ?waited, dir = %r.dir,
            "jobs have waited in the spool longer than producer.spool_alert_after");
    }
    let names = chime_shared::topology::Names::new(&config.prefix);
    let write = async {
        let mut conn = chime_shared::redis_conn::RedisConn::connect(&config.redis).await?;
        spools::report(&mut conn, &names, &r).await
    };
    match tokio::time::timeout(Duration::from_secs(5), write).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "spool not reported to redis"),
        Err(_) => tracing::debug!("reporting the spool to redis timed out"),
    }
}

async fn flush_file(
    client: &EnqueueClient,
    claimed: &Claimed,
    report: &mut FlushReport,
) -> Result<(), EnqueueError> {
    let spool_err = |source| EnqueueError::Spool { context: "flushing the spool".into(), source };
    let mut done = 0;
    for chunk in claimed.records.chunks(FLUSH_CHUNK) {
        // Typed jobs' own queues first (a spooled job's queue may not exist yet).
        let queues: BTreeSet<&String> = chunk.iter().filter_map(|r| r.declare_queue.as_ref()).collect();
        for q in queues {
            client.declare_queue(q).await?;
        }
        let now = Utc::now();
        let prepared: Vec<Prepared> = chunk
            .iter()
            .map(|r| Prepared {
                envelope: r.envelope.clone(),
                delay: r.deliver_at.and_then(|t| (t - now).to_std().ok()).unwrap_or(Duration::ZERO),
                unverified_queue: None,
                declare_queue: None,
            })
            .collect();
        let mut start = 0;
        while start < prepared.len() {
            let sent = client.publish_batch(&prepared[start..]).await;
            for p in &prepared[start..start + sent.confirmed] {
                metrics::counter!(telemetry::SPOOL_FLUSHED, "job" => p.envelope.job.clone()).increment(1);
            }
            report.published += sent.confirmed;
            start += sent.confirmed;
            match sent.error {
                None => break,
                // A broadcast copy whose worker is gone (with its queue): dropped, as at enqueue.
                Some(EnqueueError::Amqp(e))
                    if matches!(*e, chime_shared::amqp::AmqpError::Returned { .. })
                        && prepared[start].envelope.target.is_some() =>
                {
                    tracing::info!(worker = ?prepared[start].envelope.target, key = %prepared[start].envelope.key,
                        "broadcast: that worker is gone; its spooled copy is dropped");
                    report.dropped += 1;
                    start += 1;
                }
                Some(e) => {
                    claimed.published(done + start).map_err(spool_err)?;
                    return Err(e);
                }
            }
        }
        done += chunk.len();
        claimed.published(done).map_err(spool_err)?;
    }
    Ok(())
}
