//! Every exchange, queue and Redis key name chime uses: those derived from a prefix, and those
//! of the delay chain that every prefix on a virtual host shares. No I/O: the declarations
//! are in `topology` and `delay`. No name is spelled anywhere else.
//!
//! Per prefix `<p>`: exchanges `<p>.work` and `<p>.dead`; queues `<p>.q.<queue>`,
//! `<p>.dlq.<queue>` and `<p>.unroutable`; Redis keys `<p>:…`.
//!
//! Per virtual host: the delay chain `chime-delay.<type>.<level>` (exchange and queue, for
//! each queue type in use), `chime-delay.deliver`, `chime-delay.unroutable` and the queue
//! `chime-delay.orphans`. Sharing it keeps a prefix's broker footprint at its work queues and
//! DLQs plus one: RabbitMQ reserves file handles per queue, and 28 levels per prefix exhausted
//! a broker with the common limit of 1,024 open files at about 13 prefixes.

/// Queue type of work queues and DLQs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    /// Replicated Raft queues (the default).
    Quorum,
    /// Classic queues (declared as CQv2).
    Classic,
}

impl QueueType {
    /// `quorum` or `classic`, as RabbitMQ spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

/// What every name of the shared delay chain starts with (`chime-delay.`): no prefix may be it.
pub const DELAY_PREFIX: &str = "chime-delay";

/// Exchange (topic) through which the delay chain hands messages to work queues. Messages it
/// cannot route go to its alternate exchange, [`DELAY_UNROUTABLE`], never back up the chain.
pub const DELAY_DELIVER: &str = "chime-delay.deliver";
/// Alternate exchange (topic) of [`DELAY_DELIVER`]: routes each prefix's unroutable delayed
/// messages into that prefix's `<p>.unroutable` queue.
pub const DELAY_UNROUTABLE: &str = "chime-delay.unroutable";
/// Queue behind the alternate exchange of [`DELAY_UNROUTABLE`]: delayed messages of a prefix
/// that has no `<p>.unroutable` queue (deleted while its messages waited). Nothing is dropped.
pub const DELAY_ORPHANS: &str = "chime-delay.orphans";
/// Alternate exchange (fanout) of [`DELAY_UNROUTABLE`], into [`DELAY_ORPHANS`].
pub const DELAY_ORPHANS_EXCHANGE: &str = "chime-delay.orphans.x";
/// How operators name the prefix's unroutable delayed messages beside its DLQs (never a
/// queue name: names cannot hold parentheses), and the routing key on `<p>.dead` that reaches
/// `<p>.unroutable` (DLQ passes put the copies they keep back through `<p>.dead`, never
/// through the default exchange, which reaches every queue of the virtual host).
pub const UNROUTABLE_SOURCE: &str = "(unroutable)";

/// Level `level` of the shared delay chain of `queue_type` (exchange and queue share it).
pub fn delay_level(queue_type: QueueType, level: u32) -> String {
    format!("{DELAY_PREFIX}.{}.{level}", queue_type.as_str())
}

/// A name as one routing-key word: dots (allowed in names) become `~` (which is not).
pub fn word(name: &str) -> String {
    name.replace('.', "~")
}

/// All names derived from one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    prefix: String,
}

impl Names {
    /// Names under `prefix` (`chime` by default).
    pub fn new(prefix: &str) -> Self {
        Self { prefix: prefix.to_string() }
    }
    /// The prefix itself.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// `<p>.work`, the direct exchange every job is published to.
    pub fn work_exchange(&self) -> String {
        format!("{}.work", self.prefix)
    }
    /// `<p>.dead`, the exchange dead letters are published to.
    pub fn dead_exchange(&self) -> String {
        format!("{}.dead", self.prefix)
    }
    /// `<p>.q.<queue>`, a work queue.
    pub fn work_queue(&self, queue: &str) -> String {
        format!("{}.q.{queue}", self.prefix)
    }
    /// `<p>.dlq.<queue>`, a dead-letter queue.
    pub fn dlq(&self, queue: &str) -> String {
        format!("{}.dlq.{queue}", self.prefix)
    }
    /// Where this prefix's delayed messages go when their work queue does not exist.
    pub fn unroutable_queue(&self) -> String {
        format!("{}.unroutable", self.prefix)
    }
    /// Redis key of the lock every pass over the DLQ of `queue` holds (one pass at a time).
    pub fn dlq_lock(&self, queue: &str) -> String {
        format!("{}:dlq-lock:{queue}", self.prefix)
    }
    /// Redis key of the idempotency record of `key`.
    pub fn idem_key(&self, key: &str) -> String {
        joined(&[&self.prefix, ":idem:", key])
    }
    /// Redis stream of the keys `chime cancel` cancelled: workers read it twice a second and
    /// stop the runs of those keys they hold.
    pub fn cancels(&self) -> String {
        format!("{}:cancels", self.prefix)
    }
    /// Redis stream of the run history of `queue`.
    pub fn history(&self, queue: &str) -> String {
        joined(&[&self.prefix, ":history:", queue])
    }
    /// Redis key of a live worker's heartbeat.
    pub fn worker(&self, id: &str) -> String {
        format!("{}:workers:{id}", self.prefix)
    }
    /// Redis sorted set of the worker ids that wrote a heartbeat (score: when it expires, in
    /// Unix ms), so listing workers never scans the keyspace.
    pub fn workers_index(&self) -> String {
        format!("{}:workers-index", self.prefix)
    }
    /// Redis key of the pause flag of a queue.
    pub fn paused_queue(&self, queue: &str) -> String {
        format!("{}:paused:queue:{queue}", self.prefix)
    }
    /// Redis key of the pause flag of a schedule.
    pub fn paused_schedule(&self, job: &str) -> String {
        format!("{}:paused:schedule:{job}", self.prefix)
    }
    /// Redis hash of a scheduled job's overlap state: its last published run and the slot
    /// waiting for it to end (`overlap`).
    pub fn overlap(&self, job: &str) -> String {
        format!("{}:overlap:{job}", self.prefix)
    }
    /// Redis sorted set of a job's global concurrency slots: owner token → lease end (ms).
    pub fn limit(&self, job: &str) -> String {
        format!("{}:limit:{job}", self.prefix)
    }
    /// Redis hash of a rate limit's bucket (`job:<job>` or `limit:<name>`) for one tenant:
    /// the limit's schedule (`t`) and how long the downstream asked it to hold (`h`). A
    /// tenant longer than 100 bytes is named by a hash of it.
    pub fn rate(&self, bucket: &str, tenant: &str) -> String {
        if tenant.len() <= 100 {
            return format!("{}:rate:{bucket}:{tenant}", self.prefix);
        }
        // FNV-1a, 64 bits: stable across processes and versions.
        let h = tenant
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        format!("{}:rate:{bucket}:#{h:016x}", self.prefix)
    }
    /// Redis string set while a queue is shedding its `sheddable` jobs (the threshold it
    /// crossed; refreshed every second by the workers that see it, expiring 5 s after).
    pub fn shed(&self, queue: &str) -> String {
        format!("{}:shed:{queue}", self.prefix)
    }
    /// Redis hash of the producers' local spools that hold jobs (`[producer] spool_dir`): field
    /// `<host>:<dir>`, value the spool's status as JSON, written at each flush (the DLQ monitor
    /// alerts on it).
    pub fn spools(&self) -> String {
        format!("{}:spools", self.prefix)
    }
    /// Redis hash of a circuit breaker (`jobs[].circuit`, `[[circuits]]`): its state and
    /// rolling window.
    pub fn circuit(&self, name: &str) -> String {
        format!("{}:circuit:{name}", self.prefix)
    }
    /// Redis string of a workflow (JSON): its steps, their keys and what each waits for.
    pub fn workflow(&self, key: &str) -> String {
        format!("{}:workflow:{key}", self.prefix)
    }
    /// Redis hash of a fanned-out run (sharded or broadcast): its members' keys.
    pub fn group(&self, base_key: &str) -> String {
        format!("{}:group:{base_key}", self.prefix)
    }

    /// The catalog's jobs: job name → what a worker registered about it (JSON).
    pub fn catalog_jobs(&self) -> String {
        format!("{}:catalog:jobs", self.prefix)
    }

    /// The catalog's queues: queue → the worker that consumes it and when it said so (JSON).
    pub fn catalog_queues(&self) -> String {
        format!("{}:catalog:queues", self.prefix)
    }

    /// One minute's totals for the dashboard's charts (a hash; see `chime_shared::minutes`).
    pub fn minute(&self, minute: i64) -> String {
        format!("{}:minutes:{minute}", self.prefix)
    }

    /// Workers seen in the last day: id → the time of its last heartbeat (a sorted set).
    pub fn workers_seen(&self) -> String {
        format!("{}:workers-seen", self.prefix)
    }

    /// A worker's last heartbeat, kept a day after it stops (for the dashboard's dead and
    /// stopped workers).
    pub fn worker_last(&self, id: &str) -> String {
        format!("{}:workers-last:{id}", self.prefix)
    }

    /// The ticker's leader lease (a string: the leader's id, with a TTL).
    pub fn ticker_leader(&self) -> String {
        format!("{}:ticker:leader", self.prefix)
    }

    /// The ticker's watermarks: job → the last slot published (Unix seconds).
    pub fn ticker_watermarks(&self) -> String {
        format!("{}:ticker:wm", self.prefix)
    }

    /// The ticker's counters of missed and paused slots per job.
    pub fn ticker_counts(&self) -> String {
        format!("{}:ticker:counts", self.prefix)
    }
}

/// The route (a queue of the prefix, `<prefix>.q.<route>`) of a worker's own queue: `@` and
/// the worker id with every character outside letters, digits, `.`, `_` and `-` spelled `-`.
pub fn worker_route(worker: &str) -> String {
    let id: String = worker
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '-' })
        .collect();
    format!("@{id}")
}

/// The route of `queue`'s priority level `level` (`high` or `low`; normal is the queue
/// itself): `<queue>^<level>` (`^` is outside the name alphabet: no queue is called so).
pub fn level_route(queue: &str, level: &str) -> String {
    format!("{queue}^{level}")
}

/// `<host>:<pid>`: how a worker or ticker names itself in claims, leases and logs unless
/// configured otherwise.
pub fn process_name() -> String {
    let host = gethostname::gethostname();
    let host = host.to_string_lossy();
    format!("{}:{}", if host.is_empty() { "host" } else { &host }, std::process::id())
}

/// The parts one after another, in one allocation (the names on a job's path are built per
/// job).
fn joined(parts: &[&str]) -> String {
    let mut s = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        s.push_str(p);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_design() {
        let n = Names::new("chime");
        assert_eq!(n.work_exchange(), "chime.work");
        assert_eq!(n.dead_exchange(), "chime.dead");
        assert_eq!(n.work_queue("default"), "chime.q.default");
        assert_eq!(n.dlq("default"), "chime.dlq.default");
        assert_eq!(n.unroutable_queue(), "chime.unroutable");
        assert_eq!(n.idem_key("k"), "chime:idem:k");
        assert_eq!(n.history("default"), "chime:history:default");
        assert_eq!(n.worker("h:1:ab"), "chime:workers:h:1:ab");
        assert_eq!(n.paused_queue("q"), "chime:paused:queue:q");
        assert_eq!(n.paused_schedule("j"), "chime:paused:schedule:j");
        assert_eq!(delay_level(QueueType::Quorum, 27), "chime-delay.quorum.27");
        assert_eq!(word("my.app"), "my~app");
    }
}
