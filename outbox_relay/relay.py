"""Outbox relay: Postgres ``outbox`` -> Kafka, at-least-once, per-key order kept.

Protocol (design.md, "Outbox relay"):

1. One active relay: a session-level ``pg_try_advisory_lock`` held on a dedicated connection;
   other relays stand by and take over when that connection dies. This keeps per-key order
   without partitioning the outbox (the simpler of the two designs the doc allows).
2. Read unpublished rows in id order (``published_at IS NULL``): after the last id fetched
   while a backlog drains, otherwise from a floor that trails by ``relay_late_commit_s``
   (and from id 0 every ``relay_full_rescan_s``), so a transaction that commits late with a
   lower id is still published (see "the pipelined loop" below and docs/design-notes.md);
   caught up, by probing only the ids it read past without a row (its gaps) while it knows
   them all, instead of reading the range from the floor; the full rescan probes every gap
   it knows, old ones too, and reads from id 0 only up to where it knows them (the whole
   range after an id-sequence restart; docs/design-notes.md, "The full rescan probes the old
   gaps").
3. Produce with an idempotent producer (``enable.idempotence=true``, ``acks=all``) without
   waiting: up to ``relay_max_in_flight`` rows are in flight while the next batch is fetched.
4. Delete a row (keeping its compact ``outbox_published`` record, migration 0022) only after
   its delivery report said so: while a backlog drains, on the marker thread's own
   connection; once caught up, in the same statement as the next fetch (one round trip and
   one transaction per wake-up). A crash between 3 and 4 re-publishes those rows: that is
   the at-least-once side, absorbed by idempotent consumers. A row that can never be
   delivered (over ``message.max.bytes`` = ``kafka_message_max_bytes``, refused by its topic,
   unserialisable) is isolated: a row the broker refused is re-sent alone (its batch-mates
   may be the reason), and if it fails alone it is parked in the ``dead_letter`` table with
   the broker's reason, its outbox row deleted and its job failed (``undeliverable_event``)
   in one transaction; the relay goes on. Rows that failed with a retriable error stay
   unpublished and are re-sent after a backoff (0.5 s doubling to ``relay_backoff_cap_s``).
5. Wake on ``LISTEN outbox_v1`` (a NOTIFY is sent by a trigger at commit); fall back to polling
   every ``relay_poll_interval_s``. Every ``gc_interval_s`` the active relay runs retention
   (:mod:`jobstream.retention`): ``outbox_published`` records, idempotent-consumer rows and
   idempotency records past their horizons, a bounded number of batches per run.
6. The active relay also runs the stuck-stage sweeper (``streams.actions.sweep``).
"""

from __future__ import annotations

import importlib
import logging
import queue
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from operator import itemgetter
from typing import Any

import orjson
import psycopg
from confluent_kafka import KafkaError, KafkaException, Producer
from psycopg.rows import tuple_row
from psycopg.types.json import set_json_loads

from jobstream import faults, health
from jobstream.db import QUERIES as Q
from jobstream.db import Conn, connect
from jobstream.kafka import base_config, producer_config
from jobstream.settings import Settings

log = logging.getLogger("jobstream.relay")

RELAY_LOCK_ID = 0x6F757462  # "outb": the active-relay advisory lock
HOUSEKEEPING_LOCK_ID = 0x6F757463  # the same for --housekeeping-only (Debezium publishes)
CHANNEL = "outbox_v1"
GC_MAX_BATCHES = 20  # per table and run: retention must not hold up publishing for long
#: The look below the last id probes the ids it read past (gaps: rolled back, or a
#: transaction still open) one by one while there are at most this many; with more, or
#: while the gaps are not all known, it reads the id range from the floor (see _fetch).
MAX_GAP_PROBES = 256
#: Gaps tracked at most; beyond (a sequence jump, mass rollbacks) tracking restarts above the
#: last id and the relay reads from the floor until the floor passes it.
MAX_GAPS = 20000
#: The full rescan probes the gaps it knows (old ones too) instead of reading the range above
#: ``_gap_base`` while there are at most this many; with more it reads the whole range, as
#: before, and the tracking restarts above the last id (see _fetch).
MAX_FULL_RESCAN_PROBES = 4096


class DeliveryFailed(Exception):
    """Some rows of a batch failed with a retriable error (they stay unpublished)."""


_MISSING = object()
_ID = itemgetter(0)  # an outbox row's id
#: Delivery errors that no retry fixes: the row is parked (dead_letter table), not re-sent.
PERMANENT_ERRORS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_MSG, KafkaError.INVALID_MSG_SIZE,
    KafkaError.RECORD_LIST_TOO_LARGE, KafkaError.INVALID_RECORD, KafkaError.POLICY_VIOLATION,
    KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.TOPIC_EXCEPTION, KafkaError._INVALID_ARG,
    KafkaError._BAD_MSG, KafkaError._VALUE_SERIALIZATION,
})


#: Delivery errors a missing topic gives: never created (``UNKNOWN_TOPIC_OR_PART`` once
#: ``topic.metadata.propagation.max.ms`` passed) or deleted after the producer had its metadata
#: (``_MSG_TIMED_OUT`` after ``message.timeout.ms``). Retriable, unless the broker's metadata
#: says the topic is gone for ``relay_missing_topic_park_s``: then the row is parked.
MISSING_TOPIC_ERRORS = frozenset({
    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._MSG_TIMED_OUT,
    KafkaError._UNKNOWN_PARTITION,
})


#: Bytes of a record batch beyond its records (the v2 batch header, 61, and the log entry's
#: offset and length, 12); the most a record adds to its key, value and headers (its length,
#: attributes, timestamp and offset deltas, key and value lengths, header count: varints);
#: the most a header adds to its name and value (two varint lengths). See record_bytes().
BATCH_OVERHEAD, RECORD_OVERHEAD, HEADER_OVERHEAD = 73, 36, 10


def record_bytes(row: tuple[Any, ...]) -> int:
    """An upper bound of the bytes (uncompressed) of outbox ``row`` alone in a record batch:
    its key, value and headers (UTF-8) plus the framing. Compression usually makes the batch
    the broker checks against ``max.message.bytes`` smaller; its worst-case growth on
    incompressible bytes is in :func:`narrow_batch_bytes`' margin."""
    _id, _topic, key, payload, headers, _type = row
    n = BATCH_OVERHEAD + RECORD_OVERHEAD + len(payload)
    if key is not None:
        n += len(key.encode()) if isinstance(key, str) else len(key)
    if isinstance(headers, dict):
        for k, v in headers.items():
            n += HEADER_OVERHEAD + len(str(k).encode()) + len(str(v).encode())
    elif headers:  # not the relay's dict (jsonb of another shape): its JSON, an upper bound
        n += HEADER_OVERHEAD + len(orjson.dumps(headers, default=str))
    return n


def relay_topic_wait(settings: Settings) -> dict[str, int]:
    """The relay producers' ``topic.metadata.propagation.max.ms`` (milliseconds):
    ``relay_topic_propagation_ms``, unless ``kafka_extra`` sets it (then that, from
    :func:`jobstream.kafka.base_config`). librdkafka's default (30 s) held the first row to a
    topic the broker does not know (and the relay's flush with it) for half a minute before
    it failed as missing; the relay holds such rows and re-sends them on the topic's own
    backoff anyway (:meth:`OutboxRelay._hold`, docs/design-notes.md "Relay windows")."""
    if "topic.metadata.propagation.max.ms" in settings.kafka_extra:
        return {}
    return {"topic.metadata.propagation.max.ms": settings.relay_topic_propagation_ms}


def narrow_batch_bytes(limit: int) -> int:
    """The ``batch.size`` (bytes) of the producer that sends a narrow topic's rows: what a
    record batch may hold so that, framed (``BATCH_OVERHEAD``) and compressed (lz4's frame
    header and worst-case growth on incompressible bytes: 64 bytes + 1 %), it stays within
    the topic's ``max.message.bytes`` = ``limit``. A row with a larger :func:`record_bytes`
    is not batched (:meth:`OutboxRelay._produce_narrow`)."""
    return max(1, limit - BATCH_OVERHEAD - 64 - limit // 100)


def _permanent(err: KafkaError | None) -> bool:
    return err is not None and err.code() in PERMANENT_ERRORS


def _describe_err(err: KafkaError | None) -> str:
    return "no delivery report" if err is None else f"{err.name()}: {err.str()}"


def _describe_exc(exc: Exception) -> str:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return _describe_err(exc.args[0])
    return f"{type(exc).__name__}: {exc}"


def _uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value)) if value else None
    except ValueError:
        return None


@dataclass
class RelayStats:
    """Counters of one relay process (rows published, batches, failed deliveries)."""

    published: int = 0
    batches: int = 0  # deletes of acknowledged rows (alone or with a fetch)
    failed: int = 0
    parked: int = 0
    #: Postgres transactions of the publishing path (fetches, deletes, parks; not the
    #: sweeper's or retention's): bench.relay reports them per event.
    transactions: int = 0
    started_at: float = field(default_factory=time.monotonic)


def id_array(ids: Iterable[int]) -> str:
    """``ids`` (outbox ids, ints) as a Postgres array literal (``'{1,2,3}'``), the parameter
    the relay's queries cast with ``::bigint[]``. psycopg dumps a Python list element by
    element in Python (~1.7 us per id, measured: 831 us for 500 ids, against 126 us for
    this join), and the relay sends every id at least once (its delete) and up to
    ``relay_max_in_flight`` of them per look from the floor (the ids to skip) (issue 12,
    perf-relay7)."""
    return "{" + ",".join(map(str, ids)) + "}"


def delete_params(ids: list[int], at: float, log: bool) -> dict[str, Any]:
    """Parameters of ``outbox_delete_published``: the row ids (as :func:`id_array`), ``at``
    (epoch seconds: when the acknowledgements were seen) as a timestamptz, and whether to
    keep the compact ``outbox_published`` record."""
    return {"ids": id_array(ids), "at": datetime.fromtimestamp(at, UTC), "log": log}


class Marker(threading.Thread):
    """Deletes delivered rows (keeping their ``outbox_published`` record) on a connection of
    its own, so the relay's loop does not wait for Postgres while a backlog drains. Rows
    submitted and not yet deleted are in :attr:`marking` (the loop must not fetch them
    again); :meth:`drain` waits for the queue; an error (Postgres gone) is kept and
    re-raised by :meth:`check`."""

    def __init__(self, url: str, *, log_published: bool = True) -> None:
        super().__init__(name="relay-marker", daemon=True)
        self._conn = connect(url, autocommit=True)
        self._conn.execute(Q["relay_session_async_commit"])
        self._conn.execute(Q["relay_session_index_plans"])  # as the relay's session
        self._query = Q["outbox_delete_published" if log_published
                        else "outbox_delete_published_nolog"]
        self._log = log_published
        self._queue: queue.Queue[tuple[list[int], float] | None] = queue.Queue()
        self.marking: set[int] = set()
        self.error: Exception | None = None
        self.transactions = 0  # statements run (one autocommit transaction each)

    def submit(self, ids: list[int], at: float) -> None:
        """Queue the delete of ``ids`` (acknowledged at ``at``, epoch seconds); raises the
        marker's earlier error, if any."""
        self.check()
        self.marking.update(ids)
        self._queue.put((ids, at))

    def check(self) -> None:
        """Re-raise the error that stopped the marker (its rows were not marked)."""
        if self.error is not None:
            raise self.error

    def run(self) -> None:
        while (item := self._queue.get()) is not None:
            ids, at = item
            try:
                if self.error is None:
                    self.transactions += 1
                    self._conn.execute(self._query, delete_params(ids, at, self._log))
            except Exception as exc:  # re-raised in the relay's loop
                self.error = exc
            finally:
                self.marking.difference_update(ids)
                self._queue.task_done()
        self._queue.task_done()

    def drain(self) -> None:
        """Wait until every submitted mark ran (or failed: see :meth:`check`)."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued marks, stop the thread, close its connection."""
        self._queue.put(None)
        self.join(60)
        try:
            self._conn.close()
        except Exception as exc:  # a connection already broken
            log.debug("marker connection close: %s", exc)


class OutboxRelay:
    """Publishes the outbox until :meth:`stop` is called (thread-safe) or a signal arrives."""

    def __init__(self, settings: Settings, *, housekeeping_only: bool = False) -> None:
        self.settings = settings
        #: Only the sweeper and retention, never publish: the Debezium relay publishes.
        self.housekeeping_only = housekeeping_only
        self.stats = RelayStats()
        self._stop = threading.Event()
        # murmur2_random: the Java client's partitioner, so a key lands on the partition
        # Kafka Connect (the Debezium relay) would choose: one key, one partition, either relay.
        # linger.ms: relay_linger_ms (0: a caught-up row is sent at once; bench/README.md).
        self._producer = Producer(producer_config(settings, **{
            "client.id": "jobstream-relay", "partitioner": "murmur2_random",
            "linger.ms": settings.relay_linger_ms, **relay_topic_wait(settings)}))
        self._ctx: Any = None  # StageContext of the sweeper, made on first use
        # The pipeline (see pump): rows in flight by id, acknowledged (to mark), failed.
        self._pending: dict[int, tuple[Any, ...]] = {}
        self._acked: list[tuple[Any, ...]] = []
        self._acked_at = 0.0  # wall time (epoch s) of the latest acknowledgement seen
        self._failed: list[tuple[tuple[Any, ...], KafkaError]] = []
        self._refused: list[tuple[tuple[Any, ...], str]] = []
        self._marker: Marker | None = None  # in run(): marks on a connection of its own
        self._hwm = 0  # the highest id fetched
        self._draining = False  # the last fetch was a full batch: continue after _hwm
        self._floor = 0  # rows below it were published (or parked) when it was recorded
        self._floors: deque[tuple[float, int]] = deque()  # (monotonic time, floor) per rescan
        self._last_rescan = self._last_full = time.monotonic()
        self._touched = time.monotonic()  # the last statement on the lock session
        #: Topics the broker's metadata said do not exist -> when that was first seen
        #: (monotonic s); see _missing_past_grace.
        self._missing_topics: dict[str, float] = {}
        #: Topic -> (its max.message.bytes or None when unknown, monotonic s it was asked);
        #: see _narrow.
        self._topic_limits: dict[str, tuple[int | None, float]] = {}
        self._admin: Any = None  # AdminClient, made on first use (_topic_limit)
        #: Topics whose limit was never learnt, warned of once (see _narrow).
        self._limit_unknown: set[str] = set()
        #: Rows of a missing topic (within the grace) held aside in id order, so its retries
        #: do not hold up the other topics (breaker6, test_break_relay_missing_liveness.py),
        #: and topic -> (monotonic s its rows are due again, its backoff in s); see _hold.
        self._held: dict[str, list[tuple[Any, ...]]] = {}
        self._held_due: dict[str, tuple[float, float]] = {}
        #: The producer of narrow topics' rows (batch.size below their limits, see
        #: _produce_narrow), made on first use; its batch.size (bytes).
        self._narrow_producer: Producer | None = None
        self._narrow_batch = 0
        #: Topic -> whether its last rows went to the narrow producer (True) or to the main
        #: one: when that changes, the other producer is flushed first (per-key order).
        self._on_narrow: dict[str, bool] = {}
        #: The next draining fetch, sent ahead in pipeline mode (_read_ahead): the id it
        #: reads after, its cursor and the pipeline's context manager.
        self._ahead: tuple[int, Any, Any] | None = None
        #: Ids in (_gap_base, _hwm] that no fetch returned (a rolled-back insert, or a
        #: transaction still open when the relay read past its id: a late commit) -> when
        #: first seen missing (monotonic s); every other id in that range was fetched. See
        #: _track_gaps and the comment above pump.
        self._gaps: dict[int, float] = {}
        self._gap_base = 0
        #: Gaps forgotten by the looks (a look relay_late_commit_s after they were first seen
        #: did not find them: rolled back, or a transaction open longer than that), still in
        #: (_gap_base, _hwm]: the full rescan probes them instead of reading the range
        #: (issue 12, perf-relay7). Cleared with _gaps.
        self._old_gaps: set[int] = set()
        #: The outbox id sequence's relfilenode at the last full rescan (None: not yet seen):
        #: ALTER SEQUENCE ... RESTART gives it a new one (see _sequence_restarted).
        self._seq_filenode: int | None = None

    def stop(self, *_: Any) -> None:
        """Ask the relay loop to finish its current batch and return."""
        self._stop.set()

    def publish_batch(self, conn: Conn) -> int:
        """Publish one batch of unpublished rows and wait for all of it; returns how many rows
        it settled (delivered and marked, or parked). The synchronous form of :meth:`pump`
        (one fetch, then :meth:`settle` with ``wait=True``), for tools and tests.

        Rows the broker acknowledged are marked published. A row that can never be delivered
        (too large for the producer or the topic, refused by the topic, unserialisable) is
        parked (:meth:`park`) and the batch goes on. Raises :class:`DeliveryFailed` after
        marking and parking when some rows failed with a retriable error: they stay
        unpublished and the caller backs off before the next try.
        """
        before = self.stats.published + self.stats.parked
        self._draining = False  # a look from the floor: this call stands alone
        self.pump(conn)
        self.settle(conn, wait=True)
        return self.stats.published + self.stats.parked - before

    # ---------------------------------------------------------------- the pipelined loop
    #
    # Rows are produced as soon as they are fetched and marked once their delivery reports
    # arrive, in the reports' order; the next batch is fetched while earlier ones are still on
    # their way to the broker (at most relay_max_in_flight rows). Per-key order: rows are
    # produced in id order and the idempotent producer keeps a partition's order across
    # retries. Rows in flight must not be fetched again, and a transaction that committed late
    # with a lower id must still be found, so a fetch reads from a *floor*, not from a
    # high-water mark alone:
    # * draining a backlog (the previous fetch was full), a fetch continues after the highest
    #   id fetched (``_hwm``): an index range scan that neither re-reads rows in flight nor walks
    #   past the index entries of rows marked since the last vacuum;
    # * otherwise (caught up, or every relay_rescan_s while draining) it re-reads from the
    #   floor and skips, in Python, the rows in flight. The floor is the lowest id that was
    #   unpublished (or not yet visible) relay_late_commit_s ago: a transaction that had its
    #   id then has committed or rolled back by now. A transaction open longer than that is
    #   still found: every relay_full_rescan_s the relay reads from id 0.
    # * The range from the floor walks the index entries (and visits the heap tuples) of every
    #   row deleted since the last vacuum: 185-495 shared blocks per caught-up fetch in
    #   perf-pg5's runs. Yet below its last id the relay only needs the ids it read past
    #   without getting a row (``_gaps``: rolled back, or still open). So while every such
    #   id above ``_gap_base`` is known, the floor is at or above ``_gap_base`` and there are
    #   at most MAX_GAP_PROBES of them, the look below the last id probes those ids only (an
    #   index lookup each) instead of the range. A gap is probed until a look at least
    #   relay_late_commit_s after it was first seen (the same bound as the floor's), then
    #   forgotten: a longer transaction waits for the full rescan, as before. Rows given
    #   back (a failed delivery, a new session) restart the tracking above the last id, and
    #   the range is read until the floor passes it.

    def pump(self, conn: Conn, *, fetch: bool = True) -> int:
        """One step of the pipelined relay: serve delivery reports, settle failures (raises
        :class:`DeliveryFailed` like :meth:`publish_batch`), fetch and produce the next
        batch when fewer than ``relay_max_in_flight`` rows are in flight, mark the rows
        acknowledged so far. ``fetch=False``: only serve reports and mark. Returns the number
        of rows fetched (``relay_batch_size``: more are probably waiting)."""
        poll = self._producer.poll
        poll(0)
        narrow = self._narrow_producer
        if narrow is not None:
            narrow.poll(0)
        if self._marker is not None:
            self._marker.check()
        if self._failed or self._refused:
            self.settle(conn, wait=True)  # raises DeliveryFailed for retriable failures
        if self._held and self._release_held():
            return 0  # its failures are settled (held again) before a fetch could re-read them
        if not fetch:
            # Caught up: the acknowledged rows are deleted by the next fetch's statement
            # (one transaction per wake-up), unless a batch of them is waiting.
            if self._draining or len(self._acked) >= self.settings.relay_batch_size:
                self.mark(conn)
            return 0
        if len(self._pending) >= self.settings.relay_max_in_flight:
            self.mark(conn)
            # The window is full: wait for reports (from the producer with rows in flight).
            if narrow is not None and len(narrow) and not len(self._producer):
                narrow.poll(0.05)
            else:
                poll(0.05)
            return self.settings.relay_batch_size
        rows = self._fetch(conn)
        if rows:
            self._produce(rows)
            poll(0)
        return len(rows)

    def _fetch(self, conn: Conn) -> list[tuple[Any, ...]]:
        """The next rows to produce, in id order (see the comment above :meth:`pump`). Read in
        binary: the payload (bytea) comes as its bytes instead of hex text that Postgres
        encodes and the client decodes (~1 us less per row on each side, bench/README.md)."""
        n, st = self.settings.relay_batch_size, self.settings
        now = time.monotonic()
        if self._draining and now - self._last_rescan < st.relay_rescan_s:
            self.mark(conn)  # on the marker thread: rows after _hwm only are read here
            rows = self._take_ahead(self._hwm, rearm=False)
            rearm = rows is not None  # no statement ran after the pipeline (_take_ahead)
            if rows is None:
                self.stats.transactions += 1
                with conn.cursor(row_factory=tuple_row, binary=True) as cur:
                    rows = cur.execute(Q["outbox_fetch_after"], (self._hwm, n)).fetchall()
            self._track_gaps(self._hwm, rows, now)
        else:
            self._take_ahead(None, rearm=False)  # the statement below follows
            rearm = False
            floors = self._floors
            if now - self._last_rescan >= st.relay_late_commit_s:
                # No look for that long (the relay was frozen or stalled): a transaction that
                # was open (invisible) at the last looks may have committed meanwhile, above
                # the lows they recorded. Count the window from now: keep the floor, drop the
                # later lows, see the gaps as new (breaker8,
                # tests/e2e/test_break_relay_frozen_range.py).
                floors.clear()
                for gap in self._gaps:
                    self._gaps[gap] = now
            while floors and now - floors[0][0] >= st.relay_late_commit_s:
                self._floor = floors.popleft()[1]
            floor = self._floor
            gaps = self._gaps
            probing = False
            old = self._old_gaps
            upto = self._hwm  # the range read: (floor, upto]
            full = now - self._last_full >= st.relay_full_rescan_s
            if full:  # a transaction open longer than the window
                self._last_full = now
                if (len(gaps) + len(old) <= MAX_FULL_RESCAN_PROBES
                        and not self._sequence_restarted(conn)):
                    # Every id in (_gap_base, _hwm] the relay has not fetched is a gap, young
                    # or old: read the range up to _gap_base only and probe the gaps, instead
                    # of walking the index entries (and heap tuples) of every row deleted
                    # since the last vacuum up to the last id (bench/README.md, seventh pass).
                    floor, upto = 0, self._gap_base
                else:
                    # Too many to probe (rolled-back ids stay gaps for good), or ids below
                    # the last one may be handed out again: the whole range, as before, and
                    # the tracking restarts above the last id.
                    floor = 0
                    gaps.clear()
                    old.clear()
                    self._gap_base = self._hwm
            elif floor >= self._gap_base and len(gaps) <= MAX_GAP_PROBES:
                # Every id below the last one the relay has not fetched is in _gaps: probe
                # those instead of reading the range (an empty range from the last id).
                probing, floor = True, self._hwm
            pending = self._pending
            # Copied before the query: a row whose mark commits meanwhile is in the copy (and
            # skipped) or already published in the query's snapshot.
            marking = set(self._marker.marking) if self._marker is not None else set()
            hwm = self._hwm
            # One statement: the rows acknowledged so far deleted, late rows between the floor
            # and the last id (those in flight, being deleted or deleted by this statement
            # skipped), then new rows after the last id. One round trip, one transaction.
            ids = self._take_acked()
            held = {r[0] for rows in self._held.values() for r in rows}
            lowest = min((min(u) for u in (pending.keys(), marking, ids, held) if u),
                         default=hwm + 1)
            probe: list[int] = []
            young_low = hwm + 1  # the lowest young gap probed (old ones do not hold the floor)
            skip: Iterable[int] = ()
            if full and upto < hwm:
                # The range below _gap_base may hold rows in flight (given back, then the
                # tracking restarted above them): skipped as in any range read.
                skip = pending.keys() | marking | set(ids) | held
                probe = sorted(g for g in gaps.keys() | old if g not in pending
                               and g not in marking and g not in held)
                young_low = min(gaps, default=young_low)
            elif probing:
                # A gap was never fetched, so it is not in flight; checked all the same (a
                # row re-sent while in flight is a duplicate). No range to skip rows in:
                # the up to relay_max_in_flight ids in flight are not sent (the array's
                # parse alone was ~1 ms of planning per look).
                probe = [g for g in sorted(gaps) if g not in pending and g not in marking
                         and g not in held]
            else:
                skip = pending.keys() | marking | set(ids) | held
            self.stats.transactions += 1
            with conn.cursor(row_factory=tuple_row, binary=True) as cur:
                rows = cur.execute(Q["outbox_delete_and_fetch"],
                                   {"floor": floor, "upto": upto, "hwm": hwm,
                                    "skip": id_array(skip),
                                    "n": n, "gaps": id_array(probe),
                                    **delete_params(ids, self._acked_at,
                                                    st.relay_published_log)}).fetchall()[:n]
            # Below ``low`` every row was published, or not yet visible: committed by a
            # transaction that was still open now (it has its id already).
            late = rows[0][0] if rows and rows[0][0] <= hwm else hwm + 1
            if probing and probe:
                young_low = probe[0]
            low = min(late, lowest, young_low) - 1
            floors.append((now, low))
            self._last_rescan = now
            self._track_gaps(hwm, rows, now)
            if gaps:  # looked for now (probed or in the range): forget those due
                due = now - st.relay_late_commit_s
                for gap in [g for g, seen in gaps.items() if seen <= due]:
                    del gaps[gap]
                    old.add(gap)  # probed by the full rescan from now on
        self._draining = len(rows) >= n
        if rows:
            self._hwm = max(self._hwm, max(r[0] for r in rows))
        if (self._draining and self._marker is not None
                and now - self._last_rescan < st.relay_rescan_s):
            self._read_ahead(conn)
        elif rearm:
            self._rearm(conn)
        return rows

    def _track_gaps(self, after: int, rows: list[tuple[Any, ...]], now: float) -> None:
        """Keep ``_gaps`` (see the comment above :meth:`pump`) after a fetch of ``rows`` (in
        id order: those at or below ``after``, the last id before the fetch, first) that read
        every id in (``after``, its last row's id]: the rows at or below ``after`` were gaps
        (late commits) and are forgotten; the ids above ``after`` it read past without a row
        are new gaps, first seen ``now`` (monotonic s)."""
        if not rows or (rows[0][0] > after and rows[-1][0] - after == len(rows)):
            return  # nothing read past (the usual case: consecutive ids)
        gaps, prev = self._gaps, after
        for row in rows:
            i = row[0]
            if i <= after:
                gaps.pop(i, None)
                self._old_gaps.discard(i)
                continue
            if i > prev + 1:
                if len(gaps) + i - prev - 1 > MAX_GAPS or (
                        after == 0 and i - prev - 1 > MAX_GAP_PROBES):
                    # Too many to track: restart above the last id read (the range from the
                    # floor is read until the floor passes it). So too on a session's first
                    # look (nothing fetched yet) when more ids lie below its first row than
                    # the looks would probe: they are the rows earlier sessions published and
                    # deleted (and any transaction still open), which the looks read as a range
                    # anyway, so tracking each one only cost the looks of the next
                    # relay_late_commit_s a pass over up to MAX_GAPS of them in Python (the
                    # latency runs' profile, bench/README.md, eighth pass).
                    gaps.clear()
                    self._old_gaps.clear()
                    self._gap_base = rows[-1][0]
                    return
                for gap in range(prev + 1, i):
                    gaps[gap] = now
            prev = i

    def _sequence_filenode(self, conn: Conn) -> tuple[int, int | None]:
        """The outbox id sequence's last value (0 before its first ``nextval``) and
        relfilenode (None if not found); one statement on ``conn``."""
        self.stats.transactions += 1
        row = conn.execute(Q["outbox_id_sequence_state"]).fetchone()
        if row is None:
            return 0, None
        return int(row["last_value"] or 0), row["filenode"]

    def _sequence_restarted(self, conn: Conn) -> bool:
        """Whether the outbox id sequence may hand out ids at or below the last id fetched
        again (the full rescan then reads the whole range: such rows are neither gaps nor
        after the last id; breaker8, tests/e2e/test_break_relay_gap_bounds.py): its last
        value is below that id (``setval`` lower, or RESTART and not yet past it), or it got
        a new relfilenode since the session started or the last full rescan (ALTER SEQUENCE
        ... RESTART, TRUNCATE ... RESTART IDENTITY), or that was not known. Not seen: a
        ``setval`` lower whose ids pass the last id again before the next full rescan."""
        last, filenode = self._sequence_filenode(conn)
        seen, self._seq_filenode = self._seq_filenode, filenode
        return seen is None or seen != filenode or last < self._hwm

    def _read_ahead(self, conn: Conn) -> None:
        """Send the next draining fetch (the rows after ``_hwm``) without waiting for it
        (psycopg pipeline mode): Postgres reads them while this batch is produced, and the
        next :meth:`_fetch` takes the result (:meth:`_take_ahead`). Until then ``conn`` runs
        nothing else: every other use of it takes (or drops) the read-ahead first.

        The query is followed by a Sync at once (without waiting for its result): a query sent
        in pipeline mode with no Sync leaves the backend ``active`` (ClientRead) in an open
        implicit transaction, where neither idle timeout of the lock session applies, so a
        relay frozen before it took the read-ahead kept the relay lock (and its snapshot) for
        as long as it was frozen and no standby took over
        (tests/e2e/test_break_relay_readahead_frozen.py). After the Sync the session is idle
        once the rows are sent: ``relay_lock_timeout_s`` ends it."""
        pipeline = conn.pipeline()
        pl = pipeline.__enter__()
        try:
            cur = conn.cursor(row_factory=tuple_row, binary=True)
            cur.execute(Q["outbox_fetch_after"], (self._hwm, self.settings.relay_batch_size))
            # Pipeline.sync() would also wait for the rows; queue and send the Sync alone
            # (psycopg's own steps of sync(), without its fetch).
            pl._enqueue_sync()
            conn.wait(pl._communicate_gen())
        except BaseException:
            pipeline.__exit__(None, None, None)
            raise
        self.stats.transactions += 1
        self._ahead = (self._hwm, cur, pipeline)

    def _take_ahead(self, after: int | None, *, rearm: bool = True
                    ) -> list[tuple[Any, ...]] | None:
        """Wait for the read-ahead (if one was sent) and leave pipeline mode; its rows when
        it read after id ``after`` (the fetch the caller would run), else None (dropped: the
        caller reads again). ``rearm``: then run one statement (:meth:`_rearm`); False when
        the caller runs one next."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        at, cur, pipeline = ahead
        try:
            rows: list[tuple[Any, ...]] = cur.fetchall()
        finally:
            cur.close()
            pipeline.__exit__(None, None, None)
        if rearm:
            self._rearm(cur.connection)
        return rows if at == after else None

    def _rearm(self, conn: Conn) -> None:
        """One statement on the lock session after a pipeline: psycopg ends a pipeline with a
        Flush request after its Sync, and a Flush disarms Postgres' ``idle_session_timeout``
        (armed again only when the next statement finishes), so a relay frozen after taking
        its read-ahead (e.g. in the caught-up wait after a drain, or the backoff after a
        failed delivery) kept the relay lock for as long as it was frozen."""
        conn.execute(Q["relay_touch"])
        self._touched = time.monotonic()

    def _forget_floor(self) -> None:
        """Read from id 0 next time (a row was given back as undelivered: it may lie below
        the floor); the ids the relay has not fetched are known again only above the last
        id (``_gaps``)."""
        self._floor, self._draining = 0, False
        self._floors.clear()
        self._gaps.clear()
        self._old_gaps.clear()
        self._gap_base = self._hwm

    def _produce(self, rows: list[tuple[Any, ...]]) -> None:
        """Hand ``rows`` to the producer; each one's delivery report lands in ``_on_delivery``.
        A row the client refuses at once (over ``message.max.bytes``, unserialisable) goes to
        ``_refused`` with the reason."""
        produce, pending = self._producer.produce, self._pending
        on_delivery = self._on_delivery
        missing, now = self._missing_topics, time.monotonic()
        grace = self.settings.relay_missing_topic_park_s
        narrow: list[tuple[Any, ...]] = []
        held = self._held
        limits: dict[str, int] = {}  # topic -> _route(topic), once per batch
        for row in rows:
            _id, topic, key, payload, headers, _type = row
            if held and topic in held:  # behind its topic's held rows (_hold)
                held[topic].append(row)
                continue
            if missing and now - missing.get(topic, now + 1) >= grace:
                # Its topic is gone past the grace: not queued in the client (where it would
                # wait message.timeout.ms and hold every flush up); settle() re-checks the
                # topic and parks it, or sends it again if the topic is back.
                self._failed.append((row, KafkaError(KafkaError._UNKNOWN_TOPIC)))
                continue
            limit = limits.get(topic)
            if limit is None:
                limit = limits[topic] = self._route(topic)
            if limit:
                narrow.append(row)
                continue
            try:  # a dict of str headers is UTF-8 encoded by the client, in C
                produce(topic, value=payload, key=key, headers=headers,
                        on_delivery=partial(on_delivery, row))
                pending[_id] = row
            except (BufferError, TypeError, KafkaException, ValueError):
                self._produce_row(self._producer, row)  # retried or refused there
        if narrow:
            self._produce_narrow(narrow, limits)

    def _produce_row(self, producer: Producer, row: tuple[Any, ...]) -> None:
        """Hand one row to ``producer`` (delivery report to ``_on_delivery``): waits while the
        client's queue is full, stringifies header values that are not strings, and puts a
        row the client refuses at once in ``_refused`` (or in ``_failed`` when the client
        knows its topic is missing)."""
        _id, topic, key, payload, headers, _type = row
        while True:
            try:  # a dict of str headers is UTF-8 encoded by the client, in C
                producer.produce(topic, value=payload, key=key, headers=headers,
                                 on_delivery=partial(self._on_delivery, row))
                self._pending[_id] = row
                return
            except BufferError:
                producer.poll(0.1)  # local queue full: serve callbacks, then retry
            except TypeError as exc:  # a header value that is not a string (JSON number)
                if isinstance(headers, dict) and not all(
                        isinstance(v, str) for v in headers.values()):
                    headers = {k: str(v) for k, v in headers.items()}
                    continue
                self._refused.append(
                    (row, f"cannot serialise the row: {type(exc).__name__}: {exc}"))
                return
            except (KafkaException, ValueError) as exc:  # e.g. MSG_SIZE_TOO_LARGE
                err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
                if isinstance(err, KafkaError) and err.code() in MISSING_TOPIC_ERRORS:
                    # The client knows the topic is missing: retriable until the grace
                    # (settle(): _missing_past_grace), as a delivery report saying so.
                    self._failed.append((row, err))
                else:
                    self._refused.append((row, _describe_exc(exc)))
                return

    def _route(self, topic: str) -> int:
        """Where ``topic``'s rows go: 0 for the main producer (batched); its
        ``max.message.bytes`` (> 0) for a narrow topic whose limit is known (the narrow
        producer, :meth:`_produce_narrow`); -1 for a topic whose limit is not known (a topic
        that went missing, or whose limit the broker did not tell: one row at a time on the
        main producer, each after the one before was acknowledged). When a
        topic moves between the two producers, the one it leaves is flushed first, so its
        earlier rows are acknowledged (or failed) before later ones are sent.

        A narrow topic's known limit is asked again for every batch (one describe_configs per
        fetch, ~ms): its rows are batched under that limit, and a limit lowered since
        (``kafka-configs --alter``) would have the broker refuse a batch for one row while
        later batches go through, the batch-mates re-sent alone after them (breaker6,
        tests/e2e/test_break_relay_narrow_lowered.py; rows alone never broke the order). What
        is left: an alter between that ask and the send."""
        got = self._topic_limits.get(topic)
        if (got is not None and got[0] is not None
                and got[0] < self.settings.kafka_message_max_bytes):
            self._topic_limits[topic] = (got[0], float("-inf"))  # _narrow asks again
        limit = 0
        if self._narrow(topic):
            got = self._topic_limits.get(topic)
            limit = got[0] if got is not None and got[0] is not None else -1
            if topic in self._missing_topics:
                limit = -1
        on_narrow = limit > 0
        was = self._on_narrow.get(topic)
        if was is not None and was != on_narrow:
            left = self._narrow_producer if was else self._producer
            if left is not None:
                left.flush(60)
        self._on_narrow[topic] = on_narrow
        return limit

    def _narrow(self, topic: str) -> bool:
        """True when ``topic`` takes smaller record batches (its ``max.message.bytes``) than
        this producer builds (``message.max.bytes`` = ``kafka_message_max_bytes``): the broker
        would refuse a whole batch for one large row, its batch-mates with it, while later
        batches of the partition go through, so the batch-mates re-sent alone would land
        after them (per-key order broken). Such a topic's rows go to a producer whose record
        batches stay under the limit, and a row too large to be batched goes alone
        (:meth:`_produce_narrow`). Its limit is asked again after 5 s while unknown, and
        after ``relay_topic_limit_refresh_s`` when known (an operator may lower it meanwhile:
        breaker4, tests/e2e/test_break_relay_limit_lowered.py), and at once after the broker
        refused a message as too large (:meth:`_on_delivery`). A topic the broker said was
        missing counts as narrow until a row of it is acknowledged, and so does a topic whose
        limit was never learnt (the AdminClient missed its 2 s: load, a cold client after a
        restart, or DescribeConfigs not allowed): its rows go one at a time (:meth:`_route`
        -1) until the limit is known. Counted as wide, its rows were batched and a batch the
        broker refused for one large row landed after later ones (flakes10,
        tests/integration/test_relay_limit_unknown.py). A narrow topic whose limit could not
        be asked again is unknown too, not its old limit (it may have been lowered since:
        robust11, same file); a wide topic keeps its old limit until the next ask."""
        if topic in self._missing_topics:
            # Gone, or back and not yet delivered to: it may come back as a new topic with
            # another limit (breaker5, tests/e2e/test_break_narrow_missing.py), so its old
            # limit was dropped (_missing_past_grace) and nothing is batched until a row
            # is acknowledged (_forget_missing).
            return True
        got = self._topic_limits.get(topic)
        now = time.monotonic()
        # Unknown (the broker did not answer within 2 s: load, outage): asked again after
        # 5 s, not 60, since meanwhile its rows go one at a time (perf-relay5 saw a cold
        # AdminClient miss the 2 s under load, test_break_missing_topic[narrow]).
        every = 5 if got is None or got[0] is None else self.settings.relay_topic_limit_refresh_s
        if got is None or now - got[1] > every:
            old = got[0] if got is not None else None
            limit = self._topic_limit(topic)
            wide = self.settings.kafka_message_max_bytes
            if limit is None and old is not None and old >= wide:
                limit = old  # not told this time: a wide topic keeps what we knew
            # A narrow topic not told is unknown, not its old limit: asked for every batch
            # because an alter may have lowered it, and batched under a stale limit the broker
            # refuses a batch for one row while later ones go through (robust11,
            # tests/integration/test_relay_limit_unknown.py, the AdminClient unreachable).
            got = self._topic_limits[topic] = (limit, now)
            if limit is None and topic not in self._limit_unknown:
                self._limit_unknown.add(topic)
                log.warning(
                    "max.message.bytes of topic %s not known (the broker did not answer the "
                    "AdminClient within 2 s%s): its rows go one at a time, each after the one "
                    "before was acknowledged, until it is known (asked again every 5 s)", topic,
                    f"; it was {old}, maybe lowered since" if old is not None else "")
            elif limit is not None:
                self._limit_unknown.discard(topic)
            if (limit != old and limit is not None
                    and limit < self.settings.kafka_message_max_bytes):
                log.warning(
                    "topic %s takes messages up to %d bytes (max.message.bytes), less than "
                    "this relay produces (JOBSTREAM_KAFKA_MESSAGE_MAX_BYTES=%d): its rows "
                    "go in record batches of at most %d bytes, and a row larger than that "
                    "alone, after the rows before it were acknowledged, to keep per-key "
                    "order when the broker refuses a large row (slower). Create the topic "
                    "with `jobstream topics` or raise its max.message.bytes, or lower the "
                    "setting to the topic's limit", topic, got[0],
                    self.settings.kafka_message_max_bytes, narrow_batch_bytes(limit))
        return got[0] is None or got[0] < self.settings.kafka_message_max_bytes

    def _warm_up(self) -> None:
        """Before the lock (a standby too, so a takeover publishes at once): import what the
        sweeper, retention and parking use, and connect the AdminClient that asks a topic's
        ``max.message.bytes``. The imports took ~0.25 s inside the first drain (bench.relay
        --profile, issue 12's fifth pass), and the first describe_configs of a cold
        AdminClient includes its connection to the broker, which under load can take longer
        than :meth:`_topic_limit` waits (its rows then go one at a time until asked again)."""
        for module in ("jobstream.deadletter", "jobstream.retention", "streams.actions",
                       "streams.context"):
            importlib.import_module(module)
        if self.housekeeping_only:
            return
        from confluent_kafka.admin import AdminClient
        try:
            if self._admin is None:
                self._admin = AdminClient(base_config(self.settings))
            self._admin.list_topics(timeout=5)
        except KafkaException as exc:  # the broker is not there yet: asked again on use
            log.debug("relay warm-up: broker metadata not fetched: %s", exc)

    def _topic_limit(self, topic: str) -> int | None:
        """``topic``'s ``max.message.bytes`` (bytes), or None when the broker did not say
        within 2 s (missing topic, outage)."""
        from confluent_kafka.admin import AdminClient, ConfigResource
        try:
            if self._admin is None:
                self._admin = AdminClient(base_config(self.settings))
            (fut,) = self._admin.describe_configs(
                [ConfigResource(ConfigResource.Type.TOPIC, topic)], request_timeout=2).values()
            return int(fut.result(timeout=2)["max.message.bytes"].value)
        except Exception as exc:  # noqa: BLE001 - unknown: one row at a time, asked again later
            log.debug("max.message.bytes of %s unknown: %s", topic, exc)
            return None

    def _narrow_for(self, limit: int) -> Producer:
        """The narrow producer, its ``batch.size`` at most :func:`narrow_batch_bytes` of
        ``limit`` (bytes): made on first use; a topic narrower than the ones before replaces
        it by one with smaller batches, after the old one's rows were acknowledged."""
        want = narrow_batch_bytes(limit)
        producer = self._narrow_producer
        if producer is not None and self._narrow_batch <= want:
            return producer
        if producer is not None and producer.flush(60):
            # Still undelivered after a minute: purged, their reports (failures) served now,
            # so the rows are re-sent after the backoff rather than left in _pending.
            producer.purge()
            producer.flush(5)
        self._narrow_producer = producer = Producer(producer_config(self.settings, **{
            "client.id": "jobstream-relay-narrow", "partitioner": "murmur2_random",
            "linger.ms": self.settings.relay_linger_ms, "batch.size": want,
            **relay_topic_wait(self.settings)}))
        self._narrow_batch = want
        return producer

    def _produce_narrow(self, rows: list[tuple[Any, ...]], limits: dict[str, int]) -> None:
        """Produce rows of narrow topics (``limits``: topic -> :meth:`_route`). A row of a
        topic whose limit is known and whose :func:`record_bytes` fit the narrow producer's
        ``batch.size`` is batched by it: every record batch stays within the topic's
        ``max.message.bytes``, so the broker never refuses a batch for one large row. A larger
        row, or any row of a topic whose limit is not known, goes alone
        (:meth:`_produce_alone`) once the rows before it were acknowledged."""
        stalled: set[str] = set()
        for row in rows:
            topic = row[1]
            if topic in stalled:
                self._failed.append((row, KafkaError(
                    KafkaError._STATE, "behind an undelivered row of its topic")))
                continue
            limit = limits[topic]
            if limit > 0:
                producer = self._narrow_for(limit)
                if record_bytes(row) <= self._narrow_batch:
                    self._produce_row(producer, row)
                    continue
                # Too large to batch: the rows before it first (a refusal then touches only
                # this row), unless one of them failed (sent after it, the order breaks).
                producer.flush(60)
                if any(r[1] == topic for r, _ in self._failed):
                    stalled.add(topic)
                    self._failed.append((row, KafkaError(
                        KafkaError._STATE, "behind an undelivered row of its topic")))
                    continue
            if not self._produce_alone(row, self._narrow_producer if limit > 0 else None):
                stalled.add(topic)

    def _produce_alone(self, row: tuple[Any, ...], producer: Producer | None = None) -> bool:
        """Produce ``row`` alone on ``producer`` (the main one by default) and wait for its
        delivery report: acknowledged, or refused by the topic (``_refused``, parked alone),
        or failed otherwise (``_failed``, re-sent in id order after the backoff: returns
        False, the topic's later rows must not be sent before it)."""
        reports, refusal = self._send([row], producer)
        report = reports.get(0, _MISSING)
        if 0 in refusal:
            self._refused.append((row, refusal[0]))
        elif report is None:
            self._acked.append(row)
            self._acked_at = time.time()
            self._forget_missing(row[1])
        elif isinstance(report, KafkaError) and _permanent(report):
            self._refused.append((row, _describe_err(report)))
        else:
            self._failed.append((row, report if isinstance(report, KafkaError)
                                 else KafkaError(KafkaError._MSG_TIMED_OUT)))
            return False
        return True

    def _on_delivery(self, row: tuple[Any, ...], err: KafkaError | None, _msg: Any) -> None:
        """Delivery report of ``row`` (called from ``poll``/``flush`` in this thread)."""
        if self._pending.pop(row[0], None) is None:
            return  # given up on earlier (no report in time); it will be fetched again
        if err is None:
            self._acked.append(row)
            self._acked_at = time.time()
            if self._missing_topics:
                self._forget_missing(row[1])
        else:
            if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                self._topic_limits.pop(row[1], None)  # lowered? ask again (_narrow)
            self._failed.append((row, err))

    def _flush(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` seconds each) for the delivery reports of every row
        handed to either producer."""
        self._producer.flush(timeout_s)
        if self._narrow_producer is not None:
            self._narrow_producer.flush(timeout_s)

    def _forget_missing(self, topic: str) -> None:
        """``topic`` took a row: it exists (again). Its limit was dropped when it went
        missing, so the next :meth:`_narrow` asks the broker."""
        self._missing_topics.pop(topic, None)
        self._held_due.pop(topic, None)

    def _hold(self, retriable: list[tuple[tuple[Any, ...], KafkaError | None]]
              ) -> list[tuple[tuple[Any, ...], KafkaError | None]]:
        """Of the rows that failed retriably (within the missing-topic grace): hold aside those
        of a topic the broker says is missing, in id order with that topic's later rows
        (:meth:`_produce`), due again after the topic's own backoff (0.5 s doubling to
        ``relay_backoff_cap_s``); return the others (they fail the round: DeliveryFailed and
        the relay's backoff). Held rows are skipped by the fetch, which keeps its floor below
        them, and forgotten with the pipeline (fetched again). Before, the round failed for
        every topic: the relay slept up to relay_backoff_cap_s per round with healthy topics'
        rows waiting, for as long as the grace."""
        missing = self._missing_topics
        if not missing:
            return retriable
        keep: list[tuple[tuple[Any, ...], KafkaError | None]] = []
        now, cap = time.monotonic(), self.settings.relay_backoff_cap_s
        for row, err in retriable:
            topic = row[1]
            if topic not in missing:
                self._held_due.pop(topic, None)  # found again: its backoff starts afresh
                keep.append((row, err))
                continue
            if topic not in self._held:
                _due, wait = self._held_due.get(topic, (0.0, 0.25))
                wait = min(wait * 2, cap)
                self._held_due[topic] = (now + wait, wait)
                log.warning("rows of topic %s held back while it is missing (the other "
                            "topics go on): re-sending the undelivered rows in %.1fs: %s",
                            topic, wait, _describe_err(err))
            self._held.setdefault(topic, []).append(row)
        for topic, rows in self._held.items():  # in id order, each row once
            self._held[topic] = sorted({r[0]: r for r in rows}.values(), key=lambda r: r[0])
        return keep

    def _release_held(self) -> bool:
        """Produce again, in id order, the held rows of every topic whose backoff ran out
        (:meth:`_hold`): delivered if the topic is back, held again (longer) if not, parked
        past the grace. True when some were produced: the caller settles their failures
        before it fetches (a failed row is not in flight, the fetch would read it again)."""
        now = time.monotonic()
        due = [t for t in self._held if self._held_due.get(t, (0.0, 0.0))[0] <= now]
        for topic in due:
            self._produce(self._held.pop(topic))
        return bool(due)

    def _take_acked(self) -> list[int]:
        """The ids of the rows acknowledged so far, to be deleted by the caller's statement
        (fault points ``relay_after_produce_before_mark[:<event type>]`` fire first); counts
        them published."""
        acked = self._acked
        if not acked:
            return []
        if faults.armed():  # the set of a batch's event types only for a crash test
            faults.point("relay_after_produce_before_mark")
            for event_type in sorted({r[5] for r in acked}):
                faults.point(f"relay_after_produce_before_mark:{event_type}")
        self._acked = []
        self.stats.published += len(acked)
        self.stats.batches += 1
        return list(map(_ID, acked))

    def mark(self, conn: Conn) -> int:
        """Delete the rows acknowledged so far (one statement; their compact
        ``outbox_published`` records kept unless ``relay_published_log`` is off); returns
        how many. In :meth:`run` the statement goes to the marker thread (its own
        connection), so the next batch is fetched and produced while Postgres deletes this
        one; otherwise it runs on ``conn``. (Caught up, the relay deletes them in its next
        fetch's statement instead: :meth:`_fetch`.) The relay's sessions commit without
        waiting for the WAL flush: a delete lost in a Postgres crash only re-publishes its
        rows (the at-least-once side, absorbed by the consumers)."""
        ids = self._take_acked()
        if not ids:
            return 0
        log_published = self.settings.relay_published_log
        if self._marker is None:
            self._take_ahead(None, rearm=False)
            self.stats.transactions += 1
            conn.execute(Q["outbox_delete_published" if log_published
                           else "outbox_delete_published_nolog"],
                         delete_params(ids, self._acked_at, log_published))
        else:
            self._marker.submit(ids, self._acked_at)
        return len(ids)

    def settle(self, conn: Conn, *, wait: bool) -> None:
        """Mark what was acknowledged and deal with what failed; with ``wait``, first wait
        (at most 60 s) for the report of every row in flight, and give up on the rest
        (retriable: fetched again). A row the broker refused is re-sent alone (its
        batch-mates may be the reason); one that fails alone, or that the client refused, is
        parked. Raises :class:`DeliveryFailed` when some rows failed with a retriable error
        (they stay unpublished; the caller backs off)."""
        self._take_ahead(None)  # conn runs the parks below
        if wait:
            self._flush(60)
        retriable: list[tuple[tuple[Any, ...], KafkaError | None]] = (
            [(row, None) for row in self._pending.values()] if wait else [])
        if wait:
            self._pending.clear()
        retriable += [(row, err) for row, err in self._failed if not _permanent(err)]
        lone = [row for row, err in self._failed if _permanent(err)]
        refused, self._refused, self._failed = self._refused, [], []
        retriable = self._hold(self._missing_past_grace(retriable, refused))
        for row in lone:  # isolate: one row alone in its produce request
            alone, refusal = self._send([row])
            if 0 in refusal:
                refused.append((row, refusal[0]))
            elif alone.get(0, _MISSING) is None:
                self._acked.append(row)
            elif 0 in alone and _permanent(alone[0]):
                refused.append((row, _describe_err(alone[0])))
            else:
                retriable.append((row, alone.get(0)))
        if retriable or refused:
            self.stats.failed += len(retriable) + len(refused)
            self._forget_floor()
        self.mark(conn)
        for row, why in refused:
            self.park(conn, row, why)
            self.stats.parked += 1
        if retriable:
            errs = [err for _, err in retriable[:3]]
            raise DeliveryFailed(f"{len(retriable)} rows not delivered (retriable), "
                                 f"{len(refused)} parked: {errs}")

    def _topics_missing(self, topics: set[str]) -> set[str]:
        """Those of ``topics`` the broker's metadata does not have (never created, or
        deleted): ONE metadata request for all, waiting at most 2 s; an empty set when the
        broker did not answer (an outage is not a missing topic)."""
        try:
            known = self._producer.list_topics(timeout=2).topics
        except KafkaException:
            return set()
        return {t for t in topics if t not in known}

    def _missing_past_grace(self, retriable: list[tuple[tuple[Any, ...], KafkaError | None]],
                            refused: list[tuple[tuple[Any, ...], str]]
                            ) -> list[tuple[tuple[Any, ...], KafkaError | None]]:
        """Of the rows that failed retriably: move to ``refused`` (to be parked) those whose
        topic the broker has said does not exist for ``relay_missing_topic_park_s`` or
        longer, and return the others. A row whose report says its topic is missing, or that
        got no report in time, has its topic looked up (one metadata request per call); a
        topic found again is forgotten. Before, the client's own ``_UNKNOWN_TOPIC`` refusal
        parked a row at once (a topic created 30 s late failed jobs), while a deleted topic's
        rows were re-sent round after round, each waiting out message.timeout.ms."""
        now, grace = time.monotonic(), self.settings.relay_missing_topic_park_s
        looked = {row[1] for row, err in retriable
                  if err is None or err.code() in MISSING_TOPIC_ERRORS}
        if not looked:
            return retriable
        missing = self._topics_missing(looked)
        for topic in looked:
            # A topic gone or found again may be a new topic with another max.message.bytes:
            # its cached limit no longer holds (_narrow asks again).
            self._topic_limits.pop(topic, None)
            if topic in missing:
                self._missing_topics.setdefault(topic, now)
            else:
                self._missing_topics.pop(topic, None)
        keep: list[tuple[tuple[Any, ...], KafkaError | None]] = []
        for row, err in retriable:
            topic = row[1]
            if topic in looked:
                since = self._missing_topics.get(topic)
                if since is not None and now - since >= grace:
                    refused.append((row, f"topic {topic} does not exist (the broker said so "
                                         f"for {now - since:.0f} s): {_describe_err(err)}"))
                    continue
            keep.append((row, err))
        return keep

    def _send(self, rows: list[tuple[Any, ...]], producer: Producer | None = None
              ) -> tuple[dict[int, KafkaError | None], dict[int, str]]:
        """Produce ``rows`` on ``producer`` (the main one by default) and wait for their
        delivery reports (at most 60 s), outside the pipeline (a refused row re-sent alone).
        Returns the reports by row index (``None``:
        acknowledged; absent: no report in time; a missing topic the client knows of at
        ``produce()`` is reported as its error) and the rows the client refused at once (too
        large for ``message.max.bytes``, unserialisable), with the reason."""
        reports: dict[int, KafkaError | None] = {}
        refused: dict[int, str] = {}
        producer = self._producer if producer is None else producer

        def report_to(i: int) -> Any:
            def on_delivery(err: KafkaError | None, _msg: Any) -> None:
                reports[i] = err
            return on_delivery

        for i, (_id, topic, key, payload, headers, _type) in enumerate(rows):
            if isinstance(headers, dict):
                headers = {k: v if isinstance(v, str) else str(v) for k, v in headers.items()}
            try:
                producer.produce(topic, value=payload, key=key, headers=headers,
                                 on_delivery=report_to(i))
            except (KafkaException, ValueError, TypeError, BufferError) as exc:
                err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
                if isinstance(err, KafkaError) and err.code() in MISSING_TOPIC_ERRORS:
                    # The client knows the topic is missing: a retriable report, as in
                    # _produce (the missing-topic grace decides), not a refusal.
                    reports[i] = err
                else:
                    refused[i] = _describe_exc(exc)
        producer.flush(60)
        return reports, refused

    def park(self, conn: Conn, row: tuple[Any, ...], why: str) -> None:
        """Move an outbox row that can never be delivered to the ``dead_letter`` table (ONE
        transaction): keep its bytes, headers and the broker's reason, delete the outbox row,
        and fail its job (``undeliverable_event``, with a ``job.failed`` event) when the row
        belongs to one that is still open."""
        from jobstream.deadletter import store_dead_letter
        outbox_id, topic, key, payload, headers, event_type = row
        headers = headers if isinstance(headers, dict) else {}
        job_id = _uuid(headers.get("job_id"))
        with conn.transaction():
            conn.execute(Q["relay_park_sync_commit"])  # the session's marks are asynchronous
            gone = conn.execute(Q["outbox_park"], (outbox_id,)).fetchone()
            if gone is None:
                return  # another relay settled it meanwhile
            dl_id = store_dead_letter(
                conn, source="relay", topic=topic, code="undeliverable",
                reason=f"{event_type} outbox row {outbox_id} cannot be delivered: {why}",
                key=None if key is None else str(key).encode(), value=payload,
                headers=[(str(k), str(v).encode()) for k, v in headers.items()],
                outbox_id=outbox_id, dlq_error=why, job_id=job_id)
            failed = self._fail_job(conn, job_id, f"its {event_type} event cannot be "
                                                  f"delivered to {topic}: {why}")
        log.error("parked outbox row %d (%s to %s) as dead_letter id=%d: %s%s", outbox_id,
                  event_type, topic, dl_id, why, f"; job {job_id} failed" if failed else "")

    def _fail_job(self, conn: Conn, job_id: uuid.UUID | None, error: str) -> bool:
        """Fail an open job (its open stages too) with ``undeliverable_event`` and write its
        ``job.failed`` to the outbox, in the caller's transaction. False when there is no
        such job or it is already terminal."""
        from jobstream.kafka import topic_for
        from jobstream.store import TERMINAL, Store, outbox_message
        from schemas.events import JobFailed, JobFailedPayload
        if job_id is None:
            return False
        job = conn.execute(Q["get_job_for_update"], (job_id,)).fetchone()
        if job is None:
            return False
        job = dict(job) if not isinstance(job, dict) else job
        if job["status"] in TERMINAL:
            return False
        code, error = "undeliverable_event", error[:4000]
        conn.execute(Q["fail_open_stages"], (code, error, job_id))
        conn.execute(Q["fail_job"], (code, error, job_id))
        ev = JobFailed(tenant_id=job["tenant_id"], idempotency_key=job["idempotency_key"],
                       request_id=job["request_id"], job_id=job_id, dedup_key=job["dedup_key"],
                       generation=job["generation"],
                       payload=JobFailedPayload(stage=job["current_stage"] or "intake",
                                                error_code=code, error=error))
        Store.add_outbox(conn, outbox_message(
            self.settings.topic(topic_for("job.failed", None)), ev))
        return True

    def _acquire_lock(self, conn: Conn) -> bool:
        standing_by = False
        while not self._stop.is_set():
            lock = HOUSEKEEPING_LOCK_ID if self.housekeeping_only else RELAY_LOCK_ID
            row = conn.execute(Q["relay_try_lock"], (lock,)).fetchone()
            self._touched = time.monotonic()
            health.ok()
            if row and row["locked"]:
                return True
            if not standing_by:  # once, not every try
                log.info("another relay is active; standing by (trying every 2 s)")
                standing_by = True
            self._stop.wait(2.0)
        return False

    def _stage_ctx(self) -> None:
        """Make the StageContext the sweeper and retention share (on first use)."""
        from jobstream.store import Store
        from streams.context import StageContext
        if self._ctx is None:
            self._ctx = StageContext(self.settings, Store.for_process(
                self.settings, "relay", self.settings.db_pool_relay_max))

    def _sweep(self) -> None:
        """Run the stuck-stage sweeper (the active relay is the one process that does)."""
        from jobstream.errors import RetryableError
        from streams.actions import sweep
        self._stage_ctx()
        try:
            for action in sweep(self._ctx):
                log.warning("sweeper: %s", action)
        except RetryableError as exc:
            log.warning("sweeper skipped: %s", exc)

    def _gc(self) -> None:
        """Run retention (bounded); a Postgres outage only postpones it."""
        from jobstream.errors import RetryableError
        from jobstream.retention import collect
        self._stage_ctx()
        try:
            report = collect(self.settings, self._ctx.store, max_batches=GC_MAX_BATCHES)
        except RetryableError as exc:
            log.warning("retention skipped: %s", exc)
            return
        if any(report.deleted.values()):
            log.info("retention: deleted %s", report.deleted)

    def _keep_lock(self, conn: Conn) -> None:
        """Run a statement on the lock session when a third of ``relay_lock_timeout_s`` went
        by without one: Postgres ends a session idle that long (a frozen relay's lock is
        released), never a live relay's. Raises ``psycopg.OperationalError`` when the
        session is gone (the lock with it)."""
        if time.monotonic() - self._touched >= self.settings.relay_lock_timeout_s / 3:
            self._take_ahead(None, rearm=False)
            conn.execute(Q["relay_touch"])
            self._touched = time.monotonic()

    def _wait(self, conn: Conn, seconds: float) -> None:
        """Wait ``seconds`` (or until stopped) keeping the lock session alive."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            self._stop.wait(min(left, self.settings.relay_lock_timeout_s / 3))
            self._keep_lock(conn)

    def _relay_loop(self, conn: Conn) -> None:
        """Publish (or only keep house) while the lock is held and no stop was asked."""
        retry_s = 0.5
        last_gc = last_sweep = 0.0
        batch = self.settings.relay_batch_size
        fetch = True
        while not self._stop.is_set():
            self._keep_lock(conn)
            try:
                published = self.stats.published
                n = 0 if self.housekeeping_only else self.pump(conn, fetch=fetch)
                health.ok()
                if self.stats.published > published:  # deliveries succeed (again)
                    retry_s = 0.5
            except DeliveryFailed as exc:
                log.warning("delivery failed; re-sending the undelivered rows in "
                            "%.1fs: %s", retry_s, exc)
                self._wait(conn, retry_s)
                retry_s = min(retry_s * 2, self.settings.relay_backoff_cap_s)
                continue
            except psycopg.OperationalError:
                raise  # reconnect in run()
            except Exception:  # a bug must not stop the outbox for everyone
                log.exception("relay batch failed; retrying in %.1fs", retry_s)
                self._give_up_in_flight()
                if self._marker is not None and self._marker.error is not None:
                    self._marker.close()  # its unmarked rows are fetched again
                    self.stats.transactions += self._marker.transactions
                    self._marker = self._new_marker()
                    self._marker.start()
                self._wait(conn, retry_s)
                retry_s = min(retry_s * 2, self.settings.relay_backoff_cap_s)
                continue
            if time.monotonic() - last_sweep > min(self.settings.sweep_grace_s,
                                                   self.settings.sweep_stall_grace_s) / 2:
                self._sweep()
                last_sweep = time.monotonic()
            if time.monotonic() - last_gc > self.settings.gc_interval_s:
                self._gc()
                last_gc = time.monotonic()
            if n < batch:
                # Caught up: sleep until a NOTIFY (a commit) or the polling interval; with
                # rows in flight only briefly, to serve their reports. Acknowledged rows
                # wait at most relay_delete_hold_s for the next commit's NOTIFY: its fetch
                # deletes them in the same statement (one transaction per wake-up).
                busy = bool(self._pending)
                st = self.settings
                timeout = (st.relay_in_flight_wait_s if busy else st.relay_delete_hold_s
                           if self._acked else min(st.relay_poll_interval_s,
                                                   st.relay_lock_timeout_s / 3))
                woke = False
                self._take_ahead(None)
                for _ in conn.notifies(timeout=timeout, stop_after=1):
                    woke = True
                # Woken only to serve reports: no fetch (a commit's NOTIFY, or the wait
                # with nothing in flight, fetches).
                fetch = woke or not busy
            else:
                fetch = True

    def _new_marker(self) -> Marker:
        return Marker(self.settings.database_url,
                      log_published=self.settings.relay_published_log)

    def _reset_pipeline(self) -> None:
        """Forget the rows in flight (a new session: they are fetched again)."""
        self._ahead = None  # its session is gone (or it was taken)
        self._seq_filenode = None
        self._pending.clear()
        self._acked, self._failed, self._refused = [], [], []
        self._held.clear()
        self._hwm = 0
        self._forget_floor()

    def _give_up_in_flight(self) -> None:
        """After an unexpected error: let every row in flight be fetched again."""
        self._flush(10)
        try:
            self._take_ahead(None)
        except psycopg.Error as exc:  # the session is in doubt: reconnect (run())
            raise psycopg.OperationalError(f"relay read-ahead failed: {exc}") from exc
        self._pending.clear()
        self._failed, self._refused = [], []
        self._held.clear()
        self._forget_floor()

    def _wind_down(self, conn: Conn) -> None:
        """On the way out (stop or error): wait briefly for the rows in flight and mark those
        delivered, so a clean stop re-publishes nothing. Best effort: what is not marked is
        published again by the next active relay."""
        marker = self._marker
        if marker is None:
            return
        try:
            self._take_ahead(None)
            if self._pending:
                self._flush(10)
            self.mark(conn)
        except Exception as exc:  # Postgres gone: the next relay re-publishes
            log.info("could not mark the last delivered rows (%s); they will be published "
                     "again", exc)
        finally:
            self._marker = None
            marker.close()  # runs the marks queued so far
            self.stats.transactions += marker.transactions
        if marker.error is not None:
            log.info("could not mark the last delivered rows (%s); they will be published "
                     "again", marker.error)
        self._reset_pipeline()

    def run(self) -> RelayStats:
        """Relay until stopped. Reconnects to Postgres with backoff; never marks a row
        published before its delivery report."""
        backoff = 0.5
        self._warm_up()
        while not self._stop.is_set():
            try:
                with connect(self.settings.database_url, autocommit=True) as conn:
                    # A relay frozen past this loses its session, so its lock (see
                    # relay_lock_timeout_s): a standby takes over.
                    conn.execute(Q["relay_lock_session_timeout"], {
                        "ms": str(int(self.settings.relay_lock_timeout_s * 1000))})
                    self._touched = time.monotonic()
                    if not self._acquire_lock(conn):
                        break
                    conn.execute(f"LISTEN {CHANNEL}")  # constant channel name, not input
                    # The jsonb headers of every fetched row, decoded by orjson (C) rather
                    # than json.loads: the largest item of the relay's profile (bench/README.md).
                    set_json_loads(orjson.loads, conn)
                    log.info("housekeeping active (lock held): sweeper and retention, not "
                             "publishing" if self.housekeeping_only
                             else "relay active (lock held); publishing outbox")
                    backoff = 0.5
                    # The marks commit without waiting for the WAL flush (see mark()).
                    conn.execute(Q["relay_session_async_commit"])
                    # Index plans only: a generic plan made on a near-empty outbox read the
                    # whole table per fetch (queries.sql, bench/README.md "relay-plan9").
                    conn.execute(Q["relay_session_index_plans"])
                    self._reset_pipeline()
                    if not self.housekeeping_only:
                        # The session's first look reads from id 0; a RESTART of the id
                        # sequence after it changes this (_sequence_restarted).
                        self._seq_filenode = self._sequence_filenode(conn)[1]
                    if not self.housekeeping_only:
                        self._marker = self._new_marker()
                        self._marker.start()
                    try:
                        self._relay_loop(conn)
                    finally:
                        self._wind_down(conn)
            except psycopg.OperationalError as exc:
                health.failed(exc)  # one line per outage (jobstream.health), not per retry
                log.debug("postgres unavailable (%s); reconnecting in %.1fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        self._flush(30)
        if self._ctx is not None:
            self._ctx.store.close()
        return self.stats


def main(settings: Settings, *, housekeeping_only: bool = False) -> int:
    """Run a relay in the foreground until SIGINT/SIGTERM; returns the exit code (2 when
    the Debezium relay owns the outbox: the two must never publish the same rows).
    ``housekeeping_only``: run only the sweeper and retention (one active instance, under its
    own lock), never publish: what the Debezium relay needs beside it."""
    from jobstream.connect import relay_refusal
    reason = None if housekeeping_only else relay_refusal(settings)
    if reason is not None:
        log.error("the Python relay refuses to start: %s (`jobstream relay "
                  "--housekeeping-only` runs the sweeper and retention without publishing)",
                  reason)
        return 2
    relay = OutboxRelay(settings, housekeeping_only=housekeeping_only)
    signal.signal(signal.SIGTERM, relay.stop)
    signal.signal(signal.SIGINT, relay.stop)
    stats = relay.run()
    log.info("relay stopped: %s", stats)
    return 0
