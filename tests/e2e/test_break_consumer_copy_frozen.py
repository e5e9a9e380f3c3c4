"""Breaker6: a ``consume-ready`` frozen (SIGSTOP, a VM pause) inside the ready applier's batch
apply statement (``apply_ready_rows``), with real consumer processes, the broker and Postgres.

The batch's ``processed_event`` rows are inserted before the effect rows, in the same
transaction, so a frozen consumer holds them, and the partitions' next owner waits on them,
until its session ends. The effect rows used to be written with a binary ``COPY ... FROM
STDIN``: a session waiting for COPY data is ``active`` (``ClientRead``), so
``idle_in_transaction_session_timeout`` (the library's bound for a paused consumer,
``transaction_idle_timeout_s``) never ended it and the partitions stayed held for as long as
the process was frozen (seen 1 run in 5 with a SIGSTOP at an arbitrary moment of a backlog).
Now each table gets one prepared ``INSERT ... SELECT * FROM unnest($1::<row type>[])``: once
the statement has run, the session is idle in transaction and the timeout ends it; a freeze
while its parameters are being sent is bounded the same way (the Bind of a prepared statement
follows a ReadyForQuery: checked by hand, docs/design-notes.md "A consumer frozen mid-apply").

Made deterministic by holding a SHARE lock on the analysis table so the consumer's INSERT waits
to start, freezing the consumer there, then releasing it: the INSERT completes and its answer
waits for a client that does not read it.
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


def _apply_session(url: str, *, state: str, wait_event: str | None
                   ) -> list[dict[str, object]]:
    # the apply statement, or the binary COPY it replaced (so the probe still fails with it)
    return query(url, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                      "AND query ~ '^(INSERT INTO|COPY) downstream\\.document_analysis' "
                      "AND state = %s AND wait_event IS NOT DISTINCT FROM %s",
                 (state, wait_event))


def test_a_consumer_frozen_mid_apply_does_not_hold_the_partitions(
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
        waiting = wait_for(lambda: _apply_session(url, state="active", wait_event="relation"),
                           60, "the consumer's apply statement waiting to start", procs.logs,
                           every_s=0.05)
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        blocker.rollback()  # the INSERT runs; its client is frozen
        procs.start("consume-ready", name="consumer-next", **env)
        wait_for(lambda: int(query(url, "SELECT count(*) AS n FROM processed_event")[0]["n"])
                 == N, 25, "the next owner to apply every event while the first consumer "
                 "is frozen mid-apply", procs.logs, every_s=0.5)
        # the frozen consumer's session was ended (idle_in_transaction_session_timeout)
        wait_for(lambda: not query(url, "SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                                   (waiting[0]["pid"],)), 10,
                 "the frozen consumer's session to be gone", procs.logs)
    finally:
        blocker.close()
        os.kill(frozen.popen.pid, signal.SIGCONT)
    rows = query(url, "SELECT dedup_key, count(*) AS n FROM downstream.document_analysis "
                      "GROUP BY dedup_key")
    assert len(rows) == N and {r["n"] for r in rows} == {1}, rows[:5]
