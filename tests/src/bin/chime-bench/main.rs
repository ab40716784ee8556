//! chime-bench: throughput and latency of chime against a raw lapin + redis baseline measured
//! in the same run, on the same broker and Redis. Prints medians and ratios; asserts nothing.
//!
//! ```text
//! cargo run --release -p chime-tests --bin chime-bench -- [--queue-type quorum|classic]
//!     [--runs 3] [--seconds 10] [--only SCENARIO,…] [--workers 1,2,4]
//!     [--latency-rates 1000,2000] [--offer 1000]
//! ```
//!
//! Scenarios: publish (raw vs EnqueueClient), consume (raw per-message ack + chime's 2 scripts,
//! or 2 plain SETs, vs 1/2/4 chime-worker processes), latency (enqueue → handler start at
//! steady rates), duplicates, ticker (100,000 schedules); opt-in: publish-cli (`chime enqueue
//! --batch` against a plain lapin program, whole processes, many rotated rounds), properties (the broker's
//! cost of each AMQP property of the envelope), history (the run history's cost on the drain
//! rate, and its memory per event), web (the dashboard's page times over 1,000,000 history
//! events and 10,000 dead letters), probes (`/livez` idle and under a connection flood),
//! limits (a rate limit's accuracy across 4 workers, tenant isolation, the cost of limits and
//! circuits, a circuit over a failing downstream; `limits-broker`: the broker's own floor under
//! the tenants' flood, no chime process), traces (a worker's drain with traces off,
//! on, and before trace support), spool (enqueue with the spool on and off, spooling and
//! flushing rates, a producer's memory while it spools 1 GiB), allocs (allocations per job of
//! the enqueue client and of an in-process worker, unpacked and packed), queue-types (raw lapin
//! through quorum and classic queues: the broker's CPU per message published and drained),
//! shards (a 1,000-shard job's runs sent one member per message, or packed 10 and 100 to a
//! message by `jobs[].pack`: enqueue to last member done through one default worker).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod allocs;
mod consume;
mod fixtures;
mod latency;
mod limits;
mod measure;
mod probes;
mod publish;
mod queues;
mod scale;
mod shards;
mod spool;
mod ticker;
mod traces;
mod web;

use chime_tests::connect_amqp;
use lapin::Connection;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// The system allocator, counting allocations (and reallocations) for the `allocs` scenario.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed to the system allocator unchanged; the counter is an atomic.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations (and reallocations) made by this process so far.
pub fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// Throughput and latency of chime against raw lapin + redis (see the file header).
#[derive(clap::Parser)]
pub struct Opts {
    /// Queue type of the work queues.
    #[arg(long, default_value = "quorum", value_parser = ["quorum", "classic"])]
    pub queue_type: String,
    /// Runs per figure (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Length of each measured run.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Scenarios to run (default: all but the opt-in ones).
    #[arg(long, value_delimiter = ',')]
    pub only: Option<Vec<String>>,
    /// Worker process counts of the consume scenario.
    #[arg(long = "workers", value_delimiter = ',', default_value = "1,2,4")]
    pub procs: Vec<usize>,
    /// Extra offered rates the latency scenario measures (beside 25/50/80 % of the capacity).
    #[arg(long = "latency-rates", value_delimiter = ',')]
    pub rates: Vec<u64>,
    /// Jobs a second offered to the 200/s limit of the `limits-rate` scenario.
    #[arg(long, default_value_t = 1000)]
    pub offer: usize,
    /// `worker.park_pack` of the `limits-rate` and `limits-tenants` scenarios' workers (1: each parked copy alone).
    #[arg(long, default_value_t = 100)]
    pub park_pack: usize,
}

/// What every scenario reads: the options and one connection to the shared broker.
pub struct Ctx {
    pub o: Opts,
    pub conn: Connection,
    /// One worker's saturated drain rate, when `consume` ran first.
    pub saturated: Option<f64>,
}

impl Ctx {
    /// A scenario of the default set, unless `--only` leaves it out.
    pub fn want(&self, s: &str) -> bool {
        self.o.only.as_ref().is_none_or(|v| v.iter().any(|x| x == s))
    }
    /// An opt-in scenario: only when `--only` names it.
    pub fn opted(&self, s: &str) -> bool {
        self.o.only.as_ref().is_some_and(|v| v.iter().any(|x| x == s))
    }
}

#[tokio::main]
pub async fn main() {
    // The latency scenario's worker runs as a child process of this binary.
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("latency-worker") {
        latency::worker_main(&args[2]).await;
        return;
    }
    // The raw consumer on its own, for profiling beside a chime-worker:
    // chime-bench raw-consume QUEUE N [sets]
    if args.get(1).map(String::as_str) == Some("raw-consume") {
        let conn = connect_amqp().await;
        let mode = if args.get(4).is_some_and(|m| m == "sets") {
            consume::RawRedis::Sets
        } else {
            consume::RawRedis::Scripts
        };
        let n: u64 = args[3].parse().unwrap();
        // Its keys live under a prefix of its own, removed at the end.
        let env = chime_tests::TestEnv::new("bench-raw");
        let (rate, cpu, w) =
            consume::raw_consume(&conn, &args[2], n, 32, &env.redis_url, &env.prefix, mode).await;
        println!("{rate:.0} msg/s  {}  {w:?}", measure::cpu_text(cpu));
        return;
    }
    // A plain lapin publisher as a program of its own, timed as a whole process beside `chime
    // enqueue --batch`: chime-bench raw-publish-file EXCHANGE ROUTING_KEY FILE [contract]
    if args.get(1).map(String::as_str) == Some("raw-publish-file") {
        let plain = match args.get(5).map(String::as_str) {
            Some("contract") => publish::Plain::Contract,
            _ => publish::Plain::Bare,
        };
        let n = publish::raw_publish_file(&args[2], &args[3], std::path::Path::new(&args[4]), plain).await;
        println!("{n}");
        return;
    }
    let o = <Opts as clap::Parser>::parse();
    println!("chime-bench: queue type {}, {} run(s) of ~{}s each, medians", o.queue_type, o.runs, o.seconds);
    let conn = connect_amqp().await;
    let mut c = Ctx { o, conn, saturated: None };
    if c.want("publish") {
        publish::scenario(&c).await;
    }
    if c.opted("queue-types") {
        queues::scenario(&c).await;
    }
    if c.opted("baseline") {
        publish::baseline(&c).await;
    }
    if c.want("defaults") {
        consume::defaults(&c).await;
    }
    if c.opted("publish-cli") {
        publish::cli_rounds(&c).await;
    }
    if c.opted("batch-memory") {
        publish::batch_memory(&c).await;
    }
    if c.opted("properties") {
        publish::properties(&c).await;
    }
    if c.want("consume") {
        c.saturated = consume::scenario(&c).await;
    }
    if c.opted("history") {
        consume::history(&c).await;
    }
    if c.o.only.as_ref().is_some_and(|v| v.iter().any(|s| s.starts_with("limits"))) {
        limits::scenario(&c).await;
    }
    if c.opted("shards") {
        shards::scenario(&c).await;
    }
    if c.opted("scale") {
        scale::scenario(&c).await;
    }
    if c.opted("web") {
        web::web_pages(&c.o.queue_type).await;
    }
    if c.opted("probes") {
        probes::scenario(c.o.runs).await;
    }
    if c.opted("spool") {
        spool::scenario(&c).await;
    } else if c.opted("spool-big") {
        spool::big(&c.o.queue_type).await;
    }
    if c.opted("traces") {
        traces::scenario(&c).await;
    }
    if c.opted("allocs") {
        allocs::scenario(&c).await;
    }
    if c.opted("priority") {
        latency::priority(&c).await;
    }
    if c.want("latency") {
        latency::scenario(&c).await;
    }
    if c.want("ticker") {
        ticker::scenario(&c).await;
    }
    let _ = c.conn.close(200, "".into()).await;
}
