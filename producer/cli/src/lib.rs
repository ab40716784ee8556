//! The `chime` command, a thin binary over the libraries: the ticker and the alert monitor
//! (`chime tick`, `chime watch`) are `chime-scheduler`; this crate adds the command line, the
//! DLQ tools (`chime dlq`) and the dashboard (`chime web`). Not a library for services: they
//! depend on `chime-producer` (enqueue), `chime-worker` (handlers) or `chime-scheduler`.

pub mod cli;
pub mod dlq;
