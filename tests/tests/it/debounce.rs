//! Debounce and replace against a real worker: of enqueues of one key within the window only
//! the last runs, with its payload (the CLI and the library); a replacing enqueue runs now and
//! the delayed copy it replaced is dropped when it arrives; a retry of a replaced version is not
//! run; a key already done stays done; bad requests are refused by name.

use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;

/// (job, payload, attempt) of every run.
type Runs = Arc<Mutex<Vec<(String, serde_json::Value, u32)>>>;

fn recording(runs: &Runs) -> Registry {
    let mut r = Registry::new();
    for name in ["ping", "flaky"] {
        let runs = runs.clone();
        r.register(
            name,
            raw_handler_fn(move |ctx: JobContext, payload: serde_json::Value| {
                let runs = runs.clone();
                async move {
                    runs.lock().unwrap().push((ctx.job().to_string(), payload.clone(), ctx.attempt()));
                    if payload["fail"] == true {
                        return Err(JobError::transient("asked to fail"));
                    }
                    Ok::<_, JobError>(())
                }
            }),
        );
    }
    r
}

fn payloads(runs: &Runs, job: &str) -> Vec<serde_json::Value> {
    runs.lock().unwrap().iter().filter(|r| r.0 == job).map(|r| r.1.clone()).collect()
}

fn outcomes(path: &Path, job: &str, outcome: &str) -> usize {
    let (code, out, err) = chime(path, &["history", "--job", job, "--outcome", outcome, "--json"], None);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["runs"].as_array().map_or(0, Vec::len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_last_enqueue_of_a_debounced_or_replaced_key_runs() {
    let env = TestEnv::new("debounce");
    let jobs = "[[jobs]]\nname = \"ping\"\nhandler = \"ping\"\n\
                [[jobs]]\nname = \"flaky\"\nhandler = \"flaky\"\nbackoff = { initial = \"3s\", factor = 1.0, max = \"3s\" }\n\
                [[jobs]]\nname = \"split\"\nhandler = \"noop\"\nshards = 2\n";
    let text = env.config_text("quorum", "", "", jobs);
    let path = env.write_config(&text);
    let config = env.config("quorum", "", "", jobs);
    let runs: Runs = Arc::default();
    let worker = Running::start(config.clone(), recording(&runs), 8).await;

    // Debounced from the CLI: five enqueues within the 2 s window; the fifth runs, once.
    for n in 1..=5 {
        let payload = format!("{{\"n\":{n}}}");
        let (code, out, err) = chime(
            &path,
            &["enqueue", "ping", "--key", "k1", "--debounce", "2s", "--payload", &payload],
            None,
        );
        assert_eq!(code, 0, "{out}{err}");
    }
    wait_until("the debounced run", Duration::from_secs(20), || async {
        !payloads(&runs, "ping").is_empty()
    })
    .await;
    wait_until("the four older copies dropped", Duration::from_secs(20), || async {
        outcomes(&path, "ping", "superseded") == 4
    })
    .await;
    assert_eq!(payloads(&runs, "ping"), [serde_json::json!({"n": 5})]);

    // From the library, the same.
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    for n in 1..=3 {
        let req = EnqueueRequest::new("ping")
            .key("lib")
            .payload(serde_json::json!({"lib": n}))
            .debounce(Duration::from_secs(1));
        client.enqueue(req).await.unwrap();
    }
    wait_until("the library's debounced run", Duration::from_secs(20), || async {
        payloads(&runs, "ping").len() == 2 && outcomes(&path, "ping", "superseded") == 6
    })
    .await;
    assert_eq!(payloads(&runs, "ping")[1], serde_json::json!({"lib": 3}));

    // Replace: a copy delayed 3 s is superseded by one that runs now; it is dropped on arrival.
    let delayed = ["enqueue", "ping", "--key", "r1", "--delay", "3s", "--payload", "{\"v\":\"old\"}"];
    assert_eq!(chime(&path, &delayed, None).0, 0);
    let replace = ["enqueue", "ping", "--key", "r1", "--replace", "--payload", "{\"v\":\"new\"}"];
    let (code, out, _) = chime(&path, &replace, None);
    assert_eq!(code, 0);
    assert!(out.contains("still waiting (queued or delayed) are superseded"), "{out}");
    wait_until("the replacing run", Duration::from_secs(20), || async { payloads(&runs, "ping").len() == 3 })
        .await;
    wait_until("the delayed copy dropped", Duration::from_secs(20), || async {
        outcomes(&path, "ping", "superseded") == 7
    })
    .await;
    assert_eq!(payloads(&runs, "ping")[2], serde_json::json!({"v": "new"}));
    // A key done stays done: a replacing enqueue of it is absorbed, and says so.
    let (code, _, err) = chime(
        &path,
        &["enqueue", "ping", "--key", "r1", "--replace", "--payload", "{\"v\":\"newer\"}"],
        None,
    );
    assert_eq!(code, 0);
    assert!(err.contains("already done"), "{err}");

    // A failed attempt's retry belongs to the version it was: replaced meanwhile, it never runs.
    let first = ["enqueue", "flaky", "--key", "f1", "--payload", "{\"fail\":true}"];
    assert_eq!(chime(&path, &first, None).0, 0);
    wait_until("the first attempt failed", Duration::from_secs(20), || async {
        payloads(&runs, "flaky").len() == 1
    })
    .await;
    let fixed = ["enqueue", "flaky", "--key", "f1", "--replace", "--payload", "{\"fail\":false}"];
    assert_eq!(chime(&path, &fixed, None).0, 0);
    wait_until("the replacing run done", Duration::from_secs(20), || async {
        idem_state(&env, &chime_shared::envelope::adhoc_key("flaky", "f1").to_string()).await.as_deref()
            == Some("done")
    })
    .await;
    // The retry of the failed version arrives 3 s after the failure and is absorbed.
    wait_until("the old retry absorbed", Duration::from_secs(20), || async {
        worker.duplicates() + u64::try_from(outcomes(&path, "flaky", "superseded")).unwrap() >= 1
    })
    .await;
    assert_eq!(
        payloads(&runs, "flaky"),
        [serde_json::json!({"fail": true}), serde_json::json!({"fail": false})]
    );

    // Refused by name.
    for (args, says) in [
        (vec!["enqueue", "ping", "--debounce", "2s"], "--key"),
        (vec!["enqueue", "ping", "--key", "x", "--debounce", "500ms"], "debounce: must be at least 1s"),
        (vec!["enqueue", "ping", "--key", "x", "--debounce", "2s", "--delay", "5s"], "--delay"),
        (vec!["enqueue", "split", "--key", "x", "--replace"], "fans out"),
    ] {
        let (code, out, err) = chime(&path, &args, None);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    worker.stop().await;
}
