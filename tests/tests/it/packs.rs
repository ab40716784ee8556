//! Packed batches: several jobs in one AMQP message, each settled on its own. One job of a
//! pack is retried alone, another dead-lettered alone and replayed from the DLQ alone; the
//! CLI packs a batch file; and `chime-worker` processes SIGKILLed at random while draining
//! packs with failing jobs lose nothing and run nothing twice beyond the jobs they were
//! running when they died.

use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_worker::{JobContext, JobError, Registry, raw_handler_fn};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::common::*;

fn dlq_letters(path: &Path) -> Vec<serde_json::Value> {
    let (code, out, err) = chime(path, &["dlq", "list", "--json"], None);
    assert_eq!(code, 0, "{out}{err}");
    serde_json::from_str(&out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_job_of_a_pack_is_retried_dead_lettered_and_replayed_alone() {
    let env = TestEnv::new("pack-one");
    let jobs = "[[jobs]]\nname = \"pk\"\nhandler = \"pk\"\nmax_attempts = 2\n\
                backoff = { initial = \"1s\", factor = 1.0, max = \"1s\" }\n\
                [[jobs]]\nname = \"fan\"\nhandler = \"pk\"\nbroadcast = true\n";
    let text = env.config_text("quorum", "", "", jobs);
    let path = env.write_config(&text);
    let config = env.config("quorum", "", "", jobs);
    let client = EnqueueClient::connect(config.clone()).await.unwrap();

    // 50 jobs in packs of 20: three messages on the queue, not fifty.
    let reqs: Vec<EnqueueRequest> = (0..50u64)
        .map(|n| EnqueueRequest::new("pk").key(format!("n-{n}")).payload(serde_json::json!({"n": n})))
        .collect();
    let report = client.enqueue_packed(&reqs, 20).await.unwrap();
    assert!(report.error.is_none(), "{:?}", report.error);
    assert_eq!((report.total, report.confirmed), (50, 50));
    let queue = env.names().work_queue("default");
    assert_eq!(depth(&queue).await, 3, "packs of 20, 20 and 10");

    // Job 7 fails once (its retry runs alone); job 13 fails for good while `broken`.
    let (ledger, attempts) = (Ledger::default(), Ledger::default());
    let broken = Arc::new(AtomicBool::new(true));
    let mut reg = Registry::new();
    let (l, a, b) = (ledger.clone(), attempts.clone(), broken.clone());
    reg.register(
        "pk",
        raw_handler_fn(move |ctx: JobContext, p: serde_json::Value| {
            let n = p["n"].as_u64().unwrap();
            l.record(n);
            if n == 7 {
                a.record(u64::from(ctx.attempt()));
            }
            let fails = (n == 7 && ctx.attempt() == 1) || (n == 13 && b.load(Ordering::SeqCst));
            async move { if fails { Err(JobError::transient(format!("job {n} failed"))) } else { Ok(()) } }
        }),
    );
    let worker = Running::start(config.clone(), reg, 8).await;
    let w = &worker;
    wait_until("49 done, 1 dead", Duration::from_secs(60), || async {
        w.succeeded() == 49 && w.dead_lettered() == 1
    })
    .await;
    assert_eq!(ledger.distinct(), 50);
    for n in 0..50 {
        let want = match n {
            7 | 13 => 2,
            _ => 1,
        };
        assert_eq!(ledger.get(n), want, "job {n} ran {} times", ledger.get(n));
    }
    assert_eq!((attempts.get(1), attempts.get(2)), (1, 1), "job 7: attempt 1 failed, attempt 2 ran");
    assert_eq!(depth(&queue).await, 0, "every pack acked");

    // The DLQ holds job 13 alone, as a job of its own: its key, its job, its payload.
    let letters = dlq_letters(&path);
    assert_eq!(letters.len(), 1, "{letters:?}");
    let key13 = chime_shared::envelope::adhoc_key("pk", "n-13").to_string();
    assert_eq!(letters[0]["key"], key13.as_str());
    assert_eq!(letters[0]["job"], "pk");
    let (code, shown, err) = chime(&path, &["dlq", "show", letters[0]["id"].as_str().unwrap()], None);
    assert_eq!(code, 0, "{err}");
    assert!(shown.contains("\"n\": 13") && !shown.contains("x-chime-pack"), "{shown}");
    // Its history and inspect see the job, not the pack.
    let key7 = chime_shared::envelope::adhoc_key("pk", "n-7").to_string();
    let (code, out, _) = chime(&path, &["history", "--key", &key7, "--json"], None);
    assert_eq!(code, 0);
    assert!(out.contains("\"retried\"") && out.contains("\"succeeded\""), "{out}");

    // Replayed alone once it can succeed: it runs, nothing else does.
    broken.store(false, Ordering::SeqCst);
    let (code, out, err) = chime(&path, &["dlq", "replay", "--key", &key13], None);
    assert_eq!(code, 0, "{out}{err}");
    let l = &ledger;
    wait_until("job 13 ran from the replay", Duration::from_secs(30), || async { l.get(13) == 3 }).await;
    let e = &env;
    wait_until("job 13 done", Duration::from_secs(30), || async {
        idem_state(e, &key13).await.as_deref() == Some("done")
    })
    .await;
    assert_eq!(ledger.total(), 53, "only job 13 ran again");

    // The CLI packs a batch file (a bad --pack and a broadcast job are refused by name).
    let batch = env.dir.join("batch.jsonl");
    let lines: String =
        (100..130u64).map(|n| format!("{{\"key\":\"n-{n}\",\"payload\":{{\"n\":{n}}}}}\n")).collect();
    std::fs::write(&batch, lines).unwrap();
    let b = batch.to_str().unwrap();
    let (code, _, err) = chime(&path, &["enqueue", "pk", "--batch", b, "--pack", "0"], None);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--pack 0"), "{err}");
    let (code, _, err) = chime(&path, &["enqueue", "fan", "--batch", b, "--pack", "10"], None);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("broadcast"), "{err}");
    let (code, out, err) = chime(&path, &["enqueue", "pk", "--batch", b, "--pack", "16"], None);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("confirmed 30 of 30 jobs"), "{out}");
    wait_until("the CLI's 30 packed jobs ran", Duration::from_secs(30), || async { l.distinct() == 80 })
        .await;
    // The same file again: every key is done, so nothing runs twice.
    let (code, _, err) = chime(&path, &["enqueue", "pk", "--batch", b, "--pack", "16"], None);
    assert_eq!(code, 0, "{err}");
    wait_until("the second copies absorbed", Duration::from_secs(30), || async { w.duplicates() >= 30 })
        .await;
    assert_eq!(ledger.total(), 83, "no job of the file ran twice");
    worker.stop().await;
}

/// `<worker pid> <attempt> <n> <fail>` lines the exec job appends as it starts (the worker
/// is the parent of the guard shell that runs the command).
fn starts(ledger: &Path) -> Vec<(u32, u32, u64, bool)> {
    ledger_file(ledger)
        .iter()
        .filter_map(|l| {
            let mut p = l.split_whitespace();
            Some((
                p.next()?.parse().ok()?,
                p.next()?.parse().ok()?,
                p.next()?.parse().ok()?,
                p.next()? == "true",
            ))
        })
        .collect()
}

fn ledger_file(path: &Path) -> Vec<String> {
    ledger(path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_killed_at_random_while_draining_packs_lose_nothing() {
    let env = TestEnv::new("pack-kill");
    let ledger = env.dir.join("ledger");
    // Every 20th job fails (5 %): retried once, then dead-lettered.
    let jobs = format!(
        "[[jobs]]\nname = \"p\"\nhandler = \"exec\"\nmax_attempts = 2\n\
         backoff = {{ initial = \"1s\", factor = 1.0, max = \"1s\" }}\n\
         command = ['sh', '-c', 'read -r a b c w rest < /proc/$PPID/stat; p=$(cat); n=${{p#*\\\"n\\\":}}; n=${{n%\\}}}}; \
          f=false; case \"$p\" in *true*) f=true;; esac; echo \"$w $CHIME_ATTEMPT $n $f\" >> {l}; sleep 0.02; test $f = false']\n",
        l = ledger.display()
    );
    let text = env.config_text("quorum", "", "concurrency = 8", &jobs);
    let path = env.write_config(&text);
    let total = 600u64;
    let batch = env.dir.join("batch.jsonl");
    let lines: String = (0..total)
        .map(|n| format!("{{\"key\":\"k-{n}\",\"payload\":{{\"n\":{n},\"fail\":{}}}}}\n", n % 20 == 7))
        .collect();
    std::fs::write(&batch, lines).unwrap();
    let (code, out, err) =
        chime(&path, &["enqueue", "p", "--batch", batch.to_str().unwrap(), "--pack", "100"], None);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(depth(&env.names().work_queue("default")).await, 6, "six packs of 100");

    // Two workers; one SIGKILLed (and replaced) each time another 100 runs have started.
    let mut workers =
        vec![Child::worker(&env.dir, &path, &[], "w0"), Child::worker(&env.dir, &path, &[], "w1")];
    let mut killed = BTreeSet::new();
    let mut seed = std::process::id() as usize;
    for round in 1..=4usize {
        let l = &ledger;
        wait_until("another 100 runs started", Duration::from_secs(120), || async {
            starts(l).len() >= round * 100
        })
        .await;
        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let victim = workers.remove(seed % workers.len());
        killed.insert(victim.pid() as u32);
        victim.signal(9);
        workers.push(Child::worker(&env.dir, &path, &[], &format!("w{}", round + 1)));
    }
    let names = env.names();
    let (queue, dlq) = (names.work_queue("default"), names.dlq("default"));
    let l = &ledger;
    let key_of = |n: u64| chime_shared::envelope::adhoc_key("p", &format!("k-{n}")).to_string();
    let failing: Vec<u64> = (0..total).filter(|n| n % 20 == 7).collect();
    // Ended: every good job ran, every failing key is `dead` with its letter in the DLQ (a
    // worker killed between the dead letter's publish and recording `dead` leaves the key
    // `dying`, and the next copy dead-letters it again: the DLQ may hold more than 30).
    wait_for_state("every job ended: 570 ran, 30 keys dead, queue empty", Duration::from_secs(180), || async {
        let ran: BTreeSet<u64> = starts(l).iter().filter(|s| !s.3).map(|s| s.2).collect();
        let (letters, waiting) = (depth(&dlq).await, depth(&queue).await);
        let mut redis = connect_redis(&env.redis_url).await;
        let mut pipe = redis::pipe();
        for n in &failing {
            pipe.cmd("HGET").arg(env.names().idem_key(&key_of(*n))).arg("s");
        }
        let states: Vec<Option<String>> = pipe.query_async(&mut redis).await.map_err(|e| e.to_string())?;
        let dead = states.iter().filter(|s| s.as_deref() == Some("dead")).count();
        if ran.len() == 570 && dead == 30 && letters >= 30 && waiting == 0 {
            return Ok(());
        }
        let missing: Vec<u64> = (0..total).filter(|n| n % 20 != 7 && !ran.contains(n)).collect();
        let mut records = Vec::new();
        for n in missing.iter().take(5) {
            let record: std::collections::HashMap<String, String> =
                redis::cmd("HGETALL").arg(env.names().idem_key(&key_of(*n))).query_async(&mut redis).await.unwrap_or_default();
            records.push(format!("job {n}: {record:?}"));
        }
        Err(format!(
            "{} of 570 ran, {dead} of 30 failing keys dead, dlq {letters}, queue {waiting}, missing {missing:?}; {}",
            ran.len(),
            records.join("; ")
        ))
    })
    .await;

    let runs = starts(&ledger);
    let mut by_job: BTreeMap<u64, Vec<(u32, u32)>> = BTreeMap::new();
    for (pid, attempt, n, _) in &runs {
        by_job.entry(*n).or_default().push((*pid, *attempt));
    }
    assert_eq!(by_job.len() as u64, total, "every job ran");
    // A job runs again only when the worker that ran it before was killed (it may have died
    // before recording the run): each extra run follows a run by a killed worker.
    let mut extra = 0;
    for (n, r) in &by_job {
        let fails = n % 20 == 7;
        let expected = if fails { 2 } else { 1 };
        for i in expected..r.len() {
            assert!(
                r[..i].iter().any(|(p, _)| killed.contains(p)),
                "job {n} ran again though no worker that ran it died: {r:?}"
            );
            extra += 1;
        }
        if fails {
            let attempts: BTreeSet<u32> = r.iter().map(|x| x.1).collect();
            assert!(attempts.contains(&2), "failing job {n} was retried: {r:?}");
        }
    }
    // Each failing job is in the DLQ alone, under its own key; twice only when a killed worker
    // ran its last attempt (it died between the dead letter's confirm and recording `dead`).
    let letters = dlq_letters(&path);
    let mut per_key: BTreeMap<String, usize> = BTreeMap::new();
    for d in &letters {
        *per_key.entry(d["key"].as_str().unwrap().to_string()).or_default() += 1;
    }
    let mut want: Vec<String> = failing.iter().map(|n| key_of(*n)).collect();
    want.sort();
    assert_eq!(per_key.keys().cloned().collect::<Vec<_>>(), want, "a dead letter per failing job, alone");
    let mut twice = 0;
    for n in &failing {
        let letters = per_key[&key_of(*n)];
        if letters > 1 {
            let r = &by_job[n];
            assert!(
                letters == 2 && r.iter().any(|(p, a)| *a == 2 && killed.contains(p)),
                "job {n} dead-lettered {letters} times though no killed worker ran its last attempt: {r:?}"
            );
            twice += 1;
        }
    }
    println!(
        "packs: {total} jobs in 6 packs of 100, {} workers SIGKILLed mid-pack: lost 0, extra runs {extra} \
         (runs in progress when a worker died; at most 8 per kill), {} runs in all, {twice} of 30 \
         dead letters twice (dead-lettered by a killed worker)",
        killed.len(),
        runs.len()
    );
    // A killed worker was running at most `concurrency` (8) jobs: only those may run again (a
    // job whose retry it had published is stale when its pack comes back, not run again).
    assert!(extra <= 8 * killed.len(), "extra runs {extra} beyond the 8 per kill in progress");
    for mut w in workers {
        w.signal(15);
        let _ = tokio::time::timeout(Duration::from_secs(60), w.child.wait()).await;
    }
}
