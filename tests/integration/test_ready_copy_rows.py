"""The ready applier's hand-built binary COPY rows (``copy_rows`` + ``apply_ready_rows``) write
exactly what the per-event ``apply_ready`` inserts, for awkward values; and the consumer
library's ``on_batch(prepare=...)``: prepared in the decode-ahead thread, a prepare error
splits the batch and the per-event handler decides that event alone; with ``light=True``
``prepare`` gets the fast path's structs while handlers and hooks still get models."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from consumers.idempotent import ConsumerStats, IdempotentConsumer
from jobstream.db import connect
from jobstream.errors import PoisonMessage
from jobstream.producer import produce_raw
from jobstream.ready_applier import (
    apply_ready,
    apply_ready_batch,
    apply_ready_rows,
    copy_rows,
    idempotent_consumer,
)
from jobstream.settings import Settings
from schemas import fastpath
from schemas.events import DocumentAnalysis, JobReady, JobReadyPayload, encode_event
from tests.helpers import query, read_topic, wait_for

pytestmark = pytest.mark.integration

ROWS = ("SELECT tenant_id, dedup_key, job_id, filename, title, summary, keywords, fields "
        "FROM downstream.document_analysis ORDER BY id")
CHARGES = ("SELECT tenant_id, dedup_key, job_id, amount_usd FROM downstream.ledger_charge "
           "ORDER BY id")


def _ready(name: str, *, charge: float = 0.01, keywords: list[str] | None = None,
           fields: dict[str, Any] | None = None, title: str | None = None) -> JobReady:
    return JobReady(
        tenant_id="acme", idempotency_key=name, job_id=uuid.uuid4(),
        dedup_key=uuid.uuid4().hex * 2,
        payload=JobReadyPayload(
            result=DocumentAnalysis(title=title or name, summary="s\t\n\\ \"q\" ü",
                                    keywords=keywords or ["a"], word_count=1, chunk_count=1,
                                    fields=fields if fields is not None else {"k": "v"}),
            document_sha256="a" * 64, filename=name, cost_usd=0.0, charge_usd=charge))


def test_copy_rows_write_what_the_per_event_handler_inserts(database_url: str) -> None:
    events = [
        _ready("plain"),
        _ready("unicode", title="Lizenz — ü € 😀 \u2028", keywords=["ä", "", "😀", "a,b", "{x}",
                                                                  'q"uote', "back\\slash"]),
        _ready("fields", fields={"big": 2**70, "neg": -5, "list": ["1", "2"], "e": [],
                                 "ü": "😀", "n": "null"}),
        _ready("no-fields", fields={}),
        *(_ready(f"charge-{c!r}", charge=c) for c in (
            0.0, 1e-8, 0.1 + 0.2, 123.456, 999999.99999999, 10000.0, 5e-9, 1e-5, 42.0)),
    ]
    with connect(database_url) as conn:
        for ev in events:
            apply_ready(conn, ev)
        one = conn.execute(ROWS).fetchall(), conn.execute(CHARGES).fetchall()
        conn.rollback()
        apply_ready_batch(conn, events)
        batch = conn.execute(ROWS).fetchall(), conn.execute(CHARGES).fetchall()
        conn.rollback()
        apply_ready_rows(conn, [copy_rows(ev) for ev in events[:3]])
        apply_ready_rows(conn, [copy_rows(ev) for ev in events[3:]])
        twice = conn.execute(ROWS).fetchall(), conn.execute(CHARGES).fetchall()
        conn.rollback()
    assert len(one[0]) == len(one[1]) == len(events)
    assert batch == one
    assert twice == one


def _ready_consumer(settings: Settings, group: str, events: list[JobReady],
                    handler: Any, prepare: Any, *, light: bool) -> IdempotentConsumer:
    """``events`` produced to job.ready (one key: one partition, in order), and a ready
    consumer in ``group`` with ``handler`` per event and ``apply_ready_rows`` of ``prepare``
    per batch."""
    produce_raw(settings, settings.topic("job.ready"),
                [(b"k", encode_event(e)) for e in events])
    consumer = idempotent_consumer(settings, group=settings.group(group), topics=[],
                                   event_types=())
    consumer.on(JobReady, topic=settings.topic("job.ready"))(handler)
    consumer.on_batch(JobReady, prepare=prepare, light=light)(apply_ready_rows)
    return consumer


def _run_until(consumer: IdempotentConsumer, n: int) -> ConsumerStats:
    """Run ``consumer`` until it has handled ``n`` messages (and 0.5 s more), stop it, and
    return its counters; asserts that at least one batch of several messages was applied."""
    sizes: list[int] = []
    batch = consumer.process_batch
    consumer.process_batch = lambda msgs: (sizes.append(len(msgs)), batch(msgs))[1]  # type: ignore[method-assign]
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    st = consumer.stats
    try:
        wait_for(lambda: st.applied + st.duplicates + st.dead_lettered >= n, 60,
                 f"{n} messages handled (stats {st})")
        time.sleep(0.5)
    finally:
        consumer.stop()
        t.join(30)
    assert not t.is_alive()
    assert max(sizes) > 1, f"no batch was formed: {sizes}"
    return st


@pytest.mark.parametrize("light", [False, True])
def test_prepare_runs_ahead_and_its_error_costs_only_its_event(settings: Settings,
                                                               light: bool) -> None:
    threads: set[str] = set()
    kinds: dict[str, set[type]] = {"prepare": set(), "handler": set()}

    def prepare(ev: JobReady) -> tuple[bytes, bytes]:
        threads.add(threading.current_thread().name)
        kinds["prepare"].add(type(ev))
        if ev.payload.filename == "bad":
            raise ValueError("cannot prepare this one")
        return copy_rows(ev)

    def handler(conn: psycopg.Connection, ev: JobReady) -> None:
        kinds["handler"].add(type(ev))
        if ev.payload.filename == "bad":
            raise PoisonMessage("refused by the handler", code="refused")
        apply_ready(conn, ev)

    events = [_ready(n) for n in ("a", "b", "bad", "c")]
    consumer = _ready_consumer(settings, "test-prepare", [*events, events[0], events[1]],
                               handler, prepare, light=light)
    st = _run_until(consumer, 6)
    assert (st.applied, st.duplicates, st.dead_lettered) == (3, 2, 1)
    rows = query(settings.database_url, "SELECT filename, count(*) AS n FROM "
                 "downstream.document_analysis GROUP BY filename ORDER BY filename")
    assert [(r["filename"], r["n"]) for r in rows] == [("a", 1), ("b", 1), ("c", 1)]
    assert query(settings.database_url,
                 "SELECT count(*) AS n FROM downstream.ledger_charge")[0]["n"] == 3
    dlq = read_topic(settings, settings.topic("job.ready.dlq"))
    assert [dict(m.headers())["dlq_reason_code"] for m in dlq] == [b"refused"]
    # Prepared in the decode-ahead thread, not in the thread that applies the batch.
    assert threads and all(n.startswith("decode-") for n in threads), threads
    # light: prepare got the checked structs; the per-event handler the models all the same.
    assert kinds == {"prepare": {fastpath.Ready if light else JobReady}, "handler": {JobReady}}


def test_a_light_batch_builds_models_only_for_hooks(settings: Settings) -> None:
    """``on_batch(light=True)``: a batch applied whole (duplicates in it) gives the hooks
    models, and the rows are those of the models."""
    kinds: dict[str, list[type]] = {"prepare": [], "applied": [], "duplicate": []}

    def prepare(ev: JobReady) -> tuple[bytes, bytes]:
        kinds["prepare"].append(type(ev))
        return copy_rows(ev)

    events = [_ready(f"e{i}") for i in range(6)]
    consumer = _ready_consumer(settings, "test-light", [*events, events[0], events[3]],
                               apply_ready, prepare, light=True)
    consumer.hooks.on_applied = lambda ev: kinds["applied"].append(type(ev))
    consumer.hooks.on_duplicate = lambda ev: kinds["duplicate"].append(type(ev))
    st = _run_until(consumer, 8)
    assert (st.applied, st.duplicates, st.dead_lettered) == (6, 2, 0)
    assert set(kinds["prepare"]) == {fastpath.Ready}
    assert kinds["applied"] == [JobReady] * 6 and kinds["duplicate"] == [JobReady] * 2
    rows = query(settings.database_url, "SELECT filename FROM downstream.document_analysis "
                 "ORDER BY id")
    assert [r["filename"] for r in rows] == [f"e{i}" for i in range(6)]
