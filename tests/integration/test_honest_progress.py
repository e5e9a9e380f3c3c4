"""Honest progress and the submitter's papercuts, against a real API process, workers, Kafka
and Postgres: the failed stage and error code, SSE that ends on needs_reconciliation and sends
keep-alives, a long Idempotency-Key, cancelling a finished job, and a new intent for a
computation that failed or was cancelled."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from jobstream.drills.fake_provider import FakeProvider
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, wait_for

pytestmark = pytest.mark.integration

TOKENS = {"tok-acme": "acme"}
ACME = {"Authorization": "Bearer tok-acme"}
LICENSES = Path("/usr/share/common-licenses")


@pytest.fixture
def api(procs: ProcessRunner) -> Iterator[str]:
    url, _ = procs.start_api(TOKENS, JOBSTREAM_SSE_KEEPALIVE_S="0.5")
    yield url


def _post(url: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/jobs", json=body, headers={**ACME, "Idempotency-Key": key},
                      timeout=30)


def _job(url: str, job_id: str) -> dict:
    return httpx.get(f"{url}/v1/jobs/{job_id}", headers=ACME, timeout=10).json()


def _status_is(url: str, job_id: str, *statuses: str) -> bool:
    return _job(url, job_id)["status"] in statuses


def test_long_idempotency_key_has_its_own_code_and_a_missing_one_keeps_its_own(api: str) -> None:
    body = {"filename": "a.txt", "text": "Some document with words."}
    long = _post(api, "k" * 201, body)
    assert long.status_code == 400 and long.json()["code"] == "idempotency_key_too_long", long.text
    missing = httpx.post(f"{api}/v1/jobs", json=body, headers=ACME, timeout=30)
    assert missing.status_code == 400 and missing.json()["code"] == "missing_idempotency_key"
    assert _post(api, "k" * 200, body).status_code == 202


def test_failed_job_reports_the_failed_stage_and_a_new_key_starts_a_new_run(
        api: str, procs: ProcessRunner, settings: Settings) -> None:
    text = (LICENSES / "BSD").read_text()
    with FakeProvider({"default": {"status": 400}}) as fake:
        procs.pipeline(JOBSTREAM_PROVIDER_BASE_URL=fake.base_url,
                       JOBSTREAM_CHUNK_SIZE_CHARS="4000")
        body = {"filename": "bsd.txt", "model_profile": "custom", "text": text}
        first = _post(api, "first", body)
        assert first.status_code == 202 and first.json()["dedup"] == "new"
        job_id = first.json()["job_id"]
        wait_for(lambda: _status_is(api, job_id, "failed"), 90, "the job to fail", procs.logs)
        v = _job(api, job_id)
        # the stage that failed, not the last one that succeeded (chunk)
        assert v["current_stage"] == "llm" and v["error_code"] == "http_400", v
        assert query(settings.database_url, "SELECT current_stage FROM job WHERE job_id = %s",
                     (job_id,))[0]["current_stage"] == "llm"
        listing = procs.run("jobs", "--tenant", "acme", COLUMNS="250")
        assert "llm" in listing.stdout and "http_400" in listing.stdout, listing.stdout
        assert job_id in listing.stdout  # the whole id (what redrive/status need), not cut
        shown = procs.run("status", job_id, JOBSTREAM_API_URL=api, JOBSTREAM_API_TOKEN="tok-acme",
                          COLUMNS="80")
        assert shown.returncode == 1, shown.stdout + shown.stderr  # a failed job: exit 1
        assert job_id in shown.stdout and "failed at stage llm: http_400" in shown.stdout
        with httpx.stream("GET", f"{api}/v1/jobs/{job_id}/events", headers=ACME,
                          timeout=30) as resp:
            lines = list(resp.iter_lines())
        end = json.loads(lines[lines.index("event: end") + 1].removeprefix("data: "))
        assert end == {"status": "failed", "current_stage": "llm",
                       "error_code": "http_400", "waiting_for": None}, end

        # The same key again: the same (failed) job, no new work.
        again = _post(api, "first", body)
        assert again.status_code == 200 and again.json()["dedup"] == "replayed"
        assert again.json()["status"] == "failed"
        # A new key for the failed computation: a new run of that job.
        fake.set_script({})
        second = _post(api, "second", body)
        assert second.status_code == 202, second.text
        assert second.json()["job_id"] == job_id and second.json()["dedup"] == "restarted"
        assert "new run" in second.json()["message"]
        wait_for(lambda: _status_is(api, job_id, "succeeded"), 90, "the new run to succeed",
                 procs.logs)
        # A third key for the succeeded computation reuses it: no new work.
        third = _post(api, "third", body)
        assert third.status_code == 200 and third.json()["dedup"] == "reused"
        assert "Idempotent-Replayed" not in third.headers
        def applied() -> int:
            return query(settings.database_url, "SELECT count(*) AS n FROM "
                         "downstream.document_analysis WHERE tenant_id = 'acme'")[0]["n"]
        wait_for(lambda: applied() >= 1, 30, "the result applied downstream", procs.logs)
        time.sleep(1)
        assert _job(api, job_id)["status"] == "succeeded" and applied() == 1


def test_cancel_of_a_finished_job_changes_nothing_and_a_cancelled_one_restarts(
        api: str, procs: ProcessRunner, settings: Settings) -> None:
    body = {"filename": "mit.txt", "text": (LICENSES / "Apache-2.0").read_text()[:3000]}
    # No workers yet: the job waits, the cancel ends it at once.
    r = _post(api, "c1", body)
    job_id = r.json()["job_id"]
    c = httpx.post(f"{api}/v1/jobs/{job_id}/cancel", headers=ACME, timeout=30)
    assert c.status_code == 202 and c.json()["status"] == "cancelled", c.text
    procs.pipeline()
    restarted = _post(api, "c2", body)
    assert restarted.status_code == 202 and restarted.json()["dedup"] == "restarted"
    assert restarted.json()["job_id"] == job_id
    wait_for(lambda: _status_is(api, job_id, "succeeded"), 90, "the new run to succeed",
             procs.logs)
    v = _job(api, job_id)
    assert v["cancel_requested"] is False
    # Cancelling the succeeded job: 200, its state said, no cancel_requested.
    done = httpx.post(f"{api}/v1/jobs/{job_id}/cancel", headers=ACME, timeout=30)
    assert done.status_code == 200 and done.json()["status"] == "succeeded", done.text
    assert "already ended" in done.json()["message"]
    assert _job(api, job_id)["cancel_requested"] is False
    assert query(settings.database_url, "SELECT cancel_requested FROM job WHERE job_id = %s",
                 (job_id,))[0]["cancel_requested"] is False


def test_sse_sends_keep_alives_and_ends_on_needs_reconciliation(
        api: str, procs: ProcessRunner) -> None:
    with FakeProvider({"sequence": [{"hang_s": 4}]}) as fake:
        procs.pipeline(JOBSTREAM_PROVIDER_BASE_URL=fake.base_url,
                       JOBSTREAM_PROVIDER_TIMEOUT_S="2")
        r = _post(api, "park", {"filename": "bsd.txt", "model_profile": "custom",
                                "lane": "batch", "text": (LICENSES / "BSD").read_text()})
        job_id = r.json()["job_id"]
        lines: list[str] = []
        with httpx.stream("GET", f"{api}/v1/jobs/{job_id}/events", headers=ACME,
                          timeout=httpx.Timeout(30, read=30)) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            deadline = time.monotonic() + 120
            for line in resp.iter_lines():  # ends when the server closes the stream
                lines.append(line)
                assert time.monotonic() < deadline, lines[-20:]
        assert ": keep-alive" in lines, lines  # while the provider call hung
        ends = [json.loads(ln.removeprefix("data: ")) for i, ln in enumerate(lines)
                if i and lines[i - 1] == "event: end"]
        assert len(ends) == 1, lines[-10:]
        assert ends[0]["status"] == "needs_reconciliation"
        assert ends[0]["waiting_for"] == "operator"
        assert ends[0]["current_stage"] == "llm"
        assert _job(api, job_id)["status"] == "needs_reconciliation"
