"""A relay frozen (SIGSTOP) while it drains a backlog, with its read-ahead fetch sent
(outbox_relay/relay.py ``_read_ahead``: psycopg pipeline mode, the next batch's query sent
before this batch is produced) and not yet taken, and a standby waiting for the relay lock.

A query sent in pipeline mode and not followed by a Sync leaves the backend ``active``
(ClientRead), not idle: neither ``idle_session_timeout`` nor
``idle_in_transaction_session_timeout`` (the relay lock session's bound,
``relay_lock_timeout_s``) applies, so the frozen relay would keep its advisory lock (and a
snapshot, holding back vacuum's horizon) for as long as it is frozen, and the standby would
never take over. The standby must take over within the bound and publish the whole backlog;
on SIGCONT the old relay must step down; each key's events first reach Kafka in outbox order;
every row ends with one ``outbox_published`` record.

Breaker10 (``big-rows``): the same with rows of 60 kB, so the read-ahead's answer (100 rows,
6 MB) is more than the loopback socket buffers hold: the frozen relay's backend is left
``active`` in ``ClientWrite`` (sending an answer nobody reads), where no idle timeout applies,
nor ``statement_timeout``. BROKE on main (e0e52a3): the standby never got the lock while the
relay was frozen (2 runs of 2). Fixed: the lock session also sets ``tcp_user_timeout``
(``relay_lock_session_timeout``), so Postgres ends it once its answer stays unacknowledged
for ``relay_lock_timeout_s``.
"""

from __future__ import annotations

import os
import signal

import pytest

from jobstream.settings import Settings
from tests.helpers import (
    ProcessRunner,
    first_deliveries,
    insert_keyed_rows,
    query,
    wait_for,
)

pytestmark = pytest.mark.e2e

KEYS = [f"job-{i}" for i in range(4)]


def _sessions(url: str) -> str:
    """The relay database's other sessions (state, wait event, query): the failure message."""
    rows = query(url, "SELECT pid, state, wait_event, left(query, 60) AS q FROM pg_stat_activity"
                      " WHERE datname = current_database() AND pid <> pg_backend_pid()")
    return "\n".join(str(r) for r in rows)


@pytest.mark.parametrize(("N", "pad_bytes"), [
    pytest.param(500, 0, id="small-rows"),  # rows per key: 20 batches of 100
    pytest.param(100, 60_000, id="big-rows")])  # 4 batches of 6 MB
def test_a_relay_frozen_with_its_read_ahead_sent_hands_over_to_the_standby(
        settings: Settings, procs: ProcessRunner, N: int, pad_bytes: int) -> None:
    url, topic = settings.database_url, settings.topic("job.failed")
    insert_keyed_rows(url, topic, KEYS, N, pad_bytes=pad_bytes)
    env = {"JOBSTREAM_RELAY_BATCH_SIZE": "100", "JOBSTREAM_RELAY_MAX_IN_FLIGHT": "200",
           "JOBSTREAM_RELAY_LOCK_TIMEOUT_S": "3"}
    # The third mark of the drain: a draining fetch's read-ahead is out (the fault point runs
    # in mark(), before the next _fetch takes it).
    frozen = procs.start("relay", name="relay-frozen",
                         JOBSTREAM_FAULT="relay_after_produce_before_mark@3=stop", **env)
    try:
        wait_for(lambda: "SIGSTOP" in frozen.log_text(), 60,
                 "the active relay to freeze mid-backlog", procs.logs)
        left = int(query(url, "SELECT count(*) AS n FROM outbox")[0]["n"])
        assert 0 < left < N * len(KEYS), left
        ahead = query(url, "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = "
                           "current_database() AND state = 'active' AND query LIKE "
                           "'%%FROM outbox%%' AND pid <> pg_backend_pid()")[0]["n"]
        standby = procs.start("relay", name="relay-standby", **env)
        wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 30,
                 f"the standby to take over and drain while the active relay is frozen "
                 f"(frozen with {ahead} read-ahead fetch(es) active; sessions now:\n"
                 f"{_sessions(url)})", procs.logs)
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    wait_for(lambda: "standing by" in frozen.log_text(), 60,
             "the resumed relay to step down", procs.logs)
    firsts = first_deliveries(settings, topic)
    assert {k: firsts.get(k) for k in KEYS} == {k: list(range(N)) for k in KEYS}
    rec = query(url, "SELECT count(*) AS n, count(DISTINCT id) AS d FROM outbox_published")[0]
    assert rec["n"] == rec["d"] == N * len(KEYS), rec
    assert standby.popen.poll() is None and frozen.popen.poll() is None, procs.logs()
    assert "Traceback" not in standby.log_text() + frozen.log_text(), procs.logs()
