//! Test harness for chime's integration tests against real RabbitMQ and Redis.
//!
//! - [`TestEnv`]: a unique prefix per test (exchanges, queues, Redis keys), removed on drop.
//! - [`wait_until`]: wait on a condition with a deadline; tests never sleep to synchronise.
//! - [`PrivateRedis`]: a redis-server of the test's own on a spare port, to kill and restart.
//! - [`Child`]: a `chime`/`chime-worker` process of the test's own, killed on drop.
//!
//! A test that cannot reach its service fails with a message saying so; none passes
//! vacuously.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use chime_shared::config::{Config, ValidConfig};
use chime_shared::topology::Names;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub fn amqp_url() -> String {
    std::env::var("CHIME_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub fn redis_url() -> String {
    std::env::var("CHIME_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".into())
}

/// Waits until `pred` is true, polling every 20 ms; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut pred: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        // A predicate that hangs (say, a connect that never completes) must not outlive the
        // deadline: each call gets at most the time that is left.
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        if let Ok(true) = tokio::time::timeout(left, pred()).await {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Connects to the shared broker, failing the test with a clear message if it is down.
pub async fn connect_amqp() -> Connection {
    match Connection::connect(&amqp_url(), ConnectionProperties::default()).await {
        Ok(c) => c,
        Err(e) => {
            panic!("RabbitMQ is not reachable at {}: {e}. Start it (README: running the tests).", amqp_url())
        }
    }
}

/// A connection to the broker at `url` (a private one).
pub async fn connect_amqp_to(url: &str) -> Connection {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("cannot reach RabbitMQ at {url}: {e}"))
}

/// A multiplexed connection to a Redis, failing the test clearly if it is down.
pub async fn connect_redis(url: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(url).expect("redis url");
    match client.get_multiplexed_async_connection().await {
        Ok(c) => c,
        Err(e) => panic!("Redis is not reachable at {url}: {e}. Start it (README: running the tests)."),
    }
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A test's own namespace on the shared services. Dropping it deletes every queue and
/// exchange the test declared and every Redis key under its prefix.
pub mod probes;
pub mod proxy;
pub mod reliability;
pub mod tls;
pub mod webdriver;

pub struct TestEnv {
    pub prefix: String,
    pub queues: Vec<String>,
    pub amqp_url: String,
    pub redis_url: String,
    pub dir: PathBuf,
}

impl TestEnv {
    /// `name` becomes part of the prefix, so leftovers point at their test.
    pub fn new(name: &str) -> Self {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let prefix = format!(
            "t-{name}-{}-{n}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        );
        let dir = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&dir).unwrap();
        Self { prefix, queues: vec!["default".into()], amqp_url: amqp_url(), redis_url: redis_url(), dir }
    }

    pub fn names(&self) -> Names {
        Names::new(&self.prefix)
    }

    /// A config under this prefix: `extra` is TOML appended after the generated sections'
    /// keys (use it for `[[jobs]]`), `worker` is added to `[worker]`.
    pub fn config_text(&self, queue_type: &str, redis: &str, worker: &str, jobs: &str) -> String {
        format!(
            "prefix = \"{}\"\n[amqp]\nurl = \"{}\"\nqueue_type = \"{queue_type}\"\n[redis]\nurl = \"{}\"\n{redis}\n[worker]\n{worker}\n{jobs}\n",
            self.prefix, self.amqp_url, self.redis_url
        )
    }

    pub fn config(&self, queue_type: &str, redis: &str, worker: &str, jobs: &str) -> ValidConfig {
        let text = self.config_text(queue_type, redis, worker, jobs);
        Config::from_toml_str(&text).unwrap_or_else(|e| panic!("test config invalid: {e}\n{text}"))
    }

    /// Writes a config file into the test's directory and returns its path.
    pub fn write_config(&self, text: &str) -> PathBuf {
        let path = self.dir.join("chime.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    async fn cleanup(&self) {
        let Ok(conn) = Connection::connect(&self.amqp_url, ConnectionProperties::default()).await else {
            return;
        };
        let names = self.names();
        // The prefix's own queues and exchanges; the delay chain is shared by every prefix on
        // the virtual host and stays.
        let level = |q: &str, p| names.work_queue(&chime_shared::envelope::priority_route(q, p));
        let mut queues: Vec<String> = self
            .queues
            .iter()
            .flat_map(|q| {
                [
                    names.work_queue(q),
                    level(q, chime_shared::config::Priority::High),
                    level(q, chime_shared::config::Priority::Low),
                    names.dlq(q),
                ]
            })
            .collect();
        queues.push(names.unroutable_queue());
        for name in queues {
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default()).await;
            }
        }
        for ex in [names.work_exchange(), names.dead_exchange()] {
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch.exchange_delete(ex.as_str().into(), ExchangeDeleteOptions::default()).await;
            }
        }
        let _ = conn.close(200, "cleanup".into()).await;
        if let Ok(client) = redis::Client::open(self.redis_url.as_str())
            && let Ok(mut r) = client.get_multiplexed_async_connection().await
        {
            // SCAN in pages and unlink in batches: benchmarks leave hundreds of thousands of keys.
            let pattern = format!("{}:*", self.prefix);
            let mut cursor: u64 = 0;
            loop {
                let page: Result<(u64, Vec<String>), _> = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(10_000)
                    .query_async(&mut r)
                    .await;
                let Ok((next, keys)) = page else { break };
                if !keys.is_empty() {
                    let _: Result<(), _> = redis::cmd("UNLINK").arg(keys).query_async(&mut r).await;
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let env = TestEnv {
            prefix: self.prefix.clone(),
            queues: self.queues.clone(),
            amqp_url: self.amqp_url.clone(),
            redis_url: self.redis_url.clone(),
            dir: self.dir.clone(),
        };
        // Runs on its own thread and runtime: Drop may run inside (or outside) a runtime.
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
                rt.block_on(env.cleanup());
            }
            std::mem::forget(env); // its own Drop must not recurse
        })
        .join();
    }
}

/// A free TCP port on loopback (bound once, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A redis-server owned by one test, on a spare port, with no persistence.
pub struct PrivateRedis {
    pub port: u16,
    child: Option<std::process::Child>,
    dir: PathBuf,
    /// Extra `redis-server` arguments (`--replicaof …`).
    args: Vec<String>,
}

impl PrivateRedis {
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A replica of the Redis on `master`, synchronised before this returns.
    pub async fn start_replica_of(master: u16) -> Self {
        let r = Self::start_with(&["--replicaof", "127.0.0.1", &master.to_string()]).await;
        let url = r.url();
        wait_until("the replica is in sync", Duration::from_secs(20), || {
            let url = url.clone();
            async move {
                let mut c = connect_redis(&url).await;
                let info: String =
                    redis::cmd("INFO").arg("replication").query_async(&mut c).await.unwrap_or_default();
                info.contains("master_link_status:up")
            }
        })
        .await;
        r
    }

    pub async fn start_with(args: &[&str]) -> Self {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("chime-redis-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let args = args.iter().map(|a| a.to_string()).collect();
        let mut r = Self { port, child: None, dir, args };
        r.spawn().await;
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    async fn spawn(&mut self) {
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server (is it installed?): {e}"));
        self.child = Some(child);
        let url = self.url();
        wait_until("private redis answers PING", Duration::from_secs(10), || {
            let url = url.clone();
            async move {
                let Ok(client) = redis::Client::open(url.as_str()) else { return false };
                let probe = async {
                    let mut c = client.get_multiplexed_async_connection().await?;
                    redis::cmd("PING").query_async::<String>(&mut c).await
                };
                matches!(tokio::time::timeout(Duration::from_secs(3), probe).await, Ok(Ok(_)))
            }
        })
        .await;
    }

    /// SIGKILLs the server (its data is gone: no persistence).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again, empty, on the same port.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Path of a workspace binary (`chime`, `chime-worker`) next to the test executable.
pub fn bin(name: &str) -> PathBuf {
    // Test executables live in target/<profile>/deps, binaries such as chime-reliability in
    // target/<profile>: look beside the executable, then one level up.
    let exe = std::env::current_exe().unwrap();
    let here = exe.parent().unwrap();
    let path = [here.join(name), here.parent().unwrap().join(name)]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| here.join(name));
    assert!(
        path.exists(),
        "{} not found: build the binaries first (`cargo build --workspace --bins`, done by scripts/test)",
        path.display()
    );
    path
}

/// A child process killed (SIGKILL) on drop unless it already exited.
pub struct Child {
    pub child: tokio::process::Child,
    pub log: PathBuf,
}

impl Child {
    /// Spawns `chime-worker --config CONFIG args…`, logging to a file in `dir`.
    pub fn worker(dir: &Path, config: &Path, args: &[&str], tag: &str) -> Self {
        Self::spawn("chime-worker", dir, config, args, &format!("worker-{tag}"))
    }

    /// Like `worker`, with extra environment variables.
    pub fn worker_env(dir: &Path, config: &Path, tag: &str, envs: &[(&str, &str)]) -> Self {
        let mut cmd = tokio::process::Command::new(bin("chime-worker"));
        cmd.envs(envs.iter().copied());
        Self::run(cmd, dir, config, &[], &format!("worker-{tag}"))
    }

    /// Spawns `chime --config CONFIG args…` (a daemon such as `watch`).
    pub fn chime(dir: &Path, config: &Path, args: &[&str], tag: &str) -> Self {
        Self::spawn("chime", dir, config, args, tag)
    }

    /// Peak resident memory of the process so far (`VmHWM`), in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Whether the process has exited (reaps it if so).
    pub fn child_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Open file descriptors of the process.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).map(|d| d.count()).unwrap_or(0)
    }

    /// Spawns `chime --config CONFIG tick args…`.
    pub fn ticker(dir: &Path, config: &Path, args: &[&str], tag: &str) -> Self {
        let mut all = vec!["tick"];
        all.extend_from_slice(args);
        Self::spawn("chime", dir, config, &all, &format!("ticker-{tag}"))
    }

    /// Spawns `chime tick` with its wall clock `offset` away from the real one (see
    /// [`Child::with_clock`]).
    pub fn skewed_ticker(dir: &Path, config: &Path, offset: &str, tag: &str) -> Self {
        Self::with_clock("chime", dir, config, &["tick"], offset, &format!("ticker-{tag}"), &[])
    }

    /// Spawns `program --config CONFIG args…` with its wall clock `offset` (libfaketime's
    /// `FAKETIME`, e.g. `+3s` or `-3456000`) away from the real one: libfaketime is preloaded
    /// into the process itself — the `faketime` wrapper forks, so killing it would leave the
    /// program running; the monotonic clock is left alone, as a skewed NTP client would.
    /// Children it starts (an `exec` job) inherit the clock.
    pub fn with_clock(
        program: &str,
        dir: &Path,
        config: &Path,
        args: &[&str],
        offset: &str,
        tag: &str,
        envs: &[(&str, &str)],
    ) -> Self {
        let lib =
            ["/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1", "/usr/lib/faketime/libfaketimeMT.so.1"]
                .into_iter()
                .find(|p| Path::new(p).exists())
                .unwrap_or_else(|| {
                    panic!("libfaketime is needed for faked clocks (scripts/services installs faketime)")
                });
        let mut cmd = tokio::process::Command::new(bin(program));
        cmd.env("LD_PRELOAD", lib).env("FAKETIME", offset).env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        cmd.envs(envs.iter().copied());
        Self::run(cmd, dir, config, args, tag)
    }

    fn spawn(program: &str, dir: &Path, config: &Path, args: &[&str], tag: &str) -> Self {
        Self::run(tokio::process::Command::new(bin(program)), dir, config, args, tag)
    }

    /// Runs `cmd --config CONFIG args…` with debug logs into `dir/TAG.log`.
    /// Spawns `cmd --config CONFIG args…`, logging to a file in `dir`.
    pub fn run(
        mut cmd: tokio::process::Command,
        dir: &Path,
        config: &Path,
        args: &[&str],
        tag: &str,
    ) -> Self {
        let log = dir.join(format!("{tag}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = cmd
            .arg("--config")
            .arg(config)
            .args(args)
            .env("RUST_LOG", "info,chime_worker=debug,chime_producer=debug")
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self { child, log }
    }

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id().unwrap_or(0)).unwrap()
    }

    pub fn signal(&self, sig: i32) {
        signal_pid(u32::try_from(self.pid()).unwrap_or(0), sig);
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Lines of a ledger file (one line per event, appended by exec jobs).
pub fn ledger(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_string).collect()
}

/// Counts of lines equal to `line` in a ledger.
pub fn count(lines: &[String], line: &str) -> usize {
    lines.iter().filter(|l| l.as_str() == line).count()
}

/// A single-node RabbitMQ owned by one test, on spare ports, with its own data directory.
/// `kill` SIGKILLs the node (its durable queues and confirmed messages survive on disk);
/// `restart` boots it again on the same ports and data.
pub struct PrivateRabbit {
    pub port: u16,
    dist_port: u16,
    dir: PathBuf,
    /// Open-files limit the node is started with (`ulimit -n`), if any.
    nofile: Option<u32>,
    /// Extra Erlang VM flags (`RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS`), if any.
    erl_args: Option<String>,
    /// The `rabbitmq-server` wrapper process (the node itself runs as user `rabbitmq`).
    wrapper: std::sync::Mutex<Option<std::process::Child>>,
}

impl PrivateRabbit {
    pub async fn start() -> Self {
        Self::start_with("").await
    }

    /// Starts a node with `conf` as its `rabbitmq.conf` (e.g. `consumer_timeout = 60000`).
    pub async fn start_with(conf: &str) -> Self {
        Self::start_full(conf, None, None).await
    }

    /// Starts a node whose open-files limit is `nofile` (the common default is 1,024).
    pub async fn start_nofile(nofile: u32) -> Self {
        Self::start_full("", Some(nofile), None).await
    }

    /// Starts a node with extra Erlang VM flags (e.g. `+sbwt none`: schedulers that do not
    /// busy-wait, so that the node's CPU time is the work it did).
    pub async fn start_erl(erl_args: &str) -> Self {
        Self::start_full("", None, Some(erl_args.to_string())).await
    }

    async fn start_full(conf: &str, nofile: Option<u32>, erl_args: Option<String>) -> Self {
        let port = free_port();
        let dist_port = free_port();
        let dir = std::env::temp_dir().join(format!("chime-rabbit-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        if !conf.is_empty() {
            std::fs::write(dir.join("rabbitmq.conf"), conf).unwrap();
        }
        // rabbitmq-server drops privileges to the `rabbitmq` user when started as root.
        let _ = std::process::Command::new("chown").args(["-R", "rabbitmq:rabbitmq"]).arg(&dir).status();
        let r = Self { port, dist_port, dir, nofile, erl_args, wrapper: std::sync::Mutex::new(None) };
        r.spawn().await;
        r
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Erlang node name.
    pub fn node(&self) -> String {
        format!("chime-test-{}@localhost", self.port)
    }

    /// `rabbitmqctl -n <this node> args…` (e.g. `stop_app`, `start_app`); returns stdout.
    pub fn ctl(&self, args: &[&str]) -> String {
        let out =
            std::process::Command::new("rabbitmqctl").arg("-n").arg(self.node()).args(args).output().unwrap();
        assert!(out.status.success(), "rabbitmqctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until the node accepts AMQP connections again (after `start_app`).
    pub async fn wait_amqp(&self) {
        let url = self.url();
        wait_until("RabbitMQ node accepts AMQP connections", Duration::from_secs(90), || {
            let url = url.clone();
            async move {
                // One attempt can hang (accepted during boot, never answered): retry instead.
                let attempt = Connection::connect(&url, ConnectionProperties::default());
                match tokio::time::timeout(Duration::from_secs(3), attempt).await {
                    Ok(Ok(c)) => {
                        let _ = c.close(200, "probe".into()).await;
                        true
                    }
                    _ => false,
                }
            }
        })
        .await;
    }

    /// Pid of the node's Erlang VM.
    pub fn pid(&self) -> u32 {
        std::fs::read_to_string(self.dir.join("pid")).ok().and_then(|p| p.trim().parse().ok()).unwrap_or(0)
    }

    async fn spawn(&self) {
        let d = &self.dir;
        let mut cmd = match self.nofile {
            Some(n) => {
                let mut c = std::process::Command::new("sh");
                c.args(["-c", &format!("ulimit -n {n} && exec rabbitmq-server")]);
                c
            }
            None => std::process::Command::new("rabbitmq-server"),
        };
        if let Some(a) = &self.erl_args {
            cmd.env("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", a);
        }
        let child = cmd
            .env("RABBITMQ_NODENAME", format!("chime-test-{}@localhost", self.port))
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("plugins"))
            .env("RABBITMQ_ENABLED_PLUGINS", "")
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq"))
            .current_dir(d)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start rabbitmq-server (is it installed?): {e}"));
        *self.wrapper.lock().unwrap() = Some(child);
        self.wait_amqp().await;
    }

    /// SIGKILLs the node and waits until its port is closed.
    pub async fn kill(&self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
            let _ =
                std::process::Command::new("kill").args(["-9", pid.trim()]).stderr(Stdio::null()).status();
        }
        let port = self.port;
        wait_until("private RabbitMQ port closed", Duration::from_secs(20), || async move {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
        })
        .await;
        self.reap();
    }

    fn reap(&self) {
        if let Some(mut c) = self.wrapper.lock().unwrap().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub async fn restart(&self) {
        self.kill().await;
        self.spawn().await;
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
            let _ =
                std::process::Command::new("kill").args(["-9", pid.trim()]).stderr(Stdio::null()).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends `sig` to `pid` through the `kill` program (the test crate has no unsafe code).
pub fn signal_pid(pid: u32, sig: i32) {
    let status =
        std::process::Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status().unwrap();
    assert!(status.success(), "kill -{sig} {pid} failed");
}

/// A RabbitMQ cluster of private nodes on one machine (same Erlang cookie, loopback ports).
pub struct PrivateCluster {
    pub nodes: Vec<PrivateRabbit>,
}

impl PrivateCluster {
    pub async fn start(n: usize) -> Self {
        Self::start_erl(n, None).await
    }

    /// A cluster whose nodes run with extra Erlang VM flags.
    pub async fn start_erl(n: usize, erl_args: Option<&str>) -> Self {
        let start = || async {
            match erl_args {
                Some(a) => PrivateRabbit::start_erl(a).await,
                None => PrivateRabbit::start().await,
            }
        };
        let mut nodes = vec![start().await];
        for _ in 1..n {
            let node = start().await;
            node.ctl(&["stop_app"]);
            node.ctl(&["join_cluster", &nodes[0].node()]);
            node.ctl(&["start_app"]);
            node.wait_amqp().await;
            nodes.push(node);
        }
        Self { nodes }
    }

    /// Every node's URL, for `amqp.url = [...]`.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(PrivateRabbit::url).collect()
    }

    /// The node that leads quorum queue `queue`, asked through `via` (a live node).
    pub fn leader_of(&self, queue: &str, via: usize) -> String {
        let out = self.nodes[via].ctl(&["list_queues", "-q", "--no-table-headers", "name", "leader"]);
        out.lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(queue)).then(|| f.next().unwrap_or("").to_string())
            })
            .unwrap_or_default()
    }
}

/// Three sentinels (on spare ports) watching the master `mymaster` on `master`, which has a
/// replica: `failover` asks them to promote the replica.
pub struct PrivateSentinels {
    pub ports: Vec<u16>,
    pub replica: PrivateRedis,
    children: Vec<std::process::Child>,
    dir: PathBuf,
}

impl PrivateSentinels {
    pub const MASTER: &'static str = "mymaster";

    /// A replica of the Redis on `master` and three sentinels that know it and each other.
    pub async fn start(master: u16) -> Self {
        let replica = PrivateRedis::start_replica_of(master).await;
        let dir = std::env::temp_dir().join(format!("chime-sentinels-{master}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut ports = Vec::new();
        let mut children = Vec::new();
        for _ in 0..3 {
            let port = free_port();
            let conf = dir.join(format!("sentinel-{port}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {} 127.0.0.1 {master} 2\n\
                     sentinel down-after-milliseconds {m} 1000\nsentinel failover-timeout {m} 10000\n\
                     sentinel parallel-syncs {m} 1\n",
                    dir.display(),
                    Self::MASTER,
                    m = Self::MASTER
                ),
            )
            .unwrap();
            let child = std::process::Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start redis-server --sentinel: {e}"));
            ports.push(port);
            children.push(child);
        }
        let s = Self { ports, replica, children, dir };
        for &port in &s.ports {
            let url = format!("redis://127.0.0.1:{port}");
            wait_until(
                "a sentinel knows the replica and the other sentinels",
                Duration::from_secs(30),
                || {
                    let url = url.clone();
                    async move {
                        let Ok(client) = redis::Client::open(url.as_str()) else { return false };
                        let Ok(Ok(mut c)) = tokio::time::timeout(
                            Duration::from_secs(2),
                            client.get_multiplexed_async_connection(),
                        )
                        .await
                        else {
                            return false;
                        };
                        let replicas: Vec<redis::Value> = redis::cmd("SENTINEL")
                            .arg("replicas")
                            .arg(Self::MASTER)
                            .query_async(&mut c)
                            .await
                            .unwrap_or_default();
                        let sentinels: Vec<redis::Value> = redis::cmd("SENTINEL")
                            .arg("sentinels")
                            .arg(Self::MASTER)
                            .query_async(&mut c)
                            .await
                            .unwrap_or_default();
                        replicas.len() == 1 && sentinels.len() == 2
                    }
                },
            )
            .await;
        }
        s
    }

    /// `sentinels = [...]` and `master_name` lines for `[redis]`.
    pub fn config_lines(&self) -> String {
        let list = self.ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect::<Vec<_>>().join(", ");
        format!("sentinels = [{list}]\nmaster_name = \"{}\"\n", Self::MASTER)
    }

    /// The master's port as the first sentinel reports it.
    pub async fn master_port(&self) -> u16 {
        let mut c = connect_redis(&format!("redis://127.0.0.1:{}", self.ports[0])).await;
        let addr: Vec<String> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(Self::MASTER)
            .query_async(&mut c)
            .await
            .unwrap();
        addr[1].parse().unwrap()
    }

    /// `SENTINEL FAILOVER`, then waits until the sentinels name the replica as master and it
    /// accepts writes.
    pub async fn failover(&self) {
        let mut c = connect_redis(&format!("redis://127.0.0.1:{}", self.ports[0])).await;
        let _: () =
            redis::cmd("SENTINEL").arg("FAILOVER").arg(Self::MASTER).query_async(&mut c).await.unwrap();
        self.wait_promoted().await;
    }

    /// Waits until the sentinels name the replica as master and it accepts writes (after a
    /// `failover`, or after the master died).
    pub async fn wait_promoted(&self) {
        let port = self.replica.port;
        wait_until("the replica is the master", Duration::from_secs(30), || async move {
            self.master_port().await == port && {
                let mut r = connect_redis(&format!("redis://127.0.0.1:{port}/0")).await;
                redis::cmd("SET").arg("chime:failover-probe").arg(1).query_async::<()>(&mut r).await.is_ok()
            }
        })
        .await;
    }
}

impl Drop for PrivateSentinels {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of `masters` masters with one replica each, on spare ports.
pub struct PrivateRedisCluster {
    pub nodes: Vec<PrivateRedis>,
}

impl PrivateRedisCluster {
    pub async fn start(masters: usize) -> Self {
        let mut nodes = Vec::new();
        for _ in 0..masters * 2 {
            nodes.push(
                PrivateRedis::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    // A replica always stands for election, however long its link was down.
                    "--cluster-replica-validity-factor",
                    "0",
                ])
                .await,
            );
        }
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = std::process::Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| panic!("redis-cli is needed to create a cluster: {e}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let c = Self { nodes };
        c.wait_ok().await;
        c
    }

    /// Waits until every live node says `cluster_state:ok` and sees every slot served.
    pub async fn wait_ok(&self) {
        for n in self.nodes.iter().filter(|n| n.pid() != 0) {
            let url = n.url();
            wait_until("cluster_state:ok", Duration::from_secs(60), || {
                let url = url.clone();
                async move {
                    let mut c = connect_redis(&url).await;
                    let info: String =
                        redis::cmd("CLUSTER").arg("INFO").query_async(&mut c).await.unwrap_or_default();
                    info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
                }
            })
            .await;
        }
    }

    /// `redis.cluster = [...]` line.
    pub fn config_line(&self) -> String {
        let list =
            self.nodes.iter().map(|n| format!("\"127.0.0.1:{}\"", n.port)).collect::<Vec<_>>().join(", ");
        format!("cluster = [{list}]\n")
    }

    /// Indexes of the nodes that are masters now.
    pub async fn masters(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for (i, n) in self.nodes.iter().enumerate().filter(|(_, n)| n.pid() != 0) {
            let mut c = connect_redis(&n.url()).await;
            let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut c).await.unwrap_or_default();
            if matches!(role.first(), Some(redis::Value::BulkString(b)) if b == b"master") {
                out.push(i);
            }
        }
        out
    }
}
