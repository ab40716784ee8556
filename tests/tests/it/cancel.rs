//! `chime cancel KEY` against two `chime-worker` processes: a running `exec` job gets SIGTERM
//! within a second on whichever worker holds it (one that ignores SIGTERM is killed after
//! `worker.cancel_grace`), is recorded `cancelled`, not retried, not dead-lettered; copies that
//! arrive later (a delayed enqueue, a retry, an enqueue again) are dropped as cancelled; a key
//! that is done or dead says so. The renewal fallback answers `cancelled` to the owner.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::*;

fn history_of(path: &Path, key: &str) -> Vec<serde_json::Value> {
    let (code, out, err) = chime(path, &["history", "--key", key, "--json"], None);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["runs"].as_array().cloned().unwrap_or_default()
}

fn enqueue(path: &Path, job: &str, key: &str, extra: &[&str]) -> String {
    let (code, out, err) = chime(path, &[&["enqueue", job, "--key", key][..], extra].concat(), None);
    assert_eq!(code, 0, "{out}{err}");
    // "enqueued J on queue Q (key K, id I), confirmed"
    out.split("(key ").nth(1).and_then(|s| s.split(',').next()).unwrap().to_string()
}

/// Running (a zombie, killed but not yet reaped by whoever inherited it, is not).
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
        .is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_run_on_whichever_worker_holds_it_and_drops_its_later_copies() {
    let env = TestEnv::new("cancel");
    let d = env.dir.display().to_string();
    // `polite` records SIGTERM and exits; `stubborn` ignores it (killed after the grace);
    // `flaky` fails and retries after 2 s; `fail` fails for good.
    let jobs = format!(
        "[[jobs]]\nname = \"polite\"\nhandler = \"exec\"\nmax_attempts = 3\ncommand = [\"sh\", \"-c\", \
         \"echo $$ > {d}/$CHIME_KEY.started; trap 'echo term > {d}/$CHIME_KEY.term; exit 3' TERM; sleep 60 & wait\"]\n\
         [[jobs]]\nname = \"stubborn\"\nhandler = \"exec\"\ncommand = [\"sh\", \"-c\", \
         \"echo $$ > {d}/$CHIME_KEY.started; trap '' TERM; sleep 60\"]\n\
         [[jobs]]\nname = \"flaky\"\nhandler = \"exec\"\nmax_attempts = 5\nbackoff = {{ initial = \"2s\", factor = 1.0, max = \"2s\" }}\n\
         command = [\"sh\", \"-c\", \"echo x >> {d}/$CHIME_KEY.runs; exit 1\"]\n\
         [[jobs]]\nname = \"fail\"\nhandler = \"exec\"\nmax_attempts = 1\ncommand = [\"sh\", \"-c\", \"exit 100\"]\n\
         [[jobs]]\nname = \"quick\"\nhandler = \"noop\"\n"
    );
    let text = env.config_text("quorum", "", "cancel_grace = \"2s\"", &jobs);
    let path = env.write_config(&text);
    let a = Child::worker(&env.dir, &path, &[], "a");
    let b = Child::worker(&env.dir, &path, &[], "b");
    let file = |key: &str, ext: &str| env.dir.join(format!("{key}.{ext}"));

    // A polite run, on whichever worker took it: SIGTERM within a second of `chime cancel`.
    let key = enqueue(&path, "polite", "p1", &[]);
    wait_until("the run started", Duration::from_secs(30), || async { file(&key, "started").exists() }).await;
    let asked = Instant::now();
    let (code, out, err) = chime(&path, &["cancel", &key], None);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&format!("cancelling {key}: its run on worker")), "{out}");
    // Within 3 s: the cancellations stream, not the renewal fallback (a third of the 30 s lease).
    wait_until("SIGTERM reached the program", Duration::from_secs(3), || async {
        file(&key, "term").exists()
    })
    .await;
    eprintln!("cancel → SIGTERM in {} ms", asked.elapsed().as_millis());
    wait_until("the run recorded cancelled", Duration::from_secs(15), || async {
        history_of(&path, &key).iter().any(|e| e["outcome"] == "cancelled")
    })
    .await;
    let (_, out, _) = chime(&path, &["inspect", &key, "--json"], None);
    let record: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(record["record"]["state"], "cancelled", "{out}");
    // Enqueued again: dropped as cancelled, never started again, never dead-lettered.
    std::fs::remove_file(file(&key, "started")).unwrap();
    enqueue(&path, "polite", "p1", &[]);
    wait_until("the copy dropped as cancelled", Duration::from_secs(15), || async {
        history_of(&path, &key).iter().any(|e| e["error"] == "a copy of a cancelled key, dropped")
    })
    .await;
    assert!(!file(&key, "started").exists(), "a cancelled key ran again");
    let runs = history_of(&path, &key);
    assert!(!runs.iter().any(|e| e["outcome"] == "retried" || e["outcome"] == "dead_lettered"), "{runs:?}");

    // A program that ignores SIGTERM is killed after worker.cancel_grace (2 s).
    let key = enqueue(&path, "stubborn", "s1", &[]);
    wait_until("the stubborn run started", Duration::from_secs(30), || async {
        file(&key, "started").exists()
    })
    .await;
    let pid = std::fs::read_to_string(file(&key, "started")).unwrap();
    assert!(alive(&pid));
    let asked = Instant::now();
    let (code, _, err) = chime(&path, &["cancel", &key], None);
    assert_eq!(code, 0, "{err}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(&pid) {
        if Instant::now() > deadline {
            let ps = std::process::Command::new("ps")
                .args(["-eo", "pid,ppid,pgid,stat,lstart,cmd"])
                .output()
                .unwrap();
            panic!(
                "the stubborn program {} still runs 10 s after the cancel: {:?}\n{}",
                pid.trim(),
                std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())),
                String::from_utf8_lossy(&ps.stdout)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = asked.elapsed();
    eprintln!("cancel → SIGKILL of a program ignoring SIGTERM in {} ms", took.as_millis());
    assert!(took >= Duration::from_secs(2), "killed before the grace: {took:?}");

    // A delayed copy, cancelled before it arrives: dropped when it does, never started.
    let key = enqueue(&path, "polite", "d1", &["--delay", "3s"]);
    let (code, out, _) = chime(&path, &["cancel", &key], None);
    assert_eq!(code, 0);
    assert!(out.contains("no run of it has started"), "{out}");
    wait_until("the delayed copy dropped", Duration::from_secs(20), || async {
        history_of(&path, &key).iter().any(|e| e["outcome"] == "cancelled")
    })
    .await;
    assert!(!file(&key, "started").exists(), "the delayed copy of a cancelled key ran");

    // Between attempts: the retry is dropped when it arrives.
    let key = enqueue(&path, "flaky", "f1", &[]);
    wait_until("the first attempt failed", Duration::from_secs(20), || async {
        history_of(&path, &key).iter().any(|e| e["outcome"] == "retried")
    })
    .await;
    let (code, out, _) = chime(&path, &["cancel", &key], None);
    assert_eq!(code, 0);
    assert!(out.contains("no run held it"), "{out}");
    wait_until("the retry dropped", Duration::from_secs(20), || async {
        history_of(&path, &key).iter().any(|e| e["error"] == "a copy of a cancelled key, dropped")
    })
    .await;
    let attempts = std::fs::read_to_string(file(&key, "runs")).unwrap().lines().count();
    assert_eq!(attempts, 1, "the flaky job ran again after its cancellation");

    // Done, dead and not a key: said so, exit code 1 (2 for a bad argument).
    let key = enqueue(&path, "quick", "q1", &[]);
    wait_until("the quick job done", Duration::from_secs(20), || async {
        idem_state(&env, &key).await.as_deref() == Some("done")
    })
    .await;
    let (code, _, err) = chime(&path, &["cancel", &key], None);
    assert_eq!(code, 1);
    assert!(err.contains("is done: nothing to cancel"), "{err}");
    let key = enqueue(&path, "fail", "x1", &[]);
    wait_until("the failing job dead", Duration::from_secs(20), || async {
        idem_state(&env, &key).await.as_deref() == Some("dead")
    })
    .await;
    let (code, _, err) = chime(&path, &["cancel", &key], None);
    assert_eq!(code, 1);
    assert!(err.contains("is dead (dead-lettered): nothing to cancel"), "{err}");
    let (code, _, err) = chime(&path, &["cancel", "not-a-key"], None);
    assert_eq!(code, 2);
    assert!(err.contains("is not an idempotency key"), "{err}");
    drop((a, b));
    // The polite job's first cancelled run was never dead-lettered.
    assert_eq!(depth(&env.names().dlq("default")).await, 1, "only the failing job's dead letter");
}

#[tokio::test]
async fn a_cancelled_keys_owner_learns_it_at_its_next_renewal() {
    let env = TestEnv::new("cancelrenew");
    let config = env.config("quorum", "", "", "");
    let store = chime_shared::idempotency::IdemStore::connect(&config.redis, env.names()).unwrap();
    let key = uuid::Uuid::new_v4().to_string();
    assert!(matches!(
        store.claim(&key, "w/1/0").await.unwrap(),
        chime_shared::idempotency::Claim::Claimed { .. }
    ));
    let mut conn = chime_shared::redis_conn::RedisConn::connect(&config.redis).await.unwrap();
    let (found, text, ok) =
        chime_shared::control::cancel(&mut conn, &env.names(), &config, &key, "tester").await.unwrap();
    assert!(ok && matches!(found, chime_shared::idempotency::Cancelled::Running { .. }), "{text}");
    assert_eq!(store.renew(&key, "w/1/0").await.unwrap(), chime_shared::idempotency::Renewal::Cancelled);
    // Another claimant finds it cancelled; a second cancel says so.
    assert!(matches!(
        store.claim(&key, "w/2/0").await.unwrap(),
        chime_shared::idempotency::Claim::Cancelled { .. }
    ));
    let (_, text, ok) =
        chime_shared::control::cancel(&mut conn, &env.names(), &config, &key, "tester").await.unwrap();
    assert!(ok && text.contains("was cancelled already"), "{text}");
}

/// The dashboard's Cancel button and `POST /api/v1/keys/{key}/cancel` do what `chime cancel`
/// does; the API refuses a token for another job and answers 409 for a key that is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_http_api_cancel_a_running_job() {
    let env = TestEnv::new("cancelweb");
    let d = env.dir.display().to_string();
    let jobs = format!(
        "[[api.tokens]]\nname = \"other\"\nenv = \"T_OTHER\"\njobs = [\"quick\"]\n\
         [[jobs]]\nname = \"polite\"\nhandler = \"exec\"\ncommand = [\"sh\", \"-c\", \
         \"echo $$ > {d}/$CHIME_KEY.started; trap 'echo term > {d}/$CHIME_KEY.term; exit 3' TERM; sleep 60 & wait\"]\n\
         [[jobs]]\nname = \"quick\"\nhandler = \"noop\"\n"
    );
    let text = env.config_text("quorum", "", "cancel_grace = \"1s\"", &jobs);
    let path = env.write_config(&text);
    let worker = Child::worker(&env.dir, &path, &[], "a");
    let file = |key: &str, ext: &str| env.dir.join(format!("{key}.{ext}"));
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();

    // The dashboard: the key's page has the button; pressing it stops the run.
    let (web, base) = crate::web::start_web(&env, &path, &[], &[]).await;
    let key = enqueue(&path, "polite", "w1", &[]);
    wait_until("the run started", Duration::from_secs(30), || async { file(&key, "started").exists() }).await;
    let page = http.get(format!("{base}/keys/{key}")).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("Cancel this run"), "{page}");
    let csrf =
        page.split("name=\"csrf\" value=\"").nth(1).and_then(|s| s.split('"').next()).unwrap().to_string();
    let back = format!("/keys/{key}");
    let form = [("csrf", csrf.as_str()), ("back", back.as_str()), ("op", "cancel"), ("key", key.as_str())];
    let r = http.post(format!("{base}/actions/cancel")).form(&form).send().await.unwrap();
    assert!(r.status().is_redirection(), "{}", r.status());
    wait_until("SIGTERM from the dashboard", Duration::from_secs(3), || async {
        file(&key, "term").exists()
    })
    .await;
    wait_until("recorded cancelled", Duration::from_secs(15), || async {
        history_of(&path, &key).iter().any(|e| e["outcome"] == "cancelled")
    })
    .await;
    let page = http.get(format!("{base}/keys/{key}")).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("cancelled") && !page.contains("Cancel this run"), "{page}");
    drop(web);

    // The HTTP API.
    let port = free_port();
    let token = "every-job-token-0123456789";
    let mut cmd = tokio::process::Command::new(bin("chime"));
    cmd.env("CHIME_API_TOKEN", token).env("T_OTHER", "token-for-quick-only-0123");
    let api = Child::run(cmd, &env.dir, &path, &["api", "--listen", &format!("127.0.0.1:{port}")], "api");
    let base = format!("http://127.0.0.1:{port}");
    wait_until("the api answers", Duration::from_secs(30), || async {
        reqwest::get(format!("{base}/livez")).await.is_ok_and(|r| r.status().is_success())
    })
    .await;
    let key = enqueue(&path, "polite", "a1", &[]);
    wait_until("the run started", Duration::from_secs(30), || async { file(&key, "started").exists() }).await;
    let cancel = |bearer: &'static str, key: String| {
        http.post(format!("{base}/api/v1/keys/{key}/cancel")).bearer_auth(bearer).send()
    };
    let r = cancel("token-for-quick-only-0123", key.clone()).await.unwrap();
    assert_eq!(r.status(), 404, "a token for another job may not cancel it");
    let r = cancel(token, key.clone()).await.unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(body["cancelled"], true, "{body}");
    assert!(body["message"].as_str().unwrap().starts_with(&format!("cancelling {key}")), "{body}");
    wait_until("SIGTERM from the api", Duration::from_secs(3), || async { file(&key, "term").exists() })
        .await;
    let key = enqueue(&path, "quick", "q1", &[]);
    wait_until("the quick job done", Duration::from_secs(20), || async {
        idem_state(&env, &key).await.as_deref() == Some("done")
    })
    .await;
    let r = cancel(token, key.clone()).await.unwrap();
    assert_eq!(r.status(), 409);

    // `chime enqueue --wait` on a job that gets cancelled: it says so, exit 1.
    let waiting = tokio::process::Command::new(bin("chime"))
        .arg("--config")
        .arg(&path)
        .args(["enqueue", "polite", "--key", "w2", "--wait"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let key = chime_shared::envelope::adhoc_key("polite", "w2").to_string();
    wait_until("the waited run started", Duration::from_secs(30), || async {
        file(&key, "started").exists()
    })
    .await;
    assert_eq!(chime(&path, &["cancel", &key], None).0, 0);
    let out =
        tokio::time::timeout(Duration::from_secs(30), waiting.wait_with_output()).await.unwrap().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("the job was cancelled"), "{err}");
    let body: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert!(body.to_string().contains("is done: nothing to cancel"), "{body}");
    drop((api, worker));
}

/// The worker running a key is SIGKILLed; the key is cancelled while nobody runs it; the
/// broker redelivers the copy to a new worker, which drops it as cancelled: the job never runs
/// again (its program died with its worker: `PR_SET_PDEATHSIG`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_cancelled_while_its_worker_is_dead_never_runs_again() {
    let env = TestEnv::new("cancelkill");
    let d = env.dir.display().to_string();
    let jobs = format!(
        "[[jobs]]\nname = \"long\"\nhandler = \"exec\"\ncommand = [\"sh\", \"-c\", \
         \"echo $$ >> {d}/$CHIME_KEY.started; sleep 60\"]\n"
    );
    let text = env.config_text("quorum", "", "", &jobs);
    let path = env.write_config(&text);
    let a = Child::worker(&env.dir, &path, &[], "a");
    let file = |key: &str, ext: &str| env.dir.join(format!("{key}.{ext}"));
    let key = enqueue(&path, "long", "k1", &[]);
    wait_until("the run started", Duration::from_secs(30), || async { file(&key, "started").exists() }).await;
    let pid = std::fs::read_to_string(file(&key, "started")).unwrap();
    a.signal(9);
    wait_until("the program died with its worker", Duration::from_secs(10), || async { !alive(&pid) }).await;
    // Its lease is still running: the cancellation says a run holds it.
    let (code, out, err) = chime(&path, &["cancel", &key], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("cancelling"), "{out}");
    let b = Child::worker(&env.dir, &path, &[], "b");
    wait_until("the redelivered copy dropped as cancelled", Duration::from_secs(30), || async {
        history_of(&path, &key).iter().any(|e| e["error"] == "a copy of a cancelled key, dropped")
    })
    .await;
    let started = std::fs::read_to_string(file(&key, "started")).unwrap();
    assert_eq!(started.lines().count(), 1, "the cancelled job ran again: {started}");
    assert_eq!(idem_state(&env, &key).await.as_deref(), Some("cancelled"));
    drop((a, b));
}
