//! `chime enqueue`: one job, or a batch of JSON lines, each confirmed by the broker.

use anyhow::Context as _;
use chime_producer::{
    Delivery, Encoded, EnqueueClient, EnqueueError, EnqueueRequest, LineShape, Prepared,
    parse_batch_line_shaped, prepare, prepare_owned,
};
use chime_shared::config::{Config, ValidConfig};
use chime_shared::history::HistoryReader;
use clap::Args;
use std::io::{BufRead, Read, Write};
use std::time::Instant;

use super::failure::{Failure, from_enqueue, runtime, usage};

#[derive(Debug, Clone, Args)]
pub struct EnqueueArgs {
    /// Job name, as in the config's [[jobs]]
    #[arg(required_unless_present = "workflow")]
    pub job: Option<String>,
    /// Enqueue a workflow: a TOML (or .json) file of [[steps]] (name, job, payload, after);
    /// every step is published now and starts when the steps it names in `after` are done
    #[arg(long, value_name = "FILE", conflicts_with_all = ["job", "payload", "payload_file", "batch", "debounce", "replace", "delay", "at", "queue", "max_attempts", "priority", "wait"])]
    pub workflow: Option<String>,
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
    /// high, normal or low: delivered ahead of (or behind) the queue's other jobs when a
    /// backlog exists (default: the job's priority)
    #[arg(long)]
    pub priority: Option<chime_shared::config::Priority>,
    /// Deliver after this long ("90s", "2h", "30d"; 1 s granularity)
    #[arg(long, value_name = "DUR", conflicts_with = "at")]
    pub delay: Option<String>,
    /// Deliver at this time (RFC 3339; a past time runs now)
    #[arg(long, value_name = "RFC3339")]
    pub at: Option<String>,
    /// Debounce: deliver after this window ("30s"); of several enqueues of this --key within
    /// it only the last runs, with its payload (a key already done stays done)
    #[arg(long, value_name = "DUR", conflicts_with_all = ["delay", "at", "batch"], requires = "key")]
    pub debounce: Option<String>,
    /// Replace: supersede the copies of this --key still waiting (queued or delayed); this one
    /// runs, with its payload (one already running is not stopped: see `chime cancel`)
    #[arg(long, conflicts_with = "batch", requires = "key")]
    pub replace: bool,
    /// JSON lines, one job each ({"payload":…,"key":…} or a bare payload); `-` = stdin
    #[arg(long, value_name = "PATH|-")]
    pub batch: Option<String>,
    /// With --batch: up to N jobs per AMQP message (1-1000; each job keeps its own key,
    /// payload and attempts, and is retried or dead-lettered on its own). For many short jobs
    #[arg(long, value_name = "N", requires = "batch")]
    pub pack: Option<usize>,
    /// Wait until the job is done or dead and print its result (exit 1 if it was
    /// dead-lettered or did not finish in time)
    #[arg(long, conflicts_with = "batch")]
    pub wait: bool,
    /// How long --wait waits
    #[arg(long, value_name = "DUR", default_value = "5m", requires = "wait")]
    pub wait_timeout: String,
    /// Print the result as JSON
    #[arg(long)]
    pub json: bool,
    /// With a spool (`[producer] spool_dir`): exit 0 when the broker did not confirm a job and
    /// it went to the spool (default: exit 1, the job kept in the spool all the same)
    #[arg(long)]
    pub allow_spool: bool,
}

impl EnqueueArgs {
    /// The job named (empty with --workflow).
    fn job(&self) -> &str {
        self.job.as_deref().unwrap_or_default()
    }
}

/// Reads a payload from a file or `-` (stdin), at most `limit` bytes (what `limit_name`
/// names): a larger one is rejected without being read whole.
fn read_source(path: &str, limit: usize, limit_name: &str) -> Result<String, Failure> {
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
        return Err(usage(anyhow::anyhow!("{path} is larger than {limit_name} ({limit} bytes)")));
    }
    let mut text = String::from_utf8(bytes).with_context(|| format!("{path} is not UTF-8")).map_err(usage)?;
    strip_bom(&mut text);
    Ok(text)
}

/// Drops a UTF-8 byte order mark that starts `text` (some Windows tools write one; JSON
/// readers may ignore it, RFC 8259 §8.1).
fn strip_bom(text: &mut String) {
    if text.starts_with('\u{feff}') {
        text.drain(..'\u{feff}'.len_utf8());
    }
}

/// A line [`bounded_line`] could not return.
#[derive(Debug)]
enum BadLine {
    /// Longer than the limit: its length.
    TooLong(usize),
    /// Not UTF-8: the column (from 1) of its first byte that is not.
    NotUtf8(usize),
}

/// The next line of `reader` (without its newline), at most `limit` bytes and UTF-8 (never
/// altered: a byte that is not UTF-8 refuses the line); `None` at the end.
fn bounded_line(reader: &mut dyn BufRead, limit: usize) -> std::io::Result<Option<Result<String, BadLine>>> {
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
        return Ok(Some(Err(BadLine::TooLong(skipped))));
    }
    Ok(Some(String::from_utf8(buf).map_err(|e| BadLine::NotUtf8(e.utf8_error().valid_up_to() + 1))))
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

pub async fn run(config: ValidConfig, args: EnqueueArgs) -> Result<(), Failure> {
    if let Some(file) = &args.workflow {
        return workflow(config, &args, file).await;
    }
    if config.job(args.job()).is_none() {
        return Err(usage(EnqueueError::UnknownJob(args.job().to_string())));
    }
    let (delay, at) = timing(&args)?;
    if let Some(batch) = &args.batch {
        return enqueue_batch(config, &args, batch, delay, at).await;
    }
    let payload_text = match (&args.payload, &args.payload_file) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(f)) => Some(read_source(f, config.amqp.max_message_bytes, "amqp.max_message_bytes")?),
        (None, None) => None,
    };
    let what = match &args.payload_file {
        Some(f) if args.payload.is_none() => format!("--payload-file {f}"),
        _ => "--payload".to_string(),
    };
    let payload = payload_text
        .map(|t| serde_json::from_str::<serde_json::Value>(&t))
        .transpose()
        .with_context(|| format!("{what} is not valid JSON"))
        .map_err(usage)?;
    let mut req = EnqueueRequest::new(args.job());
    req.payload = payload;
    req.key = args.key.clone();
    req.queue = args.queue.clone();
    req.max_attempts = args.max_attempts;
    req.priority = args.priority;
    req.delay = delay;
    req.at = at;
    req.replace = args.replace;
    req.debounce = args
        .debounce
        .as_deref()
        .map(chime_shared::duration::parse)
        .transpose()
        .map_err(|e| usage(anyhow::anyhow!("--debounce: {e}")))?;
    // Validate before connecting, so a bad request never touches the broker.
    let key = prepare(&config, &req).map_err(from_enqueue)?.envelope.key;
    // Asked before publishing: a worker may settle this very copy a moment later.
    let settled =
        if args.key.is_some() { settled_keys(&config, &[key.to_string()]).await } else { Vec::new() };
    let wait_for = if args.wait {
        let d = chime_shared::duration::parse(&args.wait_timeout)
            .map_err(|e| usage(anyhow::anyhow!("--wait-timeout: {e}")))?;
        // Refused before the job is published: a zero wait could only fail after enqueueing.
        if d.is_zero() {
            return Err(usage(anyhow::anyhow!(
                "--wait-timeout {}: must be more than 0 (leave out --wait not to wait)",
                args.wait_timeout
            )));
        }
        Some(d)
    } else {
        None
    };
    let client = EnqueueClient::connect(config.clone()).await.map_err(from_enqueue)?;
    let done = client.enqueue(req).await.map_err(from_enqueue)?;
    let spooled = done.delivery == Delivery::Spooled;
    let how = if spooled { "spooled" } else { "confirmed" };
    let Some(wait_for) = wait_for else {
        if args.json {
            let mut out = serde_json::json!({"confirmed": !spooled, "spooled": spooled, "id": done.id,
                "key": done.key, "job": done.job, "queue": done.queue});
            if !done.members.is_empty() {
                out["members"] = serde_json::json!(done.members);
            }
            println!("{out}");
        } else if done.members.is_empty() {
            println!(
                "enqueued {} on queue {} (key {}, id {}), {how}",
                done.job, done.queue, done.key, done.id
            );
            if args.replace {
                println!(
                    "copies of key {} still waiting (queued or delayed) are superseded: this one runs",
                    done.key
                );
            }
        } else {
            println!(
                "enqueued {} on queue {} as {} messages (key {}; chime inspect {} shows each), {how}",
                done.job,
                done.queue,
                done.members.len(),
                done.key,
                done.key
            );
        }
        warn_settled(settled.first(), settled.len());
        return spool_verdict(&config, args.allow_spool, spooled.then_some(1));
    };
    if !args.json {
        eprintln!("enqueued {} (key {}), {how}; waiting up to {}", done.job, done.key, args.wait_timeout);
    }
    warn_settled(settled.first(), settled.len());
    // A spooled job is published by this process's flusher while it waits.
    print_finished(client.wait(done.key, wait_for).await, args.json)
}

/// Exit status after `spooled` jobs went to the spool: 1 unless `--allow-spool`, with what
/// happened to them.
fn spool_verdict(config: &ValidConfig, allow: bool, spooled: Option<usize>) -> Result<(), Failure> {
    let Some(n) = spooled.filter(|n| *n > 0) else { return Ok(()) };
    let dir = config.producer.spool_dir.as_deref().map(|d| d.display().to_string()).unwrap_or_default();
    let what = format!(
        "the broker did not confirm {n} job(s): they are kept in the spool ({dir}) and published under \
         their keys by the next flush (chime spool status, chime spool flush)"
    );
    if allow {
        eprintln!("{what}");
        Ok(())
    } else {
        Err(runtime(anyhow::anyhow!("{what}; --allow-spool makes this exit 0")))
    }
}

/// Prints how a waited-for job ended: its result (standard output), or why it did not end
/// well (exit 1).
fn print_finished(
    finished: Result<chime_producer::Finished, chime_producer::WaitError>,
    json: bool,
) -> Result<(), Failure> {
    use chime_producer::Finished;
    let finished = finished.map_err(runtime)?;
    if json {
        println!("{}", serde_json::to_string(&finished).unwrap_or_default());
    }
    match finished {
        Finished::Done { result } => {
            use chime_shared::record::StoredResult;
            if !json {
                match result {
                    Some(StoredResult::Value(r)) => {
                        println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default())
                    }
                    Some(StoredResult::Missing(why)) => eprintln!("done; no result: {why}"),
                    None => eprintln!("done (no result)"),
                }
            }
            Ok(())
        }
        Finished::Dead { reason, error } => Err(runtime(anyhow::anyhow!(
            "the job was dead-lettered ({}){}",
            chime_shared::redact::escape_control(reason.as_deref().unwrap_or("see chime dlq list")),
            error.map(|e| format!(": {}", chime_shared::redact::escape_control(&e))).unwrap_or_default()
        ))),
        Finished::Cancelled => Err(runtime(anyhow::anyhow!("the job was cancelled (chime cancel)"))),
        Finished::Group { members } => {
            let dead = members
                .iter()
                .filter(|m| matches!(m.finished, Finished::Dead { .. } | Finished::Cancelled))
                .count();
            if !json {
                for m in &members {
                    let who = match (&m.shard, &m.worker) {
                        (Some(s), _) => format!("shard {s}"),
                        (_, Some(w)) => format!("worker {}", chime_shared::redact::escape_control(w)),
                        _ => m.key.to_string(),
                    };
                    match &m.finished {
                        Finished::Done { result: Some(chime_shared::record::StoredResult::Value(r)) } => {
                            println!("{who}: {r}")
                        }
                        Finished::Done { .. } => println!("{who}: done"),
                        Finished::Dead { reason, .. } => {
                            let reason = reason.as_deref().unwrap_or("?");
                            println!(
                                "{who}: dead-lettered ({})",
                                chime_shared::redact::escape_control(reason)
                            )
                        }
                        Finished::Cancelled => println!("{who}: cancelled"),
                        Finished::Group { .. } => {}
                    }
                }
            }
            if dead == 0 {
                Ok(())
            } else {
                Err(runtime(anyhow::anyhow!(
                    "{dead} of {} members were dead-lettered or cancelled",
                    members.len()
                )))
            }
        }
    }
}

/// A key that already ran to an end: the key, `done` or `dead`, and when.
type Settled = (String, chime_shared::record::KeyState, Option<chrono::DateTime<chrono::Utc>>);

/// The keys among `keys` that already ran to an end: their new copies will be absorbed as
/// duplicates. Empty when Redis cannot be asked.
async fn settled_keys(config: &Config, keys: &[String]) -> Vec<Settled> {
    match super::history::reader(config).await {
        Ok(reader) => settled_among(&reader, keys).await,
        Err(_) => Vec::new(),
    }
}

/// [`settled_keys`] on a connection already made.
async fn settled_among(reader: &HistoryReader, keys: &[String]) -> Vec<Settled> {
    let Ok(states) = reader.states(keys).await else { return Vec::new() };
    keys.iter()
        .zip(states)
        .filter_map(|(k, s)| s.filter(|(s, _)| s.settled()).map(|(s, t)| (k.clone(), s, t)))
        .collect()
}

/// Warns (on stderr; the exit code stays 0) about copies that will be absorbed, which
/// otherwise look like fresh jobs that never run.
fn warn_settled(first: Option<&Settled>, count: usize) {
    match (first, count) {
        (_, 0) | (None, _) => {}
        (Some((key, state, at)), 1) => {
            let when = at.map(|t| format!(" at {}", t.format("%Y-%m-%d %H:%M:%S UTC"))).unwrap_or_default();
            let fate = if *state == chime_shared::record::KeyState::Dead {
                "it was dead-lettered; `chime dlq replay` runs it again"
            } else {
                "it will not run again; use a new --key to run the job again"
            };
            eprintln!(
                "warning: key {key} is already {state}{when}: this copy will be absorbed as a duplicate ({fate})"
            );
        }
        (Some(_), many) => eprintln!(
            "warning: {many} of these keys already ran to an end (done or dead): their copies will be absorbed as duplicates"
        ),
    }
}

/// Jobs published per `publish_batch` call: what the second pass holds in memory at once.
const PUBLISH_CHUNK: usize = 10_000;
/// The validating pass keeps the jobs it prepared, up to about this many bytes of memory (for
/// each half of a split file), so that the publishing pass does not read, parse and prepare
/// them again; it reads the rest of a larger batch again from the first job not kept.
const KEEP_BYTES: usize = 32 << 20;
/// Keys asked about per Redis round trip while validating.
const SETTLED_CHUNK: usize = 1_000;
/// A batch file at least this large is validated in two halves at once, the second on a
/// thread of its own (standard input is read once, on one thread).
const SPLIT_BYTES: u64 = 256 << 10;

/// Jobs a batch keeps between its passes, and pass 2 reads in chunks: prepared, or encoded
/// ([`Encoded`]) when each job is a message of its own (not packed, not fanned out): then each
/// costs less than half the memory, and is encoded where it is validated or read, not on the
/// task that publishes.
enum Jobs {
    Prepared(Vec<Prepared>),
    Encoded(Vec<Encoded>),
}

impl Default for Jobs {
    fn default() -> Self {
        Jobs::Prepared(Vec::new())
    }
}

impl Jobs {
    fn with_capacity(encoded: bool, n: usize) -> Self {
        if encoded { Jobs::Encoded(Vec::with_capacity(n)) } else { Jobs::Prepared(Vec::with_capacity(n)) }
    }

    fn push(&mut self, p: Prepared) {
        match self {
            Jobs::Prepared(v) => v.push(p),
            Jobs::Encoded(v) => v.push(Encoded::new(p)),
        }
    }

    fn len(&self) -> usize {
        match self {
            Jobs::Prepared(v) => v.len(),
            Jobs::Encoded(v) => v.len(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A prepared job's share of `KEEP_BYTES`: about 1 KiB for a small payload (peak RSS measured
/// with 10,000 and 50,000 jobs of 20-byte lines), growing with its line. An encoded job takes
/// less than half of that (~470 bytes measured alike) but is counted the same: the budget
/// stays a bound, and a batch of up to ~60,000 small lines is kept whole either way.
fn kept_cost(line_len: usize) -> usize {
    1024 + 4 * line_len
}

/// Where a batch file's second half starts: just after the first newline past its middle.
/// None for a small file, or when that line is longer than `limit` (the first half then
/// reports it).
fn split_point(path: &std::path::Path, limit: usize) -> Option<u64> {
    use std::io::Seek as _;
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    if len < SPLIT_BYTES {
        return None;
    }
    let middle = len / 2;
    f.seek(std::io::SeekFrom::Start(middle)).ok()?;
    let mut rest = Vec::new();
    let n = std::io::BufReader::new(f).take(limit as u64 + 1).read_until(b'\n', &mut rest).ok()?;
    let at = middle + n as u64;
    (rest.last() == Some(&b'\n') && at < len).then_some(at)
}

/// What validating a file's second half found.
#[derive(Default)]
struct Checked {
    jobs: usize,
    /// Queues no config declares, each with the first line naming it.
    queues: std::collections::BTreeMap<String, usize>,
    /// Its keys that already ran to an end.
    settled: SettledTally,
    /// Its keys given on more than one line.
    repeats: Repeats,
    /// Its lines that look like requests without a payload.
    lookalikes: Lookalikes,
    /// The jobs of its first lines, up to `kept_lines` (numbered in the whole file), kept for
    /// pass 2 while they fit in `KEEP_BYTES` (none once the first half could not keep all of
    /// its own: pass 2 then reads on from the first half's last kept line).
    kept: Jobs,
    kept_lines: usize,
}

/// Pass 1's look at one request (line `i`): prepared as it will be published, its queue noted
/// when no config declares it; the key to ask Redis about when the line gave one.
fn check_line(
    config: &Config,
    source: &str,
    i: usize,
    req: EnqueueRequest,
    queues: &mut std::collections::BTreeMap<String, usize>,
) -> Result<(Prepared, Option<uuid::Uuid>), Failure> {
    let keyed = req.key.is_some();
    let p = prepare_owned(config, req).map_err(|e| usage(anyhow::anyhow!("{source} line {i}: {e}")))?;
    if let Some(q) = &p.unverified_queue {
        queues.entry(q.clone()).or_insert(i);
    }
    let key = keyed.then_some(p.envelope.key);
    Ok((p, key))
}

/// The keys a batch gives on more than one line. Each key runs once, so of the lines sharing
/// one only a single job runs (whichever copy a worker claims first): worth a warning, as the
/// lines may well have meant different jobs. Each keyed line is remembered as 16 bytes (64 bits
/// of its key, which are UUIDv5 hashes: a false repeat among a million keys has odds of about
/// 1 in 30 million; and its line), sorted once the whole batch is read: ~16 MiB for a million
/// keyed lines, nothing for lines without a key.
#[derive(Default)]
pub(crate) struct Repeats {
    /// `key bits << 64 | line`, in the order of the lines.
    seen: Vec<u128>,
}

impl Repeats {
    pub(crate) fn add(&mut self, key: uuid::Uuid, line: usize) {
        let (hi, lo) = key.as_u64_pair();
        self.seen.push(u128::from(hi ^ lo) << 64 | line as u128);
    }

    /// The lines of a later part of the file (`later`) added.
    fn merge(&mut self, mut later: Repeats) {
        self.seen.append(&mut later.seen);
    }

    /// How many lines repeat a key given on an earlier line, and the first of them with the
    /// earlier line whose key it repeats.
    fn found(mut self) -> (usize, Option<(usize, usize)>) {
        self.seen.sort_unstable();
        let (mut count, mut first) = (0, None::<(usize, usize)>);
        let key = |v: u128| (v >> 64) as u64;
        let line = |v: u128| (v as u64) as usize;
        for group in self.seen.chunk_by(|a, b| key(*a) == key(*b)).filter(|g| g.len() > 1) {
            count += group.len() - 1;
            let (earlier, repeat) = (line(group[0]), line(group[1]));
            if first.is_none_or(|(l, _)| repeat < l) {
                first = Some((repeat, earlier));
            }
        }
        (count, first)
    }

    /// The warning, if any line repeats an earlier one's key: `one` names a repeat and the
    /// line it repeats, `many` a count of them (and the first), `lines` what the batch's
    /// elements are called.
    pub(crate) fn warning(
        self,
        one: impl Fn(usize, usize) -> String,
        many: impl Fn(usize, usize, usize) -> String,
        lines: &str,
    ) -> Option<String> {
        let (count, Some((line, earlier))) = self.found() else { return None };
        let repeats = match count {
            1 => one(line, earlier),
            n => many(n, line, earlier),
        };
        Some(format!(
            "{repeats}: each key runs once, so of the {lines} sharing a key only one job runs \
             (whichever copy a worker claims first); give each job its own key"
        ))
    }

    fn warn(self, source: &str) {
        let warning = self.warning(
            |line, earlier| format!("{source} line {line} repeats the key of line {earlier}"),
            |n, line, earlier| {
                format!("{n} lines of {source} repeat the key of an earlier line (the first: line {line}, the key of line {earlier})")
            },
            "lines",
        );
        if let Some(w) = warning {
            eprintln!("warning: {w}");
        }
    }
}

/// Validates the lines of `path` from byte `from` to the end (read by `requests`), numbered as
/// in the whole file, keeping the jobs of its first lines while they fit (and while
/// `first_full` is unset: the first half kept all of its own so far), and asks Redis about
/// their keys a chunk at a time (on the runtime, from this blocking thread); stops early
/// (with what it found) once `stop` is set.
fn check_second_half<'a>(
    path: &std::path::Path,
    from: u64,
    requests: impl FnOnce(Box<dyn BufRead + 'a>) -> Requests<'a>,
    config: &Config,
    stop: &std::sync::atomic::AtomicBool,
    first_full: &std::sync::atomic::AtomicBool,
    encoded: bool,
) -> Result<Checked, Failure> {
    let handle = tokio::runtime::Handle::current();
    let f =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display())).map_err(usage)?;
    // The lines before it, read through once (the file's position ends at `from`).
    let mut head = std::io::BufReader::with_capacity(1 << 16, (&f).take(from));
    let mut before = 0;
    loop {
        let buf = head.fill_buf().with_context(|| format!("reading {}", path.display())).map_err(usage)?;
        if buf.is_empty() {
            break;
        }
        before += buf.iter().filter(|b| **b == b'\n').count();
        let n = buf.len();
        head.consume(n);
    }
    drop(head);
    let mut requests = requests(Box::new(std::io::BufReader::with_capacity(1 << 16, f)));
    requests.line = before;
    let mut found = Checked { kept: Jobs::with_capacity(encoded, 0), ..Checked::default() };
    let (mut kept_bytes, mut keeping) = (0, true);
    while !stop.load(std::sync::atomic::Ordering::Relaxed)
        && let Some((i, req)) = requests.next()?
    {
        let (p, key) = check_line(config, requests.source, i, req, &mut found.queues)?;
        if let Some(key) = key {
            found.repeats.add(key, i);
            handle.block_on(found.settled.add(config, key.to_string()));
        }
        found.jobs += 1;
        if keeping {
            kept_bytes += kept_cost(requests.last_len);
            let useless = first_full.load(std::sync::atomic::Ordering::Relaxed);
            keeping = kept_bytes <= KEEP_BYTES && !useless;
            if keeping {
                found.kept.push(p);
                found.kept_lines = i;
            } else if useless {
                // Of no use to pass 2: the memory goes now.
                (found.kept, found.kept_lines) = (Jobs::default(), 0);
            }
        }
    }
    handle.block_on(found.settled.flush(config));
    found.lookalikes = std::mem::take(&mut requests.lookalikes);
    Ok(found)
}

/// Sets its flag when dropped: the second half's check stops when the first half fails.
struct StopOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A batch's lines, read twice: once to validate every one (nothing is published when one is
/// bad), once to publish. Standard input, a pipe (`--batch <(…)`) or a device cannot be read
/// twice, so the first pass copies it to a temporary file, removed when this is dropped.
/// Memory does not grow with the batch.
struct BatchFile {
    path: std::path::PathBuf,
    spooled: bool,
}

impl BatchFile {
    /// Its first `upto` bytes (all of it without).
    fn reader(&self, upto: Option<u64>) -> Result<Box<dyn BufRead>, Failure> {
        open_batch(&self.path, 0..upto.unwrap_or(u64::MAX))
    }
}

/// The bytes `range` of the file at `path`.
fn open_batch(path: &std::path::Path, range: std::ops::Range<u64>) -> Result<Box<dyn BufRead>, Failure> {
    use std::io::Seek as _;
    let mut f =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display())).map_err(usage)?;
    if range.start > 0 {
        f.seek(std::io::SeekFrom::Start(range.start))
            .with_context(|| format!("reading {}", path.display()))
            .map_err(usage)?;
    }
    Ok(Box::new(std::io::BufReader::with_capacity(1 << 16, f.take(range.end - range.start))))
}

impl Drop for BatchFile {
    fn drop(&mut self) {
        if self.spooled {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Counts the keys of a batch that already ran to an end, asking Redis a chunk at a time on
/// one connection (made at the first chunk; none if Redis cannot be reached).
#[derive(Default)]
struct SettledTally {
    count: usize,
    first: Option<Settled>,
    pending: Vec<String>,
    reader: Option<Option<HistoryReader>>,
}

impl SettledTally {
    async fn add(&mut self, config: &Config, key: String) {
        self.pending.push(key);
        if self.pending.len() >= SETTLED_CHUNK {
            self.flush(config).await;
        }
    }

    async fn flush(&mut self, config: &Config) {
        if self.pending.is_empty() {
            return;
        }
        if self.reader.is_none() {
            self.reader = Some(super::history::reader(config).await.ok());
        }
        let keys = std::mem::take(&mut self.pending);
        let found = match self.reader.as_ref().and_then(Option::as_ref) {
            Some(reader) => settled_among(reader, &keys).await,
            None => Vec::new(),
        };
        self.count += found.len();
        if self.first.is_none() {
            self.first = found.into_iter().next();
        }
    }
}

/// The requests of a batch file, one per non-blank line, numbered from 1 as in the file, with
/// the command line's queue, attempts and timing filled in; each line is also copied to
/// `spool` when there is one. Lines up to `skip_to` are passed over unread (their jobs were
/// kept from the first pass).
struct Requests<'a> {
    reader: Box<dyn BufRead + 'a>,
    spool: Option<std::io::BufWriter<std::fs::File>>,
    source: &'a str,
    limit: usize,
    args: &'a EnqueueArgs,
    timing: (Option<std::time::Duration>, Option<chrono::DateTime<chrono::Utc>>),
    line: usize,
    skip_to: usize,
    /// The length of the last line returned.
    last_len: usize,
    /// Its lines that look like requests without a payload.
    lookalikes: Lookalikes,
}

/// The lines of a batch that are objects of a request's fields without `payload`
/// (`{"key": "k1"}`): read as payloads, as documented, though likely meant as requests; a
/// warning names the first.
#[derive(Default)]
struct Lookalikes {
    count: usize,
    first: Option<usize>,
}

impl Lookalikes {
    /// Lines come in order: the first one added is the first.
    fn add(&mut self, line: usize) {
        self.count += 1;
        self.first.get_or_insert(line);
    }

    /// Those of a later part of the file added.
    fn merge(&mut self, later: Lookalikes) {
        self.count += later.count;
        self.first = self.first.or(later.first);
    }

    fn warn(&self, source: &str) {
        let Some(line) = self.first else { return };
        let lines = match self.count {
            1 => format!("{source} line {line} is"),
            n => format!("{n} lines of {source} (the first: line {line}) are"),
        };
        eprintln!(
            "warning: {lines} an object of request fields (key, queue, max_attempts, priority) without \
             \"payload\": such a line is the job's payload, so its job has no key; for a request with \
             the job's default payload write {{\"payload\": null, \"key\": …}}"
        );
    }
}

impl<'a> Requests<'a> {
    fn new(
        reader: Box<dyn BufRead + 'a>,
        source: &'a str,
        limit: usize,
        args: &'a EnqueueArgs,
        timing: (Option<std::time::Duration>, Option<chrono::DateTime<chrono::Utc>>),
    ) -> Self {
        Self {
            reader,
            spool: None,
            source,
            limit,
            args,
            timing,
            line: 0,
            skip_to: 0,
            last_len: 0,
            lookalikes: Lookalikes::default(),
        }
    }
}

impl Requests<'_> {
    fn next(&mut self) -> Result<Option<(usize, EnqueueRequest)>, Failure> {
        loop {
            let (source, limit) = (self.source, self.limit);
            let Some(line) = bounded_line(&mut *self.reader, limit)
                .with_context(|| format!("reading {source}"))
                .map_err(usage)?
            else {
                if let Some(w) = self.spool.as_mut() {
                    w.flush().context("copying the batch to a temporary file").map_err(usage)?;
                }
                return Ok(None);
            };
            self.line += 1;
            let i = self.line;
            if i <= self.skip_to {
                continue;
            }
            let mut line = line.map_err(|bad| {
                usage(match bad {
                    BadLine::TooLong(len) => anyhow::anyhow!(
                        "{source} line {i}: {len} bytes, above amqp.max_message_bytes ({limit})"
                    ),
                    BadLine::NotUtf8(column) => anyhow::anyhow!(
                        "{source} line {i}: not UTF-8 (the byte at column {column}); JSON is UTF-8: \
                         convert the file first (iconv -f LATIN1 -t UTF-8, say)"
                    ),
                })
            })?;
            if i == 1 {
                strip_bom(&mut line);
            }
            if let Some(w) = self.spool.as_mut() {
                writeln!(w, "{line}").context("copying the batch to a temporary file").map_err(usage)?;
            }
            if line.trim().is_empty() {
                continue;
            }
            self.last_len = line.len();
            let (mut req, shape) = parse_batch_line_shaped(self.args.job(), &line)
                .map_err(|e| usage(anyhow::anyhow!("{source} line {i}: {e}")))?;
            if shape == LineShape::PayloadLikeRequest {
                self.lookalikes.add(i);
            }
            if req.queue.is_none() {
                req.queue = self.args.queue.clone();
            }
            if req.priority.is_none() {
                req.priority = self.args.priority;
            }
            if req.max_attempts.is_none() {
                req.max_attempts = self.args.max_attempts;
            }
            (req.delay, req.at) = self.timing;
            return Ok(Some((i, req)));
        }
    }
}

/// Ctrl-C (or SIGTERM) during a batch: the first sets `signo` (2 or 15): the batch stops
/// validating, or publishes nothing more and waits for the confirms of what it sent, then
/// says how far it got; a second ends the process at once.
struct Interrupt {
    signo: std::sync::Arc<std::sync::atomic::AtomicI32>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Interrupt {
    fn watch() -> Self {
        let signo = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, flag) = (signo.clone(), stop.clone());
        tokio::spawn(async move {
            let Ok(first) = chime_daemon::signals::next_stop_signal().await else { return };
            s.store(first, std::sync::atomic::Ordering::SeqCst);
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
            eprintln!(
                "chime: interrupted: the batch stops once what was sent is confirmed (again to quit at once)"
            );
            if chime_daemon::signals::next_stop_signal().await.is_ok() {
                std::process::exit(128 + first);
            }
        });
        Self { signo, stop }
    }

    fn stopped(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The failure that ends the command (exit status 128 + the signal, as the shell gives).
    fn failure(&self, what: String) -> Failure {
        let signo = self.signo.load(std::sync::atomic::Ordering::SeqCst);
        // Before any signal (none can be known here): SIGINT's 2.
        Failure { code: 128 + if signo > 0 { signo } else { 2 }, error: anyhow::anyhow!(what) }
    }
}

/// The line of `path` holding its `n`th job (non-blank line), counting from 1.
fn line_of_job(path: &std::path::Path, n: usize) -> Option<usize> {
    let reader = std::io::BufReader::new(std::fs::File::open(path).ok()?);
    let mut jobs = 0;
    for (i, line) in reader.lines().enumerate() {
        let line = line.ok()?;
        let line = if i == 0 { line.trim_start_matches('\u{feff}') } else { line.as_str() };
        if !line.trim().is_empty() {
            jobs += 1;
            if jobs == n {
                return Some(i + 1);
            }
        }
    }
    None
}

/// Frees `jobs` on a thread of its own: tens of thousands of prepared jobs take ~10 ms to
/// free, which publishing need not wait for (here, when no thread can be started).
fn free_aside(jobs: Jobs) {
    let _ = std::thread::Builder::new().name("free".into()).spawn(move || drop(jobs));
}

/// What pass 2 of a batch has published so far.
#[derive(Default)]
struct Sent {
    /// Messages to publish (a fanned-out line counts as its members).
    total: usize,
    confirmed: usize,
    spooled: usize,
    /// The failure that stopped it.
    error: Option<EnqueueError>,
}

impl Sent {
    /// Publishes `jobs`, a fanned-out job's a chunk at a time; false when it stopped at a
    /// failure.
    async fn publish_all(
        &mut self,
        client: &EnqueueClient,
        jobs: &Jobs,
        fans_out: bool,
        pack: Option<usize>,
    ) -> Result<bool, Failure> {
        if jobs.is_empty() {
            return Ok(true);
        }
        match jobs {
            Jobs::Encoded(jobs) => {
                let report = client.send_encoded(jobs).await;
                self.confirmed += report.confirmed;
                self.spooled += report.spooled;
                self.error = report.error;
                Ok(self.error.is_none())
            }
            Jobs::Prepared(jobs) => {
                // A fanned-out job's members are made a chunk at a time; other jobs go in one call.
                let step = if fans_out { PUBLISH_CHUNK } else { jobs.len().max(1) };
                for chunk in jobs.chunks(step) {
                    if !self.publish(client, chunk, fans_out, pack).await? {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        }
    }

    /// Publishes `chunk` (its members when the job fans out), packed by `pack`; false when it
    /// stopped at a failure.
    async fn publish(
        &mut self,
        client: &EnqueueClient,
        chunk: &[Prepared],
        fans_out: bool,
        pack: Option<usize>,
    ) -> Result<bool, Failure> {
        // A sharded or broadcast job's line is several messages: counted as such.
        let messages = if fans_out {
            let members = client.fan_out(chunk).await.map_err(from_enqueue)?;
            self.total += members.len() - chunk.len();
            std::borrow::Cow::Owned(members)
        } else {
            std::borrow::Cow::Borrowed(chunk)
        };
        let report = match pack {
            Some(n) => client.send_packed(&messages, n).await,
            None => client.send_batch(&messages).await,
        };
        self.confirmed += report.confirmed;
        self.spooled += report.spooled;
        self.error = report.error;
        Ok(self.error.is_none())
    }
}

async fn enqueue_batch(
    config: ValidConfig,
    args: &EnqueueArgs,
    source: &str,
    delay: Option<std::time::Duration>,
    at: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<(), Failure> {
    let limit = config.amqp.max_message_bytes;
    if let Some(n) = args.pack {
        if !(1..=chime_shared::envelope::pack::MAX_PACK).contains(&n) {
            return Err(usage(anyhow::anyhow!(
                "--pack {n}: a pack holds 1 to {} jobs",
                chime_shared::envelope::pack::MAX_PACK
            )));
        }
        if config.job(args.job()).is_some_and(|j| j.broadcast) {
            return Err(usage(anyhow::anyhow!(
                "--pack: {:?} is a broadcast job (one copy per worker), which cannot be packed",
                args.job()
            )));
        }
    }
    // Only a regular file can be read again; anything else is copied aside as it is read. (A
    // path that cannot be looked at is opened as a file: its error names it.)
    let once = source == "-" || std::fs::metadata(source).is_ok_and(|m| !m.is_file());
    let file = if once {
        let name = format!(
            "chime-batch-{}-{}.jsonl",
            std::process::id(),
            chrono::Utc::now().timestamp_nanos_opt().unwrap_or(0)
        );
        BatchFile { path: std::env::temp_dir().join(name), spooled: true }
    } else {
        BatchFile { path: source.into(), spooled: false }
    };
    // Pass 1: validate every line, ask Redis which given keys already ran to an end, and copy
    // standard input aside to read it again. A large file's second half is validated at the
    // same time on a thread of its own (the broker idles until every line is validated).
    let split = if file.spooled { None } else { split_point(&file.path, limit) };
    let (reader, spool): (Box<dyn BufRead>, _) = if file.spooled {
        let out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&file.path)
            .with_context(|| format!("creating {}", file.path.display()))
            .map_err(usage)?;
        let input: Box<dyn std::io::Read> = if source == "-" {
            Box::new(std::io::stdin())
        } else {
            Box::new(std::fs::File::open(source).with_context(|| format!("opening {source}")).map_err(usage)?)
        };
        (
            Box::new(std::io::BufReader::with_capacity(1 << 16, input)),
            Some(std::io::BufWriter::with_capacity(1 << 16, out)),
        )
    } else {
        (file.reader(split)?, None)
    };
    let timing = (delay, at);
    // One message a job (not packed, not fanned out): the jobs are kept and read encoded.
    let fans_out = config.job(args.job()).is_some_and(|j| j.shards.is_some() || j.broadcast);
    let encoded = !fans_out && args.pack.is_none();
    let interrupt = Interrupt::watch();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let _stop_on_return = StopOnDrop(stop.clone());
    // Set once the first half stops keeping its jobs: the second's would then be read again.
    let first_full = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let second_half = split.map(|from| {
        let (path, owned_args, owned_source, cfg, stop, first_full) = (
            file.path.clone(),
            args.clone(),
            source.to_string(),
            config.clone(),
            stop.clone(),
            first_full.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let source = owned_source.as_str();
            let requests = |r| Requests::new(r, source, limit, &owned_args, timing);
            check_second_half(&path, from, requests, &cfg, &stop, &first_full, encoded)
        })
    });
    let mut requests = Requests { spool, ..Requests::new(reader, source, limit, args, timing) };
    // The broker connection is made while the file is validated (used only if it is valid).
    let connecting = tokio::spawn(EnqueueClient::connect(config.clone()));
    let mut total = 0usize;
    let mut queues: std::collections::BTreeMap<String, usize> = Default::default();
    let mut settled = SettledTally::default();
    let mut repeats = Repeats::default();
    // The jobs of lines 1..=kept_lines, kept for pass 2 while they fit in KEEP_BYTES.
    let (mut kept, mut kept_lines, mut kept_bytes, mut keeping) =
        (Jobs::with_capacity(encoded, 0), 0, 0, true);
    let not_published =
        || interrupt.failure("interrupted while the batch was validated: nothing was published".into());
    while let Some((i, req)) = requests.next()? {
        if interrupt.stopped() {
            return Err(not_published());
        }
        let (p, key) = check_line(&config, source, i, req, &mut queues)?;
        if let Some(key) = key {
            repeats.add(key, i);
            settled.add(&config, key.to_string()).await;
        }
        total += 1;
        kept_bytes += kept_cost(requests.last_len);
        if keeping && kept_bytes > KEEP_BYTES {
            keeping = false;
            first_full.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if keeping {
            kept.push(p);
            kept_lines = i;
        }
    }
    // Every job of a split file's first part kept: pass 2 reads on from the second part.
    let first_part_lines = requests.line;
    let mut lookalikes = std::mem::take(&mut requests.lookalikes);
    drop(requests);
    settled.flush(&config).await;
    // The first half had no bad line: the second's first, if any, is the batch's.
    // The second half's kept jobs follow the first's when the first kept all of its own.
    let (mut second_kept, mut second_kept_lines) = (Jobs::default(), 0);
    if let Some(checking) = second_half {
        let found = checking.await.map_err(|e| runtime(anyhow::anyhow!("validating {source}: {e}")))??;
        if keeping {
            (second_kept, second_kept_lines) = (found.kept, found.kept_lines);
        }
        total += found.jobs;
        for (q, line) in found.queues {
            queues.entry(q).or_insert(line);
        }
        settled.count += found.settled.count;
        settled.first = settled.first.or(found.settled.first);
        repeats.merge(found.repeats);
        lookalikes.merge(found.lookalikes);
    }
    let client = connecting
        .await
        .map_err(|e| runtime(anyhow::anyhow!("connecting to the broker: {e}")))?
        .map_err(from_enqueue)?
        .with_stop(interrupt.stop.clone());
    if interrupt.stopped() {
        return Err(not_published());
    }
    // Queues no config declares must exist on the broker: each checked once, before anything
    // is published.
    for (q, line) in &queues {
        client
            .verify_queue(q)
            .await
            .map_err(|e| usage(anyhow::anyhow!("{source} line {line}: queue: {e}")))?;
    }
    // Pass 2: publish the kept jobs (the first half's, then the second's), then the rest
    // PUBLISH_CHUNK jobs at a time. The rest is read and prepared on a thread of its own while
    // the kept jobs and each chunk are published: a chunk's confirms are all awaited before
    // the next is sent, and the broker would otherwise idle while the next one was parsed. At
    // most two chunks are held at once.
    tracing::debug!(
        total,
        first = kept.len(),
        second = second_kept.len(),
        "batch: jobs kept from validation"
    );
    let started = Instant::now();
    let rest = (kept.len() + second_kept.len() < total).then(|| {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Jobs, Failure>>(1);
        let (path, owned_args, owned_source, cfg) =
            (file.path.clone(), args.clone(), source.to_string(), config.clone());
        // Where the rest starts: the second part of a split file whose first part was kept
        // whole (its lines not read again; the second's kept lines skipped), else the file's
        // start, the kept lines skipped.
        let (from, line, skip_to) = match split {
            Some(at) if keeping => (at, first_part_lines, second_kept_lines),
            _ => (0, 0, kept_lines),
        };
        // Exactly the lines pass 1 validated: lines added to the file since are not read; a
        // file that ends before them changed meanwhile.
        let mut remaining = total - kept.len() - second_kept.len();
        let preparer = tokio::task::spawn_blocking(move || {
            let reader = match open_batch(&path, from..u64::MAX) {
                Ok(r) => r,
                Err(f) => {
                    let _ = tx.blocking_send(Err(f));
                    return;
                }
            };
            let source = owned_source.as_str();
            let mut requests =
                Requests { skip_to, line, ..Requests::new(reader, source, limit, &owned_args, timing) };
            loop {
                let mut chunk = Jobs::with_capacity(encoded, PUBLISH_CHUNK.min(remaining));
                while chunk.len() < PUBLISH_CHUNK && remaining > 0 {
                    // Validated in pass 1: this fails only if the file changed meanwhile.
                    let next = requests.next().and_then(|r| match r {
                        Some((i, req)) => prepare_owned(&cfg, req)
                            .map_err(|e| usage(anyhow::anyhow!("{source} line {i}: {e}"))),
                        None => Err(runtime(anyhow::anyhow!(
                            "{source} changed while it was enqueued: it ends before the {total} jobs \
                             validated ({remaining} not found when it was read again)"
                        ))),
                    });
                    match next {
                        Ok(p) => {
                            chunk.push(p);
                            remaining -= 1;
                        }
                        Err(f) => {
                            let _ = tx.blocking_send(Err(f));
                            return;
                        }
                    }
                }
                // Empty: the end. A send error: the publisher stopped.
                if chunk.is_empty() || tx.blocking_send(Ok(chunk)).is_err() {
                    return;
                }
            }
        });
        (rx, preparer)
    });
    let mut sent = Sent { total, ..Sent::default() };
    let mut going = true;
    for jobs in [kept, second_kept] {
        going = going && sent.publish_all(&client, &jobs, fans_out, args.pack).await?;
        free_aside(jobs);
    }
    // Pass 2 stopped by its own reading (the file changed): reported after what was published.
    let mut unread = None;
    if let Some((mut rx, preparer)) = rest {
        while going && let Some(chunk) = rx.recv().await {
            match chunk {
                Ok(chunk) => going = sent.publish_all(&client, &chunk, fans_out, args.pack).await?,
                Err(f) => {
                    unread = Some(f);
                    break;
                }
            }
        }
        drop(rx);
        let _ = preparer.await;
    }
    let Sent { total, confirmed, spooled, error } = sent;
    warn_settled(settled.first.as_ref(), settled.count);
    repeats.warn(source);
    lookalikes.warn(source);
    let secs = started.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            serde_json::json!({"confirmed": confirmed, "spooled": spooled, "total": total, "seconds": secs,
                "error": error.as_ref().map(|e| e.to_string())})
        );
    } else {
        let rate = if secs > 0.0 { confirmed as f64 / secs } else { 0.0 };
        let and_spooled = if spooled > 0 { format!(", {spooled} spooled") } else { String::new() };
        println!("confirmed {confirmed} of {total} jobs in {secs:.2}s ({rate:.0}/s){and_spooled}");
    }
    if let Some(f) = unread {
        return Err(f);
    }
    if matches!(error, Some(EnqueueError::Interrupted)) {
        // Confirmed in order: the first `confirmed` jobs, through some line of the file (its
        // copy, for standard input, numbered alike). A fanned-out job's members are counted
        // instead of its lines.
        let through = if fans_out || confirmed == 0 { None } else { line_of_job(&file.path, confirmed) };
        let rest = match through {
            Some(line) if file.spooled => {
                format!(" (through line {line}); the rest starts at line {} of the input", line + 1)
            }
            Some(line) => format!(" (through line {line}); the rest: tail -n +{} {source}", line + 1),
            None => String::new(),
        };
        return Err(interrupt.failure(format!(
            "interrupted: {confirmed} of {total} confirmed{rest}; nothing after them was published"
        )));
    }
    match error {
        None => spool_verdict(&config, args.allow_spool, Some(spooled)),
        Some(e) => Err(runtime(anyhow::anyhow!(
            "{} of {total} neither confirmed nor spooled: {e}",
            total - confirmed - spooled
        ))),
    }
}

/// The largest workflow file read.
const WORKFLOW_BYTES: usize = 4 << 20;

/// `chime enqueue --workflow FILE`.
async fn workflow(config: ValidConfig, args: &EnqueueArgs, file: &str) -> Result<(), Failure> {
    let text = read_source(file, WORKFLOW_BYTES, "a workflow file's limit")?;
    // JSON by its name, or by its first character (`{`, which no TOML document starts with):
    // a workflow from a pipe (`--workflow <(…)`, `-`) has no name to tell.
    let json = file.ends_with(".json") || text.trim_start().starts_with('{');
    let parsed = if json {
        chime_producer::WorkflowRequest::from_json(text.as_bytes())
    } else {
        toml::from_str::<chime_producer::WorkflowRequest>(&text)
            .map_err(|e| chime_shared::config::toml_error(&text, &e))
    };
    let wf = parsed.map_err(|e| usage(anyhow::anyhow!("workflow {file}: {e}")))?;
    // Asked before publishing (a worker may settle these very copies a moment later).
    let settled = if wf.key.is_some() {
        let key = wf.workflow_key();
        let keys: Vec<String> =
            wf.steps.iter().map(|s| chime_shared::envelope::step_key(key, &s.name).to_string()).collect();
        settled_keys(&config, &keys).await
    } else {
        Vec::new()
    };
    let client = EnqueueClient::connect(config.clone()).await.map_err(from_enqueue)?;
    let done = client.workflow(&wf).await.map_err(|e| {
        let failed = from_enqueue(e);
        Failure { code: failed.code, error: failed.error.context(format!("workflow {file}")) }
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&done).unwrap_or_default());
    } else {
        let how = if done.spooled > 0 {
            format!("{} confirmed, {} spooled", done.confirmed, done.spooled)
        } else {
            "confirmed".to_string()
        };
        println!("enqueued workflow {} ({} steps, {how})", done.key, done.steps.len());
        let width = done.steps.iter().map(|s| s.step.len()).max().unwrap_or(0);
        for s in &done.steps {
            let when = if s.after.is_empty() {
                "starts now".to_string()
            } else {
                format!("after {}", s.after.join(", "))
            };
            println!("  {:width$}  {}  job {} on {}  {when}", s.step, s.key, s.job, s.queue);
        }
        println!("see it: chime inspect {}", done.key);
    }
    if !settled.is_empty() {
        eprintln!(
            "chime: note: {} of the workflow's {} steps were already settled (done, dead or cancelled) under key {:?}: \
             their copies are absorbed, not run again",
            settled.len(),
            done.steps.len(),
            wf.key.as_deref().unwrap_or_default()
        );
    }
    if done.spooled > 0 && !args.allow_spool {
        return Err(runtime(anyhow::anyhow!(
            "{} of the workflow's steps went to the spool (the broker did not confirm them); a flush publishes them",
            done.spooled
        )));
    }
    Ok(())
}
