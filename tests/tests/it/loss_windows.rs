//! The two job-loss windows found by hand (issue: "nothing lost, provably"), reproduced with
//! real `chime-worker` processes: each must end with the job completed or in the DLQ.

use chime_producer::{EnqueueClient, EnqueueRequest};
use chime_shared::config::Config;
use lapin::options::ExchangeDeleteOptions;
use std::path::Path;
use std::time::Duration;

use crate::common::*;

fn lines(path: &Path) -> Vec<String> {
    ledger(path)
}

async fn wait_line(path: &Path, line: &str, within: Duration, what: &str) {
    let (p, l) = (path.to_path_buf(), line.to_string());
    wait_until(what, within, || {
        let (p, l) = (p.clone(), l.clone());
        async move { lines(&p).contains(&l) }
    })
    .await;
}

/// Waits until `queue` has a consumer (the worker process is up).
async fn wait_consumer(queue: &str) {
    let q = queue.to_string();
    wait_until("the worker consumes", Duration::from_secs(30), || {
        let q = q.clone();
        async move {
            let conn = connect_amqp().await;
            let d = chime_shared::topology::depth(&conn, &q).await.map(|(_, c)| c).unwrap_or(0);
            let _ = conn.close(200, "".into()).await;
            d > 0
        }
    })
    .await;
}

/// Window 1: a job longer than a renewal period while Redis restarts empty. Before: the
/// renewal found no record, took that for "another owner", cancelled the handler and acked
/// the delivery, and nobody ran the job again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_job_survives_redis_restarting_empty_under_it() {
    let mut redis = PrivateRedis::start().await;
    let mut env = TestEnv::new("loss-redis");
    env.redis_url = redis.url();
    let ledger = env.dir.join("ledger");
    let jobs = format!(
        "[[jobs]]\nname = \"long\"\nhandler = \"exec\"\ntimeout = \"60s\"\n\
         command = ['sh', '-c', 'echo start >> {l}; sleep 12; echo end >> {l}']\n",
        l = ledger.display()
    );
    let text = env.config_text("quorum", "lease = \"3s\"", "", &jobs);
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    let mut worker = Child::worker(&env.dir, &path, &[], "w");
    let client = EnqueueClient::connect(config).await.unwrap();
    let job = client.enqueue(EnqueueRequest::new("long").key("long-1")).await.unwrap();
    wait_line(&ledger, "start", Duration::from_secs(30), "the job started").await;
    // Three seconds in (three renewals of a 3 s lease), Redis dies and comes back empty.
    let started = std::time::Instant::now();
    wait_until("3 s into the job", Duration::from_secs(10), || async {
        started.elapsed() > Duration::from_secs(3)
    })
    .await;
    redis.restart().await;
    wait_line(&ledger, "end", Duration::from_secs(60), "the job ran to its end").await;
    let key = job.key.to_string();
    let e = &env;
    wait_until("`done` recorded in the new Redis", Duration::from_secs(30), || async {
        idem_state(e, &key).await.as_deref() == Some("done")
    })
    .await;
    assert_eq!(lines(&ledger), ["start", "end"], "one run, not cancelled");
    let log = worker.log_text();
    assert!(log.contains("claimed it again"), "the renewal re-created the lost record:\n{log}");
    assert!(!log.contains("another owner took this key over"), "{log}");
    // Stop the worker: anything it had not acked would go back to the queue.
    worker.signal(15);
    let _ = tokio::time::timeout(Duration::from_secs(60), worker.child.wait()).await;
    assert_eq!(depth(&env.names().work_queue("default")).await, 0, "acked");
    assert_eq!(depth(&env.names().dlq("default")).await, 0);
}

/// Window 2: a job fails for good and its dead letter cannot be published (the dead exchange
/// is gone). Before: `dead` was recorded first, so the requeued copy counted as a duplicate
/// and was acked: no copy anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_survives_a_failed_dlq_publish() {
    let env = TestEnv::new("loss-dlq");
    let ledger = env.dir.join("ledger");
    let jobs = format!(
        "[[jobs]]\nname = \"doomed\"\nhandler = \"exec\"\ncommand = ['sh', '-c', 'echo run >> {l}; exit 100']\n",
        l = ledger.display()
    );
    let text = env.config_text("quorum", "", "", &jobs);
    let path = env.write_config(&text);
    let config = Config::from_toml_str(&text).unwrap();
    let worker = Child::worker(&env.dir, &path, &[], "w");
    let names = env.names();
    wait_consumer(&names.work_queue("default")).await;
    // The client declares the topology when it connects: delete the exchange after that.
    let client = EnqueueClient::connect(config).await.unwrap();
    let conn = connect_amqp().await;
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_delete(names.dead_exchange().as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let _ = conn.close(200, "".into()).await;
    let job = client.enqueue(EnqueueRequest::new("doomed").key("d-1")).await.unwrap();
    let dlq = names.dlq("default");
    wait_until("the dead letter reached the DLQ", Duration::from_secs(60), || {
        let dlq = dlq.clone();
        async move { depth(&dlq).await >= 1 }
    })
    .await;
    let log = worker.log_text();
    assert!(log.contains("cannot publish to the DLQ; requeueing"), "the first publish failed:\n{log}");
    assert_eq!(lines(&ledger), ["run"], "the requeued copy dead-lettered again without running the job");
    let key = job.key.to_string();
    let e = &env;
    wait_until("`dead` recorded after the confirm", Duration::from_secs(10), || async {
        idem_state(e, &key).await.as_deref() == Some("dead")
    })
    .await;
    assert_eq!(depth(&names.work_queue("default")).await, 0);
}
