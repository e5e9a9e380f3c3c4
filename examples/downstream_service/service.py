"""The downstream service: charge a ledger once per ``job.ready``.

Everything it needs is the consumer library (``consumers``) and the event models
(``schemas``); it imports nothing from ``jobstream``. Configuration comes from the
environment, ``JOBSTREAM_CONSUMER_*`` (see :class:`consumers.ConsumerSettings`): the tables
(``processed_event``, ``dead_letter`` and this service's ``ledger``) live in
``JOBSTREAM_CONSUMER_DB_SCHEMA`` (default ``billing`` here).

Examples
--------
>>> settings = ConsumerSettings(group="billing", db_schema="billing")
>>> migrate(settings)            # doctest: +SKIP
>>> build(settings).run_forever()  # doctest: +SKIP
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import psycopg
from psycopg import sql

from consumers import (
    ConsumerSettings,
    IdempotentConsumer,
    PoisonMessage,
    create_tables,
    upgrade_tables,
)
from schemas.events import JobReady

MIGRATIONS = Path(__file__).with_name("migrations")


def settings_from_env() -> ConsumerSettings:
    """:class:`ConsumerSettings` from ``JOBSTREAM_CONSUMER_*``, with this service's defaults
    (group ``billing``, schema ``billing``) where the environment says nothing."""
    import os

    defaults = {"group": "billing", "db_schema": "billing"}
    return ConsumerSettings(**{k: v for k, v in defaults.items()
                               if f"JOBSTREAM_CONSUMER_{k.upper()}" not in os.environ})


def migrate(settings: ConsumerSettings) -> None:
    """Create the library's tables and this service's ledger in ``settings.db_schema``
    (idempotent), and convert a ``processed_event`` table of the library's first shape to the
    ``key_digest`` one (:func:`consumers.upgrade_tables`; a no-op once done). Raises
    ``psycopg.Error``."""
    with psycopg.connect(settings.dsn, connect_timeout=10) as conn:
        create_tables(conn, settings.db_schema, settings.table, settings.dead_letter_table)
        upgrade_tables(conn, settings.db_schema, settings.table)
        with conn.transaction():
            for path in sorted(MIGRATIONS.glob("*.sql")):
                conn.execute(sql.SQL(path.read_text()).format(
                    schema=sql.Identifier(settings.db_schema),
                    ledger=sql.Identifier(settings.db_schema, "ledger")))


def build(settings: ConsumerSettings) -> IdempotentConsumer:
    """The service's consumer: one ledger row per ``job.ready`` (exactly once).

    A ``job.ready`` with a negative charge is refused as poison (``negative_charge``): it goes
    to ``job.ready.dlq`` and the partition moves on.
    """
    consumer = IdempotentConsumer(settings)
    ledger = sql.Identifier(settings.db_schema, "ledger")
    insert = sql.SQL("INSERT INTO {} (tenant_id, dedup_key, job_id, filename, amount_usd) "
                     "VALUES (%s, %s, %s, %s, %s)").format(ledger)

    @consumer.on(JobReady)
    def charge(tx: psycopg.Connection, event: JobReady) -> None:
        amount = Decimal(str(event.payload.charge_usd))
        if amount < 0:
            raise PoisonMessage(f"negative charge {amount} USD", code="negative_charge")
        tx.execute(insert, (event.tenant_id, event.dedup_key, event.job_id,
                            event.payload.filename, amount))

    return consumer
