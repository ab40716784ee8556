//! The envelope's instants as chrono's serde writes them (RFC 3339 in UTC with `Z`, and 0, 3,
//! 6 or 9 fractional digits, whichever is shortest without loss), written by hand: chrono goes
//! through the formatting machinery, a fifth of the cost of encoding an envelope.

use chrono::{DateTime, Datelike, Timelike, Utc};
use serde::{Serialize, Serializer};

/// The longest text written: `YYYY-MM-DDTHH:MM:SS.nnnnnnnnnZ`.
const LONGEST: usize = 30;

/// `t` in RFC 3339, written into `buf`; `None` for what chrono spells differently (a year
/// outside 0–9999, a leap second), left to chrono.
fn write(t: &DateTime<Utc>, buf: &mut [u8; LONGEST]) -> Option<usize> {
    let year = u32::try_from(t.year()).ok().filter(|y| *y <= 9999)?;
    let nano = t.nanosecond();
    if nano >= 1_000_000_000 {
        return None;
    }
    let mut two = |at: usize, n: u32| {
        buf[at] = b'0' + (n / 10) as u8;
        buf[at + 1] = b'0' + (n % 10) as u8;
    };
    two(0, year / 100);
    two(2, year % 100);
    two(5, t.month());
    two(8, t.day());
    two(11, t.hour());
    two(14, t.minute());
    two(17, t.second());
    for (at, c) in [(4, b'-'), (7, b'-'), (10, b'T'), (13, b':'), (16, b':')] {
        buf[at] = c;
    }
    let (digits, mut frac) = match nano {
        0 => (0, 0),
        n if n % 1_000_000 == 0 => (3, n / 1_000_000),
        n if n % 1_000 == 0 => (6, n / 1_000),
        n => (9, n),
    };
    let mut end = 19;
    if digits > 0 {
        buf[19] = b'.';
        for i in (0..digits).rev() {
            buf[20 + i] = b'0' + (frac % 10) as u8;
            frac /= 10;
        }
        end = 20 + digits;
    }
    buf[end] = b'Z';
    Some(end + 1)
}

/// Serialises an instant exactly as `DateTime<Utc>`'s own `Serialize` does.
pub(super) fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    let mut buf = [0u8; LONGEST];
    match write(t, &mut buf).and_then(|n| std::str::from_utf8(&buf[..n]).ok()) {
        Some(text) => s.serialize_str(text),
        None => t.serialize(s),
    }
}

/// [`serialize`] for an optional instant.
pub(super) fn serialize_opt<S: Serializer>(t: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
    /// One instant, written by [`serialize`].
    struct Instant<'a>(&'a DateTime<Utc>);
    impl Serialize for Instant<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            serialize(self.0, s)
        }
    }
    match t {
        Some(t) => s.serialize_some(&Instant(t)),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    /// The text chrono writes and this module's, for the same instant.
    fn both(t: DateTime<Utc>) -> (String, String) {
        let mut ours = Vec::new();
        serialize(&t, &mut serde_json::Serializer::new(&mut ours)).unwrap();
        (serde_json::to_string(&t).unwrap(), String::from_utf8(ours).unwrap())
    }

    #[test]
    fn every_instant_is_written_as_chrono_writes_it() {
        // A cheap deterministic generator: seconds across years 0–9999, and each precision.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let lowest = Utc.with_ymd_and_hms(0, 1, 1, 0, 0, 0).unwrap().timestamp();
        let highest = Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap().timestamp();
        for i in 0..200_000u64 {
            let secs = lowest + (next() % (highest - lowest + 1) as u64) as i64;
            let n = (next() % 1_000_000_000) as u32;
            let nano = match i % 5 {
                0 => 0,
                1 => n / 1_000_000 * 1_000_000,
                2 => n / 1_000 * 1_000,
                3 => n,
                _ => (n % 10) * 100_000_000 + 1,
            };
            let t = Utc.timestamp_opt(secs, nano).unwrap();
            let (chrono, ours) = both(t);
            assert_eq!(ours, chrono, "{secs} s {nano} ns");
        }
        for t in [
            Utc.timestamp_opt(0, 0).unwrap(),
            Utc.with_ymd_and_hms(0, 1, 1, 0, 0, 0).unwrap(),
            Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap(),
            Utc.with_ymd_and_hms(2026, 3, 29, 1, 30, 0).unwrap(),
        ] {
            let (chrono, ours) = both(t);
            assert_eq!(ours, chrono);
        }
    }

    #[test]
    fn what_chrono_spells_its_own_way_is_left_to_it() {
        let leap = chrono::NaiveDate::from_ymd_opt(2016, 12, 31)
            .unwrap()
            .and_hms_nano_opt(23, 59, 59, 1_500_000_000)
            .unwrap()
            .and_utc();
        let far = Utc.with_ymd_and_hms(10_000, 1, 1, 0, 0, 0).unwrap();
        let before = Utc.with_ymd_and_hms(-1, 6, 1, 12, 0, 0).unwrap();
        for t in [leap, far, before] {
            let mut buf = [0u8; LONGEST];
            assert_eq!(write(&t, &mut buf), None, "{t:?}");
            let (chrono, ours) = both(t);
            assert_eq!(ours, chrono);
        }
    }
}
