"""Migration 0031 (the example downstream's dedup_key indexes as hash indexes) on a database
written by the previous release: every effect row is kept, a double apply is still reported by
``jobstream verify``'s query, and a lookup by dedup_key uses the new index."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from jobstream.db import QUERIES, connect, migrate
from tests.helpers import database_before, query

pytestmark = pytest.mark.integration


@pytest.fixture
def old_db(endpoints) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """An empty database migrated only up to 0030 (the release before migration 0031)."""
    with database_before(endpoints.database_url, 31) as url:
        yield url


def test_rows_kept_double_apply_still_found_and_lookups_use_the_hash_index(old_db: str) -> None:
    keys = [uuid.uuid4().hex * 2 for _ in range(3)]
    with connect(old_db) as conn:
        for k in keys + keys[:1]:  # keys[0] charged twice: what verify must report
            conn.execute("INSERT INTO downstream.ledger_charge (tenant_id, dedup_key, job_id, "
                         "amount_usd) VALUES ('t', %s, %s, 0.01)", (k, uuid.uuid4()))
        for k in keys:
            conn.execute("INSERT INTO downstream.document_analysis (tenant_id, dedup_key, "
                         "job_id, filename, title, summary, keywords, fields) VALUES "
                         "('t', %s, %s, 'f', 't', 's', '{}', '{}')", (k, uuid.uuid4()))
        conn.commit()
    assert "0031_downstream_dedup_hash_index.sql" in migrate(old_db)
    assert query(old_db, "SELECT count(*) AS n FROM downstream.ledger_charge")[0]["n"] == 4
    assert query(old_db, "SELECT count(*) AS n FROM downstream.document_analysis")[0]["n"] == 3
    defs = {r["indexname"]: r["indexdef"] for r in query(
        old_db, "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'downstream'")}
    for name in ("document_analysis_dedup", "ledger_charge_dedup"):
        assert "USING hash (dedup_key)" in defs[name], defs
    twice = query(old_db, QUERIES["verify_applied_twice"], {"tenant": "t"})
    assert [(r["what"], r["dedup_key"], r["n"]) for r in twice] == [
        ("downstream.ledger_charge", keys[0], 2)]
    with connect(old_db) as conn:
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(
            "EXPLAIN SELECT 1 FROM downstream.document_analysis WHERE dedup_key = %s",
            (keys[1],)))
    assert "document_analysis_dedup" in plan, plan
