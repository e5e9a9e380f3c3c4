"""Keys, event contracts and the committed JSON Schema files (no services needed)."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest

from jobstream.errors import PoisonMessage
from jobstream.keys import canonical_json, dedup_key, request_hash
from schemas.events import DocumentRef, DocumentUploaded, DocumentUploadedPayload, decode_event
from schemas.generate import main as generate_main

BASE = {"tenant_id": "acme", "document_hash": "a" * 64, "pipeline": "document-analysis",
        "prompt_version": "analysis-v1", "model_profile": "local", "extractor": "text"}


def test_dedup_key_is_sha256_of_canonical_json_of_the_six_fields() -> None:
    expected = hashlib.sha256(
        b'{"document_hash":"' + b"a" * 64 + b'","extractor":"text","model_profile":"local",'
        b'"pipeline":"document-analysis","prompt_version":"analysis-v1","tenant_id":"acme"}'
    ).hexdigest()
    assert dedup_key(**BASE) == expected


@pytest.mark.parametrize("field,value", [("tenant_id", "other"), ("prompt_version", "analysis-v2"),
                                         ("model_profile", "openai"), ("document_hash", "b" * 64),
                                         ("pipeline", "p2"), ("extractor", "pypdf")])
def test_dedup_key_changes_with_every_computational_input(field: str, value: str) -> None:
    assert dedup_key(**{**BASE, field: value}) != dedup_key(**BASE)


def test_request_hash_covers_lane_filename_and_content_type_but_not_the_tenant() -> None:
    body = {k: v for k, v in BASE.items() if k not in ("tenant_id", "extractor")}
    body |= {"filename": "a.txt", "content_type": "text/plain"}
    base = request_hash(**body, lane="interactive")
    assert request_hash(**body, lane="batch") != base
    assert request_hash(**{**body, "filename": "b.txt"}, lane="interactive") != base
    assert request_hash(**{**body, "content_type": "application/pdf"}, lane="interactive") != base


def test_canonical_json_is_order_independent() -> None:
    assert canonical_json({"b": 1, "a": [1, "é"]}) == canonical_json({"a": [1, "é"], "b": 1})


def _uploaded(**kw: object) -> DocumentUploaded:
    doc = DocumentRef(filename="a.txt", sha256="0" * 64, size_bytes=1, content_b64="YQ==")
    return DocumentUploaded(tenant_id="acme", idempotency_key="k",
                            payload=DocumentUploadedPayload(document=doc), **kw)


def test_transport_fields_differ_but_decode_round_trips() -> None:
    a, b = _uploaded(), _uploaded()
    assert a.event_id != b.event_id
    back = decode_event(a.model_dump_json().encode(), expected="document.uploaded")
    assert back == a


@pytest.mark.parametrize("raw,code", [
    (b"not json", "not_json"),
    (b"", "empty"),
    (b'{"event_type": "document.uploaded"}', "schema_violation"),
    (b'{"event_type": "job.ready"}', "unexpected_event_type"),
    (b"[1, 2]", "schema_violation"),
    (b"\xff\xfe", "not_json"),
])
def test_poison_messages_are_classified_with_a_reason(raw: bytes, code: str) -> None:
    with pytest.raises(PoisonMessage) as exc:
        decode_event(raw, expected="document.uploaded")
    assert exc.value.code == code
    assert str(exc.value)


def test_missing_tenant_names_the_field() -> None:
    obj = json.loads(_uploaded().model_dump_json())
    del obj["tenant_id"]
    with pytest.raises(PoisonMessage, match="tenant_id"):
        decode_event(json.dumps(obj))


def test_extra_fields_are_rejected_frozen_contract() -> None:
    obj = json.loads(_uploaded().model_dump_json())
    obj["surprise"] = 1
    with pytest.raises(PoisonMessage, match="surprise"):
        decode_event(json.dumps(obj))


def test_document_ref_needs_exactly_one_source() -> None:
    with pytest.raises(ValueError):
        DocumentRef(filename="a", sha256="0" * 64, size_bytes=1)
    with pytest.raises(ValueError):
        DocumentRef(filename="a", sha256="0" * 64, size_bytes=1, content_b64="YQ==",
                    uri="file:///x")


def test_committed_json_schemas_match_the_models() -> None:
    assert generate_main(["--check"]) == 0, "run: python -m schemas.generate"


def test_job_ids_are_uuids_in_job_events() -> None:
    from schemas.events import JobFailed, JobFailedPayload
    ev = JobFailed(tenant_id="t", idempotency_key="k", job_id=uuid.uuid4(), dedup_key="f" * 64,
                   payload=JobFailedPayload(stage="llm", error_code="x", error="y"))
    assert decode_event(ev.model_dump_json()).job_id == ev.job_id


def test_file_uris_are_read_only_under_the_document_roots(tmp_path) -> None:
    inside = tmp_path / "ok dir" / "a.txt"
    inside.parent.mkdir()
    inside.write_bytes(b"hello")
    ref = DocumentRef(filename="a.txt", sha256="0" * 64, size_bytes=5,
                      uri="file://" + str(inside).replace(" ", "%20"))
    assert ref.content([str(tmp_path)]) == b"hello"
    with pytest.raises(PermissionError):
        ref.content([])  # no roots configured: refused
    sneaky = DocumentRef(filename="p", sha256="0" * 64, size_bytes=1,
                         uri=f"file://{tmp_path}/../../etc/passwd")
    with pytest.raises(PermissionError):
        sneaky.content([str(tmp_path)])


def test_a_message_without_event_type_is_read_as_the_topics_type() -> None:
    obj = json.loads(_uploaded().model_dump_json())
    del obj["event_type"]  # optional in the published schema: it has a default
    assert decode_event(json.dumps(obj), expected="document.uploaded").event_type == \
        "document.uploaded"
    del obj["payload"]
    with pytest.raises(PoisonMessage) as exc:  # the real reason is reported, not the type
        decode_event(json.dumps(obj), expected="document.uploaded")
    assert exc.value.code == "schema_violation" and "payload" in str(exc.value)


@pytest.mark.parametrize("path", [("payload", "document", "filename"), ("idempotency_key",),
                                  ("request_id",), ("payload", "pipeline"),
                                  ("payload", "prompt_version"), ("payload", "model_profile")])
@pytest.mark.parametrize("char", ["\x00", "\x07", "\n", "\x7f", "\x85"])
def test_control_characters_in_identifiers_and_filenames_are_schema_violations(
        path: tuple[str, ...], char: str) -> None:
    obj = json.loads(_uploaded().model_dump_json())
    node = obj
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = f"a{char}b"
    with pytest.raises(PoisonMessage) as exc:
        decode_event(json.dumps(obj).encode(), expected="document.uploaded")
    assert exc.value.code == "schema_violation"


def test_file_uri_reads_are_bounded_and_regular_files_only(tmp_path) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 5000)
    ref = DocumentRef(filename="big.txt", sha256="0" * 64, size_bytes=10, uri=f"file://{big}")
    assert len(ref.content([str(tmp_path)], max_bytes=100)) == 101  # never the whole file
    fifo = tmp_path / "fifo"
    import os
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="regular file"):
        DocumentRef(filename="f", sha256="0" * 64, size_bytes=1,
                    uri=f"file://{fifo}").content([str(tmp_path)])
