"""decode_event against hostile input: bounded before parsing, and for ANY bytes or JSON it
returns an event or raises PoisonMessage (with a reason code), never anything else
(property-based, hypothesis)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobstream.errors import PoisonMessage
from jobstream.kafka import CONSUMED_TOPICS
from schemas.events import (
    EVENT_TYPES,
    DocumentRef,
    DocumentUploaded,
    DocumentUploadedPayload,
    decode_event,
    encode_event,
    json_depth_exceeds,
)

CODES = {"empty", "message_too_large", "json_too_deep", "not_json", "schema_violation",
         "unexpected_event_type"}


def _good() -> dict[str, Any]:
    ev = DocumentUploaded(tenant_id="t1", idempotency_key="k1", payload=DocumentUploadedPayload(
        document=DocumentRef(filename="a.txt", sha256="0" * 64, size_bytes=1,
                             content_b64="YQ==")))
    return json.loads(encode_event(ev))


def _check(raw: bytes | str | None, expected: Any = None, **bounds: int) -> None:
    try:
        ev = decode_event(raw, expected=expected, **bounds)
    except PoisonMessage as exc:
        assert exc.code in CODES, exc.code
    else:
        assert ev.event_type in EVENT_TYPES


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=40),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2000), st.sampled_from([None, *CONSUMED_TOPICS]))
def test_arbitrary_bytes_raise_only_poison(raw: bytes, expected: str | None) -> None:
    _check(raw, expected if expected in EVENT_TYPES else None)


@settings(max_examples=300)
@given(json_values)
def test_arbitrary_json_raises_only_poison(value: Any) -> None:
    _check(json.dumps(value).encode(), "document.uploaded")


@settings(max_examples=300)
@given(st.sampled_from(["tenant_id", "idempotency_key", "request_id", "event_id",
                        "schema_version", "event_type", "occurred_at", "payload"]),
       json_values)
def test_any_envelope_field_replaced_raises_only_poison(field: str, value: Any) -> None:
    doc = _good()
    doc[field] = value
    _check(json.dumps(doc).encode(), "document.uploaded")


@settings(max_examples=200)
@given(st.sampled_from(["filename", "sha256", "content_b64", "uri", "content_type",
                        "size_bytes"]),
       st.text(alphabet=st.characters(codec="utf-8"), max_size=30) | json_values)
def test_any_document_field_replaced_raises_only_poison(field: str, value: Any) -> None:
    doc = _good()
    doc["payload"]["document"][field] = value
    _check(json.dumps(doc).encode(), "document.uploaded")


@settings(max_examples=200)
@given(st.integers(min_value=1, max_value=300), st.sampled_from(["[", "{\"a\":"]))
def test_nesting_is_refused_before_the_parser(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    raw = (opener * depth + "1" + closer * depth).encode()
    if depth > 16:
        with pytest.raises(PoisonMessage) as exc:
            decode_event(raw, max_depth=16)
        assert exc.value.code == "json_too_deep"
    else:
        _check(raw, max_depth=16)


def test_issue_row_1_the_50000_deep_value_is_json_too_deep() -> None:
    raw = b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    with pytest.raises(PoisonMessage) as exc:
        decode_event(raw, expected="document.uploaded")
    assert exc.value.code == "json_too_deep"


def test_brackets_inside_strings_are_not_nesting() -> None:
    doc = _good()
    doc["request_id"] = "[" * 150  # text, not structure
    assert not json_depth_exceeds(json.dumps(doc).encode(), 8)
    assert decode_event(json.dumps(doc).encode()).request_id == "[" * 150


def test_size_is_checked_before_parsing() -> None:
    raw = json.dumps({"junk": "x" * 5000}).encode()
    with pytest.raises(PoisonMessage) as exc:
        decode_event(raw, max_bytes=4096)
    assert exc.value.code == "message_too_large"


_FIXED_ID = uuid.UUID("8eaa3248-7f9f-4a92-a8ee-2135efb1f56e")


# A fixed uuid in the truncated JSON: the test ids must be the same in every pytest-xdist worker
@pytest.mark.parametrize("raw", [b"1" * 5000, b"\xff\xfe[", b"\x00", "\ud800".encode(
    "utf-8", "surrogatepass"), b'{"event_id": "' + str(_FIXED_ID).encode() + b'"', None, b""])
def test_odd_values_are_poison(raw: bytes | None) -> None:
    with pytest.raises(PoisonMessage):
        decode_event(raw, expected="job.ready")


def _ready_json() -> bytes:
    from schemas.events import DocumentAnalysis, JobReady, JobReadyPayload
    return encode_event(JobReady(
        tenant_id="t1", idempotency_key="k1", job_id=uuid.uuid4(), dedup_key="d" * 64,
        payload=JobReadyPayload(
            result=DocumentAnalysis(title="t", summary="s", keywords=["a"], word_count=1,
                                    chunk_count=1, fields={"years": ["2020"]}),
            document_sha256="a" * 64, filename="f", cost_usd=0.0, charge_usd=0.0)))


def test_the_deepest_valid_event_bounds_the_depth_scan() -> None:
    """decode_event validates first and scans the depth only of what fails when max_depth is
    at least VALID_EVENT_DEPTH: the deepest valid event (job.ready: envelope, payload, result,
    fields, a list) is 5 levels; an unbounded or recursive schema has no bound."""
    from schemas.events import VALID_EVENT_DEPTH, schema_depth
    assert VALID_EVENT_DEPTH == 5
    raw = _ready_json()
    assert json_depth_exceeds(raw, 4) and not json_depth_exceeds(raw, 5)
    assert decode_event(raw, expected="job.ready", max_depth=5).payload.result.fields
    with pytest.raises(PoisonMessage) as exc:  # below the bound: scanned first, as before
        decode_event(raw, expected="job.ready", max_depth=4)
    assert exc.value.code == "json_too_deep"
    assert schema_depth({"type": "object", "properties": {"a": {}}}) is None
    assert schema_depth({"type": "array", "items": {"$ref": "#/$defs/A"},
                         "$defs": {"A": {"type": "array", "items": {"$ref": "#/$defs/A"}}}}
                        ) is None
    assert schema_depth({"type": "object", "additionalProperties": False, "properties": {
        "a": {"type": "array", "items": {"type": "integer"}}}}) == 2


@pytest.mark.parametrize("nul", [False, True])
def test_too_deep_and_invalid_is_json_too_deep_whatever_else_is_wrong(nul: bool) -> None:
    """A value that fails validation is still scanned before json.loads parses it (a NUL
    escape in it too: the depth is reported first, as before the scan moved)."""
    doc = json.loads(_ready_json())
    doc["payload"]["result"]["fields"] = {"x": json.loads("[" * 70 + "]" * 70)}
    if nul:
        doc["request_id"] = "\u0000"
    with pytest.raises(PoisonMessage) as exc:
        decode_event(json.dumps(doc).encode(), expected="job.ready")
    assert exc.value.code == "json_too_deep"


def _ready() -> dict[str, Any]:
    from schemas.events import DocumentAnalysis, JobReady, JobReadyPayload
    ev = JobReady(tenant_id="t1", idempotency_key="k1", job_id=uuid.uuid4(), dedup_key="d" * 64,
                  payload=JobReadyPayload(
                      result=DocumentAnalysis(title="t", summary="s", keywords=["k"],
                                              word_count=3, chunk_count=1, fields={"n": 2}),
                      document_sha256="0" * 64, filename="a.txt", cost_usd=0.5,
                      charge_usd=0.01))
    return json.loads(encode_event(ev))


@pytest.mark.parametrize(("path", "value"), [
    (("payload", "charge_usd"), True),          # pydantic's lax mode made this 1.0
    (("payload", "charge_usd"), "1.5"),         # ... and this 1.5
    (("payload", "charge_usd"), 1_000_000),     # numeric(14, 8) cannot hold it
    (("payload", "cost_usd"), "0"),
    (("payload", "result", "word_count"), "12"),
    (("payload", "result", "word_count"), 12.0),
    (("payload", "result", "chunk_count"), True),
    (("payload", "result", "fields", "n"), True),
    (("generation",), "1"),
    (("schema_version",), True),                # Literal[1] compares by equality: True == 1
    (("schema_version",), 1.0),                 # ... and 1.0 == 1
    (("payload", "result", "word_count"), 2**63),  # beyond bigint (int8)
    (("payload", "result", "chunk_count"), 2**64),
    (("generation",), 2**63),
])
def test_lax_numbers_are_schema_violations(path: tuple[str, ...], value: Any) -> None:
    """Counts and money are JSON numbers of the right kind: what pydantic's lax mode would
    coerce (a boolean, a numeric string, 12.0 for a count) is dead-lettered with its field."""
    obj = _ready()
    assert decode_event(json.dumps(obj).encode(), "job.ready").payload.charge_usd == 0.01
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(PoisonMessage) as caught:
        decode_event(json.dumps(obj).encode(), "job.ready")
    assert caught.value.code == "schema_violation"
    assert path[-1] in str(caught.value)


@pytest.mark.parametrize("path", [("payload", "result", "word_count"), ("generation",)])
def test_a_count_may_be_as_large_as_a_bigint(path: tuple[str, ...]) -> None:
    """The bound of a count is what Postgres ``bigint`` holds (2^63 - 1), not less."""
    obj = _ready()
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = 2**63 - 1
    ev = decode_event(json.dumps(obj).encode(), "job.ready")
    value: Any = ev
    for key in path:
        value = getattr(value, key)
    assert value == 2**63 - 1


@pytest.mark.parametrize("text", [b"1e400", b"-1e400", b"NaN", b"Infinity"])
def test_non_finite_money_is_a_schema_violation(text: bytes) -> None:
    """1e400 parses as infinity and NaN/Infinity are accepted by some parsers: neither is an
    amount (USD)."""
    raw = json.dumps(_ready()).encode().replace(b'"charge_usd": 0.01', b'"charge_usd": ' + text)
    assert text in raw
    with pytest.raises(PoisonMessage) as caught:
        decode_event(raw, "job.ready")
    assert caught.value.code in ("schema_violation", "not_json")
    assert caught.value.code == "not_json" or "charge_usd" in str(caught.value)
