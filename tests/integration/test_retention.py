"""Retention (`jobstream gc`) on real Postgres and Kafka: only rows past their horizon go."""

from __future__ import annotations

import json
import uuid

import pytest
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from jobstream.errors import IdempotencyConflict
from jobstream.kafka import all_topics
from jobstream.settings import Settings
from jobstream.store import Store
from schemas.events import DocumentUploaded
from streams.context import StageContext
from streams.intake import handle_intake
from tests.helpers import ProcessRunner, query, text_uploaded

pytestmark = pytest.mark.integration

HORIZON = {"JOBSTREAM_OUTBOX_RETENTION_S": "3600", "JOBSTREAM_PROCESSED_EVENT_RETENTION_S": "3600",
           "JOBSTREAM_IDEMPOTENCY_RETENTION_S": "3600"}
OLD = "now() - interval '2 hours'"


def _uploaded(key: str, text: str) -> DocumentUploaded:
    return text_uploaded(key, text, tenant="gc")


def _sql(url: str, q: str, params: tuple = ()) -> None:
    query(url, q + " RETURNING 1", params)


def _gc(procs: ProcessRunner) -> dict:
    out = procs.run("gc", "--json", **HORIZON)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _set_retention_ms(settings: Settings, ms: int) -> None:
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap_servers})
    entry = ConfigEntry("retention.ms", str(ms), incremental_operation=AlterConfigOpType.SET)
    futs = admin.incremental_alter_configs([
        ConfigResource(ResourceType.TOPIC, t, incremental_configs=[entry])
        for t in all_topics(settings)])
    for f in futs.values():
        f.result(30)


def test_gc_deletes_only_rows_past_their_horizon_and_keys_stay_bound(
        settings: Settings, procs: ProcessRunner) -> None:
    url = settings.database_url
    ctx = StageContext(settings, Store(url, max_size=2))
    try:
        done_old = handle_intake(ctx, _uploaded("a", "finished long ago")).job_id
        assert handle_intake(ctx, _uploaded("a2", "finished long ago")).job_id == done_old
        open_old = handle_intake(ctx, _uploaded("b", "still running")).job_id
        done_new = handle_intake(ctx, _uploaded("c", "finished just now")).job_id
        _sql(url, f"UPDATE job SET status = 'succeeded', finished_at = {OLD} WHERE job_id = %s",
             (done_old,))
        _sql(url, "UPDATE job SET status = 'succeeded', finished_at = now() WHERE job_id = %s",
             (done_new,))
        _sql(url, f"UPDATE job_request SET created_at = {OLD}")  # every record is old

        # Outbox: the three job.accepted rows; one published long ago, one published just
        # now, one unpublished and old (never deleted, however old).
        rows = query(url, "SELECT id, (headers->>'job_id')::uuid AS job_id FROM outbox")
        by_job = {r["job_id"]: r["id"] for r in rows}
        _sql(url, f"UPDATE outbox SET published_at = {OLD} WHERE id = %s", (by_job[done_old],))
        _sql(url, "UPDATE outbox SET published_at = now() WHERE id = %s", (by_job[done_new],))
        _sql(url, f"UPDATE outbox SET created_at = {OLD} WHERE id = %s", (by_job[open_old],))
        # The compact records the relay keeps of published rows (migration 0022): one old,
        # one fresh.
        for age in (OLD, "now()"):
            _sql(url, "INSERT INTO outbox_published (id, event_id, event_type, kafka_key, "
                      f"created_at, published_at) VALUES (0, %s, 'job.ready', 'k', {age}, {age})",
                 (uuid.uuid4(),))

        # Idempotent-consumer rows: one old, one fresh.
        for age, dk in ((OLD, "1" * 64), ("now()", "2" * 64)):
            _sql(url, "INSERT INTO processed_event (key_digest, consumer_group, dedup_key, "
                      "event_type, event_id, processed_at) VALUES (processed_event_key('g', "
                      f"'job.ready', %s), 'g', %s, 'job.ready', %s, {age})",
                 (dk, dk, uuid.uuid4()))

        # Topics keep messages 7 days (broker default): a 1 h horizon is refused for
        # processed_event; the others go.
        first = _gc(procs)
        assert first["deleted"] == {"outbox": 1, "outbox_published": 1, "job_request": 2}, first
        assert len(query(url, "SELECT 1 FROM outbox_published")) == 1
        assert "redelivery window" in first["skipped"]["processed_event"]
        left = query(url, "SELECT id FROM outbox ORDER BY id")
        assert [r["id"] for r in left] == sorted([by_job[open_old], by_job[done_new]])
        assert {r["idempotency_key"] for r in query(
            url, "SELECT idempotency_key FROM job_request")} == {"b", "c"}
        assert len(query(url, "SELECT 1 FROM processed_event")) == 2

        # With topics keeping messages 1 s, a 1 h horizon is longer than any redelivery.
        _set_retention_ms(settings, 1000)
        second = _gc(procs)
        assert second["deleted"] == {"outbox": 0, "outbox_published": 0, "processed_event": 1,
                                     "job_request": 0}
        assert second["skipped"] == {}
        assert [r["dedup_key"] for r in query(url, "SELECT dedup_key FROM processed_event")] \
            == ["2" * 64]

        # The job remembers the key that created it: same body -> same job, other body ->
        # conflict, although the record is gone.
        again = handle_intake(ctx, _uploaded("a", "finished long ago"))
        assert (again.job_id, again.created) == (done_old, False)
        with pytest.raises(IdempotencyConflict):
            handle_intake(ctx, _uploaded("a", "another body"))
        # The documented cost of the horizon: a job's *second* key, reused for another body
        # after its record expired, makes a new job.
        assert handle_intake(ctx, _uploaded("a2", "another body")).job_id != done_old
    finally:
        ctx.store.close()
