//! Batched acknowledgements for one consume channel.
//!
//! [`AckLedger`] is the pure state machine: it is told which delivery tags arrived and how each
//! was settled, and answers with the frames to send ([`Wire`]). [`AckBatcher`] runs it in a task
//! and sends those frames through the deliveries' ackers; [`Ticket`] is a delivery's handle on
//! it, which requeues the delivery if it is dropped unsettled (a panic anywhere in the
//! delivery's task, a task aborted).
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
//! the settled-by-ack tags ≤ T. Requeues (`basic.nack`, requeue) go out at once, in order. A
//! settled delivery held back by a slower one below it is acked on its own after [`HOLD`], so a
//! long job never fills the prefetch window with finished deliveries.

use futures_util::future::BoxFuture;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

/// How long a settled delivery may wait for the ones below it.
pub(crate) const HOLD: Duration = Duration::from_millis(20);

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

    /// The delivery's outcome is durable: it may be acked. Ignored unless `tag` is open.
    pub fn ack(&mut self, tag: u64, now: Instant) -> Vec<Wire> {
        if !self.open.remove(&tag) {
            return Vec::new();
        }
        self.pending.insert(tag, now);
        self.ack_prefix()
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
        let limit = match (self.open.first(), self.unknown.first()) {
            (Some(a), Some(b)) => *a.min(b),
            (Some(a), None) => *a,
            (None, Some(b)) => *b,
            (None, None) => u64::MAX,
        };
        let Some((&top, _)) = self.pending.range(..limit).next_back() else { return Vec::new() };
        self.pending = self.pending.split_off(&(top + 1));
        vec![Wire::Ack { tag: top, multiple: true }]
    }

    /// Acks on its own every settled delivery held back for `HOLD` or longer.
    pub fn tick(&mut self, now: Instant) -> Vec<Wire> {
        let held: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= HOLD)
            .map(|(t, _)| *t)
            .collect();
        held.into_iter()
            .filter_map(|tag| self.pending.remove(&tag).map(|_| Wire::Ack { tag, multiple: false }))
            .collect()
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

/// Sends acks and requeues for one delivery (lapin's `Acker`; a recorder in tests).
pub(crate) trait AckSink: Send + 'static {
    fn ack(&self, multiple: bool) -> BoxFuture<'_, Result<(), String>>;
    fn requeue(&self) -> BoxFuture<'_, Result<(), String>>;
}

impl AckSink for lapin::Acker {
    fn ack(&self, multiple: bool) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            lapin::Acker::ack(self, BasicAckOptions { multiple }).await.map(drop).map_err(|e| e.to_string())
        })
    }
    fn requeue(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            self.nack(BasicNackOptions { requeue: true, ..Default::default() })
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        })
    }
}

enum Msg<A> {
    Delivered(u64),
    Ack(u64, A),
    Requeue(u64, A),
    Flush(oneshot::Sender<()>),
}

/// Handle on a channel's ack task (cheap to clone).
pub(crate) struct AckBatcher<A: AckSink = lapin::Acker> {
    tx: mpsc::UnboundedSender<Msg<A>>,
}

impl<A: AckSink> Clone for AckBatcher<A> {
    fn clone(&self) -> Self {
        Self { tx: self.tx.clone() }
    }
}

impl<A: AckSink> AckBatcher<A> {
    pub fn spawn() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(rx));
        Self { tx }
    }

    /// Registers a delivery as it arrives and returns the ticket that settles it.
    pub fn delivered(&self, tag: u64, acker: A) -> Ticket<A> {
        let _ = self.tx.send(Msg::Delivered(tag));
        Ticket { tag, acker: Some(acker), batcher: self.clone() }
    }

    /// Sends every pending ack; returns once they are handed to the channel.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

/// One delivery's right to be settled, exactly once. Dropped unsettled (a panic in the
/// delivery's task, an aborted task), it requeues the delivery.
pub(crate) struct Ticket<A: AckSink = lapin::Acker> {
    tag: u64,
    acker: Option<A>,
    batcher: AckBatcher<A>,
}

impl<A: AckSink> Ticket<A> {
    /// The outcome is durable: ack (batched).
    pub fn ack(mut self) {
        if let Some(a) = self.acker.take() {
            let _ = self.batcher.tx.send(Msg::Ack(self.tag, a));
        }
    }

    /// Nothing was decided: back to the queue (sent at once).
    pub fn requeue(mut self) {
        if let Some(a) = self.acker.take() {
            let _ = self.batcher.tx.send(Msg::Requeue(self.tag, a));
        }
    }
}

impl<A: AckSink> Drop for Ticket<A> {
    fn drop(&mut self) {
        if let Some(a) = self.acker.take() {
            warn!(tag = self.tag, "delivery dropped unsettled (a panic outside the handler?); requeueing");
            let _ = self.batcher.tx.send(Msg::Requeue(self.tag, a));
        }
    }
}

async fn run<A: AckSink>(mut rx: mpsc::UnboundedReceiver<Msg<A>>) {
    let mut ledger = AckLedger::default();
    let mut ackers: HashMap<u64, A> = HashMap::new();
    let mut tick = tokio::time::interval(HOLD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let msg = tokio::select! {
            msg = rx.recv() => msg,
            _ = tick.tick() => {
                let wire = ledger.tick(Instant::now());
                send(&mut ackers, wire).await;
                continue;
            }
        };
        let Some(msg) = msg else {
            let wire = ledger.flush();
            send(&mut ackers, wire).await;
            return;
        };
        // Apply what arrived together before touching the wire.
        let mut wire = Vec::new();
        let mut flushed = Vec::new();
        let mut apply = |msg: Msg<A>, wire: &mut Vec<Wire>| match msg {
            Msg::Delivered(tag) => ledger.delivered(tag),
            Msg::Ack(tag, a) => {
                ackers.insert(tag, a);
                wire.extend(ledger.ack(tag, Instant::now()));
            }
            Msg::Requeue(tag, a) => {
                ackers.insert(tag, a);
                wire.extend(ledger.requeue(tag));
            }
            Msg::Flush(done) => {
                wire.extend(ledger.flush());
                flushed.push(done);
            }
        };
        apply(msg, &mut wire);
        while let Ok(more) = rx.try_recv() {
            apply(more, &mut wire);
        }
        send(&mut ackers, wire).await;
        for done in flushed {
            let _ = done.send(());
        }
    }
}

/// Sends the frames in order. A multiple ack goes through the acker of its top tag, and the
/// ackers of the tags it covers are dropped (they are settled by it).
async fn send<A: AckSink>(ackers: &mut HashMap<u64, A>, wire: Vec<Wire>) {
    for w in wire {
        let result = match w {
            Wire::Ack { tag, multiple } => {
                let Some(a) = ackers.remove(&tag) else { continue };
                if multiple {
                    ackers.retain(|t, _| *t > tag);
                }
                a.ack(multiple).await
            }
            Wire::Requeue { tag } => match ackers.remove(&tag) {
                Some(a) => a.requeue().await,
                None => continue,
            },
        };
        if let Err(e) = result {
            warn!(error = %e, "ack or requeue failed; the broker redelivers when the channel closes");
        }
    }
}

#[cfg(test)]
mod tests;
