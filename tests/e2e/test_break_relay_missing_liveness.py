"""Breaker6: a missing topic must not hold up the OTHER topics' rows while its own wait out the
missing-topic grace (``relay_missing_topic_park_s``, 300 s), with a real relay process,
Postgres and the broker.

The relay retried a missing topic's rows by failing the whole round (``DeliveryFailed``) and
backing off, doubling to ``relay_backoff_cap_s`` (30 s): the one relay of the outbox slept, so
every other topic's rows -- every other job's events -- waited up to 30 s per round, for as long
as the grace (measured with the client's default timeouts: rows of a healthy topic published
44 s, then 27-30 s after their commit while another topic was deleted). And rows of the missing
topic at the head of the outbox (one fetch's worth) kept the rows behind them from being
fetched at all. A row whose only fault is its own topic's absence waits on its own: its topic's
rows are held aside (in order) and retried on their own backoff; the rest flows.

The probe: a topic is deleted while rows of one key wait for it; once the relay's backoff has
reached 8 s, a row of a healthy topic is written and must be published within 5 s (a healthy
relay publishes it in milliseconds); then the topic is re-created and its rows must arrive once,
in outbox order, nothing parked.
"""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.kafka import base_config, topic_max_message_bytes
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.e2e

EXTRA = '{"message.timeout.ms": 3000, "topic.metadata.propagation.max.ms": 1000}'


def _insert(url: str, topic: str, ns: list[int], key: str) -> None:
    with psycopg.connect(url) as conn, conn.transaction():
        for i in ns:
            conn.execute(Q["outbox_insert"], (topic, key, json.dumps({"n": i}).encode(),
                                              Jsonb({"n": str(i)}), uuid.uuid4(), "test.row"))


def _left(url: str, topic: str) -> int:
    return int(query(url, "SELECT count(*) AS n FROM outbox WHERE topic = %s",
                     (topic,))[0]["n"])


def _create(admin: AdminClient, topic: str, config: dict[str, str]) -> None:
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1,
                                  config=config)])[topic].result(30)
    wait_for(lambda: topic in admin.list_topics(timeout=10).topics, 30, "the topic")


@pytest.mark.parametrize("limit", ["producer", "narrow"])
def test_a_missing_topic_does_not_hold_up_the_other_topics(
        settings: Settings, procs: ProcessRunner, limit: str) -> None:
    """``narrow``: the deleted topic takes smaller messages than the producer sends (its rows
    go one at a time)."""
    url = settings.database_url
    gone, healthy = settings.topic("break.gone"), settings.topic("job.failed")
    admin = AdminClient(base_config(settings))
    config = {"max.message.bytes": str(topic_max_message_bytes(settings, gone))
              if limit == "producer" else "2000"}
    _create(admin, gone, config)
    relay = procs.start("relay", JOBSTREAM_RELAY_MISSING_TOPIC_PARK_S="120",
                        JOBSTREAM_KAFKA_EXTRA=EXTRA)
    _insert(url, gone, [0], "job-1")
    wait_for(lambda: _left(url, gone) == 0, 60, "the first row published", procs.logs)
    admin.delete_topics([gone])[gone].result(30)
    wait_for(lambda: gone not in admin.list_topics(timeout=10).topics, 30, "deleted")
    _insert(url, gone, list(range(1, 1200)), "job-1")  # more than one fetch (500 rows)
    wait_for(lambda: "re-sending the undelivered rows in 8.0s" in relay.log_text()
             or "held back while it is missing" in relay.log_text(), 90,
             "delivery rounds while the topic is gone", procs.logs)
    _insert(url, healthy, [0], "other-job")
    wait_for(lambda: _left(url, healthy) == 0, 5,
             "a healthy topic's row published while another topic is missing (the relay "
             "backs off for every topic)", procs.logs, every_s=0.1)
    assert not query(url, "SELECT 1 FROM dead_letter"), "parked within the grace"
    _create(admin, gone, config)
    wait_for(lambda: _left(url, gone) == 0, 90, "the missing topic's rows delivered",
             procs.logs)
    got = [json.loads(m.value())["n"] for m in read_topic(settings, gone)]
    assert got == list(range(1, 1200)), f"lost, duplicated or reordered: {got[:50]}"
    assert [json.loads(m.value())["n"] for m in read_topic(settings, healthy)] == [0]
    assert not query(url, "SELECT 1 FROM dead_letter")
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()
