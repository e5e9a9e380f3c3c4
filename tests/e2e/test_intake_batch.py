"""The intake agent in batches (issue 12), with real worker processes: a burst with duplicates
and hostile events yields one job per distinct document and a dead letter per bad event, in
shared transactions; a worker killed mid-batch (before the batch commits, or after it and
before the offset commit) loses nothing and duplicates nothing.
"""

from __future__ import annotations

import pytest

from jobstream.kafka import group_lag
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import DocumentUploaded, encode_event
from tests.helpers import (
    ProcessRunner,
    assert_each_document_accepted_once,
    count,
    query,
    read_topic,
    wait_for,
)
from tests.helpers import text_uploaded as _uploaded

pytestmark = pytest.mark.e2e


def _kv(ev: DocumentUploaded) -> tuple[bytes, bytes]:
    return ev.idempotency_key.encode(), encode_event(ev)


def _drained(settings: Settings) -> bool:
    topic = settings.topic("document.uploaded")
    return group_lag(settings, settings.group("jobstream-streams"), [topic]) == 0


def test_burst_with_duplicates_and_hostile_events_one_job_per_document_and_dead_letters(
        settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("document.uploaded")
    docs = [_uploaded(f"k{i}", f"document number {i}, of the burst") for i in range(24)]
    wrong_hash = _uploaded("bad-hash", "its hash is not this", sha256="0" * 64)
    conflict = _uploaded("k2", "the key k2 again, with another body")
    reused = _uploaded("k5-other-key", "document number 5, of the burst")  # same document
    msgs = [_kv(d) for d in docs[:12]]
    msgs += [(b"x", b"this is not json {"), _kv(wrong_hash), _kv(conflict), _kv(docs[3]),
             _kv(reused), _kv(docs[7])]  # hostile ones and duplicates in the middle
    msgs += [_kv(d) for d in docs[12:]] + [_kv(docs[20])]
    produce_raw(settings, topic, msgs)  # all there before the worker starts: one burst

    procs.start("worker", "--stages", "intake")
    wait_for(lambda: _drained(settings), 120, "document.uploaded consumed and committed",
             procs.logs, every_s=1.0)

    jobs = query(settings.database_url, "SELECT idempotency_key, created_at FROM job")
    assert sorted(j["idempotency_key"] for j in jobs) == sorted(d.idempotency_key for d in docs)
    assert count(settings, "SELECT count(*) AS n FROM outbox WHERE event_type = "
                            "'job.accepted'") == len(docs)
    assert count(settings, "SELECT count(*) AS n FROM job_stage WHERE stage = 'intake'"
                  ) == len(docs)
    # Accepted in batches: jobs share their transaction's timestamp.
    assert len({j["created_at"] for j in jobs}) < len(docs), jobs
    # The other key for document 5 is bound to its job.
    bound = query(settings.database_url,
                  "SELECT r.idempotency_key, r.job_id = j.job_id AS same FROM job_request r "
                  "JOIN job j ON j.tenant_id = r.tenant_id AND j.idempotency_key = 'k5' "
                  "WHERE r.idempotency_key IN ('k5', 'k5-other-key')")
    assert len(bound) == 2 and all(r["same"] for r in bound), bound

    dlq = wait_for(lambda: (m := read_topic(settings, topic + ".dlq")) and len(m) >= 3 and m,
                   30, "three dead letters", procs.logs)
    reasons = sorted(dict(m.headers())["dlq_reason_code"].decode() for m in dlq)
    assert reasons == ["document_hash_mismatch", "idempotency_key_conflict", "not_json"], reasons
    assert all(dict(m.headers())["dlq_reason"] for m in dlq)
    assert count(settings, "SELECT count(*) AS n FROM dead_letter") == 0  # the DLQ took them


@pytest.mark.parametrize("fault", ["intake_batch_before_commit",
                                   "stage_after_commit_before_offset@3"])
def test_worker_killed_mid_batch_loses_nothing_and_duplicates_nothing(
        settings: Settings, procs: ProcessRunner, fault: str) -> None:
    topic = settings.topic("document.uploaded")
    docs = [_uploaded(f"k{i}", f"document number {i}, killed mid-batch") for i in range(30)]
    produce_raw(settings, topic, [_kv(d) for d in docs] + [_kv(d) for d in docs[::6]])

    first = procs.start("worker", "--stages", "intake", JOBSTREAM_FAULT=fault)
    wait_for(lambda: first.popen.poll() is not None, 90, f"the worker to kill itself at {fault}",
             procs.logs)
    assert "[fault]" in first.log_text(), first.log_text()[-3000:]
    at_kill = count(settings, "SELECT count(*) AS n FROM job")
    if fault.startswith("intake_batch_before_commit"):
        assert at_kill == 0  # the first batch never committed
    else:
        assert at_kill >= 1  # a batch committed; its offsets were not

    second = procs.start("worker", "--stages", "intake")
    wait_for(lambda: _drained(settings), 120, "document.uploaded consumed and committed",
             procs.logs, every_s=1.0)
    assert_each_document_accepted_once(settings, [d.idempotency_key for d in docs])
    if not fault.startswith("intake_batch_before_commit"):
        # The committed batch came again and was a replay.
        assert "dedup='replayed'" in second.log_text(), second.log_text()[-3000:]
