//! Metric names (the only place they are spelled), their descriptions, label values, and
//! the Prometheus recorder that binaries install. Libraries only emit through `metrics`;
//! they never install a recorder.

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

pub const JOBS_PUBLISHED: &str = "chime_jobs_published_total";
pub const JOBS_COMPLETED: &str = "chime_jobs_completed_total";
pub const JOB_DURATION: &str = "chime_job_duration_seconds";
pub const JOB_LAG: &str = "chime_job_lag_seconds";
pub const SLOTS_MISSED: &str = "chime_slots_missed_total";
pub const QUEUE_MESSAGES: &str = "chime_queue_messages";
pub const DLQ_MESSAGES: &str = "chime_dlq_messages";
pub const TICKER_LEADER: &str = "chime_ticker_leader";
pub const TICKER_CLOCK_SKEW: &str = "chime_ticker_clock_skew_seconds";
pub const UP: &str = "chime_up";

/// Values of the `outcome` label of [`JOBS_COMPLETED`].
pub mod outcome {
    pub const SUCCEEDED: &str = "succeeded";
    pub const RETRIED: &str = "retried";
    pub const DEAD_LETTERED: &str = "dead_lettered";
    pub const DUPLICATE: &str = "duplicate";
    pub const EXPIRED: &str = "expired";
}

/// Label used instead of a job name that is not in the config (keeps cardinality bounded).
pub const UNKNOWN_JOB_LABEL: &str = "_unknown";

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

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(JOBS_PUBLISHED, "Messages published and confirmed, by job and source.");
    describe_counter!(JOBS_COMPLETED, "Deliveries finished, by job and outcome.");
    describe_histogram!(JOB_DURATION, metrics::Unit::Seconds, "Handler run time.");
    describe_histogram!(JOB_LAG, metrics::Unit::Seconds, "Handler start minus slot (or enqueue time).");
    describe_counter!(SLOTS_MISSED, "Scheduled slots older than the catch-up window.");
    describe_gauge!(QUEUE_MESSAGES, "Ready messages in a work queue.");
    describe_gauge!(DLQ_MESSAGES, "Ready messages in a dead-letter queue.");
    describe_gauge!(TICKER_LEADER, "1 while this ticker holds the leader lease.");
    describe_gauge!(TICKER_CLOCK_SKEW, "Local clock minus Redis TIME.");
    describe_gauge!(UP, "1 when the dependency answers, by dependency.");
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`); JSON lines when
/// `CHIME_LOG_FORMAT=json`. Binaries call this once.
pub fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    if std::env::var("CHIME_LOG_FORMAT").is_ok_and(|v| v == "json") {
        let _ = builder.json().flatten_event(true).try_init();
    } else {
        let _ = builder.try_init();
    }
}
