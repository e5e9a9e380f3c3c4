"""An idempotent consumer on confluent-kafka and psycopg: apply each event exactly once.

For every message: decode, bounded (poison -> dead-lettered with the reason, then move on);
open ONE Postgres transaction; insert ``(consumer_group, dedup_key, event_type)`` into
``processed_event``; if the row already existed the event is a duplicate (redelivery or
re-publication) and the handler is not called; else run the handler registered for the event's
class in that same transaction; commit; only then store the Kafka offset
(``enable.auto.offset.store=false``; the stored offsets are auto-committed). A crash anywhere
before the commit redoes everything; a crash after it finds the row. That is "delivered
at-least-once, applied exactly once".

Failures (one route for every consumer, :mod:`consumers.routing`, shared with jobstream's stage
agents): a message without key, over ``max_message_bytes``, nested deeper than
``max_json_depth``, undecodable, schema-violating, refused by the handler
(:class:`~schemas.errors.PoisonMessage`), holding data Postgres cannot store
(``invalid_data``) or reusing an event id with other content (``event_id_conflict``) is poison:
dead-lettered (``<topic>.dlq``, else the ``dead_letter`` table) and its offset stored once that
is durable. Postgres or Kafka unavailable is transient: retried with backoff, nothing skipped.
Any other handler error is retried until the same error failed the same message
``poison_after`` times, then dead-lettered as ``handler_error``. Poison never blocks a
partition.

Batches: the messages already fetched when one arrives (up to ``batch_size`` messages and
``batch_max_bytes`` bytes of keys and values; a single larger message is a batch of its own,
applied alone) are applied in ONE transaction: one multi-row ``processed_event`` insert
(``INSERT ... SELECT FROM unnest(...) ON CONFLICT DO NOTHING RETURNING``) tells which keys are
new, the handler runs for the first copy of each new key -- the batch handler
(:meth:`IdempotentConsumer.on_batch`, e.g. one prepared ``INSERT ... SELECT FROM unnest`` per
table) once for all of them, else the per-event handler for each, one statement at a time -- one
commit, then the poison ones of the batch are dead-lettered and the offsets stored. If the
handler raises, the batch is rolled back and split in halves, each applied on its own, down to
one message per transaction, so a bad message costs only itself and its neighbours are applied
exactly once. With ``decode_ahead`` (the default) the next batch is fetched before this one is
applied and a second thread decodes it while this one is in Postgres (it only reads message
values: the Kafka consumer and Postgres stay in one thread), computes its dedup-key digests and
runs the batch handler's ``prepare`` on each event (e.g. the ready applier's binary rows,
:meth:`IdempotentConsumer.on_batch`). For a type registered with ``on_batch(...,
light=True)`` the batch path keeps the decoder's light form of an event (a ``job.ready``'s
checked msgspec struct, ``schemas.fastpath``) and builds its pydantic model only when a
handler or hook is given the event.

Apply lanes (``settings.apply_lanes``, 2 by default): a fetched batch of at least
``settings.apply_lanes_min_batch`` messages (200) is split by partition
(``partition % apply_lanes``) and its parts are applied at the same time, each in its own
transaction on its own Postgres connection (the ``run()`` thread is lane 0, the others are
helper threads), so one part's Python work runs while another waits on Postgres. Everything
above holds per part (dedup insert, handler, split on refusal, dead letters); a partition's
messages are always in one part, and the next batch starts only when every part is
committed, so per-partition order is kept. Only the ``run()`` thread touches the Kafka
consumer: a helper lane hands back the messages it applied, and their offsets are stored
(after ``after_apply``) once its part is committed; an offset of a partition revoked
meanwhile is not stored. The same dedup key in two parts at once (copies on two partitions)
is decided by the ``processed_event`` insert: one part waits for the other's row and skips
it. Hooks other than ``after_apply`` (``in_transaction``, ``on_applied``, ...) run in the
lane's thread. ``apply_lanes=1`` applies each batch in one transaction, as before.

Examples
--------
>>> from consumers import ConsumerSettings, IdempotentConsumer
>>> from schemas.events import JobReady
>>> consumer = IdempotentConsumer(ConsumerSettings(group="billing", db_schema="billing"))
>>> @consumer.on(JobReady)
... def charge(tx, event: JobReady) -> None:
...     tx.execute("INSERT INTO billing.ledger (dedup_key, amount_usd) VALUES (%s, %s)",
...                (event.dedup_key, event.payload.charge_usd))
>>> consumer.create_tables()        # doctest: +SKIP
>>> consumer.run_forever()          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import logging
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from psycopg import sql
from psycopg.rows import DictRow, dict_row, tuple_row

from consumers.ddl import create_tables, has_key_digest
from consumers.headers import HEADERS_UNREADABLE, read_headers
from consumers.holders import FrozenHolderWatch, session_name
from consumers.routing import (
    HANDLER_ERROR,
    REFUSED_DATA,
    DeadLetterSink,
    FailureCounter,
    classify,
    describe,
    is_outage,
)
from consumers.settings import ConsumerSettings
from schemas.errors import PoisonMessage, RetryableError
from schemas.events import as_model, decode_event

log = logging.getLogger("consumers.idempotent")

E = TypeVar("E")
Handler = Callable[[psycopg.Connection[Any], Any], None]
BatchHandler = Callable[[psycopg.Connection[Any], list[Any]], None]


@dataclass
class ConsumerStats:
    """Counters: applied (handler ran), duplicates (skipped), dead_lettered."""

    applied: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    started_at: float = field(default_factory=time.monotonic)


@dataclass
class Hooks:
    """Callbacks of an :class:`IdempotentConsumer` (each optional; exceptions they raise are
    logged and ignored, never allowed to change what happens to a message).

    Metrics: ``on_applied(event)``, ``on_duplicate(event)`` (after the commit),
    ``on_dead_lettered(code, reason)`` (once the dead letter is durable). Runtime:
    ``db_ok()`` / ``db_failed(exc)`` (readiness), ``message_scope(headers, group)`` (a context
    manager around one message: log context, tracing), ``bind(**fields)`` (facts learnt once
    decoded), ``after_apply()`` (after a commit, before the offsets are stored: a crash point),
    ``in_transaction()`` (the handler ran, the transaction is not committed yet: a pause point).
    """

    on_applied: Callable[[Any], None] | None = None
    on_duplicate: Callable[[Any], None] | None = None
    on_dead_lettered: Callable[[str, str], None] | None = None
    db_ok: Callable[[], None] | None = None
    db_failed: Callable[[BaseException], None] | None = None
    message_scope: Callable[..., contextlib.AbstractContextManager[Any]] | None = None
    bind: Callable[..., None] | None = None
    after_apply: Callable[[], None] | None = None
    in_transaction: Callable[[], None] | None = None


#: ``processed_event.event_type`` of the marker row that records a dead-lettered position.
DEAD_LETTER_MARK = "jobstream.dead_lettered"
_DEAD_LETTER_NS = uuid.UUID("6b0c1f0e-5d8a-4c59-9a8e-3f0f5a8e2d11")
#: A dead letter's transaction outlives the DLQ produce it waits for (milliseconds, text).
DEAD_LETTER_IDLE_LIMIT = "SELECT set_config('idle_in_transaction_session_timeout', %s, true)"
_MISSING = object()
#: Most messages :meth:`IdempotentConsumer._fetch` takes from the client at once while it fills
#: a batch: what it took past the byte cap waits for the next batch, so at most this many.
FETCH_CHUNK = 256


@dataclass(frozen=True)
class _Failed:
    """What ``prepare`` raised in the decode-ahead thread (raised again when applied)."""

    exc: Exception


def _call(hook: Callable[..., Any] | None, *args: Any, **kw: Any) -> None:
    if hook is None:
        return
    try:
        hook(*args, **kw)
    except Exception:  # a metrics hook never decides a message's fate
        log.exception("consumer hook %r failed", hook)


class IdempotentConsumer:
    """Consume the topics of the registered event classes and apply each event exactly once
    per ``(group, dedup_key, event_type)``.

    Parameters
    ----------
    settings : ConsumerSettings
        Kafka, Postgres and limits (env prefix ``JOBSTREAM_CONSUMER_``).
    group : str, optional
        Consumer group (default ``settings.group``).
    topics, event_types, handler, batch_handler
        Untyped registration (one handler for every type in ``event_types``, read from
        ``topics``); prefer :meth:`on`.
    max_batch : int, optional
        Most messages applied in one transaction (default ``settings.batch_size``; 1 = a
        transaction per message).
    kafka_config : dict, optional
        librdkafka settings merged over the consumer's defaults.
    sink : consumers.routing.DeadLetterSink, optional
        Where dead letters go (default: one built from ``settings``).
    hooks : Hooks, optional
        Metrics and runtime callbacks; ``on_applied``, ``on_duplicate`` and
        ``on_dead_lettered`` may also be passed directly.

    Raises
    ------
    ValueError
        Two handlers for one event class (from :meth:`on`).

    Examples
    --------
    >>> consumer = IdempotentConsumer(ConsumerSettings(group="billing"),
    ...                               on_applied=lambda ev: print("applied", ev.dedup_key))
    >>> @consumer.on(JobReady)
    ... def apply(tx, event: JobReady) -> None:
    ...     ...  # statements on tx; do not commit
    >>> consumer.topics
    ['job.ready']
    """

    def __init__(self, settings: ConsumerSettings | None = None, *, group: str | None = None,
                 topics: list[str] | None = None, event_types: tuple[str, ...] = (),
                 handler: Handler | None = None, batch_handler: BatchHandler | None = None,
                 max_batch: int | None = None, kafka_config: dict[str, Any] | None = None,
                 sink: DeadLetterSink | None = None, hooks: Hooks | None = None,
                 on_applied: Callable[[Any], None] | None = None,
                 on_duplicate: Callable[[Any], None] | None = None,
                 on_dead_lettered: Callable[[str, str], None] | None = None) -> None:
        self.settings = settings = settings or ConsumerSettings()
        self.group = group or settings.group
        self.max_batch = max_batch or settings.batch_size
        self.hooks = hooks or Hooks()
        for name, fn in (("on_applied", on_applied), ("on_duplicate", on_duplicate),
                         ("on_dead_lettered", on_dead_lettered)):
            if fn is not None:
                setattr(self.hooks, name, fn)
        self._topics: list[str] = list(topics or [])
        self._handlers: dict[str, Handler] = {}
        self._batch_handlers: dict[str, BatchHandler] = {}
        # event type -> on_batch(prepare=...): run in the decode-ahead thread per event.
        self._prepare: dict[str, Callable[[Any], Any]] = {}
        # event types registered with on_batch(light=True): decoded to their light form.
        self._light: frozenset[str] = frozenset()
        for t in event_types:
            if handler is not None:
                self._handlers[t] = handler
            if batch_handler is not None:
                self._batch_handlers[t] = batch_handler
        self._table = (sql.Identifier(settings.db_schema, settings.table) if settings.db_schema
                       else sql.Identifier(settings.table))
        self._event_id_index = f"{settings.table}_event_id"
        # Shape of the table, read at each new connection: True = key_digest primary key
        # (consumers/sql/consumer.sql), False = the first shape (an older table, not upgraded).
        self._key_digest = False
        # event type -> sha256 state after "group \0 event_type \0" (_digest: a copy per key)
        self._digest_prefixes: dict[str, Any] = {}
        self.stats = ConsumerStats()
        self._stop = threading.Event()
        # This consumer's token: the end of its Kafka client.id and of its Postgres sessions'
        # application_name, so the partitions' next owner can tell a session of a consumer
        # that left the group (consumers/holders.py).
        self._token = uuid.uuid4().hex[:12]
        user = {**settings.kafka_extra, **(kafka_config or {})}
        self._consumer = Consumer({
            "bootstrap.servers": settings.bootstrap_servers, "group.id": self.group,
            "enable.auto.commit": True, "auto.commit.interval.ms": 1000,
            "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "session.timeout.ms": settings.session_timeout_ms,
            "heartbeat.interval.ms": max(500, settings.session_timeout_ms // 5),
            **user, "client.id": f"{user.get('client.id', 'jobstream-consumer')}-{self._token}"})
        self._busy_since: float | None = None  # monotonic s the current apply started
        # The longest a rebalance can take before the coordinator ends it (ms): its join
        # phase waits up to the members' rebalance timeout (max.poll.interval.ms, librdkafka's
        # default 300 s), its sync phase up to the leader's session timeout.
        # Both as the client runs them: kafka_extra (``user``) overrides the settings.
        self._rebalance_bound_ms = (
            int(user.get("max.poll.interval.ms", 300_000))
            + int(user.get("session.timeout.ms", settings.session_timeout_ms)))
        # Group membership, for the log: when this consumer last lost or gave up its
        # partitions without being assigned any since (time.monotonic(); None while it holds
        # an assignment, even an empty one), and whether that was already reported as long.
        self._rebalance_since: float | None = None
        self._rebalance_reported = False
        if sink is None:
            dl = (sql.Identifier(settings.db_schema, settings.dead_letter_table)
                  if settings.db_schema else sql.Identifier(settings.dead_letter_table))
            sink = DeadLetterSink({"bootstrap.servers": settings.bootstrap_servers,
                                   **settings.kafka_extra}, dsn=settings.dsn, group=self.group,
                                  max_message_bytes=settings.max_message_bytes,
                                  dlq_produce_timeout_s=settings.dlq_produce_timeout_s,
                                  dlq_headroom_bytes=settings.dlq_headroom_bytes, table=dl)
        self._sink = sink
        self._failures = FailureCounter()
        # Apply lanes (settings.apply_lanes): lane -> its connection. The calling thread of
        # run() is lane 0; each helper thread learns its lane number at start (_lane.n).
        self._conns: dict[int, psycopg.Connection[DictRow]] = {}
        self._lane = threading.local()
        self._lane_numbers = itertools.count(1)
        # stats and the dead-letter sink are shared by the lanes
        self._shared_lock = threading.Lock()
        self._headers: dict[tuple[Any, Any, Any], list[tuple[str, bytes | None]]] = {}
        # (topic, partition, offset) -> the event or the PoisonMessage its decoding raised,
        # for the batch being applied (filled by the decode-ahead thread), and -> what its
        # type's prepare() returned (or the exception it raised, wrapped in _Failed).
        self._predecoded: dict[tuple[Any, Any, Any], Any] = {}
        self._prepared: dict[tuple[Any, Any, Any], Any] = {}
        # (dedup_key, event_type) -> its key_digest, computed by the decode-ahead thread.
        self._digests: dict[tuple[str, str], bytes] = {}
        # Fetched after a batch reached settings.batch_max_bytes: the start of the next one.
        self._carry: list[Message] = []

    @property
    def _conn(self) -> psycopg.Connection[DictRow] | None:
        """The connection of the calling thread's apply lane (None until opened)."""
        return self._conns.get(getattr(self._lane, "n", 0))

    @_conn.setter
    def _conn(self, conn: psycopg.Connection[DictRow] | None) -> None:
        lane = getattr(self._lane, "n", 0)
        if conn is None:
            self._conns.pop(lane, None)
        else:
            self._conns[lane] = conn

    # -- registration -------------------------------------------------------------------

    def on(self, event_class: type[E], *, topic: str | None = None,
           batch: Callable[[psycopg.Connection[Any], list[E]], None] | None = None
           ) -> Callable[[Callable[[psycopg.Connection[Any], E], None]],
                         Callable[[psycopg.Connection[Any], E], None]]:
        """Register the handler of ``event_class`` (a decorator).

        The class chooses the route: its ``event_type`` is what is accepted and, with
        ``settings.topic_prefix``, the topic subscribed (``topic`` overrides the name). The
        handler gets the open transaction and the typed event; it must not commit. It may raise
        :class:`~schemas.errors.PoisonMessage` (dead-lettered at once); any other error rolls
        back and is retried (``poison_after`` identical failures -> ``handler_error`` DLQ).

        Parameters
        ----------
        event_class : type
            A ``schemas.events`` model (e.g. ``JobReady``).
        topic : str, optional
            Full topic name when it is not ``topic_prefix + event_type``.
        batch : callable, optional
            ``batch(tx, events)`` with the effect of calling the handler for each event in
            order (e.g. multi-row statements); used for batches.

        Raises
        ------
        ValueError
            ``event_class`` already has a handler, or has no ``event_type``.

        Examples
        --------
        >>> @consumer.on(JobReady)
        ... def apply(tx, event: JobReady) -> None:
        ...     tx.execute("INSERT INTO ledger (dedup_key) VALUES (%s)", (event.dedup_key,))
        """
        fields = getattr(event_class, "model_fields", {})
        event_type = fields["event_type"].default if "event_type" in fields else None
        if not isinstance(event_type, str):
            raise ValueError(f"{event_class!r} has no event_type: not an event model")
        if event_type in self._handlers:
            raise ValueError(f"{event_type} already has a handler: one handler per event class")

        def register(fn: Callable[[psycopg.Connection[Any], E], None]
                     ) -> Callable[[psycopg.Connection[Any], E], None]:
            self._handlers[event_type] = fn
            if batch is not None:
                self._batch_handlers[event_type] = batch
            name = topic or self.settings.topic(event_type)
            if name not in self._topics:
                self._topics.append(name)
            return fn

        return register

    def on_batch(self, event_class: type[E], *, prepare: Callable[[E], Any] | None = None,
                 light: bool = False
                 ) -> Callable[[Callable[[psycopg.Connection[Any], list[Any]], None]],
                               Callable[[psycopg.Connection[Any], list[Any]], None]]:
        """Register the batch handler of ``event_class`` (a decorator), next to its per-event
        handler (:meth:`on`, registered first: the per-event handler still applies a batch
        that had to be split down to single messages).

        ``fn(tx, events)`` gets the open transaction and the new events of a batch (first copy
        of each new dedup key, in delivery order) and must have the effect of calling the
        per-event handler for each in order, e.g. one multi-row statement per table. It must
        not commit. If it raises, the batch is rolled back and split.

        ``prepare(event)``, if given, turns one event into what ``fn`` writes (e.g. its rows
        as bytes) without touching Postgres; it runs in the decode-ahead thread right
        after the event is decoded, so that work is done while the previous batch is in
        Postgres, and ``fn(tx, values)`` then gets the prepared values of the new events
        instead of the events (same order). It must be pure and thread-safe. An error it
        raises is raised again when its event's batch is applied (rolled back and split:
        the per-event handler then applies that event alone, or refuses it).

        ``light=True`` (with ``prepare``): ``prepare`` also accepts the decoder's light form
        of the event, ``schemas.events.decode_event(..., light=...)`` (for ``job.ready`` the
        checked :class:`schemas.fastpath.Ready` struct: the model's attribute names and values,
        ``occurred_at`` as text), and the batch path then builds no pydantic model for an
        event that only goes through ``prepare`` (~3 us per ``job.ready``). Handlers and hooks
        still get models (built when called: equal, not always the same instance); the
        outcome of every message is the same.

        Raises
        ------
        ValueError
            ``event_class`` has no per-event handler yet, or already has a batch handler, or
            ``light`` without ``prepare``.

        Examples
        --------
        >>> @consumer.on_batch(JobReady)
        ... def apply_many(tx, events: list[JobReady]) -> None:
        ...     tx.execute("INSERT INTO ledger (dedup_key) SELECT unnest(%s::text[])",
        ...                ([ev.dedup_key for ev in events],), prepare=True)

        Send the rows as parameters of a prepared statement (``prepare=True``), not with
        ``COPY ... FROM STDIN``: a consumer frozen mid-COPY keeps its session ``active``, which
        ``transaction_idle_timeout_s`` does not end, holding the batch's dedup rows (and the
        partitions' next owner) for as long as it is frozen.
        """
        fields = getattr(event_class, "model_fields", {})
        event_type = fields["event_type"].default if "event_type" in fields else None
        if not isinstance(event_type, str) or event_type not in self._handlers:
            raise ValueError(f"{event_class!r}: register its per-event handler with "
                             "@consumer.on first")
        if event_type in self._batch_handlers:
            raise ValueError(f"{event_type} already has a batch handler")
        if light and prepare is None:
            raise ValueError("light=True needs prepare (only prepare gets the light form)")

        def register(fn: Callable[[psycopg.Connection[Any], list[Any]], None]
                     ) -> Callable[[psycopg.Connection[Any], list[Any]], None]:
            self._batch_handlers[event_type] = fn
            if prepare is not None:
                self._prepare[event_type] = prepare
            if light:
                self._light |= {event_type}
            return fn

        return register

    @property
    def topics(self) -> list[str]:
        """Full names of the subscribed topics."""
        return list(self._topics)

    @property
    def event_types(self) -> tuple[str, ...]:
        """Event types with a handler (others are dead-lettered as ``unexpected_type``)."""
        return tuple(self._handlers)

    # -- tables -------------------------------------------------------------------------

    def create_tables(self) -> None:
        """Create ``processed_event`` and ``dead_letter`` in ``settings.db_schema``
        (:func:`consumers.ddl.create_tables`). Raises ``psycopg.Error``."""
        with psycopg.connect(self.settings.dsn, connect_timeout=10) as conn:
            create_tables(conn, self.settings.db_schema or "public", self.settings.table,
                          self.settings.dead_letter_table)

    def gc(self, horizon_s: float, *, batch: int = 10_000) -> int:
        """Delete this group's ``processed_event`` rows older than ``horizon_s`` seconds;
        returns how many. Keep ``horizon_s`` above the longest time a copy of an event can
        still arrive (the topic's retention, a replay window): a copy older than the horizon
        would be applied again. Raises ``psycopg.Error``.

        Examples
        --------
        >>> consumer.gc(7 * 86400)  # doctest: +SKIP
        1234
        """
        # By ctid: the same statement for both shapes of the table (key_digest or not).
        q = sql.SQL("DELETE FROM {t} WHERE ctid = ANY(ARRAY("
                    " SELECT ctid FROM {t}"
                    "  WHERE consumer_group = %s"
                    "    AND processed_at < now() - make_interval(secs => %s) LIMIT %s))"
                    ).format(t=self._table)
        total = 0
        with psycopg.connect(self.settings.dsn, autocommit=True, connect_timeout=10) as conn:
            while True:
                n = conn.execute(q, (self.group, float(horizon_s), batch)).rowcount
                total += n
                if n < batch:
                    return total

    # -- processing ---------------------------------------------------------------------

    def headers(self, msg: Message) -> list[tuple[str, bytes | None]]:
        """``msg``'s headers, read from confluent-kafka ONCE per message
        (:func:`consumers.headers.read_headers`: unreadable header names become one header
        ``headers_unreadable``; the event itself is still processed)."""
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
        """Ask the loop to return after the current message (also a signal handler)."""
        self._stop.set()

    def _db(self) -> psycopg.Connection[DictRow]:
        if self._conn is None or self._conn.closed:
            try:
                # A consumer frozen inside its transaction past this loses the session, so
                # the batch's locks: the partitions' next owner does not wait for it.
                ms = int(self.settings.transaction_idle_timeout_s * 1000)
                options = psycopg.conninfo.conninfo_to_dict(self.settings.dsn).get("options")
                conn = self._conn = psycopg.connect(
                    self.settings.dsn, row_factory=dict_row, connect_timeout=10,
                    application_name=session_name(self.group, self._token),
                    options=f"{options or ''} -c idle_in_transaction_session_timeout={ms}")
            except psycopg.OperationalError as exc:
                _call(self.hooks.db_failed, exc)
                raise
            try:
                self._key_digest = has_key_digest(conn, self._table)
                conn.commit()
            except psycopg.Error:
                conn.close()
                self._conn = None
                raise
            _call(self.hooks.db_ok)
            return conn
        return self._conn

    def db_probe(self) -> None:
        """Readiness probe of an idle consumer: fine while it holds an open connection (its
        work reports failures); else it must be able to open one. Raises
        ``psycopg.OperationalError``."""
        conn = self._conn
        if conn is None or conn.closed:
            psycopg.connect(self.settings.dsn, connect_timeout=10).close()

    def _dead_letter(self, msg: Message, code: str, reason: str) -> bool:
        """Make the dead letter durable (``<topic>.dlq``, else the dead_letter table), once per
        consumer group and position; True when sent, False when this group had already
        dead-lettered that position.

        A consumer paused (SIGSTOP, VM pause) while its partitions were handed to another
        works through its stale batch when it resumes, before its client notices the lost
        assignment: its applies are absorbed by ``processed_event``, and so are its dead letters.
        The position is recorded there as a marker row (event type :data:`DEAD_LETTER_MARK`,
        dedup key ``<topic>[<partition>]@<offset>``) in a transaction that commits only once
        the dead letter is durable, so a crash in between dead-letters it again (at least
        once), never not at all. The transaction's idle limit covers the sink's waits (at least
        ``2 * (dlq_produce_timeout_s + 5) + 10`` s, else ``transaction_idle_timeout_s``). A
        consumer paused inside the DLQ produce itself (between the send and the
        acknowledgement) past that limit loses its session and marker; the send cannot be
        fenced by Postgres, so once resumed it can add one second record of that one position
        (``dlq replay`` re-produces both; the idempotency key absorbs the copy). Raises
        :class:`RetryableError` when neither the DLQ nor Postgres took it (the offset must not
        be stored), ``psycopg.Error`` when Postgres is away."""
        topic, partition, offset = msg.topic() or "", msg.partition() or 0, msg.offset() or 0
        position = f"{topic}[{partition}]@{offset}"
        headers = self.headers(msg)
        conn = self._db()
        with conn.transaction():
            # The sink below waits inside this transaction: up to dlq_produce_timeout_s + 5 s
            # for the DLQ, then (the table took it) as long again for the reference record.
            # An idle limit shorter than that ended the session of a live consumer, so the
            # dead letter went to the table and its marker was lost, again at every retry, for
            # as long as the DLQ did not answer (tests/e2e/test_break_consumer_slow_dlq.py).
            wait_s = 2 * (self.settings.dlq_produce_timeout_s + 5) + 10
            if wait_s > self.settings.transaction_idle_timeout_s:
                conn.execute(DEAD_LETTER_IDLE_LIMIT, (str(int(wait_s * 1000)),))
            if not self._record_keys(conn, [position], [DEAD_LETTER_MARK], [uuid.uuid5(
                    _DEAD_LETTER_NS, f"{self.group}\0{position}")], [None]):
                log.info("%s was dead-lettered before by group %s (a redelivery to a revoked "
                         "or restarted consumer); not again", position, self.group)
                return False
            with self._shared_lock:  # one sink for every apply lane
                self._sink.send(topic=topic, partition=partition, offset=offset, key=msg.key(),
                                value=msg.value(), headers=headers, code=code, reason=reason)
                self.stats.dead_lettered += 1
        _call(self.hooks.on_dead_lettered, code, reason)
        return True

    def _decode(self, msg: Message, light: bool = False) -> Any:
        """The message's event, bounded (size, JSON depth) before parsing: its model, or with
        ``light`` its light form when the decode-ahead thread made one (see :meth:`on_batch`).
        Raises :class:`PoisonMessage` (a message without key is ``missing_key``)."""
        got = self._predecoded.get((msg.topic(), msg.partition(), msg.offset()))
        if got is not None:
            if isinstance(got, PoisonMessage):
                raise got
            return got if light else as_model(got)
        return self._decode_now(msg)

    def _decode_now(self, msg: Message, expected: tuple[str, ...] | None = None,
                    light: frozenset[str] = frozenset()) -> Any:
        """:meth:`_decode` without the decode-ahead results; ``expected``: :attr:`event_types`
        (given by a caller that decodes many messages, so the tuple is built once);
        ``light``: the types whose light form is returned (``decode_event``)."""
        if _unreadable(msg):
            raise PoisonMessage(f"the Kafka client could not read this message: {msg.error()}",
                                code="unreadable_message")
        if msg.key() is None:
            raise PoisonMessage("message has no key (jobstream events are keyed by job id)",
                                code="missing_key")
        return decode_event(msg.value(),
                            expected=self.event_types if expected is None else expected,
                            max_bytes=self.settings.max_message_bytes,
                            max_depth=self.settings.max_json_depth, light=light)

    def _scope(self, msg: Message) -> contextlib.AbstractContextManager[Any]:
        if self.hooks.message_scope is None:
            return contextlib.nullcontext()
        return self.hooks.message_scope(self.headers(msg), group=self.group)

    def process(self, msg: Message) -> str:
        """Handle one message; returns ``applied``, ``duplicate`` or ``dead_lettered``.

        Raises ``psycopg.Error`` (or the handler's error) after rolling back: the caller must
        not store the offset and retries the message.
        """
        with self._scope(msg):
            outcome = self._process(msg)
            log.debug("%s %s[%d]@%d", outcome, msg.topic(), msg.partition(), msg.offset())
            return outcome

    def _process(self, msg: Message) -> str:
        try:
            event = self._decode(msg)
        except PoisonMessage as exc:
            return "dead_lettered" if self._dead_letter(msg, exc.code, str(exc)) else "duplicate"
        _call(self.hooks.bind, request_id=event.request_id, tenant=event.tenant_id,
              event_type=event.event_type, job_id=event.job_id)
        conn = self._db()
        try:
            with conn.transaction():
                row = self._record(conn, event)
                if row is None:
                    with self._shared_lock:
                        self.stats.duplicates += 1
                    _call(self.hooks.on_duplicate, event)
                    return "duplicate"
                self._handlers[event.event_type](conn, event)
                _call(self.hooks.in_transaction)
        except (PoisonMessage, *REFUSED_DATA) as exc:
            return ("dead_lettered" if self._dead_letter(msg, classify(exc)[1], describe(exc))
                    else "duplicate")
        with self._shared_lock:
            self.stats.applied += 1
        _call(self.hooks.on_applied, event)
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
        seen: list[tuple[int, Any]] = []
        for i, msg in enumerate(msgs):
            try:
                event = self._decode(msg, light=True)  # models only where needed, below
            except PoisonMessage as exc:
                poison.append((i, exc))
                continue
            seen.append((i, event))
            first.setdefault((event.dedup_key, event.event_type), (i, event))
        conn = self._db()
        applied: list[Any] = []
        if first:
            with conn.transaction():
                todo = self._new_events(conn, seen, first)
                types = {ev.event_type for _, ev in todo}
                one = next(iter(types)) if len(types) == 1 else None
                if one is not None and one in self._batch_handlers:
                    prepare = self._prepare.get(one)
                    self._batch_handlers[one](conn, [ev for _, ev in todo] if prepare is None
                                              else self._prepared_values(msgs, todo, prepare))
                else:
                    # Not in a psycopg pipeline (it saved a round trip per statement): a
                    # statement sent in pipeline mode leaves the backend ``active``
                    # (ClientRead) until a Sync, and psycopg's Flush request after a Sync
                    # disarms the timer, so idle_in_transaction_session_timeout never ended
                    # the session of a consumer frozen between or inside its handlers: it kept
                    # the batch's rows, and the next owner waiting, for good
                    # (tests/e2e/test_break_consumer_pipeline*.py).
                    for _, ev in todo:
                        self._handlers[ev.event_type](conn, as_model(ev))
                _call(self.hooks.in_transaction)
                for i, ev in todo:
                    outcomes[i] = "applied"
                    applied.append(ev)
        for i, bad in poison:
            if self._dead_letter(msgs[i], bad.code, str(bad)):
                outcomes[i] = "dead_lettered"
        with self._shared_lock:
            self.stats.applied += outcomes.count("applied")
            self.stats.duplicates += outcomes.count("duplicate")
        if self.hooks.on_applied is not None:
            for ev in applied:
                _call(self.hooks.on_applied, as_model(ev))
        if self.hooks.on_duplicate is not None:
            for i, ev in seen:
                if outcomes[i] == "duplicate":
                    _call(self.hooks.on_duplicate, as_model(ev))
        if log.isEnabledFor(logging.DEBUG):
            for msg, outcome in zip(msgs, outcomes, strict=True):
                with self._scope(msg):
                    log.debug("%s %s[%d]@%d", outcome, msg.topic(), msg.partition(),
                              msg.offset())
        return outcomes

    def _prepared_values(self, msgs: list[Message], todo: list[tuple[int, Any]],
                         prepare: Callable[[Any], Any]) -> list[Any]:
        """``prepare(event)`` of each ``(index, event)`` of ``todo``: from the decode-ahead
        thread when it ran, else computed now. Raises what ``prepare`` raised."""
        out = []
        for i, ev in todo:
            m = msgs[i]
            got = self._prepared.get((m.topic(), m.partition(), m.offset()), _MISSING)
            if got is _MISSING:
                got = prepare(ev)
            elif isinstance(got, _Failed):
                raise got.exc
            out.append(got)
        return out

    def _new_events(self, conn: psycopg.Connection[Any], seen: list[tuple[int, Any]],
                    first: dict[tuple[str, str], tuple[int, Any]]) -> list[tuple[int, Any]]:
        """Record the batch's keys in ``processed_event`` (one statement, in ``conn``'s
        transaction) and return ``(index, event)`` of the events to apply: the first copy of
        each key that was new, in delivery order. ``seen``: every decoded ``(index, event)``;
        ``first``: key -> its first copy. Raises ``psycopg.Error`` (an event id reused by
        another key: ``UniqueViolation``, the batch is then split)."""
        events = [ev for _, ev in first.values()]
        new = self._record_keys(conn, [e.dedup_key for e in events],
                                [e.event_type for e in events], [e.event_id for e in events],
                                [e.job_id for e in events])
        return [(i, ev) for key, (i, ev) in first.items() if key in new]

    def _record_keys(self, conn: psycopg.Connection[Any], keys: list[str], types: list[str],
                     event_ids: list[Any], job_ids: list[Any]) -> set[tuple[str, str]]:
        """Insert ``processed_event`` rows (one statement, in ``conn``'s transaction) and
        return the ``(dedup_key, event_type)`` pairs that were new. Raises ``psycopg.Error``."""
        # Prepared on first use (prepare=True): the keys then arrive in a Bind message right
        # after a ReadyForQuery, read while the session is "idle in transaction", so a
        # consumer frozen while sending them is ended by idle_in_transaction_session_timeout
        # (an unprepared statement's Parse comes first and the timeout is not armed again
        # before its Bind). The batch handler's statements should do the same
        # (jobstream.ready_applier.apply_ready_rows).
        cur = conn.cursor(row_factory=tuple_row)
        with _shape_changed(self):
            if self._key_digest:
                pre = self._digests  # from the decode-ahead thread, else computed here
                digests = [pre.get((k, t)) or self._digest(t, k)
                           for t, k in zip(types, keys, strict=True)]
                by_digest = dict(zip(digests, zip(keys, types, strict=True), strict=True))
                # The new rows' digests come back (16 bytes each, binary), not their texts.
                return {by_digest[d] for d, in cur.execute(
                    sql.SQL(RECORD_PROCESSED_BATCH_DIGEST).format(table=self._table),
                    (self.group, digests, keys, types, event_ids, job_ids),
                    binary=True, prepare=True).fetchall()}
            return set(cur.execute(sql.SQL(RECORD_PROCESSED_BATCH).format(table=self._table),
                                   (self.group, keys, types, event_ids, job_ids),
                                   prepare=True).fetchall())

    def _digest(self, event_type: str, dedup_key: str) -> bytes:
        """:func:`consumers.ddl.key_digest` of this group (its prefix hashed once)."""
        pre = self._digest_prefixes.get(event_type)
        if pre is None:  # once per event type (a handful): the group and type hashed once
            pre = hashlib.sha256(b"\0".join((self.group.encode(), event_type.encode(), b"")))
            self._digest_prefixes[event_type] = pre
        h = pre.copy()
        h.update(dedup_key.encode())
        return h.digest()[:16]

    def _settle(self, msg: Message) -> bool:
        """Process ``msg`` until it is applied, a duplicate or dead-lettered; False if stopped
        first (its offset must then not be stored).

        Poison (decode, validation, :class:`PoisonMessage`, ``psycopg.DataError``) is
        dead-lettered at once. Transient failures (Postgres or the broker away) are retried with
        backoff, nothing skipped. Any other handler error is retried too, but the same error on
        the same message ``poison_after`` times in a row makes it poison (``handler_error``,
        the exception as reason). Each failure logs one ``processing failed`` line with
        topic/partition/offset and the next action.
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
                outage = is_outage(exc)
                if outage:
                    _call(self.hooks.db_failed, exc)  # one line per outage, not per retry
                    if self._conn is not None:
                        self._conn.close()
                        self._conn = None
                if kind == "bug":
                    n = self._failures.record(position, exc)
                    if n >= self.settings.poison_after:
                        log.warning("processing failed %s[%d]@%d (%s, %d times); next: "
                                    "dead-letter (%s)", *position, describe(exc), n,
                                    HANDLER_ERROR)
                        if self._dead_letter_or_wait(msg, HANDLER_ERROR,
                                                     f"failed {n} times: {describe(exc)}"):
                            self._failures.forget(position)
                            return True
                        continue
                    action = f"retry {n + 1}/{self.settings.poison_after}"
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

    def _one_by_one(self, msgs: list[Message],
                    store: Callable[[Message], None] | None = None) -> bool:
        """The per-message path: settle, then store the offset, message after message
        (``store``: see :meth:`_apply`)."""
        for msg in msgs:
            if not self._settle(msg):
                return False  # stopping: the offset of the unprocessed message is not stored
            if store is None:
                _call(self.hooks.after_apply)
                self._store_offset(msg)
            else:
                store(msg)
        return True

    def _store_offset(self, msg: Message) -> None:
        """Store ``msg``'s offset for the next commit. A partition revoked meanwhile (a
        rebalance served while a batch was fetched) is skipped: its new owner re-delivers from
        the last committed offset, and processed_event absorbs the copy."""
        try:
            if msg.error() is None:
                self._consumer.store_offsets(message=msg)
            else:  # an unreadable message, dead-lettered (_UNREADABLE): the client refuses
                # to store a message with an error, and fetches its offset again and again
                past = TopicPartition(msg.topic() or "", msg.partition() or 0,
                                      (msg.offset() or 0) + 1)
                self._consumer.store_offsets(offsets=[past])
                self._consumer.seek(past)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._STATE:
                raise
            log.info("%s[%d] is no longer assigned; offset %d not stored (its next owner "
                     "re-delivers it as a duplicate)", msg.topic(), msg.partition(),
                     msg.offset())

    def _apply_lanes(self, msgs: list[Message], lanes: ThreadPoolExecutor | None) -> bool:
        """Apply a fetched batch and store its offsets; False when stopped before the end.

        With ``lanes`` (``settings.apply_lanes`` > 1) a batch of at least
        ``settings.apply_lanes_min_batch`` messages is split by partition
        (``partition % apply_lanes``): the first part is applied in this thread, the others
        at the same time by the lane threads, each on its own connection, in its own
        transaction. Every part is finished (committed, or stopped) before this returns, so
        the next batch of a partition never overtakes this one. The lane threads do not touch
        the Kafka consumer: the messages they applied come back here, and their offsets are
        stored (after the ``after_apply`` hook) only once their part is committed."""
        if lanes is None or len(msgs) < max(2, self.settings.apply_lanes_min_batch):
            return self._apply(msgs)
        n = self.settings.apply_lanes
        parts: dict[int, list[Message]] = {}
        for m in msgs:
            parts.setdefault((m.partition() or 0) % n, []).append(m)
        if len(parts) < 2:
            return self._apply(msgs)
        mine, *others = parts.values()
        futures = [lanes.submit(self._apply_part, part) for part in others]
        try:
            ok = self._apply(mine)
        finally:
            # wait for every part, whatever happened here: a lane still in its transaction
            # must not be overtaken by the next batch of its partitions
            done = [f.exception() or f.result() for f in futures]
        for got in done:
            if isinstance(got, BaseException):
                raise got
            part_ok, applied = got
            if applied:
                self._applied(applied)
            ok = ok and part_ok
        return ok

    def _apply_part(self, msgs: list[Message]) -> tuple[bool, list[Message]]:
        """A lane thread's part of a batch: :meth:`_apply` with the offsets collected, not
        stored (the caller stores them: the Kafka consumer stays in one thread). Returns
        (finished, the messages applied, duplicates or dead-lettered, in order)."""
        applied: list[Message] = []
        return self._apply(msgs, applied.append), applied

    def _lane_start(self) -> None:
        """Initializer of a lane thread: its lane number (its own connection)."""
        self._lane.n = next(self._lane_numbers)

    def _apply(self, msgs: list[Message],
               store: Callable[[Message], None] | None = None) -> bool:
        """Apply a batch and store its offsets; False when stopped before the end. With
        ``store`` (a lane thread), each message applied is passed to it instead: no hook, no
        offset stored here."""
        if len(msgs) == 1:
            return self._one_by_one(msgs, store)
        while not self._stop.is_set():
            try:
                self.process_batch(msgs)
            except Exception as exc:
                if not is_outage(exc):
                    # the handler (or Postgres) refused one: find it, halving the batch
                    half = len(msgs) // 2
                    log.info("batch of %d rolled back (%s: %s); applying it as %s", len(msgs),
                             type(exc).__name__, exc,
                             f"two batches of {half} and {len(msgs) - half}" if len(msgs) > 8
                             else "one message per transaction")
                    if len(msgs) <= 8:
                        return self._one_by_one(msgs, store)
                    return (self._apply(msgs[:half], store)
                            and self._apply(msgs[half:], store))
                _call(self.hooks.db_failed, exc)
                log.debug("batch failed (%s); retrying", exc)
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                self._stop.wait(0.5)
                continue
            if store is not None:
                for m in msgs:
                    store(m)
                return True
            self._applied(msgs)
            return True
        return False

    def _applied(self, msgs: list[Message]) -> None:
        """``msgs`` are committed (applied, duplicates or dead-lettered): run the
        ``after_apply`` hook, then store the offset after the last of each partition."""
        _call(self.hooks.after_apply)
        last: dict[tuple[str, int], Message] = {}
        for m in msgs:
            last[(m.topic() or "", m.partition() or 0)] = m
        for m in last.values():
            self._store_offset(m)

    def _fetch(self, timeout_s: float = 0.5) -> list[Message]:
        """The next message (waiting up to ``timeout_s`` seconds) and those already fetched
        after it, up to ``max_batch`` messages and ``settings.batch_max_bytes`` bytes of keys
        and values (never waits for more); [] when none came.

        The message that would take the batch over the byte cap is kept, with the rest of
        what was taken from the client with it (at most :data:`FETCH_CHUNK` messages), and
        starts the next batch (no wait). A message larger than the cap is a batch of its own
        (applied alone, :meth:`_one_by_one`). A kept message is not acknowledged until its own
        batch is applied (at a stop it is delivered again, like a batch fetched ahead)."""
        got = self._carry
        self._carry = []
        if not got:
            msg = self._consumer.poll(timeout_s)
            if msg is None:
                return []
            got = [msg]
        cap, most = self.settings.batch_max_bytes, self.max_batch
        msgs: list[Message] = []
        size = 0
        while True:
            for i, m in enumerate(got):
                err = m.error()
                if err is not None and not _unreadable(m):
                    if err.code() != KafkaError._PARTITION_EOF:
                        log.warning("consumer error: %s", err)
                    continue
                n = len(m.value() or b"") + len(m.key() or b"")
                if msgs and (len(msgs) >= most or size + n > cap):
                    self._carry = got[i:]  # the next batch starts with it
                    return msgs
                msgs.append(m)
                size += n
            if len(msgs) >= most or size >= cap:
                return msgs
            got = self._consumer.consume(min(most - len(msgs), FETCH_CHUNK), 0)
            if not got:
                return msgs

    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Rebalance callback (served inside ``poll()``): one line per assignment, with how
        long the consumer was without one. confluent-kafka assigns ``partitions`` after it
        returns: under the eager protocol (the default) the whole new assignment, possibly
        empty; under ``cooperative-sticky`` (``partition.assignment.strategy`` in
        ``kafka_extra``) only the partitions added, so the line counts those."""
        since, self._rebalance_since = self._rebalance_since, None
        waited = "" if since is None else f" after {time.monotonic() - since:.1f}s without"
        log.info("group %s: %d partition(s) assigned%s: %s", self.group, len(partitions),
                 waited, _partitions(partitions))

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Rebalance callback: the partitions are given up for a rebalance (unassigned after
        it returns); the consumer holds none until :meth:`_on_assign`."""
        self._rebalance_since, self._rebalance_reported = time.monotonic(), False
        log.info("group %s: %d partition(s) revoked (rebalance): %s", self.group,
                 len(partitions), _partitions(partitions))

    def _on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Rebalance callback: the assignment is lost (the client timed its session out,
        SESSTMOUT, e.g. through a broker outage longer than ``session.timeout.ms``, or the
        coordinator fenced it); unassigned after it returns, then the group is joined again
        as a new member. Offsets stored for the lost partitions are not committed: their
        next owner re-delivers from the last commit and ``processed_event`` absorbs it."""
        self._rebalance_since, self._rebalance_reported = time.monotonic(), False
        log.warning("group %s: assignment of %d partition(s) lost (session timed out or "
                    "fenced); rejoining the group: %s", self.group, len(partitions),
                    _partitions(partitions))

    def _report_long_rebalance(self) -> None:
        """Log once when the consumer has been without an assignment since a revoke, a loss
        or its subscribe for longer than ``max.poll.interval.ms`` + ``session.timeout.ms``
        (the longest a broker's join and sync phases can legitimately take): a consumer that
        never rejoins is otherwise silent (issue 12, outage12)."""
        since = self._rebalance_since
        if since is None or self._rebalance_reported:
            return
        waited = time.monotonic() - since
        if waited * 1000 < self._rebalance_bound_ms:
            return
        self._rebalance_reported = True
        log.warning("group %s: no partitions assigned for %.0fs (a rebalance that did not "
                    "finish: the group coordinator has not answered the join, or the client "
                    "did not rejoin); consuming nothing meanwhile", self.group, waited)

    def _decode_all(self, msgs: list[Message]) -> tuple[dict[tuple[Any, Any, Any], Any],
                                                        dict[tuple[Any, Any, Any], Any],
                                                        dict[tuple[str, str], bytes]]:
        """Decode a batch (in the decode-ahead thread): position -> event, or the
        :class:`PoisonMessage` its decoding raised (dead-lettered when the batch is applied);
        position -> its type's ``prepare(event)`` (:meth:`on_batch`), or ``_Failed``; and
        ``(dedup_key, event_type)`` -> its ``key_digest``. Reads only the messages' key and
        value: the Kafka consumer stays in one thread."""
        decoded: dict[tuple[Any, Any, Any], Any] = {}
        prepared: dict[tuple[Any, Any, Any], Any] = {}
        digests: dict[tuple[str, str], bytes] = {}
        prepares = self._prepare
        expected = self.event_types  # once per batch, not per message
        light = self._light
        for m in msgs:
            pos = (m.topic(), m.partition(), m.offset())
            try:
                event = decoded[pos] = self._decode_now(m, expected, light)
            except PoisonMessage as exc:
                decoded[pos] = exc
                continue
            key = (event.dedup_key, event.event_type)
            if key not in digests:
                try:  # noqa: SIM105 - contextlib.suppress costs ~0.4-1.3 us per new key
                    digests[key] = self._digest(event.event_type, event.dedup_key)
                except UnicodeEncodeError:
                    pass  # raised again when applied
            prepare = prepares.get(event.event_type) if prepares else None
            if prepare is not None:
                try:
                    prepared[pos] = prepare(event)
                except Exception as exc:  # noqa: BLE001 - raised again when applied
                    prepared[pos] = _Failed(exc)
        return decoded, prepared, digests

    def run(self, *, idle_exit_s: float | None = None) -> ConsumerStats:
        """Consume until :meth:`stop` (or, with ``idle_exit_s``, until idle that long, in
        seconds); returns the counters. Closing commits the stored offsets.

        With ``settings.decode_ahead`` (and ``max_batch`` > 1) the next batch is fetched
        before the current one is applied and decoded in a second thread meanwhile (the Kafka
        consumer and Postgres are used from this thread only); a batch fetched but not applied
        when the consumer stops is not acknowledged (it is delivered again). Meanwhile the
        interpreter's GIL switch interval is ``settings.switch_interval_s`` and, with
        ``settings.gc_tuning``, the collector is tuned (both process-wide, both restored).

        Raises
        ------
        ValueError
            No handler registered.
        """
        if not self._handlers or not self._topics:
            raise ValueError("no handler registered: use @consumer.on(EventClass)")
        self._rebalance_since, self._rebalance_reported = time.monotonic(), False
        self._consumer.subscribe(self._topics, on_assign=self._on_assign,
                                 on_revoke=self._on_revoke, on_lost=self._on_lost)
        log.info("consuming %s as group %s into %s (a new group starts at the earliest "
                 "retained message unless kafka_extra sets auto.offset.reset)",
                 ", ".join(self._topics), self.group, self._table.as_string(None))
        last_msg = time.monotonic()
        ahead = self.settings.decode_ahead and self.max_batch > 1
        decoder = (ThreadPoolExecutor(1, thread_name_prefix=f"decode-{self.group}")
                   if ahead else None)
        lanes = (ThreadPoolExecutor(self.settings.apply_lanes - 1, initializer=self._lane_start,
                                    thread_name_prefix=f"apply-{self.group}")
                 if self.settings.apply_lanes > 1 and self.max_batch > 1 else None)
        pending: tuple[list[Message], Future[Any]] | None = None  # fetched, being decoded
        # Ends a frozen former owner's session that this consumer's applies wait on
        # (consumers/holders.py): Postgres has no timeout for a session frozen mid-statement.
        watch = FrozenHolderWatch(
            group=self.group, token=self._token, dsn=self.settings.dsn,
            admin_config={"bootstrap.servers": self.settings.bootstrap_servers,
                          **self.settings.kafka_extra},
            held_s=self.settings.transaction_idle_timeout_s,
            busy_since=lambda: self._busy_since)
        watch.start()
        thresholds = gc.get_threshold()
        switch = sys.getswitchinterval()
        if ahead and self.settings.switch_interval_s is not None:
            # Two threads want the GIL: the decode thread (CPU-bound while a batch is decoded)
            # and this one, woken by each Postgres reply (about four per batch). At the default
            # interval this one waited up to 5 ms for the GIL after every reply.
            sys.setswitchinterval(self.settings.switch_interval_s)
        if self.settings.gc_tuning:
            # A batch of decoded events is ~14 container objects per event, alive until the
            # commit: at the default threshold (700) the cyclic collector ran every ~50 events
            # and re-walked every live object (the imported modules included), doubling the
            # decode cost. The objects alive now are frozen (never walked again) and young
            # cycles are collected every 50,000 allocations; restored when run() returns.
            gc.freeze()
            gc.set_threshold(max(thresholds[0], 50_000), *thresholds[1:])
        try:
            while not self._stop.is_set():
                msgs = self._fetch(0 if pending is not None else 0.5)
                if msgs:
                    last_msg = time.monotonic()
                if decoder is None:
                    current: tuple[list[Message], Any] | None = ((msgs, ({}, {}, {})) if msgs
                                                                 else None)
                else:
                    current = None if pending is None else (pending[0], pending[1].result())
                    pending = (msgs, decoder.submit(self._decode_all, msgs)) if msgs else None
                if current is None:
                    self._report_long_rebalance()
                    if (pending is None and idle_exit_s is not None
                            and time.monotonic() - last_msg > idle_exit_s):
                        break
                    continue
                self._predecoded, self._prepared, self._digests = current[1]
                self._busy_since = time.monotonic()
                try:
                    ok = self._apply_lanes(current[0], lanes)
                finally:
                    self._busy_since = None
                    self._predecoded, self._prepared, self._digests = {}, {}, {}
                    self._headers.clear()
                if not ok:
                    break
        finally:
            watch.close()
            sys.setswitchinterval(switch)
            if self.settings.gc_tuning:
                gc.set_threshold(*thresholds)
                gc.unfreeze()
            if decoder is not None:
                decoder.shutdown(wait=True, cancel_futures=True)
            if lanes is not None:
                lanes.shutdown(wait=True)
            self._carry = []  # fetched, not applied: delivered again
            self._consumer.close()  # commits the stored offsets
            self._sink.close()
            for conn in list(self._conns.values()):
                conn.close()
            self._conns.clear()
        return self.stats

    def run_forever(self) -> ConsumerStats:
        """:meth:`run` until SIGTERM or SIGINT (graceful: the current message or batch is
        finished and its offsets committed). Call it from the main thread."""
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        stats = self.run()
        log.info("consumer stopped: %s", stats)
        return stats

    def _record(self, conn: psycopg.Connection[DictRow], event: Any) -> Any:
        """Insert the idempotent-consumer row; ``None`` for a duplicate. Raises
        :class:`PoisonMessage` ``event_id_conflict`` when the event id was already recorded
        with other content (another dedup key or event type)."""
        try:
            with _shape_changed(self), conn.transaction():  # a savepoint: the outer
                # transaction survives the refusal
                if self._key_digest:
                    return conn.execute(
                        sql.SQL(RECORD_PROCESSED_DIGEST).format(table=self._table),
                        (self._digest(event.event_type, event.dedup_key), self.group,
                         event.dedup_key, event.event_type, event.event_id,
                         event.job_id)).fetchone()
                return conn.execute(sql.SQL(RECORD_PROCESSED).format(table=self._table), (
                    self.group, event.dedup_key, event.event_type, event.event_id,
                    event.job_id)).fetchone()
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.constraint_name != self._event_id_index:
                raise
            # ON CONFLICT arbitrates only the dedup key: when another consumer of the group
            # inserted this very event concurrently (the same message on two partitions, or
            # a partition's old and new owner during a rebalance), the insert can wait on
            # that row's (group, event_id) entry and fail there once it commits. Same event:
            # a duplicate, not poison (seen under load in
            # tests/integration/test_consumer_frozen_holder.py).
            if conn.execute(sql.SQL(SAME_EVENT_RECORDED).format(table=self._table), (
                    self.group, event.event_id, event.dedup_key,
                    event.event_type)).fetchone() is not None:
                return None
            raise PoisonMessage(f"event_id {event.event_id} was already used by another event",
                                code="event_id_conflict") from None


#: Errors the Kafka client reports for ONE message it fetched but cannot hand over (its
#: position is known): a batch whose decompression fails (e.g. a zstd "bomb" that unpacks past
#: ``receive.message.max.bytes``) or a corrupt one. The client fetches that offset again and
#: again, so such a message blocked its partition for good (adv15); it is dead-lettered as
#: ``unreadable_message`` and the consumer seeks past it (:meth:`IdempotentConsumer._store_offset`).
_UNREADABLE = frozenset({KafkaError._BAD_COMPRESSION, KafkaError._BAD_MSG})


def _unreadable(msg: Message) -> bool:
    """``msg`` is an error for one unreadable message with a position (see
    :data:`_UNREADABLE`)."""
    err = msg.error()
    offset = msg.offset()
    return (err is not None and err.code() in _UNREADABLE and msg.topic() is not None
            and offset is not None and offset >= 0)


def _partitions(partitions: list[TopicPartition]) -> str:
    """``topic[0,1,2] other[3]``: a rebalance's partitions, for one log line."""
    by_topic: dict[str, list[int]] = {}
    for tp in partitions:
        by_topic.setdefault(tp.topic, []).append(tp.partition)
    return " ".join(f"{t}[{','.join(map(str, sorted(ps)))}]" for t, ps in sorted(by_topic.items())
                    ) or "none"


@contextlib.contextmanager
def _shape_changed(consumer: IdempotentConsumer) -> Any:
    """Turn "the table no longer has the shape read at connect" (upgraded by
    :func:`consumers.ddl.upgrade_tables` while this consumer held its connection: the ON
    CONFLICT target or a column is gone) into an outage: the caller closes the connection and
    retries, and the next connection reads the shape again. Nothing is dead-lettered for it."""
    try:
        yield
    except (psycopg.errors.InvalidColumnReference, psycopg.errors.UndefinedColumn) as exc:
        raise psycopg.OperationalError(
            f"{consumer.settings.table}: its shape changed ({exc}); reconnecting") from exc


def run_forever(consumer: IdempotentConsumer) -> int:
    """Run ``consumer`` until SIGINT/SIGTERM; returns the exit code (0)."""
    consumer.run_forever()
    return 0


#: The idempotent-consumer row, in the same transaction as the effect. No row back = duplicate.
#: Is ``event_id`` already recorded in the group for this very event (same dedup key and type)?
SAME_EVENT_RECORDED = """
SELECT 1 FROM {table}
 WHERE consumer_group = %s AND event_id = %s AND dedup_key = %s AND event_type = %s"""
RECORD_PROCESSED = """
INSERT INTO {table} (consumer_group, dedup_key, event_type, event_id, job_id)
VALUES (%s, %s, %s, %s, %s)
ON CONFLICT (consumer_group, dedup_key, event_type) DO NOTHING
RETURNING 1 AS inserted"""
#: The rows of a batch (distinct keys). Returns the keys that were new; others are duplicates.
#: Binary parameters (%b): psycopg's text array dumper cost ~7 us per row, binary ~1 us.
#: Sorted by key: index pages visited in order (~10 % less Postgres CPU per row), and two
#: consumers inserting overlapping batches (a rebalance) lock the keys in the same order.
RECORD_PROCESSED_BATCH = """
INSERT INTO {table} (consumer_group, dedup_key, event_type, event_id, job_id)
SELECT %b, u.dedup_key, u.event_type, u.event_id, u.job_id
  FROM unnest(%b::text[], %b::text[], %b::uuid[], %b::uuid[])
       AS u(dedup_key, event_type, event_id, job_id)
 ORDER BY u.dedup_key, u.event_type
ON CONFLICT (consumer_group, dedup_key, event_type) DO NOTHING
RETURNING dedup_key, event_type"""
#: The same two statements for a table with the ``key_digest`` primary key (the current shape,
#: consumers/sql/consumer.sql): a 16-byte key, sorted, instead of three text columns.
RECORD_PROCESSED_DIGEST = """
INSERT INTO {table} (key_digest, consumer_group, dedup_key, event_type, event_id, job_id)
VALUES (%s, %s, %s, %s, %s, %s)
ON CONFLICT (key_digest) DO NOTHING
RETURNING 1 AS inserted"""
RECORD_PROCESSED_BATCH_DIGEST = """
INSERT INTO {table} (key_digest, consumer_group, dedup_key, event_type, event_id, job_id)
SELECT u.key_digest, %b, u.dedup_key, u.event_type, u.event_id, u.job_id
  FROM unnest(%b::bytea[], %b::text[], %b::text[], %b::uuid[], %b::uuid[])
       AS u(key_digest, dedup_key, event_type, event_id, job_id)
 ORDER BY u.key_digest
ON CONFLICT (key_digest) DO NOTHING
RETURNING key_digest"""
