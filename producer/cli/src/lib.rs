//! The `chime` command and the daemons it runs: the ticker (`chime tick`), the DLQ tools
//! (`chime dlq`), the alert monitor (`chime watch`). Not a library for services: they depend
//! on `chime-producer` (enqueue) or `chime-worker` (handlers).

pub mod cli;
pub mod dlq;
pub mod lease;
pub mod monitor;
pub mod overlap;
pub mod ticker;
