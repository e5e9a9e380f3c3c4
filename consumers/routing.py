"""Route a consumed message that cannot be processed: one implementation for every consumer.

Used by jobstream's faust stage agents (``streams/base.py``, through ``jobstream.deadletter``)
and the idempotent consumer (``consumers/idempotent.py``); it imports only confluent-kafka,
psycopg and ``schemas``.

- :func:`classify` says how a failure must be treated: ``poison`` (the message itself is bad:
  dead-letter it and move on), ``transient`` (a dependency is away: retry, skip nothing) or
  ``bug`` (anything else: the caller decides, e.g. dead-letter ``unhandled`` or retry a few
  times first, see :class:`FailureCounter`).
- :class:`DeadLetterSink` makes a dead letter durable: ``<topic>.dlq`` first; when that produce
  fails (too large, refused, not acknowledged within ``dlq_produce_timeout_s``) the original
  key, value, headers, position and reason go to the Postgres ``dead_letter`` table (jobstream's
  migration 0008, or :func:`consumers.ddl.create_tables` standalone) and a small reference
  record (no value, header ``dlq_stored=dead_letter:<id>``) is put on the DLQ where possible.
  :meth:`DeadLetterSink.send` returns only once one of them is durable, so the caller may
  then store or commit the offset; it raises :class:`RetryableError` otherwise (and the
  caller must not move past the message).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException, Producer
from psycopg import sql
from psycopg.rows import DictRow, dict_row

from consumers.headers import dlq_headers
from schemas.errors import OutcomeUnknown, PoisonMessage, RetryableError

log = logging.getLogger("consumers.routing")

DLQ_SUFFIX = ".dlq"
#: Header of a DLQ reference record: ``dead_letter:<id>`` of the row that holds the original.
STORED_HEADER = "dlq_stored"
#: Header naming the topic a dead letter was read from when it is not ``dlq_original_topic``
#: (the ``.retry`` twin): ``dlq_original_partition``/``offset`` are positions in that topic.
CONSUMED_TOPIC_HEADER = "dlq_consumed_topic"
#: Reason code of a handler error that kept failing the same message (idempotent consumer).
HANDLER_ERROR = "handler_error"
#: Reason code of an exception nothing expected (stage agents).
UNHANDLED = "unhandled"
#: Reason code of bytes or strings the database cannot store (``psycopg.DataError``).
INVALID_DATA = "invalid_data"

#: The default dead-letter table (unqualified: found on the search_path).
DEAD_LETTER = sql.Identifier("dead_letter")

Headers = Sequence[tuple[str, bytes | str | None]]


def safe_text(text: str, limit: int = 2000) -> str:
    """``text`` cut to ``limit`` characters, with NUL (which Postgres text cannot hold) and
    lone surrogates escaped: safe for a reason column, a log line or a header."""
    return (text[:limit].replace("\x00", "\\x00")
            .encode("utf-8", "backslashreplace").decode("utf-8"))


#: Postgres unavailable, or this session ended under us (idle in transaction past its limit,
#: e.g. a process paused mid-batch: SQLSTATE class 25 makes that an InternalError): an outage.
DB_OUTAGE = (psycopg.OperationalError, psycopg.errors.IdleInTransactionSessionTimeout)
#: Data Postgres refuses: bad data, never an outage, although psycopg files SQLSTATE class 54
#: (program limits: an index row over btree's 2704 bytes, too many columns or arguments) under
#: ``OperationalError``. Dead-lettered as ``invalid_data``; retried, they blocked a partition.
REFUSED_DATA = (psycopg.DataError, psycopg.errors.ProgramLimitExceeded,
                psycopg.errors.StatementTooComplex, psycopg.errors.TooManyColumns,
                psycopg.errors.TooManyArguments, UnicodeEncodeError)


def is_outage(exc: BaseException) -> bool:
    """True when ``exc`` means Postgres is away or ended this session (:data:`DB_OUTAGE`), not
    that it refused the data (:data:`REFUSED_DATA`)."""
    return isinstance(exc, DB_OUTAGE) and not isinstance(exc, REFUSED_DATA)


def classify(exc: BaseException) -> tuple[str, str]:
    """``(kind, code)`` of a failure while decoding or handling one message.

    ``kind``: ``poison`` (:class:`PoisonMessage` with its code; :data:`REFUSED_DATA`, e.g.
    ``psycopg.DataError``, a Postgres limit or a ``UnicodeEncodeError`` of a query parameter
    -> ``invalid_data``), ``transient``
    (:class:`RetryableError`, :class:`OutcomeUnknown`, :data:`DB_OUTAGE`, a
    retriable ``KafkaException``) or ``bug`` (anything else, code ``unhandled``).
    """
    if isinstance(exc, PoisonMessage):
        return "poison", exc.code
    if isinstance(exc, REFUSED_DATA):  # e.g. a lone surrogate, an index row too large
        return "poison", INVALID_DATA
    if isinstance(exc, RetryableError | OutcomeUnknown):
        return "transient", exc.code
    if isinstance(exc, DB_OUTAGE):
        return "transient", "db_unavailable"
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError) \
            and exc.args[0].retriable():
        return "transient", "kafka_unavailable"
    return "bug", UNHANDLED


def describe(exc: BaseException) -> str:
    """``"<ExceptionType>: <message>"``, made safe (:func:`safe_text`)."""
    return safe_text(f"{type(exc).__name__}: {exc}")


class FailureCounter:
    """How many times in a row the same error failed the same message.

    ``record(position, exc)`` returns the count for ``position`` (any hashable, e.g.
    ``(topic, partition, offset)``): it restarts at 1 when the error differs from the last one
    seen there (type and message). ``forget(position)`` drops it once the message is done.
    """

    def __init__(self) -> None:
        self._seen: dict[Any, tuple[str, int]] = {}

    def record(self, position: Any, exc: BaseException) -> int:
        sig = describe(exc)
        last, n = self._seen.get(position, ("", 0))
        n = n + 1 if last == sig else 1
        self._seen[position] = (sig, n)
        return n

    def forget(self, position: Any) -> None:
        self._seen.pop(position, None)


@dataclass(frozen=True)
class Routed:
    """Where a dead letter went: ``"topic"`` (on ``<topic>.dlq``) or ``"table"`` (row
    ``dead_letter_id`` of the ``dead_letter`` table; ``dlq_error`` says why not the topic)."""

    where: str
    dead_letter_id: int | None = None
    dlq_error: str | None = None


class DeadLetterSink:
    """Durable dead letters for consumer group ``group`` (see the module docstring).

    Thread-safe; one per process is enough. Its producer allows messages up to
    ``max_message_bytes + dlq_headroom_bytes`` (the DLQ topics' size) and gives up on a
    delivery after ``dlq_produce_timeout_s``.

    Examples
    --------
    >>> sink = DeadLetterSink({"bootstrap.servers": "127.0.0.1:9092"},
    ...                       dsn="postgresql://...", group="billing", max_message_bytes=1048576)
    >>> sink.send(topic="job.ready", partition=0, offset=42, key=b"k", value=b"{",
    ...           headers=[], code="undecodable", reason="bad JSON")  # doctest: +SKIP
    Routed(where='topic', dead_letter_id=None, dlq_error=None)
    """

    def __init__(self, kafka_config: dict[str, Any], *, dsn: str, group: str,
                 max_message_bytes: int, dlq_produce_timeout_s: float = 30.0,
                 dlq_headroom_bytes: int = 65_536,
                 table: sql.Composable = DEAD_LETTER) -> None:
        """Parameters
        ----------
        kafka_config : dict
            librdkafka settings of the DLQ producer (``bootstrap.servers`` at least);
            idempotence, acks, sizes and timeouts are set here.
        dsn : str
            Postgres connection string of the fallback ``dead_letter`` table.
        group : str
            Consumer group recorded with each dead letter.
        max_message_bytes : int
            Largest message the source topics accept (bytes); the DLQ producer allows
            ``dlq_headroom_bytes`` more for the ``dlq_*`` headers.
        dlq_produce_timeout_s : float
            Seconds a DLQ delivery may take before the table is used instead.
        table : psycopg.sql.Composable
            The fallback table (e.g. ``sql.Identifier("myschema", "dead_letter")``).
        """
        self.dsn = dsn
        self.group = group
        self.table = table
        self.dlq_produce_timeout_s = dlq_produce_timeout_s
        timeout_ms = int(dlq_produce_timeout_s * 1000)
        self._producer = Producer({
            "enable.idempotence": True, "acks": "all", "compression.type": "lz4",
            **kafka_config,
            "client.id": f"{group}-dlq", "linger.ms": 0,
            "message.max.bytes": max_message_bytes + dlq_headroom_bytes,
            "message.timeout.ms": timeout_ms,
            "request.timeout.ms": min(30_000, timeout_ms),
        })

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is still queued (at most ``timeout_s``)."""
        self._producer.flush(timeout_s)

    def _produce(self, topic: str, key: bytes | None, value: bytes | None,
                 headers: list[tuple[str, bytes | str | None]]) -> str | None:
        """Produce one message and wait for its delivery report; ``None`` when acknowledged,
        else why not (text)."""
        result: list[KafkaError | None] = []
        done = threading.Event()

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            result.append(err)
            done.set()

        try:
            self._producer.produce(topic, key=key, value=value, headers=headers,
                                   on_delivery=on_delivery)
        except (KafkaException, BufferError, TypeError, ValueError) as exc:
            return describe(exc)
        wait_s = self.dlq_produce_timeout_s + 5
        deadline = time.monotonic() + wait_s
        # poll() serves delivery callbacks (any thread's); several threads may wait at once.
        while not done.is_set() and time.monotonic() < deadline:
            self._producer.poll(0.1)
        if not done.is_set():
            return f"not acknowledged within {wait_s:.0f}s"
        err = result[0]
        return None if err is None else f"{err.name()}: {err.str()}"

    def send(self, *, topic: str, partition: int, offset: int, key: bytes | None,
             value: bytes | None, headers: Headers, code: str, reason: str,
             consumed_topic: str | None = None, job_id: uuid.UUID | str | None = None
             ) -> Routed:
        """Dead-letter one message and return once it is durable.

        ``topic``: full name of the message's topic (its DLQ is ``<topic>.dlq``, replay goes
        back there); ``consumed_topic``: where it was actually read (e.g. the ``.retry`` twin;
        default ``topic``) at ``partition``/``offset``. ``headers``: the original headers
        (``dlq_*`` ones are replaced). Raises :class:`RetryableError` ``dead_letter_failed``
        when neither the DLQ nor Postgres took it: the caller must not store the offset.
        """
        reason = safe_text(reason)
        kept = [(k, v) for k, v in headers if not k.startswith("dlq_")]
        dlq_topic = topic + DLQ_SUFFIX
        hdrs = kept + list(dlq_headers(code, reason, topic, partition, offset,
                                           self.group).items())
        if consumed_topic and consumed_topic != topic:  # read from the .retry twin
            hdrs.append((CONSUMED_TOPIC_HEADER, consumed_topic.encode()))
        why = self._produce(dlq_topic, key, value, hdrs)
        if why is None:
            log.warning("dead-lettered %s[%d]@%d to %s: %s: %s", consumed_topic or topic,
                        partition, offset, dlq_topic, code, reason)
            return Routed("topic")
        try:
            row_id = self.store(topic=topic, consumed_topic=consumed_topic or topic,
                                partition=partition, offset=offset, key=key, value=value,
                                headers=kept, code=code, reason=reason, dlq_error=why,
                                job_id=job_id)
        except RetryableError as exc:
            raise RetryableError(f"dead letter of {topic}[{partition}]@{offset} not durable: "
                                 f"{dlq_topic}: {why}; postgres: {exc}",
                                 code="dead_letter_failed") from None
        log.warning("dead-lettered %s[%d]@%d to table dead_letter id=%d (%s refused it: %s): "
                    "%s: %s", consumed_topic or topic, partition, offset, row_id, dlq_topic, why,
                    code, reason)
        ref = hdrs + [(STORED_HEADER, f"dead_letter:{row_id}".encode())]
        ref_key = key if key is None or len(key) <= 1024 else None
        ref_why = self._produce(dlq_topic, ref_key, None, ref)
        if ref_why is not None:
            log.warning("reference record of dead_letter id=%d not produced to %s: %s", row_id,
                        dlq_topic, ref_why)
        return Routed("table", row_id, why)

    def store(self, *, topic: str, consumed_topic: str | None, partition: int | None,
              offset: int | None, key: bytes | None, value: bytes | None, headers: Headers,
              code: str, reason: str, dlq_error: str | None,
              job_id: uuid.UUID | str | None = None) -> int:
        """Write one ``dead_letter`` row of this consumer group (committed) and return its id
        (:func:`store_dead_letter`). Raises :class:`RetryableError` ``db_unavailable``."""
        try:
            with psycopg.connect(self.dsn, row_factory=dict_row) as c, c.transaction():
                return store_dead_letter(
                    c, table=self.table, source="consumer", consumer_group=self.group, topic=topic,
                    consumed_topic=consumed_topic, partition=partition, offset=offset,
                    key=key, value=value, headers=headers, code=code, reason=reason,
                    dlq_error=dlq_error, job_id=job_id)
        except psycopg.OperationalError as exc:
            raise RetryableError(f"database unavailable: {exc}", code="db_unavailable") from None


def store_dead_letter(conn: psycopg.Connection[DictRow], *, source: str,
                      table: sql.Composable = DEAD_LETTER, topic: str, code: str,
                      reason: str, key: bytes | None, value: bytes | None, headers: Headers,
                      consumer_group: str = "", consumed_topic: str | None = None,
                      partition: int | None = None, offset: int | None = None,
                      outbox_id: int | None = None, dlq_error: str | None = None,
                      job_id: uuid.UUID | str | None = None) -> int:
    """Insert one ``dead_letter`` row in ``conn``'s transaction and return its id.

    ``source``: ``consumer`` (with ``consumer_group``, ``consumed_topic``, ``partition``,
    ``offset``) or ``relay`` (with ``outbox_id``). A message stored before (same group and
    position, or same outbox row: a redelivery) returns the existing row's id. Texts are made
    safe for Postgres (:func:`safe_text`); raises ``psycopg.Error``.
    """
    params = {
        "source": source, "consumer_group": consumer_group, "topic": topic,
        "consumed_topic": consumed_topic, "partition": partition, "offset": offset,
        "outbox_id": outbox_id, "job_id": _uuid_or_none(job_id), "key": key, "value": value,
        "header_names": [safe_text(k, 1000) for k, _ in headers],
        "header_values": [v if v is None or isinstance(v, bytes) else str(v).encode()
                          for _, v in headers],
        "reason_code": safe_text(code, 200), "reason": safe_text(reason),
        "dlq_error": None if dlq_error is None else safe_text(dlq_error)}
    return _insert(conn, table, params)


def _uuid_or_none(value: uuid.UUID | str | None) -> uuid.UUID | None:
    if value is None or isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def _insert(conn: psycopg.Connection[DictRow], table: sql.Composable,
            params: dict[str, Any]) -> int:
    row = conn.execute(sql.SQL(DEAD_LETTER_INSERT).format(table=table), params).fetchone()
    if row is None:  # stored before (a redelivery): the first row stands
        if params["outbox_id"] is not None:
            found = conn.execute(sql.SQL(DEAD_LETTER_FIND_OUTBOX).format(table=table),
                                 (params["outbox_id"],)).fetchone()
        else:
            found = conn.execute(sql.SQL(DEAD_LETTER_FIND).format(table=table), (
                params["consumer_group"], params["consumed_topic"], params["partition"],
                params["offset"])).fetchone()
        assert found is not None
        row = found
    return int(row["id"] if isinstance(row, dict) else row[0])


#: Keep a dead letter in Postgres (its DLQ produce failed, or the relay cannot deliver it).
#: A redelivered message (same group and position, or same outbox row) keeps its first row.
DEAD_LETTER_INSERT = """
INSERT INTO {table} (source, consumer_group, topic, consumed_topic, kafka_partition,
                     kafka_offset, outbox_id, job_id, kafka_key, value, header_names,
                     header_values, reason_code, reason, dlq_error)
VALUES (%(source)s, %(consumer_group)s, %(topic)s, %(consumed_topic)s, %(partition)s,
        %(offset)s, %(outbox_id)s, %(job_id)s, %(key)s, %(value)s, %(header_names)s,
        %(header_values)s, %(reason_code)s, %(reason)s, %(dlq_error)s)
ON CONFLICT DO NOTHING
RETURNING id"""
#: The row an earlier delivery of the same message wrote.
DEAD_LETTER_FIND = """
SELECT id FROM {table}
 WHERE consumer_group = %s AND consumed_topic = %s AND kafka_partition = %s
   AND kafka_offset = %s"""
DEAD_LETTER_FIND_OUTBOX = "SELECT id FROM {table} WHERE outbox_id = %s"
