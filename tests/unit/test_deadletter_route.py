"""The shared routing decisions of jobstream.deadletter (no services): which failures are
poison, transient or bugs, the identical-failure counter, and text made safe for Postgres."""

from __future__ import annotations

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException

from jobstream.deadletter import FailureCounter, classify, safe_text
from jobstream.errors import IdempotencyConflict, OutcomeUnknown, PoisonMessage, RetryableError
from jobstream.settings import Settings


@pytest.mark.parametrize(("exc", "expected"), [
    (PoisonMessage("x", code="schema_violation"), ("poison", "schema_violation")),
    (IdempotencyConflict("x"), ("poison", "idempotency_key_conflict")),
    (psycopg.errors.NumericValueOutOfRange("x"), ("poison", "invalid_data")),
    (psycopg.DataError("x"), ("poison", "invalid_data")),
    ("\ud800".encode, ("poison", "invalid_data")),
    (RetryableError("x", code="db_unavailable"), ("transient", "db_unavailable")),
    (OutcomeUnknown("x"), ("transient", "outcome_unknown")),
    (psycopg.OperationalError("x"), ("transient", "db_unavailable")),
    (KafkaException(KafkaError(KafkaError._TRANSPORT, "down", retriable=True)),
     ("transient", "kafka_unavailable")),
    (KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)), ("bug", "unhandled")),
    (ValueError("x"), ("bug", "unhandled")),
])
def test_classify(exc: object, expected: tuple[str, str]) -> None:
    if callable(exc):  # raise a real UnicodeEncodeError
        try:
            exc()
        except UnicodeEncodeError as real:
            exc = real
    assert classify(exc) == expected  # type: ignore[arg-type]


def test_failure_counter_counts_only_identical_errors_in_a_row() -> None:
    c = FailureCounter()
    pos = ("t", 0, 5)
    assert [c.record(pos, ValueError("a")) for _ in range(3)] == [1, 2, 3]
    assert c.record(pos, ValueError("b")) == 1
    assert c.record(("t", 1, 5), ValueError("b")) == 1
    c.forget(pos)
    assert c.record(pos, ValueError("b")) == 1


def test_safe_text_escapes_nul_and_surrogates_and_cuts() -> None:
    assert safe_text("a\x00b\ud800c") == "a\\x00b\\ud800c"
    assert len(safe_text("x" * 5000)) == 2000


def test_settings_refuse_an_inline_limit_that_does_not_fit_a_message() -> None:
    with pytest.raises(ValueError, match="kafka_message_max_bytes"):
        Settings(kafka_message_max_bytes=1_000_000, max_inline_document_bytes=1_000_000)
    Settings(kafka_message_max_bytes=1_048_576, max_inline_document_bytes=700_000)
