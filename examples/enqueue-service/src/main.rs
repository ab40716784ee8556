//! A service that only enqueues: `enqueue-service CUSTOMER CENTS [COUNT]` sends COUNT invoices
//! (keys `CUSTOMER-0`, `CUSTOMER-1`, …) and prints one confirmed key a line. The config comes
//! from `$CHIME_CONFIG` (else `./chime.toml`); `send_invoice` needs no `[[jobs]]` entry.

use chime_producer::{EnqueueClient, EnqueueRequest};
use invoice_jobs::SendInvoice;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let customer = args.next().ok_or("usage: enqueue-service CUSTOMER CENTS [COUNT]")?;
    let cents: u64 = args.next().ok_or("CENTS missing")?.parse()?;
    let count: usize = args.next().map(|n| n.parse()).transpose()?.unwrap_or(1);
    let client = EnqueueClient::connect(chime_shared::Config::load(None)?).await?;
    for i in 0..count {
        let invoice = SendInvoice { customer: customer.clone(), cents };
        // A typed job; the key makes a retry of this request harmless.
        let done = client.enqueue(EnqueueRequest::job(&invoice).key(format!("{customer}-{i}"))).await?;
        println!("{}", done.key);
    }
    Ok(())
}
