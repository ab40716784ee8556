//! The fault-injection suite (tests/src/reliability.rs), each scenario a test: lost = 0,
//! duplicate effects = 0, duplicate executions within the scenario's bound.
//! `cargo run -p chime-tests --bin chime-reliability` runs them all and prints the table.

use chime_tests::reliability::{self, Outcome, TABLE_HEAD};

fn check(o: Outcome) {
    println!("{TABLE_HEAD}\n{}\n{}", o.row(), o.note);
    assert!(o.passed(), "{}", o.row());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_worker_sigkill() {
    check(reliability::worker_sigkill().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_worker_sigterm() {
    check(reliability::worker_sigterm().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_leader_sigkill() {
    check(reliability::leader_sigkill().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_all_tickers_down() {
    check(reliability::all_tickers_down().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_broker_restart() {
    check(reliability::broker_restart().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_broker_frozen() {
    check(reliability::broker_frozen().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_redis_restarted_empty() {
    check(reliability::redis_restarted_empty().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_redis_frozen() {
    check(reliability::redis_frozen().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_poison_and_timeouts() {
    check(reliability::poison_and_timeouts().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_duplicate_publishes() {
    check(reliability::duplicate_publishes().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_dlq_replay() {
    check(reliability::dlq_replay().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_sentinel_failover_drain() {
    check(reliability::sentinel_failover_drain().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_sentinel_master_killed() {
    check(reliability::sentinel_master_killed().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_sentinel_failover_ticker() {
    check(reliability::sentinel_failover_ticker().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_redis_cluster_master_killed() {
    check(reliability::redis_cluster_master_killed().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_cluster_leader_killed() {
    check(reliability::cluster_leader_killed().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_handler_panic() {
    check(reliability::handler_panic().await);
}

/// 2–3 minutes of wall clock: run by `chime-reliability` (and `cargo test -- --ignored`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn reliability_consumer_timeout() {
    check(reliability::consumer_timeout().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_long_jobs_redis_restarted_empty() {
    check(reliability::long_jobs_redis_restarted_empty().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_redis_failover_to_lagging_replica() {
    check(reliability::redis_failover_to_lagging_replica().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_connection_closed_while_failing() {
    check(reliability::connection_closed_while_failing().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_dead_exchange_missing() {
    check(reliability::dead_exchange_missing().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_memory_alarm() {
    check(reliability::memory_alarm().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_ticker_clock_skew() {
    check(reliability::ticker_clock_skew().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_rolling_deploy() {
    check(reliability::rolling_deploy().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliability_sigkill_loop() {
    check(reliability::sigkill_loop().await);
}
