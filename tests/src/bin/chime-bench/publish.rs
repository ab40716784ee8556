//! Publishing: raw lapin publishers against `EnqueueClient` and `chime enqueue --batch`.

use crate::Ctx;
use crate::fixtures::*;
use crate::measure::*;
use chime_producer::{EnqueueClient, Prepared};
use chime_tests::*;
use lapin::options::ConfirmSelectOptions;
use lapin::{BasicProperties, Connection};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How a raw publisher sends: up to `window` confirms outstanding, and `group` publishes handed
/// to lapin before their writes are awaited (1: each publish waits until its frames reached the
/// socket, so every message costs the I/O thread a wake-up and a write of its own).
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub window: usize,
    pub group: usize,
}

/// How much a raw publisher sends: for a time (into an ever longer queue), or a count.
#[derive(Clone, Copy, Debug)]
pub enum Amount {
    Secs(u64),
    Count(usize),
}

/// Where and what a raw publisher sends.
pub struct Target<'a> {
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub mandatory: bool,
    pub props: BasicProperties,
    pub body: &'a [u8],
}

/// The bare properties: persistent JSON.
/// The fastest shape measured here (`--only baseline`): 4,096 confirms outstanding, 256
/// publishes handed to lapin at once.
pub const FASTEST: Shape = Shape { window: 4096, group: 256 };
/// chime-bench's earlier baseline: every publish awaited before the next.
pub const ONE_BY_ONE: Shape = Shape { window: 4096, group: 1 };

pub fn bare_props() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into())
}

/// Raw lapin: confirmed persistent publishes shaped by `shape`; returns confirmed msg/s and
/// this process's CPU and system calls per message.
pub async fn raw_publish(conn: &Connection, t: &Target<'_>, shape: Shape, amount: Amount) -> (f64, Cost) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let opts = lapin::options::BasicPublishOptions { mandatory: t.mandatory, ..Default::default() };
    let mut pending = VecDeque::new();
    let (mut sent, mut confirmed) = (0usize, 0u64);
    let cost = ProcCost::start(std::process::id());
    let start = Instant::now();
    let more = |sent: usize| match amount {
        Amount::Secs(s) => start.elapsed() < Duration::from_secs(s),
        Amount::Count(n) => sent < n,
    };
    while more(sent) {
        let n = match amount {
            Amount::Count(total) => shape.group.min(total - sent),
            Amount::Secs(_) => shape.group,
        };
        let publishes = (0..n).map(|_| {
            ch.basic_publish(t.exchange.into(), t.routing_key.into(), opts, t.body, t.props.clone())
        });
        for p in futures_util::future::join_all(publishes).await {
            pending.push_back(p.unwrap());
        }
        sent += n;
        confirmed += confirm_down_to(&mut pending, shape.window).await;
    }
    confirmed += confirm_down_to(&mut pending, 0).await;
    let rate = confirmed as f64 / start.elapsed().as_secs_f64();
    let _ = ch.close(200, "".into()).await;
    (rate, cost.per_message(confirmed))
}

/// Awaits the oldest confirms of `pending` until at most `keep` are left, each an ack;
/// returns how many it awaited.
async fn confirm_down_to(pending: &mut VecDeque<lapin::PublisherConfirm>, keep: usize) -> u64 {
    let mut n = 0;
    while pending.len() > keep
        && let Some(p) = pending.pop_front()
    {
        assert!(matches!(p.await.unwrap(), lapin::Confirmation::Ack(None)), "raw publish not acked");
        n += 1;
    }
    n
}

/// What the plain program's messages carry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Plain {
    /// Persistent JSON, nothing else.
    Bare,
    /// The wire contract's message as chime sends it: mandatory, a fresh `message_id` (a
    /// UUID, as the key of an unkeyed job), `type` (the job) and `timestamp` besides.
    Contract,
}

/// A plain lapin publisher, as a user would write one in place of `chime enqueue --batch`:
/// connect, read `file` a line at a time and publish each line as a persistent message in the
/// fastest shape ([`FASTEST`]), every confirm awaited; returns how many were confirmed.
pub async fn raw_publish_file(
    exchange: &str,
    routing_key: &str,
    file: &std::path::Path,
    plain: Plain,
) -> u64 {
    use std::io::BufRead;
    let conn = connect_amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let reader = std::io::BufReader::with_capacity(1 << 16, std::fs::File::open(file).unwrap());
    let mut lines = reader.lines();
    let mut pending = VecDeque::new();
    let mut confirmed = 0;
    let props = bare_props();
    loop {
        let group: Vec<String> = lines.by_ref().take(FASTEST.group).map(Result::unwrap).collect();
        if group.is_empty() {
            break;
        }
        let publishes = group.iter().map(|line| {
            let (opts, props) = match plain {
                Plain::Bare => (lapin::options::BasicPublishOptions::default(), props.clone()),
                Plain::Contract => (
                    lapin::options::BasicPublishOptions { mandatory: true, ..Default::default() },
                    props
                        .clone()
                        .with_message_id(uuid::Uuid::new_v4().to_string().into())
                        .with_type("noop".into())
                        .with_timestamp(chrono::Utc::now().timestamp() as u64),
                ),
            };
            ch.basic_publish(exchange.into(), routing_key.into(), opts, line.as_bytes(), props)
        });
        for p in futures_util::future::join_all(publishes).await {
            pending.push_back(p.unwrap());
        }
        confirmed += confirm_down_to(&mut pending, FASTEST.window).await;
    }
    confirmed += confirm_down_to(&mut pending, 0).await;
    let _ = conn.close(200, "".into()).await;
    confirmed
}

/// [`raw_publish_file`] started as a process of its own (this binary) and timed as one, as
/// [`cli_batch`] times the command: messages a second from start to exit.
pub async fn raw_file_process(
    exchange: &str,
    routing_key: &str,
    file: &std::path::Path,
    plain: Plain,
) -> (f64, Cost) {
    let time_out = file.with_extension("time");
    let exe = std::env::current_exe().unwrap();
    let mut args: Vec<std::ffi::OsString> =
        vec!["raw-publish-file".into(), exchange.into(), routing_key.into(), file.into()];
    if plain == Plain::Contract {
        args.push("contract".into());
    }
    let (wall, stdout, syscalls) = timed_process(&exe, &args, &time_out).await;
    let n: f64 = String::from_utf8_lossy(&stdout).trim().parse().unwrap();
    (n / wall, process_cost(&time_out, n, syscalls))
}

/// Runs `program` with `args` under `/usr/bin/time` (its CPU written to `time_out`), counting
/// its system calls with a perf attached once it runs (a perf that started it would count its
/// own start-up, ~0.09 s here, as the program's time); returns the wall time from spawn to
/// exit, the standard output and the system calls. Panics when it fails.
async fn timed_process(
    program: &std::path::Path,
    args: &[std::ffi::OsString],
    time_out: &std::path::Path,
) -> (f64, Vec<u8>, Option<u64>) {
    let mut cmd = tokio::process::Command::new("/usr/bin/time");
    cmd.args(["-f", "%U %S", "-o"]).arg(time_out).arg(program).args(args);
    cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let started = Instant::now();
    let child = cmd.spawn().unwrap();
    let calls = child.id().and_then(child_of).map(Syscalls::spawn);
    let out = child.wait_with_output().await.unwrap();
    let wall = started.elapsed().as_secs_f64();
    let syscalls = calls.and_then(Syscalls::stop);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (wall, out.stdout, syscalls)
}

/// CPU and system calls per message of a process timed by `/usr/bin/time -f "%U %S" -o time_out`.
fn process_cost(time_out: &std::path::Path, n: f64, syscalls: Option<u64>) -> Cost {
    let times = std::fs::read_to_string(time_out).unwrap_or_default();
    let t: Vec<f64> =
        times.lines().last().unwrap_or("").split_whitespace().filter_map(|x| x.parse().ok()).collect();
    Cost {
        user_us: t.first().copied().unwrap_or(f64::NAN) * 1e6 / n,
        sys_us: t.get(1).copied().unwrap_or(f64::NAN) * 1e6 / n,
        syscalls: syscalls.map_or(f64::NAN, |c| c as f64 / n),
    }
}

/// chime: one `EnqueueClient::publish_batch` of `batch` prepared jobs; returns confirmed jobs/s
/// and this process's cost per job.
pub async fn chime_publish(client: &EnqueueClient, batch: &[Prepared]) -> (f64, Cost) {
    let cost = ProcCost::start(std::process::id());
    let start = Instant::now();
    let n = client.publish_batch(batch).await.confirmed;
    assert_eq!(n, batch.len(), "EnqueueClient confirmed {n} of {}", batch.len());
    (n as f64 / start.elapsed().as_secs_f64(), cost.per_message(n as u64))
}

/// `chime enqueue --batch FILE` of the JSON lines in `file` through the release CLI `bin`;
/// returns jobs/s as the CLI reports it (publish time, excluding process start and the
/// validating pass) and the whole process's CPU and system calls per job.
/// `chime enqueue noop --batch FILE` (with `--pack N`), timed as a whole process, as a user
/// times it (start, validation pass, connection, publishing, exit).
pub async fn cli_batch(
    env: &TestEnv,
    bin: &std::path::Path,
    config: &std::path::Path,
    file: &std::path::Path,
    pack: Option<usize>,
) -> (f64, Cost) {
    let time_out = env.dir.join("cli.time");
    let mut args: Vec<std::ffi::OsString> = vec!["--config".into(), config.into()];
    args.extend(["enqueue", "noop", "--batch"].map(Into::into));
    args.extend([file.as_os_str().to_owned(), "--json".into()]);
    if let Some(n) = pack {
        args.extend(["--pack".into(), n.to_string().into()]);
    }
    let (wall, stdout, syscalls) = timed_process(bin, &args, &time_out).await;
    let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    let n = v["confirmed"].as_f64().unwrap();
    (n / wall, process_cost(&time_out, n, syscalls))
}

/// The process `/usr/bin/time` (pid `parent`) started, once it has started it (up to 1 s).
fn child_of(parent: u32) -> Option<u32> {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
        if let Some(pid) = children.split_whitespace().next().and_then(|p| p.parse().ok()) {
            return Some(pid);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Each variant of the publish scenario: rates, per-round ratios to the baseline, costs.
#[derive(Default, Clone)]
struct Runs {
    rates: Vec<f64>,
    ratios: Vec<f64>,
    costs: Vec<Cost>,
    broker: Vec<f64>,
}

/// `publish`: `10,000 × --seconds` jobs into an empty queue per run, published by raw lapin
/// (through the direct work exchange, as the baseline; through the default exchange; one write
/// per message; chime's exact message), by `EnqueueClient::publish_batch` and by `chime
/// enqueue --batch`; rounds rotate the order, ratios are medians of per-round ratios to the
/// baseline.
pub async fn scenario(c: &Ctx) {
    let o = &c.o;
    let conn = &c.conn;
    let qt = c.o.queue_type.clone();
    let n = 10_000 * c.o.seconds as usize;
    let env = TestEnv::new("bench-pub");
    let config = bench_config(&env, &qt, "");
    let client = EnqueueClient::connect(config.clone()).await.unwrap();
    let q = env.names().work_queue("default");
    let batch = envelopes(n, false);
    let body = batch[0].envelope.encode();
    let work = env.names().work_exchange();
    let text = env.config_text(&qt, "", "", "[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n");
    let path = env.write_config(&text);
    // Lines whose envelopes are the size of the others' bodies, and the plain program's file.
    let (file, raw_file) = batch_files(&env, n, &body);
    let before = std::env::var_os("BENCH_CHIME_BEFORE").map(std::path::PathBuf::from);
    let bare = Target { exchange: "", routing_key: &q, mandatory: false, props: bare_props(), body: &body };
    let same = Target {
        exchange: &work,
        routing_key: "default",
        mandatory: true,
        props: batch[0].envelope.properties(),
        body: &body,
    };
    // The baseline (first line): the plain publisher, a direct exchange bound to the
    // quorum queue, in the fastest shape lapin allows.
    let direct = Target {
        exchange: &work,
        routing_key: "default",
        mandatory: false,
        props: bare_props(),
        body: &body,
    };
    let mut variants: Vec<&str> = vec![
        "raw lapin, direct exchange, 4096 confirms, 256 per write",
        "raw lapin, default exchange (no routing), same shape",
        "raw lapin, direct exchange, one write per message",
        "raw, chime's message (mandatory, properties), same shape",
        "EnqueueClient::publish_batch",
        "chime enqueue --batch (CLI, whole process)",
        "chime enqueue --batch --pack 100 (CLI, whole process)",
        "raw lapin as a program of its own (whole process)",
    ];
    if before.is_some() {
        variants.push("chime enqueue --batch, BENCH_CHIME_BEFORE");
    }
    let mut runs = vec![Runs::default(); variants.len()];
    for r in 0..o.runs {
        let mut round = vec![0.0; variants.len()];
        for k in 0..variants.len() {
            let i = (k + r) % variants.len();
            progress(&format!("publish: {}, run {}/{} ({n} jobs)", variants[i], r + 1, o.runs));
            let broker = CpuWindow::start(Vec::new());
            let (rate, cost) = match i {
                0 => raw_publish(conn, &direct, FASTEST, Amount::Count(n)).await,
                1 => raw_publish(conn, &bare, FASTEST, Amount::Count(n)).await,
                2 => raw_publish(conn, &direct, ONE_BY_ONE, Amount::Count(n)).await,
                3 => raw_publish(conn, &same, FASTEST, Amount::Count(n)).await,
                4 => chime_publish(&client, &batch).await,
                5 => cli_batch(&env, &bin_path("chime"), &path, &file, None).await,
                6 => cli_batch(&env, &bin_path("chime"), &path, &file, Some(100)).await,
                7 => raw_file_process(&work, "default", &raw_file, Plain::Bare).await,
                _ => cli_batch(&env, before.as_ref().unwrap(), &path, &file, None).await,
            };
            runs[i].broker.push(broker.per_message(n as u64)[0]);
            round[i] = rate;
            runs[i].rates.push(rate);
            runs[i].costs.push(cost);
            purge(conn, &q).await;
        }
        for (i, rate) in round.iter().enumerate() {
            runs[i].ratios.push(rate / round[0]);
        }
    }
    progress("");
    for (name, r) in variants.iter().zip(&runs) {
        println!(
            "publish  {name:<56} {:>7.0} msg/s  {:.2}x   {}; broker {:.0} µs/msg",
            median(r.rates.clone()),
            median(r.ratios.clone()),
            Cost::median(&r.costs).text(),
            median(r.broker.clone())
        );
    }
    // The command against the plain program, each timed as a whole process, round by round.
    let like: Vec<f64> = runs[5].rates.iter().zip(&runs[7].rates).map(|(cli, raw)| cli / raw).collect();
    println!(
        "publish  chime enqueue --batch against the plain lapin program, both whole processes: {:.2}x",
        median(like)
    );
}

/// Opt-in `publish-cli`: `chime enqueue --batch` (and `BENCH_CHIME_BEFORE`'s build beside it)
/// against the plain lapin program, each a whole process publishing `10,000 × --seconds` jobs,
/// `--runs` rounds in rotated order: the median of the rounds' ratios with its quartiles, how
/// many rounds reached 0.9, and the two builds paired round by round. Only these processes
/// run, so that many rounds fit in a few minutes (single processes vary by ±10 % here). The
/// plain program runs twice a round: with bare messages (the ratios' baseline) and with the
/// wire contract's message ([`Plain::Contract`]), the command's ratio to which is printed too.
pub async fn cli_rounds(c: &Ctx) {
    let conn = &c.conn;
    let qt = c.o.queue_type.clone();
    let n = 10_000 * c.o.seconds as usize;
    let env = TestEnv::new("bench-pubcli");
    let _declared = EnqueueClient::connect(bench_config(&env, &qt, "")).await.unwrap();
    let q = env.names().work_queue("default");
    let work = env.names().work_exchange();
    let body = envelopes(1, false)[0].envelope.encode();
    let text = env.config_text(&qt, "", "", "[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n");
    let path = env.write_config(&text);
    let (file, raw_file) = batch_files(&env, n, &body);
    let before = std::env::var_os("BENCH_CHIME_BEFORE").map(std::path::PathBuf::from);
    let variants = if before.is_some() { 4 } else { 3 };
    // Wall times: the command, the plain program, the plain program sending the contract's
    // message, the build before.
    let mut walls: Vec<Vec<f64>> = vec![Vec::new(); variants];
    for r in 0..c.o.runs {
        for k in 0..variants {
            let i = (k + r) % variants;
            progress(&format!("publish-cli: round {}/{}", r + 1, c.o.runs));
            let rate = match i {
                0 => cli_batch(&env, &bin_path("chime"), &path, &file, None).await.0,
                1 => raw_file_process(&work, "default", &raw_file, Plain::Bare).await.0,
                2 => raw_file_process(&work, "default", &raw_file, Plain::Contract).await.0,
                _ => cli_batch(&env, before.as_ref().unwrap(), &path, &file, None).await.0,
            };
            walls[i].push(n as f64 / rate);
            purge(conn, &q).await;
        }
    }
    progress("");
    let summary = |name: &str, w: &[f64], base: usize| {
        let mut ratios: Vec<f64> = w.iter().zip(&walls[base]).map(|(own, plain)| plain / own).collect();
        let reached = ratios.iter().filter(|r| **r >= 0.9).count();
        ratios.sort_by(f64::total_cmp);
        let q = |f: f64| ratios[((ratios.len() - 1) as f64 * f).round() as usize];
        println!(
            "publish-cli  {name:<22} median wall {:.3} s  against the plain program{} {:.3}x (quartiles {:.3}-{:.3}), rounds at 0.9x or more: {reached} of {}",
            median(w.to_vec()),
            if base == 2 { " (contract's message)" } else { "" },
            q(0.5),
            q(0.25),
            q(0.75),
            ratios.len()
        );
    };
    println!(
        "publish-cli  plain lapin program      median wall {:.3} s ({n} jobs a round)",
        median(walls[1].clone())
    );
    println!(
        "publish-cli  plain program, contract  median wall {:.3} s (mandatory, message_id, type, timestamp)",
        median(walls[2].clone())
    );
    summary("chime enqueue --batch", &walls[0], 1);
    summary("chime enqueue --batch", &walls[0], 2);
    if let Some(b) = walls.get(3) {
        summary("BENCH_CHIME_BEFORE", b, 1);
        let faster = walls[0].iter().zip(b).filter(|(new, old)| new < old).count();
        let diff = median(walls[0].iter().zip(b).map(|(new, old)| (new - old) * 1000.0).collect());
        println!(
            "publish-cli  paired: this build faster in {faster} of {} rounds (median {diff:+.0} ms)",
            b.len()
        );
    }
}

/// The command's batch file (`{"payload":{"i":N}}` lines, whose envelopes are `body`'s size)
/// and the plain program's (each line one copy of `body`), `n` lines each, in `env`'s directory.
fn batch_files(env: &TestEnv, n: usize, body: &[u8]) -> (std::path::PathBuf, std::path::PathBuf) {
    let file = env.dir.join("batch.jsonl");
    let lines: String = (0..n).map(|i| format!("{{\"payload\":{{\"i\":{i}}}}}\n")).collect();
    std::fs::write(&file, lines).unwrap();
    let raw_file = env.dir.join("raw.jsonl");
    let mut raw_lines = Vec::with_capacity(n * (body.len() + 1));
    for _ in 0..n {
        raw_lines.extend_from_slice(body);
        raw_lines.push(b'\n');
    }
    std::fs::write(&raw_file, raw_lines).unwrap();
    (file, raw_file)
}

/// Opt-in `batch-memory`: peak RSS of `chime enqueue --batch` for 100,000 and 1,000,000
/// lines, from a file and from standard input (spooled to a temporary file).
pub async fn batch_memory(c: &Ctx) {
    let conn = &c.conn;
    let qt = c.o.queue_type.clone();
    let env = TestEnv::new("bench-batchmem");
    let config = bench_config(&env, &qt, "");
    let _declared = EnqueueClient::connect(config).await.unwrap();
    let q = env.names().work_queue("default");
    let text = env.config_text(&qt, "", "", "[[jobs]]\nname = \"noop\"\nhandler = \"noop\"\n");
    let path = env.write_config(&text);
    for n in [100_000usize, 1_000_000] {
        let file = env.dir.join("batch.jsonl");
        let lines: String =
            (0..n).map(|i| format!("{{\"payload\":{{\"i\":{i}}},\"key\":\"k{i}\"}}\n")).collect();
        std::fs::write(&file, lines).unwrap();
        for stdin in [false, true] {
            progress(&format!("batch-memory: {n} lines, {}", if stdin { "stdin" } else { "file" }));
            let script = format!(
                "/usr/bin/time -f %M {} --config {} enqueue noop --batch {} --json {}",
                bin_path("chime").display(),
                path.display(),
                if stdin { "-" } else { file.to_str().unwrap() },
                if stdin { format!("< {}", file.display()) } else { String::new() },
            );
            let out = tokio::process::Command::new("sh").args(["-c", &script]).output().await.unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let rss: u64 = String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("0")
                .trim()
                .parse()
                .unwrap_or(0);
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            progress("");
            println!(
                "batch    chime enqueue --batch {n:>9} lines from {:<5}  peak RSS {:>7} KiB  {:.0} jobs/s",
                if stdin { "stdin" } else { "file" },
                rss,
                v["confirmed"].as_f64().unwrap() / v["seconds"].as_f64().unwrap()
            );
            purge(conn, &q).await;
        }
    }
}

/// Opt-in `properties`: which of the envelope's AMQP properties costs the broker.
pub async fn properties(c: &Ctx) {
    let o = &c.o;
    let conn = &c.conn;
    let qt = c.o.queue_type.clone();
    let n = 10_000 * c.o.seconds as usize;
    let env = TestEnv::new("bench-props");
    let config = bench_config(&env, &qt, "");
    let _declared = EnqueueClient::connect(config).await.unwrap();
    let q = env.names().work_queue("default");
    let work = env.names().work_exchange();
    let sample = envelopes(1, false).remove(0).envelope;
    let body = sample.encode();
    let key = sample.key.to_string();
    // (what, via the work exchange, mandatory, properties)
    let variants: Vec<(&str, bool, bool, BasicProperties)> = vec![
        ("default exchange, bare", false, false, bare_props()),
        ("direct exchange, bare", true, false, bare_props()),
        ("direct, mandatory", true, true, bare_props()),
        ("direct, + message_id (the key)", true, false, bare_props().with_message_id(key.clone().into())),
        ("direct, + type (the job)", true, false, bare_props().with_type(sample.job.clone().into())),
        ("direct, + timestamp", true, false, bare_props().with_timestamp(1_764_000_000)),
        ("direct, all three properties", true, false, sample.properties()),
        ("direct, mandatory, all three (chime's)", true, true, sample.properties()),
    ];
    let mut rates: Vec<Vec<f64>> = variants.iter().map(|_| Vec::new()).collect();
    let mut broker: Vec<Vec<f64>> = variants.iter().map(|_| Vec::new()).collect();
    for r in 0..o.runs {
        for k in 0..variants.len() {
            let i = (k + r) % variants.len();
            let (what, direct, mandatory, props) = &variants[i];
            progress(&format!("properties: {what}, run {}/{}", r + 1, o.runs));
            let t = Target {
                exchange: if *direct { &work } else { "" },
                routing_key: if *direct { "default" } else { &q },
                mandatory: *mandatory,
                props: props.clone(),
                body: &body,
            };
            let cpu = CpuWindow::start(Vec::new());
            rates[i].push(raw_publish(conn, &t, FASTEST, Amount::Count(n)).await.0);
            broker[i].push(cpu.per_message(n as u64)[0]);
            purge(conn, &q).await;
        }
    }
    progress("");
    let base_rate = median(rates[1].clone());
    for (i, (what, ..)) in variants.iter().enumerate() {
        let r = median(rates[i].clone());
        println!(
            "props    raw publish, {what:<40} {r:>7.0} msg/s   {:.2}x   broker {:.1} µs/msg",
            r / base_rate,
            median(broker[i].clone())
        );
    }
}

/// Opt-in `baseline`: which shape of raw publisher lapin allows to go fastest (confirm window,
/// frames handed over together, a fixed count into an empty queue or a fixed time).
pub async fn baseline(c: &Ctx) {
    let conn = &c.conn;
    let qt = c.o.queue_type.clone();
    let env = TestEnv::new("bench-base");
    let config = bench_config(&env, &qt, "");
    let _declared = EnqueueClient::connect(config).await.unwrap();
    let q = env.names().work_queue("default");
    let body = envelopes(1, false)[0].envelope.encode();
    let t = Target { exchange: "", routing_key: &q, mandatory: false, props: bare_props(), body: &body };
    let shapes: Vec<(Shape, Amount)> = std::env::var("BENCH_SHAPES")
        .unwrap_or_else(|_| "4096:1:s10,1000:1:100000,1000:64:100000,4096:256:100000,1000:1:s10".into())
        .split(',')
        .map(|s| {
            let f: Vec<&str> = s.split(':').collect();
            let amount = match f[2].strip_prefix('s') {
                Some(secs) => Amount::Secs(secs.parse().unwrap()),
                None => Amount::Count(f[2].parse().unwrap()),
            };
            (Shape { window: f[0].parse().unwrap(), group: f[1].parse().unwrap() }, amount)
        })
        .collect();
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); shapes.len()];
    let mut costs: Vec<Vec<Cost>> = vec![Vec::new(); shapes.len()];
    for r in 0..c.o.runs {
        for (i, (shape, amount)) in shapes.iter().enumerate() {
            progress(&format!("baseline: {shape:?} {amount:?}, run {}/{}", r + 1, c.o.runs));
            let (rate, cost) = raw_publish(conn, &t, *shape, *amount).await;
            rates[i].push(rate);
            costs[i].push(cost);
            purge(conn, &q).await;
        }
    }
    progress("");
    for (i, (shape, amount)) in shapes.iter().enumerate() {
        println!(
            "baseline window {:>5} group {:>4} {:<16} {:>8.0} msg/s   {}",
            shape.window,
            shape.group,
            format!("{amount:?}"),
            median(rates[i].clone()),
            Cost::median(&costs[i]).text()
        );
    }
}
