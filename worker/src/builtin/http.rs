//! `http`: POSTs the payload as JSON.
//!
//! Mapping: 2xx = success; 429, and 503 with a `Retry-After`, = the downstream pushed back
//! (`JobError::rate_limited` for the `Retry-After` it gave, in seconds or as an HTTP date,
//! else 1 s: the run is parked, not counted, and the job's rate limit holds that long); 408,
//! 425 and 5xx = transient; other 4xx = permanent (the request itself is wrong; sending it
//! again cannot help); connection errors and timeouts = transient. Headers `X-Chime-Job`, `X-Chime-Key`, `X-Chime-Attempt`, `X-Chime-Fence`
//! and `Idempotency-Key` (= the key) let the receiving service deduplicate.
//!
//! A 2xx response's body (up to `results.max_bytes`) is the run's result.
//!
//! Redirects are followed only to the same host (a redirect elsewhere would re-POST the body
//! and the idempotency key to a stranger). Errors name the URL with its password and query
//! values redacted, so tokens in a query string never reach logs or the DLQ.

use chime_shared::redact::redact;
use futures_util::future::BoxFuture;

use crate::handler::{Handler, JobContext, JobError};

/// POSTs the payload to a URL per job (`handler = "http"`, feature `http`).
pub struct HttpHandler {
    url: String,
    client: reqwest::Client,
}

/// Follows redirects only to the same origin (scheme, host and port), or from `http` up to
/// `https` on port 443 of the same host; at most 5. A 307/308 resends the body, so a redirect
/// down to `http`, or to another port of the host (another service), is never followed.
fn same_origin_redirects() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let follow =
            attempt.previous().first().is_some_and(|first| same_origin_or_upgrade(first, attempt.url()));
        if attempt.previous().len() >= 5 {
            attempt.error("too many redirects")
        } else if follow {
            attempt.follow()
        } else {
            attempt.stop()
        }
    })
}

/// `to` has the origin of `from`, or is its `https` upgrade on port 443.
fn same_origin_or_upgrade(from: &reqwest::Url, to: &reqwest::Url) -> bool {
    let same_host = from.host_str().is_some() && from.host_str() == to.host_str();
    let same_origin =
        from.scheme() == to.scheme() && from.port_or_known_default() == to.port_or_known_default();
    let upgrade =
        from.scheme() == "http" && to.scheme() == "https" && to.port_or_known_default() == Some(443);
    same_host && (same_origin || upgrade)
}

impl HttpHandler {
    /// A handler posting to `url`, following redirects only within its origin.
    pub fn new(url: String) -> Self {
        let client = reqwest::Client::builder().redirect(same_origin_redirects()).build().unwrap_or_default();
        Self { url, client }
    }
}

/// An error and its causes, one after the other, without the URL reqwest puts in it (a TLS
/// failure says which: unknown CA, name mismatch, expired).
fn describe(e: reqwest::Error) -> String {
    chime_shared::tls::describe_error(&e.without_url())
}

/// Classifies a response status and its `Retry-After` header; `what` names the request in
/// the error.
pub fn classify(status: u16, retry_after: Option<&str>, what: &str) -> Result<(), JobError> {
    let wait = retry_after.and_then(parse_retry_after);
    match (status, wait) {
        (200..=299, _) => Ok(()),
        (429, wait) | (503, wait @ Some(_)) => {
            let wait = wait.unwrap_or(std::time::Duration::from_secs(1));
            Err(JobError::rate_limited(
                wait,
                format!("{what}: HTTP {status} (retry after {})", chime_shared::duration::format(wait)),
            ))
        }
        (408 | 425 | 500..=599, _) => Err(JobError::transient(format!("{what}: HTTP {status}"))),
        _ => Err(JobError::permanent(format!("{what}: HTTP {status}"))),
    }
}

/// `Retry-After`: whole seconds, or an HTTP date (the wait until then); at most a day.
fn parse_retry_after(v: &str) -> Option<std::time::Duration> {
    let v = v.trim();
    let wait = match v.parse::<u64>() {
        Ok(secs) => std::time::Duration::from_secs(secs),
        Err(_) => {
            let at = chrono::DateTime::parse_from_rfc2822(v).ok()?;
            (at.with_timezone(&chrono::Utc) - chrono::Utc::now()).to_std().unwrap_or_default()
        }
    };
    Some(wait.min(crate::handler::MAX_PUSH_BACK))
}

/// `X-Chime-Upstream`: a workflow step's upstream runs, JSON, with their results when that
/// fits in 4 KiB, else without them (the key API has them); absent for a job that waited for
/// nothing, or past 4 KiB even without results.
fn upstream_header(ctx: &JobContext) -> Option<String> {
    let runs = ctx.upstream();
    if runs.is_empty() { None } else { chime_shared::workflow::upstream_json(runs, 4096) }
}

impl Handler for HttpHandler {
    fn call<'a>(
        &'a self,
        ctx: JobContext,
        payload: serde_json::Value,
    ) -> BoxFuture<'a, Result<(), JobError>> {
        let mut req = self
            .client
            .post(&self.url)
            .timeout(ctx.timeout())
            .header("content-type", "application/json")
            .header("x-chime-job", ctx.job())
            .header("x-chime-key", ctx.key().to_string())
            .header("idempotency-key", ctx.key().to_string())
            .header("x-chime-attempt", ctx.attempt().to_string())
            .header("x-chime-fence", ctx.fence().to_string())
            .body(serde_json::to_vec(&payload).unwrap_or_default());
        if let Some(up) = upstream_header(&ctx) {
            req = req.header("x-chime-upstream", up);
        }
        let shown = redact(&self.url);
        Box::pin(async move {
            let resp = req
                .send()
                .await
                .map_err(|e| JobError::transient(format!("POST {shown}: {}", describe(e))))?;
            let status = resp.status();
            if status.is_redirection() {
                let to = resp
                    .headers()
                    .get("location")
                    .and_then(|l| l.to_str().ok())
                    .map(redact)
                    .unwrap_or_default();
                return Err(JobError::permanent(format!(
                    "POST {shown}: HTTP {} to another origin ({to}), not followed",
                    status.as_u16()
                )));
            }
            let retry_after = resp.headers().get("retry-after").and_then(|v| v.to_str().ok());
            classify(status.as_u16(), retry_after, &format!("POST {shown}"))?;
            // A 2xx body is the run's result (JSON if it parses, else text), read only up to
            // results.max_bytes: a larger one is not kept, and never held in memory whole.
            let max = ctx.run.result_max_bytes;
            let mut body = Vec::new();
            let mut resp = resp;
            while let Ok(Some(chunk)) = resp.chunk().await {
                body.extend_from_slice(&chunk);
                if body.len() > max {
                    ctx.set_result_error(format!(
                        "the response body exceeds results.max_bytes ({max}); not kept"
                    ));
                    return Ok(());
                }
            }
            if !body.is_empty() {
                match serde_json::from_slice::<serde_json::Value>(&body) {
                    Ok(v) => ctx.set_result(&v),
                    Err(_) => ctx.set_result(&String::from_utf8_lossy(&body)),
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn redirects_stay_within_the_origin() {
        let u = |s: &str| reqwest::Url::parse(s).unwrap();
        let from = u("https://api.example/hook");
        assert!(same_origin_or_upgrade(&from, &u("https://api.example/v2/hook")));
        assert!(same_origin_or_upgrade(&from, &u("https://api.example:443/v2")));
        assert!(!same_origin_or_upgrade(&from, &u("http://api.example/hook")), "a downgrade");
        assert!(!same_origin_or_upgrade(&from, &u("https://api.example:8443/hook")), "another port");
        assert!(!same_origin_or_upgrade(&from, &u("https://evil.example/hook")));
        let plain = u("http://api.example/hook");
        assert!(same_origin_or_upgrade(&plain, &u("https://api.example/hook")), "an upgrade");
        assert!(!same_origin_or_upgrade(&plain, &u("https://api.example:8443/hook")));
        assert!(!same_origin_or_upgrade(&plain, &u("http://api.example:8080/hook")));
    }

    #[test]
    fn status_mapping() {
        assert!(classify(204, None, "x").is_ok());
        for (status, permanent) in [(400, true), (404, true), (429, false), (503, false)] {
            assert_eq!(classify(status, None, "x").unwrap_err().is_permanent(), permanent, "{status}");
        }
        let wait = |status, after| classify(status, after, "x").unwrap_err().rate_limited_for();
        assert_eq!(wait(429, None), Some(Duration::from_secs(1)), "429 without Retry-After: 1 s");
        assert_eq!(wait(429, Some("7")), Some(Duration::from_secs(7)));
        assert_eq!(wait(503, Some("2")), Some(Duration::from_secs(2)), "503 with Retry-After pushes back");
        assert_eq!(wait(503, None), None, "503 without it is a transient failure");
        assert_eq!(wait(500, Some("2")), None);
        let soon = (chrono::Utc::now() + chrono::Duration::seconds(30)).to_rfc2822();
        let by_date = wait(429, Some(&soon)).unwrap();
        assert!(by_date > Duration::from_secs(25) && by_date <= Duration::from_secs(30), "{by_date:?}");
        assert_eq!(wait(429, Some("999999999")), Some(Duration::from_secs(86_400)), "at most a day");
    }
}
