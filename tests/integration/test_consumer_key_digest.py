"""The consumer library's ``key_digest`` dedup table on real Kafka + Postgres: a table of the
first shape (primary key on the three text columns) keeps working, is converted by
``consumers.ddl.upgrade_tables`` under a running consumer without losing a duplicate, and an
event id reused by another dedup key is still ``event_id_conflict`` (dead-lettered, the rest of
its batch applied once)."""

from __future__ import annotations

import sys
import threading
from typing import Any

import psycopg
import pytest

from consumers import IdempotentConsumer, create_tables
from consumers.ddl import KEY_DIGEST_SQL, key_digest, upgrade_tables
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import JobReady, encode_event
from tests.helpers import job_ready as _ready
from tests.helpers import library_consumer, query, wait_for

pytestmark = pytest.mark.integration
SCHEMA = "lib_digest"

#: processed_event as consumers/sql/consumer.sql created it before key_digest.
FIRST_SHAPE = f"""
CREATE SCHEMA {SCHEMA};
CREATE TABLE {SCHEMA}.processed_event (
    consumer_group  text        NOT NULL,
    dedup_key       text        NOT NULL,
    event_type      text        NOT NULL,
    event_id        uuid        NOT NULL,
    job_id          uuid,
    processed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, dedup_key, event_type)
);
CREATE INDEX processed_event_processed_at ON {SCHEMA}.processed_event (processed_at);
CREATE UNIQUE INDEX processed_event_event_id ON {SCHEMA}.processed_event (consumer_group, event_id);
"""


def _consumer(settings: Settings, seen: dict[str, list[Any]]) -> IdempotentConsumer:
    """The library standalone on ``SCHEMA``; its handler records each applied name in
    ``seen.name`` and the interpreter's GIL switch interval in ``seen["switch"]``."""
    consumer = library_consumer(settings, SCHEMA, seen)

    @consumer.on(JobReady)
    def apply(tx: psycopg.Connection, event: JobReady) -> None:
        seen.setdefault("switch", []).append(sys.getswitchinterval())
        tx.execute(f"INSERT INTO {SCHEMA}.seen VALUES (%s)",  # noqa: S608
                   (event.idempotency_key,))

    return consumer


def _handled(seen: dict[str, list[Any]]) -> int:
    return len(seen["applied"]) + len(seen["duplicate"]) + len(seen["dead"])


def _seen_rows(settings: Settings) -> list[str]:
    return [r["name"] for r in query(settings.database_url,
                                     f"SELECT name FROM {SCHEMA}.seen ORDER BY name")]  # noqa: S608


def test_first_shape_table_upgraded_under_a_running_consumer_keeps_every_duplicate(
        settings: Settings) -> None:
    with psycopg.connect(settings.database_url) as conn:
        conn.execute(FIRST_SHAPE)  # type: ignore[arg-type]  # test DDL, no parameters
        create_tables(conn, SCHEMA)  # the table exists: left as it is; dead_letter created
        conn.execute(f"CREATE TABLE {SCHEMA}.seen (name text PRIMARY KEY)")  # noqa: S608
        conn.commit()
    seen: dict[str, list[Any]] = {"applied": [], "duplicate": [], "dead": []}
    consumer = _consumer(settings, seen)
    a, b, c = _ready("a"), _ready("b"), _ready("c")
    topic = settings.topic("job.ready")
    produce_raw(settings, topic, [(b"k", encode_event(e)) for e in (a, a, b)])
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: _handled(seen) >= 3, 90, f"3 messages handled ({seen})")
        assert query(settings.database_url,  # still the first shape: no key_digest column
                     "SELECT count(*) AS n FROM information_schema.columns WHERE "
                     "table_schema = %s AND column_name = 'key_digest'", (SCHEMA,)
                     )[0]["n"] == 0
        # Converted while the consumer holds its connection (idle between batches).
        with psycopg.connect(settings.database_url) as conn:
            upgrade_tables(conn, SCHEMA)
            upgrade_tables(conn, SCHEMA)  # idempotent
        produce_raw(settings, topic, [(b"k", encode_event(e)) for e in (c, a, b)])
        wait_for(lambda: _handled(seen) >= 6, 90, f"6 messages handled ({seen})")
    finally:
        consumer.stop()
        t.join(30)
    assert not t.is_alive()
    assert sorted(seen["applied"]) == ["a", "b", "c"], seen
    assert sorted(seen["duplicate"]) == ["a", "a", "b"], seen
    assert seen["dead"] == []
    assert _seen_rows(settings) == ["a", "b", "c"]
    rows = query(settings.database_url, f"SELECT consumer_group, event_type, dedup_key, "  # noqa: S608
                 f"key_digest FROM {SCHEMA}.processed_event")
    assert len(rows) == 3
    for r in rows:  # the upgrade's digest (SQL) is the consumer's (Python)
        assert bytes(r["key_digest"]) == key_digest(r["consumer_group"], r["event_type"],
                                                    r["dedup_key"]), r
    pkey = query(settings.database_url,
                 "SELECT pg_get_constraintdef(oid) AS d FROM pg_constraint WHERE contype = 'p' "
                 "AND conrelid = %s::regclass", (f"{SCHEMA}.processed_event",))
    assert pkey == [{"d": "PRIMARY KEY (key_digest)"}]
    # Non-ASCII text: the SQL expression operators use agrees with key_digest().
    got = query(settings.database_url, f"SELECT {KEY_DIGEST_SQL} AS d FROM (VALUES "  # noqa: S608
                "(%s, %s, %s)) AS v(consumer_group, event_type, dedup_key)",
                ("grüppe", "job.réady", "k€y"))
    assert bytes(got[0]["d"]) == key_digest("grüppe", "job.réady", "k€y")


def test_event_id_reused_by_another_dedup_key_is_dead_lettered_and_its_batch_applied(
        settings: Settings) -> None:
    with psycopg.connect(settings.database_url) as conn:
        create_tables(conn, SCHEMA)  # the key_digest shape
        conn.execute(f"CREATE TABLE {SCHEMA}.seen (name text PRIMARY KEY)")  # noqa: S608
        conn.commit()
    seen: dict[str, list[Any]] = {"applied": [], "duplicate": [], "dead": []}
    consumer = _consumer(settings, seen)
    before = sys.getswitchinterval()
    x, y = _ready("x"), _ready("y")
    forged = x.model_copy(update={"dedup_key": "b" * 64, "idempotency_key": "forged"})
    produce_raw(settings, settings.topic("job.ready"),
                [(b"k", encode_event(e)) for e in (x, forged, y, x)])
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: _handled(seen) >= 4, 90, f"4 messages handled ({seen})")
    finally:
        consumer.stop()
        t.join(30)
    assert not t.is_alive()
    assert sorted(seen["applied"]) == ["x", "y"], seen
    assert seen["duplicate"] == ["x"], seen
    assert seen["dead"] == ["event_id_conflict"], seen
    assert _seen_rows(settings) == ["x", "y"]
    # decode_ahead: the GIL switch interval is switch_interval_s while run() runs, then restored
    assert set(seen["switch"]) == {0.0005} and sys.getswitchinterval() == before, seen
