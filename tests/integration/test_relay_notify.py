"""The outbox trigger NOTIFYs on every commit (migration 0030 restores the plain trigger of
0001 and drops migration 0025's arming flag). A database upgraded while a relay of 0025 had
left writers silent (flag 0) notifies again after 0030; on a current database a lone commit
wakes a real relay process whose polling fallback is a minute, and reaches Kafka once."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.db import migrate
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, database_before, query, read_topic, wait_for

pytestmark = pytest.mark.integration


def _insert(conn: psycopg.Connection, topic: str, key: str) -> None:
    conn.execute(Q["outbox_insert"], (topic, key, b"{}", Jsonb({"key": key}), uuid.uuid4(),
                                      "test.row"))


def _flag_exists(url: str) -> bool:
    return bool(query(url, "SELECT count(*) AS n FROM pg_class WHERE relname = "
                           "'outbox_relay_armed'")[0]["n"])


@pytest.fixture
def db_before_0030(endpoints) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """An empty database migrated only up to 0029 (the release before migration 0030)."""
    with database_before(endpoints.database_url, 30) as url:
        yield url


def _notified_on_commit(url: str, timeout_s: float) -> bool:
    """Commit one outbox row on one connection; True when a LISTENing one got its NOTIFY
    (waiting at most ``timeout_s`` seconds)."""
    with psycopg.connect(url, autocommit=True) as listener, \
            psycopg.connect(url, autocommit=True) as writer:
        listener.execute("LISTEN outbox_v1")
        _insert(writer, "t.job.failed", "k")
        return any(True for _ in listener.notifies(timeout=timeout_s, stop_after=1))


def test_0030_makes_writers_silenced_by_0025_notify_again(db_before_0030: str) -> None:
    with psycopg.connect(db_before_0030, autocommit=True) as conn:
        conn.execute("SELECT setval('outbox_relay_armed', 0, true)")  # a relay left it disarmed
    assert not _notified_on_commit(db_before_0030, 1.0)  # what 0025 did with the flag at 0
    assert "0030_outbox_plain_notify.sql" in migrate(db_before_0030)
    assert not _flag_exists(db_before_0030)
    assert _notified_on_commit(db_before_0030, 10.0)


def test_a_lone_commit_wakes_the_relay(settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("job.failed")
    url = settings.database_url
    assert not _flag_exists(url)
    relay = procs.start("relay", JOBSTREAM_RELAY_POLL_INTERVAL_S="60")
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the relay to be active",
             procs.logs)
    time.sleep(0.5)  # past its first look: now it waits for a NOTIFY (fallback: 60 s)
    with psycopg.connect(url, autocommit=True) as conn:
        _insert(conn, topic, "lone")
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 20,
             "the lone row published (only its NOTIFY can wake the relay in time)", procs.logs)
    keys = Counter(m.key().decode() for m in read_topic(settings, topic))
    assert keys == {"lone": 1}, keys
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text()
    relay.popen.terminate()  # it waits for a NOTIFY (up to 40 s): one more commit wakes it
    with psycopg.connect(url, autocommit=True) as conn:
        _insert(conn, topic, "wake")
    relay.popen.wait(20)
