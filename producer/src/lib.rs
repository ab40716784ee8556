//! chime's producer side: the enqueue client (a library API for services that push jobs),
//! and the `chime` operations CLI built on it. The ticker lands here too.

pub mod cli;
mod cli_dlq;
mod cli_ops;
pub mod dlq;
pub mod enqueue;
pub mod lease;
pub mod monitor;
pub mod ticker;

pub use enqueue::{BatchReport, EnqueueClient, EnqueueError, EnqueueRequest, Enqueued};
