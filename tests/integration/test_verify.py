"""``jobstream verify`` on a running pipeline: clean -> exit 0; then two guarantees broken by
hand (a second ledger charge, a stage stranded) -> exactly those reported, exit 1, and the
``jobstream_verify_broken{check}`` gauges on /metrics say the same."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import generate_latest

from jobstream import metrics, verify
from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from jobstream.store import Store
from tests.helpers import ProcessRunner, query, wait_for

STRICT = ("--grace", "0", "--outbox-age", "0", "--max-lag", "0")


def _verify(procs: ProcessRunner, *args: str) -> tuple[int, dict]:
    r = procs.run("verify", "--json", *args, timeout_s=120)
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout)


def _broken(report: dict) -> dict[str, list[list[str]]]:
    return {name: [f["job_ids"] for f in fs] for name, fs in report["checks"].items() if fs}


def test_verify_clean_then_reports_exactly_the_broken_invariants(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    procs.pipeline()
    tenant = "verify"
    events = []
    for i in range(2):
        doc = tmp_path / f"doc-{i}.txt"
        doc.write_text(f"Document {i}. " + "Some words about ledgers and parcels. " * 20)
        events.append(uploaded_event(doc, tenant_id=tenant, idempotency_key=f"k{i}",
                                     settings=settings))
    submit(settings, events)
    url = settings.database_url
    wait_for(lambda: query(url, "SELECT count(*) AS n FROM downstream.document_analysis "
                                "WHERE tenant_id = %s", (tenant,))[0]["n"] == 2, 120,
             "both jobs applied downstream", procs.logs)

    # Clean: every check holds, even with no grace at all (offsets commit within seconds).
    def clean() -> bool:
        rc, report = _verify(procs, *STRICT)
        return rc == 0 and report["ok"]
    wait_for(clean, 60, "verify to be clean", lambda: str(_verify(procs, *STRICT)),
             every_s=2)

    jobs = query(url, "SELECT job_id, dedup_key FROM job WHERE tenant_id = %s "
                      "ORDER BY job_id", (tenant,))
    charged, stranded = str(jobs[0]["job_id"]), str(jobs[1]["job_id"])
    # Break two guarantees by hand (test-only SQL): a second ledger charge for one job, and
    # the other job put back to llm with the stages after it gone, an hour ago.
    query(url, "INSERT INTO downstream.ledger_charge (tenant_id, dedup_key, job_id, amount_usd) "
               "SELECT tenant_id, dedup_key, job_id, charge_usd FROM job WHERE job_id = %s "
               "RETURNING 1", (charged,))
    query(url, "DELETE FROM job_stage WHERE job_id = %s AND stage IN ('validate', 'publish') "
               "RETURNING 1", (stranded,))
    query(url, "UPDATE job_stage SET finished_at = now() - interval '1 hour', "
               "updated_at = now() - interval '1 hour' WHERE job_id = %s RETURNING 1",
          (stranded,))
    query(url, "UPDATE outbox_published SET created_at = created_at - interval '1 hour', "
               "published_at = published_at - interval '1 hour' WHERE kafka_key = %s "
               "RETURNING 1", (stranded,))
    query(url, "UPDATE job SET status = 'running', current_stage = 'llm', "
               "finished_at = NULL, updated_at = now() - interval '1 hour' WHERE job_id = %s "
               "RETURNING 1", (stranded,))

    rc, report = _verify(procs, "--grace", "60", "--outbox-age", "0", "--max-lag", "0")
    assert rc == 1, report
    assert not report["errors"], report
    assert _broken(report) == {"applied_twice": [[charged]], "stuck_jobs": [[stranded]],
                               "stranded_stages": [[stranded]]}, report
    assert "llm succeeded" in report["checks"]["stranded_stages"][0]["detail"]
    assert "ledger_charge has 2 rows" in report["checks"]["applied_twice"][0]["detail"]

    # Text output and exit code of the plain command.
    r = procs.run("verify", "--grace", "60", timeout_s=120)
    assert r.returncode == 1 and "BROKEN stuck_jobs (1)" in r.stdout, r.stdout + r.stderr

    # The gauges on /metrics (default grace: 300 s; the stranded job is an hour old).
    store = Store(url, max_size=1)
    try:
        text = generate_latest(metrics.registry(settings, store)).decode()
    finally:
        store.close()
    for name in verify.CHECKS:
        want = 1 if name in ("applied_twice", "stuck_jobs", "stranded_stages") else 0
        assert f'jobstream_verify_broken{{check="{name}"}} {want}.0' in text, text
