use super::*;

fn utc(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

fn slots(expr: &str, zone: &str, from: &str, to: &str) -> Vec<String> {
    Schedule::parse(expr, Some(zone))
        .unwrap()
        .slots_between(utc(from), utc(to), 1000)
        .into_iter()
        .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
        .collect()
}

// Europe/Berlin 2026: spring forward 29 March 02:00 CET → 03:00 CEST (01:00Z);
// fall back 25 October 03:00 CEST → 02:00 CET (01:00Z).
// America/New_York 2026: spring forward 8 March 02:00 EST → 03:00 EDT (07:00Z);
// fall back 1 November 02:00 EDT → 01:00 EST (06:00Z).

#[test]
fn daily_0230_runs_once_on_both_transition_days() {
    // Spring: 02:30 does not exist; runs once at the transition, 03:00 CEST = 01:00Z.
    assert_eq!(
        slots("30 2 * * *", "Europe/Berlin", "2026-03-28T12:00:00Z", "2026-03-30T12:00:00Z"),
        ["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"]
    );
    // Fall: 02:30 happens twice; runs once, at the first (02:30 CEST = 00:30Z).
    assert_eq!(
        slots("30 2 * * *", "Europe/Berlin", "2026-10-24T12:00:00Z", "2026-10-26T12:00:00Z"),
        ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]
    );
    assert_eq!(
        slots("30 2 * * *", "America/New_York", "2026-03-07T12:00:00Z", "2026-03-09T12:00:00Z"),
        ["2026-03-08T07:00:00Z", "2026-03-09T06:30:00Z"]
    );
    // New York repeats 01:00-02:00; a 01:30 job runs once, at the first (EDT, 05:30Z).
    assert_eq!(
        slots("30 1 * * *", "America/New_York", "2026-10-31T12:00:00Z", "2026-11-02T12:00:00Z"),
        ["2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"]
    );
}

#[test]
fn hourly_runs_at_every_real_hour() {
    // Spring: the hour 02:00-03:00 does not exist; 01:00 CET (00:00Z), then 03:00 CEST (01:00Z).
    assert_eq!(
        slots("0 * * * *", "Europe/Berlin", "2026-03-28T23:30:00Z", "2026-03-29T02:30:00Z"),
        ["2026-03-29T00:00:00Z", "2026-03-29T01:00:00Z", "2026-03-29T02:00:00Z"]
    );
    // Fall: 02:00 CEST (00:00Z) and 02:00 CET (01:00Z) both run.
    assert_eq!(
        slots("0 * * * *", "Europe/Berlin", "2026-10-24T23:30:00Z", "2026-10-25T02:30:00Z"),
        ["2026-10-25T00:00:00Z", "2026-10-25T01:00:00Z", "2026-10-25T02:00:00Z"]
    );
    assert_eq!(
        slots("0 * * * *", "America/New_York", "2026-11-01T04:30:00Z", "2026-11-01T07:30:00Z"),
        ["2026-11-01T05:00:00Z", "2026-11-01T06:00:00Z", "2026-11-01T07:00:00Z"]
    );
}

#[test]
fn every_30_minutes_is_monotonic_through_the_repeated_hour() {
    let s = slots("*/30 * * * *", "Europe/Berlin", "2026-10-24T23:45:00Z", "2026-10-25T02:15:00Z");
    assert_eq!(
        s,
        [
            "2026-10-25T00:00:00Z",
            "2026-10-25T00:30:00Z",
            "2026-10-25T01:00:00Z",
            "2026-10-25T01:30:00Z",
            "2026-10-25T02:00:00Z"
        ]
    );
    let s = slots("*/30 * * * *", "America/New_York", "2026-03-08T06:15:00Z", "2026-03-08T08:15:00Z");
    assert_eq!(
        s,
        ["2026-03-08T06:30:00Z", "2026-03-08T07:00:00Z", "2026-03-08T07:30:00Z", "2026-03-08T08:00:00Z"]
    );
}

#[test]
fn a_year_of_slots_in_both_zones_is_strictly_increasing_without_gaps_or_doubles() {
    for zone in ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe"] {
        for expr in ["*/30 * * * *", "0 * * * *", "30 2 * * *", "15 1 * * *"] {
            let s = Schedule::parse(expr, Some(zone)).unwrap();
            let all = s.slots_between(utc("2026-01-01T00:00:00Z"), utc("2027-01-01T00:00:00Z"), 100_000);
            assert!(all.windows(2).all(|w| w[0] < w[1]), "{zone} {expr}: not strictly increasing");
            if expr.starts_with("30 2") || expr.starts_with("15 1") {
                // Exactly one run per local calendar day.
                let days: std::collections::BTreeSet<_> =
                    all.iter().map(|t| t.with_timezone(&s.zone()).date_naive()).collect();
                assert_eq!(days.len(), all.len(), "{zone} {expr}: a day ran twice");
                assert_eq!(days.len(), 365, "{zone} {expr}: a day was skipped");
            }
        }
    }
}

#[test]
fn seconds_and_macros_parse() {
    let s = Schedule::parse("*/5 * * * * *", None).unwrap();
    assert_eq!(s.next_after(utc("2026-01-01T00:00:01Z")), Some(utc("2026-01-01T00:00:05Z")));
    let d = Schedule::parse("@daily", Some("Europe/Berlin")).unwrap();
    assert_eq!(d.next_after(utc("2026-06-01T12:00:00Z")), Some(utc("2026-06-01T22:00:00Z")));
    assert!(Schedule::parse("61 * * * *", None).is_err());
    assert!(Schedule::parse("* * * * *", Some("Mars/Base")).is_err());
}

/// The four rows of the README's DST table (issue: hour lists and ranges skipped and doubled).
#[test]
fn hour_lists_and_ranges_follow_vixie_cron_in_berlin() {
    // Spring forward: 02:30 does not exist; it runs once at the transition (03:00 CEST).
    assert_eq!(
        slots("30 2,14 * * *", "Europe/Berlin", "2026-03-28T20:00:00Z", "2026-03-29T23:00:00Z"),
        ["2026-03-29T01:00:00Z", "2026-03-29T12:30:00Z"]
    );
    // Fall back: 02:30 happens twice; it runs once, at the first (CEST).
    assert_eq!(
        slots("30 2,14 * * *", "Europe/Berlin", "2026-10-24T20:00:00Z", "2026-10-25T23:00:00Z"),
        ["2026-10-25T00:30:00Z", "2026-10-25T13:30:00Z"]
    );
    assert_eq!(
        slots("0 30 1-3 * * *", "Europe/Berlin", "2026-03-28T20:00:00Z", "2026-03-29T06:00:00Z"),
        ["2026-03-29T00:30:00Z", "2026-03-29T01:00:00Z", "2026-03-29T01:30:00Z"]
    );
    assert_eq!(
        slots("0 30 1-3 * * *", "Europe/Berlin", "2026-10-24T20:00:00Z", "2026-10-25T06:00:00Z"),
        ["2026-10-24T23:30:00Z", "2026-10-25T00:30:00Z", "2026-10-25T02:30:00Z"]
    );
}

#[test]
fn steps_on_a_fixed_start_are_fixed_time() {
    assert_eq!(
        slots("30 0-4/2 * * *", "Europe/Berlin", "2026-03-28T20:00:00Z", "2026-03-29T06:00:00Z"),
        ["2026-03-28T23:30:00Z", "2026-03-29T01:00:00Z", "2026-03-29T02:30:00Z"]
    );
    assert_eq!(
        slots("30 0-4/2 * * *", "Europe/Berlin", "2026-10-24T20:00:00Z", "2026-10-25T06:00:00Z"),
        ["2026-10-24T22:30:00Z", "2026-10-25T00:30:00Z", "2026-10-25T03:30:00Z"]
    );
}

#[test]
fn local_times_in_one_gap_are_one_slot() {
    assert_eq!(
        slots("0,30 2 * * *", "Europe/Berlin", "2026-03-28T20:00:00Z", "2026-03-30T06:00:00Z"),
        ["2026-03-29T01:00:00Z", "2026-03-30T00:00:00Z", "2026-03-30T00:30:00Z"]
    );
    // 02:00 is in the gap and 03:00 is the transition itself: one instant, one key.
    assert_eq!(
        slots("0 2,3 * * *", "Europe/Berlin", "2026-03-28T20:00:00Z", "2026-03-29T12:00:00Z"),
        ["2026-03-29T01:00:00Z"]
    );
}

#[test]
fn a_wildcard_minute_in_a_fixed_hour_runs_at_every_real_instant() {
    // `*/30 2 * * *` is a wildcard job (its minute field starts with `*`): both passes of the
    // repeated hour run, and nothing runs on the night 02:00-03:00 does not exist.
    assert_eq!(
        slots("*/30 2 * * *", "Europe/Berlin", "2026-10-24T20:00:00Z", "2026-10-25T06:00:00Z"),
        ["2026-10-25T00:00:00Z", "2026-10-25T00:30:00Z", "2026-10-25T01:00:00Z", "2026-10-25T01:30:00Z"]
    );
    assert!(
        slots("*/30 2 * * *", "Europe/Berlin", "2026-03-28T20:00:00Z", "2026-03-29T23:59:00Z").is_empty()
    );
}

#[test]
fn thirty_minute_dst_on_lord_howe() {
    // 4 Oct 2026: 02:00 LHST (+10:30) becomes 02:30 LHDT (+11) at 15:30Z on the 3rd.
    assert_eq!(
        slots("15 2 * * *", "Australia/Lord_Howe", "2026-10-03T12:00:00Z", "2026-10-04T23:00:00Z"),
        ["2026-10-03T15:30:00Z", "2026-10-04T15:15:00Z"]
    );
    // 5 Apr 2026: 02:00 LHDT becomes 01:30 LHST at 15:00Z on the 4th; 01:30-02:00 repeats.
    assert_eq!(
        slots("45 1 * * *", "Australia/Lord_Howe", "2026-04-04T12:00:00Z", "2026-04-05T23:00:00Z"),
        ["2026-04-04T14:45:00Z", "2026-04-05T15:15:00Z"]
    );
    assert_eq!(
        slots("*/15 1 * * *", "Australia/Lord_Howe", "2026-04-04T12:00:00Z", "2026-04-04T20:00:00Z"),
        [
            "2026-04-04T14:00:00Z",
            "2026-04-04T14:15:00Z",
            "2026-04-04T14:30:00Z",
            "2026-04-04T14:45:00Z",
            "2026-04-04T15:00:00Z",
            "2026-04-04T15:15:00Z"
        ]
    );
}

#[test]
fn forty_five_minute_offsets_on_chatham() {
    // 27 Sep 2026: 02:45 CHAST (+12:45) becomes 03:45 CHADT (+13:45) at 14:00Z on the 26th.
    assert_eq!(
        slots("0 3 * * *", "Pacific/Chatham", "2026-09-26T12:00:00Z", "2026-09-26T23:00:00Z"),
        ["2026-09-26T14:00:00Z"]
    );
    // 5 Apr 2026: 03:45 CHADT becomes 02:45 CHAST at 14:00Z on the 4th; 03:00 runs at its first.
    assert_eq!(
        slots("0 3 * * *", "Pacific/Chatham", "2026-04-04T12:00:00Z", "2026-04-05T16:00:00Z"),
        ["2026-04-04T13:15:00Z", "2026-04-05T14:15:00Z"]
    );
}

#[test]
fn transitions_at_midnight_in_havana_and_santiago() {
    // Havana, 8 Mar 2026: 00:00 CST (-5) becomes 01:00 CDT (-4) at 05:00Z; Sunday midnight
    // does not exist that week and runs at the transition.
    assert_eq!(
        slots("0 0 * * 0", "America/Havana", "2026-03-07T12:00:00Z", "2026-03-16T00:00:00Z"),
        ["2026-03-08T05:00:00Z", "2026-03-15T04:00:00Z"]
    );
    // Havana, 1 Nov 2026: 01:00 CDT becomes 00:00 CST at 05:00Z; 00:30 runs at its first.
    assert_eq!(
        slots("30 0 * * *", "America/Havana", "2026-10-31T12:00:00Z", "2026-11-02T12:00:00Z"),
        ["2026-11-01T04:30:00Z", "2026-11-02T05:30:00Z"]
    );
    // Santiago, 5 Apr 2026: 24:00 (-3) becomes 23:00 (-4) on Saturday the 4th at 03:00Z.
    assert_eq!(
        slots("30 23 * * *", "America/Santiago", "2026-04-04T12:00:00Z", "2026-04-06T12:00:00Z"),
        ["2026-04-05T02:30:00Z", "2026-04-06T03:30:00Z"]
    );
    // Santiago, 6 Sep 2026: 00:00 (-4) becomes 01:00 (-3) at 04:00Z.
    assert_eq!(
        slots("15 0 * * *", "America/Santiago", "2026-09-05T12:00:00Z", "2026-09-07T12:00:00Z"),
        ["2026-09-06T04:00:00Z", "2026-09-07T03:15:00Z"]
    );
}

#[test]
fn kinds_follow_the_first_character_of_the_time_fields() {
    let kind = |e: &str| Schedule::parse(e, None).unwrap().kind();
    for fixed in
        ["30 2,14 * * *", "0 30 1-3 * * *", "30 1-5/2 * * *", "0 0 2 * * *", "@daily", "@weekly", "0 0 L * *"]
    {
        assert_eq!(kind(fixed), Kind::FixedTime, "{fixed}");
    }
    for wild in ["*/15 * * * *", "0 * * * *", "30 */2 * * *", "*/10 0 2 * * *", "@hourly", "* 2 * * *"] {
        assert_eq!(kind(wild), Kind::Wildcard, "{wild}");
    }
}

#[test]
fn day_fields_combine_as_in_vixie_cron() {
    // Day of month starts with `*`: a day must match both fields (odd days that are Mondays).
    let and = Schedule::parse("0 12 */2 * 1", None).unwrap();
    let got: Vec<_> = and.upcoming(utc("2026-06-01T00:00:00Z"), 3).iter().map(|t| t.to_rfc3339()).collect();
    assert_eq!(got, ["2026-06-01T12:00:00+00:00", "2026-06-15T12:00:00+00:00", "2026-06-29T12:00:00+00:00"]);
    // Neither starts with `*`: either field (odd days, or Mondays).
    let or = Schedule::parse("0 12 1-31/2 * 1", None).unwrap();
    let got: Vec<_> = or.upcoming(utc("2026-06-06T00:00:00Z"), 3).iter().map(|t| t.to_rfc3339()).collect();
    assert_eq!(got, ["2026-06-07T12:00:00+00:00", "2026-06-08T12:00:00+00:00", "2026-06-09T12:00:00+00:00"]);
}

#[test]
fn expressions_that_cannot_be_planned_are_rejected_by_name() {
    for (expr, says) in [
        ("0 0 30 2 *", "never fires"),
        ("0 0 31 4,6 *", "never fires"),
        ("0 0 0 1 1 * 2030", "7 fields"),
        ("0 0 1", "3 fields"),
        ("0 25 * * *", "hour field \"25\""),
        ("0 25 * * *", "expected 0-23"),
        ("60 * * * *", "minute field \"60\""),
        ("0 0 * * 8", "day of week field \"8\""),
        ("0 0 0 32 * *", "day of month field \"32\""),
        ("*/0 * * * *", "minute field \"*/0\": Step cannot be zero (expected 0-59)"),
        ("$ * * * *", "minute field \"$\": illegal character '$' in part '$'"),
        ("61 0 0 * * *", "second field \"61\""),
        ("0 0 * FOO *", "month field \"FOO\""),
        ("@reboot", "not a macro chime knows"),
    ] {
        let e = Schedule::parse(expr, None).unwrap_err().to_string();
        assert!(e.contains(says) && e.contains(expr), "{expr}: {e}");
    }
    let e = Schedule::parse("* * * * *", Some("europe/berlin")).unwrap_err().to_string();
    assert_eq!(e, "\"europe/berlin\" is not an IANA time zone (names are case-sensitive: \"Europe/Berlin\")");
    let e = Schedule::parse("* * * * *", Some("Mars/Base")).unwrap_err().to_string();
    assert_eq!(e, "\"Mars/Base\" is not an IANA time zone");
    assert!(Schedule::parse("0 0 29 2 *", None).is_ok());
    assert!(Schedule::parse("0 0 * 2 1#5", None).is_ok());
}
