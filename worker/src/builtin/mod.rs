//! Built-in handlers: `exec`, `http` and `noop`, built per job from its config.

pub mod exec;
#[cfg(feature = "http")]
pub mod http;

use chime_shared::config::{HandlerConfig, JobConfig, WorkerConfig};
use std::sync::Arc;

use crate::handler::{Handler, raw_handler_fn};

/// Names of the built-in handlers (`http` needs the crate's `http` feature).
pub const BUILTINS: [&str; 3] = ["exec", "http", "noop"];

/// The built-in handler for `job`, or `None` if it names a Rust-registered handler.
pub fn for_job(job: &JobConfig, worker: &WorkerConfig) -> Option<Arc<dyn Handler>> {
    match &job.handler {
        HandlerConfig::Noop => Some(raw_handler_fn(|_, _| async { Ok(()) })),
        HandlerConfig::Exec(exec) => {
            let names = worker.pass_env.iter().chain(&exec.pass_env);
            let env = exec::environment(names.map(String::as_str));
            Some(Arc::new(
                exec::ExecHandler::new(exec.command.clone(), exec.permanent_exit_codes.clone(), env)
                    .with_rate_limited_exit_codes(exec.rate_limited_exit_codes.clone()),
            ))
        }
        HandlerConfig::Http { url } => http_handler(url),
        HandlerConfig::Registered(_) => None,
    }
}

#[cfg(feature = "http")]
fn http_handler(url: &str) -> Option<Arc<dyn Handler>> {
    Some(Arc::new(http::HttpHandler::new(url.to_string())))
}

/// Without the `http` feature no `http` handler exists: a job that needs one is a config
/// error naming it when the worker is built.
#[cfg(not(feature = "http"))]
fn http_handler(_: &str) -> Option<Arc<dyn Handler>> {
    None
}
