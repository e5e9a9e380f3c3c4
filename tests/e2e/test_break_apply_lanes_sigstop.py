"""A ``consume-ready`` SIGSTOPped from outside at an arbitrary moment while a backlog is applied
in two apply lanes (two transactions on two connections, possibly both open, anywhere in
them: the dedup insert, the ready applier's batch write, the commit), past its Kafka session and
the transaction idle limit; a second consumer takes the partitions over; then SIGCONT.
Breaker6 wrote this probe and dropped it: it failed 1 run in 5 on the mid-COPY freeze (the
session ``active``/ClientRead inside ``COPY FROM STDIN``, no idle limit), which consumer6
replaced with one INSERT ... SELECT FROM unnest statement (migration 0035). Every event applied
once, nothing dead-lettered (``poison_after`` 1: a dead session met on resume must count as an
outage), every offset committed, both consumers alive. Real processes, shared services.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from jobstream.kafka import group_lag
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, job_ready, produce_at, query, read_topic, wait_for

#: consumer6's fix (the ready applier's batch write as one INSERT ... SELECT FROM unnest
#: statement, migration 0035): without it a freeze inside COPY FROM STDIN holds the partitions
#: (test_break_consumer_copy_frozen.py, xfail strict there) and this probe fails 1 run in 5.
_UNNEST_APPLY = any((Path(__file__).resolve().parents[2] / "jobstream" / "migrations").glob(
    "0035_*.sql"))
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    not _UNNEST_APPLY, reason="needs consumer6's unnest apply (migration 0035): a freeze "
    "mid-COPY is the known open break of test_break_consumer_copy_frozen.py")]



def test_a_consumer_sigstopped_mid_lanes_past_its_session_applies_each_event_once(
        settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("job.ready")
    events = [job_ready(f"stop{i}", charge_usd=0.25) for i in range(2400)]
    produce_at(settings, topic, [(i % 3, str(e.job_id).encode(), encode_event(e))
                               for i, e in enumerate(events)]
             + [((i + 2) % 3, str(e.job_id).encode(), encode_event(e))
                for i, e in enumerate(events) if i % 11 == 0])
    env = {"JOBSTREAM_CONSUMER_APPLY_LANES": "2", "JOBSTREAM_CONSUMER_BATCH_SIZE": "400",
           "JOBSTREAM_CONSUMER_TRANSACTION_IDLE_TIMEOUT_S": "3",
           "JOBSTREAM_CONSUMER_POISON_AFTER": "1"}
    url = settings.database_url

    def done() -> int:
        return int(query(url, "SELECT count(*) AS n FROM processed_event")[0]["n"])

    frozen = procs.start("consume-ready", name="consumer-frozen", **env)
    try:
        wait_for(lambda: done() >= 300, 60, "some batches applied", procs.logs, every_s=0.02)
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        assert done() < len(events), "drained before the freeze: probe too small"
        procs.start("consume-ready", name="consumer-next", **env)
        wait_for(lambda: done() == len(events), 90,
                 "the next consumer to apply everything while the first is frozen",
                 lambda: _sessions(url) + procs.logs(), every_s=0.5)
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    group = settings.group("downstream-ready-applier")
    wait_for(lambda: group_lag(settings, group, [topic]) == 0, 60, "every offset committed",
             procs.logs, every_s=0.5)
    time.sleep(2)  # the resumed consumer's retried batch would show by now
    rows = query(url, "SELECT a.dedup_key, count(*) AS n, (SELECT count(*) FROM "
                      "downstream.ledger_charge c WHERE c.dedup_key = a.dedup_key) AS charges "
                      "FROM downstream.document_analysis a GROUP BY a.dedup_key")
    got = {r["dedup_key"]: (int(r["n"]), int(r["charges"])) for r in rows}
    assert len(got) == len(events) and set(got.values()) == {(1, 1)}, \
        {k: v for k, v in got.items() if v != (1, 1)}
    assert done() == len(events)
    assert read_topic(settings, topic + ".dlq") == []
    assert all(p.popen.poll() is None for p in procs.procs), procs.logs()
    assert "Traceback" not in "".join(p.log_text() for p in procs.procs), procs.logs()


def _sessions(url: str) -> str:
    """The test database's sessions (state, what they wait for, their query): why a
    consumer waits."""
    rows = query(url, "SELECT pid, application_name, state, wait_event_type, wait_event, "
                      "now() - xact_start AS xact_age, left(query, 120) AS q FROM "
                      "pg_stat_activity WHERE datname = current_database() AND pid <> "
                      "pg_backend_pid()")
    return "\n".join(str(r) for r in rows) + "\n"
