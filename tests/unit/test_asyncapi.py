"""The committed AsyncAPI document: generated from the models, valid AsyncAPI 3.0, and in step
with the topics and headers the code really uses (no services needed)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from jsonschema import Draft7Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from jobstream.kafka import all_topics, dlq_headers
from jobstream.settings import Settings
from jobstream.store import outbox_message
from schemas import asyncapi
from schemas.events import (
    DocumentRef,
    DocumentUploaded,
    DocumentUploadedPayload,
    JobFailed,
    JobFailedPayload,
)

SPEC = Path(__file__).parent / "data" / "asyncapi-3.0.0.schema.json"


def _doc() -> dict[str, Any]:
    return json.loads(asyncapi.OUT.read_text())


def test_committed_asyncapi_matches_the_models() -> None:
    assert asyncapi.main(["--check"]) == 0, "run: python -m schemas.asyncapi"


def test_asyncapi_document_is_valid_against_the_official_3_0_schema() -> None:
    spec = json.loads(SPEC.read_text())
    registry: Registry = Registry()
    for sub in spec.get("definitions", {}).values():
        if isinstance(sub, dict) and "$id" in sub:
            registry = registry.with_resource(
                sub["$id"], Resource.from_contents(sub, default_specification=DRAFT7))
    errors = [f"{list(e.path)}: {e.message[:200]}"
              for e in Draft7Validator(spec, registry=registry).iter_errors(_doc())]
    assert not errors, errors[:5]


def test_the_validator_does_reject_a_broken_document() -> None:
    spec = json.loads(SPEC.read_text())
    registry: Registry = Registry()
    for sub in spec.get("definitions", {}).values():
        if isinstance(sub, dict) and "$id" in sub:
            registry = registry.with_resource(
                sub["$id"], Resource.from_contents(sub, default_specification=DRAFT7))
    doc = _doc()
    doc["operations"]["send_job_ready"]["action"] = "publish"  # AsyncAPI 2 vocabulary
    assert list(Draft7Validator(spec, registry=registry).iter_errors(doc))


def test_every_topic_and_twin_is_a_channel() -> None:
    doc = _doc()
    addresses = {c["address"] for c in doc["channels"].values()}
    assert addresses == set(all_topics(Settings(topic_prefix="")))


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def test_every_reference_resolves_and_job_topics_are_keyed_by_job_id() -> None:
    doc = _doc()
    text = json.dumps(doc)
    refs = {r.split('"')[0] for r in text.split('"$ref": "')[1:]}
    for ref in refs:
        assert _resolve(doc, ref) is not None, ref
    for mid, msg in doc["components"]["messages"].items():
        key = msg["bindings"]["kafka"]["key"]
        if mid.startswith("job_") and not mid.endswith("_dlq"):
            assert key.get("format") == "uuid", mid


def test_documented_headers_are_the_ones_the_code_writes() -> None:
    job_ev = JobFailed(tenant_id="t", idempotency_key="k", job_id=uuid.uuid4(),
                       dedup_key="f" * 64,
                       payload=JobFailedPayload(stage="llm", error_code="x", error="y"))
    assert set(outbox_message("job.failed", job_ev).headers) == (
        set(asyncapi.EVENT_HEADERS) | set(asyncapi.JOB_HEADERS))
    up = DocumentUploaded(tenant_id="t", idempotency_key="k", payload=DocumentUploadedPayload(
        document=DocumentRef(filename="a", sha256="0" * 64, size_bytes=1, content_b64="YQ==")))
    assert set(outbox_message("document.uploaded", up).headers) == set(asyncapi.EVENT_HEADERS)
    assert set(dlq_headers("c", "r", "t", 0, 1, "g")) == set(asyncapi.DLQ_HEADERS)
    sink = (Path(__file__).parents[2] / "consumers" / "routing.py").read_text()
    for name in asyncapi.DLQ_OPTIONAL_HEADERS:
        assert f'"{name}"' in sink, name
    base = (Path(__file__).parents[2] / "streams" / "base.py").read_text()
    for name in asyncapi.RETRY_HEADERS:
        assert f'"{name}"' in base, name
    dlq_src = (Path(__file__).parents[2] / "jobstream" / "dlq.py").read_text()
    for name in asyncapi.REPLAY_HEADERS:
        assert name in dlq_src, name


def test_every_message_payload_names_its_own_event_model() -> None:
    """Each topic's message (and its .retry / .dlq twin) points at the model of the event
    type that topic carries — a reused loop variable once made every twin say JobFailed."""
    from schemas.events import EVENT_MODELS
    from schemas.pipeline import PIPELINE

    messages = _doc()["components"]["messages"]
    checked = 0
    for msg in messages.values():
        name = msg["name"]
        base = name.removesuffix(".retry").removesuffix(".dlq")
        model = EVENT_MODELS[PIPELINE.event_type_of(base)].__name__
        payload = msg["payload"]
        if name.endswith(".dlq"):
            assert f"the {model} schema" in payload["description"], name
        else:
            assert payload["$ref"] == f"#/components/schemas/{model}", name
        checked += 1
    assert checked >= len(EVENT_MODELS) + 5  # topics, .retry twins and .dlq twins
