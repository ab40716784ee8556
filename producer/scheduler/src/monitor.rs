//! DLQ depth monitor and alerts, and circuit breaker alerts.
//!
//! Every `alerts.interval` it reads each DLQ's depth with a passive declare (no plugin) and
//! sets `chime_dlq_messages{queue}` (and `chime_queue_messages{queue}` for work queues). A DLQ
//! at or above `alerts.dlq_threshold` for `alerts.for` raises one `firing` notification; when
//! it drops below, one `resolved`. Sinks: the log, and optionally a webhook that receives an
//! Alertmanager-compatible (webhook v4) JSON body, retried with backoff; notifications are
//! sent one at a time, in order, so `resolved` never overtakes its `firing`.
//!
//! At the same interval it reads every circuit breaker of the config from Redis: one that is
//! not closed (open, half-open, or held open by an operator) raises `firing` at once; closed
//! again, `resolved`. Workers change circuits; the monitor, one per prefix, tells people.

use chime_shared::amqp;
use chime_shared::catalog;
use chime_shared::config::ValidConfig;
use chime_shared::health::Health;
use chime_shared::telemetry;
use chime_shared::topology::{self, Names};
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::json;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Runs the monitor whenever `leading` is `true` (on the config current at that moment),
/// stopping it when `leading` turns `false`, until `token` is cancelled.
pub async fn run_while(
    mut leading: tokio::sync::watch::Receiver<bool>,
    config: tokio::sync::watch::Receiver<ValidConfig>,
    token: CancellationToken,
) {
    loop {
        tokio::select! {
            r = leading.wait_for(|l| *l) => if r.is_err() { return },
            _ = token.cancelled() => return,
        }
        let term = token.child_token();
        let monitor = tokio::spawn(run(config.borrow().clone(), Health::default(), term.clone()));
        tokio::select! {
            _ = leading.wait_for(|l| !*l) => {}
            _ = token.cancelled() => {}
        }
        term.cancel();
        let _ = monitor.await;
    }
}

/// One state change of one DLQ's or circuit's alert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The DLQ's queue, or the circuit's name.
    pub queue: String,
    pub firing: bool,
    /// The DLQ's depth (0 for a circuit).
    pub depth: u32,
    pub starts_at: DateTime<Utc>,
    pub ends_at: Option<DateTime<Utc>>,
    /// A circuit breaker's or a shedding queue's alert (a DLQ's: `None`).
    pub about: Option<About>,
}

/// What an alert other than a DLQ's is about, with its state in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum About {
    /// A circuit breaker that is not closed (`queue` is its name).
    Circuit(String),
    /// A queue shedding its sheddable runs (the threshold crossed).
    Shedding(String),
    /// A producer's local spool holding jobs longer than `producer.spool_alert_after`
    /// (`queue` is `<host>:<dir>`; what it holds in words).
    Spool(String),
}

impl Notification {
    /// The alert it changes (one delivery task each).
    fn subject(&self) -> String {
        match &self.about {
            Some(About::Circuit(_)) => format!("circuit:{}", self.queue),
            Some(About::Shedding(_)) => format!("shed:{}", self.queue),
            Some(About::Spool(_)) => format!("spool:{}", self.queue),
            None => self.queue.clone(),
        }
    }
}

#[derive(Debug, Default)]
struct AlertState {
    above_since: Option<(Instant, DateTime<Utc>)>,
    firing: Option<DateTime<Utc>>,
}

/// The per-queue state machine: feed it depths, it says when to notify.
#[derive(Debug)]
pub struct Alerts {
    threshold: u64,
    hold: Duration,
    state: HashMap<String, AlertState>,
}

impl Alerts {
    pub fn new(threshold: u64, hold: Duration) -> Self {
        Self { threshold, hold, state: HashMap::new() }
    }

    /// Records `depth` of `queue` seen at `now`; returns a notification on a state change.
    pub fn observe(
        &mut self,
        queue: &str,
        depth: u32,
        now: Instant,
        wall: DateTime<Utc>,
    ) -> Option<Notification> {
        let s = self.state.entry(queue.to_string()).or_default();
        if u64::from(depth) >= self.threshold {
            let (since, since_wall) = *s.above_since.get_or_insert((now, wall));
            if s.firing.is_none() && now.duration_since(since) >= self.hold {
                s.firing = Some(since_wall);
                return Some(Notification {
                    queue: queue.to_string(),
                    firing: true,
                    depth,
                    starts_at: since_wall,
                    ends_at: None,
                    about: None,
                });
            }
            None
        } else {
            s.above_since = None;
            s.firing.take().map(|starts_at| Notification {
                queue: queue.to_string(),
                firing: false,
                depth,
                starts_at,
                ends_at: Some(wall),
                about: None,
            })
        }
    }

    /// Records the state of circuit `name` (`detail` says it in words); returns a notification
    /// when it left `closed` (at once: a circuit opens on a window of failures already) or
    /// came back to it.
    pub fn observe_circuit(
        &mut self,
        name: &str,
        closed: bool,
        detail: String,
        wall: DateTime<Utc>,
    ) -> Option<Notification> {
        self.observe_state(name, !closed, About::Circuit(detail), wall)
    }

    /// Records whether `queue` sheds (`about` says why); a notification when that changes.
    pub fn observe_shedding(
        &mut self,
        queue: &str,
        reason: Option<String>,
        wall: DateTime<Utc>,
    ) -> Option<Notification> {
        let on = reason.is_some();
        self.observe_state(
            queue,
            on,
            About::Shedding(reason.unwrap_or_else(|| "below its threshold".into())),
            wall,
        )
    }

    /// Records whether spool `name` (`<host>:<dir>`) has held a job too long (`detail` says
    /// what it holds); a notification when that changes.
    pub fn observe_spool(
        &mut self,
        name: &str,
        on: bool,
        detail: String,
        wall: DateTime<Utc>,
    ) -> Option<Notification> {
        self.observe_state(name, on, About::Spool(detail), wall)
    }

    /// The spools whose alert is firing (`<host>:<dir>`).
    pub fn firing_spools(&self) -> Vec<String> {
        self.state
            .iter()
            .filter(|(k, s)| k.starts_with("spool:") && s.firing.is_some())
            .map(|(k, _)| k["spool:".len()..].to_string())
            .collect()
    }

    /// A state that fires at once while `on` and resolves when it goes off.
    fn observe_state(
        &mut self,
        name: &str,
        on: bool,
        about: About,
        wall: DateTime<Utc>,
    ) -> Option<Notification> {
        let key = Notification {
            queue: name.to_string(),
            firing: false,
            depth: 0,
            starts_at: wall,
            ends_at: None,
            about: Some(about.clone()),
        }
        .subject();
        let s = self.state.entry(key).or_default();
        let closed = !on;
        let n = |firing, starts_at, ends_at| Notification {
            queue: name.to_string(),
            firing,
            depth: 0,
            starts_at,
            ends_at,
            about: Some(about.clone()),
        };
        match (closed, s.firing) {
            (false, None) => {
                s.firing = Some(wall);
                Some(n(true, wall, None))
            }
            (true, Some(since)) => {
                s.firing = None;
                Some(n(false, since, Some(wall)))
            }
            _ => None,
        }
    }
}

/// A circuit's state in words, for its alert.
fn circuit_detail(c: &chime_shared::circuit::CircuitView) -> String {
    let s = &c.status;
    let mut d = if s.forced { "open (held by an operator)".to_string() } else { s.state.to_string() };
    if let Some((failed, runs)) = s.tripped.as_deref().and_then(|t| t.split_once(' ')) {
        d.push_str(&format!(": {failed} of {runs} runs failed"));
    }
    d.push_str(&format!(" ({}; jobs {})", c.settings, c.jobs.join(", ")));
    d
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// The Alertmanager webhook (v4) body for one notification.
pub fn webhook_body(n: &Notification, names: &Names, threshold: u64) -> serde_json::Value {
    let status = if n.firing { "firing" } else { "resolved" };
    let (labels, annotations, group, identity) = match &n.about {
        None => (
            json!({
                "alertname": "ChimeDeadLetters",
                "severity": "warning",
                "prefix": names.prefix(),
                "queue": n.queue,
                "dlq": names.dlq(&n.queue),
            }),
            json!({
                "summary": format!("dead letters in {}", names.dlq(&n.queue)),
                "description": format!("{} message(s) in {} (threshold {threshold}); inspect with `chime dlq list --queue {}`",
                    n.depth, names.dlq(&n.queue), n.queue),
            }),
            json!({"alertname": "ChimeDeadLetters", "queue": n.queue}),
            format!("{{alertname=\"ChimeDeadLetters\",queue=\"{}\"}}", n.queue),
        ),
        Some(About::Shedding(reason)) => (
            json!({
                "alertname": "ChimeShedding",
                "severity": "warning",
                "prefix": names.prefix(),
                "queue": n.queue,
            }),
            json!({
                "summary": format!("queue {} is shedding its sheddable jobs", n.queue),
                "description": format!("{reason}; its sheddable runs and slots are skipped (recorded `shed`) until it drops below 80 % of its threshold"),
            }),
            json!({"alertname": "ChimeShedding", "queue": n.queue}),
            format!("{{alertname=\"ChimeShedding\",queue=\"{}\"}}", n.queue),
        ),
        Some(About::Spool(detail)) => (
            json!({
                "alertname": "ChimeSpoolNotEmpty",
                "severity": "warning",
                "prefix": names.prefix(),
                "spool": n.queue,
            }),
            json!({
                "summary": format!("jobs wait in the local spool {}", n.queue),
                "description": format!("{detail}; the broker did not confirm them; they are published when it does (`chime spool status`, `chime spool flush` on that host)"),
            }),
            json!({"alertname": "ChimeSpoolNotEmpty", "spool": n.queue}),
            format!("{{alertname=\"ChimeSpoolNotEmpty\",spool=\"{}\"}}", n.queue),
        ),
        Some(About::Circuit(detail)) => (
            json!({
                "alertname": "ChimeCircuitOpen",
                "severity": "warning",
                "prefix": names.prefix(),
                "circuit": n.queue,
            }),
            json!({
                "summary": format!("circuit breaker {} is not closed", n.queue),
                "description": format!("{detail}; its runs wait (see `chime circuits`, `chime circuit close {}`)", n.queue),
            }),
            json!({"alertname": "ChimeCircuitOpen", "circuit": n.queue}),
            format!("{{alertname=\"ChimeCircuitOpen\",circuit=\"{}\"}}", n.queue),
        ),
    };
    json!({
        "version": "4",
        "groupKey": format!("{{}}:{identity}"),
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "chime",
        "groupLabels": group,
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": "",
        "alerts": [{
            "status": status,
            "labels": labels,
            "annotations": annotations,
            "startsAt": rfc3339(n.starts_at),
            "endsAt": n.ends_at.map(rfc3339).unwrap_or_else(|| "0001-01-01T00:00:00Z".into()),
            "generatorURL": "",
            "fingerprint": format!("{:016x}", fingerprint(&identity)),
        }],
    })
}

fn fingerprint(s: &str) -> u64 {
    // FNV-1a: stable across runs and processes.
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Delivers notifications: one task per queue, each in order (a `firing` before its
/// `resolved`), so a receiver failing for one queue delays only that queue's notifications.
struct Dispatch {
    queues: HashMap<String, mpsc::UnboundedSender<Notification>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    names: Names,
    threshold: u64,
    webhook: Option<std::sync::Arc<Webhook>>,
}

impl Dispatch {
    fn new(config: &ValidConfig) -> Self {
        Self {
            queues: HashMap::new(),
            tasks: Vec::new(),
            names: Names::new(&config.prefix),
            threshold: config.alerts.dlq_threshold,
            webhook: Webhook::new(config).map(std::sync::Arc::new),
        }
    }

    fn send(&mut self, n: Notification) {
        let tx = self.queues.entry(n.subject()).or_insert_with(|| {
            let (tx, mut rx) = mpsc::unbounded_channel::<Notification>();
            let (names, threshold, webhook) = (self.names.clone(), self.threshold, self.webhook.clone());
            self.tasks.push(tokio::spawn(async move {
                while let Some(n) = rx.recv().await {
                    match (&n.about, n.firing) {
                        (None, true) => warn!(queue = %n.queue, depth = n.depth, "DLQ alert firing"),
                        (None, false) => info!(queue = %n.queue, depth = n.depth, "DLQ alert resolved"),
                        (Some(About::Circuit(d)), true) => warn!(circuit = %n.queue, state = %d, "circuit alert firing"),
                        (Some(About::Circuit(_)), false) => info!(circuit = %n.queue, "circuit alert resolved: closed"),
                        (Some(About::Shedding(d)), true) => warn!(queue = %n.queue, reason = %d, "shedding alert firing"),
                        (Some(About::Shedding(_)), false) => info!(queue = %n.queue, "shedding alert resolved"),
                        (Some(About::Spool(d)), true) => warn!(spool = %n.queue, holds = %d, "spool alert firing"),
                        (Some(About::Spool(_)), false) => info!(spool = %n.queue, "spool alert resolved: flushed"),
                    }
                    if let Some(w) = &webhook {
                        let result = w.send(&n, &webhook_body(&n, &names, threshold)).await;
                        metrics::counter!(telemetry::ALERT_NOTIFICATIONS, "queue" => n.subject(), "result" => result)
                            .increment(1);
                    }
                }
            }));
            tx
        });
        let _ = tx.send(n);
    }

    /// Lets queued notifications go out (bounded), then stops.
    async fn finish(self) {
        drop(self.queues);
        let all = async {
            for task in self.tasks {
                let _ = task.await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(10), all).await;
    }
}

/// Why a webhook call failed.
#[cfg(feature = "webhook")]
enum Refused {
    /// The receiver refused the notification itself (a 4xx other than 408 and 429): sending
    /// it again cannot help.
    Rejected(String),
    /// Worth another try (a 5xx, 408, 429, a timeout, no connection).
    Failed(String),
}

#[cfg(feature = "webhook")]
impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Rejected(e) | Refused::Failed(e) => f.write_str(e),
        }
    }
}

/// The alert webhook (`alerts.webhook`), retried with backoff when retrying can help.
#[cfg(feature = "webhook")]
struct Webhook {
    url: String,
    http: reqwest::Client,
}

#[cfg(feature = "webhook")]
impl Webhook {
    fn new(config: &ValidConfig) -> Option<Self> {
        // No redirects for alerts: an Alertmanager URL never moves, and a redirect would resend
        // the body elsewhere.
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        config.alerts.webhook.clone().map(|url| Self { url, http })
    }

    /// Posts `body`; the result as the `result` label of `chime_alert_notifications_total`:
    /// `sent`, `rejected` (a 4xx other than 408 and 429: not retried) or `gave_up` (still
    /// failing after the retries: 5xx, 408, 429, timeouts, no connection).
    async fn send(&self, n: &Notification, body: &serde_json::Value) -> &'static str {
        let shown = chime_shared::redact::redact(&self.url);
        let send = || async {
            let r = self
                .http
                .post(&self.url)
                .timeout(Duration::from_secs(10))
                .header("content-type", "application/json")
                .body(serde_json::to_vec(body).unwrap_or_default())
                .send()
                .await
                .map_err(|e| Refused::Failed(chime_shared::tls::describe_error(&e.without_url())))?;
            let status = r.status();
            match status.as_u16() {
                200..=299 => Ok(()),
                408 | 429 => Err(Refused::Failed(format!("HTTP {status}"))),
                400..=499 => Err(Refused::Rejected(format!("HTTP {status}"))),
                _ => Err(Refused::Failed(format!("HTTP {status}"))),
            }
        };
        use backon::Retryable;
        let policy = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(500))
            .with_max_delay(Duration::from_secs(30))
            .with_max_times(6)
            .with_jitter();
        let notify = |e: &Refused, d: Duration| warn!(url = %shown, error = %e, queue = %n.queue, retry_in = ?d, "alert webhook failed");
        match send.retry(policy).when(|e| matches!(e, Refused::Failed(_))).notify(notify).await {
            Ok(()) => "sent",
            Err(Refused::Rejected(e)) => {
                warn!(url = %shown, error = %e, queue = %n.queue,
                    "alert webhook refused the notification; not retried (the log line above stands)");
                "rejected"
            }
            Err(Refused::Failed(e)) => {
                warn!(url = %shown, error = %e, queue = %n.queue, "alert webhook gave up; the log line above stands");
                "gave_up"
            }
        }
    }
}

/// Without the `webhook` feature: a configured webhook is reported once, alerts are logged.
#[cfg(not(feature = "webhook"))]
struct Webhook;

#[cfg(not(feature = "webhook"))]
impl Webhook {
    fn new(config: &ValidConfig) -> Option<Self> {
        if config.alerts.webhook.is_some() {
            warn!(
                "alerts.webhook is set, but this build of chime-scheduler has no `webhook` feature: alerts go to the log only"
            );
        }
        None
    }

    async fn send(&self, _: &Notification, _: &serde_json::Value) -> &'static str {
        "sent"
    }
}

/// The queues the monitor watches: the config's and those the workers' catalog adds (read at
/// each connection and every [`catalog::REFRESH`]).
struct Known {
    base: ValidConfig,
    config: ValidConfig,
    queues: Vec<String>,
    redis: Option<chime_shared::redis_conn::RedisConn>,
    read_at: Option<Instant>,
}

impl Known {
    fn new(config: &ValidConfig) -> Self {
        Self {
            base: config.clone(),
            config: config.clone(),
            queues: config.all_queues(),
            redis: chime_shared::redis_conn::RedisConn::new(&config.redis).ok(),
            read_at: None,
        }
    }

    /// Reads the catalog again; returns the queues it added.
    async fn refresh(&mut self) -> Vec<String> {
        self.read_at = Some(Instant::now());
        let Some(mut redis) = self.redis.clone() else { return Vec::new() };
        let names = Names::new(&self.base.prefix);
        let wait = self.base.redis.timeout + self.base.redis.timeout;
        let Ok(Ok(found)) = tokio::time::timeout(wait, catalog::read(&mut redis, &names)).await else {
            return Vec::new();
        };
        let Ok(merged) = found.merge(self.base.clone().into_config()).validated() else { return Vec::new() };
        let queues = merged.all_queues();
        let added: Vec<String> = queues.iter().filter(|q| !self.queues.contains(q)).cloned().collect();
        self.config = merged;
        self.queues = queues;
        added
    }

    async fn refresh_due(&mut self) -> Vec<String> {
        if self.read_at.is_some_and(|t| t.elapsed() < catalog::REFRESH) {
            return Vec::new();
        }
        self.refresh().await
    }
}

/// Polls DLQ depths and raises alerts until `token` is cancelled; reconnects as needed.
pub async fn run(config: ValidConfig, health: Health, token: CancellationToken) {
    let names = Names::new(&config.prefix);
    let mut known = Known::new(&config);
    let mut dispatch = Dispatch::new(&config);
    let mut alerts = Alerts::new(config.alerts.dlq_threshold, config.alerts.for_);
    health.set("amqp", false);
    'connect: while !token.is_cancelled() {
        let conn = match amqp::connect(&config.amqp, "chime-watch").await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "DLQ monitor cannot reach RabbitMQ");
                health.set("amqp", false);
                tokio::select! { _ = tokio::time::sleep(Duration::from_secs(2)) => continue, _ = token.cancelled() => break }
            }
        };
        known.refresh().await;
        if let Err(e) = topology::declare(&conn, &known.config, &known.queues).await {
            warn!(error = %e, "DLQ monitor cannot declare the topology");
        }
        health.set("amqp", true);
        let mut tick = tokio::time::interval(config.alerts.interval);
        loop {
            tokio::select! {
                _ = token.cancelled() => break 'connect,
                _ = tick.tick() => {}
            }
            // Queues the workers' catalog adds since (a worker of a new job type started).
            let new = known.refresh_due().await;
            if !new.is_empty()
                && let Err(e) = topology::declare(&conn, &known.config, &new).await
            {
                warn!(error = %e, "DLQ monitor cannot declare the topology; reconnecting");
                continue 'connect;
            }
            let queues = known.queues.clone();
            let config = known.config.clone();
            let (mut work_depths, mut dead_depths) = (Vec::new(), Vec::new());
            for q in &queues {
                let depth = match topology::depth(&conn, &names.dlq(q)).await {
                    Ok((d, _)) => d,
                    Err(e) => {
                        warn!(error = %e, queue = %q, "reading DLQ depth failed; reconnecting");
                        health.set("amqp", false);
                        continue 'connect;
                    }
                };
                metrics::gauge!(telemetry::DLQ_MESSAGES, "queue" => q.clone()).set(f64::from(depth));
                // Every priority level of the queue counts.
                let mut work = 0u32;
                for (route, _) in config.routes(q) {
                    if let Ok((d, _)) = topology::depth(&conn, &names.work_queue(&route)).await {
                        work = work.saturating_add(d);
                    }
                }
                metrics::gauge!(telemetry::QUEUE_MESSAGES, "queue" => q.clone()).set(f64::from(work));
                work_depths.push((q.clone(), work));
                dead_depths.push((q.clone(), depth));
                if let Some(n) = alerts.observe(q, depth, Instant::now(), Utc::now()) {
                    dispatch.send(n);
                }
            }
            // Circuit breakers: firing while one is not closed.
            if let Some(mut redis) = known.redis.clone() {
                let read = chime_shared::circuit::read_all(&mut redis, &names, &config);
                match tokio::time::timeout(Duration::from_secs(5), read).await {
                    Ok(Ok(circuits)) => {
                        for c in circuits {
                            let closed = c.status.state == "closed";
                            let detail = circuit_detail(&c);
                            if let Some(n) = alerts.observe_circuit(&c.name, closed, detail, Utc::now()) {
                                dispatch.send(n);
                            }
                        }
                    }
                    Ok(Err(e)) => warn!(error = %e, "cannot read the circuit breakers from redis"),
                    Err(_) => warn!("reading the circuit breakers from redis timed out"),
                }
                // Producers' spools: firing while one has held a job longer than
                // producer.spool_alert_after; resolved when it reports empty (its field goes).
                let read = chime_shared::spools::read(&mut redis, &names);
                if let Ok(Ok(reports)) = tokio::time::timeout(Duration::from_secs(5), read).await {
                    let now = Utc::now();
                    let mut seen = std::collections::BTreeSet::new();
                    for r in &reports {
                        let waited = r.oldest.and_then(|o| (now - o).to_std().ok()).unwrap_or_default();
                        let on = r.records > 0 && waited >= config.producer.spool_alert_after;
                        let detail = format!(
                            "{} job(s), {} bytes, the oldest spooled {}s ago (reported {})",
                            r.records,
                            r.bytes,
                            waited.as_secs(),
                            rfc3339(r.at)
                        );
                        seen.insert(r.field());
                        if let Some(n) = alerts.observe_spool(&r.field(), on, detail, now) {
                            dispatch.send(n);
                        }
                    }
                    for gone in alerts.firing_spools().into_iter().filter(|s| !seen.contains(s)) {
                        if let Some(n) = alerts.observe_spool(&gone, false, "empty".into(), now) {
                            dispatch.send(n);
                        }
                    }
                }
                let shed_queues: Vec<String> = config.worker.shed.keys().cloned().collect();
                let read = chime_shared::shed::read(&mut redis, &names, &shed_queues);
                if let Ok(Ok(flags)) = tokio::time::timeout(Duration::from_secs(5), read).await {
                    for (q, flag) in shed_queues.iter().zip(flags) {
                        if let Some(n) = alerts.observe_shedding(q, flag, Utc::now()) {
                            dispatch.send(n);
                        }
                    }
                }
            }
            // For the dashboard's charts: the depths of this minute (the last reading stands).
            if let Some(mut redis) = known.redis.clone() {
                let minute = chime_shared::minutes::minute_of(Utc::now());
                let write =
                    chime_shared::minutes::set_depths(&mut redis, &names, minute, &work_depths, &dead_depths);
                if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(5), write).await {
                    tracing::debug!(error = %e, "queue depths not recorded for the charts");
                }
            }
        }
    }
    dispatch.finish().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fires_once_after_the_hold_and_resolves_once() {
        let mut a = Alerts::new(2, Duration::from_secs(60));
        let t0 = Instant::now();
        let w = Utc::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(a.observe("q", 1, at(0), w), None);
        assert_eq!(a.observe("q", 2, at(10), w), None);
        assert_eq!(a.observe("q", 5, at(30), w), None, "not yet held for 60s");
        let f = a.observe("q", 5, at(70), w).unwrap();
        assert!(f.firing);
        assert_eq!(a.observe("q", 9, at(80), w), None, "fires once");
        let r = a.observe("q", 0, at(90), w).unwrap();
        assert!(!r.firing);
        assert_eq!(a.observe("q", 0, at(100), w), None, "resolves once");
        // A dip below the threshold restarts the hold.
        assert_eq!(a.observe("q", 3, at(110), w), None);
        assert_eq!(a.observe("q", 1, at(120), w), None);
        assert_eq!(a.observe("q", 3, at(130), w), None);
        assert_eq!(a.observe("q", 3, at(185), w), None);
        assert!(a.observe("q", 3, at(191), w).unwrap().firing);
    }

    #[test]
    fn webhook_body_is_alertmanager_shaped() {
        let n = Notification {
            queue: "default".into(),
            firing: true,
            depth: 3,
            starts_at: Utc::now(),
            ends_at: None,
            about: None,
        };
        let b = webhook_body(&n, &Names::new("chime"), 1);
        assert_eq!(b["version"], "4");
        assert_eq!(b["status"], "firing");
        assert_eq!(b["alerts"][0]["labels"]["dlq"], "chime.dlq.default");
        assert_eq!(b["alerts"][0]["endsAt"], "0001-01-01T00:00:00Z");
    }

    #[test]
    fn a_circuit_fires_when_it_leaves_closed_and_resolves_when_back() {
        let mut a = Alerts::new(1, Duration::from_secs(60));
        let w = Utc::now();
        assert_eq!(a.observe_circuit("stripe", true, "closed".into(), w), None);
        let f = a.observe_circuit("stripe", false, "open: 5 failed of 8".into(), w).unwrap();
        assert!(f.firing && f.about.is_some());
        assert_eq!(a.observe_circuit("stripe", false, "half_open".into(), w), None, "fires once");
        let r = a.observe_circuit("stripe", true, "closed".into(), w).unwrap();
        assert!(!r.firing);
        let b = webhook_body(&f, &Names::new("chime"), 1);
        assert_eq!(b["alerts"][0]["labels"]["alertname"], "ChimeCircuitOpen");
        assert_eq!(b["alerts"][0]["labels"]["circuit"], "stripe");
        // A queue named like the circuit keeps its own alerts.
        assert!(a.observe("stripe", 5, Instant::now(), w).is_none());
        let s = a.observe_shedding("stripe", Some("depth 10 >= max_depth 10".into()), w).unwrap();
        assert!(s.firing);
        assert_eq!(
            webhook_body(&s, &Names::new("chime"), 1)["alerts"][0]["labels"]["alertname"],
            "ChimeShedding"
        );
        assert_eq!(a.observe_shedding("stripe", Some("still".into()), w), None);
        assert!(!a.observe_shedding("stripe", None, w).unwrap().firing);
    }
}
