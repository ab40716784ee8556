//! `chime backfill JOB --from T1 --to T2 [--dry-run]`: a scheduled job's past slots, published
//! again with their deterministic keys (a slot already done is absorbed by the workers as a
//! duplicate), paced, with a progress bar on a terminal and a summary.

use chime_producer::{EnqueueClient, Prepared};
use chime_shared::config::ValidConfig;
use chime_shared::config::{JobConfig, Overlap};
use chime_shared::envelope::{self, Envelope, Source};
use chime_shared::history::HistoryReader;
use chime_shared::record::KeyState;
use chime_shared::schedule::Schedule;
use chime_shared::topology::Names;
use chrono::{DateTime, LocalResult, NaiveDate, NaiveDateTime, SecondsFormat, TimeZone, Utc};
use chrono_tz::Tz;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use super::failure::{Failure, from_enqueue, runtime, usage};
use super::table;

/// Most slots one backfill publishes unless `--max` says otherwise.
const DEFAULT_MAX: usize = 1000;

#[derive(Debug, clap::Args)]
pub struct BackfillArgs {
    /// A scheduled job of the config
    pub job: String,
    /// First instant of the range, inclusive: RFC 3339, a local time in the job's time zone
    /// (`2026-03-29T01:30`, `2026-03-29`), or `now`
    #[arg(long, value_name = "TIME")]
    pub from: String,
    /// Last instant of the range, inclusive (not in the future: those slots are the ticker's)
    #[arg(long, value_name = "TIME")]
    pub to: String,
    /// List the slots and what each has done; publish nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Slots published per second at most
    #[arg(long, value_name = "N", default_value_t = 50.0)]
    pub rate: f64,
    /// Refuse a range of more slots than this (a mistyped year is not a million runs)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX)]
    pub max: usize,
    #[arg(long)]
    pub json: bool,
}

/// What a slot's key has done so far.
#[derive(Debug, Clone, PartialEq, Eq)]
enum SlotState {
    /// No record: never ran (missed, paused, skipped by the overlap policy, or expired from
    /// Redis after `redis.done_retention`).
    None,
    /// Done (every member, for a fanned-out run).
    Done,
    /// Dead: republishing does not run it again (`chime dlq replay` does).
    Dead,
    /// Running, or waiting for a retry.
    InProgress(String),
    /// A fanned-out run with some members done.
    Partial { done: usize, of: usize },
}

impl SlotState {
    fn label(&self) -> String {
        match self {
            SlotState::None => "-".into(),
            SlotState::Done => "done".into(),
            SlotState::Dead => "dead".into(),
            SlotState::InProgress(s) => s.clone(),
            SlotState::Partial { done, of } => format!("{done}/{of} done"),
        }
    }
}

pub async fn run(config: ValidConfig, args: BackfillArgs) -> Result<(), Failure> {
    let job = config
        .job(&args.job)
        .ok_or_else(|| usage(anyhow::anyhow!("unknown job {:?} (not in the config's [[jobs]])", args.job)))?
        .clone();
    let schedule = config
        .schedule_of(&job)
        .map_err(|e| usage(anyhow::anyhow!("{e}")))?
        .ok_or_else(|| {
            usage(anyhow::anyhow!(
                "job {} has no schedule: backfill publishes a schedule's past slots (use `chime enqueue` for ad-hoc runs)",
                job.name
            ))
        })?;
    if !(args.rate.is_finite() && args.rate > 0.0) {
        return Err(usage(anyhow::anyhow!(
            "--rate {}: must be a positive number of slots per second",
            args.rate
        )));
    }
    // The range's form is checked before connecting; "now" and the future are Redis `TIME`'s:
    // a host whose clock is ahead would publish slots that are not due yet (they would run
    // early, and the ticker's own copies be absorbed as duplicates).
    parse_time("--from", &args.from, schedule.zone(), Utc::now())?;
    parse_time("--to", &args.to, schedule.zone(), Utc::now())?;
    let names = Names::new(&config.prefix);
    let reader = HistoryReader::connect(&config.redis, names.clone()).await.map_err(runtime)?;
    let now = reader.now().await.map_err(runtime)?;
    let from = parse_time("--from", &args.from, schedule.zone(), now)?;
    let to = parse_time("--to", &args.to, schedule.zone(), now)?;
    if from > to {
        return Err(usage(anyhow::anyhow!("--from {} is after --to {}", utc(from), utc(to))));
    }
    if to > now {
        return Err(usage(anyhow::anyhow!(
            "--to {} is in the future: the ticker publishes those slots when they are due",
            utc(to)
        )));
    }
    let slots = schedule.slots_between(from - chrono::Duration::seconds(1), to, args.max.saturating_add(1));
    if slots.len() > args.max {
        return Err(usage(anyhow::anyhow!(
            "more than {} slots of {} between {} and {}: narrow the range or raise --max",
            args.max,
            job.name,
            utc(from),
            utc(to)
        )));
    }
    let states = slot_states(&reader, &names, &job, &slots).await.map_err(runtime)?;
    if args.dry_run {
        print_plan(&job, &schedule, &slots, &states, args.json);
        return Ok(());
    }
    if slots.is_empty() {
        println!("backfill {}: no slot between {} and {}", job.name, utc(from), utc(to));
        return Ok(());
    }
    if job.overlap != Overlap::Allow {
        eprintln!(
            "chime: note: job {} has overlap = \"{}\"; a backfill publishes every slot in the range regardless (pace it with --rate)",
            job.name,
            job.overlap.as_str()
        );
    }
    let client = EnqueueClient::connect(config.clone()).await.map_err(from_enqueue)?;
    let progress = Progress::new(slots.len());
    let started = Instant::now();
    let mut published = 0usize;
    let mut failure = None;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let chain = chime_shared::workflow::chain_of(&config.jobs, &job.name);
    for slot in &slots {
        tick.tick().await;
        match client.enqueue_prepared(&prepared(&job, *slot, &chain)).await {
            Ok(_) => published += 1,
            Err(e) => {
                failure = Some((*slot, e));
                break;
            }
        }
        progress.show(published, *slot);
    }
    progress.finish();
    drop(client);
    let elapsed = started.elapsed().as_secs_f64();
    let count = |f: fn(&SlotState) -> bool| states.iter().take(published).filter(|s| f(s)).count();
    let done = count(|s| *s == SlotState::Done);
    let dead = count(|s| *s == SlotState::Dead);
    let busy = count(|s| matches!(s, SlotState::InProgress(_) | SlotState::Partial { .. }));
    let summary = serde_json::json!({
        "job": job.name,
        "from": utc(from),
        "to": utc(to),
        "slots": slots.len(),
        "published": published,
        "already_done": done,
        "dead": dead,
        "in_progress": busy,
        "seconds": (elapsed * 1000.0).round() / 1000.0,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary).unwrap_or_default());
    } else {
        let n = |k: usize, one: &str, many: &str| format!("{k} {}", if k == 1 { one } else { many });
        println!(
            "backfill {}: published {published} of {} from {} to {} in {elapsed:.1} s",
            job.name,
            n(slots.len(), "slot", "slots"),
            utc(from),
            utc(to)
        );
        let fresh = published - done - dead - busy;
        println!("  {} no record and will run", n(fresh, "had", "had"));
        if done > 0 {
            println!("  {} already done: absorbed by the workers as duplicates", n(done, "was", "were"));
        }
        if dead > 0 {
            println!(
                "  {} dead: dead keys stay dead (`chime dlq replay` runs a dead letter again)",
                n(dead, "is", "are")
            );
        }
        if busy > 0 {
            println!(
                "  {} in progress or partly done: only what has not finished runs",
                n(busy, "is", "are")
            );
        }
    }
    if let Some((slot, e)) = failure {
        let failed = from_enqueue(e);
        return Err(Failure {
            code: failed.code,
            error: failed.error.context(format!(
                "slot {} not published; the {} slots before it are (run the backfill again from --from {}: published slots are absorbed)",
                utc(slot),
                published,
                utc(slot)
            )),
        });
    }
    Ok(())
}

/// The message of `slot`: the ticker's envelope for it (a step of its chain, when the job is
/// in one: backfill the chain's jobs over the same range), marked as a backfill.
fn prepared(job: &JobConfig, slot: DateTime<Utc>, chain: &[chime_shared::workflow::StepRecord]) -> Prepared {
    let mut env = Envelope::new(
        &job.name,
        job.queue(),
        envelope::scheduled_key(&job.name, slot),
        job.payload.clone().unwrap_or(serde_json::Value::Null),
        Some(slot),
        job.max_attempts(),
        Source::Schedule,
    );
    env.priority = job.priority.filter(|p| *p != chime_shared::config::Priority::Normal);
    env.backfill = true;
    if !chain.is_empty() {
        env.step = chime_shared::workflow::scheduled_chain(chain, slot).step_of(&job.name);
    }
    Prepared { envelope: env, delay: Duration::ZERO, unverified_queue: None, declare_queue: None }
}

/// What each slot's key (or, for a fanned-out job, each member's) has done.
async fn slot_states(
    reader: &HistoryReader,
    names: &Names,
    job: &JobConfig,
    slots: &[DateTime<Utc>],
) -> redis::RedisResult<Vec<SlotState>> {
    let bases: Vec<uuid::Uuid> = slots.iter().map(|s| envelope::scheduled_key(&job.name, *s)).collect();
    let of = |s: Option<(KeyState, Option<DateTime<Utc>>)>| match s {
        None => SlotState::None,
        Some((KeyState::Done, _)) => SlotState::Done,
        Some((KeyState::Dead, _)) => SlotState::Dead,
        Some((s, _)) => SlotState::InProgress(s.as_str().to_string()),
    };
    if job.shards.is_none() && !job.broadcast {
        let keys: Vec<String> = bases.iter().map(|k| k.to_string()).collect();
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(1000) {
            out.extend(reader.states(chunk).await?.into_iter().map(of));
        }
        return Ok(out);
    }
    let mut conn = reader.connection();
    let mut out = Vec::with_capacity(bases.len());
    for base in bases {
        let Some(group) = chime_shared::group::read(&mut conn, names, base).await? else {
            out.push(SlotState::None);
            continue;
        };
        let keys: Vec<String> = group.fan.members(base).iter().map(|m| m.key.to_string()).collect();
        let states: Vec<SlotState> = reader.states(&keys).await?.into_iter().map(of).collect();
        let done = states.iter().filter(|s| **s == SlotState::Done).count();
        out.push(if done == keys.len() {
            SlotState::Done
        } else if states.iter().all(|s| *s == SlotState::None) {
            SlotState::None
        } else {
            SlotState::Partial { done, of: keys.len() }
        });
    }
    Ok(out)
}

fn print_plan(
    job: &JobConfig,
    schedule: &Schedule,
    slots: &[DateTime<Utc>],
    states: &[SlotState],
    json: bool,
) {
    if json {
        let rows: Vec<serde_json::Value> = slots
            .iter()
            .zip(states)
            .map(|(s, st)| {
                serde_json::json!({
                    "slot": utc(*s),
                    "local": s.with_timezone(&schedule.zone()).to_rfc3339(),
                    "key": envelope::scheduled_key(&job.name, *s),
                    "state": st.label(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows).unwrap_or_default());
        return;
    }
    let mut t = table::new(["SLOT (UTC)", "SLOT (LOCAL)", "KEY", "STATE"], &[]);
    for (s, st) in slots.iter().zip(states) {
        t.add_row([
            utc(*s),
            s.with_timezone(&schedule.zone()).format("%Y-%m-%d %H:%M:%S %Z").to_string(),
            envelope::scheduled_key(&job.name, *s).to_string(),
            st.label(),
        ]);
    }
    if !slots.is_empty() {
        table::print(&t);
    }
    let done = states.iter().filter(|s| **s == SlotState::Done).count();
    println!(
        "{} slot(s) of {} ({} in {}); {done} already done. Nothing published (--dry-run).",
        slots.len(),
        job.name,
        schedule.expr(),
        schedule.zone().name()
    );
}

/// `now`, RFC 3339, or a local date-time (or date) in the job's zone. A local time the zone
/// skips, or has twice, is an error that says so.
fn parse_time(flag: &str, s: &str, zone: Tz, now: DateTime<Utc>) -> Result<DateTime<Utc>, Failure> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("now") {
        return Ok(now);
    }
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let naive = ["%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M"]
        .iter()
        .find_map(|f| NaiveDateTime::parse_from_str(s, f).ok())
        .or_else(|| NaiveDate::parse_from_str(s, "%Y-%m-%d").ok().and_then(|d| d.and_hms_opt(0, 0, 0)));
    let Some(naive) = naive else {
        return Err(usage(anyhow::anyhow!(
            "{flag} {s:?}: not a time (RFC 3339 such as 2026-03-29T01:30:00Z, a local time in {} such as 2026-03-29T01:30, or `now`)",
            zone.name()
        )));
    };
    match zone.from_local_datetime(&naive) {
        LocalResult::Single(t) => Ok(t.with_timezone(&Utc)),
        LocalResult::Ambiguous(a, b) => Err(usage(anyhow::anyhow!(
            "{flag} {s:?}: {} has that local time twice ({} and {}): give the offset",
            zone.name(),
            a.to_rfc3339(),
            b.to_rfc3339()
        ))),
        LocalResult::None => Err(usage(anyhow::anyhow!(
            "{flag} {s:?}: {} skips that local time (a daylight-saving change): give an RFC 3339 time",
            zone.name()
        ))),
    }
}

fn utc(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// A one-line progress bar on stderr, drawn only when stderr is a terminal.
struct Progress {
    total: usize,
    tty: bool,
    last: std::cell::Cell<Option<Instant>>,
}

impl Progress {
    fn new(total: usize) -> Self {
        Self { total, tty: std::io::stderr().is_terminal(), last: std::cell::Cell::new(None) }
    }

    fn show(&self, done: usize, slot: DateTime<Utc>) {
        if !self.tty {
            return;
        }
        let now = Instant::now();
        if done < self.total && self.last.get().is_some_and(|l| now - l < Duration::from_millis(100)) {
            return;
        }
        self.last.set(Some(now));
        let width = 30;
        let filled = done * width / self.total.max(1);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r[{}{}] {done}/{} slots, at {}",
            "#".repeat(filled),
            " ".repeat(width - filled),
            self.total,
            utc(slot)
        );
        let _ = err.flush();
    }

    fn finish(&self) {
        if self.tty && self.last.get().is_some() {
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn times_are_rfc3339_local_in_the_jobs_zone_or_now() {
        let berlin: Tz = "Europe/Berlin".parse().unwrap();
        let now = at("2026-12-02T10:00:00Z");
        assert_eq!(parse_time("--from", "now", berlin, now).unwrap(), now);
        assert_eq!(
            parse_time("--from", "2026-03-29T00:30:00Z", berlin, now).unwrap(),
            at("2026-03-29T00:30:00Z")
        );
        assert_eq!(
            parse_time("--from", "2026-03-29T01:30", berlin, now).unwrap(),
            at("2026-03-29T00:30:00Z")
        );
        assert_eq!(parse_time("--from", "2026-07-01", berlin, now).unwrap(), at("2026-06-30T22:00:00Z"));
        let skipped = parse_time("--from", "2026-03-29T02:30", berlin, now).unwrap_err().error.to_string();
        assert!(skipped.contains("skips that local time"), "{skipped}");
        let twice = parse_time("--to", "2026-10-25 02:30", berlin, now).unwrap_err().error.to_string();
        assert!(twice.contains("twice") && twice.contains("+02:00") && twice.contains("+01:00"), "{twice}");
        let bad = parse_time("--to", "yesterday", berlin, now).unwrap_err().error.to_string();
        assert!(bad.starts_with("--to \"yesterday\": not a time"), "{bad}");
    }
}
