"""Example downstream service: applies ``job.ready`` exactly once per dedup_key.

The effect is two rows in the downstream's own schema: the document's analysis
(``downstream.document_analysis``) and one ledger charge (``downstream.ledger_charge``), both in
the idempotent consumer's transaction. Run it with ``jobstream consume-ready``.
"""

from __future__ import annotations

import psycopg
from psycopg.types.json import Jsonb

from consumers.idempotent import IdempotentConsumer
from jobstream.db import QUERIES as Q
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


def apply_ready_batch(conn: psycopg.Connection, events: list[JobReady]) -> None:
    """:func:`apply_ready` for many events at once: two statements for the whole batch
    (caller's tx), the same rows in the same order."""
    conn.execute(Q["apply_analysis_batch"], (Jsonb([
        {"tenant_id": ev.tenant_id, "dedup_key": ev.dedup_key, "job_id": str(ev.job_id),
         "filename": ev.payload.filename, "title": ev.payload.result.title,
         "summary": ev.payload.result.summary, "keywords": ev.payload.result.keywords,
         "fields": ev.payload.result.fields} for ev in events]),))
    conn.execute(Q["apply_charge_batch"], (Jsonb([
        {"tenant_id": ev.tenant_id, "dedup_key": ev.dedup_key, "job_id": str(ev.job_id),
         "amount_usd": ev.payload.charge_usd} for ev in events]),))


def build(settings: Settings) -> IdempotentConsumer:
    """The ready applier as an :class:`IdempotentConsumer` on ``job.ready``."""
    return IdempotentConsumer(settings, group=settings.group(GROUP),
                              topics=[settings.topic("job.ready")],
                              event_types=("job.ready",), handler=apply_ready,
                              batch_handler=apply_ready_batch)
