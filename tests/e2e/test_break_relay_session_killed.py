"""Breaker6: the active relay's Postgres lock session terminated under it (``pg_terminate_backend``:
a failover, an operator, a pooler recycling it) while it drains a backlog with rows in flight,
its marker thread marking on its own connection and (issue 12) the next fetch sent ahead on
the lock session; a standby relay waits. Real relay processes, the shared broker and Postgres.

The advisory lock goes with the session: the standby may take over while the old relay still
has rows in its producer and acknowledgements not yet marked; the old relay reconnects and
stands by (or takes the lock back). Whatever the interleaving, three terminations in a row:
nothing lost, each key's events first reach Kafka in outbox order (duplicates allowed: at least
once), every row deleted with exactly one ``outbox_published`` record, both relays alive.
"""

from __future__ import annotations

import pytest

from jobstream.settings import Settings
from outbox_relay.relay import RELAY_LOCK_ID
from tests.helpers import (
    ProcessRunner,
    first_deliveries,
    insert_keyed_rows,
    query,
    wait_for,
)

pytestmark = pytest.mark.e2e

KEYS = [f"job-{i}" for i in range(4)]
N = 2500  # rows per key


def _lock_holder(url: str) -> int | None:
    rows = query(url, "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                      "AND objid = %s AND database = (SELECT oid FROM pg_database WHERE "
                      "datname = current_database())", (RELAY_LOCK_ID & 0xFFFFFFFF,))
    return int(rows[0]["pid"]) if rows else None


def _left(url: str) -> int:
    return int(query(url, "SELECT count(*) AS n FROM outbox")[0]["n"])


def test_the_relays_lock_session_terminated_mid_backlog_loses_nothing_and_keeps_order(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("job.failed")
    insert_keyed_rows(url, topic, KEYS, N)
    # Small batches and a small window: on a quiet machine a relay at 50 / 200 drained the
    # 10,000 rows within a second of the first termination (fresh-clone CI: killed == 1).
    env = {"JOBSTREAM_RELAY_BATCH_SIZE": "5", "JOBSTREAM_RELAY_MAX_IN_FLIGHT": "10"}
    relays = [procs.start("relay", name="relay-a", **env)]
    wait_for(lambda: _lock_holder(url), 30, "a relay holding the lock", procs.logs)
    relays.append(procs.start("relay", name="relay-b", **env))
    total, killed = N * len(KEYS), 0
    for _ in range(3):
        left = _left(url)
        wait_for(lambda left=left: _left(url) < left - 100 or _left(url) == 0, 60,
                 "rows published", procs.logs, every_s=0.02)
        pid = _lock_holder(url)
        if pid is None or _left(url) == 0:
            break
        assert query(url, "SELECT pg_terminate_backend(%s) AS ok", (pid,))[0]["ok"]
        killed += 1
        print(f"terminated the lock session with {_left(url)} rows left")
        wait_for(lambda pid=pid: (_lock_holder(url) or pid) != pid or _left(url) == 0, 30,
                 "the lock taken again", procs.logs, every_s=0.05)
    assert killed >= 2, "drained before the terminations: probe too small"
    wait_for(lambda: _left(url) == 0, 90, "the outbox drained", procs.logs)
    firsts = first_deliveries(settings, topic)
    assert {k: firsts.get(k) for k in KEYS} == {k: list(range(N)) for k in KEYS}, \
        {k: [a for a, b in zip(firsts.get(k, []), range(N), strict=False) if a != b][:10]
         for k in KEYS}
    rec = query(url, "SELECT count(*) AS n, count(DISTINCT id) AS d FROM outbox_published")[0]
    assert rec["n"] == rec["d"] == total, rec
    assert all(r.popen.poll() is None for r in relays), procs.logs()
    assert "Traceback" not in "".join(r.log_text() for r in relays), procs.logs()
