"""The consumer library's DDL: one ``processed_event`` table (and the ``dead_letter``
fallback), schema and table names configurable, composed with ``psycopg.sql.Identifier``."""

from __future__ import annotations

from pathlib import Path

import psycopg
from psycopg import sql

SQL_FILE = Path(__file__).with_name("sql") / "consumer.sql"


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
