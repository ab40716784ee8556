//! Cron schedules as strictly increasing UTC slot instants, with Vixie-cron DST rules.
//!
//! croner is used only to *match wall-clock fields*: it is asked for the next naive local time
//! that matches, never to resolve that time in a zone. Resolving local times to instants is
//! done here, by the rule of Vixie cron 4.1 and cronie (`find_jobs`):
//!
//! - A schedule is a **wildcard** job when its minute or hour field (or, with six fields, its
//!   seconds field) starts with `*`; every other schedule is **fixed-time**, whatever lists,
//!   ranges or steps its fields hold (`30 2,14 * * *`, `0 30 1-3 * * *`, `30 1-5/2 * * *`).
//! - Fixed-time: a matching local time that does not exist (spring-forward gap) runs once, at
//!   the first instant after the gap; one that occurs twice (fall back) runs once, at its first
//!   occurrence. Equivalently, the slot of a matching local time `L` is the first instant at
//!   which the wall clock reads `L` or later, which is non-decreasing in `L`; local times that
//!   land on the same instant are one slot.
//! - Wildcard: every real instant whose local time matches (both passes through a repeated
//!   hour, nothing inside a gap).
//!
//! Day-of-month and day-of-week combine as in Vixie cron: when either field starts with `*`
//! (or `?`) a day must match both, otherwise either. (croner alone treats only a bare `*` that
//! way, so `*/2` in day-of-month would widen to OR; the parser is configured per expression.)
//!
//! Slots are handled as UTC instants; keys derive from the UTC instant, so every replica and
//! every restart computes the same slots.
//!
//! # Business calendars
//!
//! A schedule may follow a business calendar (`jobs[].calendar`, [`Schedule::on_calendar`]).
//! The calendar's dates are the schedule's own (a job runs in its calendar's zone), so a
//! slot's day is its local date. By its [`Rule`]:
//!
//! - `on_holiday = "skip"`: the slots on business days run; the others are skipped (the
//!   ticker counts them, and records those on holidays).
//! - `on_holiday = "next_business_day"` / `"previous_business_day"` (fixed-time schedules
//!   only): a slot on another day runs on the next (previous) business day at the same local
//!   time, resolved by the fixed-time DST rule above. Its instant, hence its key, is that of
//!   the rolled local time: a slot rolled onto a time the schedule already has on that day,
//!   or two slots rolled onto one, are one slot and run once.
//! - `business_day = n`: the slots on the n-th business day of each month (n ≥ 1), or the
//!   n-th last (n ≤ −1; −1 is the last). The schedule gives the time of day and the months;
//!   its day fields must be `*`.
//!
//! Slots stay strictly increasing instants computed from the config alone, so watermarks,
//! catch-up, backfill and every replica work on them unchanged.

use chrono::{DateTime, Duration, LocalResult, NaiveDate, NaiveTime, Offset, TimeZone, Utc};
use chrono_tz::{GapInfo, Tz};
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use std::str::FromStr;

mod business;

pub use business::{BUSINESS_DAY_HORIZON_MONTHS, Business, Closed, Moved, Rule};

/// How a schedule is resolved across daylight-saving transitions (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Minute, hour (and seconds) fields hold no `*`: one run per matching local time.
    FixedTime,
    /// Minute, hour or seconds field starts with `*`: a run at every matching real instant.
    Wildcard,
}

/// A parsed schedule, optionally on a business calendar ([`Schedule::on_calendar`]).
#[derive(Debug, Clone)]
pub struct Schedule {
    cron: Cron,
    tz: Tz,
    kind: Kind,
    expr: String,
    /// Neither day field restricts the day (`*` or `?` in both).
    days_any: bool,
    business: Option<std::sync::Arc<Business>>,
}

/// Why a schedule is rejected.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    /// Not a 5- or 6-field cron expression chime accepts.
    #[error("invalid cron expression {expr:?}: {message}")]
    Cron {
        /// The expression as written.
        expr: String,
        /// What is wrong with it.
        message: String,
    },
    /// The `timezone` field.
    #[error("{}", zone_message(.0))]
    Zone(String),
}

/// An IANA time zone by its name (`Europe/Berlin`, `UTC`).
pub fn zone(name: &str) -> Result<Tz, ScheduleError> {
    Tz::from_str(name).map_err(|_| ScheduleError::Zone(name.to_string()))
}

/// Why `name` is not a zone, with the zone it meant when only its case differs (`utc`,
/// `europe/berlin`).
fn zone_message(name: &str) -> String {
    let meant = chrono_tz::TZ_VARIANTS.iter().map(|z| z.name()).find(|z| z.eq_ignore_ascii_case(name));
    match meant {
        Some(z) => format!("{name:?} is not an IANA time zone (names are case-sensitive: {z:?})"),
        None => format!("{name:?} is not an IANA time zone"),
    }
}

/// The macros croner knows (`@reboot` and the like are not schedules).
const MACROS: &str = "@yearly, @annually, @monthly, @weekly, @daily, @midnight, @hourly";

/// croner's message for a rejected expression, with the field it rejects named: each field is
/// tried alone (the others `*`) and the first one refused is the culprit, with its range.
fn explain(parser: &CronParser, fields: &[&str], expr: &str, message: &str) -> String {
    if expr.trim_start().starts_with('@') {
        return format!("{:?} is not a macro chime knows ({MACROS})", expr.trim());
    }
    let names: &[(&str, &str)] = &[
        ("second", "0-59"),
        ("minute", "0-59"),
        ("hour", "0-23"),
        ("day of month", "1-31, L, W"),
        ("month", "1-12 or JAN-DEC"),
        ("day of week", "0-7 or SUN-SAT, 0 and 7 both Sunday, L and # allowed"),
    ];
    // croner's wrappers say nothing to a user ("Component error: Step cannot be zero").
    let message = message
        .trim_start_matches("Component error: ")
        .trim_start_matches("Invalid pattern: ")
        .trim_start_matches("Pattern contains illegal characters: CronPattern contains ");
    let names = &names[names.len() - fields.len()..];
    for (i, (name, range)) in names.iter().enumerate() {
        let alone: Vec<&str> = (0..fields.len()).map(|j| if j == i { fields[i] } else { "*" }).collect();
        if parser.parse(&alone.join(" ")).is_err() {
            let message = message.trim_end_matches('.');
            return format!("{name} field {:?}: {message} (expected {range})", fields[i]);
        }
    }
    message.to_string()
}

/// Upper bound on offset transitions crossed while looking for one wildcard slot (tzdb has
/// about two a year; a schedule that matches nothing for centuries is rejected at parse time).
const MAX_TRANSITIONS: usize = 2_000;
/// Offsets are compared at least this often while looking for a transition: no zone changes
/// its offset twice within 12 hours.
const PROBE: i64 = 12 * 3600;

impl Schedule {
    /// Parses a 5-field (minute first) or 6-field (seconds first) expression, or a macro such
    /// as `@daily`, in `zone` (default UTC). Expressions that can never fire are rejected.
    pub fn parse(expr: &str, zone: Option<&str>) -> Result<Self, ScheduleError> {
        // croner's messages quote the offending part raw: escaped, as they reach terminals and logs.
        let bad = |message: String| ScheduleError::Cron {
            expr: expr.to_string(),
            message: crate::redact::escape_control(&message).into_owned(),
        };
        let fields: Vec<&str> = expr.split_whitespace().collect();
        let (kind, dom_and_dow, days_any) = if expr.trim_start().starts_with('@') {
            // croner's macros: only @hourly has a wildcard hour; none restricts both day fields.
            let m = expr.trim().to_ascii_lowercase();
            let hourly = m == "@hourly";
            let days_any = matches!(m.as_str(), "@hourly" | "@daily" | "@midnight");
            (if hourly { Kind::Wildcard } else { Kind::FixedTime }, false, days_any)
        } else {
            let time_fields = match fields.len() {
                5 => 2,
                6 => 3,
                n => return Err(bad(format!("{n} fields; expected 5 (minute first) or 6 (seconds first)"))),
            };
            let star = |f: &str| f.starts_with('*') || f.starts_with('?');
            let kind =
                if fields[..time_fields].iter().any(|f| star(f)) { Kind::Wildcard } else { Kind::FixedTime };
            let (dom, dow) = (fields[time_fields], fields[time_fields + 2]);
            (kind, star(dom) || star(dow), star(dom) && star(dow) && !dom.contains('/') && !dow.contains('/'))
        };
        let parser = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .dom_and_dow(dom_and_dow)
            .build();
        let cron = parser.parse(expr).map_err(|e| bad(explain(&parser, &fields, expr, &e.to_string())))?;
        let tz = match zone {
            Some(z) => self::zone(z)?,
            None => Tz::UTC,
        };
        // Without a year field a pattern repeats with the Gregorian calendar's 400-year cycle:
        // one that matches no date in a whole cycle never fires (`0 0 30 2 *`).
        let cycle = |y| NaiveDate::from_ymd_opt(y, 1, 1).map(|d| d.and_time(NaiveTime::MIN));
        let fires = match (cycle(2000), cycle(2400)) {
            (Some(from), Some(to)) => cron.find_next_occurrence(&from, true).is_ok_and(|t| t < to),
            _ => false,
        };
        if !fires {
            return Err(bad("never fires: no date matches (check day of month against month)".into()));
        }
        Ok(Self { cron, tz, kind, expr: expr.to_string(), days_any, business: None })
    }

    /// This schedule on a business calendar (see [`Rule`]):
    /// refused, with the reason, when the rule cannot apply to it (a roll on a wildcard
    /// schedule, `business_day` with day fields, an index no month reaches).
    pub fn on_calendar(mut self, business: Business) -> Result<Self, String> {
        business::check(&self, &business)?;
        self.business = Some(std::sync::Arc::new(business));
        Ok(self)
    }

    /// The business calendar it follows, if any.
    pub fn business(&self) -> Option<&Business> {
        self.business.as_deref()
    }

    /// The zone slots are computed in.
    pub fn zone(&self) -> Tz {
        self.tz
    }

    /// The expression as written.
    pub fn expr(&self) -> &str {
        &self.expr
    }

    /// How the expression behaves across DST transitions.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The first slot strictly after `t` (on its calendar, if it has one).
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match &self.business {
            None => self.next_bare(t),
            Some(b) => self.next_business(b, t),
        }
    }

    /// What the ticker walks: [`Schedule::next_after`], and the slots its calendar skips
    /// (`on_holiday = "skip"`), which it counts and records ([`Schedule::skipped`]).
    pub fn next_tick(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self.business.as_deref().map(|b| b.rule) {
            Some(Rule::OnHoliday(crate::calendar::OnHoliday::Skip)) => self.next_bare(t),
            _ => self.next_after(t),
        }
    }

    /// The bare schedule's first slot after `t`, calendar aside.
    fn next_bare(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match self.kind {
            Kind::FixedTime => self.next_fixed(t),
            Kind::Wildcard => self.next_wildcard(t),
        }
    }

    /// Fixed-time: walk matching local times from `t`'s wall clock; each resolves to the first
    /// instant at which the clock reads it or later. That instant never decreases as the local
    /// time grows, so the first one after `t` is the answer. Only inside a repeated hour (when
    /// `t` is its second pass) does the walk step over local times whose slot already passed.
    fn next_fixed(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let mut cursor = t.with_timezone(&self.tz).naive_local();
        loop {
            let local = self.cron.find_next_occurrence(&cursor, false).ok()?;
            let slot = match self.tz.from_local_datetime(&local) {
                LocalResult::Single(x) | LocalResult::Ambiguous(x, _) => x.with_timezone(&Utc),
                LocalResult::None => GapInfo::new(&local, &self.tz)?.end?.with_timezone(&Utc),
            };
            if slot > t {
                return Some(slot);
            }
            cursor = local;
        }
    }

    /// Wildcard: within a stretch of constant UTC offset, wall clock and instants advance
    /// together, so the next matching local time is the next slot unless an offset transition
    /// comes first; then the search restarts at the transition, with the new offset.
    fn next_wildcard(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let mut from = t;
        let mut inclusive = false;
        for _ in 0..MAX_TRANSITIONS {
            let offset = offset_at(self.tz, from);
            let wall = from.naive_utc() + offset;
            let local = self.cron.find_next_occurrence(&wall, inclusive).ok()?;
            let slot = (local - offset).and_utc();
            match first_transition(self.tz, from, slot) {
                None => return Some(slot),
                Some(at) => {
                    from = at;
                    inclusive = true;
                }
            }
        }
        None
    }

    /// Slots in `(after, until]`, at most `limit` of them.
    pub fn slots_between(
        &self,
        after: DateTime<Utc>,
        until: DateTime<Utc>,
        limit: usize,
    ) -> Vec<DateTime<Utc>> {
        let mut out = Vec::new();
        let mut t = after;
        while out.len() < limit {
            match self.next_after(t) {
                Some(n) if n <= until => {
                    out.push(n);
                    t = n;
                }
                _ => break,
            }
        }
        out
    }

    /// The next `count` slots after `t`.
    pub fn upcoming(&self, t: DateTime<Utc>, count: usize) -> Vec<DateTime<Utc>> {
        self.slots_between(t, DateTime::<Utc>::MAX_UTC, count)
    }
}

/// The zone's total UTC offset in effect at instant `t`.
fn offset_at(tz: Tz, t: DateTime<Utc>) -> Duration {
    Duration::seconds(i64::from(tz.offset_from_utc_datetime(&t.naive_utc()).fix().local_minus_utc()))
}

/// The first instant in `(after, until]` whose offset differs from the one in effect at
/// `after`, to the second (tzdb transitions fall on whole seconds).
fn first_transition(tz: Tz, after: DateTime<Utc>, until: DateTime<Utc>) -> Option<DateTime<Utc>> {
    let before = offset_at(tz, after);
    let end = until.timestamp();
    let mut lo = after.timestamp();
    while lo < end {
        let hi = (lo + PROBE).min(end);
        if offset_at(tz, at_second(hi)?) != before {
            // offset(lo) == before != offset(hi): narrow down to the first changed second.
            let (mut lo, mut hi) = (lo, hi);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if offset_at(tz, at_second(mid)?) == before { lo = mid } else { hi = mid }
            }
            return at_second(hi);
        }
        lo = hi;
    }
    None
}

fn at_second(s: i64) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(s, 0)
}

#[cfg(test)]
mod business_oracle;
#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod oracle;
#[cfg(test)]
mod tests;
