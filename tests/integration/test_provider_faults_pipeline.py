"""Provider faults through the whole pipeline: real processes, real Kafka and Postgres, and a
real fake provider over HTTP on loopback. Counts in the fake provider and in provider_attempt
must agree."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobstream.drills.fake_provider import FakeProvider
from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.integration

LICENSES = Path("/usr/share/common-licenses")


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as fp:
        yield fp


def _env(fake: FakeProvider, **extra: str) -> dict[str, str]:
    return {"JOBSTREAM_PROVIDER_BASE_URL": fake.base_url, "JOBSTREAM_PROVIDER_TIMEOUT_S": "1",
            "JOBSTREAM_CHUNK_SIZE_CHARS": "1500", **extra}


def _submit(settings: Settings, doc: str, key: str, lane: str = "interactive",
            prompt_version: str | None = None) -> None:
    submit(settings, [uploaded_event(LICENSES / doc, tenant_id="acme", idempotency_key=key,
                                     settings=settings, lane=lane, model_profile="custom",
                                     prompt_version=prompt_version)])


def _job(settings: Settings, key: str) -> dict | None:
    rows = query(settings.database_url,
                 "SELECT j.* FROM job j JOIN job_request r USING (job_id) "
                 "WHERE r.tenant_id = 'acme' AND r.idempotency_key = %s", (key,))
    return rows[0] if rows else None


def _status(settings: Settings, key: str) -> str | None:
    j = _job(settings, key)
    return j["status"] if j else None


def _attempts(settings: Settings, job_id: object) -> list[dict]:
    return query(settings.database_url,
                 "SELECT chunk_idx, attempt, outcome, status_code, started_at FROM provider_attempt"
                 " WHERE job_id = %s ORDER BY attempt_id", (job_id,))


def _agree(fake: FakeProvider, settings: Settings, job_id: object) -> None:
    """The fake provider's per-key counts equal provider_attempt's per-chunk counts."""
    rows = query(settings.database_url,
                 "SELECT chunk_idx, count(*) AS n FROM provider_attempt WHERE job_id = %s "
                 "GROUP BY chunk_idx", (job_id,))
    ours = {f"{job_id}:{r['chunk_idx']}": r["n"] for r in rows}
    theirs = {k: v for k, v in fake.snapshot()["by_key"].items() if k.startswith(str(job_id))}
    assert ours == theirs


def test_429_with_retry_after_and_503_are_retried_then_succeed(
        settings: Settings, procs: ProcessRunner, fake: FakeProvider) -> None:
    fake.set_script({"sequence": [{"status": 429, "retry_after": "1"}, {"status": 503}]})
    procs.pipeline(**_env(fake))
    _submit(settings, "BSD", "k")
    wait_for(lambda: _status(settings, "k") == "succeeded", 90, "success", procs.logs)
    job = _job(settings, "k")
    att = _attempts(settings, job["job_id"])
    first = [a for a in att if a["chunk_idx"] == 0]
    assert [a["outcome"] for a in first] == ["transient_error", "transient_error", "succeeded"]
    assert [a["status_code"] for a in first[:1]] == [None] or first[0]["outcome"]
    # Retry-After: 1 was honoured: the second attempt started at least a second later.
    assert (first[1]["started_at"] - first[0]["started_at"]).total_seconds() >= 0.95
    _agree(fake, settings, job["job_id"])


def test_400_fails_the_job_at_once_with_a_job_failed_event(
        settings: Settings, procs: ProcessRunner, fake: FakeProvider) -> None:
    fake.set_script({"default": {"status": 400}})
    procs.pipeline(**_env(fake))
    _submit(settings, "BSD", "k")
    wait_for(lambda: _status(settings, "k") == "failed", 90, "failure", procs.logs)
    job = _job(settings, "k")
    assert job["error_code"] == "http_400"
    att = _attempts(settings, job["job_id"])
    assert [a["outcome"] for a in att] == ["permanent_error"]  # no retry of a 400
    failed = wait_for(lambda: read_topic(settings, settings.topic("job.failed")), 30,
                      "job.failed on the topic")
    assert json.loads(failed[0].value())["payload"]["error_code"] == "http_400"
    assert read_topic(settings, settings.topic("job.ready")) == []
    _agree(fake, settings, job["job_id"])


def test_timeout_interactive_is_outcome_unknown_then_retried(
        settings: Settings, procs: ProcessRunner, fake: FakeProvider) -> None:
    fake.set_script({"sequence": [{"hang_s": 3}]})
    procs.pipeline(**_env(fake))
    _submit(settings, "BSD", "k", lane="interactive")
    wait_for(lambda: _status(settings, "k") == "succeeded", 90, "success", procs.logs)
    job = _job(settings, "k")
    outcomes = [a["outcome"] for a in _attempts(settings, job["job_id"])]
    assert outcomes[:2] == ["outcome_unknown", "succeeded"], outcomes
    assert "failed" not in " ".join(outcomes)  # a timeout is never a proven failure
    _agree(fake, settings, job["job_id"])


def test_timeout_in_batch_parks_the_job_and_reconcile_retry_finishes_it(
        settings: Settings, procs: ProcessRunner, fake: FakeProvider) -> None:
    fake.set_script({"sequence": [{"hang_s": 3}]})
    procs.pipeline(**_env(fake))
    _submit(settings, "Apache-2.0", "k", lane="batch")
    wait_for(lambda: _status(settings, "k") == "needs_reconciliation", 90, "parking",
             procs.logs)
    job = _job(settings, "k")
    assert [a["outcome"] for a in _attempts(settings, job["job_id"])] == ["outcome_unknown"]
    time.sleep(2)  # parked means parked: nothing keeps calling the provider
    assert fake.snapshot()["total"] == 1
    listing = subprocess.run([sys.executable, "-m", "jobstream.cli", "reconcile"],
                             env=procs.env(COLUMNS="200"), capture_output=True, text=True)
    assert str(job["job_id"]) in listing.stdout, listing.stdout + listing.stderr
    r = subprocess.run([sys.executable, "-m", "jobstream.cli", "reconcile",
                        str(job["job_id"]), "--retry"], env=procs.env(), capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: _status(settings, "k") == "succeeded", 90, "success after reconcile",
             procs.logs)
    att = _attempts(settings, job["job_id"])
    by_chunk: dict[int, list[str]] = {}
    for a in att:
        by_chunk.setdefault(a["chunk_idx"], []).append(a["outcome"])
    assert by_chunk[0] == ["outcome_unknown", "succeeded"]
    assert all(v == ["succeeded"] for k, v in by_chunk.items() if k != 0)
    _agree(fake, settings, job["job_id"])
    applied = query(settings.database_url,
                    "SELECT count(*) AS n FROM downstream.document_analysis")[0]["n"]
    wait_for(lambda: query(settings.database_url, "SELECT count(*) AS n FROM "
                           "downstream.document_analysis")[0]["n"] == 1, 30, "applied once")
    assert applied <= 1


def test_validator_bump_reruns_only_validation_and_a_new_prompt_is_a_new_computation(
        settings: Settings, procs: ProcessRunner, fake: FakeProvider) -> None:
    env = _env(fake)
    procs.start("relay", **env)
    worker = procs.start("worker", **env)
    procs.start("consume-ready", **env)
    _submit(settings, "MPL-2.0", "k")
    wait_for(lambda: _status(settings, "k") == "succeeded", 90, "success", procs.logs)
    job = _job(settings, "k")
    calls_before = fake.snapshot()["total"]
    assert calls_before >= 2

    # Deploy a new validator: restart the workers with its code version bumped, re-drive.
    procs.kill9(worker)
    procs.start("worker", name="worker-v2",
                **env, JOBSTREAM_STAGE_CODE_VERSIONS='{"validate": "validate-2"}')
    r = subprocess.run([sys.executable, "-m", "jobstream.cli", "redrive", str(job["job_id"])],
                       env=procs.env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

    def revalidated() -> bool:
        rows = query(settings.database_url,
                     "SELECT code_version FROM job_stage WHERE job_id = %s AND stage = "
                     "'validate'", (job["job_id"],))
        return rows[0]["code_version"] == "validate-2" and _status(settings, "k") == "succeeded"
    wait_for(revalidated, 90, "validation to re-run", procs.logs)
    stages = {r["stage"]: r for r in query(
        settings.database_url, "SELECT stage, attempt, code_version FROM job_stage "
        "WHERE job_id = %s", (job["job_id"],))}
    assert stages["llm"]["attempt"] == 1  # the paid stage was not redone
    assert stages["extract"]["attempt"] == 1 and stages["chunk"]["attempt"] == 1
    assert stages["validate"]["attempt"] == 2 and stages["publish"]["attempt"] == 2
    assert fake.snapshot()["total"] == calls_before
    _agree(fake, settings, job["job_id"])

    # A new prompt version is a new computation: a new job and new provider calls.
    _submit(settings, "MPL-2.0", "k-v2", prompt_version="analysis-v2")
    wait_for(lambda: _status(settings, "k-v2") == "succeeded", 90, "v2 success", procs.logs)
    job2 = _job(settings, "k-v2")
    assert job2["job_id"] != job["job_id"] and job2["dedup_key"] != job["dedup_key"]
    assert fake.snapshot()["total"] > calls_before
    time.sleep(2)
    applied = query(settings.database_url, "SELECT dedup_key, count(*) AS n FROM "
                    "downstream.document_analysis GROUP BY dedup_key")
    assert sorted(a["n"] for a in applied) == [1, 1]


def test_failures_outliving_in_process_backoff_go_through_the_retry_topic(
        settings: Settings, procs: ProcessRunner, fake: FakeProvider) -> None:
    fake.set_script({"sequence": [{"status": 503}] * 3})
    procs.pipeline(**_env(fake, JOBSTREAM_PROVIDER_MAX_ATTEMPTS="2", JOBSTREAM_RETRY_IN_PLACE="0",
                          JOBSTREAM_RETRY_BASE_S="0.5"))
    _submit(settings, "BSD", "k")
    wait_for(lambda: _status(settings, "k") == "succeeded", 90, "success", procs.logs)
    job = _job(settings, "k")
    assert [a["outcome"] for a in _attempts(settings, job["job_id"])] == [
        "transient_error", "transient_error", "transient_error", "succeeded"]
    retried = read_topic(settings, settings.topic("job.chunks_ready.retry"))
    assert len(retried) == 1
    h = dict(retried[0].headers())
    assert h["retry_count"] == b"1" and int(h["retry_not_before_ms"]) > 0
    assert h["retry_original_topic"].decode() == settings.topic("job.chunks_ready")
    assert b"provider" in h["retry_reason"]
    _agree(fake, settings, job["job_id"])


def test_an_exhausted_retry_budget_fails_the_job_with_the_reason(
        settings: Settings, procs: ProcessRunner, fake: FakeProvider) -> None:
    fake.set_script({"default": {"status": 503}})
    procs.pipeline(**_env(fake, JOBSTREAM_PROVIDER_MAX_ATTEMPTS="2", JOBSTREAM_RETRY_IN_PLACE="0",
                          JOBSTREAM_RETRY_BASE_S="0.2", JOBSTREAM_PROVIDER_BUDGET_ATTEMPTS="4"))
    _submit(settings, "BSD", "k")
    wait_for(lambda: _status(settings, "k") == "failed", 90, "failure", procs.logs)
    job = _job(settings, "k")
    assert job["error_code"] == "retry_budget_exhausted"
    assert fake.snapshot()["total"] == 4  # the budget is a hard bound on calls
    _agree(fake, settings, job["job_id"])
    failed = wait_for(lambda: read_topic(settings, settings.topic("job.failed")), 30,
                      "job.failed")
    assert json.loads(failed[0].value())["payload"]["error_code"] == "retry_budget_exhausted"
