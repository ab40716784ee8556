//! Opt-in `traces`: what traces cost a `chime-worker`. One worker drains a queue of noop jobs
//! with traces off (no `[telemetry] otlp_endpoint`) and on (every run's span exported to a
//! local OTLP receiver), and, with
//! `BENCH_WORKER_BEFORE=/path/to/chime-worker`, a build without trace support: the rounds
//! interleaved, medians and ratios to "off" printed. The rate is taken after the first 1,000
//! jobs (startup excluded); success logs are off (`log.success_sample = 0`) in every variant.

use crate::Ctx;
use crate::consume::completed;
use crate::fixtures::*;
use crate::measure::*;
use chime_producer::EnqueueClient;
use chime_tests::*;
use std::time::{Duration, Instant};

const JOBS: usize = 30_000;
const WARM: u64 = 1_000;

pub async fn scenario(c: &Ctx) {
    let (otlp, posts) = chime_tests::otlp::receiver().await;
    let this = bin_path("chime-worker");
    let mut variants: Vec<(&str, std::path::PathBuf, Option<u16>)> =
        vec![("off", this.clone(), None), ("on (OTLP)", this, Some(otlp))];
    if let Ok(before) = std::env::var("BENCH_WORKER_BEFORE") {
        variants.push(("before traces", before.into(), None));
    }
    println!("\n== traces: one chime-worker draining {JOBS} noop jobs ({} queues)", c.o.queue_type);
    let mut rates = vec![Vec::new(); variants.len()];
    let mut cpus = vec![Vec::new(); variants.len()];
    for round in 0..c.o.runs {
        for (i, (name, bin, endpoint)) in variants.iter().enumerate() {
            let (rate, cpu_us) = drain(bin, *endpoint, &c.o.queue_type).await;
            println!("round {round}: {name:<14} {rate:>8.0} jobs/s  {cpu_us:>6.1} µs worker CPU per job");
            rates[i].push(rate);
            cpus[i].push(cpu_us);
        }
    }
    let (off_rate, off_cpu) = (median(rates[0].clone()), median(cpus[0].clone()));
    for (i, (name, _, _)) in variants.iter().enumerate() {
        let (r, cpu) = (median(rates[i].clone()), median(cpus[i].clone()));
        println!(
            "median   {name:<14} {r:>8.0} jobs/s ({:.2}× off)  {cpu:>6.1} µs CPU per job ({:.2}× off)",
            r / off_rate,
            cpu / off_cpu
        );
    }
    println!("the receiver took {} export requests", posts.lock().unwrap().len());
}

/// Publishes the jobs, starts the worker, and returns its drain rate and CPU per job past the
/// first [`WARM`] jobs.
async fn drain(bin: &std::path::Path, otlp: Option<u16>, queue_type: &str) -> (f64, f64) {
    let env = TestEnv::new("bench-traces");
    let telemetry =
        otlp.map(|p| format!("[telemetry]\notlp_endpoint = \"http://127.0.0.1:{p}\"\n")).unwrap_or_default();
    let jobs =
        format!("[log]\nsuccess_sample = 0.0\n{telemetry}[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n");
    let text = env.config_text(queue_type, "", "", &jobs);
    let path = env.write_config(&text);
    let config = chime_shared::config::Config::from_toml_str(&text).unwrap();
    let client = EnqueueClient::connect(config).await.unwrap();
    assert_eq!(client.publish_batch(&envelopes(JOBS, false)).await.confirmed, JOBS);
    let port = free_port();
    let log = std::fs::File::create(env.dir.join("worker.log")).unwrap();
    let mut child = tokio::process::Command::new(bin)
        .arg("--config")
        .arg(&path)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let start = Instant::now();
    let mut mark: Option<(Instant, u64, f64)> = None;
    let result = loop {
        let done = completed(&[port]).await;
        if mark.is_none() && done >= WARM {
            mark = Some((Instant::now(), done, cpu_secs(pid)));
        }
        if done >= JOBS as u64
            && let Some((t0, d0, c0)) = mark
        {
            let n = (done - d0) as f64;
            break (n / t0.elapsed().as_secs_f64(), (cpu_secs(pid) - c0) * 1e6 / n);
        }
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(env.dir.join("worker.log")).unwrap_or_default();
            panic!("the worker exited ({status}) during the drain:\n{log}");
        }
        assert!(start.elapsed() < Duration::from_secs(300), "traces drain stalled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let _ = child.start_kill();
    let _ = child.wait().await;
    drop(client);
    result
}
