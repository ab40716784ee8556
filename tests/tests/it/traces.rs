//! Traces across the queue: with `[telemetry] otlp_endpoint` set, `chime enqueue`, `chime api`
//! and `chime-worker` export spans over OTLP/HTTP (JSON) to a receiver this test runs, and
//! the worker's run span continues the producer's trace; a retry's span links to the attempt
//! before.

use crate::common::*;
use serde_json::Value;
use std::time::Duration;

const TOKEN: &str = "trace-token-0123456789abcdef";

/// One exported span: its service, trace, ids, name, attributes and links.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    trace: String,
    id: String,
    parent: String,
    name: String,
    attrs: Value,
    links: Vec<(String, String)>,
}

impl Span {
    fn attr(&self, key: &str) -> Option<String> {
        let a = self.attrs.as_array()?.iter().find(|a| a["key"] == key)?;
        let v = &a["value"];
        ["stringValue", "intValue"].iter().find_map(|k| match &v[*k] {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        })
    }
}

fn spans_of(body: &Value) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in body["resourceSpans"].as_array().into_iter().flatten() {
        let service = rs["resource"]["attributes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["key"] == "service.name")
            .and_then(|a| a["value"]["stringValue"].as_str())
            .unwrap_or("")
            .to_string();
        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
            for s in ss["spans"].as_array().into_iter().flatten() {
                let text = |k: &str| s[k].as_str().unwrap_or("").to_string();
                let links = s["links"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|l| {
                        (
                            l["traceId"].as_str().unwrap_or("").into(),
                            l["spanId"].as_str().unwrap_or("").into(),
                        )
                    })
                    .collect();
                out.push(Span {
                    service: service.clone(),
                    trace: text("traceId"),
                    id: text("spanId"),
                    parent: text("parentSpanId"),
                    name: text("name"),
                    attrs: s["attributes"].clone(),
                    links,
                });
            }
        }
    }
    out
}

async fn wait_span(got: &chime_tests::otlp::Bodies, what: &str, pred: impl Fn(&Span) -> bool) -> Span {
    let found = || got.lock().unwrap().iter().flat_map(spans_of).find(|s| pred(s));
    wait_until(what, Duration::from_secs(60), || async { found().is_some() }).await;
    found().unwrap()
}

/// The producer's trace reaches the worker's run span: from `chime enqueue` (its own span),
/// from an HTTP caller's `traceparent` through `chime api`, and across a retry, whose span
/// links to the failed attempt's; job, key, attempt and outcome are attributes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producers_trace_reaches_the_workers_run_span() {
    let env = TestEnv::new("traces");
    let (otlp, got) = chime_tests::otlp::receiver().await;
    let flag = env.dir.join("failed-once");
    let jobs = format!(
        "[telemetry]\notlp_endpoint = \"http://127.0.0.1:{otlp}\"\n\
         [[jobs]]\nname = \"echo\"\nhandler = \"noop\"\n\
         [[jobs]]\nname = \"beat\"\nhandler = \"noop\"\nschedule = \"* * * * * *\"\n\
         [[jobs]]\nname = \"flaky\"\nhandler = \"exec\"\nmax_attempts = 3\n\
         backoff = {{ initial = \"1s\", factor = 1.0, max = \"1s\" }}\n\
         command = [\"sh\", \"-c\", \"test -e {f} || {{ touch {f}; exit 1; }}\"]\n",
        f = flag.display()
    );
    let path = env.write_config(&env.config_text("quorum", "", "", &jobs));
    // Export every 100 ms instead of every 5 s.
    let fast = [("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let _worker = Child::worker_env(&env.dir, &path, "a", &fast);

    // 1. chime enqueue: its `enqueue` span is the parent of the worker's `job` span.
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    let (code, out, err) = chime_env(
        &path,
        &["enqueue", "echo", "--key", "k1"],
        None,
        &[("OTEL_BSP_SCHEDULE_DELAY", os("100"))],
    );
    assert_eq!(code, 0, "{out}{err}");
    let key = chime_shared::envelope::adhoc_key("echo", "k1").to_string();
    let sent = wait_span(&got, "the enqueue span", |s| {
        s.name == "enqueue" && s.attr("key").as_deref() == Some(&key)
    })
    .await;
    assert_eq!((sent.service.as_str(), sent.attr("job").as_deref()), ("chime", Some("echo")), "{sent:?}");
    let run =
        wait_span(&got, "the run's span", |s| s.name == "job" && s.attr("key").as_deref() == Some(&key))
            .await;
    assert_eq!(run.service, "chime-worker", "{run:?}");
    assert_eq!(
        (run.trace.as_str(), run.parent.as_str()),
        (sent.trace.as_str(), sent.id.as_str()),
        "{run:?} {sent:?}"
    );
    assert_eq!(run.attr("attempt").as_deref(), Some("1"));
    assert_eq!(run.attr("outcome").as_deref(), Some("succeeded"), "{run:?}");

    // 2. An HTTP caller's traceparent, through chime api.
    let port = free_port();
    let mut cmd = tokio::process::Command::new(bin("chime"));
    cmd.env("CHIME_API_TOKEN", TOKEN).env("OTEL_BSP_SCHEDULE_DELAY", "100");
    let _api = Child::run(cmd, &env.dir, &path, &["api", "--listen", &format!("127.0.0.1:{port}")], "api");
    wait_until("chime api answers /livez", Duration::from_secs(30), || async move {
        chime_tests::probes::get_once(port, "/livez").await.is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;
    let caller_trace = "0af7651916cd43dd8448eb211c80319c";
    let caller = format!("00-{caller_trace}-b7ad6b7169203331-01");
    let out = std::process::Command::new("curl")
        .args(["-sS", "-X", "POST", "-H", "Content-Type: application/json"])
        .args(["-H", &format!("Authorization: Bearer {TOKEN}"), "-H", &format!("traceparent: {caller}")])
        .args(["--data-binary", r#"{"key": "k2"}"#, &format!("http://127.0.0.1:{port}/api/v1/jobs/echo")])
        .output()
        .expect("curl");
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert_eq!(answer["delivery"], "confirmed", "{answer}");
    let key2 = chime_shared::envelope::adhoc_key("echo", "k2").to_string();
    let run2 = wait_span(&got, "the HTTP job's run span", |s| {
        s.name == "job" && s.attr("key").as_deref() == Some(&key2)
    })
    .await;
    assert_eq!(run2.trace, caller_trace, "{run2:?}");

    // 2b. A publisher in another language that sets the AMQP `traceparent` header (as
    // OpenTelemetry's AMQP instrumentations do) and leaves the envelope's trace_id null.
    let foreign_trace = "5af7651916cd43dd8448eb211c80319d";
    let key4 = chime_shared::envelope::adhoc_key("echo", "k4");
    let env4 = chime_shared::envelope::Envelope::new(
        "echo",
        "default",
        key4,
        serde_json::Value::Null,
        None,
        3,
        chime_shared::envelope::Source::Adhoc,
    );
    let mut headers = lapin::types::FieldTable::default();
    chime_shared::envelope::put_header(
        &mut headers,
        "traceparent",
        &format!("00-{foreign_trace}-c7ad6b7169203331-01"),
    );
    let conn = connect_amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default()).await.unwrap();
    chime_shared::amqp::publish_confirmed(
        &ch,
        &env.names().work_exchange(),
        "default",
        &env4.encode(),
        env4.properties().with_headers(headers),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let key4 = key4.to_string();
    let run4 = wait_span(&got, "the foreign job's run span", |s| {
        s.name == "job" && s.attr("key").as_deref() == Some(&key4)
    })
    .await;
    assert_eq!((run4.trace.as_str(), run4.parent.as_str()), (foreign_trace, "c7ad6b7169203331"), "{run4:?}");
    let _ = conn.close(200, "".into()).await;

    // 3. A retry: both attempts in the producer's trace, the second linked to the first.
    let (code, out, err) = chime_env(
        &path,
        &["enqueue", "flaky", "--key", "k3"],
        None,
        &[("OTEL_BSP_SCHEDULE_DELAY", os("100"))],
    );
    assert_eq!(code, 0, "{out}{err}");
    let key3 = chime_shared::envelope::adhoc_key("flaky", "k3").to_string();
    let attempt = |n: &'static str| {
        let key3 = key3.clone();
        move |s: &Span| {
            s.name == "job" && s.attr("key") == Some(key3.clone()) && s.attr("attempt").as_deref() == Some(n)
        }
    };
    let first = wait_span(&got, "the first attempt's span", attempt("1")).await;
    let second = wait_span(&got, "the second attempt's span", attempt("2")).await;
    assert_eq!(first.attr("outcome").as_deref(), Some("retried"), "{first:?}");
    assert_eq!(second.attr("outcome").as_deref(), Some("succeeded"), "{second:?}");
    assert_eq!(first.trace, second.trace, "both attempts continue the producer's trace");
    assert_eq!(first.parent, second.parent);
    assert!(second.links.contains(&(first.trace.clone(), first.id.clone())), "{second:?} links to {first:?}");

    // 4. The ticker: each published slot has a span, which the slot's run continues.
    let _ticker = Child::run(
        {
            let mut cmd = tokio::process::Command::new(bin("chime"));
            cmd.env("OTEL_BSP_SCHEDULE_DELAY", "100");
            cmd
        },
        &env.dir,
        &path,
        &["tick"],
        "ticker",
    );
    let slot =
        wait_span(&got, "a slot's span", |s| s.name == "slot" && s.attr("job").as_deref() == Some("beat"))
            .await;
    assert_eq!(slot.service, "chime", "{slot:?}");
    let slot_key = slot.attr("key").unwrap();
    let run = wait_span(&got, "the slot's run span", |s| {
        s.name == "job" && s.attr("key") == Some(slot_key.clone())
    })
    .await;
    assert_eq!(
        (run.trace.as_str(), run.parent.as_str()),
        (slot.trace.as_str(), slot.id.as_str()),
        "{run:?} {slot:?}"
    );
}
