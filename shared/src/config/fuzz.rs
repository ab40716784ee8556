//! Config files as operators (and their editors) get them wrong: the example config, edited at
//! random — lines dropped, doubled or cut, values replaced by values of other types or sizes,
//! bytes inserted — is either accepted (and then valid) or refused with an error that names
//! its place and never echoes the source (which may hold a password). Nothing panics.

use super::Config;
use proptest::prelude::*;

const EXAMPLE: &str = include_str!("../../../examples/chime.toml");
const SECRET: &str = "Sup3rSecretPw";

fn example() -> String {
    EXAMPLE.replace("amqp://guest:guest@", &format!("amqp://guest:{SECRET}@"))
}

#[derive(Debug, Clone)]
enum Edit {
    DropLine(usize),
    DoubleLine(usize),
    CutLine(usize, usize),
    Value(usize, String),
    Insert(usize, String),
    Truncate(usize),
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        proptest::sample::select(vec![
            "0",
            "-1",
            "1e309",
            "99999999999999999999",
            "true",
            "\"\"",
            "\"0s\"",
            "\"-5s\"",
            "\"1y\"",
            "\"999999999d\"",
            "[]",
            "[1, \"a\"]",
            "{}",
            "{ a = 1 }",
            "\"\\u0000\"",
            "\"a\\nb\"",
            "'''x'''",
            "nan",
            "inf",
            "1979-05-27T07:32:00Z",
            "\"* * * * * * *\"",
            "\"Mars/Olympus\"",
            "\"../../etc/passwd\"",
            "\"amqp://u:p@h\"",
            "=",
            "[[",
            "\"",
            // A URL with a password, typed into the wrong key.
            "\"amqp://u:Sup3rSecretPw@h/\"",
            "[\"redis://:Sup3rSecretPw@h\"]",
        ])
        .prop_map(str::to_string),
        "\\PC{0,30}".prop_map(|s| format!("{s:?}")),
        any::<i64>().prop_map(|n| n.to_string()),
    ]
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        1 => (0..200usize).prop_map(Edit::DropLine),
        1 => (0..200usize).prop_map(Edit::DoubleLine),
        1 => (0..200usize, 0..80usize).prop_map(|(l, c)| Edit::CutLine(l, c)),
        4 => (0..200usize, value()).prop_map(|(l, v)| Edit::Value(l, v)),
        1 => (0..8000usize, "\\PC{1,8}|[\\[\\]=\"'#\n]{1,4}").prop_map(|(at, s)| Edit::Insert(at, s)),
        1 => (0..8000usize).prop_map(Edit::Truncate),
    ]
}

fn apply(text: &str, edits: &[Edit]) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    for e in edits {
        let n = lines.len().max(1);
        match e {
            Edit::DropLine(l) if !lines.is_empty() => {
                lines.remove(l % n);
            }
            Edit::DoubleLine(l) if !lines.is_empty() => {
                let line = lines[l % n].clone();
                lines.insert(l % n, line);
            }
            Edit::CutLine(l, c) if !lines.is_empty() => {
                let line = &mut lines[l % n];
                let at = line.char_indices().nth(*c).map_or(line.len(), |(i, _)| i);
                line.truncate(at);
            }
            Edit::Value(l, v) if !lines.is_empty() => {
                let line = &mut lines[l % n];
                if let Some(eq) = line.find('=') {
                    line.replace_range(eq + 1.., &format!(" {v}"));
                }
            }
            Edit::Insert(at, s) => {
                let mut joined = lines.join("\n");
                let at = (0..=joined.len().min(*at)).rev().find(|i| joined.is_char_boundary(*i)).unwrap_or(0);
                joined.insert_str(at, s);
                lines = joined.lines().map(str::to_string).collect();
            }
            Edit::Truncate(at) => {
                let mut joined = lines.join("\n");
                let at = (0..=joined.len().min(*at)).rev().find(|i| joined.is_char_boundary(*i)).unwrap_or(0);
                joined.truncate(at);
                lines = joined.lines().map(str::to_string).collect();
            }
            _ => {}
        }
    }
    lines.join("\n")
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: crate::fuzz_cases(500),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn edited_configs_are_valid_or_refused_by_place(edits in proptest::collection::vec(edit(), 1..6)) {
        let text = apply(&example(), &edits);
        match Config::from_toml_str(&text) {
            Ok(c) => prop_assert!(c.validate().is_ok(), "accepted but invalid"),
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(!msg.contains(SECRET), "the error echoes the password: {msg}");
                prop_assert!(!msg.chars().any(|c| c.is_control() && c != '\n'), "{:?}", msg);
            }
        }
    }

    #[test]
    fn arbitrary_text_is_refused_or_valid(text in "\\PC{0,300}") {
        if let Ok(c) = Config::from_toml_str(&text) {
            prop_assert!(c.validate().is_ok());
        }
    }
}

#[test]
fn the_example_config_is_valid_unedited() {
    Config::from_toml_str(&example()).unwrap();
}
