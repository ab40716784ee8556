//! chime's worker runtime: consume with manual acks, deduplicate through Redis, run
//! handlers under a timeout with a renewed lease, and settle every delivery exactly once.
//!
//! ```no_run
//! use chime_worker::{JobContext, JobError, Registry, Worker, handler_fn};
//! # async fn demo(config: chime_shared::Config, token: tokio_util::sync::CancellationToken) {
//! #[derive(serde::Deserialize)]
//! struct Invoice { id: u64 }
//! let mut registry = Registry::new();
//! registry.register("send_invoice", handler_fn(|ctx: JobContext, inv: Invoice| async move {
//!     println!("invoice {} (key {}, fence {})", inv.id, ctx.key, ctx.fence);
//!     Ok::<_, JobError>(())
//! }));
//! let worker = Worker::builder(config).registry(registry).build().unwrap();
//! worker.run(token).await.unwrap();
//! # }
//! ```

mod ack;
pub mod builtin;
mod decision;
pub mod handler;
mod process;
pub mod retry;
pub mod runtime;
mod state;
mod store;

pub use handler::{Handler, JobContext, JobError, Registry, handler_fn, raw_handler_fn};
pub use retry::DeadReason;
pub use runtime::{Reloader, Stats, Worker, WorkerBuilder, WorkerError};
