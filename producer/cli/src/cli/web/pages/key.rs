//! `/keys/{key}`: one idempotency key: its record, its fan-out, its runs and dead letters.

use axum::extract::{Path, Query, State};
use axum::response::Response;
use chime_shared::history::KeyRecord;
use maud::{Markup, html};
use std::sync::Arc;
use uuid::Uuid;

use super::dlq::{dead_letters_table, dlq_views};
use super::history::runs_table;
use super::{Notice, failed, not_found, ok_page};
use crate::cli::web::Web;
use crate::cli::web::dlq_cache::View;
use crate::cli::web::html::{at, button, cut, key_link, t, table};
use chime_shared::record::KeyState;

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
    let group = match chime_shared::group::read(&mut web.reader.connection(), &web.names, key).await {
        Ok(Some(group)) => match group_html(&web, &group).await {
            Ok(html) => Some(html),
            Err(e) => return failed(&web, "Key", e),
        },
        Ok(None) => None,
        Err(e) => return failed(&web, "Key", e),
    };
    let workflow =
        match chime_shared::workflow::WorkflowRecord::read(&mut web.reader.connection(), &web.names, key)
            .await
        {
            Ok(Some(wf)) => match workflow_html(&web, &wf).await {
                Ok(html) => Some(html),
                Err(e) => return failed(&web, "Key", e),
            },
            Ok(None) => None,
            Err(e) => return failed(&web, "Key", e),
        };
    let mut found = Vec::new();
    let mut notes = Vec::new();
    for (source, view) in dlq_views(&web).await {
        match view {
            Ok(View::Ready { snapshot, refreshing }) => {
                found.extend(snapshot.letters.iter().filter(|d| d.key == Some(key)).cloned());
                if refreshing {
                    notes.push(format!("{source} as of {}", at(snapshot.taken_at)));
                }
            }
            Ok(View::Reading) => notes.push(format!("{source}: still reading")),
            Err(e) => notes.push(format!("{source}: {e}")),
        }
    }
    let mut runs = record.runs.clone();
    runs.reverse();
    // Anything not settled may be cancelled (a key with no record: queued, delayed, unknown).
    let cancellable = !record.state.as_ref().is_some_and(|s| s.settled() || *s == KeyState::Dying);
    let f = super::frame(&web, &Notice::default());
    let here = format!("/keys/{key}");
    let key_text = key.to_string();
    // A workflow's own key has no record: its steps are the page.
    if let (Some(workflow), None) = (&workflow, &record.state) {
        let body = html! { (workflow) };
        return ok_page(&web, &notice, &format!("Workflow {key}"), "", None, body);
    }
    let body = html! {
        @if let Some(group) = group { (group) }
        (record_html(&key, &record))
        @if cancellable {
            p #cancel { (button(&f, "/actions/cancel", "Cancel this run", &here, &[("op", "cancel"), ("key", &key_text)], true))
                span.muted { " stops it on its worker within a second; a copy that arrives later is dropped" } }
        }
        h2 { "Runs" }
        @if runs.is_empty() {
            p { "No runs recorded (history off, or the record expired)." }
        } @else {
            (runs_table("key-runs", &runs))
        }
        h2 { "Dead letters" }
        @if found.is_empty() {
            p #no-dead-letters { "None in any DLQ of this prefix." }
        } @else {
            (dead_letters_table(&found))
        }
        @if !notes.is_empty() { p.muted { (t(&notes.join("; "))) } }
    };
    ok_page(&web, &notice, &format!("Key {key}"), "", None, body)
}

/// A fanned-out run (sharded or broadcast): its members, a missing one marked.
async fn group_html(web: &Web, group: &chime_shared::group::GroupRecord) -> redis::RedisResult<Markup> {
    use crate::cli::history::GroupView;
    let view = GroupView::read(&web.reader, group).await?;
    let complete = view.done == view.members.len();
    let rows: Vec<Vec<Markup>> = view
        .members
        .iter()
        .zip(&view.states)
        .zip(&view.records)
        .map(|((m, s), r)| {
            let result = r
                .result
                .as_ref()
                .and_then(|r| r.value())
                .map(|v| cut(&v.to_string(), 60))
                .unwrap_or_default();
            vec![
                html! { (t(&GroupView::label(m))) },
                key_link(&m.key.to_string()),
                html! {
                    @match s {
                        Some((state, _)) => (state.as_str()),
                        None => b.warn.missing { "missing: not started" },
                    }
                },
                html! { @if let Some((_, Some(finished))) = s { (at(*finished)) } },
                html! { (t(&result)) },
            ]
        })
        .collect();
    Ok(html! {
        h2 { "Fan-out" }
        dl #group {
            dt { "Job" } dd { (t(&group.job)) " on queue " (t(&group.queue)) }
            @if let Some(slot) = group.slot { dt { "Slot" } dd { (at(slot)) " UTC" } }
            dt { "Fan-out" } dd { (t(&GroupView::fan(group))) }
            dt { "State" } dd { b #group-state class=(if complete { "ok" } else { "warn" }) { (t(&view.summary())) } }
        }
        (table("members", &["Member", "Key", "State", "Finished (UTC)", "Result"], &[], &rows))
        p.muted { "The key below is the whole run's: its members have keys of their own." }
    })
}

/// A workflow: its steps, each with its state, what it waits for and its result.
async fn workflow_html(web: &Web, wf: &chime_shared::workflow::WorkflowRecord) -> redis::RedisResult<Markup> {
    use crate::cli::history::WorkflowView;
    let view = WorkflowView::read(&web.reader, wf).await?;
    let complete = view.done == wf.steps.len();
    let rows: Vec<Vec<Markup>> = wf
        .steps
        .iter()
        .zip(&view.records)
        .map(|(s, r)| {
            let state = WorkflowView::state(r);
            let detail = match (&r.state, &r.waiting) {
                (Some(KeyState::Done), _) => r
                    .result
                    .as_ref()
                    .and_then(|v| v.value())
                    .map(|v| cut(&v.to_string(), 60))
                    .unwrap_or_default(),
                (None | Some(KeyState::Free | KeyState::Running), Some(w)) => cut(w, 100),
                _ => String::new(),
            };
            vec![
                html! { (t(&s.step)) },
                html! { (t(&s.job)) },
                key_link(&s.key.to_string()),
                html! { (t(&s.after.join(", "))) },
                html! { @if state == "blocked" || state == "dead" { b.warn { (state) } } @else { (state) } },
                html! { (t(&detail)) },
            ]
        })
        .collect();
    let summary = if complete {
        "complete: every step is done".to_string()
    } else {
        format!("{} of {} steps done", view.done, wf.steps.len())
    };
    Ok(html! {
        h2 { "Workflow" }
        dl #workflow {
            @if let Some(slot) = wf.slot { dt { "Slot" } dd { (at(slot)) " UTC (a scheduled chain)" } }
            @else { dt { "Enqueued" } dd { (at(wf.created)) " UTC" } }
            dt { "State" } dd { b #workflow-state class=(if complete { "ok" } else { "warn" }) { (t(&summary)) } }
        }
        (table("steps", &["Step", "Job", "Key", "After", "State", "Result / waiting for"], &[], &rows))
        p.muted { "This is the workflow's key: each step has a key of its own (follow it for its runs)." }
    })
}

fn record_html(key: &Uuid, r: &KeyRecord) -> Markup {
    let expires = r.expires_in_ms.map(|ms| {
        chime_shared::duration::format(std::time::Duration::from_secs(u64::try_from(ms / 1000).unwrap_or(0)))
    });
    html! {
        dl #record {
            dt { "Key" } dd { code { (key) } }
            @if let (Some(w), None | Some(KeyState::Free)) = (&r.waiting, &r.state) { dt { "Workflow step" } dd #waiting { (t(w)) } }
            @match &r.state {
                None => {
                    dt { "Record" }
                    dd { "none: never claimed, or expired after " code { "redis.done_retention" } " (or Redis lost it)" }
                }
                Some(state) => {
                    dt { "State" } dd { b #state { (state.as_str()) } " — " (state.meaning()) }
                    @if let Some(o) = &r.owner { dt { "Owner" } dd { code { (t(o)) } } }
                    @if let Some(f) = r.fence { dt { "Fence" } dd { (f) } }
                    @if let Some(at_) = r.claimed_at { dt { "Claimed" } dd { (at(at_)) " UTC" } }
                    @if let Some(at_) = r.finished_at { dt { "Finished" } dd { (at(at_)) " UTC" } }
                    @if let Some(at_) = r.lease_until { dt { "Lease until" } dd { (at(at_)) " UTC" } }
                    @if let Some(e) = &expires { dt { "Expires" } dd { "in " (e) } }
                    @if let Some(d) = &r.dying_reason { dt { "Dying reason" } dd { (t(d)) } }
                }
            }
        }
    }
}
