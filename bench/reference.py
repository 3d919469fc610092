"""References for `python -m bench workers`, each the least a part of photo-reactor could be:

- `RenewingSimpleWorker`: RQ's SimpleWorker with the worker classes' renewal of the worker key
  (`reactor.worker.worker_key`) and nothing else, so that what the lifecycle costs can be told from
  what that renewal saves.
- `python -m bench.reference QUEUE` (the bare hop): one process that LISTENs on the channel
  `bench_hop` and enqueues each notification's payload to plain RQ's `bench.noop.stamp` at
  once: no claim, no lifecycle. Its latency is what a minimal relay between a COMMIT and an
  RQ queue adds on this machine: the notification, waking the relay, building the job with
  RQ and the enqueue's round trip. Reads DATABASE_URL and REDIS_URL; prints `ready` once
  listening, and exits on the payload `stop`.
"""

from __future__ import annotations

import os
import select
import sys

import psycopg
import redis
import rq.worker
from psycopg import sql
from rq import Queue

from reactor.worker.worker_key import KeyRenewal

#: The bare hop's channel.
HOP_CHANNEL = "bench_hop"
HOP_STOP = "stop"


class RenewingSimpleWorker(KeyRenewal, rq.worker.SimpleWorker):
    """RQ's SimpleWorker, renewing its key as `reactor.SimpleWorker` does."""


def hop(queue_name: str) -> None:
    """The bare hop: enqueue each notified photo at once (see the module docstring)."""
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(HOP_CHANNEL)))
        queue = Queue(queue_name, connection=redis.Redis.from_url(os.environ["REDIS_URL"]))
        # Build and send one job first, so the measured ones pay for no first use.
        queue.enqueue("bench.noop.noop", "warm-up")
        print("ready", flush=True)
        while True:
            select.select([conn.fileno()], [], [])
            for notification in conn.notifies(timeout=0):
                if notification.payload == HOP_STOP:
                    return
                queue.enqueue("bench.noop.stamp", notification.payload)


if __name__ == "__main__":
    hop(sys.argv[1])
