//! The code's shape, checked: no import circle between the modules of any crate, and the
//! invariants of ARCHITECTURE.md that a reading of the sources can check.

use crate::common::root;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The `src/` directories of the workspace's crates.
const CRATES: [&str; 9] = [
    "shared/job/src",
    "shared/protocol/src",
    "shared/src",
    "shared/daemon/src",
    "producer/src",
    "producer/cli/src",
    "producer/scheduler/src",
    "worker/src",
    "worker/cli/src",
];

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// A file's code without its comments and its test module (tests may reach anywhere).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if matches!(name, "tests.rs" | "fuzz.rs" | "oracle.rs") {
        return String::new();
    }
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| w[0].trim() == "#[cfg(test)]" && w[1].trim_start().starts_with("mod "))
        .unwrap_or(lines.len());
    lines[..end].iter().filter(|l| !l.trim_start().starts_with("//")).copied().collect::<Vec<_>>().join("\n")
}

/// Names that follow `prefix` in `text` (`crate::config::X` gives `config`), and those inside
/// `prefix{a, b::c}` groups.
fn named_after(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let word = |s: &str| s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>();
    for (i, _) in text.match_indices(prefix) {
        let rest = &text[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            out.extend(group.split(',').map(|p| word(p.trim())).filter(|w| !w.is_empty()));
        } else {
            let w = word(rest);
            if !w.is_empty() {
                out.insert(w);
            }
        }
    }
    out
}

/// The modules of the module directory `dir` (a crate's `src/`, or a module's own directory):
/// each `x.rs` or `x/` beside the root file, with the files that make it up.
fn modules(dir: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut out: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = path.file_stem().and_then(|n| n.to_str()).unwrap_or("").to_string();
        if path.is_dir() {
            out.entry(name).or_default().extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs")
            && !matches!(name.as_str(), "lib" | "main" | "mod")
        {
            out.entry(name).or_default().push(path);
        }
    }
    out
}

/// A circle among `graph`'s nodes, if there is one.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut c = path[i..].to_vec();
            c.push(n.to_string());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for m in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

/// The import graph among the modules of `dir`: module → the sibling modules its code names,
/// through `crate::` paths (at a crate's root) or `super::` paths (inside a module directory,
/// `super::` from its files, `super::super::` from their children…).
fn graph(dir: &Path, at_crate_root: bool) -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules(dir);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, files) in &mods {
        let edges = g.entry(name.clone()).or_default();
        for f in files {
            let text = code(f);
            let named = if at_crate_root {
                named_after(&text, "crate::")
            } else {
                // How many `super::` lead from this file to `dir`.
                let depth = f.strip_prefix(dir).map(|p| p.components().count()).unwrap_or(1);
                let ups = if f.file_name().is_some_and(|n| n == "mod.rs") { depth - 1 } else { depth };
                named_after(&text, &"super::".repeat(ups.max(1)))
            };
            edges.extend(named.into_iter().filter(|m| m != name && mods.contains_key(m)));
        }
    }
    g
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let mut checked = 0;
    for krate in CRATES {
        let src = root().join(krate);
        let mut dirs = vec![(src.clone(), true)];
        // Every module directory inside the crate, too.
        let mut stack = vec![src];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap().flatten() {
                if entry.path().is_dir() {
                    dirs.push((entry.path(), false));
                    stack.push(entry.path());
                }
            }
        }
        for (dir, at_root) in dirs {
            let g = graph(&dir, at_root);
            checked += g.len();
            if let Some(c) = circle(&g) {
                panic!("an import circle in {}: {}", dir.display(), c.join(" → "));
            }
        }
    }
    assert!(checked > 40, "only {checked} modules were read: is the layout different?");
}

#[test]
fn the_circle_finder_finds_circles() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("config", vec!["envelope"]),
        ("envelope", vec!["names"]),
        ("names", vec!["config"]),
        ("leaf", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    let c = circle(&g).unwrap();
    assert_eq!(c.first(), c.last());
    assert_eq!(c.len(), 4, "{c:?}");
    assert_eq!(named_after("use crate::{config::X, envelope};\ncrate::names::word(x)", "crate::").len(), 3);
}

/// What follows a `{placeholder}` in a string that spells a broker or Redis name.
const NAME_SHAPES: [&str; 17] = [
    ".q.",
    ".dlq.",
    ".work\"",
    ".dead\"",
    ".unroutable\"",
    ":idem:",
    ":ticker:",
    ":history:",
    ":workers",
    ":paused:",
    ":overlap:",
    ":limit:",
    ":rate:",
    ":circuit:",
    ":group:",
    ":dlq-lock:",
    "^",
];

/// The string literals of `code` that spell a name: a placeholder followed by a name's shape
/// (`"{prefix}:ticker:leader"`, `"{}.q.{queue}"`, `"{queue}^{}"`), or a worker route (`"@{"`).
fn spelled_names(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in code.lines() {
        for (i, literal) in line.split('"').enumerate() {
            if i % 2 == 0 {
                continue;
            }
            let quoted = format!("{literal}\"");
            let shaped =
                quoted.split('}').skip(1).any(|after| NAME_SHAPES.iter().any(|s| after.starts_with(s)));
            if shaped || literal.starts_with("@{") {
                out.push(line.trim().to_string());
            }
        }
    }
    out
}

/// ARCHITECTURE.md: no queue, exchange or Redis key name is spelled outside `names`.
#[test]
fn names_are_spelled_only_in_names() {
    let mut found = Vec::new();
    for dir in CRATES {
        for file in rust_files(&root().join(dir)) {
            if file.ends_with("protocol/src/names.rs") {
                continue;
            }
            for line in spelled_names(&code(&file)) {
                found.push(format!("{}: {line}", file.strip_prefix(root()).unwrap().display()));
            }
        }
    }
    assert!(found.is_empty(), "names spelled outside names.rs:\n{}", found.join("\n"));
    // The finder finds what it looks for.
    assert_eq!(spelled_names(r#"let k = format!("{prefix}:ticker:leader");"#).len(), 1);
    assert_eq!(
        spelled_names(r#"format!("{}.q.{queue}", p), format!("{queue}^{}", l), format!("@{id}")"#).len(),
        3
    );
    assert!(spelled_names(r#"format!("{job}@{}", slot); format!("{a}: {b}")"#).is_empty());
}

/// ARCHITECTURE.md: a worker settles a delivery only through its `Ticket` (the ack batcher
/// alone calls lapin's ack and nack), and only `process` (every delivery it judged) and
/// `runtime` (prefetched deliveries never started, given back at shutdown) settle tickets.
#[test]
fn deliveries_are_settled_only_through_tickets_where_architecture_says() {
    let worker = root().join("worker/src");
    for file in rust_files(&worker) {
        let name = file.strip_prefix(&worker).unwrap().display().to_string();
        let code = code(&file);
        if ["basic_ack(", "basic_nack(", "basic_reject("].iter().any(|c| code.contains(c)) {
            assert_eq!(name, "ack.rs", "{name} calls lapin's ack/nack itself");
        }
        if code.contains(".requeue().await") || code.contains(".ack().await") {
            assert!(
                matches!(name.as_str(), "process.rs" | "runtime.rs" | "ack.rs"),
                "{name} settles deliveries"
            );
        }
        if name == "runtime.rs" {
            assert!(!code.contains(".ack().await"), "runtime only gives prefetched deliveries back");
        }
    }
}
