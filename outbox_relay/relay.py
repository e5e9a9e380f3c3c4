"""Outbox relay: Postgres ``outbox`` -> Kafka, at-least-once, per-key order kept.

Protocol (design.md, "Outbox relay"):

1. One active relay: a session-level ``pg_try_advisory_lock`` held on a dedicated connection;
   other relays stand by and take over when that connection dies. This keeps per-key order
   without partitioning the outbox (the simpler of the two designs the doc allows).
2. Read unpublished rows in id order (``published_at IS NULL``). Rows are marked, never skipped
   past a high-water mark, so a transaction that commits late with a lower id is still
   published on the next poll (no loss under sequence gaps).
3. Produce the batch with an idempotent producer (``enable.idempotence=true``, ``acks=all``),
   ``flush()``, and check every delivery report.
4. Only then mark the delivered rows published. A crash between 3 and 4 re-publishes the batch:
   that is the at-least-once side, absorbed by idempotent consumers.
5. Wake on ``LISTEN outbox_v1`` (a NOTIFY is sent by a trigger at commit); fall back to polling
   every ``relay_poll_interval_s``. Every ``gc_interval_s`` the active relay runs retention
   (:mod:`jobstream.retention`): published outbox rows, idempotent-consumer rows and
   idempotency records past their horizons, a bounded number of batches per run.
6. The active relay also runs the stuck-stage sweeper (``jobstream.stages.sweep``).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import KafkaError, Producer
from psycopg.rows import tuple_row

from jobstream import faults
from jobstream.db import QUERIES as Q
from jobstream.db import connect
from jobstream.kafka import producer_config
from jobstream.settings import Settings

log = logging.getLogger("jobstream.relay")

RELAY_LOCK_ID = 0x6F757462  # "outb": the active-relay advisory lock
HOUSEKEEPING_LOCK_ID = 0x6F757463  # the same for --housekeeping-only (Debezium publishes)
CHANNEL = "outbox_v1"
GC_MAX_BATCHES = 20  # per table and run: retention must not hold up publishing for long


class DeliveryFailed(Exception):
    """At least one message of a batch was not acknowledged by the broker."""


@dataclass
class RelayStats:
    """Counters of one relay process (rows published, batches, failed deliveries)."""

    published: int = 0
    batches: int = 0
    failed: int = 0
    started_at: float = field(default_factory=time.monotonic)


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
        self._producer = Producer(producer_config(settings, **{"client.id": "jobstream-relay",
                                                               "partitioner": "murmur2_random"}))
        self._ctx: Any = None  # StageContext of the sweeper, made on first use

    def stop(self, *_: Any) -> None:
        """Ask the relay loop to finish its current batch and return."""
        self._stop.set()

    def publish_batch(self, conn: psycopg.Connection) -> int:
        """Publish one batch of unpublished rows; returns how many were published.

        Raises :class:`DeliveryFailed` (nothing of the batch is marked) when any delivery
        report carries an error; the rows stay unpublished and are retried.
        """
        with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
            # Plain tuples: building a dict per row cost a third of the fetch.
            rows = cur.execute(Q["outbox_fetch"], (self.settings.relay_batch_size,)).fetchall()
        if not rows:
            return 0
        errors: list[KafkaError] = []

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        produce, poll = self._producer.produce, self._producer.poll
        for _id, topic, key, payload, headers, _type in rows:
            while True:
                try:  # a dict of str headers is UTF-8 encoded by the client, in C
                    produce(topic, value=payload, key=key, headers=headers,
                            on_delivery=on_delivery)
                    break
                except BufferError:
                    poll(0.1)  # local queue full: serve callbacks, then retry
                except TypeError:  # a header value that is not a string (JSON number, ...)
                    if all(isinstance(v, str) for v in headers.values()):
                        raise  # not the headers: a bug, let it surface
                    headers = {k: str(v) for k, v in headers.items()}
            poll(0)
        remaining = self._producer.flush(60)
        if remaining or errors:
            self.stats.failed += len(errors) + remaining
            raise DeliveryFailed(f"{len(errors)} failed, {remaining} undelivered: "
                                 f"{errors[:3]}")
        faults.point("relay_after_produce_before_mark")
        for event_type in sorted({r[5] for r in rows}):
            faults.point(f"relay_after_produce_before_mark:{event_type}")
        ids = [r[0] for r in rows]
        with conn.transaction():
            # A mark lost in a Postgres crash only re-publishes its rows (the at-least-once
            # side, absorbed by the consumers), so its commit need not wait for the WAL flush.
            conn.execute(Q["relay_mark_async_commit"])
            conn.execute(Q["outbox_mark_published"], (ids,))
        self.stats.published += len(ids)
        self.stats.batches += 1
        return len(ids)

    def _acquire_lock(self, conn: psycopg.Connection) -> bool:
        while not self._stop.is_set():
            lock = HOUSEKEEPING_LOCK_ID if self.housekeeping_only else RELAY_LOCK_ID
            row = conn.execute(Q["relay_try_lock"], (lock,)).fetchone()
            if row and row["locked"]:
                return True
            log.info("another relay is active; standing by")
            self._stop.wait(2.0)
        return False

    def _stage_ctx(self) -> None:
        """Make the StageContext the sweeper and retention share (on first use)."""
        from jobstream.stages import StageContext
        from jobstream.store import Store
        if self._ctx is None:
            self._ctx = StageContext(self.settings, Store(self.settings.database_url,
                                                          max_size=2))

    def _sweep(self) -> None:
        """Run the stuck-stage sweeper (the active relay is the one process that does)."""
        from jobstream.errors import RetryableError
        from jobstream.stages import sweep
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

    def run(self) -> RelayStats:
        """Relay until stopped. Reconnects to Postgres with backoff; never marks a row
        published before its delivery report."""
        last_gc = last_sweep = 0.0
        backoff = 0.5
        while not self._stop.is_set():
            try:
                with connect(self.settings.database_url, autocommit=True) as conn:
                    if not self._acquire_lock(conn):
                        break
                    conn.execute(f"LISTEN {CHANNEL}")  # constant channel name, not input
                    log.info("housekeeping active (lock held): sweeper and retention, not "
                             "publishing" if self.housekeeping_only
                             else "relay active (lock held); publishing outbox")
                    backoff = 0.5
                    while not self._stop.is_set():
                        try:
                            n = 0 if self.housekeeping_only else self.publish_batch(conn)
                        except DeliveryFailed as exc:
                            log.warning("delivery failed, will retry the batch: %s", exc)
                            self._stop.wait(1.0)
                            continue
                        if time.monotonic() - last_sweep > self.settings.sweep_grace_s / 2:
                            self._sweep()
                            last_sweep = time.monotonic()
                        if time.monotonic() - last_gc > self.settings.gc_interval_s:
                            self._gc()
                            last_gc = time.monotonic()
                        if n < self.settings.relay_batch_size:
                            # Caught up: sleep until a NOTIFY or the polling interval.
                            for _ in conn.notifies(timeout=self.settings.relay_poll_interval_s,
                                                   stop_after=1):
                                pass
            except psycopg.OperationalError as exc:
                log.warning("postgres unavailable (%s); reconnecting in %.1fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        self._producer.flush(30)
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
