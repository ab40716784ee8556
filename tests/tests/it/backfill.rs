//! `chime backfill`: a scheduled job's past slots published with their deterministic keys, over a
//! daylight-saving night; slots already done absorbed, a deadline counted from the backfill,
//! sharded jobs fanned out, and bad ranges refused by name.

use chrono::{DateTime, Utc};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_runs_each_past_slot_once_across_a_dst_night() {
    let env = TestEnv::new("backfill");
    // Every 10 minutes in Berlin, with a deadline a backfilled slot is far past; the spring-
    // forward night of 2026-03-29 has no 02:00-02:59.
    let jobs = "[[jobs]]\nname = \"report\"\nhandler = \"report\"\nschedule = \"*/10 * * * *\"\n\
                timezone = \"Europe/Berlin\"\ndeadline = \"1m\"\n\
                [[jobs]]\nname = \"split\"\nhandler = \"split\"\nschedule = \"0 * * * *\"\nshards = 2\n\
                [[jobs]]\nname = \"adhoc\"\nhandler = \"noop\"\n";
    let text = env.config_text("quorum", "", "", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let runs: SlotRuns = Arc::default();
    let worker = Running::start(config.clone(), slot_recording(&runs, &["report", "split"]), 8).await;
    let night = ["--from", "2026-03-29T00:00", "--to", "2026-03-29T04:00"];

    // The plan: local 00:00-01:50 and 03:00-04:00 (the skipped hour has no slot), in UTC.
    let (code, out, err) =
        chime(&path, &[&["backfill", "report", "--dry-run", "--json"][..], &night].concat(), None);
    assert_eq!(code, 0, "{err}");
    let plan: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let expected: Vec<String> = (0..19)
        .map(|i| {
            let t =
                "2026-03-28T23:00:00Z".parse::<DateTime<Utc>>().unwrap() + chrono::Duration::minutes(10 * i);
            t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        })
        .collect();
    let planned: Vec<&str> = plan.iter().map(|r| r["slot"].as_str().unwrap()).collect();
    assert_eq!(planned, expected);
    assert!(plan.iter().all(|r| r["state"] == "-"), "{out}");
    assert!(!plan.iter().any(|r| r["local"].as_str().unwrap().starts_with("2026-03-29T02:")), "{out}");
    assert_eq!(
        plan[0]["key"].as_str().unwrap(),
        chime_shared::envelope::scheduled_key("report", expected[0].parse().unwrap()).to_string()
    );
    let (code, out, _) = chime(&path, &[&["backfill", "report", "--dry-run"][..], &night].concat(), None);
    assert_eq!(code, 0);
    assert!(out.contains("19 slot(s) of report") && out.contains("Nothing published"), "{out}");
    assert!(out.contains("2026-03-29 03:00:00 CEST") && out.contains("2026-03-29 01:50:00 CET"), "{out}");
    assert_eq!(depth(&env.names().work_queue("default")).await, 0, "a dry run publishes nothing");

    // The first three slots, then the whole night: the three are absorbed, the rest run once,
    // none expired by the deadline (which counts from the backfill).
    let (code, out, err) =
        chime(&path, &["backfill", "report", "--from", "2026-03-29T00:00", "--to", "2026-03-29T00:20"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("published 3 of 3 slots") && out.contains("3 had no record and will run"), "{out}");
    wait_until("three runs", Duration::from_secs(30), || async { slots_of(&runs, "report").len() >= 3 })
        .await;
    let done = |n: usize| {
        let env = &env;
        let keys: Vec<String> = expected[..n]
            .iter()
            .map(|s| chime_shared::envelope::scheduled_key("report", s.parse().unwrap()).to_string())
            .collect();
        async move {
            for k in &keys {
                if idem_state(env, k).await.as_deref() != Some("done") {
                    return false;
                }
            }
            true
        }
    };
    wait_until("three slots done", Duration::from_secs(30), || done(3)).await;
    let (code, out, err) =
        chime(&path, &[&["backfill", "report", "--rate", "500"][..], &night].concat(), None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("published 19 of 19 slots"), "{out}");
    assert!(out.contains("16 had no record and will run"), "{out}");
    assert!(out.contains("3 were already done: absorbed by the workers as duplicates"), "{out}");
    wait_until("every slot done", Duration::from_secs(60), || done(19)).await;
    wait_until("three duplicates absorbed", Duration::from_secs(30), || async { worker.duplicates() >= 3 })
        .await;
    let ran: Vec<String> = slots_of(&runs, "report")
        .iter()
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .collect();
    assert_eq!(ran, expected, "each slot exactly once, none expired");
    let (_, out, _) =
        chime(&path, &[&["backfill", "report", "--dry-run", "--json"][..], &night].concat(), None);
    let plan: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert!(plan.iter().all(|r| r["state"] == "done"), "{out}");

    // A sharded job: each slot fans out to its shards, complete when both are done.
    let (code, out, err) = chime(
        &path,
        &["backfill", "split", "--from", "2026-03-29T00:00:00Z", "--to", "2026-03-29T01:00:00Z"],
        None,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("published 2 of 2 slots"), "{out}");
    wait_until("four shard runs", Duration::from_secs(30), || async { slots_of(&runs, "split").len() >= 4 })
        .await;
    let mut shards: Vec<(DateTime<Utc>, Option<u32>)> =
        runs.lock().unwrap().iter().filter(|r| r.0 == "split").map(|r| (r.1, r.2)).collect();
    shards.sort();
    let h0: DateTime<Utc> = "2026-03-29T00:00:00Z".parse().unwrap();
    let h1 = h0 + chrono::Duration::hours(1);
    assert_eq!(shards, vec![(h0, Some(0)), (h0, Some(1)), (h1, Some(0)), (h1, Some(1))]);
    wait_until("both slots complete", Duration::from_secs(30), || async {
        let (_, out, _) = chime(
            &path,
            &[
                "backfill",
                "split",
                "--dry-run",
                "--json",
                "--from",
                "2026-03-29T00:00:00Z",
                "--to",
                "2026-03-29T01:00:00Z",
            ],
            None,
        );
        serde_json::from_str::<Vec<serde_json::Value>>(&out)
            .is_ok_and(|p| p.len() == 2 && p.iter().all(|r| r["state"] == "done"))
    })
    .await;

    // Bad requests, refused by name with exit code 2 and nothing published.
    let refused = |args: &[&str], says: &str| {
        let (code, out, err) = chime(&path, args, None);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(says), "{args:?}: {err}");
    };
    refused(&["backfill", "report", "--from", "now", "--to", "2099-01-01T00:00:00Z"], "is in the future");
    refused(
        &["backfill", "report", "--from", "2026-03-30T00:00", "--to", "2026-03-29T00:00"],
        "is after --to",
    );
    refused(&[&["backfill", "report", "--max", "5"][..], &night].concat(), "more than 5 slots of report");
    refused(
        &["backfill", "adhoc", "--from", "2026-03-29", "--to", "2026-03-30"],
        "job adhoc has no schedule",
    );
    refused(&["backfill", "nope", "--from", "2026-03-29", "--to", "2026-03-30"], "unknown job \"nope\"");
    refused(&["backfill", "report", "--from", "2026-03-29T02:30", "--to", "now"], "skips that local time");
    refused(&["backfill", "report", "--from", "2026-03-29", "--to", "now", "--rate", "0"], "--rate 0");
    assert_eq!(slots_of(&runs, "report").len(), 19);
    worker.stop().await;
}

/// "now" and "the future" are Redis `TIME`'s: on a host an hour ahead, `--to now` reached an
/// hour past the real now (3,600 slots of an every-second schedule, refused by `--max`, or
/// published early with a higher one), and a real future instant passed the check.
#[tokio::test]
async fn a_backfill_whose_clock_is_ahead_takes_no_slot_that_is_not_due() {
    let env = TestEnv::new("backfill-skew");
    let jobs = "[[jobs]]\nname = \"tick\"\nhandler = \"noop\"\nschedule = \"* * * * * *\"\n";
    let path = env.write_config(&env.config_text("quorum", "", "", jobs));
    let ahead = chime_tests::faked_clock("+3600");
    let ahead: Vec<(&str, &std::ffi::OsStr)> =
        ahead.iter().map(|(k, v)| (*k, std::ffi::OsStr::new(v))).collect();
    let from = (Utc::now() - chrono::Duration::seconds(10)).to_rfc3339();
    let args = ["backfill", "tick", "--from", &from, "--to", "now", "--dry-run", "--json"];
    let (code, out, err) = chime_env(&path, &args, None, &ahead);
    assert_eq!(code, 0, "{err}");
    let plan: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert!((9..=30).contains(&plan.len()), "{} slots from 10 s ago to now", plan.len());
    let later = (Utc::now() + chrono::Duration::minutes(10)).to_rfc3339();
    let (code, _, err) =
        chime_env(&path, &["backfill", "tick", "--from", &from, "--to", &later], None, &ahead);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is in the future"), "{err}");
}
