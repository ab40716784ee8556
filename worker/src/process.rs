//! One delivery: judge it (decode, handler lookup, claim, run) into a [`Plan`], then carry
//! the plan out and settle the delivery last, through its [`Ticket`]. This is the only module
//! that settles deliveries. The plans and the order of their steps are `decision`'s table.
//!
//! The run: the handler future runs inside this delivery's task, under `catch_unwind`, with
//! the lease renewed every third of it. On timeout, at the drain deadline, or when another
//! owner took the key, the handler's cancellation token fires first; the handler has
//! `worker.cancel_grace` to stop on its own (a result it returns in that time stands), and only
//! then is its future dropped (an `exec` child's process group is killed on drop).

use backon::Retryable;
use chime_shared::envelope::{Envelope, header_str, pack, put_header};
use chime_shared::history::{self, Outcome, RunEvent};
use chime_shared::idempotency::{Claim, DeadInfo, Final, IdemError, Recorded, Renewal};
use chime_shared::limit::{ClaimWith, SlotTake};
use chime_shared::record::StoredResult;
use chime_shared::telemetry::{self, outcome};
use chime_shared::trace::{self, TraceContext};
use chrono::{DateTime, Utc};
use futures_util::FutureExt;
use lapin::BasicProperties;
use lapin::types::FieldTable;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span, debug, error, info, info_span, warn};

use crate::ack::{AckSink, Ticket};
use crate::decision::{self, AfterClaim, HeldPlan, KeyMark, Park, Plan, Redelay, RunEnd, Settled};
use crate::handler::{JobContext, JobError};
use crate::retry::{DeadReason, Failure};
use crate::state::{Core, JobSpec, Stats};
use crate::store::{KeyStore, Outbox};

/// Header carrying when a job was first seen without a handler (rolling deploys).
pub(crate) const UNKNOWN_SINCE: &str = "x-chime-unknown-since";
/// Header carrying a parked rate-limited run's ticket, its place in line (µs of Redis time).
pub(crate) const RATE_AT: &str = "x-chime-rate-at";
/// Header counting the times a run was parked waiting for a global concurrency slot.
pub(crate) const SLOT_PARKS: &str = "x-chime-slot-parks";
/// Header counting the times a run was parked by its circuit breaker.
pub(crate) const CIRCUIT_PARKS: &str = "x-chime-circuit-parks";
/// Header counting the times a workflow step was parked waiting for its upstream steps.
pub(crate) const WORKFLOW_PARKS: &str = "x-chime-workflow-parks";
/// Header carrying when a workflow step first waited (s since the epoch).
pub(crate) const WAITING_SINCE: &str = "x-chime-waiting-since";
/// Header marking the copy of a workflow step an upstream step's end released.
pub(crate) const RELEASED: &str = "x-chime-released";
/// Header carrying the `traceparent` of the attempt a retry follows (its span is linked).
pub(crate) const PREVIOUS_SPAN: &str = "x-chime-previous-span";

/// A fault the suite injects (`CHIME_TEST_FAULT=abort_before_release`): the process dies
/// right after recording a workflow step's `done` or `dead`, before releasing the steps that
/// wait for it and before acking, the worst moment for a workflow.
static FAULT_BEFORE_RELEASE: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var("CHIME_TEST_FAULT").is_ok_and(|v| v == "abort_before_release"));

/// A delivery, as far as deciding its fate goes.
pub(crate) struct Incoming {
    /// The queue the delivery belongs to (its DLQ, history, logs).
    pub queue: String,
    /// The broker queue it came from: the queue, one of its priority levels, or the worker's
    /// own queue (broadcast copies).
    pub route: String,
    pub data: Vec<u8>,
    pub properties: BasicProperties,
    /// The worker-wide slot (`worker.concurrency`) the delivery holds until it is settled;
    /// given back while it waits for its job's own limit (`jobs[].concurrency`).
    pub slot: WorkerSlot,
    /// One job of a pack: `properties` are the pack's until the envelope is decoded.
    pub packed: bool,
}

/// A permit of the worker-wide semaphore, if the delivery holds one.
#[derive(Default)]
pub(crate) struct WorkerSlot(std::sync::Mutex<Option<tokio::sync::OwnedSemaphorePermit>>);

impl WorkerSlot {
    pub fn new(permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        Self(std::sync::Mutex::new(Some(permit)))
    }

    fn take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn put(&self, permit: tokio::sync::OwnedSemaphorePermit) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(permit);
    }
}

/// Takes a permit of the job's own limit. When none is free, the worker-wide slot is given
/// back while waiting (so other jobs keep running) and taken again after; `None` when intake
/// stopped meanwhile (the delivery is requeued).
async fn job_permit(
    core: &Core,
    limit: &Arc<tokio::sync::Semaphore>,
    slot: &WorkerSlot,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    if let Ok(p) = limit.clone().try_acquire_owned() {
        return Some(p);
    }
    let worker_wide = give_back(slot);
    let permit = tokio::select! {
        p = limit.clone().acquire_owned() => p.ok()?,
        _ = core.intake_stopped.cancelled() => return None,
    };
    take_again(core, slot, worker_wide).await.then_some(permit)
}

/// A global slot (`jobs[].global_concurrency`) this run holds; freed when dropped.
struct GlobalSlot<'a, S: KeyStore> {
    store: &'a S,
    spec: Arc<JobSpec>,
    job: String,
    owner: String,
}

impl<S: KeyStore> Drop for GlobalSlot<'_, S> {
    fn drop(&mut self) {
        self.store.free_slot(&self.job, &self.owner);
        // A delivery of this job waiting in this process asks again at once (the free is
        // ahead of its ask in the same Redis pipeline order).
        self.spec.global_freed.notify_one();
    }
}

/// Shortest and longest pause between two asks for a global slot while all are held.
const SLOT_POLL: (Duration, Duration) = (Duration::from_millis(10), Duration::from_millis(500));

/// What waiting for a global slot came to.
enum SlotWait<'a, S: KeyStore> {
    Got(GlobalSlot<'a, S>),
    /// Intake stopped meanwhile (requeue).
    Stopped,
    /// Every slot stayed held for `worker.max_hold`: park the run for this long.
    Park(Duration),
}

/// Takes one of the job's global slots, waiting while every one is held: one delivery per job
/// and process asks Redis (the others queue behind it), again at once when a run of this
/// process frees one, else after a pause that doubles from 10 ms to 500 ms (never past the
/// moment the first held slot lapses). While it waits the delivery gives its worker-wide
/// slot back, as [`job_permit`] does. A delivery still without a slot after
/// `worker.max_hold` is parked (it must not hold its delivery for as long as other runs
/// take): for 1 s, doubling with each time it was parked so (`parks`), at most 60 s.
#[allow(clippy::too_many_arguments)]
async fn global_slot<'a, S: KeyStore>(
    core: &Core,
    store: &'a S,
    spec: &Arc<JobSpec>,
    job: &str,
    owner: &str,
    limit: usize,
    slot: &WorkerSlot,
    parks: u32,
) -> Result<SlotWait<'a, S>, IdemError> {
    let deadline = tokio::time::Instant::now() + core.config.worker.max_hold;
    let park = Duration::from_secs(1 << parks.min(5)).min(Duration::from_secs(60));
    let turn = match spec.global_turn.try_lock() {
        Ok(turn) => turn,
        Err(_) => {
            let worker_wide = give_back(slot);
            let turn = tokio::select! {
                t = spec.global_turn.lock() => t,
                _ = tokio::time::sleep_until(deadline) => return Ok(SlotWait::Park(park)),
                _ = core.intake_stopped.cancelled() => return Ok(SlotWait::Stopped),
            };
            if !take_again(core, slot, worker_wide).await {
                return Ok(SlotWait::Stopped);
            }
            turn
        }
    };
    let mut pause = SLOT_POLL.0;
    let mut worker_wide = None;
    loop {
        let lapses_in = match store.take_slot(job, owner, limit).await? {
            SlotTake::Taken => break,
            SlotTake::Full { lapses_in } => lapses_in,
        };
        if tokio::time::Instant::now() >= deadline {
            // Its worker-wide slot comes back to it before it is settled.
            if let Some(sem) = worker_wide
                && !take_again(core, slot, sem).await
            {
                return Ok(SlotWait::Stopped);
            }
            return Ok(SlotWait::Park(park));
        }
        if worker_wide.is_none() {
            worker_wide = Some(give_back(slot));
        }
        let wait = pause.min(lapses_in + Duration::from_millis(1));
        tokio::select! {
            _ = tokio::time::sleep(wait) => pause = (pause * 2).min(SLOT_POLL.1),
            _ = tokio::time::sleep_until(deadline) => {}
            _ = spec.global_freed.notified() => pause = SLOT_POLL.0,
            _ = core.intake_stopped.cancelled() => return Ok(SlotWait::Stopped),
        }
    }
    drop(turn);
    // Held from here: dropped (freed) if intake stops before the worker-wide slot is back.
    let taken = GlobalSlot { store, spec: spec.clone(), job: job.to_string(), owner: owner.to_string() };
    if let Some(sem) = worker_wide
        && !take_again(core, slot, sem).await
    {
        return Ok(SlotWait::Stopped);
    }
    Ok(SlotWait::Got(taken))
}

/// What a run's rate limit says.
enum Gate {
    /// It starts now, its key claimed already when the decision could claim it.
    Go(Option<Result<Claim, IdemError>>),
    /// Its start is further off than `worker.max_hold` (or no in-place wait is free).
    Park(Duration, Park),
    /// Intake stopped while it waited.
    Stopped,
}

/// How long a run whose turn is `wait` away is parked: the whole seconds less one, at least
/// one, and at most the longest delay the chain holds (a turn further off than 8.5 years, a
/// slow limit's long line, comes back early and parks again with its ticket).
fn rate_park(wait: Duration) -> Duration {
    let secs = wait.as_secs().saturating_sub(1).max(1);
    Duration::from_secs(secs).min(chime_shared::delay::MAX_DELAY)
}

/// Asks the job's rate limit (if any) when this run may start. It may wait in place for
/// under a second, or for up to `worker.max_hold` when one of the worker's in-place waits is
/// free (its worker-wide slot given back meanwhile); a start within that is its own. Else it
/// is parked, carrying its ticket: until about its ticket's turn when that is further off,
/// or (due, but every start within its wait taken by other due runs) for about the wait.
/// Parks are the whole seconds of the wait less one, at least one (the delay chain counts
/// whole seconds, and a loaded chain returns copies late): a copy should be back a little
/// early and wait the rest in place. However late copies come back, starts stay spaced by
/// the limit (see `chime_shared::limit`).
///
/// With `claim` (the run takes nothing else between its start and its claim), a run that
/// may start at once has its key claimed in the same round trip. `permit`, the job's own
/// permit taken for that, is given back before any wait in place.
async fn rate_gate<S: KeyStore>(
    core: &Core,
    store: &S,
    spec: &JobSpec,
    env: &Envelope,
    incoming: &Incoming,
    claim: Option<ClaimWith>,
    permit: &mut Option<tokio::sync::OwnedSemaphorePermit>,
) -> Result<Gate, IdemError> {
    let Some(limit) = &spec.rate else { return Ok(Gate::Go(None)) };
    let key = rate_key(core, limit, env);
    let ticket = header_str(&incoming.properties, RATE_AT).and_then(|s| s.parse::<u64>().ok());
    let rate = &limit.limit.rate;
    let max_hold = core.config.worker.max_hold;
    let mut hold =
        if max_hold >= Duration::from_secs(1) { core.holds.clone().try_acquire_owned().ok() } else { None };
    let horizon = if hold.is_some() { max_hold } else { IN_PLACE };
    let take = store.take_rate(key, rate.interval_us(), rate.burst, ticket, horizon, claim).await?;
    if !take.admitted {
        return Ok(Gate::Park(rate_park(take.wait), Park::RateLimit { ticket_us: take.ticket_us }));
    }
    if take.wait.is_zero() || take.claim.is_some() {
        return Ok(Gate::Go(take.claim));
    }
    if take.wait < IN_PLACE {
        hold = None;
    }
    *permit = None;
    let worker_wide = give_back(&incoming.slot);
    tokio::select! {
        _ = tokio::time::sleep(take.wait) => {}
        _ = core.intake_stopped.cancelled() => return Ok(Gate::Stopped),
    }
    drop(hold);
    Ok(if take_again(core, &incoming.slot, worker_wide).await { Gate::Go(None) } else { Gate::Stopped })
}

/// How long any rate-limited run may wait in place without one of the worker's in-place
/// waits (`worker.max_hold` with one).
const IN_PLACE: Duration = Duration::from_millis(999);

/// What a workflow step's upstream steps say.
enum StepGate {
    /// Not a waiting step, or every upstream step came to what it waits for (their runs).
    Go(Vec<chime_shared::workflow::UpstreamRun>),
    /// Park it this long (registered on the upstream records, which release it sooner).
    Park(Duration, Park),
    /// It has waited longer than `redis.done_retention`: why.
    DeadLetter(String),
    /// A copy an upstream's end released, which still has to wait: acked (the step's own
    /// copy is parked).
    Drop,
}

/// Reads a workflow step's upstream records (see `chime_shared::workflow`), 64 at a time in
/// order, stopping at a batch with one that has not come to what the step waits for (a big
/// fan-in's copy released by each member's end reads no further than the first still running).
/// It goes when every one has; else it is parked (1 s, doubling with each park, at most 60 s;
/// a blocked one at most 10 min), what it waits for noted on its own record and, when that
/// changed, in the history. A copy an upstream's end released that still has to wait is
/// dropped: the step's own copy is parked already.
async fn step_gate<S: KeyStore>(
    core: &Core,
    store: &S,
    env: &Envelope,
    incoming: &Incoming,
) -> Result<StepGate, IdemError> {
    use chime_shared::workflow::{MAX_BLOCKED_PARK, MAX_PARK, Standing};
    let Some(step) = env.step.as_ref().filter(|s| !s.after.is_empty()) else {
        return Ok(StepGate::Go(Vec::new()));
    };
    let route = env.route();
    let mut runs = Vec::with_capacity(step.after.len());
    for batch in step.after.chunks(64) {
        let read = futures_util::future::try_join_all(
            batch.iter().map(|u| store.wait_for(u, env, &route, step.wait)),
        )
        .await?;
        let stop = read.iter().any(|r| !r.ended(step.wait));
        runs.extend(read);
        if stop {
            break;
        }
    }
    // Those not read yet count as not ended.
    let unread = step.after[runs.len()..].iter().map(|u| chime_shared::workflow::UpstreamRun {
        step: u.step.clone(),
        job: u.job.clone(),
        key: u.key,
        state: None,
        result: None,
    });
    runs.extend(unread.collect::<Vec<_>>());
    let standing = Standing::of(step.wait, runs);
    let blocked = matches!(standing, Standing::Blocked(_));
    let runs = match standing {
        Standing::Ready(runs) => return Ok(StepGate::Go(runs)),
        _ => standing.describe(),
    };
    let changed = match store.note_waiting(&env.key.to_string(), &runs).await {
        // Settled while it waited (cancelled, say): the claim settles this copy.
        Ok((_, Some(own))) if own.settled() => return Ok(StepGate::Go(Vec::new())),
        Ok((changed, _)) => changed,
        Err(e) => {
            warn!(error = %e, "cannot note the step's wait on its record");
            false
        }
    };
    if changed {
        info!(step = %step.name, "{runs}");
        if store.records_history() {
            let (outcome, reason) =
                if blocked { (Outcome::Blocked, "blocked") } else { (Outcome::Parked, "workflow") };
            let e = run_event(core, incoming, Some(env), None, outcome, Some(reason), Some(&runs));
            store.stream_run(&e);
            store.log_run(&e);
        }
    }
    if has_header(&incoming.properties, RELEASED) {
        return Ok(StepGate::Drop);
    }
    let header = |name| header_str(&incoming.properties, name);
    let parks: u32 = header(WORKFLOW_PARKS).and_then(|s| s.parse().ok()).unwrap_or(0);
    let now = core.now().timestamp();
    let since =
        header(WAITING_SINCE).and_then(|s| s.parse::<i64>().ok()).filter(|s| *s <= now).unwrap_or(now);
    let waited = Duration::from_secs(u64::try_from(now - since).unwrap_or(0));
    if waited > core.config.redis.done_retention {
        return Ok(StepGate::DeadLetter(format!(
            "waited {}s (redis.done_retention), {runs}",
            waited.as_secs()
        )));
    }
    let cap = if blocked { MAX_BLOCKED_PARK } else { MAX_PARK };
    let delay = Duration::from_secs(1 << parks.min(10)).min(cap);
    Ok(StepGate::Park(delay, Park::Workflow { parks: parks.saturating_add(1), since, blocked }))
}

/// Whether the delivery carries header `name`.
fn has_header(props: &BasicProperties, name: &str) -> bool {
    props.headers().as_ref().is_some_and(|h| h.inner().contains_key(name))
}

/// What a run's circuit breaker says.
enum Breaker<'a, S: KeyStore> {
    /// Closed, or no circuit (or Redis did not answer: a breaker fails open, and the claim
    /// that follows needs Redis anyway).
    Go,
    /// Half-open: the run goes as one of its probes.
    Probe(Probe<'a, S>),
    /// Open (or half-open with every probe out): park it this long, its attempt unchanged.
    Park(Duration, Park),
    /// Open with `on_open = "dead_letter"`: why.
    DeadLetter(String),
}

/// A probe a half-open circuit let through: reported when its run ends, else given back
/// when dropped (the run was parked or found its key settled), so the next run may probe.
struct Probe<'a, S: KeyStore> {
    store: &'a S,
    spec: Arc<JobSpec>,
    token: Option<String>,
}

impl<S: KeyStore> Probe<'_, S> {
    fn token(&mut self) -> Option<String> {
        self.token.take()
    }
}

impl<S: KeyStore> Drop for Probe<'_, S> {
    fn drop(&mut self) {
        if let (Some(token), Some(c)) = (self.token.take(), &self.spec.circuit) {
            self.store.circuit_give_back(c.key.clone(), &c.limits, &token);
        }
    }
}

/// Asks the job's circuit breaker (if any) whether the run may go: closed, it goes; open, it
/// is parked until probes may go (whole seconds, at least one), or dead-lettered with
/// `on_open = "dead_letter"`; half-open, it goes as a probe while fewer than `probes` are out,
/// else it is parked for 1 s, doubling with each such park, at most `open_for`.
async fn breaker<'a, S: KeyStore>(store: &'a S, spec: &Arc<JobSpec>, incoming: &Incoming) -> Breaker<'a, S> {
    use chime_shared::circuit::Admit;
    let Some(c) = &spec.circuit else { return Breaker::Go };
    if c.known_closed() {
        return Breaker::Go;
    }
    let admit = match store.circuit_admit(c.key.clone(), &c.limits).await {
        Ok(a) => a,
        Err(e) => {
            warn!(circuit = %c.name, error = %e, "circuit breaker unreadable in redis; the run goes through");
            return Breaker::Go;
        }
    };
    c.show(admit.state());
    c.answered(admit == Admit::Go);
    let parks: u32 =
        header_str(&incoming.properties, CIRCUIT_PARKS).and_then(|s| s.parse().ok()).unwrap_or(0);
    let why = Park::Circuit { parks: parks.saturating_add(1) };
    match admit {
        Admit::Go => Breaker::Go,
        Admit::Probe(token) => {
            info!(circuit = %c.name, "circuit half-open: this run goes as a probe");
            Breaker::Probe(Probe { store, spec: spec.clone(), token: Some(token) })
        }
        Admit::Open(_) if c.on_open == chime_shared::config::OnOpen::DeadLetter => {
            Breaker::DeadLetter(format!("circuit {:?} is open", c.name))
        }
        Admit::Open(left) => {
            Breaker::Park(Duration::from_secs(chime_shared::delay::seconds(left).max(1)), why)
        }
        Admit::Busy(_) => {
            let wait = Duration::from_secs(1 << parks.min(12)).min(c.limits.open_for);
            Breaker::Park(wait.max(Duration::from_secs(1)), why)
        }
    }
}

/// Tells the job's circuit breaker how its run ended (a probe's report decides the circuit).
async fn report<S: KeyStore>(store: &S, spec: &JobSpec, end: &RunEnd, probe: Option<Probe<'_, S>>) {
    use chime_shared::circuit::{CircuitState, Ended};
    let Some(c) = &spec.circuit else { return };
    let ended = match end {
        RunEnd::Succeeded => Ended::Succeeded,
        RunEnd::Failed(..) | RunEnd::RetryAfter(..) => Ended::Failed,
        RunEnd::RateLimited(..) | RunEnd::LeaseTaken | RunEnd::Stopped | RunEnd::Cancelled => Ended::Neither,
    };
    let token = probe.and_then(|mut p| p.token());
    // Successes are reported in batches (a closed circuit only needs their number); a
    // failure or a probe's end at once, with the successes not yet reported.
    let (ended, more) = match (ended, &token) {
        (Ended::Succeeded, None) => match c.succeeded() {
            0 => return,
            n => (Ended::Succeeded, n - 1),
        },
        (Ended::Failed, _) => {
            // After a failure the next run asks again: this one may have opened it.
            c.answered(false);
            (Ended::Failed, c.take_successes())
        }
        (e, _) => (e, 0),
    };
    match store.circuit_record(c.key.clone(), &c.limits, ended, token.as_deref(), more).await {
        Ok(r) => match r.changed {
            Some(CircuitState::Open) => {
                c.show(CircuitState::Open);
                metrics::counter!(telemetry::CIRCUIT_TRANSITIONS, "circuit" => c.name.clone(), "to" => "open")
                    .increment(1);
                warn!(circuit = %c.name, failed = r.failed, runs = r.succeeded + r.failed,
                    open_for = ?c.limits.open_for, "circuit opened: its runs wait until a probe succeeds");
            }
            Some(CircuitState::Closed) => {
                c.show(CircuitState::Closed);
                metrics::counter!(telemetry::CIRCUIT_TRANSITIONS, "circuit" => c.name.clone(), "to" => "closed")
                    .increment(1);
                info!(circuit = %c.name, "circuit closed: a probe succeeded");
            }
            _ => {}
        },
        Err(e) => warn!(circuit = %c.name, error = %e, "cannot count the run in its circuit breaker"),
    }
}

/// The Redis bucket of `env`'s run under `limit`: the limit's, for the run's tenant.
fn rate_key(core: &Core, limit: &chime_shared::config::ResolvedLimit, env: &Envelope) -> String {
    let tenant = match &limit.limit.key {
        Some(k) => k.tenant(&env.payload),
        None => chime_shared::config::NO_TENANT.to_string(),
    };
    core.names.rate(&limit.bucket, &tenant)
}

/// Hands the delivery's worker-wide slot back while it waits; the semaphore to take it again.
fn give_back(slot: &WorkerSlot) -> Option<Arc<tokio::sync::Semaphore>> {
    slot.take().map(|p| {
        let sem = p.semaphore().clone();
        drop(p);
        sem
    })
}

/// Takes the worker-wide slot given back by [`give_back`] again; `false` if intake stopped.
async fn take_again(core: &Core, slot: &WorkerSlot, sem: Option<Arc<tokio::sync::Semaphore>>) -> bool {
    let Some(sem) = sem else { return true };
    tokio::select! {
        p = sem.acquire_owned() => match p {
            Ok(p) => {
                slot.put(p);
                true
            }
            Err(_) => false,
        },
        _ = core.intake_stopped.cancelled() => false,
    }
}

/// Logs why a global slot could not be asked for (and reports Redis as failed).
fn slot_error(core: &Core, e: &IdemError) {
    if e.is_bad_record() {
        warn!(error = %e, "the job's global slots in Redis are unreadable; dead-lettering this delivery");
    } else {
        warn!(error = %e, "redis unreachable: requeueing without a decision");
        core.redis_failed();
    }
}

/// The claim a plan is carried out under.
struct Held {
    key: String,
    owner: String,
    fence: u64,
    /// The result of a successful run, encoded for the record (`StoredResult::encode`).
    result: Option<String>,
}

/// What the history records of a handler run.
struct RunFacts {
    started_at: DateTime<Utc>,
    duration: Duration,
    error: Option<String>,
}

/// A plan, with exactly what carrying it out needs: a plan that records on the key comes
/// with the claim it records under.
enum Verdict {
    /// Not a job (too large, malformed): dead-letter the bytes as they came.
    Rejected(DeadInfo),
    /// A job whose key this delivery does not hold.
    Unheld {
        env: Envelope,
        /// The job's definition (for its interned metric handles), if this worker has it.
        spec: Option<Arc<JobSpec>>,
        plan: Plan,
    },
    /// A job whose key this delivery holds.
    Held {
        env: Envelope,
        spec: Arc<JobSpec>,
        held: Held,
        plan: HeldPlan,
        /// The handler run, if one happened.
        run: Option<RunFacts>,
    },
}

impl Verdict {
    fn unheld(plan: Plan, env: Envelope, spec: Option<Arc<JobSpec>>) -> Self {
        Self::Unheld { env, spec, plan }
    }
}

/// Processes one delivery and settles it.
pub(crate) async fn handle<S: KeyStore, O: Outbox, A: AckSink>(
    core: &Core,
    store: &S,
    outbox: &O,
    mut incoming: Incoming,
    ticket: Ticket<A>,
) {
    let started = Instant::now();
    if incoming.queue.is_empty() {
        // From this worker's own queue (a broadcast copy): it belongs to the queue its
        // envelope names if that is a queue of the config (a publisher must not make this
        // worker write to any history stream or DLQ it names); else to the worker's first.
        incoming.queue = Envelope::decode(&incoming.data)
            .map(|e| e.queue)
            .ok()
            .filter(|q| core.config.all_queues().contains(q))
            .or_else(|| core.config.worker.queues.first().cloned())
            .unwrap_or_else(|| chime_shared::config::DEFAULT_QUEUE.to_string());
    }
    let max = core.config.amqp.max_message_bytes;
    let unknown = || telemetry::UNKNOWN_JOB_LABEL.to_string();
    let (label, verdict, span) = if incoming.data.len() > max {
        warn!(queue = %incoming.queue, size = incoming.data.len(), max, "message too large");
        let error = format!("{} bytes, above amqp.max_message_bytes ({max})", incoming.data.len());
        (unknown(), Verdict::Rejected(decision::rejected(DeadReason::TooLarge, &error)), Span::none())
    } else if !incoming.packed
        && pack::is_pack(&incoming.properties)
        && let Err(e) = pack::split(&incoming.data)
    {
        // A pack the intake could not unpack: dead-lettered whole.
        warn!(queue = %incoming.queue, route = %incoming.route, error = %e, "malformed pack");
        (
            unknown(),
            Verdict::Rejected(decision::rejected(DeadReason::Malformed, &e.to_string())),
            Span::none(),
        )
    } else {
        match Envelope::decode(&incoming.data) {
            Err(e) => {
                if incoming.packed {
                    incoming.properties = pack::unmarked(&incoming.properties);
                }
                warn!(queue = %incoming.queue, route = %incoming.route, error = %e, "malformed message");
                (
                    unknown(),
                    Verdict::Rejected(decision::rejected(DeadReason::Malformed, &e.to_string())),
                    Span::none(),
                )
            }
            Ok(mut env) => {
                if incoming.packed {
                    // From here on the job is a message of its own: retried, parked and
                    // dead-lettered with its own properties.
                    incoming.properties = pack::member_properties(&env, &incoming.properties);
                }
                // With traces off, the span the logs have always had, and nothing more.
                let span = if trace::enabled() {
                    let span = info_span!("job", otel.kind = "consumer", job = %env.job, key = %env.key,
                        attempt = env.attempt, outcome = tracing::field::Empty);
                    follow(&span, &mut env, &incoming.properties);
                    span
                } else {
                    info_span!("job", job = %env.job, key = %env.key, attempt = env.attempt)
                };
                let label = if core.knows(&env.job) { env.job.clone() } else { unknown() };
                let verdict = judge(core, store, &incoming, env).instrument(span.clone()).await;
                (label, verdict, span)
            }
        }
    };
    carry_out(core, store, outbox, &incoming, &label, verdict, ticket).instrument(span).await;
    debug!(elapsed_us = started.elapsed().as_micros() as u64, "delivery settled");
}

/// Continues the producer's trace in `span`: the envelope's `trace_id`, else the AMQP
/// `traceparent` header of a publisher in another language (copied into the envelope, so that
/// a retry carries it on); links the span of the attempt a retry follows.
fn follow(span: &Span, env: &mut Envelope, props: &BasicProperties) {
    let carried = env.trace_id.as_deref().and_then(|t| TraceContext::parse(t, env.trace_state.as_deref()));
    let parent = carried.or_else(|| {
        let c = TraceContext::parse(
            &header_str(props, "traceparent")?,
            header_str(props, "tracestate").as_deref(),
        )?;
        env.trace_id = Some(c.traceparent.clone());
        env.trace_state.clone_from(&c.tracestate);
        Some(c)
    });
    if let Some(p) = &parent {
        trace::adopt(span, p);
    }
    if let Some(previous) = header_str(props, PREVIOUS_SPAN).and_then(|p| TraceContext::parse(&p, None)) {
        trace::link(span, &previous);
    }
}

/// Handler lookup, deadline, claim and run: the plan for a decoded envelope.
async fn judge<S: KeyStore>(core: &Core, store: &S, incoming: &Incoming, env: Envelope) -> Verdict {
    // How long the queue made it wait, for load shedding: only a copy published straight to
    // the queue says so (one back from the delay chain, `x-death`, waited on purpose).
    if !core.shed.is_empty() && !has_header(&incoming.properties, "x-death") {
        let waited = (core.now() - env.enqueued_at).num_milliseconds().max(0);
        core.saw_age(&incoming.queue, u64::try_from(waited).unwrap_or(0));
    }
    let Some(spec) = core.job(&env.job) else {
        let now = core.now();
        let since = header_str(&incoming.properties, UNKNOWN_SINCE)
            .and_then(|s| s.parse::<DateTime<Utc>>().ok())
            .filter(|t| *t <= now)
            .unwrap_or(now);
        let plan =
            decision::unknown_job(&env.job, env.attempt, since, now, core.config.worker.unknown_job_grace);
        let grace = chime_shared::duration::format(core.config.worker.unknown_job_grace);
        match &plan {
            Plan::Redelay { delay, .. } => warn!(
                retry_in = %chime_shared::duration::format(*delay),
                unknown_since = %since,
                %grace,
                "no handler for this job on this worker: sent round again until worker.unknown_job_grace has passed (a rolling deploy may bring its handler)"
            ),
            _ => warn!(
                unknown_since = %since,
                %grace,
                "no handler for this job on any worker within worker.unknown_job_grace: dead-lettered as unknown_job"
            ),
        }
        return Verdict::unheld(plan, env, None);
    };
    // A backfilled slot is past on purpose: its deadline runs from the backfill.
    let due_at = if env.backfill { Some(env.enqueued_at) } else { env.slot };
    if let (Some(slot), Some(deadline)) = (due_at, spec.deadline) {
        let late = (core.now() - slot).to_std().unwrap_or(Duration::ZERO);
        if late > deadline {
            warn!(%slot, late_ms = late.as_millis() as u64, "slot picked up past its deadline; skipped as expired");
            return Verdict::unheld(Plan::Ack(Settled::Expired), env, Some(spec));
        }
    }
    if spec.sheddable && core.shedding(&incoming.queue).is_some() {
        let (key, owner) = (env.key.to_string(), core.owner_token());
        let version = chime_shared::idempotency::version_of(&env);
        return match decision::on_claim(
            claim(core, store, &key, &owner, (version, env.attempt), None).await.as_ref().cloned(),
        ) {
            AfterClaim::Run(fence) => {
                let held = Held { key, owner, fence, result: None };
                Verdict::Held { env, spec, held, plan: HeldPlan::Shed, run: None }
            }
            AfterClaim::Settle(plan) => Verdict::unheld(plan, env, Some(spec)),
            AfterClaim::Hold { fence, plan } => {
                let held = Held { key, owner, fence, result: None };
                Verdict::Held { env, spec, held, plan, run: None }
            }
        };
    }
    let upstream = match step_gate(core, store, &env, incoming).await {
        Ok(StepGate::Go(runs)) => runs,
        Ok(StepGate::Park(delay, why)) => {
            return Verdict::unheld(Plan::Redelay { delay, why: Redelay::Parked(why) }, env, Some(spec));
        }
        Ok(StepGate::Drop) => {
            debug!("a released copy of a step that still waits: dropped (its own copy is parked)");
            return Verdict::unheld(Plan::Ack(Settled::Released), env, Some(spec));
        }
        Ok(StepGate::DeadLetter(why)) => {
            let dead = decision::dead_info(DeadReason::Blocked, &why, env.attempt);
            return Verdict::unheld(Plan::DeadLetter(dead), env, Some(spec));
        }
        Err(e) => {
            slot_error(core, &e);
            return Verdict::unheld(decision::on_redis_error(&e), env, Some(spec));
        }
    };
    let mut probe = match breaker(store, &spec, incoming).await {
        Breaker::Go => None,
        Breaker::Probe(p) => Some(p),
        Breaker::Park(delay, why) => {
            return Verdict::unheld(Plan::Redelay { delay, why: Redelay::Parked(why) }, env, Some(spec));
        }
        Breaker::DeadLetter(why) => {
            let dead = decision::dead_info(DeadReason::CircuitOpen, &why, env.attempt);
            return Verdict::unheld(Plan::DeadLetter(dead), env, Some(spec));
        }
    };
    let owner = core.owner_token();
    let key = env.key.to_string();
    let version = chime_shared::idempotency::version_of(&env);
    // Claimed with the rate decision when nothing else is taken between them: no global slot,
    // and the job's own permit in this process (exec and http jobs have one by default) free
    // now, held through the decision (given back if the run must wait).
    let mut early_permit = match (&spec.rate, &spec.limit, spec.global) {
        (Some(_), Some(limit), None) => limit.clone().try_acquire_owned().ok(),
        _ => None,
    };
    let claim_with =
        (spec.rate.is_some() && spec.global.is_none() && (spec.limit.is_none() || early_permit.is_some()))
            .then(|| ClaimWith { key: key.clone(), owner: owner.clone(), version, attempt: env.attempt });
    let claimed = match rate_gate(core, store, &spec, &env, incoming, claim_with, &mut early_permit).await {
        Ok(Gate::Go(claimed)) => claimed,
        Ok(Gate::Park(delay, why)) => {
            return Verdict::unheld(Plan::Redelay { delay, why: Redelay::Parked(why) }, env, Some(spec));
        }
        Ok(Gate::Stopped) => return Verdict::unheld(Plan::Requeue, env, Some(spec)),
        Err(e) => {
            slot_error(core, &e);
            return Verdict::unheld(decision::on_redis_error(&e), env, Some(spec));
        }
    };
    // Held until the run is over (dropped at the end of this function).
    let _job_permit = match (&spec.limit, early_permit) {
        (_, Some(p)) => Some(p),
        (Some(limit), None) => match job_permit(core, limit, &incoming.slot).await {
            Some(p) => Some(p),
            None => return Verdict::unheld(Plan::Requeue, env, Some(spec)),
        },
        (None, None) => None,
    };
    let parks: u32 = header_str(&incoming.properties, SLOT_PARKS).and_then(|s| s.parse().ok()).unwrap_or(0);
    let _global_slot = match spec.global {
        Some(limit) => {
            match global_slot(core, store, &spec, &env.job, &owner, limit, &incoming.slot, parks).await {
                Ok(SlotWait::Got(slot)) => Some(slot),
                Ok(SlotWait::Stopped) => return Verdict::unheld(Plan::Requeue, env, Some(spec)),
                Ok(SlotWait::Park(delay)) => {
                    let why = Redelay::Parked(Park::GlobalSlot { parks: parks.saturating_add(1) });
                    return Verdict::unheld(Plan::Redelay { delay, why }, env, Some(spec));
                }
                Err(e) => {
                    slot_error(core, &e);
                    return Verdict::unheld(decision::on_redis_error(&e), env, Some(spec));
                }
            }
        }
        None => None,
    };
    let claim = claim(core, store, &key, &owner, (version, env.attempt), claimed).await;
    let checkpoint = match &claim {
        Ok(Claim::Claimed { checkpoint, .. }) => checkpoint.clone(),
        _ => None,
    };
    let fence = match decision::on_claim(claim.as_ref().cloned()) {
        AfterClaim::Run(fence) => fence,
        AfterClaim::Settle(plan) => return Verdict::unheld(plan, env, Some(spec)),
        // A `dying` claim made us the owner of the dead letter to publish again.
        AfterClaim::Hold { fence, plan } => {
            let held = Held { key, owner, fence, result: None };
            return Verdict::Held { env, spec, held, plan, run: None };
        }
    };
    let metrics = spec.metrics(&env.job);
    let lag_from = env.slot.unwrap_or(env.enqueued_at);
    let lag_ms = (core.now() - lag_from).num_milliseconds().max(0);
    metrics.lag.record(lag_ms as f64 / 1000.0);
    core.count_minute(|c| c.latency(u64::try_from(lag_ms).unwrap_or(0)));
    let fence = AtomicU64::new(fence);
    let (run_started, started_at) = (Instant::now(), core.now());
    let running = chime_shared::control::Running {
        job: env.job.clone(),
        key: key.clone(),
        queue: incoming.queue.clone(),
        attempt: env.attempt,
        started_at,
    };
    let guard = core.running(&owner, running);
    let (end, result) =
        run(core, store, &spec, &env, &key, &owner, &fence, checkpoint, upstream, &guard.cancelled).await;
    drop(guard);
    let duration = run_started.elapsed();
    metrics.duration.record(duration.as_secs_f64());
    let mut error = None;
    if let RunEnd::Failed(_, e) | RunEnd::RetryAfter(_, e) = &end {
        let e = chime_shared::redact::redact_text(e);
        warn!(error = %chime_shared::redact::escape_control(&e), "job failed");
        error = Some(e);
    }
    if let (RunEnd::RateLimited(wait, _), Some(limit)) = (&end, &spec.rate) {
        // Every worker's runs of this bucket wait too (best-effort: this run parks either way).
        let rate = &limit.limit.rate;
        let key = rate_key(core, limit, &env);
        if let Err(e) = store.slow_rate(key, *wait, rate.interval_us(), rate.burst).await {
            warn!(error = %e, "cannot hold the job's rate limit in redis; only this run waits");
        }
    }
    report(store, &spec, &end, probe.take()).await;
    let plan = decision::on_run(end, env.attempt, env.max_attempts, &spec.backoff, env.key);
    let result = result.map(|r| StoredResult::encode(r, core.config.results.max_bytes));
    let held = Held { key, owner, fence: fence.load(Ordering::Relaxed), result };
    Verdict::Held { env, spec, held, plan, run: Some(RunFacts { started_at, duration, error }) }
}

/// Claims `key` for `owner` (unless the rate decision `claimed` it already); a failure is
/// logged (and an unreachable Redis pauses the intake).
async fn claim<S: KeyStore>(
    core: &Core,
    store: &S,
    key: &str,
    owner: &str,
    (version, attempt): (u64, u32),
    claimed: Option<Result<Claim, IdemError>>,
) -> Result<Claim, IdemError> {
    let claim = match claimed {
        Some(claim) => claim,
        None => store.claim(key, owner, version, attempt).await,
    };
    match &claim {
        Err(e) if e.is_bad_record() => {
            warn!(error = %e, "the key's record is unreadable; dead-lettering this delivery")
        }
        Err(e) => {
            warn!(error = %e, "redis unreachable: requeueing without a decision");
            core.redis_failed();
        }
        Ok(_) => {}
    }
    claim
}

/// Why a run was stopped before it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Timeout,
    LeaseTaken,
    Shutdown,
    Cancelled,
}

/// What a handler left as its result (see [`JobContext::set_result`]).
type RunResult = Option<Result<serde_json::Value, String>>;

/// Runs the handler under its timeout with the lease renewed and its checkpoints saved,
/// catching a panic; returns how it ended and the result it set.
#[allow(clippy::too_many_arguments)]
async fn run<S: KeyStore>(
    core: &Core,
    store: &S,
    spec: &JobSpec,
    env: &Envelope,
    key: &str,
    owner: &str,
    fence: &AtomicU64,
    checkpoint: Option<String>,
    upstream: Vec<chime_shared::workflow::UpstreamRun>,
    cancelled: &CancellationToken,
) -> (RunEnd, RunResult) {
    let (saves, save_rx) = tokio::sync::mpsc::unbounded_channel();
    let state = Arc::new(crate::handler::RunState {
        checkpoint: std::sync::Mutex::new(checkpoint),
        result: std::sync::Mutex::new(None),
        saves: Some(saves),
        max_bytes: core.config.checkpoints.max_bytes,
        result_max_bytes: core.config.results.max_bytes,
        poll: core.config.checkpoints.poll,
        kept: None,
        upstream,
    });
    let end = run_handler(core, store, spec, env, key, owner, fence, state.clone(), save_rx, cancelled).await;
    let result = state.result.lock().ok().and_then(|mut r| r.take());
    (end, result)
}

/// [`run`] with its run state made.
#[allow(clippy::too_many_arguments)]
async fn run_handler<S: KeyStore>(
    core: &Core,
    store: &S,
    spec: &JobSpec,
    env: &Envelope,
    key: &str,
    owner: &str,
    fence: &AtomicU64,
    state: Arc<crate::handler::RunState>,
    save_rx: tokio::sync::mpsc::UnboundedReceiver<crate::handler::SaveCheckpoint>,
    // Fired when `chime cancel` names this key (the cancellations stream).
    cancelled: &CancellationToken,
) -> RunEnd {
    let cancel = CancellationToken::new();
    let ctx = JobContext {
        job: env.job.clone(),
        queue: env.queue.clone(),
        key: env.key,
        id: env.id,
        attempt: env.attempt,
        max_attempts: env.max_attempts,
        slot: env.slot,
        fence: fence.load(Ordering::Relaxed),
        timeout: spec.timeout,
        cancel: cancel.clone(),
        run: state,
        shard: env.shard.zip(env.shards),
        group: env.group,
    };
    let mut task = std::pin::pin!(
        std::panic::AssertUnwindSafe(spec.handler.call(ctx, env.payload.clone())).catch_unwind()
    );
    // Beside the handler: lease renewals (this ends only when another owner took the key) and
    // the checkpoints it saves, under this claim.
    let mut renewals = std::pin::pin!(async {
        tokio::select! {
            lost = renew_lease(core, store, key, owner, fence, spec.global.map(|n| (env.job.as_str(), n))) => lost,
            _ = save_checkpoints(core, store, key, owner, save_rx) => std::future::pending().await,
        }
    });
    let mut stop = tokio::select! {
        joined = &mut task => return ended(joined),
        _ = tokio::time::sleep(spec.timeout) => Stop::Timeout,
        lost = &mut renewals => lost,
        _ = cancelled.cancelled() => Stop::Cancelled,
        _ = core.hard_stop.cancelled() => Stop::Shutdown,
    };
    if stop == Stop::Cancelled {
        info!("cancelled (chime cancel): the handler's cancellation token fires");
    }
    // Cancellation first; the handler has the grace to stop on its own, renewing meanwhile.
    cancel.cancel();
    let grace = core.config.worker.cancel_grace;
    let late = tokio::select! {
        joined = tokio::time::timeout(grace, &mut task) => joined.ok(),
        lost = &mut renewals, if stop != Stop::LeaseTaken && stop != Stop::Cancelled => {
            stop = lost;
            None
        }
    };
    if stop == Stop::LeaseTaken {
        warn!("another owner took this key over; the handler was cancelled and that owner settles it");
        return RunEnd::LeaseTaken;
    }
    match (stop, late.map(ended)) {
        // Told to stop by `chime cancel`: cancelled, whatever it returned after.
        (Stop::Cancelled, _) => RunEnd::Cancelled,
        // Stopped cleanly with a result: success stands; an error after a timeout is a timeout.
        (_, Some(RunEnd::Succeeded)) => RunEnd::Succeeded,
        (Stop::Timeout, Some(RunEnd::Failed(Failure::Permanent, e))) => RunEnd::Failed(Failure::Permanent, e),
        (
            Stop::Timeout,
            Some(RunEnd::Failed(_, e) | RunEnd::RetryAfter(_, e) | RunEnd::RateLimited(_, e)),
        ) => RunEnd::Failed(
            Failure::Timeout,
            format!("timeout after {}: {e}", chime_shared::duration::format(spec.timeout)),
        ),
        (Stop::Timeout, _) => RunEnd::Failed(
            Failure::Timeout,
            format!(
                "timeout: no result within {} (plus {} after cancellation)",
                chime_shared::duration::format(spec.timeout),
                chime_shared::duration::format(grace)
            ),
        ),
        (_, _) => RunEnd::Stopped,
    }
}

type Joined = Result<Result<(), JobError>, Box<dyn std::any::Any + Send>>;

fn ended(joined: Joined) -> RunEnd {
    match joined {
        Ok(Ok(())) => RunEnd::Succeeded,
        Ok(Err(e)) if e.is_permanent() => RunEnd::Failed(Failure::Permanent, e.to_string()),
        // A handler's own delays within what the delay chain holds (a longer one would lose its
        // high bits there) and a push-back within a day (it holds the whole bucket).
        Ok(Err(e)) => match (e.rate_limited_for(), e.retry_delay()) {
            (Some(wait), _) => RunEnd::RateLimited(wait.min(crate::handler::MAX_PUSH_BACK), e.to_string()),
            (None, Some(delay)) => {
                RunEnd::RetryAfter(delay.min(chime_shared::delay::MAX_DELAY), e.to_string())
            }
            (None, None) => RunEnd::Failed(Failure::Transient, e.to_string()),
        },
        Err(panic) => RunEnd::Failed(Failure::Panic, format!("panic: {}", panic_message(panic))),
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Saves the checkpoints a run asks for, one at a time, answering each; ends when the run's
/// context is gone.
async fn save_checkpoints<S: KeyStore>(
    core: &Core,
    store: &S,
    key: &str,
    owner: &str,
    mut saves: tokio::sync::mpsc::UnboundedReceiver<crate::handler::SaveCheckpoint>,
) {
    while let Some(save) = saves.recv().await {
        let answer = match store.checkpoint(key, owner, &save.json).await {
            Ok(Recorded::Yes | Recorded::Recreated) => Ok(()),
            Ok(Recorded::NotOurs) => Err("another owner holds the key now; checkpoint not saved".to_string()),
            Err(e) => {
                if !e.is_bad_record() {
                    core.redis_failed();
                }
                Err(format!("checkpoint not saved: {e}"))
            }
        };
        let _ = save.done.send(answer);
    }
}

/// Renews the lease every third of it; returns only when another owner holds the key
/// ([`Stop::LeaseTaken`]) or the key was cancelled ([`Stop::Cancelled`]). A record Redis lost
/// is claimed again (new fence) and the job keeps running.
///
/// A run holding a global slot (`global`: job and limit) renews it with the lease. A slot that
/// lapsed meanwhile (Redis lost it, or the worker stalled past the lease) is taken again if
/// one is free; if none is, the run goes on over the limit, and says so.
async fn renew_lease<S: KeyStore>(
    core: &Core,
    store: &S,
    key: &str,
    owner: &str,
    fence: &AtomicU64,
    global: Option<(&str, usize)>,
) -> Stop {
    let lease = store.lease();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + lease / 3, lease / 3);
    let mut over_limit = false;
    loop {
        tick.tick().await;
        if let Some((job, limit)) = global {
            match store.take_slot(job, owner, limit).await {
                Ok(SlotTake::Taken) => over_limit = false,
                Ok(SlotTake::Full { .. }) if !over_limit => {
                    over_limit = true;
                    warn!(
                        limit,
                        "this run's global slot lapsed and every slot is taken: it runs over the limit"
                    );
                }
                Ok(SlotTake::Full { .. }) | Err(_) => {}
            }
        }
        match store.renew(key, owner).await {
            Ok(Renewal::Renewed) => {}
            Ok(Renewal::Recreated { fence: new }) => {
                warn!(
                    fence = new,
                    "redis had lost this job's record; claimed it again, the job keeps running"
                );
                fence.store(new, Ordering::Relaxed);
                Stats::bump(&core.stats.leases_recreated);
            }
            Ok(Renewal::Lost) => return Stop::LeaseTaken,
            Ok(Renewal::Cancelled) => return Stop::Cancelled,
            Err(e) if e.is_bad_record() => warn!(error = %e, "lease renewal failed; the job keeps running"),
            Err(e) => {
                warn!(error = %e, "lease renewal failed; the job keeps running");
                core.redis_failed();
            }
        }
    }
}

/// Carries the plan out and settles the delivery, last.
#[allow(clippy::too_many_arguments)]
async fn carry_out<S: KeyStore, O: Outbox, A: AckSink>(
    core: &Core,
    store: &S,
    outbox: &O,
    incoming: &Incoming,
    label: &str,
    verdict: Verdict,
    ticket: Ticket<A>,
) {
    let base = Settle { core, store, outbox, incoming, label, env: None, run: None, interned: None };
    // The hot outcomes use the job's interned handles; the rest look the series up.
    match verdict {
        Verdict::Rejected(dead) => base.dead_letter(&dead, None, ticket).await,
        Verdict::Unheld { env, spec, plan } => {
            let interned = spec.as_ref().map(|s| s.metrics(&env.job));
            Settle { env: Some(&env), interned, ..base }.unheld(plan, ticket).await
        }
        Verdict::Held { env, spec, held, plan, run } => {
            let interned = Some(spec.metrics(&env.job));
            Settle { env: Some(&env), run: run.as_ref(), interned, ..base }
                .held(&env, &held, plan, ticket)
                .await
        }
    }
}

/// What settling one delivery refers to.
struct Settle<'a, S, O> {
    core: &'a Core,
    store: &'a S,
    outbox: &'a O,
    incoming: &'a Incoming,
    /// The job's metric label (`unknown` for a job this worker has no handler for).
    label: &'a str,
    env: Option<&'a Envelope>,
    run: Option<&'a RunFacts>,
    interned: Option<&'a crate::state::JobMetrics>,
}

impl<S: KeyStore, O: Outbox> Settle<'_, S, O> {
    /// The run's event when history is on, handed to the history stream now: before the
    /// `finish` that records the outcome (and puts the event in the key's record), so that
    /// no outcome is recorded without its run reaching the stream first.
    fn streamed(&self, outcome: Outcome, reason: Option<&str>, error: Option<&str>) -> Option<RunEvent> {
        let e = self
            .store
            .records_history()
            .then(|| run_event(self.core, self.incoming, self.env, self.run, outcome, reason, error))?;
        self.store.stream_run(&e);
        Some(e)
    }

    /// Puts a streamed event in its key's record unless its `finish` did (`logged`).
    fn log_unless(&self, e: Option<RunEvent>, logged: bool) {
        if let (Some(e), false) = (e, logged) {
            self.store.log_run(&e);
        }
    }

    /// Records an event no `finish` carries: in the stream and in the key's record.
    fn record(&self, outcome: Outcome, reason: Option<&str>, error: Option<&str>) {
        self.log_unless(self.streamed(outcome, reason, error), false)
    }

    /// Whether this key's successful runs are logged (`log.success_sample`).
    fn logs_success(&self) -> bool {
        self.env.is_none_or(|e| self.core.config.log.logs_success(&e.key))
    }

    /// Logs (as a success is, `log.success_sample`) and counts a parked run.
    fn parked(&self, park: Park, delay: Duration) {
        if self.logs_success() {
            info!(reason = park.as_str(), ?delay, "run parked");
        }
        metrics::counter!(telemetry::RUNS_PARKED, "job" => self.label.to_string(), "reason" => park.as_str())
            .increment(1);
        if trace::enabled() {
            Span::current().record("outcome", "parked");
        }
    }

    fn run_error(&self) -> Option<&str> {
        self.run.and_then(|r| r.error.as_deref())
    }

    fn completed(&self, o: &'static str) {
        if trace::enabled() {
            Span::current().record("outcome", o);
        }
        self.core.count_minute(|c| c.outcome(o));
        match (self.interned, o) {
            (Some(m), outcome::SUCCEEDED) => m.succeeded.increment(1),
            (Some(m), outcome::DUPLICATE) => m.duplicate.increment(1),
            _ => {
                metrics::counter!(telemetry::JOBS_COMPLETED, "job" => self.label.to_string(), "outcome" => o)
                    .increment(1)
            }
        }
    }

    fn stats(&self) -> &Stats {
        &self.core.stats
    }

    async fn requeue<A: AckSink>(&self, ticket: Ticket<A>) {
        Stats::bump(&self.stats().requeued);
        ticket.requeue().await;
    }

    /// A copy dropped without running (its key cancelled, or replaced by a newer enqueue):
    /// counted, recorded (reason = the outcome's name), acked.
    async fn dropped<A: AckSink>(&self, o: Outcome, label: &'static str, why: &str, ticket: Ticket<A>) {
        self.completed(label);
        self.record(o, Some(o.as_str()), Some(why));
        ticket.ack().await;
    }

    /// Publishes at once the workflow steps registered as waiting for `env`'s key, now that
    /// it is `done` or `dead` (best-effort: a step not released here comes back parked).
    async fn release(&self, env: &Envelope) {
        if !env.step.as_ref().is_some_and(|s| s.releases) {
            return;
        }
        if *FAULT_BEFORE_RELEASE {
            error!("CHIME_TEST_FAULT=abort_before_release: the process dies between `done` and the release");
            std::process::abort();
        }
        let waiting = match self.store.release(&env.key.to_string()).await {
            Ok(w) => w,
            Err(e) => {
                warn!(error = %e, "cannot release the steps waiting for this one; their parked copies come back on their own");
                return;
            }
        };
        for (route, copy) in waiting {
            let mut headers = FieldTable::default();
            put_header(&mut headers, RELEASED, "1");
            match self.outbox.delayed(&route, &copy, Duration::ZERO, headers).await {
                Ok(()) => debug!(step = %copy.job, key = %copy.key, "waiting step released"),
                Err(e) => {
                    warn!(error = %e, key = %copy.key, "cannot release a waiting step; its parked copy comes back on its own")
                }
            }
        }
    }

    /// A delivery whose key it does not hold.
    async fn unheld<A: AckSink>(&self, plan: Plan, ticket: Ticket<A>) {
        match plan {
            Plan::Ack(Settled::Duplicate) => {
                debug!("duplicate absorbed");
                Stats::bump(&self.stats().duplicates);
                self.completed(outcome::DUPLICATE);
                ticket.ack().await;
            }
            Plan::Ack(Settled::Superseded) => {
                debug!("older copy of a replaced key dropped (superseded)");
                let why = "a newer enqueue of this key replaced this copy";
                self.dropped(Outcome::Superseded, outcome::SUPERSEDED, why, ticket).await;
            }
            Plan::Ack(Settled::Cancelled) => {
                info!("copy of a cancelled key dropped");
                let why = "a copy of a cancelled key, dropped";
                self.dropped(Outcome::Cancelled, outcome::CANCELLED, why, ticket).await;
            }
            Plan::Ack(Settled::Released) => ticket.ack().await,
            Plan::Ack(Settled::Expired) => {
                Stats::bump(&self.stats().expired);
                self.completed(outcome::EXPIRED);
                self.record(Outcome::Expired, None, None);
                ticket.ack().await;
            }
            Plan::Requeue => self.requeue(ticket).await,
            Plan::Redelay { delay, why } => {
                let Some(env) = self.env else { return self.requeue(ticket).await };
                let mut headers = FieldTable::default();
                match why {
                    Redelay::UnknownJob(since) => {
                        put_header(&mut headers, UNKNOWN_SINCE, &since.to_rfc3339())
                    }
                    Redelay::Parked(Park::RateLimit { ticket_us }) => {
                        put_header(&mut headers, RATE_AT, &ticket_us.to_string())
                    }
                    Redelay::Parked(Park::GlobalSlot { parks }) => {
                        put_header(&mut headers, SLOT_PARKS, &parks.to_string())
                    }
                    Redelay::Parked(Park::Circuit { parks }) => {
                        put_header(&mut headers, CIRCUIT_PARKS, &parks.to_string())
                    }
                    Redelay::Parked(Park::Workflow { parks, since, .. }) => {
                        put_header(&mut headers, WORKFLOW_PARKS, &parks.to_string());
                        put_header(&mut headers, WAITING_SINCE, &since.to_string());
                    }
                    Redelay::Parked(Park::PushedBack) | Redelay::Busy => {}
                }
                let sent = if matches!(why, Redelay::Parked(_)) {
                    // A pack of its job's copies never holds more than it can run at once.
                    let most = self.core.job(&env.job).and_then(|s| s.max_running).unwrap_or(usize::MAX);
                    self.outbox.parked(&env.route(), env, delay, headers, most).await
                } else {
                    self.outbox.delayed(&env.route(), env, delay, headers).await
                };
                match sent {
                    Ok(()) => {
                        debug!(?delay, ?why, "copy sent round again");
                        Stats::bump(&self.stats().redelayed);
                        if let Redelay::Parked(park) = why {
                            self.parked(park, delay);
                            // A workflow step's waits are recorded by its gate, once.
                            if !matches!(park, Park::Workflow { .. }) {
                                self.record(Outcome::Parked, Some(park.as_str()), None);
                            }
                        }
                        ticket.ack().await;
                    }
                    Err(e) => {
                        error!(error = %e, "cannot send the copy round again; requeueing");
                        self.requeue(ticket).await;
                    }
                }
            }
            Plan::DeadLetter(dead) => self.dead_letter(&dead, None, ticket).await,
        }
    }

    /// A delivery that holds its key under `h`.
    async fn held<A: AckSink>(&self, env: &Envelope, h: &Held, plan: HeldPlan, ticket: Ticket<A>) {
        let (core, store) = (self.core, self.store);
        match plan {
            HeldPlan::RecordDone => {
                let done = self.streamed(Outcome::Succeeded, None, None);
                if let Some(logged) = record_until_done(core, store, h, done.as_ref()).await {
                    self.release(env).await;
                    Stats::bump(&self.stats().succeeded);
                    self.completed(outcome::SUCCEEDED);
                    self.log_unless(done, logged);
                    if self.logs_success() {
                        info!("job succeeded");
                    }
                    ticket.ack().await;
                } else {
                    error!(
                        "drain deadline passed before `done` could be recorded; requeueing (the job may run again)"
                    );
                    self.record(
                        Outcome::Stopped,
                        None,
                        Some("succeeded, but `done` could not be recorded before the drain deadline"),
                    );
                    self.requeue(ticket).await;
                }
            }
            HeldPlan::Retry { delay } => {
                let mut next = env.clone();
                next.attempt += 1;
                next.id = chime_shared::envelope::new_id();
                let mut headers = FieldTable::default();
                if let Some(this) = trace::current() {
                    put_header(&mut headers, PREVIOUS_SPAN, &this.traceparent);
                }
                let sent = self.outbox.delayed(&next.route(), &next, delay, headers).await;
                let retried =
                    if sent.is_ok() { self.streamed(Outcome::Retried, None, self.run_error()) } else { None };
                // Free the key either way: the retry (or the requeued copy) must be able to claim
                // it. A published retry also marks its attempt as the key's next: this copy,
                // should it come back (its ack lost), is then stale and does not run again.
                let state = if sent.is_ok() { Final::Retry(next.attempt) } else { Final::Free };
                let freed = best_effort(core, "free the key", || {
                    store.finish(&h.key, &h.owner, h.fence, state, None, retried.as_ref())
                })
                .await;
                match sent {
                    Ok(()) => {
                        info!(retry_in = ?delay, attempt = next.attempt, "retry published");
                        Stats::bump(&self.stats().retried);
                        self.completed(outcome::RETRIED);
                        self.log_unless(retried, logged(freed));
                        ticket.ack().await;
                    }
                    Err(e) => {
                        error!(error = %e, "cannot publish the retry; requeueing");
                        self.requeue(ticket).await;
                    }
                }
            }
            HeldPlan::Park { delay } => {
                // The same attempt, after the wait the downstream asked for.
                let sent = self.outbox.delayed(&env.route(), env, delay, FieldTable::default()).await;
                let parked = if sent.is_ok() {
                    self.streamed(Outcome::Parked, Some(Park::PushedBack.as_str()), self.run_error())
                } else {
                    None
                };
                let freed = best_effort(core, "free the key", || {
                    store.finish(&h.key, &h.owner, h.fence, Final::Free, None, parked.as_ref())
                })
                .await;
                match sent {
                    Ok(()) => {
                        self.parked(Park::PushedBack, delay);
                        self.log_unless(parked, logged(freed));
                        ticket.ack().await;
                    }
                    Err(e) => {
                        error!(error = %e, "cannot park the run; requeueing");
                        self.requeue(ticket).await;
                    }
                }
            }
            HeldPlan::Shed => {
                let why = self.core.shedding(&self.incoming.queue).unwrap_or_default();
                let shed = self.streamed(Outcome::Shed, Some("load"), Some(&why));
                if let Some(logged) = record_until_done(core, store, h, shed.as_ref()).await {
                    if self.logs_success() {
                        info!(reason = %why, "queue backed up: sheddable run skipped (shed)");
                    }
                    self.completed(outcome::SHED);
                    self.log_unless(shed, logged);
                    ticket.ack().await;
                } else {
                    error!("drain deadline passed before the shed run could be recorded; requeueing");
                    self.requeue(ticket).await;
                }
            }
            HeldPlan::DeadLetter { dead, mark } => self.dead_letter(&dead, Some((h, mark)), ticket).await,
            HeldPlan::LeaseTaken => {
                Stats::bump(&self.stats().lost_lease);
                self.record(Outcome::LostLease, None, self.run_error());
                ticket.ack().await;
            }
            HeldPlan::Cancelled => {
                info!("job cancelled (chime cancel)");
                self.completed(outcome::CANCELLED);
                let why = self.run_error().unwrap_or("cancelled while it ran (chime cancel)");
                self.record(Outcome::Cancelled, Some("cancelled"), Some(why));
                ticket.ack().await;
            }
            HeldPlan::Release => {
                let stopped = self.streamed(Outcome::Stopped, None, self.run_error());
                let freed = best_effort(core, "free the key", || {
                    store.finish(&h.key, &h.owner, h.fence, Final::Free, None, stopped.as_ref())
                })
                .await;
                info!("job stopped by the drain deadline; requeued");
                self.log_unless(stopped, logged(freed));
                self.requeue(ticket).await;
            }
        }
    }

    /// Publishes the delivery to its queue's DLQ, then (as the key's holder) records `dead`.
    async fn dead_letter<A: AckSink>(
        &self,
        dead: &DeadInfo,
        held: Option<(&Held, KeyMark)>,
        ticket: Ticket<A>,
    ) {
        let (core, store, incoming) = (self.core, self.store, self.incoming);
        if let Some((h, KeyMark::MarkDying)) = held {
            let marked =
                best_effort(core, "mark the key dying", || store.mark_dying(&h.key, &h.owner, h.fence, dead))
                    .await;
            if marked == Some(Recorded::NotOurs) {
                warn!("another owner took this key over before it was dead-lettered; that owner settles it");
                Stats::bump(&self.stats().lost_lease);
                self.record(Outcome::LostLease, None, self.run_error());
                return ticket.ack().await;
            }
        }
        let props = dead_letter_properties(core, incoming, dead);
        match self.outbox.dead_letter(&incoming.queue, &incoming.data, props).await {
            Ok(()) => {
                let error = chime_shared::redact::redact_text(&dead.error);
                let died = self.streamed(Outcome::DeadLettered, Some(&dead.reason), Some(&error));
                let mut recorded = None;
                if let Some((h, _)) = held {
                    recorded = best_effort(core, "record dead", || {
                        store.finish(&h.key, &h.owner, h.fence, Final::Dead, None, died.as_ref())
                    })
                    .await;
                }
                if let (Some(_), Some(env)) = (held, self.env) {
                    self.release(env).await;
                }
                warn!(reason = %dead.reason, error = %chime_shared::redact::escape_control(&error), queue = %incoming.queue, "dead-lettered");
                Stats::bump(&self.stats().dead_lettered);
                self.completed(outcome::DEAD_LETTERED);
                self.log_unless(died, logged(recorded));
                ticket.ack().await;
            }
            Err(e) => {
                // The key stays `dying` (or unrecorded): the redelivered copy dead-letters again,
                // at once as we let go of our hold.
                if let Some((h, _)) = held {
                    store.let_go_dying(&h.key, &h.owner);
                }
                error!(error = %e, "cannot publish to the DLQ; requeueing");
                self.requeue(ticket).await;
            }
        }
    }
}

/// The history event of a settled delivery.
fn run_event(
    core: &Core,
    incoming: &Incoming,
    env: Option<&Envelope>,
    run: Option<&RunFacts>,
    outcome: Outcome,
    reason: Option<&str>,
    error: Option<&str>,
) -> RunEvent {
    let text = |s: &str| s.to_string();
    RunEvent {
        job: env.map(|e| text(&e.job)).unwrap_or_default(),
        key: env.map(|e| e.key.to_string()).unwrap_or_default(),
        id: env.map(|e| e.id.to_string()).unwrap_or_default(),
        queue: incoming.queue.clone(),
        attempt: env.map_or(0, |e| e.attempt),
        max_attempts: env.map_or(0, |e| e.max_attempts),
        worker: core.worker_id.clone(),
        started_at: run.map(|r| r.started_at),
        finished_at: core.now(),
        outcome,
        duration_ms: run.map(|r| u64::try_from(r.duration.as_millis()).unwrap_or(u64::MAX)),
        reason: reason.map(text),
        error: error.map(|e| text(history::truncate(e, history::ERROR_BYTES))),
        entry: None,
    }
}

/// The dead letter's properties: the original ones plus chime's `x-chime-*` headers.
fn dead_letter_properties(core: &Core, incoming: &Incoming, dead: &DeadInfo) -> BasicProperties {
    let mut headers = incoming.properties.headers().clone().unwrap_or_default();
    put_header(&mut headers, "x-chime-reason", &dead.reason);
    put_header(&mut headers, "x-chime-error", &chime_shared::redact::redact_text(&dead.error));
    put_header(&mut headers, "x-chime-attempts", &dead.attempts.to_string());
    put_header(&mut headers, "x-chime-failed-at", &core.now().to_rfc3339());
    put_header(&mut headers, "x-chime-worker", &core.worker_id);
    put_header(&mut headers, "x-chime-queue", &incoming.queue);
    put_header(&mut headers, "x-chime-dead-id", &chime_shared::envelope::new_id().to_string());
    incoming.properties.clone().with_headers(headers)
}

/// Records `done`, retrying across a Redis outage until it is written or the drain deadline
/// passes (`false`): a delivery is never acked with its key left in `run`.
/// Whether a finish put its run in the key's record.
fn logged(recorded: Option<Recorded>) -> bool {
    matches!(recorded, Some(Recorded::Yes | Recorded::Recreated))
}

/// Records `done` (with `run` in the key's record), retrying across a Redis outage. `None`:
/// the drain deadline passed first (the delivery goes back unacked); `Some(logged)`: settled,
/// `logged` when the run joined the record.
async fn record_until_done<S: KeyStore>(
    core: &Core,
    store: &S,
    h: &Held,
    run: Option<&RunEvent>,
) -> Option<bool> {
    let policy = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .without_max_times();
    // Every attempt runs to its answer (at a hard stop too: Redis may well be fine); only the
    // wait between attempts is cut short, and a hard stop ends the retries.
    let stop = core.hard_stop.clone();
    let recorded = (|| store.finish(&h.key, &h.owner, h.fence, Final::Done, h.result.as_deref(), run))
        .retry(policy)
        .sleep(move |wait| {
            let stop = stop.clone();
            async move {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.cancelled() => {}
                }
            }
        })
        .when(|e| !e.is_bad_record() && !core.hard_stop.is_cancelled())
        .notify(|e, wait| {
            warn!(error = %e, retry_in = ?wait, "cannot record `done` yet; the delivery stays unacked");
            core.redis_failed();
        })
        .await;
    match recorded {
        Ok(Recorded::NotOurs) => {
            warn!("key taken over by another owner before `done` was recorded; that owner settles it");
            Some(false)
        }
        Ok(Recorded::Yes | Recorded::Recreated) => Some(true),
        Err(e) if e.is_bad_record() => {
            error!(error = %e, "`done` cannot be recorded over an unreadable record; acking (the job ran)");
            Some(false)
        }
        // The drain deadline passed with `done` unrecorded: the delivery goes back unacked.
        Err(_) => None,
    }
}

/// A record whose outcome is already durable elsewhere: three tries, then logged.
async fn best_effort<T, F, Fut>(core: &Core, what: &str, f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, chime_shared::idempotency::IdemError>>,
{
    let policy =
        backon::ExponentialBuilder::default().with_min_delay(Duration::from_millis(100)).with_max_times(2);
    let result = f
        .retry(policy)
        .when(|e| !e.is_bad_record())
        .notify(|e, _| {
            warn!(error = %e, "cannot {what} in redis yet");
            core.redis_failed();
        })
        .await;
    match result {
        Ok(v) => Some(v),
        Err(e) if e.is_bad_record() => {
            error!(error = %e, "cannot {what} over an unreadable record");
            None
        }
        Err(e) => {
            error!(error = %e, "could not {what} in redis; the outcome itself is durable in the broker");
            None
        }
    }
}

#[cfg(test)]
mod tests;
