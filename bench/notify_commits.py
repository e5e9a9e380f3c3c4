"""How many outbox commits per second the writers can reach on this server, with the outbox
trigger's NOTIFY in the writing transaction (as today) or not: what bounds the offered load of
``bench.relay``'s latency runs (issue 12, perf-relay8).

Postgres serialises the commits of every transaction that sent a NOTIFY, server-wide: the
committing backend takes a lock on the notification queue (``pg_stat_activity`` wait event
``Lock:object``) before its commit record and keeps it until the transaction ended, i.e.
through its WAL flush, so those commits cannot share a flush (group commit). Each arm runs
``--writers`` threads, each committing ``--rows-per-tx`` outbox rows per transaction through the
relay's real insert (``outbox_insert``) for ``--seconds``, arms alternated for ``--rounds``:

* ``in``: the outbox trigger as migrated (a NOTIFY in the writing transaction);
* ``after``: what jobstream's writers do since perf-notify9 (migration 0039): the session sets
  ``jobstream.outbox_notify=after_commit`` (the trigger skips its NOTIFY) and after each commit
  wakes the relay with :func:`jobstream.store.wake_relay` (the NOTIFY in a transaction of its
  own with ``synchronous_commit`` off: it waits for no flush, so holds the queue lock for
  microseconds);
* ``none``: the trigger disabled and no NOTIFY (the relay would have to poll): the ceiling.

    python3 -m bench.notify_commits --writers 8 --seconds 5 --rounds 2

Prints JSON: per arm and round the commits and rows per second and the writers' backends'
wait events (sampled every 20 ms from ``pg_stat_activity``, share of samples), and per arm the
median commits per second. The database is the run's own (``bench.common.fresh_database``),
so disabling its trigger touches nothing else.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from collections import Counter
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.common import base_parser, emit, fresh_database, log, machine
from jobstream.db import QUERIES as Q
from jobstream.store import outbox_notify_option, wake_relay

ARMS = ("in", "after", "none")


def _writer(
    url: str, arm: str, rows: int, stop: threading.Event, counts: list[int], i: int
) -> None:
    payload = b'{"k": "v"}' * 60  # ~600 bytes, as bench.relay's rows
    mode = "after_commit" if arm == "after" else "in_transaction"
    with psycopg.connect(url, options=outbox_notify_option(mode)) as conn:
        while not stop.is_set():
            params = [
                (
                    "bench.notify",
                    f"k{i}",
                    payload,
                    Jsonb({"event_id": str(uuid.uuid4())}),
                    uuid.uuid4(),
                    "bench.row",
                )
                for _ in range(rows)
            ]
            with conn.cursor() as cur:
                cur.executemany(Q["outbox_insert"], params)
            conn.commit()
            counts[i] += 1
            if arm == "after":
                wake_relay(conn)


def run_arm(url: str, arm: str, writers: int, rows: int, seconds: float) -> dict[str, Any]:
    """One arm for ``seconds``: commits/s, rows/s and the writers' wait events (% of samples)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE outbox DISABLE TRIGGER outbox_notify_v1"
            if arm == "none"
            else "ALTER TABLE outbox ENABLE TRIGGER outbox_notify_v1"
        )
    stop, counts = threading.Event(), [0] * writers
    threads = [
        threading.Thread(target=_writer, args=(url, arm, rows, stop, counts, i))
        for i in range(writers)
    ]
    for t in threads:
        t.start()
    states: Counter[str] = Counter()
    start = time.monotonic()
    with psycopg.connect(url, autocommit=True) as mon:
        dbname = mon.info.dbname
        while time.monotonic() - start < seconds:
            for wtype, wevent in mon.execute(
                "SELECT coalesce(wait_event_type, 'cpu'), coalesce(wait_event, '') "
                "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend'",
                (dbname,),
            ).fetchall():
                states[f"{wtype}:{wevent}"] += 1
            time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - start
    total = sum(states.values()) or 1
    commits = sum(counts)
    return {
        "arm": arm,
        "commits_per_s": round(commits / elapsed),
        "rows_per_s": round(commits * rows / elapsed),
        "writer_states_pct": {k: round(100 * v / total, 1) for k, v in states.most_common(6)},
        "loadavg": [round(x, 1) for x in os.getloadavg()],
    }


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--writers", type=int, default=8, help="writer threads (connections)")
    p.add_argument("--rows-per-tx", type=int, default=1, help="outbox rows per commit")
    p.add_argument("--seconds", type=float, default=5.0, help="duration of each arm")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the three arms")
    args = p.parse_args()
    out: dict[str, Any] = {
        "benchmark": "notify_commits",
        "machine": machine(),
        "params": {k: v for k, v in vars(args).items() if k not in ("database_url", "kafka")},
    }
    runs: list[dict[str, Any]] = []
    with fresh_database(args.database_url, "notify") as url:
        for r in range(args.rounds):
            arms = ARMS if r % 2 == 0 else ARMS[::-1]
            for arm in arms:
                res = run_arm(url, arm, args.writers, args.rows_per_tx, args.seconds)
                log(f"round {r + 1} {arm}: {res['commits_per_s']} commits/s")
                runs.append({"round": r + 1, **res})
    out["runs"] = runs
    out["median_commits_per_s"] = {
        arm: statistics.median(x["commits_per_s"] for x in runs if x["arm"] == arm) for arm in ARMS
    }
    emit(out)


if __name__ == "__main__":
    main()
