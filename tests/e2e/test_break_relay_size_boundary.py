"""Breaker6: the relay on a NARROW topic (``max.message.bytes`` below the producer's
``message.max.bytes``) with rows of one key whose sizes straddle the topic's limit, from
outside with a real relay process, Postgres and the broker.

Which rows the topic takes is not decided by the payload's length alone: the key, the headers,
the record and record-batch framing and lz4 (random bytes do not shrink, they grow a little)
all count. The truth is asked of the broker: every row is first produced ALONE, with the
relay's producer settings, to a twin topic of the same limit. Then the relay publishes the
same rows. Whatever the relay does to be fast (batching rows of a narrow topic under its
limit, parking a row it estimates too large without sending it), a row the topic takes alone
must be delivered (once, in outbox order) and only a row it refuses alone may be parked
(``undeliverable``, with the reason).

Sizes: singles near the limit (limit-260 .. limit+60 bytes of payload, 4-byte steps), rows
near a half and a third of it (two or three fill a record batch to the limit: a batch sized
by uncompressed bytes grows under lz4), small rows between, headers of varying length.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.kafka import base_config, producer_config
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, create_limited_topic, query, read_topic, wait_for

pytestmark = pytest.mark.e2e

LIMIT = 4000


def _rows(seed: int) -> list[tuple[bytes, dict[str, str]]]:
    """(payload, headers) of each row, in outbox order."""
    rng = random.Random(seed)
    sizes: list[int] = []
    near = list(range(LIMIT - 260, LIMIT + 60, 4))
    rng.shuffle(near)
    for big in near:
        sizes += [big, rng.randint(20, 200), LIMIT // 2 - rng.randint(0, 120),
                  LIMIT // 2 - rng.randint(0, 120), LIMIT // 3 - rng.randint(0, 90),
                  LIMIT // 3 - rng.randint(0, 90), LIMIT // 3 - rng.randint(0, 90)]
    return [(os.urandom(size), {"n": str(i), "h": "x" * rng.randint(0, 60)})
            for i, size in enumerate(sizes)]


def _create(admin: AdminClient, topic: str) -> None:
    create_limited_topic(admin, topic, LIMIT)


def _deliverable_alone(settings: Settings, topic: str,
                       rows: list[tuple[bytes, dict[str, str]]]) -> set[int]:
    """Indexes of the rows ``topic`` takes when each is produced alone (one per request)."""
    producer = Producer(producer_config(settings, **{"linger.ms": 0}))
    ok: set[int] = set()
    for i, (payload, headers) in enumerate(rows):
        report: list[Any] = []
        try:
            producer.produce(topic, value=payload, key=b"job-1", headers=headers,
                             on_delivery=lambda err, _m, r=report: r.append(err))
        except Exception:  # noqa: BLE001 - refused by the client: not deliverable
            continue
        producer.flush(30)
        assert report, f"row {i}: no delivery report from the twin topic"
        if report[0] is None:
            ok.add(i)
    return ok


def test_rows_straddling_a_narrow_topics_limit_are_parked_only_when_refused_alone(
        settings: Settings, procs: ProcessRunner) -> None:
    url = settings.database_url
    topic, twin = settings.topic("break.boundary"), settings.topic("break.boundary.twin")
    admin = AdminClient(base_config(settings))
    _create(admin, topic)
    _create(admin, twin)
    rows = _rows(6)
    ok = _deliverable_alone(settings, twin, rows)
    refused = set(range(len(rows))) - ok
    assert ok and refused, "the sizes do not straddle the limit: probe too weak"
    print(f"{len(rows)} rows, {len(refused)} refused alone")
    with psycopg.connect(url) as conn, conn.transaction():
        for payload, headers in rows:
            conn.execute(Q["outbox_insert"], (topic, "job-1", payload, Jsonb(headers),
                                              uuid.uuid4(), "test.row"))
    relay = procs.start("relay")
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE published_at IS NULL"), 120,
             "the outbox drained", procs.logs)
    got = [int(dict(m.headers())["n"]) for m in read_topic(settings, topic)]
    assert sorted(set(got)) == sorted(ok), (
        f"lost (deliverable alone, not delivered): {sorted(ok - set(got))}; "
        f"delivered though refused alone: {sorted(set(got) - ok)}")
    assert got == sorted(ok), f"per-key order broken or duplicates: {got}"
    parked = query(url, "SELECT outbox_id, dlq_error FROM dead_letter ORDER BY id")
    assert len(parked) == len(refused), parked
    assert all(p["dlq_error"] for p in parked), parked
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()
    print(json.dumps({"delivered": len(got), "parked": len(parked)}))
