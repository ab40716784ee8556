//! Business calendars: which days are working days, where a slot that falls on a holiday
//! goes, and the n-th (or n-th last) business day of a month.
//!
//! A calendar has working weekdays (Monday to Friday unless said otherwise), holidays (dates
//! listed, and all-day events of an iCalendar file, yearly rules included) and extra working
//! days (a Saturday made a working day); an extra working day wins over a holiday. Dates are
//! the calendar's own (the zone it names decides which day an instant falls on).
//!
//! This module is the days alone; `crate::schedule` puts a schedule's slots on them, and
//! `[[calendars]]` in the config builds them.

mod ics;

pub use ics::{IcsError, parse_ics};

use chrono::{Datelike, Days, NaiveDate, Weekday};
use std::collections::BTreeSet;

/// How far a roll looks for a business day before it gives up (a calendar whose working days
/// are all holidays for a year has none to give).
const ROLL_LIMIT: u64 = 366;

/// A holiday every year on one month and day (`RRULE:FREQ=YEARLY`), from one year, until a
/// last date if the rule has one.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Yearly {
    /// Month, 1–12.
    pub month: u32,
    /// Day of the month, 1–31 (a 29 February holiday is a holiday in leap years only).
    pub day: u32,
    /// The first year it applies.
    pub from: i32,
    /// Its last date (`UNTIL`), if any.
    pub until: Option<NaiveDate>,
}

impl Yearly {
    fn covers(&self, d: NaiveDate) -> bool {
        d.month() == self.month
            && d.day() == self.day
            && d.year() >= self.from
            && self.until.is_none_or(|u| d <= u)
    }
}

/// Where a slot that falls on a day that is not a business day goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnHoliday {
    /// It does not run (recorded as skipped).
    Skip,
    /// The next business day, same time of day.
    NextBusinessDay,
    /// The business day before, same time of day.
    PreviousBusinessDay,
}

/// A business calendar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Calendar {
    /// Working weekdays, Monday first.
    working: [bool; 7],
    holidays: BTreeSet<NaiveDate>,
    yearly: Vec<Yearly>,
    extra: BTreeSet<NaiveDate>,
}

impl Default for Calendar {
    /// Monday to Friday, no holidays.
    fn default() -> Self {
        Self::new([Weekday::Mon, Weekday::Tue, Weekday::Wed, Weekday::Thu, Weekday::Fri])
    }
}

impl Calendar {
    /// A calendar whose working days are `weekdays`, with no holidays yet.
    pub fn new(weekdays: impl IntoIterator<Item = Weekday>) -> Self {
        let mut working = [false; 7];
        for w in weekdays {
            working[w.num_days_from_monday() as usize] = true;
        }
        Self { working, holidays: BTreeSet::new(), yearly: Vec::new(), extra: BTreeSet::new() }
    }

    /// Adds holidays on these dates.
    pub fn with_holidays(mut self, dates: impl IntoIterator<Item = NaiveDate>) -> Self {
        self.holidays.extend(dates);
        self
    }

    /// Adds yearly holidays.
    pub fn with_yearly(mut self, rules: impl IntoIterator<Item = Yearly>) -> Self {
        self.yearly.extend(rules);
        self.yearly.sort();
        self.yearly.dedup();
        self
    }

    /// Adds extra working days (they win over weekdays and holidays).
    pub fn with_extra_working_days(mut self, dates: impl IntoIterator<Item = NaiveDate>) -> Self {
        self.extra.extend(dates);
        self
    }

    /// Whether any weekday is a working day (a calendar with none can only have extra days).
    pub fn has_working_weekday(&self) -> bool {
        self.working.iter().any(|w| *w)
    }

    /// Whether `d` is a holiday (listed or by a yearly rule), whatever its weekday.
    pub fn is_holiday(&self, d: NaiveDate) -> bool {
        self.holidays.contains(&d) || self.yearly.iter().any(|y| y.covers(d))
    }

    /// Whether `d` is a business day.
    pub fn is_business_day(&self, d: NaiveDate) -> bool {
        self.extra.contains(&d)
            || (self.working[d.weekday().num_days_from_monday() as usize] && !self.is_holiday(d))
    }

    /// The day a slot on `d` runs on under `policy`: `d` itself when it is a business day;
    /// `None` when it is skipped, or when no business day lies within a year of it.
    pub fn roll(&self, d: NaiveDate, policy: OnHoliday) -> Option<NaiveDate> {
        if self.is_business_day(d) {
            return Some(d);
        }
        let step = |day: NaiveDate, n: u64| match policy {
            OnHoliday::Skip => None,
            OnHoliday::NextBusinessDay => day.checked_add_days(Days::new(n)),
            OnHoliday::PreviousBusinessDay => day.checked_sub_days(Days::new(n)),
        };
        (1..=ROLL_LIMIT).map_while(|n| step(d, n)).find(|day| self.is_business_day(*day))
    }

    /// The `n`-th business day of `month` in `year` (`n` ≥ 1), or the `-n`-th last (`n` ≤ −1:
    /// −1 is the last business day); `None` when the month has fewer, or `n` is 0.
    pub fn business_day_of_month(&self, year: i32, month: u32, n: i32) -> Option<NaiveDate> {
        let first = NaiveDate::from_ymd_opt(year, month, 1)?;
        let next = if month == 12 {
            NaiveDate::from_ymd_opt(year + 1, 1, 1)?
        } else {
            NaiveDate::from_ymd_opt(year, month + 1, 1)?
        };
        let mut days = first.iter_days().take_while(|d| *d < next).filter(|d| self.is_business_day(*d));
        if n > 0 {
            return days.nth(usize::try_from(n - 1).ok()?);
        }
        let all: Vec<NaiveDate> = days.collect();
        let back = usize::try_from(n.unsigned_abs()).ok().filter(|b| *b > 0)?;
        all.len().checked_sub(back).map(|i| all[i])
    }
}

#[cfg(test)]
mod tests;
