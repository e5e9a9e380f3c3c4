"""Dead-letter tools: list the messages of ``<topic>.dlq`` topics and of the Postgres
``dead_letter`` table (migration 0008), and replay them.

A dead letter lives in one of two places (``jobstream.deadletter``): on ``<topic>.dlq``, or, when
that topic did not take it (too large, refused, broker away) or the relay could not deliver an
outbox row, in the ``dead_letter`` table, with a small reference record (header ``dlq_stored``)
on the DLQ where possible. Listing shows both (reference records only through their row);
replay re-produces both, the table rows after the topic's messages.

A dead-lettered message keeps the original key and value bytes; its headers say why and where
it came from: ``dlq_reason_code``, ``dlq_reason``, ``dlq_original_topic``,
``dlq_original_partition``, ``dlq_original_offset`` (``jobstream.kafka.dlq_headers``,
``consumers.idempotent``).

Listing (:func:`list_dead_letters`) reads with an *assigned* consumer (no subscription, so it
never joins a group) that never commits: it moves no consumer group's offsets.

Replaying (:func:`replay`) re-produces the original key and value bytes to the original topic
(and partition) with an idempotent producer (``acks=all``), adding the header
``dlq_replayed_from`` = ``<dlq topic>:<partition>:<offset>``. Bookkeeping
(docs/design-notes.md, "Replaying the DLQ"):

- Postgres table ``dlq_replay`` is the record of what was replayed: one row per DLQ message,
  written after the broker acknowledged the re-produced copy. A message with a row is never
  replayed again, so a second run replays nothing new.
- A filter (``reason_codes``) leaves the other messages unrecorded: a later run with another
  filter (or none) still finds them.
- The consumer group ``<prefix>jobstream-dlq-replay`` commits, per DLQ partition, the first
  offset that is not replayed yet (committed after the produce was acknowledged and recorded).
  Everything below it is done, so later runs start reading there; it never moves past a skipped
  message, so it is a resume point, never a decision.
- Runs on one DLQ topic are serialised by a Postgres advisory lock.

Guarantee: within a run that returns, each DLQ message is re-produced at most once; a message
recorded in ``dlq_replay`` is never re-produced again. A crash between the broker's
acknowledgement and the record re-produces that message on the next run (at-least-once, like
the outbox relay); the consumers' idempotency keys absorb the copy.

Errors (``jobstream.errors``): :class:`PermanentError` ``unknown_topic`` (no such topic),
``schema_missing`` (``dlq_replay`` absent: run ``jobstream migrate``); :class:`RetryableError`
``replay_in_progress`` (another replay holds the topic's lock), ``db_unavailable``,
``kafka_unavailable`` (metadata, watermarks or reads failed or timed out).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from jobstream.db import QUERIES as Q
from jobstream.db import Conn, connect
from jobstream.deadletter import CONSUMED_TOPIC_HEADER, STORED_HEADER
from jobstream.errors import PermanentError, RetryableError
from jobstream.kafka import CONSUMED_TOPICS, base_config, producer_config, read_headers
from jobstream.settings import Settings

log = logging.getLogger("jobstream.dlq")

DLQ_SUFFIX = ".dlq"
#: Logical consumer group whose committed offsets are the replay's resume points.
REPLAY_GROUP = "jobstream-dlq-replay"
#: Header added to a replayed message: ``<dlq topic>:<partition>:<offset>`` of its DLQ copy.
REPLAYED_FROM_HEADER = "dlq_replayed_from"
#: Advisory-lock class (``"dlq"``) of replays; the second key is ``hashtext(dlq topic)``.
REPLAY_LOCK_CLASS = 0x646C71
_BATCH = 100  # messages produced (and acknowledged) before their rows are recorded
_KAFKA_TIMEOUT_S = 10.0
#: Errors a partition answers with for a moment after its topic was created (or its leader
#: moved); retried, not reported.
_SETTLING = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
             KafkaError._TIMED_OUT, KafkaError._TRANSPORT)


def _kafka_error(what: str, exc: Exception) -> RetryableError:
    return RetryableError(f"{what}: {exc}", code="kafka_unavailable")


# ---------------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class DeadLetter:
    """One message of a DLQ topic: its position, key, value and headers.

    ``value`` may be cut short when read for listing; ``value_size`` is always the full size
    (``-1`` for a null value). The ``dlq_*`` properties decode the reason headers (``None``
    when absent or malformed).
    """

    dlq_topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    value_size: int
    headers: tuple[tuple[str, bytes | None], ...]

    def header(self, name: str) -> str | None:
        """The last header ``name`` as text (undecodable bytes escaped), or ``None``."""
        found = [v for k, v in self.headers if k == name]
        if not found or found[-1] is None:
            return None
        return found[-1].decode("utf-8", errors="backslashreplace")

    def _int_header(self, name: str) -> int | None:
        raw = self.header(name)
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return None

    @property
    def ref(self) -> str:
        """``<dlq topic>:<partition>:<offset>``: the value of :data:`REPLAYED_FROM_HEADER`."""
        return f"{self.dlq_topic}:{self.partition}:{self.offset}"

    @property
    def reason_code(self) -> str | None:
        """``dlq_reason_code``: the stable machine-readable reason (e.g. ``not_json``)."""
        return self.header("dlq_reason_code")

    @property
    def reason(self) -> str | None:
        """``dlq_reason``: the human-readable reason."""
        return self.header("dlq_reason")

    @property
    def original_topic(self) -> str | None:
        """``dlq_original_topic``: the full name of the topic the message was consumed from."""
        return self.header("dlq_original_topic")

    @property
    def original_partition(self) -> int | None:
        """``dlq_original_partition``."""
        return self._int_header("dlq_original_partition")

    @property
    def original_offset(self) -> int | None:
        """``dlq_original_offset``."""
        return self._int_header("dlq_original_offset")

    @property
    def consumer_group(self) -> str | None:
        """``dlq_consumer_group``: the consumer group that dead-lettered it (``None`` for dead
        letters written before the header existed)."""
        return self.header("dlq_consumer_group")

    @property
    def stored_as(self) -> str | None:
        """``dead_letter:<id>`` when this DLQ message is only a reference record: the original
        did not fit the DLQ and is kept in the Postgres ``dead_letter`` table."""
        return self.header(STORED_HEADER)

    def to_dict(self, head_bytes: int = 64) -> dict[str, Any]:
        """A JSON-ready summary: ``source`` (``topic``), position, reason, origin
        (``consumed_topic``: where it was read, e.g. a ``.retry`` twin), the original headers
        (``dlq_*`` left out), key (text), value size and the first ``head_bytes`` bytes of the
        value as text (undecodable bytes escaped)."""
        value = self.value
        return {
            "source": "topic", "dlq_topic": self.dlq_topic, "partition": self.partition,
            "offset": self.offset,
            "timestamp_ms": self.timestamp_ms,
            "dlq_reason_code": self.reason_code, "dlq_reason": self.reason,
            "consumer_group": self.consumer_group,
            "original_topic": self.original_topic,
            "consumed_topic": self.header(CONSUMED_TOPIC_HEADER) or self.original_topic,
            "original_partition": self.original_partition,
            "original_offset": self.original_offset,
            "headers": {k: None if v is None else v.decode("utf-8", "backslashreplace")
                        for k, v in self.headers if not k.startswith("dlq_")},
            "key": None if self.key is None else self.key.decode("utf-8", "backslashreplace"),
            "value_size": self.value_size,
            "value_head": None if value is None
            else value[:head_bytes].decode("utf-8", "backslashreplace"),
        }


def _dead_letter(msg: Message, keep_value_bytes: int | None) -> DeadLetter:
    value = msg.value()
    ts_type, ts = msg.timestamp()
    return DeadLetter(
        dlq_topic=msg.topic() or "", partition=msg.partition() or 0, offset=msg.offset() or 0,
        timestamp_ms=ts if ts_type else None, key=msg.key(),
        value=value if value is None or keep_value_bytes is None else value[:keep_value_bytes],
        value_size=-1 if value is None else len(value),
        headers=tuple((str(k), v.encode() if isinstance(v, str) else v)
                      for k, v in read_headers(msg)))


def _reader_config(settings: Settings, group: str) -> dict[str, Any]:
    """A consumer that is only ever assigned partitions and never commits on its own."""
    return {**base_config(settings), "group.id": group, "enable.auto.commit": False,
            "enable.auto.offset.store": False, "enable.partition.eof": True,
            "auto.offset.reset": "earliest", "isolation.level": "read_committed",
            "allow.auto.create.topics": False}


def _partitions(consumer: Consumer, topic: str) -> list[int]:
    """Partition ids of ``topic``. Raises PermanentError ``unknown_topic`` when it does not
    exist, RetryableError ``kafka_unavailable`` when the broker does not answer."""
    try:
        md = consumer.list_topics(topic, timeout=_KAFKA_TIMEOUT_S).topics.get(topic)
    except KafkaException as exc:
        raise _kafka_error(f"metadata of {topic}", exc) from None
    if md is None or (md.error is not None
                      and md.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
        raise PermanentError(f"topic {topic} does not exist", code="unknown_topic")
    if md.error is not None:
        raise RetryableError(f"metadata of {topic}: {md.error}", code="kafka_unavailable")
    return sorted(md.partitions)


def _watermarks(consumer: Consumer, topic: str,
                partitions: list[int]) -> dict[int, tuple[int, int]]:
    """``(low, high)`` watermarks per partition. Retriable broker errors (a new topic's leader
    answers NOT_LEADER_FOR_PARTITION for a moment) are retried for ``_KAFKA_TIMEOUT_S``; then
    raises RetryableError ``kafka_unavailable``."""
    out: dict[int, tuple[int, int]] = {}
    deadline = time.monotonic() + _KAFKA_TIMEOUT_S
    for p in partitions:
        while p not in out:
            try:
                out[p] = consumer.get_watermark_offsets(TopicPartition(topic, p),
                                                        timeout=_KAFKA_TIMEOUT_S)
            except KafkaException as exc:
                err = exc.args[0]
                if (not (err.retriable() or err.code() in _SETTLING)
                        or time.monotonic() > deadline):
                    raise _kafka_error(f"watermarks of {topic}[{p}]", exc) from None
                time.sleep(0.2)
    return out


def _read(consumer: Consumer, topic: str, starts: dict[int, int], ends: dict[int, int], *,
          keep_value_bytes: int | None = None, idle_timeout_s: float = 30.0,
          ) -> Generator[DeadLetter, None, None]:
    """Yield the messages of ``topic`` at offsets ``[starts[p], ends[p])`` of each partition,
    each partition in offset order (partitions interleaved).

    A partition also ends at end-of-partition (under ``read_committed`` that may come before
    ``ends[p]`` while a transaction is open). Raises RetryableError ``kafka_unavailable`` when
    nothing arrives for ``idle_timeout_s`` or on a fatal consumer error.
    """
    todo = {p for p in ends if ends[p] > starts[p]}
    if not todo:
        return
    consumer.assign([TopicPartition(topic, p, starts[p]) for p in sorted(todo)])
    deadline = time.monotonic() + idle_timeout_s
    try:
        while todo:
            if time.monotonic() > deadline:
                raise RetryableError(f"reading {topic}: partitions {sorted(todo)} gave nothing "
                                     f"for {idle_timeout_s:.0f}s", code="kafka_unavailable")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    todo.discard(msg.partition())
                elif err.fatal():
                    raise RetryableError(f"reading {topic}: {err}", code="kafka_unavailable")
                else:
                    log.warning("reading %s: %s", topic, err)
                continue
            p, o = msg.partition(), msg.offset()
            if p is None or o is None or p not in todo or o >= ends[p]:
                continue
            deadline = time.monotonic() + idle_timeout_s
            yield _dead_letter(msg, keep_value_bytes)
            if o >= ends[p] - 1:
                todo.discard(p)
    finally:
        consumer.unassign()


def dlq_topic_names(settings: Settings, topic: str | None = None) -> list[str]:
    """Full DLQ topic names: of logical ``topic``, or of every consumed topic when ``None``.

    Raises ``ValueError`` when ``topic`` already ends in ``.dlq`` (give the logical topic).
    """
    if topic is not None and topic.endswith(DLQ_SUFFIX):
        raise ValueError(f"give the logical topic, not the DLQ: {topic[:-len(DLQ_SUFFIX)]!r}")
    return [settings.topic(t + DLQ_SUFFIX) for t in ([topic] if topic else CONSUMED_TOPICS)]


def list_dead_letters(settings: Settings, topic: str | None = None, *, limit: int = 100,
                      head_bytes: int = 64) -> list[DeadLetter]:
    """The oldest ``limit`` messages of each DLQ topic (of logical ``topic``, else of every
    consumed topic), ordered by topic, timestamp, partition, offset. Values are cut to
    ``head_bytes`` (``value_size`` keeps the full size). Reference records (header
    ``dlq_stored``: the original is in the ``dead_letter`` table) are left out; see
    :func:`list_stored` for the table.

    Reads from the low watermark with an assigned consumer that never commits (its throwaway
    group id is never joined or written): no consumer group is disturbed. With ``topic=None``
    missing DLQ topics are left out; a named one that does not exist raises PermanentError
    ``unknown_topic``. Raises RetryableError ``kafka_unavailable`` when Kafka does not answer.
    """
    if limit < 1:
        raise ValueError("limit must be >= 1")
    out: list[DeadLetter] = []
    consumer = Consumer(_reader_config(
        settings, settings.group(f"jobstream-dlq-list-{uuid.uuid4().hex[:12]}")))
    try:
        for name in dlq_topic_names(settings, topic):
            try:
                parts = _partitions(consumer, name)
            except PermanentError:
                if topic is not None:
                    raise
                continue
            marks = _watermarks(consumer, name, parts)
            starts = {p: lo for p, (lo, _hi) in marks.items()}
            ends = {p: min(hi, lo + limit) for p, (lo, hi) in marks.items()}
            got = sorted((d for d in _read(consumer, name, starts, ends,
                                           keep_value_bytes=head_bytes)
                          if d.stored_as is None),  # the table row is listed instead
                         key=lambda d: (d.timestamp_ms or 0, d.partition, d.offset))
            out.extend(got[:limit])
    finally:
        consumer.close()
    return out


def stored_to_dict(row: dict[str, Any], head_bytes: int = 64) -> dict[str, Any]:
    """A JSON-ready summary of one ``dead_letter`` row, with the keys of
    :meth:`DeadLetter.to_dict` (``source`` = ``table``; ``dlq_topic``, ``partition`` and
    ``offset`` are ``None``) plus ``dead_letter_id``, ``ref`` (``dead_letter:<id>``),
    ``stored_by`` (``consumer``/``relay``), ``dlq_error`` and ``replayed_at``."""
    value, key = row["value"], row["kafka_key"]
    return {
        "source": "table", "dead_letter_id": row["id"], "ref": f"dead_letter:{row['id']}",
        "stored_by": row["source"], "dlq_topic": None, "partition": None, "offset": None,
        "timestamp_ms": int(row["created_at"].timestamp() * 1000),
        "dlq_reason_code": row["reason_code"], "dlq_reason": row["reason"],
        "consumer_group": row["consumer_group"] or None,
        "original_topic": row["topic"], "consumed_topic": row["consumed_topic"] or row["topic"],
        "original_partition": row["kafka_partition"], "original_offset": row["kafka_offset"],
        "headers": {k: None if v is None else bytes(v).decode("utf-8", "backslashreplace")
                    for k, v in zip(row["header_names"], row["header_values"], strict=True)},
        "key": None if key is None else bytes(key).decode("utf-8", "backslashreplace"),
        "value_size": -1 if value is None else len(value),
        "value_head": None if value is None
        else bytes(value[:head_bytes]).decode("utf-8", "backslashreplace"),
        "dlq_error": row["dlq_error"],
        "replayed_at": None if row["replayed_at"] is None else row["replayed_at"].isoformat(),
    }


def list_stored(settings: Settings, topic: str | None = None, *, limit: int = 100,
                head_bytes: int = 64) -> list[dict[str, Any]]:
    """The oldest ``limit`` rows of the ``dead_letter`` table for logical ``topic`` (else of
    every topic with the settings' prefix: the relay parks rows of any topic), as
    :func:`stored_to_dict` summaries. Raises PermanentError
    ``schema_missing`` (run ``jobstream migrate``) and RetryableError ``db_unavailable``."""
    with _ledger(settings.database_url) as conn:
        rows = conn.execute(Q["dead_letter_list"], {
            "topics": [settings.topic(topic)] if topic else None,
            "prefix": settings.topic_prefix, "limit": limit}).fetchall()
    return [stored_to_dict(r, head_bytes) for r in rows]


# ---------------------------------------------------------------------------------- replay

@dataclass(frozen=True)
class ReplayItem:
    """One DLQ message a run replayed (or, in a dry run, would replay).

    ``dlq_partition``/``dlq_offset``: the DLQ copy (``ref`` = ``<dlq topic>:<p>:<o>``).
    ``replayed_partition``/``replayed_offset``: where the re-produced copy landed (``None`` in a
    dry run or when the delivery failed; ``error`` then says why).
    """

    ref: str
    dlq_partition: int
    dlq_offset: int
    reason_code: str | None
    original_topic: str
    original_partition: int | None
    original_offset: int | None
    replayed_partition: int | None = None
    replayed_offset: int | None = None
    error: str | None = None

    @classmethod
    def of(cls, dl: DeadLetter, original_topic: str, **extra: Any) -> ReplayItem:
        """The item of DLQ message ``dl`` (``extra``: the replay outcome fields)."""
        return cls(dl.ref, dl.partition, dl.offset, dl.reason_code, original_topic,
                   dl.original_partition, dl.original_offset, **extra)


@dataclass
class ReplayReport:
    """What one :func:`replay` run did.

    ``replayed``: acknowledged and recorded (dry run: would be replayed); ``failed``: not
    acknowledged, not recorded (a later run retries them); ``already_replayed``: recorded by an
    earlier run; ``skipped``: left out by the filter; ``unreplayable``: ``(ref, why)`` of
    messages without a usable ``dlq_original_topic`` header; ``limit_reached``: the run stopped
    at ``limit``; ``committed``: DLQ partition -> offset committed for the replay group.
    """

    dlq_topic: str
    original_topic: str
    dry_run: bool
    replayed: list[ReplayItem] = field(default_factory=list)
    failed: list[ReplayItem] = field(default_factory=list)
    already_replayed: int = 0
    skipped: int = 0
    references: int = 0
    unreplayable: list[tuple[str, str]] = field(default_factory=list)
    limit_reached: bool = False
    committed: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``committed`` keys become strings)."""
        d = asdict(self)
        d["committed"] = {str(p): o for p, o in self.committed.items()}
        d["unreplayable"] = [{"ref": r, "why": w} for r, w in self.unreplayable]
        return d


def unreplayable_reason(dl: DeadLetter, original_topic: str) -> str | None:
    """Why ``dl`` cannot be replayed to ``original_topic`` (full name), or ``None`` if it can.

    Replay trusts ``dlq_original_topic`` only when it names the topic this DLQ belongs to, so a
    forged or stray header cannot make replay write to an arbitrary topic.
    """
    if dl.original_topic is None:
        return "no dlq_original_topic header"
    if dl.original_topic != original_topic:
        return f"dlq_original_topic {dl.original_topic!r} is not {original_topic!r}"
    return None


def replay_headers(dl: DeadLetter) -> list[tuple[str, str | bytes | None]]:
    """Headers of the re-produced copy: the DLQ message's headers minus the ``dlq_*`` ones, plus
    :data:`REPLAYED_FROM_HEADER`."""
    kept: list[tuple[str, str | bytes | None]] = [
        (k, v) for k, v in dl.headers if not k.startswith("dlq_")]
    return [*kept, (REPLAYED_FROM_HEADER, dl.ref.encode())]


def resume_offsets(starts: dict[int, int], read_to: dict[int, int],
                   not_done: dict[int, int]) -> dict[int, int]:
    """Per partition, the offset to commit for the replay group: the first offset read and not
    replayed (``not_done``), else the end of what was read (``read_to``). Never below
    ``starts``; partitions without progress are left out."""
    out = {}
    for p, start in starts.items():
        off = min(not_done.get(p, read_to.get(p, start)), read_to.get(p, start))
        if off > start:
            out[p] = off
    return out


@contextmanager
def _ledger(url: str) -> Iterator[Conn]:
    """A dedicated autocommit connection (it holds the session-level replay lock)."""
    try:
        with connect(url, autocommit=True) as conn:
            yield conn
    except psycopg.errors.UndefinedTable:
        raise PermanentError("table dlq_replay or dead_letter is missing: run `jobstream "
                             "migrate`",
                             code="schema_missing") from None
    except psycopg.OperationalError as exc:
        raise RetryableError(f"database unavailable: {exc}", code="db_unavailable") from None


class _Replayer:
    """The state of one replay run over one DLQ topic (see :func:`replay`)."""

    def __init__(self, settings: Settings, conn: Conn, report: ReplayReport, *,
                 source_partitions: int, done: dict[int, set[int]], reason_codes: set[str],
                 limit: int | None, groups: set[str] | None = None) -> None:
        self.settings = settings
        self.conn = conn
        self.report = report
        self.source_partitions = source_partitions
        self.done = done  # DLQ partition -> offsets recorded in dlq_replay before this run
        self.reason_codes = reason_codes
        self.groups = groups or set()
        self.limit = limit
        #: DLQ partition -> offsets read and not replayed (yet): they hold the resume point.
        self.pending: dict[int, set[int]] = {}
        self.batch: list[DeadLetter] = []
        self.producer: Producer | None = None

    def first_pending(self) -> dict[int, int]:
        """DLQ partition -> the lowest offset read and not replayed."""
        return {p: min(offs) for p, offs in self.pending.items() if offs}

    def consider(self, dl: DeadLetter) -> bool:
        """Classify one DLQ message and queue it for replay if it is due; returns False when
        the limit is reached (the caller stops reading)."""
        r = self.report
        if dl.offset in self.done.get(dl.partition, ()):
            r.already_replayed += 1
            return True
        self.pending.setdefault(dl.partition, set()).add(dl.offset)
        if dl.stored_as is not None:  # the original is replayed from the table
            r.references += 1
            self.pending[dl.partition].discard(dl.offset)
            return True
        if ((self.reason_codes and dl.reason_code not in self.reason_codes)
                or (self.groups and dl.consumer_group not in self.groups)):
            r.skipped += 1
            return True
        why = unreplayable_reason(dl, r.original_topic)
        if why is not None:
            r.unreplayable.append((dl.ref, why))
            return True
        if self.limit is not None and (len(r.replayed) + len(r.failed) + len(self.batch)
                                       >= self.limit):
            r.limit_reached = True
            return False
        if r.dry_run:
            r.replayed.append(ReplayItem.of(dl, r.original_topic))
            return True
        self.batch.append(dl)
        if len(self.batch) >= _BATCH:
            self.flush()
        return True

    def flush(self) -> None:
        """Produce the queued batch, wait for every delivery report, then record the
        acknowledged messages in ``dlq_replay`` (one transaction)."""
        batch, self.batch = self.batch, []
        if not batch:
            return
        if self.producer is None:
            self.producer = Producer(producer_config(
                self.settings, **{"client.id": self.settings.group(REPLAY_GROUP)}))
        results: dict[int, tuple[KafkaError | None, Message | None]] = {}

        def report_to(i: int) -> Any:
            def on_delivery(err: KafkaError | None, msg: Message) -> None:
                results[i] = (err, msg)
            return on_delivery

        for i, dl in enumerate(batch):
            part = dl.original_partition
            if part is None or not 0 <= part < self.source_partitions:
                part = -1  # RD_KAFKA_PARTITION_UA: the partitioner chooses by key
            while True:
                try:
                    self.producer.produce(
                        self.report.original_topic, value=dl.value, key=dl.key,
                        partition=part, headers=replay_headers(dl),
                        on_delivery=report_to(i))
                    break
                except BufferError:
                    self.producer.poll(0.1)  # local queue full: serve callbacks, then retry
            self.producer.poll(0)
        self.producer.flush(60)
        acked: list[ReplayItem] = []
        for i, dl in enumerate(batch):
            err, msg = results.get(i, (None, None))
            if err is not None or msg is None:
                why = str(err) if err is not None else "not acknowledged within 60s"
                self.report.failed.append(ReplayItem.of(dl, self.report.original_topic,
                                                        error=why))
                log.warning("replay of %s failed: %s", dl.ref, why)
                continue
            acked.append(ReplayItem.of(dl, self.report.original_topic,
                                       replayed_partition=msg.partition(),
                                       replayed_offset=msg.offset()))
        if not acked:
            return
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.executemany(Q["dlq_replay_record"], [{
                "dlq_topic": self.report.dlq_topic, "dlq_partition": it.dlq_partition,
                "dlq_offset": it.dlq_offset, "reason_code": it.reason_code,
                "original_topic": it.original_topic,
                "original_partition": it.original_partition,
                "original_offset": it.original_offset,
                "replayed_partition": it.replayed_partition,
                "replayed_offset": it.replayed_offset} for it in acked])
        self.report.replayed.extend(acked)
        for it in acked:
            self.pending[it.dlq_partition].discard(it.dlq_offset)
            log.info("replayed %s -> %s[%s]@%s", it.ref, it.original_topic,
                     it.replayed_partition, it.replayed_offset)


def replay(settings: Settings, topic: str, *, reason_codes: Sequence[str] = (),
           limit: int | None = None, dry_run: bool = False,
           groups: Sequence[str] = ()) -> ReplayReport:
    """Replay the dead-lettered messages of logical ``topic`` (``<topic>.dlq`` ->
    ``<topic>``); the module docstring describes the bookkeeping.

    ``reason_codes``: replay only messages whose ``dlq_reason_code`` is one of these (empty:
    all). ``groups``: replay only what these consumer groups dead-lettered
    (``dlq_consumer_group``; with several groups on a topic, a bad message is dead-lettered
    once per group, and one copy replayed reaches every group again). ``limit``: replay at most
    this many. ``dry_run``: report what would be replayed;
    nothing is produced, recorded or committed (and no lock is taken).

    Each message is re-produced with its original key and value bytes to its original partition
    (when that partition still exists; else the partitioner picks by key), with the header
    ``dlq_replayed_from``. Deliveries that fail are listed in :attr:`ReplayReport.failed`, not
    recorded, and retried by the next run. Raises ``ValueError`` for a ``.dlq`` topic name or a
    ``limit`` below 1, and the errors listed in the module docstring.
    """
    if limit is not None and limit < 1:
        raise ValueError("limit must be >= 1")
    dlq_topic = dlq_topic_names(settings, topic)[0]
    report = ReplayReport(dlq_topic=dlq_topic, original_topic=settings.topic(topic),
                          dry_run=dry_run)
    group = settings.group(REPLAY_GROUP)
    with _ledger(settings.database_url) as conn:
        if not dry_run:
            row = conn.execute(Q["dlq_replay_try_lock"],
                               (REPLAY_LOCK_CLASS, dlq_topic)).fetchone()
            if not (row and row["locked"]):
                raise RetryableError(f"another replay of {dlq_topic} is running",
                                     code="replay_in_progress")
        consumer = Consumer(_reader_config(settings, group))
        try:
            parts = _partitions(consumer, dlq_topic)
            source_partitions = len(_partitions(consumer, report.original_topic))
            marks = _watermarks(consumer, dlq_topic, parts)
            try:
                committed = {tp.partition: tp.offset for tp in consumer.committed(
                    [TopicPartition(dlq_topic, p) for p in parts], timeout=_KAFKA_TIMEOUT_S)}
            except KafkaException as exc:
                raise _kafka_error(f"committed offsets of {group}", exc) from None
            # Resume at the committed offset; from the low watermark when there is none, or
            # when it is outside the log (retention deleted past it, or the topic was recreated).
            starts = {p: c if lo <= (c := committed.get(p, -1)) <= hi else lo
                      for p, (lo, hi) in marks.items()}
            ends = {p: hi for p, (_lo, hi) in marks.items()}
            done = {p: {r["dlq_offset"] for r in conn.execute(
                        Q["dlq_replayed_offsets"], (dlq_topic, p, starts[p], ends[p]))}
                    for p in parts}
            run = _Replayer(settings, conn, report, source_partitions=source_partitions,
                            done=done, reason_codes=set(reason_codes), limit=limit,
                            groups=set(groups))
            read_to = dict(starts)
            with closing(_read(consumer, dlq_topic, starts, ends)) as messages:
                for dl in messages:
                    read_to[dl.partition] = dl.offset + 1
                    if not run.consider(dl):
                        break
            run.flush()
            if not dry_run:
                _commit_resume_points(consumer, run, starts, read_to, committed)
        finally:
            consumer.close()
        if not report.limit_reached:
            _replay_stored(settings, conn, report, source_partitions=source_partitions,
                           reason_codes=set(reason_codes), limit=limit, groups=set(groups))
    return report


def _replay_stored(settings: Settings, conn: Conn, report: ReplayReport, *,
                   source_partitions: int, reason_codes: set[str], limit: int | None,
                   groups: set[str] | None = None) -> None:
    """Replay the ``dead_letter`` rows of the report's topic not replayed yet: re-produce the
    original key, value and headers (plus ``dlq_replayed_from=dead_letter:<id>``), then mark
    the row replayed. Rows parked by the relay go to their topic as they are (and fail again
    while the topic still refuses them)."""
    rows = conn.execute(Q["dead_letter_list"], {
        "topics": [report.original_topic], "prefix": "", "limit": 1_000_000}).fetchall()
    todo: list[dict[str, Any]] = []
    for r in rows:
        if r["replayed_at"] is not None:
            report.already_replayed += 1
        elif ((reason_codes and r["reason_code"] not in reason_codes)
              or (groups and r["consumer_group"] not in groups)):
            report.skipped += 1
        elif limit is not None and len(report.replayed) + len(report.failed) + len(todo) >= limit:
            report.limit_reached = True
            break
        else:
            todo.append(r)
    if not todo:
        return

    def item(r: dict[str, Any], **extra: Any) -> ReplayItem:
        return ReplayItem(f"dead_letter:{r['id']}", -1, -1, r["reason_code"],
                          report.original_topic, r["kafka_partition"], r["kafka_offset"],
                          **extra)

    if report.dry_run:
        report.replayed.extend(item(r) for r in todo)
        return
    producer = Producer(producer_config(settings, **{
        "client.id": settings.group(REPLAY_GROUP),
        "message.max.bytes": settings.kafka_message_max_bytes + settings.dlq_headroom_bytes}))
    results: dict[int, tuple[KafkaError | None, Message | None]] = {}

    def report_to(i: int) -> Any:
        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            results[i] = (err, msg)
        return on_delivery

    for r in todo:
        part = r["kafka_partition"]
        if part is None or not 0 <= part < source_partitions:
            part = -1
        headers = [*zip(r["header_names"], r["header_values"], strict=True),
                   (REPLAYED_FROM_HEADER, f"dead_letter:{r['id']}".encode())]
        try:
            producer.produce(report.original_topic, key=r["kafka_key"], value=r["value"],
                             partition=part, headers=headers,
                             on_delivery=report_to(r["id"]))
        except (KafkaException, BufferError) as exc:
            results[r["id"]] = (exc.args[0] if exc.args and isinstance(
                exc.args[0], KafkaError) else KafkaError(KafkaError._FAIL, str(exc)), None)
        producer.poll(0)
    producer.flush(60)
    for r in todo:
        err, msg = results.get(r["id"], (None, None))
        if err is not None or msg is None:
            why = str(err) if err is not None else "not acknowledged within 60s"
            report.failed.append(item(r, error=why))
            log.warning("replay of dead_letter:%d failed: %s", r["id"], why)
            continue
        conn.execute(Q["dead_letter_mark_replayed"], (msg.partition(), msg.offset(), r["id"]))
        report.replayed.append(item(r, replayed_partition=msg.partition(),
                                    replayed_offset=msg.offset()))
        log.info("replayed dead_letter:%d -> %s[%s]@%s", r["id"], report.original_topic,
                 msg.partition(), msg.offset())


def _commit_resume_points(consumer: Consumer, run: _Replayer, starts: dict[int, int],
                          read_to: dict[int, int], committed: dict[int, int]) -> None:
    """Commit the replay group's resume points. Acknowledged messages are already recorded, so
    a failed commit only costs the next run a longer read: it is logged, not raised."""
    offsets = {p: o for p, o in resume_offsets(starts, read_to, run.first_pending()).items()
               if o != committed.get(p)}
    if not offsets:
        return
    try:
        consumer.commit(offsets=[TopicPartition(run.report.dlq_topic, p, o)
                                     for p, o in offsets.items()], asynchronous=False)
        run.report.committed = offsets
    except KafkaException as exc:
        log.warning("could not commit the replay group's offsets %s: %s", offsets, exc)
