//! One delivery, one exhaustive decision, ack last. This is the only module that acks.
//!
//! decode → handler lookup → Redis claim → run (timeout, lease renewal, panic capture) →
//! record the outcome → publish to the DLQ if needed (confirmed) → ack. When Redis cannot
//! be reached before a decision, the delivery is requeued, never acked.

use chime_shared::amqp;
use chime_shared::delay;
use chime_shared::envelope::{Envelope, put_header};
use chime_shared::idempotency::{Claim, Final, IdemError};
use chime_shared::telemetry::{self, outcome};
use futures_util::FutureExt;
use lapin::message::Delivery;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};
use uuid::Uuid;

use crate::ack::AckBatcher;
use crate::handler::{JobContext, JobError};
use crate::retry::{self, DeadReason, Decision, Failure};
use crate::runtime::{Shared, Stats};

/// Longest `x-chime-error` header kept.
const MAX_ERROR_LEN: usize = 1000;

/// What happened to a run.
#[derive(Debug)]
enum RunResult {
    Ok,
    Failed(Failure, String),
    /// Another owner took the key over while we ran (our lease lapsed).
    LostLease,
    /// Stopped by the shutdown deadline.
    Aborted,
}

/// What to do with the delivery.
#[derive(Debug)]
enum Disposition {
    Ack,
    Requeue,
    /// Publish this envelope for delivery after `delay` (confirmed), then ack.
    Republish {
        envelope: Box<Envelope>,
        delay: Duration,
        retry: bool,
    },
    DeadLetter {
        reason: DeadReason,
        error: String,
        attempts: u32,
    },
}

/// Processes one delivery from `queue` and settles it (ack, requeue, or DLQ then ack).
pub(crate) async fn handle(
    shared: &Shared,
    publish: &lapin::Channel,
    acks: &AckBatcher,
    queue: &str,
    delivery: Delivery,
) {
    let started = Instant::now();
    let max = shared.config.amqp.max_message_bytes;
    if delivery.data.len() > max {
        warn!(queue, size = delivery.data.len(), max, "message too large");
        let d = Disposition::DeadLetter {
            reason: DeadReason::TooLarge,
            error: format!("{} bytes, above amqp.max_message_bytes ({max})", delivery.data.len()),
            attempts: 0,
        };
        settle(shared, publish, acks, queue, delivery, telemetry::UNKNOWN_JOB_LABEL, d, started).await;
        return;
    }
    let (job_label, disposition) = match Envelope::decode(&delivery.data) {
        Err(e) => {
            warn!(queue, error = %e, "malformed message");
            (
                telemetry::UNKNOWN_JOB_LABEL.to_string(),
                Disposition::DeadLetter { reason: DeadReason::Malformed, error: e.to_string(), attempts: 0 },
            )
        }
        Ok(env) => {
            let span = info_span!("job", job = %env.job, key = %env.key, attempt = env.attempt);
            let label =
                if shared.knows(&env.job) { env.job.clone() } else { telemetry::UNKNOWN_JOB_LABEL.into() };
            (label, decide(shared, env).instrument(span).await)
        }
    };
    settle(shared, publish, acks, queue, delivery, &job_label, disposition, started).await;
}

async fn decide(shared: &Shared, env: Envelope) -> Disposition {
    let Some(spec) = shared.job(&env.job) else {
        warn!("no handler for this job");
        return Disposition::DeadLetter {
            reason: DeadReason::UnknownJob,
            error: format!("no handler for job {:?} on this worker", env.job),
            attempts: env.attempt.saturating_sub(1),
        };
    };
    if let (Some(slot), Some(deadline)) = (env.slot, spec.deadline) {
        let late = (chrono::Utc::now() - slot).to_std().unwrap_or(Duration::ZERO);
        if late > deadline {
            warn!(%slot, late_ms = late.as_millis() as u64, "slot picked up past its deadline; skipped as expired");
            Stats::bump(&shared.stats.expired);
            metrics::counter!(telemetry::JOBS_COMPLETED, "job" => env.job.clone(), "outcome" => outcome::EXPIRED)
                .increment(1);
            return Disposition::Ack;
        }
    }
    let metrics = spec.metrics(&env.job);
    let key = env.key.to_string();
    let owner = shared.owner_token();
    let fence = match shared.store.claim(&key, &owner).await {
        Err(e) => return redis_down(shared, e),
        Ok(Claim::Claimed { fence }) => fence,
        Ok(Claim::Done { .. } | Claim::Dead { .. }) => {
            debug!("duplicate absorbed");
            Stats::bump(&shared.stats.duplicates);
            metrics.duplicate.increment(1);
            return Disposition::Ack;
        }
        Ok(Claim::Busy { remaining, .. }) => {
            // Another live owner runs this key. Never drop the copy (the owner may die):
            // send it round again after the owner's remaining lease.
            debug!(?remaining, "key busy; re-delaying this copy");
            let delay = remaining.max(Duration::from_secs(1));
            return Disposition::Republish { envelope: Box::new(env), delay, retry: false };
        }
    };

    let lag_from = env.slot.unwrap_or(env.enqueued_at);
    let lag = (chrono::Utc::now() - lag_from).num_milliseconds().max(0) as f64 / 1000.0;
    metrics.lag.record(lag);

    let run_started = Instant::now();
    let result = run(shared, spec, &env, &key, &owner, fence).await;
    metrics.duration.record(run_started.elapsed().as_secs_f64());

    match result {
        RunResult::Ok => {
            record(shared, &key, &owner, fence, Final::Done).await;
            metrics.succeeded.increment(1);
            info!(elapsed_ms = run_started.elapsed().as_millis() as u64, "job succeeded");
            Stats::bump(&shared.stats.succeeded);
            Disposition::Ack
        }
        RunResult::LostLease => {
            warn!("lease lost while running; the new owner settles this key");
            Stats::bump(&shared.stats.lost_lease);
            Disposition::Ack
        }
        RunResult::Aborted => {
            record(shared, &key, &owner, fence, Final::Free).await;
            info!("job stopped by the shutdown deadline; requeued");
            Disposition::Requeue
        }
        RunResult::Failed(failure, error) => {
            match retry::decide(env.attempt, env.max_attempts, failure, &spec.backoff, env.key) {
                Decision::Retry(delay) => {
                    warn!(?failure, %error, retry_in = ?delay, "job failed; retrying");
                    // Free the key first: the retry must be able to claim it.
                    record(shared, &key, &owner, fence, Final::Free).await;
                    let mut next = env;
                    next.attempt += 1;
                    next.id = Uuid::now_v7();
                    Disposition::Republish { envelope: Box::new(next), delay, retry: true }
                }
                Decision::Dead(reason) => {
                    // Recorded as dead, so later duplicates count as duplicates, not reruns.
                    warn!(reason = reason.as_str(), %error, "job failed for good");
                    record(shared, &key, &owner, fence, Final::Dead).await;
                    Disposition::DeadLetter { reason, error, attempts: env.attempt }
                }
            }
        }
    }
}

fn redis_down(shared: &Shared, e: IdemError) -> Disposition {
    warn!(error = %e, "redis unreachable: requeueing without a decision");
    shared.redis_failed();
    Disposition::Requeue
}

/// Records an outcome, retrying a few times across a Redis blip. The outcome is already
/// decided, so a record that cannot be written is logged and the delivery still settles.
async fn record(shared: &Shared, key: &str, owner: &str, fence: u64, state: Final) {
    for attempt in 0..5u32 {
        match shared.store.finish(key, owner, fence, state).await {
            Ok(true) => return,
            Ok(false) => {
                warn!(?state, "key was taken over by another owner; not recording");
                return;
            }
            Err(e) => {
                warn!(error = %e, attempt, "cannot record the outcome in redis yet");
                shared.redis_failed();
                tokio::time::sleep(Duration::from_millis(200 * 2u64.pow(attempt))).await;
            }
        }
    }
    error!(?state, "outcome not recorded in redis; a later duplicate of this key may run again");
}

/// Runs the handler under the timeout, catching a panic, renewing the lease every third of
/// it. The handler runs inside this delivery's task (no task of its own): a handler must not
/// block its thread (use `spawn_blocking` for CPU-bound or blocking work).
async fn run(
    shared: &Shared,
    spec: &crate::runtime::JobSpec,
    env: &Envelope,
    key: &str,
    owner: &str,
    fence: u64,
) -> RunResult {
    let cancel = CancellationToken::new();
    let ctx = JobContext {
        job: env.job.clone(),
        queue: env.queue.clone(),
        key: env.key,
        id: env.id,
        attempt: env.attempt,
        max_attempts: env.max_attempts,
        slot: env.slot,
        fence,
        timeout: spec.timeout,
        cancel: cancel.clone(),
    };
    // Dropping the future (timeout, lost lease, hard stop) cancels the handler; an exec
    // handler's process group is killed when its future is dropped.
    let task = std::panic::AssertUnwindSafe(spec.handler.call(ctx, env.payload.clone())).catch_unwind();
    // Polled alongside the handler, so a slow renewal never pauses it; ends only when the
    // key is no longer ours.
    let renewals = async {
        let lease = shared.store.lease();
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + lease / 3, lease / 3);
        loop {
            renew.tick().await;
            match shared.store.renew(key, owner, fence).await {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    warn!(error = %e, "lease renewal failed; the job keeps running");
                    shared.redis_failed();
                }
            }
        }
    };
    let result = tokio::select! {
        joined = task => match joined {
            Ok(Ok(())) => RunResult::Ok,
            Ok(Err(JobError::Permanent(m))) => RunResult::Failed(Failure::Permanent, m),
            Ok(Err(JobError::Transient(m))) => RunResult::Failed(Failure::Transient, m),
            Err(panic) => RunResult::Failed(Failure::Panic, format!("panic: {}", panic_message(panic))),
        },
        _ = tokio::time::sleep(spec.timeout) => {
            RunResult::Failed(Failure::Timeout, format!("timeout: no result within {:?}", spec.timeout))
        }
        _ = renewals => RunResult::LostLease,
        _ = shared.hard_stop.cancelled() => RunResult::Aborted,
    };
    if !matches!(result, RunResult::Ok) {
        cancel.cancel();
    }
    result
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Applies the disposition. Dead letters are published (confirmed) before the ack, so a
/// crash between the two leaves a duplicate in the DLQ, never a loss.
#[allow(clippy::too_many_arguments)]
async fn settle(
    shared: &Shared,
    publish: &lapin::Channel,
    acks: &AckBatcher,
    queue: &str,
    delivery: Delivery,
    job_label: &str,
    disposition: Disposition,
    started: Instant,
) {
    let tag = delivery.delivery_tag;
    match disposition {
        Disposition::Ack => acks.ack(tag, delivery.acker),
        Disposition::Requeue => {
            Stats::bump(&shared.stats.requeued);
            acks.requeue(tag, delivery.acker);
        }
        Disposition::Republish { envelope, delay, retry } => {
            let (exchange, routing_key) = delay::target(&shared.names, queue, delay);
            let sent = amqp::publish_confirmed(
                publish,
                &exchange,
                &routing_key,
                &envelope.encode(),
                envelope.properties(),
                shared.config.amqp.publish_timeout,
            )
            .await;
            match sent {
                Ok(()) => {
                    if retry {
                        Stats::bump(&shared.stats.retried);
                        metrics::counter!(telemetry::JOBS_COMPLETED, "job" => job_label.to_string(), "outcome" => outcome::RETRIED)
                            .increment(1);
                    } else {
                        Stats::bump(&shared.stats.redelayed);
                    }
                    acks.ack(tag, delivery.acker);
                }
                Err(e) => {
                    error!(error = %e, "cannot publish the delayed copy; requeueing");
                    Stats::bump(&shared.stats.requeued);
                    acks.requeue(tag, delivery.acker);
                }
            }
        }
        Disposition::DeadLetter { reason, error, attempts } => {
            let mut headers = delivery.properties.headers().clone().unwrap_or_default();
            put_header(&mut headers, "x-chime-reason", reason.as_str());
            put_header(&mut headers, "x-chime-error", truncate(&error, MAX_ERROR_LEN));
            put_header(&mut headers, "x-chime-attempts", &attempts.to_string());
            put_header(&mut headers, "x-chime-failed-at", &chrono::Utc::now().to_rfc3339());
            put_header(&mut headers, "x-chime-worker", &shared.worker_id);
            put_header(&mut headers, "x-chime-queue", queue);
            put_header(&mut headers, "x-chime-dead-id", &Uuid::now_v7().to_string());
            let props = delivery.properties.clone().with_headers(headers);
            let exchange = shared.names.dead_exchange();
            match amqp::publish_confirmed(
                publish,
                &exchange,
                queue,
                &delivery.data,
                props,
                shared.config.amqp.publish_timeout,
            )
            .await
            {
                Ok(()) => {
                    metrics::counter!(telemetry::JOBS_COMPLETED, "job" => job_label.to_string(), "outcome" => outcome::DEAD_LETTERED)
                        .increment(1);
                    info!(reason = reason.as_str(), queue, "dead-lettered");
                    Stats::bump(&shared.stats.dead_lettered);
                    acks.ack(tag, delivery.acker);
                }
                Err(e) => {
                    error!(error = %e, "cannot publish to the DLQ; requeueing");
                    acks.requeue(tag, delivery.acker);
                }
            }
        }
    }
    debug!(elapsed_us = started.elapsed().as_micros() as u64, "delivery settled");
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
