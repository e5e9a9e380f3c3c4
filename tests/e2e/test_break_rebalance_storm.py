"""Breaker (session 6): the offsets floor and seek-back (``streams/offsets.py``
``CompletionTracker.sought`` / ``take_rewind``, ``streams/base.py`` ``rewind_if_gap``) under a
rebalance storm, with the sweeper's stall backstop OFF (grace an hour): a message skipped by
an offset commit is never re-driven, so its job stays stuck and the test times out instead of
passing on the backstop.

Cycle after cycle, while documents flow through the llm stage (fake provider with latency, 4
events at once per worker, so a partition's events finish out of order and are in flight at
every rebalance): worker B is frozen (SIGSTOP) and worker C joins (a rebalance B cannot answer:
it is evicted after the session timeout), B is resumed (it rejoins: another rebalance, seeks
while its events were in flight), and C is killed -9 mid-call (a third). Every job must
succeed, be applied exactly once, with no stall re-emission (``sweeps`` 0) and ``jobstream
verify`` clean. Real processes, shared services.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from jobstream import verify
from jobstream.drills import chaos
from jobstream.drills.fake_provider import FakeProvider
from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, succeeded_and_applied, wait_for

pytestmark = pytest.mark.e2e

CYCLES = int(os.environ.get("JOBSTREAM_TEST_STORM_CYCLES", "1"))
DOCS_PER_CYCLE = 8


@pytest.mark.timeout(400)
def test_a_rebalance_storm_with_frozen_and_killed_workers_never_skips_an_offset(
        settings: Settings, tmp_path: Path) -> None:
    with FakeProvider({"default": {"latency_s": 0.7}}) as fake:
        s = chaos.chaos_settings(settings, fake.base_url, lease_s=6.0)
        env = {k: v for k, v in chaos.settings_env(s).items() if k.startswith("JOBSTREAM_")}
        env |= {"JOBSTREAM_LLM_CONCURRENCY": "4", "JOBSTREAM_SWEEP_GRACE_S": "3600",
                "JOBSTREAM_SWEEP_STALL_GRACE_S": "3600",
                "JOBSTREAM_CONSUMER_SESSION_TIMEOUT_MS": "6000",
                # A killed C's provider slots (the shared limit) are held provider_timeout_s
                # + provider_slot_margin_s: 11 s with a 6 s timeout (the fake answers in
                # 0.7 s) and the suite's 5 s margin, not 90 s.
                "JOBSTREAM_PROVIDER_TIMEOUT_S": "6"}
        runner = ProcessRunner(s, tmp_path / "logs")
        url, tenant = s.database_url, f"storm-{uuid.uuid4().hex[:8]}"
        total = 0
        frozen: list[int] = []
        try:
            runner.start("relay", **env)
            runner.start("consume-ready", **env)
            runner.start("worker", name="worker-a", **env)
            b = runner.start("worker", name="worker-b", **env)
            wait_for(lambda: "[^Worker]: Ready" in b.log_text(), 90, "worker B ready",
                     runner.logs)
            for c_no in range(CYCLES):
                events = []
                for i in range(DOCS_PER_CYCLE):
                    doc = chaos.make_documents(tmp_path / f"c{c_no}d{i}", f"{tenant}-{c_no}-{i}",
                                               1, paragraphs=1 + (i * 3) % 7)[0]
                    events.append(uploaded_event(doc, tenant_id=tenant,
                                                 idempotency_key=f"{tenant}:{c_no}:{i}",
                                                 settings=s, model_profile="custom"))
                submit(s, events)
                total += len(events)
                time.sleep(1.5)  # llm events in flight on A and B
                os.kill(b.popen.pid, signal.SIGSTOP)
                frozen.append(b.popen.pid)
                c = runner.start("worker", name=f"worker-c{c_no}", **env)
                wait_for(lambda c=c: "[^Worker]: Ready" in c.log_text(), 90,
                         f"worker C{c_no} to join while B is frozen", runner.logs)
                time.sleep(1.0)
                os.kill(b.popen.pid, signal.SIGCONT)  # B rejoins: another rebalance
                frozen.remove(b.popen.pid)
                deadline = time.monotonic() + 20
                while ("llm job.chunks_ready" not in c.log_text()
                       and time.monotonic() < deadline):
                    time.sleep(0.1)
                time.sleep(1.0)
                runner.kill9(c)  # mid-call: a third rebalance

            def diag() -> str:
                stuck = verify.run(s, checks=["stuck_jobs", "stranded_stages"], tenant=tenant,
                                   grace_s=10)
                return f"done={succeeded_and_applied(url, tenant)}\n{stuck.text()}\n{runner.logs()}"
            wait_for(lambda: succeeded_and_applied(url, tenant) == (total, total), 180,
                     f"all {total} jobs to succeed and be applied (no backstop)", diag,
                     every_s=1)
        finally:  # SIGKILL: a worker resumed after SIGSTOP ignores SIGTERM for 15 s
            runner.kill_all()

        assert query(url, "SELECT count(*) AS n FROM job WHERE sweeps > 0")[0]["n"] == 0
        report = verify.run(s, tenant=tenant, grace_s=0, outbox_age_s=0,
                            skip=("consumer_lag",))
        assert not report.broken and not report.errors, report.text()
        applied = query(url, "SELECT dedup_key, count(*) AS n FROM downstream.ledger_charge "
                             "WHERE tenant_id = %s GROUP BY 1", (tenant,))
        assert len(applied) == total and all(a["n"] == 1 for a in applied), applied
        rewinds = sum(p.log_text().count("seeking back to") for p in runner.procs)
        print(f"{total} jobs, {CYCLES} storm cycles, {rewinds} seek-backs after a gap")
