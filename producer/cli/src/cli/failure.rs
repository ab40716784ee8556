//! Exit codes: 2 for usage and config errors, 1 at run time.

use chime_producer::EnqueueError;

/// A failure with its exit code: 2 for usage and config errors, 1 at run time.
#[derive(Debug)]
pub struct Failure {
    /// The process exit code.
    pub code: i32,
    /// What went wrong.
    pub error: anyhow::Error,
}

/// A usage or config error (exit code 2).
pub fn usage(error: impl Into<anyhow::Error>) -> Failure {
    Failure { code: 2, error: error.into() }
}

/// A run-time failure (exit code 1).
pub fn runtime(error: impl Into<anyhow::Error>) -> Failure {
    Failure { code: 1, error: error.into() }
}

/// An enqueue error with the exit code its kind calls for.
pub fn from_enqueue(e: EnqueueError) -> Failure {
    if e.is_usage() { usage(e) } else { runtime(e) }
}
