//! The same worker, ticker and CLI flow as over TLS (`tls::run_flow`: enqueue, a retry, a dead
//! letter, scheduled slots, status, inspect, history), on Redis behind Sentinel (through a
//! failover) and on a Redis Cluster (through a master's death). The fault suite
//! (`reliability_sentinel_*`, `reliability_redis_cluster_*`) counts what a failover costs
//! under load.

use std::time::Duration;

use chime_tests::{PrivateRedis, PrivateRedisCluster, PrivateSentinels};

use crate::common::*;
use crate::tls::{flow_jobs, run_flow};

/// `[redis]` lines for the test's prefix and broker, with `redis_lines` added.
fn config(env: &TestEnv, redis_url: &str, redis_lines: &str, ledger: &std::path::Path) -> String {
    format!(
        "prefix = \"{}\"\n[amqp]\nurl = \"{}\"\nqueue_type = \"quorum\"\n[redis]\nurl = \"{redis_url}\"\n{redis_lines}\
         [ticker]\nlease = \"2s\"\n{}",
        env.prefix,
        env.amqp_url,
        flow_jobs(ledger)
    )
}

#[tokio::test]
async fn worker_ticker_and_cli_run_on_redis_sentinel_across_a_failover() {
    let master = PrivateRedis::start().await;
    let sentinels = PrivateSentinels::start(master.port).await;
    let mut env = TestEnv::new("sentinel");
    env.redis_url = master.url();
    let ledger_path = env.dir.join("ledger");
    // The URL names no server (the sentinels do): it gives the scheme and the database.
    let text = config(&env, "redis://sentinel-named/0", &sentinels.config_lines(), &ledger_path);
    let path = env.write_config(&text);
    let (worker, ticker) = run_flow(&env, &path, &ledger_path, &[]).await;
    sentinels.failover().await;
    // After the failover: the same flow again, with new keys, on the promoted replica.
    let beats = |l: &[String]| l.iter().filter(|x| x.starts_with("beat ")).count();
    let before = beats(&ledger(&ledger_path));
    for job in ["ok", "flaky"] {
        let (code, out, err) = chime(&path, &["enqueue", job, "--key", &format!("{job}-after")], None);
        assert_eq!(code, 0, "enqueue {job} after the failover: {out}{err}");
    }
    let l = ledger_path.clone();
    wait_until("jobs and slots run after the failover", Duration::from_secs(60), || {
        let l = l.clone();
        async move {
            let lines = ledger(&l);
            lines.iter().filter(|x| x.starts_with("ok ")).count() >= 2
                && lines.iter().filter(|x| *x == "flaky 2").count() >= 2
                && beats(&lines) >= before + 3
        }
    })
    .await;
    let (code, out, err) = chime(&path, &["status", "--json"], None);
    assert_eq!(code, 0, "status after the failover: {err}");
    assert!(out.contains("\"leader\""), "{out}");
    // Every slot ran once: the ticker kept its lease (or handed it over) across the failover.
    let slots: Vec<String> = ledger(&ledger_path).into_iter().filter(|x| x.starts_with("beat ")).collect();
    let unique: std::collections::BTreeSet<&String> = slots.iter().collect();
    assert!(slots.len() - unique.len() <= 1, "at most one slot repeated by the failover: {slots:?}");
    drop((worker, ticker));
}

#[tokio::test]
async fn worker_ticker_and_cli_run_on_a_redis_cluster_across_a_master_death() {
    let mut cluster = PrivateRedisCluster::start(3).await;
    let mut env = TestEnv::new("rcluster");
    // Cleanup scans one node only; the cluster's data goes with its processes.
    env.redis_url = cluster.nodes[0].url();
    let ledger_path = env.dir.join("ledger");
    let text = config(&env, "redis://cluster-named/0", &cluster.config_line(), &ledger_path);
    let path = env.write_config(&text);
    let (worker, ticker) = run_flow(&env, &path, &ledger_path, &[]).await;
    let victim = cluster.masters().await[0];
    cluster.nodes[victim].kill();
    cluster.wait_ok().await;
    for i in 0..20 {
        let (code, out, err) = chime(&path, &["enqueue", "ok", "--key", &format!("after-{i}")], None);
        assert_eq!(code, 0, "enqueue after the master's death: {out}{err}");
    }
    let l = ledger_path.clone();
    wait_until("jobs on every slot run after the master's death", Duration::from_secs(60), || {
        let l = l.clone();
        async move { ledger(&l).iter().filter(|x| x.starts_with("ok ")).count() >= 21 }
    })
    .await;
    let (code, out, err) = chime(&path, &["status", "--json"], None);
    assert_eq!(code, 0, "status after the master's death: {err}");
    assert!(out.contains("\"leader\""), "{out}");
    drop((worker, ticker));
}

/// On a Redis Cluster a run's key and its rate bucket may live on two nodes: the rate
/// decision claims nothing there (the run claims on its own), for keys of every slot.
#[tokio::test]
async fn on_a_redis_cluster_the_rate_decision_leaves_the_claim_to_the_run() {
    use chime_shared::idempotency::Claim;
    use chime_shared::limit::ClaimWith;
    let cluster = PrivateRedisCluster::start(3).await;
    let mut env = TestEnv::new("rcluster-rate");
    env.redis_url = cluster.nodes[0].url();
    let config = env.config("classic", &cluster.config_line(), "", "");
    let store = chime_shared::idempotency::IdemStore::connect(&config.redis, env.names()).unwrap();
    let bucket = env.names().rate("b", "-");
    for i in 0..20 {
        let key = format!("k{i}");
        let with = ClaimWith { key: key.clone(), owner: format!("o{i}"), version: 1, attempt: 1 };
        let take = store.take_rate(bucket.clone(), 1, 1_000, None, Duration::ZERO, Some(with)).await;
        let take = take.unwrap_or_else(|e| panic!("rate decision for {key}: {e}"));
        assert!(take.admitted && take.wait.is_zero() && take.claim.is_none(), "{take:?}");
        let claim = store.claim(&key, &format!("o{i}")).await.unwrap();
        assert!(matches!(claim, Claim::Claimed { .. }), "{claim:?}");
    }
}
