"""The relay keeps batches in flight and reads after its last id while rows keep coming, so a
transaction that took its outbox id early and commits after higher ids were published must
still be found (outbox_relay/relay.py, "the pipelined loop"): one that commits within
``relay_late_commit_s`` on the relay's next look from its floor, one open longer at the next
full rescan. A real relay process, Postgres and broker; every row reaches Kafka exactly once
(no row re-sent while its first copy is in flight or being marked)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import psycopg
import pytest
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.integration


def _insert(conn: psycopg.Connection, topic: str, key: str) -> int:
    conn.execute(Q["outbox_insert"], (topic, key, b'{"k": "%s"}' % key.encode(),
                                      Jsonb({"key": key}), uuid.uuid4(), "test.row"))
    row = conn.execute("SELECT currval('outbox_id_seq') AS id").fetchone()
    assert row is not None
    return int(row[0])


def test_rows_committed_late_with_lower_ids_are_published_once(
        settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("job.failed")
    url = settings.database_url
    relay = procs.start("relay", JOBSTREAM_RELAY_LATE_COMMIT_S="2",
                        JOBSTREAM_RELAY_FULL_RESCAN_S="8")
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the relay to be active",
             procs.logs)
    # Two transactions take their ids first and stay open: "short" commits after ~1 s
    # (within relay_late_commit_s), "long" after ~5 s (longer: found by the full rescan).
    short, long_ = psycopg.connect(url), psycopg.connect(url)
    try:
        short_id = _insert(short, topic, "late-short")
        long_id = _insert(long_, topic, "late-long")
        stop = threading.Event()

        def stream() -> None:  # rows with higher ids, committed meanwhile, one by one
            with psycopg.connect(url, autocommit=True) as conn:
                i = 0
                while not stop.is_set() and i < 400:
                    _insert(conn, topic, f"on-time-{i}")
                    i += 1
                    time.sleep(0.02)

        writer = threading.Thread(target=stream)
        writer.start()
        try:
            wait_for(lambda: query(url, "SELECT count(*) AS n FROM outbox_published "
                                        "WHERE id > %s", (long_id,))[0]["n"] >= 20,
                     60, "rows with higher ids published first", procs.logs)
            short.commit()
            time.sleep(4.0)
            long_.commit()
        finally:
            stop.set()
            writer.join(30)
    finally:
        short.close()
        long_.close()
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE published_at IS NULL"), 60,
             "every row published, the late ones too", procs.logs)
    keys = Counter(m.key().decode() for m in read_topic(settings, topic))
    on_time = [k for k in keys if k.startswith("on-time-")]
    assert keys["late-short"] == 1 and keys["late-long"] == 1, keys
    assert len(on_time) >= 20 and set(keys.values()) == {1}, keys.most_common(3)
    assert short_id < long_id
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text()


def test_late_commits_are_found_by_their_gaps_and_after_a_sequence_jump(
        settings: Settings, procs: ProcessRunner) -> None:
    """Caught up, the relay no longer reads the id range from its floor (which walks the index
    entries of every row deleted since the last vacuum) but probes the ids it read past without
    a row, its gaps (perf-relay6). A row committed late within ``relay_late_commit_s`` must be
    found by that probe, long before the full rescan (10 minutes here); an id rolled back (a gap
    that never fills) holds nothing up; and after a sequence jump too large to track
    (``MAX_GAPS``) the relay reads the range from its floor again and still finds a late row."""
    from outbox_relay.relay import MAX_GAPS

    topic = settings.topic("job.failed")
    url = settings.database_url
    relay = procs.start("relay", JOBSTREAM_RELAY_LATE_COMMIT_S="30",
                        JOBSTREAM_RELAY_FULL_RESCAN_S="600")
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the relay to be active",
             procs.logs)

    def publish_past(late: psycopg.Connection, key: str, jump: int = 0) -> int:
        """``late`` takes an id and stays open; an id is rolled back; rows after both are
        committed and published (the relay read past both ids); then ``late`` commits."""
        late_id = _insert(late, topic, key)
        with psycopg.connect(url) as rolled_back:
            _insert(rolled_back, topic, "rolled-back")
            rolled_back.rollback()
        with psycopg.connect(url, autocommit=True) as conn:
            if jump:
                conn.execute("SELECT setval('outbox_id_seq', nextval('outbox_id_seq') + %s)",
                             (jump,))
            last = max(_insert(conn, topic, f"{key}-next-{i}") for i in range(5))
        wait_for(lambda: query(url, "SELECT count(*) AS n FROM outbox_published "
                                    "WHERE id > %s AND id <= %s", (late_id, last))[0]["n"] == 5,
                 60, f"the rows after {key} published first", procs.logs)
        late.commit()
        return late_id

    for key, jump in (("late-gap", 0), ("late-after-jump", MAX_GAPS + 10)):
        with psycopg.connect(url) as late:
            publish_past(late, key, jump)
        # Bounded well below the full rescan (600 s) and the late-commit window (30 s).
        wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 20,
                 f"{key}: the late row published without a full rescan", procs.logs)
    keys = Counter(m.key().decode() for m in read_topic(settings, topic))
    assert keys["late-gap"] == 1 and keys["late-after-jump"] == 1, keys
    assert "rolled-back" not in keys and set(keys.values()) == {1}, keys
    assert sum(1 for k in keys if "-next-" in k) == 10, keys
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text()


def _outbox_reads(url: str) -> tuple[int, int]:
    """What scans of the outbox have read so far: ``outbox_pkey``'s index entries
    (pg_stat_user_indexes, dead ones included: what a range read walks; a heap page is counted
    once per run of entries on it, so blocks alone do not show a walk) and the outbox's heap and
    index blocks (pg_statio_user_tables, hit or read, by any kind of scan: what a sequential
    read costs, which index entries do not see; relay-plan9)."""
    row = query(url, "SELECT i.idx_tup_read AS entries, t.heap_blks_hit + t.heap_blks_read "
                     "+ t.idx_blks_hit + t.idx_blks_read AS blocks FROM pg_stat_user_indexes i, "
                     "pg_statio_user_tables t WHERE i.indexrelname = 'outbox_pkey' "
                     "AND t.relname = 'outbox'")[0]
    return int(row["entries"]), int(row["blocks"])


def test_the_full_rescan_probes_old_gaps_instead_of_walking_deleted_rows(
        settings: Settings, procs: ProcessRunner) -> None:
    """perf-relay7: the full rescan (every ``relay_full_rescan_s``, 2 s here) probes the gaps
    the relay knows, old ones too (forgotten by the looks after ``relay_late_commit_s``),
    instead of reading the range from id 0. A transaction stays open over 3,000 rows committed,
    published and deleted after its id (its xid keeps their index entries from being marked
    dead, as any long transaction does). Over two full rescans and the looks between them
    (~35 in 7 s) the relay walks far fewer index entries than one range read of the deleted
    rows (3,000; ~6,000 before perf-relay7) and reads few outbox blocks by any kind of scan:
    ~290 with index plans, ~2,000 with the sequential reads of the whole table (three per
    look) of the generic plan made on a near-empty outbox before relay-plan9. The open
    transaction's row, committed after them, is still published, once."""
    topic = settings.topic("job.failed")
    url = settings.database_url
    with psycopg.connect(url, autocommit=True) as conn:  # no vacuum to clean the range
        conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
    relay = procs.start("relay", JOBSTREAM_RELAY_LATE_COMMIT_S="1",
                        JOBSTREAM_RELAY_FULL_RESCAN_S="2")
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the relay to be active",
             procs.logs)
    long_ = psycopg.connect(url)
    try:
        long_id = _insert(long_, topic, "late-long")
        with psycopg.connect(url) as conn, conn.cursor() as cur:
            cur.executemany(Q["outbox_insert"], [
                (topic, f"next-{i}", b"{}", Jsonb({"key": f"next-{i}"}), uuid.uuid4(),
                 "test.row") for i in range(3000)])
        wait_for(lambda: query(url, "SELECT count(*) AS n FROM outbox_published "
                                    "WHERE id > %s", (long_id,))[0]["n"] == 3000,
                 60, "the rows after the open transaction's id published", procs.logs)
        # Its gap is old, the session's first full rescan (whole range) done, and the drain's
        # deletes counted: a backend that goes idle less than a second after its last report
        # (the relay's marker, after its last delete) reports its statistics up to 10 s later
        # (Postgres 15's PGSTAT_IDLE_INTERVAL), which put the drain's 3,000 deletes by id
        # into the window when it began 4 s after them.
        time.sleep(11.0)
        entries0, blocks0 = _outbox_reads(url)
        time.sleep(5.0)  # two full rescans
        time.sleep(2.0)  # the relay's backend (a look every ~0.2 s) reports about every second
        entries1, blocks1 = _outbox_reads(url)
        walked, read = entries1 - entries0, blocks1 - blocks0
        assert walked < 1500, f"{walked} index entries read in two full rescans and the looks"
        assert read < 1000, f"{read} outbox blocks read in two full rescans and the looks"
        long_.commit()
    finally:
        long_.close()
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 30,
             "the open transaction's row published by a full rescan's probe", procs.logs)
    keys = Counter(m.key().decode() for m in read_topic(settings, topic))
    assert keys["late-long"] == 1 and len(keys) == 3001 and set(keys.values()) == {1}, \
        keys.most_common(3)
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text()


def test_a_sessions_first_look_over_published_ids_tracks_no_gap_each_and_finds_a_late_row(
        settings: Settings) -> None:
    """A relay session that starts on an outbox whose first ids were published (deleted) by
    earlier sessions, with one transaction still open among them: the first look reads past
    more ids than the looks would probe (``MAX_GAP_PROBES``), so it restarts the gap tracking
    above its last id (the range from the floor covers them) instead of keeping each one as a
    gap, which cost every look of the next ``relay_late_commit_s`` a pass over all of them
    (bench/README.md, eighth pass). The open transaction's row, committed after that look,
    is still published by the next one. In-process relay, real Postgres and broker."""
    from psycopg.rows import tuple_row

    from outbox_relay.relay import MAX_GAP_PROBES, OutboxRelay

    topic, url = settings.topic("job.failed"), settings.database_url
    published = MAX_GAP_PROBES + 200
    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(published):
            _insert(conn, topic, f"old-{i}")
        conn.execute("DELETE FROM outbox")  # published and deleted by an earlier session
    late = psycopg.connect(url)
    try:
        late_id = _insert(late, topic, "late")  # open: its id lies below the next row's
        with psycopg.connect(url, autocommit=True) as conn:
            first = _insert(conn, topic, "first")
        relay = OutboxRelay(settings)
        with psycopg.connect(url, autocommit=True, row_factory=tuple_row) as conn:
            assert relay.publish_batch(conn) == 1  # type: ignore[arg-type]
            assert relay._gaps == {} and relay._gap_base == first, (  # noqa: SLF001
                len(relay._gaps), relay._gap_base)  # noqa: SLF001
            late.commit()
            assert relay.publish_batch(conn) == 1  # type: ignore[arg-type]
        relay._flush(10)  # noqa: SLF001
    finally:
        late.close()
    assert late_id < first
    assert not query(url, "SELECT 1 FROM outbox")
    keys = Counter(m.key().decode() for m in read_topic(settings, topic))
    assert keys == Counter({"first": 1, "late": 1}), keys
