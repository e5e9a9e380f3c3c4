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
   that is the at-least-once side, absorbed by idempotent consumers. A row that can never be
   delivered (over ``message.max.bytes`` = ``kafka_message_max_bytes``, refused by its topic,
   unserialisable) is isolated: a row the broker refused is re-sent alone (its batch-mates may
   be the reason), and if it fails alone it is parked in the ``dead_letter`` table with the
   broker's reason, its outbox row deleted and its job failed (``undeliverable_event``) in one
   transaction; the relay goes on. Rows that failed with a retriable error stay unpublished
   and are re-sent after a backoff (0.5 s doubling to ``relay_backoff_cap_s``).
5. Wake on ``LISTEN outbox_v1`` (a NOTIFY is sent by a trigger at commit); fall back to polling
   every ``relay_poll_interval_s``. Every ``gc_interval_s`` the active relay runs retention
   (:mod:`jobstream.retention`): published outbox rows, idempotent-consumer rows and
   idempotency records past their horizons, a bounded number of batches per run.
6. The active relay also runs the stuck-stage sweeper (``streams.actions.sweep``).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException, Producer
from psycopg.rows import tuple_row

from jobstream import faults, health
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
    """Some rows of a batch failed with a retriable error (they stay unpublished)."""


_MISSING = object()
#: Delivery errors that no retry fixes: the row is parked (dead_letter table), not re-sent.
PERMANENT_ERRORS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_MSG, KafkaError.INVALID_MSG_SIZE,
    KafkaError.RECORD_LIST_TOO_LARGE, KafkaError.INVALID_RECORD, KafkaError.POLICY_VIOLATION,
    KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.TOPIC_EXCEPTION, KafkaError._INVALID_ARG,
    KafkaError._BAD_MSG, KafkaError._VALUE_SERIALIZATION,
})


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
        """Publish one batch of unpublished rows; returns how many rows it settled (delivered
        and marked, or parked).

        Rows the broker acknowledged are marked published. A row that can never be delivered
        (too large for the producer or the topic, refused by the topic, unserialisable) is
        parked (:meth:`park`) and the batch goes on. Raises :class:`DeliveryFailed` after
        marking and parking when some rows failed with a retriable error: they stay
        unpublished and the caller backs off before the next try.
        """
        with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
            # Plain tuples: building a dict per row cost a third of the fetch.
            rows = cur.execute(Q["outbox_fetch"], (self.settings.relay_batch_size,)).fetchall()
        if not rows:
            return 0
        reports, refused = self._send(rows)
        retriable: list[int] = []
        lone: list[int] = []  # refused by the broker: maybe only because of its batch-mates
        for i in range(len(rows)):
            if i in refused:
                continue
            if i not in reports:
                retriable.append(i)
            elif reports[i] is not None:
                (lone if _permanent(reports[i]) else retriable).append(i)
        delivered = [i for i in range(len(rows)) if i not in refused and i not in lone
                     and i not in retriable]
        for i in lone:  # isolate: one row alone in its produce request
            alone, why = self._send([rows[i]])
            if 0 in why:
                refused[i] = why[0]
            elif alone.get(0, _MISSING) is None:
                delivered.append(i)
            elif 0 in alone and _permanent(alone[0]):
                refused[i] = _describe_err(alone[0])
            else:
                retriable.append(i)
        if retriable or refused:
            self.stats.failed += len(retriable) + len(refused)
        faults.point("relay_after_produce_before_mark")
        for event_type in sorted({rows[i][5] for i in delivered}):
            faults.point(f"relay_after_produce_before_mark:{event_type}")
        ids = [rows[i][0] for i in sorted(delivered)]
        if ids:
            with conn.transaction():
                # A mark lost in a Postgres crash only re-publishes its rows (the at-least-once
                # side, absorbed by the consumers), so its commit need not wait for the WAL
                # flush.
                conn.execute(Q["relay_mark_async_commit"])
                conn.execute(Q["outbox_mark_published"], (ids,))
        for i in sorted(refused):
            self.park(conn, rows[i], refused[i])
        self.stats.published += len(ids)
        self.stats.batches += 1
        if retriable:
            errs = [reports.get(i) for i in retriable[:3]]
            raise DeliveryFailed(f"{len(retriable)} rows not delivered (retriable), "
                                 f"{len(ids)} delivered, {len(refused)} parked: {errs}")
        return len(ids) + len(refused)

    def _send(self, rows: list[tuple[Any, ...]]
              ) -> tuple[dict[int, KafkaError | None], dict[int, str]]:
        """Produce ``rows`` and wait for their delivery reports (at most 60 s). Returns the
        reports by row index (``None``: acknowledged; absent: no report in time) and the rows
        the client refused at once (too large for ``message.max.bytes``, unserialisable),
        with the reason."""
        reports: dict[int, KafkaError | None] = {}
        refused: dict[int, str] = {}

        def report_to(i: int) -> Any:
            def on_delivery(err: KafkaError | None, _msg: Any) -> None:
                reports[i] = err
            return on_delivery

        produce, poll = self._producer.produce, self._producer.poll
        for i, (_id, topic, key, payload, headers, _type) in enumerate(rows):
            while True:
                try:  # a dict of str headers is UTF-8 encoded by the client, in C
                    produce(topic, value=payload, key=key, headers=headers,
                            on_delivery=report_to(i))
                    break
                except BufferError:
                    poll(0.1)  # local queue full: serve callbacks, then retry
                except TypeError as exc:  # a header value that is not a string (JSON number)
                    if isinstance(headers, dict) and not all(
                            isinstance(v, str) for v in headers.values()):
                        headers = {k: str(v) for k, v in headers.items()}
                        continue
                    refused[i] = f"cannot serialise the row: {type(exc).__name__}: {exc}"
                    break
                except (KafkaException, ValueError) as exc:  # e.g. MSG_SIZE_TOO_LARGE
                    refused[i] = _describe_exc(exc)
                    break
            poll(0)
        self._producer.flush(60)
        return reports, refused

    def park(self, conn: psycopg.Connection, row: tuple[Any, ...], why: str) -> None:
        """Move an outbox row that can never be delivered to the ``dead_letter`` table (ONE
        transaction): keep its bytes, headers and the broker's reason, delete the outbox row,
        and fail its job (``undeliverable_event``, with a ``job.failed`` event) when the row
        belongs to one that is still open."""
        from jobstream.deadletter import store_dead_letter
        outbox_id, topic, key, payload, headers, event_type = row
        headers = headers if isinstance(headers, dict) else {}
        job_id = _uuid(headers.get("job_id"))
        with conn.transaction():
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

    def _fail_job(self, conn: psycopg.Connection, job_id: uuid.UUID | None, error: str) -> bool:
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

    def _acquire_lock(self, conn: psycopg.Connection) -> bool:
        standing_by = False
        while not self._stop.is_set():
            lock = HOUSEKEEPING_LOCK_ID if self.housekeeping_only else RELAY_LOCK_ID
            row = conn.execute(Q["relay_try_lock"], (lock,)).fetchone()
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
                    retry_s = 0.5
                    while not self._stop.is_set():
                        try:
                            n = 0 if self.housekeeping_only else self.publish_batch(conn)
                            health.ok()
                            retry_s = 0.5
                        except DeliveryFailed as exc:
                            log.warning("delivery failed; re-sending the undelivered rows in "
                                        "%.1fs: %s", retry_s, exc)
                            self._stop.wait(retry_s)
                            retry_s = min(retry_s * 2, self.settings.relay_backoff_cap_s)
                            continue
                        except psycopg.OperationalError:
                            raise  # reconnect below
                        except Exception:  # a bug must not stop the outbox for everyone
                            log.exception("relay batch failed; retrying in %.1fs", retry_s)
                            self._stop.wait(retry_s)
                            retry_s = min(retry_s * 2, self.settings.relay_backoff_cap_s)
                            continue
                        if time.monotonic() - last_sweep > self.settings.sweep_grace_s / 2:
                            self._sweep()
                            last_sweep = time.monotonic()
                        if time.monotonic() - last_gc > self.settings.gc_interval_s:
                            self._gc()
                            last_gc = time.monotonic()
                        if n < self.settings.relay_batch_size:
                            self._producer.poll(0)  # serve client logs/callbacks while idle
                            # Caught up: sleep until a NOTIFY or the polling interval.
                            for _ in conn.notifies(timeout=self.settings.relay_poll_interval_s,
                                                   stop_after=1):
                                pass
            except psycopg.OperationalError as exc:
                health.failed(exc)  # one line per outage (jobstream.health), not per retry
                log.debug("postgres unavailable (%s); reconnecting in %.1fs", exc, backoff)
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
