//! `chime history` (what ran) and `chime inspect` (one key: its record, its runs, its dead
//! letter).

use chime_shared::config::Config;
use chime_shared::config::ValidConfig;
use chime_shared::history::{HistoryReader, KeyRecord, Outcome, Query, RunEvent};
use chime_shared::record::{KeyState, StoredResult};
use chime_shared::redact::escape_control;
use chime_shared::topology::Names;
use chrono::{DateTime, Utc};
use clap::Args;
use uuid::Uuid;

use super::failure::{Failure, runtime, usage};
use super::table;
use crate::dlq::{DlqClient, Filter};

#[derive(Debug, Args)]
pub struct HistoryArgs {
    /// Only this job
    #[arg(long)]
    pub job: Option<String>,
    /// Only this idempotency key (a UUID)
    #[arg(long)]
    pub key: Option<String>,
    /// Only this queue
    #[arg(long)]
    pub queue: Option<String>,
    /// Only this outcome: succeeded, retried, dead_lettered, expired, stopped, lost_lease
    #[arg(long)]
    pub outcome: Option<String>,
    /// Only runs that finished within this long ("1h", "2d")
    #[arg(long, value_name = "DUR")]
    pub since: Option<String>,
    /// Only runs older than this cursor: a stream entry id, or a run's `entry` from `--json`
    /// (`<entry>:<index>`); the next page of a search
    #[arg(long, value_name = "ENTRY")]
    pub before: Option<String>,
    /// At most this many runs, newest first
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    /// Count the matching runs by job, queue and worker and outcome instead of listing them
    /// (with `--since`: "did everything run in the last hour?")
    #[arg(long, conflicts_with_all = ["key", "before"])]
    pub totals: bool,
    /// Print JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The idempotency key (a UUID, as printed by `chime enqueue` and `chime history`)
    #[arg(required_unless_present = "job", conflicts_with = "job")]
    pub key: Option<String>,
    /// Derive the key from a job name and the `--key` given to `chime enqueue` (or a
    /// scheduled slot, `--slot`)
    #[arg(long)]
    pub job: Option<String>,
    /// With `--job`: the key given to `chime enqueue --key`
    #[arg(long = "key", value_name = "K", id = "user_key", conflicts_with = "slot")]
    pub user_key: Option<String>,
    /// With `--job`: a scheduled slot (RFC 3339), as `chime jobs next` prints them
    #[arg(long, value_name = "RFC3339")]
    pub slot: Option<String>,
    /// Print JSON
    #[arg(long)]
    pub json: bool,
}

pub async fn reader(config: &Config) -> Result<HistoryReader, Failure> {
    // The Redis error stays the cause: the command names the server it came from.
    HistoryReader::connect(&config.redis, Names::new(&config.prefix)).await.map_err(runtime)
}

/// A `--key` argument: a UUID.
fn parse_key(text: &str) -> Result<Uuid, Failure> {
    Uuid::parse_str(text.trim()).map_err(|_| {
        usage(anyhow::anyhow!(
            "{:?} is not an idempotency key (a UUID); to derive one from `chime enqueue --key K`, \
             use `chime inspect --job JOB --key K`",
            escape_control(text)
        ))
    })
}

/// The query `args` describe.
pub fn query(args: &HistoryArgs) -> Result<Query, Failure> {
    let outcome = args
        .outcome
        .as_deref()
        .map(|o| {
            Outcome::parse(o).ok_or_else(|| {
                let all: Vec<&str> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
                usage(anyhow::anyhow!("--outcome {o:?}: expected one of {}", all.join(", ")))
            })
        })
        .transpose()?;
    let since = args
        .since
        .as_deref()
        .map(|d| {
            chime_shared::duration::parse(d).map_err(|e| usage(anyhow::anyhow!("--since: {e}"))).and_then(
                |d| chrono::Duration::from_std(d).map_err(|e| usage(anyhow::anyhow!("--since: {e}"))),
            )
        })
        .transpose()?
        .map(|d| Utc::now() - d);
    let key = args.key.as_deref().map(parse_key).transpose()?.map(|k| k.to_string());
    if args.limit == 0 {
        return Err(usage(anyhow::anyhow!("--limit must be at least 1")));
    }
    if let Some(b) = args.before.as_deref().filter(|b| !chime_shared::history::valid_cursor(b)) {
        return Err(usage(anyhow::anyhow!(
            "--before {:?}: not a history cursor (the entry a listing printed, e.g. 1764698000000-0:3)",
            escape_control(b)
        )));
    }
    Ok(Query {
        queue: args.queue.clone(),
        job: args.job.clone(),
        key,
        outcome,
        since,
        before: args.before.clone(),
        limit: args.limit,
    })
}

fn at(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3f").to_string()
}

fn cut(s: &str, n: usize) -> String {
    let one_line = escape_control(&s.replace('\n', " ")).into_owned();
    if one_line.chars().count() <= n {
        one_line
    } else {
        format!("{}…", one_line.chars().take(n - 1).collect::<String>())
    }
}

/// Runs as a table, newest first.
pub fn print_runs(events: &[RunEvent]) {
    let mut t = table::new(
        ["FINISHED (UTC)", "JOB", "QUEUE", "OUTCOME", "ATT", "TOOK", "WORKER", "KEY", "ERROR"],
        &["ATT", "TOOK"],
    );
    for e in events {
        let took =
            e.duration_ms.map(|ms| format!("{:.3}s", ms as f64 / 1000.0)).unwrap_or_else(|| "-".into());
        let error = match (&e.reason, &e.error) {
            (Some(r), Some(err)) => format!("{r}: {err}"),
            (Some(r), None) => r.clone(),
            (None, Some(err)) => err.clone(),
            (None, None) => String::new(),
        };
        t.add_row([
            at(e.finished_at),
            cut(if e.job.is_empty() { "-" } else { &e.job }, 32),
            e.queue.clone(),
            e.outcome.as_str().to_string(),
            format!("{}/{}", e.attempt, e.max_attempts),
            took,
            cut(&e.worker, 28),
            if e.key.is_empty() { "-".into() } else { e.key.clone() },
            cut(&error, 60),
        ]);
    }
    table::print(&t);
}

pub async fn history(config: ValidConfig, args: HistoryArgs) -> Result<(), Failure> {
    let q = query(&args)?;
    let reader = reader(&config).await?;
    if args.totals {
        let totals = reader.totals(&config.all_queues(), &q).await.map_err(runtime)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&totals).unwrap_or_default());
        } else {
            print_totals(&totals);
        }
        return Ok(());
    }
    let found = reader.search(&config.all_queues(), &q).await.map_err(runtime)?;
    if args.json {
        let out = serde_json::json!({"runs": found.events, "scanned": found.scanned, "more_before": found.truncated});
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
        return Ok(());
    }
    if found.events.is_empty() {
        println!("no runs found");
    } else {
        print_runs(&found.events);
    }
    match (&found.truncated, &found.next) {
        (Some(entry), _) => {
            eprintln!(
                "searched the newest {} runs; older runs may match: add --before {entry}",
                found.scanned
            )
        }
        (None, Some(entry)) => eprintln!("older runs: add --before {entry}"),
        _ => {}
    }
    Ok(())
}

/// Outcome counts, one table each by job, queue and worker.
fn print_totals(totals: &chime_shared::history::Totals) {
    let outcomes: Vec<&str> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
    let upper: Vec<String> = outcomes.iter().map(|o| o.to_uppercase()).collect();
    for (title, map) in [("JOB", &totals.by_job), ("QUEUE", &totals.by_queue), ("WORKER", &totals.by_worker)]
    {
        // A column per outcome, whatever their number.
        let mut head = [""; Outcome::ALL.len() + 2];
        head[0] = title;
        head[1] = "RUNS";
        for (slot, name) in head.iter_mut().skip(2).zip(&upper) {
            *slot = name;
        }
        let mut t = table::new(head, &head[1..]);
        for (name, counts) in map {
            let mut row = vec![name.clone(), counts.values().sum::<u64>().to_string()];
            row.extend(outcomes.iter().map(|o| counts.get(*o).copied().unwrap_or(0).to_string()));
            t.add_row(row);
        }
        table::print(&t);
        println!();
    }
    println!("{} run(s) counted", totals.runs);
    if totals.truncated {
        eprintln!(
            "stopped at the search budget after {} runs: older runs in the window were not counted (narrow --since, --queue or --job)",
            totals.scanned
        );
    }
}

pub async fn inspect(config: ValidConfig, args: InspectArgs) -> Result<(), Failure> {
    let key = match (&args.key, &args.job, &args.user_key, &args.slot) {
        (Some(k), _, _, _) => parse_key(k)?,
        (None, Some(_), Some(k), _) if k.is_empty() => {
            return Err(usage(anyhow::anyhow!("--key: must not be empty (as chime enqueue --key)")));
        }
        (None, Some(job), Some(k), _) => chime_shared::envelope::adhoc_key(job, k),
        (None, Some(job), None, Some(slot)) => {
            let slot = slot
                .parse::<chrono::DateTime<chrono::Utc>>()
                .map_err(|e| usage(anyhow::anyhow!("--slot {slot:?}: not an RFC 3339 time: {e}")))?;
            chime_shared::envelope::scheduled_key(job, slot)
        }
        _ => return Err(usage(anyhow::anyhow!("give a KEY, or --job JOB with --key K or --slot RFC3339"))),
    };
    let reader = reader(&config).await?;
    let view = KeyView::load(&config, &reader, key, true).await.map_err(runtime)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&view.json(&reader).await.map_err(runtime)?).unwrap_or_default()
        );
        return Ok(());
    }
    if let Some(group) = &view.group {
        return print_group(&reader, group).await;
    }
    if let Some(wf) = &view.workflow {
        return print_workflow(&reader, wf).await;
    }
    let (record, dead, queues) = (&view.record, &view.dead, &view.queues);
    print_record(&key, record);
    if dead.is_empty() {
        println!(
            "dead letters: none in {}",
            queues.iter().map(|q| format!("{q}'s DLQ")).collect::<Vec<_>>().join(", ")
        );
    } else {
        for d in dead {
            println!(
                "dead letter: {} in {}'s DLQ ({}{}) — `chime dlq replay {}` runs it again",
                d.id,
                d.queue,
                d.reason,
                d.error.as_deref().map(|e| format!(": {}", cut(e, 80))).unwrap_or_default(),
                d.id
            );
        }
    }
    Ok(())
}

/// One key as `chime inspect` and the HTTP API show it: its record, or the group it names, and
/// its dead letters.
pub struct KeyView {
    pub key: Uuid,
    pub record: KeyRecord,
    /// A fanned-out run: the key names its group; each member has a record of its own.
    pub group: Option<chime_shared::group::GroupRecord>,
    /// A workflow: the key names it; each step has a record of its own.
    pub workflow: Option<chime_shared::workflow::WorkflowRecord>,
    /// The DLQs searched (those the key's runs name, or every queue when none ran here).
    pub queues: Vec<String>,
    pub dead: Vec<crate::dlq::DeadLetter>,
}

impl KeyView {
    /// Reads `key`; its DLQs are searched when `search_dlq` is set, or else only when the
    /// record says the key is dead (a pass over a DLQ may take seconds).
    pub async fn load(
        config: &ValidConfig,
        reader: &HistoryReader,
        key: Uuid,
        search_dlq: bool,
    ) -> anyhow::Result<Self> {
        let record = reader.record(&key.to_string()).await?;
        let group =
            chime_shared::group::read(&mut reader.connection(), &Names::new(&config.prefix), key).await?;
        let workflow = if group.is_none() && record.state.is_none() {
            chime_shared::workflow::WorkflowRecord::read(
                &mut reader.connection(),
                &Names::new(&config.prefix),
                key,
            )
            .await?
        } else {
            None
        };
        let mut queues: Vec<String> = record.runs.iter().map(|r| r.queue.clone()).collect();
        queues.sort();
        queues.dedup();
        if queues.is_empty() {
            queues = config.all_queues();
        }
        let mut dead = Vec::new();
        if group.is_none() && workflow.is_none() && (search_dlq || record.state == Some(KeyState::Dead)) {
            let dlq = DlqClient::connect(config.clone()).await?.named("chime inspect");
            let filter = Filter { keys: vec![key], ..Filter::default() };
            for q in &queues {
                dead.extend(dlq.list(q, &filter).await?);
            }
            dlq.close().await;
        }
        Ok(Self { key, record, group, workflow, queues, dead })
    }

    /// What `chime inspect --json` prints.
    pub async fn json(&self, reader: &HistoryReader) -> anyhow::Result<serde_json::Value> {
        if let Some(group) = &self.group {
            let view = GroupView::read(reader, group).await?;
            let rows: Vec<serde_json::Value> = view
                .members
                .iter()
                .zip(&view.records)
                .map(|(m, r)| serde_json::json!({"member": m, "record": r}))
                .collect();
            return Ok(serde_json::json!({"key": group.base, "group": group, "members": rows,
                "complete": view.done == view.members.len()}));
        }
        if let Some(wf) = &self.workflow {
            let view = WorkflowView::read(reader, wf).await?;
            let steps: Vec<serde_json::Value> = wf
                .steps
                .iter()
                .zip(&view.records)
                .map(|(s, r)| serde_json::json!({"step": s, "state": WorkflowView::state(r), "record": r}))
                .collect();
            return Ok(serde_json::json!({"key": wf.key, "workflow": wf, "steps": steps,
                "complete": view.done == wf.steps.len()}));
        }
        let dead: Vec<_> = self
            .dead
            .iter()
            .map(|d| serde_json::json!({"id": d.id, "queue": d.queue, "reason": d.reason, "error": d.error}))
            .collect();
        Ok(serde_json::json!({"key": self.key, "record": self.record, "dead_letters": dead}))
    }
}

/// A fanned-out run's members, each with its state and record, and what the run adds up to
/// (shared by `chime inspect` and the dashboard's key page).
pub struct GroupView {
    pub members: Vec<chime_shared::group::Member>,
    /// State and finish time of each member's key (`None`: no record — not started).
    pub states: Vec<Option<(KeyState, Option<DateTime<Utc>>)>>,
    pub records: Vec<KeyRecord>,
    pub done: usize,
    pub missing: usize,
}

impl GroupView {
    pub async fn read(
        reader: &HistoryReader,
        group: &chime_shared::group::GroupRecord,
    ) -> redis::RedisResult<Self> {
        let members = group.fan.members(group.base);
        let keys: Vec<String> = members.iter().map(|m| m.key.to_string()).collect();
        let states = reader.states(&keys).await?;
        let mut records = Vec::new();
        for k in &keys {
            records.push(reader.record(k).await?);
        }
        let done = states.iter().filter(|s| s.as_ref().is_some_and(|(s, _)| *s == KeyState::Done)).count();
        let missing = states.iter().filter(|s| s.is_none()).count();
        Ok(Self { members, states, records, done, missing })
    }

    /// `complete: every member is done`, or how many are done and not started.
    pub fn summary(&self) -> String {
        if self.done == self.members.len() {
            "complete: every member is done".to_string()
        } else {
            format!(
                "{} of {} done; {} not started (queued, or lost)",
                self.done,
                self.members.len(),
                self.missing
            )
        }
    }

    /// `shard 2`, `worker host:pid`.
    pub fn label(m: &chime_shared::group::Member) -> String {
        match (&m.shard, &m.target) {
            (Some(i), _) => format!("shard {i}"),
            (_, Some(w)) => format!("worker {w}"),
            _ => String::new(),
        }
    }

    /// `shards: 3`, `broadcast to 2 workers`.
    pub fn fan(group: &chime_shared::group::GroupRecord) -> String {
        match &group.fan {
            chime_shared::group::Fan::Shards(n) => format!("{n} shards"),
            chime_shared::group::Fan::Broadcast(w) => format!("broadcast to {} workers", w.len()),
        }
    }
}

/// A workflow's steps, each with its record (shared by `chime inspect` and the dashboard).
pub struct WorkflowView {
    pub records: Vec<KeyRecord>,
    pub done: usize,
}

impl WorkflowView {
    pub async fn read(
        reader: &HistoryReader,
        wf: &chime_shared::workflow::WorkflowRecord,
    ) -> redis::RedisResult<Self> {
        let mut records = Vec::with_capacity(wf.steps.len());
        for s in &wf.steps {
            records.push(reader.record(&s.key.to_string()).await?);
        }
        let done = records.iter().filter(|r| r.state == Some(KeyState::Done)).count();
        Ok(Self { records, done })
    }

    /// A step's state: its record's, else what it waits for (or what blocks it), else
    /// `pending` (published, not looked at by a worker yet).
    pub fn state(r: &KeyRecord) -> String {
        match (&r.state, &r.waiting) {
            (Some(s), _) => s.to_string(),
            (None, Some(w)) if w.starts_with("blocked") => "blocked".into(),
            (None, Some(_)) => "waiting".into(),
            (None, None) => "pending".into(),
        }
    }
}

/// A workflow: its steps, each with its state, what it waits for and its result.
async fn print_workflow(
    reader: &HistoryReader,
    wf: &chime_shared::workflow::WorkflowRecord,
) -> Result<(), Failure> {
    let view = WorkflowView::read(reader, wf).await.map_err(runtime)?;
    println!("key       {} (a workflow: each step has a key of its own)", wf.key);
    match wf.slot {
        Some(slot) => println!("slot      {} UTC (a scheduled chain)", at(slot)),
        None => println!("enqueued  {} UTC", at(wf.created)),
    }
    let n = wf.steps.len();
    let state = if view.done == n {
        "complete: every step is done".to_string()
    } else {
        format!("{} of {n} steps done", view.done)
    };
    println!("state     {state}");
    let mut t = crate::cli::table::new(["STEP", "JOB", "KEY", "AFTER", "STATE", "RESULT / WAITING FOR"], &[]);
    for (s, r) in wf.steps.iter().zip(&view.records) {
        let state = WorkflowView::state(r);
        let detail = match (&r.state, &r.result, &r.waiting) {
            (Some(KeyState::Done), Some(res), _) => res
                .value()
                .map(|v| cut(&v.to_string(), 60))
                .unwrap_or_else(|| cut(res.missing().unwrap_or(""), 60)),
            (Some(KeyState::Done | KeyState::Dead | KeyState::Cancelled), _, _) => String::new(),
            (_, _, Some(w)) => cut(w, 80),
            _ => String::new(),
        };
        let after = if s.after.is_empty() { "-".to_string() } else { s.after.join(",") };
        t.add_row([s.step.clone(), s.job.clone(), s.key.to_string(), after, state, detail]);
    }
    crate::cli::table::print(&t);
    println!("a step's own runs: chime inspect <its KEY>");
    Ok(())
}

/// A fanned-out run: its members, each with its state (a member without a record has not
/// started: queued, or lost).
async fn print_group(
    reader: &HistoryReader,
    group: &chime_shared::group::GroupRecord,
) -> Result<(), Failure> {
    let view = GroupView::read(reader, group).await.map_err(runtime)?;
    println!("key       {} (a fanned-out run: each member has a key of its own)", group.base);
    println!("job       {} on queue {}", group.job, group.queue);
    if let Some(slot) = group.slot {
        println!("slot      {} UTC", at(slot));
    }
    println!("fan-out   {}", GroupView::fan(group));
    println!("state     {}", view.summary());
    let mut t = crate::cli::table::new(["MEMBER", "KEY", "STATE", "FINISHED (UTC)", "RESULT"], &[]);
    for ((m, s), r) in view.members.iter().zip(&view.states).zip(&view.records) {
        let (state, finished) = match s {
            Some((state, t)) => (state.to_string(), t.map(at).unwrap_or_default()),
            None => ("missing: not started".to_string(), String::new()),
        };
        let result =
            r.result.as_ref().and_then(|r| r.value()).map(|v| cut(&v.to_string(), 60)).unwrap_or_default();
        t.add_row([GroupView::label(m), m.key.to_string(), state, finished, result]);
    }
    crate::cli::table::print(&t);
    let done = chime_shared::envelope::completion_key(group.base);
    let record = reader.record(&done.to_string()).await.map_err(runtime)?;
    if record.state.is_some() || record.waiting.is_some() {
        let state = WorkflowView::state(&record);
        let waiting = record.waiting.as_deref().filter(|_| record.state.is_none());
        println!("on_complete {done}: {state}{}", waiting.map(|w| format!(" ({w})")).unwrap_or_default());
    }
    Ok(())
}

fn print_record(key: &Uuid, r: &KeyRecord) {
    println!("key       {key}");
    if let (Some(w), None | Some(KeyState::Free)) = (&r.waiting, &r.state) {
        println!("step      {} (a workflow step)", escape_control(w));
    }
    let Some(state) = &r.state else {
        println!("record    none: never claimed, or expired after redis.done_retention (or Redis lost it)");
        return print_key_runs(r);
    };
    println!("state     {} — {}", escape_control(state.as_str()), state.meaning());
    if let Some(o) = &r.owner {
        println!("owner     {}", escape_control(o));
    }
    if let Some(f) = r.fence {
        println!("fence     {f}");
    }
    if let Some(t) = r.claimed_at {
        println!("claimed   {} UTC", at(t));
    }
    if let Some(t) = r.finished_at {
        println!("finished  {} UTC", at(t));
    }
    if let Some(t) = r.lease_until {
        println!("lease     until {} UTC", at(t));
    }
    if let Some(ms) = r.expires_in_ms {
        let left = std::time::Duration::from_secs(u64::try_from(ms / 1000).unwrap_or(0));
        println!("expires   in {}", chime_shared::duration::format(left));
    }
    if let Some(reason) = &r.dying_reason {
        println!("dying     reason {}", escape_control(reason));
    }
    if let Some(cp) = &r.checkpoint {
        println!("checkpoint {}", shown(cp));
    }
    match &r.result {
        Some(StoredResult::Value(v)) => println!("result    {}", shown(v)),
        Some(StoredResult::Missing(why)) => println!("result    none kept: {}", escape_control(why)),
        None => {}
    }
    print_key_runs(r);
}

/// A JSON value on one line, control characters escaped, cut at 2 KiB.
fn shown(v: &serde_json::Value) -> String {
    let text = chime_shared::redact::escape_control(&v.to_string()).into_owned();
    match text.char_indices().nth(2048) {
        Some((i, _)) => format!("{}… (cut; --json shows it whole)", &text[..i]),
        None => text,
    }
}

fn print_key_runs(r: &KeyRecord) {
    if r.runs.is_empty() {
        println!("runs      none recorded (history off, or the record expired)");
    } else {
        println!("runs      (oldest first)");
        print_runs(&r.runs);
    }
}
