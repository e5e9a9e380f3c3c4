"""Breaking the consumer library's idempotent consumer (``consumers/``) with hostile
``job.ready`` values, on real Kafka + Postgres.

* A value Postgres refuses because of one of its limits (SQLSTATE class 54, here an index row
  over btree's 2704-byte maximum: the downstream's handler indexes the result's summary) used to
  count as a database outage (``psycopg.OperationalError``): retried forever, the connection
  closed each time, the partition blocked behind it. It is bad data, like ``DataError``:
  dead-lettered as ``invalid_data``, its neighbours applied once.
* A huge dedup key (100 kB) is refused by the schema (``schema_violation``) before any digest.
"""

from __future__ import annotations

import random
import string
import threading
from typing import Any

import orjson
import psycopg
import pytest

from consumers import create_tables
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import DocumentAnalysis, JobReady, encode_event
from tests.helpers import job_ready, library_consumer, query, read_topic, wait_for

pytestmark = pytest.mark.e2e
SCHEMA = "lib_break"


def test_a_value_over_a_postgres_limit_is_dead_lettered_not_retried_forever(
        settings: Settings) -> None:
    with psycopg.connect(settings.database_url) as conn:
        create_tables(conn, SCHEMA)
        conn.execute(f"CREATE TABLE {SCHEMA}.result (summary text UNIQUE)")  # noqa: S608
    seen: dict[str, list[Any]] = {"applied": [], "dead": []}
    consumer = library_consumer(settings, SCHEMA, seen)

    @consumer.on(JobReady)
    def apply(tx: psycopg.Connection, event: JobReady) -> None:
        tx.execute(f"INSERT INTO {SCHEMA}.result VALUES (%s)",  # noqa: S608
                   (event.payload.result.summary,))

    rng = random.Random(12)
    big = job_ready("big")  # 4000 random characters: no compression brings it under 2704 bytes
    big = big.model_copy(update={"payload": big.payload.model_copy(update={
        "result": DocumentAnalysis(title="t", keywords=["k"], word_count=1, chunk_count=1,
                                   summary="".join(rng.choices(string.printable[:94], k=4000)))
    })})
    huge_key = orjson.loads(encode_event(job_ready("huge-key")))
    huge_key["dedup_key"] = "a" * 100_000
    a, c = job_ready("a"), job_ready("c")
    a = a.model_copy(update={"payload": a.payload.model_copy(update={
        "result": a.payload.result.model_copy(update={"summary": "a"})})})
    c = c.model_copy(update={"payload": c.payload.model_copy(update={
        "result": c.payload.result.model_copy(update={"summary": "c"})})})
    topic = settings.topic("job.ready")
    produce_raw(settings, topic, [(b"k", encode_event(a)), (b"k", encode_event(big)),
                                  (b"k", orjson.dumps(huge_key)), (b"k", encode_event(c)),
                                  (b"k", encode_event(a))])
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(seen["applied"]) + len(seen["dead"]) >= 4, 60,
                 f"the five messages settled ({seen})")
    finally:
        consumer.stop()
        t.join(30)
    assert not t.is_alive()
    assert sorted(seen["applied"]) == ["a", "c"], seen
    assert sorted(seen["dead"]) == ["invalid_data", "schema_violation"], seen
    assert [r["summary"] for r in query(settings.database_url, f"SELECT summary FROM "  # noqa: S608
                                        f"{SCHEMA}.result ORDER BY 1")] == ["a", "c"]
    dlq = read_topic(settings, topic + ".dlq")
    codes = sorted(dict(m.headers())["dlq_reason_code"].decode() for m in dlq)
    assert codes == ["invalid_data", "schema_violation"], codes
