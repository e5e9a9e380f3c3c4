"""Lanes (separate topics and consumer pools) and the shared AIMD provider limit, with real
worker processes and the fake provider over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobstream.drills.fake_provider import FakeProvider
from jobstream.limiter import SharedLimiter
from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from jobstream.store import Store
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.integration


def _docs(tmp_path: Path, n: int, words: int = 40) -> list[Path]:
    out = []
    for i in range(n):
        p = tmp_path / f"doc-{i}.txt"
        p.write_text(f"Document {i} is about topic {i * 7}. " + "It has words in it. " * words)
        out.append(p)
    return out


def _statuses(settings: Settings) -> list[str]:
    return [r["status"] for r in query(settings.database_url, "SELECT status FROM job")]


def test_batch_jobs_take_the_batch_topic_and_pool_interactive_ones_theirs(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    procs.start("relay")
    procs.start("worker", "--lane", "interactive", name="worker-interactive")
    procs.start("worker", "--lane", "batch", name="worker-batch")
    a, b = _docs(tmp_path, 2)
    submit(settings, [
        uploaded_event(a, tenant_id="acme", idempotency_key="i", settings=settings,
                       lane="interactive"),
        uploaded_event(b, tenant_id="acme", idempotency_key="b", settings=settings,
                       lane="batch")])
    wait_for(lambda: _statuses(settings) == ["succeeded"] * 2, 90, "both jobs", procs.logs)
    inter = read_topic(settings, settings.topic("job.chunks_ready"))
    batch = read_topic(settings, settings.topic("job.chunks_ready.batch"))
    assert len(inter) == 1 and len(batch) == 1
    assert json.loads(inter[0].value())["idempotency_key"] == "i"
    assert json.loads(batch[0].value())["idempotency_key"] == "b"
    logs = {p.name: p.log_text() for p in procs.procs}
    assert "llm_batch job.chunks_ready" in logs["worker-batch"]
    assert "llm_batch" not in logs["worker-interactive"]


def test_the_window_slow_starts_and_halves_once_per_window_of_calls_in_flight(
        settings: Settings) -> None:
    store = Store(settings.database_url, max_size=1)
    lim = SharedLimiter(store, max_limit=8, reserved=0, hold_s=60)

    def window() -> tuple[float, int]:
        [r] = query(settings.database_url, "SELECT limit_now, decreases FROM provider_limit")
        return r["limit_now"], r["decreases"]

    def take(n: int) -> list:
        slots = [lim.try_acquire("p", "batch", None) for _ in range(n)]
        assert None not in slots and lim.try_acquire("p", "batch", None) is None
        return slots

    try:
        for slot in take(2):  # slow start: the initial window, +1 per success
            lim.release(slot, "succeeded")
        assert window() == (4, 0)
        a, b, c, d = take(4)
        lim.release(a, "rate_limited")  # half the 4 calls in flight
        lim.release(b, "rate_limited")  # same window, same overload: no second halving
        lim.release(c, "succeeded")  # in flight at the decrease: no growth either
        lim.release(d, "succeeded")
        assert window() == (2, 1)
        e, f = take(2)
        lim.release(e, "succeeded")  # congestion avoidance: +1/window
        assert window() == (2.5, 1)
        lim.release(f, "rate_limited")  # taken after the decrease: a new overload
        assert window() == (1, 2)  # half of one call in flight, floor 1
    finally:
        store.close()


def test_429_above_a_threshold_converges_below_it_without_a_retry_avalanche(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    n = 40
    with FakeProvider({"max_concurrency": 3, "default": {"latency_s": 0.2}}) as fake:
        env = {"JOBSTREAM_PROVIDER_BASE_URL": fake.base_url, "JOBSTREAM_LLM_CONCURRENCY": "8",
               "JOBSTREAM_PROVIDER_MAX_CONCURRENCY": "8", "JOBSTREAM_CHUNK_SIZE_CHARS": "4000"}
        procs.start("relay", **env)
        procs.start("worker", "--stages", "intake,extract,chunk,validate,publish", **env)
        submit(settings, [uploaded_event(d, tenant_id="acme", idempotency_key=d.name,
                                         settings=settings, lane="batch",
                                         model_profile="custom") for d in _docs(tmp_path, n)])
        # Every chunk waits before the LLM worker starts: it meets the whole batch at once
        # (llm_concurrency 8 against a provider that takes 3), however slow the machine.
        wait_for(lambda: query(settings.database_url, "SELECT count(*) AS n FROM chunk")[0]["n"]
                 == n, 120, "every document chunked", procs.logs)
        procs.start("worker", "--lane", "batch", name="worker-llm", **env)
        wait_for(lambda: _statuses(settings).count("succeeded") == n, 180, "all jobs",
                 procs.logs)
        calls = fake.snapshot()
    chunks = query(settings.database_url, "SELECT count(*) AS n FROM chunk")[0]["n"]
    assert chunks == n
    print(f"{calls['total']} provider calls for {chunks} chunks: {calls['statuses']}, "
          f"at most {calls['max_in_flight']} in flight")
    assert calls["total"] <= 1.2 * chunks, calls  # no avalanche of retries
    limit = query(settings.database_url, "SELECT limit_now, decreases FROM provider_limit")[0]
    assert limit["decreases"] >= 1  # AIMD reacted to the 429s
    assert limit["limit_now"] <= 8
    # ... and it is visible in the metrics.
    from prometheus_client import generate_latest

    from jobstream.metrics import registry
    from jobstream.store import Store
    store = Store(settings.database_url, max_size=1)
    try:
        text = generate_latest(registry(settings, store)).decode()
    finally:
        store.close()
    assert 'jobstream_provider_limit_decreases_total{profile="custom"}' in text
    assert 'jobstream_provider_limit_window{profile="custom"}' in text
    attempts = query(settings.database_url,
                     "SELECT count(*) AS n FROM provider_attempt")[0]["n"]
    assert attempts == calls["total"]
