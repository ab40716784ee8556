//! Spans over OTLP (`[telemetry] otlp_endpoint`): the OpenTelemetry layer of the daemons' log
//! subscriber, and the backend of `chime_shared::trace` that carries W3C trace context
//! across the queue.
//!
//! Off unless the endpoint is set: the layer is `None` and no backend is installed, so the
//! libraries make no span of their own and read no trace header.

use chime_shared::config::TelemetryConfig;
use chime_shared::trace::{self, TraceContext};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Registry;

/// The OpenTelemetry layer, over the registry.
pub(crate) type OtelLayer =
    tracing_opentelemetry::OpenTelemetryLayer<Registry, opentelemetry_sdk::trace::Tracer>;

/// How long an export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Spans being exported; dropping it sends what is buffered (waiting at most 10 s).
#[derive(Debug)]
pub struct Otlp {
    provider: SdkTracerProvider,
}

impl Drop for Otlp {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "spans not all exported at exit");
        }
    }
}

/// Sets up logging as `telemetry::init_tracing` does and, with `config.otlp_endpoint` set,
/// exports spans there as `service` (`chime-worker`, `chime`); `Ok(None)` when it is unset.
/// Call once, instead of `init_tracing`; keep the guard until exit.
pub fn init(config: &TelemetryConfig, service: &'static str) -> Result<Option<Otlp>, String> {
    let Some(url) = config.traces_url() else {
        subscriber(None);
        return Ok(None);
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .with_endpoint(url.clone())
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(Client::default())
        .build()
        .map_err(|e| format!("telemetry.otlp_endpoint {url:?}: {e}"))?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service).build())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("chime"));
    if !subscriber(Some(layer)) {
        return Err("traces: a log subscriber was set up already".into());
    }
    trace::install(Box::new(Backend));
    tracing::info!(endpoint = %chime_shared::redact::redact_text(&url), "exporting spans over OTLP");
    Ok(Some(Otlp { provider }))
}

/// The log subscriber (`telemetry::init_tracing`), with the OpenTelemetry layer when there is
/// one (the filter applies to spans too: `RUST_LOG=warn` exports none). `false` when a
/// subscriber was set already.
pub(crate) fn subscriber(otel: Option<OtelLayer>) -> bool {
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi);
    let base = Registry::default().with(otel).with(filter);
    let installed = if std::env::var("CHIME_LOG_FORMAT").is_ok_and(|v| v == "json") {
        base.with(fmt.json().flatten_event(true)).try_init()
    } else {
        base.with(fmt).try_init()
    };
    installed.is_ok()
}

/// `chime_shared::trace`'s backend: W3C context in and out of tracing's spans.
struct Backend;

fn extract(t: &TraceContext) -> opentelemetry::Context {
    let mut carrier = HashMap::from([("traceparent".to_string(), t.traceparent.clone())]);
    if let Some(s) = &t.tracestate {
        carrier.insert("tracestate".into(), s.clone());
    }
    TraceContextPropagator::new().extract(&carrier)
}

impl trace::Backend for Backend {
    fn current(&self) -> Option<TraceContext> {
        let cx = tracing::Span::current().context();
        if !cx.span().span_context().is_valid() {
            return None;
        }
        let mut carrier = HashMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        TraceContext::parse(carrier.get("traceparent")?, carrier.get("tracestate").map(String::as_str))
    }

    fn adopt(&self, span: &tracing::Span, parent: &TraceContext) {
        let _ = span.set_parent(extract(parent));
    }

    fn link(&self, span: &tracing::Span, previous: &TraceContext) {
        let cx = extract(previous);
        let sc = cx.span().span_context().clone();
        if sc.is_valid() {
            span.add_link(sc);
        }
    }
}

/// The exporter's HTTP client: the workspace's reqwest, blocking (the batch processor exports
/// from a thread of its own), made on that thread at the first export.
#[derive(Debug, Default)]
struct Client {
    inner: OnceLock<Result<reqwest::blocking::Client, String>>,
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Client {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let client = self
            .inner
            .get_or_init(|| {
                reqwest::blocking::Client::builder()
                    .timeout(EXPORT_TIMEOUT)
                    .build()
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| e.clone())?;
        let (parts, body) = request.into_parts();
        let mut req = client.request(parts.method, parts.uri.to_string()).body(body.to_vec());
        for (name, value) in &parts.headers {
            req = req.header(name, value);
        }
        let resp = req.send()?;
        let mut out = http::Response::builder().status(resp.status());
        for (name, value) in resp.headers() {
            out = out.header(name, value);
        }
        Ok(out.body(resp.bytes()?)?)
    }
}
