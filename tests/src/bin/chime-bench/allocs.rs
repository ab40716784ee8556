//! Allocations per job (opt-in `allocs`), counted by this binary's global allocator: of the
//! enqueue client publishing 20,000 prepared jobs (one message each, and in packs of 100), and
//! of an in-process worker with the default settings draining them, from its start (connect,
//! declare: a few thousand allocations, spread over the jobs) to the last job done.

use crate::Ctx;
use crate::fixtures::{bench_config, envelopes};
use chime_producer::EnqueueClient;
use chime_tests::*;
use chime_worker::{JobError, Registry, Stats, Worker, raw_handler_fn};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const JOBS: usize = 20_000;

pub async fn scenario(c: &Ctx) {
    for pack in [None, Some(100)] {
        let (mut publish, mut drain, mut rates) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..c.o.runs {
            let env = TestEnv::new("bench-allocs");
            let config = bench_config(&env, &c.o.queue_type, "");
            let client = EnqueueClient::connect(config.clone()).await.unwrap();
            let envs = envelopes(JOBS, false);
            let before = crate::allocations();
            let report = match pack {
                None => client.publish_batch(&envs).await,
                Some(n) => client.send_packed(&envs, n).await,
            };
            publish.push((crate::allocations() - before) as f64 / JOBS as f64);
            assert!(report.error.is_none() && report.confirmed == JOBS, "{:?}", report.error);
            drop(envs);
            let mut registry = Registry::new();
            registry.register("noop", raw_handler_fn(|_, _| async { Ok::<_, JobError>(()) }));
            let worker = Worker::builder(config).registry(registry).build().unwrap();
            let stats = worker.stats();
            let token = CancellationToken::new();
            let before = crate::allocations();
            let started = Instant::now();
            let running = tokio::spawn(worker.run(token.clone()));
            let s = stats.clone();
            wait_until("the drain", Duration::from_secs(300), || {
                let s = s.clone();
                async move { Stats::get(&s.succeeded) >= JOBS as u64 }
            })
            .await;
            drain.push((crate::allocations() - before) as f64 / JOBS as f64);
            rates.push(JOBS as f64 / started.elapsed().as_secs_f64());
            token.cancel();
            let _ = running.await;
        }
        let how = match pack {
            None => "one message per job".to_string(),
            Some(n) => format!("packs of {n}"),
        };
        println!(
            "allocs   {how:<20} publish {:>6.1} allocations/job   in-process worker drain {:>6.1} allocations/job ({:.0} jobs/s)",
            crate::measure::median(publish),
            crate::measure::median(drain),
            crate::measure::median(rates),
        );
    }
}
