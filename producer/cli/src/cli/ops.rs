//! `chime tick`, `chime jobs list|next`, `chime status`.

use chime_shared::config::{Config, ValidConfig};
use chime_shared::delay;
use chime_shared::health::Health;
use chime_shared::schedule::Schedule;
use chime_shared::topology::{self, Names};
use chrono::{DateTime, Utc};
use clap::Subcommand;
use std::path::PathBuf;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::failure::{Failure, runtime, usage};
use super::table;
use chime_scheduler::lease::TickerStore;
use chime_scheduler::ticker::{Ticker, scheduled_jobs};
use chime_shared::control::{self, Target};

#[derive(Debug, Subcommand)]
pub enum JobsCommand {
    /// Scheduled jobs with their next run (local time and UTC)
    List {
        #[arg(long)]
        json: bool,
    },
    /// Upcoming slots of a job, UTC RFC 3339, one a line
    Next {
        name: String,
        /// Start after this instant (default: now)
        #[arg(long, value_name = "RFC3339")]
        after: Option<String>,
        /// How many (1 to 10,000)
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..=10_000))]
        count: u16,
        #[arg(long)]
        json: bool,
    },
}

fn schedule_of(config: &Config, name: &str) -> Result<Schedule, Failure> {
    let job = config
        .job(name)
        .ok_or_else(|| usage(anyhow::anyhow!("unknown job {name:?} (not in the config's [[jobs]])")))?;
    config
        .schedule_of(job)
        .map_err(|e| usage(anyhow::anyhow!("{e}")))?
        .ok_or_else(|| usage(anyhow::anyhow!("job {name} has no schedule (it runs ad hoc only)")))
}

pub fn jobs(config: &Config, cmd: JobsCommand) -> Result<(), Failure> {
    match cmd {
        JobsCommand::List { json } => {
            let now = Utc::now();
            let mut rows = Vec::new();
            for job in config.jobs.iter().filter(|j| j.schedule.is_some()) {
                let s = schedule_of(config, &job.name)?;
                let next = s.next_after(now);
                rows.push(serde_json::json!({
                    "name": job.name,
                    "schedule": s.expr(),
                    "timezone": s.zone().name(),
                    "queue": job.queue(),
                    "next_local": next.map(|n| n.with_timezone(&s.zone()).to_rfc3339()),
                    "next_utc": next.map(|n| n.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
                }));
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&rows).unwrap_or_default());
                return Ok(());
            }
            let mut t = table::new(["NAME", "SCHEDULE", "ZONE", "QUEUE", "NEXT (LOCAL)", "NEXT (UTC)"], &[]);
            for r in rows {
                let s = |k: &str| r[k].as_str().unwrap_or("-").to_string();
                t.add_row([
                    s("name"),
                    s("schedule"),
                    s("timezone"),
                    s("queue"),
                    s("next_local"),
                    s("next_utc"),
                ]);
            }
            table::print(&t);
            Ok(())
        }
        JobsCommand::Next { name, after, count, json } => {
            let s = schedule_of(config, &name)?;
            let after = match after {
                Some(a) => DateTime::parse_from_rfc3339(&a)
                    .map_err(|e| usage(anyhow::anyhow!("--after: {e} (expected RFC 3339)")))?
                    .with_timezone(&Utc),
                None => Utc::now(),
            };
            let runs = s.upcoming(after, usize::from(count));
            if json {
                let slots: Vec<String> = runs.iter().map(|t| rfc3339(*t)).collect();
                println!("{}", serde_json::to_string(&slots).unwrap_or_default());
            } else {
                for line in explained(&s, after, &runs) {
                    println!("{line}");
                }
                // Fewer than asked (none, past year 9999): said, not left to an empty output.
                if runs.len() < usize::from(count) {
                    eprintln!(
                        "chime: note: {} slot(s) of {name} after {}: there are no more that chime can compute",
                        runs.len(),
                        rfc3339(after)
                    );
                }
            }
            Ok(())
        }
    }
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// One line per run; on a business calendar each says why it is where it is (the slots it
/// runs for, rolled from days off; its business day of the month), and the slots the calendar
/// skips between them get a line of their own.
fn explained(s: &Schedule, after: DateTime<Utc>, runs: &[DateTime<Utc>]) -> Vec<String> {
    use chime_shared::calendar::OnHoliday;
    use chime_shared::schedule::{Closed, Rule};
    let Some(b) = s.business() else { return runs.iter().map(|t| rfc3339(*t)).collect() };
    let local = |l: &chrono::NaiveDateTime| l.format("%a %Y-%m-%d %H:%M").to_string();
    let why = |c: Closed| match c {
        Closed::Holiday => "holiday",
        Closed::NotWorkingDay => "day off",
    };
    let mut lines: Vec<(DateTime<Utc>, String)> = Vec::new();
    for run in runs {
        let text = match b.rule {
            Rule::OnHoliday(policy) => {
                let from = s.origins(*run);
                if from.is_empty() {
                    rfc3339(*run)
                } else {
                    let which = if policy == OnHoliday::NextBusinessDay { "next" } else { "previous" };
                    let list: Vec<String> =
                        from.iter().map(|m| format!("{} ({})", local(&m.from), why(m.closed))).collect();
                    format!(
                        "{}  {which} business day for {} [calendar {}]",
                        rfc3339(*run),
                        list.join(", "),
                        b.name
                    )
                }
            }
            Rule::BusinessDay(n) => {
                let ordinal = match n {
                    -1 => "last".to_string(),
                    n if n < 0 => format!("{} last", ordinal(n.unsigned_abs())),
                    n => ordinal(n.unsigned_abs()),
                };
                let month = run.with_timezone(&s.zone()).format("%B %Y");
                format!("{}  {ordinal} business day of {month} [calendar {}]", rfc3339(*run), b.name)
            }
        };
        lines.push((*run, text));
    }
    if let Some(last) = runs.last() {
        // One line a day: the first skipped slot's instant (its key is for it), and how many.
        let mut days: Vec<(chime_shared::schedule::Moved, usize)> = Vec::new();
        for m in s.moved_between(after, *last, 1_000_000).into_iter().filter(|m| m.to.is_none()) {
            match days.last_mut() {
                Some((first, n)) if first.from.date() == m.from.date() => *n += 1,
                _ => days.push((m, 1)),
            }
        }
        for (m, n) in days {
            let Some(at) = m.at else { continue };
            let day = m.from.format("%a %Y-%m-%d");
            let what = if n == 1 { "skipped".to_string() } else { format!("{n} slots skipped") };
            lines.push((
                at,
                format!("{}  {what}: {day} is a {} [calendar {}]", rfc3339(at), why(m.closed), b.name),
            ));
        }
    }
    lines.sort_by_key(|(t, _)| *t);
    lines.into_iter().map(|(_, l)| l).collect()
}

fn ordinal(n: u32) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// `chime tick`: the ticker daemon. SIGHUP, or a change of the config file, reloads the
/// schedules; SIGTERM/SIGINT gives the lease up and exits.
pub async fn tick(config: ValidConfig, path: PathBuf, listen: Option<String>) -> Result<(), Failure> {
    scheduled_jobs(&config).map_err(|e| usage(anyhow::anyhow!("{e}")))?;
    let listen = listen.or_else(|| config.ticker.listen.clone());
    let health = Health::new(&["redis"]);
    let token = CancellationToken::new();
    if let Some(addr) = listen {
        chime_shared::config::check_listen(&addr).map_err(|e| usage(anyhow::anyhow!("--listen {e}")))?;
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| usage(anyhow::anyhow!("cannot listen on {addr}: {e}")))?;
        let recorder = chime_daemon::telemetry::install_recorder().ok();
        info!(%addr, "serving /metrics, /livez, /readyz");
        tokio::spawn(chime_daemon::server::serve(listener, health.clone(), recorder, token.clone()));
    }
    // Jobs producers on this machine spooled while the broker was away (`[producer] spool_dir`).
    tokio::spawn(chime_producer::flush_at_start(config.clone()));
    let (tx, rx) = watch::channel(config);
    let id = format!(
        "{}:{}",
        chime_shared::names::process_name(),
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    );
    let ticker = Ticker::new(rx.clone(), id, health).map_err(runtime)?;
    // The DLQ monitor runs on the leader only, so one replica sends the alerts.
    let monitor = tokio::spawn(chime_scheduler::monitor::run_while(ticker.leadership(), rx, token.clone()));
    tokio::spawn(reloads(path, tx, token.clone()));
    ticker.run(token).await;
    let _ = monitor.await;
    Ok(())
}

/// Signals and config-file changes: reload on SIGHUP or a changed file, stop on SIGTERM/SIGINT.
async fn reloads(path: PathBuf, tx: watch::Sender<ValidConfig>, token: CancellationToken) {
    // The config file, and the calendars' .ics files the running config reads.
    let watched = {
        let (path, rx) = (path.clone(), tx.subscribe());
        move || {
            let mut files = vec![path.clone()];
            files.extend(rx.borrow().calendars.iter().filter_map(|c| c.ics.clone()));
            files
        }
    };
    let reload = || match Config::load(Some(&path)).and_then(|c| {
        scheduled_jobs(&c)?;
        Ok(c)
    }) {
        Ok(c) => {
            info!(path = %path.display(), "config reloaded");
            tx.send_replace(c);
        }
        Err(e) => warn!(error = %e, "config reload rejected; keeping the running config"),
    };
    if let Err(e) = chime_daemon::signals::until_stopped_watching(watched, reload).await {
        warn!(error = %e, "cannot install signal handlers");
        return;
    }
    info!("shutdown requested");
    token.cancel();
}

#[derive(serde::Serialize)]
struct QueueRow {
    queue: String,
    /// Ready in all its levels.
    ready: u32,
    /// Ready in each level (high, normal, low), when it has levels.
    #[serde(skip_serializing_if = "Option::is_none")]
    levels: Option<[u32; 3]>,
    consumers: u32,
    dlq: u32,
    paused: Option<chime_shared::control::PauseFlag>,
}

#[derive(serde::Serialize)]
struct JobRow {
    job: String,
    last_published: Option<String>,
    next_due: Option<String>,
    paused: Option<chime_shared::control::PauseFlag>,
}

/// `chime status`: depths, consumers, the leader and per-job slots.
pub async fn status(config: ValidConfig, json: bool) -> Result<(), Failure> {
    let conn = chime_shared::amqp::connect(&config.amqp, "chime-status").await.map_err(runtime)?;
    let names = Names::new(&config.prefix);
    let mut queues = Vec::new();
    for q in config.all_queues() {
        let (ready, consumers) = topology::depth(&conn, &names.work_queue(&q)).await.unwrap_or((0, 0));
        let routes = config.routes(&q);
        let levels = if routes.len() > 1 {
            let mut by = [0u32; 3];
            for (i, (route, _)) in routes.iter().enumerate() {
                by[i] = topology::depth(&conn, &names.work_queue(route)).await.map(|d| d.0).unwrap_or(0);
            }
            Some(by)
        } else {
            None
        };
        let ready = levels.map_or(ready, |l| l.iter().sum());
        let dlq = topology::depth(&conn, &names.dlq(&q)).await.map(|d| d.0).unwrap_or(0);
        queues.push(QueueRow { queue: q, ready, levels, consumers, dlq, paused: None });
    }
    let mut delayed = 0u64;
    for level in 0..delay::LEVELS {
        let q = chime_shared::names::delay_level(config.amqp.queue_type, level);
        delayed += u64::from(topology::depth(&conn, &q).await.map(|d| d.0).unwrap_or(0));
    }
    let _ = conn.close(200, "status".into()).await;
    let store = TickerStore::connect(&config.redis, &config.prefix).map_err(runtime)?;
    let leader = store.leader().await.map_err(runtime)?;
    let marks = store.watermarks().await.map_err(runtime)?;
    let now = Utc::now();
    let jobs: Vec<JobRow> = scheduled_jobs(&config)
        .map_err(|e| usage(anyhow::anyhow!("{e}")))?
        .into_iter()
        .map(|j| {
            let last = marks.get(&j.name).and_then(|s| DateTime::from_timestamp(*s, 0));
            JobRow {
                paused: None,
                last_published: last.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
                next_due: j
                    .schedule
                    .next_after(now)
                    .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
                job: j.name,
            }
        })
        .collect();
    let mut jobs = jobs;
    let mut redis = super::history::reader(&config).await?.connection();
    let queue_names: Vec<String> = queues.iter().map(|q| q.queue.clone()).collect();
    let flags = control::flags(&mut redis, &names, Target::Queue, &queue_names).await.map_err(runtime)?;
    for (q, f) in queues.iter_mut().zip(flags) {
        q.paused = f;
    }
    let job_names: Vec<String> = jobs.iter().map(|j| j.job.clone()).collect();
    let flags = control::flags(&mut redis, &names, Target::Schedule, &job_names).await.map_err(runtime)?;
    for (j, f) in jobs.iter_mut().zip(flags) {
        j.paused = f;
    }
    let workers = control::workers(&mut redis, &names).await.map_err(runtime)?;
    if json {
        let v = serde_json::json!({"leader": leader, "queues": queues, "delayed": delayed, "jobs": jobs, "workers": workers});
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    match &leader {
        Some(l) => println!(
            "leader: {} (lease held {:.1}s, expires in {:.1}s)",
            chime_shared::redact::escape_control(&l.id),
            l.lease_age_ms as f64 / 1000.0,
            l.expires_in_ms as f64 / 1000.0
        ),
        None => println!("leader: none (no ticker holds the lease)"),
    }
    println!();
    let paused = |f: &Option<chime_shared::control::PauseFlag>| {
        f.as_ref().map(|f| format!("paused by {}", f.by)).unwrap_or_default()
    };
    let mut t = table::new(["QUEUE", "READY", "CONSUMERS", "DLQ", ""], &["READY", "CONSUMERS", "DLQ"]);
    for q in &queues {
        t.add_row([
            q.queue.clone(),
            match q.levels {
                Some([h, n, l]) => format!("{} (high {h}, normal {n}, low {l})", q.ready),
                None => q.ready.to_string(),
            },
            q.consumers.to_string(),
            q.dlq.to_string(),
            paused(&q.paused),
        ]);
    }
    table::print(&t);
    println!("delayed (retries and --delay, every prefix on this virtual host): {delayed}");
    if !jobs.is_empty() {
        println!();
        let mut t = table::new(["JOB", "LAST PUBLISHED (UTC)", "NEXT DUE (UTC)", ""], &[]);
        for j in &jobs {
            let or_dash = |v: &Option<String>| v.as_deref().unwrap_or("-").to_string();
            t.add_row([j.job.clone(), or_dash(&j.last_published), or_dash(&j.next_due), paused(&j.paused)]);
        }
        table::print(&t);
    }
    println!();
    super::steer::print_workers(&workers);
    Ok(())
}
