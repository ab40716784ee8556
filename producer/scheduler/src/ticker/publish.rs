//! One batch of due slots: pause flags, overlap decisions, fan-out (shards, broadcast), then
//! pipelined publishing with confirms, and the watermarks of what the broker confirmed.

use chime_shared::amqp;
use chime_shared::config::{Config, Overlap};
use chime_shared::envelope::{self, Envelope, Source};
use chime_shared::group;
use chime_shared::history::{self, Outcome, RunEvent};
use chime_shared::idempotency;
use chime_shared::schedule::Closed;
use chime_shared::telemetry;
use chime_shared::topology::Names;
use chime_shared::trace;
use chrono::{DateTime, Utc};
use lapin::Channel;
use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use tracing::{debug, info, warn};

use super::{Plan, Ticker, TickerJob};
use crate::overlap::{self, Decision};

/// Why a run is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// Its slot is due.
    Due,
    /// Its slot was waiting for the previous run to end (`buffer_one`), which it has.
    Released,
}

/// One slot to publish: its messages (one, or its members when it fans out).
struct Run {
    i: usize,
    slot: DateTime<Utc>,
    key: uuid::Uuid,
    why: Why,
    envs: Vec<Envelope>,
}

impl Ticker {
    /// Publishes due slots with pipelined confirms, advances the watermarks of the confirmed
    /// ones (and of those skipped or buffered by their overlap policy), and schedules their
    /// next slots. Failed slots are retried. `buffered` holds the jobs with a slot waiting
    /// (`buffer_one`): their previous run is checked here, and the slot published once it
    /// ended. False if the channel failed.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn publish(
        &self,
        ch: &Channel,
        names: &Names,
        config: &Config,
        jobs: &[TickerJob],
        plan: &mut Plan,
        due: Vec<(usize, DateTime<Utc>)>,
        buffered: &mut BTreeSet<usize>,
    ) -> bool {
        let exchange = names.work_exchange();
        let timeout = config.amqp.publish_timeout;
        let retry_at = Utc::now() + chrono::Duration::seconds(1);
        let retry = |plan: &mut Plan, i: usize, slot: DateTime<Utc>| {
            plan.heap.push(Reverse((retry_at.timestamp_millis(), slot.timestamp(), i)));
        };
        let mut conn = self.store.conn();
        // Paused schedules: their slots are skipped and count as handled (the watermark
        // moves on), so neither a resume nor a new leader runs them late.
        let due_jobs: Vec<String> =
            due.iter().filter_map(|(i, _)| jobs.get(*i).map(|j| j.name.clone())).collect();
        let paused: Vec<bool> = match self.store.paused(names, &due_jobs).await {
            Ok(p) => p,
            Err(e) => {
                warn!(error = %e, "cannot read pause flags; publishing");
                vec![false; due_jobs.len()]
            }
        };
        // Sheddable jobs whose queue sheds: their slots are recorded as shed, not published.
        let shed_queues: Vec<String> = due
            .iter()
            .filter_map(|(i, _)| jobs.get(*i).filter(|j| j.sheddable).map(|j| j.queue.clone()))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let shedding: HashMap<String, String> = match chime_shared::shed::read(&mut conn, names, &shed_queues)
            .await
        {
            Ok(flags) => shed_queues.into_iter().zip(flags).filter_map(|(q, f)| f.map(|f| (q, f))).collect(),
            Err(e) => {
                warn!(error = %e, "cannot read shedding flags; publishing");
                HashMap::new()
            }
        };
        // Handled without a publish: the watermark moves on, the next slot is planned.
        let mut handled: Vec<(usize, DateTime<Utc>)> = Vec::new();
        let mut paused_slots = Vec::new();
        let mut due_left = Vec::new();
        let mut shed_events = Vec::new();
        // Calendar skips per job, counted in Redis once a batch.
        let mut calendar_skips: HashMap<usize, u64> = HashMap::new();
        for ((i, slot), paused) in due.into_iter().zip(paused.into_iter().chain(std::iter::repeat(false))) {
            let Some(job) = jobs.get(i) else { continue };
            // A slot its business calendar skips (`on_holiday = "skip"`): counted; recorded
            // when the day is a holiday (days off every week are counted only).
            if let Some(closed) = job.schedule.skipped(slot) {
                let calendar = job.schedule.business().map(|b| b.name.as_str()).unwrap_or_default();
                debug!(job = %job.name, %slot, calendar, reason = closed.as_str(), "not a business day: slot skipped");
                metrics::counter!(telemetry::SLOTS_CALENDAR_SKIPPED, "job" => job.name.clone(), "reason" => closed.as_str())
                    .increment(1);
                *calendar_skips.entry(i).or_default() += 1;
                if closed == Closed::Holiday {
                    let day = slot.with_timezone(&job.schedule.zone()).date_naive();
                    info!(job = %job.name, %slot, calendar, %day, "holiday: slot skipped");
                    shed_events.push(self.unpublished(
                        job,
                        slot,
                        Outcome::Skipped,
                        "calendar",
                        format!("slot {slot}: {day} is a holiday in calendar {calendar:?}"),
                    ));
                }
                handled.push((i, slot));
                continue;
            }
            if paused {
                debug!(job = %job.name, %slot, "schedule paused: slot skipped");
                metrics::counter!(telemetry::SLOTS_PAUSED, "job" => job.name.clone()).increment(1);
                paused_slots.push((i, slot));
                continue;
            }
            if let Some(why) = shedding.get(&job.queue).filter(|_| job.sheddable) {
                info!(job = %job.name, %slot, queue = %job.queue, reason = %why, "queue backed up: sheddable slot not published (shed)");
                metrics::counter!(telemetry::SLOTS_SHED, "job" => job.name.clone()).increment(1);
                shed_events.push(self.unpublished(
                    job,
                    slot,
                    Outcome::Shed,
                    "load",
                    format!("slot {slot}: {why}"),
                ));
                handled.push((i, slot));
                continue;
            }
            due_left.push((i, slot));
        }
        for (i, n) in calendar_skips {
            self.store.count(&jobs[i].name, "calendar", n).await;
        }

        // Overlap: the jobs that have a policy, among the due ones and those with a slot waiting.
        let mut watched: BTreeSet<usize> = buffered.clone();
        watched.extend(due_left.iter().filter(|(i, _)| jobs[*i].overlap != Overlap::Allow).map(|(i, _)| *i));
        let mut states: HashMap<usize, (overlap::State, bool)> = HashMap::new();
        if !watched.is_empty() {
            let names_of: Vec<&str> = watched.iter().map(|i| jobs[*i].name.as_str()).collect();
            match overlap::states(&mut conn, names, &names_of).await {
                Ok(found) => {
                    for (i, s) in watched.iter().zip(found) {
                        let busy = match s.last {
                            Some((key, at)) => {
                                overlap::running(&mut conn, names, key, at, config.redis.done_retention).await
                            }
                            None => Ok(false),
                        };
                        match busy {
                            Ok(b) => {
                                states.insert(*i, (s, b));
                            }
                            Err(e) => {
                                warn!(job = %jobs[*i].name, error = %e, "cannot read the previous run's state")
                            }
                        }
                    }
                }
                Err(e) => warn!(error = %e, "cannot read overlap states"),
            }
        }
        let mut runs: Vec<Run> = Vec::new();
        // A waiting slot whose previous run ended goes first.
        for i in buffered.clone() {
            match states.get_mut(&i) {
                Some((s, busy)) if !*busy => {
                    if let Some(slot) = s.buffered.and_then(|t| DateTime::from_timestamp(t, 0)) {
                        runs.push(Run {
                            i,
                            slot,
                            key: envelope::scheduled_key(&jobs[i].name, slot),
                            why: Why::Released,
                            envs: Vec::new(),
                        });
                        // What comes next of this job finds this one in progress.
                        *busy = true;
                        s.buffered = None;
                    } else {
                        buffered.remove(&i);
                    }
                }
                Some((s, _)) if s.buffered.is_none() => {
                    buffered.remove(&i);
                }
                _ => {}
            }
        }
        let mut skipped_overlap: Vec<(usize, DateTime<Utc>)> = Vec::new();
        for (i, slot) in due_left {
            let job = &jobs[i];
            let decision = match (job.overlap, states.get_mut(&i)) {
                (Overlap::Allow, _) => Decision::Publish,
                // An earlier leader published this very slot (its lease lapsed before it moved
                // the watermark): handled, not a run overlapping itself.
                (_, Some((s, _)))
                    if s.last.is_some_and(|(k, _)| k == envelope::scheduled_key(&job.name, slot)) =>
                {
                    handled.push((i, slot));
                    continue;
                }
                (_, Some((s, busy))) => {
                    let d = overlap::decide(job.overlap, *busy, s.buffered.is_some());
                    match d {
                        Decision::Publish => *busy = true,
                        Decision::Buffer => s.buffered = Some(slot.timestamp()),
                        Decision::Skip => {}
                    }
                    d
                }
                // The state could not be read: try again in a second, never guess.
                (_, None) => {
                    retry(plan, i, slot);
                    continue;
                }
            };
            match decision {
                Decision::Publish => runs.push(Run {
                    i,
                    slot,
                    key: envelope::scheduled_key(&job.name, slot),
                    why: Why::Due,
                    envs: Vec::new(),
                }),
                Decision::Skip => skipped_overlap.push((i, slot)),
                Decision::Buffer => match overlap::buffer(&mut conn, names, &job.name, slot).await {
                    Ok(()) => {
                        info!(job = %job.name, %slot, "previous run in progress: slot waits for it (buffer_one)");
                        metrics::counter!(telemetry::SLOTS_BUFFERED, "job" => job.name.clone()).increment(1);
                        buffered.insert(i);
                        handled.push((i, slot));
                    }
                    Err(e) => {
                        warn!(job = %job.name, %slot, error = %e, "cannot buffer the slot; will retry");
                        retry(plan, i, slot);
                    }
                },
            }
        }

        // Each run's messages: one, or its members (the group record fixes them).
        let mut ready = Vec::with_capacity(runs.len());
        for mut run in runs {
            let job = &jobs[run.i];
            let mut env = Envelope::new(
                &job.name,
                &job.queue,
                run.key,
                job.payload.clone(),
                Some(run.slot),
                job.max_attempts,
                Source::Schedule,
            );
            env.priority = job.priority;
            if !job.chain.is_empty() {
                // A step of the slot's chain: its record says what waits for what.
                let chain = chime_shared::workflow::scheduled_chain(&job.chain, run.slot);
                env.step = chain.step_of(&job.name);
                if let Err(e) = chain.write(&mut conn, names, config.redis.done_retention).await {
                    warn!(job = %job.name, slot = %run.slot, error = %e, "cannot write the chain's workflow record; will retry");
                    if run.why == Why::Due {
                        retry(plan, run.i, run.slot);
                    }
                    continue;
                }
            }
            if trace::enabled() {
                // A span for the slot, which the run's span on the worker continues.
                let span = tracing::info_span!("slot", otel.kind = "producer", job = %job.name,
                    slot = %run.slot, key = %run.key);
                if let Some(t) = span.in_scope(trace::current) {
                    env.trace_id = Some(t.traceparent);
                    env.trace_state = t.tracestate;
                }
            }
            if job.fans_out() {
                let fan = match group::propose_for(
                    &mut conn,
                    names,
                    &job.queue,
                    job.shards,
                    job.broadcast,
                    Some(run.slot),
                )
                .await
                {
                    Ok(Some(fan)) => {
                        group::fix(&mut conn, names, &env, &fan, config.redis.done_retention).await
                    }
                    Ok(None) => Ok(group::Fan::Shards(1)),
                    Err(e) => Err(e),
                };
                match fan {
                    Ok(fan) => {
                        run.envs = fan.envelopes(&env);
                        if let Some(c) = &job.on_complete {
                            let done = c.attach(&env, &mut run.envs);
                            run.envs.push(done);
                        }
                    }
                    Err(e) => {
                        warn!(job = %job.name, slot = %run.slot, error = %e, "cannot fix the slot's shards or workers; will retry");
                        if run.why == Why::Due {
                            retry(plan, run.i, run.slot);
                        }
                        continue;
                    }
                }
                if run.envs.is_empty() {
                    info!(job = %job.name, slot = %run.slot, "broadcast: no live worker consumes the queue; nothing to run");
                }
            } else {
                run.envs = vec![env];
            }
            ready.push(run);
        }

        // Publish every message, a group at a time (a burst leaves in a few writes); a job
        // with `pack` has its members packed.
        let max_bytes = config.amqp.max_message_bytes;
        let bodies: Vec<(usize, Vec<u8>, lapin::BasicProperties, String)> = ready
            .iter()
            .enumerate()
            .flat_map(|(r, run)| match jobs[run.i].pack {
                Some(n) => envelope::pack::messages(&run.envs, n, max_bytes)
                    .into_iter()
                    .map(|m| (r, m.body, m.props, m.route))
                    .collect::<Vec<_>>(),
                None => run.envs.iter().map(|e| (r, e.encode(), e.properties(), e.route())).collect(),
            })
            .collect();
        let mut healthy = true;
        let mut pending = Vec::with_capacity(bodies.len());
        for chunk in bodies.chunks(amqp::PUBLISH_GROUP) {
            let sent = if healthy {
                let outgoing = chunk.iter().map(|(_, body, props, route)| amqp::Outgoing {
                    exchange: &exchange,
                    routing_key: route,
                    body,
                    props: props.clone(),
                });
                amqp::publish_group(ch, outgoing).await
            } else {
                Vec::new()
            };
            let mut sent = sent.into_iter();
            for _ in chunk {
                let p = if healthy { sent.next().and_then(Result::ok) } else { None };
                if p.is_none() {
                    healthy = false;
                }
                pending.push(p);
            }
        }
        // Every confirm first, then each message's verdict: a returned message may ride on
        // any confirm of the burst (see amqp::Returns). A run is published when all of its
        // messages are.
        let mut returns = amqp::Returns::default();
        let mut verdicts = Vec::with_capacity(pending.len());
        for (p, (_, _, _, route)) in pending.into_iter().zip(&bodies) {
            verdicts.push(match p {
                Some(p) => returns.confirm(p, &exchange, route, timeout).await.map_err(Some),
                None => Err(None),
            });
        }
        let mut ok = vec![true; ready.len()];
        for (verdict, (r, body, _, route)) in verdicts.into_iter().zip(&bodies) {
            let verdict = verdict.and_then(|()| match returns.take(&exchange, route, body) {
                Some(e) => Err(Some(e)),
                None => Ok(()),
            });
            if let Err(e) = verdict {
                // A broadcast copy for a worker whose queue is gone: the worker is gone too.
                if route.starts_with('@') && matches!(e, Some(amqp::AmqpError::Returned { .. })) {
                    info!(job = %jobs[ready[*r].i].name, slot = %ready[*r].slot, route = %route, "broadcast: that worker is gone; its copy is dropped");
                    if jobs[ready[*r].i].on_complete.is_some() {
                        // Its `on_complete` job waits for members that end: this one never starts.
                        let key = Envelope::decode(body).map(|e| e.key.to_string()).unwrap_or_default();
                        let why = "broadcast copy dropped: its worker is gone";
                        let gone = chime_shared::idempotency::cancel(
                            &mut conn,
                            names,
                            &key,
                            config.redis.done_retention,
                            why,
                        );
                        if let Err(e) = gone.await {
                            warn!(key = %key, error = %e, "cannot mark the dropped broadcast copy ended; its on_complete job waits for it");
                        }
                    }
                    continue;
                }
                if let Some(e) = e {
                    warn!(job = %jobs[ready[*r].i].name, slot = %ready[*r].slot, error = %e, "slot not confirmed; will retry");
                    if e.is_transient() {
                        healthy = false;
                    }
                }
                ok[*r] = false;
            }
        }
        let mut confirmed = Vec::new();
        for (run, ok) in ready.iter().zip(ok) {
            let job = &jobs[run.i];
            if !ok {
                if run.why == Why::Due {
                    retry(plan, run.i, run.slot);
                }
                continue;
            }
            let lag = (Utc::now() - run.slot).num_milliseconds() as f64 / 1000.0;
            debug!(job = %job.name, slot = %run.slot, lag, messages = run.envs.len(), "slot published");
            metrics::counter!(telemetry::JOBS_PUBLISHED, "job" => job.name.clone(), "source" => "schedule")
                .increment(run.envs.len() as u64);
            if job.overlap != Overlap::Allow || run.why == Why::Released {
                let released = run.why == Why::Released;
                if let Err(e) = overlap::published(&mut conn, names, &job.name, run.key, released).await {
                    warn!(job = %job.name, error = %e, "cannot record the run for the overlap policy");
                }
                if released {
                    info!(job = %job.name, slot = %run.slot, "the previous run ended: the waiting slot is published");
                    buffered.remove(&run.i);
                }
            }
            if run.why == Why::Due {
                confirmed.push((run.i, run.slot));
            }
        }
        // Overlapped: counted, and recorded in the history under the slot's key.
        let mut events = shed_events;
        for (i, slot) in &skipped_overlap {
            let job = &jobs[*i];
            let previous =
                states.get(i).and_then(|(s, _)| s.last).map(|(k, _)| k.to_string()).unwrap_or_default();
            info!(job = %job.name, %slot, previous = %previous, "previous run in progress: slot skipped (overlap)");
            metrics::counter!(telemetry::SLOTS_OVERLAPPED, "job" => job.name.clone()).increment(1);
            self.store.count(&job.name, "overlapped", 1).await;
            let error = format!("slot {slot}: the run {previous} was still in progress");
            events.push(self.unpublished(job, *slot, Outcome::Skipped, "overlap", error));
        }
        // Each skipped or shed slot's key is settled first: a copy of it published by another
        // leader is a duplicate, and a slot another leader already decided is not recorded twice.
        let mut recorded = Vec::with_capacity(events.len());
        for event in events {
            match idempotency::settle_unrun(
                &mut conn,
                names,
                config.redis.done_retention,
                &config.history,
                &event,
            )
            .await
            {
                Ok(true) => recorded.push(event),
                Ok(false) => {
                    debug!(job = %event.job, key = %event.key, "slot already decided by another leader")
                }
                Err(e) => {
                    warn!(job = %event.job, key = %event.key, error = %e, "cannot settle the slot's key");
                    recorded.push(event);
                }
            }
        }
        if !recorded.is_empty()
            && let Err(e) = history::append(&mut conn, names, &recorded).await
        {
            warn!(error = %e, "cannot record skipped slots in the history");
        }
        for (i, _) in &paused_slots {
            if let Some(job) = jobs.get(*i) {
                self.store.count(&job.name, "paused", 1).await;
            }
        }
        confirmed.extend(paused_slots);
        confirmed.extend(handled);
        confirmed.extend(skipped_overlap);
        let marks: Vec<(&str, i64)> = confirmed
            .iter()
            .filter_map(|(i, slot)| jobs.get(*i).map(|j| (j.name.as_str(), slot.timestamp())))
            .collect();
        if let Err(e) = self.store.advance(&marks).await {
            // Published but not recorded: a later leader republishes these slots (same keys,
            // absorbed by the workers). Never the other way round.
            warn!(error = %e, slots = marks.len(), "watermarks not advanced");
        }
        for (i, slot) in confirmed {
            if let Some(job) = jobs.get(i)
                && let Some(next) = job.schedule.next_tick(slot)
            {
                plan.push(i, job, next);
            }
        }
        healthy
    }
}

impl Ticker {
    /// The history event of a slot the ticker did not publish (skipped for overlap, shed).
    fn unpublished(
        &self,
        job: &TickerJob,
        slot: DateTime<Utc>,
        outcome: Outcome,
        reason: &str,
        error: String,
    ) -> RunEvent {
        RunEvent {
            job: job.name.clone(),
            key: envelope::scheduled_key(&job.name, slot).to_string(),
            id: String::new(),
            queue: job.queue.clone(),
            attempt: 0,
            max_attempts: job.max_attempts,
            worker: self.id.clone(),
            started_at: None,
            finished_at: Utc::now(),
            outcome,
            duration_ms: None,
            reason: Some(reason.into()),
            error: Some(error),
            entry: None,
        }
    }
}
