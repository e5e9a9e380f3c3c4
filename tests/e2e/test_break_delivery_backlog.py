"""Breaking the faust delivery fast path (``streams/delivery.py``) where it hands over to
faust's own ``wait_first``: a stream queue that is FULL (the callback blocks) when a rebalance
suspends the flow. Real workers, Kafka and Postgres.

Thousands of ``job.validated`` events of jobs that do not exist are produced at once: the
worker fetches far faster than it settles them (each is dead-lettered ``unknown_job``, the
dead letter acknowledged before its offset may be committed), so the stream queue fills and
the fetcher's callback waits. A second worker then joins the group: the rebalance suspends the
flow while the callback waits, faust abandons it, and the partitions are split and re-read
from their committed offsets. No message may be skipped: every offset of the topic ends up in
the DLQ (at least once), the group's lag 0, both workers alive.
"""

from __future__ import annotations

import uuid

import pytest

from jobstream.kafka import group_lag
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import Validated, ValidatedPayload, encode_event
from tests.helpers import ProcessRunner, read_topic, wait_for

pytestmark = pytest.mark.e2e

N = 6000


def test_a_rebalance_while_the_stream_queue_is_full_skips_no_message(
        settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("job.validated")
    evs = [Validated(tenant_id="t", idempotency_key=f"k{i}", job_id=uuid.uuid4(),
                     dedup_key="ab" * 32, payload=ValidatedPayload(output_sha256="cd" * 32))
           for i in range(N)]
    produce_raw(settings, topic, [(str(e.job_id).encode(), encode_event(e)) for e in evs])
    first = procs.start("worker", "--stages", "publish", name="worker-a")
    wait_for(lambda: " -> " in first.log_text() or "unknown_job" in first.log_text(), 90,
             "the first worker under way", procs.logs)
    second = procs.start("worker", "--stages", "publish", name="worker-b")
    group = settings.group("jobstream-streams")
    wait_for(lambda: group_lag(settings, group, [topic]) == 0, 240,
             "every event settled and committed", procs.logs, every_s=2.0)
    source = {(m.partition(), m.offset()) for m in read_topic(settings, topic, timeout_s=60)}
    assert len(source) == N
    got = set()
    for m in read_topic(settings, topic + ".dlq", timeout_s=60):
        h = dict(m.headers())
        assert h["dlq_reason_code"] == b"unknown_job", h
        got.add((int(h["dlq_original_partition"]), int(h["dlq_original_offset"])))
    skipped = sorted(source - got)
    assert not skipped, f"{len(skipped)} messages skipped: {skipped[:10]}"
    assert "Setting newly assigned partitions" in second.log_text(), procs.logs()
    assert first.popen.poll() is None and second.popen.poll() is None, procs.logs()
