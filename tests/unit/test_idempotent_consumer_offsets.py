"""Offsets of a batch: the last message per partition is stored; a partition revoked while
the batch was fetched is skipped instead of crashing the consumer (no services needed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from consumers.idempotent import IdempotentConsumer
from jobstream.ready_applier import idempotent_consumer
from jobstream.settings import Settings


@dataclass
class Msg:
    """The part of a confluent-kafka Message the offset code reads."""

    p: int
    off: int

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return self.p

    def offset(self) -> int:
        return self.off


@dataclass
class FakeConsumer:
    """store_offsets fails like librdkafka for partitions in ``revoked`` (or with ``error``)."""

    revoked: set[int]
    error: int = KafkaError._STATE
    stored: list[tuple[int, int]] = field(default_factory=list)

    def store_offsets(self, *, message: Msg) -> None:
        if message.partition() in self.revoked:
            raise KafkaException(KafkaError(self.error))
        self.stored.append((message.partition(), message.offset()))

    def close(self) -> None:
        pass


def _consumer(fake: FakeConsumer) -> IdempotentConsumer:
    c = idempotent_consumer(Settings(kafka_bootstrap_servers="127.0.0.1:1"), group="g",
                           topics=["t"], event_types=("job.ready",),
                           handler=lambda conn, ev: None)
    c._consumer.close()
    c._consumer = fake  # type: ignore[assignment]
    c.process_batch = lambda msgs: ["applied"] * len(msgs)  # type: ignore[method-assign]
    return c


def test_the_last_offset_per_partition_is_stored_and_a_revoked_one_skipped() -> None:
    fake = FakeConsumer(revoked={1})
    c = _consumer(fake)
    assert c._apply([Msg(0, 5), Msg(1, 7), Msg(0, 6), Msg(2, 1)]) is True  # type: ignore[list-item]
    assert sorted(fake.stored) == [(0, 6), (2, 1)]


def test_other_offset_errors_still_raise() -> None:
    fake = FakeConsumer(revoked={0}, error=KafkaError._INVALID_ARG)
    c = _consumer(fake)
    with pytest.raises(KafkaException):
        c._apply([Msg(0, 5), Msg(0, 6)])  # type: ignore[list-item]


def test_a_single_message_takes_the_per_message_path(monkeypatch: Any) -> None:
    fake = FakeConsumer(revoked={3})
    c = _consumer(fake)
    monkeypatch.setattr(c, "process", lambda m: "applied")
    assert c._one_by_one([Msg(3, 9), Msg(4, 2)]) is True  # type: ignore[list-item]
    assert fake.stored == [(4, 2)]
