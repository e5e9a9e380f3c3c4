"""perf-relay6's gap probing (outbox_relay/relay.py ``_gaps``, ``MAX_GAP_PROBES``,
``MAX_GAPS``) from outside: 30 writer transactions hold outbox ids open (late commits) among
360 ids burnt by rolled-back inserts (more gaps than the relay probes one by one), rows
committed above them (the relay reads past every gap), then, per case, the active relay killed
(SIGKILL) or frozen (SIGSTOP) with a standby taking over, and/or the outbox id sequence jumped
far ahead (``setval``: more ids read past than ``MAX_GAPS``) while the late commits are pending;
then the open transactions commit in random order, each key's next row written after its late
one committed. ``relay_late_commit_s`` 20 s (every late commit lands within it), the full
rescan out of reach (600 s). Real relay processes, Postgres and broker.

Every committed row must reach Kafka, each key's rows first delivered in commit order, one
``outbox_published`` record per row, nothing left in the outbox.
"""

from __future__ import annotations

import os
import random
import signal
import uuid

import psycopg
import pytest
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, first_deliveries, query, wait_for

pytestmark = pytest.mark.e2e

OPEN = 30  # open transactions; 12 burnt ids after each: 360 gaps > 256 (the range is read),
# 4 after each: 120 gaps (probed one by one)


def _row(conn: psycopg.Connection[object], topic: str, key: str, n: int) -> None:
    conn.execute(Q["outbox_insert"], (topic, key, f'{{"k": "{key}", "n": {n}}}'.encode(),
                                      Jsonb({"key": key}), uuid.uuid4(), "test.row"))


def _burn(conn: psycopg.Connection[object], topic: str, n: int) -> None:
    """Take ``n`` outbox ids in a transaction that rolls back (gaps that never commit)."""
    with conn.transaction(force_rollback=True), conn.cursor() as cur:
        cur.executemany(Q["outbox_insert"], [(topic, "burnt", b'{"rolled": "back"}',
                                              Jsonb({"key": "burnt"}), uuid.uuid4(),
                                              "test.row") for _ in range(n)])


@pytest.mark.parametrize("kill,jump,burnt,batch", [
    (signal.SIGSTOP, True, 12, 500), (None, True, 12, 500), (signal.SIGKILL, False, 4, 500),
    (signal.SIGSTOP, True, 4, 7), (None, True, 4, 7)],
    ids=["sigstop-jump-range", "jump-range", "sigkill-probed", "sigstop-jump-probed-draining",
         "jump-probed-draining"])
def test_late_commits_among_many_gaps_survive_takeover_and_sequence_jump(
        settings: Settings, procs: ProcessRunner, kill: signal.Signals | None,
        jump: bool, burnt: int, batch: int) -> None:
    url, topic = settings.database_url, settings.topic("job.failed")
    env = {"JOBSTREAM_RELAY_LATE_COMMIT_S": "20", "JOBSTREAM_RELAY_FULL_RESCAN_S": "600",
           "JOBSTREAM_RELAY_LOCK_TIMEOUT_S": "3", "JOBSTREAM_RELAY_BATCH_SIZE": str(batch)}
    first = procs.start("relay", name="relay-first", **env)
    wait_for(lambda: "relay active" in first.log_text(), 60, "the relay to be active",
             procs.logs)
    standby = None
    if kill is not None:
        standby = procs.start("relay", name="relay-standby", **env)
        wait_for(lambda: "standing by" in standby.log_text(), 60, "the standby", procs.logs)
    keys = [f"k{j}" for j in range(OPEN)]
    rnd = random.Random(8)
    opened: list[psycopg.Connection[object]] = []
    try:
        with psycopg.connect(url, autocommit=True) as other:
            for k in keys:
                _row(other, topic, k, 0)
            for k in keys:
                late = psycopg.connect(url)
                opened.append(late)
                _row(late, topic, k, 1)  # its id taken, committed late
                _burn(other, topic, burnt)
            for i in range(20):
                _row(other, topic, "busy", i)  # above every gap: the relay reads past them
            wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE kafka_key = 'busy'"),
                     30, "the rows above the gaps published", procs.logs)
            if kill is not None:
                assert standby is not None
                os.kill(first.popen.pid, kill)
                wait_for(lambda: "relay active" in standby.log_text(), 30,
                         "the standby to take over", procs.logs)
            if jump:
                other.execute("SELECT setval(s, nextval(s) + 5000000) FROM "
                              "pg_get_serial_sequence('outbox', 'id') AS s")
                for i in range(20):
                    _row(other, topic, "jumped", i)
                wait_for(lambda: not query(url, "SELECT 1 FROM outbox "
                                                "WHERE kafka_key = 'jumped'"),
                         30, "the rows after the jump published", procs.logs)
            order = list(range(OPEN))
            rnd.shuffle(order)
            for j in order:  # out of order, all within relay_late_commit_s
                opened[j].commit()
                _row(other, topic, keys[j], 2)
            wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 40,
                     "every late row published (the full rescan is 600 s away)",
                     lambda: str(query(url, "SELECT id, kafka_key FROM outbox ORDER BY id "
                                            "LIMIT 40")) + procs.logs())
    finally:
        for c in opened:
            c.close()
        if kill == signal.SIGSTOP:
            os.kill(first.popen.pid, signal.SIGCONT)
    firsts = first_deliveries(settings, topic)
    assert {k: firsts.get(k) for k in keys} == {k: [0, 1, 2] for k in keys}, firsts
    assert firsts.get("busy") == list(range(20))
    total = 3 * OPEN + 20 + (20 if jump else 0)
    if jump:
        assert firsts.get("jumped") == list(range(20))
    assert "burnt" not in firsts
    rec = query(url, "SELECT count(*) AS n, count(DISTINCT id) AS d FROM outbox_published")[0]
    assert rec["n"] == rec["d"] == total, rec
