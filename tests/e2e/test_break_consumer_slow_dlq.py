"""A dead letter whose DLQ produce takes longer than the consumer's
``transaction_idle_timeout_s`` (main at bcda484: a dead-lettered position is marked in
``processed_event`` in a transaction that commits only once the dead letter is durable, and the
DLQ produce runs inside it). Real ``consume-ready``, shared broker and Postgres.

The DLQ topic is missing (deleted; the broker does not create topics on produce): each DLQ
produce waits ``dlq_produce_timeout_s`` for the topic and the dead letter then goes to the
``dead_letter`` table (as during a DLQ outage). Meanwhile the marker's transaction sat idle
past the idle limit: Postgres ended the session, the marker was lost, and the consumer retried
the position, wrote it to the table again, lost the session again... for as long as the DLQ
stayed unwritable, with the partition blocked behind it. Each hostile message must end in
the table once, the live consumer must keep its session, the good events applied once, every
offset committed. (Seen before the fix: the session ended twice for the first position, ~20 s
lost; the table write is idempotent, so no second row; with a DLQ that keeps timing out, as
in an outage of its partition leader, the partition stayed blocked.)
"""

from __future__ import annotations

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from jobstream.kafka import base_config, group_lag, producer_config
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, job_ready, query, wait_for

pytestmark = pytest.mark.e2e

HOSTILE = [b"not json at all", b"[1,2,3]", b'{"event_type": "job.ready"}']


def test_a_dead_letter_slower_than_the_idle_limit_is_written_once(
        settings: Settings, procs: ProcessRunner) -> None:
    topic, url = settings.topic("job.ready"), settings.database_url
    admin = AdminClient(base_config(settings))
    dlq = topic + ".dlq"
    wait_for(lambda: dlq in admin.list_topics(timeout=10).topics, 30, "the DLQ topic")
    admin.delete_topics([dlq])[dlq].result(30)
    wait_for(lambda: dlq not in admin.list_topics(timeout=10).topics, 30, "the DLQ deleted")
    events = [job_ready(f"slowdlq{i}") for i in range(6)]
    producer = Producer(producer_config(settings))
    for i, e in enumerate(events):
        producer.produce(topic, key=b"k", value=encode_event(e), partition=0)
        if i < len(HOSTILE):
            producer.produce(topic, key=b"k", value=HOSTILE[i], partition=0)
    assert producer.flush(30) == 0
    group = settings.group("downstream-ready-applier")
    procs.start("consume-ready", name="consumer",
                # Each DLQ produce waits longer than the idle limit (1.5 s > 1 s): the session
                # ended there before the fix. Two waits per hostile message (the DLQ, then the
                # reference record): 6 x 1.5 s (was 6 x 2 s).
                JOBSTREAM_CONSUMER_TRANSACTION_IDLE_TIMEOUT_S="1",
                JOBSTREAM_DLQ_PRODUCE_TIMEOUT_S="1.5")

    def tabled() -> list[dict[str, object]]:
        return query(url, "SELECT kafka_offset, count(*) AS n FROM dead_letter "
                          "GROUP BY kafka_offset ORDER BY kafka_offset")

    wait_for(lambda: group_lag(settings, group, [topic]) == 0, 90,
             "every offset committed",
             lambda: f"dead_letter rows by offset: {tabled()}\n{procs.logs()}", every_s=0.5)
    rows = tabled()
    assert len(rows) == len(HOSTILE) and all(r["n"] == 1 for r in rows), \
        f"dead letters written more than once: {rows}\n{procs.logs()}"
    assert "idle-in-transaction timeout" not in procs.logs(), \
        f"a live consumer lost its session while dead-lettering:\n{procs.logs()}"
    applied = query(url, "SELECT count(*) AS n, count(DISTINCT dedup_key) AS d "
                         "FROM downstream.document_analysis")[0]
    assert applied["n"] == applied["d"] == len(events), applied
