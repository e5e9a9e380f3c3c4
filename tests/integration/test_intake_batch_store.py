"""Intake batches on real Postgres (issue 12): many intents in ONE transaction, each still
idempotent, and a row Postgres refuses in the middle costs only its own intent."""

from __future__ import annotations

import base64
import dataclasses
import hashlib

import psycopg
import pytest

from jobstream.errors import IdempotencyConflict, PoisonMessage
from jobstream.settings import Settings
from jobstream.store import IntakeResult, Store
from schemas.events import DocumentRef, DocumentUploaded, DocumentUploadedPayload
from streams.context import StageContext
from streams.intake import intake_intent
from tests.helpers import query

pytestmark = pytest.mark.integration


def _uploaded(key: str, text: str) -> DocumentUploaded:
    data = text.encode()
    doc = DocumentRef(filename=f"{key}.txt", sha256=hashlib.sha256(data).hexdigest(),
                      size_bytes=len(data), content_b64=base64.b64encode(data).decode())
    return DocumentUploaded(tenant_id="acme", idempotency_key=key,
                            payload=DocumentUploadedPayload(document=doc))


def test_one_transaction_for_the_batch_and_a_refused_row_loses_only_itself(
        settings: Settings) -> None:
    ctx = StageContext(settings, Store(settings.database_url, max_size=2))
    try:
        good = [intake_intent(ctx, _uploaded(f"k{i}", f"document {i}")) for i in range(5)]
        # Postgres itself refuses these rows mid-batch, after the document row of each was
        # written in its savepoint: a CHECK violation (lane) and text with a NUL.
        bad_lane = intake_intent(ctx, _uploaded("bad-lane", "refused by a CHECK"))
        bad_lane = dataclasses.replace(bad_lane, job={**bad_lane.job, "lane": "bogus"})
        bad_nul = intake_intent(ctx, _uploaded("bad-nul", "refused: NUL"))
        bad_nul = dataclasses.replace(bad_nul, job={**bad_nul.job, "filename": "a\x00b"})
        again = intake_intent(ctx, _uploaded("k1", "document 1"))      # same key, same body
        reused = intake_intent(ctx, _uploaded("k9", "document 2"))     # other key, same doc
        conflict = intake_intent(ctx, _uploaded("k3", "another body"))  # key reused
        batch = [good[0], good[1], bad_lane, good[2], again, bad_nul, reused, good[3],
                 conflict, good[4]]

        out = ctx.store.intake_batch(batch)

        assert len(out) == len(batch)
        created = [r for r in out if isinstance(r, IntakeResult) and r.created]
        assert len(created) == 5
        assert isinstance(out[2], psycopg.errors.CheckViolation), out[2]
        assert isinstance(out[5], PoisonMessage) and out[5].code == "invalid_data", out[5]
        assert isinstance(out[8], IdempotencyConflict), out[8]
        assert isinstance(out[4], IntakeResult) and isinstance(out[1], IntakeResult)
        assert out[4].job_id == out[1].job_id and out[4].dedup == "replayed"
        assert isinstance(out[6], IntakeResult) and isinstance(out[3], IntakeResult)
        assert out[6].job_id == out[3].job_id and out[6].dedup == "reused"

        url = settings.database_url
        jobs = query(url, "SELECT idempotency_key, created_at FROM job")
        assert sorted(j["idempotency_key"] for j in jobs) == [f"k{i}" for i in range(5)]
        # ONE transaction: every job has the same transaction timestamp.
        assert len({j["created_at"] for j in jobs}) == 1
        # Each job with its checkpoint and its job.accepted outbox row; nothing of the refused
        # rows (their documents rolled back with their savepoints).
        assert query(url, "SELECT count(*) AS n FROM job_stage WHERE stage = 'intake'"
                     )[0]["n"] == 5
        assert query(url, "SELECT count(*) AS n FROM outbox WHERE event_type = 'job.accepted'"
                     )[0]["n"] == 5
        assert query(url, "SELECT count(*) AS n FROM document")[0]["n"] == 5
        assert sorted(r["idempotency_key"] for r in query(
            url, "SELECT idempotency_key FROM job_request")) == sorted(
            [f"k{i}" for i in range(5)] + ["k9"])

        # The whole batch again (a redelivery after a crash before the offset commit): no new
        # job, no new outbox row, the same answers.
        out2 = ctx.store.intake_batch(batch)
        assert [r.job_id for r in out2 if isinstance(r, IntakeResult)] == [
            r.job_id for r in out if isinstance(r, IntakeResult)]
        assert not any(r.created for r in out2 if isinstance(r, IntakeResult))
        assert query(url, "SELECT count(*) AS n FROM outbox WHERE event_type = 'job.accepted'"
                     )[0]["n"] == 5
    finally:
        ctx.store.close()


def test_intake_batch_of_settings_defaults() -> None:
    s = Settings()
    assert s.intake_batch_max >= 1 and s.intake_batch_wait_s >= 0
    assert s.intake_batch_max_bytes >= s.max_inline_document_bytes
