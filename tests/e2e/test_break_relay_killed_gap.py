"""The active relay killed (SIGKILL) while a transaction that took an outbox id is still open
below the relay's last id (a gap the relay read past: perf-relay6 probes such gaps instead of
reading the range from the floor), a standby taking over, the transaction committing after the
takeover (within ``relay_late_commit_s``), the full rescan out of reach. Real relay processes,
Postgres and broker.

The late row must reach Kafka (its key's rows in commit order: it committed last), every row
once, one ``outbox_published`` record each, nothing left in the outbox.

Breaker10 (``busy=300``): more published rows above the gap than the looks probe
(``MAX_GAP_PROBES``, 256), so the standby's first look reads past more ids than it would track
one by one (perf-relay8 restarts the gap tracking above its last id there and relies on the
range read from the floor): the late row must still be found within ``relay_late_commit_s``.
"""

from __future__ import annotations

import os
import signal
import uuid

import psycopg
import pytest
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, first_deliveries, query, wait_for

pytestmark = pytest.mark.e2e


def _row(conn: psycopg.Connection[object], topic: str, key: str, n: int) -> None:
    conn.execute(Q["outbox_insert"], (topic, key, f'{{"k": "{key}", "n": {n}}}'.encode(),
                                      Jsonb({"key": key}), uuid.uuid4(), "test.row"))


@pytest.mark.parametrize("busy", [20, 300])
def test_a_late_commit_below_a_killed_relays_last_id_is_published_by_the_standby(
        settings: Settings, procs: ProcessRunner, busy: int) -> None:
    url, topic = settings.database_url, settings.topic("job.failed")
    env = {"JOBSTREAM_RELAY_LATE_COMMIT_S": "20", "JOBSTREAM_RELAY_FULL_RESCAN_S": "600",
           "JOBSTREAM_RELAY_LOCK_TIMEOUT_S": "3"}
    first = procs.start("relay", name="relay-killed", **env)
    wait_for(lambda: "relay active" in first.log_text(), 60, "the relay to be active",
             procs.logs)
    standby = procs.start("relay", name="relay-standby", **env)
    wait_for(lambda: "standing by" in standby.log_text(), 60, "the standby", procs.logs)
    with psycopg.connect(url, autocommit=True) as other:
        _row(other, topic, "late", 0)  # committed: published
        with psycopg.connect(url) as late:
            _row(late, topic, "late", 1)  # its id taken, not committed: a gap
            for i in range(busy):
                _row(other, topic, "busy", i)  # committed above it: the relay reads past
            wait_for(lambda: len(query(url, "SELECT 1 FROM outbox WHERE kafka_key = 'busy'"))
                     == 0, 30, "the rows above the gap published", procs.logs)
            os.kill(first.popen.pid, signal.SIGKILL)
            first.popen.wait(10)
            wait_for(lambda: "relay active" in standby.log_text(), 30,
                     "the standby to take over", procs.logs)
            _row(other, topic, "late", 2)  # after the takeover, above the gap
            wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE kafka_key = 'late'"),
                     30, "the standby to publish the row above the gap (the gap's own row is "
                     "not visible yet)", procs.logs)
            late.commit()  # the late row, its id below everything the standby read
        wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 30,
                 "the late row published (the full rescan is 600 s away)",
                 lambda: str(query(url, "SELECT id, kafka_key FROM outbox")) + procs.logs())
    firsts = first_deliveries(settings, topic)
    assert firsts.get("busy") == list(range(busy))
    assert firsts.get("late") == [0, 2, 1], firsts  # commit order
    rec = query(url, "SELECT count(*) AS n, count(DISTINCT id) AS d FROM outbox_published")[0]
    assert rec["n"] == rec["d"] == busy + 3, rec
