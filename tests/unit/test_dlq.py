"""The DLQ tools' pure parts: header decoding, replay headers and targets, resume points."""

from __future__ import annotations

import pytest

from jobstream.dlq import (
    REPLAYED_FROM_HEADER,
    DeadLetter,
    dlq_topic_names,
    replay_headers,
    resume_offsets,
    unreplayable_reason,
)
from jobstream.kafka import CONSUMED_TOPICS
from jobstream.settings import Settings


def _dl(headers: list[tuple[str, bytes]], value: bytes | None = b"\xffnot json at all",
        **kw: object) -> DeadLetter:
    args: dict = {"dlq_topic": "p.document.uploaded.dlq", "partition": 2, "offset": 7,
                  "timestamp_ms": 1, "key": b"k\xff", "value": value,
                  "value_size": -1 if value is None else len(value), "headers": tuple(headers)}
    args.update(kw)
    return DeadLetter(**args)


FULL = [("dlq_reason_code", b"not_json"), ("dlq_reason", b"value is not JSON"),
        ("dlq_original_topic", b"p.document.uploaded"), ("dlq_original_partition", b"1"),
        ("dlq_original_offset", b"41"), ("trace", b"abc")]


def test_headers_are_decoded_and_summarised() -> None:
    d = _dl(FULL)
    assert (d.reason_code, d.reason, d.original_topic) == (
        "not_json", "value is not JSON", "p.document.uploaded")
    assert (d.original_partition, d.original_offset) == (1, 41)
    assert d.ref == "p.document.uploaded.dlq:2:7"
    s = d.to_dict(head_bytes=4)
    assert s["key"] == "k\\xff" and s["value_head"] == "\\xffnot" and s["value_size"] == 16
    assert _dl(FULL, value=None).to_dict()["value_head"] is None


def test_missing_or_malformed_headers_read_as_none() -> None:
    d = _dl([("dlq_original_offset", b"forty-one")])
    assert d.reason_code is None and d.original_topic is None and d.original_offset is None


def test_replay_only_to_the_topic_the_dlq_belongs_to() -> None:
    assert unreplayable_reason(_dl(FULL), "p.document.uploaded") is None
    assert "no dlq_original_topic" in (unreplayable_reason(_dl([]), "p.document.uploaded") or "")
    assert "is not" in (unreplayable_reason(_dl(FULL), "q.document.uploaded") or "")


def test_replayed_copy_drops_dlq_headers_and_says_where_it_came_from() -> None:
    assert replay_headers(_dl(FULL)) == [("trace", b"abc"),
                                         (REPLAYED_FROM_HEADER, b"p.document.uploaded.dlq:2:7")]


def test_resume_point_never_passes_a_message_that_was_not_replayed() -> None:
    starts = {0: 0, 1: 5, 2: 3}
    read_to = {0: 10, 1: 9, 2: 3}
    # partition 0: offset 4 pending (skipped by a filter); 1: all done; 2: nothing read.
    assert resume_offsets(starts, read_to, {0: 4}) == {0: 4, 1: 9}
    assert resume_offsets(starts, read_to, {0: 0, 1: 5}) == {}


def test_dlq_topic_names() -> None:
    s = Settings(topic_prefix="p.")
    assert dlq_topic_names(s, "document.uploaded") == ["p.document.uploaded.dlq"]
    assert dlq_topic_names(s) == [f"p.{t}.dlq" for t in CONSUMED_TOPICS]
    with pytest.raises(ValueError):
        dlq_topic_names(s, "document.uploaded.dlq")
