//! The project's face stays true: the demo config is valid, compose is valid YAML naming
//! the services the README promises, and the README carries both commands.

use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
fn example_config_is_valid() {
    let text = std::fs::read_to_string(root().join("examples/chime.toml")).unwrap();
    let c = chime_shared::Config::from_toml_str(&text).unwrap();
    assert!(c.jobs.iter().any(|j| j.schedule.is_some()), "the demo has a schedule");
    assert!(
        c.jobs.iter().filter(|j| matches!(j.handler, chime_shared::config::HandlerConfig::Exec(_))).count()
            >= 2,
        "the demo has exec jobs"
    );
}

#[test]
fn docker_compose_is_valid_yaml_with_the_whole_stack() {
    use yaml_rust2::YamlLoader;
    let text = std::fs::read_to_string(root().join("docker-compose.yml")).unwrap();
    let docs = YamlLoader::load_from_str(&text).unwrap();
    let services = &docs[0]["services"];
    for s in ["rabbitmq", "redis", "worker", "worker-2", "ticker", "ticker-2", "web"] {
        assert!(!services[s].is_badvalue(), "service {s} missing");
    }
    assert!(!services["rabbitmq"]["healthcheck"].is_badvalue());
    assert!(!services["redis"]["healthcheck"].is_badvalue());
    assert!(services["rabbitmq"]["image"].as_str().unwrap().contains("management"));
    // The dashboard listens off loopback inside its container, so it must carry credentials
    // (it refuses to start without them).
    let web = &services["web"];
    assert!(
        !web["environment"]["CHIME_WEB_USER"].is_badvalue()
            && !web["environment"]["CHIME_WEB_PASSWORD"].is_badvalue()
    );
    assert_eq!(web["ports"][0].as_str(), Some("127.0.0.1:8090:8090"));
    // The config it mounts is the (validated) demo config, and the image it builds has
    // both binaries the README names.
    assert!(text.contains("./examples/chime.toml:/etc/chime/chime.toml"));
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    assert!(
        dockerfile.contains("target/release/chime ") && dockerfile.contains("target/release/chime-worker")
    );
}

/// The Dockerfile and `scripts/demo` build the packages that hold the `chime` and
/// `chime-worker` binaries (a package renamed or split must not leave them building a
/// library that has no binary).
#[test]
fn the_image_and_the_demo_build_the_binary_packages() {
    let manifest = |dir: &str| std::fs::read_to_string(root().join(dir).join("Cargo.toml")).unwrap();
    for (dir, bin) in [("producer/cli", "chime"), ("worker/cli", "chime-worker")] {
        assert!(manifest(dir).contains(&format!("[[bin]]\nname = \"{bin}\"")), "{dir} builds {bin}");
    }
    for file in ["Dockerfile", "scripts/demo"] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        let build =
            text.lines().find(|l| l.contains("cargo build")).unwrap_or_else(|| panic!("{file} builds"));
        let packages: Vec<&str> = build
            .split_whitespace()
            .skip_while(|w| *w != "-p")
            .filter(|w| *w != "-p" && !w.starts_with('-'))
            .collect();
        assert_eq!(packages, ["chime-cli", "chime-worker-cli"], "{file}: {build}");
    }
}

#[test]
fn readme_has_the_two_commands() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(readme.contains("docker compose up"), "stack command");
    assert!(readme.contains("scripts/test"), "test command");
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(ci.contains("scripts/test"), ".ci/run runs the README's test command");
}

#[test]
fn prometheus_rules_are_valid_yaml_and_use_chime_metrics() {
    use yaml_rust2::YamlLoader;
    let text = std::fs::read_to_string(root().join("deploy/prometheus/chime-rules.yml")).unwrap();
    let docs = YamlLoader::load_from_str(&text).unwrap();
    let rules = docs[0]["groups"][0]["rules"].as_vec().unwrap();
    assert!(rules.len() >= 3);
    for r in rules {
        let expr = r["expr"].as_str().unwrap();
        assert!(expr.contains("chime_"), "{expr}");
        assert!(r["alert"].as_str().is_some());
    }
    assert!(text.contains("chime_dlq_messages"));
}

/// What a library user depends on: no HTTP server, CLI parser, Prometheus exporter, log
/// subscriber or HTTP client — the binaries own those.
#[test]
fn library_crates_compile_only_what_they_use() {
    const DAEMON_ONLY: [&str; 6] =
        ["axum", "clap", "metrics-exporter-prometheus", "tracing-subscriber", "reqwest", "hyper"];
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for package in ["chime-shared", "chime-producer", "chime-worker", "enqueue-service", "invoice-worker"] {
        let out = std::process::Command::new(&cargo)
            .current_dir(root())
            .args(["tree", "--offline", "--locked", "-e", "normal", "--prefix", "none", "-p", package])
            .output()
            .unwrap();
        assert!(out.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&out.stderr));
        let tree = String::from_utf8_lossy(&out.stdout);
        let crates: std::collections::BTreeSet<&str> =
            tree.lines().filter_map(|l| l.split_whitespace().next()).collect();
        for heavy in DAEMON_ONLY {
            assert!(!crates.contains(heavy), "{package} pulls {heavy}");
        }
        println!("{package}: {} crates", crates.len());
    }
}
