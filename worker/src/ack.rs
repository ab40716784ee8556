//! Batched acknowledgements for one consume channel.
//!
//! Delivery tags on a channel are contiguous. The batcher tracks the lowest tag not yet
//! settled; when every tag up to some T is settled, one `basic.ack(T, multiple=true)` acks all
//! the settled-by-ack deliveries ≤ T at once. An ack therefore only ever covers deliveries
//! whose outcome is already recorded. Nacks are sent at once, individually, before any later
//! multiple-ack (one task sends everything, in order). A settled delivery held back by a
//! slower one below it is acked on its own after `HOLD`, so a long job never fills the
//! prefetch window with finished deliveries.

use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

/// How long a settled delivery may wait for the ones below it.
const HOLD: Duration = Duration::from_millis(20);

enum Msg {
    Delivered(u64),
    Ack(u64, Acker),
    Nack(u64, Acker),
    Flush(oneshot::Sender<()>),
}

/// Handle on a channel's batcher (cheap to clone).
#[derive(Clone)]
pub(crate) struct AckBatcher {
    tx: mpsc::UnboundedSender<Msg>,
}

impl AckBatcher {
    pub fn spawn() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(rx));
        Self { tx }
    }

    /// Registers a delivery as it arrives (before it is processed).
    pub fn delivered(&self, tag: u64) {
        let _ = self.tx.send(Msg::Delivered(tag));
    }

    pub fn ack(&self, tag: u64, acker: Acker) {
        let _ = self.tx.send(Msg::Ack(tag, acker));
    }

    /// Requeues the delivery (sent at once).
    pub fn requeue(&self, tag: u64, acker: Acker) {
        let _ = self.tx.send(Msg::Nack(tag, acker));
    }

    /// Sends every pending ack; returns once they are handed to the channel.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

#[derive(Default)]
struct State {
    /// Delivered and not yet settled.
    open: BTreeSet<u64>,
    /// Settled by ack, not yet acked on the wire: tag → (acker, since).
    pending: BTreeMap<u64, (Acker, Instant)>,
}

async fn run(mut rx: mpsc::UnboundedReceiver<Msg>) {
    let mut st = State::default();
    let mut tick = tokio::time::interval(HOLD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            msg = rx.recv() => match msg {
                None => {
                    flush_all(&mut st).await;
                    return;
                }
                Some(Msg::Delivered(tag)) => {
                    st.open.insert(tag);
                }
                Some(Msg::Ack(tag, acker)) => {
                    st.open.remove(&tag);
                    st.pending.insert(tag, (acker, Instant::now()));
                    // Batch what arrived together before touching the wire.
                    while let Ok(more) = rx.try_recv() {
                        match more {
                            Msg::Delivered(t) => { st.open.insert(t); }
                            Msg::Ack(t, a) => { st.open.remove(&t); st.pending.insert(t, (a, Instant::now())); }
                            Msg::Nack(t, a) => { st.open.remove(&t); send_nack(a).await; }
                            Msg::Flush(done) => { flush_all(&mut st).await; let _ = done.send(()); }
                        }
                    }
                    ack_prefix(&mut st).await;
                }
                Some(Msg::Nack(tag, acker)) => {
                    st.open.remove(&tag);
                    send_nack(acker).await;
                    ack_prefix(&mut st).await;
                }
                Some(Msg::Flush(done)) => {
                    flush_all(&mut st).await;
                    let _ = done.send(());
                }
            },
            _ = tick.tick() => release_held(&mut st).await,
        }
    }
}

async fn send_nack(acker: Acker) {
    if let Err(e) = acker.nack(BasicNackOptions { requeue: true, ..Default::default() }).await {
        warn!(error = %e, "requeue failed; the broker redelivers when the channel closes");
    }
}

/// Acks, with one `multiple` ack, every pending tag below the lowest open one.
async fn ack_prefix(st: &mut State) {
    let limit = st.open.first().copied().unwrap_or(u64::MAX);
    let Some((&top, _)) = st.pending.range(..limit).next_back() else { return };
    let below: Vec<u64> = st.pending.range(..=top).map(|(t, _)| *t).collect();
    let mut top_acker = None;
    for t in below {
        if let Some((a, _)) = st.pending.remove(&t)
            && t == top
        {
            top_acker = Some(a);
        }
    }
    if let Some(a) = top_acker
        && let Err(e) = a.ack(BasicAckOptions { multiple: true }).await
    {
        warn!(error = %e, "ack failed; the broker redelivers and the idempotency record absorbs it");
    }
}

/// Acks on its own every pending delivery held back longer than `HOLD`.
async fn release_held(st: &mut State) {
    let now = Instant::now();
    let held: Vec<u64> = st
        .pending
        .iter()
        .filter(|(_, (_, since))| now.duration_since(*since) >= HOLD)
        .map(|(t, _)| *t)
        .collect();
    for t in held {
        if let Some((a, _)) = st.pending.remove(&t)
            && let Err(e) = a.ack(BasicAckOptions::default()).await
        {
            warn!(error = %e, "ack failed; the broker redelivers and the idempotency record absorbs it");
        }
    }
}

async fn flush_all(st: &mut State) {
    ack_prefix(st).await;
    let rest: Vec<u64> = st.pending.keys().copied().collect();
    for t in rest {
        if let Some((a, _)) = st.pending.remove(&t) {
            let _ = a.ack(BasicAckOptions::default()).await;
        }
    }
}
