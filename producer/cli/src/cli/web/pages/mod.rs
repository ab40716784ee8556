//! The dashboard's pages, one module each, and what they share. Markup is written with maud
//! (`html!`), which escapes every value; `super::html` has the layout and the pieces.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use chime_shared::control::PauseFlag;
use chrono::{DateTime, Utc};
use maud::{Markup, html};

use super::Web;
use super::html::{Frame, ago, enc, page, t};
use crate::dlq::UNROUTABLE;

mod actions;
mod dlq;
mod history;
mod key;
mod overview;
mod running;
mod schedules;

pub use actions::{cancel_action, circuit_action, dlq_action, queue_action, schedule_action};
pub use dlq::{confirm, dead_letter, dlq};
pub use history::history;
pub use key::key;
pub use overview::overview;
pub use running::running;
pub use schedules::schedules;

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

/// A page of the dashboard (200).
fn ok_page(
    web: &Web,
    notice: &Notice,
    title: &str,
    active: &str,
    refresh: Option<u32>,
    body: Markup,
) -> Response {
    Html(page(&frame(web, notice), title, active, refresh, body)).into_response()
}

/// A page that could not be built: what failed, as a page (500).
fn failed(web: &Web, title: &str, error: impl std::fmt::Display) -> Response {
    let error = chime_shared::redact::redact_text(&error.to_string());
    let body = html! { p.warn { (t(&error)) } };
    (StatusCode::INTERNAL_SERVER_ERROR, Html(page(&frame(web, &Notice::default()), title, "", None, body)))
        .into_response()
}

fn not_found(web: &Web, what: &str) -> Response {
    let body = html! { p.warn { (t(what)) } };
    (StatusCode::NOT_FOUND, Html(page(&frame(web, &Notice::default()), "Not found", "", None, body)))
        .into_response()
}

fn paused_cell(flag: &Option<PauseFlag>, now: DateTime<Utc>) -> Markup {
    html! {
        @match flag {
            Some(f) => { span.warn { "paused" } " " (ago(f.at, now)) " by " (t(&f.by)) }
            None => span.ok { "active" },
        }
    }
}

/// A DLQ's depth, linked to its listing, marked when it reaches the alert threshold.
fn dlq_cell(source: &str, depth: Option<u32>, threshold: u64) -> Markup {
    html! {
        @match depth {
            None => "?",
            Some(d) => {
                a href={ "/dlq?queue=" (enc(source)) } { (d) }
                @if u64::from(d) >= threshold {
                    " " span.warn title={ "alerts.dlq_threshold = " (threshold) } { "alert" }
                }
            }
        }
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

fn nonempty(v: &Option<String>) -> Option<String> {
    v.as_deref().map(str::trim).filter(|s| !s.is_empty()).map(str::to_string)
}
