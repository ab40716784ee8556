//! `/running`: the jobs running now, from the workers' heartbeats.

use axum::extract::{Query, State};
use axum::response::Response;
use chime_shared::control;
use chrono::Utc;
use maud::html;
use std::sync::Arc;

use super::overview::workers_table;
use super::{Notice, failed, ok_page};
use crate::cli::web::Web;
use crate::cli::web::html::{at, key_link, t, table};

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
            // As of the worker's last heartbeat: a job that has ended since may still show.
            let secs = (w.seen_at - r.started_at).num_milliseconds().max(0) as f64 / 1000.0;
            rows.push(vec![
                html! { (t(&r.job)) },
                key_link(&r.key),
                html! { (t(&r.queue)) },
                html! { (r.attempt) },
                html! { (at(r.started_at)) " (" (format!("{secs:.1}")) "s at the last heartbeat)" },
                html! { code { (t(&w.id)) } },
            ]);
        }
    }
    let body = html! {
        p {
            (rows.len()) " job(s) running on " (workers.len()) " worker(s), from their heartbeats (every "
            (control::BEAT_EVERY.as_secs()) "s)."
        }
        @if !rows.is_empty() {
            (table(
                "running",
                &["Job", "Key", "Queue", "Attempt", "Started (UTC)", "Worker"],
                &["Attempt"],
                &rows,
            ))
        }
        h2 { "Workers" }
        (workers_table(&workers, now))
    };
    ok_page(&web, &notice, "Running", "Running", Some(5), body)
}
