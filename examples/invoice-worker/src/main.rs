//! A custom worker binary: `invoice-worker LEDGER` runs `send_invoice` jobs, appending one
//! line a run to LEDGER (standing in for a database: the shared state every handler gets).
//! The config comes from `$CHIME_CONFIG` (else `./chime.toml`). Ctrl-C or SIGTERM drains.

use chime_worker::{JobContext, JobError, Registry, State, Worker};
use invoice_jobs::SendInvoice;
use std::io::Write;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// The "database": cheap to clone, shared by every run.
#[derive(Clone)]
struct Ledger(Arc<Mutex<std::fs::File>>);

async fn send_invoice(
    ctx: JobContext,
    invoice: SendInvoice,
    State(ledger): State<Ledger>,
) -> Result<(), JobError> {
    if invoice.cents == 0 {
        return Err(JobError::permanent("an invoice of 0 cents")); // straight to the DLQ
    }
    // Exactly-once effects: store the key with the effect, under a unique constraint.
    let line = format!("{} {} {} {}\n", ctx.key(), invoice.customer, invoice.cents, ctx.attempt());
    let mut file = ledger.0.lock().map_err(|_| JobError::transient("ledger lock poisoned"))?;
    file.write_all(line.as_bytes())?; // an io::Error: transient, retried
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: invoice-worker LEDGER")?;
    let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    let config = chime_shared::Config::load(None)?;
    let mut registry = Registry::new();
    registry.state(Ledger(Arc::new(Mutex::new(file)))).job(send_invoice);
    let token = CancellationToken::new();
    let stop = token.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { if let Some(t) = term.as_mut() { t.recv().await; } } => {}
        }
        stop.cancel();
    });
    Worker::builder(config).registry(registry).build()?.run(token).await?;
    Ok(())
}
