//! W3C trace context across the queue, and the hook through which a tracing backend takes
//! part.
//!
//! A producer puts its trace context in the envelope (`trace_id` holds the W3C `traceparent`,
//! `trace_state` the `tracestate`); a publisher in another language may use the AMQP headers
//! `traceparent` and `tracestate` instead (what OpenTelemetry's AMQP instrumentations write).
//! The worker makes its run span a child of that context.
//!
//! The libraries do not depend on OpenTelemetry: a backend (chime's daemons install one when
//! `[telemetry] otlp_endpoint` is set) implements [`Backend`] and [`install`]s it. Without one
//! every function here returns at once: [`enabled`] is one atomic load.

use std::sync::OnceLock;

/// A W3C trace context: `traceparent` (always valid, see [`valid_traceparent`]) and
/// `tracestate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// `00-<trace id, 32 hex>-<parent span id, 16 hex>-<flags, 2 hex>`.
    pub traceparent: String,
    /// Vendor data passed along unchanged (`None`: none).
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// The context `traceparent` and `tracestate` give, `None` when `traceparent` is not a
    /// valid W3C value (such a value is ignored, as the W3C recommends: the trace restarts).
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let traceparent = traceparent.trim();
        valid_traceparent(traceparent).then(|| Self {
            traceparent: traceparent.to_ascii_lowercase(),
            tracestate: tracestate
                .map(str::trim)
                .filter(|s| !s.is_empty() && s.len() <= 512)
                .map(str::to_string),
        })
    }

    /// The trace id (32 hex digits).
    pub fn trace_id(&self) -> &str {
        &self.traceparent[3..35]
    }
}

/// Whether `s` is a W3C `traceparent`: version `00` exactly (a later version: its first four
/// fields), a trace id of 32 and a parent id of 16 hex digits, neither all zeros, flags of 2.
pub fn valid_traceparent(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    let hex = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| b.is_ascii_hexdigit());
    let nonzero = |p: &str| p.bytes().any(|b| b != b'0');
    match parts.as_slice() {
        [version, trace, parent, flags, rest @ ..] => {
            hex(version, 2)
                && !version.eq_ignore_ascii_case("ff")
                && (rest.is_empty() || *version != "00")
                && hex(trace, 32)
                && nonzero(trace)
                && hex(parent, 16)
                && nonzero(parent)
                && hex(flags, 2)
        }
        _ => false,
    }
}

/// What a tracing backend does for chime.
pub trait Backend: Send + Sync + 'static {
    /// The context of the current span (where an enqueue happens), if it is recorded.
    fn current(&self) -> Option<TraceContext>;
    /// Makes `span` a child of `parent` (a context from another process).
    fn adopt(&self, span: &tracing::Span, parent: &TraceContext);
    /// Links `span` to `previous` (an earlier attempt of the same run).
    fn link(&self, span: &tracing::Span, previous: &TraceContext);
}

static BACKEND: OnceLock<Box<dyn Backend>> = OnceLock::new();

/// Installs the process's tracing backend; `false` if one was installed already.
pub fn install(backend: Box<dyn Backend>) -> bool {
    BACKEND.set(backend).is_ok()
}

/// Whether a backend is installed (spans are exported).
pub fn enabled() -> bool {
    BACKEND.get().is_some()
}

/// The current span's context, when a backend records it.
pub fn current() -> Option<TraceContext> {
    BACKEND.get()?.current()
}

/// Makes `span` a child of `parent`, when a backend is installed.
pub fn adopt(span: &tracing::Span, parent: &TraceContext) {
    if let Some(b) = BACKEND.get() {
        b.adopt(span, parent);
    }
}

/// Links `span` to an earlier attempt's span, when a backend is installed.
pub fn link(span: &tracing::Span, previous: &TraceContext) {
    if let Some(b) = BACKEND.get() {
        b.link(span, previous);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_read_as_the_w3c_defines_them() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = TraceContext::parse(good, Some("congo=t61rcWkgMzE")).unwrap();
        assert_eq!(c.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(c.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
        assert!(TraceContext::parse(&good.to_uppercase(), None).is_some_and(|c| c.traceparent == good));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01",
        ] {
            assert!(TraceContext::parse(bad, None).is_none(), "{bad}");
        }
        // A later version may add fields after the four it shares with 00.
        assert!(valid_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz"));
        assert!(!enabled() && current().is_none());
    }
}
