"""Breaker10: a worker frozen (SIGSTOP) INSIDE its one-transaction claim statement, while
Postgres sends it what the claim read (``stage_claim_reads``, migration 0036: the document's
bytes come back as a column of ``claim_job_and_stage``).

A one-transaction stage run (extract of a ``text/plain`` document) holds the job's row lock
from its claim to its completion; a process paused past its lease must lose its session, and
the lock with it (``idle_in_transaction_session_timeout``, set by the claim statement), so a
frozen worker never holds a job (``Store.claim_and_complete``). That bound only covers a
session that is IDLE in its transaction. Since 0036 the claim's own answer carries the
document (up to ``max_inline_document_bytes``, 5 MiB): more than the loopback socket buffers
hold (``tcp_wmem`` max 4 MiB plus the client's unread receive buffer), so a client frozen
before it read the answer leaves its backend ``active`` in ``ClientWrite``, the job row locked
and the claim uncommitted, and no idle limit applies.

Made deterministic: the test holds the job's row lock (``FOR UPDATE``) before the relay emits
``job.accepted``, so the worker's extract claim waits on it; the worker is SIGSTOPped while it
waits; the lock is released, the claim runs and its answer blocks. A live worker then takes
the partitions over (the frozen one's Kafka session times out) and must decide the extract
stage while the other stays frozen. Real processes, shared services.

BROKE on main (e0e52a3): the frozen session stayed ``active``/``ClientWrite`` and the live
worker's claim waited for the row lock for as long as the other process was stopped (60 s
asserted, 3 runs of 3). Not new with 0036: before it, the same transaction read the document
with a separate ``get_document`` statement under the same lock. Fixed (breaker10): the claim
statement also sets ``tcp_user_timeout`` to the idle limit (``claim_job_and_stage``), so
Postgres ends a session whose answer stays unacknowledged that long. The 20 kB document is
the control: its answer fits the socket buffers, the idle limit ends the frozen session.
"""

from __future__ import annotations

import os
import signal

import psycopg
import pytest

from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, query, stopped, text_uploaded, wait_for

pytestmark = pytest.mark.e2e

SENTENCE = "Lanterns and kettles on the harbour wall, sentence after sentence. "
ENV = {"JOBSTREAM_LEASE_S": "4", "JOBSTREAM_SWEEP_GRACE_S": "1"}


def _claim_session(url: str, *, wait_event: str) -> list[dict[str, object]]:
    return query(url, "SELECT pid, state, wait_event FROM pg_stat_activity "
                      "WHERE datname = current_database() AND query ~ '^WITH j AS' "
                      "AND wait_event IS NOT DISTINCT FROM %s", (wait_event,))


def _extract(url: str) -> dict[str, object]:
    rows = query(url, "SELECT s.status, s.attempt, j.status AS job_status FROM job j "
                      "LEFT JOIN job_stage s ON s.job_id = j.job_id AND s.stage = 'extract'")
    return rows[0] if rows else {}


@pytest.mark.parametrize("size", [
    # the control: the answer fits the socket buffers, the session goes idle in its
    # transaction and the idle limit (= lease) ends it: the probe's mechanics can pass
    20_000,
    # just under max_inline_document_bytes (5 MiB): more than loopback buffers hold
    4_900_000])
def test_a_worker_frozen_while_its_claim_sends_the_document_does_not_hold_the_job(
        settings: Settings, procs: ProcessRunner, size: int) -> None:
    url = settings.database_url
    text = (SENTENCE * (size // len(SENTENCE) + 1))[:size]
    frozen = procs.start("worker", name="worker-frozen", **ENV)
    produce_raw(settings, settings.topic("document.uploaded"),
                [(b"big", encode_event(text_uploaded("big", text)))])
    wait_for(lambda: query(url, "SELECT 1 FROM job"), 90, "intake to write the job",
             procs.logs)
    with psycopg.connect(url) as holder:
        holder.execute("SELECT 1 FROM job FOR UPDATE")
        procs.start("relay", **ENV)  # job.accepted now; the extract claim waits on our lock
        wait_for(lambda: _claim_session(url, wait_event="transactionid")
                 or _claim_session(url, wait_event="tuple"), 60,
                 "the extract claim to wait for the job row lock", procs.logs)
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        wait_for(lambda: stopped(frozen.popen.pid), 10, "the worker to stop")
        holder.commit()
    try:
        if size > 1_000_000:
            # The claim ran; its answer (the document) waits for a client that does not read.
            wait_for(lambda: _claim_session(url, wait_event="ClientWrite"), 30,
                     "the frozen worker's claim to block sending the document", procs.logs)
        procs.start("worker", name="worker-live", **ENV)
        # lease 4 s, Kafka session 6 s: a minute is plenty for the live worker
        wait_for(lambda: _extract(url).get("status") in ("succeeded", "failed")
                 or _extract(url).get("job_status") in ("failed", "cancelled"), 60,
                 "the live worker to decide the extract stage while the other is frozen "
                 f"(claim sessions: {_claim_session(url, wait_event='ClientWrite')})",
                 procs.logs, every_s=1.0)
        assert stopped(frozen.popen.pid), "the frozen worker was resumed early: inconclusive"
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    # the resumed worker's claim was taken over (or never committed): one decision, no rerun
    wait_for(lambda: _claim_session(url, wait_event="ClientWrite") == [], 60,
             "the resumed worker to read its answer", procs.logs)
    row = _extract(url)
    assert row["status"] in ("succeeded", "failed"), row
