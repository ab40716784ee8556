//! The per-delivery decision, carried out end to end against in-memory fakes of the key store
//! and the broker (no services): every combination of claim result × handler outcome ×
//! attempts × publish result, checked against the table in `decision.rs` and against the
//! invariant that an ack only follows a durable outcome.

use super::*;
use crate::ack::AckBatcher;
use crate::handler::{Registry, raw_handler_fn};
use crate::state::resolve_jobs;
use chime_shared::amqp::AmqpError;
use chime_shared::config::Config;
use chime_shared::envelope::{Source, adhoc_key};
use chime_shared::history::{Outcome, RunEvent};
use chime_shared::idempotency::{Claim, IdemError};
use futures_util::future::BoxFuture;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

// ----------------------------------------------------------------------------- fakes

#[derive(Debug, Clone)]
struct Rec {
    state: &'static str,
    owner: String,
    fence: u64,
    until: tokio::time::Instant,
    dead: Option<DeadInfo>,
    /// The checkpoint.
    cp: Option<String>,
    /// The result a `done` run left.
    res: Option<String>,
    /// The attempt a published retry carries (`na`): earlier copies are stale.
    next_attempt: Option<u32>,
}

/// The Lua scripts' semantics over a map.
#[derive(Default)]
struct FakeStore {
    recs: Mutex<HashMap<String, Rec>>,
    /// Every command fails (Redis unreachable).
    down: AtomicBool,
    /// `finish` fails (Redis went away after the claim).
    finish_down: AtomicBool,
    lease_ms: u64,
    /// Runs recorded in the history.
    events: Mutex<Vec<RunEvent>>,
    /// Runs a successful `finish` put in a key's record.
    logged: Mutex<Vec<RunEvent>>,
    /// Global slots held, by job.
    slots: Mutex<HashMap<String, Vec<String>>>,
    /// `take_slot` calls.
    slot_asks: AtomicUsize,
    /// What `take_rate` answers (`None`: start at once).
    rate_wait: Mutex<Option<Duration>>,
    /// Claims made by `take_rate` (a run let through at once, its claim asked with it).
    rate_claims: AtomicUsize,
    /// `slow_rate` calls: bucket and hold.
    slowed: Mutex<Vec<(String, Duration)>>,
    /// What `circuit_admit` answers (`None`: closed).
    circuit: Mutex<Option<chime_shared::circuit::Admit>>,
    /// `circuit_record` and `circuit_give_back` calls: how the run ended and its probe token.
    circuit_reports: Mutex<Vec<(chime_shared::circuit::Ended, Option<String>)>>,
    /// Copies registered as waiting, by the key they wait for: route and envelope.
    waiters: Mutex<HashMap<String, Vec<(String, Envelope)>>>,
    /// What each waiting step noted on its record.
    noted: Mutex<HashMap<String, String>>,
}

impl FakeStore {
    fn new() -> Self {
        Self { lease_ms: 30_000, ..Self::default() }
    }
    fn err() -> IdemError {
        IdemError::Protocol("connection refused".into())
    }
    fn state(&self, key: &str) -> Option<&'static str> {
        self.recs.lock().unwrap().get(key).map(|r| r.state)
    }
    fn set(&self, key: &str, state: &'static str, owner: &str) {
        let rec = Rec {
            state,
            owner: owner.into(),
            fence: 1,
            // A `dying` key set here is a crashed publisher's: its hold has lapsed.
            until: tokio::time::Instant::now() + Duration::from_secs(if state == "dying" { 0 } else { 30 }),
            dead: (state == "dying").then(|| DeadInfo {
                reason: "permanent".into(),
                error: "earlier".into(),
                attempts: 1,
            }),
            cp: None,
            res: None,
            next_attempt: None,
        };
        self.recs.lock().unwrap().insert(key.into(), rec);
    }
}

impl KeyStore for FakeStore {
    async fn wait_for(
        &self,
        up: &chime_shared::envelope::Upstream,
        env: &Envelope,
        route: &str,
        wait: chime_shared::envelope::Wait,
    ) -> Result<chime_shared::workflow::UpstreamRun, IdemError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Self::err());
        }
        let key = up.key.to_string();
        let (state, res) = match self.recs.lock().unwrap().get(&key) {
            Some(r) => (Some(chime_shared::record::KeyState::parse(r.state)), r.res.clone()),
            None => (None, None),
        };
        let result = res.and_then(|r| chime_shared::record::StoredResult::decode(Some(&r), None, Utc::now()));
        let run = chime_shared::workflow::UpstreamRun {
            step: up.step.clone(),
            job: up.job.clone(),
            key: up.key,
            state,
            result,
        };
        if !run.ended(wait) {
            self.waiters.lock().unwrap().entry(key).or_default().push((route.to_string(), env.clone()));
        }
        Ok(run)
    }
    async fn release(&self, key: &str) -> Result<Vec<(String, Envelope)>, IdemError> {
        Ok(self.waiters.lock().unwrap().remove(key).unwrap_or_default())
    }
    async fn note_waiting(
        &self,
        key: &str,
        standing: &str,
    ) -> Result<(bool, Option<chime_shared::record::KeyState>), IdemError> {
        let changed = self.noted.lock().unwrap().insert(key.to_string(), standing.to_string()).as_deref()
            != Some(standing);
        Ok((changed, self.state(key).map(chime_shared::record::KeyState::parse)))
    }
    async fn take_slot(&self, job: &str, owner: &str, limit: usize) -> Result<SlotTake, IdemError> {
        self.slot_asks.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Err(Self::err());
        }
        let mut slots = self.slots.lock().unwrap();
        let held = slots.entry(job.to_string()).or_default();
        if held.iter().any(|o| o == owner) || held.len() < limit {
            if !held.iter().any(|o| o == owner) {
                held.push(owner.to_string());
            }
            return Ok(SlotTake::Taken);
        }
        Ok(SlotTake::Full { lapses_in: Duration::from_secs(30) })
    }
    fn free_slot(&self, job: &str, owner: &str) {
        if let Some(held) = self.slots.lock().unwrap().get_mut(job) {
            held.retain(|o| o != owner);
        }
    }
    fn records_history(&self) -> bool {
        true
    }
    async fn take_rate(
        &self,
        _key: String,
        _interval_us: u64,
        _burst: u32,
        ticket: Option<u64>,
        horizon: Duration,
        claim: Option<chime_shared::limit::ClaimWith>,
    ) -> Result<chime_shared::limit::RateTake, IdemError> {
        let wait = if ticket.is_some() { None } else { *self.rate_wait.lock().unwrap() };
        let wait = wait.unwrap_or_default();
        // As the rate script does: a run that starts at once has its key claimed with it.
        let claim = match claim {
            Some(c) if wait.is_zero() => {
                self.rate_claims.fetch_add(1, Ordering::SeqCst);
                Some(self.claim(&c.key, &c.owner, c.version, c.attempt).await)
            }
            _ => None,
        };
        Ok(chime_shared::limit::RateTake { ticket_us: 42, admitted: wait <= horizon, wait, claim })
    }
    async fn slow_rate(
        &self,
        key: String,
        hold: Duration,
        _interval_us: u64,
        _burst: u32,
    ) -> Result<(), IdemError> {
        self.slowed.lock().unwrap().push((key, hold));
        Ok(())
    }
    async fn circuit_admit(
        &self,
        _key: String,
        _limits: &chime_shared::circuit::Limits,
    ) -> Result<chime_shared::circuit::Admit, IdemError> {
        Ok(self.circuit.lock().unwrap().clone().unwrap_or(chime_shared::circuit::Admit::Go))
    }
    async fn circuit_record(
        &self,
        _key: String,
        _limits: &chime_shared::circuit::Limits,
        ended: chime_shared::circuit::Ended,
        token: Option<&str>,
        _successes: u64,
    ) -> Result<chime_shared::circuit::Recorded, IdemError> {
        self.circuit_reports.lock().unwrap().push((ended, token.map(str::to_string)));
        Ok(chime_shared::circuit::Recorded { changed: None, succeeded: 0, failed: 0 })
    }
    fn circuit_give_back(&self, _key: String, _limits: &chime_shared::circuit::Limits, token: &str) {
        self.circuit_reports
            .lock()
            .unwrap()
            .push((chime_shared::circuit::Ended::Neither, Some(token.into())));
    }
    fn stream_run(&self, event: &RunEvent) {
        assert!(
            !self.logged.lock().unwrap().contains(event),
            "{event:?} streamed after the finish that recorded it (a crash in between loses it)"
        );
        self.events.lock().unwrap().push(event.clone());
    }
    fn log_run(&self, event: &RunEvent) {
        assert!(
            !self.logged.lock().unwrap().contains(event),
            "log_run of {event:?}, which a successful finish already put in the record"
        );
        assert!(self.events.lock().unwrap().contains(event), "{event:?} logged but never streamed");
    }
    fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }
    async fn claim(&self, key: &str, owner: &str, _version: u64, attempt: u32) -> Result<Claim, IdemError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Self::err());
        }
        let mut recs = self.recs.lock().unwrap();
        let now = tokio::time::Instant::now();
        if let Some(r) = recs.get_mut(key) {
            match r.state {
                "done" => return Ok(Claim::Done { fence: r.fence }),
                "dead" => return Ok(Claim::Dead { fence: r.fence }),
                "dying" if r.owner != owner && r.until > now => {
                    return Ok(Claim::Busy { fence: r.fence, remaining: r.until - now });
                }
                "dying" => {
                    r.owner = owner.into();
                    r.until = now + self.lease();
                    return Ok(Claim::Dying {
                        fence: r.fence,
                        dead: r.dead.clone().unwrap_or(DeadInfo {
                            reason: String::new(),
                            error: String::new(),
                            attempts: 0,
                        }),
                    });
                }
                "run" if r.owner == owner => {
                    return Ok(Claim::Claimed { fence: r.fence, checkpoint: r.cp.clone() });
                }
                "run" if r.until > now => {
                    return Ok(Claim::Busy { fence: r.fence, remaining: r.until - now });
                }
                _ if r.next_attempt.is_some_and(|n| attempt < n) => {
                    return Ok(Claim::Stale { fence: r.fence });
                }
                _ => {}
            }
        }
        let fence = recs.get(key).map_or(0, |r| r.fence) + 1;
        let cp = recs.get(key).and_then(|r| r.cp.clone());
        let next_attempt = recs.get(key).and_then(|r| r.next_attempt);
        let until = now + self.lease();
        recs.insert(
            key.into(),
            Rec {
                state: "run",
                owner: owner.into(),
                fence,
                until,
                dead: None,
                cp: cp.clone(),
                res: None,
                next_attempt,
            },
        );
        Ok(Claim::Claimed { fence, checkpoint: cp })
    }
    async fn renew(&self, key: &str, owner: &str) -> Result<Renewal, IdemError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Self::err());
        }
        let mut recs = self.recs.lock().unwrap();
        let until = tokio::time::Instant::now() + self.lease();
        match recs.get_mut(key) {
            None => {
                recs.insert(
                    key.into(),
                    Rec {
                        state: "run",
                        owner: owner.into(),
                        fence: 1000,
                        until,
                        dead: None,
                        cp: None,
                        res: None,
                        next_attempt: None,
                    },
                );
                Ok(Renewal::Recreated { fence: 1000 })
            }
            Some(r) if r.state == "run" && r.owner == owner => {
                r.until = until;
                Ok(Renewal::Renewed)
            }
            Some(_) => Ok(Renewal::Lost),
        }
    }
    async fn finish(
        &self,
        key: &str,
        owner: &str,
        fence: u64,
        state: Final,
        result: Option<&str>,
        run: Option<&RunEvent>,
    ) -> Result<Recorded, IdemError> {
        if let Some(run) = run {
            assert!(self.events.lock().unwrap().contains(run), "finish of {run:?} before it was streamed");
        }
        let recorded = self.finish_state(key, owner, fence, state, result)?;
        if let (Some(run), Recorded::Yes | Recorded::Recreated) = (run, &recorded) {
            self.logged.lock().unwrap().push(run.clone());
        }
        Ok(recorded)
    }
    async fn checkpoint(&self, key: &str, owner: &str, checkpoint: &str) -> Result<Recorded, IdemError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Self::err());
        }
        let mut recs = self.recs.lock().unwrap();
        match recs.get_mut(key) {
            Some(r) if r.state == "run" && r.owner == owner => {
                r.cp = Some(checkpoint.into());
                Ok(Recorded::Yes)
            }
            Some(_) => Ok(Recorded::NotOurs),
            None => Ok(Recorded::Recreated),
        }
    }
    async fn mark_dying(
        &self,
        key: &str,
        owner: &str,
        fence: u64,
        dead: &DeadInfo,
    ) -> Result<Recorded, IdemError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Self::err());
        }
        let mut recs = self.recs.lock().unwrap();
        let now = tokio::time::Instant::now();
        match recs.get(key) {
            Some(r) if !(r.state == "run" && r.owner == owner) => Ok(Recorded::NotOurs),
            found => {
                let existed = found.is_some();
                recs.insert(
                    key.into(),
                    Rec {
                        state: "dying",
                        owner: owner.into(),
                        fence,
                        until: now + self.lease(),
                        dead: Some(dead.clone()),
                        cp: None,
                        res: None,
                        next_attempt: None,
                    },
                );
                Ok(if existed { Recorded::Yes } else { Recorded::Recreated })
            }
        }
    }
    fn let_go_dying(&self, key: &str, owner: &str) {
        if let Some(r) = self.recs.lock().unwrap().get_mut(key)
            && r.state == "dying"
            && r.owner == owner
        {
            r.until = tokio::time::Instant::now();
        }
    }
}

impl FakeStore {
    fn checkpoint_of(&self, key: &str) -> Option<String> {
        self.recs.lock().unwrap().get(key).and_then(|r| r.cp.clone())
    }
    fn result_of(&self, key: &str) -> Option<String> {
        self.recs.lock().unwrap().get(key).and_then(|r| r.res.clone())
    }
    fn finish_state(
        &self,
        key: &str,
        owner: &str,
        fence: u64,
        state: Final,
        result: Option<&str>,
    ) -> Result<Recorded, IdemError> {
        if self.down.load(Ordering::SeqCst) || self.finish_down.load(Ordering::SeqCst) {
            return Err(Self::err());
        }
        let name = match state {
            Final::Done => "done",
            Final::Dead => "dead",
            Final::Free | Final::Retry(_) => "free",
        };
        let mut recs = self.recs.lock().unwrap();
        let now = tokio::time::Instant::now();
        match recs.get_mut(key) {
            None => {
                if !matches!(state, Final::Free | Final::Retry(_)) {
                    let res = result.filter(|_| state == Final::Done).map(str::to_string);
                    recs.insert(
                        key.into(),
                        Rec {
                            state: name,
                            owner: owner.into(),
                            fence,
                            until: now,
                            dead: None,
                            cp: None,
                            res,
                            next_attempt: None,
                        },
                    );
                }
                Ok(Recorded::Recreated)
            }
            Some(r) if (r.state == "run" || r.state == "dying") && r.owner == owner => {
                r.state = name;
                r.dead = None;
                if let Final::Retry(next) = state {
                    r.next_attempt = Some(next);
                }
                if state == Final::Done {
                    r.cp = None;
                    r.res = result.map(str::to_string);
                }
                Ok(Recorded::Yes)
            }
            Some(_) => Ok(Recorded::NotOurs),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Sent {
    Delayed {
        attempt: u32,
        delay: Duration,
        unknown_since: Option<String>,
        /// `x-chime-rate-at` and `x-chime-slot-parks` (a parked run).
        parked: (Option<String>, Option<String>),
        /// `x-chime-circuit-parks`.
        circuit_parks: Option<String>,
    },
    Dead {
        reason: String,
        attempts: String,
    },
}

#[derive(Default)]
struct FakeOutbox {
    sent: Mutex<Vec<Sent>>,
    fail: AtomicBool,
}

impl Outbox for FakeOutbox {
    async fn delayed(
        &self,
        _queue: &str,
        env: &Envelope,
        delay: Duration,
        headers: FieldTable,
    ) -> Result<(), AmqpError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(AmqpError::ConfirmTimeout(Duration::from_secs(1)));
        }
        let props = BasicProperties::default().with_headers(headers);
        let unknown_since = header_str(&props, UNKNOWN_SINCE);
        let parked = (header_str(&props, RATE_AT), header_str(&props, SLOT_PARKS));
        let circuit_parks = header_str(&props, CIRCUIT_PARKS);
        self.sent.lock().unwrap().push(Sent::Delayed {
            attempt: env.attempt,
            delay,
            unknown_since,
            parked,
            circuit_parks,
        });
        Ok(())
    }
    async fn dead_letter(&self, _queue: &str, _body: &[u8], props: BasicProperties) -> Result<(), AmqpError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(AmqpError::Nacked { exchange: "dead".into(), routing_key: "q".into() });
        }
        let h = |n| header_str(&props, n).unwrap_or_default();
        self.sent
            .lock()
            .unwrap()
            .push(Sent::Dead { reason: h("x-chime-reason"), attempts: h("x-chime-attempts") });
        Ok(())
    }
}

/// What the delivery's acker was told.
#[derive(Clone, Default)]
struct Settles(Arc<Mutex<Vec<&'static str>>>);

impl AckSink for Settles {
    fn ack(&self, _tag: u64, _multiple: bool) -> BoxFuture<'static, Result<(), String>> {
        self.0.lock().unwrap().push("ack");
        Box::pin(async { Ok(()) })
    }
    fn requeue(&self, _tag: u64) -> BoxFuture<'static, Result<(), String>> {
        self.0.lock().unwrap().push("requeue");
        Box::pin(async { Ok(()) })
    }
}

// ----------------------------------------------------------------------------- harness

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    Ok,
    Transient,
    Permanent,
    Panic,
    /// Ignores cancellation; outlives its timeout and the grace.
    Hang,
}

const ALL: [Behaviour; 5] =
    [Behaviour::Ok, Behaviour::Transient, Behaviour::Permanent, Behaviour::Panic, Behaviour::Hang];

struct Harness {
    core: Core,
    store: FakeStore,
    outbox: FakeOutbox,
    runs: Arc<AtomicUsize>,
    /// Set by the `cooperative` handler when it saw its cancellation token fire.
    saw_cancel: Arc<AtomicBool>,
    /// Where each run of the `resumable` handler started.
    starts: Arc<Mutex<Vec<u64>>>,
}

fn harness() -> Harness {
    let text = "[worker]\ncancel_grace = \"50ms\"\nunknown_job_grace = \"1m\"\n\
                [[jobs]]\nname = \"job\"\nhandler = \"job\"\ntimeout = \"200ms\"\n\
                [[jobs]]\nname = \"cooperative\"\nhandler = \"cooperative\"\ntimeout = \"100ms\"\n\
                [[jobs]]\nname = \"long\"\nhandler = \"long\"\n\
                [[jobs]]\nname = \"patient\"\nhandler = \"patient\"\ntimeout = \"60s\"\n\
                [[jobs]]\nname = \"stubborn\"\nhandler = \"stubborn\"\ntimeout = \"60s\"\n\
                [[jobs]]\nname = \"resumable\"\nhandler = \"resumable\"\n\
                [[jobs]]\nname = \"limited\"\nhandler = \"job\"\nglobal_concurrency = 1\n\
                [[jobs]]\nname = \"rated\"\nhandler = \"job\"\nrate_limit = { rate = \"1/s\", key = \"tenant\" }\n\
                [[jobs]]\nname = \"rated_slot\"\nhandler = \"job\"\nrate_limit = \"10/s\"\nglobal_concurrency = 1\n\
                [[jobs]]\nname = \"rated_own\"\nhandler = \"job\"\nrate_limit = \"10/s\"\nconcurrency = 1\n\
                [[jobs]]\nname = \"pushy\"\nhandler = \"pushy\"\nrate_limit = \"shared\"\n\
                [[limits]]\nname = \"shared\"\nrate = \"10/s\"\n\
                [[jobs]]\nname = \"guarded\"\nhandler = \"job\"\ncircuit = \"dep\"\n\
                [[jobs]]\nname = \"guarded_rated\"\nhandler = \"job\"\ncircuit = \"dep\"\nrate_limit = \"1/s\"\n\
                [[jobs]]\nname = \"guarded_dl\"\nhandler = \"job\"\ncircuit = { failures = 2, on_open = \"dead_letter\" }\n\
                [[jobs]]\nname = \"step\"\nhandler = \"step\"\n\
                [[jobs]]\nname = \"optional\"\nhandler = \"job\"\ncriticality = \"sheddable\"\n\
                [[circuits]]\nname = \"dep\"\nfailures = 3\nopen_for = \"10s\"\n\
                [worker.shed.default]\nmax_depth = 100\n\
                [results]\nmax_bytes = 64\n";
    let config = Config::from_toml_str(text).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let saw_cancel = Arc::new(AtomicBool::new(false));
    let mut registry = Registry::new();
    let r = runs.clone();
    registry.register(
        "job",
        raw_handler_fn(move |_ctx, payload| {
            r.fetch_add(1, Ordering::SeqCst);
            async move {
                match payload.as_str() {
                    Some("ok") => Ok(()),
                    Some("transient") => Err(JobError::transient("blip")),
                    Some("permanent") => Err(JobError::permanent("bad input")),
                    Some("panic") => panic!("handler bug"),
                    _ => {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        Ok(())
                    }
                }
            }
        }),
    );
    let saw = saw_cancel.clone();
    registry.register(
        "cooperative",
        raw_handler_fn(move |ctx: JobContext, _| {
            let saw = saw.clone();
            async move {
                ctx.cancelled().await;
                saw.store(true, Ordering::SeqCst);
                Err(JobError::transient("stopped on cancellation"))
            }
        }),
    );
    registry.register(
        "long",
        raw_handler_fn(|_, _| async {
            tokio::time::sleep(Duration::from_millis(600)).await;
            Ok(())
        }),
    );
    // Stops with success when cancelled (a result returned within the grace stands).
    let (r, saw) = (runs.clone(), saw_cancel.clone());
    registry.register(
        "patient",
        raw_handler_fn(move |ctx: JobContext, _| {
            r.fetch_add(1, Ordering::SeqCst);
            let saw = saw.clone();
            async move {
                ctx.cancelled().await;
                saw.store(true, Ordering::SeqCst);
                Ok(())
            }
        }),
    );
    // Ignores cancellation: dropped once the grace is over.
    let r = runs.clone();
    registry.register(
        "stubborn",
        raw_handler_fn(move |_, _| {
            r.fetch_add(1, Ordering::SeqCst);
            async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(())
            }
        }),
    );
    // Counts from its last checkpoint to `to`, saving each step; fails once at `fail_at`
    // (attempt 1 only); its result is the rows it counted, or `pad` bytes of text.
    let (r, starts) = (runs.clone(), Arc::new(Mutex::new(Vec::new())));
    let s = starts.clone();
    registry.register(
        "resumable",
        raw_handler_fn(move |ctx: JobContext, p: serde_json::Value| {
            r.fetch_add(1, Ordering::SeqCst);
            let s = s.clone();
            async move {
                let start: u64 = ctx.last_checkpoint().unwrap_or(0);
                s.lock().unwrap().push(start);
                for row in start..p["to"].as_u64().unwrap_or(0) {
                    if ctx.attempt() == 1 && Some(row) == p["fail_at"].as_u64() {
                        return Err(JobError::transient("cut off"));
                    }
                    ctx.checkpoint(&(row + 1)).await?;
                }
                match p["pad"].as_u64() {
                    Some(n) => ctx.set_result(&"x".repeat(n as usize)),
                    None => ctx.set_result(&serde_json::json!({"rows": p["to"]})),
                }
                Ok(())
            }
        }),
    );
    // A workflow step: keeps what its upstream steps left.
    registry.register(
        "step",
        raw_handler_fn(move |ctx: JobContext, _| {
            STEP_SAW.lock().unwrap().push(serde_json::to_value(ctx.upstream()).unwrap());
            async { Ok(()) }
        }),
    );
    // The downstream always pushes back.
    let r = runs.clone();
    registry.register(
        "pushy",
        raw_handler_fn(move |_, _| {
            r.fetch_add(1, Ordering::SeqCst);
            async { Err(JobError::rate_limited(Duration::from_millis(2500), "HTTP 429")) }
        }),
    );
    let jobs = resolve_jobs(&config, &registry, &["default".to_string()]).unwrap();
    let core = Core::new(config, registry, jobs, "test".into());
    Harness { core, store: FakeStore::new(), outbox: FakeOutbox::default(), runs, saw_cancel, starts }
}

fn envelope(job: &str, payload: &str, attempt: u32, max: u32) -> Envelope {
    let mut env =
        Envelope::new(job, "default", adhoc_key(job, "k"), payload.into(), None, max, Source::Adhoc);
    env.attempt = attempt;
    env
}

fn incoming(env: &Envelope) -> Incoming {
    Incoming {
        queue: "default".into(),
        route: env.route(),
        data: env.encode(),
        properties: env.properties(),
        slot: Default::default(),
        packed: false,
    }
}

impl Harness {
    /// Handles one delivery; returns how it was settled.
    async fn deliver(&self, incoming: Incoming) -> Vec<&'static str> {
        let settles = Settles::default();
        let batcher = AckBatcher::spawn(settles.clone());
        let ticket = batcher.delivered(1);
        handle(&self.core, &self.store, &self.outbox, incoming, ticket).await;
        batcher.flush().await;
        settles.0.lock().unwrap().clone()
    }
    fn sent(&self) -> Vec<Sent> {
        self.outbox.sent.lock().unwrap().clone()
    }
}

// ----------------------------------------------------------------------------- the table

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Before {
    Fresh,
    Done,
    Dead,
    Busy,
    Dying,
    RedisDown,
}

/// What the table in `decision.rs` says: how the delivery settles, what the broker got, and
/// the key's state after.
fn expected(
    before: Before,
    b: Behaviour,
    last: bool,
    publish_ok: bool,
) -> (&'static str, Option<&'static str>, Option<&'static str>) {
    let publish = |sent, state_ok, state_fail| {
        if publish_ok { ("ack", Some(sent), state_ok) } else { ("requeue", None, state_fail) }
    };
    match before {
        Before::RedisDown => ("requeue", None, None),
        Before::Done => ("ack", None, Some("done")),
        Before::Dead => ("ack", None, Some("dead")),
        Before::Busy => publish("redelay", Some("run"), Some("run")),
        Before::Dying => publish("dead", Some("dead"), Some("dying")),
        Before::Fresh => match b {
            Behaviour::Ok => ("ack", None, Some("done")),
            Behaviour::Permanent => publish("dead", Some("dead"), Some("dying")),
            _ if last => publish("dead", Some("dead"), Some("dying")),
            _ => publish("retry", Some("free"), Some("free")),
        },
    }
}

#[tokio::test(start_paused = true)]
async fn every_claim_outcome_attempt_and_publish_result_settles_by_the_table() {
    let mut checked = 0;
    for before in [Before::Fresh, Before::Done, Before::Dead, Before::Busy, Before::Dying, Before::RedisDown]
    {
        for b in ALL {
            for last in [false, true] {
                for publish_ok in [true, false] {
                    let h = harness();
                    let payload = format!("{b:?}").to_lowercase();
                    let payload = if b == Behaviour::Hang { "hang".to_string() } else { payload };
                    let env = envelope("job", &payload, if last { 3 } else { 1 }, 3);
                    let key = env.key.to_string();
                    match before {
                        Before::Fresh => {}
                        Before::Done => h.store.set(&key, "done", "other"),
                        Before::Dead => h.store.set(&key, "dead", "other"),
                        Before::Busy => h.store.set(&key, "run", "other"),
                        Before::Dying => h.store.set(&key, "dying", "crashed-worker"),
                        Before::RedisDown => h.store.down.store(true, Ordering::SeqCst),
                    }
                    h.outbox.fail.store(!publish_ok, Ordering::SeqCst);
                    let settled = h.deliver(incoming(&env)).await;
                    let case = format!("{before:?} × {b:?} × last attempt {last} × publish ok {publish_ok}");
                    let (settle, sent, state) = expected(before, b, last, publish_ok);
                    assert_eq!(settled, [settle], "{case}: settled");
                    let sent_kind = h.sent().first().map(|s| match s {
                        Sent::Delayed { attempt, .. } if *attempt == env.attempt + 1 => "retry",
                        Sent::Delayed { .. } => "redelay",
                        Sent::Dead { .. } => "dead",
                    });
                    assert_eq!(sent_kind, sent, "{case}: published {:?}", h.sent());
                    assert!(h.sent().len() <= 1, "{case}: {:?}", h.sent());
                    if before != Before::RedisDown {
                        assert_eq!(h.store.state(&key), state, "{case}: key state");
                    }
                    // The invariant, independently of the table: an ack follows a durable outcome.
                    if settle == "ack" {
                        let durable = matches!(h.store.state(&key), Some("done" | "dead")) || sent.is_some();
                        assert!(
                            durable || matches!(before, Before::Done | Before::Dead),
                            "{case}: acked without a durable outcome"
                        );
                    }
                    let ran = h.runs.load(Ordering::SeqCst);
                    assert_eq!(ran, usize::from(before == Before::Fresh), "{case}: handler runs");
                    // History: one event per decided outcome, none for duplicates, redelays
                    // or a delivery given back without a decision.
                    let events = h.store.events.lock().unwrap().clone();
                    let want = match (settle, sent) {
                        ("ack", Some("retry")) => Some(Outcome::Retried),
                        ("ack", Some("dead")) => Some(Outcome::DeadLettered),
                        ("ack", None) if before == Before::Fresh => Some(Outcome::Succeeded),
                        _ => None,
                    };
                    assert_eq!(
                        events.iter().map(|e| e.outcome).collect::<Vec<_>>(),
                        Vec::from_iter(want),
                        "{case}: history"
                    );
                    if let Some(e) = events.first() {
                        assert_eq!(
                            (e.key.as_str(), e.attempt, e.job.as_str()),
                            (key.as_str(), env.attempt, "job"),
                            "{case}"
                        );
                        assert_eq!(e.started_at.is_some(), before == Before::Fresh, "{case}: ran iff fresh");
                        assert_eq!(e.error.is_some(), want != Some(Outcome::Succeeded), "{case}: error kept");
                    }
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 6 * 5 * 2 * 2);
}

#[tokio::test(start_paused = true)]
async fn a_dead_letter_whose_publish_failed_is_dead_lettered_again_by_the_next_copy() {
    let h = harness();
    let env = envelope("job", "permanent", 1, 3);
    let key = env.key.to_string();
    h.outbox.fail.store(true, Ordering::SeqCst);
    assert_eq!(h.deliver(incoming(&env)).await, ["requeue"]);
    assert_eq!(h.store.state(&key), Some("dying"), "the decision survives the failed publish");
    h.outbox.fail.store(false, Ordering::SeqCst);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(h.sent(), [Sent::Dead { reason: "permanent".into(), attempts: "1".into() }]);
    assert_eq!(h.store.state(&key), Some("dead"));
    assert_eq!(h.runs.load(Ordering::SeqCst), 1, "the redelivered copy does not run the handler again");
    // A third copy is a duplicate.
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(h.sent().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_copy_arriving_while_the_dead_letter_is_published_waits_instead_of_dead_lettering_again() {
    let h = harness();
    let env = envelope("job", "permanent", 3, 3);
    let key = env.key.to_string();
    // Another worker marked the key `dying` and is publishing its dead letter (its hold runs).
    h.store.set(&key, "dying", "publisher");
    h.store.recs.lock().unwrap().get_mut(&key).unwrap().until =
        tokio::time::Instant::now() + Duration::from_secs(20);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert!(
        matches!(h.sent().as_slice(), [Sent::Delayed { attempt: 3, .. }]),
        "the copy is redelayed, not dead-lettered: {:?}",
        h.sent()
    );
    assert_eq!(h.store.state(&key), Some("dying"));
    assert_eq!(h.runs.load(Ordering::SeqCst), 0);
    // The publisher died: once its hold lapsed, the next copy dead-letters the key.
    tokio::time::advance(Duration::from_secs(21)).await;
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert!(matches!(h.sent().last(), Some(Sent::Dead { .. })), "{:?}", h.sent());
    assert_eq!(h.store.state(&key), Some("dead"));
    assert_eq!(h.runs.load(Ordering::SeqCst), 0, "nobody ran the handler again");
}

#[tokio::test(start_paused = true)]
async fn done_that_cannot_be_recorded_keeps_the_delivery_unacked_until_the_drain_deadline() {
    let h = harness();
    let env = envelope("job", "ok", 1, 3);
    h.store.finish_down.store(true, Ordering::SeqCst);
    let settles = Settles::default();
    let batcher = AckBatcher::spawn(settles.clone());
    let ticket = batcher.delivered(1);
    let h = Arc::new(h);
    let task = {
        let h = h.clone();
        tokio::spawn(async move { handle(&h.core, &h.store, &h.outbox, incoming(&env), ticket).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !task.is_finished() && settles.0.lock().unwrap().is_empty(),
        "no ack while `done` is not recorded"
    );
    h.core.hard_stop.cancel();
    task.await.unwrap();
    batcher.flush().await;
    assert_eq!(*settles.0.lock().unwrap(), ["requeue"]);
}

#[tokio::test(start_paused = true)]
async fn done_recorded_once_redis_answers_again_then_acked() {
    let h = Arc::new(harness());
    let env = envelope("job", "ok", 1, 3);
    let key = env.key.to_string();
    h.store.finish_down.store(true, Ordering::SeqCst);
    let task = {
        let h = h.clone();
        tokio::spawn(async move { h.deliver(incoming(&env)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.store.finish_down.store(false, Ordering::SeqCst);
    assert_eq!(task.await.unwrap(), ["ack"]);
    assert_eq!(h.store.state(&key), Some("done"));
}

#[tokio::test(start_paused = true)]
async fn a_record_lost_mid_run_is_claimed_again_and_the_job_completes() {
    let mut h = harness();
    h.store.lease_ms = 150; // renewed every 50 ms
    let h = Arc::new(h);
    let env = envelope("long", "", 1, 3);
    let key = env.key.to_string();
    let task = {
        let h = h.clone();
        tokio::spawn(async move { h.deliver(incoming(&env)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.store.recs.lock().unwrap().clear(); // Redis restarted empty
    assert_eq!(task.await.unwrap(), ["ack"]);
    assert_eq!(h.store.state(&key), Some("done"));
    assert!(Stats::get(&h.core.stats.leases_recreated) >= 1);
    assert_eq!(Stats::get(&h.core.stats.lost_lease), 0);
}

#[tokio::test(start_paused = true)]
async fn a_lease_really_taken_over_cancels_the_run_and_leaves_the_key_to_its_owner() {
    let mut h = harness();
    h.store.lease_ms = 150;
    let h = Arc::new(h);
    let env = envelope("long", "", 1, 3);
    let key = env.key.to_string();
    let task = {
        let h = h.clone();
        tokio::spawn(async move { h.deliver(incoming(&env)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.store.set(&key, "run", "another-worker");
    assert_eq!(task.await.unwrap(), ["ack"]);
    assert_eq!(h.store.state(&key), Some("run"), "the other owner's claim is untouched");
    assert_eq!(Stats::get(&h.core.stats.lost_lease), 1);
}

#[tokio::test(start_paused = true)]
async fn on_timeout_the_token_fires_before_the_future_is_dropped() {
    let h = harness();
    let env = envelope("cooperative", "", 1, 1);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert!(h.saw_cancel.load(Ordering::SeqCst), "the handler observed its cancellation within the grace");
    assert_eq!(h.sent(), [Sent::Dead { reason: "timeout".into(), attempts: "1".into() }]);
}

#[tokio::test(start_paused = true)]
async fn unknown_jobs_are_sent_round_within_the_grace_then_dead_lettered() {
    let h = harness();
    let env = envelope("not-deployed-yet", "", 1, 3);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    let Some(Sent::Delayed { delay, unknown_since: Some(since), .. }) = h.sent().first().cloned() else {
        panic!("{:?}", h.sent());
    };
    assert_eq!(delay, Duration::from_secs(10));
    // The copy comes back carrying when it was first seen; past the grace it is dead-lettered.
    let mut back = incoming(&env);
    let mut headers = FieldTable::default();
    let long_ago = (Utc::now() - chrono::Duration::minutes(2)).to_rfc3339();
    put_header(&mut headers, UNKNOWN_SINCE, &long_ago);
    back.properties = back.properties.with_headers(headers);
    assert!(since.parse::<DateTime<Utc>>().is_ok());
    assert_eq!(h.deliver(back).await, ["ack"]);
    assert_eq!(h.sent()[1], Sent::Dead { reason: "unknown_job".into(), attempts: "0".into() });
}

#[tokio::test(start_paused = true)]
async fn malformed_and_too_large_bodies_are_dead_lettered_with_their_reason() {
    let h = harness();
    let garbage = Incoming {
        queue: "default".into(),
        route: "default".into(),
        data: b"not json".to_vec(),
        properties: BasicProperties::default(),
        slot: Default::default(),
        packed: false,
    };
    assert_eq!(h.deliver(garbage).await, ["ack"]);
    let huge = Incoming {
        queue: "default".into(),
        route: "default".into(),
        data: vec![b' '; 2 << 20],
        properties: BasicProperties::default(),
        slot: Default::default(),
        packed: false,
    };
    assert_eq!(h.deliver(huge).await, ["ack"]);
    let reasons: Vec<_> = h
        .sent()
        .into_iter()
        .map(|s| match s {
            Sent::Dead { reason, .. } => reason,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(reasons, ["malformed", "too_large"]);
    h.outbox.fail.store(true, Ordering::SeqCst);
    let garbage = Incoming {
        queue: "default".into(),
        route: "default".into(),
        data: b"{".to_vec(),
        properties: BasicProperties::default(),
        slot: Default::default(),
        packed: false,
    };
    assert_eq!(h.deliver(garbage).await, ["requeue"], "a dead letter that was not confirmed is not acked");
}

/// Delivers `env` on a task, waits until its handler runs, then stops the worker; returns
/// the settlements.
async fn shut_down_while_running(h: Harness, env: Envelope) -> (Arc<Harness>, Vec<&'static str>) {
    let h = Arc::new(h);
    let task = {
        let h = h.clone();
        tokio::spawn(async move { h.deliver(incoming(&env)).await })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while h.runs.load(Ordering::SeqCst) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the handler never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    h.core.hard_stop.cancel();
    // The grace is 50 ms: a handler still running after it is dropped, not awaited.
    let settled = tokio::time::timeout(Duration::from_secs(5), task).await.expect("dropped after the grace");
    (h, settled.unwrap())
}

#[tokio::test(start_paused = true)]
async fn on_shutdown_the_token_fires_and_a_result_within_the_grace_stands() {
    let env = envelope("patient", "", 1, 3);
    let key = env.key.to_string();
    let (h, settled) = shut_down_while_running(harness(), env).await;
    assert!(h.saw_cancel.load(Ordering::SeqCst), "the handler observed its cancellation");
    assert_eq!(settled, ["ack"]);
    assert_eq!(h.store.state(&key), Some("done"));
}

#[tokio::test(start_paused = true)]
async fn on_shutdown_a_handler_ignoring_cancellation_is_dropped_and_its_delivery_returned() {
    let env = envelope("stubborn", "", 1, 3);
    let key = env.key.to_string();
    let (h, settled) = shut_down_while_running(harness(), env).await;
    assert_eq!(settled, ["requeue"], "the job is given back, not acked");
    assert_eq!(h.store.state(&key), Some("free"), "the key is released for the next copy");
    assert!(h.sent().is_empty(), "no retry and no dead letter for a job that was stopped");
}

#[tokio::test(start_paused = true)]
async fn a_retry_resumes_from_the_last_checkpoint_and_a_success_keeps_its_result() {
    let h = harness();
    let payload = serde_json::json!({"to": 5, "fail_at": 3});
    let mut env =
        Envelope::new("resumable", "default", adhoc_key("resumable", "r"), payload, None, 3, Source::Adhoc);
    let key = env.key.to_string();
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"], "attempt 1 fails and is retried");
    assert_eq!(h.store.state(&key), Some("free"));
    assert_eq!(h.store.checkpoint_of(&key).as_deref(), Some("3"), "rows 0, 1, 2 were done");
    env.attempt = 2;
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(*h.starts.lock().unwrap(), [0, 3], "the retry started from the checkpoint");
    assert_eq!(h.store.state(&key), Some("done"));
    assert_eq!(h.store.checkpoint_of(&key), None, "a success clears the checkpoint");
    assert_eq!(h.store.result_of(&key).as_deref(), Some(r#"v{"rows":5}"#));

    // A result above results.max_bytes (64) does not fail the run; the record says why.
    let env = Envelope::new(
        "resumable",
        "default",
        adhoc_key("resumable", "big"),
        serde_json::json!({"to": 1, "pad": 100}),
        None,
        3,
        Source::Adhoc,
    );
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    let key = env.key.to_string();
    assert_eq!(h.store.state(&key), Some("done"));
    let kept = h.store.result_of(&key).unwrap();
    assert!(kept.starts_with("eresult of 102 bytes exceeds results.max_bytes (64)"), "{kept}");
}

/// A run of a job with `global_concurrency` takes a slot before its claim and frees it when
/// the run is over.
#[tokio::test(start_paused = true)]
async fn a_globally_limited_run_holds_a_slot_while_it_runs() {
    let h = harness();
    let env = envelope("limited", "ok", 1, 3);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(h.store.state(&env.key.to_string()), Some("done"));
    assert_eq!(h.store.slot_asks.load(Ordering::SeqCst), 1);
    assert!(h.store.slots.lock().unwrap()["limited"].is_empty(), "the slot is freed");
}

/// While every global slot is held elsewhere, the delivery waits (asking again), unsettled and
/// without running; once one is freed it runs.
#[tokio::test(start_paused = true)]
async fn a_globally_limited_delivery_waits_for_a_free_slot() {
    let h = Arc::new(harness());
    h.store.slots.lock().unwrap().insert("limited".into(), vec!["another worker".into()]);
    let env = envelope("limited", "ok", 1, 3);
    let task = {
        let (h, env) = (h.clone(), env.clone());
        tokio::spawn(async move { h.deliver(incoming(&env)).await })
    };
    let s = &h.store;
    wait_until_true("asked for a slot three times", || s.slot_asks.load(Ordering::SeqCst) >= 3).await;
    assert!(!task.is_finished() && h.runs.load(Ordering::SeqCst) == 0, "no run without a slot");
    assert_eq!(h.store.state(&env.key.to_string()), None, "not even claimed");
    h.store.free_slot("limited", "another worker");
    assert_eq!(task.await.unwrap(), ["ack"]);
    assert_eq!(h.runs.load(Ordering::SeqCst), 1);
}

/// Redis unreachable when the slot is asked for: requeued without a decision, and the worker
/// told Redis failed.
#[tokio::test(start_paused = true)]
async fn a_slot_that_cannot_be_asked_for_requeues() {
    let h = harness();
    h.core.redis_ok.send_replace(true);
    h.store.down.store(true, Ordering::SeqCst);
    let env = envelope("limited", "ok", 1, 3);
    assert_eq!(h.deliver(incoming(&env)).await, ["requeue"]);
    assert_eq!(h.runs.load(Ordering::SeqCst), 0);
    assert!(!*h.core.redis_ok.borrow(), "the worker pauses intake");
}

async fn wait_until_true(what: &str, pred: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !pred() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Every global slot held past `worker.max_hold`: the delivery is parked (sent round with its
/// attempt unchanged and a park count), not held, and never claimed or run.
#[tokio::test(start_paused = true)]
async fn a_globally_limited_delivery_is_parked_once_it_waited_max_hold() {
    let h = harness();
    h.store.slots.lock().unwrap().insert("limited".into(), vec!["another worker".into()]);
    let env = envelope("limited", "ok", 2, 3);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    let Some(Sent::Delayed { attempt: 2, delay, parked: (None, Some(parks)), .. }) =
        h.sent().first().cloned()
    else {
        panic!("{:?}", h.sent())
    };
    assert_eq!((delay, parks.as_str()), (Duration::from_secs(1), "1"));
    assert_eq!((h.runs.load(Ordering::SeqCst), h.store.state(&env.key.to_string())), (0, None));
    let events = h.store.events.lock().unwrap().clone();
    assert_eq!(events.len(), 1);
    assert_eq!(
        (events[0].outcome, events[0].reason.as_deref()),
        (Outcome::Parked, Some("global_concurrency"))
    );
    // Parked again, it waits twice as long.
    let mut again = incoming(&env);
    let mut headers = FieldTable::default();
    put_header(&mut headers, SLOT_PARKS, "1");
    again.properties = again.properties.with_headers(headers);
    assert_eq!(h.deliver(again).await, ["ack"]);
    assert!(
        matches!(h.sent()[1], Sent::Delayed { delay, .. } if delay == Duration::from_secs(2)),
        "{:?}",
        h.sent()
    );
}

/// A rate-limited run whose start is further off than `worker.max_hold` is parked until
/// then, carrying its reserved start; the copy that comes back with it runs.
#[tokio::test(start_paused = true)]
async fn a_rate_limited_run_far_from_its_turn_is_parked_with_its_ticket() {
    let h = harness();
    *h.store.rate_wait.lock().unwrap() = Some(Duration::from_millis(4500));
    let env = envelope("rated", r#"{"tenant":"a"}"#, 1, 3);
    let env = Envelope { payload: serde_json::json!({"tenant": "a"}), ..env };
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    let Some(Sent::Delayed { attempt: 1, delay, parked: (Some(at), None), .. }) = h.sent().first().cloned()
    else {
        panic!("{:?}", h.sent())
    };
    assert_eq!(
        (delay, at.as_str()),
        (Duration::from_secs(3), "42"),
        "whole seconds less one (back early): the rest is waited on return"
    );
    assert_eq!(h.runs.load(Ordering::SeqCst), 0);
    let reason = h.store.events.lock().unwrap()[0].reason.clone();
    assert_eq!(reason.as_deref(), Some("rate_limit"));
    let mut back = incoming(&env);
    let mut headers = FieldTable::default();
    put_header(&mut headers, RATE_AT, &at);
    back.properties = back.properties.with_headers(headers);
    assert_eq!(h.deliver(back).await, ["ack"]);
    assert_eq!((h.runs.load(Ordering::SeqCst), h.store.state(&env.key.to_string())), (1, Some("done")));
}

/// A run whose start is near waits in place, then runs.
#[tokio::test(start_paused = true)]
async fn a_rate_limited_run_near_its_start_waits_in_place() {
    let h = harness();
    *h.store.rate_wait.lock().unwrap() = Some(Duration::from_millis(300));
    let env = envelope("rated", "ok", 1, 3);
    let started = tokio::time::Instant::now();
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(h.sent().is_empty(), "{:?}", h.sent());
    assert_eq!(h.store.state(&env.key.to_string()), Some("done"));
    assert_eq!(
        h.store.rate_claims.load(Ordering::SeqCst),
        0,
        "claimed after its wait, not with its decision"
    );
}

/// A rate-limited run let through at once has its key claimed with the rate decision (one
/// round trip); one that takes a global slot after its decision claims after the slot.
#[tokio::test(start_paused = true)]
async fn a_rate_limited_run_let_through_at_once_is_claimed_with_its_decision() {
    let h = harness();
    let env = envelope("rated", "ok", 1, 3);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(h.store.state(&env.key.to_string()), Some("done"));
    assert_eq!(h.store.rate_claims.load(Ordering::SeqCst), 1);
    let env = envelope("rated_slot", "ok", 1, 3);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(h.store.state(&env.key.to_string()), Some("done"));
    assert_eq!(h.store.rate_claims.load(Ordering::SeqCst), 1, "the slot's run claims on its own");
    // A job with a limit of its own in this process (exec and http jobs by default): its
    // permit, free, is taken first and the claim goes with the decision.
    let env = envelope("rated_own", "ok", 1, 3);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(h.store.state(&env.key.to_string()), Some("done"));
    assert_eq!(h.store.rate_claims.load(Ordering::SeqCst), 2);
}

/// A run of a job with a limit of its own (1 here) that waits in place for its start does
/// not hold the job's permit meanwhile: a run whose turn has come goes at once beside it.
#[tokio::test(start_paused = true)]
async fn a_run_waiting_in_place_for_its_start_holds_no_permit_of_its_job() {
    let h = harness();
    *h.store.rate_wait.lock().unwrap() = Some(Duration::from_millis(300));
    let (a, b) = (envelope("rated_own", "ok", 1, 3), envelope("rated_own", "ok", 1, 3));
    // `b` is a parked copy back with its ticket: its turn is now.
    let mut back = incoming(&b);
    let mut headers = FieldTable::default();
    put_header(&mut headers, RATE_AT, "42");
    back.properties = back.properties.with_headers(headers);
    let started = tokio::time::Instant::now();
    let first = async {
        let acks = h.deliver(incoming(&a)).await;
        (acks, started.elapsed())
    };
    let second = async {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let acks = h.deliver(back).await;
        (acks, started.elapsed())
    };
    let ((x, waited), (y, went)) = tokio::join!(first, second);
    assert_eq!((x, y), (vec!["ack"], vec!["ack"]));
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(went < Duration::from_millis(300), "the run whose turn came waited for the permit: {went:?}");
}

/// A run shed while its queue is backed up settles its key (`done`, with a `shed` run), so a
/// copy that comes back after shedding stopped (an ack the broker lost) is a duplicate.
#[tokio::test(start_paused = true)]
async fn a_shed_run_settles_its_key_and_a_later_copy_is_a_duplicate() {
    let h = harness();
    let env = envelope("optional", "ok", 1, 3);
    *h.core.shed["default"].reason.write().unwrap() = Some("depth 150 >= 100".into());
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(h.runs.load(Ordering::SeqCst), 0, "a shed run does not run");
    assert_eq!(h.store.state(&env.key.to_string()), Some("done"));
    *h.core.shed["default"].reason.write().unwrap() = None;
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(h.runs.load(Ordering::SeqCst), 0, "the copy back later is a duplicate");
    let events = h.store.events.lock().unwrap().clone();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((events[0].outcome, events[0].reason.as_deref()), (Outcome::Shed, Some("load")));
    // A critical job of the same queue runs.
    let env = envelope("job", "ok", 1, 3);
    *h.core.shed["default"].reason.write().unwrap() = Some("depth 150 >= 100".into());
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(h.runs.load(Ordering::SeqCst), 1);
}

/// A handler reporting that the downstream pushed back: its bucket is held for the wait it
/// asked for, and the same attempt is parked for that long (not retried, not counted).
#[tokio::test(start_paused = true)]
async fn a_pushed_back_run_slows_its_bucket_and_is_parked_as_the_same_attempt() {
    let h = harness();
    let env = envelope("pushy", "ok", 3, 3);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert!(
        matches!(h.sent().first(), Some(Sent::Delayed { attempt: 3, delay, .. }) if *delay == Duration::from_secs(3)),
        "the last attempt is parked, not dead-lettered: {:?}",
        h.sent()
    );
    let slowed = h.store.slowed.lock().unwrap().clone();
    assert_eq!(slowed.len(), 1);
    assert!(
        slowed[0].0.ends_with(":rate:limit:shared:-") && slowed[0].1 == Duration::from_millis(2500),
        "{slowed:?}"
    );
    assert_eq!(h.store.state(&env.key.to_string()), Some("free"));
    let events = h.store.events.lock().unwrap().clone();
    assert_eq!((events[0].outcome, events[0].reason.as_deref()), (Outcome::Parked, Some("pushed_back")));
}

/// A run whose circuit is open is parked until probes may go (whole seconds), its attempt
/// unchanged and its key never claimed; half-open with every probe out, it is parked for 1 s
/// doubling with each such park.
#[tokio::test(start_paused = true)]
async fn a_run_whose_circuit_is_open_is_parked_without_a_claim() {
    use chime_shared::circuit::Admit;
    let h = harness();
    *h.store.circuit.lock().unwrap() = Some(Admit::Open(Duration::from_millis(4200)));
    let env = envelope("guarded", "ok", 2, 3);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    let Some(Sent::Delayed { attempt: 2, delay, circuit_parks: Some(parks), .. }) = h.sent().first().cloned()
    else {
        panic!("{:?}", h.sent())
    };
    assert_eq!((delay, parks.as_str()), (Duration::from_secs(5), "1"));
    assert_eq!((h.runs.load(Ordering::SeqCst), h.store.state(&env.key.to_string())), (0, None));
    let events = h.store.events.lock().unwrap().clone();
    assert_eq!((events[0].outcome, events[0].reason.as_deref()), (Outcome::Parked, Some("circuit_open")));
    *h.store.circuit.lock().unwrap() = Some(Admit::Busy(Duration::from_secs(30)));
    let mut again = incoming(&env);
    let mut headers = FieldTable::default();
    put_header(&mut headers, CIRCUIT_PARKS, "2");
    again.properties = again.properties.with_headers(headers);
    assert_eq!(h.deliver(again).await, ["ack"]);
    assert!(
        matches!(&h.sent()[1], Sent::Delayed { delay, circuit_parks: Some(p), .. } if *delay == Duration::from_secs(4) && p == "3"),
        "{:?}",
        h.sent()
    );
    assert!(h.store.circuit_reports.lock().unwrap().is_empty(), "nothing ran, nothing to report");
}

/// `on_open = "dead_letter"`: a run that finds its circuit open goes to the DLQ at once.
#[tokio::test(start_paused = true)]
async fn a_run_whose_circuit_is_open_can_be_dead_lettered_instead() {
    use chime_shared::circuit::Admit;
    let h = harness();
    *h.store.circuit.lock().unwrap() = Some(Admit::Open(Duration::from_secs(20)));
    let env = envelope("guarded_dl", "ok", 1, 3);
    assert_eq!(h.deliver(incoming(&env)).await, ["ack"]);
    assert_eq!(h.sent(), [Sent::Dead { reason: "circuit_open".into(), attempts: "1".into() }]);
    assert_eq!(h.runs.load(Ordering::SeqCst), 0);
}

/// Every run through a circuit reports how it ended; a probe's report carries its token, and a
/// probe that does not run (parked by its rate limit) is given back.
#[tokio::test(start_paused = true)]
async fn runs_report_to_their_circuit_and_a_probe_that_does_not_run_is_given_back() {
    use chime_shared::circuit::{Admit, Ended};
    let h = harness();
    assert_eq!(h.deliver(incoming(&envelope("guarded", "ok", 1, 3))).await, ["ack"]);
    // (A `closed` answer stands for a moment in the job that got it: the probe is another job's.)
    let mut failing = envelope("guarded_rated", "transient", 1, 3);
    failing.key = adhoc_key("guarded_rated", "other");
    *h.store.circuit.lock().unwrap() = Some(Admit::Probe("77".into()));
    assert_eq!(h.deliver(incoming(&failing)).await, ["ack"]);
    *h.store.rate_wait.lock().unwrap() = Some(Duration::from_secs(9));
    let mut rated = envelope("guarded_rated", "ok", 1, 3);
    rated.key = adhoc_key("guarded_rated", "r");
    assert_eq!(h.deliver(incoming(&rated)).await, ["ack"]);
    assert_eq!(
        h.store.circuit_reports.lock().unwrap().clone(),
        [(Ended::Succeeded, None), (Ended::Failed, Some("77".into())), (Ended::Neither, Some("77".into()))]
    );
    assert_eq!(h.runs.load(Ordering::SeqCst), 2);
}

/// What the `step` handler saw of its upstream steps.
static STEP_SAW: Mutex<Vec<serde_json::Value>> = Mutex::new(Vec::new());

/// A workflow step waits (parked, registered on its upstream, recorded once), is released at
/// once by its upstream's `done` and runs with the upstream's result; a step whose upstream
/// is dead is recorded blocked, and a released copy that must still wait is dropped.
#[tokio::test(start_paused = true)]
async fn a_workflow_step_waits_for_its_upstream_and_runs_with_its_result() {
    use chime_shared::envelope::{Step, Upstream, Wait};
    let h = harness();
    let wf = chime_shared::envelope::new_id();
    let mut up = envelope("resumable", "", 1, 3);
    up.payload = serde_json::json!({"to": 2});
    up.key = chime_shared::envelope::step_key(wf, "extract");
    up.step =
        Some(Step { workflow: wf, name: "extract".into(), after: vec![], wait: Wait::Done, releases: true });
    let upstream = Upstream { step: "extract".into(), job: "resumable".into(), key: up.key };
    let mut down = envelope("step", "", 1, 3);
    down.key = chime_shared::envelope::step_key(wf, "load");
    down.step = Some(Step {
        workflow: wf,
        name: "load".into(),
        after: vec![upstream],
        wait: Wait::Done,
        releases: false,
    });

    // Before its upstream: parked 1 s, then 2 s; the wait recorded once.
    assert_eq!(h.deliver(incoming(&down)).await, ["ack"]);
    let mut again = incoming(&down);
    let mut headers = FieldTable::default();
    put_header(&mut headers, WORKFLOW_PARKS, "1");
    again.properties = again.properties.with_headers(headers);
    assert_eq!(h.deliver(again).await, ["ack"]);
    let delays: Vec<Duration> = h
        .sent()
        .iter()
        .filter_map(|s| match s {
            Sent::Delayed { delay, .. } => Some(*delay),
            Sent::Dead { .. } => None,
        })
        .collect();
    assert_eq!(delays, [Duration::from_secs(1), Duration::from_secs(2)]);
    let events = h.store.events.lock().unwrap().clone();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((events[0].outcome, events[0].reason.as_deref()), (Outcome::Parked, Some("workflow")));
    assert!(events[0].error.as_deref().unwrap_or("").contains("waiting for extract"));
    assert_eq!(h.runs.load(Ordering::SeqCst), 0);

    // The upstream's `done` releases the waiting copy at once.
    assert_eq!(h.deliver(incoming(&up)).await, ["ack"]);
    assert_eq!(h.store.state(&up.key.to_string()), Some("done"));
    assert!(
        matches!(h.sent().last(), Some(Sent::Delayed { delay, .. }) if delay.is_zero()),
        "{:?}",
        h.sent()
    );
    assert!(h.store.waiters.lock().unwrap().is_empty());
    let mut released = incoming(&down);
    let mut headers = FieldTable::default();
    put_header(&mut headers, RELEASED, "1");
    released.properties = released.properties.with_headers(headers.clone());
    assert_eq!(h.deliver(released).await, ["ack"]);
    assert_eq!(h.store.state(&down.key.to_string()), Some("done"));
    let saw = STEP_SAW.lock().unwrap().clone();
    assert_eq!(saw.len(), 1);
    assert_eq!(saw[0][0]["step"], "extract");
    assert_eq!(saw[0][0]["state"], "done");
    assert_eq!(saw[0][0]["result"], serde_json::json!({"rows": 2}));

    // An upstream that is dead blocks the step (recorded); a released copy that still has to
    // wait is dropped without a park.
    let mut blocked = down.clone();
    blocked.key = chime_shared::envelope::step_key(wf, "report");
    let dead = chime_shared::envelope::step_key(wf, "broken");
    h.store.set(&dead.to_string(), "dead", "x");
    blocked.step.as_mut().unwrap().after[0].key = dead;
    let sent_before = h.sent().len();
    let mut copy = incoming(&blocked);
    copy.properties = copy.properties.with_headers(headers);
    assert_eq!(h.deliver(copy).await, ["ack"]);
    assert_eq!(h.sent().len(), sent_before, "a released copy that must wait is not parked");
    let events = h.store.events.lock().unwrap().clone();
    let last = events.last().unwrap();
    assert_eq!((last.outcome, last.reason.as_deref()), (Outcome::Blocked, Some("blocked")));
    assert!(last.error.as_deref().unwrap_or("").contains("blocked by extract (dead"), "{last:?}");
    assert_eq!(h.store.state(&blocked.key.to_string()), None, "not claimed");
}

/// Delivers the jobs of a pack (one delivery) one after another; returns how the pack's
/// delivery was settled.
async fn deliver_pack(h: &Harness, jobs: &[Vec<u8>]) -> Vec<&'static str> {
    let settles = Settles::default();
    let batcher = AckBatcher::spawn(settles.clone());
    let tickets = batcher.delivered(1).unpack(jobs.len());
    let envs: Vec<Envelope> = jobs.iter().filter_map(|j| Envelope::decode(j).ok()).collect();
    let props = chime_shared::envelope::pack::properties(&envs[0], jobs.len());
    for (i, (data, ticket)) in jobs.iter().zip(tickets).enumerate() {
        let incoming = Incoming {
            queue: "default".into(),
            route: "default".into(),
            data: data.clone(),
            properties: props.clone(),
            slot: Default::default(),
            packed: true,
        };
        handle(&h.core, &h.store, &h.outbox, incoming, ticket).await;
        batcher.flush().await;
        if i + 1 < jobs.len() {
            assert!(settles.0.lock().unwrap().is_empty(), "the pack is settled only after its last job");
        }
    }
    settles.0.lock().unwrap().clone()
}

#[tokio::test(start_paused = true)]
async fn a_pack_is_acked_once_every_job_in_it_is_settled_and_each_job_fails_alone() {
    let h = harness();
    let mut jobs = Vec::new();
    for (i, payload) in ["ok", "transient", "permanent", "ok"].iter().enumerate() {
        let mut env = envelope("job", payload, 1, 3);
        env.key = adhoc_key("job", &format!("pack-{i}"));
        jobs.push(env.encode());
    }
    jobs.insert(2, b"{\"not\":\"an envelope\"}".to_vec());
    assert_eq!(deliver_pack(&h, &jobs).await, ["ack"]);
    assert_eq!(h.runs.load(Ordering::SeqCst), 4, "every job ran once");
    let sent = h.sent();
    assert_eq!(sent.len(), 3, "{sent:?}");
    assert!(
        matches!(sent[0], Sent::Delayed { attempt: 2, .. }),
        "the transient job alone is retried: {sent:?}"
    );
    assert!(matches!(&sent[1], Sent::Dead { reason, .. } if reason == "malformed"), "{sent:?}");
    assert!(matches!(&sent[2], Sent::Dead { reason, .. } if reason == "permanent"), "{sent:?}");
    // The same pack again (redelivered: its ack was lost): the jobs that ended are absorbed,
    // and so is the retried one's first attempt (its retry is on its way: stale).
    let before = h.runs.load(Ordering::SeqCst);
    assert_eq!(deliver_pack(&h, &jobs).await, ["ack"]);
    assert_eq!(h.runs.load(Ordering::SeqCst), before, "nothing runs again");
    let sent = h.sent();
    assert_eq!(sent.len(), 4, "{sent:?}");
    assert!(
        matches!(&sent[3], Sent::Dead { reason, .. } if reason == "malformed"),
        "only the malformed job, which has no key to absorb it, is dead-lettered again: {sent:?}"
    );
    // The retry itself (attempt 2) runs.
    let mut retry = Envelope::decode(&jobs[1]).unwrap();
    retry.attempt = 2;
    assert_eq!(h.deliver(incoming(&retry)).await, ["ack"]);
    assert_eq!(h.runs.load(Ordering::SeqCst), before + 1, "the retry runs");
    // A job that cannot be settled (the DLQ does not confirm) requeues the whole pack.
    h.outbox.fail.store(true, Ordering::SeqCst);
    let mut env = envelope("job", "permanent", 1, 3);
    env.key = adhoc_key("job", "pack-fresh");
    let mut ok = envelope("job", "ok", 1, 3);
    ok.key = adhoc_key("job", "pack-fresh-ok");
    assert_eq!(deliver_pack(&h, &[env.encode(), ok.encode()]).await, ["requeue"]);
}

/// A handler's delays are bounded: a push-back by a day (it holds the job's whole bucket), a
/// retry delay by the longest the delay chain holds (a longer one would lose its high bits
/// there: 2^28 s was published as no delay at all).
#[test]
fn a_handlers_own_delays_are_bounded() {
    let pushed = ended(Ok(Err(JobError::rate_limited(Duration::MAX, "quota"))));
    assert!(matches!(pushed, RunEnd::RateLimited(d, _) if d == crate::handler::MAX_PUSH_BACK));
    let later = ended(Ok(Err(JobError::retry_after(Duration::from_secs(1 << 28), "later"))));
    let RunEnd::RetryAfter(d, _) = later else { panic!("a retry") };
    assert_eq!(d, chime_shared::delay::MAX_DELAY);
    let key = chime_shared::delay::routing_key(chime_shared::delay::seconds(d), "p", "q");
    assert!(key.starts_with(&"1.".repeat(28)), "the longest delay, not none: {key}");
}

/// A rate-limited run parks for its wait less a second, at least one, at most the delay
/// chain's longest (a "1/d" limit's line of 10,000 runs puts the last 27 years out).
#[test]
fn rate_parks_are_within_the_delay_chain() {
    assert_eq!(rate_park(Duration::from_millis(1500)), Duration::from_secs(1));
    assert_eq!(rate_park(Duration::from_secs(90)), Duration::from_secs(89));
    assert_eq!(rate_park(Duration::from_secs(10_000 * 86_400)), chime_shared::delay::MAX_DELAY);
}
