//! Sharded and broadcast jobs: a slot (or an enqueue) fans out to one message per shard, or
//! one per live worker, each under its own key; the group record fixes the members so that
//! a second publish of the same run (another ticker, a catch-up) brings the same keys.

use chime_producer::{EnqueueClient, EnqueueRequest, Finished};
use chime_shared::envelope::{Envelope, Source, scheduled_key};
use chime_shared::group::{self, Fan};
use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;

/// `(job, slot or "adhoc", (shard, shards))` of a run.
type Seen = (String, String, Option<(u32, u32)>);

/// Records every run.
fn shard_recorder(seen: &Arc<Mutex<Vec<Seen>>>, name: &str) -> Registry {
    let s = seen.clone();
    let mut r = Registry::new();
    r.register(
        name,
        raw_handler_fn(move |ctx: JobContext, _| {
            let slot = ctx.slot().map(|t| t.to_rfc3339()).unwrap_or_else(|| "adhoc".into());
            s.lock().unwrap().push((ctx.job().to_string(), slot, ctx.shard()));
            let shard = ctx.shard();
            async move {
                if let Some((i, _)) = shard {
                    ctx.set_result(&serde_json::json!({"shard": i, "rows": 100 + i}));
                }
                Ok::<_, JobError>(())
            }
        }),
    );
    r
}

/// Waits for fanned-out run `key` to finish: a group of `n` members, every one done.
async fn wait_group_done(client: &EnqueueClient, key: uuid::Uuid, n: usize) {
    match client.wait(key, Duration::from_secs(60)).await.unwrap() {
        Finished::Group { members } => {
            assert_eq!(members.len(), n);
            assert!(members.iter().all(|m| matches!(m.finished, Finished::Done { .. })), "{members:?}");
        }
        other => panic!("expected a group, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_schedule_runs_every_shard_of_every_slot_once() {
    let env = TestEnv::new("shards");
    let jobs = "[ticker]\nlease = \"2s\"\n\
                [[jobs]]\nname = \"split\"\nhandler = \"split\"\nschedule = \"* * * * * *\"\nshards = 3\n\
                [[jobs]]\nname = \"adhoc-split\"\nhandler = \"split\"\nshards = 4\n";
    // A short lease: a copy that finds its key still running comes back within seconds.
    let text = env.config_text("quorum", "lease = \"2s\"", "", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let worker = Running::start(config.clone(), shard_recorder(&seen, "split"), 8).await;
    let ticker = Child::ticker(&env.dir, &path, &[], "a");
    wait_until("five slots of three shards ran", Duration::from_secs(60), || async {
        let s = seen.lock().unwrap();
        let mut slots: Vec<&String> =
            s.iter().filter(|(j, _, _)| j == "split").map(|(_, slot, _)| slot).collect();
        slots.sort();
        slots.dedup();
        slots.len() >= 6
    })
    .await;
    drop(ticker);
    let runs: Vec<Seen> = seen.lock().unwrap().iter().filter(|(j, _, _)| j == "split").cloned().collect();
    let mut by_slot: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
    for (_, slot, shard) in &runs {
        let (i, n) = shard.expect("every run of a sharded job knows its shard");
        assert_eq!(n, 3);
        by_slot.entry(slot.clone()).or_default().push(i);
    }
    // Every complete slot: shards 0, 1, 2, each once (the last slot may still be running).
    let complete: Vec<_> = by_slot.iter().take(by_slot.len() - 1).collect();
    for (slot, shards) in &complete {
        let mut s = (*shards).clone();
        s.sort_unstable();
        assert_eq!(s, [0, 1, 2], "slot {slot}");
    }
    // `chime inspect --job --slot` shows the slot's three members, done.
    let (slot, _) = complete[1];
    let (code, out, err) = chime(&path, &["inspect", "--job", "split", "--slot", slot], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("fan-out   3 shards") && out.contains("complete: every member is done"), "{out}");
    assert!(out.contains("shard 0") && out.contains("shard 2"), "{out}");

    // Ad hoc: four messages, `--wait` prints each shard's result; the JSON names the members.
    let (code, out, err) =
        chime(&path, &["enqueue", "adhoc-split", "--key", "run-1", "--wait", "--wait-timeout", "60s"], None);
    assert_eq!(code, 0, "{err}");
    for i in 0..4 {
        assert!(out.contains(&format!("shard {i}: {{\"rows\":{},\"shard\":{i}}}", 100 + i)), "{out}");
    }
    worker.stop().await;

    // No worker: the members wait in the queue, and inspect says none has started.
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    let done = client.enqueue(EnqueueRequest::new("adhoc-split").key("run-2")).await.unwrap();
    assert_eq!(done.members.len(), 4);
    let (code, out, _) = chime(&path, &["inspect", &done.key.to_string()], None);
    assert_eq!(code, 0);
    assert!(out.contains("0 of 4 done; 4 not started"), "{out}");
    assert_eq!(out.matches("missing: not started").count(), 4, "{out}");
    // The dashboard's key page shows the same: the run's members, each one missing.
    let (web, base) = crate::web::start_web(&env, &path, &[], &[]).await;
    let page = reqwest::get(format!("{base}/keys/{}", done.key)).await.unwrap().text().await.unwrap();
    assert!(page.contains("id=\"group-state\"") && page.contains("0 of 4 done; 4 not started"), "{page}");
    assert!(page.contains("4 shards") && page.contains("shard 3"), "{page}");
    assert_eq!(page.matches("missing: not started").count(), 4, "{page}");
    for m in &done.members {
        assert!(page.contains(&format!("/keys/{m}")), "a link to member {m}: {page}");
    }
    // The same key again: the same four members (absorbed as duplicates once run).
    let again = client.enqueue(EnqueueRequest::new("adhoc-split").key("run-2")).await.unwrap();
    assert_eq!(again.members, done.members);
    let worker = Running::start(config.clone(), shard_recorder(&seen, "split"), 8).await;
    wait_group_done(&client, done.key, 4).await;
    wait_until("the duplicates are absorbed", Duration::from_secs(30), || async { worker.duplicates() >= 4 })
        .await;
    let adhoc =
        seen.lock().unwrap().iter().filter(|(j, slot, _)| j == "adhoc-split" && slot == "adhoc").count();
    assert_eq!(adhoc, 8, "4 for run-1, 4 for run-2, none twice");
    let page = reqwest::get(format!("{base}/keys/{}", done.key)).await.unwrap().text().await.unwrap();
    assert!(
        page.contains("complete: every member is done") && !page.contains("missing: not started"),
        "{page}"
    );
    drop(web);
    worker.stop().await;
}

/// `pack = 10` on a job of 25 shards: an enqueue and every slot the ticker publishes are 3
/// messages (10, 10, 5 members), not 25, and every member of each still runs once, knowing
/// its shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_packed_sharded_job_sends_its_members_ten_per_message_and_runs_each_once() {
    let env = TestEnv::new("shards-packed");
    let jobs = "[ticker]\nlease = \"2s\"\n\
                [[jobs]]\nname = \"split\"\nhandler = \"split\"\nschedule = \"* * * * * *\"\nshards = 25\npack = 10\n";
    let text = env.config_text("quorum", "lease = \"2s\"", "", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let queue = env.names().work_queue("default");
    // No worker: an enqueue leaves 3 messages for its 25 members.
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    let done = client.enqueue(EnqueueRequest::new("split").key("run-1")).await.unwrap();
    assert_eq!(done.members.len(), 25);
    wait_depth(&queue, 3, Duration::from_secs(10)).await;
    // The ticker adds 3 per slot (it never stands at 25 or 50 as it would unpacked).
    let ticker = Child::ticker(&env.dir, &path, &[], "t");
    wait_until("two slots published as three packs each", Duration::from_secs(30), || {
        let q = queue.clone();
        async move { matches!(depth(&q).await, 9 | 12) }
    })
    .await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let worker = Running::start(config.clone(), shard_recorder(&seen, "split"), 8).await;
    wait_group_done(&client, done.key, 25).await;
    wait_until("five slots ran", Duration::from_secs(60), || async {
        let s = seen.lock().unwrap();
        let slots: std::collections::BTreeSet<&String> =
            s.iter().filter(|(_, slot, _)| slot != "adhoc").map(|(_, slot, _)| slot).collect();
        slots.len() >= 5
    })
    .await;
    drop(ticker);
    let runs: Vec<Seen> = seen.lock().unwrap().clone();
    let mut by_slot: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
    for (_, slot, shard) in &runs {
        let (i, n) = shard.expect("every member of a pack knows its shard");
        assert_eq!(n, 25);
        by_slot.entry(slot.clone()).or_default().push(i);
    }
    let mut adhoc = by_slot.remove("adhoc").unwrap_or_default();
    adhoc.sort_unstable();
    assert_eq!(adhoc, (0..25).collect::<Vec<_>>(), "the enqueue's members, each once");
    // Every complete slot (the last may still be running): shards 0 to 24, each once.
    for (slot, shards) in by_slot.iter().take(by_slot.len() - 1) {
        let mut s = shards.clone();
        s.sort_unstable();
        assert_eq!(s, (0..25).collect::<Vec<_>>(), "slot {slot}");
    }
    worker.stop().await;
}

#[tokio::test]
async fn the_group_record_fixes_the_members_the_first_publish_chose() {
    let env = TestEnv::new("group-fix");
    let config = env.config("quorum", "", "", "");
    let names = env.names();
    let mut conn = chime_shared::redis_conn::RedisConn::connect(&config.redis).await.unwrap();
    let slot = "2026-03-29T01:00:00Z".parse().unwrap();
    let base = Envelope::new(
        "j",
        "default",
        scheduled_key("j", slot),
        serde_json::json!(null),
        Some(slot),
        3,
        Source::Schedule,
    );
    // Two leaders of a split brain counted the workers differently: the first to publish wins.
    let first = group::fix(&mut conn, &names, &base, &Fan::Shards(2), Duration::from_secs(60)).await.unwrap();
    let second =
        group::fix(&mut conn, &names, &base, &Fan::Shards(5), Duration::from_secs(60)).await.unwrap();
    assert_eq!((first.clone(), second), (Fan::Shards(2), Fan::Shards(2)));
    assert_eq!(
        Fan::Shards(2).envelopes(&base).iter().map(|e| e.key).collect::<Vec<_>>(),
        first.members(base.key).iter().map(|m| m.key).collect::<Vec<_>>()
    );
    let read = group::read(&mut conn, &names, base.key).await.unwrap().unwrap();
    assert_eq!((read.job.as_str(), read.fan, read.slot), ("j", Fan::Shards(2), Some(slot)));
}

#[tokio::test]
async fn shards_workers_takes_the_count_of_live_workers_on_the_queue() {
    let env = TestEnv::new("shards-workers");
    let script = env.dir.join("shard.sh");
    std::fs::write(&script, "printf '%s/%s' \"$CHIME_SHARD\" \"$CHIME_SHARDS\" > \"$CHIME_RESULT_FILE\"")
        .unwrap();
    let jobs = format!(
        "[[jobs]]\nname = \"wide\"\nhandler = \"exec\"\ncommand = [\"sh\", \"{}\"]\nshards = \"workers\"\n",
        script.display()
    );
    let text = env.config_text("quorum", "", "", &jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let _a = Child::worker(&env.dir, &path, &[], "a");
    let _b = Child::worker(&env.dir, &path, &[], "b");
    let names = env.names();
    let conn = chime_shared::redis_conn::RedisConn::connect(&config.redis).await.unwrap();
    wait_until("two live workers", Duration::from_secs(30), || {
        let (mut c, n) = (conn.clone(), names.clone());
        async move {
            let beats = chime_shared::control::workers(&mut c, &n).await.unwrap_or_default();
            group::consumers_of(&beats, "default", None).len() == 2
        }
    })
    .await;
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    let done = client.enqueue(EnqueueRequest::new("wide")).await.unwrap();
    assert_eq!(done.members.len(), 2, "one shard per live worker");
    match client.wait(done.key, Duration::from_secs(30)).await.unwrap() {
        Finished::Group { members } => {
            let results: Vec<_> = members
                .iter()
                .map(|m| match &m.finished {
                    Finished::Done { result } => result.as_ref().and_then(|r| r.value()).cloned(),
                    _ => None,
                })
                .collect();
            assert_eq!(results, [Some(serde_json::json!("0/2")), Some(serde_json::json!("1/2"))]);
        }
        other => panic!("expected a group, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broadcast_runs_each_slot_once_on_every_live_worker_and_never_earlier_slots() {
    let env = TestEnv::new("broadcast");
    let ledger = env.dir.join("ledger");
    let jobs = "[ticker]\nlease = \"2s\"\n\
                [[jobs]]\nname = \"refresh\"\nhandler = \"exec\"\nschedule = \"* * * * * *\"\nbroadcast = true\n\
                pass_env = [\"LEDGER\", \"TAG\"]\n\
                command = [\"sh\", \"-c\", \"echo \\\"$CHIME_SLOT $TAG $CHIME_GROUP\\\" >> \\\"$LEDGER\\\"\"]\n";
    let text = env.config_text("quorum", "", "", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let worker = |tag: &str| {
        Child::worker_env(&env.dir, &path, tag, &[("LEDGER", ledger.to_str().unwrap()), ("TAG", tag)])
    };
    let names = env.names();
    let conn = chime_shared::redis_conn::RedisConn::connect(&config.redis).await.unwrap();
    let live = |n: usize| {
        let (conn, names) = (conn.clone(), names.clone());
        async move {
            wait_until(&format!("{n} live workers"), Duration::from_secs(30), || {
                let (mut c, names) = (conn.clone(), names.clone());
                async move {
                    let beats = chime_shared::control::workers(&mut c, &names).await.unwrap_or_default();
                    group::consumers_of(&beats, "default", None).len() == n
                }
            })
            .await;
        }
    };
    let (_a, _b) = (worker("a"), worker("b"));
    live(2).await;
    let ticker = Child::ticker(&env.dir, &path, &[], "t");
    let runs = || -> Vec<(String, String)> {
        crate::common::ledger(&ledger)
            .iter()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                Some((f.next()?.to_string(), f.next()?.to_string()))
            })
            .collect()
    };
    wait_until("three slots on both workers", Duration::from_secs(60), || async {
        let r = runs();
        ["a", "b"].iter().all(|t| r.iter().filter(|(_, w)| w == t).count() >= 3)
    })
    .await;
    // A worker that joins later runs the slots from its start on, never an earlier one.
    let joined = chrono::Utc::now();
    let _c = worker("c");
    live(3).await;
    wait_until("two slots on the late worker", Duration::from_secs(60), || async {
        runs().iter().filter(|(_, w)| w == "c").count() >= 2
    })
    .await;
    drop(ticker);
    let r = runs();
    for (slot, _) in r.iter().filter(|(_, w)| w == "c") {
        let slot: chrono::DateTime<chrono::Utc> = slot.parse().unwrap();
        assert!(
            slot >= joined - chrono::Duration::seconds(1),
            "worker c ran slot {slot}, before it joined at {joined}"
        );
    }
    // Each slot once per worker.
    let mut counts: std::collections::BTreeMap<(String, String), usize> = Default::default();
    for run in &r {
        *counts.entry(run.clone()).or_default() += 1;
    }
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    let slots: std::collections::BTreeSet<&String> = r.iter().map(|(s, _)| s).collect();
    let (first, last) = (slots.iter().next().unwrap(), slots.iter().next_back().unwrap());
    for s in slots.iter().filter(|s| *s != first && *s != last) {
        for w in ["a", "b"] {
            assert!(
                counts.contains_key(&((*s).clone(), w.to_string())),
                "slot {s} did not run on {w}: {counts:?}"
            );
        }
    }
    // inspect shows the slot's copies, one per worker, done.
    let some = slots.iter().nth(1).unwrap();
    let (code, out, err) = chime(&path, &["inspect", "--job", "refresh", "--slot", some], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("fan-out   broadcast to 2 workers") && out.contains("complete"), "{out}");
    // Ad hoc: one copy per live worker, now three.
    let (code, out, err) = chime(&path, &["enqueue", "refresh", "--wait", "--wait-timeout", "60s"], None);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().filter(|l| l.starts_with("worker ") && l.ends_with(": done")).count(), 3, "{out}");
}
