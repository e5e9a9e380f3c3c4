"""W3C traceparent parsing/generation and the JSON log formatter (no services)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re

import pytest

from jobstream import logs, tracing

TP = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
# The example of the W3C Recommendation, §3.2.2.
SPEC = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_parse_the_spec_example() -> None:
    span = tracing.parse(SPEC)
    assert span == tracing.SpanContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7",
                                       None, 1)
    assert tracing.parse(SPEC.encode()) == span  # Kafka header values are bytes
    assert tracing.parse(f"  {SPEC} ") == span


@pytest.mark.parametrize("value", [
    None, "", "garbage", SPEC.upper(),
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff is invalid
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace-id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero parent-id
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",   # short trace-id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",   # short flags
    SPEC + "-extra",                                            # version 00 has 4 fields
    b"\xff\xfe",
])
def test_parse_rejects_invalid_headers(value: str | bytes | None) -> None:
    assert tracing.parse(value) is None


def test_parse_accepts_a_future_version_with_more_fields() -> None:
    span = tracing.parse("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-ever")
    assert span is not None and span.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_generated_headers_are_valid_and_children_keep_the_trace() -> None:
    root = tracing.start()
    assert TP.match(root.traceparent()) and root.parent_id is None
    assert tracing.parse(root.traceparent()) == tracing.SpanContext(
        root.trace_id, root.span_id, None, 1)
    child = root.child()
    assert child.trace_id == root.trace_id and child.parent_id == root.span_id
    assert child.span_id != root.span_id
    assert len({tracing.start().trace_id for _ in range(100)}) == 100


def test_continue_from_keeps_flags_and_trace_or_starts_one() -> None:
    span = tracing.continue_from("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
    assert span is not None
    assert (span.trace_id, span.parent_id, span.flags) == (
        "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 0)
    assert span.traceparent().endswith("-00")  # not sampled upstream: not sampled here
    assert tracing.continue_from("bad", start_if_missing=False) is None
    fresh = tracing.continue_from(None)
    assert fresh is not None and fresh.parent_id is None


def test_outgoing_header_prefers_the_current_span_then_the_given_trace() -> None:
    assert tracing.current() is None
    tid = "4bf92f3577b34da6a3ce929d0e0e4736"
    assert tracing.outgoing_header(tid).split("-")[1] == tid
    span = tracing.start()
    with tracing.use(span):
        assert tracing.current() is span
        assert tracing.outgoing_header(tid) == span.traceparent()
    assert tracing.current() is None
    assert TP.match(tracing.outgoing_header())


def _record(logger: logging.Logger, fmt: logging.Formatter, fn) -> dict:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(fmt)
    logger.addHandler(h)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        fn()
    finally:
        logger.removeHandler(h)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def test_json_formatter_writes_one_object_with_context_trace_and_extras() -> None:
    log = logging.getLogger("test.json")
    span = tracing.start()

    def emit() -> None:
        with tracing.use(span), logs.log_context(request_id="r1", tenant="acme",
                                                 stage="llm", job_id=None):
            logs.bind(job_id="j-1")
            log.info("hello %s", "world", extra={"chunk": 3, "obj": object(),
                                                 "tags": ("a", 1)})

    rec = _record(log, logs.JsonFormatter(), emit)
    assert rec["message"] == "hello world" and rec["level"] == "INFO"
    assert rec["logger"] == "test.json"
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00$", rec["ts"])
    assert (rec["request_id"], rec["job_id"], rec["tenant"], rec["stage"]) == (
        "r1", "j-1", "acme", "llm")
    assert (rec["trace_id"], rec["span_id"]) == (span.trace_id, span.span_id)
    assert rec["chunk"] == 3 and rec["tags"] == ["a", 1] and rec["obj"].startswith("<object")
    assert list(rec)[:4] == ["ts", "level", "logger", "message"]


def test_json_formatter_renders_exceptions_and_leaves_no_context_behind() -> None:
    log = logging.getLogger("test.json.exc")

    def emit() -> None:
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")

    rec = _record(log, logs.JsonFormatter(), emit)
    assert rec["level"] == "ERROR" and "ValueError: boom" in rec["exc_info"]
    assert "request_id" not in rec and "trace_id" not in rec
    assert logs.current_context() == {}


def test_log_context_follows_to_thread_and_is_restored() -> None:
    async def main() -> tuple[dict, dict]:
        with logs.log_context(job_id="j-9", stage="validate"):
            inner = await asyncio.to_thread(logs.current_context)
        return inner, logs.current_context()

    inner, after = asyncio.run(main())
    assert inner == {"job_id": "j-9", "stage": "validate"} and after == {}


def test_message_scope_reads_kafka_headers() -> None:
    headers = [("request_id", b"r-7"), ("job_id", b"j-7"), ("tenant_id", b"acme"),
               ("event_type", b"job.ready"), ("traceparent", SPEC.encode())]
    with logs.message_scope(headers, group="g") as span:
        assert span is not None and span.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert span.parent_id == "00f067aa0ba902b7"
        assert logs.current_context() == {"request_id": "r-7", "job_id": "j-7",
                                          "tenant": "acme", "event_type": "job.ready",
                                          "group": "g"}
    with logs.message_scope(None) as span:
        assert span is None
    with logs.message_scope({}, start_trace=True) as span:
        assert span is not None and span.parent_id is None


def _reference_scope(headers, *, stage=None, group=None, start_trace=False):  # type: ignore[no-untyped-def]
    """message_scope as it was before perf-faust9 (three generator context managers and a
    dict of every header): the behaviour the one-object version must keep."""
    from collections.abc import Mapping
    from contextlib import ExitStack

    items = headers.items() if isinstance(headers, Mapping) else (headers or [])
    h = {}
    for k, v in items:
        if isinstance(v, bytes):
            v = v.decode("utf-8", errors="replace")
        h[str(k)] = str(v) if v is not None else ""
    span = tracing.continue_from(h.get(tracing.HEADER), start_if_missing=start_trace)
    stack = ExitStack()
    stack.enter_context(tracing.use(span))
    stack.enter_context(logs.log_context(
        request_id=h.get("request_id"), job_id=h.get("job_id"), tenant=h.get("tenant_id"),
        event_type=h.get("event_type"), stage=stage, group=group))
    return stack, span


def test_message_scope_matches_the_reference_on_random_headers() -> None:
    """Every header set (names repeated, null / non-UTF-8 / non-bytes values, dict or pairs,
    inside an outer context or not) gives the context, span and restore the reference gives;
    span ids are random, so spans compare by trace, parent and flags."""
    import random

    rng = random.Random(12)
    names = ["request_id", "job_id", "tenant_id", "event_type", "traceparent", "other",
             "retry_count", "Job_Id"]
    values: list[object] = [b"r-1", b"j-2", b"\xff\xfe", None, b"", SPEC.encode(), SPEC,
                            SPEC.upper().encode(), 7, "text", b"00-" + b"0" * 32 + b"-" + b"1" * 16
                            + b"-01"]
    for _ in range(3000):
        pairs = [(rng.choice(names), rng.choice(values)) for _ in range(rng.randint(0, 7))]
        headers: object = (dict(pairs) if rng.random() < 0.3 else pairs) if pairs or \
            rng.random() < 0.5 else None
        kw = {"stage": rng.choice([None, "llm"]), "group": rng.choice([None, "g", ""]),
              "start_trace": rng.random() < 0.5}
        outer = rng.choice([{}, {"job_id": "outer", "x": "1"}])
        with logs.log_context(**outer):
            before = (logs.current_context(), tracing.current())
            stack, want_span = _reference_scope(headers, **kw)
            with stack:
                want = logs.current_context()
                want_current = tracing.current()
            with logs.message_scope(headers, **kw) as got_span:
                got = logs.current_context()
                got_current = tracing.current()
            after = (logs.current_context(), tracing.current())

        def key(span: tracing.SpanContext | None) -> object:
            return None if span is None else (span.trace_id if span.parent_id else "root",
                                              span.parent_id, span.flags)

        assert got == want, (headers, kw)
        assert key(got_span) == key(want_span) and got_current is got_span, (headers, kw)
        assert key(want_current) == key(want_span)
        assert after == before


def test_handler_formats_and_rejects_unknown() -> None:
    assert isinstance(logs.handler("json").formatter, logs.JsonFormatter)
    assert logs.handler("text").formatter._fmt == logs.TEXT_FORMAT  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        logs.handler("xml")
    assert logs.faust_logging_config("info", "text") is None
    cfg = logs.faust_logging_config("info", "json")
    assert cfg is not None and cfg["root"]["level"] == "INFO"

