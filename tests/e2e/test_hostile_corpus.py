"""A generated corpus of hostile messages on EVERY consumed topic, against a running relay,
worker (every stage agent and its retry agent) and ``consume-ready`` (issue 9).

Every consumed topic (``document.uploaded``, each stage topic, each ``.retry`` twin,
``job.ready``) gets every kind of bad message the corpus knows (deep nesting, over-size
compressed and uncompressed, binary, invalid UTF-8, NUL and other control characters in every
string field, wrong types, unknown ``schema_version`` and ``event_type``, tombstones, a missing
key, a reused ``event_id`` with other content, a valid envelope with an invalid payload, ...),
interleaved with good messages: documents that go through the whole pipeline, and ``job.ready``
events applied directly. Each message carries a ``corpus`` header naming it.

Afterwards: every bad message is listed by ``jobstream dlq list --json`` (a DLQ topic or the
``dead_letter`` table) with a reason code that is not ``unhandled``; every good one is processed
and applied exactly once; no process crashed or logged a traceback; no stage is left
``running``; the consumer groups' lag is 0.

The processes run with ``kafka_message_max_bytes`` = 1 MiB while the test's topics accept
8 MiB, so the over-size kinds are accepted by the broker, refused by the consumers' bound, and
too large for the DLQ producer: they land in the ``dead_letter`` table (the fallback), with a
reference record on the DLQ.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Producer

from jobstream.kafka import STAGE_TOPICS, base_config
from jobstream.settings import Settings
from schemas.events import (
    ChunksReady,
    ChunksReadyPayload,
    DocumentAnalysis,
    DocumentRef,
    DocumentUploaded,
    DocumentUploadedPayload,
    JobAccepted,
    JobAcceptedPayload,
    JobReady,
    JobReadyPayload,
    LlmDone,
    LlmDonePayload,
    TextExtracted,
    TextExtractedPayload,
    Validated,
    ValidatedPayload,
    encode_event,
)
from tests.helpers import ProcessRunner, query, wait_for, wait_pipeline_drained

pytestmark = pytest.mark.e2e

LIMIT = 1024 * 1024  # the processes' kafka_message_max_bytes
ENV = {"JOBSTREAM_KAFKA_MESSAGE_MAX_BYTES": str(LIMIT),
       "JOBSTREAM_MAX_INLINE_DOCUMENT_BYTES": "700000",
       "JOBSTREAM_DLQ_PRODUCE_TIMEOUT_S": "5"}
ROW_1 = b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}"
H = "0123456789abcdef" * 4  # a valid sha256-shaped string
TENANT = "corpus-bad"
GOOD_DOCS = 4
GOOD_READY = 6


def _doc(text: str) -> DocumentRef:
    data = text.encode()
    return DocumentRef(filename="doc.txt", sha256=hashlib.sha256(data).hexdigest(),
                       size_bytes=len(data), content_b64=base64.b64encode(data).decode())


def _text(i: int) -> str:
    return (f"Report number {i} on the hostile corpus. " * 3
            + "Kafka consumers dead-letter poison messages and move on. "
              "Postgres keeps what the topic refused. ") * 4


def _job_fields() -> dict[str, Any]:
    return {"tenant_id": TENANT, "idempotency_key": "k", "job_id": uuid.uuid4(),
            "dedup_key": H}


def _templates() -> dict[str, dict[str, Any]]:
    """A schema-valid event of each consumed event type (stage events name no real job)."""
    evs = {
        "document.uploaded": DocumentUploaded(
            tenant_id=TENANT, idempotency_key="k", payload=DocumentUploadedPayload(
                document=_doc("a document that is valid on its own"))),
        "job.accepted": JobAccepted(**_job_fields(), payload=JobAcceptedPayload(
            document_sha256=H, content_type="text/plain", pipeline="document-analysis",
            prompt_version="analysis-v1", model_profile="local", lane="interactive")),
        "job.text_extracted": TextExtracted(**_job_fields(), payload=TextExtractedPayload(
            text_sha256=H, char_count=10, page_count=0)),
        "job.chunks_ready": ChunksReady(**_job_fields(), payload=ChunksReadyPayload(
            chunk_count=1, chunks_sha256=H)),
        "job.llm_done": LlmDone(**_job_fields(), payload=LlmDonePayload(
            chunk_count=1, output_sha256=H, provider_calls=1, reused=False, cost_usd=0.0)),
        "job.validated": Validated(**_job_fields(), payload=ValidatedPayload(output_sha256=H)),
        "job.ready": _ready("template", TENANT),
    }
    return {k: json.loads(encode_event(v)) for k, v in evs.items()}


def _ready(name: str, tenant: str) -> JobReady:
    return JobReady(tenant_id=tenant, idempotency_key=name, job_id=uuid.uuid4(),
                    dedup_key=hashlib.sha256(name.encode()).hexdigest(),
                    payload=JobReadyPayload(
                        result=DocumentAnalysis(title=name, summary="s", keywords=["a"],
                                                word_count=1, chunk_count=1,
                                                fields={"licence_name": "MIT"}),
                        document_sha256=H, filename=f"{name}.txt", cost_usd=0.0,
                        charge_usd=0.01))


def _string_paths(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(obj, str):
        yield path
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _string_paths(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _string_paths(v, (*path, i))


def _set(obj: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    cur: Any = out
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return out


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


class Msg:
    """One corpus message: where it goes and what it is."""

    def __init__(self, topic: str, kind: str, value: bytes | None, key: bytes | None = b"",
                 compress: bool = False) -> None:
        self.topic, self.kind, self.value, self.compress = topic, kind, value, compress
        self.label = f"{topic}|{kind}"
        self.key = f"bad-{uuid.uuid4().hex[:8]}".encode() if key == b"" else key

    @property
    def good(self) -> bool:
        return self.kind.startswith("good")


def _bad(topic: str, event_type: str, tpl: dict[str, Any]) -> list[Msg]:
    """Every bad kind for one topic whose events are ``event_type``."""
    enc = lambda d: json.dumps(d).encode()  # noqa: E731
    fresh = lambda: _set(tpl, ("event_id",), str(uuid.uuid4()))  # noqa: E731
    other_type = "job.ready" if event_type == "document.uploaded" else "document.uploaded"
    surrogate_path = (("payload", "filename") if event_type == "job.ready"
                      else ("idempotency_key",))
    out = [
        Msg(topic, "deep_nesting_row_1", ROW_1),
        Msg(topic, "deep_nesting_in_payload", enc(_set(fresh(), ("payload",), json.loads(
            "[" * 200 + "]" * 200)))),
        Msg(topic, "oversize_uncompressed", b'{"junk": "' + b"x" * (LIMIT + 150_000) + b'"}'),
        Msg(topic, "oversize_lz4_compressed", b'{"junk": "' + b"x" * (2 * LIMIT) + b'"}',
            compress=True),
        Msg(topic, "binary", random.Random(7).randbytes(300)),
        Msg(topic, "invalid_utf8", b'{"a": "\xff\xfe\xfd"}'),
        Msg(topic, "invalid_utf8_in_tenant", enc(fresh()).replace(
            TENANT.encode(), b"corpus-\xc3\x28bad", 1)),
        Msg(topic, "tombstone", None),
        Msg(topic, "empty_value", b""),
        Msg(topic, "missing_key", enc(fresh()), key=None),
        Msg(topic, "json_array", b"[]"),
        Msg(topic, "json_number", b"42"),
        Msg(topic, "json_string", b'"hello"'),
        Msg(topic, "json_null", b"null"),
        Msg(topic, "truncated_json", enc(fresh())[:60]),
        Msg(topic, "trailing_garbage", enc(fresh()) + b"}}"),
        Msg(topic, "huge_integer", b'{"n": ' + b"9" * 5000 + b"}"),
        Msg(topic, "nan_timestamp", enc(_set(fresh(), ("occurred_at",), float("nan")))),
        Msg(topic, "wrong_type_tenant_int", enc(_set(fresh(), ("tenant_id",), 42))),
        Msg(topic, "wrong_type_payload_list", enc(_set(fresh(), ("payload",), []))),
        Msg(topic, "wrong_type_event_id", enc(_set(fresh(), ("event_id",), "not-a-uuid"))),
        Msg(topic, "unknown_schema_version", enc(_set(fresh(), ("schema_version",), 2))),
        Msg(topic, "unknown_event_type", enc(_set(fresh(), ("event_type",), "job.exploded"))),
        Msg(topic, "other_topics_event_type", enc(_set(fresh(), ("event_type",), other_type))),
        Msg(topic, "missing_payload", enc({k: v for k, v in fresh().items() if k != "payload"})),
        Msg(topic, "extra_field", enc(_set(fresh(), ("surprise",), True))),
        Msg(topic, "valid_envelope_invalid_payload", enc(_set(fresh(), ("payload",),
                                                              {"unexpected": 1}))),
        # A lone surrogate (json.dumps writes it as \ud800) in a field the consumer stores.
        Msg(topic, "lone_surrogate_in_stored_text", enc(_set(
            fresh(), surrogate_path, _get(tpl, surrogate_path) + "\ud800"))),
    ]
    for path in _string_paths(tpl):
        name = ".".join(map(str, path))
        value = _get(tpl, path)
        out.append(Msg(topic, f"nul_in_{name}", enc(_set(fresh(), path,
                                                         value[:1] + "\x00" + value[1:]))))
    for path in (("tenant_id",), ("event_id",), ("occurred_at",)):
        for ch, cname in (("\x1b", "esc"), ("\x07", "bel"), ("\x7f", "del")):
            name = ".".join(map(str, path))
            out.append(Msg(topic, f"{cname}_in_{name}",
                           enc(_set(fresh(), path, _get(tpl, path)[:3] + ch))))
    if event_type == "job.ready":
        out.append(Msg(topic, "charge_out_of_numeric_range", enc(_set(
            fresh(), ("payload", "charge_usd"), 1e9))))
    elif event_type != "document.uploaded":
        out.append(Msg(topic, "valid_event_of_unknown_job", enc(fresh())))
        first = fresh()
        out.append(Msg(topic, "event_id_reused_a", enc(first)))
        out.append(Msg(topic, "event_id_reused_b_other_content", enc(
            _set(first, ("idempotency_key",), "other"))))
    else:
        out.append(Msg(topic, "unknown_pipeline", enc(_set(fresh(), ("payload", "pipeline"),
                                                           "no-such-pipeline"))))
        out.append(Msg(topic, "document_hash_mismatch", enc(_set(
            fresh(), ("payload", "document", "sha256"), H))))
        out.append(Msg(topic, "file_uri_outside_roots", enc(_set(
            _set(fresh(), ("payload", "document", "content_b64"), None),
            ("payload", "document", "uri"), "file:///etc/passwd"))))
    return out


def _corpus(settings: Settings) -> tuple[list[Msg], list[Msg]]:
    """``(messages in produce order, the good ones)``."""
    tpls = _templates()
    rng = random.Random(42)
    per_topic: dict[str, list[Msg]] = {}
    for logical in STAGE_TOPICS:
        event_type = "job.chunks_ready" if logical == "job.chunks_ready.batch" else logical
        for name in (logical, logical + ".retry"):
            per_topic[name] = _bad(settings.topic(name), event_type, tpls[event_type])
    per_topic["job.ready"] = _bad(settings.topic("job.ready"), "job.ready", tpls["job.ready"])

    good_docs = [DocumentUploaded(tenant_id="corpus-good", idempotency_key=f"good-{i}",
                                  payload=DocumentUploadedPayload(document=_doc(_text(i))))
                 for i in range(GOOD_DOCS)]
    good_ready = [_ready(f"direct-{i}", "corpus-direct") for i in range(GOOD_READY)]
    up, ready = settings.topic("document.uploaded"), settings.topic("job.ready")
    goods = ([Msg(up, f"good_doc_{i}", encode_event(e), key=e.idempotency_key.encode())
              for i, e in enumerate(good_docs)]
             + [Msg(ready, f"good_ready_{i}", encode_event(e), key=str(e.job_id).encode())
                for i, e in enumerate(good_ready)])
    for g in goods:
        lst = per_topic["document.uploaded" if g.topic == up else "job.ready"]
        lst.insert(rng.randrange(len(lst) + 1), g)
    # A reused event id with other content, produced after its original (same key, so the
    # same partition, later offset): an idempotency-key conflict on document.uploaded, an
    # event-id conflict on job.ready.
    d0 = json.loads(encode_event(good_docs[0]))
    d0["payload"]["document"] = json.loads(_doc("another document").model_dump_json())
    per_topic["document.uploaded"].append(Msg(up, "event_id_reused_other_document",
                                              json.dumps(d0).encode(), key=b"good-0"))
    r0 = json.loads(encode_event(good_ready[0]))
    r0["dedup_key"] = hashlib.sha256(b"other").hexdigest()
    per_topic["job.ready"].append(Msg(ready, "event_id_reused_other_dedup_key",
                                      json.dumps(r0).encode(),
                                      key=str(good_ready[0].job_id).encode()))
    # Interleave the topics (round robin), each topic's own order kept.
    order: list[Msg] = []
    queues = [list(v) for v in per_topic.values()]
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    return order, goods


def _produce(settings: Settings, msgs: list[Msg]) -> None:
    conf = {**base_config(settings), "message.max.bytes": 8 * 1024 * 1024,
            "linger.ms": 5}
    plain = Producer({**conf, "compression.type": "none"})
    lz4 = Producer({**conf, "compression.type": "lz4"})
    errors: list[Any] = []
    for m in msgs:
        p = lz4 if m.compress else plain
        p.produce(m.topic, key=m.key, value=m.value, headers=[("corpus", m.label.encode())],
                  on_delivery=lambda err, _m, lab=m.label: errors.append((lab, err))
                  if err else None)
        p.poll(0)
    assert plain.flush(60) == 0 and lz4.flush(60) == 0 and not errors, errors[:5]


def _listed(procs: ProcessRunner) -> list[dict[str, Any]]:
    out = procs.run("dlq", "list", "--json", "--limit", "5000", timeout_s=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_hostile_corpus_on_every_consumed_topic(settings: Settings,
                                                 procs: ProcessRunner) -> None:
    msgs, goods = _corpus(settings)
    bad = [m for m in msgs if not m.good]
    kinds = {m.kind for m in bad}
    assert len(kinds) >= 40, len(kinds)
    assert len({m.topic for m in bad}) == 2 * len(STAGE_TOPICS) + 1
    assert len({m.label for m in bad}) == len(bad), "labels must tell messages apart"
    started = procs.pipeline(**ENV)
    _produce(settings, msgs)
    url = settings.database_url

    def applied(tenant: str) -> Counter[str]:
        rows = query(url, "SELECT dedup_key FROM downstream.document_analysis "
                          "WHERE tenant_id = %s", (tenant,))
        return Counter(r["dedup_key"] for r in rows)

    wait_for(lambda: sum(applied("corpus-good").values()) >= GOOD_DOCS
             and sum(applied("corpus-direct").values()) >= GOOD_READY, 120,
             "every good message applied", procs.logs, every_s=1.0)
    wanted = {m.label for m in bad}
    listed: list[dict[str, Any]] = []

    def all_listed() -> bool:
        nonlocal listed
        listed = _listed(procs)
        return wanted <= {(r.get("headers") or {}).get("corpus") for r in listed}

    wait_for(all_listed, 120, "every bad message listed by `jobstream dlq list --json`",
             lambda: str(sorted(wanted - {(r.get("headers") or {}).get("corpus")
                                          for r in listed}))[:3000] + procs.logs(),
             every_s=3.0)
    wait_pipeline_drained(settings, procs)
    time.sleep(2.0)  # anything still in flight would show up below

    # Every bad message: listed, with a reason code, never `unhandled`.
    by_label: dict[str, list[dict[str, Any]]] = {}
    for r in listed:
        by_label.setdefault((r.get("headers") or {}).get("corpus"), []).append(r)
    codes = {}
    for m in bad:
        rows = by_label[m.label]
        assert all(r["dlq_reason_code"] for r in rows), rows
        assert not any(r["dlq_reason_code"] == "unhandled" for r in rows), rows
        codes[m.label] = rows[0]["dlq_reason_code"]
    assert not {g.label for g in goods} & set(by_label), "a good message was dead-lettered"
    # The over-size ones did not fit the DLQ: they are in the dead_letter table.
    oversize = [r for m in bad if m.kind.startswith("oversize") for r in by_label[m.label]]
    assert oversize and all(r["source"] == "table" for r in oversize), oversize[:2]
    assert {codes[m.label] for m in bad if m.kind.startswith("oversize")} == {
        "message_too_large"}
    assert {codes[m.label] for m in bad if m.kind == "deep_nesting_row_1"} == {"json_too_deep"}

    # Every good message: processed and applied exactly once.
    good_apps, direct_apps = applied("corpus-good"), applied("corpus-direct")
    assert len(good_apps) == GOOD_DOCS and set(good_apps.values()) == {1}, good_apps
    assert len(direct_apps) == GOOD_READY and set(direct_apps.values()) == {1}, direct_apps
    jobs = query(url, "SELECT status, count(*) AS n FROM job WHERE tenant_id = 'corpus-good' "
                      "GROUP BY status")
    assert [(j["status"], j["n"]) for j in jobs] == [("succeeded", GOOD_DOCS)], jobs
    assert not query(url, "SELECT job_id, stage FROM job_stage WHERE status = 'running'")

    # Nothing crashed: every process still runs, no traceback, no crashed agent.
    for p in started.values():
        text = p.log_text()
        assert p.popen.poll() is None, f"{p.name} exited\n{text[-3000:]}"
        assert "Traceback" not in text, f"{p.name}\n{text[-5000:]}"
        assert "crashed" not in text.lower(), f"{p.name}\n{text[-5000:]}"
