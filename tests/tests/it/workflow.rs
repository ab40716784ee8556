//! Workflows against real `chime-worker` processes: an ad-hoc DAG runs each step after the
//! steps it names, with their results; a dead step blocks its dependants (recorded `blocked`)
//! until it is replayed from the DLQ; a scheduled chain runs each slot's `load` after the same
//! slot's `extract`; a sharded run's `on_complete` job runs once, after every member ended
//! (dead ones included, marked); and a worker killed between a step's `done` and the release
//! of its dependants loses nothing and runs nothing twice.

use std::path::Path;
use std::time::Duration;

use crate::common::*;

/// `<job> <key> <upstream JSON>` lines the exec jobs append, parsed.
fn runs(ledger: &Path) -> Vec<(String, String, serde_json::Value)> {
    ledger_lines(ledger)
        .iter()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ' ');
            let (job, key, up) = (parts.next()?, parts.next()?, parts.next().unwrap_or("[]"));
            Some((
                job.to_string(),
                key.to_string(),
                serde_json::from_str(up).unwrap_or(serde_json::Value::Null),
            ))
        })
        .collect()
}

fn ledger_lines(path: &Path) -> Vec<String> {
    ledger(path)
}

fn jobs_of(ledger: &Path, job: &str) -> Vec<(String, serde_json::Value)> {
    runs(ledger).into_iter().filter(|r| r.0 == job).map(|r| (r.1, r.2)).collect()
}

/// An exec job that logs itself and its upstream runs, leaves `{"from": JOB}` as its result,
/// and fails for good while the file `<dir>/fail-<JOB>` (or `<dir>/fail-<KEY>`) exists (or
/// when `CHIME_UPSTREAM` and `CHIME_UPSTREAM_FILE` disagree).
fn job(name: &str, dir: &Path, extra: &str) -> String {
    let d = dir.display();
    format!(
        "[[jobs]]\nname = \"{name}\"\nhandler = \"exec\"\nmax_attempts = 1\n{extra}\ncommand = [\"sh\", \"-c\", \
         \"if test -e {d}/fail-$CHIME_JOB || test -e {d}/fail-$CHIME_KEY; then exit 100; fi; \
         test \\\"$CHIME_UPSTREAM\\\" = \\\"$(cat $CHIME_UPSTREAM_FILE)\\\" || exit 7; echo \\\"$CHIME_JOB $CHIME_KEY $CHIME_UPSTREAM\\\" >> {d}/ledger; \
         echo '{{\\\"from\\\": \\\"'$CHIME_JOB'\\\"}}' > $CHIME_RESULT_FILE\"]\n"
    )
}

fn inspect_json(path: &Path, key: &str) -> serde_json::Value {
    let (code, out, err) = chime(path, &["inspect", key, "--json"], None);
    assert_eq!(code, 0, "{out}{err}");
    serde_json::from_str(&out).unwrap()
}

fn step_states(path: &Path, key: &str) -> Vec<(String, String)> {
    inspect_json(path, key)["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["step"]["step"].as_str().unwrap().to_string(), s["state"].as_str().unwrap().to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adhoc_workflow_runs_in_order_and_a_dead_step_blocks_until_replayed() {
    let env = TestEnv::new("wf-adhoc");
    let jobs = [
        job("extract", &env.dir, ""),
        job("load", &env.dir, ""),
        job("report", &env.dir, ""),
        job("audit", &env.dir, ""),
    ]
    .concat();
    let text = env.config_text("quorum", "", "", &jobs);
    let path = env.write_config(&text);
    let ledger = env.dir.join("ledger");
    let _a = Child::worker(&env.dir, &path, &[], "a");
    let _b = Child::worker(&env.dir, &path, &[], "b");
    std::fs::write(env.dir.join("fail-load"), "").unwrap();
    // Listed out of order on purpose: the file's order is not the run order.
    let file = env.dir.join("nightly.toml");
    std::fs::write(
        &file,
        "key = \"nightly-1\"\n\
         [[steps]]\nname = \"report\"\nafter = [\"load\", \"audit\"]\n\
         [[steps]]\nname = \"load\"\nafter = [\"extract\"]\npayload = {table = \"orders\"}\n\
         [[steps]]\nname = \"extract\"\n\
         [[steps]]\nname = \"audit\"\njob = \"audit\"\nafter = [\"extract\"]\n",
    )
    .unwrap();
    let (code, out, err) = chime(&path, &["enqueue", "--workflow", file.to_str().unwrap(), "--json"], None);
    assert_eq!(code, 0, "{out}{err}");
    let done: serde_json::Value = serde_json::from_str(&out).unwrap();
    let wf = done["key"].as_str().unwrap().to_string();
    let key_of = |step: &str| {
        done["steps"].as_array().unwrap().iter().find(|s| s["step"] == step).unwrap()["key"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(key_of("load"), chime_shared::envelope::step_key(wf.parse().unwrap(), "load").to_string());

    // extract and audit run; load dies (its file says fail); report is blocked by it.
    wait_until("load dead, report blocked", Duration::from_secs(60), || async {
        step_states(&path, &wf)
            == [
                ("extract".to_string(), "done".to_string()),
                ("audit".into(), "done".into()),
                ("load".into(), "dead".into()),
                ("report".into(), "blocked".into()),
            ]
    })
    .await;
    let audit = jobs_of(&ledger, "audit");
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].1[0]["step"], "extract");
    assert_eq!(audit[0].1[0]["state"], "done");
    assert_eq!(
        audit[0].1[0]["result"],
        serde_json::json!({"from": "extract"}),
        "the upstream's result is passed"
    );
    assert!(jobs_of(&ledger, "report").is_empty(), "a blocked step does not run");
    let (code, out, _) = chime(&path, &["history", "--key", &key_of("report"), "--json"], None);
    assert_eq!(code, 0);
    assert!(out.contains("\"blocked\"") && out.contains("blocked by load"), "{out}");
    let (code, text_view, _) = chime(&path, &["inspect", &wf], None);
    assert_eq!(code, 0);
    assert!(text_view.contains("a workflow") && text_view.contains("blocked by load"), "{text_view}");
    // The dashboard's page of the workflow's key shows the same steps.
    let (_web, base) = crate::web::start_web(&env, &path, &[], &[]).await;
    let page = reqwest::get(format!("{base}/keys/{wf}")).await.unwrap().text().await.unwrap();
    assert!(
        page.contains("<h2>Workflow</h2>")
            && page.contains("2 of 4 steps done")
            && !page.contains("Cancel this run"),
        "{page}"
    );
    for needle in ["extract", "audit", "blocked by load", "{&quot;from&quot;:&quot;extract&quot;}"] {
        assert!(page.contains(needle), "{needle} on the page: {page}");
    }

    // Fixed and replayed from the DLQ: load runs, and report right after it.
    std::fs::remove_file(env.dir.join("fail-load")).unwrap();
    let (code, out, err) = chime(&path, &["dlq", "replay", "--all"], None);
    assert_eq!(code, 0, "{out}{err}");
    wait_until("the workflow complete", Duration::from_secs(60), || async {
        inspect_json(&path, &wf)["complete"] == true
    })
    .await;
    let report = jobs_of(&ledger, "report");
    assert_eq!(report.len(), 1, "{report:?}");
    let upstream = report[0].1.as_array().unwrap();
    assert_eq!(upstream.len(), 2);
    assert!(upstream.iter().all(|u| u["state"] == "done"));
    assert!(upstream.iter().any(|u| u["step"] == "load" && u["result"]["from"] == "load"));
    // Each step ran once (load twice: its dead attempt logged nothing), in order.
    let order: Vec<String> = runs(&ledger).into_iter().map(|r| r.0).collect();
    assert_eq!(order.iter().filter(|j| *j == "extract").count(), 1);
    assert_eq!(order.iter().filter(|j| *j == "load").count(), 1);
    let pos = |j: &str| order.iter().position(|x| x == j).unwrap();
    assert!(
        pos("extract") < pos("audit") && pos("extract") < pos("load") && pos("load") < pos("report"),
        "{order:?}"
    );

    // Enqueued again with the same key: every step is absorbed, nothing runs again.
    let (code, _, err) = chime(&path, &["enqueue", "--workflow", file.to_str().unwrap()], None);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("4 of the workflow's 4 steps were already settled"), "{err}");
    // Bad workflows are refused by name, before anything is published.
    let bad = env.dir.join("bad.toml");
    for (text, says) in [
        (
            "[[steps]]\nname = \"a\"\nafter = [\"b\"]\n[[steps]]\nname = \"b\"\nafter = [\"a\"]\njob = \"load\"\n",
            "cycle",
        ),
        ("[[steps]]\nname = \"a\"\nafter = [\"zz\"]\njob = \"load\"\n", "\"zz\", which is not a step"),
        ("[[steps]]\nname = \"a\"\njob = \"nope\"\n", "steps.a.job"),
        (
            "[[steps]]\nname = \"a\"\njob = \"load\"\ncolour = 1\n",
            "steps[0].colour (line 4, column 1): unknown field",
        ),
        ("", "bad.toml: line 1, column 1: missing field `steps`"),
    ] {
        std::fs::write(&bad, text).unwrap();
        let (code, out, err) = chime(&path, &["enqueue", "--workflow", bad.to_str().unwrap()], None);
        assert_ne!(code, 0, "{text}: {out}");
        assert!(err.contains(says), "{text}: {err}");
    }
    // A JSON workflow that is not an object says what one is.
    let bad_json = env.dir.join("bad.json");
    std::fs::write(&bad_json, r#"[{"name": "a", "job": "load"}]"#).unwrap();
    let (code, out, err) = chime(&path, &["enqueue", "--workflow", bad_json.to_str().unwrap()], None);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("bad.json: a workflow is a JSON object: {\"key\""), "{err}");
    // Read from a pipe (no name to tell), JSON is known by its first character.
    let (code, out, err) = chime(&path, &["enqueue", "--workflow", "-"], Some(r#"{"steps": 3}"#));
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("workflow -: invalid type: integer `3`, expected a sequence"), "{err}");
    wait_depth(&env.names().work_queue("default"), 0, Duration::from_secs(30)).await;
    let again: Vec<String> = runs(&ledger).into_iter().map(|r| r.0).collect();
    assert_eq!(again.len(), 4, "nothing ran again: {again:?}");

    // A step cancelled while it waits (blocked here) stops waiting: its copy is dropped.
    std::fs::write(env.dir.join("fail-extract"), "").unwrap();
    std::fs::write(&bad, "key = \"doomed\"\n[[steps]]\nname = \"extract\"\n[[steps]]\nname = \"load\"\nafter = [\"extract\"]\n").unwrap();
    let (code, out, err) = chime(&path, &["enqueue", "--workflow", bad.to_str().unwrap(), "--json"], None);
    assert_eq!(code, 0, "{out}{err}");
    let doomed =
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["key"].as_str().unwrap().to_string();
    wait_until("the step blocked", Duration::from_secs(60), || async {
        step_states(&path, &doomed).get(1).is_some_and(|s| s.1 == "blocked")
    })
    .await;
    let load = chime_shared::envelope::step_key(doomed.parse().unwrap(), "load").to_string();
    let (code, out, err) = chime(&path, &["cancel", &load], None);
    assert_eq!(code, 0, "{out}{err}");
    wait_until("the blocked step's copy dropped as cancelled", Duration::from_secs(60), || async {
        let (_, out, _) =
            chime(&path, &["history", "--key", &load, "--outcome", "cancelled", "--json"], None);
        out.contains("a copy of a cancelled key, dropped")
    })
    .await;
    assert_eq!(step_states(&path, &doomed)[1].1, "cancelled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_chain_and_a_sharded_runs_on_complete_wait_for_their_upstream() {
    let env = TestEnv::new("wf-chain");
    let every = "schedule = \"*/2 * * * * *\"";
    let jobs = [
        job("extract", &env.dir, every),
        job("load", &env.dir, &format!("{every}\nafter = [\"extract\"]")),
        job("part", &env.dir, "shards = 3\non_complete = \"summary\""),
        job("summary", &env.dir, ""),
    ]
    .concat();
    let jobs = format!("[ticker]\nlease = \"2s\"\n{jobs}");
    let text = env.config_text("quorum", "", "", &jobs);
    let path = env.write_config(&text);
    let ledger = env.dir.join("ledger");
    let _a = Child::worker(&env.dir, &path, &[], "a");
    let _b = Child::worker(&env.dir, &path, &[], "b");

    // The sharded run: shard 1 dies (its key's file), the summary still runs, once, after all.
    let part = chime_shared::envelope::adhoc_key("part", "p1");
    let members = chime_shared::group::Fan::Shards(3).members(part);
    std::fs::write(env.dir.join(format!("fail-{}", members[1].key)), "").unwrap();
    let (code, out, err) = chime(&path, &["enqueue", "part", "--key", "p1"], None);
    assert_eq!(code, 0, "{out}{err}");
    let summary_key = chime_shared::envelope::completion_key(part).to_string();
    wait_until("the summary ran", Duration::from_secs(60), || async {
        !jobs_of(&ledger, "summary").is_empty()
    })
    .await;
    let parts = jobs_of(&ledger, "part");
    assert_eq!(parts.len(), 2, "both live members ran before the summary: {parts:?}");
    let summary = jobs_of(&ledger, "summary");
    assert_eq!(summary.len(), 1);
    assert_eq!(summary[0].0, summary_key);
    let seen = summary[0].1.as_array().unwrap();
    assert_eq!(seen.len(), 3, "{seen:?}");
    for (i, m) in seen.iter().enumerate() {
        assert_eq!(m["key"], members[i].key.to_string());
        if i == 1 {
            assert_eq!(m["state"], "dead", "the dead member is marked: {m}");
        } else {
            assert_eq!((&m["state"], &m["result"]["from"]), (&"done".into(), &"part".into()), "{m}");
        }
    }

    // The chain: two tickers publish both jobs' slots (one SIGKILLed after three slots, the
    // other takes over); each load runs after its slot's extract, no slot twice.
    let first = Child::ticker(&env.dir, &path, &[], "t1");
    let second = Child::ticker(&env.dir, &path, &[], "t2");
    wait_until("three slots of load", Duration::from_secs(60), || async {
        jobs_of(&ledger, "load").len() >= 3
    })
    .await;
    drop(first);
    wait_until("three more slots of load after the kill", Duration::from_secs(60), || async {
        jobs_of(&ledger, "load").len() >= 6
    })
    .await;
    drop(second);
    let lines = runs(&ledger);
    for (i, (job, key, up)) in lines.iter().enumerate() {
        if job != "load" {
            continue;
        }
        let ups = up.as_array().unwrap();
        assert_eq!(ups.len(), 1, "{up}");
        let extract_key = ups[0]["key"].as_str().unwrap();
        assert_eq!(ups[0]["state"], "done");
        assert_eq!(ups[0]["result"]["from"], "extract");
        let before = lines[..i].iter().any(|(j, k, _)| j == "extract" && k == extract_key);
        assert!(before, "load {key} ran before its slot's extract {extract_key}: {lines:?}");
    }
    let load_keys: Vec<String> = jobs_of(&ledger, "load").into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        load_keys.len(),
        load_keys.iter().collect::<std::collections::HashSet<_>>().len(),
        "no slot twice"
    );
}

/// A step's upstream results are judged by Redis `TIME`: a worker whose clock is two hours
/// ahead still passes an upstream result kept for an hour (by its own clock it had expired).
#[tokio::test]
async fn a_worker_whose_clock_is_ahead_passes_upstream_results_still_kept() {
    let env = TestEnv::new("wf-skew");
    let jobs =
        [job("extract", &env.dir, ""), job("load", &env.dir, ""), "[results]\nretention = \"1h\"\n".into()]
            .concat();
    let path = env.write_config(&env.config_text("quorum", "", "", &jobs));
    let ledger = env.dir.join("ledger");
    let _worker = Child::with_clock("chime-worker", &env.dir, &path, &[], "+7200", "worker-ahead", &[]);
    let file = env.dir.join("wf.toml");
    std::fs::write(&file, "key = \"skew-1\"\n[[steps]]\nname = \"extract\"\n[[steps]]\nname = \"load\"\nafter = [\"extract\"]\n")
        .unwrap();
    let (code, out, err) = chime(&path, &["enqueue", "--workflow", file.to_str().unwrap()], None);
    assert_eq!(code, 0, "{out}{err}");
    wait_until("load ran", Duration::from_secs(60), || async { !jobs_of(&ledger, "load").is_empty() }).await;
    let load = jobs_of(&ledger, "load");
    assert_eq!(load[0].1[0]["step"], "extract", "{load:?}");
    assert_eq!(load[0].1[0]["result"], serde_json::json!({"from": "extract"}), "{load:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_between_a_steps_done_and_its_release_loses_nothing() {
    let env = TestEnv::new("wf-kill");
    let jobs =
        [job("extract", &env.dir, ""), job("load", &env.dir, ""), job("report", &env.dir, "")].concat();
    let text = env.config_text("quorum", "", "", &jobs);
    let path = env.write_config(&text);
    let ledger = env.dir.join("ledger");
    // This worker dies right after recording a step's `done`, before releasing its dependants
    // and before acking.
    let mut doomed =
        Child::worker_env(&env.dir, &path, "doomed", &[("CHIME_TEST_FAULT", "abort_before_release")]);
    let file = env.dir.join("chain.toml");
    std::fs::write(
        &file,
        "[[steps]]\nname = \"extract\"\n[[steps]]\nname = \"load\"\nafter = [\"extract\"]\n\
         [[steps]]\nname = \"report\"\nafter = [\"load\"]\n",
    )
    .unwrap();
    let (code, out, err) = chime(&path, &["enqueue", "--workflow", file.to_str().unwrap(), "--json"], None);
    assert_eq!(code, 0, "{out}{err}");
    let wf = serde_json::from_str::<serde_json::Value>(&out).unwrap()["key"].as_str().unwrap().to_string();
    let exited = tokio::time::timeout(Duration::from_secs(60), doomed.child.wait()).await;
    assert!(exited.is_ok(), "the worker died at the fault");
    assert!(doomed.log_text().contains("dies between `done` and the release"), "{}", doomed.log_text());
    assert_eq!(jobs_of(&ledger, "extract").len(), 1);
    assert!(jobs_of(&ledger, "load").is_empty());
    // A healthy worker: the unacked copy of extract is a duplicate; load's parked copy comes
    // back on its own and runs; report follows.
    let _healthy = Child::worker(&env.dir, &path, &[], "healthy");
    wait_until("the workflow complete", Duration::from_secs(120), || async {
        inspect_json(&path, &wf)["complete"] == true
    })
    .await;
    let order: Vec<String> = runs(&ledger).into_iter().map(|r| r.0).collect();
    assert_eq!(order, ["extract", "load", "report"], "each step once, in order");

    // Twelve more workflows, with a worker that dies at every release restarted as it dies
    // (up to 20 times) beside the healthy one: every step runs once, after its upstream.
    let mut doomed =
        Child::worker_env(&env.dir, &path, "doomed-0", &[("CHIME_TEST_FAULT", "abort_before_release")]);
    let queue = env.names().work_queue("default");
    wait_until("both workers consume", Duration::from_secs(30), || {
        let q = queue.clone();
        async move {
            let conn = connect_amqp().await;
            let consumers = chime_shared::topology::depth(&conn, &q).await.map(|(_, c)| c).unwrap_or(0);
            let _ = conn.close(200, "".into()).await;
            consumers >= 2
        }
    })
    .await;
    let mut keys = Vec::new();
    for _ in 0..12 {
        let (code, out, err) =
            chime(&path, &["enqueue", "--workflow", file.to_str().unwrap(), "--json"], None);
        assert_eq!(code, 0, "{out}{err}");
        keys.push(
            serde_json::from_str::<serde_json::Value>(&out).unwrap()["key"].as_str().unwrap().to_string(),
        );
    }
    let mut deaths = 0;
    wait_until("every workflow complete across the deaths", Duration::from_secs(180), || {
        if deaths < 20 && doomed.child.try_wait().ok().flatten().is_some() {
            deaths += 1;
            doomed = Child::worker_env(
                &env.dir,
                &path,
                &format!("doomed-{deaths}"),
                &[("CHIME_TEST_FAULT", "abort_before_release")],
            );
        }
        let done = keys.iter().all(|k| inspect_json(&path, k)["complete"] == true);
        async move { done }
    })
    .await;
    assert!(deaths >= 1, "the doomed worker never hit the fault");
    let lines = runs(&ledger);
    let mut seen = std::collections::HashSet::new();
    for (job, key, _) in &lines {
        assert!(seen.insert(key.clone()), "{job} {key} ran twice: {lines:?}");
    }
    assert_eq!(lines.len(), 3 * 13, "every step of every workflow ran: {lines:?}");
    for wf in &keys {
        let step = |s: &str| chime_shared::envelope::step_key(wf.parse().unwrap(), s).to_string();
        let at = |s: &str| lines.iter().position(|(_, k, _)| *k == step(s)).unwrap();
        assert!(at("extract") < at("load") && at("load") < at("report"), "workflow {wf} out of order");
    }
    eprintln!("workflows complete across {deaths} deaths at the release");
}
