"""Migration 0032 and ``db_prepare_threshold`` (issue 12, perf-pg5): what Postgres no longer
does per stage transaction, checked where it could silently come back.

* ``processed_event_key`` is inlined by the planner (its body, not a call through fmgr_sql,
  in the plan of a statement that uses it) and still gives the consumer library's bytes;
* the hot toasted columns are compressed with lz4;
* a pooled connection prepares a statement on its first execution.
"""

from __future__ import annotations

import pytest

from consumers.ddl import key_digest
from jobstream.db import connect
from jobstream.store import Store

pytestmark = pytest.mark.integration


def test_key_digest_is_inlined_and_unchanged(database_url: str) -> None:
    with connect(database_url, autocommit=True) as conn:
        plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(
            "EXPLAIN VERBOSE SELECT 1 FROM processed_event WHERE key_digest = "
            "processed_event_key(consumer_group, event_type, dedup_key)"))
        assert "processed_event_key(" not in plan, plan
        assert "sha256(" in plan, plan
        row = conn.execute("SELECT processed_event_key(%s, %s, %s) AS d",
                           ("grp", "stage.done", "k\u00e9y-1")).fetchone()
    assert row is not None
    assert bytes(row["d"]) == key_digest("grp", "stage.done", "k\u00e9y-1")


def test_hot_toasted_columns_use_lz4(database_url: str) -> None:
    with connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.relname || '.' || a.attname AS col, a.attcompression AS comp "
            "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
            "WHERE (c.relname, a.attname) IN (('document', 'content'), ('chunk', 'text'), "
            "('chunk', 'llm_output'), ('job_stage', 'output'), ('outbox', 'payload'))"
        ).fetchall()
    assert {r["col"]: r["comp"] for r in rows} == {
        c: "l" for c in ("document.content", "chunk.text", "chunk.llm_output",
                         "job_stage.output", "outbox.payload")}


def test_pooled_connection_prepares_on_first_execution(database_url: str) -> None:
    store = Store(database_url, max_size=1)
    try:
        with store.pool.connection() as conn:
            conn.execute("SELECT %s::int AS x", (1,))
            n = conn.execute("SELECT count(*) AS n FROM pg_prepared_statements").fetchone()
        assert n is not None and n["n"] >= 1
    finally:
        store.pool.close()


def test_worker_pool_plans_each_statement_once(database_url: str) -> None:
    """Issue 12 (perf-stage6): the stage workers' pool runs with plan_cache_mode
    force_generic_plan (``db_worker_plan_cache_mode``): a prepared statement is planned once
    per connection, never with custom plans; other processes keep the server's auto."""
    import uuid

    from jobstream.db import QUERIES
    from jobstream.settings import Settings

    s = Settings(database_url=database_url)
    assert s.db_worker_plan_cache_mode == "force_generic_plan"
    plans = {}
    for process in ("worker", "api"):
        store = Store.for_process(s, process, 1)
        try:
            with store.pool.connection() as conn:
                for _ in range(3):
                    conn.execute(QUERIES["get_job"], (uuid.uuid4(),)).fetchall()
                plans[process] = conn.execute(
                    "SELECT generic_plans, custom_plans, current_setting('plan_cache_mode') "
                    "AS mode FROM pg_prepared_statements WHERE statement LIKE "
                    "'SELECT * FROM job WHERE job_id = $1%%'").fetchone()
        finally:
            store.close()
    assert plans["worker"] == {"generic_plans": 3, "custom_plans": 0,
                               "mode": "force_generic_plan"}
    assert plans["api"] is not None and plans["api"]["custom_plans"] >= 1
    assert plans["api"]["mode"] == "auto"
