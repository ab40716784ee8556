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
    crate::workflow::order(jobs, |j| j.name.as_str(), |j| j.after.as_slice())
        .map(|_| ())
        .map_err(|e| ConfigError::invalid("jobs", e.replace("steps", "jobs").replace("step ", "job ")))
}
