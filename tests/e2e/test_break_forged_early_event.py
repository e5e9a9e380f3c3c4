"""adv12 (session 10): a schema-valid ``job.validated`` naming a REAL job that is still at an
earlier stage (forged, or a copy superseded by a re-run) arrives on ``job.validated``. The
publish stage finds no validate checkpoint (``not_ready``) and retries; when that copy's retry
budget was spent, the worker used to fail the real job (``retry_budget_exhausted``), so one
stray message ended good work (2 runs of 2). Only the copy may be dead-lettered: the jobs
must go on and succeed, each applied and charged once. Real worker, relay and
``consume-ready`` processes, shared services.

breaker11: the same forged early event at the two stages nobody probed: ``chunk`` (one
transaction: claim, work and complete under the job's row lock; the claim commits alone when
the work raises) and ``llm`` on a REMOTE provider (the fake provider over loopback: the claim
commits in its own transaction, the provider calls run outside it). A schema-valid
``job.text_extracted`` / ``job.chunks_ready`` naming a REAL job that is still queued before
extract is consumed, each also as a copy with a far-future ``generation``. The copies of the
job's generation claim a stage whose input is not there (``not_ready``), release it and spend
their retry budget; only they may be dead-lettered. Then extract runs: every job must succeed,
be applied and charged once, each chunk answered by exactly one provider attempt.

policy12: the far-future copies are refused at once as poison (``generation_ahead``: no
legitimate event is ahead of its job, a redrive writes its events with the job's new
generation); the claim took any generation ``>=`` the job's, so they used to claim and spend
their budget like the others (breaker11's note). The budget here is one round with no in-place
retries (CI time: the llm case took ~100 s with 2 rounds and 2 in-place retries each, the
retry agent running the copies one at a time); what is asserted is the same: a copy whose
budget is spent, at any count, is dead-lettered and changes no job.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobstream.drills import chaos
from jobstream.drills.fake_provider import FakeProvider
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import (
    ChunksReady,
    ChunksReadyPayload,
    TextExtracted,
    TextExtractedPayload,
    Validated,
    ValidatedPayload,
    encode_event,
)
from tests.helpers import (
    ProcessRunner,
    assert_jobs_succeed_charged_once,
    assert_one_succeeded_attempt_per_chunk,
    query,
    text_uploaded,
    wait_for,
)

pytestmark = pytest.mark.e2e

N = 3
#: A short retry budget: the forged copies are spent within a few seconds (one round through
#: the ``.retry`` topic, no in-place retries: still a retried copy whose budget runs out).
ENV = {"JOBSTREAM_RETRY_ROUNDS": "1", "JOBSTREAM_RETRY_IN_PLACE": "0",
       "JOBSTREAM_RETRY_BASE_S": "0.2", "JOBSTREAM_RETRY_CAP_S": "1"}
#: What the worker logs for each copy dead-lettered ahead of its job (consumers/routing.py).
AHEAD = ": generation_ahead: "


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
    assert_jobs_succeed_charged_once(settings, procs, N)


#: The generation of the far-future copies.
FAR_GENERATION = 1_000_000


Remote = tuple[Settings, ProcessRunner, dict[str, str], FakeProvider]


@pytest.fixture
def remote_env(settings: Settings, tmp_path: Path) -> Iterator[Remote]:
    """Settings whose jobs run on the ``custom`` profile served by the fake provider (the
    llm stage's two-transaction claim), a runner passing them on, its environment (with
    :data:`ENV`'s short retry budget) and the provider."""
    with FakeProvider() as fake:
        s = chaos.chaos_settings(settings, fake.base_url, lease_s=30)
        runner = ProcessRunner(s, tmp_path / "logs")
        env = {k: v for k, v in chaos.settings_env(s).items() if k.startswith("JOBSTREAM_")}
        try:
            yield s, runner, env | ENV, fake
        finally:
            runner.kill_all()


def _on_remote(doc: Any) -> Any:
    """``doc`` (a ``document.uploaded``) asking for the ``custom`` profile (the fake
    provider)."""
    return doc.model_copy(update={"payload": doc.payload.model_copy(
        update={"model_profile": "custom"})})


def _forged(url: str, stage: str) -> list[tuple[bytes, bytes]]:
    """Schema-valid copies of ``stage``'s input event for every job, with each job's real
    ids: one of the job's generation, one of :data:`FAR_GENERATION`."""
    out = []
    for j in query(url, "SELECT job_id, tenant_id, idempotency_key, dedup_key, generation "
                        "FROM job"):
        ids = {"tenant_id": j["tenant_id"], "idempotency_key": j["idempotency_key"],
               "job_id": j["job_id"], "dedup_key": j["dedup_key"]}
        for gen in (j["generation"], FAR_GENERATION):
            ev = (TextExtracted(**ids, generation=gen, payload=TextExtractedPayload(
                      text_sha256="0" * 64, char_count=10, page_count=0))
                  if stage == "chunk" else
                  ChunksReady(**ids, generation=gen, payload=ChunksReadyPayload(
                      chunk_count=3, chunks_sha256="0" * 64)))
            out.append((str(j["job_id"]).encode(), encode_event(ev)))
    return out


@pytest.mark.parametrize("stage", ["chunk", "llm"])
def test_a_forged_early_event_at_chunk_or_remote_llm_fails_no_job(
        remote_env: Remote, stage: str) -> None:
    s, procs, env, _ = remote_env
    url = s.database_url
    procs.start("relay", **env)
    procs.start("consume-ready", **env)
    # Every stage but extract: the real jobs wait before it while the forged copies run out.
    worker = procs.start("worker", "--stages", "intake,chunk,llm,validate,publish",
                         name="no-extract", **env)
    docs = [_on_remote(text_uploaded(f"fe-{stage}-{i}",
                                     f"Forged early doc {i}. " + "Some words. " * 80))
            for i in range(N)]
    produce_raw(s, s.topic("document.uploaded"),
                [(d.idempotency_key.encode(), encode_event(d)) for d in docs])
    wait_for(lambda: query(url, "SELECT count(*) AS n FROM job")[0]["n"] == N, 60,
             "jobs accepted", procs.logs)
    assert {r["model_profile"] for r in query(url, "SELECT model_profile FROM job")} == {
        "custom"}, "the jobs must run on the remote (fake) provider"
    topic = "job.text_extracted" if stage == "chunk" else "job.chunks_ready"
    produce_raw(s, s.topic(topic), _forged(url, stage))
    # Until every copy is dead-lettered (spent, or ahead), or a copy changed its job (the
    # break: a job failed by the first copy spent, the others then skipped as terminal).
    def dead_lettered() -> int:
        text = worker.log_text()
        return text.count("retry budget exhausted") + text.count(AHEAD)
    wait_for(lambda: dead_lettered() >= 2 * N or query(
        url, "SELECT count(*) AS n FROM job WHERE status <> 'queued'")[0]["n"] > 0, 90,
             "the forged copies dead-lettered", procs.logs)
    changed = query(url, "SELECT job_id, status, error_code FROM job WHERE status <> 'queued'")
    assert changed == [], "a forged copy changed its job\n" + procs.logs()
    assert worker.log_text().count(AHEAD) == N, \
        "the far-future copies were not refused as generation_ahead\n" + procs.logs()
    assert query(url, "SELECT count(*) AS n FROM provider_attempt")[0]["n"] == 0, \
        "a forged copy reached the provider"
    procs.start("worker", "--stages", "extract", name="extract", **env)
    for r in assert_jobs_succeed_charged_once(s, procs, N):
        assert_one_succeeded_attempt_per_chunk(url, r["job_id"])


def test_a_forged_retry_count_does_not_fail_a_job_through_an_outage(remote_env: Remote) -> None:
    """A copy of a real job's ``job.chunks_ready`` (its real ids and generation) put on
    ``job.chunks_ready.retry`` with ``retry_count`` 1000 while the provider answers 503: the
    real event has budget left (50 rounds), the copy has none, and a copy spent on a
    transient error failed its job (``give_up``) before the rounds were counted in Postgres
    (migration 0044). The job must survive the outage: the provider heals and the job
    succeeds, charged once."""
    s, procs, env, fake = remote_env
    url = s.database_url
    env |= {"JOBSTREAM_RETRY_ROUNDS": "50", "JOBSTREAM_RETRY_IN_PLACE": "0",
            "JOBSTREAM_PROVIDER_MAX_ATTEMPTS": "1", "JOBSTREAM_PROVIDER_BUDGET_ATTEMPTS": "1000",
            "JOBSTREAM_PROVIDER_BACKOFF_BASE_S": "0.1", "JOBSTREAM_PROVIDER_BACKOFF_CAP_S": "0.5"}
    fake.set_script({"default": {"status": 503}})
    procs.start("relay", **env)
    procs.start("consume-ready", **env)
    worker = procs.start("worker", **env)
    doc = _on_remote(text_uploaded("rc-0", "Retry count doc. " + "Some words. " * 80))
    produce_raw(s, s.topic("document.uploaded"), [(b"rc-0", encode_event(doc))])
    wait_for(lambda: query(url, "SELECT count(*) AS n FROM provider_attempt WHERE outcome = "
                                "'transient_error'")[0]["n"] >= 2, 120,
             "the outage felt by the real event", procs.logs)
    [j] = query(url, "SELECT job_id, tenant_id, idempotency_key, dedup_key, generation FROM job")
    copy = ChunksReady(tenant_id=j["tenant_id"], idempotency_key=j["idempotency_key"],
                       job_id=j["job_id"], dedup_key=j["dedup_key"], generation=j["generation"],
                       payload=ChunksReadyPayload(chunk_count=3, chunks_sha256="0" * 64))
    def transient() -> int:
        return int(query(url, "SELECT count(*) AS n FROM provider_attempt WHERE outcome = "
                              "'transient_error'")[0]["n"])

    before = transient()
    produce_raw(s, s.topic("job.chunks_ready.retry"),
                [(str(j["job_id"]).encode(), encode_event(copy))],
                headers=[("retry_count", b"1000"), ("retry_not_before_ms", b"0")])
    # Due at once, the copy fails on its first call; before migration 0044 that failure spent
    # the job's whole budget. Four more failed calls (the copy's and the real event's rounds
    # together) are well inside the real budget of 50 rounds.
    wait_for(lambda: "retry budget exhausted" in worker.log_text()
             or query(url, "SELECT status FROM job")[0]["status"] == "failed"
             or transient() >= before + 4, 120, "the copy's first rounds", procs.logs)
    assert "retry budget exhausted" not in worker.log_text(), procs.logs()
    [job] = query(url, "SELECT status, error_code FROM job")
    assert job["status"] != "failed", f"the copy's retry_count failed the job: {job}"
    fake.set_script({})  # the outage ends
    assert_jobs_succeed_charged_once(s, procs, 1, timeout_s=180)
