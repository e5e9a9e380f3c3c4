"""adv12 (session 10): a schema-valid ``job.validated`` naming a REAL job that is still at an
earlier stage (forged, or a copy superseded by a re-run) arrives on ``job.validated``. The
publish stage finds no validate checkpoint (``not_ready``) and retries; when that copy's retry
budget was spent, the worker used to fail the real job (``retry_budget_exhausted``), so one
stray message ended good work (2 runs of 2). Only the copy may be dead-lettered: the jobs
must go on and succeed, each applied and charged once. Real worker, relay and
``consume-ready`` processes, shared services.
"""

from __future__ import annotations

import pytest

from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import Validated, ValidatedPayload, encode_event
from tests.helpers import ProcessRunner, query, text_uploaded, wait_for, wait_pipeline_drained

pytestmark = pytest.mark.e2e

N = 3
#: A short retry budget: the forged copies are spent within a few seconds.
ENV = {"JOBSTREAM_RETRY_ROUNDS": "2", "JOBSTREAM_RETRY_BASE_S": "0.2",
       "JOBSTREAM_RETRY_CAP_S": "1"}


def test_a_forged_early_stage_event_is_dead_lettered_and_fails_no_job(
        settings: Settings, procs: ProcessRunner) -> None:
    url = settings.database_url
    procs.start("relay", **ENV)
    procs.start("consume-ready", **ENV)
    # Every stage but extract: the real jobs wait before it while the forged copies run out.
    worker = procs.start("worker", "--stages", "intake,chunk,llm,validate,publish",
                         name="no-extract", **ENV)
    docs = [text_uploaded(f"fg{i}", f"Forged doc {i}. " + "Some words. " * 40)
            for i in range(N)]
    produce_raw(settings, settings.topic("document.uploaded"),
                [(d.idempotency_key.encode(), encode_event(d)) for d in docs])
    wait_for(lambda: query(url, "SELECT count(*) AS n FROM job")[0]["n"] == N, 60,
             "jobs accepted", procs.logs)
    forged = [(str(j["job_id"]).encode(), encode_event(Validated(
        tenant_id=j["tenant_id"], idempotency_key=j["idempotency_key"], job_id=j["job_id"],
        dedup_key=j["dedup_key"], generation=j["generation"],
        payload=ValidatedPayload(output_sha256="0" * 64))))
        for j in query(url, "SELECT job_id, tenant_id, idempotency_key, dedup_key, generation "
                            "FROM job")]
    produce_raw(settings, settings.topic("job.validated"), forged)
    wait_for(lambda: worker.log_text().count("retry budget exhausted") >= N, 60,
             "the forged copies' retry budget spent", procs.logs)
    assert query(url, "SELECT status FROM job WHERE status <> 'queued'") == [], \
        "a forged copy changed its job\n" + procs.logs()
    procs.start("worker", "--stages", "extract", name="extract", **ENV)
    wait_for(lambda: query(url, "SELECT count(*) AS n FROM job WHERE status IN "
                                "('succeeded', 'failed', 'cancelled')")[0]["n"] == N, 120,
             "jobs terminal", procs.logs)
    wait_pipeline_drained(settings, procs, 120)
    st = query(url, "SELECT job_id, status, error_code, current_stage FROM job")
    assert all(r["status"] == "succeeded" for r in st), st
    per_job = query(url, "SELECT (SELECT count(*) FROM downstream.ledger_charge c WHERE "
                         "c.dedup_key = j.dedup_key) AS c FROM job j")
    assert [r["c"] for r in per_job] == [1] * N, per_job
