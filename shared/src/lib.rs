//! Shared contracts of chime: configuration, the wire envelope, topology names and
//! declaration, the Redis idempotency store, AMQP connection helpers and telemetry names.
//!
//! Both the producer (`chime`) and the worker (`chime-worker`) depend on this crate, so
//! everything that must agree between them lives here and nowhere else.

pub mod amqp;
pub mod config;
pub mod delay;
pub mod duration;
pub mod envelope;
pub mod health;
pub mod idempotency;
pub mod names;
pub mod schedule;
pub mod signals;
pub mod telemetry;
pub mod topology;

pub use config::{Config, ConfigError};
pub use envelope::{Envelope, Source};
pub use topology::Names;
