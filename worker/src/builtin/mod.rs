//! Built-in handlers: `exec`, `http` and `noop`, built per job from its config.

pub mod exec;
pub mod http;

use chime_shared::config::{JobConfig, WorkerConfig};
use std::sync::Arc;

use crate::handler::{Handler, raw_handler_fn};

/// Names of the built-in handlers.
pub const BUILTINS: [&str; 3] = ["exec", "http", "noop"];

/// The built-in handler for `job`, or `None` if it names a Rust-registered handler.
pub fn for_job(job: &JobConfig, worker: &WorkerConfig) -> Option<Arc<dyn Handler>> {
    match job.handler.as_str() {
        "noop" => Some(raw_handler_fn(|_, _| async { Ok(()) })),
        "exec" => {
            let command = job.command.clone().unwrap_or_default();
            let names = worker.pass_env.iter().chain(job.pass_env.iter().flatten());
            let env = exec::environment(names.map(String::as_str));
            Some(Arc::new(exec::ExecHandler::new(command, job.permanent_exit_codes(), env)))
        }
        "http" => Some(Arc::new(http::HttpHandler::new(job.url.clone().unwrap_or_default()))),
        _ => None,
    }
}
