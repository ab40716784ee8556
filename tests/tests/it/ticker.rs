//! `chime tick` as real processes: failover, catch-up policies, split brain, broker restart.

use chime_scheduler::lease::TickerStore;
use chime_shared::Config;
use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
use chrono::{DateTime, Utc};
use std::time::Duration;

use crate::common::*;

/// A registry whose handler `name` records each run's slot (Unix seconds) in `ledger`.
fn slot_recorder(reg: &mut Registry, name: &str, ledger: &Ledger) {
    let l = ledger.clone();
    reg.register(
        name,
        raw_handler_fn(move |ctx: JobContext, _| {
            l.record(u64::try_from(ctx.slot().map(|s| s.timestamp()).unwrap_or(0)).unwrap());
            async { Ok::<_, JobError>(()) }
        }),
    );
}

fn every_second(name: &str, catch_up: &str) -> String {
    format!(
        "[[jobs]]\nname = \"{name}\"\nhandler = \"{name}\"\nschedule = \"* * * * * *\"\ncatch_up = \"{catch_up}\"\ncatch_up_window = \"1h\"\n"
    )
}

/// Sorted slots of a ledger.
fn slots(l: &Ledger) -> Vec<u64> {
    let mut v: Vec<u64> = l.0.lock().unwrap().keys().copied().collect();
    v.sort_unstable();
    v
}

/// (slot before, slot after) of every hole in a sorted slot list.
fn gaps(s: &[u64]) -> Vec<(u64, u64)> {
    s.windows(2).filter(|w| w[1] - w[0] > 1).map(|w| (w[0], w[1])).collect()
}

async fn leader(store: &TickerStore) -> Option<String> {
    store.leader().await.unwrap().map(|l| l.id)
}

fn pid_of(id: &str) -> i32 {
    id.split(':').nth(1).unwrap().parse().unwrap()
}

async fn wait_slot_at_least(l: &Ledger, t: DateTime<Utc>, what: &str) {
    let target = u64::try_from(t.timestamp()).unwrap();
    wait_until(what, Duration::from_secs(30), || async { slots(l).last().is_some_and(|s| *s >= target) })
        .await;
}

async fn wait_time(t: DateTime<Utc>) {
    wait_until("clock passes the mark", Duration::from_secs(60), || async { Utc::now() >= t }).await;
}

async fn status_leader(path: &std::path::Path) -> Option<String> {
    let out = tokio::process::Command::new(bin("chime"))
        .arg("--config")
        .arg(path)
        .args(["status", "--json"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["leader"]["id"].as_str().map(str::to_string)
}

/// Two tickers over an every-second `beat` schedule (lease 2 s) and a worker recording slots;
/// returns once one of them leads (`first`) and `min_slots` slots ran.
struct TwoTickers {
    env: TestEnv,
    path: std::path::PathBuf,
    ledger: Ledger,
    worker: Running,
    store: TickerStore,
    a: Child,
    b: Child,
    first: String,
}

/// Config file with an every-second `beat` schedule (ticker lease 2 s), and a running worker
/// whose handler records each slot in the returned ledger.
async fn beat_stack(env: &TestEnv) -> (std::path::PathBuf, chime_shared::ValidConfig, Ledger, Running) {
    let text = env.config_text(
        "quorum",
        "",
        "",
        &format!("[ticker]\nlease = \"2s\"\n{}", every_second("beat", "all")),
    );
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    let ledger = Ledger::default();
    let mut reg = Registry::new();
    slot_recorder(&mut reg, "beat", &ledger);
    let worker = Running::start(config.clone(), reg, 8).await;
    (path, config, ledger, worker)
}

async fn two_tickers(name: &str, min_slots: usize) -> TwoTickers {
    let env = TestEnv::new(name);
    let (path, config, ledger, worker) = beat_stack(&env).await;
    let store = TickerStore::connect(&config.redis, &config.prefix).unwrap();
    let a = Child::ticker(&env.dir, &path, &[], "a");
    wait_until("a leader", Duration::from_secs(20), || async { leader(&store).await.is_some() }).await;
    let b = Child::ticker(&env.dir, &path, &[], "b");
    let l = &ledger;
    wait_until("slots ran", Duration::from_secs(20), || async { l.distinct() >= min_slots }).await;
    let first = leader(&store).await.unwrap();
    TwoTickers { env, path, ledger, worker, store, a, b, first }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_standby_takes_over_and_every_slot_runs_once() {
    let TwoTickers { env: _env, path, ledger, worker, store, a, b, first } = two_tickers("failover", 3).await;
    assert_eq!(status_leader(&path).await.as_deref(), Some(first.as_str()), "status shows the leader");
    let (victim, survivor) = if pid_of(&first) == a.pid() { (a, b) } else { (b, a) };
    victim.signal(9);
    let killed = Utc::now();
    wait_until("standby took over", Duration::from_secs(20), || async {
        leader(&store).await.is_some_and(|id| id != first)
    })
    .await;
    let info = store.leader().await.unwrap().unwrap();
    let failover = (Utc::now() - killed).num_milliseconds() - info.lease_age_ms;
    assert_eq!(pid_of(&info.id), survivor.pid());
    assert_eq!(status_leader(&path).await.as_deref(), Some(info.id.as_str()), "status reflects the change");
    wait_slot_at_least(&ledger, killed + chrono::Duration::seconds(4), "slots after the failover").await;
    let s = slots(&ledger);
    println!(
        "failover: new leader {failover} ms after the SIGKILL (lease 2 s); {} slots, none missing",
        s.len()
    );
    assert!(gaps(&s).is_empty(), "missing slots: {:?}", gaps(&s));
    assert_eq!(ledger.duplicates(), 0, "each slot executed once");
    assert!(failover <= 2_500, "takeover within one lease of the kill: {failover} ms");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_all_tickers_were_down_each_catch_up_policy_is_obeyed() {
    let env = TestEnv::new("catchup");
    let port = free_port();
    let jobs = format!(
        "{}{}{}",
        every_second("c-all", "all"),
        every_second("c-latest", "latest"),
        every_second("c-none", "none")
    );
    let text = env.config_text("classic", "", "", &format!("[ticker]\nlease = \"1s\"\n{jobs}"));
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    let (all, latest, none) = (Ledger::default(), Ledger::default(), Ledger::default());
    let mut reg = Registry::new();
    slot_recorder(&mut reg, "c-all", &all);
    slot_recorder(&mut reg, "c-latest", &latest);
    slot_recorder(&mut reg, "c-none", &none);
    let worker = Running::start(config.clone(), reg, 8).await;

    let t1 = Child::ticker(&env.dir, &path, &[], "t1");
    let n = &none;
    wait_until("slots ran", Duration::from_secs(20), || async { n.distinct() >= 2 }).await;
    t1.signal(9);
    let down = Utc::now();
    wait_time(down + chrono::Duration::seconds(5)).await; // five slots pass with no ticker
    let restarted = Utc::now();
    let _t2 = Child::ticker(&env.dir, &path, &["--listen", &format!("127.0.0.1:{port}")], "t2");
    for (l, name) in [(&all, "all"), (&latest, "latest"), (&none, "none")] {
        wait_slot_at_least(l, restarted + chrono::Duration::seconds(3), name).await;
    }
    let (sa, sl, sn) = (slots(&all), slots(&latest), slots(&none));
    assert!(gaps(&sa).is_empty(), "all: every missed slot caught up: {:?}", gaps(&sa));
    let (gl, gn) = (gaps(&sl), gaps(&sn));
    assert_eq!((gl.len(), gn.len()), (1, 1), "latest {gl:?}, none {gn:?}");
    // Same watermark for all three (advanced together), so: `none` resumes with the first
    // slot after the restart; `latest` ran exactly one more, the last slot due at that point.
    assert_eq!(gl[0].0, gn[0].0, "same last slot before the outage");
    assert_eq!(gl[0].1 + 1, gn[0].1, "latest caught up exactly the newest missed slot");
    assert!(
        gn[0].1 > u64::try_from(restarted.timestamp()).unwrap(),
        "none published nothing from the outage"
    );
    // The ticker counted every slot it will never publish.
    let metrics =
        reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await.unwrap().text().await.unwrap();
    let missed = |job: &str| -> u64 {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("chime_slots_missed_total{{job=\"{job}\"}}")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    // The slots in each gap, plus one when the killed ticker had published the slot before
    // the gap (it ran) but not yet advanced the watermark past it: the new leader will never
    // publish that one either, so it counts it (seen once in CI).
    assert_eq!(missed("c-all"), 0);
    for (job, (last, next)) in [("c-latest", gl[0]), ("c-none", gn[0])] {
        let gap = next - last - 1;
        assert!([gap, gap + 1].contains(&missed(job)), "{job}: gap of {gap}: {metrics}");
    }
    for l in [&all, &latest, &none] {
        assert_eq!(l.duplicates(), 0);
    }
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_brain_after_a_paused_leader_resumes_runs_each_slot_once() {
    let TwoTickers { env: _env, ledger, worker, store, a, b, first, .. } = two_tickers("splitbrain", 2).await;
    let paused = if pid_of(&first) == a.pid() { &a } else { &b };
    paused.signal(19); // SIGSTOP: frozen past its lease
    wait_until("the other ticker took over", Duration::from_secs(20), || async {
        leader(&store).await.is_some_and(|id| id != first)
    })
    .await;
    paused.signal(18); // SIGCONT: it wakes up believing it leads
    let resumed = Utc::now();
    wait_slot_at_least(&ledger, resumed + chrono::Duration::seconds(3), "slots after the resume").await;
    let s = slots(&ledger);
    assert!(gaps(&s).is_empty(), "missing slots: {:?}", gaps(&s));
    assert_eq!(ledger.duplicates(), 0, "each slot executed once");
    let log = std::fs::read_to_string(&paused.log).unwrap();
    assert!(log.contains("lost the leader lease"), "the resumed ticker stood down:\n{log}");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_not_confirmed_during_a_broker_outage_are_published_afterwards() {
    let rabbit = PrivateRabbit::start().await;
    let mut env = TestEnv::new("tickbroker");
    env.amqp_url = rabbit.url();
    let (path, _config, ledger, worker) = beat_stack(&env).await;
    let _t = Child::ticker(&env.dir, &path, &[], "t");
    let l = &ledger;
    wait_until("slots ran", Duration::from_secs(30), || async { l.distinct() >= 2 }).await;
    rabbit.kill().await;
    let down = Utc::now();
    wait_time(down + chrono::Duration::seconds(3)).await;
    rabbit.restart().await;
    wait_slot_at_least(&ledger, Utc::now() + chrono::Duration::seconds(2), "slots after the restart").await;
    // The outage's slots are published again once the broker confirms; their runs may end
    // after those of later slots (one worker runs them side by side).
    let l = &ledger;
    wait_until("the outage's slots ran (retried, not skipped)", Duration::from_secs(30), || async {
        gaps(&slots(l)).is_empty()
    })
    .await;
    assert_eq!(ledger.duplicates(), 0);
    worker.stop().await;
}

#[tokio::test]
async fn jobs_cli_lists_and_computes_slots() {
    let env = TestEnv::new("jobscli");
    let jobs = "[[jobs]]\nname = \"half\"\nhandler = \"noop\"\nschedule = \"*/30 * * * *\"\ntimezone = \"Europe/Berlin\"\n\
                [[jobs]]\nname = \"twice\"\nhandler = \"noop\"\nschedule = \"30 2,14 * * *\"\ntimezone = \"Europe/Berlin\"\n\
                [[jobs]]\nname = \"range\"\nhandler = \"noop\"\nschedule = \"0 30 1-3 * * *\"\ntimezone = \"Europe/Berlin\"\n\
                [[jobs]]\nname = \"adhoc\"\nhandler = \"noop\"\n";
    let path = env.write_config(&env.config_text("classic", "", "", jobs));
    let run = |args: &[&str]| {
        std::process::Command::new(bin("chime")).arg("--config").arg(&path).args(args).output().unwrap()
    };
    let out = run(&["jobs", "next", "half", "--after", "2026-10-24T23:45:00Z", "--count", "5"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "2026-10-25T00:00:00Z\n2026-10-25T00:30:00Z\n2026-10-25T01:00:00Z\n2026-10-25T01:30:00Z\n2026-10-25T02:00:00Z\n",
        "the repeated hour runs at every real instant, monotonic"
    );
    // Hour lists and ranges on Berlin's DST nights (fixed-time jobs: once at the transition
    // in spring, once at the first pass in autumn), as README's table shows.
    for (job, after, want) in [
        ("twice", "2026-03-28T20:00:00Z", "2026-03-29T01:00:00Z\n2026-03-29T12:30:00Z\n"),
        ("twice", "2026-10-24T20:00:00Z", "2026-10-25T00:30:00Z\n2026-10-25T13:30:00Z\n"),
        (
            "range",
            "2026-03-28T20:00:00Z",
            "2026-03-29T00:30:00Z\n2026-03-29T01:00:00Z\n2026-03-29T01:30:00Z\n",
        ),
        (
            "range",
            "2026-10-24T20:00:00Z",
            "2026-10-24T23:30:00Z\n2026-10-25T00:30:00Z\n2026-10-25T02:30:00Z\n",
        ),
    ] {
        let count = want.lines().count().to_string();
        let out = run(&["jobs", "next", job, "--after", after, "--count", &count]);
        assert_eq!(String::from_utf8_lossy(&out.stdout), want, "{job} after {after}");
    }
    let out = run(&["jobs", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("half") && text.contains("Europe/Berlin") && !text.contains("adhoc"), "{text}");
    let out = run(&["jobs", "next", "adhoc"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no schedule"));
    let bad = env.dir.join("bad.toml");
    std::fs::write(
        &bad,
        "[[jobs]]\nname = \"x\"\nhandler = \"noop\"\nschedule = \"* * * * *\"\ntimezone = \"Mars/Olympus\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(bin("chime"))
        .arg("--config")
        .arg(&bad)
        .args(["jobs", "list"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("jobs[0] (x).timezone"));
}

#[tokio::test]
async fn a_slot_picked_up_past_its_deadline_is_skipped_as_expired() {
    let env = TestEnv::new("deadline");
    let jobs = "[[jobs]]\nname = \"beat\"\nhandler = \"beat\"\ndeadline = \"1m\"\n";
    let config = env.config("classic", "", "", jobs);
    let ledger = Ledger::default();
    let mut reg = Registry::new();
    slot_recorder(&mut reg, "beat", &ledger);
    let worker = Running::start(config.clone(), reg, 2).await;
    let conn = connect_amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default()).await.unwrap();
    for age in [3600i64, 5] {
        let slot = DateTime::from_timestamp(Utc::now().timestamp() - age, 0).unwrap();
        let key = chime_shared::envelope::scheduled_key("beat", slot);
        let e = chime_shared::Envelope::new(
            "beat",
            "default",
            key,
            serde_json::Value::Null,
            Some(slot),
            1,
            chime_shared::Source::Schedule,
        );
        chime_shared::amqp::publish_confirmed(
            &ch,
            &env.names().work_exchange(),
            "default",
            &e.encode(),
            e.properties(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    }
    let w = &worker;
    wait_until("one expired, one run", Duration::from_secs(20), || async {
        chime_worker::Stats::get(&w.stats.expired) == 1 && w.succeeded() == 1
    })
    .await;
    assert_eq!(ledger.total(), 1);
    worker.stop().await;
    let _ = conn.close(200, "".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_schedules_without_losing_or_doubling_a_slot() {
    let env = TestEnv::new("reload");
    let text = env.config_text(
        "classic",
        "",
        "",
        &format!("[ticker]\nlease = \"2s\"\n{}", every_second("beat", "all")),
    );
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    let (beat, extra) = (Ledger::default(), Ledger::default());
    let mut reg = Registry::new();
    slot_recorder(&mut reg, "beat", &beat);
    slot_recorder(&mut reg, "extra", &extra);
    let worker = Running::start(config.clone(), reg, 8).await;
    let t = Child::ticker(&env.dir, &path, &[], "t");
    let b = &beat;
    wait_until("slots ran", Duration::from_secs(20), || async { b.distinct() >= 2 }).await;
    std::fs::write(&path, format!("{text}{}", every_second("extra", "all"))).unwrap();
    t.signal(1); // SIGHUP
    let e = &extra;
    wait_until("the added job runs", Duration::from_secs(20), || async { e.distinct() >= 2 }).await;
    wait_slot_at_least(&beat, Utc::now() + chrono::Duration::seconds(1), "beat goes on").await;
    let s = slots(&beat);
    assert!(gaps(&s).is_empty(), "{:?}", gaps(&s));
    assert_eq!(beat.duplicates() + extra.duplicates(), 0);
    worker.stop().await;
}
