"""Breaking the COPY batch idempotent consumer (consumers/idempotent.py) from outside, with real
``consume-ready`` processes, Postgres and the broker.

A consumer frozen (SIGSTOP, a VM pause) inside its batch transaction -- the batch's
``processed_event`` rows and effects written, not committed -- past its Kafka session timeout:
the group gives its partitions to another consumer, whose insert of the same dedup keys waits
for the frozen transaction. Without a bound on that transaction's idleness the new owner (and
every partition it holds) waits for as long as the first process is frozen. On SIGCONT the
frozen one must find its transaction gone, re-apply nothing, and every event must be applied
exactly once.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from jobstream.kafka import group_lag
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import JobReady, encode_event
from tests.helpers import ProcessRunner, job_ready, query, read_topic, wait_for

pytestmark = pytest.mark.e2e


def _ready(name: str) -> JobReady:
    return job_ready(name, charge_usd=0.01)


def _produce(settings: Settings, events: list[JobReady]) -> None:
    produce_raw(settings, settings.topic("job.ready"),
                [(str(e.job_id).encode(), encode_event(e)) for e in events])


def _applied(settings: Settings) -> dict[str, int]:
    """filename -> analyses applied, checked against the ledger in the same snapshot."""
    rows = query(settings.database_url,
                 "SELECT filename, count(*) AS n, (SELECT count(*) FROM downstream.ledger_charge)"
                 " AS charges FROM downstream.document_analysis GROUP BY filename")
    out = {r["filename"]: int(r["n"]) for r in rows}
    assert not rows or rows[0]["charges"] == sum(out.values()), (rows, out)
    return out


@pytest.mark.parametrize("first", [20, 1], ids=["batch", "single"])
def test_a_consumer_frozen_inside_its_batch_transaction_does_not_hold_the_partitions(
        settings: Settings, procs: ProcessRunner, first: int) -> None:
    """``single``: the first fetch is one message (the per-message path); with
    ``poison_after`` = 1 the dead session met on resume must count as an outage, not as a
    handler error that dead-letters a valid event."""
    events = [_ready(f"e{i}") for i in range(20)]
    _produce(settings, events[:first])
    idle = {"JOBSTREAM_CONSUMER_TRANSACTION_IDLE_TIMEOUT_S": "3",
            "JOBSTREAM_CONSUMER_POISON_AFTER": "1"}
    frozen = procs.start("consume-ready", name="consumer-frozen", **idle,
                         JOBSTREAM_FAULT="consumer_inside_transaction=stop")
    try:
        wait_for(lambda: "SIGSTOP" in frozen.log_text(), 60,
                 "the consumer to freeze inside its transaction", procs.logs)
        assert _applied(settings) == {}  # nothing committed yet
        procs.start("consume-ready", name="consumer-next", **idle)
        _produce(settings, events[first:])
        wait_for(lambda: len(_applied(settings)) == 20, 60,
                 "the next owner of the partitions to apply every event while the first "
                 "consumer is frozen inside its transaction", procs.logs)
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    late = [_ready(f"late{i}") for i in range(5)]
    _produce(settings, [*late, events[0], events[7], late[0]])
    wait_for(lambda: len(_applied(settings)) == 25, 60, "the later events applied", procs.logs)
    group = settings.group("downstream-ready-applier")
    wait_for(lambda: group_lag(settings, group, [settings.topic("job.ready")]) == 0, 60,
             "every offset committed", procs.logs)
    time.sleep(2)  # a copy applied twice would show by now (the resumed batch retries at once)
    assert set(_applied(settings).values()) == {1}, _applied(settings)
    n = query(settings.database_url, "SELECT count(*) AS n FROM processed_event")[0]["n"]
    assert n == 25
    assert read_topic(settings, settings.topic("job.ready.dlq")) == []
    assert all(p.popen.poll() is None for p in procs.procs), procs.logs()
    assert "Traceback" not in "".join(p.log_text() for p in procs.procs), procs.logs()
