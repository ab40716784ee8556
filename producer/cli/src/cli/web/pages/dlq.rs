//! `/dlq`: the DLQs' depths and one DLQ's dead letters (filtered, paged); `/dlq/{queue}/{id}`:
//! one dead letter; `/dlq/{queue}/{id}/confirm`: the confirmation before a replay or purge.

use axum::extract::{Path, Query, State};
use axum::response::Response;
use maud::{Markup, html};
use std::fmt::Write;
use std::sync::Arc;

use super::{Notice, dlq_broker_queue, dlq_cell, dlq_sources, failed, frame, nonempty, not_found, ok_page};
use crate::cli::web::Web;
use crate::cli::web::dlq_cache::{Snapshot, View};
use crate::cli::web::html::{at, button, cut, enc, key_link, t, table};
use crate::dlq::DeadLetter;

/// Dead letters per DLQ page.
const DLQ_PAGE: usize = 100;

/// Every DLQ source with its cached view.
pub(super) async fn dlq_views(web: &Arc<Web>) -> Vec<(String, Result<View, crate::dlq::DlqError>)> {
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
    let rows: Vec<Vec<Markup>> = sources
        .iter()
        .zip(&depths)
        .map(|(s, d)| {
            vec![
                html! { a href={ "/dlq?queue=" (enc(s)) } { (t(s)) } },
                dlq_cell(s, d.map(|d| d.0), threshold),
            ]
        })
        .collect();
    let depth_table = table("dlq-depths", &["DLQ of", "Depth"], &["Depth"], &rows);
    let Some(queue) = selected else {
        let body = html! { (depth_table) p { "Choose a queue to list its dead letters." } };
        return ok_page(&web, &notice, "Dead letters", "Dead letters", None, body);
    };
    let depth = sources.iter().position(|s| *s == queue).and_then(|i| depths[i]).map(|d| d.0).unwrap_or(0);
    let job = nonempty(&form.job);
    let key = nonempty(&form.key);
    let head = html! {
        (depth_table)
        h2 { (t(&queue)) }
        form.filter method="get" action="/dlq" {
            input type="hidden" name="queue" value=(queue);
            input name="job" placeholder="job" value=(job.as_deref().unwrap_or(""));
            input name="key" placeholder="key (UUID)" size="38" value=(key.as_deref().unwrap_or(""));
            button type="submit" { "Filter" }
        }
    };
    match web.dlq.view(&queue, depth).await {
        Err(e) => failed(&web, "Dead letters", e),
        Ok(View::Reading) => {
            let body = html! {
                (head)
                p #reading {
                    "Reading " (depth) " dead letters (a pass over the whole DLQ; about a second per few \
                     thousand). This page reloads in 2 s."
                }
            };
            ok_page(&web, &notice, "Dead letters", "Dead letters", Some(2), body)
        }
        Ok(View::Ready { snapshot, refreshing }) => {
            let listing = listing(
                &queue,
                &snapshot,
                refreshing,
                job.as_deref(),
                key.as_deref(),
                form.page.unwrap_or(0),
            );
            ok_page(&web, &notice, "Dead letters", "Dead letters", None, html! { (head) (listing) })
        }
    }
}

fn listing(
    queue: &str,
    snapshot: &Snapshot,
    refreshing: bool,
    job: Option<&str>,
    key: Option<&str>,
    page_no: usize,
) -> Markup {
    let matching: Vec<&DeadLetter> = snapshot
        .letters
        .iter()
        .filter(|d| job.is_none_or(|j| d.job.as_deref() == Some(j)))
        .filter(|d| key.is_none_or(|k| d.key.is_some_and(|dk| dk.to_string() == k.trim())))
        .collect();
    let pages = matching.len().div_ceil(DLQ_PAGE).max(1);
    let page_no = page_no.min(pages - 1);
    let shown: Vec<DeadLetter> =
        matching.iter().skip(page_no * DLQ_PAGE).take(DLQ_PAGE).map(|d| (*d).clone()).collect();
    let link = |p: usize| {
        let mut l = format!("/dlq?queue={}&page={p}", enc(queue));
        if let Some(j) = job {
            let _ = write!(l, "&job={}", enc(j));
        }
        if let Some(k) = key {
            let _ = write!(l, "&key={}", enc(k));
        }
        l
    };
    html! {
        p.muted #as-of {
            (snapshot.total) " dead letter(s), " (matching.len()) " matching, as read at "
            (at(snapshot.taken_at)) " UTC"
            @if refreshing { "; a newer read is under way" }
            "."
        }
        @if snapshot.total > snapshot.letters.len() {
            p.warn #kept {
                "Only the first " (snapshot.letters.len()) " are shown and searched here; "
                code { "chime dlq list --queue " (t(queue)) } " lists them all."
            }
        }
        @if shown.is_empty() {
            p #dlq-empty { "No dead letters." }
        } @else {
            (dead_letters_table(&shown))
        }
        @if pages > 1 {
            p {
                "Page " (page_no + 1) " of " (pages)
                @if page_no > 0 { " · " a href=(link(page_no - 1)) { "newer" } }
                @if page_no + 1 < pages { " · " a #next-page href=(link(page_no + 1)) { "older" } }
            }
        }
    }
}

/// Dead letters, one row each, linked to their pages.
pub(super) fn dead_letters_table(letters: &[DeadLetter]) -> Markup {
    let rows: Vec<Vec<Markup>> = letters
        .iter()
        .map(|d| {
            vec![
                html! {
                    a.dead-letter href={ "/dlq/" (enc(&d.queue)) "/" (enc(&d.id)) } { code { (t(&d.id)) } }
                },
                html! { (t(&d.queue)) },
                html! { (t(d.job.as_deref().unwrap_or("-"))) },
                d.key.map(|k| key_link(&k.to_string())).unwrap_or_else(|| html! { "-" }),
                html! { (t(&d.reason)) },
                html! { (d.attempts.map(|a| a.to_string()).unwrap_or_else(|| "-".into())) },
                html! { (d.failed_at.map(at).unwrap_or_else(|| "-".into())) },
                html! { (t(&d.error.as_deref().map(|e| cut(e, 80)).unwrap_or_default())) },
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

/// The dead letter `id` of `queue`'s DLQ, or the page saying it is gone.
async fn found(web: &Arc<Web>, queue: &str, id: &str) -> Result<(DeadLetter, Snapshot), Response> {
    match find_dead_letter(web, queue, id).await? {
        Some(found) => Ok(found),
        None => {
            Err(not_found(web, &format!("no dead letter {id} in the DLQ of {queue} (replayed or purged?)")))
        }
    }
}

pub async fn dead_letter(
    State(web): State<Arc<Web>>,
    Path((queue, id)): Path<(String, String)>,
    Query(notice): Query<Notice>,
) -> Response {
    let (d, snapshot) = match found(&web, &queue, &id).await {
        Ok(found) => found,
        Err(page) => return page,
    };
    let text = match serde_json::from_slice::<serde_json::Value>(&d.body) {
        Ok(v) if d.body_whole() => serde_json::to_string_pretty(&v).unwrap_or_default(),
        _ => String::from_utf8_lossy(&d.body).into_owned(),
    };
    let confirm = |action: &str| format!("/dlq/{}/{}/confirm?action={action}", enc(&queue), enc(&d.id));
    let body = html! {
        dl #dead-letter {
            dt { "Id" } dd { code #dead-id { (t(&d.id)) } }
            dt { "Queue" } dd { (t(&d.queue)) }
            dt { "Job" } dd { (t(d.job.as_deref().unwrap_or("-"))) }
            dt { "Key" } dd { (d.key.map(|k| key_link(&k.to_string())).unwrap_or_else(|| html! { "-" })) }
            dt { "Reason" } dd { (t(&d.reason)) }
            dt { "Attempts" } dd { (d.attempts.map(|a| a.to_string()).unwrap_or_else(|| "-".into())) }
            dt { "Failed at" } dd { (d.failed_at.map(|t| at(t) + " UTC").unwrap_or_else(|| "-".into())) }
            dt { "Worker" } dd { @match &d.worker { Some(w) => code { (t(w)) }, None => "-" } }
            dt { "Error" } dd { @match &d.error { Some(e) => pre { (t(e)) }, None => "-" } }
        }
        h2 { "Body" }
        pre #body { (t(&text)) }
        @if !d.body_whole() {
            p.muted #body-cut {
                "The first " (d.body.len()) " of " (d.body_bytes) " bytes; replay sends the whole body, "
                code { "chime dlq show " (t(&d.id)) } " shows up to " (crate::dlq::BodyKept::SHOWN.0 / 1024) " KiB."
            }
        }
        p.muted { "As read at " (at(snapshot.taken_at)) " UTC." }
        @if !web.read_only {
            p {
                @if d.replayable {
                    a #replay href=(confirm("replay")) { "Replay…" } " · "
                } @else {
                    span.muted { "Not a chime envelope: cannot be replayed." } " · "
                }
                a #purge .warn href=(confirm("purge")) { "Purge…" }
            }
        }
        p { a href={ "/dlq?queue=" (enc(&queue)) } { "Back to the DLQ" } }
    };
    ok_page(&web, &notice, "Dead letter", "Dead letters", None, body)
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
    let (d, _) = match found(&web, &queue, &id).await {
        Ok(found) => found,
        Err(page) => return page,
    };
    let notice = Notice::default();
    let f = frame(&web, &notice);
    let what = if replay {
        "Replay sends it back to its work queue as attempt 1 (source \"replay\") and frees its key, so it runs again."
    } else {
        "Purge deletes it for good."
    };
    let label = if replay { "Replay this dead letter" } else { "Purge this dead letter" };
    let back = format!("/dlq?queue={}", enc(&queue));
    let fields = [("queue", queue.as_str()), ("id", d.id.as_str()), ("op", form.action.as_str())];
    let body = html! {
        p { (what) }
        dl {
            dt { "Id" } dd { code { (t(&d.id)) } }
            dt { "Job" } dd { (t(d.job.as_deref().unwrap_or("-"))) }
            dt { "Key" } dd { @match d.key { Some(k) => code { (k) }, None => "-" } }
            dt { "Reason" } dd { (t(&d.reason)) }
        }
        p { "This acts on exactly this id and nothing else." }
        p {
            (button(&f, "/actions/dlq", label, &back, &fields, !replay))
            " " a href={ "/dlq/" (enc(&queue)) "/" (enc(&d.id)) } { "Cancel" }
        }
    };
    let title = if replay { "Replay a dead letter" } else { "Purge a dead letter" };
    ok_page(&web, &notice, title, "Dead letters", None, body)
}
