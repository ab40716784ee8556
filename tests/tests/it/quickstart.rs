//! The README's quick start, as a new user types it: the demo's stack on `examples/chime.toml`
//! (workers and a ticker, the demo jobs pushed as `scripts/demo` pushes them), then every
//! command of the README's "with the demo running" block, verbatim but for where the binary
//! was built (`target/debug` here), from the checkout's root as the README assumes.

use std::time::Duration;

use crate::common::*;

/// The lines of the README's shell block that follows `marker`.
fn block_after(readme: &str, marker: &str) -> Vec<String> {
    let rest = &readme[readme.find(marker).unwrap_or_else(|| panic!("README lacks {marker:?}"))..];
    let start = rest.find("```sh\n").expect("a shell block") + "```sh\n".len();
    let end = rest[start..].find("```").expect("the block ends");
    rest[start..start + end].lines().map(str::to_string).collect()
}

/// A command line without its comment, as words (the README's commands quote nothing).
fn words(line: &str) -> Vec<String> {
    line.split('#').next().unwrap_or("").split_whitespace().map(str::to_string).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_quick_start_commands_work_verbatim() {
    let mut env = TestEnv::new("quickstart");
    env.queues = vec!["default".into(), "reports".into()];
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = block_after(&readme, "With the demo running");
    let config = lines
        .iter()
        .find_map(|l| l.strip_prefix("export CHIME_CONFIG="))
        .expect("the README says where the demo's config is")
        .to_string();
    assert_eq!(config, "examples/chime.toml", "the config scripts/demo runs");
    let demo = std::fs::read_to_string(root().join("scripts/demo")).unwrap();
    assert!(demo.contains("config=${CHIME_CONFIG:-examples/chime.toml}"));
    // This test's own prefix, on the shared services: overrides a user would not need.
    let overrides = [
        ("CHIME_PREFIX", env.prefix.clone()),
        ("CHIME_AMQP_URL", env.amqp_url.clone()),
        ("CHIME_REDIS_URL", env.redis_url.clone()),
    ];
    let config_path = root().join(&config);
    let daemon = |binary: &str, args: &[&str], tag: &str| {
        let mut cmd = tokio::process::Command::new(bin(binary));
        cmd.current_dir(root()).envs(overrides.iter().map(|(k, v)| (*k, v.as_str())));
        Child::run(cmd, &env.dir, &config_path, args, tag)
    };
    let _w1 = daemon("chime-worker", &["--listen", &format!("127.0.0.1:{}", free_port())], "w1");
    let _w2 = daemon("chime-worker", &["--listen", &format!("127.0.0.1:{}", free_port())], "w2");
    let _t1 = daemon("chime", &["tick", "--listen", &format!("127.0.0.1:{}", free_port())], "t1");
    // The demo's jobs, as scripts/demo pushes them (its single-command enqueue lines).
    let run = {
        let (overrides, config) = (overrides.clone(), config.clone());
        move |args: &[String]| {
            let out = std::process::Command::new(bin("chime"))
                .current_dir(root())
                .env("CHIME_CONFIG", &config)
                .envs(overrides.iter().map(|(k, v)| (*k, v.as_str())))
                .args(args)
                .output()
                .unwrap();
            (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let mut pushed = 0;
    for line in demo.lines().filter(|l| l.contains(" enqueue ") && !l.contains("| \"$bin")) {
        let line = line.replace("\"$bin/chime\" --config \"$config\" ", "").replace(" || true", "");
        // Payloads are single-quoted JSON without spaces in the demo.
        let args: Vec<String> = line.split_whitespace().map(|w| w.trim_matches('\'').to_string()).collect();
        let (code, out, err) = tokio::task::spawn_blocking({
            let args = args.clone();
            let run = run.clone();
            move || run(&args)
        })
        .await
        .unwrap();
        assert!(code == 0 || args.contains(&"report".to_string()), "{args:?}: {out}{err}");
        pushed += 1;
    }
    assert!(pushed >= 4, "the demo pushes its jobs with `chime enqueue`");
    let dlq = env.names().dlq("reports");
    wait_until("the failing report is dead-lettered", Duration::from_secs(60), || {
        let dlq = dlq.clone();
        async move { depth(&dlq).await == 1 }
    })
    .await;

    // Every command of the block, with the demo running.
    let mut ran = 0;
    for line in lines.iter().filter(|l| l.starts_with("target/release/chime ")) {
        let args: Vec<String> = words(line).into_iter().skip(1).collect();
        if args.first().map(String::as_str) == Some("web") {
            // Long-running: it serves the dashboard where the README says.
            let mut cmd = std::process::Command::new(bin("chime"));
            cmd.current_dir(root())
                .env("CHIME_CONFIG", &config)
                .envs(overrides.iter().map(|(k, v)| (*k, v.as_str())))
                .args(&args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            let mut web = cmd.spawn().unwrap();
            let url = line
                .split("http://")
                .nth(1)
                .map(|u| format!("http://{}", u.trim()))
                .expect("the README names the URL");
            let page = url.clone();
            wait_until("the dashboard answers where the README says", Duration::from_secs(20), || {
                let page = page.clone();
                async move { reqwest::get(&page).await.is_ok_and(|r| r.status().is_success()) }
            })
            .await;
            let _ = web.kill();
            let _ = web.wait();
            ran += 1;
            continue;
        }
        let (code, out, err) = tokio::task::spawn_blocking({
            let (args, run) = (args.clone(), run.clone());
            move || run(&args)
        })
        .await
        .unwrap();
        assert_eq!(code, 0, "{line}: {err}");
        match args[0].as_str() {
            "status" => assert!(out.contains("reports") && out.contains("heartbeat"), "{line}:\n{out}"),
            "dlq" => assert!(out.contains("report") && out.contains("permanent"), "{line}:\n{out}"),
            _ => {}
        }
        ran += 1;
    }
    assert_eq!(ran, 3, "status, dlq list and web");
}
