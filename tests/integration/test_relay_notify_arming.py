"""The outbox trigger's NOTIFY is sent only while the relay is armed (migration 0025: a NOTIFY
serialises commits server-wide). While rows arrive faster than ``relay_notify_below_rate`` the
relay disarms it and polls; when they slow down it re-arms it, and a single commit after that
wakes it at once. A real relay process, Postgres and broker; the relay's polling fallback is
set to a minute, so the last row can only be published within the wait's bound if its
commit's NOTIFY woke the relay. Every row reaches Kafka exactly once."""

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


def _armed(url: str) -> int:
    return int(query(url, "SELECT last_value AS v FROM outbox_relay_armed")[0]["v"])


def _insert(conn: psycopg.Connection, topic: str, key: str) -> None:
    conn.execute(Q["outbox_insert"], (topic, key, b"{}", Jsonb({"key": key}), uuid.uuid4(),
                                      "test.row"))


def test_writers_notify_only_while_the_relay_waits(settings: Settings,
                                                   procs: ProcessRunner) -> None:
    topic = settings.topic("job.failed")
    url = settings.database_url
    relay = procs.start("relay", JOBSTREAM_RELAY_NOTIFY_BELOW_RATE="40",
                        JOBSTREAM_RELAY_POLL_INTERVAL_S="60")
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the relay to be active",
             procs.logs)
    assert _armed(url) == 1
    seen: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.add(_armed(url))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with psycopg.connect(url, autocommit=True) as conn:  # ~2 s of rows, one per commit
            deadline = time.monotonic() + 2.0
            sent = 0
            while time.monotonic() < deadline:
                _insert(conn, topic, f"fast-{sent}")
                sent += 1
        wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 60, "the stream published",
                 procs.logs)
        wait_for(lambda: _armed(url) == 1, 20, "the relay to re-arm the NOTIFY", procs.logs)
    finally:
        stop.set()
        watcher.join(10)
    assert sent > 100 and 0 in seen, (sent, seen)  # disarmed while rows came fast
    time.sleep(0.5)  # the relay back to waiting for a NOTIFY (polling fallback: 60 s)
    with psycopg.connect(url, autocommit=True) as conn:
        _insert(conn, topic, "after")
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 20,
             "the row after the stream published (only its NOTIFY can wake the relay)",
             procs.logs)
    keys = Counter(m.key().decode() for m in read_topic(settings, topic))
    assert keys["after"] == 1 and len(keys) == sent + 1 and set(keys.values()) == {1}, \
        keys.most_common(3)
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text()
    relay.popen.terminate()  # it waits for a NOTIFY (up to 40 s): one more commit wakes it
    with psycopg.connect(url, autocommit=True) as conn:
        _insert(conn, topic, "wake")
    relay.popen.wait(20)
