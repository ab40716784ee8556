"""The Celery side of scripts/bench-peers: one no-op task that counts itself in Redis."""
import os
import time

import redis
from celery import Celery

KEY = os.environ["PEERS_KEY"]
N = int(os.environ["PEERS_N"])
R = redis.Redis.from_url(os.environ["PEERS_REDIS"])

app = Celery("peers", broker=os.environ["PEERS_AMQP"])
app.conf.update(
    task_default_queue=os.environ["PEERS_QUEUE"],
    task_ignore_result=True,
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    # kombu waits for the broker's confirm of each publish (Celery publishes without by default).
    broker_transport_options={"confirm_publish": True},
)


@app.task(name="noop")
def noop():
    n = R.incr(KEY)
    if n == 1:
        R.set(KEY + ":t0", time.time())
    if n == N:
        R.set(KEY + ":t1", time.time())
