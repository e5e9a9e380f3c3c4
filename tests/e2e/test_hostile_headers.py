"""Hostile HEADERS on every consumed topic, against a running worker and ``consume-ready``.

The hostile corpus (``test_hostile_corpus.py``) varies keys and values; this one varies what a
producer can put in headers: a header name that is not UTF-8, a forged ``retry_not_before_ms``
too large for a float, duplicated and null headers, a binary ``traceparent``, a large header.
Each message must be dead-lettered (listed by ``jobstream dlq list``) or processed; no agent
crashes, no partition is blocked (consumer lag 0), a good document still goes through.

A header name that is not UTF-8 cannot be produced with confluent-kafka (it writes ``str(key)``
for a bytes name), so it is produced with aiokafka's pure-Python record builder and a name
object that encodes to invalid UTF-8.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from jobstream.kafka import STAGE_TOPICS
from jobstream.settings import Settings
from schemas.events import DocumentRef, DocumentUploaded, DocumentUploadedPayload, encode_event
from tests.helpers import ProcessRunner, query, wait_for, wait_pipeline_drained

pytestmark = pytest.mark.e2e

#: Produces the messages given as JSON on stdin (hex key/value/header values) with aiokafka's
#: pure-Python records, so a header name may be any bytes (``{"hex": ...}``).
_PRODUCER = r"""
import asyncio, json, sys
from aiokafka import AIOKafkaProducer

class RawName(str):
    def __new__(cls, raw):
        obj = super().__new__(cls, raw.decode("latin-1"))
        obj.raw = raw
        return obj
    def encode(self, *a, **k):
        return self.raw

async def main():
    spec = json.load(sys.stdin)
    p = AIOKafkaProducer(bootstrap_servers=spec["bootstrap"], max_request_size=4 * 1024 * 1024)
    await p.start()
    try:
        for m in spec["messages"]:
            headers = [(RawName(bytes.fromhex(k)), None if v is None else bytes.fromhex(v))
                       for k, v in m["headers"]]
            await p.send_and_wait(m["topic"], key=bytes.fromhex(m["key"]),
                                  value=bytes.fromhex(m["value"]), headers=headers)
    finally:
        await p.stop()

asyncio.run(main())
"""


def _produce_raw(settings: Settings, messages: list[dict[str, Any]]) -> None:
    spec = {"bootstrap": settings.kafka_bootstrap_servers, "messages": [
        {"topic": m["topic"], "key": m["key"].hex(), "value": m["value"].hex(),
         "headers": [(k.hex(), None if v is None else v.hex()) for k, v in m["headers"]]}
        for m in messages]}
    env = {**os.environ, "AIOKAFKA_NO_EXTENSIONS": "1"}
    out = subprocess.run([sys.executable, "-c", _PRODUCER], input=json.dumps(spec).encode(),
                         env=env, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]


def _bad_messages(settings: Settings) -> list[dict[str, Any]]:
    topics = ([settings.topic(t) for t in STAGE_TOPICS]
              + [settings.topic(t + ".retry") for t in STAGE_TOPICS]
              + [settings.topic("job.ready")])
    kinds: dict[str, list[tuple[bytes, bytes | None]]] = {
        "name_not_utf8": [(b"\xff\xfe-name", b"v")],
        "not_before_over_float": [(b"retry_not_before_ms", b"9" * 400),
                                  (b"retry_count", b"1")],
        "retry_count_huge": [(b"retry_count", b"9" * 400)],
        "dup_null_binary": [(b"traceparent", bytes(range(256))), (b"traceparent", None),
                            (b"job_id", b"\x00\xff"), (b"job_id", b"x"), (b"", b""),
                            (b"nullvalue", None)],
        "large_header": [(b"big", b"h" * 300_000)],
    }
    out = []
    for topic in topics:
        for kind, headers in kinds.items():
            label = f"{topic}|{kind}"
            out.append({"topic": topic, "key": f"bad-{kind}".encode(), "label": label,
                        "value": b"not json at all",
                        "headers": [*headers, (b"corpus", label.encode())]})
    return out


def topics_of(msgs: list[dict[str, Any]]) -> set[str]:
    return {m["topic"] for m in msgs}


def _good_doc() -> DocumentUploaded:
    data = b"A good document after hostile headers. It mentions Kafka and Postgres. " * 5
    return DocumentUploaded(
        tenant_id="headers-good", idempotency_key="good-after-headers",
        payload=DocumentUploadedPayload(document=DocumentRef(
            filename="good.txt", sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data), content_b64=base64.b64encode(data).decode())))


def test_hostile_headers_on_every_consumed_topic(settings: Settings,
                                                  procs: ProcessRunner) -> None:
    started = procs.pipeline(JOBSTREAM_DLQ_PRODUCE_TIMEOUT_S="5")
    bad = _bad_messages(settings)
    good = _good_doc()
    # Written straight to a DLQ: `jobstream dlq list` must read it, not crash.
    direct = {"topic": settings.topic("job.ready.dlq"), "key": b"direct-on-dlq",
              "value": b"x", "headers": [(b"\xff-direct", b"v"),
                                         (b"dlq_reason_code", b"not_json")]}
    _produce_raw(settings, [*bad, direct, {
        "topic": settings.topic("document.uploaded"), "key": good.idempotency_key.encode(),
        "value": encode_event(good), "headers": []}])
    url = settings.database_url
    wait_for(lambda: query(url, "SELECT 1 FROM job WHERE tenant_id = 'headers-good' "
                                "AND status = 'succeeded'"), 120,
             "the good document succeeded", procs.logs, every_s=1.0)

    # confluent-kafka cannot read ANY header of a message with a non-UTF-8 header name
    # (consume-ready): it is processed without them, its dead letter says so.
    unreadable = settings.topic("job.ready") + "|name_not_utf8"
    wanted = {m["label"] for m in bad} - {unreadable}
    listed: list[dict[str, Any]] = []

    def all_listed() -> bool:
        nonlocal listed
        out = procs.run("dlq", "list", "--json", "--limit", "5000", timeout_s=120)
        assert out.returncode == 0, out.stderr[-3000:]
        listed = json.loads(out.stdout)
        return wanted <= {(r.get("headers") or {}).get("corpus") for r in listed} and any(
            "headers_unreadable" in (r.get("headers") or {}) for r in listed) and any(
            r.get("key") == "direct-on-dlq" for r in listed)

    wait_for(all_listed, 120, "every message with hostile headers dead-lettered",
             lambda: str(sorted(wanted - {(r.get("headers") or {}).get("corpus")
                                          for r in listed}))[:3000] + procs.logs(),
             every_s=3.0)
    # A null header value stays null in the dead letter (it was written as b"None").
    nulls = [(r.get("headers") or {}) for r in listed
             if str((r.get("headers") or {}).get("corpus")).endswith("|dup_null_binary")]
    assert len(nulls) >= len(topics_of(bad)) and all(
        "nullvalue" in h and h["nullvalue"] is None for h in nulls), nulls[:3]
    wait_pipeline_drained(settings, procs)
    time.sleep(1.0)
    for p in started.values():
        text = p.log_text()
        assert p.popen.poll() is None, f"{p.name} exited\n{text[-3000:]}"
        assert "Traceback" not in text, f"{p.name}\n{text[-5000:]}"
        assert "crashed" not in text.lower(), f"{p.name}\n{text[-5000:]}"
