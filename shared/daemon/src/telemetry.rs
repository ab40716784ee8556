//! The Prometheus recorder and the log subscriber, installed once by each daemon.

use chime_shared::telemetry::describe;
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0,
];

/// Installs the global Prometheus recorder (binaries only) with explicit histogram buckets,
/// so histograms aggregate across replicas instead of rendering as summaries.
pub fn install_recorder() -> Result<PrometheusHandle, BuildError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?
        .install_recorder()?;
    describe();
    Ok(handle)
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`); JSON lines when
/// `CHIME_LOG_FORMAT=json`. Binaries call this (or `traces::init`, which exports spans as
/// well) once.
pub fn init_tracing() {
    crate::traces::subscriber(None);
}
