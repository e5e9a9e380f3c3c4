"""robust11: forged ``retry_not_before_ms`` headers hold a stage's retry lane no longer than
``retry_cap_s`` after they were written, all of them together.

A producer with write access to a ``.retry`` topic (adv12) writes, ahead of a real retry on
the same partition, messages whose ``retry_not_before_ms`` is far in the future: some with a
value that is not an event at all, some with a schema-valid copy of a real job's
``document.uploaded`` and a forged CreateTime half an hour ahead. The retry agent runs one
message at a time; it used to sleep ``retry_cap_s`` for each of them before even decoding it,
so the real retry behind N of them waited N x ``retry_cap_s``. Now a message is decoded first
(poison is dead-lettered at once) and its wait ends by its Kafka timestamp (the broker's:
``.retry`` topics are created with ``LogAppendTime``) plus ``retry_cap_s``: the real retry runs
about ``retry_cap_s`` after the forged messages were written, not 8 x ``retry_cap_s``.
Real processes (a worker), shared services.
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer

from jobstream.kafka import producer_config
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, query, text_uploaded, wait_for

pytestmark = pytest.mark.e2e

CAP_S = 3
FORGED_POISON = 4
FORGED_VALID = 4


def _job_created(url: str, key: str) -> float | None:
    rows = query(url, "SELECT extract(epoch FROM created_at)::float8 AS t FROM job "
                      "WHERE idempotency_key = %s", (key,))
    return rows[0]["t"] if rows else None


def test_forged_not_before_headers_delay_a_real_retry_by_the_cap_at_most(
        settings: Settings, procs: ProcessRunner) -> None:
    url = settings.database_url
    procs.start("worker", JOBSTREAM_RETRY_CAP_S=str(CAP_S))
    real = text_uploaded("forged-lane-a", "A document whose upload is copied by a forger.")
    produce_raw(settings, settings.topic("document.uploaded"),
                [(b"forged-lane-a", encode_event(real))])
    wait_for(lambda: _job_created(url, "forged-lane-a"), 90, "the worker to take job A",
             procs.logs)

    far = str(int((time.time() + 3600) * 1000)).encode()
    now_ms = int(time.time() * 1000)
    retry_topic = settings.topic("document.uploaded.retry")
    producer = Producer(producer_config(settings))
    errors: list[object] = []

    def send(value: bytes, headers: list[tuple[str, bytes]], timestamp_ms: int = 0) -> None:
        producer.produce(retry_topic, key=b"forged-lane", value=value, partition=0,
                         headers=headers, timestamp=timestamp_ms,
                         on_delivery=lambda err, _m: errors.append(err) if err else None)

    forged = [("retry_count", b"1"), ("retry_not_before_ms", far)]
    written = time.time()
    for i in range(FORGED_POISON):
        send(b"not an event %d" % i, forged)
    for _ in range(FORGED_VALID):  # a real job's upload, CreateTime forged 30 min ahead
        send(encode_event(real), forged, timestamp_ms=now_ms + 1_800_000)
    # The real retry, due now, behind them on the same partition.
    later = text_uploaded("forged-lane-b", "The document whose retry waits behind them.")
    send(encode_event(later), [("retry_count", b"1"),
                               ("retry_not_before_ms", str(now_ms).encode())])
    assert producer.flush(60) == 0 and not errors, errors

    # Before robust11 it waited FORGED_POISON + FORGED_VALID caps (24 s); now one cap.
    created = wait_for(lambda: _job_created(url, "forged-lane-b"), 90,
                       "the real retry to run", procs.logs)
    waited = created - written
    print(f"the real retry ran {waited:.1f}s after the forged messages were written "
          f"(cap {CAP_S}s, {FORGED_POISON + FORGED_VALID} forged)")
    assert waited < (FORGED_POISON + FORGED_VALID) * CAP_S / 2, waited
    jobs = query(url, "SELECT count(*) AS n FROM job WHERE idempotency_key LIKE 'forged-lane%%'")
    assert jobs[0]["n"] == 2  # the valid copies were replays of job A
