//! Seeing and steering: run history, `chime inspect`, worker heartbeats, pause and resume of
//! queues and schedules, `chime run`.

use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;

/// `count` (records `payload.n`) and `doomed` (fails for good).
fn registry(ledger: &Ledger) -> Registry {
    let mut r = counting_registry(ledger);
    r.register("doomed", raw_handler_fn(|_, _| async { Err(JobError::permanent("the invoice is empty")) }));
    r
}

const JOBS: &str = "[[jobs]]\nname = \"count\"\nhandler = \"count\"\n\
                    [[jobs]]\nname = \"doomed\"\nhandler = \"doomed\"\n";

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_and_inspect_answer_did_it_run_and_how() {
    let env = TestEnv::new("history");
    let text = env.config_text("classic", "", "", JOBS);
    let path = env.write_config(&text);
    let ledger = Ledger::default();
    let worker = Running::start(env.config("classic", "", "", JOBS), registry(&ledger), 4).await;

    let (code, out, err) =
        chime(&path, &["enqueue", "count", "--key", "manual-1", "--payload", r#"{"n":1}"#], None);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!err.contains("warning"), "a fresh key: {err}");
    let l = ledger.clone();
    wait_until("count ran", Duration::from_secs(20), || {
        let l = l.clone();
        async move { l.get(1) == 1 }
    })
    .await;
    // The second enqueue of the same key says why nothing will happen.
    let key = chime_shared::envelope::adhoc_key("count", "manual-1").to_string();
    let e = env.names().idem_key(&key);
    wait_until("done recorded", Duration::from_secs(10), || {
        let (env, e) = (&env, e.clone());
        async move {
            let mut r = connect_redis(&env.redis_url).await;
            let s: Option<String> = redis::cmd("HGET").arg(&e).arg("s").query_async(&mut r).await.unwrap();
            s.as_deref() == Some("done")
        }
    })
    .await;
    let (code, _, err) =
        chime(&path, &["enqueue", "count", "--key", "manual-1", "--payload", r#"{"n":1}"#], None);
    assert_eq!(code, 0, "a warning, not an error");
    assert!(
        err.contains(&format!("warning: key {key} is already done at ")) && err.contains("new --key"),
        "{err}"
    );

    let (code, out, err) = chime(&path, &["enqueue", "doomed", "--key", "inv-7", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let doomed_key = json(&out)["key"].as_str().unwrap().to_string();
    wait_depth(&env.names().dlq("default"), 1, Duration::from_secs(20)).await;

    // History, newest first: the dead letter with its reason and error, the success, and
    // the absorbed duplicate recorded nowhere.
    let runs = || {
        let (code, out, err) = chime(&path, &["history", "--json"], None);
        assert_eq!(code, 0, "{err}");
        json(&out)["runs"].as_array().cloned().unwrap_or_default()
    };
    wait_until("both runs in the history", Duration::from_secs(10), || {
        let n = runs().len();
        async move { n == 2 }
    })
    .await;
    let all = runs();
    assert_eq!(all[0]["job"], "doomed");
    assert_eq!(all[0]["outcome"], "dead_lettered");
    assert_eq!(all[0]["reason"], "permanent");
    assert!(all[0]["error"].as_str().unwrap().contains("the invoice is empty"), "{all:?}");
    assert_eq!(all[1]["job"], "count");
    assert_eq!(all[1]["outcome"], "succeeded");
    assert_eq!(all[1]["key"], key.as_str());
    assert_eq!(all[1]["attempt"], 1);
    assert!(all[1]["worker"].as_str().is_some_and(|w| !w.is_empty()));
    assert!(all[1]["started_at"].is_string() && all[1]["duration_ms"].is_number());
    let (_, out, _) = chime(&path, &["history", "--outcome", "dead_lettered"], None);
    assert!(out.contains("doomed") && !out.contains(" count "), "{out}");
    let (_, out, _) = chime(&path, &["history", "--job", "count", "--json"], None);
    assert_eq!(json(&out)["runs"].as_array().unwrap().len(), 1);
    let (code, _, err) = chime(&path, &["history", "--outcome", "exploded"], None);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("dead_lettered"), "the valid outcomes are listed: {err}");

    // One key: derived from the job and the user's key.
    let (code, out, err) = chime(&path, &["inspect", "--job", "count", "--key", "manual-1"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&key) && out.contains("state     done"), "{out}");
    assert!(out.contains("succeeded") && out.contains("dead letters: none"), "{out}");
    let (code, out, err) = chime(&path, &["inspect", &doomed_key, "--json"], None);
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    assert_eq!(v["record"]["state"], "dead");
    assert_eq!(v["record"]["runs"][0]["outcome"], "dead_lettered");
    assert_eq!(v["dead_letters"].as_array().unwrap().len(), 1, "its copy in the DLQ: {v}");
    assert!(v["record"]["expires_in_ms"].as_i64().unwrap() > 0);
    let (code, out, _) = chime(&path, &["inspect", "00000000-0000-0000-0000-000000000000"], None);
    assert_eq!(code, 0);
    assert!(out.contains("record    none"), "{out}");
    let (code, _, err) = chime(&path, &["inspect", "manual-1"], None);
    assert_eq!(code, 2);
    assert!(err.contains("--job JOB --key K"), "{err}");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_can_be_switched_off() {
    let env = TestEnv::new("history-off");
    let ledger = Ledger::default();
    let config = env.config("classic", "", "", &format!("[history]\nenabled = false\n{JOBS}"));
    let worker = Running::start(config.clone(), registry(&ledger), 4).await;
    let client = chime_producer::EnqueueClient::connect(config).await.unwrap();
    client
        .enqueue(chime_producer::EnqueueRequest::new("count").payload(serde_json::json!({"n": 5})))
        .await
        .unwrap();
    let l = ledger.clone();
    wait_until("count ran", Duration::from_secs(20), || {
        let l = l.clone();
        async move { l.get(5) == 1 }
    })
    .await;
    worker.stop().await;
    let mut r = connect_redis(&env.redis_url).await;
    let len: u64 = redis::cmd("XLEN").arg(env.names().history("default")).query_async(&mut r).await.unwrap();
    assert_eq!(len, 0, "nothing recorded");
}

/// Entries and runs in the `default` queue's history stream.
async fn history_size(env: &TestEnv) -> (usize, usize) {
    let (entries, runs) = history_runs(env).await;
    (entries, runs.len())
}

/// A worker SIGKILLed mid-drain loses no history: the moment every key is `done`, every key
/// has its `succeeded` run in the stream (a run reaches the stream ahead of the script that
/// records its outcome, in the same pipeline). Counting history then equals counting done
/// keys; a run the killed worker streamed but could not record ran again, and both runs are
/// in the history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_after_a_sigkill_counts_every_done_key() {
    use chime_shared::history::Outcome;
    use chime_shared::record::KeyState;
    const N: usize = 3000;
    let env = TestEnv::new("history-kill");
    let jobs = "[[jobs]]\nname = \"tick\"\nhandler = \"exec\"\ncommand = [\"true\"]\n";
    let path = env.write_config(&env.config_text("classic", "", "", jobs));
    let config = chime_shared::Config::from_toml_str(&env.config_text("classic", "", "", jobs)).unwrap();
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let reqs: Vec<_> =
        (0..N).map(|n| chime_producer::EnqueueRequest::new("tick").key(format!("t{n}"))).collect();
    let keys: Vec<String> =
        reqs.iter().map(|r| client.prepare(r).unwrap().envelope.key.to_string()).collect();
    let report = client.enqueue_batch(&reqs).await.unwrap();
    assert_eq!(report.confirmed, N, "{:?}", report.error);
    let reader = chime_shared::history::HistoryReader::connect(&config.redis, env.names()).await.unwrap();
    let done = |reader: chime_shared::history::HistoryReader, keys: Vec<String>| async move {
        let states = reader.states(&keys).await.unwrap();
        states.iter().filter(|s| matches!(s, Some((KeyState::Done, _)))).count()
    };
    let a = Child::worker(&env.dir, &path, &["--concurrency", "4"], "a");
    let (r, k) = (reader.clone(), keys.clone());
    wait_until("500 keys done on worker A", Duration::from_secs(60), || {
        let (r, k) = (r.clone(), k.clone());
        async move { done(r, k).await >= 500 }
    })
    .await;
    a.signal(9);
    let mut a = a;
    let _ = a.child.wait().await;
    let at_kill = done(reader.clone(), keys.clone()).await;
    assert!(at_kill < N, "A was killed mid-drain (it had done {at_kill} of {N})");
    let b = Child::worker(&env.dir, &path, &["--concurrency", "4"], "b");
    let (r, k) = (reader.clone(), keys.clone());
    wait_until("every key done on worker B", Duration::from_secs(120), || {
        let (r, k) = (r.clone(), k.clone());
        async move { done(r, k).await == N }
    })
    .await;
    // At once, without waiting for B to stop or for anything to be flushed.
    let (_, runs) = history_runs(&env).await;
    let succeeded: Vec<_> = runs.iter().filter(|e| e.outcome == Outcome::Succeeded).collect();
    let with_run: BTreeSet<&str> = succeeded.iter().map(|e| e.key.as_str()).collect();
    let missing: Vec<_> = keys.iter().filter(|k| !with_run.contains(k.as_str())).collect();
    assert!(
        missing.is_empty(),
        "{} of {N} done keys have no `succeeded` run in the history (A had done {at_kill} when killed), e.g. {:?}",
        missing.len(),
        missing.iter().take(3).collect::<Vec<_>>()
    );
    // Runs streamed without their `done` (the kill fell between the two) ran again on B:
    // at most A's runs in flight.
    let again = succeeded.len() - N;
    assert!(again <= 4 * 2, "{again} runs recorded twice: more than A had in flight");
    let (code, out, err) = chime(&path, &["history", "--since", "1h", "--totals", "--json"], None);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["by_job"]["tick"]["succeeded"], u64::try_from(succeeded.len()).unwrap(), "{out}");
    // A window reaching back before 1970 is the whole history (not a negative stream id).
    let (code, all, err) = chime(&path, &["history", "--since", "100000d", "--totals", "--json"], None);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&all)["by_job"]["tick"], json(&out)["by_job"]["tick"], "{all}");
    drop(b);
}

/// `entries-added` of the `default` queue's history stream (Redis 7): every entry ever appended.
async fn entries_added(env: &TestEnv) -> u64 {
    let mut r = connect_redis(&env.redis_url).await;
    let info: Vec<redis::Value> = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(env.names().history("default"))
        .query_async(&mut r)
        .await
        .unwrap();
    let i =
        info.iter().position(|v| matches!(v, redis::Value::BulkString(b) if b == b"entries-added")).unwrap();
    redis::from_redis_value::<u64>(info[i + 1].clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_capped_by_length_and_age() {
    let env = TestEnv::new("history-cap");
    // Tiny caps: 100 runs (13 entries of up to 8 runs); a 1 s age.
    let jobs = format!("[history]\nmax_len = 100\nmax_age = \"1s\"\n{JOBS}");
    let config = env.config("classic", "", "", &jobs);
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), registry(&ledger), 32).await;
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let reqs: Vec<_> = (0..1000)
        .map(|n| chime_producer::EnqueueRequest::new("count").payload(serde_json::json!({ "n": n })))
        .collect();
    client.enqueue_batch(&reqs).await.unwrap();
    let l = ledger.clone();
    wait_until("1000 ran", Duration::from_secs(60), || {
        let l = l.clone();
        async move { l.distinct() == 1000 }
    })
    .await;
    // A worker writes the runs it still holds as it stops.
    worker.stop().await;
    let added = entries_added(&env).await;
    assert!(added >= 125, "1000 runs in entries of at most 8: {added} entries");
    let (entries, runs) = history_size(&env).await;
    assert!(entries == 13 && runs <= 104, "capped by length: {entries} entries, {runs} runs");
    assert!(runs >= 13, "the newest entries are kept: {runs} runs");
    // Age: once every run is older than 1 s, the next write drops them.
    let written = std::time::Instant::now();
    wait_until("the runs are older than max_age", Duration::from_secs(5), || async move {
        written.elapsed() > Duration::from_millis(1100)
    })
    .await;
    let worker = Running::start(config.clone(), registry(&ledger), 32).await;
    client.enqueue_batch(&reqs[..200]).await.unwrap();
    let l = ledger.clone();
    wait_until("200 more ran", Duration::from_secs(60), || {
        let l = l.clone();
        async move { (0..200).all(|n| l.get(n) == 2) }
    })
    .await;
    worker.stop().await;
    let (_, runs) = history_size(&env).await;
    assert!(runs <= 200, "trimmed by age: {runs} runs left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_are_listed_with_their_running_jobs_and_vanish_when_stopped() {
    let env = TestEnv::new("workers");
    let jobs =
        "[[jobs]]\nname = \"slow\"\nhandler = \"exec\"\ncommand = [\"sleep\", \"30\"]\ntimeout = \"60s\"\n";
    let path = env.write_config(&env.config_text("classic", "", "", jobs));
    let mut worker = Child::worker(&env.dir, &path, &["--concurrency", "3"], "w");
    let (code, out, err) = chime(&path, &["enqueue", "slow", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let key = json(&out)["key"].as_str().unwrap().to_string();
    let p = path.clone();
    wait_until("the running job in the heartbeat", Duration::from_secs(20), || {
        let (_, out, _) = chime(&p, &["workers", "--json"], None);
        let k = key.clone();
        async move {
            let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            v[0]["running"][0]["key"] == k.as_str()
        }
    })
    .await;
    let (_, out, _) = chime(&path, &["workers", "--json"], None);
    let w = &json(&out)[0];
    assert_eq!(w["pid"], worker.pid());
    assert_eq!(w["concurrency"], 3);
    assert_eq!(w["queues"], serde_json::json!(["default"]));
    assert_eq!(w["running"][0]["job"], "slow");
    let (_, out, _) = chime(&path, &["workers"], None);
    assert!(out.contains("RUNNING JOB") && out.contains("slow"), "{out}");
    let (_, out, _) = chime(&path, &["status"], None);
    assert!(out.contains(&w["id"].as_str().unwrap().to_string()), "status lists the workers: {out}");
    worker.signal(libc::SIGKILL);
    worker.child_exited();
    // A killed worker's beat expires; a stopped one deletes it (tested by the in-process
    // workers of the pause test). Here: gone within the TTL.
    wait_until("the dead worker disappears", Duration::from_secs(30), || {
        let (_, out, _) = chime(&path, &["workers", "--json"], None);
        async move { out.trim() == "[]" }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_queue_is_not_consumed_until_resumed() {
    let env = TestEnv::new("pause-q");
    let path = env.write_config(&env.config_text("classic", "", "", JOBS));
    let ledger = Ledger::default();
    let worker = Running::start(env.config("classic", "", "", JOBS), registry(&ledger), 4).await;
    let (code, out, err) = chime(&path, &["pause", "queue", "default"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("paused queue default"), "{out}");
    let h = worker.health.clone();
    wait_until("the worker stopped consuming", Duration::from_secs(10), || {
        let h = h.clone();
        async move { !h.get("consuming") }
    })
    .await;
    let conn = connect_amqp().await;
    let consumers = || async {
        chime_shared::topology::depth(&conn, &env.names().work_queue("default")).await.map(|d| d.1).unwrap()
    };
    assert_eq!(consumers().await, 0, "no consumer on a paused queue");
    let batch: String = (0..5).map(|n| format!("{{\"n\":{n}}}\n")).collect();
    let (code, _, err) = chime(&path, &["enqueue", "count", "--batch", "-"], Some(&batch));
    assert_eq!(code, 0, "{err}");
    let (_, out, _) = chime(&path, &["status"], None);
    assert!(out.contains("paused by"), "{out}");
    let (_, out, _) = chime(&path, &["pause", "queue", "default"], None);
    assert!(out.contains("already paused"), "{out}");
    assert_eq!(depth(&env.names().work_queue("default")).await, 5, "waiting, not consumed");
    assert_eq!(ledger.distinct(), 0);
    let (code, out, _) = chime(&path, &["resume", "queue", "default"], None);
    assert_eq!(code, 0);
    assert!(out.contains("resumed queue default"), "{out}");
    let l = ledger.clone();
    wait_until("the 5 jobs ran after the resume", Duration::from_secs(20), || {
        let l = l.clone();
        async move { l.distinct() == 5 }
    })
    .await;
    assert_eq!(consumers().await, 1);
    let (code, _, err) = chime(&path, &["pause", "queue", "nope"], None);
    assert_eq!(code, 2, "an unknown queue is named: {err}");
    let _ = conn.close(200, "".into()).await;
    worker.stop().await;
    let mut r = connect_redis(&env.redis_url).await;
    let beats: u32 = redis::cmd("EXISTS")
        .arg(env.names().worker(&chime_shared::names::process_name()))
        .query_async(&mut r)
        .await
        .unwrap();
    assert_eq!(beats, 0, "a stopped worker deletes its heartbeat");
}

/// A scheduled job whose runs record their slot.
fn slot_registry(slots: &Arc<Mutex<BTreeSet<i64>>>) -> Registry {
    let s = slots.clone();
    let mut r = Registry::new();
    r.register(
        "tick",
        raw_handler_fn(move |ctx: JobContext, _| {
            let s = s.clone();
            async move {
                if let Some(slot) = ctx.slot() {
                    s.lock().unwrap().insert(slot.timestamp());
                }
                Ok::<_, JobError>(())
            }
        }),
    );
    r
}

/// A resume's catch-up ends at Redis `TIME`, as the pause flag was stamped: `chime resume
/// --catch-up` on a host an hour ahead published every slot of the hour to come at once (each
/// would have run early, and the ticker's own copy been absorbed as a duplicate).
#[tokio::test]
async fn a_resume_whose_clock_is_ahead_catches_up_no_slot_that_is_not_due() {
    let env = TestEnv::new("pause-skew");
    let jobs = "[[jobs]]\nname = \"tick\"\nhandler = \"tick\"\nschedule = \"* * * * * *\"\n";
    let path = env.write_config(&env.config_text("classic", "", "", jobs));
    let (code, _, err) = chime(&path, &["pause", "schedule", "tick"], None);
    assert_eq!(code, 0, "{err}");
    let ahead = chime_tests::faked_clock("+3600");
    let ahead: Vec<(&str, &std::ffi::OsStr)> =
        ahead.iter().map(|(k, v)| (*k, std::ffi::OsStr::new(v))).collect();
    let (code, out, err) = chime_env(&path, &["resume", "schedule", "tick", "--catch-up"], None, &ahead);
    assert_eq!(code, 0, "{err}");
    let published: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("published ")?.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no count in {out}"));
    // The seconds between the pause and the resume, not the hour ahead.
    assert!(published < 30, "{published} slots caught up:\n{out}");
    wait_depth(
        &env.names().work_queue("default"),
        u32::try_from(published).unwrap(),
        Duration::from_secs(10),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_schedule_skips_its_slots_and_resume_catches_up_only_when_asked() {
    let env = TestEnv::new("pause-s");
    let jobs = "[[jobs]]\nname = \"tick\"\nhandler = \"tick\"\nschedule = \"* * * * * *\"\n";
    let path = env.write_config(&env.config_text("classic", "", "", jobs));
    let slots = Arc::new(Mutex::new(BTreeSet::new()));
    let worker = Running::start(env.config("classic", "", "", jobs), slot_registry(&slots), 8).await;
    let _ticker = Child::ticker(&env.dir, &path, &[], "t");
    let s = slots.clone();
    wait_until("slots run", Duration::from_secs(30), || {
        let s = s.clone();
        async move { s.lock().unwrap().len() >= 2 }
    })
    .await;
    let paused_count = || async {
        let mut r = connect_redis(&env.redis_url).await;
        let n: Option<u64> = redis::cmd("HGET")
            .arg(format!("{}:ticker:counts", env.prefix))
            .arg("tick:paused")
            .query_async(&mut r)
            .await
            .unwrap();
        n.unwrap_or(0)
    };

    // Pause, no catch-up: the skipped slots never run.
    let (code, _, err) = chime(&path, &["pause", "schedule", "tick"], None);
    assert_eq!(code, 0, "{err}");
    wait_until("3 slots skipped", Duration::from_secs(20), || async { paused_count().await >= 3 }).await;
    let (code, out, _) = chime(&path, &["resume", "schedule", "tick"], None);
    assert_eq!(code, 0);
    assert!(out.contains("resumed schedule tick"), "{out}");
    let skipped_until = chrono::Utc::now().timestamp();
    let s = slots.clone();
    wait_until("slots run again", Duration::from_secs(20), || {
        let s = s.clone();
        async move { s.lock().unwrap().range(skipped_until + 1..).count() >= 2 }
    })
    .await;
    let ran: Vec<i64> = slots.lock().unwrap().iter().copied().collect();
    let gaps = ran.windows(2).filter(|w| w[1] - w[0] > 1).count();
    assert_eq!(gaps, 1, "one hole where the schedule was paused: {ran:?}");
    let hole = ran.windows(2).find(|w| w[1] - w[0] > 1).map(|w| w[1] - w[0] - 1).unwrap();
    assert!(hole >= 3, "at least the 3 counted slots were skipped: {ran:?}");

    // Pause, then resume with --catch-up: the skipped slots are published after all.
    let before = paused_count().await;
    let (code, _, _) = chime(&path, &["pause", "schedule", "tick"], None);
    assert_eq!(code, 0);
    wait_until("3 more slots skipped", Duration::from_secs(20), || async {
        paused_count().await >= before + 3
    })
    .await;
    let (code, out, err) = chime(&path, &["resume", "schedule", "tick", "--catch-up"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("slot(s) skipped while paused"), "{out}");
    let s = slots.clone();
    let last_hole_end = chrono::Utc::now().timestamp();
    wait_until("the caught-up slots ran", Duration::from_secs(20), || {
        let s = s.clone();
        async move {
            let ran: Vec<i64> = s.lock().unwrap().range(..last_hole_end).copied().collect();
            let holes = ran.windows(2).filter(|w| w[1] - w[0] > 1).count();
            holes == 1 // only the first pause's hole is left
        }
    })
    .await;
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_triggers_a_job_now_with_a_key_of_its_own() {
    let env = TestEnv::new("run-now");
    let jobs =
        "[[jobs]]\nname = \"count\"\nhandler = \"count\"\nschedule = \"0 3 * * *\"\npayload = { n = 42 }\n";
    let path = env.write_config(&env.config_text("classic", "", "", jobs));
    let ledger = Ledger::default();
    let worker = Running::start(env.config("classic", "", "", jobs), counting_registry(&ledger), 2).await;
    let (code, out, err) = chime(&path, &["run", "count", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let first = json(&out)["key"].as_str().unwrap().to_string();
    let (code, out, _) = chime(&path, &["run", "count", "--json"], None);
    assert_eq!(code, 0);
    assert_ne!(json(&out)["key"].as_str().unwrap(), first, "each run is a new key");
    let l = ledger.clone();
    wait_until("both runs, with the configured payload", Duration::from_secs(20), || {
        let l = l.clone();
        async move { l.get(42) == 2 }
    })
    .await;
    let (code, _, err) = chime(&path, &["run", "nope"], None);
    assert_eq!(code, 2, "{err}");
    worker.stop().await;
}

/// Paging through the history: 21 runs in entries of 8, 8 and 5, read 5 at a time (pages end
/// inside entries) and 3 at a time with a job filter; each run once, newest first, none
/// skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_pages_continue_inside_entries_without_gaps_or_repeats() {
    use chime_shared::history::{HistoryReader, Outcome, Query, RunEvent, encode_entry};
    let env = TestEnv::new("history-pages");
    let mut r = connect_redis(&env.redis_url).await;
    let stream = env.names().history("default");
    let t0 = chrono::Utc::now();
    let run = |n: i64| RunEvent {
        job: if n % 3 == 0 { "three".into() } else { "other".into() },
        key: format!("k{n}"),
        id: format!("i{n}"),
        queue: "default".into(),
        attempt: 1,
        max_attempts: 1,
        worker: "w".into(),
        started_at: None,
        finished_at: t0 + chrono::Duration::milliseconds(n),
        outcome: Outcome::Succeeded,
        duration_ms: None,
        reason: None,
        error: None,
        entry: None,
    };
    for chunk in [0..8i64, 8..16, 16..21] {
        let values: Vec<[String; 4]> = chunk.map(|n| run(n).stream_values()).collect();
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("runs")
            .arg(encode_entry(&values))
            .query_async(&mut r)
            .await
            .unwrap();
    }
    let reader = HistoryReader::connect(&env.config("classic", "", "", "").redis, env.names()).await.unwrap();
    let queues = vec!["default".to_string()];
    let page_through = |job: Option<&'static str>, limit: usize| {
        let reader = reader.clone();
        let queues = queues.clone();
        async move {
            let mut seen = Vec::new();
            let mut before = None;
            for _ in 0..30 {
                let q =
                    Query { job: job.map(str::to_string), before: before.clone(), limit, ..Query::default() };
                let found = reader.search(&queues, &q).await.unwrap();
                if found.events.is_empty() {
                    return seen;
                }
                seen.extend(found.events.iter().map(|e| e.key.clone()));
                before = found.events.last().and_then(|e| e.entry.clone());
            }
            panic!("paging never ended: {seen:?}");
        }
    };
    let all: Vec<String> = (0..21).rev().map(|n| format!("k{n}")).collect();
    assert_eq!(page_through(None, 5).await, all, "5 at a time");
    let threes: Vec<String> = (0..21).rev().filter(|n| n % 3 == 0).map(|n| format!("k{n}")).collect();
    assert_eq!(page_through(Some("three"), 3).await, threes, "filtered, 3 at a time");
}

/// Liveness is judged by Redis time, not by the clocks of the worker and the reader: a worker
/// whose clock is two minutes behind is listed by a `chime workers` on a correct clock (the
/// index used to be pruned by the reader's clock against scores written by the worker's).
#[tokio::test]
async fn a_worker_with_a_skewed_clock_is_still_listed() {
    let env = TestEnv::new("workers-skew");
    let path =
        env.write_config(&env.config_text("classic", "", "", "[[jobs]]\nname = \"n\"\nhandler = \"noop\"\n"));
    let worker = Child::with_clock("chime-worker", &env.dir, &path, &[], "-120", "worker-behind", &[]);
    let pid = worker.pid();
    let p = path.clone();
    wait_until("the worker two minutes behind is listed", Duration::from_secs(30), || {
        let (_, out, _) = chime(&p, &["workers", "--json"], None);
        async move {
            let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            v.as_array().is_some_and(|ws| ws.iter().any(|w| w["pid"] == pid))
        }
    })
    .await;
    // Listed for longer than the one-minute grace the index gives: not pruned as stale.
    let mut r = connect_redis(&env.redis_url).await;
    let (_, score): (String, f64) = redis::cmd("ZRANGE")
        .arg(env.names().workers_index())
        .arg(0)
        .arg(0)
        .arg("WITHSCORES")
        .query_async::<Vec<(String, f64)>>(&mut r)
        .await
        .unwrap()
        .into_iter()
        .next()
        .expect("the worker is in the index");
    let (secs, _micros): (i64, i64) = redis::cmd("TIME").query_async(&mut r).await.unwrap();
    let ahead = score / 1000.0 - secs as f64;
    assert!(
        (0.0..=20.0).contains(&ahead),
        "the index entry expires {ahead:.1} s from Redis's now (its TTL), by Redis time"
    );
}

/// The history is trimmed to `history.max_age` by Redis time, as its entries' ids are: a
/// worker whose clock is two days ahead keeps the runs it records (its own clock less a day
/// used to trim away every entry, its own included), and counts them in Redis's minutes (its
/// per-minute totals were two days in the future, past every chart).
#[tokio::test]
async fn a_worker_whose_clock_is_days_ahead_keeps_the_history() {
    let env = TestEnv::new("history-skew");
    let text = env.config_text("classic", "", "", "[[jobs]]\nname = \"n\"\nhandler = \"noop\"\n");
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let worker = Child::with_clock("chime-worker", &env.dir, &path, &[], "+172800", "worker-ahead", &[]);
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let mut keys = Vec::new();
    for i in 0..3 {
        keys.push(
            client.enqueue(chime_producer::EnqueueRequest::new("n").key(format!("k{i}"))).await.unwrap().key,
        );
    }
    let wanted: Vec<String> = keys.iter().map(ToString::to_string).collect();
    let e = &env;
    // Recorded after each run is done: its history entry follows in the worker's next write.
    wait_until("the runs are in the history", Duration::from_secs(30), || {
        let wanted = wanted.clone();
        async move {
            let (_, runs) = history_runs(e).await;
            wanted.iter().all(|k| {
                runs.iter().any(|r| &r.key == k && r.outcome == chime_shared::history::Outcome::Succeeded)
            })
        }
    })
    .await;
    // Its per-minute totals (the dashboard's charts) are counted in Redis's minutes too.
    let mut r = connect_redis(&env.redis_url).await;
    let (secs, _): (i64, i64) = redis::cmd("TIME").query_async(&mut r).await.unwrap();
    let minute = chime_shared::minutes::minute_of(chrono::DateTime::from_timestamp(secs, 0).unwrap());
    let names = env.names();
    wait_until("the runs in this minute's totals", Duration::from_secs(30), || {
        let (mut r, names) = (r.clone(), names.clone());
        async move {
            let minutes = chime_shared::minutes::read(&mut r, &names, minute - 2, minute + 2).await.unwrap();
            minutes.iter().map(|m| m.counts.outcomes.get("succeeded").copied().unwrap_or(0)).sum::<u64>() == 3
        }
    })
    .await;
    drop(worker);
}

/// A job's `deadline` is judged by Redis time: a worker whose clock is ten minutes ahead runs a
/// slot that is due now (it used to skip it as `expired`, and every slot after it), and still
/// skips one that is ten minutes late. Its offset is exported as
/// `chime_worker_clock_skew_seconds`.
#[tokio::test]
async fn a_worker_whose_clock_is_ahead_does_not_expire_slots_on_time() {
    let env = TestEnv::new("deadline-skew");
    let port = free_port();
    let jobs = "[[jobs]]\nname = \"pay\"\nhandler = \"noop\"\ndeadline = \"5m\"\n";
    let text = env.config_text("classic", "", &format!("listen = \"127.0.0.1:{port}\""), jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let worker = Child::with_clock("chime-worker", &env.dir, &path, &[], "+600", "worker-ahead", &[]);
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let mut r = connect_redis(&env.redis_url).await;
    let (secs, _): (i64, i64) = redis::cmd("TIME").query_async(&mut r).await.unwrap();
    let redis_now = chrono::DateTime::from_timestamp(secs, 0).unwrap();
    // Slots as a ticker on Redis time publishes them: one due now, one ten minutes late.
    let slot = |key: &str, at| {
        let mut p = client.prepare(&chime_producer::EnqueueRequest::new("pay").key(key)).unwrap();
        p.envelope.slot = Some(at);
        p
    };
    let (on_time, late) =
        (slot("on-time", redis_now), slot("late", redis_now - chrono::Duration::minutes(10)));
    let keys = [on_time.envelope.key.to_string(), late.envelope.key.to_string()];
    assert_eq!(client.send_batch(&[on_time, late]).await.confirmed, 2);
    let e = &env;
    wait_until("both slots are in the history", Duration::from_secs(30), || {
        let keys = keys.clone();
        async move {
            let runs = history_runs(e).await.1;
            keys.iter().all(|k| runs.iter().any(|r| &r.key == k))
        }
    })
    .await;
    let (_, runs) = history_runs(&env).await;
    let outcome = |k: &str| runs.iter().find(|r| r.key == k).map(|r| r.outcome.as_str());
    assert_eq!(outcome(&keys[0]), Some("succeeded"), "the slot due now runs");
    assert_eq!(outcome(&keys[1]), Some("expired"), "the slot ten minutes late is past its deadline");
    // The history says when it ran by Redis's clock, not the worker's ten minutes ahead.
    let ran = runs.iter().find(|r| r.key == keys[0]).unwrap();
    let off = (ran.finished_at - redis_now).num_seconds();
    assert!((0..120).contains(&off), "finished {off} s after the slot was published");
    let metrics =
        reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await.unwrap().text().await.unwrap();
    let skew: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("chime_worker_clock_skew_seconds "))
        .and_then(|v| v.parse().ok())
        .expect("the skew is exported");
    assert!((590.0..610.0).contains(&skew), "the worker's clock is 600 s ahead: {skew}");
    drop(worker);
}

/// A worker that stops is listed among the workers gone, as `stopped`, with its totals; what
/// it settled is in the per-minute totals the dashboard charts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_worker_is_listed_as_gone_and_its_runs_are_in_the_minute_totals() {
    let env = TestEnv::new("gone");
    let config = env.config("classic", "", "", COUNT_JOB);
    let ledger = Ledger::default();
    let worker = Running::start(config.clone(), counting_registry(&ledger), 4).await;
    let client = chime_producer::EnqueueClient::connect(config.clone()).await.unwrap();
    let from = chime_shared::minutes::minute_of(chrono::Utc::now());
    for n in 0..3 {
        client
            .enqueue(chime_producer::EnqueueRequest::new("count").payload(serde_json::json!({"n": n})))
            .await
            .unwrap();
    }
    let l = ledger.clone();
    wait_until("3 runs", Duration::from_secs(30), || {
        let l = l.clone();
        async move { l.distinct() == 3 }
    })
    .await;
    let mut r = connect_redis(&env.redis_url).await;
    let names = env.names();
    assert!(
        chime_shared::control::gone(&mut r, &names).await.unwrap().is_empty(),
        "a live worker is not gone"
    );
    worker.stop().await;
    let gone = chime_shared::control::gone(&mut r, &names).await.unwrap();
    assert_eq!(gone.len(), 1, "{gone:?}");
    assert!(gone[0].stopped && gone[0].settled[0] == 3, "{:?}", gone[0]);
    let to = chime_shared::minutes::minute_of(chrono::Utc::now());
    let minutes = chime_shared::minutes::read(&mut r, &names, from, to).await.unwrap();
    let succeeded: u64 =
        minutes.iter().map(|m| m.counts.outcomes.get("succeeded").copied().unwrap_or(0)).sum();
    let started: u64 = minutes.iter().map(|m| m.counts.latency.iter().sum::<u64>()).sum();
    assert_eq!((succeeded, started), (3, 3), "{minutes:?}");
    // The history's totals over the window say the same (the worker wrote its runs as it
    // stopped).
    let path = env.write_config(&env.config_text("classic", "", "", COUNT_JOB));
    let (code, out, err) = chime(&path, &["history", "--since", "1h", "--totals", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let totals: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(totals["by_job"]["count"]["succeeded"], 3, "{totals}");
    assert_eq!(totals["by_queue"]["default"]["succeeded"], 3, "{totals}");
    assert_eq!(totals["runs"], 3, "{totals}");
    let (code, out, _) = chime(&path, &["history", "--since", "1h", "--totals"], None);
    assert_eq!(code, 0);
    assert!(out.contains("SUCCEEDED") && out.contains("3 run(s) counted"), "{out}");
}

/// A worker SIGKILLed is listed among the workers gone once its heartbeat expires, as
/// having stopped beating (not `stopped`), with what its last heartbeat said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_listed_as_gone_without_a_clean_stop() {
    let env = TestEnv::new("gone-killed");
    let path =
        env.write_config(&env.config_text("classic", "", "", "[[jobs]]\nname = \"n\"\nhandler = \"noop\"\n"));
    let worker = Child::worker(&env.dir, &path, &[], "doomed");
    let names = env.names();
    let url = env.redis_url.clone();
    wait_until("the worker beats", Duration::from_secs(30), || {
        let (names, url) = (names.clone(), url.clone());
        async move {
            let mut r = connect_redis(&url).await;
            chime_shared::control::workers(&mut r, &names).await.unwrap().len() == 1
        }
    })
    .await;
    worker.signal(9);
    // Its heartbeat lives control::BEAT_TTL (15 s) after its last write.
    wait_until("the killed worker is gone", Duration::from_secs(40), || {
        let (names, url) = (names.clone(), url.clone());
        async move {
            let mut r = connect_redis(&url).await;
            let gone = chime_shared::control::gone(&mut r, &names).await.unwrap();
            gone.len() == 1 && !gone[0].stopped
        }
    })
    .await;
    let mut r = connect_redis(&env.redis_url).await;
    assert!(chime_shared::control::workers(&mut r, &names).await.unwrap().is_empty());
}
