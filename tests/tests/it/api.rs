//! `chime api`, the HTTP enqueue API, driven with `curl` as a service in another language
//! would: jobs enqueued over HTTP run on a worker, their keys read back, every bad request
//! answered with a JSON error naming its field.

use crate::common::*;
use chime_worker::{JobContext, Registry, raw_handler_fn};
use std::time::Duration;

const TOKEN: &str = "every-job-token-0123456789";
const LIMITED: &str = "only-echo-token-0123456789";
const BURST: &str = "burst-token-0123456789abcd";

/// A `curl` call: (status, body as JSON (`null` if not JSON), the `Retry-After` header).
fn curl(args: &[&str]) -> (u16, serde_json::Value, String) {
    let out = std::process::Command::new("curl")
        .args(["-sS", "-w", "\n%{http_code} %header{retry-after}"])
        .args(args)
        .output()
        .expect("curl is needed for the HTTP API tests (scripts/services installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, tail) = text.rsplit_once('\n').unwrap_or(("", &text));
    let (code, retry) = tail.split_once(' ').unwrap_or((tail, ""));
    let status = code.trim().parse().unwrap_or_else(|_| panic!("curl {args:?}: {text} {:?}", out.stderr));
    (status, serde_json::from_str(body).unwrap_or(serde_json::Value::Null), retry.trim().to_string())
}

fn post(port: u16, job: &str, token: Option<&str>, body: &str) -> (u16, serde_json::Value, String) {
    post_to(port, &format!("/api/v1/jobs/{job}"), token, body)
}

fn post_to(port: u16, path: &str, token: Option<&str>, body: &str) -> (u16, serde_json::Value, String) {
    let url = format!("http://127.0.0.1:{port}{path}");
    let auth = token.map(|t| format!("Authorization: Bearer {t}"));
    let mut args = vec!["-X", "POST", "-H", "Content-Type: application/json", "--data-binary", body];
    if let Some(a) = &auth {
        args.extend(["-H", a.as_str()]);
    }
    args.push(&url);
    curl(&args)
}

fn get(port: u16, path: &str, token: &str) -> (u16, serde_json::Value, String) {
    let url = format!("http://127.0.0.1:{port}{path}");
    let auth = format!("Authorization: Bearer {token}");
    curl(&["-H", &auth, &url])
}

fn start_api(env: &TestEnv, config: &std::path::Path, port: u16) -> Child {
    let mut cmd = tokio::process::Command::new(bin("chime"));
    cmd.env("CHIME_API_TOKEN", TOKEN).env("T_LIMITED", LIMITED).env("T_BURST", BURST);
    Child::run(cmd, &env.dir, config, &["api", "--listen", &format!("127.0.0.1:{port}")], "api")
}

/// Jobs enqueued with `curl` run once on a worker and read back by key with their result;
/// tokens limited to some jobs, bodies that are too large, not JSON, or name an unknown field,
/// and a token over its rate are each answered with the status the OpenAPI document gives and
/// a JSON error naming what is wrong; the document served is the one in the repository.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_enqueued_with_curl_run_and_every_bad_request_is_named() {
    let env = TestEnv::new("api");
    let jobs = "[api]\nmax_body_bytes = 2048\nrate_limit = \"40/m\"\n\
                [[api.tokens]]\nname = \"limited\"\nenv = \"T_LIMITED\"\njobs = [\"echo\"]\n\
                [[api.tokens]]\nname = \"burst\"\nenv = \"T_BURST\"\njobs = [\"*\"]\n\
                [[jobs]]\nname = \"echo\"\nhandler = \"echo\"\n\
                [[jobs]]\nname = \"other\"\nhandler = \"echo\"\n";
    let text = env.config_text("quorum", "", "", jobs);
    let path = env.write_config(&text);
    let config = env.config("quorum", "", "", jobs);
    let mut registry = Registry::new();
    for name in ["echo", "other"] {
        registry.register(
            name,
            raw_handler_fn(|ctx: JobContext, p: serde_json::Value| async move {
                ctx.set_result(&p);
                Ok(())
            }),
        );
    }
    let worker = Running::start(config.clone(), registry, 4).await;
    let port = free_port();
    let _api = start_api(&env, &path, port);
    wait_until("chime api answers /livez", Duration::from_secs(30), || async move {
        chime_tests::probes::get_once(port, "/livez").await.is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;

    // Enqueued, confirmed, run, read back with its result.
    let (status, done, _) = post(port, "echo", Some(TOKEN), r#"{"payload": {"n": 7}, "key": "order-7"}"#);
    assert_eq!(status, 202, "{done}");
    let key = chime_shared::envelope::adhoc_key("echo", "order-7");
    assert_eq!(done["key"], key.to_string());
    assert_eq!(done["delivery"], "confirmed");
    assert_eq!(done["job"], "echo");
    wait_until("the job ran", Duration::from_secs(30), || async {
        idem_state(&env, &key.to_string()).await.as_deref() == Some("done")
    })
    .await;
    // The same key again, once the first is done: accepted, and absorbed by the worker (one
    // run). (Sent while the first still ran, the copy would find the key busy and come round
    // again after the rest of the run's lease, up to `redis.lease`, 30 s, later.)
    let (status, again, _) = post(port, "echo", Some(LIMITED), r#"{"payload": {"n": 7}, "key": "order-7"}"#);
    assert_eq!((status, &again["key"]), (202, &done["key"]), "{again}");
    let (status, view, _) = get(port, &format!("/api/v1/keys/{key}"), LIMITED);
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["record"]["state"], "done", "{view}");
    assert_eq!(view["record"]["result"], serde_json::json!({"n": 7}), "{view}");
    wait_until("the copy was absorbed", Duration::from_secs(30), || async { worker.duplicates() >= 1 }).await;
    assert_eq!(worker.succeeded(), 1);

    // A key nobody enqueued: no record yet (it may still be queued).
    let unknown = uuid::Uuid::new_v4();
    let (status, view, _) = get(port, &format!("/api/v1/keys/{unknown}"), TOKEN);
    assert_eq!((status, &view["record"]["state"]), (200, &serde_json::Value::Null), "{view}");

    // Each bad request, its status and the field it names.
    let field = |r: &(u16, serde_json::Value, String)| (r.0, r.1["field"].as_str().unwrap_or("").to_string());
    let named = |status: u16, f: &str| (status, f.to_string());
    assert_eq!(post(port, "echo", None, "{}").0, 401);
    assert_eq!(post(port, "echo", Some("wrong-token-0123456789abcdef"), "{}").0, 401);
    assert_eq!(field(&post(port, "other", Some(LIMITED), "{}")), named(403, "job"));
    assert_eq!(field(&post(port, "nope", Some(TOKEN), "{}")), named(404, "job"));
    assert_eq!(field(&post(port, "echo", Some(TOKEN), r#"{"paylod": 1}"#)), named(400, "paylod"));
    assert_eq!(field(&post(port, "echo", Some(TOKEN), r#"{"delay": "soon"}"#)), named(400, "delay"));
    assert_eq!(field(&post(port, "echo", Some(TOKEN), r#"{"max_attempts": 0}"#)), named(400, "max_attempts"));
    assert_eq!(field(&post(port, "echo", Some(TOKEN), r#"{"priority": "urgent"}"#)), named(400, "priority"));
    let (status, e, _) = post(port, "echo", Some(TOKEN), r#"{"key": "#);
    assert!(status == 400 && e["error"].as_str().unwrap().contains("not valid JSON"), "{status} {e}");
    let big = format!(r#"{{"payload": "{}"}}"#, "x".repeat(4000));
    let (status, e, _) = post(port, "echo", Some(TOKEN), &big);
    assert!(status == 413 && e["error"].as_str().unwrap().contains("api.max_body_bytes"), "{status} {e}");
    let url = format!("http://127.0.0.1:{port}/api/v1/jobs/echo");
    let auth = format!("Authorization: Bearer {TOKEN}");
    assert_eq!(curl(&["-H", &auth, "-H", "Content-Type: text/plain", "--data-binary", "{}", &url]).0, 415);
    assert_eq!(field(&get(port, "/api/v1/keys/not-a-uuid", TOKEN)), named(400, "key"));
    // A workflow: `second` runs after `first`, with its result; every step's job must be
    // allowed to the token; a step naming no step is refused by name.
    let wf_url = format!("http://127.0.0.1:{port}/api/v1/workflows");
    let wf = r#"{"key": "wf-1", "steps": [{"name": "first", "job": "other", "payload": {"n": 1}},
        {"name": "second", "job": "echo", "after": ["first"]}]}"#;
    let post_wf = |auth: &str, body: &str| {
        curl(&[
            "-X",
            "POST",
            "-H",
            auth,
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            body,
            &wf_url,
        ])
    };
    let limited_auth = format!("Authorization: Bearer {LIMITED}");
    assert_eq!(field(&post_wf(&limited_auth, wf)), named(403, "steps"));
    let (status, done_wf, _) = post_wf(&auth, wf);
    assert_eq!(status, 202, "{done_wf}");
    let second = done_wf["steps"][1]["key"].as_str().unwrap().to_string();
    wait_until("the workflow's second step ran", Duration::from_secs(30), || async {
        idem_state(&env, &second).await.as_deref() == Some("done")
    })
    .await;
    let (status, view, _) = get(port, &format!("/api/v1/keys/{}", done_wf["key"].as_str().unwrap()), TOKEN);
    assert_eq!((status, &view["complete"]), (200, &serde_json::json!(true)), "{view}");
    let bad = r#"{"steps": [{"name": "a", "job": "echo", "after": ["b"]}]}"#;
    assert_eq!(field(&post_wf(&auth, bad)), named(400, "steps"));
    // A key of a job the limited token may not read is not shown to it.
    let (status, other, _) = post(port, "other", Some(TOKEN), r#"{"key": "o-1"}"#);
    assert_eq!(status, 202, "{other}");
    let other_key = other["key"].as_str().unwrap().to_string();
    wait_until("`other` ran", Duration::from_secs(30), || async {
        idem_state(&env, &other_key).await.as_deref() == Some("done")
    })
    .await;
    wait_until("`other`'s run is in the history", Duration::from_secs(30), || async {
        history_runs(&env).await.1.iter().any(|r| r.key == other_key)
    })
    .await;
    assert_eq!(field(&get(port, &format!("/api/v1/keys/{other_key}"), LIMITED)), named(404, "key"));

    // Batches: a bad element is named by its index and nothing of its batch is enqueued; a
    // batch answers every key in order once all are confirmed, unpacked and packed, and each
    // job runs once.
    let batch = |token: &str, job: &str, body: &str| {
        post_to(port, &format!("/api/v1/jobs/{job}/batch"), Some(token), body)
    };
    let bad = r#"{"jobs": [{"key": "never-1"}, {"max_attempts": 0}]}"#;
    assert_eq!(field(&batch(TOKEN, "echo", bad)), named(400, "jobs[1].max_attempts"));
    assert_eq!(
        field(&batch(TOKEN, "echo", r#"{"jobs": [{}, {"paylod": 1}]}"#)),
        named(400, "jobs[1].paylod")
    );
    assert_eq!(field(&batch(TOKEN, "echo", r#"{"jobs": []}"#)), named(400, "jobs"));
    assert_eq!(field(&batch(TOKEN, "echo", r#"{"jobs": [{}], "pack": 0}"#)), named(400, "pack"));
    assert_eq!(field(&batch(LIMITED, "other", r#"{"jobs": [{}]}"#)), named(403, "job"));
    let (status, done, _) = batch(
        LIMITED,
        "echo",
        r#"{"jobs": [{"payload": {"n": 1}, "key": "b-1"}, {"payload": {"n": 2}}, {"key": "b-3"}]}"#,
    );
    assert_eq!(status, 202, "{done}");
    assert_eq!(
        (&done["total"], &done["confirmed"], &done["spooled"]),
        (&3.into(), &3.into(), &0.into()),
        "{done}"
    );
    assert!(done.get("warning").is_none(), "{done}");
    // Elements repeating an earlier element's key are all published, with a warning naming
    // the first of them.
    let (status, repeated, _) = batch(
        TOKEN,
        "echo",
        r#"{"jobs": [{"key": "r-1"}, {"key": "r-2"}, {}, {"key": "r-1"}, {"key": "r-2"}]}"#,
    );
    assert_eq!((status, &repeated["confirmed"]), (202, &5.into()), "{repeated}");
    assert!(
        repeated["warning"].as_str().is_some_and(|w| w.starts_with(
            "2 elements repeat the key of an earlier element (the first: jobs[3], the key of jobs[0]): each key runs once"
        )),
        "{repeated}"
    );
    let (status, packed, _) =
        batch(TOKEN, "echo", r#"{"jobs": [{"key": "p-1"}, {"key": "p-2"}], "pack": 10}"#);
    assert_eq!((status, &packed["confirmed"]), (202, &2.into()), "{packed}");
    let keys: Vec<String> = [&done, &packed]
        .iter()
        .flat_map(|d| d["keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_string()))
        .collect();
    assert_eq!(keys.len(), 5, "{done} {packed}");
    assert_eq!(keys[0], chime_shared::envelope::adhoc_key("echo", "b-1").to_string());
    assert_eq!(keys[4], chime_shared::envelope::adhoc_key("echo", "p-2").to_string());
    for key in &keys {
        wait_until(&format!("batch key {key} ran"), Duration::from_secs(30), || async {
            idem_state(&env, key).await.as_deref() == Some("done")
        })
        .await;
    }
    let (_, view, _) = get(port, &format!("/api/v1/keys/{}", keys[1]), TOKEN);
    assert_eq!(view["record"]["result"], serde_json::json!({"n": 2}), "{view}");
    let never = chime_shared::envelope::adhoc_key("echo", "never-1").to_string();
    assert_eq!(idem_state(&env, &never).await, None, "a job of a refused batch ran");

    // The document served is the one in the repository.
    let (status, doc, _) = get(port, "/api/v1/openapi.json", TOKEN);
    let in_repo: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("producer/cli/src/cli/api/openapi.json")).unwrap(),
    )
    .unwrap();
    assert_eq!((status, &doc), (200, &in_repo));

    // Over the rate: 40 a minute in a burst, then 429 with Retry-After. Each request is a
    // `curl` process: on a loaded machine the burst takes long enough for a token or two to
    // come back (one per 1.5 s), so the count allowed grows with the time the burst took.
    let mut statuses = Vec::new();
    let started = std::time::Instant::now();
    while statuses.len() < 200 {
        statuses.push(get(port, &format!("/api/v1/keys/{unknown}"), BURST));
        if statuses.last().is_some_and(|s| s.0 != 200) {
            break;
        }
    }
    let refilled = (started.elapsed().as_millis() / 1500) as usize + 1;
    let passed = statuses.len() - 1;
    assert!(
        (40..=40 + refilled).contains(&passed),
        "{passed} requests passed before the limit (40 + at most {refilled} refilled): {:?}",
        statuses.iter().map(|s| s.0).collect::<Vec<_>>()
    );
    let (status, e, retry) = &statuses[passed];
    assert_eq!(*status, 429, "{e}");
    assert!(retry.parse::<u64>().is_ok_and(|s| (1..=2).contains(&s)), "Retry-After {retry:?}");
    // Another token is not slowed down.
    assert_eq!(get(port, &format!("/api/v1/keys/{unknown}"), LIMITED).0, 200);
    worker.stop().await;

    // A broker nobody answers on and no spool: 503 with Retry-After, nothing enqueued; the
    // job is named in the error.
    let down = env.dir.join("down.toml");
    std::fs::write(&down, text.replace(&env.amqp_url, "amqp://guest:guest@127.0.0.1:1/%2f")).unwrap();
    let port = free_port();
    let _down_api = start_api(&env, &down, port);
    wait_until("the second chime api answers /livez", Duration::from_secs(30), || async move {
        chime_tests::probes::get_once(port, "/livez").await.is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;
    let (status, e, retry) = post(port, "echo", Some(TOKEN), r#"{"key": "order-8"}"#);
    assert_eq!((status, retry.as_str()), (503, "5"), "{e}");
    assert!(e["error"].as_str().is_some_and(|m| m.contains("RabbitMQ")), "{e}");
    let (status, e, retry) =
        post_to(port, "/api/v1/jobs/echo/batch", Some(TOKEN), r#"{"jobs": [{"key": "b-9"}]}"#);
    assert_eq!((status, retry.as_str()), (503, "5"), "{e}");
}
