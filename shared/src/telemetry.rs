//! Metric names (the only place they are spelled), their descriptions and label values.
//! Libraries only emit through `metrics`; the daemons install the recorder (`chime-daemon`).

/// Counter: messages published and confirmed (`job`, `source`).
pub const JOBS_PUBLISHED: &str = "chime_jobs_published_total";
/// Counter: deliveries finished (`job`, `outcome`).
pub const JOBS_COMPLETED: &str = "chime_jobs_completed_total";
/// Histogram: handler run time in seconds (`job`).
pub const JOB_DURATION: &str = "chime_job_duration_seconds";
/// Histogram: handler start minus slot or enqueue time (`job`).
pub const JOB_LAG: &str = "chime_job_lag_seconds";
/// Counter: slots older than the catch-up window (`job`).
pub const SLOTS_MISSED: &str = "chime_slots_missed_total";
/// Counter: slots skipped because their schedule was paused (`job`).
pub const SLOTS_PAUSED: &str = "chime_slots_paused_total";
/// Counter: slots not published because the job's previous run was still in progress
/// (`overlap = "skip"`, or `"buffer_one"` with a slot already waiting) (`job`).
pub const SLOTS_OVERLAPPED: &str = "chime_slots_overlapped_total";
/// Counter: slots held until the job's previous run ended (`overlap = "buffer_one"`) (`job`).
pub const SLOTS_BUFFERED: &str = "chime_slots_buffered_total";
/// Gauge: ready messages in a work queue (`queue`).
pub const QUEUE_MESSAGES: &str = "chime_queue_messages";
/// Gauge: ready messages in a dead-letter queue (`queue`).
pub const DLQ_MESSAGES: &str = "chime_dlq_messages";
/// Gauge: 1 while this ticker holds the leader lease.
pub const TICKER_LEADER: &str = "chime_ticker_leader";
/// Gauge: local clock minus Redis `TIME`, in seconds.
pub const TICKER_CLOCK_SKEW: &str = "chime_ticker_clock_skew_seconds";
/// Gauge: jobs a worker process may run at once (`worker.concurrency`); one series per worker
/// process, so `count(chime_worker_concurrency)` is the number of workers.
pub const WORKER_CONCURRENCY: &str = "chime_worker_concurrency";
/// Gauge: jobs a worker process is running now.
pub const WORKER_RUNNING: &str = "chime_worker_running";
/// Gauge: 1 when the dependency answers (`dependency` = `amqp` or `redis`).
pub const UP: &str = "chime_up";
/// Counter: DLQ alert notifications posted to `alerts.webhook` (`queue`, `result`: `sent`,
/// `rejected` by the receiver with a 4xx, not retried, or `gave_up` after the retries).
pub const ALERT_NOTIFICATIONS: &str = "chime_alert_notifications_total";
/// Counter: runs parked (`job`, `reason`: `rate_limit`, `global_concurrency` or
/// `pushed_back`): sent round the delay chain to wait, their attempt unchanged.
pub const RUNS_PARKED: &str = "chime_runs_parked_total";
/// Counter: scheduled slots the ticker did not publish because their queue was shedding
/// (`job`; a `sheddable` job).
pub const SLOTS_SHED: &str = "chime_slots_shed_total";
/// Counter: scheduled slots its business calendar skips (`job`, `reason`: `holiday` or
/// `not_working_day`; `on_holiday = "skip"`).
pub const SLOTS_CALENDAR_SKIPPED: &str = "chime_slots_calendar_skipped_total";
/// Gauge: a worker's clock less Redis `TIME`, in seconds (the worker judges deadlines and
/// waits by Redis's clock).
pub const WORKER_CLOCK_SKEW: &str = "chime_worker_clock_skew_seconds";
/// Gauge: 1 while this worker sheds the `sheddable` runs of a queue (`queue`).
pub const QUEUE_SHEDDING: &str = "chime_queue_shedding";
/// Gauge: the longest a run this worker took from a queue with a shedding threshold had
/// waited in it, in seconds, over the last reading's second (`queue`; set when it took one):
/// what load shedding compares with `max_age`.
pub const QUEUE_WAIT: &str = "chime_queue_wait_seconds";
/// Gauge: the state of a circuit breaker as a worker last saw it (`circuit`): 0 closed, 1
/// half-open, 2 open.
pub const CIRCUIT_STATE: &str = "chime_circuit_state";
/// Counter: circuit breaker state changes a worker made (`circuit`, `to`: `open` or `closed`).
pub const CIRCUIT_TRANSITIONS: &str = "chime_circuit_transitions_total";
/// Counter: jobs a producer wrote to its local spool because the broker did not confirm them
/// (`job`).
pub const JOBS_SPOOLED: &str = "chime_jobs_spooled_total";
/// Counter: spooled jobs published and confirmed by a flush (`job`).
pub const SPOOL_FLUSHED: &str = "chime_spool_flushed_total";
/// Gauge: bytes in the spool directory, as this process last read it.
pub const SPOOL_BYTES: &str = "chime_spool_bytes";

/// Every metric name above (tests check dashboards and alert rules against it).
pub const ALL: &[&str] = &[
    JOBS_PUBLISHED,
    JOBS_COMPLETED,
    JOB_DURATION,
    JOB_LAG,
    SLOTS_MISSED,
    SLOTS_PAUSED,
    SLOTS_OVERLAPPED,
    SLOTS_BUFFERED,
    QUEUE_MESSAGES,
    DLQ_MESSAGES,
    TICKER_LEADER,
    TICKER_CLOCK_SKEW,
    WORKER_CONCURRENCY,
    WORKER_RUNNING,
    UP,
    ALERT_NOTIFICATIONS,
    RUNS_PARKED,
    CIRCUIT_STATE,
    CIRCUIT_TRANSITIONS,
    SLOTS_SHED,
    SLOTS_CALENDAR_SKIPPED,
    QUEUE_SHEDDING,
    QUEUE_WAIT,
    WORKER_CLOCK_SKEW,
    JOBS_SPOOLED,
    SPOOL_FLUSHED,
    SPOOL_BYTES,
];

/// Values of the `outcome` label of [`JOBS_COMPLETED`].
pub mod outcome {
    /// The handler succeeded and `done` was recorded.
    pub const SUCCEEDED: &str = "succeeded";
    /// A retry was published to the delay chain.
    pub const RETRIED: &str = "retried";
    /// The message went to its DLQ.
    pub const DEAD_LETTERED: &str = "dead_lettered";
    /// Acked without running: the key was done, dead or busy.
    pub const DUPLICATE: &str = "duplicate";
    /// A scheduled run older than its job's `expires` was dropped.
    pub const EXPIRED: &str = "expired";
    /// A `sheddable` run skipped while its queue was above its shedding threshold.
    pub const SHED: &str = "shed";
    /// Cancelled (`chime cancel`): a run stopped, or a copy of a cancelled key dropped.
    pub const CANCELLED: &str = "cancelled";
    /// An older copy of a key a newer enqueue replaced (debounce, replace), dropped.
    pub const SUPERSEDED: &str = "superseded";
}

/// Label used instead of a job name that is not in the config (keeps cardinality bounded).
pub const UNKNOWN_JOB_LABEL: &str = "_unknown";

/// Registers the descriptions of every metric with the installed recorder.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(JOBS_PUBLISHED, "Messages published and confirmed, by job and source.");
    describe_counter!(JOBS_COMPLETED, "Deliveries finished, by job and outcome.");
    describe_histogram!(JOB_DURATION, metrics::Unit::Seconds, "Handler run time.");
    describe_histogram!(JOB_LAG, metrics::Unit::Seconds, "Handler start minus slot (or enqueue time).");
    describe_counter!(SLOTS_MISSED, "Scheduled slots older than the catch-up window.");
    describe_counter!(SLOTS_PAUSED, "Scheduled slots skipped while their schedule was paused.");
    describe_counter!(SLOTS_OVERLAPPED, "Scheduled slots skipped because the previous run was in progress.");
    describe_counter!(SLOTS_BUFFERED, "Scheduled slots held until the previous run ended (buffer_one).");
    describe_gauge!(QUEUE_MESSAGES, "Ready messages in a work queue.");
    describe_gauge!(DLQ_MESSAGES, "Ready messages in a dead-letter queue.");
    describe_gauge!(TICKER_LEADER, "1 while this ticker holds the leader lease.");
    describe_gauge!(TICKER_CLOCK_SKEW, "Local clock minus Redis TIME.");
    describe_gauge!(UP, "1 when the dependency answers, by dependency.");
    describe_gauge!(WORKER_CONCURRENCY, "Jobs this worker process may run at once.");
    describe_gauge!(WORKER_RUNNING, "Jobs this worker process is running now.");
    describe_counter!(
        ALERT_NOTIFICATIONS,
        "Alert notifications posted to the webhook, by queue (or circuit:<name>) and result."
    );
    describe_counter!(RUNS_PARKED, "Runs parked on the delay chain to wait, by job and reason.");
    describe_gauge!(CIRCUIT_STATE, "Circuit breaker state last seen: 0 closed, 1 half-open, 2 open.");
    describe_counter!(CIRCUIT_TRANSITIONS, "Circuit breaker state changes, by circuit and new state.");
    describe_counter!(SLOTS_SHED, "Scheduled slots not published because their queue was shedding.");
    describe_counter!(
        SLOTS_CALENDAR_SKIPPED,
        "Scheduled slots skipped by their business calendar (holiday, day off)."
    );
    describe_gauge!(QUEUE_SHEDDING, "1 while this worker sheds the sheddable runs of the queue.");
    describe_gauge!(WORKER_CLOCK_SKEW, "This worker's clock minus Redis TIME.");
    describe_gauge!(
        QUEUE_WAIT,
        "The longest a run taken from the queue in the last second had waited in it (queues with a shedding threshold)."
    );
    describe_counter!(
        JOBS_SPOOLED,
        "Jobs written to the local spool because the broker did not confirm them."
    );
    describe_counter!(SPOOL_FLUSHED, "Spooled jobs published and confirmed by a flush.");
    describe_gauge!(SPOOL_BYTES, "Bytes in the spool directory, as this process last read it.");
}
