"""Database access: the named-query registry, connections, and ordered SQL migrations.

Every SQL statement lives in ``jobstream/sql/queries.sql`` under a ``-- name: <name>`` header and
is looked up as ``QUERIES["<name>"]`` (parametrised with psycopg placeholders; never
string-formatted). Migrations are numbered plain ``.sql`` files in ``jobstream/migrations``;
``migrate()`` applies the missing ones in order, all in ONE transaction (all or none) under an
advisory transaction lock, so concurrent callers are safe.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import psycopg
from psycopg.rows import DictRow, dict_row

_MIGRATIONS = Path(__file__).parent / "migrations"
_MIGRATE_LOCK_ID = 0x6A6F6273  # "jobs": pg_advisory_lock key serialising migrate()

#: A connection whose rows are dicts (column name -> value), as every jobstream connection is.
Conn = psycopg.Connection[DictRow]


def _load_queries() -> dict[str, str]:
    text = resources.files("jobstream").joinpath("sql/queries.sql").read_text()
    queries: dict[str, str] = {}
    for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith("--")]
        queries[name.strip()] = "\n".join(lines).strip().rstrip(";")
    return queries


QUERIES: dict[str, str] = _load_queries()


def connect(url: str, *, autocommit: bool = False) -> Conn:
    """Open one connection with dict rows. Raises ``psycopg.OperationalError`` if unreachable."""
    return psycopg.connect(url, autocommit=autocommit, row_factory=dict_row, connect_timeout=10)


def migration_files() -> list[tuple[int, str, str]]:
    """``(version, name, sql)`` for every migration file, in version order."""
    out = []
    for path in sorted(_MIGRATIONS.glob("*.sql")):
        version = int(path.name.split("_", 1)[0])
        out.append((version, path.name, path.read_text()))
    return out


def migrate(url: str) -> list[str]:
    """Apply missing migrations; returns the names applied (empty when up to date).

    Idempotent and safe to run concurrently (pg_advisory_xact_lock serialises callers). All
    missing migrations run in one transaction: a failing file leaves the schema as it was.
    """
    applied: list[str] = []
    with connect(url) as conn, conn.transaction():
        conn.execute(QUERIES["migrate_lock"], (_MIGRATE_LOCK_ID,))
        conn.execute(QUERIES["create_migration_table"])
        done = {r["version"] for r in conn.execute(QUERIES["applied_migrations"])}
        for version, name, sql in migration_files():
            if version in done:
                continue
            conn.execute(sql)  # a trusted file of this package, not user input
            conn.execute(QUERIES["record_migration"], (version, name))
            applied.append(name)
    return applied
