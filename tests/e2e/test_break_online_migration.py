"""Breaker6: an additive migration applied while the pipeline runs (a rolling upgrade: the new
release's ``jobstream migrate`` before its processes replace the old ones; docs/design-notes.md
counts on old processes working meanwhile), with real worker, relay and ``consume-ready``
processes, shared services.

Every process keeps pooled connections, and psycopg prepares a statement server-side after
``prepare_threshold`` executions on a connection (5 by default, 0 = at once: issue 12). A
prepared statement that reads ``job.*`` or ``job_stage.*`` fails with "cached plan must not
change result type" once a column is added to the table; if the store takes that for a bug,
every job that meets it fails. Jobs submitted after the ``ALTER TABLE`` must succeed and be
applied once, like those before it, nothing dead-lettered. (Without the fix this failed 1 run
in 2 at psycopg's default threshold: a job meets the error only on a connection that had
prepared the statement; always at threshold 0.)
"""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
import pytest

from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, succeeded_and_applied, wait_for

pytestmark = pytest.mark.e2e

BEFORE, AFTER = 12, 8


def _submit(settings: Settings, folder: Path, tenant: str, first: int, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(first, first + n):
        doc = folder / f"doc-{i}.txt"
        doc.write_text(f"Document {i} of {tenant}: a lease between a harbour and a lantern "
                       f"maker, clause after clause. " * 12)
        docs.append(uploaded_event(doc, tenant_id=tenant, idempotency_key=f"{tenant}:{i}",
                                   settings=settings))
    submit(settings, docs)


def test_jobs_after_an_additive_migration_applied_while_the_pipeline_runs_succeed(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    url = settings.database_url
    tenant = f"mig-{uuid.uuid4().hex[:8]}"
    procs.pipeline()
    for i in range(BEFORE):  # one at a time: each pooled statement runs many times
        _submit(settings, tmp_path / "docs", tenant, i, 1)
        wait_for(lambda n=i + 1: succeeded_and_applied(url, tenant) == (n, n), 90,
                 f"job {i} succeeded and applied", procs.logs)
    # The next release's migration: an additive column on the tables the stages read whole.
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ALTER TABLE job ADD COLUMN breaker6_note text")
        conn.execute("ALTER TABLE job_stage ADD COLUMN breaker6_note text")
    _submit(settings, tmp_path / "docs", tenant, BEFORE, AFTER)
    total = BEFORE + AFTER
    wait_for(lambda: succeeded_and_applied(url, tenant)[0] == total
             or query(url, "SELECT 1 FROM job WHERE status NOT IN ('queued', 'running', "
                           "'succeeded')"), 90, "the later jobs to end", procs.logs)
    bad = query(url, "SELECT status, error_code, error FROM job WHERE status <> 'succeeded'")
    assert not bad, f"jobs failed by the migration: {bad}\n{procs.logs()}"
    wait_for(lambda: succeeded_and_applied(url, tenant) == (total, total), 60,
             "every job applied downstream", procs.logs)
    assert not query(url, "SELECT 1 FROM dead_letter"), "dead-lettered"
    assert all(p.popen.poll() is None for p in procs.procs), procs.logs()
