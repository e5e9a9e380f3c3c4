"""A small, reusable idempotent consumer on confluent-kafka and psycopg.

For every message: decode, bounded (poison -> dead-lettered with the reason, then move on);
open ONE Postgres transaction; insert ``(consumer_group, dedup_key, event_type)`` into
``processed_event``; if the row already existed the event is a duplicate (redelivery or
re-publication) and the handler is not called; else run ``handler(conn, event)`` in that same
transaction; commit; only then store the Kafka offset (``enable.auto.offset.store=false``; the
stored offsets are auto-committed). A crash anywhere before the commit redoes everything; a
crash after it finds the row. That is "delivered at-least-once, applied exactly once".

Failures (one route for every consumer, ``jobstream.deadletter``): a message without key,
over ``kafka_message_max_bytes``, nested deeper than ``max_json_depth``, undecodable,
schema-violating, refused by the handler (:class:`PoisonMessage`), holding data Postgres cannot
store (``invalid_data``) or reusing an event id with other content (``event_id_conflict``) is
poison: dead-lettered (``<topic>.dlq``, else the ``dead_letter`` table) and its offset stored
once that is durable. Postgres or Kafka unavailable is transient: retried with backoff, nothing
skipped. Any other handler error is retried until the same error failed the same message
``consumer_poison_after`` times, then dead-lettered as ``handler_error``. Poison never blocks a
partition.

Batches: the messages already fetched when one arrives (up to ``max_batch``) are applied in
ONE transaction: one multi-row ``processed_event`` insert tells which keys are new, the handler
runs for the first copy of each new key (its statements pipelined), one commit, then the
poison ones of the batch are dead-lettered and the offsets stored. Same guarantee, one commit
per batch instead of per message. If the handler raises, the batch is rolled back and its
messages are processed one by one as above, so a bad message costs only itself.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Message

from jobstream import faults, health, logs
from jobstream.db import QUERIES as Q
from jobstream.db import connect
from jobstream.deadletter import HANDLER_ERROR, DeadLetterSink, FailureCounter, classify, describe
from jobstream.errors import PoisonMessage, RetryableError
from jobstream.kafka import HEADERS_UNREADABLE, consumer_config, read_headers
from jobstream.settings import Settings
from schemas.events import decode_event

log = logging.getLogger("jobstream.consumer")

Handler = Callable[[psycopg.Connection, Any], None]
BatchHandler = Callable[[psycopg.Connection, list[Any]], None]


@dataclass
class ConsumerStats:
    """Counters: applied (handler ran), duplicates (skipped), dead_lettered."""

    applied: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    started_at: float = field(default_factory=time.monotonic)


class IdempotentConsumer:
    """Consume ``topics`` in consumer group ``group`` and apply ``handler`` exactly once per
    ``(group, dedup_key, event_type)``.

    ``event_types``: the types accepted (others are dead-lettered). The handler gets the open
    connection (inside the transaction) and the decoded event; it must not commit. If it raises
    :class:`PoisonMessage` the message is dead-lettered; any other exception rolls back and the
    message is retried after a backoff (nothing is lost, the partition waits). ``max_batch``:
    most messages applied in one transaction (1 = a transaction per message).
    ``batch_handler(conn, events)``, if given, must have the effect of calling ``handler`` for
    each event in order (e.g. multi-row statements); batches use it instead of the loop.
    """

    def __init__(self, settings: Settings, *, group: str, topics: list[str],
                 event_types: tuple[str, ...], handler: Handler,
                 batch_handler: BatchHandler | None = None, max_batch: int = 500) -> None:
        self.settings = settings
        self.max_batch = max_batch
        self.batch_handler = batch_handler
        self.group = group
        self.topics = topics
        self.event_types = event_types
        self.handler = handler
        self.stats = ConsumerStats()
        self._stop = threading.Event()
        self._consumer = Consumer(consumer_config(settings, group))
        self._sink = DeadLetterSink(settings, group=group)
        self._failures = FailureCounter()
        self._conn: psycopg.Connection | None = None
        self._headers: dict[tuple[Any, Any, Any], list[tuple[str, bytes | None]]] = {}

    def headers(self, msg: Message) -> list[tuple[str, bytes | None]]:
        """``msg``'s headers, read from confluent-kafka ONCE per message.

        A header name that is not UTF-8 makes ``Message.headers()`` raise ``SystemError``
        and leaves a broken list behind that crashes the process (SIGSEGV) on the next call.
        Such a message's headers are unreadable: they become one header
        ``headers_unreadable`` (with the error), the event itself is still processed, and a
        dead letter of it keeps key, value and position.
        """
        pos = (msg.topic(), msg.partition(), msg.offset())
        got = self._headers.get(pos)
        if got is None:
            got = read_headers(msg)
            if got and got[0][0] == HEADERS_UNREADABLE:
                log.warning("headers of %s[%s]@%s unreadable (%r); processing without them",
                            *pos, got[0][1])
            if len(self._headers) > 10 * self.max_batch + 100:
                self._headers.clear()
            self._headers[pos] = got
        return got

    def stop(self, *_: Any) -> None:
        """Ask the loop to return after the current message."""
        self._stop.set()

    def _db(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            try:
                self._conn = connect(self.settings.database_url)
            except psycopg.OperationalError as exc:
                health.failed(exc)
                raise
            health.ok()
        return self._conn

    def db_probe(self) -> None:
        """Readiness probe of an idle consumer: fine while it holds an open connection (its
        work reports failures); else it must be able to open one. Raises
        ``psycopg.OperationalError``."""
        conn = self._conn
        if conn is None or conn.closed:
            connect(self.settings.database_url).close()

    def _dead_letter(self, msg: Message, code: str, reason: str) -> None:
        """Make the dead letter durable (``<topic>.dlq``, else the dead_letter table). Raises
        :class:`RetryableError` when neither took it: the offset must not be stored."""
        self._sink.send(topic=msg.topic() or "", partition=msg.partition() or 0,
                        offset=msg.offset() or 0, key=msg.key(), value=msg.value(),
                        headers=self.headers(msg), code=code, reason=reason)
        self.stats.dead_lettered += 1

    def _decode(self, msg: Message) -> Any:
        """The message's event, bounded (size, JSON depth) before parsing. Raises
        :class:`PoisonMessage` (a message without key is ``missing_key``)."""
        if msg.key() is None:
            raise PoisonMessage("message has no key (jobstream events are keyed by job id)",
                                code="missing_key")
        return decode_event(msg.value(), expected=self.event_types,
                            max_bytes=self.settings.kafka_message_max_bytes,
                            max_depth=self.settings.max_json_depth)

    def process(self, msg: Message) -> str:
        """Handle one message; returns ``applied``, ``duplicate`` or ``dead_lettered``.

        Runs in the message's log context and trace span (its ``traceparent`` header).
        Raises ``psycopg.Error`` (or the handler's error) after rolling back: the caller must
        not store the offset and retries the message.
        """
        with logs.message_scope(self.headers(msg), group=self.group):
            outcome = self._process(msg)
            log.debug("%s %s[%d]@%d", outcome, msg.topic(), msg.partition(), msg.offset())
            return outcome

    def _process(self, msg: Message) -> str:
        try:
            event = self._decode(msg)
        except PoisonMessage as exc:
            self._dead_letter(msg, exc.code, str(exc))
            return "dead_lettered"
        logs.bind(request_id=event.request_id, tenant=event.tenant_id,
                  event_type=event.event_type, job_id=event.job_id)
        conn = self._db()
        try:
            with conn.transaction():
                row = _record(conn, self.group, event)
                if row is None:
                    self.stats.duplicates += 1
                    return "duplicate"
                self.handler(conn, event)
        except (PoisonMessage, psycopg.DataError, UnicodeEncodeError) as exc:
            self._dead_letter(msg, classify(exc)[1], describe(exc))
            return "dead_lettered"
        self.stats.applied += 1
        return "applied"

    def process_batch(self, msgs: list[Message]) -> list[str]:
        """Apply ``msgs`` in ONE transaction; returns each message's outcome (``applied``,
        ``duplicate`` or ``dead_lettered``), in order.

        Undecodable messages are dead-lettered after the commit. Raises (after rolling back,
        with nothing dead-lettered and no stats counted) ``psycopg.Error`` or whatever the
        handler raised, :class:`PoisonMessage` included: the caller then processes the
        messages one by one with :meth:`process`.
        """
        outcomes: list[str] = ["duplicate"] * len(msgs)
        poison: list[tuple[int, PoisonMessage]] = []
        first: dict[tuple[str, str], tuple[int, Any]] = {}  # key -> first copy in the batch
        for i, msg in enumerate(msgs):
            try:
                event = self._decode(msg)
            except PoisonMessage as exc:
                poison.append((i, exc))
                continue
            first.setdefault((event.dedup_key, event.event_type), (i, event))
        conn = self._db()
        if first:
            events = [ev for _, ev in first.values()]
            with conn.transaction():
                new = {(r["dedup_key"], r["event_type"]) for r in conn.execute(
                    Q["record_processed_batch"], (
                        self.group, [e.dedup_key for e in events],
                        [e.event_type for e in events], [e.event_id for e in events],
                        [e.job_id for e in events])).fetchall()}  # event_id reused: raises
                todo = [(i, ev) for key, (i, ev) in first.items() if key in new]
                if self.batch_handler is not None:
                    if todo:
                        self.batch_handler(conn, [ev for _, ev in todo])
                else:
                    with conn.pipeline():
                        for _, ev in todo:
                            self.handler(conn, ev)
                for i, _ in todo:
                    outcomes[i] = "applied"
        for i, exc in poison:
            self._dead_letter(msgs[i], exc.code, str(exc))
            outcomes[i] = "dead_lettered"
        self.stats.applied += outcomes.count("applied")
        self.stats.duplicates += outcomes.count("duplicate")
        if log.isEnabledFor(logging.DEBUG):
            for msg, outcome in zip(msgs, outcomes, strict=True):
                with logs.message_scope(self.headers(msg), group=self.group):
                    log.debug("%s %s[%d]@%d", outcome, msg.topic(), msg.partition(),
                              msg.offset())
        return outcomes

    def _settle(self, msg: Message) -> bool:
        """Process ``msg`` until it is applied, a duplicate or dead-lettered; False if stopped
        first (its offset must then not be stored).

        Poison (decode, validation, :class:`PoisonMessage`, ``psycopg.DataError``) is
        dead-lettered at once. Transient failures (Postgres or the broker away) are retried with
        backoff, nothing skipped. Any other handler error is retried too, but the same error on
        the same message ``consumer_poison_after`` times in a row makes it poison
        (``handler_error``, the exception as reason). Each failure logs one ``processing
        failed`` line with topic/partition/offset and the next action.
        """
        position = (msg.topic(), msg.partition(), msg.offset())
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.process(msg)
                self._failures.forget(position)
                return True
            except Exception as exc:  # rolled back: decide, never skip silently
                kind, code = classify(exc)
                outage = isinstance(exc, psycopg.OperationalError)
                if outage:
                    health.failed(exc)  # one line per outage (jobstream.health), not per retry
                if isinstance(exc, psycopg.OperationalError) and self._conn is not None:
                    self._conn.close()
                    self._conn = None
                if kind == "bug":
                    n = self._failures.record(position, exc)
                    if n >= self.settings.consumer_poison_after:
                        log.warning("processing failed %s[%d]@%d (%s, %d times); next: "
                                    "dead-letter (%s)", *position, describe(exc), n,
                                    HANDLER_ERROR)
                        if self._dead_letter_or_wait(msg, HANDLER_ERROR,
                                                     f"failed {n} times: {describe(exc)}"):
                            self._failures.forget(position)
                            return True
                        continue
                    action = f"retry {n + 1}/{self.settings.consumer_poison_after}"
                elif kind == "poison":  # raised by the dead-lettering inside process()
                    action = "retry"
                else:
                    action = "retry (transient)"
                (log.debug if outage else log.warning)(
                    "processing failed %s[%d]@%d (%s: %s); next: %s in %.1fs",
                    *position, code, describe(exc), action, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        return False

    def _dead_letter_or_wait(self, msg: Message, code: str, reason: str) -> bool:
        """Dead-letter ``msg``; True once durable, False (after a short wait) when neither the
        DLQ nor Postgres took it (the caller tries again)."""
        try:
            self._dead_letter(msg, code, reason)
            return True
        except RetryableError as exc:
            log.warning("processing failed %s[%d]@%d: %s; next: retry the dead letter in 1s",
                        msg.topic(), msg.partition(), msg.offset(), exc)
            self._stop.wait(1.0)
            return False

    def _one_by_one(self, msgs: list[Message]) -> bool:
        """The per-message path: settle, then store the offset, message after message."""
        for msg in msgs:
            if not self._settle(msg):
                return False  # stopping: the offset of the unprocessed message is not stored
            faults.point("consumer_after_apply_before_offset")
            self._store_offset(msg)
        return True

    def _store_offset(self, msg: Message) -> None:
        """Store ``msg``'s offset for the next commit. A partition revoked meanwhile (a
        rebalance served while a batch was fetched) is skipped: its new owner re-delivers from
        the last committed offset, and processed_event absorbs the copy."""
        try:
            self._consumer.store_offsets(message=msg)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._STATE:
                raise
            log.info("%s[%d] is no longer assigned; offset %d not stored (its next owner "
                     "re-delivers it as a duplicate)", msg.topic(), msg.partition(),
                     msg.offset())

    def _apply(self, msgs: list[Message]) -> bool:
        """Apply a batch and store its offsets; False when stopped before the end."""
        if len(msgs) == 1:
            return self._one_by_one(msgs)
        while not self._stop.is_set():
            try:
                self.process_batch(msgs)
            except psycopg.OperationalError as exc:
                health.failed(exc)
                log.debug("batch failed (%s); retrying", exc)
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                self._stop.wait(0.5)
                continue
            except Exception as exc:  # the handler refused one: find it, one by one
                log.info("batch of %d rolled back (%s: %s); applying one by one", len(msgs),
                         type(exc).__name__, exc)
                return self._one_by_one(msgs)
            faults.point("consumer_after_apply_before_offset")
            last: dict[tuple[str, int], Message] = {}
            for m in msgs:
                last[(m.topic() or "", m.partition() or 0)] = m
            for m in last.values():
                self._store_offset(m)
            return True
        return False

    def run(self, *, idle_exit_s: float | None = None) -> ConsumerStats:
        """Consume until stopped (or, with ``idle_exit_s``, until idle that long)."""
        self._consumer.subscribe(self.topics)
        last_msg = time.monotonic()
        try:
            while not self._stop.is_set():
                msg = self._consumer.poll(0.5)
                if msg is None:
                    if idle_exit_s is not None and time.monotonic() - last_msg > idle_exit_s:
                        break
                    continue
                got = [msg]
                if self.max_batch > 1:  # what is already fetched; never waits for more
                    got += self._consumer.consume(self.max_batch - 1, 0)
                msgs = []
                for m in got:
                    if m.error():
                        if m.error().code() != KafkaError._PARTITION_EOF:
                            log.warning("consumer error: %s", m.error())
                        continue
                    msgs.append(m)
                if not msgs:
                    continue
                last_msg = time.monotonic()
                ok = self._apply(msgs)
                self._headers.clear()
                if not ok:
                    break
        finally:
            self._consumer.close()  # commits the stored offsets
            if self._conn is not None:
                self._conn.close()
        return self.stats


def _record(conn: psycopg.Connection, group: str, event: Any) -> Any:
    """Insert the idempotent-consumer row; ``None`` for a duplicate. Raises
    :class:`PoisonMessage` ``event_id_conflict`` when the event id was already recorded with
    other content (another dedup key or event type)."""
    try:
        with conn.transaction():  # a savepoint: the outer transaction survives the refusal
            return conn.execute(Q["record_processed"], (
                group, event.dedup_key, event.event_type, event.event_id,
                event.job_id)).fetchone()
    except psycopg.errors.UniqueViolation as exc:
        if exc.diag.constraint_name != "processed_event_event_id":
            raise
        raise PoisonMessage(f"event_id {event.event_id} was already used by another event",
                            code="event_id_conflict") from None


def run_forever(consumer: IdempotentConsumer) -> int:
    """Run ``consumer`` until SIGINT/SIGTERM; returns the exit code."""
    signal.signal(signal.SIGTERM, consumer.stop)
    signal.signal(signal.SIGINT, consumer.stop)
    stats = consumer.run()
    log.info("consumer stopped: %s", stats)
    return 0
