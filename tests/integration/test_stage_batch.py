"""Several stage events in ONE transaction (``streams.runner.run_stage_batch``, the group
commit of one-transaction stages; issue 12) on real Postgres: each run is fenced on its own
(run token, generation, duplicate check) inside the shared transaction, a failing one fails
no other, and the ones that succeed commit together. Jobs are made through ``Store.intake``
(no Kafka); the events are the ``job.accepted`` events intake wrote to the outbox.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from jobstream.settings import Settings
from jobstream.store import Store
from schemas.events import JobAccepted, JobAcceptedPayload, decode_event
from streams.context import StageContext
from streams.runner import run_stage_batch
from tests.helpers import query

pytestmark = pytest.mark.integration

TEXT = b"Harbour lanterns and copper kettles, sentence after sentence.\n" * 20


@pytest.fixture
def ctx(settings: Settings) -> Iterator[StageContext]:
    store = Store(settings.database_url, max_size=2)
    yield StageContext(settings=settings, store=store)
    store.close()


def _job(store: Store, content: bytes, key: str) -> JobAccepted:
    """A job made by intake; returns its ``job.accepted`` event (as intake wrote it)."""
    sha = hashlib.sha256(content).hexdigest()
    dedup = hashlib.sha256(key.encode()).hexdigest()
    job = {"job_id": uuid.uuid4(), "tenant_id": "acme", "idempotency_key": key,
           "request_hash": key, "dedup_key": dedup, "request_id": "r",
           "document_sha256": sha, "filename": "doc.txt", "content_type": "text/plain",
           "pipeline": "document-analysis", "prompt_version": "v1", "model_profile": "local",
           "lane": "interactive"}

    def accepted(job_id: uuid.UUID) -> JobAccepted:
        return JobAccepted(tenant_id="acme", idempotency_key=key, request_id="r",
                           job_id=job_id, dedup_key=dedup, payload=JobAcceptedPayload(
                               document_sha256=sha, content_type="text/plain",
                               pipeline="document-analysis", prompt_version="v1",
                               model_profile="local", lane="interactive"))

    got = store.intake(tenant_id="acme", idempotency_key=key, request_hash=key,
                       request_id="r", job=job, content=content, accepted=accepted,
                       topic="job.accepted")
    return accepted(got.job_id)


def test_a_batch_shares_one_transaction_fences_each_run_and_a_failing_one_fails_no_other(
        ctx: StageContext, settings: Settings) -> None:
    url = settings.database_url
    good1 = _job(ctx.store, TEXT, "k1")
    empty = _job(ctx.store, b"", "k2")  # extract fails it: the document is empty
    good2 = _job(ctx.store, TEXT + b"more", "k3")
    again = decode_event(good1.model_dump_json().encode(), expected="job.accepted")
    out = run_stage_batch(ctx, [good1, empty, good2, again])
    assert out == ["done", "failed:empty_document", "done", "skipped:duplicate"]
    rows = query(url, "SELECT job_id, status, started_at, finished_at FROM job_stage "
                 "WHERE stage = 'extract'")
    by_job = {r["job_id"]: r for r in rows}
    ok1, ok2, bad = by_job[good1.job_id], by_job[good2.job_id], by_job[empty.job_id]
    assert ok1["status"] == ok2["status"] == "succeeded" and bad["status"] == "failed"
    # One transaction claimed all three and completed the two (now() is the transaction's
    # start time); the failed one was ended afterwards, in its own transaction.
    assert ok1["started_at"] == ok1["finished_at"] == ok2["finished_at"] == bad["started_at"]
    assert bad["finished_at"] > bad["started_at"]
    [failed] = query(url, "SELECT status, error_code FROM job WHERE job_id = %s",
                     (empty.job_id,))
    assert failed == {"status": "failed", "error_code": "empty_document"}
    emitted = query(url, "SELECT kafka_key AS key, event_type FROM outbox WHERE event_type IN "
                    "('job.text_extracted', 'job.failed') ORDER BY event_type, key")
    assert sorted((r["event_type"], r["key"]) for r in emitted) == sorted([
        ("job.text_extracted", str(good1.job_id)), ("job.text_extracted", str(good2.job_id)),
        ("job.failed", str(empty.job_id))])


def test_a_run_postgres_refuses_in_a_shared_transaction_fails_alone_and_the_rest_commit(
        ctx: StageContext, settings: Settings) -> None:
    """The shared transaction runs its events without a savepoint each (perf-worker4): when
    one raises (here Postgres refuses its completion: a trigger the test installs), the whole
    transaction rolls back and runs again with a savepoint per event, so the outcome is the
    savepoint path's: the others done in ONE transaction with exactly one next event each,
    the refused one's error handed back and its job failed, nothing of its run committed."""
    url = settings.database_url
    good1, victim, good2 = (_job(ctx.store, TEXT + k.encode(), k) for k in ("a1", "a2", "a3"))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"""
            CREATE FUNCTION refuse_victim() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.job_id = '{victim.job_id}' AND NEW.status = 'succeeded' THEN
                    RAISE EXCEPTION 'refused by the test' USING ERRCODE = 'check_violation';
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER refuse_victim BEFORE UPDATE ON job_stage
                FOR EACH ROW EXECUTE FUNCTION refuse_victim();""")
    out = run_stage_batch(ctx, [good1, victim, good2])
    assert out[0] == out[2] == "done", out
    assert isinstance(out[1], psycopg.errors.CheckViolation), out
    rows = query(url, "SELECT job_id, status, started_at FROM job_stage WHERE stage = 'extract'")
    by_job = {r["job_id"]: r for r in rows}
    ok1, ok2 = by_job[good1.job_id], by_job[good2.job_id]
    assert ok1["status"] == ok2["status"] == "succeeded"
    assert ok1["started_at"] == ok2["started_at"]  # one transaction, not one each
    assert by_job[victim.job_id]["status"] == "failed"  # claimed again alone, then ended
    [job] = query(url, "SELECT status, error_code FROM job WHERE job_id = %s", (victim.job_id,))
    assert job == {"status": "failed", "error_code": "internal_error"}
    emitted = query(url, "SELECT kafka_key AS key, event_type FROM outbox WHERE event_type IN "
                    "('job.text_extracted', 'job.failed')")
    assert sorted((r["event_type"], r["key"]) for r in emitted) == sorted([
        ("job.text_extracted", str(good1.job_id)), ("job.text_extracted", str(good2.job_id)),
        ("job.failed", str(victim.job_id))])
    processed = query(url, "SELECT job_id FROM processed_event WHERE event_type = "
                      "'job.accepted'")
    assert sorted(map(str, (r["job_id"] for r in processed))) == sorted(
        map(str, (good1.job_id, good2.job_id, victim.job_id)))
