"""The bounds of perf-relay6's gap probing (outbox_relay/relay.py ``_gaps``) from outside, with
a real relay, Postgres and broker: rows the gap probes cannot see must still be found by the
full rescan (``relay_full_rescan_s``, 4 s here), nothing stuck longer.

* ``open-past-window``: a writer transaction open 3 s, longer than ``relay_late_commit_s``
  (1 s), among rolled-back ids and rows committed above it: its gap is probed, then forgotten;
  its row must still be published (by the full rescan). Its key's row committed after it (and
  inside the window) may go first: per-key order holds only for transactions that keep to
  ``relay_late_commit_s`` (docs/design-notes.md), so this case checks each row arrives, not
  the order of ``late``'s rows 1 and 2 (seen: 0, 2, 1).
* ``sequence-restarted``: the outbox id sequence restarted BELOW the relay's last id
  (``ALTER SEQUENCE ... RESTART``; every earlier row published and deleted): the new rows are
  neither gaps nor above the last id; the full rescan must find them, each key in order.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("case", ["open-past-window", "sequence-restarted"])
def test_rows_the_gap_probes_miss_are_found_by_the_full_rescan(
        settings: Settings, procs: ProcessRunner, case: str) -> None:
    url, topic = settings.database_url, settings.topic("job.failed")
    relay = procs.start("relay", name="relay", JOBSTREAM_RELAY_LATE_COMMIT_S="1",
                        JOBSTREAM_RELAY_FULL_RESCAN_S="4")
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the relay to be active",
             procs.logs)
    with psycopg.connect(url, autocommit=True) as other:
        for i in range(50):
            _row(other, topic, "before", i)
        _row(other, topic, "late", 0)
        wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 30, "the first rows published",
                 procs.logs)
        if case == "open-past-window":
            with psycopg.connect(url) as late:
                _row(late, topic, "late", 1)  # its id taken; commits 3 s later
                with other.transaction(force_rollback=True):
                    for _ in range(5):
                        _row(other, topic, "burnt", 0)
                for i in range(10):
                    _row(other, topic, "above", i)
                time.sleep(3)
                late.commit()
            _row(other, topic, "late", 2)
            expect = {"late": [0, 1, 2], "above": list(range(10))}
            order_kept = False
        else:
            other.execute("SELECT setval(pg_get_serial_sequence('outbox', 'id'), 1, false)")
            for i in range(10):
                _row(other, topic, "restarted", i)
            _row(other, topic, "late", 1)
            expect = {"late": [0, 1], "restarted": list(range(10))}
            order_kept = True
        wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 20,
                 "every row published within the full rescan (4 s)",
                 lambda: str(query(url, "SELECT id, kafka_key FROM outbox ORDER BY id"))
                 + procs.logs())
    firsts = first_deliveries(settings, topic)
    got = {k: firsts.get(k) or [] for k in expect}
    assert got == expect if order_kept else {k: sorted(v) for k, v in got.items()} == expect, \
        firsts
    assert firsts["late"][0] == 0, firsts
    assert firsts.get("before") == list(range(50))
    assert "burnt" not in firsts
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()
