"""Breaker (session 6): the sweeper's stall backstop (re-emission of a stage event whose stage
was never claimed) racing a claim held by a FROZEN worker.

A worker is frozen (SIGSTOP, fault point ``stage_inside_one_transaction@3=stop``) inside the
local llm stage's one transaction: its claim of the stage is not committed, so to the sweeper
the stage looks never claimed, while the frozen transaction holds the job's row lock. The stall
grace is 1 s (the relay sweeps every 0.5 s), so the sweeper tries to re-emit
``job.chunks_ready`` while the frozen claim holds the lock (it must wait or give up, not
re-emit past it), again once Postgres ended the frozen session (idle limit = lease), and a live
worker takes the partitions over and processes the original event, maybe also the re-emitted
copy. Whatever the interleaving: every chunk answered once, one result applied, one
``job.ready``, and the frozen worker, resumed, doubles nothing. Real processes, shared
services.
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

TEXT = " ".join(f"Paragraph {i}: the local model answers this chunk while the sweeper looks "
                f"for stalled jobs every half second." for i in range(14))


def _job(settings: Settings) -> dict:
    rows = query(settings.database_url, "SELECT job_id, status, sweeps FROM job")
    return rows[0] if rows else {}


def test_the_stall_backstop_racing_a_frozen_one_transaction_claim_doubles_nothing(
        settings: Settings, procs: ProcessRunner) -> None:
    env = {"JOBSTREAM_LEASE_S": "4", "JOBSTREAM_CHUNK_SIZE_CHARS": "400",
           "JOBSTREAM_SWEEP_STALL_GRACE_S": "1", "JOBSTREAM_SWEEP_GRACE_S": "1"}
    relay, frozen = freeze_in_local_llm(settings, procs, "stall-frozen", TEXT, env)
    with kept_frozen(settings, procs, frozen):
        # The sweeper meets the frozen claim's lock, then (after the idle limit) no claim.
        wait_for(lambda: "sweeper" in relay.log_text(), 30, "the sweeper to act on the job",
                 procs.logs)
        procs.start("worker", name="worker-live", **env)
        wait_for(lambda: _job(settings).get("status") == "succeeded", 120,
                 "the live worker to finish the job while the other is frozen", procs.logs,
                 every_s=1.0)
    url = settings.database_url
    job = _job(settings)
    sweeper = [ln for ln in relay.log_text().splitlines() if "sweeper" in ln]
    print(f"sweeps={job['sweeps']}", *sweeper[:6], sep="\n")
    job_id = job["job_id"]
    assert_one_succeeded_attempt_per_chunk(url, job_id)
    for table in ("downstream.document_analysis", "downstream.ledger_charge"):
        assert query(url, f"SELECT count(*) AS n FROM {table}")[0]["n"] == 1, table
    ready = [m for m in read_topic(settings, settings.topic("job.ready"))
             if m.key().decode() == str(job_id)]
    assert len(ready) == 1, ready
    for stage in ("validate", "publish"):
        [row] = query(url, "SELECT attempt FROM job_stage WHERE job_id = %s AND stage = %s",
                      (job_id, stage))
        assert row["attempt"] == 1, (stage, row)
    assert "Traceback" not in relay.log_text(), relay.log_text()[-3000:]
