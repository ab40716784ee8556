//! The dashboard's pages and actions.

use axum::Form;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use chime_shared::control::{self, PauseFlag, Target};
use chime_shared::history::{KeyRecord, Outcome, RunEvent};
use chrono::{DateTime, Utc};
use std::collections::HashMap;
use std::fmt::Write;
use std::sync::Arc;
use uuid::Uuid;

use super::Web;
use super::dlq_cache::{Snapshot, View};
use super::html::{Frame, ago, at, button, cut, enc, esc, page, table};
use crate::dlq::{DeadLetter, UNROUTABLE};
use chime_scheduler::ticker::scheduled_jobs;

/// Dead letters per DLQ page.
const DLQ_PAGE: usize = 100;
/// Runs per history page.
const HISTORY_PAGE: usize = 100;

/// The notice an action left for the page it redirected to: its id in [`Web::notices`].
#[derive(Debug, Default, serde::Deserialize)]
pub struct Notice {
    notice: Option<String>,
}

fn frame<'a>(web: &'a Web, notice: &Notice) -> Frame<'a> {
    Frame {
        prefix: &web.config.prefix,
        read_only: web.read_only,
        csrf: &web.csrf,
        notice: notice.notice.as_deref().and_then(|id| web.notices.get(id)),
    }
}

/// A page that could not be built: what failed, as a page (500).
fn failed(web: &Web, title: &str, error: impl std::fmt::Display) -> Response {
    let notice = Notice::default();
    let body =
        format!("<p class=\"warn\">{}</p>", esc(&chime_shared::redact::redact_text(&error.to_string())));
    (StatusCode::INTERNAL_SERVER_ERROR, Html(page(&frame(web, &notice), title, "", None, &body)))
        .into_response()
}

fn not_found(web: &Web, what: &str) -> Response {
    let notice = Notice::default();
    let body = format!("<p class=\"warn\">{}</p>", esc(what));
    (StatusCode::NOT_FOUND, Html(page(&frame(web, &notice), "Not found", "", None, &body))).into_response()
}

fn paused_cell(flag: &Option<PauseFlag>, now: DateTime<Utc>) -> String {
    match flag {
        Some(f) => format!("<span class=\"warn\">paused</span> {} by {}", ago(f.at, now), esc(&f.by)),
        None => "<span class=\"ok\">active</span>".into(),
    }
}

fn key_link(key: &str) -> String {
    if key.is_empty() {
        "-".into()
    } else {
        format!("<a href=\"/keys/{}\"><code>{}</code></a>", enc(key), esc(key))
    }
}

/// The DLQ source names: each queue's DLQ, and the prefix's unroutable delayed messages.
fn dlq_sources(web: &Web) -> Vec<String> {
    let mut all = web.config.all_queues();
    all.push(UNROUTABLE.to_string());
    all
}

fn dlq_broker_queue(web: &Web, source: &str) -> String {
    if source == UNROUTABLE { web.names.unroutable_queue() } else { web.names.dlq(source) }
}

// ---------------------------------------------------------------------------------------------
// Overview

pub async fn overview(State(web): State<Arc<Web>>, Query(notice): Query<Notice>) -> Response {
    match overview_body(&web).await {
        Ok(body) => {
            Html(page(&frame(&web, &notice), "Overview", "Overview", Some(10), &body)).into_response()
        }
        Err(e) => failed(&web, "Overview", e),
    }
}

async fn overview_body(web: &Web) -> anyhow::Result<String> {
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
    let workers = control::workers(&mut conn, &web.names).await?;
    let leader = web.ticker.leader().await?;
    let threshold = web.config.alerts.dlq_threshold;

    let mut body = String::new();
    body.push_str("<h2>Queues</h2>");
    let mut rows = Vec::new();
    for (i, q) in queues.iter().enumerate() {
        let running: usize = workers.iter().map(|w| w.running.iter().filter(|r| r.queue == *q).count()).sum();
        let dlq = depths[queues.len() + i].map(|d| d.0);
        let (ready, consumers) = match depths[i] {
            Some((r, c)) => (r.to_string(), c.to_string()),
            None => ("?".into(), "?".into()),
        };
        let rate = web.rate(q).map(|r| format!("{r:.1}/s")).unwrap_or_else(|| "-".into());
        let flag = &flags[i];
        let back = "/";
        let action = if flag.is_some() {
            button(
                &frame(web, &Notice::default()),
                "/actions/queue",
                "Resume",
                back,
                &[("queue", q), ("op", "resume")],
                false,
            )
        } else {
            button(
                &frame(web, &Notice::default()),
                "/actions/queue",
                "Pause",
                back,
                &[("queue", q), ("op", "pause")],
                false,
            )
        };
        rows.push(vec![
            esc(q),
            ready,
            consumers,
            running.to_string(),
            rate,
            dlq_cell(web, q, dlq, threshold),
            paused_cell(flag, now),
            action,
        ]);
    }
    body.push_str(&table(
        "queues",
        &["Queue", "Ready", "Consumers", "Running", "Finished", "DLQ", "State", ""],
        &["Ready", "Consumers", "Running", "Finished", "DLQ"],
        &rows,
    ));
    let unroutable = depths[2 * queues.len()].map(|d| d.0).unwrap_or(0);
    let delayed: u64 =
        depths[2 * queues.len() + 1..].iter().map(|d| u64::from(d.map(|d| d.0).unwrap_or(0))).sum();
    let _ = write!(
        body,
        "<p>Waiting in the delay chain (retries and <code>--delay</code>, every prefix on this virtual host): {delayed}. \
         Unroutable delayed messages: {}.</p>",
        dlq_cell(web, UNROUTABLE, Some(unroutable), threshold)
    );
    body.push_str("<h2>Ticker</h2>");
    match leader {
        Some(l) => {
            let _ = write!(
                body,
                "<p id=\"leader\">Leader <code>{}</code>, lease held {:.1}s, expires in {:.1}s.</p>",
                esc(&l.id),
                l.lease_age_ms as f64 / 1000.0,
                l.expires_in_ms as f64 / 1000.0
            );
        }
        None => body.push_str("<p id=\"leader\" class=\"warn\">No ticker holds the lease: scheduled jobs are not being published.</p>"),
    }
    body.push_str("<h2>Workers</h2>");
    body.push_str(&workers_table(&workers, now));
    Ok(body)
}

fn dlq_cell(_web: &Web, source: &str, depth: Option<u32>, threshold: u64) -> String {
    let Some(d) = depth else { return "?".into() };
    let link = format!("<a href=\"/dlq?queue={}\">{d}</a>", enc(source));
    if u64::from(d) >= threshold {
        format!("{link} <span class=\"warn\" title=\"alerts.dlq_threshold = {threshold}\">alert</span>")
    } else {
        link
    }
}

fn workers_table(workers: &[control::WorkerBeat], now: DateTime<Utc>) -> String {
    if workers.is_empty() {
        return format!(
            "<p class=\"warn\" id=\"no-workers\">No live workers (none wrote a heartbeat in the last {}s).</p>",
            control::BEAT_TTL.as_secs()
        );
    }
    let rows: Vec<Vec<String>> = workers
        .iter()
        .map(|w| {
            vec![
                format!("<code>{}</code>", esc(&w.id)),
                esc(&w.version),
                esc(&w.queues.join(", ")),
                if w.paused.is_empty() { "-".into() } else { esc(&w.paused.join(", ")) },
                w.concurrency.to_string(),
                w.running.len().to_string(),
                w.settled[0].to_string(),
                ago(w.started_at, now).replace(" ago", ""),
                ago(w.seen_at, now),
            ]
        })
        .collect();
    table(
        "workers",
        &["Worker", "Version", "Queues", "Paused", "Concurrency", "Running", "Succeeded", "Up", "Seen"],
        &["Concurrency", "Running", "Succeeded"],
        &rows,
    )
}

// ---------------------------------------------------------------------------------------------
// Running

pub async fn running(State(web): State<Arc<Web>>, Query(notice): Query<Notice>) -> Response {
    let mut conn = web.reader.connection();
    let workers = match control::workers(&mut conn, &web.names).await {
        Ok(w) => w,
        Err(e) => return failed(&web, "Running", e),
    };
    let now = Utc::now();
    let mut rows = Vec::new();
    for w in &workers {
        for r in &w.running {
            let secs = (now - r.started_at).num_milliseconds().max(0) as f64 / 1000.0;
            rows.push(vec![
                esc(&r.job),
                key_link(&r.key),
                esc(&r.queue),
                r.attempt.to_string(),
                format!("{} ({secs:.1}s)", at(r.started_at)),
                format!("<code>{}</code>", esc(&w.id)),
            ]);
        }
    }
    let mut body = String::new();
    let _ = write!(
        body,
        "<p>{} job(s) running on {} worker(s), from their heartbeats (every {}s).</p>",
        rows.len(),
        workers.len(),
        control::BEAT_EVERY.as_secs()
    );
    if !rows.is_empty() {
        body.push_str(&table(
            "running",
            &["Job", "Key", "Queue", "Attempt", "Started (UTC)", "Worker"],
            &["Attempt"],
            &rows,
        ));
    }
    body.push_str("<h2>Workers</h2>");
    body.push_str(&workers_table(&workers, now));
    Html(page(&frame(&web, &notice), "Running", "Running", Some(5), &body)).into_response()
}

// ---------------------------------------------------------------------------------------------
// Schedules

pub async fn schedules(State(web): State<Arc<Web>>, Query(notice): Query<Notice>) -> Response {
    match schedules_body(&web).await {
        Ok(body) => Html(page(&frame(&web, &notice), "Schedules", "Schedules", None, &body)).into_response(),
        Err(e) => failed(&web, "Schedules", e),
    }
}

async fn schedules_body(web: &Web) -> anyhow::Result<String> {
    let jobs = scheduled_jobs(&web.config).map_err(|(j, e)| anyhow::anyhow!("job {j}: {e}"))?;
    if jobs.is_empty() {
        return Ok("<p>No job of this config has a schedule.</p>".into());
    }
    let now = Utc::now();
    let names: Vec<String> = jobs.iter().map(|j| j.name.clone()).collect();
    let mut conn = web.reader.connection();
    let flags = control::flags(&mut conn, &web.names, Target::Schedule, &names).await?;
    let marks = web.ticker.watermarks().await?;
    let counts = web.ticker.counts().await?;
    let last: Vec<Option<DateTime<Utc>>> =
        jobs.iter().map(|j| marks.get(&j.name).and_then(|s| DateTime::from_timestamp(*s, 0))).collect();
    let keys: Vec<String> = jobs
        .iter()
        .zip(&last)
        .map(|(j, l)| {
            l.map(|l| chime_shared::envelope::scheduled_key(&j.name, l).to_string()).unwrap_or_default()
        })
        .collect();
    let states = web.reader.states(&keys).await?;
    let f = Frame { prefix: &web.config.prefix, read_only: web.read_only, csrf: &web.csrf, notice: None };
    let mut rows = Vec::new();
    for (i, j) in jobs.iter().enumerate() {
        let n = counts.get(&j.name).copied().unwrap_or_default();
        let next = j.schedule.next_after(now);
        let outcome = match (&last[i], &states[i]) {
            (None, _) => "-".to_string(),
            (Some(_), Some((state, _))) => format!("{} {}", esc(state.as_str()), key_link(&keys[i])),
            (Some(_), None) => format!("<span class=\"muted\">no record</span> {}", key_link(&keys[i])),
        };
        let toggle = if flags[i].is_some() {
            button(
                &f,
                "/actions/schedule",
                "Resume",
                "/schedules",
                &[("job", &j.name), ("op", "resume")],
                false,
            )
        } else {
            button(
                &f,
                "/actions/schedule",
                "Pause",
                "/schedules",
                &[("job", &j.name), ("op", "pause")],
                false,
            )
        };
        let run = button(
            &f,
            "/actions/schedule",
            "Run now",
            "/schedules",
            &[("job", &j.name), ("op", "run")],
            false,
        );
        rows.push(vec![
            format!("<a href=\"/history?job={}\">{}</a>", enc(&j.name), esc(&j.name)),
            format!("<code>{}</code> {}", esc(j.schedule.expr()), esc(j.schedule.zone().name())),
            esc(&j.queue),
            next.map(at).unwrap_or_else(|| "-".into()),
            last[i].map(at).unwrap_or_else(|| "-".into()),
            outcome,
            n.missed.to_string(),
            n.paused.to_string(),
            n.overlapped.to_string(),
            paused_cell(&flags[i], now),
            format!("{toggle} {run}"),
        ]);
    }
    Ok(table(
        "schedules",
        &[
            "Job",
            "Schedule",
            "Queue",
            "Next slot (UTC)",
            "Last slot (UTC)",
            "Last outcome",
            "Missed",
            "Paused slots",
            "Overlapped",
            "State",
            "",
        ],
        &["Missed", "Paused slots", "Overlapped"],
        &rows,
    ) + "<p class=\"muted\">Resuming here does not catch paused slots up; \
        <code>chime resume schedule JOB --catch-up</code> does.</p>")
}

// ---------------------------------------------------------------------------------------------
// History

#[derive(Debug, Default, serde::Deserialize)]
pub struct HistoryForm {
    job: Option<String>,
    key: Option<String>,
    queue: Option<String>,
    outcome: Option<String>,
    since: Option<String>,
    before: Option<String>,
    notice: Option<String>,
}

fn nonempty(v: &Option<String>) -> Option<String> {
    v.as_deref().map(str::trim).filter(|s| !s.is_empty()).map(str::to_string)
}

pub async fn history(State(web): State<Arc<Web>>, Query(form): Query<HistoryForm>) -> Response {
    let notice = Notice { notice: form.notice.clone() };
    let args = super::super::history::HistoryArgs {
        job: nonempty(&form.job),
        key: nonempty(&form.key),
        queue: nonempty(&form.queue),
        outcome: nonempty(&form.outcome),
        since: nonempty(&form.since),
        before: nonempty(&form.before),
        limit: HISTORY_PAGE,
        json: false,
    };
    let mut body = history_form(&web, &form);
    match super::super::history::query(&args) {
        Err(f) => {
            let _ = write!(body, "<p class=\"warn\">{}</p>", esc(&f.error.to_string()));
        }
        Ok(q) => match web.reader.search(&web.config.all_queues(), &q).await {
            Err(e) => return failed(&web, "History", e),
            Ok(found) => {
                if found.events.is_empty() {
                    body.push_str("<p id=\"no-runs\">No runs found.</p>");
                } else {
                    body.push_str(&runs_table("runs", &found.events));
                }
                let older = found.truncated.clone().or_else(|| {
                    (found.events.len() == HISTORY_PAGE)
                        .then(|| found.events.last().and_then(|e| e.entry.clone()))
                        .flatten()
                });
                if let Some(entry) = older {
                    let mut link = String::from("/history?");
                    for (k, v) in [
                        ("job", &args.job),
                        ("queue", &args.queue),
                        ("outcome", &args.outcome),
                        ("since", &args.since),
                    ] {
                        if let Some(v) = v {
                            let _ = write!(link, "{k}={}&", enc(v));
                        }
                    }
                    let _ = write!(link, "before={}", enc(&entry));
                    let scanned = if found.truncated.is_some() {
                        format!(" (searched {} entries)", found.scanned)
                    } else {
                        String::new()
                    };
                    let _ = write!(
                        body,
                        "<p><a id=\"older\" href=\"{}\">Older runs</a>{scanned}</p>",
                        esc(&link)
                    );
                }
            }
        },
    }
    Html(page(&frame(&web, &notice), "History", "History", None, &body)).into_response()
}

fn history_form(web: &Web, form: &HistoryForm) -> String {
    let val = |v: &Option<String>| esc(v.as_deref().unwrap_or(""));
    let mut outcomes = String::from("<option value=\"\">any outcome</option>");
    for o in Outcome::ALL {
        let sel = if form.outcome.as_deref() == Some(o.as_str()) { " selected" } else { "" };
        let _ = write!(outcomes, "<option{sel}>{}</option>", o.as_str());
    }
    let mut queues = String::from("<option value=\"\">any queue</option>");
    for q in web.config.all_queues() {
        let sel = if form.queue.as_deref() == Some(q.as_str()) { " selected" } else { "" };
        let _ = write!(queues, "<option{sel}>{}</option>", esc(&q));
    }
    format!(
        "<form class=\"filter\" method=\"get\" action=\"/history\">\
         <input name=\"job\" placeholder=\"job\" value=\"{}\"><input name=\"key\" placeholder=\"key (UUID)\" size=\"38\" value=\"{}\">\
         <select name=\"queue\">{queues}</select><select name=\"outcome\">{outcomes}</select>\
         <input name=\"since\" placeholder=\"since (1h, 2d)\" size=\"10\" value=\"{}\"><button type=\"submit\">Search</button></form>",
        val(&form.job),
        val(&form.key),
        val(&form.since)
    )
}

fn runs_table(id: &str, events: &[RunEvent]) -> String {
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            let error = match (&e.reason, &e.error) {
                (Some(r), Some(err)) => format!("{r}: {err}"),
                (Some(r), None) => r.clone(),
                (None, Some(err)) => err.clone(),
                (None, None) => String::new(),
            };
            let outcome_class = match e.outcome {
                Outcome::Succeeded => "ok",
                Outcome::Retried | Outcome::Stopped => "muted",
                _ => "warn",
            };
            vec![
                at(e.finished_at),
                if e.job.is_empty() { "-".into() } else { esc(&e.job) },
                esc(&e.queue),
                format!("<span class=\"{outcome_class}\">{}</span>", e.outcome.as_str()),
                format!("{}/{}", e.attempt, e.max_attempts),
                e.duration_ms.map(|ms| format!("{:.3}s", ms as f64 / 1000.0)).unwrap_or_else(|| "-".into()),
                format!("<code>{}</code>", esc(&e.worker)),
                key_link(&e.key),
                format!("<span title=\"{}\">{}</span>", esc(&error), cut(&error, 80)),
            ]
        })
        .collect();
    table(
        id,
        &["Finished (UTC)", "Job", "Queue", "Outcome", "Attempt", "Took", "Worker", "Key", "Error"],
        &["Attempt", "Took"],
        &rows,
    )
}

// ---------------------------------------------------------------------------------------------
// One key

pub async fn key(
    State(web): State<Arc<Web>>,
    Path(key): Path<String>,
    Query(notice): Query<Notice>,
) -> Response {
    let Ok(key) = Uuid::parse_str(key.trim()) else {
        return not_found(&web, &format!("{key:?} is not an idempotency key (a UUID)"));
    };
    let record = match web.reader.record(&key.to_string()).await {
        Ok(r) => r,
        Err(e) => return failed(&web, "Key", e),
    };
    let mut body = match chime_shared::group::read(&mut web.reader.connection(), &web.names, key).await {
        Ok(Some(group)) => match group_html(&web, &group).await {
            Ok(html) => html,
            Err(e) => return failed(&web, "Key", e),
        },
        Ok(None) => String::new(),
        Err(e) => return failed(&web, "Key", e),
    };
    body.push_str(&record_html(&key, &record));
    body.push_str("<h2>Runs</h2>");
    if record.runs.is_empty() {
        body.push_str("<p>No runs recorded (history off, or the record expired).</p>");
    } else {
        let mut runs = record.runs.clone();
        runs.reverse();
        body.push_str(&runs_table("key-runs", &runs));
    }
    body.push_str("<h2>Dead letters</h2>");
    let mut found = Vec::new();
    let mut notes = Vec::new();
    for (source, view) in dlq_views(&web).await {
        match view {
            Ok(View::Ready { snapshot, refreshing }) => {
                found.extend(snapshot.letters.iter().filter(|d| d.key == Some(key)).cloned());
                if refreshing {
                    notes.push(format!("{} as of {}", esc(&source), at(snapshot.taken_at)));
                }
            }
            Ok(View::Reading) => notes.push(format!("{}: still reading", esc(&source))),
            Err(e) => notes.push(format!("{}: {}", esc(&source), esc(&e.to_string()))),
        }
    }
    if found.is_empty() {
        body.push_str("<p id=\"no-dead-letters\">None in any DLQ of this prefix.</p>");
    } else {
        body.push_str(&dead_letters_table(&found));
    }
    if !notes.is_empty() {
        let _ = write!(body, "<p class=\"muted\">{}</p>", notes.join("; "));
    }
    Html(page(&frame(&web, &notice), &format!("Key {key}"), "", None, &body)).into_response()
}

/// A fanned-out run (sharded or broadcast): its members, a missing one marked.
async fn group_html(web: &Web, group: &chime_shared::group::GroupRecord) -> redis::RedisResult<String> {
    use crate::cli::history::GroupView;
    let view = GroupView::read(&web.reader, group).await?;
    let mut out = String::from("<h2>Fan-out</h2><dl id=\"group\">");
    let _ = write!(out, "<dt>Job</dt><dd>{} on queue {}</dd>", esc(&group.job), esc(&group.queue));
    if let Some(slot) = group.slot {
        let _ = write!(out, "<dt>Slot</dt><dd>{} UTC</dd>", at(slot));
    }
    let _ = write!(out, "<dt>Fan-out</dt><dd>{}</dd>", esc(&GroupView::fan(group)));
    let complete = view.done == view.members.len();
    let _ = write!(
        out,
        "<dt>State</dt><dd><b id=\"group-state\" class=\"{}\">{}</b></dd></dl>",
        if complete { "ok" } else { "warn" },
        esc(&view.summary())
    );
    let rows: Vec<Vec<String>> = view
        .members
        .iter()
        .zip(&view.states)
        .zip(&view.records)
        .map(|((m, s), r)| {
            let (state, finished) = match s {
                Some((state, t)) => (esc(state.as_str()), t.map(at).unwrap_or_default()),
                None => ("<b class=\"warn missing\">missing: not started</b>".to_string(), String::new()),
            };
            let result = r
                .result
                .as_ref()
                .and_then(|r| r.value())
                .map(|v| cut(&v.to_string(), 60))
                .unwrap_or_default();
            vec![esc(&GroupView::label(m)), key_link(&m.key.to_string()), state, finished, result]
        })
        .collect();
    out.push_str(&table("members", &["Member", "Key", "State", "Finished (UTC)", "Result"], &[], &rows));
    out.push_str(
        "<p class=\"muted\">The key below is the whole run's: its members have keys of their own.</p>",
    );
    Ok(out)
}

fn record_html(key: &Uuid, r: &KeyRecord) -> String {
    let mut dl = format!("<dl id=\"record\"><dt>Key</dt><dd><code>{key}</code></dd>");
    match &r.state {
        None => dl.push_str(
            "<dt>Record</dt><dd>none: never claimed, or expired after <code>redis.done_retention</code> (or Redis lost it)</dd>",
        ),
        Some(state) => {
            let _ = write!(
                dl,
                "<dt>State</dt><dd><b id=\"state\">{}</b> — {}</dd>",
                esc(state.as_str()),
                esc(state.meaning())
            );
            let mut row = |k: &str, v: Option<String>| {
                if let Some(v) = v {
                    let _ = write!(dl, "<dt>{k}</dt><dd>{v}</dd>");
                }
            };
            row("Owner", r.owner.as_deref().map(|o| format!("<code>{}</code>", esc(o))));
            row("Fence", r.fence.map(|f| f.to_string()));
            row("Claimed", r.claimed_at.map(|t| at(t) + " UTC"));
            row("Finished", r.finished_at.map(|t| at(t) + " UTC"));
            row("Lease until", r.lease_until.map(|t| at(t) + " UTC"));
            row(
                "Expires",
                r.expires_in_ms.map(|ms| {
                    format!(
                        "in {}",
                        chime_shared::duration::format(std::time::Duration::from_secs(u64::try_from(ms / 1000).unwrap_or(0)))
                    )
                }),
            );
            row("Dying reason", r.dying_reason.as_deref().map(esc));
        }
    }
    dl.push_str("</dl>");
    dl
}

// ---------------------------------------------------------------------------------------------
// Dead letters

async fn dlq_views(web: &Arc<Web>) -> Vec<(String, Result<View, crate::dlq::DlqError>)> {
    let sources = dlq_sources(web);
    let broker: Vec<String> = sources.iter().map(|s| dlq_broker_queue(web, s)).collect();
    let depths = web.depths(&broker).await;
    let mut out = Vec::new();
    for (s, d) in sources.into_iter().zip(depths) {
        let view = web.dlq.view(&s, d.map(|d| d.0).unwrap_or(0)).await;
        out.push((s, view));
    }
    out
}

#[derive(Debug, Default, serde::Deserialize)]
pub struct DlqForm {
    queue: Option<String>,
    job: Option<String>,
    key: Option<String>,
    page: Option<usize>,
    notice: Option<String>,
}

pub async fn dlq(State(web): State<Arc<Web>>, Query(form): Query<DlqForm>) -> Response {
    let notice = Notice { notice: form.notice.clone() };
    let sources = dlq_sources(&web);
    let selected = nonempty(&form.queue);
    if let Some(q) = &selected
        && !sources.contains(q)
    {
        return not_found(&web, &format!("{q:?} is not a queue of this config"));
    }
    let broker: Vec<String> = sources.iter().map(|s| dlq_broker_queue(&web, s)).collect();
    let depths = web.depths(&broker).await;
    let threshold = web.config.alerts.dlq_threshold;
    let mut body = String::new();
    let rows: Vec<Vec<String>> = sources
        .iter()
        .zip(&depths)
        .map(|(s, d)| {
            vec![
                format!("<a href=\"/dlq?queue={}\">{}</a>", enc(s), esc(s)),
                dlq_cell(&web, s, d.map(|d| d.0), threshold),
            ]
        })
        .collect();
    body.push_str(&table("dlq-depths", &["DLQ of", "Depth"], &["Depth"], &rows));
    let Some(queue) = selected else {
        body.push_str("<p>Choose a queue to list its dead letters.</p>");
        return Html(page(&frame(&web, &notice), "Dead letters", "Dead letters", None, &body))
            .into_response();
    };
    let depth = sources.iter().position(|s| *s == queue).and_then(|i| depths[i]).map(|d| d.0).unwrap_or(0);
    let job = nonempty(&form.job);
    let key = nonempty(&form.key);
    let _ = write!(
        body,
        "<h2>{}</h2><form class=\"filter\" method=\"get\" action=\"/dlq\"><input type=\"hidden\" name=\"queue\" value=\"{}\">\
         <input name=\"job\" placeholder=\"job\" value=\"{}\"><input name=\"key\" placeholder=\"key (UUID)\" size=\"38\" value=\"{}\">\
         <button type=\"submit\">Filter</button></form>",
        esc(&queue),
        esc(&queue),
        esc(job.as_deref().unwrap_or("")),
        esc(key.as_deref().unwrap_or(""))
    );
    match web.dlq.view(&queue, depth).await {
        Err(e) => return failed(&web, "Dead letters", e),
        Ok(View::Reading) => {
            let _ = write!(
                body,
                "<p id=\"reading\">Reading {depth} dead letters (a pass over the whole DLQ; about a second per few thousand). \
                 This page reloads in 2 s.</p>"
            );
            let mut html = page(&frame(&web, &notice), "Dead letters", "Dead letters", Some(2), &body);
            html.shrink_to_fit();
            return Html(html).into_response();
        }
        Ok(View::Ready { snapshot, refreshing }) => {
            body.push_str(&dlq_listing(
                &queue,
                &snapshot,
                refreshing,
                job.as_deref(),
                key.as_deref(),
                form.page.unwrap_or(0),
            ));
        }
    }
    Html(page(&frame(&web, &notice), "Dead letters", "Dead letters", None, &body)).into_response()
}

fn dlq_listing(
    queue: &str,
    snapshot: &Snapshot,
    refreshing: bool,
    job: Option<&str>,
    key: Option<&str>,
    page_no: usize,
) -> String {
    let matching: Vec<&DeadLetter> = snapshot
        .letters
        .iter()
        .filter(|d| job.is_none_or(|j| d.job.as_deref() == Some(j)))
        .filter(|d| key.is_none_or(|k| d.key.is_some_and(|dk| dk.to_string() == k.trim())))
        .collect();
    let mut out = format!(
        "<p class=\"muted\" id=\"as-of\">{} dead letter(s), {} matching, as read at {} UTC{}.</p>",
        snapshot.total,
        matching.len(),
        at(snapshot.taken_at),
        if refreshing { "; a newer read is under way" } else { "" }
    );
    if snapshot.total > snapshot.letters.len() {
        let _ = write!(
            out,
            "<p class=\"warn\" id=\"kept\">Only the first {} are shown and searched here; \
             <code>chime dlq list --queue {}</code> lists them all.</p>",
            snapshot.letters.len(),
            esc(queue)
        );
    }
    let pages = matching.len().div_ceil(DLQ_PAGE).max(1);
    let page_no = page_no.min(pages - 1);
    let shown: Vec<DeadLetter> =
        matching.iter().skip(page_no * DLQ_PAGE).take(DLQ_PAGE).map(|d| (*d).clone()).collect();
    if shown.is_empty() {
        out.push_str("<p id=\"dlq-empty\">No dead letters.</p>");
    } else {
        out.push_str(&dead_letters_table(&shown));
    }
    if pages > 1 {
        let link = |p: usize| {
            let mut l = format!("/dlq?queue={}&page={p}", enc(queue));
            if let Some(j) = job {
                let _ = write!(l, "&job={}", enc(j));
            }
            if let Some(k) = key {
                let _ = write!(l, "&key={}", enc(k));
            }
            esc(&l)
        };
        let _ = write!(out, "<p>Page {} of {pages}", page_no + 1);
        if page_no > 0 {
            let _ = write!(out, " · <a href=\"{}\">newer</a>", link(page_no - 1));
        }
        if page_no + 1 < pages {
            let _ = write!(out, " · <a href=\"{}\" id=\"next-page\">older</a>", link(page_no + 1));
        }
        out.push_str("</p>");
    }
    out
}

fn dead_letters_table(letters: &[DeadLetter]) -> String {
    let rows: Vec<Vec<String>> = letters
        .iter()
        .map(|d| {
            vec![
                format!(
                    "<a class=\"dead-letter\" href=\"/dlq/{}/{}\"><code>{}</code></a>",
                    enc(&d.queue),
                    enc(&d.id),
                    esc(&d.id)
                ),
                esc(&d.queue),
                d.job.as_deref().map(esc).unwrap_or_else(|| "-".into()),
                d.key.map(|k| key_link(&k.to_string())).unwrap_or_else(|| "-".into()),
                esc(&d.reason),
                d.attempts.map(|a| a.to_string()).unwrap_or_else(|| "-".into()),
                d.failed_at.map(at).unwrap_or_else(|| "-".into()),
                d.error.as_deref().map(|e| cut(e, 80)).unwrap_or_default(),
            ]
        })
        .collect();
    table(
        "dead-letters",
        &["Id", "Queue", "Job", "Key", "Reason", "Attempts", "Failed (UTC)", "Error"],
        &["Attempts"],
        &rows,
    )
}

async fn find_dead_letter(
    web: &Arc<Web>,
    queue: &str,
    id: &str,
) -> Result<Option<(DeadLetter, Snapshot)>, Response> {
    if !dlq_sources(web).iter().any(|s| s == queue) {
        return Err(not_found(web, &format!("{queue:?} is not a queue of this config")));
    }
    let depth = web.depths(&[dlq_broker_queue(web, queue)]).await[0].map(|d| d.0).unwrap_or(0);
    match web.dlq.view(queue, depth).await {
        Err(e) => Err(failed(web, "Dead letter", e)),
        Ok(View::Reading) => Ok(None),
        Ok(View::Ready { snapshot, .. }) => {
            Ok(snapshot.letters.iter().find(|d| d.id == id).cloned().map(|d| (d, snapshot.clone())))
        }
    }
}

pub async fn dead_letter(
    State(web): State<Arc<Web>>,
    Path((queue, id)): Path<(String, String)>,
    Query(notice): Query<Notice>,
) -> Response {
    let (d, snapshot) = match find_dead_letter(&web, &queue, &id).await {
        Err(r) => return r,
        Ok(None) => {
            return not_found(
                &web,
                &format!("no dead letter {id} in the DLQ of {queue} (replayed or purged?)"),
            );
        }
        Ok(Some(found)) => found,
    };
    let f = frame(&web, &notice);
    let back = format!("/dlq?queue={}", enc(&queue));
    let mut body =
        format!("<dl id=\"dead-letter\"><dt>Id</dt><dd><code id=\"dead-id\">{}</code></dd>", esc(&d.id));
    let mut row = |k: &str, v: String| {
        let _ = write!(body, "<dt>{k}</dt><dd>{v}</dd>");
    };
    row("Queue", esc(&d.queue));
    row("Job", d.job.as_deref().map(esc).unwrap_or_else(|| "-".into()));
    row("Key", d.key.map(|k| key_link(&k.to_string())).unwrap_or_else(|| "-".into()));
    row("Reason", esc(&d.reason));
    row("Attempts", d.attempts.map(|a| a.to_string()).unwrap_or_else(|| "-".into()));
    row("Failed at", d.failed_at.map(|t| at(t) + " UTC").unwrap_or_else(|| "-".into()));
    row(
        "Worker",
        d.worker.as_deref().map(|w| format!("<code>{}</code>", esc(w))).unwrap_or_else(|| "-".into()),
    );
    row("Error", d.error.as_deref().map(|e| format!("<pre>{}</pre>", esc(e))).unwrap_or_else(|| "-".into()));
    body.push_str("</dl><h2>Body</h2>");
    let text = match serde_json::from_slice::<serde_json::Value>(&d.body) {
        Ok(v) if d.body_whole() => serde_json::to_string_pretty(&v).unwrap_or_default(),
        _ => String::from_utf8_lossy(&d.body).into_owned(),
    };
    let _ = write!(body, "<pre id=\"body\">{}</pre>", esc(&text));
    if !d.body_whole() {
        let _ = write!(
            body,
            "<p class=\"muted\" id=\"body-cut\">The first {} of {} bytes; replay sends the whole body, \
             <code>chime dlq show {}</code> shows up to {} KiB.</p>",
            d.body.len(),
            d.body_bytes,
            esc(&d.id),
            crate::dlq::BodyKept::SHOWN.0 / 1024
        );
    }
    let _ = write!(body, "<p class=\"muted\">As read at {} UTC.</p>", at(snapshot.taken_at));
    if !web.read_only {
        let confirm = |action: &str| format!("/dlq/{}/{}/confirm?action={action}", enc(&queue), enc(&d.id));
        if d.replayable {
            let _ = write!(body, "<p><a id=\"replay\" href=\"{}\">Replay…</a> · ", esc(&confirm("replay")));
        } else {
            body.push_str("<p><span class=\"muted\">Not a chime envelope: cannot be replayed.</span> · ");
        }
        let _ =
            write!(body, "<a id=\"purge\" class=\"warn\" href=\"{}\">Purge…</a></p>", esc(&confirm("purge")));
    }
    let _ = write!(body, "<p><a href=\"{}\">Back to the DLQ</a></p>", esc(&back));
    let _ = f;
    Html(page(&frame(&web, &notice), "Dead letter", "Dead letters", None, &body)).into_response()
}

#[derive(Debug, serde::Deserialize)]
pub struct ConfirmForm {
    action: String,
}

pub async fn confirm(
    State(web): State<Arc<Web>>,
    Path((queue, id)): Path<(String, String)>,
    Query(form): Query<ConfirmForm>,
) -> Response {
    let replay = match form.action.as_str() {
        "replay" => true,
        "purge" => false,
        other => return not_found(&web, &format!("unknown action {other:?} (replay or purge)")),
    };
    let (d, _) = match find_dead_letter(&web, &queue, &id).await {
        Err(r) => return r,
        Ok(None) => {
            return not_found(
                &web,
                &format!("no dead letter {id} in the DLQ of {queue} (replayed or purged?)"),
            );
        }
        Ok(Some(found)) => found,
    };
    let notice = Notice::default();
    let f = frame(&web, &notice);
    let what = if replay {
        "Replay sends it back to its work queue as attempt 1 (source \"replay\") and frees its key, so it runs again."
    } else {
        "Purge deletes it for good."
    };
    let body = format!(
        "<p>{what}</p><dl><dt>Id</dt><dd><code>{}</code></dd><dt>Job</dt><dd>{}</dd><dt>Key</dt><dd>{}</dd><dt>Reason</dt><dd>{}</dd></dl>\
         <p>This acts on exactly this id and nothing else.</p><p>{} <a href=\"/dlq/{}/{}\">Cancel</a></p>",
        esc(&d.id),
        d.job.as_deref().map(esc).unwrap_or_else(|| "-".into()),
        d.key.map(|k| format!("<code>{k}</code>")).unwrap_or_else(|| "-".into()),
        esc(&d.reason),
        button(
            &f,
            "/actions/dlq",
            if replay { "Replay this dead letter" } else { "Purge this dead letter" },
            &format!("/dlq?queue={}", enc(&queue)),
            &[("queue", &queue), ("id", &d.id), ("op", &form.action)],
            !replay
        ),
        enc(&queue),
        enc(&d.id),
    );
    Html(page(
        &f,
        if replay { "Replay a dead letter" } else { "Purge a dead letter" },
        "Dead letters",
        None,
        &body,
    ))
    .into_response()
}

// ---------------------------------------------------------------------------------------------
// Actions

#[derive(Debug, serde::Deserialize)]
pub struct ActionForm {
    csrf: String,
    back: String,
    op: String,
    #[serde(flatten)]
    fields: HashMap<String, String>,
}

/// Where an action returns to with its notice: only a page of this dashboard (else the
/// overview), carrying the id of the notice stored in [`Web::notices`].
fn back_to(web: &Web, back: &str, msg: String) -> Response {
    let path = own_page(back).unwrap_or("/");
    let sep = if path.contains('?') { '&' } else { '?' };
    Redirect::to(&format!("{path}{sep}notice={}", web.notices.post(msg))).into_response()
}

/// `back` if it is a page of this dashboard: one of its paths, then an optional query of
/// plain characters. Anything a browser could read as another host (`//evil`, `/\\evil`,
/// `/%09/evil`, which some browsers strip to `//evil`) is refused.
pub(super) fn own_page(back: &str) -> Option<&str> {
    let (path, query) = back.split_once('?').unwrap_or((back, ""));
    let known = matches!(path, "/" | "/schedules" | "/running" | "/history" | "/dlq")
        || path
            .strip_prefix("/keys/")
            .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
        || path.strip_prefix("/dlq/").is_some_and(|rest| {
            rest.split('/').all(|s| {
                !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.~%".contains(&b))
            })
        });
    let plain_query = query.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.~%=&+".contains(&b));
    (known && plain_query).then_some(back)
}

fn csrf_ok(web: &Web, form: &ActionForm) -> bool {
    super::ct_eq(web.csrf.as_bytes(), form.csrf.as_bytes())
}

fn csrf_refused() -> Response {
    (StatusCode::FORBIDDEN, "refused: missing or stale form token (reload the page)\n").into_response()
}

pub async fn queue_action(State(web): State<Arc<Web>>, Form(form): Form<ActionForm>) -> Response {
    if !csrf_ok(&web, &form) {
        return csrf_refused();
    }
    let queue = form.fields.get("queue").cloned().unwrap_or_default();
    if !web.config.all_queues().contains(&queue) {
        return (StatusCode::BAD_REQUEST, format!("{queue:?} is not a queue of this config\n"))
            .into_response();
    }
    let msg = match pause_or_resume(&web, Target::Queue, &queue, &form.op).await {
        Some(Ok(msg)) => msg,
        Some(Err(page)) => return page,
        None => {
            return (StatusCode::BAD_REQUEST, format!("unknown operation {:?}\n", form.op)).into_response();
        }
    };
    tracing::info!(queue = %queue, op = %form.op, "dashboard action");
    back_to(&web, &form.back, msg)
}

pub async fn schedule_action(State(web): State<Arc<Web>>, Form(form): Form<ActionForm>) -> Response {
    if !csrf_ok(&web, &form) {
        return csrf_refused();
    }
    let job = form.fields.get("job").cloned().unwrap_or_default();
    let Some(spec) = web.config.job(&job) else {
        return (StatusCode::BAD_REQUEST, format!("unknown job {job:?}\n")).into_response();
    };
    if spec.schedule.is_none() && form.op != "run" {
        return (StatusCode::BAD_REQUEST, format!("job {job:?} has no schedule\n")).into_response();
    }
    let msg = match form.op.as_str() {
        "run" => match web.run_now(&job).await {
            Ok(d) => format!("Triggered {job} now on queue {} (key {}), confirmed.", d.queue, d.key),
            Err(e) => return failed(&web, "Run now", e),
        },
        op => match pause_or_resume(&web, Target::Schedule, &job, op).await {
            Some(Ok(msg)) => msg,
            Some(Err(page)) => return page,
            None => return (StatusCode::BAD_REQUEST, format!("unknown operation {op:?}\n")).into_response(),
        },
    };
    tracing::info!(job = %job, op = %form.op, "dashboard action");
    back_to(&web, &form.back, msg)
}

pub async fn dlq_action(State(web): State<Arc<Web>>, Form(form): Form<ActionForm>) -> Response {
    if !csrf_ok(&web, &form) {
        return csrf_refused();
    }
    let queue = form.fields.get("queue").cloned().unwrap_or_default();
    let id = form.fields.get("id").cloned().unwrap_or_default();
    if !dlq_sources(&web).contains(&queue) || id.is_empty() {
        return (StatusCode::BAD_REQUEST, "a DLQ action needs a queue of this config and an exact id\n")
            .into_response();
    }
    let replay = match form.op.as_str() {
        "replay" => true,
        "purge" => false,
        other => return (StatusCode::BAD_REQUEST, format!("unknown operation {other:?}\n")).into_response(),
    };
    let report = match web.dlq.act(&queue, &id, replay).await {
        Ok(r) => r,
        Err(e) => return failed(&web, "Dead letters", e),
    };
    tracing::info!(queue = %queue, id = %id, op = %form.op, ?report, "dashboard action");
    let msg = match (replay, report.replayed, report.dropped, report.unreplayable) {
        (true, 1, _, _) => format!("Replayed dead letter {id} to queue {queue}."),
        (true, _, _, 1) => format!("Dead letter {id} is not a chime envelope and cannot be replayed; kept."),
        (false, _, 1, _) => format!("Purged dead letter {id}."),
        _ => format!(
            "No dead letter {id} is in the DLQ of {queue} any more (replayed or purged by someone else?); nothing done."
        ),
    };
    back_to(&web, &form.back, msg)
}

/// Carries out `op` (`pause` or `resume`) on a queue or schedule and says what happened;
/// `None` for any other `op`, `Some(Err(page))` when Redis failed.
async fn pause_or_resume(
    web: &Web,
    target: Target,
    name: &str,
    op: &str,
) -> Option<Result<String, Response>> {
    let mut conn = web.reader.connection();
    let label = if target == Target::Queue { "Queue" } else { "Schedule" };
    Some(match op {
        "pause" => match control::pause(&mut conn, &web.names, target, name, &web_operator()).await {
            Ok(None) if target == Target::Queue => Ok(format!(
                "Paused queue {name}: workers stop consuming it within about a second; running jobs finish."
            )),
            Ok(None) => {
                Ok(format!("Paused schedule {name}: the ticker skips its slots until it is resumed."))
            }
            Ok(Some(f)) => Ok(format!("{label} {name} was already paused by {}.", f.by)),
            Err(e) => Err(failed(web, "Pause", e)),
        },
        "resume" => match control::resume(&mut conn, &web.names, target, name).await {
            Ok(Some(_)) if target == Target::Queue => {
                Ok(format!("Resumed queue {name}: workers consume it again within about a second."))
            }
            Ok(Some(_)) => Ok(format!("Resumed schedule {name} from its next slot.")),
            Ok(None) => Ok(format!("{label} {name} was not paused.")),
            Err(e) => Err(failed(web, "Resume", e)),
        },
        _ => return None,
    })
}

/// Who pauses from the dashboard, as the flag records it.
fn web_operator() -> String {
    format!("{} (dashboard)", control::operator())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_return_only_to_pages_of_this_dashboard() {
        for ok in [
            "/",
            "/schedules",
            "/dlq?queue=default",
            "/dlq?queue=a%2Eb&page=2",
            "/keys/0196-ab",
            "/dlq/default/01ab",
        ] {
            assert_eq!(own_page(ok), Some(ok), "{ok}");
        }
        for bad in [
            "//evil.example/",
            "/\\evil.example",
            "/%09/evil.example",
            "/\t/evil.example",
            "https://evil.example/",
            "evil.example",
            "/dlq?queue=x\r\nSet-Cookie:a",
            "/dlq//evil",
            "/dlq/a//evil.example",
            "/keys/",
            "",
        ] {
            assert_eq!(own_page(bad), None, "{bad:?}");
        }
    }
}
