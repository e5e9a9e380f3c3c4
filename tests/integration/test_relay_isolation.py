"""The relay isolates an outbox row that can never be delivered (issue 9, rows 12 and 13), with
a real relay process, a real broker and Postgres.

Row 12: a topic created with ``max.message.bytes=2000`` and one ~26 KB row among small rows.
Row 13: a row larger than the producer's ``message.max.bytes``. In both, the good rows around
the bad one reach Kafka exactly once (counted: no duplicate storm), the bad one is parked in the
``dead_letter`` table and listed by ``jobstream dlq list``, its job fails
(``undeliverable_event``, with a ``job.failed`` event), and the relay keeps running.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
import uuid
from collections import Counter

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.kafka import base_config
from jobstream.settings import Settings
from jobstream.store import Store
from schemas.events import DocumentRef, DocumentUploaded, DocumentUploadedPayload
from streams.context import StageContext
from streams.intake import handle_intake
from tests.helpers import ProcessRunner, create_limited_topic, query, read_topic, wait_for

pytestmark = pytest.mark.integration

SMALL = 25  # good rows before and after the bad one


def _job(settings: Settings) -> uuid.UUID:
    """A real job (intake), whose event the bad row pretends to be."""
    data = b"a small document"
    ev = DocumentUploaded(tenant_id="acme", idempotency_key=f"k-{uuid.uuid4().hex[:6]}",
                          payload=DocumentUploadedPayload(document=DocumentRef(
                              filename="a.txt", sha256=hashlib.sha256(data).hexdigest(),
                              size_bytes=len(data), content_b64=base64.b64encode(data).decode())))
    store = Store(settings.database_url, max_size=2)
    try:
        return handle_intake(StageContext(settings=settings, store=store), ev).job_id
    finally:
        store.close()


def _outbox(settings: Settings, topic: str, bad_size: int, job_id: uuid.UUID) -> None:
    """SMALL good rows, the bad row of ``bad_size`` bytes, SMALL good rows: one transaction,
    so the relay fetches them in one batch."""
    with psycopg.connect(settings.database_url) as conn, conn.transaction():
        for i in range(2 * SMALL + 1):
            bad = i == SMALL
            # Random padding: lz4 cannot shrink it under the topic's limit.
            pad = base64.b64encode(os.urandom(bad_size * 3 // 4 if bad else 60)).decode()
            payload = json.dumps({"n": i, "pad": pad}).encode()
            headers = {"event_type": "test.row", "n": str(i)}
            if bad:
                headers["job_id"] = str(job_id)
            conn.execute(Q["outbox_insert"], (topic, f"key-{i}", payload, Jsonb(headers),
                                              uuid.uuid4(), "test.row"))


def _create_topic(settings: Settings, name: str, max_message_bytes: int) -> None:
    admin = AdminClient(base_config(settings))
    create_limited_topic(admin, name, max_message_bytes, partitions=3)


def _check(settings: Settings, procs: ProcessRunner, topic: str, job_id: uuid.UUID,
           relay_log: str) -> None:
    url = settings.database_url
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE published_at IS NULL"), 60,
             "the outbox drained (good rows published, the bad one parked)",
             on_timeout=procs.logs)
    time.sleep(3.0)  # several relay polls: a storm would re-send the batch meanwhile
    keys = Counter(m.key().decode() for m in read_topic(settings, topic))
    expected = {f"key-{i}" for i in range(2 * SMALL + 1) if i != SMALL}
    assert set(keys) == expected, sorted(set(keys) ^ expected)
    assert set(keys.values()) == {1}, f"duplicates: {[k for k, n in keys.items() if n > 1]}"

    parked = query(url, "SELECT source, topic, reason_code, dlq_error, length(value) AS size, "
                        "job_id FROM dead_letter")
    assert len(parked) == 1, parked
    assert parked[0]["source"] == "relay" and parked[0]["topic"] == topic
    assert parked[0]["reason_code"] == "undeliverable"
    assert "MSG_SIZE_TOO_LARGE" in parked[0]["dlq_error"], parked[0]["dlq_error"]
    assert parked[0]["job_id"] == job_id

    job = query(url, "SELECT status, error_code FROM job WHERE job_id = %s", (job_id,))[0]
    assert (job["status"], job["error_code"]) == ("failed", "undeliverable_event")
    failed = [json.loads(m.value()) for m in read_topic(settings, settings.topic("job.failed"))]
    assert [f["payload"]["error_code"] for f in failed if f["job_id"] == str(job_id)] == [
        "undeliverable_event"]

    listed = procs.run("dlq", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [r for r in json.loads(listed.stdout) if r["source"] == "table"]
    assert [(r["original_topic"], r["dlq_reason_code"]) for r in rows] == [
        (topic, "undeliverable")]

    relay = next(p for p in procs.procs if p.name == "relay")
    assert relay.popen.poll() is None, "the relay exited\n" + relay.log_text()[-3000:]
    assert "Traceback" not in relay.log_text(), relay.log_text()[-3000:]
    assert relay_log in relay.log_text()


def test_row_12_a_row_the_topic_refuses_is_parked_and_the_rest_sent_once(
        settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("narrow")
    _create_topic(settings, topic, 2000)
    job_id = _job(settings)
    _outbox(settings, topic, 26_000, job_id)
    procs.start("relay")
    _check(settings, procs, topic, job_id, "parked outbox row")


def test_row_13_a_row_over_the_producer_limit_is_parked_and_the_rest_sent_once(
        settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("document.uploaded")
    job_id = _job(settings)
    _outbox(settings, topic, 300_000, job_id)
    procs.start("relay", JOBSTREAM_KAFKA_MESSAGE_MAX_BYTES="200000",
                JOBSTREAM_MAX_INLINE_DOCUMENT_BYTES="100000")
    _check(settings, procs, topic, job_id, "parked outbox row")


def test_row_13_publish_of_a_document_over_the_inline_limit_is_a_clear_error(
        settings: Settings, procs: ProcessRunner, tmp_path) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 150_000)
    out = procs.run("publish", str(big), "--tenant", "acme",
                    JOBSTREAM_MAX_INLINE_DOCUMENT_BYTES="100000")
    assert out.returncode == 2, out
    assert "JOBSTREAM_MAX_INLINE_DOCUMENT_BYTES=100000" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_row_the_client_cannot_serialise_is_parked(settings: Settings,
                                                     procs: ProcessRunner) -> None:
    topic = settings.topic("job.failed")
    with psycopg.connect(settings.database_url) as conn, conn.transaction():
        for i, headers in enumerate([{"n": "0"}, [1, 2], {"n": "2"}]):
            conn.execute(Q["outbox_insert"], (topic, f"key-{i}", b'{"n": %d}' % i,
                                              Jsonb(headers), uuid.uuid4(), "test.row"))
    relay = procs.start("relay")
    url = settings.database_url
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE published_at IS NULL"), 60,
             "the outbox drained", procs.logs)
    assert sorted(m.key() for m in read_topic(settings, topic)) == [b"key-0", b"key-2"]
    parked = query(url, "SELECT reason_code, dlq_error FROM dead_letter")
    assert len(parked) == 1 and "cannot serialise" in parked[0]["dlq_error"], parked
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text()


def test_a_retriable_delivery_error_backs_off_and_delivers_once_it_clears(
        settings: Settings, procs: ProcessRunner) -> None:
    """A row for a topic that does not exist yet fails retriably (the delivery times out): the
    rows around it are delivered once, the row stays in the outbox (neither parked nor lost),
    the relay waits longer each round instead of re-sending every second, and once the topic
    exists the row is delivered once."""
    good, missing = settings.topic("job.failed"), settings.topic("later")
    with psycopg.connect(settings.database_url) as conn, conn.transaction():
        for i in range(21):
            conn.execute(Q["outbox_insert"], (missing if i == 10 else good, f"key-{i}",
                                              b'{"n": %d}' % i, Jsonb({"n": str(i)}),
                                              uuid.uuid4(), "test.row"))
    relay = procs.start("relay", JOBSTREAM_KAFKA_EXTRA='{"message.timeout.ms": 2000}')
    url = settings.database_url
    wait_for(lambda: relay.log_text().count("re-sending the undelivered rows") >= 3, 60,
             "three delivery rounds of the missing topic's row", procs.logs)
    waits = re.findall(r"re-sending the undelivered rows in ([0-9.]+)s", relay.log_text())
    assert [float(w) for w in waits[:3]] == [0.5, 1.0, 2.0], waits
    assert [r["kafka_key"] for r in query(
        url, "SELECT kafka_key FROM outbox WHERE published_at IS NULL")] == ["key-10"]
    assert not query(url, "SELECT 1 FROM dead_letter")
    _create_topic(settings, missing, 1_000_000)
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE published_at IS NULL"), 90,
             "the row delivered once its topic exists", procs.logs)
    keys = Counter(m.key().decode() for m in read_topic(settings, good))
    assert keys == Counter({f"key-{i}": 1 for i in range(21) if i != 10}), keys
    assert [m.key() for m in read_topic(settings, missing)] == [b"key-10"]
    assert relay.popen.poll() is None
