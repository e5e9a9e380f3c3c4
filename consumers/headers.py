"""Reading a consumed message's headers safely, and the headers of a dead letter."""

from __future__ import annotations

import gc
from typing import cast

from confluent_kafka import Message

#: Header standing for the headers of a message confluent-kafka cannot read (see
#: :func:`read_headers`); its value says why.
HEADERS_UNREADABLE = "headers_unreadable"


def read_headers(msg: Message) -> list[tuple[str, bytes | None]]:
    """A consumed message's headers as ``(name, value)`` pairs. Call it ONCE per message.

    A header name that is not UTF-8 makes confluent-kafka's ``Message.headers()`` raise
    ``SystemError`` and leave a broken list behind that crashes the process (SIGSEGV) on the
    next call. Such a message's headers are unreadable: they become the one header
    :data:`HEADERS_UNREADABLE` (with the error); key and value are unaffected.
    """
    try:
        # A consumed message's headers are a list of pairs (a dict only goes to produce()).
        raw = cast("list[tuple[str, bytes | None]]", msg.headers() or [])
        # Sometimes the call returns normally: the list then holds a (NULL, value) tuple that
        # crashes whoever reads it, and a UnicodeDecodeError is left pending. A NULL slot is
        # invisible to gc.get_referents (tuples skip it), so it is found without touching it;
        # the C calls made here, inside the try, raise the pending error if there is one.
        if any(len(gc.get_referents(t)) != 2 for t in raw):
            raise ValueError("a header name is not UTF-8")
        return [(str(k), v) for k, v in raw]
    except Exception as exc:  # SystemError / UnicodeDecodeError from the C extension
        return [(HEADERS_UNREADABLE,
                 f"{type(exc).__name__}: {exc}"[:500].encode("utf-8", "backslashreplace"))]


def dlq_headers(reason_code: str, reason: str, topic: str, partition: int,
                offset: int, group: str) -> dict[str, bytes]:
    """Headers of a dead-lettered message: the reason (``dlq_reason_code``, ``dlq_reason``,
    at most 2000 characters), where it came from (original topic, partition, offset) and which
    consumer group dead-lettered it (``dlq_consumer_group``: with several groups on one topic,
    one bad message is dead-lettered once per group)."""
    return {
        "dlq_consumer_group": group.encode(),
        "dlq_reason_code": reason_code.encode(),
        "dlq_reason": reason[:2000].encode(),
        "dlq_original_topic": topic.encode(),
        "dlq_original_partition": str(partition).encode(),
        "dlq_original_offset": str(offset).encode(),
    }
