"""The store's fewer-transactions protocol on real Postgres (issue 12): a claim reads what its
stage needs in the same transaction; a short pure stage claims, works and completes in ONE
transaction (``Store.claim_and_complete``) and a failure of its work leaves the claim committed
alone, so the run ends as after a two-transaction claim; answers of the in-process model are
recorded with the completion, fenced like it. Jobs are made through ``Store.intake`` (no Kafka).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from jobstream.errors import PermanentError, StaleRun
from jobstream.settings import Settings
from jobstream.store import (
    STAGES,
    ChunkRow,
    Claim,
    JobRow,
    LocalAnswer,
    OutboxMessage,
    Store,
    typed_row,
)
from schemas.events import JobAccepted, JobAcceptedPayload
from tests.helpers import query

pytestmark = pytest.mark.integration

CONTENT = b"Harbour lanterns and copper kettles, sentence after sentence.\n" * 20
FIRST, SECOND, LLM = STAGES[1], STAGES[2], STAGES[3]
DEDUP = "d" * 64


def _msg(event_type: str, job_id: uuid.UUID, payload: dict[str, Any]) -> OutboxMessage:
    body = {"event_id": str(uuid.uuid4()), "event_type": event_type, "job_id": str(job_id),
            "payload": payload}
    return OutboxMessage("t", str(job_id), json.dumps(body).encode(),
                         {"event_type": event_type, "traceparent": "00-" + "1" * 32 + "-"
                          + "2" * 16 + "-01"})


@pytest.fixture
def store(settings: Settings) -> Iterator[Store]:
    s = Store(settings.database_url, max_size=2)
    yield s
    s.close()


@pytest.fixture
def job_id(store: Store) -> uuid.UUID:
    sha = hashlib.sha256(CONTENT).hexdigest()
    job = {"job_id": uuid.uuid4(), "tenant_id": "acme", "idempotency_key": "k",
           "request_hash": "h", "dedup_key": DEDUP, "request_id": "r", "document_sha256": sha,
           "filename": "doc.txt", "content_type": "text/plain", "pipeline": "document-analysis",
           "prompt_version": "v1", "model_profile": "local", "lane": "interactive"}

    def accepted(job_id: uuid.UUID) -> JobAccepted:
        return JobAccepted(tenant_id="acme", idempotency_key="k", request_id="r",
                           job_id=job_id, dedup_key=DEDUP, payload=JobAcceptedPayload(
                               document_sha256=sha, content_type="text/plain",
                               pipeline="document-analysis", prompt_version="v1",
                               model_profile="local", lane="interactive"))

    got = store.intake(tenant_id="acme", idempotency_key="k", request_hash="h", request_id="r",
                       job=job, content=CONTENT, accepted=accepted, topic="t")
    return got.job_id


def _claim_kw(job_id: uuid.UUID, stage: str, **kw: Any) -> dict[str, Any]:
    return {"job_id": job_id, "stage": stage, "group": f"g-{stage}", "dedup_key": DEDUP,
            "event_type": f"ev.{stage}", "event_id": uuid.uuid4(), "lease_s": 30.0,
            "code_version": "v", **kw}


def _done(claim: Claim, output: Any, **kw: Any) -> dict[str, Any]:
    return {"output": output, "input_hash": "x", "code_version": "v", "cost_usd": 0.0,
            "group": f"g-{claim.stage}", "event_type": f"ev.{claim.stage}",
            "event_id": uuid.uuid4(),
            "next_msg": _msg(f"next.{claim.stage}", claim.job.job_id, {"n": 1}), **kw}


def test_a_claim_reads_the_document_and_a_checkpoint_in_its_transaction_as_typed_rows(
        store: Store, job_id: uuid.UUID) -> None:
    got = store.claim(**_claim_kw(job_id, FIRST, reads=("document",)))
    assert isinstance(got, Claim) and isinstance(got.job, JobRow)
    assert got.job.job_id == job_id and got.job.content_type == "text/plain"
    assert got.inputs.document == CONTENT and got.inputs.chunks is None
    store.complete(got, **_done(got, {"text": "the text"}))
    second = store.claim(**_claim_kw(job_id, SECOND, reads=(f"output:{FIRST}", "chunks",
                                                            "budget")))
    assert isinstance(second, Claim)
    assert second.inputs.previous_output == {"text": "the text"}
    assert second.inputs.chunks == ()
    assert second.inputs.budget is not None and second.inputs.budget.stage_attempts == 0
    with pytest.raises(ValueError, match="unknown stage read"):
        store.claim(**_claim_kw(job_id, STAGES[3], reads=("everything",)))


def test_one_transaction_claims_works_and_completes_and_a_duplicate_is_skipped(
        store: Store, job_id: uuid.UUID, settings: Settings) -> None:
    kw = _claim_kw(job_id, FIRST, reads=("document",))
    seen: list[bytes | None] = []

    def work(claim: Claim) -> dict[str, Any]:
        seen.append(claim.inputs.document)
        return _done(claim, {"text": "t"})

    got, failure = store.claim_and_complete(work, **kw)
    assert isinstance(got, Claim) and failure is None and seen == [CONTENT]
    [row] = query(settings.database_url, "SELECT status, output, lease_until FROM job_stage "
                  "WHERE job_id = %s AND stage = %s", (job_id, FIRST))
    assert row == {"status": "succeeded", "output": {"text": "t"}, "lease_until": None}
    assert query(settings.database_url, "SELECT count(*) AS n FROM outbox WHERE event_type = "
                 "%s", (f"next.{FIRST}",)) == [{"n": 1}]
    again, failure = store.claim_and_complete(work, **kw)  # the same event redelivered
    assert again.reason == "duplicate" and failure is None and len(seen) == 1  # type: ignore[union-attr]


def test_a_failed_work_commits_the_claim_alone_so_the_fenced_fail_path_ends_the_run(
        store: Store, job_id: uuid.UUID, settings: Settings) -> None:
    def work(claim: Claim) -> dict[str, Any]:
        raise PermanentError("unreadable", code="document_unreadable")

    got, failure = store.claim_and_complete(work, **_claim_kw(job_id, FIRST))
    assert isinstance(got, Claim) and isinstance(failure, PermanentError)
    [row] = query(settings.database_url, "SELECT status, run_token, attempt FROM job_stage "
                  "WHERE job_id = %s AND stage = %s", (job_id, FIRST))
    assert row == {"status": "running", "run_token": got.run_token, "attempt": 1}
    assert query(settings.database_url, "SELECT count(*) AS n FROM outbox WHERE event_type = "
                 "%s", (f"next.{FIRST}",)) == [{"n": 0}]
    store.fail(got, error_code="document_unreadable", error="unreadable", group="g",
               event_type=f"ev.{FIRST}", event_id=uuid.uuid4(),
               failed_msg=_msg("job.failed", job_id, {}))
    [job] = query(settings.database_url, "SELECT * FROM job WHERE job_id = %s", (job_id,))
    assert typed_row(JobRow, job).status == "failed"


def test_local_answers_are_recorded_with_the_completion_and_fenced_like_it(
        store: Store, job_id: uuid.UUID, settings: Settings) -> None:
    url = settings.database_url
    chunked = store.claim(**_claim_kw(job_id, FIRST))
    assert isinstance(chunked, Claim)
    store.complete(chunked, **_done(chunked, {}, chunks=[(0, 0, 5, "hello", "h0")]))
    stale = store.claim(**_claim_kw(job_id, LLM, lease_s=0.001, reads=("chunks",)))
    assert isinstance(stale, Claim) and [c.idx for c in stale.inputs.chunks or ()] == [0]
    fresh = store.claim(**_claim_kw(job_id, LLM, reads=("chunks", "budget")))
    assert isinstance(fresh, Claim) and fresh.run_token != stale.run_token
    answer = LocalAnswer(idx=0, attempt=1, model="m", output={"summary": "s"},
                         latency_ms=1.0, prompt_tokens=3, completion_tokens=2, cost_usd=0.0)
    with pytest.raises(StaleRun):  # the taken-over run: nothing of its answer is kept
        store.complete(stale, **_done(stale, {}, local_answers=(answer,)))
    assert query(url, "SELECT count(*) AS n FROM provider_attempt") == [{"n": 0}]
    store.complete(fresh, **_done(fresh, {}, local_answers=(answer,)))
    [a] = query(url, "SELECT outcome, run_token, chunk_idx FROM provider_attempt")
    assert a == {"outcome": "succeeded", "run_token": fresh.run_token, "chunk_idx": 0}
    [c] = store.chunks(job_id)
    assert c.llm_output == {"summary": "s"}
    budget = store.provider_budget(job_id, LLM)
    assert budget.chunk_attempts == {0: 1} and budget.stage_attempts == 1
    # The next stage's claim reads the answered chunks and the budget (one statement).
    after = store.claim(**_claim_kw(job_id, STAGES[4], reads=("chunks", "budget")))
    assert isinstance(after, Claim) and after.inputs.budget is not None
    assert after.inputs.chunks == (ChunkRow(0, "hello", "h0", {"summary": "s"}),)
    assert after.inputs.budget.stage_attempts == 0  # the validate stage's own: none
    assert after.inputs.budget.job_cost_usd == budget.job_cost_usd


def test_a_claim_that_waited_for_the_job_lock_reads_what_the_lock_holder_committed(
        store: Store, job_id: uuid.UUID, settings: Settings) -> None:
    """The claim returns its reads from its own statement (migration 0036), whose snapshot is
    older than its wait for the job's row lock: the reads must still see what the holder of
    that lock committed meanwhile (here a re-run's new output of the previous stage; a
    subquery of the claim, or a STABLE function, would return the old one)."""
    first = store.claim(**_claim_kw(job_id, FIRST))
    assert isinstance(first, Claim)
    store.complete(first, **_done(first, {"text": "old"}))
    holder = psycopg.connect(settings.database_url)
    try:
        holder.execute("SELECT 1 FROM job WHERE job_id = %s FOR UPDATE", (job_id,))
        holder.execute("UPDATE job_stage SET output = %s WHERE job_id = %s AND stage = %s",
                       (Jsonb({"text": "new"}), job_id, FIRST))
        got: list[Any] = []
        waiting = threading.Thread(target=lambda: got.append(store.claim(**_claim_kw(
            job_id, SECOND, reads=(f"output:{FIRST}",)))))
        waiting.start()
        deadline = time.monotonic() + 10
        while not query(settings.database_url, "SELECT 1 FROM pg_stat_activity WHERE "
                        "datname = current_database() AND wait_event_type = 'Lock'"):
            assert time.monotonic() < deadline, "the claim never waited for the job lock"
            time.sleep(0.02)
        holder.commit()
        waiting.join(10)
        assert not waiting.is_alive()
    finally:
        holder.close()
    [claim] = got
    assert isinstance(claim, Claim)
    assert claim.inputs.previous_output == {"text": "new"}
