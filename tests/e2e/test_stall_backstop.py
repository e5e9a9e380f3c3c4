"""A job stalled between stages is re-driven by the sweeper (the liveness backstop).

After a broker SIGKILL restart a stage's event can be lost on the Kafka side: its offset was
committed past it before the stage ever ran (docs/design-notes.md "Stalled between stages";
seen 1 run in ~35 of test_service_restarts ``sigkill``). Exactly-once holds, but the job stays
``running`` forever. The backstop: the relay's sweeper re-emits, through the outbox, the next
stage's event of a job whose last checkpoint is older than ``sweep_stall_grace_s`` and whose
next stage was never claimed.

Here the event is lost for real, deterministically: the stage's transaction commits its
checkpoint and its outbox row, and the row is deleted before any relay publishes it (what a
lost message looks like from Postgres: checkpoint done, no event anywhere, the next stage never
claimed). Real processes (worker, relay with its sweeper, downstream applier), shared services.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, wait_for

pytestmark = pytest.mark.e2e

TENANT = "stall"


def test_the_sweeper_re_emits_a_stage_event_lost_after_its_checkpoint_committed(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    url = settings.database_url
    env = {"JOBSTREAM_SWEEP_STALL_GRACE_S": "1"}
    procs.start("worker", **env)
    procs.start("consume-ready", **env)
    doc = tmp_path / "doc.txt"
    doc.write_text("A short contract between a tenant and a provider. " * 20)
    submit(settings, [uploaded_event(doc, tenant_id=TENANT, idempotency_key=f"{TENANT}:1",
                                     settings=settings)])

    # intake committed the job, its checkpoint and the job.accepted outbox row; no relay yet.
    [row] = wait_for(lambda: query(url, "SELECT id, kafka_key FROM outbox "
                                        "WHERE event_type = 'job.accepted'"),
                     60, "intake's job.accepted outbox row", procs.logs)
    # The event is lost after its commit: nothing will ever deliver it.
    assert query(url, "DELETE FROM outbox WHERE id = %s RETURNING id", (row["id"],))
    [stages] = query(url, "SELECT array_agg(stage ORDER BY stage) AS s FROM job_stage")
    assert stages["s"] == ["intake"], "extract ran without its event?"

    relay = procs.start("relay", **env)
    wait_for(lambda: query(url, "SELECT status FROM job")[0]["status"] == "succeeded", 90,
             "the stalled job to be re-driven by the sweeper and succeed", procs.logs)
    wait_for(lambda: query(url, "SELECT count(*) AS n FROM downstream.document_analysis")[0]["n"],
             60, "the result applied downstream", procs.logs)

    assert f"re-emitted job.accepted of {row['kafka_key']}: extract never claimed after " \
           "intake" in relay.log_text(), procs.logs()
    [job] = query(url, "SELECT generation, sweeps, dedup_key FROM job")
    assert (job["generation"], job["sweeps"]) == (0, 1), job  # one re-emission, no re-drive
    for table in ("downstream.document_analysis", "downstream.ledger_charge"):
        rows = query(url, f"SELECT dedup_key FROM {table}")
        assert [r["dedup_key"] for r in rows] == [job["dedup_key"]], table
    assert query(url, "SELECT stage, attempt FROM job_stage WHERE attempt <> 1") == []
