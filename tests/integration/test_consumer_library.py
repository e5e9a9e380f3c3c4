"""The consumer library used standalone (no jobstream settings, tables or hooks) on real Kafka
+ Postgres: its own schema and DDL, typed registration, metrics hooks, the dead-letter table
fallback of its own DDL when the DLQ refuses a poison message, N identical handler failures ->
DLQ, and retention (``gc``)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
import pytest

from consumers import create_tables
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import JobReady, encode_event
from tests.helpers import job_ready as _ready
from tests.helpers import library_consumer, query, read_topic, set_topic_config, wait_for

pytestmark = pytest.mark.integration
SCHEMA = "lib_test"


def test_standalone_library_routes_applies_and_collects(settings: Settings) -> None:
    dlq = settings.topic("job.ready.dlq")
    set_topic_config(settings, dlq, "max.message.bytes", "2000")
    with psycopg.connect(settings.database_url) as conn:
        create_tables(conn, SCHEMA)
        create_tables(conn, SCHEMA)  # idempotent
        conn.execute(f"CREATE TABLE {SCHEMA}.seen (name text PRIMARY KEY)")  # noqa: S608
        conn.commit()
    seen: dict[str, list[Any]] = {"applied": [], "duplicate": [], "dead": []}
    consumer = library_consumer(settings, SCHEMA, seen, poison_after=2, batch_size=1)

    @consumer.on(JobReady)
    def apply(tx: psycopg.Connection, event: JobReady) -> None:
        if event.idempotency_key == "explodes":
            raise ValueError("cannot take this one")
        tx.execute(f"INSERT INTO {SCHEMA}.seen VALUES (%s)",  # noqa: S608
                   (event.idempotency_key,))

    a, b, bad = _ready("a"), _ready("b"), _ready("explodes")
    big_poison = b'{"junk": "' + os.urandom(6000).hex().encode() + b'"}'  # over the DLQ's size
    produce_raw(settings, settings.topic("job.ready"), [
        (b"k", encode_event(a)), (b"k", big_poison), (b"k", encode_event(a)),
        (b"k", encode_event(bad)), (b"k", encode_event(b))])
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(seen["applied"]) + len(seen["duplicate"]) + len(seen["dead"]) >= 5,
                 90, f"5 messages handled ({seen})")
    finally:
        consumer.stop()
        t.join(30)
    assert not t.is_alive()
    assert (seen["applied"], seen["duplicate"]) == (["a", "b"], ["a"])
    assert seen["dead"] == ["schema_violation", "handler_error"]
    assert query(settings.database_url, f"SELECT name FROM {SCHEMA}.seen ORDER BY name"  # noqa: S608
                 ) == [{"name": "a"}, {"name": "b"}]
    rows = query(settings.database_url,  # the big poison: refused by the DLQ, kept in the table
                 f"SELECT consumer_group, value, dlq_error FROM {SCHEMA}.dead_letter")  # noqa: S608
    assert len(rows) == 1 and bytes(rows[0]["value"]) == big_poison, rows
    assert rows[0]["consumer_group"] == consumer.settings.group
    assert query(settings.database_url, "SELECT count(*) AS n FROM public.dead_letter"
                 )[0]["n"] == 0
    codes = [dict(m.headers()).get("dlq_reason_code") for m in read_topic(settings, dlq)]
    assert b"handler_error" in codes
    # Retention: nothing is older than an hour; everything is older than 0 s.
    assert consumer.gc(3600) == 0
    time.sleep(0.05)
    assert consumer.gc(0) == 4  # 2 applied, 2 dead-lettered positions (their marker rows)
    assert query(settings.database_url,
                 f"SELECT count(*) AS n FROM {SCHEMA}.processed_event")[0]["n"] == 0  # noqa: S608
