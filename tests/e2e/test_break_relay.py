"""Breaking the pipelined relay from outside (outbox_relay/relay.py), with real relay processes,
Postgres and the broker.

A relay frozen (SIGSTOP, a VM pause) while it is the active one: its advisory lock lives as long
as its Postgres session, and a stopped process keeps its TCP connection open (the kernel still
answers), so without a bound on the lock session's idleness the standby never takes over and
the whole outbox waits for as long as the process is frozen. Frozen here with rows produced
and not yet marked (``relay_after_produce_before_mark=stop``): the standby must publish those
again and everything written meanwhile; on SIGCONT the old relay must step down without
publishing anything new, and every key's events must first reach Kafka in outbox order.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections import defaultdict

import psycopg
import pytest
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.e2e

KEYS = [f"job-{i}" for i in range(4)]


def _insert(url: str, topic: str, rows: list[tuple[str, int]]) -> None:
    """One outbox row per ``(key, sequence number)``, committed together."""
    with psycopg.connect(url) as conn:
        for key, n in rows:
            conn.execute(Q["outbox_insert"], (topic, key, f'{{"k": "{key}", "n": {n}}}'.encode(),
                                              Jsonb({"key": key}), uuid.uuid4(), "test.row"))


def _unpublished(url: str) -> int:
    return int(query(url, "SELECT count(*) AS n FROM outbox WHERE published_at IS NULL")[0]["n"])


def test_a_relay_frozen_with_rows_in_flight_hands_over_to_the_standby(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("job.failed")
    frozen = procs.start("relay", name="relay-frozen", JOBSTREAM_RELAY_LOCK_TIMEOUT_S="3",
                         JOBSTREAM_FAULT="relay_after_produce_before_mark=stop")
    wait_for(lambda: "relay active" in frozen.log_text(), 60, "the first relay to be active",
             procs.logs)
    standby = procs.start("relay", name="relay-standby", JOBSTREAM_RELAY_LOCK_TIMEOUT_S="3")
    wait_for(lambda: "standing by" in standby.log_text(), 60, "the second relay to stand by",
             procs.logs)
    try:
        _insert(url, topic, [(k, 0) for k in KEYS])  # produced, then the relay freezes
        wait_for(lambda: "SIGSTOP" in frozen.log_text(), 60,
                 "the active relay to freeze with its rows produced and not marked", procs.logs)
        _insert(url, topic, [(k, 1) for k in KEYS])  # written while it is frozen
        wait_for(lambda: _unpublished(url) == 0, 60,
                 "the standby to take over and publish every row while the active one is "
                 "frozen", procs.logs)
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    wait_for(lambda: frozen.log_text().count("standing by") >= 1, 60,
             "the resumed relay to step down", procs.logs)
    _insert(url, topic, [(k, 2) for k in KEYS])
    wait_for(lambda: _unpublished(url) == 0, 60, "rows written after the resume published",
             procs.logs)
    firsts: dict[str, list[int]] = defaultdict(list)
    copies: dict[tuple[str, int], int] = defaultdict(int)
    for m in read_topic(settings, topic):
        key, n = m.key().decode(), int(m.value().decode().split('"n": ')[1].rstrip("}"))
        copies[(key, n)] += 1
        if copies[(key, n)] == 1:
            firsts[key].append(n)
    # Nothing lost, each key's events first reach Kafka in outbox order; copies (the frozen
    # relay's rows, produced before it froze) are the at-least-once side.
    assert {k: v for k, v in firsts.items()} == {k: [0, 1, 2] for k in KEYS}, firsts
    assert all(copies[(k, n)] <= 2 for k in KEYS for n in (0, 1, 2)), copies
    assert all(copies[(k, n)] == 1 for k in KEYS for n in (1, 2)), copies
    assert standby.popen.poll() is None and frozen.popen.poll() is None, procs.logs()
    assert "Traceback" not in standby.log_text() + frozen.log_text(), procs.logs()
