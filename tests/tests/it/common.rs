//! In-process workers and a counting ledger for the tests.

use chime_shared::config::ValidConfig;
use chime_shared::health::Health;
use chime_worker::{JobContext, JobError, Registry, Stats, Worker, WorkerError, raw_handler_fn};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use chime_tests::*;

/// (job, slot, shard) of every run of a scheduled job.
pub type SlotRuns = Arc<Mutex<Vec<(String, chrono::DateTime<chrono::Utc>, Option<u32>)>>>;

/// Handlers for `names` that record each run's job, slot and shard.
pub fn slot_recording(runs: &SlotRuns, names: &[&str]) -> Registry {
    let mut r = Registry::new();
    for name in names {
        let runs = runs.clone();
        r.register(
            *name,
            raw_handler_fn(move |ctx: JobContext, _| {
                let runs = runs.clone();
                async move {
                    runs.lock().unwrap().push((
                        ctx.job().to_string(),
                        ctx.slot().unwrap(),
                        ctx.shard().map(|s| s.0),
                    ));
                    Ok::<_, JobError>(())
                }
            }),
        );
    }
    r
}

/// The slots `job` ran, in order.
pub fn slots_of(runs: &SlotRuns, job: &str) -> Vec<chrono::DateTime<chrono::Utc>> {
    let mut s: Vec<_> = runs.lock().unwrap().iter().filter(|r| r.0 == job).map(|r| r.1).collect();
    s.sort();
    s
}

/// The repository's root (the workspace), for tests that read its files.
pub fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(|p| p.to_path_buf()).unwrap_or_default()
}

/// Executions per payload `n`.
#[derive(Clone, Default)]
pub struct Ledger(pub Arc<Mutex<HashMap<u64, u32>>>);

impl Ledger {
    pub fn record(&self, n: u64) {
        *self.0.lock().unwrap().entry(n).or_default() += 1;
    }
    pub fn distinct(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    pub fn total(&self) -> u64 {
        self.0.lock().unwrap().values().map(|v| u64::from(*v)).sum()
    }
    pub fn get(&self, n: u64) -> u32 {
        self.0.lock().unwrap().get(&n).copied().unwrap_or(0)
    }
    pub fn duplicates(&self) -> u64 {
        self.0.lock().unwrap().values().map(|v| u64::from(v.saturating_sub(1))).sum()
    }
}

/// A registry with handler `count` recording `payload.n`, sleeping `payload.sleep_ms`.
pub fn counting_registry(ledger: &Ledger) -> Registry {
    let l = ledger.clone();
    let mut r = Registry::new();
    r.register(
        "count",
        raw_handler_fn(move |_ctx: JobContext, p: serde_json::Value| {
            let l = l.clone();
            async move {
                if let Some(ms) = p.get("sleep_ms").and_then(|v| v.as_u64()) {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                l.record(p.get("n").and_then(|v| v.as_u64()).unwrap_or(u64::MAX));
                Ok::<_, JobError>(())
            }
        }),
    );
    r
}

/// `[[jobs]]` entry for the counting handler.
pub const COUNT_JOB: &str = "[[jobs]]\nname = \"count\"\nhandler = \"count\"\n";

pub struct Running {
    pub token: CancellationToken,
    /// The worker's task (taken by `stop`).
    handle: Option<JoinHandle<Result<(), WorkerError>>>,
    pub stats: Arc<Stats>,
    pub health: Health,
}

impl Drop for Running {
    /// A worker dropped without `stop` (at a test's end, or as a failed test unwinds) is
    /// stopped at once: its test's `TestEnv`, declared before it and so dropped after it,
    /// then deletes the topology, which a worker still running could declare again.
    fn drop(&mut self) {
        self.token.cancel();
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}

impl Running {
    pub async fn start(config: ValidConfig, registry: Registry, concurrency: usize) -> Self {
        if std::env::var_os("RUST_LOG").is_some() {
            chime_daemon::telemetry::init_tracing();
        }
        let health = Health::default();
        let worker = Worker::builder(config)
            .registry(registry)
            .concurrency(concurrency)
            .health(health.clone())
            .build()
            .expect("worker builds");
        let stats = worker.stats();
        let token = CancellationToken::new();
        let handle = tokio::spawn(worker.run(token.clone()));
        let h = health.clone();
        wait_until("worker consuming", Duration::from_secs(20), || {
            let h = h.clone();
            async move { h.get("consuming") }
        })
        .await;
        Self { token, handle: Some(handle), stats, health }
    }

    pub async fn stop(mut self) {
        self.token.cancel();
        let handle = self.handle.take().expect("stopped once");
        let r = tokio::time::timeout(Duration::from_secs(60), handle).await;
        r.expect("worker stops within 60s").expect("worker task").expect("worker run ok");
    }

    pub fn succeeded(&self) -> u64 {
        Stats::get(&self.stats.succeeded)
    }
    pub fn duplicates(&self) -> u64 {
        Stats::get(&self.stats.duplicates)
    }
    pub fn dead_lettered(&self) -> u64 {
        Stats::get(&self.stats.dead_lettered)
    }
}

/// Ready messages in `queue` (passive declare).
pub async fn depth(queue: &str) -> u32 {
    let conn = connect_amqp().await;
    let d = chime_shared::topology::depth(&conn, queue).await.map(|(m, _)| m).unwrap_or(u32::MAX);
    let _ = conn.close(200, "".into()).await;
    d
}

/// Waits until `queue` holds exactly `n` ready messages.
pub async fn wait_depth(queue: &str, n: u32, within: Duration) {
    let q = queue.to_string();
    wait_until(&format!("{n} messages in {queue}"), within, || {
        let q = q.clone();
        async move { depth(&q).await == n }
    })
    .await;
}

/// The envelopes of the `n` messages in `queue`, in queue order, taken off it (an automatic-ack
/// consumer); fails when fewer arrive within `within`, or one is not an envelope.
pub async fn take_envelopes(
    queue: &str,
    n: usize,
    within: Duration,
) -> Vec<chime_shared::envelope::Envelope> {
    use futures_util::StreamExt as _;
    let conn = connect_amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(1000, Default::default()).await.unwrap();
    let opts = lapin::options::BasicConsumeOptions { no_ack: true, ..Default::default() };
    let mut consumer = ch.basic_consume(queue.into(), "take".into(), opts, Default::default()).await.unwrap();
    let deadline = tokio::time::Instant::now() + within;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let d = tokio::time::timeout_at(deadline, consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{} of {n} messages from {queue} within {within:?}", out.len()))
            .expect("the consumer ended")
            .unwrap();
        out.push(chime_shared::envelope::Envelope::decode(&d.data).unwrap());
    }
    let _ = conn.close(200, "".into()).await;
    out
}

/// State (`run`, `done`, `dead`, `free`) of an idempotency key in Redis.
pub async fn idem_state(env: &TestEnv, key: &str) -> Option<String> {
    let mut r = connect_redis(&env.redis_url).await;
    redis::cmd("HGET").arg(env.names().idem_key(key)).arg("s").query_async(&mut r).await.unwrap()
}

/// Runs `chime --config CONFIG args…` to completion, feeding `stdin` (closed when `None`);
/// returns (exit code, stdout, stderr).
pub fn chime(config: &std::path::Path, args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    chime_env(config, args, stdin, &[])
}

/// [`chime`] with more environment variables.
pub fn chime_env(
    config: &std::path::Path,
    args: &[&str],
    stdin: Option<&str>,
    envs: &[(&str, &std::ffi::OsStr)],
) -> (i32, String, String) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(bin("chime"))
        .envs(envs.iter().copied())
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(s) = stdin {
        // A command may stop reading early (it rejected the input): not an error here.
        let _ = child.stdin.take().unwrap().write_all(s.as_bytes());
    } else {
        drop(child.stdin.take());
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The number of entries of the `default` queue's history stream, and its runs, oldest first.
pub async fn history_runs(env: &TestEnv) -> (usize, Vec<chime_shared::history::RunEvent>) {
    let mut r = connect_redis(&env.redis_url).await;
    let entries: Vec<(String, std::collections::HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(env.names().history("default"))
        .arg("-")
        .arg("+")
        .query_async(&mut r)
        .await
        .unwrap();
    let runs =
        entries.iter().flat_map(|(id, f)| chime_shared::history::decode_entry("default", id, f)).collect();
    (entries.len(), runs)
}
