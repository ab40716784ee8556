//! Runs the whole fault-injection suite and prints the RELIABILITY.md table.
//!
//!     cargo build --workspace --bins && cargo run -p chime-tests --bin chime-reliability
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let outcomes = chime_tests::reliability::all().await;
    println!("{}", chime_tests::reliability::TABLE_HEAD);
    for o in &outcomes {
        println!("{}", o.row());
    }
    let failed = outcomes.iter().filter(|o| !o.passed()).count();
    println!("\n{} passed, {} failed", outcomes.len() - failed, failed);
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
