"""The active relay frozen (SIGSTOP) longer than ``relay_late_commit_s`` but shorter than its
lock timeout (no standby takes over, its session survives), while it reads the range below its
last id (more gaps than ``MAX_GAP_PROBES``: 300 rolled-back ids) and a writer transaction that
took an id below that last id commits during the freeze (within ``relay_late_commit_s`` of its
insert). Real relay process, Postgres and broker; the full rescan out of reach (600 s).

On SIGCONT the late row must be published promptly (not after the full rescan), before its
key's next row, committed after it: per-key order.
"""

from __future__ import annotations

import os
import signal
import time
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


@pytest.mark.parametrize("burnt", [300, 20], ids=["range", "probed"])
def test_a_late_commit_during_a_relay_freeze_is_published_in_order_on_resume(
        settings: Settings, procs: ProcessRunner, burnt: int) -> None:
    url, topic = settings.database_url, settings.topic("job.failed")
    relay = procs.start("relay", name="relay", JOBSTREAM_RELAY_LATE_COMMIT_S="3",
                        JOBSTREAM_RELAY_FULL_RESCAN_S="600", JOBSTREAM_RELAY_LOCK_TIMEOUT_S="60")
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the relay to be active",
             procs.logs)
    frozen = False
    try:
        with psycopg.connect(url, autocommit=True) as other:
            _row(other, topic, "late", 0)
            with psycopg.connect(url) as late:
                started = time.monotonic()
                _row(late, topic, "late", 1)  # its id taken, committed during the freeze
                with other.transaction(force_rollback=True):
                    for _ in range(burnt):
                        _row(other, topic, "burnt", 0)
                for i in range(10):
                    _row(other, topic, "above", i)
                wait_for(lambda: not query(url, "SELECT 1 FROM outbox "
                                                "WHERE kafka_key IN ('above')"), 20,
                         "the rows above the gaps published", procs.logs, every_s=0.05)
                os.kill(relay.popen.pid, signal.SIGSTOP)
                frozen = True
                time.sleep(max(0.0, 2.0 - (time.monotonic() - started)))
                late.commit()  # within relay_late_commit_s (3 s) of its insert
            _row(other, topic, "late", 2)
            time.sleep(3.5)  # frozen longer than relay_late_commit_s, far below the lock timeout
            os.kill(relay.popen.pid, signal.SIGCONT)
            frozen = False
            wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 20,
                     "the late row published on resume (the full rescan is 600 s away)",
                     lambda: str(query(url, "SELECT id, kafka_key FROM outbox ORDER BY id"))
                     + procs.logs())
    finally:
        if frozen:
            os.kill(relay.popen.pid, signal.SIGCONT)
    firsts = first_deliveries(settings, topic)
    assert firsts.get("late") == [0, 1, 2], firsts
    assert firsts.get("above") == list(range(10))
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()
