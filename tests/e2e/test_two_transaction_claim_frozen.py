"""robust11: a worker frozen inside a two-transaction stage's short claim transaction (a
PDF's extract) holds the job's row lock no longer than its lease.

The one-transaction claims set an idle limit (= lease) and ``tcp_user_timeout`` on their
transaction (issue 11, breaker10); the two-transaction claim (``Store.claim``: a PDF's extract,
a remote provider's llm stage) set neither, so a worker SIGSTOPped between its claim statement
and its COMMIT (fault point ``stage_inside_claim_transaction``) kept the job row locked for as
long as it stayed frozen: a live worker that took the partitions over waited on the lock in its
own claim, and the job never finished (breaker10's note: "not probed"). Now Postgres ends the
frozen session after the lease (4 s here), the claim rolls back, and the live worker runs the
job. Real processes (relay, two workers, the ready applier), shared services.
"""

from __future__ import annotations

import base64
import hashlib

import pytest

from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import DocumentRef, DocumentUploaded, DocumentUploadedPayload, encode_event
from tests.helpers import ProcessRunner, kept_frozen, query, read_topic, wait_for
from tests.hostile_documents import good_pdf

pytestmark = pytest.mark.e2e


def _pdf_uploaded(key: str) -> DocumentUploaded:
    data = good_pdf(pages=2)
    doc = DocumentRef(filename=f"{key}.pdf", content_type="application/pdf",
                      sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data),
                      content_b64=base64.b64encode(data).decode())
    return DocumentUploaded(tenant_id="acme", idempotency_key=key,
                            payload=DocumentUploadedPayload(document=doc))


def _job(url: str) -> dict:
    rows = query(url, "SELECT job_id, status FROM job")
    return rows[0] if rows else {}


def test_a_worker_frozen_inside_a_two_transaction_claim_holds_the_job_no_longer_than_its_lease(
        settings: Settings, procs: ProcessRunner) -> None:
    url = settings.database_url
    env = {"JOBSTREAM_LEASE_S": "4"}
    procs.start("relay", **env)
    procs.start("consume-ready", **env)
    frozen = procs.start("worker", name="worker-frozen", **env,
                         JOBSTREAM_FAULT="stage_inside_claim_transaction=stop")
    produce_raw(settings, settings.topic("document.uploaded"),
                [(b"frozen-claim", encode_event(_pdf_uploaded("frozen-claim")))])
    wait_for(lambda: "SIGSTOP" in frozen.log_text(), 90,
             "the worker to freeze inside the PDF extract's claim transaction", procs.logs)
    with kept_frozen(settings, procs, frozen):
        procs.start("worker", name="worker-live", **env)
        wait_for(lambda: _job(url).get("status") == "succeeded", 120,
                 "the live worker to finish the job while the other is frozen in its claim",
                 procs.logs, every_s=1.0)
    job_id = _job(url)["job_id"]
    [extract] = query(url, "SELECT attempt, status FROM job_stage WHERE job_id = %s AND "
                           "stage = 'extract'", (job_id,))
    # The frozen claim rolled back with its session: the live worker's claim is the first.
    assert extract == {"attempt": 1, "status": "succeeded"}, extract
    for table in ("downstream.document_analysis", "downstream.ledger_charge"):
        assert query(url, f"SELECT count(*) AS n FROM {table}")[0]["n"] == 1, table
    ready = [m for m in read_topic(settings, settings.topic("job.ready"))
             if m.key().decode() == str(job_id)]
    assert len(ready) == 1, ready
