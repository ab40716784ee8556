//! Human-readable durations in config files (`"30s"`, `"5m"`, `"7d"`).

use serde::{Deserialize, Deserializer, de::Error as _};
use std::time::Duration;

/// Parses a duration such as `"1500ms"`, `"30s"`, `"5m"`, `"2h"` or `"7d"`.
pub fn parse(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("invalid duration {text:?} ({e}); use forms like \"30s\", \"5m\", \"7d\""))
}

/// Formats a duration the way the config expects it back.
pub fn format(d: Duration) -> String {
    humantime::format_duration(d).to_string()
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
}
