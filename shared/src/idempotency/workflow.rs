//! Workflows: steps that wait for other steps (a scheduled job's `after`, an ad-hoc DAG, the
//! `on_complete` job of a fanned-out run).
//!
//! Every step is published at once, with its own key, its own retries and its own dead
//! letter; what it waits for travels in its envelope ([`Step`]). Waiting is pulled, not
//! pushed: before claiming its key, a step's copy reads the records of the steps it waits for
//! ([`IdemStore::wait_for`]). While one is not there yet, the copy registers itself on that
//! step's record (the field `w:<its key>` holds its route and envelope) and is parked in the
//! delay chain. The `done` or `dead` of an upstream step whose envelope says `releases` is
//! followed by [`IdemStore::release`], which takes the registered copies off its record (one
//! script: the registration and the finish are both atomic on that one record, so a copy
//! registered before the finish is always released) and publishes them at once.
//!
//! A worker killed between an upstream's `done` and that release loses nothing: the parked
//! copy comes back on its own (within [`MAX_PARK`]) and finds the upstream done. Nothing runs
//! twice: a released copy and the parked one are two copies of one key.
//!
//! A step whose upstream is dead or cancelled is **blocked**: recorded once, parked (long),
//! still registered on the dead record, so that replaying the dead step from the DLQ and its
//! `done` releases the blocked one. A step that has waited longer than
//! `redis.done_retention` is dead-lettered (reason `blocked`).

use chrono::{DateTime, Utc};
use redis::Script;
use std::sync::LazyLock;
use std::time::Duration;
use uuid::Uuid;

use crate::envelope::{Envelope, Step, Upstream, Wait};
use crate::idempotency::{IdemError, IdemStore, evalsha};
use crate::record::{KeyState, StoredResult};
use crate::redis_conn::RedisConn;
use crate::topology::Names;

/// Longest a waiting step's copy is parked between two looks at its upstream steps.
pub const MAX_PARK: Duration = Duration::from_secs(60);
/// Longest a blocked step's copy is parked between two looks.
pub const MAX_BLOCKED_PARK: Duration = Duration::from_secs(600);

/// KEYS[1] the upstream's record; ARGV waiter field, waiter value, retention_ms, wait
/// (`done`|`ended`) → `{state, res, rt, now_ms}` (`now_ms`: Redis `TIME`, which a result's `rt`
/// is judged by). Unless the upstream came to what the step waits
/// for, the step's copy is registered on the record (`w:<key>` and the flag `wn`; a record not
/// there yet is created with just that and the retention as its TTL).
static WAIT_FOR: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local h = redis.call('HMGET', KEYS[1], 's', 'res', 'rt')
local s = h[1] or ''
local ended = s == 'done' or s == 'dead' or s == 'cancelled'
if s ~= 'done' and not (ARGV[4] == 'ended' and ended) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], 'wn', 1)
  if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
end
local t = redis.call('TIME')
return {s, h[2] or '', h[3] or '', string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))}",
    )
});

/// KEYS[1] a step's record → the values of its `w:*` fields (the copies registered as
/// waiting for it), which it deletes.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('HEXISTS', KEYS[1], 'wn') == 0 then return {} end
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 2) == 'w:' then
    table.insert(out, all[i + 1])
    redis.call('HDEL', KEYS[1], all[i])
  end
end
redis.call('HDEL', KEYS[1], 'wn')
return out",
    )
});

/// KEYS[1] a waiting step's own record; ARGV what it waits for, retention_ms → `{1 when that
/// changed (0: the same as noted before), the step's own state}`. Written so that `chime inspect` shows a step that
/// has not run yet as waiting or blocked (and its history has a record to go to), and so that
/// its several copies record a wait once.
static WAITING: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local h = redis.call('HMGET', KEYS[1], 'wf', 's')
redis.call('HSET', KEYS[1], 'wf', ARGV[1])
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
local changed = 1
if h[1] == ARGV[1] then changed = 0 end
return {changed, h[2] or ''}",
    )
});

/// This module's scripts (loaded again after a Redis restart).
pub(crate) fn scripts() -> impl Iterator<Item = &'static Script> {
    [&*WAIT_FOR, &*RELEASE, &*WAITING].into_iter()
}

/// What an upstream step came to, as a waiting step sees it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct UpstreamRun {
    /// Its name within the workflow.
    pub step: String,
    /// Its job.
    pub job: String,
    /// Its key.
    pub key: Uuid,
    /// Its state (`None`: no record yet: queued, delayed, or not published).
    #[serde(serialize_with = "state_or_pending")]
    pub state: Option<KeyState>,
    /// The result its `done` run left (a value, or why none is kept).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub result: Option<StoredResult>,
}

fn state_or_pending<S: serde::Serializer>(s: &Option<KeyState>, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_str(s.as_ref().map_or("pending", KeyState::as_str))
}

impl UpstreamRun {
    /// Ended as a step waits for: `done`, or (`Wait::Ended`) also `dead` or `cancelled`.
    pub fn ended(&self, wait: Wait) -> bool {
        matches!(
            (&self.state, wait),
            (Some(KeyState::Done), _) | (Some(KeyState::Dead | KeyState::Cancelled), Wait::Ended)
        )
    }

    /// Blocks a step that waits for it to be `done`: `dead` or `cancelled`.
    pub fn blocks(&self, wait: Wait) -> bool {
        wait == Wait::Done && matches!(self.state, Some(KeyState::Dead | KeyState::Cancelled))
    }
}

/// Upstream runs as JSON of at most `max` bytes, for a handler's environment or header: with
/// their results when that fits, else without them; `None` when even that does not fit.
pub fn upstream_json(runs: &[UpstreamRun], max: usize) -> Option<String> {
    let full = serde_json::to_string(runs).ok()?;
    if full.len() <= max {
        return Some(full);
    }
    let bare: Vec<UpstreamRun> = runs.iter().map(|r| UpstreamRun { result: None, ..r.clone() }).collect();
    serde_json::to_string(&bare).ok().filter(|s| s.len() <= max)
}

/// Where a step stands, from its upstream steps' records.
#[derive(Debug, Clone, PartialEq)]
pub enum Standing {
    /// Every upstream step came to what it waits for: run, with their runs.
    Ready(Vec<UpstreamRun>),
    /// Some have not come to what it waits for yet (named).
    Waiting(Wait, Vec<UpstreamRun>),
    /// One it waits to be `done` is dead or cancelled (named).
    Blocked(Vec<UpstreamRun>),
}

impl Standing {
    /// From the upstream runs, as read.
    pub fn of(wait: Wait, runs: Vec<UpstreamRun>) -> Self {
        if runs.iter().any(|r| r.blocks(wait)) {
            Standing::Blocked(runs)
        } else if runs.iter().all(|r| r.ended(wait)) {
            Standing::Ready(runs)
        } else {
            Standing::Waiting(wait, runs)
        }
    }

    /// Says what it waits for, or what blocks it (for logs, the history and inspect): the
    /// steps by name and key, not their passing states, so that it changes only when the
    /// steps it waits for do.
    pub fn describe(&self) -> String {
        let names = |runs: &[UpstreamRun], pick: &dyn Fn(&UpstreamRun) -> bool, state: bool| {
            runs.iter()
                .filter(|r| pick(r))
                .map(|r| match (&r.state, state) {
                    (Some(s), true) => format!("{} ({s}, key {})", r.step, r.key),
                    _ => format!("{} (key {})", r.step, r.key),
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            Standing::Ready(_) => "every upstream step has ended".into(),
            Standing::Waiting(wait, runs) => {
                format!("waiting for {}", names(runs, &|r| !r.ended(*wait), false))
            }
            Standing::Blocked(runs) => format!(
                "blocked by {}: replaying it from the DLQ (or enqueueing it again) resumes this step",
                names(runs, &|r| r.blocks(Wait::Done), true)
            ),
        }
    }
}

impl IdemStore {
    /// Reads upstream step `up`'s record for the waiting copy `env` (of route `route`), and
    /// registers that copy on it unless `up` came to what `wait` asks (see the module).
    pub async fn wait_for(
        &self,
        up: &Upstream,
        env: &Envelope,
        route: &str,
        wait: Wait,
    ) -> Result<UpstreamRun, IdemError> {
        let mut cmd = evalsha(&WAIT_FOR, self.names().idem_key(&up.key.to_string()));
        let mut value = format!("{route}\n").into_bytes();
        value.extend_from_slice(&env.encode());
        let wait = match wait {
            Wait::Done => "done",
            Wait::Ended => "ended",
        };
        cmd.arg(format!("w:{}", env.key)).arg(value).arg(Self::ms(self.retention())).arg(wait);
        let (s, res, rt, now): (String, String, String, String) = self.call(cmd).await?;
        let state = (!s.is_empty()).then(|| KeyState::parse(&s));
        let result = if state == Some(KeyState::Done) {
            let now =
                now.parse().ok().and_then(chrono::DateTime::from_timestamp_millis).unwrap_or_else(Utc::now);
            StoredResult::decode((!res.is_empty()).then_some(res.as_str()), rt.parse().ok(), now)
        } else {
            None
        };
        Ok(UpstreamRun { step: up.step.clone(), job: up.job.clone(), key: up.key, state, result })
    }

    /// Takes the copies registered as waiting for `key` off its record: `(route, envelope)`
    /// of each, to publish at once.
    pub async fn release(&self, key: &str) -> Result<Vec<(String, Envelope)>, IdemError> {
        let cmd = evalsha(&RELEASE, self.names().idem_key(key));
        let values: Vec<Vec<u8>> = self.call(cmd).await?;
        Ok(values
            .iter()
            .filter_map(|v| {
                let at = v.iter().position(|b| *b == b'\n')?;
                let route = String::from_utf8(v[..at].to_vec()).ok()?;
                Some((route, Envelope::decode(&v[at + 1..]).ok()?))
            })
            .collect())
    }

    /// Notes on waiting step `key`'s own record what it waits for (the `WAITING` script): whether
    /// that changed, and the step's own state (a step cancelled while it waits need not wait).
    pub async fn note_waiting(
        &self,
        key: &str,
        standing: &str,
    ) -> Result<(bool, Option<KeyState>), IdemError> {
        let mut cmd = evalsha(&WAITING, self.names().idem_key(key));
        cmd.arg(standing).arg(Self::ms(self.retention()));
        let (n, s): (i64, String) = self.call(cmd).await?;
        Ok((n == 1, (!s.is_empty()).then(|| KeyState::parse(&s))))
    }
}

/// One step of a workflow's record.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StepRecord {
    /// Its name.
    pub step: String,
    /// Its job.
    pub job: String,
    /// Its queue.
    pub queue: String,
    /// Its key.
    pub key: Uuid,
    /// The steps it waits for (names).
    #[serde(default)]
    pub after: Vec<String>,
}

/// A workflow's record (`<prefix>:workflow:<key>`): what `chime inspect` and the dashboard
/// show of it, each step's state read from its own record.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkflowRecord {
    /// The workflow's key.
    pub key: Uuid,
    /// When it was enqueued (or its slot, for a scheduled chain).
    pub created: DateTime<Utc>,
    /// The slot, for a scheduled chain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<DateTime<Utc>>,
    /// Its steps, upstream first.
    pub steps: Vec<StepRecord>,
}

impl WorkflowRecord {
    /// The step envelopes' `step` fields: what each waits for, and whether it releases others.
    pub fn step_of(&self, name: &str) -> Option<Step> {
        let me = self.steps.iter().find(|s| s.step == name)?;
        let after = me
            .after
            .iter()
            .filter_map(|a| self.steps.iter().find(|s| &s.step == a))
            .map(|s| Upstream { step: s.step.clone(), job: s.job.clone(), key: s.key })
            .collect();
        Some(Step {
            workflow: self.key,
            name: name.to_string(),
            after,
            wait: Wait::Done,
            releases: self.steps.iter().any(|s| s.after.iter().any(|a| a == name)),
        })
    }

    /// Writes the record (kept `retention`); the first write of a key stays (a second
    /// publish of the same workflow, or a second ticker, leaves it as it is).
    pub async fn write(
        &self,
        conn: &mut RedisConn,
        names: &Names,
        retention: Duration,
    ) -> redis::RedisResult<()> {
        let json = serde_json::to_string(self).unwrap_or_default();
        let _: Option<String> = redis::cmd("SET")
            .arg(names.workflow(&self.key.to_string()))
            .arg(json)
            .arg("NX")
            .arg("PX")
            .arg(u64::try_from(retention.as_millis()).unwrap_or(u64::MAX))
            .query_async(conn)
            .await?;
        Ok(())
    }

    /// The record of workflow `key`, if there is one.
    pub async fn read(conn: &mut RedisConn, names: &Names, key: Uuid) -> redis::RedisResult<Option<Self>> {
        let json: Option<String> =
            redis::cmd("GET").arg(names.workflow(&key.to_string())).query_async(conn).await?;
        Ok(json.and_then(|j| serde_json::from_str(&j).ok()))
    }
}

/// Checks a workflow's steps and orders them (see [`crate::config::step_order`]).
pub use crate::config::step_order as order;

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct S(&'static str, Vec<String>);

    fn ord(steps: &[S]) -> Result<Vec<&str>, String> {
        order(steps, |s| s.0, |s| &s.1).map(|v| v.iter().map(|s| s.0).collect())
    }

    #[test]
    fn steps_are_ordered_and_cycles_refused_by_name() {
        let steps =
            vec![S("load", vec!["extract".into()]), S("extract", vec![]), S("report", vec!["load".into()])];
        assert_eq!(ord(&steps).unwrap(), vec!["extract", "load", "report"]);
        let cycle = vec![S("a", vec!["b".into()]), S("b", vec!["a".into()]), S("c", vec![])];
        assert_eq!(ord(&cycle).unwrap_err(), "the steps a, b wait for each other in a cycle");
        let unknown = vec![S("a", vec!["x".into()])];
        assert!(ord(&unknown).unwrap_err().contains("\"x\", which is not a step"));
        let twice = vec![S("a", vec![]), S("a", vec![])];
        assert!(ord(&twice).unwrap_err().contains("named twice"));
        let me = vec![S("a", vec!["a".into()])];
        assert!(ord(&me).unwrap_err().contains("waits for itself"));
    }

    #[test]
    fn upstream_json_drops_results_then_gives_up_past_its_limit() {
        let run = |n: usize| UpstreamRun {
            step: format!("shard-{n}"),
            job: "j".into(),
            key: Uuid::nil(),
            state: Some(KeyState::Done),
            result: Some(StoredResult::Value(serde_json::json!("x".repeat(100)))),
        };
        let runs: Vec<UpstreamRun> = (0..10).map(run).collect();
        let full = upstream_json(&runs, usize::MAX).unwrap();
        assert!(full.contains("xxxx") && full.contains("\"state\":\"done\""));
        let bare = upstream_json(&runs, full.len() - 1).unwrap();
        assert!(!bare.contains("xxxx") && bare.contains("shard-9"));
        assert_eq!(upstream_json(&runs, bare.len() - 1), None);
    }

    #[test]
    fn standing_blocks_on_dead_only_for_chains() {
        let run = |state: Option<KeyState>| UpstreamRun {
            step: "x".into(),
            job: "x".into(),
            key: Uuid::nil(),
            state,
            result: None,
        };
        assert!(matches!(Standing::of(Wait::Done, vec![run(Some(KeyState::Dead))]), Standing::Blocked(_)));
        assert!(matches!(Standing::of(Wait::Ended, vec![run(Some(KeyState::Dead))]), Standing::Ready(_)));
        assert!(matches!(Standing::of(Wait::Done, vec![run(None)]), Standing::Waiting(..)));
        assert!(matches!(
            Standing::of(Wait::Ended, vec![run(Some(KeyState::Done)), run(Some(KeyState::Running))]),
            Standing::Waiting(..)
        ));
        assert!(
            Standing::of(Wait::Done, vec![run(Some(KeyState::Cancelled))])
                .describe()
                .contains("blocked by x")
        );
    }

    #[test]
    fn a_chain_is_its_linked_jobs_upstream_first_and_its_keys_are_the_slots() {
        let every = "schedule = \"0 2 * * *\"\ntimezone = \"Europe/Berlin\"";
        let text = format!(
            "[[jobs]]\nname = \"report\"\nhandler = \"noop\"\n{every}\nafter = [\"load\"]\n\
             [[jobs]]\nname = \"load\"\nhandler = \"noop\"\n{every}\nafter = [\"extract\"]\n\
             [[jobs]]\nname = \"extract\"\nhandler = \"noop\"\n{every}\n\
             [[jobs]]\nname = \"other\"\nhandler = \"noop\"\n{every}\n"
        );
        let c = crate::config::Config::from_toml_str(&text).unwrap();
        let chain = chain_of(&c.jobs, "load");
        let names: Vec<&str> = chain.iter().map(|s| s.step.as_str()).collect();
        assert_eq!(names, ["extract", "load", "report"]);
        assert!(chain_of(&c.jobs, "other").is_empty());
        let slot = "2026-12-04T01:00:00Z".parse().unwrap();
        let wf = scheduled_chain(&chain, slot);
        assert_eq!(wf.steps[1].key, crate::envelope::scheduled_key("load", slot));
        assert_eq!(wf.key, scheduled_chain(&chain_of(&c.jobs, "report"), slot).key);
        let load = wf.step_of("load").unwrap();
        assert_eq!(load.after[0].key, crate::envelope::scheduled_key("extract", slot));
        assert!(load.releases && !wf.step_of("report").unwrap().releases);
    }
}

/// The scheduled chain a job of `jobs` belongs to (the jobs linked to it through `after`,
/// either way), upstream first; empty when it is in none.
pub fn chain_of(jobs: &[crate::config::JobConfig], name: &str) -> Vec<StepRecord> {
    let linked = |a: &crate::config::JobConfig, b: &crate::config::JobConfig| {
        a.after.contains(&b.name) || b.after.contains(&a.name)
    };
    let Some(start) = jobs.iter().find(|j| j.name == name) else { return Vec::new() };
    let mut members = vec![start];
    let mut i = 0;
    while i < members.len() {
        let m = members[i];
        for j in jobs {
            if linked(m, j) && !members.iter().any(|x| x.name == j.name) {
                members.push(j);
            }
        }
        i += 1;
    }
    if members.len() < 2 {
        return Vec::new();
    }
    let ordered: Vec<&crate::config::JobConfig> =
        order(&members, |j| j.name.as_str(), |j| j.after.as_slice())
            .map(|v| v.into_iter().copied().collect())
            .unwrap_or_else(|_| members.clone());
    ordered
        .into_iter()
        .map(|j| StepRecord {
            step: j.name.clone(),
            job: j.name.clone(),
            queue: j.queue().to_string(),
            key: Uuid::nil(),
            after: j.after.clone(),
        })
        .collect()
}

/// The record of a scheduled chain's run of `slot` (`chain` from [`chain_of`]): its key
/// derives from the chain's jobs and the slot, each step's key is its job's key of the slot.
pub fn scheduled_chain(chain: &[StepRecord], slot: DateTime<Utc>) -> WorkflowRecord {
    let mut names: Vec<&str> = chain.iter().map(|s| s.step.as_str()).collect();
    names.sort_unstable();
    let key = Uuid::new_v5(
        &crate::envelope::NAMESPACE,
        format!("chain:{}@{}", names.join(","), slot.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            .as_bytes(),
    );
    WorkflowRecord {
        key,
        created: slot,
        slot: Some(slot),
        steps: chain
            .iter()
            .map(|s| StepRecord { key: crate::envelope::scheduled_key(&s.job, slot), ..s.clone() })
            .collect(),
    }
}

/// The job a fanned-out run's `on_complete` names, as its run is published.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Its job.
    pub job: String,
    /// Its queue.
    pub queue: String,
    /// Its payload (the job's configured one).
    pub payload: serde_json::Value,
    /// Its attempts.
    pub max_attempts: u32,
    /// Its priority.
    pub priority: Option<crate::envelope::Priority>,
}

impl Completion {
    /// The `on_complete` job of `job` in `jobs`, if it names one.
    pub fn of(jobs: &[crate::config::JobConfig], job: &crate::config::JobConfig) -> Option<Self> {
        let c = jobs.iter().find(|j| Some(&j.name) == job.on_complete.as_ref())?;
        Some(Self {
            job: c.name.clone(),
            queue: c.queue().to_string(),
            payload: c.payload.clone().unwrap_or(serde_json::Value::Null),
            max_attempts: c.max_attempts(),
            priority: c.priority.filter(|p| *p != crate::envelope::Priority::Normal),
        })
    }

    /// Makes `members` (the envelopes of the run keyed `base`) steps that release, and gives
    /// the completion's envelope: keyed [`crate::envelope::completion_key`], waiting for every
    /// member to end (`done`, `dead` or `cancelled`).
    pub fn attach(&self, base: &Envelope, members: &mut [Envelope]) -> Envelope {
        let name = |e: &Envelope| match (&e.shard, &e.target) {
            (Some(s), _) => format!("shard-{s}"),
            (None, Some(w)) => format!("worker-{w}"),
            (None, None) => e.key.to_string(),
        };
        let mut after = Vec::with_capacity(members.len());
        for m in members.iter_mut() {
            let step = name(m);
            after.push(Upstream { step: step.clone(), job: m.job.clone(), key: m.key });
            m.step = Some(Step {
                workflow: base.key,
                name: step,
                after: Vec::new(),
                wait: Wait::Done,
                releases: true,
            });
        }
        let mut env = Envelope::new(
            &self.job,
            &self.queue,
            crate::envelope::completion_key(base.key),
            self.payload.clone(),
            base.slot,
            self.max_attempts,
            base.source,
        );
        env.priority = self.priority;
        env.trace_id.clone_from(&base.trace_id);
        env.backfill = base.backfill;
        env.step = Some(Step {
            workflow: base.key,
            name: "on_complete".into(),
            after,
            wait: Wait::Ended,
            releases: false,
        });
        env
    }
}
