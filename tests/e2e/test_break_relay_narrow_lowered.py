"""Breaker6: a NARROW topic's ``max.message.bytes`` lowered further while the relay runs
(within ``relay_topic_limit_refresh_s``, 60 s by default: the relay still has the old limit),
rows of one key with some too large for the new limit among them. Real relay process, shared
broker and Postgres.

A narrow topic's rows went one at a time, so a lower limit only made the broker refuse the large
rows themselves (parked alone) and the key kept its order whatever the relay believed the limit
was. Rows of a narrow topic batched under the limit the relay KNOWS (issue 12, the narrow-topic
batching) are batched under the OLD one: the broker refuses a record batch for one large row,
its batch-mates with it, while later (smaller) batches of the partition go through, and the
batch-mates re-sent alone land after them. Every row the topic takes must be delivered once and
in outbox order, only the rows over the new limit parked.

``batch.num.messages`` 3: a refused batch has later batches of the partition in flight behind
it (as in tests/e2e/test_break_relay_refusal_order.py).
"""

from __future__ import annotations

import base64
import json
import os
import uuid

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.kafka import base_config
from jobstream.settings import Settings
from tests.helpers import (
    ProcessRunner,
    create_limited_topic,
    query,
    read_topic,
    set_topic_config,
    wait_for,
)

pytestmark = pytest.mark.e2e

WAS, NOW = 6000, 2000
ROWS = 90
BIG = {7, 8, 30, 31, 32, 55, 71, 88}  # over NOW, under WAS


def _insert(url: str, topic: str, ns: range | list[int]) -> None:
    with psycopg.connect(url) as conn, conn.transaction():
        for i in ns:
            pad = base64.b64encode(os.urandom(2400 if i in BIG else 200)).decode()
            conn.execute(Q["outbox_insert"], (topic, "job-1", json.dumps(
                {"n": i, "pad": pad}).encode(), Jsonb({"n": str(i)}), uuid.uuid4(),
                "test.row"))


def test_a_narrow_topics_limit_lowered_while_the_relay_runs_keeps_the_key_order(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("break.narrower")
    admin = AdminClient(base_config(settings))
    create_limited_topic(admin, topic, WAS)
    relay = procs.start("relay", JOBSTREAM_KAFKA_EXTRA=json.dumps({"batch.num.messages": 3}))
    _insert(url, topic, [-1])
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 60, "the first row published",
             procs.logs)
    assert f"topic {topic} takes messages up to {WAS}" in relay.log_text(), procs.logs()
    set_topic_config(settings, topic, "max.message.bytes", str(NOW))
    _insert(url, topic, range(ROWS))
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 90,
             "the outbox drained (rows published, the large ones parked)", procs.logs)
    got = [json.loads(m.value())["n"] for m in read_topic(settings, topic)]
    want = [-1] + [i for i in range(ROWS) if i not in BIG]
    assert sorted(set(got)) == want, f"lost: {sorted(set(want) - set(got))}"
    assert got == want, f"per-key order broken or duplicates: {got}"
    parked = query(url, "SELECT outbox_id FROM dead_letter")
    assert len(parked) == len(BIG), parked
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()
