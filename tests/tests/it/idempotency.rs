//! Every branch of the idempotency scripts (CLAIM, RENEW, FINISH, DYING, REVIVE, SETTLE_UNRUN) against real
//! Redis, under the test's own prefix.

use crate::common::*;
use chime_shared::idempotency::{Claim, DeadInfo, Final, IdemStore, Recorded, Renewal};
use std::time::Duration;

struct Keys {
    env: TestEnv,
    store: IdemStore,
    conn: redis::aio::MultiplexedConnection,
}

impl Keys {
    async fn new(name: &str) -> Self {
        let env = TestEnv::new(name);
        let config = env.config("quorum", "lease = \"1s\"", "", "");
        let store = IdemStore::connect(&config.redis, env.names()).unwrap();
        let conn = connect_redis(&env.redis_url).await;
        Self { env, store, conn }
    }
    fn key(&self, k: &str) -> String {
        self.env.names().idem_key(k)
    }
    async fn field(&mut self, k: &str, f: &str) -> Option<String> {
        redis::cmd("HGET").arg(self.key(k)).arg(f).query_async(&mut self.conn).await.unwrap()
    }
    async fn ttl_ms(&mut self, k: &str) -> i64 {
        redis::cmd("PTTL").arg(self.key(k)).query_async(&mut self.conn).await.unwrap()
    }
    async fn forget(&mut self, k: &str) {
        let _: i64 = redis::cmd("DEL").arg(self.key(k)).query_async(&mut self.conn).await.unwrap();
    }
    async fn claimed(&self, k: &str, owner: &str) -> u64 {
        match self.store.claim(k, owner).await.unwrap() {
            Claim::Claimed { fence, .. } => fence,
            other => panic!("{k}: {other:?}"),
        }
    }
}

/// Seven days, the default retention, in ms.
const RETENTION_MS: i64 = 7 * 86_400_000;

#[tokio::test]
async fn claim_branches() {
    let mut t = Keys::new("lua-claim").await;
    // Fresh: claimed with a fence from Redis TIME (microseconds, so > 10^15 today).
    let f1 = t.claimed("a", "o1").await;
    assert!(f1 > 1_000_000_000_000_000, "fence {f1} is Redis time in µs");
    assert!(t.ttl_ms("a").await > RETENTION_MS - 60_000);
    // The same owner again (a resent command): the same fence.
    assert_eq!(t.claimed("a", "o1").await, f1);
    // Another owner within the lease: busy, with what is left of it.
    let Claim::Busy { fence, remaining } = t.store.claim("a", "o2").await.unwrap() else {
        panic!("not busy")
    };
    assert_eq!(fence, f1);
    assert!(remaining <= Duration::from_secs(1));
    // After the lease: claimed by the other owner, with a higher fence.
    let store = t.store.clone();
    wait_until("the 1 s lease lapses", Duration::from_secs(5), || {
        let store = store.clone();
        async move { matches!(store.claim("a", "o2").await, Ok(Claim::Claimed { .. })) }
    })
    .await;
    let f2 = t.claimed("a", "o2").await;
    assert!(f2 > f1);
    // done and dead are duplicates, with their fence.
    assert_eq!(t.store.finish("a", "o2", f2, Final::Done).await.unwrap(), Recorded::Yes);
    assert_eq!(t.store.claim("a", "o3").await.unwrap(), Claim::Done { fence: f2 });
    let f = t.claimed("b", "o1").await;
    t.store.finish("b", "o1", f, Final::Dead).await.unwrap();
    assert_eq!(t.store.claim("b", "o3").await.unwrap(), Claim::Dead { fence: f });
    // free: claimable again, the fence grows.
    let f = t.claimed("c", "o1").await;
    t.store.finish("c", "o1", f, Final::Free).await.unwrap();
    assert!(t.claimed("c", "o2").await > f);
    // A published retry: an earlier attempt's copy that comes back (its ack was lost) is
    // stale; the retry's attempt and later ones claim; a copy without an attempt is not judged.
    let f = t.claimed("r", "o1").await;
    t.store.finish("r", "o1", f, Final::Retry(3)).await.unwrap();
    assert_eq!(t.field("r", "na").await.as_deref(), Some("3"));
    assert!(matches!(t.store.claim_copy("r", "o2", None, Some(2)).await.unwrap(), Claim::Stale { .. }));
    let Claim::Claimed { fence: f, .. } = t.store.claim_copy("r", "o2", None, Some(3)).await.unwrap() else {
        panic!("attempt 3 claims")
    };
    // Parked (free again), attempt 3 comes back; attempt 2 still does not.
    t.store.finish("r", "o2", f, Final::Free).await.unwrap();
    assert!(matches!(t.store.claim_copy("r", "o4", None, Some(2)).await.unwrap(), Claim::Stale { .. }));
    let Claim::Claimed { fence: f, .. } = t.store.claim_copy("r", "o4", None, Some(3)).await.unwrap() else {
        panic!("the parked attempt 3 claims")
    };
    // Dead-lettered without a claim after a retry (an open circuit, an unknown job): the key
    // stays `free`; its replay (attempt 1) is not stale.
    let f2 = t.claimed("r2", "o1").await;
    t.store.finish("r2", "o1", f2, Final::Retry(2)).await.unwrap();
    assert!(!t.store.revive("r2").await.unwrap(), "not dead: nothing to revive");
    assert!(matches!(t.store.claim_copy("r2", "o2", None, Some(1)).await.unwrap(), Claim::Claimed { .. }));
    // Dead, then replayed from the DLQ: the replay's attempt 1 runs.
    t.store.finish("r", "o4", f, Final::Dead).await.unwrap();
    assert!(t.store.revive("r").await.unwrap());
    assert!(matches!(t.store.claim_copy("r", "o5", None, Some(1)).await.unwrap(), Claim::Claimed { .. }));
    // A record Redis lost: claimed again with a fence still above every earlier one.
    t.forget("c").await;
    let after_loss = t.claimed("c", "o3").await;
    assert!(after_loss > f, "fences never go backwards after data loss ({after_loss} ≤ {f})");
    // A fence from an older release (a small counter) is raised to Redis time.
    let _: () = redis::cmd("HSET")
        .arg(t.key("old"))
        .arg(&["s", "free", "o", "x", "u", "0", "f", "41"])
        .query_async(&mut t.conn)
        .await
        .unwrap();
    assert!(t.claimed("old", "o1").await > 1_000_000_000_000_000);
}

#[tokio::test]
async fn dying_keys_are_handed_to_the_next_claimer() {
    let mut t = Keys::new("lua-dying").await;
    let dead = DeadInfo { reason: "exhausted".into(), error: "exit code 1".into(), attempts: 5 };
    let f = t.claimed("d", "o1").await;
    assert_eq!(t.store.mark_dying("d", "o1", f, &dead).await.unwrap(), Recorded::Yes);
    assert_eq!(t.field("d", "s").await.as_deref(), Some("dying"));
    // Someone else cannot mark a key it does not hold.
    let f2 = t.claimed("e", "o1").await;
    assert_eq!(t.store.mark_dying("e", "o2", f2, &dead).await.unwrap(), Recorded::NotOurs);
    // While its owner publishes the dead letter (a lease), a copy waits: no second dead letter.
    assert!(
        matches!(t.store.claim("d", "o2").await.unwrap(), Claim::Busy { fence, remaining } if fence == f && remaining <= Duration::from_secs(1)),
        "a copy of a key being dead-lettered is busy"
    );
    // Only the owner lets go (its publish failed); the next copy gets the dead letter's facts
    // and becomes the owner, holding it in turn.
    t.store.let_go_dying("d", "o3");
    assert!(matches!(t.store.claim("d", "o2").await.unwrap(), Claim::Busy { .. }));
    t.store.let_go_dying("d", "o1");
    assert_eq!(t.store.claim("d", "o2").await.unwrap(), Claim::Dying { fence: f, dead: dead.clone() });
    assert!(matches!(t.store.claim("d", "o4").await.unwrap(), Claim::Busy { .. }));
    assert_eq!(
        t.store.finish("d", "o1", f, Final::Dead).await.unwrap(),
        Recorded::NotOurs,
        "the old owner lost it"
    );
    assert_eq!(t.store.finish("d", "o2", f, Final::Dead).await.unwrap(), Recorded::Yes);
    assert_eq!(t.field("d", "s").await.as_deref(), Some("dead"));
    assert_eq!(t.field("d", "r").await, None, "the dead letter's facts are dropped once it is confirmed");
    // Marking a record Redis lost writes it anew.
    assert_eq!(t.store.mark_dying("gone", "o1", 7, &dead).await.unwrap(), Recorded::Recreated);
    // A publisher that died never lets go: its hold lapses after the lease (1 s here).
    wait_until("the dying key's hold lapses", Duration::from_secs(10), || async {
        matches!(t.store.claim("gone", "o9").await.unwrap(), Claim::Dying { .. })
    })
    .await;
}

#[tokio::test]
async fn renew_branches() {
    let mut t = Keys::new("lua-renew").await;
    let f = t.claimed("r", "o1").await;
    // Renewed, and the TTL refreshed to the retention.
    let _: i64 = redis::cmd("PEXPIRE").arg(t.key("r")).arg(5_000).query_async(&mut t.conn).await.unwrap();
    assert_eq!(t.store.renew("r", "o1").await.unwrap(), Renewal::Renewed);
    assert!(t.ttl_ms("r").await > RETENTION_MS - 60_000, "renewal refreshes the TTL");
    // Another owner's key: lost.
    assert_eq!(t.store.renew("r", "o2").await.unwrap(), Renewal::Lost);
    // A settled key: lost.
    t.store.finish("r", "o1", f, Final::Done).await.unwrap();
    assert_eq!(t.store.renew("r", "o1").await.unwrap(), Renewal::Lost);
    // The record is gone (Redis restarted empty): re-created for the same owner, new fence.
    let f = t.claimed("m", "o1").await;
    t.forget("m").await;
    let Renewal::Recreated { fence } = t.store.renew("m", "o1").await.unwrap() else {
        panic!("not recreated")
    };
    assert!(fence > f);
    assert_eq!(t.field("m", "s").await.as_deref(), Some("run"));
    assert_eq!(t.field("m", "o").await.as_deref(), Some("o1"));
    assert!(
        matches!(t.store.claim("m", "o2").await.unwrap(), Claim::Busy { .. }),
        "a copy sees it busy again"
    );
}

#[tokio::test]
async fn finish_and_revive_branches() {
    let mut t = Keys::new("lua-finish").await;
    let f = t.claimed("f", "o1").await;
    assert_eq!(t.store.finish("f", "o2", f, Final::Done).await.unwrap(), Recorded::NotOurs);
    assert_eq!(t.field("f", "s").await.as_deref(), Some("run"));
    assert_eq!(t.store.finish("f", "o1", f, Final::Done).await.unwrap(), Recorded::Yes);
    assert!(t.ttl_ms("f").await > RETENTION_MS - 60_000);
    // A record Redis lost: done and dead are written anew; free writes nothing.
    assert_eq!(t.store.finish("lost-done", "o1", 9, Final::Done).await.unwrap(), Recorded::Recreated);
    assert_eq!(t.field("lost-done", "s").await.as_deref(), Some("done"));
    assert_eq!(t.store.finish("lost-free", "o1", 9, Final::Free).await.unwrap(), Recorded::Recreated);
    assert_eq!(t.field("lost-free", "s").await, None);
    // Revive: only a dead key comes back.
    let f = t.claimed("v", "o1").await;
    assert!(!t.store.revive("v").await.unwrap());
    t.store.finish("v", "o1", f, Final::Dead).await.unwrap();
    assert!(t.store.revive("v").await.unwrap());
    assert!(t.claimed("v", "o2").await > f);
    // A dying key (its worker died after the dead letter's confirm) is revived by a replay.
    let f = t.claimed("w", "o1").await;
    let dead = DeadInfo { reason: "permanent".into(), error: "e".into(), attempts: 1 };
    t.store.mark_dying("w", "o1", f, &dead).await.unwrap();
    assert!(t.store.revive("w").await.unwrap());
    assert!(t.claimed("w", "o2").await > f);
}

/// SETTLE_UNRUN: a key that never runs (a slot skipped or shed by the ticker) is settled `done`
/// with its run once; a second decision for it, or one for a key already claimed, writes
/// nothing; a copy of a settled key is a duplicate.
#[tokio::test]
async fn a_key_that_never_runs_is_settled_once() {
    use chime_shared::history::{Outcome, RunEvent};
    let mut t = Keys::new("lua-unrun").await;
    let config = t.env.config("quorum", "", "", "");
    let conn = chime_shared::redis_conn::RedisConn::connect(&config.redis).await.unwrap();
    let names = t.env.names();
    let event = |key: &str, worker: &str| RunEvent {
        job: "j".into(),
        key: key.into(),
        id: String::new(),
        queue: "default".into(),
        attempt: 0,
        max_attempts: 3,
        worker: worker.into(),
        started_at: None,
        finished_at: chrono::Utc::now(),
        outcome: Outcome::Skipped,
        duration_ms: None,
        reason: Some("overlap".into()),
        error: None,
        entry: None,
    };
    let settle = |e: RunEvent| {
        let (mut conn, names, history) = (conn.clone(), names.clone(), config.history.clone());
        async move {
            chime_shared::idempotency::settle_unrun(&mut conn, &names, Duration::from_secs(600), &history, &e)
                .await
                .unwrap()
        }
    };
    assert!(settle(event("s", "ticker-1")).await, "the first decision settles the key");
    assert_eq!(t.field("s", "s").await.as_deref(), Some("done"));
    assert_eq!(t.field("s", "n").await.as_deref(), Some("1"), "its run is in the record");
    assert!(t.ttl_ms("s").await > 500_000);
    assert!(!settle(event("s", "ticker-2")).await, "a second decision writes nothing");
    assert_eq!(t.field("s", "o").await.as_deref(), Some("ticker-1"));
    assert_eq!(t.field("s", "n").await.as_deref(), Some("1"));
    assert!(matches!(t.store.claim("s", "w").await.unwrap(), Claim::Done { .. }), "a copy is a duplicate");
    // A key published and claimed already: left to its run.
    t.claimed("c", "w").await;
    assert!(!settle(event("c", "ticker-2")).await);
    assert_eq!(t.field("c", "s").await.as_deref(), Some("run"));
}
