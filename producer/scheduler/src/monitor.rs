//! DLQ depth monitor and alerts.
//!
//! Every `alerts.interval` it reads each DLQ's depth with a passive declare (no plugin) and
//! sets `chime_dlq_messages{queue}` (and `chime_queue_messages{queue}` for work queues). A DLQ
//! at or above `alerts.dlq_threshold` for `alerts.for` raises one `firing` notification; when
//! it drops below, one `resolved`. Sinks: the log, and optionally a webhook that receives an
//! Alertmanager-compatible (webhook v4) JSON body, retried with backoff; notifications are
//! sent one at a time, in order, so `resolved` never overtakes its `firing`.

use chime_shared::amqp;
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

/// One state change of one DLQ's alert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub queue: String,
    pub firing: bool,
    pub depth: u32,
    pub starts_at: DateTime<Utc>,
    pub ends_at: Option<DateTime<Utc>>,
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
            })
        }
    }
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// The Alertmanager webhook (v4) body for one notification.
pub fn webhook_body(n: &Notification, names: &Names, threshold: u64) -> serde_json::Value {
    let status = if n.firing { "firing" } else { "resolved" };
    let labels = json!({
        "alertname": "ChimeDeadLetters",
        "severity": "warning",
        "prefix": names.prefix(),
        "queue": n.queue,
        "dlq": names.dlq(&n.queue),
    });
    let annotations = json!({
        "summary": format!("dead letters in {}", names.dlq(&n.queue)),
        "description": format!("{} message(s) in {} (threshold {threshold}); inspect with `chime dlq list --queue {}`",
            n.depth, names.dlq(&n.queue), n.queue),
    });
    json!({
        "version": "4",
        "groupKey": format!("{{}}:{{alertname=\"ChimeDeadLetters\",queue=\"{}\"}}", n.queue),
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "chime",
        "groupLabels": {"alertname": "ChimeDeadLetters", "queue": n.queue},
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
            "fingerprint": format!("{:016x}", fingerprint(&names.dlq(&n.queue))),
        }],
    })
}

fn fingerprint(s: &str) -> u64 {
    // FNV-1a: stable across runs and processes.
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Sends notifications in order: log, then the webhook (when this build has one).
async fn sender(mut rx: mpsc::UnboundedReceiver<Notification>, config: ValidConfig) {
    let names = Names::new(&config.prefix);
    let webhook = Webhook::new(&config);
    while let Some(n) = rx.recv().await {
        if n.firing {
            warn!(queue = %n.queue, depth = n.depth, "DLQ alert firing");
        } else {
            info!(queue = %n.queue, depth = n.depth, "DLQ alert resolved");
        }
        if let Some(w) = &webhook {
            w.send(&n, &webhook_body(&n, &names, config.alerts.dlq_threshold)).await;
        }
    }
}

/// The alert webhook (`alerts.webhook`), retried with backoff.
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

    async fn send(&self, n: &Notification, body: &serde_json::Value) {
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
                .map_err(reqwest::Error::without_url)?;
            r.error_for_status().map(|_| ()).map_err(reqwest::Error::without_url)
        };
        use backon::Retryable;
        let policy = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(500))
            .with_max_delay(Duration::from_secs(30))
            .with_max_times(8)
            .with_jitter();
        let notify = |e: &reqwest::Error, d: Duration| {
            let error = chime_shared::tls::describe_error(e);
            warn!(url = %shown, %error, retry_in = ?d, "alert webhook failed")
        };
        if let Err(e) = send.retry(policy).notify(notify).await {
            let error = chime_shared::tls::describe_error(&e);
            warn!(url = %shown, %error, queue = %n.queue, "alert webhook gave up; the log line above stands");
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

    async fn send(&self, _: &Notification, _: &serde_json::Value) {}
}

/// Polls DLQ depths and raises alerts until `token` is cancelled; reconnects as needed.
pub async fn run(config: ValidConfig, health: Health, token: CancellationToken) {
    let names = Names::new(&config.prefix);
    let queues = config.all_queues();
    let (tx, rx) = mpsc::unbounded_channel();
    let sending = tokio::spawn(sender(rx, config.clone()));
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
        if let Err(e) = topology::declare(&conn, &config, &queues).await {
            warn!(error = %e, "DLQ monitor cannot declare the topology");
        }
        health.set("amqp", true);
        let mut tick = tokio::time::interval(config.alerts.interval);
        loop {
            tokio::select! {
                _ = token.cancelled() => break 'connect,
                _ = tick.tick() => {}
            }
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
                if let Some(n) = alerts.observe(q, depth, Instant::now(), Utc::now()) {
                    let _ = tx.send(n);
                }
            }
        }
    }
    drop(tx);
    // Let queued notifications go out (bounded), then stop.
    let _ = tokio::time::timeout(Duration::from_secs(10), sending).await;
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
        };
        let b = webhook_body(&n, &Names::new("chime"), 1);
        assert_eq!(b["version"], "4");
        assert_eq!(b["status"], "firing");
        assert_eq!(b["alerts"][0]["labels"]["dlq"], "chime.dlq.default");
        assert_eq!(b["alerts"][0]["endsAt"], "0001-01-01T00:00:00Z");
    }
}
