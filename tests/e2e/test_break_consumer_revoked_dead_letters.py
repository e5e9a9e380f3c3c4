"""Probe (helper-42, session 7): a ``consume-ready`` paused (SIGSTOP) with a fetched backlog
while its partitions go to a second consumer of the group, then resumed (SIGCONT).

The resumed consumer works through its stale batch before its client notices the lost
assignment. Its applies were always absorbed by ``processed_event``; its dead letters were not:
each hostile message of the stale batch went to ``job.ready.dlq`` a second time under the same
group (28 bad messages gave 56 DLQ records, and ``dlq replay`` replayed both copies). A
dead-lettered position is now recorded in ``processed_event`` in the transaction that waits
for the dead letter to be durable, so each group dead-letters a position once (one position
may come twice: the one whose DLQ produce was in flight at the pause).
"""

from __future__ import annotations

import collections
import os
import signal
import time

import pytest
from confluent_kafka import Producer

from jobstream.kafka import group_lag, producer_config
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, job_ready, query, read_topic, stopped, wait_for

pytestmark = pytest.mark.e2e

N = 900
PARTITIONS = 3
HOSTILE = [
    (None, None),
    (b"k", b"not json at all"),
    (b"k", b"\xff\xfe\xfa bad utf8 \x80"),
    (b"k", b'{"event_type": "job.ready"}'),
    (b"k", b"[1,2,3]"),
    (b"\xff\x00", b"null"),
]


def test_a_revoked_consumer_resumed_mid_batch_dead_letters_nothing_twice(
        settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("job.ready")
    events = [job_ready(f"revoked{i}") for i in range(N)]
    producer = Producer(producer_config(settings))
    hostile: set[tuple[int, int]] = set()  # (partition, offset) of each bad message
    errs: list[object] = []

    def on_delivery(err: object, msg: object) -> None:
        if err:
            errs.append(err)

    def on_hostile(err: object, msg: object) -> None:
        if err:
            errs.append(err)
        else:
            hostile.add((msg.partition(), msg.offset()))  # type: ignore[attr-defined]

    for i, e in enumerate(events):
        p = i % PARTITIONS
        producer.produce(topic, key=str(e.job_id).encode(), value=encode_event(e), partition=p,
                         on_delivery=on_delivery)
        if i % 31 == 0:  # bad messages spread through every partition's backlog
            k, v = HOSTILE[(i // 31) % len(HOSTILE)]
            producer.produce(topic, key=k, value=v, partition=p, on_delivery=on_hostile)
        producer.poll(0)
    assert producer.flush(60) == 0 and not errs, errs
    group = settings.group("downstream-ready-applier")
    # A consumer paused inside a dead letter's transaction holds that position's marker row
    # until Postgres ends its session (transaction_idle_timeout_s): 3 s here, not 60.
    env = {"JOBSTREAM_CONSUMER_SESSION_TIMEOUT_MS": "6000", "JOBSTREAM_CONSUMER_BATCH_SIZE": "300",
           "JOBSTREAM_CONSUMER_TRANSACTION_IDLE_TIMEOUT_S": "3"}

    def n_applied() -> int:
        return int(query(settings.database_url,
                         "SELECT count(*) AS n FROM downstream.document_analysis")[0]["n"])

    first = procs.start("consume-ready", name="consumer-paused", **env)
    wait_for(lambda: n_applied() > 0, 60, "first apply", procs.logs, every_s=0.02)
    os.kill(first.popen.pid, signal.SIGSTOP)
    wait_for(lambda: stopped(first.popen.pid), 5, "consumer stopped")
    at_stop = n_applied()
    procs.start("consume-ready", name="consumer-next", **env)
    # The next owner takes the partitions once the paused one's session expires, and works
    # through everything, the paused one's fetched batch included.
    wait_for(lambda: n_applied() == N, 90, "the next owner applied everything", procs.logs,
             every_s=0.2)
    os.kill(first.popen.pid, signal.SIGCONT)
    wait_for(lambda: group_lag(settings, group, [topic]) == 0, 60, "lag 0", procs.logs,
             every_s=0.5)
    time.sleep(3)  # the resumed consumer's stale batch is worked through by now
    print("applied when paused", at_stop, "hostile", len(hostile))
    assert at_stop < N, "probe too small: everything was applied before the pause"

    per_key = query(settings.database_url,
                    "SELECT a.dedup_key, count(*) AS n, (SELECT count(*) FROM "
                    "downstream.ledger_charge c WHERE c.dedup_key = a.dedup_key) AS charges "
                    "FROM downstream.document_analysis a GROUP BY a.dedup_key")
    assert sorted(r["dedup_key"] for r in per_key) == sorted(e.dedup_key for e in events)
    assert all((r["n"], r["charges"]) == (1, 1) for r in per_key)

    def positions() -> collections.Counter[tuple[int, int]]:
        seen: collections.Counter[tuple[int, int]] = collections.Counter()
        for m in read_topic(settings, topic + ".dlq"):
            h = dict(m.headers() or [])
            assert h["dlq_consumer_group"] == group.encode()
            seen[int(h["dlq_original_partition"] or b"-1"),
                 int(h["dlq_original_offset"] or b"-1")] += 1
        return seen

    dlq = positions()
    twice = {pos: n for pos, n in dlq.items() if n > 1}
    # Before the fix every bad message of the stale batch came twice (10 of 10 here). One
    # position may still come twice: the one whose DLQ produce was in flight at the pause
    # (Postgres cannot fence a broker write; consumers/idempotent.py _dead_letter).
    assert len(twice) <= 1 and set(twice.values()) <= {2}, \
        f"dead-lettered more than once by one group: {twice}"
    assert set(dlq) == hostile, (set(dlq) ^ hostile)
    # The same window, seen from the other side: when the pause lands while a DLQ produce is
    # in flight, the resumed consumer finds that produce's deadline (dlq_produce_timeout_s)
    # passed and stores the dead letter in the dead_letter table instead (never dropped). So
    # at most that one position may be there, and only a bad one.
    table = query(settings.database_url,
                  "SELECT kafka_partition, kafka_offset, consumer_group, dlq_error "
                  "FROM dead_letter")
    assert len(table) <= 1, f"more than the one in-flight dead letter stored: {table}"
    assert {(r["kafka_partition"], r["kafka_offset"]) for r in table} <= hostile, table
    assert all(r["consumer_group"] == group for r in table), table
