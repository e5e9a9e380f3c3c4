"""flakes10: the relay when it cannot learn a narrow topic's ``max.message.bytes``.

``test_relay_killed_mid_one_row_sends_loses_nothing_and_keeps_order``
(tests/e2e/test_break_narrow_missing.py) once broke a key's order under load. The cause: a
restarted relay's AdminClient did not answer ``describe_configs`` within its 2 s, and a topic
whose limit is unknown counted as *wide*: its rows were batched up to the producer's
``message.max.bytes``, the broker refused a batch holding one large row while later batches of
the partition went through, and the batch-mates re-sent alone landed after them. Here the
AdminClient is made absent (pointed at a closed port: every ``describe_configs`` times out),
with real Kafka and Postgres: the rows of one key, some of them too large for the topic, must
arrive in outbox order and the large ones alone be parked.
"""

from __future__ import annotations

import contextlib
import json

import pytest
from confluent_kafka.admin import AdminClient

from jobstream.db import connect as db_connect
from jobstream.kafka import base_config
from jobstream.settings import Settings
from outbox_relay.relay import DeliveryFailed, OutboxRelay
from tests.e2e.test_break_narrow_missing import LIMIT, _insert, _unpublished
from tests.helpers import create_limited_topic, query, read_topic, wait_for

pytestmark = pytest.mark.integration


def _small_batches(settings: Settings) -> Settings:
    """``settings`` with small record batches (3 rows, ~1 KB: under the topic's limit unless
    a large row is in one), as test_topic_recreated_narrower_within_the_grace_keeps_the_key_order
    has them, so a refused batch has later batches of the partition in flight behind it."""
    return settings.model_copy(
        update={
            "kafka_extra": {
                **settings.kafka_extra,
                "message.timeout.ms": 5000,
                "batch.num.messages": 3,
            }
        }
    )


def test_a_narrow_topic_whose_limit_is_unknown_keeps_the_key_order(settings: Settings) -> None:
    url, topic = settings.database_url, settings.topic("limit.unknown")
    create_limited_topic(AdminClient(base_config(settings)), topic, LIMIT)
    big = {5, 20, 21, 41}
    _insert(url, topic, list(range(60)), big)
    relay = OutboxRelay(_small_batches(settings))
    # The AdminClient that asks max.message.bytes never answers (as one that misses its 2 s
    # under load, or a broker that does not allow DescribeConfigs).
    relay._admin = AdminClient(
        {"bootstrap.servers": "127.0.0.1:1", "reconnect.backoff.max.ms": 1000, "log_level": 0}
    )
    with db_connect(url, autocommit=True) as conn:

        def drained() -> bool:
            with contextlib.suppress(DeliveryFailed):  # retried: the loop backs off
                relay.publish_batch(conn)
            return _unpublished(url) == 0

        wait_for(drained, 120, "the outbox drained")
    assert relay._topic_limits.get(topic, (None,))[0] is None, "the limit became known"
    got = [json.loads(m.value())["n"] for m in read_topic(settings, topic)]
    want = [i for i in range(60) if i not in big]
    assert sorted(set(got)) == want, f"lost: {sorted(set(want) - set(got))}; got {got}"
    firsts = list(dict.fromkeys(got))
    assert firsts == want, f"per-key order broken: {got}"
    parked = query(url, "SELECT outbox_id FROM dead_letter ORDER BY outbox_id")
    assert len(parked) == len(big), parked


def test_a_narrow_topics_limit_lowered_while_the_admin_client_cannot_answer_keeps_the_key_order(
        settings: Settings) -> None:
    """robust11: a narrow topic whose limit the relay KNOWS (6,000 bytes), lowered to 2,000
    (``kafka-configs --alter``) while the AdminClient cannot answer: the per-batch ask
    (breaker6) gets no answer, and the relay used to keep the limit it knew, batching under
    the stale one, so the broker refused a batch for one large row while later batches of the
    partition went through. Every row the topic takes must arrive once and in outbox order,
    only the rows over the new limit parked."""
    from tests.e2e import test_break_relay_narrow_lowered as lowered
    from tests.helpers import set_topic_config

    url, topic = settings.database_url, settings.topic("limit.stale")
    was, now, rows, big = lowered.WAS, lowered.NOW, lowered.ROWS, lowered.BIG
    create_limited_topic(AdminClient(base_config(settings)), topic, was)
    relay = OutboxRelay(_small_batches(settings))
    with db_connect(url, autocommit=True) as conn:

        def drained() -> bool:
            with contextlib.suppress(DeliveryFailed):  # retried: the loop backs off
                relay.publish_batch(conn)
            return _unpublished(url) == 0

        _insert(url, topic, [-1])
        wait_for(drained, 60, "the first row published")
        assert relay._topic_limits[topic][0] == was, relay._topic_limits
        set_topic_config(settings, topic, "max.message.bytes", str(now))
        relay._admin = AdminClient(
            {"bootstrap.servers": "127.0.0.1:1", "reconnect.backoff.max.ms": 1000, "log_level": 0}
        )
        # Rows of one key, the BIG ones over the new limit and under the old one.
        lowered._insert(url, topic, range(rows))
        wait_for(drained, 120, "the outbox drained")
    got = [json.loads(m.value())["n"] for m in read_topic(settings, topic)]
    want = [-1] + [i for i in range(rows) if i not in big]
    assert sorted(set(got)) == want, f"lost: {sorted(set(want) - set(got))}; got {got}"
    assert list(dict.fromkeys(got)) == want, f"per-key order broken: {got}"
    parked = query(url, "SELECT outbox_id FROM dead_letter ORDER BY outbox_id")
    assert len(parked) == len(big), parked

