//! `http`: POSTs the payload as JSON.
//!
//! Mapping: 2xx = success; 408, 425, 429 and 5xx = transient; other 4xx = permanent (the
//! request itself is wrong; sending it again cannot help); connection errors and timeouts
//! = transient. Headers `X-Chime-Job`, `X-Chime-Key`, `X-Chime-Attempt`, `X-Chime-Fence`
//! and `Idempotency-Key` (= the key) let the receiving service deduplicate.

use futures_util::future::BoxFuture;

use crate::handler::{Handler, JobContext, JobError};

pub struct HttpHandler {
    url: String,
    client: reqwest::Client,
}

impl HttpHandler {
    pub fn new(url: String) -> Self {
        Self { url, client: reqwest::Client::new() }
    }
}

/// Classifies a response status.
pub fn classify(status: u16) -> Result<(), JobError> {
    match status {
        200..=299 => Ok(()),
        408 | 425 | 429 | 500..=599 => Err(JobError::Transient(format!("HTTP {status}"))),
        _ => Err(JobError::Permanent(format!("HTTP {status}"))),
    }
}

impl Handler for HttpHandler {
    fn call(&self, ctx: JobContext, payload: serde_json::Value) -> BoxFuture<'static, Result<(), JobError>> {
        let req = self
            .client
            .post(&self.url)
            .timeout(ctx.timeout)
            .header("content-type", "application/json")
            .header("x-chime-job", ctx.job.as_str())
            .header("x-chime-key", ctx.key.to_string())
            .header("idempotency-key", ctx.key.to_string())
            .header("x-chime-attempt", ctx.attempt.to_string())
            .header("x-chime-fence", ctx.fence.to_string())
            .body(serde_json::to_vec(&payload).unwrap_or_default());
        Box::pin(async move {
            let resp = req.send().await.map_err(|e| JobError::Transient(format!("request failed: {e}")))?;
            classify(resp.status().as_u16())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_mapping() {
        assert!(classify(204).is_ok());
        assert!(matches!(classify(400), Err(JobError::Permanent(_))));
        assert!(matches!(classify(404), Err(JobError::Permanent(_))));
        assert!(matches!(classify(429), Err(JobError::Transient(_))));
        assert!(matches!(classify(503), Err(JobError::Transient(_))));
    }
}
