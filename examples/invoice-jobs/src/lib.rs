//! The job types of the invoice example, in their own small crate: the service that enqueues
//! them and the worker that runs them both depend on it, so the two always agree on the name,
//! the payload and the options.

use chime_job::{Job, JobOptions};
use std::time::Duration;

/// Send an invoice to a customer.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SendInvoice {
    /// Whom to bill.
    pub customer: String,
    /// How much, in cents; 0 is refused (a permanent failure).
    pub cents: u64,
}

impl Job for SendInvoice {
    const NAME: &'static str = "send_invoice";
    fn options() -> JobOptions {
        JobOptions::default().queue("invoices").max_attempts(3).timeout(Duration::from_secs(30))
    }
}
