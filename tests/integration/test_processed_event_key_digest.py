"""Migration 0026 (jobstream's own ``processed_event`` on the 16-byte ``key_digest``) on a
database written by the previous release: a ``job.ready`` applied by the ready applier before
the upgrade and re-delivered after it is a duplicate (applied once), a stage agent's row from
before is still found by the claim and by ``record_processed``, and a redrive's
``forget_processed`` and the retention ``gc`` find the rows by their digest."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from consumers.ddl import key_digest
from jobstream.db import QUERIES, connect, migrate
from jobstream.producer import produce_raw
from jobstream.ready_applier import build
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import database_before, job_ready, query, run_until_handled

pytestmark = pytest.mark.integration


@pytest.fixture
def old_db(endpoints) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """An empty database migrated only up to 0025 (the release before migration 0026)."""
    with database_before(endpoints.database_url, 26) as url:
        yield url


def _has_key_digest(url: str) -> bool:
    return bool(query(url, "SELECT count(*) AS n FROM information_schema.columns WHERE "
                           "table_name = 'processed_event' AND column_name = 'key_digest'"
                      )[0]["n"])


def test_an_event_applied_before_the_upgrade_is_a_duplicate_after_it(
        settings: Settings, old_db: str) -> None:
    s = settings.model_copy(update={"database_url": old_db})
    a, b = job_ready("a"), job_ready("b")
    topic = s.topic("job.ready")
    produce_raw(s, topic, [(b"k", encode_event(a))])
    first = build(s)
    run_until_handled(first, 1)
    assert (first.stats.applied, first.stats.duplicates) == (1, 0)
    assert not _has_key_digest(old_db)  # applied through the first shape

    assert "0026_processed_event_key_digest.sql" in migrate(old_db)
    assert _has_key_digest(old_db)
    rows = query(old_db, "SELECT consumer_group, event_type, dedup_key, key_digest "
                         "FROM processed_event")
    assert len(rows) == 1  # the migration's digest (SQL) is the consumer's (Python)
    assert bytes(rows[0]["key_digest"]) == key_digest(
        rows[0]["consumer_group"], rows[0]["event_type"], rows[0]["dedup_key"])

    produce_raw(s, topic, [(b"k", encode_event(e)) for e in (a, b, a)])  # re-delivered
    second = build(s)  # same group: reads the three new messages
    run_until_handled(second, 3)
    assert (second.stats.applied, second.stats.duplicates) == (1, 2)
    applied = query(old_db, "SELECT filename, count(*) AS n FROM downstream.document_analysis"
                            " GROUP BY filename ORDER BY filename")
    assert [(r["filename"], r["n"]) for r in applied] == [("a", 1), ("b", 1)]
    charges = query(old_db, "SELECT count(*) AS n FROM downstream.ledger_charge")
    assert charges[0]["n"] == 2
    assert query(old_db, "SELECT count(*) AS n FROM processed_event")[0]["n"] == 2


def test_stage_rows_from_before_the_upgrade_still_dedup_and_can_be_forgotten(
        old_db: str) -> None:
    job_id, event_id, group = uuid.uuid4(), uuid.uuid4(), "acme.jobstream-chunk"
    dk, et = "d" * 64, "job.text_extracted"
    with connect(old_db) as conn, conn.transaction():
        conn.execute("INSERT INTO document (tenant_id, sha256, content_type, size_bytes, "
                     "content) VALUES ('t', 'h', 'text/plain', 1, 'x')")
        conn.execute(
            "INSERT INTO job (job_id, tenant_id, idempotency_key, request_hash, dedup_key, "
            "request_id, document_sha256, filename, content_type, pipeline, prompt_version, "
            "model_profile, lane, status, current_stage) VALUES (%s, 't', 'k', 'rh', %s, "
            "'r', 'h', 'f.txt', 'text/plain', 'p', 'v', 'm', 'interactive', 'running', "
            "'chunk')", (job_id, dk))
        # The previous release's record_processed.
        conn.execute("INSERT INTO processed_event (consumer_group, dedup_key, event_type, "
                     "event_id, job_id) VALUES (%s, %s, %s, %s, %s) ON CONFLICT "
                     "(consumer_group, dedup_key, event_type) DO NOTHING",
                     (group, dk, et, event_id, job_id))

    assert "0026_processed_event_key_digest.sql" in migrate(old_db)
    claim = {"job_id": job_id, "group": group, "dedup_key": dk, "event_type": et,
             "stage": "chunk", "run_token": uuid.uuid4(), "lease_s": 30.0,
             "code_version": "v", "generation": 0, "idle_ms": "30000", "reads": []}
    with connect(old_db) as conn, conn.transaction():
        row = conn.execute(QUERIES["claim_job_and_stage"], claim).fetchone()
        assert row is not None and row["processed"] is True
        assert row["claim_run_token"] is None  # a processed event claims nothing
        # The same event recorded again: a duplicate (no row back); another type is new.
        assert conn.execute(QUERIES["record_processed"],
                            (group, dk, et, event_id, job_id)).fetchone() is None
        assert conn.execute(QUERIES["record_processed"], (group, dk, "job.chunks_ready",
                                                          uuid.uuid4(), job_id)).fetchone()
        # A redrive forgets both (every pair of its groups and types).
        gone = conn.execute(QUERIES["forget_processed"],
                            (dk, [group, "acme.other"], [et, "job.chunks_ready"])).rowcount
        assert gone == 2
        row = conn.execute(QUERIES["claim_job_and_stage"], claim).fetchone()
        assert row is not None and row["processed"] is False
        assert row["claim_run_token"] == claim["run_token"]
        # The retention gc deletes by digest.
        conn.execute(QUERIES["record_processed"], (group, dk, et, event_id, job_id))
        conn.execute("UPDATE processed_event SET processed_at = now() - interval '2 days'")
        n = conn.execute(QUERIES["gc_processed_event"],
                         {"horizon_s": 86400.0, "limit": 100}).rowcount
        assert n == 1
        assert conn.execute("SELECT count(*) AS n FROM processed_event").fetchone() == {"n": 0}
