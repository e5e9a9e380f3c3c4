"""The HTTP API as a real uvicorn process against real Postgres and Kafka."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from jobstream.drills.fake_provider import FakeProvider
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, wait_for

pytestmark = pytest.mark.integration

TOKENS = {"tok-acme": "acme", "tok-other": "other"}
ACME = {"Authorization": "Bearer tok-acme"}
OTHER = {"Authorization": "Bearer tok-other"}
LICENSES = Path("/usr/share/common-licenses")


@pytest.fixture
def api(procs: ProcessRunner) -> Iterator[str]:
    url, _ = procs.start_api(TOKENS)
    yield url


def _post(url: str, key: str, body: dict, headers: dict = ACME) -> httpx.Response:
    return httpx.post(f"{url}/v1/jobs", json=body, headers={**headers, "Idempotency-Key": key},
                      timeout=30)


def test_idempotent_post_same_key_same_job_409_on_other_body_404_for_other_tenant(
        api: str, settings: Settings) -> None:
    body = {"filename": "bsd.txt", "text": (LICENSES / "BSD").read_text()}
    first = _post(api, "k1", body)
    assert first.status_code == 202, first.text
    job_id = first.json()["job_id"]
    again = _post(api, "k1", body)
    assert again.status_code == 200 and again.json()["job_id"] == job_id
    assert again.headers["Idempotent-Replayed"] == "true"

    # 20 concurrent identical POSTs with a fresh key: one job.
    body2 = {"filename": "mpl.txt", "text": (LICENSES / "MPL-2.0").read_text()}
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: _post(api, "k20", body2), range(20)))
    assert {a.status_code for a in answers} <= {200, 202}, [a.text for a in answers]
    assert sum(a.status_code == 202 for a in answers) == 1
    assert len({a.json()["job_id"] for a in answers}) == 1
    assert query(settings.database_url, "SELECT count(*) AS n FROM job_request "
                 "WHERE idempotency_key = 'k20'")[0]["n"] == 1

    up = httpx.post(f"{api}/v1/jobs/upload", headers={**ACME, "Idempotency-Key": "u1"},
                    files={"file": ("gpl1.txt", (LICENSES / "GPL-1").read_bytes(),
                                    "text/plain")}, data={"lane": "batch"}, timeout=30)
    assert up.status_code == 202, up.text
    again_up = httpx.post(f"{api}/v1/jobs/upload", headers={**ACME, "Idempotency-Key": "u1"},
                          files={"file": ("gpl1.txt", (LICENSES / "GPL-1").read_bytes(),
                                          "text/plain")}, data={"lane": "batch"}, timeout=30)
    assert again_up.status_code == 200 and again_up.json()["job_id"] == up.json()["job_id"]
    assert httpx.get(f"{api}/v1/jobs/{up.json()['job_id']}", headers=ACME).json()["lane"] \
        == "batch"

    conflict = _post(api, "k1", {"filename": "bsd.txt", "text": "something else entirely"})
    assert conflict.status_code == 409 and conflict.json()["code"] == "idempotency_key_conflict"

    assert httpx.get(f"{api}/v1/jobs/{job_id}", headers=OTHER).status_code == 404
    assert httpx.get(f"{api}/v1/jobs/{job_id}").status_code == 401
    assert _post(api, "k3", body, headers={"Authorization": "Bearer nope"}).status_code == 401
    r = httpx.post(f"{api}/v1/jobs", json=body, headers=ACME)
    assert r.status_code == 400 and r.json()["code"] == "missing_idempotency_key"
    bad = _post(api, "k4", {"text": "x", "model_profile": "no-such-model"})
    assert bad.status_code == 422 and bad.json()["code"] == "unknown_model_profile"
    # The tenant is never taken from the body.
    assert _post(api, "k5", {**body, "tenant_id": "other"}).status_code == 422


def test_get_on_a_running_job_shows_stages_and_cost_increasing_live_and_sse(
        api: str, procs: ProcessRunner, settings: Settings) -> None:
    with FakeProvider({"default": {"latency_s": 0.4}}) as fake:
        procs.pipeline(JOBSTREAM_PROVIDER_BASE_URL=fake.base_url,
                       JOBSTREAM_CHUNK_SIZE_CHARS="1500")
        r = _post(api, "live", {"filename": "gpl2.txt", "model_profile": "custom",
                                "text": (LICENSES / "GPL-2").read_text()})
        job_id = r.json()["job_id"]
        seen_cost, seen_stages = [], []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            v = httpx.get(f"{api}/v1/jobs/{job_id}", headers=ACME, timeout=10).json()
            seen_cost.append(v["cost_so_far_usd"])
            seen_stages.append(v["stages_done"])
            if v["status"] == "succeeded":
                break
            time.sleep(0.3)
        assert v["status"] == "succeeded", v
        assert len(set(seen_cost)) >= 3, seen_cost  # cost rose while the job ran
        assert seen_cost == sorted(seen_cost) and seen_stages == sorted(seen_stages)
        assert v["stages_done"] == v["stages_total"] == 6
        assert v["result"]["title"] and v["provider_attempts"]
        assert all(a["outcome"] == "succeeded" for a in v["provider_attempts"])
        assert v["queue_wait_s"] is not None and v["run_s"] > 0
        assert v["charge_usd"] > 0

        # Server-Sent Events for a finished job: progress, then end.
        with httpx.stream("GET", f"{api}/v1/jobs/{job_id}/events", headers=ACME,
                          timeout=30) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            text = "".join(resp.iter_text())
        assert "event: progress" in text and '"status": "succeeded"' in text


def test_cancelling_a_batch_mid_way_stops_provider_calls_and_ends_every_job(
        api: str, procs: ProcessRunner, settings: Settings) -> None:
    docs = [{"filename": f"doc-{i}.txt", "model_profile": "custom",
             "text": f"Document number {i}. " + "Some words make a sentence here. " * 60}
            for i in range(40)]
    with FakeProvider({"default": {"latency_s": 0.3}}) as fake:
        procs.pipeline(JOBSTREAM_PROVIDER_BASE_URL=fake.base_url,
                       JOBSTREAM_CHUNK_SIZE_CHARS="600")
        r = httpx.post(f"{api}/v1/batches", json={"documents": docs},
                       headers={**ACME, "Idempotency-Key": "b1"}, timeout=60)
        assert r.status_code == 202, r.text
        batch = r.json()
        assert batch["jobs"] == 40
        wait_for(lambda: fake.snapshot()["total"] >= 5, 60, "some provider calls", procs.logs)
        c = httpx.post(f"{api}/v1/batches/{batch['batch_id']}/cancel", headers=ACME, timeout=30)
        assert c.status_code == 202
        # The cancel has committed by now. (Not its cancel_requested_at: that is its
        # transaction's start, and an attempt whose transaction held the job's row lock when
        # the cancel's update reached it started after that and before the commit, rightly.)
        committed_by = query(settings.database_url, "SELECT clock_timestamp() AS t")[0]["t"]

        def settled() -> bool:
            v = httpx.get(f"{api}/v1/batches/{batch['batch_id']}", headers=ACME).json()
            return v["queued"] + v["running"] + v["needs_reconciliation"] == 0
        wait_for(settled, 90, "every job of the batch to end", procs.logs)
        v = httpx.get(f"{api}/v1/batches/{batch['batch_id']}", headers=ACME).json()
        assert v["cancelled"] >= 1 and v["succeeded"] + v["failed"] + v["cancelled"] == 40
        calls_at_end = fake.snapshot()["total"]
        time.sleep(3)  # nothing left that would restart work
        assert fake.snapshot()["total"] == calls_at_end
        late = query(settings.database_url,
                     "SELECT count(*) AS n FROM provider_attempt a JOIN job j USING (job_id) "
                     "WHERE j.cancel_requested AND a.started_at > %s", (committed_by,))
        assert late[0]["n"] == 0  # no provider call started after the cancel committed
        attempts = query(settings.database_url, "SELECT count(*) AS n FROM provider_attempt")
        assert attempts[0]["n"] == fake.snapshot()["total"]
        cancelled = query(settings.database_url,
                          "SELECT error_code FROM job WHERE status = 'cancelled'")
        assert {c["error_code"] for c in cancelled} == {"cancelled_by_user"}
        # A job stopped during its LLM call shows the stage it was stopped at, not the last
        # one that succeeded (chunk).
        stopped = query(settings.database_url,
                        "SELECT j.current_stage, s.stage FROM job j JOIN job_stage s "
                        "USING (job_id) WHERE j.status = 'cancelled' "
                        "AND s.error_code = 'cancelled_by_user'")
        assert stopped and all(r["current_stage"] == r["stage"] for r in stopped), stopped


def test_schemathesis_finds_no_server_errors_in_the_openapi_spec(api: str,
                                                                tmp_path: Path) -> None:
    import shutil
    import subprocess
    st = shutil.which("st") or shutil.which("schemathesis")
    assert st, "schemathesis is a test dependency (pip install -e '.[test]')"
    r = subprocess.run([st, "run", f"{api}/openapi.json", "--checks", "not_a_server_error",
                        "--header", "Authorization: Bearer tok-acme", "--max-examples", "25",
                        "--phases", "coverage,fuzzing", "--seed", "1"],
                       capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)  # its .schemathesis/ cache goes there, not in the repo
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert "passed" in r.stdout


def test_cli_submit_status_cancel_and_batch_talk_to_the_api(
        api: str, procs: ProcessRunner, settings: Settings) -> None:
    import subprocess
    import sys
    procs.pipeline()
    env = procs.env(JOBSTREAM_API_URL=api, JOBSTREAM_API_TOKEN="tok-acme", COLUMNS="200")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "jobstream.cli", *args], env=env,
                              capture_output=True, text=True, timeout=180)

    r = cli("submit", str(LICENSES / "BSD"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "succeeded" in r.stdout
    job_id = r.stdout.split("job ", 1)[1].split()[0]
    again = cli("submit", str(LICENSES / "BSD"), "--no-wait")  # same file: same intent
    assert job_id in again.stdout
    st = cli("status", job_id, "--json")
    assert json.loads(st.stdout)["status"] == "succeeded"
    c = cli("cancel", job_id)
    assert c.returncode == 0 and "succeeded" in c.stdout  # a finished job stays finished
    b = cli("batch", str(LICENSES / "CC0-1.0"), str(LICENSES / "Artistic"))
    assert b.returncode == 0, b.stdout + b.stderr
    assert "succeeded 2" in b.stdout
    bad = cli("status", job_id, "--token", "wrong")
    assert bad.returncode != 0 and "401" in bad.stderr


def test_cancel_of_a_job_whose_row_a_frozen_worker_holds_is_503_not_a_hang(
        api: str, settings: Settings) -> None:
    """A worker frozen inside a one-transaction stage holds the job's row lock until Postgres
    ends its session (up to the lease, 120 s by default): a cancel answers 503 ``row_locked``
    with Retry-After within the API's lock timeout, and succeeds once the lock is gone."""
    import psycopg
    created = _post(api, "frozen", {"filename": "bsd.txt",
                                    "text": (LICENSES / "BSD").read_text()})
    assert created.status_code == 202, created.text
    job_id = created.json()["job_id"]
    with psycopg.connect(settings.database_url) as holder:  # the frozen worker's transaction
        holder.execute("SELECT 1 FROM job WHERE job_id = %s FOR UPDATE", (job_id,))
        busy = httpx.post(f"{api}/v1/jobs/{job_id}/cancel", headers=ACME, timeout=60)
        assert busy.status_code == 503, busy.text
        assert busy.json()["code"] == "row_locked" and int(busy.headers["Retry-After"]) >= 1
        holder.rollback()
    done = httpx.post(f"{api}/v1/jobs/{job_id}/cancel", headers=ACME, timeout=60)
    assert done.status_code in (200, 202), done.text
    assert _job_cancel_flag(settings, job_id)


def _job_cancel_flag(settings: Settings, job_id: str) -> bool:
    rows = query(settings.database_url, "SELECT cancel_requested, status FROM job "
                 "WHERE job_id = %s", (job_id,))
    return bool(rows[0]["cancel_requested"] or rows[0]["status"] in ("cancelled", "succeeded"))
