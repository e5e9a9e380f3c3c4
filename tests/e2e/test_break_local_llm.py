"""Breaking the local llm stage's ONE transaction (``llm_local_one_transaction``: claim, answer
every chunk on the in-process model and complete -- ``record_local_answer``,
``complete_stage_advance_job`` -- in one transaction under the job's row lock) from outside,
with real worker processes, relay, ``consume-ready``, Postgres and the broker.

A worker frozen (SIGSTOP) inside that transaction, its answers computed and not written, past
its lease and its Kafka session: a second worker gets the partition and the redelivered
``job.chunks_ready``, waits for the frozen session's row lock until Postgres ends that session
(the idle limit, ``lease_s``), and answers the chunks itself. On SIGCONT the frozen worker's
completion meets its dead session. The job must succeed once: one ``succeeded`` attempt per
chunk (the frozen run's answers never recorded beside the live run's), every chunk's output
bound to one of them, one ``job.ready``, one analysis and one charge downstream, nothing
dead-lettered, both workers alive.
"""

from __future__ import annotations

import pytest

from jobstream.settings import Settings
from tests.helpers import (
    ProcessRunner,
    assert_one_succeeded_attempt_per_chunk,
    freeze_in_local_llm,
    kept_frozen,
    query,
    read_topic,
    wait_for,
)

pytestmark = pytest.mark.e2e

#: Long enough for several chunks at chunk_size_chars=400.
TEXT = " ".join(f"Paragraph {i}: the local model answers this chunk inside one transaction "
                f"while the worker that holds it is frozen past its lease." for i in range(20))


def _job(settings: Settings) -> dict:
    rows = query(settings.database_url, "SELECT job_id, status, error_code FROM job")
    return rows[0] if rows else {}


def test_a_worker_frozen_inside_the_local_llm_transaction_past_its_lease_answers_once(
        settings: Settings, procs: ProcessRunner) -> None:
    env = {"JOBSTREAM_LEASE_S": "4", "JOBSTREAM_CHUNK_SIZE_CHARS": "400"}
    # One document: the one-transaction stages run extract (1), chunk (2), llm (3).
    _, frozen = freeze_in_local_llm(settings, procs, "frozen-llm", TEXT, env)
    with kept_frozen(settings, procs, frozen):
        job_id = _job(settings)["job_id"]
        stages = {r["stage"]: r["status"] for r in query(
            settings.database_url, "SELECT stage, status FROM job_stage WHERE job_id = %s",
            (job_id,))}
        assert stages.get("chunk") == "succeeded" and "llm" not in stages, stages
        live = procs.start("worker", name="worker-live", **env)
        wait_for(lambda: _job(settings).get("status") == "succeeded", 120,
                 "the live worker to finish the job while the other is frozen", procs.logs,
                 every_s=1.0)
    wait_for(lambda: query(settings.database_url, "SELECT count(*) AS n FROM "
                           "downstream.ledger_charge")[0]["n"] >= 1, 60,
             "the result applied downstream", procs.logs)
    url = settings.database_url
    chunks = assert_one_succeeded_attempt_per_chunk(url, job_id)
    assert {c["outcome"] for c in chunks} == {"succeeded"}, chunks
    assert query(url, "SELECT count(*) AS n FROM downstream.document_analysis")[0]["n"] == 1
    assert query(url, "SELECT count(*) AS n FROM downstream.ledger_charge")[0]["n"] == 1
    ready = [m for m in read_topic(settings, settings.topic("job.ready"))
             if m.key().decode() == str(job_id)]
    assert len(ready) == 1, ready
    for t in ("job.chunks_ready", "job.llm_done"):
        assert read_topic(settings, settings.topic(t + ".dlq")) == [], t
    assert "database unavailable" in frozen.log_text(), procs.logs()  # met its dead session
    assert frozen.popen.poll() is None and live.popen.poll() is None, procs.logs()
