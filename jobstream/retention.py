"""Retention: expire published outbox rows, idempotent-consumer rows and idempotency records.

Run by ``jobstream gc`` and, every ``gc_interval_s``, by the active outbox relay. Each kind has
its own horizon (seconds, settings) and its own reason to be safe (docs/design-notes.md,
"Retention horizons"):

- ``outbox`` (``outbox_retention_s``): published rows only; nothing reads a row once the
  broker acknowledged it. Unpublished rows are never deleted. Since migration 0022 the relay
  deletes a row once it is published; what is left here are rows marked by an older relay.
- ``outbox_published`` (``outbox_retention_s``): the compact row the relay keeps of each
  published event (migration 0022), for the crash-matrix invariants and ``jobstream verify``.
- ``processed_event`` (``processed_event_retention_s``): deleted only when the horizon is
  longer than the longest time a copy of an already-processed event can still reach a
  consumer through Kafka (:func:`required_processed_horizon_s`, from the topics'
  ``retention.ms``). When that cannot be established (Kafka unreachable, a topic kept
  forever or compacted) the rows are kept and the report says why.
- ``job_request`` (``idempotency_retention_s``): records of jobs finished longer ago than the
  horizon, themselves older than it. The job keeps its first key and request hash, and a job
  exists once per dedup key, so the same request again still maps to the same job; only a
  *second* key of a job, reused with another body after the horizon, is no longer refused.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from jobstream.kafka import CONSUMED_TOPICS, STAGE_TOPICS, base_config
from jobstream.settings import Settings
from jobstream.store import Store

log = logging.getLogger("jobstream.retention")

#: Expirable tables, in the order they are collected.
TABLES = ("outbox", "outbox_published", "processed_event", "job_request")


@dataclass
class GcReport:
    """What one run did: rows ``deleted`` per table, tables ``skipped`` with the reason,
    and the horizons used (seconds)."""

    deleted: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    horizons_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON types."""
        return {"deleted": self.deleted, "skipped": self.skipped, "horizons_s": self.horizons_s}


def horizons(settings: Settings) -> dict[str, float]:
    """The horizon of each table (seconds)."""
    return {"outbox": settings.outbox_retention_s,
            "outbox_published": settings.outbox_retention_s,
            "processed_event": settings.processed_event_retention_s,
            "job_request": settings.idempotency_retention_s}


def required_processed_horizon_s(retention_ms: dict[str, float]) -> float:
    """How long an idempotent-consumer row must be kept (seconds), given ``retention_ms``:
    ``retention.ms`` per logical topic name (``math.inf`` for a topic kept forever or
    compacted; a topic absent from the dict holds nothing).

    For each consumed topic T: a copy of an event may wait in T up to its retention (a
    lagging or reset consumer), go through ``T.retry`` and ``T.dlq`` (each up to its
    retention) and be replayed into T, where it may wait once more. So
    ``2 * R(T) + R(T.retry) + R(T.dlq)``, the maximum over T. Repeated DLQ replays of one
    message, and a relay outage between produce and mark (the outbox re-publish window), come
    on top: the horizon needs a margin.
    """
    def r(name: str) -> float:
        return retention_ms.get(name, 0.0) / 1000.0

    worst = 0.0
    for t in CONSUMED_TOPICS:
        retry = r(f"{t}.retry") if t in STAGE_TOPICS else 0.0
        worst = max(worst, 2 * r(t) + retry + r(f"{t}.dlq"))
    return worst


def topic_retention_ms(settings: Settings, timeout_s: float = 10.0) -> dict[str, float]:
    """``retention.ms`` of every consumed topic and its twins, by logical name; ``math.inf``
    when kept forever (``-1``) or compacted. Topics that do not exist are left out. Raises
    ``KafkaException`` (or ``TimeoutError``) when the cluster does not answer."""
    names = [*CONSUMED_TOPICS, *(f"{t}.retry" for t in STAGE_TOPICS),
             *(f"{t}.dlq" for t in CONSUMED_TOPICS)]
    admin = AdminClient(base_config(settings))
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    wanted = {settings.topic(n): n for n in names if settings.topic(n) in existing}
    if not wanted:
        return {}
    futs = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in wanted],
                                  request_timeout=timeout_s)
    out: dict[str, float] = {}
    for res, fut in futs.items():
        cfg = fut.result(timeout_s + 1)
        ms = float(cfg["retention.ms"].value)
        compact = "compact" in (cfg["cleanup.policy"].value or "")
        out[wanted[res.name]] = math.inf if ms < 0 or compact else ms
    return out


def _processed_event_guard(settings: Settings) -> str | None:
    """``None`` when ``processed_event`` rows may be deleted at their horizon, else why not."""
    try:
        retention = topic_retention_ms(settings)
    except (KafkaException, TimeoutError) as exc:
        return f"topic retention unknown (Kafka: {exc}); rows kept"
    need = required_processed_horizon_s(retention)
    if need == math.inf:
        return "a jobstream topic is kept forever or compacted: rows kept"
    if settings.processed_event_retention_s <= need:
        return (f"processed_event_retention_s={settings.processed_event_retention_s:.0f}s is "
                f"not longer than the redelivery window of the topics ({need:.0f}s: "
                "2 x retention.ms + .retry + .dlq); rows kept")
    return None


def collect(settings: Settings, store: Store, *, max_batches: int | None = None) -> GcReport:
    """Delete the expired rows of every table, ``gc_batch_size`` rows per transaction, at
    most ``max_batches`` transactions per table (``None``: until none is left).

    Returns a :class:`GcReport`. Raises :class:`jobstream.errors.RetryableError` when
    Postgres is unavailable (rows deleted so far stay deleted).
    """
    report = GcReport(horizons_s=horizons(settings))
    guard = _processed_event_guard(settings)
    if guard is not None:
        report.skipped["processed_event"] = guard
        log.warning("gc: processed_event: %s", guard)
    for table in TABLES:
        if table in report.skipped:
            continue
        total, batches = 0, 0
        while max_batches is None or batches < max_batches:
            n = store.gc_batch(table, horizon_s=report.horizons_s[table],
                               limit=settings.gc_batch_size)
            total += n
            batches += 1
            if n < settings.gc_batch_size:
                break
        report.deleted[table] = total
    return report
