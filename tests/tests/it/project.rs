//! The project's face stays true: the demo config is valid, compose is valid YAML naming
//! the services the README promises, and the README carries both commands.

use crate::common::root;

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
    for s in ["rabbitmq", "redis", "worker", "ticker", "ticker-2", "web"] {
        assert!(!services[s].is_badvalue(), "service {s} missing");
    }
    // Workers scale (--scale worker=N) without a host port to clash on.
    assert_eq!(services["worker"]["deploy"]["replicas"].as_i64(), Some(2));
    assert!(services["worker"]["ports"].is_badvalue(), "a published worker port clashes when scaled");
    // The versions the suite runs on.
    assert_eq!(services["rabbitmq"]["image"].as_str(), Some("rabbitmq:3.10-management"));
    assert_eq!(services["redis"]["image"].as_str(), Some("redis:7.0"));
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

/// Every `chime_*` metric named in `text` (histogram series reduced to their metric).
fn chime_metrics(text: &str) -> std::collections::BTreeSet<String> {
    let mut found = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("chime_") {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|b| b.ends_with("_seconds")))
            .unwrap_or(name);
        // Skip chime_ inside other words (a job called `x_chime_y` in a label value).
        if i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric() {
            found.insert(base.to_string());
        }
        rest = &tail[end..];
    }
    found
}

/// `promtool check rules` on `path` when promtool is installed (scripts/services installs
/// it); returns whether it ran.
fn promtool_check_rules(path: &std::path::Path) -> bool {
    let Ok(out) = std::process::Command::new("promtool").arg("check").arg("rules").arg(path).output() else {
        eprintln!("promtool not installed: rules checked as YAML only");
        return false;
    };
    assert!(
        out.status.success(),
        "promtool check rules {}: {}{}",
        path.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    true
}

/// The Grafana dashboard and the alert rules use only metrics chime exports, their PromQL
/// parses (promtool), the dashboard shows throughput, latency, DLQ depth and workers, and
/// compose loads both.
#[test]
fn the_grafana_dashboard_and_the_rules_use_only_metrics_chime_exports() {
    use yaml_rust2::YamlLoader;
    let exported: std::collections::BTreeSet<String> =
        chime_shared::telemetry::ALL.iter().map(|m| m.to_string()).collect();
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/grafana/chime-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            exprs.push((
                panel["title"].as_str().unwrap().to_string(),
                t["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    let rules_text = std::fs::read_to_string(root().join("deploy/prometheus/chime-rules.yml")).unwrap();
    for (what, text) in
        exprs.iter().map(|(t, e)| (t.as_str(), e.as_str())).chain([("rules", rules_text.as_str())])
    {
        let used = chime_metrics(text);
        assert!(!used.is_empty(), "{what} uses no chime metric: {text}");
        for m in used {
            assert!(exported.contains(&m), "{what} uses {m}, which chime does not export");
        }
    }
    let all: String = exprs.iter().map(|(_, e)| e.as_str()).collect::<Vec<_>>().join("\n");
    for needed in [
        "chime_jobs_completed_total",
        "chime_job_lag_seconds_bucket",
        "chime_dlq_messages",
        "chime_worker_concurrency",
    ] {
        assert!(all.contains(needed), "the dashboard shows {needed}");
    }
    // The dashboard's queries parse: promtool checks them as recording rules.
    let dir = std::env::temp_dir().join(format!("chime-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, e)) in exprs.iter().enumerate() {
        rules.push_str(&format!(
            "      - record: dashboard:q{i}\n        expr: {}\n",
            serde_json::to_string(e).unwrap()
        ));
    }
    std::fs::write(dir.join("dashboard.yml"), rules).unwrap();
    if promtool_check_rules(&dir.join("dashboard.yml")) {
        promtool_check_rules(&root().join("deploy/prometheus/chime-rules.yml"));
    }
    let _ = std::fs::remove_dir_all(&dir);
    // Compose runs Prometheus with these rules and Grafana with this dashboard, and
    // Prometheus scrapes the ports the daemons listen on.
    let compose = std::fs::read_to_string(root().join("docker-compose.yml")).unwrap();
    let services = &YamlLoader::load_from_str(&compose).unwrap()[0]["services"];
    let volumes = |s: &str| -> String {
        services[s]["volumes"]
            .as_vec()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert!(
        volumes("prometheus").contains("./deploy/prometheus/chime-rules.yml:/etc/prometheus/chime-rules.yml")
    );
    assert!(
        volumes("grafana").contains("./deploy/grafana/chime-dashboard.json:/var/lib/grafana/dashboards/")
    );
    assert!(volumes("grafana").contains("./deploy/grafana/provisioning:/etc/grafana/provisioning"));
    let prom = std::fs::read_to_string(root().join("deploy/prometheus/prometheus.yml")).unwrap();
    assert!(prom.contains("chime-rules.yml"));
    for (service, port) in [("worker", 9464), ("ticker", 9465), ("ticker-2", 9465)] {
        let command: Vec<&str> =
            services[service]["command"].as_vec().unwrap().iter().filter_map(|c| c.as_str()).collect();
        assert!(
            command.join(" ").contains(&format!("--listen 0.0.0.0:{port}")),
            "{service} listens on {port}"
        );
    }
    // Every worker replica, found by DNS; the two tickers by name.
    assert!(
        prom.contains("names: [\"worker\"]") && prom.contains("port: 9464"),
        "Prometheus finds every worker"
    );
    for ticker in ["ticker:9465", "ticker-2:9465"] {
        assert!(prom.contains(&format!("\"{ticker}\"")), "Prometheus scrapes {ticker}");
    }
}

/// One Kubernetes object by kind and name from deploy/kubernetes/*.yaml.
fn k8s_objects() -> Vec<yaml_rust2::Yaml> {
    let mut objects = Vec::new();
    let mut files: Vec<_> =
        std::fs::read_dir(root().join("deploy/kubernetes")).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let docs =
            yaml_rust2::YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        for d in docs {
            assert!(
                d["apiVersion"].as_str().is_some() && d["kind"].as_str().is_some(),
                "{}: {d:?}",
                f.display()
            );
            objects.push(d);
        }
    }
    objects
}

/// The manifests agree with the config they mount and with chime: probe paths and ports are
/// the ones the daemons serve, the grace period outlasts the drain, KEDA scales the worker
/// Deployment on the work queue's real name, and the PrometheusRule holds the same rules as
/// deploy/prometheus/chime-rules.yml.
#[test]
fn kubernetes_manifests_agree_with_the_config_and_the_rules() {
    use yaml_rust2::Yaml;
    let objects = k8s_objects();
    let find = |kind: &str, name: &str| -> &Yaml {
        objects
            .iter()
            .find(|o| o["kind"].as_str() == Some(kind) && o["metadata"]["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("{kind} {name} missing"))
    };
    let toml = find("ConfigMap", "chime-config")["data"]["chime.toml"].as_str().unwrap().to_string();
    let config = chime_shared::Config::from_toml_str(&toml)
        .unwrap_or_else(|e| panic!("the ConfigMap's chime.toml: {e}"));
    let secret = find("Secret", "chime-secrets");
    for (deployment, program, replicas) in
        [("chime-worker", "chime-worker", None), ("chime-ticker", "chime", Some(2))]
    {
        let d = find("Deployment", deployment);
        let pod = &d["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let args: Vec<&str> = c["args"].as_vec().unwrap().iter().filter_map(Yaml::as_str).collect();
        assert_eq!(args[0], program, "{deployment} runs {program}");
        let listen = args
            .windows(2)
            .find(|w| w[0] == "--listen")
            .map(|w| w[1])
            .unwrap_or_else(|| panic!("{deployment}: --listen"));
        let port: i64 = listen.rsplit(':').next().unwrap().parse().unwrap();
        for (probe, path) in [("livenessProbe", "/livez"), ("readinessProbe", "/readyz")] {
            assert_eq!(c[probe]["httpGet"]["path"].as_str(), Some(path), "{deployment} {probe}");
            assert_eq!(c[probe]["httpGet"]["port"].as_i64(), Some(port), "{deployment} {probe} port");
        }
        assert_eq!(c["ports"][0]["containerPort"].as_i64(), Some(port));
        assert_eq!(
            d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"].as_str(),
            Some(port.to_string().as_str())
        );
        assert!(c["resources"]["requests"]["memory"].as_str().is_some(), "{deployment} requests memory");
        let env: Vec<&Yaml> = c["env"].as_vec().unwrap().iter().collect();
        for (var, key) in [("CHIME_AMQP_URL", "amqp-url"), ("CHIME_REDIS_URL", "redis-url")] {
            let e = env
                .iter()
                .find(|e| e["name"].as_str() == Some(var))
                .unwrap_or_else(|| panic!("{deployment}: {var}"));
            assert_eq!(e["valueFrom"]["secretKeyRef"]["key"].as_str(), Some(key));
            assert!(secret["stringData"][key].as_str().is_some(), "the Secret holds {key}");
        }
        if let Some(n) = replicas {
            assert_eq!(d["spec"]["replicas"].as_i64(), Some(n), "{deployment} replicas");
        }
        if deployment == "chime-worker" {
            let grace = pod["terminationGracePeriodSeconds"].as_i64().unwrap();
            let drain = (config.worker.shutdown_timeout + config.worker.cancel_grace).as_secs() as i64;
            assert!(
                grace > drain,
                "terminationGracePeriodSeconds {grace} must exceed shutdown_timeout + cancel_grace ({drain} s)"
            );
            assert_eq!(config.worker.listen.as_deref(), Some(listen), "the worker's listen in the config");
        }
    }
    // Secrets' URLs are valid for chime (and TLS ones).
    let mut with_urls = toml.clone();
    with_urls = with_urls.replace(
        "[amqp]\n",
        &format!("[amqp]\nurl = \"{}\"\n", secret["stringData"]["amqp-url"].as_str().unwrap()),
    );
    with_urls = with_urls.replace(
        "[redis]\n",
        &format!("[redis]\nurl = \"{}\"\n", secret["stringData"]["redis-url"].as_str().unwrap()),
    );
    chime_shared::Config::from_toml_str(&with_urls).unwrap_or_else(|e| panic!("the Secret's URLs: {e}"));
    let scaled = find("ScaledObject", "chime-worker");
    assert_eq!(scaled["spec"]["scaleTargetRef"]["name"].as_str(), Some("chime-worker"));
    let trigger = &scaled["spec"]["triggers"][0];
    assert_eq!(trigger["type"].as_str(), Some("rabbitmq"));
    let queue = chime_shared::Names::new(&config.prefix).work_queue("default");
    assert_eq!(
        trigger["metadata"]["queueName"].as_str(),
        Some(queue.as_str()),
        "KEDA watches the work queue"
    );
    let auth = trigger["authenticationRef"]["name"].as_str().unwrap();
    let auth = find("TriggerAuthentication", auth);
    assert_eq!(auth["spec"]["secretTargetRef"][0]["key"].as_str(), Some("amqp-url"));
    // The PrometheusRule is the rules file.
    let rules_text = std::fs::read_to_string(root().join("deploy/prometheus/chime-rules.yml")).unwrap();
    let rules = &yaml_rust2::YamlLoader::load_from_str(&rules_text).unwrap()[0]["groups"];
    assert_eq!(&find("PrometheusRule", "chime")["spec"]["groups"], rules, "PrometheusRule = chime-rules.yml");
}

/// What a library user depends on: no HTTP server, CLI parser, Prometheus exporter, log
/// subscriber or HTTP client — the binaries own those.
#[test]
fn library_crates_compile_only_what_they_use() {
    const DAEMON_ONLY: [&str; 6] =
        ["axum", "clap", "metrics-exporter-prometheus", "tracing-subscriber", "reqwest", "hyper"];
    // Crates in each library's normal dependency tree, itself included, at most: a crate that
    // only defines jobs compiles serde and a duration parser; the wire protocol, lapin's
    // types and JSON; the others are held where they
    // are, so that growth is a decision.
    // Without their default `tls` feature, the client, worker and scheduler libraries leave out
    // rustls, ring and lapin's PKCS#12 support: about a third of their tree.
    let bounds = [
        ("chime-job", false, 20),
        ("invoice-jobs", false, 20),
        ("chime-protocol", false, 95),
        ("chime-shared", false, 205),
        ("chime-producer", false, 206),
        ("chime-worker", false, 206),
        ("chime-scheduler", false, 206),
        ("enqueue-service", false, 208),
        ("invoice-worker", false, 208),
        ("chime-producer", true, 145),
        ("chime-worker", true, 145),
        ("chime-scheduler", true, 145),
    ];
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for (package, no_tls, bound) in bounds {
        let mut args =
            vec!["tree", "--offline", "--locked", "-e", "normal", "--prefix", "none", "-p", package];
        if no_tls {
            args.push("--no-default-features");
        }
        let out = std::process::Command::new(&cargo).current_dir(root()).args(&args).output().unwrap();
        assert!(out.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&out.stderr));
        let tree = String::from_utf8_lossy(&out.stdout);
        let crates: std::collections::BTreeSet<&str> =
            tree.lines().filter_map(|l| l.split_whitespace().next()).collect();
        for heavy in DAEMON_ONLY {
            assert!(!crates.contains(heavy), "{package} pulls {heavy}");
        }
        // The wire protocol needs neither Redis nor TLS.
        if package == "chime-protocol" {
            for heavy in ["redis", "rustls", "ring"] {
                assert!(!crates.contains(heavy), "{package} pulls {heavy}");
            }
        }
        let package = if no_tls { format!("{package} without tls") } else { package.to_string() };
        println!("{package}: {} crates", crates.len());
        assert!(
            crates.len() <= bound,
            "{package} compiles {} crates (at most {bound}):\n{tree}",
            crates.len()
        );
    }
}
