"""examples/downstream_service against real Kafka + Postgres, as a separate process: its own
schema, 1,000 ``job.ready`` with 30 % duplicates and one poison message -> exactly 700 ledger
rows, the poison on ``job.ready.dlq``, a graceful stop on SIGTERM. Its code imports nothing
from jobstream (tests/unit/test_consumer_library.py checks that too)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import DocumentAnalysis, JobReady, JobReadyPayload, encode_event
from tests.helpers import processed_rows, query, read_topic, wait_for

pytestmark = pytest.mark.integration
ROOT = Path(__file__).parents[2]
SCHEMA = "billing_example"


def _ready(i: int) -> JobReady:
    return JobReady(
        tenant_id=f"tenant-{i % 7}", idempotency_key=f"k{i}", job_id=uuid.uuid4(),
        dedup_key=uuid.uuid4().hex * 2,
        payload=JobReadyPayload(
            result=DocumentAnalysis(title="t", summary="s", keywords=["a"], word_count=1,
                                    chunk_count=1, fields={}),
            document_sha256="a" * 64, filename=f"doc-{i}.pdf", cost_usd=0.0,
            charge_usd=0.01))


def _ledger(settings: Settings) -> int:
    return query(settings.database_url,
                 f"SELECT count(*) AS n FROM {SCHEMA}.ledger")[0]["n"]  # noqa: S608 - constant


def test_example_service_charges_each_job_ready_once(settings: Settings, tmp_path: Path) -> None:
    events = [_ready(i) for i in range(700)]
    msgs = [(str(e.job_id).encode(), encode_event(e)) for e in events]
    rng = random.Random(8)
    msgs += rng.sample(msgs, 300)  # 300 duplicates: redeliveries of the same events
    rng.shuffle(msgs)
    msgs.insert(rng.randrange(len(msgs)), (b"poison", b"{not json"))
    assert len(msgs) == 1001
    produce_raw(settings, settings.topic("job.ready"), msgs)

    env = {**os.environ,
           "JOBSTREAM_CONSUMER_BOOTSTRAP_SERVERS": settings.kafka_bootstrap_servers,
           "JOBSTREAM_CONSUMER_DSN": settings.database_url,
           "JOBSTREAM_CONSUMER_GROUP": settings.group("billing"),
           "JOBSTREAM_CONSUMER_TOPIC_PREFIX": settings.topic_prefix,
           "JOBSTREAM_CONSUMER_DB_SCHEMA": SCHEMA,
           "JOBSTREAM_CONSUMER_BATCH_SIZE": "50"}
    env.pop("JOBSTREAM_FAULT", None)
    log = tmp_path / "service.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "examples.downstream_service"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: query(settings.database_url,
                               "SELECT 1 FROM information_schema.tables WHERE table_schema = %s "
                               "AND table_name = 'ledger'", (SCHEMA,)) and _ledger(settings) >= 700,
                 180, "700 ledger rows", on_timeout=log.read_text)
        dlq = wait_for(lambda: read_topic(settings, settings.topic("job.ready.dlq")), 60,
                       "the poison message on job.ready.dlq", on_timeout=log.read_text)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert _ledger(settings) == 700
    assert query(settings.database_url,
                 f"SELECT count(DISTINCT dedup_key) AS n FROM {SCHEMA}.ledger")[0]["n"] == 700  # noqa: S608
    assert processed_rows(settings.database_url, SCHEMA) == (700, 1)  # 1 dead-lettered
    assert len(dlq) == 1
    assert dlq[0].value() == b"{not json"
    assert dict(dlq[0].headers())["dlq_reason_code"] == b"not_json"
    assert "stopped: applied=700 duplicates=300 dead_lettered=1" in log.read_text()
