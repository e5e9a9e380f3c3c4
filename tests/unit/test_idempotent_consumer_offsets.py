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

    def error(self) -> None:  # a readable message
        return None

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


def test_apply_lanes_split_by_partition_and_store_every_offset_from_the_run_thread() -> None:
    """``apply_lanes`` 2: a batch's parts hold one lane's partitions each, in delivery order;
    the lane thread applies its part, and only the calling (run) thread stores offsets: the
    lane's after its part was applied, after the ``after_apply`` hook; a revoked partition's
    offset is skipped."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    events: list[tuple[str, Any]] = []
    fake = FakeConsumer(revoked={3})
    store = fake.store_offsets

    def store_offsets(*, message: Msg) -> None:
        events.append(("store", (threading.current_thread().name, message.partition())))
        store(message=message)

    fake.store_offsets = store_offsets  # type: ignore[method-assign]
    c = _consumer(fake)
    c.settings = c.settings.model_copy(update={"apply_lanes": 2, "apply_lanes_min_batch": 2})
    parts: list[tuple[str, list[tuple[int, int]]]] = []

    def process_batch(msgs: list[Msg]) -> list[str]:
        parts.append((threading.current_thread().name, [(m.p, m.off) for m in msgs]))
        events.append(("applied", threading.current_thread().name))
        return ["applied"] * len(msgs)

    c.process_batch = process_batch  # type: ignore[assignment]
    c.hooks.after_apply = lambda: events.append(("after_apply", None))
    msgs = [Msg(0, 1), Msg(1, 1), Msg(2, 1), Msg(3, 1), Msg(0, 2), Msg(1, 2), Msg(3, 2)]
    with ThreadPoolExecutor(1, initializer=c._lane_start, thread_name_prefix="apply-t") as lanes:
        assert c._apply_lanes(msgs, lanes) is True  # type: ignore[arg-type]
    me = threading.current_thread().name
    assert sorted(parts) == sorted([(me, [(0, 1), (2, 1), (0, 2)]),
                                    ("apply-t_0", [(1, 1), (3, 1), (1, 2), (3, 2)])])
    assert sorted(fake.stored) == [(0, 2), (1, 2), (2, 1)]
    assert {who for kind, (who, _) in [e for e in events if e[0] == "store"]} == {me}
    # the lane's offsets (partitions 1, 3) are stored after its part and after the hook
    first_lane_store = next(i for i, e in enumerate(events)
                            if e[0] == "store" and e[1][1] in (1, 3))
    assert ("applied", "apply-t_0") in events[:first_lane_store]
    assert events[first_lane_store - 1] == ("after_apply", None)
