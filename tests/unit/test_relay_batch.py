"""OutboxRelay.publish_batch with a fake connection and producer (no services needed): rows
go out as they are, non-string header values are stringified, and a row is deleted (its
outbox_published record kept) only after its delivery succeeded. The relay's failure paths
with a real broker are in tests/integration/test_relay_isolation.py."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from jobstream.db import QUERIES as Q
from jobstream.settings import Settings
from outbox_relay.relay import DeliveryFailed, OutboxRelay, id_array, relay_topic_wait


class FakeConn:
    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = rows
        self.executed: list[tuple[str, Any]] = []

    @contextmanager
    def transaction(self) -> Any:
        yield

    @contextmanager
    def cursor(self, **_: Any) -> Any:
        conn = self

        class Cur:
            result: list[tuple[Any, ...]] = []

            def execute(self, q: str, params: Any) -> Any:
                conn.executed.append((q, params))
                if q == Q["outbox_fetch_after"]:  # unpublished rows after an id
                    after, limit = params
                    self.result = [r for r in conn.rows if r[0] > after][:limit]
                elif q == Q["outbox_delete_and_fetch"]:  # no late rows in these tests
                    self.result = [r for r in conn.rows if r[0] > params["hwm"]][:params["n"]]
                else:
                    self.result = []
                return self

            def fetchall(self) -> list[tuple[Any, ...]]:
                return self.result

        yield Cur()

    def execute(self, q: str, params: Any = None) -> None:
        self.executed.append((q, params))


class FakeProducer:
    def __init__(self, fail: bool = False, fail_keys: tuple[str, ...] = ()) -> None:
        self.sent: list[dict[str, Any]] = []
        self.fail = fail
        self.fail_keys = fail_keys
        self._cbs: list[Any] = []

    def produce(self, topic: str, *, value: bytes, key: str, headers: dict[str, str],
                on_delivery: Any) -> None:
        if any(not isinstance(v, str) for v in headers.values()):
            raise TypeError("expected header value to be None, binary, or unicode string")
        self.sent.append({"topic": topic, "value": value, "key": key, "headers": headers})
        self._cbs.append((key, on_delivery))

    def poll(self, _t: float) -> int:
        return 0

    def list_topics(self, timeout: float) -> Any:
        """The relay asks whether a failed row's topic exists: no answer (not missing)."""
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    def flush(self, _t: float) -> int:
        for key, cb in self._cbs:
            failed = self.fail or key in self.fail_keys
            cb(KafkaError(KafkaError._MSG_TIMED_OUT) if failed else None, None)
        self._cbs.clear()
        return 0


def _relay(producer: FakeProducer) -> OutboxRelay:
    relay = OutboxRelay(Settings(kafka_bootstrap_servers="127.0.0.1:1"))
    relay._producer = producer  # type: ignore[assignment]
    # Topic "t" is wide (its limit is the producer's, known and never asked again): its rows
    # are batched. With no broker to tell, its limit would be unknown and its rows would go
    # one at a time (flakes10, tests/integration/test_relay_limit_unknown.py).
    relay._topic_limits["t"] = (relay.settings.kafka_message_max_bytes, float("inf"))
    return relay


ROWS = [(1, "t", "k1", b"v1", {"event_id": "e1", "schema_version": "1"}, "job.ready"),
        (2, "t", "k2", b"v2", {"event_id": "e2", "schema_version": 1}, "job.ready")]


def _deleted(conn: FakeConn) -> list[list[int]]:
    """The ids of every delete the relay ran (alone, or with a fetch)."""
    return [[int(i) for i in p["ids"].strip("{}").split(",")] for q, p in conn.executed
            if q in (Q["outbox_delete_published"], Q["outbox_delete_and_fetch"])
            and p["ids"] != "{}"]


def test_rows_are_sent_in_order_then_deleted() -> None:
    conn, producer = FakeConn(ROWS), FakeProducer()
    assert _relay(producer).publish_batch(conn) == 2  # type: ignore[arg-type]
    assert [m["key"] for m in producer.sent] == ["k1", "k2"]
    assert producer.sent[1]["headers"] == {"event_id": "e2", "schema_version": "1"}
    assert conn.executed[-1][0] == Q["outbox_delete_published"]
    assert _deleted(conn) == [[1, 2]]


def test_nothing_is_deleted_when_a_delivery_failed() -> None:
    conn, producer = FakeConn(ROWS), FakeProducer(fail=True)
    with pytest.raises(DeliveryFailed):
        _relay(producer).publish_batch(conn)  # type: ignore[arg-type]
    assert _deleted(conn) == []


def test_delivered_rows_are_deleted_when_another_failed_retriably() -> None:
    conn, producer = FakeConn(ROWS), FakeProducer(fail_keys=("k1",))
    with pytest.raises(DeliveryFailed):
        _relay(producer).publish_batch(conn)  # type: ignore[arg-type]
    assert _deleted(conn) == [[2]]


def test_relay_topic_wait_default_and_kafka_extra_wins() -> None:
    """The relay's producers wait 3 s (not librdkafka's 30 s) for a topic the broker does not
    know, unless JOBSTREAM_KAFKA_EXTRA sets it (the missing-topic probes pass their own)."""
    s = Settings(kafka_bootstrap_servers="127.0.0.1:1")
    assert relay_topic_wait(s) == {"topic.metadata.propagation.max.ms": 3000}
    s = Settings(kafka_bootstrap_servers="127.0.0.1:1",
                 kafka_extra={"topic.metadata.propagation.max.ms": 500})
    assert relay_topic_wait(s) == {}


def test_id_array_is_a_postgres_array_literal() -> None:
    assert id_array([]) == "{}"
    assert id_array([3, 1, 2**62]) == f"{{3,1,{2**62}}}"
