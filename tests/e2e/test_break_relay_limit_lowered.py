"""Breaker (session 6): the relay's narrow-topic path (``_narrow`` / ``_produce_alone``) when a
topic's ``max.message.bytes`` is LOWERED while the relay runs (an operator's ``kafka-configs
--alter``, or a topic recreated by other tooling at a smaller limit).

The relay asked each topic's limit once and cached a known one for good: a topic that was
wide when first published to stayed "wide", its rows batched, and a large row refused by the
broker took its batch-mates with it while later batches of the partition went through: the
per-key order broken exactly as before the narrow path (test_break_relay_refusal_order.py).
Fix: a known limit is asked again after ``relay_topic_limit_refresh_s`` (default 60 s); this
test sets it to 1 s. Real relay process, shared broker and Postgres.
"""

from __future__ import annotations

import json
import time
import uuid

import psycopg
import pytest
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
)
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.kafka import base_config
from jobstream.settings import Settings
from tests.e2e.test_break_relay_refusal_order import BAD, ROWS, _insert
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.e2e


def test_a_topic_limit_lowered_while_the_relay_runs_keeps_the_key_order(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("break.lowered")
    admin = AdminClient(base_config(settings))
    wide = str(settings.kafka_message_max_bytes)
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1,
                                  config={"max.message.bytes": wide})])[topic].result(30)
    wait_for(lambda: topic in admin.list_topics(timeout=10).topics, 30, "the topic")
    relay = procs.start("relay", JOBSTREAM_RELAY_TOPIC_LIMIT_REFRESH_S="1",
                        JOBSTREAM_KAFKA_EXTRA=json.dumps({"batch.num.messages": 3}))
    with psycopg.connect(url) as conn:  # one row while the topic is wide: its limit is known
        conn.execute(Q["outbox_insert"], (topic, "job-1", json.dumps({"n": -1}).encode(),
                                          Jsonb({}), uuid.uuid4(), "test.row"))
    wait_for(lambda: len(read_topic(settings, topic)) == 1, 60, "the first row published",
             procs.logs)
    res = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[ConfigEntry(
        "max.message.bytes", "2000", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([res])[res].result(30)
    time.sleep(3)  # past the refresh (1 s) and a relay poll
    _insert(url, topic)
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE published_at IS NULL"), 90,
             "the outbox drained (good rows published, the large ones parked)", procs.logs)
    got = [json.loads(m.value())["n"] for m in read_topic(settings, topic)][1:]
    want = [i for i in range(ROWS) if i not in BAD]
    assert sorted(got) == want, f"lost or duplicated: {sorted(set(got) ^ set(want))}, {got}"
    assert got == want, f"per-key order broken: {got}"
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()
