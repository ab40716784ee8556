//! What every part of chime must agree on: the configuration, the wire envelope and its keys,
//! job types ([`job::Job`]), every broker and Redis name ([`names`]), declaring the topology,
//! the Redis idempotency table, cron schedules with Vixie-cron DST rules, AMQP helpers, and
//! metric names. It is the only chime crate both a service that enqueues and a worker binary
//! compile; it carries no HTTP server, CLI parser, exporter or log subscriber.
//!
//! ```
//! use chime_shared::Config;
//!
//! let config = Config::from_toml_str(r#"
//!     prefix = "billing"
//!     [[jobs]]
//!     name = "nightly-report"
//!     handler = "exec"
//!     command = ["/usr/local/bin/report"]
//!     schedule = "30 2 * * *"
//!     timezone = "Europe/Berlin"
//! "#).unwrap();
//! assert_eq!(config.all_queues(), ["default"]);
//!
//! // The same slot always has the same idempotency key, on every ticker replica.
//! let slot = "2026-03-29T01:00:00Z".parse().unwrap();
//! let key = chime_shared::envelope::scheduled_key("nightly-report", slot);
//! assert_eq!(key.to_string(), "6c94badc-ac49-57fc-aff9-efaefacce06b");
//! ```

#![warn(missing_docs)]

pub mod amqp;
pub mod calendar;
pub mod catalog;
pub mod config;
pub mod control;
pub mod delay;
pub use chime_job::duration;
pub use chime_protocol::envelope;
pub mod group;
pub mod health;
pub mod history;
pub mod idempotency;
pub mod job;
pub mod minutes;
pub use chime_protocol::names;
pub use idempotency::{circuit, limit, workflow};
pub mod record;
pub mod redact;
pub mod redis_conn;
pub mod schedule;
pub mod shed;
pub mod spools;
pub mod telemetry;
pub mod tls;
pub mod topology;
pub mod trace;

pub use config::{Config, ConfigError, ValidConfig};
pub use envelope::{Envelope, Source};
pub use topology::Names;

/// Cases per property test over outside input: `CHIME_FUZZ_CASES`, else `default` (CI runs
/// the defaults; a longer local run raises it).
#[doc(hidden)]
pub use chime_protocol::fuzz_cases;
