"""The traceparent of outbox rows written with no span in force (sweeper, redrive)."""

from __future__ import annotations

import base64
import hashlib

import pytest

from jobstream import tracing
from jobstream.settings import Settings
from jobstream.store import Store, outbox_message
from schemas.events import (
    DocumentRef,
    DocumentUploaded,
    DocumentUploadedPayload,
    JobFailed,
    JobFailedPayload,
)
from streams.context import StageContext
from streams.intake import handle_intake
from tests.helpers import query

pytestmark = pytest.mark.integration


def _uploaded(key: str) -> DocumentUploaded:
    data = f"document {key}".encode()
    doc = DocumentRef(filename=f"{key}.txt", sha256=hashlib.sha256(data).hexdigest(),
                      size_bytes=len(data), content_b64=base64.b64encode(data).decode())
    return DocumentUploaded(tenant_id="tr", idempotency_key=key,
                            payload=DocumentUploadedPayload(document=doc))


def _failed(job: dict) -> JobFailed:
    return JobFailed(tenant_id=job["tenant_id"], idempotency_key=job["idempotency_key"],
                     job_id=job["job_id"], dedup_key=job["dedup_key"],
                     payload=JobFailedPayload(stage="llm", error_code="x", error="x"))


def _trace_of_last_row(url: str) -> str:
    row = query(url, "SELECT headers->>'traceparent' AS tp FROM outbox ORDER BY id DESC "
                     "LIMIT 1")[0]
    span = tracing.parse(row["tp"])
    assert span is not None, row
    return span.trace_id


def test_rows_written_without_a_span_use_the_jobs_trace(settings: Settings) -> None:
    url = settings.database_url
    ctx = StageContext(settings, Store(url, max_size=2))
    try:
        # Intake with no span starts the job's trace; its job.accepted row carries it.
        job_id = handle_intake(ctx, _uploaded("a")).job_id
        job = ctx.store.job(job_id)
        assert job is not None and job["trace_id"] and tracing.current() is None
        assert _trace_of_last_row(url) == job["trace_id"]

        # A row written later with no span (the sweeper's case) stays in the job's trace.
        with ctx.store.tx() as conn:
            Store.add_outbox(conn, outbox_message(settings.topic("job.failed"), _failed(job)))
        assert _trace_of_last_row(url) == job["trace_id"]

        # Under a span, the span wins (it already continues the job's trace upstream).
        span = tracing.start()
        with tracing.use(span), ctx.store.tx() as conn:
            Store.add_outbox(conn, outbox_message(settings.topic("job.failed"), _failed(job)))
        assert _trace_of_last_row(url) == span.trace_id

        # A job from before traces were recorded is given one, and keeps it.
        query(url, "UPDATE job SET trace_id = NULL WHERE job_id = %s RETURNING 1", (job_id,))
        given = []
        for _ in range(2):
            with ctx.store.tx() as conn:
                Store.add_outbox(conn, outbox_message(settings.topic("job.failed"),
                                                      _failed(job)))
            stored = query(url, "SELECT trace_id FROM job WHERE job_id = %s", (job_id,))[0]
            assert stored["trace_id"] and _trace_of_last_row(url) == stored["trace_id"]
            given.append(stored["trace_id"])
        assert given[0] == given[1] != job["trace_id"]
    finally:
        ctx.store.close()
