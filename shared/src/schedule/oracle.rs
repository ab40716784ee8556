//! An independent oracle for the planner, and property tests that compare the two.
//!
//! The oracle knows nothing of croner or of the planner's walks. It is the rule written out
//! by brute force over chrono-tz's zone data: enumerate every local wall-clock time of a
//! window (each minute, or each second for six-field expressions), match it against the
//! expression's fields with its own matcher, and resolve each match with
//! `TimeZone::from_local_datetime`:
//! - a time that exists once runs then;
//! - a time that exists twice runs at the first pass, and for a wildcard job at the second too;
//! - a time that does not exist runs, for a fixed-time job only, at the first instant whose wall
//!   clock is later (found by stepping forward, minute then second).
//!
//! Expressions are generated around real offset transitions of tzdb zones between 2020 and
//! 2040: hours, minutes, days, months and weekdays favour the transition's own, so most cases
//! cross a gap or a repeated hour. CI runs a sample (`CHIME_DST_CASES`, default 400, over the
//! zones named below plus a seeded draw of the rest); `exhaustive_every_zone_and_year` (ignored;
//! run it with `cargo test --release -p chime-shared exhaustive -- --ignored --nocapture`) covers
//! every transition of every zone.

use super::Schedule;
use chrono::{
    DateTime, Datelike, Duration, LocalResult, NaiveDate, NaiveDateTime, Offset, TimeZone, Timelike, Utc,
};
use chrono_tz::{TZ_VARIANTS, Tz};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use std::collections::BTreeSet;

// ---------------------------------------------------------------------------------------------
// Expressions: text for the planner, value sets for the oracle.

#[derive(Debug, Clone)]
struct Field {
    text: String,
    values: BTreeSet<u32>,
}

#[derive(Debug, Clone)]
struct Days {
    field: Field,
    last: bool,
}

#[derive(Debug, Clone)]
struct Weekdays {
    field: Field,
    /// `d#n`: the n-th weekday d of the month.
    nth: Vec<(u32, u32)>,
    /// `dL`: the last weekday d of the month.
    last: Vec<u32>,
}

#[derive(Debug, Clone)]
struct Expr {
    seconds: Option<Field>,
    minute: Field,
    hour: Field,
    dom: Days,
    month: Field,
    dow: Weekdays,
}

impl Expr {
    fn text(&self) -> String {
        let mut parts = Vec::new();
        if let Some(s) = &self.seconds {
            parts.push(s.text.clone());
        }
        parts.extend(
            [
                &self.minute.text,
                &self.hour.text,
                &self.dom.field.text,
                &self.month.text,
                &self.dow.field.text,
            ]
            .map(String::clone),
        );
        parts.join(" ")
    }

    /// The rule: a wildcard job is one whose seconds, minute or hour field starts with `*`.
    fn wildcard(&self) -> bool {
        self.seconds.iter().chain([&self.minute, &self.hour]).any(|f| f.text.starts_with('*'))
    }

    fn matches(&self, t: NaiveDateTime) -> bool {
        let second_ok = match &self.seconds {
            Some(s) => s.values.contains(&t.second()),
            None => t.second() == 0,
        };
        if !(second_ok
            && self.minute.values.contains(&t.minute())
            && self.hour.values.contains(&t.hour())
            && self.month.values.contains(&t.month()))
        {
            return false;
        }
        let (day, len) = (t.day(), days_in_month(t.date()));
        let wd = t.weekday().num_days_from_sunday();
        let dom_ok = self.dom.field.values.contains(&day) || (self.dom.last && day == len);
        let dow_ok = self.dow.field.values.contains(&wd)
            || self.dow.nth.contains(&(wd, (day - 1) / 7 + 1))
            || (self.dow.last.contains(&wd) && day + 7 > len);
        // Vixie cron: if either day field starts with `*`, a day must match both; else either.
        if self.dom.field.text.starts_with('*') || self.dow.field.text.starts_with('*') {
            dom_ok && dow_ok
        } else {
            dom_ok || dow_ok
        }
    }
}

impl Expr {
    /// Whether any day from 2000 to 2399 (one Gregorian cycle) matches the day fields.
    fn fires_on_some_day(&self) -> bool {
        let noon = |d: NaiveDate| d.and_hms_opt(12, 0, 0);
        let mut day = NaiveDate::from_ymd_opt(2000, 1, 1);
        while let Some(d) = day.filter(|d| d.year() < 2400) {
            // The time fields always hold a value; try the day with the first of each.
            let first = |f: &Field| f.values.first().copied().unwrap_or(0);
            let at = noon(d).and_then(|t| {
                t.with_hour(first(&self.hour))?
                    .with_minute(first(&self.minute))?
                    .with_second(self.seconds.as_ref().map_or(0, first))
            });
            if at.is_some_and(|t| self.matches(t)) {
                return true;
            }
            day = d.succ_opt();
        }
        false
    }
}

fn days_in_month(d: NaiveDate) -> u32 {
    let (y, m) = (d.year(), d.month());
    let next =
        if m == 12 { NaiveDate::from_ymd_opt(y + 1, 1, 1) } else { NaiveDate::from_ymd_opt(y, m + 1, 1) };
    next.and_then(|n| n.pred_opt()).map_or(31, |l| l.day())
}

// ---------------------------------------------------------------------------------------------
// The oracle.

/// Slots in `(after, until]` by the rule, by brute force over local wall-clock times.
fn oracle(expr: &Expr, tz: Tz, after: DateTime<Utc>, until: DateTime<Utc>) -> Vec<DateTime<Utc>> {
    let step = if expr.seconds.is_some() { Duration::seconds(1) } else { Duration::minutes(1) };
    // Every instant of the window has its wall clock within these bounds (no transition moves
    // a clock by more than three hours).
    let wall = |t: DateTime<Utc>| t.with_timezone(&tz).naive_local();
    let mut local = truncate_to_minute(wall(after) - Duration::hours(3));
    let end = wall(until) + Duration::hours(3);
    let wildcard = expr.wildcard();
    let mut out = Vec::new();
    while local <= end {
        if expr.matches(local) {
            match tz.from_local_datetime(&local) {
                LocalResult::Single(x) => out.push(x.with_timezone(&Utc)),
                LocalResult::Ambiguous(first, second) => {
                    out.push(first.with_timezone(&Utc));
                    if wildcard {
                        out.push(second.with_timezone(&Utc));
                    }
                }
                LocalResult::None if !wildcard => out.push(first_instant_after_gap(tz, local)),
                LocalResult::None => {}
            }
        }
        local += step;
    }
    out.retain(|t| *t > after && *t <= until);
    out.sort();
    out.dedup();
    out
}

fn truncate_to_minute(t: NaiveDateTime) -> NaiveDateTime {
    t.with_second(0).and_then(|t| t.with_nanosecond(0)).unwrap_or(t)
}

/// The first instant whose wall clock reads a time after `local`, which does not exist.
fn first_instant_after_gap(tz: Tz, local: NaiveDateTime) -> DateTime<Utc> {
    let exists = |t: NaiveDateTime| tz.from_local_datetime(&t).earliest();
    let mut minute = truncate_to_minute(local) + Duration::minutes(1);
    while exists(minute).is_none() {
        minute += Duration::minutes(1);
    }
    let mut second = (minute - Duration::seconds(59)).max(local);
    loop {
        if let Some(t) = exists(second) {
            return t.with_timezone(&Utc);
        }
        second += Duration::seconds(1);
    }
}

// ---------------------------------------------------------------------------------------------
// Zones and their transitions.

fn offset(tz: Tz, t: DateTime<Utc>) -> i32 {
    tz.offset_from_utc_datetime(&t.naive_utc()).fix().local_minus_utc()
}

fn utc(y: i32, m: u32, d: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, m, d, 0, 0, 0).single().unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// Zones whose UTC offset changes between 2020 and 2040, by a probe on the 1st and 15th of
/// every month (every DST period lasts weeks).
fn zones_with_transitions() -> Vec<Tz> {
    TZ_VARIANTS
        .iter()
        .copied()
        .filter(|tz| {
            let first = offset(*tz, utc(2020, 1, 1));
            (2020..=2040)
                .any(|y| (1..=12).any(|m| [1, 15].iter().any(|d| offset(*tz, utc(y, m, *d)) != first)))
        })
        .collect()
}

/// Every offset transition of `tz` in `year`, to the second: a probe every 6 hours, then
/// bisection.
fn transitions(tz: Tz, year: i32) -> Vec<DateTime<Utc>> {
    let mut out = Vec::new();
    let (mut lo, end) = (utc(year, 1, 1).timestamp(), utc(year + 1, 1, 1).timestamp());
    let at = |s: i64| DateTime::from_timestamp(s, 0).unwrap_or(DateTime::<Utc>::MIN_UTC);
    while lo < end {
        let hi = lo + 6 * 3600;
        let before = offset(tz, at(lo));
        if offset(tz, at(hi)) != before {
            let (mut a, mut b) = (lo, hi);
            while b - a > 1 {
                let mid = a + (b - a) / 2;
                if offset(tz, at(mid)) == before { a = mid } else { b = mid }
            }
            out.push(at(b));
        }
        lo = hi;
    }
    out
}

/// One transition to test around, with what the generator should favour.
#[derive(Debug, Clone)]
struct Window {
    tz: Tz,
    at: DateTime<Utc>,
}

impl Window {
    /// Wall-clock times on both sides of the transition.
    fn walls(&self) -> [NaiveDateTime; 2] {
        let before = self.at - Duration::seconds(1);
        [before, self.at].map(|t| t.with_timezone(&self.tz).naive_local())
    }
}

fn windows(zones: &[Tz], years: std::ops::RangeInclusive<i32>) -> Vec<Window> {
    zones
        .iter()
        .flat_map(|tz| {
            years
                .clone()
                .flat_map(move |y| transitions(*tz, y).into_iter().map(move |at| Window { tz: *tz, at }))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Generators.

/// One list item of a numeric field over `lo..=hi`: a value, a range or a stepped range,
/// favouring the `hot` values.
fn item(lo: u32, hi: u32, hot: Vec<u32>) -> impl Strategy<Value = (String, BTreeSet<u32>)> {
    let value = prop_oneof![3 => proptest::sample::select(hot), 1 => lo..=hi];
    let single = value.clone().prop_map(|v| (v.to_string(), BTreeSet::from([v])));
    let range = (value.clone(), 0..=4u32).prop_map(move |(a, len)| {
        let b = (a + len).min(hi);
        (format!("{a}-{b}"), (a..=b).collect())
    });
    let stepped = (value, 1..=6u32, 2..=4u32).prop_map(move |(a, len, step)| {
        let b = (a + len * step).min(hi);
        (format!("{a}-{b}/{step}"), (a..=b).step_by(step as usize).collect())
    });
    prop_oneof![3 => single, 2 => range, 1 => stepped]
}

/// A numeric field: `*`, `*/n`, or a list of one to three items.
fn field(lo: u32, hi: u32, hot: Vec<u32>, star_weight: u32, steps: Vec<u32>) -> impl Strategy<Value = Field> {
    let star = Just(Field { text: "*".into(), values: (lo..=hi).collect() });
    let star_step = proptest::sample::select(steps)
        .prop_map(move |n| Field { text: format!("*/{n}"), values: (lo..=hi).step_by(n as usize).collect() });
    let list = proptest::collection::vec(item(lo, hi, hot), 1..=3).prop_map(|items| Field {
        text: items.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>().join(","),
        values: items.into_iter().flat_map(|(_, v)| v).collect(),
    });
    prop_oneof![star_weight => star, 1 => star_step, 4 => list]
}

fn days(hot: u32) -> impl Strategy<Value = Days> {
    let plain = field(1, 31, vec![hot, hot.saturating_sub(1).max(1), (hot + 1).min(31)], 8, vec![2, 3, 7])
        .prop_map(|field| Days { field, last: false });
    let last = (Just(()), proptest::option::of(Just(hot))).prop_map(|((), extra)| match extra {
        Some(d) => Days { field: Field { text: format!("{d},L"), values: BTreeSet::from([d]) }, last: true },
        None => Days { field: Field { text: "L".into(), values: BTreeSet::new() }, last: true },
    });
    prop_oneof![6 => plain, 1 => last]
}

fn weekdays(hot: u32) -> impl Strategy<Value = Weekdays> {
    // In a range 7 is Sunday again (croner and Vixie both accept `5-7`).
    let plain =
        field(0, 7, vec![hot, if hot == 0 { 7 } else { hot }], 8, vec![2, 3]).prop_map(|mut field| {
            if field.values.remove(&7) {
                field.values.insert(0);
            }
            Weekdays { field, nth: vec![], last: vec![] }
        });
    let nth = (prop_oneof![Just(hot), 0..=6u32], 1..=5u32).prop_map(|(d, n)| Weekdays {
        field: Field { text: format!("{d}#{n}"), values: BTreeSet::new() },
        nth: vec![(d, n)],
        last: vec![],
    });
    let last = prop_oneof![Just(hot), 0..=6u32].prop_map(|d| Weekdays {
        field: Field { text: format!("{d}L"), values: BTreeSet::new() },
        nth: vec![],
        last: vec![d],
    });
    prop_oneof![6 => plain, 1 => nth, 1 => last]
}

/// Expressions aimed at one transition: its wall-clock hours, minutes, day, month, weekday.
fn expr_near(w: &Window) -> impl Strategy<Value = Expr> + use<> {
    let walls = w.walls();
    let mut hours: Vec<u32> = walls.iter().map(|t| t.hour()).collect();
    hours.extend(walls.iter().map(|t| (t.hour() + 23) % 24));
    let mut minutes: Vec<u32> = walls.iter().flat_map(|t| [t.minute(), (t.minute() + 59) % 60]).collect();
    minutes.extend([0, 15, 30, 45]);
    let day = walls[1].day();
    let month = walls[1].month();
    let wd = walls[1].weekday().num_days_from_sunday();
    (
        proptest::option::weighted(0.25, field(0, 59, vec![0, 30, 59], 3, vec![15, 20, 30])),
        field(0, 59, minutes, 2, vec![5, 10, 15, 20, 30]),
        field(0, 23, hours, 2, vec![2, 3, 4, 6]),
        days(day),
        field(1, 12, vec![month], 6, vec![2, 3]),
        weekdays(wd),
    )
        .prop_map(|(seconds, minute, hour, dom, month, dow)| Expr {
            seconds,
            minute,
            hour,
            dom,
            month,
            dow,
        })
}

// ---------------------------------------------------------------------------------------------
// The properties.

/// Compares planner and oracle around `w` and checks the planner's own properties; `salt`
/// picks where a restart is simulated.
fn check(w: &Window, expr: &Expr, salt: u64) -> Result<usize, TestCaseError> {
    let text = expr.text();
    let schedule = match Schedule::parse(&text, Some(w.tz.name())) {
        Ok(s) => s,
        // A rejection is right only if no day of a whole 400-year cycle matches.
        Err(e) if e.to_string().contains("never fires") && !expr.fires_on_some_day() => return Ok(0),
        Err(e) => return Err(TestCaseError::fail(format!("{text}: {e}"))),
    };
    let span = if expr.seconds.is_some() { Duration::hours(3) } else { Duration::hours(30) };
    let (after, until) = (w.at - span, w.at + span);
    let planned = schedule.slots_between(after, until, 1_000_000);
    let expected = oracle(expr, w.tz, after, until);
    if planned != expected {
        // Show the neighbourhood of the first difference, not thousands of slots.
        let first = planned.iter().zip(&expected).take_while(|(a, b)| a == b).count();
        let show = |v: &[DateTime<Utc>]| {
            let near = &v[first.saturating_sub(2).min(v.len())..(first + 4).min(v.len())];
            let near: Vec<_> = near.iter().map(|t| t.format("%m-%dT%H:%M:%SZ").to_string()).collect();
            format!("{} slots; from #{}: {}", v.len(), first.saturating_sub(2), near.join(" "))
        };
        return Err(TestCaseError::fail(format!(
            "{} {text:?} around {} ({}):\n planner: {}\n oracle:  {}",
            w.tz.name(),
            w.at,
            if expr.wildcard() { "wildcard" } else { "fixed-time" },
            show(&planned),
            show(&expected)
        )));
    }
    prop_assert!(planned.windows(2).all(|p| p[0] < p[1]), "{text}: not strictly increasing");
    if !expr.wildcard() {
        // Never two slots (two keys) for one local slot.
        let walls: BTreeSet<_> = planned.iter().map(|t| t.with_timezone(&w.tz).naive_local()).collect();
        prop_assert_eq!(walls.len(), planned.len(), "{}: a local time ran twice", text);
    }
    // A ticker that restarts (or a standby that takes over) from any watermark, a slot or
    // any instant in between, plans the same slots after it.
    if !planned.is_empty() {
        let k = (salt as usize) % planned.len();
        prop_assert_eq!(&schedule.slots_between(planned[k], until, 1_000_000)[..], &planned[k + 1..]);
        let cut = after + Duration::seconds((salt % (2 * span.num_seconds() as u64)) as i64);
        let rest: Vec<_> = planned.iter().copied().filter(|t| *t > cut).collect();
        prop_assert_eq!(schedule.slots_between(cut, until, 1_000_000), rest);
    }
    Ok(planned.len())
}

/// Zones every CI run covers: 30-minute DST, 45-minute offsets, transitions at midnight, the
/// southern hemisphere, negative DST, a two-hour DST and a Ramadan suspension.
const NAMED: &[&str] = &[
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "America/Havana",
    "America/Santiago",
    "Australia/Sydney",
    "Pacific/Auckland",
    "Europe/Dublin",
    "America/St_Johns",
    "Antarctica/Troll",
    "Africa/Casablanca",
    "Asia/Tehran",
    "America/Asuncion",
    "Asia/Gaza",
];

fn ci_zones(all: &[Tz]) -> Vec<Tz> {
    let mut zones: Vec<Tz> = NAMED.iter().filter_map(|n| n.parse().ok()).collect();
    // A fixed, seeded stride through the rest (the list is in tzdb order).
    let rest: Vec<Tz> = all.iter().step_by(7).filter(|tz| !zones.contains(tz)).copied().collect();
    zones.extend(rest);
    zones
}

#[test]
fn planner_matches_the_oracle_on_sampled_zones_and_years() {
    let all = zones_with_transitions();
    let zones = ci_zones(&all);
    assert!(zones.len() >= NAMED.len() + 20, "only {} zones", zones.len());
    let years: Vec<i32> = (2020..=2040).step_by(3).collect(); // 2020, 2023, … 2038
    let sample: Vec<Window> = zones
        .iter()
        .flat_map(|tz| {
            years
                .iter()
                .flat_map(move |y| transitions(*tz, *y).into_iter().map(move |at| Window { tz: *tz, at }))
        })
        .collect();
    let cases = std::env::var("CHIME_DST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(400);
    let strategy = (proptest::sample::select(sample.clone()), any::<u64>())
        .prop_flat_map(|(w, salt)| (Just(w.clone()), expr_near(&w), Just(salt)));
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let result = runner.run(&strategy, |(w, expr, salt)| check(&w, &expr, salt).map(|_| ()));
    if let Err(e) = result {
        panic!("{e}");
    }
    eprintln!(
        "DST property: {cases} expressions over {} transitions in {} of {} zones with transitions, years {:?}",
        sample.len(),
        zones.len(),
        all.len(),
        years
    );
}

/// Every transition of every zone from 2020 to 2040, `CHIME_DST_PER_TRANSITION` expressions
/// each (default 8). Takes a few minutes in release mode.
#[test]
#[ignore = "exhaustive; run with --release -- --ignored"]
fn exhaustive_every_zone_and_year() {
    let zones = zones_with_transitions();
    let all = windows(&zones, 2020..=2040);
    let per: usize = std::env::var("CHIME_DST_PER_TRANSITION").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let mut runner = TestRunner::deterministic();
    let (mut exprs, mut slots) = (0usize, 0usize);
    for w in &all {
        for _ in 0..per {
            let expr = expr_near(w).new_tree(&mut runner).map(|t| t.current());
            let Ok(expr) = expr else { continue };
            let salt = any::<u64>().new_tree(&mut runner).map(|t| t.current()).unwrap_or(0);
            match check(w, &expr, salt) {
                Ok(n) => slots += n,
                Err(e) => panic!("{e}"),
            }
            exprs += 1;
        }
    }
    eprintln!(
        "DST exhaustive: {} zones, {} transitions (2020-2040), {exprs} expressions, {slots} slots compared",
        zones.len(),
        all.len()
    );
}
