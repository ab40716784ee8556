//! Sharded, broadcast and overlap-controlled jobs on a daylight-saving night, across a leader
//! failover: tickers and workers run with their clocks set to Berlin's fall-back night of
//! 2026-10-25 (libfaketime), where 02:00-02:59 happens twice. Each job gets exactly the
//! schedule's slots (`chime jobs next`'s), each fanned out in full, once, and the overlap
//! policy holds through the repeated hour and the takeover.

use chime_scheduler::lease::TickerStore;
use chime_shared::envelope::scheduled_key;
use chrono::{DateTime, SecondsFormat, Utc};
use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::*;

fn utc(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// Lines of a ledger split into fields, instants written as `utc` does (`CHIME_SLOT` is
/// RFC 3339 with `+00:00`).
fn rows(path: &std::path::Path) -> Vec<Vec<String>> {
    let field = |f: &str| f.parse::<DateTime<Utc>>().map(utc).unwrap_or_else(|_| f.to_string());
    ledger(path).iter().map(|l| l.split_whitespace().map(field).collect()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fanned_out_and_overlap_jobs_keep_the_schedule_on_a_dst_night_across_a_failover() {
    let env = TestEnv::new("dstnight");
    let (split, every, single) = (env.dir.join("split"), env.dir.join("every"), env.dir.join("single"));
    // Every 5 s in the local hour 2, which this night has twice (CEST, then CET): a job whose
    // minutes are not fixed runs in both (cronie's rule).
    let at = "schedule = \"*/5 * 2 * * *\"\ntimezone = \"Europe/Berlin\"\nhandler = \"exec\"\n\
              pass_env = [\"LEDGER_DIR\", \"TAG\"]\n";
    let jobs = format!(
        "[ticker]\nlease = \"2s\"\n\
         [[jobs]]\nname = \"split\"\n{at}shards = 2\n\
         command = [\"sh\", \"-c\", \"echo $CHIME_SLOT $CHIME_SHARD >> $LEDGER_DIR/split\"]\n\
         [[jobs]]\nname = \"every\"\n{at}broadcast = true\n\
         command = [\"sh\", \"-c\", \"echo $CHIME_SLOT $TAG >> $LEDGER_DIR/every\"]\n\
         [[jobs]]\nname = \"single\"\n{at}overlap = \"skip\"\n\
         command = [\"sh\", \"-c\", \"echo S $CHIME_SLOT >> $LEDGER_DIR/single; sleep 7; echo E $CHIME_SLOT >> $LEDGER_DIR/single\"]\n"
    );
    let text = env.config_text("quorum", "", "", &jobs);
    let path = env.write_config(&text);
    let config = chime_shared::Config::from_toml_str(&text).unwrap();
    // Every clock of the stack 35 s before the repeated hour begins (01:00:00Z = 02:00 CET).
    let start: DateTime<Utc> = "2026-10-25T00:59:25Z".parse().unwrap();
    let offset = format!("{:+}", (start - Utc::now()).num_seconds());
    let dir = env.dir.to_str().unwrap();
    let worker = |tag: &str| {
        Child::with_clock(
            "chime-worker",
            &env.dir,
            &path,
            &[],
            &offset,
            &format!("worker-{tag}"),
            &[("LEDGER_DIR", dir), ("TAG", tag)],
        )
    };
    let ticker = |tag: &str| {
        Child::with_clock("chime", &env.dir, &path, &["tick"], &offset, &format!("ticker-{tag}"), &[])
    };
    let (_a, _b) = (worker("a"), worker("b"));
    let conn = chime_shared::redis_conn::RedisConn::connect(&config.redis).await.unwrap();
    let names = env.names();
    wait_until("two live workers", Duration::from_secs(30), || {
        let (mut c, names) = (conn.clone(), names.clone());
        async move {
            // Read without `control::workers`, which drops beats older than a minute by this
            // process's clock, i.e. every beat of a faked night.
            let ids: Vec<String> = redis::cmd("ZRANGE")
                .arg(names.workers_index())
                .arg(0)
                .arg(-1)
                .query_async(&mut c)
                .await
                .unwrap();
            let keys: Vec<String> = ids.iter().map(|id| names.worker(id)).collect();
            let texts: Vec<Option<String>> = if keys.is_empty() {
                Vec::new()
            } else {
                redis::cmd("MGET").arg(&keys).query_async(&mut c).await.unwrap()
            };
            let beats: Vec<chime_shared::control::WorkerBeat> =
                texts.into_iter().flatten().filter_map(|t| serde_json::from_str(&t).ok()).collect();
            chime_shared::group::consumers_of(&beats, "default", None).len() == 2
        }
    })
    .await;
    let store = TickerStore::connect(&config.redis, &config.prefix).unwrap();
    let mut tickers = vec![ticker("one"), ticker("two")];
    let ran_at_least = |t: &'static str| {
        let t: DateTime<Utc> = t.parse().unwrap();
        let split = split.clone();
        move || {
            let split = split.clone();
            async move { rows(&split).iter().any(|r| r[0].parse::<DateTime<Utc>>().is_ok_and(|s| s >= t)) }
        }
    };
    // The leader dies in the repeated hour; the standby takes over from the watermarks.
    wait_until("a slot of the repeated hour", Duration::from_secs(90), ran_at_least("2026-10-25T01:00:05Z"))
        .await;
    let leader = store.leader().await.unwrap().unwrap().id;
    let i = tickers
        .iter()
        .position(|t| leader.split(':').nth(1) == Some(&t.pid().to_string()))
        .unwrap_or_else(|| panic!("the leader {leader} is one of the two tickers"));
    drop(tickers.remove(i));
    wait_until("the standby leads", Duration::from_secs(20), || async {
        store.leader().await.ok().flatten().is_some_and(|l| l.id != leader)
    })
    .await;
    wait_until("slots under the new leader", Duration::from_secs(60), ran_at_least("2026-10-25T01:00:30Z"))
        .await;
    // The leader decides the overlap job's slot in the same batch, and records a skip after the
    // batch's confirms: the tickers stop only once it has (else nobody would).
    let last = "2026-10-25T01:00:30Z";
    wait_until("the overlap job's last slot decided", Duration::from_secs(30), || async {
        rows(&single).iter().any(|l| l[0] == "S" && l[1] == last)
            || skipped_keys(&env).contains(&single_key(last))
    })
    .await;
    drop(tickers);
    finish(&env, &config, &split, &every, &single).await;
}

/// The keys of the overlap job's slots the ticker recorded as skipped.
fn skipped_keys(env: &TestEnv) -> Vec<String> {
    let (code, out, err) = chime(
        &env.dir.join("chime.toml"),
        &["history", "--job", "single", "--outcome", "skipped", "--json", "--limit", "1000"],
        None,
    );
    assert_eq!(code, 0, "{err}");
    let found: serde_json::Value = serde_json::from_str(&out).unwrap();
    found["runs"].as_array().unwrap().iter().map(|e| e["key"].as_str().unwrap().to_string()).collect()
}

/// The key of the overlap job's slot `s` (as `utc` writes it).
fn single_key(s: &str) -> String {
    scheduled_key("single", s.parse().unwrap()).to_string()
}

/// Lets the runs under way end, and checks every job's slots.
async fn finish(
    env: &TestEnv,
    config: &chime_shared::Config,
    split: &std::path::Path,
    every: &std::path::Path,
    single: &std::path::Path,
) {
    // The slots to account for: from the first the sharded job ran to 01:00:30Z, by the schedule.
    let schedule = config.schedule_of(config.job("split").unwrap()).unwrap().unwrap();
    let first = rows(split).iter().filter_map(|r| r[0].parse::<DateTime<Utc>>().ok()).min().unwrap();
    let last: DateTime<Utc> = "2026-10-25T01:00:30Z".parse().unwrap();
    let mut slots = vec![first];
    slots.extend(schedule.slots_between(first, last, 100));
    let slots: Vec<String> = slots.into_iter().map(utc).collect();
    assert!(
        first <= "2026-10-25T00:59:50Z".parse::<DateTime<Utc>>().unwrap(),
        "the run began before the repeated hour: {first}"
    );
    assert!(
        slots.contains(&"2026-10-25T00:59:55Z".to_string())
            && slots.contains(&"2026-10-25T01:00:00Z".to_string())
    );
    let in_range = |s: &str| slots.iter().any(|x| x == s);
    let skipped = || skipped_keys(env);
    // Every run of the window has ended, and each of the overlap job's slots started or was
    // skipped (its last slot's run may start after the sharded job's).
    // (On a timeout the checks below say what is missing.)
    let ended = || {
        let split_done = slots.iter().all(|s| rows(split).iter().filter(|r| &r[0] == s).count() >= 2);
        let every_done = slots.iter().all(|s| rows(every).iter().filter(|r| &r[0] == s).count() >= 2);
        let r = rows(single);
        let single_done =
            r.iter().filter(|l| l[0] == "S").count() == r.iter().filter(|l| l[0] == "E").count();
        let skipped = skipped();
        let single_accounted = slots
            .iter()
            .all(|s| r.iter().any(|l| l[0] == "S" && &l[1] == s) || skipped.contains(&single_key(s)));
        split_done && every_done && single_done && single_accounted
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !ended() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Sharded: each slot's two shards, exactly once each; no slot outside the schedule.
    let mut shards: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in rows(split) {
        assert!(
            r[0].as_str() > slots[slots.len() - 1].as_str() || in_range(&r[0]),
            "split ran a slot the schedule does not have: {r:?}"
        );
        shards.entry(r[0].clone()).or_default().push(r[1].clone());
    }
    for s in &slots {
        let mut got = shards.get(s).cloned().unwrap_or_default();
        got.sort();
        assert_eq!(got, ["0", "1"], "split at {s}: each shard once");
    }
    // Broadcast: each slot once on each of the two workers.
    let mut copies: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in rows(every) {
        assert!(r[0].as_str() > slots[slots.len() - 1].as_str() || in_range(&r[0]), "every ran {r:?}");
        copies.entry(r[0].clone()).or_default().push(r[1].clone());
    }
    for s in &slots {
        let mut got = copies.get(s).cloned().unwrap_or_default();
        got.sort();
        assert_eq!(got, ["a", "b"], "every at {s}: once per worker");
    }
    // Overlap skip: runs never overlap (start, end, start, end …), and each slot either ran once
    // or was recorded as skipped, never both.
    let r = rows(single);
    for pair in r.chunks(2) {
        assert!(
            pair.len() == 2 && pair[0][0] == "S" && pair[1][0] == "E" && pair[0][1] == pair[1][1],
            "{r:?}"
        );
    }
    let ran: Vec<&String> = r.iter().filter(|l| l[0] == "S").map(|l| &l[1]).collect();
    let skipped = skipped();
    let (mut n_ran, mut n_skipped) = (0, 0);
    for s in &slots {
        let key = single_key(s);
        let times_ran = ran.iter().filter(|x| **x == s).count();
        let times_skipped = skipped.iter().filter(|k| **k == key).count();
        assert_eq!(times_ran + times_skipped, 1, "single at {s}: ran {times_ran}, skipped {times_skipped}");
        n_ran += times_ran;
        n_skipped += times_skipped;
    }
    assert!(
        n_ran >= 2 && n_skipped >= 2,
        "a 7 s job every 5 s both runs and skips: {n_ran} ran, {n_skipped} skipped"
    );
}
