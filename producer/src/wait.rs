//! [`EnqueueClient::wait`]: how a job ended, and what it returned, read from its key's record.

use chime_shared::history::{HistoryReader, KeyRecord};
use chime_shared::record::{KeyState, StoredResult};
use std::time::{Duration, Instant};
use uuid::Uuid;

use crate::EnqueueClient;

/// How a job ended, as its key's record says.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Finished {
    /// It succeeded.
    Done {
        /// What it returned (a Rust handler's value, an `exec` job's `CHIME_RESULT_FILE`, an
        /// `http` job's response body), or why a result it returned is not there (too large
        /// for `results.max_bytes`, past `results.retention`); `None` if it returned nothing.
        #[serde(flatten)]
        result: Option<StoredResult>,
    },
    /// It was dead-lettered (`chime dlq show` has the whole story).
    Dead {
        /// Why, from the key's last run (with `[history]` on).
        reason: Option<String>,
        /// The last error, from the key's last run (with `[history]` on).
        error: Option<String>,
    },
    /// It was cancelled (`chime cancel`): stopped, or dropped before it ran.
    Cancelled,
    /// A sharded or broadcast run: every member ended (done, dead or cancelled), in order.
    Group {
        /// Each member and how it ended.
        members: Vec<MemberFinished>,
    },
}

/// How one member of a fanned-out run ended.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemberFinished {
    /// The member's own key.
    pub key: Uuid,
    /// Its shard (sharded runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    /// Its worker (broadcast runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// How it ended.
    #[serde(flatten)]
    pub finished: Finished,
}

/// Why [`EnqueueClient::wait`] returned without an outcome.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The job did not end within the wait.
    #[error("job {key} did not finish within {} (its key is {})", chime_shared::duration::format(*waited), state.as_ref().map_or("not claimed yet: queued, delayed or not enqueued", KeyState::as_str))]
    Timeout {
        /// The key waited for.
        key: Uuid,
        /// How long.
        waited: Duration,
        /// The key's state when the wait ended (running, free between retries, …).
        state: Option<KeyState>,
    },
    /// A fanned-out run had members that did not end within the wait.
    #[error(
        "job {key} did not finish within {} (a fanned-out run with {open} of {members} members not ended)",
        chime_shared::duration::format(*waited)
    )]
    GroupTimeout {
        /// The run's key.
        key: Uuid,
        /// How long.
        waited: Duration,
        /// Members that had not ended.
        open: usize,
        /// Members in all.
        members: usize,
    },
    /// Redis could not be asked.
    #[error("cannot read the job's record from Redis: {0}")]
    Redis(String),
}

impl Finished {
    fn of(record: &KeyRecord) -> Option<Self> {
        match record.state {
            Some(KeyState::Done) => Some(Finished::Done { result: record.result.clone() }),
            Some(KeyState::Dead) => {
                let last = record.runs.last();
                Some(Finished::Dead {
                    reason: last.and_then(|r| r.reason.clone()),
                    error: last.and_then(|r| r.error.clone()),
                })
            }
            Some(KeyState::Cancelled) => Some(Finished::Cancelled),
            _ => None,
        }
    }
}

impl EnqueueClient {
    /// Waits until the job under `key` (an [`crate::Enqueued::key`]) is done or dead, for at
    /// most `timeout`, and returns how it ended with its result; for a sharded or broadcast
    /// run, until every member has ended ([`Finished::Group`]). Reads the key's record in
    /// Redis (connected on first use), every 20 ms at first and every 500 ms at most; a job
    /// that already ended returns at once, for as long as its record is kept
    /// (`redis.done_retention`).
    pub async fn wait(&self, key: Uuid, timeout: Duration) -> Result<Finished, WaitError> {
        let reader = self
            .redis
            .get_or_try_init(|| HistoryReader::connect(&self.config.redis, self.names.clone()))
            .await
            .map_err(|e| WaitError::Redis(e.to_string()))?;
        // A fanned-out run's key names its group record; its members have the records.
        let group = chime_shared::group::read(&mut reader.connection(), &self.names, key)
            .await
            .map_err(|e| WaitError::Redis(e.to_string()))?;
        if let Some(group) = group {
            return self.wait_members(reader, key, group.fan.members(key), timeout).await;
        }
        let start = Instant::now();
        let mut pause = Duration::from_millis(20);
        loop {
            let record =
                reader.record(&key.to_string()).await.map_err(|e| WaitError::Redis(e.to_string()))?;
            if let Some(done) = Finished::of(&record) {
                return Ok(done);
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(WaitError::Timeout { key, waited: timeout, state: record.state });
            }
            tokio::time::sleep(pause.min(left)).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// Waits until every member has ended.
    async fn wait_members(
        &self,
        reader: &HistoryReader,
        key: Uuid,
        members: Vec<chime_shared::group::Member>,
        timeout: Duration,
    ) -> Result<Finished, WaitError> {
        let start = Instant::now();
        let mut pause = Duration::from_millis(20);
        let mut ended: Vec<Option<Finished>> = vec![None; members.len()];
        loop {
            for (m, slot) in members.iter().zip(ended.iter_mut()).filter(|(_, e)| e.is_none()) {
                let record =
                    reader.record(&m.key.to_string()).await.map_err(|e| WaitError::Redis(e.to_string()))?;
                *slot = Finished::of(&record);
            }
            if ended.iter().all(Option::is_some) {
                let members = members
                    .into_iter()
                    .zip(ended)
                    .filter_map(|(m, f)| {
                        Some(MemberFinished { key: m.key, shard: m.shard, worker: m.target, finished: f? })
                    })
                    .collect();
                return Ok(Finished::Group { members });
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let open = ended.iter().filter(|e| e.is_none()).count();
                return Err(WaitError::GroupTimeout { key, waited: timeout, open, members: ended.len() });
            }
            tokio::time::sleep(pause.min(left)).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_says_how_long_in_the_configs_units() {
        let e = WaitError::Timeout { key: Uuid::nil(), waited: Duration::from_secs(90), state: None };
        assert!(e.to_string().contains("did not finish within 1m 30s (its key is not claimed yet"), "{e}");
        let e = WaitError::Timeout { key: Uuid::nil(), waited: Duration::ZERO, state: None };
        assert!(e.to_string().contains("within 0s"), "{e}");
    }
}
