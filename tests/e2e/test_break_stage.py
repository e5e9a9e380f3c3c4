"""Breaking the one-transaction stages (``Store.claim_and_complete``, streams/runner.py) from
outside, with a real worker, relay, Postgres and broker.

Postgres refuses a one-transaction stage's completion with an error that is not about the
data (here a constraint trigger: ``check_violation``, as a constraint added by a migration
or an operator would). The transaction rolls back with the claim in it; the run must still end
as a two-transaction run ends after a bug (README "Bad input": the stage fails, the job fails
at once with ``internal_error`` and a ``job.failed`` event, the message is dead-lettered as
``unhandled``), not leave the job open with no run, no lease and nothing left to move it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import psycopg
import pytest

from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, query, read_topic, wait_for
from tests.helpers import text_uploaded as _uploaded

pytestmark = pytest.mark.e2e

REFUSE_CHUNK = """
CREATE FUNCTION break_refuse_chunk() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.stage = 'chunk' AND NEW.status = 'succeeded' THEN
    RAISE EXCEPTION 'chunk completion refused by a constraint' USING ERRCODE = 'check_violation';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER break_refuse_chunk BEFORE INSERT OR UPDATE ON job_stage
  FOR EACH ROW EXECUTE FUNCTION break_refuse_chunk();
"""


def _job(settings: Settings, key: str) -> dict:
    rows = query(settings.database_url, "SELECT job_id, status, error_code, current_stage "
                                        "FROM job WHERE idempotency_key = %s", (key,))
    return rows[0] if rows else {}


def _ended(settings: Settings, key: str) -> dict:
    """The job of ``key`` once it is terminal, else ``{}``."""
    job = _job(settings, key)
    return job if job.get("status") in ("failed", "succeeded", "cancelled") else {}



def _job_failed_events(settings: Settings, procs: ProcessRunner, job_id: object) -> list[Any]:
    """The ``job.failed`` messages of ``job_id`` on the topic, once the outbox is drained."""
    wait_for(lambda: not query(settings.database_url,
                               "SELECT 1 FROM outbox WHERE published_at IS NULL"),
             60, "the job.failed event published", procs.logs)
    return [m for m in read_topic(settings, settings.topic("job.failed"))
            if m.key().decode() == str(job_id)]

def test_a_one_transaction_completion_postgres_refuses_fails_the_job_once(
        settings: Settings, procs: ProcessRunner) -> None:
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        conn.execute(REFUSE_CHUNK)
    procs.start("relay")
    worker = procs.start("worker", JOBSTREAM_STAGE_ONE_TRANSACTION="true")
    ev = _uploaded("refused", "One short document. It has two sentences.")
    produce_raw(settings, settings.topic("document.uploaded"), [(b"refused", encode_event(ev))])
    job = wait_for(lambda: _ended(settings, "refused"), 90,
                   "the job whose chunk completion Postgres refuses to end", procs.logs)
    assert (job["status"], job["error_code"]) == ("failed", "internal_error"), job
    stages = {r["stage"]: (r["status"], r["attempt"]) for r in query(
        settings.database_url, "SELECT stage, status, attempt FROM job_stage WHERE job_id = %s",
        (job["job_id"],))}
    assert stages["chunk"] == ("failed", 1), stages
    failed = _job_failed_events(settings, procs, job["job_id"])
    assert len(failed) == 1, failed
    dlq = read_topic(settings, settings.topic("job.text_extracted.dlq"))
    assert [dict(m.headers())["dlq_reason_code"] for m in dlq] == [b"unhandled"], dlq

    # The worker goes on: with the constraint gone the next document completes.
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        conn.execute("DROP TRIGGER break_refuse_chunk ON job_stage")
    ok = _uploaded("ok", "Another short document. It completes every stage.")
    produce_raw(settings, settings.topic("document.uploaded"), [(b"ok", encode_event(ok))])
    wait_for(lambda: _job(settings, "ok").get("status") == "succeeded", 90,
             "the next document to succeed", procs.logs)
    assert worker.popen.poll() is None, procs.logs()


SLOW_CHUNK = """
CREATE FUNCTION break_slow_chunk() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.stage = 'chunk' AND NEW.status = 'succeeded' THEN
    PERFORM pg_sleep(3);
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER break_slow_chunk BEFORE INSERT OR UPDATE ON job_stage
  FOR EACH ROW EXECUTE FUNCTION break_slow_chunk();
"""


def test_a_one_transaction_completion_over_statement_timeout_ends_in_the_retry_budget(
        settings: Settings, procs: ProcessRunner) -> None:
    """Postgres cancels a one-transaction stage's completion (``statement_timeout``) every
    time: an outage to the worker, so the event goes round the retry topic, the claim rolling
    back each time (no attempt counted); when the budget is spent the job must fail once
    (``retry_budget_exhausted``, one ``job.failed``), never stay open."""
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        conn.execute(SLOW_CHUNK)
        dbname = conn.info.dbname
        conn.execute(f'ALTER DATABASE "{dbname}" SET statement_timeout = \'1s\'')
    procs.start("relay")
    worker = procs.start("worker", JOBSTREAM_STAGE_ONE_TRANSACTION="true",
                         JOBSTREAM_RETRY_ROUNDS="1",
                         JOBSTREAM_RETRY_IN_PLACE="0", JOBSTREAM_RETRY_BASE_S="0.1")
    ev = _uploaded("slow", "A document whose chunks Postgres takes too long to store.")
    produce_raw(settings, settings.topic("document.uploaded"), [(b"slow", encode_event(ev))])
    job = wait_for(lambda: _ended(settings, "slow"), 90,
                   "the job whose chunk completion always times out to end", procs.logs)
    assert (job["status"], job["error_code"]) == ("failed", "retry_budget_exhausted"), job
    assert "statement timeout" in worker.log_text(), procs.logs()
    failed = _job_failed_events(settings, procs, job["job_id"])
    assert len(failed) == 1, failed
    assert not query(settings.database_url, "SELECT 1 FROM job_stage WHERE job_id = %s AND "
                     "stage = 'chunk' AND status = 'succeeded'", (job["job_id"],))


def test_a_lone_worker_frozen_inside_a_one_transaction_stage_finishes_the_job_when_resumed(
        settings: Settings, procs: ProcessRunner) -> None:
    """The only worker freezes inside a one-transaction stage past its lease: Postgres ends its
    session (``idle_in_transaction_session_timeout``), the claim rolls back. No other worker
    takes over. On SIGCONT its completion meets the dead session: that is an outage (retry
    the event), not a bug -- the job must still succeed, once, not be dead-lettered
    (``unhandled``) with the job left open, nor failed."""
    procs.start("relay")
    frozen = procs.start("worker", JOBSTREAM_STAGE_ONE_TRANSACTION="true", JOBSTREAM_LEASE_S="3",
                         JOBSTREAM_FAULT="stage_inside_one_transaction@1=stop")
    ev = _uploaded("paused", "A document. The worker pauses inside its extract transaction.")
    produce_raw(settings, settings.topic("document.uploaded"), [(b"paused", encode_event(ev))])
    try:
        wait_for(lambda: "SIGSTOP" in frozen.log_text(), 60,
                 "the worker to freeze inside a one-transaction stage", procs.logs)
        wait_for(lambda: not query(settings.database_url,
                                   "SELECT 1 FROM pg_stat_activity WHERE datname = "
                                   "current_database() AND state LIKE 'idle in transaction%%'"),
                 60, "Postgres to end the frozen worker's session", procs.logs)
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    job = wait_for(lambda: _ended(settings, "paused"), 90, "the job to end", procs.logs)
    assert (job["status"], job["error_code"]) == ("succeeded", None), (job, procs.logs())
    assert "database unavailable" in frozen.log_text(), procs.logs()  # it met the dead session
    stages = query(settings.database_url, "SELECT stage, status, attempt FROM job_stage "
                   "WHERE job_id = %s AND stage <> 'intake'", (job["job_id"],))
    assert {s["status"] for s in stages} == {"succeeded"} and len(stages) == 5, stages
    assert read_topic(settings, settings.topic("job.accepted.dlq")) == []
    wait_for(lambda: not query(settings.database_url,
                               "SELECT 1 FROM outbox WHERE published_at IS NULL"),
             60, "every event published", procs.logs)
    ready = [m for m in read_topic(settings, settings.topic("job.ready"))
             if m.key().decode() == str(job["job_id"])]
    assert len(ready) == 1, ready
    assert frozen.popen.poll() is None, procs.logs()
