//! chime's wire protocol: what a producer in any language must write for a chime worker to
//! run it, and where.
//!
//! - [`envelope`]: the JSON job envelope, its AMQP properties and headers, and the
//!   idempotency keys derived from a job and its key or slot;
//! - [`names`]: the exchanges, queues and Redis keys of a prefix.
//!
//! It compiles without Redis or TLS; `chime-shared` re-exports both modules under the same
//! paths.

#![warn(missing_docs)]

pub mod envelope;
pub mod names;

pub use envelope::{Envelope, Source};

use std::borrow::Cow;

/// `text` with control characters (newlines, ESC, …) escaped, so text from the wire cannot
/// forge log lines or terminal output.
pub fn escape_control(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(
        text.chars()
            .flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] })
            .collect(),
    )
}

/// Cases each property test runs: `CHIME_FUZZ_CASES`, else `default`.
#[doc(hidden)]
pub fn fuzz_cases(default: u32) -> u32 {
    std::env::var("CHIME_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}
