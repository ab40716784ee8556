//! chime's producer side: the enqueue client (a library API for services that push jobs),
//! and the `chime` operations CLI built on it. The ticker lands here too.

pub mod cli;
pub mod enqueue;

pub use enqueue::{BatchReport, EnqueueClient, EnqueueError, EnqueueRequest, Enqueued};
