//! Ad-hoc workflows: a small DAG of jobs enqueued at once (`EnqueueClient::workflow`,
//! `chime enqueue --workflow FILE`, `POST /api/v1/workflows`). Every step is published now,
//! keyed from the workflow's key and its name; a step waits on its worker for the steps it
//! names in `after` (see `chime_shared::workflow`).

use chime_shared::config::Priority;
use chime_shared::envelope::{NAMESPACE, step_key};
use chime_shared::workflow::{StepRecord, WorkflowRecord};
use std::collections::HashSet;
use uuid::Uuid;

use super::{BatchReport, EnqueueClient, EnqueueError, EnqueueRequest};

/// Most steps one workflow may have.
pub const MAX_STEPS: usize = 1000;

/// An ad-hoc workflow: its steps and what each waits for. As a file (TOML, or JSON for a
/// `.json` file): `key = "…"` and `[[steps]]` tables.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkflowRequest {
    /// The workflow's own key: the same key enqueues the same workflow once (its steps'
    /// keys derive from it). Without one, a random key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The steps.
    pub steps: Vec<StepRequest>,
}

/// One step of a [`WorkflowRequest`].
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct StepRequest {
    /// Its name within the workflow (what `after` names).
    pub name: String,
    /// The job it runs (default: its name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// Its payload (default: the job's configured one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<serde_json::Value>,
    /// The steps that must be `done` before it starts (it receives their results).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<String>,
    /// Overrides the job's queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// Overrides the job's `max_attempts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Overrides the job's priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
}

impl WorkflowRequest {
    /// A workflow from its JSON form (a byte-order mark ignored): an object with `steps`
    /// (and an optional `key`). Anything else is refused saying what a workflow is, with no
    /// Rust type names.
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        let bytes = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(bytes);
        let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
        // serde would take an array as the fields in order ("expected a string").
        if first.is_some_and(|b| *b != b'{') {
            return Err(
                "a workflow is a JSON object: {\"key\": \"…\", \"steps\": [{\"name\": \"…\"}, …]}".into()
            );
        }
        serde_json::from_slice(bytes)
            .map_err(|e| chime_shared::config::plain_types(&e.to_string(), "an object"))
    }

    /// The workflow's key: UUIDv5(ns, "workflow#{key}"), or a random one.
    pub fn workflow_key(&self) -> Uuid {
        match &self.key {
            Some(k) => Uuid::new_v5(&NAMESPACE, format!("workflow#{k}").as_bytes()),
            None => chime_shared::envelope::new_id(),
        }
    }
}

/// What [`EnqueueClient::workflow`] published.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkflowEnqueued {
    /// The workflow's key (`chime inspect` shows its steps).
    pub key: Uuid,
    /// Its steps, upstream first.
    pub steps: Vec<StepRecord>,
    /// Steps the broker confirmed; the rest (if any) went to the spool.
    pub confirmed: usize,
    /// Steps written to the local spool.
    pub spooled: usize,
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> EnqueueError {
    EnqueueError::Invalid { field: field.into(), message: message.into() }
}

impl EnqueueClient {
    /// Enqueues a workflow: checks it whole (names, `after`, cycles, each step as
    /// [`EnqueueClient::prepare`] checks a job) before anything is written, records it in
    /// Redis, then publishes every step (with a spool, as [`EnqueueClient::enqueue_batch`]).
    /// Enqueued again with the same key, its steps are absorbed as duplicates.
    pub async fn workflow(&self, wf: &WorkflowRequest) -> Result<WorkflowEnqueued, EnqueueError> {
        if wf.steps.is_empty() {
            return Err(invalid("steps", "a workflow needs at least one step"));
        }
        if wf.steps.len() > MAX_STEPS {
            return Err(invalid("steps", format!("{} steps, more than {MAX_STEPS}", wf.steps.len())));
        }
        if let Some(k) = &wf.key
            && (k.is_empty() || k.len() > 200)
        {
            return Err(invalid("key", "must be 1-200 characters"));
        }
        let ordered = chime_shared::workflow::order(&wf.steps, |s| s.name.as_str(), |s| s.after.as_slice())
            .map_err(|e| invalid("steps", e))?;
        let key = wf.workflow_key();
        let mut steps = Vec::with_capacity(ordered.len());
        let mut prepared = Vec::with_capacity(ordered.len());
        for s in &ordered {
            let job = s.job.clone().unwrap_or_else(|| s.name.clone());
            let field = |f: &str| format!("steps.{}.{f}", s.name);
            if self.config.job(&job).is_some_and(|j| j.shards.is_some() || j.broadcast) {
                return Err(invalid(
                    field("job"),
                    format!("{job:?} is sharded or broadcast: a workflow step is one run"),
                ));
            }
            let mut req = EnqueueRequest::new(&job);
            req.payload = s.payload.clone();
            req.queue = s.queue.clone();
            req.max_attempts = s.max_attempts;
            req.priority = s.priority;
            let mut p = self.prepare(&req).map_err(|e| match e {
                EnqueueError::Invalid { field: f, message } => invalid(field(&f), message),
                EnqueueError::UnknownJob(j) => {
                    invalid(field("job"), format!("unknown job {j:?} (not in the config's [[jobs]])"))
                }
                other => other,
            })?;
            p.envelope.key = step_key(key, &s.name);
            steps.push(StepRecord {
                step: s.name.clone(),
                job,
                queue: p.envelope.queue.clone(),
                key: p.envelope.key,
                after: s.after.clone(),
            });
            prepared.push(p);
        }
        let record = WorkflowRecord { key, created: chrono::Utc::now(), slot: None, steps };
        for (p, s) in prepared.iter_mut().zip(&record.steps) {
            p.envelope.step = record.step_of(&s.step);
            let size = p.envelope.encoded_len();
            if size > self.config.amqp.max_message_bytes {
                return Err(EnqueueError::TooLarge {
                    job: p.envelope.job.clone(),
                    size,
                    max: self.config.amqp.max_message_bytes,
                });
            }
        }
        let mut checked = HashSet::new();
        for p in &prepared {
            let queue = p.unverified_queue.as_ref().or(p.declare_queue.as_ref());
            if queue.is_some_and(|q| checked.insert(q.clone())) {
                self.check_queue(p).await?;
            }
        }
        self.write_workflow(&record).await?;
        let report: BatchReport = self.send_batch(&prepared).await;
        if let Some(e) = report.error {
            return Err(e);
        }
        Ok(WorkflowEnqueued {
            key,
            steps: record.steps,
            confirmed: report.confirmed,
            spooled: report.spooled,
        })
    }

    async fn write_workflow(&self, record: &WorkflowRecord) -> Result<(), EnqueueError> {
        let redis_err =
            |e: redis::RedisError| EnqueueError::Redis(format!("writing the workflow's record: {e}"));
        let mut conn = self.redis_conn().await.map_err(redis_err)?;
        record.write(&mut conn, &self.names, self.config.redis.done_retention).await.map_err(redis_err)
    }
}

#[cfg(test)]
mod tests {
    use super::WorkflowRequest;

    #[test]
    fn from_json_takes_an_object_and_names_anything_else() {
        let wf = WorkflowRequest::from_json("\u{feff} {\"steps\": [{\"name\": \"a\"}]}".as_bytes()).unwrap();
        assert_eq!(wf.steps[0].name, "a");
        for text in [r#"[{"name": "a"}]"#, r#""steps""#, "42", "null"] {
            let e = WorkflowRequest::from_json(text.as_bytes()).unwrap_err();
            assert!(e.starts_with("a workflow is a JSON object"), "{text}: {e}");
        }
        let e = WorkflowRequest::from_json(br#"{"steps": 3}"#).unwrap_err();
        assert!(e.contains("invalid type: integer `3`, expected a sequence"), "{e}");
        let e = WorkflowRequest::from_json(b"{").unwrap_err();
        assert!(!e.contains("struct"), "{e}");
    }
}
