"""``unhandled`` ends the stage (issue 9): an exception nothing in the stage expects (here a
provider base URL httpx cannot parse, raised after the LLM stage was claimed) releases the claim
and fails the job at once with ``internal_error`` and a ``job.failed`` event, instead of leaving
the stage ``running`` for the sweeper; the message is dead-lettered ``unhandled`` and the worker
keeps serving. Real worker, relay, Kafka and Postgres."""

from __future__ import annotations

import json

import pytest

from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.integration


def test_an_unexpected_error_in_a_stage_fails_the_job_at_once(
        settings: Settings, procs: ProcessRunner, tmp_path) -> None:
    doc = tmp_path / "a.txt"
    doc.write_text("A short document about dead letters. " * 20)
    # The sweeper would only act after sweep_grace_s (300 s): anything faster is the new path.
    procs.start("relay")
    worker = procs.start("worker", JOBSTREAM_PROVIDER_BASE_URL="http://[::1/v1")
    submit(settings, [uploaded_event(doc, tenant_id="acme", idempotency_key="k1",
                                     settings=settings, model_profile="openai")])
    url = settings.database_url
    job = wait_for(lambda: query(url, "SELECT job_id, status, error_code FROM job "
                                      "WHERE status = 'failed'"), 90,
                   "the job failed", procs.logs)[0]
    assert job["error_code"] == "internal_error"
    stages = {r["stage"]: (r["status"], r["error_code"]) for r in query(
        url, "SELECT stage, status, error_code FROM job_stage WHERE job_id = %s",
        (job["job_id"],))}
    assert stages["llm"] == ("failed", "internal_error"), stages
    assert not [s for s, (st, _) in stages.items() if st == "running"], stages
    failed = wait_for(lambda: [json.loads(m.value()) for m in read_topic(
        settings, settings.topic("job.failed"))], 30, "job.failed on the topic")
    assert [(f["job_id"], f["payload"]["error_code"]) for f in failed] == [
        (str(job["job_id"]), "internal_error")]
    listed = json.loads(procs.run("dlq", "list", "--topic", "job.chunks_ready", "--json").stdout)
    assert [r["dlq_reason_code"] for r in listed] == ["unhandled"]
    assert "InvalidURL" in listed[0]["dlq_reason"]
    assert worker.popen.poll() is None, worker.log_text()[-3000:]
    assert "processing failed" in worker.log_text()
