//! Schedules on business calendars against an oracle that knows neither croner, the planner's
//! walks nor `Calendar`: for every day of a wide window it matches the expression's fields
//! itself, decides business days from the raw weekday set, holiday and extra-day lists, moves
//! each matching local time onto its day by scanning day by day, and resolves it with
//! `TimeZone::from_local_datetime` (a repeated time at its first pass, a missing one at the
//! first minute that exists). Zones and windows favour DST nights, so rolled slots cross them.

use super::{Business, Rule, Schedule};
use crate::calendar::{Calendar, OnHoliday};
use chrono::{DateTime, Datelike, Duration, LocalResult, NaiveDate, NaiveDateTime, TimeZone, Utc, Weekday};
use chrono_tz::Tz;
use proptest::prelude::*;
use std::collections::BTreeSet;
use std::sync::Arc;

const ZONES: [Tz; 5] =
    [Tz::Europe__Berlin, Tz::America__New_York, Tz::Australia__Lord_Howe, Tz::America__Santiago, Tz::UTC];
/// Days the oracle enumerates before and after the compared window (longer than any run of
/// days off the generated calendars have).
const MARGIN: i64 = 70;

#[derive(Debug, Clone)]
struct Case {
    zone: usize,
    start: NaiveDate,
    minute: u32,
    hours: BTreeSet<u32>,
    /// Day-of-month list, `None` = `*`.
    dom: Option<BTreeSet<u32>>,
    /// Day-of-week list (0 = Sunday), `None` = `*`.
    dow: Option<BTreeSet<u32>>,
    /// Month list, `None` = `*`.
    months: Option<BTreeSet<u32>>,
    weekdays: BTreeSet<u32>,
    holidays: BTreeSet<NaiveDate>,
    extra: BTreeSet<NaiveDate>,
    rule: Rule,
}

fn list(s: &BTreeSet<u32>) -> String {
    s.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

impl Case {
    fn expr(&self) -> String {
        let opt = |f: &Option<BTreeSet<u32>>| f.as_ref().map_or("*".to_string(), list);
        format!(
            "{} {} {} {} {}",
            self.minute,
            list(&self.hours),
            opt(&self.dom),
            opt(&self.months),
            opt(&self.dow)
        )
    }

    fn tz(&self) -> Tz {
        ZONES[self.zone]
    }

    /// Vixie: with either day field `*` a day must match both, otherwise either.
    fn day_matches(&self, d: NaiveDate) -> bool {
        if self.months.as_ref().is_some_and(|m| !m.contains(&d.month())) {
            return false;
        }
        let dom = self.dom.as_ref().map(|s| s.contains(&d.day()));
        let dow = self.dow.as_ref().map(|s| s.contains(&d.weekday().num_days_from_sunday()));
        match (dom, dow) {
            (Some(a), Some(b)) => a || b,
            (a, b) => a.unwrap_or(true) && b.unwrap_or(true),
        }
    }

    fn business(&self, d: NaiveDate) -> bool {
        self.extra.contains(&d)
            || (self.weekdays.contains(&d.weekday().num_days_from_monday()) && !self.holidays.contains(&d))
    }

    /// The day a matching local time on `d` runs on, by scanning day by day.
    fn run_day(&self, d: NaiveDate) -> Option<NaiveDate> {
        let step = |k: i64| match self.rule {
            Rule::OnHoliday(OnHoliday::NextBusinessDay) => Some(d + Duration::days(k)),
            Rule::OnHoliday(OnHoliday::PreviousBusinessDay) => Some(d - Duration::days(k)),
            Rule::OnHoliday(OnHoliday::Skip) => (k == 0).then_some(d),
            Rule::BusinessDay(n) => {
                let month: Vec<NaiveDate> = (1..=31)
                    .filter_map(|day| NaiveDate::from_ymd_opt(d.year(), d.month(), day))
                    .filter(|x| self.business(*x))
                    .collect();
                let pick = if n > 0 {
                    month.get(usize::try_from(n - 1).ok()?).copied()
                } else {
                    month.len().checked_sub(usize::try_from(-n).ok()?).map(|i| month[i])
                };
                (k == 0 && pick == Some(d)).then_some(d)
            }
        };
        (0..=366).map_while(step).find(|x| self.business(*x))
    }

    fn calendar(&self) -> Calendar {
        let weekdays = self.weekdays.iter().map(|w| Weekday::try_from(u8::try_from(*w).unwrap()).unwrap());
        Calendar::new(weekdays)
            .with_holidays(self.holidays.iter().copied())
            .with_extra_working_days(self.extra.iter().copied())
    }
}

fn resolve(tz: Tz, local: NaiveDateTime) -> DateTime<Utc> {
    let mut t = local;
    loop {
        match tz.from_local_datetime(&t) {
            LocalResult::Single(x) | LocalResult::Ambiguous(x, _) => return x.with_timezone(&Utc),
            LocalResult::None => t += Duration::minutes(1),
        }
    }
}

fn oracle(c: &Case, after: DateTime<Utc>, until: DateTime<Utc>) -> Vec<DateTime<Utc>> {
    let tz = c.tz();
    let mut out = BTreeSet::new();
    let mut day = c.start - Duration::days(MARGIN);
    while day <= c.start + Duration::days(30 + MARGIN) {
        if c.day_matches(day)
            && let Some(run) = c.run_day(day)
        {
            for h in &c.hours {
                let at = resolve(tz, run.and_hms_opt(*h, c.minute, 0).unwrap());
                if at > after && at <= until {
                    out.insert(at);
                }
            }
        }
        day += Duration::days(1);
    }
    out.into_iter().collect()
}

fn date_near_transitions() -> impl Strategy<Value = NaiveDate> {
    // Windows of 30 days starting up to 40 days before a March/April or October/November night.
    (2025i32..=2027, prop_oneof![Just(2u32), Just(3), Just(9), Just(10)], 1u32..=28)
        .prop_map(|(y, m, d)| NaiveDate::from_ymd_opt(y, m, d).unwrap())
}

fn case() -> impl Strategy<Value = Case> {
    let hours = proptest::collection::btree_set(prop_oneof![3 => 0u32..=3, 1 => 0u32..24], 1..=3);
    let days = proptest::option::weighted(0.3, proptest::collection::btree_set(1u32..=31, 1..=4));
    let dows = proptest::option::weighted(0.3, proptest::collection::btree_set(0u32..7, 1..=3));
    (
        0..ZONES.len(),
        date_near_transitions(),
        prop_oneof![Just(0u32), Just(30), 0u32..60],
        (hours, proptest::option::weighted(0.3, proptest::collection::btree_set(0u32..2, 1..=2))),
        days,
        dows,
        proptest::collection::btree_set(0u32..7, 2..=7),
        proptest::collection::vec(-40i64..70, 0..12),
        proptest::collection::vec(-40i64..70, 0..3),
        prop_oneof![
            Just(Rule::OnHoliday(OnHoliday::Skip)),
            Just(Rule::OnHoliday(OnHoliday::NextBusinessDay)),
            Just(Rule::OnHoliday(OnHoliday::PreviousBusinessDay)),
            prop_oneof![1i32..=5, -5i32..=-1, 18i32..=23].prop_map(Rule::BusinessDay),
        ],
    )
        .prop_map(|(zone, start, minute, (hours, months), dom, dow, weekdays, holidays, extra, rule)| {
            // The window's month and the next (so the months matter inside it).
            let months = months.map(|m| m.iter().map(|k| (start.month() - 1 + k) % 12 + 1).collect());
            let at = |k: &i64| start + Duration::days(*k);
            let (dom, dow) = if matches!(rule, Rule::BusinessDay(_)) { (None, None) } else { (dom, dow) };
            Case {
                zone,
                start,
                minute,
                hours,
                dom,
                dow,
                months,
                weekdays,
                holidays: holidays.iter().map(at).collect(),
                extra: extra.iter().map(at).collect(),
                rule,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("CHIME_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(300)
    ))]

    /// Thirty days of slots of a fixed-time schedule on a random calendar (skip, rolled either
    /// way, n-th or n-th last business day), in zones with DST, agree with the oracle; and the
    /// ticker's walk is the bare schedule's slots for `skip`, with exactly the others skipped.
    #[test]
    fn calendar_slots_agree_with_a_day_by_day_oracle(c in case()) {
        let tz = c.tz();
        // A day list no listed month has (`31 11`) never fires: refused at parse, no case.
        let Ok(bare) = Schedule::parse(&c.expr(), Some(tz.name())) else { return Ok(()) };
        let business = Business { name: "test".into(), calendar: Arc::new(c.calendar()), rule: c.rule };
        // An index no month reaches is refused up front; nothing else to compare.
        let s = match bare.clone().on_calendar(business) {
            Ok(s) => s,
            Err(_) => return Ok(()),
        };
        let after = resolve(tz, c.start.and_hms_opt(0, 0, 0).unwrap());
        let until = after + Duration::days(30);
        let got = s.slots_between(after, until, 10_000);
        prop_assert_eq!(&got, &oracle(&c, after, until), "{} in {} from {}", c.expr(), tz.name(), c.start);
        if c.rule == Rule::OnHoliday(OnHoliday::Skip) {
            let mut ticks = Vec::new();
            let mut t = after;
            while let Some(n) = s.next_tick(t).filter(|n| *n <= until) {
                ticks.push(n);
                t = n;
            }
            prop_assert_eq!(&ticks, &bare.slots_between(after, until, 10_000));
            let runs: Vec<_> = ticks.iter().copied().filter(|t| s.skipped(*t).is_none()).collect();
            prop_assert_eq!(runs, got);
        }
    }
}

#[test]
fn a_payroll_calendar_rolls_and_explains_its_slots() {
    let d = |s: &str| s.parse::<NaiveDate>().unwrap();
    let t = |s: &str| s.parse::<DateTime<Utc>>().unwrap();
    // London, Monday to Friday, Christmas and Boxing Day (observed on Monday 28th) off.
    let cal = Arc::new(Calendar::default().with_holidays([d("2026-12-25"), d("2026-12-28")]));
    let on = |expr: &str, rule| {
        Schedule::parse(expr, Some("Europe/London")).unwrap().on_calendar(Business {
            name: "uk".into(),
            calendar: cal.clone(),
            rule,
        })
    };
    let from = t("2026-12-20T00:00:00Z");
    let until = t("2027-01-02T00:00:00Z");
    // 09:00 every day, rolled forward: the weekend and both holidays run on Tuesday 29th, once.
    let next = on("0 9 * * *", Rule::OnHoliday(OnHoliday::NextBusinessDay)).unwrap();
    let days: Vec<String> =
        next.slots_between(from, until, 100).iter().map(|s| s.format("%d %H:%M").to_string()).collect();
    assert_eq!(
        days,
        ["21 09:00", "22 09:00", "23 09:00", "24 09:00", "29 09:00", "30 09:00", "31 09:00", "01 09:00"]
    );
    let moved = next.moved_between(from, until, 100);
    let to_29: Vec<String> = moved
        .iter()
        .filter(|m| m.to == Some(t("2026-12-29T09:00:00Z")))
        .map(|m| format!("{} {}", m.from.format("%d"), m.closed.as_str()))
        .collect();
    assert_eq!(to_29, ["25 holiday", "26 not_working_day", "27 not_working_day", "28 holiday"]);
    // The 25th of each month, on the business day before when it is a holiday or weekend.
    let pay = on("30 2 25 * *", Rule::OnHoliday(OnHoliday::PreviousBusinessDay)).unwrap();
    assert_eq!(pay.next_after(from), Some(t("2026-12-24T02:30:00Z")));
    // The last business day of each month at 17:00; skipped slots are ticks of their own.
    let last = on("0 17 * * *", Rule::BusinessDay(-1)).unwrap();
    assert_eq!(last.next_after(from), Some(t("2026-12-31T17:00:00Z")));
    assert_eq!(last.next_after(t("2026-12-31T17:00:00Z")), Some(t("2027-01-29T17:00:00Z")));
    // Quarter ends: the months from the schedule, the day from the calendar (31 March 2027 is
    // a Wednesday, in summer time: 16:00Z).
    let quarters = on("0 17 * 3,6,9,12 *", Rule::BusinessDay(-1)).unwrap();
    assert_eq!(quarters.next_after(t("2027-01-01T00:00:00Z")), Some(t("2027-03-31T16:00:00Z")));
    assert_eq!(quarters.next_after(t("2027-03-31T16:00:00Z")), Some(t("2027-06-30T16:00:00Z")));
    let skip = on("0 9 * * *", Rule::OnHoliday(OnHoliday::Skip)).unwrap();
    assert_eq!(skip.next_after(t("2026-12-24T10:00:00Z")), Some(t("2026-12-29T09:00:00Z")));
    assert_eq!(skip.next_tick(t("2026-12-24T10:00:00Z")), Some(t("2026-12-25T09:00:00Z")));
    assert_eq!(skip.skipped(t("2026-12-25T09:00:00Z")), Some(super::Closed::Holiday));
    assert_eq!(skip.skipped(t("2026-12-26T09:00:00Z")), Some(super::Closed::NotWorkingDay));
    assert_eq!(skip.skipped(t("2026-12-29T09:00:00Z")), None);
    // Refused by name of the problem.
    let e = on("*/15 * * * *", Rule::OnHoliday(OnHoliday::NextBusinessDay)).unwrap_err();
    assert!(e.contains("fixed-time schedule"), "{e}");
    let e = on("0 17 1 * *", Rule::BusinessDay(-1)).unwrap_err();
    assert!(e.contains("day-of-month and day-of-week"), "{e}");
    let e = on("0 17 * * *", Rule::BusinessDay(24)).unwrap_err();
    assert!(e.contains("can never match"), "{e}");
    let e = on("0 17 * * *", Rule::BusinessDay(0)).unwrap_err();
    assert!(e.contains("not 0"), "{e}");
}
