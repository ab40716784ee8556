//! A schedule on a business calendar (rules in the parent module's docs): which of its slots
//! run, on which day, and why.

use super::*;
use crate::calendar::{Calendar, OnHoliday};
use chrono::{Datelike, Days, NaiveDateTime};
use std::sync::Arc;

/// How far a slot may roll, and how far back the planner looks for slots rolled forward
/// (as [`Calendar::roll`]).
const ROLL_DAYS: u64 = 366;
/// Most schedule matches walked for one answer (a schedule with thousands of times a day on a
/// long run of holidays; beyond it the answer is "none").
const WALK_LIMIT: usize = 1_000_000;
/// How far ahead a `business_day` index is looked for before it is called impossible.
pub const BUSINESS_DAY_HORIZON_MONTHS: u32 = 120;

/// Which days of its calendar a schedule runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Business days; a slot on another day is skipped or rolled.
    OnHoliday(OnHoliday),
    /// The n-th (n ≥ 1) or n-th last (n ≤ −1) business day of each month.
    BusinessDay(i32),
}

/// A business calendar as a schedule uses it.
#[derive(Debug, Clone)]
pub struct Business {
    /// The calendar's name (`[[calendars]] name`), for explanations.
    pub name: String,
    /// Its days.
    pub calendar: Arc<Calendar>,
    /// The rule.
    pub rule: Rule,
}

/// Why a day is not a business day.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// A holiday of the calendar.
    Holiday,
    /// A weekday the calendar does not work.
    NotWorkingDay,
}

impl Closed {
    /// `holiday` or `not_working_day` (metric label, history reason).
    pub fn as_str(self) -> &'static str {
        match self {
            Closed::Holiday => "holiday",
            Closed::NotWorkingDay => "not_working_day",
        }
    }
}

/// A slot of the bare schedule that does not run at its own time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    /// The local time the schedule gives.
    pub from: NaiveDateTime,
    /// Its instant, had it run on its own day (a skipped slot's key is for it).
    pub at: Option<DateTime<Utc>>,
    /// Why its day is not a business day.
    pub closed: Closed,
    /// The instant it runs at instead; `None` when skipped.
    pub to: Option<DateTime<Utc>>,
}

impl Business {
    fn closed(&self, d: NaiveDate) -> Closed {
        if self.calendar.is_holiday(d) { Closed::Holiday } else { Closed::NotWorkingDay }
    }

    /// Whether slots on `d` run under a filtering rule (`skip`, `business_day`).
    fn runs_on(&self, d: NaiveDate) -> bool {
        match self.rule {
            Rule::OnHoliday(_) => self.calendar.is_business_day(d),
            Rule::BusinessDay(n) => self.calendar.business_day_of_month(d.year(), d.month(), n) == Some(d),
        }
    }

    /// The first day after `d` slots may run on under a filtering rule.
    fn next_run_day(&self, d: NaiveDate) -> Option<NaiveDate> {
        match self.rule {
            Rule::OnHoliday(_) => self.calendar.roll(d.succ_opt()?, OnHoliday::NextBusinessDay),
            Rule::BusinessDay(n) => {
                let mut month = d.with_day(1)?;
                for _ in 0..=BUSINESS_DAY_HORIZON_MONTHS {
                    if let Some(day) = self.calendar.business_day_of_month(month.year(), month.month(), n)
                        && day > d
                    {
                        return Some(day);
                    }
                    month = month.checked_add_months(chrono::Months::new(1))?;
                }
                None
            }
        }
    }
}

/// Why a schedule cannot follow its calendar rule.
pub(super) fn check(schedule: &Schedule, business: &Business) -> Result<(), String> {
    match business.rule {
        Rule::OnHoliday(OnHoliday::Skip) => Ok(()),
        Rule::OnHoliday(_) if schedule.kind == Kind::Wildcard => Err(
            "moving slots to another business day needs a fixed-time schedule (no `*` in its minute and hour \
             fields): a schedule that runs every few minutes or hours already runs on that day; use \
             on_holiday = \"skip\""
                .into(),
        ),
        Rule::OnHoliday(_) => Ok(()),
        Rule::BusinessDay(n) => {
            if !schedule.days_any {
                return Err(format!(
                    "business_day = {n} picks the day of the month: the schedule's day-of-month and day-of-week \
                     fields must be `*` (it gives the time of day, and may restrict the months)"
                ));
            }
            if n == 0 || !(-31..=31).contains(&n) {
                return Err(format!(
                    "business_day = {n}: 1 is the first business day of the month, 2 the second, -1 the last, \
                     -2 the one before (between -31 and 31, not 0)"
                ));
            }
            let today = Utc::now().with_timezone(&schedule.tz).date_naive();
            let start = today.with_day(1).unwrap_or(today);
            let found = (0..BUSINESS_DAY_HORIZON_MONTHS)
                .filter_map(|m| start.checked_add_months(chrono::Months::new(m)))
                .any(|m| business.calendar.business_day_of_month(m.year(), m.month(), n).is_some());
            if found {
                Ok(())
            } else {
                Err(format!(
                    "business_day = {n} can never match: no month of the next {} years has {} business days in \
                     calendar {:?}",
                    BUSINESS_DAY_HORIZON_MONTHS / 12,
                    n.unsigned_abs(),
                    business.name
                ))
            }
        }
    }
}

impl Schedule {
    /// The first local instant at which the wall clock reads `local` or later (the fixed-time
    /// rule: a time in a spring-forward gap runs at the gap's end, a repeated one at its first
    /// occurrence).
    fn resolve_fixed(&self, local: &NaiveDateTime) -> Option<DateTime<Utc>> {
        match self.tz.from_local_datetime(local) {
            LocalResult::Single(x) | LocalResult::Ambiguous(x, _) => Some(x.with_timezone(&Utc)),
            LocalResult::None => GapInfo::new(local, &self.tz)?.end.map(|e| e.with_timezone(&Utc)),
        }
    }

    fn local_date(&self, t: DateTime<Utc>) -> NaiveDate {
        t.with_timezone(&self.tz).date_naive()
    }

    /// The calendar's next slot after `t`.
    pub(super) fn next_business(&self, b: &Business, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match b.rule {
            Rule::OnHoliday(OnHoliday::NextBusinessDay) | Rule::OnHoliday(OnHoliday::PreviousBusinessDay) => {
                self.next_rolled(b, t)
            }
            _ => self.next_filtered(b, t),
        }
    }

    /// `skip` and `business_day`: the bare schedule's slots on the days that run, jumping
    /// over the others a day at a time (or straight to the next run day).
    fn next_filtered(&self, b: &Business, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let mut from = t;
        for _ in 0..WALK_LIMIT {
            let slot = self.next_bare(from)?;
            let day = self.local_date(slot);
            if b.runs_on(day) {
                return Some(slot);
            }
            // The last instant before the next day that runs: the bare schedule's next slot
            // after it is that day's first (or later).
            let next = b.next_run_day(day)?;
            let start = self.resolve_fixed(&next.and_time(NaiveTime::MIN))?;
            from = (start - Duration::seconds(1)).max(slot);
        }
        None
    }

    /// `next_business_day` / `previous_business_day` (fixed-time): the schedule's local times
    /// in order, each moved onto its business day. That day never decreases along the walk,
    /// so the answer is the earliest instant after `t` of the first day that has one.
    fn next_rolled(&self, b: &Business, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let Rule::OnHoliday(policy) = b.rule else { return None };
        let today = self.local_date(t);
        let cal = &b.calendar;
        // Local times from here on can land after `t`: rolled forward, those since the last
        // business day before today; rolled back, those from (about) today on.
        let first_day = match policy {
            OnHoliday::NextBusinessDay => (1..=ROLL_DAYS)
                .filter_map(|k| today.checked_sub_days(Days::new(k)))
                .find(|d| cal.is_business_day(*d))
                .and_then(|d| d.succ_opt())
                .or_else(|| today.checked_sub_days(Days::new(ROLL_DAYS)))?,
            _ => today.pred_opt()?,
        };
        let mut cursor = first_day.and_time(NaiveTime::MIN);
        let mut inclusive = true;
        let mut best: Option<(NaiveDate, DateTime<Utc>)> = None;
        for _ in 0..WALK_LIMIT {
            let Ok(local) = self.cron.find_next_occurrence(&cursor, inclusive) else { break };
            inclusive = false;
            cursor = local;
            let day = local.date();
            if best.is_none() && day > today.checked_add_days(Days::new(2 * ROLL_DAYS + 1))? {
                return None;
            }
            let Some(runs_on) = cal.roll(day, policy) else { continue };
            if let Some((best_day, at)) = best
                && runs_on > best_day
            {
                return Some(at);
            }
            if let Some(at) = self.resolve_fixed(&runs_on.and_time(local.time()))
                && at > t
                && best.is_none_or(|(_, b)| at < b)
            {
                best = Some((runs_on, at));
            }
        }
        best.map(|(_, at)| at)
    }

    /// The calendar's skipped and moved slots among the bare schedule's local times in
    /// `(after, until]` (at most `limit`): what `chime jobs next` explains.
    pub fn moved_between(&self, after: DateTime<Utc>, until: DateTime<Utc>, limit: usize) -> Vec<Moved> {
        let Some(b) = &self.business else { return Vec::new() };
        let mut out = Vec::new();
        let rule = match b.rule {
            Rule::OnHoliday(p) => p,
            // Other days are not the day: nothing to explain slot by slot.
            Rule::BusinessDay(_) => return out,
        };
        let mut cursor = after.with_timezone(&self.tz).naive_local();
        let end = until.with_timezone(&self.tz).naive_local();
        for _ in 0..WALK_LIMIT {
            if out.len() >= limit {
                break;
            }
            let Ok(local) = self.cron.find_next_occurrence(&cursor, false) else { break };
            if local > end {
                break;
            }
            cursor = local;
            let day = local.date();
            if b.calendar.is_business_day(day) {
                continue;
            }
            let to = b.calendar.roll(day, rule).and_then(|d| self.resolve_fixed(&d.and_time(local.time())));
            out.push(Moved { from: local, at: self.resolve_fixed(&local), closed: b.closed(day), to });
        }
        out
    }

    /// The bare schedule's local times on days off that run at `slot` (rolled onto its day):
    /// what `chime jobs next` says a rolled slot is for. Empty without a rolling rule.
    pub fn origins(&self, slot: DateTime<Utc>) -> Vec<Moved> {
        let Some(b) = &self.business else { return Vec::new() };
        let Rule::OnHoliday(policy @ (OnHoliday::NextBusinessDay | OnHoliday::PreviousBusinessDay)) = b.rule
        else {
            return Vec::new();
        };
        let day = self.local_date(slot);
        let mut out = Vec::new();
        for k in 1..=ROLL_DAYS {
            let other = match policy {
                OnHoliday::NextBusinessDay => day.checked_sub_days(Days::new(k)),
                _ => day.checked_add_days(Days::new(k)),
            };
            let Some(other) = other.filter(|d| !b.calendar.is_business_day(*d)) else { break };
            let mut cursor = other.and_time(NaiveTime::MIN);
            let mut inclusive = true;
            while let Ok(local) = self.cron.find_next_occurrence(&cursor, inclusive) {
                if local.date() != other {
                    break;
                }
                if self.resolve_fixed(&day.and_time(local.time())) == Some(slot) {
                    let at = self.resolve_fixed(&local);
                    out.push(Moved { from: local, at, closed: b.closed(other), to: Some(slot) });
                }
                cursor = local;
                inclusive = false;
            }
        }
        out.sort_by_key(|m| m.from);
        out
    }

    /// Why the ticker does not publish `slot` (a slot of [`Schedule::next_tick`]): `None` when
    /// it runs; the reason when the calendar skips it (`on_holiday = "skip"`).
    pub fn skipped(&self, slot: DateTime<Utc>) -> Option<Closed> {
        let b = self.business.as_ref()?;
        if b.rule != Rule::OnHoliday(OnHoliday::Skip) {
            return None;
        }
        let day = self.local_date(slot);
        (!b.calendar.is_business_day(day)).then(|| b.closed(day))
    }
}
