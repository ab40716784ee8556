//! chime's enqueue client: what a service that pushes jobs depends on.
//!
//! Jobs are published persistent, mandatory and confirmed: [`EnqueueClient::enqueue`] returns
//! only once the broker holds the job (a message it cannot route is an error, never a silent
//! drop). A typed job is any [`Job`]; the untyped [`EnqueueRequest`] serves jobs defined only
//! in the config (`exec`, `http`, other languages).
//!
//! ```no_run
//! use chime_producer::{EnqueueClient, EnqueueRequest, Job};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct SendWelcome { user_id: u64 }
//! impl Job for SendWelcome { const NAME: &'static str = "send_welcome"; }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // The config is validated on load (a config built in code: `Config::validated`).
//! let client = EnqueueClient::connect(chime_shared::Config::load(None)?).await?;
//! let done = client.enqueue(SendWelcome { user_id: 42 }).await?;          // typed
//! println!("confirmed, key {}", done.key);
//! client.enqueue(EnqueueRequest::new("nightly-report").key("2026-12-01")).await?; // by name
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod enqueue;
pub mod spool;
mod wait;

pub use chime_shared::job::{Job, JobOptions};
pub use enqueue::flush::{FlushReport, flush_at_start, flush_spool};
pub use enqueue::workflow::{MAX_STEPS, StepRequest, WorkflowEnqueued, WorkflowRequest};
pub use enqueue::{
    BatchReport, Delivery, Encoded, EnqueueClient, EnqueueError, EnqueueRequest, Enqueued, IntoRequest,
    LineShape, Pack, Prepared, packs, parse_batch_line, parse_batch_line_shaped, prepare, prepare_owned,
};
pub use wait::{Finished, MemberFinished, WaitError};
