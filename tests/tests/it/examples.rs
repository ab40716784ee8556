//! The typed API end to end: `examples/enqueue-service` (a service that depends on
//! chime-producer alone) enqueues `SendInvoice` jobs that `examples/invoice-worker` (a custom
//! worker binary with shared state) runs — neither with a `[[jobs]]` entry.

use std::process::Stdio;
use std::time::Duration;

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_service_enqueues_and_a_custom_worker_runs_the_jobs() {
    let mut env = TestEnv::new("examples");
    env.queues.push("invoices".into());
    let path = env.write_config(&env.config_text("quorum", "", "", ""));
    let ledger = env.dir.join("ledger");
    let mut worker = tokio::process::Command::new(bin("invoice-worker"))
        .arg(&ledger)
        .env("CHIME_CONFIG", &path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let enqueue = |customer: &str, cents: &str, count: &str| {
        std::process::Command::new(bin("enqueue-service"))
            .args([customer, cents, count])
            .env("CHIME_CONFIG", &path)
            .output()
            .unwrap()
    };
    let out = enqueue("acme", "1250", "20");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let keys: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(keys.len(), 20);
    let l = ledger.clone();
    wait_until("20 invoices sent", Duration::from_secs(60), || {
        let l = l.clone();
        async move { crate::common::ledger(&l).len() >= 20 }
    })
    .await;
    let lines = crate::common::ledger(&ledger);
    for key in &keys {
        assert_eq!(
            lines.iter().filter(|l| l.starts_with(key.as_str())).count(),
            1,
            "{key} ran once: {lines:?}"
        );
    }
    assert!(lines.iter().all(|l| l.contains(" acme 1250 ")), "{lines:?}");
    // The same request again is absorbed (same keys); a 0-cent invoice fails for good.
    assert!(enqueue("acme", "1250", "20").status.success());
    assert!(enqueue("zero", "0", "1").status.success());
    wait_until("the 0-cent invoice dead-lettered", Duration::from_secs(30), || async {
        depth(&env.names().dlq("invoices")).await == 1
    })
    .await;
    assert_eq!(crate::common::ledger(&ledger).len(), 20, "duplicates absorbed");
    signal_pid(worker.id().unwrap(), 15);
    let status = tokio::time::timeout(Duration::from_secs(60), worker.wait()).await.unwrap().unwrap();
    assert!(status.success(), "drained and exited cleanly");
}
