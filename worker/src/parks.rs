//! Parked copies, packed. Under a long rate-limit line every run beyond the limit is parked
//! (sent round the delay chain), and the chain's dead-lettering becomes the bound: each copy
//! is a confirmed publish and one dead-lettering per set bit of its delay. Copies parked at
//! about the same moment for the same whole-second delay to the same queue share a routing
//! key, so they can travel as one message: a pack (see `chime_shared::envelope::pack`) whose
//! members keep their own headers (their tickets and park counts). When it comes back, each
//! member is decided on its own, and the pack is acked once all are settled.
//!
//! The first copy of a job for a routing key opens a pack and a timer; copies of that job
//! for that key within [`linger`] (a 64th of the delay, 50 to 500 ms) join it; the timer,
//! or the copy that fills it, publishes it, and every member's caller gets the one
//! confirm's outcome. A pack of one is sent as the
//! plain message it would have been. A pack is full at `worker.park_pack` copies,
//! `worker.concurrency`, the job's own concurrency (`jobs[].concurrency` or
//! `global_concurrency`, whichever is lower), or `amqp.max_message_bytes`: a worker that
//! takes a pack back can start every copy in it at once, so no copy waits for a slot while
//! it holds the others' delivery. When a job's copies across all its open packs reach that
//! bound, they all go at once: the worker may hold no more of the job's deliveries than
//! that (its prefetch follows the job's concurrency), so waiting would only hold them. And
//! when the copies in the open packs of one queue together reach half that queue's
//! prefetch, every one of them goes: lingering copies hold their deliveries, and a consumer
//! whose prefetch they fill gets nothing else (other jobs included) until they go.

use chime_shared::amqp::AmqpError;
use chime_shared::envelope::pack::{self, MemberHeaders};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::oneshot;

/// How long an open pack waits for more copies with its routing key, at least: a small part
/// of the shortest park (1 s).
const LINGER: Duration = Duration::from_millis(50);

/// The most an open pack waits: half the second a rate-limited copy is parked early by.
const MAX_LINGER: Duration = Duration::from_millis(500);

/// How long a pack opened for copies parked `delay` waits for more: a 64th of the delay
/// (it comes back at most that much later), at least [`LINGER`], at most [`MAX_LINGER`].
/// Copies parked far ahead (a long rate-limit line) travel in bigger packs: fewer messages
/// and fewer dead-letterings through the delay chain for the same copies.
pub(crate) fn linger(delay: Duration) -> Duration {
    (delay / 64).clamp(LINGER, MAX_LINGER)
}

/// Bytes a pack spends besides its members' bodies and headers (`{"v":1,"pack":[`, `]`,
/// `,"headers":[`, `]}`), with room to spare.
const PACK_BYTES: usize = 64;

/// Where a pack goes (the delay chain's top level, by the delay's routing key), and whose
/// copies it carries: copies of one job only, so that its concurrency bounds the pack.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Target {
    pub exchange: String,
    pub routing_key: String,
    pub job: String,
    /// The queue whose delivery each copy holds meanwhile.
    pub queue: String,
}

/// One parked copy waiting in an open pack.
pub(crate) struct Member {
    /// The envelope, encoded.
    pub body: Vec<u8>,
    /// Its properties as a message of its own (used when it is alone).
    pub props: BasicProperties,
    /// Its own headers, as the pack carries them.
    pub headers: MemberHeaders,
    sent: Option<oneshot::Sender<Result<(), String>>>,
}

impl Member {
    /// A member with `props` (its headers included) and its encoded `body`; the receiver
    /// gets the outcome of the publish that carries it.
    pub fn new(body: Vec<u8>, props: BasicProperties) -> (Self, oneshot::Receiver<Result<(), String>>) {
        let headers = own_headers(props.headers().as_ref());
        let (tx, rx) = oneshot::channel();
        (Self { body, props, headers, sent: Some(tx) }, rx)
    }

    fn bytes(&self) -> usize {
        self.body.len() + 3 + self.headers.iter().map(|(k, v)| k.len() + v.len() + 6).sum::<usize>()
    }
}

fn own_headers(table: Option<&FieldTable>) -> MemberHeaders {
    let mut out = MemberHeaders::new();
    for (k, v) in table.map(FieldTable::inner).into_iter().flatten() {
        let value = match v {
            AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            AMQPValue::ShortString(s) => s.as_str().to_string(),
            other => format!("{other:?}"),
        };
        out.insert(k.as_str().to_string(), value);
    }
    out
}

/// Copies closed into one message, ready to publish.
pub(crate) struct Closed {
    pub target: Target,
    members: Vec<Member>,
}

impl Closed {
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// The message: a pack of the members, or the one member as itself.
    pub fn message(&self) -> (Vec<u8>, BasicProperties) {
        match self.members.as_slice() {
            [one] => (one.body.clone(), one.props.clone()),
            members => {
                let bodies: Vec<&[u8]> = members.iter().map(|m| m.body.as_slice()).collect();
                let headers: Vec<&MemberHeaders> = members.iter().map(|m| &m.headers).collect();
                let ts = members.first().and_then(|m| *m.props.timestamp()).unwrap_or(0);
                (pack::encode_with_headers(&bodies, &headers), pack::properties_at(ts, members.len()))
            }
        }
    }

    /// Tells every member's caller the outcome of the publish.
    pub fn settle(mut self, outcome: &Result<(), AmqpError>) {
        let outcome = outcome.as_ref().map(|_| ()).map_err(ToString::to_string);
        for m in &mut self.members {
            if let Some(tx) = m.sent.take() {
                let _ = tx.send(outcome.clone());
            }
        }
    }
}

struct Open {
    id: u64,
    bytes: usize,
    members: Vec<Member>,
}

/// Packs open per routing key.
pub(crate) struct Packer {
    most: usize,
    max_bytes: usize,
    /// Copies the open packs of a queue may hold together before every one of them is
    /// closed (a queue not named: no such bound).
    held: HashMap<String, usize>,
    open: Mutex<HashMap<Target, Open>>,
    ids: AtomicU64,
}

/// What adding a copy asks of its caller.
pub(crate) struct Added {
    /// It opened a pack: start its timer, then [`Packer::take`] it by this id.
    pub opened: Option<u64>,
    /// Packs to publish now (the one it would have overflowed, the one it filled).
    pub closed: Vec<Closed>,
}

/// Copies waiting in the open packs whose target is `of`.
fn copies(open: &HashMap<Target, Open>, of: impl Fn(&Target) -> bool) -> usize {
    open.iter().filter(|(t, _)| of(t)).map(|(_, o)| o.members.len()).sum()
}

/// Every open pack whose target is `of`, closed.
fn close_where(open: &mut HashMap<Target, Open>, of: impl Fn(&Target) -> bool) -> Vec<Closed> {
    open.extract_if(|t, _| of(t)).map(|(t, o)| Closed { target: t, members: o.members }).collect()
}

impl Packer {
    /// At most `most` copies and `max_bytes` of body per pack, and `held[queue]` copies in
    /// the open packs of a queue together.
    pub fn new(most: usize, max_bytes: usize, held: HashMap<String, usize>) -> Self {
        Self { most: most.max(1), max_bytes, held, open: Mutex::new(HashMap::new()), ids: AtomicU64::new(0) }
    }

    /// Whether packing is on (`worker.park_pack` above 1).
    pub fn packs(&self) -> bool {
        self.most > 1
    }

    /// Adds `member` to the open pack for `target` (opening one if there is none), closing
    /// it at `most` copies when that is below the packer's own bound. When the job's copies
    /// in all its open packs reach that bound, every one of them is closed: a worker that
    /// holds that many of the job's deliveries at once (its prefetch, with the job's own
    /// concurrency) may get no more to fill them, and each copy's delivery waits unacked.
    /// When the open packs of the copy's queue hold that queue's `held` copies together,
    /// every one of them is closed.
    pub fn add(&self, target: Target, member: Member, most: usize) -> Added {
        let most = self.most.min(most.max(1));
        let mut closed = Vec::new();
        let bytes = member.bytes();
        let mut open = self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(o) = open.get(&target)
            && PACK_BYTES + o.bytes + bytes > self.max_bytes
            && let Some(o) = open.remove(&target)
        {
            closed.push(Closed { target: target.clone(), members: o.members });
        }
        let mut opened = None;
        let o = open.entry(target.clone()).or_insert_with(|| {
            let id = self.ids.fetch_add(1, Ordering::Relaxed);
            opened = Some(id);
            Open { id, bytes: 0, members: Vec::new() }
        });
        o.bytes += bytes;
        o.members.push(member);
        let full_bytes = PACK_BYTES + o.bytes >= self.max_bytes;
        let same_queue = |t: &Target| t.queue == target.queue;
        let same_job = |t: &Target| t.job == target.job;
        if self.held.get(&target.queue).is_some_and(|bound| copies(&open, same_queue) >= *bound) {
            closed.extend(close_where(&mut open, same_queue));
        } else if copies(&open, same_job) >= most {
            closed.extend(close_where(&mut open, same_job));
        } else if full_bytes && let Some(o) = open.remove(&target) {
            closed.push(Closed { target, members: o.members });
        }
        Added { opened, closed }
    }

    /// The pack `id` for `target`, if it is still open (its timer ran out).
    pub fn take(&self, target: &Target, id: u64) -> Option<Closed> {
        let mut open = self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if open.get(target).is_none_or(|o| o.id != id) {
            return None;
        }
        open.remove(target).map(|o| Closed { target: target.clone(), members: o.members })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chime_shared::envelope::{Envelope, Source, adhoc_key, put_header};

    #[test]
    fn a_pack_lingers_a_64th_of_its_delay_within_50_and_500_ms() {
        assert_eq!(linger(Duration::from_secs(1)), Duration::from_millis(50));
        assert_eq!(linger(Duration::from_secs(16)), Duration::from_millis(250));
        assert_eq!(linger(Duration::from_secs(60)), Duration::from_millis(500));
        assert_eq!(linger(Duration::from_secs(3600)), Duration::from_millis(500));
    }

    fn member(i: u32, at: &str) -> (Member, oneshot::Receiver<Result<(), String>>) {
        let env = Envelope::new(
            "j",
            "default",
            adhoc_key("j", &i.to_string()),
            serde_json::json!({"i": i}),
            None,
            3,
            Source::Adhoc,
        );
        let mut headers = FieldTable::default();
        put_header(&mut headers, "x-chime-rate-at", at);
        Member::new(env.encode(), env.properties().with_headers(headers))
    }

    fn target(rk: &str) -> Target {
        Target { exchange: "chain".into(), routing_key: rk.into(), job: "j".into(), queue: "default".into() }
    }

    #[test]
    fn copies_for_one_key_share_a_pack_until_it_is_full() {
        let packer = Packer::new(3, 1 << 20, HashMap::new());
        let (a, _ra) = member(1, "10");
        let added = packer.add(target("1"), a, usize::MAX);
        let id = added.opened.expect("the first copy opens the pack");
        assert!(added.closed.is_empty());
        // Another job's copy, so that this pack fills before the job's copies reach 3.
        let second = Target { job: "k".into(), ..target("2") };
        let (b, _rb) = member(2, "20");
        let added = packer.add(second.clone(), b, usize::MAX);
        assert!(added.opened.is_some(), "another routing key, another pack");
        let (c, _rc) = member(3, "30");
        assert!(packer.add(target("1"), c, usize::MAX).opened.is_none(), "joins the open pack");
        let (d, _rd) = member(4, "40");
        let added = packer.add(target("1"), d, usize::MAX);
        assert_eq!(added.closed.len(), 1, "the third copy fills it");
        let full = added.closed.into_iter().next().unwrap();
        assert!(packer.take(&target("1"), id).is_none(), "its timer finds it gone");
        let (body, props) = full.message();
        assert!(pack::is_pack(&props));
        let (jobs, headers) = pack::unpack(&body).unwrap();
        assert_eq!(jobs.len(), 3);
        let ats: Vec<&str> = headers.iter().map(|h| h["x-chime-rate-at"].as_str()).collect();
        assert_eq!(ats, ["10", "30", "40"], "each keeps its own ticket, in order");
        // A pack of one is the copy itself.
        let lone = packer.take(&second, 1).unwrap();
        let (body, props) = lone.message();
        assert!(!pack::is_pack(&props));
        assert!(Envelope::decode(&body).is_ok());
    }

    #[test]
    fn a_jobs_concurrency_bounds_its_packs_and_jobs_never_share_one() {
        let packer = Packer::new(100, 1 << 20, HashMap::new());
        let other = Target { job: "other".into(), ..target("1") };
        let (a, _ra) = member(1, "1");
        assert!(packer.add(target("1"), a, 2).opened.is_some());
        let (b, _rb) = member(2, "2");
        assert!(packer.add(other, b, 2).opened.is_some(), "another job, another pack");
        let (c, _rc) = member(3, "3");
        let added = packer.add(target("1"), c, 2);
        assert_eq!(added.closed.iter().map(Closed::len).collect::<Vec<_>>(), [2], "full at the job's 2");
        assert!(!Packer::new(1, 1 << 20, HashMap::new()).packs(), "park_pack = 1 sends each alone");
        // Copies of one job for different delays: when as many wait as the job's bound, every
        // open pack of the job goes (its deliveries may be all the worker gets).
        let packer = Packer::new(100, 1 << 20, HashMap::new());
        for (i, rk) in ["5", "6"].into_iter().enumerate() {
            let (m, _) = member(i as u32, rk);
            assert!(packer.add(target(rk), m, 3).closed.is_empty());
        }
        let (m, _) = member(9, "9");
        let mut sizes: Vec<usize> = packer.add(target("7"), m, 3).closed.iter().map(Closed::len).collect();
        sizes.sort();
        assert_eq!(sizes, [1, 1, 1], "three packs of one, all closed at the job's 3");
    }

    #[test]
    fn copies_held_together_up_to_half_the_prefetch_close_every_pack_of_their_queue() {
        // Half a prefetch of 8: four copies of two jobs for four delays, each job far below
        // its own bound; the fourth closes all four packs (a consumer of 8 keeps 4 free), not
        // the pack of another queue.
        let packer = Packer::new(100, 1 << 20, HashMap::from([("default".to_string(), 4)]));
        let (m, _) = member(9, "1");
        let elsewhere = Target { queue: "reports".into(), ..target("9") };
        assert!(packer.add(elsewhere, m, 100).closed.is_empty());
        let other = |rk: &str| Target { job: "other".into(), ..target(rk) };
        for (i, t) in [target("1"), other("2"), target("3")].into_iter().enumerate() {
            let (m, _) = member(i as u32, "1");
            let added = packer.add(t, m, 100);
            assert!(added.opened.is_some() && added.closed.is_empty(), "copy {i} waits");
        }
        let (m, _) = member(3, "1");
        let added = packer.add(other("4"), m, 100);
        let mut closed: Vec<(String, usize)> =
            added.closed.iter().map(|c| (c.target.routing_key.clone(), c.len())).collect();
        closed.sort();
        assert_eq!(closed, [("1".into(), 1), ("2".into(), 1), ("3".into(), 1), ("4".into(), 1)]);
        let (m, _) = member(4, "1");
        assert!(packer.add(target("1"), m, 100).opened.is_some(), "the next copy opens a new pack");
    }

    #[tokio::test]
    async fn every_member_hears_the_outcome_and_size_closes_a_pack() {
        let (a, _) = member(1, "1");
        let one = a.bytes();
        let packer = Packer::new(100, PACK_BYTES + 2 * one, HashMap::new());
        let (a, ra) = member(1, "1");
        let (b, rb) = member(2, "2");
        assert!(packer.add(target("k"), a, usize::MAX).closed.is_empty());
        let added = packer.add(target("k"), b, usize::MAX);
        assert_eq!(added.closed.iter().map(Closed::len).collect::<Vec<_>>(), [2], "full by size");
        let (c, rc) = member(3, "3");
        let added_c = packer.add(target("k"), c, usize::MAX);
        assert!(added_c.opened.is_some() && added_c.closed.is_empty());
        for closed in added.closed {
            closed.settle(&Err(AmqpError::ConfirmTimeout(Duration::from_secs(1))));
        }
        for rx in [ra, rb] {
            let e = rx.await.unwrap().unwrap_err();
            assert!(e.contains("no publisher confirm"), "{e}");
        }
        packer.take(&target("k"), added_c.opened.unwrap()).unwrap().settle(&Ok(()));
        assert_eq!(rc.await.unwrap(), Ok(()));
    }
}
