//! `chime dlq list|show|replay|purge`.

use chime_shared::config::ValidConfig;
use clap::{Args, Subcommand};
use std::io::{BufRead, IsTerminal, Write};

use super::failure::{Failure, runtime, usage};
use super::table;
use crate::dlq::{BodyKept, DeadLetter, DlqClient, Filter, PassReport, ResolveError};

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
    /// Show one dead letter with its headers and body, by id (or a unique prefix of 8+
    /// characters) or by idempotency key
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
        /// Do not ask for confirmation (required when stdin is not a terminal)
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Debug, Args)]
pub struct Select {
    /// Dead-letter ids (or unique prefixes of 8+ characters; an ambiguous prefix is an error)
    pub ids: Vec<String>,
    /// Dead letters of this idempotency key (a UUID, or with --job the key given at enqueue)
    #[arg(long = "key", value_name = "K")]
    pub keys: Vec<String>,
    /// Every dead letter (narrowed by --queue, --job and --key)
    #[arg(long, conflicts_with = "ids")]
    pub all: bool,
    #[arg(long)]
    pub queue: Option<String>,
    #[arg(long)]
    pub job: Option<String>,
    #[arg(long)]
    pub json: bool,
}

pub async fn run(config: ValidConfig, cmd: DlqCommand) -> Result<(), Failure> {
    let client = DlqClient::connect(config).await.map_err(runtime)?.named("chime dlq");
    let result = dispatch(&client, cmd).await;
    client.close().await;
    result
}

async fn dispatch(client: &DlqClient, cmd: DlqCommand) -> Result<(), Failure> {
    match cmd {
        DlqCommand::List { queue, job, limit, json } => {
            if limit == Some(0) {
                return Err(usage(anyhow::anyhow!("--limit must be at least 1")));
            }
            let filter = Filter { job, ..Default::default() };
            let mut all = Vec::new();
            for q in client.queues(queue.as_deref()).map_err(usage)? {
                let found = client
                    .list_with(&q, &filter, BodyKept::NONE, limit.unwrap_or(usize::MAX))
                    .await
                    .map_err(runtime)?;
                all.extend(found.letters);
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default());
            } else {
                print_table(&all);
            }
            Ok(())
        }
        DlqCommand::Show { id, json } => {
            let queues = client.queues(None).map_err(usage)?;
            // A key names the dead letters of one job run; an id (prefix) names one.
            if let Ok(key) = uuid::Uuid::parse_str(&id) {
                let filter = Filter { keys: vec![key], ..Default::default() };
                let mut found = Vec::new();
                for q in &queues {
                    found.extend(
                        client.list_with(q, &filter, BodyKept::SHOWN, 10).await.map_err(runtime)?.letters,
                    );
                }
                match found.as_slice() {
                    [one] => {
                        print_one(one, json);
                        return Ok(());
                    }
                    [] => {}
                    many => {
                        return Err(usage(anyhow::anyhow!(
                            "key {id} has {} dead letters; show one by id:\n{}",
                            many.len(),
                            many.iter()
                                .map(|d| format!("  {}  {}  {}", d.id, d.queue, d.reason))
                                .collect::<Vec<_>>()
                                .join("\n")
                        )));
                    }
                }
            }
            let ids = resolved(client, &queues, std::slice::from_ref(&id)).await?;
            let filter = Filter { ids, ..Default::default() };
            for q in &queues {
                let found = client.list_with(q, &filter, BodyKept::SHOWN, 1).await.map_err(runtime)?;
                if let Some(d) = found.letters.into_iter().next() {
                    print_one(&d, json);
                    return Ok(());
                }
            }
            Err(Failure { code: 1, error: anyhow::anyhow!("no dead letter with id {id}") })
        }
        DlqCommand::Replay(select) => {
            let queues = client.queues(select.queue.as_deref()).map_err(usage)?;
            let filter = selection(client, &queues, &select, None).await?;
            let mut total = PassReport::default();
            for q in &queues {
                add(&mut total, client.replay(q, &filter).await.map_err(runtime)?);
            }
            report("replayed", total.replayed, &total, select.json);
            nothing_matched(&select, total.replayed + total.unreplayable)
        }
        DlqCommand::Purge { select, older_than, yes } => {
            let queues = client.queues(select.queue.as_deref()).map_err(usage)?;
            let filter = selection(client, &queues, &select, older_than.as_deref()).await?;
            if !yes && !std::io::stdin().is_terminal() {
                return Err(usage(anyhow::anyhow!(
                    "refusing to purge without --yes: standard input is not a terminal, so nobody can confirm"
                )));
            }
            if !yes {
                let (mut n, mut per_queue) = (0, Vec::new());
                for q in &queues {
                    let here = client.list(q, &filter).await.map_err(runtime)?.len();
                    if here > 0 {
                        per_queue.push(format!("{q}: {here}"));
                    }
                    n += here;
                }
                eprint!("purge {n} dead letter(s) ({})? [y/N] ", per_queue.join(", "));
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
            nothing_matched(&select, total.dropped)
        }
    }
}

/// A command naming ids or keys that matched nothing exits 1 (a typo must not look like
/// success); `--all` over an empty DLQ is fine.
fn nothing_matched(select: &Select, n: usize) -> Result<(), Failure> {
    if n == 0 && !(select.all && select.ids.is_empty() && select.keys.is_empty()) {
        return Err(Failure { code: 1, error: anyhow::anyhow!("no dead letter matched") });
    }
    Ok(())
}

/// Exact ids for `given` ids or prefixes: an ambiguous prefix exits 2 listing the matches, an
/// unknown id exits 1.
async fn resolved(client: &DlqClient, queues: &[String], given: &[String]) -> Result<Vec<String>, Failure> {
    match client.resolve(queues, given).await.map_err(runtime)? {
        Ok(ids) => Ok(ids),
        Err(e @ ResolveError::NoMatch(_)) => Err(Failure { code: 1, error: e.into() }),
        Err(e) => Err(usage(e)),
    }
}

async fn selection(
    client: &DlqClient,
    queues: &[String],
    select: &Select,
    older_than: Option<&str>,
) -> Result<Filter, Failure> {
    if select.ids.is_empty() && select.keys.is_empty() && !select.all {
        return Err(usage(anyhow::anyhow!(
            "name dead-letter ids, or --key K, or pass --all (narrowed by --queue/--job)"
        )));
    }
    let older_than = older_than
        .map(chime_shared::duration::parse)
        .transpose()
        .map_err(|e| usage(anyhow::anyhow!("--older-than: {e}")))?;
    let keys = select
        .keys
        .iter()
        .map(|k| match (uuid::Uuid::parse_str(k), &select.job) {
            (Ok(key), _) => Ok(key),
            (Err(_), Some(job)) => Ok(chime_shared::envelope::adhoc_key(job, k)),
            (Err(_), None) => Err(usage(anyhow::anyhow!(
                "--key {k:?}: not a UUID; give --job too to derive the key of an ad-hoc job"
            ))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let ids = if select.ids.is_empty() { Vec::new() } else { resolved(client, queues, &select.ids).await? };
    Ok(Filter { ids, keys, job: select.job.clone(), older_than })
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
    let one_line = chime_shared::redact::escape_control(&s.replace('\n', " ")).into_owned();
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
    let mut t = table::new(["ID", "QUEUE", "JOB", "REASON", "ATT", "FAILED AT (UTC)", "ERROR"], &["ATT"]);
    for d in all {
        t.add_row([
            d.id.to_string(),
            cut(&d.queue, 24),
            cut(d.job.as_deref().unwrap_or("-"), 32),
            d.reason.to_string(),
            d.attempts.map(|a| a.to_string()).unwrap_or_else(|| "-".into()),
            d.failed_at.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string()).unwrap_or_else(|| "-".into()),
            cut(d.error.as_deref().unwrap_or(""), 60),
        ]);
    }
    table::print(&t);
    println!("{} dead letter(s)", all.len());
    for line in shared_keys(all) {
        println!("{line}");
    }
}

/// A line for each key that several of `all` share: one run dead-lettered more than once (a
/// worker killed between publishing its dead letter and acking the delivery dead-letters it
/// again). Replaying one of them is enough: the key runs once whichever copies are replayed.
fn shared_keys(all: &[DeadLetter]) -> Vec<String> {
    let mut count: std::collections::BTreeMap<uuid::Uuid, usize> = Default::default();
    for k in all.iter().filter_map(|d| d.key) {
        *count.entry(k).or_default() += 1;
    }
    count
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(k, n)| {
            format!(
                "note: {n} dead letters share key {k} (one run dead-lettered more than once); replaying one is enough (chime dlq show {k} lists them)"
            )
        })
        .collect()
}

fn print_one(d: &DeadLetter, json: bool) {
    // A body that is not JSON (or is cut) is shown as a JSON string: JSON escapes control
    // characters, so nothing from the wire reaches the terminal raw.
    let body: serde_json::Value = serde_json::from_slice(&d.body)
        .ok()
        .filter(|_| d.body_whole())
        .unwrap_or_else(|| serde_json::Value::String(String::from_utf8_lossy(&d.body).into_owned()));
    let cut = (!d.body_whole()).then(|| {
        format!("the first {} of {} bytes (a replay sends the whole body)", d.body.len(), d.body_bytes)
    });
    if json {
        let mut v = serde_json::to_value(d).unwrap_or_default();
        v["body"] = body;
        v["body_truncated"] = serde_json::Value::Bool(cut.is_some());
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return;
    }
    println!("id:        {}", d.id);
    println!("queue:     {}", d.queue);
    let esc = |s: &str| chime_shared::redact::escape_control(s).into_owned();
    println!("job:       {}", esc(d.job.as_deref().unwrap_or("-")));
    println!("key:       {}", d.key.map(|k| k.to_string()).unwrap_or_else(|| "-".into()));
    println!("reason:    {}", d.reason);
    println!("attempts:  {}", d.attempts.map(|a| a.to_string()).unwrap_or_else(|| "-".into()));
    println!("failed at: {}", d.failed_at.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into()));
    println!("worker:    {}", esc(d.worker.as_deref().unwrap_or("-")));
    println!("error:     {}", esc(d.error.as_deref().unwrap_or("-")));
    match cut {
        Some(cut) => println!("body, {cut}:"),
        None => println!("body:"),
    }
    println!("{}", serde_json::to_string_pretty(&body).unwrap_or_default());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(id: &str, key: Option<uuid::Uuid>) -> DeadLetter {
        DeadLetter {
            id: id.into(),
            queue: "q".into(),
            job: Some("j".into()),
            key,
            reason: "failed".into(),
            error: None,
            attempts: Some(1),
            failed_at: None,
            worker: None,
            body_bytes: 0,
            replayable: true,
            body: Vec::new(),
        }
    }

    #[test]
    fn keys_shared_by_several_dead_letters_are_named_once_each() {
        let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        let all = [
            letter("1", Some(a)),
            letter("2", Some(b)),
            letter("3", Some(a)),
            letter("4", None),
            letter("5", None),
        ];
        let lines = shared_keys(&all);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with(&format!("note: 2 dead letters share key {a}")), "{lines:?}");
        assert!(shared_keys(&all[1..3]).is_empty());
    }
}
