"""A writer SIGKILLed between its commit and its wake-up of the relay (issue 12, perf-notify9:
the NOTIFY after the commit, migration 0039). Real processes: a stage worker whose intake batch
commits its ``job.accepted`` outbox row and dies at ``outbox_after_commit_before_wake``, a relay,
Postgres and the broker.

No NOTIFY reaches the relay's channel (the trigger is silent in the worker's session and the
wake-up never went out), and the row is published all the same: the relay's poll
(``relay_poll_interval_s``) finds it. The time it took is printed, not asserted (speed lives in
bench/). The poll is 2 s here and the relay's other timed wake-up (its lock session's keep-alive,
every ``relay_lock_timeout_s`` / 3) 200 s away, so a relay that only woke on a NOTIFY would
leave the row past the test's 30 s wait (``JOBSTREAM_RELAY_POLL_INTERVAL_S=3600`` in
``RELAY_ENV`` makes this test fail)."""

from __future__ import annotations

import time

import psycopg
import pytest

from jobstream.producer import produce_raw
from jobstream.settings import Settings
from outbox_relay.relay import CHANNEL
from schemas.events import encode_event
from tests.helpers import ProcessRunner, query, text_uploaded, wait_for

pytestmark = pytest.mark.e2e

RELAY_ENV = {"JOBSTREAM_RELAY_POLL_INTERVAL_S": "2", "JOBSTREAM_RELAY_LOCK_TIMEOUT_S": "600"}


def test_a_writer_killed_between_commit_and_wake_up_has_its_row_published_by_the_poll(
        settings: Settings, procs: ProcessRunner) -> None:
    url = settings.database_url
    relay = procs.start("relay", **RELAY_ENV)
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the relay to be active",
             procs.logs)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")  # a constant channel name
        doc = text_uploaded("killed-writer", "a document whose intake dies before its wake-up")
        produce_raw(settings, settings.topic("document.uploaded"),
                    [(doc.idempotency_key.encode(), encode_event(doc))])
        worker = procs.start("worker", "--stages", "intake",
                             JOBSTREAM_FAULT="outbox_after_commit_before_wake")
        worker.popen.wait(120)  # it SIGKILLs itself right after the intake batch's commit
        assert worker.popen.returncode == -9, procs.logs()
        killed_at = time.monotonic()
        assert "[fault] outbox_after_commit_before_wake" in worker.log_text()
        wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 30,
                 "the committed job.accepted row published without a wake-up",
                 lambda: str(query(url, "SELECT id, event_type FROM outbox")) + procs.logs())
        print(f"published {time.monotonic() - killed_at:.2f} s after the writer died "
              f"(relay poll {RELAY_ENV['JOBSTREAM_RELAY_POLL_INTERVAL_S']} s)")
        assert list(listener.notifies(timeout=0.5)) == []  # nothing woke the relay
    published = query(url, "SELECT event_type FROM outbox_published")
    assert [r["event_type"] for r in published] == ["job.accepted"], published
    assert query(url, "SELECT idempotency_key FROM job") == [
        {"idempotency_key": "killed-writer"}]
