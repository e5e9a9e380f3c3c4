"""Breaking the intake batches (``Store.intake_batch``'s fast path and its fallback when a race
is lost) with duplicate delivery across partitions, with two real intake workers, Kafka and
Postgres.

A producer that keys ``document.uploaded`` by something else than the idempotency key (or
re-sends a request through another path) puts copies of one intent on different partitions,
so two workers' batches accept them at the same time; and one document under several
idempotency keys (one dedup key) races the same way. Whatever the interleaving: one job per
dedup key, every idempotency key bound to the job of its document, one ``intake`` checkpoint
and one ``job.accepted`` outbox row per job, nothing dead-lettered, the lag 0.
"""

from __future__ import annotations

import uuid

import pytest

from jobstream.kafka import group_lag
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, query, read_topic, wait_for
from tests.helpers import text_uploaded as _uploaded

pytestmark = pytest.mark.e2e

DOCS, KEYS, COPIES = 10, 4, 2


def test_copies_of_intents_on_different_partitions_make_one_job_per_document(
        settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("document.uploaded")
    env = {"JOBSTREAM_LEASE_S": "5"}
    a = procs.start("worker", "--stages", "intake", name="intake-a", **env)
    b = procs.start("worker", "--stages", "intake", name="intake-b", **env)
    wait_for(lambda: all("Setting newly assigned partitions" in p.log_text() for p in (a, b)),
             90, "both intake workers assigned partitions", procs.logs)
    msgs = []
    for _copy in range(COPIES):
        for k in range(KEYS):
            for d in range(DOCS):
                ev = _uploaded(f"d{d}-k{k}", f"Document {d}: the same text under {KEYS} keys.")
                # A fresh Kafka key per copy: the copies spread over the partitions.
                msgs.append((uuid.uuid4().bytes, encode_event(ev)))
    produce_raw(settings, topic, msgs)
    url = settings.database_url
    wait_for(lambda: group_lag(settings, settings.group("jobstream-streams"), [topic]) == 0,
             120, "document.uploaded consumed and committed", procs.logs, every_s=1.0)
    jobs = query(url, "SELECT job_id, filename FROM job")
    assert len(jobs) == DOCS, jobs
    bound = query(url, "SELECT r.idempotency_key, j.filename FROM job_request r "
                       "JOIN job j USING (job_id)")
    assert len(bound) == DOCS * KEYS, bound
    # Every key is bound to the job of ITS document (d<n>-k<m> -> a job of document n).
    assert all(r["idempotency_key"].split("-")[0] == r["filename"].split("-")[0]
               for r in bound), bound
    assert query(url, "SELECT count(*) AS n FROM job_stage WHERE stage = 'intake' "
                      "AND status = 'succeeded'")[0]["n"] == DOCS
    accepted = query(url, "SELECT count(*) AS n, count(DISTINCT kafka_key) AS k FROM outbox "
                          "WHERE event_type = 'job.accepted'")[0]
    assert accepted["n"] == accepted["k"] == DOCS, accepted
    assert read_topic(settings, topic + ".dlq") == []
    assert all(" -> " in p.log_text() for p in (a, b)), "one worker took no event: inconclusive"
    assert a.popen.poll() is None and b.popen.poll() is None, procs.logs()
    assert "Traceback" not in a.log_text() + b.log_text(), procs.logs()
