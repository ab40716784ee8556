//! TestEnv: one test's prefix, config and clean-up.

use super::*;

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

    /// Deletes the test's queues, exchanges and keys, and its directory unless `keep_dir` (a
    /// failed test's logs are kept for whoever reads the failure).
    async fn cleanup(&self, keep_dir: bool) {
        // The test's own URL first (a private broker); else the shared broker's (a test that
        // switched to a user it has deleted since, or a broker that is gone).
        let conn = match Connection::connect(&self.amqp_url, ConnectionProperties::default()).await {
            Ok(conn) => Some(conn),
            Err(_) => Connection::connect(&amqp_url(), ConnectionProperties::default()).await.ok(),
        };
        // Workers' own queues (broadcast jobs): a worker deletes its own as it stops, not
        // when it is killed; the ids come from the workers' index, before the keys go.
        let mut redis = match redis::Client::open(self.redis_url.as_str()) {
            Ok(client) => client.get_multiplexed_async_connection().await.ok(),
            Err(_) => None,
        };
        let workers = match redis.as_mut() {
            Some(r) => Self::worker_ids(r, &self.names()).await,
            None => Vec::new(),
        };
        if let Some(conn) = conn {
            self.delete_topology(&conn, &workers).await;
        }
        if let Some(r) = redis.as_mut() {
            self.delete_keys(r).await;
        }
        if keep_dir {
            eprintln!("the failed test's files and logs are kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    async fn worker_ids(r: &mut redis::aio::MultiplexedConnection, names: &Names) -> Vec<String> {
        redis::cmd("ZRANGE")
            .arg(names.workers_index())
            .arg(0)
            .arg(-1)
            .query_async(r)
            .await
            .unwrap_or_default()
    }

    async fn delete_topology(&self, conn: &Connection, workers: &[String]) {
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
        queues.extend(workers.iter().map(|id| names.work_queue(&chime_shared::envelope::worker_route(id))));
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
    }

    async fn delete_keys(&self, r: &mut redis::aio::MultiplexedConnection) {
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
                .query_async(r)
                .await;
            let Ok((next, keys)) = page else { break };
            if !keys.is_empty() {
                let _: Result<(), _> = redis::cmd("UNLINK").arg(keys).query_async(r).await;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
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
        let keep_dir = std::thread::panicking();
        // Runs on its own thread and runtime: Drop may run inside (or outside) a runtime.
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
                rt.block_on(env.cleanup(keep_dir));
            }
            std::mem::forget(env); // its own Drop must not recurse
        })
        .join();
    }
}
