"""Metrics, trace context and JSON logs after a small real pipeline run (real processes)."""

from __future__ import annotations

import json
import math
import socket
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobstream import tracing
from jobstream.kafka import PIPELINE_TOPICS
from jobstream.producer import produce_raw, uploaded_event
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.integration

LICENSES = Path("/usr/share/common-licenses")
TOKENS = {"tok-acme": "acme"}
UP_API = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UP_KAFKA = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
JOB_EVENTS = ("job.accepted", "job.text_extracted", "job.chunks_ready", "job.llm_done",
              "job.validated", "job.ready")
STAGES = ("extract", "chunk", "llm", "validate", "publish")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``{sample name: [(labels, value)]}`` of one scrape."""
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[s.name].append((s.labels, s.value))
    return out


def _one(m: dict, name: str, **labels: str) -> float:
    got = [v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(got) == 1, f"{name}{labels}: {got} (have {sorted(m)})"
    return got[0]


def test_metrics_trace_context_and_json_logs_after_a_small_pipeline_run(
        settings: Settings, procs: ProcessRunner) -> None:
    api_port, exporter_port = _free_port(), _free_port()
    env = {"JOBSTREAM_LOG_FORMAT": "json", "JOBSTREAM_METRICS_CACHE_S": "0"}
    procs.start("api", "--port", str(api_port), JOBSTREAM_API_TOKENS=json.dumps(TOKENS), **env)
    procs.start("relay", **env)
    procs.start("worker", **env)
    # The downstream logs each applied message at debug level.
    procs.start("--log-level", "debug", "consume-ready", name="consume-ready", **env)
    procs.start("metrics", "--port", str(exporter_port), **env)
    api = f"http://127.0.0.1:{api_port}"
    wait_for(lambda: _up(f"{api}/healthz"), 30, "the API to answer", procs.logs)

    # Two documents through the API (one continuing a caller's trace), one through Kafka
    # with an upstream traceparent header.
    auth = {"Authorization": "Bearer tok-acme"}
    r1 = httpx.post(f"{api}/v1/jobs", json={"filename": "bsd", "text": (LICENSES / "BSD")
                                            .read_text()},
                    headers={**auth, "Idempotency-Key": "k1", "traceparent": UP_API,
                             "X-Request-Id": "req-bsd"}, timeout=30)
    assert r1.status_code == 202, r1.text
    assert r1.headers["x-request-id"] == "req-bsd"
    r2 = httpx.post(f"{api}/v1/jobs", json={"filename": "mit", "text": (LICENSES / "Apache-2.0")
                                            .read_text()},
                    headers={**auth, "Idempotency-Key": "k2"}, timeout=30)
    assert r2.status_code == 202, r2.text
    ev = uploaded_event(LICENSES / "MPL-2.0", tenant_id="acme", idempotency_key="k3",
                        settings=settings)
    produce_raw(settings, settings.topic("document.uploaded"), [(b"k3", encode_event(ev))],
                headers=[("traceparent", UP_KAFKA.encode())])

    def finished() -> bool:
        jobs = query(settings.database_url, "SELECT status FROM job WHERE tenant_id = 'acme'")
        applied = query(settings.database_url,
                        "SELECT count(*) AS n FROM downstream.document_analysis")[0]["n"]
        return len(jobs) == 3 and all(j["status"] == "succeeded" for j in jobs) and applied == 3
    wait_for(finished, 150, "three jobs to succeed and be applied", procs.logs)
    wait_for(lambda: query(settings.database_url, "SELECT count(*) AS n FROM outbox "
                                                  "WHERE published_at IS NULL")[0]["n"] == 0,
             30, "the outbox to drain", procs.logs)

    jobs = {r["job_id"]: r for r in query(
        settings.database_url, "SELECT job_id, idempotency_key, trace_id, request_id FROM job")}
    by_key = {j["idempotency_key"]: j for j in jobs.values()}
    assert by_key["k1"]["trace_id"] == tracing.parse(UP_API).trace_id  # type: ignore[union-attr]
    assert by_key["k3"]["trace_id"] == tracing.parse(UP_KAFKA).trace_id  # type: ignore[union-attr]
    assert by_key["k1"]["request_id"] == "req-bsd"

    # Every event of a job, on every topic, carries a traceparent of the job's trace.
    traces: dict[str, set[str]] = defaultdict(set)
    seen: dict[str, set[str]] = defaultdict(set)
    for topic in PIPELINE_TOPICS[1:]:
        for m in read_topic(settings, settings.topic(topic)):
            h = {k: v.decode() for k, v in m.headers() or []}
            span = tracing.parse(h.get("traceparent"))
            assert span is not None, f"{topic}: no valid traceparent in {h}"
            traces[h["job_id"]].add(span.trace_id)
            seen[h["job_id"]].add(h["event_type"])
    assert len(traces) == 3
    for job_id, ids in traces.items():
        assert ids == {jobs[uuid.UUID(job_id)]["trace_id"]}, (job_id, ids)
        assert seen[job_id] == set(JOB_EVENTS)

    # /metrics on the API: the named metrics with plausible values.
    def settled() -> dict | None:
        m = _scrape(f"{api}/metrics")
        lag = {lab["group"]: v for lab, v in m.get("jobstream_consumer_group_lag_messages", [])}
        want = {settings.group("jobstream-streams"), settings.group("downstream-ready-applier")}
        return m if want <= set(lag) and all(lag[g] == 0 for g in want) else None
    m = wait_for(settled, 30, "consumer lag of both groups to reach 0", procs.logs, every_s=1)
    assert _one(m, "jobstream_metrics_source_up", source="postgres") == 1
    assert _one(m, "jobstream_metrics_source_up", source="kafka") == 1
    assert _one(m, "jobstream_jobs_created_total", lane="interactive") == 3
    assert _one(m, "jobstream_jobs_accepted", lane="interactive") == 3
    assert _one(m, "jobstream_jobs", lane="interactive", status="succeeded") == 3
    for stage in STAGES:
        assert _one(m, "jobstream_stage_runs_total", stage=stage) >= 3
        assert _one(m, "jobstream_lease_expired_total", stage=stage) == 0
        assert _one(m, "jobstream_leases_expired", stage=stage) == 0
        # Every stage of the three jobs finished inside the window: 3 observations each.
        assert _one(m, "jobstream_stage_duration_seconds_bucket", stage=stage,
                    lane="interactive", le="+Inf") == 3
        assert _one(m, "jobstream_queue_wait_seconds_gcount", stage=stage,
                    lane="interactive") == 3
        assert _one(m, "jobstream_queue_wait_seconds_gsum", stage=stage,
                    lane="interactive") >= 0
    assert 0 <= _one(m, "jobstream_job_retry_rate") < 1
    calls = query(settings.database_url, "SELECT count(*) AS n, sum(cost_usd)::float8 AS usd "
                                         "FROM provider_attempt")[0]
    assert calls["n"] >= 3
    assert _one(m, "jobstream_provider_attempts_total", outcome="succeeded",
                model_profile="local") == calls["n"]
    assert _one(m, "jobstream_provider_unknown_outcomes_total", model_profile="local") == 0
    assert math.isclose(_one(m, "jobstream_cost_per_accepted_job_usd"), calls["usd"] / 3,
                        abs_tol=1e-9)
    assert _one(m, "jobstream_outbox_backlog") == 0
    assert _one(m, "jobstream_outbox_oldest_age_seconds") == 0
    topics = {lab["topic"] for lab, _ in m["jobstream_consumer_lag_messages"]
              if lab["group"] == settings.group("jobstream-streams")}
    assert settings.topic("job.accepted") in topics

    # The standalone exporter serves the same numbers.
    exporter = f"http://127.0.0.1:{exporter_port}/metrics"
    wait_for(lambda: _up(exporter), 30, "the exporter to answer", procs.logs)
    e = _scrape(exporter)
    assert _one(e, "jobstream_jobs_created_total", lane="interactive") == 3
    assert _one(e, "jobstream_outbox_backlog") == 0
    assert {lab["group"] for lab, _ in e["jobstream_consumer_group_lag_messages"]} >= {
        settings.group("jobstream-streams"), settings.group("downstream-ready-applier")}

    # JSON logs: the worker's stage lines carry the job's ids, tenant, stage and trace.
    records = [json.loads(line) for p in procs.procs if p.name in ("worker", "consume-ready")
               for line in p.log_text().splitlines() if line.startswith("{")]
    done = [r for r in records if "-> done" in r["message"]]
    assert len(done) == 3 * len(STAGES), [r["message"] for r in records][-20:]
    for r in done:
        job = jobs[uuid.UUID(r["job_id"])]
        assert r["tenant"] == "acme" and r["stage"] in STAGES
        assert r["request_id"] == job["request_id"] and r["trace_id"] == job["trace_id"]
    applied = [r for r in records if r["message"].startswith("applied ")]
    assert len(applied) == 3, [r["message"] for r in records][-20:]
    for r in applied:
        assert r["group"] == settings.group("downstream-ready-applier")
        assert r["trace_id"] == jobs[uuid.UUID(r["job_id"])]["trace_id"]
        assert r["event_type"] == "job.ready" and r["tenant"] == "acme"
