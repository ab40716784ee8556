//! Circuit breakers: `jobs[].circuit` and the named `[[circuits]]` several jobs calling one
//! downstream share. A circuit counts the runs that end (succeeded or failed) over a rolling
//! `window`; once at least `min_volume` runs ended in it and the failures reach `failures` (a
//! count) or `failure_ratio` (a share), it opens for every worker (state in Redis, see
//! `crate::idempotency::circuit`): runs are parked (or dead-lettered, `on_open`) without
//! running or using an attempt. After `open_for` it lets `probes` runs through; a probe that
//! succeeds closes it, one that fails opens it again.

use super::*;

/// What happens to a run that finds its circuit open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnOpen {
    /// Parked until the circuit may let a probe through; its attempt is not used (default).
    #[default]
    Park,
    /// Dead-lettered at once with reason `circuit_open` (replay it once the downstream is back).
    DeadLetter,
}

/// When a circuit opens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Trip {
    /// This many failures in the window.
    Failures(u32),
    /// This share of the runs that ended in the window failed (0 < ratio ≤ 1).
    Ratio(f64),
}

/// A circuit breaker's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Circuit {
    /// When it opens.
    pub trip: Trip,
    /// The rolling window the runs are counted over (1 s to 1 day; default 60 s).
    pub window: Duration,
    /// Runs that must have ended in the window before it may open (default: `failures`, or 10
    /// with `failure_ratio`): three failures at night do not open a circuit set to a ratio.
    pub min_volume: u32,
    /// How long it stays open before probes go through (1 s to 1 day; default 30 s).
    pub open_for: Duration,
    /// Runs let through at once while half-open (1 to 1,000; default 1).
    pub probes: u32,
    /// What a run that finds it open does.
    pub on_open: OnOpen,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCircuit {
    #[serde(default)]
    failures: Option<u32>,
    #[serde(default)]
    failure_ratio: Option<f64>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    window: Option<Duration>,
    #[serde(default)]
    min_volume: Option<u32>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    open_for: Option<Duration>,
    #[serde(default)]
    probes: Option<u32>,
    #[serde(default)]
    on_open: Option<OnOpen>,
}

impl RawCircuit {
    fn into_circuit(self) -> Result<Circuit, String> {
        let trip = match (self.failures, self.failure_ratio) {
            (Some(_), Some(_)) => return Err("give `failures` or `failure_ratio`, not both".into()),
            (None, None) => {
                return Err("needs `failures` (a count) or `failure_ratio` (0.0 < r <= 1.0)".into());
            }
            (Some(n), None) if !(1..=1_000_000).contains(&n) => {
                return Err(format!("failures {n}: must be 1 to 1,000,000"));
            }
            (Some(n), None) => Trip::Failures(n),
            (None, Some(r)) if !(r > 0.0 && r <= 1.0) => {
                return Err(format!("failure_ratio {r}: must be above 0.0 and at most 1.0"));
            }
            (None, Some(r)) => Trip::Ratio(r),
        };
        let window = self.window.unwrap_or(Duration::from_secs(60));
        let open_for = self.open_for.unwrap_or(Duration::from_secs(30));
        for (name, d) in [("window", window), ("open_for", open_for)] {
            if d < Duration::from_secs(1) || d > Duration::from_secs(86_400) {
                return Err(format!("{name} {}: must be 1s to 1 day", duration::format(d)));
            }
        }
        let min_volume = self.min_volume.unwrap_or(match trip {
            Trip::Failures(n) => n,
            Trip::Ratio(_) => 10,
        });
        if !(1..=1_000_000).contains(&min_volume) {
            return Err(format!("min_volume {min_volume}: must be 1 to 1,000,000"));
        }
        let probes = self.probes.unwrap_or(1);
        if !(1..=1_000).contains(&probes) {
            return Err(format!("probes {probes}: must be 1 to 1,000"));
        }
        Ok(Circuit { trip, window, min_volume, open_for, probes, on_open: self.on_open.unwrap_or_default() })
    }
}

impl std::fmt::Display for Circuit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.trip {
            Trip::Failures(n) => write!(f, "{n} failures")?,
            Trip::Ratio(r) => write!(f, "{:.0}% failed", r * 100.0)?,
        }
        write!(
            f,
            " in {} (min {} runs), open {}, {} probe{}",
            duration::format(self.window),
            self.min_volume,
            duration::format(self.open_for),
            self.probes,
            if self.probes == 1 { "" } else { "s" }
        )?;
        if self.on_open == OnOpen::DeadLetter {
            f.write_str(", dead-letter while open")?;
        }
        Ok(())
    }
}

/// `jobs[].circuit`: the job's own circuit, or the name of a `[[circuits]]` entry.
#[derive(Debug, Clone, PartialEq)]
pub enum CircuitRef {
    /// A circuit of this job alone (named after the job).
    Own(Circuit),
    /// A `[[circuits]]` entry several jobs may share.
    Named(String),
}

impl<'de> Deserialize<'de> for CircuitRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let expected = "the name of a [[circuits]] entry, or a table with failures (or failure_ratio), window, min_volume, open_for, probes and on_open";
        match NameOrTable::deserialize(d, expected)? {
            NameOrTable::Name(s) => Ok(CircuitRef::Named(s)),
            NameOrTable::Table(t) => NameOrTable::read::<RawCircuit, _>(t, RawCircuit::into_circuit)
                .map(CircuitRef::Own)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// One `[[circuits]]` entry: a circuit several jobs share by name (`circuit = "stripe"`).
#[derive(Debug, Clone, PartialEq)]
pub struct NamedCircuit {
    /// The name jobs (and `chime circuit open|close`) refer to it by.
    pub name: String,
    /// The circuit.
    pub circuit: Circuit,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNamedCircuit {
    name: String,
    #[serde(default)]
    failures: Option<u32>,
    #[serde(default)]
    failure_ratio: Option<f64>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    window: Option<Duration>,
    #[serde(default)]
    min_volume: Option<u32>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    open_for: Option<Duration>,
    #[serde(default)]
    probes: Option<u32>,
    #[serde(default)]
    on_open: Option<OnOpen>,
}

/// `[[circuits]]` with each entry's index in its errors.
pub(super) fn de_circuits<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<NamedCircuit>, D::Error> {
    let raw = Vec::<RawNamedCircuit>::deserialize(d)?;
    raw.into_iter()
        .enumerate()
        .map(|(i, c)| {
            let body = RawCircuit {
                failures: c.failures,
                failure_ratio: c.failure_ratio,
                window: c.window,
                min_volume: c.min_volume,
                open_for: c.open_for,
                probes: c.probes,
                on_open: c.on_open,
            };
            body.into_circuit()
                .map(|circuit| NamedCircuit { name: c.name.clone(), circuit })
                .map_err(|e| serde::de::Error::custom(format!("circuits[{i}] ({}): {e}", c.name)))
        })
        .collect()
}

/// The rules of `[[circuits]]` and of the jobs' references to them. A job's own circuit is
/// named after the job, so a `[[circuits]]` entry may not take the name of such a job.
pub(super) fn validate(circuits: &[NamedCircuit], jobs: &[JobConfig]) -> Result<(), ConfigError> {
    let names = super::limits::entry_names("circuits", "circuit", circuits.iter().map(|c| c.name.as_str()))?;
    for (i, c) in circuits.iter().enumerate() {
        if let Some(job) =
            jobs.iter().find(|j| j.name == c.name && matches!(j.circuit, Some(CircuitRef::Own(_))))
        {
            return Err(ConfigError::invalid(
                format!("circuits[{i}] ({}).name", c.name),
                format!(
                    "job {:?} has a circuit of its own, named after it; name this one otherwise",
                    job.name
                ),
            ));
        }
    }
    for (i, job) in jobs.iter().enumerate() {
        if let Some(CircuitRef::Named(n)) = &job.circuit
            && !names.contains(n.as_str())
        {
            return Err(ConfigError::invalid(
                format!("jobs[{i}] ({}).circuit", job.name),
                format!(
                    "{n:?} is not the name of a [[circuits]] entry ({})",
                    super::limits::known_entries("circuits", &names)
                ),
            ));
        }
    }
    Ok(())
}

/// The circuit a job's runs go through, resolved: its name (the `[[circuits]]` entry's, or the
/// job's for a circuit of its own) and settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedCircuit {
    /// The circuit's name (its Redis key, its metric label, what `chime circuit` takes).
    pub name: String,
    /// The settings.
    pub circuit: Circuit,
}

impl Config {
    /// The circuit `job`'s runs go through, if any.
    pub fn circuit_of(&self, job: &str) -> Option<ResolvedCircuit> {
        match &self.job(job)?.circuit {
            None => None,
            Some(CircuitRef::Own(circuit)) => {
                Some(ResolvedCircuit { name: job.to_string(), circuit: circuit.clone() })
            }
            Some(CircuitRef::Named(n)) => self
                .circuits
                .iter()
                .find(|c| c.name == *n)
                .map(|c| ResolvedCircuit { name: n.clone(), circuit: c.circuit.clone() }),
        }
    }

    /// Every circuit of the config, by name, with the jobs that go through it.
    pub fn all_circuits(&self) -> Vec<(ResolvedCircuit, Vec<String>)> {
        let mut out: Vec<(ResolvedCircuit, Vec<String>)> = self
            .circuits
            .iter()
            .map(|c| (ResolvedCircuit { name: c.name.clone(), circuit: c.circuit.clone() }, Vec::new()))
            .collect();
        for job in &self.jobs {
            let Some(resolved) = self.circuit_of(&job.name) else { continue };
            match out.iter_mut().find(|(c, _)| c.name == resolved.name) {
                Some((_, jobs)) => jobs.push(job.name.clone()),
                None => out.push((resolved, vec![job.name.clone()])),
            }
        }
        out.sort_by(|a, b| a.0.name.cmp(&b.0.name));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn circuits_in_the_config_resolve_and_bad_ones_are_refused_by_name() {
        let job =
            |name: &str, extra: &str| format!("[[jobs]]\nname = \"{name}\"\nhandler = \"noop\"\n{extra}\n");
        let ok = Config::from_toml_str(&format!(
            "{}{}{}[[circuits]]\nname = \"stripe\"\nfailure_ratio = 0.5\nwindow = \"30s\"\nopen_for = \"10s\"\nprobes = 2\n",
            job("charge", "circuit = \"stripe\""),
            job("refund", "circuit = \"stripe\""),
            job("mail", "circuit = { failures = 5, on_open = \"dead_letter\" }"),
        ))
        .unwrap();
        let stripe = ok.circuit_of("charge").unwrap();
        assert_eq!(stripe.name, "stripe");
        assert_eq!(stripe.circuit.trip, Trip::Ratio(0.5));
        assert_eq!((stripe.circuit.min_volume, stripe.circuit.probes), (10, 2));
        assert_eq!(stripe.circuit.on_open, OnOpen::Park);
        let mail = ok.circuit_of("mail").unwrap();
        assert_eq!((mail.name.as_str(), mail.circuit.trip), ("mail", Trip::Failures(5)));
        assert_eq!(
            (mail.circuit.min_volume, mail.circuit.window, mail.circuit.open_for),
            (5, Duration::from_secs(60), Duration::from_secs(30))
        );
        assert_eq!(mail.circuit.on_open, OnOpen::DeadLetter);
        let all = ok.all_circuits();
        assert_eq!(
            all.iter().map(|(c, j)| (c.name.as_str(), j.clone())).collect::<Vec<_>>(),
            [("mail", vec!["mail".to_string()]), ("stripe", vec!["charge".into(), "refund".into()])]
        );
        let err = |text: &str| Config::from_toml_str(text).unwrap_err().to_string();
        for (text, says) in [
            (
                job("charge", "circuit = \"stripe\""),
                "jobs[0] (charge).circuit: \"stripe\" is not the name of a [[circuits]] entry (there are no",
            ),
            (job("charge", "circuit = { failures = 0 }"), "failures 0: must be 1"),
            (job("charge", "circuit = { failure_ratio = 1.5 }"), "failure_ratio 1.5"),
            (job("charge", "circuit = { failure_ratio = 0.0 }"), "failure_ratio 0"),
            (job("charge", "circuit = { failures = 3, failure_ratio = 0.5 }"), "not both"),
            (job("charge", "circuit = { window = \"10s\" }"), "needs `failures`"),
            (job("charge", "circuit = { failures = 3, window = \"0s\" }"), "window 0s: must be 1s to 1 day"),
            (job("charge", "circuit = { failures = 3, window = 10 }"), "window"),
            (job("charge", "circuit = { failures = 3, probes = 0 }"), "probes 0"),
            (
                job("charge", "circuit = { failures = 3, on_open = \"drop\" }"),
                "): on_open: unknown variant `drop`, expected `park` or `dead_letter`",
            ),
            (job("charge", "circuit = { failures = 3, cooldown = \"1s\" }"), "unknown field `cooldown`"),
            (job("charge", "circuit = 3"), "the name of a [[circuits]] entry, or a table"),
            (
                format!(
                    "{}[[circuits]]\nname = \"charge\"\nfailures = 3\n",
                    job("charge", "circuit = { failures = 3 }")
                ),
                "circuits[0] (charge).name: job \"charge\" has a circuit of its own",
            ),
            (
                "[[circuits]]\nname = \"a\"\nfailures = 1\n[[circuits]]\nname = \"a\"\nfailures = 2\n"
                    .to_string(),
                "circuits[1] (a).name: duplicate",
            ),
            (
                "[[circuits]]\nname = \"a\"\nfailures = 1\nopen_for = \"2d\"\n".to_string(),
                "circuits[0] (a): open_for 2d",
            ),
        ] {
            let e = err(&text);
            assert!(e.contains(says), "{text}\n→ {e}");
        }
    }
}
