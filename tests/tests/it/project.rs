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
    assert!(c.jobs.iter().filter(|j| j.handler == "exec").count() >= 2, "the demo has exec jobs");
}

#[test]
fn docker_compose_is_valid_yaml_with_the_whole_stack() {
    use yaml_rust2::YamlLoader;
    let text = std::fs::read_to_string(root().join("docker-compose.yml")).unwrap();
    let docs = YamlLoader::load_from_str(&text).unwrap();
    let services = &docs[0]["services"];
    for s in ["rabbitmq", "redis", "worker", "worker-2", "ticker", "ticker-2"] {
        assert!(!services[s].is_badvalue(), "service {s} missing");
    }
    assert!(!services["rabbitmq"]["healthcheck"].is_badvalue());
    assert!(!services["redis"]["healthcheck"].is_badvalue());
    assert!(services["rabbitmq"]["image"].as_str().unwrap().contains("management"));
    // The config it mounts is the (validated) demo config, and the image it builds has
    // both binaries the README names.
    assert!(text.contains("./examples/chime.toml:/etc/chime/chime.toml"));
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    assert!(dockerfile.contains("-p chime-producer -p chime-worker"));
    assert!(
        dockerfile.contains("target/release/chime ") && dockerfile.contains("target/release/chime-worker")
    );
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
