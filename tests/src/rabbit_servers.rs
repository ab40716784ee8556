//! Private RabbitMQ nodes and clusters.

use super::*;

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
