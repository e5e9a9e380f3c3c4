"""Additive migrations applied WHILE a burst of jobs is in flight (breaker6's probe applies one
between jobs sent one at a time): with many events waiting, the worker runs its stages in
shared transactions (``Store.claim_and_complete_many``: the steps first without savepoints,
then a savepoint each), and statements prepared on its pooled connections meet "cached plan
must not change result type" inside a step, inside a savepoint, or alone. Real worker, relay
and ``consume-ready`` processes, shared services.

Up to sixteen migrations, job_stage and job in turn, 0.15 s apart while the burst lasts. Every
job of the burst must succeed and be applied once, none failed, nothing dead-lettered, every
process alive, and at least one statement must have met a migration.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, succeeded_and_applied, wait_for

pytestmark = pytest.mark.e2e

JOBS = 60
MIGRATIONS = 16
MIGRATION_EVERY_S = 0.15


def test_additive_migrations_while_a_burst_of_jobs_is_in_flight_fail_no_job(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    url = settings.database_url
    tenant = f"migb-{uuid.uuid4().hex[:8]}"
    procs.pipeline()
    folder = tmp_path / "docs"
    folder.mkdir()
    docs = []
    for i in range(JOBS):
        doc = folder / f"doc-{i}.txt"
        doc.write_text(f"Document {i} of {tenant}: a lease between a harbour and a lantern "
                       f"maker, clause after clause. " * 12)
        docs.append(uploaded_event(doc, tenant_id=tenant, idempotency_key=f"{tenant}:{i}",
                                   settings=settings))
    submit(settings, docs[:4])  # every statement prepared on the pooled connections first
    wait_for(lambda: succeeded_and_applied(url, tenant)[0] == 4, 90, "the first jobs",
             procs.logs)
    submit(settings, docs[4:])
    # The next release's migrations, one table at a time while the burst flows: job_stage, then
    # job, then again, every MIGRATION_EVERY_S until the burst ends (at most MIGRATIONS). One
    # migration each, taken at a fixed progress mark, could land after every statement that
    # returns the table's row type had run for the last time (CI, session 9: "inconclusive").
    wait_for(lambda: query(url, "SELECT 1 FROM job_stage s JOIN job j USING (job_id) WHERE "
                                "j.tenant_id = %s AND s.status = 'succeeded' OFFSET 8",
                           (tenant,)), 90, "the burst under way", procs.logs, every_s=0.05)
    migrated = 0
    with psycopg.connect(url, autocommit=True) as conn:
        while migrated < MIGRATIONS:
            table = ("job_stage", "job")[migrated % 2]
            conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} text").format(
                sql.Identifier(table), sql.Identifier(f"breaker7_note_{migrated}")))
            migrated += 1
            if migrated == 1:
                assert succeeded_and_applied(url, tenant)[0] < JOBS, "the burst ended before " \
                    "the migrations: probe too small"
            if succeeded_and_applied(url, tenant)[0] == JOBS:
                break
            time.sleep(MIGRATION_EVERY_S)
    wait_for(lambda: succeeded_and_applied(url, tenant)[0] == JOBS
             or query(url, "SELECT 1 FROM job WHERE status NOT IN ('queued', 'running', "
                           "'succeeded')"), 120, "every job to end", procs.logs)
    bad = query(url, "SELECT status, error_code, error FROM job WHERE status <> 'succeeded'")
    assert not bad, f"jobs failed by the migration: {bad}\n{procs.logs()}"
    wait_for(lambda: succeeded_and_applied(url, tenant) == (JOBS, JOBS), 60,
             "every job applied downstream", procs.logs)
    assert not query(url, "SELECT 1 FROM dead_letter"), "dead-lettered"
    assert all(p.popen.poll() is None for p in procs.procs), procs.logs()
    met = sum(p.log_text().count("a table changed under a prepared statement")
              for p in procs.procs)
    assert met > 0, "no statement met the migration: probe inconclusive\n" + procs.logs()
