//! TLS everywhere, failing closed: a worker, a ticker and the CLI over `amqps://` and
//! `rediss://` with mutual TLS (a private RabbitMQ node and Redis with TLS listeners and
//! certificates made by the test), `https://` for the `http` handler, and every way a
//! handshake can be wrong named in the error.

use std::path::Path;
use std::time::Duration;

use chime_tests::tls::{HttpsServer, Pki, rabbit_with_tls, redis_with_tls};

use crate::common::*;

/// `[amqp]` and `[redis]` over TLS on these ports, with the given `[*.tls]` bodies.
fn tls_sections(amqp_port: u16, amqp_tls: &str, redis_port: u16, redis_tls: &str) -> String {
    format!(
        "[amqp]\nurl = \"amqps://guest:guest@127.0.0.1:{amqp_port}/%2f\"\nqueue_type = \"quorum\"\n\
         [amqp.tls]\n{amqp_tls}\n\
         [redis]\nurl = \"rediss://127.0.0.1:{redis_port}/0\"\n[redis.tls]\n{redis_tls}\n"
    )
}

fn mutual(pki: &Pki) -> String {
    format!(
        "ca_file = \"{}\"\nclient_cert = \"{}\"\nclient_key = \"{}\"\n",
        pki.ca.display(),
        pki.client.cert.display(),
        pki.client.key.display()
    )
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// The jobs every deployment test runs: `ok` (rate-limited: its rate decision claims its key
/// in the same call, except on a Redis Cluster), `flaky` (fails its first attempt), `bad`
/// (dead-lettered at once) and `beat` (every second), writing to `ledger`.
pub fn flow_jobs(ledger: &Path) -> String {
    let l = ledger.display();
    format!(
        "[[jobs]]\nname = \"ok\"\nhandler = \"exec\"\nrate_limit = \"100/s\"\n\
         command = ['sh', '-c', 'echo ok $CHIME_KEY >> {l}']\n\
         [[jobs]]\nname = \"flaky\"\nhandler = \"exec\"\nmax_attempts = 3\n\
         backoff = {{ initial = \"1s\", factor = 1.0, max = \"1s\" }}\n\
         command = ['sh', '-c', 'echo flaky $CHIME_ATTEMPT >> {l}; test $CHIME_ATTEMPT -ge 2']\n\
         [[jobs]]\nname = \"bad\"\nhandler = \"exec\"\ncommand = ['sh', '-c', 'exit 100']\n\
         [[jobs]]\nname = \"beat\"\nhandler = \"exec\"\nschedule = \"* * * * * *\"\n\
         command = ['sh', '-c', 'echo beat $CHIME_SLOT >> {l}']\n"
    )
}

/// A worker and a ticker (started with `envs`) on the config at `path` (which holds
/// [`flow_jobs`] writing to `ledger`), driven through the CLI: enqueue, a retry that succeeds,
/// a dead letter listed by `chime dlq list`, scheduled slots, the leader in `chime status`, a
/// key's record in `chime inspect` and its run in `chime history`. Returns the processes.
pub async fn run_flow(
    env: &TestEnv,
    path: &Path,
    ledger_path: &Path,
    envs: &[(&str, &str)],
) -> (Child, Child) {
    let (code, out, err) = chime(path, &["check-config"], None);
    assert_eq!(code, 0, "check-config: {out}{err}");
    let worker = Child::worker_env(&env.dir, path, "w", envs);
    let mut tick = tokio::process::Command::new(bin("chime"));
    tick.envs(envs.iter().copied());
    let ticker = Child::run(tick, &env.dir, path, &["tick"], "ticker-t");
    for job in ["ok", "flaky", "bad"] {
        let (code, out, err) = chime(path, &["enqueue", job, "--key", job], None);
        assert_eq!(code, 0, "enqueue {job}: {out}{err}");
    }
    let l2 = ledger_path.to_path_buf();
    let w = &worker;
    wait_until("ok ran, flaky succeeded on its retry, two beats ran", Duration::from_secs(60), || {
        let l = l2.clone();
        async move {
            let lines = ledger(&l);
            let done = lines.iter().any(|x| x.starts_with("ok "))
                && lines.iter().any(|x| x == "flaky 2")
                && lines.iter().filter(|x| x.starts_with("beat ")).count() >= 2;
            if !done && w.log_text().contains("panicked") {
                panic!("the worker panicked:\n{}", w.log_text());
            }
            done
        }
    })
    .await;
    let p = path.to_path_buf();
    wait_until("bad is dead-lettered", Duration::from_secs(60), || {
        let p = p.clone();
        async move {
            let (code, out, err) = chime(&p, &["dlq", "list", "--json"], None);
            assert_eq!(code, 0, "dlq list: {err}");
            out.contains("\"bad\"")
        }
    })
    .await;
    let (code, out, err) = chime(path, &["status", "--json"], None);
    assert_eq!(code, 0, "status: {err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(status["leader"]["id"].is_string(), "the ticker leads: {out}");
    let (code, out, err) = chime(path, &["inspect", "--job", "ok", "--key", "ok", "--json"], None);
    assert_eq!(code, 0, "inspect: {err}");
    assert!(out.contains("\"done\""), "the key's record says done: {out}");
    let p = path.to_path_buf();
    wait_until("chime history shows the run of ok", Duration::from_secs(30), || {
        let p = p.clone();
        async move {
            let (code, out, _) = chime(&p, &["history", "--job", "ok"], None);
            code == 0 && out.contains("succeeded")
        }
    })
    .await;
    (worker, ticker)
}

#[tokio::test]
async fn worker_ticker_and_cli_run_over_tls_and_every_bad_handshake_is_named() {
    let mut env = TestEnv::new("tls");
    let pki = Pki::generate(&env.dir.join("pki"));
    let (rabbit, amqps) = rabbit_with_tls(&pki, &pki.server).await;
    let (redis, rediss) = redis_with_tls(&pki, &pki.server).await;
    // The test's own cleanup and helpers use the plaintext listeners of the private servers.
    env.amqp_url = rabbit.url();
    env.redis_url = redis.url();
    let hook = HttpsServer::start(&pki.server, 200).await;
    let misnamed = HttpsServer::start(&pki.wrong_name, 200).await;
    let alerts = HttpsServer::start(&pki.server, 200).await;
    let ledger_path = env.dir.join("ledger");
    let jobs = format!(
        "{}[[jobs]]\nname = \"hook\"\nhandler = \"http\"\nurl = \"https://localhost:{}/hook\"\n\
         [[jobs]]\nname = \"hook_misnamed\"\nhandler = \"http\"\nmax_attempts = 1\nurl = \"https://localhost:{}/hook\"\n",
        flow_jobs(&ledger_path),
        hook.port,
        misnamed.port
    );
    let good = format!(
        "prefix = \"{}\"\n{}[ticker]\nlease = \"2s\"\n\
         [alerts]\nfor = \"1s\"\ninterval = \"200ms\"\nwebhook = \"https://localhost:{}/alerts\"\n{jobs}",
        env.prefix,
        tls_sections(amqps, &mutual(&pki), rediss, &mutual(&pki)),
        alerts.port
    );
    let path = write(&env.dir, "chime.toml", &good);
    // The worker (http jobs) and the ticker (the DLQ alert webhook) trust the test CA for
    // https:// through SSL_CERT_FILE (the platform's roots).
    let ca = pki.ca.display().to_string();
    let (worker, ticker) = run_flow(&env, &path, &ledger_path, &[("SSL_CERT_FILE", ca.as_str())]).await;
    for job in ["hook", "hook_misnamed"] {
        let (code, out, err) = chime(&path, &["enqueue", job, "--key", job], None);
        assert_eq!(code, 0, "enqueue {job} over TLS: {out}{err}");
    }
    let h = &hook;
    wait_until("the https:// handler posted", Duration::from_secs(30), || async move { h.count() >= 1 })
        .await;
    let p = path.clone();
    wait_until("hook_misnamed is dead-lettered", Duration::from_secs(60), || {
        let p = p.clone();
        async move { chime(&p, &["dlq", "list", "--json"], None).1.contains("\"hook_misnamed\"") }
    })
    .await;
    let out = chime(&path, &["dlq", "list", "--json"], None).1;
    assert!(
        out.contains("does not name the host"),
        "the https:// failure says the certificate names another host: {out}"
    );
    assert_eq!(misnamed.count(), 0, "nothing was sent to a server whose certificate names another host");
    let a = &alerts;
    wait_until("the DLQ alert reached the https:// webhook", Duration::from_secs(30), || async move {
        a.count() >= 1
    })
    .await;
    drop(ticker);
    drop(worker);

    // Every way the handshake can be wrong fails closed, naming the endpoint and the cause.
    let other = format!("ca_file = \"{}\"\n", pki.other_ca.display());
    let no_client_cert = format!("ca_file = \"{}\"\n", pki.ca.display());
    let client_only = format!(
        "client_cert = \"{}\"\nclient_key = \"{}\"\n",
        pki.client.cert.display(),
        pki.client.key.display()
    );
    let cases: Vec<(&str, String, &str, &str)> = vec![
        (
            "AMQP server signed by a CA the client does not trust (platform roots only)",
            tls_sections(amqps, &client_only, rediss, &mutual(&pki)),
            "signed by a CA this client does not trust",
            "amqps://guest:***@127.0.0.1",
        ),
        (
            "Redis server signed by a CA the client does not trust",
            tls_sections(amqps, &mutual(&pki), rediss, &other),
            "signed by a CA this client does not trust",
            "127.0.0.1",
        ),
        (
            "AMQP without the client certificate the broker requires",
            tls_sections(amqps, &no_client_cert, rediss, &mutual(&pki)),
            "client certificate",
            "amqps://guest:***@127.0.0.1",
        ),
    ];
    for (what, sections, cause, endpoint) in cases {
        let p = write(&env.dir, "bad.toml", &format!("prefix = \"{}\"\n{sections}{jobs}", env.prefix));
        let (code, out, err) = chime(&p, &["status"], None);
        assert_ne!(code, 0, "{what}: refused\n{out}");
        eprintln!("{what}:\n  {}", err.trim());
        assert!(err.contains(cause) && err.contains(endpoint), "{what}: {err}");
    }

    // A CA file is trusted alone, for AMQP as for Redis: the platform's roots (here
    // SSL_CERT_FILE, which holds the servers' CA) do not widen it. (Round two, finding 9:
    // lapin's own TLS setup trusted both.)
    for (what, sections, endpoint) in [
        (
            "AMQP",
            tls_sections(amqps, &format!("{other}{client_only}"), rediss, &mutual(&pki)),
            "amqps://guest:***@127.0.0.1",
        ),
        ("Redis", tls_sections(amqps, &mutual(&pki), rediss, &format!("{other}{client_only}")), "127.0.0.1"),
    ] {
        let p = write(&env.dir, "narrow.toml", &format!("prefix = \"{}\"\n{sections}{jobs}", env.prefix));
        let (code, out, err) =
            chime_env(&p, &["status"], None, &[("SSL_CERT_FILE", std::ffi::OsStr::new(&ca))]);
        assert_ne!(code, 0, "{what}: the platform's roots must not widen ca_file\n{out}");
        assert!(
            err.contains("signed by a CA this client does not trust") && err.contains(endpoint),
            "{what}: {err}"
        );
    }

    // amqps:// and rediss:// against plaintext ports: refused, never a plaintext session.
    let plain = format!(
        "prefix = \"{}\"\n[amqp]\nurl = \"amqps://guest:guest@127.0.0.1:{}/%2f\"\n[amqp.tls]\n{}\
         [redis]\nurl = \"rediss://127.0.0.1:{}/0\"\n[redis.tls]\n{}{jobs}",
        env.prefix,
        rabbit.port,
        mutual(&pki),
        redis.port,
        mutual(&pki)
    );
    let p = write(&env.dir, "plain.toml", &plain);
    let (code, out, err) = chime(&p, &["status"], None);
    assert_ne!(code, 0, "amqps:// to a plaintext port must fail: {out}");
    eprintln!("amqps:// to a plaintext port:\n  {}", err.trim());
    assert!(err.contains("amqps://guest:***@127.0.0.1"), "names the endpoint: {err}");

    // Server certificates that are expired, or name another host.
    for (pair, cause) in [(&pki.expired, "has expired"), (&pki.wrong_name, "does not name the host")] {
        let (bad_redis, bad_port) = redis_with_tls(&pki, pair).await;
        let sections = tls_sections(amqps, &mutual(&pki), bad_port, &mutual(&pki));
        let p = write(&env.dir, "cert.toml", &format!("prefix = \"{}\"\n{sections}{jobs}", env.prefix));
        let (code, out, err) = chime(&p, &["status"], None);
        assert_ne!(code, 0, "{cause}: refused\n{out}");
        eprintln!("{cause}:\n  {}", err.trim());
        assert!(err.contains(cause) && err.contains(&format!("127.0.0.1:{bad_port}")), "{cause}: {err}");
        drop(bad_redis);
    }
}

#[test]
fn tls_settings_that_would_be_ignored_or_fail_open_are_rejected_by_name() {
    let dir = std::env::temp_dir().join(format!("chime-tls-config-{}", std::process::id()));
    let pki = Pki::generate(&dir);
    let ca = pki.ca.display();
    let cases = [
        (
            format!("[amqp]\nurl = \"amqp://h/%2f\"\n[amqp.tls]\nca_file = \"{ca}\"\n"),
            "amqp.tls: is set but amqp.url is not a amqps:// URL",
        ),
        (format!("[redis]\nurl = \"redis://h/0\"\n[redis.tls]\nca_file = \"{ca}\"\n"), "redis.tls: is set"),
        ("[amqp]\nurl = [\"amqps://a/%2f\", \"amqp://b/%2f\"]\n".to_string(), "amqp.url: mixes amqps://"),
        ("[redis]\nurl = \"rediss://h/0#insecure\"\n".to_string(), "redis.url: #insecure"),
        (
            "[redis]\nurl = \"redis+sentinel://h/mymaster\"\n".to_string(),
            "scheme \"redis+sentinel\" is not supported",
        ),
        (
            "[redis]\nurl = \"rediss://h/0\"\n[redis.tls]\nca_file = \"/nonexistent/ca.pem\"\n".to_string(),
            "redis.tls.ca_file: cannot read /nonexistent/ca.pem",
        ),
        (
            format!("[amqp]\nurl = \"amqps://h/%2f\"\n[amqp.tls]\nclient_cert = \"{ca}\"\n"),
            "amqp.tls.client_key: client_cert is set without client_key",
        ),
        (
            format!(
                "[amqp]\nurl = \"amqps://h/%2f\"\n[amqp.tls]\nca_file = \"{}\"\n",
                pki.client.key.display()
            ),
            "holds no PEM CERTIFICATE block",
        ),
        ("[amqp.tls]\nverify = false\n".to_string(), "unknown field `verify`"),
    ];
    for (text, want) in cases {
        let e = chime_shared::Config::from_toml_str(&text).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(want), "{text}\nwanted {want:?} in: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
