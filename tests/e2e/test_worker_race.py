"""Two stage workers racing for the same work: a rebalance mid-batch, a worker killed with work
in flight, and a worker frozen past its lease that wakes up. Never two results: one job.ready
event id per job (re-publication repeats an id, a second id is the bug), and the run that lost
its lease writes nothing."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from jobstream.drills import chaos
from jobstream.drills.fake_provider import FakeProvider
from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from tests.helpers import Proc, ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def race(settings: Settings, tmp_path: Path):
    """Settings on the fake provider with a 5 s lease, and a runner passing all of them on."""
    with FakeProvider() as fake:
        s = chaos.chaos_settings(settings, fake.base_url)
        runner = ProcessRunner(s, tmp_path / "logs")
        env = {k: v for k, v in chaos.settings_env(s).items() if k.startswith("JOBSTREAM_")}
        # One LLM stage at a time per worker, so "the stage A holds" is one row.
        env["JOBSTREAM_LLM_CONCURRENCY"] = "1"
        yield s, runner, env, fake, tmp_path
        runner.kill_all()  # frozen ones too


def _submit(s: Settings, folder: Path, n: int, tenant: str | None = None,
            first: int = 0) -> tuple[str, list[str]]:
    """Submit documents ``first``..``first + n - 1`` of a tenant (a fresh one by default)."""
    tenant = tenant or f"race-{uuid.uuid4().hex[:8]}"
    docs = chaos.make_documents(folder / "docs", tenant, first + n)[first:]
    keys = [f"{tenant}:{d.name}" for d in docs]
    submit(s, [uploaded_event(d, tenant_id=tenant, idempotency_key=k, settings=s,
                              model_profile="custom") for d, k in zip(docs, keys, strict=True)])
    return tenant, keys


def _state(p: Proc) -> str:
    """The process state letter from /proc (``T`` = stopped)."""
    with open(f"/proc/{p.popen.pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _ready_ids(s: Settings) -> dict[str, set[str]]:
    import json
    ids: dict[str, set[str]] = defaultdict(set)
    for m in read_topic(s, s.topic("job.ready")):
        ev = json.loads(m.value())
        ids[ev["job_id"]].add(ev["event_id"])
    return ids


def _snapshot(url: str) -> dict[str, Any]:
    """Everything a stage run can write, row by row (test-only SQL)."""
    q = {
        "job": "SELECT job_id, status, current_stage, cost_usd, charge_usd, updated_at FROM job",
        "job_stage": "SELECT job_id, stage, status, attempt, run_token, lease_until, output, "
                     "input_hash, cost_usd, finished_at, updated_at FROM job_stage",
        "chunk": "SELECT job_id, idx, text_sha256, llm_output, llm_attempt_id FROM chunk",
        "provider_attempt": "SELECT attempt_id, outcome, run_token, finished_at "
                            "FROM provider_attempt",
        "outbox": "SELECT id, event_id, event_type, published_at FROM outbox",
        "outbox_published": "SELECT id, event_id, event_type FROM outbox_published",
        "processed_event": "SELECT consumer_group, dedup_key, event_type, event_id "
                           "FROM processed_event",
        "analysis": "SELECT id, dedup_key FROM downstream.document_analysis",
        "charge": "SELECT id, dedup_key FROM downstream.ledger_charge",
    }
    return {name: sorted(map(str, query(url, sql))) for name, sql in q.items()}


def test_a_worker_frozen_past_its_lease_is_fenced_off_and_writes_nothing(race) -> None:
    s, runner, env, fake, tmp = race
    url = s.database_url
    runner.start("relay", **env)
    runner.start("consume-ready", **env)
    # Worker A answers every chunk of its first job, then freezes before the llm
    # checkpoint: alive, holding a claim whose lease runs out.
    a = runner.start("worker", name="worker-a", **env,
                     JOBSTREAM_FAULT="llm_after_provider_before_checkpoint=stop")
    tenant, keys = _submit(s, tmp, 3)
    wait_for(lambda: _state(a) == "T", 90, "worker A to freeze at the fault point", runner.logs)
    [held] = query(url, "SELECT job_id, run_token FROM job_stage "
                        "WHERE stage = 'llm' AND status = 'running'")

    # Worker B joins; A's session and lease expire; B takes the stage over and finishes.
    runner.start("worker", name="worker-b", **env)
    wait_for(lambda: chaos.quiescent(s, tenant, len(keys)), 120,
             "worker B to finish every job", runner.logs)
    [stage] = query(url, "SELECT status, attempt, run_token FROM job_stage "
                         "WHERE job_id = %s AND stage = 'llm'", (held["job_id"],))
    assert stage["status"] == "succeeded" and stage["attempt"] == 2
    assert stage["run_token"] != held["run_token"]
    before = _snapshot(url)

    # A wakes up and tries to complete its stale run: the fenced UPDATE matches no row.
    os.kill(a.popen.pid, signal.SIGCONT)
    wait_for(lambda: "discarding a stale run" in a.log_text(), 60,
             "worker A to discard its stale run", runner.logs)
    assert f"run {held['run_token']} was fenced off" in a.log_text()
    time.sleep(3)  # let A rejoin the group and see whatever it would redo
    wait_for(lambda: chaos.quiescent(s, tenant, len(keys)), 60, "quiescence", runner.logs)
    assert a.popen.poll() is None, "the stale worker keeps running"
    assert _snapshot(url) == before, "the stale run wrote something"

    assert all(len(ids) == 1 for ids in _ready_ids(s).values())
    violations, effects = chaos.check_invariants(
        s, tenant=tenant, keys=keys, calls_by_key=fake.snapshot()["by_key"],
        worker_killed=True)
    assert not violations, "\n".join(violations) + runner.logs()
    assert effects["retaken_stages"] == 1 and effects["started_attempts"] == 0


def test_a_worker_joining_mid_batch_then_one_killed_never_gives_two_results(race) -> None:
    s, runner, env, fake_a, tmp = race
    # Each worker has its own fake provider, so "in a provider call" tells the workers apart.
    # Worker A's first calls are slow: B joins the group while A is inside an LLM stage.
    fake_a.set_script({"sequence": [{"latency_s": 1.0}] * 6, "default": {"latency_s": 0.2}})
    with FakeProvider({"default": {"latency_s": 0.2}}) as fake_b:
        runner.start("relay", **env)
        runner.start("consume-ready", **env)
        a = runner.start("worker", name="worker-a", **env)
        tenant, keys = _submit(s, tmp, 3)
        wait_for(lambda: fake_a.in_flight, 90, "worker A in a provider call", runner.logs,
                 every_s=0.01)
        b = runner.start("worker", name="worker-b",
                         **{**env, "JOBSTREAM_PROVIDER_BASE_URL": fake_b.base_url})
        wait_for(lambda: "Setting newly assigned partitions" in b.log_text(), 60,
                 "worker B to join the group (a rebalance with A's stage in flight)",
                 runner.logs)
        _, more = _submit(s, tmp, 8, tenant=tenant, first=3)
        keys += more
        # Kill -9 whichever worker is in a provider call first: a stage is cut mid-run.
        busy = [(a, fake_a), (b, fake_b)]
        victim = wait_for(lambda: next((w for w, f in busy if f.in_flight), None), 60,
                          "a worker in a provider call", runner.logs, every_s=0.01)
        runner.kill9(victim)
        survivor = b if victim is a else a
        wait_for(lambda: chaos.quiescent(s, tenant, len(keys)), 150,
                 f"{survivor.name} to finish every job", runner.logs)
        assert survivor.popen.poll() is None
        calls = Counter(fake_a.snapshot()["by_key"]) + Counter(fake_b.snapshot()["by_key"])

    ready = _ready_ids(s)
    assert len(ready) == len(keys)
    assert all(len(ids) == 1 for ids in ready.values()), ready
    violations, effects = chaos.check_invariants(s, tenant=tenant, keys=keys,
                                                 calls_by_key=calls, worker_killed=True)
    assert not violations, "\n".join(violations) + runner.logs()
    assert effects["retaken_stages"] >= 1, effects  # the killed run's stage was taken over
    assert "-> done" in a.log_text() and "-> done" in b.log_text(), "both workers took part"
