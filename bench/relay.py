"""Outbox relay throughput and commit-to-Kafka latency, next to a raw producer baseline.

Scenarios, all in one run against the same broker and a fresh database:

* ``drain_1_relay``: ``--n`` outbox rows are committed by ``--writers`` concurrent writer
  processes (``Store.add_outbox`` inside their own transactions, ``--rows-per-tx`` rows each),
  then one ``jobstream relay`` process publishes the backlog. Throughput = rows / (time the
  last row was marked published - broker time of the first message).
* ``raw_producer``: the same messages (topic, key, value, headers read back from the outbox)
  sent by a plain confluent-kafka producer with the relay's exact producer config
  (``enable.idempotence=true``, ``acks=all``, same linger and compression): rows / (time of
  the first ``produce()`` .. ``flush()`` returned). The ratio relay/raw is reported.
* ``drain_large`` (with ``--n-large``, e.g. 1e6): the same drain from a larger backlog,
  reported against the ``--n`` drain (``large_vs_n_ratio``): the outbox must not slow down as
  it ages (rows marked since the last vacuum).
* ``drain_2_relays``: the same with two relay processes. By design one holds the advisory lock
  and publishes, the other stands by: the throughput is one relay's, not two.
* ``latency_1k``, ``latency_5k``: writers commit at a fixed offered load (each of ``--rates``,
  default 1000 and 5000 events/s, for ``--seconds``, one row per transaction,
  ``--latency-writers`` processes per 1,000 events/s) while one relay runs. ``commit_to_kafka`` =
  broker append time of the message (topics use ``message.timestamp.type=LogAppendTime``,
  millisecond resolution) - the row's ``created_at`` (``clock_timestamp()`` at the INSERT,
  just before the COMMIT: an upper bound that also counts a writer descheduled between its
  INSERT and COMMIT). ``commit_returned_to_kafka`` uses the wall time right after the writer's
  COMMIT returned instead (a lower bound: it can even be negative when the writer process was
  descheduled after the commit). ``raw_produce_to_kafka`` is the same offered load through a
  raw producer: broker append time - ``produce()`` call time.

With ``--relay debezium`` the same run also measures the Debezium relay (Kafka Connect in
distributed mode + the Outbox Event Router, a private worker started by
``scripts/services.sh up connect``; ``--connect-url`` uses a running one instead):

* ``drain_debezium``: the connector is paused, the writers commit ``--n`` rows (deleted in
  their own transactions; the WAL keeps them), the connector is resumed. Throughput = rows /
  (broker time of the first .. of the last message).
* ``latency_debezium``: the first offered load of ``--rates`` with the connector running.
  The rows are gone by the time we look, so only ``commit_returned_to_kafka`` (the writer's
  wall time after COMMIT returned -> broker append time) is measured; ``latency_1k`` reports
  the same figure for the Python relay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import re
import subprocess
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import orjson
import psycopg
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from bench.common import (
    base_parser,
    create_topics,
    emit,
    isolated,
    latency_summary,
    log,
    machine,
    pyplot,
    pyspy_record,
    pyspy_stacks,
    start_cli,
    stop,
)
from jobstream import tracing
from jobstream.db import QUERIES as Q
from jobstream.db import connect
from jobstream.kafka import base_config, producer_config
from jobstream.settings import Settings
from jobstream.store import (
    OutboxMessage,
    Store,
    outbox_message,
    outbox_notify_option,
    wake_relay,
)
from outbox_relay.relay import narrow_batch_bytes
from schemas.events import TextExtracted, TextExtractedPayload

TOPIC_CONFIG = {"message.timestamp.type": "LogAppendTime"}
#: The raw producer's config beyond the relay's (--topic-max-message-bytes: the batch.size of
#: the relay's narrow-topic producer, without which the broker refuses its batches).
RAW_EXTRA: dict[str, Any] = {}


def make_message(topic: str) -> OutboxMessage:
    """A realistic stage event (``job.text_extracted``, ~600 bytes) for a fresh job."""
    ev = TextExtracted(tenant_id="bench", idempotency_key=uuid.uuid4().hex,
                       job_id=uuid.uuid4(), dedup_key=uuid.uuid4().hex * 2,
                       payload=TextExtractedPayload(text_sha256="0" * 64, char_count=1234,
                                                    page_count=0))
    msg = outbox_message(topic, ev)
    # The trace a stage's span gives its event: without one, add_outbox would look up the
    # job's trace (three more statements per row), which is not what a stage transaction does.
    msg.headers.setdefault(tracing.HEADER, tracing.outgoing_header())
    return msg


def _writer(url: str, topic: str, count: int, rows_per_tx: int, interval: float,
            start_at: float, offset: float) -> dict[str, float]:
    """One writer: ``count`` outbox rows, ``rows_per_tx`` per transaction, one transaction
    every ``interval`` seconds from wall time ``start_at + offset`` (0: as fast as it goes).
    Returns event id -> wall time right after its COMMIT returned. The writers wake the relay
    as a Store's transactions do (``JOBSTREAM_OUTBOX_NOTIFY``, default ``after_commit``: after
    each commit, :func:`jobstream.store.wake_relay`; ``in_transaction``: the trigger's NOTIFY)."""
    msgs = [make_message(topic) for _ in range(count)]  # built before the clock starts
    mine: dict[str, float] = {}
    notify = Settings().outbox_notify
    with psycopg.connect(url, row_factory=dict_row, connect_timeout=10,
                         options=outbox_notify_option(notify)) as conn:
        # The parameters of Store.add_outbox's statement (outbox_insert), built before the
        # clock too: the offer loop only inserts and commits (one round trip for a
        # transaction's rows, executemany's pipeline), so a writer process offers more
        # than the ~250-500 commits/s it reached under load building them per row.
        params = []
        for m in msgs:
            ev = orjson.loads(m.value)
            params.append((m.topic, m.key, m.value,
                           Jsonb(Store._outbox_headers(conn, m, ev)),  # noqa: SLF001
                           ev["event_id"], ev["event_type"]))
        delay = start_at - time.time()
        if delay > 0:
            time.sleep(delay)
        t0 = time.monotonic()
        done = k = 0
        while done < count:
            if interval:
                wait = t0 + offset + k * interval - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            batch = msgs[done:done + rows_per_tx]
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(Q["outbox_insert"], params[done:done + rows_per_tx])
            now = time.time()
            if notify == "after_commit":
                wake_relay(conn)
            for m in batch:
                mine[m.headers["event_id"]] = now
            done += len(batch)
            k += 1
    return mine


def _writer_proc(args: tuple[Any, ...]) -> dict[str, float]:
    return _writer(*args)


def write_outbox(url: str, topic: str, n: int, *, writers: int, rows_per_tx: int,
                 rate: float | None = None) -> dict[str, Any]:
    """Commit ``n`` outbox rows from ``writers`` concurrent writer processes (their own
    connections and transactions; processes, so the GIL of one does not pace the others);
    with ``rate`` (events/s, all writers together) paced and staggered, else as fast as they
    go. Returns the commit time (wall clock) of every event id and the writers' elapsed time
    (first commit .. last commit)."""
    share = [n // writers + (1 if i < n % writers else 0) for i in range(writers)]
    interval = writers * rows_per_tx / rate if rate else 0.0
    start_at = time.time() + 1.0 + n / 50_000  # time for the children to build their messages
    jobs = [(url, topic, share[i], rows_per_tx, interval, start_at, i * interval / writers)
            for i in range(writers) if share[i]]
    with mp.get_context("fork").Pool(len(jobs)) as pool:
        parts = pool.map(_writer_proc, jobs)
    committed: dict[str, float] = {}
    for part in parts:
        committed.update(part)
    times = committed.values()
    return {"committed": committed, "elapsed_s": max(max(times) - min(times), 1e-3)}


class Collector(threading.Thread):
    """Reads ``topic`` from the beginning (assigned, no group) and keeps the broker timestamp
    (ms) of the first copy of each event id (with ``keep``, also its key, value and headers
    in :attr:`messages`: the relay deletes the outbox rows it published)."""

    def __init__(self, settings: Settings, topic: str, expect: int, partitions: int,
                 *, keep: bool = False) -> None:
        super().__init__(daemon=True)
        self.expect = expect
        self.keep = keep
        self.messages: list[tuple[str, bytes, list[tuple[str, bytes]]]] = []
        self.seen: dict[str, int] = {}
        self.copies = 0
        self.ts_types: set[int] = set()
        self._halt = threading.Event()
        self._c = Consumer({**base_config(settings), "group.id": f"bench-{uuid.uuid4().hex}",
                            "enable.auto.commit": False, "fetch.wait.max.ms": 5})
        self._c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])

    def run(self) -> None:
        try:
            while not self._halt.is_set() and len(self.seen) < self.expect:
                for m in self._c.consume(1000, 0.1):
                    if m.error():
                        if m.error().code() != KafkaError._PARTITION_EOF:
                            log(f"collector: {m.error()}")
                        continue
                    self.copies += 1
                    ts_type, ts = m.timestamp()
                    self.ts_types.add(ts_type)
                    eid = next((v.decode() for k, v in (m.headers() or []) if k == "event_id"),
                               None)
                    if eid is not None and eid not in self.seen:
                        self.seen[eid] = ts
                        if self.keep:
                            key = m.key()
                            self.messages.append((key.decode() if key else "",
                                                  m.value() or b"", list(m.headers() or [])))
        finally:
            self._c.close()

    def wait(self, timeout_s: float) -> None:
        self.join(timeout_s)
        self._halt.set()
        self.join(5)


def created_at(url: str, event_ids: list[str]) -> dict[str, float]:
    """event id -> the row's created_at (wall clock seconds) for ``event_ids``, from the
    outbox or, once published and deleted, its ``outbox_published`` record."""
    q = ("SELECT event_id::text AS e, extract(epoch FROM created_at) AS t FROM outbox "
         "WHERE event_id = ANY(%(ids)s::uuid[])")
    with connect(url) as conn:
        if conn.execute("SELECT to_regclass('outbox_published') AS t").fetchone()["t"]:
            q += (" UNION ALL SELECT event_id::text, extract(epoch FROM created_at) "
                  "FROM outbox_published WHERE event_id = ANY(%(ids)s::uuid[])")
        rows = conn.execute(q, {"ids": event_ids}).fetchall()
    return {r["e"]: float(r["t"]) for r in rows}


def unpublished(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone()
    assert row is not None
    return int(row[0])


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: application_name of the bench's own connections (drain check, state sampler), so that
#: backends_cpu_s counts the relay's backends only.
BENCH_APP = "bench-relay"


def backends_cpu_s(url: str) -> float:
    """CPU seconds used so far by the client backends of ``url``'s database other than the
    bench's own (read from /proc: Postgres runs on this machine). During a drain these are
    the relay's connections: the Postgres side of publishing."""
    with psycopg.connect(url, autocommit=True, application_name=BENCH_APP) as conn:
        pids = [r[0] for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND application_name <> %s",
            (BENCH_APP,)).fetchall()]
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):  # gone, or not readable
            total += cpu_s(pid)
    return total


#: How wait_drained asks "is anything left?". ``index`` (default): the lowest unpublished id
#: by the primary key, from the lowest one seen before (every row of a drain is committed
#: before it starts), so each look reads a few index entries whatever the table's size.
#: ``count``: ``outbox_backlog`` (``count(*)``), what the bench used up to this session: a
#: scan of the whole table every 10 ms, which on a 1e6-row backlog kept a Postgres backend
#: busy for most of the drain (a core of the two), so the drain measured itself.
DRAIN_CHECK = {"index": "SELECT id FROM outbox WHERE published_at IS NULL AND id >= %s "
                        "ORDER BY id LIMIT 1",
               "count": None}


def wait_drained(url: str, timeout_s: float, check: str = "index") -> float:
    """Poll (every 10 ms) until no outbox row is unpublished; returns that moment (wall
    clock). ``check``: see :data:`DRAIN_CHECK`."""
    deadline = time.monotonic() + timeout_s
    low = 0
    with psycopg.connect(url, autocommit=True, application_name=BENCH_APP) as conn:
        while time.monotonic() < deadline:
            if check == "count":
                row = conn.execute(Q["outbox_backlog"]).fetchone()
                if row is not None and row[0] == 0:
                    return time.time()
            else:
                row = conn.execute(DRAIN_CHECK["index"], (low,)).fetchone()
                if row is None:
                    return time.time()
                low = row[0]
            time.sleep(0.01)
    raise TimeoutError(f"outbox not drained after {timeout_s}s")


def fill_sql(url: str, topic: str, n: int, rows_per_tx: int = 20_000) -> dict[str, Any]:
    """Commit ``n`` outbox rows quickly: one ``INSERT … SELECT generate_series`` of
    ``rows_per_tx`` copies of a realistic event per transaction, each copy with its own event
    id (in its headers, where the collectors read it) and Kafka key. Only to build a large
    backlog in seconds rather than minutes: the rows are the relay's to read like any other
    (same columns and sizes); stage transactions write one or a few rows each."""
    msg = make_message(topic)
    headers = dict(msg.headers)
    t0 = time.time()
    with psycopg.connect(url, autocommit=True) as conn:
        done = 0
        while done < n:
            k = min(rows_per_tx, n - done)
            conn.execute(
                "INSERT INTO outbox (topic, kafka_key, payload, headers, event_id, event_type) "
                "SELECT %(topic)s, e::text, %(payload)s, "
                "       %(headers)s::jsonb || jsonb_build_object('event_id', e::text), e, "
                "       %(type)s "
                "  FROM (SELECT gen_random_uuid() AS e FROM generate_series(1, %(k)s)) g",
                {"topic": topic, "payload": msg.value, "headers": Jsonb(headers),
                 "type": json.loads(msg.value)["event_type"], "k": k})
            done += k
    return {"elapsed_s": max(time.time() - t0, 1e-3)}


#: pg_stat_wal / pg_stat_bgwriter counters read before and after a drain (cluster-wide: other
#: databases' work on the shared server is in them too).
_PG_COUNTERS = (
    "SELECT w.wal_records, w.wal_fpi, w.wal_bytes::bigint AS wal_bytes, w.wal_buffers_full, "
    "       b.checkpoints_timed + b.checkpoints_req AS checkpoints, b.buffers_checkpoint, "
    "       b.buffers_clean, b.buffers_backend, d.blks_read, d.blks_hit "
    "  FROM pg_stat_wal w, pg_stat_bgwriter b, pg_stat_database d "
    " WHERE d.datname = current_database()")


def pg_counters(url: str) -> dict[str, int]:
    """The server's WAL, checkpoint and buffer counters, and the database's blocks read
    (from the OS) and hit (in shared buffers)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        cur = conn.execute(_PG_COUNTERS)
        row = cur.fetchone()
        assert row is not None and cur.description is not None
        return {c.name: int(v) for c, v in zip(cur.description, row, strict=True)}


def counters_per_row(before: dict[str, int], after: dict[str, int], rows: int
                     ) -> dict[str, Any]:
    """What changed between two :func:`pg_counters` readings, per outbox row drained (the
    checkpoints as a count)."""
    out: dict[str, Any] = {"checkpoints": after["checkpoints"] - before["checkpoints"]}
    for k, v in after.items():
        if k != "checkpoints":
            out[f"{k}_per_row"] = round((v - before[k]) / max(rows, 1), 3)
    return out


class WaitSampler(threading.Thread):
    """Samples ``pg_stat_activity`` of the run's database every ``every_s`` seconds while a
    drain runs: per backend (named by its last statement: the relay's fetch, its marker's
    delete, autovacuum, …) the share of samples it was running (``cpu``: active, no wait
    event), waiting on something inside Postgres (``IO:DataFileRead``, ``LWLock:WALWrite``, …)
    or idle, i.e. waiting for its client (``idle``): where a drain's time goes on the Postgres
    side."""

    def __init__(self, url: str, every_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s = url, every_s
        self.counts: dict[str, Counter[str]] = {}
        self.samples = 0
        self._halt = threading.Event()

    @staticmethod
    def _who(backend_type: str, query: str) -> str:
        q = " ".join((query or "").split()).lower()
        if backend_type != "client backend":
            return backend_type
        if "insert into outbox_published" in q and "select id, topic" not in q:
            return "relay: delete (marker)"
        if "select id, topic" in q and "delete" in q:
            return "relay: delete + look from the floor"
        if "select id, topic" in q:
            return "relay: fetch after the last id"
        return "other: " + q[:40]

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True, application_name=BENCH_APP) as conn:
            while not self._halt.wait(self.every_s):
                rows = conn.execute(
                    "SELECT backend_type, state, wait_event_type, wait_event, query "
                    "  FROM pg_stat_activity WHERE datname = current_database() "
                    "   AND application_name <> %s", (BENCH_APP,)).fetchall()
                self.samples += 1
                for btype, state, wtype, wevent, query in rows:
                    if state == "idle" and btype == "client backend":
                        what = "idle"  # waiting for its client
                    elif wtype is None:
                        what = "cpu"
                    else:
                        what = f"{wtype}:{wevent}"
                    self.counts.setdefault(self._who(btype, query), Counter())[what] += 1

    def summary(self) -> dict[str, Any]:
        """Per backend, the share (%) of samples in each state (states under 1 % left out)."""
        self._halt.set()
        self.join(5)
        out: dict[str, Any] = {"samples": self.samples, "every_s": self.every_s}
        for who, c in sorted(self.counts.items()):
            out[who] = {k: round(100 * v / max(self.samples, 1), 1)
                        for k, v in c.most_common() if 100 * v / max(self.samples, 1) >= 1}
        return out


def start_pyspy(pid: int, out: Path, gil: bool = False) -> subprocess.Popen[bytes] | None:
    """``py-spy record --idle --threads`` of ``pid`` (wall clock: waits included, per thread)
    until :func:`stop_pyspy`; with ``gil``, ``--gil --threads`` (only samples holding the
    GIL: the relay's Python CPU); None without py-spy."""
    return pyspy_record(pid, out, "--gil" if gil else "--idle", "--threads", rate=100)


def stop_pyspy(proc: subprocess.Popen[bytes] | None, out: Path, top: int = 20
               ) -> dict[str, Any] | None:
    """Stop :func:`start_pyspy` and summarise its stacks: per thread, the share of its
    samples by innermost function (wall clock, so a wait on a socket shows as the call that
    waits)."""
    stacks = pyspy_stacks(proc, out)
    if stacks is None:
        return None
    per: dict[str, Counter[str]] = {}
    for frames, n in stacks:
        thread = re.sub(r" \(\d+\)$", "", frames[0].strip("\""))
        leaf = re.sub(r" \(/.*/", " (", frames[-1])
        per.setdefault(thread, Counter())[leaf] += n
    return {"file": str(out), "threads": {
        t: {"samples": sum(c.values()), "self_pct": {
            k: round(100 * v / sum(c.values()), 1) for k, v in c.most_common(top)}}
        for t, c in per.items()}}


def drain(settings: Settings, args: argparse.Namespace, logdir: Path, label: str,
          relays: int, n: int | None = None, rows_per_tx: int | None = None
          ) -> dict[str, Any]:
    """Fill the outbox with ``n`` (default ``args.n``) rows for ``<prefix>bench.<label>``,
    then drain it with ``relays`` relay processes."""
    n = args.n if n is None else n
    rows_per_tx = args.rows_per_tx if rows_per_tx is None else rows_per_tx
    topic = settings.topic(f"bench.{label}")
    create_topics(settings, [topic], partitions=settings.topic_partitions, config=TOPIC_CONFIG)
    if rows_per_tx == 0:  # --large-rows-per-tx 0: the quick SQL fill
        log(f"{label}: {n} outbox rows by INSERT ... SELECT")
        w = fill_sql(settings.database_url, topic, n)
    else:
        log(f"{label}: {args.writers} writers commit {n} outbox rows")
        w = write_outbox(settings.database_url, topic, n, writers=args.writers,
                         rows_per_tx=rows_per_tx)
    log(f"{label}: committed in {w['elapsed_s']:.1f}s; starting {relays} relay(s)")
    msgs = raw_messages(settings.database_url, topic)  # before the relay deletes the rows
    col = Collector(settings, topic, n, settings.topic_partitions)
    col.start()
    load_before = list(os.getloadavg())
    counters = pg_counters(settings.database_url)
    sampler = WaitSampler(settings.database_url)
    procs = [start_cli(settings, logdir, f"{label}-relay{i}", "relay", log_level="info")
             for i in range(relays)]
    spy_out = Path(args.profile) / f"{label}-relay0.txt" if args.profile else None
    spy = start_pyspy(procs[0].pid, spy_out, args.profile_gil) if spy_out else None
    sampler.start()
    try:
        # CPU from the first message on (the relay's start-up left out): its process and its
        # Postgres backends.
        deadline = time.monotonic() + 120
        while not col.seen and time.monotonic() < deadline:
            time.sleep(0.002)
        relay_cpu0 = sum(cpu_s(p.pid) for p in procs)
        pg_cpu0 = backends_cpu_s(settings.database_url)
        t_drained = wait_drained(settings.database_url, args.timeout, args.drain_check)
        waits = sampler.summary()
        counters = counters_per_row(counters, pg_counters(settings.database_url), n)
        pyspy = stop_pyspy(spy, spy_out) if spy_out else None
        relay_cpu = sum(cpu_s(p.pid) for p in procs)  # before the relays stop
        pg_cpu = backends_cpu_s(settings.database_url)
        col.wait(60)
    finally:
        stop(procs)
    if len(col.seen) < n:
        raise RuntimeError(f"{label}: only {len(col.seen)} of {n} messages on {topic}")
    first = min(col.seen.values()) / 1000
    last = max(col.seen.values()) / 1000
    logs = [(logdir / f"{label}-relay{i}.log").read_text(errors="replace")
            for i in range(relays)]
    return {
        "rows": n, "relays": relays, "loadavg_before": load_before,
        "loadavg_after": list(os.getloadavg()),
        "events_per_s": round(n / (t_drained - first)),
        "produce_span_events_per_s": round(n / max(last - first, 1e-3)),
        "drain_s": round(t_drained - first, 3),
        # CPU of the relay process(es) over their whole life (start-up included) per 1k rows:
        # less sensitive to the machine's load than the rate.
        "relay_cpu_ms_per_1k_rows": round(relay_cpu * 1e6 / n, 1),
        # The relay's Postgres backends (fetch, mark or delete) over the relay's life.
        "postgres_cpu_ms_per_1k_rows": round(pg_cpu * 1e6 / n, 1),
        # The same from the first message to the drained outbox (start-up left out), in
        # microseconds per row: the relay process, and its Postgres backends.
        "drain_cpu_us_per_row": {"relay": round((relay_cpu - relay_cpu0) * 1e6 / n, 2),
                                 "postgres": round((pg_cpu - pg_cpu0) * 1e6 / n, 2)},
        "relay_transactions_per_event": relay_transactions_per_event(
            logdir / f"{label}-relay0.log"),
        # Where the drain's time went on the Postgres side (sampled backend states) and the
        # server's WAL / checkpoint / buffer counters per row (cluster-wide).
        "postgres_backend_states_pct": waits, "postgres_counters": counters,
        **({"relay_profile": pyspy} if pyspy else {}),
        "messages_on_topic": col.copies,
        "relays_that_stood_by": sum("standing by" in t for t in logs),
        "writers": {"processes": args.writers if rows_per_tx else 1,
                    "rows_per_tx": rows_per_tx or 20_000,
                    "commit_rate_per_s": round(n / w["elapsed_s"])},
        "_topic": topic, "_msgs": msgs,
    }


def raw_messages(url: str, topic: str) -> list[tuple[str, bytes, list[tuple[str, bytes]]]]:
    """``(key, value, headers)`` of every outbox row of ``topic`` in id order."""
    with connect(url) as conn:
        rows = conn.execute("SELECT kafka_key, payload, headers FROM outbox WHERE topic = %s "
                            "ORDER BY id", (topic,)).fetchall()
    return [(r["kafka_key"], bytes(r["payload"]),
             [(k, str(v).encode()) for k, v in r["headers"].items()]) for r in rows]


def raw_produce(settings: Settings, topic: str,
                msgs: list[tuple[str, bytes, list[tuple[str, bytes]]]],
                rate: float | None = None) -> dict[str, Any]:
    """Send ``msgs`` with a plain producer (the relay's config); paced at ``rate`` events/s
    if given. Returns the elapsed time and the produce() call time of each event id."""
    p = Producer(producer_config(settings, **{"client.id": "bench-raw",
                                              "linger.ms": settings.relay_linger_ms,
                                              **RAW_EXTRA}))
    p.list_topics(topic, timeout=10)  # connection + metadata before the clock starts
    # ... and the idempotent producer's id: the relay has it long before it is measured. The
    # warm-up message has no event_id header, so the collectors ignore it.
    p.produce(topic, value=b"warm-up", key="warm-up")
    if p.flush(30):
        raise RuntimeError("raw producer: the warm-up message was not delivered")
    errors: list[Any] = []
    sent: dict[str, float] = {}

    def cb(err: Any, _m: Any) -> None:
        if err is not None:
            errors.append(err)

    start, cpu0 = time.monotonic(), time.process_time()
    for i, (key, value, headers) in enumerate(msgs):
        if rate:
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        eid = next(v.decode() for k, v in headers if k == "event_id")
        sent[eid] = time.time()
        while True:
            try:
                p.produce(topic, value=value, key=key, headers=headers, on_delivery=cb)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    left = p.flush(60)
    elapsed, cpu = time.monotonic() - start, time.process_time() - cpu0
    if left or errors:
        raise RuntimeError(f"raw producer: {left} undelivered, errors {errors[:3]}")
    # cpu_s: the whole process's CPU (Python and librdkafka's threads) over the sending;
    # meaningful in a process of its own (raw_baseline), not beside the collectors.
    return {"elapsed_s": elapsed, "cpu_s": cpu, "sent": sent}


def _raw_child(settings: Settings, topic: str,
               msgs: list[tuple[str, bytes, list[tuple[str, bytes]]]], out: Any) -> None:
    r = raw_produce(settings, topic, msgs)
    out.send({"elapsed_s": r["elapsed_s"], "cpu_s": r["cpu_s"]})
    out.close()


def raw_baseline(settings: Settings, msgs: list[tuple[str, bytes, list[tuple[str, bytes]]]],
                 n: int, label: str = "raw") -> dict[str, Any]:
    """The raw producer sending ``msgs`` as fast as it goes, in a process of its own (forked:
    the messages are not copied; its CPU is its own): rate and CPU per row."""
    topic = settings.topic(f"bench.{label}")
    create_topics(settings, [topic], partitions=settings.topic_partitions, config=TOPIC_CONFIG)
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_raw_child, args=(settings, topic, msgs, send))
    child.start()
    send.close()
    try:
        r = recv.recv()
    except EOFError:
        raise RuntimeError("raw producer: the child process failed") from None
    finally:
        child.join(60)
    return {"rows": n, "events_per_s": round(n / r["elapsed_s"]),
            "elapsed_s": round(r["elapsed_s"], 3),
            "cpu_us_per_row": round(r["cpu_s"] * 1e6 / n, 2),
            "producer_config": {k: v for k, v in producer_config(settings, **RAW_EXTRA).items()
                                if k not in ("bootstrap.servers", "logger")}}


def round_figures(d: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
    """One relay drain and the raw run right after it: both rates and their ratio, and the
    ratio of CPU per row (raw producer's / relay's own; / relay's + its Postgres backends'),
    which the machine's load moves much less than the rates."""
    cpu = d["drain_cpu_us_per_row"]
    return {"relay_events_per_s": d["events_per_s"], "raw_events_per_s": r["events_per_s"],
            "rate_ratio": round(d["events_per_s"] / r["events_per_s"], 3),
            "relay_cpu_us_per_row": cpu["relay"], "postgres_cpu_us_per_row": cpu["postgres"],
            "raw_cpu_us_per_row": r["cpu_us_per_row"],
            "cpu_ratio": round(r["cpu_us_per_row"] / max(cpu["relay"], 1e-9), 3),
            "cpu_ratio_with_postgres": round(
                r["cpu_us_per_row"] / max(cpu["relay"] + cpu["postgres"], 1e-9), 3),
            "loadavg_before": round(d["loadavg_before"][0], 1)}


def wait_relay_active(settings: Settings, topic: str, timeout_s: float = 60.0) -> None:
    """Insert one probe row for ``topic`` and wait until a relay published it: the relay holds
    the lock and its producer knows the topic's partitions and leaders (a first produce to a
    topic waits for that metadata, which is no part of the steady-state latency)."""
    with connect(settings.database_url) as conn, conn.transaction():
        Store.add_outbox(conn, make_message(topic))
    wait_drained(settings.database_url, timeout_s)


def relay_transactions_per_event(logfile: Path) -> float | None:
    """Postgres transactions of the relay's publishing path per event published, from the
    ``relay stopped: RelayStats(...)`` line a relay logs at INFO (None when absent)."""
    text = logfile.read_text(errors="replace") if logfile.exists() else ""
    found = re.findall(r"relay stopped: RelayStats\(published=(\d+).*?transactions=(\d+)", text)
    if not found:
        return None
    published, tx = map(int, found[-1])
    return round(tx / max(published, 1), 3)


def latency_writers(args: argparse.Namespace, rate: float, rows_per_tx: int = 1) -> int:
    """Writer processes for an offered load: ``--latency-writers`` per 1,000 commits/s
    (``rate`` events/s, ``rows_per_tx`` per commit; one process commits ~1-2k/s here)."""
    return max(1, round(args.latency_writers * rate / rows_per_tx / 1000))


def latency(settings: Settings, args: argparse.Namespace, logdir: Path,
            rate: float) -> dict[str, Any]:
    """Offered load ``rate`` events/s for ``args.seconds`` through one running relay."""
    topic = settings.topic(f"bench.latency{rate:.0f}")
    create_topics(settings, [topic], partitions=settings.topic_partitions, config=TOPIC_CONFIG)
    n = int(rate * args.seconds)
    rows_per_tx = args.latency_rows_per_tx or max(1, round(rate / 1000))
    writers = latency_writers(args, rate, rows_per_tx)
    relay = start_cli(settings, logdir, f"latency{rate:.0f}-relay", "relay", log_level="info")
    try:
        wait_relay_active(settings, topic)
        col = Collector(settings, topic, n + 1, settings.topic_partitions,  # + the probe
                        keep=True)
        col.start()
        log(f"latency: {rate:.0f} events/s for {args.seconds}s through one relay, "
            f"{writers} writer processes")
        sampler = WaitSampler(settings.database_url)
        sampler.start()
        relay_cpu0 = cpu_s(relay.pid)
        w = write_outbox(settings.database_url, topic, n, writers=writers,
                         rows_per_tx=rows_per_tx, rate=rate)
        wait_drained(settings.database_url, args.timeout)
        relay_cpu = cpu_s(relay.pid) - relay_cpu0
        waits = sampler.summary()
        col.wait(60)
    finally:
        stop([relay])
    created = created_at(settings.database_url, list(w["committed"]))
    lat = [col.seen[e] - c * 1000 for e, c in created.items()
           if e in col.seen and e in w["committed"]]  # not the probe
    lat_commit = [col.seen[e] - c * 1000 for e, c in w["committed"].items() if e in col.seen]
    achieved = n / w["elapsed_s"]
    # Raw baseline at the same offered load: produce() call -> broker append time.
    raw_topic = settings.topic(f"bench.raw_latency{rate:.0f}")
    create_topics(settings, [raw_topic], partitions=settings.topic_partitions,
                  config=TOPIC_CONFIG)
    msgs = [m for m in col.messages if dict(m[2])["event_id"].decode() in w["committed"]]
    rcol = Collector(settings, raw_topic, len(msgs), settings.topic_partitions)
    rcol.start()
    r = raw_produce(settings, raw_topic, msgs, rate=rate)
    rcol.wait(60)
    raw_lat = [rcol.seen[e] - t * 1000 for e, t in r["sent"].items() if e in rcol.seen]
    return {
        "offered_events_per_s": rate, "writer_processes": writers,
        "achieved_commit_rate_per_s": round(achieved),
        "events": n, "received": len(lat),
        "commit_to_kafka": latency_summary(lat),
        "commit_returned_to_kafka": latency_summary(lat_commit),
        "raw_produce_to_kafka": latency_summary(raw_lat),
        "relay_transactions_per_event": relay_transactions_per_event(
            logdir / f"latency{rate:.0f}-relay.log"),
        "rows_per_commit": rows_per_tx,
        "achieved_commits_per_s": round(n / rows_per_tx / w["elapsed_s"]),
        "relay_cpu_us_per_event": round(relay_cpu * 1e6 / n, 1),
        "postgres_backend_states_pct": waits,
        "_lat": lat, "_raw_lat": raw_lat,
    }


class ConnectWorker:
    """A Kafka Connect worker for the benchmark: ``url`` of a running one, or a private one
    started (and stopped) through ``scripts/services.sh`` with its own directory, port and
    group id on the run's Kafka."""

    def __init__(self, settings: Settings, url: str | None) -> None:
        self.url = url
        self.env: dict[str, str] = {}
        self._dir: str | None = None
        if url is None:
            import socket
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            self._dir = mkdtemp(prefix="bench-connect-")
            self.group = f"{settings.topic_prefix}connect"
            self.env = {**os.environ, "JOBSTREAM_CONNECT_DIR": self._dir,
                        "JOBSTREAM_CONNECT_PORT": str(port), "JOBSTREAM_CONNECT_GROUP": self.group,
                        "JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS": settings.kafka_bootstrap_servers}
            self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> ConnectWorker:
        if self._dir is not None:
            self._services("up", "connect")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._dir is not None:
            self._services("down", "connect")

    def _services(self, *args: str) -> None:
        import subprocess
        script = Path(__file__).resolve().parents[1] / "scripts" / "services.sh"
        subprocess.run(["bash", str(script), *args], env=self.env, check=True,
                       stdout=subprocess.DEVNULL, timeout=300)


def _connector(settings: Settings, action: str) -> None:
    """Pause or resume the outbox connector (Connect REST API)."""
    import httpx

    from jobstream.connect import names
    r = httpx.put(f"{settings.connect_url}/connectors/{names(settings).connector}/{action}",
                  timeout=30)
    r.raise_for_status()


def debezium(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    """``drain_debezium`` and ``latency_debezium`` (see the module docstring)."""
    from jobstream import connect as dbz
    out: dict[str, Any] = {}
    with ConnectWorker(settings, args.connect_url) as worker:
        s = settings.model_copy(update={"relay": "debezium", "connect_url": worker.url})
        try:
            dbz.deploy(s)
            topic = s.topic("bench.debezium")
            create_topics(s, [topic], partitions=s.topic_partitions, config=TOPIC_CONFIG)
            _connector(s, "pause")
            time.sleep(3)  # a paused task stops polling the slot
            log(f"debezium: {args.writers} writers commit {args.n} rows, connector paused")
            w = write_outbox(s.database_url, topic, args.n, writers=args.writers,
                             rows_per_tx=args.rows_per_tx)
            col = Collector(s, topic, args.n, s.topic_partitions)
            col.start()
            _connector(s, "resume")
            col.wait(args.timeout)
            if len(col.seen) < args.n:
                raise RuntimeError(f"debezium: only {len(col.seen)} of {args.n} on {topic}")
            first, last = min(col.seen.values()) / 1000, max(col.seen.values()) / 1000
            out["drain_debezium"] = {
                "rows": args.n, "events_per_s": round(args.n / max(last - first, 1e-3)),
                "drain_s": round(last - first, 3), "messages_on_topic": col.copies,
                "writers": {"processes": args.writers, "rows_per_tx": args.rows_per_tx,
                            "commit_rate_per_s": round(args.n / w["elapsed_s"])}}
            log(f"debezium drain: {out['drain_debezium']['events_per_s']} events/s")
            if not {"latency", "latency_1k"} & set(filter(None, args.skip.split(","))):
                lt = s.topic("bench.debezium_latency")
                create_topics(s, [lt], partitions=s.topic_partitions, config=TOPIC_CONFIG)
                rate = args.rates[0]
                n = int(rate * args.seconds)
                col = Collector(s, lt, n, s.topic_partitions)
                col.start()
                log(f"debezium latency: {rate:.0f} events/s for {args.seconds}s")
                w = write_outbox(s.database_url, lt, n, writers=latency_writers(args, rate),
                                 rows_per_tx=1, rate=rate)
                col.wait(120)
                lat = [col.seen[e] - c * 1000 for e, c in w["committed"].items()
                       if e in col.seen]
                out["latency_debezium"] = {
                    "offered_events_per_s": rate, "events": n, "received": len(lat),
                    "achieved_commit_rate_per_s": round(n / w["elapsed_s"]),
                    "commit_returned_to_kafka": latency_summary(lat)}
        finally:
            dbz.delete(s)
    return out


def plot(result: dict[str, Any], path: str, lat_key: str) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["raw producer", "1 relay"]
    vals = [result["raw_producer"]["events_per_s"], result["drain_1_relay"]["events_per_s"]]
    for key, label in (("drain_large", f"1 relay, {result['params']['n_large']:.0e} rows"),
                       ("drain_2_relays", "2 relays (1 active)")):
        if key in result:
            names.append(label)
            vals.append(result[key]["events_per_s"])
    ax1.bar(names, vals, color=["grey", "tab:blue", "tab:cyan", "tab:purple"][:len(vals)])
    ax1.axhline(result["raw_producer"]["events_per_s"] / 2, color="red", ls="--", lw=1,
                label="target: half the raw producer")
    ax1.set_ylabel("events/s")
    ax1.set_title(f"throughput, {result['params']['n']} rows")
    ax1.legend()
    lat = result[lat_key]
    for key, label in (("_lat", "relay: commit -> broker"), ("_raw_lat", "raw: produce -> broker")):
        xs = sorted(lat[key])
        if xs:
            ax2.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    raw99 = lat["raw_produce_to_kafka"]["p99_ms"]
    if raw99:
        ax2.axvline(2 * raw99, color="red", ls="--", lw=1, label="target: p99 <= 2x raw p99")
    ax2.set_xscale("symlog")
    ax2.set_xlabel("latency (ms)")
    ax2.set_ylabel("fraction of events")
    ax2.set_title(f"latency CDF at {lat['offered_events_per_s']:.0f} events/s offered")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--n", type=float, default=1e4, help="rows per drain (1e4..1e6)")
    p.add_argument("--n-large", type=float, default=0,
                   help="also drain a backlog this large (1e6: does the outbox slow down as "
                        "it ages?) and report its rate against the --n drain's; 0: skip")
    p.add_argument("--large-rows-per-tx", type=int, default=10,
                   help="outbox rows per writer transaction for the --n-large backlog (only "
                        "to write it faster; the relay reads the same rows); 0: one "
                        "INSERT ... SELECT of 20,000 rows per transaction (seconds for 1e6)")
    p.add_argument("--rounds", type=int, default=1,
                   help="relay drain + raw producer pairs of --n rows, back to back (the "
                        "first with the writers, the others filled by INSERT ... SELECT); "
                        "the median ratio is reported")
    p.add_argument("--drain-check", choices=sorted(DRAIN_CHECK), default="index",
                   help="how the end of a drain is polled: index (a look at the lowest "
                        "unpublished id) or count (count(*) of the outbox every 10 ms, the "
                        "bench before issue 12's third pass: it loads Postgres with the "
                        "backlog's size)")
    p.add_argument("--profile-gil", action="store_true",
                   help="with --profile: only samples holding the GIL (py-spy --gil), the "
                        "relay's own Python CPU, instead of --idle (wall clock)")
    p.add_argument("--profile", help="py-spy record --idle --threads of the (first) relay "
                   "of each drain, stacks written to this directory")
    p.add_argument("--writers", type=int, default=4, help="concurrent writer processes")
    p.add_argument("--rows-per-tx", type=int, default=1, help="outbox rows per transaction")
    p.add_argument("--latency-writers", type=int, default=2,
                   help="writer processes per 1,000 events/s of the latency runs (one row "
                        "per transaction)")
    p.add_argument("--latency-rows-per-tx", type=int, default=0,
                   help="outbox rows per writer transaction in the latency runs (1: the "
                        "one-event stage transaction; a group commit writes several); 0 "
                        "(default): one per 1,000 events/s offered (1 at 1k, 5 at 5k): a "
                        "commit that NOTIFYs is serialised server-wide through its WAL "
                        "flush, so one row per commit never reached 5k here (629-1,026 "
                        "commits/s in every pass since the third)")
    p.add_argument("--rates", default="1000,5000",
                   help="offered loads of the latency runs (events/s, comma list)")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each latency run")
    p.add_argument("--relay-batch-size", type=int, help="override relay_batch_size")
    p.add_argument("--timeout", type=float, default=900.0, help="max seconds per drain")
    p.add_argument("--skip", default="", help="comma list of scenarios to skip: "
                   "drain_2_relays,latency")
    p.add_argument("--relay", choices=["python", "debezium"], default="python",
                   help="debezium: also measure the Debezium relay in the same run")
    p.add_argument("--connect-url", help="a running Kafka Connect worker (default: start a "
                   "private one with scripts/services.sh)")
    p.add_argument("--topic-max-message-bytes", type=int,
                   help="create the drains' and raw producer's topics with this "
                        "max.message.bytes (bytes), below the producer's message.max.bytes: "
                        "the relay's narrow-topic path (e.g. 1048588, the broker's default; "
                        "default: as jobstream creates its topics)")
    args = p.parse_args()
    if args.topic_max_message_bytes:  # a narrow topic: the relay's _narrow path
        TOPIC_CONFIG["max.message.bytes"] = str(args.topic_max_message_bytes)
        RAW_EXTRA["batch.size"] = narrow_batch_bytes(args.topic_max_message_bytes)
    args.n = int(args.n)
    args.n_large = int(args.n_large)
    args.rates = [float(r) for r in args.rates.split(",") if r]
    skip = set(filter(None, args.skip.split(",")))
    if "latency_1k" in skip:  # the old name
        skip.add("latency")
    kw = {} if args.relay_batch_size is None else {"relay_batch_size": args.relay_batch_size}
    result: dict[str, Any] = {"benchmark": "relay", "machine": machine(),
                              "params": {k: v for k, v in vars(args).items() if k != "plot"}}
    logdir = Path(mkdtemp(prefix="bench-relay-"))
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    lat_keys: list[str] = []
    with isolated(args, "relay", relay_poll_interval_s=1.0, **kw) as s:
        result["params"]["relay_batch_size"] = s.relay_batch_size
        result["params"]["relay_max_in_flight"] = s.relay_max_in_flight
        one = drain(s, args, logdir, "relay1", 1)
        result["drain_1_relay"] = one
        log(f"1 relay: {one['events_per_s']} events/s; raw baseline with the same messages")
        one.pop("_topic")
        raw = raw_baseline(s, one.pop("_msgs"), args.n)
        result["raw_producer"] = raw
        result["relay_vs_raw_ratio"] = round(one["events_per_s"] / raw["events_per_s"], 3)
        log(f"raw: {raw['events_per_s']} events/s, ratio {result['relay_vs_raw_ratio']}")
        rounds = [round_figures(one, raw)]
        for i in range(1, args.rounds):
            # Again, drain then raw back to back (a fresh backlog by INSERT ... SELECT: the
            # writers take minutes here), so each relay drain sits between two raw runs.
            d = drain(s, args, logdir, f"relay1r{i}", 1, rows_per_tx=0)
            d.pop("_topic")
            r = raw_baseline(s, d.pop("_msgs"), args.n, f"raw{i}")
            rounds.append(round_figures(d, r))
            log(f"round {i}: {rounds[-1]}")
        if args.rounds > 1:
            result["rounds"] = rounds
            for k in ("rate_ratio", "cpu_ratio", "cpu_ratio_with_postgres"):
                vals = sorted(x[k] for x in rounds)
                result[f"median_{k}"] = vals[len(vals) // 2]
        result["relay_vs_raw_cpu_ratio"] = (result["median_cpu_ratio"] if args.rounds > 1
                                            else rounds[0]["cpu_ratio"])
        if args.n_large:
            big = drain(s, args, logdir, "relaylarge", 1, n=args.n_large,
                        rows_per_tx=args.large_rows_per_tx)
            big.pop("_topic"), big.pop("_msgs")
            result["drain_large"] = big
            result["large_vs_n_ratio"] = round(big["events_per_s"] / one["events_per_s"], 3)
            result["large_vs_raw_ratio"] = round(big["events_per_s"] / raw["events_per_s"], 3)
            log(f"{args.n_large} rows: {big['events_per_s']} events/s, "
                f"{result['large_vs_n_ratio']} of the {args.n}-row drain")
        if "drain_2_relays" not in skip:
            two = drain(s, args, logdir, "relay2", 2)
            two.pop("_topic"), two.pop("_msgs")
            result["drain_2_relays"] = two
            log(f"2 relays: {two['events_per_s']} events/s")
        if "latency" not in skip:
            for rate in args.rates:
                key = f"latency_{rate / 1000:g}k"
                result[key] = latency(s, args, logdir, rate)
                lat_keys.append(key)
                log(f"{key}: relay {result[key]['commit_to_kafka']}, "
                    f"raw {result[key]['raw_produce_to_kafka']}")
        if args.relay == "debezium":
            result.update(debezium(s, args))
    result["machine"]["loadavg_after"] = list(os.getloadavg())
    targets = {"relay>=50%_of_raw": result["relay_vs_raw_ratio"] >= 0.5}
    if args.rounds > 1:
        targets["relay>=50%_of_raw_median_of_rounds"] = result["median_rate_ratio"] >= 0.5
    targets["relay_cpu_per_row<=2x_raw"] = result["relay_vs_raw_cpu_ratio"] >= 0.5
    if "large_vs_n_ratio" in result:
        targets[f"drain_{args.n_large:.0e}>=0.8x_drain_{args.n:.0e}"] = \
            result["large_vs_n_ratio"] >= 0.8
    for key in lat_keys:
        p99 = result[key]["commit_to_kafka"]["p99_ms"]
        raw99 = result[key]["raw_produce_to_kafka"]["p99_ms"]
        result[key]["p99_vs_raw"] = None if not p99 or not raw99 else round(p99 / raw99, 2)
        targets[f"commit_to_kafka_p99<=2x_raw_at_{key[8:]}"] = (
            p99 is not None and raw99 is not None and p99 <= 2 * raw99)
        # The latency target holds only at the load offered: writers that could not commit
        # that fast (a NOTIFY per commit serialises commits server-wide) measured less.
        achieved = result[key]["achieved_commit_rate_per_s"]
        targets[f"offered_load_reached_at_{key[8:]}"] = (
            achieved >= 0.9 * result[key]["offered_events_per_s"])
    result["targets_met"] = targets
    if args.plot and lat_keys:
        plot(result, args.plot, lat_keys[0])
        result["plot"] = args.plot
    for key in lat_keys:
        result[key] = {k: v for k, v in result[key].items() if not k.startswith("_")}
    result["relay_logs"] = str(logdir)
    emit(result)


if __name__ == "__main__":
    main()
