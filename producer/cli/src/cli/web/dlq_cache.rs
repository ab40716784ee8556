//! The dead letters the dashboard shows. Reading a DLQ is a pass over all of it (AMQP has no
//! "peek"): about a second per few thousand messages. So the dashboard keeps the last pass per
//! queue and reads again when the depth changed or the pass is older than [`FRESH`]: at once
//! when the DLQ is small, in the background (pages say "as of") when it is large. Actions never
//! use the cache: they name one exact id and the pass that performs them checks it again.

use chime_shared::config::ValidConfig;
use chrono::{DateTime, Utc};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::dlq::{BodyKept, DeadLetter, DlqClient, DlqError, Filter, PassReport};

/// A pass younger than this, of a DLQ whose depth has not changed, is shown as it is.
pub const FRESH: Duration = Duration::from_secs(30);
/// DLQs up to this depth are read while the page waits; deeper ones in the background.
pub const READ_INLINE: u32 = 500;
/// Dead letters a snapshot keeps (with a preview of each body): memory stays bounded however
/// deep the DLQ (`chime dlq list` lists them all).
pub const KEPT: usize = 5_000;

/// One pass over one DLQ.
#[derive(Clone)]
pub struct Snapshot {
    /// The first [`KEPT`] dead letters, bodies cut to a preview.
    pub letters: Arc<Vec<DeadLetter>>,
    /// Dead letters the pass went over.
    pub total: usize,
    pub taken_at: DateTime<Utc>,
    taken: Instant,
}

/// What a page gets for one DLQ.
pub enum View {
    /// The dead letters as of the snapshot's time; `refreshing`: a newer pass is under way.
    Ready { snapshot: Snapshot, refreshing: bool },
    /// The first pass is under way (a large DLQ): come back in a moment.
    Reading,
}

pub struct DlqCache {
    config: ValidConfig,
    client: tokio::sync::Mutex<Option<DlqClient>>,
    snapshots: Mutex<HashMap<String, Snapshot>>,
    running: Mutex<std::collections::HashSet<String>>,
}

impl DlqCache {
    pub fn new(config: ValidConfig) -> Self {
        Self {
            config,
            client: tokio::sync::Mutex::new(None),
            snapshots: Mutex::new(HashMap::new()),
            running: Mutex::new(Default::default()),
        }
    }

    fn cached(&self, queue: &str) -> Option<Snapshot> {
        self.snapshots.lock().ok()?.get(queue).cloned()
    }

    /// The dead letters of `queue` (a DLQ source name) whose depth is now `depth`.
    pub async fn view(self: &Arc<Self>, queue: &str, depth: u32) -> Result<View, DlqError> {
        let cached = self.cached(queue);
        let fresh = cached.as_ref().is_some_and(|s| s.total == depth as usize && s.taken.elapsed() < FRESH);
        if let (true, Some(snapshot)) = (fresh, &cached) {
            return Ok(View::Ready { snapshot: snapshot.clone(), refreshing: false });
        }
        if depth <= READ_INLINE {
            return Ok(View::Ready { snapshot: self.read(queue).await?, refreshing: false });
        }
        let started = self.running.lock().map(|mut r| r.insert(queue.to_string())).unwrap_or(false);
        if started {
            let me = self.clone();
            let q = queue.to_string();
            tokio::spawn(async move {
                if let Err(e) = me.read(&q).await {
                    tracing::warn!(queue = %q, error = %e, "dashboard could not read the DLQ");
                }
                if let Ok(mut r) = me.running.lock() {
                    r.remove(&q);
                }
            });
        }
        Ok(match cached {
            Some(snapshot) => View::Ready { snapshot, refreshing: true },
            None => View::Reading,
        })
    }

    /// A pass over `queue`'s DLQ now; the snapshot replaces the cached one.
    async fn read(&self, queue: &str) -> Result<Snapshot, DlqError> {
        let mut guard = self.client.lock().await;
        let client = checkout(&mut guard, &self.config).await?;
        let listing = client.list_with(queue, &Filter::default(), BodyKept::PREVIEW, KEPT).await;
        keep(&mut guard, client, listing.is_ok()).await;
        drop(guard);
        let listing = listing?;
        let snapshot = Snapshot {
            letters: Arc::new(listing.letters),
            total: listing.seen,
            taken_at: Utc::now(),
            taken: Instant::now(),
        };
        if let Ok(mut s) = self.snapshots.lock() {
            s.insert(queue.to_string(), snapshot.clone());
        }
        Ok(snapshot)
    }

    /// Replays (`replay`) or purges the dead letter with exactly this id; the cached pass of
    /// the queue is dropped.
    pub async fn act(&self, queue: &str, id: &str, replay: bool) -> Result<PassReport, DlqError> {
        let filter = Filter { ids: vec![id.to_string()], ..Filter::default() };
        let mut guard = self.client.lock().await;
        let client = checkout(&mut guard, &self.config).await?;
        let report =
            if replay { client.replay(queue, &filter).await } else { client.purge(queue, &filter).await };
        keep(&mut guard, client, report.is_ok()).await;
        drop(guard);
        if let Ok(mut s) = self.snapshots.lock() {
            s.remove(queue);
        }
        report
    }
}

/// The connected client (connecting if there is none).
async fn checkout(slot: &mut Option<DlqClient>, config: &ValidConfig) -> Result<DlqClient, DlqError> {
    match slot.take() {
        Some(c) => Ok(c),
        None => Ok(DlqClient::connect(config.clone()).await?.named("chime web")),
    }
}

/// Keeps `client` for the next call, unless its call failed (the next call connects again).
async fn keep(slot: &mut Option<DlqClient>, client: DlqClient, ok: bool) {
    if ok {
        *slot = Some(client);
    } else {
        client.close().await;
    }
}
