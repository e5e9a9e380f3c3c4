"""The msgspec fast path of ``job.ready`` (schemas/fastpath.py) against pydantic, the reference:
whatever the fast path accepts, pydantic accepts with the same values (equal models, the same
JSON, the same ``model_fields_set``), so ``decode_event`` gives every input the outcome and
reason code it gave before. Valid events, edge cases of each field, and hypothesis-mutated
events; and the two schemas' fields and bounds compared, so a change to ``JobReady`` that is
not made in the fast path fails here. The light form (``decode_ready``: the checked struct,
no model) is held to the same: a struct exactly when a model, ``to_model`` of it equal to the
model, the ready applier's rows from it byte for byte those from the model, and
``decode_event(..., light=...)`` giving every input the outcome it gives without."""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from jobstream.ready_applier import copy_rows
from schemas import fastpath
from schemas.errors import PoisonMessage
from schemas.events import (
    _ADAPTER,
    DocumentAnalysis,
    JobReady,
    JobReadyPayload,
    as_model,
    decode_event,
    encode_event,
)


def _ready(**over: Any) -> dict[str, Any]:
    ev = JobReady(
        tenant_id="acme",
        idempotency_key="k-1",
        job_id=uuid.uuid4(),
        dedup_key="ab" * 32,
        payload=JobReadyPayload(
            result=DocumentAnalysis(
                title="MIT licence",
                summary="A permissive licence.",
                keywords=["mit", "licence"],
                word_count=170,
                chunk_count=1,
                fields={"licence_name": "MIT", "years": ["2024"], "version": 2},
            ),
            document_sha256="0f" * 32,
            filename="LICENSE.txt",
            cost_usd=0.0012,
            charge_usd=0.5,
        ),
    )
    doc: dict[str, Any] = json.loads(encode_event(ev))
    doc.update(over)
    return doc


def _pydantic(raw: bytes) -> Any:
    try:
        return _ADAPTER.validate_json(raw)
    except ValidationError:
        return None


def _rows(ev: Any) -> Any:
    """``copy_rows(ev)``, or the type of what it raised (a lone surrogate, a charge that is
    not finite)."""
    try:
        return copy_rows(ev)
    except (UnicodeEncodeError, ValueError) as exc:
        return type(exc)


def _outcome(raw: bytes, **kw: Any) -> Any:
    """``decode_event(raw, "job.ready", **kw)`` as the model, or the refusal's code."""
    try:
        return as_model(decode_event(raw, "job.ready", **kw))
    except PoisonMessage as exc:
        return exc.code


def _same(raw: bytes) -> Any:
    """Decode ``raw`` both ways; assert the fast path accepted only what pydantic accepts,
    with equal models. Returns the fast path's event (or None)."""
    assert _outcome(raw, light=("job.ready",)) == _outcome(raw)
    fast = fastpath.decode_job_ready(raw)
    light = fastpath.decode_ready(raw)
    assert (light is None) == (fast is None), raw
    if fast is None:
        return None
    assert light is not None
    assert as_model(light) == fastpath.to_model(light) == fast
    assert as_model(fast) is fast
    assert _rows(light) == _rows(fast)
    ref = _pydantic(raw)
    assert ref is not None, f"fast path accepted what pydantic refuses: {raw!r}"
    assert fast == ref
    assert type(fast) is type(ref) is JobReady
    assert fast.model_dump_json() == ref.model_dump_json()
    assert fast.model_dump() == ref.model_dump()

    def parts(m: BaseModel) -> list[BaseModel]:
        return [m, m.payload, m.payload.result]  # type: ignore[attr-defined]

    for a, b in zip(parts(fast), parts(ref), strict=True):
        assert a.model_fields_set == b.model_fields_set
        assert list(a.__dict__) == list(b.__dict__)
        for name, value in a.__dict__.items():
            assert type(value) is type(b.__dict__[name]) or name == "occurred_at", name
    assert fast.occurred_at.utcoffset() == ref.occurred_at.utcoffset()
    with pytest.raises(ValidationError):  # frozen like the validated one
        fast.tenant_id = "x"  # type: ignore[misc]
    return fast


def test_valid_events_take_the_fast_path_with_equal_models() -> None:
    for doc in (
        _ready(),
        _ready(generation=3),
        _ready(request_id=""),
        _ready(occurred_at="2026-12-01T10:00:00+02:00"),
        _ready(occurred_at="2026-12-01T10:00:00.5Z"),
        _ready(occurred_at="2026-12-01 10:00:00"),
        _ready(occurred_at="2026-12-01T10:00:00.123456-00:30"),
    ):
        raw = json.dumps(doc).encode()
        assert _same(raw) is not None, doc
        assert decode_event(raw, "job.ready") == _pydantic(raw)


# Values each field gets in turn: the fast path may refuse any, but must never accept one
# pydantic refuses, nor accept one with another value.
EDGE: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    1.0,
    5.0,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    1e400,
    1.5,
    "",
    "x",
    "x\n",
    "\n",
    "a\tb",
    "\x7f",
    "\x85",
    "\u00a0",
    "\u2028",
    "é",
    "ab" * 32,
    "ab" * 32 + "\n",
    "AB" * 32,
    "ab" * 31,
    "0f" * 32,
    "acme\n",
    "ac me",
    "a" * 200,
    "a" * 201,
    "a" * 513,
    "2026-12-01T10:00:00Z",
    "2026-12-01T10:00:00.1234567Z",
    "2026-12-01T10:00:00.9999995Z",
    "2026-12-01T10:00:00.123456789+01:00",
    "2026-12-01",
    "2026-12-01T10:00Z",
    "2026-12-01T10:00:00,5Z",
    "2026-12-01T24:00:00Z",
    "2026-12-01t10:00:00z",
    "2026-12-01T10:00:00+0100",
    "2026-12-01T23:59:60Z",
    "1764583200",
    str(uuid.uuid4()),
    uuid.uuid4().hex,
    "{" + str(uuid.uuid4()) + "}",
    "urn:uuid:" + str(uuid.uuid4()),
    str(uuid.uuid4()).upper(),
    [],
    ["a"],
    ["a"] * 21,
    {},
    {"a": 1},
    {"a": [1]},
    {"a": True},
    {"a": 2**64},
    {"a": None},
    {"a": 1.0},
    "job.ready",
    "job.failed",
    999_999.99999999,
    999_999.999999995,
    1e6,
    -0.0,
    0.0,
    10**30,
]
FIELDS: list[tuple[str, ...]] = (
    [(name,) for name in _ready() if name != "payload"]
    + [("payload", name) for name in _ready()["payload"] if name != "result"]
    + [("payload", "result", name) for name in _ready()["payload"]["result"]]
)


def _set(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for step in path[:-1]:
        doc = doc[step]
    doc[path[-1]] = value


@pytest.mark.parametrize("path", FIELDS, ids=".".join)
def test_edge_values_of_each_field(path: tuple[str, ...]) -> None:
    for value in EDGE:
        doc = _ready()
        _set(doc, path, value)
        _same(json.dumps(doc).encode())
    doc = _ready()
    target = doc
    for step in path[:-1]:
        target = target[step]
    del target[path[-1]]  # missing: pydantic's default (or its error), never the fast path
    assert fastpath.decode_job_ready(json.dumps(doc).encode()) is None


def test_raw_texts_the_parsers_could_read_differently() -> None:
    good = json.dumps(_ready())
    for raw in (
        good.replace('"tenant_id"', '"tenant_id": "evil", "tenant_id"', 1),  # duplicate key
        good.replace('"acme"', '"acme", "extra": 1', 1),  # an unknown field
        good.replace('"acme"', '"\\u0061cme"', 1),  # an escaped letter
        good.replace('"k-1"', '"k-\\ud800"', 1),  # a lone surrogate
        good.replace('"k-1"', '"k-\\ud83d\\ude00"', 1),  # a pair
        good.replace('"tenant_id"', '"tenant\\u005fid"', 1),  # an escaped key
        good.replace('"schema_version": 1', '"schema_version": 1.0', 1),
        good.replace('"schema_version": 1', '"schema_version": true', 1),
        good.replace('"generation": 0', '"generation": 0.0', 1),
        good.replace('"generation": 0', '"generation": -0', 1),
        good.replace('"charge_usd": 0.5', '"charge_usd": 5e-1', 1),
        good.replace('"charge_usd": 0.5', '"charge_usd": 1', 1),
        good.replace('"charge_usd": 0.5', '"charge_usd": NaN', 1),
        good.replace('"charge_usd": 0.5', '"charge_usd": Infinity', 1),
        good + "\n",
        " " + good,
        good + "x",
        "\ufeff" + good,
        good[:-1],
    ):
        _same(raw.encode())
    for raw_bytes in (good.encode().replace(b"acme", b"ac\xffe"), good.encode("utf-16")):
        _same(raw_bytes)


json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=70)
    | st.sampled_from(EDGE)
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(FIELDS), json_values), max_size=3))
def test_mutated_events_accepted_only_as_pydantic_accepts(changes: list[Any]) -> None:
    doc = _ready()
    for path, value in changes:
        _set(doc, path, value)
    _same(json.dumps(doc).encode())


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_bytes_accepted_only_as_pydantic_accepts(data: st.DataObject) -> None:
    raw = bytearray(json.dumps(_ready()).encode())
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at : at + 1] = data.draw(st.binary(min_size=0, max_size=2))
    _same(bytes(raw))


def _bounds(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


@pytest.mark.parametrize(
    ("model", "struct"),
    [
        (JobReady, fastpath.Ready),
        (JobReadyPayload, fastpath.ReadyPayload),
        (DocumentAnalysis, fastpath.Analysis),
    ],
    ids=["JobReady", "payload", "result"],
)
def test_the_fast_path_schema_is_as_strict_as_the_models(
    model: type[BaseModel], struct: type[Any]
) -> None:
    """Same fields; every bound of the model's JSON Schema is met by the struct's (equal or
    stricter); every pattern is one the fast path checks itself (PATTERNS)."""
    assert list(model.model_fields) == list(struct.__struct_fields__)
    ref = model.model_json_schema()
    (fast,), fast_defs = msgspec.json.schema_components([struct])
    fast = fast_defs[struct.__name__]
    assert set(fast["required"]) == set(model.model_fields)  # no default taken here
    assert fast_defs[struct.__name__].get("additionalProperties") is False
    for name, prop in ref["properties"].items():
        got = _bounds(fast["properties"][name], fast_defs)
        for low in ("minLength", "minimum", "minItems"):
            if low in prop:
                assert got.get(low, -1) >= prop[low], (name, low)
        for high in ("maxLength", "maximum", "maxItems"):
            if high in prop:
                assert got.get(high, float("inf")) <= prop[high], (name, high)
        if "pattern" in prop:
            assert (model.__name__, name) in PATTERNS, (name, prop["pattern"])
            assert PATTERNS[(model.__name__, name)] == prop["pattern"], name
        if "const" in prop:
            assert got.get("enum") == [prop["const"]], name
        elif "type" in prop:
            assert got.get("type") == prop["type"], name


#: The patterns the fast path checks in Python (decode_job_ready), as the models state them.
PATTERNS = {
    ("JobReady", "tenant_id"): r"^[A-Za-z0-9._:-]+$",
    ("JobReady", "idempotency_key"): r"^[^\x00-\x1f\x7f-\x9f]*$",
    ("JobReady", "request_id"): r"^[^\x00-\x1f\x7f-\x9f]*$",
    ("JobReady", "dedup_key"): r"^[0-9a-f]{64}$",
    ("JobReadyPayload", "document_sha256"): r"^[0-9a-f]{64}$",
    ("JobReadyPayload", "filename"): r"^[^\x00-\x1f\x7f-\x9f]*$",
}


@pytest.mark.parametrize(
    "path", [("payload", "result", "title"), ("payload", "result", "fields"), ("request_id",)]
)
def test_a_nul_escape_is_refused_before_the_fast_path(path: tuple[str, ...]) -> None:
    """The fast path (like pydantic) would take U+0000 in a title; decode_event refuses it
    first (Postgres text cannot store it), whatever the field."""
    doc = _ready()
    _set(doc, path, {"k": "a\u0000b"} if path[-1] == "fields" else "a\u0000b")
    raw = json.dumps(doc).encode()
    assert b"\\u0000" in raw
    with pytest.raises(PoisonMessage) as caught:
        decode_event(raw, "job.ready")
    assert caught.value.code == "schema_violation"
