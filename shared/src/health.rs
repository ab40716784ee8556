//! Readiness checks, set by the runtime as dependencies come and go, and served by the
//! daemons' `/readyz` (`chime-daemon`). `amqp` and `redis` are mirrored in `chime_up`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::telemetry;

/// Readiness checks, set by the runtime as dependencies come and go.
#[derive(Clone, Default)]
pub struct Health {
    checks: Arc<Mutex<BTreeMap<&'static str, bool>>>,
}

impl Health {
    /// Health with these checks, all failing until set.
    pub fn new(checks: &[&'static str]) -> Self {
        let h = Self::default();
        for c in checks {
            h.set(c, false);
        }
        h
    }

    /// Sets a check; `amqp` and `redis` are mirrored in `chime_up{dependency}`.
    pub fn set(&self, check: &'static str, ok: bool) {
        if let Ok(mut m) = self.checks.lock() {
            m.insert(check, ok);
        }
        if matches!(check, "amqp" | "redis") {
            metrics::gauge!(telemetry::UP, "dependency" => check).set(if ok { 1.0 } else { 0.0 });
        }
    }

    /// Whether a check passes (an unknown check does not).
    pub fn get(&self, check: &str) -> bool {
        self.checks.lock().map(|m| m.get(check).copied().unwrap_or(false)).unwrap_or(false)
    }

    /// Whether every check passes.
    pub fn ready(&self) -> bool {
        self.checks.lock().map(|m| m.values().all(|v| *v)).unwrap_or(false)
    }

    /// The checks as a JSON object (`{"amqp":true,…}`).
    pub fn report(&self) -> String {
        let map: BTreeMap<&str, bool> =
            self.checks.lock().map(|m| m.iter().map(|(k, v)| (*k, *v)).collect()).unwrap_or_default();
        serde_json::to_string(&map).unwrap_or_default()
    }
}
