//! `[[jobs]]`: a job's definition (handler, schedule, policies), how the TOML is read into it, and its rules.

use super::*;

/// Missed-slot policy of a schedule, after an outage of every ticker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CatchUp {
    /// Every missed slot within the window, oldest first.
    All,
    /// Only the newest missed slot.
    Latest,
    /// Nothing from the outage; resume at the next slot.
    None,
}

/// What the ticker does with a slot whose previous run is still in progress (not yet done or
/// dead: queued, running, or between retries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Publish it anyway (runs may overlap).
    #[default]
    Allow,
    /// Skip it (counted in `chime_slots_overlapped_total`, recorded in the history).
    Skip,
    /// Hold it until the previous run ends, then publish it; at most one waits, later ones
    /// are skipped.
    BufferOne,
}

impl Overlap {
    /// `allow`, `skip` or `buffer_one`, as the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::Allow => "allow",
            Overlap::Skip => "skip",
            Overlap::BufferOne => "buffer_one",
        }
    }
}

/// How many copies of each slot (or ad-hoc enqueue) a sharded job fans out to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(untagged)]
pub enum Shards {
    /// A fixed number, 1 to 1,000.
    Count(u32),
    /// As many as workers consume the job's queue when the slot is published.
    Workers,
}

impl<'de> Deserialize<'de> for Shards {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "a number of shards (1 to 1000), or \"workers\"")]
        enum Raw {
            N(i64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) if (1..=1000).contains(&n) => Ok(Shards::Count(n as u32)),
            Raw::N(n) => {
                Err(serde::de::Error::custom(format!("{n}: must be between 1 and 1000, or \"workers\"")))
            }
            Raw::S(s) if s == "workers" => Ok(Shards::Workers),
            Raw::S(s) => Err(serde::de::Error::custom(format!("{s:?}: a number of shards, or \"workers\""))),
        }
    }
}

/// One `[[jobs]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "RawJobConfig")]
pub struct JobConfig {
    /// The job's name (required): letters, digits, `-`, `_`, `.`.
    pub name: String,
    /// Cron expression (5 or 6 fields, or a macro such as `@daily`); absent = ad-hoc only.
    pub schedule: Option<String>,
    /// IANA zone of the schedule; default UTC.
    pub timezone: Option<String>,
    /// Queue; default `default`.
    pub queue: Option<String>,
    /// What runs the job, with the settings only that handler has.
    pub handler: HandlerConfig,
    /// Default payload (scheduled runs, and `chime enqueue` without `--payload`).
    pub payload: Option<serde_json::Value>,
    /// Attempts in all, first run included (default 5, at most 1,000).
    pub max_attempts: Option<u32>,
    /// Retry delays (default 5 s doubling to 1 h).
    pub backoff: Option<BackoffConfig>,
    /// Handler timeout (default `worker.default_timeout`).
    pub timeout: Option<Duration>,
    /// After an outage of every ticker (default `all`).
    pub catch_up: Option<CatchUp>,
    /// How far back missed slots are caught up (default 1 h).
    pub catch_up_window: Option<Duration>,
    /// A slot started later than slot + deadline is skipped (`expired`).
    pub deadline: Option<Duration>,
    /// Publish up to this much after the slot, deterministically per slot.
    pub jitter: Option<Duration>,
    /// Runs of this job at once in one worker process (default: 8 for `exec`, otherwise
    /// `worker.concurrency`): heavy handlers bounded, light ones run wide.
    pub concurrency: Option<usize>,
    /// Runs of this job at once across every worker sharing the prefix (slots leased in
    /// Redis; a dead worker's slot lapses after `redis.lease`).
    pub global_concurrency: Option<usize>,
    /// A scheduled job's slot whose previous run is still in progress (default `allow`).
    pub overlap: Overlap,
    /// Fan each slot (or ad-hoc enqueue) out to this many messages, one per shard.
    pub shards: Option<Shards>,
    /// A sharded job's members travel up to this many per AMQP message (a pack, 2 to 1,000)
    /// when the ticker publishes a slot or `chime enqueue` one job; unset: one message each.
    pub pack: Option<usize>,
    /// Run each slot once on every live worker consuming the job's queue.
    pub broadcast: bool,
    /// Delivery order when a backlog exists (default `normal`).
    pub priority: Option<Priority>,
    /// The rate every worker together runs this job at (its own, or a `[[limits]]` entry's).
    pub rate_limit: Option<RateLimitRef>,
    /// The circuit breaker its runs go through (its own, or a `[[circuits]]` entry's).
    pub circuit: Option<CircuitRef>,
    /// Whether its runs are skipped while its queue is backed up (default `normal`: never).
    pub criticality: Criticality,
    /// Aging: a waiting run of this job is taken one priority level up for each whole
    /// `promote_after` it has waited (low → normal → high), and among runs of one level the
    /// one that waited longest goes first, so no run starves.
    pub promote_after: Option<Duration>,
    /// The `[[calendars]]` entry its slots follow (business days, holidays).
    pub calendar: Option<String>,
    /// Where a slot on a day that is not a business day goes (default `skip`).
    pub on_holiday: Option<crate::calendar::OnHoliday>,
    /// Only the n-th (n ≥ 1) or n-th last (n ≤ −1) business day of each month.
    pub business_day: Option<i32>,
    /// Scheduled jobs whose run of the same slot must be `done` before this one's starts (it
    /// receives their results). They share this job's schedule.
    pub after: Vec<String>,
    /// A sharded or broadcast job: the job that runs once when every member of a run has
    /// ended, with the members' outcomes and results.
    pub on_complete: Option<String>,
}

/// What runs a job. In TOML it is the `handler` key plus the keys of that handler alone
/// (`command`, `permanent_exit_codes`, `pass_env` for `exec`; `url` for `http`): a key of
/// another handler is an error naming it, so no combination here is invalid.
#[derive(Debug, Clone, PartialEq)]
pub enum HandlerConfig {
    /// `handler = "exec"`: runs a program per job.
    Exec(ExecConfig),
    /// `handler = "http"`: POSTs the payload to `url` (an `http://` or `https://` URL).
    Http {
        /// Where the payload is POSTed.
        url: String,
    },
    /// `handler = "noop"`: succeeds at once (benchmarks, smoke tests).
    Noop,
    /// Any other name: a handler registered in Rust (a typed job's name, or
    /// `Registry::register`).
    Registered(String),
}

/// Settings of the `exec` handler.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecConfig {
    /// Program and arguments (no shell); at least the program.
    pub command: Vec<String>,
    /// Exit codes that mean permanent failure (default `[100]`).
    pub permanent_exit_codes: Vec<i32>,
    /// Variables of the worker's environment passed to this job's program, besides
    /// `worker.pass_env` and the safe defaults (`PATH`, `HOME`, locale, `TZ`, `TMPDIR`).
    pub pass_env: Vec<String>,
    /// Exit codes that mean "the downstream pushed back": the run is parked, its rate limit
    /// slowed for every worker, and the attempt not counted (default none).
    pub rate_limited_exit_codes: Vec<i32>,
}

impl HandlerConfig {
    /// The `handler` key as written (`exec`, `http`, `noop`, or the registered name).
    pub fn name(&self) -> &str {
        match self {
            HandlerConfig::Exec(_) => "exec",
            HandlerConfig::Http { .. } => "http",
            HandlerConfig::Noop => "noop",
            HandlerConfig::Registered(name) => name,
        }
    }
}

/// `[[jobs]]` as written: every handler's keys side by side, checked and folded into
/// [`HandlerConfig`] by `TryFrom` (serde's `flatten` would lose `deny_unknown_fields`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJobConfig {
    name: String,
    #[serde(default)]
    schedule: Option<String>,
    #[serde(default)]
    timezone: Option<String>,
    #[serde(default)]
    queue: Option<String>,
    handler: String,
    #[serde(default)]
    command: Option<Vec<String>>,
    #[serde(default)]
    permanent_exit_codes: Option<Vec<i32>>,
    #[serde(default)]
    pass_env: Option<Vec<String>>,
    #[serde(default)]
    rate_limited_exit_codes: Option<Vec<i32>>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    payload: Option<serde_json::Value>,
    #[serde(default)]
    max_attempts: Option<u32>,
    #[serde(default)]
    backoff: Option<BackoffConfig>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    timeout: Option<Duration>,
    #[serde(default)]
    catch_up: Option<CatchUp>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    catch_up_window: Option<Duration>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    deadline: Option<Duration>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    jitter: Option<Duration>,
    #[serde(default)]
    concurrency: Option<usize>,
    #[serde(default)]
    global_concurrency: Option<usize>,
    #[serde(default)]
    overlap: Option<Overlap>,
    #[serde(default)]
    shards: Option<Shards>,
    #[serde(default)]
    pack: Option<i64>,
    #[serde(default)]
    broadcast: Option<bool>,
    #[serde(default)]
    priority: Option<Priority>,
    #[serde(default)]
    rate_limit: Option<RateLimitRef>,
    #[serde(default)]
    circuit: Option<CircuitRef>,
    #[serde(default)]
    criticality: Option<Criticality>,
    #[serde(default, deserialize_with = "duration::de_opt")]
    promote_after: Option<Duration>,
    #[serde(default)]
    calendar: Option<String>,
    #[serde(default)]
    on_holiday: Option<crate::calendar::OnHoliday>,
    #[serde(default)]
    business_day: Option<i32>,
    #[serde(default)]
    after: Vec<String>,
    #[serde(default)]
    on_complete: Option<String>,
}

/// `[[jobs]]` with each entry's index in its errors, as `validate` names them.
pub(super) fn de_jobs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<JobConfig>, D::Error> {
    let raw = Vec::<RawJobConfig>::deserialize(d)?;
    raw.into_iter()
        .enumerate()
        .map(|(i, job)| job.into_job(&format!("jobs[{i}]")).map_err(serde::de::Error::custom))
        .collect()
}

impl TryFrom<RawJobConfig> for JobConfig {
    type Error = String;

    fn try_from(raw: RawJobConfig) -> Result<Self, String> {
        raw.into_job("jobs")
    }
}

impl RawJobConfig {
    fn into_job(self, at: &str) -> Result<JobConfig, String> {
        let raw = self;
        let key = |field: &str| format!("{at} ({}).{field}", raw.name);
        let only =
            |field: &str, handler: &str| format!("{}: only valid with handler \"{handler}\"", key(field));
        if raw.overlap.is_some_and(|o| o != Overlap::Allow) && raw.schedule.is_none() {
            return Err(format!(
                "{}: applies to scheduled jobs only (this one has no schedule)",
                key("overlap")
            ));
        }
        if raw.broadcast == Some(true) && raw.shards.is_some() {
            return Err(format!("{}: a job is sharded or broadcast, not both", key("broadcast")));
        }
        let max_pack = crate::envelope::pack::MAX_PACK;
        let pack = match raw.pack {
            None => None,
            Some(_) if raw.broadcast == Some(true) => {
                return Err(format!(
                    "{}: a broadcast job's copies (one per worker) cannot be packed",
                    key("pack")
                ));
            }
            Some(_) if raw.shards.is_none() => {
                return Err(format!(
                    "{}: packs a sharded job's members; set `shards`, or remove `pack`",
                    key("pack")
                ));
            }
            Some(n) if n < 2 || n > max_pack as i64 => {
                return Err(format!(
                    "{}: {n}: must be between 2 and {max_pack} members per message",
                    key("pack")
                ));
            }
            Some(n) => Some(n as usize),
        };
        if raw.handler != "exec" {
            for (field, set) in [
                ("command", raw.command.is_some()),
                ("permanent_exit_codes", raw.permanent_exit_codes.is_some()),
                ("pass_env", raw.pass_env.is_some()),
                ("rate_limited_exit_codes", raw.rate_limited_exit_codes.is_some()),
            ] {
                if set {
                    return Err(only(field, "exec"));
                }
            }
        }
        if raw.handler != "http" && raw.url.is_some() {
            return Err(only("url", "http"));
        }
        let handler = match raw.handler.as_str() {
            "exec" => match raw.command {
                Some(command) if command.first().is_some_and(|p| !p.is_empty()) => {
                    HandlerConfig::Exec(ExecConfig {
                        command,
                        permanent_exit_codes: raw
                            .permanent_exit_codes
                            .unwrap_or(vec![DEFAULT_PERMANENT_EXIT_CODE]),
                        pass_env: raw.pass_env.unwrap_or_default(),
                        rate_limited_exit_codes: raw.rate_limited_exit_codes.unwrap_or_default(),
                    })
                }
                _ => {
                    return Err(format!(
                        "{}: required for handler \"exec\" (a non-empty list: program and arguments)",
                        key("command")
                    ));
                }
            },
            "http" => match raw.url {
                Some(url) if url.starts_with("http://") || url.starts_with("https://") => {
                    HandlerConfig::Http { url }
                }
                _ => {
                    return Err(format!(
                        "{}: required for handler \"http\" (an http:// or https:// URL)",
                        key("url")
                    ));
                }
            },
            "noop" => HandlerConfig::Noop,
            "" => return Err(format!("{}: must not be empty", key("handler"))),
            _ => HandlerConfig::Registered(raw.handler),
        };
        Ok(JobConfig {
            name: raw.name,
            schedule: raw.schedule,
            timezone: raw.timezone,
            queue: raw.queue,
            handler,
            payload: raw.payload,
            max_attempts: raw.max_attempts,
            backoff: raw.backoff,
            timeout: raw.timeout,
            catch_up: raw.catch_up,
            catch_up_window: raw.catch_up_window,
            deadline: raw.deadline,
            jitter: raw.jitter,
            concurrency: raw.concurrency,
            global_concurrency: raw.global_concurrency,
            overlap: raw.overlap.unwrap_or_default(),
            shards: raw.shards,
            pack,
            broadcast: raw.broadcast.unwrap_or(false),
            priority: raw.priority,
            rate_limit: raw.rate_limit,
            circuit: raw.circuit,
            criticality: raw.criticality.unwrap_or_default(),
            promote_after: raw.promote_after,
            calendar: raw.calendar,
            on_holiday: raw.on_holiday,
            business_day: raw.business_day,
            after: raw.after,
            on_complete: raw.on_complete,
        })
    }
}

impl JobConfig {
    /// The options this entry sets (a typed job's options with this entry on top:
    /// [`JobConfig::over`]).
    pub fn options(&self) -> JobOptions {
        let mut o = JobOptions::default();
        o.queue = self.queue.clone();
        o.timeout = self.timeout;
        o.max_attempts = self.max_attempts;
        o.backoff = self.backoff.clone();
        o.concurrency = self.concurrency;
        o.global_concurrency = self.global_concurrency;
        o
    }

    /// `base` (a typed job's own options) with every setting of this entry on top, so
    /// operators tune a job defined in Rust without a rebuild.
    pub fn over(&self, base: &JobOptions) -> JobOptions {
        let mut o = base.clone();
        let mine = self.options();
        o.queue = mine.queue.or(o.queue);
        o.timeout = mine.timeout.or(o.timeout);
        o.max_attempts = mine.max_attempts.or(o.max_attempts);
        o.backoff = mine.backoff.or(o.backoff);
        o.concurrency = mine.concurrency.or(o.concurrency);
        o.global_concurrency = mine.global_concurrency.or(o.global_concurrency);
        o
    }

    /// The queue and attempts of [`Self::over`]`(base)` (`None`: the defaults), nothing
    /// cloned: all an enqueue needs of them, once per job of a batch.
    pub fn queue_and_attempts_over<'a>(&'a self, base: Option<&'a JobOptions>) -> (&'a str, u32) {
        let queue = self.queue.as_deref().or_else(|| base.and_then(|b| b.queue.as_deref()));
        let attempts = self.max_attempts.or_else(|| base.and_then(|b| b.max_attempts));
        (queue.unwrap_or(DEFAULT_QUEUE), attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS))
    }

    /// The job's queue (`default` unless set).
    pub fn queue(&self) -> &str {
        self.queue.as_deref().unwrap_or(DEFAULT_QUEUE)
    }
    /// The job's attempts (5 unless set).
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS)
    }
}

impl JobConfig {
    /// The entry at index `i`: its name, its options (by `JobOptions::validate`, the rules a
    /// typed job's options are checked by), schedule, zone and passed variables.
    pub(super) fn validate(&self, i: usize) -> Result<(), ConfigError> {
        let key = |field: &str| format!("jobs[{i}] ({}).{field}", self.name);
        if !valid_name(&self.name) {
            return Err(ConfigError::invalid(
                format!("jobs[{i}].name"),
                format!("{:?} must be 1-100 letters, digits, '-', '_' or '.'", self.name),
            ));
        }
        self.options().validate().map_err(|e| ConfigError::invalid(key(e.field), e.message))?;
        if let Some(s) = &self.schedule {
            // The planner's own parser: 5 or 6 fields, and a pattern that can fire.
            crate::schedule::Schedule::parse(s, None)
                .map_err(|e| ConfigError::invalid(key("schedule"), e.to_string()))?;
        }
        if self.payload.as_ref().is_some_and(crate::envelope::too_deep) {
            return Err(ConfigError::invalid(key("payload"), crate::envelope::too_deep_message()));
        }
        if let Some(tz) = &self.timezone {
            crate::schedule::zone(tz).map_err(|e| ConfigError::invalid(key("timezone"), e.to_string()))?;
        }
        let pass_env = match &self.handler {
            HandlerConfig::Exec(exec) => exec.pass_env.as_slice(),
            _ => &[],
        };
        for (j, name) in pass_env.iter().enumerate() {
            if !valid_env_name(name) {
                return Err(ConfigError::invalid(
                    format!("{}[{j}]", key("pass_env")),
                    format!("{name:?} is not a variable name"),
                ));
            }
        }
        Ok(())
    }
}
