//! The documentation holds together: every link resolves inside the repository (anchors
//! included), the configuration and metrics references name exactly what the code has, and
//! the README stays an entry page.

use crate::common::root;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every Markdown file of the repository (not under `target/` or hidden directories).
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name.starts_with('.') || name == "target" || name == "node_modules" {
                continue;
            }
            if path.is_dir() {
                walk(&path, out);
            } else if name.ends_with(".md") {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), &mut out);
    out.sort();
    out
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    prose(text).into_iter().filter(|l| l.starts_with('#')).map(|l| slug(l.trim_start_matches('#'))).collect()
}

/// `(target, line)` of every inline link `[text](target)` in `text`, outside code.
fn links(text: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push((after[..end].to_string(), n + 1));
            rest = &after[end..];
        }
    }
    let prose: BTreeSet<&str> = prose(text).into_iter().collect();
    out.retain(|(_, n)| text.lines().nth(n - 1).is_some_and(|l| prose.contains(l)));
    out
}

#[test]
fn every_link_resolves_inside_the_repository() {
    let root = root().canonicalize().unwrap();
    let mut checked = 0;
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let shown = file.strip_prefix(&root).unwrap_or(&file).display().to_string();
        for line in prose(&text) {
            assert!(!line.contains("../shared/"), "{shown} points at a file outside the repository: {line}");
        }
        for (target, line) in links(&text) {
            if target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            checked += 1;
            let (path, anchor) =
                target.split_once('#').map_or((target.as_str(), None), |(p, a)| (p, Some(a)));
            let dest = if path.is_empty() { file.clone() } else { file.parent().unwrap().join(path) };
            let Ok(dest) = dest.canonicalize() else {
                broken.push(format!("{shown}:{line}: {target} (no such file)"));
                continue;
            };
            if !dest.starts_with(&root) {
                broken.push(format!("{shown}:{line}: {target} (outside the repository)"));
                continue;
            }
            if let Some(anchor) = anchor
                && dest.extension().is_some_and(|e| e == "md")
                && !anchors(&std::fs::read_to_string(&dest).unwrap()).contains(anchor)
            {
                broken.push(format!("{shown}:{line}: {target} (no heading with that anchor)"));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked > 50, "only {checked} links found: the finder is broken");
}

#[test]
fn the_link_checker_finds_broken_links_and_anchors() {
    let text = "# Top\n## A section\nsee [x](#a-section), [y](#nowhere)\n```\n[z](in-code.md)\n```\n";
    assert_eq!(anchors(text), BTreeSet::from(["top".to_string(), "a-section".to_string()]));
    let found: Vec<String> = links(text).into_iter().map(|(t, _)| t).collect();
    assert_eq!(found, ["#a-section", "#nowhere"], "links in code blocks are not links");
    assert_eq!(slug("Scale-out model (issue #13 item 6)"), "scale-out-model-issue-13-item-6");
    assert_eq!(slug("The dashboard: `chime web`"), "the-dashboard-chime-web");
}

/// The keys serde accepts in a table, from its unknown-field error ("expected one of …").
fn accepted_keys(toml: &str) -> Vec<String> {
    let err = chime_shared::Config::from_toml_str(toml).unwrap_err().to_string();
    // serde says "expected one of `a`, `b`", "expected `a` or `b`" or "expected `a`".
    let list = err.split(", expected ").nth(1).unwrap_or_else(|| panic!("no key list in: {err}"));
    list.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// Every key of the config types, as the reference spells it (`amqp.tls.ca_file`,
/// `jobs[].timeout`).
fn config_keys() -> BTreeSet<String> {
    const UNKNOWN: &str = "zz_not_a_key = 1";
    let mut keys = BTreeSet::new();
    let sections: BTreeSet<String> = accepted_keys(UNKNOWN).into_iter().collect();
    for top in &sections {
        match top.as_str() {
            "jobs" => {
                let job = format!("[[jobs]]\nname = \"a\"\nhandler = \"noop\"\n{UNKNOWN}\n");
                for k in accepted_keys(&job) {
                    keys.insert(format!("jobs[].{k}"));
                }
            }
            "limits" => {
                let limit = format!("[[limits]]\nname = \"a\"\nrate = \"1/s\"\n{UNKNOWN}\n");
                for k in accepted_keys(&limit) {
                    keys.insert(format!("limits[].{k}"));
                }
            }
            "circuits" => {
                let circuit = format!("[[circuits]]\nname = \"a\"\nfailures = 1\n{UNKNOWN}\n");
                for k in accepted_keys(&circuit) {
                    keys.insert(format!("circuits[].{k}"));
                }
            }
            "calendars" => {
                let calendar = format!("[[calendars]]\nname = \"a\"\n{UNKNOWN}\n");
                for k in accepted_keys(&calendar) {
                    keys.insert(format!("calendars[].{k}"));
                }
            }
            "prefix" => {
                keys.insert(top.clone());
            }
            section => {
                for k in accepted_keys(&format!("[{section}]\n{UNKNOWN}\n")) {
                    if k == "tls" {
                        for t in accepted_keys(&format!("[{section}.tls]\n{UNKNOWN}\n")) {
                            keys.insert(format!("{section}.tls.{t}"));
                        }
                    } else {
                        keys.insert(format!("{section}.{k}"));
                    }
                }
            }
        }
    }
    keys
}

/// The keys the configuration reference's table documents: the code spans of its first column.
fn documented_keys() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("docs/reference/configuration.md")).unwrap();
    text.lines()
        .filter(|l| l.starts_with("| `"))
        .flat_map(|l| {
            let first = l.split('|').nth(1).unwrap_or_default();
            first.split('`').skip(1).step_by(2).map(str::to_string).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn the_configuration_reference_names_exactly_the_keys_of_the_config_types() {
    let code = config_keys();
    let docs = documented_keys();
    assert!(
        code.len() > 60 && code.contains("jobs[].global_concurrency") && code.contains("amqp.tls.ca_file")
    );
    let undocumented: Vec<_> = code.difference(&docs).collect();
    let unknown: Vec<_> = docs.difference(&code).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "docs/reference/configuration.md is out of step with the config types:\n\
         keys the config accepts but the reference does not document: {undocumented:?}\n\
         keys the reference documents but the config rejects: {unknown:?}"
    );
}

#[test]
fn the_metrics_reference_names_exactly_the_metrics_chime_exports() {
    let text = std::fs::read_to_string(root().join("docs/reference/metrics.md")).unwrap();
    let documented: BTreeSet<&str> =
        text.lines().filter(|l| l.starts_with("| `chime_")).filter_map(|l| l.split('`').nth(1)).collect();
    let exported: BTreeSet<&str> = chime_shared::telemetry::ALL.iter().copied().collect();
    assert_eq!(documented, exported, "docs/reference/metrics.md against telemetry::ALL");
}

#[test]
fn the_readme_is_an_entry_page() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(lines < 250, "README.md has {lines} lines: move detail to docs/");
    for part in ["## Quick start", "## Guarantees", "docs/README.md"] {
        assert!(readme.contains(part), "README.md lacks {part}");
    }
}
