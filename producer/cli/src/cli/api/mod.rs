//! `chime api`: the HTTP enqueue API, for services in any language.
//!
//! `POST /api/v1/jobs/{job}` answers `202` only once the broker confirmed the job (or the local
//! spool holds it, marked `"delivery": "spooled"`); `GET /api/v1/keys/{key}` answers what
//! `chime inspect --json` prints; `GET /api/v1/openapi.json` serves the document kept beside
//! this file (`openapi.json`). Every route but `/livez` needs a bearer token, even on
//! loopback: `CHIME_API_TOKEN` (every job) or `[[api.tokens]]` (each limited to some jobs, its
//! secret in an environment variable). Bodies are bounded (`api.max_body_bytes`), each token
//! is rate-limited (`api.rate_limit`, per process), and failed logins are throttled per
//! address. Errors are JSON: `{"error": "...", "field": "..."}`.
//!
//! A browser adds no `Authorization` header of its own accord, so a page of another site can
//! reach nothing here (no cookies, no basic auth: no CSRF, and DNS rebinding gains nothing).

mod body;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chime_producer::{EnqueueClient, EnqueueError};
use chime_shared::config::{ApiConfig, Rate, ValidConfig};
use chime_shared::history::HistoryReader;
use chime_shared::topology::Names;
use chime_shared::trace::TraceContext;
use clap::Args;
use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use super::failure::{Failure, usage};
use super::history::KeyView;
use super::logins::{Logins, ct_eq};

/// Where `chime api` listens unless `--listen` says otherwise.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8091";

/// The OpenAPI document of this API, as served at `/api/v1/openapi.json`.
pub const OPENAPI: &str = include_str!("openapi.json");

/// The routes, as the OpenAPI document lists them.
const ROUTES: [&str; 6] = [
    "/api/v1/jobs/{job}",
    "/api/v1/keys/{key}",
    "/api/v1/openapi.json",
    "/api/v1/keys/{key}/cancel",
    "/api/v1/workflows",
    "/api/v1/jobs/{job}/batch",
];

const TRACEPARENT: header::HeaderName = header::HeaderName::from_static("traceparent");
const TRACESTATE: header::HeaderName = header::HeaderName::from_static("tracestate");

/// The shortest token accepted.
const MIN_TOKEN: usize = 16;

/// How long a caller should wait before trying again after a `503`.
const RETRY_AFTER_UNAVAILABLE: u64 = 5;

#[derive(Debug, Args)]
pub struct ApiArgs {
    /// Address to serve on (a bearer token is required on every address, loopback included)
    #[arg(long, value_name = "ADDR", default_value = DEFAULT_LISTEN)]
    pub listen: String,
}

/// A bearer token and what it may do.
struct Token {
    name: String,
    secret: String,
    /// The jobs it may enqueue and read; `None`: every job.
    jobs: Option<BTreeSet<String>>,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token").field("name", &self.name).field("jobs", &self.jobs).finish_non_exhaustive()
    }
}

impl Token {
    fn allows(&self, job: &str) -> bool {
        self.jobs.as_ref().is_none_or(|j| j.contains(job))
    }
}

/// The tokens of `api`: `CHIME_API_TOKEN` (every job), then each `[[api.tokens]]` from its
/// environment variable; `env` reads a variable.
fn tokens(api: &ApiConfig, env: impl Fn(&str) -> Option<String>) -> Result<Vec<Token>, String> {
    let mut out = Vec::new();
    let check = |name: &str, var: &str, secret: &str| {
        if secret.chars().count() < MIN_TOKEN {
            return Err(format!("{var} (token {name:?}) must be at least {MIN_TOKEN} characters"));
        }
        Ok(())
    };
    if let Some(secret) = env("CHIME_API_TOKEN") {
        check("default", "CHIME_API_TOKEN", &secret)?;
        out.push(Token { name: "default".into(), secret, jobs: None });
    }
    for t in &api.tokens {
        let secret = env(&t.env).ok_or_else(|| {
            format!("api.tokens {:?}: its environment variable {} is not set (or empty)", t.name, t.env)
        })?;
        check(&t.name, &t.env, &secret)?;
        if let Some(same) = out.iter().find(|o: &&Token| o.secret == secret) {
            return Err(format!("tokens {:?} and {:?} have the same secret", same.name, t.name));
        }
        let jobs = (!t.jobs.iter().any(|j| j == "*")).then(|| t.jobs.iter().cloned().collect());
        out.push(Token { name: t.name.clone(), secret, jobs });
    }
    if out.is_empty() {
        return Err("chime api needs a bearer token: set CHIME_API_TOKEN (16+ characters, every job), or \
                    list [[api.tokens]] in the config with their environment variables"
            .into());
    }
    Ok(out)
}

/// Requests each token may still make: a GCRA per token (the theoretical arrival time of its
/// next request).
struct Limiter {
    rate: Rate,
    next: Mutex<HashMap<String, Instant>>,
}

impl Limiter {
    /// `Err(wait)` when `token` is over its rate.
    fn take(&self, token: &str) -> Result<(), Duration> {
        let interval = Duration::from_micros(self.rate.interval_us());
        let tolerance = interval * self.rate.burst.saturating_sub(1);
        let now = Instant::now();
        let mut next = self.next.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let tat = next.get(token).copied().unwrap_or(now).max(now);
        let ahead = tat - now;
        if ahead > tolerance {
            return Err(ahead - tolerance);
        }
        next.insert(token.to_string(), tat + interval);
        Ok(())
    }
}

/// What the handlers share.
pub struct Api {
    config: ValidConfig,
    tokens: Vec<Token>,
    limiter: Limiter,
    logins: Logins,
    /// Connected at the first enqueue (again after a failure to connect).
    client: tokio::sync::Mutex<Option<Arc<EnqueueClient>>>,
    /// Connected at the first key read (again after a failure to connect).
    reader: tokio::sync::Mutex<Option<HistoryReader>>,
}

/// A JSON error: `{"error": message, "field": field}`.
fn error(status: StatusCode, message: impl Into<String>, field: Option<&str>) -> Response {
    let mut body = serde_json::json!({"error": message.into()});
    if let Some(f) = field {
        body["field"] = serde_json::Value::String(f.to_string());
    }
    json(status, &body)
}

fn json(status: StatusCode, body: &serde_json::Value) -> Response {
    let mut r = (status, body.to_string()).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn with_retry_after(mut r: Response, secs: u64) -> Response {
    r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
    r
}

impl Api {
    fn new(config: ValidConfig, tokens: Vec<Token>) -> Self {
        Self {
            limiter: Limiter { rate: config.api.rate(), next: Mutex::new(HashMap::new()) },
            config,
            tokens,
            logins: Logins::default(),
            client: tokio::sync::Mutex::new(None),
            reader: tokio::sync::Mutex::new(None),
        }
    }

    /// The token `headers` carry, within its rate; else the answer to give.
    fn admit(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Result<&Token, Box<Response>> {
        if let Some(wait) = peer.and_then(|p| self.logins.blocked(p)) {
            let r = error(StatusCode::TOO_MANY_REQUESTS, "too many failed logins; try again later", None);
            return Err(Box::new(with_retry_after(r, wait.as_secs())));
        }
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let token = given.and_then(|g| self.tokens.iter().find(|t| ct_eq(t.secret.as_bytes(), g.as_bytes())));
        let Some(token) = token else {
            if let Some(p) = peer
                && headers.contains_key(header::AUTHORIZATION)
            {
                self.logins.failed(p);
            }
            let mut r = error(
                StatusCode::UNAUTHORIZED,
                "a bearer token is required (Authorization: Bearer ...)",
                None,
            );
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"chime\""));
            return Err(Box::new(r));
        };
        if let Err(wait) = self.limiter.take(&token.name) {
            let r = error(
                StatusCode::TOO_MANY_REQUESTS,
                format!("token {:?} is over api.rate_limit ({})", token.name, self.config.api.rate_limit),
                None,
            );
            return Err(Box::new(with_retry_after(r, wait.as_secs_f64().ceil() as u64)));
        }
        Ok(token)
    }

    /// The enqueue client, connecting it if there is none.
    async fn client(&self) -> Result<Arc<EnqueueClient>, EnqueueError> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = Arc::new(EnqueueClient::connect(self.config.clone()).await?);
        *slot = Some(c.clone());
        Ok(c)
    }

    /// After a broker failure of the enqueue client, the next request connects afresh.
    async fn forget_broken_client(&self, e: &EnqueueError) {
        if matches!(e, EnqueueError::Amqp(_) | EnqueueError::Topology(_)) && e.is_broker() {
            self.client.lock().await.take();
        }
    }

    async fn reader(&self) -> Result<HistoryReader, String> {
        let mut slot = self.reader.lock().await;
        if let Some(r) = slot.as_ref() {
            return Ok(r.clone());
        }
        let r = HistoryReader::connect(&self.config.redis, Names::new(&self.config.prefix))
            .await
            .map_err(|e| chime_shared::redact::redact_text(&e.to_string()))?;
        *slot = Some(r.clone());
        Ok(r)
    }
}

fn peer(info: Option<&ConnectInfo<SocketAddr>>) -> Option<IpAddr> {
    info.map(|c| c.0.ip())
}

/// The token of a request to enqueue `job` (it must allow the job) and the JSON body; or the
/// answer refusing it.
async fn admit_job<'a>(
    api: &'a Api,
    info: Option<&axum::Extension<ConnectInfo<SocketAddr>>>,
    headers: &HeaderMap,
    job: &str,
    body: Body,
) -> Result<(&'a Token, axum::body::Bytes), Box<Response>> {
    let token = api.admit(headers, peer(info.map(|i| &i.0)))?;
    if !token.allows(job) {
        return Err(Box::new(error(
            StatusCode::FORBIDDEN,
            format!("token {:?} may not enqueue job {job:?}", token.name),
            Some("job"),
        )));
    }
    Ok((token, json_body(api, headers, body).await?))
}

/// The caller's trace, which the run continues (an invalid `traceparent` is ignored).
fn trace_of(headers: &HeaderMap) -> Option<TraceContext> {
    let text = |h: header::HeaderName| headers.get(h).and_then(|v| v.to_str().ok());
    text(TRACEPARENT).and_then(|p| TraceContext::parse(p, text(TRACESTATE)))
}

/// `POST /api/v1/jobs/{job}`.
async fn post_job(
    State(api): State<Arc<Api>>,
    info: Option<axum::Extension<ConnectInfo<SocketAddr>>>,
    Path(job): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (token, bytes) = match admit_job(&api, info.as_ref(), &headers, &job, body).await {
        Ok(admitted) => admitted,
        Err(r) => return *r,
    };
    let mut req = match body::request(&job, &bytes) {
        Ok(r) => r,
        Err((field, message)) => return error(StatusCode::BAD_REQUEST, message, field.as_deref()),
    };
    if let Some(t) = trace_of(&headers) {
        req = req.trace(t);
    }
    let client = match api.client().await {
        Ok(c) => c,
        Err(e) => return enqueue_error(&e),
    };
    match client.enqueue(req).await {
        Ok(done) => {
            tracing::info!(job = %done.job, key = %done.key, token = %token.name, delivery = ?done.delivery, "enqueued over http");
            let status = StatusCode::ACCEPTED;
            match serde_json::to_value(&done) {
                Ok(v) => json(status, &v),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None),
            }
        }
        Err(e) => {
            api.forget_broken_client(&e).await;
            enqueue_error(&e)
        }
    }
}

/// A request's JSON body, at most `api.max_body_bytes`; or the answer refusing it.
async fn json_body(api: &Api, headers: &HeaderMap, body: Body) -> Result<axum::body::Bytes, Box<Response>> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("");
        if !ct.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")) {
            return Err(Box::new(error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("Content-Type {ct:?}: the body is JSON (application/json)"),
                None,
            )));
        }
    }
    let max = api.config.api.max_body_bytes;
    axum::body::to_bytes(body, max).await.map_err(|_| {
        Box::new(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is larger than api.max_body_bytes ({max} bytes), or was cut off"),
            None,
        ))
    })
}

/// `POST /api/v1/workflows`: a workflow (`{"key": …, "steps": [{"name", "job", "payload",
/// "after"}, …]}`), every step checked and published (see `EnqueueClient::workflow`). The
/// token must allow every step's job.
async fn post_workflow(
    State(api): State<Arc<Api>>,
    info: Option<axum::Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let token = match api.admit(&headers, peer(info.as_ref().map(|i| &i.0))) {
        Ok(t) => t,
        Err(r) => return *r,
    };
    let bytes = match json_body(&api, &headers, body).await {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let wf = match chime_producer::WorkflowRequest::from_json(&bytes) {
        Ok(w) => w,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("the body is not a workflow: {e}"), None),
    };
    for s in &wf.steps {
        let job = s.job.as_deref().unwrap_or(&s.name);
        if !token.allows(job) {
            return error(
                StatusCode::FORBIDDEN,
                format!("token {:?} may not enqueue job {job:?} (step {:?})", token.name, s.name),
                Some("steps"),
            );
        }
    }
    let client = match api.client().await {
        Ok(c) => c,
        Err(e) => return enqueue_error(&e),
    };
    match client.workflow(&wf).await {
        Ok(done) => {
            tracing::info!(workflow = %done.key, steps = done.steps.len(), token = %token.name, "workflow enqueued over http");
            match serde_json::to_value(&done) {
                Ok(v) => json(StatusCode::ACCEPTED, &v),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None),
            }
        }
        Err(e) => {
            api.forget_broken_client(&e).await;
            enqueue_error(&e)
        }
    }
}

/// The answer to an enqueue that failed: nothing was published or spooled.
fn enqueue_error(e: &EnqueueError) -> Response {
    let (status, body) = enqueue_error_body(e, None);
    answer_error(status, &body)
}

/// `{"error", "field"}` and the status of an enqueue that failed; the field of an element of a
/// batch is named under `element` (`jobs[2]`).
fn enqueue_error_body(e: &EnqueueError, element: Option<&str>) -> (StatusCode, serde_json::Value) {
    let text = chime_shared::redact::redact_text(&e.to_string());
    let within = |f: &str| element.map_or(f.to_string(), |el| format!("{el}.{f}"));
    let text = match element {
        Some(el) if matches!(e, EnqueueError::Invalid { .. } | EnqueueError::TooLarge { .. }) => {
            format!("{el}: {text}")
        }
        _ => text,
    };
    let (status, field) = match e {
        EnqueueError::UnknownJob(_) => (StatusCode::NOT_FOUND, Some("job".to_string())),
        EnqueueError::Invalid { field, .. } => (StatusCode::BAD_REQUEST, Some(within(field))),
        EnqueueError::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, Some(within("payload"))),
        EnqueueError::NoSuchQueue { .. } => (StatusCode::BAD_REQUEST, Some("queue".to_string())),
        EnqueueError::NoWorkers { .. } => (StatusCode::CONFLICT, None),
        EnqueueError::Redis(_) | EnqueueError::Spool { .. } => (StatusCode::SERVICE_UNAVAILABLE, None),
        _ if e.is_broker() => (StatusCode::SERVICE_UNAVAILABLE, None),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, None),
    };
    let mut body = serde_json::json!({"error": text});
    if let Some(f) = field {
        body["field"] = serde_json::Value::String(f);
    }
    (status, body)
}

/// An error answer with `body`; a `503` says when to try again.
fn answer_error(status: StatusCode, body: &serde_json::Value) -> Response {
    let r = json(status, body);
    if status == StatusCode::SERVICE_UNAVAILABLE { with_retry_after(r, RETRY_AFTER_UNAVAILABLE) } else { r }
}

/// `POST /api/v1/jobs/{job}/batch`: `{"jobs": [{...}, ...], "pack": N}`, each element the body
/// of `POST /api/v1/jobs/{job}`. Every element is checked before anything is published (a bad
/// one is answered `400` naming `jobs[i].field`, and nothing is enqueued); then the jobs are
/// published pipelined (or `pack` to a message) and `202` answers once all are confirmed or
/// spooled, with the key of each element in order. A failure part way (the broker gone, no
/// spool) is answered with the error and how many were taken (`confirmed` + `spooled`, the
/// first in order): sending the batch again with the same keys is safe.
async fn post_batch(
    State(api): State<Arc<Api>>,
    info: Option<axum::Extension<ConnectInfo<SocketAddr>>>,
    Path(job): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (token, bytes) = match admit_job(&api, info.as_ref(), &headers, &job, body).await {
        Ok(admitted) => admitted,
        Err(r) => return *r,
    };
    let (mut reqs, pack) = match body::batch(&job, &bytes) {
        Ok(b) => b,
        Err((field, message)) => return error(StatusCode::BAD_REQUEST, message, field.as_deref()),
    };
    if pack.is_some() && api.config.job(&job).is_some_and(|j| j.broadcast) {
        let message = format!("{job:?} is a broadcast job (one copy per worker), which cannot be packed");
        return error(StatusCode::BAD_REQUEST, message, Some("pack"));
    }
    if let Some(t) = trace_of(&headers) {
        reqs = reqs.into_iter().map(|r| r.trace(t.clone())).collect();
    }
    let client = match api.client().await {
        Ok(c) => c,
        Err(e) => return enqueue_error(&e),
    };
    let mut prepared = Vec::with_capacity(reqs.len());
    for (i, r) in reqs.iter().enumerate() {
        match client.prepare(r) {
            Ok(p) => prepared.push(p),
            Err(e) => {
                let (status, body) = enqueue_error_body(&e, Some(&format!("jobs[{i}]")));
                return answer_error(status, &body);
            }
        }
    }
    let keys: Vec<String> = prepared.iter().map(|p| p.envelope.key.to_string()).collect();
    let mut repeats = super::enqueue::Repeats::default();
    for (i, (r, p)) in reqs.iter().zip(&prepared).enumerate() {
        if r.key.is_some() {
            repeats.add(p.envelope.key, i);
        }
    }
    let warning = repeats.warning(
        |i, earlier| format!("jobs[{i}] repeats the key of jobs[{earlier}]"),
        |n, i, earlier| {
            format!("{n} elements repeat the key of an earlier element (the first: jobs[{i}], the key of jobs[{earlier}])")
        },
        "elements",
    );
    let messages = match client.fan_out(&prepared).await {
        Ok(m) => m,
        Err(e) => return enqueue_error(&e),
    };
    let report = match pack {
        Some(n) => client.send_packed(&messages, n).await,
        None => client.send_batch(&messages).await,
    };
    let mut answer = serde_json::json!({
        "job": job, "total": report.total, "confirmed": report.confirmed, "spooled": report.spooled, "keys": keys,
    });
    if let Some(w) = warning {
        tracing::warn!(job = %job, token = %token.name, "batch over http: {w}");
        answer["warning"] = w.into();
    }
    match report.error {
        None => {
            tracing::info!(job = %job, jobs = keys.len(), confirmed = report.confirmed, spooled = report.spooled,
                token = %token.name, "batch enqueued over http");
            json(StatusCode::ACCEPTED, &answer)
        }
        Some(e) => {
            api.forget_broken_client(&e).await;
            let (status, body) = enqueue_error_body(&e, None);
            answer["error"] = body["error"].clone();
            if let Some(f) = body.get("field") {
                answer["field"] = f.clone();
            }
            answer_error(status, &answer)
        }
    }
}

/// The token of a request about one key, and the key; or the answer refusing it (no or a
/// wrong token, too many failed logins, not a UUID).
fn admit_key<'a>(
    api: &'a Api,
    info: Option<&axum::Extension<ConnectInfo<SocketAddr>>>,
    headers: &HeaderMap,
    key: &str,
) -> Result<(&'a Token, uuid::Uuid), Box<Response>> {
    let token = api.admit(headers, peer(info.map(|i| &i.0)))?;
    let key = uuid::Uuid::parse_str(key).map_err(|_| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            "not an idempotency key (a UUID, as enqueue answered it)",
            Some("key"),
        ))
    })?;
    Ok((token, key))
}

/// `GET /api/v1/keys/{key}`: what `chime inspect --json` prints (a key whose runs belong to a
/// job the token may not read is answered as unknown).
async fn get_key(
    State(api): State<Arc<Api>>,
    info: Option<axum::Extension<ConnectInfo<SocketAddr>>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    let (token, key) = match admit_key(&api, info.as_ref(), &headers, &key) {
        Ok(admitted) => admitted,
        Err(r) => return *r,
    };
    let reader = match api.reader().await {
        Ok(r) => r,
        Err(e) => {
            return with_retry_after(
                error(StatusCode::SERVICE_UNAVAILABLE, format!("redis: {e}"), None),
                RETRY_AFTER_UNAVAILABLE,
            );
        }
    };
    let unavailable = |e: anyhow::Error| {
        with_retry_after(
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                chime_shared::redact::redact_text(&format!("{e:#}")),
                None,
            ),
            RETRY_AFTER_UNAVAILABLE,
        )
    };
    let view = match KeyView::load(&api.config, &reader, key, false).await {
        Ok(v) => v,
        Err(e) => {
            api.reader.lock().await.take();
            return unavailable(e);
        }
    };
    let jobs: BTreeSet<&str> = match &view.group {
        Some(g) => BTreeSet::from([g.job.as_str()]),
        None => view.record.runs.iter().map(|r| r.job.as_str()).collect(),
    };
    if !jobs.iter().all(|j| token.allows(j)) {
        return error(
            StatusCode::NOT_FOUND,
            format!("token {:?} may not read this key", token.name),
            Some("key"),
        );
    }
    match view.json(&reader).await {
        Ok(v) => json(StatusCode::OK, &v),
        Err(e) => unavailable(e),
    }
}

/// `POST /api/v1/keys/{key}/cancel`: `chime cancel KEY`. The token must allow the key's job
/// (a key whose job is not known yet, still queued or unknown, needs a token for every job);
/// 200 with what happened, 409 when the key is done or dead.
async fn cancel_key(
    State(api): State<Arc<Api>>,
    info: Option<axum::Extension<ConnectInfo<SocketAddr>>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    let (token, key) = match admit_key(&api, info.as_ref(), &headers, &key) {
        Ok(admitted) => admitted,
        Err(r) => return *r,
    };
    let unavailable = |e: String| {
        with_retry_after(
            error(StatusCode::SERVICE_UNAVAILABLE, chime_shared::redact::redact_text(&e), None),
            RETRY_AFTER_UNAVAILABLE,
        )
    };
    let reader = match api.reader().await {
        Ok(r) => r,
        Err(e) => return unavailable(format!("redis: {e}")),
    };
    let record = match reader.record(&key.to_string()).await {
        Ok(r) => r,
        Err(e) => {
            api.reader.lock().await.take();
            return unavailable(format!("redis: {e}"));
        }
    };
    let jobs: BTreeSet<&str> = record.runs.iter().map(|r| r.job.as_str()).collect();
    let allowed = if jobs.is_empty() { token.jobs.is_none() } else { jobs.iter().all(|j| token.allows(j)) };
    if !allowed {
        return error(
            StatusCode::NOT_FOUND,
            format!("token {:?} may not cancel this key", token.name),
            Some("key"),
        );
    }
    let who = format!("api token {}", token.name);
    let mut conn = reader.connection();
    let names = Names::new(&api.config.prefix);
    match chime_shared::control::cancel(&mut conn, &names, &api.config, &key.to_string(), &who).await {
        Ok((_, text, true)) => {
            json(StatusCode::OK, &serde_json::json!({"key": key, "cancelled": true, "message": text}))
        }
        Ok((_, text, false)) => error(StatusCode::CONFLICT, text, Some("key")),
        Err(e) => unavailable(format!("redis: {e}")),
    }
}

/// The API's routes.
pub fn router(api: Arc<Api>) -> Router {
    Router::new()
        .route(ROUTES[0], post(post_job))
        .route(ROUTES[1], get(get_key))
        .route(ROUTES[2], get(openapi))
        .route(ROUTES[3], post(cancel_key))
        .route(ROUTES[4], post(post_workflow))
        .route(ROUTES[5], post(post_batch))
        .route("/livez", get(|| async { "ok\n" }))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route (see /api/v1/openapi.json)", None) })
        .with_state(api)
}

/// `GET /api/v1/openapi.json` (open to every token holder, like the rest).
async fn openapi(
    State(api): State<Arc<Api>>,
    info: Option<axum::Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = api.admit(&headers, peer(info.as_ref().map(|i| &i.0))) {
        return *r;
    }
    let mut r = OPENAPI.into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// `chime api`: serves until SIGTERM/SIGINT.
pub async fn run(config: ValidConfig, args: ApiArgs) -> Result<(), Failure> {
    let tokens = tokens(&config.api, |k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .map_err(|e| usage(anyhow::anyhow!(e)))?;
    let addrs = super::web::resolve(&args.listen).await?;
    let listener = tokio::net::TcpListener::bind(addrs.as_slice())
        .await
        .map_err(|e| usage(anyhow::anyhow!(format!("cannot listen on {}: {e}", args.listen))))?;
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| args.listen.clone());
    let names: Vec<&str> = tokens.iter().map(|t| t.name.as_str()).collect();
    tracing::info!(addr = %local, tokens = ?names, "http api serving");
    eprintln!("chime api: serving http://{local}/api/v1/ (tokens: {})", names.join(", "));
    let api = Arc::new(Api::new(config, tokens));
    super::web::serve_until_stopped(listener, router(api), CancellationToken::new()).await
}

#[cfg(test)]
mod tests;
