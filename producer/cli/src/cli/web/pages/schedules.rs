//! `/schedules`: each scheduled job, its next and last slot, the last outcome, its counters and
//! pause state.

use axum::extract::{Query, State};
use axum::response::Response;
use chime_scheduler::ticker::scheduled_jobs;
use chime_shared::control::{self, Target};
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use std::sync::Arc;

use super::{Notice, failed, frame, ok_page, paused_cell};
use crate::cli::web::Web;
use crate::cli::web::html::{at, button, enc, key_link, t, table};

pub async fn schedules(State(web): State<Arc<Web>>, Query(notice): Query<Notice>) -> Response {
    match body(&web).await {
        Ok(body) => ok_page(&web, &notice, "Schedules", "Schedules", None, body),
        Err(e) => failed(&web, "Schedules", e),
    }
}

async fn body(web: &Web) -> anyhow::Result<Markup> {
    let jobs = scheduled_jobs(&web.config)?;
    if jobs.is_empty() {
        return Ok(html! { p { "No job of this config has a schedule." } });
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
    let f = frame(web, &Notice::default());
    let mut rows = Vec::new();
    for (i, j) in jobs.iter().enumerate() {
        let n = counts.get(&j.name).copied().unwrap_or_default();
        let next = j.schedule.next_after(now);
        let outcome = match (&last[i], &states[i]) {
            (None, _) => html! { "-" },
            (Some(_), Some((state, _))) => html! { (state.as_str()) " " (key_link(&keys[i])) },
            (Some(_), None) => html! { span.muted { "no record" } " " (key_link(&keys[i])) },
        };
        let (label, op) = if flags[i].is_some() { ("Resume", "resume") } else { ("Pause", "pause") };
        let job = &j.name;
        let actions = html! {
            (button(&f, "/actions/schedule", label, "/schedules", &[("job", job), ("op", op)], false))
            " "
            (button(&f, "/actions/schedule", "Run now", "/schedules", &[("job", job), ("op", "run")], false))
        };
        rows.push(vec![
            html! { a href={ "/history?job=" (enc(job)) } { (t(job)) } },
            html! {
                code { (t(j.schedule.expr())) } " " (j.schedule.zone().name())
                @if let Some(b) = j.schedule.business() { br; span.muted { "calendar " (t(&b.name)) } }
            },
            html! { (t(&j.queue)) },
            html! { (next.map(at).unwrap_or_else(|| "-".into())) },
            html! { (last[i].map(at).unwrap_or_else(|| "-".into())) },
            outcome,
            html! { (n.missed) },
            html! { (n.paused) },
            html! { (n.overlapped) },
            html! { (n.calendar) },
            paused_cell(&flags[i], now),
            actions,
        ]);
    }
    Ok(html! {
        (table(
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
                "Calendar skipped",
                "State",
                "",
            ],
            &["Missed", "Paused slots", "Overlapped", "Calendar skipped"],
            &rows,
        ))
        p.muted {
            "Resuming here does not catch paused slots up; "
            code { "chime resume schedule JOB --catch-up" } " does."
        }
    })
}
