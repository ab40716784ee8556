//! Cron schedules as strictly increasing UTC slot instants (croner, Vixie-cron DST rules).
//!
//! - A fixed-time job whose local time does not exist (spring forward) runs once, at the
//!   transition; one whose local time occurs twice (fall back) runs once, at the first.
//! - Interval jobs (`*/15 * * * *`, hourly) run at every real instant, including the
//!   repeated hour.
//! - Slots are computed in the job's IANA zone and handled as UTC instants; keys derive from
//!   the UTC instant, so every replica agrees.

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use croner::Cron;
use std::str::FromStr;

use crate::config::JobConfig;

/// A parsed schedule.
#[derive(Debug, Clone)]
pub struct Schedule {
    cron: Cron,
    tz: Tz,
    expr: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("invalid cron expression {expr:?}: {message}")]
    Cron { expr: String, message: String },
    #[error("{0:?} is not an IANA time zone")]
    Zone(String),
}

impl Schedule {
    pub fn parse(expr: &str, zone: Option<&str>) -> Result<Self, ScheduleError> {
        let cron = Cron::from_str(expr)
            .map_err(|e| ScheduleError::Cron { expr: expr.to_string(), message: e.to_string() })?;
        let tz = match zone {
            Some(z) => Tz::from_str(z).map_err(|_| ScheduleError::Zone(z.to_string()))?,
            None => Tz::UTC,
        };
        Ok(Self { cron, tz, expr: expr.to_string() })
    }

    /// The schedule of a job, if it has one.
    pub fn of(job: &JobConfig) -> Result<Option<Self>, ScheduleError> {
        job.schedule.as_deref().map(|s| Self::parse(s, job.timezone.as_deref())).transpose()
    }

    pub fn zone(&self) -> Tz {
        self.tz
    }

    pub fn expr(&self) -> &str {
        &self.expr
    }

    /// The first slot strictly after `t`.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let mut from = t;
        // croner answers in local time; guard the "strictly after, in UTC" contract anyway.
        for _ in 0..4 {
            let local = from.with_timezone(&self.tz);
            let next = self.cron.find_next_occurrence(&local, false).ok()?.with_timezone(&Utc);
            if next > t {
                return Some(next);
            }
            from = next + chrono::Duration::seconds(1);
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

#[cfg(test)]
mod tests {
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
}
