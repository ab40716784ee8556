//! The vocabulary of a key's idempotency record (`<prefix>:idem:<key>`), as types: the state
//! the Lua scripts write (`s`) and the result a `done` run keeps (`res`). Every reader — the
//! worker's claim, `wait`, the ticker's overlap check, `inspect`, the dashboard, backfill —
//! decodes through these, never by comparing strings.

use chrono::{DateTime, Utc};
use serde::Serialize;

/// The state of a key's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    /// Claimed: a run holds it and renews its lease (`run`).
    Running,
    /// Dead-lettering: the dead letter is being published (`dying`).
    Dying,
    /// Done: later copies are absorbed as duplicates (`done`).
    Done,
    /// Dead-lettered: later copies are absorbed until it is replayed (`dead`).
    Dead,
    /// Released for a retry (`free`).
    Free,
    /// Cancelled (`chime cancel`): not run again; later copies are dropped (`cancelled`).
    Cancelled,
    /// Anything else: not a state chime writes (a newer release's, or a poisoned record).
    Unknown(String),
}

impl KeyState {
    /// The state spelled `s` in a record.
    pub fn parse(s: &str) -> Self {
        match s {
            "run" => Self::Running,
            "dying" => Self::Dying,
            "done" => Self::Done,
            "dead" => Self::Dead,
            "free" => Self::Free,
            "cancelled" => Self::Cancelled,
            other => Self::Unknown(other.to_string()),
        }
    }

    /// As the record spells it.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Running => "run",
            Self::Dying => "dying",
            Self::Done => "done",
            Self::Dead => "dead",
            Self::Free => "free",
            Self::Cancelled => "cancelled",
            Self::Unknown(s) => s,
        }
    }

    /// The run is over for good (`done` or `dead`): nothing runs it again but a replay.
    pub fn settled(&self) -> bool {
        matches!(self, Self::Done | Self::Dead | Self::Cancelled)
    }

    /// What the state means, for `chime inspect` and the dashboard.
    pub fn meaning(&self) -> &'static str {
        match self {
            Self::Running => "running (claimed; its owner renews the lease)",
            Self::Dying => "dying: its dead letter is being published (a later copy publishes it again)",
            Self::Done => "done: later copies are absorbed as duplicates",
            Self::Dead => "dead: dead-lettered; later copies are absorbed until it is replayed",
            Self::Free => "free: released for a retry",
            Self::Cancelled => "cancelled: not run again; later copies are dropped as cancelled",
            Self::Unknown(_) => "unknown state",
        }
    }
}

impl std::fmt::Display for KeyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for KeyState {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// What a `done` run left: its result, or why none is kept (too large, not serialisable,
/// past `results.retention`, unreadable). The run succeeded either way. As JSON (flattened
/// into its owner): `"result": …` or `"result_missing": "why"`.
#[derive(Debug, Clone, PartialEq)]
pub enum StoredResult {
    /// The result (JSON).
    Value(serde_json::Value),
    /// Why there is none.
    Missing(String),
}

impl Serialize for StoredResult {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(1))?;
        match self {
            Self::Value(v) => m.serialize_entry("result", v)?,
            Self::Missing(why) => m.serialize_entry("result_missing", why)?,
        }
        m.end()
    }
}

impl StoredResult {
    /// The record's `res` field for a run's result (`v` and the JSON, or `e` and why there is
    /// none): a result whose JSON exceeds `max_bytes` is not kept.
    pub fn encode(result: Result<serde_json::Value, String>, max_bytes: usize) -> String {
        match result {
            Ok(v) => {
                let json = v.to_string();
                if json.len() > max_bytes {
                    format!(
                        "eresult of {} bytes exceeds results.max_bytes ({max_bytes}); not kept",
                        json.len()
                    )
                } else {
                    format!("v{json}")
                }
            }
            Err(e) => format!("e{e}"),
        }
    }

    /// Decodes `res` and its expiry (`rt`, ms) as of `now`; `None` when the run left no result.
    pub fn decode(res: Option<&str>, until_ms: Option<i64>, now: DateTime<Utc>) -> Option<Self> {
        let res = res?;
        if until_ms.is_some_and(|u| u > 0 && u <= now.timestamp_millis()) {
            return Some(Self::Missing("the result is past results.retention".into()));
        }
        Some(match res.split_at_checked(1) {
            Some(("v", json)) => match serde_json::from_str(json) {
                Ok(v) => Self::Value(v),
                Err(e) => Self::Missing(format!("unreadable result: {e}")),
            },
            Some(("e", why)) => Self::Missing(why.to_string()),
            _ => Self::Missing("unreadable result".into()),
        })
    }

    /// The value, if one is kept.
    pub fn value(&self) -> Option<&serde_json::Value> {
        match self {
            Self::Value(v) => Some(v),
            Self::Missing(_) => None,
        }
    }

    /// Why none is kept, if so.
    pub fn missing(&self) -> Option<&str> {
        match self {
            Self::Value(_) => None,
            Self::Missing(why) => Some(why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip_and_unknown_ones_stay_visible() {
        for s in ["run", "dying", "done", "dead", "free", "cancelled", "zombie"] {
            assert_eq!(KeyState::parse(s).as_str(), s);
        }
        assert!(KeyState::parse("done").settled() && KeyState::parse("dead").settled());
        assert!(!KeyState::parse("run").settled());
        assert_eq!(KeyState::parse("zombie"), KeyState::Unknown("zombie".into()));
    }

    #[test]
    fn results_round_trip_and_say_why_none_is_kept() {
        let now = Utc::now();
        let kept = StoredResult::encode(Ok(serde_json::json!({"n": 1})), 100);
        assert_eq!(
            StoredResult::decode(Some(&kept), None, now),
            Some(StoredResult::Value(serde_json::json!({"n": 1})))
        );
        let big = StoredResult::encode(Ok(serde_json::json!("x".repeat(200))), 100);
        assert!(StoredResult::decode(Some(&big), None, now).unwrap().missing().unwrap().contains("exceeds"));
        let past = StoredResult::decode(Some(&kept), Some(now.timestamp_millis() - 1), now).unwrap();
        assert_eq!(past.missing(), Some("the result is past results.retention"));
        assert_eq!(StoredResult::decode(Some("x"), None, now).unwrap().missing(), Some("unreadable result"));
        assert_eq!(StoredResult::decode(None, None, now), None);
    }
}
