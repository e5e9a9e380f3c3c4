"""The relay's batched narrow-topic path (issue 12, fifth pass), with a real relay process,
Postgres and the broker: a topic whose ``max.message.bytes`` (2000) is below the producer's
``message.max.bytes`` gets its rows in record batches kept under the limit, and a row too large
for such a batch goes alone after the rows before it were acknowledged.

The row over the limit uncompressed that lz4 brings under it must be DELIVERED (the broker
decides, the relay does not park it unsent), in its place in the key's order; the one that
stays over the limit (random bytes) is parked, alone; nothing else is refused or reordered.
"""

from __future__ import annotations

import base64
import json
import os
import uuid

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.kafka import base_config
from jobstream.settings import Settings
from outbox_relay.relay import narrow_batch_bytes, record_bytes
from tests.helpers import ProcessRunner, create_limited_topic, query, read_topic, wait_for

pytestmark = pytest.mark.e2e

LIMIT = 2000
ROWS = 80
COMPRESSIBLE, RANDOM = 10, 50  # 6,000 bytes of one letter; 4,000 random bytes (base64)


def _payload(i: int) -> bytes:
    pad = ("x" * 6000 if i == COMPRESSIBLE
           else base64.b64encode(os.urandom(3000 if i == RANDOM else 60)).decode())
    return json.dumps({"n": i, "pad": pad}).encode()


def test_a_narrow_topic_is_batched_and_only_a_row_it_refuses_is_parked(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("narrow.batches")
    admin = AdminClient(base_config(settings))
    create_limited_topic(admin, topic, LIMIT)
    payloads = [_payload(i) for i in range(ROWS)]
    big = {i for i, p in enumerate(payloads)
           if record_bytes((0, topic, "job-1", p, {"n": str(i)}, "t")) > narrow_batch_bytes(LIMIT)}
    assert big == {COMPRESSIBLE, RANDOM}, big  # the two go alone, the others are batched
    with psycopg.connect(url) as conn, conn.transaction():
        for i, p in enumerate(payloads):
            conn.execute(Q["outbox_insert"], (topic, "job-1", p, Jsonb({"n": str(i)}),
                                              uuid.uuid4(), "test.row"))
    relay = procs.start("relay", JOBSTREAM_KAFKA_EXTRA=json.dumps({"batch.num.messages": 7}))
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE published_at IS NULL"), 90,
             "the outbox drained", procs.logs)
    got = [json.loads(m.value())["n"] for m in read_topic(settings, topic)]
    want = [i for i in range(ROWS) if i != RANDOM]
    assert got == want, f"lost, duplicated or reordered: {got}"
    parked = query(url, "SELECT reason_code, dlq_error FROM dead_letter")
    assert len(parked) == 1 and parked[0]["reason_code"] == "undeliverable", parked
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()
    assert "record batches of at most" in relay.log_text(), relay.log_text()[-2000:]


def test_two_narrow_topics_of_different_limits_share_the_smaller_batches(
        settings: Settings, procs: ProcessRunner) -> None:
    """Rows of a 50,000-byte topic come first (the narrow producer is made for its limit),
    then rows of both interleave with a 2,000-byte topic: the producer is replaced by one with
    batches under 2,000 bytes after its rows were acknowledged. Each topic keeps its key's
    order; only the rows each topic refuses are parked."""
    url = settings.database_url
    wide, tight = settings.topic("narrow.fifty"), settings.topic("narrow.two")
    admin = AdminClient(base_config(settings))
    for topic, limit in ((wide, 50_000), (tight, LIMIT)):
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1, config={
            "max.message.bytes": str(limit)})])[topic].result(30)
        wait_for(lambda t=topic: t in admin.list_topics(timeout=10).topics, 30, "the topic")
    # (topic, n, random bytes): 60,000 random bytes are over both limits, 3,000 over the
    # 2,000-byte one only.
    rows = [(wide, i, 60_000 if i == 7 else 3_000 if i % 5 == 0 else 60) for i in range(20)]
    for i in range(20, 80):
        rows.append((wide, i, 3_000 if i % 9 == 0 else 60))
        rows.append((tight, i, 3_000 if i in (30, 31, 55) else 60))
    with psycopg.connect(url) as conn, conn.transaction():
        for topic, i, size in rows:
            pad = base64.b64encode(os.urandom(size)).decode()
            conn.execute(Q["outbox_insert"], (topic, "job-1", json.dumps(
                {"n": i, "pad": pad}).encode(), Jsonb({"n": str(i)}), uuid.uuid4(), "test.row"))
    # A 50 ms linger fills the batches (without it, how many rows share one depends on
    # timing); at most 10 rows each (~2,500 bytes of the 2,000-byte topic's rows: over its
    # limit unless batch.size stops them first), so several batches of a partition are in
    # flight at once, the case where a refused one lets later ones overtake it.
    relay = procs.start("relay", JOBSTREAM_RELAY_LINGER_MS="50",
                        JOBSTREAM_KAFKA_EXTRA=json.dumps({"batch.num.messages": 10}))
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE published_at IS NULL"), 90,
             "the outbox drained", procs.logs)
    for topic, refused in ((wide, {7}), (tight, {30, 31, 55})):
        got = [json.loads(m.value())["n"] for m in read_topic(settings, topic)]
        want = [i for t, i, _ in rows if t == topic and i not in refused]
        assert got == want, f"{topic}: lost, duplicated or reordered: {got}"
    assert len(query(url, "SELECT 1 FROM dead_letter")) == 4
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()
