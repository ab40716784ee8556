//! Opt-in `scale`: what one job costs each part of the system, on one RabbitMQ node with one
//! Redis and on a 3-node RabbitMQ cluster (quorum queues replicated to the 3 nodes) with a
//! 3-master Redis Cluster, all private processes on this machine; and the model those costs
//! give for 100,000 jobs/s.
//!
//! The same work on both: 3 queues (each led by another node on the cluster), one publisher
//! per queue publishing to its leader's node, then one `chime-worker` per queue connected to
//! that node. CPU is read per process from `/proc`; the nodes run with `+sbwt none` so that a
//! node's CPU time is the work it did, not its schedulers spinning while they wait.

use crate::Ctx;
use crate::consume::completed;
use crate::fixtures::*;
use crate::measure::*;
use chime_producer::{EnqueueClient, Prepared};
use chime_shared::envelope::{self, Envelope, Source};
use chime_tests::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

const QUEUES: usize = 3;
const ERL_ARGS: &str = "+sbwt none +sbwtdcpu none +sbwtdio none";

/// CPU seconds of each group of processes.
struct Groups(Vec<Vec<u32>>);

impl Groups {
    fn now(&self) -> Vec<f64> {
        self.0.iter().map(|g| g.iter().map(|p| cpu_secs(*p)).sum()).collect()
    }
}

/// Costs of one topology, µs of CPU per job.
struct Costs {
    /// Per broker node, while publishing.
    publish_nodes: Vec<f64>,
    /// The publishers (this process).
    publisher: f64,
    /// Per broker node, while draining.
    drain_nodes: Vec<f64>,
    /// Redis masters, while draining.
    redis: f64,
    /// Redis replicas (applying the masters' writes), while draining.
    replicas: f64,
    /// The worker processes, while draining.
    workers: f64,
    publish_rate: f64,
    drain_rate: f64,
}

fn jobs_text() -> String {
    (0..QUEUES)
        .map(|i| format!("[[jobs]]\nname = \"j{i}\"\nhandler = \"noop\"\nqueue = \"q{i}\"\n"))
        .collect()
}

/// The config of the process that should talk to node `first`: the URL list rotated.
fn config_text(prefix: &str, urls: &[String], first: usize, redis: &str) -> String {
    let rotated: Vec<String> =
        (0..urls.len()).map(|k| format!("\"{}\"", urls[(first + k) % urls.len()])).collect();
    // Three copies of each queue however many nodes there are.
    let replicas = if urls.len() >= 3 { "quorum_replicas = 3\n" } else { "" };
    format!(
        "prefix = \"{prefix}\"\n[amqp]\nurl = [{}]\nqueue_type = \"quorum\"\n{replicas}[redis]\n{redis}\n{}",
        rotated.join(", "),
        jobs_text()
    )
}

/// One topology: `redis_pids` are the masters, `replica_pids` the replicas.
async fn run(
    urls: &[String],
    broker_pids: &[u32],
    redis_line: &str,
    redis_pids: &[u32],
    replica_pids: &[u32],
    cluster: Option<&PrivateCluster>,
    n: usize,
) -> Costs {
    let prefix = format!("bench-scale-{}", uuid::Uuid::new_v4().simple());
    let queues: Vec<String> = (0..QUEUES).map(|i| format!("q{i}")).collect();
    // Queue i is declared first from node i: quorum queues are led by the declaring node.
    let configs: Vec<String> = (0..QUEUES).map(|i| config_text(&prefix, urls, i, redis_line)).collect();
    for (i, text) in configs.iter().enumerate() {
        let cfg = chime_shared::config::Config::from_toml_str(text).unwrap();
        let conn = chime_shared::amqp::connect(&cfg.amqp, "bench-declare").await.unwrap();
        chime_shared::topology::declare(&conn, &cfg, std::slice::from_ref(&queues[i])).await.unwrap();
        let _ = conn.close(200, "".into()).await;
    }
    if let Some(cluster) = cluster {
        let names = chime_shared::topology::Names::new(&prefix);
        let leaders: Vec<String> =
            queues.iter().map(|q| cluster.leader_of(&names.work_queue(q), 0)).collect();
        println!("scale    queue leaders: {}", leaders.join(", "));
    }
    let mut clients = Vec::new();
    for text in &configs {
        let cfg = chime_shared::config::Config::from_toml_str(text).unwrap();
        clients.push(Arc::new(EnqueueClient::connect(cfg).await.unwrap()));
    }
    let batches: Vec<Arc<Vec<Prepared>>> = (0..QUEUES)
        .map(|i| {
            Arc::new(
                (0..n / QUEUES)
                    .map(|k| Prepared {
                        envelope: Envelope::new(
                            &format!("j{i}"),
                            &format!("q{i}"),
                            envelope::random_key(),
                            serde_json::json!({ "i": k }),
                            None,
                            3,
                            Source::Adhoc,
                        ),
                        delay: Duration::ZERO,
                        unverified_queue: None,
                        declare_queue: None,
                    })
                    .collect(),
            )
        })
        .collect();
    let total = (n / QUEUES) * QUEUES;
    let me = std::process::id();
    let mut groups: Vec<Vec<u32>> = broker_pids.iter().map(|p| vec![*p]).collect();
    groups.push(redis_pids.to_vec());
    groups.push(vec![me]);
    let g = Groups(groups);
    let before = g.now();
    let start = Instant::now();
    let tasks: Vec<_> = clients
        .iter()
        .zip(&batches)
        .map(|(c, b)| {
            let (c, b) = (c.clone(), b.clone());
            tokio::spawn(async move { c.publish_batch(&b).await.confirmed })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), n / QUEUES);
    }
    let publish_rate = total as f64 / start.elapsed().as_secs_f64();
    let after = g.now();
    let per = |i: usize, a: &[f64], b: &[f64]| (a[i] - b[i]) * 1e6 / total as f64;
    let nodes = broker_pids.len();
    let publish_nodes: Vec<f64> = (0..nodes).map(|i| per(i, &after, &before)).collect();
    let publisher = per(nodes + 1, &after, &before);

    // Drain: worker i consumes q{i} through node i.
    let dir = std::env::temp_dir().join(&prefix);
    std::fs::create_dir_all(&dir).unwrap();
    let mut children = Vec::new();
    let mut ports = Vec::new();
    for (i, text) in configs.iter().enumerate() {
        let path = dir.join(format!("w{i}.toml"));
        std::fs::write(&path, text).unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.join(format!("w{i}.log"))).unwrap();
        let mut c = tokio::process::Command::new(bin_path("chime-worker"));
        c.arg("--config")
            .arg(&path)
            .args(["--queues", &queues[i], "--listen", &format!("127.0.0.1:{port}")])
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        children.push(c.spawn().unwrap());
        ports.push(port);
    }
    let worker_pids: Vec<u32> = children.iter().filter_map(|c| c.id()).collect();
    let mut groups: Vec<Vec<u32>> = broker_pids.iter().map(|p| vec![*p]).collect();
    groups.push(redis_pids.to_vec());
    groups.push(worker_pids);
    groups.push(replica_pids.to_vec());
    let g = Groups(groups);
    let before = g.now();
    let start = Instant::now();
    loop {
        if completed(&ports).await >= total as u64 {
            break;
        }
        for (i, c) in children.iter_mut().enumerate() {
            if let Ok(Some(status)) = c.try_wait() {
                let log = std::fs::read_to_string(dir.join(format!("w{i}.log"))).unwrap_or_default();
                panic!("worker {i} exited ({status}) during the drain:\n{log}");
            }
        }
        assert!(start.elapsed() < Duration::from_secs(900), "scale drain stalled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let drain_rate = total as f64 / start.elapsed().as_secs_f64();
    let after = g.now();
    let drain_nodes: Vec<f64> = (0..nodes).map(|i| per(i, &after, &before)).collect();
    let redis = per(nodes, &after, &before);
    let workers = per(nodes + 1, &after, &before);
    let replicas = per(nodes + 2, &after, &before);
    for c in &mut children {
        let _ = c.start_kill();
        let _ = c.wait().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Costs { publish_nodes, publisher, drain_nodes, redis, replicas, workers, publish_rate, drain_rate }
}

fn line(what: &str, c: &Costs) {
    let list = |v: &[f64]| v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(" + ");
    let sum = |v: &[f64]| v.iter().sum::<f64>();
    println!(
        "scale    {what:<48} publish {:>6.0}/s: broker {} = {:.0} µs/job, publisher {:.0} µs   drain {:>6.0}/s: broker {} = {:.0} µs/job, redis {:.0} µs (+ replicas {:.0} µs), workers {:.0} µs",
        c.publish_rate,
        list(&c.publish_nodes),
        sum(&c.publish_nodes),
        c.publisher,
        c.drain_rate,
        list(&c.drain_nodes),
        sum(&c.drain_nodes),
        c.redis,
        c.replicas,
        c.workers,
    );
    // The check: this machine's two cores divided by what a job costs all processes.
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get()) as f64;
    let publish = sum(&c.publish_nodes) + c.publisher;
    let drain = sum(&c.drain_nodes) + c.redis + c.replicas + c.workers;
    println!(
        "check    {what:<48} {cores:.0} cores / CPU per job predict publish {:.0}/s (measured {:.0}/s, {:.2}x), drain {:.0}/s (measured {:.0}/s, {:.2}x)",
        cores * 1e6 / publish,
        c.publish_rate,
        c.publish_rate / (cores * 1e6 / publish),
        cores * 1e6 / drain,
        c.drain_rate,
        c.drain_rate / (cores * 1e6 / drain),
    );
}

/// What 100,000 jobs/s (enqueued and run) needs at the measured per-job costs, with every
/// process kept at 70 % of its cores.
fn model(c: &Costs) {
    const TARGET: f64 = 100_000.0;
    const UTIL: f64 = 0.7;
    let broker = c.publish_nodes.iter().sum::<f64>() + c.drain_nodes.iter().sum::<f64>();
    let redis = c.redis + c.replicas;
    let cores = |us: f64| TARGET * us / 1e6 / UTIL;
    let (b, m, r, w, p) = (cores(broker), cores(c.redis), cores(redis), cores(c.workers), cores(c.publisher));
    // A queue is one Raft leader: its node's share of a job, on one core.
    let leader = broker / c.publish_nodes.len() as f64;
    println!(
        "model    per core: broker {:.0} jobs/s (3 copies of each job), one queue's leader at most {:.0} jobs/s, Redis master {:.0} jobs/s, worker {:.0} jobs/s, publisher {:.0} jobs/s",
        1e6 / broker,
        1e6 / leader,
        1e6 / c.redis,
        1e6 / c.workers,
        1e6 / c.publisher
    );
    println!(
        "model    100,000 jobs/s at 70 % load: broker {b:.0} cores ({} nodes of 8 cores, quorum_replicas = 3), at least {} queues, Redis {m:.1} master cores = {} shards ({r:.1} cores with replicas), workers {w:.0} cores, publishers {p:.0} cores",
        (b / 8.0).ceil().max(3.0),
        (TARGET / (UTIL * 1e6 / leader)).ceil(),
        m.ceil()
    );
}
pub async fn scenario(c: &Ctx) {
    let n = 6_000 * c.o.seconds as usize;
    progress("scale: starting a private RabbitMQ node and Redis");
    let node = PrivateRabbit::start_erl(ERL_ARGS).await;
    let redis = PrivateRedis::start().await;
    progress(&format!("scale: one node, {n} jobs"));
    let single = run(
        &[node.url()],
        &[node.pid()],
        &format!("url = \"{}\"", redis.url()),
        &[redis.pid()],
        &[],
        None,
        n,
    )
    .await;
    drop(node);
    drop(redis);
    progress("scale: starting a 3-node RabbitMQ cluster and a 3-master Redis Cluster");
    let cluster = PrivateCluster::start_erl(3, Some(ERL_ARGS)).await;
    let rc = PrivateRedisCluster::start(3).await;
    let pids: Vec<u32> = cluster.nodes.iter().map(PrivateRabbit::pid).collect();
    let masters = rc.masters().await;
    let (mut redis_pids, mut replica_pids) = (Vec::new(), Vec::new());
    for (i, node) in rc.nodes.iter().enumerate() {
        if masters.contains(&i) { redis_pids.push(node.pid()) } else { replica_pids.push(node.pid()) }
    }
    progress(&format!("scale: 3 nodes, {n} jobs"));
    let redis_line = format!("url = \"redis://127.0.0.1/0\"\n{}", rc.config_line());
    let three = run(&cluster.urls(), &pids, &redis_line, &redis_pids, &replica_pids, Some(&cluster), n).await;
    progress("");

    line("1 node, 1 Redis", &single);
    line("3 nodes (quorum, 3 replicas), Redis Cluster 3x2", &three);
    model(&three);
}
