"""breaker11: every outbox writer's wake-up lost. perf-notify9 moves the relay's wake-up from
the outbox trigger's NOTIFY (sent at commit, inside the transaction) to the writers, after
their commit; a writer killed between its commit and its wake-up leaves a committed row that
no NOTIFY announces. The worst case of that window is every commit silent: here the outbox's
NOTIFY trigger is disabled in the test's database (where one exists), the stage workers are
killed (SIGKILL) right after a stage's commit (``stage_after_commit_before_offset``) and
restarted, and the relay has nothing but its polling fallback (``relay_poll_interval_s``) and
its caught-up look. Every job must still succeed, be applied and charged once.

Real worker, relay and ``consume-ready`` processes; shared services.
"""

from __future__ import annotations

import psycopg
import pytest

from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import (
    ProcessRunner,
    assert_jobs_succeed_charged_once,
    query,
    text_uploaded,
    wait_for,
)

pytestmark = pytest.mark.e2e

N = 4
KILLS = 3


def _silence_outbox(url: str) -> list[str]:
    """Disable every trigger on ``outbox`` whose function calls ``pg_notify`` (the writers'
    wake-up at commit). Returns their names."""
    names = [r["tgname"] for r in query(url, """
        SELECT t.tgname FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
         WHERE t.tgrelid = 'outbox'::regclass AND NOT t.tgisinternal
           AND position('pg_notify' IN p.prosrc) > 0""")]
    with psycopg.connect(url, autocommit=True) as conn:
        for name in names:
            conn.execute(psycopg.sql.SQL("ALTER TABLE outbox DISABLE TRIGGER {}").format(
                psycopg.sql.Identifier(name)))
    return names


#: Every writer wakes the relay by the outbox trigger's NOTIFY (perf-notify9's setting; a
#: version without the setting ignores the variable): with the trigger disabled, no commit
#: wakes the relay.
ENV = {"JOBSTREAM_OUTBOX_NOTIFY": "in_transaction"}


def test_jobs_finish_when_no_commit_wakes_the_relay(settings: Settings,
                                                    procs: ProcessRunner) -> None:
    url = settings.database_url
    silenced = _silence_outbox(url)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute("LISTEN outbox_v1")
        procs.start("relay", **ENV)
        procs.start("consume-ready", **ENV)
        docs = [text_uploaded(f"silent-{i}", f"Silent doc {i}. " + "Some words. " * 60)
                for i in range(N)]
        produce_raw(settings, settings.topic("document.uploaded"),
                    [(d.idempotency_key.encode(), encode_event(d)) for d in docs])
        # Workers killed -9 right after a stage's commit, KILLS times, each restarted.
        for k in range(KILLS):
            w = procs.start("worker", name=f"worker-killed-{k}", **ENV,
                            JOBSTREAM_FAULT="stage_after_commit_before_offset@2")
            wait_for(lambda w=w: w.popen.poll() is not None, 120,  # type: ignore[misc]
                     "the worker killed after a stage's commit", procs.logs)
        procs.start("worker", name="worker", **ENV)
        assert_jobs_succeed_charged_once(settings, procs, N, timeout_s=180)
        heard = list(listener.notifies(timeout=0.1))
    assert silenced, "no NOTIFY trigger on the outbox: the probe silenced nothing"
    assert heard == [], f"a NOTIFY reached the relay's channel: {heard}"
