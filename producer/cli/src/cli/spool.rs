//! `chime spool status|list|flush`: the producers' local spool (`[producer] spool_dir`).

use anyhow::anyhow;
use chime_producer::spool::Spool;
use chime_shared::config::ValidConfig;
use clap::Subcommand;

use super::failure::{Failure, from_enqueue, runtime, usage};

#[derive(Debug, Subcommand)]
pub enum SpoolCommand {
    /// Files, jobs and bytes the spool holds, the oldest job's age, torn tails set aside
    Status {
        #[arg(long)]
        json: bool,
    },
    /// The spooled jobs, in the order they will be published (the spool is left as it was)
    List {
        /// Show at most N
        #[arg(long)]
        limit: Option<usize>,
        #[arg(long)]
        json: bool,
    },
    /// Publish every spooled job no live producer holds, in order, under its own key (exit 1
    /// if the broker does not take them all; what is left stays)
    Flush {
        #[arg(long)]
        json: bool,
    },
}

fn open(config: &ValidConfig) -> Result<Spool, Failure> {
    let dir = config
        .producer
        .spool_dir
        .as_ref()
        .ok_or_else(|| usage(anyhow!("no spool: [producer] spool_dir is not set in the config")))?;
    Spool::open(dir, config.producer.spool_max_bytes, &config.prefix).map_err(runtime)
}

pub async fn run(config: ValidConfig, cmd: SpoolCommand) -> Result<(), Failure> {
    match cmd {
        SpoolCommand::Status { json } => {
            let spool = open(&config)?;
            let status = spool.status().map_err(runtime)?;
            if json {
                println!("{}", serde_json::to_string(&status).unwrap_or_default());
                return Ok(());
            }
            let age = status
                .oldest
                .map(|t| {
                    format!(", the oldest spooled {}s ago", (chrono::Utc::now() - t).num_seconds().max(0))
                })
                .unwrap_or_default();
            println!(
                "spool {}: {} job(s) in {} file(s), {} bytes of {}{age}",
                spool.dir().display(),
                status.records,
                status.files,
                status.bytes,
                config.producer.spool_max_bytes
            );
            for t in &status.torn {
                println!("set aside (torn or damaged lines, never replayed): {}", t.display());
            }
            Ok(())
        }
        SpoolCommand::List { limit, json } => {
            let spool = open(&config)?;
            let records = spool.list().map_err(runtime)?;
            let shown = records.iter().take(limit.unwrap_or(usize::MAX));
            if json {
                let all: Vec<_> = shown.collect();
                println!("{}", serde_json::to_string(&all).unwrap_or_default());
                return Ok(());
            }
            for r in shown {
                let at = r.deliver_at.map(|t| format!(", deliver at {}", t.to_rfc3339())).unwrap_or_default();
                println!(
                    "{} {} key {} id {} queue {}{at}: {}",
                    r.spooled_at.to_rfc3339(),
                    r.envelope.job,
                    r.envelope.key,
                    r.envelope.id,
                    r.envelope.queue,
                    r.reason
                );
            }
            if records.is_empty() {
                println!("the spool is empty");
            }
            Ok(())
        }
        SpoolCommand::Flush { json } => {
            open(&config)?;
            let report =
                chime_producer::flush_spool(&config).await.map_err(from_enqueue)?.unwrap_or_default();
            let left = open(&config)?.status().map_err(runtime)?.records;
            if json {
                let mut out = serde_json::to_value(&report).unwrap_or_default();
                out["left"] = serde_json::json!(left);
                println!("{out}");
            } else {
                let left =
                    if left > 0 { format!("; {left} left (held by live producers)") } else { String::new() };
                println!(
                    "published {} spooled job(s) from {} file(s){}{left}",
                    report.published,
                    report.files,
                    if report.dropped > 0 {
                        format!(", {} broadcast copies dropped (their worker is gone)", report.dropped)
                    } else {
                        String::new()
                    }
                );
                for (path, why) in &report.torn {
                    println!("set aside, not replayed: {} ({why})", path.display());
                }
            }
            Ok(())
        }
    }
}
