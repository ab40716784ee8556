//! The `chime` command line. `main` only calls [`main_exit_code`].

use anyhow::Context as _;
use chime_shared::config::Config;
use clap::{Args, Parser, Subcommand};
use std::io::{BufRead, Read};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::enqueue::{EnqueueClient, EnqueueError, EnqueueRequest, parse_batch_line, prepare};

#[derive(Debug, Parser)]
#[command(name = "chime", version, about = "Scheduled and ad-hoc jobs on RabbitMQ and Redis")]
pub struct Cli {
    /// Config file (default: $CHIME_CONFIG, else ./chime.toml)
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Push an ad-hoc job (returns after the broker confirmed it)
    Enqueue(EnqueueArgs),
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
    Jobs(crate::cli_ops::JobsCommand),
    /// Queue depths, consumers, DLQ depths, the leader and per-job slots
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Inspect, replay and purge dead letters (over AMQP; no plugin needed)
    #[command(subcommand)]
    Dlq(crate::cli_dlq::DlqCommand),
    /// Watch DLQ depths and raise alerts (log and webhook); until SIGTERM/SIGINT
    Watch {
        /// Serve /metrics, /livez and /readyz here
        #[arg(long, value_name = "ADDR")]
        listen: Option<String>,
    },
}

#[derive(Debug, Args)]
pub struct EnqueueArgs {
    /// Job name, as in the config's [[jobs]]
    pub job: String,
    /// Payload as JSON text
    #[arg(long, conflicts_with_all = ["payload_file", "batch"])]
    pub payload: Option<String>,
    /// Read the payload from a file, or from standard input with `-`
    #[arg(long, value_name = "PATH|-", conflicts_with = "batch")]
    pub payload_file: Option<String>,
    /// Idempotency key: the same key for the same job runs once
    #[arg(long, conflicts_with = "batch")]
    pub key: Option<String>,
    /// Queue (default: the job's queue)
    #[arg(long)]
    pub queue: Option<String>,
    /// Attempts before the job is dead-lettered (default: the job's max_attempts)
    #[arg(long)]
    pub max_attempts: Option<u32>,
    /// Deliver after this long ("90s", "2h", "30d"; 1 s granularity)
    #[arg(long, value_name = "DUR", conflicts_with = "at")]
    pub delay: Option<String>,
    /// Deliver at this time (RFC 3339; a past time runs now)
    #[arg(long, value_name = "RFC3339")]
    pub at: Option<String>,
    /// JSON lines, one job each ({"payload":…,"key":…} or a bare payload); `-` = stdin
    #[arg(long, value_name = "PATH|-")]
    pub batch: Option<String>,
    /// Print the result as JSON
    #[arg(long)]
    pub json: bool,
}

/// A failure with its exit code: 2 for usage and config errors, 1 at run time.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub error: anyhow::Error,
}

pub(crate) fn usage(error: impl Into<anyhow::Error>) -> Failure {
    Failure { code: 2, error: error.into() }
}
pub(crate) fn runtime(error: impl Into<anyhow::Error>) -> Failure {
    Failure { code: 1, error: error.into() }
}
fn from_enqueue(e: EnqueueError) -> Failure {
    if e.is_usage() { usage(e) } else { runtime(e) }
}

/// Runs the CLI and returns the process exit code.
pub async fn main_exit_code(cli: Cli) -> i32 {
    match run(cli).await {
        Ok(()) => 0,
        Err(f) => {
            eprintln!("chime: error: {:#}", f.error);
            f.code
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let path = Config::resolve_path(cli.config.as_deref());
    let config = Config::load(Some(&path)).map_err(usage)?;
    match cli.command {
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
        Command::Enqueue(args) => enqueue(Arc::new(config), args).await,
        Command::Dlq(cmd) => crate::cli_dlq::run(config, cmd).await,
        Command::Watch { listen } => watch(config, listen).await,
        Command::Tick { listen } => crate::cli_ops::tick(config, path, listen).await,
        Command::Jobs(cmd) => crate::cli_ops::jobs(&config, cmd),
        Command::Status { json } => crate::cli_ops::status(config, json).await,
    }
}

async fn watch(config: Config, listen: Option<String>) -> Result<(), Failure> {
    use chime_shared::health::{self, Health};
    let health = Health::new(&["amqp"]);
    let token = tokio_util::sync::CancellationToken::new();
    if let Some(addr) = listen {
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))
            .map_err(usage)?;
        let recorder = chime_shared::telemetry::install_recorder().ok();
        tokio::spawn(health::serve(listener, health.clone(), recorder, token.clone()));
    }
    let t = token.clone();
    tokio::spawn(async move {
        let _ = chime_shared::signals::next_stop().await;
        t.cancel();
    });
    crate::monitor::run(Arc::new(config), health, token).await;
    Ok(())
}

/// Reads a payload from a file or `-` (stdin), at most `limit` bytes: a larger one is
/// rejected without being read whole.
fn read_source(path: &str, limit: usize) -> Result<String, Failure> {
    let source: Box<dyn Read> = if path == "-" {
        Box::new(std::io::stdin())
    } else {
        Box::new(std::fs::File::open(path).with_context(|| format!("opening {path}")).map_err(usage)?)
    };
    let mut bytes = Vec::new();
    source
        .take(limit as u64 + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {path}"))
        .map_err(usage)?;
    if bytes.len() > limit {
        return Err(usage(anyhow::anyhow!("{path} is larger than amqp.max_message_bytes ({limit} bytes)")));
    }
    String::from_utf8(bytes).with_context(|| format!("{path} is not UTF-8")).map_err(usage)
}

/// The next line of `reader` (without its newline), at most `limit` bytes; `None` at the end.
fn bounded_line(reader: &mut dyn BufRead, limit: usize) -> std::io::Result<Option<Result<String, usize>>> {
    let mut buf = Vec::new();
    let n = (&mut *reader).take(limit as u64 + 1).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > limit {
        // Too long: skip to the end of the line without keeping it.
        let mut skipped = buf.len();
        loop {
            let chunk = reader.fill_buf()?;
            if chunk.is_empty() {
                break;
            }
            match chunk.iter().position(|b| *b == b'\n') {
                Some(i) => {
                    reader.consume(i + 1);
                    skipped += i;
                    break;
                }
                None => {
                    let len = chunk.len();
                    reader.consume(len);
                    skipped += len;
                }
            }
        }
        return Ok(Some(Err(skipped)));
    }
    Ok(Some(Ok(String::from_utf8_lossy(&buf).into_owned())))
}

/// Parses `--delay` and `--at` into the request.
fn timing(
    args: &EnqueueArgs,
) -> Result<(Option<std::time::Duration>, Option<chrono::DateTime<chrono::Utc>>), Failure> {
    let delay = args
        .delay
        .as_deref()
        .map(chime_shared::duration::parse)
        .transpose()
        .map_err(|e| usage(anyhow::anyhow!("--delay: {e}")))?;
    let at = args
        .at
        .as_deref()
        .map(|t| chrono::DateTime::parse_from_rfc3339(t).map(|d| d.with_timezone(&chrono::Utc)))
        .transpose()
        .map_err(|e| usage(anyhow::anyhow!("--at: {e} (expected RFC 3339, e.g. 2026-12-01T02:30:00Z)")))?;
    Ok((delay, at))
}

async fn enqueue(config: Arc<Config>, args: EnqueueArgs) -> Result<(), Failure> {
    if config.job(&args.job).is_none() {
        return Err(usage(EnqueueError::UnknownJob(args.job)));
    }
    let (delay, at) = timing(&args)?;
    if let Some(batch) = &args.batch {
        return enqueue_batch(config, &args, batch, delay, at).await;
    }
    let payload_text = match (&args.payload, &args.payload_file) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(f)) => Some(read_source(f, config.amqp.max_message_bytes)?),
        (None, None) => None,
    };
    let payload = payload_text
        .map(|t| serde_json::from_str::<serde_json::Value>(&t))
        .transpose()
        .context("--payload is not valid JSON")
        .map_err(usage)?;
    let req = EnqueueRequest {
        job: args.job.clone(),
        payload,
        key: args.key.clone(),
        queue: args.queue.clone(),
        max_attempts: args.max_attempts,
        delay,
        at,
    };
    // Validate before connecting, so a bad request never touches the broker.
    prepare(&config, &req).map_err(from_enqueue)?;
    let client = EnqueueClient::connect(config).await.map_err(from_enqueue)?;
    let done = client.enqueue(req).await.map_err(from_enqueue)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"confirmed": true, "id": done.id, "key": done.key, "job": done.job, "queue": done.queue})
        );
    } else {
        println!(
            "enqueued {} on queue {} (key {}, id {}), confirmed",
            done.job, done.queue, done.key, done.id
        );
    }
    Ok(())
}

async fn enqueue_batch(
    config: Arc<Config>,
    args: &EnqueueArgs,
    source: &str,
    delay: Option<std::time::Duration>,
    at: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<(), Failure> {
    let mut reader: Box<dyn BufRead> = if source == "-" {
        Box::new(std::io::BufReader::new(std::io::stdin()))
    } else {
        let f = std::fs::File::open(source).with_context(|| format!("opening {source}")).map_err(usage)?;
        Box::new(std::io::BufReader::new(f))
    };
    let limit = config.amqp.max_message_bytes;
    let mut reqs = Vec::new();
    let mut i = 0usize;
    while let Some(line) =
        bounded_line(&mut *reader, limit).with_context(|| format!("reading {source}")).map_err(usage)?
    {
        i += 1;
        let line = line.map_err(|len| {
            usage(anyhow::anyhow!("{source} line {i}: {len} bytes, above amqp.max_message_bytes ({limit})"))
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let mut req = parse_batch_line(&args.job, &line)
            .map_err(|e| usage(anyhow::anyhow!("{source} line {i}: {e}")))?;
        if req.queue.is_none() {
            req.queue = args.queue.clone();
        }
        if req.max_attempts.is_none() {
            req.max_attempts = args.max_attempts;
        }
        req.delay = delay;
        req.at = at;
        reqs.push(req);
    }
    for (i, r) in reqs.iter().enumerate() {
        prepare(&config, r).map_err(|e| usage(anyhow::anyhow!("{source} entry {}: {e}", i + 1)))?;
    }
    let client = EnqueueClient::connect(config).await.map_err(from_enqueue)?;
    let started = Instant::now();
    let report = client.enqueue_batch(&reqs).await.map_err(from_enqueue)?;
    let secs = started.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            serde_json::json!({"confirmed": report.confirmed, "total": report.total, "seconds": secs,
                "error": report.error.as_ref().map(|e| e.to_string())})
        );
    } else {
        let rate = if secs > 0.0 { report.confirmed as f64 / secs } else { 0.0 };
        println!("confirmed {} of {} jobs in {secs:.2}s ({rate:.0}/s)", report.confirmed, report.total);
    }
    match report.error {
        None => Ok(()),
        Some(e) => Err(runtime(anyhow::anyhow!(
            "{} of {} not confirmed: {e}",
            report.total - report.confirmed,
            report.total
        ))),
    }
}
