use super::*;
use proptest::prelude::*;
use std::sync::{Arc, Mutex};

/// What the application does next.
#[derive(Debug, Clone)]
enum Op {
    /// The broker delivers the next tag; the worker registers it, or loses it on the way (a
    /// consumer cancelled and re-created on the same channel, a stream item never read).
    Deliver {
        registered: bool,
    },
    /// The worker settles the n-th delivery still in progress.
    Settle {
        nth: usize,
        ack: bool,
    },
    /// A delivery is settled a second time (a bug elsewhere must not reach the wire).
    SettleAgain {
        nth: usize,
        ack: bool,
    },
    Tick {
        ms: u64,
    },
    Flush,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => prop_oneof![9 => Just(true), 1 => Just(false)].prop_map(|registered| Op::Deliver { registered }),
        4 => (any::<usize>(), prop_oneof![4 => Just(true), 1 => Just(false)]).prop_map(|(nth, ack)| Op::Settle { nth, ack }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(nth, ack)| Op::SettleAgain { nth, ack }),
        2 => (0..40u64).prop_map(|ms| Op::Tick { ms }),
        1 => Just(Op::Flush),
    ]
}

/// The broker's view of one channel, and what the application decided.
#[derive(Default)]
struct Model {
    next: u64,
    /// Delivered and not yet acked or requeued at the broker.
    outstanding: BTreeSet<u64>,
    in_progress: Vec<u64>,
    settled_ack: BTreeSet<u64>,
    settled_requeue: BTreeSet<u64>,
    settled: Vec<u64>,
}

impl Model {
    /// Applies frames as the broker would, failing on any frame that breaks the invariant.
    fn wire(&mut self, frames: Vec<Wire>) -> Result<(), TestCaseError> {
        for w in frames {
            match w {
                Wire::Ack { tag, multiple: false } => {
                    prop_assert!(
                        self.outstanding.remove(&tag),
                        "ack of tag {} not outstanding (double ack)",
                        tag
                    );
                    prop_assert!(self.settled_ack.contains(&tag), "ack of tag {} not settled by ack", tag);
                }
                Wire::Ack { tag, multiple: true } => {
                    prop_assert!(
                        self.outstanding.contains(&tag),
                        "multiple ack of tag {} not outstanding",
                        tag
                    );
                    let covered: Vec<u64> = self.outstanding.range(..=tag).copied().collect();
                    for t in covered {
                        prop_assert!(
                            self.settled_ack.contains(&t),
                            "multiple ack up to {} covers tag {}, which is not settled by ack",
                            tag,
                            t
                        );
                        self.outstanding.remove(&t);
                    }
                }
                Wire::Requeue { tag } => {
                    prop_assert!(self.outstanding.remove(&tag), "requeue of tag {} not outstanding", tag);
                    prop_assert!(
                        self.settled_requeue.contains(&tag),
                        "requeue of tag {} not settled by requeue",
                        tag
                    );
                }
            }
        }
        Ok(())
    }
}

fn run_ops(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let start = Instant::now();
    let mut now = start;
    let mut ledger = AckLedger::default();
    let mut m = Model { next: 1, ..Model::default() };
    for op in ops {
        match op {
            Op::Deliver { registered } => {
                let tag = m.next;
                m.next += 1;
                m.outstanding.insert(tag);
                if registered {
                    ledger.delivered(tag);
                    m.in_progress.push(tag);
                }
            }
            Op::Settle { nth, ack } if !m.in_progress.is_empty() => {
                let tag = m.in_progress.remove(nth % m.in_progress.len());
                m.settled.push(tag);
                let frames = if ack {
                    m.settled_ack.insert(tag);
                    ledger.ack(tag, now)
                } else {
                    m.settled_requeue.insert(tag);
                    ledger.requeue(tag)
                };
                m.wire(frames)?;
            }
            Op::Settle { .. } => {}
            Op::SettleAgain { nth, ack } if !m.settled.is_empty() => {
                let tag = m.settled[nth % m.settled.len()];
                let frames = if ack { ledger.ack(tag, now) } else { ledger.requeue(tag) };
                prop_assert!(frames.is_empty(), "settling tag {} twice sent {:?}", tag, frames);
            }
            Op::SettleAgain { .. } => {}
            Op::Tick { ms } => {
                now += Duration::from_millis(ms);
                m.wire(ledger.tick(now))?;
            }
            Op::Flush => m.wire(ledger.flush())?,
        }
    }
    // Settle the rest, flush: every registered delivery is then off the broker's books; only
    // the lost ones stay outstanding (the broker redelivers them when the channel closes).
    for tag in std::mem::take(&mut m.in_progress) {
        m.settled_ack.insert(tag);
        let frames = ledger.ack(tag, now);
        m.wire(frames)?;
    }
    m.wire(ledger.flush())?;
    let left: Vec<u64> = m
        .outstanding
        .iter()
        .filter(|t| m.settled_ack.contains(t) || m.settled_requeue.contains(t))
        .copied()
        .collect();
    prop_assert!(left.is_empty(), "settled but never sent: {:?}", left);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn a_multiple_ack_never_covers_an_unsettled_or_unknown_delivery(ops in proptest::collection::vec(op(), 1..200)) {
        run_ops(ops)?;
    }
}

#[test]
fn a_lost_tag_blocks_multiple_acks_past_it() {
    let t = Instant::now();
    let mut l = AckLedger::default();
    l.delivered(1);
    // Tag 2 was delivered to the channel but never reached the ledger.
    l.delivered(3);
    assert_eq!(l.ack(1, t), vec![Wire::Ack { tag: 1, multiple: true }]);
    assert!(l.ack(3, t).is_empty(), "3 must not be acked with multiple=true over 2");
    assert_eq!(l.tick(t + HOLD), vec![Wire::Ack { tag: 3, multiple: false }]);
}

#[test]
fn jobs_settled_in_order_are_acked_a_quarter_of_the_window_at_a_time() {
    let t = Instant::now();
    let mut l = AckLedger::default();
    for tag in 1..=64 {
        l.delivered(tag);
    }
    let mut frames = Vec::new();
    for tag in 1..=40 {
        frames.extend(l.ack(tag, t));
    }
    // 16 settled of 64 unacked, then 12 of 48 (a quarter again), then 9 of 36.
    let want = [16, 28, 37].map(|tag| Wire::Ack { tag, multiple: true });
    assert_eq!(frames, want);
    // The rest of the prefix goes out at the next tick, in one frame.
    assert_eq!(l.tick(t + Duration::from_millis(1)), vec![Wire::Ack { tag: 40, multiple: true }]);
    // The last one in flight is acked at once: nothing else would carry it.
    for tag in 41..=63 {
        l.ack(tag, t);
    }
    assert_eq!(l.ack(64, t), vec![Wire::Ack { tag: 64, multiple: true }]);
    assert!(!l.holds());
}

#[test]
fn requeues_go_out_at_once_and_unblock_the_prefix() {
    let t = Instant::now();
    let mut l = AckLedger::default();
    for tag in 1..=3 {
        l.delivered(tag);
    }
    assert!(l.ack(2, t).is_empty());
    assert!(l.ack(3, t).is_empty());
    assert_eq!(l.requeue(1), vec![Wire::Requeue { tag: 1 }, Wire::Ack { tag: 3, multiple: true }]);
    assert!(!l.is_open(1));
}

/// Records what the channel was asked to send, by tag.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<(u64, &'static str)>>>);

impl AckSink for Recorder {
    fn ack(&self, tag: u64, multiple: bool) -> BoxFuture<'static, Result<(), String>> {
        let log = self.0.clone();
        Box::pin(async move {
            log.lock().unwrap().push((tag, if multiple { "ack-multiple" } else { "ack" }));
            Ok(())
        })
    }
    fn requeue(&self, tag: u64) -> BoxFuture<'static, Result<(), String>> {
        let log = self.0.clone();
        Box::pin(async move {
            log.lock().unwrap().push((tag, "requeue"));
            Ok(())
        })
    }
}

async fn wait_for(log: &Recorder, n: usize) -> Vec<(u64, &'static str)> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let seen = log.0.lock().unwrap().clone();
        if seen.len() >= n || Instant::now() > deadline {
            return seen;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_panic_anywhere_in_a_delivery_task_requeues_it() {
    let log = Recorder::default();
    let batcher = AckBatcher::spawn(log.clone());
    let ticket = batcher.delivered(1);
    let task = tokio::spawn(async move {
        let _ticket = ticket;
        panic!("a bug outside the handler");
    });
    assert!(task.await.is_err());
    assert_eq!(wait_for(&log, 1).await, vec![(1, "requeue")]);
}

#[tokio::test]
async fn tickets_settle_once_through_the_batcher() {
    let log = Recorder::default();
    let batcher = AckBatcher::spawn(log.clone());
    let tickets: Vec<_> = (1..=3).map(|t| batcher.delivered(t)).collect();
    let mut it = tickets.into_iter();
    let (a, b, c) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    b.ack().await;
    c.requeue().await;
    a.ack().await;
    batcher.flush().await;
    let seen = wait_for(&log, 2).await;
    assert!(seen.contains(&(3, "requeue")), "{seen:?}");
    // 1 and 2 go out as one multiple ack through tag 2's acker.
    assert!(seen.contains(&(2, "ack-multiple")), "{seen:?}");
    assert_eq!(seen.len(), 2, "{seen:?}");
}
