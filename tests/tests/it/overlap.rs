//! Overlap policies against a real ticker: with `skip`, a slot whose previous run is still in
//! progress is not published (counted, in the history); with `buffer_one`, one such slot waits
//! and runs when the previous run ends, across a leader failover.

use chime_scheduler::lease::TickerStore;
use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
use chrono::{DateTime, Utc};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;

/// (slot, started, ended) of a run.
type Run = (DateTime<Utc>, DateTime<Utc>, Option<DateTime<Utc>>);
/// (job, slot, started, ended) of every run.
type Runs = Arc<Mutex<Vec<(String, DateTime<Utc>, DateTime<Utc>, Option<DateTime<Utc>>)>>>;

/// A handler that takes 2.5 s and records when it ran.
fn slow(runs: &Runs, names: &[&str]) -> Registry {
    let mut r = Registry::new();
    for name in names {
        let runs = runs.clone();
        r.register(
            *name,
            raw_handler_fn(move |ctx: JobContext, _| {
                let runs = runs.clone();
                async move {
                    let i = {
                        let mut r = runs.lock().unwrap();
                        r.push((ctx.job().to_string(), ctx.slot().unwrap(), Utc::now(), None));
                        r.len() - 1
                    };
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                    runs.lock().unwrap()[i].3 = Some(Utc::now());
                    Ok::<_, JobError>(())
                }
            }),
        );
    }
    r
}

fn of(runs: &Runs, job: &str) -> Vec<Run> {
    runs.lock().unwrap().iter().filter(|r| r.0 == job).map(|r| (r.1, r.2, r.3)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_and_buffer_one_never_overlap_runs_and_account_for_every_slot() {
    let env = TestEnv::new("overlap");
    let jobs = "[ticker]\nlease = \"2s\"\n\
                [[jobs]]\nname = \"skipper\"\nhandler = \"skipper\"\nschedule = \"* * * * * *\"\noverlap = \"skip\"\n\
                [[jobs]]\nname = \"buffered\"\nhandler = \"buffered\"\nschedule = \"* * * * * *\"\noverlap = \"buffer_one\"\n";
    let text = env.config_text("quorum", "", "", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let runs: Runs = Arc::default();
    let worker = Running::start(config.clone(), slow(&runs, &["skipper", "buffered"]), 8).await;
    let store = TickerStore::connect(&config.redis, &config.prefix).unwrap();
    let a = Child::ticker(&env.dir, &path, &[], "a");
    wait_until("four runs of each", Duration::from_secs(60), || async {
        of(&runs, "skipper").len() >= 4 && of(&runs, "buffered").len() >= 3
    })
    .await;
    // The leader dies while `buffered` has a slot waiting; the standby takes over and carries on.
    let b = Child::ticker(&env.dir, &path, &[], "b");
    wait_until("a standby", Duration::from_secs(10), || async { b.log_text().contains("ticker starting") })
        .await;
    drop(a);
    wait_until("the standby leads", Duration::from_secs(20), || async {
        store
            .leader()
            .await
            .ok()
            .flatten()
            .is_some_and(|l| l.id.split(':').nth(1) == Some(&b.pid().to_string()))
    })
    .await;
    let before = of(&runs, "buffered").len();
    wait_until("two more buffered runs under the new leader", Duration::from_secs(60), || async {
        of(&runs, "buffered").len() >= before + 2
    })
    .await;
    drop(b);

    for job in ["skipper", "buffered"] {
        let r = of(&runs, job);
        // Never two runs at once: each started after the previous one ended.
        for w in r.windows(2) {
            let ended = w[0].2.expect("the previous run ended");
            assert!(w[1].1 >= ended, "{job}: the run of {} started before that of {} ended", w[1].0, w[0].0);
            assert!(w[1].0 > w[0].0, "{job}: slots in order");
        }
    }
    // `buffer_one`: the waiting slot runs as soon as the previous run ends (checked every
    // second), so runs follow each other within about a second; `skip` waits for a new slot.
    let b = of(&runs, "buffered");
    for w in b.windows(2).skip(1) {
        let gap = (w[1].1 - w[0].2.unwrap()).num_milliseconds();
        assert!(gap < 2500, "buffered: {gap} ms between a run's end and the waiting slot's start");
    }
    // Every skipped slot is in the history, with its reason.
    let (code, out, err) =
        chime(&path, &["history", "--job", "skipper", "--outcome", "skipped", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let found: serde_json::Value = serde_json::from_str(&out).unwrap();
    let skipped = found["runs"].as_array().unwrap();
    assert!(skipped.len() >= 4, "{out}");
    assert!(skipped.iter().all(|e| e["reason"] == "overlap"), "{out}");
    // …and counted on the dashboard's schedules page (the Overlapped column).
    let counts = store.counts().await.unwrap();
    assert!(counts["skipper"].overlapped >= 4, "{counts:?}");
    let (web, base) = crate::web::start_web(&env, &path, &[], &[]).await;
    let page = reqwest::get(format!("{base}/schedules")).await.unwrap().text().await.unwrap();
    assert!(page.contains("<th>Overlapped</th>"), "{page}");
    assert!(
        page.contains(&format!("<td class=\"n\">{}</td>", counts["skipper"].overlapped)),
        "skipper's overlapped count {}: {page}",
        counts["skipper"].overlapped
    );
    drop(web);
    worker.stop().await;
}
