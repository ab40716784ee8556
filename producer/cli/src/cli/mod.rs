//! The `chime` command line, one module per command group; `main` only calls
//! [`main_exit_code`].

mod api;
mod backfill;
mod dlq;
mod enqueue;
mod failure;
pub(crate) mod history;
mod logins;
mod ops;
mod spool;
mod steer;
mod table;
mod watch;
mod web;

use chime_shared::config::{Config, ValidConfig};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

pub use failure::Failure;
use failure::usage;

#[derive(Debug, Parser)]
#[command(name = "chime", version, about = "Scheduled and ad-hoc jobs on RabbitMQ and Redis")]
pub struct Cli {
    /// Config file (default: $CHIME_CONFIG, else ./chime.toml)
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

impl Command {
    /// The daemons (`tick`, `web`, `watch`); every other command runs and exits.
    pub fn is_daemon(&self) -> bool {
        matches!(self, Command::Tick { .. } | Command::Web(_) | Command::Api(_) | Command::Watch { .. })
    }
}

// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Push an ad-hoc job (returns after the broker confirmed it)
    Enqueue(enqueue::EnqueueArgs),
    /// Validate the config and exit (0 = valid, 2 = invalid)
    CheckConfig,
    /// The ticker daemon: publishes scheduled slots (one leader among replicas) and, on the
    /// leader, watches DLQ depths
    Tick {
        /// Serve /metrics, /livez and /readyz here (default: ticker.listen)
        #[arg(long, value_name = "ADDR")]
        listen: Option<String>,
    },
    /// Scheduled jobs and their upcoming slots
    #[command(subcommand)]
    Jobs(ops::JobsCommand),
    /// Queue depths, consumers, DLQ depths, the leader and per-job slots
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Inspect, replay and purge dead letters (over AMQP; no plugin needed)
    #[command(subcommand)]
    Dlq(dlq::DlqCommand),
    /// Runs that finished: when, where, how (newest first)
    History(history::HistoryArgs),
    /// One key: its idempotency record, its runs and its dead letter
    Inspect(history::InspectArgs),
    /// Live workers (from their heartbeats) and the jobs they are running
    Workers {
        #[arg(long)]
        json: bool,
    },
    /// Circuit breakers: their state, the failures in their window and the jobs behind each
    Circuits {
        #[arg(long)]
        json: bool,
    },
    /// Hold a circuit breaker open (until closed) or close it, for every worker at once
    #[command(subcommand)]
    Circuit(steer::CircuitCommand),
    /// Cancel a run: stop it on whichever worker runs it (within a second), or drop it when a
    /// copy arrives; recorded `cancelled`, not retried, not dead-lettered
    Cancel {
        /// The run's idempotency key (a UUID, as `chime enqueue` and `chime history` print it)
        key: String,
        #[arg(long)]
        json: bool,
    },
    /// Move a waiting run to another priority level of its queue (`high`, `normal`, `low`)
    Priority {
        /// The run's idempotency key (a UUID, as `chime enqueue` and `chime history` print it)
        key: String,
        /// The level it should wait at
        level: String,
        /// Look in this queue only (default: every queue with priority levels)
        #[arg(long)]
        queue: Option<String>,
    },
    /// Stop consuming a queue, or stop publishing a schedule's slots (kept in Redis)
    #[command(subcommand)]
    Pause(steer::PauseTarget),
    /// Undo `chime pause`
    #[command(subcommand)]
    Resume(steer::ResumeTarget),
    /// Publish a scheduled job's past slots again, with their own keys (slots already done
    /// are absorbed as duplicates); `--dry-run` lists them
    Backfill(backfill::BackfillArgs),
    /// Run a job now, ad hoc, with its configured payload (a new key)
    Run {
        /// Job name
        job: String,
        #[arg(long)]
        json: bool,
    },
    /// The HTTP enqueue API: POST /api/v1/jobs/{job}, GET /api/v1/keys/{key} (a bearer token on
    /// every request)
    Api(api::ApiArgs),
    /// The dashboard: overview, schedules, running jobs, history, keys and dead letters
    Web(web::WebArgs),
    /// RabbitMQ permissions for this prefix's user, as definitions to load with `rabbitmqctl
    /// import_definitions`: its own exchanges and queues and the shared delay chain, with topic
    /// permissions so that delayed messages reach this prefix only
    Permissions {
        /// The RabbitMQ user (create it first: rabbitmqctl add_user)
        user: String,
        /// Virtual host
        #[arg(long, default_value = "/")]
        vhost: String,
    },
    /// The local spool of jobs the broker did not confirm (`[producer] spool_dir`): status,
    /// list, flush
    #[command(subcommand)]
    Spool(spool::SpoolCommand),
    /// Watch DLQ depths and raise alerts (log and webhook); until SIGTERM/SIGINT
    Watch {
        /// Serve /metrics, /livez and /readyz here
        #[arg(long, value_name = "ADDR")]
        listen: Option<String>,
    },
}

/// `chime permissions`: RabbitMQ definitions (`permissions`, `topic_permissions`) for `user`.
fn permissions_json(prefix: &str, user: &str, vhost: &str) -> String {
    let p = chime_shared::topology::permissions(prefix);
    let topics: Vec<serde_json::Value> = p
        .topics
        .iter()
        .map(|(exchange, write, read)| {
            serde_json::json!({"user": user, "vhost": vhost, "exchange": exchange, "write": write, "read": read})
        })
        .collect();
    let defs = serde_json::json!({
        "permissions": [{"user": user, "vhost": vhost, "configure": p.resources, "write": p.resources, "read": p.resources}],
        "topic_permissions": topics,
    });
    serde_json::to_string_pretty(&defs).unwrap_or_default()
}

/// Runs the CLI and returns the process exit code.
pub async fn main_exit_code(cli: Cli) -> i32 {
    match run(cli).await {
        Ok(()) => 0,
        Err(f) => {
            // Each cause once (a Redis error repeats its source), and what a TLS failure means.
            // An error may quote what came from the wire or from Redis: control characters
            // escaped, line breaks kept.
            let text = chime_shared::tls::describe_error(f.error.as_ref());
            let lines: Vec<_> = text.lines().map(chime_shared::redact::escape_control).collect();
            eprintln!("chime: error: {}", lines.join("\n"));
            f.code
        }
    }
}

/// `config` with what the workers' catalog adds (jobs and queues only a worker knows, such as
/// typed jobs on queues of their own), when Redis answers in time; else the config alone (a
/// command that needs Redis then says why itself).
pub async fn with_catalog(config: ValidConfig) -> ValidConfig {
    let read = async {
        let mut conn = chime_shared::redis_conn::RedisConn::connect(&config.redis).await?;
        chime_shared::catalog::read(&mut conn, &chime_shared::names::Names::new(&config.prefix)).await
    };
    let wait = config.redis.timeout + config.redis.timeout;
    match tokio::time::timeout(wait, read).await {
        Ok(Ok(catalog)) if !catalog.jobs.is_empty() || !catalog.queues.is_empty() => {
            match catalog.merge(config.clone().into_config()).validated() {
                Ok(merged) => merged,
                Err(e) => {
                    tracing::warn!(error = %e, "the workers' catalog does not fit the config; using the config alone");
                    config
                }
            }
        }
        _ => config,
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let path = Config::resolve_path(cli.config.as_deref());
    let config = Config::load(Some(&path)).map_err(usage)?;
    // Logs, and spans over OTLP (`[telemetry] otlp_endpoint`) from the commands that publish;
    // spans are sent when the command ends.
    let exports = matches!(
        cli.command,
        Command::Enqueue(_)
            | Command::Tick { .. }
            | Command::Api(_)
            | Command::Run { .. }
            | Command::Backfill(_)
            | Command::Spool(_)
    );
    let telemetry = if exports { config.telemetry.clone() } else { Default::default() };
    let _otlp = chime_daemon::traces::init(&telemetry, "chime").map_err(|e| usage(anyhow::anyhow!(e)))?;
    // The operator tools see what the workers can run, beyond the file.
    let config = match &cli.command {
        Command::Enqueue(_)
        | Command::Dlq(_)
        | Command::Watch { .. }
        | Command::Status { .. }
        | Command::History(_)
        | Command::Inspect(_)
        | Command::Pause(_)
        | Command::Resume(_)
        | Command::Run { .. }
        | Command::Web(_)
        | Command::Api(_) => with_catalog(config).await,
        _ => config,
    };
    let redis_url = config.redis.endpoint();
    // A Redis error says nothing of the server it came from: name it.
    let name_redis = |mut f: Failure| {
        if f.error.chain().any(|c| c.downcast_ref::<redis::RedisError>().is_some()) {
            f.error = f.error.context(format!("Redis at {redis_url}"));
        }
        f
    };
    let result = match cli.command {
        Command::CheckConfig => {
            println!(
                "config OK: {} job(s), queues: {}, queue type {}, prefix {:?}",
                config.jobs.len(),
                config.all_queues().join(", "),
                config.amqp.queue_type.as_str(),
                config.prefix
            );
            Ok(())
        }
        Command::Enqueue(args) => enqueue::run(config, args).await,
        Command::Spool(cmd) => spool::run(config, cmd).await,
        Command::Dlq(cmd) => dlq::run(config, cmd).await,
        Command::Watch { listen } => watch::run(config, listen).await,
        Command::Tick { listen } => ops::tick(config, path, listen).await,
        Command::Jobs(cmd) => ops::jobs(&config, cmd),
        Command::Status { json } => ops::status(config, json).await,
        Command::History(args) => history::history(config, args).await,
        Command::Inspect(args) => history::inspect(config, args).await,
        Command::Workers { json } => steer::workers(config, json).await,
        Command::Circuits { json } => steer::circuits(config, json).await,
        Command::Circuit(cmd) => steer::circuit(config, cmd).await,
        Command::Cancel { key, json } => steer::cancel(config, &key, json).await,
        Command::Priority { key, level, queue } => {
            steer::priority(config, &key, &level, queue.as_deref()).await
        }
        Command::Pause(target) => steer::pause(config, target, &chime_shared::control::operator()).await,
        Command::Resume(target) => steer::resume(config, target).await,
        Command::Backfill(args) => backfill::run(config, args).await,
        Command::Run { job, json } => steer::run_now(config, job, json).await,
        Command::Web(args) => web::run(config, args).await,
        Command::Api(args) => api::run(config, args).await,
        Command::Permissions { user, vhost } => {
            // Definitions naming no user (or no virtual host) would fail only at import.
            if user.is_empty() {
                return Err(usage(anyhow::anyhow!("permissions: the user name is empty")));
            }
            if vhost.is_empty() {
                return Err(usage(anyhow::anyhow!(
                    "permissions: --vhost is empty (\"/\" is the default virtual host)"
                )));
            }
            println!("{}", permissions_json(&config.prefix, &user, &vhost));
            Ok(())
        }
    };
    result.map_err(name_redis)
}
