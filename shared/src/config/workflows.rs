//! `jobs[].after` (scheduled chains) and `jobs[].on_complete` (fan-in of a fanned-out run),
//! checked against the jobs they name.

use super::{ConfigError, JobConfig};

/// Every job `after` names exists, is scheduled on the very same schedule (cron, zone and
/// calendar settings: the slot's key of the one is the slot's key of the other), does not fan
/// out, and no chain waits for itself; an `on_complete` job exists, does not fan out, and
/// belongs to a job that does.
pub(super) fn validate(jobs: &[JobConfig]) -> Result<(), ConfigError> {
    let at = |i: usize, j: &JobConfig, field: &str| format!("jobs[{i}] ({}).{field}", j.name);
    let fans = |j: &JobConfig| j.shards.is_some() || j.broadcast;
    for (i, job) in jobs.iter().enumerate() {
        if !job.after.is_empty() {
            let field = at(i, job, "after");
            if job.schedule.is_none() {
                return Err(ConfigError::invalid(
                    field,
                    "only a scheduled job can wait for other jobs' runs of its slot",
                ));
            }
            if fans(job) {
                return Err(ConfigError::invalid(
                    field,
                    "a sharded or broadcast job cannot wait for other jobs (use on_complete on the upstream one)",
                ));
            }
            for name in &job.after {
                let Some(up) = jobs.iter().find(|j| &j.name == name) else {
                    return Err(ConfigError::invalid(field, format!("{name:?} is not a job of this config")));
                };
                if up.name == job.name {
                    return Err(ConfigError::invalid(field, "a job cannot wait for itself"));
                }
                if fans(up) {
                    return Err(ConfigError::invalid(
                        field,
                        format!(
                            "{name:?} is sharded or broadcast: give it on_complete = {:?} instead",
                            job.name
                        ),
                    ));
                }
                let same = up.schedule == job.schedule
                    && up.timezone == job.timezone
                    && up.calendar == job.calendar
                    && up.on_holiday == job.on_holiday
                    && up.business_day == job.business_day;
                if !same {
                    return Err(ConfigError::invalid(
                        field,
                        format!(
                            "{name:?} must have the same schedule, timezone and calendar settings as {:?} (a run waits for the upstream's run of the same slot)",
                            job.name
                        ),
                    ));
                }
            }
        }
        if let Some(name) = &job.on_complete {
            let field = at(i, job, "on_complete");
            if !fans(job) {
                return Err(ConfigError::invalid(
                    field,
                    "only a sharded or broadcast job has members to complete",
                ));
            }
            let Some(done) = jobs.iter().find(|j| &j.name == name) else {
                return Err(ConfigError::invalid(field, format!("{name:?} is not a job of this config")));
            };
            if done.name == job.name || fans(done) {
                return Err(ConfigError::invalid(
                    field,
                    format!("{name:?} must be another job, neither sharded nor broadcast"),
                ));
            }
        }
    }
    order(jobs, |j| j.name.as_str(), |j| j.after.as_slice())
        .map(|_| ())
        .map_err(|e| ConfigError::invalid("jobs", e.replace("steps", "jobs").replace("step ", "job ")))
}

/// Checks a workflow's steps: names unique and valid, every `after` names another step, no
/// cycle. Returns the steps in an order where each comes after those it waits for.
pub fn order<T>(
    steps: &[T],
    name: impl Fn(&T) -> &str,
    after: impl Fn(&T) -> &[String],
) -> Result<Vec<&T>, String> {
    let mut seen = std::collections::HashSet::new();
    for s in steps {
        if !chime_job::valid_name(name(s)) {
            return Err(format!(
                "step {:?}: not a valid name (1-100 letters, digits, '-', '_' or '.')",
                name(s)
            ));
        }
        if !seen.insert(name(s)) {
            return Err(format!("step {:?} is named twice", name(s)));
        }
    }
    for s in steps {
        for a in after(s) {
            if !seen.contains(a.as_str()) {
                return Err(format!(
                    "step {:?}: after names {a:?}, which is not a step of the workflow",
                    name(s)
                ));
            }
            if a == name(s) {
                return Err(format!("step {:?} waits for itself", name(s)));
            }
        }
    }
    let mut done: Vec<&T> = Vec::with_capacity(steps.len());
    while done.len() < steps.len() {
        let before = done.len();
        for s in steps {
            let placed = |n: &str| done.iter().any(|d| name(d) == n);
            if !placed(name(s)) && after(s).iter().all(|a| placed(a)) {
                done.push(s);
            }
        }
        if done.len() == before {
            let stuck: Vec<&str> =
                steps.iter().map(&name).filter(|n| !done.iter().any(|d| name(d) == *n)).collect();
            return Err(format!("the steps {} wait for each other in a cycle", stuck.join(", ")));
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn err(jobs: &str) -> String {
        Config::from_toml_str(jobs).map(|_| ()).unwrap_err().to_string()
    }

    const EVERY: &str = "schedule = \"0 2 * * *\"\ntimezone = \"Europe/Berlin\"";

    #[test]
    fn chains_and_completions_are_checked_by_name() {
        let ok = format!(
            "[[jobs]]\nname = \"extract\"\nhandler = \"noop\"\n{EVERY}\n\
             [[jobs]]\nname = \"load\"\nhandler = \"noop\"\n{EVERY}\nafter = [\"extract\"]\n\
             [[jobs]]\nname = \"part\"\nhandler = \"noop\"\nshards = 4\non_complete = \"sum\"\n\
             [[jobs]]\nname = \"sum\"\nhandler = \"noop\"\n"
        );
        Config::from_toml_str(&ok).unwrap();
        let cases = [
            (
                ok.replace("after = [\"extract\"]", "after = [\"nope\"]"),
                "jobs[1] (load).after: \"nope\" is not a job",
            ),
            (
                ok.replacen(EVERY, "schedule = \"0 3 * * *\"", 1),
                "must have the same schedule, timezone and calendar",
            ),
            (ok.replace("after = [\"extract\"]", "after = [\"load\"]"), "cannot wait for itself"),
            (ok.replace("after = [\"extract\"]", "after = [\"part\"]"), "give it on_complete"),
            (
                ok.replace("on_complete = \"sum\"", "on_complete = \"nope\""),
                "jobs[2] (part).on_complete: \"nope\"",
            ),
            (ok.replace("on_complete = \"sum\"", "on_complete = \"part\""), "another job"),
            (
                format!("{ok}[[jobs]]\nname = \"solo\"\nhandler = \"noop\"\non_complete = \"sum\"\n"),
                "only a sharded or broadcast job",
            ),
            (
                format!("{ok}[[jobs]]\nname = \"adhoc\"\nhandler = \"noop\"\nafter = [\"extract\"]\n"),
                "only a scheduled job",
            ),
        ];
        for (text, says) in cases {
            let e = err(&text);
            assert!(e.contains(says), "{says}: {e}");
        }
        let cycle = format!(
            "[[jobs]]\nname = \"a\"\nhandler = \"noop\"\n{EVERY}\nafter = [\"b\"]\n\
             [[jobs]]\nname = \"b\"\nhandler = \"noop\"\n{EVERY}\nafter = [\"a\"]\n"
        );
        assert!(err(&cycle).contains("the jobs a, b wait for each other in a cycle"), "{}", err(&cycle));
    }
}
