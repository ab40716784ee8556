//! Real `chime-worker` processes: SIGKILL mid-job, SIGTERM drain, exec hygiene.

use chime_producer::{EnqueueClient, EnqueueRequest};
use std::path::Path;
use std::time::Duration;

use crate::common::*;

/// An exec job that logs `start KEY FENCE`, sleeps, then logs `done KEY FENCE`.
fn ledger_job(ledger: &Path, sleep_s: f32) -> String {
    format!(
        "[[jobs]]\nname = \"work\"\nhandler = \"exec\"\ntimeout = \"60s\"\n\
         command = ['sh', '-c', 'echo start $CHIME_KEY $CHIME_FENCE >> {l}; sleep {sleep_s}; echo done $CHIME_KEY $CHIME_FENCE >> {l}']\n",
        l = ledger.display()
    )
}

async fn exit_code(child: &mut Child, within: Duration) -> i32 {
    match tokio::time::timeout(within, child.child.wait()).await {
        Ok(Ok(status)) => status.code().unwrap_or(-1),
        Ok(Err(e)) => panic!("waiting for the worker: {e}"),
        Err(_) => panic!("worker did not exit within {within:?}; log:\n{}", child.log_text()),
    }
}

#[tokio::test]
async fn worker_killed_mid_job_completes_elsewhere_after_the_lease_once() {
    let env = TestEnv::new("killed");
    let ledger = env.dir.join("ledger");
    let text = env.config_text("quorum", "lease = \"3s\"", "", &ledger_job(&ledger, 2.0));
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();

    let mut a = Child::worker(&env.dir, &path, &[], "a");
    let client = EnqueueClient::connect(config).await.unwrap();
    let job = client.enqueue(EnqueueRequest::new("work")).await.unwrap();
    let key = job.key.to_string();
    wait_started(&ledger).await;
    a.signal(9);
    let _ = a.child.wait().await;

    let b = Child::worker(&env.dir, &path, &[], "b");
    let k = key.clone();
    let l = ledger.clone();
    wait_until("the job completed on worker B", Duration::from_secs(30), || {
        let (l, k) = (l.clone(), k.clone());
        async move { ledger_lines(&l).iter().any(|x| x.starts_with(&format!("done {k}"))) }
    })
    .await;
    let lines = ledger_lines(&ledger);
    let fence = |l: &str| l.rsplit(' ').next().and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    assert_eq!(lines.len(), 3, "{lines:?}");
    let (a_start, b_start, b_done) = (&lines[0], &lines[1], &lines[2]);
    assert!(
        a_start.starts_with(&format!("start {key} "))
            && b_start.starts_with(&format!("start {key} "))
            && b_done == &format!("done {key} {}", fence(b_start))
            && fence(b_start) > fence(a_start),
        "B ran it once, with a higher fence; A's child never finished: {lines:?}\n{}",
        b.log_text()
    );
    // The child writes its last ledger line before it exits and B records the outcome.
    wait_until("B logged the success", Duration::from_secs(10), || {
        let log = b.log_text();
        async move { log.contains("job succeeded") }
    })
    .await;
}

fn ledger_lines(path: &Path) -> Vec<String> {
    ledger(path)
}

/// Waits until the exec job wrote its first ledger line.
async fn wait_started(path: &Path) {
    let l = path.to_path_buf();
    wait_until("the job started", Duration::from_secs(20), || {
        let l = l.clone();
        async move { !ledger_lines(&l).is_empty() }
    })
    .await;
}

#[tokio::test]
async fn sigterm_drains_in_flight_jobs_and_exits_zero() {
    let mut env = TestEnv::new("sigterm");
    // A queue to consume that no config names: consumed, with a warning (a typo would leave
    // the queue meant unconsumed).
    env.queues.push("extra".into());
    let ledger = env.dir.join("ledger");
    let text = env.config_text("classic", "", "shutdown_timeout = \"30s\"", &ledger_job(&ledger, 1.0));
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let mut w = Child::worker(&env.dir, &path, &["--concurrency", "2", "--queues", "default,extra"], "w");
    let client = EnqueueClient::connect(config).await.unwrap();
    let job = client.enqueue(EnqueueRequest::new("work")).await.unwrap();
    wait_started(&ledger).await;
    w.signal(15);
    assert_eq!(exit_code(&mut w, Duration::from_secs(30)).await, 0, "{}", w.log_text());
    let lines = ledger_lines(&ledger);
    let fence = lines.first().and_then(|l| l.rsplit(' ').next()).unwrap_or("").to_string();
    assert_eq!(lines, vec![format!("start {} {fence}", job.key), format!("done {} {fence}", job.key)]);
    assert_eq!(depth(&env.names().work_queue("default")).await, 0, "acked before exit:\n{}", w.log_text());
    let log = w.log_text();
    assert!(
        log.lines().any(|l| l.contains("queue=extra")
            && l.contains("neither in this config nor a queue of this worker's jobs")),
        "{log}"
    );
    assert_eq!(idem_state(&env, &job.key.to_string()).await.as_deref(), Some("done"));
}

#[tokio::test]
async fn drain_deadline_stops_the_job_kills_its_process_group_and_requeues() {
    let env = TestEnv::new("deadline");
    let ledger = env.dir.join("ledger");
    let text = env.config_text("quorum", "", "shutdown_timeout = \"1s\"", &ledger_job(&ledger, 30.0));
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let mut w = Child::worker(&env.dir, &path, &[], "w");
    let client = EnqueueClient::connect(config).await.unwrap();
    let job = client.enqueue(EnqueueRequest::new("work")).await.unwrap();
    wait_started(&ledger).await;
    w.signal(15);
    assert_eq!(exit_code(&mut w, Duration::from_secs(30)).await, 0, "{}", w.log_text());
    // The job's `sleep 30` was killed with its group, and the message is back in the queue
    // with its claim released, so the next worker can run it at once.
    let key = job.key.to_string();
    let pgrep =
        std::process::Command::new("pgrep").args(["-f", &ledger.display().to_string()]).output().unwrap();
    assert!(pgrep.stdout.is_empty(), "the job's processes outlived the worker");
    let q = env.names().work_queue("default");
    let qq = q.clone();
    wait_until("message requeued", Duration::from_secs(10), || {
        let qq = qq.clone();
        async move { depth(&qq).await == 1 }
    })
    .await;
    assert_eq!(idem_state(&env, &key).await.as_deref(), Some("free"));
    let lines = ledger_lines(&ledger);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with(&format!("start {key} ")), "{lines:?}");
}

#[tokio::test]
async fn exec_gets_payload_on_stdin_and_facts_in_env() {
    let env = TestEnv::new("execenv");
    let out = env.dir.join("out");
    let jobs = format!(
        "[[jobs]]\nname = \"show\"\nhandler = \"exec\"\n\
         command = ['sh', '-c', 'cat > {o}.stdin; echo \"$CHIME_JOB|$CHIME_KEY|$CHIME_ATTEMPT|$CHIME_SLOT|$CHIME_FENCE\" > {o}.env']\n",
        o = out.display()
    );
    let config = env.config("classic", "", "", &jobs);
    let worker = Running::start(config.clone(), chime_worker::Registry::new(), 1).await;
    let client = EnqueueClient::connect(config).await.unwrap();
    let job = client
        .enqueue(EnqueueRequest::new("show").payload(serde_json::json!({"greeting": "hi"})).key("k-1"))
        .await
        .unwrap();
    let w = &worker;
    wait_until("exec job done", Duration::from_secs(20), || async { w.succeeded() == 1 }).await;
    let stdin = std::fs::read_to_string(out.with_extension("stdin")).unwrap();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&stdin).unwrap(),
        serde_json::json!({"greeting": "hi"})
    );
    let envs = std::fs::read_to_string(out.with_extension("env")).unwrap();
    let (facts, fence) = envs.trim().rsplit_once('|').unwrap();
    assert_eq!(facts, format!("show|{}|1|", job.key));
    assert!(fence.parse::<u64>().unwrap() > 1_000_000_000_000_000, "the fence is Redis time in µs: {fence}");
    worker.stop().await;
}

/// SIGHUP reloads the job definitions: a job added to the file runs without a restart. A
/// setting the running worker keeps until it restarts (`[worker]`, `[log]`) is named in the
/// log instead of passing for reloaded.
#[tokio::test]
async fn a_reload_runs_new_jobs_and_names_the_settings_it_keeps() {
    let env = TestEnv::new("reload");
    let noop = "[[jobs]]\nname = \"a\"\nhandler = \"noop\"\n";
    let path = env.write_config(&env.config_text("classic", "", "", noop));
    let mut w = Child::worker(&env.dir, &path, &[], "w");
    let log = env.dir.join("worker-w.log");
    wait_until("the worker consumes", Duration::from_secs(30), || {
        let log = log.clone();
        async move { std::fs::read_to_string(&log).unwrap_or_default().contains("connected to RabbitMQ") }
    })
    .await;
    let text = env.config_text(
        "classic",
        "",
        "max_hold = \"5s\"",
        &format!("[log]\nsuccess_sample = 0.5\n{noop}[[jobs]]\nname = \"b\"\nhandler = \"noop\"\n"),
    );
    std::fs::write(&path, &text).unwrap();
    w.signal(1);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    // The worker's new job runs (published once the reload is logged: before it, an unknown
    // job would wait out worker.unknown_job_grace).
    wait_until("the reload is logged", Duration::from_secs(30), || {
        let log = log.clone();
        async move { std::fs::read_to_string(&log).unwrap_or_default().contains("job definitions reloaded") }
    })
    .await;
    let key = client.enqueue(EnqueueRequest::new("b")).await.unwrap().key.to_string();
    crate::limits::wait_all_done(&config, &env, &[key], Duration::from_secs(30)).await;
    let text = w.log_text();
    let warned = text
        .lines()
        .find(|l| l.contains("settings a running worker keeps until it restarts"))
        .unwrap_or_else(|| panic!("no warning of the settings kept:\n{text}"));
    assert!(warned.contains("[worker], [log]"), "{warned}");
    w.signal(15);
    assert_eq!(exit_code(&mut w, Duration::from_secs(30)).await, 0);
}
