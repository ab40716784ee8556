use super::*;
use proptest::prelude::*;
use std::collections::HashSet;

fn d(s: &str) -> NaiveDate {
    NaiveDate::parse_from_str(s, "%Y-%m-%d").unwrap()
}

/// Germany-ish: weekdays, New Year and Christmas every year, Good Friday 2026 listed, a
/// Saturday made a working day.
fn calendar() -> Calendar {
    Calendar::default()
        .with_holidays([d("2026-04-03")])
        .with_yearly([
            Yearly { month: 1, day: 1, from: 2000, until: None },
            Yearly { month: 12, day: 25, from: 2000, until: None },
            Yearly { month: 12, day: 26, from: 2000, until: Some(d("2026-12-31")) },
        ])
        .with_extra_working_days([d("2026-12-19")])
}

#[test]
fn business_days_roll_and_count_as_a_payroll_clerk_would() {
    let c = calendar();
    assert!(c.is_business_day(d("2026-12-04"))); // a Friday
    assert!(!c.is_business_day(d("2026-12-05"))); // Saturday
    assert!(c.is_business_day(d("2026-12-19"))); // a Saturday made a working day
    assert!(!c.is_business_day(d("2026-12-25")) && c.is_holiday(d("2026-12-25")));
    assert!(c.is_business_day(d("2027-12-27")), "the 26 December rule ended in 2026 (a Monday in 2027)");
    // Christmas 2026 is a Friday, then a weekend: the next business day is Monday the 28th.
    assert_eq!(c.roll(d("2026-12-25"), OnHoliday::NextBusinessDay), Some(d("2026-12-28")));
    assert_eq!(c.roll(d("2026-12-25"), OnHoliday::PreviousBusinessDay), Some(d("2026-12-24")));
    assert_eq!(c.roll(d("2026-12-25"), OnHoliday::Skip), None);
    assert_eq!(c.roll(d("2026-12-04"), OnHoliday::Skip), Some(d("2026-12-04")));
    // January 2027: the 1st is a holiday (a Friday), so the first business day is Monday the 4th.
    assert_eq!(c.business_day_of_month(2027, 1, 1), Some(d("2027-01-04")));
    assert_eq!(c.business_day_of_month(2026, 12, -1), Some(d("2026-12-31")));
    assert_eq!(c.business_day_of_month(2026, 4, 2), Some(d("2026-04-02")), "Good Friday the 3rd is out");
    assert_eq!(c.business_day_of_month(2026, 4, 3), Some(d("2026-04-06")));
    assert_eq!(c.business_day_of_month(2026, 2, 25), None, "February has 20 business days");
    assert_eq!(c.business_day_of_month(2026, 2, 0), None);
    assert_eq!(c.business_day_of_month(2026, 13, 1), None);
    // No working weekday and no extra day: nothing to roll onto.
    let none = Calendar::new([]);
    assert!(!none.has_working_weekday());
    assert_eq!(none.roll(d("2026-12-25"), OnHoliday::NextBusinessDay), None);
    assert_eq!(none.business_day_of_month(2026, 12, -1), None);
}

const ICS: &str = "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//test//EN\r\n\
BEGIN:VEVENT\r\nUID:1\r\nDTSTART;VALUE=DATE:20261225\r\nDTEND;VALUE=DATE:20261227\r\n\
RRULE:FREQ=YEARLY;UNTIL=20281231\r\nSUMMARY:Christmas\r\nEND:VEVENT\r\n\
BEGIN:VEVENT\r\nUID:2\r\nDTSTART;VALUE=DATE:20260403\r\nSUMMARY:Good Friday, a long\r\n  summary folded\r\nEND:VEVENT\r\n\
BEGIN:VEVENT\r\nUID:3\r\nDTSTART:20270101\r\nRRULE:FREQ=YEARLY;COUNT=2\r\nEND:VEVENT\r\n\
END:VCALENDAR\r\n";

#[test]
fn an_ics_file_gives_its_all_day_and_yearly_holidays() {
    let (dates, rules) = parse_ics(ICS).unwrap();
    assert_eq!(dates, [d("2026-04-03")]);
    let c = Calendar::default().with_holidays(dates).with_yearly(rules);
    for h in ["2026-12-25", "2028-12-25", "2027-01-01", "2028-01-01"] {
        assert!(c.is_holiday(d(h)), "{h}");
    }
    assert!(c.is_holiday(d("2027-12-26")), "DTEND is exclusive: the 25th and 26th");
    assert!(!c.is_holiday(d("2027-12-27")));
    assert!(!c.is_holiday(d("2029-12-25")), "UNTIL 2028");
    assert!(!c.is_holiday(d("2029-01-01")), "COUNT=2: 2027 and 2028");
    assert!(!c.is_holiday(d("2025-12-25")), "not before its first year");
}

#[test]
fn an_ics_file_that_says_something_else_is_refused_by_line() {
    let cases = [
        ("VERSION:2.0\n", 1, "BEGIN:VCALENDAR"),
        (
            "BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART:20261225T090000Z\nEND:VEVENT\nEND:VCALENDAR\n",
            3,
            "time of day",
        ),
        (
            "BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART;VALUE=DATE:20261325\nEND:VEVENT\nEND:VCALENDAR\n",
            3,
            "DTSTART",
        ),
        (
            "BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART;VALUE=DATE:20261225\nRRULE:FREQ=WEEKLY\nEND:VEVENT\nEND:VCALENDAR\n",
            4,
            "FREQ=WEEKLY",
        ),
        (
            "BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART;VALUE=DATE:20260525\nRRULE:FREQ=YEARLY;BYDAY=-1MO\nEND:VEVENT\nEND:VCALENDAR\n",
            4,
            "BYDAY",
        ),
        ("BEGIN:VCALENDAR\nBEGIN:VEVENT\nSUMMARY:x\nEND:VEVENT\nEND:VCALENDAR\n", 2, "without DTSTART"),
        (
            "BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART;VALUE=DATE:20261225\nDTEND;VALUE=DATE:20261225\nEND:VEVENT\nEND:VCALENDAR\n",
            4,
            "not after",
        ),
        (
            "BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART;VALUE=DATE:20261225\nEXDATE;VALUE=DATE:20271225\nEND:VEVENT\nEND:VCALENDAR\n",
            4,
            "EXDATE",
        ),
        ("BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART;VALUE=DATE:20261225\n", 2, "without END:VEVENT"),
        ("BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART;VALUE=DATE:20261225\nEND:VEVENT\n", 4, "cut off"),
        ("BEGIN:VCALENDAR\nthis is not a content line\nEND:VCALENDAR\n", 2, "NAME:VALUE"),
    ];
    for (text, line, needle) in cases {
        let e = parse_ics(text).expect_err(text);
        assert_eq!(e.line, line, "{text:?}: {e}");
        assert!(e.to_string().contains(needle), "{text:?}: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// An independent oracle: the calendar's rule written out over an explicit set of days.

#[derive(Debug, Clone)]
struct Spec {
    weekdays: Vec<u32>,
    holidays: Vec<NaiveDate>,
    yearly: Vec<(u32, u32, i32, Option<NaiveDate>)>,
    extra: Vec<NaiveDate>,
}

/// Every business day from 2024 to 2030, enumerated from the spec's raw parts.
fn oracle_days(s: &Spec) -> HashSet<NaiveDate> {
    let mut off: HashSet<NaiveDate> = s.holidays.iter().copied().collect();
    for (m, day, from, until) in &s.yearly {
        for y in 2024..=2030 {
            if let Some(date) = NaiveDate::from_ymd_opt(y, *m, *day)
                && y >= *from
                && until.is_none_or(|u| date <= u)
            {
                off.insert(date);
            }
        }
    }
    let mut out = HashSet::new();
    let mut day = NaiveDate::from_ymd_opt(2024, 1, 1).unwrap();
    while day.year() <= 2030 {
        let weekday = day.weekday().num_days_from_monday();
        if s.extra.contains(&day) || (s.weekdays.contains(&weekday) && !off.contains(&day)) {
            out.insert(day);
        }
        day = day.succ_opt().unwrap();
    }
    out
}

fn day_in(years: std::ops::RangeInclusive<i32>) -> impl Strategy<Value = NaiveDate> {
    (years, 1u32..=12, 1u32..=31).prop_filter_map("a real date", |(y, m, d)| NaiveDate::from_ymd_opt(y, m, d))
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        proptest::collection::btree_set(0u32..7, 0..=7),
        proptest::collection::vec(day_in(2026..=2028), 0..60),
        proptest::collection::vec(
            (1u32..=12, 1u32..=31, 2024i32..=2028, proptest::option::of(day_in(2026..=2029))),
            0..8,
        ),
        proptest::collection::vec(day_in(2026..=2028), 0..6),
    )
        .prop_map(|(w, holidays, yearly, extra)| Spec {
            weekdays: w.into_iter().collect(),
            holidays,
            yearly,
            extra,
        })
}

fn build(s: &Spec) -> Calendar {
    let weekdays = s.weekdays.iter().map(|w| Weekday::try_from(u8::try_from(*w).unwrap()).unwrap());
    Calendar::new(weekdays)
        .with_holidays(s.holidays.iter().copied())
        .with_yearly(s.yearly.iter().map(|(month, day, from, until)| Yearly {
            month: *month,
            day: *day,
            from: *from,
            until: *until,
        }))
        .with_extra_working_days(s.extra.iter().copied())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("CHIME_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(300)
    ))]

    /// Rolls and the n-th business day of a month agree with a brute-force enumeration of the
    /// calendar's days, for random weekdays (none included), holidays, yearly rules and extra
    /// working days.
    #[test]
    fn the_planner_agrees_with_an_enumeration_of_the_days(
        s in spec(),
        day in day_in(2026..=2028),
        n in prop_oneof![1i32..=25, -25i32..=-1],
    ) {
        let c = build(&s);
        let days = oracle_days(&s);
        prop_assert_eq!(c.is_business_day(day), days.contains(&day));
        // Within a year, as the planner looks; a day with none within a year is None.
        let next = (0..=366).map(|k| day + chrono::Duration::days(k)).find(|x| days.contains(x));
        let prev = (0..=366).map(|k| day - chrono::Duration::days(k)).find(|x| days.contains(x));
        prop_assert_eq!(c.roll(day, OnHoliday::NextBusinessDay), next);
        prop_assert_eq!(c.roll(day, OnHoliday::PreviousBusinessDay), prev);
        prop_assert_eq!(c.roll(day, OnHoliday::Skip), days.contains(&day).then_some(day));
        let mut month: Vec<NaiveDate> = days
            .iter()
            .copied()
            .filter(|x| x.year() == day.year() && x.month() == day.month())
            .collect();
        month.sort();
        let want = if n > 0 {
            month.get(usize::try_from(n - 1).unwrap()).copied()
        } else {
            month.len().checked_sub(usize::try_from(-n).unwrap()).map(|i| month[i])
        };
        prop_assert_eq!(c.business_day_of_month(day.year(), day.month(), n), want);
    }
}
