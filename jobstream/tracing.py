"""W3C Trace Context (``traceparent``) for Kafka headers, the HTTP API and the logs.

Source: W3C Recommendation "Trace Context" (https://www.w3.org/TR/trace-context/), §3.2. A
``traceparent`` is ``version-trace_id-parent_id-trace_flags``: 2, 32, 16 and 2 lowercase hex
digits. Version ``ff`` is invalid; an all-zero trace-id or parent-id is invalid; a version
above ``00`` may carry more fields after the flags (``-`` separated), which are ignored.

How jobstream uses it (docs/design-notes.md, "Trace context"): every process that takes an
event or a request *continues* the trace it carries (same trace-id, a new span-id of its own)
or, at the edge (intake, the API), starts one. The current span lives in a context variable
(:func:`current`), so it follows ``asyncio.to_thread`` into the stage code. Every outbox row
gets a ``traceparent`` header whose parent-id is the writing span, so all events of one job
share one trace-id (:func:`outgoing_header`).
"""

from __future__ import annotations

import contextvars
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: ``traceparent`` header / HTTP header name (lowercase, as the spec recommends for HTTP).
HEADER = "traceparent"
VERSION = "00"
SAMPLED = 0x01

_TRACEPARENT = re.compile(
    r"^(?P<version>[0-9a-f]{2})-(?P<trace_id>[0-9a-f]{32})-(?P<parent_id>[0-9a-f]{16})"
    r"-(?P<flags>[0-9a-f]{2})(?P<rest>-.*)?$")
_INVALID_TRACE_ID = "0" * 32
_INVALID_SPAN_ID = "0" * 16


@dataclass(frozen=True)
class SpanContext:
    """One span of a trace: ``trace_id`` (32 hex), this span's ``span_id`` (16 hex), the
    ``parent_id`` it continues (16 hex, ``None`` at a trace's root) and ``flags`` (0-255;
    bit 0 = sampled)."""

    trace_id: str
    span_id: str
    parent_id: str | None = None
    flags: int = SAMPLED

    def traceparent(self) -> str:
        """The ``traceparent`` naming this span as the parent (for a message it sends)."""
        return f"{VERSION}-{self.trace_id}-{self.span_id}-{self.flags:02x}"

    def child(self) -> SpanContext:
        """A new span of the same trace whose parent is this span."""
        return SpanContext(self.trace_id, new_span_id(), self.span_id, self.flags)


def new_trace_id() -> str:
    """A random, non-zero trace-id (32 lowercase hex digits, 128 bits)."""
    while (tid := secrets.token_hex(16)) == _INVALID_TRACE_ID:  # pragma: no cover - 2**-128
        pass
    return tid


def new_span_id() -> str:
    """A random, non-zero span-id (16 lowercase hex digits, 64 bits)."""
    while (sid := secrets.token_hex(8)) == _INVALID_SPAN_ID:  # pragma: no cover - 2**-64
        pass
    return sid


def parse(value: str | bytes | None) -> SpanContext | None:
    """The span a ``traceparent`` header names (its parent-id becomes ``span_id``), or
    ``None`` when absent or invalid (an invalid header is ignored, never an error: §4.3).

    Accepts ``bytes`` (Kafka header values). Surrounding whitespace is tolerated; upper-case
    hex, version ``ff``, all-zero ids, a version-00 header with extra fields and malformed
    input are rejected.
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    m = _TRACEPARENT.match(value.strip())
    if m is None:
        return None
    version, trace_id, parent_id = m["version"], m["trace_id"], m["parent_id"]
    if version == "ff" or (version == VERSION and m["rest"]):
        return None
    if trace_id == _INVALID_TRACE_ID or parent_id == _INVALID_SPAN_ID:
        return None
    return SpanContext(trace_id, parent_id, None, int(m["flags"], 16))


def start() -> SpanContext:
    """A new root span of a new trace (sampled)."""
    return SpanContext(new_trace_id(), new_span_id())


def continue_from(value: str | bytes | None, *, start_if_missing: bool = True
                  ) -> SpanContext | None:
    """The span of a process that received ``traceparent`` ``value``: a child of the span it
    names, or (absent/invalid) a new trace when ``start_if_missing``, else ``None``."""
    incoming = parse(value)
    if incoming is not None:
        return incoming.child()
    return start() if start_if_missing else None


_current: contextvars.ContextVar[SpanContext | None] = contextvars.ContextVar(
    "jobstream_span", default=None)


def current() -> SpanContext | None:
    """The span this code runs in (``None`` outside any)."""
    return _current.get()


@contextmanager
def use(span: SpanContext | None) -> Iterator[SpanContext | None]:
    """Run the block in ``span`` (``None`` clears it); restores the previous span on exit."""
    token = _current.set(span)
    try:
        yield span
    finally:
        _current.reset(token)


def enter(span: SpanContext | None) -> contextvars.Token[SpanContext | None]:
    """Make ``span`` current (``None`` clears it) until :func:`leave` with the returned token:
    :func:`use` without a generator, for a caller that enters and leaves once per message."""
    return _current.set(span)


def leave(token: contextvars.Token[SpanContext | None]) -> None:
    """Restore the span current before the :func:`enter` that returned ``token``."""
    _current.reset(token)


def outgoing_header(trace_id: str | None = None) -> str:
    """The ``traceparent`` of a message written now: its parent is the current span.

    ``trace_id``: the trace the message must belong to (the job's) when no span is current;
    a fresh trace otherwise. A current span always wins: it already continues the job's trace.
    """
    span = current()
    if span is not None:
        return span.traceparent()
    return SpanContext(trace_id or new_trace_id(), new_span_id()).traceparent()
