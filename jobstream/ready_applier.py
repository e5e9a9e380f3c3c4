"""Example downstream service: applies ``job.ready`` exactly once per dedup_key.

The effect is two rows in the downstream's own schema: the document's analysis
(``downstream.document_analysis``) and one ledger charge (``downstream.ledger_charge``), both in
the idempotent consumer's transaction. Run it with ``jobstream consume-ready``.
"""

from __future__ import annotations

import functools
import json
import struct
import weakref
from decimal import Decimal
from typing import Any

import orjson
import psycopg
from psycopg import pq
from psycopg.adapt import Dumper
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from consumers.idempotent import BatchHandler, Handler, Hooks, IdempotentConsumer
from consumers.settings import ConsumerSettings
from jobstream import faults, health, logs
from jobstream.db import QUERIES as Q
from jobstream.kafka import base_config
from jobstream.settings import Settings
from schemas import fastpath
from schemas.events import JobReady

GROUP = "downstream-ready-applier"


def apply_ready(conn: psycopg.Connection, ev: JobReady) -> None:
    """Write the analysis row and the ledger charge of one ``job.ready`` (caller's tx).
    Prepared statements (``prepare=True``): a consumer frozen while sending an event's
    parameters, after its ``processed_event`` row, stays ``idle in transaction``, which the
    consumer's ``idle_in_transaction_session_timeout`` ends (see :func:`apply_ready_rows`)."""
    r = ev.payload.result
    conn.execute(Q["apply_analysis"], (ev.tenant_id, ev.dedup_key, ev.job_id,
                                       ev.payload.filename, r.title, r.summary, r.keywords,
                                       Jsonb(r.fields)), prepare=True)
    conn.execute(Q["apply_charge"], (ev.tenant_id, ev.dedup_key, ev.job_id,
                                     ev.payload.charge_usd), prepare=True)


#: Binary formats (PostgreSQL's send/recv functions). A batch's rows travel as one array
#: parameter per effect table, of the composite types of migration 0035: an array header
#: (1 dimension, no NULLs, the element type's oid, length, lower bound 1), then per row its
#: length and the composite: the number of fields, then per field its type oid, its length
#: and its bytes.
_I32 = struct.Struct(">i")
_ARRAY = struct.Struct(">iiIii")
#: A text[] field: its type oid and length, then the array header of its text elements.
_KEYWORDS = struct.Struct(">Iiiiiii")
_NUMERIC = struct.Struct(">hhHH")
_TEXT, _UUID, _JSONB, _NUMERIC_OID = (struct.pack(">I", oid) for oid in (25, 2950, 3802, 1700))
_ANALYSIS_FIELDS = _I32.pack(8)
_CHARGE_FIELDS = _I32.pack(4)
_UUID_LEN = _I32.pack(16)
#: The composite types' names (migration 0035), their oids read once per connection.
ANALYSIS_ROW_TYPE = "downstream.ready_analysis_row"
CHARGE_ROW_TYPE = "downstream.ready_charge_row"


@functools.lru_cache(maxsize=1024)
def _tenant(s: str) -> bytes:
    """A ``text`` field (oid, length, UTF-8) of a tenant id, cached (a few tenants repeat)."""
    b = s.encode()  # strict UTF-8: a lone surrogate raises UnicodeEncodeError, as psycopg does
    return _TEXT + _I32.pack(len(b)) + b


def _jsonb_text(value: object) -> bytes:
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):  # an int beyond 64 bits, a lone surrogate:
        return json.dumps(value).encode()          # what psycopg's Jsonb sends (json.dumps)


@functools.lru_cache(maxsize=4096)
def _numeric(value: float) -> bytes:
    """PostgreSQL's binary ``numeric`` of ``Decimal(repr(value))`` (the decimal text
    :func:`apply_ready` sends), with its type oid: base-10000 digits around the decimal point,
    cached per value (charges repeat). Raises ``ValueError`` for NaN or an infinity (the
    per-event path then sends it and Postgres decides)."""
    dec = Decimal(repr(value))
    if not dec.is_finite():
        raise ValueError(f"not a finite number: {value!r}")
    exp = dec.as_tuple().exponent
    assert isinstance(exp, int)
    whole, _, frac = format(abs(dec), "f").partition(".")
    whole = whole.lstrip("0")
    whole = "0" * (-len(whole) % 4) + whole
    frac += "0" * (-len(frac) % 4)
    groups = [int(whole[i:i + 4]) for i in range(0, len(whole), 4)]
    weight = len(groups) - 1
    groups += [int(frac[i:i + 4]) for i in range(0, len(frac), 4)]
    while groups and groups[0] == 0:
        groups.pop(0)
        weight -= 1
    while groups and groups[-1] == 0:
        groups.pop()
    if not groups:
        weight = 0
    data = (_NUMERIC.pack(len(groups), weight, 0x4000 if dec.is_signed() and groups else 0,
                          max(0, -exp)) + struct.pack(f">{len(groups)}H", *groups))
    return _NUMERIC_OID + _I32.pack(len(data)) + data


def copy_rows(ev: JobReady | fastpath.Ready) -> tuple[bytes, bytes]:
    """The binary rows of one ``job.ready``: ``(analysis row, charge row)``, each one array
    element (its length, then a ``downstream.ready_analysis_row`` / ``ready_charge_row``
    composite in binary), with the same values :func:`apply_ready` inserts (the charge through
    ``Decimal(repr(x))``). ``ev``: the model, or the fast path's checked struct
    (:func:`schemas.fastpath.decode_ready`: the same attribute names and values, so the same
    bytes; ``occurred_at`` is not read). Pure Python with no connection: the consumer runs it
    in its decode-ahead thread (``@consumer.on_batch(JobReady, prepare=copy_rows,
    light=True)``: no model is built for the batch path). Raises
    ``UnicodeEncodeError`` (a string that is not valid Unicode) or ``ValueError`` (a charge
    that is not finite); the batch is then split and the event applied alone by
    :func:`apply_ready`. (The name is from when these were binary ``COPY`` rows.)"""
    payload = ev.payload
    r = payload.result
    pack = _I32.pack
    # Every text field encoded with strict UTF-8: a lone surrogate raises UnicodeEncodeError,
    # as psycopg does. Inlined (no helper per field): this runs once per event.
    dedup, filename = ev.dedup_key.encode(), payload.filename.encode()
    title, summary = r.title.encode(), r.summary.encode()
    head = b"".join((_tenant(ev.tenant_id), _TEXT, pack(len(dedup)), dedup, _UUID, _UUID_LEN,
                     ev.job_id.bytes))
    # append, not `parts += (len, bytes)`: no tuple per keyword (the loop was ~half of this)
    parts: list[bytes] = []
    add = parts.append
    for word in r.keywords:
        b = word.encode()
        add(pack(len(b)))
        add(b)
    keywords = b"".join(parts)
    fields = _jsonb_text(r.fields)
    analysis = b"".join((
        _ANALYSIS_FIELDS, head, _TEXT, pack(len(filename)), filename, _TEXT, pack(len(title)),
        title, _TEXT, pack(len(summary)), summary,
        _KEYWORDS.pack(1009, len(keywords) + 20, 1, 0, 25, len(r.keywords), 1), keywords,
        _JSONB, pack(len(fields) + 1), b"\x01", fields))  # jsonb binary format version 1
    charge = b"".join((_CHARGE_FIELDS, head, _numeric(payload.charge_usd)))
    return pack(len(analysis)) + analysis, pack(len(charge)) + charge


class _BinaryParam(bytes):
    """A query parameter already in Postgres's binary format; its type is the query's cast."""


class _BinaryParamDumper(Dumper):
    format = pq.Format.BINARY

    def dump(self, obj: Any) -> bytes:
        return obj  # a _BinaryParam is bytes already: no copy of the batch


#: connection -> (oid of ready_analysis_row, oid of ready_charge_row); the connection's
#: adapters know _BinaryParam once it is here.
_ROW_TYPES: weakref.WeakKeyDictionary[psycopg.Connection[Any], tuple[int, int]] = (
    weakref.WeakKeyDictionary())


def _row_types(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    got = _ROW_TYPES.get(conn)
    if got is None:
        row = conn.cursor(row_factory=tuple_row).execute(
            Q["ready_row_type_oids"], (ANALYSIS_ROW_TYPE, CHARGE_ROW_TYPE)).fetchone()
        if row is None or row[0] is None or row[1] is None:
            raise RuntimeError(f"{ANALYSIS_ROW_TYPE} / {CHARGE_ROW_TYPE} missing: run "
                               "`jobstream migrate` (migration 0035)")
        conn.adapters.register_dumper(_BinaryParam, _BinaryParamDumper)
        got = _ROW_TYPES[conn] = (int(row[0]), int(row[1]))
    return got


def _array(oid: int, elements: list[bytes]) -> _BinaryParam:
    return _BinaryParam(b"".join([_ARRAY.pack(1, 0, oid, len(elements), 1), *elements]))


def apply_ready_rows(conn: psycopg.Connection[Any], rows: list[tuple[bytes, bytes]]) -> None:
    """Write the :func:`copy_rows` of many events (caller's tx): one ``INSERT ... SELECT *
    FROM unnest($1::downstream.ready_analysis_row[])`` per table, its rows as ONE binary array
    parameter, in order. Each statement is prepared on first use (``prepare=True``), so its
    parameters arrive in a Bind message that directly follows a ReadyForQuery: a consumer
    frozen while sending it leaves its session ``idle in transaction``, and the library's
    ``idle_in_transaction_session_timeout`` ends it (with a binary ``COPY FROM STDIN`` the
    session stayed ``active`` and nothing ended it; docs/design-notes.md). Raises
    ``psycopg.Error`` (``DataError`` for a value Postgres refuses, e.g. a charge over
    ``numeric(14, 8)``: the consumer then splits the batch)."""
    analysis_oid, charge_oid = _row_types(conn)
    conn.execute(Q["apply_analysis_rows"], (_array(analysis_oid, [a for a, _ in rows]),),
                 prepare=True)
    conn.execute(Q["apply_charge_rows"], (_array(charge_oid, [c for _, c in rows]),),
                 prepare=True)


def apply_ready_batch(conn: psycopg.Connection[Any], events: list[JobReady]) -> None:
    """:func:`apply_ready` for many events at once (caller's tx): one ``INSERT ... SELECT FROM
    unnest`` of a binary array per table (:func:`copy_rows`, :func:`apply_ready_rows`), the
    same rows in the same order. Raises ``psycopg.Error`` (``DataError`` for a value Postgres
    refuses: the consumer then splits the batch), ``UnicodeEncodeError`` or ``ValueError``
    (see :func:`copy_rows`)."""
    apply_ready_rows(conn, [copy_rows(ev) for ev in events])


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
    broker, database (tables on the search path, from jobstream's migrations), limits
    (``consumer_batch_max_bytes`` included) and ``consumer_poison_after``."""
    return ConsumerSettings(
        bootstrap_servers=settings.kafka_bootstrap_servers, group=group,
        dsn=settings.database_url, db_schema="", topic_prefix=settings.topic_prefix,
        poison_after=settings.consumer_poison_after,
        batch_max_bytes=settings.consumer_batch_max_bytes,
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
    :func:`apply_ready`, per batch :func:`apply_ready_rows` of the :func:`copy_rows` the
    decode-ahead thread prepared from the fast path's structs, no model built
    (``@consumer.on_batch(JobReady, prepare=copy_rows, light=True)``)."""
    consumer = idempotent_consumer(settings, group=settings.group(GROUP), topics=[],
                                   event_types=())
    consumer.on(JobReady, topic=settings.topic("job.ready"))(apply_ready)
    consumer.on_batch(JobReady, prepare=copy_rows, light=True)(apply_ready_rows)
    return consumer
