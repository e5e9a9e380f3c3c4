"""Breaker5: the relay's one-row path for a narrow topic (max.message.bytes below the
producer's message.max.bytes) against a missing topic and a killed relay, from outside with
a real relay process, Postgres and the broker.

A: a narrow topic is deleted, rows of ONE key (one too large for the topic) are written while
   it is gone, and it is re-created (narrow again) within the missing-topic grace: the good
   rows must be delivered once, in outbox order; only the large row parked (as too large, not
   as a missing topic).
B: the relay is SIGKILLed (twice) while it sends a narrow topic's rows one at a time: no row
   lost, the key's order kept (a duplicate allowed: at-least-once), nothing parked.
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
from tests.helpers import ProcessRunner, create_limited_topic, query, read_topic, wait_for

pytestmark = pytest.mark.e2e

LIMIT = 2000
EXTRA = '{"message.timeout.ms": 3000, "topic.metadata.propagation.max.ms": 1000}'


def _insert(url: str, topic: str, ns: list[int], big: set[int] = frozenset()) -> None:
    with psycopg.connect(url) as conn, conn.transaction():
        for i in ns:
            pad = base64.b64encode(os.urandom(4000 if i in big else 60)).decode()
            conn.execute(Q["outbox_insert"], (topic, "job-1", json.dumps(
                {"n": i, "pad": pad}).encode(), Jsonb({"n": i}), uuid.uuid4(), "test.row"))


def _unpublished(url: str) -> int:
    return int(query(url, "SELECT count(*) AS n FROM outbox WHERE published_at IS NULL")[0]["n"])


def _create(admin: AdminClient, topic: str) -> None:
    create_limited_topic(admin, topic, LIMIT)


def test_narrow_topic_deleted_and_recreated_within_the_grace(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("break.narrowgone")
    admin = AdminClient(base_config(settings))
    _create(admin, topic)
    relay = procs.start("relay", JOBSTREAM_RELAY_MISSING_TOPIC_PARK_S="120",
                        JOBSTREAM_KAFKA_EXTRA=EXTRA)
    _insert(url, topic, [0])
    wait_for(lambda: _unpublished(url) == 0, 60, "the first row published", procs.logs)
    assert f"topic {topic} takes messages up to {LIMIT}" in relay.log_text()
    admin.delete_topics([topic])[topic].result(30)
    wait_for(lambda: topic not in admin.list_topics(timeout=10).topics, 30, "deleted")
    big = {7}
    _insert(url, topic, list(range(1, 20)), big)
    wait_for(lambda: relay.log_text().count("re-sending the undelivered rows") >= 3, 60,
             "delivery rounds while the topic is gone", procs.logs)
    assert not query(url, "SELECT 1 FROM dead_letter"), "parked within the grace"
    _create(admin, topic)
    _insert(url, topic, list(range(20, 30)))
    wait_for(lambda: _unpublished(url) == 0, 90, "the outbox drained", procs.logs)
    got = [json.loads(m.value())["n"] for m in read_topic(settings, topic)]
    want = [i for i in range(1, 30) if i not in big]
    assert sorted(set(got)) == want, f"lost: {sorted(set(want) - set(got))}; got {got}"
    assert got == want, f"order broken or duplicates: {got}"
    parked = query(url, "SELECT kafka_key, dlq_error FROM dead_letter")
    assert len(parked) == 1 and "does not exist" not in parked[0]["dlq_error"], parked
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()


def test_relay_killed_mid_one_row_sends_loses_nothing_and_keeps_order(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("break.narrowkill")
    admin = AdminClient(base_config(settings))
    _create(admin, topic)
    total = n = 4000
    _insert(url, topic, list(range(n)))
    # The narrow path batches since issue 12's fifth pass (~30k rows/s): small fetches and
    # a small window keep the three kills mid-drain (4,000 rows drained before the third).
    slow = {"JOBSTREAM_RELAY_BATCH_SIZE": "20", "JOBSTREAM_RELAY_MAX_IN_FLIGHT": "40"}
    for _ in range(3):
        relay = procs.start("relay", JOBSTREAM_KAFKA_EXTRA=EXTRA, **slow)
        wait_for(lambda left=n: _unpublished(url) < left - min(300, left // 3), 90,
                 "some rows published", procs.logs, every_s=0.02)
        procs.kill9(relay)
        n = _unpublished(url)
        print(f"killed with {n} left")
    assert n > 0, "drained before the kills: probe too small"
    relay = procs.start("relay", JOBSTREAM_KAFKA_EXTRA=EXTRA)
    wait_for(lambda: _unpublished(url) == 0, 120, "the outbox drained", procs.logs)
    got = [json.loads(m.value())["n"] for m in read_topic(settings, topic)]
    lost = sorted(set(range(total)) - set(got))
    assert not lost and sorted(set(got)) == list(range(total)), f"lost: {lost[:50]}"
    firsts = list(dict.fromkeys(got))
    bad = [(a, b) for a, b in zip(firsts, firsts[1:], strict=False) if b != a + 1]
    assert not bad, f"per-key order broken (first deliveries): {bad[:20]}"
    assert not query(url, "SELECT 1 FROM dead_letter"), "parked"
    print(f"duplicates: {len(got) - total}")


def test_topic_recreated_narrower_within_the_grace_keeps_the_key_order(
        settings: Settings, procs: ProcessRunner) -> None:
    """C: a wide topic (the producer's limit) is deleted and re-created NARROW (2000 bytes)
    within the grace, rows of one key with large ones among them written meanwhile. The relay
    saw the topic go missing; the re-created topic is a new topic whose limit it knows nothing
    of -- if it keeps the old (wide) limit until relay_topic_limit_refresh_s, it batches, the
    broker refuses a batch with a large row, and the batch-mates re-sent alone land after later
    batches (per-key order broken)."""
    from jobstream.kafka import topic_max_message_bytes
    url, topic = settings.database_url, settings.topic("break.renarrow")
    admin = AdminClient(base_config(settings))
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1, config={
        "max.message.bytes": str(topic_max_message_bytes(settings, topic))})])[topic].result(30)
    wait_for(lambda: topic in admin.list_topics(timeout=10).topics, 30, "the topic")
    relay = procs.start("relay", JOBSTREAM_RELAY_MISSING_TOPIC_PARK_S="120",
                        JOBSTREAM_KAFKA_EXTRA='{"message.timeout.ms": 3000, '
                        '"topic.metadata.propagation.max.ms": 1000, "batch.num.messages": 3}')
    _insert(url, topic, [0])
    wait_for(lambda: _unpublished(url) == 0, 60, "the first row published", procs.logs)
    admin.delete_topics([topic])[topic].result(30)
    wait_for(lambda: topic not in admin.list_topics(timeout=10).topics, 30, "deleted")
    big = {5, 20, 21, 41}
    _insert(url, topic, list(range(1, 60)), big)
    wait_for(lambda: relay.log_text().count("re-sending the undelivered rows") >= 2, 60,
             "delivery rounds while the topic is gone", procs.logs)
    _create(admin, topic)  # narrow now
    wait_for(lambda: _unpublished(url) == 0, 90, "the outbox drained", procs.logs)
    got = [json.loads(m.value())["n"] for m in read_topic(settings, topic)]
    want = [i for i in range(1, 60) if i not in big]
    assert sorted(set(got)) == want, f"lost: {sorted(set(want) - set(got))}; got {got}"
    assert got == want, f"per-key order broken or duplicates: {got}"
    assert len(query(url, "SELECT 1 FROM dead_letter")) == len(big)
