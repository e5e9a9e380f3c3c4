"""Postgres side of the ready applier's idempotent apply, statement by statement, without Kafka.

Batches of ``--batch`` ``job.ready`` events (``bench.consumer.ready_event``; their rows and
digests prepared beforehand, as the decode-ahead thread does) are applied the way
``IdempotentConsumer.process_batch`` + ``apply_ready_rows`` apply them: in one transaction the
``processed_event`` insert (``RECORD_PROCESSED_BATCH_DIGEST``, the library's table in schema
``consumer_bench``), the prepared ``INSERT ... SELECT * FROM unnest($1::...row[])`` of the
analysis rows and of the charges (one binary array parameter each, migration 0035; binary
``COPY`` before consumer6), commit. For each statement: the Postgres backend's CPU per event
(``/proc``), the WAL bytes per event (``pg_current_wal_lsn()`` before and after:
server-wide, so other sessions' writes count too on a shared server), and wall time.
``--variants`` compares the tables as the migrations make them (``base``: migration 0031's
hash indexes) with ``btree_0002`` (the effect indexes before 0031) and other shapes
(:data:`VARIANTS`). Also prints ``EXPLAIN (ANALYZE, BUFFERS, WAL)`` of one dedup insert and
of two column-array ``INSERT ... SELECT``s of the same effects for the last batch.

Prints one JSON object on stdout.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from bench.common import base_parser, emit, isolated, log, machine
from bench.consumer import BENCH_SCHEMA, backend_cpu_s, ready_event
from consumers.ddl import create_tables, key_digest
from consumers.idempotent import RECORD_PROCESSED_BATCH_DIGEST
from jobstream.db import QUERIES as Q
from jobstream.ready_applier import _array, _row_types, copy_rows

GROUP = "bench-pg"
#: Table changes compared with ``--variants`` (each applied after :data:`RESET`): ``base`` is
#: the tables as the migrations make them (0031: hash indexes on the effects' dedup_key),
#: ``btree_0002`` the effect indexes before migration 0031.
VARIANTS: dict[str, list[str]] = {
    "base": [],
    "btree_0002": [
        "DROP INDEX downstream.document_analysis_dedup",
        "DROP INDEX downstream.ledger_charge_dedup",
        "CREATE INDEX document_analysis_dedup ON downstream.document_analysis"
        " (tenant_id, dedup_key)",
        "CREATE INDEX ledger_charge_dedup ON downstream.ledger_charge (tenant_id, dedup_key)"],
    "seq_cache": [
        "ALTER SEQUENCE downstream.document_analysis_id_seq CACHE 1000",
        "ALTER SEQUENCE downstream.ledger_charge_id_seq CACHE 1000"],
    "no_effect_dedup_idx": [
        "DROP INDEX downstream.document_analysis_dedup",
        "DROP INDEX downstream.ledger_charge_dedup"],
    "no_processed_at_idx": [f"DROP INDEX {BENCH_SCHEMA}.processed_event_processed_at"],
}
#: Run before each variant: the tables as the migrations and the library's DDL make them.
RESET = [
    "ALTER SEQUENCE downstream.document_analysis_id_seq CACHE 1",
    "ALTER SEQUENCE downstream.ledger_charge_id_seq CACHE 1",
    "DROP INDEX IF EXISTS downstream.document_analysis_dedup",
    "DROP INDEX IF EXISTS downstream.ledger_charge_dedup",
    "CREATE INDEX document_analysis_dedup ON downstream.document_analysis USING hash (dedup_key)",
    "CREATE INDEX ledger_charge_dedup ON downstream.ledger_charge USING hash (dedup_key)",
]


def lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def run_variant(url: str, name: str, batches: list[list[Any]]) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE downstream.document_analysis, downstream.ledger_charge")
        conn.execute(f"DROP SCHEMA IF EXISTS {BENCH_SCHEMA} CASCADE")
        create_tables(conn, BENCH_SCHEMA)
        for stmt in RESET + VARIANTS[name]:
            conn.execute(stmt)
    table = sql.Identifier(BENCH_SCHEMA, "processed_event")
    dedup_q = sql.SQL(RECORD_PROCESSED_BATCH_DIGEST).format(table=table)
    cpu = {"dedup_insert": 0.0, "insert_analysis": 0.0, "insert_charge": 0.0, "commit": 0.0}
    wal = dict.fromkeys(cpu, 0)
    wall = dict.fromkeys(cpu, 0.0)
    n = 0
    with psycopg.connect(url, row_factory=tuple_row) as conn:
        pid = conn.info.backend_pid

        def step(label: str, fn: Any, *args: Any) -> None:
            c0, w0, t0 = backend_cpu_s(pid), lsn(conn), time.perf_counter()
            fn(*args)
            t1 = time.perf_counter()
            c1, w1 = backend_cpu_s(pid), lsn(conn)
            wall[label] += t1 - t0
            wal[label] += w1 - w0
            if c0 is not None and c1 is not None:
                cpu[label] += c1 - c0

        def dedup(evs: list[Any], digests: list[bytes]) -> None:
            conn.cursor().execute(dedup_q, (
                GROUP, digests, [e.dedup_key for e in evs], [e.event_type for e in evs],
                [e.event_id for e in evs], [e.job_id for e in evs]), binary=True,
                prepare=True).fetchall()

        def insert(query: str, oid: int, data: list[bytes]) -> None:
            # as jobstream.ready_applier.apply_ready_rows: one binary array, prepared
            conn.execute(query, (_array(oid, data),), prepare=True)

        analysis_oid, charge_oid = _row_types(conn)
        conn.commit()

        for batch in batches:
            conn.execute("BEGIN")
            step("dedup_insert", dedup, [ev for ev, _, _ in batch], [d for _, _, d in batch])
            step("insert_analysis", insert, Q["apply_analysis_rows"], analysis_oid,
                 [r[0] for _, r, _ in batch])
            step("insert_charge", insert, Q["apply_charge_rows"], charge_oid,
                 [r[1] for _, r, _ in batch])
            step("commit", conn.commit)
            n += len(batch)
        sizes = conn.execute(
            "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c "
            "JOIN pg_namespace s ON s.oid = c.relnamespace "
            "WHERE s.nspname IN ('downstream', %s) AND c.relkind IN ('r', 'i') ORDER BY 1",
            (BENCH_SCHEMA,)).fetchall()
    return {"events": n,
            "postgres_cpu_us_per_event": {k: round(v / n * 1e6, 2) for k, v in cpu.items()}
            | {"total": round(sum(cpu.values()) / n * 1e6, 2)},
            "wal_bytes_per_event": {k: round(v / n) for k, v in wal.items()}
            | {"total": round(sum(wal.values()) / n)},
            "wall_us_per_event": {k: round(v / n * 1e6, 2) for k, v in wall.items()}
            | {"total": round(sum(wall.values()) / n * 1e6, 2)},
            "relation_bytes_per_event": {r: round(b / n) for r, b in sizes}}


def explain(url: str, batch: list[Any]) -> dict[str, str]:
    """EXPLAIN (ANALYZE, BUFFERS, WAL) of the dedup insert and of column-array INSERT ... SELECT
    versions of the two effect inserts, for one batch (rolled back)."""
    evs = [ev for ev, _, _ in batch]
    digests = [d for _, _, d in batch]
    table = sql.Identifier(BENCH_SCHEMA, "processed_event")
    out: dict[str, str] = {}
    with psycopg.connect(url, row_factory=tuple_row) as conn:
        for label, q, params in (
            ("dedup_insert", sql.SQL("EXPLAIN (ANALYZE, BUFFERS, WAL) ")
             + sql.SQL(RECORD_PROCESSED_BATCH_DIGEST).format(table=table),
             (GROUP, digests, [e.dedup_key for e in evs], [e.event_type for e in evs],
              [e.event_id for e in evs], [e.job_id for e in evs])),
            ("analysis_insert", sql.SQL(
                "EXPLAIN (ANALYZE, BUFFERS, WAL) INSERT INTO downstream.document_analysis "
                "(tenant_id, dedup_key, job_id, filename, title, summary, keywords, fields) "
                "SELECT t, d, j, f, ti, s, ARRAY['license','program','software','copyright',"
                "'distribute','source','code','work','terms','modify'], "
                "'{\"licence_name\": \"GPL\", \"version\": \"2\", \"years\": [\"1989\", "
                "\"1991\"]}'::jsonb FROM unnest(%s::text[], %s::text[], %s::uuid[], "
                "%s::text[], %s::text[], %s::text[]) AS u(t, d, j, f, ti, s)"),
             ([e.tenant_id for e in evs], [e.dedup_key for e in evs], [e.job_id for e in evs],
              [e.payload.filename for e in evs], [e.payload.result.title for e in evs],
              [e.payload.result.summary for e in evs])),
            ("charge_insert", sql.SQL(
                "EXPLAIN (ANALYZE, BUFFERS, WAL) INSERT INTO downstream.ledger_charge "
                "(tenant_id, dedup_key, job_id, amount_usd) SELECT t, d, j, 0.01 "
                "FROM unnest(%s::text[], %s::text[], %s::uuid[]) AS u(t, d, j)"),
             ([e.tenant_id for e in evs], [e.dedup_key for e in evs],
              [e.job_id for e in evs])),
        ):
            rows = conn.execute(q, params).fetchall()
            out[label] = "\n".join(r[0] for r in rows)
        conn.rollback()
    return out


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--n", type=float, default=2e4, help="events per variant")
    p.add_argument("--batch", type=int, default=2000, help="events per transaction")
    p.add_argument("--variants", default="btree_0002,base",
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=2, help="alternate the variants this often")
    args = p.parse_args()
    n = int(args.n)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    events = [ready_event("bench-pg", i) for i in range(n)]
    prepared = [(ev, copy_rows(ev), key_digest(GROUP, ev.event_type, ev.dedup_key))
                for ev in events]
    batches = [prepared[i:i + args.batch] for i in range(0, n, args.batch)]
    result: dict[str, Any] = {"benchmark": "consumer_pg", "machine": machine(),
                              "params": {"n": n, "batch": args.batch, "variants": names,
                                         "rounds": args.rounds}, "runs": []}
    with isolated(args, "cpg") as s:
        for r in range(args.rounds):
            for name in names:
                got = run_variant(s.database_url, name, batches)
                log(f"round {r + 1} {name}: {got['postgres_cpu_us_per_event']['total']} us, "
                    f"{got['wal_bytes_per_event']['total']} WAL bytes per event")
                result["runs"].append({"variant": name, "round": r + 1, **got})
        run_variant(s.database_url, "base", batches[:-1])
        result["explain"] = explain(s.database_url, batches[-1])
    result["machine"]["loadavg_after"] = list(__import__("os").getloadavg())
    emit(result)


if __name__ == "__main__":
    main()
