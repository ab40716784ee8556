//! `[[calendars]]`: business calendars (working weekdays, holidays listed or read from an
//! iCalendar file, extra working days), and the jobs that follow one (`jobs[].calendar`,
//! `on_holiday`, `business_day`).

use super::*;
use crate::calendar::{Calendar, OnHoliday, Yearly, parse_ics};
use crate::schedule::{Business, Rule, Schedule};
use chrono::{NaiveDate, Weekday};
use chrono_tz::Tz;
use std::sync::Arc;

/// One `[[calendars]]` entry, as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CalendarConfig {
    /// The name jobs refer to it by: letters, digits, `-`, `_`, `.`.
    pub name: String,
    /// IANA zone its dates are in (default UTC); the jobs that follow it run in it.
    #[serde(default)]
    pub zone: Option<String>,
    /// Working weekdays (`"mon"` … `"sun"`, or the full names); default Monday to Friday.
    #[serde(default)]
    pub weekdays: Option<Vec<String>>,
    /// Holidays: `"2026-12-25"` (that day) or `"12-25"` (every year).
    #[serde(default)]
    pub holidays: Vec<String>,
    /// An iCalendar file whose all-day events are holidays (yearly rules included); relative
    /// paths are from the working directory. Reloaded when it changes.
    #[serde(default)]
    pub ics: Option<PathBuf>,
    /// Days that are working days whatever their weekday or holidays (`"2026-12-19"`).
    #[serde(default)]
    pub extra_working_days: Vec<String>,
}

/// A calendar read and checked: its days and its zone.
#[derive(Debug, Clone)]
pub struct ResolvedCalendar {
    /// Its days.
    pub calendar: Arc<Calendar>,
    /// Its zone.
    pub zone: Tz,
}

fn weekday(s: &str) -> Option<Weekday> {
    let s = s.trim().to_ascii_lowercase();
    let all = [
        ("mon", "monday", Weekday::Mon),
        ("tue", "tuesday", Weekday::Tue),
        ("wed", "wednesday", Weekday::Wed),
        ("thu", "thursday", Weekday::Thu),
        ("fri", "friday", Weekday::Fri),
        ("sat", "saturday", Weekday::Sat),
        ("sun", "sunday", Weekday::Sun),
    ];
    all.into_iter().find(|(short, long, _)| s == *short || s == *long).map(|(_, _, w)| w)
}

impl CalendarConfig {
    /// Reads (the `.ics` file included) and checks entry `i`.
    fn resolve(&self, i: usize) -> Result<ResolvedCalendar, ConfigError> {
        let key = |field: &str| format!("calendars[{i}] ({}).{field}", self.name);
        let zone = match &self.zone {
            Some(z) => {
                crate::schedule::zone(z).map_err(|e| ConfigError::invalid(key("zone"), e.to_string()))?
            }
            None => Tz::UTC,
        };
        let weekdays = match &self.weekdays {
            None => vec![Weekday::Mon, Weekday::Tue, Weekday::Wed, Weekday::Thu, Weekday::Fri],
            Some(list) => list
                .iter()
                .enumerate()
                .map(|(j, w)| {
                    weekday(w).ok_or_else(|| {
                        ConfigError::invalid(
                            format!("{}[{j}]", key("weekdays")),
                            format!("{w:?} is not a weekday (mon, tue, wed, thu, fri, sat, sun)"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        let date = |field: &str, j: usize, s: &str| {
            NaiveDate::parse_from_str(s.trim(), "%Y-%m-%d").map_err(|_| {
                ConfigError::invalid(
                    format!("{}[{j}]", key(field)),
                    format!("{s:?} is not a date (YYYY-MM-DD)"),
                )
            })
        };
        let mut dates = Vec::new();
        let mut yearly = Vec::new();
        for (j, h) in self.holidays.iter().enumerate() {
            let every_year = h.trim().len() == 5;
            if every_year {
                // "MM-DD": checked against a leap year, so 02-29 is a holiday in leap years.
                let d =
                    NaiveDate::parse_from_str(&format!("2000-{}", h.trim()), "%Y-%m-%d").map_err(|_| {
                        ConfigError::invalid(
                            format!("{}[{j}]", key("holidays")),
                            format!(
                                "{h:?} is not a month and day (MM-DD, every year) nor a date (YYYY-MM-DD)"
                            ),
                        )
                    })?;
                yearly.push(Yearly { month: d.month(), day: d.day(), from: i32::MIN, until: None });
            } else {
                dates.push(date("holidays", j, h)?);
            }
        }
        if let Some(path) = &self.ics {
            let text = std::fs::read_to_string(path).map_err(|e| {
                ConfigError::invalid(key("ics"), format!("cannot read {}: {e}", path.display()))
            })?;
            let (days, rules) = parse_ics(&text)
                .map_err(|e| ConfigError::invalid(key("ics"), format!("{}: {e}", path.display())))?;
            dates.extend(days);
            yearly.extend(rules);
        }
        let extra: Vec<NaiveDate> = self
            .extra_working_days
            .iter()
            .enumerate()
            .map(|(j, s)| date("extra_working_days", j, s))
            .collect::<Result<_, _>>()?;
        let calendar = Calendar::new(weekdays).with_holidays(dates).with_yearly(yearly);
        if !calendar.has_working_weekday() && extra.is_empty() {
            return Err(ConfigError::invalid(
                key("weekdays"),
                "the calendar has no working day (no weekday, no extra working day): every slot would be skipped",
            ));
        }
        Ok(ResolvedCalendar { calendar: Arc::new(calendar.with_extra_working_days(extra)), zone })
    }
}

/// Every `[[calendars]]` entry read and checked, by name.
pub(super) fn resolve(
    calendars: &[CalendarConfig],
) -> Result<BTreeMap<String, ResolvedCalendar>, ConfigError> {
    super::limits::entry_names("calendars", "calendar", calendars.iter().map(|c| c.name.as_str()))?;
    calendars.iter().enumerate().map(|(i, c)| Ok((c.name.clone(), c.resolve(i)?))).collect()
}

/// Each job's calendar settings against the calendars: known, consistent with its schedule
/// and zone.
pub(super) fn validate(
    calendars: &BTreeMap<String, ResolvedCalendar>,
    jobs: &[JobConfig],
) -> Result<(), ConfigError> {
    for (i, job) in jobs.iter().enumerate() {
        let key = |field: &str| format!("jobs[{i}] ({}).{field}", job.name);
        let Some(name) = &job.calendar else {
            for (field, set) in
                [("on_holiday", job.on_holiday.is_some()), ("business_day", job.business_day.is_some())]
            {
                if set {
                    return Err(ConfigError::invalid(
                        key(field),
                        "needs jobs[].calendar (the business calendar it applies to)",
                    ));
                }
            }
            continue;
        };
        if job.schedule.is_none() {
            return Err(ConfigError::invalid(
                key("calendar"),
                "applies to scheduled jobs only (this one has no schedule)",
            ));
        }
        if job.on_holiday.is_some() && job.business_day.is_some() {
            return Err(ConfigError::invalid(
                key("on_holiday"),
                "has no meaning with business_day (a business day is never a holiday); set one of them",
            ));
        }
        let Some(cal) = calendars.get(name) else {
            let names: BTreeSet<&str> = calendars.keys().map(String::as_str).collect();
            return Err(ConfigError::invalid(
                key("calendar"),
                format!(
                    "{name:?} is not a [[calendars]] entry ({})",
                    super::limits::known_entries("calendars", &names)
                ),
            ));
        };
        if let Some(tz) = &job.timezone
            && Tz::from_str(tz).ok() != Some(cal.zone)
        {
            return Err(ConfigError::invalid(
                key("timezone"),
                format!(
                    "{tz:?} differs from the zone of calendar {name:?} ({}): a job runs in its calendar's zone, \
                     so that a slot's day is the calendar's day (drop timezone, or use a calendar in {tz})",
                    cal.zone.name()
                ),
            ));
        }
        schedule_of(job, calendars).map_err(|(field, e)| ConfigError::invalid(key(field), e))?;
    }
    Ok(())
}

/// The schedule of `job` on its calendar, if it has one; the field at fault otherwise.
pub(super) fn schedule_of(
    job: &JobConfig,
    calendars: &BTreeMap<String, ResolvedCalendar>,
) -> Result<Option<Schedule>, (&'static str, String)> {
    let Some(expr) = &job.schedule else { return Ok(None) };
    let cal = job.calendar.as_ref().and_then(|name| calendars.get(name).map(|c| (name, c)));
    let zone = job.timezone.clone().or_else(|| cal.map(|(_, c)| c.zone.name().to_string()));
    let schedule = Schedule::parse(expr, zone.as_deref()).map_err(|e| ("schedule", e.to_string()))?;
    let Some((name, cal)) = cal else { return Ok(Some(schedule)) };
    let (rule, field) = match (job.business_day, job.on_holiday) {
        (Some(n), _) => (Rule::BusinessDay(n), "business_day"),
        (None, policy) => (Rule::OnHoliday(policy.unwrap_or(OnHoliday::Skip)), "on_holiday"),
    };
    let business = Business { name: name.clone(), calendar: cal.calendar.clone(), rule };
    schedule.on_calendar(business).map(Some).map_err(|e| (field, e))
}

use chrono::Datelike;

#[cfg(test)]
mod tests {
    use super::super::tests::err;
    use super::*;

    const UK: &str =
        "[[calendars]]\nname = \"uk\"\nzone = \"Europe/London\"\nholidays = [\"2026-12-28\", \"12-25\"]\n";

    fn job(extra: &str) -> String {
        format!(
            "{UK}[[jobs]]\nname = \"pay\"\nhandler = \"noop\"\nschedule = \"0 9 * * *\"\ncalendar = \"uk\"\n{extra}\n"
        )
    }

    #[test]
    fn a_job_on_a_calendar_runs_in_its_zone_on_its_business_days() {
        let c = Config::from_toml_str(&job("on_holiday = \"next_business_day\"")).unwrap();
        let s = c.schedule_of(c.job("pay").unwrap()).unwrap().unwrap();
        assert_eq!(s.zone().name(), "Europe/London");
        // Friday 25th (every year) and Monday 28th off, and the weekend: Tuesday 29th, once.
        let t = |s: &str| s.parse::<chrono::DateTime<chrono::Utc>>().unwrap();
        assert_eq!(s.next_after(t("2026-12-24T10:00:00Z")), Some(t("2026-12-29T09:00:00Z")));
        assert_eq!(s.next_after(t("2027-12-24T10:00:00Z")), Some(t("2027-12-27T09:00:00Z")));
    }

    #[test]
    fn an_ics_file_is_read_and_a_bad_one_named_by_line() {
        let dir = std::env::temp_dir().join(format!("chime-cal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.ics");
        std::fs::write(
            &good,
            "BEGIN:VCALENDAR\r\nBEGIN:VEVENT\r\nDTSTART;VALUE=DATE:20261204\r\nSUMMARY:Founders' day\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n",
        )
        .unwrap();
        let bad = dir.join("bad.ics");
        std::fs::write(
            &bad,
            "BEGIN:VCALENDAR\nBEGIN:VEVENT\nDTSTART:20261204T090000\nEND:VEVENT\nEND:VCALENDAR\n",
        )
        .unwrap();
        let text = |p: &std::path::Path| {
            format!("[[calendars]]\nname = \"hq\"\nics = {:?}\n", p.display().to_string())
        };
        let c = Config::from_toml_str(&text(&good)).unwrap();
        let cal = &c.resolved_calendars["hq"].calendar;
        assert!(cal.is_holiday("2026-12-04".parse().unwrap()));
        let e = err(&text(&bad));
        assert!(e.contains("calendars[0] (hq).ics") && e.contains("bad.ics: line 3"), "{e}");
        let e = err(&text(&dir.join("missing.ics")));
        assert!(e.contains("calendars[0] (hq).ics: cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_calendar_settings_are_refused_by_name() {
        for (text, says) in [
            (job("").replace("calendar = \"uk\"", "calendar = \"us\""), "jobs[0] (pay).calendar: \"us\" is not a [[calendars]] entry (known: uk)"),
            (
                "[[jobs]]\nname = \"j\"\nhandler = \"noop\"\nschedule = \"0 9 * * *\"\ncalendar = \"uk\"\n".into(),
                "there are no [[calendars]] entries",
            ),
            (format!("{UK}weekdays = []\n"), "calendars[0] (uk).weekdays: the calendar has no working day"),
            (format!("{UK}weekdays = [\"mon\", \"funday\"]\n"), "calendars[0] (uk).weekdays[1]: \"funday\" is not a weekday"),
            (UK.replace("12-25\"", "2026-02-30\""), "calendars[0] (uk).holidays[1]: \"2026-02-30\" is not a date"),
            (UK.replace("12-25\"", "13-01\""), "calendars[0] (uk).holidays[1]: \"13-01\" is not a month and day"),
            (format!("{UK}extra_working_days = [\"soon\"]\n"), "calendars[0] (uk).extra_working_days[0]"),
            (UK.replace("Europe/London", "Europe/Atlantis"), "calendars[0] (uk).zone: \"Europe/Atlantis\" is not an IANA time zone"),
            (format!("{UK}{UK}"), "calendars[1] (uk).name: duplicate calendar name"),
            (format!("{UK}colour = \"red\"\n"), "colour"),
            (job("business_day = 24"), "jobs[0] (pay).business_day: business_day = 24 can never match"),
            (job("business_day = 0"), "jobs[0] (pay).business_day: business_day = 0: 1 is the first"),
            (job("business_day = -1").replace("0 9 * * *", "0 9 1 * *"), "jobs[0] (pay).business_day: business_day = -1 picks the day"),
            (job("on_holiday = \"next_business_day\"").replace("0 9 * * *", "*/5 * * * *"), "jobs[0] (pay).on_holiday: moving slots"),
            (job("on_holiday = \"tomorrow\""), "on_holiday"),
            (job("business_day = -1\non_holiday = \"skip\""), "jobs[0] (pay).on_holiday: has no meaning with business_day"),
            (job("timezone = \"America/New_York\""), "jobs[0] (pay).timezone: \"America/New_York\" differs from the zone of calendar \"uk\" (Europe/London)"),
            (
                "[[jobs]]\nname = \"j\"\nhandler = \"noop\"\nschedule = \"0 9 * * *\"\non_holiday = \"skip\"\n".into(),
                "jobs[0] (j).on_holiday: needs jobs[].calendar",
            ),
            (format!("{UK}[[jobs]]\nname = \"j\"\nhandler = \"noop\"\ncalendar = \"uk\"\n"), "jobs[0] (j).calendar: applies to scheduled jobs only"),
        ] {
            let e = err(&text);
            assert!(e.contains(says), "{text}\n→ {e}");
        }
        // The calendar's own zone is the job's; naming it again is fine.
        Config::from_toml_str(&job("timezone = \"Europe/London\"\nbusiness_day = -1")).unwrap();
        // Extra working days alone make a calendar.
        Config::from_toml_str(
            "[[calendars]]\nname = \"x\"\nweekdays = []\nextra_working_days = [\"2026-12-19\"]\n",
        )
        .unwrap();
    }
}
