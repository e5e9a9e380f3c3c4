"""Breaker6: the consumer library's apply lanes (``apply_lanes`` 2: one fetched batch split by
partition, the parts applied at the same time on two connections) with the SAME dedup keys in
both lanes at once, in opposite orders, from outside: one real ``consume-ready`` process, the
broker and Postgres.

``job.ready`` events are produced to partition 0 and copies of them (the same message, and the
same dedup key under a new event id) to partition 1 in the reverse order, all before the
consumer starts, so its first batches hold both partitions and lane 0 (partition 0) and lane 1
(partition 1) insert the same ``processed_event`` keys at the same moment: one lane waits for
the other's uncommitted rows. In the opposite order, row by row, that is a deadlock between the
two lanes of one process (Postgres aborts one: it must be retried, not dead-lettered nor
crash the consumer). Each dedup key must be applied exactly once (one analysis, one charge),
nothing dead-lettered, every offset committed, the consumer alive.
"""

from __future__ import annotations

import uuid

import pytest

from jobstream.kafka import group_lag
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import (
    ProcessRunner,
    job_ready,
    processed_rows,
    produce_at,
    query,
    read_topic,
    wait_for,
)

pytestmark = pytest.mark.e2e

N = 400



def test_the_same_dedup_keys_in_both_apply_lanes_at_once_apply_once(
        settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("job.ready")
    events = [job_ready(f"lane{i}", charge_usd=0.5) for i in range(N)]
    again = [e.model_copy(update={"event_id": uuid.uuid4()}) for e in events[::3]]
    first = [(0, str(e.job_id).encode(), encode_event(e)) for e in events]
    copies = [(1, str(e.job_id).encode(), encode_event(e))
              for e in reversed(events + again)]
    produce_at(settings, topic, first + copies)
    consumer = procs.start("consume-ready", JOBSTREAM_CONSUMER_APPLY_LANES="2")
    group = settings.group("downstream-ready-applier")

    def applied() -> dict[str, tuple[int, int]]:
        rows = query(settings.database_url,
                     "SELECT a.dedup_key, count(*) AS n, (SELECT count(*) FROM "
                     "downstream.ledger_charge c WHERE c.dedup_key = a.dedup_key) AS charges "
                     "FROM downstream.document_analysis a GROUP BY a.dedup_key")
        return {r["dedup_key"]: (int(r["n"]), int(r["charges"])) for r in rows}

    wait_for(lambda: len(applied()) == N and group_lag(settings, group, [topic]) == 0, 120,
             "every event applied and every offset committed", procs.logs, every_s=0.5)
    got = applied()
    assert set(got.values()) == {(1, 1)}, {k: v for k, v in got.items() if v != (1, 1)}
    assert sorted(got) == sorted(e.dedup_key for e in events)
    assert query(settings.database_url,
                 "SELECT count(*) AS n FROM processed_event")[0]["n"] == N
    assert read_topic(settings, topic + ".dlq") == []
    assert not query(settings.database_url, "SELECT 1 FROM dead_letter")
    assert consumer.popen.poll() is None and "Traceback" not in consumer.log_text(), \
        procs.logs()


def test_a_consumer_killed_again_and_again_mid_lanes_applies_each_event_once(
        settings: Settings, procs: ProcessRunner) -> None:
    """kill -9 from outside at arbitrary moments while large batches (over
    ``apply_lanes_min_batch``) of three partitions are applied in two lanes, with copies of
    events on other partitions: after three kills and a restart every event is applied
    once, nothing dead-lettered, every offset committed."""
    topic = settings.topic("job.ready")
    events = [job_ready(f"kill{i}", charge_usd=0.25) for i in range(1500)]
    parts = [(i % 3, str(e.job_id).encode(), encode_event(e)) for i, e in enumerate(events)]
    parts += [((i + 1) % 3, str(e.job_id).encode(), encode_event(e))
              for i, e in enumerate(events) if i % 7 == 0]
    produce_at(settings, topic, parts)
    env = {"JOBSTREAM_CONSUMER_APPLY_LANES": "2", "JOBSTREAM_CONSUMER_BATCH_SIZE": "400"}
    url = settings.database_url

    def done() -> int:
        return int(query(url, "SELECT count(*) AS n FROM processed_event")[0]["n"])

    kills = 0
    for step in (250, 600, 900):
        consumer = procs.start("consume-ready", **env)
        wait_for(lambda step=step: done() >= step, 90, f"{step} events applied", procs.logs,
                 every_s=0.02)
        procs.kill9(consumer)
        kills += done() < len(events)
    assert kills == 3, "drained before the kills: probe too small"
    consumer = procs.start("consume-ready", **env)
    group = settings.group("downstream-ready-applier")
    wait_for(lambda: done() == len(events) and group_lag(settings, group, [topic]) == 0, 120,
             "every event applied and every offset committed", procs.logs, every_s=0.5)
    rows = query(url, "SELECT a.dedup_key, count(*) AS n, (SELECT count(*) FROM "
                      "downstream.ledger_charge c WHERE c.dedup_key = a.dedup_key) AS charges "
                      "FROM downstream.document_analysis a GROUP BY a.dedup_key")
    got = {r["dedup_key"]: (int(r["n"]), int(r["charges"])) for r in rows}
    assert len(got) == len(events) and set(got.values()) == {(1, 1)}, \
        {k: v for k, v in got.items() if v != (1, 1)}
    assert read_topic(settings, topic + ".dlq") == []
    assert consumer.popen.poll() is None and "Traceback" not in consumer.log_text(), \
        procs.logs()


def test_event_ids_reused_across_both_apply_lanes_at_once_are_dead_lettered_once_each(
        settings: Settings, procs: ProcessRunner) -> None:
    """The same event id under DIFFERENT dedup keys on two partitions, so both lanes insert
    it at once (the ``processed_event`` rows are ordered by key digest, the event-id index
    is not: crossing waits, a deadlock between the lanes). For each event id exactly one of
    its two events is applied and the other dead-lettered ``event_id_conflict``; nothing
    retried forever, nothing lost, the consumer alive."""
    topic = settings.topic("job.ready")
    n = 300
    first = [job_ready(f"eid{i}", charge_usd=0.5) for i in range(n)]
    other = [job_ready(f"eidx{i}", charge_usd=0.5).model_copy(
        update={"event_id": first[(i * 7) % n].event_id}) for i in range(n)]
    produce_at(settings, topic, [(0, str(e.job_id).encode(), encode_event(e)) for e in first]
             + [(1, str(e.job_id).encode(), encode_event(e)) for e in other])
    consumer = procs.start("consume-ready", JOBSTREAM_CONSUMER_APPLY_LANES="2")
    group = settings.group("downstream-ready-applier")
    url = settings.database_url
    dlq = topic + ".dlq"

    def dead() -> list[str]:
        return [dict(m.headers() or []).get("dlq_reason_code", b"").decode()
                for m in read_topic(settings, dlq)] if dlq in _topics(settings) else []

    wait_for(lambda: processed_rows(url)[0] == n
             and group_lag(settings, group, [topic]) == 0, 120,
             "every event applied or dead-lettered and every offset committed", procs.logs,
             every_s=0.5)
    applied = {r["dedup_key"] for r in query(
        url, "SELECT dedup_key FROM downstream.document_analysis")}
    by_id: dict[object, list[str]] = {}
    for e in first + other:
        by_id.setdefault(e.event_id, []).append(e.dedup_key)
    assert all(len(set(keys) & applied) == 1 for keys in by_id.values()), \
        [keys for keys in by_id.values() if len(set(keys) & applied) != 1][:5]
    codes = dead()
    assert len(codes) == n and set(codes) == {"event_id_conflict"}, codes[:10]
    assert consumer.popen.poll() is None and "Traceback" not in consumer.log_text(), \
        procs.logs()


def _topics(settings: Settings) -> set[str]:
    from confluent_kafka.admin import AdminClient

    from jobstream.kafka import base_config
    return set(AdminClient(base_config(settings)).list_topics(timeout=10).topics)

