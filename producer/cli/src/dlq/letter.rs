//! One dead letter as operators see it, read from a delivery with bounded memory.
//!
//! Everything here came from the wire, and a dead letter need not be chime's own (the broker
//! dead-letters, unroutable delayed messages, anyone with publish rights): every text is
//! shown with control characters escaped (no terminal escape reaches `dlq list`), every
//! field is cut to a length, and the body is kept only as far as the reader asked
//! ([`BodyKept`]). A listing of a DLQ full of maximum-size messages therefore holds a few
//! hundred bytes per dead letter, not the messages; replay republishes the whole body from the
//! delivery itself.

use chime_shared::envelope::{Envelope, header_str};
use chime_shared::redact::escape_control;
use chrono::{DateTime, Utc};
use lapin::types::AMQPValue;
use uuid::Uuid;

use super::UNROUTABLE;

/// Longest id, name, reason or worker kept (characters; chime's own are far shorter).
pub const FIELD_MAX: usize = 200;
/// Longest error kept (chime writes at most 1,000 bytes; a foreign publisher may write more).
pub const ERROR_MAX: usize = 2_000;

/// How much of each body a reading keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyKept(pub usize);

impl BodyKept {
    /// None: listings.
    pub const NONE: Self = Self(0);
    /// A preview (the dashboard's snapshot).
    pub const PREVIEW: Self = Self(2 * 1024);
    /// One dead letter shown (`dlq show`).
    pub const SHOWN: Self = Self(64 * 1024);
}

/// One dead letter, as read from a DLQ.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadLetter {
    /// `x-chime-dead-id`, else the envelope id, else the AMQP message id (escaped, cut).
    pub id: String,
    pub queue: String,
    pub job: Option<String>,
    pub key: Option<Uuid>,
    /// `x-chime-reason`, else the broker's `x-first-death-reason` (e.g. `delivery_limit`).
    pub reason: String,
    pub error: Option<String>,
    pub attempts: Option<u32>,
    pub failed_at: Option<DateTime<Utc>>,
    pub worker: Option<String>,
    /// The body's whole size in bytes.
    pub body_bytes: usize,
    /// The body is a chime envelope, so it can be replayed.
    pub replayable: bool,
    /// The first bytes of the body, as many as the reading kept ([`BodyKept`]).
    #[serde(skip)]
    pub body: Vec<u8>,
}

impl DeadLetter {
    /// Whether [`DeadLetter::body`] is the whole body.
    pub fn body_whole(&self) -> bool {
        self.body.len() == self.body_bytes
    }

    /// Reads `delivery` from the DLQ of `queue`, keeping `kept` of its body; also returns the
    /// decoded envelope (for a replay, which needs its payload), never stored.
    pub(super) fn read(
        queue: &str,
        delivery: &lapin::message::Delivery,
        kept: BodyKept,
    ) -> (Self, Option<Envelope>) {
        let props = &delivery.properties;
        let envelope = Envelope::decode(&delivery.data).ok();
        let id = header_str(props, "x-chime-dead-id")
            .or_else(|| envelope.as_ref().map(|e| e.id.to_string()))
            .or_else(|| props.message_id().as_ref().map(|m| m.as_str().to_string()))
            .map(|s| shown(&s, FIELD_MAX))
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "-".into());
        let reason = if queue == UNROUTABLE {
            // Routed by the broker's alternate exchange: its work queue did not exist.
            "unroutable".to_string()
        } else {
            header_str(props, "x-chime-reason")
                .or_else(|| header_str(props, "x-first-death-reason"))
                .map(|s| shown(&s, FIELD_MAX))
                .unwrap_or_else(|| "unknown".into())
        };
        let failed_at = header_str(props, "x-chime-failed-at")
            .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
            .map(|t| t.with_timezone(&Utc))
            .or_else(|| death_time(props))
            .or_else(|| props.timestamp().and_then(|t| DateTime::from_timestamp(i64::try_from(t).ok()?, 0)));
        let letter = Self {
            id,
            queue: queue.to_string(),
            job: envelope
                .as_ref()
                .map(|e| e.job.clone())
                .or_else(|| props.kind().as_ref().map(|k| shown(k.as_str(), FIELD_MAX))),
            key: envelope.as_ref().map(|e| e.key),
            reason,
            error: header_str(props, "x-chime-error").map(|e| shown_multiline(&e, ERROR_MAX)),
            attempts: header_str(props, "x-chime-attempts").and_then(|a| a.parse().ok()),
            failed_at,
            worker: header_str(props, "x-chime-worker").map(|w| shown(&w, FIELD_MAX)),
            body_bytes: delivery.data.len(),
            replayable: envelope.is_some(),
            body: delivery.data[..delivery.data.len().min(kept.0)].to_vec(),
        };
        (letter, envelope)
    }
}

/// `s` on one line, control characters escaped, cut to `max` characters (with `…`).
pub fn shown(s: &str, max: usize) -> String {
    cut(escape_control(s).as_ref(), max)
}

/// `s` with its line breaks kept and every other control character escaped, cut to `max`.
fn shown_multiline(s: &str, max: usize) -> String {
    let lines: Vec<String> = s.split('\n').map(|l| escape_control(l).into_owned()).collect();
    cut(&lines.join("\n"), max)
}

fn cut(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Time of the broker's first dead-lettering (`x-death[0].time`), for broker-made dead letters.
fn death_time(props: &lapin::BasicProperties) -> Option<DateTime<Utc>> {
    let headers = props.headers().as_ref()?;
    let AMQPValue::FieldArray(deaths) = headers.inner().get("x-death")? else { return None };
    let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else { return None };
    match first.inner().get("time")? {
        AMQPValue::Timestamp(t) => DateTime::from_timestamp(i64::try_from(*t).ok()?, 0),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_text_is_escaped_and_cut() {
        assert_eq!(shown("\u{1b}[2J\u{1b}]0;pwned\u{7}", 100), "\\u{1b}[2J\\u{1b}]0;pwned\\u{7}");
        assert_eq!(shown("abcdef", 3), "abc…");
        assert_eq!(shown_multiline("line 1\nline 2\u{1b}[31m", 100), "line 1\nline 2\\u{1b}[31m");
        assert_eq!(cut("ééé", 2), "éé…");
    }
}
