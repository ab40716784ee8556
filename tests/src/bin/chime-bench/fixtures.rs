//! What every scenario starts from: configs, prepared envelopes, purges, binaries.

use chime_producer::Prepared;
use chime_shared::config::ValidConfig;
use chime_shared::envelope::{self, Envelope, Source};
use chime_tests::*;
use lapin::Connection;
use lapin::options::QueuePurgeOptions;
use std::time::Duration;

pub fn bench_config(env: &TestEnv, queue_type: &str, worker: &str) -> ValidConfig {
    env.config(queue_type, "", worker, "[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n")
}

pub fn envelopes(n: usize, same_keys: bool) -> Vec<Prepared> {
    (0..n)
        .map(|i| {
            let key = if same_keys {
                envelope::adhoc_key("noop", &(i / 2).to_string())
            } else {
                envelope::random_key()
            };
            Prepared {
                envelope: Envelope::new(
                    "noop",
                    "default",
                    key,
                    serde_json::json!({"i": i}),
                    None,
                    3,
                    Source::Adhoc,
                ),
                delay: Duration::ZERO,
                unverified_queue: None,
                declare_queue: None,
            }
        })
        .collect()
}

pub async fn purge(conn: &Connection, queue: &str) {
    let ch = conn.create_channel().await.unwrap();
    let _ = ch.queue_purge(queue.into(), QueuePurgeOptions::default()).await;
}

pub fn bin_path(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().join(name)
}

/// Bytes of Redis memory `key` takes, every element counted (`MEMORY USAGE … SAMPLES 0`).
pub async fn memory_usage(r: &mut redis::aio::MultiplexedConnection, key: &str) -> u64 {
    redis::cmd("MEMORY").arg("USAGE").arg(key).arg("SAMPLES").arg(0).query_async(r).await.unwrap()
}
