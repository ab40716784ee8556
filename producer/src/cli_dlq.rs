//! `chime dlq list|show|replay|purge`.

use chime_shared::config::Config;
use clap::{Args, Subcommand};
use std::io::{BufRead, IsTerminal, Write};
use std::sync::Arc;

use crate::cli::{Failure, runtime, usage};
use crate::dlq::{DeadLetter, DlqClient, Filter, PassReport};

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters (the DLQ is left as it was)
    List {
        #[arg(long)]
        queue: Option<String>,
        #[arg(long)]
        job: Option<String>,
        /// Show at most N (per queue)
        #[arg(long)]
        limit: Option<usize>,
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter with its headers and body
    Show {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Send dead letters back to their work queue (attempt 1, source "replay")
    Replay(Select),
    /// Delete dead letters
    Purge {
        #[command(flatten)]
        select: Select,
        /// Only those that failed at least this long ago ("7d")
        #[arg(long, value_name = "DUR")]
        older_than: Option<String>,
        /// Do not ask for confirmation on a terminal
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Debug, Args)]
pub struct Select {
    /// Dead-letter ids (or unique prefixes of 8+ characters)
    pub ids: Vec<String>,
    /// Every dead letter (narrowed by --queue and --job)
    #[arg(long, conflicts_with = "ids")]
    pub all: bool,
    #[arg(long)]
    pub queue: Option<String>,
    #[arg(long)]
    pub job: Option<String>,
    #[arg(long)]
    pub json: bool,
}

pub async fn run(config: Config, cmd: DlqCommand) -> Result<(), Failure> {
    let client = DlqClient::connect(Arc::new(config)).await.map_err(runtime)?;
    let result = dispatch(&client, cmd).await;
    client.close().await;
    result
}

async fn dispatch(client: &DlqClient, cmd: DlqCommand) -> Result<(), Failure> {
    match cmd {
        DlqCommand::List { queue, job, limit, json } => {
            let filter = Filter { job, ..Default::default() };
            let mut all = Vec::new();
            for q in client.queues(queue.as_deref()).map_err(usage)? {
                let mut found = client.list(&q, &filter).await.map_err(runtime)?;
                if let Some(n) = limit {
                    found.truncate(n);
                }
                all.extend(found);
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default());
            } else {
                print_table(&all);
            }
            Ok(())
        }
        DlqCommand::Show { id, json } => {
            let filter = Filter { ids: vec![id.clone()], ..Default::default() };
            for q in client.queues(None).map_err(usage)? {
                if let Some(d) = client.list(&q, &filter).await.map_err(runtime)?.into_iter().next() {
                    print_one(&d, json);
                    return Ok(());
                }
            }
            Err(Failure { code: 1, error: anyhow::anyhow!("no dead letter with id {id}") })
        }
        DlqCommand::Replay(select) => {
            let filter = selection(&select, None)?;
            let mut total = PassReport::default();
            for q in client.queues(select.queue.as_deref()).map_err(usage)? {
                add(&mut total, client.replay(&q, &filter).await.map_err(runtime)?);
            }
            report("replayed", total.replayed, &total, select.json);
            Ok(())
        }
        DlqCommand::Purge { select, older_than, yes } => {
            let filter = selection(&select, older_than.as_deref())?;
            let queues = client.queues(select.queue.as_deref()).map_err(usage)?;
            if !yes && std::io::stdin().is_terminal() {
                let mut n = 0;
                for q in &queues {
                    n += client.list(q, &filter).await.map_err(runtime)?.len();
                }
                eprint!("purge {n} dead letter(s) from {}? [y/N] ", queues.join(", "));
                let _ = std::io::stderr().flush();
                let mut answer = String::new();
                let _ = std::io::stdin().lock().read_line(&mut answer);
                if !matches!(answer.trim(), "y" | "Y" | "yes") {
                    eprintln!("nothing purged");
                    return Ok(());
                }
            }
            let mut total = PassReport::default();
            for q in &queues {
                add(&mut total, client.purge(q, &filter).await.map_err(runtime)?);
            }
            report("purged", total.dropped, &total, select.json);
            Ok(())
        }
    }
}

fn selection(select: &Select, older_than: Option<&str>) -> Result<Filter, Failure> {
    if select.ids.is_empty() && !select.all {
        return Err(usage(anyhow::anyhow!(
            "name dead-letter ids, or pass --all (narrowed by --queue/--job)"
        )));
    }
    let older_than = older_than
        .map(chime_shared::duration::parse)
        .transpose()
        .map_err(|e| usage(anyhow::anyhow!("--older-than: {e}")))?;
    Ok(Filter { ids: select.ids.clone(), job: select.job.clone(), older_than })
}

fn add(total: &mut PassReport, r: PassReport) {
    total.seen += r.seen;
    total.kept += r.kept;
    total.dropped += r.dropped;
    total.replayed += r.replayed;
    total.unreplayable += r.unreplayable;
}

fn report(verb: &str, n: usize, r: &PassReport, json: bool) {
    if json {
        println!("{}", serde_json::to_string(r).unwrap_or_default());
        return;
    }
    println!("{verb} {n} dead letter(s); {} left in place", r.kept);
    if r.unreplayable > 0 {
        println!("{} matched but are not valid envelopes (reason malformed) and were kept", r.unreplayable);
    }
}

fn cut(s: &str, n: usize) -> String {
    let one_line = s.replace('\n', " ");
    if one_line.chars().count() <= n {
        one_line
    } else {
        format!("{}…", one_line.chars().take(n - 1).collect::<String>())
    }
}

fn print_table(all: &[DeadLetter]) {
    if all.is_empty() {
        println!("no dead letters");
        return;
    }
    println!(
        "{:<36}  {:<10}  {:<16}  {:<12}  {:>3}  {:<20}  ERROR",
        "ID", "QUEUE", "JOB", "REASON", "ATT", "FAILED AT"
    );
    for d in all {
        println!(
            "{:<36}  {:<10}  {:<16}  {:<12}  {:>3}  {:<20}  {}",
            d.id,
            cut(&d.queue, 10),
            cut(d.job.as_deref().unwrap_or("-"), 16),
            d.reason,
            d.attempts.map(|a| a.to_string()).unwrap_or_else(|| "-".into()),
            d.failed_at.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string()).unwrap_or_else(|| "-".into()),
            cut(d.error.as_deref().unwrap_or(""), 60),
        );
    }
    println!("{} dead letter(s)", all.len());
}

fn print_one(d: &DeadLetter, json: bool) {
    let body: serde_json::Value = serde_json::from_slice(&d.body)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&d.body).into_owned()));
    if json {
        let mut v = serde_json::to_value(d).unwrap_or_default();
        v["body"] = body;
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return;
    }
    println!("id:        {}", d.id);
    println!("queue:     {}", d.queue);
    println!("job:       {}", d.job.as_deref().unwrap_or("-"));
    println!("key:       {}", d.key.map(|k| k.to_string()).unwrap_or_else(|| "-".into()));
    println!("reason:    {}", d.reason);
    println!("attempts:  {}", d.attempts.map(|a| a.to_string()).unwrap_or_else(|| "-".into()));
    println!("failed at: {}", d.failed_at.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into()));
    println!("worker:    {}", d.worker.as_deref().unwrap_or("-"));
    println!("error:     {}", d.error.as_deref().unwrap_or("-"));
    println!("body:\n{}", serde_json::to_string_pretty(&body).unwrap_or_default());
}
