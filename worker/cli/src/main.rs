//! `chime-worker`: parses flags, wires config → tracing → metrics → health → `Worker::run`.

use chime_shared::config::{Config, ValidConfig};
use chime_shared::health::Health;
use chime_worker::{Registry, Reloader, Worker};
use clap::Parser;
use std::path::PathBuf;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(name = "chime-worker", version, about = "Runs chime jobs from RabbitMQ")]
struct Args {
    /// Config file (default: $CHIME_CONFIG, else ./chime.toml)
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Queues to consume, comma-separated (default: worker.queues, else every job's queue)
    #[arg(long, value_delimiter = ',')]
    queues: Option<Vec<String>>,
    /// Jobs run at once (default: worker.concurrency)
    #[arg(long)]
    concurrency: Option<usize>,
    /// Serve /metrics, /livez and /readyz here (default: worker.listen; none if unset)
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
}

fn main() {
    let args = Args::parse();
    let config = match Config::load(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("chime-worker: error: {e}");
            std::process::exit(2);
        }
    };
    // worker.threads: 0 = one per core (tokio's default).
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if config.worker.threads > 0 {
        rt.worker_threads(config.worker.threads);
    }
    let rt = match rt.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("chime-worker: error: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    std::process::exit(rt.block_on(run(args, config)));
}

async fn run(args: Args, config: ValidConfig) -> i32 {
    // Logs, and spans over OTLP when `[telemetry] otlp_endpoint` is set (sent on the way out).
    let _otlp = match chime_daemon::traces::init(&config.telemetry, "chime-worker") {
        Ok(o) => o,
        Err(e) => {
            eprintln!("chime-worker: error: {e}");
            return 2;
        }
    };
    let listen = args.listen.clone().or_else(|| config.worker.listen.clone());
    let path = args.config.clone();
    let health = Health::default();
    let spool_config = config.clone();
    let mut builder = Worker::builder(config).registry(Registry::new()).health(health.clone());
    if let Some(q) = args.queues {
        builder = builder.queues(q);
    }
    if let Some(n) = args.concurrency {
        builder = builder.concurrency(n);
    }
    let worker = match builder.build() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("chime-worker: error: {e}");
            return if e.is_config() { 2 } else { 1 };
        }
    };
    let token = CancellationToken::new();
    if let Some(addr) = listen {
        if let Err(e) = chime_shared::config::check_listen(&addr) {
            eprintln!("chime-worker: error: --listen {e}");
            return 2;
        }
        let listener = match tokio::net::TcpListener::bind(&addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("chime-worker: error: cannot listen on {addr}: {e}");
                return 2;
            }
        };
        let recorder = match chime_daemon::telemetry::install_recorder() {
            Ok(h) => Some(h),
            Err(e) => {
                tracing::warn!(error = %e, "metrics recorder not installed");
                None
            }
        };
        tracing::info!(%addr, "serving /metrics, /livez, /readyz");
        tokio::spawn(chime_daemon::server::serve(listener, health, recorder, token.clone()));
    }
    tokio::spawn(signals(token.clone(), worker.reloader(), path));
    // Jobs producers on this machine spooled while the broker was away (`[producer] spool_dir`).
    tokio::spawn(chime_producer::flush_at_start(spool_config));
    match worker.run(token).await {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("chime-worker: error: {e}");
            if e.is_config() { 2 } else { 1 }
        }
    }
}

/// First SIGTERM/SIGINT: graceful drain. Second: exit at once. SIGHUP, or a change of the
/// config file, reloads the job definitions; a config that does not validate is rejected and
/// the running one kept.
async fn signals(token: CancellationToken, reloader: Reloader, path: Option<PathBuf>) {
    let file = Config::resolve_path(path.as_deref());
    let reload = || match Config::load(path.as_deref()) {
        Ok(c) => match reloader.reload(&c) {
            Ok(()) => tracing::info!(path = %file.display(), "config reloaded"),
            Err(e) => tracing::warn!(error = %e, "config reload rejected; keeping the running config"),
        },
        Err(e) => tracing::warn!(error = %e, "config reload rejected; keeping the running config"),
    };
    if let Err(e) = chime_daemon::signals::until_stopped(&file, reload).await {
        tracing::error!(error = %e, "cannot install signal handlers");
        return;
    }
    tracing::info!("shutdown requested; draining (signal again to exit at once)");
    token.cancel();
    let _ = chime_daemon::signals::next_stop().await;
    std::process::exit(130);
}
