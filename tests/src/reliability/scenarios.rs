//! The fault scenarios of the first suite: processes killed and frozen, broker and Redis
//! outages, poison messages, duplicate publishes, DLQ replay, a cluster node lost.

use chime_producer::{EnqueueClient, EnqueueRequest};
use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::{BROKER_CONF, Check, Outcome, Stack, now_f64, wait_runs};
use crate::{Child, wait_until};

// ---------------------------------------------------------------- scenarios

/// 3 workers, 150 jobs of 0.3 s; one worker SIGKILLed mid-job.
pub async fn worker_sigkill() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start("rel-wkill", false, "concurrency = 4", 0.3, "").await;
    let ws: Vec<Child> = (0..3).map(|i| s.worker(&i.to_string())).collect();
    let expected = s.enqueue(150).await;
    wait_runs(&s, 20, Duration::from_secs(60)).await;
    ws[0].signal(9);
    let fault = now_f64();
    // Its running jobs were killed with it (process groups), so none finished twice; the
    // bound is what it had in flight.
    let c = Check::new("SIGKILL a worker mid-job", "kill -9 one of 3 workers", t0);
    s.check(c.done(expected).bound(4).fault(fault), Duration::from_secs(120)).await
}

/// 1 worker, 40 jobs of 0.5 s; SIGTERM, then a second worker finishes the rest.
pub async fn worker_sigterm() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start("rel-wterm", false, "concurrency = 4\nshutdown_timeout = \"30s\"", 0.5, "").await;
    let mut w = s.worker("a");
    let expected = s.enqueue(40).await;
    wait_runs(&s, 5, Duration::from_secs(60)).await;
    w.signal(15);
    let fault = now_f64();
    let code = tokio::time::timeout(Duration::from_secs(60), w.child.wait()).await.unwrap().unwrap().code();
    assert_eq!(code, Some(0), "graceful exit");
    let _b = s.worker("b");
    let c = Check::new("SIGTERM drain", "SIGTERM the only worker; exit 0; a new one resumes", t0);
    s.check(c.done(expected).fault(fault), Duration::from_secs(120)).await
}

/// Every-second schedule, 2 tickers, the leader SIGKILLed; expected = every slot in the run.
pub async fn leader_sigkill() -> Outcome {
    let t0 = Instant::now();
    let extra = "schedule = \"* * * * * *\"\n[ticker]\nlease = \"2s\"\n";
    let s = Stack::start("rel-lkill", false, "concurrency = 8", 0.0, extra).await;
    let _w = s.worker("w");
    let a = s.ticker("a");
    let b = s.ticker("b");
    wait_runs(&s, 3, Duration::from_secs(30)).await;
    let store = chime_scheduler::lease::TickerStore::connect(&s.config.redis, &s.config.prefix).unwrap();
    let leader = store.leader().await.unwrap().unwrap().id;
    let pid: i32 = leader.split(':').nth(1).unwrap().parse().unwrap();
    let victim = if pid == a.pid() { &a } else { &b };
    victim.signal(9);
    let fault = now_f64();
    let until = fault + 6.0;
    wait_until("slots after the failover", Duration::from_secs(30), || async { now_f64() > until + 1.0 })
        .await;
    let expected = slot_keys(&s, until);
    let c = Check::new("SIGKILL the leader ticker", "kill -9 the leader of 2 tickers", t0);
    s.check(c.done(expected).valid(valid_slot_keys()).fault(fault), Duration::from_secs(30)).await
}

/// Keys of every slot of the `work` schedule within a day of now (what may legitimately run).
pub(crate) fn valid_slot_keys() -> HashSet<String> {
    let now = chrono::Utc::now();
    let sched = chime_shared::schedule::Schedule::parse("* * * * * *", None).unwrap();
    sched
        .slots_between(now - chrono::Duration::minutes(10), now + chrono::Duration::minutes(10), 100_000)
        .into_iter()
        .map(|t| chime_shared::envelope::scheduled_key("work", t).to_string())
        .collect()
}

/// Keys of every slot of the `work` schedule from its first executed slot to `until`.
pub(crate) fn slot_keys(s: &Stack, until: f64) -> HashSet<String> {
    let l = s.read_ledger();
    let first = l.times.iter().map(|(t, _)| *t).fold(f64::MAX, f64::min);
    let from = chrono::DateTime::from_timestamp(first.floor() as i64 - 2, 0).unwrap();
    let to = chrono::DateTime::from_timestamp(until as i64, 0).unwrap();
    let sched = chime_shared::schedule::Schedule::parse("* * * * * *", None).unwrap();
    // Only slots from the first one that ran (the ticker starts at "now").
    let all: Vec<_> = sched.slots_between(from, to, 100_000);
    let keys: Vec<String> =
        all.iter().map(|t| chime_shared::envelope::scheduled_key("work", *t).to_string()).collect();
    let start = keys.iter().position(|k| l.runs.contains_key(k)).unwrap_or(0);
    keys[start..].iter().cloned().collect()
}

/// One ticker killed, every slot missed while none ran is caught up (`catch_up = "all"`).
pub async fn all_tickers_down() -> Outcome {
    let t0 = Instant::now();
    let extra = "schedule = \"* * * * * *\"\ncatch_up = \"all\"\n[ticker]\nlease = \"1s\"\n";
    let s = Stack::start("rel-tdown", false, "concurrency = 8", 0.0, extra).await;
    let _w = s.worker("w");
    let a = s.ticker("a");
    wait_runs(&s, 3, Duration::from_secs(30)).await;
    a.signal(9);
    let fault = now_f64();
    wait_until("no ticker for 5 s", Duration::from_secs(30), || async { now_f64() > fault + 5.0 }).await;
    let _b = s.ticker("b");
    let until = now_f64() + 3.0;
    wait_until("slots after the restart", Duration::from_secs(30), || async { now_f64() > until + 1.0 })
        .await;
    let expected = slot_keys(&s, until);
    let c =
        Check::new("all tickers down, then back", "kill -9 the only ticker, 5 s, restart (catch_up all)", t0);
    s.check(c.done(expected).valid(valid_slot_keys()).fault(fault), Duration::from_secs(30)).await
}

/// Broker `stop_app` for 3 s under load, then `start_app`.
pub async fn broker_restart() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start("rel-brestart", true, "concurrency = 4", 0.05, "").await;
    let _w1 = s.worker("1");
    let _w2 = s.worker("2");
    let expected = s.enqueue(200).await;
    wait_runs(&s, 30, Duration::from_secs(60)).await;
    let rabbit = s.rabbit.as_ref().unwrap();
    rabbit.ctl(&["stop_app"]);
    let stopped = now_f64();
    wait_until("3 s of broker outage", Duration::from_secs(30), || async { now_f64() > stopped + 3.0 }).await;
    rabbit.ctl(&["start_app"]);
    let fault = now_f64(); // recovery is measured from the end of the fault
    // Deliveries unacked at the stop come back; those already run are absorbed by Redis.
    let c = Check::new("broker restart under load", "rabbitmqctl stop_app, 3 s, start_app", t0);
    s.check(c.done(expected).bound(8).fault(fault), Duration::from_secs(120)).await
}

/// Broker frozen (SIGSTOP) past the 2 s heartbeat timeout for 8 s, then SIGCONT.
pub async fn broker_frozen() -> Outcome {
    let t0 = Instant::now();
    let mut s = Stack::start("rel-bfreeze", true, "concurrency = 4", 0.05, "").await;
    s.edit_config(|t| t.replacen("[amqp]\n", "[amqp]\nheartbeat = \"2s\"\n", 1));
    let _w = s.worker("w");
    let expected = s.enqueue(150).await;
    wait_runs(&s, 20, Duration::from_secs(60)).await;
    let pid = s.rabbit.as_ref().unwrap().pid();
    crate::signal_pid(pid, 19);
    let frozen = now_f64();
    wait_until("8 s frozen", Duration::from_secs(30), || async { now_f64() > frozen + 8.0 }).await;
    crate::signal_pid(pid, 18);
    let fault = now_f64(); // recovery is measured from the end of the fault
    let c =
        Check::new("broker frozen past the heartbeat", "SIGSTOP the broker 8 s (heartbeat 2 s), SIGCONT", t0);
    s.check(c.done(expected).bound(8).fault(fault), Duration::from_secs(120)).await
}

/// Redis killed and restarted empty under load: its dedup records are gone.
pub async fn redis_restarted_empty() -> Outcome {
    let t0 = Instant::now();
    let mut s = Stack::start("rel-rrestart", false, "concurrency = 4", 0.05, "").await;
    let _w1 = s.worker("1");
    let _w2 = s.worker("2");
    let expected = s.enqueue(200).await;
    wait_runs(&s, 30, Duration::from_secs(60)).await;
    s.redis.restart().await;
    let fault = now_f64();
    // A job that ran but was not yet acked when Redis lost its record can run again.
    let c = Check::new("Redis restarted empty", "kill -9 Redis and restart it with no data", t0);
    s.check(c.done(expected).bound(8).fault(fault), Duration::from_secs(120)).await
}

/// Redis frozen (SIGSTOP) for 5 s under load, then SIGCONT.
pub async fn redis_frozen() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start("rel-rfreeze", false, "concurrency = 4", 0.05, "").await;
    let _w = s.worker("w");
    let expected = s.enqueue(150).await;
    wait_runs(&s, 20, Duration::from_secs(60)).await;
    let pid = s.redis.pid();
    crate::signal_pid(pid, 19);
    let frozen = now_f64();
    wait_until("5 s frozen", Duration::from_secs(30), || async { now_f64() > frozen + 5.0 }).await;
    crate::signal_pid(pid, 18);
    let fault = now_f64(); // recovery is measured from the end of the fault
    let c = Check::new("Redis frozen", "SIGSTOP Redis 5 s, SIGCONT", t0);
    s.check(c.done(expected).bound(4).fault(fault), Duration::from_secs(120)).await
}

/// Malformed bodies, a permanently failing job and a job that times out, among good ones.
pub async fn poison_and_timeouts() -> Outcome {
    let t0 = Instant::now();
    let extra = "[[jobs]]\nname = \"poison\"\nhandler = \"exec\"\ncommand = [\"sh\", \"-c\", \"exit 100\"]\n\
                 [[jobs]]\nname = \"slow\"\nhandler = \"exec\"\ncommand = [\"sleep\", \"30\"]\ntimeout = \"1s\"\nmax_attempts = 2\n\
                 backoff = { initial = \"1s\", factor = 1.0, max = \"1s\" }\n";
    let s = Stack::start("rel-poison", false, "concurrency = 4", 0.0, extra).await;
    let _w = s.worker("w");
    let expected = s.enqueue(50).await;
    let client = EnqueueClient::connect(s.config.clone()).await.unwrap();
    let mut dead = HashSet::new();
    for i in 0..5 {
        client.enqueue(EnqueueRequest::new("poison").key(format!("p{i}"))).await.unwrap();
        client.enqueue(EnqueueRequest::new("slow").key(format!("s{i}"))).await.unwrap();
        dead.insert(chime_shared::envelope::adhoc_key("poison", &format!("p{i}")).to_string());
        dead.insert(chime_shared::envelope::adhoc_key("slow", &format!("s{i}")).to_string());
    }
    let conn =
        lapin::Connection::connect(&s.env.amqp_url, lapin::ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default()).await.unwrap();
    for i in 0..5 {
        let body = format!("garbage {i}");
        chime_shared::amqp::publish_confirmed(
            &ch,
            &s.env.names().work_exchange(),
            "default",
            body.as_bytes(),
            lapin::BasicProperties::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    }
    let c = Check::new(
        "malformed, poison, timeout",
        "5 garbage bodies, 5 exit-100 jobs, 5 jobs past their timeout",
        t0,
    );
    let o = s.check(c.done(expected).dead(dead), Duration::from_secs(90)).await;
    assert_eq!(o.dlq.get("malformed"), Some(&5), "{o:?}");
    assert_eq!(o.dlq.get("permanent"), Some(&5), "{o:?}");
    assert_eq!(o.dlq.get("timeout"), Some(&5), "{o:?}");
    let _ = conn.close(200, "".into()).await;
    o
}

/// A second publisher sends every slot of the schedule again (what two leaders would do).
pub async fn duplicate_publishes() -> Outcome {
    let t0 = Instant::now();
    let extra = "schedule = \"* * * * * *\"\n[ticker]\nlease = \"2s\"\n";
    let s = Stack::start("rel-dup", false, "concurrency = 8", 0.0, extra).await;
    let _w = s.worker("w");
    let _t = s.ticker("t");
    wait_runs(&s, 2, Duration::from_secs(30)).await;
    let client = EnqueueClient::connect(s.config.clone()).await.unwrap();
    let fault = now_f64();
    let until = fault + 8.0;
    let mut sent = 0;
    let mut last = 0i64;
    while now_f64() < until {
        let sec = chrono::Utc::now().timestamp();
        if sec != last {
            last = sec;
            let slot = chrono::DateTime::from_timestamp(sec, 0).unwrap();
            let key = chime_shared::envelope::scheduled_key("work", slot);
            let env = chime_shared::Envelope::new(
                "work",
                "default",
                key,
                serde_json::Value::Null,
                Some(slot),
                20,
                chime_shared::Source::Schedule,
            );
            client.publish(&env, Duration::ZERO).await.unwrap();
            sent += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(sent >= 7);
    let expected = slot_keys(&s, until);
    let c =
        Check::new("duplicate publishes of every slot", "a rogue second publisher sends each slot again", t0);
    s.check(c.done(expected).valid(valid_slot_keys()).fault(fault), Duration::from_secs(30)).await
}

/// 100 jobs fail permanently, then are replayed from the DLQ with `chime dlq replay --all`.
pub async fn dlq_replay() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start_gated("rel-replay", false, "concurrency = 8", 0.0, "", Some("open")).await;
    let _w = s.worker("w");
    let expected = s.enqueue(100).await;
    wait_until("100 dead letters", Duration::from_secs(60), || async {
        s.dlq().await.get("permanent") == Some(&100)
    })
    .await;
    std::fs::write(s.env.dir.join("open"), b"").unwrap();
    let fault = now_f64();
    let out = tokio::process::Command::new(crate::bin("chime"))
        .arg("--config")
        .arg(&s.config_path)
        .args(["dlq", "replay", "--all"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let c = Check::new(
        "DLQ replay of 100 dead letters",
        "100 permanent failures, then `chime dlq replay --all`",
        t0,
    );
    s.check(c.done(expected).fault(fault), Duration::from_secs(60)).await
}

/// A 3-node cluster, quorum queues, three AMQP URLs; the node leading the work queue is
/// SIGKILLed under load.
pub async fn cluster_leader_killed() -> Outcome {
    let t0 = Instant::now();
    let cluster = crate::PrivateCluster::start(3).await;
    let mut s = Stack::start("rel-cluster", false, "concurrency = 4", 0.05, "").await;
    s.env.amqp_url = cluster.urls()[0].clone();
    let urls = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect::<Vec<_>>().join(", ");
    let shared = crate::amqp_url();
    s.edit_config(|t| t.replacen(&format!("url = \"{shared}\""), &format!("url = [{urls}]"), 1));
    let _w1 = s.worker("1");
    let _w2 = s.worker("2");
    let expected = s.enqueue(300).await;
    wait_runs(&s, 30, Duration::from_secs(60)).await;
    let queue = s.env.names().work_queue("default");
    let leader = cluster.leader_of(&queue, 1);
    let victim = cluster
        .nodes
        .iter()
        .position(|n| n.node() == leader)
        .unwrap_or_else(|| panic!("leader {leader:?} of {queue} not found"));
    cluster.nodes[victim].kill().await;
    let fault = now_f64();
    let c =
        Check::new("cluster: queue leader killed", "3 nodes, kill -9 the node leading the work queue", t0);
    s.check(c.done(expected).bound(8).fault(fault), Duration::from_secs(180)).await
}

/// A Rust handler (in-process worker) that panics on its first attempt of every job; the
/// retry writes the same ledger and effect table.
pub async fn handler_panic() -> Outcome {
    use chime_worker::{JobContext, JobError, Registry, Worker, raw_handler_fn};
    let t0 = Instant::now();
    let mut s = Stack::start("rel-panic", false, "concurrency = 4", 0.0, "").await;
    s.edit_config(|t| {
        t.replacen("handler = \"exec\"", "handler = \"panicky\"", 1)
            .replace("command = ['sh'", "# command = ['sh'")
    });
    let (db, ledger) = (s.db.clone(), s.ledger.clone());
    let mut reg = Registry::new();
    reg.register(
        "panicky",
        raw_handler_fn(move |ctx: JobContext, _| {
            let (db, ledger) = (db.clone(), ledger.clone());
            async move {
                if ctx.attempt() == 1 {
                    panic!("first attempts always panic");
                }
                // The same two effect rows as the exec job's (see `Stack::start`).
                let effect = format!("INSERT INTO effects(key) VALUES ('{}')", ctx.key());
                let guarded = format!("INSERT INTO guarded(key) VALUES ('{}')", ctx.key());
                let out = tokio::process::Command::new("psql")
                    .args([
                        "-qAt",
                        "-h",
                        "127.0.0.1",
                        "-U",
                        "postgres",
                        "-d",
                        &db,
                        "-c",
                        &effect,
                        "-c",
                        &guarded,
                    ])
                    .output()
                    .await
                    .map_err(JobError::transient)?;
                let err = String::from_utf8_lossy(&out.stderr);
                let what = if err.contains("duplicate") {
                    "rejected"
                } else if err.contains("rror") {
                    return Err(JobError::transient("database error"));
                } else {
                    "done"
                };
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&ledger)
                    .map_err(JobError::transient)?;
                // One write per line: O_APPEND keeps whole writes apart; `writeln!` on a File
                // issues several, which concurrent handlers interleave.
                let line = format!("{} {} {what}\n", now_f64(), ctx.key());
                f.write_all(line.as_bytes()).map_err(JobError::transient)?;
                Ok(())
            }
        }),
    );
    let worker = Worker::builder(s.config.clone()).registry(reg).build().unwrap();
    let token = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(token.clone()));
    let expected = s.enqueue(60).await;
    let c = Check::new("handler panic", "every job's first attempt panics (Rust handler)", t0);
    let o = s.check(c.done(expected), Duration::from_secs(120)).await;
    token.cancel();
    let _ = run.await;
    o
}

/// A broker with `consumer_timeout = 60000` ms and a job running 150 s while quick jobs
/// share its channel: the broker closes the channel and requeues everything unacked on it.
/// Takes 2–3 minutes; run by `chime-reliability`, not in CI.
pub async fn consumer_timeout() -> Outcome {
    let t0 = Instant::now();
    BROKER_CONF.with(|c| *c.borrow_mut() = "consumer_timeout = 60000\n".into());
    let extra =
        "[[jobs]]\nname = \"long\"\nhandler = \"exec\"\ntimeout = \"300s\"\ncommand = [\"sleep\", \"150\"]\n";
    let mut s = Stack::start("rel-ctimeout", true, "concurrency = 4\nprefetch = 4", 0.2, extra).await;
    BROKER_CONF.with(|c| c.borrow_mut().clear());
    // Tell chime what the broker enforces, so the worker can warn about the long job.
    s.edit_config(|t| t.replacen("[amqp]\n", "[amqp]\nconsumer_timeout = \"1m\"\n", 1));
    let w = s.worker("w");
    let client = EnqueueClient::connect(s.config.clone()).await.unwrap();
    client.enqueue(EnqueueRequest::new("long").key("long")).await.unwrap();
    let mut expected = HashSet::new();
    let fault = now_f64();
    // Quick jobs keep flowing on the same channel for the whole run.
    // The broker checks consumer_timeout once a minute: an ack 150 s late is always caught.
    for round in 0..36 {
        let reqs: Vec<_> =
            (0..10).map(|i| EnqueueRequest::new("work").key(format!("r{round}-{i}"))).collect();
        client.enqueue_batch(&reqs).await.unwrap();
        expected.extend(
            (0..10).map(|i| chime_shared::envelope::adhoc_key("work", &format!("r{round}-{i}")).to_string()),
        );
        let until = now_f64() + 5.0;
        wait_until("5 s", Duration::from_secs(30), || async { now_f64() > until }).await;
    }
    let c = Check::new(
        "late ack past consumer_timeout",
        "consumer_timeout 60 s; a 150 s job shares the channel (prefetch 4)",
        t0,
    );
    let o = s.check(c.done(expected).bound(4).fault(fault), Duration::from_secs(120)).await;
    let log = w.log_text();
    assert!(log.contains("not safely below RabbitMQ's consumer_timeout"), "startup warning");
    assert!(
        log.contains("connection lost") || log.contains("consumer of"),
        "the broker closed the channel:\n{log}"
    );
    o
}
