"""The relay's wake-up after the commit (issue 12, perf-notify9; migration 0039) on real
Postgres: each Store path that writes outbox rows (intake, an intake batch, a completion, a
one-transaction stage, ``add_outbox`` in ``Store.tx``) sends exactly one NOTIFY on the relay's
channel, after its commit and not inside it; a transaction that rolled back or wrote no outbox
row sends none; a session that does not say it wakes the relay itself (another tool, the relay's
own connection, ``outbox_notify=in_transaction``) still gets the trigger's NOTIFY."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from jobstream.settings import Settings
from jobstream.store import Claim, Store
from outbox_relay.relay import CHANNEL
from streams.context import StageContext
from streams.intake import intake_intent
from tests.helpers import ProcessRunner, query, text_uploaded, wait_for
from tests.integration.test_stage_transactions import (  # noqa: F401  (fixtures)
    FIRST,
    SECOND,
    _claim_kw,
    _done,
    _msg,
    job_id,
    store,
)

pytestmark = pytest.mark.integration


class Listener:
    """A session LISTENing on the relay's channel: :meth:`wakes` counts what arrived."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(f"LISTEN {CHANNEL}")  # a constant channel name

    def wakes(self, expect: int) -> int:
        """The notifications received since the last call: waits (10 s at most) for
        ``expect`` of them, then 0.3 s more for any extra one."""
        got: list[Any] = []
        if expect:
            wait_for(lambda: got.extend(self.conn.notifies(timeout=0.2)) or len(got) >= expect,
                     10, f"{expect} wake-up(s)")
        got.extend(self.conn.notifies(timeout=0.3))
        return len(got)


@pytest.fixture
def listener(settings: Settings) -> Iterator[Listener]:
    lis = Listener(settings.database_url)
    yield lis
    lis.conn.close()


def test_each_store_write_wakes_the_relay_once_after_its_commit(
        listener: Listener, store: Store, job_id: uuid.UUID,  # noqa: F811  (fixtures)
        settings: Settings) -> None:
    assert listener.wakes(1) == 1  # the job_id fixture's Store.intake

    with store.tx() as conn:
        store.add_outbox(conn, _msg("test.row", job_id, {"n": 1}))
        assert listener.wakes(0) == 0  # not inside the transaction: the trigger is silent
    assert listener.wakes(1) == 1

    with pytest.raises(RuntimeError), store.tx() as conn:
        store.add_outbox(conn, _msg("test.row", job_id, {"n": 2}))
        raise RuntimeError("rolled back")
    assert listener.wakes(0) == 0

    claim = store.claim(**_claim_kw(job_id, FIRST))
    assert isinstance(claim, Claim)
    assert listener.wakes(0) == 0  # a claim writes no outbox row
    store.complete(claim, **_done(claim, {"text": "t"}))  # complete_stage_emit
    assert listener.wakes(1) == 1

    def work(c: Claim) -> dict[str, Any]:
        return _done(c, {"chunks": 1})
    got, err = store.claim_and_complete(work, **_claim_kw(job_id, SECOND))
    assert err is None and isinstance(got, Claim)
    assert listener.wakes(1) == 1

    ctx = StageContext(settings, store)
    out = store.intake_batch([intake_intent(ctx, text_uploaded(f"b{i}", f"document {i}"))
                              for i in range(3)])
    assert len(out) == 3
    assert listener.wakes(1) == 1  # one per transaction, not per row


def test_sessions_that_do_not_wake_the_relay_themselves_keep_the_triggers_notify(
        listener: Listener, settings: Settings) -> None:
    url = settings.database_url
    msg = _msg("test.row", uuid.uuid4(), {"n": 1})
    with psycopg.connect(url) as plain:  # another tool, the relay's own connection
        with plain.transaction():
            Store.add_outbox(plain, msg)  # type: ignore[arg-type]  # tuple rows suffice here
        assert listener.wakes(1) == 1
    in_tx = Store(url, max_size=1, outbox_notify="in_transaction")
    try:
        with in_tx.tx() as conn:
            in_tx.add_outbox(conn, msg)
        assert listener.wakes(1) == 1  # the trigger's, at the commit
    finally:
        in_tx.close()


def test_a_lone_store_commit_wakes_a_real_relay_after_its_commit(
        settings: Settings, procs: ProcessRunner) -> None:
    """The post-commit NOTIFY reaches a relay process whose polling fallback is a minute
    (``test_relay_notify.py`` does the same for the trigger's NOTIFY of a plain session)."""
    url = settings.database_url
    relay = procs.start("relay", JOBSTREAM_RELAY_POLL_INTERVAL_S="60")
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the relay to be active",
             procs.logs)
    time.sleep(0.5)  # past its first look: now it waits for a NOTIFY (fallback: 60 s)
    writer = Store(url, max_size=1)
    try:
        with writer.tx() as conn:
            msg = _msg("test.row", uuid.uuid4(), {"n": 1})
            writer.add_outbox(conn, dataclasses.replace(msg, topic=settings.topic("job.failed")))
    finally:
        writer.close()
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 20,
             "the lone row published (only the wake-up can wake the relay in time)",
             procs.logs)
    assert [r["event_type"] for r in query(url, "SELECT event_type FROM outbox_published")
            ] == ["test.row"]
