//! The POST actions (pause, resume, run now; replay, purge), each behind the form token, and
//! where they may send the browser back to.

use axum::Form;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use chime_shared::control::{self, Target};
use std::collections::HashMap;
use std::sync::Arc;

use super::{dlq_sources, failed};
use crate::cli::web::Web;

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
fn own_page(back: &str) -> Option<&str> {
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
    crate::cli::web::ct_eq(web.csrf.as_bytes(), form.csrf.as_bytes())
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

/// Holds a circuit breaker open or closes it (`chime circuit open|close`).
pub async fn circuit_action(State(web): State<Arc<Web>>, Form(form): Form<ActionForm>) -> Response {
    if !csrf_ok(&web, &form) {
        return csrf_refused();
    }
    let name = form.fields.get("circuit").cloned().unwrap_or_default();
    if !web.config.all_circuits().iter().any(|(c, _)| c.name == name) {
        return (StatusCode::BAD_REQUEST, format!("{name:?} is not a circuit breaker of this config\n"))
            .into_response();
    }
    let open = match form.op.as_str() {
        "open" => true,
        "close" => false,
        op => return (StatusCode::BAD_REQUEST, format!("unknown operation {op:?}\n")).into_response(),
    };
    let mut conn = web.reader.connection();
    let msg = match chime_shared::circuit::force(&mut conn, &web.names, &name, open).await {
        Ok(before) if open => format!("Circuit {name} held open (was {before}) until closed."),
        Ok(before) => format!("Circuit {name} closed (was {before}): its runs go through again."),
        Err(e) => return failed(&web, "Circuit", e),
    };
    tracing::info!(circuit = %name, op = %form.op, "dashboard action");
    back_to(&web, &form.back, msg)
}

/// The Cancel button of a key's page: `chime cancel KEY`.
pub async fn cancel_action(State(web): State<Arc<Web>>, Form(form): Form<ActionForm>) -> Response {
    if !csrf_ok(&web, &form) {
        return csrf_refused();
    }
    let raw = form.fields.get("key").cloned().unwrap_or_default();
    let Ok(key) = uuid::Uuid::parse_str(raw.trim()) else {
        return (StatusCode::BAD_REQUEST, format!("{raw:?} is not an idempotency key (a UUID)\n"))
            .into_response();
    };
    let mut conn = web.reader.connection();
    let who = format!("dashboard ({})", chime_shared::control::operator());
    let msg = match chime_shared::control::cancel(&mut conn, &web.names, &web.config, &key.to_string(), &who)
        .await
    {
        Ok((_, text, _)) => text,
        Err(e) => return failed(&web, "Cancel", e),
    };
    tracing::info!(%key, "dashboard action: cancel");
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
