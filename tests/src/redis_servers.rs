//! Private Redis servers: one node, Sentinels, a Redis Cluster.

use super::*;

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

    /// A server started with `args`, on a spare port. A port another process took between
    /// `free_port` and the server's bind (tests start servers concurrently) makes the server
    /// exit: it is started again on another port, up to five times.
    pub async fn start_with(args: &[&str]) -> Self {
        let cluster = args.contains(&"--cluster-enabled");
        let mut failures = Vec::new();
        for _ in 0..5 {
            let port = if cluster { free_cluster_port() } else { free_port() };
            let dir = std::env::temp_dir().join(format!("chime-redis-{port}"));
            std::fs::create_dir_all(&dir).unwrap();
            let args = args.iter().map(|a| a.to_string()).collect();
            let mut r = Self { port, child: None, dir, args };
            match r.try_spawn().await {
                Ok(()) => return r,
                Err(e) => failures.push(format!("port {port}: {e}")),
            }
        }
        panic!("private redis-server did not start: {}", failures.join("; "))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Starts the server on its port (again, after a kill); panics if it does not answer.
    async fn spawn(&mut self) {
        if let Err(e) = self.try_spawn().await {
            panic!("private redis-server on port {}: {e}", self.port);
        }
    }

    /// Starts the server and waits (up to 30 s: tests start many processes at once) until it
    /// answers PING; `Err` when it exited first or never answered.
    async fn try_spawn(&mut self) -> Result<(), String> {
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
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                return Err(format!("redis-server exited ({status}) before answering PING"));
            }
            let Ok(client) = redis::Client::open(url.as_str()) else { return Err(format!("bad url {url}")) };
            let probe = async {
                let mut c = client.get_multiplexed_async_connection().await?;
                redis::cmd("PING").query_async::<String>(&mut c).await
            };
            if matches!(tokio::time::timeout(Duration::from_secs(3), probe).await, Ok(Ok(_))) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err("no answer to PING within 30 s".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
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

    /// The master's port as the first sentinel reports it; None when the sentinel does not
    /// answer in time (a failover on a loaded machine can keep it busy past a connection's
    /// timeout).
    pub async fn master_port(&self) -> Option<u16> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.ports[0])).ok()?;
        let mut c = client.get_multiplexed_async_connection().await.ok()?;
        let addr: Vec<String> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(Self::MASTER)
            .query_async(&mut c)
            .await
            .ok()?;
        addr.get(1)?.parse().ok()
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
        // A sentinel or replica that does not answer yet counts as not promoted yet.
        let writable = || async move {
            let client = redis::Client::open(format!("redis://127.0.0.1:{port}/0")).ok()?;
            let mut r = client.get_multiplexed_async_connection().await.ok()?;
            redis::cmd("SET").arg("chime:failover-probe").arg(1).query_async::<()>(&mut r).await.ok()
        };
        wait_until("the replica is the master", Duration::from_secs(30), || async move {
            self.master_port().await == Some(port) && writable().await.is_some()
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

/// A spare port for a cluster node: Redis also listens on the port + 10,000 (the cluster bus),
/// which must be a port (so the port is at most 55,535) and spare too.
fn free_cluster_port() -> u16 {
    for _ in 0..1000 {
        let port = free_port();
        if port <= 55_535 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no spare port p with p + 10000 spare too, for a Redis Cluster node")
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
