//! `chime web`: the dashboard, server-rendered HTML from the same data as the CLI (no script,
//! no build step).
//!
//! Safety: it binds 127.0.0.1 unless told otherwise, and refuses any other address unless
//! credentials are configured (`CHIME_WEB_TOKEN` for `Authorization: Bearer`, or
//! `CHIME_WEB_USER` + `CHIME_WEB_PASSWORD` for basic auth, which browsers prompt for; failed
//! logins are throttled per address). It answers only requests whose `Host` names it
//! ([`hosts`]: DNS rebinding). Every action is a POST carrying this process's CSRF token and is
//! refused from another site (`Sec-Fetch-Site`, `Origin`); it redirects only to the dashboard's
//! own pages, with a notice kept server-side ([`notices`]); `--read-only` renders no action and
//! refuses every POST. DLQ actions name one dead letter by its exact id.

mod charts;
mod dlq_cache;
mod hosts;
mod html;
mod notices;
mod pages;

use axum::Router;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_shared::config::ValidConfig;
use chime_shared::history::HistoryReader;
use chime_shared::topology::Names;
use clap::Args;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::failure::{Failure, runtime, usage};
use super::logins::{self, ct_eq};
use chime_scheduler::lease::TickerStore;

/// Where `chime web` listens unless `--listen` says otherwise.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8090";

#[derive(Debug, Args)]
pub struct WebArgs {
    /// Address to serve on; anything but a loopback address needs credentials in the
    /// environment (CHIME_WEB_TOKEN, or CHIME_WEB_USER and CHIME_WEB_PASSWORD)
    #[arg(long, value_name = "ADDR", default_value = DEFAULT_LISTEN)]
    pub listen: String,
    /// Show everything, change nothing: no buttons, every POST refused
    #[arg(long)]
    pub read_only: bool,
    /// Another host name the dashboard answers to (a reverse proxy's, a DNS name); repeat for
    /// more. Requests naming any other `Host` are refused (DNS rebinding); the bound address,
    /// `localhost`, `127.0.0.1` and `[::1]` are always allowed
    #[arg(long = "allow-host", value_name = "NAME", env = "CHIME_WEB_HOSTS", value_delimiter = ',')]
    pub allow_hosts: Vec<String>,
}

/// The shortest basic-auth password accepted.
pub const MIN_PASSWORD: usize = 12;

/// The credentials a request must carry (none: loopback only).
#[derive(Clone, Default)]
pub struct Auth {
    bearer: Option<String>,
    /// `user:password`, as basic auth sends it (base64-decoded).
    basic: Option<String>,
}

impl Auth {
    /// From `CHIME_WEB_TOKEN`, `CHIME_WEB_USER` and `CHIME_WEB_PASSWORD`.
    pub fn from_env() -> Result<Self, String> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let bearer = var("CHIME_WEB_TOKEN");
        let basic = match (var("CHIME_WEB_USER"), var("CHIME_WEB_PASSWORD")) {
            (Some(u), Some(_)) if u.contains(':') => {
                return Err(format!("CHIME_WEB_USER {u:?} contains ':', which basic auth cannot carry"));
            }
            (Some(u), Some(p)) => Some(format!("{u}:{p}")),
            (None, None) => None,
            (Some(_), None) => return Err("CHIME_WEB_USER is set but CHIME_WEB_PASSWORD is not".into()),
            (None, Some(_)) => return Err("CHIME_WEB_PASSWORD is set but CHIME_WEB_USER is not".into()),
        };
        if bearer.as_ref().is_some_and(|t| t.len() < 16) {
            return Err("CHIME_WEB_TOKEN must be at least 16 characters".into());
        }
        if var("CHIME_WEB_PASSWORD").is_some_and(|p| p.chars().count() < MIN_PASSWORD) {
            return Err(format!("CHIME_WEB_PASSWORD must be at least {MIN_PASSWORD} characters"));
        }
        Ok(Self { bearer, basic })
    }

    fn required(&self) -> bool {
        self.bearer.is_some() || self.basic.is_some()
    }

    fn admits(&self, headers: &HeaderMap) -> bool {
        if !self.required() {
            return true;
        }
        let Some(given) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
            return false;
        };
        if let (Some(token), Some(t)) = (&self.bearer, given.strip_prefix("Bearer ")) {
            return ct_eq(token.as_bytes(), t.trim().as_bytes());
        }
        if let (Some(pair), Some(b)) = (&self.basic, given.strip_prefix("Basic ")) {
            let decoded = base64::engine::general_purpose::STANDARD.decode(b.trim()).unwrap_or_default();
            return ct_eq(pair.as_bytes(), &decoded);
        }
        false
    }
}

/// Everything the handlers share.
pub struct Web {
    pub config: ValidConfig,
    pub names: Names,
    pub reader: HistoryReader,
    pub ticker: TickerStore,
    pub dlq: Arc<dlq_cache::DlqCache>,
    /// Depths over AMQP, apart from the DLQ passes (which may take seconds).
    amqp: tokio::sync::Mutex<Option<lapin::Connection>>,
    /// Runs finished per second per queue, sampled from the history streams.
    rates: std::sync::Mutex<HashMap<String, Rate>>,
    /// For "run now" (connected on first use, again after a failure).
    enqueue: tokio::sync::Mutex<Option<EnqueueClient>>,
    pub csrf: String,
    pub read_only: bool,
    auth: Auth,
    /// The names a request's `Host` (and a POST's `Origin`) may carry.
    hosts: hosts::AllowedHosts,
    /// Texts the actions left for the page they redirect to (by id: a link cannot forge one).
    pub notices: notices::Notices,
    /// Failed logins per client address.
    logins: logins::Logins,
}

#[derive(Clone, Copy)]
struct Rate {
    at: std::time::Instant,
    added: u64,
    per_sec: Option<f64>,
}

impl Web {
    /// Connects to Redis and RabbitMQ.
    pub async fn connect(
        config: ValidConfig,
        read_only: bool,
        auth: Auth,
        hosts: hosts::AllowedHosts,
    ) -> anyhow::Result<Arc<Self>> {
        let names = Names::new(&config.prefix);
        let mut reader = HistoryReader::connect(&config.redis, names.clone())
            .await
            .map_err(|e| anyhow::anyhow!("redis: {}", chime_shared::redact::redact_text(&e.to_string())))?;
        // A page answers quickly; older runs are one "older" click away.
        reader.budget = 20_000;
        let ticker = TickerStore::connect(&config.redis, &config.prefix)?;
        let amqp = chime_shared::amqp::connect(&config.amqp, "chime-web").await?;
        chime_shared::topology::declare(&amqp, &config, &config.all_queues()).await?;
        Ok(Arc::new(Self {
            dlq: Arc::new(dlq_cache::DlqCache::new(config.clone())),
            config,
            names,
            reader,
            ticker,
            amqp: tokio::sync::Mutex::new(Some(amqp)),
            rates: std::sync::Mutex::new(HashMap::new()),
            enqueue: tokio::sync::Mutex::new(None),
            csrf: uuid::Uuid::new_v4().simple().to_string(),
            read_only,
            auth,
            hosts,
            notices: notices::Notices::default(),
            logins: logins::Logins::default(),
        }))
    }

    /// `(ready, consumers)` of each broker queue, in order (`None`: could not be read);
    /// reconnects once when the connection was lost.
    pub async fn depths(&self, queues: &[String]) -> Vec<Option<(u32, u32)>> {
        let mut guard = self.amqp.lock().await;
        if guard.as_ref().is_none_or(|c| !c.status().connected()) {
            *guard = chime_shared::amqp::connect(&self.config.amqp, "chime-web").await.ok();
        }
        let Some(conn) = guard.as_ref() else { return vec![None; queues.len()] };
        // One channel for every passive declare (a channel each cost two more round trips);
        // a declare that fails (a queue that does not exist) closes it, so the next one opens
        // another.
        let mut out = Vec::with_capacity(queues.len());
        let mut channel: Option<lapin::Channel> = None;
        for q in queues {
            if channel.as_ref().is_none_or(|c| !c.status().connected()) {
                channel = conn.create_channel().await.ok();
            }
            let Some(ch) = channel.as_ref() else {
                out.push(None);
                continue;
            };
            let declared = ch
                .queue_declare(
                    q.as_str().into(),
                    lapin::options::QueueDeclareOptions { passive: true, ..Default::default() },
                    lapin::types::FieldTable::default(),
                )
                .await;
            out.push(declared.ok().map(|d| (d.message_count(), d.consumer_count())));
        }
        if let Some(ch) = channel
            && ch.status().connected()
        {
            let _ = ch.close(200, "depths".into()).await;
        }
        out
    }

    /// `chime run JOB` from the dashboard: the job now, with a key of its own.
    pub async fn run_now(&self, job: &str) -> Result<chime_producer::Enqueued, chime_producer::EnqueueError> {
        let mut slot = self.enqueue.lock().await;
        let client = match slot.take() {
            Some(c) => c,
            None => EnqueueClient::connect(self.config.clone()).await?,
        };
        let done = client.enqueue(EnqueueRequest::new(job)).await;
        if done.is_ok() {
            *slot = Some(client);
        }
        done
    }

    /// Runs finished per second on `queue`, over the last sampling interval.
    pub fn rate(&self, queue: &str) -> Option<f64> {
        self.rates.lock().ok()?.get(queue).and_then(|r| r.per_sec)
    }

    /// Samples each history stream's `entries-added` every 5 s for the overview's rates.
    async fn sample_rates(self: Arc<Self>, token: CancellationToken) {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = token.cancelled() => return,
                _ = tick.tick() => {}
            }
            for q in self.config.all_queues() {
                let Ok(added) = self.reader.entries_added(&q).await else { continue };
                let now = std::time::Instant::now();
                if let Ok(mut rates) = self.rates.lock() {
                    let per_sec = rates.get(&q).and_then(|before| {
                        let dt = now.duration_since(before.at).as_secs_f64();
                        (dt > 0.5).then(|| added.saturating_sub(before.added) as f64 / dt)
                    });
                    rates.insert(q, Rate { at: now, added, per_sec });
                }
            }
        }
    }
}

fn usage_text(message: String) -> Failure {
    usage(anyhow::anyhow!(message))
}

/// Every address `listen` resolves to, and whether all are loopback.
pub(super) async fn resolve(listen: &str) -> Result<Vec<SocketAddr>, Failure> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(listen)
        .await
        .map_err(|e| usage(anyhow::anyhow!(format!("--listen {listen:?}: {e} (expected HOST:PORT)"))))?
        .collect();
    if addrs.is_empty() {
        return Err(usage(anyhow::anyhow!(format!("--listen {listen:?} resolves to no address"))));
    }
    Ok(addrs)
}

/// `chime web`: serves until SIGTERM/SIGINT.
pub async fn run(config: ValidConfig, args: WebArgs) -> Result<(), Failure> {
    let auth = Auth::from_env().map_err(usage_text)?;
    let addrs = resolve(&args.listen).await?;
    if !auth.required() && !addrs.iter().all(|a| a.ip().is_loopback()) {
        return Err(usage(anyhow::anyhow!(format!(
            "refusing to serve the dashboard on {} without credentials: set CHIME_WEB_TOKEN \
             (bearer token, 16+ characters) or CHIME_WEB_USER and CHIME_WEB_PASSWORD (basic auth), \
             or listen on 127.0.0.1",
            args.listen
        ))));
    }
    let listener = tokio::net::TcpListener::bind(addrs.as_slice())
        .await
        .map_err(|e| usage(anyhow::anyhow!(format!("cannot listen on {}: {e}", args.listen))))?;
    let bound = listener.local_addr().map_err(|e| runtime(anyhow::anyhow!(format!("{e}"))))?;
    let hosts = hosts::AllowedHosts::new(bound, &args.allow_hosts).map_err(usage_text)?;
    let web = Web::connect(config, args.read_only, auth.clone(), hosts)
        .await
        .map_err(|e| runtime(anyhow::anyhow!(format!("{e:#}"))))?;
    let token = CancellationToken::new();
    tokio::spawn(web.clone().sample_rates(token.clone()));
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| args.listen.clone());
    info!(addr = %local, read_only = args.read_only, auth = auth.required(), "dashboard serving");
    eprintln!("chime web: serving http://{local}/{}", if args.read_only { " (read-only)" } else { "" });
    serve_until_stopped(listener, router(web), token).await
}

/// Serves `app` until SIGTERM/SIGINT (or `token` is cancelled): `chime web` and `chime api`.
pub async fn serve_until_stopped(
    listener: tokio::net::TcpListener,
    app: Router,
    token: CancellationToken,
) -> Result<(), Failure> {
    let stop = token.clone();
    tokio::spawn(async move {
        let _ = chime_daemon::signals::next_stop().await;
        stop.cancel();
    });
    chime_daemon::server::serve_router(listener, app, token)
        .await
        .map_err(|e| runtime(anyhow::anyhow!(format!("server: {e}"))))
}

/// The dashboard's routes behind authentication and the security headers.
pub fn router(web: Arc<Web>) -> Router {
    Router::new()
        .route("/", get(pages::overview))
        .route("/schedules", get(pages::schedules))
        .route("/running", get(pages::running))
        .route("/history", get(pages::history))
        .route("/keys/{key}", get(pages::key))
        .route("/dlq", get(pages::dlq))
        .route("/dlq/{queue}/{id}", get(pages::dead_letter))
        .route("/dlq/{queue}/{id}/confirm", get(pages::confirm))
        .route("/actions/dlq", post(pages::dlq_action))
        .route("/actions/queue", post(pages::queue_action))
        .route("/actions/schedule", post(pages::schedule_action))
        .route("/actions/circuit", post(pages::circuit_action))
        .route("/actions/cancel", post(pages::cancel_action))
        .route("/livez", get(|| async { "ok\n" }))
        .layer(middleware::from_fn_with_state(web.clone(), guard))
        .with_state(web)
}

/// Authentication, CSRF origin checks and security headers, around every route.
async fn guard(State(web): State<Arc<Web>>, req: Request, next: Next) -> Response {
    // Before anything else: after a DNS rebinding, a page of another site reaches this port
    // under its own name, and everything below (even the same-origin check) would pass.
    if req.uri().path() != "/livez"
        && let Err(why) = web.hosts.check_host(req.headers())
    {
        return (StatusCode::MISDIRECTED_REQUEST, format!("refused: {why}\n")).into_response();
    }
    let peer = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip());
    if req.uri().path() != "/livez" && web.auth.required() {
        if let Some(wait) = peer.and_then(|p| web.logins.blocked(p)) {
            let mut r =
                (StatusCode::TOO_MANY_REQUESTS, "too many failed logins; try again later\n").into_response();
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(wait.as_secs().max(1)));
            return r;
        }
        if !web.auth.admits(req.headers()) {
            if let Some(p) = peer
                && req.headers().contains_key(header::AUTHORIZATION)
            {
                web.logins.failed(p);
            }
            let mut r = (StatusCode::UNAUTHORIZED, "credentials required\n").into_response();
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Basic realm=\"chime\""));
            return r;
        }
    }
    if req.method() == axum::http::Method::POST {
        if web.read_only {
            return (StatusCode::FORBIDDEN, "this dashboard is read-only\n").into_response();
        }
        if let Err(why) = same_origin(&web.hosts, req.headers()) {
            return (StatusCode::FORBIDDEN, format!("refused: {why}\n")).into_response();
        }
    }
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// A POST must come from this dashboard's own pages: browsers say where a request comes from
/// in `Sec-Fetch-Site` and `Origin`. An `Origin` must name one of the allowed hosts, never
/// merely the request's own `Host` (which a rebound name controls).
fn same_origin(hosts: &hosts::AllowedHosts, headers: &HeaderMap) -> Result<(), String> {
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok())
        && !matches!(site, "same-origin" | "none")
    {
        return Err(format!("a {site} request"));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().map_err(|_| "an origin that is not text".to_string())?;
        if origin == "null" {
            return Err("an opaque origin".into());
        }
        hosts.check_origin(origin)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_compare_whole() {
        assert!(ct_eq(b"secret", b"secret"));
        assert!(!ct_eq(b"secret", b"secret2"));
        assert!(!ct_eq(b"secret", b"secreT"));
        assert!(!ct_eq(b"", b"x"));
        let auth = Auth { bearer: Some("0123456789abcdef".into()), basic: Some("ops:pw".into()) };
        let mut h = HeaderMap::new();
        assert!(!auth.admits(&h));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer 0123456789abcdef"));
        assert!(auth.admits(&h));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic b3BzOnB3")); // ops:pw
        assert!(auth.admits(&h));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic b3BzOnB4")); // ops:px
        assert!(!auth.admits(&h));
    }

    #[test]
    fn cross_site_posts_are_refused() {
        let hosts = hosts::AllowedHosts::new("127.0.0.1:8090".parse().unwrap(), &[]).unwrap();
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8090"));
        assert!(same_origin(&hosts, &h).is_ok());
        h.insert(header::ORIGIN, HeaderValue::from_static("http://127.0.0.1:8090"));
        assert!(same_origin(&hosts, &h).is_ok());
        h.insert(header::ORIGIN, HeaderValue::from_static("http://evil.example"));
        assert!(same_origin(&hosts, &h).is_err());
        // A rebound name is same-origin with itself: still refused.
        h.insert(header::HOST, HeaderValue::from_static("evil.example:8090"));
        h.insert(header::ORIGIN, HeaderValue::from_static("http://evil.example:8090"));
        assert!(same_origin(&hosts, &h).is_err());
        h.insert(header::ORIGIN, HeaderValue::from_static("null"));
        assert!(same_origin(&hosts, &h).is_err());
        h.remove(header::ORIGIN);
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(same_origin(&hosts, &h).is_err());
    }
}
