//! Rate limits: `jobs[].rate_limit` and the named `[[limits]]` several jobs share. A limit is a
//! rate (`limit` runs per `per`, bursts of `burst`) that holds across every worker together
//! (computed in Redis, see `crate::limit`), optionally per tenant (`key`: a payload field or a
//! JSON pointer).

use super::*;

/// A rate: `limit` runs per `per`, with up to `burst` at once after a quiet spell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// Runs per `per` (1 to 1,000,000).
    pub limit: u32,
    /// The period (1 ms to 1 day).
    pub per: Duration,
    /// Runs allowed at once (default 1: runs evenly spaced, `per / limit` apart).
    pub burst: u32,
}

impl Rate {
    /// The spacing of runs at the sustained rate (`per / limit`), in microseconds.
    pub fn interval_us(&self) -> u64 {
        (self.per.as_micros() / u128::from(self.limit.max(1))).max(1).min(u128::from(u64::MAX)) as u64
    }

    /// Parses `"100/s"`, `"20/m"`, `"5/h"`, `"1000/d"` or `"100/10s"` (a count, `/`, then a
    /// unit or a duration).
    pub fn parse(s: &str) -> Result<Self, String> {
        let (n, per) = s.split_once('/').ok_or_else(|| {
            format!("{s:?}: a rate is a count, '/', then a period (\"100/s\", \"20/m\", \"5/10s\")")
        })?;
        let limit: u64 =
            n.trim().parse().map_err(|_| format!("{s:?}: {n:?} is not a whole number of runs"))?;
        let limit = u32::try_from(limit).unwrap_or(u32::MAX);
        let per = match per.trim() {
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            "d" => Duration::from_secs(86_400),
            // A unit alone, spelt out (`sec`, `minute`, `hour`): one of it.
            unit if unit.starts_with(|c: char| c.is_ascii_alphabetic()) => {
                duration::parse(&format!("1{unit}")).map_err(|e| {
                    format!("{s:?}: the period {unit:?} is not s, m, h, d or a duration ({e})")
                })?
            }
            other => duration::parse(other)
                .map_err(|e| format!("{s:?}: the period {other:?} is not s, m, h, d or a duration ({e})"))?,
        };
        let rate = Rate { limit, per, burst: 1 };
        rate.check()?;
        Ok(rate)
    }

    fn check(&self) -> Result<(), String> {
        if !(1..=1_000_000).contains(&self.limit) {
            return Err(format!("limit {}: must be 1 to 1,000,000 runs", self.limit));
        }
        if self.per < Duration::from_millis(1) || self.per > Duration::from_secs(86_400) {
            return Err(format!("per {}: must be 1 ms to 1 day", duration::format(self.per)));
        }
        if !(1..=1_000_000).contains(&self.burst) {
            return Err(format!("burst {}: must be 1 to 1,000,000", self.burst));
        }
        Ok(())
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.limit, duration::format(self.per))?;
        if self.burst > 1 {
            write!(f, " (burst {})", self.burst)?;
        }
        Ok(())
    }
}

/// Where the tenant a limit is taken per comes from in a run's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitKey {
    /// A top-level field of a JSON object payload (`key = "account_id"`).
    Field(String),
    /// A JSON pointer (`key = "/account/id"`).
    Pointer(String),
}

/// The bucket of runs whose payload has no value at the limit's `key` (or one that is not a
/// string, number or boolean): they share one limit, named so in logs and keys.
pub const NO_TENANT: &str = "-";

impl LimitKey {
    fn parse(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            return Err("must not be empty (a payload field such as \"account_id\", or a JSON pointer such as \"/account/id\")".into());
        }
        if let Some(rest) = s.strip_prefix('/') {
            if rest.is_empty() || rest.split('/').any(str::is_empty) {
                return Err(format!("{s:?}: a JSON pointer with an empty step can never match a field"));
            }
            // RFC 6901: `~` is only the start of `~0` (a `~`) or `~1` (a `/`).
            if rest.split('~').skip(1).any(|after| !after.starts_with(['0', '1'])) {
                return Err(format!("{s:?}: in a JSON pointer `~` is written ~0 and `/` ~1 (RFC 6901)"));
            }
            return Ok(LimitKey::Pointer(s.to_string()));
        }
        if s.chars().any(char::is_control) {
            return Err(format!("{s:?}: a field name without control characters"));
        }
        Ok(LimitKey::Field(s.to_string()))
    }

    /// The tenant of `payload`: the value at the key (a string as is, a number or boolean as
    /// JSON), else [`NO_TENANT`].
    pub fn tenant(&self, payload: &serde_json::Value) -> String {
        let v = match self {
            LimitKey::Field(f) => payload.get(f),
            LimitKey::Pointer(p) => payload.pointer(p),
        };
        match v {
            Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
            Some(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) => v.to_string(),
            _ => NO_TENANT.to_string(),
        }
    }
}

/// A rate limit: a rate, optionally per tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    /// The rate every worker together keeps to (per tenant with `key`).
    pub rate: Rate,
    /// The payload value the limit is taken per (one bucket per tenant).
    pub key: Option<LimitKey>,
}

/// A rate limit as TOML writes it: `"100/s"`, or a table with `rate` (or `limit` and `per`),
/// `burst` and `key`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimitTable {
    #[serde(default)]
    rate: Option<String>,
    #[serde(default)]
    limit: Option<u32>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    per: Option<Duration>,
    #[serde(default)]
    burst: Option<u32>,
    #[serde(default)]
    key: Option<String>,
}

impl RawLimitTable {
    fn into_limit(self) -> Result<RateLimit, String> {
        let mut rate = match (self.rate, self.limit, self.per) {
            (Some(r), None, None) => Rate::parse(&r)?,
            (None, Some(limit), per) => Rate { limit, per: per.unwrap_or(Duration::from_secs(1)), burst: 1 },
            (Some(_), _, _) => return Err("give `rate` or `limit` and `per`, not both".into()),
            (None, None, _) => {
                return Err("needs `rate` (\"100/s\") or `limit` (with `per`, default 1s)".into());
            }
        };
        if let Some(b) = self.burst {
            rate.burst = b;
        }
        rate.check()?;
        let key = self.key.as_deref().map(LimitKey::parse).transpose().map_err(|e| format!("key: {e}"))?;
        Ok(RateLimit { rate, key })
    }
}

/// `jobs[].rate_limit`: the job's own limit, or the name of a `[[limits]]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RateLimitRef {
    /// A limit of this job alone.
    Own(RateLimit),
    /// A `[[limits]]` entry several jobs may share.
    Named(String),
}

impl<'de> Deserialize<'de> for RateLimitRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let expected = "a rate (\"100/s\"), the name of a [[limits]] entry, or a table with rate (or limit and per), burst and key";
        match NameOrTable::deserialize(d, expected)? {
            NameOrTable::Name(s) if s.contains('/') => Rate::parse(&s)
                .map(|rate| RateLimitRef::Own(RateLimit { rate, key: None }))
                .map_err(serde::de::Error::custom),
            NameOrTable::Name(s) => Ok(RateLimitRef::Named(s)),
            NameOrTable::Table(t) => NameOrTable::read::<RawLimitTable, _>(t, RawLimitTable::into_limit)
                .map(RateLimitRef::Own)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// One `[[limits]]` entry: a rate limit several jobs share by name (`rate_limit = "stripe"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedLimit {
    /// The name jobs refer to it by: letters, digits, `-`, `_`, `.`.
    pub name: String,
    /// The limit.
    pub limit: RateLimit,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNamedLimit {
    name: String,
    #[serde(default)]
    rate: Option<String>,
    #[serde(default)]
    limit: Option<u32>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    per: Option<Duration>,
    #[serde(default)]
    burst: Option<u32>,
    #[serde(default)]
    key: Option<String>,
}

/// `[[limits]]` with each entry's index in its errors.
pub(super) fn de_limits<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<NamedLimit>, D::Error> {
    let raw = Vec::<RawNamedLimit>::deserialize(d)?;
    raw.into_iter()
        .enumerate()
        .map(|(i, l)| {
            let table =
                RawLimitTable { rate: l.rate, limit: l.limit, per: l.per, burst: l.burst, key: l.key };
            table
                .into_limit()
                .map(|limit| NamedLimit { name: l.name.clone(), limit })
                .map_err(|e| serde::de::Error::custom(format!("limits[{i}] ({}): {e}", l.name)))
        })
        .collect()
}

/// The rules of `[[limits]]` and of the jobs' references to them.
pub(super) fn validate(limits: &[NamedLimit], jobs: &[JobConfig]) -> Result<(), ConfigError> {
    let names = entry_names("limits", "limit", limits.iter().map(|l| l.name.as_str()))?;
    for (i, job) in jobs.iter().enumerate() {
        if let Some(RateLimitRef::Named(n)) = &job.rate_limit
            && !names.contains(n.as_str())
        {
            return Err(ConfigError::invalid(
                format!("jobs[{i}] ({}).rate_limit", job.name),
                format!(
                    "{n:?} is neither a rate (\"100/s\") nor the name of a [[limits]] entry ({})",
                    known_entries("limits", &names)
                ),
            ));
        }
    }
    Ok(())
}

/// The names of a `[[<section>]]` array, each checked (valid, not repeated).
pub(super) fn entry_names<'a>(
    section: &str,
    what: &str,
    names: impl Iterator<Item = &'a str>,
) -> Result<BTreeSet<&'a str>, ConfigError> {
    let mut seen = BTreeSet::new();
    for (i, name) in names.enumerate() {
        if !valid_name(name) {
            return Err(ConfigError::invalid(
                format!("{section}[{i}].name"),
                format!("{name:?} must be 1-100 letters, digits, '-', '_' or '.'"),
            ));
        }
        if !seen.insert(name) {
            return Err(ConfigError::invalid(
                format!("{section}[{i}] ({name}).name"),
                format!("duplicate {what} name"),
            ));
        }
    }
    Ok(seen)
}

/// "known: a, b", or that there are none, for an error naming an unknown entry.
pub(super) fn known_entries(section: &str, names: &BTreeSet<&str>) -> String {
    if names.is_empty() {
        format!("there are no [[{section}]] entries")
    } else {
        format!("known: {}", names.iter().copied().collect::<Vec<_>>().join(", "))
    }
}

/// The limit a job's runs take, resolved: the bucket it counts in (`job:<name>` for a job's
/// own, `limit:<name>` for a shared one) and the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedLimit {
    /// The Redis bucket's name (before the tenant).
    pub bucket: String,
    /// The limit.
    pub limit: RateLimit,
}

impl Config {
    /// The rate limit `job`'s runs take, if any.
    pub fn rate_limit_of(&self, job: &str) -> Option<ResolvedLimit> {
        match &self.job(job)?.rate_limit {
            None => None,
            Some(RateLimitRef::Own(limit)) => {
                Some(ResolvedLimit { bucket: format!("job:{job}"), limit: limit.clone() })
            }
            Some(RateLimitRef::Named(n)) => self
                .limits
                .iter()
                .find(|l| l.name == *n)
                .map(|l| ResolvedLimit { bucket: format!("limit:{n}"), limit: l.limit.clone() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_with_units_and_durations_and_refuse_by_name() {
        let r = Rate::parse("100/s").unwrap();
        assert_eq!((r.limit, r.per, r.burst, r.interval_us()), (100, Duration::from_secs(1), 1, 10_000));
        assert_eq!(Rate::parse("20/m").unwrap().interval_us(), 3_000_000);
        assert_eq!(Rate::parse("5/10s").unwrap().per, Duration::from_secs(10));
        // A unit spelt out is one of it.
        for (text, secs) in
            [("100/sec", 1), ("100/second", 1), ("20/min", 60), ("20/minute", 60), ("5/hour", 3600)]
        {
            assert_eq!(Rate::parse(text).unwrap().per, Duration::from_secs(secs), "{text}");
        }
        for (bad, says) in [
            ("1000000000000/s", "1 to 1,000,000 runs"),
            ("99999999999999999999999/s", "not a whole number"),
            ("100", "a count, '/'"),
            ("x/s", "not a whole number"),
            ("0/s", "1 to 1,000,000"),
            ("10/fortnight", "not s, m, h, d"),
            ("10/0s", "1 ms to 1 day"),
        ] {
            let e = Rate::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn limits_in_the_config_resolve_and_bad_ones_are_refused_by_name() {
        let job = |extra: &str| format!("[[jobs]]\nname = \"charge\"\nhandler = \"noop\"\n{extra}\n");
        let ok = Config::from_toml_str(&format!(
            "{}{}[[limits]]\nname = \"stripe\"\nlimit = 100\nper = \"1s\"\nburst = 10\nkey = \"/account/id\"\n",
            job("rate_limit = \"stripe\""),
            "[[jobs]]\nname = \"mail\"\nhandler = \"noop\"\nrate_limit = { rate = \"20/m\", key = \"to\" }\n",
        ))
        .unwrap();
        let stripe = ok.rate_limit_of("charge").unwrap();
        assert_eq!(stripe.bucket, "limit:stripe");
        assert_eq!((stripe.limit.rate.limit, stripe.limit.rate.burst), (100, 10));
        assert_eq!(stripe.limit.key, Some(LimitKey::Pointer("/account/id".into())));
        let mail = ok.rate_limit_of("mail").unwrap();
        assert_eq!((mail.bucket.as_str(), mail.limit.rate.interval_us()), ("job:mail", 3_000_000));
        let err = |text: &str| Config::from_toml_str(text).unwrap_err().to_string();
        for (text, says) in [
            (job("rate_limit = \"stripe\""), "jobs[0] (charge).rate_limit: \"stripe\" is neither a rate"),
            (job("rate_limit = \"0/s\""), "1 to 1,000,000"),
            (job("rate_limit = \"100/s\"\n[[limits]]\nname = \"x\"\nrate = \"1/s\"\nwindow = 3"), "window"),
            (job("rate_limit = { rate = \"5/s\", burst = 0 }"), "burst 0"),
            (job("rate_limit = { limit = 5, per = \"0s\" }"), "per 0s: must be 1 ms to 1 day"),
            (job("rate_limit = { limit = \"5\", per = \"1s\" }"), "limit: invalid type: string \"5\""),
            (job("rate_limit = { rate = \"5/s\", window = 3 }"), "unknown field `window`"),
            (job("rate_limit = { limit = 5, rate = \"5/s\" }"), "not both"),
            (job("rate_limit = { rate = \"5/s\", key = \"/a//b\" }"), "can never match"),
            (job("rate_limit = { per = \"1s\" }"), "needs `rate`"),
            (
                job("rate_limited_exit_codes = [75]"),
                "jobs[0] (charge).rate_limited_exit_codes: only valid with handler \"exec\"",
            ),
            ("[worker]\nmax_hold = \"5m\"\n".to_string(), "worker.max_hold"),
            ("[worker]\npark_pack = 0\n".to_string(), "worker.park_pack: must be 1"),
            ("[worker]\npark_pack = 1001\n".to_string(), "worker.park_pack: must be 1"),
            (
                "[[limits]]\nname = \"a\"\nrate = \"1/s\"\n[[limits]]\nname = \"a\"\nrate = \"2/s\"\n"
                    .to_string(),
                "limits[1] (a).name: duplicate",
            ),
        ] {
            let e = err(&text);
            assert!(e.contains(says), "{text}\n→ {e}");
        }
    }

    #[test]
    fn tenants_come_from_a_field_or_a_pointer_and_default_to_one_named_bucket() {
        let p = serde_json::json!({"account_id": "acme", "n": 7, "deep": {"id": 3}});
        assert_eq!(LimitKey::parse("account_id").unwrap().tenant(&p), "acme");
        assert_eq!(LimitKey::parse("n").unwrap().tenant(&p), "7");
        assert_eq!(LimitKey::parse("/deep/id").unwrap().tenant(&p), "3");
        assert_eq!(LimitKey::parse("missing").unwrap().tenant(&p), NO_TENANT);
        assert_eq!(LimitKey::parse("account_id").unwrap().tenant(&serde_json::json!([1])), NO_TENANT);
        assert!(LimitKey::parse("/a//b").unwrap_err().contains("can never match"));
        assert!(LimitKey::parse("").is_err());
        assert!(LimitKey::parse("/a/~2").unwrap_err().contains("RFC 6901"));
        assert!(LimitKey::parse("/a~").unwrap_err().contains("RFC 6901"));
        let escaped = serde_json::json!({"a/b": {"~c": "t"}});
        assert_eq!(LimitKey::parse("/a~1b/~0c").unwrap().tenant(&escaped), "t");
    }
}
