"""The Dramatiq side of scripts/bench-peers: one no-op actor that counts itself in Redis."""
import os
import time

import dramatiq
import redis
from dramatiq.brokers.rabbitmq import RabbitmqBroker

KEY = os.environ["PEERS_KEY"]
N = int(os.environ["PEERS_N"])
R = redis.Redis.from_url(os.environ["PEERS_REDIS"])

# confirm_delivery: wait for the broker's confirm of each publish (off by default).
dramatiq.set_broker(RabbitmqBroker(url=os.environ["PEERS_AMQP"], confirm_delivery=True))


@dramatiq.actor(queue_name=os.environ["PEERS_QUEUE"], max_retries=0)
def noop():
    n = R.incr(KEY)
    if n == 1:
        R.set(KEY + ":t0", time.time())
    if n == N:
        R.set(KEY + ":t1", time.time())
