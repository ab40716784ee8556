//! `/`: queues with their depths, DLQs and pause state; the ticker's leader; the workers.

use axum::extract::{Query, State};
use axum::response::Response;
use chime_shared::control::{self, Target};
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use std::sync::Arc;

use super::{Notice, dlq_broker_queue, dlq_cell, dlq_sources, failed, frame, ok_page, paused_cell};
use crate::cli::web::Web;
use crate::cli::web::html::{ago, button, t, table};
use crate::dlq::UNROUTABLE;

pub async fn overview(State(web): State<Arc<Web>>, Query(notice): Query<Notice>) -> Response {
    match body(&web).await {
        Ok(body) => ok_page(&web, &notice, "Overview", "Overview", Some(10), body),
        Err(e) => failed(&web, "Overview", e),
    }
}

async fn body(web: &Web) -> anyhow::Result<Markup> {
    let now = Utc::now();
    let queues = web.config.all_queues();
    let mut broker: Vec<String> = queues.iter().map(|q| web.names.work_queue(q)).collect();
    broker.extend(dlq_sources(web).iter().map(|s| dlq_broker_queue(web, s)));
    let delay_queues: Vec<String> = (0..chime_shared::delay::LEVELS)
        .map(|l| chime_shared::names::delay_level(web.config.amqp.queue_type, l))
        .collect();
    broker.extend(delay_queues.iter().cloned());
    let depths = web.depths(&broker).await;
    let mut conn = web.reader.connection();
    let flags = control::flags(&mut conn, &web.names, Target::Queue, &queues).await?;
    let shedding = chime_shared::shed::read(&mut conn, &web.names, &queues).await?;
    let workers = control::workers(&mut conn, &web.names).await?;
    let leader = web.ticker.leader().await?;
    let gone = control::gone(&mut conn, &web.names).await?;
    let this_minute = chime_shared::minutes::minute_of(now);
    let minutes =
        chime_shared::minutes::read(&mut conn, &web.names, this_minute - CHART_MINUTES + 1, this_minute)
            .await?;
    let circuits = chime_shared::circuit::read_all(&mut conn, &web.names, &web.config).await?;
    let threshold = web.config.alerts.dlq_threshold;
    let f = frame(web, &Notice::default());

    let mut rows = Vec::new();
    for (i, q) in queues.iter().enumerate() {
        let running: usize = workers.iter().map(|w| w.running.iter().filter(|r| r.queue == *q).count()).sum();
        let dlq = depths[queues.len() + i].map(|d| d.0);
        let (ready, consumers) = match depths[i] {
            Some((r, c)) => (r.to_string(), c.to_string()),
            None => ("?".into(), "?".into()),
        };
        let rate = web.rate(q).map(|r| format!("{r:.1}/s")).unwrap_or_else(|| "-".into());
        let (label, op) = if flags[i].is_some() { ("Resume", "resume") } else { ("Pause", "pause") };
        rows.push(vec![
            html! { (t(q)) },
            html! { (ready) },
            html! { (consumers) },
            html! { (running) },
            html! { (rate) },
            dlq_cell(q, dlq, threshold),
            html! {
                (paused_cell(&flags[i], now))
                @if let Some(why) = shedding.get(i).and_then(|s| s.as_ref()) {
                    " " span.warn title=(why) { "shedding" }
                }
            },
            button(&f, "/actions/queue", label, "/", &[("queue", q), ("op", op)], false),
        ]);
    }
    let unroutable = depths[2 * queues.len()].map(|d| d.0).unwrap_or(0);
    let delayed: u64 =
        depths[2 * queues.len() + 1..].iter().map(|d| u64::from(d.map(|d| d.0).unwrap_or(0))).sum();
    Ok(html! {
        h2 { "Queues" }
        (table(
            "queues",
            &["Queue", "Ready", "Consumers", "Running", "Finished", "DLQ", "State", ""],
            &["Ready", "Consumers", "Running", "Finished", "DLQ"],
            &rows,
        ))
        p {
            "Waiting in the delay chain (retries and " code { "--delay" } ", every prefix on this virtual host): "
            (delayed) ". Unroutable delayed messages: " (dlq_cell(UNROUTABLE, Some(unroutable), threshold)) "."
        }
        h2 { "Ticker" }
        @match leader {
            Some(l) => p #leader {
                "Leader " code { (t(&l.id)) } ", lease held "
                (format!("{:.1}", l.lease_age_ms as f64 / 1000.0)) "s, expires in "
                (format!("{:.1}", l.expires_in_ms as f64 / 1000.0)) "s."
            },
            None => p #leader .warn { "No ticker holds the lease: scheduled jobs are not being published." },
        }
        (circuits_table(&f, &circuits))
        h2 { "Last " (CHART_MINUTES / 60) " hours" }
        (crate::cli::web::charts::overview(&minutes))
        p.muted {
            "Per minute, from every worker's totals and the depths the DLQ monitor (the leader ticker, or "
            code { "chime watch" } ") reads; kept a day in Redis."
        }
        h2 { "Workers" }
        (workers_table(&workers, now))
        (gone_table(&gone, now))
    })
}

/// The circuit breakers of the config (none: nothing shown).
fn circuits_table(f: &super::Frame, circuits: &[chime_shared::circuit::CircuitView]) -> Markup {
    if circuits.is_empty() {
        return html! {};
    }
    let now_ms = u64::try_from(Utc::now().timestamp_millis()).unwrap_or(0);
    let rows: Vec<Vec<Markup>> = circuits
        .iter()
        .map(|c| {
            let s = &c.status;
            let state = html! {
                @match (s.state, s.forced) {
                    (_, true) => span.warn { "open (held by an operator)" },
                    ("open", _) => span.warn {
                        "open" @if let Some(u) = s.until_ms { ", probes in " (u.saturating_sub(now_ms).div_ceil(1000)) "s" }
                    },
                    ("half_open", _) => span.warn { "half-open, " (s.probes_out) " probe(s) out" },
                    (st, _) => (st),
                }
            };
            let window = match (s.state, s.tripped.as_deref().and_then(|t| t.split_once(' '))) {
                ("closed", _) => format!("{} failed of {}", s.failed, s.succeeded + s.failed),
                (_, Some((failed, runs))) => format!("opened at {failed} failed of {runs}"),
                _ => "-".into(),
            };
            let (label, op) = if s.state == "closed" { ("Open", "open") } else { ("Close", "close") };
            vec![
                html! { (t(&c.name)) },
                state,
                html! { (window) },
                html! { (t(&c.jobs.join(", "))) },
                html! { (t(&c.settings)) },
                button(f, "/actions/circuit", label, "/", &[("circuit", &c.name), ("op", op)], op == "open"),
            ]
        })
        .collect();
    html! {
        h2 { "Circuit breakers" }
        (table("circuits", &["Circuit", "State", "Window", "Jobs", "Settings", ""], &[], &rows))
    }
}

/// The charts' window.
const CHART_MINUTES: i64 = 180;

/// Workers seen in the last day that no longer beat.
fn gone_table(gone: &[control::WorkerBeat], now: DateTime<Utc>) -> Markup {
    if gone.is_empty() {
        return html! {};
    }
    let rows: Vec<Vec<Markup>> = gone
        .iter()
        .map(|w| {
            vec![
                html! { code { (t(&w.id)) } },
                html! {
                    @if w.stopped { span.muted { "stopped" } } @else { span.warn { "no heartbeat (died?)" } }
                },
                html! { (ago(w.seen_at, now)) },
                html! { (t(&w.queues.join(", "))) },
                html! { (w.settled[0]) },
                html! { (w.settled[1]) },
                html! { (w.settled[2]) },
                html! { (w.running.len()) },
            ]
        })
        .collect();
    html! {
        h2 { "Workers gone (last 24 h)" }
        (table(
            "gone-workers",
            &["Worker", "State", "Last heartbeat", "Queues", "Succeeded", "Retried", "Dead-lettered", "Running then"],
            &["Succeeded", "Retried", "Dead-lettered", "Running then"],
            &rows,
        ))
    }
}

/// The live workers, from their heartbeats.
pub(super) fn workers_table(workers: &[control::WorkerBeat], now: DateTime<Utc>) -> Markup {
    if workers.is_empty() {
        return html! {
            p.warn #no-workers {
                "No live workers (none wrote a heartbeat in the last " (control::BEAT_TTL.as_secs()) "s)."
            }
        };
    }
    let rows: Vec<Vec<Markup>> = workers
        .iter()
        .map(|w| {
            vec![
                html! { code { (t(&w.id)) } },
                html! { (t(&w.version)) },
                html! { (t(&w.queues.join(", "))) },
                html! { @if w.paused.is_empty() { "-" } @else { (t(&w.paused.join(", "))) } },
                html! { (w.concurrency) },
                html! { (w.running.len()) },
                html! { (w.settled[0]) },
                html! { (w.settled[1]) },
                html! { (w.settled[2]) },
                html! { (ago(w.started_at, now).replace(" ago", "")) },
                html! { (ago(w.seen_at, now)) },
            ]
        })
        .collect();
    table(
        "workers",
        &[
            "Worker",
            "Version",
            "Queues",
            "Paused",
            "Concurrency",
            "Running",
            "Succeeded",
            "Retried",
            "Dead-lettered",
            "Up",
            "Seen",
        ],
        &["Concurrency", "Running", "Succeeded", "Retried", "Dead-lettered"],
        &rows,
    )
}
