"""Submitting with a producer the caller keeps (jobstream.producer.submit_producer): the way a
submitting service sends, without a new idempotent producer's ~0.5 s wait per call."""

from __future__ import annotations

import json

import pytest

from jobstream.producer import submit, submit_producer
from jobstream.settings import Settings
from tests.helpers import read_topic, text_uploaded

pytestmark = pytest.mark.integration


def test_one_kept_producer_delivers_every_submit_once(settings: Settings) -> None:
    producer = submit_producer(settings)
    first = [text_uploaded(f"key-{i}", f"document {i}") for i in range(3)]
    second = [text_uploaded(f"key-{i}", f"document {i}") for i in range(3, 5)]
    submit(settings, first, producer=producer)
    assert len(producer) == 0  # submit() returns once every message was acknowledged
    submit(settings, second, producer=producer)
    assert len(producer) == 0
    got = read_topic(settings, settings.topic("document.uploaded"))
    keys = [m.key().decode() for m in got]
    assert sorted(keys) == [f"key-{i}" for i in range(5)]  # each once, none lost
    for m in got:
        assert json.loads(m.value())["idempotency_key"] == m.key().decode()
