//! A worker binary with a typed Rust handler. Run with a config whose job says
//! `handler = "send_invoice"`:
//!     cargo run -p chime-worker --example custom_handler -- examples/chime.toml
use chime_shared::Config;
use chime_worker::{JobContext, JobError, Registry, Worker, handler_fn};
use tokio_util::sync::CancellationToken;

#[derive(serde::Deserialize)]
struct Invoice {
    customer: String,
    cents: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    chime_shared::telemetry::init_tracing();
    let path = std::env::args().nth(1).unwrap_or_else(|| "chime.toml".into());
    let config = Config::load(Some(path.as_ref()))?;
    let mut registry = Registry::new();
    registry.register(
        "send_invoice",
        handler_fn(|ctx: JobContext, inv: Invoice| async move {
            if inv.cents == 0 {
                return Err(JobError::permanent("empty invoice"));
            }
            // Exactly-once effects: store ctx.key (unique) and ctx.fence in the same
            // transaction as the effect; a duplicate run then fails the unique index.
            println!(
                "invoice for {}: {} cents (key {}, attempt {}, fence {})",
                inv.customer, inv.cents, ctx.key, ctx.attempt, ctx.fence
            );
            Ok(())
        }),
    );
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        t.cancel();
    });
    Worker::builder(config).registry(registry).build()?.run(token).await?;
    Ok(())
}
