"""The relay's caught-up fetch (``outbox_delete_and_fetch``): what Postgres reads below the
last id, by the range from the floor (before issue 12's sixth relay pass) or by probing the ids
the relay read past (its gaps), under EXPLAIN (ANALYZE, BUFFERS).

Each round writes ``--dead`` outbox rows and deletes them (what the relay did with the rows it
published in the last ``relay_late_commit_s``), leaves ``--gaps`` ids below the last id
unpublished or rolled back, and runs the statement once in each mode, alternating which goes
first. ``--in-flight N`` leaves the N newest rows below the last id undeleted (produced, not
yet acknowledged): the range read skips them by the array of ids the relay sends with it
(up to ``relay_max_in_flight``, 5,000); a look that probes its gaps sends none.
``full_range`` / ``full_probes``: the full rescan (every ``relay_full_rescan_s``) before and
since perf-relay7: the range from id 0, or the range up to ``_gap_base`` (0 here) and every
gap the relay knows probed (docs/design-notes.md, "The full rescan probes the old gaps").
``--hold-snapshot`` keeps a REPEATABLE READ transaction open in the same database
(another backend's snapshot, as a busy pipeline always has one): the deleted rows' index
entries cannot be marked dead by the scan then, and every look walks them again.

    python3 -m bench.relay_fetch --dead 3500 --rounds 5 [--in-flight 5000] [--hold-snapshot]

Prints JSON: per mode, the shared blocks (hit + read), the execution and planning times (ms)
of each round, and their medians.
"""

from __future__ import annotations

import json
import os
import statistics
from datetime import UTC, datetime
from typing import Any

import psycopg

from bench.common import base_parser, emit, fresh_database, log, machine
from jobstream.db import QUERIES as Q

INSERT = ("INSERT INTO outbox (topic, kafka_key, payload, headers, event_id, event_type) "
          "SELECT 'bench.t', 'k' || g, convert_to(repeat('x', 600), 'UTF8'), '{}'::jsonb, "
          "gen_random_uuid(), 'job.text_extracted' FROM generate_series(1, %s) g "
          "RETURNING id")


def _explain(conn: psycopg.Connection[Any], params: dict[str, Any]) -> dict[str, float]:
    with conn.cursor(binary=True) as cur:  # as the relay sends it
        plan = cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                           + Q["outbox_delete_and_fetch"], params).fetchone()
    assert plan is not None
    top = plan[0][0]
    node = top["Plan"]
    return {"blocks": node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0),
            "ms": round(top["Execution Time"], 3), "planning_ms": round(top["Planning Time"], 3)}


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--dead", type=int, default=3500,
                   help="rows deleted below the last id per round (700 rows/s for 5 s)")
    p.add_argument("--gaps", type=int, default=3, help="ids read past below the last id")
    p.add_argument("--in-flight", type=int, default=0,
                   help="rows below the last id still in flight (not deleted): the range "
                        "read skips them by the skip array the relay sends; probing sends none")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hold-snapshot", action="store_true",
                   help="keep another backend's snapshot open in the same database")
    args = p.parse_args()
    result: dict[str, Any] = {"benchmark": "relay_fetch", "machine": machine(),
                              "params": {k: v for k, v in vars(args).items()
                                         if k not in ("database_url", "plot")}}
    runs: dict[str, list[dict[str, float]]] = {"range": [], "gaps": [], "full_range": [],
                                               "full_probes": []}
    with fresh_database(args.database_url, "relayfetch") as url, \
            psycopg.connect(url, autocommit=True) as conn, \
            psycopg.connect(url, autocommit=True) as other:
        # The run's own vacuum would clean the range between rounds; autovacuum's timing is
        # what the relay cannot count on (5,000 dead rows at the earliest, migration 0014).
        conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
        if args.hold_snapshot:
            other.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            other.execute("SELECT 1 FROM outbox LIMIT 1")
        for rnd in range(args.rounds):
            n = args.dead + args.gaps + args.in_flight
            ids = [r[0] for r in conn.execute(INSERT, (n,)).fetchall()]
            floor, hwm = ids[0] - 1, ids[-1]
            below = ids[: len(ids) - args.in_flight]
            flying = ids[len(below):]  # the newest rows: produced, not yet acknowledged
            gaps = below[:: max(1, len(below) // max(1, args.gaps))][: args.gaps]
            conn.execute("DELETE FROM outbox WHERE id = ANY(%s) AND id <> ALL(%s)",
                         (below, gaps))
            conn.execute("INSERT INTO outbox (topic, kafka_key, payload, headers, event_id, "
                         "event_type) VALUES ('bench.t', 'k', '\\x00', '{}', "
                         "gen_random_uuid(), 'job.text_extracted')")  # a new row after hwm
            common = {"ids": [], "at": datetime.now(UTC), "log": True, "hwm": hwm, "n": 500,
                      "upto": hwm}
            # full_range: the full rescan (every relay_full_rescan_s) before perf-relay7, the
            # range from id 0; full_probes: since, the range up to _gap_base (0 here: the
            # relay's session started below these rows) and every gap known probed.
            modes = {"range": {**common, "floor": floor, "gaps": [], "skip": flying},
                     "gaps": {**common, "floor": hwm, "gaps": gaps, "skip": []},
                     "full_range": {**common, "floor": 0, "gaps": [], "skip": flying},
                     "full_probes": {**common, "floor": 0, "upto": 0, "gaps": gaps,
                                     "skip": flying}}
            order = list(modes) if rnd % 2 == 0 else list(reversed(modes))
            for mode in order:
                runs[mode].append(_explain(conn, modes[mode]))
            conn.execute("DELETE FROM outbox WHERE id = ANY(%s)", (gaps + flying,))
        if args.hold_snapshot:
            other.execute("ROLLBACK")
    for mode, rs in runs.items():
        result[mode] = {"rounds": rs,
                        "median_blocks": statistics.median(r["blocks"] for r in rs),
                        "median_ms": statistics.median(r["ms"] for r in rs),
                        "median_planning_ms": statistics.median(r["planning_ms"] for r in rs)}
    result["machine"]["loadavg_after"] = list(os.getloadavg())
    emit(result)
    log("median (blocks, ms): " + json.dumps(
        {m: (result[m]["median_blocks"], result[m]["median_ms"]) for m in runs}))


if __name__ == "__main__":
    main()
