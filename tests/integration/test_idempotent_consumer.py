"""The idempotent consumer's batch path on real Kafka + Postgres: one transaction per batch,
duplicates inside and across batches, poison messages, a handler that refuses one event, and a
SIGKILL between the batch's commit and its offsets."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from jobstream.errors import PoisonMessage
from jobstream.producer import produce_raw, submit_producer
from jobstream.ready_applier import apply_ready, apply_ready_batch, build, idempotent_consumer
from jobstream.settings import Settings
from schemas.events import DocumentAnalysis, JobReady, JobReadyPayload, encode_event
from tests.helpers import (
    ProcessRunner,
    processed_rows,
    query,
    read_topic,
    run_until_handled,
    wait_for,
)

pytestmark = pytest.mark.integration


def _ready(tenant: str, name: str) -> JobReady:
    return JobReady(
        tenant_id=tenant, idempotency_key=name, job_id=uuid.uuid4(),
        dedup_key=uuid.uuid4().hex * 2,
        payload=JobReadyPayload(
            result=DocumentAnalysis(title=name, summary="s", keywords=["a", "b"],
                                    word_count=1, chunk_count=1, fields={"k": "v"}),
            document_sha256="a" * 64, filename=name, cost_usd=0.0, charge_usd=0.01))


def _produce(settings: Settings, events: list[JobReady | bytes]) -> None:
    """One partition's worth of order: every message gets the same key."""
    produce_raw(settings, settings.topic("job.ready"),
                [(b"k", e if isinstance(e, bytes) else encode_event(e)) for e in events])


def _applied(settings: Settings, tenant: str) -> dict[str, int]:
    rows = query(settings.database_url,
                 "SELECT filename, count(*) AS n FROM downstream.document_analysis "
                 "WHERE tenant_id = %s GROUP BY filename", (tenant,))
    charges = query(settings.database_url,
                    "SELECT count(*) AS n FROM downstream.ledger_charge WHERE tenant_id = %s",
                    (tenant,))[0]["n"]
    out = {r["filename"]: r["n"] for r in rows}
    assert charges == sum(out.values()), (charges, out)
    return out


def test_a_batch_applies_each_event_once_and_dead_letters_poison(settings: Settings) -> None:
    a, b, c = (_ready("acme", n) for n in ("a", "b", "c"))
    _produce(settings, [a, b, a, b"not json", c, b, a])
    consumer = build(settings)
    sizes: list[int] = []
    batch = consumer.process_batch
    consumer.process_batch = lambda msgs: (sizes.append(len(msgs)), batch(msgs))[1]  # type: ignore[method-assign]
    run_until_handled(consumer, 7)
    assert max(sizes) > 1, f"no batch was formed: {sizes}"
    assert _applied(settings, "acme") == {"a": 1, "b": 1, "c": 1}
    assert (consumer.stats.applied, consumer.stats.duplicates,
            consumer.stats.dead_lettered) == (3, 3, 1)
    dlq = read_topic(settings, settings.topic("job.ready.dlq"))
    assert [m.value() for m in dlq] == [b"not json"]
    assert processed_rows(settings.database_url) == (3, 1)  # 3 effects, 1 dead-lettered
    # A second run of the same group has nothing left: the offsets were committed.
    again = build(settings)
    again.run(idle_exit_s=8)
    assert (again.stats.applied, again.stats.duplicates) == (0, 0)


def test_copy_batches_with_duplicates_and_poison_mid_batch_apply_each_event_once(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """The ready applier's batch path (binary COPY batch handler, decode-ahead thread): copies
    inside one batch and across batches (in one run and in a later run of the same group), an
    undecodable message and an event Postgres refuses in the middle of a batch. The refused
    one makes the batch's statement fail: the batch is rolled back and split, and every
    neighbour is still applied exactly once. The event's schema takes charges below 10^6 USD;
    this downstream narrows its own column to numeric(6, 2), so Postgres refuses a valid
    event's charge of 5 * 10^5 (numeric field overflow: data, not an outage)."""
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE downstream.ledger_charge ALTER COLUMN amount_usd "
                     "TYPE numeric(6, 2)")
    events = [_ready("acme", f"e{i}") for i in range(30)]
    refused = _ready("acme", "refused").model_copy(update={"payload": events[0].payload.model_copy(
        update={"filename": "refused", "charge_usd": 5e5})})
    first: list[JobReady | bytes] = []
    for i, ev in enumerate(events):
        first.append(ev)
        if i % 3 == 2:
            first.append(events[i - 1])  # a copy right after it: the same batch
        if i % 7 == 6:
            first.append(events[i - 6])  # an older copy: likely an earlier batch
        if i == 14:
            first += [refused, b"not json"]
    _produce(settings, first)
    consumer = build(settings)
    consumer.max_batch = 16
    sizes: list[int] = []
    batch = consumer.process_batch
    consumer.process_batch = lambda msgs: (sizes.append(len(msgs)), batch(msgs))[1]  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="consumers.idempotent"):
        run_until_handled(consumer, len(first))
    assert max(sizes) > 8, f"no batch large enough to be split was formed: {sizes}"
    assert "applying it as two batches" in caplog.text, (sizes, caplog.text)
    expected = {f"e{i}": 1 for i in range(30)}
    assert _applied(settings, "acme") == expected
    dups = len(first) - 30 - 2
    assert (consumer.stats.applied, consumer.stats.duplicates,
            consumer.stats.dead_lettered) == (30, dups, 2)
    dlq = read_topic(settings, settings.topic("job.ready.dlq"))
    assert sorted(dict(m.headers())["dlq_reason_code"] for m in dlq) == [
        b"invalid_data", b"not_json"], [m.headers() for m in dlq]
    # Across runs: re-deliveries of applied events and one new event, same group.
    late = _ready("acme", "late")
    _produce(settings, [events[3], late, events[20], events[3]])
    again = build(settings)
    run_until_handled(again, 4)
    assert (again.stats.applied, again.stats.duplicates) == (1, 3)
    assert _applied(settings, "acme") == {**expected, "late": 1}
    assert processed_rows(settings.database_url) == (31, 2)  # and 2 dead-lettered positions


@pytest.mark.parametrize("batched_handler", [True, False])
def test_a_refused_event_rolls_back_the_batch_and_costs_only_itself(
        settings: Settings, batched_handler: bool) -> None:
    def handler(conn: psycopg.Connection, ev: Any) -> None:
        if ev.payload.filename == "bad":
            raise PoisonMessage("refused by the handler", code="refused")
        apply_ready(conn, ev)

    def batch_handler(conn: psycopg.Connection, events: list[Any]) -> None:
        if any(ev.payload.filename == "bad" for ev in events):
            raise PoisonMessage("refused by the handler", code="refused")
        apply_ready_batch(conn, events)

    events = [_ready("acme", n) for n in ("a", "b", "bad", "c")]
    _produce(settings, [*events, events[0]])
    consumer = idempotent_consumer(
        settings, group=settings.group("test-refuse"), topics=[settings.topic("job.ready")],
        event_types=("job.ready",), handler=handler,
        batch_handler=batch_handler if batched_handler else None)
    run_until_handled(consumer, 5)
    assert _applied(settings, "acme") == {"a": 1, "b": 1, "c": 1}
    assert consumer.stats.dead_lettered == 1
    dlq = read_topic(settings, settings.topic("job.ready.dlq"))
    assert len(dlq) == 1
    assert dict(dlq[0].headers())["dlq_reason_code"] == b"refused"
    # The refused event left no idempotent-consumer row behind (its transaction rolled back).
    rows = query(settings.database_url, "SELECT dedup_key FROM processed_event")
    assert events[2].dedup_key not in {r["dedup_key"] for r in rows}


def test_killed_after_the_batch_commit_before_offsets_applies_nothing_twice(
        settings: Settings, procs: ProcessRunner) -> None:
    events = [_ready("acme", f"d{i}") for i in range(50)]
    _produce(settings, list(events))
    first = procs.start("consume-ready", JOBSTREAM_FAULT="consumer_after_apply_before_offset")
    wait_for(lambda: first.popen.poll() is not None, 60, "the consumer to be killed",
             procs.logs)
    assert first.popen.returncode == -9, procs.logs()
    applied = _applied(settings, "acme")
    assert applied and set(applied.values()) == {1}
    procs.start("consume-ready", name="consume-ready-restarted")
    wait_for(lambda: len(_applied(settings, "acme")) == 50, 60, "all 50 applied", procs.logs)
    time.sleep(2)  # every redelivered copy has been seen by now
    assert set(_applied(settings, "acme").values()) == {1}


def test_copies_on_two_partitions_applied_by_two_lanes_at_once_apply_once(
        settings: Settings) -> None:
    """Each event twice, on partitions 0 and 1 (``apply_lanes`` 2: lane 0 is the run()
    thread, lane 1 a helper thread with its own connection): a batch's two parts insert the
    same keys in two transactions at once; the processed_event insert decides, each event is
    applied once, and both lanes did apply parts of a batch. The copies are produced while the
    consumer is held inside the transaction of a first event (its ``in_transaction`` hook), so
    the client has fetched both partitions' backlog when the next batch is taken."""
    consumer = build(settings)
    consumer.settings = consumer.settings.model_copy(update={"apply_lanes": 2,
                                                             "apply_lanes_min_batch": 2})
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        if not held.is_set():
            held.set()
            release.wait(30)

    consumer.hooks.in_transaction = hold
    callers: set[str] = set()
    batch = consumer.process_batch
    consumer.process_batch = lambda msgs: (  # type: ignore[method-assign]
        callers.add(threading.current_thread().name), batch(msgs))[1]
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    producer = submit_producer(settings)
    topic = settings.topic("job.ready")
    producer.produce(topic, key=b"k", value=encode_event(_ready("acme", "first")), partition=2)
    producer.produce(topic, key=b"k", value=encode_event(_ready("acme", "second")), partition=2)
    assert producer.flush(30) == 0
    wait_for(held.is_set, 60, "the first batch inside its transaction")
    events = [_ready("acme", f"x{i}") for i in range(40)]
    for ev in events:
        for partition in (0, 1):
            producer.produce(topic, key=b"k", value=encode_event(ev), partition=partition)
    assert producer.flush(30) == 0
    time.sleep(2)  # the client prefetches both partitions meanwhile
    release.set()
    st = consumer.stats
    wait_for(lambda: st.applied + st.duplicates >= 82, 60, f"every copy handled (stats {st})")
    time.sleep(0.5)
    consumer.stop()
    t.join(30)
    expected = {f"x{i}": 1 for i in range(40)} | {"first": 1, "second": 1}
    assert _applied(settings, "acme") == expected
    assert (st.applied, st.duplicates, st.dead_lettered) == (42, 40, 0)
    assert any(c.startswith("apply-") for c in callers), callers  # a lane thread applied
    assert any(not c.startswith("apply-") for c in callers), callers  # and run()'s thread
    processed = query(settings.database_url, "SELECT count(*) AS n FROM processed_event")
    assert processed[0]["n"] == 42
    # A second run of the same group has nothing left: both lanes' offsets were committed.
    again = build(settings)
    again.run(idle_exit_s=8)
    assert (again.stats.applied, again.stats.duplicates) == (0, 0)
