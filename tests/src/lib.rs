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
    wait_for_state(what, timeout, || {
        let answer = pred();
        async move { if answer.await { Ok(()) } else { Err("not yet".into()) } }
    })
    .await;
}

/// Waits until `check` answers `Ok`, polling every 20 ms; after `timeout` panics with `what`
/// and the last state `check` described in its `Err`, so a timeout says what was missing.
pub async fn wait_for_state<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = None;
    loop {
        // A check that hangs (say, a connect that never completes) must not outlive the
        // deadline: each call gets at most the time that is left.
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        match tokio::time::timeout(left, check()).await {
            Ok(Ok(())) => return,
            Ok(Err(state)) => last = Some(state),
            // Keep the state the last complete check described.
            Err(_) => {}
        }
        if Instant::now() >= deadline {
            let last = last.unwrap_or_else(|| "no check completed".into());
            panic!("timed out after {timeout:?} waiting for: {what}; last state: {last}");
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
pub mod otlp;
pub mod probes;
pub mod proxy;
pub mod reliability;
pub mod tls;
pub mod webdriver;

mod env;
mod processes;
mod rabbit_servers;
mod redis_servers;

pub use env::*;
pub use processes::*;
pub use rabbit_servers::*;
pub use redis_servers::*;

/// A free TCP port on loopback (bound once, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
