//! The fault-injection suite: scenarios that run real `chime-worker` / `chime tick`
//! processes against private RabbitMQ, Redis and PostgreSQL instances, inject a fault, and
//! check what actually ran against what should have run.
//!
//! The ledger does not depend on Redis: the job is an `exec` handler that appends one line per
//! execution to a file (`O_APPEND`) and inserts its key into a PostgreSQL table with a
//! primary key ("transactional handler" mode). An execution whose insert the index rejects
//! is a duplicate execution whose effect was prevented.
//!
//! Checker, per scenario (after the Jepsen queue checker):
//! - lost: expected keys that neither succeeded nor reached the DLQ when expected there;
//! - duplicate executions: Σ max(0, executions(key) − 1) over completed executions;
//! - duplicate effects: rows beyond one per key in the effect table (0 by construction when
//!   the handler writes its key transactionally; reported to prove it);
//! - prevented: executions the unique index rejected;
//! - unexpected: executed keys nobody asked for;
//! - DLQ by reason; time to recover (fault → first success after it).

use chime_producer::dlq::{DlqClient, Filter};
use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_shared::config::Config;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{Child, PrivateRabbit, PrivateRedis, TestEnv, wait_until};

thread_local! {
    /// `rabbitmq.conf` of the next private broker a `Stack` starts on this thread.
    static BROKER_CONF: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub scenario: &'static str,
    pub injection: &'static str,
    pub expected: usize,
    pub lost: usize,
    pub dup_executions: usize,
    /// The bound the scenario allows for duplicate executions.
    pub dup_bound: usize,
    pub dup_effects: usize,
    pub prevented: usize,
    pub unexpected: usize,
    pub dlq: BTreeMap<String, usize>,
    pub recover: Option<Duration>,
    /// From the fault to the last expected job's completion.
    pub drained: Option<Duration>,
    pub elapsed: Duration,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.dup_effects == 0
            && self.unexpected == 0
            && self.dup_executions <= self.dup_bound
    }

    pub fn row(&self) -> String {
        let dlq = if self.dlq.is_empty() {
            "-".to_string()
        } else {
            self.dlq.iter().map(|(r, n)| format!("{r}:{n}")).collect::<Vec<_>>().join(" ")
        };
        format!(
            "| {} | {} | {} | {} | {} (≤ {}) | {} | {} | {} | {} | {} | {} s | {} |",
            self.scenario,
            self.injection,
            self.expected,
            self.lost,
            self.dup_executions,
            self.dup_bound,
            self.dup_effects,
            self.prevented,
            dlq,
            self.recover.map(|d| format!("{:.1} s", d.as_secs_f64())).unwrap_or_else(|| "-".into()),
            self.drained.map(|d| format!("{:.1} s", d.as_secs_f64())).unwrap_or_else(|| "-".into()),
            self.elapsed.as_secs(),
            if self.passed() { "pass" } else { "FAIL" },
        )
    }
}

pub const TABLE_HEAD: &str = "| scenario | injection | jobs | lost | duplicate executions (bound) | duplicate effects | prevented by the unique index | DLQ | time to recover* | backlog done** | wall clock | result |\n|---|---|---|---|---|---|---|---|---|---|---|---|";

/// Executions read from the file ledger.
#[derive(Debug, Default)]
pub struct Ledger {
    /// key → completed executions (insert succeeded or was rejected as a duplicate)
    pub runs: HashMap<String, usize>,
    pub rejected: usize,
    /// (time, key) of completed executions
    pub times: Vec<(f64, String)>,
}

/// A private stack for one scenario.
pub struct Stack {
    pub env: TestEnv,
    pub redis: PrivateRedis,
    pub rabbit: Option<PrivateRabbit>,
    pub db: String,
    pub ledger: PathBuf,
    pub config_path: PathBuf,
    pub config: Config,
}

fn psql(db: &str, sql: &str) -> String {
    let out = std::process::Command::new("psql")
        .args(["-qAt", "-h", "127.0.0.1", "-U", "postgres", "-d", db, "-c", sql])
        .output()
        .unwrap_or_else(|e| panic!("psql is needed for the transactional ledger: {e}"));
    assert!(out.status.success(), "psql {sql}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

impl Stack {
    /// `sleep_s`: run time of each job; `extra` is appended right after the `work` job, so
    /// its first lines may add keys to it (`schedule = …`), then sections may follow.
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
        // One line per completed execution: the effect row is written in the same step; a
        // rejected insert (duplicate key) is the index preventing a duplicate effect; any
        // other database error is transient (exit 75, retried).
        let gate =
            gate.map(|g| format!("[ -f {} ] || exit 100; ", env.dir.join(g).display())).unwrap_or_default();
        let script = format!(
            "{gate}sleep {sleep_s}; out=$(psql -qAt -h 127.0.0.1 -U postgres -d {db} -c \"INSERT INTO effects(key) VALUES ('$CHIME_KEY')\" 2>&1) \
             && echo \"$(date +%s.%N) $CHIME_KEY done\" >> {l} \
             || case \"$out\" in *duplicate*) echo \"$(date +%s.%N) $CHIME_KEY rejected\" >> {l};; *) exit 75;; esac"
        );
        let jobs = format!(
            "[[jobs]]\nname = \"work\"\nhandler = \"exec\"\ntimeout = \"60s\"\nmax_attempts = 20\n\
             backoff = {{ initial = \"1s\", factor = 1.0, max = \"1s\" }}\ncommand = ['sh', '-c', '''{script}''']\n{extra}"
        );
        let text = env.config_text("quorum", "lease = \"5s\"\ntimeout = \"1s\"", worker, &jobs);
        let config_path = env.write_config(&text);
        let config = Config::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        // Created last, once nothing can fail before `Stack` (whose Drop removes it) exists.
        psql("postgres", &format!("CREATE DATABASE {db}"));
        psql(&db, "CREATE TABLE effects (key text PRIMARY KEY, at timestamptz DEFAULT now())");
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

    /// Enqueues `n` jobs with keys `k0…`; returns their idempotency keys.
    pub async fn enqueue(&self, n: usize) -> HashSet<String> {
        let client = EnqueueClient::connect(Arc::new(self.config.clone())).await.unwrap();
        let reqs: Vec<_> = (0..n).map(|i| EnqueueRequest::new("work").key(format!("k{i}"))).collect();
        assert_eq!(client.enqueue_batch(&reqs).await.unwrap().confirmed, n);
        (0..n).map(|i| chime_shared::envelope::adhoc_key("work", &format!("k{i}")).to_string()).collect()
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

    /// Rows beyond one per key in the effect table.
    pub fn dup_effects(&self) -> usize {
        let v = psql(&self.db, "SELECT count(*) - count(DISTINCT key) FROM effects");
        v.parse().unwrap_or(usize::MAX)
    }

    pub async fn dlq(&self) -> BTreeMap<String, usize> {
        let client = DlqClient::connect(Arc::new(self.config.clone())).await.unwrap();
        let mut out = BTreeMap::new();
        for q in self.config.all_queues() {
            for d in client.list(&q, &Filter::default()).await.unwrap() {
                *out.entry(d.reason).or_default() += 1;
            }
        }
        client.close().await;
        out
    }

    /// Waits until every expected key completed at least once.
    pub async fn wait_all(&self, expected: &HashSet<String>, cap: Duration) {
        let all = wait_until("every expected job executed", cap + Duration::from_secs(5), || async {
            let l = self.read_ledger();
            expected.iter().all(|k| l.runs.contains_key(k))
        });
        if tokio::time::timeout(cap, all).await.is_err() {
            let l = self.read_ledger();
            let missing: Vec<&String> = expected.iter().filter(|k| !l.runs.contains_key(*k)).collect();
            panic!(
                "timed out after {cap:?}: {} of {} expected jobs never executed (e.g. {:?}); ledger has {} keys",
                missing.len(),
                expected.len(),
                missing.iter().take(3).collect::<Vec<_>>(),
                l.runs.len()
            );
        }
    }

    /// Checks the ledger against `expected`.
    pub async fn outcome(
        &self,
        scenario: &'static str,
        injection: &'static str,
        expected: &HashSet<String>,
        dup_bound: usize,
        fault_at: Option<f64>,
        started: Instant,
    ) -> Outcome {
        self.outcome_valid(scenario, injection, expected, expected, dup_bound, fault_at, started).await
    }

    /// Like `outcome`, with `valid` the keys that may run beyond `expected` (later slots of a
    /// schedule that keeps ticking while the checker reads).
    #[allow(clippy::too_many_arguments)]
    pub async fn outcome_valid(
        &self,
        scenario: &'static str,
        injection: &'static str,
        expected: &HashSet<String>,
        valid: &HashSet<String>,
        dup_bound: usize,
        fault_at: Option<f64>,
        started: Instant,
    ) -> Outcome {
        let l = self.read_ledger();
        let dlq = self.dlq().await;
        let lost = expected.iter().filter(|k| !l.runs.contains_key(*k)).count();
        let dup_executions = l.runs.values().map(|n| n.saturating_sub(1)).sum();
        let unexpected = l.runs.keys().filter(|k| !expected.contains(*k) && !valid.contains(*k)).count();
        let recover = fault_at.and_then(|t| {
            l.times
                .iter()
                .map(|(at, _)| *at)
                .filter(|at| *at > t)
                .fold(None, |m: Option<f64>, at| Some(m.map_or(at, |m| m.min(at))))
                .map(|first| Duration::from_secs_f64(first - t))
        });
        let drained = fault_at.and_then(|t| {
            let last = l
                .times
                .iter()
                .filter(|(_, k)| expected.contains(k))
                .map(|(at, _)| *at)
                .fold(f64::MIN, f64::max);
            (last > t).then(|| Duration::from_secs_f64(last - t))
        });
        Outcome {
            scenario,
            injection,
            expected: expected.len(),
            drained,
            lost,
            dup_executions,
            dup_bound,
            dup_effects: self.dup_effects(),
            prevented: l.rejected,
            unexpected,
            dlq,
            recover,
            elapsed: started.elapsed(),
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

// ---------------------------------------------------------------- scenarios

/// 3 workers, 150 jobs of 0.3 s; one worker SIGKILLed mid-job.
pub async fn worker_sigkill() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start("rel-wkill", false, "concurrency = 4", 0.3, "").await;
    let ws: Vec<Child> = (0..3).map(|i| s.worker(&i.to_string())).collect();
    let expected = s.enqueue(150).await;
    wait_runs(&s, 20, Duration::from_secs(60)).await;
    ws[0].signal(9);
    let fault = now_f64();
    s.wait_all(&expected, Duration::from_secs(120)).await;
    // Its running jobs were killed with it (process groups), so none finished twice; the
    // bound is what it had in flight.
    s.outcome("SIGKILL a worker mid-job", "kill -9 one of 3 workers", &expected, 4, Some(fault), t0).await
}

/// 1 worker, 40 jobs of 0.5 s; SIGTERM, then a second worker finishes the rest.
pub async fn worker_sigterm() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start("rel-wterm", false, "concurrency = 4\nshutdown_timeout = \"30s\"", 0.5, "").await;
    let mut w = s.worker("a");
    let expected = s.enqueue(40).await;
    wait_runs(&s, 5, Duration::from_secs(60)).await;
    w.signal(15);
    let fault = now_f64();
    let code = tokio::time::timeout(Duration::from_secs(60), w.child.wait()).await.unwrap().unwrap().code();
    assert_eq!(code, Some(0), "graceful exit");
    let _b = s.worker("b");
    s.wait_all(&expected, Duration::from_secs(120)).await;
    s.outcome(
        "SIGTERM drain",
        "SIGTERM the only worker; exit 0; a new one resumes",
        &expected,
        0,
        Some(fault),
        t0,
    )
    .await
}

/// Every-second schedule, 2 tickers, the leader SIGKILLed; expected = every slot in the run.
pub async fn leader_sigkill() -> Outcome {
    let t0 = Instant::now();
    let extra = "schedule = \"* * * * * *\"\n[ticker]\nlease = \"2s\"\n";
    let s = Stack::start("rel-lkill", false, "concurrency = 8", 0.0, extra).await;
    let _w = s.worker("w");
    let a = s.ticker("a");
    let b = s.ticker("b");
    wait_runs(&s, 3, Duration::from_secs(30)).await;
    let store = chime_producer::lease::TickerStore::connect(&s.config.redis, &s.config.prefix).unwrap();
    let leader = store.leader().await.unwrap().unwrap().id;
    let pid: i32 = leader.split(':').nth(1).unwrap().parse().unwrap();
    let victim = if pid == a.pid() { &a } else { &b };
    victim.signal(9);
    let fault = now_f64();
    let until = fault + 6.0;
    wait_until("slots after the failover", Duration::from_secs(30), || async { now_f64() > until + 1.0 })
        .await;
    let expected = slot_keys(&s, until);
    s.wait_all(&expected, Duration::from_secs(30)).await;
    s.outcome_valid(
        "SIGKILL the leader ticker",
        "kill -9 the leader of 2 tickers",
        &expected,
        &valid_slot_keys(),
        0,
        Some(fault),
        t0,
    )
    .await
}

/// Keys of every slot of the `work` schedule within a day of now (what may legitimately run).
fn valid_slot_keys() -> HashSet<String> {
    let now = chrono::Utc::now();
    let sched = chime_shared::schedule::Schedule::parse("* * * * * *", None).unwrap();
    sched
        .slots_between(now - chrono::Duration::minutes(10), now + chrono::Duration::minutes(10), 100_000)
        .into_iter()
        .map(|t| chime_shared::envelope::scheduled_key("work", t).to_string())
        .collect()
}

/// Keys of every slot of the `work` schedule from its first executed slot to `until`.
fn slot_keys(s: &Stack, until: f64) -> HashSet<String> {
    let l = s.read_ledger();
    let first = l.times.iter().map(|(t, _)| *t).fold(f64::MAX, f64::min);
    let from = chrono::DateTime::from_timestamp(first.floor() as i64 - 2, 0).unwrap();
    let to = chrono::DateTime::from_timestamp(until as i64, 0).unwrap();
    let sched = chime_shared::schedule::Schedule::parse("* * * * * *", None).unwrap();
    // Only slots from the first one that ran (the ticker starts at "now").
    let all: Vec<_> = sched.slots_between(from, to, 100_000);
    let keys: Vec<String> =
        all.iter().map(|t| chime_shared::envelope::scheduled_key("work", *t).to_string()).collect();
    let start = keys.iter().position(|k| l.runs.contains_key(k)).unwrap_or(0);
    keys[start..].iter().cloned().collect()
}

/// One ticker killed, every slot missed while none ran is caught up (`catch_up = "all"`).
pub async fn all_tickers_down() -> Outcome {
    let t0 = Instant::now();
    let extra = "schedule = \"* * * * * *\"\ncatch_up = \"all\"\n[ticker]\nlease = \"1s\"\n";
    let s = Stack::start("rel-tdown", false, "concurrency = 8", 0.0, extra).await;
    let _w = s.worker("w");
    let a = s.ticker("a");
    wait_runs(&s, 3, Duration::from_secs(30)).await;
    a.signal(9);
    let fault = now_f64();
    wait_until("no ticker for 5 s", Duration::from_secs(30), || async { now_f64() > fault + 5.0 }).await;
    let _b = s.ticker("b");
    let until = now_f64() + 3.0;
    wait_until("slots after the restart", Duration::from_secs(30), || async { now_f64() > until + 1.0 })
        .await;
    let expected = slot_keys(&s, until);
    s.wait_all(&expected, Duration::from_secs(30)).await;
    s.outcome_valid(
        "all tickers down, then back",
        "kill -9 the only ticker, 5 s, restart (catch_up all)",
        &expected,
        &valid_slot_keys(),
        0,
        Some(fault),
        t0,
    )
    .await
}

/// Broker `stop_app` for 3 s under load, then `start_app`.
pub async fn broker_restart() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start("rel-brestart", true, "concurrency = 4", 0.05, "").await;
    let _w1 = s.worker("1");
    let _w2 = s.worker("2");
    let expected = s.enqueue(200).await;
    wait_runs(&s, 30, Duration::from_secs(60)).await;
    let rabbit = s.rabbit.as_ref().unwrap();
    rabbit.ctl(&["stop_app"]);
    let stopped = now_f64();
    wait_until("3 s of broker outage", Duration::from_secs(30), || async { now_f64() > stopped + 3.0 }).await;
    rabbit.ctl(&["start_app"]);
    let fault = now_f64(); // recovery is measured from the end of the fault
    s.wait_all(&expected, Duration::from_secs(120)).await;
    // Deliveries unacked at the stop come back; those already run are absorbed by Redis.
    s.outcome(
        "broker restart under load",
        "rabbitmqctl stop_app, 3 s, start_app",
        &expected,
        8,
        Some(fault),
        t0,
    )
    .await
}

/// Broker frozen (SIGSTOP) past the 2 s heartbeat timeout for 8 s, then SIGCONT.
pub async fn broker_frozen() -> Outcome {
    let t0 = Instant::now();
    let mut s = Stack::start("rel-bfreeze", true, "concurrency = 4", 0.05, "").await;
    s.edit_config(|t| t.replacen("[amqp]\n", "[amqp]\nheartbeat = \"2s\"\n", 1));
    let _w = s.worker("w");
    let expected = s.enqueue(150).await;
    wait_runs(&s, 20, Duration::from_secs(60)).await;
    let pid = s.rabbit.as_ref().unwrap().pid();
    crate::signal_pid(pid, 19);
    let frozen = now_f64();
    wait_until("8 s frozen", Duration::from_secs(30), || async { now_f64() > frozen + 8.0 }).await;
    crate::signal_pid(pid, 18);
    let fault = now_f64(); // recovery is measured from the end of the fault
    s.wait_all(&expected, Duration::from_secs(120)).await;
    s.outcome(
        "broker frozen past the heartbeat",
        "SIGSTOP the broker 8 s (heartbeat 2 s), SIGCONT",
        &expected,
        8,
        Some(fault),
        t0,
    )
    .await
}

/// Redis killed and restarted empty under load: its dedup records are gone.
pub async fn redis_restarted_empty() -> Outcome {
    let t0 = Instant::now();
    let mut s = Stack::start("rel-rrestart", false, "concurrency = 4", 0.05, "").await;
    let _w1 = s.worker("1");
    let _w2 = s.worker("2");
    let expected = s.enqueue(200).await;
    wait_runs(&s, 30, Duration::from_secs(60)).await;
    s.redis.restart().await;
    let fault = now_f64();
    s.wait_all(&expected, Duration::from_secs(120)).await;
    // A job that ran but was not yet acked when Redis lost its record can run again; the
    // unique index keeps its effect single.
    s.outcome(
        "Redis restarted empty",
        "kill -9 Redis and restart it with no data",
        &expected,
        8,
        Some(fault),
        t0,
    )
    .await
}

/// Redis frozen (SIGSTOP) for 5 s under load, then SIGCONT.
pub async fn redis_frozen() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start("rel-rfreeze", false, "concurrency = 4", 0.05, "").await;
    let _w = s.worker("w");
    let expected = s.enqueue(150).await;
    wait_runs(&s, 20, Duration::from_secs(60)).await;
    let pid = s.redis.pid();
    crate::signal_pid(pid, 19);
    let frozen = now_f64();
    wait_until("5 s frozen", Duration::from_secs(30), || async { now_f64() > frozen + 5.0 }).await;
    crate::signal_pid(pid, 18);
    let fault = now_f64(); // recovery is measured from the end of the fault
    s.wait_all(&expected, Duration::from_secs(120)).await;
    s.outcome("Redis frozen", "SIGSTOP Redis 5 s, SIGCONT", &expected, 4, Some(fault), t0).await
}

/// Malformed bodies, a permanently failing job and a job that times out, among good ones.
pub async fn poison_and_timeouts() -> Outcome {
    let t0 = Instant::now();
    let extra = "[[jobs]]\nname = \"poison\"\nhandler = \"exec\"\ncommand = [\"sh\", \"-c\", \"exit 100\"]\n\
                 [[jobs]]\nname = \"slow\"\nhandler = \"exec\"\ncommand = [\"sleep\", \"30\"]\ntimeout = \"1s\"\nmax_attempts = 2\n\
                 backoff = { initial = \"1s\", factor = 1.0, max = \"1s\" }\n";
    let s = Stack::start("rel-poison", false, "concurrency = 4", 0.0, extra).await;
    let _w = s.worker("w");
    let expected = s.enqueue(50).await;
    let client = EnqueueClient::connect(Arc::new(s.config.clone())).await.unwrap();
    for i in 0..5 {
        client.enqueue(EnqueueRequest::new("poison").key(format!("p{i}"))).await.unwrap();
        client.enqueue(EnqueueRequest::new("slow").key(format!("s{i}"))).await.unwrap();
    }
    let conn =
        lapin::Connection::connect(&s.env.amqp_url, lapin::ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default()).await.unwrap();
    for i in 0..5 {
        let body = format!("garbage {i}");
        chime_shared::amqp::publish_confirmed(
            &ch,
            &s.env.names().work_exchange(),
            "default",
            body.as_bytes(),
            lapin::BasicProperties::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    }
    s.wait_all(&expected, Duration::from_secs(60)).await;
    wait_until("15 dead letters", Duration::from_secs(60), || async {
        s.dlq().await.values().sum::<usize>() == 15
    })
    .await;
    let o = s
        .outcome(
            "malformed, poison, timeout",
            "5 garbage bodies, 5 exit-100 jobs, 5 jobs past their timeout",
            &expected,
            0,
            None,
            t0,
        )
        .await;
    assert_eq!(o.dlq.get("malformed"), Some(&5));
    assert_eq!(o.dlq.get("permanent"), Some(&5));
    assert_eq!(o.dlq.get("timeout"), Some(&5));
    let _ = conn.close(200, "".into()).await;
    o
}

/// A second publisher sends every slot of the schedule again (what two leaders would do).
pub async fn duplicate_publishes() -> Outcome {
    let t0 = Instant::now();
    let extra = "schedule = \"* * * * * *\"\n[ticker]\nlease = \"2s\"\n";
    let s = Stack::start("rel-dup", false, "concurrency = 8", 0.0, extra).await;
    let _w = s.worker("w");
    let _t = s.ticker("t");
    wait_runs(&s, 2, Duration::from_secs(30)).await;
    let client = EnqueueClient::connect(Arc::new(s.config.clone())).await.unwrap();
    let fault = now_f64();
    let until = fault + 8.0;
    let mut sent = 0;
    let mut last = 0i64;
    while now_f64() < until {
        let sec = chrono::Utc::now().timestamp();
        if sec != last {
            last = sec;
            let slot = chrono::DateTime::from_timestamp(sec, 0).unwrap();
            let key = chime_shared::envelope::scheduled_key("work", slot);
            let env = chime_shared::Envelope::new(
                "work",
                "default",
                key,
                serde_json::Value::Null,
                Some(slot),
                20,
                chime_shared::Source::Schedule,
            );
            client.publish(&env, Duration::ZERO).await.unwrap();
            sent += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(sent >= 7);
    let expected = slot_keys(&s, until);
    s.wait_all(&expected, Duration::from_secs(30)).await;
    s.outcome_valid(
        "duplicate publishes of every slot",
        "a rogue second publisher sends each slot again",
        &expected,
        &valid_slot_keys(),
        0,
        Some(fault),
        t0,
    )
    .await
}

/// 100 jobs fail permanently, then are replayed from the DLQ with `chime dlq replay --all`.
pub async fn dlq_replay() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start_gated("rel-replay", false, "concurrency = 8", 0.0, "", Some("open")).await;
    let _w = s.worker("w");
    let expected = s.enqueue(100).await;
    wait_until("100 dead letters", Duration::from_secs(60), || async {
        s.dlq().await.get("permanent") == Some(&100)
    })
    .await;
    std::fs::write(s.env.dir.join("open"), b"").unwrap();
    let fault = now_f64();
    let out = tokio::process::Command::new(crate::bin("chime"))
        .arg("--config")
        .arg(&s.config_path)
        .args(["dlq", "replay", "--all"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    s.wait_all(&expected, Duration::from_secs(60)).await;
    s.outcome(
        "DLQ replay of 100 dead letters",
        "100 permanent failures, then `chime dlq replay --all`",
        &expected,
        0,
        Some(fault),
        t0,
    )
    .await
}

/// A 3-node cluster, quorum queues, three AMQP URLs; the node leading the work queue is
/// SIGKILLed under load.
pub async fn cluster_leader_killed() -> Outcome {
    let t0 = Instant::now();
    let cluster = crate::PrivateCluster::start(3).await;
    let mut s = Stack::start("rel-cluster", false, "concurrency = 4", 0.05, "").await;
    s.env.amqp_url = cluster.urls()[0].clone();
    let urls = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect::<Vec<_>>().join(", ");
    let shared = crate::amqp_url();
    s.edit_config(|t| t.replacen(&format!("url = \"{shared}\""), &format!("url = [{urls}]"), 1));
    let _w1 = s.worker("1");
    let _w2 = s.worker("2");
    let expected = s.enqueue(300).await;
    wait_runs(&s, 30, Duration::from_secs(60)).await;
    let queue = s.env.names().work_queue("default");
    let leader = cluster.leader_of(&queue, 1);
    let victim = cluster
        .nodes
        .iter()
        .position(|n| n.node() == leader)
        .unwrap_or_else(|| panic!("leader {leader:?} of {queue} not found"));
    cluster.nodes[victim].kill().await;
    let fault = now_f64();
    s.wait_all(&expected, Duration::from_secs(180)).await;
    s.outcome(
        "cluster: queue leader killed",
        "3 nodes, kill -9 the node leading the work queue",
        &expected,
        8,
        Some(fault),
        t0,
    )
    .await
}

/// A Rust handler (in-process worker) that panics on its first attempt of every job; the
/// retry writes the same ledger and effect table.
pub async fn handler_panic() -> Outcome {
    use chime_worker::{JobContext, JobError, Registry, Worker, raw_handler_fn};
    let t0 = Instant::now();
    let mut s = Stack::start("rel-panic", false, "concurrency = 4", 0.0, "").await;
    s.edit_config(|t| {
        t.replacen("handler = \"exec\"", "handler = \"panicky\"", 1)
            .replace("command = ['sh'", "# command = ['sh'")
    });
    let (db, ledger) = (s.db.clone(), s.ledger.clone());
    let mut reg = Registry::new();
    reg.register(
        "panicky",
        raw_handler_fn(move |ctx: JobContext, _| {
            let (db, ledger) = (db.clone(), ledger.clone());
            async move {
                if ctx.attempt == 1 {
                    panic!("first attempts always panic");
                }
                let sql = format!("INSERT INTO effects(key) VALUES ('{}')", ctx.key);
                let out = tokio::process::Command::new("psql")
                    .args(["-qAt", "-h", "127.0.0.1", "-U", "postgres", "-d", &db, "-c", &sql])
                    .output()
                    .await
                    .map_err(JobError::transient)?;
                let what = if out.status.success() {
                    "done"
                } else if String::from_utf8_lossy(&out.stderr).contains("duplicate") {
                    "rejected"
                } else {
                    return Err(JobError::transient("database error"));
                };
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&ledger)
                    .map_err(JobError::transient)?;
                writeln!(f, "{} {} {what}", now_f64(), ctx.key).map_err(JobError::transient)?;
                Ok(())
            }
        }),
    );
    let worker = Worker::builder(s.config.clone()).registry(reg).build().unwrap();
    let token = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(token.clone()));
    let expected = s.enqueue(60).await;
    s.wait_all(&expected, Duration::from_secs(120)).await;
    token.cancel();
    let _ = run.await;
    s.outcome("handler panic", "every job's first attempt panics (Rust handler)", &expected, 0, None, t0)
        .await
}

/// A broker with `consumer_timeout = 60000` ms and a job running 150 s while quick jobs
/// share its channel: the broker closes the channel and requeues everything unacked on it.
/// Takes 2–3 minutes; run by `chime-reliability`, not in CI.
pub async fn consumer_timeout() -> Outcome {
    let t0 = Instant::now();
    BROKER_CONF.with(|c| *c.borrow_mut() = "consumer_timeout = 60000\n".into());
    let extra =
        "[[jobs]]\nname = \"long\"\nhandler = \"exec\"\ntimeout = \"300s\"\ncommand = [\"sleep\", \"150\"]\n";
    let mut s = Stack::start("rel-ctimeout", true, "concurrency = 4\nprefetch = 4", 0.2, extra).await;
    BROKER_CONF.with(|c| c.borrow_mut().clear());
    // Tell chime what the broker enforces, so the worker can warn about the long job.
    s.edit_config(|t| t.replacen("[amqp]\n", "[amqp]\nconsumer_timeout = \"1m\"\n", 1));
    let w = s.worker("w");
    let client = EnqueueClient::connect(Arc::new(s.config.clone())).await.unwrap();
    client.enqueue(EnqueueRequest::new("long").key("long")).await.unwrap();
    let mut expected = HashSet::new();
    let fault = now_f64();
    // Quick jobs keep flowing on the same channel for the whole run.
    // The broker checks consumer_timeout once a minute: an ack 150 s late is always caught.
    for round in 0..36 {
        let reqs: Vec<_> =
            (0..10).map(|i| EnqueueRequest::new("work").key(format!("r{round}-{i}"))).collect();
        client.enqueue_batch(&reqs).await.unwrap();
        expected.extend(
            (0..10).map(|i| chime_shared::envelope::adhoc_key("work", &format!("r{round}-{i}")).to_string()),
        );
        let until = now_f64() + 5.0;
        wait_until("5 s", Duration::from_secs(30), || async { now_f64() > until }).await;
    }
    s.wait_all(&expected, Duration::from_secs(120)).await;
    let log = w.log_text();
    assert!(log.contains("not safely below RabbitMQ's consumer_timeout"), "startup warning");
    assert!(
        log.contains("connection lost") || log.contains("consumer of"),
        "the broker closed the channel:\n{log}"
    );
    s.outcome(
        "late ack past consumer_timeout",
        "consumer_timeout 60 s; a 150 s job shares the channel (prefetch 4)",
        &expected,
        4,
        Some(fault),
        t0,
    )
    .await
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
    if std::env::var_os("CHIME_QUICK").is_none() {
        run!(consumer_timeout(), "late ack past consumer_timeout");
    }
    out
}
