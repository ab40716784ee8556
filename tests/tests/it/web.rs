//! `chime web`: the dashboard driven in headless Chromium against the real services, and its
//! guards (credentials off loopback, CSRF, cross-site posts, read-only, escaping) over HTTP.

use chime_tests::webdriver::Browser;
use std::path::Path;
use std::time::Duration;

use crate::common::*;

/// A nightly payment run that fails until `<dir>/fixed` exists, and a receipt job that
/// always succeeds.
fn jobs(dir: &Path) -> String {
    format!(
        "[[jobs]]\nname = \"payment-run\"\nschedule = \"30 2 * * *\"\ntimezone = \"Europe/Berlin\"\nhandler = \"exec\"\n\
         command = [\"sh\", \"-c\", \"test -f {} || {{ echo 'bank API answered 503 <b>unavailable</b>' >&2; exit 3; }}\"]\n\
         max_attempts = 1\n\
         [[jobs]]\nname = \"send-receipt\"\nhandler = \"noop\"\ncircuit = {{ failures = 3 }}\n",
        dir.join("fixed").display()
    )
}

/// Starts `chime web` on a spare loopback port with `args` and `envs`; waits for `/livez`.
pub(crate) async fn start_web(
    env: &TestEnv,
    config: &Path,
    args: &[&str],
    envs: &[(&str, &str)],
) -> (Child, String) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut cmd = tokio::process::Command::new(bin("chime"));
    cmd.envs(envs.iter().copied());
    let mut all = vec!["web", "--listen", listen.as_str()];
    all.extend_from_slice(args);
    let child = Child::run(cmd, &env.dir, config, &all, &format!("web-{port}"));
    let base = format!("http://{listen}");
    let url = format!("{base}/livez");
    wait_until("the dashboard answers", Duration::from_secs(30), || {
        let url = url.clone();
        async move { reqwest::get(url).await.is_ok_and(|r| r.status().is_success()) }
    })
    .await;
    (child, base)
}

/// Ready messages and consumers of a broker queue.
async fn ready_and_consumers(queue: &str) -> (u32, u32) {
    let conn = connect_amqp().await;
    let d = chime_shared::topology::depth(&conn, queue).await.unwrap();
    let _ = conn.close(200, "".into()).await;
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_a_real_browser_shows_runs_replays_a_dead_letter_and_pauses_a_queue() {
    let env = TestEnv::new("web-browser");
    let path = env.write_config(&env.config_text("quorum", "", "", &jobs(&env.dir)));
    let _worker = Child::worker(&env.dir, &path, &[], "w1");
    let _ticker = Child::ticker(&env.dir, &path, &[], "t1");
    let (_web, base) = start_web(&env, &path, &[], &[]).await;
    let browser = Browser::start(&env.dir).await;

    // A run shows up in the history, with its key linking to the key's page.
    let (code, out, err) = chime(&path, &["enqueue", "send-receipt", "--key", "receipt-1", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let receipt: serde_json::Value = serde_json::from_str(&out).unwrap();
    let receipt_key = receipt["key"].as_str().unwrap().to_string();
    let text = browser
        .open_until(&format!("{base}/history?job=send-receipt"), &receipt_key, Duration::from_secs(30))
        .await;
    assert!(text.contains("succeeded"), "{text}");
    browser.screenshot("history").await;
    browser.get(&format!("a[href=\"/keys/{receipt_key}\"]")).await.click().await;
    let text = browser.get("#record").await.text().await;
    assert!(text.contains("done: later copies are absorbed"), "{text}");
    // A bad filter is named as the form's field, not as the command line's flag.
    let text = browser
        .open_until(&format!("{base}/history?outcome=nosuch"), "expected one of", Duration::from_secs(30))
        .await;
    assert!(
        text.contains("outcome \"nosuch\": expected one of succeeded") && !text.contains("--outcome"),
        "{text}"
    );

    // The payment run fails into the DLQ; its error is shown as text, not markup.
    let (code, out, err) = chime(&path, &["enqueue", "payment-run", "--key", "2026-12-01", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let payment: serde_json::Value = serde_json::from_str(&out).unwrap();
    let payment_key = payment["key"].as_str().unwrap().to_string();
    let text = browser
        .open_until(&format!("{base}/dlq?queue=default"), "bank API answered 503", Duration::from_secs(30))
        .await;
    assert!(text.contains("<b>unavailable</b>"), "the error's markup is escaped: {text}");
    assert!(!browser.source().await.contains("<b>unavailable</b>"), "no markup from a job's error");
    browser.screenshot("dead-letters").await;
    browser.get("a.dead-letter").await.click().await;
    let dead_id = browser.get("#dead-id").await.text().await;
    assert!(browser.text().await.contains(&payment_key));
    browser.screenshot("dead-letter").await;

    // Fixed upstream: replay it from the page, through the confirmation naming its exact id.
    std::fs::write(env.dir.join("fixed"), "").unwrap();
    browser.get("#replay").await.click().await;
    browser.get("main form button").await;
    let text = browser.text().await;
    assert!(text.contains(&dead_id) && text.contains("exactly this id"), "{text}");
    browser.get("main form button").await.click().await;
    let notice = browser.get("#notice").await.text().await;
    assert_eq!(notice, format!("Replayed dead letter {dead_id} to queue default."));
    let text =
        browser.open_until(&format!("{base}/keys/{payment_key}"), "succeeded", Duration::from_secs(30)).await;
    assert!(
        text.contains("dead_lettered") && text.contains("None in any DLQ"),
        "both runs, no copy left: {text}"
    );
    browser.screenshot("key").await;

    // Pause the queue from the overview: the worker stops consuming it; a new job waits.
    let work = env.names().work_queue("default");
    browser.open(&format!("{base}/")).await;
    browser.get("#queues button").await.click().await;
    let notice = browser.get("#notice").await.text().await;
    assert!(notice.starts_with("Paused queue default"), "{notice}");
    wait_until("the worker stopped consuming", Duration::from_secs(20), || {
        let w = work.clone();
        async move { ready_and_consumers(&w).await.1 == 0 }
    })
    .await;
    let (code, out, err) = chime(&path, &["enqueue", "send-receipt", "--key", "receipt-2", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let waiting: serde_json::Value = serde_json::from_str(&out).unwrap();
    let waiting_key = waiting["key"].as_str().unwrap().to_string();
    wait_depth(&work, 1, Duration::from_secs(10)).await;
    let text = browser.open_until(&format!("{base}/"), "paused", Duration::from_secs(10)).await;
    assert!(text.contains("Resume"), "{text}");
    browser.screenshot("overview-paused").await;
    assert_eq!(ready_and_consumers(&work).await, (1, 0), "still waiting while paused");
    assert_eq!(idem_state(&env, &waiting_key).await, None, "never claimed while paused");

    // Resume from the page: it is consumed and runs.
    browser.get("#queues button").await.click().await;
    let notice = browser.get("#notice").await.text().await;
    assert!(notice.starts_with("Resumed queue default"), "{notice}");
    browser
        .open_until(&format!("{base}/history?job=send-receipt"), &waiting_key, Duration::from_secs(30))
        .await;
    // The charts: this minute's runs from the workers' per-minute totals (flushed with their
    // heartbeat), drawn as inline SVG.
    let overview = format!("{base}/");
    wait_until("the runs in the overview's chart", Duration::from_secs(30), || {
        let overview = overview.clone();
        async move {
            let page = reqwest::get(&overview).await.unwrap().text().await.unwrap();
            let succeeded = page
                .split("succeeded: ")
                .nth(1)
                .and_then(|rest| rest.split(' ').next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
            succeeded >= 1
        }
    })
    .await;
    browser.open(&overview).await;
    let chart = browser.get("#chart-outcomes").await.text().await;
    assert!(chart.contains("Jobs settled per minute") && chart.contains("dead letter"), "{chart}");
    assert!(
        browser.source().await.contains("<circle") || browser.source().await.contains("<polyline"),
        "a point or a line is drawn"
    );
    browser.screenshot("overview").await;

    let text = browser.open_until(&format!("{base}/schedules"), "payment-run", Duration::from_secs(10)).await;
    assert!(text.contains("Europe/Berlin") && text.contains("Run now"), "{text}");
    browser.screenshot("schedules").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_guards_its_actions_and_its_address() {
    let env = TestEnv::new("web-guards");
    let path = env.write_config(&env.config_text("classic", "", "", &jobs(&env.dir)));
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();

    // Any address but loopback needs credentials, and says which.
    let (code, _, err) = chime(&path, &["web", "--listen", "0.0.0.0:0"], None);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("CHIME_WEB_TOKEN") && err.contains("CHIME_WEB_USER"), "{err}");

    // With a token: nothing without it, everything with it.
    let token = "0123456789abcdef-web-test";
    let (web, base) = start_web(&env, &path, &[], &[("CHIME_WEB_TOKEN", token)]).await;
    let r = http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.headers().contains_key("www-authenticate"));
    let r = http.get(format!("{base}/")).bearer_auth("wrong-token-of-16chars").send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = http.get(format!("{base}/")).bearer_auth(token).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-frame-options"], "DENY");
    let page = r.text().await.unwrap();
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap_or_else(|| panic!("a form token on the overview: {page}"))
        .to_string();
    let flag = env.names().paused_queue("default");
    let paused = || async {
        let mut r = connect_redis(&env.redis_url).await;
        let v: Option<String> = redis::cmd("GET").arg(&flag).query_async(&mut r).await.unwrap();
        v.is_some()
    };
    let post = |form: Vec<(&'static str, String)>, headers: Vec<(&'static str, String)>| {
        let mut req = http.post(format!("{base}/actions/queue")).bearer_auth(token).form(&form);
        for (k, v) in headers {
            req = req.header(k, v);
        }
        req.send()
    };
    let form = |csrf: &str| {
        vec![
            ("csrf", csrf.to_string()),
            ("back", "/".to_string()),
            ("op", "pause".into()),
            ("queue", "default".into()),
        ]
    };
    // No token, a wrong token, another site: refused, nothing changes.
    let r = post(form("forged"), vec![]).await.unwrap();
    assert_eq!(r.status(), 403);
    let r = post(form(&csrf), vec![("origin", "http://evil.example".into())]).await.unwrap();
    assert_eq!(r.status(), 403);
    let r = post(form(&csrf), vec![("sec-fetch-site", "cross-site".into())]).await.unwrap();
    assert_eq!(r.status(), 403);
    assert!(!paused().await, "a refused action changed nothing");
    // DNS rebinding: a page of attacker.example reaching this port under its own name is
    // refused whatever it asks, and so is an origin that merely matches its own Host.
    let port = base.rsplit(':').next().unwrap().to_string();
    let rebound = format!("attacker.example:{port}");
    let r = http.get(format!("{base}/")).bearer_auth(token).header("host", &rebound).send().await.unwrap();
    assert_eq!(r.status(), 421, "a foreign Host reads nothing");
    assert!(!r.text().await.unwrap().contains(&csrf), "no form token for a foreign Host");
    let r = post(form(&csrf), vec![("host", rebound.clone()), ("origin", format!("http://{rebound}"))])
        .await
        .unwrap();
    assert_eq!(r.status(), 421);
    let r = post(form(&csrf), vec![("origin", format!("http://{rebound}"))]).await.unwrap();
    assert_eq!(r.status(), 403, "an origin that is not this dashboard");
    assert!(!paused().await, "a refused action changed nothing");
    // The page's own form: done, and back to a path of the dashboard only, whatever `back`
    // says (`//evil`, or `/%09/evil`, which browsers read as `//evil`).
    for back in ["//evil.example/", "/%09/evil.example", "/\\evil.example"] {
        let mut evil = form(&csrf);
        evil[1].1 = back.into();
        let r = post(evil, vec![("origin", base.clone())]).await.unwrap();
        assert_eq!(r.status(), 303);
        let location = r.headers()["location"].to_str().unwrap();
        assert!(location.starts_with("/?notice="), "{back}: {location}");
    }
    assert!(paused().await);
    // The notice is the one the action stored; a crafted one is never shown.
    let shown = |location: String| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let page = http.get(format!("{base}{location}")).bearer_auth(token).send().await.unwrap();
            let page = page.text().await.unwrap();
            page.split("id=\"notice\">").nth(1).and_then(|s| s.split("</div>").next()).map(str::to_string)
        }
    };
    let r = post(form(&csrf), vec![]).await.unwrap();
    let text = shown(r.headers()["location"].to_str().unwrap().to_string()).await.unwrap_or_default();
    assert!(text.starts_with("Queue default was already paused by"), "{text}");
    assert_eq!(shown("/?msg=Session%20expired%2C%20call%20us".into()).await, None);
    assert_eq!(shown("/?notice=Session%20expired".into()).await, None);
    // An unknown queue is refused by name.
    let mut bad = form(&csrf);
    bad[3].1 = "nope".into();
    let r = post(bad, vec![]).await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("\"nope\""));
    // Schedules: pause, pause again, resume; an unknown operation is refused.
    let schedule_flag = env.names().paused_schedule("payment-run");
    let schedule = |op: &'static str| {
        http.post(format!("{base}/actions/schedule"))
            .bearer_auth(token)
            .form(&[("csrf", csrf.as_str()), ("back", "/schedules"), ("op", op), ("job", "payment-run")])
            .send()
    };
    let notice = |r: reqwest::Response| {
        let location = r.headers()["location"].to_str().unwrap().to_string();
        assert!(location.starts_with("/schedules?notice="), "{location}");
        async { shown(location).await.unwrap_or_default() }
    };
    assert!(notice(schedule("pause").await.unwrap()).await.starts_with("Paused schedule payment-run"));
    assert!(notice(schedule("pause").await.unwrap()).await.contains("already paused"));
    let mut r = connect_redis(&env.redis_url).await;
    let set: bool = redis::cmd("EXISTS").arg(&schedule_flag).query_async(&mut r).await.unwrap();
    assert!(set, "the schedule's pause flag is in Redis");
    assert!(notice(schedule("resume").await.unwrap()).await.starts_with("Resumed schedule"));
    assert!(notice(schedule("resume").await.unwrap()).await.contains("was not paused"));
    assert_eq!(schedule("explode").await.unwrap().status(), 400);
    // Circuit breakers: shown on the overview, held open and closed from it.
    let circuit = |op: &'static str, name: &'static str| {
        http.post(format!("{base}/actions/circuit"))
            .bearer_auth(token)
            .form(&[("csrf", csrf.as_str()), ("back", "/"), ("op", op), ("circuit", name)])
            .send()
    };
    let overview = || async {
        http.get(format!("{base}/")).bearer_auth(token).send().await.unwrap().text().await.unwrap()
    };
    assert!(overview().await.contains("Circuit breakers"));
    let r = circuit("open", "send-receipt").await.unwrap();
    let text = shown(r.headers()["location"].to_str().unwrap().to_string()).await.unwrap_or_default();
    assert!(text.starts_with("Circuit send-receipt held open (was closed)"), "{text}");
    let mut conn = connect_redis(&env.redis_url).await;
    let forced: Option<String> = redis::cmd("HGET")
        .arg(env.names().circuit("send-receipt"))
        .arg("forced")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(forced.as_deref(), Some("1"));
    assert!(overview().await.contains("open (held by an operator)"));
    let r = circuit("close", "send-receipt").await.unwrap();
    let text = shown(r.headers()["location"].to_str().unwrap().to_string()).await.unwrap_or_default();
    assert!(text.starts_with("Circuit send-receipt closed (was forced_open)"), "{text}");
    assert_eq!(circuit("open", "nope").await.unwrap().status(), 400);
    // A queue shedding its sheddable jobs is marked on the overview.
    chime_shared::shed::set(&mut conn, &env.names(), "default", "depth 12 >= max_depth 10").await.unwrap();
    assert!(overview().await.contains("title=\"depth 12 &gt;= max_depth 10\">shedding"));
    chime_shared::shed::clear(&mut conn, &env.names(), "default").await.unwrap();
    assert_eq!(circuit("explode", "send-receipt").await.unwrap().status(), 400);
    // Run now: published with a key of its own, and waiting in the queue (no worker here).
    let ran = notice(schedule("run").await.unwrap()).await;
    assert!(ran.starts_with("Triggered payment-run now"), "{ran}");
    wait_depth(&env.names().work_queue("default"), 1, Duration::from_secs(10)).await;
    let running = http.get(format!("{base}/running")).bearer_auth(token).send().await.unwrap();
    assert_eq!(running.status(), 200);
    assert!(running.text().await.unwrap().contains("0 job(s) running on 0 worker(s)"));
    // Guessing is throttled: after 10 failures (one above) this client waits, even with the
    // right token.
    for _ in 0..9 {
        let r = http.get(format!("{base}/")).bearer_auth("wrong-token-of-16chars").send().await.unwrap();
        assert_eq!(r.status(), 401);
    }
    let r = http.get(format!("{base}/")).bearer_auth(token).send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    drop(web);
    // A short basic-auth password is refused at start.
    let short = [("CHIME_WEB_USER", "ops"), ("CHIME_WEB_PASSWORD", "hunter2")];
    let (code, _, err) = chime_env(
        &path,
        &["web", "--listen", "127.0.0.1:0"],
        None,
        &short.map(|(k, v)| (k, std::ffi::OsStr::new(v))),
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("CHIME_WEB_PASSWORD must be at least 12 characters"), "{err}");

    // Read-only: no forms, every POST refused.
    let (web, base) = start_web(&env, &path, &["--read-only"], &[]).await;
    let page = http.get(format!("{base}/")).send().await.unwrap().text().await.unwrap();
    assert!(!page.contains("<form class=\"inline\"") && page.contains("read-only"), "{page}");
    let r = http.post(format!("{base}/actions/queue")).form(&form(&csrf)).send().await.unwrap();
    assert_eq!(r.status(), 403);
    // DLQ actions need an exact id of a dead letter that is there.
    drop(web);
    let (_web, base) = start_web(&env, &path, &[], &[]).await;
    let page = http.get(format!("{base}/")).send().await.unwrap().text().await.unwrap();
    let csrf =
        page.split("name=\"csrf\" value=\"").nth(1).and_then(|s| s.split('"').next()).unwrap().to_string();
    let r = http
        .post(format!("{base}/actions/dlq"))
        .form(&[
            ("csrf", csrf.as_str()),
            ("back", "/dlq"),
            ("op", "purge"),
            ("queue", "default"),
            ("id", "01a231bd"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303);
    let location = r.headers()["location"].to_str().unwrap().to_string();
    let page = http.get(format!("{base}{location}")).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("nothing done"), "a prefix names nothing: {page}");
    let r = http.get(format!("{base}/keys/%3Cscript%3E")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let body = r.text().await.unwrap();
    assert!(body.contains("&lt;script&gt;") && !body.contains("<script>"), "{body}");
}
