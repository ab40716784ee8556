//! The connection table of the health server and the dashboard: who holds a connection, and
//! which one gives way when the table is full.
//!
//! Closing new connections when the table is full (as this server once did) hands the
//! endpoints to whoever opens connections first and keeps them idle: 32 idle sockets, reopened
//! as they were dropped, failed every `/livez` for as long as they were held. So a full table
//! makes room for a client that has something to say: a new connection whose request is
//! already waiting (a probe connects and sends at once) takes the place of the connection that
//! has been idle longest (connected, no request being answered), preferring the client that
//! holds the most; one whose whole request is already waiting is not itself evicted before
//! that request is answered (a probe's request arrives in one piece, a slow client's half
//! request does not). A silent newcomer, when the table or its client's share of
//! [`MAX_PER_CLIENT`] is full, waits in the [`Lobby`] for its first bytes (a probe's request
//! may arrive a moment after its connection is accepted) and is closed if none come: idle
//! sockets only ever displace each other, never a request. Only when every candidate is in
//! the middle of a request is a talking one closed.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Connections one client address holds at most.
pub const MAX_PER_CLIENT: usize = 16;

/// What a newcomer has sent by the time it is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// Nothing yet.
    Nothing,
    /// Part of a request.
    Part,
    /// A whole request head (ending in an empty line).
    Request,
}

/// One connection's state, shared with the task serving it.
#[derive(Debug)]
pub struct Conn {
    /// A request is being answered (it cannot be evicted).
    busy: AtomicBool,
    /// When it last became idle, in ns since the table's epoch.
    idle_since: AtomicU64,
    /// Fires when the connection must give way.
    pub evicted: CancellationToken,
    epoch: Instant,
}

impl Conn {
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Marks a request as being answered until the guard is dropped.
    pub fn busy(self: &Arc<Self>) -> BusyGuard {
        self.busy.store(true, Ordering::Release);
        BusyGuard(self.clone())
    }
}

/// Marks its connection idle again when dropped (the answer is written, or the request was
/// abandoned).
#[derive(Debug)]
pub struct BusyGuard(Arc<Conn>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.idle_since.store(self.0.now(), Ordering::Release);
        self.0.busy.store(false, Ordering::Release);
    }
}

#[derive(Debug)]
struct Entry {
    peer: IpAddr,
    conn: Arc<Conn>,
}

/// Every open connection, by id.
#[derive(Debug)]
pub struct Table {
    epoch: Instant,
    max: usize,
    per_client: usize,
    inner: Mutex<(u64, HashMap<u64, Entry>)>,
}

impl Default for Table {
    fn default() -> Self {
        Self::new(MAX_CONNECTIONS, MAX_PER_CLIENT)
    }
}

impl Table {
    /// A table of `max` connections, `per_client` per address.
    pub fn new(max: usize, per_client: usize) -> Self {
        Self { epoch: Instant::now(), max, per_client, inner: Mutex::new((0, HashMap::new())) }
    }

    /// A place for a new connection from `peer` that has sent `heard` so far. When the table
    /// or the client's share is full, a newcomer that sent something evicts an idle connection
    /// and a silent one is refused; `None`: refused. One whose whole request is waiting starts
    /// busy (not evictable until that request is answered).
    pub fn admit(&self, peer: IpAddr, heard: Heard) -> Option<(u64, Arc<Conn>)> {
        let mut guard = self.inner.lock().ok()?;
        let (next_id, entries) = &mut *guard;
        let mine = entries.values().filter(|e| e.peer == peer).count();
        let full = mine >= self.per_client || entries.len() >= self.max;
        if full && heard == Heard::Nothing {
            return None;
        }
        if mine >= self.per_client {
            evict(entries, |e| e.peer == peer)?;
        } else if entries.len() >= self.max {
            // The client holding the most gives way first.
            let mut held: HashMap<IpAddr, usize> = HashMap::new();
            for e in entries.values() {
                *held.entry(e.peer).or_default() += 1;
            }
            let most = held.values().copied().max().unwrap_or(0);
            evict(entries, |e| held.get(&e.peer) == Some(&most)).or_else(|| evict(entries, |_| true))?;
        }
        let conn = Arc::new(Conn {
            busy: AtomicBool::new(heard == Heard::Request),
            idle_since: AtomicU64::new(0),
            evicted: CancellationToken::new(),
            epoch: self.epoch,
        });
        conn.idle_since.store(conn.now(), Ordering::Release);
        *next_id += 1;
        entries.insert(*next_id, Entry { peer, conn: conn.clone() });
        Some((*next_id, conn))
    }

    /// The connection `id` ended.
    pub fn remove(&self, id: u64) {
        if let Ok(mut guard) = self.inner.lock() {
            guard.1.remove(&id);
        }
    }

    /// Open connections.
    pub fn len(&self) -> usize {
        self.inner.lock().map(|g| g.1.len()).unwrap_or(0)
    }

    /// No connection is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Silent newcomers that found the table full, waiting a moment for their first bytes.
/// Bounded: when full, the one waiting longest is closed for the newcomer. Turning the
/// newcomer away instead failed about one probe in five under attack (a probe's request often
/// arrives a moment after its connection is accepted, and the lobby was always full of idle
/// sockets); pushed out, an attacker's reconnecting sockets mostly displace each other, and a
/// probe's request arrives long before [`LOBBY`] newer sockets could push it out.
#[derive(Debug)]
pub struct Lobby {
    max: usize,
    inner: Mutex<std::collections::VecDeque<CancellationToken>>,
}

impl Default for Lobby {
    fn default() -> Self {
        Self::new(LOBBY)
    }
}

/// Silent newcomers waiting at once in the [`Lobby`].
pub const LOBBY: usize = 256;

impl Lobby {
    /// A lobby of `max` places.
    pub fn new(max: usize) -> Self {
        Self { max, inner: Mutex::new(std::collections::VecDeque::new()) }
    }

    /// A place for a newcomer; the token fires when it must leave (a newer one needed the
    /// place). The place is freed on [`Lobby::leave`].
    pub fn enter(&self) -> CancellationToken {
        let token = CancellationToken::new();
        if let Ok(mut q) = self.inner.lock() {
            q.retain(|t| !t.is_cancelled());
            while q.len() >= self.max {
                if let Some(oldest) = q.pop_front() {
                    oldest.cancel();
                }
            }
            q.push_back(token.clone());
        }
        token
    }

    /// The newcomer holding `token` left.
    pub fn leave(&self, token: &CancellationToken) {
        token.cancel();
        if let Ok(mut q) = self.inner.lock() {
            q.retain(|t| !t.is_cancelled());
        }
    }
}

/// Evicts the connection idle longest among those `eligible`; `None` if none is idle.
fn evict(entries: &mut HashMap<u64, Entry>, eligible: impl Fn(&Entry) -> bool) -> Option<()> {
    let victim = entries
        .iter()
        .filter(|(_, e)| eligible(e) && !e.conn.busy.load(Ordering::Acquire))
        .min_by_key(|(_, e)| e.conn.idle_since.load(Ordering::Acquire))
        .map(|(id, _)| *id)?;
    if let Some(e) = entries.remove(&victim) {
        e.conn.evicted.cancel();
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    #[test]
    fn a_full_table_evicts_the_longest_idle_of_the_biggest_holder() {
        let t = Table::new(4, 3);
        let a: Vec<_> = (0..3).map(|_| t.admit(ip(1), Heard::Part).unwrap()).collect();
        let b = t.admit(ip(2), Heard::Part).unwrap();
        // Full: a newcomer evicts the oldest idle connection of the client holding 3.
        let c = t.admit(ip(3), Heard::Part).unwrap();
        assert!(a[0].1.evicted.is_cancelled());
        assert!(!b.1.evicted.is_cancelled() && !c.1.evicted.is_cancelled());
        assert_eq!(t.len(), 4);
        // Busy connections are never evicted; with all busy, the newcomer is refused.
        let _busy: Vec<_> = [&a[1], &a[2], &b, &c].iter().map(|(_, conn)| conn.busy()).collect();
        assert!(t.admit(ip(4), Heard::Part).is_none());
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn the_lobby_pushes_out_the_longest_waiting() {
        let l = Lobby::new(2);
        let (a, b) = (l.enter(), l.enter());
        let c = l.enter();
        assert!(a.is_cancelled() && !b.is_cancelled() && !c.is_cancelled());
        l.leave(&b);
        let d = l.enter();
        assert!(!c.is_cancelled() && !d.is_cancelled());
    }

    #[test]
    fn a_whole_request_waiting_is_not_evicted_before_it_is_answered() {
        let t = Table::new(2, 2);
        let probe = t.admit(ip(1), Heard::Request).unwrap();
        let slow = t.admit(ip(1), Heard::Part).unwrap();
        let _next = t.admit(ip(1), Heard::Part).unwrap();
        assert!(slow.1.evicted.is_cancelled() && !probe.1.evicted.is_cancelled());
        // Answered, it is idle like any other: the next newcomers evict it in its turn.
        drop(probe.1.busy());
        let _again = t.admit(ip(1), Heard::Part).unwrap();
        let _and_again = t.admit(ip(1), Heard::Part).unwrap();
        assert!(probe.1.evicted.is_cancelled());
    }

    #[test]
    fn a_silent_newcomer_never_evicts() {
        let t = Table::new(2, 2);
        let a = t.admit(ip(1), Heard::Nothing).unwrap();
        let _b = t.admit(ip(2), Heard::Nothing).unwrap();
        assert!(t.admit(ip(3), Heard::Nothing).is_none(), "full: a silent newcomer is closed");
        assert!(!a.1.evicted.is_cancelled());
        assert!(t.admit(ip(3), Heard::Part).is_some(), "a talking one takes an idle place");
        assert!(a.1.evicted.is_cancelled());
    }

    #[test]
    fn one_client_never_holds_more_than_its_share() {
        let t = Table::new(100, 2);
        let first = t.admit(ip(1), Heard::Part).unwrap();
        let second = t.admit(ip(1), Heard::Part).unwrap();
        let _third = t.admit(ip(1), Heard::Part).unwrap();
        assert!(first.1.evicted.is_cancelled(), "its own oldest gave way");
        assert!(!second.1.evicted.is_cancelled());
        assert_eq!(t.len(), 2);
        t.remove(second.0);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_connection_idle_again_is_ordered_by_when_it_finished() {
        let t = Table::new(2, 2);
        let old = t.admit(ip(1), Heard::Part).unwrap();
        let young = t.admit(ip(1), Heard::Part).unwrap();
        // The old connection answers a request after the young one connected: it is now the
        // more recently active of the two.
        drop(old.1.busy());
        let _new = t.admit(ip(2), Heard::Part).unwrap();
        assert!(young.1.evicted.is_cancelled() && !old.1.evicted.is_cancelled());
    }
}
