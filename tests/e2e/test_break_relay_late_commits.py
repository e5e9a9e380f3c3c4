"""A caught-up relay under writers whose transactions commit late (up to 1.5 s after taking
their outbox id, within ``relay_late_commit_s`` 4 s) or roll back, and once a burst of 300
rolled-back ids (more gaps than the relay probes one by one; later gaps few enough to probe),
with the full rescan out of reach (600 s): the look below the relay's last id alone (the
floor's range, or the ids it read past: its gaps) must find every late row. Real relay
process, Postgres and broker.

Every committed row reaches Kafka, each key's rows first in commit order (a writer's next row
is written after its previous one committed), one ``outbox_published`` record per row, no row
of a rolled-back transaction, nothing left in the outbox.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import psycopg
import pytest
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, first_deliveries, query, wait_for

pytestmark = pytest.mark.e2e

WRITERS, SECONDS = 6, 6.0


class _Rollback(Exception):
    """Raised inside a writer's transaction to roll it back."""


def _writer(url: str, topic: str, key: str, seed: int, committed: list[int],
            errors: list[BaseException]) -> None:
    """Write rows ``{"k": key, "n": i}`` one transaction each for SECONDS: a fifth roll back,
    half commit up to 1.5 s after their insert; writer 0's third writes 300 more rows and
    rolls back once; ``committed``: the n of each committed row, in commit order."""
    rnd, n, burst = random.Random(seed), 0, seed == 0
    deadline = time.monotonic() + SECONDS
    try:
        with psycopg.connect(url) as conn:
            while time.monotonic() < deadline:
                fate = rnd.random()
                try:
                    with conn.transaction():
                        conn.execute(Q["outbox_insert"], (
                            topic, key, f'{{"k": "{key}", "n": {n}}}'.encode(),
                            Jsonb({"key": key}), uuid.uuid4(), "test.row"))
                        if fate < 0.5:
                            time.sleep(rnd.uniform(0.05, 1.5))  # a late commit
                        if burst and n == 2:
                            with conn.cursor() as cur:  # a burst of ids never committed
                                cur.executemany(Q["outbox_insert"], [(
                                    topic, key, b'{"rolled": "back"}', Jsonb({"key": key}),
                                    uuid.uuid4(), "test.row") for _ in range(300)])
                        if burst and n == 2:
                            burst = False
                            raise _Rollback
                        if fate > 0.8:
                            raise _Rollback
                except _Rollback:
                    continue
                committed.append(n)
                n += 1
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_late_commits_and_rollback_gaps_under_a_caught_up_relay_are_all_published_in_order(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("job.failed")
    relay = procs.start("relay", name="relay", JOBSTREAM_RELAY_LATE_COMMIT_S="4",
                        JOBSTREAM_RELAY_FULL_RESCAN_S="600", JOBSTREAM_RELAY_BATCH_SIZE="50")
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the relay to be active",
             procs.logs)
    keys = [f"w{i}" for i in range(WRITERS)]
    committed: dict[str, list[int]] = {k: [] for k in keys}
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_writer, args=(url, topic, k, i, committed[k], errors))
               for i, k in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    total = sum(len(v) for v in committed.values())
    assert total > 20, committed  # enough rows to mean something
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 30,
             "every committed row published (the full rescan is 600 s away)",
             lambda: str(query(url, "SELECT id, kafka_key, now() - created_at AS age "
                                    "FROM outbox ORDER BY id LIMIT 20")) + procs.logs())
    firsts = first_deliveries(settings, topic)
    assert {k: firsts.get(k, []) for k in keys} == committed
    rec = query(url, "SELECT count(*) AS n, count(DISTINCT id) AS d FROM outbox_published")[0]
    assert rec["n"] == rec["d"] == total, rec
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text(), procs.logs()
