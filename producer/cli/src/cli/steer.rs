//! `chime pause|resume (queue Q | schedule J)`, `chime run JOB` and `chime workers`.

use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_shared::config::ValidConfig;
use chime_shared::config::{CatchUp, Config};
use chime_shared::control::{self, PauseFlag, Target, WorkerBeat};
use chime_shared::envelope::{self, Envelope, Source};
use chime_shared::topology::Names;
use chrono::{DateTime, Utc};
use clap::Subcommand;

use super::failure::{Failure, from_enqueue, runtime, usage};
use super::table;
use chime_scheduler::ticker::scheduled_jobs;

#[derive(Debug, Subcommand)]
pub enum PauseTarget {
    /// Workers stop consuming the queue within about a second (running jobs finish)
    Queue {
        /// Logical queue name
        name: String,
    },
    /// The ticker skips the job's slots (counted in chime_slots_paused_total)
    Schedule {
        /// Job name
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum ResumeTarget {
    /// Workers consume the queue again
    Queue {
        /// Logical queue name
        name: String,
    },
    /// The ticker publishes the job's slots again, from the next one on
    Schedule {
        /// Job name
        name: String,
        /// Also publish the slots skipped while paused (within the job's catch-up window and
        /// by its catch-up policy)
        #[arg(long)]
        catch_up: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum CircuitCommand {
    /// Hold it open: runs through it are parked (or dead-lettered) until `chime circuit close`
    Open {
        /// The circuit's name (a [[circuits]] entry, or a job with a circuit of its own)
        name: String,
    },
    /// Close it now (its window of failures forgotten): runs go through again
    Close {
        /// The circuit's name
        name: String,
    },
}

async fn redis(config: &Config) -> Result<chime_shared::redis_conn::RedisConn, Failure> {
    Ok(super::history::reader(config).await?.connection())
}

fn check_queue(config: &Config, name: &str) -> Result<(), Failure> {
    if config.declares_queue(name) {
        Ok(())
    } else {
        Err(usage(anyhow::anyhow!(
            "queue {name:?} is not a queue of this config (queues: {})",
            config.all_queues().join(", ")
        )))
    }
}

fn check_schedule(config: &Config, name: &str) -> Result<(), Failure> {
    match config.job(name) {
        Some(j) if j.schedule.is_some() => Ok(()),
        Some(_) => Err(usage(anyhow::anyhow!("job {name:?} has no schedule (it runs ad hoc only)"))),
        None => Err(usage(anyhow::anyhow!("unknown job {name:?} (not in the config's [[jobs]])"))),
    }
}

fn since(flag: &PauseFlag) -> String {
    format!(
        "since {} by {}",
        flag.at.format("%Y-%m-%d %H:%M:%S UTC"),
        chime_shared::redact::escape_control(&flag.by)
    )
}

pub async fn pause(config: ValidConfig, target: PauseTarget, by: &str) -> Result<(), Failure> {
    let (kind, name) = match &target {
        PauseTarget::Queue { name } => {
            check_queue(&config, name)?;
            (Target::Queue, name)
        }
        PauseTarget::Schedule { name } => {
            check_schedule(&config, name)?;
            (Target::Schedule, name)
        }
    };
    let names = Names::new(&config.prefix);
    let mut conn = redis(&config).await?;
    let earlier = control::pause(&mut conn, &names, kind, name, by).await.map_err(runtime)?;
    let what = if kind == Target::Queue { "queue" } else { "schedule" };
    match earlier {
        Some(flag) => println!("{what} {name} was already paused ({})", since(&flag)),
        None if kind == Target::Queue => {
            println!(
                "paused queue {name}: workers stop consuming it within about a second; running jobs finish"
            )
        }
        None => println!(
            "paused schedule {name}: the ticker skips its slots until `chime resume schedule {name}`"
        ),
    }
    Ok(())
}

pub async fn resume(config: ValidConfig, target: ResumeTarget) -> Result<(), Failure> {
    let names = Names::new(&config.prefix);
    match target {
        ResumeTarget::Queue { name } => {
            check_queue(&config, &name)?;
            let mut conn = redis(&config).await?;
            match control::resume(&mut conn, &names, Target::Queue, &name).await.map_err(runtime)? {
                Some(flag) => println!(
                    "resumed queue {name} (paused {}): workers consume it again within about a second",
                    since(&flag)
                ),
                None => println!("queue {name} was not paused"),
            }
        }
        ResumeTarget::Schedule { name, catch_up } => {
            check_schedule(&config, &name)?;
            let mut conn = redis(&config).await?;
            let flag = control::resume(&mut conn, &names, Target::Schedule, &name).await.map_err(runtime)?;
            let Some(flag) = flag else {
                println!("schedule {name} was not paused");
                return Ok(());
            };
            println!("resumed schedule {name} (paused {})", since(&flag));
            if catch_up {
                // Up to now by Redis, as the flag was stamped: a clock ahead would publish
                // slots that are not due yet (and they would run early).
                let now = chime_shared::redis_conn::redis_now(&mut conn).await.map_err(runtime)?;
                let n = catch_up_paused(config, &name, flag.at, now).await?;
                println!("published {n} slot(s) skipped while paused");
            }
        }
    }
    Ok(())
}

/// Publishes the slots of `job` in `(from, until]` that its catch-up policy and window allow,
/// under their scheduled keys (a slot that did run is absorbed as a duplicate).
async fn catch_up_paused(
    config: ValidConfig,
    job: &str,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
) -> Result<usize, Failure> {
    let jobs = scheduled_jobs(&config).map_err(|e| usage(anyhow::anyhow!("{e}")))?;
    let Some(j) = jobs.iter().find(|j| j.name == job) else { return Ok(0) };
    let window = chrono::Duration::from_std(j.window).unwrap_or(chrono::Duration::hours(1));
    let from = from.max(until - window);
    let mut slots = j.schedule.slots_between(from, until, 100_000);
    match j.catch_up {
        CatchUp::All => {}
        CatchUp::Latest => slots = slots.split_off(slots.len().saturating_sub(1)),
        CatchUp::None => {
            println!("job {job} has catch_up = \"none\": nothing to publish");
            return Ok(0);
        }
    }
    let client = EnqueueClient::connect(config.clone()).await.map_err(from_enqueue)?;
    for slot in &slots {
        let env = Envelope::new(
            &j.name,
            &j.queue,
            envelope::scheduled_key(&j.name, *slot),
            j.payload.clone(),
            Some(*slot),
            j.max_attempts,
            Source::Schedule,
        );
        client.publish(&env, std::time::Duration::ZERO).await.map_err(from_enqueue)?;
    }
    Ok(slots.len())
}

/// `chime run JOB`: the job now, ad hoc, with its configured payload and a key of its own.
pub async fn run_now(config: ValidConfig, job: String, json: bool) -> Result<(), Failure> {
    if config.job(&job).is_none() {
        return Err(usage(anyhow::anyhow!("unknown job {job:?} (not in the config's [[jobs]])")));
    }
    let client = EnqueueClient::connect(config).await.map_err(from_enqueue)?;
    let done = client.enqueue(EnqueueRequest::new(&job)).await.map_err(from_enqueue)?;
    if json {
        println!(
            "{}",
            serde_json::json!({"confirmed": true, "id": done.id, "key": done.key, "job": done.job, "queue": done.queue})
        );
    } else {
        println!("triggered {} now on queue {} (key {}), confirmed", done.job, done.queue, done.key);
    }
    Ok(())
}

/// The live workers, oldest heartbeat first.
pub async fn list_workers(config: &Config) -> Result<Vec<WorkerBeat>, Failure> {
    let mut conn = redis(config).await?;
    control::workers(&mut conn, &Names::new(&config.prefix)).await.map_err(runtime)
}

/// Workers as a table.
pub fn print_workers(workers: &[WorkerBeat]) {
    if workers.is_empty() {
        println!(
            "no live workers (none has written a heartbeat in the last {}s)",
            control::BEAT_TTL.as_secs()
        );
        return;
    }
    let now = Utc::now();
    let mut t = table::new(
        ["WORKER", "VERSION", "QUEUES", "PAUSED", "CONC", "RUNNING", "DONE", "UP", "SEEN"],
        &["CONC", "RUNNING", "DONE"],
    );
    for w in workers {
        let up = (now - w.started_at).to_std().unwrap_or_default();
        let seen = (now - w.seen_at).num_seconds().max(0);
        t.add_row([
            w.id.clone(),
            w.version.clone(),
            w.queues.join(","),
            if w.paused.is_empty() { "-".into() } else { w.paused.join(",") },
            w.concurrency.to_string(),
            w.running.len().to_string(),
            w.settled[0].to_string(),
            chime_shared::duration::format(std::time::Duration::from_secs(up.as_secs())),
            format!("{seen}s ago"),
        ]);
    }
    table::print(&t);
    let running: Vec<_> = workers.iter().flat_map(|w| w.running.iter().map(move |r| (w, r))).collect();
    if !running.is_empty() {
        println!();
        // As of each worker's last heartbeat (written every few seconds): a job that started
        // then has run at least this long; one that has ended since may still be listed.
        let mut t = table::new(
            ["RUNNING JOB", "KEY", "QUEUE", "ATT", "RUNNING AT BEAT", "WORKER"],
            &["ATT", "RUNNING AT BEAT"],
        );
        for (w, r) in running {
            let secs = (w.seen_at - r.started_at).num_milliseconds().max(0) as f64 / 1000.0;
            t.add_row([
                r.job.clone(),
                r.key.clone(),
                r.queue.clone(),
                r.attempt.to_string(),
                format!("{secs:.1}s"),
                w.id.clone(),
            ]);
        }
        table::print(&t);
        println!(
            "(running jobs as of each worker's last heartbeat, written every {}s)",
            control::BEAT_EVERY.as_secs()
        );
    }
}

pub async fn workers(config: ValidConfig, json: bool) -> Result<(), Failure> {
    let workers = list_workers(&config).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&workers).unwrap_or_default());
    } else {
        print_workers(&workers);
    }
    Ok(())
}

/// `chime circuits`: every circuit of the config with its state.
pub async fn circuits(config: ValidConfig, json: bool) -> Result<(), Failure> {
    let names = Names::new(&config.prefix);
    let mut conn = redis(&config).await?;
    let all = chime_shared::circuit::read_all(&mut conn, &names, &config).await.map_err(runtime)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default());
        return Ok(());
    }
    if all.is_empty() {
        println!("no circuit breakers in this config (jobs[].circuit, [[circuits]])");
        return Ok(());
    }
    let now = Utc::now().timestamp_millis();
    let mut t = table::new(["CIRCUIT", "STATE", "SINCE (UTC)", "WINDOW", "JOBS", "SETTINGS"], &[]);
    for c in &all {
        let s = &c.status;
        let state = match (s.state, s.forced, s.until_ms, s.tripped.as_deref()) {
            (_, true, _, _) => "open (held by an operator)".to_string(),
            ("open", _, Some(until), _) => {
                format!("open (probes in {}s)", ((until as i64 - now).max(0) + 999) / 1000)
            }
            ("half_open", _, _, _) => format!("half_open ({} probe(s) out)", s.probes_out),
            (state, _, _, _) => state.to_string(),
        };
        let since = s
            .since_ms
            .and_then(|ms| DateTime::<Utc>::from_timestamp_millis(ms as i64))
            .map_or("-".to_string(), |t| t.format("%Y-%m-%d %H:%M:%S").to_string());
        let window = match (s.state, s.tripped.as_deref()) {
            ("closed", _) => format!("{} failed of {}", s.failed, s.succeeded + s.failed),
            (_, Some(t)) => match t.split_once(' ') {
                Some((f, n)) => format!("opened at {f} failed of {n}"),
                None => "-".into(),
            },
            _ => "-".into(),
        };
        t.add_row([c.name.clone(), state, since, window, c.jobs.join(","), c.settings.clone()]);
    }
    table::print(&t);
    Ok(())
}

/// `chime circuit open|close NAME`.
pub async fn circuit(config: ValidConfig, cmd: CircuitCommand) -> Result<(), Failure> {
    let (name, open) = match &cmd {
        CircuitCommand::Open { name } => (name, true),
        CircuitCommand::Close { name } => (name, false),
    };
    let known: Vec<String> = config.all_circuits().into_iter().map(|(c, _)| c.name).collect();
    if !known.contains(name) {
        let known = if known.is_empty() {
            "this config has none".to_string()
        } else {
            format!("known: {}", known.join(", "))
        };
        return Err(usage(anyhow::anyhow!("{name:?} is not a circuit breaker of this config ({known})")));
    }
    let names = Names::new(&config.prefix);
    let mut conn = redis(&config).await?;
    let before = chime_shared::circuit::force(&mut conn, &names, name, open).await.map_err(runtime)?;
    if open {
        println!("circuit {name} held open (was {before}); its runs wait until `chime circuit close {name}`");
    } else {
        println!("circuit {name} closed (was {before}); its runs go through again");
    }
    Ok(())
}

/// `chime priority KEY LEVEL`: finds the waiting run with key `KEY` on the other levels of
/// its queue (a pass over each level's messages, taken and given back in their order) and
/// moves it to `LEVEL`: a copy published there (confirmed) before the original is acked.
/// A run already delivered to a worker (its prefetch), running, retrying or done is not
/// waiting: exit 1, saying so.
/// `chime cancel KEY`: see `chime_shared::control::cancel`. Exit code 1 when there was nothing
/// to cancel (done, dead).
pub async fn cancel(config: ValidConfig, key: &str, json: bool) -> Result<(), Failure> {
    let key = uuid::Uuid::parse_str(key.trim())
        .map_err(|_| {
            usage(anyhow::anyhow!(
                "{key:?} is not an idempotency key (a UUID, as `chime enqueue` and `chime history` print it)"
            ))
        })?
        .to_string();
    let mut conn = super::history::reader(&config).await?.connection();
    let names = Names::new(&config.prefix);
    let who = control::operator();
    let (found, text, ok) = control::cancel(&mut conn, &names, &config, &key, &who).await.map_err(runtime)?;
    if json {
        let state = match &found {
            chime_shared::idempotency::Cancelled::Running { .. } => "running".to_string(),
            chime_shared::idempotency::Cancelled::Waiting => "waiting".to_string(),
            chime_shared::idempotency::Cancelled::NotStarted => "not_started".to_string(),
            chime_shared::idempotency::Cancelled::Settled(s) => s.as_str().to_string(),
        };
        println!("{}", serde_json::json!({"key": key, "was": state, "cancelled": ok, "message": text}));
    } else if ok {
        println!("{text}");
    }
    if ok { Ok(()) } else { Err(runtime(anyhow::anyhow!("{text}"))) }
}

pub async fn priority(
    config: ValidConfig,
    key: &str,
    level: &str,
    queue: Option<&str>,
) -> Result<(), Failure> {
    use chime_shared::config::Priority;
    let target: Priority = level.parse().map_err(|e: String| usage(anyhow::anyhow!("level {e}")))?;
    let leveled: Vec<String> =
        config.all_queues().into_iter().filter(|q| config.levels(q).len() > 1).collect();
    let queues: Vec<String> = match queue {
        Some(q) if leveled.iter().any(|l| l == q) => vec![q.to_string()],
        Some(q) => {
            check_queue(&config, q)?;
            return Err(usage(anyhow::anyhow!(
                "queue {q:?} has no priority levels (set priority on one of its jobs)"
            )));
        }
        None if leveled.is_empty() => {
            return Err(usage(anyhow::anyhow!(
                "no queue of this config has priority levels (set priority on a job)"
            )));
        }
        None => leveled,
    };
    let moved = move_waiting(&config, &queues, key, target).await.map_err(runtime)?;
    match moved {
        Some((queue, from)) => {
            println!("run {key} moved from {queue} {} to {}", from.as_str(), target.as_str());
            Ok(())
        }
        None => Err(Failure {
            code: 1,
            error: anyhow::anyhow!(
                "no run with key {key} is waiting at another level of {} (at {} already, taken by a worker, running, retrying or done: see `chime inspect {key}`)",
                queues.join(", "),
                target.as_str()
            ),
        }),
    }
}

/// Looks for the run with key `key` on each level of `queues` other than `target`; the first
/// found is published to `target` (its envelope's priority changed, its headers kept) and
/// acked once confirmed. Every message taken on the way is given back (requeued where it
/// was). Returns the queue and level it was found at.
async fn move_waiting(
    config: &ValidConfig,
    queues: &[String],
    key: &str,
    target: chime_shared::config::Priority,
) -> anyhow::Result<Option<(String, chime_shared::config::Priority)>> {
    use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, ConfirmSelectOptions};
    let names = Names::new(&config.prefix);
    let conn = chime_shared::amqp::connect(&config.amqp, "chime-priority").await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut found = None;
    'queues: for queue in queues {
        for (route, level) in config.routes(queue) {
            if level == target {
                continue;
            }
            let name = names.work_queue(&route);
            let (depth, _) = chime_shared::topology::depth(&conn, &name).await?;
            let mut taken = Vec::new();
            for _ in 0..depth {
                let Some(msg) = ch.basic_get(name.as_str().into(), BasicGetOptions::default()).await? else {
                    break;
                };
                let d = msg.delivery;
                if d.properties.message_id().as_ref().is_none_or(|id| id.as_str() != key) {
                    taken.push(d.delivery_tag);
                    continue;
                }
                // Published first, acked after: a failure between leaves two copies of one
                // key (the second is absorbed as a duplicate), never none.
                let mut env = Envelope::decode(&d.data)?;
                env.priority = Some(target);
                let props = env.properties().with_headers(d.properties.headers().clone().unwrap_or_default());
                chime_shared::amqp::publish_confirmed(
                    &ch,
                    &names.work_exchange(),
                    &env.route(),
                    &env.encode(),
                    props,
                    config.amqp.publish_timeout,
                )
                .await?;
                ch.basic_ack(d.delivery_tag, BasicAckOptions::default()).await?;
                found = Some((queue.clone(), level));
                break;
            }
            // Everything else taken from this level goes back, one by one in the order taken
            // (a quorum queue gave a multiple nack's last messages back in reverse order).
            for tag in taken {
                ch.basic_nack(tag, BasicNackOptions { multiple: false, requeue: true }).await?;
            }
            // A quorum queue takes returns back asynchronously: wait (2 s at most) until the level
            // holds them again, so that a worker starting now takes them ahead of the runs
            // behind them (a consumer elsewhere may take some meanwhile: then the wait runs out).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            let expected = depth.saturating_sub(u32::from(found.is_some()));
            while std::time::Instant::now() < deadline {
                match chime_shared::topology::depth(&conn, &name).await {
                    Ok((ready, _)) if ready >= expected => break,
                    _ => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
                }
            }
            if found.is_some() {
                break 'queues;
            }
        }
    }
    let _ = ch.close(200, "done".into()).await;
    let _ = conn.close(200, "done".into()).await;
    Ok(found)
}
