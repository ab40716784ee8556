//! The fault-injection suite: scenarios that run real `chime-worker` / `chime tick`
//! processes against private RabbitMQ, Redis and PostgreSQL instances, inject a fault, and
//! check what actually ran against what should have run.
//!
//! What ran is recorded independently of Redis. The `work` job is an `exec` handler that, per
//! execution, inserts its key into two PostgreSQL tables and appends a line to a file ledger:
//! - `effects`, a plain table with **no constraint**: every committed effect is a row, so
//!   duplicate effects can be counted (a table whose key is unique could never show one);
//! - `guarded`, whose primary key is the idempotency key (the "transactional handler" of the
//!   README): an insert it rejects is a duplicate effect that a handler written that way would
//!   have prevented;
//! - the ledger (`O_APPEND`): `done` or `rejected` per completed execution.
//!
//! The checker, after Jepsen's queue checker, computes every column from those records and
//! the DLQ, after waiting (with a deadline, never panicking) for the expected outcome:
//! - lost: keys expected to complete that never did, plus keys expected in the DLQ that are
//!   not there;
//! - duplicate executions: Σ max(0, executions(key) − 1) in the ledger;
//! - duplicate effects: rows of `effects` beyond one per key;
//! - prevented: executions whose `guarded` insert was rejected;
//! - unexpected: executed keys nobody asked for;
//! - DLQ by reason; time to recover (fault → first success after it); backlog done (fault →
//!   the last expected completion).

mod scenarios;
mod windows;

pub use scenarios::*;
pub use windows::*;

use chime_cli::dlq::{DlqClient, Filter};
use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_shared::config::{Config, ValidConfig};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::{Child, PrivateRabbit, PrivateRedis, TestEnv, wait_until};

thread_local! {
    /// `rabbitmq.conf` of the next private broker a `Stack` starts on this thread.
    pub(crate) static BROKER_CONF: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub scenario: &'static str,
    pub injection: &'static str,
    pub expected: usize,
    pub lost: usize,
    pub dup_executions: usize,
    /// The bound the scenario allows for duplicate executions and effects.
    pub dup_bound: usize,
    pub dup_effects: usize,
    pub prevented: usize,
    pub unexpected: usize,
    pub dlq: BTreeMap<String, usize>,
    pub recover: Option<Duration>,
    /// From the fault to the last expected job's completion.
    pub drained: Option<Duration>,
    pub elapsed: Duration,
    /// What else the scenario observed (an error message it expected, a count).
    pub note: String,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.unexpected == 0
            && self.dup_executions <= self.dup_bound
            && self.dup_effects <= self.dup_bound
    }

    pub fn row(&self) -> String {
        let dlq = if self.dlq.is_empty() {
            "-".to_string()
        } else {
            self.dlq.iter().map(|(r, n)| format!("{r}:{n}")).collect::<Vec<_>>().join(" ")
        };
        let secs = |d: Option<Duration>| {
            d.map(|d| format!("{:.1} s", d.as_secs_f64())).unwrap_or_else(|| "-".into())
        };
        format!(
            "| {} | {} | {} | {} | {} / {} (≤ {}) | {} | {} | {} | {} | {} s | {} |",
            self.scenario,
            self.injection,
            self.expected,
            self.lost,
            self.dup_executions,
            self.dup_effects,
            self.dup_bound,
            self.prevented,
            dlq,
            secs(self.recover),
            secs(self.drained),
            self.elapsed.as_secs(),
            match (self.passed(), self.unexpected) {
                (true, _) => "pass".to_string(),
                (false, 0) => "FAIL".to_string(),
                (false, n) => format!("FAIL ({n} unexpected keys ran)"),
            },
        )
    }
}

pub const TABLE_HEAD: &str = "| scenario | injection | jobs | lost | duplicate executions / effects (bound) | prevented by a unique key | DLQ | time to recover* | backlog done** | wall clock | result |\n|---|---|---|---|---|---|---|---|---|---|---|";

/// Executions read from the file ledger.
#[derive(Debug, Default)]
pub struct Ledger {
    /// key → completed executions
    pub runs: HashMap<String, usize>,
    pub rejected: usize,
    /// (time, key) of completed executions
    pub times: Vec<(f64, String)>,
}

/// What a scenario expects, for the checker.
pub struct Check {
    pub scenario: &'static str,
    pub injection: &'static str,
    /// Keys that must complete.
    pub done: HashSet<String>,
    /// Keys that must end in the DLQ.
    pub dead: HashSet<String>,
    /// Keys that may also run (later slots of a schedule that keeps ticking).
    pub valid: HashSet<String>,
    pub dup_bound: usize,
    pub fault_at: Option<f64>,
    pub started: Instant,
    pub note: String,
}

impl Check {
    pub fn new(scenario: &'static str, injection: &'static str, started: Instant) -> Self {
        Self {
            scenario,
            injection,
            done: HashSet::new(),
            dead: HashSet::new(),
            valid: HashSet::new(),
            dup_bound: 0,
            fault_at: None,
            started,
            note: String::new(),
        }
    }
    pub fn done(mut self, keys: HashSet<String>) -> Self {
        self.done = keys;
        self
    }
    pub fn dead(mut self, keys: HashSet<String>) -> Self {
        self.dead = keys;
        self
    }
    pub fn valid(mut self, keys: HashSet<String>) -> Self {
        self.valid = keys;
        self
    }
    pub fn bound(mut self, n: usize) -> Self {
        self.dup_bound = n;
        self
    }
    pub fn fault(mut self, at: f64) -> Self {
        self.fault_at = Some(at);
        self
    }
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = note.into();
        self
    }
}

/// A private stack for one scenario.
pub struct Stack {
    pub env: TestEnv,
    pub redis: PrivateRedis,
    pub rabbit: Option<PrivateRabbit>,
    pub db: String,
    pub ledger: PathBuf,
    pub config_path: PathBuf,
    pub config: ValidConfig,
}

pub(crate) fn psql(db: &str, sql: &str) -> String {
    let out = std::process::Command::new("psql")
        .args(["-qAt", "-h", "127.0.0.1", "-U", "postgres", "-d", db, "-c", sql])
        .output()
        .unwrap_or_else(|e| panic!("psql is needed for the transactional ledger: {e}"));
    assert!(out.status.success(), "psql {sql}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

impl Stack {
    /// `sleep_s`: run time of each job; `extra` is appended right after the `work` job, so
    /// its first lines may add keys to it (`schedule = …`), then sections may follow. In
    /// `extra`, `{EFFECT}` stands for the shell that records one execution (effect rows and
    /// ledger line), so other jobs can record theirs too.
    pub async fn start(name: &str, private_broker: bool, worker: &str, sleep_s: f32, extra: &str) -> Self {
        Self::start_gated(name, private_broker, worker, sleep_s, extra, None).await
    }

    /// Like `start`; with `gate`, the job fails permanently (exit 100) while the file is absent.
    pub async fn start_gated(
        name: &str,
        private_broker: bool,
        worker: &str,
        sleep_s: f32,
        extra: &str,
        gate: Option<&str>,
    ) -> Self {
        let redis = PrivateRedis::start().await;
        let rabbit = if private_broker {
            Some(PrivateRabbit::start_with(BROKER_CONF.with(|c| c.borrow().clone()).as_str()).await)
        } else {
            None
        };
        let mut env = TestEnv::new(name);
        env.redis_url = redis.url();
        if let Some(r) = &rabbit {
            env.amqp_url = r.url();
        }
        let db = format!("chime_{}", env.prefix.replace(['-', '.'], "_")).to_lowercase();
        let ledger = env.dir.join("ledger");
        let l = ledger.display();
        // Per completed execution: a row in `effects` (no constraint) and one in `guarded`
        // (unique key), each committed on its own, then one ledger line: `rejected` when the
        // unique key refused the row (a duplicate a transactional handler prevents), else
        // `done`. Any other database error is transient (exit 75, retried).
        let effect = format!(
            "out=$(psql -qAt -h 127.0.0.1 -U postgres -d {db} -c \"INSERT INTO effects(key) VALUES ('$CHIME_KEY')\" \
             -c \"INSERT INTO guarded(key) VALUES ('$CHIME_KEY')\" 2>&1); \
             case \"$out\" in *duplicate*) echo \"$(date +%s.%N) $CHIME_KEY rejected\" >> {l};; \
             *ERROR*|*rror*) exit 75;; *) echo \"$(date +%s.%N) $CHIME_KEY done\" >> {l};; esac"
        );
        let gate =
            gate.map(|g| format!("[ -f {} ] || exit 100; ", env.dir.join(g).display())).unwrap_or_default();
        let script = format!("{gate}sleep {sleep_s}; {effect}");
        let extra = extra.replace("{EFFECT}", &effect).replace("{DIR}", &env.dir.display().to_string());
        let jobs = format!(
            "[[jobs]]\nname = \"work\"\nhandler = \"exec\"\ntimeout = \"60s\"\nmax_attempts = 20\n\
             backoff = {{ initial = \"1s\", factor = 1.0, max = \"1s\" }}\ncommand = ['sh', '-c', '''{script}''']\n{extra}"
        );
        let text = env.config_text("quorum", "lease = \"5s\"\ntimeout = \"1s\"", worker, &jobs);
        let config_path = env.write_config(&text);
        let config = Config::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        // Created last, once nothing can fail before `Stack` (whose Drop removes it) exists.
        psql("postgres", &format!("CREATE DATABASE {db}"));
        psql(&db, "CREATE TABLE effects (key text, at timestamptz DEFAULT now())");
        psql(&db, "CREATE TABLE guarded (key text PRIMARY KEY, at timestamptz DEFAULT now())");
        Self { env, redis, rabbit, db, ledger, config_path, config }
    }

    /// Rewrites the config file (before spawning processes that read it).
    pub fn edit_config(&mut self, f: impl Fn(&str) -> String) {
        let text = f(&std::fs::read_to_string(&self.config_path).unwrap());
        self.config = Config::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        std::fs::write(&self.config_path, text).unwrap();
    }

    pub fn worker(&self, tag: &str) -> Child {
        Child::worker(&self.env.dir, &self.config_path, &[], tag)
    }

    pub fn ticker(&self, tag: &str) -> Child {
        Child::ticker(&self.env.dir, &self.config_path, &[], tag)
    }

    pub async fn client(&self) -> EnqueueClient {
        EnqueueClient::connect(self.config.clone()).await.unwrap()
    }

    /// Enqueues `n` jobs of `job` with keys `{prefix}{i}`; returns their idempotency keys.
    pub async fn enqueue_as(&self, job: &str, prefix: &str, n: usize) -> HashSet<String> {
        let client = self.client().await;
        let reqs: Vec<_> = (0..n).map(|i| EnqueueRequest::new(job).key(format!("{prefix}{i}"))).collect();
        assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, n);
        (0..n).map(|i| chime_shared::envelope::adhoc_key(job, &format!("{prefix}{i}")).to_string()).collect()
    }

    /// Enqueues `n` `work` jobs with keys `k0…`; returns their idempotency keys.
    pub async fn enqueue(&self, n: usize) -> HashSet<String> {
        self.enqueue_as("work", "k", n).await
    }

    pub fn read_ledger(&self) -> Ledger {
        let mut l = Ledger::default();
        for line in std::fs::read_to_string(&self.ledger).unwrap_or_default().lines() {
            let f: Vec<&str> = line.split(' ').collect();
            if f.len() < 3 {
                continue;
            }
            *l.runs.entry(f[1].to_string()).or_default() += 1;
            if f[2] == "rejected" {
                l.rejected += 1;
            }
            l.times.push((f[0].parse().unwrap_or(0.0), f[1].to_string()));
        }
        l
    }

    /// Rows of `effects` beyond one per key.
    pub fn dup_effects(&self) -> usize {
        let v = psql(&self.db, "SELECT count(*) - count(DISTINCT key) FROM effects");
        v.parse().unwrap_or(usize::MAX)
    }

    /// Dead letters: reason → count, and the keys they carry.
    pub async fn dlq_contents(&self) -> (BTreeMap<String, usize>, HashSet<String>) {
        let client = DlqClient::connect(self.config.clone()).await.unwrap();
        let (mut reasons, mut keys) = (BTreeMap::new(), HashSet::new());
        for q in self.config.all_queues() {
            for d in client.list(&q, &Filter::default()).await.unwrap() {
                *reasons.entry(d.reason).or_default() += 1;
                if let Some(k) = d.key {
                    keys.insert(k.to_string());
                }
            }
        }
        client.close().await;
        (reasons, keys)
    }

    pub async fn dlq(&self) -> BTreeMap<String, usize> {
        self.dlq_contents().await.0
    }

    /// Waits up to `cap` for the expected outcome, then checks everything (never panics on a
    /// missing job: it is counted as lost).
    pub async fn check(&self, c: Check, cap: Duration) -> Outcome {
        let deadline = Instant::now() + cap;
        loop {
            let l = self.read_ledger();
            let all_done = c.done.iter().all(|k| l.runs.contains_key(k));
            let all_dead = c.dead.is_empty() || {
                let (_, keys) = self.dlq_contents().await;
                c.dead.iter().all(|k| keys.contains(k))
            };
            if (all_done && all_dead) || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let l = self.read_ledger();
        let (dlq, dead_keys) = self.dlq_contents().await;
        let lost = c.done.iter().filter(|k| !l.runs.contains_key(*k)).count()
            + c.dead.iter().filter(|k| !dead_keys.contains(*k)).count();
        let dup_executions = l.runs.values().map(|n| n.saturating_sub(1)).sum();
        let unexpected = l.runs.keys().filter(|k| !c.done.contains(*k) && !c.valid.contains(*k)).count();
        let recover = c.fault_at.and_then(|t| {
            l.times
                .iter()
                .map(|(at, _)| *at)
                .filter(|at| *at > t)
                .reduce(f64::min)
                .map(|first| Duration::from_secs_f64(first - t))
        });
        let drained = c.fault_at.and_then(|t| {
            let last = l
                .times
                .iter()
                .filter(|(_, k)| c.done.contains(k))
                .map(|(at, _)| *at)
                .fold(f64::MIN, f64::max);
            (last > t).then(|| Duration::from_secs_f64(last - t))
        });
        Outcome {
            scenario: c.scenario,
            injection: c.injection,
            expected: c.done.len() + c.dead.len(),
            drained,
            lost,
            dup_executions,
            dup_bound: c.dup_bound,
            dup_effects: self.dup_effects(),
            prevented: l.rejected,
            unexpected,
            dlq,
            recover,
            elapsed: c.started.elapsed(),
            note: c.note,
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = std::process::Command::new("psql")
            .args(["-qAt", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-c"])
            .arg(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.db))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

pub fn now_f64() -> f64 {
    chrono::Utc::now().timestamp_micros() as f64 / 1e6
}

/// Waits until at least `n` executions completed.
pub async fn wait_runs(stack: &Stack, n: usize, cap: Duration) {
    wait_until("executions under way", cap, || async { stack.read_ledger().times.len() >= n }).await;
}

/// Waits until `secs` seconds after `from` (a time condition, not a sleep for correctness).
pub async fn wait_secs(from: f64, secs: f64) {
    wait_until(
        "time to pass",
        Duration::from_secs_f64(secs + 30.0),
        || async move { now_f64() > from + secs },
    )
    .await;
}

/// Every scenario, in order (the `chime-reliability` binary runs them all).
pub async fn all() -> Vec<Outcome> {
    let mut out = Vec::new();
    macro_rules! run {
        ($f:expr, $name:expr) => {{
            eprintln!("running: {}", $name);
            out.push($f.await);
        }};
    }
    run!(worker_sigkill(), "worker SIGKILL");
    run!(worker_sigterm(), "worker SIGTERM");
    run!(leader_sigkill(), "leader SIGKILL");
    run!(all_tickers_down(), "all tickers down");
    run!(broker_restart(), "broker restart");
    run!(broker_frozen(), "broker frozen");
    run!(redis_restarted_empty(), "Redis restarted empty");
    run!(redis_frozen(), "Redis frozen");
    run!(poison_and_timeouts(), "poison and timeouts");
    run!(duplicate_publishes(), "duplicate publishes");
    run!(dlq_replay(), "DLQ replay");
    run!(handler_panic(), "handler panic");
    run!(cluster_leader_killed(), "cluster leader killed");
    run!(long_jobs_redis_restarted_empty(), "long jobs, Redis restarted empty");
    run!(redis_failover_to_lagging_replica(), "Redis failover to a lagging replica");
    run!(sentinel_failover_drain(), "Redis Sentinel failover during a drain");
    run!(sentinel_master_killed(), "Redis Sentinel master killed");
    run!(sentinel_failover_ticker(), "Redis Sentinel failover under the ticker");
    run!(redis_cluster_master_killed(), "Redis Cluster master killed");
    run!(connection_closed_while_failing(), "connection closed during retries and dead letters");
    run!(dead_exchange_missing(), "dead exchange missing");
    run!(memory_alarm(), "broker memory alarm");
    run!(ticker_clock_skew(), "ticker clock skew");
    run!(rolling_deploy(), "rolling deploy");
    run!(sigkill_loop(), "SIGKILL loop");
    if std::env::var_os("CHIME_QUICK").is_none() {
        run!(consumer_timeout(), "late ack past consumer_timeout");
    }
    out
}
