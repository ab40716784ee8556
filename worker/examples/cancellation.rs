//! A long job that stops cleanly: on timeout, at the drain deadline, or when another owner
//! takes its key over, `ctx.cancelled()` resolves first; the handler then has
//! `worker.cancel_grace` to save its progress and return before its future is dropped.
//!
//!     CHIME_CONFIG=examples/chime.toml cargo run -p chime-worker --example cancellation

use chime_worker::{Job, JobContext, JobError, JobOptions, Registry, Worker};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(serde::Serialize, serde::Deserialize)]
struct Reindex {
    batches: u32,
}

impl Job for Reindex {
    const NAME: &'static str = "reindex";
    fn options() -> JobOptions {
        JobOptions::default().timeout(Duration::from_secs(60))
    }
}

async fn reindex(ctx: JobContext, job: Reindex) -> Result<(), JobError> {
    for batch in 0..job.batches {
        tokio::select! {
            _ = ctx.cancelled() => {
                println!("stopping after {batch} batches; the retry starts from there");
                return Err(JobError::transient(format!("cancelled after {batch} batches")));
            }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = chime_shared::Config::load(None)?;
    let mut registry = Registry::new();
    registry.job(reindex);
    let token = CancellationToken::new();
    let stop = token.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    Worker::builder(config).registry(registry).build()?.run(token).await?;
    Ok(())
}
