"""The walking skeleton's guarantees on real Kafka + Postgres with real processes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from jobstream.producer import produce_raw, uploaded_event
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.integration

LICENSES = Path("/usr/share/common-licenses")


def _jobs(settings: Settings, tenant: str) -> list[dict]:
    return query(settings.database_url,
                 "SELECT job_id, status, dedup_key, error_code FROM job WHERE tenant_id = %s",
                 (tenant,))


def _applied(settings: Settings, tenant: str) -> list[dict]:
    return query(settings.database_url,
                 "SELECT dedup_key, count(*) AS n FROM downstream.document_analysis "
                 "WHERE tenant_id = %s GROUP BY dedup_key", (tenant,))


def _charges(settings: Settings, tenant: str) -> Counter:
    rows = query(settings.database_url,
                 "SELECT dedup_key FROM downstream.ledger_charge WHERE tenant_id = %s", (tenant,))
    return Counter(r["dedup_key"] for r in rows)


def test_same_document_uploaded_three_times_is_one_job_one_call_per_chunk_one_apply(
        settings: Settings, procs: ProcessRunner) -> None:
    procs.pipeline()
    ev = uploaded_event(LICENSES / "GPL-2", tenant_id="acme", idempotency_key="upload-1",
                        settings=settings)
    raw = encode_event(ev)
    # The same bytes three times (a producer retry), with pauses so they land in separate polls.
    for _ in range(3):
        produce_raw(settings, settings.topic("document.uploaded"), [(b"upload-1", raw)])

    def done() -> bool:
        jobs = _jobs(settings, "acme")
        return bool(jobs) and jobs[0]["status"] == "succeeded" and bool(_applied(settings,
                                                                               "acme"))
    wait_for(done, 90, "the job to succeed and be applied", procs.logs)
    # All three copies were consumed by intake before we count: the topic's end offsets
    # have been read by the worker group, and a grace period lets duplicates flow through.
    wait_for(lambda: len(read_topic(settings, settings.topic("job.accepted"))) >= 1, 20,
             "job.accepted on the topic")
    import time
    time.sleep(3)
    jobs = _jobs(settings, "acme")
    assert len(jobs) == 1, jobs
    job_id = jobs[0]["job_id"]
    chunks = query(settings.database_url, "SELECT idx FROM chunk WHERE job_id = %s", (job_id,))
    assert len(chunks) >= 2  # GPL-2 is ~18 KB: several chunks
    calls = query(settings.database_url,
                  "SELECT chunk_idx, count(*) AS n FROM provider_attempt WHERE job_id = %s "
                  "GROUP BY chunk_idx ORDER BY chunk_idx", (job_id,))
    assert [c["n"] for c in calls] == [1] * len(chunks), calls
    assert [r["n"] for r in _applied(settings, "acme")] == [1]
    assert list(_charges(settings, "acme").values()) == [1]
    # job.ready was published once per job, whatever the duplicates upstream did.
    ready = read_topic(settings, settings.topic("job.ready"))
    assert len({json.loads(m.value())["event_id"] for m in ready}) == 1


def test_relay_killed_after_produce_before_mark_republishes_and_downstream_applies_once(
        settings: Settings, procs: ProcessRunner) -> None:
    relay = procs.start("relay", JOBSTREAM_FAULT="relay_after_produce_before_mark:job.ready")
    procs.start("worker")
    procs.start("consume-ready")
    docs = ["BSD", "Apache-2.0", "MPL-2.0"]
    events = [uploaded_event(LICENSES / d, tenant_id="acme", idempotency_key=d,
                             settings=settings) for d in docs]
    produce_raw(settings, settings.topic("document.uploaded"),
                [(e.idempotency_key.encode(), encode_event(e)) for e in events])
    # The relay produces a batch holding job.ready rows, then SIGKILLs itself before marking.
    wait_for(lambda: relay.popen.poll() is not None, 120, "the relay to be killed",
             procs.logs)
    assert relay.popen.returncode == -9, procs.logs()
    unmarked = query(settings.database_url,
                     "SELECT count(*) AS n FROM outbox WHERE event_type = 'job.ready' "
                     "AND published_at IS NULL")[0]["n"]
    assert unmarked >= 1
    procs.start("relay", name="relay-restarted")

    def all_applied() -> bool:
        jobs = _jobs(settings, "acme")
        return (len(jobs) == 3 and all(j["status"] == "succeeded" for j in jobs)
                and len(_applied(settings, "acme")) == 3)
    wait_for(all_applied, 120, "all three jobs applied", procs.logs)
    wait_for(lambda: query(settings.database_url,
                           "SELECT count(*) AS n FROM outbox WHERE published_at IS NULL"
                           )[0]["n"] == 0, 30, "the outbox to drain")
    ready = read_topic(settings, settings.topic("job.ready"))
    per_event = Counter(json.loads(m.value())["event_id"] for m in ready)
    assert max(per_event.values()) >= 2, f"expected re-published duplicates, got {per_event}"
    import time
    time.sleep(3)  # let the downstream see every duplicate before counting
    assert sorted(r["n"] for r in _applied(settings, "acme")) == [1, 1, 1]
    assert sorted(_charges(settings, "acme").values()) == [1, 1, 1]


def test_malformed_uploads_go_to_the_dlq_with_a_reason_and_the_next_is_processed(
        settings: Settings, procs: ProcessRunner) -> None:
    procs.start("relay")
    procs.start("worker")
    good = uploaded_event(LICENSES / "BSD", tenant_id="acme", idempotency_key="k1",
                          settings=settings)
    no_tenant = json.loads(encode_event(good))
    del no_tenant["tenant_id"]
    conflict = uploaded_event(LICENSES / "CC0-1.0", tenant_id="acme", idempotency_key="k1",
                              settings=settings)
    topic = settings.topic("document.uploaded")
    produce_raw(settings, topic, [(b"x", b"this is not json {")],
                headers=[("request_id", b"req-42")])
    produce_raw(settings, topic, [(b"y", json.dumps(no_tenant).encode())])
    produce_raw(settings, topic, [(b"k1", encode_event(good))])
    produce_raw(settings, topic, [(b"k1", encode_event(conflict))])  # same key, other body

    wait_for(lambda: any(j["status"] == "succeeded" for j in _jobs(settings, "acme")), 90,
             "the valid event to be processed", procs.logs)
    dlq = wait_for(lambda: (m := read_topic(settings, topic + ".dlq")) and len(m) >= 3 and m,
                   30, "three messages on the DLQ", procs.logs)
    reasons = sorted(dict(m.headers())["dlq_reason_code"].decode() for m in dlq)
    assert reasons == ["idempotency_key_conflict", "not_json", "schema_violation"], reasons
    for m in dlq:
        h = dict(m.headers())
        assert h["dlq_reason"], "a human-readable reason travels with the message"
        assert h["dlq_original_topic"].decode() == topic
        assert int(h["dlq_original_offset"]) >= 0
    by_code = {dict(m.headers())["dlq_reason_code"].decode(): m for m in dlq}
    assert b"tenant_id" in dict(by_code["schema_violation"].headers())["dlq_reason"]
    assert by_code["not_json"].value() == b"this is not json {"  # original bytes kept
    assert dict(by_code["not_json"].headers())["request_id"] == b"req-42"  # and headers
    assert len(_jobs(settings, "acme")) == 1
