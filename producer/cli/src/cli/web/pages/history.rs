//! `/history`: runs from the history streams, filtered, newest first, paged by entry.

use axum::extract::{Query, State};
use axum::response::Response;
use chime_shared::history::{Outcome, RunEvent};
use maud::{Markup, html};
use std::fmt::Write;
use std::sync::Arc;

use super::{Notice, failed, nonempty, ok_page};
use crate::cli::web::Web;
use crate::cli::web::html::{at, cut, enc, key_link, t, table};

/// Runs per history page.
const HISTORY_PAGE: usize = 100;

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

pub async fn history(State(web): State<Arc<Web>>, Query(form): Query<HistoryForm>) -> Response {
    let notice = Notice { notice: form.notice.clone() };
    let args = crate::cli::history::HistoryArgs {
        job: nonempty(&form.job),
        key: nonempty(&form.key),
        queue: nonempty(&form.queue),
        outcome: nonempty(&form.outcome),
        since: nonempty(&form.since),
        before: nonempty(&form.before),
        limit: HISTORY_PAGE,
        totals: false,
        json: false,
    };
    let query = crate::cli::history::query(&args);
    // Over a window (`since`), the outcome totals by job, queue and worker come first.
    let totals = match &query {
        Ok(q) if q.since.is_some() && q.key.is_none() && q.before.is_none() => {
            match web.reader.totals(&web.config.all_queues(), q).await {
                Ok(totals) => Some(totals_html(&totals)),
                Err(e) => return failed(&web, "History", e),
            }
        }
        _ => None,
    };
    let results = match query {
        // The command line's message, named as the form's field (`outcome`, not `--outcome`).
        Err(f) => html! { p.warn { (t(f.error.to_string().trim_start_matches("--"))) } },
        Ok(q) => match web.reader.search(&web.config.all_queues(), &q).await {
            Err(e) => return failed(&web, "History", e),
            Ok(found) => {
                let older = found.next.clone().map(|entry| {
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
                    link
                });
                html! {
                    @if found.events.is_empty() {
                        p #no-runs { "No runs found." }
                    } @else {
                        (runs_table("runs", &found.events))
                    }
                    @if let Some(link) = older {
                        p {
                            a #older href=(link) { "Older runs" }
                            @if found.truncated.is_some() { " (searched " (found.scanned) " entries)" }
                        }
                    }
                }
            }
        },
    };
    let body = html! { (filter(&web, &form)) @if let Some(t) = totals { (t) } (results) };
    ok_page(&web, &notice, "History", "History", None, body)
}

/// Outcome totals over the window: one table each by job, queue and worker.
fn totals_html(totals: &chime_shared::history::Totals) -> Markup {
    let outcomes: Vec<&str> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
    let section =
        |id: &str,
         title: &str,
         map: &std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>>| {
            let mut head = vec![title, "Runs"];
            head.extend(outcomes.iter().copied());
            let rows: Vec<Vec<Markup>> = map
                .iter()
                .map(|(name, counts)| {
                    let mut row = vec![html! { (t(name)) }, html! { (counts.values().sum::<u64>()) }];
                    row.extend(outcomes.iter().map(|o| html! { (counts.get(*o).copied().unwrap_or(0)) }));
                    row
                })
                .collect();
            table(id, &head, &head[1..], &rows)
        };
    html! {
        h2 { "Totals" }
        p.muted #totals-summary {
            (totals.runs) " run(s) in the window"
            @if totals.truncated { " (stopped at the search budget: older runs not counted)" }
            "."
        }
        (section("totals-jobs", "Job", &totals.by_job))
        (section("totals-queues", "Queue", &totals.by_queue))
        (section("totals-workers", "Worker", &totals.by_worker))
        h2 { "Runs" }
    }
}

fn filter(web: &Web, form: &HistoryForm) -> Markup {
    let val = |v: &Option<String>| v.clone().unwrap_or_default();
    html! {
        form.filter method="get" action="/history" {
            input name="job" placeholder="job" value=(val(&form.job));
            input name="key" placeholder="key (UUID)" size="38" value=(val(&form.key));
            select name="queue" {
                option value="" { "any queue" }
                @for q in web.config.all_queues() {
                    option selected[form.queue.as_deref() == Some(q.as_str())] { (t(&q)) }
                }
            }
            select name="outcome" {
                option value="" { "any outcome" }
                @for o in Outcome::ALL {
                    option selected[form.outcome.as_deref() == Some(o.as_str())] { (o.as_str()) }
                }
            }
            input name="since" placeholder="since (1h, 2d)" size="10" value=(val(&form.since));
            button type="submit" { "Search" }
        }
    }
}

/// Runs, one row each.
pub(super) fn runs_table(id: &str, events: &[RunEvent]) -> Markup {
    let rows: Vec<Vec<Markup>> = events
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
                html! { (at(e.finished_at)) },
                html! { @if e.job.is_empty() { "-" } @else { (t(&e.job)) } },
                html! { (t(&e.queue)) },
                html! { span class=(outcome_class) { (e.outcome.as_str()) } },
                html! { (e.attempt) "/" (e.max_attempts) },
                html! { (e.duration_ms.map(|ms| format!("{:.3}s", ms as f64 / 1000.0)).unwrap_or_else(|| "-".into())) },
                html! { code { (t(&e.worker)) } },
                key_link(&e.key),
                html! { span title=(t(&error)) { (t(&cut(&error, 80))) } },
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
