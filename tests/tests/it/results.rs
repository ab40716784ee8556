//! Results and checkpoints: what a run returns is kept with its key and read back
//! (`EnqueueClient::wait`, `chime enqueue --wait`, `chime inspect`); what a run saves is
//! where the next attempt, or a copy redelivered after a crash, starts.

use chime_producer::{EnqueueClient, EnqueueRequest, Finished, WaitError};
use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use chime_shared::record::StoredResult;

/// Counts rows 0..10 from `$CHIME_CHECKPOINT_FILE`, one every 200 ms, writing each row to the
/// ledger and the next row to the checkpoint (by rename, so a read never sees half a write);
/// the result names where it started.
const COUNTER: &str = r#"start=$(cat "$CHIME_CHECKPOINT_FILE"); start=${start:-0}; i=$start
while [ "$i" -lt 10 ]; do
  echo "$$ $i" >> "$LEDGER"
  i=$((i + 1))
  echo "$i" > "$CHIME_CHECKPOINT_FILE.tmp" && mv "$CHIME_CHECKPOINT_FILE.tmp" "$CHIME_CHECKPOINT_FILE"
  sleep 0.2
done
printf '{"counted": 10, "from": %s}' "$start" > "$CHIME_RESULT_FILE""#;

#[tokio::test]
async fn an_exec_job_killed_halfway_resumes_from_its_checkpoint_on_another_worker() {
    let env = TestEnv::new("checkpoint-kill");
    let ledger = env.dir.join("ledger");
    let script = env.dir.join("count.sh");
    std::fs::write(&script, COUNTER).unwrap();
    let jobs = format!(
        "[[jobs]]\nname = \"count\"\nhandler = \"exec\"\ncommand = [\"sh\", \"{}\"]\npass_env = [\"LEDGER\"]\ntimeout = \"60s\"\n\
         [checkpoints]\npoll = \"50ms\"\n",
        script.display()
    );
    let text = env.config_text("quorum", "lease = \"2s\"", "", &jobs);
    let path = env.write_config(&text);
    let ledger_env = [("LEDGER", ledger.to_str().unwrap())];
    let mut first = Child::worker_env(&env.dir, &path, "a", &ledger_env);
    let (code, out, err) = chime(&path, &["enqueue", "count", "--key", "ckpt-1", "--json"], None);
    assert_eq!(code, 0, "{out}{err}");
    let key: serde_json::Value = serde_json::from_str(&out).unwrap();
    let key = key["key"].as_str().unwrap().to_string();
    wait_until("the first worker is halfway", Duration::from_secs(60), || async {
        crate::common::ledger(&ledger).len() >= 4
    })
    .await;
    // The worker dies mid-job (its exec child goes with it: PR_SET_PDEATHSIG).
    first.signal(9);
    let _ = first.child.wait().await;
    let before = crate::common::ledger(&ledger);
    let last_before: u64 = before.last().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    // Another worker gets the redelivered copy once the dead owner's lease (2 s) lapses.
    let _second = Child::worker_env(&env.dir, &path, "b", &ledger_env);
    wait_until("the job is done", Duration::from_secs(90), || async {
        idem_state(&env, &key).await.as_deref() == Some("done")
    })
    .await;
    let lines = crate::common::ledger(&ledger);
    let after: Vec<u64> =
        lines[before.len()..].iter().map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap()).collect();
    let resumed = after[0];
    assert!(resumed > 0, "the second run started over from 0: {lines:?}");
    // The checkpoint is read every 50 ms and a row takes 200 ms: at most the row in flight
    // when the worker died runs again.
    assert!(
        resumed + 1 >= last_before,
        "resumed at {resumed}, the first run had reached {last_before}: {lines:?}"
    );
    assert_eq!(after.last(), Some(&9), "{lines:?}");
    assert_eq!(after, (resumed..10).collect::<Vec<_>>(), "each row once from the checkpoint on: {lines:?}");

    let (code, out, _) = chime(&path, &["inspect", &key], None);
    assert_eq!(code, 0);
    assert!(out.contains(&format!(r#"result    {{"counted":10,"from":{resumed}}}"#)), "{out}");
    assert!(!out.contains("checkpoint"), "a success clears the checkpoint:\n{out}");
    let client = EnqueueClient::connect(env.config("quorum", "", "", &jobs)).await.unwrap();
    let finished = client.wait(key.parse().unwrap(), Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        finished,
        Finished::Done {
            result: Some(StoredResult::Value(serde_json::json!({"counted": 10, "from": resumed})))
        }
    );
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Import {
    rows: u64,
}

impl chime_producer::Job for Import {
    const NAME: &'static str = "import";
}

#[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
struct Imported {
    rows: u64,
    resumed_at: u64,
}

#[tokio::test]
async fn a_retry_resumes_from_its_checkpoint_and_wait_returns_the_typed_result() {
    let env = TestEnv::new("results");
    let jobs = "[[jobs]]\nname = \"import\"\nhandler = \"import\"\nbackoff = { initial = \"1s\" }\n\
                [[jobs]]\nname = \"echo\"\nhandler = \"echo\"\n\
                [[jobs]]\nname = \"broken\"\nhandler = \"broken\"\nmax_attempts = 1\n\
                [results]\nmax_bytes = 1024\n";
    let config = env.config("quorum", "", "", jobs);
    let starts = Arc::new(Mutex::new(Vec::new()));
    let s = starts.clone();
    let mut registry = Registry::new();
    // Imports row by row from its last checkpoint; the first attempt is cut off at row 6.
    registry.job(move |ctx: JobContext, job: Import| {
        let s = s.clone();
        async move {
            let start: u64 = ctx.last_checkpoint().unwrap_or(0);
            s.lock().unwrap().push(start);
            for row in start..job.rows {
                if ctx.attempt() == 1 && row == 6 {
                    return Err(JobError::transient("connection reset by the source"));
                }
                ctx.checkpoint(&(row + 1)).await?;
            }
            Ok(Imported { rows: job.rows, resumed_at: start })
        }
    });
    registry.register(
        "echo",
        raw_handler_fn(|ctx: JobContext, p: serde_json::Value| async move {
            ctx.set_result(&p);
            Ok(())
        }),
    );
    registry.register("broken", raw_handler_fn(|_, _| async { Err(JobError::permanent("no such account")) }));
    let worker = Running::start(config.clone(), registry, 8).await;
    let client = EnqueueClient::connect(config).await.unwrap();

    let done = client.enqueue(Import { rows: 10 }).await.unwrap();
    let finished = client.wait(done.key, Duration::from_secs(60)).await.unwrap();
    assert_eq!(
        finished,
        Finished::Done {
            result: Some(StoredResult::Value(serde_json::json!({"rows": 10, "resumed_at": 6})))
        }
    );
    assert_eq!(*starts.lock().unwrap(), [0, 6], "the retry resumed at the checkpoint");

    // Too large for results.max_bytes: the run succeeds, the record says why there is none.
    let big = client
        .enqueue(EnqueueRequest::new("echo").payload(serde_json::json!("x".repeat(2000))))
        .await
        .unwrap();
    match client.wait(big.key, Duration::from_secs(30)).await.unwrap() {
        Finished::Done { result: Some(StoredResult::Missing(why)) } => {
            assert!(why.contains("exceeds results.max_bytes (1024)"), "{why}")
        }
        other => panic!("expected done without a result, got {other:?}"),
    }
    // Dead: the reason and error of its last run.
    let dead = client.enqueue(EnqueueRequest::new("broken")).await.unwrap();
    match client.wait(dead.key, Duration::from_secs(30)).await.unwrap() {
        Finished::Dead { reason, error } => {
            assert_eq!(reason.as_deref(), Some("permanent"));
            assert!(error.unwrap_or_default().contains("no such account"));
        }
        other => panic!("expected dead, got {other:?}"),
    }
    // A key nobody enqueued: the wait times out, saying so.
    let never = chime_shared::envelope::adhoc_key("echo", "never");
    match client.wait(never, Duration::from_millis(300)).await {
        Err(WaitError::Timeout { state: None, .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    worker.stop().await;
}

/// Job `answer`, an `exec` job whose result is `{"answer": 42}`, its script in `env`'s
/// directory; `more` follows it in the config.
fn answer_job(env: &TestEnv, more: &str) -> String {
    let script = env.dir.join("answer.sh");
    std::fs::write(&script, "cat > /dev/null; echo '{\"answer\": 42}' > \"$CHIME_RESULT_FILE\"").unwrap();
    format!(
        "[[jobs]]\nname = \"answer\"\nhandler = \"exec\"\ncommand = [\"sh\", \"{}\"]\n{more}",
        script.display()
    )
}

#[tokio::test]
async fn enqueue_wait_prints_the_result_and_a_short_retention_hides_it_later() {
    let env = TestEnv::new("enqueue-wait");
    let jobs = answer_job(
        &env,
        "[[jobs]]\nname = \"fail\"\nhandler = \"exec\"\ncommand = [\"sh\", \"-c\", \"echo nope >&2; exit 100\"]\n\
         [results]\nretention = \"3s\"\n",
    );
    let text = env.config_text("quorum", "", "", &jobs);
    let path = env.write_config(&text);
    let _worker = Child::worker(&env.dir, &path, &[], "w");
    let (code, out, err) =
        chime(&path, &["enqueue", "answer", "--key", "q1", "--wait", "--wait-timeout", "60s"], None);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), "{\n  \"answer\": 42\n}", "{err}");
    let (code, out, _) = chime(&path, &["enqueue", "answer", "--key", "q2", "--wait", "--json"], None);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v, serde_json::json!({"state": "done", "result": {"answer": 42}}));
    // A zero wait is refused (before the job is published: it could only fail after).
    let (code, _, err) =
        chime(&path, &["enqueue", "answer", "--key", "q0", "--wait", "--wait-timeout", "0s"], None);
    assert!(code == 2 && err.contains("--wait-timeout 0s: must be more than 0"), "{err}");
    let (code, _, err) = chime(&path, &["enqueue", "fail", "--wait"], None);
    assert_eq!(code, 1, "a dead-lettered job exits 1");
    assert!(err.contains("dead-lettered (permanent)") && err.contains("nope"), "{err}");

    // results.retention = 3s: past it, readers say the result is gone.
    let key = chime_shared::envelope::adhoc_key("answer", "q1").to_string();
    wait_until("the result is past its retention", Duration::from_secs(30), || async {
        let (_, out, _) = chime(&path, &["inspect", &key], None);
        out.contains("result    none kept: the result is past results.retention")
    })
    .await;
}

/// A result's expiry (`results.retention` shorter than the record's) is written by Redis
/// `TIME`: a worker whose clock is two hours behind keeps its result for the hour asked (its
/// own clock plus an hour, an hour ago by everyone else's, hid the result at once).
#[tokio::test]
async fn a_worker_whose_clock_is_behind_keeps_its_result_for_the_retention() {
    let env = TestEnv::new("result-skew");
    let jobs = answer_job(&env, "[results]\nretention = \"1h\"\n");
    let path = env.write_config(&env.config_text("quorum", "", "", &jobs));
    let _worker = Child::with_clock("chime-worker", &env.dir, &path, &[], "-7200", "worker-behind", &[]);
    let (code, out, err) = chime(
        &path,
        &["enqueue", "answer", "--key", "r1", "--wait", "--json", "--wait-timeout", "60s"],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v, serde_json::json!({"state": "done", "result": {"answer": 42}}), "{err}");
}

/// Readers judge a result's expiry by Redis `TIME` too: `chime inspect` and `chime enqueue
/// --wait` on a host whose clock is two hours ahead still see a result kept for an hour (by
/// their own clock it had expired an hour ago).
#[tokio::test]
async fn a_reader_whose_clock_is_ahead_still_sees_a_kept_result() {
    let env = TestEnv::new("result-reader-skew");
    let jobs = answer_job(&env, "[results]\nretention = \"1h\"\n");
    let path = env.write_config(&env.config_text("quorum", "", "", &jobs));
    let _worker = Child::worker(&env.dir, &path, &[], "w");
    let args = ["enqueue", "answer", "--key", "r1", "--wait", "--json", "--wait-timeout", "60s"];
    let (code, _, err) = chime(&path, &args, None);
    assert_eq!(code, 0, "{err}");
    let ahead = chime_tests::faked_clock("+7200");
    let ahead: Vec<(&str, &std::ffi::OsStr)> =
        ahead.iter().map(|(k, v)| (*k, std::ffi::OsStr::new(v))).collect();
    let key = chime_shared::envelope::adhoc_key("answer", "r1").to_string();
    let (code, out, err) = chime_env(&path, &["inspect", &key], None, &ahead);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(r#"result    {"answer":42}"#), "{out}");
    // Enqueued again: a duplicate, and the wait reads the first run's result.
    let (code, out, err) = chime_env(&path, &args, None, &ahead);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v, serde_json::json!({"state": "done", "result": {"answer": 42}}), "{err}");
}
