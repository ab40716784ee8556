//! Holidays from an iCalendar (RFC 5545) file: its all-day `VEVENT`s, one day or several
//! (`DTEND` is exclusive), and yearly ones (`RRULE:FREQ=YEARLY`, with `UNTIL` or `COUNT`).
//!
//! Anything else an event could say about when it happens (a time of day, another frequency,
//! `BYDAY`, `EXDATE`, `RDATE`) is refused, naming its line: a holiday file read differently
//! than its author meant would move payment runs without a word.

use super::Yearly;
use chrono::{Datelike, NaiveDate};

/// Why an `.ics` file cannot be read as holidays: the line (1-based) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct IcsError {
    /// The line, 1-based (where a folded line begins).
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

fn err(line: usize, message: impl Into<String>) -> IcsError {
    IcsError { line, message: message.into() }
}

/// The logical lines of `text` (folded lines joined), each with the number of its first line.
fn unfold(text: &str) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    for (i, raw) in text.split('\n').enumerate() {
        let raw = raw.strip_suffix('\r').unwrap_or(raw);
        match (raw.strip_prefix(' ').or_else(|| raw.strip_prefix('\t')), out.last_mut()) {
            (Some(rest), Some((_, last))) => last.push_str(rest),
            _ if raw.is_empty() => {}
            _ => out.push((i + 1, raw.to_string())),
        }
    }
    out
}

/// A content line's parameters (`VALUE=DATE`), names and values upper-cased.
type Params = Vec<(String, String)>;

/// A content line's name (upper-cased), parameters and value.
fn split(line: &str) -> Option<(String, Params, &str)> {
    let (head, value) = line.split_once(':')?;
    let mut parts = head.split(';');
    let name = parts.next()?.trim().to_ascii_uppercase();
    let params = parts
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (k.trim().to_ascii_uppercase(), v.trim().to_ascii_uppercase()))
        .collect();
    Some((name, params, value.trim()))
}

/// A `DATE` value (`20261225`), or why it is not an all-day date.
fn date(line: usize, what: &str, params: &[(String, String)], value: &str) -> Result<NaiveDate, IcsError> {
    if value.len() != 8 || params.iter().any(|(k, v)| k == "VALUE" && v != "DATE") {
        return Err(err(
            line,
            format!(
                "{what} {value:?} has a time of day: only all-day events (VALUE=DATE, YYYYMMDD) are holidays"
            ),
        ));
    }
    NaiveDate::parse_from_str(value, "%Y%m%d").map_err(|e| err(line, format!("{what} {value:?}: {e}")))
}

/// The yearly rule of an event starting on `start`.
fn yearly(line: usize, value: &str, start: NaiveDate) -> Result<(Option<NaiveDate>, Option<u32>), IcsError> {
    let (mut freq, mut until, mut count) = (None, None, None);
    for part in value.split(';').filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| err(line, format!("RRULE part {part:?} is not NAME=VALUE")))?;
        match k.to_ascii_uppercase().as_str() {
            "FREQ" => freq = Some(v.to_ascii_uppercase()),
            "INTERVAL" if v == "1" => {}
            "BYMONTH" if v.parse::<u32>().ok() == Some(start.month()) => {}
            "BYMONTHDAY" if v.parse::<u32>().ok() == Some(start.day()) => {}
            "WKST" => {}
            "UNTIL" => {
                let day = v.get(..8).unwrap_or(v);
                until = Some(
                    NaiveDate::parse_from_str(day, "%Y%m%d")
                        .map_err(|e| err(line, format!("RRULE UNTIL {v:?}: {e}")))?,
                );
            }
            "COUNT" => {
                count = Some(
                    v.parse::<u32>()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| err(line, format!("RRULE COUNT {v:?} is not a positive number")))?,
                );
            }
            other => {
                return Err(err(
                    line,
                    format!(
                        "RRULE {other}={v} is not supported: a holiday repeats every year on its date \
                         (FREQ=YEARLY, with UNTIL or COUNT); list moving holidays as dates"
                    ),
                ));
            }
        }
    }
    match freq.as_deref() {
        Some("YEARLY") => Ok((until, count)),
        Some(f) => Err(err(line, format!("RRULE FREQ={f}: only FREQ=YEARLY is supported for holidays"))),
        None => Err(err(line, "RRULE without FREQ")),
    }
}

/// An event being read.
#[derive(Default)]
struct Event {
    begin: usize,
    start: Option<NaiveDate>,
    end: Option<(usize, NaiveDate)>,
    rule: Option<(usize, String)>,
}

/// The holidays of an iCalendar file: dates, and yearly rules.
pub fn parse_ics(text: &str) -> Result<(Vec<NaiveDate>, Vec<Yearly>), IcsError> {
    let lines = unfold(text);
    match lines.first().and_then(|(_, l)| split(l)) {
        Some((name, _, value)) if name == "BEGIN" && value.eq_ignore_ascii_case("VCALENDAR") => {}
        _ => {
            return Err(err(
                lines.first().map_or(1, |l| l.0),
                "not an iCalendar file (BEGIN:VCALENDAR expected)",
            ));
        }
    }
    let (mut dates, mut rules) = (Vec::new(), Vec::new());
    let mut event: Option<Event> = None;
    let mut ended = false;
    for (n, line) in &lines {
        let n = *n;
        let Some((name, params, value)) = split(line) else {
            return Err(err(n, format!("{line:?} is not NAME:VALUE")));
        };
        match (name.as_str(), event.as_mut()) {
            ("BEGIN", None) if value.eq_ignore_ascii_case("VEVENT") => {
                event = Some(Event { begin: n, ..Default::default() });
            }
            ("BEGIN", Some(_)) if value.eq_ignore_ascii_case("VEVENT") => {
                return Err(err(n, "BEGIN:VEVENT inside an event"));
            }
            ("END", Some(_)) if value.eq_ignore_ascii_case("VEVENT") => {
                let Some(e) = event.take() else { continue };
                let start = e.start.ok_or_else(|| err(e.begin, "an event without DTSTART"))?;
                let end = match e.end {
                    Some((l, end)) if end <= start => {
                        return Err(err(l, format!("DTEND {end} is not after DTSTART {start}")));
                    }
                    Some((_, end)) => end,
                    None => start.succ_opt().unwrap_or(start),
                };
                let days: Vec<NaiveDate> = start.iter_days().take_while(|d| *d < end).take(366).collect();
                match &e.rule {
                    None => dates.extend(days),
                    Some((l, rule)) => {
                        let (until, count) = yearly(*l, rule, start)?;
                        let until = match count {
                            Some(c) => {
                                let last =
                                    start.year() + i32::try_from(c).unwrap_or(i32::MAX - start.year()) - 1;
                                let by_count = NaiveDate::from_ymd_opt(last, 12, 31);
                                until.into_iter().chain(by_count).min()
                            }
                            None => until,
                        };
                        rules.extend(days.iter().map(|d| Yearly {
                            month: d.month(),
                            day: d.day(),
                            from: d.year(),
                            until,
                        }));
                    }
                }
            }
            ("END", None) if value.eq_ignore_ascii_case("VCALENDAR") => ended = true,
            ("DTSTART", Some(e)) => e.start = Some(date(n, "DTSTART", &params, value)?),
            ("DTEND", Some(e)) => e.end = Some((n, date(n, "DTEND", &params, value)?)),
            ("DURATION", Some(_)) => {
                return Err(err(n, "DURATION is not supported: give an all-day event's end as DTEND"));
            }
            ("RRULE", Some(e)) => e.rule = Some((n, value.to_string())),
            ("EXDATE" | "RDATE", Some(_)) => {
                return Err(err(n, format!("{name} is not supported: list the holiday's dates as events")));
            }
            _ => {}
        }
    }
    if let Some(e) = event {
        return Err(err(e.begin, "an event without END:VEVENT"));
    }
    if !ended {
        return Err(err(lines.last().map_or(1, |l| l.0), "no END:VCALENDAR: the file is cut off"));
    }
    dates.sort();
    dates.dedup();
    Ok((dates, rules))
}
