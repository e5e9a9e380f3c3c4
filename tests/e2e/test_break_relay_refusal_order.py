"""Breaking the relay's isolation of a row the broker refuses (too large for its topic) from
outside, with a real relay process, Postgres and the broker: the per-key order.

design.md: the relay "must keep per-key order". The rows here all have ONE key (one job's
events, one partition) on a topic whose ``max.message.bytes`` (2000) is below the producer's
``message.max.bytes``: the client accepts every row and batches them, the broker refuses the
record batch that holds the large row -- and with it the good rows batched together with it.
The large row must be parked (``undeliverable``), every other row delivered exactly once and in
outbox order, whatever the batching.
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
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.e2e

ROWS = 60
BAD = {5, 20, 21, 41}


def _insert(url: str, topic: str) -> None:
    """ROWS rows of one key, committed together; rows in BAD are over the topic's limit.
    Random padding: lz4 cannot shrink it."""
    with psycopg.connect(url) as conn, conn.transaction():
        for i in range(ROWS):
            pad = base64.b64encode(os.urandom(4000 if i in BAD else 90)).decode()
            conn.execute(Q["outbox_insert"], (topic, "job-1", json.dumps(
                {"n": i, "pad": pad}).encode(), Jsonb({"n": i}), uuid.uuid4(), "test.row"))


@pytest.mark.parametrize("batch", [None, 3], ids=["default_batches", "batches_of_3"])
def test_a_row_the_broker_refuses_is_parked_and_the_key_keeps_its_order(
        settings: Settings, procs: ProcessRunner, batch: int | None) -> None:
    """``batches_of_3``: the producer's record batches hold 3 rows (``batch.num.messages``),
    so a refused batch (the large row and its batch-mates) has later batches of the same
    partition in flight behind it, which the broker takes."""
    url, topic = settings.database_url, settings.topic("break.narrow")
    admin = AdminClient(base_config(settings))
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1,
                                  config={"max.message.bytes": "2000"})])[topic].result(30)
    wait_for(lambda: topic in admin.list_topics(timeout=10).topics, 30, "the topic")
    _insert(url, topic)
    relay = procs.start("relay", **({} if batch is None else {
        "JOBSTREAM_KAFKA_EXTRA": json.dumps({"batch.num.messages": batch})}))
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE published_at IS NULL"), 90,
             "the outbox drained (good rows published, the large one parked)", procs.logs)
    got = [json.loads(m.value())["n"] for m in read_topic(settings, topic)]
    want = [i for i in range(ROWS) if i not in BAD]
    assert sorted(got) == want, f"lost or duplicated: {sorted(set(got) ^ set(want))}, {got}"
    assert got == want, f"per-key order broken: {got}"
    parked = query(url, "SELECT reason_code, dlq_error FROM dead_letter")
    assert len(parked) == len(BAD) and parked[0]["reason_code"] == "undeliverable", parked
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()
    # The operator is told once why this topic is slow and how to fix it.
    assert relay.log_text().count(f"topic {topic} takes messages up to 2000 bytes") == 1, (
        relay.log_text()[-3000:])
