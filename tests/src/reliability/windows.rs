//! Scenarios aimed at the windows where a job could be lost: long jobs across Redis data
//! loss, a failover to a lagging replica, publishes cut off while retries and dead letters are
//! in flight, the dead exchange gone, a broker memory alarm, skewed ticker clocks, a rolling
//! deploy, and workers killed again and again.

use chime_producer::EnqueueRequest;
use chime_shared::envelope::{Envelope, Source, adhoc_key};
use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::{Check, Outcome, Stack, now_f64, wait_runs, wait_secs};
use crate::proxy::TcpSwitch;
use crate::{Child, PrivateRedis, connect_redis, wait_until};

/// Keys of `n` jobs of `job` with keys `{prefix}{i}`.
fn keys(job: &str, prefix: &str, n: usize) -> HashSet<String> {
    (0..n).map(|i| adhoc_key(job, &format!("{prefix}{i}")).to_string()).collect()
}

/// 16 jobs of 9 s (three 3 s leases) running at once; Redis killed and restarted empty 4 s in.
/// Every renewal finds its record gone, claims it again, and the jobs run to their end.
pub async fn long_jobs_redis_restarted_empty() -> Outcome {
    let t0 = Instant::now();
    let mut s = Stack::start("rel-longredis", false, "concurrency = 8", 9.0, "").await;
    s.edit_config(|t| t.replacen("lease = \"5s\"", "lease = \"3s\"", 1));
    let _w1 = s.worker("1");
    let _w2 = s.worker("2");
    let expected = s.enqueue(16).await;
    wait_secs(now_f64(), 4.0).await;
    s.redis.restart().await;
    let fault = now_f64();
    let c = Check::new(
        "long jobs, Redis restarted empty",
        "16 jobs of 9 s (3 leases each) in flight; kill -9 Redis, restart it empty",
        t0,
    );
    s.check(c.done(expected).fault(fault), Duration::from_secs(90)).await
}

/// A master and a replica behind a switchable proxy; the replica falls behind (SIGSTOP), the
/// master dies, the replica is promoted (`REPLICAOF NO ONE`) with the claims, renewals and
/// `done` records of the last seconds missing, and the proxy moves to it.
pub async fn redis_failover_to_lagging_replica() -> Outcome {
    let t0 = Instant::now();
    let mut s = Stack::start("rel-failover", false, "concurrency = 8", 6.0, "").await;
    let replica = PrivateRedis::start_replica_of(s.redis.port).await;
    let switch = TcpSwitch::start(s.redis.port).await;
    let url = switch.redis_url();
    let master = s.redis.url();
    s.edit_config(|t| t.replacen("lease = \"5s\"", "lease = \"3s\"", 1).replacen(&master, &url, 1));
    let _w1 = s.worker("1");
    let _w2 = s.worker("2");
    let expected = s.enqueue(40).await;
    wait_runs(&s, 1, Duration::from_secs(60)).await;
    crate::signal_pid(replica.pid(), 19); // the replica stops applying the master's writes
    let lag_from = now_f64();
    wait_secs(lag_from, 4.0).await;
    s.redis.kill();
    crate::signal_pid(replica.pid(), 18);
    let mut conn = connect_redis(&replica.url()).await;
    let _: () = redis::cmd("REPLICAOF").arg("NO").arg("ONE").query_async(&mut conn).await.unwrap();
    switch.switch(replica.port);
    let fault = now_f64();
    let c = Check::new(
        "Redis failover to a lagging replica",
        "replica 4 s behind (SIGSTOP), master killed, replica promoted, proxy switched; 6 s jobs, 3 s lease",
        t0,
    );
    // Runs whose `done` the replica never saw may be repeated if their copy comes back; at
    // most what was in flight on the two workers.
    s.check(c.done(expected).bound(16).fault(fault), Duration::from_secs(120)).await
}

/// The worker's connection closed by the broker five times while half of the jobs fail once
/// (retries being published) and a quarter fail for good (dead letters being published).
pub async fn connection_closed_while_failing() -> Outcome {
    let t0 = Instant::now();
    let extra = "[[jobs]]\nname = \"flaky\"\nhandler = \"exec\"\nmax_attempts = 5\n\
                 backoff = { initial = \"1s\", factor = 1.0, max = \"1s\" }\n\
                 command = ['sh', '-c', '''f={DIR}/flaky-$CHIME_KEY; [ -f $f ] || { touch $f; exit 1; }; sleep 0.2; {EFFECT}''']\n\
                 [[jobs]]\nname = \"doomed\"\nhandler = \"exec\"\ncommand = ['sh', '-c', 'sleep 0.2; exit 100']\n";
    let s = Stack::start("rel-connclose", true, "concurrency = 8", 0.2, extra).await;
    let _w = s.worker("w");
    let mut done = s.enqueue(60).await;
    done.extend(s.enqueue_as("flaky", "f", 60).await);
    let dead = s.enqueue_as("doomed", "d", 40).await;
    wait_runs(&s, 5, Duration::from_secs(60)).await;
    let rabbit = s.rabbit.as_ref().unwrap();
    let fault = now_f64();
    let mut closed = 0;
    for round in 0..5 {
        let list = rabbit.ctl(&["-q", "list_connections", "pid", "client_properties"]);
        for line in list.lines().filter(|l| l.contains("chime-worker")) {
            if let Some(pid) = line.split('\t').next() {
                rabbit.ctl(&["close_connection", pid, "fault injection"]);
                closed += 1;
            }
        }
        wait_secs(fault + f64::from(round), 1.0).await;
    }
    let c = Check::new(
        "connection closed during retries and dead letters",
        "rabbitmqctl close_connection on the worker, 5 times, 1 s apart; 60 flaky and 40 doomed jobs",
        t0,
    );
    let note = format!("{closed} connections closed");
    s.check(c.done(done).dead(dead).bound(8).fault(fault).note(note), Duration::from_secs(120)).await
}

/// The dead exchange deleted while jobs fail for good: their dead letters cannot be published
/// until the worker notices, reconnects and declares the topology again.
pub async fn dead_exchange_missing() -> Outcome {
    let t0 = Instant::now();
    let extra =
        "[[jobs]]\nname = \"doomed\"\nhandler = \"exec\"\ncommand = ['sh', '-c', 'sleep 0.1; exit 100']\n";
    let s = Stack::start("rel-deadex", false, "concurrency = 4", 0.1, extra).await;
    let _w = s.worker("w");
    let client = s.client().await; // declares the topology; delete after it
    let conn = crate::connect_amqp_to(&s.env.amqp_url).await;
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_delete(s.env.names().dead_exchange().as_str().into(), Default::default()).await.unwrap();
    let _ = conn.close(200, "".into()).await;
    let fault = now_f64();
    let reqs: Vec<_> = (0..40).map(|i| EnqueueRequest::new("doomed").key(format!("d{i}"))).collect();
    client.enqueue_batch(&reqs).await.unwrap();
    let dead = keys("doomed", "d", 40);
    let done = s.enqueue(20).await;
    let c = Check::new(
        "dead exchange missing at DLQ time",
        "the dead exchange deleted; 40 jobs fail for good, 20 succeed",
        t0,
    );
    s.check(c.done(done).dead(dead).fault(fault), Duration::from_secs(90)).await
}

/// A broker memory alarm (watermark near zero): publishers are blocked. An enqueue during it
/// fails clearly after `publish_timeout`; a drain during it (retries to publish) stalls and
/// resumes; nothing confirmed is lost.
pub async fn memory_alarm() -> Outcome {
    let t0 = Instant::now();
    let extra = "[[jobs]]\nname = \"flaky\"\nhandler = \"exec\"\nmax_attempts = 5\n\
                 backoff = { initial = \"1s\", factor = 1.0, max = \"1s\" }\n\
                 command = ['sh', '-c', '''f={DIR}/flaky-$CHIME_KEY; [ -f $f ] || { touch $f; exit 1; }; {EFFECT}''']\n";
    let mut s = Stack::start("rel-memalarm", true, "concurrency = 4", 0.05, extra).await;
    s.edit_config(|t| t.replacen("[amqp]\n", "[amqp]\npublish_timeout = \"2s\"\n", 1));
    let rabbit = s.rabbit.as_ref().unwrap();
    // During enqueue: the alarm is raised before anything is published.
    let client = s.client().await;
    rabbit.ctl(&["set_vm_memory_high_watermark", "0.000001"]);
    let blocked = std::time::Instant::now();
    let refused = client.enqueue(EnqueueRequest::new("work").key("during-alarm")).await;
    let waited = blocked.elapsed();
    let refused = match refused {
        Ok(r) => panic!("an enqueue during a memory alarm must not report success: {r:?}"),
        Err(e) => e.to_string(),
    };
    rabbit.ctl(&["set_vm_memory_high_watermark", "0.4"]);
    // During a drain: 100 jobs whose first attempts fail (each retry is a publish).
    let client = s.client().await;
    let reqs: Vec<_> = (0..100).map(|i| EnqueueRequest::new("flaky").key(format!("f{i}"))).collect();
    client.enqueue_batch(&reqs).await.unwrap();
    let done = keys("flaky", "f", 100);
    let _w = s.worker("w");
    wait_runs(&s, 5, Duration::from_secs(60)).await;
    rabbit.ctl(&["set_vm_memory_high_watermark", "0.000001"]);
    let fault = now_f64();
    wait_secs(fault, 5.0).await;
    rabbit.ctl(&["set_vm_memory_high_watermark", "0.4"]);
    let c = Check::new(
        "broker memory alarm",
        "watermark near 0: an enqueue during it, then 5 s during a drain of 100 retrying jobs",
        t0,
    );
    // The refused enqueue was not confirmed: it may or may not have reached the queue (its
    // frame can be on the wire when the broker blocks), so it may run once the alarm clears.
    // That is why a failed enqueue is retried with the same key.
    let unconfirmed = adhoc_key("work", "during-alarm").to_string();
    let c = c.done(done).valid(HashSet::from([unconfirmed.clone()])).bound(4).fault(fault);
    let o = s.check(c, Duration::from_secs(120)).await;
    let ran = s.read_ledger().runs.contains_key(&unconfirmed);
    let note = format!(
        "enqueue during the alarm failed after {:.1} s: {refused}; that unconfirmed job {} once the alarm cleared",
        waited.as_secs_f64(),
        if ran { "still ran" } else { "never ran" }
    );
    Outcome { note, ..o }
}

/// Two tickers 3 s apart (libfaketime on one), the leader killed twice: each slot is published
/// under its one key, none is missed, none runs twice.
pub async fn ticker_clock_skew() -> Outcome {
    let t0 = Instant::now();
    let extra = "schedule = \"* * * * * *\"\ncatch_up = \"all\"\n[ticker]\nlease = \"2s\"\n";
    let s = Stack::start("rel-skew", false, "concurrency = 8", 0.0, extra).await;
    let _w = s.worker("w");
    let mut ahead = Child::skewed_ticker(&s.env.dir, &s.config_path, "+3s", "ahead");
    wait_runs(&s, 3, Duration::from_secs(30)).await;
    let behind = s.ticker("behind");
    // The fast one leads; killing it hands over to a leader whose clock is 3 s behind the
    // watermark.
    ahead.signal(9);
    let fault = now_f64();
    wait_secs(fault, 6.0).await;
    let ahead2 = Child::skewed_ticker(&s.env.dir, &s.config_path, "+3s", "ahead2");
    wait_secs(fault, 8.0).await;
    behind.signal(9);
    let until = now_f64() + 4.0;
    wait_secs(until, 1.5).await;
    // The skew is real: the fast ticker saw its clock 3 s off Redis TIME.
    assert!(ahead.log_text().contains("local clock differs from Redis TIME"), "{}", ahead.log_text());
    let a = &mut ahead;
    wait_until("the killed leader is gone", Duration::from_secs(10), || std::future::ready(a.child_exited()))
        .await;
    let expected = super::scenarios::slot_keys(&s, until);
    let c = Check::new(
        "ticker clock skew",
        "2 tickers 3 s apart (faketime); the leader killed twice, each time handing over across the skew",
        t0,
    );
    let o = s
        .check(
            c.done(expected).valid(super::scenarios::valid_slot_keys()).fault(fault),
            Duration::from_secs(30),
        )
        .await;
    drop(ahead2);
    o
}

/// A new release publishes a job the workers do not know yet, and every envelope carries a
/// field they do not know; the workers keep both until their config is reloaded (a changed
/// file) and then run them.
pub async fn rolling_deploy() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start("rel-deploy", false, "concurrency = 4", 0.05, "").await;
    let w1 = s.worker("1");
    let w2 = s.worker("2");
    let client = s.client().await;
    let send = |job: &str, key: String| {
        let mut env = Envelope::new(
            job,
            "default",
            adhoc_key(job, &key),
            serde_json::Value::Null,
            None,
            20,
            Source::Adhoc,
        );
        // Fields of a release these workers do not know (not chime's own: those have meanings).
        env.extra.insert("tenant".into(), "acme".into());
        env.extra.insert("trace".into(), serde_json::json!({"id": 1, "sampled": true}));
        env
    };
    let mut done = HashSet::new();
    for i in 0..50 {
        let env = send("work", format!("w{i}"));
        done.insert(env.key.to_string());
        client.publish(&env, Duration::ZERO).await.unwrap();
    }
    for i in 0..20 {
        let env = send("newjob", format!("n{i}"));
        done.insert(env.key.to_string());
        client.publish(&env, Duration::ZERO).await.unwrap();
    }
    // The old workers run `work` (unknown fields and all) and send `newjob` round.
    wait_runs(&s, 50, Duration::from_secs(60)).await;
    let text = std::fs::read_to_string(&s.config_path).unwrap();
    let work = text.split("[[jobs]]").nth(1).unwrap().replacen("name = \"work\"", "name = \"newjob\"", 1);
    std::fs::write(&s.config_path, format!("{text}\n[[jobs]]{work}")).unwrap();
    let fault = now_f64();
    let c = Check::new(
        "rolling deploy",
        "a new job and new envelope fields published before the workers know them; config reloaded",
        t0,
    );
    let o = s.check(c.done(done).fault(fault), Duration::from_secs(90)).await;
    let redelayed = w1.log_text().matches("copy sent round again").count()
        + w2.log_text().matches("copy sent round again").count();
    Outcome { note: format!("{redelayed} copies of the unknown job sent round before the reload"), ..o }
}

/// 1,000 jobs, 3 workers; every 2 s for a minute a random worker is SIGKILLed and replaced.
pub async fn sigkill_loop() -> Outcome {
    let t0 = Instant::now();
    let s = Stack::start("rel-killloop", false, "concurrency = 4", 0.05, "").await;
    let mut workers: Vec<Child> = (0..3).map(|i| s.worker(&format!("{i}"))).collect();
    let expected = s.enqueue(1000).await;
    wait_runs(&s, 10, Duration::from_secs(60)).await;
    let fault = now_f64();
    let mut kills = 0;
    let mut seed = u64::from(std::process::id());
    for round in 0..30u32 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let victim = usize::try_from(seed >> 33).unwrap_or(0) % workers.len();
        workers[victim].signal(9);
        workers[victim] = s.worker(&format!("r{round}"));
        kills += 1;
        wait_secs(fault + 2.0 * f64::from(round), 2.0).await;
    }
    let c = Check::new(
        "SIGKILL loop",
        "a random one of 3 workers killed and replaced every 2 s for 60 s; 1,000 jobs",
        t0,
    );
    // Each kill can repeat what the victim had run but not yet recorded (4 at once).
    s.check(
        c.done(expected).bound(4 * kills).fault(fault).note(format!("{kills} kills")),
        Duration::from_secs(180),
    )
    .await
}

/// The longest stretch without a completed job from `fault` to the last completion: what a
/// failover costs in throughput (the first completion after it may be a job already running).
fn longest_stall(s: &Stack, fault: f64) -> f64 {
    let mut times: Vec<f64> =
        s.read_ledger().times.into_iter().map(|(t, _)| t).filter(|t| *t >= fault).collect();
    times.sort_by(f64::total_cmp);
    let mut last = fault;
    let mut worst: f64 = 0.0;
    for t in times {
        worst = worst.max(t - last);
        last = t;
    }
    worst
}

/// Redis behind Sentinel (master, one replica, three sentinels): `SENTINEL FAILOVER` while two
/// workers drain 300 jobs. Workers find the new master through the sentinels (a `READONLY`
/// reply from the demoted master, or a dropped connection, makes them ask again).
pub async fn sentinel_failover_drain() -> Outcome {
    sentinel_drain(false).await
}

/// Redis behind Sentinel: the master SIGKILLed while two workers drain 300 jobs; the
/// sentinels notice (down-after 1 s), elect, and promote the replica.
pub async fn sentinel_master_killed() -> Outcome {
    sentinel_drain(true).await
}

async fn sentinel_drain(kill: bool) -> Outcome {
    let t0 = Instant::now();
    let name = if kill { "rel-sentinel-kill" } else { "rel-sentinel" };
    let mut s = Stack::start(name, false, "concurrency = 4", 0.05, "").await;
    let sentinels = crate::PrivateSentinels::start(s.redis.port).await;
    let lines = sentinels.config_lines();
    s.edit_config(|t| t.replacen("[redis]\n", &format!("[redis]\n{lines}"), 1));
    let _w1 = s.worker("1");
    let _w2 = s.worker("2");
    let expected = s.enqueue(300).await;
    wait_runs(&s, 30, Duration::from_secs(60)).await;
    let fault = now_f64();
    let (scenario, injection, after) = if kill {
        s.redis.kill();
        sentinels.wait_promoted().await;
        (
            "Redis Sentinel: the master killed",
            "master + replica + 3 sentinels (down-after 1 s); kill -9 the master while 2 workers drain",
            "the kill",
        )
    } else {
        sentinels.failover().await;
        (
            "Redis Sentinel failover during a drain",
            "master + replica + 3 sentinels; SENTINEL FAILOVER while 2 workers drain",
            "SENTINEL FAILOVER",
        )
    };
    let c = Check::new(scenario, injection, t0);
    let promoted = now_f64() - fault;
    // Asynchronous replication: `done` records the replica had not received when it was
    // promoted can let a copy run again; at most what was in flight on the two workers.
    let mut out = s.check(c.done(expected).bound(8).fault(fault), Duration::from_secs(120)).await;
    out.note = format!(
        "the sentinels named the new master {promoted:.1} s after {after}; longest stretch without a completed job \
         after it: {:.1} s",
        longest_stall(&s, fault)
    );
    out
}

/// Every-second schedule, 2 tickers on Sentinel; `SENTINEL FAILOVER` while one leads.
pub async fn sentinel_failover_ticker() -> Outcome {
    let t0 = Instant::now();
    let extra = "schedule = \"* * * * * *\"\n[ticker]\nlease = \"2s\"\n";
    let mut s = Stack::start("rel-sentinel-tick", false, "concurrency = 8", 0.0, extra).await;
    let sentinels = crate::PrivateSentinels::start(s.redis.port).await;
    let lines = sentinels.config_lines();
    s.edit_config(|t| t.replacen("[redis]\n", &format!("[redis]\n{lines}"), 1));
    let _w = s.worker("w");
    let _a = s.ticker("a");
    let _b = s.ticker("b");
    wait_runs(&s, 3, Duration::from_secs(30)).await;
    let fault = now_f64();
    sentinels.failover().await;
    let until = now_f64() + 6.0;
    wait_secs(until, 1.0).await;
    let expected = super::slot_keys(&s, until);
    let c = Check::new(
        "Redis Sentinel failover under the ticker",
        "every-second schedule, 2 tickers (lease 2 s); SENTINEL FAILOVER while one leads",
        t0,
    );
    let mut out = s
        .check(
            c.done(expected).valid(super::valid_slot_keys()).bound(2).fault(fault),
            Duration::from_secs(60),
        )
        .await;
    out.note =
        format!("longest stretch without a slot run after the failover: {:.1} s", longest_stall(&s, fault));
    out
}

/// Redis Cluster of 3 masters with a replica each; one master SIGKILLed while two workers
/// drain 300 jobs, and its replica promoted by the cluster.
pub async fn redis_cluster_master_killed() -> Outcome {
    let t0 = Instant::now();
    let mut cluster = crate::PrivateRedisCluster::start(3).await;
    let mut s = Stack::start("rel-rcluster", false, "concurrency = 4", 0.05, "").await;
    let line = cluster.config_line();
    s.edit_config(|t| t.replacen("[redis]\n", &format!("[redis]\n{line}"), 1));
    let _w1 = s.worker("1");
    let _w2 = s.worker("2");
    let expected = s.enqueue(300).await;
    wait_runs(&s, 30, Duration::from_secs(60)).await;
    let victim = cluster.masters().await[0];
    cluster.nodes[victim].kill();
    let fault = now_f64();
    let c = Check::new(
        "Redis Cluster: a master killed",
        "3 masters + 3 replicas; kill -9 one master while 2 workers drain (node timeout 2 s)",
        t0,
    );
    let mut out = s.check(c.done(expected).bound(8).fault(fault), Duration::from_secs(60)).await;
    out.note =
        format!("longest stretch without a completed job after the kill: {:.1} s", longest_stall(&s, fault));
    if !out.passed() {
        // What the worker saw, for the failure message.
        let log = std::fs::read_to_string(s.env.dir.join("worker-1.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().filter(|l| !l.contains("DEBUG")).collect();
        out.note = lines[lines.len().saturating_sub(30)..].join("\n");
    }
    drop(cluster);
    out
}
