//! Human-readable durations in config files (`"30s"`, `"5m"`, `"7d"`).

use serde::{Deserialize, Deserializer, de::Error as _};
use std::time::Duration;

/// Parses a duration such as `"1500ms"`, `"30s"`, `"5m"`, `"2h"` or `"7d"`.
pub fn parse(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("invalid duration {text:?} ({e}); use forms like \"30s\", \"5m\", \"7d\""))
}

/// Formats a duration the way the config expects it back, in the config's own units (`"7d"`,
/// `"1h 30m"`, `"1s 500ms"`; below a millisecond, `"250us"`). `parse` reads every answer back
/// to the same duration. (humantime's own format writes `"7days"` and counts months of 30.44
/// days: `"1month 29days 13h 26m 24s"` for 60 days.)
pub fn format(d: Duration) -> String {
    const UNITS: [(u64, &str); 4] = [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")];
    let mut parts = Vec::new();
    let mut secs = d.as_secs();
    for (size, unit) in UNITS {
        if secs >= size {
            parts.push(format!("{}{unit}", secs / size));
            secs %= size;
        }
    }
    let nanos = d.subsec_nanos();
    for (size, unit) in [(1_000_000, "ms"), (1_000, "us"), (1, "ns")] {
        let part = nanos / size % 1_000;
        if part > 0 {
            parts.push(format!("{part}{unit}"));
        }
    }
    if parts.is_empty() { "0s".to_string() } else { parts.join(" ") }
}

/// `#[serde(deserialize_with = "chime_job::duration::de")]`
pub fn de<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    parse(&text).map_err(D::Error::custom)
}

/// Like [`de`] for an optional field.
pub fn de_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = Option::<String>::deserialize(d)?;
    text.map(|t| parse(&t).map_err(D::Error::custom)).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse("30").is_err());
        assert!(parse("soon").is_err());
    }

    #[test]
    fn formats_in_the_configs_units_and_reads_back() {
        let cases = [
            (Duration::from_secs(7 * 86_400), "7d"),
            (Duration::from_secs(60 * 86_400), "60d"),
            (Duration::from_secs(5_400), "1h 30m"),
            (Duration::from_secs(300), "5m"),
            (Duration::from_millis(1_500), "1s 500ms"),
            (Duration::from_micros(250), "250us"),
            (Duration::ZERO, "0s"),
            (Duration::new(90_061, 2_003_004), "1d 1h 1m 1s 2ms 3us 4ns"),
        ];
        for (d, text) in cases {
            assert_eq!(format(d), text);
            assert_eq!(parse(text), Ok(d), "{text}");
        }
    }
}
