//! Typed jobs: re-exported from `chime-job`, the crate a crate that only defines jobs depends
//! on (serde and a duration parser, nothing of RabbitMQ, Redis or TLS). A `[[jobs]]` entry of
//! the same name overrides a typed job's options: [`crate::config::JobConfig::over`].

pub use chime_job::{BackoffConfig, InvalidOption, Job, JobOptions, MAX_ATTEMPTS, MAX_CONCURRENCY};
