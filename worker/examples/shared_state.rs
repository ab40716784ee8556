//! A typed job whose handler uses shared state — here a connection pool stand-in — registered
//! once and handed to every run (no clone in your code).
//!
//!     CHIME_CONFIG=examples/chime.toml cargo run -p chime-worker --example shared_state

use chime_worker::{Job, JobContext, JobError, Registry, State, Worker};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio_util::sync::CancellationToken;

#[derive(serde::Serialize, serde::Deserialize)]
struct RecordVisit {
    page: String,
}

impl Job for RecordVisit {
    const NAME: &'static str = "record_visit";
}

/// What a pool is to a real service: cheap to clone, shared by all runs.
#[derive(Clone, Default)]
struct Db {
    visits: Arc<AtomicU64>,
}

async fn record_visit(ctx: JobContext, visit: RecordVisit, State(db): State<Db>) -> Result<(), JobError> {
    let n = db.visits.fetch_add(1, Ordering::Relaxed) + 1;
    println!("visit {n} of {} (key {})", visit.page, ctx.key());
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = chime_shared::Config::load(None)?;
    let mut registry = Registry::new();
    registry.state(Db::default()).job(record_visit);
    let token = CancellationToken::new();
    let stop = token.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    Worker::builder(config).registry(registry).build()?.run(token).await?;
    Ok(())
}
