//! Business calendars against the real services: a ticker skips (and records) the slots of a
//! holiday read from an `.ics` file, and runs them once the file no longer says so (reloaded
//! without a restart); backfill publishes the rolled slots of a past holiday week once each;
//! `jobs next` says why a slot moved or was skipped; `check-config` names a bad calendar.

use chime_scheduler::lease::TickerStore;
use chrono::{DateTime, Utc};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;

fn ics(days: &[chrono::NaiveDate]) -> String {
    let mut text = String::from("BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//test//EN\r\n");
    for d in days {
        text.push_str(&format!(
            "BEGIN:VEVENT\r\nUID:{d}@test\r\nDTSTART;VALUE=DATE:{}\r\nSUMMARY:Closed\r\nEND:VEVENT\r\n",
            d.format("%Y%m%d")
        ));
    }
    text + "END:VCALENDAR\r\n"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holiday_from_an_ics_file_skips_slots_until_the_file_changes() {
    let env = TestEnv::new("calendar");
    // Today and tomorrow (UTC) are holidays, so the test may cross midnight.
    let today = Utc::now().date_naive();
    let holidays = env.dir.join("holidays.ics");
    std::fs::write(&holidays, ics(&[today, today.succ_opt().unwrap()])).unwrap();
    let jobs = format!(
        "[ticker]\nlease = \"2s\"\n\
         [[calendars]]\nname = \"hq\"\nweekdays = [\"mon\", \"tue\", \"wed\", \"thu\", \"fri\", \"sat\", \"sun\"]\nics = {:?}\n\
         [[jobs]]\nname = \"beat\"\nhandler = \"beat\"\nschedule = \"* * * * * *\"\ncalendar = \"hq\"\n",
        holidays.display().to_string()
    );
    let text = env.config_text("quorum", "", "", &jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    let runs: SlotRuns = Arc::default();
    let worker = Running::start(config.clone(), slot_recording(&runs, &["beat"]), 4).await;
    let store = TickerStore::connect(&config.redis, &config.prefix).unwrap();
    let leader = Child::ticker(&env.dir, &path, &[], "a");
    wait_until("ticker a leads", Duration::from_secs(20), || async {
        store
            .leader()
            .await
            .ok()
            .flatten()
            .is_some_and(|l| l.id.split(':').nth(1) == Some(&leader.pid().to_string()))
    })
    .await;
    let standby = Child::ticker(&env.dir, &path, &[], "b");

    // `jobs next` says so.
    let (code, out, err) = chime(&path, &["jobs", "next", "beat", "--count", "1"], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("slots skipped: ") && out.contains("is a holiday [calendar hq]"), "{out}");

    // Slots are skipped, counted and recorded in the history; nothing runs.
    let history = |outcome: &str| {
        let (code, out, err) =
            chime(&path, &["history", "--job", "beat", "--outcome", outcome, "--json"], None);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["runs"].as_array().cloned().unwrap_or_default()
    };
    wait_until("three skipped slots in the history", Duration::from_secs(30), || async {
        history("skipped").len() >= 3
    })
    .await;
    let skipped = history("skipped");
    assert!(
        skipped.iter().all(|e| e["reason"] == "calendar"
            && e["error"].as_str().unwrap().contains("is a holiday in calendar \"hq\"")),
        "{skipped:?}"
    );
    assert!(store.counts().await.unwrap()["beat"].calendar >= 3);
    assert!(slots_of(&runs, "beat").is_empty(), "a slot ran on a holiday");
    // The leader dies; the standby carries on skipping, from the watermark.
    drop(leader);
    let before = history("skipped").len();
    wait_until("the standby skips too", Duration::from_secs(30), || async {
        history("skipped").len() >= before + 3
    })
    .await;
    assert!(slots_of(&runs, "beat").is_empty(), "a slot ran on a holiday after the failover");
    let ticker = standby;

    // The file changes (the holidays are withdrawn): the ticker reloads it, slots run again.
    std::fs::write(&holidays, ics(&[])).unwrap();
    wait_until("three runs after the reload", Duration::from_secs(30), || async {
        slots_of(&runs, "beat").len() >= 3
    })
    .await;
    assert!(ticker.log_text().contains("config reloaded"), "{}", ticker.log_text());
    drop(ticker);
    // No slot was both skipped and run; each ran once.
    let all_skipped = history("skipped");
    let skipped_keys: BTreeSet<String> =
        all_skipped.iter().map(|e| e["key"].as_str().unwrap().to_string()).collect();
    assert_eq!(skipped_keys.len(), all_skipped.len(), "a slot recorded skipped twice (by both leaders)");
    let ran = slots_of(&runs, "beat");
    for slot in &ran {
        let key = chime_shared::envelope::scheduled_key("beat", *slot).to_string();
        assert!(!skipped_keys.contains(&key), "slot {slot} was skipped and ran");
    }
    assert_eq!(ran.iter().collect::<BTreeSet<_>>().len(), ran.len(), "a slot ran twice: {ran:?}");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_runs_a_holiday_weeks_rolled_slots_once_and_jobs_next_says_why() {
    let env = TestEnv::new("calbackfill");
    // New York, Thanksgiving (Thursday 26 November 2026) and the day after off.
    let jobs = "[[calendars]]\nname = \"us\"\nzone = \"America/New_York\"\nholidays = [\"2026-11-26\", \"2026-11-27\"]\n\
                [[jobs]]\nname = \"pay\"\nhandler = \"pay\"\nschedule = \"0 9 * * *\"\ncalendar = \"us\"\non_holiday = \"next_business_day\"\n\
                [[jobs]]\nname = \"standup\"\nhandler = \"standup\"\nschedule = \"0 9 * * *\"\ncalendar = \"us\"\n\
                [[jobs]]\nname = \"close\"\nhandler = \"close\"\nschedule = \"0 17 * * *\"\ncalendar = \"us\"\nbusiness_day = -1\n";
    let text = env.config_text("quorum", "", "", jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();

    // A count is 1 to 10,000 (a mistyped one would compute slots until memory ran out).
    for count in ["0", "100000000"] {
        let (code, _, err) = chime(&path, &["jobs", "next", "pay", "--count", count], None);
        assert_eq!(code, 2, "{count}: {err}");
        assert!(err.contains("is not in 1..=10000"), "{err}");
    }
    // Past the last slot chime can compute, an empty answer says so.
    let (code, out, err) =
        chime(&path, &["jobs", "next", "pay", "--after", "9999-12-31T00:00:00Z", "--count", "2"], None);
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
    assert!(err.contains("note: 0 slot(s) of pay after 9999-12-31T00:00:00Z: there are no more"), "{err}");
    let (code, out, err) =
        chime(&path, &["jobs", "next", "pay", "--after", "2026-11-25T00:00:00Z", "--count", "3"], None);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        "2026-11-25T14:00:00Z\n\
         2026-11-30T14:00:00Z  next business day for Thu 2026-11-26 09:00 (holiday), Fri 2026-11-27 09:00 (holiday), \
         Sat 2026-11-28 09:00 (day off), Sun 2026-11-29 09:00 (day off) [calendar us]\n\
         2026-12-01T14:00:00Z\n"
    );
    let (_, out, _) =
        chime(&path, &["jobs", "next", "standup", "--after", "2026-11-25T00:00:00Z", "--count", "2"], None);
    assert_eq!(
        out,
        "2026-11-25T14:00:00Z\n\
         2026-11-26T14:00:00Z  skipped: Thu 2026-11-26 is a holiday [calendar us]\n\
         2026-11-27T14:00:00Z  skipped: Fri 2026-11-27 is a holiday [calendar us]\n\
         2026-11-28T14:00:00Z  skipped: Sat 2026-11-28 is a day off [calendar us]\n\
         2026-11-29T14:00:00Z  skipped: Sun 2026-11-29 is a day off [calendar us]\n\
         2026-11-30T14:00:00Z\n"
    );
    let (_, out, _) =
        chime(&path, &["jobs", "next", "close", "--after", "2026-11-01T00:00:00Z", "--count", "1"], None);
    assert_eq!(out, "2026-11-30T22:00:00Z  last business day of November 2026 [calendar us]\n");

    // Backfill the week, twice: Wednesday's, then Monday's (with Thursday to Sunday rolled
    // onto it), then Tuesday's slot; the second backfill's copies are absorbed.
    let runs: SlotRuns = Arc::default();
    let worker = Running::start(config.clone(), slot_recording(&runs, &["pay", "standup", "close"]), 8).await;
    let week = ["--from", "2026-11-25T00:00", "--to", "2026-12-01T23:00"];
    for job in ["pay", "standup", "close"] {
        for _ in 0..2 {
            let (code, out, err) = chime(&path, &[&["backfill", job][..], &week].concat(), None);
            assert_eq!(code, 0, "{out}{err}");
        }
    }
    let utc = |s: &str| s.parse::<DateTime<Utc>>().unwrap();
    let business =
        vec![utc("2026-11-25T14:00:00Z"), utc("2026-11-30T14:00:00Z"), utc("2026-12-01T14:00:00Z")];
    wait_until("the week's runs", Duration::from_secs(30), || async {
        slots_of(&runs, "pay").len() >= 3
            && slots_of(&runs, "standup").len() >= 3
            && !slots_of(&runs, "close").is_empty()
    })
    .await;
    // Wait for the second copies to be absorbed before counting.
    wait_until("every copy settled", Duration::from_secs(30), || async {
        worker.succeeded() + worker.duplicates() >= 14
    })
    .await;
    assert_eq!(slots_of(&runs, "pay"), business);
    assert_eq!(slots_of(&runs, "standup"), business);
    assert_eq!(slots_of(&runs, "close"), [utc("2026-11-30T22:00:00Z")]);
    worker.stop().await;
}

#[test]
fn check_config_names_a_bad_calendar() {
    let env = TestEnv::new("calcheck");
    let bad = env.dir.join("bad.ics");
    std::fs::write(&bad, "BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART;VALUE=DATE:20261225\nRRULE:FREQ=MONTHLY\nEND:VEVENT\nEND:VCALENDAR\n")
        .unwrap();
    for (calendars, job, says) in [
        (format!("ics = {:?}\n", bad.display().to_string()), "", "calendars[0] (eu).ics: "),
        (
            String::new(),
            "calendar = \"us\"\n",
            "jobs[0] (run).calendar: \"us\" is not a [[calendars]] entry (known: eu)",
        ),
        ("weekdays = []\n".into(), "", "calendars[0] (eu).weekdays: the calendar has no working day"),
        (
            String::new(),
            "calendar = \"eu\"\nbusiness_day = 25\n",
            "jobs[0] (run).business_day: business_day = 25 can never match",
        ),
    ] {
        let job = if job.is_empty() { "calendar = \"eu\"\n" } else { job };
        let text = format!(
            "prefix = \"{}\"\n[[calendars]]\nname = \"eu\"\nzone = \"Europe/Paris\"\n{calendars}\
             [[jobs]]\nname = \"run\"\nhandler = \"noop\"\nschedule = \"0 9 * * *\"\n{job}",
            env.prefix
        );
        let path = env.write_config(&text);
        let (code, out, err) = chime(&path, &["check-config"], None);
        assert_eq!(code, 2, "{text}\n{out}{err}");
        assert!(err.contains(says), "{text}\n→ {err}");
        if says.contains(".ics") {
            assert!(err.contains("bad.ics: line 4") && err.contains("FREQ"), "{err}");
        }
    }
}
