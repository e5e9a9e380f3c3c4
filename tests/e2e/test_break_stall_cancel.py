"""Breaker6: the sweeper's stall backstop (``Store.stalled_jobs`` / ``reemit_stalled``) against a
CANCELLED job whose next stage event was lost.

A cancel that lands while a stage runs under a live lease does not end the job at once
(``cancel_waiting_jobs`` leaves jobs with a running stage to their worker); the run's
completion does not look at the flag (``complete_stage_emit``), so the job goes on to the next
stage, whose claim sees the cancel and ends the job ``cancelled``. If that next stage's event is
lost (what the backstop exists for: an offset committed past it after a broker restart; lost
here for real by deleting its outbox row after the commit, as tests/e2e/test_stall_backstop.py
does), nothing ever claims the next stage, and ``stalled_jobs`` skipped every job with
``cancel_requested``: the job stayed ``running`` (its cancel requested) forever.

Real processes (worker frozen by SIGSTOP at ``llm_after_provider_before_checkpoint`` with its
lease live, relay with its sweeper, API for the cancel, fake provider), shared services.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobstream.drills import chaos
from jobstream.drills.fake_provider import FakeProvider
from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, stopped, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def fake_env(settings: Settings, tmp_path: Path) -> Iterator[tuple[Settings, ProcessRunner,
                                                                   dict[str, str]]]:
    """Settings on the fake provider with a 60 s lease (the cancel lands under a live lease),
    a runner passing them on, and its environment."""
    with FakeProvider() as fake:
        s = chaos.chaos_settings(settings, fake.base_url, lease_s=60)
        runner = ProcessRunner(s, tmp_path / "logs")
        env = {k: v for k, v in chaos.settings_env(s).items() if k.startswith("JOBSTREAM_")}
        try:
            yield s, runner, env
        finally:
            runner.kill_all()  # frozen ones too


def test_a_cancelled_job_whose_next_event_was_lost_ends_cancelled(
        fake_env: tuple[Settings, ProcessRunner, dict[str, str]], tmp_path: Path) -> None:
    s, procs, env = fake_env
    url = s.database_url
    tenant = f"cancel-{uuid.uuid4().hex[:8]}"
    relay = procs.start("relay", **env)
    procs.start("consume-ready", **env)
    worker = procs.start("worker", **env,
                         JOBSTREAM_FAULT="llm_after_provider_before_checkpoint=stop")
    [doc] = chaos.make_documents(tmp_path / "docs", tenant, 1)
    submit(s, [uploaded_event(doc, tenant_id=tenant, idempotency_key=f"{tenant}:1",
                              settings=s, model_profile="custom")])
    wait_for(lambda: stopped(worker.popen.pid), 90,
             "the worker frozen after its provider calls, before the llm checkpoint",
             procs.logs)
    [job] = query(url, "SELECT job_id FROM job")
    job_id = job["job_id"]

    # No relay while the completion commits: its next event is lost before anyone sends it.
    relay.popen.send_signal(signal.SIGTERM)
    relay.popen.wait(30)
    token = uuid.uuid4().hex
    api, _ = procs.start_api({token: tenant}, **{k: v for k, v in env.items()
                                                  if k != "JOBSTREAM_API_TOKENS"})
    got = httpx.post(f"{api}/v1/jobs/{job_id}/cancel",
                     headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert got.status_code == 202, got.text
    [row] = query(url, "SELECT status, cancel_requested FROM job")
    assert (row["status"], row["cancel_requested"]) == ("running", True), row  # lease live

    os.kill(worker.popen.pid, signal.SIGCONT)
    [lost] = wait_for(lambda: query(url, "SELECT id FROM outbox WHERE event_type = "
                                         "'job.llm_done'"), 60,
                      "the llm completion's job.llm_done outbox row", procs.logs)
    assert query(url, "DELETE FROM outbox WHERE id = %s RETURNING id", (lost["id"],))
    stages: dict[str, Any] = {r["stage"]: r["status"] for r in query(
        url, "SELECT stage, status FROM job_stage WHERE job_id = %s", (job_id,))}
    assert stages.get("llm") == "succeeded" and "validate" not in stages, stages

    relay = procs.start("relay", **{**env, "JOBSTREAM_SWEEP_STALL_GRACE_S": "1"})
    wait_for(lambda: query(url, "SELECT status FROM job")[0]["status"] == "cancelled", 45,
             "the cancelled job to end 'cancelled' (the backstop skipped it: stuck "
             "'running' for good)", procs.logs)
    [row] = query(url, "SELECT status, error_code, current_stage FROM job")
    assert row["error_code"] == "cancelled_by_user", row
    assert not query(url, "SELECT 1 FROM downstream.document_analysis"), "applied anyway"
    assert worker.popen.poll() is None and relay.popen.poll() is None, procs.logs()
