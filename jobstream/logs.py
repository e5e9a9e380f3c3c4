"""Logging: a context of who is being worked on, and an opt-in JSON formatter.

The log context (``request_id``, ``job_id``, ``tenant``, ``stage``, ``group``, ``event_type``)
lives in a context variable, set around the processing of one message or request
(:func:`log_context`); it follows ``asyncio.to_thread`` into the stage code, so every record
logged there carries it. ``trace_id`` and ``span_id`` come from :mod:`jobstream.tracing`.

``JOBSTREAM_LOG_FORMAT=json`` makes every process write one JSON object per line
(:class:`JsonFormatter`); the default ``text`` keeps the human-readable format.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from jobstream import tracing

#: The human-readable format of ``JOBSTREAM_LOG_FORMAT=text``.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
#: The context keys, in the order they appear in a JSON record.
CONTEXT_KEYS = ("request_id", "job_id", "tenant", "stage", "group", "event_type")

_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "jobstream_log_context", default=MappingProxyType({}))
# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("x", 0, "x", 0, "x", None, None))) | {
    "message", "asctime", "taskName"}


def current_context() -> dict[str, Any]:
    """The log context in force (a copy; values are never ``None``)."""
    return dict(_context.get())


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Add ``fields`` to the log context for the block (``None`` values are left out);
    the previous context is restored on exit. Values are logged with ``str()``."""
    merged = {**_context.get(), **{k: str(v) for k, v in fields.items() if v is not None}}
    token = _context.set(merged)
    try:
        yield
    finally:
        _context.reset(token)


def bind(**fields: Any) -> None:
    """Add ``fields`` to the log context of the enclosing :func:`log_context` block (for facts
    learnt inside it, e.g. the job id once the message is decoded)."""
    _context.set({**_context.get(), **{k: str(v) for k, v in fields.items() if v is not None}})


def _header_map(headers: Any) -> dict[str, str]:
    """Kafka headers (a list of ``(name, bytes)`` pairs, a dict, or ``None``) as text."""
    items = headers.items() if isinstance(headers, Mapping) else (headers or [])
    out = {}
    for k, v in items:
        if isinstance(v, bytes):
            v = v.decode("utf-8", errors="replace")
        out[str(k)] = str(v) if v is not None else ""
    return out


#: Header name -> log context key, for the headers :func:`message_scope` reads.
_SCOPE_HEADERS = {"request_id": "request_id", "job_id": "job_id", "tenant_id": "tenant",
                  "event_type": "event_type"}


class message_scope:  # noqa: N801 - used as a function (a context manager), as it was
    """The scope of processing one Kafka message: a span continuing the message's
    ``traceparent`` header (a new trace if it has none and ``start_trace``; else no span, and
    outbox rows fall back to the job's trace) and a log context from the routing headers
    (``request_id``, ``job_id``, ``tenant_id``, ``event_type``) plus ``stage`` and ``group``.
    ``headers``: a list of ``(name, bytes)`` pairs, a dict, or ``None``. ``with`` gives the
    span (or ``None``); on exit the previous span and log context are back.

    The same as ``tracing.use(span)`` inside ``log_context(...)`` with every header decoded
    (UTF-8, ``replace``; a null value as ``""``; the last of a repeated name wins), in one
    object instead of three generator context managers and a dict of every header: it runs
    once per consumed message on the workers' event loop (perf-faust9, bench/README.md)."""

    __slots__ = ("_fields", "_span", "_span_token", "_token")

    def __init__(self, headers: Any, *, stage: str | None = None, group: str | None = None,
                 start_trace: bool = False) -> None:
        items = headers.items() if isinstance(headers, Mapping) else (headers or ())
        fields: dict[str, str] = {}
        traceparent: str | None = None
        for k, v in items:
            name = str(k)
            if name == tracing.HEADER or name in _SCOPE_HEADERS:
                if isinstance(v, bytes):
                    v = v.decode("utf-8", errors="replace")
                text = str(v) if v is not None else ""
                if name == tracing.HEADER:
                    traceparent = text
                else:
                    fields[_SCOPE_HEADERS[name]] = text
        if stage is not None:
            fields["stage"] = str(stage)
        if group is not None:
            fields["group"] = str(group)
        self._fields = fields
        self._span = tracing.continue_from(traceparent, start_if_missing=start_trace)

    def __enter__(self) -> tracing.SpanContext | None:
        self._span_token = tracing.enter(self._span)
        self._token = _context.set({**_context.get(), **self._fields})
        return self._span

    def __exit__(self, *exc: object) -> None:
        _context.reset(self._token)
        tracing.leave(self._span_token)


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, one line: ``ts`` (ISO 8601, UTC, milliseconds), ``level``,
    ``logger``, ``message``, then the log context (``request_id``, ``job_id``, ``tenant``,
    ``stage``, ...), ``trace_id``/``span_id`` of the current span, fields given with
    ``extra=``, and ``exc_info``/``stack_info`` as formatted text. Values that JSON cannot
    hold are written with ``str()``; formatting never raises for odd extras."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as one line of JSON (no trailing newline)."""
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ctx = _context.get()
        out.update({k: ctx[k] for k in CONTEXT_KEYS if k in ctx})
        out.update({k: v for k, v in ctx.items() if k not in out})
        span = tracing.current()
        if span is not None:
            out["trace_id"] = span.trace_id
            out["span_id"] = span.span_id
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = _jsonable(value)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def handler(fmt: str) -> logging.Handler:
    """A stderr handler writing ``fmt`` (``json`` or ``text``). Raises ``ValueError``."""
    h = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        h.setFormatter(JsonFormatter())
    elif fmt == "text":
        h.setFormatter(logging.Formatter(TEXT_FORMAT))
    else:
        raise ValueError(f"log format must be text or json, not {fmt!r}")
    return h


def configure(level: str, fmt: str) -> None:
    """Configure the root logger: ``level`` (``info``, ...) and format ``fmt`` (``text`` or
    ``json``), replacing any handler installed before. Raises ``ValueError``."""
    root = logging.getLogger()
    root.handlers[:] = [handler(fmt)]
    root.setLevel(level.upper())


def faust_logging_config(level: str, fmt: str) -> dict[str, Any] | None:
    """``logging_config`` for a faust/mode ``Worker`` (which replaces the root handlers when
    it starts): ``None`` keeps mode's own text format; ``json`` installs
    :class:`JsonFormatter` on stderr."""
    if fmt != "json":
        return None
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "json",
                                 "stream": "ext://sys.stderr"}},
        "root": {"level": level.upper(), "handlers": ["default"]},
    }
