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
