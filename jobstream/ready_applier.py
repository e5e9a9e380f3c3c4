"""Example downstream service: applies ``job.ready`` exactly once per dedup_key.

The effect is two rows in the downstream's own schema: the document's analysis
(``downstream.document_analysis``) and one ledger charge (``downstream.ledger_charge``), both in
the idempotent consumer's transaction. Run it with ``jobstream consume-ready``.
"""

from __future__ import annotations

from decimal import Decimal

import psycopg
from psycopg.types.json import Jsonb

from consumers.idempotent import BatchHandler, Handler, Hooks, IdempotentConsumer
from consumers.settings import ConsumerSettings
from jobstream import faults, health, logs
from jobstream.db import QUERIES as Q
from jobstream.kafka import base_config
from jobstream.settings import Settings
from schemas.events import JobReady

GROUP = "downstream-ready-applier"


def apply_ready(conn: psycopg.Connection, ev: JobReady) -> None:
    """Write the analysis row and the ledger charge of one ``job.ready`` (caller's tx)."""
    r = ev.payload.result
    conn.execute(Q["apply_analysis"], (ev.tenant_id, ev.dedup_key, ev.job_id,
                                       ev.payload.filename, r.title, r.summary, r.keywords,
                                       Jsonb(r.fields)))
    conn.execute(Q["apply_charge"], (ev.tenant_id, ev.dedup_key, ev.job_id,
                                     ev.payload.charge_usd))


#: Column types of the binary COPY of :func:`apply_ready_batch`.
ANALYSIS_TYPES = ["text", "text", "uuid", "text", "text", "text", "text[]", "jsonb"]
CHARGE_TYPES = ["text", "text", "uuid", "numeric"]


def apply_ready_batch(conn: psycopg.Connection, events: list[JobReady]) -> None:
    """:func:`apply_ready` for many events at once (caller's tx): one binary ``COPY`` per
    table, the same rows in the same order. The charge goes through ``Decimal(repr(x))``, the
    same decimal text Postgres parses in :func:`apply_ready`. Raises ``psycopg.Error``
    (``DataError`` for a value Postgres refuses: the consumer then splits the batch)."""
    with conn.cursor().copy(Q["apply_analysis_copy"]) as cp:
        cp.set_types(ANALYSIS_TYPES)
        for ev in events:
            r = ev.payload.result
            cp.write_row((ev.tenant_id, ev.dedup_key, ev.job_id, ev.payload.filename, r.title,
                          r.summary, r.keywords, Jsonb(r.fields)))
    with conn.cursor().copy(Q["apply_charge_copy"]) as cp:
        cp.set_types(CHARGE_TYPES)
        for ev in events:
            cp.write_row((ev.tenant_id, ev.dedup_key, ev.job_id,
                          Decimal(repr(ev.payload.charge_usd))))


def apply_ready_batch_json(conn: psycopg.Connection, events: list[JobReady]) -> None:
    """:func:`apply_ready` for many events at once: two ``INSERT ... SELECT FROM
    jsonb_to_recordset`` statements (caller's tx), the same rows in the same order. Slower than
    :func:`apply_ready_batch` (JSON built in Python, parsed by Postgres); kept for comparison
    in ``bench.consumer``."""
    conn.execute(Q["apply_analysis_batch"], (Jsonb([
        {"tenant_id": ev.tenant_id, "dedup_key": ev.dedup_key, "job_id": str(ev.job_id),
         "filename": ev.payload.filename, "title": ev.payload.result.title,
         "summary": ev.payload.result.summary, "keywords": ev.payload.result.keywords,
         "fields": ev.payload.result.fields} for ev in events]),))
    conn.execute(Q["apply_charge_batch"], (Jsonb([
        {"tenant_id": ev.tenant_id, "dedup_key": ev.dedup_key, "job_id": str(ev.job_id),
         "amount_usd": ev.payload.charge_usd} for ev in events]),))


def consumer_settings(settings: Settings, group: str) -> ConsumerSettings:
    """The consumer library's settings for a jobstream consumer in ``group``: jobstream's
    broker, database (tables on the search path, from jobstream's migrations), limits and
    ``consumer_poison_after``."""
    return ConsumerSettings(
        bootstrap_servers=settings.kafka_bootstrap_servers, group=group,
        dsn=settings.database_url, db_schema="", topic_prefix=settings.topic_prefix,
        poison_after=settings.consumer_poison_after,
        max_message_bytes=settings.kafka_message_max_bytes,
        max_json_depth=settings.max_json_depth,
        dlq_produce_timeout_s=settings.dlq_produce_timeout_s,
        dlq_headroom_bytes=settings.dlq_headroom_bytes,
        session_timeout_ms=settings.consumer_session_timeout_ms,
        kafka_extra=settings.kafka_extra)


def idempotent_consumer(settings: Settings, *, group: str, topics: list[str],
                        event_types: tuple[str, ...], handler: Handler | None = None,
                        batch_handler: BatchHandler | None = None,
                        max_batch: int | None = None) -> IdempotentConsumer:
    """A :class:`consumers.idempotent.IdempotentConsumer` wired into jobstream: its Kafka
    config (logger, ``kafka_extra``), the shared dead-letter sink
    (:class:`jobstream.deadletter.DeadLetterSink`), readiness (``jobstream.health``), the log
    context and trace span of each message, and the ``consumer_after_apply_before_offset``
    and ``consumer_inside_transaction`` fault points."""
    from jobstream.deadletter import DeadLetterSink

    base = base_config(settings)
    return IdempotentConsumer(
        consumer_settings(settings, group), group=group, topics=topics,
        event_types=event_types, handler=handler, batch_handler=batch_handler,
        max_batch=max_batch, kafka_config={"logger": base["logger"]},
        sink=DeadLetterSink(settings, group=group),
        hooks=Hooks(db_ok=health.ok, db_failed=health.failed,
                    message_scope=logs.message_scope, bind=logs.bind,
                    after_apply=lambda: faults.point("consumer_after_apply_before_offset"),
                    in_transaction=lambda: faults.point("consumer_inside_transaction")))


def build(settings: Settings) -> IdempotentConsumer:
    """The ready applier as an :class:`IdempotentConsumer` on ``job.ready``: per event
    :func:`apply_ready`, per batch :func:`apply_ready_batch` (``@consumer.on_batch``)."""
    consumer = idempotent_consumer(settings, group=settings.group(GROUP), topics=[],
                                   event_types=())
    consumer.on(JobReady, topic=settings.topic("job.ready"))(apply_ready)
    consumer.on_batch(JobReady)(apply_ready_batch)
    return consumer
