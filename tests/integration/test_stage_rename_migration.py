"""Migration 0019 (one name per stage) on a database written by the previous release: the
checkpoints, the job's current stage, the provider call log and the stage groups'
idempotent-consumer rows are renamed; a stage name from before is refused afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from jobstream.db import connect, migrate
from schemas.pipeline import OLD_NAMES, PIPELINE
from tests.helpers import database_before

pytestmark = pytest.mark.integration


@pytest.fixture
def old_db(endpoints) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """An empty database migrated only up to 0018 (the release before one name per stage)."""
    with database_before(endpoints.database_url, 19) as url:
        yield url


def test_0019_renames_every_stored_stage_name(old_db: str) -> None:
    job_id = uuid.uuid4()
    with connect(old_db) as conn, conn.transaction():
        conn.execute("INSERT INTO document (tenant_id, sha256, content_type, size_bytes, content)"
                     " VALUES ('t', 'h', 'text/plain', 1, 'x')")
        conn.execute(
            "INSERT INTO job (job_id, tenant_id, idempotency_key, request_hash, dedup_key, "
            "request_id, document_sha256, filename, content_type, pipeline, prompt_version, "
            "model_profile, lane, status, current_stage) VALUES (%s, 't', 'k', 'rh', 'dk', "
            "'r', 'h', 'f.txt', 'text/plain', 'p', 'v', 'm', 'interactive', 'running', "
            "'llm_done')", (job_id,))
        for old in OLD_NAMES:
            conn.execute("INSERT INTO job_stage (job_id, stage, status) VALUES (%s, %s, "
                         "'succeeded')", (job_id, old))
        conn.execute("INSERT INTO provider_attempt (job_id, stage, chunk_idx, attempt, "
                     "run_token, model_profile, model) VALUES (%s, 'llm_done', 0, 1, %s, 'm', "
                     "'m')", (job_id, uuid.uuid4()))
        for group in ("acme.jobstream-validated", "acme.downstream-ready-applier"):
            conn.execute("INSERT INTO processed_event (consumer_group, dedup_key, event_type, "
                         "event_id, job_id) VALUES (%s, 'dk', 'job.llm_done', %s, %s)",
                         (group, uuid.uuid4(), job_id))

    assert "0019_one_name_per_stage.sql" in migrate(old_db)

    with connect(old_db) as conn:
        stages = {r["stage"] for r in conn.execute("SELECT stage FROM job_stage")}
        assert stages == set(PIPELINE.names)
        assert conn.execute("SELECT current_stage FROM job").fetchone() == {"current_stage": "llm"}
        assert conn.execute("SELECT stage FROM provider_attempt").fetchone() == {"stage": "llm"}
        groups = {r["consumer_group"] for r in conn.execute(
            "SELECT consumer_group FROM processed_event")}
        assert groups == {"acme.jobstream-validate", "acme.downstream-ready-applier"}
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO job_stage (job_id, stage) VALUES (%s, 'text_extracted')",
                         (job_id,))
