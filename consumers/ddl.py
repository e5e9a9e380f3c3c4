"""The consumer library's DDL: one ``processed_event`` table (and the ``dead_letter``
fallback), schema and table names configurable, composed with ``psycopg.sql.Identifier``.

``processed_event``'s primary key is ``key_digest`` (:func:`key_digest`), a 16-byte digest of
``(consumer_group, event_type, dedup_key)``; tables created before it (primary key on the
three text columns) still work and are converted by :func:`upgrade_tables`."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

SQL_FILE = Path(__file__).with_name("sql") / "consumer.sql"
UPGRADE_FILE = Path(__file__).with_name("sql") / "upgrade_key_digest.sql"

#: SQL expression of :func:`key_digest` over a row's columns (for an operator's lookup:
#: ``WHERE key_digest = substr(sha256(...), 1, 16)`` with the three values in place).
KEY_DIGEST_SQL = ("substr(sha256(convert_to(consumer_group, 'UTF8') || '\\x00'::bytea || "
                  "convert_to(event_type, 'UTF8') || '\\x00'::bytea || "
                  "convert_to(dedup_key, 'UTF8')), 1, 16)")


def key_digest(group: str, event_type: str, dedup_key: str) -> bytes:
    """The ``processed_event`` primary key of ``(group, event_type, dedup_key)``: the first 16
    bytes of ``sha256(group || 0x00 || event_type || 0x00 || dedup_key)`` over UTF-8 (a NUL
    cannot occur in Postgres text, so the join is unambiguous). Raises
    ``UnicodeEncodeError`` for a string that is not valid Unicode (a lone surrogate).

    Examples
    --------
    >>> key_digest("billing", "job.ready", "ab" * 32).hex()[:8]
    '64f97de5'
    """
    return hashlib.sha256(b"\0".join((group.encode(), event_type.encode(),
                                       dedup_key.encode()))).digest()[:16]


def ddl(schema: str = "public", table: str = "processed_event",
        dead_letter_table: str = "dead_letter") -> sql.Composed:
    """The DDL of ``consumers/sql/consumer.sql`` with its identifiers filled in.

    Parameters
    ----------
    schema : str
        Schema holding both tables (created if missing).
    table : str
        Name of the idempotent-consumer table.
    dead_letter_table : str
        Name of the dead-letter fallback table.

    Returns
    -------
    psycopg.sql.Composed
        Statements to execute (idempotent: ``IF NOT EXISTS`` everywhere).

    Examples
    --------
    >>> q = ddl("billing")
    >>> "CREATE TABLE IF NOT EXISTS" in q.as_string(None)  # doctest: +SKIP
    True
    """
    ident = sql.Identifier
    return sql.SQL(SQL_FILE.read_text()).format(
        schema=ident(schema), processed=ident(schema, table),
        processed_at_idx=ident(f"{table}_processed_at"), event_id_idx=ident(f"{table}_event_id"),
        dead_letter=ident(schema, dead_letter_table),
        dl_position_idx=ident(f"{dead_letter_table}_position"),
        dl_outbox_idx=ident(f"{dead_letter_table}_outbox"),
        dl_topic_idx=ident(f"{dead_letter_table}_topic"))


def create_tables(conn: psycopg.Connection, schema: str = "public",
                  table: str = "processed_event", dead_letter_table: str = "dead_letter") -> None:
    """Create the library's tables in ``conn``'s database (in one transaction).

    Raises
    ------
    psycopg.Error
        The database refused the DDL (e.g. no ``CREATE`` privilege on the schema).

    Examples
    --------
    >>> with psycopg.connect(dsn) as conn:  # doctest: +SKIP
    ...     create_tables(conn, schema="billing")
    """
    with conn.transaction():
        conn.execute(ddl(schema, table, dead_letter_table))


def upgrade_tables(conn: psycopg.Connection, schema: str = "public",
                   table: str = "processed_event") -> None:
    """Convert a ``processed_event`` table of the first shape (primary key ``(consumer_group,
    dedup_key, event_type)``) to the ``key_digest`` shape (``consumers/sql/
    upgrade_key_digest.sql``), in one transaction; a table already converted is left alone.

    It locks the table (ACCESS EXCLUSIVE) and rewrites it: stop the table's consumers first
    (a consumer that was running keeps its old statements until it reconnects). Every row is
    kept, so a copy of an event applied before the upgrade is still a duplicate after it.
    ``schema=""``: the unqualified name (found on the search path).

    Raises
    ------
    psycopg.Error
        The table does not exist (``UndefinedTable``), or the database refused the change.

    Examples
    --------
    >>> with psycopg.connect(dsn) as conn:  # doctest: +SKIP
    ...     upgrade_tables(conn, schema="billing")
    """
    ident = sql.Identifier(schema, table) if schema else sql.Identifier(table)
    with conn.transaction():
        conn.execute(sql.SQL(UPGRADE_FILE.read_text()).format(
            processed=ident, processed_name=sql.Literal(ident.as_string(conn)),
            pkey_idx=sql.Identifier(f"{table}_key_digest")))


def has_key_digest(conn: psycopg.Connection[Any], table: sql.Composable) -> bool:
    """Whether ``table`` (an identifier) has the ``key_digest`` primary key column (the current
    shape) rather than the first shape; False when it does not exist. Runs one catalog query
    in ``conn``'s current transaction (the caller commits or rolls back)."""
    row = conn.cursor(row_factory=tuple_row).execute(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) "
        "AND attname = 'key_digest' AND NOT attisdropped)",
        (table.as_string(conn),)).fetchone()
    return bool(row and row[0])
