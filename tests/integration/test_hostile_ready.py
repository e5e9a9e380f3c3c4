"""Poison never blocks a partition of the idempotent consumer (issue 9, row 3), on real Kafka,
Postgres and a real ``jobstream consume-ready`` process; and a handler error that repeats on
the same message is dead-lettered after ``consumer_poison_after`` tries."""

from __future__ import annotations

import json
import threading
import uuid

import psycopg
import pytest
from confluent_kafka import Producer

from consumers.routing import DeadLetterSink
from jobstream.kafka import base_config, group_lag
from jobstream.ready_applier import apply_ready, idempotent_consumer
from jobstream.settings import Settings
from schemas.events import DocumentAnalysis, JobReady, JobReadyPayload, encode_event
from tests.helpers import ProcessRunner, query, wait_for

pytestmark = pytest.mark.integration

ROW_1 = b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}"


def _ready(tenant: str, name: str) -> JobReady:
    return JobReady(
        tenant_id=tenant, idempotency_key=name, job_id=uuid.uuid4(),
        dedup_key=uuid.uuid4().hex * 2,
        payload=JobReadyPayload(
            result=DocumentAnalysis(title=name, summary="s", keywords=["a"], word_count=1,
                                    chunk_count=1),
            document_sha256="a" * 64, filename=name, cost_usd=0.0, charge_usd=0.01))


def _produce(settings: Settings, items: list[tuple[int, bytes, bytes]]) -> None:
    """``(partition, key, value)`` to job.ready, each acknowledged."""
    p = Producer({**base_config(settings), "message.max.bytes": 2_000_000})
    errors: list[object] = []
    for part, key, value in items:
        p.produce(settings.topic("job.ready"), key=key, value=value, partition=part,
                  on_delivery=lambda err, _m: errors.append(err) if err else None)
    assert p.flush(30) == 0 and not errors, errors


def _applied(settings: Settings, tenant: str) -> dict[str, int]:
    rows = query(settings.database_url,
                 "SELECT filename, count(*) AS n FROM downstream.document_analysis "
                 "WHERE tenant_id = %s GROUP BY filename", (tenant,))
    return {r["filename"]: r["n"] for r in rows}


def test_row_3_deep_value_on_job_ready_is_dead_lettered_and_every_partition_moves_on(
        settings: Settings, procs: ProcessRunner) -> None:
    consumer = procs.start("consume-ready")
    parts = range(settings.topic_partitions)
    # The poison first on every partition, then good messages behind it on every partition.
    _produce(settings, [(p, f"poison-{p}".encode(), ROW_1) for p in parts])
    good = [_ready("acme", f"doc-{p}-{i}") for p in parts for i in range(3)]
    _produce(settings, [(i % settings.topic_partitions, str(ev.job_id).encode(),
                         encode_event(ev)) for i, ev in enumerate(good)])
    wait_for(lambda: _applied(settings, "acme") == {ev.payload.filename: 1 for ev in good},
             60, "every good job.ready applied once", procs.logs)
    group = settings.group("downstream-ready-applier")
    wait_for(lambda: group_lag(settings, group, [settings.topic("job.ready")]) == 0, 30,
             "consumer lag 0", procs.logs)
    listed = procs.run("dlq", "list", "--topic", "job.ready", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert sorted((r["key"], r["dlq_reason_code"]) for r in rows) == [
        (f"poison-{p}", "json_too_deep") for p in parts]
    assert consumer.popen.poll() is None, consumer.log_text()[-3000:]
    assert "Traceback" not in consumer.log_text(), consumer.log_text()[-3000:]


def test_the_same_handler_error_n_times_dead_letters_the_message(
        settings: Settings, procs: ProcessRunner) -> None:
    s = settings.model_copy(update={"consumer_poison_after": 3})
    bad, ok = _ready("acme", "explodes"), _ready("acme", "fine")
    tries: list[str] = []

    def handler(conn: psycopg.Connection, ev: JobReady) -> None:
        tries.append(ev.payload.filename)
        if ev.payload.filename == "explodes":
            raise ValueError("the handler cannot take this one")
        apply_ready(conn, ev)

    consumer = idempotent_consumer(s, group=s.group("poison-after"),
                                  topics=[s.topic("job.ready")], event_types=("job.ready",),
                                  handler=handler, max_batch=1)
    _produce(settings, [(0, b"same", encode_event(bad)), (0, b"same", encode_event(ok))])
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: _applied(settings, "acme") == {"fine": 1}, 60,
                 "the message behind the failing one applied")
    finally:
        consumer.stop()
        t.join(30)
    assert tries.count("explodes") == 3
    assert consumer.stats.dead_lettered == 1
    rows = json.loads(procs.run("dlq", "list", "--topic", "job.ready", "--json").stdout)
    assert [(r["dlq_reason_code"], "ValueError" in r["dlq_reason"]) for r in rows] == [
        ("handler_error", True)]



def test_two_groups_dead_letter_one_message_once_each_and_replay_can_pick_one_group(
        settings: Settings, procs: ProcessRunner) -> None:
    """Each consumer group on job.ready dead-letters a bad message once: the DLQ entries say
    which group (header dlq_consumer_group, `dlq list`), and `dlq replay --group` replays only
    that group's copy (one copy reaches every group again)."""
    procs.start("consume-ready")
    _produce(settings, [(0, b"poison-0", b"not json at all")])
    group = settings.group("downstream-ready-applier")
    wait_for(lambda: group_lag(settings, group, [settings.topic("job.ready")]) == 0, 60,
             "consume-ready dead-lettered the poison", procs.logs)
    # A second team's consumer group meets the same message: the library's dead-letter sink
    # (what IdempotentConsumer uses) on the same broker, group "billing".
    sink = DeadLetterSink(base_config(settings), dsn=settings.database_url, group="billing",
                          max_message_bytes=settings.kafka_message_max_bytes)
    assert sink.send(topic=settings.topic("job.ready"), partition=0, offset=0, key=b"poison-0",
                     value=b"not json at all", headers=[], code="not_json",
                     reason="billing could not decode it").where == "topic"
    sink.close()
    rows = wait_for(lambda: (r := json.loads(procs.run("dlq", "list", "--topic", "job.ready",
                                                       "--json").stdout)) and len(r) == 2 and r,
                    30, "both groups' dead letters listed", procs.logs)
    assert sorted(r["consumer_group"] for r in rows) == sorted([group, "billing"])
    table = procs.run("dlq", "list", "--topic", "job.ready", COLUMNS="250")
    assert "by billing" in table.stdout, table.stdout
    dry = procs.run("dlq", "replay", "--topic", "job.ready", "--group", "billing", "--dry-run",
                    "--json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    [billing] = [r for r in rows if r["consumer_group"] == "billing"]
    assert [it["ref"] for it in report["replayed"]] == [
        f"{billing['dlq_topic']}:{billing['partition']}:{billing['offset']}"]
    assert report["skipped"] == 1
