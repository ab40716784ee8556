//! Opt-in `shards`: a sharded job's runs, their members sent one per message or packed
//! (`jobs[].pack`), from the enqueue to the last member done, through one default
//! chime-worker.

use crate::Ctx;
use crate::consume::{completed, wait_ready};
use crate::measure::*;
use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_tests::*;
use std::time::{Duration, Instant};

/// Shards of the job: a run is this many members.
const SHARDS: usize = 1_000;

/// One variant's figures over the rounds.
#[derive(Default)]
struct Runs {
    publish: Vec<f64>,
    done: Vec<f64>,
    ratios: Vec<f64>,
    cpu: Vec<[f64; 3]>,
}

/// `runs` runs of the sharded `noop` job (packed by `pack`), enqueued one after the other by
/// one client while one chime-worker with default settings runs them: members a second
/// published (enqueue calls confirmed), members a second done (from the first enqueue to the
/// last member done), and CPU per member of the broker, Redis and the worker.
async fn one(env: &TestEnv, queue_type: &str, pack: Option<usize>, runs: usize) -> (f64, f64, [f64; 3]) {
    let pack_line = pack.map(|n| format!("pack = {n}\n")).unwrap_or_default();
    let jobs = format!("[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\nshards = {SHARDS}\n{pack_line}");
    let text = env.config_text(queue_type, "", "", &jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let port = free_port();
    let mut worker = tokio::process::Command::new(crate::fixtures::bin_path("chime-worker"))
        .arg("--config")
        .arg(&path)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_ready(&[port]).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let members = (runs * SHARDS) as u64;
    let before = completed(&[port]).await;
    let cpu = CpuWindow::start(worker.id().into_iter().collect());
    let start = Instant::now();
    for _ in 0..runs {
        let done = client.enqueue(EnqueueRequest::new("noop")).await.unwrap();
        assert_eq!(done.members.len(), SHARDS);
    }
    let published = start.elapsed().as_secs_f64();
    loop {
        let done = completed(&[port]).await - before;
        if done >= members {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(600), "stalled at {done} of {members} members");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let total = start.elapsed().as_secs_f64();
    let cpu = cpu.per_message(members);
    drop(client);
    let _ = worker.start_kill();
    let _ = worker.wait().await;
    (members as f64 / published, members as f64 / total, cpu)
}

pub async fn scenario(c: &Ctx) {
    let qt = c.o.queue_type.clone();
    let runs = (2 * c.o.seconds as usize).max(2);
    let env = TestEnv::new("bench-shards");
    let variants: [(&str, Option<usize>); 3] =
        [("one member per message", None), ("pack = 10", Some(10)), ("pack = 100", Some(100))];
    let mut all: Vec<Runs> = variants.iter().map(|_| Runs::default()).collect();
    for r in 0..c.o.runs {
        let mut round = [0.0; 3];
        for k in 0..variants.len() {
            let i = (k + r) % variants.len();
            progress(&format!(
                "shards: {} runs of {SHARDS} shards, {}, run {}/{}",
                runs,
                variants[i].0,
                r + 1,
                c.o.runs
            ));
            let (publish, done, cpu) = one(&env, &qt, variants[i].1, runs).await;
            round[i] = done;
            all[i].publish.push(publish);
            all[i].done.push(done);
            all[i].cpu.push(cpu);
        }
        for (i, rate) in round.iter().enumerate() {
            all[i].ratios.push(rate / round[0]);
        }
    }
    progress("");
    for ((name, _), r) in variants.iter().zip(all) {
        let cpu = median3(&r.cpu);
        println!(
            "shards   {runs} runs of {SHARDS} shards, {name:<24} published {:>7.0} members/s   done {:>6.0} members/s  {:.2}x   CPU/member: broker {:.0} µs, redis {:.0} µs, worker {:.0} µs",
            median(r.publish),
            median(r.done),
            median(r.ratios),
            cpu[0],
            cpu[1],
            cpu[2]
        );
    }
}
