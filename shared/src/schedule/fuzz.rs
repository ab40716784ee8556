//! Cron expressions and zones as they arrive from a config file or `chime jobs next`: any
//! text is either refused with a one-line reason or gives a schedule whose slots strictly
//! increase. Nothing panics or loops (`CHIME_FUZZ_CASES` raises the case count).

use super::Schedule;
use chrono::{DateTime, Utc};
use proptest::prelude::*;

/// Pieces a cron field is made of, and pieces that break it.
fn token() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(vec![
            "*", "?", "0", "1", "5", "7", "12", "23", "29", "30", "31", "59", "60", "61", "*/0", "*/1", "*/7",
            "*/61", "0-0", "5-1", "1-5", "0-59/15", "L", "5L", "W", "15W", "LW", "1#1", "5#5", "0#6", "MON-FRI",
            "SUN", "JAN", "DEC-JAN", ",", "-", "/", "1,", ",1", "1,,2", "99999999999", "-1", "1.5",
        ])
        .prop_map(str::to_string),
        1 => "[0-9*/,LW#?A-Z-]{1,8}",
    ]
}

fn expression() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::collection::vec(token(), 4..=7).prop_map(|t| t.join(" ")),
        1 => proptest::sample::select(vec!["@daily", "@hourly", "@yearly", "@weekly", "@monthly", "@reboot", "@", "@every 5m"])
            .prop_map(str::to_string),
        1 => "\\PC{0,40}",
        1 => proptest::collection::vec(any::<char>(), 0..30).prop_map(|c| c.into_iter().collect()),
    ]
}

fn zone() -> impl Strategy<Value = Option<String>> {
    proptest::option::of(prop_oneof![
        proptest::sample::select(vec![
            "UTC",
            "Europe/Berlin",
            "America/St_Johns",
            "Australia/Lord_Howe",
            "Asia/Kathmandu",
            "Pacific/Apia",
            "Etc/GMT+12",
            "Europe/berlin",
            "",
            "../etc/passwd"
        ])
        .prop_map(str::to_string),
        "\\PC{0,20}",
    ])
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: crate::fuzz_cases(1_000),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn any_expression_is_refused_or_gives_increasing_slots(
        expr in expression(),
        zone in zone(),
        start in 0i64..4_102_444_800, // 1970 to 2100
    ) {
        match Schedule::parse(&expr, zone.as_deref()) {
            Err(e) => {
                let text = e.to_string();
                // Shown by check-config on a terminal: one line, control characters escaped.
                prop_assert!(!text.chars().any(char::is_control), "{:?}", text);
            }
            Ok(s) => {
                let from = DateTime::<Utc>::from_timestamp(start, 0).unwrap_or_default();
                let slots = s.upcoming(from, 5);
                prop_assert!(slots.windows(2).all(|w| w[0] < w[1]), "{expr:?} in {zone:?}: {slots:?}");
                prop_assert!(slots.first().is_none_or(|t| *t > from), "{expr:?}: {slots:?} after {from}");
                prop_assert_eq!(slots, s.upcoming(from, 5), "deterministic");
            }
        }
    }
}
