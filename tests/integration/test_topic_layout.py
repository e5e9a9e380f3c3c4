"""The topics ``jobstream topics`` creates on the broker (issue 12): each stage's ``.retry``
topic has ``retry_topic_partitions`` partitions (a slow path that every stage worker would
otherwise decode ``topic_partitions`` empty partitions of in every fetch), the others
``topic_partitions``."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient

from jobstream.kafka import all_topics, base_config
from jobstream.settings import Settings

pytestmark = pytest.mark.integration


def test_retry_topics_have_their_own_partition_count(settings: Settings) -> None:
    md = AdminClient(base_config(settings)).list_topics(timeout=10).topics
    counts = {t: len(md[t].partitions) for t in all_topics(settings)}
    retry = {t: n for t, n in counts.items() if t.endswith(".retry")}
    others = {t: n for t, n in counts.items() if not t.endswith(".retry")}
    assert retry and set(retry.values()) == {settings.retry_topic_partitions}
    assert set(others.values()) == {settings.topic_partitions}
    assert settings.retry_topic_partitions != settings.topic_partitions  # the test can fail
