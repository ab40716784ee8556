//! The `chime` binary: exit codes, confirmations, batch, and bad input publishing nothing.

use crate::common::*;

const JOBS: &str = "[[jobs]]\nname = \"greet\"\nhandler = \"noop\"\n";

#[tokio::test]
async fn config_errors_exit_2_naming_the_key() {
    let env = TestEnv::new("clicfg");
    let good = env.write_config(&env.config_text("classic", "", "", JOBS));
    let (code, out, _) = chime(&good, &["check-config"], None);
    assert_eq!(code, 0);
    assert!(out.contains("config OK: 1 job(s)"), "{out}");

    let bad = env.dir.join("bad.toml");
    std::fs::write(&bad, format!("{}\n[worker]\nconcurency = 4\n", "prefix = \"x\"")).unwrap();
    let (code, _, err) = chime(&bad, &["check-config"], None);
    assert_eq!(code, 2);
    assert!(err.contains("concurency"), "{err}");

    std::fs::write(&bad, "[[jobs]]\nname = \"a\"\nhandler = \"exec\"\n").unwrap();
    let (code, _, err) = chime(&bad, &["check-config"], None);
    assert_eq!(code, 2);
    assert!(err.contains("jobs[0] (a).command"), "{err}");

    let (code, _, err) = chime(&env.dir.join("missing.toml"), &["check-config"], None);
    assert_eq!(code, 2);
    assert!(err.contains("not found"), "{err}");
}

#[tokio::test]
async fn enqueue_confirms_and_bad_input_publishes_nothing() {
    let env = TestEnv::new("clienq");
    let path = env.write_config(&env.config_text("quorum", "", "", JOBS));
    let queue = env.names().work_queue("default");

    let (code, _, err) = chime(&path, &["enqueue", "nope"], None);
    assert_eq!(code, 2);
    assert!(err.contains("unknown job \"nope\""), "{err}");
    let (code, _, err) = chime(&path, &["enqueue", "greet", "--payload", "{bad"], None);
    assert_eq!(code, 2);
    assert!(err.contains("not valid JSON"), "{err}");
    let (code, _, err) =
        chime(&path, &["enqueue", "greet", "--batch", "-"], Some("{\"payload\":1}\n{oops\n"));
    assert_eq!(code, 2);
    assert!(err.contains("line 2"), "{err}");

    let (code, out, err) =
        chime(&path, &["enqueue", "greet", "--payload", "{\"a\":1}", "--key", "k", "--json"], None);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["confirmed"], true);
    assert_eq!(v["key"], chime_shared::envelope::adhoc_key("greet", "k").to_string());
    assert_eq!(depth(&queue).await, 1, "only the valid job was published");

    let (code, out, err) = chime(&path, &["enqueue", "greet", "--payload-file", "-"], Some("[1,2,3]"));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("confirmed"), "{out}");

    let lines: String =
        (0..1000).map(|i| format!("{{\"payload\":{{\"i\":{i}}},\"key\":\"b{i}\"}}\n")).collect();
    let (code, out, err) = chime(&path, &["enqueue", "greet", "--batch", "-"], Some(&lines));
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("confirmed 1000 of 1000 jobs"), "{out}");
    assert!(!err.contains("warning"), "{err}");
    // Lines of a request's fields without "payload" are payloads, as documented, with a warning.
    let lines = "{\"payload\":1}\n{\"key\":\"k1\"}\n{\"user\":1}\n{\"key\":\"k2\",\"queue\":\"default\"}\n";
    let (code, out, err) = chime(&path, &["enqueue", "greet", "--batch", "-"], Some(lines));
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("confirmed 4 of 4 jobs"), "{out}");
    assert!(
        err.contains("warning: 2 lines of - (the first: line 2) are an object of request fields (key, queue, max_attempts, priority) without \"payload\""),
        "{err}"
    );
    let q = queue.clone();
    wait_until("1006 messages queued", std::time::Duration::from_secs(10), || {
        let q = q.clone();
        async move { depth(&q).await == 1006 }
    })
    .await;

    // A queue that neither the config nor the broker knows: refused before publishing.
    let (code, _, err) = chime(&path, &["enqueue", "greet", "--queue", "unbound"], None);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("\"unbound\" is neither declared by this config nor present on the broker"),
        "{err}"
    );
}

/// The test's config (quorum queues, `jobs`) written, and its topology declared so that
/// "nothing published" is a depth of 0 from the first attempt: the config's path and the
/// default work queue.
async fn declared(env: &TestEnv, jobs: &str) -> (std::path::PathBuf, String) {
    let text = env.config_text("quorum", "", "", jobs);
    let path = env.write_config(&text);
    drop(chime_producer::EnqueueClient::connect(env.config("quorum", "", "", jobs)).await.unwrap());
    (path, env.names().work_queue("default"))
}

/// Each line of a batch goes where its own fields and the command's delay say, through the
/// jobs the command keeps encoded: a `priority` line to its level's queue, a `queue` line to
/// that queue, and with `--delay` every line round the delay chain first.
#[tokio::test]
async fn a_batch_routes_each_line_by_its_priority_queue_and_delay() {
    let mut env = TestEnv::new("batchroute");
    env.queues.push("mail".into());
    let jobs = "[[jobs]]\nname = \"greet\"\nhandler = \"noop\"\npriority = \"normal\"\n\
                [[jobs]]\nname = \"mailer\"\nhandler = \"noop\"\nqueue = \"mail\"\n";
    let (path, normal) = declared(&env, jobs).await;
    let (high, mail) = (env.names().work_queue("default^high"), env.names().work_queue("mail"));
    let lines = "{\"payload\":{\"i\":0}}\n{\"payload\":{\"i\":1},\"priority\":\"high\"}\n\
                 {\"payload\":{\"i\":2},\"queue\":\"mail\"}\n";
    let (code, out, err) = chime(&path, &["enqueue", "greet", "--batch", "-"], Some(lines));
    assert_eq!(code, 0, "{out}{err}");
    let at = |q: &str| {
        let q = q.to_string();
        async move { take_envelopes(&q, 1, std::time::Duration::from_secs(10)).await[0].payload["i"].as_u64() }
    };
    assert_eq!((at(&normal).await, at(&high).await, at(&mail).await), (Some(0), Some(1), Some(2)));
    // Delayed: not in the queue when the command returns, there after the delay.
    let (code, out, err) = chime(
        &path,
        &["enqueue", "greet", "--batch", "-", "--delay", "3s"],
        Some("{\"payload\":{\"i\":3}}\n"),
    );
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(depth(&normal).await, 0, "a delayed line waits in the delay chain");
    assert_eq!(at(&normal).await, Some(3));
}

/// `enqueue --batch -` reads standard input once to validate every line (spooling it to a
/// temporary file), keeping what fits in memory (about 13,000 of these 1 KB lines), and
/// publishes those, then the rest from the spool in chunks: a bad last line of 25,000
/// publishes nothing; the good batch arrives whole, each key once, across the kept jobs' end
/// and the chunk boundaries; the spool is removed both times (the command's `TMPDIR` is the
/// test's own: other tests spool too).
#[tokio::test]
async fn a_large_batch_on_stdin_is_validated_whole_then_published_in_chunks() {
    let env = TestEnv::new("bigbatch");
    let (path, queue) = declared(&env, COUNT_JOB).await;
    let tmp = env.dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let envs = [("TMPDIR", tmp.as_os_str())];
    let spools = || std::fs::read_dir(&tmp).unwrap().count();
    let pad = "x".repeat(1000);
    let good: String = (0..25_000)
        .map(|i| format!("{{\"payload\":{{\"n\":{i},\"pad\":\"{pad}\"}},\"key\":\"k{i}\"}}\n"))
        .collect();
    let bad = format!("{good}{{\"payload\":1,\"max_attempts\":0}}\n");
    let (code, out, err) = chime_env(&path, &["enqueue", "count", "--batch", "-"], Some(&bad), &envs);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("line 25001"), "{err}");
    assert_eq!(depth(&queue).await, 0, "nothing published");
    assert_eq!(spools(), 0, "the spool of a rejected batch is removed");
    let (code, out, err) =
        chime_env(&path, &["enqueue", "count", "--batch", "-", "--json"], Some(&good), &envs);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((v["confirmed"].as_u64(), v["total"].as_u64()), (Some(25_000), Some(25_000)), "{out}");
    wait_depth(&queue, 25_000, std::time::Duration::from_secs(30)).await;
    assert_eq!(spools(), 0, "the spool of standard input is removed");
}

/// A batch file of 256 KiB or more is validated in two halves at once (the second on a thread
/// of its own): a bad line in either half is reported by its line in the file, the first one
/// when both halves have one, and publishes nothing; a queue nobody declares, named only in
/// the second half, is refused by that line; keys that already ran are counted in both halves,
/// and so are lines repeating an earlier line's key (within a half and across them); a good
/// file arrives whole, each line once.
#[tokio::test]
async fn a_large_batch_file_is_validated_in_two_halves() {
    let env = TestEnv::new("halfbatch");
    let (path, queue) = declared(&env, JOBS).await;
    let n = 20_000;
    let lines: Vec<String> =
        (0..n).map(|i| format!("{{\"payload\":{{\"i\":{i}}},\"key\":\"h{i}\"}}")).collect();
    assert!(lines.iter().map(|l| l.len() + 1).sum::<usize>() > 256 << 10, "large enough to be split");
    let file = env.dir.join("batch.jsonl");
    let file_arg = file.to_str().unwrap();
    let run = |edits: &[(usize, &str)]| {
        let mut l = lines.clone();
        for (line, text) in edits {
            l[line - 1] = text.to_string();
        }
        std::fs::write(&file, l.join("\n") + "\n").unwrap();
        chime(&path, &["enqueue", "greet", "--batch", file_arg], None)
    };
    let bad = "{oops";
    let none_here = "{\"payload\":1,\"queue\":\"nowhere\"}";
    for (edits, line) in [
        (vec![(17_000, bad)], "line 17000: invalid JSON"),
        (vec![(n, bad)], "line 20000: invalid JSON"),
        (vec![(2, "{\"payload\":1,\"max_attempts\":0}"), (17_000, bad)], "line 2: invalid max_attempts"),
        (vec![(16_000, none_here), (19_000, none_here)], "line 16000: queue: "),
    ] {
        let (code, out, err) = run(&edits);
        assert_eq!(code, 2, "{edits:?}: {out}{err}");
        assert!(err.contains(line), "{edits:?}: {err}");
        assert_eq!(depth(&queue).await, 0, "{edits:?}: nothing published");
    }
    // Three keys already done: one in the first half, two in the second.
    let mut r = connect_redis(&env.redis_url).await;
    for i in [5, 15_000, 19_000] {
        let key = chime_shared::envelope::adhoc_key("greet", &format!("h{i}")).to_string();
        let _: () = redis::cmd("HSET")
            .arg(env.names().idem_key(&key))
            .arg("s")
            .arg("done")
            .query_async(&mut r)
            .await
            .unwrap();
    }
    // Lines 7 and 12 repeat line 3's key (the first half), line 19,500 line 100's (across the
    // halves), line 19,600 line 15,000's (the second half).
    let again = |i: usize| format!("{{\"payload\":{{\"again\":{i}}},\"key\":\"h{i}\"}}");
    let (a, b, c) = (again(2), again(99), again(14_999));
    let edits = [(10_001, ""), (10_002, ""), (7, a.as_str()), (12, &a), (19_500, &b), (19_600, &c)];
    let (code, out, err) = run(&edits);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("confirmed 19998 of 19998 jobs"), "{out}");
    assert!(err.contains("warning: 3 of these keys already ran to an end"), "{err}");
    assert!(
        err.contains(&format!("warning: 4 lines of {file_arg} repeat the key of an earlier line (the first: line 7, the key of line 3)")),
        "{err}"
    );
    // One repeat in a small file (validated in one piece).
    let small = env.dir.join("small.jsonl");
    std::fs::write(
        &small,
        "{\"payload\":1,\"key\":\"a\"}\n{\"payload\":1,\"key\":\"b\"}\n{\"payload\":2,\"key\":\"a\"}\n",
    )
    .unwrap();
    let small_arg = small.to_str().unwrap();
    let (code, _, err) = chime(&path, &["enqueue", "greet", "--batch", small_arg], None);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!("warning: {small_arg} line 3 repeats the key of line 1: each key runs once")),
        "{err}"
    );
    wait_depth(&queue, 19_998 + 3, std::time::Duration::from_secs(30)).await;
}

/// A batch line with a byte that is not UTF-8 (inside a JSON string, where a lossy reading
/// would replace it unseen) is refused by its line and column, in either half of a split file,
/// and nothing is published; a byte order mark opening a batch file, standard input or a
/// payload file (as some Windows tools write) is ignored.
#[tokio::test]
async fn a_batch_line_that_is_not_utf8_is_refused_and_a_byte_order_mark_is_ignored() {
    let env = TestEnv::new("utf8batch");
    let (path, queue) = declared(&env, JOBS).await;
    let file = env.dir.join("batch.jsonl");
    let file_arg = file.to_str().unwrap();
    let good = |i: usize| format!("{{\"payload\":{{\"i\":{i}}}}}\n").into_bytes();
    let latin1 = b"{\"payload\":{\"s\":\"caf\xe9\"}}\n".to_vec();
    for (lines, at) in [(3, 2), (20_000, 2), (20_000, 19_000)] {
        let bytes: Vec<u8> =
            (1..=lines).flat_map(|i| if i == at { latin1.clone() } else { good(i) }).collect();
        std::fs::write(&file, bytes).unwrap();
        let (code, out, err) = chime(&path, &["enqueue", "greet", "--batch", file_arg], None);
        assert_eq!(code, 2, "{out}{err}");
        assert!(err.contains(&format!("line {at}: not UTF-8 (the byte at column 21)")), "{err}");
        assert_eq!(depth(&queue).await, 0, "nothing published");
    }
    let bom = "\u{feff}";
    std::fs::write(&file, format!("{bom}{{\"payload\":{{\"i\":1}}}}\n{{\"payload\":{{\"i\":2}}}}\n"))
        .unwrap();
    let (code, out, err) = chime(&path, &["enqueue", "greet", "--batch", file_arg], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("confirmed 2 of 2 jobs"), "{out}");
    let stdin = format!("{bom}{{\"payload\":{{\"i\":3}}}}\n");
    let (code, _, err) = chime(&path, &["enqueue", "greet", "--batch", "-"], Some(&stdin));
    assert_eq!(code, 0, "{err}");
    let payload = env.dir.join("payload.json");
    std::fs::write(&payload, format!("{bom}{{\"i\":4}}")).unwrap();
    let (code, _, err) =
        chime(&path, &["enqueue", "greet", "--payload-file", payload.to_str().unwrap()], None);
    assert_eq!(code, 0, "{err}");
    let got: Vec<u64> = take_envelopes(&queue, 4, std::time::Duration::from_secs(30))
        .await
        .iter()
        .map(|e| e.payload["i"].as_u64().unwrap())
        .collect();
    assert_eq!(got, [1, 2, 3, 4]);
    // A payload file that is not one JSON value is named as the file, not as --payload.
    std::fs::write(&payload, "{\"i\":5} {\"i\":6}").unwrap();
    let file = payload.to_str().unwrap();
    let (code, _, err) = chime(&path, &["enqueue", "greet", "--payload-file", file], None);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("--payload-file {file} is not valid JSON: trailing characters")), "{err}");
    assert_eq!(depth(&queue).await, 0, "nothing published");
}

/// Both halves of a large batch file keep the jobs they prepared (each within its memory
/// budget) and the publishing pass reads again only what was not kept: whether both keep
/// everything, the second runs out of room, or the first does (the second's jobs are then
/// read again from the file), every line arrives once, in the file's order; so it does from a
/// pipe, which is copied aside to be read again.
#[tokio::test]
async fn a_large_batch_file_arrives_whole_and_in_order_whatever_each_half_keeps() {
    let env = TestEnv::new("keptbatch");
    let (path, queue) = declared(&env, JOBS).await;
    let file = env.dir.join("batch.jsonl");
    let line =
        |i: usize, pad: usize| format!("{{\"payload\":{{\"i\":{i},\"pad\":\"{}\"}}}}", "x".repeat(pad));
    // A job's share of the 32 MiB budget is ~1 KiB plus 4 bytes a byte of its line: jobs with
    // 3,000-byte pads fill it at ~2,600; lines of spaces cost nothing but split the file.
    let spaces = " ".repeat(10_000);
    let cases: [(&str, Vec<String>); 3] = [
        ("both keep all", (0..20_000).map(|i| line(i, 0)).collect()),
        ("the second runs out", {
            let mut l: Vec<String> = (0..500).map(|i| line(i, 0)).collect();
            l.extend(std::iter::repeat_n(spaces.clone(), 920));
            l.extend((500..3_500).map(|i| line(i, 3_000)));
            l
        }),
        ("the first runs out", (0..6_000).map(|i| line(i, 3_000)).collect()),
    ];
    for (case, lines) in cases {
        let jobs = lines.iter().filter(|l| !l.trim().is_empty()).count();
        std::fs::write(&file, lines.join("\n") + "\n").unwrap();
        let (code, out, err) = chime(&path, &["enqueue", "greet", "--batch", file.to_str().unwrap()], None);
        assert_eq!(code, 0, "{case}: {err}");
        assert!(out.starts_with(&format!("confirmed {jobs} of {jobs} jobs")), "{case}: {out}");
        arrived_in_order(&queue, jobs, case).await;
    }
    // A pipe (`--batch <(…)`, here a named one) is read once: copied aside as it is validated,
    // so that the jobs not kept are read again from the copy, not from the pipe (whose end
    // would publish nothing more, and say so with exit 0).
    let fifo = env.dir.join("batch.fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let jobs = 6_000;
    let text: String = (0..jobs).map(|i| line(i, 3_000) + "\n").collect();
    let writer = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::write(fifo, text))
    };
    let tmp = env.dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let (code, out, err) = chime_env(
        &path,
        &["enqueue", "greet", "--batch", fifo.to_str().unwrap()],
        None,
        &[("TMPDIR", tmp.as_os_str())],
    );
    writer.join().unwrap().unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with(&format!("confirmed {jobs} of {jobs} jobs")), "a pipe: {out}");
    arrived_in_order(&queue, jobs, "a pipe").await;
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0, "the pipe's copy is removed");
}

/// Takes `jobs` messages from `queue`: payloads `{"i": 0}` … in order, each once, and nothing
/// more.
async fn arrived_in_order(queue: &str, jobs: usize, case: &str) {
    let got: Vec<u64> = take_envelopes(queue, jobs, std::time::Duration::from_secs(60))
        .await
        .iter()
        .map(|e| e.payload["i"].as_u64().unwrap())
        .collect();
    assert_eq!(got, (0..jobs as u64).collect::<Vec<_>>(), "{case}: every line once, in order");
    assert_eq!(depth(queue).await, 0, "{case}: nothing more");
}

/// Ctrl-C while a batch is published: it sends nothing more, waits for the confirms of what it
/// sent, and says how many were confirmed, through which line, and where the rest starts;
/// exactly those are in the queue, and the exit status is 130 (128 + SIGINT).
#[tokio::test]
async fn an_interrupted_batch_says_how_far_it_got_and_published_exactly_that() {
    let env = TestEnv::new("clisigint");
    let (path, queue) = declared(&env, JOBS).await;
    let file = env.dir.join("batch.jsonl");
    let jobs = 300_000;
    // A blank first line: the lines and the jobs are numbered apart.
    let text: String = std::iter::once("\n".to_string())
        .chain((0..jobs).map(|i| format!("{{\"payload\":{{\"i\":{i}}}}}\n")))
        .collect();
    std::fs::write(&file, text).unwrap();
    let child = std::process::Command::new(chime_tests::bin("chime"))
        .args(["--config", path.to_str().unwrap(), "enqueue", "greet", "--batch", file.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let q = queue.clone();
    wait_until("the batch is being published", std::time::Duration::from_secs(60), || {
        let q = q.clone();
        async move { depth(&q).await > 0 }
    })
    .await;
    chime_tests::signal_pid(child.id(), 2);
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap()).await.unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(130), "{stdout}{stderr}");
    let confirmed: usize = stderr
        .split("interrupted: ")
        .nth(2)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in: {stderr}"));
    assert!((1..jobs).contains(&confirmed), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{confirmed} of {jobs} confirmed (through line {}); the rest: tail -n +{}",
            confirmed + 1,
            confirmed + 2
        )),
        "{stderr}"
    );
    assert!(stdout.starts_with(&format!("confirmed {confirmed} of {jobs} jobs")), "{stdout}");
    // Nothing more arrives: the process has ended, and the queue holds exactly those.
    let q = queue.clone();
    wait_until("the confirmed jobs are queued", std::time::Duration::from_secs(30), || {
        let q = q.clone();
        async move { depth(&q).await >= confirmed as u32 }
    })
    .await;
    assert_eq!(depth(&queue).await, confirmed as u32, "{stderr}");
}

/// `chime … | head`: the reader going away ends the command quietly (SIGPIPE), never with a
/// panic and a backtrace.
#[tokio::test]
async fn a_closed_pipe_ends_a_command_quietly() {
    use std::io::BufRead;
    let env = TestEnv::new("clipipe");
    let jobs = "[[jobs]]\nname = \"tick\"\nhandler = \"noop\"\nschedule = \"* * * * * *\"\n";
    let path = env.write_config(&env.config_text("quorum", "", "", jobs));
    let mut child = std::process::Command::new(bin("chime"))
        .arg("--config")
        .arg(&path)
        .args(["jobs", "next", "tick", "--count", "10000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.contains("T"), "{first}");
    // The reader is gone (dropped above).
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(13), "ended by SIGPIPE: {:?} {err}", out.status);
}

/// A command that needs Redis and cannot reach it names the server it tried, whichever
/// command it is (history, workers, circuits, inspect, dlq: each used to say `redis: …` alone).
#[tokio::test]
async fn a_redis_that_does_not_answer_is_named_by_every_command() {
    let env = TestEnv::new("redisdown");
    let closed = "redis://127.0.0.1:1/0";
    let path = env.write_config(&env.config_text("quorum", "", "", JOBS).replace(&env.redis_url, closed));
    for args in [
        &["history"][..],
        &["workers"],
        &["circuits"],
        &["inspect", "--job", "greet", "--key", "a"],
        &["dlq", "list"],
    ] {
        let (code, out, err) = chime(&path, args, None);
        assert_ne!(code, 0, "{args:?}: {out}");
        assert!(err.contains(&format!("Redis at {closed}: ")), "{args:?}: {err}");
    }
}
