//! What chime's daemons (`chime tick`, `chime watch`, `chime-worker`) share and libraries do
//! not need: the bounded HTTP server for `/livez`, `/readyz` and `/metrics`, the Prometheus
//! recorder, the log subscriber, and signal handling. A service that only enqueues, or a custom
//! worker binary that brings its own, never compiles this crate.

#![warn(missing_docs)]

pub mod connections;
pub mod server;
pub mod signals;
pub mod telemetry;
pub mod traces;
