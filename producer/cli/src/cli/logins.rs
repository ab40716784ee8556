//! Credentials checks shared by `chime web` and `chime api`: failed logins, counted per client
//! address, and a comparison that takes the same time wherever two secrets differ.
//!
//! Failed logins: after [`ALLOWED`] failures within [`WINDOW`],
//! that address gets `429 Too Many Requests` until the window has passed, so credentials
//! cannot be guessed at the speed of the network. Other addresses are not affected (one
//! client cannot lock the operator out from elsewhere).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failed attempts allowed per address within [`WINDOW`].
pub const ALLOWED: u32 = 10;
/// How long failures are remembered.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Addresses remembered at most (the table is cleared of old windows when it is full).
const TRACKED: usize = 10_000;

/// Failures per address: when its window began, and how many.
#[derive(Debug, Default)]
pub struct Logins {
    failures: Mutex<HashMap<IpAddr, (Instant, u32)>>,
}

impl Logins {
    /// `Some(wait)` while `peer` must not try again.
    pub fn blocked(&self, peer: IpAddr) -> Option<Duration> {
        let failures = self.failures.lock().ok()?;
        let (since, n) = failures.get(&peer)?;
        let left = WINDOW.checked_sub(since.elapsed())?;
        (*n >= ALLOWED).then_some(left)
    }

    /// `peer` failed to log in.
    pub fn failed(&self, peer: IpAddr) {
        let Ok(mut failures) = self.failures.lock() else { return };
        if failures.len() >= TRACKED {
            failures.retain(|_, (since, _)| since.elapsed() < WINDOW);
        }
        let entry = failures.entry(peer).or_insert((Instant::now(), 0));
        if entry.0.elapsed() >= WINDOW {
            *entry = (Instant::now(), 0);
        }
        entry.1 += 1;
    }
}

/// Compares without stopping at the first difference (the time says nothing about where).
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i).copied().unwrap_or(!x));
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_blocked_after_its_failures_and_no_other() {
        let l = Logins::default();
        let (a, b) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        for _ in 0..ALLOWED - 1 {
            l.failed(a);
        }
        assert!(l.blocked(a).is_none());
        l.failed(a);
        assert!(l.blocked(a).is_some_and(|d| d <= WINDOW));
        assert!(l.blocked(b).is_none());
    }
}
