"""Breaker (session 6): the sweeper's stall backstop (Store.stalled_jobs / reemit_stalled)
must re-emit only a LOST stage event, never one that is merely waiting.

A stage that hits a transient failure gives itself back (release_stage: status ``pending``)
and its event waits in the ``.retry`` topic for the provider's Retry-After. Its row is
``pending`` like a stage never claimed, and the stall grace counted from the checkpoint BEFORE
it, so once that checkpoint was older than ``sweep_stall_grace_s`` the sweeper re-emitted the
stage's input event: a fresh copy (no ``retry_*`` headers) the stage ran at once, ignoring the
provider's Retry-After (and starting a second retry chain, with a fresh retry budget, when it
failed too). A Retry-After (or retry backoff) longer than the grace is enough: the job's last
change is the release. Fix: the release records when its retry is due at the latest
(``lease_until`` of the pending row: max(retry_cap_s, Retry-After)) and the stall clock of a
pending stage starts at its own row (jobstream/sql/queries.sql stalled_jobs).

Real processes (worker, relay with its sweeper, downstream applier), the fake provider on
loopback answering the first call 429 with ``Retry-After: 6`` (no in-process or in-place
retry: the event goes through the retry topic at once), shared services.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jobstream.drills import chaos
from jobstream.drills.fake_provider import FakeProvider
from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, wait_for

pytestmark = pytest.mark.e2e

TENANT = "stall-retry"
RETRY_AFTER_S = 6
STALL_GRACE_S = 2  # below the provider's Retry-After (default: 300 s, Retry-After unbounded)


def test_a_stage_waiting_out_a_retry_after_is_not_re_emitted_as_stalled(
        settings: Settings, tmp_path: Path) -> None:
    url = settings.database_url
    script = {"sequence": [{"status": 429, "retry_after": str(RETRY_AFTER_S)}]}
    with FakeProvider(script) as fake:
        s = chaos.chaos_settings(settings, fake.base_url, chunk_size_chars=4000)
        runner = ProcessRunner(s, tmp_path / "logs")
        env = {k: v for k, v in chaos.settings_env(s).items() if k.startswith("JOBSTREAM_")}
        env |= {"JOBSTREAM_SWEEP_STALL_GRACE_S": str(STALL_GRACE_S),
                "JOBSTREAM_SWEEP_GRACE_S": "1",  # the relay sweeps every 0.5 s
                "JOBSTREAM_PROVIDER_MAX_ATTEMPTS": "1", "JOBSTREAM_RETRY_IN_PLACE": "0"}
        try:
            runner.start("worker", **env)
            runner.start("consume-ready", **env)
            relay = runner.start("relay", **env)
            doc = tmp_path / "doc.txt"
            doc.write_text("A short contract between a tenant and a provider. " * 20)
            submit(s, [uploaded_event(doc, tenant_id=TENANT, idempotency_key=f"{TENANT}:1",
                                      settings=s, model_profile="custom")])
            wait_for(lambda: fake.snapshot()["total"] >= 1, 60, "the first provider call",
                     runner.logs)
            first = time.monotonic()
            wait_for(lambda: query(url, "SELECT status FROM job")[0]["status"] == "succeeded",
                     90, "the job to succeed after the Retry-After", runner.logs)
            took = time.monotonic() - first
            assert "re-emitted" not in relay.log_text(), relay.log_text()[-3000:]
            [job] = query(url, "SELECT sweeps FROM job")
            assert job["sweeps"] == 0, job
            # The second call came from the retry topic, not before the provider's Retry-After.
            assert fake.snapshot()["total"] == 2, fake.snapshot()
            assert took >= RETRY_AFTER_S - 1, took
        finally:
            runner.kill_all()
