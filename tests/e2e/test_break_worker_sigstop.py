"""A stage worker SIGSTOPped from outside at an arbitrary moment of a burst (not at a fault
point: wherever it is -- faust's fetcher handing messages to the streams through the delivery
fast path (``streams/delivery.py``), a shared stage transaction, the local llm stage's one
transaction, an offset commit), past its lease and its Kafka session, while a second worker
shares the group; then resumed. Real relay, workers, ``consume-ready``, Postgres and broker.

Every job must succeed once: one ``job.ready`` per job on the topic, one analysis and one
charge downstream, one ``succeeded`` provider attempt per chunk, nothing dead-lettered, the
group's lag 0, both workers alive.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from jobstream.kafka import STAGE_TOPICS, group_lag
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, count, query, read_topic, stopped, wait_for
from tests.helpers import text_uploaded as _uploaded

pytestmark = pytest.mark.e2e


def _succeeded(settings: Settings) -> int:
    return count(settings, "SELECT count(*) AS n FROM job WHERE status = 'succeeded'")


def _docs(prefix: str, n: int) -> list[tuple[bytes, bytes]]:
    docs = [_uploaded(f"{prefix}{i}", f"Document {prefix}{i}. " + "A sentence of text. " * 60)
            for i in range(n)]
    return [(d.idempotency_key.encode(), encode_event(d)) for d in docs]


def test_a_worker_sigstopped_mid_burst_past_its_session_keeps_effects_exactly_once(
        settings: Settings, procs: ProcessRunner) -> None:
    env = {"JOBSTREAM_LEASE_S": "4", "JOBSTREAM_CHUNK_SIZE_CHARS": "400"}
    procs.start("relay", **env)
    procs.start("consume-ready", **env)
    frozen = procs.start("worker", name="worker-a", **env)
    live = procs.start("worker", name="worker-b", **env)
    topic = settings.topic("document.uploaded")
    # Submit once BOTH workers hold partitions (the second to join triggers the rebalance
    # that shares them), as tests/integration/test_scale_out.py does.
    wait_for(lambda: all("Setting newly assigned partitions" in p.log_text()
                         for p in (frozen, live)), 90, "both workers assigned partitions",
             procs.logs)
    total = 48
    produce_raw(settings, topic, _docs("burst", total))
    wait_for(lambda: _succeeded(settings) >= 12, 120, "the burst under way", procs.logs)
    os.kill(frozen.popen.pid, signal.SIGSTOP)
    assert " -> done" in frozen.log_text(), "the frozen worker held no work: inconclusive"
    try:
        wait_for(lambda: _succeeded(settings) == total, 180,
                 "the live worker to finish every job while the other is frozen", procs.logs,
                 every_s=1.0)
        assert stopped(frozen.popen.pid), "the frozen worker was resumed early: inconclusive"
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    topics = [settings.topic(t) for t in STAGE_TOPICS]
    wait_for(lambda: group_lag(settings, settings.group("jobstream-streams"), topics) == 0, 120,
             "every stage topic consumed and committed after the resume", procs.logs,
             every_s=1.0)
    url = settings.database_url
    wait_for(lambda: query(url, "SELECT count(*) AS n FROM downstream.ledger_charge")[0]["n"]
             >= total, 60, "every result applied downstream", procs.logs)
    time.sleep(2)  # a late duplicate from the resumed worker would show by now
    assert _succeeded(settings) == total
    per_job = query(url, "SELECT j.job_id, (SELECT count(*) FROM downstream.document_analysis a "
                         "WHERE a.dedup_key = j.dedup_key) AS a, (SELECT count(*) FROM "
                         "downstream.ledger_charge c WHERE c.dedup_key = j.dedup_key) AS c "
                         "FROM job j")
    assert {(r["a"], r["c"]) for r in per_job} == {(1, 1)}, per_job
    attempts = query(url, "SELECT job_id, chunk_idx, count(*) AS n FROM provider_attempt "
                          "GROUP BY job_id, chunk_idx HAVING count(*) <> 1 OR "
                          "bool_or(outcome <> 'succeeded')")
    assert attempts == [], attempts
    ready = read_topic(settings, settings.topic("job.ready"))
    keys = [m.key() for m in ready]
    assert len(keys) == total and len(set(keys)) == total, len(keys)
    for t in STAGE_TOPICS:
        assert read_topic(settings, settings.topic(t + ".dlq")) == [], t
    assert frozen.popen.poll() is None and live.popen.poll() is None, procs.logs()
    assert "Traceback" not in frozen.log_text() + live.log_text(), procs.logs()
