//! Batched acknowledgements for one consume channel.
//!
//! [`AckLedger`] is the pure state machine: it is told which delivery tags arrived and how each
//! was settled, and answers with the frames to send ([`Wire`]). [`AckBatcher`] keeps it behind a
//! lock and sends those frames through the deliveries' ackers, from the task that settles a
//! delivery; [`Ticket`] is a delivery's handle on it, which requeues the delivery if it is
//! dropped unsettled (a panic anywhere in the delivery's task, a task aborted).
//!
//! The invariant, checked by property tests below: **a `multiple=true` ack never covers a
//! delivery that is not settled by ack**, whether it is still being processed, was requeued,
//! or never reached the ledger at all (a delivery lost between the consumer stream and the
//! ledger, e.g. after a consumer was cancelled and re-created on the same channel). Delivery
//! tags of a channel are consecutive from 1, so a tag that arrives after a gap marks the
//! missing tags as unknown; no multiple ack ever reaches past one. Each tag goes on the wire at
//! most once (acking a tag twice closes the channel).
//!
//! Batching: when every tag up to some T is settled, one `basic.ack(T, multiple=true)` acks all
//! the settled-by-ack tags ≤ T; it is sent once those tags are a quarter of the channel's
//! unacked deliveries, or nothing else is in flight, or at the next tick (within [`HOLD`]).
//! Requeues (`basic.nack`, requeue) go out at once, in order. A settled delivery held back by
//! a slower one below it is acked on its own after [`HOLD`], so a long job never fills the
//! prefetch window with finished deliveries.

use futures_util::future::BoxFuture;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tracing::warn;

/// How long a settled delivery may wait for the ones below it, or for others to be acked with.
pub(crate) const HOLD: Duration = Duration::from_millis(20);

/// A settled prefix is acked at once when it is at least this fraction (1/n) of the
/// deliveries not yet acked on the wire: three quarters of the prefetch window keep working
/// while a quarter waits to be acked in one frame.
const BATCH_SHARE: usize = 4;

/// A frame the ledger wants sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wire {
    Ack {
        tag: u64,
        multiple: bool,
    },
    /// `basic.nack(requeue=true)` of one delivery.
    Requeue {
        tag: u64,
    },
}

/// The pure ack state machine of one channel.
#[derive(Debug)]
pub(crate) struct AckLedger {
    /// The next tag the channel will deliver.
    next: u64,
    /// Delivered, not settled.
    open: BTreeSet<u64>,
    /// Tags skipped between two registered ones: delivered to the channel, never seen here.
    unknown: BTreeSet<u64>,
    /// Settled by ack, not yet on the wire: tag → since.
    pending: BTreeMap<u64, Instant>,
}

impl Default for AckLedger {
    fn default() -> Self {
        Self { next: 1, open: BTreeSet::new(), unknown: BTreeSet::new(), pending: BTreeMap::new() }
    }
}

impl AckLedger {
    /// A delivery arrived (before it is processed). Tags must arrive in channel order.
    pub fn delivered(&mut self, tag: u64) {
        if tag > self.next {
            self.unknown.extend(self.next..tag);
        }
        self.unknown.remove(&tag);
        self.next = self.next.max(tag + 1);
        self.open.insert(tag);
    }

    /// The delivery's outcome is durable: it may be acked. Ignored unless `tag` is open. The
    /// ack goes out with others ([`Self::prefix_due`]), or at the next [`Self::tick`].
    pub fn ack(&mut self, tag: u64, now: Instant) -> Vec<Wire> {
        if !self.open.remove(&tag) {
            return Vec::new();
        }
        self.pending.insert(tag, now);
        if self.prefix_due() { self.ack_prefix() } else { Vec::new() }
    }

    /// Whether the settled prefix is worth a frame now: nothing else is in flight, or it is a
    /// [`BATCH_SHARE`]th of the deliveries the broker counts as unacked. A frame per job (jobs
    /// finish about in order) costs the broker as much as the job's delivery: a quorum queue
    /// spent 51 µs a message acked one by one against 13 µs acked 32 at once (BENCHMARKS.md).
    fn prefix_due(&self) -> bool {
        if self.open.is_empty() {
            return true;
        }
        let settled = self.pending.range(..self.limit()).count();
        settled > 0 && settled * BATCH_SHARE >= self.open.len() + self.pending.len()
    }

    /// The lowest open or unknown tag: no multiple ack reaches it.
    fn limit(&self) -> u64 {
        match (self.open.first(), self.unknown.first()) {
            (Some(a), Some(b)) => *a.min(b),
            (Some(a), None) => *a,
            (None, Some(b)) => *b,
            (None, None) => u64::MAX,
        }
    }

    /// The delivery goes back to the queue. Ignored unless `tag` is open.
    pub fn requeue(&mut self, tag: u64) -> Vec<Wire> {
        if !self.open.remove(&tag) {
            return Vec::new();
        }
        let mut out = vec![Wire::Requeue { tag }];
        out.extend(self.ack_prefix());
        out
    }

    /// One multiple ack over the settled tags below the lowest open or unknown one.
    fn ack_prefix(&mut self) -> Vec<Wire> {
        let Some((&top, _)) = self.pending.range(..self.limit()).next_back() else { return Vec::new() };
        self.pending = self.pending.split_off(&(top + 1));
        vec![Wire::Ack { tag: top, multiple: true }]
    }

    /// Acks the settled prefix, whatever its size, then on its own every settled delivery
    /// held back for `HOLD` or longer.
    pub fn tick(&mut self, now: Instant) -> Vec<Wire> {
        let mut out = self.ack_prefix();
        let held: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= HOLD)
            .map(|(t, _)| *t)
            .collect();
        out.extend(
            held.into_iter()
                .filter_map(|tag| self.pending.remove(&tag).map(|_| Wire::Ack { tag, multiple: false })),
        );
        out
    }

    /// Settled deliveries are held back (waiting for slower ones below them).
    pub fn holds(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Everything settled goes on the wire now.
    pub fn flush(&mut self) -> Vec<Wire> {
        let mut out = self.ack_prefix();
        let rest: Vec<u64> = std::mem::take(&mut self.pending).into_keys().collect();
        out.extend(rest.into_iter().map(|tag| Wire::Ack { tag, multiple: false }));
        out
    }

    #[cfg(test)]
    pub fn is_open(&self, tag: u64) -> bool {
        self.open.contains(&tag)
    }
}

/// Sends acks and requeues of one channel (a lapin `Channel`; a recorder in tests). The frame
/// must be queued for the wire by the returned future's *first poll*: [`AckBatcher`] polls it
/// once while it holds the channel's ledger, so frames reach the wire in the order the ledger
/// decided them. lapin's `Channel::basic_ack`/`basic_nack` queue their frame before their first
/// await; its `Acker` does not (it hands the command to a task that spawns one task per frame,
/// which can reorder a multiple ack before the single ack it covers: the broker then closes
/// the channel, "unknown delivery tag").
pub(crate) trait AckSink: Send + Sync + 'static {
    fn ack(&self, tag: u64, multiple: bool) -> BoxFuture<'static, Result<(), String>>;
    fn requeue(&self, tag: u64) -> BoxFuture<'static, Result<(), String>>;
}

impl AckSink for Arc<lapin::Channel> {
    fn ack(&self, tag: u64, multiple: bool) -> BoxFuture<'static, Result<(), String>> {
        let ch = self.clone();
        Box::pin(
            async move { ch.basic_ack(tag, BasicAckOptions { multiple }).await.map_err(|e| e.to_string()) },
        )
    }
    fn requeue(&self, tag: u64) -> BoxFuture<'static, Result<(), String>> {
        let ch = self.clone();
        Box::pin(async move {
            let opts = BasicNackOptions { requeue: true, ..Default::default() };
            ch.basic_nack(tag, opts).await.map_err(|e| e.to_string())
        })
    }
}

/// A frame handed to the sink (queued), not yet known to be written.
type Sending = BoxFuture<'static, Result<(), String>>;

/// One channel's ledger and its sink.
struct Book<A: AckSink> {
    ledger: AckLedger,
    sink: A,
    /// Wakes the hold timer: a delivery is held, or the book is gone.
    held: Arc<Notify>,
}

impl<A: AckSink> Book<A> {
    /// Hands the frames to the sink in order; each is queued for the wire before this returns
    /// (see [`AckSink`]).
    fn send(&mut self, wire: Vec<Wire>) -> Vec<Sending> {
        let mut sending = Vec::new();
        for w in wire {
            let mut frame = match w {
                Wire::Ack { tag, multiple } => self.sink.ack(tag, multiple),
                Wire::Requeue { tag } => self.sink.requeue(tag),
            };
            let mut cx = Context::from_waker(Waker::noop());
            match frame.as_mut().poll(&mut cx) {
                Poll::Ready(result) => report(result),
                Poll::Pending => sending.push(frame),
            }
        }
        sending
    }
}

impl<A: AckSink> Drop for Book<A> {
    /// The channel's last handle is gone: whatever is settled goes out (best effort; a
    /// graceful stop has flushed already).
    fn drop(&mut self) {
        let wire = self.ledger.flush();
        drop(self.send(wire));
        self.held.notify_one();
    }
}

fn report(result: Result<(), String>) {
    if let Err(e) = result {
        warn!(error = %e, "ack or requeue failed; the broker redelivers when the channel closes");
    }
}

/// Waits until the frames are written (or failed).
async fn written(sending: Vec<Sending>) {
    for frame in sending {
        report(frame.await);
    }
}

/// One consume channel's acks (cheap to clone). The delivery tasks settle through it
/// themselves: the ledger is behind a lock, and whoever settles a delivery queues the frames
/// that settling makes possible, so no task sits between a job and the wire (a task of its own
/// that forwarded every ack, one at a time, cost the worker three context switches per job). A
/// task sends the acks held back by slower deliveries after [`HOLD`] (it sleeps while none is).
pub(crate) struct AckBatcher<A: AckSink = Arc<lapin::Channel>> {
    book: Arc<Mutex<Book<A>>>,
}

impl<A: AckSink> Clone for AckBatcher<A> {
    fn clone(&self) -> Self {
        Self { book: self.book.clone() }
    }
}

impl<A: AckSink> AckBatcher<A> {
    /// The acks of the channel `sink` sends on.
    pub fn spawn(sink: A) -> Self {
        let held = Arc::new(Notify::new());
        let book = Arc::new(Mutex::new(Book { ledger: AckLedger::default(), sink, held: held.clone() }));
        tokio::spawn(hold_timer(Arc::downgrade(&book), held));
        Self { book }
    }

    /// Applies `step` to the ledger and queues the frames it yields, under the lock; wakes
    /// the hold timer when a settled delivery is left held.
    fn settle(&self, step: impl FnOnce(&mut AckLedger) -> Vec<Wire>) -> Vec<Sending> {
        let mut book = self.book.lock().unwrap_or_else(|p| p.into_inner());
        let wire = step(&mut book.ledger);
        if book.ledger.holds() {
            // Stores a permit when the timer is not waiting: no wake-up while it sleeps.
            book.held.notify_one();
        }
        book.send(wire)
    }

    /// Registers a delivery as it arrives (in channel order) and returns the ticket that
    /// settles it.
    pub fn delivered(&self, tag: u64) -> Ticket<A> {
        self.book.lock().unwrap_or_else(|p| p.into_inner()).ledger.delivered(tag);
        Ticket { tag, open: true, to: Settles::Delivery(self.clone()) }
    }

    /// Sends every pending ack; returns once they are written.
    pub async fn flush(&self) {
        let sending = self.settle(AckLedger::flush);
        written(sending).await;
    }
}

/// Sends the acks held back for [`HOLD`]: sleeps until a delivery is held, then ticks every
/// `HOLD` while any is. Ends with the channel's handles.
async fn hold_timer<A: AckSink>(book: Weak<Mutex<Book<A>>>, held: Arc<Notify>) {
    loop {
        held.notified().await;
        loop {
            tokio::time::sleep(HOLD).await;
            let Some(book) = book.upgrade() else { return };
            let (sending, holds) = {
                let mut b = book.lock().unwrap_or_else(|p| p.into_inner());
                let wire = b.ledger.tick(Instant::now());
                (b.send(wire), b.ledger.holds())
            };
            drop(book);
            written(sending).await;
            if !holds {
                break;
            }
        }
    }
}

/// One delivery's right to be settled, exactly once. Dropped unsettled (a panic in the
/// delivery's task, an aborted task), it requeues the delivery.
///
/// A job of a pack has a ticket of its own on the pack ([`Ticket::unpack`]): the pack's
/// delivery is settled when the last of its jobs is, acked if every one was acked, else
/// requeued whole (its jobs already done are then absorbed by their keys).
pub(crate) struct Ticket<A: AckSink = Arc<lapin::Channel>> {
    tag: u64,
    open: bool,
    to: Settles<A>,
}

/// What a ticket settles: a delivery of the channel, or one job of a pack.
enum Settles<A: AckSink> {
    Delivery(AckBatcher<A>),
    Packed(Arc<Pack<A>>),
}

/// A pack's delivery, settled by its last job.
struct Pack<A: AckSink> {
    state: Mutex<PackState<A>>,
}

struct PackState<A: AckSink> {
    delivery: Option<Ticket<A>>,
    left: usize,
    requeue: bool,
}

impl<A: AckSink> Pack<A> {
    /// One job is settled (`requeue`: it could not be decided); the pack's ticket and how to
    /// settle it when that was the last one.
    fn settled(&self, requeue: bool) -> Option<(Ticket<A>, bool)> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.left = s.left.saturating_sub(1);
        s.requeue |= requeue;
        if s.left > 0 {
            return None;
        }
        let requeue = s.requeue;
        s.delivery.take().map(|t| (t, requeue))
    }
}

impl<A: AckSink> Ticket<A> {
    /// Splits the ticket of a pack's delivery into one ticket per job (`jobs` ≥ 1).
    pub fn unpack(self, jobs: usize) -> Vec<Ticket<A>> {
        let tag = self.tag;
        let pack = Arc::new(Pack {
            state: Mutex::new(PackState { delivery: Some(self), left: jobs, requeue: false }),
        });
        (0..jobs).map(|_| Ticket { tag, open: true, to: Settles::Packed(pack.clone()) }).collect()
    }

    /// The outcome is durable: ack (batched). Returns once the frames this ack released are
    /// written; a held ack goes out with a later one, or after [`HOLD`].
    pub async fn ack(mut self) {
        self.open = false;
        let tag = self.tag;
        match &self.to {
            Settles::Delivery(batcher) => written(batcher.settle(|l| l.ack(tag, Instant::now()))).await,
            Settles::Packed(pack) => match pack.settled(false) {
                Some((delivery, false)) => Box::pin(delivery.ack()).await,
                Some((delivery, true)) => Box::pin(delivery.requeue()).await,
                None => {}
            },
        }
    }

    /// Nothing was decided: back to the queue (sent at once; a job of a pack: the pack, once
    /// its other jobs are settled).
    pub async fn requeue(mut self) {
        let sending = self.requeue_now();
        written(sending).await;
    }

    fn requeue_now(&mut self) -> Vec<Sending> {
        self.open = false;
        let tag = self.tag;
        match &self.to {
            Settles::Delivery(batcher) => batcher.settle(|l| l.requeue(tag)),
            Settles::Packed(pack) => match pack.settled(true) {
                Some((mut delivery, _)) => delivery.requeue_now(),
                None => Vec::new(),
            },
        }
    }
}

impl<A: AckSink> Drop for Ticket<A> {
    fn drop(&mut self) {
        if self.open {
            warn!(tag = self.tag, "delivery dropped unsettled (a panic outside the handler?); requeueing");
            // Queued now; nobody is left to wait for the write.
            drop(self.requeue_now());
        }
    }
}

#[cfg(test)]
mod tests;
