//! The ticker at 100,000 schedules.

use crate::Ctx;
use crate::fixtures::*;
use crate::measure::*;
use chime_shared::config::JobConfig;
use chime_shared::envelope::Envelope;
use chime_tests::*;
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use std::time::{Duration, Instant};

/// 100,000 schedules in an in-process ticker; a raw consumer timestamps each delivery
/// against its slot. `hourly`: one slot per job per hour, spread over the 3,600 seconds
/// (about 28 due per second); otherwise one per minute (about 1,667 due per second).
pub async fn ticker(
    env: &TestEnv,
    queue_type: &str,
    secs: u64,
    hourly: bool,
) -> (usize, f64, f64, f64, u64, f64) {
    let mut config = bench_config(env, queue_type, "").into_config();
    config.ticker.lease = Duration::from_secs(10);
    let template: JobConfig =
        toml::from_str("name = \"x\"\nhandler = \"noop\"\nschedule = \"0 * * * * *\"\ncatch_up = \"none\"\n")
            .unwrap();
    config.jobs.clear();
    for i in 0..100_000u32 {
        let mut j = template.clone();
        j.name = format!("s{i}");
        j.schedule = Some(if hourly {
            format!("{} {} * * * *", i % 60, (i / 60) % 60)
        } else {
            format!("{} * * * * *", i % 60)
        });
        config.jobs.push(j);
    }
    let names = env.names();
    let conn = connect_amqp().await;
    // Declare first so the consumer can attach before the first slot.
    chime_shared::topology::declare(&conn, &config, &["default".into()]).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(1000, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            names.work_queue("default").as_str().into(),
            "lag".into(),
            BasicConsumeOptions { no_ack: true, ..Default::default() },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let lags = latencies();
    let l = lags.clone();
    let reader = tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let now = chrono::Utc::now();
            if let Ok(e) = Envelope::decode(&d.data)
                && let Some(slot) = e.slot
            {
                l.lock()
                    .unwrap()
                    .saturating_record((now - slot).num_microseconds().unwrap_or(0).max(1) as u64);
            }
        }
    });
    let (tx, rx) = tokio::sync::watch::channel(config.validated().unwrap());
    let pid = std::process::id();
    let rss_before = rss_kb(pid);
    let planning = Instant::now();
    let token = tokio_util::sync::CancellationToken::new();
    let t = chime_scheduler::ticker::Ticker::new(
        rx,
        format!("bench:{pid}"),
        chime_shared::health::Health::default(),
    )
    .unwrap();
    let run = tokio::spawn(t.run(token.clone()));
    // Measure a steady window after the first slot arrives.
    wait_until("first slot delivered", Duration::from_secs(60), || {
        let l = lags.clone();
        async move { !l.lock().unwrap().is_empty() }
    })
    .await;
    let plan_secs = planning.elapsed().as_secs_f64();
    lags.lock().unwrap().reset();
    let cpu0 = cpu_secs(pid);
    let start = Instant::now();
    let mut rss_peak = 0;
    while start.elapsed() < Duration::from_secs(secs) {
        rss_peak = rss_peak.max(rss_kb(pid));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let cpu = (cpu_secs(pid) - cpu0) / start.elapsed().as_secs_f64();
    token.cancel();
    let _ = run.await;
    drop(tx);
    reader.abort();
    let h = lags.lock().unwrap().clone();
    let n = h.len() as usize;
    let _ = conn.close(200, "".into()).await;
    (
        n,
        quantile_ms(&h, 0.5),
        quantile_ms(&h, 0.99),
        cpu * 100.0,
        rss_peak.saturating_sub(rss_before),
        plan_secs,
    )
}

/// `ticker`: 100,000 hourly, then every-minute, schedules.
pub async fn scenario(c: &Ctx) {
    let qt = c.o.queue_type.clone();
    let secs = c.o.seconds;
    for (hourly, shape) in [(true, "hourly, ~28 due/s"), (false, "every minute, ~1,667 due/s")] {
        let env = TestEnv::new("bench-tick");
        progress(&format!("ticker: 100,000 schedules ({shape})"));
        let (n, p50, p99, cpu, rss, plan) = ticker(&env, &qt, secs.max(20), hourly).await;
        progress("");
        println!(
            "ticker   100,000 schedules ({shape}): planned and first slot in {plan:.1}s; {n} slots measured; \
             slot → delivered p50 {p50:.1} ms, p99 {p99:.1} ms; CPU {cpu:.0}% of a core (ticker + lag consumer); RSS +{} MiB",
            rss / 1024
        );
    }
}
