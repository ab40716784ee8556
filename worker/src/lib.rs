//! chime's worker runtime: consume jobs from RabbitMQ with manual acks, deduplicate them
//! through Redis, run handlers under a timeout with a renewed lease, and settle every
//! delivery exactly once — acked only after its outcome is durable.
//!
//! Define a job once as a type (shared with the code that enqueues it), write its handler
//! as a plain `async fn`, register shared state once, and run:
//!
//! ```no_run
//! use chime_worker::{Job, JobContext, JobError, Registry, State, Worker};
//! use tokio_util::sync::CancellationToken;
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct SendWelcome { user_id: u64 }
//! impl Job for SendWelcome { const NAME: &'static str = "send_welcome"; }
//!
//! #[derive(Clone)]
//! struct Mailer; // a client or a pool: cheap to clone, shared by every run
//!
//! async fn send_welcome(ctx: JobContext, job: SendWelcome, State(mailer): State<Mailer>) -> Result<(), JobError> {
//!     if job.user_id == 0 {
//!         return Err(JobError::permanent("no such user")); // straight to the DLQ
//!     }
//!     let _ = (mailer, ctx.key()); // store ctx.key() with the effect for exactly-once effects
//!     Ok(())                        // any error converts with `?` (transient: retried)
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = chime_shared::Config::load(None)?;
//! let mut registry = Registry::new();
//! registry.state(Mailer).job(send_welcome);
//! let token = CancellationToken::new(); // cancel it to drain and stop
//! Worker::builder(config).registry(registry).build()?.run(token).await?;
//! # Ok(()) }
//! ```
//!
//! Jobs defined only in the config run through the built-in handlers (`exec`, `noop`, and
//! `http` with the crate's `http` feature) or [`Registry::register`]. The library installs no
//! signal handler, log subscriber or metrics recorder: the binary owns them.
//! `examples/shared_state.rs` and `examples/cancellation.rs` are complete programs.

#![warn(missing_docs)]

mod ack;
pub mod builtin;
mod decision;
pub mod handler;
mod parks;
mod process;
pub mod retry;
pub mod runtime;
mod state;
mod store;
pub mod testing;

pub use chime_shared::job::{Job, JobOptions};
pub use handler::{
    Handler, JobContext, JobError, JobFn, MAX_PUSH_BACK, Registry, State, handler_fn, raw_handler_fn,
};
pub use retry::DeadReason;
pub use runtime::{Reloader, Stats, Worker, WorkerBuilder, WorkerError};
