//! `chime tick`: turns schedules into exactly one message per due slot, highly available.
//!
//! Any number of replicas run; a Redis lease elects the one that publishes. The leader keeps
//! a min-heap with one entry per job (its next slot), so a tick touches only what is due,
//! however many schedules there are. Due slots are published in a batch with pipelined
//! confirms; only confirmed slots advance the job's watermark in Redis (one round trip per
//! batch). A slot whose publish fails goes back into the heap and is retried, never skipped.
//!
//! A new leader (or a restart) plans from the watermarks: slots missed while no leader ran
//! are caught up by the job's policy (`all`, `latest`, `none`) within `catch_up_window`;
//! every slot not published is counted in `chime_slots_missed_total{job}` and logged.
//! A leader stops publishing as soon as its lease could have lapsed by its own clock
//! (a paused process that wakes up after its lease does not publish before renewing). Keys
//! are deterministic, so the duplicates a split brain can still cause are absorbed by workers.

use chime_shared::amqp;
use chime_shared::calendar::OnHoliday;
use chime_shared::config::ConfigError;
use chime_shared::config::ValidConfig;
use chime_shared::config::{CatchUp, Config};
use chime_shared::envelope;
use chime_shared::health::Health;
use chime_shared::schedule::Schedule;
use chime_shared::telemetry;
use chime_shared::topology::{self, Names};
use chrono::{DateTime, Utc};
use lapin::options::ConfirmSelectOptions;
use lapin::{Channel, Connection};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::lease::TickerStore;

mod publish;

/// Default catch-up window of jobs that set none.
pub const DEFAULT_CATCH_UP_WINDOW: Duration = Duration::from_secs(3600);
/// Most slots published in one batch.
const BATCH: usize = 10_000;
/// How often a slot waiting for its job's previous run (`buffer_one`) checks on it.
const RELEASE_CHECK: Duration = Duration::from_secs(1);
/// Most missed slots counted one by one for one job (beyond it the count is a lower bound).
const COUNT_CAP: usize = 1_000_000;

/// A scheduled job as the ticker sees it.
#[derive(Debug, Clone)]
pub struct TickerJob {
    pub name: String,
    pub queue: String,
    /// Shared by every job with the same expression and zone (a parsed croner schedule
    /// holds about 5.6 KB; 100,000 distinct ones would take 560 MB).
    pub schedule: Arc<Schedule>,
    pub catch_up: CatchUp,
    pub window: Duration,
    pub jitter: Option<Duration>,
    pub payload: serde_json::Value,
    pub max_attempts: u32,
    /// High or low; `None` is normal.
    pub priority: Option<chime_shared::config::Priority>,
    /// Sharded: how many shards each slot fans out to.
    pub shards: Option<chime_shared::config::Shards>,
    /// Its members travel up to this many per message (`jobs[].pack`).
    pub pack: Option<usize>,
    /// Broadcast: each slot runs once on every live worker of the queue.
    pub broadcast: bool,
    /// What to do with a slot whose previous run is still in progress.
    pub overlap: chime_shared::config::Overlap,
    /// Its slots are not published while its queue sheds (`criticality = "sheddable"`).
    pub sheddable: bool,
    /// The scheduled chain (`after`) it belongs to, upstream first; empty when none.
    pub chain: Arc<Vec<chime_shared::workflow::StepRecord>>,
    /// The job that runs when every member of a fanned-out slot has ended (`on_complete`).
    pub on_complete: Option<Arc<chime_shared::workflow::Completion>>,
}

impl TickerJob {
    /// Whether a slot of this job is more than one message (sharded or broadcast).
    pub fn fans_out(&self) -> bool {
        self.shards.is_some() || self.broadcast
    }
}

/// Every job of `config` that has a schedule.
pub fn scheduled_jobs(config: &Config) -> Result<Vec<TickerJob>, ConfigError> {
    let mut out = Vec::new();
    // Expression, zone and calendar settings.
    type Id = (String, Option<String>, Option<String>, Option<OnHoliday>, Option<i32>);
    let mut parsed: HashMap<Id, Arc<Schedule>> = HashMap::new();
    for job in &config.jobs {
        let Some(expr) = &job.schedule else { continue };
        let id = (expr.clone(), job.timezone.clone(), job.calendar.clone(), job.on_holiday, job.business_day);
        let schedule = match parsed.get(&id) {
            Some(s) => s.clone(),
            None => {
                let Some(s) = config.schedule_of(job)? else { continue };
                let s = Arc::new(s);
                parsed.insert(id, s.clone());
                s
            }
        };
        out.push(TickerJob {
            name: job.name.clone(),
            queue: job.queue().to_string(),
            schedule,
            catch_up: job.catch_up.unwrap_or(CatchUp::All),
            window: job.catch_up_window.unwrap_or(DEFAULT_CATCH_UP_WINDOW),
            jitter: job.jitter,
            payload: job.payload.clone().unwrap_or(serde_json::Value::Null),
            max_attempts: job.max_attempts(),
            priority: job.priority.filter(|p| *p != chime_shared::config::Priority::Normal),
            shards: job.shards,
            pack: job.pack,
            broadcast: job.broadcast,
            overlap: job.overlap,
            sheddable: job.criticality == chime_shared::config::Criticality::Sheddable,
            chain: Arc::new(chime_shared::workflow::chain_of(&config.jobs, &job.name)),
            on_complete: chime_shared::workflow::Completion::of(&config.jobs, job).map(Arc::new),
        });
    }
    Ok(out)
}

/// Deterministic jitter of a slot: every replica computes the same offset from the key.
pub fn jitter_of(key: uuid::Uuid, jitter: Option<Duration>) -> Duration {
    match jitter {
        Some(j) if !j.is_zero() => {
            let ms = j.as_millis().max(1);
            Duration::from_millis(u64::try_from(key.as_u128() % ms).unwrap_or(0))
        }
        _ => Duration::ZERO,
    }
}

/// Heap entry: (due ms, slot s, job index), smallest due first.
type Entry = Reverse<(i64, i64, usize)>;

/// The plan: heap of next slots plus what was missed.
#[derive(Debug, Default)]
pub struct Plan {
    heap: BinaryHeap<Entry>,
    /// job → slots that will never be published (older than the window, or skipped by policy).
    pub missed: HashMap<String, usize>,
}

impl Plan {
    /// Plans every job from its watermark (Unix seconds of the last confirmed slot).
    pub fn new(jobs: &[TickerJob], watermarks: &HashMap<String, i64>, now: DateTime<Utc>) -> Self {
        let mut plan = Plan::default();
        for (i, job) in jobs.iter().enumerate() {
            let s = &job.schedule;
            let Some(wm) = watermarks.get(&job.name).and_then(|w| DateTime::from_timestamp(*w, 0)) else {
                // A job never published before starts with its next slot.
                if let Some(next) = s.next_tick(now) {
                    plan.push(i, job, next);
                }
                continue;
            };
            let window_start =
                now - chrono::Duration::from_std(job.window).unwrap_or(chrono::Duration::zero());
            let catch_from = wm.max(window_start);
            let too_old =
                if wm < window_start { s.slots_between(wm, window_start, COUNT_CAP).len() } else { 0 };
            let in_window = s.slots_between(catch_from, now, COUNT_CAP);
            // Never below the watermark: a leader whose clock is behind the last published
            // slot (clock skew between replicas) continues after it, not before.
            let upcoming = s.next_tick(now.max(wm));
            let (first, skipped) = match job.catch_up {
                // The first tick: a slot, or one its calendar skips (recorded as such).
                CatchUp::All => (s.next_tick(catch_from).filter(|t| *t <= now).or(upcoming), 0),
                CatchUp::Latest => match in_window.last() {
                    Some(last) => (Some(*last), in_window.len() - 1),
                    None => (upcoming, 0),
                },
                CatchUp::None => (upcoming, in_window.len()),
            };
            if too_old + skipped > 0 {
                plan.missed.insert(job.name.clone(), too_old + skipped);
            }
            if let Some(first) = first {
                plan.push(i, job, first);
            }
        }
        plan
    }

    fn push(&mut self, i: usize, job: &TickerJob, slot: DateTime<Utc>) {
        let key = envelope::scheduled_key(&job.name, slot);
        let due =
            slot + chrono::Duration::from_std(jitter_of(key, job.jitter)).unwrap_or(chrono::Duration::zero());
        self.heap.push(Reverse((due.timestamp_millis(), slot.timestamp(), i)));
    }

    /// Due time of the earliest entry.
    pub fn next_due(&self) -> Option<DateTime<Utc>> {
        self.heap.peek().and_then(|Reverse((ms, _, _))| DateTime::from_timestamp_millis(*ms))
    }

    /// Removes and returns up to `max` entries due at or before `now` as (job index, slot).
    fn pop_due(&mut self, now: DateTime<Utc>, max: usize) -> Vec<(usize, DateTime<Utc>)> {
        let mut out = Vec::new();
        while out.len() < max {
            match self.heap.peek() {
                Some(Reverse((due, _, _))) if *due <= now.timestamp_millis() => {
                    if let Some(Reverse((_, slot, i))) = self.heap.pop()
                        && let Some(slot) = DateTime::from_timestamp(slot, 0)
                    {
                        out.push((i, slot));
                    }
                }
                _ => break,
            }
        }
        out
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

/// Why leading stopped.
enum Stop {
    Shutdown,
    LostLease,
}

/// One ticker replica.
pub struct Ticker {
    id: String,
    store: TickerStore,
    health: Health,
    config_rx: watch::Receiver<ValidConfig>,
    leading: watch::Sender<bool>,
}

impl Ticker {
    /// `config_rx` carries the current config; send a new one to reload the schedules.
    pub fn new(
        config_rx: watch::Receiver<ValidConfig>,
        id: String,
        health: Health,
    ) -> Result<Self, redis::RedisError> {
        let config = config_rx.borrow().clone();
        let store = TickerStore::connect(&config.redis, &config.prefix)?;
        Ok(Self { id, store, health, config_rx, leading: watch::Sender::new(false) })
    }

    /// `true` while this replica holds the lease and publishes: what runs only on the leader
    /// (the DLQ monitor in `chime tick`) follows it.
    pub fn leadership(&self) -> watch::Receiver<bool> {
        self.leading.subscribe()
    }

    /// Stands by or leads until `token` is cancelled; then gives the lease up.
    pub async fn run(mut self, token: CancellationToken) {
        info!(id = %self.id, "ticker starting");
        while !token.is_cancelled() {
            metrics::gauge!(telemetry::TICKER_LEADER).set(0.0);
            if !self.stand_by(&token).await {
                break;
            }
            metrics::gauge!(telemetry::TICKER_LEADER).set(1.0);
            info!(id = %self.id, "leader: publishing schedules");
            self.leading.send_replace(true);
            let stop = self.lead(&token).await;
            self.leading.send_replace(false);
            metrics::gauge!(telemetry::TICKER_LEADER).set(0.0);
            match stop {
                Stop::Shutdown => break,
                Stop::LostLease => warn!(id = %self.id, "lost the leader lease; standing by"),
            }
        }
        let _ = self.store.release(&self.id).await;
        info!(id = %self.id, "ticker stopped");
    }

    fn lease(&self) -> Duration {
        self.config_rx.borrow().ticker.lease
    }

    /// Polls the lease until we hold it (true) or shutdown (false).
    async fn stand_by(&mut self, token: &CancellationToken) -> bool {
        let poll = (self.lease() / 20).clamp(Duration::from_millis(50), Duration::from_secs(1));
        loop {
            match self.store.acquire(&self.id, self.lease()).await {
                Ok(state) => {
                    self.health.set("redis", true);
                    self.skew(state.redis_now_ms);
                    if state.held {
                        return true;
                    }
                }
                Err(e) => {
                    // Once per outage, not per poll.
                    if self.health.get("redis") {
                        warn!(error = %e, "lease poll failed; standing by until Redis answers");
                    }
                    self.health.set("redis", false);
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(poll) => {}
                _ = token.cancelled() => return false,
            }
        }
    }

    /// Local clock minus Redis `TIME`; warns beyond `ticker.max_clock_skew`.
    fn skew(&self, redis_now_ms: i64) {
        let skew_ms = Utc::now().timestamp_millis() - redis_now_ms;
        metrics::gauge!(telemetry::TICKER_CLOCK_SKEW).set(skew_ms as f64 / 1000.0);
        let max = self.config_rx.borrow().ticker.max_clock_skew;
        if skew_ms.unsigned_abs() > u64::try_from(max.as_millis()).unwrap_or(u64::MAX) {
            warn!(skew_ms, max = ?max, "local clock differs from Redis TIME beyond ticker.max_clock_skew");
        }
    }

    async fn lead(&mut self, token: &CancellationToken) -> Stop {
        let mut config = self.config_rx.borrow().clone();
        let names = Names::new(&config.prefix);
        let mut jobs = scheduled_jobs(&config).unwrap_or_default();
        let lease = self.lease();
        let mut lease_until = Instant::now() + lease / 2; // conservative until the first renew
        let mut next_renew = Instant::now();
        let mut amqp_link: Option<(Connection, Channel)> = None;
        let mut plan = match self.plan(&jobs).await {
            Some(p) => p,
            None => return Stop::LostLease,
        };
        // Jobs with a slot waiting for their previous run (buffer_one): checked every second.
        let mut buffered = self.buffered(&names, &jobs).await;
        let mut next_release = Instant::now();
        loop {
            if Instant::now() >= next_renew {
                let asked = Instant::now();
                match self.store.acquire(&self.id, lease).await {
                    Ok(s) if s.held => {
                        self.health.set("redis", true);
                        self.skew(s.redis_now_ms);
                        lease_until = asked + lease;
                        next_renew = Instant::now() + lease / 3;
                    }
                    Ok(_) => return Stop::LostLease,
                    Err(e) => {
                        self.health.set("redis", false);
                        warn!(error = %e, "lease renewal failed");
                        next_renew = Instant::now() + Duration::from_millis(200);
                    }
                }
            }
            // By our own clock the lease may have lapsed: someone else may lead now.
            if Instant::now() >= lease_until {
                return Stop::LostLease;
            }
            let due = plan.pop_due(Utc::now(), BATCH);
            let release = !buffered.is_empty() && Instant::now() >= next_release;
            if !due.is_empty() || release {
                if release {
                    next_release = Instant::now() + RELEASE_CHECK;
                }
                if amqp_link.is_none() {
                    amqp_link = connect(&config).await;
                    self.health.set("amqp", amqp_link.is_some());
                }
                match &amqp_link {
                    Some((_, ch)) => {
                        if !self.publish(ch, &names, &config, &jobs, &mut plan, due, &mut buffered).await {
                            amqp_link = None; // reconnect before the retry
                        }
                    }
                    None => {
                        let retry = Utc::now() + chrono::Duration::seconds(1);
                        for (i, slot) in due {
                            plan.heap.push(Reverse((retry.timestamp_millis(), slot.timestamp(), i)));
                        }
                    }
                }
                continue;
            }
            let mut wake = plan
                .next_due()
                .map(|d| (d - Utc::now()).to_std().unwrap_or(Duration::ZERO))
                .unwrap_or(Duration::from_secs(3600))
                .min(next_renew.saturating_duration_since(Instant::now()));
            if !buffered.is_empty() {
                wake = wake.min(next_release.saturating_duration_since(Instant::now()));
            }
            tokio::select! {
                _ = tokio::time::sleep(wake) => {}
                _ = token.cancelled() => return Stop::Shutdown,
                changed = self.config_rx.changed() => {
                    if changed.is_ok() {
                        config = self.config_rx.borrow().clone();
                        match scheduled_jobs(&config) {
                            Ok(j) => {
                                jobs = j;
                                info!(jobs = jobs.len(), "schedules reloaded");
                                // Re-plan from the watermarks: nothing lost, nothing doubled.
                                match self.plan(&jobs).await {
                                    Some(p) => plan = p,
                                    None => return Stop::LostLease,
                                }
                                buffered = self.buffered(&names, &jobs).await;
                            }
                            Err(e) => warn!(error = %e, "reload rejected; keeping the old schedules"),
                        }
                    }
                }
            }
        }
    }

    /// The jobs (indexes) with a slot waiting for their previous run (`buffer_one`), as
    /// Redis says: a new leader carries on with what the last one buffered.
    async fn buffered(&self, names: &Names, jobs: &[TickerJob]) -> std::collections::BTreeSet<usize> {
        let watched: Vec<usize> = (0..jobs.len())
            .filter(|i| jobs[*i].overlap == chime_shared::config::Overlap::BufferOne)
            .collect();
        if watched.is_empty() {
            return Default::default();
        }
        let job_names: Vec<&str> = watched.iter().map(|i| jobs[*i].name.as_str()).collect();
        match crate::overlap::states(&mut self.store.conn(), names, &job_names).await {
            Ok(states) => watched
                .into_iter()
                .zip(states)
                .filter(|(_, s)| s.buffered.is_some())
                .map(|(i, _)| i)
                .collect(),
            Err(e) => {
                warn!(error = %e, "cannot read buffered slots; checking them at every slot");
                watched.into_iter().collect()
            }
        }
    }

    /// Reads the watermarks and plans; `None` if Redis stays unreachable past the lease.
    async fn plan(&self, jobs: &[TickerJob]) -> Option<Plan> {
        let give_up = Instant::now() + self.lease();
        loop {
            match self.store.watermarks().await {
                Ok(wm) => {
                    let plan = Plan::new(jobs, &wm, Utc::now());
                    for (job, n) in &plan.missed {
                        warn!(%job, missed = n, "slots outside the catch-up window or skipped by the catch-up policy");
                        metrics::counter!(telemetry::SLOTS_MISSED, "job" => job.clone()).increment(*n as u64);
                        self.store.count(job, "missed", *n as u64).await;
                    }
                    info!(jobs = jobs.len(), "planned");
                    return Some(plan);
                }
                Err(e) if Instant::now() < give_up => {
                    warn!(error = %e, "reading watermarks failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(_) => return None,
            }
        }
    }
}

async fn connect(config: &Config) -> Option<(Connection, Channel)> {
    let conn = match amqp::connect(&config.amqp, "chime-tick").await {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "ticker cannot reach RabbitMQ");
            return None;
        }
    };
    let queues: Vec<String> = {
        let mut q = config.all_queues();
        q.dedup();
        q
    };
    if let Err(e) = topology::declare(&conn, config, &queues).await {
        warn!(error = %e, "ticker cannot declare the topology");
        return None;
    }
    let ch = conn.create_channel().await.ok()?;
    ch.confirm_select(ConfirmSelectOptions::default()).await.ok()?;
    Some((conn, ch))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(expr: &str, catch_up: CatchUp, window_s: u64) -> TickerJob {
        TickerJob {
            name: "j".into(),
            queue: "default".into(),
            schedule: Arc::new(Schedule::parse(expr, None).unwrap()),
            catch_up,
            window: Duration::from_secs(window_s),
            jitter: None,
            payload: serde_json::Value::Null,
            max_attempts: 1,
            priority: None,
            shards: None,
            pack: None,
            broadcast: false,
            overlap: chime_shared::config::Overlap::Allow,
            sheddable: false,
            chain: Arc::default(),
            on_complete: None,
        }
    }

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn plans_follow_the_catch_up_policy() {
        let now = t("2026-01-01T00:10:00Z");
        // Last confirmed slot 00:00; every minute; window 5 min.
        let wm = HashMap::from([("j".to_string(), t("2026-01-01T00:00:00Z").timestamp())]);
        let mut all = Plan::new(&[job("* * * * *", CatchUp::All, 300)], &wm, now);
        // 00:01..00:05 are outside the window (missed); 00:05 itself is the window start.
        assert_eq!(all.missed["j"], 5);
        assert_eq!(all.pop_due(now, 100), vec![(0, t("2026-01-01T00:06:00Z"))]);
        let mut latest = Plan::new(&[job("* * * * *", CatchUp::Latest, 300)], &wm, now);
        assert_eq!(latest.missed["j"], 5 + 4);
        assert_eq!(latest.pop_due(now, 100), vec![(0, t("2026-01-01T00:10:00Z"))]);
        let mut none = Plan::new(&[job("* * * * *", CatchUp::None, 300)], &wm, now);
        assert_eq!(none.missed["j"], 10);
        assert!(none.pop_due(now, 100).is_empty());
        assert_eq!(none.next_due(), Some(t("2026-01-01T00:11:00Z")));
        // A leader whose clock is behind the watermark plans from the watermark on.
        let behind = Plan::new(&[job("* * * * *", CatchUp::All, 300)], &wm, t("2025-12-31T23:58:00Z"));
        assert_eq!(behind.next_due(), Some(t("2026-01-01T00:01:00Z")));
        // A job without a watermark starts at its next slot.
        let fresh = Plan::new(&[job("* * * * *", CatchUp::All, 300)], &HashMap::new(), now);
        assert!(fresh.missed.is_empty());
        assert_eq!(fresh.next_due(), Some(t("2026-01-01T00:11:00Z")));
    }

    /// Runs the leader's loop minute by minute from `from` to `to`: pop what is due, "confirm"
    /// it (advance the watermark, plan the next slot), and at each instant in `failovers` throw
    /// the plan away and let a new leader plan from the watermarks, as after a takeover.
    fn lead(jobs: &[TickerJob], from: &str, to: &str, failovers: &[&str], wm: Option<&str>) -> Vec<String> {
        let mut marks: HashMap<String, i64> = HashMap::new();
        if let Some(w) = wm {
            marks.insert("j".into(), t(w).timestamp());
        }
        let mut now = t(from);
        let mut plan = Plan::new(jobs, &marks, now);
        let mut out = Vec::new();
        while now <= t(to) {
            if failovers.iter().any(|f| t(f) == now) {
                plan = Plan::new(jobs, &marks, now);
            }
            for (i, slot) in plan.pop_due(now, BATCH) {
                out.push(slot.format("%m-%dT%H:%M:%SZ").to_string());
                marks.insert(jobs[i].name.clone(), slot.timestamp());
                if let Some(next) = jobs[i].schedule.next_tick(slot) {
                    plan.push(i, &jobs[i], next);
                }
            }
            now += chrono::Duration::seconds(30);
        }
        out
    }

    fn berlin(expr: &str) -> Vec<TickerJob> {
        let mut j = job(expr, CatchUp::All, 6 * 3600);
        j.schedule = Arc::new(Schedule::parse(expr, Some("Europe/Berlin")).unwrap());
        vec![j]
    }

    #[test]
    fn the_leader_publishes_vixie_slots_on_dst_nights_across_failovers_and_outages() {
        let jobs = berlin("0 30 1-3 * * *");
        let spring = ["03-29T00:30:00Z", "03-29T01:00:00Z", "03-29T01:30:00Z"];
        let fall = ["10-24T23:30:00Z", "10-25T00:30:00Z", "10-25T02:30:00Z"];
        assert_eq!(lead(&jobs, "2026-03-28T22:00:00Z", "2026-03-29T04:00:00Z", &[], None), spring);
        assert_eq!(lead(&jobs, "2026-10-24T21:00:00Z", "2026-10-25T04:00:00Z", &[], None), fall);
        // A takeover right after each slot, and in the repeated hour: same slots, once each.
        let takeovers = ["2026-03-29T00:30:30Z", "2026-03-29T01:00:30Z", "2026-03-29T01:15:00Z"];
        assert_eq!(lead(&jobs, "2026-03-28T22:00:00Z", "2026-03-29T04:00:00Z", &takeovers, None), spring);
        let takeovers = ["2026-10-25T00:30:30Z", "2026-10-25T01:30:00Z", "2026-10-25T02:00:00Z"];
        assert_eq!(lead(&jobs, "2026-10-24T21:00:00Z", "2026-10-25T04:00:00Z", &takeovers, None), fall);
        // Every ticker down from 22:00Z to 03:00Z: the next leader catches the night up from the
        // watermark with the same slots (catch_up = "all", window 6 h).
        let wm = Some("2026-03-28T22:00:00Z");
        assert_eq!(lead(&jobs, "2026-03-29T03:00:00Z", "2026-03-29T04:00:00Z", &[], wm), spring);
        let wm = Some("2026-10-24T21:00:00Z");
        assert_eq!(lead(&jobs, "2026-10-25T03:00:00Z", "2026-10-25T04:00:00Z", &[], wm), fall);
        let jobs = berlin("30 2,14 * * *");
        assert_eq!(
            lead(&jobs, "2026-03-28T20:00:00Z", "2026-03-29T23:00:00Z", &[], None),
            ["03-29T01:00:00Z", "03-29T12:30:00Z"]
        );
        assert_eq!(
            lead(&jobs, "2026-10-24T20:00:00Z", "2026-10-25T23:00:00Z", &[], None),
            ["10-25T00:30:00Z", "10-25T13:30:00Z"]
        );
    }

    #[test]
    fn calendar_slots_roll_once_across_takeovers_and_outages_on_a_dst_weekend() {
        use chime_shared::calendar::Calendar;
        use chime_shared::schedule::{Business, Rule};
        // Berlin, Monday to Friday, Friday 27 March 2026 a holiday; the clocks go forward on
        // Sunday 29th (02:30 does not exist that night). A 02:30 job rolled forward: Friday,
        // Saturday and Sunday all land on Monday 02:30 CEST (00:30Z), which is Monday's own
        // slot: one run.
        let holiday = "2026-03-27".parse().unwrap();
        let on = |rule| {
            let mut j = berlin("30 2 * * *").remove(0);
            let business = Business {
                name: "de".into(),
                calendar: Arc::new(Calendar::default().with_holidays([holiday])),
                rule,
            };
            j.schedule = Arc::new(
                Schedule::parse("30 2 * * *", Some("Europe/Berlin")).unwrap().on_calendar(business).unwrap(),
            );
            vec![j]
        };
        let jobs = on(Rule::OnHoliday(OnHoliday::NextBusinessDay));
        let want = ["03-30T00:30:00Z", "03-31T00:30:00Z"];
        assert_eq!(lead(&jobs, "2026-03-26T12:00:00Z", "2026-03-31T12:00:00Z", &[], None), want);
        let takeovers = ["2026-03-27T01:30:30Z", "2026-03-29T01:00:00Z", "2026-03-30T00:30:30Z"];
        assert_eq!(lead(&jobs, "2026-03-26T12:00:00Z", "2026-03-31T12:00:00Z", &takeovers, None), want);
        // Every ticker down over the weekend: the next leader catches Monday's slot up, once.
        let wm = Some("2026-03-26T01:30:00Z");
        assert_eq!(lead(&jobs, "2026-03-30T02:00:00Z", "2026-03-31T12:00:00Z", &[], wm), want);
        // Skipped instead: the ticker walks the days off too (to count and record them).
        let jobs = on(Rule::OnHoliday(OnHoliday::Skip));
        let ticks = lead(&jobs, "2026-03-26T12:00:00Z", "2026-03-31T12:00:00Z", &takeovers, None);
        assert_eq!(
            ticks,
            ["03-27T01:30:00Z", "03-28T01:30:00Z", "03-29T01:00:00Z", "03-30T00:30:00Z", "03-31T00:30:00Z"]
        );
        let skipped: Vec<bool> =
            ticks.iter().map(|s| jobs[0].schedule.skipped(t(&format!("2026-{s}"))).is_some()).collect();
        assert_eq!(skipped, [true, true, true, false, false]);
    }

    #[test]
    fn jitter_is_deterministic_and_bounded() {
        let k = envelope::scheduled_key("j", t("2026-01-01T00:00:00Z"));
        let j = Some(Duration::from_secs(30));
        assert_eq!(jitter_of(k, j), jitter_of(k, j));
        assert!(jitter_of(k, j) < Duration::from_secs(30));
        assert_eq!(jitter_of(k, None), Duration::ZERO);
    }

    #[test]
    fn twenty_thousand_schedules_pop_only_what_is_due() {
        let jobs: Vec<TickerJob> = (0..20_000)
            .map(|i| {
                let mut j = job(&format!("{} {} * * * *", i % 60, (i / 60) % 60), CatchUp::All, 60);
                j.name = format!("j{i}");
                j
            })
            .collect();
        let now = t("2026-01-01T00:00:00Z");
        let mut plan = Plan::new(&jobs, &HashMap::new(), now);
        assert_eq!(plan.len(), 20_000);
        let due = plan.pop_due(t("2026-01-01T00:00:01Z"), BATCH);
        // Second 1 of minute 0 of each hour: i % 60 == 1 and (i / 60) % 60 == 0.
        assert_eq!(due.len(), (0..20_000).filter(|i| i % 60 == 1 && (i / 60) % 60 == 0).count());
        assert!(!plan.is_empty());
    }
}
