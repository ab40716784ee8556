//! The two things a delivery's fate is written to: the key's record ([`KeyStore`], Redis in
//! production) and the broker ([`Outbox`]: delayed copies and dead letters, each confirmed).
//! `process` is written against these traits, so the whole per-delivery decision is tested
//! without services (`process/tests.rs`); the real implementations are below.

use crate::parks::{Closed, Member, Packer, Target};
use chime_shared::amqp::{self, AmqpError};
use chime_shared::circuit::{Admit, Ended, Limits, Recorded as CircuitRecorded};
use chime_shared::config::QueueType;
use chime_shared::delay;
use chime_shared::envelope::{Envelope, Upstream, Wait};
use chime_shared::history::RunEvent;
use chime_shared::idempotency::{Claim, DeadInfo, Final, IdemError, IdemStore, Recorded, Renewal};
use chime_shared::limit::{ClaimWith, RateTake, SlotTake};
use chime_shared::record::KeyState;
use chime_shared::topology::Names;
use chime_shared::workflow::UpstreamRun;
use lapin::BasicProperties;
use lapin::types::FieldTable;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A key's record: claim, renew, finish, and the `dying` mark of a dead letter in flight.
pub(crate) trait KeyStore: Send + Sync + 'static {
    fn lease(&self) -> Duration;
    /// Claims `key` for `owner`, for the copy of `version` (its `enqueued_at`, µs) and
    /// `attempt`: an older copy of a key a newer enqueue replaced is superseded, an earlier
    /// attempt of a key whose retry is published is stale.
    fn claim(
        &self,
        key: &str,
        owner: &str,
        version: u64,
        attempt: u32,
    ) -> impl Future<Output = Result<Claim, IdemError>> + Send;
    fn renew(&self, key: &str, owner: &str) -> impl Future<Output = Result<Renewal, IdemError>> + Send;
    /// Records the final state (with the encoded result of a `done` run, see
    /// `StoredResult::encode`); `run` (when history is on) joins the key's record in the same
    /// step.
    fn finish(
        &self,
        key: &str,
        owner: &str,
        fence: u64,
        state: Final,
        result: Option<&str>,
        run: Option<&RunEvent>,
    ) -> impl Future<Output = Result<Recorded, IdemError>> + Send;
    /// Saves the run's checkpoint while `owner` holds the key.
    fn checkpoint(
        &self,
        key: &str,
        owner: &str,
        checkpoint: &str,
    ) -> impl Future<Output = Result<Recorded, IdemError>> + Send;
    fn mark_dying(
        &self,
        key: &str,
        owner: &str,
        fence: u64,
        dead: &DeadInfo,
    ) -> impl Future<Output = Result<Recorded, IdemError>> + Send;
    /// `owner` could not publish the dead letter of its `dying` key: the next copy takes it
    /// over at once (best-effort, nobody waits).
    fn let_go_dying(&self, key: &str, owner: &str);
    /// Takes (or renews) one of `limit` slots of `job` for `owner` (`global_concurrency`).
    fn take_slot(
        &self,
        job: &str,
        owner: &str,
        limit: usize,
    ) -> impl Future<Output = Result<SlotTake, IdemError>> + Send;
    /// Frees `owner`'s slot of `job` (best-effort, nobody waits).
    fn free_slot(&self, job: &str, owner: &str);
    /// When a run may start by rate bucket `key`: reserves a start, or keeps `reserved`. With
    /// `claim`, a run that may start at once may have its key claimed in the same call
    /// ([`RateTake::claim`]).
    fn take_rate(
        &self,
        key: String,
        interval_us: u64,
        burst: u32,
        ticket: Option<u64>,
        horizon: Duration,
        claim: Option<ClaimWith>,
    ) -> impl Future<Output = Result<RateTake, IdemError>> + Send;
    /// Holds rate bucket `key` for `hold`, for every worker (the downstream pushed back).
    fn slow_rate(
        &self,
        key: String,
        hold: Duration,
        interval_us: u64,
        burst: u32,
    ) -> impl Future<Output = Result<(), IdemError>> + Send;
    /// Whether a run may go through circuit `key` now.
    fn circuit_admit(
        &self,
        key: String,
        limits: &Limits,
    ) -> impl Future<Output = Result<Admit, IdemError>> + Send;
    /// Counts how a run of circuit `key` ended (a probe's `token` decides a half-open circuit).
    fn circuit_record(
        &self,
        key: String,
        limits: &Limits,
        ended: Ended,
        token: Option<&str>,
        successes: u64,
    ) -> impl Future<Output = Result<CircuitRecorded, IdemError>> + Send;
    /// Gives a probe of circuit `key` back unreported (best-effort: an unreported probe
    /// stops counting after `probe_ttl`).
    fn circuit_give_back(&self, key: String, limits: &Limits, token: &str);
    /// Whether settled runs are recorded in the history.
    fn records_history(&self) -> bool;
    /// Appends a settled run to its queue's history stream, ahead of any `finish` called
    /// after it (best-effort; nobody waits).
    fn stream_run(&self, event: &RunEvent);
    /// Appends a run to its key's record, for a run no `finish` put there (best-effort).
    fn log_run(&self, event: &RunEvent);
    /// Reads upstream step `up` for the waiting step `env` (sent to `route`), registering
    /// `env` on it unless it came to what `wait` asks (`chime_shared::workflow`).
    fn wait_for(
        &self,
        up: &Upstream,
        env: &Envelope,
        route: &str,
        wait: Wait,
    ) -> impl Future<Output = Result<UpstreamRun, IdemError>> + Send;
    /// Takes the copies registered as waiting for `key` off its record.
    fn release(&self, key: &str) -> impl Future<Output = Result<Vec<(String, Envelope)>, IdemError>> + Send;
    /// Notes on waiting step `key`'s own record what it waits for: whether that changed, and
    /// the step's own state.
    fn note_waiting(
        &self,
        key: &str,
        standing: &str,
    ) -> impl Future<Output = Result<(bool, Option<KeyState>), IdemError>> + Send;
}

impl KeyStore for IdemStore {
    fn take_slot(
        &self,
        job: &str,
        owner: &str,
        limit: usize,
    ) -> impl Future<Output = Result<SlotTake, IdemError>> + Send {
        IdemStore::take_slot(self, job, owner, limit)
    }
    fn free_slot(&self, job: &str, owner: &str) {
        IdemStore::free_slot(self, job, owner)
    }
    fn take_rate(
        &self,
        key: String,
        interval_us: u64,
        burst: u32,
        ticket: Option<u64>,
        horizon: Duration,
        claim: Option<ClaimWith>,
    ) -> impl Future<Output = Result<RateTake, IdemError>> + Send {
        IdemStore::take_rate(self, key, interval_us, burst, ticket, horizon, claim)
    }
    fn slow_rate(
        &self,
        key: String,
        hold: Duration,
        interval_us: u64,
        burst: u32,
    ) -> impl Future<Output = Result<(), IdemError>> + Send {
        IdemStore::slow_rate(self, key, hold, interval_us, burst)
    }
    fn circuit_admit(
        &self,
        key: String,
        limits: &Limits,
    ) -> impl Future<Output = Result<Admit, IdemError>> + Send {
        IdemStore::circuit_admit(self, key, limits)
    }
    fn circuit_record(
        &self,
        key: String,
        limits: &Limits,
        ended: Ended,
        token: Option<&str>,
        successes: u64,
    ) -> impl Future<Output = Result<CircuitRecorded, IdemError>> + Send {
        IdemStore::circuit_record(self, key, limits, ended, token, successes)
    }
    fn circuit_give_back(&self, key: String, limits: &Limits, token: &str) {
        IdemStore::circuit_give_back(self, key, limits, token)
    }
    fn records_history(&self) -> bool {
        IdemStore::records_history(self)
    }
    fn stream_run(&self, event: &RunEvent) {
        IdemStore::stream_run(self, event)
    }
    fn log_run(&self, event: &RunEvent) {
        IdemStore::log_run(self, event)
    }
    fn wait_for(
        &self,
        up: &Upstream,
        env: &Envelope,
        route: &str,
        wait: Wait,
    ) -> impl Future<Output = Result<UpstreamRun, IdemError>> + Send {
        IdemStore::wait_for(self, up, env, route, wait)
    }
    fn release(&self, key: &str) -> impl Future<Output = Result<Vec<(String, Envelope)>, IdemError>> + Send {
        IdemStore::release(self, key)
    }
    fn note_waiting(
        &self,
        key: &str,
        standing: &str,
    ) -> impl Future<Output = Result<(bool, Option<KeyState>), IdemError>> + Send {
        IdemStore::note_waiting(self, key, standing)
    }
    fn lease(&self) -> Duration {
        IdemStore::lease(self)
    }
    fn claim(
        &self,
        key: &str,
        owner: &str,
        version: u64,
        attempt: u32,
    ) -> impl Future<Output = Result<Claim, IdemError>> + Send {
        IdemStore::claim_copy(self, key, owner, Some(version), Some(attempt))
    }
    fn renew(&self, key: &str, owner: &str) -> impl Future<Output = Result<Renewal, IdemError>> + Send {
        IdemStore::renew(self, key, owner)
    }
    fn finish(
        &self,
        key: &str,
        owner: &str,
        fence: u64,
        state: Final,
        result: Option<&str>,
        run: Option<&RunEvent>,
    ) -> impl Future<Output = Result<Recorded, IdemError>> + Send {
        IdemStore::finish_with_run(self, key, owner, fence, state, result, run)
    }
    fn checkpoint(
        &self,
        key: &str,
        owner: &str,
        checkpoint: &str,
    ) -> impl Future<Output = Result<Recorded, IdemError>> + Send {
        IdemStore::checkpoint(self, key, owner, checkpoint)
    }
    fn mark_dying(
        &self,
        key: &str,
        owner: &str,
        fence: u64,
        dead: &DeadInfo,
    ) -> impl Future<Output = Result<Recorded, IdemError>> + Send {
        IdemStore::mark_dying(self, key, owner, fence, dead)
    }
    fn let_go_dying(&self, key: &str, owner: &str) {
        IdemStore::let_go_dying(self, key, owner)
    }
}

/// Confirmed publishes of a delivery's follow-up messages.
pub(crate) trait Outbox: Send + Sync + 'static {
    /// `envelope` back to `queue` after `delay` (through the delay chain; at once if zero),
    /// with fresh properties plus `headers`.
    fn delayed(
        &self,
        queue: &str,
        envelope: &Envelope,
        delay: Duration,
        headers: FieldTable,
    ) -> impl Future<Output = Result<(), AmqpError>> + Send;
    /// A parked copy: as [`Outbox::delayed`], but it may travel in one message with up to
    /// `most` copies of its job parked for the same delay and queue (see `parks`).
    fn parked(
        &self,
        queue: &str,
        envelope: &Envelope,
        delay: Duration,
        headers: FieldTable,
        _most: usize,
    ) -> impl Future<Output = Result<(), AmqpError>> + Send {
        self.delayed(queue, envelope, delay, headers)
    }
    /// The original body, with its dead-letter headers, to the queue's DLQ.
    fn dead_letter(
        &self,
        queue: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> impl Future<Output = Result<(), AmqpError>> + Send;
}

/// The worker's publish channels (confirm mode), lent to one delivery's publish at a time.
#[derive(Clone)]
pub(crate) struct BrokerOutbox {
    pub channels: Arc<amqp::ChannelPool>,
    pub names: Names,
    pub queue_type: QueueType,
    pub timeout: Duration,
    /// Cancelled when the broker closed a publish channel (a publish to an exchange that is
    /// gone, say): the session then reconnects and declares the topology again.
    pub broken: CancellationToken,
    /// Parked copies packed by job, delay and queue (`worker.park_pack`).
    pub parks: Arc<Packer>,
}

/// Publish channels a worker session opens at most (more publishes at once wait for one).
pub(crate) const PUBLISH_CHANNELS: usize = 32;

impl BrokerOutbox {
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), AmqpError> {
        let lent = self.channels.lend().await?;
        let sent =
            amqp::publish_confirmed(lent.channel(), exchange, routing_key, body, props, self.timeout).await;
        if sent.is_err() && !lent.channel().status().connected() {
            self.broken.cancel();
        }
        // Without a confirm the publish is still outstanding on it: the channel is not lent again.
        if !matches!(sent, Err(AmqpError::ConfirmTimeout(_))) {
            lent.settled();
        }
        sent
    }

    /// Where a copy of `envelope` goes after `delay` (exchange, routing key) and its
    /// properties: fresh ones plus `headers`.
    fn copy(
        &self,
        queue: &str,
        envelope: &Envelope,
        delay: Duration,
        headers: FieldTable,
    ) -> (String, String, BasicProperties) {
        let (exchange, routing_key) = delay::target(&self.names, self.queue_type, queue, delay);
        let props = envelope.properties();
        let props = if headers.inner().is_empty() { props } else { props.with_headers(headers) };
        (exchange, routing_key, props)
    }

    /// Publishes a closed pack (or lone copy) and tells its members.
    async fn send(&self, closed: Closed) {
        let (body, props) = closed.message();
        let sent = self.publish(&closed.target.exchange, &closed.target.routing_key, &body, props).await;
        if sent.is_ok() && closed.len() > 1 {
            tracing::debug!(copies = closed.len(), "parked copies sent round in one message");
        }
        closed.settle(&sent);
    }
}

impl Outbox for BrokerOutbox {
    async fn delayed(
        &self,
        queue: &str,
        envelope: &Envelope,
        delay: Duration,
        headers: FieldTable,
    ) -> Result<(), AmqpError> {
        let (exchange, routing_key, props) = self.copy(queue, envelope, delay, headers);
        self.publish(&exchange, &routing_key, &envelope.encode(), props).await
    }

    async fn parked(
        &self,
        queue: &str,
        envelope: &Envelope,
        delay: Duration,
        headers: FieldTable,
        most: usize,
    ) -> Result<(), AmqpError> {
        // A broadcast copy goes to one worker's own queue: never packed (nor is a copy sent
        // at once).
        if !self.parks.packs() || envelope.target.is_some() || delay.is_zero() {
            return self.delayed(queue, envelope, delay, headers).await;
        }
        let (exchange, routing_key, props) = self.copy(queue, envelope, delay, headers);
        let (member, outcome) = Member::new(envelope.encode(), props);
        let target =
            Target { exchange, routing_key, job: envelope.job.clone(), queue: envelope.queue.clone() };
        let added = self.parks.add(target.clone(), member, most);
        if let Some(id) = added.opened {
            // A task of its own: the pack goes out even if this delivery's future is dropped.
            let this = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(crate::parks::linger(delay)).await;
                if let Some(closed) = this.parks.take(&target, id) {
                    this.send(closed).await;
                }
            });
        }
        for closed in added.closed {
            self.send(closed).await;
        }
        match outcome.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(AmqpError::Shared(e)),
            Err(_) => Err(AmqpError::Shared("the pack was dropped before it was published".into())),
        }
    }

    async fn dead_letter(&self, queue: &str, body: &[u8], props: BasicProperties) -> Result<(), AmqpError> {
        self.publish(&self.names.dead_exchange(), queue, body, props).await
    }
}
