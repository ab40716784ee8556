#!/usr/bin/env python3
"""Enqueue a chime job from Python with plain pika, following the envelope v1 contract
(docs/reference/envelope.md): a persistent, mandatory, confirmed publish to <prefix>.work.

    python3 enqueue.py JOB [--payload JSON] [--key K] [--queue Q] [--max-attempts N]
                           [--amqp-url URL] [--prefix P]

Prints the job's idempotency key, and exits 0 once the broker confirmed the message (1 if it
did not, or returned it as unroutable: the job is then not enqueued, and the caller should try
again with the same --key).
"""

import argparse
import datetime
import json
import os
import sys
import uuid

import pika

# UUIDv5(URL namespace, "https://chime.dev/ns/idempotency"): chime's key namespace.
NAMESPACE = uuid.UUID("7f5a2425-8181-5667-9a90-88234fabd9fe")
assert NAMESPACE == uuid.uuid5(uuid.NAMESPACE_URL, "https://chime.dev/ns/idempotency")


def uuid7():
    """A UUIDv7 (time-ordered), as chime uses for message ids."""
    ms = int(datetime.datetime.now(datetime.timezone.utc).timestamp() * 1000)
    rand = int.from_bytes(os.urandom(10), "big")
    n = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | (rand >> 68 & 0xFFF) << 64 | 0b10 << 62 | (rand & ((1 << 62) - 1))
    return uuid.UUID(int=n)


def job_key(job, key):
    """The key chime derives from a caller's key: the same job and key run once."""
    return uuid.uuid5(NAMESPACE, f"{job}#{key}") if key is not None else uuid7()


def envelope(job, queue, payload, key, max_attempts):
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return {
        "v": 1,
        "id": str(uuid7()),
        "key": str(job_key(job, key)),
        "job": job,
        "queue": queue,
        "payload": payload,
        "slot": None,
        "enqueued_at": now.isoformat().replace("+00:00", "Z"),
        "attempt": 1,
        "max_attempts": max_attempts,
        "source": "adhoc",
        "trace_id": None,
    }


def enqueue(channel, prefix, env):
    """Publishes `env`; raises if the broker does not confirm it or returns it."""
    body = json.dumps(env, separators=(",", ":")).encode()
    props = pika.BasicProperties(
        content_type="application/json",
        delivery_mode=2,
        message_id=env["key"],
        type=env["job"],
        timestamp=int(datetime.datetime.now(datetime.timezone.utc).timestamp()),
    )
    # With confirms on, basic_publish raises UnroutableError for a returned message and
    # NackError for a refused one; it returns once the broker confirmed it.
    channel.basic_publish(f"{prefix}.work", env["queue"], body, props, mandatory=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job")
    p.add_argument("--payload", default="null", help="the job's arguments, JSON")
    p.add_argument("--key", help="your idempotency key (the same key runs once)")
    p.add_argument("--queue", default="default")
    p.add_argument("--max-attempts", type=int, default=5)
    p.add_argument("--amqp-url", default=os.environ.get("CHIME_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))
    p.add_argument("--prefix", default=os.environ.get("CHIME_PREFIX", "chime"))
    args = p.parse_args()
    env = envelope(args.job, args.queue, json.loads(args.payload), args.key, args.max_attempts)
    conn = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        enqueue(channel, args.prefix, env)
    except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as e:
        print(f"not enqueued ({type(e).__name__}): is {args.prefix}.q.{args.queue} declared?", file=sys.stderr)
        return 1
    finally:
        conn.close()
    print(env["key"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
