"""Breaker6: a ``consume-ready`` frozen (SIGSTOP, a VM pause) in the middle of its binary
``COPY ... FROM STDIN`` (the ready applier's batch path, ``apply_ready_rows``), with real
consumer processes, the broker and Postgres.

The batch's ``processed_event`` rows are inserted before the COPY, in the same transaction.
A session waiting for COPY data from its client is ``active`` (``ClientRead``), not idle in
transaction, so ``idle_in_transaction_session_timeout`` (the library's bound for a paused
consumer, ``transaction_idle_timeout_s``) never ends it, and ``statement_timeout`` is not acted
on while the backend waits for the client (checked by hand: the lock stays until the client
writes again). The partitions' next owner waits on those rows for as long as the process is
frozen: nothing applied on the batch's partitions (seen 1 run in 5 with a SIGSTOP at an
arbitrary moment of a backlog; made deterministic here by holding a SHARE lock on the analysis
table so the consumer's COPY waits to start, freezing the consumer there, then releasing it:
the server enters COPY IN and waits for data that never comes).
"""

from __future__ import annotations

import os
import signal

import psycopg
import pytest
from confluent_kafka import Producer

from jobstream.kafka import producer_config
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, job_ready, query, wait_for

pytestmark = pytest.mark.e2e

N = 300


def _copy_session(url: str, wait_event: str) -> list[dict[str, object]]:
    return query(url, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                      "AND query LIKE 'COPY downstream.document_analysis%%' "
                      "AND wait_event = %s", (wait_event,))


@pytest.mark.xfail(strict=True, reason="a consumer frozen mid-COPY FROM STDIN holds its batch's "
                   "processed_event rows for as long as it is frozen (no server-side bound: "
                   "the session is active, ClientRead); the fix (COPY into a session-private "
                   "temp table before the batch transaction, or INSERT ... SELECT FROM unnest "
                   "instead of COPY) is the consumer path's owner's call")
def test_a_consumer_frozen_mid_copy_does_not_hold_the_partitions(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("job.ready")
    producer = Producer(producer_config(settings))
    events = [job_ready(f"copy{i}", charge_usd=0.5) for i in range(N)]
    for i, e in enumerate(events):
        producer.produce(topic, value=encode_event(e), key=str(e.job_id).encode(),
                         partition=i % 3)
    assert producer.flush(60) == 0
    env = {"JOBSTREAM_CONSUMER_TRANSACTION_IDLE_TIMEOUT_S": "3"}
    blocker = psycopg.connect(url)
    blocker.execute("LOCK TABLE downstream.document_analysis IN SHARE MODE")
    frozen = procs.start("consume-ready", name="consumer-frozen", **env)
    try:
        wait_for(lambda: _copy_session(url, "relation"), 60,
                 "the consumer's COPY waiting to start", procs.logs, every_s=0.05)
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        blocker.rollback()  # the COPY starts; its client is frozen
        wait_for(lambda: _copy_session(url, "ClientRead"), 30,
                 "the frozen consumer's session inside COPY FROM STDIN", procs.logs)
        procs.start("consume-ready", name="consumer-next", **env)
        wait_for(lambda: int(query(url, "SELECT count(*) AS n FROM processed_event")[0]["n"])
                 == N, 25, "the next owner to apply every event while the first consumer "
                 "is frozen mid-COPY", procs.logs, every_s=0.5)
    finally:
        blocker.close()
        os.kill(frozen.popen.pid, signal.SIGCONT)
    rows = query(url, "SELECT dedup_key, count(*) AS n FROM downstream.document_analysis "
                      "GROUP BY dedup_key")
    assert len(rows) == N and {r["n"] for r in rows} == {1}, rows[:5]
