//! The wire format as a contract for other languages: the JSON Schema of envelope v1 against
//! the Rust type, the documented namespace and headers against the code, and
//! `examples/python/enqueue.py` (plain pika) enqueuing jobs that a Rust worker runs.

use crate::common::*;
use chime_shared::envelope::{
    Envelope, MAX_ATTEMPTS, MAX_SHARDS, NAMESPACE, Priority, Source, adhoc_key, scheduled_key,
};
use chime_worker::{JobContext, Registry, raw_handler_fn};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::time::Duration;

fn schema() -> Value {
    let text = std::fs::read_to_string(root().join("docs/reference/envelope-v1.schema.json")).unwrap();
    serde_json::from_str(&text).expect("envelope-v1.schema.json is JSON")
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object().unwrap().keys().cloned().collect()
}

fn strings(v: &Value) -> BTreeSet<String> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

/// The schema lists exactly the fields the Rust envelope writes, requires exactly those it
/// always writes, and gives the same bounds and spellings; the documented example decodes.
#[test]
fn the_envelope_schema_matches_the_rust_type() {
    let schema = schema();
    let props = &schema["properties"];
    let slot = chrono::DateTime::parse_from_rfc3339("2026-12-01T02:30:00Z").unwrap().to_utc();
    let minimal =
        Envelope::new("job", "default", scheduled_key("job", slot), json!(1), None, 5, Source::Adhoc);
    let mut full = minimal.clone();
    full.slot = Some(slot);
    full.trace_id = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
    full.trace_state = Some("congo=t61rcWkgMzE".into());
    full.group = Some(minimal.key);
    full.shard = Some(0);
    full.shards = Some(2);
    full.target = Some("worker-1".into());
    full.priority = Some(Priority::High);
    full.backfill = true;
    full.step = Some(chime_shared::envelope::Step {
        workflow: minimal.key,
        name: "load".into(),
        after: vec![chime_shared::envelope::Upstream {
            step: "extract".into(),
            job: "extract".into(),
            key: minimal.key,
        }],
        wait: chime_shared::envelope::Wait::Ended,
        releases: true,
    });
    let written = |e: &Envelope| keys(&serde_json::from_slice(&e.encode()).unwrap());
    assert_eq!(keys(props), written(&full), "schema `properties` against the fields a full envelope writes");
    assert_eq!(
        strings(&schema["required"]),
        written(&minimal),
        "schema `required` against the fields always written"
    );

    assert_eq!(props["v"]["const"], json!(chime_shared::envelope::VERSION));
    assert_eq!(props["max_attempts"]["maximum"], json!(MAX_ATTEMPTS));
    assert_eq!(props["shards"]["maximum"], json!(MAX_SHARDS));
    let sources: BTreeSet<String> =
        [Source::Schedule, Source::Adhoc, Source::Replay].iter().map(|s| s.as_str().to_string()).collect();
    assert_eq!(strings(&props["source"]["enum"]), sources);
    let levels: BTreeSet<String> = Priority::ALL.iter().map(|p| p.as_str().to_string()).collect();
    assert_eq!(strings(&props["priority"]["enum"]), levels);
    let step: Value = serde_json::from_slice::<Value>(&full.encode()).unwrap()["step"].clone();
    assert_eq!(keys(&props["step"]["properties"]), keys(&step), "the step's fields");
    assert_eq!(keys(&props["step"]["properties"]["after"]["items"]["properties"]), keys(&step["after"][0]));
    assert_eq!(schema["additionalProperties"], json!(true), "unknown fields are passed through");

    // Every envelope the schema describes decodes; the documented example is one.
    let doc = std::fs::read_to_string(root().join("docs/reference/envelope.md")).unwrap();
    let example =
        doc.split("```json\n").nth(1).and_then(|s| s.split("\n```").next()).expect("a JSON example");
    let decoded =
        Envelope::decode(example.replace('\n', "").as_bytes()).expect("the documented example decodes");
    assert_eq!(written(&decoded), strings(&schema["required"]));
    // A field the schema requires is required by the decoder too.
    for field in strings(&schema["required"]) {
        let mut v: Value = serde_json::from_slice(&minimal.encode()).unwrap();
        v.as_object_mut().unwrap().remove(&field);
        let err = Envelope::decode(v.to_string().as_bytes()).expect_err(&field).to_string();
        assert!(err.contains(&format!("missing field `{field}`")), "{field}: {err}");
    }
}

/// The namespace in the docs and the Python example is the code's; every `x-chime-*` header
/// the worker writes on the wire is documented.
#[test]
fn the_documented_namespace_and_headers_are_the_codes() {
    let doc = std::fs::read_to_string(root().join("docs/reference/envelope.md")).unwrap();
    let python = std::fs::read_to_string(root().join("examples/python/enqueue.py")).unwrap();
    let ns = NAMESPACE.to_string();
    assert!(doc.contains(&ns) && python.contains(&ns), "namespace {ns} in envelope.md and enqueue.py");
    assert_eq!(adhoc_key("job", "k"), uuid::Uuid::new_v5(&NAMESPACE, b"job#k"), "the documented derivation");

    let source = std::fs::read_to_string(root().join("worker/src/process.rs")).unwrap();
    let headers: BTreeSet<&str> = source
        .split('"')
        .filter(|s| s.starts_with("x-chime-") && s.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        .collect();
    assert!(headers.len() >= 10, "{headers:?}");
    for h in headers {
        assert!(doc.contains(&format!("`{h}`")), "header {h} is not documented in envelope.md");
    }
}

/// `examples/python/enqueue.py`, plain pika following the contract, enqueues a job that a
/// Rust worker runs once: the key it prints is the one chime derives, the same key enqueued
/// again is absorbed, and a queue nobody declared is reported, not silently dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_enqueued_from_python_with_pika_runs_on_a_rust_worker() {
    let env = TestEnv::new("python");
    let config = env.config("quorum", "", "", "[[jobs]]\nname = \"echo\"\nhandler = \"echo\"\n");
    let mut registry = Registry::new();
    registry.register(
        "echo",
        raw_handler_fn(|ctx: JobContext, p: Value| async move {
            ctx.set_result(&p);
            Ok(())
        }),
    );
    let worker = Running::start(config, registry, 2).await;
    let python = |args: &[&str]| {
        let out = std::process::Command::new("/usr/bin/python3")
            .arg(root().join("examples/python/enqueue.py"))
            .args(args)
            .args(["--amqp-url", &env.amqp_url, "--prefix", &env.prefix])
            .output()
            .expect("python3 runs (scripts/services installs python3-pika)");
        let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    let (code, key, err) = python(&["echo", "--payload", r#"{"order": 42}"#, "--key", "order-42"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(key, adhoc_key("echo", "order-42").to_string(), "the key pika derived is chime's");
    wait_until("the Python job ran", Duration::from_secs(30), || async {
        idem_state(&env, &key).await.as_deref() == Some("done")
    })
    .await;
    let (code, again, err) = python(&["echo", "--payload", r#"{"order": 42}"#, "--key", "order-42"]);
    assert_eq!((code, &again), (Some(0), &key), "{err}");
    wait_until("the second copy was absorbed", Duration::from_secs(30), || async {
        worker.duplicates() >= 1
    })
    .await;
    assert_eq!(worker.succeeded(), 1);
    wait_until("the run is in the history, as `echo`", Duration::from_secs(30), || async {
        history_runs(&env).await.1.iter().any(|r| r.key == key && r.job == "echo")
    })
    .await;

    // A queue nobody declared: returned by the broker (mandatory), reported, exit 1.
    let (code, _, err) = python(&["echo", "--queue", "nowhere"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not enqueued") && err.contains("nowhere"), "{err}");
    worker.stop().await;
}
